"""analysis: time to load and analyse a whole kernel, next to ``objdump -d``.

The Debian 6.1 vmlinux (14.7 MB of text, ~50 K functions from kallsyms): load the
image (ELF sections + the kallsyms list), then ``analyze()`` every function
(decode, CFG with jump tables, points).  Measured in a fresh Python process so
that "cold" really is cold (the reader caches register effects per instruction
text), then, in the same process: "cached" — ``analyze()`` again on the same
image (its per-image cache), and "re-analyse" — a new Image of the same file with
the process's decoder caches warm.  ``objdump -d`` runs on the same file in the
same benchmark.  ``--quick`` analyses every k-th function and scales the times by
the share of bytes covered (said in the notes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Any

from ksim.bench.common import Context, Section, Skip, Table, pyplot, save

NAME = "analysis"
TITLE = "Load and analyse a whole kernel (cold, cached) vs objdump -d"


def worker(symbols: str | None, path: str, stride: int) -> dict[str, Any]:
    """Runs in a fresh interpreter (``python -m ksim.bench.analysis ...``)."""
    from ksim.analysis import analyze
    from ksim.image import load_image, load_kallsyms

    def load() -> Any:
        return load_kallsyms(symbols, path) if symbols else load_image(path)

    t0 = time.perf_counter()
    image = load()
    t_load = time.perf_counter() - t0
    funcs = image.functions[::stride]
    counts = {"functions": 0, "instructions": 0, "blocks": 0, "points": 0, "bytes": 0, "failed": 0}

    def pass_over(img: Any, count: bool) -> float:
        t = time.perf_counter()
        for f in funcs:
            try:
                fa = analyze(img, f.name if img is not image else f)
            except Exception:  # noqa: BLE001 - counted: some kallsyms "functions" are data
                if count:
                    counts["failed"] += 1
                continue
            if count:
                counts["functions"] += 1
                counts["instructions"] += len(fa.insns)
                counts["blocks"] += len(fa.cfg.blocks)
                counts["points"] += len(fa.points.all())
                counts["bytes"] += f.size
        return time.perf_counter() - t

    cold = pass_over(image, True)
    cached = pass_over(image, False)
    t0 = time.perf_counter()
    image2 = load()
    reload = time.perf_counter() - t0
    funcs_by_name = funcs
    funcs = [image2.function(f.name) if image2.has_function(f.name) else f for f in funcs_by_name]
    reanalyse = pass_over(image2, False)
    total_bytes = sum(f.size for f in image.functions)
    return {"load_s": t_load, "cold_s": cold, "cached_s": cached, "reload_s": reload,
            "reanalyse_s": reanalyse, "counts": counts, "all_functions": len(image.functions),
            "all_bytes": total_bytes, "stride": stride}


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
    stride = ctx.pick(1, 20, 1)
    notes = []
    with ctx.bar(2, f"analysis: {label}") as bar:
        proc = subprocess.run(
            [sys.executable, "-m", "ksim.bench.analysis", symbols or "-", path, str(stride)],
            capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"analysis worker failed: {proc.stderr.strip()[-600:]}")
        w = json.loads(proc.stdout.strip().splitlines()[-1])
        bar.advance(note="objdump -d")
        objdump = _objdump(path)
        bar.advance()
    c = w["counts"]
    scale = w["all_bytes"] / c["bytes"] if c["bytes"] else 1.0
    if stride > 1:
        notes.append(f"quick run: every {stride}th function ({c['functions']} of "
                     f"{w['all_functions']}, {100 / scale:.1f}% of the bytes); times for the "
                     f"whole kernel are scaled by {scale:.1f}")
    if c["failed"]:
        notes.append(f"{c['failed']} symbol(s) could not be analysed (data or aliases in text)")
    whole = {k: w[k] * (scale if k in ("cold_s", "cached_s", "reanalyse_s") else 1)
             for k in ("load_s", "cold_s", "cached_s", "reload_s", "reanalyse_s")}
    rows = [
        ["load image + kallsyms", w["load_s"], whole["load_s"]],
        ["analyse, cold (fresh process)", w["cold_s"], whole["cold_s"]],
        ["analyse, cached (same image)", w["cached_s"], whole["cached_s"]],
        ["analyse, new image, warm decoder", w["reanalyse_s"], whole["reanalyse_s"]],
        ["objdump -d (whole file)", objdump.get("seconds"), objdump.get("seconds")],
    ]
    table = Table(f"Seconds ({label})", ["step", "measured", "whole kernel"],
                  [[r[0], _r(r[1]), _r(r[2])] for r in rows])
    rate = Table("Throughput", ["what", "value"], [
        ["functions analysed", c["functions"]],
        ["instructions", c["instructions"]],
        ["basic blocks", c["blocks"]],
        ["points (entry, exits, blocks, call sites)", c["points"]],
        ["instructions/s, cold", _r(c["instructions"] / w["cold_s"] if w["cold_s"] else None)],
        ["objdump lines/s", _r(objdump.get("lines", 0) / objdump["seconds"]
                               if objdump.get("seconds") else None)],
        ["cold analysis / objdump (whole kernel)",
         _r(whole["cold_s"] / objdump["seconds"] if objdump.get("seconds") else None)],
    ])
    return Section({"target": label, "worker": w, "whole_kernel_s": whole, "objdump": objdump,
                    "scale": scale}, [table, rate], notes, {"stride": stride})


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
    proc.wait()
    return {"seconds": time.perf_counter() - t0, "lines": lines, "returncode": proc.returncode}


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    w = res["whole_kernel_s"]
    labels = ["load", "analyse\ncold", "analyse\ncached", "new image,\nwarm decoder", "objdump -d"]
    vals = [w["load_s"], w["cold_s"], w["cached_s"], w["reanalyse_s"],
            res["objdump"].get("seconds") or 0]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    bars = ax.bar(labels, vals, color=["#999", "#d62728", "#2ca02c", "#ff7f0e", "#1f77b4"])
    for b, v in zip(bars, vals, strict=False):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (whole kernel)")
    ax.set_title(f"Analysing {res['target']}" + (" (scaled from a subset)" if res["scale"] > 1.01 else ""))
    save(fig, path)


if __name__ == "__main__":
    _symbols, _path, _stride = sys.argv[1:4]
    print(json.dumps(worker(None if _symbols == "-" else _symbols, _path, int(_stride))))
