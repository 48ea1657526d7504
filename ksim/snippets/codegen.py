"""Generic snippet code generation: walk the AST, drive an architecture's Emitter.

The model is a stack machine with one accumulator (Dyninst's layering: nodes
know *what* to compute, the Emitter knows *how* on its architecture).  Every
node leaves its value in the accumulator; a binary node evaluates its left
operand, pushes it, evaluates the right operand, and asks the Emitter to
combine the popped left with the accumulator.  Nothing here knows a register
name except those the Arch contract names (argument and return registers).

The frame (prologue/epilogue) saves exactly the registers the generated code
clobbers that are live at the point, plus any clobbered register a snippet
reads as it was at the point (Arg, RetVal), and the flags when live.

A ``Load`` through a computed pointer is read the fault-safe way the kernel's ABI
offers (:func:`read_mode`): checked inline against the ABI's ``readable`` regions
(0 outside them), or through its ``read_nofault`` function (0 when it reports a
fault), else plainly -- which ksim.snippets.verify refuses for user snippets.
``Guarded`` (the verifier's recursion guard) takes and gives back a per-cpu flag
around its body.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any

from ksim.errors import CodegenError

from . import ast
from .check import check

if TYPE_CHECKING:
    from ksim.arch.base import Arch, CallOperand
    from ksim.core import MemRef


class Emitter(ABC):
    """What codegen asks of an architecture.  ``acc`` is the accumulator.

    Temporaries live on a stack the Emitter manages; ``depth`` counts them.
    Labels are opaque objects from ``new_label``.

    The code depends on the address it is generated for through ``call`` only:
    data addresses are built as constants (never PC-relative) and labels are
    relative within the code, so code without calls runs unchanged wherever it is
    copied (:func:`position_independent`).
    """

    depth: int

    # --- frame -----------------------------------------------------------------------
    @abstractmethod
    def clobbers(self, calls: bool) -> frozenset[str]:
        """Registers (and "flags") the generated code may change, with or without calls."""

    @abstractmethod
    def begin(self, save: frozenset[str], calls: bool) -> None:
        """Prologue: save ``save``; prepare for calls (stack alignment) if ``calls``."""

    @abstractmethod
    def end(self) -> bytes:
        """Epilogue (restore what ``begin`` saved) and the finished code."""

    def resave(self, save: frozenset[str]) -> bytes | None:
        """After ``end``: the code a generation begun with ``save`` (and the same
        ``calls``) would finish with, and this emitter as that one would be, made
        without generating again; None (nothing changed) when it cannot be sure the
        bytes would be the same."""
        return None

    @abstractmethod
    def writes(self) -> frozenset[str]:
        """After ``end``: every register (and "flags") the finished code may change
        between the prologue's saves and the epilogue's restores, including what a
        called function may change (the stack pointer excepted: it is rebalanced)."""

    # --- values -------------------------------------------------------------------------
    @abstractmethod
    def const(self, value: int) -> None: ...

    @abstractmethod
    def load(self, address: int, size: int, signed: bool, segment: str | None) -> None:
        """acc = memory at ``address`` (``segment``-relative when given)."""

    @abstractmethod
    def store(self, address: int, size: int, segment: str | None) -> None:
        """memory at ``address`` = low ``size`` bytes of acc; acc unchanged."""

    @abstractmethod
    def load_indirect(self, offset: int, size: int, signed: bool) -> None:
        """acc = memory at acc + offset."""

    @abstractmethod
    def load_checked(self, size: int, signed: bool, regions: Sequence[tuple[int, int]]) -> None:
        """acc = memory at acc if its ``size`` bytes lie inside one of ``regions``
        ((start, end) pairs), else 0: a load that cannot fault."""

    @abstractmethod
    def load_nofault(self, function: int, size: int, signed: bool) -> None:
        """acc = memory at acc read through ``function``, which has the contract of
        Linux's copy_from_kernel_nofault ``(dst, src, size) -> 0 or -EFAULT``; 0 when
        it fails.  A call: only in a frame begun with ``calls``."""

    @abstractmethod
    def swap_indirect(self, value: int) -> None:
        """Atomically exchange the 8 bytes at address acc with ``value``; acc = the
        bytes it held."""

    @abstractmethod
    def narrow(self, size: int, signed: bool) -> None:
        """acc = acc's low ``size`` bytes, zero- or sign-extended."""

    @abstractmethod
    def point_reg(self, reg: str) -> None:
        """acc = the value ``reg`` had when the point was reached."""

    @abstractmethod
    def push(self) -> None:
        """Push acc as a temporary (depth += 1)."""

    @abstractmethod
    def load_temp(self, index: int) -> None:
        """acc = the temporary pushed when depth was ``index``."""

    @abstractmethod
    def temp_address(self, index: int) -> None:
        """acc = the address of the temporary pushed when depth was ``index`` (the
        temporaries pushed after it lie below it, each one word lower)."""

    @abstractmethod
    def drop(self) -> None:
        """Discard the top temporary (depth -= 1); acc and the flags unchanged."""

    @abstractmethod
    def binop(self, op: str) -> None:
        """acc = popped-left ``op`` acc (ops of ksim.snippets.check.BINOPS)."""

    @abstractmethod
    def compare(self, op: str) -> None:
        """acc = 1 if popped-left ``op`` acc else 0."""

    def binop_imm(self, op: str, value: int) -> bool:
        """acc = acc ``op`` value with an immediate operand, if the architecture has
        such a form for this op and value; False (nothing emitted) otherwise."""
        return False

    def compare_imm(self, op: str, value: int) -> bool:
        """acc = 1 if acc ``op`` value else 0 with an immediate, if possible."""
        return False

    @abstractmethod
    def unary(self, op: str) -> None:
        """acc = neg/not/lnot acc (lnot: 1 if acc == 0 else 0)."""

    @abstractmethod
    def counter(self) -> None:
        """acc = the cycle counter."""

    # --- tables and scratch variables (Elem, Frame) ---------------------------------------
    @abstractmethod
    def element(self, base: int, count: int, size: int) -> None:
        """acc = the address of element acc (unsigned, clamped to ``count - 1``) of the
        table of ``count`` ``size``-byte integers at ``base``."""

    @abstractmethod
    def store_temp(self, index: int) -> None:
        """The temporary pushed when depth was ``index`` = acc; acc unchanged."""

    @abstractmethod
    def store_via(self, temp: int, size: int) -> None:
        """Memory at the address held by temporary ``temp`` = low ``size`` bytes of
        acc; acc unchanged."""

    @abstractmethod
    def atomic_add_via(self, temp: int, size: int, fetch: bool = True) -> None:
        """atomic_add on the memory at the address held by temporary ``temp``."""

    @abstractmethod
    def compare_and_swap_via(self, temp: int, size: int, retry: Any) -> None:
        """compare_and_swap on the memory at the address held by temporary ``temp``."""

    @abstractmethod
    def compare_exchange_via(self, temp: int, size: int) -> None:
        """The top temporary is the expected value (popped), acc the new one: store acc
        at the address held by temporary ``temp`` if the memory holds the expected
        value, atomically; acc = what the memory held (its low ``size`` bytes valid)."""

    # --- control flow -----------------------------------------------------------------------
    @abstractmethod
    def new_label(self) -> Any: ...

    @abstractmethod
    def bind(self, label: Any) -> None: ...

    @abstractmethod
    def jump(self, label: Any) -> None: ...

    @abstractmethod
    def jump_if_zero(self, label: Any) -> None:
        """Branch if acc == 0 (acc unchanged)."""

    @abstractmethod
    def call(self, address: int, nargs: int) -> None:
        """Call ``address`` with the top ``nargs`` temporaries (first pushed = first
        argument), popping them; acc = the return value."""

    # --- atomics ---------------------------------------------------------------------------
    @abstractmethod
    def atomic_add(self, address: int, size: int, segment: str | None, fetch: bool = True) -> None:
        """Atomically add acc to memory; if ``fetch``, acc = the new value (not yet
        narrowed), else acc is undefined."""

    def atomic_add_imm(self, address: int, size: int, segment: str | None, value: int) -> bool:
        """Atomically add a constant to memory (result unused), if possible."""
        return False

    @abstractmethod
    def compare_and_swap(self, address: int, size: int, segment: str | None, retry: Any) -> None:
        """acc is the new value, the top temporary the expected old one (popped).
        Atomically store acc if memory still holds the old value, else go to ``retry``."""


def memref_load(emitter: Emitter, ref: MemRef) -> None:
    emitter.load(ref.address, ref.size, False, ref.segment)


def read_mode(abi: Any) -> str:
    """How a Load through a computed pointer is read with ``abi``: "checked" (inline
    against the ABI's fixed memory map), "nofault" (through its read_nofault
    function: a call) or "plain" (the ABI offers neither)."""
    if abi is not None and abi.readable:
        return "checked"
    if abi is not None and abi.read_nofault is not None:
        return "nofault"
    return "plain"


@dataclass(frozen=True, eq=False, slots=True)
class OperandLoad(ast.Load):
    """The memory operand of the indirect call at the point (CallTarget), read just
    before the call reads it: a plain load, which faults only where the kernel's own
    call would.  Built by codegen only; the check refuses it in a user's tree."""


class Codegen:
    """Lowers a checked tree onto an Emitter."""

    def __init__(self, arch: Arch, emitter: Emitter, abi: Any) -> None:
        self.arch = arch
        self.e = emitter
        self.abi = abi
        #: Var key -> temporary holding its snapshot (inside a compare-and-swap loop)
        self.bound: dict[tuple[int, str | None], int] = {}
        #: the same for Elem targets: (element, temporary holding its snapshot)
        self.bound_elems: list[tuple[ast.Elem, int]] = []
        #: the temporary of Local(0) of the Frame being generated
        self.frame_base: int | None = None
        self.read_mode = read_mode(abi)

    def gen(self, node: ast.Node) -> None:
        """Code leaving ``node``'s value in the accumulator."""
        _GEN[type(node)](self, node)

    def _const(self, n: ast.Const) -> None:
        self.e.const(n.value)

    def _tsc(self, n: ast.Tsc) -> None:
        self.e.counter()

    def _arg(self, n: ast.Arg) -> None:
        self.e.point_reg(self.arch.arg_regs[n.n])

    def _retval(self, n: ast.RetVal) -> None:
        self.e.point_reg(self.arch.ret_reg)

    def _reg(self, n: ast.Reg) -> None:
        self.e.point_reg(n.name)

    def effect(self, node: ast.Node) -> None:
        """Code for ``node``'s effects only (its value is discarded)."""
        if isinstance(node, ast.Seq):
            for stmt in node.body:
                self.effect(stmt)
        elif isinstance(node, ast.If):
            self._if(node, value=False)
        elif isinstance(node, ast.Assign):
            self._assign(node, value=False)
        elif isinstance(node, ast.AtomicAssign):
            self._atomic_assign(node, value=False)
        elif isinstance(node, ast.Guarded):
            self._guarded(node, value=False)
        elif isinstance(node, ast.Frame):
            self._frame(node, value=False)
        else:
            self.gen(node)

    def _var(self, n: ast.Var) -> None:
        if n.key in self.bound:
            self.e.load_temp(self.bound[n.key])
        else:
            self.e.load(n.address, n.size, n.signed, n.segment)

    def _binop(self, n: ast.BinOp) -> None:
        self.gen(n.left)
        if isinstance(n.right, ast.Const) and self.e.binop_imm(n.op, n.right.value):
            return
        self.e.push()
        self.gen(n.right)
        self.e.binop(n.op)

    def _compare(self, n: ast.Compare) -> None:
        self.gen(n.left)
        if isinstance(n.right, ast.Const) and self.e.compare_imm(n.op, n.right.value):
            return
        self.e.push()
        self.gen(n.right)
        self.e.compare(n.op)

    def _unary(self, n: ast.Unary) -> None:
        self.gen(n.operand)
        self.e.unary(n.op)

    def _lnot(self, n: ast.LogicalNot) -> None:
        self.gen(n.operand)
        self.e.unary("lnot")

    def _land(self, n: ast.LogicalAnd) -> None:
        false, done = self.e.new_label(), self.e.new_label()
        for side in (n.left, n.right):
            self.gen(side)
            self.e.jump_if_zero(false)
        self.e.const(1)
        self.e.jump(done)
        self.e.bind(false)
        self.e.const(0)
        self.e.bind(done)

    def _lor(self, n: ast.LogicalOr) -> None:
        right, true, done = self.e.new_label(), self.e.new_label(), self.e.new_label()
        self.gen(n.left)
        self.e.jump_if_zero(right)
        self.e.jump(true)
        self.e.bind(right)
        self.gen(n.right)
        self.e.jump_if_zero(done)       # acc is already 0
        self.e.bind(true)
        self.e.const(1)
        self.e.bind(done)

    def _if(self, n: ast.If, value: bool = True) -> None:
        branch = self.gen if value else self.effect
        orelse, done = self.e.new_label(), self.e.new_label()
        self.gen(n.cond)
        self.e.jump_if_zero(orelse)
        branch(n.then)
        if n.orelse is None and not value:
            self.e.bind(orelse)
            return
        self.e.jump(done)
        self.e.bind(orelse)
        if n.orelse is None:
            self.e.const(0)
        else:
            branch(n.orelse)
        self.e.bind(done)

    def _seq(self, n: ast.Seq) -> None:
        if not n.body:
            self.e.const(0)
        for stmt in n.body:
            self.gen(stmt)

    def _assign(self, n: ast.Assign, value: bool = True) -> None:
        if isinstance(n.target, ast.Local):
            self.gen(n.value)
            self.e.store_temp(self._local_temp(n.target))
            return
        if isinstance(n.target, ast.Elem):
            self._assign_elem(n.target, n.value, value)
            return
        t: ast.Var = n.target
        self.gen(n.value)
        self.e.store(t.address, t.size, t.segment)
        if value:
            self.e.narrow(t.size, t.signed)

    def _atomic_assign(self, n: ast.AtomicAssign, value: bool = True) -> None:
        if isinstance(n.target, ast.Elem):
            self._atomic_elem(n.target, n.value, value)
            return
        t: ast.Var = n.target
        delta = _additive_delta(t, n.value)
        if delta is None:
            self._cas_loop(t, n.value)
        elif not value and self._atomic_add_const(t, *delta):
            return
        else:
            term, negate = delta
            self.gen(term)
            if negate:
                self.e.unary("neg")
            self.e.atomic_add(t.address, t.size, t.segment, fetch=value)
        if value:
            self.e.narrow(t.size, t.signed)

    def _atomic_add_const(self, t: ast.Var, term: ast.Node, negate: bool) -> bool:
        """``lock add``-style update by a constant whose result is not needed."""
        if not isinstance(term, ast.Const):
            return False
        amount = -term.value if negate else term.value
        return self.e.atomic_add_imm(t.address, t.size, t.segment, _signed(amount))

    def _cas_loop(self, t: ast.Var, value: ast.Node) -> None:
        """Snapshot the variable, compute the value with every read of the variable
        seeing the snapshot, store it if the variable still holds the snapshot."""
        retry = self.e.new_label()
        self.e.bind(retry)
        self.e.load(t.address, t.size, t.signed, t.segment)
        slot = self.e.depth
        self.e.push()
        outer = self.bound.get(t.key)
        self.bound[t.key] = slot
        self.gen(value)
        if outer is None:
            del self.bound[t.key]
        else:
            self.bound[t.key] = outer
        self.e.compare_and_swap(t.address, t.size, t.segment, retry)

    # --- scratch variables and tables --------------------------------------------------------
    def _frame(self, n: ast.Frame, value: bool = True) -> None:
        """Push the Frame's zeroed slots, run the body, drop them (acc is kept)."""
        base = self.e.depth
        if n.slots:
            self.e.const(0)
        for _ in range(n.slots):
            self.e.push()
        outer, self.frame_base = self.frame_base, base
        (self.gen if value else self.effect)(n.body)
        self.frame_base = outer
        for _ in range(n.slots):
            self.e.drop()

    def _local_temp(self, n: ast.Local) -> int:
        if self.frame_base is None:
            raise CodegenError(f"Local({n.slot}) outside any Frame")
        return self.frame_base + n.slot

    def _local(self, n: ast.Local) -> None:
        self.e.load_temp(self._local_temp(n))

    def _local_address(self, n: ast.LocalAddress) -> None:
        self.e.temp_address(self._local_temp(ast.Local(n.slot)))

    def _elem_address(self, n: ast.Elem) -> None:
        self.gen(n.index)
        self.e.element(n.base, n.count, n.size)

    def _elem(self, n: ast.Elem) -> None:
        for bound, slot in self.bound_elems:
            if _same_elem(bound, n):
                self.e.load_temp(slot)
                return
        self._elem_address(n)
        self.e.load_indirect(0, n.size, n.signed)

    def _assign_elem(self, t: ast.Elem, value_node: ast.Node, value: bool) -> None:
        """The element's address (index first), then the value, then the store."""
        self._elem_address(t)
        address = self.e.depth
        self.e.push()
        self.gen(value_node)
        self.e.store_via(address, t.size)
        self.e.drop()
        if value:
            self.e.narrow(t.size, t.signed)

    def _atomic_elem(self, t: ast.Elem, value_node: ast.Node, value: bool) -> None:
        self._elem_address(t)
        address = self.e.depth
        self.e.push()
        delta = _elem_delta(t, value_node)
        if delta is not None:
            term, negate = delta
            self.gen(term)
            if negate:
                self.e.unary("neg")
            self.e.atomic_add_via(address, t.size, fetch=value)
        else:
            retry = self.e.new_label()
            self.e.bind(retry)
            self.e.load_temp(address)
            self.e.load_indirect(0, t.size, t.signed)
            slot = self.e.depth
            self.e.push()
            self.bound_elems.append((t, slot))
            self.gen(value_node)
            self.bound_elems.pop()
            self.e.compare_and_swap_via(address, t.size, retry)
        self.e.drop()
        if value:
            self.e.narrow(t.size, t.signed)

    def _compare_exchange(self, n: ast.CompareExchange) -> None:
        t = n.target
        if isinstance(t, ast.Elem):
            self._elem_address(t)
        else:
            self.e.const(t.address)
        address = self.e.depth
        self.e.push()
        self.gen(n.expected)
        self.e.push()
        self.gen(n.new)
        self.e.compare_exchange_via(address, t.size)
        self.e.drop()
        self.e.narrow(t.size, False)

    def _call(self, n: ast.Call) -> None:
        for a in n.args:
            self.gen(a)
            self.e.push()
        self.e.call(n.address, len(n.args))

    def _pid(self, n: ast.Pid) -> None:
        memref_load(self.e, self.abi.current_task)
        self.e.load_indirect(self.abi.task_pid_offset, self.abi.task_pid_size, False)

    def _current_task(self, n: ast.CurrentTask) -> None:
        memref_load(self.e, self.abi.current_task)

    def _tgid(self, n: ast.Tgid) -> None:
        offset = self.abi.task_tgid_offset
        memref_load(self.e, self.abi.current_task)
        self.e.load_indirect(self.abi.task_pid_offset if offset is None else offset,
                             self.abi.task_pid_size, False)

    def _comm(self, n: ast.Comm) -> None:
        if self.abi.task_comm_offset is None:
            raise CodegenError("this kernel's ABI does not say where a task's name (comm) is")
        memref_load(self.e, self.abi.current_task)
        self.e.load_indirect(self.abi.task_comm_offset + 8 * n.word, 8, False)

    def _cpu(self, n: ast.Cpu) -> None:
        if self.abi.cpu_number is None:
            self.e.const(0)
        else:
            memref_load(self.e, self.abi.cpu_number)

    def _load(self, n: ast.Load) -> None:
        self.gen(n.ptr)
        if n.user and self.abi is not None and self.abi.read_user_nofault is not None:
            self.e.load_nofault(self.abi.read_user_nofault, n.size, n.signed)
        elif self.read_mode == "checked":
            self.e.load_checked(n.size, n.signed, [(r.start, r.end) for r in self.abi.readable])
        elif self.read_mode == "nofault":
            self.e.load_nofault(self.abi.read_nofault, n.size, n.signed)
        else:
            self.e.load_indirect(0, n.size, n.signed)

    def _operand_load(self, n: OperandLoad) -> None:
        self.gen(n.ptr)
        self.e.load_indirect(0, n.size, n.signed)

    def _guarded(self, n: ast.Guarded, value: bool = True) -> None:
        """Take this cpu's flag with an atomic exchange; run the body if it was free
        and give the flag back, else count a miss.  The flag's address stays in a
        temporary: a task that migrates inside the body gives back the flag it took
        (on a preemptible kernel nesting is then bounded by the number of flags)."""
        g = n.guard
        enter, leave = self.e.new_label(), self.e.new_label()
        self._guard_flag(g)
        flag = self.e.depth
        self.e.push()
        self.e.swap_indirect(1)
        self.e.jump_if_zero(enter)
        for counter in (g.missed, n.missed):
            if counter is not None and not self.e.atomic_add_imm(counter, 8, None, 1):
                self.e.const(1)
                self.e.atomic_add(counter, 8, None, fetch=False)
        self.e.jump(leave)
        self.e.bind(enter)
        self.effect(n.body)
        self.e.load_temp(flag)
        self.e.swap_indirect(0)
        self.e.bind(leave)
        self.e.drop()
        if value:
            self.e.const(0)

    def _guard_flag(self, g: ast.Guard) -> None:
        """acc = the address of the running cpu's flag of ``g``."""
        cpu = self.abi.cpu_number if self.abi is not None else None
        if cpu is None or g.slots == 1:
            self.e.const(g.flag(0))
            return
        memref_load(self.e, cpu)
        self._op_const("and", g.slots - 1)
        self._op_const("shl", 3)
        self._op_const("add", g.flag(0))

    def _op_const(self, op: str, value: int) -> None:
        """acc = acc ``op`` value."""
        if not self.e.binop_imm(op, value):
            self.e.push()
            self.e.const(value)
            self.e.binop(op)


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


#: node type -> the Codegen method that leaves its value in the accumulator
_GEN: dict[type, Callable[[Codegen, Any], None]] = {
    ast.Const: Codegen._const,
    ast.Var: Codegen._var,
    ast.BinOp: Codegen._binop,
    ast.Unary: Codegen._unary,
    ast.Compare: Codegen._compare,
    ast.LogicalAnd: Codegen._land,
    ast.LogicalOr: Codegen._lor,
    ast.LogicalNot: Codegen._lnot,
    ast.Assign: Codegen._assign,
    ast.AtomicAssign: Codegen._atomic_assign,
    ast.If: Codegen._if,
    ast.Seq: Codegen._seq,
    ast.Call: Codegen._call,
    ast.Tsc: Codegen._tsc,
    ast.Pid: Codegen._pid,
    ast.Tgid: Codegen._tgid,
    ast.CurrentTask: Codegen._current_task,
    ast.LocalAddress: Codegen._local_address,
    ast.Comm: Codegen._comm,
    ast.Cpu: Codegen._cpu,
    ast.Arg: Codegen._arg,
    ast.RetVal: Codegen._retval,
    ast.Load: Codegen._load,
    OperandLoad: Codegen._operand_load,
    ast.Reg: Codegen._reg,
    ast.Guarded: Codegen._guarded,
    ast.Frame: Codegen._frame,
    ast.Local: Codegen._local,
    ast.Elem: Codegen._elem,
    ast.CompareExchange: Codegen._compare_exchange,
}


def _reads_var(node: Any, key: tuple[int, str | None]) -> bool:
    return any(isinstance(x, ast.Var) and x.key == key for x in ast.walk(node))


def _additive_delta(t: ast.Var, value: ast.Node) -> tuple[ast.Node, bool] | None:
    """(term, negate) when ``value`` is ``t + term``, ``term + t`` or ``t - term`` and
    the term does not read ``t`` (and has no side effects on it): one locked add."""
    if not isinstance(value, ast.BinOp) or value.op not in ("add", "sub"):
        return None
    left, right = value.left, value.right
    if _is_var(left, t) and not _reads_var(right, t.key):
        return right, value.op == "sub"
    if value.op == "add" and _is_var(right, t) and not _reads_var(left, t.key):
        return left, False
    return None


def _same_elem(a: ast.Elem, b: ast.Elem) -> bool:
    """The same element of the same table (indexes have no side effects: checked)."""
    return (a.base, a.count, a.size) == (b.base, b.count, b.size) and ast.same(a.index, b.index)


def _reads_table(node: Any, t: ast.Elem) -> bool:
    return any(isinstance(x, ast.Elem) and x.table[0] == t.table[0] for x in ast.walk(node))


def _elem_delta(t: ast.Elem, value: ast.Node) -> tuple[ast.Node, bool] | None:
    """(term, negate) when ``value`` is ``t + term``, ``term + t`` or ``t - term`` and
    the term reads nothing of ``t``'s table: one locked add."""
    if not isinstance(value, ast.BinOp) or value.op not in ("add", "sub"):
        return None
    left, right = value.left, value.right

    def is_t(x: Any) -> bool:
        return isinstance(x, ast.Elem) and _same_elem(x, t) and x.signed == t.signed

    if is_t(left) and not _reads_table(right, t):
        return right, value.op == "sub"
    if value.op == "add" and is_t(right) and not _reads_table(left, t):
        return left, False
    return None


def _is_var(node: Any, t: ast.Var) -> bool:
    """``node`` reads ``t`` exactly as stored (same address, size and extension)."""
    return (isinstance(node, ast.Var) and node.key == t.key and node.size == t.size
            and node.signed == t.signed)


@dataclass(frozen=True, slots=True)
class Facts:
    """What codegen and the Manager ask of a whole tree, found in one walk."""

    #: a Call
    calls: bool = False
    #: a Load (exactly: not OperandLoad), and one with ``user``
    loads: bool = False
    user_loads: bool = False
    #: a node that reads the kernel's ABI (Pid, Tgid, Comm, Cpu, CurrentTask)
    abi: bool = False
    #: a CallTarget
    call_target: bool = False
    #: what the tree reads of the point: Arg numbers, RetVal, Reg names (as the
    #: nodes hold them, in walk order: a name the check refuses is not hashed here)
    args: tuple[Any, ...] = ()
    retval: bool = False
    regs: tuple[Any, ...] = ()

    def __or__(self, o: Facts) -> Facts:
        return Facts(self.calls or o.calls, self.loads or o.loads, self.user_loads or o.user_loads,
                     self.abi or o.abi, self.call_target or o.call_target, self.args + o.args,
                     self.retval or o.retval, self.regs + o.regs)


_ABI_NODES = (ast.Pid, ast.Tgid, ast.Comm, ast.Cpu, ast.CurrentTask)
#: classes (exactly) of which no node adds a fact
_NO_FACTS = frozenset({
    int, ast.Const, ast.Var, ast.BinOp, ast.Unary, ast.Compare, ast.LogicalAnd, ast.LogicalOr,
    ast.LogicalNot, ast.Assign, ast.AtomicAssign, ast.If, ast.Tsc, ast.Guarded, ast.Frame,
    ast.Local, ast.LocalAddress, ast.Elem, ast.CompareExchange,
})


def facts(node: Any) -> Facts:
    """The Facts of the tree ``node``, remembered by identity (nodes never change;
    a tree with a list in it, which may, is walked each time)."""
    known = _FACTS.get(id(node))
    if known is not None and known[0] is node:
        _FACTS.move_to_end(id(node))
        return known[1]
    calls = loads = user_loads = abi = call_target = retval = False
    args: list[Any] = []
    regs: list[Any] = []
    mutable = False
    stack = [node]
    while stack:
        x = stack.pop()
        t = type(x)
        if t in _NO_FACTS:
            pass
        elif t is ast.Load:
            loads = True
            user_loads = user_loads or bool(x.user)
        elif isinstance(x, ast.Call):
            calls = True
            mutable = mutable or type(x.args) is not tuple
        elif isinstance(x, ast.Seq):
            mutable = mutable or type(x.body) is not tuple
        elif isinstance(x, _ABI_NODES):
            abi = True
        elif isinstance(x, ast.CallTarget):
            call_target = True
        elif isinstance(x, ast.Arg):
            args.append(x.n)
        elif isinstance(x, ast.RetVal):
            retval = True
        elif isinstance(x, ast.Reg):
            regs.append(x.name)
        if isinstance(x, ast.Node):
            stack.extend(x.children())
    out = Facts(calls, loads, user_loads, abi, call_target, tuple(args), retval, tuple(regs))
    if isinstance(node, ast.Node) and not mutable:
        _FACTS[id(node)] = (node, out)
        if len(_FACTS) > FACTS:
            _FACTS.popitem(last=False)
    return out


#: trees whose Facts are known, by identity (holding the node keeps its id from
#: being reused): a snippet is asked about by the verifier, the Manager and codegen
_FACTS: OrderedDict[int, tuple[Any, Facts]] = OrderedDict()
FACTS = 1 << 16


def uses_calls(node: Any, abi: Any = None) -> bool:
    """Whether the code for ``node`` calls out: a Call, or a Load read through the
    ABI's read_nofault function."""
    return _calls_out(facts(node), abi)


def _calls_out(f: Facts, abi: Any) -> bool:
    nofault = read_mode(abi) == "nofault"
    user = abi is not None and abi.read_user_nofault is not None
    return f.calls or (f.loads and nofault) or (f.user_loads and user)


def position_independent(snippets: Sequence[ast.Node], abi: Any = None) -> bool:
    """Whether the code of ``snippets`` is the same at every address (no calls:
    the Emitter contract), so that one compilation serves wherever it is placed."""
    return not any(uses_calls(s, abi) for s in snippets)


def point_reads(arch: Arch, node: Any) -> frozenset[str]:
    """Registers whose value at the point the snippet reads (Arg, RetVal)."""
    return _point_reads(arch, facts(node))


def _point_reads(arch: Arch, f: Facts) -> frozenset[str]:
    out = {arch.arg_regs[n] for n in f.args} | set(f.regs)
    if f.retval:
        out.add(arch.ret_reg)
    return frozenset(out)


def gprs(arch: Arch) -> frozenset[str]:
    """The names ``Reg`` may use: the general-purpose registers."""
    return frozenset(arch.all_regs) - {"flags"}


def destination(op: CallOperand) -> ast.Node:
    """The tree that computes an indirect call's destination from the registers at
    the point: the register, or a load from ``[base + index*scale + disp]``."""
    if op.reg is not None:
        return ast.Reg(op.reg)
    terms: list[ast.Node] = []
    if op.base is not None:
        terms.append(ast.Reg(op.base))
    if op.index is not None:
        terms.append(ast.Reg(op.index) * op.scale if op.scale != 1 else ast.Reg(op.index))
    disp = ast.Const(op.disp & ((1 << 64) - 1))
    # the displacement last, so that it can be an immediate operand of the add
    address = terms[0] if terms else disp
    for term in terms[1:]:
        address = address + term
    if terms and op.disp:
        address = address + disp
    return OperandLoad(address, op.size)


def expand_call_target(snippet: ast.Node, op: CallOperand | None) -> ast.Node:
    """``snippet`` with every CallTarget replaced by the tree computing it."""
    if op is None:
        return snippet
    return ast.substitute(snippet, lambda n: destination(op) if isinstance(n, ast.CallTarget) else None)


def compile_snippets(
    arch: Arch,
    snippets: Sequence[ast.Node],
    new_emitter: Callable[[], Emitter],
    *,
    live: frozenset[str],
    point_kind: str = "entry",
    abi: Any = None,
    call_operand: CallOperand | None = None,
) -> bytes:
    """Check, then generate code that runs ``snippets`` in order and falls through
    with every live register (and the flags if live) as it found them.

    Two passes: the first saves every live register the Emitter *may* clobber and
    learns which ones the code really writes; the second saves exactly those (a
    counter increment at a point where only the flags are live saves only the
    flags), generated again unless the Emitter can put the new saves around the
    first's body (:meth:`Emitter.resave`).  The result is then verified: nothing
    live is written unsaved.

    ``call_operand`` is the operand of the indirect call at the point: CallTarget
    becomes the Reg (and Load) tree that computes the call's destination."""
    unknown = set(live).difference(arch.all_regs)
    if unknown:
        raise CodegenError(f"unknown registers in the live set: {sorted(unknown)}")
    registers = gprs(arch)
    for s in snippets:
        check(s, point_kind, registers=registers, call_operand=call_operand)
    snippets = [expand_call_target(s, call_operand) for s in snippets]
    found = reduce(operator.or_, map(facts, snippets)) if snippets else Facts()
    if abi is None and found.abi:
        raise CodegenError("Pid, Tgid, Comm and Cpu need the kernel's ABI (abi=KernelABI(...))")
    calls = _calls_out(found, abi)
    needed = frozenset(live) | _point_reads(arch, found)
    first = new_emitter()
    save = first.clobbers(calls) & needed
    code = _generate(arch, snippets, first, save, calls, abi)
    exact = first.writes() & needed
    if exact != save:
        # the saves change around a body that often does not: then it is not
        # generated again (the Emitter says when the bytes would be the same)
        resaved = first.resave(exact)
        if resaved is not None:
            second, code = first, resaved
        else:
            second = new_emitter()
            code = _generate(arch, snippets, second, exact, calls, abi)
        if not second.writes() & needed <= exact:
            raise CodegenError("generated code writes a live register it does not save")
    return code


def _generate(arch: Arch, snippets: Sequence[ast.Node], emitter: Emitter,
              save: frozenset[str], calls: bool, abi: Any) -> bytes:
    emitter.begin(save, calls)
    codegen = Codegen(arch, emitter, abi)
    for s in snippets:
        codegen.effect(s)
    if emitter.depth != 0:
        raise CodegenError(f"unbalanced temporaries after codegen (depth {emitter.depth})")
    return emitter.end()
