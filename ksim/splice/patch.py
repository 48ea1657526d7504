"""The planner's output: plain data, applied by a target, undone by its inverse."""

from __future__ import annotations

from dataclasses import dataclass, field

from ksim.errors import OverlappingWrites


@dataclass(frozen=True, slots=True)
class Write:
    """Replace ``old`` by ``new`` at ``address`` (same length)."""

    address: int
    old: bytes
    new: bytes

    def __post_init__(self) -> None:
        if len(self.old) != len(self.new):
            raise ValueError("a Write must keep the length of the bytes it replaces")

    def inverse(self) -> Write:
        return Write(self.address, self.new, self.old)

    @property
    def end(self) -> int:
        return self.address + len(self.new)


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
