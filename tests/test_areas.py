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
