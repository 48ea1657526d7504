"""The Linux kernel's calling convention on AArch64: the one table of it.

AAPCS64 (Arm IHI 0055, 6.1.1 "General-purpose registers", 6.9 "Result return") as
the kernel uses it: arguments in x0..x7, a one-word result in x0 (a two-word one
in x0:x1), x19..x28 and the frame pointer x29 saved and restored by a callee.
The stack pointer is preserved too but kept apart (``stack_reg``, see
:class:`ksim.arch.base.CallConvention`).  x16/x17 (IP0/IP1, clobbered by veneers),
x18 (the platform register: an ordinary temporary, or the shadow call stack
pointer that every callee preserves), the link register x30 and the flags are
caller-saved.  x30 is live at every return and tail call nonetheless
(``link_reg``): it holds the address the function, or the callee it branches
to, returns to.

The special callees are the assembly routines with their own register
interfaces: ``_mcount`` and the ftrace trampolines (entered with the caller's x30
in x9 under ``-fpatchable-function-entry``, arch/arm64/kernel/entry-ftrace.S),
the sanitizers' check routines (``__hwasan_check_*`` take the address in x0 and
a tag in x16/x17 and preserve everything else), and ``cpu_switch_to``.

There are no paravirt call tables with custom conventions, no retpoline thunks and
no return thunks on arm64: those patterns match nothing.
"""

from __future__ import annotations

import re

from ksim.arch.base import CallConvention, StackABI, SyscallABI

from .regs import ALL_REGS, ARG_REGS

_NOTHING = re.compile(r"(?!)")

LINUX = CallConvention(
    arg_regs=ARG_REGS,
    ret_regs=("x0", "x1"),
    callee_saved=frozenset({f"x{n}" for n in range(19, 30)}),
    stack_reg="sp",
    all_regs=ALL_REGS,
    special_callee=re.compile(
        r"^(_mcount|__fentry__|ftrace_caller|ftrace_regs_caller|ftrace_common"
        r"|ftrace_graph_caller|return_to_handler|cpu_switch_to|__cpu_switch_to"
        r"|__hwasan_.*|__asan_.*|__kasan_.*|__kcsan_.*|__tsan_.*|__sanitizer_.*)$"
    ),
    special_call_table=_NOTHING,
    indirect_thunk=_NOTHING,
    return_thunk=_NOTHING,
    # the return address: a tail call's callee returns through it
    link_reg="x30",
)

#: System calls: SYSCALL_DEFINEn makes ``__arm64_sys_NAME(const struct pt_regs *regs)``
#: (arch/arm64/include/asm/syscall_wrapper.h), and the arguments are x0..x5, the
#: first six of ``u64 regs[31]`` at the start of struct pt_regs
#: (arch/arm64/include/asm/ptrace.h).  syscall_get_arguments() takes the first from
#: orig_x0, which el0_svc_common() copies from regs[0] before the call; regs[0] holds
#: it until invoke_syscall() stores the result there, after the wrapper returns, so
#: at the wrapper's entry both are the argument.
SYSCALLS = SyscallABI(wrapper_prefix="__arm64_sys_", arg_offsets=(0, 8, 16, 24, 32, 40))

#: kstack: Linux's stack_trace_save_regs walks the frame records from the pt_regs'
#: pc and regs[29] (arch/arm64/kernel/stacktrace.c, kunwind_init_from_regs)
STACK = StackABI(save="stack_trace_save_regs",
                 registers=(("pc", "point"), ("sp", "sp"), ("regs.29", "x29"),
                            ("regs.30", "x30")), slot_bytes=16)
