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
"""

from __future__ import annotations

import weakref

from ksim.analysis.abi import ArchSupport
from ksim.arch.base import Flow
from ksim.image.image import Image
from ksim.image.model import Function

_MAX_DEPTH = 200
_CACHE: weakref.WeakKeyDictionary[Image, dict[int, frozenset[str]]] = weakref.WeakKeyDictionary()


def function_clobbers(image: Image, support: ArchSupport, func: Function) -> frozenset[str]:
    """Registers ``func`` (or anything it calls or tail-calls) may write."""
    memo = _CACHE.setdefault(image, {})
    return _clobbers(image, support, func, memo, set(), 0)


def _clobbers(image: Image, support: ArchSupport, func: Function, memo: dict[int, frozenset[str]],
              active: set[int], depth: int) -> frozenset[str]:
    cc = support.convention
    worst = cc.caller_saved
    if func.address in memo:
        return memo[func.address]
    if func.address in active or depth > _MAX_DEPTH:
        return worst  # a cycle or a very deep chain: assume the worst, do not memoise
    active.add(func.address)
    try:
        written: set[str] = set()
        code = image.read(func.address, func.size)
        end = func.address
        for insn in support.decode(code, func.address):
            end = insn.end
            written |= insn.writes
            if insn.flow is Flow.CALL_INDIRECT:
                written |= worst
            elif insn.flow is Flow.JMP_INDIRECT:
                if insn.address not in _tables(image, func):
                    written |= worst  # an indirect tail call
            elif insn.flow in (Flow.CALL, Flow.JMP, Flow.JCC) and insn.target is not None:
                if insn.target in func:
                    continue
                # a jump into another function's middle (a .cold part) runs part of it
                callee = image.function_at(insn.target)
                if callee is None or (insn.flow is Flow.CALL and callee.address != insn.target):
                    written |= worst
                else:
                    written |= _clobbers(image, support, callee, memo, active, depth + 1)
        if end != func.end:
            written |= worst  # undecodable bytes
    finally:
        active.discard(func.address)
    result = frozenset(written - {cc.stack_reg})
    memo[func.address] = result
    return result


def _tables(image: Image, func: Function) -> frozenset[int]:
    """Addresses of the recovered jump-table jumps of ``func``."""
    from ksim.analysis.function import analyze  # analysis uses this module

    return frozenset(analyze(image, func).tables)


def own_writes(image: Image, support: ArchSupport, func: Function) -> frozenset[str]:
    """Registers the function's own instructions write (flow-insensitive, no callees)."""
    written: set[str] = set()
    for insn in support.decode(image.read(func.address, func.size), func.address):
        written |= insn.writes
    return frozenset(written)
