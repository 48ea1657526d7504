"""ksim bench: a smoke run of every benchmark (tiny sizes, no timing assertions)
validates against the results schema; the pure parts (the paper's cost model, the
kallsyms decoder, padding trimming, refusal normalisation) are checked exactly."""

from __future__ import annotations

import io
import json
import shutil
import struct

import pytest

from ksim.bench import runner
from ksim.bench.common import SCHEMA, Context, Table, format_table, markdown_table, validate
from ksim.bench.corpus import trim_padding
from ksim.bench.coverage import normalize
from ksim.bench.kernel import _names, _token_table
from ksim.bench.offset import BASE_OFFSET, paper_costs
from ksim.cli import main

needs_tools = pytest.mark.skipif(
    not (shutil.which("gcc") and shutil.which("qemu-system-x86_64") and shutil.which("objdump")),
    reason="the smoke run builds the toy kernel and boots it in QEMU")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path = out / "results.json"
    text = io.StringIO()
    doc = runner.run(runner.names_for("all"), Context(mode="smoke", progress=False), out=text,
                     json_path=str(json_path), plot_path=str(out / "plot.png"))
    return doc, json.loads(json_path.read_text()), text.getvalue(), out


@needs_tools
def test_smoke_run_follows_the_schema(smoke):
    doc, on_disk, _text, _out = smoke
    assert validate(on_disk) == []
    assert on_disk["schema"] == SCHEMA and on_disk["mode"] == "smoke"
    assert set(on_disk["benchmarks"]) == set(runner.BENCHMARKS)
    for name, entry in on_disk["benchmarks"].items():
        assert entry["status"] in ("ok", "skipped"), (name, entry.get("reason"), entry.get("traceback"))


@needs_tools
def test_smoke_run_prints_tables_and_draws_plots(smoke):
    _doc, on_disk, text, out = smoke
    for name, entry in on_disk["benchmarks"].items():
        assert f"== {name}:" in text
        if entry["status"] == "ok":
            png = out / entry["plot"]
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_tools
def test_smoke_figures_are_consistent(smoke):
    _doc, on_disk, _text, _out = smoke
    b = on_disk["benchmarks"]
    toy = b["sizes"]["results"]["toy"]
    assert abs(sum(toy["length_share"].values()) - 1.0) < 1e-9
    cov = b["coverage"]["results"]["toy"]
    for kind in ("entry", "block", "insn"):
        assert abs(sum(cov["auto"][kind].values()) - 1.0) < 1e-9
    native = b["per-hit"]["results"]["native"]
    if "rows" in native:  # a counting splice counted every call
        assert all(r["counter_ok"] for r in native["rows"] if r.get("counter_ok") is not None)
    for run_ in b["batch"]["results"]["unicorn"]["runs"]:
        assert run_["text_restored"]


def test_validate_reports_problems():
    assert validate({}) != []
    doc = {"schema": SCHEMA, "machine": {}, "started": "t", "mode": "quick", "benchmarks": {
        "sizes": {"status": "ok", "seconds": 1.0, "results": {}, "notes": [],
                  "tables": [{"title": "t", "columns": ["a", "b"], "rows": [[1]]}]},
        "live": {"status": "skipped", "seconds": 0.0},
        "odd": {"status": "maybe", "seconds": 0.0, "reason": "?"}}}
    problems = validate(doc)
    assert any("rows[0]" in p for p in problems)
    assert any("live" in p and "reason" in p for p in problems)
    assert any("odd.status" in p for p in problems)


def test_cli_writes_json(tmp_path):
    path = tmp_path / "offset.json"
    assert main(["bench", "offset", "--smoke", "--no-progress", "--output", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert validate(doc) == [] and doc["benchmarks"]["offset"]["status"] == "ok"


def test_paper_model_follows_reach_of_each_jump_length():
    offsets = [0, 1000, 2**20]
    five = paper_costs({"5": 1.0}, offsets)
    assert five["jmp"] == [1.0, 1.0, 1.0] and five["trap"] == [19.0] * 3
    two = paper_costs({"2": 1.0}, offsets)
    assert two["jmp"] == [float(-(-(BASE_OFFSET + x) // 127)) for x in offsets]
    three = paper_costs({"3": 1.0}, [2**16])
    assert three["jmp"] == [float(-(-(BASE_OFFSET + 2**16) // (2**15 - 1)))]


def test_kallsyms_token_table_and_names_decode():
    tokens = [bytes([i]) if 0x20 < i < 0x7F else b"x%d" % i for i in range(256)]
    tokens[0x80] = b"sched"
    blob = b"\0".join(tokens) + b"\0"
    start = 64
    data = bytearray(start) + blob
    while len(data) % 8:
        data += b"\0"
    offsets, k = [], 0
    for t in tokens:
        offsets.append(k)
        k += len(t) + 1
    data += struct.pack("<256H", *offsets)
    at, found = _token_table(bytes(data))
    assert at == start and found == tokens
    names = bytes([3, ord("T"), 0x80, ord("_")]) + bytes([2, ord("t"), ord("a")])
    decoded, end = _names(names, 0, 2, found)
    assert decoded == [b"Tsched_", b"ta"] and end == len(names)


def test_trim_padding_cuts_trailing_int3_and_nops():
    ret = b"\xc3"
    code = b"\x48\x89\xf8" + ret + b"\xcc\xcc" + bytes.fromhex("0f1f440000") + b"\x90"
    assert trim_padding(code, 0x1000) == b"\x48\x89\xf8" + ret


def test_refusal_reasons_are_normalized():
    a = normalize("a branch lands inside the 5-byte window (at 0xffffffff81000123)")
    b = normalize("a branch lands inside the 5-byte window (at 0xffffffff81000456)")
    assert a == b and "ADDR" in a


def test_tables_format_as_text_and_markdown():
    t = Table("T", ["name", "value"], [["a", 1.23456], ["b", 12345]])
    text = format_table(t)
    assert "1.23" in text and "12,345" in text
    assert markdown_table(t).splitlines()[1] == "| --- | ---: |"


def test_source_file_runs_hold_their_functions():
    """The anchor runs (link order) put known functions in the right file and stop at
    the neighbours from other files (needs the Debian kernel already in the cache)."""
    from ksim.bench import kernel as kmod
    from ksim.bench.corpus import debian_sets

    if not kmod.is_cached():
        pytest.skip("the Debian kernel package is not in ~/.cache/ksim (ksim bench sizes fetches it)")
    sets = {cs.name: {f.name for f in cs.functions} for cs in debian_sets(kmod.debian_kernel())}
    assert {"__schedule", "schedule", "wake_up_process", "sched_setscheduler"} <= sets["kernel/sched/core.c"]
    assert {"kmem_cache_alloc", "kmem_cache_free", "__kmem_cache_create"} <= sets["mm/slub.c"]
    assert {"__alloc_pages", "get_page_from_freelist", "__free_pages"} <= sets["mm/page_alloc.c"]
    assert not {"update_min_vruntime", "__wait_on_bit_lock"} & sets["kernel/sched/core.c"]
    assert not {"folio_migrate_flags"} & sets["mm/slub.c"]
    assert not {"shuffle_pick_tail", "vfree"} & sets["mm/page_alloc.c"]
    assert "e100_probe" in sets["e100.ko"]


def test_cli_prints_json_like_every_command(tmp_path, capsys):
    path = tmp_path / "offset.json"
    assert main(["bench", "offset", "--smoke", "--no-progress", "--json", "-o", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert validate(printed) == [] and printed == json.loads(path.read_text())


# --- a row that cannot run is skipped with its reason; its section keeps the rest -------------
def test_a_missing_bpftrace_is_a_skipped_row(tmp_path, monkeypatch):
    """KSIM_BPFTRACE naming a file that does not exist: the bpftrace rows of per-hit are
    recorded as skipped, with the path in the reason, and nothing is raised."""
    from ksim.bench import bpftrace, perhit
    from ksim.bench.common import Skip

    absent = tmp_path / "no-such-bpftrace"
    monkeypatch.setenv(bpftrace.BINARY_ENV, str(absent))
    with pytest.raises(Skip, match="no-such-bpftrace"):
        bpftrace.binary()
    rows = [{"variant": "uninstrumented", "min_cycles_per_call": 30.0}]
    for kind in ("kprobe", "kfunc"):
        # the bpftrace rows need no target before they know there is no bpftrace
        perhit._row(rows, f"bpftrace {kind} count()",
                    lambda kind=kind: perhit._bpftrace_count(None, kind, "true"))
    assert rows[0] == {"variant": "uninstrumented", "min_cycles_per_call": 30.0}
    assert [r["variant"] for r in rows[1:]] == ["bpftrace kprobe count()", "bpftrace kfunc count()"]
    for r in rows[1:]:
        assert set(r) == {"variant", "skipped"} and str(absent) in r["skipped"]


def test_a_bpftrace_the_guest_cannot_see_is_skipped(tmp_path, monkeypatch):
    """An executable under /tmp exists on the host but not in the guest (its /tmp is a
    tmpfs of its own): skipped, saying so."""
    from ksim.bench import bpftrace
    from ksim.bench.common import Skip

    exe = tmp_path / "bpftrace"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    if not str(exe.resolve()).startswith("/tmp/"):
        pytest.skip("pytest's temporary directory is not under /tmp here")
    monkeypatch.setenv(bpftrace.BINARY_ENV, str(exe))
    with pytest.raises(Skip, match="under /tmp"):
        bpftrace.binary()


def test_validate_wants_a_reason_for_every_skipped_or_failed_row():
    def doc(rows):
        return {"schema": SCHEMA, "machine": {}, "started": "t", "mode": "quick", "benchmarks": {
            "per-hit": {"status": "ok", "seconds": 1.0, "tables": [], "notes": [],
                        "results": {"live": {"rows": rows}, "qemu": {"skipped": "no qemu"}}}}}

    good = [{"variant": "ksim jmp", "min_cycles_per_call": 60.0},
            {"variant": "bpftrace kfunc count()", "skipped": "bpftrace is not installed"},
            {"variant": "kprobe int3", "error": "TargetError: refused"}]
    assert validate(doc(good)) == []
    problems = validate(doc([{"variant": "a", "skipped": ""}, {"variant": "b", "error": None}]))
    assert len(problems) == 2
    assert "live.rows[0].skipped" in problems[0] and "live.rows[1].error" in problems[1]
