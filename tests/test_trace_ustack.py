"""ustack on the live testbed, side by side with bpftrace 0.17 in the guest.

The workload is a PIE built here with frame pointers, whose chain of named functions
(main -> ksim_outer, in the program, -> ksim_lib_middle -> ksim_lib_inner, in a
shared library of its own, mapped from a file offset not 0) ends in a getppid made
by the syscall instruction itself.  One process makes its calls in two rounds, one
while ksim traces it and one while bpftrace does, and stays alive while both print
(bpftrace names a user stack's frames when it prints it, in the process's files):
the same addresses, so the same text is expected from both, byte for byte.

Oracles: the program's own count of its calls; the chain's names, in order (the
source); bpftrace's output for the same process.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from ksim.commands.trace import trace
from ksim.live import testbed as tb
from ksim.live.testing import connect, testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]

CALLS = 23
CHAIN = ["ksim_lib_inner", "ksim_lib_middle", "ksim_outer", "main"]

LIB = r"""
#include <sys/syscall.h>
long ksim_lib_inner(long n)
{
    long r;
    /* getppid by the syscall instruction: the walk's first frame is in this function */
    __asm__ volatile ("syscall" : "=a"(r) : "0"((long)SYS_getppid) : "rcx", "r11", "memory");
    return r + n;
}
long ksim_lib_middle(long n) { return ksim_lib_inner(n) + 1; }
"""

MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
long ksim_lib_middle(long n);
static long ksim_outer(long n) { return ksim_lib_middle(n) + 2; }
static void wait_for(const char *path)
{
    struct stat st;
    while (stat(path, &st) != 0)
        usleep(10000);
}
/* ksimustack N DIR: its pid; then for each round, once DIR/goK exists, N calls down
   the chain and their count; then alive until DIR/done exists */
int main(int argc, char **argv)
{
    long n = atol(argv[1]), i, k, s = 0;
    char path[4096];
    printf("%d\n", getpid());
    fflush(stdout);
    for (k = 1; k <= 2; k++) {
        snprintf(path, sizeof(path), "%s/go%ld", argv[2], k);
        wait_for(path);
        for (i = 0; i < n; i++)
            s += ksim_outer(i);
        printf("%ld\n", i);
        fflush(stdout);
    }
    snprintf(path, sizeof(path), "%s/done", argv[2]);
    wait_for(path);
    return s == 0;
}
"""


def build() -> Path:
    """The program and its library, built at -O0 with frame pointers (every function
    of the chain has its frame record), into a directory the guest sees through 9p,
    named by the sources (the guest's cache of a file under an old name is stale)."""
    digest = hashlib.sha256((LIB + MAIN).encode()).hexdigest()[:12]
    out = tb.cache_dir() / "bin" / f"ksimustack-{digest}"
    exe = out / "ksimustack"
    if not exe.exists():
        out.mkdir(parents=True, exist_ok=True)
        (out / "lib.c").write_text(LIB)
        (out / "main.c").write_text(MAIN)
        flags = ["-O0", "-fno-omit-frame-pointer"]
        subprocess.run(["gcc", *flags, "-shared", "-fPIC", "-o", str(out / "libksimustack.so"),
                        str(out / "lib.c")], check=True)
        subprocess.run(["gcc", *flags, "-pie", "-fPIE", "-o", str(exe), str(out / "main.c"),
                        f"-L{out}", "-lksimustack", f"-Wl,-rpath,{out}"], check=True)
    return exe


class Workload:
    """The program running in the guest, in a directory of its own under /tmp."""

    def __init__(self, tbed: dict, exe: Path, tag: str) -> None:
        self.tb, self.dir = tbed, f"/tmp/ksimustack-{tag}"
        self.out = f"{self.dir}/out"
        t = connect(tbed)
        try:
            t.exec_checked(f"rm -rf {self.dir}; mkdir -p {self.dir}; setsid {exe} {CALLS} "
                           f"{self.dir} >{self.out} 2>&1 </dev/null &")
            deadline = time.monotonic() + 60
            while not (text := t.exec_checked(f"cat {self.out}")).strip():
                assert time.monotonic() < deadline, "the workload did not start"
                time.sleep(0.2)
        finally:
            t.close()
        self.pid = int(text.split()[0])

    def round(self, k: int) -> str:
        """A command that starts round ``k`` and returns once its count is out."""
        return (f"touch {self.dir}/go{k}; while [ $(wc -l < {self.out}) -le {k} ]; "
                "do sleep 0.05; done")

    def counts(self) -> list[int]:
        t = connect(self.tb)
        try:
            return [int(x) for x in t.exec_checked(f"cat {self.out}").split()[1:]]
        finally:
            t.close()

    def stop(self) -> None:
        t = connect(self.tb)
        try:
            t.exec_checked(f"touch {self.dir}/done")
        finally:
            t.close()


def entries(text: str) -> dict[str, list[tuple[str, int]]]:
    """The keyed maps of a program's text output: name -> [(key text, count)], in
    the order printed (two keys may print alike)."""
    maps: dict[str, list[tuple[str, int]]] = {}
    for m in re.finditer(r"^(@\w*)\[(.*?)\]: (\d+)$", text, re.M | re.S):
        maps.setdefault(m.group(1), []).append((m.group(2), int(m.group(3))))
    return maps


def bpftrace_maps(tbed: dict, prog: str, cmd: str, tag: str) -> dict[str, list[tuple[str, int]]]:
    """The keyed maps bpftrace prints running ``prog`` while ``cmd`` runs."""
    script = f"/tmp/ksimustack-{tag}.sh"
    t = connect(tbed)
    try:
        t.exec_checked(f"printf '%s\\n' {shlex.quote(cmd)} > {script}")
        out = t.exec_checked(f"timeout 300 bpftrace -e {shlex.quote(prog)} -c '/bin/sh {script}' "
                             "2>/dev/null", timeout=400)
    finally:
        t.close()
    return entries(out)


def names(stack: str) -> list[str]:
    """The symbols of a stack's frames (bpftrace or perf mode)."""
    return [re.sub(r"^\S+ (?=\S+\+\d+)", "", line.strip()).split("+")[0]
            for line in stack.strip("\n").splitlines()]


def test_ustack_names_the_chain_as_bpftrace_names_it(testbed) -> None:
    """@[ustack], @p[ustack(perf)] and @r[ustack(raw, 3)] over the workload's getppid
    calls: one stack each, counted as often as the program says it called; its frames
    the chain's functions in order, then libc's __libc_start_call_main (found in
    libc's build-id debug file, as bcc finds it); the bpftrace and perf mode texts
    equal to bpftrace's for the same process, and raw's addresses the perf mode's."""
    exe = build()
    work = Workload(testbed, exe, "names")
    try:
        prog = ("kprobe:__x64_sys_getppid /pid == %d/ { @[ustack] = count(); "
                "@p[ustack(perf)] = count(); @r[ustack(%s, 3)] = count(); @n = count(); }")
        report, text = trace(prog % (work.pid, "raw"), testbed["address"], while_cmd=work.round(1))
        theirs = bpftrace_maps(testbed, prog % (work.pid, "perf"), work.round(2), "names")
        counts = work.counts()
    finally:
        work.stop()
    assert counts == [CALLS, CALLS]
    ours = report["maps"]
    assert ours["@n"] == CALLS
    (stack, n), = ours["@"].items()
    assert n == CALLS
    assert names(stack)[:5] == [*CHAIN, "__libc_start_call_main"], stack
    assert stack.startswith("\n    ksim_lib_inner+") and f"]: {CALLS}\n" in text
    (perf, _), = ours["@p"].items()
    assert names(perf)[:4] == CHAIN
    exe_lines = [line for line in perf.splitlines() if "ksim_outer" in line or " main+" in line]
    assert len(exe_lines) == 2 and all(line.endswith(f" ({exe})") for line in exe_lines)
    assert f"({exe.parent}/libksimustack.so)" in perf.splitlines()[1]
    (raw, _), = ours["@r"].items()
    assert raw.split() == [line.split()[0] for line in perf.strip().splitlines()[:3]]
    # bpftrace 0.17 has no raw mode: its third map is ustack(perf, 3)
    assert entries(text)["@"] == theirs["@"] == [(stack, CALLS)]
    assert theirs["@p"] == [(perf, CALLS)]
    assert [line.split()[0] for line in theirs["@r"][0][0].strip().splitlines()] == raw.split()


def addresses(stack: str) -> tuple[str, ...]:
    """A perf mode stack's addresses."""
    return tuple(line.split()[0] for line in stack.strip("\n").splitlines())


def test_a_ustack_key_is_per_process_each_named_in_its_own_files(testbed) -> None:
    """Two processes of one program down the same chain: two keys, one per pid,
    whose stacks print alike in bpftrace mode, each counted as its process says; in
    perf mode each process's own addresses (ASLR puts them apart), each named in its
    own process's mappings.  bpftrace 0.17 prints the same two keys, but keeps one
    symbol cache per executable, made from the first process it names (its
    resolve_usym; bpftrace issues #75 and #2386): the other process, loaded elsewhere,
    has its frames printed as addresses there, which must then be the ones ksim
    names."""
    exe = build()
    one, two = Workload(testbed, exe, "pid1"), Workload(testbed, exe, "pid2")
    try:
        prog = (f"kprobe:__x64_sys_getppid /pid == {one.pid} || pid == {two.pid}/ "
                "{ @[ustack(4)] = count(); @p[ustack(perf, 4)] = count(); @pids[pid] = count(); }")
        report, text = trace(prog, testbed["address"],
                             while_cmd=f"{one.round(1)}; {two.round(1)}")
        theirs = bpftrace_maps(testbed, prog, f"{one.round(2)}; {two.round(2)}", "pids")
        counts = one.counts() + two.counts()
    finally:
        one.stop()
        two.stop()
    assert counts == [CALLS] * 4
    assert report["maps"]["@pids"] == {str(one.pid): CALLS, str(two.pid): CALLS}
    ours = entries(text)
    assert len(ours["@"]) == 2 and ours["@"][0] == ours["@"][1], text
    assert names(ours["@"][0][0]) == CHAIN and ours["@"][0][1] == CALLS
    perf = {addresses(k): k for k, n in ours["@p"] if n == CALLS}
    assert len(perf) == 2 and all(names(k) == CHAIN for k in perf.values()), text
    assert ours["@"][0] in theirs["@"] and len(theirs["@"]) == 2, theirs
    assert {addresses(k) for k, _ in theirs["@p"]} == set(perf), theirs
    named = 0
    for k, n in theirs["@p"]:
        unresolved = "".join(f"\n\t{a} 0x{a} ([unknown])" for a in addresses(k)) + "\n"
        assert n == CALLS and k in (perf[addresses(k)], unresolved), (k, perf)
        named += k == perf[addresses(k)]
    assert named >= 1
