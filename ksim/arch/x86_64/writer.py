"""Emit x86-64 instructions by name, with labels resolved on ``flush()``.

Modelled on frida-gum's ``GumX86Writer``: one ``put_*`` method per instruction
form, a ``Writer`` that knows the address its code will run at (so relative
branches and RIP-relative operands to absolute addresses are encoded right
away), and labels for forward branches, patched in ``flush()``.

The writer is deterministic: one form per request (branches to labels are
always rel32 unless a ``_short`` method is asked for; immediates use the
shortest form the SDM offers for that operation).  Encodings follow Intel SDM
Vol. 2A, chapter 2 (REX, ModR/M, SIB) and the opcode pages cited per method.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ksim.arch.code import CodeBuffer, Label, condition
from ksim.errors import CodegenError, OutOfRange

from .regs import ALU, COND, SEGMENT_PREFIX, SHIFT, UNARY, reg_num

INT8 = (-(1 << 7), (1 << 7) - 1)
INT32 = (-(1 << 31), (1 << 31) - 1)


def fits(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]


def signed64(value: int) -> int:
    """An address or integer taken modulo 2**64, as a signed 64-bit value."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def abs32_reaches(address: int) -> bool:
    """Can ``address`` be an absolute sign-extended disp32 (low or top 2 GB)?"""
    return fits(signed64(address), INT32)


def rel32_reaches(src_end: int, dst: int) -> bool:
    return fits(signed64(dst - src_end), INT32)


@dataclass(frozen=True, slots=True)
class Mem:
    """A memory operand: ``segment:[base + index*scale + disp]`` or ``[rip -> rip_target]``.

    With neither base nor index, ``disp`` is an absolute address encoded as a
    sign-extended disp32 (SIB with no base, SDM Vol. 2A, Table 2-3 note 1), so it
    must lie in the low or the top 2 GB.  ``rip_target`` asks for RIP-relative
    addressing of an absolute address (SDM Vol. 2A, 2.2.1.6).
    """

    base: str | None = None
    index: str | None = None
    scale: int = 1
    disp: int = 0
    rip_target: int | None = None
    segment: str | None = None


def absolute(address: int, segment: str | None = None) -> Mem:
    return Mem(disp=address, segment=segment)


def rip_relative(address: int) -> Mem:
    return Mem(rip_target=address)


_SCALE_BITS = {1: 0, 2: 1, 4: 2, 8: 3}
#: operand-size handling per access size: (opcode offset for byte forms, 66 prefix, REX.W)
_SIZE = {1: (-1, False, False), 2: (0, True, False), 4: (0, False, False), 8: (0, False, True)}
#: zero/sign-extending loads (SDM "MOVZX", "MOVSX/MOVSXD"): (size, signed) -> (opcode, REX.W)
_LOAD = {
    (1, False): (b"\x0f\xb6", False),
    (2, False): (b"\x0f\xb7", False),
    (4, False): (b"\x8b", False),       # a 32-bit mov zero-extends (SDM Vol. 1, 3.4.1.1)
    (8, False): (b"\x8b", True),
    (1, True): (b"\x0f\xbe", True),
    (2, True): (b"\x0f\xbf", True),
    (4, True): (b"\x63", True),
    (8, True): (b"\x8b", True),
}


#: NOPS[n] is an n-byte no-op (SDM Vol. 2B, "NOP", Table 4-12)
NOPS: tuple[bytes, ...] = (
    b"",
    bytes.fromhex("90"),
    bytes.fromhex("6690"),
    bytes.fromhex("0f1f00"),
    bytes.fromhex("0f1f4000"),
    bytes.fromhex("0f1f440000"),
    bytes.fromhex("660f1f440000"),
    bytes.fromhex("0f1f8000000000"),
    bytes.fromhex("0f1f840000000000"),
    bytes.fromhex("660f1f840000000000"),
)


def _cc(cond: str | int) -> int:
    return condition(cond, COND)


class Writer(CodeBuffer):
    """Accumulates the code of one patch that will run at ``address``."""

    def __init__(self, address: int) -> None:
        super().__init__(address)
        #: (offset of the rel field, its size, offset of the instruction's end, label id)
        self._fixups: list[tuple[int, int, int, int]] = []

    def flush(self) -> bytes:
        """Resolve every label reference and return the code."""
        code = bytearray(self._code)
        for at, size, end, label_id in self._fixups:
            rel = self._bound(label_id) - end
            if size == 1 and not fits(rel, INT8):
                raise OutOfRange(f"rel8 branch at {self.address + end:#x} cannot reach label")
            code[at:at + size] = rel.to_bytes(size, "little", signed=True)
        return bytes(code)

    def put_bytes(self, data: bytes) -> None:
        self._code += data

    # --- encoding helpers --------------------------------------------------------------
    def _put_rel(self, opcode: bytes, target: int | Label, size: int) -> None:
        """``opcode`` followed by a rel8/rel32 to an address or a label."""
        end = len(self._code) + len(opcode) + size
        if isinstance(target, Label):
            self._fixups.append((len(self._code) + len(opcode), size, end, target.id))
            self._code += opcode + bytes(size)
            return
        # rip arithmetic wraps modulo 2**64 (SDM Vol. 1, 3.3.7.1), so distances do too
        rel = signed64(target - (self.address + end))
        if not fits(rel, INT8 if size == 1 else INT32):
            raise OutOfRange(
                f"rel{size * 8} at {self.pc:#x} cannot reach {target:#x} (distance {rel:#x})"
            )
        self._code += opcode + rel.to_bytes(size, "little", signed=True)

    @staticmethod
    def _rex(w: bool, r: int, x: int, b: int, force: bool = False) -> bytes:
        """REX = 0100WRXB (SDM Vol. 2A, 2.2.1.2); omitted when all bits are zero."""
        value = 0x40 | (w << 3) | ((r >> 3) << 2) | ((x >> 3) << 1) | (b >> 3)
        return bytes([value]) if value != 0x40 or force else b""

    def _mem_form(self, reg_field: int, mem: Mem) -> tuple[int, int, bytes, int | None]:
        """(REX.X source, REX.B source, ModR/M+SIB+disp bytes, rip target).

        ModR/M = mod(2) reg(3) rm(3); rm=100 announces a SIB byte, mod=00 rm=101
        is RIP+disp32, and SIB base=101 with mod=00 means "no base, disp32"
        (SDM Vol. 2A, Tables 2-2 and 2-3).
        """
        reg = (reg_field & 7) << 3
        if mem.rip_target is not None:
            return 0, 0, bytes([reg | 0b101]) + bytes(4), mem.rip_target
        index = reg_num(mem.index) if mem.index else None
        if index == 4:
            raise CodegenError("rsp cannot be an index register")
        if mem.scale not in _SCALE_BITS:
            raise CodegenError(f"bad scale {mem.scale}")
        if mem.base is None:
            disp = signed64(mem.disp)
            if not fits(disp, INT32):
                raise OutOfRange(f"absolute address {mem.disp:#x} does not fit a disp32")
            sib = (_SCALE_BITS[mem.scale] << 6) | (((index or 4) & 7) << 3) | 0b101
            return index or 0, 0, bytes([reg | 0b100, sib]) + struct.pack("<i", disp), None
        base = reg_num(mem.base)
        if not fits(mem.disp, INT32):
            raise CodegenError(f"displacement {mem.disp:#x} does not fit a disp32")
        # rbp/r13 as a base with mod=00 would mean "no base": use a zero disp8 instead
        if mem.disp == 0 and base & 7 != 5:
            mod, disp_bytes = 0b00, b""
        elif fits(mem.disp, INT8):
            mod, disp_bytes = 0b01, struct.pack("<b", mem.disp)
        else:
            mod, disp_bytes = 0b10, struct.pack("<i", mem.disp)
        if index is None and base & 7 != 4:
            return 0, base, bytes([(mod << 6) | reg | (base & 7)]) + disp_bytes, None
        # rsp/r12 as a base always needs a SIB byte (index=100: none)
        sib = (_SCALE_BITS[mem.scale] << 6) | (((4 if index is None else index) & 7) << 3) | (base & 7)
        return index or 0, base, bytes([(mod << 6) | reg | 0b100, sib]) + disp_bytes, None

    def _put_op(
        self,
        opcode: bytes,
        reg_field: int,
        rm: str | Mem,
        *,
        w: bool = False,
        prefixes: bytes = b"",
        imm: bytes = b"",
        force_rex: bool = False,
    ) -> None:
        """Legacy prefixes, segment, REX, opcode, ModR/M (+SIB, disp), immediate."""
        if isinstance(rm, Mem):
            x, b, modrm, target = self._mem_form(reg_field, rm)
            if rm.segment is not None:
                prefixes = bytes([SEGMENT_PREFIX[rm.segment]]) + prefixes
        else:
            b, x, target = reg_num(rm), 0, None
            modrm = bytes([0xC0 | ((reg_field & 7) << 3) | (b & 7)])
        insn = bytearray(prefixes + self._rex(w, reg_field, x, b, force_rex) + opcode + modrm + imm)
        if target is not None:
            rel = signed64(target - (self.pc + len(insn)))
            if not fits(rel, INT32):
                raise OutOfRange(f"RIP-relative operand at {self.pc:#x} cannot reach {target:#x}")
            at = len(insn) - len(imm) - 4
            insn[at:at + 4] = struct.pack("<i", rel)
        self._code += insn

    @staticmethod
    def _imm(value: int, size: int) -> bytes:
        lo, hi = -(1 << (size * 8 - 1)), (1 << (size * 8)) - 1
        if not lo <= value <= hi:
            raise CodegenError(f"immediate {value:#x} does not fit {size} bytes")
        return (value & ((1 << (size * 8)) - 1)).to_bytes(size, "little")

    # --- control flow ----------------------------------------------------------------
    def put_jmp(self, target: int | Label) -> None:
        """jmp rel32: e9 cd (SDM "JMP")."""
        self._put_rel(b"\xe9", target, 4)

    def put_jmp_short(self, target: int | Label) -> None:
        """jmp rel8: eb cb."""
        self._put_rel(b"\xeb", target, 1)

    def put_jcc(self, cond: str | int, target: int | Label) -> None:
        """jcc rel32: 0f 80+cc cd (SDM "Jcc"); ``cond`` is a name or the cc nibble."""
        self._put_rel(bytes([0x0F, 0x80 | _cc(cond)]), target, 4)

    def put_jcc_short(self, cond: str | int, target: int | Label) -> None:
        """jcc rel8: 70+cc cb."""
        self._put_rel(bytes([0x70 | _cc(cond)]), target, 1)

    def put_call(self, target: int | Label) -> None:
        """call rel32: e8 cd (SDM "CALL")."""
        self._put_rel(b"\xe8", target, 4)

    def put_xbegin(self, target: int | Label) -> None:
        """xbegin rel32: c7 f8 cd (SDM Vol. 2D, "XBEGIN"): abort to ``target``."""
        self._put_rel(b"\xc7\xf8", target, 4)

    def put_call_reg(self, reg: str) -> None:
        """call r/m64: ff /2."""
        self._put_op(b"\xff", 2, reg)

    def put_jmp_reg(self, reg: str) -> None:
        """jmp r/m64: ff /4."""
        self._put_op(b"\xff", 4, reg)

    def put_ret(self) -> None:
        self._code += b"\xc3"

    def put_nop(self, size: int = 1) -> None:
        """One ``size``-byte no-op: the SDM's recommended multi-byte NOP forms
        (Vol. 2B, "NOP", Table 4-12), chained for sizes above 9."""
        while size > 0:
            chunk = min(size, len(NOPS) - 1)
            self._code += NOPS[chunk]
            size -= chunk

    def put_int3(self) -> None:
        self._code += b"\xcc"

    def put_ud2(self) -> None:
        self._code += b"\x0f\x0b"

    # --- moves -------------------------------------------------------------------------
    def put_mov_reg_imm(self, reg: str, value: int) -> None:
        """Shortest exact form: mov r32, imm32 (b8+r, zero-extends), mov r/m64, imm32
        (REX.W c7 /0, sign-extends) or movabs r64, imm64 (REX.W b8+r)."""
        value &= (1 << 64) - 1
        signed = value - (1 << 64) if value >> 63 else value
        num = reg_num(reg)
        if value < (1 << 32):
            self._code += self._rex(False, 0, 0, num) + bytes([0xB8 | (num & 7)])
            self._code += struct.pack("<I", value)
        elif fits(signed, INT32):
            self._put_op(b"\xc7", 0, reg, w=True, imm=struct.pack("<i", signed))
        else:
            self.put_movabs(reg, value)

    def put_movabs(self, reg: str, value: int) -> None:
        """movabs r64, imm64 (REX.W b8+r io), always 10 bytes whatever the value."""
        num = reg_num(reg)
        self._code += self._rex(True, 0, 0, num) + bytes([0xB8 | (num & 7)])
        self._code += struct.pack("<Q", value & ((1 << 64) - 1))

    def put_mov_reg_reg(self, dst: str, src: str) -> None:
        """mov r/m64, r64: REX.W 89 /r."""
        self._put_op(b"\x89", reg_num(src), dst, w=True)

    def put_mov_reg_mem(self, reg: str, mem: Mem, size: int = 8, signed: bool = False) -> None:
        """Load ``size`` bytes into a 64-bit register, zero- or sign-extended."""
        opcode, w = _LOAD[(size, signed)]
        self._put_op(opcode, reg_num(reg), mem, w=w)

    def put_mov_mem_reg(self, mem: Mem, reg: str, size: int = 8) -> None:
        """Store the low ``size`` bytes of ``reg``: 88 /r (byte) or [66|REX.W] 89 /r."""
        delta, p66, w = _SIZE[size]
        num = reg_num(reg)
        # spl/bpl/sil/dil are only reachable with a REX prefix (SDM Vol. 2A, 2.2.1.2)
        self._put_op(bytes([0x89 + delta]), num, mem, w=w, prefixes=b"\x66" if p66 else b"",
                     force_rex=size == 1 and 4 <= num < 8)

    def put_mov_reg_gs(self, reg: str, offset: int, size: int = 8, signed: bool = False) -> None:
        """Per-cpu load ``mov reg, gs:[offset]`` (65 prefix, SIB no-base disp32)."""
        self.put_mov_reg_mem(reg, absolute(offset, "gs"), size, signed)

    def put_extend(self, dst: str, src: str, size: int, signed: bool) -> None:
        """dst = low ``size`` bytes of src, zero- or sign-extended to 64 bits
        (movzx/movsx/movsxd, or mov r32, r/m32 which zero-extends)."""
        opcode, w = _LOAD[(size, signed)]
        num = reg_num(src)
        self._put_op(opcode, reg_num(dst), src, w=w, force_rex=size == 1 and 4 <= num < 8)

    def put_xchg_reg_reg(self, a: str, b: str) -> None:
        """xchg r/m64, r64: REX.W 87 /r."""
        self._put_op(b"\x87", reg_num(b), a, w=True)

    def put_xchg_mem_reg(self, mem: Mem, reg: str) -> None:
        """xchg m64, r64: REX.W 87 /r; locked whether or not a lock prefix is given
        (SDM "XCHG")."""
        self._put_op(b"\x87", reg_num(reg), mem, w=True)

    def put_lea(self, reg: str, mem: Mem) -> None:
        """lea r64, m: REX.W 8d /r."""
        if mem.segment is not None:
            raise CodegenError("lea ignores segments; a segment override is meaningless here")
        self._put_op(b"\x8d", reg_num(reg), mem, w=True)

    def put_push(self, reg: str) -> None:
        """push r64: 50+r (REX.B for r8-r15)."""
        num = reg_num(reg)
        self._code += self._rex(False, 0, 0, num) + bytes([0x50 | (num & 7)])

    def put_pop(self, reg: str) -> None:
        """pop r64: 58+r."""
        num = reg_num(reg)
        self._code += self._rex(False, 0, 0, num) + bytes([0x58 | (num & 7)])

    def put_pushfq(self) -> None:
        self._code += b"\x9c"

    def put_popfq(self) -> None:
        self._code += b"\x9d"

    # --- arithmetic ---------------------------------------------------------------------
    def put_alu_reg_reg(self, op: str, dst: str, src: str) -> None:
        """``op dst, src`` (64-bit): REX.W <op> /r with dst in r/m (SDM Table A-6, group 1)."""
        self._put_op(bytes([ALU[op][1]]), reg_num(src), dst, w=True)

    def put_alu_reg_imm(self, op: str, reg: str, value: int) -> None:
        """``op reg, imm``: REX.W 83 /n ib or REX.W 81 /n id (sign-extended immediates)."""
        digit = ALU[op][0]
        if fits(value, INT8):
            self._put_op(b"\x83", digit, reg, w=True, imm=struct.pack("<b", value))
        elif fits(value, INT32):
            self._put_op(b"\x81", digit, reg, w=True, imm=struct.pack("<i", value))
        else:
            raise CodegenError(f"{op} immediate {value:#x} does not fit a sign-extended imm32")

    def put_add_reg_imm(self, reg: str, value: int) -> None:
        self.put_alu_reg_imm("add", reg, value)

    def put_sub_reg_imm(self, reg: str, value: int) -> None:
        self.put_alu_reg_imm("sub", reg, value)

    def put_and_reg_imm(self, reg: str, value: int) -> None:
        self.put_alu_reg_imm("and", reg, value)

    def put_cmp_reg_imm(self, reg: str, value: int) -> None:
        self.put_alu_reg_imm("cmp", reg, value)

    def put_test_reg_reg(self, a: str, b: str) -> None:
        """test r/m64, r64: REX.W 85 /r."""
        self._put_op(b"\x85", reg_num(b), a, w=True)

    def put_imul_reg_reg(self, dst: str, src: str) -> None:
        """imul r64, r/m64: REX.W 0f af /r (low 64 bits of the product)."""
        self._put_op(b"\x0f\xaf", reg_num(dst), src, w=True)

    def put_imul_reg_imm(self, dst: str, src: str, value: int) -> None:
        """imul r64, r/m64, imm: REX.W 6b /r ib or REX.W 69 /r id (sign-extended)."""
        if fits(value, INT8):
            self._put_op(b"\x6b", reg_num(dst), src, w=True, imm=struct.pack("<b", value))
        elif fits(value, INT32):
            self._put_op(b"\x69", reg_num(dst), src, w=True, imm=struct.pack("<i", value))
        else:
            raise CodegenError(f"imul immediate {value:#x} does not fit a sign-extended imm32")

    def put_unary(self, op: str, reg: str) -> None:
        """not/neg/mul/imul/div/idiv r/m64: REX.W f7 /n (group 3)."""
        self._put_op(b"\xf7", UNARY[op], reg, w=True)

    def put_shift_cl(self, op: str, reg: str) -> None:
        """shl/shr/sar/rol/ror r/m64, cl: REX.W d3 /n (count masked to 6 bits)."""
        self._put_op(b"\xd3", SHIFT[op], reg, w=True)

    def put_shift_imm(self, op: str, reg: str, count: int) -> None:
        """shift r/m64, imm8: REX.W c1 /n ib."""
        if not 0 <= count < 64:
            raise CodegenError(f"shift count {count} out of 0..63")
        self._put_op(b"\xc1", SHIFT[op], reg, w=True, imm=bytes([count]))

    def put_cqo(self) -> None:
        """Sign-extend rax into rdx:rax before idiv: REX.W 99."""
        self._code += b"\x48\x99"

    def put_setcc(self, cond: str, reg: str) -> None:
        """setcc r/m8: 0f 90+cc /0 (REX forced so that 4-7 mean spl..dil, not ah..bh)."""
        num = reg_num(reg)
        self._put_op(bytes([0x0F, 0x90 | _cc(cond)]), 0, reg, force_rex=4 <= num < 8)

    def put_movzx_reg_reg8(self, dst: str, src: str) -> None:
        """movzx r32, r/m8: 0f b6 /r (zero-extends to 64 bits)."""
        num = reg_num(src)
        self._put_op(b"\x0f\xb6", reg_num(dst), src, force_rex=4 <= num < 8)

    # --- atomics (SDM Vol. 3A, 9.1.2.2: a lock prefix makes the read-modify-write atomic) --
    def put_lock_add_mem_imm(self, mem: Mem, value: int, size: int = 8) -> None:
        """lock add m, imm: f0 [66|REX.W] 83 /0 ib | 81 /0 iz | 80 /0 ib (byte)."""
        delta, p66, w = _SIZE[size]
        prefixes = b"\xf0" + (b"\x66" if p66 else b"")
        if size == 1:
            self._put_op(b"\x80", 0, mem, prefixes=prefixes, imm=self._imm(value, 1))
        elif fits(value, INT8):
            self._put_op(b"\x83", 0, mem, w=w, prefixes=prefixes, imm=struct.pack("<b", value))
        else:
            imm = self._imm(value, 2 if size == 2 else 4)
            if size == 8 and not fits(value, INT32):
                raise CodegenError(f"lock add immediate {value:#x} does not fit an imm32")
            self._put_op(b"\x81", 0, mem, w=w, prefixes=prefixes, imm=imm)

    def put_lock_add_mem_reg(self, mem: Mem, reg: str, size: int = 8) -> None:
        """lock add m, r: f0 [66|REX.W] 01 /r (00 /r for bytes)."""
        self._put_locked(bytes([0x01 + _SIZE[size][0]]), mem, reg, size)

    def put_lock_xadd(self, mem: Mem, reg: str, size: int = 8) -> None:
        """lock xadd m, r: f0 [66|REX.W] 0f c1 /r (0f c0 for bytes); reg gets the old value."""
        self._put_locked(bytes([0x0F, 0xC1 + _SIZE[size][0]]), mem, reg, size)

    def put_lock_cmpxchg(self, mem: Mem, reg: str, size: int = 8) -> None:
        """lock cmpxchg m, r: f0 [66|REX.W] 0f b1 /r (0f b0 for bytes); compares with rax."""
        self._put_locked(bytes([0x0F, 0xB1 + _SIZE[size][0]]), mem, reg, size)

    def _put_locked(self, opcode: bytes, mem: Mem, reg: str, size: int) -> None:
        _, p66, w = _SIZE[size]
        num = reg_num(reg)
        self._put_op(opcode, num, mem, w=w, prefixes=b"\xf0" + (b"\x66" if p66 else b""),
                     force_rex=size == 1 and 4 <= num < 8)

    # --- misc ---------------------------------------------------------------------------
    def put_rdtsc(self) -> None:
        """rdtsc: 0f 31 (edx:eax = time-stamp counter)."""
        self._code += b"\x0f\x31"
