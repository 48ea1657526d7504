"""Batches on a live kernel: Manager.insert_many / remove_many over hundreds and
thousands of function entries, each as one Change that the module makes as one
batch -- patch code, the routes of the trap policy, and text (int3 -> sync -> tail
-> sync -> head -> sync for all of it at once); the patch area and the data heap
growing by areas and shrinking back.

Real module, real kernel: the kernel's own kprobe (tracefs kprobe_profile) is the
oracle for counts, and text is read back byte for byte.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ksim.analysis.points import Point
from ksim.core import Write
from ksim.errors import BlockInUse, KsimError, OutOfMemory, StaleText, TextOwned
from ksim.kapi import Handle, Manager
from ksim.live.client import KprobeCounter, LiveTarget
from ksim.live.testing import (  # noqa: F401
    connect,
    dmesg_problems,
    getppid_loop,
    plain_insn,
    program,
    read_u64,
    restart_kerninstd,
    routes_of,
    testbed,
)
from ksim.snippets import ast
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

# Syscalls nothing else in the guest makes while a test runs: their entries are the
# sample whose counts must equal the kernel's kprobe's.
SAMPLE = ("__x64_sys_getppid", "__x64_sys_getpgrp", "__x64_sys_getegid",
          "__x64_sys_getresuid", "__x64_sys_getresgid", "__x64_sys_times")
SYSCALLS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/times.h>
/* Makes each of getppid, getpgrp, getegid, getresuid, getresgid and times N times. */
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, i;
    unsigned r, e, s;
    struct tms t;
    for (i = 0; i < n; i++) {
        syscall(SYS_getppid);
        syscall(SYS_getpgrp);
        syscall(SYS_getegid);
        syscall(SYS_getresuid, &r, &e, &s);
        syscall(SYS_getresgid, &r, &e, &s);
        syscall(SYS_times, &t);
    }
    printf("%ld\n", i);
    return 0;
}
"""
N = 2_000
AROUND = 300        # function entries in a batch: the sample's neighbours in kernel/sys.c
PARAMS = "/sys/module/kerninst/parameters"


def syscalls() -> str:
    return str(program("syscall_loop", SYSCALLS))


def attach(testbed: dict[str, Any]) -> Manager:
    return Manager.attach(testbed["address"], token_file=testbed["token_file"])


def entries(m: Manager, funcs: list[Any], policy: str) -> list[Point]:
    """The entry points of ``funcs`` that ``policy`` can splice (Manager.can_insert)."""
    return [p for _, p in m.spliceable_entries(funcs, policy)[0]]


def around_the_sample(m: Manager, policy: str, n: int = AROUND) -> list[Point]:
    """``n`` spliceable entries: the sample's and their neighbours', by address."""
    funcs = sorted(m.target.image.functions, key=lambda f: f.address)
    at = [f.address for f in funcs].index(m.find_function(SAMPLE[0]).address)
    near = funcs[max(0, at - n // 2):at + n]
    points = entries(m, near, policy)
    assert {m.find_function(s).address for s in SAMPLE} <= {m.target.image.function_at(p.address).address
                                                            for p in points}, "a sample entry is not spliceable"
    return points[:n]


def counters(m: Manager, points: list[Point]) -> tuple[int, dict[int, ast.Var]]:
    """One 8-byte counter per point, all in one heap block."""
    variables = m.malloc_array(len(points))
    return variables[0].address, {p.address: v for p, v in zip(points, variables, strict=True)}


def counting(var: dict[int, ast.Var]) -> Callable[[Point], ast.Snippet]:
    return lambda p: var[p.address].atomic_assign(var[p.address] + 1)


def text_of(t: LiveTarget, points: list[Point]) -> dict[int, bytes]:
    return t.read_many([p.address for p in points])


@contextlib.contextmanager
def oracles(t: LiveTarget, m: Manager, names: tuple[str, ...]) -> Iterator[dict[str, KprobeCounter]]:
    made: dict[str, KprobeCounter] = {}
    try:
        for name in names:
            made[name] = KprobeCounter(t, m.find_function(name).address)
        yield made
    finally:
        for o in made.values():
            o.close()


def param(t: LiveTarget, name: str, value: int | None = None) -> int:
    if value is not None:
        t.exec_checked(f"echo {value} > {PARAMS}/{name}")
    return int(t.exec_checked(f"cat {PARAMS}/{name}"))


# -- a batch counts like the kernel's kprobe ---------------------------------------------
@pytest.mark.parametrize("policy", ["jmp", "trap"])
def test_a_batch_of_entries_counts_like_the_kernels_kprobe(testbed, policy: str) -> None:
    m = attach(testbed)
    t: LiveTarget = m.target
    try:
        points = around_the_sample(m, policy)
        before = text_of(t, points)
        _base, var = counters(m, points)
        handles = m.insert_many(points, counting(var), splice=policy)
        assert len(m.splices()) == len(points) >= AROUND * 2 // 3
        tactics = {tactic for tactic, _n in m.splices().values()}
        assert tactics <= ({"trap"} if policy == "trap" else {"jmp", "jmp+displace", "springboard"})
        sample = {name: var[m.entry_point(name).address] for name in SAMPLE}
        with oracles(t, m, SAMPLE) as kp:
            k0 = {n: o.count for n, o in kp.items()}
            c0 = {n: m.read(v) for n, v in sample.items()}
            out = m.run(while_cmd=f"{syscalls()} {N}").output
            c1 = {n: m.read(v) for n, v in sample.items()}
            k1 = {n: o.count for n, o in kp.items()}
        assert out.strip() == str(N)
        for name in SAMPLE:
            assert c1[name] - c0[name] == k1[name] - k0[name], name
            assert N <= c1[name] - c0[name] <= N + 2, name
        m.remove_many(handles)
        assert m.splices() == {}
        assert text_of(t, points) == before
        assert dmesg_problems(t) == []
    finally:
        m.detach()


# -- refused whole ---------------------------------------------------------------------------
def test_a_batch_over_another_clients_point_is_refused_whole(testbed) -> None:
    m, other = attach(testbed), attach(testbed)
    t: LiveTarget = m.target
    try:
        points = around_the_sample(m, "jmp")
        taken = points[len(points) // 2]
        var = other.malloc(8)
        held = other.insert_snippet(other.entry_point(other.target.image.function_at(taken.address)),
                                    var.assign(1), splice="jmp")
        before = text_of(t, points)
        _base, mine = counters(m, points)
        for policy in ("jmp", "trap"):
            with pytest.raises(TextOwned, match="another client's session"):
                m.insert_many(points, counting(mine), splice=policy)
            assert text_of(t, points) == before, policy
            assert m.splices() == {}
        # nothing of the refused batches is left: the rest goes in, and out again
        rest = [p for p in points if p.address != taken.address]
        handles = m.insert_many(rest, counting(mine), splice="trap")
        m.remove_many(handles)
        assert text_of(t, points) == before
        other.remove_snippet(held)
    finally:
        other.detach()
        m.detach()


def test_a_batch_with_one_stale_write_or_no_room_changes_nothing(testbed) -> None:
    """One Change of routes and text writes, refused for one stale write and then for
    lack of room, changes no byte and sets no route; the same Change goes in whole,
    and its inverse (the int3s out and their routes cleared, in one batch) out."""
    t = connect(testbed)
    try:
        names = ("__x64_sys_getppid", "__x64_sys_getpgrp", "__x64_sys_getegid",
                 "__x64_sys_getresuid", "__x64_sys_getresgid", "__x64_sys_times")
        sites = [plain_insn(t, n) for n in names]
        before = {a: t.read(a, 16) for a, _ in sites}
        idle = t.alloc_code(64)
        jmp_site, jmp_insn = sites[0]
        jmp = b"\xe9" + struct.pack("<i", idle - (jmp_site + 5))
        good = [Write(jmp_site, jmp_insn[:5], jmp)] + [Write(a, insn[:1], b"\xcc") for a, insn in sites[1:]]
        routes = tuple((a, idle) for a, _ in sites[1:])
        last, last_insn = sites[-1]
        stale = Write(last, bytes([last_insn[0] ^ 0xFF]), b"\xcc")  # its old byte is wrong
        with pytest.raises(StaleText):
            t.apply(Change(routes=routes, text=(*good[:-1], stale)))
        assert {a: t.read(a, 16) for a, _ in sites} == before
        # its routes went with it
        assert routes_of(t) == {}
        insert = Change(routes=routes, text=tuple(good))
        saved = param(t, "max_splices")
        try:
            param(t, "max_splices", len(good) - 1)   # one text write short
            with pytest.raises(OutOfMemory):
                t.apply(insert)
            assert {a: t.read(a, 16) for a, _ in sites} == before
            assert routes_of(t) == {}
        finally:
            param(t, "max_splices", saved)
        # the batch itself is good: in, and out again
        t.apply(insert)
        assert t.read(jmp_site, 5) == jmp
        assert all(t.read(a, 1) == b"\xcc" for a, _ in sites[1:])
        assert routes_of(t) == dict(routes)
        t.apply(Change(routes=tuple((a, 0) for a, _ in routes),
                       text=tuple(w.inverse() for w in good)))
        assert {a: t.read(a, 16) for a, _ in sites} == before
        assert routes_of(t) == {}
        assert dmesg_problems(t) == []
    finally:
        t.close()


# -- every spliceable entry ------------------------------------------------------------------
class Workload:
    """A workload the guest runs, over its own connection, until stopped."""

    def __init__(self, testbed: dict[str, Any]) -> None:
        self.flag = f"/tmp/ksim-batch-stop-{os.getpid()}"
        self.testbed = testbed
        self.side = connect(testbed)
        self.error: BaseException | None = None
        cmd = (f"rm -f {self.flag}; n=0; while [ ! -e {self.flag} ]; do {syscalls()} 200 >/dev/null; "
               f"ls -R /proc/sys >/dev/null 2>&1; cat /proc/meminfo >/dev/null; n=$((n+1)); done; echo $n")
        self.thread = threading.Thread(target=self._run, args=(cmd,), daemon=True)
        self.rounds = 0
        self.thread.start()

    def _run(self, cmd: str) -> None:
        try:
            self.rounds = int(self.side.exec_checked(cmd, timeout=7200).split()[-1])
        except BaseException as exc:  # raised in the test's thread by stop()
            self.error = exc

    def stop(self) -> int:
        # over a connection of its own: the workload's is busy until the loop ends
        flag = connect(self.testbed)
        try:
            flag.exec(f"touch {self.flag}")
        finally:
            flag.close()
        self.thread.join(600)
        self.side.close()
        if self.error is not None:
            raise self.error
        return self.rounds


#: every STRIDE-th function of core kernel text in the batch of the test below
#: (KSIM_SCALE=1: every 16th; KSIM_SCALE=all: every function, some 47,000: 45,698 entries
#: with jmp and every one of them with trap, seven and a half minutes in all under TCG)
STRIDE = 1 if os.environ.get("KSIM_SCALE") == "all" else 16


@pytest.mark.skipif(not os.environ.get("KSIM_SCALE"),
                    reason="thousands of entries under load, minutes under TCG: "
                           "KSIM_SCALE=1 runs every 16th function, KSIM_SCALE=all every one")
def test_every_spliceable_entry_attaches_under_load_and_detaches_byte_for_byte(testbed) -> None:
    """insert_many over every entry point of core kernel text (every STRIDE-th function)
    that can_insert accepts, with the jmp policy and then with the trap policy, while the
    guest runs a workload the whole time; remove_many puts every byte back."""
    m = attach(testbed)
    t: LiveTarget = m.target
    load = None
    try:
        funcs = sorted((f for f in t.image.functions if t.text[0] <= f.address < t.text[1]),
                       key=lambda f: f.address)[::STRIDE]
        # the entries can_insert accepts, each policy's hazards asked of the kernel at
        # once (Manager.spliceable_entries): planning 40,000 points works from one look
        pool = {policy: entries(m, funcs, policy) for policy in ("jmp", "trap")}
        assert len(pool["trap"]) > len(funcs) // 2 and len(pool["jmp"]) > len(funcs) // 2
        load = Workload(testbed)
        refused: dict[str, str] = {}
        for policy in ("trap", "jmp"):
            points = pool[policy]
            before = text_of(t, points)
            base, var = counters(m, points)
            areas = len(code_areas(t))
            try:
                handles: list[Handle] = m.insert_many(points, counting(var), splice=policy)
            except KsimError as exc:  # refused whole: nothing may have changed
                refused[policy] = f"{type(exc).__name__}: {exc}"
                assert m.splices() == {} and text_of(t, points) == before, policy
                m.free(base)
                continue
            # every patch in one allocation; for every function, larger than the
            # first patch area: it grew
            assert len(m.splices()) == len(points)
            assert STRIDE > 1 or len(code_areas(t)) > areas
            time.sleep(2)
            hits = struct.unpack(f"<{len(points)}Q", t.read(base, 8 * len(points)))
            m.remove_many(handles)
            assert sum(hits) > 0 and sum(1 for h in hits if h) > 100, policy
            assert m.splices() == {}
            assert text_of(t, points) == before, policy
            m.free(base)
            # the areas the batch needed are given back
            assert len(code_areas(t)) == areas
        # every point can_insert accepted on its own must go in together
        assert refused == {}, refused
        assert load.stop() > 0
        load = None
        assert dmesg_problems(t) == []
        m.detach()
    finally:
        if load is not None:  # failed: stop the load and leave, keeping the first error
            with contextlib.suppress(KsimError, OSError):
                load.stop()
            with contextlib.suppress(KsimError, OSError):
                m.detach()


# -- areas -----------------------------------------------------------------------------------
def install_patch(t: LiveTarget, patch: int, counter: int, site: int, insn: bytes) -> None:
    """lock incq [rip+counter]; <insn, as is>; jmp site+len(insn) -- at ``patch``."""
    code = b"\xf0\x48\xff\x05" + struct.pack("<i", counter - (patch + 8)) + insn
    code += b"\xe9" + struct.pack("<i", site + len(insn) - (patch + len(code) + 5))
    t.apply(Change(code=(Write(patch, t.read(patch, len(code)), code),)))


def code_areas(t: LiveTarget) -> list[dict[str, Any]]:
    return [a for a in t.areas() if a["region"] == "code"]


def test_the_patch_area_and_heap_grow_by_areas_and_shrink_back(testbed) -> None:
    """More patch code than the first area holds lands in an area the module adds,
    within rel32 reach of text: a jmp into it counts every call.  The heap grows
    likewise.  Freed, the added areas go back; a kept splice in an added area
    survives a kerninstd restart (its area and block adopted, never handed out)."""
    t = connect(testbed)
    name = f"batch-area-{os.getpid()}"
    try:
        first = code_areas(t)
        assert len(first) == 1
        size = first[0]["size"]
        big = [t.alloc_code(size * 3 // 4) for _ in range(2)]  # the second fits no more
        grown = code_areas(t)
        assert len(grown) == 2
        added = next(a for a in grown if a["address"] != first[0]["address"])
        assert added["address"] <= big[1] < added["address"] + added["size"]
        data = [t.alloc_data(size * 3 // 4, 8) for _ in range(2)]
        assert len([a for a in t.areas() if a["region"] == "data"]) == 2
        t.write(data[1], b"\x5a" * 64)
        assert t.read(data[1], 64) == b"\x5a" * 64
        # a splice whose patch lives in the added area
        site, insn = plain_insn(t, "__x64_sys_getppid")
        orig = t.read(site, 16)
        install_patch(t, big[1], data[1], site, insn)
        t.write(data[1], bytes(8))
        t.free_data(data[0])  # while no patch code of this client is live
        jmp = Write(site, orig[:5], b"\xe9" + struct.pack("<i", big[1] - (site + 5)))
        t.apply(Change(text=(jmp,)))
        with pytest.raises(BlockInUse):  # its patch code may write any of its blocks now
            t.free_data(data[1])
        t.run(while_cmd=f"{getppid_loop()} 1000")
        assert 1000 <= read_u64(t, data[1]) <= 1002
        # kept, across a kerninstd restart: the new kerninstd adopts the added areas
        t.free_code(big[0])
        t.keep(name=name)
        t = restart_kerninstd(t, testbed)
        assert t.read(site, 5) == jmp.new
        assert len(code_areas(t)) == 2
        fresh = [t.alloc_code(4096) for _ in range(8)]
        assert all(not big[1] <= a < big[1] + size * 3 // 4 for a in fresh)
        t.run(while_cmd=f"{getppid_loop()} 1000")
        assert read_u64(t, data[1]) >= 2000
        for a in fresh:
            t.free_code(a)
        t.remove_kept(name)
        assert t.read(site, 16) == orig
        # nothing holds the added areas any more: given back
        assert len(code_areas(t)) == 1
        assert len([a for a in t.areas() if a["region"] == "data"]) == 1
        assert dmesg_problems(t) == []
    finally:
        with contextlib.suppress(KsimError):
            if name in {k["name"] for k in t.kept()}:
                t.remove_kept(name)
        t.close()


def test_patch_code_freed_is_free_again_once_no_session_is_left(testbed) -> None:
    """A freed patch block waits for QUIESCE before it is handed out again (a task
    may still run in it); kerninstd waits that out as soon as no session is left,
    not in the next client's first allocation.  (The testbed serves one client at
    a time.)"""
    t = connect(testbed)
    try:
        before = sum(a["free"] for a in code_areas(t))
        block = t.alloc_code(4096)
        t.free_code(block)
        assert sum(a["free"] for a in code_areas(t)) <= before - 4096  # held back
    finally:
        t.close()
    t = connect(testbed)
    try:
        assert sum(a["free"] for a in code_areas(t)) == before
    finally:
        t.close()


def test_a_springboard_in_a_function_text_poke_runs_goes_in_and_out(testbed) -> None:
    """invalidate_user_asid starts with a 2-byte jmp and has padding after its ret: the
    jmp policy splices it with a short jmp to a springboard in that padding, two writes
    of one batch, and text_poke itself calls it (switch_mm_irqs_off) while the int3s of
    that very batch are in: every temporary route must be in place before any int3."""
    m = attach(testbed)
    t: LiveTarget = m.target
    try:
        f = m.find_function("invalidate_user_asid")
        before = t.read(f.address, f.size + 16)
        counter = m.malloc(8)
        h = m.insert_snippet(m.entry_point(f), counter.atomic_assign(counter + 1), splice="jmp")
        assert m.patch_of(h).tactic == "springboard"
        t.exec_checked("ls -R /proc/sys > /dev/null")
        assert m.read(counter) > 0
        m.remove_snippet(h)
        assert t.read(f.address, f.size + 16) == before
        assert dmesg_problems(t) == []
    finally:
        m.detach()
