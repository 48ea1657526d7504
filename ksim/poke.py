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

from ksim.core import Write
from ksim.errors import OverlappingWrites, StaleText
from ksim.splice.patch import Change

Read = Callable[[int, int], bytes]
#: a target's route table: route(site, patch) sets or re-points (patch) or clears
#: (None) the route at ``site`` and returns what was there (None: nothing)
Route = Callable[[int, "int | None"], "int | None"]
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
    _write_steps(writes, write, trap, sync)


def _write_steps(writes: Sequence[Write], write: WriteBytes, trap: bytes,
                 sync: Callable[[], None]) -> None:
    """The protocol's steps, each followed by a sync (old bytes checked already)."""
    for step in protocol_steps(writes, trap):
        for address, data in step:
            write(address, data)
        sync()


def check_disjoint(writes: Sequence[Write]) -> None:
    """One change writes each byte once (a batch that wrote a byte twice would
    depend on the order its writes are made in)."""
    spans = sorted((w.address, w.end) for w in writes)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise OverlappingWrites(f"one change writes {start:#x} twice: nothing was written")


def apply_change(change: Change, *, read: Read, write: WriteBytes, trap: bytes, route: Route,
                 check_routes: Callable[[Change], None] = lambda _c: None,
                 sync: Callable[[], None] = lambda: None) -> None:
    """Apply ``change`` to a kernel that ksim holds stopped (an emulator, a QEMU guest
    under the gdbstub), all or nothing, in Change's order: code, routes set, text
    (by the protocol above), routes cleared.

    Everything that can be refused is checked first (old bytes, overlaps, and the
    target's ``check_routes``); should a write or a route fail after all (the
    gdbstub's connection breaks), what was made is undone before the error is
    raised again."""
    check_disjoint([*change.code, *change.text])
    check_old(read, [*change.code, *change.text])
    check_routes(change)
    written: list[Write] = []
    routed: list[tuple[int, int | None]] = []
    try:
        for w in change.code:
            written.append(w)
            write(w.address, w.new)
        for site, patch in change.sets:
            routed.append((site, route(site, patch)))
        if change.text:
            written.extend(change.text)
            _write_steps(change.text, write, trap, sync)
        for site in change.clears:
            routed.append((site, route(site, None)))
    except BaseException:
        for w in reversed(written):
            write(w.address, w.old)
        for site, before in reversed(routed):
            route(site, before)
        raise
