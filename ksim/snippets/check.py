"""The static check every snippet passes before any code is generated.

Like kprobes' ``check_kprobe_address_safe()``, one function runs every check and
refuses with a cause-specific error; codegen may then assume a well-formed tree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ksim.errors import (
    ArgIndexError,
    BadOperand,
    CallOperandError,
    DivisionByZero,
    NotAssignable,
    NotIndirectCall,
    PointKindError,
    SlotError,
    SnippetError,
    TooManyCallArgs,
    UnknownRegister,
)

if TYPE_CHECKING:
    from ksim.arch.base import CallOperand

from . import ast

#: kinds of instrumentation points
POINT_KINDS = frozenset({"entry", "exit", "block", "callsite", "insn"})
#: how many arguments travel in registers (System V; what Arg and Call can reach)
MAX_ARGS = 6
ACCESS_SIZES = frozenset({1, 2, 4, 8})
BINOPS = frozenset({"add", "sub", "mul", "div", "mod", "and", "or", "xor", "shl", "sar", "shr"})
UNOPS = frozenset({"neg", "not"})
COMPARES = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "ult", "ule", "ugt", "uge"})
SEGMENTS = frozenset({None, "gs"})
#: how deeply a snippet's nodes may nest: the check and the code generator walk the
#: tree recursively (two or three Python frames a level), well within Python's limit
#: at this depth (ksim trace's deepest programs make about 180)
MAX_DEPTH = 256
#: nodes code is generated for, a node shared by several parents counted once per
#: parent (its code is generated each time): about six bytes of code each
MAX_NODES = 1_000_000


class SnippetTooLarge(SnippetError):
    """A snippet nested deeper than MAX_DEPTH or larger than MAX_NODES nodes."""

    code = "snippet-too-large"


@dataclass(frozen=True)
class _Site:
    """What some nodes need to know about the point beyond its kind."""

    #: general-purpose register names Reg may name (None: not known here, left to codegen)
    registers: frozenset[str] | None
    #: the operand of the indirect call at the point (None: the point is no indirect call)
    call_operand: CallOperand | None


def check(snippet: Any, point_kind: str = "entry", *, registers: frozenset[str] | None = None,
          call_operand: CallOperand | None = None) -> None:
    """Raise a SnippetError subclass if ``snippet`` cannot be compiled for ``point_kind``.

    ``registers`` are the names ``Reg`` may use (codegen passes the architecture's
    general-purpose registers); ``call_operand`` is the operand of the indirect call
    at the point, without which ``CallTarget`` has no meaning."""
    if point_kind not in POINT_KINDS:
        raise PointKindError(f"unknown point kind {point_kind!r} (known: {sorted(POINT_KINDS)})")
    asked = (point_kind, registers, call_operand)
    passed = _PASSED.get(id(snippet))
    if passed is not None and passed[0] is snippet and passed[1] == asked:
        _PASSED.move_to_end(id(snippet))
        return
    check_shape(snippet)
    _check(snippet, point_kind, "snippet", _Site(registers, call_operand))
    _check_frames(snippet, None)
    if isinstance(snippet, ast.Node):
        _PASSED[id(snippet)] = (snippet, asked)
        if len(_PASSED) > PASSED:
            _PASSED.popitem(last=False)


#: snippets that passed ``check``, by identity, with what they passed for: a tree of
#: nodes never changes (frozen), so it passes again.  The Manager checks a snippet
#: when it is inserted and codegen when it compiles it: a batch of ten thousand
#: probes checks each once.  Holding the node keeps its id from being reused.
_PASSED: OrderedDict[int, tuple[Any, tuple[str, frozenset[str] | None, CallOperand | None]]] = OrderedDict()
PASSED = 1 << 16


def check_shape(snippet: Any) -> None:
    """SnippetTooLarge if ``snippet`` nests deeper than MAX_DEPTH or has more than
    MAX_NODES nodes as code is generated for them; SlotError if it contains itself.
    Found without recursion, each distinct node visited once (a tree sharing nodes
    may stand for exponentially many)."""
    depth: dict[int, int] = {}
    size: dict[int, int] = {}
    open_: set[int] = set()
    # (node, None): not yet opened; (node, its children): every child done
    stack: list[tuple[Any, tuple[Any, ...] | None]] = [(snippet, None)]
    while stack:
        node, kids = stack.pop()
        key = id(node)
        if kids is None:
            if key in depth:
                continue
            if key in open_:
                raise SlotError(f"{type(node).__name__} contains itself")
            kids = node.children() if isinstance(node, ast.Node) else ()
            if not kids:        # a leaf: one level, one node
                depth[key] = size[key] = 1
                continue
            open_.add(key)
            stack.append((node, kids))
            stack.extend((k, None) for k in kids if id(k) not in depth)
            continue
        open_.discard(key)
        d = n = 0
        for k in kids:
            kd = depth[id(k)]
            if kd > d:
                d = kd
            n += size[id(k)]
        d += 1
        n += 1
        if d > MAX_DEPTH:
            raise SnippetTooLarge(f"the snippet nests deeper than {MAX_DEPTH} levels")
        if n > MAX_NODES:
            raise SnippetTooLarge(f"the snippet has more than {MAX_NODES} nodes (a node used in "
                                  "several places counts in each)")
        depth[key], size[key] = d, n


def _check(node: Any, kind: str, slot: str | tuple[Any, int], site: _Site) -> None:
    """``slot``: where ``node`` is, for a refusal's message: a name, or (parent, index)
    (named only when refused)."""
    t = type(node)
    if t not in _KNOWN:
        where = slot if isinstance(slot, str) else f"{type(slot[0]).__name__} operand {slot[1]}"
        if not isinstance(node, ast.Node):
            raise SlotError(f"{where}: expected a snippet node or an int, got {node!r}")
        raise SlotError(f"{where}: {t.__name__} is not a snippet node codegen knows")
    rule = _RULES.get(t)
    if rule is not None:
        rule(node, kind)
    site_rule = _SITE_RULES.get(t)
    if site_rule is not None:
        site_rule(node, kind, site)
    for i, child in enumerate(node.children()):
        _check(child, kind, (node, i), site)


def _const(node: ast.Const, kind: str) -> None:
    if isinstance(node.value, bool) or not isinstance(node.value, int):
        raise SlotError(f"Const holds {node.value!r}, not an int")
    if not -(1 << 63) <= node.value < (1 << 64):
        raise BadOperand(f"constant {node.value:#x} does not fit 64 bits")


def _size(size: Any, what: str) -> None:
    if size not in ACCESS_SIZES:
        raise BadOperand(f"{what}: access size {size!r} is not one of 1, 2, 4, 8")


def _var(node: ast.Var, kind: str) -> None:
    # the address first: the other messages show it (a node there, Var(Arg(0)), is
    # no address: a Load reads through a computed one)
    if isinstance(node.address, bool) or not isinstance(node.address, int) or not (
            0 <= node.address < (1 << 64)):
        raise BadOperand(f"Var address {node.address!r} is not a 64-bit address"
                         + (" (a Load reads through a computed address)"
                            if isinstance(node.address, ast.Node) else ""))
    _size(node.size, f"Var at {node.address:#x}")
    if node.segment not in SEGMENTS:
        raise BadOperand(f"Var segment {node.segment!r} is not None or 'gs'")


def _binop(node: ast.BinOp, kind: str) -> None:
    if node.op not in BINOPS:
        raise BadOperand(f"unknown arithmetic operator {node.op!r}")
    if node.op in ("div", "mod") and isinstance(node.right, ast.Const) and node.right.value == 0:
        raise DivisionByZero(f"{node.op} by the constant 0")


def _unary(node: ast.Unary, kind: str) -> None:
    if node.op not in UNOPS:
        raise BadOperand(f"unknown unary operator {node.op!r}")


def _compare(node: ast.Compare, kind: str) -> None:
    if node.op not in COMPARES:
        raise BadOperand(f"unknown comparison {node.op!r}")


def _assign(node: ast.Assign | ast.AtomicAssign, kind: str) -> None:
    if not isinstance(node.target, ast.Var | ast.Elem | ast.Local):
        what = type(node.target).__name__ if isinstance(node.target, ast.Node) else repr(node.target)
        raise NotAssignable(f"cannot assign to {what}: only a Var, an Elem or a Local can be assigned")


def _atomic_assign(node: ast.AtomicAssign, kind: str) -> None:
    _assign(node, kind)
    if isinstance(node.target, ast.Local):
        raise NotAssignable("atomic assignment to a Local: scratch variables belong to one "
                            "hit, assign them plainly")
    for x in ast.walk(node.value):
        if isinstance(x, ast.Assign | ast.AtomicAssign | ast.CompareExchange) \
                and _same_memory(x.target, node.target):
            # the compare-and-swap would see its own store as interference, forever
            raise SlotError("the value of an atomic assignment must not assign its own target")
        if isinstance(node.target, ast.Elem) and isinstance(x, ast.Assign) \
                and isinstance(x.target, ast.Local) and _reads_local(node.target.index, x.target.slot):
            raise SlotError("the value of an atomic assignment to an Elem must not change "
                            "the Local its index reads")


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two assignment targets may name the same memory (a table: any element)."""
    if isinstance(a, ast.Var) and isinstance(b, ast.Var):
        return a.key == b.key
    if isinstance(a, ast.Elem) and isinstance(b, ast.Elem):
        return a.table[0] == b.table[0]
    return False


def _reads_local(node: Any, slot: int) -> bool:
    return any(isinstance(x, ast.Local) and x.slot == slot for x in ast.walk(node))


def _elem(node: ast.Elem, kind: str) -> None:
    _size(node.size, "Elem")
    if not isinstance(node.base, int) or not 0 <= node.base < (1 << 64):
        raise BadOperand(f"Elem base {node.base!r} is not a 64-bit address")
    if isinstance(node.count, bool) or not isinstance(node.count, int) or node.count < 1 \
            or node.base + node.count * node.size > (1 << 64):
        raise BadOperand(f"Elem count {node.count!r} is not a table of at least one element "
                         "inside the address space")
    for x in ast.walk(node.index):
        if isinstance(x, ast.Assign | ast.AtomicAssign | ast.CompareExchange | ast.Call):
            raise SlotError(f"an Elem's index must have no side effects ({type(x).__name__})")


def _compare_exchange(node: ast.CompareExchange, kind: str) -> None:
    t = node.target
    if not isinstance(t, ast.Var | ast.Elem) or (isinstance(t, ast.Var) and t.segment is not None):
        what = type(t).__name__ if isinstance(t, ast.Node) else repr(t)
        raise NotAssignable(f"compare-exchange on {what}: only an absolute Var or an Elem")


#: the most scratch slots a Frame has (8 bytes each, on the kernel's stack)
MAX_FRAME_SLOTS = 128


def _frame(node: ast.Frame, kind: str) -> None:
    if isinstance(node.slots, bool) or not isinstance(node.slots, int) \
            or not 0 <= node.slots <= MAX_FRAME_SLOTS:
        raise BadOperand(f"Frame slots {node.slots!r} is not a count from 0 to {MAX_FRAME_SLOTS}")


def _local(node: ast.Local | ast.LocalAddress, kind: str) -> None:
    if isinstance(node.slot, bool) or not isinstance(node.slot, int) or node.slot < 0:
        raise BadOperand(f"Local({node.slot!r}) is not a slot number")


def _check_frames(node: Any, frame: ast.Frame | None) -> None:
    """Every Local lies in a Frame with that many slots; Frames do not nest."""
    if isinstance(node, ast.Frame):
        if frame is not None:
            raise SlotError("a Frame inside a Frame: a snippet has one set of scratch variables")
        frame = node
    elif isinstance(node, ast.Local | ast.LocalAddress):
        if frame is None:
            raise SlotError(f"Local({node.slot}) outside any Frame")
        if node.slot >= frame.slots:
            raise BadOperand(f"Local({node.slot}) in a Frame of {frame.slots} slots")
    if isinstance(node, ast.Node):
        for child in node.children():
            _check_frames(child, frame)


def _seq(node: ast.Seq, kind: str) -> None:
    if not isinstance(node.body, (tuple, list)):
        raise SlotError(f"Seq body must be a sequence of nodes, got {node.body!r}")


def _call(node: ast.Call, kind: str) -> None:
    if not isinstance(node.address, int) or not 0 <= node.address < (1 << 64):
        raise BadOperand(f"call address {node.address!r} is not a 64-bit address")
    if not isinstance(node.args, (tuple, list)):
        raise SlotError(f"Call args must be a sequence of nodes, got {node.args!r}")
    if len(node.args) > MAX_ARGS:
        raise TooManyCallArgs(f"call to {node.address:#x} with {len(node.args)} arguments; at most {MAX_ARGS}")


def _arg(node: ast.Arg, kind: str) -> None:
    if isinstance(node.n, bool) or not isinstance(node.n, int) or not 0 <= node.n < MAX_ARGS:
        raise ArgIndexError(f"Arg({node.n!r}): only arguments 0..{MAX_ARGS - 1} are in registers")
    if kind != "entry":
        raise PointKindError(f"Arg({node.n}) at a {kind} point: arguments are known at entry only")


def _retval(node: ast.RetVal, kind: str) -> None:
    if kind != "exit":
        raise PointKindError(f"RetVal at a {kind} point: the return value is known at exit only")


def _load(node: ast.Load, kind: str) -> None:
    _size(node.size, "Load")


def _guarded(node: ast.Guarded, kind: str) -> None:
    g = node.guard
    if not isinstance(g, ast.Guard):
        raise SlotError(f"Guarded holds {g!r}, not a Guard")
    if isinstance(g.slots, bool) or not isinstance(g.slots, int) or g.slots < 1 or g.slots & (g.slots - 1):
        raise BadOperand(f"guard slots {g.slots!r} is not a power of two")
    if not isinstance(g.address, int) or g.address % 8 or not 0 < g.address < (1 << 64) - g.size:
        raise BadOperand(f"guard address {g.address!r} is not an aligned 64-bit address")


def _reg(node: ast.Reg, kind: str, site: _Site) -> None:
    if not isinstance(node.name, str):
        raise UnknownRegister(f"Reg({node.name!r}): a register is named by a string")
    if site.registers is not None and node.name not in site.registers:
        raise UnknownRegister(f"Reg({node.name!r}) is not one of {sorted(site.registers)}")


def _call_target(node: ast.CallTarget, kind: str, site: _Site) -> None:
    if kind != "callsite":
        raise NotIndirectCall(f"CallTarget at a point of kind {kind!r}: only a call site has a destination")
    op = site.call_operand
    if op is None:
        raise NotIndirectCall("CallTarget at a call site that is not an indirect call "
                              "(a direct call's destination is known statically)")
    if op.segment is not None:
        # Load has no segment: the per-cpu base would be missing from the address
        raise CallOperandError(f"CallTarget through the segment-relative operand {op}")
    if op.in_memory and op.size != 8:
        raise CallOperandError(f"CallTarget through a {op.size}-byte memory operand {op}")


_RULES: dict[type, Callable[[Any, str], None]] = {
    ast.Const: _const,
    ast.Var: _var,
    ast.BinOp: _binop,
    ast.Unary: _unary,
    ast.Compare: _compare,
    ast.Assign: _assign,
    ast.AtomicAssign: _atomic_assign,
    ast.Seq: _seq,
    ast.Call: _call,
    ast.Arg: _arg,
    ast.RetVal: _retval,
    ast.Load: _load,
    ast.Guarded: _guarded,
    ast.Elem: _elem,
    ast.CompareExchange: _compare_exchange,
    ast.Frame: _frame,
    ast.Local: _local,
    ast.LocalAddress: _local,
}

#: rules that need more of the point than its kind
_SITE_RULES: dict[type, Callable[[Any, str, _Site], None]] = {
    ast.Reg: _reg,
    ast.CallTarget: _call_target,
}

#: every node class codegen can lower
_KNOWN: frozenset[type] = frozenset({
    ast.Const, ast.Var, ast.BinOp, ast.Unary, ast.Compare, ast.LogicalAnd, ast.LogicalOr,
    ast.LogicalNot, ast.Assign, ast.AtomicAssign, ast.If, ast.Seq, ast.Call, ast.Tsc, ast.Pid,
    ast.Tgid, ast.CurrentTask, ast.Comm, ast.Cpu, ast.Arg, ast.RetVal, ast.Load, ast.Reg, ast.CallTarget, ast.Guarded,
    ast.Elem, ast.CompareExchange, ast.Frame, ast.Local, ast.LocalAddress,
})
