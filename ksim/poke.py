"""The one way ksim changes kernel text.

A multi-byte instruction cannot be replaced atomically while other CPUs may be
executing it, so text is changed in the order Linux's ``text_poke_bp`` uses
(arch/x86/kernel/alternative.c, the comment above text_poke_bp_batch):

    1. write the trap byte over the first byte of every site;       sync
    2. write every byte but the first (the "tail");                 sync
    3. write the first byte (the "head").                           sync

A CPU that reaches a site during the change hits the trap, and the target's trap
dispatch sends it to that site's patch -- which is correct both while inserting
(the patch is in place before the text changes) and while removing (the patch is
freed only after the text is restored).  "sync" makes every CPU serialise its
instruction stream (``text_poke_sync`` on Linux; a no-op for a stopped emulator).

Before anything is written, every write's old bytes are compared with memory:
a stale request (the text is not what the planner saw) raises StaleText and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ksim.errors import StaleText
from ksim.splice.patch import Write

Read = Callable[[int, int], bytes]
WriteBytes = Callable[[int, bytes], None]


def check_old(read: Read, writes: Sequence[Write]) -> None:
    for w in writes:
        now = read(w.address, len(w.old))
        if now != w.old:
            raise StaleText(
                f"text at {w.address:#x} is {now.hex()}, expected {w.old.hex()}: nothing was written"
            )


def protocol_steps(writes: Sequence[Write], trap: bytes) -> list[list[tuple[int, bytes]]]:
    """The byte writes of each step of the protocol (a step ends with a sync).

    The "first byte" is the trap's length: one byte on x86-64, one 4-byte word on
    AArch64, whose aligned word stores are atomic for instruction fetch.  Writes
    no longer than the trap need no protocol: one store is atomic.  (With a
    one-byte head and a 4-byte trap, a site whose first byte changed got the whole
    trap in step 1 but only the bytes of its tail that changed in step 2: two B
    instructions differing in their first byte left a broken word behind.)"""
    k = len(trap)
    if all(len(w.new) <= k for w in writes):
        return [[(w.address, w.new) for w in writes if w.old != w.new]]
    head_trap = [(w.address, trap) for w in writes if len(w.new) > k and w.new[:k] != w.old[:k]]
    tails = [(w.address + k, w.new[k:]) for w in writes if len(w.new) > k and w.new[k:] != w.old[k:]]
    heads = [(w.address, w.new[:k]) for w in writes if w.new[:k] != w.old[:k] or len(w.new) <= k]
    return [step for step in (head_trap, tails, heads) if step]


def apply(writes: Sequence[Write], *, read: Read, write: WriteBytes, trap: bytes,
          sync: Callable[[], None] = lambda: None) -> None:
    """Check old bytes, then apply ``writes`` step by step (see the module doc)."""
    check_old(read, writes)
    for step in protocol_steps(writes, trap):
        for address, data in step:
            write(address, data)
        sync()
