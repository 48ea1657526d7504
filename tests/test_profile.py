"""profile:hz:N as ksim samples it (ksim.trace.profile, docs/profile.md): a guard on
the kernel's tick, per cpu.

- The guard's code, run in the snippet machine against the schedule it documents,
  over clock readings hypothesis picks (first tick, jitter, idle gaps, a clock
  started again, cpus interleaved).
- unicorn:toy and toy-arm64 (and qemu:toy): the toy's workload ticks a known
  number of times, and its clock is its jiffies, so the count is exact arithmetic
  over the exact-address hook's count of the tick function.
- The live testbed: 50 Hz on two busy cpus for 2 s of the guest's own clock; the
  kernel's kprobe on update_process_times counts the ticks the guard saw.
- Bad input is refused by cause, before anything is allocated or spliced.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import dataclasses
import random
import struct

import pytest
from conftest import needs_image
from hypothesis import given
from hypothesis import strategies as st
from snippet_machine import Machine, random_regs

from ksim.arch import get_arch
from ksim.core import KernelABI, MemRef, Region
from ksim.kapi import Manager
from ksim.live.testing import dmesg_problems, program, testbed  # noqa: F401
from ksim.snippets import ast
from ksim.trace import profile
from ksim.trace.profile import (
    BadProfileRate,
    BadProfileUnit,
    NoTickPath,
    ProfileError,
    due,
    period_ns,
    release,
    sampler,
)

MS = 1_000_000


# --- the guard, in the snippet machine ----------------------------------------------------
ARCH = get_arch("x86_64")
CODE, DATA, STACK = 0x1000000, 0x2000000, 0x3000000
STACK_TOP = STACK + 0x8000 - 0x18
CPU, CLOCK, OUT, TABLE = DATA + 0x100, DATA + 0x108, DATA + 0x110, DATA + 0x400
ABI = KernelABI(current_task=MemRef(DATA + 0x118), task_pid_offset=0x10,
                cpu_number=MemRef(CPU, size=4), readable=(Region(DATA, DATA + 0x1000),))
CPUS = 3
_machine: Machine | None = None


def guard_machine(period: int) -> tuple[Machine, bytes]:
    global _machine
    if _machine is None:
        _machine = Machine({CODE: 0x10000, DATA: 0x1000, STACK: 0x10000})
    _machine.write(DATA, bytes(0x1000))
    guard = due(TABLE, CPUS, period, ast.Var(CLOCK))
    code = ARCH.compile_snippets([ast.Var(OUT).assign(guard)], CODE,
                                 live=frozenset(ARCH.all_regs), abi=ABI)
    return _machine, code


def tick(m: Machine, code: bytes, cpu: int, now: int) -> int:
    m.put64(CPU, cpu)
    m.put64(CLOCK, now)
    m.run(code, CODE, random_regs(random.Random(now), STACK_TOP))
    return m.u64(OUT)


class Schedule:
    """The schedule docs/profile.md states, per cpu: samples are due at origin + i *
    period (i = 1, 2, ...); the first tick sets the origin; a tick at or after the
    next due time samples once, and restarts the schedule from itself when it is a
    whole period or more late; a clock more than a period behind restarts it too."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.origin: dict[int, int] = {}
        self.i: dict[int, int] = {}

    def tick(self, cpu: int, now: int) -> int:
        p = self.period
        if cpu not in self.origin or now + p < self.origin[cpu] + self.i[cpu] * p:
            self.origin[cpu], self.i[cpu] = now, 1
            return 0
        due_at = self.origin[cpu] + self.i[cpu] * p
        if now < due_at:
            return 0
        if now >= due_at + p:
            self.origin[cpu], self.i[cpu] = now, 1
        else:
            self.i[cpu] += 1
        return 1


@given(period=st.integers(1, 10**9),
       ticks=st.lists(st.tuples(st.integers(0, CPUS - 1), st.integers(0, 3 * 10**9)),
                      min_size=1, max_size=60))
def test_the_guard_keeps_the_documented_schedule(period, ticks):
    """Each cpu's clock moves forward by steps hypothesis picks (a jittered tick, an
    idle gap many periods long, nothing), sometimes starting again from a small value."""
    m, code = guard_machine(period)
    model = Schedule(period)
    clocks = [0] * CPUS
    for cpu, step in ticks:
        clocks[cpu] = step // 7 if step % 11 == 0 else clocks[cpu] + step   # 1 in 11: a new boot
        assert tick(m, code, cpu, clocks[cpu]) == model.tick(cpu, clocks[cpu]), (cpu, clocks)


def test_a_cpu_back_from_idle_samples_once_not_a_burst():
    m, code = guard_machine(10)
    got = [tick(m, code, 0, t) for t in (100, 105, 110, 120, 125)]
    assert got == [0, 0, 1, 1, 0]            # the first tick starts it; due at 110, 120, 130
    got = [tick(m, code, 0, t) for t in (1000, 1005, 1010, 1019, 1020)]
    assert got == [1, 0, 1, 0, 1]            # 88 periods late: one sample, then due at 1010, ...
    assert [tick(m, code, 1, t) for t in (1000, 1010)] == [0, 1]   # cpu 1 has its own


def test_a_clock_that_starts_again_restarts_the_schedule():
    m, code = guard_machine(10)
    assert [tick(m, code, 0, t) for t in (500, 510, 520)] == [0, 1, 1]
    assert [tick(m, code, 0, t) for t in (3, 9, 13, 23)] == [0, 0, 1, 1]


# --- periods and refusals ------------------------------------------------------------------
def test_periods_of_each_unit():
    assert period_ns("hz", 99) == 10**9 // 99
    assert period_ns("s", 2) == 2 * 10**9
    assert period_ns("ms", 10) == 10 * MS
    assert period_ns("us", 250) == 250_000


@pytest.mark.parametrize("unit, value, error, words", [
    ("hz", 0, BadProfileRate, "positive"),
    ("hz", -1, BadProfileRate, "positive"),
    ("ms", -5, BadProfileRate, "positive"),
    ("s", 0, BadProfileRate, "positive"),
    ("hz", 10**9 + 1, BadProfileRate, "nanosecond"),
    ("s", 2**62, BadProfileRate, "longer than"),
    ("min", 1, BadProfileUnit, "hz, s, ms or us"),
    ("", 99, BadProfileUnit, "unknown unit"),
    ("hz", 1001, BadProfileRate, "HZ=1000"),
    ("us", 999, BadProfileRate, "every 1 ms"),
])
def test_bad_input_is_refused_by_cause_and_changes_nothing(toy_manager, unit, value, error,
                                                           words):
    m = toy_manager
    heap, text, splices = m.rules().writable, m.text_snapshot(), m.splices()
    with pytest.raises(error) as exc:
        sampler(m, unit, value)
    assert words in str(exc.value) and isinstance(exc.value, ProfileError)
    assert m.rules().writable == heap and m.text_snapshot() == text and m.splices() == splices


def test_a_kernel_without_a_tick_function_is_refused(toy_manager, monkeypatch):
    heap = toy_manager.rules().writable
    monkeypatch.setattr(profile, "TICK_PATHS", (
        profile.TickPath("no_such_tick", "jiffies", MS, None),
        profile.TickPath("update_process_times", "no_such_jiffies", MS, None),
    ))
    with pytest.raises(NoTickPath, match="no_such_tick .*no_such_tick missing.*"
                                         "no_such_jiffies missing"):
        sampler(toy_manager, "hz", 10)
    assert toy_manager.rules().writable == heap


def test_release_frees_the_schedule(toy_manager):
    heap = toy_manager.rules().writable
    s = sampler(toy_manager, "hz", 100)
    assert (s.table, 16 * s.cpus) in toy_manager.rules().writable
    release(toy_manager, s)
    assert toy_manager.rules().writable == heap


# --- the toy kernels: exact counts -------------------------------------------------------------
def expected_samples(ticks: int, tick_ns: int, period: int) -> int:
    """Samples over ``ticks`` ticks a tick apart: the first starts the schedule, then
    one at the first tick at or after each period."""
    return (ticks - 1) * tick_ns // period


def count_samples(m: Manager, unit: str, value: int, runs: int = 1) -> list[tuple[int, int]]:
    """(ticks the exact-address oracle counted, samples) for each of ``runs`` runs."""
    s = sampler(m, unit, value)
    assert s.function == "update_process_times" and s.regs is None and s.tick_ns == MS
    counter = m.malloc(8)
    handles = m.insert_many(s.points, lambda p: ast.if_(s.guard, counter.atomic_assign(counter + 1)))
    out = []
    try:
        for _ in range(runs):
            m.write(counter, 0)
            with m.oracle(s.points[0].address) as oracle:
                m.run(seed=5)
                out.append((oracle.count, m.read(counter)))
    finally:
        m.remove_many(handles)
        release(m, s)
        m.free(counter)
    return out


@pytest.mark.parametrize("unit, value", [("hz", 1000), ("hz", 200), ("ms", 3), ("hz", 7),
                                         ("us", 2500), ("s", 1)])
def test_toy_samples_are_exact_multiples_of_its_ticks(image_manager, unit, value):
    """The toy's jiffies are its workload's ticks (1 ms each): the count follows
    from the oracle's count of update_process_times alone."""
    [(ticks, samples)] = count_samples(image_manager, unit, value)
    assert ticks > 100
    assert samples == expected_samples(ticks, MS, period_ns(unit, value))


def test_a_sampler_counts_the_same_in_every_run_of_the_toy(image_manager):
    """Each run boots the kernel again, its jiffies from 0, under the same schedule
    block: the schedule starts again rather than waiting for the old due time."""
    runs = count_samples(image_manager, "ms", 4, runs=3)
    assert len(set(runs)) == 1
    ticks, samples = runs[0]
    assert samples == expected_samples(ticks, MS, 4 * MS) > 0


@pytest.mark.slow
def test_qemu_toy_samples_like_unicorn(toy_path):
    needs_image("toy")
    with Manager.attach("qemu:toy") as m:
        [(ticks, samples)] = count_samples(m, "hz", 250)
    assert ticks > 100 and samples == expected_samples(ticks, MS, 4 * MS)


# --- the live kernel ---------------------------------------------------------------------------
SPIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
/* N children each spin in user mode until D ns of CLOCK_MONOTONIC (the clock
 * ktime_get_mono_fast_ns reads) have passed since the start; prints that clock
 * before the first fork and after the last child ended. */
static long long ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
int main(int argc, char **argv)
{
    int n = atoi(argv[1]), i;
    long long d = atoll(argv[2]), t0 = ns();
    for (i = 0; i < n; i++)
        if (fork() == 0) {
            volatile long x = 0;
            long j;
            do
                for (j = 0; j < 2000000; j++)
                    x++;
            while (ns() - t0 < d);
            _exit(0);
        }
    while (wait(NULL) > 0)
        ;
    printf("%lld %lld\n", t0, ns());
    return 0;
}
"""
SPINNER = "ksim_prof_spin"
RATE, SECONDS = 50, 2
#: sample times kept per cpu
LOG = 1024


def is_spinner() -> ast.Node:
    name = SPINNER.encode().ljust(16, b"\0")
    return ast.land(ast.comm(0) == int.from_bytes(name[:8], "little"),
                    ast.comm(1) == int.from_bytes(name[8:], "little"))


def spin(m: Manager, cpus: int) -> tuple[int, int]:
    """The guest's CLOCK_MONOTONIC (ns) before and after ``cpus`` spinners ran."""
    result = m.run(while_cmd=f"{program(SPINNER, SPIN)} {cpus} {SECONDS * 10**9}")
    t0, t1 = result.output.split()
    return int(t0), int(t1)


@pytest.mark.live
@pytest.mark.slow
def test_live_50hz_on_two_busy_cpus(testbed):
    """Each sample logs the kernel's clock, per cpu.  While two spinners keep both
    cpus busy (from t0 to t1 by the guest's CLOCK_MONOTONIC, the clock the guard
    reads), there are 2 x 50 x (t1 - t0) samples, whatever else the guest runs
    then: less when a tick comes a whole period late (none did on the testbed),
    at most one more per cpu for where the window cuts its schedule.  The guard
    ran at every tick the kernel's kprobe on update_process_times saw (the
    kprobe's window holds ksim's, so it may see a few ticks more).  Under TCG the
    ticks come every 7-8 ms, not every 4 ms, and the rate holds all the same: the
    guard reads the clock, it does not count ticks."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        s = sampler(m, "hz", RATE)
        assert s.function == "update_process_times" and s.hz == 250 and s.cpus == 2
        hits, counts, log = m.malloc(8), m.alloc_data(8 * s.cpus), m.alloc_data(8 * s.cpus * LOG)
        n = ast.Elem(counts, s.cpus, ast.cpu())
        at = ast.Elem(log, s.cpus * LOG, ast.cpu() * LOG + n)
        # only a cpu's own tick writes its words, with interrupts off
        action = ast.if_(ast.ult(n, LOG), ast.seq(at.assign(ast.call(m.target.abi.clock_ns)),
                                                  n.assign(n + 1)))
        body = ast.seq(hits.atomic_assign(hits + 1), ast.if_(s.guard, action))
        fn = m.find_function(s.function)
        before = m.copy_from_kernel(fn.address, 32)
        handles = m.insert_many(s.points, lambda p: body)
        with m.oracle(fn.address) as oracle:
            k0, h0 = oracle.count, m.read(hits)
            t0, t1 = spin(m, 2)
            h1, k1 = m.read(hits), oracle.count
        m.remove_many(handles)
        release(m, s)
        per_cpu = struct.unpack(f"<{s.cpus}Q", m.copy_from_kernel(counts, 8 * s.cpus))
        times = struct.unpack(f"<{s.cpus * LOG}Q", m.copy_from_kernel(log, 8 * s.cpus * LOG))
        inside = [sum(t0 <= t <= t1 for t in times[c * LOG:c * LOG + per_cpu[c]])
                  for c in range(s.cpus)]
        expected = RATE * (t1 - t0) / 1e9
        assert all(0.95 * expected - 1 <= k <= expected + 1 for k in inside), (inside, expected)
        seen, ticks = h1 - h0, k1 - k0
        # the reads on either side of the run see the guest's other ticks
        assert sum(per_cpu) <= seen <= ticks <= 1.1 * seen + 20, (per_cpu, seen, ticks)
        assert m.copy_from_kernel(fn.address, 32) == before
        assert dmesg_problems(m.target) == []
    finally:
        m.detach()


@pytest.mark.live
@pytest.mark.slow
def test_live_regs_is_the_interrupted_context(testbed):
    """Sampler.regs points to the pt_regs of what the tick interrupted: while a
    spinner spins in user mode on one cpu and dd copies /dev/zero to /dev/null in
    the kernel on the other, the spinner's samples mostly find user mode there
    (cs & 3 == 3, arch/x86/include/asm/ptrace.h user_mode()) and dd's mostly
    kernel mode; and every sample's ip is a user address in user mode, a kernel
    one in kernel mode.  The Manager declares no per-cpu data beyond the ABI's
    yet, so this test adds __irq_regs to its rules."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        s = sampler(m, "hz", RATE)
        assert isinstance(s.regs, ast.Var) and s.regs.segment == "gs"
        rules = m.rules
        m.rules = lambda: dataclasses.replace(rules(), percpu=((s.regs.address, 8),))
        spins, spin_user, dds, dd_user, wrong = (m.malloc(8) for _ in range(5))
        ip, cs = ast.load(s.regs + 128, 8), ast.load(s.regs + 136, 8)  # pt_regs: ..., ip, cs
        user = (cs & 3) == 3
        dd = ast.land(ast.comm(0) == int.from_bytes(b"dd".ljust(8, b"\0"), "little"),
                      ast.comm(1) == 0)

        def one(v: ast.Var) -> ast.Node:
            return v.atomic_assign(v + 1)

        action = ast.seq(
            ast.if_(is_spinner(), ast.seq(one(spins), ast.if_(user, one(spin_user)))),
            ast.if_(dd, ast.seq(one(dds), ast.if_(user, one(dd_user)))),
            ast.if_(user != ast.ult(ip, 1 << 47), one(wrong)))
        handles = m.insert_many(s.points, lambda p: ast.if_(s.guard, action))
        m.run(while_cmd=f"timeout 2 dd if=/dev/zero of=/dev/null bs=1M & "
                        f"{program(SPINNER, SPIN)} 1 {SECONDS * 10**9}; wait")
        m.remove_many(handles)
        release(m, s)
        counts = [m.read(v) for v in (spins, spin_user, dds, dd_user, wrong)]
        assert counts[0] > 30 and counts[1] >= 0.6 * counts[0], counts
        assert counts[2] > 30 and counts[3] <= 0.2 * counts[2], counts
        assert counts[4] == 0, counts
    finally:
        m.detach()
