"""The data heap on a live kernel (issue "Hardening, round two"): no block is freed
while a snippet uses it, nor handed to anyone before no task can still write it,
and no client frees or writes another's.

* The Manager refuses ``free`` of a block an inserted snippet still writes
  (BlockInUse, naming the splice), as on the emulators (tests/test_heap_safety.py);
  the snippet keeps counting into it, and after its removal the free goes through.
* Over the wire: a ``free_data`` (or a ``write``) of a block another client holds
  is refused by the module, the last arbiter of ownership (TextOwned), and the
  block stays its owner's: the other client's next ``alloc_data`` is elsewhere.
* A freed heap block is held by no one until a QUIESCE has waited out every task
  that may still run patch code just taken out of text (and so still write it):
  the next ``alloc_data`` of the same size is another block.
* Over the wire (issue 23): the module refuses to free a client's data block
  while that client has any live patch code -- a trap route of its, or a jump in
  text into one of its patch blocks -- and kerninstd says so (BlockInUse, with
  how many); the block stays the client's, and another client's ``alloc_data``
  does not get it.  Once the splice is undone the free goes through.  The Manager
  keeps a data area it emptied while a splice of its lives (the module would
  refuse to take it back) and gives it back after the last removal."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.core import Write
from ksim.errors import AlreadySpliced, BlockInUse, OutsideHeapBlock, TargetFault, TextOwned
from ksim.kapi import Manager
from ksim.live.client import LiveTarget
from ksim.live.testing import (  # noqa: F401
    connect,
    dmesg_problems,
    getppid_loop,
    install_patch,
    jmp,
    own_log,
    plain_insn,
    read_u64,
    rel32,
    target,
    testbed,
)
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"
N = 5_000


def data_blocks_of(t: LiveTarget) -> set[int]:
    """The data blocks the module records as ``t``'s session's, read from its own log."""
    return {int(b["address"]) for b in own_log(t)["blocks"] if b["region"] == "data"}


def test_a_block_a_snippet_writes_is_not_freed(testbed: dict) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        fn = m.find_function(FUNC)
        text = m.copy_from_kernel(fn.address, 16)
        u = m.malloc(8)
        h = m.insert_snippet(m.entry_point(fn), u.atomic_assign(u + 1))
        spliced = m.copy_from_kernel(fn.address, 16)
        with pytest.raises(BlockInUse, match=rf"handle {h.id}\b.*{FUNC}\+0x5"):
            m.free(u)
        assert m.copy_from_kernel(fn.address, 16) == spliced and u.address in m._heap
        v = m.malloc(8)
        assert v.address != u.address
        m.run(while_cmd=f"{getppid_loop()} {N}")
        assert N <= m.read(u) <= N + 2 and m.read(v) == 0
        m.remove_snippet(h)
        m.free(u)
        m.free(v)
        assert m.copy_from_kernel(fn.address, 16) == text
        # a write that would run past its block into the next is refused here too
        a, b = m.alloc_data(8), m.alloc_data(8)
        with pytest.raises(OutsideHeapBlock):
            m.copy_to_kernel(a, bytes(16))
        assert m.copy_from_kernel(b, 8) == bytes(8)
        assert dmesg_problems(m.target) == []
    finally:
        m.detach()


def test_no_client_frees_or_writes_another_clients_block(testbed: dict, target) -> None:
    a, b = target, connect(testbed)
    try:
        mine = a.alloc_data(64)
        a.write(mine, b"\x11" * 64)
        theirs = b.alloc_data(64)  # b has an owner of its own now
        with pytest.raises(TextOwned):
            b.free_data(mine)
        with pytest.raises((TextOwned, TargetFault)):
            b.write(mine, b"\x22" * 8)
        assert a.read(mine, 64) == b"\x11" * 64
        again = [b.alloc_data(64) for _ in range(4)]
        assert mine not in again
        a.write(mine, b"\x33" * 64)  # still a's
        assert a.read(mine, 64) == b"\x33" * 64
        for x in (theirs, *again):
            b.free_data(x)
        a.free_data(mine)
    finally:
        b.close()


def test_a_freed_block_is_not_handed_out_before_a_quiesce(target) -> None:
    """kerninstd keeps a freed heap block (the module: held by no one) until it
    needs the room or gives the area back, after QUIESCE; a new block of the same
    size goes elsewhere, where first fit would have put it on the freed one."""
    first = target.alloc_data(24)
    target.free_data(first)
    second = target.alloc_data(24)
    try:
        assert second != first
        with pytest.raises((TargetFault, TextOwned)):
            target.write(first, b"\x01")
    finally:
        target.free_data(second)


@pytest.mark.parametrize("how", ["jmp", "route"])
def test_no_data_block_is_freed_while_its_owner_has_live_patch_code(testbed: dict, target,
                                                                    how: str) -> None:
    """A jump in text into a's patch block (counting getppid calls), or a trap route of
    a's alone (no int3: never hit): free_data of any of a's data blocks is refused,
    the counter patch code writes and one it does not refer to alike; the blocks stay
    a's in the module's log, a still writes them, and b's alloc_data does not get
    them.  A free of the patch block itself stays AlreadySpliced.  After the undo
    both frees go through."""
    a, b = target, connect(testbed)
    try:
        site, insn = plain_insn(a, FUNC)
        orig = a.read(site, 16)
        counter, other = a.alloc_data(8), a.alloc_data(64)
        patch = install_patch(a, counter, site, insn)
        if how == "jmp":
            a.apply(Change(text=(Write(site, orig[:5], jmp(site, patch)),)))
            undo = Change(text=(Write(site, jmp(site, patch), orig[:5]),))
        else:
            a.apply(Change(routes=((site, patch),)))
            undo = Change(routes=((site, 0),))
        for block in (counter, other):
            with pytest.raises(BlockInUse, match=rf"free_data: the data block at {block:#x}: "
                               r"this client still has 1 live splices/routes whose patch code "
                               r"may write it; remove them first; nothing was freed"):
                a.free_data(block)
        with pytest.raises(AlreadySpliced, match=f"patch block at {patch:#x}"):
            a.free_code(patch)
        assert {counter, other} <= data_blocks_of(a)
        a.write(other, b"\x5a" * 64)
        assert a.read(other, 64) == b"\x5a" * 64
        theirs = [b.alloc_data(64) for _ in range(4)] + [b.alloc_data(8) for _ in range(4)]
        assert not {counter, other} & set(theirs)
        for x in theirs:
            b.free_data(x)
        if how == "jmp":  # the patch code is live: it counts into the block kept
            out = a.run(while_cmd=f"{getppid_loop()} {N}").output
            assert out.strip() == str(N) and N <= read_u64(a, counter) <= N + 2
        a.apply(undo)
        assert a.read(site, 16) == orig
        a.free_data(other)
        a.free_data(counter)
        a.free_code(patch)
        assert not {counter, other} & data_blocks_of(a)
        with pytest.raises((TargetFault, TextOwned)):
            a.write(other, b"\x01")
        assert dmesg_problems(a) == []
    finally:
        b.close()


def test_the_manager_keeps_an_emptied_data_area_while_a_splice_lives(testbed: dict) -> None:
    """A block alone in a data area of its own, not referenced by the snippet that
    counts into another: Manager.free accepts it, but the area stays the client's in
    the module (a free_data of it now is refused: the snippet is live) until the
    snippet is removed; then the Manager gives it back."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        u = m.malloc(8)
        h = m.insert_snippet(m.entry_point(FUNC), u.atomic_assign(u + 1))
        before = data_blocks_of(m.target)
        big = m.alloc_data(m.capabilities.data_chunk)   # too big for the area held
        (area,) = data_blocks_of(m.target) - before
        m.free(big)
        assert area in data_blocks_of(m.target) and m._data.idle() == [area]
        with pytest.raises(BlockInUse, match=f"data block at {area:#x}: this client still has 1 "):
            m.target.free_data(area)
        m.run(while_cmd=f"{getppid_loop()} {N}")
        assert N <= m.read(u) <= N + 2
        m.remove_snippet(h)
        assert data_blocks_of(m.target) == before and m._data.idle() == []
        m.free(u)
        assert dmesg_problems(m.target) == []
    finally:
        m.detach()
