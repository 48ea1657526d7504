"""What analysis needs to know about an architecture and the kernel's calling habits.

Analysis is generic; it reaches the decoder and the calling convention through
:func:`support_for` (keyed by ``Image.arch``), never by testing an architecture's
name itself.  Conventions are data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ksim.arch.base import Flow, Insn
from ksim.errors import UnsupportedImage


@dataclass(frozen=True)
class CallConvention:
    """The calling convention as liveness sees it."""

    #: registers that carry arguments (live before every call, tail call)
    arg_regs: tuple[str, ...]
    #: registers that carry return values (live at every return)
    ret_regs: frozenset[str]
    #: registers a callee must preserve (live at every return and tail call)
    callee_saved: frozenset[str]
    #: the stack pointer (always live)
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

    @property
    def caller_saved(self) -> frozenset[str]:
        """What a call may change: everything but the callee-saved registers and the stack."""
        return self.all_regs - self.callee_saved - {self.stack_reg}

    @property
    def at_return(self) -> frozenset[str]:
        return self.ret_regs | self.callee_saved | {self.stack_reg}

    @property
    def at_tail_call(self) -> frozenset[str]:
        return frozenset(self.arg_regs) | self.callee_saved | {self.stack_reg}

    def at_call(self) -> frozenset[str]:
        return frozenset(self.arg_regs) | {self.stack_reg}


# The System V AMD64 convention as the Linux kernel uses it (no red zone, no
# vector registers in kernel C code).  The special callees are assembly routines
# with their own register interfaces: __fentry__ / mcount (preserve everything),
# __get_user_* / __put_user_* (arch/x86/lib/getuser.S, putuser.S: pointer and
# value in rax/rcx/rdx, clobber almost nothing), copy/clear_user helpers
# (rep_movs_alternative: rcx/rsi/rdi), __sw_hweight* (preserve all but rax),
# __switch_to_asm, the thunk_*.S wrappers, and memcpy/memset variants patched
# by alternatives.
X86_64_LINUX = CallConvention(
    arg_regs=("rdi", "rsi", "rdx", "rcx", "r8", "r9"),
    ret_regs=frozenset({"rax", "rdx"}),
    callee_saved=frozenset({"rbx", "rbp", "r12", "r13", "r14", "r15"}),
    stack_reg="rsp",
    all_regs=frozenset({
        "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "flags",
    }),
    special_callee=re.compile(
        r"^(__fentry__|mcount|__mcount|__get_user_.*|__put_user_.*|__get_user_nocheck_.*"
        r"|__put_user_nocheck_.*|rep_movs_alternative|rep_stos_alternative|copy_user_.*"
        r"|clear_user_.*|__clear_user|__sw_hweight\d+|__switch_to_asm|.*_thunk(_\w+)?"
        r"|__memcpy|memcpy_orig|memcpy_erms|__memset|memset_orig|memset_erms"
        r"|__x86_indirect_.*|__x86_return_thunk|__x86_retpoline_.*|srso_.*|retbleed_.*"
        r"|__sanitizer_.*|__tsan_.*|__asan_.*|__kcsan_.*)$"
    ),
    special_call_table=re.compile(r"^(pv_ops|pv_.*_ops|paravirt_.*)$"),
    indirect_thunk=re.compile(r"^__x86_indirect_(?:call_|jump_)?thunk_(r\w+)$"),
    return_thunk=re.compile(r"^(__x86_return_thunk|srso_return_thunk|retbleed_return_thunk"
                            r"|srso_alias_return_thunk|__ret)$"),
)


#: architecture name (``Arch.name``) -> the kernel's calling convention on it
CONVENTIONS: dict[str, CallConvention] = {"x86_64": X86_64_LINUX}


#: (address, size, flow, direct target) per instruction: control flow without the
#: cost of register effects
FlowScan = Callable[[bytes, int], Iterator[tuple[int, int, Flow, int | None]]]

#: The facts of a linear sweep in bulk, for analyses of a whole kernel:
#: ``(sizes, codes, targets, tail, tail_code)``.  ``sizes`` holds one byte per decoded
#: instruction; ``codes`` one int per instruction packed as :data:`FLOW_MASK` (index
#: into :data:`FLOWS`) | :data:`FILLER_BIT` (alignment filler: nop, int3) |
#: :data:`TARGET_BIT` (has a direct target) | effects << :data:`EFFECT_SHIFT` (index
#: into the architecture's ``effects`` table of (reads, writes)); ``targets`` the
#: direct targets of the instructions that have one, in order.  ``tail`` one-byte
#: padding instructions of code ``tail_code`` follow the decoded ones (0 when none):
#: a scan need not decode the padding that ends most kernel functions.  The sweep
#: stops where ``decode`` would.
CodeScan = Callable[[bytes, int], tuple[bytes, Sequence[int], Sequence[int], int, int]]
#: a CodeScan of many functions ``(code, address)`` at once: (sizes of each, codes of
#: all in order, targets of all in order, tail of each, tail code)
CodeScanMany = Callable[[Sequence[tuple[bytes, int]]],
                        tuple[list[bytes], Sequence[int], Sequence[int], list[int], int]]
FLOWS: tuple[Flow, ...] = tuple(Flow)
FLOW_MASK = 0b111
FILLER_BIT = 1 << 3
TARGET_BIT = 1 << 4
EFFECT_SHIFT = 5
_FLOW_INDEX = {flow: i for i, flow in enumerate(FLOWS)}
_FILLERS = frozenset({"nop", "int3"})


def _x86_64_flows() -> FlowScan:
    from ksim.arch.x86_64.reader import flows

    return flows


Effects = Sequence[tuple[frozenset[str], frozenset[str]]]
#: the instructions a scan found, as objects: (code, address, sizes, codes, targets,
#: effects) -> instructions, stopping at the first whose size differs from the scan's
Rebuild = Callable[[bytes, int, bytes, Sequence[int], Sequence[int], Effects], list[Insn]]


def _x86_64_scan() -> tuple[CodeScan, CodeScanMany, Rebuild, Effects]:
    from ksim.arch.x86_64.reader import EFFECTS
    from ksim.arch.x86_64.scan import rebuild, scan, scan_many

    return scan, scan_many, rebuild, EFFECTS


#: architecture name -> its fast control-flow scan, where it has one
FLOW_SCANS: dict[str, Callable[[], FlowScan]] = {"x86_64": _x86_64_flows}
#: architecture name -> its bulk scan, the rebuilding of instructions from one, and the
#: effects table their codes index, where it has them
CODE_SCANS: dict[str, Callable[[], tuple[CodeScan, CodeScanMany, Rebuild, Effects]]] = {
    "x86_64": _x86_64_scan,
}


@dataclass(frozen=True)
class ArchSupport:
    name: str
    decode: Callable[[bytes, int], Iterator[Insn]]
    convention: CallConvention
    flows: FlowScan
    scan: CodeScan
    scan_many: CodeScanMany
    rebuild: Rebuild
    #: (reads, writes) by the effects index of a code (grows as new effects are met)
    effects: Effects


_CACHE: dict[str, ArchSupport] = {}


def _slow_flows(decode: Callable[[bytes, int], Iterator[Insn]]) -> FlowScan:
    def scan(code: bytes, address: int) -> Iterator[tuple[int, int, Flow, int | None]]:
        for insn in decode(code, address):
            yield insn.address, insn.size, insn.flow, insn.target

    return scan


def _slow_scan(decode: Callable[[bytes, int], Iterator[Insn]]
               ) -> tuple[CodeScan, CodeScanMany, Rebuild, Effects]:
    """A CodeScan from an architecture's ``decode`` (one object per instruction)."""
    table: list[tuple[frozenset[str], frozenset[str]]] = []
    ids: dict[tuple[frozenset[str], frozenset[str]], int] = {}

    def scan(code: bytes, address: int) -> tuple[bytes, list[int], list[int], int, int]:
        sizes, codes, targets = bytearray(), [], []
        for insn in decode(code, address):
            key = (insn.reads, insn.writes)
            if key not in ids:
                ids[key] = len(table)
                table.append(key)
            packed = _FLOW_INDEX[insn.flow] | ids[key] << EFFECT_SHIFT
            if insn.mnemonic.rsplit(" ", 1)[-1] in _FILLERS:
                packed |= FILLER_BIT
            if insn.target is not None:
                packed |= TARGET_BIT
                targets.append(insn.target)
            sizes.append(insn.size)
            codes.append(packed)
        return bytes(sizes), codes, targets, 0, 0

    def rebuild(code: bytes, address: int, sizes: bytes, codes: Sequence[int],
                targets: Sequence[int], effects: Effects) -> list[Insn]:
        out = []
        for insn, size in zip(decode(code[:sum(sizes)], address), sizes, strict=False):
            if insn.size != size:
                break
            out.append(insn)
        return out

    def scan_many(items: Sequence[tuple[bytes, int]]
                  ) -> tuple[list[bytes], list[int], list[int], list[int], int]:
        sizes_of, codes, targets, tails = [], [], [], []
        for code, address in items:
            sizes, c, t, tail, _code = scan(code, address)
            sizes_of.append(sizes)
            codes += c
            targets += t
            tails.append(tail)
        return sizes_of, codes, targets, tails, 0

    return scan, scan_many, rebuild, table


def support_for(arch_name: str) -> ArchSupport:
    """The decoder (from the architecture plug-in) and calling convention for an image."""
    if arch_name not in _CACHE:
        from ksim.arch import get_arch

        try:
            arch = get_arch(arch_name)
        except ValueError as exc:
            raise UnsupportedImage(str(exc)) from exc
        convention = CONVENTIONS.get(arch.name)
        if convention is None:
            raise UnsupportedImage(f"no calling convention known for architecture {arch.name!r}")
        flows = FLOW_SCANS.get(arch.name)
        code_scan = CODE_SCANS.get(arch.name)
        scan, scan_many, rebuild, effects = code_scan() if code_scan else _slow_scan(arch.decode)
        _CACHE[arch_name] = ArchSupport(arch.name, arch.decode, convention,
                                        flows() if flows else _slow_flows(arch.decode),
                                        scan, scan_many, rebuild, effects)
    return _CACHE[arch_name]
