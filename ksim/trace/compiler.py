"""From a parsed trace program to snippets, one per instrumented point.

Two passes.  :func:`analyse` walks the whole program once and decides every map's
key kinds and value kind (refusing mixtures, as bpftrace's language does), and
checks builtins and functions against the subset.  :class:`ProbeCompiler` then
lowers one probe's filter and action for one point (a function's entry for
``kprobe``, each of its returns for ``kretprobe``, an instruction for
``kprobe:f+OFF``) to a snippet::

    Frame(n, [if (!stopped)] if (filter) { statements })

Scratch variables (``$x``) and the temporaries of map accesses are the Frame's
Locals, on the snippet's stack.  ``func`` and ``probe`` are constants of the point
(map keys of kind ksym/probe hold an index into the program's table of names).
A map access whose keys are all constants is resolved before the run: the
client placed the record (:func:`ksim.trace.maps.place`) and the snippet addresses
it as a plain Var.  Other keyed accesses hash their keys and search the map's
index, claiming records with CompareExchange (see ksim.trace.maps).  BEGIN, END
and interval actions run in the client (ksim.trace.session.Interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ksim.snippets import ast
from ksim.snippets.ast import COMM_WORDS

from . import syntax as t
from .errors import Loc, TraceSemanticError, TraceUnsupported
from .events import MAX_ARGS
from .maps import (
    HI,
    LO,
    MASK,
    RESERVE_TRIES,
    SIGN,
    MapLayout,
    MapType,
    hash_keys,
    hash_tree,
    key_words,
    start_slot,
)

#: builtins, and where they mean something
BUILTINS = {"pid", "tid", "cpu", "nsecs", "retval", "func", "probe", "comm",
            *(f"arg{i}" for i in range(6))}
#: builtins of bpftrace's language outside the subset
OTHER_BUILTINS = {"kstack", "ustack", "curtask", "rand", "uid", "gid", "elapsed",
                  "username", "cgroup", "ctx", "args", "cpid", "numaid", "jiffies", "ncpus",
                  "sarg0", "sarg1", "sarg2", "sarg3", "sarg4", "sarg5", "usym", "ksym",
                  "arg6", "arg7", "arg8", "arg9", "__builtin_probe"}
AGGREGATIONS = {"count": 0, "sum": 1, "min": 1, "max": 1, "avg": 1, "hist": 1, "lhist": 4}
STATEMENTS = {"print", "clear", "delete", "exit", "printf", "time"}
OTHER_FUNCTIONS = {"stats", "join", "str", "buf", "ksym", "usym", "kaddr", "uaddr",
                   "reg", "system", "cat", "signal", "strncmp", "override", "ntop", "cgroupid",
                   "macaddr", "zero", "strftime", "path", "kstack", "ustack", "cgroup_path",
                   "bswap", "skboutput", "pton", "strcontains", "has_key", "len", "unwatch",
                   "percpu_kaddr", "errorf", "warnf", "debugf", "print_stats"}
BINOPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "%": "mod", "&": "and", "|": "or",
          "^": "xor", "<<": "shl", ">>": "sar"}
COMPARES = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
NAMED_KEYS = {"func": "ksym", "probe": "probe", "comm": "comm"}


# --- analysis --------------------------------------------------------------------------------
@dataclass
class Analysis:
    maps: dict[str, MapType] = field(default_factory=dict)
    #: whether some action calls exit()
    exits: bool = False
    #: printf formats with the kind of each argument ("int", "name" for func and
    #: probe, "comm"), numbered in program order
    formats: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


def analyse(program: t.Program) -> Analysis:
    """Every map's type, checked across the whole program; builtins and functions
    checked against the subset."""
    a = Analysis()
    for probe in program.probes:
        if probe.pred is not None:
            _check_expr(a, probe.pred)
        for stmt in _stmts(probe.body):
            _analyse_stmt(a, stmt)
    for m in a.maps.values():
        if m.kind is None:
            raise TraceSemanticError(f"Undefined map: {m.name} (it is never assigned)")
    return a


def _stmts(body: tuple[t.Stmt, ...]) -> Iterator[t.Stmt]:
    for s in body:
        yield s
        if isinstance(s, t.If):
            yield from _stmts(s.then)
            yield from _stmts(s.orelse)


def _analyse_stmt(a: Analysis, s: t.Stmt) -> None:
    if isinstance(s, t.Assign):
        _check_expr(a, s.value, allow_aggregation=isinstance(s.target, t.MapRef) and s.op == "=")
        if isinstance(s.target, t.MapRef):
            _use_map(a, s.target)
            _assign_kind(a, s.target, s.op, s.value)
    elif isinstance(s, t.If):
        _check_expr(a, s.cond)
    elif isinstance(s, t.ExprStmt):
        e = s.expr
        if isinstance(e, t.Call) and e.name in STATEMENTS:
            _check_statement_call(a, e)
        else:
            _check_expr(a, e)


def _check_printf(a: Analysis, call: t.Call) -> None:
    from .events import conversions, unknown_conversion

    if not call.args or not isinstance(call.args[0], t.Str):
        raise TraceSemanticError("printf() expects a format string first", call.loc)
    fmt, args = call.args[0].value, call.args[1:]
    bad = unknown_conversion(fmt)
    if bad is not None:
        raise TraceUnsupported(f"printf conversion {bad!r} is not supported", call.args[0].loc)
    convs = conversions(fmt)
    if len(args) != len(convs):
        which = "Too many" if len(args) > len(convs) else "Not enough"
        raise TraceSemanticError(f"printf: {which} arguments for format string", call.loc)
    if len(args) > MAX_ARGS:
        raise TraceUnsupported(f"printf() with more than {MAX_ARGS} arguments is not supported",
                               call.loc)
    for conv, arg in zip(convs, args, strict=True):
        name = arg.name if isinstance(arg, t.Builtin) and arg.name in NAMED_KEYS else None
        if conv == "s" and name is None:
            raise TraceUnsupported("printf %s of anything but comm, func or probe is not "
                                   "supported", arg.loc)
        if conv != "s" and name is not None:
            raise TraceSemanticError(f"printf: %{conv} specifier expects a value of type integer "
                                     f"({name} supplied)", arg.loc)
        _check_expr(a, arg, key=name is not None)
    kinds = printf_kinds(args)
    if key_words(kinds) > MAX_ARGS:
        raise TraceUnsupported(f"printf() with more than {MAX_ARGS} argument words (comm takes "
                               "two) is not supported", call.loc)
    if (fmt, kinds) not in a.formats:
        a.formats.append((fmt, kinds))


def printf_kinds(args: tuple[t.Expr, ...]) -> tuple[str, ...]:
    """The kind of each printf argument, as the event ring holds it: "comm", "name"
    (func, probe: an index into the names) or "int"."""
    return tuple("int" if not (isinstance(x, t.Builtin) and x.name in NAMED_KEYS)
                 else "comm" if x.name == "comm" else "name" for x in args)


def _check_statement_call(a: Analysis, call: t.Call) -> None:
    if call.name == "printf":
        _check_printf(a, call)
        return
    if call.name == "time":
        if len(call.args) > 1 or (call.args and not isinstance(call.args[0], t.Str)):
            raise TraceSemanticError("time() takes one format string, or none", call.loc)
        return
    if call.name == "exit":
        if call.args:
            raise TraceUnsupported("exit() with an exit code is not supported", call.loc)
        a.exits = True
        return
    if call.name == "print" and call.args and not isinstance(call.args[0], t.MapRef):
        if len(call.args) > 1:
            raise TraceSemanticError("print() of a value takes one argument", call.loc)
        _check_expr(a, call.args[0])
        return
    if len(call.args) != 1 or not isinstance(call.args[0], t.MapRef):
        if call.name == "print" and len(call.args) > 1:
            raise TraceUnsupported("print() with top or div arguments is not supported", call.loc)
        raise TraceSemanticError(f"{call.name}() expects a map argument", call.loc)
    ref = call.args[0]
    if call.name in ("print", "clear") and ref.keys:
        raise TraceSemanticError(f"{call.name}() expects a map with no keys, e.g. {ref.name}",
                                 ref.loc)
    if call.name == "delete" and not ref.keys and a.maps.get(ref.name) and a.maps[ref.name].keys:
        raise TraceSemanticError(f"delete() of {ref.name} needs its keys", ref.loc)
    if call.name == "delete":
        _use_map(a, ref)
    else:
        a.maps.setdefault(ref.name, MapType(ref.name))
    for k in ref.keys:
        _check_expr(a, k, key=True)


def _use_map(a: Analysis, ref: t.MapRef) -> MapType:
    kinds = tuple(NAMED_KEYS.get(k.name, "int") if isinstance(k, t.Builtin) else "int"
                  for k in ref.keys)
    for k in ref.keys:
        _check_expr(a, k, key=True)
    m = a.maps.setdefault(ref.name, MapType(ref.name))
    if m.keys is None:
        m.keys = kinds
    elif m.keys != kinds:
        raise TraceSemanticError(
            f"Argument mismatch for {ref.name}: trying to access with arguments: "
            f"[{', '.join(kinds)}] when map expects arguments: [{', '.join(m.keys)}]", ref.loc)
    return m


def _assign_kind(a: Analysis, ref: t.MapRef, op: str, value: t.Expr) -> None:
    m = a.maps[ref.name]
    kind, lhist = "int", None
    if op == "=" and isinstance(value, t.Call) and value.name in AGGREGATIONS:
        kind = value.name
        if kind == "lhist":
            lhist = tuple(_constant(x) for x in value.args[1:])
            lo, hi, step = lhist
            if step <= 0 or hi <= lo:
                raise TraceSemanticError("lhist() needs max > min and step > 0", value.loc)
            if (hi - lo) // step > 1000:
                raise TraceSemanticError("lhist() has more than 1000 buckets", value.loc)
    if m.kind is not None and (m.kind != kind or (lhist is not None and m.lhist != lhist)):
        raise TraceSemanticError(f"Type mismatch for {ref.name}: trying to assign value of type "
                                 f"'{kind}' when map already contains a value of type '{m.kind}'",
                                 value.loc)
    m.kind = kind
    if lhist is not None:
        m.lhist = lhist  # type: ignore[assignment]


def _constant(e: t.Expr) -> int:
    if isinstance(e, t.Int):
        return e.value
    if isinstance(e, t.Unary) and e.op == "-" and isinstance(e.operand, t.Int):
        return -e.operand.value
    raise TraceSemanticError("lhist() min, max and step must be integer literals", e.loc)


def _check_expr(a: Analysis, e: t.Expr, *, allow_aggregation: bool = False, key: bool = False) -> None:
    if isinstance(e, t.Int):
        if e.value >= 1 << 64:
            raise TraceSemanticError("integer literal does not fit 64 bits", e.loc)
    elif isinstance(e, t.Str):
        raise TraceUnsupported("strings are not supported here (only as a printf format, or "
                               "compared with comm)", e.loc)
    elif isinstance(e, t.Builtin):
        _check_builtin(e, key)
    elif isinstance(e, t.MapRef):
        _use_map(a, e)
    elif isinstance(e, t.Binary):
        if _comm_compare(e) is not None:
            return
        if any(isinstance(x, t.Builtin) and x.name == "comm" for x in (e.left, e.right)):
            raise TraceUnsupported("comm can only be compared (== or !=) with a string literal",
                                   e.loc)
        _check_expr(a, e.left)
        _check_expr(a, e.right)
    elif isinstance(e, t.Unary):
        _check_expr(a, e.operand)
    elif isinstance(e, t.Ternary):
        for x in (e.cond, e.then, e.orelse):
            _check_expr(a, x)
    elif isinstance(e, t.Call):
        _check_call(a, e, allow_aggregation)


def _comm_compare(e: t.Binary) -> tuple[str, int] | None:
    """(the operator, the string's words as one integer) when ``e`` is ``comm == "..."``
    or ``comm != "..."`` (either way round)."""
    if e.op not in ("==", "!="):
        return None
    for x, y in ((e.left, e.right), (e.right, e.left)):
        if isinstance(x, t.Builtin) and x.name == "comm" and isinstance(y, t.Str):
            raw = y.value.encode()[:8 * COMM_WORDS - 1]   # what a task's name can hold
            return e.op, int.from_bytes(raw.ljust(8 * COMM_WORDS, b"\0"), "little")
    return None


def _check_builtin(e: t.Builtin, key: bool) -> None:
    if e.name in NAMED_KEYS and not key:
        raise TraceUnsupported(f"{e.name} is not supported outside a map key or a printf %s"
                               + (" (or compared with a string)" if e.name == "comm" else ""),
                               e.loc)
    if e.name in BUILTINS:
        return
    if e.name in OTHER_BUILTINS:
        raise TraceUnsupported(f"builtin {e.name} is not supported", e.loc)
    raise TraceSemanticError(f"Unknown identifier: '{e.name}'", e.loc)


def _check_call(a: Analysis, e: t.Call, allow_aggregation: bool) -> None:
    name = e.name
    loc = e.name_loc or e.loc
    if name in AGGREGATIONS:
        if not allow_aggregation:
            raise TraceSemanticError(f"{name}() should be directly assigned to a map", loc)
        want = AGGREGATIONS[name]
        if name == "hist" and len(e.args) == 2:
            raise TraceUnsupported("hist() with a precision argument is not supported", loc)
        if len(e.args) != want:
            raise TraceSemanticError(f"{name}() expects {want} argument{'s' if want != 1 else ''} "
                                     f"({len(e.args)} provided)", e.loc)
        if e.args:
            _check_expr(a, e.args[0])
        return
    if name in STATEMENTS:
        raise TraceSemanticError(f"{name}() should not be used in an expression", loc)
    if name in OTHER_FUNCTIONS:
        raise TraceUnsupported(f"function {name}() is not supported", loc)
    raise TraceSemanticError(f"Unknown function: {name}", loc)


def constant_key(k: t.Expr, site: Site | None, name_index: Callable[[str], int]) -> int | None:
    """The word a map key holds when it is the same at every hit of a point: ``func``
    and ``probe`` (indexes into the program's names; only at a kernel point, ``site``)
    and integer literals.  None: computed when the action runs."""
    if isinstance(k, t.Builtin) and k.name in ("func", "probe") and site is not None:
        return name_index(site.function if k.name == "func" else site.probe)
    if isinstance(k, t.Int):
        return k.value & MASK
    return None


def map_refs(probe: t.Probe) -> Iterator[t.MapRef]:
    """Every map access of a probe (filter and action) that names keys."""
    def expr(e: t.Expr) -> Iterator[t.MapRef]:
        if isinstance(e, t.MapRef):
            if e.keys:
                yield e
            for k in e.keys:
                yield from expr(k)
        elif isinstance(e, t.Binary):
            yield from expr(e.left)
            yield from expr(e.right)
        elif isinstance(e, t.Unary):
            yield from expr(e.operand)
        elif isinstance(e, t.Ternary):
            for x in (e.cond, e.then, e.orelse):
                yield from expr(x)
        elif isinstance(e, t.Call):
            for x in e.args:
                yield from expr(x)

    if probe.pred is not None:
        yield from expr(probe.pred)
    for s in _stmts(probe.body):
        if isinstance(s, t.Assign):
            yield from expr(s.target)
            yield from expr(s.value)
        elif isinstance(s, t.If):
            yield from expr(s.cond)
        elif isinstance(s, t.ExprStmt):
            yield from expr(s.expr)


# --- lowering ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """The point a probe's snippet is compiled for."""

    kind: str                  # "entry", "exit", "insn"
    function: str              # the probed function's name
    probe: str                 # the attach point's text, as ``probe`` names it


class Locals:
    """The Frame's slots: scratch variables for the whole action, temporaries LIFO."""

    def __init__(self) -> None:
        self.used = 0
        self.high = 0
        self.scratch: dict[str, int] = {}

    def take(self) -> ast.Local:
        slot = self.used
        self.used += 1
        self.high = max(self.high, self.used)
        if self.high > 64:
            raise TraceUnsupported("the action needs more than 64 scratch slots")
        return ast.Local(slot)

    def var(self, name: str) -> ast.Local:
        if name not in self.scratch:
            self.scratch[name] = self.take().slot
        return ast.Local(self.scratch[name])

    def mark(self) -> int:
        return self.used

    def release(self, mark: int) -> None:
        self.used = max(mark, len(self.scratch) and max(self.scratch.values()) + 1)


@dataclass
class Access:
    """A map access resolved for the snippet: code to run first, the record (a
    constant or a Local), and the condition that it was found (None: always)."""

    setup: list[ast.Node]
    slot: ast.Node | int
    found: ast.Node | None


class ProbeCompiler:
    """Lowers one probe for one Site."""

    def __init__(self, layouts: dict[str, MapLayout], site: Site, *,
                 stop: ast.Var | None, name_index: Callable[[str], int],
                 placed: Callable[[MapLayout, tuple[int, ...]], tuple[str, int] | None],
                 ring: Any = None, clock: int | None = None) -> None:
        self.layouts = layouts
        self.clock = clock
        self.ring = ring
        self.site = site
        self.stop = stop
        self.name_index = name_index
        #: where a constant key is: ("record", r), placed before the run, ("direct", n),
        #: its own word; None: searched for
        self.placed = placed
        self.locals = Locals()
        #: scratch variables assigned so far, in the program's order
        self.defined: set[str] = set()

    def compile(self, probe: t.Probe) -> ast.Node:
        # every scratch variable has its slot from the start: a temporary never
        # shares one with a variable (which then reads 0 until assigned)
        for s in _stmts(probe.body):
            if isinstance(s, t.Assign) and isinstance(s.target, t.Scratch):
                self.locals.var(s.target.name)
        body = self.block(probe.body)
        if probe.pred is not None:
            body = ast.If(self.expr(probe.pred), body)
        if self.stop is not None:
            body = ast.If(ast.lnot(self.stop), body)
        return ast.Frame(self.locals.high, body)

    # --- statements ------------------------------------------------------------------------
    def block(self, stmts: tuple[t.Stmt, ...]) -> ast.Node:
        return ast.Seq(tuple(self.stmt(s) for s in stmts))

    def stmt(self, s: t.Stmt) -> ast.Node:
        if isinstance(s, t.If):
            return ast.If(self.expr(s.cond), self.block(s.then),
                          self.block(s.orelse) if s.orelse else None)
        if isinstance(s, t.Assign):
            if isinstance(s.target, t.Scratch):
                return self.assign_scratch(s)
            return self.assign_map(s.target, s.op, s.value)
        assert isinstance(s, t.ExprStmt)
        e = s.expr
        if isinstance(e, t.Call) and e.name in STATEMENTS:
            return self.statement_call(e)
        return self.expr(e)

    def assign_scratch(self, s: t.Assign) -> ast.Node:
        assert isinstance(s.target, t.Scratch)
        value = self.expr(s.value)
        var = self.locals.var(s.target.name)
        self.defined.add(s.target.name)
        if s.op != "=":
            value = self.binop(s.op[:-1], var, value)
        return var.assign(value)

    def statement_call(self, call: t.Call) -> ast.Node:
        if call.name == "printf":
            return self.printf(call)
        if call.name == "exit":
            assert self.stop is not None
            return self.stop.assign(1)
        if call.name == "time":
            raise TraceUnsupported("time() in a kprobe action is not supported (use it in "
                                   "BEGIN, END or interval)", call.loc)
        if call.name == "print":
            raise TraceUnsupported("print() in a kprobe action is not supported (print maps in "
                                   "END, or let them print at exit)", call.loc)
        ref = call.args[0]
        assert isinstance(ref, t.MapRef)
        lay = self.layouts[ref.name]
        if call.name == "clear" and lay.keyed:
            raise TraceUnsupported("clear() of a keyed map in a kprobe action is not supported "
                                   "(it needs a loop over the table): clear it in END", call.loc)
        mark = self.locals.mark()
        acc = self.access(ref, claim=False)
        zero = ast.Seq(tuple(lay.word(acc.slot, i).assign(0) for i in range(lay.present, lay.stride)))
        self.locals.release(mark)
        return ast.Seq((*acc.setup, zero if acc.found is None else ast.If(acc.found, zero)))

    def printf(self, call: t.Call) -> ast.Node:
        assert self.ring is not None and isinstance(call.args[0], t.Str)
        mark = self.locals.mark()
        code: list[ast.Node] = []
        args = [self.leaf(w, code) for a in call.args[1:] for w in self.key_words(a)]
        fmt = (call.args[0].value, printf_kinds(call.args[1:]))
        code.append(self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), args))
        self.locals.release(mark)
        return ast.Seq(tuple(code))

    # --- map updates -------------------------------------------------------------------------
    def assign_map(self, ref: t.MapRef, op: str, value: t.Expr) -> ast.Node:
        lay = self.layouts[ref.name]
        kind = lay.type.kind
        mark = self.locals.mark()
        code: list[ast.Node] = []
        arg: ast.Node | None = None
        if isinstance(value, t.Call) and value.name in AGGREGATIONS and op == "=":
            if value.args:
                arg = self.leaf(self.expr(value.args[0]), code)
        else:
            arg = self.leaf(self.expr(value), code)
        acc = self.access(ref, claim=True, into=code)
        update = ast.Seq((lay.word(acc.slot, lay.present).assign(1),
                          *self.update(lay, acc.slot, kind, op, arg)))
        if acc.found is None:
            code.append(update)
        else:
            assert lay.lost is not None
            lost = ast.Var(lay.lost)
            code.append(ast.If(acc.found, update, lost.atomic_assign(lost + 1)))
        self.locals.release(mark)
        return ast.Seq(tuple(code))

    def update(self, lay: MapLayout, slot: ast.Node | int, kind: str | None, op: str,
               v: ast.Node | None) -> list[ast.Node]:
        w = lay.word(slot, lay.value0)
        if kind == "count":
            return [w.atomic_assign(w + 1)]
        assert v is not None
        if kind == "sum":
            return [w.atomic_assign(w + v)]
        if kind == "avg":
            n = lay.word(slot, lay.value0 + 1)
            return [w.atomic_assign(w + v), n.atomic_assign(n + 1)]
        if kind in ("min", "max"):
            u = self.locals.take()
            biased = v ^ ast.Const(SIGN)
            return [u.assign(biased if kind == "max" else ~biased),
                    w.atomic_assign(ast.If(ast.ugt(u, w), u, w))]
        if kind in ("hist", "lhist"):
            bucket, code = self.bucket(lay, v)
            b = lay.word(slot, lay.value0 + bucket)
            return [*code, b.atomic_assign(b + 1)]
        # an integer map: plain or compound assignment
        if op == "=":
            return [w.assign(v)]
        if op in ("+=", "-="):
            return [w.atomic_assign(w + v if op == "+=" else w - v)]
        return [w.atomic_assign(self.binop(op[:-1], w, v))]

    def bucket(self, lay: MapLayout, v: ast.Node) -> tuple[ast.Node, list[ast.Node]]:
        """The bucket of ``v`` (a leaf) as bpftrace's language computes it, and the
        code that computes it into a Local."""
        out = self.locals.take()
        if lay.type.kind == "lhist":
            assert lay.type.lhist is not None
            lo, hi, step = lay.type.lhist
            inside = ast.Const(1) + (v - lo) / ast.Const(step)
            last = 1 + (hi - lo) // step
            return out, [out.assign(ast.If(v < lo, ast.Const(0),
                                           ast.If(v > hi, ast.Const(last), inside)))]
        # power of two: 0 below 0, 1 for 0, 2 + floor(log2(v)) above
        n, log = self.locals.take(), self.locals.take()
        code: list[ast.Node] = [n.assign(v), log.assign(0)]
        for shift in (32, 16, 8, 4, 2, 1):
            code.append(ast.If(ast.uge(n, ast.Const(1 << shift)),
                               ast.seq(n.assign(ast.lshr(n, shift)), log.assign(log + shift))))
        code.append(out.assign(ast.If(v < 0, ast.Const(0), ast.If(v == 0, ast.Const(1), log + 2))))
        return out, code

    # --- map accesses ------------------------------------------------------------------------
    def access(self, ref: t.MapRef, *, claim: bool, into: list[ast.Node] | None = None) -> Access:
        lay = self.layouts[ref.name]
        code: list[ast.Node] = [] if into is None else into
        if not lay.keyed:
            return Access(code, 0, None)
        constant = [constant_key(k, self.site, self.name_index) for k in ref.keys]
        if all(c is not None for c in constant):
            key = tuple(c for c in constant if c is not None)
            where = self.placed(lay, key)
            if where is not None and where[0] == "record":
                return Access(code, where[1], None)
            if where is not None:
                return self.direct(lay, key, where[1], claim, code)
            # no record before the run, and keys computed elsewhere: searched for
            # like any key (so that both find the same record), its hash computed here
            return self.search(lay, [ast.Const(c) for c in key], claim, code, hash_keys(key))
        keys = [self.leaf(w, code) for k in ref.keys for w in self.key_words(k)]
        return self.search(lay, keys, claim, code)

    def search(self, lay: MapLayout, keys: list[ast.Node], claim: bool, code: list[ast.Node],
               h: int | None = None) -> Access:
        """The record of ``keys`` found through the map's index, and when ``claim``
        and absent, a new record (if one is left) claimed at the first empty slot.
        ``r`` ends as the record, or ``capacity`` (absent; claimable at slot ``i``)
        or ``capacity + 1`` (absent, nowhere to claim)."""
        if not lay.slots:
            # every key of this map has its record from before the run, and this
            # one is none of them: it can never be stored
            return Access(code, 0, ast.Const(0))
        n, last = lay.capacity, lay.slots - 1
        hi: ast.Node
        i, r, v = self.locals.take(), self.locals.take(), self.locals.take()
        if h is None:
            hi = self.locals.take()
            code += [hi.assign(hash_tree(keys) & ast.Const(HI)), i.assign(ast.lshr(hi, 64 - lay.bits))]
        else:
            hi = ast.Const(h & HI)
            code.append(i.assign(start_slot(h, lay)))
        code.append(r.assign(n + 1))

        def record(entry: ast.Node) -> ast.Node:
            return (entry & ast.Const(LO)) - 1

        def match(entry: ast.Node) -> ast.Node:
            same: ast.Node = (entry & ast.Const(HI)) == hi
            for j, k in enumerate(keys):
                same = ast.land(same, lay.word(record(entry), lay.key0 + j) == k)
            return same

        # the search: each step nested in the one before (no flag to test per step);
        # an empty slot ends it, since slots are never emptied
        step: ast.Node | None = None
        for _ in range(lay.probes):
            go_on = None if step is None else ast.seq(i.assign((i + 1) & ast.Const(last)), step)
            step = ast.seq(v.assign(lay.slot(i)),
                           ast.If(v == 0, r.assign(n), ast.If(match(v), r.assign(record(v)), go_on)))
        assert step is not None
        code.append(step)
        if claim:
            code.append(ast.If(r == n, self.claim(lay, keys, hi, i, r, v, record)))
        return Access(code, r, ast.ult(r, n))

    def direct(self, lay: MapLayout, key: tuple[int, ...], n: int, claim: bool,
               code: list[ast.Node]) -> Access:
        """A constant key with a word of its own: its record + 1, or 0 until its first
        update claims one (a compare-and-swap from 0; the loser of a race takes the
        winner's record, which is this key's)."""
        cap = lay.capacity
        r, v = self.locals.take(), self.locals.take()
        word = lay.direct_word(n)
        code += [v.assign(word), r.assign(ast.If(v == 0, ast.Const(cap), v - 1))]
        if claim:
            res = self.locals.take()
            won = ast.seq(*(lay.word(res - 1, lay.key0 + j).assign(k) for j, k in enumerate(key)),
                          r.assign(res - 1))
            code.append(ast.If(r == cap, ast.seq(
                *self.reserve(lay, res),
                ast.If(res == 0, r.assign(cap + 1),        # full: the key is not stored
                       ast.If(ast.CompareExchange(word, ast.Const(0), res) == 0, won,
                              ast.seq(v.assign(word), r.assign(v - 1)))))))
        return Access(code, r, ast.ult(r, cap))

    def reserve(self, lay: MapLayout, res: ast.Local) -> list[ast.Node]:
        """``res`` = a new record + 1, or 0 when the map is full: a compare-and-swap of
        ``used`` below the capacity (a failed swap means another cpu took a record
        meanwhile: look again, a few times)."""
        u = self.locals.take()
        used = ast.Var(lay.used or 0)
        return [res.assign(0), *(ast.If(res == 0, ast.seq(
            u.assign(used),
            ast.If(ast.ult(u, lay.capacity),
                   ast.If(ast.CompareExchange(used, u, u + 1) == u, res.assign(u + 1)))))
            for _ in range(RESERVE_TRIES))]

    def claim(self, lay: MapLayout, keys: list[ast.Node], hi: ast.Node, i: ast.Local,
              r: ast.Local, v: ast.Local, record: Callable[[ast.Node], ast.Node]) -> ast.Node:
        """A new record for ``keys`` at empty slot ``i`` (:meth:`reserve`), the slot
        claimed by a compare-and-swap from 0.  A cpu that loses the slot to another
        adding the same key at the same moment (their hashes' upper halves equal)
        uses the winner's record; to a different key, its update is lost (counted)."""
        n = lay.capacity
        res = self.locals.take()
        won = ast.seq(*(lay.word(res - 1, lay.key0 + j).assign(k) for j, k in enumerate(keys)),
                      r.assign(res - 1))
        lost = ast.seq(v.assign(lay.slot(i)),
                       ast.If((v & ast.Const(HI)) == hi, r.assign(record(v)), r.assign(n + 1)))
        return ast.seq(*self.reserve(lay, res),
                       ast.If(res == 0, r.assign(n + 1),        # full: the key is not stored
                              ast.If(ast.CompareExchange(lay.slot(i), ast.Const(0), hi | res) == 0,
                                     won, lost)))

    def key(self, k: t.Expr) -> ast.Node:
        c = constant_key(k, self.site, self.name_index)
        return ast.Const(c) if c is not None else self.expr(k)

    def key_words(self, k: t.Expr) -> list[ast.Node]:
        """The words a key (or a printf argument) is held in: comm's name takes two."""
        if isinstance(k, t.Builtin) and k.name == "comm":
            return [ast.Comm(i) for i in range(COMM_WORDS)]
        return [self.key(k)]

    def leaf(self, node: ast.Node, code: list[ast.Node]) -> ast.Node:
        """``node`` itself when reading it again is free and harmless, else a Local
        computed once by ``code``."""
        if isinstance(node, ast.Const | ast.Local | ast.Arg | ast.RetVal):
            return node
        local = self.locals.take()
        code.append(local.assign(node))
        return local

    # --- expressions ------------------------------------------------------------------------
    def expr(self, e: t.Expr) -> ast.Node:
        if isinstance(e, t.Int):
            return ast.Const(e.value)
        if isinstance(e, t.Builtin):
            return self.builtin(e)
        if isinstance(e, t.Scratch):
            if e.name not in self.defined:
                raise TraceSemanticError(f"Undefined or undeclared variable: ${e.name}", e.loc)
            return self.locals.var(e.name)
        if isinstance(e, t.MapRef):
            return self.read_map(e)
        if isinstance(e, t.Binary) and (cmp := _comm_compare(e)) is not None:
            op, value = cmp
            low, high = value & ((1 << 64) - 1), value >> 64
            same = ast.land(ast.Comm(0) == ast.Const(low), ast.Comm(1) == ast.Const(high))
            return same if op == "==" else ast.lnot(same)
        if isinstance(e, t.Binary):
            left, right = self.expr(e.left), self.expr(e.right)
            if e.op == "&&":
                return ast.land(left, right)
            if e.op == "||":
                return ast.lor(left, right)
            return self.binop(e.op, left, right, e.loc)
        if isinstance(e, t.Unary):
            operand = self.expr(e.operand)
            return {"!": ast.lnot, "~": lambda x: ~x, "-": lambda x: -x,
                    "+": lambda x: x}[e.op](operand)
        if isinstance(e, t.Ternary):
            return ast.If(self.expr(e.cond), self.expr(e.then), self.expr(e.orelse))
        raise TraceSemanticError("this expression has no integer value", e.loc)

    def binop(self, op: str, left: ast.Node, right: ast.Node, loc: Loc | None = None) -> ast.Node:
        if op in BINOPS:
            if op in ("/", "%") and isinstance(right, ast.Const) and right.value == 0:
                raise TraceSemanticError("Divide or modulo by 0 detected", loc)
            return ast.BinOp(BINOPS[op], left, right)
        return ast.Compare(COMPARES[op], left, right)

    def builtin(self, e: t.Builtin) -> ast.Node:
        name, kind = e.name, self.site.kind
        if name == "pid":           # the process's: its thread group's id
            return ast.Tgid()
        if name == "tid":
            return ast.Pid()
        if name == "cpu":
            return ast.Cpu()
        if name == "nsecs":         # the kernel's clock where it has one, else cycles
            return ast.Tsc() if self.clock is None else ast.Call(self.clock, ())
        if name.startswith("arg"):
            if kind != "entry":
                raise TraceSemanticError(f"The {name} builtin can only be used at a function's "
                                         "entry (kprobe:FUNCTION)", e.loc)
            return ast.Arg(int(name[3:]))
        if name == "retval":
            if kind != "exit":
                raise TraceSemanticError("The retval builtin can only be used with kretprobe", e.loc)
            return ast.RetVal()
        raise TraceUnsupported(f"{name} is not supported outside a map key", e.loc)

    def read_map(self, ref: t.MapRef) -> ast.Node:
        lay = self.layouts[ref.name]
        kind = lay.type.kind
        if kind in ("hist", "lhist"):
            raise TraceSemanticError(f"{ref.name} holds a {kind}, which has no integer value", ref.loc)
        mark = self.locals.mark()
        acc = self.access(ref, claim=False)
        w = lay.word(acc.slot, lay.value0)
        value: ast.Node
        if kind in ("min", "max"):
            value = ast.If(w == 0, ast.Const(0),
                           (w if kind == "max" else ~w) ^ ast.Const(SIGN))
        elif kind == "avg":
            n = lay.word(acc.slot, lay.value0 + 1)
            value = ast.If(n == 0, ast.Const(0), w / n)
        else:
            value = w
        self.locals.release(mark)
        if acc.found is not None:
            value = ast.If(acc.found, value, ast.Const(0))
        return ast.Seq((*acc.setup, value)) if acc.setup else value


__all__ = ["Analysis", "ProbeCompiler", "Site", "analyse", "constant_key", "map_refs"]
