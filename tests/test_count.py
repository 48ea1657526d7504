"""`ksim count` on unicorn:toy: jmp and trap give count == oracle on the hard cases."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.mark.parametrize("splice", ["auto", "jmp", "trap"])
def test_a_wildcard_is_planned_once_with_can_inserts_verdicts(capsys, toy_path, splice):
    """Every function of the toy under one wildcard: the batch plans each entry once
    and leaves out those it refuses; what is left out, and why, is exactly what
    spliceable_entries' dry runs (can_insert) say, and every count equals its oracle."""
    from ksim.kapi import Manager

    status, report = run_count(capsys, "*", "--splice", splice)
    with Manager.attach("unicorn:toy") as m:
        funcs = {f.name: f for f in m.target.image.functions}
        unique = sorted({f.address: f for f in funcs.values()}.values(), key=lambda f: f.address)
        found, refused = m.spliceable_entries(unique, splice)
        assert m.splices() == {}
    assert report["skipped"] == refused and refused
    assert {r["function"] for r in report["rows"]} == {f.name for f, _ in found}
    assert all(r["count"] == r["oracle"] for r in report["rows"]), report["rows"]
    assert status == 0


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


def _ksim_process(tmp_path, argv: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """The ``ksim`` executable's entry (ksim.cli.run) in a process of its own, after
    ``prelude``."""
    script = tmp_path / "entry.py"
    script.write_text(f"import sys\n{prelude}\nsys.argv = ['ksim', *{argv!r}]\n"
                      "from ksim.cli import run\nrun()\n")
    return subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)


def test_the_executable_ends_with_mains_output_status_and_exit_handlers(tmp_path, capsys,
                                                                        toy_path):
    """run() skips the interpreter's teardown, not what anyone sees of an exit: the
    output is main's, flushed; the status is main's; the exit handlers ran."""
    ran = tmp_path / "atexit-ran"
    proc = _ksim_process(tmp_path, ["funcs"], "import atexit\n"
                         f"atexit.register(lambda: open({str(ran)!r}, 'w').write('yes'))")
    assert main(["funcs"]) == 0
    assert proc.returncode == 0 and proc.stdout.decode() == capsys.readouterr().out
    assert ran.read_text() == "yes"
    refused = _ksim_process(tmp_path, ["no-such-command"])
    assert refused.returncode == 2 and b"invalid choice" in refused.stderr
    assert not refused.stdout


def test_the_executable_waits_for_a_thread_still_running(tmp_path):
    """A thread (not a daemon) still running when the command ends: the process exits
    as Python's does, after it."""
    done = tmp_path / "thread-done"
    proc = _ksim_process(tmp_path, ["--version"], "import threading, time\n"
                         "def late():\n    time.sleep(0.3)\n"
                         f"    open({str(done)!r}, 'w').write('yes')\n"
                         "threading.Thread(target=late).start()")
    assert proc.returncode == 0 and b"ksim" in proc.stdout
    assert done.read_text() == "yes"


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


# --- the point grammar: every bad FUNC is a point-syntax error, with JSON under --json ---------------
@pytest.mark.parametrize("what,words", [
    ("tcp_sync_mss+xyz", "the offset 'xyz' is not a number"),
    ("+08", "no function name before '+'"),
    ("+4+4", "no function name before '+'"),
    ("tcp_sync_mss+4+4", "one function and one offset only"),
    ("tcp_sync_mss+", "no offset after '+'"),
    ("tcp_sync_mss+08", "the offset '08' has a leading zero"),
    ("0x", "no hexadecimal digits after 0x"),
    ("0xZZ", "'0xZZ' is not hexadecimal"),
    ("0777", "'0777' has a leading zero"),
    ("1abc", "'1abc' is not a number"),
    ("0x1" + "0" * 16, "beyond 64 bits"),
    ("²", "neither an address nor a function's name"),
    ("tcp sync", "neither an address nor a function's name"),
    ("tcp_*+4", "a wildcard names functions' entries; it takes no +OFFSET"),
    ("0x10+4", "an address is given alone"),
    ("", "an empty point"),
    ("9" * 5000, "longer than any point"),
])
def test_a_point_off_the_grammar_is_a_point_syntax_error(capsys, what, words):
    status = main(["count", what])
    out, err = capsys.readouterr()
    assert status == 2 and not out and err.startswith("ksim: error: ") and words in err
    status, report = run_count(capsys, what)
    assert status == 2 and report["error"] == "point-syntax" and words in report["message"]


def test_an_offset_past_the_function_is_refused(capsys, toy_path):
    status, report = run_count(capsys, "tcp_sync_mss+0x10000")
    assert status == 2 and report["error"] == "outside-text" and "past the end" in report["message"]


def test_offsets_and_addresses_in_decimal_and_hexadecimal_name_the_same_point(capsys, toy_path):
    from ksim.commands.count import parse_point

    assert parse_point("tcp_sync_mss+0x10") == parse_point("tcp_sync_mss+16")
    assert parse_point("0X10").address == parse_point("16").address == 16
    assert parse_point("0").address == 0 and parse_point("vfs_*").wildcard
