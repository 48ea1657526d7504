"""The toy kernel boots in QEMU (TCG) through its PVH note and agrees with unicorn:
same checksum for the same seed, and the same int3 dispatch through
ksim_trap_table by the kernel's own #BP handler."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from qemu_exit import run_to_exit
from toy_traps import first_insn, trap_patch

from ksim.images import toy
from ksim.machine.unicorn import UnicornMachine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                       reason="qemu-system-x86_64 is not installed"),
]

CHECKSUM = re.compile(toy.CHECKSUM_LINE)
TIMEOUT = 120


def boot(elf: Path, append: str = "", timeout: float = TIMEOUT) -> tuple[int, str]:
    """Boot in QEMU under TCG; return (exit status, serial output).  No QEMU outlives it."""
    cmd = ["qemu-system-x86_64", "-kernel", str(elf), "-nographic", "-no-reboot",
           "-accel", "tcg", "-m", "256M", "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
    if append:
        cmd += ["-append", append]
    return run_to_exit(cmd, timeout)


def unicorn_run(elf: Path, seed: int, trap_table: bool = False):
    m = UnicornMachine(elf)
    if trap_table:
        m.use_trap_table()
    return m.run(seed=seed)


def test_boots_prints_checksum_and_matches_unicorn(toy_path):
    status, out = boot(toy_path, "seed=42")
    assert status == toy.QEMU_EXIT_SUCCESS, out[-2000:]
    m = CHECKSUM.search(out)
    assert m, out[-2000:]
    assert int(m["seed"], 16) == 42
    assert int(m["checksum"], 16) == unicorn_run(toy_path, 42).checksum


def test_default_seed_matches_unicorn(toy_path):
    status, out = boot(toy_path)
    assert status == toy.QEMU_EXIT_SUCCESS
    m = CHECKSUM.search(out)
    assert int(m["seed"], 16) == toy.DEFAULT_SEED
    assert int(m["checksum"], 16) == unicorn_run(toy_path, toy.DEFAULT_SEED).checksum


def test_bench_mode(toy_path):
    status, out = boot(toy_path, "bench=1000")
    assert status == toy.QEMU_EXIT_SUCCESS
    assert re.search(r"toy: bench calls=1000 cycles=\d+", out), out[-1000:]


# --- trap dispatch by the kernel's own #BP handler ----------------------------------------------
class ElfFile:
    """Patch bytes of an ELF file at virtual addresses (loaded, file-backed bytes only)."""

    def __init__(self, path: Path) -> None:
        self.data = bytearray(path.read_bytes())
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.segs = [(p["p_vaddr"], p["p_offset"], p["p_filesz"])
                         for p in elf.iter_segments() if p["p_type"] == "PT_LOAD"]
            self.syms = {s.name: s["st_value"]
                         for s in elf.get_section_by_name(".symtab").iter_symbols() if s.name}

    def _off(self, address: int, n: int) -> int:
        for vaddr, off, filesz in self.segs:
            if vaddr <= address and address + n <= vaddr + filesz:
                return off + address - vaddr
        raise ValueError(f"{address:#x} is not file-backed")

    def read(self, address: int, n: int) -> bytes:
        o = self._off(address, n)
        return bytes(self.data[o:o + n])

    def write(self, address: int, data: bytes) -> None:
        o = self._off(address, len(data))
        self.data[o:o + len(data)] = data


def _trapped_elf(toy_path: Path, tmp_path: Path, function: str, in_table: bool) -> Path:
    """A copy of the kernel with an int3 at ``function``'s entry; the patch prints
    '#' on COM1, runs the displaced instruction and jumps back."""
    f = ElfFile(toy_path)
    site, patch = f.syms[function], f.syms[toy.PATCH_AREA]
    first = first_insn(f, site)
    f.write(patch, trap_patch(site, patch, first, b"#"))
    if in_table:
        f.write(f.syms[toy.TRAP_TABLE], struct.pack("<QQ", site, patch))
        f.write(f.syms[toy.TRAP_COUNT], struct.pack("<Q", 1))
    f.write(site, b"\xcc")
    out = tmp_path / f"toy-int3-{function}.elf"
    out.write_bytes(bytes(f.data))
    return out


def test_int3_dispatch_matches_unicorn(toy_path, tmp_path):
    elf = _trapped_elf(toy_path, tmp_path, "kmem_cache_alloc", in_table=True)
    status, out = boot(elf, "seed=9")
    assert status == toy.QEMU_EXIT_SUCCESS, out[-2000:]
    qemu_sum = int(CHECKSUM.search(out)["checksum"], 16)
    uni = unicorn_run(elf, 9, trap_table=True)
    plain = unicorn_run(toy_path, 9)
    # the patch changes nothing but the serial output
    assert qemu_sum == uni.checksum == plain.checksum
    # one '#' per call of kmem_cache_alloc, the same number under both
    boot_text = out[out.index("toy: ksim toy kernel booting"):]
    assert boot_text.count("#") == uni.serial.count("#") > 0


def test_int3_not_in_table_panics(toy_path, tmp_path):
    elf = _trapped_elf(toy_path, tmp_path, "kmem_cache_alloc", in_table=False)
    status, out = boot(elf)
    assert status == toy.QEMU_EXIT_FAILURE
    assert "is not in ksim_trap_table" in out
