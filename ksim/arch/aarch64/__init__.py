"""The AArch64 architecture: the ``Arch`` object generic code is handed.

Decoding is ``reader``; emitting is ``writer``; moving instructions is
``relocator``; snippet code generation goes through ``emitter``; the calling
convention is ``convention``; jump-table idioms are ``jumptables``.  The A64
PC-relative encodings all of them rely on are the table in ``pcrel``.

Every instruction is one 4-byte word, so the long jump to a patch and the short
jump of a springboard are the same ``B`` (+-128 MB), and a breakpoint is one
word too: ``BRK #0x004``, the immediate the Linux arm64 kernel uses for kprobes
(``KPROBES_BRK_IMM`` in arch/arm64/include/asm/brk-imm.h), so the kernel's own
brk handler recognises ksim's traps as kprobe-style ones and an unknown BRK
immediate is never mistaken for a BUG/WARN (``BUG_BRK_IMM`` 0x800).

Padding: A64 has no one-byte filler.  Padding written by generic code always
covers whole overwritten instructions (every instruction is 4 bytes, and so is a
jump), and ``pad_byte`` is 0x00, so a padded word is ``0x00000000``, ``UDF #0``:
permanently undefined (Arm ARM, "UDF"), it raises an undefined-instruction
exception if it is ever executed, the role ``int3`` padding plays on x86-64.
``pad_word`` is that word.  Alignment filler (``is_filler``) is NOP, which
assemblers put between functions in code sections, and UDF #0.

Breakpoints (``is_breakpoint``): every ``BRK``, whatever its immediate (a kprobe's
0x004, a uprobe's 0x005, kgdb's 0x400, and the compiled-in BUG/WARN 0x800, KASAN
and kCFI ones, which their handlers find by address or immediate), and ``HLT``,
an external debugger's breakpoint: none may be moved or overwritten.
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
from ksim.errors import RelocationError

from . import pcrel, regs
from .convention import LINUX, STACK, SYSCALLS

if TYPE_CHECKING:
    from ksim.core import KernelABI
    from ksim.snippets.ast import Snippet

#: ``KPROBES_BRK_IMM`` (arch/arm64/include/asm/brk-imm.h)
KPROBES_BRK_IMM = 0x004
#: BRK #imm16 and HLT #imm16 (Arm ARM, "BRK", "HLT"): the immediate in bits 20:5
_BRK, _HLT, _IMM16_MASK = 0xD4200000, 0xD4400000, 0xFFE0001F
#: alignment filler: NOP and UDF #0
_FILLERS = frozenset({0xD503201F, 0x00000000})
#: the exclusive loads and stores (Arm ARM C6.2), and how far back kprobes looks
#: for the load before a point (MAX_ATOMIC_CONTEXT_SIZE, arch/arm64/kernel/probes/
#: decode-insn.c: the 128 bytes Arm recommends at most between the two)
_LOAD_EXCLUSIVE = frozenset({"ldxr", "ldxrb", "ldxrh", "ldxp",
                             "ldaxr", "ldaxrb", "ldaxrh", "ldaxp"})
_STORE_EXCLUSIVE = frozenset({"stxr", "stxrb", "stxrh", "stxp",
                              "stlxr", "stlxrb", "stlxrh", "stlxp"})
_ATOMIC_CONTEXT = 32


# --- components ---------------------------------------------------------------------------
#: where each instruction keeps the immediate a relocation sets (Arm ARM C4.1; the
#: same places as ``pcrel``): ADR/ADRP's immlo [30:29] then immhi [23:5], ADD's and
#: the unsigned-offset loads' and stores' imm12 [21:10], B/BL's imm26 [25:0],
#: B.cond/CBZ's imm19 [23:5], TBZ's imm14 [18:5]
_ADR, _IMM12 = ((29, 2), (5, 19)), ((10, 12),)


def _lo12(name: str, scale: int) -> Relocation:
    """LDST<8*2**scale>_ABS_LO12_NC: X[11:scale] into the scaled imm12 (no overflow
    check: the ADRP before it supplies the page)."""
    return Relocation(name, size=4, bits=12 - scale, shift=scale, fields=_IMM12)


def _branch(name: str, bits: int, field: tuple[int, int]) -> Relocation:
    """A branch's S+A-P, X[bits+1:2], checked to fit: -2**(bits+1) <= X < 2**(bits+1)."""
    reach = 1 << (bits + 1)
    return Relocation(name, size=4, bits=bits, shift=2, pcrel=True, range=(-reach, reach),
                      fields=(field,))


#: Components: the arm64 toy's code generation (images/toy/Makefile, Linux's
#: arch/arm64/Makefile: the small code model, no FP/SIMD, no BTI/PAC, no
#: outlined atomics), and the relocations a -mcmodel=small -fno-pic object uses,
#: as "ELF for the Arm 64-bit Architecture (AArch64)" (aaelf64) section 5.7
#: defines them and Linux's arch/arm64/kernel/module.c (apply_relocate_add)
#: applies them.  Absolute data words: ABS64, and ABS32 / PREL32 checked to
#: -2**31 <= X < 2**32.  Branches: CALL26/JUMP26 +-128 MB, CONDBR19 +-1 MB,
#: TSTBR14 +-32 KB.  Addresses: ADR_PREL_LO21 +-1 MB, ADR_PREL_PG_HI21 (ADRP) +-4 GB
#: in pages, with ADD_ABS_LO12_NC or an LDSTn_ABS_LO12_NC for the low 12 bits.
TOOLCHAIN = ComponentToolchain(
    compiler="aarch64-linux-gnu-gcc",
    package="gcc-aarch64-linux-gnu",
    cflags=("-O2", "-std=gnu11", "-ffreestanding", "-nostdlib", "-mcmodel=small", "-fno-pic",
            "-fno-pie", "-mgeneral-regs-only", "-mbranch-protection=none",
            "-mno-outline-atomics", "-mabi=lp64", "-mlittle-endian", "-fsigned-char",
            "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
            "-fno-common", "-Wall"),
    elf_machine="EM_AARCH64",
    relocations={
        257: Relocation("R_AARCH64_ABS64", size=8, bits=64),
        258: Relocation("R_AARCH64_ABS32", size=4, bits=32, range=(-2**31, 2**32)),
        261: Relocation("R_AARCH64_PREL32", size=4, bits=32, pcrel=True, range=(-2**31, 2**32)),
        274: Relocation("R_AARCH64_ADR_PREL_LO21", size=4, bits=21, pcrel=True,
                        range=(-2**20, 2**20), fields=_ADR),
        275: Relocation("R_AARCH64_ADR_PREL_PG_HI21", size=4, bits=21, shift=12, pcrel=True,
                        page=True, range=(-2**32, 2**32), fields=_ADR),
        277: Relocation("R_AARCH64_ADD_ABS_LO12_NC", size=4, bits=12, fields=_IMM12),
        278: _lo12("R_AARCH64_LDST8_ABS_LO12_NC", 0),
        279: _branch("R_AARCH64_TSTBR14", 14, (5, 14)),
        280: _branch("R_AARCH64_CONDBR19", 19, (5, 19)),
        282: _branch("R_AARCH64_JUMP26", 26, (0, 26)),
        283: _branch("R_AARCH64_CALL26", 26, (0, 26)),
        284: _lo12("R_AARCH64_LDST16_ABS_LO12_NC", 1),
        285: _lo12("R_AARCH64_LDST32_ABS_LO12_NC", 2),
        286: _lo12("R_AARCH64_LDST64_ABS_LO12_NC", 3),
        299: _lo12("R_AARCH64_LDST128_ABS_LO12_NC", 4),
    },
)


class AArch64:
    """AArch64 (AAPCS64 / Linux kernel calling convention), little-endian."""

    name = "aarch64"
    trap = (0xD4200000 | KPROBES_BRK_IMM << 5).to_bytes(4, "little")   # BRK #0x004
    jmp_size = 4                   # B imm26: +-128 MB
    short_jmp_size = 4             # the same B: A64 has no shorter jump
    pad_byte = 0x00                # whole words of it are UDF #0 (module doc)
    pad_word = bytes(4)
    convention = LINUX
    arg_regs = LINUX.arg_regs
    ret_reg = LINUX.ret_reg
    all_regs = LINUX.all_regs
    pc_reg = "pc"
    component_toolchain: ComponentToolchain | None = TOOLCHAIN
    #: the name register effects give the condition flags
    flags_reg = regs.FLAGS
    #: relocatable arm64 modules are not loaded (ksim.image.elf refuses them)
    module_loader: ModuleLoader | None = None
    gdb = GdbRegisters("aarch64", regs.GDB_REGS)
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

    def code_scan(self) -> CodeScans | None:
        return None                 # generic code derives the bulk scan from decode

    def prepare(self) -> None:
        from . import emitter, reader, relocator  # noqa: F401

    def is_filler(self, insn: Insn) -> bool:
        return insn.size == 4 and int.from_bytes(insn.raw, "little") in _FILLERS

    def trap_with(self, immediate: int | None) -> bytes:
        if immediate is None:
            return self.trap
        if not 0 <= immediate <= 0xFFFF:
            raise ValueError(f"BRK's immediate is 16 bits, not {immediate:#x}")
        return (_BRK | immediate << 5).to_bytes(4, "little")

    def is_breakpoint(self, insn: Insn) -> bool:
        word = int.from_bytes(insn.raw, "little") & _IMM16_MASK
        return insn.size == 4 and word in (_BRK, _HLT)

    def in_exclusive_sequence(self, insns: Sequence[Insn], index: int) -> bool:
        # kprobes' is_probed_address_atomic (arch/arm64/kernel/probes/decode-insn.c):
        # back from the instruction before, at most MAX_ATOMIC_CONTEXT_SIZE (32)
        # instructions, a store-exclusive first means outside, a load-exclusive
        # inside
        for insn in reversed(insns[max(0, index - _ATOMIC_CONTEXT):index]):
            if insn.mnemonic in _STORE_EXCLUSIVE:
                return False
            if insn.mnemonic in _LOAD_EXCLUSIVE:
                return True
        return False

    @property
    def jump_tables(self) -> JumpTableIdioms:
        from .jumptables import JUMP_TABLES

        return JUMP_TABLES

    # --- jumps ---------------------------------------------------------------------
    def jmp_reaches(self, src: int, dst: int) -> bool:
        return pcrel.B.reaches(src, dst)

    def short_jmp_reaches(self, src: int, dst: int) -> bool:
        return pcrel.B.reaches(src, dst)

    def jmp(self, src: int, dst: int) -> bytes:
        from .writer import encode_b

        return encode_b(src, dst)

    def short_jmp(self, src: int, dst: int) -> bytes:
        return self.jmp(src, dst)

    # --- relocation and snippets -----------------------------------------------------
    def relocate(self, insns: Sequence[Insn], new_address: int, *,
                 first_to: int | None = None) -> bytes:
        from .relocator import relocate

        return relocate(insns, new_address, first_to=first_to)

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

        from .emitter import AArch64Emitter

        return compile_snippets(
            self, snippets, lambda: AArch64Emitter(address), live=live, point_kind=point_kind,
            abi=abi, call_operand=call_operand,
        )

    def call_operand(self, insn: Insn) -> CallOperand | None:
        from .reader import call_operand

        return call_operand(insn)

    def moved_call(self, insn: Insn, at: int) -> bytes:
        from .relocator import moved_call

        return moved_call(insn, at)

    def redirect_call(self, insn: Insn, to: int) -> bytes:
        word = int.from_bytes(insn.raw, "little")
        if len(insn.raw) != 4 or not pcrel.BL.matches(word):
            raise RelocationError(f"{insn} is not a direct call (BL)")
        if not pcrel.BL.reaches(insn.address, to):
            raise RelocationError(f"{to:#x} is out of a BL's reach from {insn.address:#x}")
        return pcrel.BL.with_target(word, insn.address, to).to_bytes(4, "little")

    def __repr__(self) -> str:
        return "AArch64()"


ARCH: Arch = AArch64()
