"""The arm64 toy kernel's machine in unicorn: QEMU's virt board, as far as the toy uses it.

A PL011 UART, a GIC that reads as zero, and Arm semihosting's SYS_EXIT for a
panic; the rest of a board (where a breakpoint's site is, page faults) is generic
(``ksim.machine.boards``), read from this architecture's ``Emulation``.
"""

from __future__ import annotations

import struct
from typing import Any

import capstone
import unicorn
from unicorn import arm64_const as A

from ksim.errors import EmulationError
from ksim.machine.boards import Board

# unicorn's interrupt numbers are QEMU's exception indexes (target/arm/cpu.h)
EXCP_UDEF, EXCP_PREFETCH_ABORT, EXCP_DATA_ABORT, EXCP_BKPT = 1, 3, 4, 7


class Arm64Board(Board):
    """The arm64 toy's QEMU virt board (images/toy/include/asm-arm64.h), a Cortex-A57.

    Unicorn's Cortex-A57 comes out of reset with SCR_EL3.RW = 0 and EL1 would
    be AArch32: SCR_EL3.RW|NS and HCR_EL2.RW make EL1 AArch64 and non-secure,
    and the run starts at EL1h with DAIF masked, as head.S leaves it.  The
    devices are where QEMU's virt puts them, one to one through TTBR0 (head.S).
    """

    GIC_BASE, GIC_SIZE = 0x08000000, 0x01000000  # distributor, CPU interface, redistributors
    UART_BASE, UART_SIZE = 0x09000000, 0x1000  # PL011: data register at +0
    identity = ((GIC_BASE, GIC_SIZE), (UART_BASE, UART_SIZE))
    PSTATE_EL1H = 0x3C5  # EL1 with SP_EL1, D, A, I, F masked
    #: (CRn, CRm, op0, op1, op2) of the registers set before the first run
    SCR_EL3, HCR_EL2 = (1, 1, 3, 6, 0), (1, 1, 3, 4, 0)
    SEMIHOSTING = "semihosting_call"  # the kernel's HLT #0xf000 (arch/arm64/setup.c)
    SEMIHOST_SYS_EXIT, ADP_STOPPED_APP_EXIT = 0x18, 0x20026
    EXIT_FAILURE = 35

    def create(self) -> unicorn.Uc:
        uc = super().create()
        uc.ctl_set_cpu_model(A.UC_CPU_ARM64_A57)
        return uc

    def install(self) -> None:
        uc = self.m._uc
        uc.reg_write(A.UC_ARM64_REG_CP_REG, (*self.SCR_EL3, 0x401))  # RW | NS
        uc.reg_write(A.UC_ARM64_REG_CP_REG, (*self.HCR_EL2, 1 << 31))  # RW
        uc.mmio_map(self.UART_BASE, self.UART_SIZE, self._guarded(lambda *_: 0), None,
                    self._guarded(self._on_uart), None)
        uc.mmio_map(self.GIC_BASE, self.GIC_SIZE, self._guarded(lambda *_: 0), None,
                    self._guarded(lambda *_: None), None)
        at = self.m.address_of(self.SEMIHOSTING)
        self.m._add(unicorn.UC_HOOK_CODE, self._on_semihosting, begin=at, end=at)

    def _guarded(self, fn: Any) -> Any:
        guarded = self.m._guard(fn)
        return lambda uc, *args: guarded(uc, *args) or 0

    def enter(self, stack: int) -> None:
        for n in range(31):
            self.m.set_reg(f"x{n}", 0)
        # the exception level first: the stack pointer written next is SP_EL1
        self.m.set_reg("pstate", self.PSTATE_EL1H)
        self.m.set_reg("sp", stack)

    def interrupt_error(self, vector: int) -> EmulationError | None:
        if vector != EXCP_UDEF:
            return None
        pc = self.m.reg("pc")
        word = self.m.read(pc, 4).hex() if self.m._in_image(pc) else "?"
        err = EmulationError(f"invalid instruction at {pc:#x} ({self.m.symbolize(pc)}): {word}")
        err.address = pc  # type: ignore[attr-defined]
        return err

    def _on_uart(self, offset: int, _size: int, value: int, _user: Any) -> None:
        if offset == 0:
            self.m._serial.append(value & 0xFF)

    def _on_semihosting(self, _address: int, _size: int, _user: Any) -> None:
        if self.m.reg("x0") == self.SEMIHOST_SYS_EXIT:
            reason, code = struct.unpack("<QQ", self.m.read(self.m.reg("x1"), 16))
            self.m._exit(code if reason == self.ADP_STOPPED_APP_EXIT else self.EXIT_FAILURE)

    def _operand_addresses(self, insn: Any, pc: int) -> list[int]:
        out = []
        for op in insn.operands:
            if op.type != capstone.arm64.ARM64_OP_MEM:
                continue
            ea = op.mem.disp
            for reg in (op.mem.base, op.mem.index):
                if reg:
                    ea += self.m.reg(insn.reg_name(reg))
            out.append(ea & (2**64 - 1))
        return out
