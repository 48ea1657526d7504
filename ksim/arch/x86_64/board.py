"""The x86-64 toy kernel's PC in unicorn (drivers/tty/serial_8250.c, arch/x86/traps.c).

COM1 and QEMU's isa-debug-exit port are reached through IN/OUT hooks; the rest
of a board (registers at entry, where a breakpoint's site is) is generic
(``ksim.machine.boards``), read from this architecture's ``Emulation``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import capstone
import unicorn
from unicorn import x86_const as X

from ksim.machine.boards import Board

if TYPE_CHECKING:
    from ksim.arch.base import Emulation
    from ksim.machine.unicorn import UnicornMachine


class X86Board(Board):
    """A PC as the x86-64 toy uses it: a 16550 UART at COM1 and isa-debug-exit."""

    COM1 = 0x3F8
    UART_LSR_READY = 0x60  # THR empty | transmitter empty: the UART is never busy
    DEBUG_EXIT_PORT = 0xF4

    def __init__(self, machine: UnicornMachine, emulation: Emulation) -> None:
        super().__init__(machine, emulation)
        self._lcr = 0

    def install(self) -> None:
        self.m._add(unicorn.UC_HOOK_INSN, self._on_in, arg1=X.UC_X86_INS_IN)
        self.m._add(unicorn.UC_HOOK_INSN, self._on_out, arg1=X.UC_X86_INS_OUT)

    def reset(self) -> None:
        self._lcr = 0

    def _on_in(self, port: int, size: int, _user: Any) -> int:
        return self.UART_LSR_READY if port == self.COM1 + 5 else 0

    def _on_out(self, port: int, size: int, value: int, _user: Any) -> None:
        if port == self.COM1 + 3:
            self._lcr = value & 0xFF
        elif port == self.COM1 and not self._lcr & 0x80:  # DLAB clear: a character
            self.m._serial.append(value & 0xFF)
        elif port == self.DEBUG_EXIT_PORT:
            self.m._exit(((value << 1) | 1) & 0xFF)  # QEMU's status for the value

    def _operand_addresses(self, insn: Any, pc: int) -> list[int]:
        out = []
        for op in insn.operands:
            if op.type != capstone.x86.X86_OP_MEM:
                continue
            mem = op.mem
            if mem.base == capstone.x86.X86_REG_RIP:
                ea = pc + insn.size + mem.disp
            else:
                ea = mem.disp
                for reg, scale in ((mem.base, 1), (mem.index, mem.scale)):
                    if reg:
                        ea += scale * self.m.reg(insn.reg_name(reg))
            out.append(ea & (2**64 - 1))
        return out
