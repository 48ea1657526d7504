"""``ksim trace`` on the live arm64 kernel, as a user types it: a kprobe, a kretprobe's
retval and a syscall tracepoint's args, filtered by comm, each count equal to the
calls the program made and to the kernel's own kprobe at the function; and the text
byte for byte as it was once the command ended.  The kprobe is placed first: a
tracer already at a function's entry (on arm64 its BRK over the ftrace location's
``mov x9, x30``) leaves ksim's entry point, after the location, as it was.  ``kstack`` is refused by name on
arm64 (its pt_regs cannot be built in the snippet's frame slots)."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_live_arm64 import SYSCALLS  # getpriority and setpriority N times each

from ksim.live import testing
from ksim.live.client import KprobeCounter
from ksim.live.testing import kerninst_arm64, target_arm64, testbed_arm64  # noqa: F401

pytestmark = [pytest.mark.live]

ROOT = Path(__file__).resolve().parents[1]
N = 700
COMM = "ksim_a64trace"

TRACE = f"""
kprobe:__arm64_sys_getpriority /comm == "{COMM}"/ {{ @get[comm] = count(); }}
kretprobe:__arm64_sys_setpriority /comm == "{COMM}"/ {{ @ret[retval] = count(); }}
tracepoint:syscalls:sys_enter_setpriority /comm == "{COMM}"/ {{ @who[args->which, args->who] = count(); }}
"""


def _trace(testbed: dict, program: str, while_cmd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "ksim", "trace", "-e", program,
         "--target", f"live://127.0.0.1:{testbed['port']}", "--while", while_cmd, "--json"],
        capture_output=True, text=True, timeout=600, env=env)


def test_trace_counts_as_the_program_calls_and_the_kprobe_sees(kerninst_arm64, target_arm64,
                                                               testbed_arm64):
    t = target_arm64
    prog = testing.program(COMM, SYSCALLS, "arm64")
    funcs = ("__arm64_sys_getpriority", "__arm64_sys_setpriority")
    before = {f: bytes(t.read(t.lookup(f), 64)) for f in funcs}
    with KprobeCounter(t, t.lookup(funcs[0])) as oracle:
        done = _trace(testbed_arm64, TRACE, f"{prog} {N}")
        seen = oracle.count
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    maps: dict = {}
    for r in records:
        if r.get("type") in ("map", "hist"):
            maps.update(r["data"])
    assert maps["@get"] == {COMM: N}, maps
    assert seen == N, (seen, maps)
    assert maps["@ret"] == {"0": N}, maps
    # PRIO_PROCESS (0), who 0: the calling process
    assert maps["@who"] == {"0,0": N}, maps
    assert {f: bytes(t.read(t.lookup(f), 64)) for f in funcs} == before


def test_kstack_is_refused_by_name_on_arm64(kerninst_arm64, testbed_arm64):
    done = _trace(testbed_arm64, "kprobe:__arm64_sys_getpriority { @[kstack] = count(); }", "true")
    said = done.stdout + done.stderr     # --json: the error is a JSON record
    assert done.returncode != 0
    assert "kstack" in said and "Traceback" not in said, said
