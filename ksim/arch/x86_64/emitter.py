"""The x86-64 Emitter for snippet codegen (see ksim.snippets.codegen).

Register use: rax is the accumulator, rcx holds a popped left operand (and the
shift count, cl; a checked load's offset; an exchanged value), rdx is the address
scratch and idiv's high half.  The code
may clobber rax, rcx, rdx and the flags (``writes()`` says which it does); a
snippet that calls a function also clobbers every caller-saved register and
rbx, which keeps the stack pointer of the frame while rsp is aligned to 16 for
the call (System V ABI 3.2.2).

Fault-safe loads: ``load_checked`` compares the address with each region of the
kernel's fixed memory map (an unsigned ``address - start <= end - start - size``:
one compare covers both ends) and reads 0 outside; ``load_nofault`` calls a
copy_from_kernel_nofault-like function with an 8-byte buffer on the temporary
stack.

Frame, from high to low addresses::

    [flags]  pushfq first, before anything changes them (if "flags" is saved)
    saved registers, in encoding order
    (with calls: rbx = rsp here; rsp &= -16)
    temporaries
"""

from __future__ import annotations

from collections.abc import Sequence

from ksim.errors import CodegenError
from ksim.snippets.codegen import Emitter

from .convention import LINUX
from .regs import GPR64
from .writer import (
    INT32,
    Label,
    Mem,
    Writer,
    abs32_reaches,
    absolute,
    fits,
    rel32_reaches,
    signed64,
)

ACC, LEFT, SCRATCH = "rax", "rcx", "rdx"
BASE_CLOBBERS = frozenset({ACC, LEFT, SCRATCH, "flags"})
CALL_CLOBBERS = BASE_CLOBBERS | LINUX.caller_saved | {"rbx"}

#: codegen comparison -> condition code after ``cmp left, right`` (SDM Vol. 1, B.1)
COMPARE_CC = {
    "eq": "e", "ne": "ne", "lt": "l", "le": "le", "gt": "g", "ge": "ge",
    "ult": "b", "ule": "be", "ugt": "a", "uge": "ae",
}
#: operations done as ``op rax, rcx`` (commutative)
COMMUTATIVE = {"add": "add", "and": "and", "or": "or", "xor": "xor"}
SHIFTS = {"shl": "shl", "sar": "sar", "shr": "shr"}
#: movabs rax, imm64 (10) + call rax (2)
_FAR_CALL_SIZE = 12
#: the last body ``writes`` decoded, and the registers it writes (one entry)
_LAST_BODY: tuple[bytes, frozenset[str]] | None = None


def _save_order(save: frozenset[str]) -> list[str]:
    """The order the prologue saves ``save`` in: the flags first, then encoding order."""
    return (["flags"] if "flags" in save else []) + [r for r in GPR64 if r in save]


def _prologue(w: Writer, saved: list[str]) -> None:
    for reg in saved:
        w.put_pushfq() if reg == "flags" else w.put_push(reg)


def _epilogue(w: Writer, saved: list[str]) -> None:
    for reg in reversed(saved):
        w.put_popfq() if reg == "flags" else w.put_pop(reg)


class X86Emitter(Emitter):
    """Implements ksim.snippets.codegen.Emitter for code placed at ``address``."""

    def __init__(self, address: int) -> None:
        self.w = Writer(address)
        self.depth = 0
        self._saved: list[str] = []
        self._frame_reg = False
        self._body_start = self._body_end = 0
        self._code = b""
        #: the body read where the prologue saved a register (its code depends on the saves)
        self._read_saves = False

    # --- frame -----------------------------------------------------------------------
    def clobbers(self, calls: bool) -> frozenset[str]:
        return CALL_CLOBBERS if calls else BASE_CLOBBERS

    def begin(self, save: frozenset[str], calls: bool) -> None:
        self._saved = _save_order(save)
        _prologue(self.w, self._saved)
        self._body_start = self.w.offset
        if calls:
            self._frame_reg = True
            self.w.put_mov_reg_reg("rbx", "rsp")
            self.w.put_and_reg_imm("rsp", -16)

    def end(self) -> bytes:
        if self._frame_reg:
            self.w.put_mov_reg_reg("rsp", "rbx")
        self._body_end = self.w.offset
        _epilogue(self.w, self._saved)
        self._code = self.w.flush()
        return self._code

    def resave(self, save: frozenset[str]) -> bytes | None:
        """The code begin(save) would lead to, from this finished code's body: it is
        the same bytes when the body neither calls (a call is placed relative to
        where it lies; without calls nothing in the body depends on its address,
        labels being relative within it) nor read a saved register's slot, and
        ``save`` saves nothing this code did not (a register read at the point that
        was not saved here is read where it is, as it would be again)."""
        if self._frame_reg or self._read_saves or not save <= frozenset(self._saved):
            return None
        body = self._code[self._body_start:self._body_end]
        w = Writer(self.w.address)
        saved = _save_order(save)
        _prologue(w, saved)
        start = w.offset
        w.put_bytes(body)
        end = w.offset
        _epilogue(w, saved)
        self.w, self._saved, self._body_start, self._body_end = w, saved, start, end
        self._code = w.flush()
        return self._code

    def writes(self) -> frozenset[str]:
        """Decoded from the finished code (the reader's register effects), plus every
        caller-saved register when the code calls out."""
        from .reader import sweep_writes

        global _LAST_BODY
        body = self._code[self._body_start:self._body_end]
        last = _LAST_BODY
        if last is not None and last[0] == body:
            # the same bytes decode the same (the second pass of compile_snippets
            # changes the saves around a body that is often unchanged): lengths and
            # register effects do not depend on where the code lies
            written = last[1]
        else:
            written, length = sweep_writes(body, self.w.address + self._body_start)
            if length != len(body):
                raise CodegenError("generated code does not decode")
            _LAST_BODY = (body, written)
        if self._frame_reg:
            written |= CALL_CLOBBERS
        return frozenset(written - {"rsp"})

    def _slot(self, reg: str) -> Mem:
        """Where the prologue saved ``reg``."""
        above = 8 * (len(self._saved) - 1 - self._saved.index(reg))
        if self._frame_reg:
            return Mem(base="rbx", disp=above)
        return Mem(base="rsp", disp=8 * self.depth + above)

    def point_reg(self, reg: str) -> None:
        if reg == "rsp":
            # the point's rsp lies above the prologue's saves (and the temporaries)
            self._read_saves = True
            saves = 8 * len(self._saved)
            below = Mem(base="rbx", disp=saves) if self._frame_reg else \
                Mem(base="rsp", disp=8 * self.depth + saves)
            self.w.put_lea(ACC, below)
        elif reg in self._saved:
            self._read_saves = True
            self.w.put_mov_reg_mem(ACC, self._slot(reg))
        else:
            # not saved: the code never writes it (compile_snippets verifies this)
            self.w.put_mov_reg_reg(ACC, reg)

    # --- memory ------------------------------------------------------------------------
    def _mem(self, address: int, segment: str | None, scratch: str) -> Mem:
        """An absolute disp32 operand when ``address`` lies in the low or top 2 GB (the
        kernel image), else through ``scratch`` loaded with the 64-bit address.

        RIP-relative forms are deliberately not used: the choice, and so the code's
        length, then depends on the data address only, never on where the code is
        placed, and the planner can size a patch before it allocates it."""
        if abs32_reaches(address):
            return absolute(address, segment)
        self.w.put_mov_reg_imm(scratch, address)
        return Mem(base=scratch, segment=segment)

    def const(self, value: int) -> None:
        self.w.put_mov_reg_imm(ACC, value)

    def load(self, address: int, size: int, signed: bool, segment: str | None) -> None:
        self.w.put_mov_reg_mem(ACC, self._mem(address, segment, ACC), size, signed)

    def store(self, address: int, size: int, segment: str | None) -> None:
        self.w.put_mov_mem_reg(self._mem(address, segment, SCRATCH), ACC, size)

    def load_indirect(self, offset: int, size: int, signed: bool) -> None:
        self.w.put_mov_reg_mem(ACC, Mem(base=ACC, disp=offset), size, signed)

    def load_checked(self, size: int, signed: bool, regions: Sequence[tuple[int, int]]) -> None:
        w = self.w
        inside, done = w.new_label(), w.new_label()
        for start, end in regions:
            last = end - start - size           # the highest offset a read may start at
            if last < 0:
                continue
            self._offset_from(start)            # rcx = rax - start, modulo 2**64
            if fits(last, INT32):
                w.put_cmp_reg_imm(LEFT, last)
            else:
                w.put_mov_reg_imm(SCRATCH, last)
                w.put_alu_reg_reg("cmp", LEFT, SCRATCH)
            w.put_jcc("be", inside)             # unsigned: below start wraps to a huge offset
        w.put_mov_reg_imm(ACC, 0)
        w.put_jmp(done)
        w.put_label(inside)
        w.put_mov_reg_mem(ACC, Mem(base=ACC), size, signed)
        w.put_label(done)

    def _offset_from(self, start: int) -> None:
        """rcx = rax - start (modulo 2**64), rax unchanged."""
        minus = signed64(-start)
        if fits(minus, INT32):
            self.w.put_lea(LEFT, Mem(base=ACC, disp=minus))
        else:
            self.w.put_mov_reg_imm(LEFT, minus)
            self.w.put_alu_reg_reg("add", LEFT, ACC)

    def load_nofault(self, function: int, size: int, signed: bool) -> None:
        if not self._frame_reg:
            raise CodegenError("a fault-safe load calls out: it needs begin(..., calls=True)")
        w = self.w
        failed = w.new_label()
        w.put_mov_reg_reg("rsi", ACC)           # src
        w.put_mov_reg_imm(ACC, 0)
        self.push()                             # the buffer: one zeroed temporary
        w.put_mov_reg_reg("rdi", "rsp")         # dst
        w.put_mov_reg_imm("rdx", size)          # size
        self._call(function)
        w.put_test_reg_reg(ACC, ACC)            # 0, or -EFAULT
        w.put_mov_reg_imm(ACC, 0)               # (a mov leaves the flags alone)
        w.put_jcc("nz", failed)
        w.put_mov_reg_mem(ACC, Mem(base="rsp"), size, signed)
        w.put_label(failed)
        self.drop()

    def swap_indirect(self, value: int) -> None:
        # xchg with a memory operand is locked without a lock prefix (SDM "XCHG")
        self.w.put_mov_reg_imm(LEFT, value)
        self.w.put_xchg_mem_reg(Mem(base=ACC), LEFT)
        self.w.put_mov_reg_reg(ACC, LEFT)

    def narrow(self, size: int, signed: bool) -> None:
        if size != 8:
            self.w.put_extend(ACC, ACC, size, signed)

    # --- temporaries -----------------------------------------------------------------------
    def push(self) -> None:
        self.w.put_push(ACC)
        self.depth += 1

    def _pop(self, reg: str) -> None:
        if self.depth == 0:
            raise CodegenError("temporary stack underflow")
        self.w.put_pop(reg)
        self.depth -= 1

    def load_temp(self, index: int) -> None:
        self.w.put_mov_reg_mem(ACC, Mem(base="rsp", disp=8 * (self.depth - 1 - index)))

    def temp_address(self, index: int) -> None:
        self.w.put_lea(ACC, Mem(base="rsp", disp=8 * (self.depth - 1 - index)))

    def drop(self) -> None:
        self._pop(LEFT)                          # pop rcx: one byte, flags untouched

    # --- operations ------------------------------------------------------------------------
    def binop(self, op: str) -> None:
        self._pop(LEFT)
        if op in COMMUTATIVE:
            self.w.put_alu_reg_reg(COMMUTATIVE[op], ACC, LEFT)
        elif op == "mul":
            self.w.put_imul_reg_reg(ACC, LEFT)
        elif op == "sub":
            self.w.put_alu_reg_reg("sub", LEFT, ACC)
            self.w.put_mov_reg_reg(ACC, LEFT)
        elif op in SHIFTS:
            self.w.put_xchg_reg_reg(ACC, LEFT)      # value in rax, count in cl
            self.w.put_shift_cl(SHIFTS[op], ACC)
        elif op in ("div", "mod"):
            self.w.put_xchg_reg_reg(ACC, LEFT)      # dividend in rax, divisor in rcx
            self._divide(op == "mod")
        else:
            raise CodegenError(f"unknown operator {op!r}")

    def _divide(self, modulo: bool) -> None:
        """Signed truncating division that never raises #DE (SDM "IDIV": divisor 0 and
        MIN / -1 fault): x / 0 = -1, x % 0 = x, x / -1 = -x (wrapping), x % -1 = 0."""
        w = self.w
        zero, idiv, done = w.new_label(), w.new_label(), w.new_label()
        w.put_test_reg_reg(LEFT, LEFT)
        w.put_jcc_short("z", zero)
        w.put_cmp_reg_imm(LEFT, -1)
        w.put_jcc_short("ne", idiv)
        if modulo:
            w.put_mov_reg_imm(ACC, 0)
        else:
            w.put_unary("neg", ACC)
        w.put_jmp_short(done)
        w.put_label(idiv)
        w.put_cqo()
        w.put_unary("idiv", LEFT)
        if modulo:
            w.put_mov_reg_reg(ACC, SCRATCH)
        w.put_jmp_short(done)
        w.put_label(zero)
        if not modulo:
            w.put_mov_reg_imm(ACC, -1)
        w.put_label(done)

    def binop_imm(self, op: str, value: int) -> bool:
        v = signed64(value)
        if op in SHIFTS:
            self.w.put_shift_imm(SHIFTS[op], ACC, value & 63)
        elif not fits(v, INT32) or op in ("div", "mod"):
            return False
        elif op in COMMUTATIVE or op == "sub":
            self.w.put_alu_reg_imm(op, ACC, v)
        elif op == "mul":
            self.w.put_imul_reg_imm(ACC, ACC, v)
        else:
            return False
        return True

    def compare_imm(self, op: str, value: int) -> bool:
        v = signed64(value)
        if not fits(v, INT32):
            return False
        self.w.put_cmp_reg_imm(ACC, v)
        self._set_acc(COMPARE_CC[op])
        return True

    def compare(self, op: str) -> None:
        self._pop(LEFT)
        self.w.put_alu_reg_reg("cmp", LEFT, ACC)
        self._set_acc(COMPARE_CC[op])

    def _set_acc(self, cond: str) -> None:
        self.w.put_setcc(cond, ACC)
        self.w.put_movzx_reg_reg8(ACC, ACC)

    def unary(self, op: str) -> None:
        if op == "lnot":
            self.w.put_test_reg_reg(ACC, ACC)
            self._set_acc("e")
        else:
            self.w.put_unary(op, ACC)

    def counter(self) -> None:
        self.w.put_rdtsc()                        # edx:eax, upper halves zeroed
        self.w.put_shift_imm("shl", SCRATCH, 32)
        self.w.put_alu_reg_reg("or", ACC, SCRATCH)

    # --- tables and scratch variables -------------------------------------------------------
    def element(self, base: int, count: int, size: int) -> None:
        w = self.w
        last = count - 1
        inside = w.new_label()
        if fits(last, INT32):
            w.put_cmp_reg_imm(ACC, last)
        else:
            w.put_mov_reg_imm(LEFT, last)
            w.put_alu_reg_reg("cmp", ACC, LEFT)
        w.put_jcc("be", inside)                 # unsigned: a negative index clamps too
        w.put_mov_reg_imm(ACC, last)
        w.put_label(inside)
        if size > 1:
            w.put_shift_imm("shl", ACC, size.bit_length() - 1)
        b = signed64(base)
        if fits(b, INT32):
            w.put_alu_reg_imm("add", ACC, b)
        else:
            w.put_mov_reg_imm(LEFT, base)
            w.put_alu_reg_reg("add", ACC, LEFT)

    def _temp(self, index: int) -> Mem:
        return Mem(base="rsp", disp=8 * (self.depth - 1 - index))

    def store_temp(self, index: int) -> None:
        self.w.put_mov_mem_reg(self._temp(index), ACC)

    def _via(self, temp: int) -> Mem:
        """rdx = the address held by temporary ``temp``; the operand [rdx]."""
        self.w.put_mov_reg_mem(SCRATCH, self._temp(temp))
        return Mem(base=SCRATCH)

    def store_via(self, temp: int, size: int) -> None:
        self.w.put_mov_mem_reg(self._via(temp), ACC, size)

    def atomic_add_via(self, temp: int, size: int, fetch: bool = True) -> None:
        mem = self._via(temp)
        if not fetch:
            self.w.put_lock_add_mem_reg(mem, ACC, size)
            return
        self.w.put_mov_reg_reg(LEFT, ACC)
        self.w.put_lock_xadd(mem, ACC, size)     # rax = old value
        self.w.put_alu_reg_reg("add", ACC, LEFT)

    def compare_and_swap_via(self, temp: int, size: int, retry: Label) -> None:
        self.compare_exchange_via(temp, size)
        self.w.put_jcc("nz", retry)              # ZF: cmpxchg stored (SDM "CMPXCHG")
        self.w.put_mov_reg_reg(ACC, LEFT)

    def compare_exchange_via(self, temp: int, size: int) -> None:
        self.w.put_mov_reg_reg(LEFT, ACC)        # new value
        self._pop(ACC)                           # expected old value
        self.w.put_lock_cmpxchg(self._via(temp), LEFT, size)   # rax = the old value

    # --- control flow ----------------------------------------------------------------------
    def new_label(self) -> Label:
        return self.w.new_label()

    def bind(self, label: Label) -> None:
        self.w.put_label(label)

    def jump(self, label: Label) -> None:
        self.w.put_jmp(label)

    def jump_if_zero(self, label: Label) -> None:
        self.w.put_test_reg_reg(ACC, ACC)
        self.w.put_jcc("z", label)

    def call(self, address: int, nargs: int) -> None:
        if not self._frame_reg:
            raise CodegenError("a call needs the aligned frame: begin(..., calls=True)")
        for reg in reversed(LINUX.arg_regs[:nargs]):
            self._pop(reg)
        self._call(address)

    def _call(self, address: int) -> None:
        """call ``address`` with rsp 16-aligned (its arguments already in registers)."""
        pad = self.depth % 2 == 1               # rsp was 16-aligned at depth 0
        if pad:
            self.w.put_sub_reg_imm("rsp", 8)
        if rel32_reaches(self.w.pc + 5, address):
            # padded to the length of the far form so that the code's length does
            # not depend on where it is placed
            self.w.put_call(address)
            self.w.put_nop(_FAR_CALL_SIZE - 5)
        else:
            self.w.put_movabs(ACC, address)
            self.w.put_call_reg(ACC)
        if pad:
            self.w.put_add_reg_imm("rsp", 8)

    # --- atomics (lock prefix: SDM Vol. 3A, 9.1.2.2) ------------------------------------
    def atomic_add(self, address: int, size: int, segment: str | None, fetch: bool = True) -> None:
        mem = self._mem(address, segment, SCRATCH)
        if not fetch:
            self.w.put_lock_add_mem_reg(mem, ACC, size)
            return
        self.w.put_mov_reg_reg(LEFT, ACC)
        self.w.put_lock_xadd(mem, ACC, size)     # rax = old value
        self.w.put_alu_reg_reg("add", ACC, LEFT)

    def atomic_add_imm(self, address: int, size: int, segment: str | None, value: int) -> bool:
        bits = 8 * size
        v = value & ((1 << bits) - 1)            # only the low bytes matter at this size
        v = v - (1 << bits) if v >> (bits - 1) else v
        if not fits(v, INT32):
            return False
        self.w.put_lock_add_mem_imm(self._mem(address, segment, SCRATCH), v, size)
        return True

    def compare_and_swap(self, address: int, size: int, segment: str | None, retry: Label) -> None:
        self.w.put_mov_reg_reg(LEFT, ACC)        # new value
        self._pop(ACC)                           # expected old value
        mem = self._mem(address, segment, SCRATCH)
        self.w.put_lock_cmpxchg(mem, LEFT, size)
        self.w.put_jcc("nz", retry)
        self.w.put_mov_reg_reg(ACC, LEFT)
