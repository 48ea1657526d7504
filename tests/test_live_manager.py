"""End to end through the Manager on the live kernel: count == N == the kernel's kprobe."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ksim.kapi import Manager
from ksim.live.testing import dmesg_problems, getppid_loop, testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"
N = 100_000


@pytest.mark.parametrize("splice", ["jmp", "trap"])
def test_manager_counts_entries_like_the_kprobe(testbed: dict, splice: str) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        fn = m.find_function(FUNC)
        before = m.copy_from_kernel(fn.address, 16)
        counter = m.malloc(8)
        entry = m.entry_point(fn)
        # the function starts with the ftrace location, which the kernel owns: the
        # entry point is the instruction after it
        assert entry.address == fn.address + 5
        handle = m.insert_snippet(entry, counter.atomic_assign(counter + 1), splice=splice)
        assert m.patch_of(handle).tactic in ({"jmp", "jmp+displace", "springboard"}
                                             if splice == "jmp" else {"trap"})
        with m.oracle(fn.address) as oracle:
            k0, c0 = oracle.count, m.read(counter)
            result = m.run(while_cmd=f"{getppid_loop()} {N}")
            c1, k1 = m.read(counter), oracle.count
        m.remove_snippet(handle)
        assert result.output.strip() == str(N)
        # The only other caller in the interval is the shell that starts the program,
        # seen by both counts.
        assert c1 - c0 == k1 - k0
        assert N <= c1 - c0 <= N + 2
        assert m.copy_from_kernel(fn.address, 16) == before
        assert dmesg_problems(m.target) == []
    finally:
        m.detach()


def test_a_detached_manager_keeps_nothing_alive(testbed: dict) -> None:
    """The live image (the kernel's text read, its analyses and store) goes with its
    Manager: a process that attaches again and again does not grow by a kernel."""
    import gc
    import weakref

    refs = []
    for _ in range(2):
        with Manager.attach(testbed["address"], token_file=testbed["token_file"]) as m:
            counter = m.malloc(8)
            for name in (FUNC, "vfs_read"):
                h = m.insert_snippet(m.entry_point(name), counter.atomic_assign(counter + 1))
                m.remove_snippet(h)
            m.free(counter)
            refs += [weakref.ref(m.target.image), weakref.ref(m.facts), weakref.ref(m.target)]
        del m, counter
    gc.collect()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_ksim_count_command_agrees_with_the_kprobe(testbed: dict) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ksim.cli", "count", FUNC, "--target", testbed["address"],
         "--oracle", "kprobe", "--splice", "jmp", "--while", f"{getppid_loop()} 20000", "--json"],
        capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    assert out.returncode == 0, report
    assert report["count"] == report["oracle"] and 20_000 <= report["count"] <= 20_002


def test_ksim_count_takes_a_wildcard_on_the_live_kernel(testbed: dict) -> None:
    """One batch over every match; each function's count equals the kernel's kprobe
    on it over the same run, and the getppid loop's function counts exactly N.  (The
    pattern leaves out getpid: other processes of the guest call it while the counts
    are read one after the other, so its two counts cover windows that differ by those
    calls.)"""
    out = subprocess.run(
        [sys.executable, "-m", "ksim.cli", "count", "__x64_sys_getp[gpr]*", "--target",
         testbed["address"], "--oracle", "kprobe", "--while", f"{getppid_loop()} 20000",
         "--json"],
        capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    assert out.returncode == 0, report
    rows = {r["function"]: r for r in report["rows"]}
    assert {"__x64_sys_getppid", "__x64_sys_getpgid", "__x64_sys_getpgrp"} <= set(rows)
    assert all(r["count"] == r["oracle"] for r in rows.values()), rows
    assert 20_000 <= rows["__x64_sys_getppid"]["count"] <= 20_002
