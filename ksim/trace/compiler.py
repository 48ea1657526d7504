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

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ksim.snippets import ast
from ksim.snippets.ast import COMM_WORDS

from . import syntax as t
from .errors import Loc, TraceError, TraceSemanticError, TraceUnsupported
from .events import CAT_FORMAT, MAP_FORMAT, MAX_ARGS, VALUE_FORMAT
from .maps import (
    ERRNO,
    HI,
    LO,
    MAC,
    MASK,
    RESERVE_TRIES,
    SIGN,
    SYSCALL,
    TUPLE,
    USERNAME,
    MapLayout,
    MapType,
    hash_into,
    hash_keys,
    is_text,
    key_words,
    start_slot,
    tuple_items,
    tuple_kind,
    width,
)
from .types import INT64, UINT64, CType, TypeSystem, integer, pointer, string
from .types import VOID as VOID_T

#: builtins, and where they mean something
BUILTINS = {"pid", "tid", "cpu", "nsecs", "retval", "func", "probe", "comm", "curtask", "args",
            "ppid", "pcomm", "kstack", "ustack", "numaid", "username",
            "uid", "gid", "elapsed", "cgroup", "jiffies", "rand", "ncpus",
            *(f"arg{i}" for i in range(6))}
#: builtins of bpftrace's language outside the subset
OTHER_BUILTINS = {"ctx", "cpid",
                  "sarg0", "sarg1", "sarg2", "sarg3", "sarg4", "sarg5", "usym", "ksym",
                  "arg6", "arg7", "arg8", "arg9", "__builtin_probe"}
AGGREGATIONS = {"count": 0, "sum": 1, "min": 1, "max": 1, "avg": 1, "hist": 1, "lhist": 4,
                "stats": 1}
STATEMENTS = {"print", "clear", "delete", "exit", "printf", "time", "zero", "join", "cat"}
#: functions with a value, in the subset
FUNCTIONS = {"str", "ksym", "kaddr", "ntop", "has_key", "strncmp", "bswap", "strftime", "kstack",
             "ustack", "buf", "cgroup_path", "strerror", "syscall_name", "strcontains", "len", "macaddr",
             "pton", "path"}
#: why a builtin outside the subset is (where the plain "not supported" says too little)
WHY_NOT = {
    "cpid": "cpid is not supported: it is the process bpftrace's -c started, and ksim trace "
            "starts none (--while runs its command in the traced machine, its pid unknown to "
            "the client)",
}
#: the most bytes of a string strcontains() searches (the program's max_strlen, at most)
STRCONTAINS_MAX = 64
#: the most bytes buf() keeps
BUF_MAX = 64
#: kstack's and ustack's frames when the program does not say (kstack(N)); their modes
KSTACK_DEPTH = 32
STACK_MODES = ("bpftrace", "perf", "raw")
#: the stacks: the kernel's, the task's user stack
STACKS = ("kstack", "ustack")
#: where the kernel lets bpf_d_path run, and so where path() may: kfunc and kretfunc
#: probes of the functions of its btf_allowlist_d_path (kernel/trace/bpf_trace.c, the
#: same list in 6.1 and today; the security_* ones exist with CONFIG_SECURITY and
#: CONFIG_SECURITY_PATH).  d_path follows the path's dentry and mount chains under
#: rename_lock and mount_lock: safe where the caller holds a live struct path and
#: neither lock, which the kernel vouches for in these functions alone
D_PATH_ALLOWED = ("security_file_permission", "security_inode_getattr", "security_file_open",
                  "security_path_truncate", "vfs_truncate", "vfs_fallocate", "dentry_open",
                  "vfs_getattr", "filp_close")
#: d_path's ERR_PTR values: -MAX_ERRNO and above (include/linux/err.h)
ERR_PTR_START = (1 << 64) - 4095
OTHER_FUNCTIONS = {"usym", "uaddr",
                   "reg", "system", "cat", "signal", "override", "cgroupid",
                   "macaddr", "strftime", "path", "kstack", "ustack", "cgroup_path",
                   "skboutput", "pton", "strcontains", "len", "unwatch",
                   "percpu_kaddr", "errorf", "warnf", "debugf", "print_stats", "syscall_name",
                   "strerror"} - FUNCTIONS
#: rand's generator where the kernel has no get_random_u32: state = state * MUL + ADD
#: (mod 2^64), the number its upper 32 bits (Knuth's MMIX constants)
RAND_MUL, RAND_ADD = 6364136223846793005, 1442695040888963407
#: bpftrace's default max_strlen: the bytes str() reads
DEFAULT_STRLEN = 64
#: the most scratch slots of one action (8 bytes each, on the kernel's stack)
MAX_SLOTS = 128
#: join(): the strings it reads, and the bytes of each
JOIN_ARGS, JOIN_STRLEN = 8, 64
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
    #: probe, "comm", "str:N", "kaddr", "inet"), numbered in program order
    formats: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    #: the bytes str() reads by default (the program's max_strlen, a multiple of 8)
    strlen: int = DEFAULT_STRLEN
    #: the program's max_strlen as it gives it (path()'s buffer)
    max_strlen: int = DEFAULT_STRLEN
    #: the program's types (base types, its struct definitions, the kernel's BTF)
    types: TypeSystem = field(default_factory=TypeSystem)


def analyse(program: t.Program, types: TypeSystem | None = None,
            site_of: Callable[[t.Probe], Site | None] | None = None) -> Analysis:
    """Every map's type, checked across the whole program; builtins and functions
    checked against the subset.  ``site_of(probe)``: a point the probe attaches to,
    whose arguments type its expressions (kfunc's, a tracepoint's)."""
    max_strlen = int(program.config.get("max_strlen", DEFAULT_STRLEN))
    strlen = -(-max_strlen // 8) * 8
    types = types or TypeSystem()
    for kind, name, fields, loc in program.records:
        types.define(kind, name, list(fields), loc)
    # twice: a map read before the assignment that types it (in the program's order) is
    # typed by what the first pass found it holds (an error there is found again)
    first = Analysis(strlen=strlen, max_strlen=max_strlen, types=types)
    _analyse_probes(program, first, site_of, tolerant=True)
    a = Analysis(strlen=strlen, max_strlen=max_strlen, types=types)
    a.maps = {name: dataclasses.replace(m) for name, m in first.maps.items() if m.kind is not None}
    _analyse_probes(program, a, site_of)
    for m in a.maps.values():
        if m.kind is None:
            raise TraceSemanticError(f"Undefined map: {m.name} (it is never assigned)")
    return a


def _analyse_probes(program: t.Program, a: Analysis,
                    site_of: Callable[[t.Probe], Site | None] | None,
                    tolerant: bool = False) -> None:
    """Each probe's filter and statements analysed into ``a``; ``tolerant``: a
    statement in error is passed over (the first pass, which only collects kinds)."""
    for probe in program.probes:
        site = site_of(probe) if site_of is not None else None
        typer = ProbeCompiler({}, site or CLIENT_SITE, stop=None, name_index=lambda n: 0,
                              placed=lambda lay, key: None, analysis=a, typing=True)
        typer.kernel = not all(ap.provider in t.CLIENT_PROVIDERS for ap in probe.points)
        if probe.pred is not None:
            try:
                _check_expr(a, probe.pred)
                typer.value(probe.pred)
            except TraceError:
                if not tolerant:
                    raise
        for stmt in _stmts(probe.body):
            try:
                _analyse_stmt(a, stmt, typer)
            except TraceError:
                if not tolerant:
                    raise


def _stmts(body: tuple[t.Stmt, ...]) -> Iterator[t.Stmt]:
    for s in body:
        yield s
        if isinstance(s, t.If):
            yield from _stmts(s.then)
            yield from _stmts(s.orelse)
        elif isinstance(s, t.While):
            yield from _stmts(s.body)
            yield from _stmts(s.step)
        elif isinstance(s, t.ForMap):
            yield from _stmts(s.body)


def _analyse_stmt(a: Analysis, s: t.Stmt, typer: ProbeCompiler) -> None:
    if isinstance(s, t.Assign):
        _check_expr(a, s.value, allow_aggregation=isinstance(s.target, t.MapRef) and s.op == "=")
        if isinstance(s.target, t.MapRef):
            _use_map(a, s.target, typer)
            _assign_kind(a, s.target, s.op, s.value, typer)
        else:
            typer.declare(s.target.name, typer.value(s.value).type, s.value.loc)
    elif isinstance(s, t.Declare):
        if s.type is not None:
            typer.declare(s.name, a.types.named(s.type, s.loc), s.loc)
    elif isinstance(s, t.If | t.While):
        _check_expr(a, s.cond)
        typer.value(s.cond)
    elif isinstance(s, t.ForMap):
        _check_for_map(a, s, typer)
    elif isinstance(s, t.ExprStmt):
        e = s.expr
        if isinstance(e, t.Call) and e.name in STATEMENTS:
            _check_statement_call(a, e, typer)
        else:
            _check_expr(a, e)
            typer.value(e)


def _check_for_map(a: Analysis, s: t.ForMap, typer: ProbeCompiler) -> None:
    """``for ($kv : @m)`` over the map's entries; ``$kv`` is the tuple (key, value), a
    key of several parts a tuple itself.  Run by the client in BEGIN, END and interval;
    in a kernel probe's action, unrolled over the map's records (ProbeCompiler.for_map)."""
    typer.var_types[s.var] = for_map_type(a, s)


def for_map_type(a: Analysis, s: t.ForMap) -> CType:
    """The type of a for loop's ``$kv``: the tuple (key, value)."""
    m = a.maps.get(s.map.name)
    if m is None or m.kind is None or m.keys is None:
        raise TraceSemanticError(f"for: {s.map.name} is never assigned", s.map.loc)
    if not m.keys:
        raise TraceSemanticError(f"for: {s.map.name} has no keys to loop over", s.map.loc)
    if m.kind in ("hist", "lhist") or m.stats:
        raise TraceSemanticError(f"for: {s.map.name} holds a {'stats' if m.stats else m.kind}, "
                                 "which has no single value for $kv.1", s.map.loc)
    key = m.keys[0] if len(m.keys) == 1 else tuple_kind(m.keys)
    value = "int" if m.kind in ("count", "sum", "min", "max", "avg") else m.kind
    # the loop's variable is its own: another loop's of the same name may hold another type
    return tuple_type((key, value))


def _check_printf(a: Analysis, call: t.Call, typer: ProbeCompiler) -> None:
    from .events import MAX_FIELD, conversions, too_wide, unknown_conversion
    from .parser import TraceLimit

    if not call.args or not isinstance(call.args[0], t.Str):
        raise TraceSemanticError(f"{call.name}() expects a format string first", call.loc)
    fmt, args = call.args[0].value, call.args[1:]
    bad = unknown_conversion(fmt)
    if bad is not None:
        raise TraceUnsupported(f"printf conversion {bad!r} is not supported", call.args[0].loc)
    wide = too_wide(fmt)
    if wide is not None:
        raise TraceLimit(f"printf: {wide!r} asks for a field wider than {MAX_FIELD} characters",
                         call.args[0].loc)
    convs = conversions(fmt)
    if len(args) != len(convs):
        which = "Too many" if len(args) > len(convs) else "Not enough"
        raise TraceSemanticError(f"printf: {which} arguments for format string", call.loc)
    for arg in args:
        _check_expr(a, arg, key=True)
    kinds = typer.printf_kinds(args)
    for conv, arg, kind in zip(convs, args, kinds, strict=True):
        if conv == "r" or kind.startswith("buf:"):
            if conv != "r" or not kind.startswith("buf:"):
                raise TraceSemanticError("printf: %r formats a buffer (buf()), and a buffer "
                                         "is formatted by %r", arg.loc)
            continue
        if conv == "s" and kind == "int":
            raise TraceSemanticError("printf: %s specifier expects a value of type string "
                                     "(integer supplied)", arg.loc)
        if conv != "s" and kind != "int":
            raise TraceSemanticError(f"printf: %{conv} specifier expects a value of type integer "
                                     f"({_kind_text(kind)} supplied)", arg.loc)
    if key_words(kinds) > MAX_ARGS:
        raise TraceUnsupported(f"printf() with more than {MAX_ARGS} argument words (a string "
                               "takes one per 8 bytes) is not supported", call.loc)
    if (fmt, kinds) not in a.formats:
        a.formats.append((fmt, kinds))


#: a printf format that stands for time(FORMAT): the client prints the time the
#: event is drained at, as strftime formats it
TIME_FORMAT = "\0time\0"


#: a printf format that stands for join(ARRAY, DELIMITER)
JOIN_FORMAT = "\0join\0"
def map_format(call: t.Call) -> str:
    """The event format of print(@m[, top[, div]]), clear(@m) or zero(@m) in a kernel
    probe's action: MAP_FORMAT OP "\0" @NAME "\0" TOP "\0" DIV (the client prints or
    clears the map when it drains the event).  print(value)'s is VALUE_FORMAT, with
    the value's kind; cat("FILE")'s CAT_FORMAT FILE."""
    ref = call.args[0]
    assert isinstance(ref, t.MapRef)
    extra = [x.value if isinstance(x, t.Int) else 0 for x in call.args[1:3]]
    top, div = (extra + [0, 1])[:2] if extra else (0, 1)
    op = "clear" if call.name == "zero" else call.name
    return f"{MAP_FORMAT}{op}\0{ref.name}\0{top}\0{div or 1}"


def _add_format(a: Analysis, fmt: tuple[str, tuple[str, ...]]) -> None:
    if fmt not in a.formats:
        a.formats.append(fmt)


def _join_delimiter(call: t.Call) -> str:
    return call.args[1].value if len(call.args) == 2 and isinstance(call.args[1], t.Str) else " "


def _time_format(call: t.Call) -> str:
    return call.args[0].value if call.args and isinstance(call.args[0], t.Str) else "%H:%M:%S\n"


def _kind_text(kind: str) -> str:
    if kind.startswith(TUPLE):
        return "(" + ", ".join(_kind_text(k) for k in tuple_items(kind)) + ")"
    return {"name": "string", "comm": "string", "kaddr": "ksym", "inet": "inet"}.get(
        kind, "string" if kind.startswith("str:") else kind)


def _check_statement_call(a: Analysis, call: t.Call, typer: ProbeCompiler) -> None:
    if call.name == "printf":
        _check_printf(a, call, typer)
        return
    if call.name == "join":
        if not 1 <= len(call.args) <= 2 or (len(call.args) == 2
                                             and not isinstance(call.args[1], t.Str)):
            raise TraceSemanticError("join() takes an array of strings and an optional "
                                     "delimiter string", call.loc)
        _check_expr(a, call.args[0])
        typer.value(call.args[0]).scalar(call.args[0].loc)
        fmt = (JOIN_FORMAT + _join_delimiter(call), (f"str:{JOIN_STRLEN}",) * JOIN_ARGS)
        if fmt not in a.formats:
            a.formats.append(fmt)
        return
    if call.name == "time":
        if len(call.args) > 1 or (call.args and not isinstance(call.args[0], t.Str)):
            raise TraceSemanticError("time() takes one format string, or none", call.loc)
        if "\0" in _time_format(call):
            raise TraceSemanticError("time(): the format has a NUL character", call.loc)
        fmt = (TIME_FORMAT + _time_format(call), ())
        if fmt not in a.formats:
            a.formats.append(fmt)
        return
    if call.name == "exit":
        if len(call.args) > 1:
            raise TraceSemanticError("exit() takes one exit code, or none", call.loc)
        for x in call.args:
            _check_expr(a, x)
        a.exits = True
        return
    if call.name == "print" and call.args and not isinstance(call.args[0], t.MapRef):
        if len(call.args) > 1:
            raise TraceSemanticError("print() of a value takes one argument", call.loc)
        _check_expr(a, call.args[0], key=True)
        if typer.kernel:
            _add_format(a, (VALUE_FORMAT, typer.print_kinds(call.args[0])))
        return
    if call.name == "cat":
        if not call.args or not isinstance(call.args[0], t.Str):
            raise TraceSemanticError("cat() takes a file's name as a string literal (and "
                                     "printf's arguments for it)", call.loc)
        if len(call.args) > 1:
            raise TraceUnsupported("cat() with a format's arguments is not supported (a "
                                   "file's name as a string literal is)", call.args[1].loc)
        if typer.kernel:
            _add_format(a, (CAT_FORMAT + call.args[0].value, ()))
        return
    if call.name == "delete" and len(call.args) == 2 and isinstance(call.args[0], t.MapRef) \
            and not call.args[0].keys:
        # delete(@m, key): bpftrace's newer spelling of delete(@m[key])
        keys = call.args[1].items if isinstance(call.args[1], t.Tuple) else (call.args[1],)
        ref = t.MapRef(call.args[0].loc, call.args[0].name, tuple(keys))
        _check_statement_call(a, t.Call(call.loc, "delete", (ref,), call.name_loc), typer)
        return
    given = call
    if call.name == "print" and 2 <= len(call.args) <= 3 and isinstance(call.args[0], t.MapRef):
        for x in call.args[1:]:
            if not isinstance(x, t.Int):
                raise TraceSemanticError("print(@map, top, div): top and div are integer "
                                         "literals", x.loc)
        call = t.Call(call.loc, call.name, call.args[:1], call.name_loc)
    if len(call.args) != 1 or not isinstance(call.args[0], t.MapRef):
        raise TraceSemanticError(f"{call.name}() expects a map argument", call.loc)
    ref = call.args[0]
    if call.name in ("print", "clear", "zero") and ref.keys:
        raise TraceSemanticError(f"{call.name}() expects a map with no keys, e.g. {ref.name}",
                                 ref.loc)
    if call.name == "delete" and not ref.keys and a.maps.get(ref.name) and a.maps[ref.name].keys:
        raise TraceSemanticError(f"delete() of {ref.name} needs its keys", ref.loc)
    if call.name == "delete":
        _use_map(a, ref, typer)
    else:
        a.maps.setdefault(ref.name, MapType(ref.name))
        if typer.kernel and call.name in ("print", "clear", "zero"):
            # done by the client when it drains the event (ksim.trace.events)
            _add_format(a, (map_format(given), ()))
    for k in ref.keys:
        _check_expr(a, k, key=True)


def _use_map(a: Analysis, ref: t.MapRef, typer: ProbeCompiler) -> MapType:
    for k in ref.keys:
        _check_expr(a, k, key=True)
    kinds = tuple(kind for k in ref.keys for kind in typer.key_kinds(k))
    m = a.maps.setdefault(ref.name, MapType(ref.name))
    if m.keys is None:
        m.keys = kinds
    elif m.keys != kinds:
        m.keys = _widen(m.keys, kinds, ref)
    return m


def _widen(have: tuple[str, ...], new: tuple[str, ...], ref: t.MapRef) -> tuple[str, ...]:
    """Two uses' key kinds made one: strings of different lengths take the longer."""
    if len(have) == len(new) and all(x == y or (_is_str(x) and _is_str(y))
                                     for x, y in zip(have, new, strict=True)):
        return tuple(x if x == y else f"str:{max(_str_len(x), _str_len(y))}"
                     for x, y in zip(have, new, strict=True))
    raise TraceSemanticError(
        f"Argument mismatch for {ref.name}: trying to access with arguments: "
        f"[{', '.join(map(_kind_text, new))}] when map expects arguments: "
        f"[{', '.join(map(_kind_text, have))}]", ref.loc)


def _wider(a: str, b: str) -> str | None:
    """The kind that holds values of kinds ``a`` and ``b``: strings of different lengths
    take the longer, tuples item by item (None: none does)."""
    if a == b:
        return a
    if _is_str(a) and _is_str(b):
        return f"str:{max(_str_len(a), _str_len(b))}"
    if a.startswith(TUPLE) and b.startswith(TUPLE):
        x, y = tuple_items(a), tuple_items(b)
        items = [_wider(i, j) for i, j in zip(x, y, strict=False)]
        if len(x) == len(y) and all(i is not None for i in items):
            return tuple_kind([i for i in items if i is not None])
    return None


def _is_str(kind: str | None) -> bool:
    return kind is not None and (kind == "comm" or kind.startswith("str:"))


def _str_len(kind: str) -> int:
    return 16 if kind == "comm" else int(kind[4:])


def _assign_kind(a: Analysis, ref: t.MapRef, op: str, value: t.Expr, typer: ProbeCompiler) -> None:
    m = a.maps[ref.name]
    kind, lhist = "int", None
    if op == "=" and isinstance(value, t.Call) and value.name in AGGREGATIONS:
        kind = value.name
        if kind == "stats":
            kind = "avg"        # count, average and total: avg's two words hold them
            m.stats = True
        if kind == "lhist":
            lhist = tuple(_constant(x) for x in value.args[1:])
            lo, hi, step = lhist
            if step <= 0 or hi <= lo:
                raise TraceSemanticError("lhist() needs max > min and step > 0", value.loc)
            if (hi - lo) // step > 1000:
                raise TraceSemanticError("lhist() has more than 1000 buckets", value.loc)
        if value.args:
            typer.value(value.args[0]).scalar(value.args[0].loc)
    elif op == "=":
        kind = typer.value_kind(value)
        if kind == "ptr" and m.ctype is None:
            m.ctype = typer.value(value).type      # read back as the same pointer type
    else:
        typer.value(value).scalar(value.loc)
    if m.kind is not None and _wider(m.kind, kind) is not None:
        kind = _wider(m.kind, kind) or kind
    elif m.kind is not None and (m.kind != kind or (lhist is not None and m.lhist != lhist)):
        raise TraceSemanticError(f"Type mismatch for {ref.name}: trying to assign value of type "
                                 f"'{_kind_text(kind)}' when map already contains a value of "
                                 f"type '{_kind_text(m.kind)}'", value.loc)
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
    elif isinstance(e, t.Builtin):
        if e.name not in BUILTINS and e.name not in OTHER_BUILTINS \
                and a.types.enumerator(e.name) is not None:
            return          # an enum's constant (TCP_ESTABLISHED), from the kernel's BTF
        _check_builtin(e, key)
    elif isinstance(e, t.MapRef):
        for k in e.keys:
            _check_expr(a, k, key=True)
    elif isinstance(e, t.Binary):
        _check_expr(a, e.left)
        _check_expr(a, e.right)
    elif isinstance(e, t.Unary | t.Cast | t.Field | t.Deref):
        _check_expr(a, e.operand)
    elif isinstance(e, t.Index):
        _check_expr(a, e.operand)
        _check_expr(a, e.index)
    elif isinstance(e, t.Ternary):
        for x in (e.cond, e.then, e.orelse):
            _check_expr(a, x)
    elif isinstance(e, t.Tuple):
        for x in e.items:
            _check_expr(a, x, key=key)
    elif isinstance(e, t.Call):
        _check_call(a, e, allow_aggregation)


def _check_builtin(e: t.Builtin, key: bool) -> None:
    if e.name in BUILTINS:
        return
    if e.name in WHY_NOT:
        raise TraceUnsupported(WHY_NOT[e.name], e.loc)
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
    if name in STATEMENTS and name != "delete":
        raise TraceSemanticError(f"{name}() should not be used in an expression", loc)
    if name == "delete":
        return      # delete()'s value (newer bpftrace): checked as the statement it also is
    if name in FUNCTIONS:
        for x in e.args:
            if name in STACKS and isinstance(x, t.Builtin) and x.name in STACK_MODES:
                continue
            if not (name in ("has_key", "len") and isinstance(x, t.MapRef)):
                _check_expr(a, x, key=True)
        return
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
        elif isinstance(e, t.Unary | t.Cast | t.Field | t.Deref):
            yield from expr(e.operand)
        elif isinstance(e, t.Index):
            yield from expr(e.operand)
            yield from expr(e.index)
        elif isinstance(e, t.Ternary):
            for x in (e.cond, e.then, e.orelse):
                yield from expr(x)
        elif isinstance(e, t.Tuple):
            for x in e.items:
                yield from expr(x)
        elif isinstance(e, t.Call):
            if e.name == "delete" and len(e.args) == 2 and isinstance(e.args[0], t.MapRef):
                keys = e.args[1].items if isinstance(e.args[1], t.Tuple) else (e.args[1],)
                yield t.MapRef(e.args[0].loc, e.args[0].name, tuple(keys))
                for k in keys:
                    yield from expr(k)
                return
            for x in e.args:
                yield from expr(x)

    if probe.pred is not None:
        yield from expr(probe.pred)
    for s in _stmts(probe.body):
        if isinstance(s, t.Assign):
            yield from expr(s.target)
            yield from expr(s.value)
        elif isinstance(s, t.If | t.While):
            yield from expr(s.cond)
        elif isinstance(s, t.ExprStmt):
            yield from expr(s.expr)


# --- lowering ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """The point a probe's snippet is compiled for."""

    kind: str                  # "entry", "exit", "insn", "event", "sample", "client"
    function: str              # the probed function's name
    probe: str                 # the attach point's text, as ``probe`` names it
    #: what ``args.NAME`` reads here (kfunc's parameters, a tracepoint's fields):
    #: (name, type, node): the node is the value, or the address for a record or
    #: an array; ``data_loc``: a string at the record's offset the u32 holds
    args: tuple[tuple[str, CType, Any], ...] | None = None
    #: retval's type (kretfunc)
    ret: CType | None = None
    #: a condition this point's hits must meet to be the probe's (a tracepoint's
    #: event among the class's)
    guard: Any = None
    #: the function argument arg0 is (a raw tracepoint's iterator: 1, past its data)
    arg_base: int = 0
    #: the point's address (where kstack starts)
    address: int = 0
    #: what path() calls (kfunc, kretfunc): None where the kernel has no d_path
    d_path: PathCall | None = None


class PathCall(NamedTuple):
    """What path()'s code calls: the kernel's ``d_path(const struct path *, char *buf,
    int buflen)``, and the bytes between the Frame's slots (its buffer is made of
    them, as kstack's)."""

    address: int
    slot_bytes: int = 8


#: where BEGIN, END and interval actions are typed
CLIENT_SITE = Site("client", "", "")


@dataclass
class Val:
    """A typed value in a snippet: a scalar's ``node``, a record's or an array's
    address (``node``), or a string's words."""

    type: CType
    node: Any = None
    words: list[Any] | None = None

    def scalar(self, loc: Loc | None = None) -> Any:
        if self.type.kind in ("int", "ptr", "name", "kaddr", "tm", "cgroup_path"):
            return self.node
        raise TraceSemanticError(f"a value of type {self.type.name or self.type.kind} is not an "
                                 "integer here", loc)


#: types of values that are not C's
NAME = CType("name", 8, name="name")
KADDR = CType("kaddr", 8, name="ksym")
INET = CType("inet", 24, name="inet")
COMM = CType("str", 16, name="comm")
#: a cgroup's id, printed as its path (cgroup_path)
CGROUP_PATH = CType("cgroup_path", 8, name="cgroup_path")
#: numbers the client prints as names: an errno (strerror), a system call's
#: (syscall_name); six bytes printed as a MAC address (macaddr)
STRERROR = CType(ERRNO, 8, name="strerror_t")
SYSCALL_NAME = CType(SYSCALL, 8, name="syscall_name")
MACADDR = CType(MAC, 8, name="macaddr_t")
USERNAME_T = CType(USERNAME, 8, name="username")
#: kinds of one word that print as text and are not integers
NAMED_WORDS = (ERRNO, SYSCALL, MAC, USERNAME)


def tuple_type(items: tuple[str, ...] | list[str]) -> CType:
    """The type of a tuple whose items have these kinds (``kinds``: the kinds of its
    words' parts, a tuple item's flattened; ``items``: each item's)."""
    kinds = tuple(k for item in items for k in _flat(item))
    return CType("tuple", 8 * key_words(kinds), name="tuple",
                 extra={"kinds": kinds, "items": tuple(items)})


def _flat(kind: str) -> list[str]:
    return [k for item in tuple_items(kind) for k in _flat(item)] if kind.startswith(TUPLE) \
        else [kind]


def bytes_type(n: int) -> CType:
    """An array of ``n`` bytes held as words (pton's)."""
    return CType("bytes", n, name=f"uint8[{n}]", extra={"n": n})


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
        if self.high > MAX_SLOTS:
            raise TraceUnsupported(f"the action needs more than {MAX_SLOTS} scratch slots "
                                   f"({MAX_SLOTS * 8} bytes of the kernel's stack)")
        return ast.Local(slot)

    def var(self, name: str, n: int = 1) -> ast.Local:
        """A variable's first slot (``n`` consecutive slots: a string's words)."""
        if name not in self.scratch:
            self.scratch[name] = self.take().slot
            for _ in range(n - 1):
                self.take()
            self.end = self.used
        return ast.Local(self.scratch[name])

    end = 0

    def mark(self) -> int:
        return self.used

    def release(self, mark: int) -> None:
        self.used = max(mark, self.end)


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
                 ring: Any = None, clock: int | None = None, analysis: Analysis | None = None,
                 typing: bool = False, lookup: Callable[[str], int] | None = None,
                 start: ast.Var | None = None, unwinder: Any = None,
                 user_unwinder: Any = None, user_reads: bool = False) -> None:
        self.analysis = analysis if analysis is not None else Analysis()
        #: how kstack asks the kernel to unwind (None: it cannot)
        self.unwinder = unwinder
        #: how ustack asks the kernel to walk the task's user frames (a
        #: session.UserUnwinder; its ``save`` None: it cannot, ``why`` says why)
        self.user_unwinder = user_unwinder
        #: the kernel reads user memory its own way (copy_from_user_nofault)
        self.user_reads = user_reads
        self.types = self.analysis.types
        #: only typing (the analysis's pass): no map is read or written
        self.typing = typing
        #: a kernel symbol's address (kaddr)
        self.lookup = lookup
        #: where the run's start time is (elapsed)
        self.start = start
        #: the type of each scratch variable
        self.var_types: dict[str, CType] = {}
        #: the Local that says the action returned (when it has a return)
        self.returned: ast.Local | None = None
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
        #: the loops being compiled, innermost last: (broken, continued) flags
        self.loops: list[tuple[ast.Local, ast.Local]] = []
        #: a kernel probe's action (the analysis's typer: not BEGIN, END, interval)
        self.kernel = site.kind != "client"
        #: where rand's state is (None: the kernel's get_random_u32)
        self.rand_state: ast.Var | None = None
        self.rand_call: int | None = None

    def compile(self, probe: t.Probe) -> ast.Node:
        # every scratch variable has its slots from the start: a temporary never
        # shares one with a variable (which then reads 0 until assigned); a
        # variable's type is its first assignment's (typed in program order first)
        typer = ProbeCompiler({}, self.site, stop=None, name_index=self.name_index,
                              placed=lambda lay, key: None, analysis=self.analysis, typing=True)
        for s in _stmts(probe.body):
            if isinstance(s, t.Assign) and isinstance(s.target, t.Scratch):
                typer.declare(s.target.name, typer.value(s.value).type, s.loc)
            elif isinstance(s, t.Declare) and s.type is not None:
                typer.declare(s.name, self.types.named(s.type, s.loc), s.loc)
            elif isinstance(s, t.ForMap):
                # each loop's variable has its own type: its slots hold the largest
                ct = for_map_type(self.analysis, s)
                have = typer.var_types.get(s.var)
                if have is None or have.size < ct.size:
                    typer.var_types[s.var] = ct
        self.var_types = typer.var_types
        for name, ct in self.var_types.items():
            self.locals.var(name, ct.size // 8 if ct.kind == "tuple" else
                            width(kind_of(ct)) if ct.kind in ("str", "inet") else 1)
        if any(isinstance(s, t.Return) for s in _stmts(probe.body)):
            self.returned = self.locals.take()
        body = self.block(probe.body)
        if probe.pred is not None:
            body = ast.If(self.expr(probe.pred), body)
        if self.site.guard is not None:
            body = ast.If(self.site.guard, body)
        if self.stop is not None:
            body = ast.If(ast.lnot(self.stop), body)
        return ast.Frame(self.locals.high, body)

    # --- statements ------------------------------------------------------------------------
    def block(self, stmts: tuple[t.Stmt, ...]) -> ast.Node:
        out: list[ast.Node] = []
        for i, s in enumerate(stmts):
            out.append(self.stmt(s))
            guard = self.goes_on(s) if i + 1 < len(stmts) else None
            if guard is not None:
                # what follows runs only if the action did not return, nor the loop
                # break or continue
                out.append(ast.If(guard, self.block(stmts[i + 1:])))
                break
        return ast.Seq(tuple(out))

    def goes_on(self, s: t.Stmt) -> ast.Node | None:
        """The condition that what follows ``s`` runs (None: always)."""
        conds: list[ast.Node] = []
        if self.returned is not None and _may_return(s):
            conds.append(self.returned == 0)
        if self.loops and _may_jump(s):
            broken, continued = self.loops[-1]
            conds += [ast.lnot(broken), ast.lnot(continued)]
        if not conds:
            return None
        out = conds[0]
        for c in conds[1:]:
            out = ast.land(out, c)
        return out

    def loop(self, s: t.While) -> ast.Node:
        """A loop as ``bound`` copies of one pass (the snippets have no backward jump):
        each runs while the loop has not ended (its condition false, a break, the
        action's return); a continue skips the rest of the body, not the step.  A
        loop whose condition still holds after the last copy stops there."""
        from .parser import MAX_LOOP

        mark = self.locals.mark()
        broken, continued = self.locals.take(), self.locals.take()
        self.loops.append((broken, continued))
        try:
            cond = self.expr(s.cond)
            body = self.block(s.body)
            step = self.block(s.step) if s.step else None
        finally:
            self.loops.pop()
        alive: ast.Node = ast.lnot(broken)
        if self.returned is not None:
            alive = ast.land(alive, self.returned == 0)
        parts: list[ast.Node] = [continued.assign(0), body]
        if step is not None:
            parts.append(ast.If(alive, step))
        one = ast.If(alive, ast.If(cond, ast.Seq(tuple(parts)), broken.assign(1)))
        self.locals.release(mark)
        bound = MAX_LOOP if s.bound is None else s.bound
        return ast.Seq((broken.assign(0), *([one] * bound)))

    def for_map(self, s: t.ForMap) -> ast.Node:
        """``for ($kv : @m)`` in a kernel probe's action: the body copied once per record
        of the map (its capacity, max_map_keys), each copy running when its record was
        handed out and holds a key (present), ``$kv`` its key and value read there.  A
        map whose copies would make more than MAX_UNROLLED statements is refused:
        bpftrace walks the map with bpf_for_each_map_elem, a snippet has no loop."""
        from .parser import MAX_UNROLLED, TraceLimit, emitted_count

        lay = self.layouts[s.map.name]
        per = emitted_count(s.body) + 1
        if lay.capacity * per > MAX_UNROLLED:
            raise TraceLimit(f"for over {s.map.name} in a kernel probe's action: the map holds "
                             f"up to {lay.capacity} keys, and the loop is its body copied once "
                             f"per key ({lay.capacity} x {per} statements, more than "
                             f"{MAX_UNROLLED}): set a smaller max_map_keys, or loop in an END or "
                             "interval action", s.loc)
        ct = for_map_type(self.analysis, s)
        outer = self.var_types.get(s.var)
        self.var_types[s.var] = ct
        self.defined.add(s.var)
        mark = self.locals.mark()
        broken, continued = self.locals.take(), self.locals.take()
        self.loops.append((broken, continued))
        try:
            body = self.block(s.body)
        finally:
            self.loops.pop()
            if outer is not None:
                self.var_types[s.var] = outer
        alive: ast.Node = ast.lnot(broken)
        if self.returned is not None:
            alive = ast.land(alive, self.returned == 0)
        base = self.locals.var(s.var).slot
        assert lay.used is not None
        used = self.locals.take()
        passes: list[ast.Node] = [broken.assign(0), used.assign(ast.Var(lay.used))]
        for r in range(lay.capacity):
            words = [lay.word(r, lay.key0 + j) for j in range(lay.nkeys)]
            words += self.record_value(lay, r)
            bind = [ast.Local(base + i).assign(w) for i, w in enumerate(words)]
            here = ast.land(ast.ult(ast.Const(r), used), lay.word(r, lay.present) != 0)
            passes.append(ast.If(alive, ast.If(here, ast.Seq((continued.assign(0), *bind,
                                                                 body)))))
        self.locals.release(mark)
        return ast.Seq(tuple(passes))

    def record_value(self, lay: MapLayout, r: int) -> list[ast.Node]:
        """The words of record ``r``'s value as the program reads it: an aggregation's
        integer (min and max unbiased, avg the quotient), else the words held."""
        kind = lay.type.kind
        w = lay.word(r, lay.value0)
        if kind in ("min", "max"):
            return [ast.If(w == 0, ast.Const(0), (w if kind == "max" else ~w) ^ ast.Const(SIGN))]
        if kind == "avg":
            n = lay.word(r, lay.value0 + 1)
            return [ast.If(n == 0, ast.Const(0), w / n)]
        return [lay.word(r, lay.value0 + i) for i in range(width(kind or "int"))]

    def stmt(self, s: t.Stmt) -> ast.Node:
        if isinstance(s, t.Return):
            assert self.returned is not None
            return self.returned.assign(1)
        if isinstance(s, t.Declare):
            return ast.Seq(())
        if isinstance(s, t.While):
            return self.loop(s)
        if isinstance(s, t.ForMap):
            return self.for_map(s)
        if isinstance(s, t.Break | t.Continue):
            assert self.loops
            broken, continued = self.loops[-1]
            return (broken if isinstance(s, t.Break) else continued).assign(1)
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
        name = s.target.name
        ct = self.var_types.get(name, INT64)
        v = self.value(s.value)
        self.defined.add(name)
        if ct.kind in ("str", "inet", "tuple"):
            if s.op != "=":
                raise TraceSemanticError(f"a value of type {ct.name} can only be assigned", s.loc)
            if ct.kind == "tuple":
                if v.type.kind != "tuple" or v.type.extra["kinds"] != ct.extra["kinds"] \
                        or v.words is None:
                    raise TraceSemanticError(f"${name} holds a tuple of other types", s.value.loc)
                words = v.words
            elif ct.kind == "inet":
                if v.type.kind != "inet" or v.words is None:
                    raise TraceSemanticError(f"${name} holds an address (ntop), not "
                                             f"{v.type.name}", s.value.loc)
                words = v.words
            else:
                words = self.text_words(v, ct.size, s.value.loc)
            base = self.locals.var(name).slot
            return ast.Seq(tuple(ast.Local(base + i).assign(w) for i, w in enumerate(words)))
        value = v.scalar(s.value.loc)
        var = self.locals.var(name)
        if s.op != "=":
            value = self.binop(s.op[:-1], var, value)
        return var.assign(value)

    def statement_call(self, call: t.Call) -> ast.Node:
        if call.name == "printf":
            return self.printf(call)
        if call.name == "exit":
            if self.typing:
                return ast.Seq(())
            assert self.stop is not None
            # the flag holds the exit code + 1 (non-zero: stopped)
            status = (self.expr(call.args[0]) & ast.Const(0xFF)) + 1 if call.args \
                else ast.Const(1)
            return self.stop.assign(status)
        if call.name == "delete" and len(call.args) == 2:
            ref0, key = call.args
            assert isinstance(ref0, t.MapRef)
            keys = key.items if isinstance(key, t.Tuple) else (key,)
            return self.statement_call(t.Call(call.loc, "delete",
                                              (t.MapRef(ref0.loc, ref0.name, tuple(keys)),),
                                              call.name_loc))
        if self.typing:
            return ast.Seq(())
        if call.name == "join":
            if self.typing:
                return ast.Seq(())
            assert self.ring is not None
            mark = self.locals.mark()
            code: list[ast.Node] = []
            array = self.leaf(self.expr(call.args[0]), code)
            words: list[ast.Node] = []
            for i in range(JOIN_ARGS):
                p = self.leaf(ast.load(array + 8 * i, 8, user=True), code)
                words += [self.leaf(w, code) for w in
                          self.read_string(p, JOIN_STRLEN, JOIN_STRLEN // 8, user=True)]
            fmt = (JOIN_FORMAT + _join_delimiter(call), (f"str:{JOIN_STRLEN}",) * JOIN_ARGS)
            code.append(self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), words))
            self.locals.release(mark)
            return ast.Seq(tuple(code))
        if call.name == "time":
            if self.typing:
                return ast.Seq(())
            assert self.ring is not None
            mark = self.locals.mark()
            fmt = (TIME_FORMAT + _time_format(call), ())
            event = self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), [])
            self.locals.release(mark)
            return event
        if call.name == "print" and call.args and not isinstance(call.args[0], t.MapRef):
            # print(value): an event whose argument is the value
            assert self.ring is not None
            mark = self.locals.mark()
            code = []
            args = [self.leaf(w, code) for w in self.key_words(call.args[0])]
            fmt = (VALUE_FORMAT, self.print_kinds(call.args[0]))
            code.append(self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), args))
            self.locals.release(mark)
            return ast.Seq(tuple(code))
        if call.name == "cat":
            assert self.ring is not None and isinstance(call.args[0], t.Str)
            mark = self.locals.mark()
            fmt = (CAT_FORMAT + call.args[0].value, ())
            event = self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), [])
            self.locals.release(mark)
            return event
        ref = call.args[0]
        assert isinstance(ref, t.MapRef)
        lay = self.layouts[ref.name]
        if call.name == "print" or (call.name in ("clear", "zero") and lay.keyed):
            # the client prints (clears) the map when it drains this event: the map as
            # it is then, a little after the probe fired (the table has no loop here)
            assert self.ring is not None
            mark = self.locals.mark()
            fmt = (map_format(call), ())
            event = self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), [])
            self.locals.release(mark)
            return event
        mark = self.locals.mark()
        acc = self.access(ref, claim=False)
        # clear() of a map without keys leaves it present at 0 (bpftrace's "@: 0")
        first = lay.present + (1 if call.name == "clear" and not lay.keyed else 0)
        zero = ast.Seq(tuple(lay.word(acc.slot, i).assign(0) for i in range(first, lay.stride)))
        self.locals.release(mark)
        return ast.Seq((*acc.setup, zero if acc.found is None else ast.If(acc.found, zero)))

    def printf(self, call: t.Call) -> ast.Node:
        assert isinstance(call.args[0], t.Str)
        if self.typing:
            return ast.Seq(())
        assert self.ring is not None
        mark = self.locals.mark()
        code: list[ast.Node] = []
        args = [self.leaf(w, code) for a in call.args[1:] for w in self.key_words(a)]
        fmt = (call.args[0].value, self.printf_kinds(call.args[1:]))
        if fmt not in self.ring.formats:
            raise TraceSemanticError("printf's arguments have other types at this point than "
                                     "where the program was typed", call.loc)
        code.append(self.ring.emit(self.locals.take(), self.ring.formats.index(fmt), args))
        self.locals.release(mark)
        return ast.Seq(tuple(code))

    def print_kinds(self, e: t.Expr) -> tuple[str, ...]:
        """The kinds print(e)'s event holds: a tuple's one kind (printed whole, as
        bpftrace prints it), else printf's."""
        if isinstance(e, t.Tuple) or self.value(e).type.kind == "tuple":
            return (kind_of(self.value(e).type, self.analysis.strlen),)
        return self.printf_kinds((e,))

    def printf_kinds(self, args: tuple[t.Expr, ...]) -> tuple[str, ...]:
        """The kind of each printf argument, as the event ring holds it (a pointer as
        the integer its conversion formats)."""
        return tuple("int" if k == "ptr" else k for a in args for k in self.key_kinds(a))

    # --- map updates -------------------------------------------------------------------------
    def assign_map(self, ref: t.MapRef, op: str, value: t.Expr) -> ast.Node:
        if self.typing:
            for k in ref.keys:
                self.value(k)
            return ast.Seq(())
        lay = self.layouts[ref.name]
        kind = lay.type.kind
        mark = self.locals.mark()
        code: list[ast.Node] = []
        arg: ast.Node | None = None
        words: list[ast.Node] | None = None
        if isinstance(value, t.Call) and value.name in AGGREGATIONS and op == "=":
            if value.args:
                arg = self.leaf(self.expr(value.args[0]), code)
        elif kind is not None and (width(kind) > 1 or kind in ("comm", "inet")
                                   or kind.startswith("str:")):
            words = [self.leaf(w, code) for w in self.kind_words(value, kind)]
        else:
            arg = self.leaf(self.kind_words(value, kind or "int")[0], code)
        acc = self.access(ref, claim=True, into=code)
        if words is not None:
            update = ast.Seq((lay.word(acc.slot, lay.present).assign(1),
                              *(lay.word(acc.slot, lay.value0 + i).assign(w)
                                for i, w in enumerate(words))))
        else:
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
            code += [*hash_into(keys, hi), hi.assign(hi & ast.Const(HI)),
                     i.assign(ast.lshr(hi, 64 - lay.bits))]
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
        """The words a key (or a printf argument) is held in: comm's name takes two,
        a string one per 8 bytes; a tuple its items' words."""
        if isinstance(k, t.Tuple):
            return [w for x in k.items for w in self.key_words(x)]
        c = constant_key(k, self.site, self.name_index)
        if c is not None:
            return [ast.Const(c)]
        if isinstance(k, t.Builtin) and k.name in NAMED_KEYS:
            return self.kind_words(k, NAMED_KEYS[k.name])
        # lowered once: a key reading a map keyed by a map read... is linear, not 2^n
        v = self.value(k)
        if v.type.kind == "tuple":
            assert v.words is not None
            return list(v.words)
        return self.kind_words(k, kind_of(v.type, self.analysis.strlen), v)

    def key_kinds(self, k: t.Expr) -> tuple[str, ...]:
        """The kinds of a key's (or printf argument's) parts."""
        if isinstance(k, t.Tuple):
            return tuple(x for item in k.items for x in self.key_kinds(item))
        if isinstance(k, t.Builtin) and k.name in NAMED_KEYS:
            return (NAMED_KEYS[k.name],)
        ct = self.value(k).type
        if ct.kind == "tuple":
            return tuple(ct.extra["kinds"])
        return (kind_of(ct, self.analysis.strlen),)

    def item_kind(self, e: t.Expr) -> str:
        """The kind a tuple's item ``e`` is held as (its words are ``key_words(e)``)."""
        kinds = self.key_kinds(e)
        if len(kinds) == 1 and not isinstance(e, t.Tuple):
            return kinds[0]
        return kind_of(self.value(e).type, self.analysis.strlen)

    def item(self, kind: str, words: list[ast.Node]) -> Val:
        """A value of ``kind`` held in ``words`` (a tuple's item)."""
        ct = kind_type(kind)
        if len(words) == 1 and not is_text(kind) and not kind.startswith(
                (TUPLE, "bytes:", "buf:", "kstack:", "ustack:")) and kind != "inet":
            return Val(ct, words[0])
        return Val(ct, words=words)

    def value_kind(self, e: t.Expr) -> str:
        """The kind a map assigned ``e`` holds (``func`` as a value: the function's
        address, printed by name, the kind ``ksym()`` gives, as bpftrace's two are
        one type)."""
        if isinstance(e, t.Builtin) and e.name == "func":
            return "kaddr"
        if isinstance(e, t.Builtin) and e.name == "probe":
            return NAMED_KEYS[e.name]
        return kind_of(self.value(e).type, self.analysis.strlen)

    def kind_words(self, e: t.Expr, kind: str, v: Val | None = None) -> list[ast.Node]:
        """The words of ``e`` held as ``kind`` (a string padded or cut to its size);
        ``v``: ``e`` already lowered."""
        if isinstance(e, t.Builtin) and e.name == "func" and kind == "kaddr":
            if self.typing or self.lookup is None or not self.site.function:
                return [ast.Const(0)]
            return [ast.Const(self.lookup(self.site.function))]
        if isinstance(e, t.Builtin) and e.name in ("func", "probe"):
            c = constant_key(e, self.site, self.name_index)
            if c is None:
                raise TraceSemanticError(f"{e.name} has no value here", e.loc)
            return [ast.Const(c)]
        v = self.value(e) if v is None else v
        if kind == "comm" or kind.startswith("str:"):
            return self.text_words(v, 16 if kind == "comm" else int(kind[4:]), e.loc)
        if kind.startswith(TUPLE):
            return self.tuple_words(e, kind, v)
        if kind == "inet" or kind.startswith(("kstack:", "ustack:", "buf:", "bytes:")):
            if v.words is None:
                raise TraceSemanticError(f"a value of type {v.type.name or v.type.kind} where "
                                         f"a {_kind_text(kind)} is held", e.loc)
            return v.words
        if kind in NAMED_WORDS:
            if v.type.kind != kind:
                raise TraceSemanticError(f"a value of type {v.type.name or v.type.kind} where "
                                         f"a {_kind_text(kind)} is held", e.loc)
            return [v.node]
        return [v.scalar(e.loc)]

    def tuple_words(self, e: t.Expr, kind: str, v: Val) -> list[ast.Node]:
        """The words of tuple ``v`` held as tuple ``kind``: item by item (a string
        padded to the map's longer one)."""
        items = tuple_items(kind)
        have = v.type.extra.get("items", ()) if v.type.kind == "tuple" else ()
        if v.words is None or len(have) != len(items) \
                or _wider(kind, kind_of(v.type, self.analysis.strlen)) != kind:
            raise TraceSemanticError(f"a tuple {_kind_text(kind)} is held here, not "
                                     f"{_kind_text(kind_of(v.type, self.analysis.strlen))}",
                                     e.loc)
        if kind_of(v.type, self.analysis.strlen) == kind:
            return list(v.words)
        code: list[ast.Node] = []
        held = Val(v.type, words=[self.leaf(w, code) for w in v.words])
        out = [w for i, k in enumerate(items)
               for w in self.kind_words(e, k, self.tuple_field(held, str(i), e.loc))]
        if code:
            out[0] = ast.Seq((*code, out[0]))
        return out

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
        """``e``'s integer value."""
        return self.value(e).scalar(e.loc)

    def value(self, e: t.Expr) -> Val:
        """``e`` lowered with its type."""
        if isinstance(e, t.Int):
            return Val(INT64 if e.value < 1 << 63 else UINT64, ast.Const(e.value & MASK))
        if isinstance(e, t.Str):
            raw = e.value.encode()
            size = max(8, -(-(len(raw) + 1) // 8) * 8)
            return Val(string(size), words=_const_words(raw, size))
        if isinstance(e, t.Builtin):
            return self.builtin(e)
        if isinstance(e, t.Scratch):
            if e.name not in self.var_types:
                raise TraceSemanticError(f"Undefined or undeclared variable: ${e.name}", e.loc)
            if not self.typing and e.name not in self.defined:
                raise TraceSemanticError(f"Undefined or undeclared variable: ${e.name}", e.loc)
            ct = self.var_types[e.name]
            var = self.locals.var(e.name)
            if ct.kind == "tuple":
                return Val(ct, words=[ast.Local(var.slot + i) for i in range(ct.size // 8)])
            if ct.kind in ("str", "inet"):
                return Val(ct, words=[ast.Local(var.slot + i) for i in range(width(kind_of(ct)))])
            return Val(ct, var)
        if isinstance(e, t.MapRef):
            return self.read_map(e)
        if isinstance(e, t.Binary):
            return self.binary(e)
        if isinstance(e, t.Unary):
            operand = self.value(e.operand)
            x = operand.scalar(e.operand.loc)
            node = {"!": ast.lnot, "~": lambda x: ~x, "-": lambda x: -x,
                    "+": lambda x: x}[e.op](x)
            return Val(INT64 if e.op != "+" else operand.type, node)
        if isinstance(e, t.Ternary):
            then, orelse = self.value(e.then), self.value(e.orelse)
            cond = self.expr(e.cond)
            if then.words is not None or orelse.words is not None:
                size = max(then.type.size, orelse.type.size)
                a, b = self.text_words(then, size, e.loc), self.text_words(orelse, size, e.loc)
                c = self.locals.take() if not self.typing else ast.Local(0)
                return Val(string(size), words=[ast.Seq((c.assign(cond), ast.If(c, x, y)))
                                                if i == 0 else ast.If(c, x, y)
                                                for i, (x, y) in enumerate(zip(a, b, strict=True))])
            return Val(then.type, ast.If(cond, then.scalar(e.then.loc), orelse.scalar(e.orelse.loc)))
        if isinstance(e, t.Cast):
            return self.cast(e)
        if isinstance(e, t.Field):
            return self.field(self.value(e.operand), e.name, e.loc, e.operand)
        if isinstance(e, t.Index):
            return self.index(e)
        if isinstance(e, t.Deref):
            base = self.value(e.operand)
            if base.type.kind == "int" and base.type.size == 8:
                # an address held as an integer (kaddr("avenrun")): a u64 there
                return self.at(UINT64, base.node, e.loc)
            if base.type.kind != "ptr":
                raise TraceSemanticError(f"cannot dereference a value of type "
                                         f"{base.type.name or base.type.kind}", e.loc)
            return self.at(base.type.ref, base.node, e.loc)
        if isinstance(e, t.SizeOf):
            ct = self.types.named(e.type, e.loc) if e.type is not None else \
                self.value(e.operand).type  # type: ignore[arg-type]
            return Val(UINT64, ast.Const(ct.size))
        if isinstance(e, t.OffsetOf):
            ct = self.types.named(e.type, e.loc)
            bits = 0
            for name in e.path:
                m = ct.member(name) if ct.kind == "record" else None
                if m is None:
                    raise TraceSemanticError(f"{ct.name} has no field named {name}", e.loc)
                bits += m[0]
                ct = m[2]
            return Val(UINT64, ast.Const(bits // 8))
        if isinstance(e, t.Tuple):
            return Val(tuple_type([self.item_kind(x) for x in e.items]), words=self.key_words(e))
        if isinstance(e, t.Call):
            return self.function(e)
        raise TraceSemanticError("this expression has no value", e.loc)

    def binary(self, e: t.Binary) -> Val:
        left, right = self.value(e.left), self.value(e.right)
        texts = [v.words is not None and v.type.kind == "str" or v.type.is_string_like
                 if v.type.kind in ("str", "array") else False for v in (left, right)]
        if e.op in ("==", "!=") and any(texts):
            if not all(texts):
                raise TraceSemanticError("a string can only be compared with a string", e.loc)
            size = max(left.type.size, right.type.size)
            a, b = self.text_words(left, size, e.loc), self.text_words(right, size, e.loc)
            same: ast.Node = ast.Const(1)
            for x, y in zip(a, b, strict=True):
                same = ast.land(same, x == y)
            return Val(INT64, same if e.op == "==" else ast.lnot(same))
        x, y = left.scalar(e.left.loc), right.scalar(e.right.loc)
        if e.op == "&&":
            return Val(INT64, ast.land(x, y))
        if e.op == "||":
            return Val(INT64, ast.lor(x, y))
        if e.op in ("+", "-") and left.type.kind == "ptr" and right.type.kind == "int":
            scale = max(1, left.type.ref.size) if left.type.ref.kind != "void" else 1
            return Val(left.type, self.binop(e.op, x, y * scale if scale > 1 else y, e.loc))
        unsigned = (left.type.kind == "ptr" or right.type.kind == "ptr"
                    or (left.type.kind == "int" and not left.type.signed and left.type.size == 8)
                    or (right.type.kind == "int" and not right.type.signed and right.type.size == 8))
        if unsigned and e.op in ("<", "<=", ">", ">=") and not (isinstance(x, ast.Const)
                                                                 or isinstance(y, ast.Const)):
            op = {"<": ast.ult, "<=": ast.ule, ">": ast.ugt, ">=": ast.uge}[e.op]
            return Val(INT64, op(x, y))
        if unsigned and e.op == ">>":
            return Val(UINT64, ast.lshr(x, y))
        if unsigned and e.op in ("/", "%") and not isinstance(y, ast.Const):
            pass    # the snippets' division is signed; kernel values above 2**63 are rare
        node = self.binop(e.op, x, y, e.loc)
        return Val(INT64 if e.op in COMPARES else (UINT64 if unsigned else INT64), node)

    def cast(self, e: t.Cast) -> Val:
        ct = self.types.named(e.type, e.loc)
        v = self.value(e.operand)
        if ct.kind == "record":
            # (struct x)ptr is bpftrace's spelling of the record a pointer points to
            if v.type.kind in ("ptr", "int"):
                return Val(ct, v.scalar(e.operand.loc))
            raise TraceSemanticError(f"cannot cast to {ct.name}", e.loc)
        if ct.kind == "ptr":
            return Val(ct, v.scalar(e.operand.loc))
        if ct.kind == "int" and v.type.kind == "bytes" and v.words is not None:
            return Val(ct, _fit(v.words[0], ct))    # the bytes read as memory holds them
        if ct.kind == "int":
            return Val(ct, _fit(v.scalar(e.operand.loc), ct))
        if ct.kind == "str":
            return Val(ct, words=self.text_words(v, ct.size, e.loc))
        raise TraceSemanticError(f"cannot cast to {ct.name}", e.loc)

    def field(self, base: Val, name: str, loc: Loc, operand: t.Expr | None = None) -> Val:
        if base.type.kind == "tuple":
            return self.tuple_field(base, name, loc)
        if base.type.kind == "args":
            for arg_name, ct, node in base.type.extra["args"]:
                if arg_name == name:
                    return Val(ct, node)
            fields = ", ".join(n for n, _, _ in base.type.extra["args"])
            raise TraceSemanticError(f"{self.site.probe or 'this probe'} has no argument named "
                                     f"{name} (it has: {fields})", loc)
        ct = base.type
        address = base.node
        if ct.kind == "ptr":
            ct = ct.ref
        if ct.kind != "record":
            raise TraceSemanticError(f"cannot access field {name!r} of a value of type "
                                     f"{base.type.name or base.type.kind}", loc)
        m = ct.member(name)
        if m is None:
            have = ct.member_names() if ct.member_names is not None else []
            hint = f" (it has: {', '.join(have[:12])}{', ...' if len(have) > 12 else ''})" \
                if have else ""
            raise TraceSemanticError(f"{ct.name} has no field named {name}{hint}", loc)
        bits, bitfield, mt = m
        at = address + ast.Const(bits // 8) if bits >= 8 else address
        if bitfield:
            first = (bits // 8)
            shift = bits - first * 8
            size = 8 if shift + bitfield > 32 else 4 if shift + bitfield > 16 else \
                2 if shift + bitfield > 8 else 1
            raw = ast.load(address + ast.Const(first) if first else address, size, False)
            value = ast.lshr(raw, shift) & ast.Const((1 << bitfield) - 1) if shift else \
                raw & ast.Const((1 << bitfield) - 1)
            return Val(mt, value)
        return self.at(mt, at, loc)

    def tuple_field(self, base: Val, name: str, loc: Loc) -> Val:
        """``$t.N``: the tuple's item N (from 0), a value of its own kind."""
        items = list(base.type.extra.get("items") or base.type.extra["kinds"])
        if not name.isdigit() or int(name) >= len(items):
            raise TraceSemanticError(f"a tuple's items are .0 to .{len(items) - 1}, not .{name}",
                                     loc)
        assert base.words is not None
        i = int(name)
        at = sum(width(k) for k in items[:i])
        part = list(base.words[at:at + width(items[i])])
        if at and not isinstance(base.words[0], ast.Const | ast.Local):
            part[0] = ast.Seq((base.words[0], part[0]))     # the tuple's code is in word 0's
        return self.item(items[i], part)

    def at(self, ct: CType, address: Any, loc: Loc) -> Val:
        """The value of type ``ct`` at ``address``: read for an integer or a pointer,
        the address itself for a record or an array."""
        if ct.kind in ("record", "array"):
            return Val(ct, address)
        if ct.kind == "int":
            return Val(ct, self.read(address, ct.size if ct.size in (1, 2, 4, 8) else 8,
                                     ct.signed))
        if ct.kind == "ptr":
            return Val(ct, self.read(address, 8, False))
        raise TraceSemanticError(f"cannot read a value of type {ct.name or ct.kind}", loc)

    def read(self, address: Any, size: int, signed: bool) -> ast.Node:
        """``size`` bytes at ``address``, fault-safe: through the kernel's user-memory
        reader for an address in the lower half (a syscall's buffer, a user struct a
        kernel pointer leads to), where the kernel has one."""
        if not self.user_reads:
            return ast.load(address, size, signed)
        if not isinstance(address, ast.Const | ast.Local):
            p = self.locals.take()
            return ast.Seq((p.assign(address), self._split_read(p, size, signed)))
        return self._split_read(address, size, signed)

    def _split_read(self, p: Any, size: int, signed: bool) -> ast.Node:
        return ast.If(ast.ult(p, ast.Const(1 << 63)), ast.load(p, size, signed, user=True),
                      ast.load(p, size, signed))

    def index(self, e: t.Index) -> Val:
        base = self.value(e.operand)
        ct = base.type
        if ct.kind == "str" and base.words is not None:
            # a string's byte: a constant index only
            i = self.expr(e.index)
            if not isinstance(i, ast.Const) or not 0 <= i.value < 8 * len(base.words):
                raise TraceSemanticError(f"a string's index must be a constant from 0 to "
                                         f"{8 * len(base.words) - 1}", e.index.loc)
            k, shift = divmod(i.value, 8)
            w = base.words[k]
            if k and not isinstance(base.words[0], ast.Const | ast.Local):
                w = ast.Seq((base.words[0], w))     # the string's read is in word 0's code
            if isinstance(w, ast.Const):
                return Val(integer(1, False), ast.Const((w.value >> (8 * shift)) & 0xFF))
            return Val(integer(1, False), ast.lshr(w, 8 * shift) & ast.Const(0xFF)
                       if shift else w & ast.Const(0xFF))
        if ct.kind == "array":
            elem = ct.ref
        elif ct.kind == "ptr":
            elem = ct.ref
        else:
            raise TraceSemanticError(f"cannot index a value of type {ct.name or ct.kind}", e.loc)
        i = self.expr(e.index)
        if ct.kind == "array" and isinstance(i, ast.Const) and not 0 <= i.value < max(ct.count, 1):
            raise TraceSemanticError(f"index {i.value} is outside {ct.name}", e.index.loc)
        offset = i * elem.size if not isinstance(i, ast.Const) else ast.Const(i.value * elem.size)
        return self.at(elem, base.node + offset, e.loc)

    def text_words(self, v: Val, size: int, loc: Loc) -> list[ast.Node]:
        """``v`` as a string of ``size`` bytes (a multiple of 8): its words, cut or
        padded with zeros; a char array is read up to its first NUL."""
        n = -(-size // 8)
        if v.words is not None:
            words = list(v.words[:n])
            return words + [ast.Const(0)] * (n - len(words))
        if v.type.kind == "array" and v.type.is_string_like:
            return self.read_string(v.node, min(v.type.size, size), n, user=False)
        raise TraceSemanticError(f"a value of type {v.type.name or v.type.kind} is not a string",
                                 loc)

    def read_string(self, address: Any, limit: int, n: int, user: bool | None) -> list[ast.Node]:
        """The words of the NUL-terminated string at ``address``, at most ``limit``
        bytes, in ``n`` words (zeros past its end).  ``user``: a user-space address
        (None: decided by the address's half of the address space)."""
        if self.typing:
            return [ast.Const(0)] * n
        p, done, z = self.locals.take(), self.locals.take(), self.locals.take()
        out: list[ast.Node] = []
        code: list[ast.Node] = [p.assign(address), done.assign(0)]
        ones, highs = ast.Const(0x0101010101010101), ast.Const(0x8080808080808080)
        for i in range(n):
            w = self.locals.take()
            keep = min(8, limit - 8 * i)
            if keep <= 0:
                out.append(ast.Const(0))
                continue
            load: ast.Node
            if user is None:
                load = ast.If(ast.ult(p, ast.Const(1 << 63)), ast.load(p + 8 * i, 8, user=True),
                              ast.load(p + 8 * i, 8))
            else:
                load = ast.load(p + 8 * i, 8, user=user)
            code.append(w.assign(ast.If(done, ast.Const(0), load)))
            if keep < 8:
                code.append(w.assign(w & ast.Const((1 << (8 * keep)) - 1)))
            # the first zero byte: the lowest set bit of (w - 0x01..) & ~w & 0x80..
            code.append(z.assign((w - ones) & ~w & highs))
            code.append(ast.If(z != 0, ast.seq(
                w.assign(w & (ast.lshr(z & -z, 7) - 1)), done.assign(1))))
            out.append(w)
        out[0] = ast.Seq((*code, out[0]))
        return out

    def builtin(self, e: t.Builtin) -> Val:
        name, kind = e.name, self.site.kind
        if name not in BUILTINS and name not in OTHER_BUILTINS:
            value = self.types.enumerator(name)
            if value is None:
                raise TraceSemanticError(f"Unknown identifier: '{name}'", e.loc)
            return Val(INT64, ast.Const(value & MASK))
        if name == "comm":
            return Val(COMM, words=[ast.Comm(i) for i in range(COMM_WORDS)])
        if name in ("func", "probe"):
            c = constant_key(e, self.site if kind != "client" else None, self.name_index)
            return Val(NAME, ast.Const(0 if c is None else c))
        if name == "curtask":
            task = self.types.named("struct task_struct *", e.loc) if self.types.btf is not None \
                else pointer(CType("record", 0, name="struct task_struct"))
            return Val(task, ast.CurrentTask())
        if name == "args":
            if self.site.args is None:
                if kind == "client":
                    return Val(CType("args", 0, name="args", extra={"args": ()}), ast.Const(0))
                raise TraceSemanticError("args is only available in kfunc, kretfunc and "
                                         "tracepoint probes", e.loc)
            return Val(CType("args", 0, name="args", extra={"args": self.site.args}), ast.Const(0))
        if name == "kstack":
            return self.kstack(e, "bpftrace", KSTACK_DEPTH)
        if name == "ustack":
            return self.ustack(e, "bpftrace", KSTACK_DEPTH)
        if name == "pcomm":       # the parent's name (newer bpftrace)
            current = self.builtin(t.Builtin(e.loc, "curtask"))
            return self.field(self.field(current, "real_parent", e.loc), "comm", e.loc)
        if name == "ppid":
            current = self.builtin(t.Builtin(e.loc, "curtask"))
            parent = self.field(current, "real_parent", e.loc)
            return Val(integer(4, False), self.field(parent, "tgid", e.loc).node)
        if name == "username":        # the uid, named by the client (ksim.trace.output)
            return Val(USERNAME_T, self.builtin(t.Builtin(e.loc, "uid")).scalar(e.loc))
        if name in ("uid", "gid"):
            cred = self.field(self.builtin(t.Builtin(e.loc, "curtask")), "cred", e.loc)
            ids = self.field(cred, name, e.loc)
            return Val(integer(4, False), self.field(ids, "val", e.loc).node) \
                if ids.type.kind == "record" else ids
        if name == "cgroup":
            v = self.builtin(t.Builtin(e.loc, "curtask"))
            for f in ("cgroups", "dfl_cgrp", "kn", "id"):
                v = self.field(v, f, e.loc)
            return Val(UINT64, v.scalar(e.loc))
        if name == "elapsed":
            # from the first hit of any probe: it stores the clock as the start
            now = self.builtin(t.Builtin(e.loc, "nsecs")).node
            if self.start is None:
                return Val(UINT64, ast.Const(0) if self.typing else now)
            first = ast.If(self.start == 0, ast.CompareExchange(self.start, ast.Const(0), now))
            return Val(UINT64, ast.Seq((first, now - self.start)))
        if name == "jiffies":
            if self.lookup is None:
                if self.typing:
                    return Val(UINT64, ast.Const(0))
                raise TraceUnsupported("jiffies needs the kernel's symbols", e.loc)
            return Val(UINT64, ast.load(ast.Const(self.lookup("jiffies_64")), 8))
        if name == "ncpus":
            return Val(UINT64, ast.Const(getattr(self, "ncpus", 1)))
        if name == "rand":
            return Val(integer(4, False), self.rand(e))
        if name == "numaid":
            return Val(integer(4, False), self.numaid())
        if name == "pid":           # the process's: its thread group's id
            return Val(integer(4, False), ast.Tgid())
        if name == "tid":
            return Val(integer(4, False), ast.Pid())
        if name == "cpu":
            return Val(integer(4, False), ast.Cpu())
        if name == "nsecs":         # the kernel's clock where it has one, else cycles
            return Val(UINT64, ast.Tsc() if self.clock is None else ast.Call(self.clock, ()))
        if name.startswith("arg"):
            if kind == "client" and self.typing:
                return Val(UINT64, ast.Const(0))
            if kind != "entry":
                raise TraceSemanticError(f"The {name} builtin can only be used at a function's "
                                         "entry (kprobe:FUNCTION)", e.loc)
            n = int(name[3:]) + self.site.arg_base
            if n > 5:
                raise TraceSemanticError(f"{name} is not in a register here (the first six "
                                         "arguments are)", e.loc)
            return Val(UINT64, ast.Arg(n))
        if name == "retval":
            if kind == "client" and self.typing:
                return Val(INT64, ast.Const(0))
            if kind != "exit":
                raise TraceSemanticError("The retval builtin can only be used with kretprobe "
                                         "or kretfunc", e.loc)
            return Val(self.site.ret or INT64, ast.RetVal() if self.site.ret is None
                       or self.site.ret.kind != "int" else _fit(ast.RetVal(), self.site.ret))
        raise TraceUnsupported(f"builtin {name} is not supported", e.loc)

    def function(self, e: t.Call) -> Val:
        name = e.name
        if name == "delete":
            # delete() as a value (newer bpftrace): the deletion, then 0
            return Val(INT64, ast.Seq((self.statement_call(e), ast.Const(0))))
        if name == "str":
            if not 1 <= len(e.args) <= 2:
                raise TraceSemanticError("str() takes a pointer and an optional length", e.loc)
            v = self.value(e.args[0])
            size = self.analysis.strlen
            limit = size
            if len(e.args) == 2:
                n = self.expr(e.args[1])
                if not isinstance(n, ast.Const):
                    raise TraceUnsupported("str() with a length computed at run time is not "
                                           "supported", e.args[1].loc)
                limit = max(1, min(n.value, size))
                size = -(-limit // 8) * 8 if limit < size else size
            if v.words is not None:
                return Val(string(size), words=self.text_words(v, size, e.loc))
            if v.type.kind == "array":
                return Val(string(size), words=self.read_string(v.node, min(limit, v.type.size),
                                                                 -(-size // 8), user=False))
            p = v.scalar(e.args[0].loc)
            return Val(string(size), words=self.read_string(p, limit, -(-size // 8), user=None))
        if name == "ksym":
            if len(e.args) != 1:
                raise TraceSemanticError("ksym() takes one address", e.loc)
            return Val(KADDR, self.expr(e.args[0]))
        if name == "kaddr":
            if len(e.args) != 1 or not isinstance(e.args[0], t.Str):
                raise TraceSemanticError("kaddr() takes a symbol's name as a string literal", e.loc)
            if self.lookup is None:
                if self.typing:
                    return Val(UINT64, ast.Const(0))
                raise TraceUnsupported("kaddr() needs the kernel's symbols", e.loc)
            return Val(UINT64, ast.Const(self.lookup(e.args[0].value)))
        if name == "ntop":
            return self.ntop(e)
        if name == "has_key":
            if len(e.args) < 1 or not isinstance(e.args[0], t.MapRef) or e.args[0].keys:
                raise TraceSemanticError("has_key() takes a map and a key: has_key(@m, k)", e.loc)
            keys = e.args[1:]
            if len(keys) == 1 and isinstance(keys[0], t.Tuple):
                keys = keys[0].items
            ref = t.MapRef(e.args[0].loc, e.args[0].name, tuple(keys))
            if self.typing:
                for k in keys:
                    self.value(k)
                return Val(INT64, ast.Const(0))
            mark = self.locals.mark()
            acc = self.access(ref, claim=False)
            lay = self.layouts[ref.name]
            present = lay.word(acc.slot, lay.present) != 0
            found = present if acc.found is None else ast.land(acc.found, present)
            self.locals.release(mark)
            return Val(INT64, ast.Seq((*acc.setup, found)) if acc.setup else found)
        if name == "strncmp":
            if len(e.args) != 3:
                raise TraceSemanticError("strncmp() takes two strings and a length", e.loc)
            n = self.expr(e.args[2])
            if not isinstance(n, ast.Const):
                raise TraceUnsupported("strncmp() with a length computed at run time is not "
                                       "supported", e.args[2].loc)
            a, b = self.value(e.args[0]), self.value(e.args[1])
            # no further than the longer string's size: past both ends they are equal
            # (a length of 10^11 made 10^10 words)
            count = max(0, min(n.value, *(8 * len(v.words) if v.words is not None
                                          else v.type.size for v in (a, b))))
            size = -(-max(1, count) // 8) * 8
            x, y = self.text_words(a, size, e.loc), self.text_words(b, size, e.loc)
            same: ast.Node = ast.Const(1)
            for i, (p, q) in enumerate(zip(x, y, strict=True)):
                keep = min(8, count - 8 * i)
                mask = ast.Const((1 << (8 * keep)) - 1 if keep < 8 else MASK)
                same = ast.land(same, (p & mask) == (q & mask))
            return Val(INT64, ast.lnot(same))
        if name in STACKS:
            mode, depth = "bpftrace", KSTACK_DEPTH
            for option in e.args:
                if isinstance(option, t.Builtin) and option.name in STACK_MODES:
                    mode = option.name
                elif isinstance(option, t.Int) and 1 <= option.value <= 127:
                    depth = option.value
                else:
                    raise TraceSemanticError(f"{name}() takes a mode (bpftrace, perf, raw) and a "
                                             "depth from 1 to 127", option.loc)
            return self.kstack(e, mode, depth) if name == "kstack" else self.ustack(e, mode, depth)
        if name == "buf":
            return self.buf(e)
        if name == "path":
            return self.path(e)
        if name == "cgroup_path":
            # the id, printed as its cgroup's path by the client (which asks the traced
            # machine: ksim.trace.session)
            if not 1 <= len(e.args) <= 2:
                raise TraceSemanticError("cgroup_path() takes a cgroup's id (and a filter)",
                                         e.loc)
            if len(e.args) == 2:
                raise TraceUnsupported("cgroup_path() with a filter is not supported", e.args[1].loc)
            return Val(CGROUP_PATH, self.expr(e.args[0]))
        if name == "strftime":
            if len(e.args) != 2 or not isinstance(e.args[0], t.Str):
                raise TraceSemanticError("strftime() takes a format string and a time in ns",
                                         e.loc)
            if "\0" in e.args[0].value:
                raise TraceSemanticError("strftime(): the format has a NUL character", e.loc)
            return Val(CType("tm", 8, name="timestamp", extra={"format": e.args[0].value}),
                       self.expr(e.args[1]))
        if name in ("strerror", "syscall_name"):
            if len(e.args) != 1:
                raise TraceSemanticError(f"{name}() takes one integer", e.loc)
            n = self.expr(e.args[0])
            if name == "syscall_name":
                self.syscall_table(e)
            return Val(STRERROR if name == "strerror" else SYSCALL_NAME, n)
        if name == "strcontains":
            return self.strcontains(e)
        if name == "len":
            return self.map_len(e)
        if name == "macaddr":
            return self.macaddr(e)
        if name == "pton":
            return self.pton(e)
        if name == "bswap":
            if len(e.args) != 1:
                raise TraceSemanticError("bswap() takes one integer", e.loc)
            v = self.value(e.args[0])
            operand: ast.Node = v.scalar(e.loc)
            size = v.type.size if v.type.kind == "int" else 8
            setup: tuple[ast.Node, ...] = ()
            if not isinstance(operand, ast.Const | ast.Local):
                # its bytes read from a slot: the operand computed once, not once per
                # byte (nested bswaps grew 8^n)
                held = self.locals.take()
                setup, operand = (held.assign(operand),), held
            out: ast.Node = ast.Const(0)
            for i in range(size):
                byte = ast.lshr(operand, 8 * i) & ast.Const(0xFF)
                out = out | (byte << ast.Const(8 * (size - 1 - i)))
            return Val(integer(size, False), ast.Seq((*setup, out)) if setup else out)
        raise TraceUnsupported(f"function {name}() is not supported", e.name_loc or e.loc)

    def numaid(self) -> ast.Node:
        """The NUMA node of the cpu: the kernel's per-cpu ``numa_node`` (what
        numa_node_id() reads), at ``__per_cpu_offset[cpu]``; 0 on a kernel without
        NUMA (no such variable: its numa_node_id() is 0)."""
        if self.typing or self.lookup is None:
            return ast.Const(0)
        try:
            node, offsets = self.lookup("numa_node"), self.lookup("__per_cpu_offset")
        except TraceError:
            return ast.Const(0)
        base = ast.load(ast.Const(offsets) + ast.Cpu() * ast.Const(8), 8)
        return ast.load(base + ast.Const(node), 4)

    def syscall_table(self, e: t.Call) -> None:
        """syscall_name() names a number by the kernel's own sys_call_table (read by the
        client when it prints): refused where the kernel has none."""
        if self.typing:
            return
        try:
            if self.lookup is None:
                raise TraceSemanticError("no symbols")
            self.lookup("sys_call_table")
        except TraceError:
            raise TraceUnsupported("syscall_name() names a system call by the kernel's "
                                   "sys_call_table, and this kernel has no such symbol",
                                   e.name_loc or e.loc) from None

    def strcontains(self, e: t.Call) -> Val:
        """strcontains(s, "literal"): whether the literal's bytes appear in ``s`` before
        its NUL (a literal has no NUL, so a match never crosses it); every start is
        compared byte by byte, so the needle must be a constant."""
        if len(e.args) != 2:
            raise TraceSemanticError("strcontains() takes two strings", e.loc)
        hay = self.value(e.args[0])
        needle = e.args[1]
        if not isinstance(needle, t.Str):
            if self.value(needle).words is None:
                raise TraceSemanticError("strcontains() takes two strings", needle.loc)
            raise TraceUnsupported("strcontains() with a needle that is not a string literal "
                                   "is not supported (each start of the string is compared "
                                   "with the needle's bytes, which must be known)", needle.loc)
        raw = needle.value.encode()
        if not raw:
            return Val(INT64, ast.Const(1))
        size = min(hay.type.size if hay.words is None else 8 * len(hay.words),
                   self.analysis.strlen, STRCONTAINS_MAX)
        if hay.words is None and not (hay.type.kind == "array" and hay.type.is_string_like):
            raise TraceSemanticError(f"strcontains(): a value of type "
                                     f"{hay.type.name or hay.type.kind} is not a string",
                                     e.args[0].loc)
        if len(raw) > size:
            return Val(INT64, ast.Const(0))
        if self.typing:
            return Val(INT64, ast.Const(0))
        code: list[ast.Node] = []
        words = [self.leaf(w, code) for w in self.text_words(hay, -(-size // 8) * 8,
                                                              e.args[0].loc)]

        def byte(i: int) -> ast.Node:
            w, shift = words[i // 8], 8 * (i % 8)
            return (ast.lshr(w, shift) if shift else w) & ast.Const(0xFF)

        found: ast.Node = ast.Const(0)
        for start in range(size - len(raw), -1, -1):
            here: ast.Node = ast.Const(1)
            for j in range(len(raw) - 1, -1, -1):
                here = ast.land(byte(start + j) == ast.Const(raw[j]), here) if j < len(raw) - 1 \
                    else byte(start + j) == ast.Const(raw[j])
            found = ast.lor(here, found) if start < size - len(raw) else here
        return Val(INT64, ast.Seq((*code, found)) if code else found)

    def map_len(self, e: t.Call) -> Val:
        """len(@m): the number of the map's keys.  The client counts them in BEGIN, END
        and interval; a kernel probe's action counts the records handed out that hold
        a key, one test per record of the map (its capacity: at most MAX_UNROLLED)."""
        from .parser import MAX_UNROLLED, TraceLimit

        if len(e.args) != 1 or not isinstance(e.args[0], t.MapRef) or e.args[0].keys:
            raise TraceSemanticError("len() takes a map: len(@m)", e.loc)
        name = e.args[0].name
        self.analysis.maps.setdefault(name, MapType(name))
        if self.typing or not self.kernel:
            return Val(INT64, ast.Const(0))
        lay = self.layouts[name]
        if not lay.keyed:
            return Val(INT64, lay.word(0, lay.present) != 0)
        if lay.capacity > MAX_UNROLLED:
            raise TraceLimit(f"len({name}) in a kernel probe's action: the map holds up to "
                             f"{lay.capacity} keys, and counting them tests each record (more "
                             f"than {MAX_UNROLLED}): set a smaller max_map_keys, or count in an "
                             "END or interval action", e.name_loc or e.loc)
        assert lay.used is not None
        n, used = self.locals.take(), self.locals.take()
        code: list[ast.Node] = [n.assign(0), used.assign(ast.Var(lay.used))]
        for r in range(lay.capacity):
            here = ast.land(ast.ult(ast.Const(r), used), lay.word(r, lay.present) != 0)
            code.append(n.assign(n + here))
        return Val(INT64, ast.Seq((*code, n)))

    def macaddr(self, e: t.Call) -> Val:
        """macaddr(p): the six bytes at ``p`` (an array's, or a pointer's), printed by
        the client as a MAC address, XX:XX:XX:XX:XX:XX."""
        if len(e.args) != 1:
            raise TraceSemanticError("macaddr() takes an array of 6 bytes or a pointer", e.loc)
        v = self.value(e.args[0])
        if v.type.kind == "array":
            if v.type.size < 6:
                raise TraceSemanticError(f"macaddr() needs 6 bytes ({v.type.name} has "
                                         f"{v.type.size})", e.args[0].loc)
            address = v.node
        elif v.type.kind in ("ptr", "int"):
            address = v.scalar(e.args[0].loc)
        else:
            raise TraceSemanticError(f"macaddr() takes an array of 6 bytes or a pointer, not "
                                     f"{v.type.name or v.type.kind}", e.args[0].loc)
        if self.typing:
            return Val(MACADDR, ast.Const(0))
        p = self.locals.take()
        low = self.read(p, 4, False)
        high = self.read(p + 4, 2, False)
        return Val(MACADDR, ast.Seq((p.assign(address), low | (high << ast.Const(32)))))

    def pton(self, e: t.Call) -> Val:
        """pton("address"): its bytes in network order, 4 (IPv4: a '.') or 16 (IPv6: a
        ':'), computed here, as bpftrace computes it when it compiles."""
        import ipaddress

        if len(e.args) != 1 or not isinstance(e.args[0], t.Str):
            raise TraceSemanticError("pton() takes an address as a string literal", e.loc)
        text = e.args[0].value
        try:
            raw = ipaddress.ip_address(text).packed
        except ValueError:
            raise TraceSemanticError(f"pton(): {text!r} is not an IPv4 or IPv6 address",
                                     e.args[0].loc) from None
        words = [ast.Const(int.from_bytes(raw[i:i + 8].ljust(8, b"\0"), "little"))
                 for i in range(0, len(raw), 8)]
        return Val(bytes_type(len(raw)), words=words)

    def rand(self, e: t.Builtin) -> ast.Node:
        """A random 32-bit number: the kernel's get_random_u32() where it has one,
        else the next of a linear congruential generator whose state is a word of
        the data heap (Knuth's MMIX constants; the upper 32 bits of the new state)."""
        if self.typing:
            return ast.Const(0)
        if self.rand_call is not None:
            return ast.Call(self.rand_call, ())
        if self.rand_state is None:
            raise TraceUnsupported("rand needs the kernel's get_random_u32 or a word of the "
                                   "data heap", e.loc)
        state = self.rand_state
        x = self.locals.take()
        return ast.Seq((x.assign(state * ast.Const(RAND_MUL) + ast.Const(RAND_ADD)),
                        state.assign(x), ast.lshr(x, 32)))

    def buf(self, e: t.Call) -> Val:
        """buf(p, n) / buf(array): n bytes (at most BUF_MAX) read as they are, printed
        by %r with bytes outside printable ASCII as \\xNN; kept as its length, then
        its bytes."""
        if not 1 <= len(e.args) <= 2:
            raise TraceSemanticError("buf() takes an address and a length, or an array", e.loc)
        v = self.value(e.args[0])
        if len(e.args) == 1:
            if v.type.kind != "array":
                raise TraceSemanticError("buf() of a pointer needs a length: buf(p, n)", e.loc)
            size = min(v.type.size, BUF_MAX)
            length: ast.Node = ast.Const(size)
            address = v.node
        else:
            n = self.expr(e.args[1])
            size = min(n.value, BUF_MAX) if isinstance(n, ast.Const) else BUF_MAX
            if size < 1:
                raise TraceSemanticError("buf()'s length must be at least 1", e.args[1].loc)
            length = ast.Const(size) if isinstance(n, ast.Const) else \
                ast.If(ast.ugt(n, ast.Const(BUF_MAX)), ast.Const(BUF_MAX), n)
            address = v.scalar(e.args[0].loc) if v.type.kind != "array" else v.node
        ct = CType("buf", 8 + size, name="buffer", extra={"size": size})
        if self.typing:
            return Val(ct, words=[ast.Const(0)] * (1 + -(-size // 8)))
        p = self.locals.take()
        words: list[ast.Node] = [ast.Seq((p.assign(address), length))]
        words += [self.read(p + 8 * i, 8, False) for i in range(-(-size // 8))]
        return Val(ct, words=words)

    def path(self, e: t.Call) -> Val:
        """path(p [, size]): the full path of struct path ``p`` as d_path writes it
        (bpftrace's bpf_d_path), at most max_strlen (or ``size``) bytes with its NUL:
        the kernel's d_path called into a buffer of the Frame's slots, as bpf_d_path
        calls it, only where the kernel lets bpf_d_path run (D_PATH_ALLOWED).

        d_path writes the name at the buffer's end, NUL last, and returns where it
        starts, or ERR_PTR(-ENAMETOOLONG) when it does not fit: then it has filled
        the whole buffer with the name's tail (fs/d_path.c prepend()), or written
        nothing (a d_dname's dynamic_dname()).  bpftrace prints the buffer it zeroed
        first either way; here a marker in the buffer's last word, which d_path's
        NUL clears, tells the two apart (the slots cannot all be zeroed where a slot
        is wider than its 8-byte Local)."""
        loc = e.name_loc or e.loc
        provider, _, function = self.site.probe.partition(":")
        if provider not in t.FUNC_PROVIDERS:
            where = f"{provider} probes" if provider else "this probe"
            raise TraceUnsupported(f"function path() is not supported in {where}: only in kfunc "
                                   "and kretfunc probes, where the kernel lets bpf_d_path run "
                                   "(bpftrace refuses it elsewhere)", loc)
        if function not in D_PATH_ALLOWED:
            raise TraceUnsupported(
                f"path() in {self.site.probe}: the kernel lets d_path run only in probes of "
                f"{', '.join(D_PATH_ALLOWED)} (its btf_allowlist_d_path, "
                f"kernel/trace/bpf_trace.c), and {function} is not one of them", loc)
        call = self.site.d_path
        if call is None:
            raise TraceUnsupported("path() calls the kernel's d_path, and this kernel has no "
                                   "such function", loc)
        if not 1 <= len(e.args) <= 2:
            raise TraceSemanticError("path() takes a struct path (or a pointer to one) and an "
                                     "optional size", e.loc)
        address, path_type = self.path_argument(e.args[0])
        buflen = self.analysis.max_strlen
        if len(e.args) == 2:
            # newer bpftrace's size: an integer literal, at most max_strlen
            n = self.expr(e.args[1])
            if not isinstance(n, ast.Const) or n.value >= 1 << 63:
                raise TraceSemanticError("path()'s size must be a non-negative integer "
                                         "literal", e.args[1].loc)
            buflen = min(n.value, buflen)
        size = max(8, -(-buflen // 8) * 8)
        if self.typing or buflen == 0:      # bpf_d_path of 0 bytes writes nothing
            return Val(string(size), words=[ast.Const(0)] * (size // 8))
        stride = call.slot_bytes
        # the buffer starts ``off`` bytes into the slots, so that its last 8 bytes
        # are one slot's Local (the marker)
        off = (8 - buflen) % stride
        p, r, empty, name = (self.locals.take() for _ in range(4))
        slots = [self.locals.take() for _ in range(-(-(off + buflen) // stride))]
        marker = slots[len(slots) - 1 - (off + buflen - 8) // stride]
        buf = ast.LocalAddress(slots[-1].slot) + off if off else ast.LocalAddress(slots[-1].slot)
        # the struct path read first, as bpf_d_path does (copy_from_kernel_nofault):
        # a pointer the kernel cannot read, or a path without a mount or dentry,
        # gives the empty string, not a fault in d_path
        checks: ast.Node = ast.Const(1)
        for member in ("mnt", "dentry"):
            m = path_type.member(member)
            if m is None:
                raise TraceUnsupported(f"path(): the kernel's BTF has no struct path member "
                                       f"{member}", loc)
            at = p + ast.Const(m[0] // 8) if m[0] else p
            checks = ast.land(checks, ast.load(at, 8) != 0)
        marker_value = 0xFF << 56
        code: list[ast.Node] = [
            p.assign(address), r.assign(0), empty.assign(0), marker.assign(marker_value),
            ast.If(checks, r.assign(ast.Call(call.address, (p, buf, ast.Const(buflen))))),
            # the name: where d_path says; the filled buffer after ENAMETOOLONG; else ""
            name.assign(ast.If(ast.land(r != 0, ast.ult(r, ast.Const(ERR_PTR_START))), r,
                              ast.If(ast.land(r != 0, ast.ult(marker, ast.Const(1 << 56))),
                                     buf, ast.LocalAddress(empty.slot)))),
        ]
        words = self.read_string(name, buflen, size // 8, user=False)
        words[0] = ast.Seq((*code, words[0]))
        return Val(string(size), words=words)

    def path_argument(self, arg: t.Expr) -> tuple[ast.Node, CType]:
        """The address of the struct path path() reads: the kernel's own (its BTF's),
        reached from the probed function's arguments or return value by fields alone,
        as bpf_d_path takes only a pointer the verifier trusts (PTR_TO_BTF_ID of
        struct path): a cast, a variable or an index could hand d_path any address."""
        e = arg
        while isinstance(e, t.Field):
            e = e.operand
        if not (isinstance(e, t.Builtin) and e.name in ("args", "retval")) or e is arg:
            raise TraceUnsupported("path() takes a struct path that the probed function's "
                                   "arguments (args) or return value (retval) lead to by "
                                   "fields, e.g. path(args->filp->f_path), as bpf_d_path takes "
                                   "only a pointer the kernel's verifier trusts", arg.loc)
        v = self.value(arg)
        ct = v.type.ref if v.type.kind == "ptr" else v.type
        if ct.kind != "record" or ct.name != "struct path" or ct.origin != "btf":
            raise TraceSemanticError(f"path() takes a struct path or a pointer to one "
                                     f"({v.type.name or v.type.kind} given)", arg.loc)
        return (v.node if v.type.kind == "record" else v.scalar(arg.loc)), ct

    def kstack(self, e: t.Expr, mode: str, depth: int) -> Val:
        """The kernel's stack at the point, unwound by the kernel's own unwinder from
        a struct pt_regs the snippet fills in its Frame (the point's address, its
        stack and frame pointers): up to ``depth`` return addresses, zeros after."""
        ct = CType("kstack", 8 * depth, name="kstack", extra={"mode": mode, "depth": depth})
        if self.typing or self.unwinder is None:
            if not self.typing:
                raise TraceUnsupported("kstack is not supported on this kernel (no unwinder "
                                       "ksim knows, or no struct pt_regs in its BTF)", e.loc)
            return Val(ct, words=[ast.Const(0)] * depth)
        uw = self.unwinder
        stride = uw.slot_bytes
        store = [self.locals.take() for _ in range(-(-8 * depth // stride))]
        # the pt_regs are dead once the unwinder returned: their slots are free after
        mark = self.locals.mark()
        regs = [self.locals.take() for _ in range(-(-uw.regs_bytes // stride))]

        code: list[ast.Node] = [x.assign(0) for x in (*regs, *store)]
        for offset, what in uw.fields:
            slot = _buffer_slot(regs, offset, stride)
            if slot is None:
                raise TraceUnsupported(f"kstack: struct pt_regs's member at byte {offset} is not "
                                       f"at the start of one of the snippet's {stride}-byte "
                                       "scratch slots on this architecture", e.loc)
            code.append(slot.assign(ast.Const(self.site.address) if what == "point"
                                    else ast.Reg(what)))
        base = ast.LocalAddress(store[-1].slot)
        code.append(ast.Call(uw.save, (ast.LocalAddress(regs[-1].slot), base,
                                       ast.Const(depth), ast.Const(0))))
        words = _buffer_words(store, depth, stride)
        words[0] = ast.Seq((*code, words[0]))
        self.locals.release(mark)
        return Val(ct, words=words)

    def ustack(self, e: t.Expr, mode: str, depth: int) -> Val:
        """The task's user stack, walked by the kernel's own walker of user frames
        (Linux's ``stack_trace_save_user(store, size)``, kernel/stacktrace.c: from the
        user registers the task entered the kernel with, task_pt_regs(current), each
        frame read with page faults disabled; nothing in a kernel thread), and the
        process's pid, as bpftrace keeps both, since the client names the frames in
        that process's files: the pid, then up to ``depth`` return addresses, zeros
        after."""
        ct = CType("ustack", 8 * (depth + 1), name="ustack", extra={"mode": mode, "depth": depth})
        uw = self.user_unwinder
        if self.typing or uw is None or uw.save is None:
            if not self.typing:
                why = uw.why if uw is not None else "no walker of user frames ksim knows"
                raise TraceUnsupported(f"ustack is not supported on this kernel: {why}", e.loc)
            return Val(ct, words=[ast.Const(0)] * (depth + 1))
        stride = uw.slot_bytes
        store = [self.locals.take() for _ in range(-(-8 * depth // stride))]
        base = ast.LocalAddress(store[-1].slot)
        code: list[ast.Node] = [x.assign(0) for x in store]
        code.append(ast.Call(uw.save, (base, ast.Const(depth))))
        pid = self.builtin(t.Builtin(e.loc, "pid")).scalar(e.loc)
        return Val(ct, words=[ast.Seq((*code, pid)), *_buffer_words(store, depth, stride)])

    def ntop(self, e: t.Call) -> Val:
        """ntop([family,] address): an IPv4 address (an integer, or 4 bytes) or an
        IPv6 one (16 bytes), kept as the family and 16 bytes for the client to print."""
        if not 1 <= len(e.args) <= 2:
            raise TraceSemanticError("ntop() takes an address, or a family and an address", e.loc)
        v = self.value(e.args[-1])
        family: ast.Node
        lo: ast.Node
        hi: ast.Node
        if v.type.kind == "bytes" and v.words is not None:
            family = ast.Const(10 if v.type.size == 16 else 2)
            lo, hi = v.words[0], v.words[1] if len(v.words) > 1 else ast.Const(0)
        elif v.type.kind == "array" and v.type.size == 16:
            family = ast.Const(10)
            lo, hi = ast.load(v.node, 8), ast.load(v.node + 8, 8)
        elif v.type.kind == "array" and v.type.size == 4:
            family, lo, hi = ast.Const(2), ast.load(v.node, 4), ast.Const(0)
        elif v.type.kind == "record" and v.type.size == 16:
            family, lo, hi = ast.Const(10), ast.load(v.node, 8), ast.load(v.node + 8, 8)
        else:
            family, lo, hi = ast.Const(2), v.scalar(e.args[-1].loc) & ast.Const(0xFFFFFFFF), \
                ast.Const(0)
        if len(e.args) == 2:
            family = self.expr(e.args[0])
        return Val(INET, words=[family, lo, hi])

    def binop(self, op: str, left: ast.Node, right: ast.Node, loc: Loc | None = None) -> ast.Node:
        if op in BINOPS:
            if op in ("/", "%") and isinstance(right, ast.Const) and right.value == 0:
                raise TraceSemanticError("Divide or modulo by 0 detected", loc)
            return ast.BinOp(BINOPS[op], left, right)
        return ast.Compare(COMPARES[op], left, right)

    def read_map(self, ref: t.MapRef) -> Val:
        m = self.analysis.maps.get(ref.name)
        if m is None and self.typing:
            # read before any assignment was seen: typed as an integer until then (a
            # map never assigned at all is refused at the end of the analysis)
            m = self.analysis.maps.setdefault(ref.name, MapType(ref.name))
        kind = (m.kind if m is not None else None) or "int"
        if kind in ("hist", "lhist"):
            raise TraceSemanticError(f"{ref.name} holds a {kind}, which has no integer value",
                                     ref.loc)
        ct = m.ctype if m is not None and m.ctype is not None and kind == "ptr" \
            else kind_type(kind)
        held = ("str", "inet", "kstack", "ustack", "tuple", "bytes", "buf")
        if self.typing:
            _use_map(self.analysis, ref, self)
            if ct.kind in held:
                return Val(ct, words=[ast.Const(0)] * width(kind or "int"))
            return Val(ct, ast.Const(0))
        lay = self.layouts[ref.name]
        mark = self.locals.mark()
        acc = self.access(ref, claim=False)
        w = lay.word(acc.slot, lay.value0)
        if ct.kind in held:
            words = []
            for i in range(width(kind or "int")):
                word = lay.word(acc.slot, lay.value0 + i)
                words.append(word if acc.found is None else ast.If(acc.found, word, ast.Const(0)))
            self.locals.release(mark)
            if acc.setup:
                words[0] = ast.Seq((*acc.setup, words[0]))
            return Val(ct, words=words)
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
        return Val(ct, ast.Seq((*acc.setup, value)) if acc.setup else value)

    def declare(self, name: str, ct: CType, loc: Loc) -> None:
        """A scratch variable's type: its first assignment's (or its declaration's)."""
        if ct.kind in ("record", "array") and not ct.is_string_like:
            # a record is held by its address, as bpftrace holds a struct value
            ct = pointer(ct) if ct.kind == "record" else ct
        if ct.kind == "array":
            ct = string(-(-ct.size // 8) * 8)
        have = self.var_types.get(name)
        if have is None:
            self.var_types[name] = ct
        elif have.kind == "str" and ct.kind == "str":
            if ct.size > have.size:
                self.var_types[name] = ct
        elif (have.kind == "str") != (ct.kind == "str") or (have.kind == "inet") != (ct.kind == "inet"):
            raise TraceSemanticError(f"Type mismatch for ${name}: trying to assign value of type "
                                     f"'{ct.name}' when variable already contains a value of type "
                                     f"'{have.name}'", loc)


def _may_return(s: t.Stmt) -> bool:
    if isinstance(s, t.Return):
        return True
    if isinstance(s, t.If):
        return any(_may_return(x) for x in (*s.then, *s.orelse))
    if isinstance(s, t.While | t.ForMap):
        return any(_may_return(x) for x in s.body)
    return False


def _may_jump(s: t.Stmt) -> bool:
    """Whether ``s`` may break or continue the loop it is in (or return)."""
    if isinstance(s, t.Break | t.Continue | t.Return):
        return True
    if isinstance(s, t.If):
        return any(_may_jump(x) for x in (*s.then, *s.orelse))
    if isinstance(s, t.While | t.ForMap):
        return any(_may_return(x) for x in s.body)
    return False


def _const_words(raw: bytes, size: int) -> list[ast.Node]:
    raw = raw[:size - 1].ljust(size, b"\0")
    return [ast.Const(int.from_bytes(raw[i:i + 8], "little")) for i in range(0, size, 8)]


def _fit(node: Any, ct: CType) -> Any:
    """``node`` cut to ``ct``'s size, sign-extended when it is signed."""
    if ct.size >= 8:
        return node
    bits = 8 * ct.size
    if isinstance(node, ast.Const):
        v = node.value & ((1 << bits) - 1)
        if ct.signed and v >> (bits - 1):
            v -= 1 << bits
        return ast.Const(v & MASK)
    low = node & ast.Const((1 << bits) - 1)
    if not ct.signed:
        return low
    sign = ast.Const(1 << (bits - 1))
    return (low ^ sign) - sign


def _buffer_slot(slots: list[ast.Local], offset: int, stride: int) -> ast.Local | None:
    """The slot at byte ``offset`` of a buffer made of ``slots`` (None: the offset is
    inside one).  Slots taken one after another are a buffer at the last one's
    address, slot ``len(slots) - 1 - k`` at byte ``k * stride`` of it, a Local's value
    in its slot's first 8 bytes."""
    k, r = divmod(offset, stride)
    return slots[len(slots) - 1 - k] if r == 0 else None


def _buffer_words(slots: list[ast.Local], n: int, stride: int) -> list[ast.Node]:
    """The first ``n`` 8-byte words of the buffer made of ``slots``: a slot's Local
    where a word starts one, a load from the buffer otherwise."""
    base = ast.LocalAddress(slots[-1].slot)
    words: list[ast.Node] = []
    for j in range(n):
        slot = _buffer_slot(slots, 8 * j, stride)
        words.append(slot if slot is not None else ast.load(base + 8 * j, 8))
    return words


def kind_of(ct: CType, strlen: int = DEFAULT_STRLEN) -> str:
    """The kind a map key, map value or printf argument of type ``ct`` is held as."""
    if ct is COMM:
        return "comm"
    if ct.kind == "str":
        return f"str:{-(-ct.size // 8) * 8}"
    if ct.kind == "array" and ct.is_string_like:
        return f"str:{-(-min(ct.size, strlen) // 8) * 8}"
    if ct.kind == "name":
        return "name"
    if ct.kind == "kaddr":
        return "kaddr"
    if ct.kind == "cgroup_path":
        return "cgroup_path"
    if ct.kind == "tm":
        return "tm:" + ct.extra["format"]
    if ct.kind in STACKS:
        return f"{ct.kind}:{ct.extra['depth']}:{ct.extra['mode']}"
    if ct.kind == "buf":
        return f"buf:{ct.extra['size']}"
    if ct.kind == "inet":
        return "inet"
    if ct.kind in NAMED_WORDS:
        return ct.kind
    if ct.kind == "bytes":
        return f"bytes:{ct.extra['n']}"
    if ct.kind == "tuple":
        return tuple_kind(ct.extra.get("items") or ct.extra["kinds"])
    if ct.kind == "ptr":
        return "ptr"            # printed in hex, as bpftrace prints pointers
    if ct.kind == "int":
        return "int"
    raise TraceSemanticError(f"a value of type {ct.name or ct.kind} cannot be stored or printed "
                             "(read one of its fields)")


def kind_type(kind: str | None) -> CType:
    """The type a map's value of ``kind`` reads as."""
    if kind == "comm":
        return COMM
    if kind is not None and kind.startswith("str:"):
        return string(int(kind[4:]))
    if kind in ("ksym", "probe", "name"):
        return NAME
    if kind == "ptr":
        return pointer(VOID_T)
    if kind == "kaddr":
        return KADDR
    if kind == "cgroup_path":
        return CGROUP_PATH
    if kind == "inet":
        return INET
    if kind is not None and kind.startswith(("kstack:", "ustack:")):
        name, depth, mode = kind.split(":")
        words = int(depth) + (name == "ustack")         # a ustack's pid, then its frames
        return CType(name, 8 * words, name=name, extra={"mode": mode, "depth": int(depth)})
    if kind is not None and kind.startswith(TUPLE):
        return tuple_type(tuple_items(kind))
    if kind is not None and kind.startswith("bytes:"):
        return bytes_type(int(kind[6:]))
    if kind is not None and kind.startswith("buf:"):
        return CType("buf", 8 + int(kind[4:]), name="buffer", extra={"size": int(kind[4:])})
    if kind is not None and kind.startswith("tm:"):
        return CType("tm", 8, name="timestamp", extra={"format": kind[3:]})
    return {ERRNO: STRERROR, SYSCALL: SYSCALL_NAME, MAC: MACADDR,
            USERNAME: USERNAME_T}.get(kind or "", INT64)


__all__ = ["Analysis", "ProbeCompiler", "Site", "analyse", "constant_key", "map_refs"]
