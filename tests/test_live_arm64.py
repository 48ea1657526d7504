"""ksim on a live arm64 kernel: Debian's arm64 kernel in qemu-system-aarch64 (TCG), with
kmod/'s kerninst.ko and kerninstd in the guest (``ksim testbed up --arch arm64``).

Each count is checked against the kernel's own kprobe at the function, under both
splices: a ``B`` to the patch (jmp) and a ``BRK #KERNINST_ARM64_BRK_IMM`` routed
by the module's break hook (trap), and the function's text is byte for byte as it
was afterwards.  A wildcard attaches in one batch; two clients cannot take each
other's text.  Kept short for TCG: the guest boots in seconds, each count is a few
thousand system calls.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

from typing import Any

import pytest

from ksim.commands.count import count
from ksim.errors import AlreadySpliced, OutOfMemory, TextOwned
from ksim.kapi import Manager
from ksim.live import abi, testing
from ksim.live.testing import (  # noqa: F401
    dmesg_problems,
    kerninst_arm64,
    read_u64,
    restart_kerninstd,
    target_arm64,
    testbed_arm64,
)

pytestmark = [pytest.mark.live]

FUNC = "__arm64_sys_getpriority"
N = 3000
#: calls getpriority(2) and setpriority(2) (to nice 0, as it is) N times each (arg 1),
#: as plain system calls: nothing else in the guest calls them
SYSCALLS = r"""
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1, i;
    for (i = 0; i < n; i++) {
        syscall(SYS_getpriority, PRIO_PROCESS, 0);
        syscall(SYS_setpriority, PRIO_PROCESS, 0, 0);
    }
    return 0;
}
"""


#: calls getpriority(2) until killed, at nice 19 (so that kerninstd keeps a CPU)
GETPRIORITY = r"""
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void)
{
    nice(19);
    for (;;)
        syscall(SYS_getpriority, PRIO_PROCESS, 0);
}
"""


def _spec(testbed: dict[str, Any]) -> str:
    return f"live://127.0.0.1:{testbed['port']}"


def _loop(n: int) -> str:
    return f"{testing.program('arm64_priority', SYSCALLS, 'arm64')} {n}"


def _text(t: Any, name: str, size: int = 64) -> bytes:
    """The function's first bytes as they are in the running kernel."""
    return bytes(t.read(t.lookup(name), size))


def test_the_module_is_the_arm64_one(kerninst_arm64, target_arm64):
    t = target_arm64
    assert t.arch.name == "aarch64" and t.info["arch"] == "aarch64"
    # the module's own trap, not the kprobes BRK (0x004)
    assert t.arch.trap == t.arch.trap_with(abi.TRAP_IMMEDIATES["aarch64"])
    assert int.from_bytes(t.arch.trap, "little") == 0xD4200000 | abi.ARM64_BRK_IMM << 5
    assert t.info["current_task"] != 0  # the per-cpu slot that holds current was found
    # a function's two ftrace instructions (mov x9, x30; nop) are the kernel's
    start = t.lookup(FUNC)
    found = t.text_hazards([(start, 4), (start + 4, 4), (start + 8, 4)])
    assert "ftrace" in found[0] and "ftrace" in found[1] and "ftrace" not in found[2]
    # text writes and trap sites are whole instructions
    assert t.text_hazards([(start + 2, 1)])[0] == t.text_hazards([(start, 4)])[0]


#: BRK #0x800 (BUG_BRK_IMM: BUG and WARN), AUTIASP
BUG_BRK, AUTIASP = 0xD4210000, 0xD50323BF


def test_the_kernels_tables_and_branch_protection_are_hazards(kerninst_arm64, target_arm64):
    """Every BUG/WARN BRK is a bug-table hazard, every AUTIASP a branch-protection one,
    and an instruction with an exception-table entry (a user access) an extable one."""
    t = target_arm64
    seen: set[str] = set()
    for name in ("kfree", "__put_task_struct", "strncpy_from_user", FUNC):
        start = t.lookup(name)
        code = t.read(start, 512)
        words = [int.from_bytes(code[i:i + 4], "little") for i in range(0, len(code), 4)]
        found = t.text_hazards([(start + 4 * i, 4) for i in range(len(words))])
        for word, names in zip(words, found, strict=True):
            if word == BUG_BRK:
                assert names & {"warn", "bug"}, (name, names)
            if word == AUTIASP:
                assert "branch_prot" in names, (name, names)
            seen |= names
    assert {"warn", "branch_prot", "extable", "ftrace"} <= seen, seen


def _is_load_ex(word: int) -> bool:     # aarch64_insn_is_load_ex (asm/insn.h)
    return word & 0x3F400000 == 0x08400000


def _is_store_ex(word: int) -> bool:    # aarch64_insn_is_store_ex
    return word & 0x3F400000 == 0x08000000


def test_an_exclusive_sequence_is_a_hazard(kerninst_arm64, target_arm64):
    """What kprobes refuses on arm64 (is_probed_address_atomic): every instruction after
    a load-exclusive up to its store-exclusive; the load itself may be spliced."""
    t = target_arm64
    start = t.lookup("rtnl_getlink")   # an LDXR/STLXR loop (a refcount's decrement)
    code = t.read(start, 0x800)
    words = [int.from_bytes(code[i:i + 4], "little") for i in range(0, len(code), 4)]
    found = t.text_hazards([(start + 4 * i, 4) for i in range(len(words))])
    sequences = 0
    for i, word in enumerate(words):
        if not _is_load_ex(word):
            continue
        ends = [j for j in range(i + 1, min(i + 32, len(words))) if _is_store_ex(words[j])]
        if not ends or any(_is_load_ex(w) for w in words[i + 1:ends[0]]):
            continue
        sequences += 1
        assert "exclusive" not in found[i]
        assert all("exclusive" in found[k] for k in range(i + 1, ends[0] + 1)), hex(4 * i)
    assert sequences


@pytest.mark.parametrize("splice", ["jmp", "trap"])
def test_count_matches_the_kprobe_and_text_is_restored(kerninst_arm64, target_arm64, splice):
    t = target_arm64
    before = _text(t, FUNC, 256)
    report = count(FUNC, _spec(kerninst_arm64), splice=splice, oracle="kprobe",
                   while_cmd=_loop(N))
    assert report["tactic"] == splice
    assert report["oracle_kind"] == "kprobe"
    assert report["count"] == report["oracle"] == N, report
    assert _text(t, FUNC, 256) == before
    assert not [k for k in t.kept() if k.get("writes")]
    assert dmesg_problems(t) == []


def test_a_pid_filter_counts_one_process_only(kerninst_arm64, target_arm64):
    """Snippets find the current task through the per-cpu slot INFO names (arm64 keeps
    current in SP_EL0; the module found the slot that holds it on every CPU)."""
    t = target_arm64
    go = f"/tmp/ksim-go-{id(t):x}"
    prog = testing.program("arm64_priority", SYSCALLS, "arm64")
    pid = int(t.exec(f"sh -c 'while [ ! -e {go} ]; do sleep 0.1; done; exec {prog} 2000' "
                     ">/dev/null 2>&1 & echo $!").split()[0])
    report = count(FUNC, _spec(kerninst_arm64), splice="jmp", oracle="none", pid=pid,
                   while_cmd=f"touch {go}; {prog} 3000; "
                             f"while kill -0 {pid} 2>/dev/null; do sleep 0.1; done; rm {go}")
    assert report["count"] == 2000, report


def test_a_wildcard_attaches_in_one_batch(kerninst_arm64, target_arm64):
    t = target_arm64
    names = ("__arm64_sys_getpriority", "__arm64_sys_setpriority")
    before = {n: _text(t, n) for n in names}
    report = count("__arm64_sys_*etpriority", _spec(kerninst_arm64), splice="jmp",
                   oracle="kprobe", while_cmd=_loop(N))
    rows = {r["function"]: r for r in report["rows"]}
    assert set(rows) == set(names), sorted(rows)
    for name in names:
        assert rows[name]["tactic"] == "jmp"
        assert rows[name]["count"] == rows[name]["oracle"] == N, rows[name]
    assert {n: _text(t, n) for n in names} == before
    assert dmesg_problems(t) == []


def test_two_clients_cannot_take_each_others_text(kerninst_arm64, target_arm64):
    spec = _spec(kerninst_arm64)
    before = _text(target_arm64, FUNC)
    with Manager.attach(spec) as a, Manager.attach(spec) as b:
        point = a.entry_point(FUNC)
        va = a.malloc()
        a.insert_many([point], va.atomic_assign(va + 1), splice="jmp")
        assert _text(target_arm64, FUNC) != before
        vb = b.malloc()
        for splice in ("jmp", "trap"):
            with pytest.raises((TextOwned, AlreadySpliced)):
                b.insert_many([b.entry_point(FUNC)], vb.atomic_assign(vb + 1), splice=splice)
        # a's splice still counts
        target_arm64.exec(_loop(100))
        assert a.read_array([va])[0] >= 100
    assert _text(target_arm64, FUNC) == before
    assert dmesg_problems(target_arm64) == []


def test_a_kept_splice_outlives_its_client_and_comes_out_whole(kerninst_arm64, target_arm64):
    spec = _spec(kerninst_arm64)
    before = _text(target_arm64, FUNC)
    name = f"arm64-kept-{id(spec):x}"
    m = Manager.attach(spec)
    v = m.malloc()
    m.insert_many([m.entry_point(FUNC)], v.atomic_assign(v + 1), splice="trap")
    m.target.keep(name=name)
    m.target.close()
    (kept,) = [k for k in target_arm64.kept() if k["name"] == name]
    assert kept["writes"] and kept["routes"] and kept["session"] is None
    target_arm64.exec(_loop(200))
    assert read_u64(target_arm64, v.address) >= 200  # still counting, its client gone
    assert _text(target_arm64, FUNC) != before
    target_arm64.remove_kept(name)
    assert _text(target_arm64, FUNC) == before
    assert not [k for k in target_arm64.kept() if k["name"] == name]
    assert dmesg_problems(target_arm64) == []


def test_a_kept_splice_outlives_kerninstd_and_unload_undoes_it(kerninst_arm64, target_arm64):
    spec = _spec(kerninst_arm64)
    t = target_arm64
    before = _text(t, FUNC)
    name = f"arm64-unload-{id(spec):x}"
    m = Manager.attach(spec)
    v = m.malloc()
    m.insert_many([m.entry_point(FUNC)], v.atomic_assign(v + 1), splice="jmp")
    m.target.keep(name=name)
    m.target.close()
    spliced = _text(t, FUNC)
    assert spliced != before
    t = restart_kerninstd(t, kerninst_arm64)           # the module keeps it
    try:
        assert name in [k["name"] for k in t.kept()]
        assert _text(t, FUNC) == spliced
        t = restart_kerninstd(t, kerninst_arm64, unload=True)   # unload undoes it
        assert t.kept() == [] and _text(t, FUNC) == before
        assert dmesg_problems(t) == []
    finally:
        t.close()


def test_splices_go_in_and_out_while_both_cpus_run_the_function(kerninst_arm64, target_arm64):
    """Pokes under stop_machine and BRK routes retired after an IPI to every CPU, while
    two processes (at nice 19, so that kerninstd keeps a CPU) call the function without
    pause: each round counts more, nothing breaks, the text ends as it began."""
    t = target_arm64
    before = _text(t, FUNC)
    prog = testing.program("arm64_getpriority", GETPRIORITY, "arm64")
    t.exec(f"( {prog} & {prog} & ) >/dev/null 2>&1")
    try:
        with Manager.attach(_spec(kerninst_arm64)) as m:
            v = m.malloc()
            point = m.entry_point(FUNC)
            last = 0
            for splice in ("jmp", "trap", "jmp", "trap"):
                (handle,) = m.insert_many([point], v.atomic_assign(v + 1), splice=splice)
                t.exec("sleep 0.2")
                m.remove_many([handle])
                now = m.read_array([v])[0]
                assert now > last, (splice, now, last)
                last = now
    finally:
        t.exec("killall arm64_getpriority; true")
    assert _text(t, FUNC) == before
    assert dmesg_problems(t) == []


PARAMS = "/sys/module/kerninst/parameters"


def test_a_batch_past_the_modules_limits_changes_nothing(kerninst_arm64, target_arm64):
    """max_routes and max_splices bound what one batch may pin: past them the batch is
    refused (OutOfMemory) before any instruction changes, and within them it goes in."""
    t = target_arm64
    names = ("__arm64_sys_getpriority", "__arm64_sys_setpriority")
    before = {n: _text(t, n) for n in names}
    saved = {n: int(t.exec_checked(f"cat {PARAMS}/{n}")) for n in ("max_routes", "max_splices")}
    try:
        with Manager.attach(_spec(kerninst_arm64)) as m:
            vs = m.malloc_array(2)
            points = [m.entry_point(n) for n in names]

            def snippet(p: Any) -> Any:
                v = vs[points.index(p)]
                return v.atomic_assign(v + 1)

            for name, splice in (("max_routes", "trap"), ("max_splices", "jmp")):
                t.exec_checked(f"echo 1 > {PARAMS}/{name}")
                with pytest.raises(OutOfMemory):
                    m.insert_many(points, snippet, splice=splice)
                assert {n: _text(t, n) for n in names} == before
                t.exec_checked(f"echo {saved[name]} > {PARAMS}/{name}")
                handles = m.insert_many(points, snippet, splice=splice)
                t.exec(_loop(100))
                assert m.read_array(vs) >= [100, 100]
                m.remove_many(handles)
    finally:
        for n, v in saved.items():
            t.exec_checked(f"echo {v} > {PARAMS}/{n}")
    assert {n: _text(t, n) for n in names} == before
    assert dmesg_problems(t) == []
