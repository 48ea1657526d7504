"""Patch and heap memory as the Manager places things in it.

The target hands out areas (``Target.alloc_code`` / ``alloc_data``) a chunk at a
time; the Manager places each patch, batch of patches or variable inside them
itself.  Planning a point, asking whether it could be spliced (a dry run) or
inserting it then costs no request of the target: on a live kernel that was two
round trips per point (``alloc_code`` and ``free_code``), the whole cost of a
wildcard's dry run.

Placement is a bump pointer per area, and an area goes back to the target when
the last thing placed in it is released.  Space inside an area is never handed
out twice: a CPU may still be running in a patch that was just taken out (the
splice's jump is gone, but a task preempted inside the patch comes back to it),
and only the target knows when none can be any more -- a live kernel's daemon
waits for that (QUIESCE) before it reuses a freed area.  For the same reason a
released variable's bytes are never given to the next ``malloc`` while its area
lives: a snippet still in flight may write them.

A data area left empty may have to stay held a while: a live kernel's module refuses
to free a client's heap block while any splice of that client is live (its patch
code may write any of them), so the Manager keeps such an area (``keep``) and gives
it back (``give_back_idle``) once its last splice is out.

For the patch area the Manager keeps the area's bytes as it last wrote them, so
that a patch's write carries its ``old`` bytes without reading the target each
time: the target's fill where it says what a new area holds, else read when a
patch is first written there, as far as what is placed reaches (further when more
is).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ksim.core import Write
from ksim.errors import BadArgument, KsimError, UnknownHandle

#: the least of a patch area's bytes read at a time (what some hundred patches of a
#: probe take: inserting them one by one reads once)
SHADOW_READ = 16 << 10

#: take(size, near) -> address of a new area; give(address) returns it
Take = Callable[[int, Any], int]
#: take_ahead(size, near) -> what answers take's question, asked now
TakeAhead = Callable[[int, Any], Callable[[], int]]
Give = Callable[[int], None]
#: reaches(near, start, end): code at start..end may be jumped to from near and back
Reaches = Callable[[int, int, int], bool]
#: keep(): an area left empty stays held for now (is not given back)
Keep = Callable[[], bool]


@dataclass
class Area:
    start: int
    size: int
    cursor: int
    #: things placed in it and not released
    users: int = 0
    #: its bytes from its start as this client last left them, as far as they were
    #: read (patch areas only; empty until first asked)
    shadow: bytearray = field(default_factory=bytearray)

    @property
    def end(self) -> int:
        return self.start + self.size

    def fit(self, size: int, align: int) -> int | None:
        address = -(-self.cursor // align) * align
        return address if address + size <= self.end else None


class Areas:
    """Areas of one kind (patch code or data heap) this Manager holds."""

    def __init__(self, name: str, take: Take, give: Give, *, chunk: int, align: int,
                 reaches: Reaches | None = None,
                 read: Callable[[int, int], bytes] | None = None,
                 keep: Keep | None = None, fill: bytes = b"",
                 take_ahead: TakeAhead | None = None) -> None:
        self.name = name
        self._take, self._give, self._read = take, give, read
        self._take_ahead = take_ahead
        #: an area asked for ahead (expect) and not answered yet: its size, its answer;
        #: and the start of the one answered, until settle
        self._ahead: tuple[int, Callable[[], int]] | None = None
        self._answered: int | None = None
        #: what every byte of a new area holds, repeated from its start (the target's
        #: capabilities.code_fill; b"": not known, its bytes are read)
        self._fill = fill
        self._keep = keep
        self.chunk, self.align, self._reaches = chunk, align, reaches
        self._areas: dict[int, Area] = {}
        #: placed address -> its area's start
        self._owner: dict[int, int] = {}
        #: depth of holding(): areas a dry run takes are kept until it ends
        self._holding = 0

    # --- placing -----------------------------------------------------------------
    def place(self, size: int, near: int | None = None, align: int | None = None) -> int:
        """Room for ``size`` bytes (reachable from ``near``, for code), taking a new
        area from the target only when none of those held has room."""
        align = align or self.align
        area, address = self._find(size, near, align)
        area.cursor = address + size
        area.users += 1
        self._owner[address] = area.start
        return address

    def expect(self, size: int, near: int | None = None) -> None:
        """Room for some ``size`` bytes (reachable from ``near``) will be placed soon:
        when no area held has it, a new area is asked of the target now (take_ahead)
        and answered when a placement first needs it, so that the answer's wait
        overlaps the caller's work.  ``settle`` gives it back if nothing was placed in
        it; a placement larger than expected takes an area of its own, as without."""
        if self._ahead is not None or self._take_ahead is None or size <= 0:
            return
        if any(self._fits(area, size, near, self.align) is not None for area in self._areas.values()):
            return
        size = self._area_size(size + self.align)
        self._ahead = (size, self._take_ahead(size, near))

    def settle(self) -> None:
        """The area asked for ahead (expect) answered, and given back if nothing was
        placed in it (a placement did not need it, or was never made)."""
        self._collect_ahead()
        start, self._answered = self._answered, None
        if start is not None and start in self._areas and not self._areas[start].users \
                and not self._holding:
            self._idle(self._areas[start])

    def _collect_ahead(self) -> int | None:
        """Read the answer to the area asked for ahead; its start (None: none was
        asked, or the target refused it: a placement then asks for what it needs)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        size, answer = ahead
        try:
            start = answer()
        except KsimError:
            return None
        self._areas[start] = Area(start, size, start)
        self._answered = start
        return start

    def peek(self, size: int, near: int | None = None, align: int | None = None) -> int:
        """Where ``place`` would put ``size`` bytes now, placing nothing (a dry run).
        When no area held reaches, one is taken to answer; it is given back at once,
        or, inside ``holding()``, when that ends (many dry runs, one area)."""
        area, address = self._find(size, near, align or self.align)
        if not area.users and not self._holding:
            self._idle(area)
        return address

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Dry runs inside keep the areas they take; those still empty at the end go
        back (the target's memory is then as it was before)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding:
                self.give_back_idle()

    def _find(self, size: int, near: int | None, align: int) -> tuple[Area, int]:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise BadArgument(f"{self.name}: a placement needs a positive size, not {size!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise BadArgument(f"{self.name}: an alignment is a power of two, not {align!r}")
        while True:
            for area in self._areas.values():
                address = self._fits(area, size, near, align)
                if address is not None:
                    return area, address
            if self._collect_ahead() is None:
                break
        area = self._new(size + align, near)
        address = self._fits(area, size, near, align)
        if address is None:
            self._drop(area)
            raise AssertionError(f"{self.name}: a new area of {area.size} bytes at "
                                 f"{area.start:#x} does not hold {size} bytes near {near}")
        return area, address

    def _fits(self, area: Area, size: int, near: int | None, align: int) -> int | None:
        """Where ``size`` bytes would go in ``area``, reachable from ``near`` (None: not there)."""
        address = area.fit(size, align)
        return address if address is not None and self._reach(near, address, address + size) else None

    def _reach(self, near: int | None, start: int, end: int) -> bool:
        return near is None or self._reaches is None or self._reaches(near, start, end)

    def _area_size(self, size: int) -> int:
        """The size of the area taken for ``size`` bytes: a chunk, or more, aligned."""
        return max(self.chunk, -(-size // self.align) * self.align)

    def _new(self, size: int, near: int | None) -> Area:
        size = self._area_size(size)
        start = self._take(size, near)
        area = self._areas[start] = Area(start, size, start)
        return area

    def _drop(self, area: Area) -> None:
        del self._areas[area.start]
        self._give(area.start)

    def _idle(self, area: Area) -> None:
        """``area`` holds nothing placed: back to the target, unless ``keep`` says it
        stays held for now (``give_back_idle`` gives it back later)."""
        if self._keep is None or not self._keep():
            self._drop(area)

    def give_back_idle(self) -> None:
        """Give back every area that holds nothing placed (those kept, say), unless a
        dry run holds them or ``keep`` still says they stay."""
        if self._holding or (self._keep is not None and self._keep()):
            return
        for area in [a for a in self._areas.values() if not a.users]:
            self._drop(area)

    def idle(self) -> list[int]:
        """The starts of the areas held that hold nothing placed."""
        return [start for start, area in self._areas.items() if not area.users]

    # --- releasing ------------------------------------------------------------------
    def release(self, address: int) -> None:
        """``address`` is no longer used; its area goes back with its last user (or,
        while ``keep`` says so, is kept empty until ``give_back_idle``)."""
        start = self._owner.pop(address, None)
        if start is None:
            raise UnknownHandle(f"{self.name}: {address:#x} is not a block this client placed")
        area = self._areas[start]
        area.users -= 1
        if not area.users:
            self._idle(area)

    def release_all(self) -> None:
        """Give every area back (detach)."""
        self._collect_ahead()
        for area in list(self._areas.values()):
            self._drop(area)
        self._owner.clear()

    # --- the bytes of patch areas ---------------------------------------------------
    def old(self, address: int, size: int) -> bytes:
        """The bytes at address..+size as this client last left them: what the area
        held when taken where the target says (its fill), else read the first time,
        as far as what is placed in the area reaches (the batch about to be written)
        and SHADOW_READ bytes at least, not the whole area (a 64 KB area was 10 ms of
        a live command)."""
        area = self._areas[self._owner_area(address)]
        offset = address - area.start
        shadow = area.shadow
        if offset + size > len(shadow):
            if self._fill:
                self._filled(area, max(offset + size, area.cursor - area.start))
            else:
                assert self._read is not None, f"{self.name} keeps no bytes"
                upto = min(area.size, max(offset + size, area.cursor - area.start,
                                          len(shadow) + SHADOW_READ))
                shadow += self._read(area.start + len(shadow), upto - len(shadow))
        return bytes(shadow[offset:offset + size])

    def wrote(self, writes: Iterable[Write]) -> None:
        """Writes a target made into these areas (kept in the bytes read of them; a
        byte not read yet is read as the target now has it, when first asked; in an
        area whose fill is known, every byte up to the write is kept)."""
        for w in writes:
            area = self._areas.get(self._owner_area(w.address, strict=False))
            if area is not None:
                offset = w.address - area.start
                if self._fill:
                    self._filled(area, offset + len(w.new))
                n = min(len(w.new), len(area.shadow) - offset)
                if n > 0:
                    area.shadow[offset:offset + n] = w.new[:n]

    def _filled(self, area: Area, end: int) -> None:
        """The area's kept bytes taken up to offset ``end`` (at most its size) with the
        fill a new area holds, where they do not reach yet."""
        start, end = len(area.shadow), min(area.size, end)
        if end > start:
            fill, k = self._fill, start % len(self._fill)   # the fill repeats from offset 0
            area.shadow += (fill * ((end - start) // len(fill) + 2))[k:k + end - start]

    def _owner_area(self, address: int, *, strict: bool = True) -> int:
        for start, area in self._areas.items():
            if start <= address < area.end:
                return start
        if strict:
            raise UnknownHandle(f"{self.name}: {address:#x} is in none of this client's areas")
        return -1

