"""What every benchmark shares: the run context, a progress bar, tables, the JSON
document and its schema, the machine description, and plotting.

A benchmark module exposes ``NAME``, ``TITLE``, ``run(ctx) -> Section`` and
``plot(section, path)``.  ``run`` returns plain data (JSON-ready); the runner
(:mod:`ksim.bench.runner`) times it, prints its tables, collects the JSON and draws
the plot.  A benchmark that needs something this machine does not have raises
:class:`Skip` with the reason; the runner records a "skipped" entry.  Inside a
benchmark's results the same convention holds at every level: a part (see
:func:`attempt`) or a single row that cannot run is ``{"skipped": reason}`` (a row
keeps its own keys, e.g. ``variant``, beside it), one that failed ``{"error":
reason}``, and what was measured beside it stays.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ksim.errors import KsimError

SCHEMA = "ksim-bench/1"
#: the run modes: full figures, --quick (a few minutes for all), smoke (tests: tiny, seconds)
MODES = ("full", "quick", "smoke")


class Skip(Exception):
    """The benchmark cannot run here; the message says why."""


def attempt(name: str, results: dict[str, Any], notes: list[str], fn: Any, *args: Any) -> Any:
    """Run one part of a benchmark: its value, or None after recording why it
    was skipped -- or, for the live testbed (which may go down under us), why it
    failed; a failure anywhere else is a real error and propagates."""
    try:
        return fn(*args)
    except Skip as exc:
        results[name] = {"skipped": str(exc)}
        notes.append(f"{name}: skipped: {exc}")
    except (OSError, KsimError) as exc:
        if not name.startswith("live"):
            raise
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        notes.append(f"{name}: failed: {type(exc).__name__}: {exc}")
    return None


@dataclass
class Context:
    mode: str = "full"
    stream: Any = field(default_factory=lambda: sys.stderr)
    progress: bool = True
    #: the live testbed the live parts run on: "x86_64" (port 7070) or "arm64" (7071)
    arch: str = "x86_64"

    @property
    def quick(self) -> bool:
        return self.mode != "full"

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        """The parameter for this run's mode."""
        return {"full": full, "quick": quick, "smoke": smoke}[self.mode]

    def bar(self, total: int, label: str) -> Progress:
        return Progress(total, label, self.stream, enabled=self.progress)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


@dataclass
class Section:
    """One benchmark's output: figures (free-form, JSON-ready), tables, notes."""

    results: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)


# --- progress bar -----------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (redrawn at most 10 times a second)."""

    WIDTH = 28

    def __init__(self, total: int, label: str, stream: Any = sys.stderr, *, enabled: bool = True) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._drawn = 0.0
        self._draw(force=True)

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        self._draw(note=note)

    def close(self, note: str = "") -> None:
        self.done = self.total
        self._draw(force=True, note=note)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, *, force: bool = False, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        frac = self.done / self.total
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        line = f"\r{self.label:<28} [{bar}] {self.done}/{self.total} {now - self.start:6.1f}s {note}"
        self.stream.write(line[:150].ljust(100))
        self.stream.flush()


# --- statistics ---------------------------------------------------------------------------
def summary(samples: Sequence[float]) -> dict[str, float]:
    """min / median / mean of repeated measurements (min is the least disturbed on a shared machine)."""
    if not samples:
        return {"min": float("nan"), "median": float("nan"), "mean": float("nan"), "n": 0}
    return {"min": min(samples), "median": statistics.median(samples),
            "mean": statistics.fmean(samples), "n": len(samples)}


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


# --- tables ---------------------------------------------------------------------------------
def format_table(table: Table) -> str:
    cells = [[_fmt(c) for c in row] for row in table.rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(table.columns)]
    out = [table.title, "  ".join(h.rjust(w) if i else h.ljust(w)
                                  for i, (h, w) in enumerate(zip(table.columns, widths, strict=False)))]
    out.append("  ".join("-" * w for w in widths))
    for r in cells:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
    return "\n".join(out)


def markdown_table(table: Table) -> str:
    head = "| " + " | ".join(table.columns) + " |"
    sep = "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(table.columns))) + " |"
    rows = ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in table.rows]
    return "\n".join([head, sep] + rows)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if value else "0"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10000:
        return f"{value:,}"
    return "-" if value is None else str(value)


# --- the machine ----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "constant_tsc": "constant_tsc" in flags,
        "hypervisor": "hypervisor" in flags,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gcc": _first_line(["gcc", "--version"]),
        "qemu": _first_line(["qemu-system-x86_64", "--version"]),
    }
    for mod in ("unicorn", "capstone", "matplotlib"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is just not reported
            info[mod] = None
    return info


def _first_line(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


# --- the JSON document and its schema ------------------------------------------------
STATUSES = ("ok", "skipped", "error")


def validate(doc: Any) -> list[str]:
    """Problems with a results document (empty when it follows the schema)."""
    errs: list[str] = []

    def need(obj: Any, key: str, kinds: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            errs.append(f"{where}: missing {key!r}")
            return None
        if not isinstance(obj[key], kinds):
            errs.append(f"{where}.{key}: expected {kinds}, got {type(obj[key]).__name__}")
            return None
        return obj[key]

    if need(doc, "schema", str, "$") not in (SCHEMA, None):
        errs.append(f"$.schema: expected {SCHEMA!r}")
    need(doc, "machine", dict, "$")
    need(doc, "started", str, "$")
    if need(doc, "mode", str, "$") not in (*MODES, None):
        errs.append("$.mode: unknown mode")
    benches = need(doc, "benchmarks", dict, "$") or {}
    for name, entry in benches.items():
        where = f"$.benchmarks.{name}"
        status = need(entry, "status", str, where)
        if status not in STATUSES:
            errs.append(f"{where}.status: {status!r} is not one of {STATUSES}")
        need(entry, "seconds", (int, float), where)
        if status == "ok":
            _check_reasons(need(entry, "results", dict, where), f"{where}.results", errs)
            for i, t in enumerate(need(entry, "tables", list, where) or []):
                tw = f"{where}.tables[{i}]"
                cols = need(t, "columns", list, tw)
                for j, row in enumerate(need(t, "rows", list, tw) or []):
                    if cols is not None and (not isinstance(row, list) or len(row) != len(cols)):
                        errs.append(f"{tw}.rows[{j}]: expected {len(cols)} cells")
            need(entry, "notes", list, where)
        else:
            need(entry, "reason", str, where)
    return errs


def _check_reasons(value: Any, where: str, errs: list[str]) -> None:
    """Every "skipped" or "error" in a benchmark's results (a part's, a row's) is a reason
    someone can read: a non-empty string."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("skipped", "error") and not (isinstance(item, str) and item.strip()):
                errs.append(f"{where}.{key}: expected a reason (a non-empty string), "
                            f"got {item!r}"[:200])
            else:
                _check_reasons(item, f"{where}.{key}", errs)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_reasons(item, f"{where}[{i}]", errs)


def jsonable(value: Any) -> Any:
    """Plain JSON types only (NaN becomes null)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Table):
        return value.as_dict()
    return str(value)


# --- plotting ------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def share(counts: Iterable[int]) -> list[float]:
    counts = list(counts)
    total = sum(counts) or 1
    return [c / total for c in counts]
