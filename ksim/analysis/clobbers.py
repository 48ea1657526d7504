"""Registers a function may change, including through the functions it calls.

gcc's interprocedural register allocation (``-fipa-ra``, on at -O2) lets a caller
keep a value in a caller-saved register across a call to a function it knows does
not write that register.  So the calling convention alone does not say which
registers a call kills, nor which registers a function must preserve for its
callers: both come from what the called code actually writes.  Liveness uses

* at a call: kill only the caller-saved registers the callee may write
  (:func:`function_clobbers`);
* at a return or tail call: every caller-saved register this function's own
  instructions never write is live (:func:`own_writes`, an under-approximation
  of what gcc knows the function clobbers, so any register some caller could be
  keeping in it across the call stays live).

Killing at a call is safe only for registers the *compiler* also took to be
clobbered, since a caller relies on exactly the others surviving.  So
``function_clobbers`` follows the compiler's own view: a function clobbers what
its instructions write plus what its direct callees clobber, and every register
the convention lets a callee change when it makes an indirect call, an indirect
tail call, a call to something that is not a known function, or a call back into
a cycle (gcc assumes the convention for callees it has not compiled yet).  A
recovered jump table adds nothing: it stays inside the function.

Only the caller-saved part of a function's clobbers is ever used (a callee-saved
register comes back intact either way), so every function of a cycle gets the
same answer, the union over the cycle.  The per-function inputs come from a
:class:`Summary`, which an image's analysis store keeps for every function: no
callee is decoded to answer.  The store also keeps every answer found while every
function it depends on had the bytes its record was made from, for the next
process, and gives it back while that still holds (``Store.settled``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from ksim.analysis.abi import ArchSupport
from ksim.analysis.scc import components
from ksim.errors import TargetFault
from ksim.image.image import Image
from ksim.image.model import Function


@dataclass(frozen=True, slots=True)
class Summary:
    """What the clobber analysis needs of one function, without its instructions."""

    #: registers its own instructions write
    own_writes: frozenset[str]
    #: it makes an indirect call, an indirect jmp that is no jump table, or has
    #: undecodable bytes: it may write whatever the convention allows
    worst: bool
    #: direct calls, and direct jumps (jmp, jcc), to addresses outside it
    calls_out: tuple[int, ...]
    jumps_out: tuple[int, ...]


#: a function whose code is gone or unreadable: nothing known of it, so the worst
FREED = Summary(frozenset(), True, (), ())

_SUMMARIES: weakref.WeakKeyDictionary[Image, dict[int, Summary]] = weakref.WeakKeyDictionary()
_CACHE: weakref.WeakKeyDictionary[Image, dict[int, frozenset[str]]] = weakref.WeakKeyDictionary()


def summary(image: Image, support: ArchSupport, func: Function) -> Summary:
    """The clobber summary of ``func``: from the image's analysis store when it has
    one, else from a compact analysis of the function (kept per image)."""
    memo = _SUMMARIES.setdefault(image, {})
    found = memo.get(func.address)
    if found is None:
        from ksim.analysis import compact, store

        if image.freed(func.address):
            # init text a running kernel has freed (a __ref caller still names it):
            # whatever its bytes are now, it may write all the convention allows
            found = memo[func.address] = FREED
            return found
        kept = store.store_for(image)
        stored = kept.summary(func) if kept is not None else None
        if stored is not None:
            found = Summary(*stored)
        else:
            try:
                comp = compact.compute(image, support, func)
            except TargetFault:     # its code cannot be read: as freed text
                found = FREED
            else:
                found = Summary(comp.own_writes, comp.worst, comp.calls_out, comp.jumps_out)
        memo[func.address] = found
    return found


def own_writes(image: Image, support: ArchSupport, func: Function) -> frozenset[str]:
    """Registers the function's own instructions write (flow-insensitive, no callees)."""
    return summary(image, support, func).own_writes


def function_clobbers(image: Image, support: ArchSupport, func: Function) -> frozenset[str]:
    """Registers ``func`` (or anything it calls or tail-calls) may write.

    A function writes what its own instructions write, plus what every function it
    calls or jumps into writes; when it calls something that is not a function's
    entry, or is part of a cycle of calls (a strongly connected component of more
    than one function: gcc assumes the convention for callees it has not compiled
    yet), it may write every register the convention lets it.  Computed for all the
    functions ``func`` reaches at once (Tarjan's algorithm, without recursion), so
    the answer does not depend on what was asked before.
    """
    memo = _CACHE.setdefault(image, {})
    found = memo.get(func.address)
    if found is None:
        from ksim.analysis import store

        kept = store.store_for(image, build_missing=False)
        found = kept.clobbers(image, func) if kept is not None else None
        if found is not None:   # learnt by an earlier batch, its reach unchanged since
            memo[func.address] = found
            return found
        if kept is None:
            _read_ahead(image, support, func, memo)
        _solve(image, support, func, memo)
        found = memo[func.address]
    return found


def _edges(image: Image, support: ArchSupport, func: Function) -> tuple[set[str], list[Function]]:
    """(registers written whatever the callees do, functions called or jumped into)."""
    worst = support.convention.caller_saved
    s = summary(image, support, func)
    base = set(s.own_writes)
    succs, unknown = callees(image, s.calls_out, s.jumps_out)
    if s.worst or unknown:
        base |= worst
    return base, succs


def callees(image: Image, calls_out: Sequence[int], jumps_out: Sequence[int]
            ) -> tuple[list[Function], bool]:
    """The functions a function's direct calls and jumps out (``calls_out``,
    ``jumps_out``) go to -- the clobber analysis's edges, which the analysis store
    keeps by index too -- and whether one goes to something that is not a function
    (a call: its entry; a jump: any part of one, as a .cold part is entered)."""
    out = []
    unknown = False
    for target in calls_out:
        callee = image.function_at(target)
        if callee is None or callee.address != target:
            unknown = True
        else:
            out.append(callee)
    for target in jumps_out:
        callee = image.function_at(target)
        if callee is None:
            unknown = True
        else:
            out.append(callee)
    return out, unknown


def _read_ahead(image: Image, support: ArchSupport, root: Function,
                memo: dict[int, frozenset[str]]) -> None:
    """Without an analysis store, the summaries of everything ``root`` reaches are
    made from its functions' bytes: read them ahead a level of the call graph at a
    time, each level one request for just those functions (Image.prefetch), not the
    text around them chunk by chunk -- on a running kernel some 3,000 functions one
    call reaches were 12 MB and 1.5 s of reads.  Nothing on an image that reads no
    memory.  A function whose clobbers are known is not entered."""
    if not image.reads_memory:
        return
    summaries = _SUMMARIES.setdefault(image, {})
    seen = {root.address}
    level = [root]
    while level:
        image.prefetch([(f.address, f.size) for f in level
                        if f.address not in summaries and f.size and not image.freed(f.address)])
        after = []
        for func in level:
            s = summary(image, support, func)
            for callee in callees(image, s.calls_out, s.jumps_out)[0]:
                if callee.address not in seen and callee.address not in memo:
                    seen.add(callee.address)
                    after.append(callee)
        level = after


def _solve(image: Image, support: ArchSupport, root: Function, memo: dict[int, frozenset[str]]) -> None:
    """The strongly connected components of the functions ``root`` reaches (callees
    first), memoising the clobbers of every one of them."""
    from ksim.analysis import store

    cc = support.convention
    base: dict[int, set[str]] = {}
    succs: dict[int, list[int]] = {}
    functions = {root.address: root}
    kept = store.store_for(image, build_missing=False)

    def successors(a: int) -> list[int]:
        base[a], callees = _edges(image, support, functions[a])
        for callee in callees:
            functions.setdefault(callee.address, callee)
        succs[a] = [c.address for c in callees]
        return succs[a]

    for members in components(root.address, successors, memo):
        written: set[str] = set()
        for m in members:
            written |= base[m]
            for callee in succs[m]:
                if callee in memo:
                    written |= memo[callee]
        if len(members) > 1:
            written |= cc.caller_saved  # a cycle: the convention's worst
        result = frozenset(written - {cc.stack_reg})
        for m in members:
            memo[m] = result
            if kept is not None:    # kept for the next process where nothing it reaches changed
                kept.learn_clobbers(image, functions[m], result)
