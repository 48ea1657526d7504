"""Emit A64 instructions by name, with labels resolved on ``flush()``.

The AArch64 counterpart of :mod:`ksim.arch.x86_64.writer` (and of frida-gum's
``GumArm64Writer``): one ``put_*`` method per instruction form, a ``Writer`` that
knows the address its code will run at, so PC-relative forms to absolute
addresses are encoded at once and raise OutOfRange when they cannot reach, and
labels for forward branches, patched in ``flush()``.

Every instruction is one little-endian 32-bit word.  Encodings follow the Arm
ARM (DDI 0487), chapter C6 "A64 Base Instruction Descriptions", under the name of
the instruction each method emits.  Register operands are names: ``x0``..``x30``,
``sp`` where the encoding takes the stack pointer, ``xzr`` where it takes the
zero register, and ``w0``..``w30``/``wzr``/``wsp`` where a 32-bit form exists.

Reach (the immediate, times its scale, relative to the instruction itself; see
:mod:`ksim.arch.aarch64.pcrel`): B and BL +-128 MB, B.cond, CBZ/CBNZ, ADR and
LDR (literal) +-1 MB, TBZ/TBNZ +-32 KB, ADRP +-4 GB (in 4 KB pages).
"""

from __future__ import annotations

from ksim.arch.code import CodeBuffer, Label, condition
from ksim.errors import CodegenError, OutOfRange

from . import pcrel
from .regs import COND, invert_cond

WORD = 4

#: NOP, the hint every A64 implementation executes as a no-op
NOP = 0xD503201F

#: system registers by name -> (op0, op1, CRn, CRm, op2) (the Arm ARM's system register
#: descriptions, "Accessing ...")
SYSREGS: dict[str, tuple[int, int, int, int, int]] = {
    "nzcv": (3, 3, 4, 2, 0),
    "cntvct_el0": (3, 3, 14, 0, 2),
    "sp_el0": (3, 0, 4, 1, 0),
    "tpidr_el1": (3, 0, 13, 0, 4),
    "tpidr_el2": (3, 4, 13, 0, 2),
}

_SIZE_BITS = {1: 0, 2: 1, 4: 2, 8: 3}


def reg(name: str, *, sp: bool = False, zr: bool = False) -> tuple[int, bool]:
    """(encoding number, is 64-bit) of a register name.  ``sp``/``zr``: whether this
    operand takes the stack pointer / the zero register (both are number 31)."""
    if name[:1] in ("x", "w") and name[1:].isdigit() and 0 <= int(name[1:]) <= 30:
        return int(name[1:]), name[0] == "x"
    if name in ("sp", "wsp") and sp:
        return 31, name == "sp"
    if name in ("xzr", "wzr") and zr:
        return 31, name == "xzr"
    raise CodegenError(f"{name!r} is not a register this operand takes")


def _x(name: str, *, sp: bool = False, zr: bool = False) -> int:
    """The number of a 64-bit register operand."""
    num, wide = reg(name, sp=sp, zr=zr)
    if not wide:
        raise CodegenError(f"{name!r}: this operand is 64 bits wide")
    return num


def mov_imm_words(rd: int, value: int) -> list[int]:
    """The shortest MOVZ/MOVN + MOVK sequence that sets 64-bit register ``rd`` to
    ``value`` (Arm ARM C6.2: MOVZ, MOVN, MOVK): MOVN when more of the
    four halfwords are 0xffff than are 0, then one MOVK per remaining halfword."""
    value &= pcrel.MASK64
    halves = [(value >> (16 * i)) & 0xFFFF for i in range(4)]
    inverted = halves.count(0xFFFF) > halves.count(0)
    skip = 0xFFFF if inverted else 0
    keep = [i for i, h in enumerate(halves) if h != skip] or [0]
    first = keep[0]
    if inverted:
        words = [0x92800000 | first << 21 | (~halves[first] & 0xFFFF) << 5 | rd]
    else:
        words = [0xD2800000 | first << 21 | halves[first] << 5 | rd]
    words += [0xF2800000 | i << 21 | halves[i] << 5 | rd for i in keep[1:]]
    return words


def _check_cond(cond: str | int) -> int:
    return condition(cond, COND)


class Writer(CodeBuffer):
    """Accumulates the code of one patch that will run at ``address``."""

    def __init__(self, address: int) -> None:
        if address % WORD:
            raise CodegenError(f"A64 code must be 4-byte aligned, not at {address:#x}")
        super().__init__(address)
        #: (offset of the instruction, its PC-relative form, label id)
        self._fixups: list[tuple[int, pcrel.Form, int]] = []

    def flush(self) -> bytes:
        """Resolve every label reference and return the code."""
        code = bytearray(self._code)
        for at, form, label_id in self._fixups:
            word = int.from_bytes(code[at:at + WORD], "little")
            word = form.with_target(word, self.address + at, self.address + self._bound(label_id))
            code[at:at + WORD] = word.to_bytes(WORD, "little")
        return bytes(code)

    def put_bytes(self, data: bytes) -> None:
        if len(data) % WORD:
            raise CodegenError(f"{len(data)} bytes are not a whole number of A64 instructions")
        self._code += data

    def put_word(self, word: int) -> None:
        self._code += (word & 0xFFFFFFFF).to_bytes(WORD, "little")

    # --- PC-relative forms -------------------------------------------------------------
    def put_pcrel(self, word: int, target: int | Label) -> None:
        """``word``, a PC-relative instruction, with its immediate set so that at
        this place it refers to ``target``; OutOfRange when it cannot reach."""
        form = pcrel.form_of(word)
        if form is None:
            raise CodegenError(f"{word:#010x} is not a PC-relative instruction")
        if isinstance(target, Label):
            self._fixups.append((len(self._code), form, target.id))
            self.put_word(form.with_target(word, 0, 0))
            return
        self.put_word(form.with_target(word, self.pc, target))

    def put_b(self, target: int | Label) -> None:
        """B label: +-128 MB."""
        self.put_pcrel(0x14000000, target)

    def put_bl(self, target: int | Label) -> None:
        """BL label: +-128 MB; x30 = the address after it."""
        self.put_pcrel(0x94000000, target)

    def put_b_cond(self, cond: str | int, target: int | Label) -> None:
        """B.cond label: +-1 MB."""
        self.put_pcrel(0x54000000 | _check_cond(cond), target)

    def put_cbz(self, rt: str, target: int | Label, *, nonzero: bool = False) -> None:
        """CBZ/CBNZ Rt, label: +-1 MB; Wt tests the low 32 bits."""
        num, wide = reg(rt)
        self.put_pcrel(wide << 31 | 0x34000000 | nonzero << 24 | num, target)

    def put_cbnz(self, rt: str, target: int | Label) -> None:
        self.put_cbz(rt, target, nonzero=True)

    def put_tbz(self, rt: str, bit: int, target: int | Label, *, nonzero: bool = False) -> None:
        """TBZ/TBNZ Rt, #bit, label: +-32 KB; b5:b40 is the bit."""
        num, wide = reg(rt)
        if not 0 <= bit < (64 if wide else 32):
            raise CodegenError(f"bit {bit} out of {rt}")
        self.put_pcrel((bit >> 5) << 31 | 0x36000000 | nonzero << 24 | (bit & 31) << 19 | num,
                       target)

    def put_tbnz(self, rt: str, bit: int, target: int | Label) -> None:
        self.put_tbz(rt, bit, target, nonzero=True)

    def put_adr(self, rd: str, target: int | Label) -> None:
        """ADR Xd, label: Xd = that address, +-1 MB."""
        self.put_pcrel(0x10000000 | _x(rd), target)

    def put_adrp(self, rd: str, target: int) -> None:
        """ADRP Xd, label: Xd = the 4 KB page of ``target``, +-4 GB of
        this instruction's page."""
        self.put_pcrel(0x90000000 | _x(rd), target & ~0xFFF)

    def put_ldr_literal(self, rt: str, target: int | Label, *, signed: bool = False) -> None:
        """LDR Wt/Xt, label and LDRSW Xt, label: +-1 MB."""
        num, wide = reg(rt)
        if signed and not wide:
            raise CodegenError("LDRSW (literal) loads into an X register")
        opc = 2 if signed else int(wide)
        self.put_pcrel(opc << 30 | 0x18000000 | num, target)

    def put_prfm_literal(self, prfop: int, target: int | Label) -> None:
        """PRFM <prfop>, label: a prefetch hint, +-1 MB."""
        self.put_pcrel(0xD8000000 | (prfop & 31), target)

    # --- branches through registers, exceptions, hints ------------------------------------
    def put_br(self, rn: str) -> None:
        """BR Xn."""
        self.put_word(0xD61F0000 | _x(rn) << 5)

    def put_blr(self, rn: str) -> None:
        """BLR Xn: x30 = the address after it."""
        self.put_word(0xD63F0000 | _x(rn) << 5)

    def put_ret(self, rn: str = "x30") -> None:
        """RET {Xn}."""
        self.put_word(0xD65F0000 | _x(rn) << 5)

    def put_brk(self, imm: int) -> None:
        """BRK #imm16: a breakpoint exception with ``imm`` in ESR_ELx.ISS."""
        if not 0 <= imm < 1 << 16:
            raise CodegenError(f"BRK immediate {imm:#x} out of 16 bits")
        self.put_word(0xD4200000 | imm << 5)

    def put_udf(self, imm: int = 0) -> None:
        """UDF #imm16: permanently undefined; 0x00000000 is UDF #0."""
        if not 0 <= imm < 1 << 16:
            raise CodegenError(f"UDF immediate {imm:#x} out of 16 bits")
        self.put_word(imm)

    def put_nop(self, count: int = 1) -> None:
        for _ in range(count):
            self.put_word(NOP)

    def put_dmb_ish(self) -> None:
        """DMB ISH: a full barrier for the inner-shareable domain."""
        self.put_word(0xD5033BBF)

    # --- moves ------------------------------------------------------------------------------
    def put_movz(self, rd: str, imm16: int, shift: int = 0) -> None:
        """MOVZ Xd, #imm16, LSL #shift."""
        self._put_wide_move(0xD2800000, rd, imm16, shift)

    def put_movk(self, rd: str, imm16: int, shift: int = 0) -> None:
        """MOVK Xd, #imm16, LSL #shift: the other halfwords are kept."""
        self._put_wide_move(0xF2800000, rd, imm16, shift)

    def put_movn(self, rd: str, imm16: int, shift: int = 0) -> None:
        """MOVN Xd, #imm16, LSL #shift: Xd = ~(imm16 << shift)."""
        self._put_wide_move(0x92800000, rd, imm16, shift)

    def _put_wide_move(self, opcode: int, rd: str, imm16: int, shift: int) -> None:
        if not 0 <= imm16 < 1 << 16 or shift not in (0, 16, 32, 48):
            raise CodegenError(f"wide move #{imm16:#x}, lsl #{shift} is not encodable")
        self.put_word(opcode | (shift // 16) << 21 | imm16 << 5 | _x(rd))

    def put_mov_imm(self, rd: str, value: int) -> None:
        """Xd = ``value`` (any 64-bit value) in 1 to 4 instructions (:func:`mov_imm_words`)."""
        for word in mov_imm_words(_x(rd), value):
            self.put_word(word)

    def put_mov_reg(self, rd: str, rm: str) -> None:
        """MOV Xd, Xm: ORR Xd, XZR, Xm; to or from SP it is ADD Xd, Xn, #0
       , since ORR's register 31 is the zero register."""
        if "sp" in (rd, rm):
            self.put_add_imm(rd, rm, 0)
        else:
            self.put_word(0xAA0003E0 | _x(rm, zr=True) << 16 | _x(rd))

    # --- memory ---------------------------------------------------------------------------
    def put_ldr(self, rt: str, base: str, offset: int = 0, size: int = 8, signed: bool = False,
                mode: str = "offset") -> None:
        """Load ``size`` bytes at [base + offset] into 64-bit Xt, zero-extended (LDRB/LDRH
        and LDR Wt zero the upper bits) or sign-extended (LDRSB/LDRSH/LDRSW Xt).
        ``mode``: "offset", or "pre"/"post" to write base + offset back."""
        opc = 2 if signed and size < 8 else 1
        self._put_ldst(rt, base, offset, size, opc, mode)

    def put_str(self, rt: str, base: str, offset: int = 0, size: int = 8,
                mode: str = "offset") -> None:
        """Store the low ``size`` bytes of Xt at [base + offset] (STRB/STRH/STR)."""
        self._put_ldst(rt, base, offset, size, 0, mode)

    def _put_ldst(self, rt: str, base: str, offset: int, size: int, opc: int, mode: str) -> None:
        """Load/store register: unsigned scaled offset (imm12) when it fits, else
        unscaled (LDUR/STUR, imm9); pre/post-index take an imm9 (Arm ARM C4.1, "Loads and Stores")."""
        if size not in _SIZE_BITS:
            raise CodegenError(f"bad access size {size}")
        t, n = _x(rt, zr=True), _x(base, sp=True)
        head = _SIZE_BITS[size] << 30 | opc << 22 | n << 5 | t
        if mode == "offset" and 0 <= offset < size << 12 and offset % size == 0:
            self.put_word(head | 0x39000000 | (offset // size) << 10)
            return
        if not -256 <= offset < 256:
            raise CodegenError(f"offset {offset} does not fit a load/store ({mode})")
        index = {"offset": 0b00, "post": 0b01, "pre": 0b11}.get(mode)
        if index is None:
            raise CodegenError(f"unknown addressing mode {mode!r}")
        self.put_word(head | 0x38000000 | (offset & 0x1FF) << 12 | index << 10)

    def put_stp(self, rt: str, rt2: str, base: str, offset: int = 0, mode: str = "offset") -> None:
        """STP Xt, Xt2, [base, #offset], offset a multiple of 8 in -512..504."""
        self._put_pair(0, rt, rt2, base, offset, mode)

    def put_ldp(self, rt: str, rt2: str, base: str, offset: int = 0, mode: str = "offset") -> None:
        """LDP Xt, Xt2, [base, #offset]."""
        self._put_pair(1, rt, rt2, base, offset, mode)

    def _put_pair(self, load: int, rt: str, rt2: str, base: str, offset: int, mode: str) -> None:
        if offset % 8 or not -512 <= offset <= 504:
            raise CodegenError(f"pair offset {offset} is not a multiple of 8 in -512..504")
        index = {"post": 0b01, "offset": 0b10, "pre": 0b11}.get(mode)
        if index is None:
            raise CodegenError(f"unknown addressing mode {mode!r}")
        self.put_word(0xA8000000 | index << 23 | load << 22 | ((offset // 8) & 0x7F) << 15
                      | _x(rt2, zr=True) << 10 | _x(base, sp=True) << 5 | _x(rt, zr=True))

    def put_ldaxr(self, rt: str, rn: str, size: int = 8) -> None:
        """LDAXR{B,H} Rt, [Xn]: load-acquire exclusive, zero-extended."""
        self.put_word(_SIZE_BITS[size] << 30 | 0x085FFC00 | _x(rn, sp=True) << 5 | _x(rt, zr=True))

    def put_stlxr(self, rs: str, rt: str, rn: str, size: int = 8) -> None:
        """STLXR{B,H} Ws, Rt, [Xn]: store-release exclusive; Ws = 0 on success."""
        status, _ = reg(rs)
        self.put_word(_SIZE_BITS[size] << 30 | 0x0800FC00 | status << 16
                      | _x(rn, sp=True) << 5 | _x(rt, zr=True))

    # --- arithmetic ------------------------------------------------------------------------
    def put_add_imm(self, rd: str, rn: str, imm: int, *, flags: bool = False) -> None:
        """ADD/ADDS Xd, Xn, #imm; a negative ``imm`` becomes SUB/SUBS.
        The immediate is 12 bits, optionally shifted left by 12."""
        op = 0 if imm >= 0 else 1
        self._put_addsub_imm(op, flags, rd, rn, abs(imm))

    def put_sub_imm(self, rd: str, rn: str, imm: int, *, flags: bool = False) -> None:
        """SUB/SUBS Xd, Xn, #imm."""
        op = 1 if imm >= 0 else 0
        self._put_addsub_imm(op, flags, rd, rn, abs(imm))

    def put_cmp_imm(self, rn: str, imm: int) -> None:
        """CMP Xn, #imm: SUBS XZR, Xn, #imm (CMN for a negative ``imm``)."""
        op = 1 if imm >= 0 else 0
        self._put_addsub_imm(op, True, "xzr", rn, abs(imm))

    def _put_addsub_imm(self, op: int, flags: bool, rd: str, rn: str, imm: int) -> None:
        if imm < 1 << 12:
            shifted, field = 0, imm
        elif imm % (1 << 12) == 0 and imm < 1 << 24:
            shifted, field = 1, imm >> 12
        else:
            raise CodegenError(f"add/sub immediate {imm:#x} is not encodable")
        # Rd is SP in ADD/SUB (immediate) but the zero register in ADDS/SUBS
        d = _x(rd, zr=True) if flags else _x(rd, sp=True)
        self.put_word(0x91000000 | op << 30 | flags << 29 | shifted << 22 | field << 10
                      | _x(rn, sp=True) << 5 | d)

    #: data processing, shifted register (Arm ARM C4.1): opcode bits with sf = 1
    _ALU = {
        "and": 0x8A000000, "bic": 0x8A200000, "orr": 0xAA000000, "orn": 0xAA200000,
        "eor": 0xCA000000, "ands": 0xEA000000, "add": 0x8B000000, "adds": 0xAB000000,
        "sub": 0xCB000000, "subs": 0xEB000000,
    }

    def put_alu_reg(self, op: str, rd: str, rn: str, rm: str) -> None:
        """``op`` Xd, Xn, Xm (shifted-register forms, no shift): and, bic, orr, orn, eor,
        ands, add, adds, sub, subs.  Register 31 is the zero register in all of them."""
        try:
            opcode = self._ALU[op]
        except KeyError:
            raise CodegenError(f"unknown ALU operation {op!r}") from None
        self.put_word(opcode | _x(rm, zr=True) << 16 | _x(rn, zr=True) << 5 | _x(rd, zr=True))

    def put_cmp_reg(self, rn: str, rm: str) -> None:
        """CMP Xn, Xm: SUBS XZR, Xn, Xm."""
        self.put_alu_reg("subs", "xzr", rn, rm)

    def put_tst_reg(self, rn: str, rm: str) -> None:
        """TST Xn, Xm: ANDS XZR, Xn, Xm."""
        self.put_alu_reg("ands", "xzr", rn, rm)

    def put_neg(self, rd: str, rm: str) -> None:
        """NEG Xd, Xm: SUB Xd, XZR, Xm."""
        self.put_alu_reg("sub", rd, "xzr", rm)

    def put_mvn(self, rd: str, rm: str) -> None:
        """MVN Xd, Xm: ORN Xd, XZR, Xm."""
        self.put_alu_reg("orn", rd, "xzr", rm)

    def put_madd(self, rd: str, rn: str, rm: str, ra: str, *, subtract: bool = False) -> None:
        """MADD/MSUB Xd, Xn, Xm, Xa: Xa +- Xn*Xm."""
        self.put_word(0x9B000000 | _x(rm, zr=True) << 16 | subtract << 15 | _x(ra, zr=True) << 10
                      | _x(rn, zr=True) << 5 | _x(rd, zr=True))

    def put_mul(self, rd: str, rn: str, rm: str) -> None:
        """MUL Xd, Xn, Xm: MADD with XZR (the low 64 bits of the product)."""
        self.put_madd(rd, rn, rm, "xzr")

    def put_div(self, rd: str, rn: str, rm: str, *, signed: bool = True) -> None:
        """SDIV/UDIV Xd, Xn, Xm: rounds toward zero; division
        by zero gives 0 and never traps, INT64_MIN / -1 gives INT64_MIN."""
        self.put_word((0x9AC00C00 if signed else 0x9AC00800) | _x(rm) << 16 | _x(rn) << 5 | _x(rd))

    #: LSLV/LSRV/ASRV/RORV: the count is Xm modulo 64
    _SHIFT_REG = {"lsl": 0x9AC02000, "lsr": 0x9AC02400, "asr": 0x9AC02800, "ror": 0x9AC02C00}

    def put_shift_reg(self, op: str, rd: str, rn: str, rm: str) -> None:
        self.put_word(self._SHIFT_REG[op] | _x(rm) << 16 | _x(rn) << 5 | _x(rd))

    def put_shift_imm(self, op: str, rd: str, rn: str, amount: int) -> None:
        """LSL/LSR/ASR Xd, Xn, #amount: aliases of UBFM/SBFM."""
        if not 0 <= amount < 64:
            raise CodegenError(f"shift amount {amount} out of 0..63")
        if op == "lsl":
            self._put_bitfield(0xD3400000, rd, rn, -amount % 64, 63 - amount)
        elif op == "lsr":
            self._put_bitfield(0xD3400000, rd, rn, amount, 63)
        elif op == "asr":
            self._put_bitfield(0x93400000, rd, rn, amount, 63)
        else:
            raise CodegenError(f"unknown shift {op!r}")

    def put_extend(self, rd: str, rn: str, size: int, signed: bool) -> None:
        """Xd = the low ``size`` bytes of Xn, zero- or sign-extended: UBFX/SBFX
        Xd, Xn, #0, #(8*size) (UBFM/SBFM with immr = 0, imms = 8*size-1)."""
        if size not in (1, 2, 4):
            raise CodegenError(f"bad extension size {size}")
        self._put_bitfield(0x93400000 if signed else 0xD3400000, rd, rn, 0, 8 * size - 1)

    def _put_bitfield(self, opcode: int, rd: str, rn: str, immr: int, imms: int) -> None:
        self.put_word(opcode | immr << 16 | imms << 10 | _x(rn) << 5 | _x(rd))

    def put_csel(self, rd: str, rn: str, rm: str, cond: str | int) -> None:
        """CSEL Xd, Xn, Xm, cond: Xd = cond ? Xn : Xm."""
        self.put_word(0x9A800000 | _x(rm, zr=True) << 16 | _check_cond(cond) << 12
                      | _x(rn, zr=True) << 5 | _x(rd))

    def put_csinv(self, rd: str, rn: str, rm: str, cond: str | int) -> None:
        """CSINV Xd, Xn, Xm, cond: Xd = cond ? Xn : ~Xm."""
        self.put_word(0xDA800000 | _x(rm, zr=True) << 16 | _check_cond(cond) << 12
                      | _x(rn, zr=True) << 5 | _x(rd))

    def put_cset(self, rd: str, cond: str | int) -> None:
        """CSET Xd, cond: CSINC Xd, XZR, XZR, invert(cond)."""
        inverse = invert_cond(_check_cond(cond))
        if inverse is None:
            raise CodegenError("CSET needs a condition other than AL and NV")
        self.put_word(0x9A800400 | 31 << 16 | inverse << 12 | 31 << 5 | _x(rd))

    # --- system registers -----------------------------------------------------------------
    def put_mrs(self, rt: str, sysreg: str) -> None:
        """MRS Xt, <sysreg>."""
        self.put_word(0xD5300000 | self._sysreg(sysreg) | _x(rt, zr=True))

    def put_msr(self, sysreg: str, rt: str) -> None:
        """MSR <sysreg>, Xt."""
        self.put_word(0xD5100000 | self._sysreg(sysreg) | _x(rt, zr=True))

    @staticmethod
    def _sysreg(name: str) -> int:
        try:
            op0, op1, crn, crm, op2 = SYSREGS[name]
        except KeyError:
            raise CodegenError(f"unknown system register {name!r}") from None
        return (op0 - 2) << 19 | op1 << 16 | crn << 12 | crm << 8 | op2 << 5


def b_reaches(src: int, dst: int) -> bool:
    """Can a B at ``src`` reach ``dst``?"""
    return pcrel.B.reaches(src, dst)


def encode_b(src: int, dst: int) -> bytes:
    """The 4-byte B at ``src`` to ``dst``; OutOfRange if it cannot reach."""
    if not b_reaches(src, dst):
        raise OutOfRange(f"B at {src:#x} cannot reach {dst:#x}")
    return pcrel.B.with_target(0x14000000, src, dst).to_bytes(WORD, "little")
