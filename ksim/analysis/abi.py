"""What analysis needs to know about an architecture and the kernel's calling habits.

Analysis is generic; it reaches the decoder and the calling convention through
:func:`support_for` (keyed by ``Image.arch``), never by testing an architecture's
name itself.  Conventions are data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
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


def _x86_64_flows() -> FlowScan:
    from ksim.arch.x86_64.reader import flows

    return flows


#: architecture name -> its fast control-flow scan, where it has one
FLOW_SCANS: dict[str, Callable[[], FlowScan]] = {"x86_64": _x86_64_flows}


@dataclass(frozen=True)
class ArchSupport:
    name: str
    decode: Callable[[bytes, int], Iterator[Insn]]
    convention: CallConvention
    flows: FlowScan


_CACHE: dict[str, ArchSupport] = {}


def _slow_flows(decode: Callable[[bytes, int], Iterator[Insn]]) -> FlowScan:
    def scan(code: bytes, address: int) -> Iterator[tuple[int, int, Flow, int | None]]:
        for insn in decode(code, address):
            yield insn.address, insn.size, insn.flow, insn.target

    return scan


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
        scan = FLOW_SCANS.get(arch.name)
        _CACHE[arch_name] = ArchSupport(arch.name, arch.decode, convention,
                                        scan() if scan else _slow_flows(arch.decode))
    return _CACHE[arch_name]
