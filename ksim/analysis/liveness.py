"""Registers live before each instruction of a function (backward dataflow).

A register reported dead may be clobbered by instrumentation, so every
uncertainty resolves towards "live":

* at a call to a function that follows the calling convention: the argument
  registers and the stack pointer are read, and the caller-saved registers (and
  the flags) that the callee may write are clobbered (see ``clobbers``: gcc's
  -fipa-ra keeps values in caller-saved registers across calls that spare them);
* at a call to anything else (an assembly routine with its own register
  interface, a label that is not a function, a paravirt op): every register is live;
* at a return: the return registers, the callee-saved registers, the stack
  pointer, and every register the function never writes (``preserved``);
* at a tail call (a jump to another function's entry): the argument registers,
  the callee-saved registers, the stack pointer, ``preserved``, and the return
  registers the callee does not write (their values reach our caller);
* at any other flow out of the function (a jump into another function's middle
  or .cold part, an unrecovered indirect jump, a stop instruction, code running
  off the end): every register is live.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ksim.analysis.abi import CallConvention
from ksim.analysis.cfg import CFG, Block
from ksim.arch.base import Flow, Insn


class TargetKind(enum.Enum):
    FUNCTION = "function"     # entry of a function that follows the convention
    RETURN = "return"         # a return thunk: jumping there returns
    THUNK = "thunk"           # an indirect-branch thunk through a register
    UNKNOWN = "unknown"       # anything else


@dataclass(frozen=True, slots=True)
class Target:
    kind: TargetKind
    #: for THUNK: the register the branch goes through
    reg: str | None = None
    #: for FUNCTION: the registers a call to it may change (None: the convention's)
    clobbers: frozenset[str] | None = None


#: what an address outside the function is, as a branch or call destination
TargetClassifier = Callable[[int], Target]
#: whether an indirect call through this memory address follows the convention
IndirectCallClassifier = Callable[[Insn], bool]


def _memo(classify: TargetClassifier) -> TargetClassifier:
    """``classify`` asked once per target: the fixed point walks a block many times."""
    known: dict[int, Target] = {}

    def once(target: int) -> Target:
        found = known.get(target)
        if found is None:
            found = known[target] = classify(target)
        return found

    return once


class Liveness:
    """Live registers before and after every instruction of one function."""

    def __init__(self, cfg: CFG, convention: CallConvention, classify: TargetClassifier,
                 standard_indirect: IndirectCallClassifier = lambda insn: True,
                 preserved: frozenset[str] | None = None) -> None:
        self.cfg = cfg
        self.cc = convention
        #: live at every return and tail call on top of the convention's registers
        self.preserved = preserved if preserved is not None else convention.caller_saved
        self._at_return = convention.at_return | self.preserved
        self._at_tail_call = convention.at_tail_call | self.preserved
        self._classify = _memo(classify)
        self._standard_indirect = standard_indirect
        self._all = convention.all_regs
        # the convention's sets, made once (its properties build them on each use)
        self._caller_saved = convention.caller_saved
        self._at_call = convention.at_call()
        self._stack = frozenset({convention.stack_reg})
        self.live_in: dict[int, frozenset[str]] = {}
        self.before: dict[int, frozenset[str]] = {}
        self.after: dict[int, frozenset[str]] = {}
        self._solve()

    def live_at(self, address: int) -> frozenset[str]:
        """Registers live just before the instruction at ``address``."""
        self._record(address)
        return self.before[address]

    def live_after(self, address: int) -> frozenset[str]:
        self._record(address)
        return self.after[address]

    def _record(self, address: int) -> None:
        """Fill before/after for the block holding ``address`` (a point asks about one
        or two instructions of a function: the rest are never walked again)."""
        if address in self.before:
            return
        block = self.cfg.block_at(address)
        blocks = [block] if block is not None else self.cfg.blocks.values()
        for b in blocks:
            self._through(b, self.live_in, record=True)

    # --- the dataflow -----------------------------------------------------------------
    def _solve(self) -> None:
        """The fixed point over blocks.  Every instruction's transfer is ``(after -
        kill) | gen`` (or a constant: ``kill`` everything), so a block's is too, made
        once from its instructions (_summary); the iterations then cost a few set
        operations per block, not a walk of its instructions."""
        blocks = self.cfg.blocks
        live_in: dict[int, frozenset[str]] = {start: frozenset() for start in blocks}
        summaries = {start: self._summary(block) for start, block in blocks.items()}
        exits = {start: self._exits(blocks[start]) for start, (every, _, _) in summaries.items()
                 if not every}
        work = list(blocks)
        queued = set(work)
        while work:
            start = work.pop()
            queued.discard(start)
            every, kill, gen = summaries[start]
            if every:
                new = gen
            else:
                out = exits[start]
                for succ in blocks[start].succs:
                    out |= live_in[succ]
                new = (out - kill) | gen
            if new != live_in[start]:
                live_in[start] = new
                for pred in blocks[start].preds:
                    if pred not in queued:
                        queued.add(pred)
                        work.append(pred)
        self.live_in = live_in

    def _through(self, block: Block, live_in: dict[int, frozenset[str]], *, record: bool
                 ) -> frozenset[str]:
        if not block.insns:
            return self._all  # bytes that do not decode: nothing is known
        live = self._block_out(block, live_in)
        sp = self._stack
        for insn in reversed(block.insns):
            if record:
                self.after[insn.address] = live
            live = self._transfer(insn, live, block, live_in) | sp
            if record:
                self.before[insn.address] = live
        return live

    def _block_out(self, block: Block, live_in: dict[int, frozenset[str]]) -> frozenset[str]:
        """Live after the block's last instruction: successors plus flows out of the function."""
        out = self._exits(block)
        for succ in block.succs:
            out |= live_in[succ]
        return out

    def _exits(self, block: Block) -> frozenset[str]:
        """Live after the block's last instruction for its flows out of the function
        (what its successors need comes on top)."""
        last = block.insns[-1]
        flow = last.flow
        if flow is Flow.RET or flow is Flow.STOP:
            return frozenset()  # handled in _transfer (nothing after them is used)
        if flow in (Flow.JMP, Flow.JCC) and last.target is not None and last.target not in self.cfg.blocks:
            return self._leaving(last.target)
        if flow is Flow.JMP_INDIRECT and last.address not in self.cfg.tables:
            return self._all
        if flow in (Flow.CALL, Flow.CALL_INDIRECT):
            if block.end not in self.cfg.blocks:
                return self._all  # nothing known after a call at the function's end
        elif flow is Flow.SEQ and not block.succs:
            return self._all  # runs off the end of the function
        return frozenset()

    def _summary(self, block: Block) -> tuple[bool, frozenset[str], frozenset[str]]:
        """The block's transfer as (every, kill, gen): live before it is ``gen`` when
        ``every`` (nothing live after it matters), else ``(after - kill) | gen``.
        Composed backwards from its instructions' transfers (each one's, as
        _through applies it: the stack pointer always live)."""
        if not block.insns:
            return True, frozenset(), self._all  # bytes that do not decode: nothing is known
        every, kill, gen = False, frozenset[str](), frozenset[str]()
        for insn in reversed(block.insns):
            i_every, i_kill, i_gen = self._affine(insn, block)
            i_gen = i_gen | self._stack
            if i_every:
                every, kill, gen = True, frozenset(), i_gen
            else:
                kill, gen = kill | i_kill, (gen - i_kill) | i_gen
        return every, kill, gen

    def _affine(self, insn: Insn, block: Block) -> tuple[bool, frozenset[str], frozenset[str]]:
        """_transfer of ``insn`` as (every, kill, gen) (see _summary)."""
        flow = insn.flow
        if flow is Flow.RET:
            return True, frozenset(), self._at_return | insn.reads
        if flow is Flow.STOP:
            return True, frozenset(), self._all
        if flow is Flow.CALL or flow is Flow.CALL_INDIRECT:
            if insn is not block.insns[-1]:
                return True, frozenset(), self._all
            return self._call_affine(insn)
        return False, insn.writes, insn.reads

    def _leaving(self, target: int) -> frozenset[str]:
        """Live at a jump to ``target`` outside the function."""
        if self.cfg.start <= target < self.cfg.end:
            return self._all  # into the middle of an instruction of ours
        what = self._classify(target)
        if what.kind is TargetKind.FUNCTION:
            # what the callee leaves alone reaches our caller: return registers included
            passed = frozenset(self.cc.ret_regs) - (what.clobbers if what.clobbers is not None else self._all)
            return self._at_tail_call | passed
        if what.kind is TargetKind.RETURN:
            return self._at_return
        if what.kind is TargetKind.THUNK and what.reg:
            return self._at_tail_call | {what.reg}
        return self._all

    def _transfer(self, insn: Insn, after: frozenset[str], block: Block,
                  live_in: dict[int, frozenset[str]]) -> frozenset[str]:
        flow = insn.flow
        if flow is Flow.RET:
            return self._at_return | insn.reads
        if flow is Flow.STOP:
            return self._all  # a trap handler may read or resume with any register
        if flow is Flow.CALL or flow is Flow.CALL_INDIRECT:
            if insn is not block.insns[-1]:
                return self._all  # defensive: calls end blocks
            return self._call(insn, after)
        return (after - insn.writes) | insn.reads

    def _call(self, insn: Insn, after: frozenset[str]) -> frozenset[str]:
        every, kill, gen = self._call_affine(insn)
        return gen if every else (after - kill) | gen

    def _call_affine(self, insn: Insn) -> tuple[bool, frozenset[str], frozenset[str]]:
        """Live before a call, as (every, kill, gen) (see _summary)."""
        if insn.flow is Flow.CALL:
            assert insn.target is not None
            what = self._classify(insn.target)
            if what.kind is TargetKind.FUNCTION:
                extra: frozenset[str] = frozenset()
                if what.clobbers is not None:
                    killed = self._caller_saved & what.clobbers
                    return False, killed, self._at_call | insn.reads
            elif what.kind is TargetKind.THUNK and what.reg:
                extra = frozenset({what.reg})
            else:
                return True, frozenset(), self._all
        else:
            if not self._standard_indirect(insn):
                return True, frozenset(), self._all
            extra = frozenset()
        return False, self._caller_saved, self._at_call | insn.reads | extra
