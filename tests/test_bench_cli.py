"""``ksim bench cli --quick`` on the live testbed: the one-function and ~100-function
traces, ``ksim trace`` as a subprocess beside bpftrace in the guest, follow the
results schema and draw their plot; without bpftrace its rows are recorded as
skipped with the reason and ksim's rows keep their figures."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import io
import json

import pytest

from ksim.bench import bpftrace, cli, runner
from ksim.bench.common import SCHEMA, Context, machine_info, now_iso, validate
from ksim.live.testing import testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]


def _check_ksim_rows(rows: list[dict]) -> None:
    for tool in ("ksim trace", "ksim trace, again"):
        _check_ksim_tool(rows, tool)


def _check_ksim_tool(rows: list[dict], tool: str) -> None:
    ksim = {r["case"]: r for r in rows if r["tool"] == tool}
    assert list(ksim) == list(cli.QUICK_CASES)
    for r in ksim.values():
        assert r["status"] == "ok", r
        assert r["end_to_end_s"] > r["attach_s"] + r["detach_s"] > 0
        assert r["attach_ms_per_probe"] == pytest.approx(1e3 * r["attach_s"] / r["n"])
        assert r["keys"] <= r["n"] and not r["lost"] and not r["lost_keys"]
    assert ksim["single"]["n"] == 1 and ksim["single"]["pattern"] == cli.SINGLE
    assert 50 <= ksim["~100"]["n"] <= 200


def test_cli_quick_follows_the_schema(testbed, tmp_path):
    json_path = tmp_path / "cli.json"
    text = io.StringIO()
    runner.run(["cli"], Context(mode="quick", progress=False), out=text,
               json_path=str(json_path), plot_path=str(tmp_path / "cli.png"))
    doc = json.loads(json_path.read_text())
    assert validate(doc) == []
    entry = doc["benchmarks"]["cli"]
    assert entry["status"] == "ok", (entry.get("reason"), entry.get("traceback"))
    assert (tmp_path / entry["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "== cli:" in text.getvalue()
    rows = entry["results"]["rows"]
    assert [(r["case"], r["tool"]) for r in rows] == [
        (case, tool) for case in cli.QUICK_CASES for tool in cli.TOOLS]
    _check_ksim_rows(rows)
    for r in rows:
        if r["tool"] == "bpftrace" and "skipped" not in r:
            assert r["status"] == "ok", r
            assert r["n"] >= 1 and r["end_to_end_s"] >= r["attach_s"] + r["detach_s"]
    summary = {s["case"]: s for s in entry["results"]["summary"]}
    assert set(summary) == set(cli.QUICK_CASES)
    # what each probe adds to the one-function command's attach, by the same tool
    row = {(r["case"], r["tool"]): r for r in rows}
    for tool, key in (("ksim trace", "ksim_beyond_single_ms_per_probe"),
                      ("ksim trace, again", "ksim_again_beyond_single_ms_per_probe")):
        many, one = row[("~100", tool)], row[("single", tool)]
        assert summary["~100"][key] == pytest.approx(
            1e3 * (many["attach_s"] - one["attach_s"]) / (many["n"] - one["n"]))
        assert summary["single"][key] is None


def test_cli_without_bpftrace_keeps_the_ksim_rows(testbed, tmp_path, monkeypatch):
    absent = tmp_path / "no-such-bpftrace"
    monkeypatch.setenv(bpftrace.BINARY_ENV, str(absent))
    section = cli.run(Context(mode="quick", progress=False))
    rows = section.results["rows"]
    _check_ksim_rows(rows)
    for r in (r for r in rows if r["tool"] == "bpftrace"):
        assert set(r) == {"tool", "case", "pattern", "n", "skipped"}
        assert str(absent) in r["skipped"]
    doc = {"schema": SCHEMA, "machine": machine_info(), "started": now_iso(), "mode": "quick",
           "benchmarks": {"cli": {"status": "ok", "seconds": 0.0, "params": section.params,
                                  "results": section.results,
                                  "tables": [t.as_dict() for t in section.tables],
                                  "notes": section.notes}}}
    assert validate(json.loads(json.dumps(doc))) == []
