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

from ksim.arch.base import Arch, CallOperand, CodeScans, FlowScan, Insn, JumpTableIdioms
from ksim.errors import RelocationError

from . import pcrel, regs
from .convention import LINUX

if TYPE_CHECKING:
    from ksim.snippets.ast import Snippet
    from ksim.targets.base import KernelABI

#: ``KPROBES_BRK_IMM`` (arch/arm64/include/asm/brk-imm.h)
KPROBES_BRK_IMM = 0x004
#: BRK #imm16 and HLT #imm16 (Arm ARM, "BRK", "HLT"): the immediate in bits 20:5
_BRK, _HLT, _IMM16_MASK = 0xD4200000, 0xD4400000, 0xFFE0001F
#: alignment filler: NOP and UDF #0
_FILLERS = frozenset({0xD503201F, 0x00000000})


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
    #: the name register effects give the condition flags
    flags_reg = regs.FLAGS

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

    def is_filler(self, insn: Insn) -> bool:
        return insn.size == 4 and int.from_bytes(insn.raw, "little") in _FILLERS

    def is_breakpoint(self, insn: Insn) -> bool:
        word = int.from_bytes(insn.raw, "little") & _IMM16_MASK
        return insn.size == 4 and word in (_BRK, _HLT)

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
