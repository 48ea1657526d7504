"""The data heap is never used after it is freed, nor written past a block's end
(issue "Hardening, round two"), on unicorn and QEMU (the live kernel's half is in
tests/test_live_heap.py).

* ``free`` of a block an inserted snippet still references is refused
  (BlockInUse, naming the splice) and changes nothing; once the splice is removed
  the free goes through.  Without this, the next ``malloc`` could be handed the
  block while the snippet still writes it.
* ``copy_to_kernel`` and ``write`` write only inside one block this Manager
  allocated (OutsideHeapBlock): never past its end into the next block, never
  outside the heap; ``write`` of a value no 64-bit integer holds is refused
  (BadArgument), not wrapped.
* A data area the Manager took from the target and emptied stays held while any
  splice of the Manager is live (a live kernel's module refuses the free then) and
  goes back after the last removal."""

from __future__ import annotations

import shutil

import pytest

from ksim.errors import BadArgument, BlockInUse, OutsideHeapBlock, UnknownHandle
from ksim.kapi import Manager, _references
from ksim.snippets import ast

TARGETS = [
    pytest.param("unicorn:toy", id="unicorn"),
    pytest.param("qemu:toy", id="qemu", marks=[pytest.mark.slow, pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")]),
]


@pytest.fixture(scope="module", params=TARGETS)
def manager(request):
    m = Manager.attach(request.param)
    yield m
    m.detach()


@pytest.fixture
def m(manager):
    yield manager
    assert not manager.splices(), "a test left a splice behind"


def state(m):
    """What a refused free or write must leave as it was: text, routes, the
    target's allocations, the Manager's blocks and splices, the heap's bytes."""
    t = m.target
    heap = {a: t.read(a, n) for a, n in sorted(m._heap.items())}
    return (m.text_snapshot(), dict(t._traps), t._code.allocated(), t._data.allocated(),
            dict(m._heap), m.splices(), heap)


def test_a_block_a_snippet_writes_is_not_freed_nor_handed_out_again(m):
    """The issue's repro: u is counted by a snippet, free(u) is refused, and a block
    malloc hands out next is never u; after the removal the free goes through."""
    point = m.entry_point("tcp_sync_mss")
    u = m.malloc(8)
    h = m.insert_snippet(point, u.atomic_assign(u + 1))
    try:
        before = state(m)
        with pytest.raises(BlockInUse, match=rf"handle {h.id}\b.*tcp_sync_mss\+0x"):
            m.free(u)
        assert state(m) == before
        v = m.malloc(8)
        assert v.address != u.address
        m.run(seed=3)
        assert m.read(u) > 0 and m.read(v) == 0
        m.free(v)
    finally:
        m.remove_snippet(h)
    m.free(u)
    with pytest.raises(UnknownHandle):
        m.free(u)


@pytest.mark.parametrize("kind", ["elem", "post", "read", "trap"])
def test_every_reference_keeps_the_block(m, kind):
    """A table an Elem indexes, a post snippet's variable, a variable only read (its
    value copied into another block), and a trap splice's snippet all hold the block."""
    point = m.entry_point("tcp_sync_mss")
    held = m.alloc_data(32)
    others = []
    splice, post = "auto", None
    snippet: ast.Node = ast.Seq(())
    if kind == "elem":
        table = ast.Elem(held, 4, ast.Arg(0))
        snippet = table.assign(table + 1)
    elif kind == "read":
        others.append(m.malloc(8))
        snippet = others[0].assign(ast.Var(held + 8))
    else:
        post = ast.Var(held + 24).assign(ast.Var(held + 24) + 1)
        splice = "trap" if kind == "trap" else "auto"
    h = m.insert_snippet(point, snippet, post=post, splice=splice)
    try:
        before = state(m)
        with pytest.raises(BlockInUse, match=f"{held:#x}"):
            m.free(held)
        assert state(m) == before
    finally:
        m.remove_snippet(h)
    m.free(held)
    for v in others:
        m.free(v)


def test_a_block_is_free_again_when_its_last_snippet_goes(m):
    """Two snippets at two points write one block: the free waits for both."""
    u = m.malloc(8)
    hs = [m.insert_snippet(m.entry_point(f), u.assign(u + 1))
          for f in ("tcp_sync_mss", "tcp_current_mss")]
    try:
        m.remove_snippet(hs.pop())
        with pytest.raises(BlockInUse, match=f"handle {hs[0].id}"):
            m.free(u)
    finally:
        m.remove_many(hs)
    m.free(u)


def test_what_counts_as_a_reference():
    base = 0xFFFF_8880_0000_1000
    inside, after = ast.Var(base + 8), ast.Var(base + 16)
    assert _references(inside.assign(1), base, base + 16)
    assert not _references(after.assign(1), base, base + 16)
    assert _references(ast.Var(base - 4).assign(1), base, base + 16)      # overlaps its start
    assert not _references(ast.Var(base + 8, segment="gs"), base, base + 16)
    assert _references(ast.Elem(base - 64, 9, ast.Const(0)), base, base + 16)
    assert _references(ast.Call(0xFFFFFFFF81000000, (ast.Const(base + 4),)), base, base + 16)
    assert _references(ast.Load(ast.Const(base)), base, base + 16)
    guard = ast.Guard(base + 64)
    assert _references(ast.Guarded(ast.Seq(()), guard, missed=base), base, base + 16)
    assert not _references(ast.Guarded(ast.Seq(()), guard), base, base + 16)


def test_copy_to_kernel_stays_inside_one_block(m):
    a, b = m.alloc_data(16), m.alloc_data(16)
    m.copy_to_kernel(a, b"\x11" * 16)
    m.copy_to_kernel(b + 8, b"\x22" * 8)
    before = state(m)
    for address, data, why in [
        (a, b"\x33" * 24, "past the end"),                  # into b (or the gap before it)
        (a + 12, b"\x33" * 8, "past the end"),
        (b + 16, b"\x33", "not inside a heap block"),
        (m.guard.address, b"\x33" * 8, "not inside a heap block"),
        (m.target.image.function("tcp_sync_mss").address, b"\xcc", "not inside a heap block"),
    ]:
        with pytest.raises(OutsideHeapBlock, match=why):
            m.copy_to_kernel(address, data)
        assert state(m) == before
    with pytest.raises(BadArgument):
        m.copy_to_kernel(a, "text")
    with pytest.raises(OutsideHeapBlock, match="past the end"):
        m.write(ast.Var(a + 12, 8), 1)
    with pytest.raises(OutsideHeapBlock):
        m.write(ast.Var(m.guard.missed), 1)
    assert state(m) == before
    m.copy_to_kernel(a, b"")
    m.write(ast.Var(a + 8, 8), 5)
    assert m.read(ast.Var(a + 8)) == 5
    m.free(a)
    with pytest.raises(OutsideHeapBlock):
        m.copy_to_kernel(a, b"\x00")
    m.free(b)


def test_an_emptied_data_area_is_kept_while_a_splice_lives(m):
    """A block alone in a data area of its own is freed while a snippet counts into
    another: the Manager accepts the free, but the area stays taken from the target
    until the last splice is out; then it goes back."""
    t = m.target
    u = m.malloc(8)
    h = m.insert_snippet(m.entry_point("tcp_sync_mss"), u.atomic_assign(u + 1))
    try:
        before = set(t._data.allocated())
        big = m.alloc_data(m.capabilities.data_chunk)   # too big for the areas held
        (area,) = set(t._data.allocated()) - before
        assert area <= big < area + t._data.allocated()[area]
        m.free(big)
        assert area in t._data.allocated() and m._data.idle() == [area]
    finally:
        m.remove_snippet(h)
    assert set(t._data.allocated()) == before and m._data.idle() == []
    m.free(u)


def test_write_refuses_a_value_no_64_bit_integer_holds(m):
    """-2**63 .. 2**64 - 1 is written modulo the Var's size, as before; a value outside
    is BadArgument with nothing written."""
    a = m.alloc_data(8)
    try:
        for value, stored in [(2**64 - 1, b"\xff" * 8), (-(2**63), bytes(7) + b"\x80"),
                              (-1, b"\xff" * 8), (0x1122, b"\x22\x11" + bytes(6))]:
            m.write(ast.Var(a, 8), value)
            assert m.copy_from_kernel(a, 8) == stored
        m.write(ast.Var(a, 1), 0x1FF)                     # in range: modulo 2**8, as before
        assert m.copy_from_kernel(a, 8) == b"\xff\x11" + bytes(6)
        for value in (2**64, -(2**63) - 1, 2**200):
            with pytest.raises(BadArgument, match="no 64-bit integer holds it"):
                m.write(ast.Var(a, 8), value)
            with pytest.raises(BadArgument, match="no 64-bit integer holds it"):
                m.write(ast.Var(a, 2), value)
        assert m.copy_from_kernel(a, 8) == b"\xff\x11" + bytes(6)
    finally:
        m.free(a)
