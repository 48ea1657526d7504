"""The kernel module as the last arbiter on a live kernel: owners, reservations,
the route table, kept splices across kerninstd restarts, and unload.

Every text write, trap route and patch-area or heap block belongs to one owner
(a client session, or a kept owner with a name); a change over what another
owner holds is refused with TextOwned; a poke batch reserves what it needs
before any byte changes; trap routes live in a hash table with no small cap;
the module's log outlives kerninstd.  A Debian 6.1 kernel in QEMU, no mocks:
raw hand-assembled splices, as in test_live_kernel.py, with the kernel's own
kprobe as the oracle for counts.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import capstone
import pytest

from ksim.analysis.store import code_digest
from ksim.core import Write
from ksim.errors import KsimError, OutOfMemory, TextOwned
from ksim.live import abi
from ksim.live.client import KprobeCounter, LiveTarget, _table
from ksim.live.testing import (  # noqa: F401
    connect,
    dmesg_problems,
    getppid_loop,
    install_patch,
    jmp,
    plain_insn,
    plain_site,
    read_u64,
    rel32,
    restart_kerninstd,
    target,
    testbed,
)
from ksim.splice.patch import Change

FUNC = "__x64_sys_getppid"
TRAP_FUNC = "__x64_sys_getpid"
SPARE_FUNC = "__x64_sys_getuid"
N = 20_000
PARAMS = "/sys/module/kerninst/parameters"
OLD_TRAP_TABLE = 512   # the fixed route table before ABI 3

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)


class Splice:
    """A counting splice at the first plain instruction of a function, by jmp or by
    trap: the patch runs the whole instruction and jumps back past it."""

    def __init__(self, t: LiveTarget, func: str, how: str = "jmp") -> None:
        self.t, self.how = t, how
        self.site, self.insn = plain_insn(t, func)
        self.orig = t.read(self.site, 16)
        self.counter = t.alloc_data(8)
        self.patch = install_patch(t, self.counter, self.site, self.insn)
        routes: tuple[tuple[int, int], ...] = ()
        if how == "jmp":
            self.write = Write(self.site, self.orig[:5], jmp(self.site, self.patch))
        else:
            routes = ((self.site, self.patch),)
            self.write = Write(self.site, self.orig[:1], b"\xcc")
        t.apply(Change(routes=routes, text=(self.write,)))

    @property
    def count(self) -> int:
        return read_u64(self.t, self.counter)


def counted_like_the_kprobe(t: LiveTarget, counter: int, n: int = N) -> tuple[int, int]:
    """Run getppid n times; (the counter's increase, the kernel's kprobe's) over the run."""
    with KprobeCounter(t, t.lookup(FUNC)) as oracle:
        k0, c0 = oracle.count, read_u64(t, counter)
        out = t.run(while_cmd=f"{getppid_loop()} {n}").output
        c1, k1 = read_u64(t, counter), oracle.count
    assert out.strip() == str(n)
    return c1 - c0, k1 - k0


def owned(fn: Callable[[], object]) -> TextOwned:
    with pytest.raises(TextOwned) as info:
        fn()
    return info.value


def route_sites(t: LiveTarget, count: int, avoid: set[int]) -> list[int]:
    """``count`` instruction starts in core kernel text, past each function's entry,
    that the kernel lets a trap take (no hazard), in functions from the middle of
    text on and at least 16 bytes from ``avoid``."""
    funcs = []
    with t.kallsyms_path.open() as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[1] in "tT" and t.text[0] <= int(parts[0], 16) < t.text[1]:
                funcs.append(int(parts[0], 16))
    funcs = sorted(set(funcs))
    i = bisect.bisect_left(funcs, (t.text[0] + t.text[1]) // 2)
    sites: list[int] = []
    while len(sites) < 2 * count and i + 1 < len(funcs):
        start, end = funcs[i], funcs[min(i + 64, len(funcs) - 1)]
        code = t.read(start, end - start)
        for a, b in zip(funcs[i:i + 64], funcs[i + 1:i + 65], strict=False):
            insns = list(_cs.disasm(code[a - start:b - start], a))
            sites += [x.address for x in insns[1:] if x.mnemonic not in ("int3", "nop")
                      and all(abs(x.address - v) >= 16 for v in avoid)]
        i += 64
    answers = t.text_hazards([(a, 1) for a in sites])
    sites = [a for a, h in zip(sites, answers, strict=True) if not h]
    assert len(sites) >= count, f"only {len(sites)} route sites found"
    return sites[:count]


def snapshot(t: LiveTarget, addresses: list[int], size: int = 1) -> dict[int, bytes]:
    """The bytes at each address, read a span at a time."""
    out: dict[int, bytes] = {}
    spans: list[list[int]] = []
    for a in sorted(addresses):
        if spans and a + size - spans[-1][0] <= 1 << 16:
            spans[-1].append(a)
        else:
            spans.append([a])
    for span in spans:
        data = t.read(span[0], span[-1] + size - span[0])
        out.update({a: data[a - span[0]:a - span[0] + size] for a in span})
    return out


def param(t: LiveTarget, name: str, value: int | None = None) -> int:
    if value is not None:
        t.exec_checked(f"echo {value} > {PARAMS}/{name}")
    return int(t.exec_checked(f"cat {PARAMS}/{name}"))


@pytest.fixture
def clients(testbed: dict[str, Any]) -> Iterator[Callable[[], LiveTarget]]:
    """Makes clients of the testbed's kerninstd; those still open are closed at the end."""
    made: list[LiveTarget] = []

    def make() -> LiveTarget:
        made.append(connect(testbed))
        return made[-1]

    yield make
    for t in made:
        t.close()


# -- (a) two clients, one point -------------------------------------------------------
@pytest.mark.parametrize("how", ["jmp", "trap"])
@pytest.mark.live
@pytest.mark.slow
def test_a_second_client_is_refused_at_the_first_ones_point(clients, how: str) -> None:
    a, b = clients(), clients()
    s = Splice(a, FUNC, how)
    spare = plain_site(b, SPARE_FUNC)
    spare_orig = b.read(spare, 5)
    bcounter = b.alloc_data(8)
    bpatch = install_patch(b, bcounter, s.site, s.insn)
    b.apply(Change(routes=((spare, bpatch),)))
    cur = s.write.new
    # Whatever b tries at a's point, or on a's blocks, the module refuses with the
    # one error, which names the holder; nothing changes.
    refusals = {
        "its undo": lambda: b.apply(Change(text=(Write(s.site, cur, s.orig[:len(cur)]),))),
        "jmp over it": lambda: b.apply(Change(text=(
            Write(s.site, b.read(s.site, 5), jmp(s.site, bpatch)),))),
        "int3 over it": lambda: b.apply(Change(text=(Write(s.site, cur[:1], b"\xcc"),))),
        "a route there": lambda: b.apply(Change(routes=((s.site, bpatch),))),
        "a's patch code": lambda: b.apply(Change(code=(
            Write(s.patch, b.read(s.patch, 4), b"\xcc" * 4),))),
        "a's counter": lambda: b.write(s.counter, bytes(8)),
        # b routes spare already: re-pointing its own route into a's block is refused
        "a route into a's block": lambda: b.apply(Change(routes=((spare, s.patch),))),
        "freeing a's block": lambda: b.free_code(s.patch),
        "freeing a's counter": lambda: b.free_data(s.counter),
        # all or nothing: b's own int3 at its own routed site is not made either
        "a batch": lambda: b.apply(Change(text=(Write(spare, spare_orig[:1], b"\xcc"),
                                                Write(s.site, cur[:1], b"\xcc")))),
    }
    if how == "jmp":
        refusals["a byte inside"] = lambda: b.apply(Change(text=(
            Write(s.site + 2, cur[2:3], b"\x90"),)))
    else:
        refusals["clearing a's route"] = lambda: b.apply(Change(routes=((s.site, 0),)))
    for what, refused in refusals.items():
        err = owned(refused)
        assert "another client's session" in str(err), (what, err)
    assert b.read(s.site, len(cur)) == cur and b.read(spare, 5) == spare_orig
    # what b analyses is the kernel's own code: a's bytes read as they were, through
    # b's view of the text and the read op's kernel flag; a itself sees its own
    # bytes as they were too (it knows its pokes)
    assert b.read(s.site, len(cur), kernel=True) == s.orig[:len(cur)]
    assert b.image.read(s.site, 16) == s.orig
    # ... and so do b's reads of many rows at once (the module reads them, kerninstd
    # puts a's bytes back in the rows they overlap); the module digests the rows, and
    # those a's splice overlaps are left to b to read (kernel)
    rows = [(s.site - 64, 256), (spare, 5), (s.site + 1, 3)]
    table = _table(rows)
    for kernel in (True, False):
        data = bytes.fromhex(b.conn.request("read_ranges", ranges=table, kernel=kernel)["data"])
        reply = b.conn.request("digests", ranges=table, kernel=kernel)
        sums = bytes.fromhex(reply["digests"])
        assert reply["failed"] == ([0, 2] if kernel else []), kernel
        at = 0
        for k, (address, n) in enumerate(rows):
            assert data[at:at + n] == b.read(address, n, kernel=kernel), (kernel, k)
            assert int.from_bytes(sums[8 * k:8 * k + 8], "little") == (
                0 if k in reply["failed"] else code_digest(data[at:at + n]))
            at += n
        assert (data[64:64 + len(cur)] == s.orig[:len(cur)]) is kernel
    # what b's image knows of those rows: the module's digest, or its own of the
    # bytes it reads as they were
    b.prefetch_digests(rows)
    assert [b.known_digest(*r) for r in rows] == [None, code_digest(spare_orig), None]
    # a's splice is untouched and counts every call, as the kernel's kprobe does
    counted, oracle = counted_like_the_kprobe(a, s.counter)
    assert N <= counted <= N + 5 and abs(counted - oracle) <= 3
    assert read_u64(b, bcounter) == 0
    # a leaves: the module undoes its splice; the point is b's to take now
    a.close()
    assert b.read(s.site, 16) == s.orig
    b.apply(Change(text=(Write(s.site, s.orig[:5], jmp(s.site, bpatch)),)))
    b.run(while_cmd=f"{getppid_loop()} 100")
    assert read_u64(b, bcounter) >= 100
    b.close()
    t = clients()
    assert t.read(s.site, 16) == s.orig and t.read(spare, 5) == spare_orig
    assert dmesg_problems(t) == []


# -- (b) thousands of routes; reservations ---------------------------------------------
@pytest.mark.live
@pytest.mark.slow
def test_thousands_of_routes_and_batches_that_change_all_or_nothing(clients) -> None:
    a = clients()
    (jsite, jinsn), (tsite, tinsn), (spare, sinsn) = (plain_insn(a, f)
                                                      for f in (FUNC, TRAP_FUNC, SPARE_FUNC))
    originals = {x: a.read(x, 16) for x in (jsite, tsite, spare)}
    sites = route_sites(a, 2000, avoid={jsite, tsite, spare})
    before = snapshot(a, sites)
    counter = a.alloc_data(8)
    jpatch = install_patch(a, counter, jsite, jinsn)
    tpatch = install_patch(a, counter, tsite, tinsn)
    spatch = install_patch(a, counter, spare, sinsn)
    idle = a.alloc_code(64)   # the routes without an int3 lead here; never run
    # As many routes as the old module's whole table ...
    a.apply(Change(routes=tuple((site, idle) for site in sites[:OLD_TRAP_TABLE - 1])
                   + ((tsite, tpatch),)))
    # ... and a batch whose jmp needs one more (its int3 while it goes in), after
    # a byte it changes: the old module wrote the int3, then failed for lack of a route.
    batch = [Write(tsite, originals[tsite][:1], b"\xcc"),
             Write(jsite, originals[jsite][:5], jmp(jsite, jpatch))]
    try:
        a.apply(Change(text=tuple(batch)))
    except KsimError as exc:
        changed = [hex(w.address) for w in batch if a.read(w.address, len(w.old)) != w.old]
        pytest.fail(f"with {OLD_TRAP_TABLE} routes in use the batch was refused ({exc}); "
                    f"bytes it changed anyway: {changed}")
    assert [a.read(w.address, len(w.new)) for w in batch] == [w.new for w in batch]
    # ... and on to 2,000 routes: dispatch still finds the two live splices
    a.apply(Change(routes=tuple((site, idle) for site in sites[OLD_TRAP_TABLE - 1:])))
    out = a.run(while_cmd=f"{getppid_loop()} 1000").output
    assert out.strip() == "1000" and read_u64(a, counter) >= 1000
    # A batch refused for lack of a resource changes no byte: no room for a new
    # text write (a restore needs none, the jmp one), then for a new route.
    saved = {n: param(a, n) for n in ("max_splices", "max_routes")}
    try:
        param(a, "max_splices", 0)
        spare_jmp = Write(spare, originals[spare][:5], jmp(spare, spatch))
        with pytest.raises(OutOfMemory):
            a.apply(Change(text=(Write(tsite, b"\xcc", originals[tsite][:1]), spare_jmp)))
        assert a.read(tsite, 1) == b"\xcc" and a.read(spare, 5) == originals[spare][:5]
        param(a, "max_splices", saved["max_splices"])
        param(a, "max_routes", 2001)   # the 2,001 routes in place
        spare_trap = Change(routes=((spare, spatch),),
                            text=(Write(spare, originals[spare][:1], b"\xcc"),))
        with pytest.raises(OutOfMemory):
            a.apply(spare_trap)
        assert a.read(spare, 1) == originals[spare][:1]
        param(a, "max_routes", saved["max_routes"])
        a.apply(spare_trap)
    finally:
        for n, v in saved.items():
            param(a, n, v)
    # a leaves holding 2,002 routes, a jmp and two int3s: all undone
    a.close()
    t = clients()
    assert {x: t.read(x, 16) for x in originals} == originals
    assert snapshot(t, sites) == before
    # the routes are gone: another client may take their sites
    for site in (sites[0], sites[-1]):
        t.apply(Change(routes=((site, t.alloc_code(16)),)))
        t.apply(Change(routes=((site, 0),)))
    assert dmesg_problems(t) == []


# -- (c) kept splices and a kerninstd restart -----------------------------------------
def ksim_kept(testbed: dict[str, Any], *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ksim.cli", "kept", "--target", testbed["address"],
                          "--token-file", testbed["token_file"], "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.mark.live
@pytest.mark.slow
def test_a_kept_splice_survives_a_kerninstd_restart(testbed, clients) -> None:
    name = f"arbiter-{os.getpid()}"
    t = clients()
    s = Splice(t, FUNC, "jmp")
    assert t.keep(name=name) == name
    # another client, not kept, with a splice of its own: kerninstd dies under it
    other = clients()
    o = Splice(other, TRAP_FUNC, "trap")
    t = restart_kerninstd(t, testbed)
    other.close()
    try:
        # the kept splice is still in and still counts, as the kernel's kprobe does
        assert t.read(s.site, 5) == s.write.new
        counted, oracle = counted_like_the_kprobe(t, s.counter)
        assert N <= counted <= N + 5 and abs(counted - oracle) <= 3
        # the session that was not kept was undone when the device closed
        assert t.read(o.site, 16) == o.orig
        # it is listed, by the new kerninstd and by `ksim kept`
        (kept,) = [k for k in t.kept() if k["name"] == name]
        assert [(w["address"], w["cur"]) for w in kept["writes"]] == [(s.site, s.write.new.hex())]
        assert {(b["region"], b["address"]) for b in kept["blocks"]} == {
            ("code", s.patch), ("data", s.counter)}
        assert kept["session"] is None and not kept["orphan"]
        assert name in {k["name"] for k in ksim_kept(testbed)["kept"]}
        # its blocks are not handed out again, however much is allocated
        fresh = [(t.alloc_code(64), 64) for _ in range(16)] + [(t.alloc_data(8), 8) for _ in range(16)]
        for b in kept["blocks"]:
            assert all(not (x < b["address"] + b["size"] and b["address"] < x + n) for x, n in fresh)
        # nor may a new client change its bytes or its blocks
        owned(lambda: t.apply(Change(text=(Write(s.site, s.write.new, s.orig[:5]),))))
        owned(lambda: t.write(s.counter, bytes(8)))
        # removed by name: the text is byte-identical again
        report = ksim_kept(testbed, "--remove", name)
        assert [k["name"] for k in report["removed"]] == [name] and report["failed"] == []
        assert name not in {k["name"] for k in report["kept"]}
        assert t.read(s.site, 16) == s.orig
        assert dmesg_problems(t) == []
    finally:
        with contextlib.suppress(KsimError):
            if name in {k["name"] for k in t.kept()}:
                t.remove_kept(name)
        t.close()


@pytest.mark.live
@pytest.mark.slow
def test_a_kept_splice_is_adopted_by_name_and_undone_with_its_new_session(clients) -> None:
    name = f"adopted-{os.getpid()}"
    t = clients()
    s = Splice(t, FUNC, "trap")
    t.keep(name=name)
    # while t is connected its kept splice is t's alone
    u = clients()
    assert "still connected" in str(owned(lambda: u.adopt(name)))
    t.close()
    taken = u.adopt(name)
    assert taken["name"] == name and [r["site"] for r in taken["routes"]] == [s.site]
    assert name not in {k["name"] for k in u.kept()}
    # u may now undo it itself, or leave it to its disconnect
    u.apply(Change(routes=((s.site, 0),), text=(Write(s.site, b"\xcc", s.orig[:1]),)))
    assert u.read(s.site, 16) == s.orig
    u.close()
    v = clients()
    assert v.read(s.site, 16) == s.orig
    with pytest.raises(KsimError, match="no kept splice"):
        v.remove_kept(name)


# -- (d) unload ------------------------------------------------------------------------
@pytest.mark.live
@pytest.mark.slow
def test_unload_undoes_every_live_splice(testbed, clients) -> None:
    """Two kept owners with a jmp, two traps and, in all, as many routes as the old
    module's whole table: unloading the module puts every byte back (the old module
    had no route left for the jmp's int3, could not restore it, and freed the patch
    area it jumps to anyway)."""
    a, b = clients(), clients()
    js = Splice(a, FUNC, "jmp")
    ts = Splice(a, TRAP_FUNC, "trap")
    bs = Splice(b, SPARE_FUNC, "trap")
    sites = route_sites(a, OLD_TRAP_TABLE - 2, avoid={js.site, ts.site, bs.site})
    before = snapshot(a, sites)
    idle = a.alloc_code(16)
    a.apply(Change(routes=tuple((site, idle) for site in sites)))
    a.keep(name=f"unload-a-{os.getpid()}")
    b.keep(name=f"unload-b-{os.getpid()}")
    b.close()
    a.run(while_cmd=f"{getppid_loop()} 100")
    assert js.count >= 100
    t = restart_kerninstd(a, testbed, unload=True)
    try:
        for s in (js, ts, bs):
            assert t.read(s.site, 16) == s.orig
        assert snapshot(t, sites) == before
        assert t.kept() == []
        log = t.exec("dmesg")
        assert re.search(r"kerninst: unloaded \(2 kept owners undone", log), log[-2000:]
        assert dmesg_problems(t) == []
    finally:
        t.close()


# -- without a kernel: the header's owner flags and regions ---------------------------
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_owner_flags_and_regions_match_the_header(tmp_path: Path) -> None:
    header = Path(__file__).resolve().parent.parent / "kmod" / "kerninst.h"
    names = [f"KERNINST_OWNER_{n.upper()}" for n in abi.OWNER_FLAGS] + \
            [f"KERNINST_REGION_{n.upper()}" for n in abi.REGIONS]
    src = tmp_path / "flags.c"
    src.write_text(f'#include "{header}"\n#include <stdio.h>\nint main(void) {{\n'
                   + "".join(f'printf("%u\\n", (unsigned){n});\n' for n in names)
                   + "return 0; }\n")
    subprocess.run(["gcc", "-Wall", "-Werror", "-o", str(tmp_path / "flags"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "flags")], capture_output=True, text=True, check=True)
    assert [int(x) for x in out.stdout.split()] == [*abi.OWNER_FLAGS.values(), *abi.REGIONS.values()]
    assert set(re.findall(r"#define (KERNINST_(?:OWNER|REGION)_\w+)\s", header.read_text())) == set(names)
