"""A function seen through its compact record: the questions a batch of points asks
of it, answered without an object per instruction.

Attaching to thousands of functions at once (``ksim trace 'kprobe:t*'``) asks each
of them the same few things: where its code ends, which addresses a branch may
reach, the first few instructions at the point, and which registers are live
there.  :class:`~ksim.analysis.function.FunctionAnalysis` answers them from the
instructions and blocks as objects, rebuilt from the analysis store; a
:class:`RecordView` answers them from the record's numbers: blocks as index
ranges, register sets as bit masks, and instructions decoded only when asked for
(:class:`Instructions`).

Every answer is the object path's, exactly (tests compare both on every function
of the test kernels and of a Debian vmlinux): the blocks are
:mod:`ksim.analysis.cfg`'s, and liveness follows :mod:`ksim.analysis.liveness`
rule by rule.  A function that needs more than the record holds -- an indirect
jump (jump tables are recovered on blocks as objects), bytes that do not decode,
padding that is not the architecture's stop filler -- has no view
(:func:`view` gives None) and goes the object path.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, compress
from typing import Any, overload

from ksim.analysis.abi import (
    EFFECT_SHIFT,
    FILLER_BIT,
    FLOW_MASK,
    FLOWS,
    TARGET_BIT,
    ArchSupport,
    CallConvention,
)
from ksim.analysis.compact import Compact
from ksim.analysis.liveness import Target, TargetKind
from ksim.arch.base import Flow, Insn

_SEQ, _JMP, _JCC, _JMPI, _CALL, _CALLI, _RET, _STOP = (FLOWS.index(f) for f in (
    Flow.SEQ, Flow.JMP, Flow.JCC, Flow.JMP_INDIRECT, Flow.CALL, Flow.CALL_INDIRECT, Flow.RET, Flow.STOP))
_DECODE_AHEAD = 8  # instructions decoded at a time (a point's window is a few)
#: ... and from a function's start: an entry point's window (after an ftrace
#: location) ends within the first five instructions of nearly every function
_DECODE_HEAD = 5
#: bytes.translate's table: 1 for a direct jump's flow (jmp, jcc), 0 for any other
_IS_JUMP = bytes(int(k in (_JMP, _JCC)) for k in range(256))
#: what never goes on to the next instruction
_NO_FALLTHROUGH = frozenset({_JMP, _JMPI, _RET, _STOP})

# --- register sets as bit masks ------------------------------------------------------
_BIT: dict[str, int] = {}
_NAMES: dict[int, frozenset[str]] = {}


_MASKS: dict[frozenset[str], int] = {}


def _mask(names: frozenset[str] | set[str]) -> int:
    if isinstance(names, frozenset):
        found = _MASKS.get(names)
        if found is None:
            found = _MASKS[names] = _mask(set(names))
        return found
    m = 0
    for name in names:
        bit = _BIT.get(name)
        if bit is None:
            bit = _BIT[name] = 1 << len(_BIT)
        m |= bit
    return m


def _names(mask: int) -> frozenset[str]:
    found = _NAMES.get(mask)
    if found is None:
        found = _NAMES[mask] = frozenset(n for n, b in _BIT.items() if mask & b)
    return found


class _Masks:
    """An effects table's (reads, writes) as masks, each made when first asked for."""

    __slots__ = ("_effects", "_made")

    def __init__(self, effects: Sequence[tuple[frozenset[str], frozenset[str]]]) -> None:
        self._effects = effects
        self._made: dict[int, tuple[int, int]] = {}

    def __getitem__(self, i: int) -> tuple[int, int]:
        found = self._made.get(i)
        if found is None:
            r, w = self._effects[i]
            found = self._made[i] = (_mask(r), _mask(w))
        return found


#: a shared table's masks, kept while the table lives (a store's chunk: every function
#: of the chunk uses its table); the masks hold the table weakly, so keeping them keeps
#: no store alive
_EFFECT_MASKS: weakref.WeakKeyDictionary[Any, _Masks] = weakref.WeakKeyDictionary()


def _effect_masks(effects: Sequence[tuple[frozenset[str], frozenset[str]]]) -> _Masks:
    try:
        kept = _EFFECT_MASKS.get(effects)
    except TypeError:  # a table that cannot be weakly held (a tuple): one function's own
        return _Masks(effects)
    if kept is None:
        kept = _EFFECT_MASKS[effects] = _Masks(weakref.proxy(effects))
    return kept


_CONVENTIONS: dict[int, tuple[CallConvention, tuple[int, ...]]] = {}


def _convention_masks(cc: CallConvention) -> tuple[int, ...]:
    """A convention's sets as masks: every register, the caller-saved ones, live at a
    call, at a return and at a tail call (without ``preserved``), the return
    registers and the stack pointer (its properties build the sets on each use)."""
    kept = _CONVENTIONS.get(id(cc))
    if kept is None or kept[0] is not cc:
        masks = (_mask(cc.all_regs), _mask(cc.caller_saved), _mask(cc.at_call()),
                 _mask(cc.at_return), _mask(cc.at_tail_call), _mask(frozenset(cc.ret_regs)),
                 _mask(frozenset({cc.stack_reg})))
        kept = _CONVENTIONS[id(cc)] = (cc, masks)
    return kept[1]


# --- instructions decoded when asked for -----------------------------------------------
class Instructions(Sequence[Insn]):
    """A function's instructions from its record, each decoded (by the architecture's
    ``rebuild``, a few at a time) the first time it is indexed.  ``addresses`` holds
    every instruction's start without decoding any."""

    __slots__ = ("addresses", "_support", "_code", "_comp", "_decoded", "_with_target", "_pad")

    def __init__(self, support: ArchSupport, code: bytes, comp: Compact, addresses: list[int],
                 with_target: list[int]) -> None:
        # with_target: the indexes of the instructions that have a direct target, in order
        self.addresses = addresses
        self._support, self._code, self._comp = support, code, comp
        self._decoded: list[Insn | None] = [None] * len(addresses)
        self._with_target = with_target
        self._pad: Insn | None = None

    def __len__(self) -> int:
        return len(self.addresses)

    @overload
    def __getitem__(self, i: int) -> Insn: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Insn, ...]: ...

    def __getitem__(self, i: int | slice) -> Insn | tuple[Insn, ...]:
        if isinstance(i, slice):  # a tuple, as a function's instructions as objects slice
            return tuple(self[k] for k in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        found = self._decoded[i]
        if found is None:
            self._decode(i)
            found = self._decoded[i]
            assert found is not None
        return found

    def __iter__(self) -> Iterator[Insn]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same instructions (a tuple of them included)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def spans(self) -> list[tuple[int, int]]:
        """(address, size) of every instruction, none decoded."""
        sizes = self._comp.sizes
        n = len(sizes)
        return [(a, sizes[i] if i < n else 1) for i, a in enumerate(self.addresses)]

    def size_at(self, address: int) -> int | None:
        """The size of the instruction at ``address`` (None: no instruction starts
        there), none decoded."""
        i = bisect.bisect_left(self.addresses, address)
        if i == len(self.addresses) or self.addresses[i] != address:
            return None
        sizes = self._comp.sizes
        return sizes[i] if i < len(sizes) else 1

    def upto(self, end: int) -> Instructions:
        """The instructions that start before ``end`` (the same decoded objects)."""
        n = bisect.bisect_left(self.addresses, end)
        if n == len(self.addresses):
            return self
        out = Instructions(self._support, self._code, self._comp, self.addresses[:n],
                           self._with_target)
        out._decoded = self._decoded[:n]
        return out

    def _decode(self, i: int) -> None:
        comp = self._comp
        n = len(comp.sizes)
        if i >= n:  # padding after the decoded instructions: the same one-byte filler
            self._decoded[i] = self._padding(self.addresses[i])
            return
        hi = min(n, i + (_DECODE_HEAD if i == 0 else _DECODE_AHEAD))
        start = self.addresses[i]
        at = start - comp.start
        length = sum(comp.sizes[i:hi])
        k = bisect.bisect_left(self._with_target, i)
        targets = comp.targets[k:bisect.bisect_left(self._with_target, hi)]
        got = self._support.rebuild(self._code[at:at + length], start, comp.sizes[i:hi],
                                    comp.codes[i:hi], targets, comp.effects)
        if len(got) != hi - i:
            raise AssertionError(f"{start:#x}: the record's instructions do not decode "
                                 "(the view was made from other bytes)")
        self._decoded[i:hi] = got[:len(self._decoded) - i]

    def _padding(self, address: int) -> Insn:
        comp = self._comp
        if self._pad is None:
            at = self.addresses[len(comp.sizes)]
            pad = self._code[at - comp.start:at - comp.start + 1]
            proto = next(iter(self._support.decode(pad, at)))
            self._pad = proto
        reads, writes = comp.effects[comp.tail_code >> EFFECT_SHIFT]
        p = self._pad
        return Insn(address, 1, p.raw, p.mnemonic, p.op_str, FLOWS[comp.tail_code & FLOW_MASK],
                    None, None, reads, writes)


# --- the view ---------------------------------------------------------------------------
Classify = Callable[[int], Target]


class RecordView:
    """Blocks, reachability, branch targets and liveness of one function from its
    compact record (see the module's doc).  Build it with :func:`view`."""

    def __init__(self, support: ArchSupport, code: bytes, comp: Compact, flows: bytes,
                 classify: Classify, standard_indirect: Callable[[Insn], bool],
                 preserved: frozenset[str]) -> None:
        # flows: each instruction's flow index, the padding kept (view's TAIL_KEPT) included
        self.start, self.end = comp.start, comp.end
        self._support, self._comp = support, comp
        self._classify_fn = classify
        self._classified: dict[int, Target] = {}
        self._standard_indirect = standard_indirect
        n = len(comp.sizes)
        tail = len(flows) - n   # the padding instructions kept (see view)
        addresses = list(accumulate(comp.sizes, initial=comp.start))
        pad = addresses.pop()
        addresses += range(pad, pad + tail)
        self.addresses = addresses
        self.count = n + tail
        codes = comp.codes
        # per instruction: its flow (padding: the tail's), its effects' index
        self._flows = flows
        self._codes = codes
        # the instructions that have a target, and their targets
        with_target = list(compress(range(n), map(TARGET_BIT.__and__, codes)))
        self._with_target = with_target
        self._target_of = dict(zip(with_target, comp.targets, strict=True))
        self.insns = Instructions(support, code, comp, addresses, with_target)
        self._effect_masks = _effect_masks(comp.effects)
        (self._all, self._caller_saved, self._at_call, at_return, at_tail_call, self._ret,
         self._sp) = _convention_masks(support.convention)
        keep = _mask(preserved)
        self._at_return, self._at_tail_call = at_return | keep, at_tail_call | keep
        self._live_in: list[int] | None = None

    #: what _blocks makes, when first asked for: a batch's entry points need the
    #: blocks of a function only when the store derived nothing for it
    _LAZY = frozenset({"_index", "firsts", "_block_of_first", "_lasts", "succs", "preds",
                       "reachable"})

    def __getattr__(self, name: str) -> Any:
        if name not in RecordView._LAZY:
            raise AttributeError(name)
        self._blocks()
        return self.__dict__[name]

    def is_boundary(self, address: int) -> bool:
        """Whether an instruction starts at ``address``."""
        i = bisect.bisect_left(self.addresses, address)
        return i < self.count and self.addresses[i] == address

    def _filler(self, i: int) -> bool:
        comp = self._comp
        return bool((self._codes[i] if i < len(comp.sizes) else comp.tail_code) & FILLER_BIT)

    def _effects(self, i: int) -> tuple[int, int]:
        """(reads, writes) of instruction ``i`` as masks."""
        comp = self._comp
        code = self._codes[i] if i < len(comp.sizes) else comp.tail_code
        return self._effect_masks[code >> EFFECT_SHIFT]

    # --- blocks (ksim.analysis.cfg's, as index ranges) ---------------------------------
    def _blocks(self) -> None:
        addresses, flows, count = self.addresses, self._flows, self.count
        index = dict(zip(addresses, range(count), strict=True))
        self._index = index
        target_of = self._target_of
        # a block starts at the entry, after every instruction that is no plain
        # sequence (when the function goes on), and at every jump's target
        transfers = list(compress(range(count), flows))
        leaders = {0}
        leaders.update(i + 1 for i in transfers if i + 1 < count)
        for i in transfers:
            flow = flows[i]
            if flow == _JMP or flow == _JCC:
                k = index.get(target_of.get(i, -1))
                if k is not None:
                    leaders.add(k)
        firsts = sorted(leaders)
        self.firsts = firsts
        self._block_of_first = block_of = dict(zip(firsts, range(len(firsts)), strict=True))
        nb = len(firsts)
        lasts = [f - 1 for f in firsts[1:]] + [count - 1]
        self._lasts = lasts
        succs: list[tuple[int, ...]] = []
        for b, last in enumerate(lasts):
            flow = flows[last]
            nxt = b + 1 if b + 1 < nb else None
            if flow == _SEQ or flow == _CALL or flow == _CALLI:
                succs.append((nxt,) if nxt is not None else ())
            elif flow == _JMP or flow == _JCC:
                k = index.get(target_of.get(last, -1))
                t = block_of.get(k) if k is not None else None
                out: tuple[int, ...] = (t,) if t is not None else ()
                if flow == _JCC and nxt is not None and nxt != t:
                    out += (nxt,)
                succs.append(out)
            else:
                succs.append(())
        self.succs = succs
        preds: list[list[int]] = [[] for _ in range(nb)]
        for b, outs in enumerate(succs):
            for t in outs:
                preds[t].append(b)
        self.preds = preds
        seen = {0}
        work = [0]
        while work:
            for t in succs[work.pop()]:
                if t not in seen:
                    seen.add(t)
                    work.append(t)
        self.reachable = seen

    def _target_block(self, i: int) -> int | None:
        target = self._target_of.get(i)
        k = self._index.get(target) if target is not None else None
        return self._block_of_first.get(k) if k is not None else None

    def block_end(self, b: int) -> int:
        """The address where block ``b`` ends (the next one's start, or the function's end)."""
        nb = len(self.firsts)
        return self.addresses[self.firsts[b + 1]] if b + 1 < nb else self.end

    # --- what the planner needs ------------------------------------------------------------
    def code_end(self) -> int:
        """Where the function's code ends: before its trailing blocks of filler no path
        reaches (SiteFacts._extent's rule on the CFG)."""
        quick = self._code_end_quick()
        if quick is not None:
            return quick
        code_end = self.end
        firsts, nb = self.firsts, len(self.firsts)
        for b in range(nb - 1, -1, -1):
            lo, hi = firsts[b], firsts[b + 1] if b + 1 < nb else self.count
            block_start = self.addresses[lo]
            if (block_start < code_end and self.block_end(b) >= code_end and b not in self.reachable
                    and all(self._filler(k) for k in range(lo, hi))):
                code_end = block_start
            else:
                break
        if code_end == self.start:
            code_end = self.end
        return code_end

    def _code_end_quick(self) -> int | None:
        """code_end without the blocks, where the answer is plain: no filler at the end
        (the end), or a run of filler after an instruction that does not fall through,
        which no jump leads into (where the run starts).  None: ask the blocks."""
        count, flows = self.count, self._flows
        t = count
        while t > 0 and self._filler(t - 1):
            t -= 1
        if t == count:
            return self.end
        if t == 0 or flows[t - 1] not in _NO_FALLTHROUGH:
            return None
        start = self.addresses[t]
        if any(start <= target < self.end for i, target in self._target_of.items()
               if flows[i] == _JMP or flows[i] == _JCC):
            return None
        return start

    def branch_targets(self) -> frozenset[int]:
        """The entry, every direct jump's target, and every block start an edge other
        than a fall-through leads to (after a jcc or a call): SiteFacts' rule."""
        out = {self.start}
        addresses, flows, end = self.addresses, self._flows, self.end
        for i, target in self._target_of.items():
            flow = flows[i]
            if flow == _JMP or flow == _JCC:
                out.add(target)
            if flow == _JCC or flow == _CALL:
                nxt = addresses[i + 1] if i + 1 < self.count else end
                if nxt < end:
                    out.add(nxt)
        for i, flow in enumerate(flows):
            if flow == _CALLI:
                nxt = addresses[i + 1] if i + 1 < self.count else end
                if nxt < end:
                    out.add(nxt)
        return frozenset(out)

    def misaligned(self) -> bool:
        """Whether a direct jump leads inside the function but to no instruction's start."""
        # the jumps' targets that are no instruction's start, as sets (the blocks,
        # _index, are not made): those outside the function are its jumps out
        jumps = bytes(map(self._flows.__getitem__, self._with_target)).translate(_IS_JUMP)
        off = set(compress(self._comp.targets, jumps)).difference(self.addresses)
        start, end = self.start, self.end
        return any(start <= t < end for t in off)

    # --- liveness (ksim.analysis.liveness's rules, on masks) --------------------------------
    def live_before(self, address: int) -> frozenset[str]:
        """Registers live just before the instruction at ``address``."""
        i = self._index[address]
        live_in = self._solve()
        b = bisect.bisect_right(self.firsts, i) - 1
        lo = self.firsts[b]
        if i == lo:
            return _names(live_in[b])
        hi = self.firsts[b + 1] if b + 1 < len(self.firsts) else self.count
        live = self._block_out(b, live_in)
        for k in range(hi - 1, i - 1, -1):
            every, kill, gen = self._affine(k, k == hi - 1)
            live = (gen if every else (live & ~kill) | gen) | self._sp
        return _names(live)

    def live_head(self, count: int) -> list[frozenset[str]]:
        """The registers live before each of the function's first ``count``
        instructions (what a batch asks of its entries): found forward from the last
        of them (_live_ahead: a search from there ends within a few blocks, where the
        solve walks every one), and each one before it that only falls through (a
        plain instruction) by its own effects, as _solve's rule (once the whole
        function is solved: by it)."""
        count = min(count, self.count)
        if self._live_in is not None:
            return [self.live_before(a) for a in self.addresses[:count]]
        masks = [0] * count
        flows, sp = self._flows, self._sp
        for j in range(count - 1, -1, -1):
            if j + 1 < count and flows[j] == _SEQ:
                reads, writes = self._effects(j)
                masks[j] = (masks[j + 1] & ~writes) | reads | sp
            else:
                masks[j] = self._live_ahead(j)
        return [_names(m) for m in masks]

    def _live_ahead(self, start: int) -> int:
        """The mask live before instruction ``start``, by the rules _solve applies,
        found forward: a register is live if some path from ``start`` reads it (or
        leaves the function with it live) before it is written.  Each register's
        answer is independent of the others', so a path is followed only for the
        registers neither known live nor written on it yet, and an instruction only
        for those it was not followed for already: the search ends once every
        register is settled, mostly after the prologue and the first call."""
        addresses, count, flows, target_of = self.addresses, self.count, self._flows, self._target_of
        effects, sp = self._effects, self._sp
        live = sp
        followed: dict[int, int] = {}
        work = [(start, self._all & ~sp)]
        while work:
            i, open_ = work.pop()
            while True:
                open_ &= ~live & ~followed.get(i, 0)
                if not open_:
                    break
                followed[i] = followed.get(i, 0) | open_
                flow = flows[i]
                if flow == _SEQ:
                    reads, writes = effects(i)
                    live |= reads & open_
                    open_ &= ~writes
                    if i + 1 < count:
                        i += 1
                        continue
                    live |= self._all & open_   # off the function's end
                    break
                every, kill, gen = self._affine(i, True)
                live |= gen & open_
                if every:
                    break
                open_ &= ~kill
                nxt = i + 1 if i + 1 < count else None
                if flow == _CALL or flow == _CALLI:
                    if nxt is None:
                        live |= self._all & open_
                        break
                    i = nxt
                    continue
                if flow == _JMP or flow == _JCC:
                    target = target_of.get(i)
                    k = bisect.bisect_left(addresses, target) if target is not None else count
                    inside = target is not None and k < count and addresses[k] == target
                    if target is not None and not inside:
                        live |= self._leaving(target) & open_
                    if flow == _JCC and nxt is not None and not (inside and k == nxt):
                        if inside:
                            work.append((k, open_))
                        i = nxt
                        continue
                    if inside:
                        i = k
                        continue
                break   # a return, a stop, an indirect jump: nothing after it
        return live

    def _classify(self, target: int) -> Target:
        found = self._classified.get(target)
        if found is None:
            found = self._classified[target] = self._classify_fn(target)
        return found

    def _solve(self) -> list[int]:
        if self._live_in is not None:
            return self._live_in
        firsts, lasts = self.firsts, self._lasts
        nb = len(firsts)
        masks, codes, sp = self._effect_masks, self._codes, self._sp
        summaries = []
        for b in range(nb):
            lo, last = firsts[b], lasts[b]
            # the last instruction may transfer; the ones before it are plain sequence
            every, kill, gen = self._affine(last, True)
            gen |= sp
            for k in range(last - 1, lo - 1, -1):
                reads, writes = masks[codes[k] >> EFFECT_SHIFT]
                kill |= writes
                gen = (gen & ~writes) | reads | sp
            summaries.append((every, kill, gen))
        exits = [0 if summaries[b][0] else self._exits(b) for b in range(nb)]
        live_in = [0] * nb
        succs, preds = self.succs, self.preds
        work = list(range(nb))
        queued = set(work)
        while work:
            b = work.pop()
            queued.discard(b)
            every, kill, gen = summaries[b]
            if every:
                new = gen
            else:
                out = exits[b]
                for t in succs[b]:
                    out |= live_in[t]
                new = (out & ~kill) | gen
            if new != live_in[b]:
                live_in[b] = new
                for p in preds[b]:
                    if p not in queued:
                        queued.add(p)
                        work.append(p)
        self._live_in = live_in
        return live_in

    def _block_out(self, b: int, live_in: list[int]) -> int:
        out = self._exits(b)
        for s in self.succs[b]:
            out |= live_in[s]
        return out

    def _exits(self, b: int) -> int:
        nb = len(self.firsts)
        last = self._lasts[b]
        flow = self._flows[last]
        if flow == _RET or flow == _STOP:
            return 0
        if flow == _JMP or flow == _JCC:
            target = self._target_of.get(last)
            if target is not None and self._target_block(last) is None:
                return self._leaving(target)
            return 0
        if flow == _CALL or flow == _CALLI:
            return self._all if b + 1 >= nb else 0
        if flow == _SEQ and not self.succs[b]:
            return self._all
        return 0

    def _leaving(self, target: int) -> int:
        if self.start <= target < self.end:
            return self._all
        what = self._classify(target)
        if what.kind is TargetKind.FUNCTION:
            clobbers = _mask(what.clobbers) if what.clobbers is not None else self._all
            return self._at_tail_call | (self._ret & ~clobbers)
        if what.kind is TargetKind.RETURN:
            return self._at_return
        if what.kind is TargetKind.THUNK and what.reg:
            return self._at_tail_call | _mask({what.reg})
        return self._all

    def _affine(self, i: int, last: bool) -> tuple[bool, int, int]:
        flow = self._flows[i]
        reads, writes = self._effects(i)
        if flow == _RET:
            return True, 0, self._at_return | reads
        if flow == _STOP:
            return True, 0, self._all
        if flow == _CALL or flow == _CALLI:
            if not last:
                return True, 0, self._all
            if flow == _CALL:
                what = self._classify(self._target_of[i])
                extra = 0
                if what.kind is TargetKind.FUNCTION:
                    if what.clobbers is not None:
                        return False, self._caller_saved & _mask(what.clobbers), self._at_call | reads
                elif what.kind is TargetKind.THUNK and what.reg:
                    extra = _mask({what.reg})
                else:
                    return True, 0, self._all
            else:
                if not self._standard_indirect(self.insns[i]):
                    return True, 0, self._all
                extra = 0
            return False, self._caller_saved, self._at_call | reads | extra
        return False, writes, reads


#: one-byte filler instructions after a function's last decoded one that a view keeps
#: as instructions: a kallsyms extent can run over a megabyte of int3 up to the next
#: symbol (``__kprobes_text_end``, ``srso_alias_safe_ret``), which as one block each
#: is seconds of work; no point looks further than a window's spill or a springboard's
#: reach into it.  A jump into the filler past them leaves the view to the objects.
TAIL_KEPT = 4096


def view(support: ArchSupport, code: bytes, comp: Compact, classify: Classify,
         standard_indirect: Callable[[Insn], bool], preserved: frozenset[str]) -> RecordView | None:
    """The view of a function from its record, or None when the object path must
    answer (see the module's doc)."""
    if comp.tables:
        return None
    pad = comp.start + sum(comp.sizes)
    if pad + comp.tail != comp.end or comp.start == comp.end:
        return None  # bytes that do not decode, or no instruction at all
    if comp.tail and comp.tail_code & (FLOW_MASK | FILLER_BIT) != _STOP | FILLER_BIT:
        return None
    kept = min(comp.tail, TAIL_KEPT)
    flows = bytes(map(FLOW_MASK.__and__, comp.codes)) + bytes([comp.tail_code & FLOW_MASK]) * kept
    if _JMPI in flows:
        return None
    if kept < comp.tail and any(pad + kept <= t < comp.end for t in comp.targets):
        return None  # a jump into the filler not kept
    return RecordView(support, code, comp, flows, classify, standard_indirect, preserved)
