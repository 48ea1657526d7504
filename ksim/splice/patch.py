"""The planner's output: plain data, applied by a target, undone by its inverse."""

from __future__ import annotations

from dataclasses import dataclass, field

from ksim.core import Write
from ksim.errors import OverlappingWrites


@dataclass(frozen=True, slots=True)
class Change:
    """One step of the Manager's, which a target applies whole or not at all
    (``Target.apply``): patch code placed, trap routes set or cleared, text written.

    A target makes it in this order, so that no CPU is ever sent where nothing is
    yet: ``code`` (patch-area bytes nothing reaches yet), then the routes that
    ``routes`` sets (site -> patch; a site already routed is re-pointed), then
    ``text`` (by the poke protocol, ksim.poke), then the routes it clears (patch 0):
    a trap leaves text before its route goes.  Every write's ``old`` bytes are
    checked before anything is made; a refused part changes no byte and no route.
    """

    code: tuple[Write, ...] = ()
    routes: tuple[tuple[int, int], ...] = ()
    text: tuple[Write, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.code or self.routes or self.text)

    @property
    def sets(self) -> tuple[tuple[int, int], ...]:
        return tuple(r for r in self.routes if r[1])

    @property
    def clears(self) -> tuple[int, ...]:
        return tuple(site for site, patch in self.routes if not patch)

    @property
    def items(self) -> int:
        """Writes and route changes: what a target's batch limits count."""
        return len(self.code) + len(self.routes) + len(self.text)


@dataclass(frozen=True, slots=True)
class Patch:
    """Everything needed to splice one point, and to take the splice out again.

    ``code`` goes at ``code_address`` (patch area) before ``writes`` are poked;
    every trap instruction the patch plants is routed by ``routes`` (site ->
    where the trap dispatch resumes): the trap tactic's own site (``trap_site``)
    and a trap inside the patch code that calls an emulator's Python post
    handler.  ``undo`` restores the original text exactly.
    """

    point: int
    tactic: str
    code_address: int
    code: bytes
    writes: tuple[Write, ...]
    trap_site: int | None = None
    #: extra code placed elsewhere (a springboard's long jump in padding): (address, old, new)
    extra: tuple[Write, ...] = field(default=())
    #: trap routes the target must hold while the patch is in: (site, resume at)
    routes: tuple[tuple[int, int], ...] = ()
    #: where the post stage (code run after the instruction at the point) begins
    post_at: int | None = None

    def __post_init__(self) -> None:
        spans = sorted((w.address, w.end) for w in self.writes + self.extra)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise OverlappingWrites(
                    f"the splice of {self.point:#x} ({self.tactic}) writes {start:#x} twice")

    @property
    def undo(self) -> tuple[Write, ...]:
        return tuple(w.inverse() for w in reversed(self.writes))
