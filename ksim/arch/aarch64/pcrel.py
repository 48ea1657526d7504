"""The A64 PC-relative encodings, as data.

A64 has no PC register operand: the only instructions whose meaning depends on
where they are placed are the immediate branches and the PC-relative address and
literal forms, each with a signed immediate at a fixed place of its 32-bit word
(Arm ARM DDI 0487, C4.1 "A64 instruction set encoding", sections "Branches,
Exception Generating and System instructions", "Data Processing -- Immediate" (PC-rel.
addressing) and "Loads and Stores" (Load register (literal))):

=========  ===========  ===========  =======================  =======  ==========
form       mask         value        immediate                scale    reach
=========  ===========  ===========  =======================  =======  ==========
B          fc000000     14000000     imm26 [25:0]             4        +-128 MB
BL         fc000000     94000000     imm26 [25:0]             4        +-128 MB
B.cond     ff000000     54000000     imm19 [23:5]             4        +-1 MB
CBZ/CBNZ   7e000000     34000000     imm19 [23:5]             4        +-1 MB
TBZ/TBNZ   7e000000     36000000     imm14 [18:5]             4        +-32 KB
ADR        9f000000     10000000     immhi:immlo [23:5,30:29] 1        +-1 MB
ADRP       9f000000     90000000     immhi:immlo              4096     +-4 GB
LDR lit.   3b000000     18000000     imm19 [23:5]             4        +-1 MB
=========  ===========  ===========  =======================  =======  ==========

Every offset is relative to the address of the instruction itself (not of the
next one, as on x86); ADRP's is relative to that address with its low 12 bits
cleared, and counts 4 KB pages.  Addresses wrap modulo 2**64.

"LDR lit." covers LDR Wt/Xt, LDRSW Xt and PRFM (opc = 00, 01, 10, 11 with V = 0)
and LDR St/Dt/Qt (opc = 00, 01, 10 with V = 1).  B.cond's row covers BC.cond
(bit 4, FEAT_HBC), CBZ's covers CBNZ and TBZ's TBNZ (bit 24), both register
widths (bit 31); re-encoding changes the immediate only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ksim.errors import OutOfRange

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Form:
    """One PC-relative encoding: how to find and rewrite its offset."""

    name: str
    mask: int
    value: int
    bits: int        # width of the signed immediate
    scale: int       # bytes per unit of the immediate
    #: bit position of the immediate (ADR/ADRP: of immhi; immlo sits at 29)
    shift: int

    @property
    def lo(self) -> int:
        """The lowest offset this form can encode (in bytes)."""
        return -(1 << (self.bits - 1)) * self.scale

    @property
    def hi(self) -> int:
        """The highest offset this form can encode (in bytes)."""
        return ((1 << (self.bits - 1)) - 1) * self.scale

    def matches(self, word: int) -> bool:
        return word & self.mask == self.value

    def imm(self, word: int) -> int:
        """The signed immediate of ``word`` (in units of ``scale``)."""
        if self.name in ("adr", "adrp"):
            raw = (((word >> 5) & 0x7FFFF) << 2) | ((word >> 29) & 3)
        else:
            raw = (word >> self.shift) & ((1 << self.bits) - 1)
        return raw - (1 << self.bits) if raw >> (self.bits - 1) else raw

    def offset(self, word: int) -> int:
        """The signed byte offset ``word`` encodes."""
        return self.imm(word) * self.scale

    def base(self, address: int) -> int:
        """The address the offset is added to: the instruction's own, or its page."""
        return address & ~0xFFF if self.name == "adrp" else address

    def target(self, word: int, address: int) -> int:
        """The absolute address ``word`` at ``address`` refers to."""
        return (self.base(address) + self.offset(word)) & MASK64

    def distance(self, address: int, target: int) -> int:
        """target - base(address) as the CPU computes it: modulo 2**64, signed."""
        return signed64(target - self.base(address))

    def reaches(self, address: int, target: int) -> bool:
        d = self.distance(address, target)
        return self.lo <= d <= self.hi and d % self.scale == 0

    def with_target(self, word: int, address: int, target: int) -> int:
        """``word`` re-encoded, at ``address``, to refer to ``target``; OutOfRange
        when the immediate cannot hold the distance (or it is not a whole number
        of units: a branch to an address that is not a multiple of 4)."""
        d = self.distance(address, target)
        if d % self.scale:
            raise OutOfRange(f"{self.name} at {address:#x}: {target:#x} is not "
                             f"{self.scale}-byte aligned relative to it")
        if not self.lo <= d <= self.hi:
            raise OutOfRange(f"{self.name} at {address:#x} cannot reach {target:#x} "
                             f"(distance {d:#x}, reach {self.lo:#x}..{self.hi:#x})")
        imm = (d // self.scale) & ((1 << self.bits) - 1)
        if self.name in ("adr", "adrp"):
            cleared = word & ~((3 << 29) | (0x7FFFF << 5))
            return cleared | ((imm & 3) << 29) | ((imm >> 2) << 5)
        field = ((1 << self.bits) - 1) << self.shift
        return (word & ~field) | (imm << self.shift)


def signed64(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


B = Form("b", 0xFC000000, 0x14000000, 26, 4, 0)
BL = Form("bl", 0xFC000000, 0x94000000, 26, 4, 0)
B_COND = Form("b.cond", 0xFF000000, 0x54000000, 19, 4, 5)
CBZ = Form("cbz", 0x7E000000, 0x34000000, 19, 4, 5)
TBZ = Form("tbz", 0x7E000000, 0x36000000, 14, 4, 5)
ADR = Form("adr", 0x9F000000, 0x10000000, 21, 1, 5)
ADRP = Form("adrp", 0x9F000000, 0x90000000, 21, 4096, 5)
LDR_LITERAL = Form("ldr.literal", 0x3B000000, 0x18000000, 19, 4, 5)

FORMS: tuple[Form, ...] = (B, BL, B_COND, CBZ, TBZ, ADR, ADRP, LDR_LITERAL)


def form_of(word: int) -> Form | None:
    """The PC-relative form of the instruction word ``word``, or None."""
    for form in FORMS:
        if form.matches(word):
            return form
    return None


def class_key(word: int) -> int:
    """``word`` with its PC-relative immediate (if any) cleared: instructions with
    the same key differ only in where they point, so they share flow kind and
    register effects."""
    form = form_of(word)
    if form is None:
        return word
    return form.with_target(word, 0, 0)
