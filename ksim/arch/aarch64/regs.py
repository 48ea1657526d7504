"""AArch64 register and condition-code tables (plain data).

Register numbers are the 5-bit ``Rn``/``Rd``/``Rt`` fields of the A64 encodings
(Arm ARM DDI 0487, chapter C1, "Register names"): 0..30 name X0..X30, and 31 means the
zero register XZR/WZR or the stack pointer SP depending on the operand ("Xn|SP"
fields take SP).  Generic code sees the 64-bit names ``x0``..``x30`` and ``sp``;
the frame and link registers are ``x29`` and ``x30`` (never ``fp``/``lr``).

The condition flags N, Z, C and V (PSTATE.NZCV) are one name, :data:`FLAGS`:
every A64 instruction that sets flags sets all four (ADDS, SUBS, ANDS, CCMP, FCMP,
...), except the FlagM ones (SETF8, SETF16, RMIF), which the reader treats as
reading the flags too.
"""

from __future__ import annotations

#: the name the reader and the emitter give the condition flags
FLAGS = "nzcv"

#: the 31 general-purpose registers by their 64-bit names, in encoding order
GPR64: tuple[str, ...] = tuple(f"x{n}" for n in range(31))

#: argument registers in order and the result register (AAPCS64, IHI 0055, 6.1.1);
#: which registers survive calls is the calling convention's (convention.py)
ARG_REGS: tuple[str, ...] = tuple(f"x{n}" for n in range(8))
RET_REG = "x0"
#: every general-purpose register, the stack pointer and the flags
ALL_REGS: frozenset[str] = frozenset(GPR64) | {"sp", FLAGS}

#: The intra-procedure-call scratch registers IP0 and IP1 (AAPCS64 6.1.1): "may be
#: used by a linker as a scratch register between a routine and any subroutine it
#: calls".  No callee can rely on them at entry and no caller on them after a call,
#: so code that replaces a call may use them.  They are also the only registers a
#: ``BR`` may use to enter a ``BTI c`` landing pad (Arm ARM, "PSTATE.BTYPE"): a
#: branch through any other register to a BTI-protected function faults.
IP0, IP1 = "x16", "x17"

#: condition codes (Arm ARM, "Condition code" table); a condition and
#: its inverse differ only in bit 0 (AL and NV both mean "always")
COND: dict[str, int] = {
    "eq": 0x0, "ne": 0x1, "cs": 0x2, "hs": 0x2, "cc": 0x3, "lo": 0x3,
    "mi": 0x4, "pl": 0x5, "vs": 0x6, "vc": 0x7, "hi": 0x8, "ls": 0x9,
    "ge": 0xA, "lt": 0xB, "gt": 0xC, "le": 0xD, "al": 0xE, "nv": 0xF,
}
AL, NV = 0xE, 0xF


def invert_cond(cond: int) -> int | None:
    """The opposite condition (flip bit 0); None for AL and NV, which have none."""
    return None if cond in (AL, NV) else cond ^ 1


#: the register file as QEMU's aarch64-core.xml lays out gdb's 'g' packet (name,
#: bytes): x0..x30, sp, pc, cpsr; the FP/SIMD registers follow in their own feature
GDB_REGS: tuple[tuple[str, int], ...] = (
    *((f"x{i}", 8) for i in range(31)), ("sp", 8), ("pc", 8), ("cpsr", 4),
)

# Names capstone (and assemblers) use -> canonical name; the zero register is None.
_CANONICAL: dict[str, str | None] = {}
for _n in range(31):
    _CANONICAL[f"x{_n}"] = f"x{_n}"
    _CANONICAL[f"w{_n}"] = f"x{_n}"   # a 32-bit write zero-extends
_CANONICAL.update({"fp": "x29", "lr": "x30", "ip0": "x16", "ip1": "x17",
                   "sp": "sp", "wsp": "sp", "xzr": None, "wzr": None, "nzcv": FLAGS})


def canonical_reg(name: str) -> str | None:
    """The canonical name of a general-purpose register (``w5`` -> ``x5``, ``lr`` ->
    ``x30``, ``wsp`` -> ``sp``), ``nzcv`` for the flags, None for the zero register
    and anything else (SIMD/FP and system registers)."""
    return _CANONICAL.get(name)
