"""``ksim funcs`` / ``ksim disasm`` / ``ksim points``: JSON and human output."""

from __future__ import annotations

import json

import pytest
from analysis_kernel import fixture_kernel, toy_kernel

from ksim.cli import main
from ksim.image import load_image


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, object]:
    status = main([*argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out)  # only JSON on stdout


def test_funcs_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, rows = run_json(capsys, "funcs", "--image", fixture_kernel())
    assert status == 0
    image = load_image(fixture_kernel())
    assert [r["name"] for r in rows] == [f.name for f in image.functions]
    row = next(r for r in rows if r["name"] == "add3")
    assert set(row) == {"name", "address", "size", "blocks", "module"}
    assert row["address"] == image.address_of("add3") and isinstance(row["address"], int)
    assert row["blocks"] == 1 and row["module"] == "vmlinux"


def test_funcs_match(capsys: pytest.CaptureFixture[str]) -> None:
    _status, rows = run_json(capsys, "funcs", "--image", fixture_kernel(), "--match", "classify*")
    assert sorted(r["name"] for r in rows) == ["classify", "classify_notrack", "classify_reg"]


def test_disasm_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = run_json(capsys, "disasm", "classify", "--image", fixture_kernel())
    assert status == 0 and doc["function"] == "classify"
    blocks = doc["blocks"]
    assert blocks[0]["start"] == doc["address"] and blocks[-1]["end"] == doc["address"] + doc["size"]
    starts = {b["start"] for b in blocks}
    assert all(s in starts for b in blocks for s in b["succs"])
    first = blocks[0]["instructions"][0]
    assert set(first) >= {"address", "bytes", "mnemonic", "op_str"}
    assert bytes.fromhex(first["bytes"])
    table_block = next(b for b in blocks if len(b["succs"]) == 9)  # the jump table
    assert table_block["instructions"][-1]["mnemonic"] == "jmp"


def test_points_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = run_json(capsys, "points", "tail_caller", "--image", fixture_kernel())
    assert status == 0
    image = load_image(fixture_kernel())
    func = image.function("tail_caller")
    assert doc["function"] == "tail_caller" and doc["entry"] == [func.address]
    assert set(doc) == {"function", "entry", "exits", "blocks", "callsites"}
    assert len(doc["exits"]) == 2 and len(doc["callsites"]) == 1  # a ret and a tail call
    assert all(func.address <= a < func.end for key in ("exits", "blocks", "callsites") for a in doc[key])


def test_unknown_function(capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = run_json(capsys, "points", "clasify", "--image", fixture_kernel())
    assert status == 2
    assert doc["error"] == "unknown-symbol" and "classify" in doc["message"]


def test_bad_image_path(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    junk = tmp_path / "junk.elf"
    junk.write_bytes(b"not an elf at all")
    status, doc = run_json(capsys, "funcs", "--image", str(junk))
    assert status == 2 and doc["error"] == "malformed-image"


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["funcs", "--image", fixture_kernel()]) == 0
    out = capsys.readouterr().out
    assert "classify" in out and "ADDRESS" in out and not out.lstrip().startswith("[")
    assert main(["disasm", "add3", "--image", fixture_kernel()]) == 0
    out = capsys.readouterr().out
    assert "block 0xffffffff" in out and "ret" in out
    assert main(["points", "add3", "--image", fixture_kernel()]) == 0
    out = capsys.readouterr().out
    assert "entry" in out and "exit" in out


@pytest.mark.skipif(toy_kernel() is None, reason="the toy kernel cannot be built yet")
def test_default_image_is_toy(capsys: pytest.CaptureFixture[str]) -> None:
    status, rows = run_json(capsys, "funcs")
    assert status == 0 and rows
    assert {r["name"] for r in rows} == {f.name for f in load_image(toy_kernel()).functions}
