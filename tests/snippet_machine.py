"""A small unicorn x86-64 machine for running generated snippet code.

Virtual pages at kernel-like (or low) addresses are backed by low physical
memory through unicorn's virtual-TLB mode (in its default mode unicorn treats
addresses as physical and cannot fetch at a high canonical address, even one
mem_map accepted): a TLB-fill hook maps each virtual page of a region onto its
physical backing.
"""

from __future__ import annotations

import random

import unicorn as uc
from unicorn import x86_const as x86

PAGE = 0x1000
GPRS = ("rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
UC_REG = {name: getattr(x86, f"UC_X86_REG_{name.upper()}") for name in GPRS}
UC_REG["flags"] = x86.UC_X86_REG_RFLAGS
#: status flags a test may randomise: CF PF AF ZF SF OF (bit 1 always reads as 1)
STATUS_FLAGS = 0x8D5


class Machine:
    def __init__(self, regions: dict[int, int]) -> None:
        """``regions``: virtual base -> size (page multiples)."""
        self.uc = uc.Uc(uc.UC_ARCH_X86, uc.UC_MODE_64)
        self.uc.ctl_set_tlb_mode(uc.UC_TLB_VIRTUAL)
        self._phys: list[tuple[int, int, int]] = []
        phys = 0x100000
        for base, size in regions.items():
            self.uc.mem_map(phys, size)
            self._phys.append((base, size, phys))
            phys += size + 0x100000
        self.uc.hook_add(uc.UC_HOOK_TLB_FILL, self._fill)

    def _fill(self, _uc, vaddr, _access, entry, _data) -> bool:
        for base, size, phys in self._phys:
            if base <= vaddr < base + size:
                entry.paddr = phys + (vaddr - base)
                entry.perms = uc.UC_PROT_ALL
                return True
        return False

    def write(self, address: int, data: bytes) -> None:
        self.uc.mem_write(self._pa(address), data)

    def read(self, address: int, size: int) -> bytes:
        return bytes(self.uc.mem_read(self._pa(address), size))

    def u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def put64(self, address: int, value: int) -> None:
        self.write(address, (value & (1 << 64) - 1).to_bytes(8, "little"))

    def _pa(self, vaddr: int) -> int:
        for base, size, phys in self._phys:
            if base <= vaddr < base + size:
                return phys + (vaddr - base)
        raise ValueError(f"{vaddr:#x} is not in a region")

    def set_regs(self, regs: dict[str, int]) -> None:
        for name, value in regs.items():
            self.uc.reg_write(UC_REG[name], value)

    def regs(self) -> dict[str, int]:
        return {name: self.uc.reg_read(reg) for name, reg in UC_REG.items()}

    def run(self, code: bytes, at: int, regs: dict[str, int] | None = None) -> dict[str, int]:
        """Place ``code`` at ``at``, run it to its end, return the registers after."""
        # stale translations of earlier, longer code must not survive: pad the rest
        # of the page with hlt and drop every cached block of the code's pages
        tail = -(at + len(code)) % PAGE
        self.write(at, code + b"\xf4" * tail)
        self.uc.ctl_remove_cache(at & ~(PAGE - 1), at + len(code) + tail)
        if regs:
            self.set_regs(regs)
        self.uc.emu_start(at, at + len(code), count=1_000_000)
        return self.regs()


def random_regs(rng: random.Random, rsp: int) -> dict[str, int]:
    regs = {name: rng.getrandbits(64) for name in GPRS}
    regs["rsp"] = rsp
    regs["flags"] = 0x2 | (rng.getrandbits(12) & STATUS_FLAGS)
    return regs
