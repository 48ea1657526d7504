"""`ksim trace` on a fleet: one program on many hosts, maps merged, served to Prometheus.

Merging (ksim.trace.fleet) is checked against its definition: merged maps are the
maps of the union of the hosts' samples (hypothesis: counts, sums, min, max, avg,
stats, hist and lhist), and merging is associative and commutative.  A fleet of
emulated toy kernels runs the whole command: two hosts with the same seed see the
same workload, so every merged aggregate is twice one host's (an average the
same), a host per host (--by-host) prints exactly what the host alone prints, and a
host that cannot be reached is reported while the other's maps are printed.  The
Prometheus endpoint is scraped with a plain HTTP GET (urllib) and its text parsed:
its numbers are the maps'.  On the live testbed, a fleet of two guests: the merged
count is the sum of the two kernels' own kprobes' hits, and so is the scrape's.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import os
import re
import socket
import urllib.request
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksim.cli import main
from ksim.live.testing import testbed  # noqa: F401
from ksim.trace.fleet import (
    Fleet,
    Host,
    MapSnapshot,
    Options,
    hosts,
    map_output,
    merge_snapshots,
    parse_targets,
    read_fleet,
)
from ksim.trace.maps import HIST_BUCKETS, MASK, MapLayout, MapType, encode_extreme, scalar
from ksim.trace.prometheus import Exporter, metric_name
from ksim.trace.session import bucket

LHIST = (0, 100, 10)
KINDS = ("count", "sum", "min", "max", "avg", "stats", "hist", "lhist")


# --- merging, by its definition ----------------------------------------------------------
def aggregate(kind: str, samples: Sequence[int]) -> list[int]:
    """The value words a map of ``kind`` holds after ``samples`` (as the kernel's code
    updates it: maps.py's module doc)."""
    if kind == "count":
        return [len(samples)]
    if kind == "sum":
        return [sum(samples) & MASK]
    if kind in ("min", "max"):
        best = (min if kind == "min" else max)(samples)
        return [encode_extreme(kind, best)]
    if kind in ("avg", "stats"):
        return [sum(samples) & MASK, len(samples)]
    lay = layout(kind)
    words = [0] * lay.type.value_words
    for s in samples:
        words[bucket(lay, s)] += 1
    return words


def layout(kind: str) -> MapLayout:
    base = "avg" if kind == "stats" else kind
    return MapLayout(MapType("@m", ("int",), base, LHIST if kind == "lhist" else None,
                             kind == "stats"), 0)


def snap_of(kind: str, samples: dict[int, list[int]]) -> MapSnapshot:
    """A host's map of ``kind`` keyed by an integer, after each key's samples."""
    base = "avg" if kind == "stats" else kind
    return MapSnapshot("@m", base, ("int",), LHIST if kind == "lhist" else None,
                       kind == "stats",
                       {(k,): aggregate(kind, v) for k, v in samples.items() if v})


values = st.integers(min_value=-(1 << 40), max_value=1 << 40)
host_samples = st.dictionaries(st.integers(0, 4), st.lists(values, min_size=1, max_size=8),
                               max_size=4)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS), fleet=st.lists(host_samples, min_size=1, max_size=4))
def test_merged_maps_are_the_maps_of_every_hosts_samples(kind, fleet) -> None:
    """Counts and sums add, min and max are the fleet's, avg and stats are the
    total's (sum and count, not an average of averages), hist and lhist are the
    histogram of the union of the samples."""
    merged = merge_snapshots([snap_of(kind, h) for h in fleet])
    union: dict[int, list[int]] = {}
    for h in fleet:
        for k, v in h.items():
            union.setdefault(k, []).extend(v)
    assert merged.entries == snap_of(kind, union).entries


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS), a=host_samples, b=host_samples, c=host_samples)
def test_merging_is_associative_and_commutative(kind, a, b, c) -> None:
    x, y, z = (snap_of(kind, h) for h in (a, b, c))
    left = merge_snapshots([merge_snapshots([x, y]), z]).entries
    right = merge_snapshots([x, merge_snapshots([y, z])]).entries
    assert left == right == merge_snapshots([z, x, y]).entries == merge_snapshots([y, z, x]).entries


def test_an_average_is_the_totals_not_an_average_of_averages() -> None:
    merged = merge_snapshots([snap_of("avg", {0: [1]}), snap_of("avg", {0: [10, 10, 10]})])
    assert scalar("avg", merged.entries[(0,)]) == 31 // 4     # not (1 + 10) / 2
    out = map_output(merge_snapshots([snap_of("stats", {0: [1]}),
                                      snap_of("stats", {0: [10, 10, 10]})]))
    assert out is not None and out.text == "@m[0]: count 4, average 7, total 31\n\n"


def test_an_assigned_value_is_the_last_hosts() -> None:
    a = MapSnapshot("@m", "int", ("int",), entries={(1,): [5], (2,): [7]})
    b = MapSnapshot("@m", "int", ("int",), entries={(1,): [9]})
    assert merge_snapshots([a, b]).entries == {(1,): [9], (2,): [7]}


def test_targets_and_fleet_files_name_hosts(tmp_path) -> None:
    assert [h.label for h in hosts(parse_targets("live://a:1, live://b:2,live://a:1"))] == \
        ["a:1", "b:2", "a:1#2"]
    f = tmp_path / "fleet"
    f.write_text("# the fleet\nlive://10.0.0.1:7070 /etc/t1\n\n10.0.0.2:7070   # no token\n"
                 "unicorn:toy\n")
    assert read_fleet(str(f)) == [("live://10.0.0.1:7070", "/etc/t1"),
                                  ("live://10.0.0.2:7070", None), ("unicorn:toy", None)]


@pytest.mark.parametrize("source", ["/dev/zero", "long"])
def test_a_fleet_file_longer_than_the_bound_is_a_trace_limit(tmp_path, capsys, source) -> None:
    """/dev/zero was read until a MemoryError; a file is read up to the bound, then
    refused with its name."""
    from ksim.trace.fleet import MAX_FLEET_BYTES

    if source == "long":
        path = tmp_path / "fleet"
        path.write_text("unicorn:toy\n" + "\n" * MAX_FLEET_BYTES)
        source = str(path)
    assert main(["trace", "-e", "BEGIN { exit(); }", "--fleet", source, "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] == "trace-limit"
    assert f"the fleet file {source} is longer than {MAX_FLEET_BYTES:,} bytes" in doc["message"]
    fits = tmp_path / "fits"
    fits.write_text("unicorn:toy" + " " * (MAX_FLEET_BYTES - 11))
    assert read_fleet(str(fits)) == [("unicorn:toy", None)]


def test_a_fifo_without_a_writer_is_a_fleet_of_no_host(tmp_path) -> None:
    """open() waited for a writer forever (the command hung); it reads as empty."""
    from ksim.trace.errors import TraceError

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TraceError, match="names no host"):
        read_fleet(str(fifo))
    with pytest.raises(TraceError, match="cannot read the fleet file"):
        read_fleet(str(tmp_path))


# --- a fleet of emulated kernels ----------------------------------------------------------
PROGRAM = """kprobe:vfs_read { @reads[comm] = count(); @bytes = sum(arg2); @lo = min(arg2);
@hi = max(arg2); @avg = avg(arg2); @st = stats(arg2); @h = hist(arg2);
@l = lhist(arg2, 0, 1000, 100); printf("read %d\\n", arg2); }
END { printf("end\\n"); }"""
RUN = ["--seed", "3", "--iterations", "200"]


def trace_out(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["trace", "-e", PROGRAM, *RUN, *args])
    out, err = capsys.readouterr()
    return status, out, err


def blocks(text: str) -> dict[str, str]:
    """A trace's output's maps, by name (each map's lines up to its blank line)."""
    out = {}
    for block in text.split("\n\n"):
        lines = block.splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("@")), None)
        if at is not None:
            out[lines[at].split("[")[0].split(":")[0]] = "\n".join(lines[at:])
    return out


def test_a_fleet_of_two_prints_merged_maps_and_prefixed_events(capsys) -> None:
    status, one, _ = trace_out(capsys)
    assert status == 0
    status, two, _ = trace_out(capsys, "--target", "unicorn:toy,unicorn:toy")
    assert status == 0
    single, merged = blocks(one), blocks(two)
    assert set(single) == set(merged)
    # the same workload on both: every aggregate doubled, extremes and averages the same
    reads = [line for line in one.splitlines() if line.startswith("read ")]
    assert [line for line in two.splitlines() if line.startswith("[unicorn:toy] read")] == \
        ["[unicorn:toy] " + line for line in reads]
    assert [line for line in two.splitlines() if line.startswith("[unicorn:toy#2] read")] == \
        ["[unicorn:toy#2] " + line for line in reads]
    assert two.count("\nend\n") == 1           # END printed the same line on both: once
    for name in ("@lo", "@hi", "@avg"):
        assert merged[name] == single[name]
    count, avg, total = (int(x) for x in re.findall(r"-?\d+", single["@st"]))
    assert merged["@st"] == f"@st: count {2 * count}, average {avg}, total {2 * total}"
    n = int(single["@bytes"].split(": ")[1])
    assert merged["@bytes"] == f"@bytes: {2 * n}"
    for line in merged["@reads"].splitlines():
        key, value = line.rsplit(": ", 1)
        assert f"{key}: {int(value) // 2}" in single["@reads"].splitlines()
    for name in ("@h", "@l"):
        rows = [r.split("|")[0].split() for r in single[name].splitlines()[1:]]
        mrows = [r.split("|")[0].split() for r in merged[name].splitlines()[1:]]
        assert [r[:-1] for r in mrows] == [r[:-1] for r in rows]
        assert [int(r[-1]) for r in mrows] == [2 * int(r[-1]) for r in rows]


def test_by_host_prints_each_hosts_maps_as_it_alone_prints_them(capsys) -> None:
    _, one, _ = trace_out(capsys)
    _, by_host, _ = trace_out(capsys, "--target", "unicorn:toy,unicorn:toy", "--by-host")
    for label in ("unicorn:toy", "unicorn:toy#2"):
        mine = "".join(line[len(label) + 3:] if line.startswith(f"[{label}] ") else line
                       for line in by_host.splitlines(keepends=True)
                       if line.startswith(f"[{label}] @") or line.startswith(f"[{label}] [")
                       or line.startswith(f"[{label}] (") or line == "\n")
        maps = "".join(b + "\n\n" for b in blocks(one).values())
        assert blocks(mine) == blocks(maps)


def test_one_target_with_prometheus_prints_what_it_prints_without(capsys) -> None:
    status, plain, _ = trace_out(capsys)
    status2, served, err = trace_out(capsys, "--prometheus", "127.0.0.1:0")
    assert status == status2 == 0
    assert served == plain and "serving Prometheus metrics at http://127.0.0.1:" in err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_host_that_is_down_is_reported_and_the_others_maps_printed(capsys) -> None:
    _, one, _ = trace_out(capsys)
    down = f"127.0.0.1:{closed_port()}"
    status, out, err = trace_out(capsys, "--target", f"unicorn:toy,live://{down}")
    assert status == 1
    assert f"ksim: host {down} failed (connect): cannot reach kerninstd" in err
    assert f"1 of 2 hosts failed: {down}" in err
    assert blocks(out) == blocks(one)
    status = main(["trace", "-e", PROGRAM, *RUN, "--json", "--target", f"unicorn:toy,live://{down}"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [r for r in records if r["type"] == "host_error"]
    assert status == 1 and errors == [{"type": "host_error", "host": down, "target": f"live://{down}",
                                       "stage": "connect", "error": "target-died",
                                       "message": errors[0]["message"]}]
    summary = next(r["data"] for r in records if r["type"] == "summary")
    assert [f["host"] for f in summary["failed"]] == [down]
    assert list(summary["hosts"]) == ["unicorn:toy"]
    assert summary["maps"] == summary["hosts"]["unicorn:toy"]["maps"]


def test_every_host_down_is_status_2(capsys) -> None:
    a, b = closed_port(), closed_port()
    assert main(["trace", "-e", PROGRAM, "--target",
                 f"live://127.0.0.1:{a},live://127.0.0.1:{b}"]) == 2


# --- Prometheus ----------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The endpoint's samples, by (name, labels), from a plain HTTP GET."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def fleet_run(specs: Sequence[str], exporter: Any, program: str = PROGRAM,
              **options: Any) -> Any:
    fleet = Fleet(program, hosts([(s, None) for s in specs]), exporter=exporter,
                  options=Options(**options))
    return fleet.run()


def test_the_endpoint_serves_every_hosts_maps_as_metrics() -> None:
    with Exporter("127.0.0.1:0") as exp:
        result = fleet_run(["unicorn:toy", "unicorn:toy"], exp, seed=3, iterations=200)
        samples = scrape(exp.url)
    assert not result.failed
    for run in result.ok:
        host = run.label
        final = run.final
        for (comm,), (n,) in final["@reads"].entries.items():
            assert samples[("ksim_trace_reads_total", (("host", host), ("key0", comm)))] == n
        assert samples[("ksim_trace_bytes", (("host", host),))] == \
            scalar("sum", final["@bytes"].entries[()])
        assert samples[("ksim_trace_lo", (("host", host),))] == \
            scalar("min", final["@lo"].entries[()])
        assert samples[("ksim_trace_hi", (("host", host),))] == \
            scalar("max", final["@hi"].entries[()])
        total, count = final["@avg"].entries[()]
        assert samples[("ksim_trace_avg_sum", (("host", host),))] == total
        assert samples[("ksim_trace_avg_count", (("host", host),))] == count
        words = final["@h"].entries[()]
        assert samples[("ksim_trace_h_count", (("host", host),))] == sum(words) == count
        running = 0.0
        for i in range(HIST_BUCKETS - 1):     # bucket i holds [2**(i-2), 2**(i-1)): le its top
            running += words[i]
            le = str(-1 if i == 0 else 0 if i == 1 else (1 << (i - 1)) - 1)
            assert samples[("ksim_trace_h_bucket", (("host", host), ("le", le)))] == running
        assert samples[("ksim_trace_h_bucket", (("host", host), ("le", "+Inf")))] == count
        lwords = final["@l"].entries[()]
        assert samples[("ksim_trace_l_bucket", (("host", host), ("le", "+Inf")))] == sum(lwords)
        assert samples[("ksim_trace_l_bucket", (("host", host), ("le", "99")))] == \
            sum(lwords[:2])
    # summed over the hosts, the merged map
    merged = result.maps["@reads"].entries
    for (comm,), (n,) in merged.items():
        assert sum(v for (name, labels), v in samples.items()
                   if name == "ksim_trace_reads_total" and ("key0", comm) in labels) == n
    assert metric_name("@") == "ksim_trace" and metric_name("@a.b") == "ksim_trace_a_b"


# --- the live testbed: two guests -------------------------------------------------------------
# a system call nothing else in the guests makes (the testbed is shared: other
# programs call getppid), so that the kernels' kprobes count only the workload's
FUNC = "__x64_sys_getsid"
CALLS = 2000
GETSID_LOOP = r"""
#include <stdlib.h>
#include <unistd.h>
/* Calls getsid(0) exactly N times. */
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, i, s = 0;
    for (i = 0; i < n; i++)
        s += getsid(0);
    return s == 0;
}
"""


def getsid_loop() -> str:
    from ksim.live.testing import program

    return str(program("ksimfleet", GETSID_LOOP))


@pytest.mark.live
@pytest.mark.slow
def test_a_fleet_of_two_guests_counts_what_their_kprobes_count(testbed) -> None:
    from ksim.live.testing import connect, instance_testbed

    loop = getsid_loop()
    with instance_testbed("fleet", port=7074) as second:
        beds = {"127.0.0.1:7070": testbed, f"127.0.0.1:{second['port']}": second}
        clients = {label: connect(bed) for label, bed in beds.items()}
        oracles = {label: t.oracle_counter(t.lookup(FUNC)) for label, t in clients.items()}
        try:
            fleet = Fleet(f"kprobe:{FUNC} {{ @calls = count(); @by[comm] = count(); }}",
                          [Host(label, bed["address"], bed["token_file"])
                           for label, bed in beds.items()],
                          options=Options(while_cmd=f"{loop} {CALLS}"))
            with Exporter("127.0.0.1:0") as exp:
                fleet.exporter = exp
                result = fleet.run()
                samples = scrape(exp.url)
        finally:
            hits = {label: o.count for label, o in oracles.items()}
            for label, o in oracles.items():
                o.close()
                clients[label].close()
    assert not result.failed, result.summary()["failed"]
    assert all(n >= CALLS for n in hits.values()), hits
    merged = result.summary()["maps"]
    assert merged["@calls"] == sum(hits.values())
    assert merged["@by"] == {"ksimfleet": 2 * CALLS}
    for label, n in hits.items():
        assert samples[("ksim_trace_calls_total", (("host", label),))] == n
    assert sum(v for (name, _), v in samples.items() if name == "ksim_trace_calls_total") == \
        merged["@calls"]


@pytest.mark.live
@pytest.mark.slow
def test_a_guest_down_is_reported_and_the_other_guests_maps_printed(testbed, capsys) -> None:
    down = f"127.0.0.1:{closed_port()}"
    status = main(["trace", "-e", f"kprobe:{FUNC} {{ @calls = count(); }}", "--while",
                   f"{getsid_loop()} 100", "--target", f"{testbed['address']},live://{down}"])
    out, err = capsys.readouterr()
    assert status == 1
    assert f"ksim: host {down} failed (connect)" in err
    assert "[127.0.0.1:7070] Attaching 1 probe...\n" in out
    assert int(out.split("@calls: ")[1].split()[0]) >= 100


@pytest.mark.live
@pytest.mark.slow
def test_a_guest_that_goes_away_mid_run_is_reported_and_the_other_goes_on(testbed) -> None:
    """kerninstd of the second guest is killed while the fleet runs (its /init starts
    another): that host fails in its run, the first runs on until stopped and its
    maps are the fleet's."""
    import threading
    import time

    from ksim.live.testing import connect, instance_testbed, restart_kerninstd

    with instance_testbed("fleet", port=7074) as second:
        fleet = Fleet(f"kprobe:{FUNC} {{ @calls = count(); }}",
                      [Host("a", testbed["address"], testbed["token_file"]),
                       Host("b", second["address"], second["token_file"])])
        out: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: out.setdefault("result", fleet.run()))
        runner.start()
        try:
            deadline = time.monotonic() + 120
            while any(r.state != "attached" for r in fleet.runs):
                assert time.monotonic() < deadline and runner.is_alive()
                time.sleep(0.2)
            restart_kerninstd(connect(second), second).close()
            while fleet.runs[1].state != "failed":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            a = connect(testbed)
            try:
                a.run(while_cmd=f"{getsid_loop()} 100")
            finally:
                a.close()
        finally:
            fleet.stop.set()
            runner.join(120)
    result = out["result"]
    assert [r.label for r in result.failed] == ["b"] and result.status == 1
    failure = result.summary()["failed"][0]
    assert failure["stage"] == "run" and failure["error"] == "target-died", failure
    assert result.summary()["maps"]["@calls"] >= 100


def test_a_host_that_refuses_the_program_is_reported_and_the_others_run(capsys) -> None:
    """The arm64 toy kernel has no __x64_sys_getppid: that host refuses the program
    when it attaches; the x86-64 one runs it."""
    status = main(["trace", "-e", "kprobe:__x64_sys_getppid { @ = count(); } END { print(1); }",
                   *RUN, "--json", "--target", "unicorn:toy,unicorn:toy-arm64"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [r for r in records if r["type"] == "host_error"]
    assert status == 1
    assert [(e["host"], e["stage"], e["error"]) for e in errors] == \
        [("unicorn:toy-arm64", "attach", "trace-semantic")]
    assert "unknown function or symbol '__x64_sys_getppid'" in errors[0]["message"]
    assert {"type": "value", "data": 1} in records       # END ran on the other host
    summary = next(r["data"] for r in records if r["type"] == "summary")
    assert list(summary["hosts"]) == ["unicorn:toy"]


def test_a_fleet_file_names_the_hosts(tmp_path, capsys) -> None:
    _, one, _ = trace_out(capsys)
    fleet = tmp_path / "hosts"
    fleet.write_text("unicorn:toy\nunicorn:toy   # the same kernel twice\n")
    status, two, _ = trace_out(capsys, "--fleet", str(fleet))
    assert status == 0
    assert int(blocks(two)["@bytes"].split(": ")[1]) == 2 * int(blocks(one)["@bytes"].split(": ")[1])


@pytest.mark.live
@pytest.mark.slow
def test_a_fleets_intervals_print_merged_windows_that_add_up_to_the_kprobes(testbed, capsys) -> None:
    """Each interval prints the fleet's count of its window and clears it on every
    host: the windows and the end add up to the two kernels' kprobes' hits."""
    from ksim.live.testing import connect, instance_testbed

    with instance_testbed("fleet", port=7074) as second:
        beds = (testbed, second)
        clients = [connect(bed) for bed in beds]
        oracles = [t.oracle_counter(t.lookup(FUNC)) for t in clients]
        try:
            status = main(["trace", "-e", f"kprobe:{FUNC} {{ @calls = count(); }} "
                           "interval:ms:300 { time(\"tick\\n\"); print(@calls); clear(@calls); }",
                           "--while", f"{getsid_loop()} {CALLS}; sleep 1; {getsid_loop()} {CALLS}",
                           "--target", ",".join(bed["address"] for bed in beds)])
        finally:
            hits = [o.count for o in oracles]
            for o, t in zip(oracles, clients, strict=True):
                o.close()
                t.close()
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert all(not line.startswith("[") or line.endswith(" probes...") for line in lines), out
    windows = [int(line.split(": ")[1]) for line in lines if line.startswith("@calls: ")]
    assert sum(windows) == sum(hits) == 4 * CALLS, (windows, hits)
    # one tick and one merged @calls per window (the client's clock), not per host,
    # then END's; how many windows a second and a half hold depends on how long a
    # window's reads of two emulated kernels take
    shown = [line for line in lines if line == "tick" or line.startswith("@calls: ")]
    windows_seen = shown.count("tick")
    assert windows_seen >= 2, shown
    assert all(shown[2 * k] == "tick" and shown[2 * k + 1].startswith("@calls: ")
               for k in range(windows_seen)) and len(shown) == 2 * windows_seen + 1, shown


def test_ctrl_c_stops_every_host_and_the_merged_maps_print() -> None:
    """SIGINT while two emulated kernels run a long workload: every host stops,
    detaches and runs END, the merged maps print, and the status is 130."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "ksim", "trace", "-e",
         'kprobe:vfs_read { @ = count(); } END { printf("end\\n"); }',
         "--iterations", "10000000", "--target", "unicorn:toy,unicorn:toy"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        attached = [proc.stdout.readline() for _ in range(2)]
        assert sorted(attached) == ["[unicorn:toy#2] Attaching 2 probes...\n",
                                    "[unicorn:toy] Attaching 2 probes...\n"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert out.startswith("end\n@: ") and int(out.split("@: ")[1]) > 0, out
