"""analysis: analysing a whole kernel, cold and warm, next to ``objdump -d``.

The Debian 6.1 vmlinux (15 MB of function bytes, ~50 K functions from kallsyms), in
one run, each step in a fresh Python process:

* **cold** -- no analysis store anywhere (an empty store directory): load the image,
  then analyse every function (decode, CFG with jump tables, points, clobber
  summaries; ``ksim.analysis.store.analyze_image``, one worker per core) and save the
  store.  ``cold_s`` is the analysis; its CPU time (all workers) and the time from
  the process's start are reported too.
* **warm, new process** -- the same image in a new process with that store: load
  the image, open the store (checked against its digest and the image's function
  table) and obtain every function's points and counts.  ``warm_new_process_s`` is
  that, without the image load (reported apart); then, as a caller attaching to
  functions would, ``analyze()`` and liveness at the entry of a sample of functions.
* **objdump -d** of the same file (``objdump_s``, and its CPU time), output counted,
  not kept.

The goals: cold no slower than ``objdump -d`` in the same run, warm under a second.
The machine may be shared: the CPU times say how much of the wall time was work.
``--quick`` samples fewer functions for the attach step; the smoke mode (tests)
runs on the bundled toy kernel.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ksim.bench.common import Context, Section, Skip, Table, pyplot, save

NAME = "analysis"
TITLE = "Analyse a whole kernel: cold, warm in a new process, and objdump -d"


# --- the workers (fresh interpreters: python -m ksim.bench.analysis STEP ...) ------------
def _load(symbols: str | None, path: str) -> Any:
    from ksim.image import load_image, load_kallsyms

    return load_kallsyms(symbols, path) if symbols else load_image(path)


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (the workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def cold_worker(symbols: str | None, path: str, spawned: float) -> dict[str, Any]:
    from ksim.analysis.store import analyze_image, path_for

    t0 = time.perf_counter()
    image = _load(symbols, path)
    t_load = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), _cpu()
    store = analyze_image(image)
    cold, cpu = time.perf_counter() - t0, _cpu() - cpu0
    saved = path_for(image)
    return {"load_s": t_load, "cold_s": cold, "cold_cpu_s": cpu, "ready_s": time.time() - spawned,
            "totals": store.totals(), "jobs": os.cpu_count(),
            "store_bytes": saved.stat().st_size if saved.exists() else None}


def warm_worker(symbols: str | None, path: str, spawned: float, sample: int) -> dict[str, Any]:
    from ksim.analysis import analyze
    from ksim.analysis.store import store_for

    t0 = time.perf_counter()
    image = _load(symbols, path)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = store_for(image, build_missing=False)
    if store is None:
        raise RuntimeError("no analysis store for the image in the warm process")
    points = sum(1 + len(p.exits) + len(p.blocks) + len(p.callsites) for p in store.function_points(image))
    totals = store.totals()
    warm = time.perf_counter() - t0
    ready = time.time() - spawned
    funcs = [f for f in image.functions if store.get(f) is not None]
    chosen = random.Random(1).sample(funcs, min(sample, len(funcs)))
    t0 = time.perf_counter()
    for func in chosen:
        fa = analyze(image, func)
        fa.live_at(fa.points.entry)
    attach = time.perf_counter() - t0
    return {"load_s": t_load, "warm_s": warm, "ready_s": ready, "totals": totals, "points": points,
            "sample": len(chosen), "sample_s": attach}


def _run_worker(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "ksim.bench.analysis", args[0], args[1], args[2],
                           repr(time.time()), *args[3:]],
                          capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"analysis worker {args[0]} failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the benchmark ------------------------------------------------------------------------
def _target(ctx: Context) -> tuple[str | None, str, str]:
    from ksim.bench import kernel as kmod

    if ctx.smoke:  # tests: the bundled toy kernel, seconds
        from ksim import images

        return None, str(images.path("toy")), "toy"
    try:
        k = kmod.debian_kernel()
    except kmod.KernelUnavailable as exc:
        raise Skip(f"the Debian kernel is not available: {exc}") from exc
    return str(k.kallsyms), str(k.vmlinux), f"vmlinux {k.abi}"


def run(ctx: Context) -> Section:
    symbols, path, label = _target(ctx)
    sample = ctx.pick(200, 50, 10)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ksim-bench-analysis-") as store_dir, \
            ctx.bar(3, f"analysis: {label}") as bar:
        env = {**os.environ, "KSIM_ANALYSIS_CACHE": store_dir, "KSIM_ANALYSIS_STORE": "auto"}
        cold = _run_worker(["cold", symbols or "-", path], env)
        bar.advance(note="warm")
        warm = _run_worker(["warm", symbols or "-", path, str(sample)], env)
        bar.advance(note="objdump -d")
        objdump = _objdump(path)
        bar.advance()
    if warm["totals"] != cold["totals"]:
        raise RuntimeError(f"the warm process found {warm['totals']}, the cold one {cold['totals']}")
    t = cold["totals"]
    if t["failed"]:
        notes.append(f"{t['failed']} symbol(s) could not be analysed (their bytes are not in the image)")
    objdump_s = objdump.get("seconds")
    results: dict[str, Any] = {
        "target": label,
        "cold_s": cold["cold_s"],
        "warm_new_process_s": warm["warm_s"],
        "objdump_s": objdump_s,
        "load_s": cold["load_s"],
        "warm_load_s": warm["load_s"],
        "cold_cpu_s": cold["cold_cpu_s"],
        "objdump_cpu_s": objdump.get("cpu_seconds"),
        "cold_process_s": cold["ready_s"],
        "warm_process_s": warm["ready_s"],
        "attach_sample": warm["sample"],
        "attach_sample_s": warm["sample_s"],
        "jobs": cold["jobs"],
        "store_bytes": cold["store_bytes"],
        "totals": t,
        "objdump": objdump,
        "goals": {
            "cold_le_objdump": objdump_s is not None and cold["cold_s"] <= objdump_s,
            "warm_under_1s": warm["warm_s"] < 1.0,
        },
    }
    rows = [
        ["analyse, cold (fresh process, no store)", cold["cold_s"]],
        ["  its CPU time, all workers", cold["cold_cpu_s"]],
        ["  the cold process from its start (load, analyse, save)", cold["ready_s"]],
        ["analyse, warm (new process, with the store)", warm["warm_s"]],
        ["  the warm process from its start (load, open, points)", warm["ready_s"]],
        ["load image + kallsyms", cold["load_s"]],
        ["objdump -d (whole file)", objdump_s],
        ["  its CPU time", objdump.get("cpu_seconds")],
        [f"attach: analyze + liveness of {warm['sample']} functions, warm", warm["sample_s"]],
    ]
    table = Table(f"Seconds ({label}, {cold['jobs']} cores)", ["step", "seconds"],
                  [[r[0], _r(r[1])] for r in rows])
    rate = Table("Whole kernel", ["what", "value"], [
        ["functions analysed", t["functions"]],
        ["instructions", t["instructions"]],
        ["basic blocks", t["blocks"]],
        ["points (entry, exits, blocks, call sites)", t["points"]],
        ["store on disk (MB)", _r(cold["store_bytes"] / 1e6 if cold["store_bytes"] else None)],
        ["instructions/s, cold", _r(t["instructions"] / cold["cold_s"] if cold["cold_s"] else None)],
        ["objdump lines/s", _r(objdump.get("lines", 0) / objdump_s if objdump_s else None)],
        ["cold analysis / objdump -d", _r(cold["cold_s"] / objdump_s if objdump_s else None)],
        ["ms per attached function, warm", _r(1000 * warm["sample_s"] / max(warm["sample"], 1))],
    ])
    return Section(results, [table, rate], notes, {"sample": sample})


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _objdump(path: str) -> dict[str, Any]:
    if shutil.which("objdump") is None:
        return {"skipped": "objdump is not installed"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(["objdump", "-d", path], stdout=subprocess.PIPE)
    lines = 0
    out = proc.stdout
    assert out is not None
    for chunk in iter(lambda: out.read(1 << 20), b""):
        lines += chunk.count(b"\n")
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "lines": lines, "returncode": proc.returncode}


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    labels = ["analyse\ncold", "cold process\nfrom its start", "analyse warm\n(new process)",
              "warm process\nfrom its start", "objdump -d"]
    vals = [res["cold_s"], res["cold_process_s"], res["warm_new_process_s"], res["warm_process_s"],
            res["objdump_s"] or 0]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    bars = ax.bar(labels, vals, color=["#d62728", "#f4a3a3", "#2ca02c", "#a8dca8", "#1f77b4"])
    for b, v in zip(bars, vals, strict=False):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds, whole kernel")
    ax.set_title(f"Analysing {res['target']} ({res['jobs']} cores; lower is better)")
    save(fig, path)


if __name__ == "__main__":
    _step, _symbols, _path, _spawned = sys.argv[1:5]
    _syms = None if _symbols == "-" else _symbols
    if _step == "cold":
        print(json.dumps(cold_worker(_syms, _path, float(_spawned))))
    else:
        print(json.dumps(warm_worker(_syms, _path, float(_spawned), int(sys.argv[5]))))
