"""One function's analysis in compact form: what a whole-kernel pass computes and
the persistent store keeps.

A :class:`~ksim.analysis.function.FunctionAnalysis` holds an object per instruction
and per block, which is what a caller attaching to a function wants and what a
whole kernel (6.6 M instructions, 4.6 M blocks in the Debian 6.1 vmlinux) cannot
afford.  A :class:`Compact` holds the same facts as plain numbers: the bulk scan of
the function (sizes, packed codes, direct targets, the int3 padding as a count; see
``ksim.analysis.abi.CodeScan``), its recovered jump tables, and what the analysis
derives from them -- the number of basic blocks, the points, and the summary the
clobber analysis needs (registers written, the calls and jumps out).

:func:`compute` derives it; :func:`insns` rebuilds the instruction objects from it
(no register-effect decoding needed), from which the CFG is built as for a fresh
analysis.  The blocks and points computed here follow :mod:`ksim.analysis.cfg` and
:mod:`ksim.analysis.points` exactly (tests compare them function by function); a
function with an indirect jump goes through those modules themselves, since
recovering its jump tables needs the blocks as objects.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, compress

from ksim.analysis.abi import EFFECT_SHIFT, FILLER_BIT, FLOW_MASK, FLOWS, TARGET_BIT, ArchSupport
from ksim.analysis.cfg import CFG, JumpTable, build_cfg
from ksim.analysis.points import find_points
from ksim.arch.base import Flow, Insn
from ksim.errors import KsimError
from ksim.image.image import Image
from ksim.image.model import Function

_SEQ, _JMP, _JCC, _JMPI, _CALL, _CALLI, _RET, _STOP = (FLOWS.index(f) for f in (
    Flow.SEQ, Flow.JMP, Flow.JCC, Flow.JMP_INDIRECT, Flow.CALL, Flow.CALL_INDIRECT, Flow.RET, Flow.STOP))
assert _SEQ == 0
Effects = Sequence[tuple[frozenset[str], frozenset[str]]]


class StaleRecord(KsimError):
    """A stored analysis does not match the bytes it was made from."""


@dataclass(frozen=True, eq=False)
class Compact:
    start: int
    end: int
    #: per decoded instruction: its size, and its code (see ksim.analysis.abi.CodeScan)
    sizes: bytes
    codes: Sequence[int]
    #: direct targets of the instructions that have one, in order
    targets: Sequence[int]
    #: one-byte padding instructions after the decoded ones, and their code
    tail: int
    tail_code: int
    #: what the effects index of a code means: (reads, writes)
    effects: Effects
    tables: tuple[JumpTable, ...]
    #: basic blocks, and the points (see ksim.analysis.points)
    blocks: int
    exits: tuple[int, ...]
    block_points: tuple[int, ...]
    callsites: tuple[int, ...]
    #: registers the function's own instructions write
    own_writes: frozenset[str]
    #: an indirect call, an indirect jmp that is no jump table, or undecodable bytes
    worst: bool
    #: direct calls and jumps (jmp, jcc) to addresses outside the function, sorted
    calls_out: tuple[int, ...]
    jumps_out: tuple[int, ...]

    @property
    def instructions(self) -> int:
        return len(self.sizes) + self.tail

    def insn_effects(self) -> list[tuple[frozenset[str], frozenset[str]]]:
        """(reads, writes) of every instruction, padding included."""
        out = [self.effects[c >> EFFECT_SHIFT] for c in self.codes]
        if self.tail:
            out += [self.effects[self.tail_code >> EFFECT_SHIFT]] * self.tail
        return out

    def same_analysis(self, other: Compact) -> bool:
        """Whether ``other`` says the same of the function (effects compared by meaning,
        since two processes number them differently)."""
        fields = ("start", "end", "sizes", "tail", "tables", "blocks", "exits",
                  "block_points", "callsites", "own_writes", "worst", "calls_out", "jumps_out")
        return (all(getattr(self, f) == getattr(other, f) for f in fields)
                and list(self.targets) == list(other.targets)
                and [c & ~(-1 << EFFECT_SHIFT) for c in self.codes]
                == [c & ~(-1 << EFFECT_SHIFT) for c in other.codes]
                and self.insn_effects() == other.insn_effects())


def compute(image: Image, support: ArchSupport, func: Function) -> Compact:
    """The compact analysis of ``func`` (KsimError when its bytes cannot be read)."""
    code = image.read(func.address, func.size)
    sizes, codes, targets, tail, tail_code = support.scan(code, func.address)
    start, end = func.address, func.end
    starts = list(accumulate(sizes, initial=start))
    kinds = bytes(map(_KIND_BITS.__and__, codes))  # flow | has-target, per instruction
    tables: tuple[JumpTable, ...] = ()
    if _JMPI in kinds or (tail and tail_code & (FLOW_MASK | FILLER_BIT) != _STOP | FILLER_BIT):
        # jump tables are recovered on blocks as objects: let the CFG module do it all
        insn_list = insns(support, code, start, sizes, codes, targets, tail, tail_code, support.effects)
        cfg = build_cfg(insn_list, start, end, image.read, arch=support.arch)
        points = find_points(cfg, func.name, support.arch)
        tables = tuple(cfg.tables.values())
        blocks, exits, block_points, callsites = (len(cfg.blocks), list(points.exits),
                                                  list(points.blocks), list(points.callsites))
        calls_out, jumps_out = _out(start, end, kinds, targets)
    else:
        blocks, exits, block_points, callsites, calls_out, jumps_out = _layout(
            start, end, starts, kinds, codes, targets, tail)
    own: set[str] = set()
    effects = support.effects
    for index in set(map(EFFECT_SHIFT.__rrshift__, codes)):
        own |= effects[index][1]
    if tail:
        own |= effects[tail_code >> EFFECT_SHIFT][1]
    table_jumps = {t.jump for t in tables}
    worst = starts[-1] + tail != end or _CALLI in kinds or any(
        starts[m.start()] not in table_jumps for m in re.finditer(bytes([_JMPI]), kinds))
    return Compact(start, end, sizes, codes, targets, tail, tail_code, effects, tables,
                   blocks, tuple(exits), tuple(block_points), tuple(callsites),
                   frozenset(own), worst, calls_out, jumps_out)


_KIND_BITS = FLOW_MASK | TARGET_BIT
_KINDS = re.compile(rb"[^\x00]")


def _out(start: int, end: int, kinds: bytes, targets: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(direct call targets, direct jmp/jcc targets) outside ``[start, end)``, sorted."""
    calls: set[int] = set()
    jumps: set[int] = set()
    with_target = (m.start() for m in _KINDS.finditer(kinds) if kinds[m.start()] & TARGET_BIT)
    for i, target in zip(with_target, targets, strict=True):
        if not start <= target < end:
            (calls if kinds[i] & FLOW_MASK == _CALL else jumps).add(target)
    return tuple(sorted(calls)), tuple(sorted(jumps))


def insns(support: ArchSupport, code: bytes, start: int, sizes: bytes, codes: Sequence[int],
          targets: Sequence[int], tail: int, tail_code: int, effects: Effects) -> list[Insn]:
    """The instructions a scan describes, as objects (StaleRecord when ``code`` does not
    hold them)."""
    out = support.rebuild(code, start, sizes, codes, targets, effects)
    if len(out) != len(sizes):
        raise StaleRecord(f"{start:#x}: the code does not decode to the {len(sizes)} instructions recorded")
    if tail:
        at = out[-1].end if out else start
        pad = code[at - start:at - start + 1]
        if len(code) != at - start + tail or code[at - start:] != pad * tail:
            raise StaleRecord(f"{start:#x}: no {tail} bytes of padding at {at:#x}")
        proto = next(iter(support.decode(pad, at)), None)
        if proto is None or proto.size != 1:
            raise StaleRecord(f"{at:#x}: {pad.hex()} is no one-byte instruction")
        reads, writes = effects[tail_code >> EFFECT_SHIFT]
        flow = FLOWS[tail_code & FLOW_MASK]
        out += [Insn(at + k, 1, pad, proto.mnemonic, proto.op_str, flow, None, None, reads, writes)
                for k in range(tail)]
    return out


def _kind_table(test: Callable[[int, bool], bool]) -> bytes:
    """A bytes.translate table over kinds (flow | has-target): 1 where ``test(flow,
    has target)`` holds."""
    return bytes(1 if test(k & FLOW_MASK, bool(k & TARGET_BIT)) else 0 for k in range(256))


_IS_CALLSITE = _kind_table(lambda f, t: f in (_CALL, _CALLI))
_IS_RET_OR_JMPI = _kind_table(lambda f, t: f in (_RET, _JMPI))
_HAS_TARGET = _kind_table(lambda f, t: t)
_IS_JUMP = _kind_table(lambda f, t: f in (_JMP, _JCC))
_IS_JMP = _kind_table(lambda f, t: f == _JMP)
_IS_CALL = _kind_table(lambda f, t: f == _CALL)


def _layout(start: int, end: int, starts: list[int], kinds: bytes, codes: Sequence[int],
            targets: Sequence[int], tail: int
            ) -> tuple[int, list[int], list[int], list[int], tuple[int, ...], tuple[int, ...]]:
    """(number of blocks, exits, block points, call sites, calls out, jumps out) of a
    function without indirect jumps, as build_cfg and find_points find them.

    ``starts`` holds the address of every decoded instruction and, last, the end of
    the decoded ones; ``kinds`` the flow and has-target bits of each.  The ``tail``
    padding instructions after them are alignment filler that stops (int3): each
    starts a block of its own (the first one may close the block before it), and
    none leads anywhere.

    Works on whole sequences (``compress``, ``translate``, set operations) rather
    than instruction by instruction.  Reachability matters only for blocks of
    filler alone (a block point is any block but unreachable filler), so the blocks
    are searched only when such a block has an edge into it.
    """
    n = len(kinds)
    pad = starts[n]           # the first padding instruction (or the end of the decoded bytes)
    decoded_end = pad + tail
    callsites = list(compress(starts, kinds.translate(_IS_CALLSITE)))
    exits = list(compress(starts, kinds.translate(_IS_RET_OR_JMPI)))  # no tables: a jmp* leaves
    with_target = kinds.translate(_HAS_TARGET)
    target_kinds = bytes(compress(kinds, with_target))
    jump_targets = list(compress(targets, target_kinds.translate(_IS_JUMP)))
    calls_out = tuple(sorted(t for t in set(compress(targets, target_kinds.translate(_IS_CALL)))
                             if not start <= t < end))
    jumps_out = tuple(sorted(t for t in set(jump_targets) if not start <= t < end))
    if jumps_out:
        is_jmp = target_kinds.translate(_IS_JMP)
        exits += [a for a, t in zip(compress(compress(starts, with_target), is_jmp),
                                    compress(targets, is_jmp), strict=True)
                  if not start <= t < end]
        exits.sort()
    leaders = set(compress(starts[1:], kinds))   # after every instruction that is not SEQ
    leaders.discard(end)
    leaders.add(start)
    inner = set(jump_targets)
    leaders |= inner.intersection(starts[:n])
    in_padding = [t for t in inner if pad <= t < decoded_end] if inner and tail and max(inner) >= pad else []
    leaders.update(in_padding)
    if n + tail and decoded_end < end:
        leaders.add(decoded_end)  # bytes that do not decode
    # the explicit blocks: every leader up to the first padding instruction; past
    # it, every padding byte starts a block of its own
    order = sorted(a for a in leaders if a <= pad) if tail else sorted(leaders)
    count = len(order)
    blocks = count + max(tail - 1, 0)
    # blocks of filler alone: a point only if reachable
    filler = bytes(map(FILLER_BIT.__and__, codes))
    candidates = sorted(set(compress(starts, filler)).intersection(order))
    if tail and order[-1] == pad:
        candidates.append(pad)
    first: list[int] = []
    index: dict[int, int] = {}
    fillers: list[int] = []
    searched = False
    if candidates or in_padding:
        first = list(map(partial(bisect.bisect_left, starts, lo=0, hi=n), order))
        first.append(n)
        index = dict(zip(order, range(count), strict=True))
        for lead in candidates:
            k = index[lead]
            a, b = first[k], first[k + 1]
            if filler.count(0, a, b):
                continue  # some instruction is no filler
            fillers.append(k)
            if k == 0 or lead in inner or (kinds[a - 1] & FLOW_MASK) in (_SEQ, _CALL, _CALLI, _JCC):
                searched = True  # an edge leads in: is its source reachable?
        searched = searched or bool(in_padding)
    block_points = order
    if not tail and decoded_end < end:
        block_points = order[:-1]  # the undecodable bytes: no instructions, no point
    if not searched:
        if fillers:
            dropped = {order[k] for k in fillers}
            block_points = [a for a in block_points if a not in dropped]
        return blocks, exits, list(block_points), callsites, calls_out, jumps_out
    target_at = dict(zip(compress(range(n), with_target), targets, strict=True))
    reached = _reached(kinds, order, first, index, target_at, pad, decoded_end)
    dropped = {order[k] for k in fillers if order[k] not in reached}
    block_points = [a for a in block_points if a not in dropped]
    block_points += sorted({a for a in reached if a > pad and tail})
    return blocks, exits, block_points, callsites, calls_out, jumps_out


def _reached(kinds: bytes, order: list[int], first: list[int], index: dict[int, int],
             target_at: dict[int, int], pad: int, decoded_end: int) -> set[int]:
    """The block starts a path from the entry reaches, padding blocks included
    (``first`` holds the first instruction of each block of ``order``, then the
    number of decoded instructions)."""
    count = len(order)
    ends_in_padding = count - 1 if decoded_end > pad else -1
    reached = {order[0]}
    work = [0]
    while work:
        k = work.pop()
        stop = first[k + 1]
        if k == ends_in_padding or stop == first[k]:
            continue  # ends with padding, which stops; or undecodable bytes
        last = stop - 1
        flow = kinds[last] & FLOW_MASK
        out: list[int] = []
        if flow == _SEQ or flow == _CALL or flow == _CALLI or flow == _JCC:
            if k + 1 < count:
                out.append(k + 1)
        if flow == _JMP or flow == _JCC:
            target = target_at.get(last)
            if target is not None:
                dst = index.get(target)
                if dst is not None:
                    out.append(dst)
                elif pad < target < decoded_end:
                    reached.add(target)  # a padding block: it leads nowhere
        for dst in out:
            if order[dst] not in reached:
                reached.add(order[dst])
                work.append(dst)
    return reached




def cfg_of(support: ArchSupport, image: Image, func: Function, comp: Compact) -> tuple[list[Insn], CFG]:
    """The instructions and CFG of ``func`` rebuilt from its compact analysis."""
    code = image.read(func.address, func.size)
    insn_list = insns(support, code, func.address, comp.sizes, comp.codes, comp.targets,
                      comp.tail, comp.tail_code, comp.effects)
    cfg = build_cfg(insn_list, func.address, func.end, tables={t.jump: t for t in comp.tables})
    return insn_list, cfg
