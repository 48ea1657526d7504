"""The toy kernel built for AArch64 (``make -C images/toy ARCH=arm64``): its ELF
and ABI, its workload in unicorn's arm64 mode -- booted through the kernel's
own MMU set-up, or started at the post-MMU entry with unicorn's virtual TLB --
with the x86 toy's checksum for the same seed, its BRK dispatcher, and its
boot in qemu-system-aarch64 (-M virt)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import capstone
import pytest
import unicorn
from elftools.elf.elffile import ELFFile
from qemu_exit import run_to_exit
from unicorn import arm64_const as A

from ksim import images
from ksim.images import toy
from ksim.machine.unicorn import UnicornMachine

TOY_DIR = Path(__file__).resolve().parent.parent / "images" / "toy"
CROSS_GCC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-system-aarch64"

pytestmark = pytest.mark.skipif(shutil.which(CROSS_GCC) is None,
                                reason=f"{CROSS_GCC} is not installed "
                                       "(apt-get install gcc-aarch64-linux-gnu)")
needs_qemu = pytest.mark.skipif(shutil.which(QEMU) is None,
                                reason=f"{QEMU} is not installed (apt-get install qemu-system-arm)")

# The arm64 memory map (images/toy/include/asm-arm64.h)
KIMAGE_VADDR = 0xFFFF800008000000
KIMAGE_PADDR = 0x40200000
RAM_BASE, RAM_SIZE = 0x40000000, 128 << 20  # QEMU virt's default RAM
GIC_BASE, GIC_SIZE = 0x08000000, 0x01000000  # distributor, CPU interface, redistributors
UART_BASE, UART_SIZE = 0x09000000, 0x1000  # PL011: data register at +0, flags at +0x18
ENTRY = "primary_entry"  # the ELF entry, run at its physical address with the MMU off

#: symbols of the x86 toy's ABI that arm64 has too (ksim.images.toy), and its own
ABI_SYMBOLS = tuple(s for s in toy.ABI_SYMBOLS if s not in (toy.PVH_ENTRY, toy.TRAP_HANDLER)) + (
    "KSIM_TASK_COMM_OFFSET", "KSIM_TASK_STRUCT_SIZE", "init_stack", "ksim_brk_entry", ENTRY,
    "vectors", "timer_interrupt", "exception_common", "cpu_switch_to", "ret_from_fork",
    "sys_call_table", "semihosting_call",
)

#: the x86 toy's names that are Linux's arm64 names here (include/asm-arm64.h)
ARM64_NAMES = {**{n: "__arm64_sys_" + n[len("__x64_sys_"):] for n in toy.HARD_CASES["syscall_only"]},
               "do_syscall_64": "invoke_syscall", "__switch_to_asm": "cpu_switch_to"}

BRK0 = 0xD4200000  # brk #0: the patch area's filler
EXCP_UDEF, EXCP_BKPT = 1, 7  # unicorn's interrupt numbers (QEMU's exception indexes)
ESR_EC_UNKNOWN, ESR_EC_BRK64, ESR_IL = 0x00, 0x3C, 1 << 25
SEMIHOST_SYS_EXIT, ADP_STOPPED_APP_EXIT = 0x18, 0x20026
EXIT_SUCCESS, EXIT_FAILURE = 33, 35  # as the x86 toy's isa-debug-exit statuses
CHECKSUM = re.compile(toy.CHECKSUM_LINE)


# --- building and reading the image --------------------------------------------------------------
@pytest.fixture(scope="session")
def arm64_elf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy-arm64")
    proc = subprocess.run(["make", "-C", str(TOY_DIR), "ARCH=arm64", f"O={out}", "-j2"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out / "toy.elf"


@pytest.fixture(scope="session")
def x86_elf() -> Path:
    return images.path("toy")


@dataclass
class Segment:
    vaddr: int
    paddr: int
    memsz: int
    offset: int
    data: bytes
    flags: int


class Elf:
    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.machine = elf["e_machine"]
            self.entry = elf["e_entry"]
            self.symbols: dict[str, int] = {}
            self.funcs: dict[str, tuple[int, int]] = {}
            self.absolute: set[str] = set()
            for sym in elf.get_section_by_name(".symtab").iter_symbols():
                if not sym.name or sym.name.startswith("$"):
                    continue  # AArch64 mapping symbols ($x, $d)
                self.symbols.setdefault(sym.name, sym["st_value"])
                if sym["st_shndx"] == "SHN_ABS":
                    self.absolute.add(sym.name)
                if sym["st_info"]["type"] == "STT_FUNC":
                    self.funcs[sym.name] = (sym["st_value"], sym["st_size"])
            self.segments = [Segment(p["p_vaddr"], p["p_paddr"], p["p_memsz"], p["p_offset"],
                                     p.data(), p["p_flags"])
                             for p in elf.iter_segments() if p["p_type"] == "PT_LOAD"]
            self.sections = {s.name: (s["sh_addr"], s["sh_size"], s["sh_type"])
                             for s in elf.iter_sections()}
        offsets = {s.vaddr - s.paddr for s in self.segments}
        assert len(offsets) == 1
        self.voffset = offsets.pop()
        self.md = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)

    def read(self, address: int, n: int) -> bytes:
        for s in self.segments:
            if s.vaddr <= address and address + n <= s.vaddr + len(s.data):
                return s.data[address - s.vaddr:address - s.vaddr + n]
        raise ValueError(f"{address:#x} is not file-backed")

    def insns(self, name: str) -> list[tuple[int, int, str, str]]:
        start, size = self.funcs[name]
        return list(self.md.disasm_lite(self.read(start, size), start))


class PatchedElf:
    """An ELF file whose loaded bytes can be rewritten at virtual addresses."""

    def __init__(self, elf: Elf) -> None:
        self.elf = elf
        self.data = bytearray(elf.path.read_bytes())

    def write(self, address: int, data: bytes) -> None:
        for s in self.elf.segments:
            if s.vaddr <= address and address + len(data) <= s.vaddr + len(s.data):
                o = s.offset + address - s.vaddr
                self.data[o:o + len(data)] = data
                return
        raise ValueError(f"{address:#x} is not file-backed")

    def save(self, path: Path) -> Path:
        path.write_bytes(bytes(self.data))
        return path


# --- the kernel in unicorn -----------------------------------------------------------------------
@dataclass
class Result:
    serial: str
    checksum: int
    halted: bool  # execution reached ksim_halt
    exit_status: int | None  # the code of a semihosting SYS_EXIT (a panic), else None
    bench_cycles: int


class Arm64Toy:
    """The arm64 toy kernel in unicorn (UC_ARCH_ARM64, a Cortex-A57).

    ``mmu=True``: RAM at its physical address, the run starts at primary_entry
    (MMU off, x0 = 0: no DTB) and the kernel turns on the MMU with its own page
    tables, which unicorn walks (UC_TLB_CPU).  EL1 is made AArch64 and
    non-secure first (SCR_EL3.RW|NS, HCR_EL2.RW): unicorn's Cortex-A57 comes out
    of reset with SCR_EL3.RW = 0, and then walks EL1's tables as AArch32 LPAE
    ones.  ``mmu=False``: the run starts at the post-MMU entry ksim_entry64
    with SP = init_stack_top, and unicorn's virtual TLB maps what head.S's
    tables map (the image at KIMAGE_VADDR, the devices one to one).

    Runs end at ksim_halt; a panic ends in semihosting_call (SYS_EXIT, as QEMU
    -semihosting would see it).  The UART's data register is captured; the GIC
    reads as zero and no interrupt is delivered.  Exceptions (BRK, undefined
    instructions) are delivered to the kernel's vectors as the CPU would.
    """

    def __init__(self, elf: Elf, mmu: bool = True) -> None:
        self.elf, self.mmu = elf, mmu
        uc = self.uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
        uc.ctl_set_cpu_model(A.UC_CPU_ARM64_A57)
        uc.ctl_set_tlb_mode(unicorn.UC_TLB_CPU if mmu else unicorn.UC_TLB_VIRTUAL)
        uc.reg_write(A.UC_ARM64_REG_CP_REG, (1, 1, 3, 6, 0, 0x401))  # SCR_EL3: RW | NS
        uc.reg_write(A.UC_ARM64_REG_CP_REG, (1, 1, 3, 4, 0, 1 << 31))  # HCR_EL2: RW
        uc.reg_write(A.UC_ARM64_REG_PSTATE, 0x3C5)  # EL1h, DAIF masked
        uc.mem_map(RAM_BASE, RAM_SIZE)
        for s in elf.segments:
            uc.mem_write(s.paddr, s.data)
        self.serial = bytearray()
        uc.mmio_map(UART_BASE, UART_SIZE, lambda *_: 0, None, self._on_uart, None)
        uc.mmio_map(GIC_BASE, GIC_SIZE, lambda *_: 0, None, lambda *_: None, None)
        self.exit_status: int | None = None
        self.error: str | None = None
        uc.hook_add(unicorn.UC_HOOK_INTR, self._on_interrupt)
        sh = elf.symbols["semihosting_call"]
        uc.hook_add(unicorn.UC_HOOK_CODE, self._on_semihosting, begin=sh, end=sh)
        if not mmu:
            uc.hook_add(unicorn.UC_HOOK_TLB_FILL, self._on_tlb_fill)

    # memory of the kernel image (virtual addresses) and registers
    def pa(self, va: int) -> int:
        return va - self.elf.voffset if va >= KIMAGE_VADDR else va

    def read(self, va: int, n: int) -> bytes:
        return bytes(self.uc.mem_read(self.pa(va), n))

    def write(self, va: int, data: bytes) -> None:
        self.uc.mem_write(self.pa(va), data)

    def read_u64(self, va: int) -> int:
        return struct.unpack("<Q", self.read(va, 8))[0]

    def reg(self, r: int) -> int:
        return self.uc.reg_read(r)

    # hooks
    def _on_uart(self, _uc, offset, _size, value, _ud) -> None:
        if offset == 0:
            self.serial.append(value & 0xFF)

    def _on_tlb_fill(self, _uc, vaddr, _access, entry, _ud) -> bool:
        if vaddr >= KIMAGE_VADDR:
            entry.paddr = vaddr - self.elf.voffset
        elif vaddr < 0x80000000:  # TTBR0's one-to-one map: devices, RAM
            entry.paddr = vaddr
        else:
            return False
        entry.perms = unicorn.UC_PROT_ALL
        return True

    def _on_semihosting(self, uc, _address, _size, _ud) -> None:
        if self.reg(A.UC_ARM64_REG_X0) == SEMIHOST_SYS_EXIT:
            reason, code = struct.unpack("<QQ", self.read(self.reg(A.UC_ARM64_REG_X1), 16))
            self.exit_status = code if reason == ADP_STOPPED_APP_EXIT else 1
            uc.emu_stop()

    def _on_interrupt(self, uc, intno, _ud) -> None:
        pc = self.reg(A.UC_ARM64_REG_PC)
        if intno == EXCP_BKPT:
            imm16 = (struct.unpack("<I", self.read(pc, 4))[0] >> 5) & 0xFFFF
            self.take_exception(ESR_EC_BRK64 << 26 | ESR_IL | imm16)
        elif intno == EXCP_UDEF:
            self.take_exception(ESR_EC_UNKNOWN << 26 | ESR_IL)
        else:
            self.error = f"unexpected exception {intno} at {pc:#x}"
            uc.emu_stop()

    def take_exception(self, esr: int) -> None:
        """A synchronous exception taken to EL1 (ARM ARM D1.10), at the current PC."""
        pc, pstate = self.reg(A.UC_ARM64_REG_PC), self.reg(A.UC_ARM64_REG_PSTATE)
        self.uc.reg_write(A.UC_ARM64_REG_CP_REG, (4, 0, 3, 0, 0, pstate))  # SPSR_EL1
        self.uc.reg_write(A.UC_ARM64_REG_ELR_EL1, pc)
        self.uc.reg_write(A.UC_ARM64_REG_ESR_EL1, esr)
        self.uc.reg_write(A.UC_ARM64_REG_PSTATE, 0x3C5)
        from_spx = (pstate & 0xF) == 0x5  # EL1h: "current EL with SPx" vectors
        self.uc.reg_write(A.UC_ARM64_REG_PC,
                          self.reg(A.UC_ARM64_REG_VBAR_EL1) + (0x200 if from_spx else 0))

    def run(self, seed: int | None = None, iterations: int | None = None,
            bench_calls: int | None = None, timeout: float = 60.0) -> Result:
        sym = self.elf.symbols
        for name, value in ((toy.WORKLOAD_SEED, seed), (toy.WORKLOAD_ITERATIONS, iterations),
                            (toy.BENCH_CALLS, bench_calls)):
            if value is not None:
                self.write(sym[name], struct.pack("<Q", value))
        if self.mmu:
            start = self.pa(sym[ENTRY])
            self.uc.reg_write(A.UC_ARM64_REG_X0, 0)
        else:
            start = sym[toy.ENTRY]
            self.uc.reg_write(A.UC_ARM64_REG_SP, sym[toy.INIT_STACK_TOP])
        try:
            self.uc.emu_start(start, sym[toy.HALT], timeout=int(timeout * 1e6))
        except unicorn.UcError as exc:
            raise AssertionError(f"{exc} at {self.reg(A.UC_ARM64_REG_PC):#x}; serial:\n"
                                 f"{self.serial.decode(errors='replace')}") from None
        assert self.error is None, self.error
        return Result(self.serial.decode(errors="replace"),
                      self.read_u64(sym[toy.WORKLOAD_CHECKSUM]),
                      self.reg(A.UC_ARM64_REG_PC) == sym[toy.HALT], self.exit_status,
                      self.read_u64(sym[toy.BENCH_CYCLES]))


def unicorn_run(elf: Elf, seed: int | None = None, **kw) -> Result:
    return Arm64Toy(elf, mmu=kw.pop("mmu", True)).run(seed=seed, **kw)


def x86_checksum(x86_elf: Path, seed: int) -> int:
    return UnicornMachine(x86_elf).run(seed=seed).checksum


# --- a hand-made BRK splice ------------------------------------------------------------------------
def _branch(src: int, dst: int) -> bytes:
    off = dst - src
    assert off % 4 == 0 and -(1 << 27) <= off < (1 << 27)
    return struct.pack("<I", 0x14000000 | ((off >> 2) & 0x3FFFFFF))


def brk_patch(elf: Elf, site: int, patch: int, marker: bytes | None) -> bytes:
    """Patch code for a BRK at ``site``: an optional character on the UART, the
    displaced instruction, a branch back -- the shape of a ksim trap splice."""
    code = b""
    if marker is not None:
        code += struct.pack("<5I",
                            0xA9BF07E0,  # stp x0, x1, [sp, #-16]!
                            0xD2A12000,  # mov x0, #0x09000000 (the PL011's data register)
                            0x52800001 | marker[0] << 5,  # mov w1, #marker
                            0xB9000001,  # str w1, [x0]
                            0xA8C107E0)  # ldp x0, x1, [sp], #16
    first = elf.read(site, 4)
    _a, _s, mnem, _ops = next(elf.md.disasm_lite(first, site))
    assert not mnem.startswith(("adr", "b", "cb", "tb", "ldr")), f"{mnem} is PC-relative"
    code += first
    return code + _branch(patch + len(code), site + 4)


def brk_elf(elf: Elf, tmp_path: Path, function: str, in_table: bool, marker: bytes | None = b"#",
            imm16: int = 0) -> Elf:
    f = PatchedElf(elf)
    site, patch = elf.symbols[function], elf.symbols[toy.PATCH_AREA]
    f.write(patch, brk_patch(elf, site, patch, marker))
    if in_table:
        f.write(elf.symbols[toy.TRAP_TABLE], struct.pack("<QQ", site, patch))
        f.write(elf.symbols[toy.TRAP_COUNT], struct.pack("<Q", 1))
    f.write(site, struct.pack("<I", BRK0 | imm16 << 5))
    return Elf(f.save(tmp_path / f"toy-arm64-brk-{function}.elf"))


def count_calls(elf: Elf, function: str, seed: int) -> int:
    m = Arm64Toy(elf)
    hits = []
    at = elf.symbols[function]
    m.uc.hook_add(unicorn.UC_HOOK_CODE, lambda *_: hits.append(1), begin=at, end=at)
    m.run(seed=seed)
    return len(hits)


# --- the ELF ---------------------------------------------------------------------------------------
def test_elf_is_aarch64_linked_high_loaded_in_virt_ram(arm64_elf):
    elf = Elf(arm64_elf)
    assert elf.machine == "EM_AARCH64"
    assert elf.symbols["_text"] == KIMAGE_VADDR == elf.symbols[ENTRY] == elf.entry
    assert elf.voffset == KIMAGE_VADDR - KIMAGE_PADDR
    text = next(s for s in elf.segments if s.vaddr == KIMAGE_VADDR)
    assert text.paddr == KIMAGE_PADDR and text.flags & 1  # PF_X
    assert all(RAM_BASE + (2 << 20) <= s.paddr and s.paddr + s.memsz <= RAM_BASE + RAM_SIZE
               for s in elf.segments)  # QEMU's DTB fits in the first 2 MiB


def test_abi_symbols(arm64_elf):
    elf = Elf(arm64_elf)
    missing = [s for s in ABI_SYMBOLS if s not in elf.symbols]
    assert not missing
    for name, value in (("KSIM_TASK_PID_OFFSET", 16), ("KSIM_TASK_COMM_OFFSET", 144),
                        ("KSIM_TASK_STRUCT_SIZE", 160)):
        assert name in elf.absolute and elf.symbols[name] == value
    # Linux's arm64 names for the syscall handlers, their dispatcher and the stack switch
    assert "__arm64_sys_getpid" in elf.funcs and "invoke_syscall" in elf.funcs
    assert not [n for n in elf.symbols if n.startswith("__x64_sys")]


def test_boot_and_trap_paths_are_in_never_instrumented_ranges(arm64_elf):
    """ksim refuses sites in [__ksim_noinstr_start, __ksim_noinstr_end) (and, as
    in Linux, in .entry.text / .noinstr.text): the boot code, the vectors, the
    BRK dispatcher, the interrupt and exception paths, the stack switch."""
    elf = Elf(arm64_elf)
    lo, hi = elf.symbols["__ksim_noinstr_start"], elf.symbols["__ksim_noinstr_end"]
    assert elf.symbols["__entry_text_start"] >= lo and elf.symbols["__noinstr_text_end"] <= hi
    for name in (ENTRY, toy.ENTRY, "vectors", "ksim_brk_entry", "timer_interrupt",
                 "exception_common", "cpu_switch_to", "ret_from_fork", "semihosting_call",
                 "ksim_unknown_trap", "do_exception"):
        assert lo <= elf.symbols[name] < hi, name
    for name in toy.WORKLOAD_FUNCTIONS:
        name = ARM64_NAMES.get(name, name)
        assert not lo <= elf.symbols[name] < hi, name


def test_every_function_has_one_name_and_a_size(arm64_elf):
    elf = Elf(arm64_elf)
    assert len(elf.funcs) >= 150
    assert not [n for n in elf.funcs if re.search(r"\.(isra|part|constprop|cold)", n)]
    assert not [n for n, (_a, size) in elf.funcs.items() if size == 0]
    starts = [a for a, _ in elf.funcs.values()]
    assert len(starts) == len(set(starts))


def test_patch_area_heap_and_trap_table(arm64_elf):
    elf = Elf(arm64_elf)
    lo, hi = elf.symbols[toy.PATCH_AREA], elf.symbols[toy.PATCH_AREA_END]
    assert hi - lo == 1 << 20 and lo % 4096 == 0
    assert lo - elf.symbols["_etext"] < 4096  # right after the text: in a B's +-128 MiB of all of it
    assert set(struct.unpack(f"<{(hi - lo) // 4}I", elf.read(lo, hi - lo))) == {BRK0}
    assert elf.symbols[toy.HEAP_END] - elf.symbols[toy.HEAP] == 1 << 20
    assert elf.sections[".ksim_heap"][2] == "SHT_NOBITS"
    # the trap table and its count are file-backed (.data): a loader may fill them in the file
    table = elf.symbols[toy.TRAP_TABLE]
    assert elf.read(table, 16 * toy.TRAP_SLOTS) == bytes(16 * toy.TRAP_SLOTS)
    assert elf.read(elf.symbols[toy.TRAP_COUNT], 8) == bytes(8)


def test_vectors_are_aligned_and_route_brk(arm64_elf):
    elf = Elf(arm64_elf)
    vectors = elf.symbols["vectors"]
    assert vectors % 2048 == 0 and elf.funcs["vectors"][1] == 2048
    sync = list(elf.md.disasm_lite(elf.read(vectors + 0x200, 0x80), vectors + 0x200))
    assert any(m == "b.eq" and int(o.lstrip("#"), 16) == elf.symbols["ksim_brk_entry"]
               for _a, _s, m, o in sync)
    # ksim_brk_entry ends its routed path with eret, and touches only x0..x3
    body = elf.insns("ksim_brk_entry")
    assert "eret" in [m for _a, _s, m, _o in body]
    regs = {r for _a, _s, _m, o in body for r in re.findall(r"\b[xw](\d+)\b", o)}
    assert regs <= {"0", "1", "2", "3"}


def test_arm64_hard_cases(arm64_elf):
    elf = Elf(arm64_elf)
    # a PC-relative first instruction (adrp) to relocate
    for name in ("do_timer", "get_jiffies_64"):
        assert elf.insns(name)[0][2] == "adrp"
    # a loop head at entry+4, the second instruction
    for name in ("__sw_hweight64", "__memzero_qwords"):
        start = elf.funcs[name][0]
        assert any(m.startswith("b") and o.lstrip("#").startswith("0x")
                   and int(o.lstrip("#"), 16) == start + 4 for _a, _s, m, o in elf.insns(name))
    # tail calls: a b to another function's entry
    starts = {a for a, _ in elf.funcs.values()}
    for name in ("kmalloc", "kfree", "schedule"):
        assert any(m == "b" and int(o.lstrip("#"), 16) in starts for _a, _s, m, o in elf.insns(name))
    # jump tables: an indirect br
    for name in ("workload_step", "e100_exec_cmd"):
        assert "br" in [m for _a, _s, m, _o in elf.insns(name)]
    # two-instruction functions, reached through tables
    for name in ("__arm64_sys_getuid", "ramfs_open"):
        assert elf.funcs[name][1] == 8


# --- the workload in unicorn -------------------------------------------------------------------------
def test_unicorn_boot_through_the_kernels_mmu_matches_x86(arm64_elf, x86_elf):
    elf = Elf(arm64_elf)
    r = unicorn_run(elf, seed=42)
    assert r.halted and r.exit_status is None
    m = CHECKSUM.search(r.serial)
    assert m and int(m["seed"], 16) == 42 and int(m["checksum"], 16) == r.checksum != 0
    assert r.checksum == x86_checksum(x86_elf, 42)
    assert "toy: irq_ticks=0 " in r.serial


def test_workload_functions_hit_as_often_as_on_x86(arm64_elf, x86_elf):
    """Same seed, same run: every workload function is entered as many times as
    in the x86 toy (the syscall handlers and their dispatcher by their arm64 names)."""
    elf = Elf(arm64_elf)
    m = Arm64Toy(elf)
    arm = dict.fromkeys(toy.WORKLOAD_FUNCTIONS, 0)
    for name in arm:
        def hit(*_a, name=name):
            arm[name] += 1
        at = elf.symbols[ARM64_NAMES.get(name, name)]
        m.uc.hook_add(unicorn.UC_HOOK_CODE, hit, begin=at, end=at)
    m.run(seed=7)
    x86 = UnicornMachine(x86_elf)
    x = dict.fromkeys(toy.WORKLOAD_FUNCTIONS, 0)
    for name in x:
        def xhit(_m, _a, name=name):
            x[name] += 1
        x86.hook_code(x86.address_of(name), xhit)
    x86.run(seed=7)
    assert arm == x and all(arm.values())


def test_unicorn_post_mmu_entry_with_virtual_tlb(arm64_elf, x86_elf):
    elf = Elf(arm64_elf)
    r = unicorn_run(elf, mmu=False)
    assert r.halted
    assert int(CHECKSUM.search(r.serial)["seed"], 16) == toy.DEFAULT_SEED
    assert r.checksum == unicorn_run(elf).checksum == x86_checksum(x86_elf, toy.DEFAULT_SEED)


def test_unicorn_seeds(arm64_elf):
    elf = Elf(arm64_elf)
    assert unicorn_run(elf, seed=5).checksum == unicorn_run(elf, seed=5).checksum
    assert len({unicorn_run(elf, seed=s).checksum for s in (1, 2, 3)}) == 3
    short = unicorn_run(elf, seed=5, iterations=100)
    assert "iterations=100 " in short.serial


def test_unicorn_bench_mode(arm64_elf):
    r = unicorn_run(Elf(arm64_elf), bench_calls=1000)
    assert r.halted and r.checksum == 0
    assert re.search(r"toy: bench calls=1000 cycles=\d+", r.serial)


def test_unicorn_brk_dispatch_through_the_kernels_handler(arm64_elf, tmp_path):
    """A BRK at kmem_cache_alloc's entry, routed by the kernel's own vectors and
    ksim_brk_entry: one '#' per call, the same checksum as without it."""
    elf = Elf(arm64_elf)
    plain = unicorn_run(elf, seed=9).checksum
    trapped = brk_elf(elf, tmp_path, "kmem_cache_alloc", in_table=True, imm16=0x4)
    r = unicorn_run(trapped, seed=9)
    assert r.halted and r.checksum == plain
    calls = count_calls(elf, "kmem_cache_alloc", 9)
    boot = r.serial[r.serial.index("toy: ksim toy kernel booting"):]
    assert boot.count("#") == calls > 0


def test_unicorn_brk_not_in_table_panics(arm64_elf, tmp_path):
    elf = brk_elf(Elf(arm64_elf), tmp_path, "kmem_cache_alloc", in_table=False)
    r = unicorn_run(elf)
    assert not r.halted and r.exit_status == EXIT_FAILURE
    site = elf.symbols["kmem_cache_alloc"]
    assert f"toy: panic: brk at 0x{site:016x} is not in ksim_trap_table (0 entries)" in r.serial


def test_unicorn_undefined_instruction_panics(arm64_elf, tmp_path):
    elf = Elf(arm64_elf)
    f = PatchedElf(elf)
    f.write(elf.symbols["kmem_cache_alloc"], struct.pack("<I", 0))  # udf #0
    r = unicorn_run(Elf(f.save(tmp_path / "toy-arm64-udf.elf")))
    assert r.exit_status == EXIT_FAILURE
    assert "toy: panic: exception (vector 200) esr 2000000 at pc" in r.serial


# --- QEMU -------------------------------------------------------------------------------------------
def boot(elf: Path, append: str = "", machine: str = "virt", cpu: str = "cortex-a57",
         semihosting: bool = True, timeout: float = 60) -> tuple[int, str]:
    """Boot in qemu-system-aarch64; return (exit status, serial output).  No QEMU outlives it."""
    cmd = [QEMU, "-M", machine, "-cpu", cpu, "-nographic", "-no-reboot", "-kernel", str(elf)]
    if semihosting:
        cmd.append("-semihosting")
    if append:
        cmd += ["-append", append]
    return run_to_exit(cmd, timeout)


@needs_qemu
def test_qemu_boot_prints_the_x86_checksum(arm64_elf, x86_elf):
    status, out = boot(arm64_elf, "seed=42")
    assert status == EXIT_SUCCESS, out[-2000:]
    m = CHECKSUM.search(out)
    assert m and int(m["seed"], 16) == 42 and m["iterations"] == "3000"
    assert int(m["checksum"], 16) == unicorn_run(Elf(arm64_elf), seed=42).checksum
    assert int(m["checksum"], 16) == x86_checksum(x86_elf, 42)
    ticks = re.search(r"toy: irq_ticks=(\d+) switches=(\d+)", out)
    assert ticks and int(ticks[1]) > 0  # the generic timer's interrupts arrive


@needs_qemu
@pytest.mark.parametrize("machine,cpu", [("virt,gic-version=3", "cortex-a57"),
                                         ("virt,virtualization=on", "max")])
def test_qemu_other_configurations(arm64_elf, machine, cpu):
    """GICv3 instead of GICv2; entry at EL2 (the kernel drops to EL1, PSCI by smc)."""
    status, out = boot(arm64_elf, "seed=42", machine=machine, cpu=cpu)
    assert status == EXIT_SUCCESS, out[-2000:]
    assert int(CHECKSUM.search(out)["checksum"], 16) == unicorn_run(Elf(arm64_elf), seed=42).checksum
    assert int(re.search(r"toy: irq_ticks=(\d+)", out)[1]) > 0


@needs_qemu
def test_qemu_default_seed_and_psci_off_without_semihosting(arm64_elf):
    status, out = boot(arm64_elf, semihosting=False)
    assert status == 0, out[-2000:]  # PSCI SYSTEM_OFF
    m = CHECKSUM.search(out)
    assert int(m["seed"], 16) == toy.DEFAULT_SEED
    assert int(m["checksum"], 16) == unicorn_run(Elf(arm64_elf)).checksum


@needs_qemu
def test_qemu_bench_mode(arm64_elf):
    status, out = boot(arm64_elf, "bench=1000")
    assert status == EXIT_SUCCESS
    m = re.search(r"toy: bench calls=1000 cycles=(\d+)", out)
    assert m and int(m[1]) > 0, out[-1000:]


@needs_qemu
def test_qemu_brk_dispatch_matches_unicorn(arm64_elf, tmp_path):
    elf = Elf(arm64_elf)
    trapped = brk_elf(elf, tmp_path, "kmem_cache_alloc", in_table=True)
    status, out = boot(trapped.path, "seed=9")
    assert status == EXIT_SUCCESS, out[-2000:]
    uni = unicorn_run(trapped, seed=9)
    assert int(CHECKSUM.search(out)["checksum"], 16) == uni.checksum == unicorn_run(elf, seed=9).checksum
    boot_text = out[out.index("toy: ksim toy kernel booting"):]
    assert boot_text.count("#") == uni.serial.count("#") > 0


@needs_qemu
def test_qemu_brk_not_in_table_panics(arm64_elf, tmp_path):
    elf = brk_elf(Elf(arm64_elf), tmp_path, "kmem_cache_alloc", in_table=False)
    status, out = boot(elf.path)
    assert status == EXIT_FAILURE
    assert "is not in ksim_trap_table" in out
