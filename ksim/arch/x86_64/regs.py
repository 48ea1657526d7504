"""x86-64 register, condition-code and opcode tables (plain data).

Register numbers are the 4-bit encodings of Intel SDM Vol. 2A, Table 2-2
("32-Bit Addressing Forms with the ModR/M Byte") extended by REX.R/X/B
(SDM Vol. 2A, 2.2.1.2): the low three bits go into ModR/M or the opcode,
the fourth into the REX prefix.
"""

from __future__ import annotations

#: 64-bit general-purpose registers by encoding number
GPR64: tuple[str, ...] = (
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
)

REG_NUM: dict[str, int] = {name: num for num, name in enumerate(GPR64)}

#: every general-purpose register, plus "flags" (the status flags and DF); which of
#: them carry arguments or survive calls is the calling convention's (convention.py)
ALL_REGS: frozenset[str] = frozenset(GPR64) | {"flags"}

#: mnemonics of alignment filler, the instructions compilers pad with (capstone
#: spells prefixed ones "data16 nop"; the last word is the operation)
FILLERS: frozenset[str] = frozenset({"nop", "int3"})

#: condition codes: the low nibble of Jcc (0f 80+cc) and SETcc (0f 90+cc)
#: (SDM Vol. 2A, "Jcc", and Vol. 1, Appendix B, Table B-1)
COND: dict[str, int] = {
    "o": 0x0, "no": 0x1, "b": 0x2, "c": 0x2, "nae": 0x2, "ae": 0x3, "nb": 0x3, "nc": 0x3,
    "e": 0x4, "z": 0x4, "ne": 0x5, "nz": 0x5, "be": 0x6, "na": 0x6, "a": 0x7, "nbe": 0x7,
    "s": 0x8, "ns": 0x9, "p": 0xA, "pe": 0xA, "np": 0xB, "po": 0xB,
    "l": 0xC, "nge": 0xC, "ge": 0xD, "nl": 0xD, "le": 0xE, "ng": 0xE, "g": 0xF, "nle": 0xF,
}

#: group-1 ALU operations: /digit of 81/83 (r/m, imm) and the "op r/m64, r64" opcode
#: (SDM Vol. 2A, Table A-6 "Opcode Extensions ... Group 1")
ALU: dict[str, tuple[int, int]] = {
    "add": (0, 0x01),
    "or": (1, 0x09),
    "adc": (2, 0x11),
    "sbb": (3, 0x19),
    "and": (4, 0x21),
    "sub": (5, 0x29),
    "xor": (6, 0x31),
    "cmp": (7, 0x39),
}

#: group-2 shifts by cl: /digit of d3 (SDM Vol. 2A, Table A-6 "Group 2")
SHIFT: dict[str, int] = {"rol": 0, "ror": 1, "shl": 4, "shr": 5, "sar": 7}

#: group-3 unary operations: /digit of f7 (SDM Vol. 2A, Table A-6 "Group 3")
UNARY: dict[str, int] = {"not": 2, "neg": 3, "mul": 4, "imul": 5, "div": 6, "idiv": 7}

#: segment-override prefixes (SDM Vol. 2A, 2.1.1, Group 2 prefixes)
SEGMENT_PREFIX: dict[str, int] = {"es": 0x26, "cs": 0x2E, "ss": 0x36, "ds": 0x3E, "fs": 0x64, "gs": 0x65}


#: the register file as QEMU's i386-64bit.xml lays out gdb's 'g' packet (name, bytes)
GDB_REGS: tuple[tuple[str, int], ...] = (
    ("rax", 8), ("rbx", 8), ("rcx", 8), ("rdx", 8), ("rsi", 8), ("rdi", 8),
    ("rbp", 8), ("rsp", 8), ("r8", 8), ("r9", 8), ("r10", 8), ("r11", 8),
    ("r12", 8), ("r13", 8), ("r14", 8), ("r15", 8), ("rip", 8), ("eflags", 4),
    ("cs", 4), ("ss", 4), ("ds", 4), ("es", 4), ("fs", 4), ("gs", 4),
    ("fs_base", 8), ("gs_base", 8), ("k_gs_base", 8),
    ("cr0", 8), ("cr2", 8), ("cr3", 8), ("cr4", 8), ("cr8", 8), ("efer", 8),
)


def reg_num(name: str) -> int:
    try:
        return REG_NUM[name]
    except KeyError:
        raise ValueError(f"not an x86-64 general-purpose register: {name!r}") from None
