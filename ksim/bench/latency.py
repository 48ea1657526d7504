"""latency: a kretprobe latency histogram under ksim and under bpftrace, side by side
on the live testbed, beside the kernel's own measure of the call, and where their
difference comes from.

The program is the usual one, keyed by ``comm`` so that one run holds each size::

    kprobe:vfs_read { @start[tid] = nsecs; }
    kretprobe:vfs_read /@start[tid]/ { $d = nsecs - @start[tid];
        @ns[comm] = hist($d); @us[comm] = hist($d / 1000); @sum[comm] = sum($d);
        @min[comm] = min($d); delete(@start[tid]); }

(everything after the exit's clock read lies outside the interval it measures).

The workload has a known cost per call: a static guest program, run once per size
under a name of its own (``ksimlat_SIZE``, a symlink, so that ``comm`` tells the
sizes apart), makes N ``read`` calls of SIZE bytes from ``/dev/zero`` and times each
with ``clock_gettime(CLOCK_MONOTONIC)`` around it.  Before each size it runs as
``ksimlat_badfd`` and reads from a closed descriptor, which fails in ``ksys_read``
before ``vfs_read``: the syscall's own cost, and how fast the guest runs just then
(TCG's speed follows the host's load; a run whose failing reads were more than
SLACK slower than the fastest seen is made again).  Uninstrumented, the fastest call
of SIZE less the fastest failing one is the kernel's own measure of ``vfs_read``
(with ``fdput_pos``): no probe anywhere.

Each round runs every condition once, in one guest (CONDITIONS):

``none``                    the workload alone
``ksim``, ``bpftrace``      the program under one tool (bpftrace 0.17, ``-f json``)
``both``                    both at once
``ksim+ksim-pair``          ksim's program and ksim's empty ``kprobe:read_zero {}
                            kretprobe:read_zero {}`` (read_zero is what vfs_read calls
                            for /dev/zero: one hit of each inside every interval);
                            ``ksim+ksim-kprobe`` the kprobe alone
``bpftrace+bpftrace-pair``  the same with bpftrace's
``ksim+bpftrace-pair``,     one tool's program, the other's empty pair
``bpftrace+ksim-pair``

Figures (:func:`summarize`), per size: each tool's latency (the run's fastest call,
``@min``), beside the kernel's own measure; ``cost``, what the tool's two probes add
to a call as the workload sees it (instrumented less uninstrumented); what running
the other tool, or an empty pair, adds to a tool's latency; the histograms' buckets
(``@ns``) and how far bpftrace's lie above ksim's; and the slope of each tool's
latency against the kernel's measure from the smallest size to the largest.  Each
is the median over the rounds (the testbed is shared: others' tests run meanwhile).

Not one of ``ksim bench``'s benchmarks (no subcommand); it writes the same
``ksim-bench/1`` document, with one benchmark, ``latency``::

    python -m ksim.bench.latency [--quick] [--output benchmarks/results/latency.json]
                                 [--plot benchmarks/results/bench-latency.png]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ksim.bench import bpftrace
from ksim.bench.common import SCHEMA, Context, Section, Skip, Table, machine_info, now_iso
from ksim.errors import KsimError

NAME = "latency"
TITLE = "kretprobe latencies: ksim trace against bpftrace, with the workload's own measure"

#: read sizes (bytes) of the workload; each runs as its own process ksimlat_SIZE
SIZES = (1, 1024, 4096, 16384, 65536)
QUICK_SIZES = (1, 4096, 65536)
CALLS = 2000
QUICK_CALLS = 1000
ROUNDS = 5
QUICK_ROUNDS = 1
#: the function vfs_read calls for /dev/zero (zero_fops.read), probed by the empty pairs
INNER = "read_zero"
PREFIX = "ksimlat_"
#: a run whose failing reads were more than this much slower than the fastest seen
#: (the host was busy) is made again, at most RETRIES times; the fastest is kept
SLACK = 0.1
RETRIES = 2
#: per-call figures are the median over the sizes up to this many bytes (summarize)
SMALL = 4096

PROGRAM = """kprobe:vfs_read { @start[tid] = nsecs; }
kretprobe:vfs_read /@start[tid]/ { $d = nsecs - @start[tid];
    @ns[comm] = hist($d); @us[comm] = hist($d / 1000); @sum[comm] = sum($d);
    @min[comm] = min($d); delete(@start[tid]); }
"""
EMPTY_KPROBE = f"kprobe:{INNER} {{ }}\n"
EMPTY_PAIR = EMPTY_KPROBE + f"kretprobe:{INNER} {{ }}\n"

WORKLOAD = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
/* PROG N SIZE: N reads of SIZE bytes from /dev/zero (SIZE 0: from a closed
 * descriptor, which fails before vfs_read), each timed with CLOCK_MONOTONIC;
 * one JSON line: size, calls, median, mean, min (ns) and the calls' power-of-two
 * histogram (index 2 + floor(log2(ns)), as bpftrace's hist() counts). */
static char buf[1 << 20];
static int cmp(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}
int main(int argc, char **argv)
{
    long n = atol(argv[1]), size = atol(argv[2]), i, hist[66] = {0};
    long long *ns = calloc(n, sizeof *ns), sum = 0;
    int fd = open("/dev/zero", O_RDONLY), bad = dup(fd);
    struct timespec a, b;
    close(bad);
    for (i = 0; i < n; i++) {
        clock_gettime(CLOCK_MONOTONIC, &a);
        long r = read(size ? fd : bad, buf, size ? size : 1);
        clock_gettime(CLOCK_MONOTONIC, &b);
        if (size ? r != size : r != -1)
            return 2;
        ns[i] = (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
        sum += ns[i];
        int k = 0;
        for (long long v = ns[i]; v > 1; v >>= 1)
            k++;
        hist[ns[i] <= 0 ? (ns[i] < 0 ? 0 : 1) : 2 + k]++;
    }
    qsort(ns, n, sizeof *ns, cmp);
    printf("{\"workload\": {\"size\": %ld, \"calls\": %ld, \"median\": %lld, \"mean\": %lld, "
           "\"min\": %lld, \"hist\": [", size, n, ns[n / 2], sum / n, ns[0]);
    for (i = 0; i < 66; i++)
        printf("%s%ld", i ? ", " : "", hist[i]);
    printf("]}}\n");
    return 0;
}
"""

# The guest side: start bpftrace on a program (if any), wait until it has attached
# (its readiness probe prints), run the workload, stop bpftrace with SIGINT; print
# the workload's lines and bpftrace's JSON lines, then a status line.
DRIVER = r'''
import json, signal, subprocess, sys, threading
prog, workload, exe = sys.argv[1], sys.argv[2], sys.argv[3]
lines, ready, p = [], prog == "-", None
if prog != "-":
    p = subprocess.Popen([exe, "-f", "json", prog], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = threading.Timer(600, p.kill)
    timer.start()
    for line in p.stdout:
        lines.append(line)
        if "ksim-ready" in line:
            ready = True
            break
status = None
if ready:
    ran = subprocess.run(workload, shell=True, capture_output=True, text=True)
    status = ran.returncode
    lines.append(ran.stdout)
if p is not None:
    p.send_signal(signal.SIGINT)
    lines += p.stdout.readlines()
    p.wait()
    timer.cancel()
sys.stdout.write("".join(lines))
print(json.dumps({"ready": ready, "workload": status, "bpftrace": p and p.returncode}))
'''

READY = '\ninterval:ms:200 { printf("ksim-ready\\n"); }\n'


# --- the guest programs ------------------------------------------------------------------
def workload_binary() -> Path:
    """The workload, built statically on the host (the guest sees the host's root),
    with a symlink per size and one for the failing read (module doc)."""
    from ksim.live import testbed

    digest = hashlib.sha256(WORKLOAD.encode()).hexdigest()[:12]
    work = testbed.cache_dir() / "latency" / digest
    exe = work / "ksimlat"
    if not exe.exists():
        work.mkdir(parents=True, exist_ok=True)
        src = work / "ksimlat.c"
        src.write_text(WORKLOAD)
        try:
            proc = subprocess.run(["gcc", "-O2", "-static", "-o", str(exe), str(src)],
                                  capture_output=True, text=True, timeout=120)
        except OSError as exc:
            raise Skip(f"cannot build the guest workload: {exc}") from None
        if proc.returncode != 0:
            raise Skip(f"cannot build the guest workload: {proc.stderr.strip()[-300:]}")
    for name in [*(str(s) for s in SIZES), "badfd"]:
        link = work / f"{PREFIX}{name}"
        if not link.is_symlink():
            link.symlink_to("ksimlat")
    return exe


def workload_command(exe: Path, sizes: tuple[int, ...], calls: int) -> str:
    """One shell command running each size in turn, each after the failing read (the
    guest's speed just then: TCG's follows the host's load)."""
    runs = []
    for s in sizes:
        runs += [f"{exe.parent / (PREFIX + 'badfd')} {calls} 0",
                 f"{exe.parent / (PREFIX + str(s))} {calls} {s}"]
    return " && ".join(runs)


def parse_output(text: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """(the workload's lines by size, bpftrace's maps, the driver's status)."""
    workload: dict[int, dict[str, Any]] = {}
    maps: dict[str, Any] = {}
    status = before = None
    for text_line in text.splitlines():
        try:
            doc = json.loads(text_line)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        if "ready" in doc:
            status = doc
        elif isinstance(doc.get("workload"), dict):
            line = doc["workload"]
            # the histogram as {index: count} of the buckets used
            line["hist"] = {str(i): c for i, c in enumerate(line["hist"]) if c}
            if line["size"] == 0:
                before = line
                workload.setdefault(0, line)
            else:
                workload[int(line["size"])] = {**line, "badfd": before}
        elif doc.get("type") in ("map", "hist"):
            maps.update(doc["data"])
    return workload, maps, status


def ours_only(maps: dict[str, Any]) -> dict[str, Any]:
    """The maps keyed by comm, the workload's keys only (@start, which holds the
    threads of every process still inside vfs_read at the end, is left out)."""
    return {name: {k: v for k, v in value.items() if k.startswith(PREFIX)}
            for name, value in maps.items() if name != "@start" and isinstance(value, dict)}


# --- one condition ---------------------------------------------------------------------------
#: condition -> (ksim's program, bpftrace's program); None: that tool does not run
CONDITIONS: dict[str, tuple[str | None, str | None]] = {
    "none": (None, None),
    "ksim": (PROGRAM, None),
    "bpftrace": (None, PROGRAM),
    "both": (PROGRAM, PROGRAM),
    "ksim+ksim-pair": (PROGRAM + EMPTY_PAIR, None),
    "ksim+ksim-kprobe": (PROGRAM + EMPTY_KPROBE, None),
    "bpftrace+bpftrace-pair": (None, PROGRAM + EMPTY_PAIR),
    "ksim+bpftrace-pair": (PROGRAM, EMPTY_PAIR),
    "bpftrace+ksim-pair": (EMPTY_PAIR, PROGRAM),
}
TOOLS = ("ksim", "bpftrace")


def run_condition(address: str, token_file: str | None, condition: str, command: str,
                  exe: str | None) -> dict[str, Any]:
    """Run the workload ``command`` in the guest under ``condition`` (CONDITIONS):
    ksim's side through a TraceSession on this host, bpftrace's through the driver in
    the guest.  The workload's lines by size, and each tool's maps (as bpftrace's JSON
    holds them) when it ran the latency program, else None."""
    from ksim.kapi import Manager
    from ksim.live import testbed
    from ksim.trace.parser import parse
    from ksim.trace.session import TraceSession

    ksim_source, bt_source = CONDITIONS[condition]
    if bt_source is not None and exe is None:
        raise Skip("bpftrace is not available")
    work = testbed.cache_dir() / "latency"
    driver = testbed.guest_file(work, "driver.py", DRIVER)
    prog = "-" if bt_source is None else str(testbed.guest_file(work, "prog.bt", bt_source + READY))
    cmd = (f"{testbed.host_python()} {driver} {prog} {shlex.quote(command)} "
           f"{shlex.quote(exe or 'bpftrace')}")
    ours: dict[str, Any] = {}
    points: list[tuple[str, int, str]] = []
    with Manager.attach(address, token_file=token_file) as m:
        if ksim_source is None:
            output = m.run(while_cmd=cmd, timeout=1200).output
        else:
            session = TraceSession(m, parse(ksim_source))
            session.attach()
            try:
                splices = m.splices()
                points = sorted({(a.site.probe,
                                  a.point.address - m.find_function(a.site.function).address,
                                  splices[a.point.address][0]) for a in session.attached.values()})
                session.begin()
                output = m.run(while_cmd=cmd, timeout=1200, progress=session.progress()).output
                session.end()
            finally:
                session.detach()
            if session.lost():
                raise KsimError(f"{condition}: ksim lost map updates: {session.lost()}")
            ours = session.maps_json()
    workload, theirs, status = parse_output(output)
    if (status is None or not status["ready"] or status["workload"] != 0
            or status["bpftrace"] not in (0, None)):
        raise KsimError(f"{condition}: the guest run failed: {output[-1500:]}")
    return {"workload": {str(k): v for k, v in workload.items()},
            "ksim_points": [{"probe": p, "at": f"+{off:#x}", "tactic": tactic}
                            for p, off, tactic in points],
            "ksim": ours_only(ours) if ksim_source and PROGRAM in ksim_source else None,
            "bpftrace": ours_only(theirs) if bt_source and PROGRAM in bt_source else None}




def measure(sizes: tuple[int, ...] = SIZES, calls: int = CALLS, rounds: int = ROUNDS,
            conditions: tuple[str, ...] = tuple(CONDITIONS), bar: Any = None) -> dict[str, Any]:
    """Every condition once per round, in order, on the live testbed: the raw runs
    (``runs[round][condition]``) and what the summary needs to know about them."""
    from ksim.live import testbed

    state = testbed.status()
    if not state.get("up"):
        raise Skip("the Linux testbed is not up (start it with `ksim testbed up`)")
    try:
        exe: str | None = bpftrace.binary()
    except Skip:
        if any(CONDITIONS[c][1] for c in conditions):
            raise
        exe = None
    version = None
    if exe is not None:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.strip() or None
    binary = workload_binary()
    command = workload_command(binary, sizes, calls)
    runs: list[dict[str, Any]] = [{} for _ in range(rounds)]
    fastest = float("inf")      # the fastest failing read of any run so far

    def run_it(r: int, cond: str) -> None:
        nonlocal fastest
        got = run_condition(str(state["address"]), state.get("token_file"), cond, command, exe)
        got["speed"] = slowest_failing_read(got)
        fastest = min(fastest, got["speed"])
        kept = runs[r].get(cond)
        got["attempts"] = 1 + (kept["attempts"] if kept else 0)
        if kept is None or got["speed"] < kept["speed"]:
            runs[r][cond] = got
        else:
            kept["attempts"] = got["attempts"]

    def slow(r: int, cond: str) -> bool:
        return bool(runs[r][cond]["speed"] > (1 + SLACK) * fastest)

    for r in range(rounds):
        for cond in conditions:
            if bar is not None:
                bar.advance(0, note=f"round {r + 1}: {cond}")
            run_it(r, cond)
            while slow(r, cond) and runs[r][cond]["attempts"] <= RETRIES:
                run_it(r, cond)
            if bar is not None:
                bar.advance()
    # a run that was slow against a faster one made later: made again too
    for r in range(rounds):
        for cond in conditions:
            while slow(r, cond) and runs[r][cond]["attempts"] <= RETRIES:
                if bar is not None:
                    bar.advance(0, note=f"round {r + 1}: {cond} again")
                run_it(r, cond)
    return {"runs": runs, "sizes": list(sizes), "calls": calls, "rounds": rounds,
            "program": PROGRAM, "empty_pair": EMPTY_PAIR, "workload": command,
            "address": state.get("address"), "kernel": state.get("kernel"),
            "accel": state.get("accel"), "bpftrace": version}


def slowest_failing_read(run: dict[str, Any]) -> float:
    """The slowest of a run's fastest failing reads (one before each size): how slow
    the guest was during the run at its slowest."""
    return max(w["badfd"]["min"] for s, w in run["workload"].items() if s != "0")


# --- the figures -------------------------------------------------------------------------------
def comm(size: int) -> str:
    return f"{PREFIX}{size}"


def hist_buckets(buckets: list[dict[str, int]]) -> dict[int, int]:
    """bpftrace's JSON histogram as {bucket index: count} (index 1 is [0], 2 is [1],
    3 + k is [2**(k+1), 2**(k+2)))."""
    out: dict[int, int] = {}
    for b in buckets:
        if "min" not in b:
            i = 0
        elif b["min"] <= 1:
            i = 1 + b["min"]
        else:
            i = 2 + b["min"].bit_length() - 1
        out[i] = out.get(i, 0) + b["count"]
    return out


def latency(run: dict[str, Any], tool: str, size: int) -> dict[str, Any] | None:
    """A tool's figures for one size in one run: min and mean (ns), calls, ns buckets."""
    maps = run.get(tool)
    if not maps:
        return None
    key = comm(size)
    buckets = hist_buckets(maps["@ns"].get(key, []))
    n = sum(buckets.values())
    if not n:
        return None
    return {"min": maps["@min"][key], "mean": maps["@sum"][key] / n, "calls": n,
            "buckets": buckets, "us_buckets": hist_buckets(maps["@us"].get(key, []))}


def median(values: list[Any]) -> float | None:
    """The median of the values that are not None (None when none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def mean_bucket(buckets: dict[int, int]) -> float:
    n = sum(buckets.values())
    return sum(i * c for i, c in buckets.items()) / n if n else float("nan")


def mode_bucket(buckets: dict[int, int]) -> int | None:
    return max(buckets, key=lambda i: (buckets[i], -i)) if buckets else None


def bucket_label(i: int | None) -> str:
    from ksim.trace.output import hist_rows

    if i is None:
        return "-"
    values = [0] * (i + 1)
    values[i] = 1
    return hist_rows(values)[0][0]


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Medians over the rounds of each round's figures (module doc), per size."""
    runs, sizes = data["runs"], data["sizes"]

    def t(run: dict[str, Any], cond: str, size: int) -> int | None:
        """The fastest call of ``size`` in the run, less the fastest failing read
        just before it: the part of a call past ksys_read's descriptor lookup."""
        w = run.get(cond, {}).get("workload", {}).get(str(size))
        return None if w is None else w["min"] - w["badfd"]["min"]

    def lat(run: dict[str, Any], cond: str, tool: str, size: int, stat: str = "min") -> Any:
        f = latency(run.get(cond, {}), tool, size)
        return None if f is None else f[stat]

    def diff(a: Any, b: Any) -> Any:
        return None if a is None or b is None else a - b

    per_size = []
    for s in sizes:
        row: dict[str, Any] = {"size": s}
        # the kernel's own measure: the uninstrumented call less the failing one
        row["kernel_ns"] = median([t(r, "none", s) for r in runs])
        row["syscall_ns"] = median([r["none"]["workload"][str(s)]["badfd"]["min"] for r in runs])
        for tool in TOOLS:
            row[f"{tool}_ns"] = median([lat(r, tool, tool, s) for r in runs])
            row[f"{tool}_mean_ns"] = median([lat(r, tool, tool, s, "mean") for r in runs])
            row[f"{tool}_over_kernel_ns"] = median(
                [diff(lat(r, tool, tool, s), t(r, "none", s)) for r in runs])
            # what the tool's two probes add to a call, as the workload sees it
            row[f"{tool}_cost_ns"] = median([diff(t(r, tool, s), t(r, "none", s)) for r in runs])
            row[f"both_{tool}_ns"] = median([lat(r, "both", tool, s) for r in runs])
            # what running the other tool at once adds to this tool's latency
            row[f"both_{tool}_added_ns"] = median(
                [diff(lat(r, "both", tool, s), lat(r, tool, tool, s)) for r in runs])
            for cond in (tool, "both"):
                for which in ("buckets", "us_buckets"):
                    total: dict[int, int] = {}
                    for r in runs:
                        f = latency(r.get(cond, {}), tool, s)
                        for i, c in (f[which] if f else {}).items():
                            total[i] = total.get(i, 0) + c
                    row[f"both_{tool}_{which}" if cond == "both" else f"{tool}_{which}"] = total
        for cond, label in (("bpftrace", "alone"), ("both", "both")):
            kb = row["ksim_buckets"] if cond == "bpftrace" else row["both_ksim_buckets"]
            bb = row["bpftrace_buckets"] if cond == "bpftrace" else row["both_bpftrace_buckets"]
            row[f"bucket_shift_{label}"] = mean_bucket(bb) - mean_bucket(kb)
            # the same without the buckets' edges: log2 of the fastest calls' ratio
            k = row["ksim_ns"] if cond == "bpftrace" else row["both_ksim_ns"]
            b = row["bpftrace_ns"] if cond == "bpftrace" else row["both_bpftrace_ns"]
            row[f"log2_ratio_{label}"] = math.log2(b / k) if k and b and k > 0 < b else None
        # empty pairs on read_zero, inside the measured interval
        row["ksim_kprobe_by_ksim_ns"] = median(
            [diff(lat(r, "ksim+ksim-kprobe", "ksim", s), lat(r, "ksim", "ksim", s)) for r in runs])
        for pair in TOOLS:
            for tool in TOOLS:
                cond = f"{tool}+{pair}-pair"
                row[f"{pair}_pair_by_{tool}_ns"] = median(
                    [diff(lat(r, cond, tool, s), lat(r, tool, tool, s)) for r in runs])
        per_size.append(row)

    def across(key: str) -> float | None:
        """The median over the small sizes (up to SMALL bytes), where a run's fastest
        call varies by a hundred nanoseconds or so, far less than the figures."""
        return median([row[key] for row in per_size if row["size"] <= SMALL] or
                      [row[key] for row in per_size])

    lo, hi = per_size[0], per_size[-1]
    slopes = {tool: ((hi[f"{tool}_ns"] - lo[f"{tool}_ns"]) / (hi["kernel_ns"] - lo["kernel_ns"])
                     if None not in (hi[f"{tool}_ns"], lo[f"{tool}_ns"]) else None)
              for tool in TOOLS}
    return {
        "per_size": per_size,
        # each per-call figure is about the same at every size: their medians over sizes
        "ksim_over_kernel_ns": across("ksim_over_kernel_ns"),
        "bpftrace_over_kernel_ns": across("bpftrace_over_kernel_ns"),
        "ksim_cost_ns": across("ksim_cost_ns"),
        "bpftrace_cost_ns": across("bpftrace_cost_ns"),
        "both_ksim_added_ns": across("both_ksim_added_ns"),
        "both_bpftrace_added_ns": across("both_bpftrace_added_ns"),
        "pairs": {**{f"{pair}_pair_by_{tool}_ns": across(f"{pair}_pair_by_{tool}_ns")
                     for pair in TOOLS for tool in TOOLS},
                  "ksim_kprobe_by_ksim_ns": across("ksim_kprobe_by_ksim_ns")},
        # latency against the kernel's own measure from the smallest size to the largest
        "slope": slopes,
    }


# --- the benchmark ------------------------------------------------------------------------------
def run(ctx: Context) -> Section:
    if ctx.smoke:
        raise Skip("smoke run: the live testbed is left alone")
    sizes = QUICK_SIZES if ctx.quick else SIZES
    calls = QUICK_CALLS if ctx.quick else CALLS
    rounds = QUICK_ROUNDS if ctx.quick else ROUNDS
    with ctx.bar(rounds * len(CONDITIONS), NAME) as bar:
        data = measure(sizes, calls, rounds, bar=bar)
    data["summary"] = summarize(data)
    params = {"sizes": list(sizes), "calls": calls, "rounds": rounds,
              "conditions": list(CONDITIONS), "program": PROGRAM, "empty_pair": EMPTY_PAIR}
    return Section(data, tables(data), notes(data), params)


def _ns(v: Any) -> Any:
    return None if v is None else round(v)


def tables(data: dict[str, Any]) -> list[Table]:
    s = data["summary"]
    where = f"live testbed ({data.get('kernel')}, {data.get('accel')}), {data.get('bpftrace')}"
    rows = []
    for r in s["per_size"]:
        rows.append([r["size"], _ns(r["kernel_ns"]), _ns(r["ksim_ns"]), _ns(r["ksim_over_kernel_ns"]),
                     _ns(r["bpftrace_ns"]), _ns(r["bpftrace_over_kernel_ns"]),
                     _ns(r["both_ksim_ns"]), _ns(r["both_bpftrace_ns"]),
                     _ns(r["ksim_cost_ns"]), _ns(r["bpftrace_cost_ns"])])
    latencies = Table(
        f"vfs_read of SIZE bytes from /dev/zero, {where}: the kernel's own measure (uninstrumented "
        "call less a failing read) and each tool's latency, ns (fastest of each run's calls, "
        "median over rounds)",
        ["size", "kernel", "ksim", "ksim - kernel", "bpftrace", "bpftrace - kernel",
         "both: ksim", "both: bpftrace", "ksim cost/call", "bpftrace cost/call"], rows)
    rows = []
    for r in s["per_size"]:
        rows.append([r["size"], bucket_label(mode_bucket(r["ksim_buckets"])),
                     bucket_label(mode_bucket(r["bpftrace_buckets"])), _r3(r["bucket_shift_alone"]),
                     _r3(r["log2_ratio_alone"]), bucket_label(mode_bucket(r["both_ksim_buckets"])),
                     bucket_label(mode_bucket(r["both_bpftrace_buckets"])), _r3(r["bucket_shift_both"]),
                     _r3(r["log2_ratio_both"])])
    buckets = Table(
        "hist(nsecs - @start[tid]): the bucket holding most calls; how many buckets higher "
        "bpftrace's mass lies than ksim's (mean bucket index, all rounds); log2 of bpftrace's "
        "fastest call over ksim's",
        ["size", "ksim alone", "bpftrace alone", "shift alone", "log2 ratio alone", "both: ksim",
         "both: bpftrace", "shift both", "log2 ratio both"], rows)
    p = s["pairs"]
    inside = Table(
        f"What instrumentation inside the interval adds to it, ns (median over rounds and the sizes "
        f"up to {SMALL} bytes)",
        ["inside vfs_read", "measured by ksim", "measured by bpftrace"],
        [["ksim's empty kprobe+kretprobe on read_zero", _ns(p["ksim_pair_by_ksim_ns"]),
          _ns(p["ksim_pair_by_bpftrace_ns"])],
         ["ksim's empty kprobe on read_zero (its entry jmp alone)", _ns(p["ksim_kprobe_by_ksim_ns"]),
          None],
         ["bpftrace's empty kprobe+kretprobe on read_zero", _ns(p["bpftrace_pair_by_ksim_ns"]),
          _ns(p["bpftrace_pair_by_bpftrace_ns"])],
         ["the other tool's latency probes on vfs_read (both at once)",
          _ns(s["both_ksim_added_ns"]), _ns(s["both_bpftrace_added_ns"])],
         ["the tool's own latency probes (its latency less the kernel's measure)",
          _ns(s["ksim_over_kernel_ns"]), _ns(s["bpftrace_over_kernel_ns"])],
         ["a call's whole cost of the tool's latency probes (the workload's view)",
          _ns(s["ksim_cost_ns"]), _ns(s["bpftrace_cost_ns"])],
         ["latency / kernel's measure, smallest to largest size (slope)",
          _r3(s["slope"]["ksim"]), _r3(s["slope"]["bpftrace"])]])
    return [latencies, buckets, inside]


def _r3(v: Any) -> Any:
    return None if v is None else round(v, 3)


def notes(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    small = s["per_size"][0]
    out = [
        f"{data['rounds']} round(s) of {len(CONDITIONS)} conditions, {data['calls']} calls per size; "
        "latency figures are each run's fastest call (the least disturbed: the testbed is "
        "shared and TCG's speed follows the host's load), medians over rounds",
        "both tools read the same clock: bpf_ktime_get_ns is a tail jump to "
        "ktime_get_mono_fast_ns, which ksim's nsecs calls; their hist() buckets are the same "
        "(2 + floor(log2 v) for v > 0, checked value by value in tests/test_trace_latency.py)",
    ]
    points: list[dict[str, str]] = next(
        (run[c]["ksim_points"] for run in data["runs"] for c in ("ksim", "both")
         if run.get(c, {}).get("ksim_points")), [])
    if points:
        out.append("ksim's probes: " + ", ".join(f"{p['probe']} at {p['at']} ({p['tactic']})"
                                                 for p in points)
                   + "; bpftrace's kprobe is the function's ftrace call at +0x0 and its "
                     "kretprobe the return trampoline the ret goes to: ksim's lie inside "
                     "bpftrace's interval")
    if None not in (small["ksim_ns"], small["bpftrace_ns"], small["both_bpftrace_ns"]):
        out.append(
            f"at {small['size']} byte(s) vfs_read takes {_ns(small['kernel_ns'])} ns by the kernel's own "
            f"measure; ksim reports {_ns(small['ksim_ns'])}, bpftrace alone {_ns(small['bpftrace_ns'])} "
            f"and {_ns(small['both_bpftrace_ns'])} with ksim's probes in as well (their "
            f"{_ns(s['both_bpftrace_added_ns'])} ns lie inside bpftrace's interval, while "
            f"bpftrace's add {_ns(s['both_ksim_added_ns'])} to ksim's)")
        modes = [bucket_label(mode_bucket(small[k])) for k in
                 ("ksim_us_buckets", "bpftrace_us_buckets", "both_ksim_us_buckets",
                  "both_bpftrace_us_buckets")]
        out.append(f"hist($d / 1000) of the {small['size']}-byte reads, the bucket holding most "
                   f"calls: ksim {modes[0]}, bpftrace {modes[1]} alone; both at once ksim "
                   f"{modes[2]}, bpftrace {modes[3]}")
    return out


def plot(entry: dict[str, Any], path: str) -> None:
    from ksim.bench.common import pyplot, save

    plt = pyplot()
    s = entry["results"]["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    rows = s["per_size"]
    xs = [r["size"] for r in rows]
    for key, label, style in (("kernel_ns", "kernel's own measure", "k--"),
                              ("ksim_ns", "ksim", "o-"), ("bpftrace_ns", "bpftrace", "s-"),
                              ("both_ksim_ns", "ksim, both at once", "o:"),
                              ("both_bpftrace_ns", "bpftrace, both at once", "s:")):
        axes[0].plot(xs, [r[key] for r in rows], style, label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log", base=2)
    axes[0].set_xlabel("read size, bytes")
    axes[0].set_ylabel("vfs_read, ns (fastest call)")
    axes[0].legend(fontsize=7)
    small = rows[0]
    keys = ("ksim_buckets", "bpftrace_buckets", "both_ksim_buckets", "both_bpftrace_buckets")
    total = max(sum(small[k].values()) for k in keys) or 1
    idx = sorted({int(i) for k in keys for i, c in small[k].items() if c >= total / 200})
    width = 0.2
    for j, (k, label) in enumerate(zip(keys, ("ksim", "bpftrace", "ksim, both", "bpftrace, both"),
                                       strict=True)):
        axes[1].bar([x + (j - 1.5) * width for x in range(len(idx))],
                    [small[k].get(str(i), small[k].get(i, 0)) for i in idx], width, label=label)
    axes[1].set_xticks(list(range(len(idx))), [bucket_label(i) for i in idx], fontsize=8)
    axes[1].set_ylabel("calls (all rounds)")
    axes[1].set_title(f"hist(nsecs - @start[tid]) of {small['size']}-byte reads "
                      "(buckets holding 0.5% or more)", fontsize=9)
    axes[1].legend(fontsize=7)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    from ksim.bench import runner

    ap = argparse.ArgumentParser(prog="python -m ksim.bench.latency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes, calls and rounds")
    ap.add_argument("--output", "-o", help="write the JSON document (ksim-bench/1) here")
    ap.add_argument("--plot", help="draw the figures into this PNG file")
    args = ap.parse_args(argv)
    ctx = Context(mode="quick" if args.quick else "full")
    doc: dict[str, Any] = {"schema": SCHEMA, "machine": machine_info(), "started": now_iso(),
                           "mode": ctx.mode, "benchmarks": {}}
    import time

    t0 = time.perf_counter()
    try:
        section = run(ctx)
        entry: dict[str, Any] = {"status": "ok", "title": TITLE, "seconds": time.perf_counter() - t0,
                                 "params": section.params, "results": section.results,
                                 "tables": [t.as_dict() for t in section.tables],
                                 "notes": section.notes}
    except Skip as exc:
        entry = {"status": "skipped", "reason": str(exc), "seconds": time.perf_counter() - t0}
    doc["benchmarks"][NAME] = runner.jsonable(entry) if hasattr(runner, "jsonable") else entry
    doc["finished"] = now_iso()
    runner.print_entry(NAME, doc["benchmarks"][NAME], sys.stdout)
    if args.plot and entry["status"] == "ok":
        plot(doc["benchmarks"][NAME], args.plot)
        doc["benchmarks"][NAME]["plot"] = os.path.basename(args.plot)
    if args.output:
        runner.write_json(doc, args.output)
    return 0 if entry["status"] != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
