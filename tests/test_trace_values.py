"""Values of bpftrace's language beyond integers and strings, on unicorn:toy, each
against an oracle computed here the most direct way (exact address hooks at the
spliced points, the toy kernel's own tables as its source code gives them):
tuples as map values and their fields ($t.0), for loops over a map's entries in
the client's actions, len(@m), strerror(), syscall_name(), strcontains(),
macaddr(), pton() and numaid; and each one's misuse refused where it is."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_trace import Hooks, comm_of, pid_of, run_trace

from ksim.cli import main
from ksim.commands.trace import trace
from ksim.live.testing import testbed  # noqa: F401  (the live tests' fixture)
from ksim.trace.compiler import analyse
from ksim.trace.errors import TraceError, TraceSemanticError, TraceUnsupported
from ksim.trace.parser import parse


def size_comm_pid(machine, abi, site) -> tuple[int, str, int]:
    return machine.reg("rdx"), comm_of(machine, abi), pid_of(machine, abi)


# --- tuples ----------------------------------------------------------------------------------
def test_a_tuple_as_a_map_value_prints_as_bpftrace_prints_it(toy_path):
    """@m[k] = (comm, arg2, pid): the last hit's tuple per key, printed "(sshd, 42, 3)"
    (a string item as its text), a list in JSON."""
    hooks = Hooks(entry=size_comm_pid)
    report, text = trace("kprobe:vfs_read { @m[arg2 % 7] = (comm, arg2, pid); }", "unicorn:toy",
                         on_attach=hooks, seed=3)
    last: dict[int, list] = {}
    for size, comm, pid in hooks.seen["entry"]:
        last[size % 7] = [comm, size, pid]
    assert report["maps"]["@m"] == {str(k): v for k, v in last.items()} and len(last) > 2
    lines = [f"@m[{k}]: ({c}, {s}, {p})" for k, (c, s, p) in sorted(last.items())]
    assert [x for x in text.splitlines() if x.startswith("@m[")] == lines


def test_tuple_fields_and_a_nested_tuple(toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace("kprobe:vfs_read { $t = (arg2, (pid, comm)); @sum = sum($t.0); "
                       "@[$t.1.1] = count(); @pid[$t.1.0] = count(); @last = $t.1; }",
                       hooks, seed=3)
    seen = hooks.seen["entry"]
    assert report["maps"]["@sum"] == sum(s for s, _, _ in seen) > 0
    assert report["maps"]["@"] == dict(Counter(c for _, c, _ in seen)) and len(report["maps"]["@"]) > 1
    assert report["maps"]["@pid"] == {str(k): n for k, n in Counter(p for _, _, p in seen).items()}
    assert report["maps"]["@last"] == [seen[-1][2], seen[-1][1]]


def test_a_tuple_map_read_back_in_a_kprobe(toy_path):
    """A tuple read from a map keeps its items: the previous hit's size, per pid."""
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace("kprobe:vfs_read { $prev = @last[pid]; @before = sum($prev.0); "
                       "@last[pid] = (arg2, comm); }", hooks, seed=3)
    before, last = 0, {}
    for size, _, pid in hooks.seen["entry"]:
        before += last.get(pid, 0)
        last[pid] = size
    assert report["maps"]["@before"] == before > 0


def test_print_of_a_tuple_in_a_kprobe_prints_it_whole(toy_path):
    """print() of a tuple is one event the client prints as bpftrace prints a tuple."""
    hooks = Hooks(entry=size_comm_pid)
    report, text = trace("kprobe:vfs_read /arg2 > 300/ { $t = (arg2, (comm, pid)); print($t); "
                         "print($t.1); }", "unicorn:toy", on_attach=hooks, seed=3)
    big = [(s, c, p) for s, c, p in hooks.seen["entry"] if s > 300]
    assert big and report["printed"] == [x for s, c, p in big for x in ([s, [c, p]], [c, p])]
    assert [x for x in text.splitlines() if x.startswith("(")] == [
        x for s, c, p in big for x in (f"({s}, ({c}, {p}))", f"({c}, {p})")]


def test_tuples_assigned_by_the_client_widen_their_strings(capsys, toy_path):
    assert main(["trace", "-e", 'BEGIN { @b[1] = (1, "a"); @b[2] = (2, "a longer string"); '
                 '$x = @b[2]; print($x.1); exit(); }']) == 0
    out = capsys.readouterr().out.splitlines()
    assert "a longer string" in out and "@b[1]: (1, a)" in out
    assert "@b[2]: (2, a longer string)" in out


# --- for over a map, len ---------------------------------------------------------------------
def test_for_over_a_map_in_end_visits_every_entry(toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace('kprobe:vfs_read { @n[comm] = count(); @s[pid, arg2 % 3] = sum(arg2); }\n'
                       'END { printf("keys %d %d\\n", len(@n), len(@s)); '
                       'for ($kv : @n) { printf("%s=%d\\n", $kv.0, $kv.1); } '
                       'for ($kv : @s) { @back[$kv.0.0, $kv.0.1] = $kv.1; '
                       'if ($kv.1 > 0) { @visited++; } } }', hooks, seed=3)
    seen = hooks.seen["entry"]
    counts = Counter(c for _, c, _ in seen)
    sums: Counter = Counter()
    for size, _, pid in seen:
        sums[(pid, size % 3)] += size
    assert report["printf"][0] == f"keys {len(counts)} {len(sums)}\n"
    assert sorted(report["printf"][1:]) == sorted(f"{c}={n}\n" for c, n in counts.items())
    assert report["maps"]["@back"] == {f"{p},{k}": v for (p, k), v in sums.items()}
    assert report["maps"]["@visited"] == sum(1 for v in sums.values() if v > 0)


def test_for_over_a_map_inside_a_macro(toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace('macro dump(@m) { for ($kv : @m) { printf("%d:%d\\n", $kv.0, $kv.1); } }\n'
                       'kprobe:vfs_read { @c[arg2 % 3] = count(); } END { dump(@c); }',
                       hooks, seed=3)
    counts = Counter(s % 3 for s, _, _ in hooks.seen["entry"])
    assert sorted(report["printf"]) == sorted(f"{k}:{n}\n" for k, n in counts.items())


def for_in_kprobe_oracle(sizes: list[int]) -> dict:
    """What the program of test_for_over_a_map_in_a_kprobe_visits_each_record holds at
    the end, computed hit by hit."""
    m: dict[int, int] = {}
    mx: dict[int, int] = {}
    seen: Counter = Counter()
    big = n = total = 0
    for size in sizes:
        m[size % 5] = m.get(size % 5, 0) + 1
        mx[size % 3] = max(mx.get(size % 3, size), size)
        n, total = len(m), sum(m.values())
        for k in m:
            if k != 2:
                seen[str(k)] += 1
        big += any(v > 400 for v in mx.values())
    return {"@n": n, "@s": total, "@seen": dict(seen), "@big": big, "@l": len(m)}


def test_for_over_a_map_in_a_kprobe_visits_each_record(toy_path):
    """In a kernel probe's action the loop is unrolled over the map's records (8 here:
    max_map_keys), each pass running for a record that holds a key; continue and break
    as in any loop; len(@m) counts those records."""
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace("config = { max_map_keys = 8 }\n"
                       "kprobe:vfs_read { @m[arg2 % 5] = count(); @mx[arg2 % 3] = max(arg2); "
                       "$n = 0; $s = 0; for ($kv : @m) { $n++; $s += $kv.1; "
                       "if ($kv.0 == 2) { continue; } @seen[$kv.0] = count(); } "
                       "@n = $n; @s = $s; @l = len(@m); "
                       "for ($kv : @mx) { if ($kv.1 > 400) { @big = count(); break; } } }",
                       hooks, seed=3)
    expected = for_in_kprobe_oracle([s for s, _, _ in hooks.seen["entry"]])
    assert {k: report["maps"].get(k) for k in expected} == expected
    assert expected["@big"] > 0 and expected["@n"] == 5


def test_for_and_len_over_a_large_map_in_a_kprobe_are_refused(capsys, toy_path):
    """A map of bpftrace's default 4,096 keys would copy the loop's body 4,096 times."""
    for program, head in (("kprobe:vfs_read { @m[arg2] = count(); for ($kv : @m) { @t = 1; } }",
                           "stdin:1:39-42: ERROR: for over @m in a kernel probe's action: the "
                           "map holds up to 4096 keys"),
                          ("kprobe:vfs_read { @m[arg2] = count(); @n = len(@m); }",
                           "stdin:1:44-47: ERROR: len(@m) in a kernel probe's action")):
        assert main(["trace", "-e", program]) == 2
        assert head in capsys.readouterr().err


def test_for_over_an_empty_map_and_break_in_begin(capsys, toy_path):
    assert main(["trace", "-e", 'BEGIN { @m[1] = 10; @m[2] = 20; @m[3] = 30; $n = 0; '
                 'for ($kv : @m) { $n++; if ($n == 2) { break; } } printf("n=%d\\n", $n); '
                 'for ($kv : @none) { printf("never\\n"); } exit(); } '
                 'kprobe:vfs_read { @none[pid] = count(); }']) == 0
    out = capsys.readouterr().out
    assert "n=2\n" in out and "never" not in out


# --- strerror, syscall_name, strcontains --------------------------------------------------
#: glibc's strerror(3) texts (what bpftrace 0.17's user space prints)
ERRORS = ["Success", "Operation not permitted", "No such file or directory", "No such process",
          "Interrupted system call"]


def test_strerror_names_errno_numbers(toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report, text = trace('kprobe:vfs_read { @[strerror(arg2 % 5)] = count(); '
                         '@neg = strerror(-2); if (arg2 % 5 == 3) { printf("<%s>\\n", '
                         'strerror(arg2 % 5)); } }', "unicorn:toy", on_attach=hooks, seed=3)
    counts = Counter(ERRORS[s % 5] for s, _, _ in hooks.seen["entry"])
    assert report["maps"]["@"] == dict(counts) and len(counts) > 2
    assert report["maps"]["@neg"] == "Unknown error -2"      # strerror(3) of the int
    assert report["printf"] == ["<No such process>\n"] * counts["No such process"]


#: the toy kernel's sys_call_table (images/toy/kernel/sys.c); 12 and 19.. are sys_ni_syscall
TOY_SYSCALLS = ["read", "write", "open", "close", "lseek", "fsync", "sched_yield", "getpid",
                "getppid", "getuid", "getgid", "sync", None, "times", "sendto", "brk",
                "sethostname", "gettid", "uname"]


def test_syscall_name_names_numbers_by_the_kernels_table(toy_path):
    """do_syscall_64(regs, nr): each nr named by the toy's sys_call_table; numbers of
    one name (the unimplemented ones: "Unknown syscall") are one key, as bpftrace's
    strings are."""
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rsi"))
    report = run_trace("kprobe:do_syscall_64 { @[syscall_name(arg1)] = count(); "
                       "@far = syscall_name(1000); }", hooks, seed=3)
    names = [TOY_SYSCALLS[n] if n < len(TOY_SYSCALLS) and TOY_SYSCALLS[n] else "Unknown syscall"
             for n in hooks.seen["entry"]]
    assert report["maps"]["@"] == dict(Counter(names)) and "Unknown syscall" in names
    assert report["maps"]["@far"] == "Unknown syscall"


def test_syscall_name_is_refused_on_a_kernel_without_sys_call_table():
    """Where the kernel's symbols have no sys_call_table, syscall_name() is refused at
    the call (the session's symbol lookup raises, as for any symbol it lacks)."""
    from ksim.trace.compiler import ProbeCompiler, Site

    def lookup(name: str) -> int:
        raise TraceSemanticError(f"the kernel has no symbol {name!r}")

    from ksim.trace.maps import layout_for

    program = parse("kprobe:f { @s = syscall_name(arg0); }")
    a = analyse(program)
    layouts = {"@s": layout_for(a.maps["@s"], lambda size: 0x1000, [])}
    compiler = ProbeCompiler(layouts, Site("entry", "f", "kprobe:f"), stop=None,
                             name_index=lambda n: 0, placed=lambda lay, key: None,
                             analysis=a, lookup=lookup)
    with pytest.raises(TraceUnsupported, match="this kernel has no such symbol") as info:
        compiler.compile(program.probes[0])
    assert (info.value.loc.col, info.value.loc.end) == (17, 29)


def test_strcontains_finds_a_literal_in_a_string(toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace('kprobe:vfs_read { @[comm, strcontains(comm, "sh")] = count(); '
                       '@whole = sum(strcontains(comm, "")); @none = sum(strcontains(comm, '
                       '"a string longer than any comm")); }', hooks, seed=3)
    counts = Counter(f"{c},{int('sh' in c)}" for _, c, _ in hooks.seen["entry"])
    assert report["maps"]["@"] == dict(counts)
    assert {k.split(",")[1] for k in counts} == {"0", "1"}
    assert report["maps"]["@whole"] == len(hooks.seen["entry"]) and report["maps"]["@none"] == 0


def test_client_actions_name_values_too(capsys, toy_path):
    assert main(["trace", "-e", 'BEGIN { printf("%s|%s|%d%d\\n", strerror(1), syscall_name(3), '
                 'strcontains("kworker", "work"), strcontains("kworker", "x")); '
                 'print((1, "two")); $t = (7, "x"); print($t.0); exit(); }']) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == ["Operation not permitted|close|10",
                                                         "(1, two)", "7"]


# --- macaddr, pton, numaid --------------------------------------------------------------------
def test_macaddr_prints_six_bytes_as_bpftrace_does(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: bytes(m.read(m.reg("rsi"), 6)))
    report = run_trace("kprobe:vfs_read { @[macaddr(arg1)] = count(); }", hooks, seed=3)
    counts = Counter(":".join(f"{b:02X}" for b in raw) for raw in hooks.seen["entry"])
    assert report["maps"]["@"] == dict(counts) and counts


def test_pton_and_numaid(capsys, toy_path):
    hooks = Hooks(entry=size_comm_pid)
    report = run_trace('kprobe:vfs_read { @v4 = ntop(pton("10.1.2.3")); @v6 = ntop(pton("fe80::1")); '
                       '@n = (uint32)pton("127.0.0.1"); @b = pton("192.168.0.1"); '
                       '@[numaid] = count(); }', hooks, seed=3)
    assert report["maps"]["@v4"] == "10.1.2.3" and report["maps"]["@v6"] == "fe80::1"
    assert report["maps"]["@n"] == 0x0100007F          # the bytes as memory holds them
    assert report["maps"]["@b"] == "[192,168,0,1]"
    # the toy kernel has no NUMA (no per-cpu numa_node): node 0, as numa_node_id() says
    assert report["maps"]["@"] == {"0": len(hooks.seen["entry"])}


# --- misuse -----------------------------------------------------------------------------------
@pytest.mark.parametrize("program, error, message", [
    ('kprobe:f { $t = (1, 2); @x = $t.2; }', TraceSemanticError, "items are .0 to .1, not .2"),
    ('kprobe:f { @m[1] = (1, "a"); @m[2] = ("a", 1); }', TraceSemanticError,
     "Type mismatch for @m"),
    ('END { for ($kv : @h) { } } kprobe:f { @h[1] = hist(arg0); }', TraceSemanticError,
     "holds a hist"),
    ('END { for ($kv : @x) { } } kprobe:f { @x = 1; }', TraceSemanticError, "has no keys"),
    ('END { @n = len(1); }', TraceSemanticError, "len() takes a map"),
    ('kprobe:f { @e = strerror(); }', TraceSemanticError, "strerror() takes one integer"),
    ('kprobe:f { @e = strcontains(comm, comm); }', TraceUnsupported, "not a string literal"),
    ('kprobe:f { @e = strcontains(1, "a"); }', TraceSemanticError, "is not a string"),
    ('kprobe:f { @e = pton("10.1.2"); }', TraceSemanticError, "not an IPv4 or IPv6 address"),
    ('kprobe:f { @e = pton(comm); }', TraceSemanticError, "a string literal"),
    ('kprobe:f { @e = macaddr(comm); }', TraceSemanticError, "an array of 6 bytes or a pointer, not comm"),
    ('kprobe:f { printf("%d\\n", strerror(1)); }', TraceSemanticError, "%d specifier expects"),
    ('kprobe:f { @u = cpid; }', TraceUnsupported, "cpid is not supported"),
])
def test_misuse_is_refused_with_a_position(program, error, message):
    with pytest.raises(error) as info:
        analyse(parse(program))
    assert message in info.value.message and info.value.loc is not None


def test_username_names_a_uid_as_bpftrace_017_reads_etc_passwd():
    """The first line whose third field is the uid; empty when none is."""
    from ksim.trace.output import username_namer

    reads: list[str] = []

    def read(path: str) -> str:
        reads.append(path)
        return "root:x:0:0:root:/root:/bin/sh\nbad line\nalice:x:1000:1000::/home/a:\n" \
               "alias:x:1000:1000::/:\n"

    name = username_namer(read)
    assert [name(0), name(1000), name(7)] == ["root", "alice", ""] and reads == ["/etc/passwd"]


def test_username_on_the_toy_kernel_needs_credentials(capsys, toy_path):
    """The toy kernel's tasks have no credentials (no struct cred): username, as uid,
    is refused where it is, before anything is spliced."""
    assert main(["trace", "-e", "kprobe:vfs_read { @[username] = count(); }"]) == 2
    assert "stdin:1:21-29: ERROR: struct task_struct has no field named cred" in \
        capsys.readouterr().err


def test_json_output_holds_a_tuple_as_a_list(capsys, toy_path):
    assert main(["trace", "--json", "-e", 'kprobe:vfs_read { @t = (1, "a", (2, 3)); exit(); }']) == 0
    maps = [json.loads(x) for x in capsys.readouterr().out.splitlines()
            if '"type": "map"' in x]
    assert {"@t": [1, "a", [2, 3]]} in [m["data"] for m in maps]


def test_errors_are_trace_errors():
    with pytest.raises(TraceError):
        analyse(parse('kprobe:f { for ($k, $v : @m) { } }'))


# --- on the live kernel (the testbed) -------------------------------------------------------
LIVE_WORK = ("python3 -c \"import os\nfor _ in range({n}): os.getppid()\"")


@pytest.mark.live
def test_names_tuples_and_for_on_the_live_kernel(testbed):  # noqa: F811
    """The workload's 40 getppid calls: syscall_name() names x86-64's numbers 110 and
    39 (getppid, getpid: arch/x86/entry/syscalls/syscall_64.tbl) by the kernel's own
    sys_call_table; a tuple per pid; for and len over the map in END; username."""
    from ksim.live.testing import connect

    report, _ = trace('kprobe:__x64_sys_getppid /comm == "python3"/ { '
                      '@[syscall_name(110)] = count(); @t[pid] = (comm, syscall_name(39)); '
                      '@e = strerror(2); @[syscall_name(100000)] = count(); '
                      '@u[username, uid] = count(); } '
                      'END { for ($kv : @t) { printf("%s %s\\n", $kv.1.0, $kv.1.1); } '
                      'printf("len %d\\n", len(@t)); }',
                      testbed["address"], while_cmd=LIVE_WORK.format(n=40))
    assert report["maps"]["@"] == {"getppid": 40, "Unknown syscall": 40}
    assert list(report["maps"]["@t"].values()) == [["python3", "getpid"]]
    assert report["maps"]["@e"] == "No such file or directory"
    assert report["printf"] == ["python3 getpid\n", "len 1\n"]
    t = connect(testbed)
    try:        # the guest's own name for the workload's uid
        uid, user = t.exec_checked("id -u").strip(), t.exec_checked("id -un").strip()
    finally:
        t.close()
    assert report["maps"]["@u"] == {f"{user},{uid}": 40}
