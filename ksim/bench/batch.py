"""batch: attach and detach entry probes on N functions at once.

**Live testbed** (the Debian 6.1 kernel under QEMU), side by side on the same
functions and the same workload:

* ``ksim-jmp`` and ``ksim-trap`` -- ``Manager.insert_many`` / ``remove_many`` with
  the jmp and the trap policy, an 8-byte counter per function: each call is one
  ``Target.apply`` of one change -- patch code, trap routes and text as one request
  and one module batch, int3 -> sync -> tail -> sync -> head -> sync for all of it
  at once (the same path every command takes).  The functions are analysed beforehand (as the old
  one-by-one figures did: ``analyse_s``; the kernel's analysis store is built
  first, ``store_s``: one read of its text and a whole-kernel analysis, kept on disk
  for the next run); attaching is planning, placing and poking.
* ``bpftrace-kprobe`` and ``bpftrace-kfunc`` -- Debian's bpftrace 0.17 in the guest,
  one program listing the same functions (``kprobe:f1,kprobe:f2,... { @ = count(); }``),
  timed by a driver in the guest from bpftrace's "Attaching N probes..." to its
  first output after attaching (an interval probe listed last), then from SIGINT
  to its exit (detaching and printing the count).  This kernel has no
  kprobe_multi: bpftrace attaches kprobes one by one.

The functions: entry points that both ksim policies can splice
(``Manager.can_insert``), that the kernel's ftrace lists and bpftrace can attach
a kfunc to, with a name kallsyms gives once; taken in a fixed pseudo-random order,
so that N = 100 is spread over the whole kernel and each N is a prefix of the next.
N = "all" is every such function.  A run -- attaching, the workload, detaching --
that does not finish within ``LIMIT_S`` is stopped and recorded as such, and the
larger N for that tool are not tried; nor is an N whose attach and detach times,
projected from the per-probe times measured at the previous N, exceed ``LIMIT_S``
(recorded as ``over-limit`` with ``projected_s``).

**Trap dispatch** (:func:`ksim.bench.perhit.trap_dispatch`): the emulated cycles
per getpid with ksim's trap on ``__x64_sys_getpid`` and 1 route installed, then with
10,000 routes (idle sites elsewhere in text) -- the route table is a hash.

**Toy kernels** (unicorn, QEMU): the same insert_many / remove_many on every
spliceable function entry of the toy kernel, hits counted over the seeded workload,
and the text compared with the original bytes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

from ksim.analysis.function import CACHE_FUNCTIONS
from ksim.analysis.store import for_batch
from ksim.bench import bpftrace
from ksim.bench.common import Context, Section, Skip, Table, attempt, pyplot, save
from ksim.errors import KsimError

NAME = "batch"
TITLE = "Attach and detach entry probes on N functions: ksim against bpftrace"
TOOLS = ("ksim-jmp", "ksim-trap", "bpftrace-kprobe", "bpftrace-kfunc")
LIMIT_S = 600.0
#: what the guest runs while the probes are in (the same for every tool)
WORKLOAD = ("for i in 1 2 3; do ls -R /proc/sys >/dev/null 2>&1; cat /proc/meminfo /proc/stat "
            ">/dev/null; find /usr/lib/python3* -maxdepth 1 >/dev/null 2>&1; done")
SEED = 20261123



# --- the toy kernels ---------------------------------------------------------------------
def _toy(spec: str, policies: tuple[str, ...], ns: list[int | None]) -> dict[str, Any]:
    from ksim.kapi import Manager

    runs = []
    with Manager.attach(spec) as m:
        t0 = time.perf_counter()
        pool = {pol: [p for _, p in m.spliceable_entries(
                    sorted(m.target.image.functions, key=lambda f: f.address), pol)[0]]
                for pol in policies}
        analyse_s = time.perf_counter() - t0
        for pol in policies:
            for n in ns:
                points = pool[pol][:n] if n else pool[pol]
                before = m.text_snapshot()
                variables = m.malloc_array(len(points))
                t0 = time.perf_counter()
                handles = m.insert_many(points, _counting(points, variables), splice=pol)
                attach_s = time.perf_counter() - t0
                hits = None
                if spec.startswith("unicorn"):  # QEMU's toy boots anew with the probes in
                    m.run(seed=1, iterations=100)
                    hits = sum(m.read_array(variables))
                t0 = time.perf_counter()
                m.remove_many(handles)
                detach_s = time.perf_counter() - t0
                m.free(variables[0])
                runs.append({"tool": f"ksim-{pol}", "policy": pol, "n": len(points),
                             "attach_s": attach_s, "detach_s": detach_s, "hits": hits,
                             "attach_ms_per_probe": 1e3 * attach_s / max(len(points), 1),
                             "text_restored": m.text_snapshot() == before})
    return {"runs": runs, "candidates": {p: len(v) for p, v in pool.items()},
            "analyse_s": analyse_s}


def _counting(points: list[Any], variables: list[Any]) -> Any:
    """Each point's snippet: add one to its own counter."""
    var = {p.address: v for p, v in zip(points, variables, strict=True)}
    return lambda p: var[p.address].atomic_assign(var[p.address] + 1)


# --- the live testbed ---------------------------------------------------------------------
# The guest side of choosing functions: the names ftrace lists (kprobes at +0 go
# through it) that bpftrace can also attach a kfunc to -- in BTF, with at most six
# arguments, none of them and not the return value a struct or union passed by value
# (btf_distill_func_proto, kernel/bpf/btf.c; the x86 trampoline takes six register
# arguments), and not on the verifier's deny list -- compressed (the list is larger
# than an exec reply carries).
TRACEABLE = r"""
import base64, struct, subprocess, sys, zlib
ftrace = {l.split()[0] for l in open("/sys/kernel/tracing/available_filter_functions") if "[" not in l}
exe = sys.argv[1] if len(sys.argv) > 1 else "bpftrace"
out = subprocess.run([exe, "-l", "kfunc:*"], capture_output=True, text=True).stdout
kfunc = {l.rsplit(":", 1)[-1] for l in out.splitlines() if l.startswith("kfunc:")}
raw = open("/sys/kernel/btf/vmlinux", "rb").read()
_magic, _v, _f, hdr, toff, tlen, soff, slen = struct.unpack_from("<HBBIIIII", raw)
strs = raw[hdr + soff:hdr + soff + slen]
def name(off): return strs[off:strs.index(b"\0", off)].decode()
EXTRA = {1: 4, 3: 12, 4: 12, 5: 12, 6: 8, 13: 8, 14: 4, 15: 12, 17: 4, 19: 12}
PER = {4, 5, 6, 13, 15, 19}
types = [None]
at, end = hdr + toff, hdr + toff + tlen
while at < end:
    n, info, ref = struct.unpack_from("<III", raw, at)
    kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
    at += 12
    params = []
    if kind == 13:
        params = [struct.unpack_from("<II", raw, at + 8 * i)[1] for i in range(vlen)]
    types.append((kind, n, ref, params))
    at += EXTRA.get(kind, 0) * (vlen if kind in PER else 1)
def base(t):
    while t and types[t][0] in (8, 9, 10, 11, 18):
        t = types[t][2]
    return t
def byvalue_aggregate(t):
    t = base(t)
    return bool(t) and types[t][0] in (4, 5)
deny = {"migrate_disable", "migrate_enable", "rcu_read_unlock_strict", "preempt_count_add",
        "preempt_count_sub", "__rcu_read_lock", "__rcu_read_unlock"}
good = set()
for kind, n, ref, _ in types[1:]:
    if kind != 12:
        continue
    _k, _n, ret, params = types[ref]
    if (len(params) <= 6 and 0 not in params and not byvalue_aggregate(ret)
            and not any(byvalue_aggregate(p) for p in params)):
        good.add(name(n))
names = (ftrace & kfunc & good) - deny
print(len(ftrace), len(kfunc), len(good), base64.b64encode(zlib.compress("\n".join(sorted(names)).encode(), 9)).decode())
"""


def _traceable(t: Any, work: Path, tools: tuple[str, str] | None = None
               ) -> tuple[set[str], dict[str, int]]:
    """The names both bpftrace tools can attach to, and how many each list had;
    ``tools``: the guest's (bpftrace, python) when they are not the host's (arm64)."""
    import base64
    import zlib

    from ksim.live.testbed import guest_file, host_python

    script = guest_file(work, "traceable.py", TRACEABLE)
    exe, python = tools or ("bpftrace", host_python())
    out = t.exec_checked(f"{python} {script} {exe}", timeout=1800).split()
    names = set(zlib.decompress(base64.b64decode(out[3])).decode().split("\n"))
    return names, {"ftrace_names": int(out[0]), "kfunc_names": int(out[1]),
                   "btf_fentry_names": int(out[2])}


def _pool(m: Any, t: Any, want: int | None, bar: Any, work: Path,
          tools: tuple[str, str] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Entry points every tool can attach, in a fixed pseudo-random order; ``want``
    of them (None: all)."""
    traceable, counts = _traceable(t, work, tools)
    funcs = [f for f in t.image.functions if t.text[0] <= f.address < t.text[1]]
    names: dict[str, int] = {}
    for f in funcs:
        names[f.name] = names.get(f.name, 0) + 1
    eligible = sorted((f for f in funcs if names[f.name] == 1 and "." not in f.name
                       and f.name in traceable), key=lambda f: f.address)
    random.Random(SEED).shuffle(eligible)
    t0 = time.perf_counter()
    for_batch(t.image, len(eligible))  # the kernel's analysis store: read its text, analyse it
    store_s = time.perf_counter() - t0
    out: list[Any] = []
    analysed = 0
    t0 = time.perf_counter()
    step = 2000
    for lo in range(0, len(eligible), step):
        if want is not None and len(out) >= want:
            break
        chunk = eligible[lo:lo + step]
        analysed += len(chunk)
        jmp, _ = m.spliceable_entries(chunk, "jmp")
        both, _ = m.spliceable_entries([f for f, _p in jmp], "trap")
        out += [p for _f, p in both]
        bar.advance(0, note=f"analysing: {analysed}/{len(eligible)}, {len(out)} spliceable")
    out = out if want is None else out[:want]
    info = {"functions": len(funcs), "eligible": len(eligible), "analysed": analysed,
            "pool": len(out), "store_s": store_s, "analyse_s": time.perf_counter() - t0, **counts}
    return out, info


def _ksim(m: Any, t: Any, points: list[Any], policy: str) -> dict[str, Any]:
    # analysed again just before (untimed): the client keeps the analyses of the most
    # recently used functions only (CACHE_FUNCTIONS), and the pool's pass went over all
    t0 = time.perf_counter()
    m.spliceable_entries([t.image.function_at(p.address) for p in points], policy)
    analyse_s = time.perf_counter() - t0
    before = t.read_many([p.address for p in points])
    variables = m.malloc_array(len(points))
    t0 = time.perf_counter()
    handles = m.insert_many(points, _counting(points, variables), splice=policy)
    attach_s = time.perf_counter() - t0
    run = t.run(while_cmd=WORKLOAD, timeout=LIMIT_S)
    hits = sum(m.read_array(variables))
    t0 = time.perf_counter()
    m.remove_many(handles)
    detach_s = time.perf_counter() - t0
    restored = t.read_many([p.address for p in points]) == before
    m.free(variables[0])
    return {"status": "ok", "attach_s": attach_s, "detach_s": detach_s, "hits": hits,
            "workload_s": run.seconds, "text_restored": restored, "analyse_s": analyse_s,
            "analyses_kept": min(len(points), CACHE_FUNCTIONS)}


def _bpftrace(t: Any, points: list[Any], kind: str, work: Path,
              tools: tuple[str, str] | None = None) -> dict[str, Any]:
    """One bpftrace run in the guest on ``points``' functions, counting their hits."""
    program = (",\n".join(f"{kind}:{p.function}" for p in points)
               + "\n{ @ = count(); }\n" + bpftrace.READY_PROBE)
    exe, python = tools or (None, None)
    return bpftrace.run(t, program, WORKLOAD, LIMIT_S, work, f"probes-{kind}-{len(points)}.bt",
                        exe, python=python)


def _bpftrace_tries(t: Any, points: list[Any], kind: str, work: Path,
                    tools: tuple[str, str] | None = None) -> dict[str, Any]:
    """A bpftrace run; a function whose program the kernel refuses to load (bpftrace
    names it and stops) is left out and the run made again, a few times at most."""
    dropped: list[str] = []
    for _ in range(5):
        row = _bpftrace(t, points, kind, work, tools)
        refused = re.search(rf"Error loading program: {kind}:(?:vmlinux:)?(\S+)", row.get("output", ""))
        if row["status"] != "error" or refused is None:
            break
        dropped.append(refused.group(1))
        points = [p for p in points if p.function != refused.group(1)]
    row["n"] = len(points)
    if dropped:
        row["dropped"] = dropped
    return row


def _live(ctx: Context, bar: Any, instance: str | None = None,
          sizes: list[int | None] | None = None, routes: int | None = None) -> dict[str, Any]:
    """The live rows on the testbed ``instance`` (None: x86-64's; "arm64": the arm64
    testbed, whose guest has Debian's arm64 bpftrace and Python of its own)."""
    if ctx.smoke and sizes is None:
        raise Skip("smoke run: the live testbed is left alone")
    try:
        from ksim.live import testbed
    except ImportError as exc:
        raise Skip(f"the live testbed is not part of this installation ({exc})") from exc
    state = testbed.status(instance)
    if not state.get("up"):
        flag = " --arch arm64 --with bpftrace" if instance == "arm64" else ""
        raise Skip(f"the Linux testbed is not up (start it with `ksim testbed up{flag}`)")
    arm64 = state.get("arch") == "arm64"
    if not arm64 and shutil.which("bpftrace") is None:
        testbed.ensure_tools(("bpftrace",))
    from ksim.bench import perhit
    from ksim.kapi import Manager

    if sizes is None:  # arm64 under TCG: N = all would take the run's hour
        sizes = ctx.pick([100, 1000, 10_000] if arm64 else [100, 1000, 10_000, None], [100], [])
    m = Manager.attach(state["address"], token_file=state["token_file"])
    t: Any = m.target   # the live target: exec(), tracefs()
    try:
        tools = bpftrace.guest_tools(t) if arm64 else None
        work = testbed.cache_dir() / ("bench-batch-arm64" if arm64 else "bench-batch")
        work.mkdir(exist_ok=True)
        largest = None if None in sizes else max(s for s in sizes if s is not None)
        points, pool = _pool(m, t, largest, bar, work, tools)
        rows: list[dict[str, Any]] = []
        given_up: dict[str, int] = {}
        failed: dict[str, int] = {}   # a bpftrace tool the kernel refused to attach, at that N
        rate: dict[str, float] = {}   # bpftrace's attach + detach seconds per probe at the last N
        partial = work / "partial.json"   # what is done so far, should the run be cut short
        dispatch: dict[str, Any] = {}

        def record(row: dict[str, Any]) -> None:
            rows.append(row)
            partial.write_text(json.dumps({"rows": rows, "pool": pool, "trap_dispatch": dispatch},
                                          indent=1))

        # ksim's runs first (every N), then the trap dispatch, then bpftrace's (its
        # largest runs take the longest)
        for tool in TOOLS:
            if tool == "bpftrace-kprobe":
                dispatch = perhit.trap_dispatch(
                    m, ctx.pick(10_000, 1_000, 0) if routes is None else routes, ctx)
                bar.advance(note="trap dispatch")
            for n in sizes:
                chosen = points if n is None else points[:n]
                row: dict[str, Any] = {"target": "live", "tool": tool, "n": len(chosen),
                                       "size": "all" if n is None else n}
                projected = rate.get(tool, 0.0) * len(chosen)
                if tool in failed:
                    row.update(status="error", note=f"not run: N = {failed[tool]} failed to "
                               "attach, and every larger N holds those functions")
                elif tool in given_up:
                    row.update(status="over-limit", note=f"not run: N = {given_up[tool]} did "
                               f"not finish within {LIMIT_S:g} s")
                elif projected > LIMIT_S:
                    row.update(status="over-limit", projected_s=projected,
                               note=f"not run: at the per-probe attach and detach times "
                               f"measured for the previous N, attaching and detaching take "
                               f"{projected:.0f} s > {LIMIT_S:g} s")
                elif tool.startswith("ksim-"):
                    try:
                        row.update(_ksim(m, t, chosen, tool.split("-", 1)[1]))
                    except KsimError as exc:  # refused whole: nothing of it was made
                        row.update(status="error", output=f"{type(exc).__name__}: {exc}")
                else:
                    row.update(_bpftrace_tries(t, chosen, tool.split("-", 1)[1], work, tools))
                if row["status"] == "timeout":
                    given_up[tool] = len(chosen)
                if row["status"] == "error" and "Error attaching probe" in row.get("output", ""):
                    failed[tool] = len(chosen)
                if row["status"] == "ok" and not tool.startswith("ksim-"):
                    rate[tool] = (row["attach_s"] + row["detach_s"]) / max(row["n"], 1)
                if row.get("attach_s") is not None and row["status"] == "ok":
                    row["attach_ms_per_probe"] = 1e3 * row["attach_s"] / max(row["n"], 1)
                    row["detach_ms_per_probe"] = 1e3 * row["detach_s"] / max(row["n"], 1)
                record(row)
                bar.advance(note=f"{tool} N={len(chosen)}: {row['status']}")
        rows.sort(key=lambda r: (r["n"], TOOLS.index(r["tool"])))
    finally:
        m.detach()
    return {"rows": rows, "pool": pool, "trap_dispatch": dispatch, "limit_s": LIMIT_S,
            "workload": WORKLOAD, "kernel": state.get("kernel"), "accel": state.get("accel"),
            "arch": "arm64" if arm64 else "x86_64"}


def run(ctx: Context) -> Section:
    if ctx.arch == "arm64":  # the arm64 testbed's live rows (the toy kernels are x86-64's)
        return _run_arm64(ctx)
    toy_ns: list[int | None] = ctx.pick([10, 100, None], [10, None], [3, 10])
    live_sizes = ctx.pick(4, 1, 0)
    targets = [("unicorn", "unicorn:toy")]
    notes: list[str] = []
    if shutil.which("qemu-system-x86_64"):
        targets.append(("qemu", "qemu:toy"))
    else:
        notes.append("qemu: skipped: qemu-system-x86_64 is not installed")
    results: dict[str, Any] = {}
    total = len(targets) + live_sizes * len(TOOLS) + (1 if live_sizes else 0)
    with ctx.bar(total, "batch") as bar:
        for label, spec in targets:
            done = attempt(label, results, notes, _toy, spec, ("auto", "trap"), toy_ns)
            if done is not None:
                results[label] = done
            bar.advance(note=label)
        done = attempt("live", results, notes, _live, ctx, bar)
        if done is not None:
            results["live"] = done
    tables = [_toy_table(results)]
    live = results.get("live", {})
    if live.get("rows"):
        tables += _live_tables(live)
        notes += _live_notes(live)
    notes.append("toy kernels: insert_many / remove_many of an entry counter on N functions "
                 "(N = all: every function entry the policy can splice); hits over 100 "
                 "iterations of the seeded workload (unicorn; under QEMU the toy kernel would "
                 "boot again with its boot code probed); text compared with the original bytes")
    return Section(results, tables, notes, {"toy_ns": toy_ns, "limit_s": LIMIT_S})


def _run_arm64(ctx: Context) -> Section:
    results: dict[str, Any] = {}
    notes: list[str] = []
    with ctx.bar(ctx.pick(3, 1, 0) * len(TOOLS) + 1, "batch (arm64)") as bar:
        done = attempt("live_arm64", results, notes, _live, ctx, bar, "arm64")
        if done is not None:
            results["live_arm64"] = done
    tables: list[Table] = []
    live = results.get("live_arm64", {})
    if live.get("rows"):
        tables += _live_tables(live)
        notes += _live_notes(live)
    return Section(results, tables, notes, {"limit_s": LIMIT_S, "arch": "arm64"})


def _toy_table(results: dict[str, Any]) -> Table:
    rows = []
    for label in ("unicorn", "qemu"):
        for r in results.get(label, {}).get("runs", []):
            rows.append([label, r["tool"], r["n"], round(r["attach_s"], 4), round(r["detach_s"], 4),
                         round(r["attach_ms_per_probe"], 3), r["hits"], r["text_restored"]])
    return Table("Toy kernels: insert_many / remove_many of N entry counters",
                 ["target", "tool", "N", "attach s", "detach s", "ms/probe attach", "hits",
                  "text restored"], rows)


def _live_tables(live: dict[str, Any]) -> list[Table]:
    rows = []
    for r in live["rows"]:
        rows.append([r["tool"], r["size"], r["n"], r["status"], _r(r.get("attach_s")),
                     _r(r.get("detach_s")), _r(r.get("attach_ms_per_probe"), 3),
                     _r(r.get("detach_ms_per_probe"), 3), r.get("hits"),
                     r.get("text_restored", "-")])
    arm64 = live.get("arch") == "arm64"
    t1 = Table(f"Live testbed ({live.get('kernel')}, {live.get('accel')}): attach and detach N "
               "function entries, each counting hits",
               ["tool", "N asked", "N", "status", "attach s", "detach s", "ms/probe attach",
                "ms/probe detach", "hits", "text restored"], rows)
    d = live.get("trap_dispatch") or {}
    t2 = Table(f"Trap dispatch on the live testbed ({live.get('kernel')}): "
               + ("CNTVCT_EL0 ticks per getpid, ksim trap (BRK) on __arm64_sys_getpid" if arm64
                  else "emulated cycles per getpid, ksim trap on __x64_sys_getpid"),
               ["routes installed", f"{'ticks' if arm64 else 'cycles'}/call (min)",
                "overhead/hit"],
               [[x["routes"], _r(x["cycles"]), _r(x["overhead"])] for x in d.get("rows", [])])
    return [t1, t2]


def _live_notes(live: dict[str, Any]) -> list[str]:
    pool = live["pool"]
    d = live.get("trap_dispatch") or {}
    label = "live_arm64" if live.get("arch") == "arm64" else "live"
    notes = [f"live: the functions: {pool['pool']} entry points both ksim policies splice, "
             f"that ftrace lists and bpftrace attaches a kfunc to, with a unique name "
             f"({pool['eligible']} eligible of {pool['functions']} core text functions, "
             f"{pool['analysed']} analysed in {pool['analyse_s']:.0f} s before timing, with "
             f"the kernel's analysis store, {pool.get('store_s', 0):.0f} s to read its text and "
             "build it, or to load it)",
             f"live: ksim attach = Manager.insert_many (planning, placing, one change applied "
             "as one request: patch code, text and routes in one module batch); bpftrace "
             "attach = from 'Attaching N probes...' to its first output after the probes "
             "(its start-up, parsing and code generation before that are startup_s); detach = "
             f"remove_many / from SIGINT to bpftrace's exit; limit {live['limit_s']:g} s per run",
             "live: hits = the counters' sum / bpftrace's @ count over the same workload "
             f"({live['workload']!r}); emulated TCG guest: times are wall time of an emulated "
             "kernel, never hardware figures"]
    if label != "live":
        notes = [n.replace("live: ", f"{label}: ", 1) for n in notes]
        notes.append(f"{label}: Debian's arm64 kernel in qemu-system-aarch64 under TCG, its "
                     "bpftrace 0.17 in the same guest; ksim's text writes go in under "
                     "stop_machine, its trap is a BRK; N = all is not run on arm64; "
                     "bpftrace's kfunc probes fail to attach on this kernel (its config has "
                     "no DYNAMIC_FTRACE_WITH_DIRECT_CALLS), so the larger N are not tried")
    if d.get("ratio") is not None:
        notes.append(f"{label}: trap dispatch with {d['routes']:,} routes costs "
                     f"{d['ratio']:.3f} x the overhead with 1 route (min over {d['rounds']} "
                     "interleaved rounds)")
    return notes


def _r(v: Any, digits: int = 2) -> Any:
    return round(v, digits) if isinstance(v, float) else v


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    rows = [r for r in (res.get("live") or {}).get("rows", []) if r.get("status") == "ok"]
    for tool in TOOLS:
        mine = sorted((r for r in rows if r["tool"] == tool), key=lambda r: r["n"])
        if not mine:
            continue
        ns = [r["n"] for r in mine]
        axes[0].plot(ns, [r["attach_s"] for r in mine], "o-", label=tool)
        axes[1].plot(ns, [r["detach_s"] for r in mine], "o-", label=tool)
        axes[2].plot(ns, [r["attach_ms_per_probe"] for r in mine], "o-", label=f"live {tool}")
    for label in ("unicorn", "qemu"):
        for pol in ("auto", "trap"):
            runs = sorted((r for r in res.get(label, {}).get("runs", []) if r["policy"] == pol),
                          key=lambda r: r["n"])
            if runs:
                axes[2].plot([r["n"] for r in runs], [r["attach_ms_per_probe"] for r in runs],
                             "x--", label=f"{label} ksim-{pol}")
    for ax, title, ylabel in ((axes[0], "live: attach (lower is better)", "seconds"),
                              (axes[1], "live: detach (lower is better)", "seconds"),
                              (axes[2], "attach per probe (lower is better)", "milliseconds per probe")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N functions (count)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        if ax.get_legend_handles_labels()[0]:  # a run without the live testbed has no lines there
            ax.legend(fontsize=7)
    save(fig, path)
