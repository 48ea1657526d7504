"""The whole-image pass: the compact analysis of many functions at once.

:func:`ksim.analysis.compact.compute` analyses one function; called for each of the
~50 K functions of a vmlinux, its fixed cost per function (a few dozen calls of
C-level sequence operations) costs as much as the instructions themselves.
:func:`sweep` gives the same answers for a run of functions with every step done
over all of them together: one ``CodeScanMany`` of their code, then one sequence
of positions for all their instructions -- each function's instructions followed
by one more position, its *after* position (its padding, or its undecodable bytes,
or its end) -- on which the block leaders, call sites, exits and block points are
found with ``bytes.translate``, ``itertools.compress`` and ``bytes.count`` rather
than instruction by instruction.  Only the jump and call targets, and the few
blocks of filler alone whose reachability matters, are looked at one by one.

A function with an indirect jump (whose jump tables are recovered on blocks as
objects) goes through ``compute`` itself.  Tests compare the two function by
function.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import and_

from ksim.analysis.abi import EFFECT_SHIFT, FILLER_BIT, FLOW_MASK, ArchSupport
from ksim.analysis.compact import (
    _CALL,
    _CALLI,
    _HAS_TARGET,
    _IS_CALLSITE,
    _IS_RET_OR_JMPI,
    _JCC,
    _JMP,
    _JMPI,
    _KIND_BITS,
    _SEQ,
    _STOP,
    Compact,
    compute,
)
from ksim.errors import KsimError
from ksim.image.image import Image
from ksim.image.model import Function

_NONZERO = bytes([0] + [1] * 255)
_LOW_BITS = _KIND_BITS | FILLER_BIT
_KINDS_OF = bytes(k & _KIND_BITS for k in range(256))
_FILLER_OF = bytes(1 if k & FILLER_BIT else 0 for k in range(256))
_LEADERS = re.compile(rb"\x01")
_CANDIDATES = re.compile(rb"[^\x00]")
_FALLS_THROUGH = frozenset({_SEQ, _CALL, _CALLI, _JCC})


@dataclass(frozen=True, slots=True)
class Row:
    """One function's compact analysis, less the scan itself (kept in bulk)."""

    instructions: int
    tail: int
    targets: int
    blocks: int
    exits: list[int]
    block_points: list[int]
    callsites: list[int]
    own_writes: frozenset[str]
    worst: bool
    calls_out: tuple[int, ...]
    jumps_out: tuple[int, ...]
    tables: tuple = ()


def sweep(image: Image, support: ArchSupport, functions: Sequence[Function]
          ) -> tuple[list[Row | str], bytes, list[int], list[int], int]:
    """(a Row per function, or why it could not be read; the sizes, codes and targets
    of the functions analysed, in order; the code of their padding)."""
    rows: list[Row | str | None] = [None] * len(functions)
    items: list[tuple[bytes, int]] = []
    kept: list[int] = []
    for j, func in enumerate(functions):
        try:
            items.append((image.read(func.address, func.size), func.address))
        except KsimError as exc:
            rows[j] = str(exc)
            continue
        kept.append(j)
    sizes_of, codes, targets, tails, tail_code = support.scan_many(items)
    group = _Group([functions[j] for j in kept], sizes_of, codes, tails)
    group.follow(targets)
    out = iter(group.rows(image, support, tail_code))
    for j in kept:
        rows[j] = next(out)
    return rows, b"".join(sizes_of), list(codes), list(targets), tail_code  # type: ignore[return-value]


class _Group:
    """The instructions of a run of functions as one sequence of positions: each
    function's instructions, then its *after* position (its padding's first byte,
    its undecodable bytes, or its end)."""

    def __init__(self, funcs: list[Function], sizes_of: list[bytes], codes: Sequence[int],
                 tails: list[int]) -> None:
        m = len(funcs)
        self.funcs, self.codes, self.tails = funcs, codes, tails
        self.counts = counts = list(map(len, sizes_of))
        self.firsts = firsts = list(accumulate(counts, initial=0))    # each one's first code
        self.pads = pads = [f.address + sum(s) for f, s in zip(funcs, sizes_of, strict=True)]
        stream: list[int] = []
        prev = 0
        for f, sizes, pad in zip(funcs, sizes_of, pads, strict=True):
            stream.append(f.address - prev)
            stream += sizes
            prev = pad
        self.where = list(accumulate(stream))                      # address of each position
        self.first_pos = [firsts[j] + j for j in range(m + 1)]     # and the number of positions
        flat = bytes(map(_LOW_BITS.__and__, codes))  # flow, filler, target
        packed = b"\x00".join(flat[firsts[j]:firsts[j + 1]] for j in range(m)) + b"\x00"
        self.kinds = packed.translate(_KINDS_OF)
        self.filler = packed.translate(_FILLER_OF)
        # leaders: after every instruction that is not SEQ, and every function's entry
        lead = bytearray(b"\x01")
        lead += self.kinds[:-1]
        self.data = [False] * m
        for j, f in enumerate(funcs):
            after = self.first_pos[j] + counts[j]
            if not tails[j]:
                self.data[j] = pads[j] < f.end
                lead[after] = 1 if self.data[j] and counts[j] else 0  # undecodable bytes start a block
            lead[self.first_pos[j]] = 1
        self.lead = lead
        self.has_target = self.kinds.translate(_HAS_TARGET)
        self.calls_out: dict[int, set[int]] = {}
        self.jumps_out: dict[int, set[int]] = {}
        self.jmp_exits: dict[int, list[int]] = {}
        self.inner: dict[int, int] = {}        # jmp/jcc position -> target position
        self.in_padding: dict[int, int] = {}   # jmp/jcc position -> target in the padding, past its first byte

    def follow(self, targets: Sequence[int]) -> None:
        """Sort the direct targets: calls and jumps out of their function, and
        jmp/jcc targets that start an instruction of it (leaders too)."""
        funcs, first_pos, counts, pads, tails = self.funcs, self.first_pos, self.counts, self.pads, self.tails
        where, lead, inner = self.where, self.lead, self.inner
        kinds = self.kinds
        j = 0
        next_first = first_pos[1] if funcs else len(kinds)
        lo, hi = (funcs[0].address, funcs[0].end) if funcs else (0, 0)
        bisect_left = bisect.bisect_left
        for p, target, kind in zip(compress(range(len(kinds)), self.has_target), targets,
                                   compress(kinds, self.has_target), strict=True):
            if p >= next_first:
                while p >= next_first:
                    j += 1
                    next_first = first_pos[j + 1]
                lo, hi = funcs[j].address, funcs[j].end
            flow = kind & FLOW_MASK
            if not lo <= target < hi:
                if flow == _CALL:
                    self.calls_out.setdefault(j, set()).add(target)
                else:
                    self.jumps_out.setdefault(j, set()).add(target)
                    if flow == _JMP:
                        self.jmp_exits.setdefault(j, []).append(where[p])
                continue
            if flow == _CALL:
                continue
            after = first_pos[j] + counts[j]
            if target < pads[j]:
                q = bisect_left(where, target, first_pos[j], after)
                if where[q] == target:
                    lead[q] = 1
                    inner[p] = q
            elif target == pads[j] and tails[j]:
                lead[after] = 1
                inner[p] = after
            elif target < pads[j] + tails[j]:
                self.in_padding[p] = target

    def rows(self, image: Image, support: ArchSupport, tail_code: int) -> list[Row]:
        """A Row per function, from the leaders and targets found."""
        kinds, first_pos, counts, tails = self.kinds, self.first_pos, self.counts, self.tails
        lead01 = bytes(self.lead).translate(_NONZERO)
        callsite = kinds.translate(_IS_CALLSITE)
        ret = kinds.translate(_IS_RET_OR_JMPI)
        all_calls = list(compress(self.where, callsite))
        all_rets = list(compress(self.where, ret))
        all_leads = list(compress(self.where, lead01))
        candidates = self._filler_leaders(lead01)
        targeted = set(self.inner.values())
        padding_functions = {bisect.bisect_right(first_pos, p) - 1 for p in self.in_padding}
        unusual_padding = tail_code & (FLOW_MASK | FILLER_BIT) != _STOP | FILLER_BIT
        out: list[Row] = []
        n_calls = n_rets = n_leads = 0
        for j, f in enumerate(self.funcs):
            start, after = first_pos[j], first_pos[j] + counts[j]
            k_calls = callsite.count(1, start, after)
            k_rets = ret.count(1, start, after)
            k_leads = lead01.count(1, start, after + 1)
            calls = all_calls[n_calls:n_calls + k_calls]
            exits = all_rets[n_rets:n_rets + k_rets]
            leaders = all_leads[n_leads:n_leads + k_leads]
            n_calls, n_rets, n_leads = n_calls + k_calls, n_rets + k_rets, n_leads + k_leads
            if kinds.find(_JMPI_BYTE, start, after) != -1 or (tails[j] and unusual_padding):
                out.append(_row(compute(image, support, f)))  # jump tables: blocks as objects
                continue
            if j in self.jmp_exits:
                exits = sorted(exits + self.jmp_exits[j])
            block_points = leaders[:-1] if self.data[j] else leaders
            cands = candidates.get(j, [])
            if tails[j] and lead01[after]:
                # the first padding byte starts a block: reached only by an edge into it
                if after in targeted or (kinds[after - 1] & FLOW_MASK) in _FALLS_THROUGH:
                    cands = [*cands, after]
                elif after != start:
                    block_points = block_points[:-1]
            if cands or j in padding_functions:
                block_points = _filler_blocks(cands, start, after, tails[j], kinds, self.filler, lead01,
                                              self.where, targeted, self.inner, self.in_padding,
                                              block_points, j in padding_functions)
            out.append(Row(
                counts[j], tails[j], self.has_target.count(1, start, after),
                k_leads + max(tails[j] - 1, 0), exits, block_points, calls,
                self._own_writes(j, support, tail_code),
                self.pads[j] + tails[j] != f.end or kinds.find(_CALLI_BYTE, start, after) != -1,
                tuple(sorted(self.calls_out.get(j, ()))), tuple(sorted(self.jumps_out.get(j, ()))),
            ))
        return out

    def _filler_leaders(self, lead01: bytes) -> dict[int, list[int]]:
        """Per function, the leaders (past its entry) whose first instruction is filler."""
        first_pos = self.first_pos
        out: dict[int, list[int]] = {}
        for c in (mt.start() for mt in _CANDIDATES.finditer(bytes(map(and_, lead01, self.filler)))):
            j = bisect.bisect_right(first_pos, c) - 1
            if c != first_pos[j]:  # the entry is reached (most start with ftrace's 5-byte nop)
                out.setdefault(j, []).append(c)
        return out

    def _own_writes(self, j: int, support: ArchSupport, tail_code: int) -> frozenset[str]:
        writes = support.effects
        own: set[str] = set()
        for code in set(self.codes[self.firsts[j]:self.firsts[j + 1]]):
            own |= writes[code >> EFFECT_SHIFT][1]
        if self.tails[j]:
            own |= writes[tail_code >> EFFECT_SHIFT][1]
        return frozenset(own)


_JMPI_BYTE = bytes([_JMPI])
_CALLI_BYTE = bytes([_CALLI])


def _row(comp: Compact) -> Row:
    return Row(len(comp.sizes), comp.tail, len(comp.targets), comp.blocks, list(comp.exits),
               list(comp.block_points), list(comp.callsites), comp.own_writes, comp.worst,
               comp.calls_out, comp.jumps_out, comp.tables)


def _filler_blocks(cands: list[int], start: int, after: int, tail: int, kinds: bytes, filler: bytes,
                   lead01: bytes, where: list[int], targeted: set[int], inner: dict[int, int],
                   in_padding: dict[int, int], block_points: list[int],
                   has_padding_targets: bool) -> list[int]:
    """``block_points`` less the blocks of filler alone no path reaches, plus the
    padding blocks past the first one that a path reaches."""
    fillers = []
    search = has_padding_targets
    for c in cands:
        nxt = lead01.find(1, c + 1, after + 1)
        if nxt == -1:
            nxt = after
        if filler.count(0, c, nxt):
            continue  # some instruction is no filler
        fillers.append(c)
        if c == start:
            continue  # the entry: reached
        if c in targeted or (kinds[c - 1] & FLOW_MASK) in _FALLS_THROUGH:
            search = True  # an edge leads in: is its source reachable?
    if not search:
        return _without(block_points, [where[c] for c in fillers if c != start])
    reached, padding = _reached(start, after, tail, kinds, lead01, inner, in_padding)
    return _without(block_points, [where[c] for c in fillers if c not in reached]) + sorted(padding)


def _without(points: list[int], dropped: list[int]) -> list[int]:
    """The sorted ``points`` less ``dropped`` (some of them)."""
    if not dropped:
        return points
    points = list(points)
    for a in dropped:
        k = bisect.bisect_left(points, a)
        if k < len(points) and points[k] == a:
            del points[k]
    return points


def _reached(start: int, after: int, tail: int, kinds: bytes, lead01: bytes, inner: dict[int, int],
             in_padding: dict[int, int]) -> tuple[set[int], set[int]]:
    """(positions of the blocks a path from the entry reaches, addresses of the
    padding blocks past the first one it reaches)."""
    leaders = [mt.start() for mt in _LEADERS.finditer(lead01, start, after + 1)]
    count = len(leaders)
    index = {p: k for k, p in enumerate(leaders)}
    ends_in_padding = count - 1 if tail else -1
    reached = {start}
    padding: set[int] = set()
    work = [0]
    while work:
        k = work.pop()
        stop = leaders[k + 1] if k + 1 < count else after
        if k == ends_in_padding or stop == leaders[k]:
            continue  # ends with padding, which stops; or undecodable bytes
        last = stop - 1
        flow = kinds[last] & FLOW_MASK
        succ = []
        if flow in _FALLS_THROUGH and k + 1 < count:
            succ.append(k + 1)
        if flow == _JMP or flow == _JCC:
            q = inner.get(last)
            if q is not None:
                succ.append(index[q])
            elif last in in_padding:
                padding.add(in_padding[last])
        for dst in succ:
            if leaders[dst] not in reached:
                reached.add(leaders[dst])
                work.append(dst)
    return reached, padding
