"""The arm64 rows of ``ksim bench per-hit`` and ``ksim bench batch`` on the arm64
testbed, beside Debian's arm64 bpftrace in the same guest (small sizes: TCG emulating
AArch64 is slow).  Every count has its oracle: the guest program's getpid calls."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.bench import batch, perhit
from ksim.bench.common import Context
from ksim.live.testing import testbed_arm64  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]

CALLS, REPEATS = 2000, 1


def test_per_hit_rows_on_arm64(testbed_arm64):
    if testbed_arm64["standin"]:
        pytest.skip(f"the arm64 testbed runs the stand-in: {testbed_arm64['standin']}")
    results, tables, notes = perhit._live(Context(mode="quick", progress=False), "arm64",
                                          sizes=(CALLS, REPEATS))
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == ["uninstrumented", "ksim jmp", "ksim trap", "kprobe BRK",
                          "bpftrace kprobe count()", "bpftrace kfunc count()"]
    assert results["kernel"].endswith("-arm64") and "CNTVCT_EL0" in tables[0].title
    assert rows["ksim jmp"]["tactic"] == "jmp" and rows["ksim trap"]["tactic"] == "trap"
    for name in ("ksim jmp", "ksim trap", "kprobe BRK"):
        r = rows[name]
        assert "error" not in r and "skipped" not in r, r
        assert r["min_cycles_per_call"] > 0 and r["overhead"] is not None
        # each getpid calls __task_pid_nr_ns once; other processes call getpid too
        assert r["hits"] >= CALLS * REPEATS, r
    bt = rows["bpftrace kprobe count()"]
    if "skipped" not in bt:  # the guest's userland has bpftrace (up --with bpftrace)
        assert "error" not in bt, bt
        assert bt["bpftrace"].startswith("/") and bt["hits"] >= CALLS * REPEATS, bt
    assert any(n.startswith("live_arm64: ") for n in notes)


def test_batch_rows_on_arm64(testbed_arm64):
    if testbed_arm64["standin"]:
        pytest.skip(f"the arm64 testbed runs the stand-in: {testbed_arm64['standin']}")
    ctx = Context(mode="smoke", progress=False)
    with ctx.bar(8, "batch") as bar:
        live = batch._live(ctx, bar, "arm64", sizes=[5], routes=0)
    assert live["arch"] == "arm64" and live["kernel"].endswith("-arm64")
    rows = {r["tool"]: r for r in live["rows"]}
    assert set(rows) == set(batch.TOOLS)
    for tool in ("ksim-jmp", "ksim-trap"):
        r = rows[tool]
        assert r["status"] == "ok" and r["n"] == 5 and r["text_restored"] is True, r
    assert rows["bpftrace-kprobe"]["n"] == 5
    dispatch = live["trap_dispatch"]
    assert dispatch["function"] == "__arm64_sys_getpid"
    assert [x["routes"] for x in dispatch["rows"]] == [0, 1, 1]
    tables = batch._live_tables(live)
    assert "CNTVCT_EL0" in tables[1].title
