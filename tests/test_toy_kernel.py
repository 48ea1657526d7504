"""The toy kernel: its build, its ABI, its hard cases (checked by disassembly),
its workload's determinism, and the unicorn machine that runs it."""

from __future__ import annotations

import re
import struct
from functools import cache
from pathlib import Path

import capstone
import pytest
from elftools.elf.elffile import ELFFile
from toy_traps import first_insn, trap_patch

from ksim import images
from ksim.errors import EmulationError, ImageBuildError, UnknownImage
from ksim.images import toy
from ksim.machine.unicorn import UnicornMachine

BRANCH_PREFIXES = ("j", "loop", "call")


# --- reading the built ELF -----------------------------------------------------------
class Elf:
    """Functions, symbols, sections and segments of the built toy kernel."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.symbols: dict[str, int] = {}
            self.funcs: dict[str, tuple[int, int]] = {}
            for sym in elf.get_section_by_name(".symtab").iter_symbols():
                if sym.name:
                    self.symbols.setdefault(sym.name, sym["st_value"])
                    if sym["st_info"]["type"] == "STT_FUNC":
                        self.funcs[sym.name] = (sym["st_value"], sym["st_size"])
            self.sections = {s.name: (s["sh_addr"], s["sh_size"], s["sh_flags"], s.data()
                                      if s["sh_type"] != "SHT_NOBITS" else b"")
                             for s in elf.iter_sections()}
            self.loads = [(p["p_vaddr"], p["p_paddr"], p["p_memsz"], p["p_flags"])
                          for p in elf.iter_segments() if p["p_type"] == "PT_LOAD"]
            self.notes = [(n["n_name"], n["n_type"], n["n_desc"])
                          for seg in elf.iter_segments() if seg["p_type"] == "PT_NOTE"
                          for n in seg.iter_notes()]
        addr, _, _, data = self.sections[".text"]
        self.text_addr, self.text = addr, data
        self.md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        self.starts = {a: n for n, (a, _) in self.funcs.items()}

    def insns(self, name: str) -> list[tuple[int, int, str, str]]:
        start, size = self.funcs[name]
        code = self.text[start - self.text_addr:start - self.text_addr + size]
        out = list(self.md.disasm_lite(code, start))
        assert sum(i[1] for i in out) == size, f"{name} does not decode to its end"
        return out

    def branch_targets(self, name: str) -> list[tuple[int, str, int]]:
        """(address, mnemonic, target) of each direct branch or call in the function."""
        out = []
        for addr, _size, mnem, ops in self.insns(name):
            if mnem.startswith(BRANCH_PREFIXES) and re.fullmatch(r"0x[0-9a-f]+", ops):
                out.append((addr, mnem, int(ops, 16)))
        return out

    def all_direct_targets(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name in self.funcs:
            if self.funcs[name][1] == 0:
                continue
            for _addr, _m, target in self.branch_targets(name):
                out.setdefault(target, []).append(name)
        return out

    def pointers_in_data(self) -> set[int]:
        words: set[int] = set()
        for sec in (".rodata", ".data"):
            data = self.sections[sec][3]
            words.update(struct.unpack_from("<Q", data, i)[0] for i in range(0, len(data) - 7, 8))
        return words


@pytest.fixture(scope="module")
def elf(toy_path) -> Elf:
    return Elf(toy_path)


@cache
def _machine(path: str) -> UnicornMachine:
    return UnicornMachine(path)


@pytest.fixture
def machine(toy_path) -> UnicornMachine:
    """One machine per test session, reset before each test (hooks are removed after)."""
    m = _machine(str(toy_path))
    m.reset()
    yield m
    m._interrupt_fns.clear()


# --- build and registry ---------------------------------------------------------------
def test_registry():
    assert "toy" in images.names()
    spec = images.get("toy")
    assert spec.arch == "x86_64" and (spec.source_dir / "Makefile").is_file()
    with pytest.raises(UnknownImage):
        images.get("no-such-image")


def test_build_is_cached_per_source_hash(toy_path, monkeypatch, tmp_path):
    assert toy_path.is_file() and toy_path.name == "toy.elf"
    assert images.build("toy") == toy_path  # second call: the cached ELF
    assert images.source_hash("toy") in toy_path.parent.name


def test_build_failure_carries_compiler_output(monkeypatch, tmp_path):
    src = tmp_path / "broken"
    src.mkdir()
    (src / "Makefile").write_text("all:\n\t@echo 'broken.c:1: error: expected something' >&2; exit 1\n")
    monkeypatch.setenv("KSIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(images._REGISTRY, "broken",
                        images.ImageSpec("broken", "x86_64", src, "broken.elf"))
    with pytest.raises(ImageBuildError, match="expected something"):
        images.build("broken")


@pytest.mark.parametrize("where", ["a file", "under a file", "an images file"])
def test_a_cache_that_cannot_be_written_is_an_image_build_error(monkeypatch, tmp_path, capsys,
                                                                where):
    """KSIM_CACHE a regular file (NotADirectoryError) or a directory that cannot be
    made (FileExistsError) ended in a traceback: it is an ImageBuildError naming the
    path, and a command's error record."""
    import json

    from ksim.cli import main

    plain = tmp_path / "plain"
    plain.write_text("")
    cache = {"a file": plain, "under a file": plain / "cache", "an images file": tmp_path}[where]
    if where == "an images file":
        (tmp_path / "images").write_text("")
    monkeypatch.setenv("KSIM_CACHE", str(cache))
    with pytest.raises(ImageBuildError, match=f"in the cache {re.escape(str(cache))} .*"
                       f": {re.escape(str(cache / 'images'))}: (Not a directory|File exists)"):
        images.build("toy")
    assert main(["count", "tcp_sync_mss", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] == "image-build" and str(cache) in doc["message"]


@pytest.mark.slow
def test_concurrent_builds_share_one_result(tmp_path):
    """Two processes building at once into an empty cache: one builds, the other
    waits on the lock and takes the same ELF."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "KSIM_CACHE": str(tmp_path)}
    code = "from ksim import images; print(images.build('toy'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]).is_file()
    assert len(list((tmp_path / "images").glob("toy-*/toy.elf"))) == 1


# --- the ELF and its ABI -------------------------------------------------------------------
def test_at_least_150_functions(elf):
    assert len(elf.funcs) >= 150
    # one name per function: no compiler clones (foo.isra.0, foo.cold, ...)
    assert not [n for n in elf.funcs if "." in n]


def test_abi_symbols_present(elf):
    missing = [s for s in toy.ABI_SYMBOLS if s not in elf.symbols]
    assert not missing
    assert elf.symbols[toy.TASK_PID_OFFSET] == 16
    assert elf.symbols[toy.ENTRY] == elf.funcs[toy.ENTRY][0]


def test_linked_at_kernel_address_loaded_at_16mib(elf):
    assert elf.text_addr == toy.LINK_ADDRESS
    for vaddr, paddr, _memsz, _flags in elf.loads:
        assert vaddr - paddr == toy.START_KERNEL_MAP


def _in_load(elf, lo, hi, flags):
    return any(v <= lo and hi <= v + m and f & flags == flags for v, _p, m, f in elf.loads)


def test_patch_area_and_heap(elf):
    pa, pa_end = elf.symbols[toy.PATCH_AREA], elf.symbols[toy.PATCH_AREA_END]
    heap, heap_end = elf.symbols[toy.HEAP], elf.symbols[toy.HEAP_END]
    assert pa_end - pa == heap_end - heap == 1 << 20
    assert _in_load(elf, pa, pa_end, 0x7)  # rwx
    assert _in_load(elf, heap, heap_end, 0x6)  # rw
    # right after the text: every text byte reaches every patch byte with a rel32
    text_end = elf.text_addr + len(elf.text)
    assert 0 <= pa - text_end < 0x1000
    assert pa_end - elf.text_addr < 2**31
    addr, size, _flags, data = elf.sections[".ksim_patch"]
    assert (addr, size) == (pa, 1 << 20) and set(data) == {0xCC}


def test_pvh_note(elf):
    assert ("Xen", 18) in [(n, t) for n, t, _ in elf.notes]


# --- hard cases, each claim checked by disassembly --------------------------------------------
def test_hard_case_names_are_functions(elf):
    for kind, names in toy.HARD_CASES.items():
        for name in names:
            assert name in elf.funcs, f"{kind}: {name} is not a function"


def test_short_functions_are_short_and_called(elf):
    targets, pointers = elf.all_direct_targets(), elf.pointers_in_data()
    for name in toy.HARD_CASES["short"]:
        start, size = elf.funcs[name]
        assert 0 < size < 5, f"{name} is {size} bytes"
        assert elf.insns(name)[-1][2] == "ret"
        assert start in targets or start in pointers, f"{name} is never called"


def test_tail_calls(elf):
    for name in toy.HARD_CASES["tail_call"]:
        start, _ = elf.funcs[name]
        jumps = [t for _a, m, t in elf.branch_targets(name)
                 if m == "jmp" and t != start and t in elf.starts]
        assert jumps, f"{name} has no jmp to another function's entry"


def test_jump_tables(elf):
    for name in toy.HARD_CASES["jump_table"]:
        indirect = [(m, ops) for _a, _s, m, ops in elf.insns(name)
                    if m == "jmp" and "ptr [" in ops and "*8" in ops]
        assert indirect, f"{name} has no jmp through a table"


def test_rip_relative_within_first_5_bytes(elf):
    for name in toy.HARD_CASES["rip_relative_entry"]:
        start, _ = elf.funcs[name]
        early = [ops for a, _s, _m, ops in elf.insns(name) if a < start + 5]
        assert any("rip" in ops for ops in early), f"{name}: {early}"


def test_branch_targets_within_first_5_bytes(elf):
    for name in toy.HARD_CASES["branch_near_entry"]:
        start, _ = elf.funcs[name]
        near = [t for _a, _m, t in elf.branch_targets(name) if start < t < start + 5]
        assert near, f"{name} has no branch to entry+1..4"


def test_recursive(elf):
    for name in toy.HARD_CASES["recursive"]:
        start, _ = elf.funcs[name]
        assert any(m == "call" and t == start for _a, m, t in elf.branch_targets(name)), name


def test_syscall_only(elf):
    targets = elf.all_direct_targets()
    addr, size = elf.symbols[toy.SYSCALL_TABLE], 8 * 24
    rodata_addr, _, _, rodata = elf.sections[".rodata"]
    table = struct.unpack_from(f"<{size // 8}Q", rodata, addr - rodata_addr)
    for name in toy.HARD_CASES["syscall_only"]:
        start, _ = elf.funcs[name]
        assert start not in targets, f"{name} is called directly by {targets.get(start)}"
        assert start in table, f"{name} is not in sys_call_table"


# --- the workload in unicorn --------------------------------------------------------------------
CHECKSUM = re.compile(toy.CHECKSUM_LINE)


def test_workload_runs_and_prints_its_checksum(machine):
    r = machine.run(count_instructions=True)
    assert r.halted
    m = CHECKSUM.search(r.serial)
    assert m and int(m["checksum"], 16) == r.checksum != 0
    assert int(m["seed"], 16) == toy.DEFAULT_SEED
    assert 2_000_000 <= r.instructions <= 5_000_000
    assert machine.read_u64(machine.address_of(toy.WORKLOAD_DONE)) == 1


def test_same_seed_same_checksum(machine):
    first = machine.run(seed=42).checksum
    machine.reset()
    assert machine.run(seed=42).checksum == first


def test_different_seeds_different_checksums(machine):
    sums = set()
    for seed in (1, 2, 3, 0xDEADBEEF):
        machine.reset()
        sums.add(machine.run(seed=seed).checksum)
    assert len(sums) == 4


def _count(machine, names, seed):
    counts = dict.fromkeys(names, 0)
    removers = []
    for name in names:
        def hit(_m, _a, name=name):
            counts[name] += 1
        removers.append(machine.hook_code(machine.address_of(name), hit))
    machine.reset()
    machine.run(seed=seed)
    for remove in removers:
        remove()
    return counts


def test_workload_functions_hit_a_seed_dependent_deterministic_number_of_times(machine):
    names = list(toy.WORKLOAD_FUNCTIONS)
    a1, a2, b = _count(machine, names, 7), _count(machine, names, 7), _count(machine, names, 8)
    assert a1 == a2
    assert all(a1[n] > 0 for n in names), {n: c for n, c in a1.items() if not c}
    assert a1 != b


def test_every_hard_case_is_reached_by_the_workload(machine):
    names = sorted({n for kind in toy.HARD_CASES.values() for n in kind})
    counts = _count(machine, names, toy.DEFAULT_SEED)
    assert not [n for n, c in counts.items() if c == 0]


def test_context_switches_between_distinct_pids(machine):
    pids = set()
    off = machine.address_of(toy.TASK_PID_OFFSET)
    cur = machine.address_of(toy.CURRENT_TASK)

    def on_getpid(m, _a):
        task = m.read_u64(cur)
        pids.add(int.from_bytes(m.read(task + off, 4), "little"))

    remove = machine.hook_code(machine.address_of("__x64_sys_getpid"), on_getpid)
    machine.run()
    remove()
    assert pids == {1, 2, 3, 4, 5}


def test_bench_mode(machine):
    r = machine.run(bench_calls=1000, count_instructions=True)
    assert r.halted and r.bench_cycles > 0 and r.checksum == 0
    assert "bench calls=1000" in r.serial
    assert r.instructions < 100_000


# --- the machine: hooks, faults, traps ---------------------------------------------------------
class Boom(Exception):
    pass


def test_exception_in_code_hook_is_reraised(machine):
    def hook(_m, _a):
        raise Boom("from a hook")

    remove = machine.hook_code(machine.address_of("schedule"), hook)
    try:
        with pytest.raises(Boom, match="from a hook"):
            machine.run()
    finally:
        remove()
    # the machine is still usable
    machine.reset()
    assert machine.run().halted


def test_exception_in_interrupt_hook_is_reraised(machine):
    def on_int(_m, vector):
        raise Boom(f"vector {vector}")

    machine.hook_interrupt(on_int)
    machine.write(machine.address_of("schedule"), b"\xcc")
    with pytest.raises(Boom, match="vector 3"):
        machine.run()


def test_unmapped_access_raises_emulation_error_with_address(machine):
    # mov rax, qword ptr [0x10]: a null-pointer dereference at the entry
    machine.write(machine.address_of(toy.ENTRY), bytes.fromhex("488b042510000000"))
    with pytest.raises(EmulationError, match="0x10") as info:
        machine.run()
    assert info.value.address == 0x10


def test_invalid_instruction_raises_emulation_error(machine):
    entry = machine.address_of(toy.ENTRY)
    machine.write(entry, bytes.fromhex("0f0b"))  # ud2
    with pytest.raises(EmulationError, match="ksim_entry64") as info:
        machine.run()
    assert info.value.address == entry


def test_kernel_panic_raises_with_serial(machine):
    # kmem_cache_create returning NULL makes kernel_thread fail: the kernel panics
    machine.write(machine.address_of("kmem_cache_zalloc"), bytes.fromhex("31c0c3"))  # return NULL
    with pytest.raises(EmulationError, match="kernel_thread failed"):
        machine.run()


def test_run_timeout(machine):
    from ksim.errors import TargetTimeout

    machine.write(machine.address_of("start_kernel"), b"\xeb\xfe")  # jmp . (a hang)
    with pytest.raises(TargetTimeout, match="start_kernel"):
        machine.run(timeout=0.3)


def test_progress_callback_is_called(machine):
    from ksim.errors import TargetTimeout

    calls = []
    machine.write(machine.address_of("start_kernel"), b"\xeb\xfe")
    with pytest.raises(TargetTimeout):
        machine.run(timeout=0.8, progress=lambda: calls.append(1))
    assert calls


def test_run_without_reset_is_refused(machine):
    machine.run()
    with pytest.raises(EmulationError, match="reset"):
        machine.run()


def test_trap_table_dispatch(machine):
    """int3 at kmem_cache_alloc's entry, routed through ksim_trap_table as the
    kernel's #BP handler would: same checksum, one hit per call."""
    plain = machine.run(seed=5).checksum
    machine.reset()
    site = machine.address_of("kmem_cache_alloc")
    patch = machine.address_of(toy.PATCH_AREA)
    first = first_insn(machine, site)
    machine.write(patch, trap_patch(site, patch, first, None))
    machine.write(machine.address_of(toy.TRAP_TABLE), struct.pack("<QQ", site, patch))
    machine.write_u64(machine.address_of(toy.TRAP_COUNT), 1)
    hits = []
    remove_hook = machine.hook_code(patch, lambda m, a: hits.append(a))
    machine.write(site, b"\xcc")
    remove = machine.use_trap_table()
    try:
        assert machine.run(seed=5).checksum == plain
    finally:
        remove()
        remove_hook()
    machine.reset()
    calls = _count(machine, ["kmem_cache_alloc"], 5)["kmem_cache_alloc"]
    assert len(hits) == calls > 0


# --- the command line ---------------------------------------------------------------------------
def test_cli_images_json(capsys, toy_path):
    import json

    from ksim.cli import main

    assert main(["images", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    toy_row = next(r for r in rows if r["name"] == "toy")
    assert toy_row["arch"] == "x86_64" and toy_row["functions"] >= 150
    assert Path(toy_row["path"]) == toy_path


def test_cli_images_build_table(capsys, toy_path):
    from ksim.cli import main

    assert main(["images", "build", "toy"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["NAME", "ARCH", "FUNCS", "PATH"]
    assert str(toy_path) in out
    assert main(["images", "build", "no-such-image", "--json"]) == 2
