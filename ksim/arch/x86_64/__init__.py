"""The x86-64 architecture: the ``Arch`` object generic code is handed.

Decoding is ``reader`` (and ``scan``, in bulk); emitting is ``writer``; moving
instructions is ``relocator``; snippet code generation goes through ``emitter``;
the calling convention is ``convention``; jump-table idioms are ``jumptables``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ksim.arch.base import (
    Arch,
    CallOperand,
    CodeScans,
    ComponentToolchain,
    Emulation,
    FlowScan,
    GdbRegisters,
    Insn,
    JumpTableIdioms,
    ModuleLoader,
    Relocation,
)
from ksim.errors import OutOfRange, RelocationError

from . import regs
from .convention import LINUX, STACK, SYSCALLS
from .writer import INT8, INT32, fits

if TYPE_CHECKING:
    from ksim.core import KernelABI
    from ksim.snippets.ast import Snippet

_MASK64 = (1 << 64) - 1


def _distance(src_end: int, dst: int) -> int:
    """dst - src_end as the CPU sees it: modulo 2**64, signed."""
    d = (dst - src_end) & _MASK64
    return d - (1 << 64) if d >> 63 else d


_S32 = (-2**31, 2**31)

#: Components: the kernel's code generation (images/toy/Makefile, Linux's
#: arch/x86/Makefile), and the relocations a -mcmodel=kernel object uses
#: (System V AMD64 psABI, Table 4.10: "64" S+A, "PC32"/"PLT32" S+A-P, "32" S+A
#: zero-extended, "32S" S+A sign-extended).  The PLT is never needed: every
#: symbol is linked directly, so PLT32 is PC32.
TOOLCHAIN = ComponentToolchain(
    compiler="gcc",
    package="gcc",
    cflags=("-O2", "-std=gnu11", "-ffreestanding", "-nostdlib", "-mcmodel=kernel",
            "-mno-red-zone", "-fno-pic", "-fno-pie", "-mgeneral-regs-only",
            "-fcf-protection=none", "-fno-stack-protector", "-fno-asynchronous-unwind-tables",
            "-fno-common", "-mpreferred-stack-boundary=3", "-Wall"),
    elf_machine="EM_X86_64",
    relocations={
        1: Relocation("R_X86_64_64", size=8, bits=64),
        2: Relocation("R_X86_64_PC32", size=4, bits=32, pcrel=True, range=_S32),
        4: Relocation("R_X86_64_PLT32", size=4, bits=32, pcrel=True, range=_S32),
        10: Relocation("R_X86_64_32", size=4, bits=32, range=(0, 2**32)),
        11: Relocation("R_X86_64_32S", size=4, bits=32, range=_S32),
    },
)

#: Modules: the module area (MODULES_VADDR, Documentation/arch/x86/x86_64/mm.rst)
#: and the relocation types apply_relocate_add (arch/x86/kernel/module.c) applies
#: to a .ko's tables: a component's, and "PC64" S+A-P, 64 bits (psABI Table 4.10).
MODULE_LOADER = ModuleLoader(
    base=0xFFFFFFFFC0000000,
    relocations={**TOOLCHAIN.relocations,
                 24: Relocation("R_X86_64_PC64", size=8, bits=64, pcrel=True)},
)


class X86_64:
    """x86-64 (System V / Linux kernel calling convention)."""

    name = "x86_64"
    trap = b"\xcc"                 # int3 (SDM "INT n/INTO/INT3/INT1")
    jmp_size = 5                   # e9 rel32
    short_jmp_size = 2             # eb rel8
    pad_byte = 0xCC
    convention = LINUX
    arg_regs = LINUX.arg_regs
    ret_reg = LINUX.ret_reg
    all_regs = LINUX.all_regs
    pc_reg = "rip"
    flags_reg = "flags"
    component_toolchain: ComponentToolchain | None = TOOLCHAIN
    module_loader: ModuleLoader | None = MODULE_LOADER
    gdb = GdbRegisters("i386", regs.GDB_REGS)
    syscalls = SYSCALLS
    stack = STACK

    @property
    def emulation(self) -> Emulation:
        # imported when asked for: unicorn is loaded only by what emulates
        from .emulation import EMULATION

        return EMULATION

    def decode(self, code: bytes, address: int) -> Iterator[Insn]:
        from .reader import decode

        return decode(code, address)

    def decode_one(self, code: bytes, address: int) -> Insn:
        from .reader import decode_one

        return decode_one(code, address)

    def flow_scan(self) -> FlowScan:
        from .reader import flows

        return flows

    def code_scan(self) -> CodeScans:
        from .reader import EFFECTS
        from .scan import rebuild, scan, scan_many

        return scan, scan_many, rebuild, EFFECTS

    def prepare(self) -> None:
        from . import emitter, reader, relocator, scan  # noqa: F401

    def is_filler(self, insn: Insn) -> bool:
        return insn.mnemonic.rsplit(" ", 1)[-1] in regs.FILLERS

    def trap_with(self, immediate: int | None) -> bytes:
        if immediate is not None:
            raise ValueError(f"int3 carries no immediate (asked for {immediate:#x})")
        return self.trap

    def is_breakpoint(self, insn: Insn) -> bool:
        return insn.mnemonic == "int3"  # cc, with or without prefixes

    def in_exclusive_sequence(self, insns: Sequence[Insn], index: int) -> bool:
        return False  # locked instructions are single instructions

    @property
    def jump_tables(self) -> JumpTableIdioms:
        from .jumptables import JUMP_TABLES

        return JUMP_TABLES

    # --- jumps ---------------------------------------------------------------------
    def jmp_reaches(self, src: int, dst: int) -> bool:
        return fits(_distance(src + self.jmp_size, dst), INT32)

    def short_jmp_reaches(self, src: int, dst: int) -> bool:
        return fits(_distance(src + self.short_jmp_size, dst), INT8)

    def jmp(self, src: int, dst: int) -> bytes:
        if not self.jmp_reaches(src, dst):
            raise OutOfRange(f"jmp rel32 at {src:#x} cannot reach {dst:#x}")
        return b"\xe9" + _distance(src + 5, dst).to_bytes(4, "little", signed=True)

    def short_jmp(self, src: int, dst: int) -> bytes:
        if not self.short_jmp_reaches(src, dst):
            raise OutOfRange(f"jmp rel8 at {src:#x} cannot reach {dst:#x}")
        return b"\xeb" + _distance(src + 2, dst).to_bytes(1, "little", signed=True)

    # --- relocation and snippets -----------------------------------------------------
    def relocate(self, insns: Sequence[Insn], new_address: int, *,
                 first_to: int | None = None) -> bytes:
        from .relocator import relocate

        return relocate(insns, new_address, first_to=first_to)

    def relocated_size(self, insns: Sequence[Insn]) -> int:
        from .relocator import relocated_size

        return relocated_size(insns)

    def compile_snippets(
        self,
        snippets: Sequence[Snippet],
        address: int,
        *,
        live: frozenset[str],
        abi: KernelABI,
        point_kind: str = "entry",
        call_operand: CallOperand | None = None,
    ) -> bytes:
        from ksim.snippets.codegen import compile_snippets

        from .emitter import X86Emitter

        return compile_snippets(
            self, snippets, lambda: X86Emitter(address), live=live, point_kind=point_kind, abi=abi,
            call_operand=call_operand,
        )

    def call_operand(self, insn: Insn) -> CallOperand | None:
        from .reader import call_operand

        return call_operand(insn)

    def moved_call(self, insn: Insn, at: int) -> bytes:
        from .relocator import moved_call

        return moved_call(insn, at)

    def redirect_call(self, insn: Insn, to: int) -> bytes:
        if insn.size != 5 or insn.raw[0] != 0xE8:
            raise RelocationError(f"{insn} is not a direct call rel32")
        rel = to - insn.end
        if not -2**31 <= rel < 2**31:
            raise RelocationError(f"{to:#x} is out of a call's reach from {insn.address:#x}")
        return b"\xe8" + (rel % 2**32).to_bytes(4, "little")

    def __repr__(self) -> str:
        return "X86_64()"


ARCH: Arch = X86_64()
