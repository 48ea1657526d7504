"""bpftrace's language in a kernel probe's action on unicorn:toy, each count against
an oracle (exact address hooks at the spliced points, computed here the most direct
way): positional parameters, while / for / unroll with break and continue (bounded
by parser.MAX_LOOP), print() and clear() of maps and print() of values sent to the
client as events, rand, and bpftrace's macro definitions with getopt()."""

from __future__ import annotations

import pytest
from test_trace import Hooks, run_trace

from ksim.cli import main
from ksim.commands.trace import trace
from ksim.live.testing import testbed  # noqa: F401  (the live tests' fixture)
from ksim.trace.errors import TraceError, TraceSemanticError, TraceUnsupported
from ksim.trace.parser import MAX_LOOP, TraceLimit, parse


def rdx(machine, abi, site) -> int:
    return machine.reg("rdx")


# --- positional parameters -----------------------------------------------------------------
def test_a_positional_parameter_filters_like_the_oracle(toy_path):
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read /arg2 > $1/ { @big = count(); @n = $#; }", hooks,
                       seed=3, params=("100",))
    sizes = hooks.seen["entry"]
    assert report["maps"]["@big"] == sum(1 for n in sizes if n > 100) > 0
    assert report["maps"]["@n"] == 1


def test_str_of_an_integer_parameter_is_its_text_and_a_missing_one_is_empty(capsys, toy_path):
    """bpftrace: $1 given as 5 is the integer 5, str($1) the string "5"; a parameter
    not given is 0, and "" as a string."""
    assert main(["trace", "-e", 'BEGIN { printf("%d [%s] [%s] %d %d\\n", $1 + 1, str($1), '
                 'str($3), $3, $#); exit(); }', "5", "x"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "6 [5] [] 0 2"


def test_str_of_a_parameter_is_a_map_key(toy_path):
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { @[str($1)] = count(); }", hooks, seed=3,
                       params=("0x10",))
    assert report["maps"]["@"] == {"0x10": len(hooks.seen["entry"])}


# --- loops -----------------------------------------------------------------------------------
def loop_oracle(size: int) -> int:
    """What the program of test_while_with_break_and_continue counts for one hit."""
    i = n = 0
    for _ in range(MAX_LOOP):
        if not i < size:
            break
        i += 64
        if i > 640:
            break
        if i == 128:
            continue
        n += 1
    return n


def test_while_with_break_and_continue_equals_the_oracle(toy_path):
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { $i = 0; $n = 0; while ($i < arg2) { $i += 64; "
                       "if ($i > 640) { break; } if ($i == 128) { continue; } $n++; } "
                       "@loops = sum($n); @[$n] = count(); }", hooks, seed=3)
    sizes = hooks.seen["entry"]
    assert report["maps"]["@loops"] == sum(loop_oracle(s) for s in sizes) > 0
    expected: dict[str, int] = {}
    for s in sizes:
        expected[str(loop_oracle(s))] = expected.get(str(loop_oracle(s)), 0) + 1
    assert report["maps"]["@"] == expected and len(expected) > 1


def test_a_while_loop_still_going_stops_at_the_bound(toy_path):
    """As bpftrace's verifier bounds loops: MAX_LOOP passes, then the action goes on."""
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { $n = 0; while (1) { $n++; } @passes = sum($n); "
                       "@after = count(); }", hooks, seed=3)
    hits = len(hooks.seen["entry"])
    assert report["maps"]["@passes"] == MAX_LOOP * hits and report["maps"]["@after"] == hits > 0


def test_for_over_a_range_and_unroll_with_break(toy_path):
    """for $i : A..B runs B - A passes (continue still increments $i); unroll (N) with a
    break stops where the break is."""
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { $s = 0; for $i : 2..7 { if ($i == 4) { continue; } "
                       "$s += $i; } @sum = sum($s); $k = 0; unroll (6) { $k++; "
                       "if ($k * 100 > arg2) { break; } } @k = sum($k); "
                       "for $w : 1..4 { $x = 0; while (1) { $x++; "
                       "if ($x == $w) { break; } } @inner = sum($x); } }", hooks, seed=3)
    sizes = hooks.seen["entry"]
    assert report["maps"]["@sum"] == (2 + 3 + 5 + 6) * len(sizes)
    assert report["maps"]["@k"] == sum(next((k for k in range(1, 7) if k * 100 > s), 6)
                                       for s in sizes)
    assert report["maps"]["@inner"] == (1 + 2 + 3) * len(sizes)


def test_return_inside_a_loop_ends_the_action(toy_path):
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { $i = 0; while ($i < 10) { $i++; if ($i == 3) "
                       "{ return; } @passes = count(); } @never = count(); }", hooks, seed=3)
    assert report["maps"]["@passes"] == 2 * len(hooks.seen["entry"]) > 0
    assert "@never" not in report["maps"]


def test_loops_in_begin_and_end_run_in_the_client(capsys, toy_path):
    assert main(["trace", "-e", 'BEGIN { $i = 0; while ($i < 5) { $i++; if ($i == 2) '
                 '{ continue; } if ($i == 4) { break; } printf("%d ", $i); } '
                 'for $j : 0..200 { @n = count(); } printf("\\n"); exit(); }']) == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 3 " in out and f"@n: {MAX_LOOP}" in out


@pytest.mark.parametrize("program, error, message", [
    ("kprobe:f { break; }", TraceSemanticError, "break outside a loop"),
    ("kprobe:f { if (1) { continue; } }", TraceSemanticError, "continue outside a loop"),
    ("kprobe:f { for ($k, $v : @m) { } }", TraceUnsupported, "bind one variable"),
    ("kprobe:f { for $kv : @m[1] { } }", TraceSemanticError, "without keys"),
    ("kprobe:f { for $i : 0 { } }", TraceError, "'..'"),
    ("kprobe:f { while (1) { while (1) { @a = 1; } } }", TraceLimit, "more than 1000"),
])
def test_loop_errors_are_positioned(program, error, message):
    with pytest.raises(error) as info:
        parse(program)
    assert message in info.value.message and info.value.loc is not None


# --- print and clear as events -------------------------------------------------------------
def test_print_of_a_map_in_a_kprobe_prints_it_as_the_client_drains_the_event(toy_path):
    """As bpftrace's print() in a probe (an event its user space acts on): one map
    printed per hit, each no smaller than the hits before its event."""
    hooks = Hooks(entry=rdx)
    report, _ = trace("kprobe:vfs_read { @c = count(); print(@c); print(arg2); }",
                      "unicorn:toy", on_attach=hooks, seed=3,
                      run_options={"slices": [2_000] * 400})
    sizes = hooks.seen["entry"]
    assert report["printed"] == sizes and sizes
    printed = []

    def out(o):
        if o.kind == "map":
            printed.append(o.data["@c"])

    trace("kprobe:vfs_read { @c = count(); print(@c); }", "unicorn:toy", seed=3, out=out,
          run_options={"slices": [2_000] * 400})
    assert len(printed) == len(sizes) + 1          # each event's, and the map at exit
    assert all(p >= k for k, p in enumerate(printed[:-1], 1)) and printed == sorted(printed)
    assert printed[-1] == len(sizes)


def test_clear_of_a_keyed_map_in_a_kprobe(toy_path):
    """clear(@keyed) is done by the client when it drains the event; exit() stops the
    updates at once, so the map is empty at the end and the count is the oracle's."""
    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { @[arg2] = count(); @n = count(); "
                       "if (@n == 4) { clear(@); clear(@n); exit(); } }", hooks, seed=3)
    assert len(hooks.seen["entry"]) >= 4 and report["exited"]
    assert "@" not in report["maps"] and report["maps"]["@n"] == 0


# --- rand -----------------------------------------------------------------------------------
def test_rand_on_the_toy_is_the_generator_the_docs_give(toy_path):
    from ksim.trace.compiler import RAND_ADD, RAND_MUL

    hooks = Hooks(entry=rdx)
    report = run_trace("kprobe:vfs_read { @low = sum(rand & 0xff); @n = count(); "
                       "@[rand % 4] = count(); }", hooks, seed=3)
    state, low, buckets = 0, 0, {}
    for _ in hooks.seen["entry"]:
        state = (state * RAND_MUL + RAND_ADD) % (1 << 64)
        low += (state >> 32) & 0xFF
        state = (state * RAND_MUL + RAND_ADD) % (1 << 64)
        key = str((state >> 32) % 4)
        buckets[key] = buckets.get(key, 0) + 1
    assert report["maps"]["@low"] == low and report["maps"]["@"] == buckets
    assert len(buckets) > 1


# --- macros and getopt ----------------------------------------------------------------------
MACROS = """
macro limit() { getopt("limit", 100, "the size that counts as big") }
macro verbose() { getopt("verbose", false) }
macro tally(size, @big, @small) {
  $s = size;
  if ($s > limit) { @big += 1; } else { @small += 1; }
  $s
}
macro twice(x) { x * 2 }
kprobe:vfs_read {
  $s = 1;
  tally(arg2, @big, @small);
  @doubled = sum(twice(arg2));
  if verbose { @verbose = count(); }
  @s = sum($s);
}
"""


@pytest.mark.parametrize("params, limit, verbose", [((), 100, False),
                                                     (("--limit=300", "--verbose"), 300, True)])
def test_macros_expand_with_their_arguments_and_getopt_reads_options(toy_path, params, limit,
                                                                      verbose):
    hooks = Hooks(entry=rdx)
    report = run_trace(MACROS, hooks, seed=3, params=params)
    sizes = hooks.seen["entry"]
    assert report["maps"]["@big"] == sum(1 for s in sizes if s > limit) > 0
    assert report["maps"]["@small"] == sum(1 for s in sizes if s <= limit) > 0
    assert report["maps"]["@doubled"] == 2 * sum(sizes)
    # the macro's $s is its own: the caller's stays 1
    assert report["maps"]["@s"] == len(sizes)
    assert ("@verbose" in report["maps"]) == verbose


@pytest.mark.parametrize("program, error, message", [
    ("macro m(a) { a } kprobe:f { @ = m(1, 2); }", TraceSemanticError, "takes 1 argument"),
    ("macro m(@a) { @a = 1; } kprobe:f { m(3); }", TraceSemanticError, "takes a map"),
    ("macro m() { @x = 1; 2 } kprobe:f { @ = m(); }", TraceUnsupported, "has statements"),
    ("macro m() { 1 } macro m() { 2 }", TraceSemanticError, "defined twice"),
    ('BEGIN { @ = getopt("n", 1); }', None, None),
])
def test_macro_errors_are_positioned(program, error, message):
    if error is None:
        with pytest.raises(TraceSemanticError, match="expecting an integer"):
            parse(program, params=("--n=x",))
        return
    with pytest.raises(error) as info:
        parse(program)
    assert message in info.value.message and info.value.loc is not None


# --- cat and cgroup_path --------------------------------------------------------------------
def test_cat_on_an_emulator_prints_the_clients_file_once_per_hit(toy_path, tmp_path):
    """An emulated kernel has no filesystem: cat() prints the client's file, which
    stands for it (on live:// kerninstd reads the guest's); a file that cannot be read
    prints bpftrace's error."""
    f = tmp_path / "loadavg"
    f.write_text("0.01 0.02 0.03 1/2 3\n")
    hooks = Hooks(entry=rdx)
    report, text = trace(f'kprobe:vfs_read {{ @n = count(); if (arg2 > 100) {{ cat("{f}"); }} '
                         f'if (@n == 1) {{ cat("{tmp_path}/none"); }} }}', "unicorn:toy",
                         on_attach=hooks, seed=3)
    big = sum(1 for s in hooks.seen["entry"] if s > 100)
    assert big > 0 and report["printf"].count(f.read_text()) == big
    assert report["printf"].count(f"ERROR: failed to open file '{tmp_path}/none': No such file "
                                  "or directory\n") == 1


def test_cgroup_path_on_an_emulator_is_refused_before_anything_is_spliced(capsys, toy_path):
    status = main(["trace", "-e", 'kprobe:vfs_read { printf("%s\\n", cgroup_path(1)); }'])
    err = capsys.readouterr().err
    assert status == 2 and "unicorn:toy is an emulated kernel without cgroups" in err
    assert "stdin:1:34-45" in err


# --- on the live kernel (the testbed) -------------------------------------------------------
LIVE_WORK = ("python3 -c \"import os\nfor _ in range({n}): os.getppid()\"")


@pytest.mark.live
def test_cat_cgroup_path_and_rand_on_the_live_kernel(testbed):  # noqa: F811
    """cat() prints the guest's file (read by kerninstd), cgroup_path() the cgroup2 path
    of the directory whose inode number the task's cgroup id is, rand the kernel's
    get_random_u32; each getppid of the workload is counted once."""
    from ksim.live.testing import connect

    t = connect(testbed)
    try:
        t.exec_checked("mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup; "
                       "mkdir -p /sys/fs/cgroup/ksimlang/inner; echo 'ksim cat' > /tmp/ksimcat")
        ino = int(t.exec_checked("stat -c %i /sys/fs/cgroup/ksimlang/inner"))
    finally:
        t.close()
    work = ("sh -c 'echo $$ > /sys/fs/cgroup/ksimlang/inner/cgroup.procs; exec "
            + LIVE_WORK.format(n=40).replace("'", "'\\''") + "'")
    report, text = trace('kprobe:__x64_sys_getppid /comm == "python3"/ { @[cgroup_path(cgroup), '
                         'cgroup] = count(); @r[rand % 2] = count(); @n = count(); '
                         'if (@n == 1) { cat("/tmp/ksimcat"); cat("/tmp"); } }',
                         testbed["address"], while_cmd=work)
    assert report["maps"]["@"] == {f"unified:/ksimlang/inner,{ino}": 40}
    assert sum(report["maps"]["@r"].values()) == 40 and len(report["maps"]["@r"]) == 2
    assert report["printf"][:2] == ["ksim cat\n", "ERROR: failed to open file '/tmp': "
                                    "read_file: /tmp is not a regular file\n"]


@pytest.mark.live
@pytest.mark.parametrize("path, size, message", [
    ("etc/hostname", 10, "is not an absolute path"),
    ("/etc/../etc/hostname", 10, "is not an absolute path"),
    ("/dev/null", 10, "is not a regular file"),
    ("/nonexistent", 10, "No such file or directory"),
])
def test_read_file_refuses_what_cat_does_not_need(testbed, path, size, message):  # noqa: F811
    from ksim.live.protocol import TracedFileRefused
    from ksim.live.testing import connect

    t = connect(testbed)
    try:
        with pytest.raises(TracedFileRefused, match=message):
            t.read_file(path, size)
        assert t.read_file("/proc/version", 5) == b"Linux"
    finally:
        t.close()


@pytest.mark.live
def test_loops_and_print_events_on_the_live_kernel(testbed):  # noqa: F811
    """A while loop with continue, a for range with break, print(value) and print(@m)
    in a kprobe: exact against the workload's 40 getppid calls."""
    maps: list[int] = []

    def out(o):
        if o.kind == "map" and "@c" in o.data:
            maps.append(o.data["@c"])

    report, _ = trace('kprobe:__x64_sys_getppid /comm == "python3"/ { $i = 0; $n = 0; '
                      'while ($i < 10) { $i++; if ($i % 3 == 0) { continue; } $n++; } '
                      'for $j : 0..50 { if ($j == 5) { break; } $n += 10; } '
                      '@s = sum($n); @c = count(); print(@c); print($n); }',
                      testbed["address"], while_cmd=LIVE_WORK.format(n=40), out=out)
    assert report["maps"]["@s"] == 40 * 57 and report["printed"] == [57] * 40
    assert len(maps) == 41 and maps == sorted(maps) and maps[-1] == 40
    assert all(p >= k for k, p in enumerate(maps[:-1], 1))
