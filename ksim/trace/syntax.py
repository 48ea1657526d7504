"""The tree a trace program parses to (ksim.trace.parser builds it, the compiler
reads it).  Every node carries its span for error messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Loc


# --- expressions --------------------------------------------------------------------------
@dataclass(frozen=True)
class Expr:
    loc: Loc


@dataclass(frozen=True)
class Int(Expr):
    value: int


@dataclass(frozen=True)
class Str(Expr):
    value: str


@dataclass(frozen=True)
class Param(Int):
    """A positional parameter that reads as an integer (``$1`` given as ``5``, or
    missing: 0); ``text`` is what was given, the string ``str($1)`` is."""

    text: str = ""


@dataclass(frozen=True)
class Builtin(Expr):
    """pid, tid, cpu, nsecs, arg0..arg5, retval, func, probe."""

    name: str


@dataclass(frozen=True)
class Scratch(Expr):
    """``$name``: a variable of one probe hit."""

    name: str


@dataclass(frozen=True)
class MapRef(Expr):
    """``@name`` or ``@name[k1, k2]`` (``@`` alone is the map named "@")."""

    name: str
    keys: tuple[Expr, ...] = ()


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Unary(Expr):
    op: str
    operand: Expr


@dataclass(frozen=True)
class Ternary(Expr):
    cond: Expr
    then: Expr
    orelse: Expr


@dataclass(frozen=True)
class Call(Expr):
    name: str
    args: tuple[Expr, ...] = ()
    #: the span of the function's name alone
    name_loc: Loc | None = None


@dataclass(frozen=True)
class Cast(Expr):
    """``(TYPE)operand``: ``type`` is the C spelling, ``struct sock *``."""

    type: str
    operand: Expr


@dataclass(frozen=True)
class Field(Expr):
    """``operand.name`` or ``operand->name``."""

    operand: Expr
    name: str
    arrow: bool = False


@dataclass(frozen=True)
class Index(Expr):
    """``operand[index]`` of a pointer or an array (a map's keys are MapRef's)."""

    operand: Expr
    index: Expr


@dataclass(frozen=True)
class Deref(Expr):
    """``*operand``."""

    operand: Expr


@dataclass(frozen=True)
class SizeOf(Expr):
    """``sizeof(TYPE)`` (``type`` set) or ``sizeof(expr)``."""

    type: str | None = None
    operand: Expr | None = None


@dataclass(frozen=True)
class OffsetOf(Expr):
    """``offsetof(TYPE, a.b.c)``."""

    type: str
    path: tuple[str, ...]


@dataclass(frozen=True)
class Tuple(Expr):
    items: tuple[Expr, ...]


# --- statements -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Stmt:
    loc: Loc


@dataclass(frozen=True)
class ExprStmt(Stmt):
    expr: Expr


@dataclass(frozen=True)
class Assign(Stmt):
    """``target op value``: op is "=" or a compound "+=", "-=", ...; ``++``/``--`` are
    "+=" / "-=" of 1."""

    target: MapRef | Scratch
    op: str
    value: Expr


@dataclass(frozen=True)
class Declare(Stmt):
    """``let $name [: TYPE];`` (with a value, it parses as a Declare and an Assign)."""

    name: str
    type: str | None = None


@dataclass(frozen=True)
class While(Stmt):
    """``while (cond) { body }``; ``unroll (N)`` of a body that breaks or continues
    (``bound`` N, ``cond`` 1); ``for $i : a..b`` (``step`` increments ``$i``, run
    after each pass of the body, ``continue`` included).  At most ``bound`` passes
    (None: parser.MAX_LOOP)."""

    cond: Expr
    body: tuple[Stmt, ...]
    step: tuple[Stmt, ...] = ()
    bound: int | None = None


@dataclass(frozen=True)
class ForMap(Stmt):
    """``for ($var : @map) { body }``: the body once per entry of the map, ``$var`` the
    tuple (key, value)."""

    var: str
    map: MapRef
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class Break(Stmt):
    """``break``: the innermost loop ends here."""


@dataclass(frozen=True)
class Continue(Stmt):
    """``continue``: the innermost loop's next pass starts here."""


@dataclass(frozen=True)
class Return(Stmt):
    """``return``: the action ends here."""


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()


# --- probes ---------------------------------------------------------------------------------
#: probes whose actions the client runs (not spliced into the kernel)
CLIENT_PROVIDERS = ("BEGIN", "END", "interval")
#: probes at a function's entry whose args are typed by the kernel's BTF
FUNC_PROVIDERS = ("kfunc", "kretfunc")


@dataclass(frozen=True)
class AttachPoint:
    """``kprobe:vfs_*``, ``kretprobe:f``, ``kprobe:f+0x10``, ``interval:s:1``, ``BEGIN``,
    ``END``."""

    provider: str           # "kprobe", "kretprobe", "interval", "BEGIN", "END"
    func: str = ""
    offset: int | None = None
    text: str = ""
    loc: Loc = field(default_factory=lambda: Loc(1, 1, 2))
    #: an interval or profile probe's period
    period_ns: int | None = None
    #: a tracepoint's category (``sched`` of tracepoint:sched:sched_switch; ``func``
    #: is its name), a kfunc's module
    category: str = ""

    @property
    def wildcard(self) -> bool:
        return any(c in self.func for c in "*?[")


@dataclass(frozen=True)
class Probe:
    points: tuple[AttachPoint, ...]
    pred: Expr | None
    body: tuple[Stmt, ...]
    loc: Loc


@dataclass(frozen=True)
class Program:
    probes: tuple[Probe, ...]
    source: str
    filename: str = "stdin"
    #: the program's ``config = { ... }`` block, by ksim's name of each setting
    #: ("max_map_keys")
    config: dict[str, int] = field(default_factory=dict)
    #: ``struct NAME { TYPE FIELD; ... };`` definitions: (kind, name, [(type, field,
    #: array count or None)], where)
    records: tuple[tuple[str, str, tuple[tuple[str, str, int | None], ...], Loc], ...] = ()
    #: the headers the program includes
    includes: tuple[str, ...] = ()
    #: the values of its positional parameters ($1, ...)
    params: tuple[str, ...] = ()


__all__ = [
    "Assign", "AttachPoint", "Binary", "Break", "Builtin", "Call", "Cast", "Continue", "Declare",
    "Deref", "Expr", "ExprStmt", "Field", "ForMap", "If", "Index", "Int", "MapRef", "OffsetOf", "Param",
    "Probe", "Program", "Return", "Scratch", "SizeOf", "Stmt", "Str", "Ternary", "Tuple", "Unary",
    "While",
]
