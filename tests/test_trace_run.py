"""How `ksim trace` runs a program and reports it: a program of BEGIN and END alone
runs its target's workload (or the --while command on a live kernel); --json writes
every output as a JSON lines record in the order it happened, then a summary and
the timings; errors name what is supported and where a cast is."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import time

import pytest
from test_trace import Hooks

from ksim.cli import main
from ksim.commands.trace import trace
from ksim.kapi import Manager
from ksim.live.testing import connect, testbed  # noqa: F401
from ksim.trace.output import record


def spy_runs(results: list):
    """An on_attach that keeps what each run of the session's Manager returned."""
    def attach(session) -> None:
        real = session.m.run

        def run(**options):
            results.append(real(**options))
            return results[-1]

        session.m.run = run

    return attach


def checksum(spec: str, seed: int) -> int:
    """The workload's checksum with nothing spliced (the oracle of a complete run)."""
    with Manager.attach(spec) as m:
        return m.run(seed=seed).checksum


@pytest.mark.parametrize("spec", ["unicorn:toy", pytest.param("qemu:toy", marks=pytest.mark.slow)])
def test_a_program_of_begin_and_end_alone_runs_the_workload(toy_path, spec):
    results: list = []
    report, text = trace('BEGIN { printf("start\\n"); } END { printf("done\\n"); }', spec,
                         on_attach=spy_runs(results), seed=7)
    assert text == "start\ndone\n" and report["probes"] == 0
    assert len(results) == 1 and results[0].checksum == checksum(spec, 7) is not None


def test_an_interval_program_alone_runs_its_intervals(toy_path):
    report, _ = trace("interval:us:1 { @ticks = count(); }", "unicorn:toy", seed=7,
                      run_options={"slices": [20_000] * 20})
    assert report["maps"]["@ticks"] >= 10


def test_exit_in_an_interval_ends_the_run(toy_path):
    """The second interval (the first only sets the clock) prints its name as
    bpftrace's probe builtin does, and the count so far, and exits: the run stops
    there, the count is the oracle's hits, and no probe counts after it."""
    hooks = Hooks(entry=lambda m, abi, site: 1)
    report, text = trace('kprobe:vfs_read { @n = count(); } '
                         'i:us:1 { printf("%s %d\\n", probe, @n); exit(); }', "unicorn:toy",
                         on_attach=hooks, run_options={"slices": [300_000] * 20})
    hits = len(hooks.seen["entry"])
    assert report["exited"] and text.startswith(f"interval:us:1 {hits}\n") and hits > 0
    assert report["maps"]["@n"] == hits
    _, full = trace("kprobe:vfs_read { @n = count(); }", "unicorn:toy")
    assert int(full.split()[-1]) > hits        # the whole run would have gone on


def test_while_is_refused_on_an_emulator_before_anything_is_spliced(capsys, toy_path):
    assert main(["trace", "-e", "kprobe:vfs_read { @ = count(); }", "--while", "true"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--while runs a command in a live kernel's guest" in err


PROGRAM = ('BEGIN { printf("begin\\n"); } '
           'kprobe:vfs_read { @reads = count(); @total = count(); printf("read %d\\n", arg2); } '
           'interval:us:1 { time("tick\\n"); print(@reads); clear(@reads); } '
           'END { printf("end\\n"); print(@total); }')


def test_every_output_is_reported_in_the_order_it_happened(toy_path):
    """On the emulator the kernel stands still while the client drains printf's
    events and runs interval actions, so each interval's print(@reads) equals the
    "read" lines printed since the one before, and each line is the oracle's hit."""
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx"))
    outputs: list = []
    report, text = trace(PROGRAM, "unicorn:toy", on_attach=hooks, out=outputs.append, seed=6,
                         run_options={"slices": [50_000] * 40})
    assert text == "".join(o.text for o in outputs)
    assert report["printf"] == [o.data for o in outputs if o.kind == "printf"]
    reads = [o.text for o in outputs if o.text.startswith("read ")]
    assert reads == [f"read {n}\n" for n in hooks.seen["entry"]] and len(reads) > 20
    assert outputs[0].text == "begin\n" and [o.kind for o in outputs].count("time") >= 5
    end = next(i for i, o in enumerate(outputs) if o.text == "end\n")
    assert outputs[end + 1].data == {"@total": len(reads)}           # END's print(@total)
    assert {o.kind for o in outputs[end + 1:]} == {"map"}              # then every map at exit
    since, printed = 0, 0
    for i, o in enumerate(outputs[:end]):
        if o.text.startswith("read "):
            since += 1
        elif o.kind == "time" and since:
            assert outputs[i + 1].data == {"@reads": since}            # print(@reads), then clear
            printed, since = printed + since, 0
    assert printed + since == len(reads) and printed > 0
    assert [record(o.kind, o.data) for o in outputs[:2]] == [
        {"type": "printf", "data": "begin\n"}, {"type": "printf", "data": reads[0]}]


def test_json_lines_carry_every_output_then_summary_and_stats(capsys, toy_path):
    start = time.perf_counter()
    assert main(["trace", "-e", PROGRAM, "--json", "--seed", "6"]) == 0
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    types = [r["type"] for r in records]
    assert records[0] == {"type": "attached_probes", "data": {"probes": 4}}
    assert records[1] == {"type": "printf", "data": "begin\n"}
    assert types[-2:] == ["summary", "stats"]
    summary, stats = records[-2]["data"], records[-1]
    reads = [r for r in records if r["type"] == "printf" and r["data"].startswith("read ")]
    assert len(reads) == len(summary["printf"]) - 2 > 20
    end = records.index({"type": "printf", "data": "end\n"})
    assert records[end + 1] == {"type": "map", "data": {"@total": len(reads)}}
    assert set(types[end + 1:-2]) == {"map"}
    assert set(stats) == {"type", "probes", "attach_s", "detach_s", "end_to_end_s"}
    assert stats["probes"] == summary["probes"] == 1
    assert 0 < stats["attach_s"] and 0 < stats["detach_s"]
    assert stats["attach_s"] + stats["detach_s"] < stats["end_to_end_s"] < wall


def test_vfsstat_reports_each_interval(toy_path):
    """bpftrace's vfsstat tool, its period made shorter than the toy workload: per
    interval a time record, then the map of the calls since the interval before,
    each equal to the oracle's hits between the two (the kernel stands still while
    the client prints)."""
    from test_trace import EXAMPLES

    source = (EXAMPLES / "tools" / "vfsstat.bt").read_text().replace("interval:s:1",
                                                                      "interval:us:1")
    hooks = Hooks(entry=lambda m, abi, site: site.function)
    records: list = []

    def out(o) -> None:
        records.append((record(o.kind, o.data), len(hooks.seen["entry"])))

    trace(source, "unicorn:toy", on_attach=hooks, out=out, run_options={"slices": [50_000] * 20})
    maps = [(r["data"]["@"], hits) for r, hits in records if r["type"] == "map"]
    times = [r for r, _ in records if r["type"] == "time"]
    assert len(maps) >= 5 and len(times) >= len(maps)
    before = 0
    for counts, hits in maps:
        expected = {}
        for name in hooks.seen["entry"][before:hits]:
            expected[name] = expected.get(name, 0) + 1
        assert counts == expected
        before = hits


def test_stats_are_printed_only_when_asked(capsys, toy_path):
    assert main(["trace", "-e", "kprobe:vfs_read { @ = count(); }"]) == 0
    assert "stats:" not in capsys.readouterr().err
    assert main(["trace", "-e", "kprobe:vfs_read { @ = count(); }", "--stats"]) == 0
    out, err = capsys.readouterr()
    line = next(x for x in err.splitlines() if x.startswith("stats: "))
    fields = dict(f.split("=") for f in line.split()[1:])
    assert fields["probes"] == "1" and set(fields) == {"probes", "attach_s", "detach_s",
                                                       "end_to_end_s"}
    assert float(fields["attach_s"]) > 0 and "stats" not in out


@pytest.mark.parametrize("program, message, where", [
    ("uprobe:/bin/sh:main { @ = count(); }",
     "uprobe probes are not supported: they instrument user space", "stdin:1:1-8"),
    ("kprobe:vfs_read { @[ustack] = count(); }", "ustack is not supported on this kernel: an "
     "emulated kernel runs no user space", "stdin:1:21-27"),
    ("kprobe:vfs_read { @ = path(arg1); }", "function path() is not supported", "stdin:1:23-27"),
])
def test_unsupported_constructs_are_named_and_placed(capsys, toy_path, program, message, where):
    assert main(["trace", "-e", program]) == 2
    err = capsys.readouterr().err
    assert f"{where}: ERROR: {message}" in err and "struct definitions" not in err


@pytest.mark.live
@pytest.mark.slow
def test_a_program_of_begin_and_end_alone_runs_the_while_command_live(testbed):
    marker = f"/tmp/ksim-trace-while-{time.monotonic_ns()}"
    report, text = trace('BEGIN { printf("start\\n"); } END { printf("done\\n"); }',
                         testbed["address"], while_cmd=f"echo ran > {marker}")
    assert text == "start\ndone\n" and not report["interrupted"]
    t = connect(testbed)
    try:
        assert t.exec_checked(f"cat {marker} && rm {marker}").strip() == "ran"
    finally:
        t.close()


def test_positional_parameters_and_the_exit_code(capsys, toy_path):
    """ARGs after the program are $1, $2 ($# how many; a missing one is 0), as
    bpftrace's; exit(code) is ksim trace's exit status."""
    assert main(["trace", "-e", 'BEGIN { printf("%d %s %d %d\\n", $1, str($2), $#, $3); '
                 'exit(7); }', "40", "two"]) == 7
    assert capsys.readouterr().out.splitlines()[-1] == "40 two 2 0"
    hooks_calls = []
    report, _ = trace("kprobe:vfs_read /arg2 > $1/ { exit(3); }", "unicorn:toy", params=("100",),
                      on_attach=lambda s: hooks_calls.append(s))
    assert report["exited"] and report["exit_code"] == 3
