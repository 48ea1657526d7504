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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: listed last in a program: its first output marks the end of attaching
READY_PROBE = 'interval:ms:100 { printf("ksim-ready\\n"); }\n'

DRIVER = r'''
import json, os, re, resource, signal, subprocess, sys, threading, time
prog, workload, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
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
p = subprocess.Popen(["bpftrace", prog], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def run(t: Any, program: str, workload: str, limit: float, work: Path, name: str) -> dict[str, Any]:
    """Run ``program`` under bpftrace in the live target ``t``'s guest while
    ``workload`` (a shell command) runs; the driver's report (module doc)."""
    from ksim.live.testbed import guest_file, host_python

    prog = guest_file(work, name, program)
    driver = guest_file(work, "bpftrace_driver.py", DRIVER)
    out = t.exec(f"{host_python()} {driver} {prog} '{workload}' {limit:g}", timeout=3 * limit + 600)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"status": "error", "output": out[-2000:]}
