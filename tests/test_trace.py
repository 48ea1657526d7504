"""`ksim trace` on unicorn:toy: every counting program's maps equal what exact
address hooks (the oracle, independent of splicing) saw at the same points."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ksim.cli import main
from ksim.commands.trace import trace

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def pid_of(machine, abi) -> int:
    task = int.from_bytes(machine.read(abi.current_task.address, 8), "little")
    return int.from_bytes(machine.read(task + abi.task_pid_offset, abi.task_pid_size), "little")


def signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


class Hooks:
    """Python hooks at the points a session spliced: ``seen[kind]`` gets one value per
    hit, computed by ``fn(machine, abi)`` at that point (before its snippet runs)."""

    def __init__(self, **fns) -> None:
        self.fns = fns
        self.seen: dict[str, list] = {kind: [] for kind in fns}

    def __call__(self, session) -> None:
        target = session.m.target
        for at in session.attached.values():
            fn = self.fns.get(at.site.kind)
            if fn is not None:
                target.machine.hook_code(
                    at.point.address,
                    lambda machine, _a, fn=fn, seen=self.seen[at.site.kind], site=at.site:
                    seen.append(fn(machine, target.abi, site)))


def run_trace(program: str, hooks: Hooks | None = None, **options) -> dict:
    report, _ = trace(program, "unicorn:toy", on_attach=hooks, **options)
    return report


def hist(values) -> list[dict]:
    """Power-of-two buckets as bpftrace's language defines them, computed here in the
    most direct way (not the trace code's)."""
    def index(v):
        if v < 0:
            return 0
        if v == 0:
            return 1
        i = 2
        while 1 << (i - 1) <= v:
            i += 1
        return i

    counts = Counter(index(v) for v in values)
    out = []
    for i in range(min(counts), max(counts) + 1):
        bounds = ({"max": -1} if i == 0 else {"min": 0, "max": 0} if i == 1 else
                  {"min": 1 << (i - 2), "max": (1 << (i - 1)) - 1})
        out.append({**bounds, "count": counts.get(i, 0)})
    return out


def test_count_per_function_equals_the_oracle(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: site.function)
    report = run_trace("kprobe:vfs_* { @[func] = count(); }", hooks, seed=5)
    expected = dict(Counter(hooks.seen["entry"]))
    assert report["maps"]["@"] == expected and len(expected) >= 3
    assert report["maps"]["@"]["vfs_read"] > 0 and report["lost"] == {}
    assert report["probes"] == len({s for s in hooks.seen["entry"]} | set(report["maps"]["@"]))


def test_count_per_pid_and_a_filter_equal_the_oracle(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: (pid_of(m, abi), m.reg("rdx")))
    report = run_trace("kprobe:vfs_read { @[pid] = count(); }\n"
                       "kprobe:vfs_read /pid == 3 && arg2 > 100/ { @big = count(); @bytes = sum(arg2); "
                       "@most = max(arg2); @least = min(arg2); @mean = avg(arg2); }", hooks)
    seen = hooks.seen["entry"]
    assert report["maps"]["@"] == {str(p): n for p, n in Counter(p for p, _ in seen).items()}
    big = [n for p, n in seen if p == 3 and n > 100]
    assert len(set(p for p, _ in seen)) > 2 and big
    assert report["maps"]["@big"] == len(big) and report["maps"]["@bytes"] == sum(big)
    assert report["maps"]["@most"] == max(big) and report["maps"]["@least"] == min(big)
    assert report["maps"]["@mean"] == sum(big) // len(big)


def test_a_return_histogram_equals_the_oracle(toy_path):
    hooks = Hooks(exit=lambda m, abi, site: signed(m.reg("rax")))
    report = run_trace("kretprobe:vfs_read, kretprobe:vfs_llseek { @ = hist(retval); "
                       "@l[func] = lhist(retval, 0, 500, 100); @r = count() }", hooks, seed=2)
    values = hooks.seen["exit"]
    assert report["maps"]["@r"] == len(values) > 0
    assert report["maps"]["@"] == hist(values)
    total = sum(b["count"] for key in report["maps"]["@l"].values() for b in key)
    assert total == len(values) and set(report["maps"]["@l"]) == {"vfs_read", "vfs_llseek"}


def test_many_keys_hash_into_the_table_without_loss(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: (pid_of(m, abi), m.reg("rdx")))
    report = run_trace("kprobe:vfs_read, kprobe:vfs_write { @[arg2] = count(); "
                       "@two[pid, arg2 & 7] = count(); }", hooks, seed=7)
    seen = hooks.seen["entry"]
    assert report["maps"]["@"] == {str(n): c for n, c in Counter(n for _, n in seen).items()}
    assert len(report["maps"]["@"]) > 50
    assert report["maps"]["@two"] == {f"{p},{n & 7}": c
                                      for (p, n), c in Counter((p, n & 7) for p, n in seen).items()}
    assert report["lost"] == {}


def test_a_full_table_counts_its_lost_updates(toy_path):
    """Every hit has its own key: the first max_map_keys keys are kept, and every
    update after the map is full is counted as lost."""
    hooks = Hooks(entry=lambda m, abi, site: 1)
    report = run_trace("config = { max_map_keys = 512 }\n"
                       "kprobe:kmem_cache_alloc { @[nsecs] = count(); }", hooks)
    hits = len(hooks.seen["entry"])
    kept = report["maps"]["@"]
    assert len(kept) == 512 and set(kept.values()) == {1}
    assert report["lost"]["@"] == hits - 512 > 0
    assert report["lost_keys"] == [{"map": "@", "lost": hits - 512, "keys": 512,
                                    "max_map_keys": 512, "full": True}]


def test_map_values_in_filters_time_a_function(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: 1)
    report = run_trace((EXAMPLES / "time_func.bt").read_text(), hooks, seed=3)
    calls = len(hooks.seen["entry"])
    assert sum(b["count"] for per_pid in report["maps"]["@ns"].values() for b in per_pid) == calls
    assert "@start" not in report["maps"]          # every start deleted at its return (empty: not printed)
    assert report["maps"]["@calls"] == calls


def test_exit_stops_the_updates(toy_path):
    report = run_trace("kprobe:vfs_read { @c = count(); if (@c >= 5) { exit(); } } "
                       "kprobe:vfs_write { @w = count(); }")
    assert report["exited"] and report["maps"]["@c"] == 5


def test_begin_end_print_clear_delete(capsys, toy_path):
    program = ("BEGIN { @start = 7; @k[1] = 1; @k[2] = 2; delete(@k[1]); } "
               "kprobe:vfs_read { @n = count(); @gone[pid] = count(); } "
               "END { print(@start + 1); print(@k); clear(@gone); @seen = @n > 0; }")
    assert main(["trace", "-e", program]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Attaching 3 probes..."  # as bpftrace counts: BEGIN, END and the kprobe
    n = next(line for line in out if line.startswith("@n: "))
    assert int(n.split()[-1]) > 0
    assert out[1:] == ["8", "@k[2]: 2", "", "@k[2]: 2", "", n, "", "@seen: 1", "", "@start: 7", ""]


def test_the_command_reads_files_and_prints_json(capsys, tmp_path, toy_path):
    prog = tmp_path / "prog.bt"
    prog.write_text("kprobe:vfs_read\n{\n  @[func] = count();\n}\n")
    assert main(["trace", str(prog), "--json", "--seed", "4", "--iterations", "500"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["type"] for r in records] == ["attached_probes", "map", "summary", "stats"]
    report = records[2]["data"]
    assert records[1]["data"] == {"@": report["maps"]["@"]}
    assert set(report["maps"]["@"]) == {"vfs_read"} and report["target"] == "unicorn:toy"
    assert sum(report["tactics"].values()) == report["probes"] == 1
    prog.write_text("kprobe:vfs_read\n{\n  @ = count()\n  @x = 1;\n}\n")
    assert main(["trace", str(prog)]) == 2
    err = capsys.readouterr().err
    assert f"{prog}:4:3-5: ERROR: syntax error, unexpected '@x', expecting ';' or '}}'" in err
    assert main(["trace", str(prog), "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert error["type"] == "error" and error["error"] == "trace-syntax"


@pytest.mark.parametrize("splice", ["jmp", "trap"])
def test_counts_match_ksim_count_under_both_tactics(capsys, toy_path, splice):
    assert main(["count", "kmem_cache_free", "--json", "--seed", "9"]) == 0
    count = json.loads(capsys.readouterr().out)["count"]
    report = run_trace("k:kmem_cache_free { @ = count(); }", seed=9, splice=splice)
    assert report["maps"]["@"] == count


def test_example_count_func_runs(capsys, toy_path):
    assert main(["trace", str(EXAMPLES / "count_func.bt")]) == 0
    out = capsys.readouterr().out
    assert "@calls[vfs_read]: " in out and "@calls[tcp_sendmsg]: " in out


def test_printf_events_are_drained_while_the_kernel_runs(capsys, toy_path):
    hooks = Hooks(entry=lambda m, abi, site: (site.function, pid_of(m, abi), m.reg("rdx")))
    report, text = trace('BEGIN { printf("tracing %s\\n", probe); } '
                         'kprobe:vfs_read, kprobe:vfs_write /arg2 > 300/ '
                         '{ printf("%-9s|%d|%5u|%x%%\\n", func, pid, arg2, arg2); }',
                         "unicorn:toy", on_attach=hooks, seed=6)
    expected = [f"{f:<9}|{p}|{n:5}|{n:x}%\n" for f, p, n in hooks.seen["entry"] if n > 300]
    assert report["printf"][0] == "tracing BEGIN\n" and report["lost_events"] == 0
    assert report["printf"][1:] == expected and len(expected) > 20
    assert text.startswith("tracing BEGIN\n" + expected[0])


def test_printf_counts_the_events_it_loses(toy_path):
    """One emulator slice for the whole run: the client drains only at its end, so
    the ring (sized by bpftrace's perf_rb_pages: 18 pages hold 1,024 records of 9 words)
    keeps its first events and counts the rest as lost."""
    hooks = Hooks(entry=lambda m, abi, site: 1)
    rings = []
    report = run_trace('config = { perf_rb_pages = 18 } '
                       'kprobe:kmem_cache_alloc, kprobe:kmem_cache_free, kprobe:memcpy '
                       '{ printf("%d %d\\n", nsecs, cpu); }',
                       lambda s: (hooks(s), rings.append(s.ring.records)),
                       run_options={"slices": [10**9]})
    hits = len(hooks.seen["entry"])
    assert rings == [1024]
    assert len(report["printf"]) == 1024 and report["lost_events"] == hits - 1024 > 0


def test_scratch_variables_start_at_zero_and_clear_keeps_constant_records(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx"))
    report = run_trace("BEGIN { @[1] = count(); clear(@); } "
                       "kprobe:vfs_read { if (@big[1] > 2) { $x = arg2 } @[1] = count(); "
                       "@big[1] = count(); @last = $x; }", hooks)
    assert report["maps"]["@"] == {"1": len(hooks.seen["entry"])} == report["maps"]["@big"]
    assert report["maps"]["@last"] == hooks.seen["entry"][-1]


def comm_of(machine, abi) -> str:
    task = int.from_bytes(machine.read(abi.current_task.address, 8), "little")
    return bytes(machine.read(task + abi.task_comm_offset, 16)).split(b"\0")[0].decode()


def test_comm_keys_filters_and_printf_equal_the_oracle(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: (site.function, comm_of(m, abi), pid_of(m, abi)))
    report = run_trace('kprobe:do_syscall_64 { @[comm] = count(); }\n'
                       'kprobe:__x64_sys_getpid /comm != "sshd"/ { @p[comm, pid] = count(); }\n'
                       'kprobe:__x64_sys_getpid /comm == "sshd"/ { @sshd = count(); }', hooks, seed=4)
    seen = hooks.seen["entry"]
    assert report["maps"]["@"] == dict(Counter(c for f, c, _ in seen if f == "do_syscall_64"))
    getpid = [(c, p) for f, c, p in seen if f == "__x64_sys_getpid"]
    assert report["maps"]["@p"] == dict(Counter(f"{c},{p}" for c, p in getpid if c != "sshd"))
    assert report["maps"]["@sshd"] == sum(1 for c, _ in getpid if c == "sshd") > 0
    assert len(report["maps"]["@"]) >= 3


def test_printf_prints_comm(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: (comm_of(m, abi), pid_of(m, abi)))
    report, text = trace('kprobe:__x64_sys_getpid { printf("%-12s|%d|%s\\n", comm, pid, func); }',
                         "unicorn:toy", on_attach=hooks, seed=6)
    assert report["printf"] == [f"{c:<12}|{p}|__x64_sys_getpid\n" for c, p in hooks.seen["entry"]]
    assert report["printf"]


@pytest.mark.parametrize("program, message", [
    ('kprobe:vfs_read { @ = comm + 1; }', "a value of type comm is not an integer here"),
    ('kprobe:vfs_read /comm < "a"/ { @ = count(); }', "a value of type comm is not an integer"),
    ('kprobe:vfs_read { $x = comm; $x = 1; }', "Type mismatch for $x"),
    ('kprobe:vfs_read { printf("%d\\n", comm); }', "%d specifier expects a value of type integer"),
    ('kprobe:vfs_read { @[comm] = count(); @[pid] = count(); }', "Argument mismatch for @"),
])
def test_comm_misuse_is_refused_with_a_position(capsys, toy_path, program, message):
    assert main(["trace", "-e", program]) == 2
    err = capsys.readouterr().err
    assert message in err and "stdin:1:" in err


def test_interval_probes_run_in_the_client_each_period(toy_path):
    """interval:ms:N actions run by the client once per period that has passed (by the
    host's clock, here given explicitly): time(), print() and clear() of a kernel map."""
    from ksim.kapi import Manager
    from ksim.trace.parser import parse
    from ksim.trace.session import TraceSession

    program = parse('kprobe:vfs_read { @reads = count(); }\n'
                    'interval:ms:10 { time("tick %S\\n"); print(@reads); clear(@reads); }')
    with Manager.attach("unicorn:toy") as m:
        s = TraceSession(m, program)
        hooks = Hooks(entry=lambda machine, abi, site: 1)
        s.attach()
        try:
            hooks(s)
            progress = s.progress()
            assert progress is not None
            s.run_intervals(now=0)            # the first call only sets the clock
            m.run(seed=3)
            s.run_intervals(now=5_000_000)    # half a period: nothing
            assert [k for k, _, _ in s.printed] == []
            s.run_intervals(now=10_000_000)
            assert [k for k, _, _ in s.printed] == ["time", "map"]
            assert s.printed[1][2] == {"@reads": len(hooks.seen["entry"])} and hooks.seen["entry"]
            assert s.maps_json() == {"@reads": 0}     # cleared: present at 0, as bpftrace
        finally:
            s.detach()


def test_bpftrace_tools_run_unchanged(capsys, toy_path):
    """bpftrace's own tools, as Debian ships them (#! line, comments, interval, time(),
    attach points the toy kernel lacks: skipped with a warning, as bpftrace does)."""
    for tool in ("vfsstat.bt", "biolatency-kp.bt"):
        assert main(["trace", str(EXAMPLES / "tools" / tool)]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("Attaching ") and "Hit Ctrl-C to end." in out
        assert "skipped kprobe:" in err


def test_time_in_a_kprobe_action_prints_once_per_hit(toy_path):
    """time() in a kernel probe's action is an event: the client prints the time it
    reads it at, once per hit (the hook's count)."""
    hooks = Hooks(entry=lambda m, abi, site: 1)
    report = run_trace('kprobe:vfs_llseek { time("%Y|"); printf("x\\n"); }', hooks, seed=2)
    hits = len(hooks.seen["entry"])
    assert hits and len(report["printf"]) == 2 * hits
    assert all(len(x) == 5 and x.endswith("|") and x[:4].isdigit() for x in report["printf"][::2])


@pytest.mark.slow
def test_trace_on_qemu_counts_like_the_gdbstub_oracle(toy_path):
    """The same program on qemu:toy: the seeded workload is the same, so the per-comm
    counts add up to what ksim count's oracle (a gdbstub breakpoint) sees."""
    from ksim.commands.count import count

    report, _ = trace('kprobe:vfs_read { @[comm] = count(); @all = count(); }', "qemu:toy", seed=3)
    counted = count("vfs_read", "qemu:toy", seed=3)
    assert counted["count"] == counted["oracle"] == report["maps"]["@all"] > 0
    assert sum(report["maps"]["@"].values()) == report["maps"]["@all"]


def test_pid_option_of_count_and_trace_equals_the_oracle_filtered_by_pid(capsys, toy_path):
    hooks = Hooks(entry=lambda m, abi, site: pid_of(m, abi))
    report = run_trace("kprobe:vfs_read { @[pid] = count(); }", hooks, seed=4)
    seen = Counter(hooks.seen["entry"])
    assert report["maps"]["@"] == {str(p): n for p, n in seen.items()} and len(seen) > 1
    pid, hits = max(seen.items(), key=lambda kv: kv[1])
    hooks = Hooks(entry=lambda m, abi, site: pid_of(m, abi))
    only, _ = trace("kprobe:vfs_read { @ = count(); }", "unicorn:toy", on_attach=hooks, seed=4, pid=pid)
    assert only["maps"]["@"] == Counter(hooks.seen["entry"])[pid] == hits
    assert main(["count", "vfs_read", "--seed", "4", "--pid", str(pid), "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert counted["count"] == hits and counted["oracle"] is None and counted["pid"] == pid
    assert main(["count", "vfs_read", "--pid", "1", "--oracle", "unicorn-address-hook"]) == 2


def test_example_submit_bio_counts_and_times_every_bio(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: 1, exit=lambda m, abi, site: 1)
    report = run_trace((EXAMPLES / "submit_bio.bt").read_text(), hooks, seed=3)
    bios = len(hooks.seen["entry"])
    assert report["maps"]["@bios"] == bios > 0
    assert sum(b["count"] for b in report["maps"]["@took"]) == len(hooks.seen["exit"]) == bios
    assert "@start" not in report["maps"]


def test_a_probe_mixing_kernel_and_client_attach_points_is_refused_and_changes_nothing(capsys, toy_path):
    from ksim.kapi import Manager
    from ksim.trace.errors import TraceUnsupported
    from ksim.trace.parser import parse
    from ksim.trace.session import TraceSession

    with Manager.attach("unicorn:toy") as m:
        before = m.copy_from_kernel(m.entry_point("vfs_read").address, 16)
        s = TraceSession(m, parse("kprobe:vfs_read, interval:s:1 { @ = count(); }"))
        with pytest.raises(TraceUnsupported, match="sharing one action"):
            s.attach()
        assert m.splices() == {} and s.handles == []
        assert m.copy_from_kernel(m.entry_point("vfs_read").address, 16) == before
    assert main(["trace", "-e", "interval:s:1, kprobe:vfs_read { @ = count(); }"]) == 2
    assert "stdin:1:" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["/dev/zero", "long"])
def test_a_program_file_longer_than_the_bound_is_a_trace_limit(tmp_path, capsys, source):
    """/dev/zero was read until a MemoryError; a file is read up to the bound, then
    refused with its name, before anything is attached."""
    from ksim.commands.trace import MAX_PROGRAM_BYTES

    if source == "long":
        path = tmp_path / "long.bt"
        path.write_text("BEGIN { exit(); }\n" + "\n" * MAX_PROGRAM_BYTES)
        source = str(path)
    assert main(["trace", source, "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"] == "trace-limit"
    assert doc["message"].startswith(f"{source}: ERROR: the program file is longer than")
    fits = tmp_path / "fits.bt"
    fits.write_text("BEGIN { exit(); }" + " " * (MAX_PROGRAM_BYTES - 17))
    assert main(["trace", str(fits)]) == 0
    assert capsys.readouterr().out.startswith("Attaching 1 probe")


def test_a_program_fifo_without_a_writer_does_not_hang(tmp_path, capsys):
    """A FIFO nobody writes reads as an empty program at once (open() waited for a
    writer forever); a pipe with a program in it is read like a file."""
    import os
    import threading

    fifo = tmp_path / "prog.bt"
    os.mkfifo(fifo)
    done = threading.Event()
    status: list[int] = []
    threading.Thread(target=lambda: (status.append(main(["trace", str(fifo), "--json"])),
                                     done.set()), daemon=True).start()
    assert done.wait(60), "ksim trace waited for a writer"
    capsys.readouterr()
    # a pipe with a program in it (what ``ksim trace <(...)`` names) is read whole
    r, w = os.pipe()
    os.write(w, b'BEGIN { printf("from a pipe\\n"); exit(); }')
    os.close(w)
    try:
        assert main(["trace", f"/dev/fd/{r}"]) == 0
    finally:
        os.close(r)
    assert "from a pipe" in capsys.readouterr().out


def test_a_command_leaves_the_collector_as_it_found_it() -> None:
    """kept_for_the_command: the collector is held through the attach and what
    exists then is frozen; when the command ends nothing stays frozen and the
    collector runs again, also when the attach failed."""
    import gc

    from ksim.cli import kept_for_the_command

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with kept_for_the_command() as keep:
        with keep():
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), kept_for_the_command() as keep, keep():
        raise RuntimeError("the attach failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0
