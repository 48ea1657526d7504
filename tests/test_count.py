"""`ksim count` on unicorn:toy: jmp and trap give count == oracle on the hard cases."""

from __future__ import annotations

import json

import pytest

from ksim.cli import main
from ksim.images.toy import HARD_CASES

CASES = sorted({HARD_CASES[k][0] for k in ("short", "rip_relative_entry", "recursive",
                                            "syscall_only", "branch_near_entry")}
               | {"tcp_sync_mss"})


def run_count(capsys, *args: str) -> tuple[int, dict]:
    status = main(["count", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("splice", ["jmp", "trap"])
@pytest.mark.parametrize("function", CASES)
def test_count_equals_oracle(capsys, toy_path, function, splice):
    status, report = run_count(capsys, function, "--splice", splice, "--seed", "5")
    assert set(report) >= {"function", "target", "splice", "tactic", "count", "oracle"}
    assert report["target"] == "unicorn:toy" and report["splice"] == splice
    assert report["count"] == report["oracle"] > 0, report
    assert status == 0
    if splice == "trap":
        assert report["tactic"] == "trap"
    else:
        assert report["tactic"] in ("jmp", "jmp+displace", "springboard")


def test_counts_depend_on_the_seed(capsys, toy_path):
    _, a = run_count(capsys, "kmem_cache_alloc", "--seed", "1")
    _, b = run_count(capsys, "kmem_cache_alloc", "--seed", "2")
    assert a["count"] == a["oracle"] and b["count"] == b["oracle"]
    assert a["count"] != b["count"]


def test_unknown_function_suggests_names(capsys, toy_path):
    status = main(["count", "tcp_sync_ms", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 2 and out["error"] == "unknown-symbol"
    assert "tcp_sync_mss" in out["message"]
