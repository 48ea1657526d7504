"""Debian's bpftrace inside the live testbed, run the same way by every benchmark
that compares ksim with it.

A driver in the guest starts bpftrace on a program, takes the time from its
"Attaching N probes..." to its first output after attaching (``READY_PROBE``, an
interval probe listed last, prints ``ksim-ready``), runs the workload, stops
bpftrace with SIGINT and takes the time to its exit (detaching and printing its
maps); it reports one JSON line: ``status`` (ok, timeout, error), ``startup_s``,
``attach_s``, ``workload_s``, ``detach_s``, ``hits`` (the ``@`` count bpftrace
printed) and the workload's own output.  A run -- attaching, the workload,
detaching -- longer than ``limit`` seconds is killed and reported as a timeout
with the phase it was in.

The bpftrace binary is the host's (the guest runs the host's root filesystem):
``KSIM_BPFTRACE`` names one (a path the guest sees, so not under /tmp, which the
guest has a tmpfs over), otherwise ``bpftrace`` on PATH, installed with apt when
missing and run as root.  Where there is none, :func:`binary` raises
:class:`~ksim.bench.common.Skip` with the reason: a benchmark records the rows
bpftrace would have measured as skipped and keeps its other rows.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from ksim.bench.common import Skip
from ksim.errors import KsimError

#: names the bpftrace binary to run instead of the one on PATH
BINARY_ENV = "KSIM_BPFTRACE"

#: listed last in a program: its first output marks the end of attaching
READY_PROBE = 'interval:ms:100 { printf("ksim-ready\\n"); }\n'

DRIVER = r'''
import json, os, re, resource, signal, subprocess, sys, threading, time
prog, workload, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
binary = sys.argv[4] if len(sys.argv) > 4 else "bpftrace"
# bpftrace holds a file descriptor per attached probe: 1,024 are too few ("dup(fd):
# Too many open files: please raise NOFILE"); root may raise both limits
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
except (ValueError, OSError):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
start = time.monotonic()
probes = open(prog).read().count(",") + 2
# bpftrace refuses more than 512 probes unless told (BPFTRACE_MAX_PROBES)
env = dict(os.environ, BPFTRACE_MAX_PROBES=str(probes + 16))
p = subprocess.Popen([binary, prog], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, bufsize=1, env=env)
out = {"attaching": None, "ready": None, "done": False}
lines = []
def watchdog():  # the whole run -- attaching, the workload, detaching -- within the limit
    time.sleep(limit)
    if not out["done"]:
        out["timeout"] = "attaching" if out["ready"] is None else "detaching"
        p.kill()
threading.Thread(target=watchdog, daemon=True).start()
for line in p.stdout:
    now = time.monotonic()
    if line.startswith("Attaching") and out["attaching"] is None:
        out["attaching"] = now
    if line.strip() == "ksim-ready":
        out["ready"] = now
        break
    lines.append(line)
if out["ready"] is None:
    p.wait()
    end = time.monotonic()
    out["done"] = True
    print(json.dumps({"status": "timeout" if out.get("timeout") else "error", "limit": limit,
                      "phase": out.get("timeout"),
                      "startup_s": (out["attaching"] or end) - start,
                      "attach_s": end - (out["attaching"] or start), "exit_s": end - start,
                      "output": "".join(lines)[-2000:]}))
    sys.exit(0)
w0 = time.monotonic()
ran = subprocess.run(workload, shell=True, stdout=subprocess.PIPE, text=True)
w1 = time.monotonic()
p.send_signal(signal.SIGINT)
rest = p.stdout.read()
p.wait()
end = time.monotonic()
out["done"] = True
if out.get("timeout"):
    print(json.dumps({"status": "timeout", "limit": limit, "phase": out["timeout"],
                      "startup_s": out["attaching"] - start,
                      "attach_s": out["ready"] - out["attaching"], "workload_s": w1 - w0,
                      "detach_s": None, "exit_s": end - start}))
    sys.exit(0)
hits = [int(m) for m in re.findall(r"^@: (\d+)", rest, re.M)]
print(json.dumps({"status": "ok", "startup_s": out["attaching"] - start,
                  "attach_s": out["ready"] - out["attaching"], "workload_s": w1 - w0,
                  "detach_s": end - w1, "hits": hits[0] if hits else None,
                  "workload_output": ran.stdout[-2000:],
                  "output": rest[-500:] if not hits else ""}))
'''


def binary(*, install: bool = True) -> str:
    """The bpftrace to run in the guest, as an absolute host path; Skip with the
    reason when there is none (module doc)."""
    given = os.environ.get(BINARY_ENV)
    if given:
        path = os.path.abspath(given)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise Skip(f"bpftrace: {path} ({BINARY_ENV}) is not an executable file")
        if path == "/tmp" or path.startswith("/tmp/"):
            raise Skip(f"bpftrace: {path} ({BINARY_ENV}) is under /tmp, which the guest "
                       "does not see (it has a tmpfs of its own there)")
        return path
    found = shutil.which("bpftrace")
    if found is None and install:
        from ksim.live import testbed

        try:
            testbed.ensure_tools(("bpftrace",))
        except KsimError as exc:
            raise Skip(f"bpftrace is not installed, and installing it failed: {exc}") from None
        found = shutil.which("bpftrace")
    if found is None:
        raise Skip("bpftrace is not installed (apt package bpftrace)")
    return os.path.realpath(found)


def guest_tools(t: Any) -> tuple[str, str]:
    """(bpftrace, python) in the arm64 testbed's guest, whose userland is Debian's arm64
    packages (``ksim testbed up --arch arm64 --with bpftrace``), not the host's; Skip
    when its userland has no bpftrace."""
    from ksim.live import arm64bed

    found = t.exec("command -v bpftrace || true").strip()
    if not found.startswith("/"):
        raise Skip("the arm64 guest's userland has no bpftrace (boot it with "
                   "`ksim testbed up --arch arm64 --with bpftrace`)")
    return found, arm64bed.PYTHON


def run(t: Any, program: str, workload: str, limit: float, work: Path, name: str,
        bpftrace: str | None = None, *, python: str | None = None) -> dict[str, Any]:
    """Run ``program`` under bpftrace (``bpftrace``, or :func:`binary`'s) in the live
    target ``t``'s guest while ``workload`` (a shell command) runs; the driver's
    report (module doc).  ``python`` runs the driver (default: the host's, which the
    x86-64 guest runs; the arm64 guest's own, see guest_tools)."""
    from ksim.live.testbed import guest_file, host_python

    exe = bpftrace or binary()
    prog = guest_file(work, name, program)
    driver = guest_file(work, "bpftrace_driver.py", DRIVER)
    out = t.exec(f"{python or host_python()} {driver} {prog} '{workload}' {limit:g} "
                 f"{shlex.quote(exe)}",
                 timeout=3 * limit + 600)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"status": "error", "output": out[-2000:]}
