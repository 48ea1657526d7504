"""Jump tables as gcc emits them for x86-64 kernels (``-mcmodel=kernel``, tables of
absolute 8-byte addresses), as :class:`ksim.arch.base.JumpTableIdioms`:

* ``jmp qword ptr [idx*8 + TABLE]`` (``TABLE`` a sign-extended 32-bit address), or
  ``notrack jmp`` of the same (a ds prefix, SDM Vol. 1, 18.3.8 "Indirect Branch
  Tracking": 3e on an indirect jmp);
* ``mov reg, qword ptr [idx*8 + TABLE]`` ... ``jmp reg``;

with the number of entries taken from an unsigned bound check on the index:
``cmp idx, N`` then ``ja default`` falling through, or ``jbe``/``jb`` taken.
Between the check and the jump gcc often copies the index (``mov eax, esi``,
``movzx eax, al``, ``movsxd rax, esi``): those copies are what
:meth:`X86JumpTables.copy_source` recognises.

Operands are read from capstone's detail (SDM Vol. 2A, 2.1.5: the effective
address is base + index*scale + disp), which is slow: it is asked for only once
the mnemonic says the instruction may be one of these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from capstone import x86_const as X

from ksim.arch.base import BoundCheck, Flow, Insn, TableRead

from .reader import canonical_reg, detail, reg_width

_MASK64 = (1 << 64) - 1
#: bytes of one table entry: an absolute address
_ENTRY = 8
#: an unsigned bound check: (jcc, whether the path into the table is its taken edge)
#: -> entries for ``cmp idx, N``
_GUARDS: dict[tuple[str, bool], Callable[[int], int]] = {
    ("ja", False): lambda n: n + 1,
    ("jae", False): lambda n: n,
    ("jbe", True): lambda n: n + 1,
    ("jb", True): lambda n: n,
}
#: register copies that keep an index's value: mov (32/64-bit), movzx, movsxd
_COPIES = frozenset({"mov", "movzx", "movsxd"})


def _gpr(name: str) -> str | None:
    """The 64-bit name of a general-purpose (sub-)register, or None."""
    full = canonical_reg(name)
    return None if full == "flags" else full


def _narrow_bits(name: str) -> int | None:
    """8 or 16 for a narrow register name, None for a 32/64-bit one."""
    width = reg_width(name) or 64
    return width if width < 32 else None


def _table_operand(full: Any, op: Any) -> tuple[str, int] | None:
    """(index register, table address) of the memory operand ``qword ptr
    [idx*8 + TABLE]`` (no base, a 64-bit index, no segment but ds), else None.
    A displacement of 0 would put the table at address 0: that is no table."""
    if op.type != X.X86_OP_MEM or op.size != _ENTRY:
        return None
    mem = op.mem
    if mem.base or not mem.index or mem.scale != _ENTRY or not mem.disp:
        return None
    if mem.segment and full.reg_name(mem.segment) != "ds":
        return None
    index = full.reg_name(mem.index)
    if reg_width(index) != 64:
        return None
    return canonical_reg(index) or index, mem.disp & _MASK64


def _far(full: Any) -> bool:
    """A far jmp (``ff /5``, m16:64: a selector and an offset), which capstone
    reports as a jmp with an 8-byte operand like the near one (``ff /4``)."""
    return full.opcode[0] == 0xFF and (full.modrm >> 3) & 7 == 5


class X86JumpTables:
    """The x86-64 answers to generic jump-table recovery (ksim.analysis.cfg)."""

    def table_read(self, insn: Insn) -> TableRead | None:
        if insn.flow is Flow.JMP_INDIRECT:
            full = detail(insn)
            one = len(full.operands) == 1 and not _far(full)
            found = _table_operand(full, full.operands[0]) if one else None
            return TableRead(found[0], found[1], _ENTRY) if found else None
        if insn.mnemonic != "mov":
            return None
        full = detail(insn)
        ops = full.operands
        if len(ops) != 2 or ops[0].type != X.X86_OP_REG:
            return None
        found = _table_operand(full, ops[1])
        if found is None:
            return None
        dest = full.reg_name(ops[0].reg)
        return TableRead(found[0], found[1], _ENTRY, canonical_reg(dest) or dest)

    def jump_reg(self, insn: Insn) -> str | None:
        if insn.flow is not Flow.JMP_INDIRECT:
            return None
        full = detail(insn)
        ops = full.operands
        if len(ops) != 1 or ops[0].type != X.X86_OP_REG:
            return None
        return _gpr(full.reg_name(ops[0].reg))

    def bound_check(self, insns: Sequence[Insn], taken: bool) -> BoundCheck | None:
        """``cmp reg, N`` (the last instruction before the jcc that writes the
        flags) and an unsigned jcc that lets only indexes up to N (ja, jbe) or
        below N (jae, jb) into the table path."""
        guard = _GUARDS.get((insns[-1].mnemonic, taken)) if insns else None
        if guard is None:
            return None
        for insn in reversed(insns[:-1]):
            if "flags" not in insn.writes:
                continue
            if insn.mnemonic != "cmp":
                return None
            full = detail(insn)
            ops = full.operands
            if len(ops) != 2 or ops[0].type != X.X86_OP_REG or ops[1].type != X.X86_OP_IMM:
                return None
            name = full.reg_name(ops[0].reg)
            reg = _gpr(name)
            if reg is None:
                return None
            n = ops[1].imm
            return BoundCheck(insn.address, reg, _narrow_bits(name), n, guard(n))
        return None

    def copy_source(self, insn: Insn, reg: str) -> tuple[str, int | None] | None:
        """``mov edi, edi``, ``mov eax, esi``, ``movzx eax, al``, ``movsxd rax, esi``
        into ``reg``.  A narrow mov keeps the destination's upper bits, so only
        movzx copies a narrow register."""
        if insn.mnemonic not in _COPIES:
            return None
        full = detail(insn)
        ops = full.operands
        if len(ops) != 2 or ops[0].type != X.X86_OP_REG or ops[1].type != X.X86_OP_REG:
            return None
        dst, src = full.reg_name(ops[0].reg), full.reg_name(ops[1].reg)
        source = _gpr(src)
        if (canonical_reg(dst) or dst) != reg or source is None:
            return None
        bits = _narrow_bits(src)
        if bits is not None and insn.mnemonic != "movzx":
            return None
        return source, bits

    def table_targets(self, read: TableRead, raw: bytes) -> tuple[int, ...]:
        size = read.entry_size
        return tuple(int.from_bytes(raw[i : i + size], "little") for i in range(0, len(raw), size))


JUMP_TABLES = X86JumpTables()
