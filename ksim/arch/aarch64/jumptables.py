"""Jump tables on AArch64, as :class:`ksim.arch.base.JumpTableIdioms`: none are
recognised yet.

gcc and clang lay out an arm64 switch as a table of *relative* entries (1, 2 or
4 bytes, scaled by 4) added to the address of a label taken with ``ADR``::

    cmp   w0, #N ; b.hi default
    adrp  x1, table ; add x1, x1, :lo12:table
    ldrb  w2, [x1, w0, uxtw]          (ldrh ..., uxtw #1 / ldr w2, ..., uxtw #2)
    adr   x3, base
    add   x2, x3, w2, sxtb #2         (sxth / sxtw)
    br    x2

A :class:`~ksim.arch.base.TableRead` (table, index, entry size) cannot carry that
base, and ``table_targets`` sees only the raw entries, so these tables cannot be
described through the contract as it stands.  Every question here is answered
"no": each ``BR`` stays an unresolved indirect jump, which the analyses and the
planner treat conservatively (no window is displaced across it).
"""

from __future__ import annotations

from collections.abc import Sequence

from ksim.arch.base import BoundCheck, Insn, TableRead


class AArch64JumpTables:
    """Recognises no jump table (module doc)."""

    def table_read(self, insn: Insn) -> TableRead | None:
        return None

    def jump_reg(self, insn: Insn) -> str | None:
        return None

    def bound_check(self, insns: Sequence[Insn], taken: bool) -> BoundCheck | None:
        return None

    def copy_source(self, insn: Insn, reg: str) -> tuple[str, int | None] | None:
        return None

    def table_targets(self, read: TableRead, raw: bytes) -> tuple[int, ...]:
        return ()


JUMP_TABLES = AArch64JumpTables()
