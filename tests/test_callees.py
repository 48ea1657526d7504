"""Callee watching: the per-site destination set (in unicorn, as generated code) and
the CalleeWatcher on unicorn:toy and unicorn:toy-arm64, checked against exact address hooks."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOY_IMAGES, needs_image, toy_name
from snippet_machine import Machine, random_regs

from ksim.analysis import call_graph
from ksim.arch import get_arch
from ksim.callees import WORD, CalleeWatcher, evaluate_operand, record_snippet
from ksim.errors import NotIndirectCall
from ksim.kapi import Manager

ROOT = Path(__file__).resolve().parents[1]
ARCH = get_arch("x86_64")
ALL_LIVE = frozenset(ARCH.all_regs)
CODE, DATA, STACK = 0x1000000, 0x2000000, 0x3000000
STACK_TOP = STACK + 0x8000
SLOTS = 4
CALL_RAX = ARCH.call_operand(ARCH.decode_one(bytes.fromhex("ffd0"), 0x1000))   # call rax


# --- the set, as generated code -------------------------------------------------------------
@pytest.fixture(scope="module")
def table_machine():
    m = Machine({CODE: 0x10000, DATA: 0x1000, STACK: 0x10000})
    code = ARCH.compile_snippets([record_snippet(DATA, SLOTS)], CODE, live=ALL_LIVE, abi=None,
                                 point_kind="callsite", call_operand=CALL_RAX)
    return m, code


def record(table_machine, dest: int, seed: int = 0) -> list[int]:
    """Run the recording snippet with rax = ``dest``; the table afterwards."""
    m, code = table_machine
    before = random_regs(random.Random(seed), STACK_TOP)
    before["rax"] = dest
    after = m.run(code, CODE, before)
    assert after == before                     # every register and the flags kept
    return [m.u64(DATA + WORD * i) for i in range(1 + SLOTS)]


def clear(table_machine) -> None:
    table_machine[0].write(DATA, bytes(WORD * (1 + SLOTS)))


def test_repeats_are_stored_once_in_order_of_arrival(table_machine):
    clear(table_machine)
    for seed, dest in enumerate([0xA, 0xB, 0xA, 0xA, 0xC, 0xB]):
        table = record(table_machine, dest, seed)
    assert table == [0, 0xA, 0xB, 0xC, 0]


def test_full_table_counts_overflow_and_keeps_its_slots(table_machine):
    clear(table_machine)
    for dest in [1, 2, 3, 4, 5, 1, 6, 4, 5]:
        table = record(table_machine, dest)
    # 5, 6 and 5 again found no slot; 1 and 4 were already there
    assert table == [3, 1, 2, 3, 4]


def test_a_slot_taken_meanwhile_sends_the_destination_on(table_machine):
    """What another CPU's insert looks like: a slot already holding another value."""
    clear(table_machine)
    table_machine[0].put64(DATA + WORD, 0x77)
    assert record(table_machine, 0x99) == [0, 0x77, 0x99, 0, 0]
    assert record(table_machine, 0x77) == [0, 0x77, 0x99, 0, 0]


# --- the watcher on the toy kernel ------------------------------------------------------------
INDIRECT_FUNCS = ["do_syscall_64", "vfs_read", "vfs_write", "filp_open", "dev_queue_xmit"]


@pytest.fixture(params=TOY_IMAGES)
def kmgr(request):
    needs_image(request.param)
    with Manager.attach(f"unicorn:{request.param}") as m:
        yield m


def watched(kmgr) -> list[str]:
    """INDIRECT_FUNCS by the names the kernel gives them."""
    return [toy_name(kmgr, f) for f in INDIRECT_FUNCS]


def hook_calls(kmgr, watcher) -> list[tuple[int, int]]:
    """(site, destination) of every call at the watched sites, in order, read by an
    exact address hook from the registers and memory at the call."""
    calls: list[tuple[int, int]] = []
    machine = kmgr.target.machine
    removes = [machine.hook_code(a, lambda mach, addr, op=s.operand:
                                 calls.append((addr, evaluate_operand(op, mach.reg, mach.read))))
               for a, s in watcher.sites.items()]
    kmgr.run(seed=3, iterations=40)
    for remove in removes:
        remove()
    return calls


def test_destinations_equal_the_hook_oracle(kmgr):
    watcher = CalleeWatcher(kmgr)
    points = watcher.watch(watched(kmgr))
    assert {p.function for p in points} == set(watched(kmgr))
    calls = hook_calls(kmgr, watcher)
    oracle = {a: {d for s, d in calls if s == a} for a in watcher.sites}
    assert watcher.destinations() == oracle
    assert set(watcher.overflows().values()) == {0}
    syscall = toy_name(kmgr, "do_syscall_64")
    assert len(oracle[kmgr.callsite_points(syscall)[-1].address]) > 5
    watcher.unwatch()


def test_small_table_overflows_exactly(kmgr):
    watcher = CalleeWatcher(kmgr, slots=3)
    (site,) = watcher.watch(toy_name(kmgr, "do_syscall_64"))
    calls = [d for _, d in hook_calls(kmgr, watcher)]
    first = list(dict.fromkeys(calls))[:3]            # the first three distinct, in order
    table = watcher._table(watcher.sites[site.address])
    assert table[1:] == first
    assert table[0] == sum(1 for d in calls if d not in first) > 0
    watcher.unwatch()


def test_unwatch_restores_the_text_byte_for_byte(kmgr):
    funcs = [kmgr.find_function(f) for f in watched(kmgr) + ["e100_watchdog", "kmem_cache_alloc"]]
    text = [kmgr.copy_from_kernel(f.address, f.size) for f in funcs]
    watcher = CalleeWatcher(kmgr)
    watcher.watch(funcs)
    assert [kmgr.copy_from_kernel(f.address, f.size) for f in funcs] != text
    kmgr.run(seed=1, iterations=10)
    watcher.unwatch()
    assert [kmgr.copy_from_kernel(f.address, f.size) for f in funcs] == text
    assert kmgr.splices() == {} and watcher.sites == {}
    kmgr.run(seed=1, iterations=10)                    # and the kernel still runs


def test_a_direct_call_is_refused_and_nothing_changes(kmgr):
    syscall = toy_name(kmgr, "do_syscall_64")
    direct, indirect = kmgr.callsite_points(syscall)
    func = kmgr.find_function(syscall)
    text = kmgr.copy_from_kernel(func.address, func.size)
    watcher = CalleeWatcher(kmgr)
    with pytest.raises(NotIndirectCall):
        watcher.watch([indirect, direct])              # all or nothing
    assert kmgr.splices() == {} and watcher.sites == {}
    assert kmgr.copy_from_kernel(func.address, func.size) == text
    with pytest.raises(NotIndirectCall):
        watcher.watch(kmgr.entry_point(func))
    assert watcher.watch(indirect) == [indirect]
    watcher.unwatch()


def test_merge_into_adds_the_observed_edges_by_name(kmgr):
    watcher = CalleeWatcher(kmgr)
    syscall = toy_name(kmgr, "do_syscall_64")
    watcher.watch([syscall, "vfs_read"])
    kmgr.run(seed=2, iterations=40)
    graph = call_graph(kmgr.target.image, [kmgr.find_function(syscall),
                                           kmgr.find_function("vfs_read")])
    static = graph.callees(syscall)
    new = watcher.merge_into(graph)
    assert ("vfs_read", "ramfs_file_read") in new
    assert toy_name(kmgr, "__x64_sys_read") in graph.callees(syscall) - static
    assert syscall in graph.callers(toy_name(kmgr, "__x64_sys_write"))
    assert watcher.merge_into(graph) == set()          # merging again adds nothing
    watcher.unwatch()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                    reason="qemu-system-x86_64 is not installed")
def test_watch_callees_example_on_qemu(toy_path):
    """On qemu:toy the example's oracle is the hooked unicorn:toy run of the same workload."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "watch_callees.py"), "qemu:toy",
                           "do_syscall_64", "vfs_read", "--iterations", "60"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "__x64_sys_read" in proc.stdout and "unicorn:toy, same workload" in proc.stdout
