"""The AArch64 Emitter for snippet codegen (see ksim.snippets.codegen).

Register use: x9 is the accumulator, x10 holds a popped left operand (an
expected value, an atomic's loaded value), x11 is the address scratch, x12 the
value an exclusive load returns and x13 an exclusive store's status.  They are
AAPCS64 temporaries (6.1.1: x9..x15), never argument or result registers, so
snippets at a function's entry rarely need to save anything.  The code may
clobber x9..x13 and the flags (``writes()`` says which it does); a snippet that
calls a function also clobbers every caller-saved register (x0..x18, x30: the
call itself writes the link register) and the flags.

The stack pointer stays 16-byte aligned all the time, as the kernel requires
(SCTLR_EL1.SA checks every SP-based access, Arm ARM, "SP alignment
checking"; AAPCS64, "The stack", at calls): every temporary takes a 16-byte slot
(``STR x9, [sp, #-16]!``), and the frame of saved registers is rounded up to 16.
So a call needs no realignment and no frame register.

Per-cpu variables (segment "gs", the name snippets use for "this cpu's copy") are
reached from the per-cpu offset the Linux arm64 kernel keeps in TPIDR_EL1
(``__my_cpu_offset``, arch/arm64/include/asm/percpu.h; TPIDR_EL2 when the kernel
runs at EL2 with VHE, selected by ``percpu_sysreg``).

Atomics are load-acquire/store-release exclusive loops (LDAXR/STLXR), which every
ARMv8.0 cpu has; the cpu's monitor makes each loop atomic (Arm ARM, "Synchronization and semaphores").

Fault-safe loads: ``load_checked`` compares the address with each region of the
kernel's fixed memory map (an unsigned ``address - start <= end - start - size``)
and reads 0 outside; ``load_nofault`` calls a copy_from_kernel_nofault-like
function with a 16-byte buffer on the stack.

Constant addresses are built with MOVZ/MOVK, never with ADR/ADRP: the code's length
then depends on the data addresses only, never on where it is placed, so the
planner can size a patch before it allocates it.

Frame, from low to high addresses (sp at the bottom)::

    temporaries (16 bytes each)
    saved registers, in encoding order, 8 bytes each
    the flags (NZCV), saved last and restored first
    (padding to 16)
    --- the point's sp
"""

from __future__ import annotations

from collections.abc import Sequence

from ksim.errors import CodegenError
from ksim.snippets.codegen import Emitter

from .convention import LINUX
from .pcrel import signed64
from .regs import FLAGS, GPR64, IP0
from .writer import Label, Writer

ACC, LEFT, SCRATCH, LOADED, STATUS = "x9", "x10", "x11", "x12", "x13"
STATUS_W = "w13"            # a store-exclusive's status is a W register (0: stored)
BASE_CLOBBERS = frozenset({ACC, LEFT, SCRATCH, LOADED, STATUS, FLAGS})
CALL_CLOBBERS = BASE_CLOBBERS | LINUX.caller_saved
SLOT = 16

#: codegen comparison -> condition after ``cmp left, right`` (Arm ARM, "Condition code" table)
COMPARE_CC = {
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "ult": "lo", "ule": "ls", "ugt": "hi", "uge": "hs",
}
#: operations done as ``op x9, x10, x9``
REG_OPS = {"add": "add", "sub": "sub", "and": "and", "or": "orr", "xor": "eor"}
SHIFTS = {"shl": "lsl", "sar": "asr", "shr": "lsr"}


def _imm12(value: int) -> bool:
    """Can ``value`` be an ADD/SUB immediate (12 bits, optionally shifted by 12)?"""
    return 0 <= value < 1 << 12 or (value % (1 << 12) == 0 and 0 <= value < 1 << 24)


class AArch64Emitter(Emitter):
    """Implements ksim.snippets.codegen.Emitter for code placed at ``address``."""

    def __init__(self, address: int, *, percpu_sysreg: str = "tpidr_el1") -> None:
        self.w = Writer(address)
        self.depth = 0
        self.percpu_sysreg = percpu_sysreg
        self._saved: list[str] = []
        self._frame = 0
        self._calls = False
        self._body_start = self._body_end = 0
        self._code = b""

    # --- frame -----------------------------------------------------------------------
    def clobbers(self, calls: bool) -> frozenset[str]:
        return CALL_CLOBBERS if calls else BASE_CLOBBERS

    def begin(self, save: frozenset[str], calls: bool) -> None:
        self._saved = [r for r in GPR64 if r in save] + ([FLAGS] if FLAGS in save else [])
        self._frame = -(-8 * len(self._saved) // SLOT) * SLOT
        self._calls = calls
        w = self.w
        if self._frame:
            w.put_sub_imm("sp", "sp", self._frame)
        gprs = [r for r in self._saved if r != FLAGS]
        for i in range(0, len(gprs) - 1, 2):
            w.put_stp(gprs[i], gprs[i + 1], "sp", 8 * i)
        if len(gprs) % 2:
            w.put_str(gprs[-1], "sp", 8 * (len(gprs) - 1))
        if FLAGS in save:
            # x9 is already saved when it is live (writes() reports it written)
            w.put_mrs(ACC, "nzcv")
            w.put_str(ACC, "sp", self._offset(FLAGS))
        self._body_start = w.offset

    def end(self) -> bytes:
        w = self.w
        self._body_end = w.offset
        if FLAGS in self._saved:
            w.put_ldr(ACC, "sp", self._offset(FLAGS))
            w.put_msr("nzcv", ACC)
        gprs = [r for r in self._saved if r != FLAGS]
        for i in range(0, len(gprs) - 1, 2):
            w.put_ldp(gprs[i], gprs[i + 1], "sp", 8 * i)
        if len(gprs) % 2:
            w.put_ldr(gprs[-1], "sp", 8 * (len(gprs) - 1))
        if self._frame:
            w.put_add_imm("sp", "sp", self._frame)
        self._code = w.flush()
        return self._code

    def writes(self) -> frozenset[str]:
        """Decoded from the finished code (the reader's register effects), plus every
        caller-saved register when the code calls out, plus x9 when the flags are
        saved (it carries them to and from their slot)."""
        from .reader import decode

        body = self._code[self._body_start:self._body_end]
        out: set[str] = set()
        insns = list(decode(body, self.w.address + self._body_start))
        if 4 * len(insns) != len(body):
            raise CodegenError("generated code does not decode")
        for insn in insns:
            out |= insn.writes
        if self._calls:
            out |= CALL_CLOBBERS
        if FLAGS in self._saved:
            out.add(ACC)
        return frozenset(out - {"sp"})

    def _offset(self, reg: str) -> int:
        """Where the prologue saved ``reg``, relative to sp at depth 0."""
        return 8 * self._saved.index(reg)

    def point_reg(self, reg: str) -> None:
        w = self.w
        if reg == "sp":
            w.put_add_imm(ACC, "sp", self._frame + SLOT * self.depth)
        elif reg in self._saved:
            w.put_ldr(ACC, "sp", SLOT * self.depth + self._offset(reg))
        elif reg == FLAGS:
            w.put_mrs(ACC, "nzcv")
        else:
            # not saved: the code never writes it (compile_snippets verifies this)
            w.put_mov_reg(ACC, reg)

    # --- memory ------------------------------------------------------------------------
    def _address(self, address: int, segment: str | None, reg: str, spare: str) -> None:
        """``reg`` = the address of a variable: ``address`` itself, or for a per-cpu
        one ("gs") this cpu's offset plus ``address`` (``spare`` may be clobbered)."""
        w = self.w
        if segment is None:
            w.put_mov_imm(reg, address)
            return
        if segment != "gs":
            raise CodegenError(f"unknown segment {segment!r} (AArch64 knows per-cpu 'gs' only)")
        w.put_mrs(reg, self.percpu_sysreg)
        offset = signed64(address)
        if _imm12(abs(offset)):
            w.put_add_imm(reg, reg, offset)
        else:
            w.put_mov_imm(spare, address)
            w.put_alu_reg("add", reg, reg, spare)

    def const(self, value: int) -> None:
        self.w.put_mov_imm(ACC, value)

    def load(self, address: int, size: int, signed: bool, segment: str | None) -> None:
        self._address(address, segment, ACC, SCRATCH)
        self.w.put_ldr(ACC, ACC, 0, size, signed)

    def store(self, address: int, size: int, segment: str | None) -> None:
        self._address(address, segment, SCRATCH, LEFT)
        self.w.put_str(ACC, SCRATCH, 0, size)

    def load_indirect(self, offset: int, size: int, signed: bool) -> None:
        w = self.w
        if 0 <= offset < size << 12 and offset % size == 0 or -256 <= offset < 256:
            w.put_ldr(ACC, ACC, offset, size, signed)
            return
        w.put_mov_imm(SCRATCH, offset)
        w.put_alu_reg("add", ACC, ACC, SCRATCH)
        w.put_ldr(ACC, ACC, 0, size, signed)

    def load_checked(self, size: int, signed: bool, regions: Sequence[tuple[int, int]]) -> None:
        w = self.w
        inside, done = w.new_label(), w.new_label()
        for start, end in regions:
            last = end - start - size           # the highest offset a read may start at
            if last < 0:
                continue
            w.put_mov_imm(SCRATCH, start)
            w.put_alu_reg("sub", LEFT, ACC, SCRATCH)    # modulo 2**64: below start is huge
            if _imm12(last):
                w.put_cmp_imm(LEFT, last)
            else:
                w.put_mov_imm(SCRATCH, last)
                w.put_cmp_reg(LEFT, SCRATCH)
            w.put_b_cond("ls", inside)          # unsigned <=
        w.put_mov_imm(ACC, 0)
        w.put_b(done)
        w.put_label(inside)
        w.put_ldr(ACC, ACC, 0, size, signed)
        w.put_label(done)

    def load_nofault(self, function: int, size: int, signed: bool) -> None:
        if not self._calls:
            raise CodegenError("a fault-safe load calls out: it needs begin(..., calls=True)")
        w = self.w
        w.put_mov_reg("x1", ACC)                # src
        w.put_mov_imm(ACC, 0)
        self.push()                             # the buffer: one zeroed temporary
        w.put_mov_reg("x0", "sp")               # dst
        w.put_mov_imm("x2", size)               # size
        self._call(function)                    # x9 = 0, or -EFAULT
        w.put_ldr(LEFT, "sp", 0, size, signed)
        w.put_cmp_imm(ACC, 0)
        w.put_csel(ACC, LEFT, "xzr", "eq")      # a partial copy reads as 0 too
        self.drop()

    def swap_indirect(self, value: int) -> None:
        w = self.w
        retry = w.new_label()
        w.put_mov_imm(LEFT, value)
        w.put_label(retry)
        w.put_ldaxr(LOADED, ACC)
        w.put_stlxr(STATUS, LEFT, ACC)
        w.put_cbnz(STATUS_W, retry)
        w.put_mov_reg(ACC, LOADED)

    def narrow(self, size: int, signed: bool) -> None:
        if size != 8:
            self.w.put_extend(ACC, ACC, size, signed)

    # --- temporaries -----------------------------------------------------------------------
    def push(self) -> None:
        self.w.put_str(ACC, "sp", -SLOT, mode="pre")
        self.depth += 1

    def _pop(self, reg: str) -> None:
        if self.depth == 0:
            raise CodegenError("temporary stack underflow")
        self.w.put_ldr(reg, "sp", SLOT, mode="post")
        self.depth -= 1

    def _temp(self, index: int) -> int:
        return SLOT * (self.depth - 1 - index)

    def load_temp(self, index: int) -> None:
        self.w.put_ldr(ACC, "sp", self._temp(index))

    def temp_address(self, index: int) -> None:
        self.w.put_add_imm(ACC, "sp", self._temp(index))

    def drop(self) -> None:
        if self.depth == 0:
            raise CodegenError("temporary stack underflow")
        self.w.put_add_imm("sp", "sp", SLOT)     # ADD (immediate) leaves the flags alone
        self.depth -= 1

    # --- operations ------------------------------------------------------------------------
    def binop(self, op: str) -> None:
        self._pop(LEFT)
        w = self.w
        if op in REG_OPS:
            w.put_alu_reg(REG_OPS[op], ACC, LEFT, ACC)
        elif op == "mul":
            w.put_mul(ACC, LEFT, ACC)
        elif op in SHIFTS:
            w.put_shift_reg(SHIFTS[op], ACC, LEFT, ACC)   # the count modulo 64
        elif op == "div":
            # SDIV gives 0 for x / 0 and MIN for MIN / -1; x / 0 must be -1
            w.put_div(SCRATCH, LEFT, ACC)
            w.put_cmp_imm(ACC, 0)
            w.put_csinv(ACC, SCRATCH, "xzr", "ne")
        elif op == "mod":
            # x - (x / y) * y: x % 0 = x - 0 = x, MIN % -1 = MIN - MIN = 0
            w.put_div(SCRATCH, LEFT, ACC)
            w.put_madd(ACC, SCRATCH, ACC, LEFT, subtract=True)
        else:
            raise CodegenError(f"unknown operator {op!r}")

    def binop_imm(self, op: str, value: int) -> bool:
        v = signed64(value)
        if op in SHIFTS:
            self.w.put_shift_imm(SHIFTS[op], ACC, ACC, value & 63)
        elif op in ("add", "sub") and _imm12(abs(v)):
            (self.w.put_add_imm if op == "add" else self.w.put_sub_imm)(ACC, ACC, v)
        else:
            return False
        return True

    def compare_imm(self, op: str, value: int) -> bool:
        v = signed64(value)
        if not _imm12(abs(v)):
            return False
        self.w.put_cmp_imm(ACC, v)              # CMN for a negative value: the same flags
        self.w.put_cset(ACC, COMPARE_CC[op])
        return True

    def compare(self, op: str) -> None:
        self._pop(LEFT)
        self.w.put_cmp_reg(LEFT, ACC)
        self.w.put_cset(ACC, COMPARE_CC[op])

    def unary(self, op: str) -> None:
        if op == "lnot":
            self.w.put_cmp_imm(ACC, 0)
            self.w.put_cset(ACC, "eq")
        elif op == "neg":
            self.w.put_neg(ACC, ACC)
        elif op == "not":
            self.w.put_mvn(ACC, ACC)
        else:
            raise CodegenError(f"unknown unary operator {op!r}")

    def counter(self) -> None:
        """The virtual count (CNTVCT_EL0, Arm ARM, "The Generic Timer"): the generic timer's
        counter, readable at every exception level Linux runs code at."""
        self.w.put_mrs(ACC, "cntvct_el0")

    # --- tables and scratch variables -------------------------------------------------------
    def element(self, base: int, count: int, size: int) -> None:
        w = self.w
        w.put_mov_imm(LEFT, count - 1)
        w.put_cmp_reg(ACC, LEFT)
        w.put_csel(ACC, ACC, LEFT, "ls")        # unsigned: a negative index clamps too
        if size > 1:
            w.put_shift_imm("lsl", ACC, ACC, size.bit_length() - 1)
        b = signed64(base)
        if _imm12(abs(b)):
            w.put_add_imm(ACC, ACC, b)
        else:
            w.put_mov_imm(LEFT, base)
            w.put_alu_reg("add", ACC, ACC, LEFT)

    def store_temp(self, index: int) -> None:
        self.w.put_str(ACC, "sp", self._temp(index))

    def _via(self, temp: int) -> str:
        """x11 = the address held by temporary ``temp``."""
        self.w.put_ldr(SCRATCH, "sp", self._temp(temp))
        return SCRATCH

    def store_via(self, temp: int, size: int) -> None:
        self.w.put_str(ACC, self._via(temp), 0, size)

    def atomic_add_via(self, temp: int, size: int, fetch: bool = True) -> None:
        self._atomic_add(self._via(temp), size, fetch)

    def _atomic_add(self, base: str, size: int, fetch: bool) -> None:
        """[base] += x9 (``size`` bytes) in an exclusive loop; x9 = the new value
        (not narrowed) when ``fetch``."""
        w = self.w
        retry = w.new_label()
        w.put_label(retry)
        w.put_ldaxr(LEFT, base, size)
        w.put_alu_reg("add", LEFT, LEFT, ACC)
        w.put_stlxr(STATUS, LEFT, base, size)
        w.put_cbnz(STATUS_W, retry)
        if fetch:
            w.put_mov_reg(ACC, LEFT)

    def _compare_exchange(self, base: str, size: int) -> None:
        """Store x9 at [base] if it holds x10 (its low ``size`` bytes): x12 = the old
        value, the flags EQ exactly when the store happened (CMP then nothing that
        sets flags)."""
        w = self.w
        retry, done = w.new_label(), w.new_label()
        if size < 8:
            w.put_extend(LEFT, LEFT, size, False)   # the loaded value is zero-extended
        w.put_label(retry)
        w.put_ldaxr(LOADED, base, size)
        w.put_cmp_reg(LOADED, LEFT)
        w.put_b_cond("ne", done)
        w.put_stlxr(STATUS, ACC, base, size)
        w.put_cbnz(STATUS_W, retry)
        w.put_label(done)

    def compare_and_swap_via(self, temp: int, size: int, retry: Label) -> None:
        self._pop(LEFT)                          # expected old value
        self._compare_exchange(self._via(temp), size)
        self.w.put_b_cond("ne", retry)

    def compare_exchange_via(self, temp: int, size: int) -> None:
        self._pop(LEFT)                          # expected old value
        self._compare_exchange(self._via(temp), size)
        self.w.put_mov_reg(ACC, LOADED)

    # --- control flow ----------------------------------------------------------------------
    def new_label(self) -> Label:
        return self.w.new_label()

    def bind(self, label: Label) -> None:
        self.w.put_label(label)

    def jump(self, label: Label) -> None:
        self.w.put_b(label)

    def jump_if_zero(self, label: Label) -> None:
        self.w.put_cbz(ACC, label)

    def call(self, address: int, nargs: int) -> None:
        if not self._calls:
            raise CodegenError("a call needs begin(..., calls=True)")
        for reg in reversed(LINUX.arg_regs[:nargs]):
            self._pop(reg)
        self._call(address)

    def _call(self, address: int) -> None:
        """BLR through x16 (IP0, free at any call: AAPCS64 6.1.1) to ``address``, its
        arguments already in registers; x9 = the result.  Never BL: its reach would
        make the code's length depend on where it is placed."""
        self.w.put_mov_imm(IP0, address)
        self.w.put_blr(IP0)
        self.w.put_mov_reg(ACC, LINUX.ret_reg)

    # --- atomics ---------------------------------------------------------------------------
    def atomic_add(self, address: int, size: int, segment: str | None, fetch: bool = True) -> None:
        self._address(address, segment, SCRATCH, LEFT)
        self._atomic_add(SCRATCH, size, fetch)

    def compare_and_swap(self, address: int, size: int, segment: str | None, retry: Label) -> None:
        self._pop(LEFT)                          # expected old value
        self._address(address, segment, SCRATCH, LOADED)
        self._compare_exchange(SCRATCH, size)
        self.w.put_b_cond("ne", retry)
