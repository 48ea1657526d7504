"""Target.apply on the live kernel: a change is one request and one module batch, all
or nothing; planning and dry runs cost no request per point."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ksim.core import Write
from ksim.errors import KsimError, TargetFault, UnknownHandle, UnsafeSite
from ksim.kapi import Manager
from ksim.live.client import KprobeCounter, LiveTarget
from ksim.live.testing import dmesg_problems, getppid_loop, plain_site, routes_of, target, testbed  # noqa: F401
from ksim.splice.patch import Change
from ksim.targets.base import Capabilities

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"


@contextmanager
def requests(t: LiveTarget) -> Iterator[Counter[str]]:
    """The requests ``t`` sends while inside, by op (its own connection's log)."""
    seen: Counter[str] = Counter()
    send = t.conn.send

    def counted(op: str, *args, **kwargs):
        seen[op] += 1
        return send(op, *args, **kwargs)

    t.conn.send = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del t.conn.send


def test_capabilities_are_declared(target: LiveTarget) -> None:
    caps = target.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.traps and caps.hazards and caps.keep and not caps.python_hooks
    assert caps.exec == bool(target.info["allow_exec"])
    assert caps.oracles == ("kprobe",) and caps.nr_cpus >= 1
    assert caps.max_items and caps.max_bytes


def test_an_insert_and_a_removal_are_one_request_each(testbed: dict) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        counter = m.malloc(8)
        bump = counter.atomic_assign(counter + 1)
        first = m.insert_snippet(m.entry_point("__x64_sys_getpgrp"), bump)  # takes an area
        point = m.entry_point(FUNC)
        with requests(m.target) as seen:
            h = m.insert_snippet(point, bump, splice="trap")
        assert seen == Counter(poke=1)
        site = m.patch_of(h).trap_site
        assert routes_of(m.target)[site] == m.patch_of(h).routes[0][1]
        # a second snippet at the trap: a new patch, the route re-pointed, one request
        with requests(m.target) as seen:
            h2 = m.insert_snippet(point, bump, splice="trap")
        assert seen == Counter(poke=1)
        assert routes_of(m.target)[site] == m.patch_of(h2).routes[0][1]
        with requests(m.target) as seen:
            m.remove_many([h, h2])
        assert seen == Counter(poke=1)
        assert site not in routes_of(m.target)
        m.remove_snippet(first)
        assert dmesg_problems(m.target) == []
    finally:
        m.detach()


def test_a_refused_part_changes_nothing(testbed: dict) -> None:
    """Patch code, a route and a text write the kernel refuses (the ftrace location at
    the function's entry), in one change: the module refuses the whole batch."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    t = m.target
    try:
        fn = m.find_function(FUNC)
        site = plain_site(t, FUNC)
        code = t.alloc_code(64, near=site)
        area, entry = t.read(code, 16), t.read(fn.address, 5)
        change = Change(code=(Write(code, area, bytes(16)),), routes=((site, code),),
                        text=(Write(fn.address, entry, t.arch.jmp(fn.address, code)),))
        with requests(t) as seen, pytest.raises(UnsafeSite, match="ftrace"):
            t.apply(change)
        assert seen["poke"] == 1
        assert t.read(code, 16) == area and t.read(fn.address, 5) == entry
        assert routes_of(t) == {}
        with pytest.raises(UnknownHandle):
            t.apply(Change(routes=((site, 0),)))
        t.free_code(code)
    finally:
        m.detach()


def test_dry_runs_and_a_batch_cost_no_request_per_point(testbed: dict) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        funcs = [f for f in m.target.image.functions if f.name.startswith("tcp_")]
        m.spliceable_entries(funcs)  # analyses them (reads text once, kept)
        with requests(m.target) as seen:
            ok, refused = m.spliceable_entries(funcs)
        assert len(ok) > 200, refused
        # the kernel's hazards of every function's first bytes, asked at once (and of
        # the padding of the odd point that needs a springboard); an area to plan in;
        # their text was read ahead by the first look (read_ranges), and is kept
        assert set(seen) <= {"hazard_table", "alloc_code", "free_code"}, seen
        assert 1 <= seen["hazard_table"] <= 3, seen
        counters = dict(zip((p.address for _, p in ok), m.malloc_array(len(ok)), strict=True))
        with requests(m.target) as seen:
            hs = m.insert_many([p for _, p in ok], lambda p: counters[p.address].atomic_assign(
                counters[p.address] + 1))
        # one change; an area for the batch's patch code (its bytes the module's fill:
        # not read); the kernel's word on the batch's text and on the padding its
        # springboards may use, each asked at once
        assert seen["hazard_table"] <= 4, seen
        assert seen - Counter(hazard_table=4) == Counter(poke=1, alloc_code=1), seen
        with requests(m.target) as seen:
            m.remove_many(hs)
        assert seen == Counter(poke=1, free_code=1), seen  # the area goes back with them
    except KsimError:
        raise
    finally:
        m.detach()


def test_a_named_functions_entry_is_asked_about_at_once(testbed: dict) -> None:
    """A command naming one function finds its entry point looking ahead (as a
    wildcard's batch does): its head's hazards, its text and the digests of what it
    reaches in one request each, and no chunk of text read; the same point as
    without looking ahead."""
    from ksim.analysis.store import store_for

    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        store_for(m.target.image, build_missing=True)
        with requests(m.target) as seen, m.looking_ahead(["vfs_read"]):
            point = m.entry_point("vfs_read")
        assert seen["read"] == 0 and seen["hazard_table"] == 1 and seen["read_ranges"] == 1, seen
        assert seen["digests"] <= 1, seen
    finally:
        m.detach()
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        assert m.entry_point("vfs_read") == point
    finally:
        m.detach()


def test_a_batchs_springboards_ask_about_their_padding_at_once(testbed: dict) -> None:
    """A wildcard inserted as the command line does (entries found unplanned, then
    one batch): the points that take a springboard look at the padding around them
    with one read of the functions there and one question on its hazards, whatever
    their number, and no text is read again (pieces read ahead that overlap are one)."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        funcs = [f for f in m.target.image.functions if f.name.startswith("re")]
        with m.one_look():
            ok, _refused = m.spliceable_entries(funcs, plan=False)
            points = [p for _, p in ok]
            counters = dict(zip((p.address for p in points), m.malloc_array(len(points)),
                                strict=True))
            refused: dict[int, str] = {}
            with requests(m.target) as seen:
                hs = m.insert_many(points, lambda p: counters[p.address].atomic_assign(
                    counters[p.address] + 1), refused=refused)
        tactics = Counter(m.patch_of(h).tactic for h in hs)
        assert tactics["springboard"] >= 3, tactics
        assert seen["hazard_table"] <= 1 and seen["read_ranges"] <= 1, seen
        assert seen["read"] <= 1, seen      # the patch area's old bytes, once
        m.remove_many(hs)
    finally:
        m.detach()


def test_ftraces_own_trampolines_are_never_spliced(testbed: dict) -> None:
    """The kernel rewrites the calls inside ftrace_caller and ftrace_regs_caller
    whenever a tracer or an ftrace-based kprobe comes or goes: a wildcard over every
    function must leave them out (a splice there went stale under a batch)."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        names = ("ftrace_caller", "ftrace_call", "ftrace_regs_caller", "ftrace_regs_call")
        funcs = [f for f in m.target.image.functions if f.name in names]
        assert funcs, "the testbed kernel has ftrace's trampolines"
        ok, refused = m.spliceable_entries(funcs)
        assert ok == [] and set(refused) == {f.name for f in funcs}, (ok, refused)
        assert all("blacklist" in why or "kprobes" in why for why in refused.values()), refused
    finally:
        m.detach()


def test_freed_init_code_is_refused_before_it_is_read(testbed: dict) -> None:
    """Functions whose text the kernel freed after boot (init code, still in kallsyms)
    are refused by the batch's one question, with the planner's own words, and
    nothing of them is read or analysed."""
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        funcs = [f for f in m.target.image.functions
                 if f.name in ("tcp_init", "tcp_v4_init", "tcp_metrics_init")]
        assert funcs, "the testbed kernel lists tcp's init functions"
        with requests(m.target) as seen:
            ok, refused = m.spliceable_entries(funcs)
        assert ok == [] and set(refused) == {f.name for f in funcs}, refused
        for f in funcs:
            assert refused[f.name] == (f"{f.address:#x} ({f.name}+0x0) is not kernel or module "
                                       "text: ksim never overwrites or moves it")
        assert seen == Counter(hazard_table=1), seen
    finally:
        m.detach()


def test_requests_sent_ahead_are_answered_in_order(target: LiveTarget) -> None:
    """Requests sent without waiting (Connection.send) are answered one by one, in
    order: collecting a later one keeps the earlier replies for their own collect,
    a refused request's error comes at its own collect and nowhere else, and a
    reply is given once."""
    from ksim.errors import ProtocolError

    conn = target.conn
    info = conn.send("info")
    bad = conn.send("read", address=0, size=8)
    again = conn.send("lookup", name=FUNC)
    assert int(conn.collect(again)["address"]) == target.lookup(FUNC)
    assert conn.collect(info)["kernel"] == target.info["kernel"]
    with pytest.raises(KsimError):
        conn.collect(bad)
    with pytest.raises(ProtocolError, match="waiting"):
        conn.collect(bad)
    # deferred digests are read when one of them is first asked for, or before the
    # next request's reply
    func = target.image.function(FUNC)
    target.prefetch_digests([(func.address, func.size)])
    assert target.known_digest(func.address, func.size) is not None



def test_the_image_reads_text_as_it_was_before_this_clients_pokes(testbed: dict) -> None:
    """After a batch's pokes, the image (what the client analyses) reads every text
    byte as it was before them, in reads that hold a poked byte, start or end inside
    the poked bytes or hold none; a digest of a range holding a poked byte is not
    trusted (read instead); the target's own read gives the bytes as they are.  Once
    the batch is out, both agree again."""
    from ksim.analysis.store import code_digest

    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    t = m.target
    try:
        funcs = [m.find_function(n) for n in (FUNC, "__x64_sys_getpgrp", "__x64_sys_getpid")]
        points = [m.entry_point(f) for f in funcs]
        before = {f.address: t.read(f.address, f.size) for f in funcs}
        counter = m.malloc(8)
        handles = m.insert_many(points, counter.atomic_assign(counter + 1), splice="jmp")
        for f, p in zip(funcs, points, strict=True):
            now = t.read(f.address, f.size)
            at = p.address - f.address
            assert now != before[f.address] and now[at] != before[f.address][at]
            assert t.image.read(f.address, f.size) == before[f.address]
            for lo, hi in ((at + 2, f.size), (0, at + 3), (at + 1, at + 4), (0, at)):
                assert t.image.read(f.address + lo, hi - lo) == before[f.address][lo:hi]
            t.prefetch_digests([(f.address, f.size), (f.address, at)])
            assert t.known_digest(f.address, f.size) is None
            assert t.known_digest(f.address, at) is not None
            assert t.known_digests([(f.address, f.size), (f.address, at)]) == \
                [None, code_digest(before[f.address][:at])]
        m.remove_many(handles)
        for f in funcs:
            assert t.read(f.address, f.size) == before[f.address] == t.image.read(f.address, f.size)
    finally:
        m.detach()


def test_a_new_patch_area_holds_the_fill_and_is_not_read(testbed: dict) -> None:
    """The module hands out a code block holding only its fill (kerninst.h: CLAIM),
    whatever freed patch code was there: a Manager writes its patches over bytes it
    knows without reading them, and they are the kernel's."""
    from ksim.live import abi

    funcs = ["__x64_sys_getppid", "__x64_sys_getpgrp", "__x64_sys_getuid", "__x64_sys_geteuid",
             "__x64_sys_getgid", "__x64_sys_getegid", "__x64_sys_gettid", "__x64_sys_getpid"]
    fill = abi.code_fill("x86_64")
    assert fill

    def attach() -> Manager:
        m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
        assert m.target.capabilities.code_fill == fill
        return m

    a = attach()
    points = [p for _, p in a.spliceable_entries(funcs, "jmp")[0]]
    assert len(points) >= 4
    counter = a.malloc(8)
    a.insert_many(points, lambda p: counter.atomic_assign(counter + 1), splice="jmp")
    (first,) = a._code._areas.values()
    used = (first.start, first.cursor - first.start)
    assert a.target.read(*used) != fill * used[1]
    a.detach()      # its block freed, its patch code still there
    b = attach()
    try:
        reads: list[tuple[int, int]] = []
        real = b.target.read
        b._code._read = lambda at, n: (reads.append((at, n)), real(at, n))[1]
        counter = b.malloc(8)
        getppid = next(p for p in points if p.function == FUNC)
        handles = b.insert_many([getppid], lambda p: counter.atomic_assign(counter + 1),
                                splice="jmp")
        (area,) = b._code._areas.values()
        assert reads == [] and len(area.shadow) < area.size
        assert bytes(area.shadow) == real(area.start, len(area.shadow))
        assert real(area.start + len(area.shadow), 256) == fill * 256
        # the block a's code was in, handed out again (blocks are taken until it is):
        # the fill, a's code gone
        taken = []
        while not any(at <= used[0] < at + 65536 for at in taken):
            assert len(taken) < 64, "a's block is not handed out again"
            taken.append(b.target.alloc_code(65536))
        assert real(*used) == fill * used[1]
        for at in taken:
            b.target.free_code(at)
        # the patch written over the fill counts what the kernel's own kprobe counts
        with KprobeCounter(b.target, b.target.lookup(FUNC)) as oracle:
            k0, c0 = oracle.count, b.read(counter)
            out = b.target.run(while_cmd=f"{getppid_loop()} 200").output
            c1, k1 = b.read(counter), oracle.count
        assert out.strip() == "200"
        assert 200 <= c1 - c0 <= 205 and abs((c1 - c0) - (k1 - k0)) <= 3, (c1 - c0, k1 - k0)
        b.remove_many(handles)
        assert dmesg_problems(b.target) == []
    finally:
        b.detach()


def test_a_data_write_waits_for_no_reply_and_its_error_comes_before_the_next_change(
        target: LiveTarget) -> None:
    """A write into one of this client's data areas is sent without waiting for its
    reply: the bytes are there for the next request (the daemon answers in order),
    and a refused write raises its own error at the next request, before a change
    goes in; a write anywhere else is answered at once."""
    t = target
    block = t.alloc_data(64)
    with requests(t) as seen:
        t.write(block + 8, b"\x11" * 16)
        assert t._posted, "the write waits for its reply"
        assert t.read(block, 32) == bytes(8) + b"\x11" * 16 + bytes(8)
    assert seen == Counter({"write": 1, "read": 1}) and not t._posted
    # a block freed behind the client's back: its write is refused, and says so at
    # the next request (the change is not sent)
    t.conn.request("free_data", address=block)
    t.write(block, b"\x22" * 8)
    with requests(t) as seen, pytest.raises(TargetFault, match="write: .* not inside a data-heap"):
        t.apply(Change(text=(Write(0, b"\x90", b"\x90"),)))
    assert seen == Counter() and not t._posted
    # outside this client's data areas: refused at once
    with requests(t) as seen, pytest.raises(TargetFault):
        t.write(t.text[0], b"\x33")
    assert seen == Counter({"write": 1}) and not t._posted
def test_digests_are_the_stores_digests_of_the_bytes_read(testbed: dict) -> None:
    """digests (whether text is still what a record was made from, without reading
    it): each row's digest is the analysis store's code_digest of the bytes a read
    of that row gives; an unreadable row is named; the image's records of a batch's
    callees are checked by digest, their bytes never read; rows the protocol does
    not allow are refused."""
    import struct

    from ksim.analysis.store import code_digest, store_for
    from ksim.errors import ProtocolError
    from ksim.live import protocol as wire

    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    t = m.target
    try:
        # text that stays: init code the kernel freed is memory reused by others,
        # whose bytes change between two reads
        funcs = [f for f in t.image.functions
                 if f.name.startswith("tcp_v4_") and not t.image.freed(f.address)][:50]
        rows = [(f.address, f.size) for f in funcs] + [(0x1000, 16)]
        table = struct.pack(f"<{2 * len(rows)}Q", *(x for r in rows for x in r)).hex()
        reply = t.conn.request("digests", ranges=table, kernel=True)
        got = bytes.fromhex(reply["digests"])
        assert reply["failed"] == [len(rows) - 1] and len(got) == wire.DIGEST * len(rows)
        for k, (a, n) in enumerate(rows[:-1]):
            assert int.from_bytes(got[8 * k:8 * k + 8], "little") == \
                code_digest(t.read(a, n, kernel=True)), hex(a)
        t.prefetch_digests(rows)
        assert t.known_digest(*rows[0]) == code_digest(t.read(*rows[0], kernel=True))
        assert t.known_digest(rows[0][0], rows[0][1] - 1) is None   # only the range asked
        assert t.known_digest(*rows[-1]) is None                    # unreadable: read later
        # asked at once, as a batch's reach is: each as asked alone, the oracle's
        asked = [*rows, (rows[0][0], rows[0][1] - 1)]
        assert t.image.known_digests(asked) == [t.known_digest(*r) for r in asked] == \
            [code_digest(t.read(a, n, kernel=True)) for a, n in rows[:-1]] + [None, None]
        for bad in (table[:-2], struct.pack("<2Q", funcs[0].address, 0).hex()):
            with pytest.raises(ProtocolError, match="digests"):
                t.conn.request("digests", ranges=bad, kernel=False)
    finally:
        m.detach()
    # a batch's callees are checked by digest: none of their bytes is read
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        store_for(m.target.image, build_missing=True)   # the records a batch relies on
        m.target.close()
        m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
        funcs = [f for f in m.target.image.functions if f.name.startswith("tcp_v4_")]
        with requests(m.target) as seen:
            ok, _refused = m.spliceable_entries(funcs)
        assert ok and seen["digests"] >= 1 and seen["read"] <= 2, seen
        # the kernel's tables came with the store (kept when it was made), unread
        assert "tables" in m.target.image.__dict__ and seen["read_ranges"] == 1, seen
    finally:
        m.detach()


def test_the_module_reads_and_digests_rows_of_any_length(target: LiveTarget) -> None:
    """read_ranges and digests are one module call each (READ_ROWS, DIGEST_ROWS),
    whatever the rows: a row longer than one of the module's reads (MAX_IO) is read
    and hashed piece by piece, as a read of it alone gives it; a row at an address
    no kernel memory is at (user space, not canonical) is named and zeros; a
    row of no bytes is refused."""
    from ksim.analysis.store import code_digest
    from ksim.errors import ProtocolError
    from ksim.live import abi
    from ksim.live.client import _table

    start, _end = target.text
    big = abi.LIMITS["MAX_IO"] * 3 + 123
    rows = [(start, big), (0x1000, 16), (0x8000_0000_0000_0000, 8), (start + big, 7)]
    table = _table(rows)
    reply = target.conn.request("read_ranges", ranges=table, kernel=False)
    data = bytes.fromhex(reply["data"])
    assert reply["failed"] == [1, 2] and len(data) == big + 16 + 8 + 7
    assert data[:big] == target.read(start, big) and data[big:big + 24] == bytes(24)
    assert data[-7:] == target.read(start + big, 7)
    reply = target.conn.request("digests", ranges=table, kernel=False)
    sums = bytes.fromhex(reply["digests"])
    assert reply["failed"] == [1, 2] and sums[8:24] == bytes(16)
    assert int.from_bytes(sums[:8], "little") == code_digest(data[:big])
    assert int.from_bytes(sums[24:], "little") == code_digest(data[-7:])
    with pytest.raises(ProtocolError, match="digests"):
        target.conn.request("digests", ranges=_table([(start, 0)]), kernel=False)


def test_text_read_ahead_is_the_text_read_one_range_at_a_time(testbed: dict) -> None:
    """read_ranges (the text a batch reads, fetched ahead): each range's bytes are
    the ones a read of it alone gives, end to end; a range that cannot be read (no
    kernel memory there) is named, not fatal; rows the protocol does not
    allow are refused before anything is read."""
    import struct

    from ksim.errors import ProtocolError
    from ksim.live import protocol as wire

    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    t = m.target
    try:
        # text that stays: init code the kernel freed is memory reused by others,
        # whose bytes change between two reads
        funcs = [f for f in t.image.functions
                 if f.name.startswith("tcp_v4_") and not t.image.freed(f.address)][:50]
        assert len(funcs) > 20
        rows = [(f.address, f.size) for f in funcs] + [(0x1000, 16)]
        table = struct.pack(f"<{2 * len(rows)}Q", *(x for r in rows for x in r)).hex()
        reply = t.conn.request("read_ranges", ranges=table, kernel=True)
        data = bytes.fromhex(reply["data"])
        assert reply["failed"] == [len(rows) - 1]
        at = 0
        for a, n in rows[:-1]:
            assert data[at:at + n] == t.read(a, n, kernel=True), hex(a)
            at += n
        assert data[at:] == bytes(16)
        # the image's reads of what was read ahead need no request
        t.prefetch_text(rows)
        with requests(t) as seen:
            for f in funcs:
                assert t.image.read(f.address, f.size) == t.read(f.address, f.size, kernel=True)
        assert seen == Counter(read=len(funcs)), seen     # only the check's own reads
        # a running kernel's tables (bug, extable, jump labels, static calls): one request
        fresh = LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
        try:
            image = fresh.image
            with requests(fresh) as seen:
                tables = image.tables
            assert seen == Counter(read_ranges=1), seen
            assert tables.sites == t.image.tables.sites
        finally:
            fresh.close()
        for bad in (table[:-2], struct.pack("<2Q", funcs[0].address, 0).hex(),
                    struct.pack("<4Q", funcs[0].address, wire.MAX_READ,
                                funcs[1].address, 1).hex()):
            with pytest.raises(ProtocolError, match="read_ranges"):
                t.conn.request("read_ranges", ranges=bad, kernel=False)
    finally:
        m.detach()


def test_requests_sent_ahead_never_wait_on_each_other(target: LiveTarget) -> None:
    """Large requests sent without reading their replies, whose replies fill every
    buffer between daemon and client: the daemon stops reading requests while a
    reply waits to be read, and the client is still sending; the client reads the
    replies as they come (kept for their collect), so neither waits for the other."""
    import struct

    start, end = target.text
    rows, width = 16384, 64                         # 256 KB a request, 1 MB a reply
    tables = []
    for k in range(80):
        at = start + (k * rows * width) % (end - start - rows * width)
        tables.append((at, struct.pack(f"<{2 * rows}Q", *(x for i in range(rows)
                                                         for x in (at + i * width, width))).hex()))
    ids = [target.conn.send("read_ranges", ranges=table, kernel=True) for _, table in tables]
    got = [bytes.fromhex(target.conn.collect(i)["data"]) for i in ids]
    assert [len(g) for g in got] == [rows * width] * len(ids)
    at = tables[1][0]
    assert got[1][:4096] == target.read(at, 4096, kernel=True)


def test_a_batch_asks_in_chunks_answered_while_it_analyses(testbed: dict, monkeypatch) -> None:
    """A batch's questions about its functions (hazards, text) go in chunks of
    AHEAD_CHUNK functions, all sent before any answer is read; each is read when
    first needed, and the verdicts are those of one question about all."""
    from ksim.splice import sites

    verdicts = []
    for chunk in (10**9, 64):
        monkeypatch.setattr(sites, "AHEAD_CHUNK", chunk)
        m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
        try:
            t = m.target
            funcs = [f for f in t.image.functions if f.name.startswith("tcp_")]
            m.spliceable_entries(funcs[:5])      # the store and the kernel's tables in
            funcs = funcs[5:]
            with requests(t) as seen, m.facts.asking_ahead(funcs):
                sent = dict(seen)
                assert t._text_due, "the text is read when first needed"
                ok, refused = m.spliceable_entries(funcs)
            chunks = -(-len(funcs) // chunk)
            assert sent["hazard_table"] == chunks, sent
            assert 1 <= sent["read_ranges"] and set(sent) <= {"hazard_table", "read_ranges",
                                                              "digests"}, sent
            assert not m.facts._due        # every answer read by the block's end
            verdicts.append(([p for _, p in ok], refused))
        finally:
            m.detach()
    assert verdicts[0] == verdicts[1] and len(verdicts[0][0]) > 200


def test_without_a_store_a_functions_reach_is_read_a_level_at_a_time(testbed: dict,
                                                                       monkeypatch) -> None:
    """Without an analysis store, one function's clobbers are worked out from the
    bytes of everything it reaches: they are read ahead a call-graph level per
    request, just those functions, not the kernel's text chunk by chunk (some 12 MB
    for tcp_v4_rcv's 3,000).  The answers are those of the functions' bytes read one
    by one."""
    from ksim.analysis import clobbers
    from ksim.analysis.abi import support_for
    from ksim.image import Image

    monkeypatch.setenv("KSIM_ANALYSIS_STORE", "off")
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        t = m.target
        image = t.image
        support = support_for(image.arch)
        func = m.find_function("tcp_v4_rcv")
        with requests(t) as seen:
            found = clobbers.function_clobbers(image, support, func)
        reached = len(clobbers._SUMMARIES[image])
        assert reached > 500 and seen["read_ranges"] >= 5, (reached, seen)
        assert seen["read"] <= 2, seen     # no chunk reads
        # the same function over a reader that reads each function as asked
        plain = Image(image.path, image.arch, image.module, image.sections, image.symbols,
                      reader=lambda a, n: t.read(a, n, kernel=True), identity=None)
        assert clobbers.function_clobbers(plain, support, func) == found
    finally:
        m.detach()
