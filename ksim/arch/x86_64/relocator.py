"""Move consecutive x86-64 instructions elsewhere with the same effect.

A small pipeline in the manner of frida-gum's ``GumX86Relocator``: each
instruction is classified once (relative branch form, RIP-relative operand, or
position-independent), its size at the new place is computed, and then it is
written relocated:

* ``jmp rel8/rel32``        -> ``jmp rel32``                (e9 cd)
* ``jcc rel8/rel32``        -> ``jcc rel32``                (0f 80+cc cd)
* ``call rel32``            -> ``call rel32``, recomputed   (e8 cd)
* ``xbegin rel32``          -> ``xbegin rel32``, recomputed (c7 f8 cd)
* ``jrcxz/jecxz/loop/loope/loopne rel8`` (no rel32 form exists, SDM "JCC" and
  "LOOP/LOOPcc") -> ``op +2; jmp short +5; jmp rel32 target``
* RIP-relative memory operand -> same bytes, disp32 recomputed
  (SDM Vol. 2A, 2.2.1.6: the displacement is relative to the *next* instruction)
* anything else is copied.

A branch whose target is an instruction of the run itself goes to that
instruction's relocated copy.  Every long form is chosen regardless of the
distance, so the layout does not depend on targets and one pass of sizes
suffices.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import capstone
from capstone import x86 as cs_x86

from ksim.arch.base import Insn
from ksim.errors import OutOfRange, RelocationError

from .writer import INT32, Writer, fits, signed64

#: legacy prefixes (SDM Vol. 2A, 2.1.1)
_LEGACY_PREFIXES = frozenset({0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0x66, 0x67})
#: rel8-only conditional loops: jrcxz (e3), loop (e2), loope (e1), loopne (e0)
_LOOPS = frozenset({0xE0, 0xE1, 0xE2, 0xE3})

_MASK64 = (1 << 64) - 1
_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


@dataclass(frozen=True, slots=True)
class _Form:
    """How one instruction is relocated."""

    kind: str                 # "jmp", "jcc", "call", "loop", "riprel", "copy"
    prefixes: bytes = b""
    opcode: int = 0           # jcc: condition nibble; loop: the e0..e3 opcode
    target: int = 0           # branch target, or the absolute address a RIP operand reaches
    disp_offset: int = 0      # riprel: where the disp32 sits in the instruction

    def size(self, insn: Insn) -> int:
        extra = {"jmp": 5, "jcc": 6, "call": 5, "xbegin": 6, "loop": 2 + 2 + 5}
        return len(self.prefixes) + extra[self.kind] if self.kind in extra else insn.size


def _split_prefixes(raw: bytes) -> tuple[bytes, bytes]:
    n = 0
    while n < len(raw) and raw[n] in _LEGACY_PREFIXES:
        n += 1
    return raw[:n], raw[n:]


def _rel(insn: Insn, field: bytes) -> int:
    rel = int.from_bytes(field, "little", signed=True)
    return (insn.end + rel) & _MASK64


def _branch_form(insn: Insn) -> _Form | None:
    prefixes, rest = _split_prefixes(insn.raw)
    op = rest[0] if rest else None
    if op in (0xEB, 0xE9, 0xE8) or (op is not None and 0x70 <= op <= 0x7F) or op in _LOOPS or (
        op == 0x0F and len(rest) == 6 and 0x80 <= rest[1] <= 0x8F
    ):
        if 0x66 in prefixes and op not in _LOOPS:
            # operand-size override on a near branch truncates rIP on some CPUs (AMD)
            raise RelocationError(f"{insn}: 66-prefixed relative branch is not relocatable")
    if op == 0xEB and len(rest) == 2:
        return _Form("jmp", prefixes, target=_rel(insn, rest[1:]))
    if op == 0xE9 and len(rest) == 5:
        return _Form("jmp", prefixes, target=_rel(insn, rest[1:]))
    if op == 0xE8 and len(rest) == 5:
        return _Form("call", prefixes, target=_rel(insn, rest[1:]))
    if op is not None and 0x70 <= op <= 0x7F and len(rest) == 2:
        return _Form("jcc", prefixes, op & 0xF, _rel(insn, rest[1:]))
    if op == 0x0F and len(rest) == 6 and 0x80 <= rest[1] <= 0x8F:
        return _Form("jcc", prefixes, rest[1] & 0xF, _rel(insn, rest[2:]))
    if op in _LOOPS and len(rest) == 2:
        return _Form("loop", prefixes, op, _rel(insn, rest[1:]))
    if op == 0xC7 and len(rest) == 6 and rest[1] == 0xF8:
        # xbegin rel32 (SDM Vol. 2D, "XBEGIN"): the abort address is a rel32 target
        if 0x66 in prefixes:
            raise RelocationError(f"{insn}: 16-bit xbegin is not relocatable")
        return _Form("xbegin", prefixes, target=_rel(insn, rest[2:]))
    return None


def _riprel_form(insn: Insn) -> _Form | None:
    decoded = next(_cs.disasm(insn.raw, insn.address), None)
    if decoded is None or decoded.size != insn.size:
        raise RelocationError(f"{insn}: bytes do not decode as one instruction")
    for op in decoded.operands:
        if op.type == cs_x86.X86_OP_MEM and op.mem.base == cs_x86.X86_REG_RIP:
            at = decoded.disp_offset
            disp = struct.unpack_from("<i", insn.raw, at)[0]
            return _Form("riprel", target=(insn.end + disp) & _MASK64, disp_offset=at)
    return None


def classify(insn: Insn) -> _Form:
    if len(insn.raw) != insn.size:
        raise RelocationError(f"{insn}: raw bytes and size disagree")
    return _branch_form(insn) or _riprel_form(insn) or _Form("copy")


def _check_consecutive(insns: Sequence[Insn]) -> None:
    for a, b in zip(insns, insns[1:], strict=False):
        if a.end != b.address:
            raise RelocationError(f"instructions not consecutive: {a} then {b}")


class Relocator:
    """Relocates one run of consecutive instructions to ``new_address``."""

    def __init__(self, insns: Sequence[Insn], new_address: int) -> None:
        _check_consecutive(insns)
        self.insns = list(insns)
        self.new_address = new_address
        self.forms = [classify(i) for i in self.insns]
        self.new_of: dict[int, int] = {}
        pc = new_address
        for insn, form in zip(self.insns, self.forms, strict=True):
            self.new_of[insn.address] = pc
            pc += form.size(insn)
        self.start = self.insns[0].address if self.insns else 0
        self.end = self.insns[-1].end if self.insns else 0

    def _dest(self, insn: Insn, target: int) -> int:
        """A branch target, moved into the relocated copy when it lies in the run."""
        if not self.start <= target < self.end:
            return target
        if target not in self.new_of:
            raise RelocationError(f"{insn}: branches into the middle of an instruction")
        return self.new_of[target]

    def run(self) -> bytes:
        w = Writer(self.new_address)
        for insn, form in zip(self.insns, self.forms, strict=True):
            try:
                self._write(w, insn, form)
            except OutOfRange as e:
                raise RelocationError(f"{insn} at {w.pc:#x}: {e}") from e
        return w.flush()

    def _write(self, w: Writer, insn: Insn, form: _Form) -> None:
        w.put_bytes(form.prefixes)
        if form.kind == "jmp":
            w.put_jmp(self._dest(insn, form.target))
        elif form.kind == "jcc":
            w.put_jcc(form.opcode, self._dest(insn, form.target))
        elif form.kind == "call":
            w.put_call(self._dest(insn, form.target))
        elif form.kind == "xbegin":
            w.put_xbegin(self._dest(insn, form.target))
        elif form.kind == "loop":
            # op +2 (taken: to the long jmp); jmp short +5 (not taken: skip it)
            w.put_bytes(bytes([form.opcode, 0x02, 0xEB, 0x05]))
            w.put_jmp(self._dest(insn, form.target))
        elif form.kind == "riprel":
            self._write_riprel(w, insn, form)
        else:
            w.put_bytes(insn.raw)

    @staticmethod
    def _write_riprel(w: Writer, insn: Insn, form: _Form) -> None:
        disp = signed64(form.target - (w.pc + insn.size))
        if not fits(disp, INT32):
            raise RelocationError(
                f"{insn}: RIP-relative operand to {form.target:#x} out of reach from {w.pc:#x}"
            )
        raw = bytearray(insn.raw)
        raw[form.disp_offset:form.disp_offset + 4] = struct.pack("<i", disp)
        w.put_bytes(bytes(raw))


def relocate(insns: Sequence[Insn], new_address: int) -> bytes:
    """Re-encode consecutive ``insns`` to run at ``new_address`` (see module doc)."""
    return Relocator(insns, new_address).run()


def relocated_size(insns: Sequence[Insn]) -> int:
    """How many bytes ``relocate`` will produce for ``insns`` (independent of the address)."""
    return sum(classify(i).size(i) for i in insns)
