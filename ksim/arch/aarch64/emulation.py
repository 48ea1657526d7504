"""AArch64 as unicorn emulates it and capstone reads it (plain data; see
``ksim.arch.base.Emulation``): what the toy kernel's machine needs.  The
differential runner's rules are not declared for it (``differential`` is None).
"""

from __future__ import annotations

import capstone
import unicorn
from unicorn import arm64_const as A

from ksim.arch.base import Emulation
from ksim.machine.boards import reg_table

from . import regs
from .board import EXCP_BKPT, EXCP_DATA_ABORT, EXCP_PREFETCH_ABORT, Arm64Board

#: BUG_BRK_IMM (arch/arm64/include/asm/brk-imm.h): BUG() and WARN() are BRK #0x800
BUG_BRK_IMM = 0x800

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
)
