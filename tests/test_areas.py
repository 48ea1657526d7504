"""ksim.splice.areas: the bytes a Manager keeps of its patch areas."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ksim.core import Write
from ksim.splice.areas import Areas

FILL = bytes.fromhex("002020d4")  # arm64's BRK #0x100: a fill longer than a byte
START = 0x10000


def areas(fill: bytes, memory: bytearray, reads: list[tuple[int, int]]) -> Areas:
    def read(at: int, n: int) -> bytes:
        reads.append((at, n))
        return bytes(memory[at - START:at - START + n])

    return Areas("patch area", lambda n, near: START, lambda at: None, chunk=len(memory),
                 align=16, read=read, fill=fill)


@settings(max_examples=60, deadline=None)
@given(writes=st.lists(st.tuples(st.integers(0, 4000), st.binary(min_size=1, max_size=64)),
                       max_size=8),
       asks=st.lists(st.tuples(st.integers(0, 4000), st.integers(1, 96)), min_size=1, max_size=8))
def test_a_new_areas_bytes_are_its_fill_and_what_was_written(writes, asks) -> None:
    """An area whose fill the target declares is never read: its bytes are the fill
    repeated from its start, with the writes made over it, wherever they land."""
    memory = bytearray(FILL * 1024)     # what the target holds: the fill, then the writes
    reads: list[tuple[int, int]] = []
    a = areas(FILL, memory, reads)
    a.place(16)
    for offset, data in writes:
        data = data[:len(memory) - offset]
        memory[offset:offset + len(data)] = data
        a.wrote([Write(START + offset, bytes(len(data)), data)])
    for offset, n in asks:
        n = min(n, len(memory) - offset)
        assert a.old(START + offset, n) == bytes(memory[offset:offset + n])
    assert reads == []


def test_without_a_fill_an_areas_bytes_are_read() -> None:
    memory = bytearray(range(256)) * 16
    reads: list[tuple[int, int]] = []
    a = areas(b"", memory, reads)
    a.place(16)
    assert a.old(START + 100, 8) == bytes(memory[100:108])
    assert reads and reads[0][0] == START


class _Target:
    """A target's side of Areas as plain bookkeeping: areas handed out one after the
    other, each request logged ("take", "ahead", "answer", "give"); the answer to a
    request made ahead may be a refusal."""

    def __init__(self, refuse: bool = False) -> None:
        self.log: list[tuple[str, int]] = []
        self.next = START
        self.refuse = refuse

    def take(self, size: int, near: object) -> int:
        self.log.append(("take", size))
        return self._hand_out(size)

    def take_ahead(self, size: int, near: object):
        self.log.append(("ahead", size))

        def answer() -> int:
            self.log.append(("answer", size))
            if self.refuse:
                from ksim.errors import TargetError
                raise TargetError("no memory for the area")
            return self._hand_out(size)
        return answer

    def give(self, at: int) -> None:
        self.log.append(("give", at))

    def _hand_out(self, size: int) -> int:
        at, self.next = self.next, self.next + size
        return at

    def areas(self) -> Areas:
        return Areas("patch area", self.take, self.give, chunk=4096, align=16,
                     take_ahead=self.take_ahead)


def test_an_area_asked_for_ahead_holds_the_placement_that_fits() -> None:
    """expect asks for the area at once; the placement reads the answer and takes
    nothing more; settle leaves an area that holds something."""
    t = _Target()
    a = t.areas()
    a.expect(10_000)
    assert t.log == [("ahead", 10_016)]            # asked now, not answered yet
    assert a.place(9_000) == START
    a.settle()
    assert t.log == [("ahead", 10_016), ("answer", 10_016)]
    a.expect(100)                                  # room held already: nothing asked
    assert len(t.log) == 2 and a.place(100) == START + 9_008


def test_an_area_asked_for_ahead_and_not_used_goes_back() -> None:
    """A placement larger than expected takes an area of its own; the one asked for
    ahead is given back by settle, and so is one no placement followed."""
    t = _Target()
    a = t.areas()
    a.expect(100)
    at = a.place(8_000)
    assert t.log == [("ahead", 4096), ("answer", 4096), ("take", 8_016)]
    assert at == START + 4096
    a.settle()
    assert t.log[-1] == ("give", START)
    a.expect(50_000)
    a.settle()
    assert t.log[-2:] == [("answer", 50_016), ("give", START + 4096 + 8_016)]


def test_a_refused_area_asked_for_ahead_leaves_the_placement_to_ask_again() -> None:
    t = _Target(refuse=True)
    a = t.areas()
    a.expect(1_000)
    assert a.place(1_000) == START
    assert t.log == [("ahead", 4096), ("answer", 4096), ("take", 4096)]
    a.settle()
    assert t.log[-1] == ("take", 4096)             # nothing to give back


def test_release_all_reads_and_gives_back_an_area_asked_for_ahead() -> None:
    t = _Target()
    a = t.areas()
    a.place(16)
    a.expect(10_000)
    a.release_all()
    assert ("answer", 10_016) in t.log and ("give", START + 4096) in t.log
