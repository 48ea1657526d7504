"""What differs between the toy kernel's machines in unicorn: the board around the CPU.

``UnicornMachine`` (ksim.machine.unicorn) is generic: it maps the image, runs
it in slices or whole, counts instructions, keeps hook exceptions and watches
the timeout.  A board is the rest, as the kernel sees it: the CPU unicorn
emulates and its registers (the architecture's :class:`~ksim.arch.base.Emulation`),
the devices (where the serial output goes, how the kernel ends a run), the
registers at ``ksim_entry64``, and which interrupt is the architecture's
breakpoint and where its site is.  Each architecture names its board
(``Emulation.board``, in its package):

    x86-64   a PC: COM1 and the isa-debug-exit port through IN/OUT hooks;
             the breakpoint arrives as interrupt 3 with the PC just past it.
    AArch64  QEMU's ``virt`` board, as far as the toy kernel uses it: a PL011
             UART, a GIC that reads as zero, Arm semihosting's SYS_EXIT for a
             panic; the breakpoint arrives as unicorn's EXCP_BKPT with the PC on
             it (its preferred return address, Arm ARM D1.10.1).

Neither board delivers interrupts or exceptions to the kernel: no timer
interrupt is ever taken (runs are deterministic), a breakpoint reaches the
machine's interrupt hook instead of the kernel's vectors, and an undefined
instruction ends the run with an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import capstone
import unicorn

from ksim.errors import EmulationError

if TYPE_CHECKING:
    from ksim.arch.base import Emulation
    from ksim.machine.unicorn import UnicornMachine

PAGE = 0x1000
#: the exit status that means the kernel reached ksim_halt (QEMU's isa-debug-exit
#: status for the value 0x10; the arm64 toy's semihosting exit code)
EXIT_SUCCESS = 33


def reg_table(module: Any, prefix: str) -> dict[str, int]:
    """Unicorn's register ids in ``module`` (its ``<prefix><NAME>`` constants) by
    lower-case name."""
    return {name[len(prefix):].lower(): value for name, value in vars(module).items()
            if name.startswith(prefix) and isinstance(value, int)}


#: the bytes of translated code a machine keeps (see Board.create)
TCG_BUFFER = 32 << 20


class Board:
    """The architecture-specific half of a UnicornMachine (module doc)."""

    #: physical windows (devices) the virtual TLB maps one to one
    identity: ClassVar[tuple[tuple[int, int], ...]] = ()

    def __init__(self, machine: UnicornMachine, emulation: Emulation) -> None:
        self.m = machine
        self.cpu = emulation

    @property
    def regs(self) -> dict[str, int] | Any:
        """Register names reg()/set_reg() accept -> unicorn's ids."""
        return self.cpu.regs

    @property
    def pc(self) -> str:
        return self.cpu.pc

    @property
    def fault_vectors(self) -> frozenset[int]:
        return self.cpu.fault_vectors

    def create(self) -> unicorn.Uc:
        uc = unicorn.Uc(self.cpu.uc_arch, self.cpu.uc_mode)
        # QEMU's translated code fills a buffer front to back and starts again at the
        # front only when it is full: at unicorn's default (1 GiB) every re-translation
        # after a splice touches new pages, and a long-lived machine grows by megabytes
        # a splice.  The toy kernels' code fits many times in TCG_BUFFER.
        uc.ctl_set_tcg_buffer_size(TCG_BUFFER)  # type: ignore[attr-defined]
        return uc

    def disassembler(self) -> capstone.Cs:
        return capstone.Cs(self.cpu.cs_arch, self.cpu.cs_mode)

    def install(self) -> None:
        """Add the devices' hooks (the image is mapped, its symbols known)."""

    def reset(self) -> None:
        """Device state back to power-on (before a run)."""

    def enter(self, stack: int) -> None:
        """The registers ksim_entry64 expects: zero, but the stack pointer; the
        status register as at reset."""
        for name in self.cpu.gprs:
            self.m.set_reg(name, 0)
        self.m.set_reg(self.cpu.status_reg, self.cpu.status_reset)
        self.m.set_reg(self.cpu.sp, stack)

    def trap_site(self, vector: int) -> int | None:
        """The address of the breakpoint instruction that raised interrupt
        ``vector``; None when ``vector`` is no breakpoint."""
        if vector != self.cpu.breakpoint_vector:
            return None
        return self.m.reg(self.cpu.pc) - self.cpu.breakpoint_pc_offset

    def interrupt_error(self, vector: int) -> EmulationError | None:
        """An interrupt that ends the run (an undefined instruction), as an error."""
        return None

    def effective_address(self, pc: int, page: int) -> int:
        """The exact address the instruction at ``pc`` used in ``page`` (the TLB
        sees only pages), from its memory operands; ``page`` if none is there."""
        md = self.disassembler()
        md.detail = True
        for insn in md.disasm(self.m.read(pc, 16), pc, 1):
            for ea in self._operand_addresses(insn, pc):
                if ea & ~(PAGE - 1) == page:
                    return ea
        return page

    def _operand_addresses(self, insn: Any, pc: int) -> list[int]:
        return []
