"""The Linux kernel's calling convention on x86-64: the one table of it.

The System V AMD64 ABI (0.99, 3.2.1, Fig. 3.4 "Register Usage") as the kernel
uses it: no red zone, no vector registers in kernel C code.  Argument registers
in order, return registers (a one-word value in rax, a two-word one in rax:rdx),
the registers a callee saves and restores, and the stack pointer, which the ABI
preserves too but which the analyses treat apart (see
:class:`ksim.arch.base.CallConvention`): rsp is "preserved across function calls"
in Fig. 3.4, and is not in ``callee_saved``.

The special callees are assembly routines with their own register interfaces:
__fentry__ / mcount (preserve everything), __get_user_* / __put_user_*
(arch/x86/lib/getuser.S, putuser.S: pointer and value in rax/rcx/rdx, clobber
almost nothing), copy/clear_user helpers (rep_movs_alternative: rcx/rsi/rdi),
__sw_hweight* (preserve all but rax), __switch_to_asm, the thunk_*.S wrappers, and
memcpy/memset variants patched by alternatives.
"""

from __future__ import annotations

import re

from ksim.arch.base import CallConvention, StackABI, SyscallABI

from .regs import ALL_REGS

LINUX = CallConvention(
    arg_regs=("rdi", "rsi", "rdx", "rcx", "r8", "r9"),
    ret_regs=("rax", "rdx"),
    callee_saved=frozenset({"rbx", "rbp", "r12", "r13", "r14", "r15"}),
    stack_reg="rsp",
    all_regs=ALL_REGS,
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

#: System calls: SYSCALL_DEFINEn makes ``__x64_sys_NAME(const struct pt_regs *regs)``
#: (arch/x86/include/asm/syscall_wrapper.h), and the arguments are di, si, dx, r10,
#: r8, r9 (syscall_get_arguments, arch/x86/include/asm/syscall.h) at their offsets
#: in struct pt_regs (arch/x86/include/asm/ptrace.h: r15 r14 r13 r12 bp bx r11 r10 r9
#: r8 ax cx dx si di, 8 bytes each).  Linux 6.1's trace_event_raw_event_sys_enter
#: reads them at 0x70, 0x68, 0x60, 0x38, 0x48, 0x40.
SYSCALLS = SyscallABI(wrapper_prefix="__x64_sys_",
                      arg_offsets=(0x70, 0x68, 0x60, 0x38, 0x48, 0x40))

#: kstack: Linux's stack_trace_save_regs unwinds (ORC) from the pt_regs' ip, sp and
#: bp (arch/x86/kernel/unwind_orc.c, __unwind_start); cs 0 reads as kernel mode
STACK = StackABI(save="stack_trace_save_regs",
                 registers=(("ip", "point"), ("sp", "rsp"), ("bp", "rbp")))
