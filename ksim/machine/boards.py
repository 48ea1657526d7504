"""What differs between the toy kernel's machines in unicorn, one board per ELF machine.

``UnicornMachine`` (ksim.machine.unicorn) is generic: it maps the image, runs
it in slices or whole, counts instructions, keeps hook exceptions and watches
the timeout.  A board is the rest, as the kernel sees it: the CPU unicorn
emulates and its registers, the devices (where the serial output goes, how the
kernel ends a run), the registers at ``ksim_entry64``, and which interrupt is
the architecture's breakpoint and where its site is.

    x86-64   a PC: COM1 and the isa-debug-exit port through IN/OUT hooks;
             ``int3`` arrives as interrupt 3 with RIP just past it.
    AArch64  QEMU's ``virt`` board, as far as the toy kernel uses it: a PL011
             UART, a GIC that reads as zero, Arm semihosting's SYS_EXIT for a
             panic; ``BRK`` arrives as unicorn's EXCP_BKPT with PC on the BRK
             itself (its preferred return address, Arm ARM D1.10.1).

Neither board delivers interrupts or exceptions to the kernel: no timer
interrupt is ever taken (runs are deterministic), a breakpoint reaches the
machine's interrupt hook instead of the kernel's vectors, and an undefined
instruction ends the run with an error.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, ClassVar

import capstone
import unicorn
from unicorn import arm64_const as A
from unicorn import x86_const as X

from ksim.errors import EmulationError

if TYPE_CHECKING:
    from ksim.machine.unicorn import UnicornMachine

PAGE = 0x1000
#: the exit status that means the kernel reached ksim_halt (QEMU's isa-debug-exit
#: status for the value 0x10; the arm64 toy's semihosting exit code)
EXIT_SUCCESS = 33


def _reg_table(module: Any, prefix: str) -> dict[str, int]:
    return {name[len(prefix):].lower(): value for name, value in vars(module).items()
            if name.startswith(prefix) and isinstance(value, int)}


class Board:
    """The architecture-specific half of a UnicornMachine (module doc)."""

    #: the ELF e_machine this board runs
    e_machine: ClassVar[str]
    uc_arch: ClassVar[int]
    uc_mode: ClassVar[int]
    cs_arch: ClassVar[int]
    cs_mode: ClassVar[int]
    #: register names reg()/set_reg() accept -> unicorn's ids
    regs: ClassVar[dict[str, int]]
    pc: ClassVar[str]
    sp: ClassVar[str]
    #: physical windows (devices) the virtual TLB maps one to one
    identity: ClassVar[tuple[tuple[int, int], ...]] = ()
    #: interrupts that are the CPU's answer to a failed TLB fill (a page fault)
    fault_vectors: ClassVar[frozenset[int]]

    def __init__(self, machine: UnicornMachine) -> None:
        self.m = machine

    def create(self) -> unicorn.Uc:
        return unicorn.Uc(self.uc_arch, self.uc_mode)

    def install(self) -> None:
        """Add the devices' hooks (the image is mapped, its symbols known)."""

    def reset(self) -> None:
        """Device state back to power-on (before a run)."""

    def enter(self, stack: int) -> None:
        """The registers ksim_entry64 expects: zero, but the stack pointer."""
        raise NotImplementedError

    def trap_site(self, vector: int) -> int | None:
        """The address of the breakpoint instruction that raised interrupt
        ``vector``; None when ``vector`` is no breakpoint."""
        raise NotImplementedError

    def interrupt_error(self, vector: int) -> EmulationError | None:
        """An interrupt that ends the run (an undefined instruction), as an error."""
        return None

    def effective_address(self, pc: int, page: int) -> int:
        """The exact address the instruction at ``pc`` used in ``page`` (the TLB
        sees only pages), from its memory operands; ``page`` if none is there."""
        md = capstone.Cs(self.cs_arch, self.cs_mode)
        md.detail = True
        for insn in md.disasm(self.m.read(pc, 16), pc, 1):
            for ea in self._operand_addresses(insn, pc):
                if ea & ~(PAGE - 1) == page:
                    return ea
        return page

    def _operand_addresses(self, insn: Any, pc: int) -> list[int]:
        return []


class X86Board(Board):
    """The x86-64 toy's PC (drivers/tty/serial_8250.c, arch/x86/traps.c)."""

    e_machine = "EM_X86_64"
    uc_arch, uc_mode = unicorn.UC_ARCH_X86, unicorn.UC_MODE_64
    cs_arch, cs_mode = capstone.CS_ARCH_X86, capstone.CS_MODE_64
    regs = _reg_table(X, "UC_X86_REG_")
    pc, sp = "rip", "rsp"
    fault_vectors = frozenset({14})  # #PF
    BREAKPOINT = 3  # #BP: int3
    COM1 = 0x3F8
    UART_LSR_READY = 0x60  # THR empty | transmitter empty: the UART is never busy
    DEBUG_EXIT_PORT = 0xF4
    GPRS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12",
            "r13", "r14", "r15")

    def __init__(self, machine: UnicornMachine) -> None:
        super().__init__(machine)
        self._lcr = 0

    def install(self) -> None:
        self.m._add(unicorn.UC_HOOK_INSN, self._on_in, arg1=X.UC_X86_INS_IN)
        self.m._add(unicorn.UC_HOOK_INSN, self._on_out, arg1=X.UC_X86_INS_OUT)

    def reset(self) -> None:
        self._lcr = 0

    def enter(self, stack: int) -> None:
        for name in self.GPRS:
            self.m.set_reg(name, 0)
        self.m.set_reg("rflags", 0x2)
        self.m.set_reg("rsp", stack)

    def trap_site(self, vector: int) -> int | None:
        return self.m.reg("rip") - 1 if vector == self.BREAKPOINT else None

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


class Arm64Board(Board):
    """The arm64 toy's QEMU virt board (images/toy/include/asm-arm64.h), a Cortex-A57.

    Unicorn's Cortex-A57 comes out of reset with SCR_EL3.RW = 0 and EL1 would
    be AArch32: SCR_EL3.RW|NS and HCR_EL2.RW make EL1 AArch64 and non-secure,
    and the run starts at EL1h with DAIF masked, as head.S leaves it.  The
    devices are where QEMU's virt puts them, one to one through TTBR0 (head.S).
    """

    e_machine = "EM_AARCH64"
    uc_arch, uc_mode = unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM
    cs_arch, cs_mode = capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM
    regs = _reg_table(A, "UC_ARM64_REG_")
    pc, sp = "pc", "sp"
    GIC_BASE, GIC_SIZE = 0x08000000, 0x01000000  # distributor, CPU interface, redistributors
    UART_BASE, UART_SIZE = 0x09000000, 0x1000  # PL011: data register at +0
    identity = ((GIC_BASE, GIC_SIZE), (UART_BASE, UART_SIZE))
    # unicorn's interrupt numbers are QEMU's exception indexes (target/arm/cpu.h)
    EXCP_UDEF, EXCP_PREFETCH_ABORT, EXCP_DATA_ABORT, EXCP_BKPT = 1, 3, 4, 7
    fault_vectors = frozenset({EXCP_PREFETCH_ABORT, EXCP_DATA_ABORT})
    PSTATE_EL1H = 0x3C5  # EL1 with SP_EL1, D, A, I, F masked
    #: (CRn, CRm, op0, op1, op2) of the registers set before the first run
    SCR_EL3, HCR_EL2 = (1, 1, 3, 6, 0), (1, 1, 3, 4, 0)
    SEMIHOSTING = "semihosting_call"  # the kernel's HLT #0xf000 (arch/arm64/setup.c)
    SEMIHOST_SYS_EXIT, ADP_STOPPED_APP_EXIT = 0x18, 0x20026
    EXIT_FAILURE = 35

    def create(self) -> unicorn.Uc:
        uc = unicorn.Uc(self.uc_arch, self.uc_mode)
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
        self.m.set_reg("pstate", self.PSTATE_EL1H)
        self.m.set_reg("sp", stack)

    def trap_site(self, vector: int) -> int | None:
        return self.m.reg("pc") if vector == self.EXCP_BKPT else None

    def interrupt_error(self, vector: int) -> EmulationError | None:
        if vector != self.EXCP_UDEF:
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


BOARDS: dict[str, type[Board]] = {b.e_machine: b for b in (X86Board, Arm64Board)}
