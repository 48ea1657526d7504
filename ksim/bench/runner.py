"""Run benchmarks by name: time each, print its tables, collect the JSON document,
draw the plots."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

from ksim.bench.common import (
    SCHEMA,
    Context,
    Section,
    Skip,
    format_table,
    jsonable,
    machine_info,
    now_iso,
)

#: benchmark name -> module (one module per benchmark), in the order "all" runs them
BENCHMARKS = {
    "sizes": "ksim.bench.sizes",
    "offset": "ksim.bench.offset",
    "coverage": "ksim.bench.coverage",
    "census": "ksim.bench.census",
    "per-hit": "ksim.bench.perhit",
    "batch": "ksim.bench.batch",
    "analysis": "ksim.bench.analysis",
    "cli": "ksim.bench.cli",
}


def module(name: str) -> Any:
    return importlib.import_module(BENCHMARKS[name])


def names_for(name: str) -> list[str]:
    return list(BENCHMARKS) if name == "all" else [name]


def run_one(name: str, ctx: Context) -> dict[str, Any]:
    """One benchmark's JSON entry; a Skip or an error becomes an entry too."""
    t0 = time.perf_counter()
    try:
        mod = module(name)
        section: Section = mod.run(ctx)
    except Skip as exc:
        return {"status": "skipped", "reason": str(exc), "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - "all" goes on; the entry keeps the cause
        if os.environ.get("KSIM_BENCH_RAISE"):
            raise
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=8), "seconds": time.perf_counter() - t0}
    return {
        "status": "ok",
        "title": getattr(mod, "TITLE", name),
        "seconds": time.perf_counter() - t0,
        "params": jsonable(section.params),
        "results": jsonable(section.results),
        "tables": [t.as_dict() for t in section.tables],
        "notes": list(section.notes),
    }


def run(names: list[str], ctx: Context, *, out: Any = sys.stdout, json_path: str | None = None,
        plot_path: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"schema": SCHEMA, "machine": machine_info(), "started": now_iso(),
                           "mode": ctx.mode, "benchmarks": {}}
    for name in names:
        entry = run_one(name, ctx)
        doc["benchmarks"][name] = entry
        if out is not None:
            print_entry(name, entry, out)
        if json_path:  # written after each benchmark: a long run keeps what it measured
            write_json(doc, json_path)
        if plot_path and entry["status"] == "ok":
            path = plot_file(plot_path, name, many=len(names) > 1)
            try:
                module(name).plot(entry, path)
                entry["plot"] = os.path.basename(path)
            except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the figures
                entry["notes"].append(f"plot failed: {type(exc).__name__}: {exc}")
    doc["finished"] = now_iso()
    if json_path:
        write_json(doc, json_path)
    return doc


def plot_file(path: str, name: str, *, many: bool) -> str:
    """``--plot out.png``: that file for one benchmark; ``out-NAME.png`` for several."""
    if not many:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{name}{ext or '.png'}"


def write_json(doc: dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(doc), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def print_entry(name: str, entry: dict[str, Any], out: Any) -> None:
    head = f"== {name}: {entry.get('title', '')} ({entry['seconds']:.1f} s)"
    print(head, file=out)
    if entry["status"] != "ok":
        print(f"   {entry['status']}: {entry['reason']}", file=out)
        print(file=out)
        return
    from ksim.bench.common import Table

    for t in entry["tables"]:
        print(format_table(Table(t["title"], t["columns"], t["rows"])), file=out)
        print(file=out)
    for note in entry["notes"]:
        print(f"   note: {note}", file=out)
    print(file=out)
