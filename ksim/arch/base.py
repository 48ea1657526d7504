"""The architecture contract.

Generic code (analysis, snippets, splice) reaches an architecture only through
:class:`Arch` and the plain data types here.  One package per architecture
implements it (``ksim.arch.x86_64``); generic code never asks which one it has.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ksim.snippets.ast import Snippet
    from ksim.targets.base import KernelABI


class Flow(enum.Enum):
    """How an instruction affects control flow (what the CFG builder needs)."""

    SEQ = "seq"                  # falls through only
    JMP = "jmp"                  # direct unconditional jump (target set)
    JCC = "jcc"                  # direct conditional jump (target set), falls through too
    JMP_INDIRECT = "jmp*"        # jmp through register/memory (jump table or tail call)
    CALL = "call"                # direct call (target set)
    CALL_INDIRECT = "call*"      # call through register/memory
    RET = "ret"                  # return
    STOP = "stop"                # never falls through: hlt, ud2, int3, iret, sysret, ...


@dataclass(frozen=True, slots=True)
class Insn:
    """One decoded instruction, architecture-neutral enough for generic code."""

    address: int
    size: int
    raw: bytes
    mnemonic: str
    op_str: str
    flow: Flow = Flow.SEQ
    #: destination of a direct jmp / jcc / call
    target: int | None = None
    #: absolute address a PC-relative memory operand refers to (None if there is none)
    pc_ref: int | None = None
    #: registers read and written (canonical full-width names, e.g. "rax", "flags")
    reads: frozenset[str] = field(default_factory=frozenset)
    writes: frozenset[str] = field(default_factory=frozenset)

    @property
    def end(self) -> int:
        return self.address + self.size

    def __str__(self) -> str:
        return f"{self.address:#x}: {self.mnemonic} {self.op_str}".rstrip()


@dataclass(frozen=True, slots=True)
class CallOperand:
    """Where an indirect call takes its destination from (plain data, decoded by
    the architecture): the register ``reg``, or the ``size`` bytes in memory at
    ``segment:[base + index*scale + disp]``.  A PC-relative operand has no base
    and ``disp`` is the absolute address it refers to."""

    reg: str | None = None
    base: str | None = None
    index: str | None = None
    scale: int = 1
    disp: int = 0
    size: int = 8
    segment: str | None = None

    @property
    def in_memory(self) -> bool:
        return self.reg is None

    def __str__(self) -> str:
        if self.reg is not None:
            return self.reg
        terms = [t for t in (self.base, f"{self.index}*{self.scale}" if self.index else None) if t]
        if self.disp or not terms:
            terms.append(f"{self.disp:#x}")
        seg = f"{self.segment}:" if self.segment else ""
        return f"{seg}[{' + '.join(terms)}]"


class Arch(Protocol):
    """What generic code may ask of an architecture (see ksim.arch.x86_64)."""

    name: str
    #: bytes of the breakpoint instruction (x86-64: int3 = cc)
    trap: bytes
    #: size of the long jump used to reach a patch (x86-64: jmp rel32 = 5)
    jmp_size: int
    #: size of the short jump used by springboards (x86-64: jmp rel8 = 2)
    short_jmp_size: int
    #: filler for unused bytes (x86-64: int3)
    pad_byte: int
    #: registers that carry the first arguments, in order; and the return value register
    arg_regs: tuple[str, ...]
    ret_reg: str
    #: every general-purpose register, plus "flags"
    all_regs: frozenset[str]
    #: registers a called function must preserve
    callee_saved: frozenset[str]

    def decode(self, code: bytes, address: int) -> Iterator[Insn]:
        """Linear sweep; stops at the first undecodable byte."""
        ...

    def decode_one(self, code: bytes, address: int) -> Insn:
        """Decode exactly one instruction or raise DecodeError."""
        ...

    def jmp(self, src: int, dst: int) -> bytes:
        """A jmp_size-byte jump at ``src`` to ``dst``; OutOfRange if it cannot reach."""
        ...

    def short_jmp(self, src: int, dst: int) -> bytes:
        """A short_jmp_size-byte jump at ``src`` to ``dst``; OutOfRange if it cannot reach."""
        ...

    def jmp_reaches(self, src: int, dst: int) -> bool: ...

    def short_jmp_reaches(self, src: int, dst: int) -> bool: ...

    def relocate(self, insns: Sequence[Insn], new_address: int, *,
                 first_to: int | None = None) -> bytes:
        """Re-encode ``insns`` (consecutive) to run at ``new_address`` with the same effect.

        PC-relative operands, relative jumps, jcc and calls are fixed up (growing
        short forms to long ones as needed); a branch to another instruction of the
        run goes to its copy, except that a branch to the first one goes to
        ``first_to`` when given.  Raises RelocationError when that is impossible.
        The result's length may differ from the input's.
        """
        ...

    def call_operand(self, insn: Insn) -> CallOperand | None:
        """Where the indirect call ``insn`` finds its destination; None when ``insn``
        is not an indirect call.  CallOperandError when the operand is one the
        snippet code cannot evaluate (a 32-bit address, say)."""
        ...

    def moved_call(self, insn: Insn, at: int) -> bytes:
        """Code at ``at`` with the effect of the call ``insn`` (direct or indirect)
        executed at its original address: the return address it leaves is the
        original ``insn.end``, so a patch holding a moved call can be freed while
        the callee still runs and unwinders see the original caller.
        RelocationError when that cannot be done."""
        ...

    def redirect_call(self, insn: Insn, to: int) -> bytes:
        """The direct call ``insn`` re-encoded in place (same length) to call ``to``;
        RelocationError when ``insn`` is no direct call or ``to`` is out of its reach."""
        ...

    def compile_snippets(
        self,
        snippets: Sequence[Snippet],
        address: int,
        *,
        live: frozenset[str],
        abi: KernelABI,
        point_kind: str = "entry",
        call_operand: CallOperand | None = None,
    ) -> bytes:
        """Machine code, to be placed at ``address``, that runs ``snippets`` in order
        and then falls through with every register in ``live`` (and the flags, when
        "flags" is live) exactly as it found them.  Deterministic: same input, same bytes.
        ``point_kind`` ("entry", "exit", "block", "callsite", "insn") decides which
        nodes are meaningful (Arg at entry, RetVal at exit); ``call_operand``, the
        operand of the indirect call at the point, gives CallTarget its meaning.
        """
        ...
