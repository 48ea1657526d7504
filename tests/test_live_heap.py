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
  the next ``alloc_data`` of the same size is another block."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.errors import BlockInUse, OutsideHeapBlock, TargetFault, TextOwned
from ksim.kapi import Manager
from ksim.live.testing import (  # noqa: F401
    connect,
    dmesg_problems,
    getppid_loop,
    read_u64,
    target,
    testbed,
)

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"
N = 5_000


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
