"""The architecture contract.

Generic code (analysis, snippets, splice) reaches an architecture only through
:class:`Arch` and the plain data types here.  One package per architecture
implements it (``ksim.arch.x86_64``); generic code never asks which one it has.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ksim.core import KernelABI
    from ksim.machine.boards import Board
    from ksim.snippets.ast import Snippet


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


@dataclass(frozen=True)
class CallConvention:
    """The kernel's calling convention on an architecture, as analysis sees it.

    Each architecture holds exactly one (``Arch.convention``); the argument and
    return registers the snippet code generator uses are read from it too.

    The stack pointer is kept apart from ``callee_saved``.  The ABI preserves it
    across calls (``preserved_across_calls`` says so), but not as it preserves the
    others, which a callee saves before use and restores: a callee's pushes and
    pops balance, so it returns with the stack pointer where the call left it,
    having written it all along.  The analyses treat it as always live (read by
    every call, return and tail call) and never as a clobber, whatever a
    function's pushes write: that is what ``stack_reg`` is for.
    """

    #: registers that carry arguments, in order (live before every call, tail call)
    arg_regs: tuple[str, ...]
    #: registers that carry return values, a one-word value in the first (live at
    #: every return)
    ret_regs: tuple[str, ...]
    #: registers a callee saves before using them and restores (live at every
    #: return and tail call); the stack pointer is not one of them (see above)
    callee_saved: frozenset[str]
    #: the stack pointer (always live; never a clobber)
    stack_reg: str
    #: every register liveness tracks
    all_regs: frozenset[str]
    #: callees that do not follow the convention (custom register interfaces):
    #: a call to one of them is treated as reading every register
    special_callee: re.Pattern[str]
    #: symbols whose indirect calls use a custom convention (e.g. paravirt ops)
    special_call_table: re.Pattern[str]
    #: calls/jumps to these thunks are indirect calls/jumps through the named register
    #: (retpolines); group 1 is the register
    indirect_thunk: re.Pattern[str]
    #: a jump to one of these is a return (return thunks)
    return_thunk: re.Pattern[str]
    #: the register a call leaves the return address in (None: on the stack, as on
    #: x86-64): live at every return and tail call, whatever the function wrote to
    #: it before (AArch64: x30, restored from the frame before a tail call's B;
    #: the callee returns through it)
    link_reg: str | None = None

    @property
    def ret_reg(self) -> str:
        """The register a one-word return value is in."""
        return self.ret_regs[0]

    @property
    def preserved_across_calls(self) -> frozenset[str]:
        """What the ABI preserves across a call: the callee-saved registers and the
        stack pointer."""
        return self.callee_saved | {self.stack_reg}

    @property
    def caller_saved(self) -> frozenset[str]:
        """What a call may change: everything but the callee-saved registers and the stack."""
        return self.all_regs - self.preserved_across_calls

    @property
    def _link(self) -> frozenset[str]:
        return frozenset({self.link_reg}) if self.link_reg else frozenset()

    @property
    def at_return(self) -> frozenset[str]:
        return frozenset(self.ret_regs) | self.preserved_across_calls | self._link

    @property
    def at_tail_call(self) -> frozenset[str]:
        return frozenset(self.arg_regs) | self.preserved_across_calls | self._link

    def at_call(self) -> frozenset[str]:
        return frozenset(self.arg_regs) | {self.stack_reg}


@dataclass(frozen=True)
class StackABI:
    """How the kernel's own unwinder is started from a point, as data (what a trace
    program's ``kstack`` asks of it, ksim.trace.compiler).

    ``save`` is the kernel function that unwinds from a ``struct pt_regs`` into a
    buffer (Linux's ``stack_trace_save_regs(regs, store, size, skipnr)``, returning
    the frames stored); ``registers`` names the ``struct pt_regs`` members the
    unwinder reads (BTF member paths, ``regs.29`` for an array's element) and what
    each holds at the point: "point" its address, or a register's value there.
    """

    save: str
    registers: tuple[tuple[str, str], ...]
    #: the bytes between two scratch slots of a snippet's Frame (what LocalAddress
    #: buffers are made of): 8 on x86-64, 16 on AArch64, where sp stays 16-aligned
    slot_bytes: int = 8


@dataclass(frozen=True)
class SyscallABI:
    """How the kernel hands a system call to its handler on an architecture, as
    data (what ``tracepoint:syscalls:*`` reads, ksim.trace.tracepoints).

    The handler of system call ``NAME`` is the wrapper ``wrapper_prefix + NAME``
    (``SYSCALL_DEFINEn`` makes it), called with one argument, the ``const struct
    pt_regs *`` of the call; the call's argument ``i`` is the 8 bytes at
    ``arg_offsets[i]`` in that ``struct pt_regs``, as the architecture's
    ``syscall_get_arguments()`` reads them.
    """

    wrapper_prefix: str
    arg_offsets: tuple[int, ...]


# --- bulk decoding: the scans an architecture may offer analyses of a whole kernel --------
#: (address, size, flow, direct target) per instruction: control flow without the
#: cost of register effects
FlowScan = Callable[[bytes, int], Iterator[tuple[int, int, Flow, int | None]]]

#: The facts of a linear sweep in bulk, for analyses of a whole kernel:
#: ``(sizes, codes, targets, tail, tail_code)``.  ``sizes`` holds one byte per decoded
#: instruction; ``codes`` one int per instruction packed as :data:`FLOW_MASK` (index
#: into :data:`FLOWS`) | :data:`FILLER_BIT` (alignment filler, ``Arch.is_filler``) |
#: :data:`TARGET_BIT` (has a direct target) | effects << :data:`EFFECT_SHIFT` (index
#: into the scan's ``effects`` table of (reads, writes)); ``targets`` the direct
#: targets of the instructions that have one, in order.  ``tail`` one-byte padding
#: instructions of code ``tail_code`` follow the decoded ones (0 when none): a scan
#: need not decode the padding that ends most kernel functions.  The sweep stops
#: where ``decode`` would.
CodeScan = Callable[[bytes, int], tuple[bytes, Sequence[int], Sequence[int], int, int]]
#: a CodeScan of many functions ``(code, address)`` at once: (sizes of each, codes of
#: all in order, targets of all in order, tail of each, tail code)
CodeScanMany = Callable[[Sequence[tuple[bytes, int]]],
                        tuple[list[bytes], Sequence[int], Sequence[int], list[int], int]]
Effects = Sequence[tuple[frozenset[str], frozenset[str]]]
#: the instructions a scan found, as objects: (code, address, sizes, codes, targets,
#: effects) -> instructions, stopping at the first whose size differs from the scan's
Rebuild = Callable[[bytes, int, bytes, Sequence[int], Sequence[int], Effects], list[Insn]]
#: an architecture's bulk scan: the scan, of many functions, the rebuilding of
#: instructions from one, and the effects table its codes index (which grows as
#: new effects are met)
CodeScans = tuple[CodeScan, CodeScanMany, Rebuild, Effects]

FLOWS: tuple[Flow, ...] = tuple(Flow)
FLOW_MASK = 0b111
FILLER_BIT = 1 << 3
TARGET_BIT = 1 << 4
EFFECT_SHIFT = 5


# --- jump tables: what generic recovery (ksim.analysis.cfg) asks an architecture -----------
@dataclass(frozen=True, slots=True)
class TableRead:
    """An instruction that reads an entry of a jump table: the ``entry_size`` bytes
    at ``table + index * entry_size``, into the register ``dest`` (a load whose
    value a later indirect jump goes to), or straight into the program counter
    (``dest`` None: the indirect jump itself reads the table)."""

    index: str
    table: int
    entry_size: int
    dest: str | None = None


@dataclass(frozen=True, slots=True)
class BoundCheck:
    """An unsigned bound check on a would-be table index: the comparison at
    ``address`` of the low ``bits`` of register ``reg`` (None: all of it) with
    ``limit``, and the conditional branch after it, which lets only indexes below
    ``entries`` through on the path checked."""

    address: int
    reg: str
    bits: int | None
    limit: int
    entries: int


class JumpTableIdioms(Protocol):
    """How compilers for an architecture turn a switch into a jump table, as
    questions about single instructions.  The walk over blocks, the tracking of
    the index back to its bound check and the reading of the table are generic
    (``ksim.analysis.cfg``)."""

    def table_read(self, insn: Insn) -> TableRead | None:
        """The table entry ``insn`` reads, when it is an indirect jump through a
        table or a load of a table entry into a register."""
        ...

    def jump_reg(self, insn: Insn) -> str | None:
        """The register the indirect jump ``insn`` goes to (None: it is no jump
        through a register)."""
        ...

    def bound_check(self, insns: Sequence[Insn], taken: bool) -> BoundCheck | None:
        """The bound check that the conditional branch ending ``insns`` (a block)
        makes on the path where it is ``taken`` (or falls through)."""
        ...

    def copy_source(self, insn: Insn, reg: str) -> tuple[str, int | None] | None:
        """When ``insn`` copies a register into ``reg`` (whole, or zero-extended):
        the register copied and how many of its low bits (None: all); None for any
        other write of ``reg``."""
        ...

    def table_targets(self, read: TableRead, raw: bytes) -> tuple[int, ...]:
        """The destinations the table entries ``raw`` (read at ``read.table``) name, in order."""
        ...


# --- components: how C code is built and linked for an architecture (ksim.components) ----
@dataclass(frozen=True, slots=True)
class Relocation:
    """One ELF relocation type, as data: what value it computes and where it puts it.

    X = S + A, less P when ``pcrel``; with ``page``, Page(S + A) - Page(P) (4 KB
    pages: AArch64's ADRP).  X must lie in ``range`` (None: no check, the "_NC"
    kinds) and be a multiple of 2**``shift``; then ``bits`` bits of X from bit
    ``shift`` up are stored: as a little-endian ``size``-byte datum when ``fields``
    is empty, else into the ``size``-byte instruction word, low bits first, in its
    ``fields`` ((lowest bit, width) each; a field wider than what is left of the
    value is zero-filled).
    """

    name: str
    size: int
    bits: int
    shift: int = 0
    pcrel: bool = False
    page: bool = False
    range: tuple[int, int] | None = None
    fields: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ComponentToolchain:
    """How components (``ksim.components``) are built for an architecture: the C
    compiler and the kernel's code generation flags, and the relocation types a
    relocatable object built so carries (anything else is refused)."""

    #: the C compiler (a program on PATH) and the Debian package that installs it
    compiler: str
    package: str
    cflags: tuple[str, ...]
    #: pyelftools' e_machine of the objects it produces
    elf_machine: str
    #: ELF relocation type number -> how to apply it
    relocations: dict[int, Relocation]


@dataclass(frozen=True)
class GdbRegisters:
    """The register file as a gdbstub (QEMU's) lays it out: the qSupported
    ``xmlRegisters`` hint, and the 'g' packet's layout, (name, bytes) in order,
    used when the stub serves no target.xml."""

    xml_arch: str
    layout: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ModuleLoader:
    """How the kernel loads a relocatable module (``ET_REL``) of an architecture, as
    far as ``ksim.image.elf`` follows it: where the module area lies (the sections
    of a .ko are laid out from ``base``) and the relocation types
    ``apply_relocate_add`` applies to the tables the image loader reads."""

    base: int
    relocations: dict[int, Relocation]


@dataclass(frozen=True)
class DifferentialRules:
    """What a faithful run of kernel code in unicorn (``ksim.differential``) must stop
    at, or treat apart, on an architecture."""

    #: mnemonics that are no business of the function, or not deterministic (time
    #: stamps, random numbers, port I/O, system registers, ...): they end a run
    forbidden: frozenset[str]
    #: operands that make any instruction the machine's (control registers, ...)
    forbidden_operands: re.Pattern[str]
    #: mnemonics that write below the stack pointer and then move it over what they
    #: wrote (any other write below the stack pointer is to dead stack)
    pushing: frozenset[str]
    #: mnemonics that load the status register from memory, and the trace bit such
    #: a load may set (kernel code never single-steps itself)
    status_loads: frozenset[str]
    trace_bit: int
    #: the mnemonic prefix of instructions unicorn's code hook sees once per
    #: iteration (x86-64: rep; "": none)
    repeat_prefix: str
    #: first bytes that mark a prefixed instruction (prefixes a relocator must keep:
    #: points a splice gets wrong most easily)
    prefix_bytes: frozenset[int]
    #: operands of an instruction that writes below the stack pointer and moves it
    #: over what it wrote, whatever its mnemonic (AArch64: a pre-indexed store with
    #: writeback to sp, ``stp x29, x30, [sp, #-0x30]!``)
    pushing_operands: re.Pattern[str] = re.compile(r"(?!)")
    #: where a call leaves its return address: a register (AArch64: the link
    #: register x30, which a return branches through), or None: on top of the
    #: stack, ``stack_slot`` bytes a return pops (x86-64)
    link_reg: str | None = None
    stack_slot: int = 8
    #: the stack pointer's alignment at a call (AArch64: 16, which SP-based
    #: accesses check)
    stack_align: int = 8
    #: whether the per-cpu register holds an offset that code adds to a per-cpu
    #: variable's link-time address (AArch64: TPIDR_EL1, ``__my_cpu_offset``)
    #: rather than the base of this CPU's area (x86-64: the GS base)
    percpu_offset: bool = False
    #: the system register that holds the current task (AArch64: SP_EL0, which
    #: ``get_current`` reads), or None: current is per-cpu data (x86-64)
    current_reg: str | None = None
    #: mnemonics that leave the status flags undefined, where unicorn leaves them
    #: as the last instruction that defined them did (x86-64: div and idiv):
    #: flags they leave are not compared
    undefined_status: frozenset[str] = frozenset()
    #: unicorn's CPU model for the runs (None: unicorn's default); AArch64: the
    #: one with every architecture extension, LSE atomics among them, which
    #: kernel code uses where the CPU has them
    cpu_model: int | None = None


@dataclass(frozen=True)
class Emulation:
    """The CPU as unicorn emulates it and capstone reads it, as plain data: what the
    toy kernel's machines (``ksim.machine``) and the differential runner
    (``ksim.differential``) need so that neither names a register or an opcode.

    Register names are the lower-case names capstone, gdb and the reader use;
    ``regs`` maps every one unicorn knows to unicorn's id.
    """

    uc_arch: int
    uc_mode: int
    cs_arch: int
    cs_mode: int
    #: register name -> unicorn's id
    regs: Mapping[str, int]
    #: the general-purpose registers, the stack pointer among them, in the order a
    #: run seeds and compares them
    gprs: tuple[str, ...]
    #: the program counter and the stack pointer
    pc: str
    sp: str
    #: the register holding the status flags, its bits by name, its value at reset,
    #: and the bits the kernel's ABI keeps clear in C code (x86-64: DF)
    status_reg: str
    status_bits: Mapping[str, int]
    status_reset: int
    status_clear: frozenset[str]
    #: the register that holds this CPU's per-cpu base (what snippets call "gs")
    percpu_reg: str
    #: unicorn's interrupt number for the trap instruction, and how far past the
    #: trap the program counter is when it is reported (x86-64: int3 is vector 3,
    #: RIP past it; AArch64: BRK is EXCP_BKPT, PC on it)
    breakpoint_vector: int
    breakpoint_pc_offset: int
    #: the interrupts that are the CPU's answer to a failed TLB fill (page faults)
    fault_vectors: frozenset[int]
    #: the longest instruction; unicorn reports a size beyond it for an instruction
    #: it does not emulate
    max_insn_size: int
    #: the instruction Linux's BUG() and WARN() compile to (handle_bug finds its
    #: site in __bug_table)
    bug_insn: bytes
    #: the toy kernel's machine around this CPU in unicorn (its devices)
    board: type[Board]
    #: what a differential run needs besides (None: ksim.differential does not run
    #: this architecture's code)
    differential: DifferentialRules | None = None

    @property
    def status_mask(self) -> int:
        """The status flags' bits in ``status_reg``."""
        return sum(1 << bit for bit in self.status_bits.values())

    @property
    def status_clear_mask(self) -> int:
        return sum(1 << self.status_bits[name] for name in self.status_clear)


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
    #: the kernel's calling convention: the one table of argument, return and
    #: preserved registers
    convention: CallConvention
    #: registers that carry the first arguments, in order; and the return value
    #: register (the convention's)
    arg_regs: tuple[str, ...]
    ret_reg: str
    #: every general-purpose register, plus "flags" (the convention's)
    all_regs: frozenset[str]
    #: the program counter's register name (x86-64: rip)
    pc_reg: str
    #: the name instructions' register effects give the status flags (x86-64:
    #: flags; AArch64: nzcv)
    flags_reg: str
    #: how C components are compiled and linked for this architecture (None: they
    #: are not available on it)
    component_toolchain: ComponentToolchain | None
    #: how the kernel loads this architecture's modules (None: ksim does not load
    #: relocatable modules of it)
    module_loader: ModuleLoader | None
    #: the register file as QEMU's gdbstub lays it out
    gdb: GdbRegisters
    #: how a system call reaches its handler (the wrappers' names, pt_regs' layout)
    syscalls: SyscallABI
    #: how the kernel's unwinder starts from a point (kstack)
    stack: StackABI

    @property
    def emulation(self) -> Emulation:
        """The CPU as unicorn and capstone see it (see Emulation)."""
        ...

    @property
    def jump_tables(self) -> JumpTableIdioms:
        """How switch statements become jump tables (see JumpTableIdioms)."""
        ...

    def decode(self, code: bytes, address: int) -> Iterator[Insn]:
        """Linear sweep; stops at the first undecodable byte."""
        ...

    def decode_one(self, code: bytes, address: int) -> Insn:
        """Decode exactly one instruction or raise DecodeError."""
        ...

    def flow_scan(self) -> FlowScan | None:
        """A control-flow-only sweep faster than ``decode``, where the architecture
        has one (None: generic code derives one from ``decode``)."""
        ...

    def code_scan(self) -> CodeScans | None:
        """The bulk scan of whole kernels (see CodeScan), where the architecture has
        one (None: generic code derives one from ``decode``)."""
        ...

    def prepare(self) -> None:
        """Load the modules decoding, scanning, relocating and emitting code use
        (each is loaded when first used otherwise): a client waiting on a remote
        kernel's answer loads them then."""
        ...

    def is_filler(self, insn: Insn) -> bool:
        """Whether ``insn`` is alignment filler (x86-64: any nop, int3): padding that
        is no work of the function."""
        ...

    def trap_with(self, immediate: int | None) -> bytes:
        """The trap instruction carrying ``immediate`` where the architecture's has one
        (AArch64: BRK #imm16, the number a kernel's break hooks dispatch on); None,
        or an architecture whose trap has none (x86-64's int3): ``trap``."""
        ...

    def is_breakpoint(self, insn: Insn) -> bool:
        """Whether ``insn`` is a breakpoint (the trap instruction, in any encoding):
        someone's probe, never to be moved or overwritten."""
        ...

    def in_exclusive_sequence(self, insns: Sequence[Insn], index: int) -> bool:
        """Whether ``insns[index]`` (consecutive instructions of one function) lies
        between a load-exclusive and its store-exclusive, the store included: code
        run before it (a branch to a patch, the snippets' memory accesses, a trap's
        exception return) may clear the exclusive monitor, and the store would
        then fail on every retry of its loop.  x86-64 has no such sequences."""
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

        PC-relative operands, relative jumps and jcc are fixed up (growing short
        forms to long ones as needed); a branch to another instruction of the run
        goes to its copy, except that a branch to the first one goes to
        ``first_to`` when given.  A call always leaves the original return address:
        the run's last call is moved as ``moved_call`` writes it, a call to the next
        instruction becomes the address alone, and any other call with instructions
        after it is refused (CallInsideRun).  Raises RelocationError when that is
        impossible.  The result's length may differ from the input's.
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


# --- what every relocator checks first -----------------------------------------------
def check_consecutive(insns: Sequence[Insn]) -> None:
    """RelocationError unless each instruction of ``insns`` starts where the one
    before it ends (a run of the function's code)."""
    from ksim.errors import RelocationError

    for a, b in zip(insns, insns[1:], strict=False):
        if a.end != b.address:
            raise RelocationError(f"instructions not consecutive: {a} then {b}")


def check_relocation_arguments(insns: Sequence[Insn], **addresses: int | None) -> None:
    """BadArgument, before anything is encoded, unless ``insns`` is a sequence of
    Insn (from decode) and each address is an int from 0 to 2**64-1 (``first_to``
    may be None)."""
    from ksim.errors import BadArgument

    if not isinstance(insns, Sequence) or not all(isinstance(i, Insn) for i in insns):
        raise BadArgument(f"a relocation takes a sequence of Insn (from decode), not {insns!r:.80}")
    for what, address in addresses.items():
        if address is None and what == "first_to":
            continue
        if type(address) is not int or not 0 <= address < 1 << 64:
            raise BadArgument(f"a relocation's {what} must be an int from 0 to 2**64-1, "
                              f"not {address!r:.80}")
