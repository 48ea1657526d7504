"""AArch64 as unicorn emulates it and capstone reads it (plain data; see
``ksim.arch.base.Emulation``): what the toy kernel's machine and the
differential runner need.
"""

from __future__ import annotations

import re

import capstone
import unicorn
from unicorn import arm64_const as A

from ksim.arch.base import DifferentialRules, Emulation
from ksim.machine.boards import reg_table

from . import regs
from .board import EXCP_BKPT, EXCP_DATA_ABORT, EXCP_PREFETCH_ABORT, Arm64Board

#: BUG_BRK_IMM (arch/arm64/include/asm/brk-imm.h): BUG() and WARN() are BRK #0x800
BUG_BRK_IMM = 0x800

#: instructions that end a run: the machine's rather than the function's
#: (exception returns, calls to a hypervisor, secure monitor or the kernel
#: itself, waits for an event or an interrupt, TLB maintenance, address
#: translation, debug state, the generic system instructions) or not
#: deterministic.  BRK and HLT are breakpoints, handled on their own; system
#: registers are the operands' (FORBIDDEN_OPERANDS).
FORBIDDEN = frozenset({
    "eret", "eretaa", "eretab", "drps", "dcps1", "dcps2", "dcps3",
    "svc", "hvc", "smc",
    "wfi", "wfe", "wfit", "wfet", "sev", "sevl",
    "tlbi", "at", "sys", "sysl", "cfp", "cpp", "dvp", "brb",
    # permanently undefined, and what capstone cannot decode: an undefined
    # instruction exception, which unicorn does not always deliver to its hook
    "udf", "(bad)",
})

#: System registers a read of which is not deterministic (the generic timer's
#: counts and timer values, the performance monitors, the random number
#: registers: Arm ARM D13 "The Generic Timer", D12 "The Performance Monitors
#: Extension", "RNDR"), or that capstone names only by encoding; and writes
#: (``msr``, its first operand) to any system register or PSTATE field but the
#: interrupt masks (DAIF, ``local_irq_save``) and the condition flags: page
#: tables, exception vectors, the per-cpu offset and current task (a context
#: switch), PAN and UAO around user accesses, the FP/SIMD control: all the machine's.
FORBIDDEN_OPERANDS = re.compile(
    r"\b(?:cnt(?:v|p)ct(?:ss)?_el0|cnt(?:v|p|hv|hp|ps)_(?:tval|cval|ctl)_el[02]"
    r"|pm\w*_el[01]|rndr|rndrrs|s\d_\d_c\d+_c\d+_\d)\b"
    r"|^(?!(?:daif|daifset|daifclr|nzcv)\b)(?:\w+_el[0-3]|pan|uao|spsel|dit|ssbs|tco|fpcr|fpsr"
    r"|allint|svcr\w*|pstate\.\w+), "
)

DIFFERENTIAL = DifferentialRules(
    forbidden=FORBIDDEN,
    forbidden_operands=FORBIDDEN_OPERANDS,
    # a store with writeback of sp, pre-indexed below it: the frame record's
    # ``stp x29, x30, [sp, #-N]!`` and ``str xN, [sp, #-N]!``
    pushing=frozenset(),
    pushing_operands=re.compile(r"\[sp, #-[0-9a-fx]+\]!$"),
    # MSR NZCV loads the flags from a register; no load sets PSTATE.SS
    status_loads=frozenset(), trace_bit=0,
    repeat_prefix="",
    prefix_bytes=frozenset(),
    # BL and BLR leave the return address in x30; RET branches through it
    link_reg="x30", stack_align=16,
    # this CPU's per-cpu offset (arch/arm64/include/asm/percpu.h, __my_cpu_offset)
    # and current (arch/arm64/include/asm/current.h: get_current reads sp_el0)
    percpu_offset=True, current_reg="sp_el0",
    # unicorn's default (a Cortex-A72, Armv8.0) has no LSE atomics (LDADD, CAS,
    # ...), which the kernel's atomics take when the CPU has them; pointer
    # authentication and BTI stay off (SCTLR_EL1 is zero): PACIASP is a NOP
    cpu_model=A.UC_CPU_ARM64_MAX,
)

EMULATION = Emulation(
    uc_arch=unicorn.UC_ARCH_ARM64, uc_mode=unicorn.UC_MODE_ARM,
    cs_arch=capstone.CS_ARCH_ARM64, cs_mode=capstone.CS_MODE_ARM,
    regs=reg_table(A, "UC_ARM64_REG_"),
    gprs=(*regs.GPR64, "sp"),
    pc="pc", sp="sp",
    # PSTATE.{N,Z,C,V} (Arm ARM, "NZCV, Condition Flags")
    status_reg=regs.FLAGS, status_bits={"V": 28, "C": 29, "Z": 30, "N": 31}, status_reset=0,
    status_clear=frozenset(),
    # the per-cpu offset of this CPU (arch/arm64/include/asm/percpu.h)
    percpu_reg="tpidr_el1",
    breakpoint_vector=EXCP_BKPT, breakpoint_pc_offset=0,
    fault_vectors=frozenset({EXCP_PREFETCH_ABORT, EXCP_DATA_ABORT}),
    max_insn_size=4,
    bug_insn=(0xD4200000 | BUG_BRK_IMM << 5).to_bytes(4, "little"),
    board=Arm64Board,
    differential=DIFFERENTIAL,
)
