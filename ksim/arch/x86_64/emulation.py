"""x86-64 as unicorn emulates it and capstone reads it (plain data; see
``ksim.arch.base.Emulation``): what the toy kernel's machine and the
differential runner need.
"""

from __future__ import annotations

import re

import capstone
import unicorn
from unicorn import x86_const as X

from ksim.arch.base import DifferentialRules, Emulation
from ksim.machine.boards import reg_table

from .board import X86Board

#: the status flags in RFLAGS (SDM Vol. 1, 3.4.3 "EFLAGS Register")
STATUS_BITS = {"CF": 0, "PF": 2, "AF": 4, "ZF": 6, "SF": 7, "DF": 10, "OF": 11}
#: the trap flag: single-step after each instruction
TF = 1 << 8

#: instructions that end a run: not deterministic (time stamps, random numbers,
#: performance counters), the machine's rather than the function's (port I/O,
#: MSRs, descriptor tables, TLB and cache control, segment bases, hypercalls,
#: far transfers, monitor/mwait), or that unicorn does not emulate faithfully
#: (transactional memory).  ud2 and int3 are handled on their own.
FORBIDDEN = frozenset({
    "hlt",
    "rdtsc", "rdtscp", "rdrand", "rdseed", "rdpid", "rdpmc", "cpuid",
    "in", "out", "insb", "insw", "insd", "outsb", "outsw", "outsd",
    "rdmsr", "wrmsr", "xgetbv", "xsetbv", "rdpkru", "wrpkru",
    "lgdt", "lidt", "lldt", "ltr", "lmsw", "smsw", "clts", "invlpg", "invlpga", "invpcid",
    "wbinvd", "wbnoinvd", "invd", "swapgs", "rdfsbase", "rdgsbase", "wrfsbase", "wrgsbase",
    "syscall", "sysenter", "sysret", "sysretq", "sysexit", "sysexitq", "iret", "iretd", "iretq",
    "int", "int1", "into", "ud0", "ud1", "retf", "retfq", "ljmp", "lcall",
    "monitor", "mwait", "monitorx", "mwaitx", "umonitor", "umwait", "tpause",
    "vmcall", "vmmcall", "vmlaunch", "vmresume", "vmxon", "vmxoff", "vmread", "vmwrite",
    "vmptrld", "vmptrst", "vmclear", "invept", "invvpid", "vmrun", "vmload", "vmsave",
    "getsec", "rsm", "encls", "enclu", "enclv", "pconfig",
    "xbegin", "xend", "xabort", "xtest",
})

DIFFERENTIAL = DifferentialRules(
    forbidden=FORBIDDEN,
    # moves to and from control and debug registers
    forbidden_operands=re.compile(r"\b(cr\d+|dr\d+)\b"),
    pushing=frozenset({"push", "pushf", "pushfq", "call", "enter"}),
    status_loads=frozenset({"popf", "popfq", "popfw"}),
    trace_bit=TF,
    repeat_prefix="rep",
    # operand and address size, lock, rep/repne, and the segment overrides
    # (SDM Vol. 2A, 2.1.1 "Instruction Prefixes")
    prefix_bytes=frozenset({0x66, 0x67, 0xF0, 0xF2, 0xF3, 0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65}),
    # "The CF, OF, SF, ZF, AF, and PF flags are undefined" (SDM Vol. 2A, DIV,
    # IDIV); QEMU leaves them as the previous flag-setting instruction computed
    # them, which a snippet's own arithmetic changes
    undefined_status=frozenset({"div", "idiv"}),
)

EMULATION = Emulation(
    uc_arch=unicorn.UC_ARCH_X86, uc_mode=unicorn.UC_MODE_64,
    cs_arch=capstone.CS_ARCH_X86, cs_mode=capstone.CS_MODE_64,
    regs=reg_table(X, "UC_X86_REG_"),
    gprs=("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp",
          "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"),
    pc="rip", sp="rsp",
    # bit 1 of EFLAGS is reserved and reads as one
    status_reg="eflags", status_bits=STATUS_BITS, status_reset=0x2,
    # the kernel's C code runs with DF clear (System V AMD64 ABI 3.2.1: "The direction
    # flag DF ... must be clear on function entry and upon function return")
    status_clear=frozenset({"DF"}),
    # per-cpu data is %gs-relative (arch/x86/include/asm/percpu.h)
    percpu_reg="gs_base",
    breakpoint_vector=3, breakpoint_pc_offset=1,  # #BP; RIP past the one-byte int3
    fault_vectors=frozenset({14}),  # #PF
    max_insn_size=15,  # SDM Vol. 2A, 2.3.11 "AVX Instruction Length"
    bug_insn=b"\x0f\x0b",  # ud2 (arch/x86/include/asm/bug.h: ASM_UD2)
    board=X86Board,
    differential=DIFFERENTIAL,
)
