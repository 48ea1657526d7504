"""tracepoint:CATEGORY:NAME and rawtracepoint:NAME resolved to sites
(ksim.trace.tracepoints, docs/tracepoints.md).

On the toy kernels (x86-64 and arm64, in unicorn) a snippet at each event's site
counts its hits and sums a field, and three oracles that do not splice agree:
an exact-address unicorn hook at the site (the count, the shared class told
apart in Python), a hook at the class function's entry that reads the field's
truth from the C arguments (the task, the bio), and the workload's own counters
(runqueue.nr_switches, bios_submitted, syscall_counts[], ...).  On the live
testbed the getpid sites count exactly what the kernel's own kprobe counts.
"""

from __future__ import annotations

import pytest
from conftest import needs_image

from ksim.analysis.points import PointKind
from ksim.kapi import Manager
from ksim.live.testing import testbed  # noqa: F401
from ksim.snippets import ast
from ksim.trace.tracepoints import (
    BadTracepointPattern,
    Event,
    Field,
    NoTracepointSite,
    Site,
    TracepointError,
    Tracepoints,
    UnknownTracepoint,
    field_of,
    parse_format,
)

# --- Linux 6.1's own format files (the testbed's tracefs), and what they say --------------------
SCHED_SWITCH = """\
name: sched_switch
ID: 319
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:1;
\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prev_prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;
\tfield:char next_comm[16];\toffset:40;\tsize:16;\tsigned:1;
\tfield:pid_t next_pid;\toffset:56;\tsize:4;\tsigned:1;
\tfield:int next_prio;\toffset:60;\tsize:4;\tsigned:1;

print fmt: "prev_comm=%s prev_pid=%d ==> next_comm=%s", REC->prev_comm, REC->prev_pid
"""

BLOCK_RQ_ISSUE = """\
name: block_rq_issue
ID: 1061
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:dev_t dev;\toffset:8;\tsize:4;\tsigned:0;
\tfield:sector_t sector;\toffset:16;\tsize:8;\tsigned:0;
\tfield:unsigned int nr_sector;\toffset:24;\tsize:4;\tsigned:0;
\tfield:unsigned int bytes;\toffset:28;\tsize:4;\tsigned:0;
\tfield:char rwbs[8];\toffset:32;\tsize:8;\tsigned:1;
\tfield:char comm[16];\toffset:40;\tsize:16;\tsigned:1;
\tfield:__data_loc char[] cmd;\toffset:56;\tsize:4;\tsigned:1;

print fmt: "%d,%d %s %u (%s) %llu + %u [%s]", REC->dev
"""

SYS_ENTER_OPENAT = """\
name: sys_enter_openat
ID: 659
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:int dfd;\toffset:16;\tsize:8;\tsigned:0;
\tfield:const char * filename;\toffset:24;\tsize:8;\tsigned:0;
\tfield:int flags;\toffset:32;\tsize:8;\tsigned:0;
\tfield:umode_t mode;\toffset:40;\tsize:8;\tsigned:0;

print fmt: "dfd: 0x%08lx, filename: 0x%08lx", ((unsigned long)(REC->dfd))
"""


def test_a_format_file_gives_every_field_as_written():
    e = parse_format(SCHED_SWITCH, "sched")
    assert (e.category, e.name, str(e)) == ("sched", "sched_switch", "sched:sched_switch")
    assert [f.name for f in e.fields[:4]] == ["common_type", "common_flags",
                                               "common_preempt_count", "common_pid"]
    assert all(f.common for f in e.fields[:4]) and not any(f.common for f in e.args)
    assert e.field("prev_comm") == Field("prev_comm", 8, 16, True, "char[16]", 16, False)
    assert e.field("prev_state") == Field("prev_state", 32, 8, True, "long", None, False)
    assert e.field("next_pid") == Field("next_pid", 56, 4, True, "pid_t", None, False)
    assert e.field("common_type") == Field("common_type", 0, 2, False, "unsigned short", None, False)
    assert e.field("nope") is None and e.syscall is None


def test_data_loc_arrays_and_pointers():
    b = parse_format(BLOCK_RQ_ISSUE, "block")
    assert b.field("cmd") == Field("cmd", 56, 4, True, "__data_loc char[]", None, True)
    assert b.field("rwbs") == Field("rwbs", 32, 8, True, "char[8]", 8, False)
    assert b.field("dev") == Field("dev", 8, 4, False, "dev_t", None, False)
    s = parse_format(SYS_ENTER_OPENAT, "syscalls")
    assert s.syscall == ("enter", "openat")
    assert s.field("filename") == Field("filename", 24, 8, False, "const char *", None, False)
    assert [f.name for f in s.args] == ["__syscall_nr", "dfd", "filename", "flags", "mode"]
    # a fields_array entry (type, then name) reads as the format's declaration
    assert field_of("char[16] comm", 8, 16, True) == Field("comm", 8, 16, True, "char[16]", 16, False)
    assert field_of("unsigned long  flags", 8, 8, False).ctype == "unsigned long"


@pytest.mark.parametrize("text", ["", "name: x\nformat:\n", "field:int x;\toffset:a;\tsize:4;"])
def test_a_format_without_readable_fields_is_refused(text):
    with pytest.raises(TracepointError):
        parse_format(text, "c", "x")


# --- the toy kernels: workload counters, struct offsets (images/toy/include/*.h) ------------------
#: struct rq: nr_switches, nr_waking, nr_wakeups
RQ_NR_SWITCHES, RQ_NR_WAKING, RQ_NR_WAKEUPS = 24, 56, 64
#: struct block_device (72 bytes): sectors_read, sectors_written, ios
BDEV_SIZE, BDEV_READ, BDEV_WRITTEN, BDEV_IOS = 72, 16, 24, 32
NR_BLKDEV = 3
#: struct bio: bi_sector, bi_size (u32)
BIO_SECTOR, BIO_SIZE = 0, 8
#: struct trace_event_buffer: trace_file; struct trace_event_file: event_call
FBUFFER_FILE, FILE_CALL = 16, 16
#: struct pt_regs: where the third argument (x86 dx, arm64 regs[2]) lies
PT_REGS_ARG2 = {"x86_64": 96, "aarch64": 16}
#: the toy's syscall numbers (kernel/sys.c sys_call_table)
NR_WRITE, NR_GETPID = 1, 7
EIO = 5

#: event -> (field summed, class-entry argument whose truth it is: ("task", n) the pid of
#: the task in argument n, ("bio", n) the sectors of the bio in argument n, ("sector", n)
#: its first sector)
RECORD_EVENTS = {
    ("sched", "sched_switch"): ("next_pid", ("task", 3)),
    ("sched", "sched_waking"): ("pid", ("task", 1)),
    ("sched", "sched_wakeup"): ("pid", ("task", 1)),
    ("block", "block_rq_insert"): ("nr_sector", ("bio", 1)),
    ("block", "block_rq_issue"): ("nr_sector", ("bio", 1)),
    ("block", "block_rq_complete"): ("sector", ("sector", 1)),
}
SYSCALL_EVENTS = {("syscalls", "sys_enter_write"): "count", ("syscalls", "sys_exit_getpid"): "ret"}


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


class Oracle:
    """A count and a sum kept by unicorn hooks (no splicing)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0


class ToyRun:
    """One seeded run of a toy kernel with a counting snippet at every event's site,
    and the oracles beside it."""

    SEED = 3

    def __init__(self, image: str, splice: str) -> None:
        self.splice = splice
        self.m = m = Manager.attach(f"unicorn:{image}")
        self.arch = m.arch
        self.image = m.target.image
        self.machine = m.target.machine
        self.tp = Tracepoints(m)
        self.pid_offset = self.image.address_of("KSIM_TASK_PID_OFFSET")
        self.sites: dict[tuple[str, str], Site] = {}
        self.vars: dict[tuple[str, str], tuple[ast.Var, ast.Var]] = {}
        self.at_site: dict[tuple[str, str], Oracle] = {}
        self.at_entry: dict[tuple[str, str], Oracle] = {}
        handles, removers = [], []
        for key, (fname, truth) in RECORD_EVENTS.items():
            (event,) = self.tp.events(*key)
            site = self.tp.site(event)
            f = event.field(fname)
            handles += self._count(key, site, ast.load(site.record + f.offset, f.size, f.signed),
                                   splice)
            removers += self._record_oracles(key, site, truth)
        for key, fname in SYSCALL_EVENTS.items():
            (event,) = self.tp.events(*key)
            site = self.tp.site(event)
            handles += self._count(key, site, site.values[fname], splice)
            removers += self._syscall_oracles(key, site)
        # block_rq_complete's error, a signed int, summed apart
        complete = self.sites["block", "block_rq_complete"]
        error = self.tp.events("block", "block_rq_complete")[0].field("error")
        self.errors = m.malloc(8)
        handles += [m.insert_snippet(p, ast.if_(complete.guard, self.errors.atomic_assign(
            self.errors + ast.load(complete.record + error.offset, 4, True))), splice=splice)
            for p in complete.points]
        # the shared class without its guard: both events' hits
        issue = self.sites["block", "block_rq_issue"]
        self.unguarded = m.malloc(8)
        handles += [m.insert_snippet(p, self.unguarded.atomic_assign(self.unguarded + 1),
                                     splice=splice) for p in issue.points]
        # rawtracepoint:sched_wakeup: arg0 is the task woken
        raw = self.raw = self.tp.raw_site("sched_wakeup")
        self.sites["raw", "sched_wakeup"] = raw
        pid = ast.load(raw.values["arg0"] + self.pid_offset, 4, True)
        handles += self._count(("raw", "sched_wakeup"), raw, pid, splice)
        self.checksum = m.run(seed=self.SEED).checksum
        self.counts = {k: (m.read(c), m.read(s)) for k, (c, s) in self.vars.items()}
        self.unguarded_count = m.read(self.unguarded)
        self.error_total = _signed(m.read(self.errors), 64)
        self.tactics = {m.patch_of(h).tactic for h in handles}
        for remove in removers:
            remove()
        m.remove_many(handles)

    def _count(self, key, site, value, splice):
        count, total = self.m.malloc(8), self.m.malloc(8)
        body = ast.seq(count.atomic_assign(count + 1), total.atomic_assign(total + value))
        snippet = body if site.guard is None else ast.if_(site.guard, body)
        self.sites[key], self.vars[key] = site, (count, total)
        return [self.m.insert_snippet(p, snippet, splice=splice) for p in site.points]

    def u64(self, address: int) -> int:
        return self.machine.read_u64(address)

    def _event_call(self, key) -> int:
        return self.image.address_of(f"event_{key[1]}")

    def _record_oracles(self, key, site: Site, truth):
        arg = self.arch.arg_regs
        call = self._event_call(key)
        at_site = self.at_site[key] = Oracle()
        at_entry = self.at_entry[key] = Oracle()

        def commit(machine, _addr):
            fbuffer = machine.reg(arg[0])
            if self.u64(self.u64(fbuffer + FBUFFER_FILE) + FILE_CALL) == call:
                at_site.count += 1

        def entry(machine, _addr):
            if self.u64(machine.reg(arg[0]) + FILE_CALL) != call:
                return
            kind, n = truth
            value = machine.reg(arg[n])
            at_entry.count += 1
            if kind == "task":
                at_entry.total += _signed(self.u64(value + self.pid_offset), 32)
            elif kind == "bio":
                at_entry.total += (self.u64(value + BIO_SIZE) & 0xFFFFFFFF) >> 9
            else:
                at_entry.total += self.u64(value + BIO_SECTOR)

        fn = self.image.function_at(site.points[0].address)
        return ([self.machine.hook_code(p.address, commit) for p in site.points]
                + [self.machine.hook_code(fn.address, entry)])

    def _syscall_oracles(self, key, site: Site):
        fn = self.image.function_at(site.points[0].address)
        at_site = self.at_site[key] = Oracle()
        at_entry = self.at_entry[key] = Oracle()
        current = self.image.address_of("current_task")
        regs_arg2 = PT_REGS_ARG2[self.arch.name]

        def hit(machine, _addr):
            at_site.count += 1
            if key[1].startswith("sys_exit"):
                at_site.total += _signed(machine.reg(self.arch.ret_reg), 64)

        def entry(machine, _addr):
            at_entry.count += 1
            if key[1] == "sys_enter_write":
                at_entry.total += self.u64(machine.reg(self.arch.arg_regs[0]) + regs_arg2)
            else:   # getpid returns the caller's pid
                at_entry.total += _signed(self.u64(self.u64(current) + self.pid_offset), 32)

        removers = [self.machine.hook_code(p.address, hit) for p in site.points]
        return removers + [self.machine.hook_code(fn.address, entry)]

    # --- the workload's own numbers -------------------------------------------------------
    def kernel(self, name: str, offset: int = 0) -> int:
        return int.from_bytes(self.m.copy_from_kernel(self.image.address_of(name) + offset, 8),
                              "little")

    def devices(self, offset: int) -> int:
        return sum(self.kernel("blkdevs", i * BDEV_SIZE + offset) for i in range(NR_BLKDEV))

    def workload_count(self, key) -> int:
        return {
            ("sched", "sched_switch"): lambda: self.kernel("runqueue", RQ_NR_SWITCHES),
            ("sched", "sched_waking"): lambda: self.kernel("runqueue", RQ_NR_WAKING),
            ("sched", "sched_wakeup"): lambda: self.kernel("runqueue", RQ_NR_WAKEUPS),
            ("raw", "sched_wakeup"): lambda: self.kernel("runqueue", RQ_NR_WAKEUPS),
            ("block", "block_rq_insert"): lambda: self.kernel("bios_submitted"),
            ("block", "block_rq_issue"): lambda: self.devices(BDEV_IOS),
            ("block", "block_rq_complete"): lambda: self.kernel("bios_completed"),
            ("syscalls", "sys_enter_write"): lambda: self.kernel("syscall_counts", 8 * NR_WRITE),
            ("syscalls", "sys_exit_getpid"): lambda: self.kernel("syscall_counts", 8 * NR_GETPID),
        }[key]()


@pytest.fixture(scope="module", params=[("toy", "auto"), ("toy", "trap"), ("toy-arm64", "auto")],
                ids=["toy", "toy-trap", "toy-arm64"])
def run(request):
    image, splice = request.param
    needs_image(image)
    r = ToyRun(image, splice)
    yield r
    r.m.detach()


@pytest.mark.parametrize("key", [*RECORD_EVENTS, *SYSCALL_EVENTS, ("raw", "sched_wakeup")])
def test_each_event_counts_what_every_oracle_counts(run, key):
    count, total = run.counts[key]
    expected = run.workload_count(key)
    oracle_key = ("sched", "sched_wakeup") if key[0] == "raw" else key
    assert count == expected > 0, (key, count, expected)
    assert run.at_site.get(key, run.at_entry[oracle_key]).count == count
    assert run.at_entry[oracle_key].count == count


@pytest.mark.parametrize("key", [*RECORD_EVENTS, *SYSCALL_EVENTS, ("raw", "sched_wakeup")])
def test_each_field_sums_to_the_truth_read_from_the_kernels_objects(run, key):
    count, total = run.counts[key]
    oracle_key = ("sched", "sched_wakeup") if key[0] == "raw" else key
    signed_total = _signed(total, 64)
    assert signed_total == run.at_entry[oracle_key].total, key
    if key[1].startswith("sys_exit"):
        assert signed_total == run.at_site[key].total   # the return register at each exit


def test_field_sums_agree_with_the_workloads_own_accounts(run):
    sectors = run.devices(BDEV_READ) + run.devices(BDEV_WRITTEN)
    assert run.counts["block", "block_rq_issue"][1] == sectors > 0
    errors = run.kernel("bio_errors")
    assert run.error_total == -EIO * errors


def test_the_guard_tells_apart_the_events_of_one_class(run):
    waking, wakeup = run.counts["sched", "sched_waking"][0], run.counts["sched", "sched_wakeup"][0]
    assert waking > wakeup > 0     # every wake_up_process() call, and those that woke a task
    insert = run.counts["block", "block_rq_insert"][0]
    issue = run.counts["block", "block_rq_issue"][0]
    assert run.unguarded_count == insert + issue and issue > 0
    assert run.sites["sched", "sched_waking"].points == run.sites["sched", "sched_wakeup"].points


def test_instrumented_runs_end_in_the_plain_runs_state(run):
    assert run.m.run(seed=run.SEED).checksum == run.checksum
    assert run.tactics == ({"trap"} if run.splice == "trap" else run.tactics) and run.tactics


def test_syscall_sites_read_the_wrappers_regs_and_number(run):
    prefix = run.arch.syscalls.wrapper_prefix
    enter = run.sites["syscalls", "sys_enter_write"]
    assert [p.kind for p in enter.points] == [PointKind.ENTRY]
    assert run.image.function_at(enter.points[0].address).name == f"{prefix}write"
    assert enter.record is None and enter.guard is None
    assert ast.same(enter.values["__syscall_nr"], ast.Const(NR_WRITE))
    table = run.image.address_of("sys_call_table")
    assert run.u64(table + 8 * NR_WRITE) == run.image.address_of(f"{prefix}write")
    exit_ = run.sites["syscalls", "sys_exit_getpid"]
    assert {p.kind for p in exit_.points} == {PointKind.EXIT}
    assert ast.same(exit_.values["ret"], ast.retval())


def test_record_sites_are_the_commit_call_of_the_class_function(run):
    site = run.sites["sched", "sched_switch"]
    (point,) = site.points
    fn = run.image.function_at(point.address)
    assert fn.name == "trace_event_raw_event_sched_switch" and point.kind is PointKind.CALLSITE
    insn = next(run.arch.decode(run.image.read(point.address, 16), point.address))
    assert insn.target == run.image.address_of("trace_event_buffer_commit")
    assert site.values == {}


def test_a_data_loc_field_holds_its_length_and_offset(run):
    # block_rq's cmd is "" after the record's fixed part: (1 << 16) | its size
    (event,) = run.tp.events("block", "block_rq_issue")
    cmd = event.field("cmd")
    assert cmd.data_loc and cmd.offset == 56
    site = run.sites["block", "block_rq_issue"]
    words = run.m.malloc(8)
    snippet = ast.if_(site.guard, words.atomic_assign(
        words + ast.load(site.record + cmd.offset, 4)))
    handles = [run.m.insert_snippet(p, snippet) for p in site.points]
    try:
        run.m.run(seed=run.SEED)
    finally:
        run.m.remove_many(handles)
    issue = run.counts["block", "block_rq_issue"][0]
    assert run.m.read(words) == issue * (1 << 16 | (cmd.offset + 4))


def test_the_toy_lists_its_events_as_wildcards_expand_them(run):
    names = [str(e) for e in run.tp.events("sched", "sched_*")]
    assert names == ["sched:sched_switch", "sched:sched_wakeup", "sched:sched_waking"]
    assert [str(e) for e in run.tp.events("block", "block_rq_[ci]*")] == [
        "block:block_rq_complete", "block:block_rq_insert", "block:block_rq_issue"]
    syscalls = run.tp.events("syscalls", "sys_enter_*")
    assert "syscalls:sys_enter_getpid" in map(str, syscalls) and len(syscalls) == 18
    (switch,) = run.tp.events("sched", "sched_switch")
    assert [(f.name, f.offset, f.size, f.signed, f.ctype) for f in switch.args] == [
        ("prev_comm", 8, 16, True, "char[16]"), ("prev_pid", 24, 4, True, "pid_t"),
        ("prev_prio", 28, 4, True, "int"), ("prev_state", 32, 8, True, "long"),
        ("next_comm", 40, 16, True, "char[16]"), ("next_pid", 56, 4, True, "pid_t"),
        ("next_prio", 60, 4, True, "int")]
    (write,) = run.tp.events("syscalls", "sys_enter_write")
    assert [(f.name, f.offset, f.size, f.signed) for f in write.args] == [
        ("__syscall_nr", 8, 4, True), ("fd", 16, 8, False), ("buf", 24, 8, False),
        ("count", 32, 8, False)]


def test_enable_and_disable_change_nothing_on_the_toy(run):
    events = run.tp.events("sched", "*")
    run.tp.enable(events)
    run.tp.enable(events)
    assert run.tp.instance is None
    run.tp.disable()
    run.tp.disable()


# --- bad input: a specific error, nothing changed -----------------------------------------------
@pytest.fixture(scope="module")
def toy():
    m = Manager.attach("unicorn:toy")
    yield m
    m.detach()


def _unchanged(m, attempt):
    before = (m.text_snapshot(), dict(m.splices()))
    with pytest.raises(TracepointError) as err:
        attempt()
    assert (m.text_snapshot(), dict(m.splices())) == before
    return err.value


def test_an_unknown_event_suggests_close_names(toy):
    tp = Tracepoints(toy)
    err = _unchanged(toy, lambda: tp.events("sched", "sched_swich"))
    assert isinstance(err, UnknownTracepoint) and err.code == "unknown-tracepoint"
    assert "sched:sched_switch" in err.suggestions
    assert isinstance(_unchanged(toy, lambda: tp.events("nosuch", "*")), UnknownTracepoint)


@pytest.mark.parametrize("category,name", [("sched", "sched switch"), ("", "x"), ("sched", "[ab"),
                                           ("sched", "a/b"), ("sched:x", "y")])
def test_a_bad_pattern_is_refused(toy, category, name):
    tp = Tracepoints(toy)
    err = _unchanged(toy, lambda: tp.events(category, name))
    assert isinstance(err, BadTracepointPattern) and err.code == "tracepoint-pattern"


def test_an_event_without_a_site_is_refused_with_its_reason(toy):
    tp = Tracepoints(toy)
    (exit_read,) = tp.events("syscalls", "sys_exit_read")
    err = _unchanged(toy, lambda: tp.site(exit_read))
    assert isinstance(err, NoTracepointSite) and "tail call" in str(err)
    ghost = Event("syscalls", "sys_enter_nosuch", ())
    assert "__x64_sys_nosuch" in str(_unchanged(toy, lambda: tp.site(ghost)))
    assert isinstance(_unchanged(toy, lambda: tp.site(Event("sched", "nosuch", ()))),
                      UnknownTracepoint)
    err = _unchanged(toy, lambda: tp.raw_site("sys_enter_write"))
    assert isinstance(err, NoTracepointSite) and "raw_syscalls" in str(err)
    assert isinstance(_unchanged(toy, lambda: tp.raw_site("sched_*")), BadTracepointPattern)


# --- QEMU: the toy booted for real counts what unicorn counts ------------------------------------
@pytest.mark.slow
def test_qemu_counts_what_unicorn_counts():
    import shutil

    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
    keys = [("sched", "sched_switch"), ("sched", "sched_waking"), ("block", "block_rq_issue"),
            ("syscalls", "sys_enter_write")]
    seed, iterations = 7, 300
    out = {}
    for spec in ("unicorn:toy", "qemu:toy"):
        with Manager.attach(spec) as m:
            tp = Tracepoints(m)
            counters, handles = {}, []
            for key in keys:
                (event,) = tp.events(*key)
                site = tp.site(event)
                c = counters[key] = m.malloc(8)
                body = c.atomic_assign(c + 1)
                snippet = body if site.guard is None else ast.if_(site.guard, body)
                handles += [m.insert_snippet(p, snippet) for p in site.points]
            m.run(seed=seed, iterations=iterations)
            out[spec] = {k: m.read(v) for k, v in counters.items()}
            switches = int.from_bytes(m.copy_from_kernel(
                m.target.image.address_of("runqueue") + RQ_NR_SWITCHES, 8), "little")
            assert out[spec]["sched", "sched_switch"] == switches > 0
            m.remove_many(handles)
    assert out["qemu:toy"] == out["unicorn:toy"]


# --- the live testbed (Debian's 6.1 kernel) ---------------------------------------------------------
GETPID_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Makes exactly N getpid system calls (not glibc's getpid, whatever it caches). */
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, i, s = 0;
    for (i = 0; i < n; i++)
        s += syscall(SYS_getpid);
    printf("%ld\n", i);
    return s == 0;
}
"""
N_GETPID = 20_000


@pytest.fixture(scope="module")
def live(testbed):  # noqa: F811
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    yield m
    m.detach()


def _available(m) -> list[tuple[str, str]]:
    text = m.target.tracefs("/sys/kernel/tracing/available_events")
    return [tuple(line.split(":", 1)) for line in text.split()]


@pytest.mark.live
@pytest.mark.slow
def test_live_events_are_what_tracefs_lists(live):
    import fnmatch

    tp = Tracepoints(live)
    listed = sorted(n for c, n in _available(live) if c == "sched" and fnmatch.fnmatch(n, "sched_*"))
    found = tp.events("sched", "sched_*")
    assert [e.name for e in found] == listed and "sched_switch" in listed
    assert {e.category for e in found} == {"sched"}
    (switch,) = tp.events("sched", "sched_switch")
    assert switch.fields == parse_format(SCHED_SWITCH, "sched").fields
    (openat,) = tp.events("syscalls", "sys_enter_openat")
    assert openat.fields == parse_format(SYS_ENTER_OPENAT, "syscalls").fields
    with pytest.raises(UnknownTracepoint):
        tp.events("sched", "sched_nosuch_event")


@pytest.mark.live
@pytest.mark.slow
def test_live_sites_are_where_the_design_puts_them(live):
    tp = Tracepoints(live)
    image = live.target.image
    (switch,) = tp.events("sched", "sched_switch")
    site = tp.site(switch)
    (point,) = site.points
    assert image.function_at(point.address).name == "trace_event_raw_event_sched_switch"
    insn = next(live.arch.decode(image.read(point.address, 16), point.address))
    assert insn.target == image.address_of("trace_event_buffer_commit")
    assert site.record is not None and site.guard is not None
    # the event call the guard compares with names the event, read through it
    assert tp.catalogue.call(switch) == image.address_of("event_sched_switch")
    (openat,) = tp.events("syscalls", "sys_enter_openat")
    enter = tp.site(openat)
    assert [image.function_at(p.address).name for p in enter.points] == ["__x64_sys_openat"]
    assert {"dfd", "filename", "flags", "mode", "__syscall_nr"} <= set(enter.values)
    assert ast.same(enter.values["__syscall_nr"], ast.Const(257))     # x86-64's openat
    (getpid_exit,) = tp.events("syscalls", "sys_exit_getpid")
    exits = tp.site(getpid_exit)
    assert exits.points and {p.kind for p in exits.points} == {PointKind.EXIT}
    assert ast.same(exits.values["__syscall_nr"], ast.Const(39))


def _comm_is(name: str):
    """The current task's comm is ``name`` (at most 15 characters)."""
    raw = name.encode().ljust(16, b"\0")
    return ast.land(ast.comm(0) == int.from_bytes(raw[:8], "little"),
                    ast.comm(1) == int.from_bytes(raw[8:], "little"))


@pytest.mark.live
@pytest.mark.slow
def test_live_getpid_sites_count_what_the_kernels_kprobe_counts(live):
    """The program's own calls, told by its comm, are exactly N at both sites; all
    calls at the entry are what the kernel's kprobe on the wrapper counts, less
    other processes' calls in the moments between reading the two."""
    from ksim.live.testing import dmesg_problems, program

    tp = Tracepoints(live)
    enter = tp.site(tp.events("syscalls", "sys_enter_getpid")[0])
    exit_ = tp.site(tp.events("syscalls", "sys_exit_getpid")[0])
    entries, mine_in, mine_out = live.malloc(8), live.malloc(8), live.malloc(8)
    mine = _comm_is("getpid_loop")
    handles = [live.insert_snippet(p, ast.seq(
        entries.atomic_assign(entries + 1),
        ast.if_(mine, mine_in.atomic_assign(mine_in + 1)))) for p in enter.points]
    # getpid returns the caller's pid, its one thread's: common_pid
    handles += [live.insert_snippet(p, ast.if_(
        ast.land(mine, exit_.values["ret"] == exit_.values["common_pid"]),
        mine_out.atomic_assign(mine_out + 1))) for p in exit_.points]
    wrapper = live.find_function("__x64_sys_getpid")
    loop = program("getpid_loop", GETPID_LOOP)
    try:
        with live.oracle(wrapper.address) as oracle:
            k0, e0 = oracle.count, live.read(entries)
            result = live.run(while_cmd=f"{loop} {N_GETPID}")
            e1, k1 = live.read(entries), oracle.count
    finally:
        live.remove_many(handles)
    assert result.output.strip() == str(N_GETPID)
    assert live.read(mine_in) == live.read(mine_out) == N_GETPID
    assert N_GETPID <= e1 - e0 <= k1 - k0 <= e1 - e0 + 50
    assert dmesg_problems(live.target) == []


def _enable_or_skip(tp, events):
    from ksim.errors import ProtocolError
    from ksim.trace.tracepoints import TraceInstanceError

    try:
        tp.enable(events)
    except TraceInstanceError as exc:
        if isinstance(exc.__cause__, ProtocolError) and "mkdir" in str(exc.__cause__) \
                or "must be r, w or a" in str(exc):
            pytest.skip(f"the testbed's kerninstd makes no trace instances yet: {exc}")
        raise


@pytest.mark.live
@pytest.mark.slow
def test_live_sched_switch_counts_in_private_instances_and_they_go(live):
    """Two providers, each with its own instance: each guard counts its own
    instance's calls of the class function, an event_call-only guard both."""
    from ksim.errors import TargetError
    from ksim.live.testing import dmesg_problems

    first, second = Tracepoints(live), Tracepoints(live)
    (switch,) = first.events("sched", "sched_switch")
    sites = [first.site(switch), second.site(switch)]
    counters = [live.malloc(8), live.malloc(8), live.malloc(8)]
    handles = []
    try:
        _enable_or_skip(first, [switch])
        _enable_or_skip(second, [switch])
        for tp in (first, second):
            enabled = live.target.tracefs(
                f"/sys/kernel/tracing/instances/{tp.instance}/events/sched/sched_switch/enable")
            assert enabled.strip() == "1"
        assert sites[0].points == sites[1].points
        call = first.catalogue.call(switch)
        either = ast.load(ast.load(ast.reg(live.arch.arg_regs[0]) + 16) + 16) == ast.Const(call)
        guards = [sites[0].guard, sites[1].guard, either]
        # one snippet per hit, so that the three counts start and stop together
        snippet = ast.seq(*(ast.if_(g, c.atomic_assign(c + 1))
                            for g, c in zip(guards, counters, strict=True)))
        handles = live.insert_many(sites[0].points, lambda _p: snippet)
        live.run(while_cmd="for i in 1 2 3 4 5; do sleep 0.05; done")
        live.remove_many(handles)
        handles = []
        a, b, both = (live.read(c) for c in counters)
        assert a > 0 and b > 0 and both == a + b
        # each switch calls the class function once per instance, the two in turn:
        # the splice goes in and out between two calls of one switch at most
        assert abs(a - b) <= 2
    finally:
        live.remove_many(handles)
        names = [tp.instance for tp in (first, second)]
        first.disable()
        second.disable()
    for name in names:
        if name is not None:
            with pytest.raises(TargetError):
                live.target.tracefs(f"/sys/kernel/tracing/instances/{name}/tracing_on")
    assert first.instance is None and second.instance is None
    assert dmesg_problems(live.target) == []


@pytest.mark.live
@pytest.mark.slow
def test_live_an_event_that_cannot_be_enabled_leaves_no_instance(live):
    from ksim.trace.tracepoints import TraceInstanceError

    tp = Tracepoints(live)
    (switch,) = tp.events("sched", "sched_switch")
    ghost = Event("sched", "sched_nosuch", switch.fields)
    before = live.target.tracefs("/sys/kernel/tracing/available_events")
    with pytest.raises(TraceInstanceError) as err:
        _enable_or_skip(tp, [switch, ghost])
    assert "sched_nosuch" in str(err.value)
    assert tp.instance is None and tp.enabled == []
    assert live.target.tracefs("/sys/kernel/tracing/available_events") == before


@pytest.mark.live
@pytest.mark.slow
def test_live_rawtracepoint_sees_what_the_event_records(live):
    """rawtracepoint:sched_switch at the class function's entry, and the event at its
    commit call, counted from one change: equal, but for a call in flight."""
    tp = Tracepoints(live)
    (switch,) = tp.events("sched", "sched_switch")
    record = tp.site(switch)
    raw = tp.raw_site("sched_switch")
    assert raw.event == switch and raw.record is None
    assert [p.kind for p in raw.points] == [PointKind.ENTRY]
    at_record, at_entry, next_pids = live.malloc(8), live.malloc(8), live.malloc(8)
    pid_offset = live.target.abi.task_pid_offset
    snippets = {record.points[0].address: ast.if_(record.guard, at_record.atomic_assign(
        at_record + 1)),
                raw.points[0].address: ast.if_(raw.guard, ast.seq(
                    at_entry.atomic_assign(at_entry + 1),
                    # TP_PROTO(bool preempt, prev, next, prev_state): arg2 is next
                    next_pids.atomic_assign(next_pids + ast.load(raw.values["arg2"] + pid_offset,
                                                                 4, True))))}
    handles = []
    try:
        _enable_or_skip(tp, [switch])
        handles = live.insert_many(record.points + raw.points, lambda p: snippets[p.address])
        live.run(while_cmd="sleep 0.2")
        live.remove_many(handles)
        handles = []
    finally:
        live.remove_many(handles)
        tp.disable()
    n = live.read(at_entry)
    assert n > 0 and abs(live.read(at_record) - n) <= 2
    assert live.read(next_pids) > 0
