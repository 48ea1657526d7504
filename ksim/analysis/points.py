"""Instrumentation points of a function: entry, exits, blocks, call sites, instructions.

Exits are the places where control leaves the function for its caller: every
``ret`` (and jump to a return thunk), every direct jump out of the function (a
tail call), and every indirect jump that is not a recovered jump table (taken to
be a tail call).  A conditional jump out of the function (a conditional tail
call) is not an exit: a point there would also run when the branch is not taken.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ksim.analysis.cfg import CFG, Block
from ksim.arch.base import Arch, Flow


class PointKind(enum.StrEnum):
    ENTRY = "entry"
    EXIT = "exit"
    BLOCK = "block"
    CALLSITE = "callsite"
    INSN = "insn"


@dataclass(frozen=True, slots=True)
class Point:
    address: int
    kind: PointKind
    function: str

    def __str__(self) -> str:
        return f"{self.function}:{self.kind.value}@{self.address:#x}"


def is_padding(block: Block, arch: Arch) -> bool:
    """Alignment filler (``Arch.is_filler``) no path reaches — not worth a point."""
    return not block.reachable and all(arch.is_filler(i) for i in block.insns)


@dataclass(frozen=True)
class FunctionPoints:
    function: str
    entry: int
    exits: tuple[int, ...]
    blocks: tuple[int, ...]
    callsites: tuple[int, ...]

    def all(self) -> list[Point]:
        """Every point, entry first, then exits, blocks and call sites (each by address)."""
        out = [Point(self.entry, PointKind.ENTRY, self.function)]
        out += [Point(a, PointKind.EXIT, self.function) for a in self.exits]
        out += [Point(a, PointKind.BLOCK, self.function) for a in self.blocks]
        out += [Point(a, PointKind.CALLSITE, self.function) for a in self.callsites]
        return out

    def as_dict(self) -> dict[str, object]:
        return {"function": self.function, "entry": [self.entry], "exits": list(self.exits),
                "blocks": list(self.blocks), "callsites": list(self.callsites)}


def find_points(cfg: CFG, function: str, arch: Arch) -> FunctionPoints:
    exits = []
    callsites = []
    for insn in cfg.insns:
        flow = insn.flow
        if flow is Flow.RET:
            exits.append(insn.address)
        elif flow is Flow.JMP and insn.target is not None and not cfg.start <= insn.target < cfg.end:
            exits.append(insn.address)
        elif flow is Flow.JMP_INDIRECT and insn.address not in cfg.tables:
            exits.append(insn.address)
        elif flow in (Flow.CALL, Flow.CALL_INDIRECT):
            callsites.append(insn.address)
    blocks = tuple(b.start for b in cfg.blocks.values() if b.insns and not is_padding(b, arch))
    return FunctionPoints(function, cfg.start, tuple(exits), blocks, tuple(callsites))
