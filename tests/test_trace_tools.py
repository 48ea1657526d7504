"""bpftrace's own tools, unchanged, under `ksim trace` on the live testbed, next to
Debian's bpftrace 0.17 running the same files in the same guest at the same time.

``examples/tools/vfsstat.bt`` prints, every second, how often each VFS function ran
(its wildcards match a dozen functions of this kernel).  Both tools run it over one
workload (two copies of a program that reads /dev/zero a known number of times,
then a pause long enough for two more intervals); then:

* both attach the same number of probes (bpftrace's "Attaching N probes...", where
  the wildcards are expanded by each tool against the running kernel);
* both print the same shape: the header, then per interval a time line and the
  map, ``@[func]: N`` lines in increasing order of N;
* ksim's counts per function, summed over its intervals, lie between what the
  workload itself did and what the kernel's own kprobe counted over a window that
  contains ksim's (installed before ksim attaches, read after it detaches).

``examples/tools/biolatency-kp.bt`` probes ``blk_account_io_start`` and
``blk_account_io_done`` (and their ``__`` forms).  In this kernel (6.1) only
``blk_account_io_done`` is a symbol (the start function is inlined into its
caller): both tools attach to the same single function, skip the rest, and print
no histogram, since no request is seen starting.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ksim.live import testbed as tb
from ksim.live.client import LiveTarget
from ksim.live.testbed import guest_file, host_python
from ksim.live.testing import connect, program, testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]

TOOLS = Path(__file__).resolve().parent.parent / "examples" / "tools"

READS = r"""
#include <fcntl.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    static char buf[64];
    int fd = open("/dev/zero", O_RDONLY), i;
    for (i = 0; i < 150; i++)
        if (read(fd, buf, sizeof buf) != sizeof buf)
            return 1;
    return 0;
}
"""

# The guest side: bpftrace on the unchanged tool; once its BEGIN line is out (it has
# attached), the workload; then SIGINT.  Its output, then a status line, into a
# file of the guest's own /tmp (the guest sees the host's files read-only).
DRIVER = r'''
import json, signal, subprocess, sys, threading
tool, workload, out = sys.argv[1], sys.argv[2], sys.argv[3]
p = subprocess.Popen(["bpftrace", tool], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, bufsize=1)
timer = threading.Timer(300, p.kill)
timer.start()
lines, ready = [], False
for line in p.stdout:
    lines.append(line)
    if line.startswith("Tracing "):
        ready = True
        break
status = subprocess.run(workload, shell=True).returncode if ready else None
p.send_signal(signal.SIGINT)
lines += p.stdout.readlines()
p.wait()
timer.cancel()
with open(out, "w") as f:
    f.write("".join(lines))
    f.write(json.dumps({"ready": ready, "workload": status, "bpftrace": p.returncode}) + "\n")
'''

TIME = re.compile(r"^\d\d:\d\d:\d\d$")
ENTRY = re.compile(r"^@\[(\w+)\]: (\d+)$")


def intervals(output: str) -> list[dict[str, int]]:
    """The map printed after each time line, in order; AssertionError on a line
    that is neither (after the header)."""
    out: list[dict[str, int]] = []
    values: list[int] = []
    for line in output.splitlines():
        if TIME.match(line):
            out.append({})
            values = []
        elif (m := ENTRY.match(line)) and out:
            out[-1][m.group(1)] = int(m.group(2))
            values.append(int(m.group(2)))
            assert values == sorted(values), f"not in increasing order: {output}"
    return out


def run_both(testbed: dict[str, Any], tool: str, workload: str) -> tuple[str, str]:
    """(what ``ksim trace`` printed, what bpftrace printed) over one run of the driver."""
    work = tb.cache_dir() / "tools"
    path = guest_file(work, tool, (TOOLS / tool).read_text())
    driver = guest_file(work, "tools_driver.py", DRIVER)
    out = f"/tmp/ksim-{tool}.out"
    cmd = f"{host_python()} {driver} {path} '{workload}' {out}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "ksim", "trace", str(TOOLS / tool), "--target", testbed["address"],
         "--while", cmd],
        capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    t = connect(testbed)
    try:
        theirs = t.exec_checked(f"cat {out}")
    finally:
        t.close()
    theirs, _, status = theirs.rstrip("\n").rpartition("\n")
    assert json.loads(status) == {"ready": True, "workload": 0, "bpftrace": 0}, theirs[-3000:]
    return done.stdout + done.stderr, theirs


def attaching(output: str) -> int:
    m = re.search(r"^Attaching (\d+) probes?\.\.\.$", output, re.M)
    assert m is not None, output[-2000:]
    return int(m.group(1))


def test_vfsstat_runs_unchanged_like_bpftrace(testbed) -> None:
    reads = program("ksimvfs", READS)
    t: LiveTarget = connect(testbed)
    try:
        oracles = {name: t.oracle_counter(t.lookup(name)) for name in ("vfs_read", "vfs_write")}
        try:
            ours, theirs = run_both(testbed, "vfsstat.bt", f"{reads} && {reads} && sleep 2.5")
            counted = {name: c.count for name, c in oracles.items()}
        finally:
            for c in oracles.values():
                c.close()
    finally:
        t.close()
    assert "Tracing key VFS calls... Hit Ctrl-C to end." in ours
    assert attaching(ours) == attaching(theirs), (ours[-2000:], theirs[-2000:])
    mine, peer = intervals(ours), intervals(theirs)
    assert len(mine) >= 2 and len(peer) >= 2, (ours[-2000:], theirs[-2000:])
    total: dict[str, int] = {}
    for m in mine:
        for name, n in m.items():
            total[name] = total.get(name, 0) + n
    # the workload's 300 reads of /dev/zero, at least; no more than the kernel counted
    assert 300 <= total.get("vfs_read", 0) <= counted["vfs_read"], (total, counted)
    assert total.get("vfs_write", 0) <= counted["vfs_write"], (total, counted)
    # every function either tool printed is one of the tool's attach points
    names = set(total) | {n for m in peer for n in m}
    assert all(re.fullmatch(r"vfs_(read|write)\w*|vfs_fsync|vfs_open|vfs_create", n) for n in names), names


def test_biolatency_kp_attaches_and_skips_what_bpftrace_does(testbed) -> None:
    ours, theirs = run_both(testbed, "biolatency-kp.bt", "dd if=/dev/zero of=/dev/null bs=4k count=64")
    assert "Tracing block device I/O... Hit Ctrl-C to end." in ours
    assert attaching(ours) == attaching(theirs), (ours[-2000:], theirs[-2000:])
    for name in ("blk_account_io_start", "__blk_account_io_start", "__blk_account_io_done"):
        assert f"skipped kprobe:{name}" in ours, ours[-2000:]
    assert "@usecs" not in ours and "@usecs" not in theirs
