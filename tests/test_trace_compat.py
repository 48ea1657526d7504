"""`ksim trace` against the real bpftrace, on the live testbed.

Each program runs under both tools at once, over one run of a deterministic
workload: ksim's probes go in first; then Debian's bpftrace 0.17 starts in the
guest, and once it has attached (its readiness interval probe printed) the
workload runs: two copies of one program, named ``ksimwl_a`` and ``ksimwl_b``,
each making known syscalls a known number of times; then bpftrace is stopped
with SIGINT and prints its maps as JSON, and ksim's maps are read.  Every
program filters on those names, so what else the guest does is in neither, and
the two tools must agree exactly: counts, sums, extremes and histogram buckets.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
from typing import Any

import pytest

from ksim.kapi import Manager
from ksim.live import testbed as tb
from ksim.live.testbed import guest_file, host_python
from ksim.live.testing import program, testbed  # noqa: F401
from ksim.trace.parser import parse
from ksim.trace.session import Exited, TraceSession

pytestmark = [pytest.mark.live, pytest.mark.slow]

WORKLOAD = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
/* N rounds of: getppid; getpgrp every other round; a read of /dev/zero whose size
 * cycles through SIZES (so read's return values are known). */
static const long SIZES[] = {1, 7, 100, 512, 4000, 4096, 8192};
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100, i;
    static char buf[8192];
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0)
        return 1;
    for (i = 0; i < n; i++) {
        syscall(SYS_getppid);
        if (i & 1)
            syscall(SYS_getpgrp);
        if (read(fd, buf, SIZES[i % 7]) != SIZES[i % 7])
            return 2;
    }
    close(fd);
    printf("%ld\n", i);
    return 0;
}
"""

# The guest side: start bpftrace on the program, wait until it has attached (the
# readiness probe prints), run the workload, stop bpftrace with SIGINT; print
# bpftrace's JSON lines, then the workload's status as the last line.
DRIVER = r'''
import json, signal, subprocess, sys, threading
prog, workload = sys.argv[1], sys.argv[2]
p = subprocess.Popen(["bpftrace", "-f", "json", prog], stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True, bufsize=1)
timer = threading.Timer(300, p.kill)
timer.start()
lines = []
ready = False
for line in p.stdout:
    lines.append(line)
    if "ksim-ready" in line:
        ready = True
        break
status = None
if ready:
    status = subprocess.run(workload, shell=True, capture_output=True, text=True).returncode
    p.send_signal(signal.SIGINT)
lines += p.stdout.readlines()
p.wait()
timer.cancel()
sys.stdout.write("".join(lines))
print(json.dumps({"ready": ready, "workload": status, "bpftrace": p.returncode}))
'''

READY = '\ninterval:ms:200 { printf("ksim-ready\\n"); }\n'
NAMES = '(comm == "ksimwl_a" || comm == "ksimwl_b")'
ROUNDS = {"ksimwl_a": 70, "ksimwl_b": 49}

PROGRAMS = {
    "count": 'kprobe:__x64_sys_getppid /' + NAMES + '/ { @ = count(); }',
    "per-func": 'kprobe:__x64_sys_getppid, kprobe:__x64_sys_getpgrp /' + NAMES + '/ '
                '{ @calls[func] = count(); }',
    "per-comm": 'kprobe:__x64_sys_getppid /' + NAMES + '/ { @[comm] = count(); }',
    "kretprobe-hist": 'kretprobe:vfs_read /' + NAMES + '/ { @bytes = hist(retval); '
                      '@total = sum(retval); }',
    "args": 'kprobe:vfs_read /comm == "ksimwl_a"/ { @most = max(arg2); @least = min(arg2); '
            '@mean = avg(arg2); @l = lhist(arg2, 0, 8192, 1024); }',
    "maps-in-filters": 'kprobe:vfs_read /' + NAMES + '/ { @start[tid] = arg2; }\n'
                       'kretprobe:vfs_read /@start[tid]/ { @same[comm] = sum(retval == @start[tid]); '
                       'delete(@start[tid]); }',
}


def bpftrace_maps(output: str) -> dict[str, Any]:
    maps: dict[str, Any] = {}
    for line in output.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("type") in ("map", "hist", "lhist", "stats"):
            maps.update(doc["data"])
    return maps


def both(testbed: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(ksim's maps, bpftrace's maps, the driver's output) over one workload run."""
    a = program("ksimwl_a", WORKLOAD)
    b = program("ksimwl_b", WORKLOAD)
    workload = f"{a} {ROUNDS['ksimwl_a']} && {b} {ROUNDS['ksimwl_b']}"
    work = tb.cache_dir() / "compat"
    prog = guest_file(work, "compat.bt", source + READY)
    driver = guest_file(work, "driver.py", DRIVER)
    with Manager.attach(testbed["address"], token_file=testbed["token_file"]) as m:
        session = TraceSession(m, parse(source))
        session.attach()
        try:
            session.begin()
            try:
                r = m.run(while_cmd=f"{host_python()} {driver} {prog} '{workload}'", timeout=900,
                          progress=session.progress())
            except Exited:
                raise AssertionError("no program here calls exit()") from None
            session.end()
        finally:
            session.detach()
        assert session.lost() == {} and session.skipped == {}
        ours = session.maps_json()
    status = json.loads(r.output.strip().splitlines()[-1])
    assert status == {"ready": True, "workload": 0, "bpftrace": 0}, r.output[-3000:]
    return ours, bpftrace_maps(r.output), r.output


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_ksim_and_bpftrace_agree(testbed, name: str) -> None:
    ours, theirs, output = both(testbed, PROGRAMS[name])
    assert theirs, output[-3000:]
    assert ours == theirs, (ours, theirs)
    if name == "count":
        assert ours["@"] == sum(ROUNDS.values())
    if name == "per-comm":
        assert ours["@"] == ROUNDS
    if name == "per-func":
        assert ours["@calls"] == {"__x64_sys_getppid": sum(ROUNDS.values()),
                                  "__x64_sys_getpgrp": sum(n // 2 for n in ROUNDS.values())}
