"""The live part of ``ksim bench per-hit`` on the testbed, with no bpftrace to run:
the bpftrace rows are recorded as skipped with their reason and every other row keeps
its figures (before, a missing bpftrace turned the whole live part into one error and
the rows already measured were lost)."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.bench import bpftrace, perhit
from ksim.bench.common import SCHEMA, Context, machine_info, now_iso, validate
from ksim.live.testing import testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_per_hit_live_keeps_its_rows_without_bpftrace(testbed, tmp_path, monkeypatch):
    absent = tmp_path / "no-such-bpftrace"
    monkeypatch.setenv(bpftrace.BINARY_ENV, str(absent))
    results, tables, notes = perhit._live(Context(mode="quick", progress=False))
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == ["uninstrumented", "ksim jmp", "ksim trap", "kprobe int3",
                          "kprobe optimized (jump)", "kprobe at +0 (ftrace)",
                          "bpftrace kprobe count()", "bpftrace kfunc count()"]
    for name in ("ksim jmp", "ksim trap"):
        r = rows[name]
        assert "skipped" not in r and "error" not in r, r
        assert r["min_cycles_per_call"] > 0 and r["overhead"] is not None
        assert r["hits"] >= r["calls"] * r["repeats"]  # other processes call getpid too
    for name in ("bpftrace kprobe count()", "bpftrace kfunc count()"):
        assert set(rows[name]) == {"variant", "skipped"}
        assert str(absent) in rows[name]["skipped"]
        assert any(n.startswith(f"live: {name}: skipped: ") for n in notes)
    # the section, as the runner writes it, follows the schema
    doc = {"schema": SCHEMA, "machine": machine_info(), "started": now_iso(), "mode": "quick",
           "benchmarks": {"per-hit": {"status": "ok", "seconds": 0.0, "params": {},
                                      "results": {"live": results},
                                      "tables": [t.as_dict() for t in tables], "notes": notes}}}
    assert validate(doc) == []
