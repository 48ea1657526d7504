"""cli: the commands users type, end to end, on the live testbed: ``ksim trace``
beside Debian's bpftrace running the same program in the same guest, in one run.

The program is ``kprobe:PATTERN { @[func] = count(); }`` for

* ``single`` -- ``kprobe:__x64_sys_getppid``, one function: the fixed costs;
* ``~100`` and ``~1,000`` -- a glob prefix chosen at run time from the kernel's
  function names: the one whose matches, among kallsyms' function names (what
  ksim's wildcard matches) and among ftrace's ``available_filter_functions`` (what
  bpftrace 0.17's kprobe wildcard matches), are both closest to the size (the
  larger of the two log ratios is the smallest; then the shorter prefix);
* ``t*`` -- about 3,400 functions;
* ``*`` -- every entry.

**ksim** runs as the user runs it, in a subprocess: ``ksim trace -e PROGRAM
--target ADDRESS --while true --json``.  ``end_to_end_s`` is that process's wall
time from its start to its exit (parsing, reading the kernel's symbols and
analyses, attaching, the ``--while`` command, printing the maps, detaching);
``attach_s`` and ``detach_s`` are what the command's last JSON record
(``{"type": "stats", ...}``) says, measured inside it; ``n`` is its ``probes``.
The map it printed is checked: every key a function the pattern matches, counted
at least once, at most one key per probe, no update lost and no error record.  The
command runs twice (``ksim trace``, then ``ksim trace, again``): the first is the
first command on the kernel's analysis store made just before (it holds every
function's entry live registers and where its code ends, as they were then: a
command learns and keeps only what changed since); the second is what a user gets
from then on.

**bpftrace** runs the same program in the guest through the driver every
benchmark shares (:mod:`ksim.bench.bpftrace`: ``READY_PROBE`` listed last, the
time from "Attaching N probes..." to its first output, SIGINT, the time to its
exit).  ``BPFTRACE_MAX_PROBES`` and ``BPFTRACE_MAP_KEYS_MAX`` are raised to the
pattern's matches (bpftrace refuses more than 512 probes unless told, and its maps
hold 4,096 keys), by a two-line wrapper that execs bpftrace with them set.
``end_to_end_s`` is the driver's start-up, attach, workload and detach phases: from
bpftrace's start to its exit.  While the probes are in, the workload counts the
functions the kernel's ftrace has a handler on (``/sys/kernel/tracing/
enabled_functions``: bpftrace's kprobes at +0 are ftrace-based), less those counted
just before bpftrace started: that is bpftrace's ``n`` (by address, so an alias such
as ``__x64_sys_getppid``, which ftrace lists as ``__do_sys_getppid``, counts too).
``bpftrace -l kprobe:PATTERN`` (untimed) says how many probes it expands the
pattern to: the limits above, and ``n`` of a run not made.

A bpftrace run that does not finish within ``LIMIT_S`` is stopped and recorded as
``timeout``; a pattern whose run, projected from the seconds per probe of the
previous pattern, would take longer is recorded as ``over-limit`` with
``projected_s`` and not run (its ``n`` is then what ``bpftrace -l`` lists).  A
ksim run over the limit is stopped with SIGINT (which removes its probes) and
recorded as ``timeout``.  Without bpftrace its rows are ``{"skipped": reason}``
and ksim's stay.

Beside the rows: ksim's attach per probe from the command line against the
``insert_many`` figure of ``ksim bench batch`` in benchmarks/results/results.json
when that file has one (batch is not run again), and at N ~ 1,000 the ratio of
bpftrace's end-to-end time to ksim's (the goal is 10 times or more).
"""

from __future__ import annotations

import collections
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ksim.bench import bpftrace
from ksim.bench.common import Context, Section, Skip, Table, pyplot, save

NAME = "cli"
TITLE = "The commands users type, end to end: ksim trace against bpftrace"
#: "ksim trace, again": the same command once more, right after the first (which
#: found its functions' entries in the analysis store as it was made: the second
#: differs by what the first learnt and kept there, nothing on an unchanged kernel)
TOOLS = ("ksim trace", "ksim trace, again", "bpftrace")
LIMIT_S = 600.0
#: what ksim's --while runs in the guest (the program's probes are in meanwhile)
WHILE = "true"
SINGLE = "__x64_sys_getppid"
#: the cases of a full run, in the order they run; a size is chosen as a glob prefix
CASES: tuple[tuple[str, Any], ...] = (("single", SINGLE), ("~100", 100), ("~1,000", 1000),
                                      ("t*", "t*"), ("*", "*"))
QUICK_CASES = ("single", "~100")
#: the longest prefix tried when choosing a pattern for a size
PREFIX_MAX = 8
ENABLED = "/sys/kernel/tracing/enabled_functions"
#: the guest side of the ftrace names: what bpftrace's kprobe wildcard matches
#: (module functions are listed as "name [module]"), compressed (the list is larger
#: than an exec reply carries)
FTRACE_NAMES = r"""
import base64, zlib
listed = open("/sys/kernel/tracing/available_filter_functions")
names = sorted({l.split()[0] for l in listed if l.strip()})
print(len(names), base64.b64encode(zlib.compress("\n".join(names).encode(), 9)).decode())
"""
#: the results of the other benchmarks, for batch's insert_many figures
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "results.json"


def program(pattern: str) -> str:
    return f"kprobe:{pattern} {{ @[func] = count(); }}"


# --- choosing the patterns --------------------------------------------------------------
def prefix_counts(names: set[str]) -> collections.Counter[str]:
    """How many of ``names`` each prefix of at most PREFIX_MAX word characters starts."""
    counts: collections.Counter[str] = collections.Counter()
    for name in names:
        for k in range(1, min(len(name), PREFIX_MAX) + 1):
            if not (name[k - 1].isalnum() or name[k - 1] == "_"):
                break
            counts[name[:k]] += 1
    return counts


def choose_pattern(size: int, kallsyms: collections.Counter[str],
                   ftrace: collections.Counter[str]) -> str:
    """The glob ``PREFIX*`` whose matches among both lists are both closest to
    ``size`` (the larger log ratio smallest; then the shorter, then the first prefix)."""
    def score(prefix: str) -> tuple[float, int, str]:
        worst = max(abs(math.log(max(c, 1) / size)) for c in (kallsyms[prefix], ftrace[prefix]))
        return (round(worst, 9), len(prefix), prefix)

    return min(kallsyms, key=score) + "*"


def _ftrace_names(t: Any, work: Path) -> set[str]:
    import base64
    import zlib

    from ksim.live.testbed import guest_file, host_python

    script = guest_file(work, "ftrace_names.py", FTRACE_NAMES)
    out = t.exec_checked(f"{host_python()} {script}", timeout=600).split()
    return set(zlib.decompress(base64.b64decode(out[1])).decode().split("\n"))


# --- ksim trace --------------------------------------------------------------------------
def ksim_command() -> list[str]:
    """The ``ksim`` the user runs: the script beside this interpreter, else on PATH,
    else this interpreter's ``-m ksim``."""
    beside = Path(sys.executable).parent / "ksim"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("ksim")
    return [found] if found else [sys.executable, "-m", "ksim"]


def run_ksim(address: str, pattern: str, limit: float = LIMIT_S) -> dict[str, Any]:
    """``ksim trace -e PROGRAM --target ADDRESS --while true --json`` in a subprocess,
    timed from its start to its exit, with its stats record and its map checked."""
    args = ["trace", "-e", program(pattern), "--target", address, "--while", WHILE, "--json"]
    cmd = ksim_command() + args
    row: dict[str, Any] = {"command": shlex.join(["ksim", *args])}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # Ctrl-C: the command prints its maps and removes its probes
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        row.update(status="timeout", limit=limit, end_to_end_s=time.perf_counter() - t0,
                   exit_status=proc.returncode, stderr=err[-2000:])
        return row
    row["end_to_end_s"] = time.perf_counter() - t0
    row["exit_status"] = proc.returncode
    records = []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    by_type: dict[str, dict[str, Any]] = {}
    for r in records:
        by_type.setdefault(str(r.get("type")), r)
    stats, summary = by_type.get("stats"), by_type.get("summary")
    problems = []
    if "error" in by_type:
        problems.append(f"{by_type['error'].get('error')}: {by_type['error'].get('message')}")
    if proc.returncode != 0:
        problems.append(f"exit status {proc.returncode}")
    if stats is None or summary is None:
        problems.append("no stats or summary record")
    if stats is not None:
        row.update(n=stats["probes"], attach_s=stats["attach_s"], detach_s=stats["detach_s"],
                   inner_end_to_end_s=stats["end_to_end_s"])
    if summary is not None:
        data = summary["data"]
        final = data["maps"].get("@", {})
        printed = by_type.get("map", {}).get("data", {}).get("@", {})
        row.update(keys=len(printed), hits=sum(printed.values()), tactics=data.get("tactics"),
                   not_spliced=len(data.get("skipped", {})), lost=data.get("lost"),
                   lost_keys=data.get("lost_keys"), summary_keys=len(final),
                   summary_hits=sum(final.values()))
        problems += check_map(pattern, printed, final, data, row.get("n"))
    if problems:
        row.update(status="error", error="; ".join(problems), stderr=err[-2000:])
    else:
        row["status"] = "ok"
    return row


def check_map(pattern: str, printed: dict[str, int], final: dict[str, int],
              data: dict[str, Any], n: int | None) -> list[str]:
    """What is wrong with the ``@[func] = count()`` map the command printed: one key
    per probe that fired (a function the pattern matches, counted at least once; no
    more keys than probes), nothing lost, and nothing in it that the summary's map,
    read after the probes are removed, does not hold at least as much of."""
    problems = []
    strange = [k for k in printed if not fnmatch.fnmatchcase(k, pattern)]
    if strange:
        problems.append(f"map keys the pattern does not match: {strange[:5]}")
    if any(not isinstance(v, int) or v < 1 for v in printed.values()):
        problems.append("a map value that is not a positive count")
    if n is not None and len(final) > n:
        problems.append(f"{len(final)} keys for {n} probes")
    if data.get("lost") or data.get("lost_keys"):
        problems.append(f"lost updates: {data.get('lost')} {data.get('lost_keys')}")
    behind = [k for k, v in printed.items() if final.get(k, 0) < v]
    if behind:
        problems.append(f"the summary's map has less than the printed map for {behind[:5]}")
    return problems


# --- bpftrace ----------------------------------------------------------------------------
def _wrapper(work: Path, exe: str, matches: int) -> Path:
    """bpftrace with its probe and map-key limits raised to ``matches`` (the same for
    both: a program of ``@[func]`` gets a key per function)."""
    from ksim.live.testbed import guest_file

    limit = max(512, matches + 16)
    keys = max(4096, matches + 16)
    path = guest_file(work, "bpftrace.sh", f"#!/bin/sh\nBPFTRACE_MAX_PROBES={limit} "
                      f"BPFTRACE_MAP_KEYS_MAX={keys} exec {exe} \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def listed(t: Any, exe: str, pattern: str) -> int | None:
    """How many probes bpftrace expands ``kprobe:PATTERN`` to (``bpftrace -l``)."""
    out = t.exec(f"{shlex.quote(exe)} -l {shlex.quote('kprobe:' + pattern)} | wc -l", timeout=600)
    return int(out.strip()) if out.strip().isdigit() else None


def run_bpftrace(t: Any, work: Path, exe: str, pattern: str, matches: int,
                 limit: float = LIMIT_S) -> dict[str, Any]:
    """The same program under bpftrace in the guest (module doc)."""
    count = f"wc -l < {ENABLED}"
    before = t.exec(count, timeout=120).strip()
    text = program(pattern) + "\n" + bpftrace.READY_PROBE
    name = "cli-" + re.sub(r"[^A-Za-z0-9_]", "_", pattern) + ".bt"
    wrapper = _wrapper(work, exe, matches)
    report = bpftrace.run(t, text, count, limit, work, name, bpftrace=str(wrapper))
    row: dict[str, Any] = {"status": report.get("status", "error"), "driver": report}
    phases = [float(report.get(k) or 0.0)
              for k in ("startup_s", "attach_s", "workload_s", "detach_s")]
    if row["status"] == "ok":
        try:
            row["n"] = int(report["workload_output"].strip().splitlines()[-1]) - int(before)
        except (ValueError, IndexError, KeyError):
            row["n"] = None
            row["note"] = f"no count of enabled functions: {report.get('workload_output')!r}"
        row.update(end_to_end_s=sum(phases), startup_s=report["startup_s"],
                   attach_s=report["attach_s"], detach_s=report["detach_s"],
                   workload_s=report["workload_s"])
    elif row["status"] == "timeout":
        row.update(limit=limit, phase=report.get("phase"), end_to_end_s=report.get("exit_s"))
    else:
        output = str(report.get("output") or "")[-1000:].strip()
        row["error"] = output or "bpftrace failed with no output"
    row["enabled_before"] = int(before) if before.isdigit() else before
    return row


# --- the run -----------------------------------------------------------------------------
def _batch_reference(path: Path = RESULTS) -> dict[str, Any] | None:
    """ksim bench batch's live insert_many rows (tool, n, ms per probe) from the
    results document, when it has them."""
    try:
        doc = json.loads(path.read_text())
        entry = doc["benchmarks"]["batch"]
        rows = entry["results"]["live"]["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    keep = [{"tool": r["tool"], "n": r["n"], "attach_s": r["attach_s"],
             "attach_ms_per_probe": r["attach_ms_per_probe"]}
            for r in rows if r.get("status") == "ok" and str(r.get("tool", "")).startswith("ksim-")
            and r.get("attach_ms_per_probe") is not None]
    return {"file": str(path.name), "started": doc.get("started"), "rows": keep} if keep else None


def nearest(rows: list[dict[str, Any]], tool: str, n: int | None) -> dict[str, Any] | None:
    """The row of ``tool`` whose N is nearest ``n`` (by ratio)."""
    mine = [r for r in rows if r["tool"] == tool and r["n"]]
    if not mine or not n:
        return None
    return min(mine, key=lambda r: abs(math.log(r["n"] / n)))


def _live(ctx: Context, bar: Any) -> dict[str, Any]:
    from ksim.live import client, testbed

    state = testbed.status()
    if not state.get("up"):
        raise Skip("the Linux testbed is not up (start it with `ksim testbed up`)")
    address = str(state["address"])
    cases = [c for c in CASES if not ctx.quick or c[0] in QUICK_CASES]
    try:
        exe: str | None = bpftrace.binary()
        why_not = None
    except Skip as exc:
        exe, why_not = None, str(exc)
    work = testbed.cache_dir() / "bench-cli"
    work.mkdir(exist_ok=True)
    t = client.open(address.split("://", 1)[1], token_file=state.get("token_file"))
    try:
        kallsyms_names = {f.name for f in t.image.functions}
        ftrace_names = _ftrace_names(t, work)
        bar.advance(0, note="choosing patterns")
        kp, fp = prefix_counts(kallsyms_names), prefix_counts(ftrace_names)
        patterns: dict[str, dict[str, Any]] = {}
        for case, what in cases:
            pattern = choose_pattern(what, kp, fp) if isinstance(what, int) else what
            patterns[case] = {
                "pattern": pattern, "program": program(pattern), "size": what,
                "kallsyms_matches": sum(fnmatch.fnmatchcase(x, pattern) for x in kallsyms_names),
                "ftrace_matches": sum(fnmatch.fnmatchcase(x, pattern) for x in ftrace_names)}
        version = None
        if exe is not None:
            version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                     timeout=60).stdout.strip() or None
            for p in patterns.values():  # bpftrace's own expansion, untimed
                p["bpftrace_listed"] = listed(t, exe, p["pattern"])
        # the analysis store of this kernel: the first command after a boot (a batch of
        # BATCH_BUILD_FUNCTIONS or more) builds it, every later one loads it; the rows
        # are what a user gets once it is there, its building is timed apart
        bar.advance(0, note="analysing the running kernel (its analysis store)")
        from ksim.analysis.store import store_for

        started = time.perf_counter()
        built = store_for(t.image, build_missing=True) is not None
        store_s = time.perf_counter() - started if built else None
        rows: list[dict[str, Any]] = []
        rate = None   # bpftrace's seconds per probe, end to end, at the previous pattern
        for case, _what in cases:
            p = patterns[case]
            pattern = p["pattern"]
            # what bpftrace attaches: its own expansion, else ftrace's names
            expect = p.get("bpftrace_listed") or p["ftrace_matches"]
            base = {"case": case, "pattern": pattern}
            for tool in TOOLS:
                bar.advance(0, note=f"{tool} {program(pattern)}")
                row: dict[str, Any] = {"tool": tool, **base}
                if tool.startswith("ksim trace"):
                    row.update(run_ksim(address, pattern))
                elif exe is None:
                    row.update(n=expect, skipped=why_not)
                elif rate is not None and rate * expect > LIMIT_S:
                    projected = rate * expect
                    row.update(status="over-limit", n=expect, projected_s=projected,
                               note=f"not run: at the seconds per probe of the previous pattern "
                               f"({1e3 * rate:.1f} ms), {expect:,} probes take {projected:.0f} s "
                               f"> {LIMIT_S:g} s; n is what bpftrace -l lists for the pattern")
                else:
                    row.update(run_bpftrace(t, work, exe, pattern, expect))
                    if row["status"] == "ok" and case != "single" and row.get("n"):
                        rate = row["end_to_end_s"] / row["n"]
                    elif row["status"] == "timeout":
                        rate = math.inf   # the larger patterns are over the limit too
                if row.get("status") == "ok" and row.get("n"):
                    row["attach_ms_per_probe"] = 1e3 * row["attach_s"] / row["n"]
                    row["detach_ms_per_probe"] = 1e3 * row["detach_s"] / row["n"]
                rows.append(row)
                bar.advance(note=f"{tool} {pattern}: {row.get('status', 'skipped')}")
    finally:
        t.close()
    return {"rows": rows, "patterns": patterns, "address": address, "while": WHILE,
            "limit_s": LIMIT_S, "kernel": state.get("kernel"), "accel": state.get("accel"),
            "bpftrace": version, "batch": _batch_reference(), "store_s": store_s}


def summarize(live: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: each tool's n and times, bpftrace / ksim end to end, and ksim's attach
    per probe against batch's insert_many at the nearest N."""
    out = []
    batch = (live.get("batch") or {}).get("rows", [])

    def beyond_single(row: dict[str, Any]) -> float | None:
        # what each probe costs beyond a one-function command's attach (its fixed
        # part: the decoder's import, the store, the kernel's first answers), by the
        # same tool in the same run
        single: dict[str, Any] = next((r for r in live["rows"] if r["case"] == "single"
                                       and r["tool"] == row.get("tool")), {})
        if row.get("status") != "ok" or single.get("status") != "ok" or row["n"] < 2:
            return None
        return 1e3 * (row["attach_s"] - single["attach_s"]) / (row["n"] - single["n"])

    for case, p in live["patterns"].items():
        k: dict[str, Any] = next((r for r in live["rows"]
                                  if r["case"] == case and r["tool"] == "ksim trace"), {})
        b: dict[str, Any] = next((r for r in live["rows"]
                                  if r["case"] == case and r["tool"] == "bpftrace"), {})
        again: dict[str, Any] = next((r for r in live["rows"] if r["case"] == case
                                      and r["tool"] == "ksim trace, again"), {})
        ok = k.get("status") == "ok" and b.get("status") == "ok"
        ref = nearest(batch, "ksim-jmp", k.get("n")) if k.get("status") == "ok" else None
        out.append({
            "case": case, "pattern": p["pattern"], "ksim_n": k.get("n"), "bpftrace_n": b.get("n"),
            "ksim_end_to_end_s": k.get("end_to_end_s") if k.get("status") == "ok" else None,
            "bpftrace_end_to_end_s": b.get("end_to_end_s") if b.get("status") == "ok" else None,
            "bpftrace_status": b.get("status", "skipped" if "skipped" in b else None),
            "bpftrace_projected_s": b.get("projected_s"),
            "ratio_end_to_end": b["end_to_end_s"] / k["end_to_end_s"] if ok else None,
            # the same per probe attached: the tools' patterns match different numbers
            "ratio_per_probe": ((b["end_to_end_s"] / b["n"]) / (k["end_to_end_s"] / k["n"])
                                if ok and b.get("n") and k.get("n") else None),
            "ksim_attach_ms_per_probe": k.get("attach_ms_per_probe"),
            "ksim_again_attach_ms_per_probe": again.get("attach_ms_per_probe"),
            "ksim_beyond_single_ms_per_probe": beyond_single(k),
            "ksim_again_beyond_single_ms_per_probe": beyond_single(again),
            "bpftrace_attach_ms_per_probe": b.get("attach_ms_per_probe"),
            "batch_insert_many_ms_per_probe": ref and ref["attach_ms_per_probe"],
            "batch_n": ref and ref["n"],
        })
    return out


def run(ctx: Context) -> Section:
    if ctx.smoke:
        raise Skip("smoke run: the live testbed is left alone")
    try:
        from ksim.live import testbed  # noqa: F401 - only whether it is there
    except ImportError as exc:
        raise Skip(f"the live testbed is not part of this installation ({exc})") from exc
    cases = len(QUICK_CASES) if ctx.quick else len(CASES)
    with ctx.bar(cases * len(TOOLS), "cli") as bar:
        live = _live(ctx, bar)
    live["summary"] = summarize(live)
    tables = [_rows_table(live), _summary_table(live)]
    return Section(live, tables, _notes(live), {"limit_s": LIMIT_S, "while": WHILE,
                                                "cases": [c for c, _ in CASES if not ctx.quick
                                                          or c in QUICK_CASES]})


def _or_dash(v: Any) -> Any:
    return "-" if v is None else f"{v:,}"


def _r(v: Any, digits: int = 2) -> Any:
    return round(v, digits) if isinstance(v, float) else v


def _rows_table(live: dict[str, Any]) -> Table:
    rows = []
    for r in live["rows"]:
        status = r.get("status") or ("skipped" if "skipped" in r else "-")
        rows.append([r["case"], r["pattern"], r["tool"], r.get("n"), status,
                     _r(r.get("end_to_end_s")), _r(r.get("attach_s")), _r(r.get("detach_s")),
                     _r(r.get("attach_ms_per_probe"), 3), r.get("keys", "-")])
    return Table(f"Live testbed ({live.get('kernel')}, {live.get('accel')}): "
                 "kprobe:PATTERN { @[func] = count(); } from the command line, --while true",
                 ["case", "pattern", "tool", "n", "status", "end-to-end s", "attach s", "detach s",
                  "ms/probe attach", "map keys"], rows)


def _summary_table(live: dict[str, Any]) -> Table:
    rows = []
    for s in live["summary"]:
        bpf = s["bpftrace_end_to_end_s"]
        if bpf is None and s["bpftrace_projected_s"] is not None:
            bpf = f">{LIMIT_S:g} (projected {s['bpftrace_projected_s']:,.0f})"
        elif bpf is None:
            bpf = s["bpftrace_status"]
        batch = (f"{s['batch_insert_many_ms_per_probe']:.3f} (N={s['batch_n']:,})"
                 if s["batch_insert_many_ms_per_probe"] is not None else "-")
        rows.append([s["case"], s["pattern"], s["ksim_n"], s["bpftrace_n"],
                     _r(s["ksim_end_to_end_s"]), _r(bpf) if not isinstance(bpf, str) else bpf,
                     _r(s["ratio_end_to_end"], 1), _r(s["ratio_per_probe"], 1),
                     _r(s["ksim_attach_ms_per_probe"], 3),
                     _r(s.get("ksim_again_attach_ms_per_probe"), 3),
                     _pair(s.get("ksim_beyond_single_ms_per_probe"),
                           s.get("ksim_again_beyond_single_ms_per_probe")),
                     _r(s["bpftrace_attach_ms_per_probe"], 3), batch])
    return Table("End to end, ksim trace against bpftrace; ksim's attach per probe against "
                 "insert_many in ksim bench batch",
                 ["case", "pattern", "ksim n", "bpftrace n", "ksim s", "bpftrace s",
                  "bpftrace / ksim", "per probe", "ksim ms/probe attach",
                  "again", "ksim ms/probe beyond one function (first / again)",
                  "bpftrace ms/probe attach", "batch insert_many ms/probe (ksim-jmp)"], rows)


def _pair(first: float | None, again: float | None) -> str:
    if first is None and again is None:
        return "-"
    return " / ".join("-" if x is None else f"{x:.3f}" for x in (first, again))


def _notes(live: dict[str, Any]) -> list[str]:
    pats = live["patterns"]
    notes = ["patterns: " + "; ".join(
        f"{case}: {p['pattern']} ({p['kallsyms_matches']:,} kallsyms function names, "
        f"{p['ftrace_matches']:,} ftrace names, {_or_dash(p.get('bpftrace_listed'))} listed by "
        "bpftrace -l)" for case, p in pats.items())]
    command = f"ksim trace -e PROGRAM --target {live['address']} --while {live['while']} --json"
    notes.append(f"ksim trace: `{command}` "
                 "in a subprocess: end-to-end = its wall time from start to exit; attach and "
                 "detach = its stats record (resolving the pattern, analysis, maps, "
                 "compiling, one batch / removing the batch); n = its probes; its map checked "
                 "(one key per probe that fired, nothing lost); 'again': the same command "
                 "once more, right after (the first runs on the analysis store as it was made, "
                 "with every entry's live registers and code end; a command learns and keeps "
                 "only what changed since)")
    notes.append(f"bpftrace ({live.get('bpftrace') or 'not run'}): the same program in the "
                 "guest with the shared driver; end-to-end = start-up + attach + workload + "
                 "detach (bpftrace's start to its exit); attach = 'Attaching N probes...' to "
                 "its first output; detach = SIGINT to its exit; n = the functions the kernel's "
                 "enabled_functions lists while its probes are in, less those before (its "
                 "kprobes at +0 are ftrace-based; the workload counts them, in place of "
                 f"`{live['while']}`); limit {live['limit_s']:g} s per run")
    if live.get("store_s") is not None:
        notes.append(f"before the rows, the running kernel's analysis store was built (or "
                     f"loaded) in {live['store_s']:.1f} s: the first command after a boot that "
                     "attaches 1,000 functions or more builds it, every later one loads it")
    for s in live["summary"]:
        if s["case"] == "~1,000" and s["ratio_end_to_end"] is not None:
            verdict = "met" if s["ratio_end_to_end"] >= 10 else "not met"
            notes.append(f"at N ~ 1,000 ({s['pattern']}): bpftrace end to end / ksim end to "
                         f"end = {s['ratio_end_to_end']:.1f} x (goal >= 10 x: {verdict}); "
                         f"{s['ratio_per_probe']:.1f} x per probe attached ({s['bpftrace_n']:,} "
                         f"against {s['ksim_n']:,})")
    batch = live.get("batch")
    if batch:
        def again(s: dict[str, Any]) -> str:
            ms = s.get("ksim_again_attach_ms_per_probe")
            return f" ({ms:.3f} ms again)" if ms is not None else ""

        pairs = [f"{s['case']} {s['ksim_attach_ms_per_probe']:.3f} ms{again(s)} against "
                 f"{s['batch_insert_many_ms_per_probe']:.3f} ms at N = {s['batch_n']:,}"
                 for s in live["summary"] if s["ksim_attach_ms_per_probe"] is not None
                 and s["batch_insert_many_ms_per_probe"] is not None]
        notes.append(f"ksim's attach per probe from the command line against insert_many "
                     f"(ksim-jmp, analysed beforehand) in ksim bench batch ({batch['file']} of "
                     f"{batch['started']}): " + "; ".join(pairs))
        notes.append("beyond one function: (a case's attach - the single case's attach, by the "
                     "same tool) / (its probes - 1): what each probe adds to the command's fixed "
                     "part (the decoder's import, the analysis store, the kernel's first answers)")
    else:
        notes.append("ksim bench batch has no live insert_many figures in "
                     "benchmarks/results/results.json: no comparison")
    notes.append("emulated TCG guest on a shared machine: wall times of an emulated kernel, "
                 "never hardware figures")
    return notes


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    live = section["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    summary = live.get("summary", [])
    xs = range(len(summary))
    labels = [f"{s['case']}\n{s['pattern']}" for s in summary]
    width = 0.38
    ksim = [s["ksim_end_to_end_s"] or 0 for s in summary]
    bpf = [s["bpftrace_end_to_end_s"] or 0 for s in summary]
    proj = [s["bpftrace_projected_s"] or 0 for s in summary]
    axes[0].bar([x - width / 2 for x in xs], ksim, width, label="ksim trace")
    axes[0].bar([x + width / 2 for x in xs], bpf, width, label="bpftrace")
    if any(proj):
        axes[0].bar([x + width / 2 for x in xs], proj, width, fill=False, hatch="//",
                    label="bpftrace, projected (not run)")
    axes[0].axhline(LIMIT_S, color="grey", linestyle=":", linewidth=1)
    axes[0].set_xticks(list(xs), labels, fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("seconds, process start to exit")
    axes[0].set_title("end to end (lower is better)", fontsize=9)
    axes[0].legend(fontsize=7)
    for tool, key in (("ksim trace", "ksim"), ("bpftrace", "bpftrace")):
        pts = sorted((s[f"{key}_n"], s[f"{key}_attach_ms_per_probe"]) for s in summary
                     if s[f"{key}_n"] and s[f"{key}_attach_ms_per_probe"] is not None)
        if pts:
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=tool)
    batch = [r for r in (live.get("batch") or {}).get("rows", []) if r["tool"] == "ksim-jmp"]
    if batch:
        batch.sort(key=lambda r: r["n"])
        axes[1].plot([r["n"] for r in batch], [r["attach_ms_per_probe"] for r in batch], "x--",
                     label="insert_many (bench batch, ksim-jmp)")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("probes attached (count)")
    axes[1].set_ylabel("milliseconds per probe")
    axes[1].set_title("attach per probe (lower is better)", fontsize=9)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=7)
    save(fig, path)
