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


@pytest.mark.parametrize("splice", ["auto", "trap"])
def test_a_wildcard_counts_every_matching_function(capsys, toy_path, splice):
    status, report = run_count(capsys, "vfs_*", "--splice", splice)
    names = {r["function"] for r in report["rows"]}
    assert {"vfs_read", "vfs_write", "vfs_llseek"} <= names
    assert all(n.startswith("vfs_") for n in names | set(report["skipped"]))
    assert all(r["count"] == r["oracle"] for r in report["rows"]), report["rows"]
    assert sum(r["count"] for r in report["rows"]) > 0 and status == 0
    status = main(["count", "vfs_*"])  # the per-function table
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["FUNCTION", "COUNT", "ORACLE", "TACTIC"]
    assert "vfs_read" in out and status == 0


def test_an_offset_and_an_address_name_one_instruction(capsys, toy_path):
    from ksim.kapi import Manager

    with Manager.attach("unicorn:toy") as m:
        fn = m.find_function("tcp_sync_mss")
        code = m.facts.function_code(m.entry_point(fn))
        second = code.insns[1].address
    _, by_offset = run_count(capsys, f"tcp_sync_mss+{second - fn.address:#x}")
    _, by_address = run_count(capsys, hex(second))
    assert by_offset["rows"][0]["function"] == f"tcp_sync_mss+{second - fn.address:#x}"
    assert by_offset["count"] == by_offset["oracle"] == by_address["count"] > 0


def test_a_wildcard_matching_nothing_is_an_error(capsys, toy_path):
    assert main(["count", "no_such_*"]) == 2
    assert "no_such_*" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(toy_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ksim", "funcs"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `ksim funcs | head -0`
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("ksim ")


@pytest.mark.parametrize("command", ["count", "trace", "demo", "kept", "testbed", "bench", "funcs"])
def test_help_is_plain_text_and_every_option_is_explained(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out
    from ksim.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        assert action.help, (command, action.option_strings or action.dest)
