"""What every architecture's writer shares: a buffer of code that will run at a
known address, labels bound to positions in it, and condition names checked
against the architecture's table.  The encodings, and how a label reference is
patched when the code is flushed, are the architecture's own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ksim.errors import CodegenError


@dataclass(frozen=True, slots=True)
class Label:
    """A position in the writer's code, bound by ``put_label``."""

    id: int
    name: str = ""


class CodeBuffer:
    """Accumulates the code of one patch that will run at ``address``."""

    def __init__(self, address: int) -> None:
        self.address = address
        self._code = bytearray()
        self._labels: dict[int, int] = {}
        self._names: dict[int, str] = {}

    # --- positions and labels -------------------------------------------------------
    @property
    def offset(self) -> int:
        return len(self._code)

    @property
    def pc(self) -> int:
        """The address the next instruction will have."""
        return self.address + len(self._code)

    def new_label(self, name: str = "") -> Label:
        label = Label(len(self._names), name)
        self._names[label.id] = name
        return label

    def put_label(self, label: Label) -> None:
        if label.id in self._labels:
            raise CodegenError(f"label {label.name or label.id} bound twice")
        self._labels[label.id] = len(self._code)

    def _bound(self, label_id: int) -> int:
        """The offset label ``label_id`` was bound to (flush time: CodegenError if never)."""
        if label_id not in self._labels:
            raise CodegenError(f"label {self._names[label_id] or label_id} never bound")
        return self._labels[label_id]


def condition(cond: str | int, table: Mapping[str, int]) -> int:
    """The 4-bit code of condition ``cond`` (a name in ``table``, or the code itself)."""
    if isinstance(cond, int):
        if not 0 <= cond < 16:
            raise CodegenError(f"condition code {cond} out of 0..15")
        return cond
    try:
        return table[cond]
    except KeyError:
        raise CodegenError(f"unknown condition {cond!r}") from None
