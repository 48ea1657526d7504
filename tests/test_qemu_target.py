"""The QEMU target against a real QEMU booting the toy kernel: ``toy`` in
qemu-system-x86_64 and ``toy-arm64`` in qemu-system-aarch64 (-M virt); the
tests that are not about one architecture's bytes run on both images.

Every test here starts QEMU (under TCG on machines without a working KVM), so
all are marked slow; iteration counts stay small to keep each run to seconds.
Cross-target tests compare with the unicorn target on the same seed: the design
promises identical behaviour and byte-identical patches on every target.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from ksim.core import Write
from ksim.errors import StaleText, TargetDied, TargetError, TargetTimeout
from ksim.splice.patch import Change

pytestmark = pytest.mark.slow

#: image -> (QEMU binary, its Debian package)
QEMUS = {"toy": ("qemu-system-x86_64", "qemu-system-x86"),
         "toy-arm64": ("qemu-system-aarch64", "qemu-system-arm")}


def _image_param(image: str):
    binary, package = QEMUS[image]
    return pytest.param(image, id=image, marks=pytest.mark.skipif(
        shutil.which(binary) is None, reason=f"{binary} not installed (apt-get install {package})"))


IMAGES = [_image_param(image) for image in QEMUS]
X86 = [_image_param("toy")]

SEED = 1234
ITERATIONS = 20
#: enough for every function the Manager tests splice to be reached
MANAGER_ITERATIONS = 300


def _toy_path() -> Path:
    from ksim import images

    return Path(images.path("toy"))


@pytest.fixture(scope="module", params=IMAGES)
def target(request):
    from ksim.targets.qemu import QemuTarget

    t = QemuTarget(request.param, timeout=10.0, boot_timeout=60.0)
    try:
        yield t
    finally:
        t.close()


def _qemu_pids_with(marker: str) -> list[int]:
    """Processes whose command line contains ``marker`` (a /proc scan)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(entry))
    return pids


# --- booting, running ---------------------------------------------------------------
def test_boots_under_a_known_accelerator(target, request) -> None:
    from ksim.machine.qemu import kvm_usable

    assert target.accel in ("kvm", "tcg")
    if target.accel == "tcg" and kvm_usable() and "kvm" in target.machine.profile.accel_args:
        # KVM was tried and given up, and the reason was kept
        assert target.machine.accel_failures.get("kvm")
    assert target.name == f"qemu:{request.node.callspec.params['target']}"
    # stopped at start_kernel: the kernel's page tables are live, text reads as the ELF has it
    fn = target.image.function("start_kernel")
    assert target.read(fn.address, 16) == target.image.read(fn.address, 16)


def test_checksum_matches_unicorn(target) -> None:
    from ksim.machine.unicorn import UnicornMachine

    ours = target.run(seed=SEED, iterations=ITERATIONS, timeout=120)
    # the very ELF QEMU booted (the bundled image is rebuilt when its sources change)
    theirs = UnicornMachine(target.path).run(seed=SEED, iterations=ITERATIONS)
    assert ours.checksum == theirs.checksum
    assert ours.checksum not in (None, 0)
    assert ours.output  # the serial console carried the kernel's messages


def test_repeated_runs_are_reproducible_and_keep_the_heap(target) -> None:
    counter = target.alloc_data(8)
    try:
        target.write(counter, (41).to_bytes(8, "little"))
        first = target.run(seed=SEED + 1, iterations=ITERATIONS, timeout=120)
        second = target.run(seed=SEED + 1, iterations=ITERATIONS, timeout=120)
        assert first.checksum == second.checksum
        assert second.boot_seconds > 0  # a fresh QEMU for the second run
        assert int.from_bytes(target.read(counter, 8), "little") == 41
    finally:
        target.free_data(counter)


def test_bench_cycles(target) -> None:
    result = target.run(bench_calls=1000, timeout=120)
    # rdtsc (x86) or CNTVCT_EL0 (arm64) around the calls, emulated under TCG;
    # "bench calls=" on the console
    assert result.bench_cycles is not None
    assert "bench calls=1000" in result.output


def test_bench_calls_the_target_n_times(target) -> None:
    fn = target.image.function("ksim_bench_target")
    counter = target.oracle_counter(fn.address)
    try:
        target.run(bench_calls=25, timeout=120)
    finally:
        counter.close()
    assert counter.count == 25


def test_progress_reads_counters_while_running(target) -> None:
    seen: list[int] = []
    done = target.image.address_of("ksim_workload_done")
    iters = target.image.address_of("ksim_workload_iterations")

    def progress() -> None:  # the guest is running: read() goes through QMP xp
        assert target.machine.status() == "running"
        seen.append(int.from_bytes(target.read(done, 8), "little"))
        assert int.from_bytes(target.read(iters, 8), "little") == 600_000

    # about 2-3 s under TCG on this project's machines
    result = target.run(seed=SEED, iterations=600_000, progress=progress, timeout=300)
    assert int(result.seconds) - 1 <= len(seen) <= result.seconds + 1
    assert all(v == 0 for v in seen)  # not done while it was running
    assert int.from_bytes(target.read(done, 8), "little") == 1


def test_timeout_stops_the_guest_and_the_next_run_starts_afresh(target) -> None:
    with pytest.raises(TargetTimeout):
        target.run(seed=SEED, iterations=10**12, timeout=1.0)
    assert target.machine.status() == "paused"
    again = target.run(seed=SEED, iterations=ITERATIONS, timeout=120)
    assert again.boot_seconds > 0 and again.checksum


# --- memory, text ----------------------------------------------------------------------
def test_stale_poke_writes_nothing(target) -> None:
    fn = target.image.function("start_kernel")
    trap = target.arch.trap
    n = len(trap)  # one instruction's worth: 1 byte on x86, a word on arm64
    before = target.read(fn.address, 8)
    good = Write(fn.address, before[:n], trap)
    stale = Write(fn.address + n, bytes(b ^ 0xFF for b in before[n:2 * n]), trap)
    with pytest.raises(StaleText):
        target.apply(Change(text=(good, stale)))
    assert target.read(fn.address, 8) == before


def test_poke_and_undo(target) -> None:
    fn = target.image.function("start_kernel")
    arch = target.arch
    before = target.read(fn.address, arch.jmp_size)
    # a jump to the next instruction (jmp rel32 0 on x86, b .+4 on arm64)
    w = Write(fn.address, before, arch.jmp(fn.address, fn.address + arch.jmp_size))
    target.apply(Change(text=(w,)))
    assert target.read(fn.address, arch.jmp_size) == w.new
    target.apply(Change(text=(w.inverse(),)))
    assert target.read(fn.address, arch.jmp_size) == before


def test_write_refuses_text(target) -> None:
    fn = target.image.function("start_kernel")
    with pytest.raises(TargetError):
        target.write(fn.address, b"\x90")


def test_alloc_data_zeroes_and_code_matches_allocator(target) -> None:
    a = target.alloc_data(32)
    target.write(a, b"\xff" * 32)
    target.free_data(a)
    b = target.alloc_data(32)
    try:
        assert b == a  # first fit: the same request gets the same address
        assert target.read(b, 32) == bytes(32)
    finally:
        target.free_data(b)
    c = target.alloc_code(40, near=target.image.function("start_kernel").address)
    assert c == target.image.address_of("ksim_patch_area")
    target.free_code(c)


def test_trap_table_is_dense_and_mirrored(target) -> None:
    text, patch = target.image.function("start_kernel").address, target._code.start
    sites = [(text + 4 * i, patch + 16 * i) for i in range(4)]
    target.apply(Change(routes=tuple(sites)))
    assert target.traps_in_guest() == sites
    target.apply(Change(routes=((sites[1][0], 0),)))  # the last entry moves into the hole
    assert target.traps_in_guest() == [sites[0], sites[3], sites[2]]
    # clearing a site no longer routed (sites[1]) is no error and changes nothing else
    target.apply(Change(routes=tuple((site, 0) for site, _ in sites)))
    assert target.traps_in_guest() == []


def test_oracle_counter_counts_breakpoint_hits(target) -> None:
    from ksim.machine.unicorn import UnicornMachine

    fn = target.image.function("tcp_sync_mss")
    counter = target.oracle_counter(fn.address)
    try:
        target.run(seed=SEED, iterations=200, timeout=120)
    finally:
        counter.close()
    assert counter.name == "gdbstub-breakpoint"
    # unicorn's exact address hook on the very ELF QEMU booted
    hits = []
    with UnicornMachine(target.path) as u:
        u.hook_code(fn.address, lambda *_: hits.append(1))
        u.run(seed=SEED, iterations=200)
    assert counter.count == len(hits) > 0
    # closed: a later run neither stops there nor counts
    target.run(seed=SEED, iterations=200, timeout=120)
    assert counter.count == len(hits)


@pytest.mark.parametrize("image", IMAGES)
def test_unrouted_trap_kills_the_kernel_with_a_clear_error(image: str) -> None:
    """A trap the kernel's table does not route ends QEMU (isa-debug-exit on x86,
    semihosting on arm64): TargetDied, serial tail, no process left."""
    from ksim.targets.qemu import QemuTarget

    t = QemuTarget(image)
    try:
        fn = t.image.function("tcp_sync_mss")
        trap = t.arch.trap
        t.apply(Change(text=(Write(fn.address, t.read(fn.address, len(trap)), trap),)))
        pid = t.machine.pid
        with pytest.raises(TargetDied, match="panicked(.|\n)*not in ksim_trap_table"):
            t.run(seed=SEED, iterations=200, timeout=120)
        with pytest.raises(TargetDied, match="open the target again"):
            t.run(seed=SEED, iterations=200, timeout=120)
    finally:
        t.close()
    assert not Path(f"/proc/{pid}").exists()


# --- start-up failures ----------------------------------------------------------------------
def test_qemu_that_cannot_start_leaves_nothing() -> None:
    from ksim.machine.qemu import QemuMachine

    marker = f"ksim-test-{uuid.uuid4().hex}"
    with pytest.raises(TargetError) as err:
        QemuMachine(_toy_path(), accel="tcg", timeout=10,
                    extra_args=["-name", marker, "-no-such-option"])
    assert "no-such-option" in str(err.value)  # the tail of QEMU's stderr
    assert _qemu_pids_with(marker) == []


def test_kernel_that_never_boots_times_out_and_leaves_nothing(tmp_path) -> None:
    from ksim.machine.qemu import QemuMachine

    marker = f"ksim-test-{uuid.uuid4().hex}"

    def never(machine: QemuMachine) -> None:
        machine.gdb.set_breakpoint(0x1234)  # never reached: the guest spins in the BIOS
        machine.gdb.cont(timeout=1.0)

    with pytest.raises(TargetError):
        QemuMachine(None, accel="tcg", timeout=5, extra_args=["-name", marker],
                    boot_check=never)
    assert _qemu_pids_with(marker) == []


def test_gdb_port_taken_before_qemu_binds_it(monkeypatch) -> None:
    import socket

    from ksim.machine import qemu

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = [busy.getsockname()[1]]  # the first probe hands out a port in use
        real = qemu.free_port
        monkeypatch.setattr(qemu, "free_port", lambda: ports.pop() if ports else real())
        with qemu.QemuMachine(None, accel="tcg", memory="64M") as m:
            assert m.status() == "prelaunch" and m.gdb.halt_reason().signal == 5


@pytest.mark.parametrize("arch,package", [("x86_64", "qemu-system-x86"),
                                          ("aarch64", "qemu-system-arm")])
def test_missing_qemu_binary_says_how_to_install(arch: str, package: str) -> None:
    from ksim.machine.qemu import QemuMachine

    with pytest.raises(TargetError, match=rf"\(apt-get install {package}\)"):
        QemuMachine(None, qemu=f"/nonexistent/qemu-{arch}", arch=arch)


def test_an_architecture_without_kvm_here_says_so() -> None:
    from ksim.machine.qemu import QemuMachine

    with pytest.raises(TargetError, match="under tcg here, not kvm"):
        QemuMachine(None, accel="kvm", arch="aarch64")


# --- with the Manager: same counts, same bytes, clean removal --------------------------------
def _manager():
    try:
        from ksim.kapi import Manager
    except ImportError as e:  # the Manager is a separate layer
        pytest.skip(f"ksim.kapi cannot be imported: {e}")
    return Manager


def _functions(image: str = "toy") -> list[str]:
    """A plain function and the first function of every hard case the toy kernel
    lists (x86-64's hard cases: on arm64 they are ordinary functions of the same
    workload), by the names ``image`` gives them."""
    from ksim import images
    from ksim.images import toy

    names = ["tcp_sync_mss"]
    for cases in toy.HARD_CASES.values():
        if cases[0] not in names:
            names.append(cases[0])
    return [images.get(image).local_name(name) for name in names]


def _record_pokes(manager) -> list[tuple[int, bytes, bytes]]:
    """Wrap the target's apply so that every Write it makes (patch code, then
    text, as Change orders them) is recorded."""
    log: list[tuple[int, bytes, bytes]] = []
    real = manager.target.apply

    def apply(change):
        real(change)
        log.extend((w.address, w.old, w.new) for w in change.code + change.text)

    manager.target.apply = apply
    return log


def _count_and_bytes(spec: str, name: str, splice: str):
    Manager = _manager()
    m = Manager.attach(spec)
    try:
        log = _record_pokes(m)
        fn = m.find_function(name)
        original = m.target.read(fn.address, fn.size)
        v = m.malloc(8)
        h = m.insert_snippet(m.entry_point(fn), v.assign(v + 1), splice=splice)
        m.run(seed=SEED, iterations=MANAGER_ITERATIONS)
        count = m.read(v)
        m.remove_snippet(h)
        after = m.target.read(fn.address, fn.size)
        return count, log, original, after
    finally:
        m.detach()


def _pair(image: str, name: str, splice: str):
    """The same insertion under QEMU and under unicorn, on one build of the image:
    when the image's sources change between the two (they are rebuilt on demand),
    the pair is taken again."""
    from ksim import images

    for _ in range(3):
        before = images.source_hash(image)
        q = _count_and_bytes(f"qemu:{image}", name, splice)
        u = _count_and_bytes(f"unicorn:{image}", name, splice)
        if images.source_hash(image) == before:
            return q, u
    pytest.skip("the toy kernel's sources kept changing during the comparison")


@pytest.mark.parametrize("splice", ["jmp", "trap"])
@pytest.mark.parametrize("image", IMAGES)
def test_counts_bytes_and_removal_match_unicorn(image: str, splice: str) -> None:
    _manager()
    failures = []
    for name in _functions(image):
        (q_count, q_log, q_orig, q_after), (u_count, u_log, _, _) = _pair(image, name, splice)
        if q_count == 0:
            failures.append(f"{name}/{splice}: never reached, the comparison says nothing")
        # (a) the same number of entries under both emulators
        if q_count != u_count:
            failures.append(f"{name}/{splice}: qemu counted {q_count}, unicorn {u_count}")
        # (b) the same patch code and the same text writes, byte for byte
        if q_log != u_log:
            failures.append(f"{name}/{splice}: the writes differ")
        # (c) after removal the text read back through the gdbstub is the original
        if q_after != q_orig:
            failures.append(f"{name}/{splice}: text not restored")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("splice", ["jmp", "trap"])
@pytest.mark.parametrize("image", IMAGES)
def test_counts_equal_the_gdbstub_oracle(image: str, splice: str) -> None:
    """One QEMU, a counter at every function's entry, all spliced at once: each
    equals the gdbstub breakpoint count at that entry, the splices are what the
    policy asked for, and removing them restores every byte of text and of the
    patch area."""
    Manager = _manager()
    with Manager.attach(f"qemu:{image}") as m:
        fns = [m.find_function(name) for name in _functions(image)]
        original = {fn.name: m.target.read(fn.address, fn.size) for fn in fns}
        oracles = {fn.name: m.target.oracle_counter(fn.address) for fn in fns}
        counters = {fn.name: m.malloc(8) for fn in fns}
        handles = [m.insert_snippet(m.entry_point(fn), counters[fn.name].assign(
            counters[fn.name] + 1), splice=splice) for fn in fns]
        # trap: one route per site in the kernel's table; jmp: none
        assert len(m.target.traps_in_guest()) == (len(fns) if splice == "trap" else 0)
        m.run(seed=SEED, iterations=MANAGER_ITERATIONS)
        counts = {name: m.read(v) for name, v in counters.items()}
        for h in handles:
            m.remove_snippet(h)
        assert m.target.traps_in_guest() == []
        restored = {fn.name: m.target.read(fn.address, fn.size) for fn in fns}
        # the freed patch blocks hold the image's filler again (arm64: BRK #0)
        area = m.target.image.address_of("ksim_patch_area")
        assert m.target.read(area, 4096) == m.target.image.read(area, 4096)
    assert counts == {name: o.count for name, o in oracles.items()}
    assert all(counts.values()), counts  # every one reached: the comparison says something
    assert restored == original


@pytest.mark.parametrize("splice", ["jmp", "trap"])
@pytest.mark.parametrize("image", [_image_param("toy-arm64")])
def test_ksim_count_on_qemu(capsys, image: str, splice: str) -> None:
    """``ksim count FUNC --image toy-arm64 --target qemu``: count == the gdbstub
    oracle, for one function and for a wildcard of several."""
    import json

    from ksim.cli import main

    status = main(["count", "tcp_sync_mss", "--image", image, "--target", "qemu",
                   "--splice", splice, "--seed", "5", "--iterations", "200", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0
    assert report["target"] == f"qemu:{image}" and report["tactic"] == splice
    assert report["count"] == report["oracle"] > 0, report
    status = main(["count", "kmem_cache_*", "--image", image, "--target", "qemu",
                   "--splice", splice, "--iterations", "100", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report
    rows = report["rows"]
    assert len(rows) >= 3 and all(r["tactic"] == splice for r in rows)
    assert all(r["count"] == r["oracle"] for r in rows) and any(r["count"] for r in rows), rows
