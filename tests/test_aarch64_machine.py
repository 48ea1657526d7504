"""A small unicorn AArch64 machine for the aarch64 relocator and emitter tests
(imported by them), and the checks that it behaves as those tests assume."""

from __future__ import annotations

import random

import unicorn as uc
from unicorn import arm64_const as a64

PAGE = 0x1000
GPRS = tuple(f"x{n}" for n in range(31))
UC_REG = {name: getattr(a64, f"UC_ARM64_REG_X{n}") for n, name in enumerate(GPRS)}
UC_REG["sp"] = a64.UC_ARM64_REG_SP
UC_REG["nzcv"] = a64.UC_ARM64_REG_NZCV
#: the four condition flags, NZCV bits 31..28
NZCV_MASK = 0xF000_0000


class Machine:
    """Regions of memory at chosen (kernel-like) addresses, code run between two addresses."""

    def __init__(self, regions: dict[int, int]) -> None:
        """``regions``: base -> size (page multiples)."""
        self.uc = uc.Uc(uc.UC_ARCH_ARM64, uc.UC_MODE_ARM)
        for base, size in regions.items():
            self.uc.mem_map(base, size)

    def write(self, address: int, data: bytes) -> None:
        self.uc.mem_write(address, data)
        # a block translated from earlier bytes at these addresses must not be reused
        self.uc.ctl_remove_cache(address & ~(PAGE - 1), address + len(data))

    def read(self, address: int, size: int) -> bytes:
        return bytes(self.uc.mem_read(address, size))

    def u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def put64(self, address: int, value: int) -> None:
        self.write(address, (value & (1 << 64) - 1).to_bytes(8, "little"))

    def set_regs(self, regs: dict[str, int]) -> None:
        for name, value in regs.items():
            self.uc.reg_write(UC_REG[name], value)

    def regs(self) -> dict[str, int]:
        return {name: self.uc.reg_read(reg) for name, reg in UC_REG.items()}

    @property
    def pc(self) -> int:
        return self.uc.reg_read(a64.UC_ARM64_REG_PC)

    def run(self, start: int, until: int, regs: dict[str, int] | None = None,
            count: int = 100_000) -> dict[str, int]:
        """Run from ``start`` until the pc reaches ``until``; the registers after."""
        if regs:
            self.set_regs(regs)
        # the stop at ``until`` is compiled into the blocks translated for this run: a
        # block translated earlier at ``until`` (from longer code) would run past it
        self.uc.ctl_remove_cache(until & ~(PAGE - 1), (until | (PAGE - 1)) + 1)
        self.uc.emu_start(start, until, count=count)
        assert self.pc == until, f"stopped at {self.pc:#x}, not {until:#x}"
        return self.regs()


def random_regs(rng: random.Random, sp: int) -> dict[str, int]:
    regs = {name: rng.getrandbits(64) for name in GPRS}
    regs["sp"] = sp
    regs["nzcv"] = rng.getrandbits(4) << 28
    return regs


# --- the machine itself ----------------------------------------------------------------------
TEXT = 0xFFFF800010000000


def test_runs_code_at_kernel_addresses():
    m = Machine({TEXT: 0x1000})
    m.write(TEXT, bytes.fromhex("200080d2" "21040091"))        # mov x0, #1; add x1, x1, #1
    regs = m.run(TEXT, TEXT + 8, {"x1": 41})
    assert (regs["x0"], regs["x1"]) == (1, 42)


def test_rewritten_code_is_not_served_from_a_stale_translation():
    m = Machine({TEXT: 0x1000})
    m.write(TEXT, bytes.fromhex("200080d2"))                    # mov x0, #1
    assert m.run(TEXT, TEXT + 4)["x0"] == 1
    m.write(TEXT, bytes.fromhex("400080d2"))                    # mov x0, #2
    assert m.run(TEXT, TEXT + 4)["x0"] == 2


def test_flags_round_trip():
    m = Machine({TEXT: 0x1000})
    m.write(TEXT, bytes.fromhex("3f0000f1"))                    # cmp x1, #0
    assert m.run(TEXT, TEXT + 4, {"x1": 0, "nzcv": 0})["nzcv"] & NZCV_MASK == 0x6000_0000  # Z C
