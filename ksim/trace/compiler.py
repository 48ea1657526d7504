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
client claims the record (:meth:`Table.find`) and the snippet addresses it as a
plain Var.  Other keyed accesses hash their keys and probe the table with
CompareExchange claims (see ksim.trace.maps).  BEGIN and END run in the client
(ksim.trace.interp).
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
from .maps import SIGN, MapLayout, MapType, hash_tree, key_words

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
                 preclaim: Callable[[MapLayout, tuple[int, ...]], int | None],
                 ring: Any = None, clock: int | None = None) -> None:
        self.layouts = layouts
        self.clock = clock
        self.ring = ring
        self.site = site
        self.stop = stop
        self.name_index = name_index
        self.preclaim = preclaim
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
        constant = [self.constant_key(k) for k in ref.keys]
        if all(c is not None for c in constant):
            key = tuple(c for c in constant if c is not None)
            slot = self.preclaim(lay, key)
            if slot is None:
                raise TraceSemanticError(f"{ref.name} has no free record for the key {key}", ref.loc)
            return Access(code, slot, None)
        keys = [self.leaf(w, code) for k in ref.keys for w in self.key_words(k)]
        return self.probe_table(lay, keys, claim, code)

    def probe_table(self, lay: MapLayout, keys: list[ast.Node], claim: bool,
                    code: list[ast.Node]) -> Access:
        tag, i, s = self.locals.take(), self.locals.take(), self.locals.take()
        n = ast.Const(lay.slots)
        code += [tag.assign(hash_tree(keys) | 1),
                 i.assign(ast.lshr(tag, 64 - lay.bits)),
                 s.assign(n)]
        match: ast.Node = lay.word(i, lay.tag) == tag
        for j, k in enumerate(keys):
            match = ast.land(match, lay.word(i, lay.key0 + j) == k)
        if claim:
            won = ast.seq(*(lay.word(i, lay.key0 + j).assign(k) for j, k in enumerate(keys)),
                          s.assign(i))
            empty: ast.Node = ast.If(
                ast.CompareExchange(lay.word(i, lay.tag), ast.Const(0), tag) == 0, won,
                ast.If(match, s.assign(i)))
        else:
            empty = s.assign(lay.slots + 1)       # an empty record ends the search
        step = ast.seq(ast.If(match, s.assign(i), ast.If(lay.word(i, lay.tag) == 0, empty)),
                       i.assign((i + 1) & ast.Const(lay.slots - 1)))
        code += [ast.If(s == n, step) for _ in range(lay.probes)]
        return Access(code, s, ast.ult(s, n))

    def constant_key(self, k: t.Expr) -> int | None:
        if isinstance(k, t.Builtin) and k.name == "func":
            return self.name_index(self.site.function)
        if isinstance(k, t.Builtin) and k.name == "probe":
            return self.name_index(self.site.probe)
        if isinstance(k, t.Int):
            return k.value
        return None

    def key(self, k: t.Expr) -> ast.Node:
        c = self.constant_key(k)
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


__all__ = ["Analysis", "ProbeCompiler", "Site", "analyse"]
