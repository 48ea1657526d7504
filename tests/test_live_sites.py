"""Asking a live kernel whether text may be touched (the kerninst HAZARDS ioctl,
the ``hazards`` op, ``LiveTarget.text_hazards``), and the module refusing pokes
into text the kernel relies on.  A Debian 6.1 kernel in QEMU, no mocks.

Known sites come from the kernel's own tables, read from the running kernel
between their ``__start_``/``__stop_`` symbols with Linux 6.1's x86-64 layouts:
``struct bug_entry`` (12 bytes: bug_addr_disp, file_disp, line, flags;
include/asm-generic/bug.h), ``struct exception_table_entry`` (12 bytes: insn,
fixup, data; arch/x86/include/asm/extable.h) and ``struct jump_entry`` (16
bytes: code, target, key; include/linux/jump_label.h), each address relative to
its own field.  A WARN site in a module comes from tests/kmod_warn.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import itertools
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import capstone
import pytest

from ksim.core import Write
from ksim.errors import KsimError, OutsideText, ProtocolError, UnsafeSite
from ksim.kapi import Manager
from ksim.live import protocol as wire
from ksim.live import testbed as tb
from ksim.live.client import KprobeCounter, LiveTarget
from ksim.live.testing import dmesg_problems, getppid_loop, read_u64, target, testbed  # noqa: F401
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"
FTRACE_NOP = bytes.fromhex("0f1f440000")
UD2 = b"\x0f\x0b"
BUGFLAG_WARNING = 1 << 0  # include/asm-generic/bug.h
SAMPLE = 200  # entries of each table asked about
WARN_MODULE = Path(__file__).resolve().parent / "kmod_warn"
WARN_FUNC = "ksim_warn_check"
WARN_PARAM = "/sys/module/ksim_warn_test/parameters/value"

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_marks = itertools.count(int(time.time()))


def rel32(frm: int, to: int) -> bytes:
    return struct.pack("<i", to - frm)


def insns(t: LiveTarget, address: int, size: int) -> list[capstone.CsInsn]:
    return list(_cs.disasm(t.read(address, size), address))


def table(t: LiveTarget, name: str, entry: str) -> list[tuple[int, tuple[int, ...]]]:
    """(address of the entry, its fields) for the kernel table NAME."""
    start, stop = t.lookup(f"__start_{name}"), t.lookup(f"__stop_{name}")
    size = struct.calcsize(entry)
    data = t.read(start, stop - start)
    return [(start + i, struct.unpack_from(entry, data, i)) for i in range(0, len(data), size)]


def in_core_text(t: LiveTarget, address: int) -> bool:
    return t.text[0] <= address < t.text[1]


def sample(items: list[Any], n: int = SAMPLE) -> list[Any]:
    return items[:: max(1, len(items) // n)][:n]


def bug_sites(t: LiveTarget) -> list[tuple[int, bool]]:
    """(ud2 address, is a WARN) of every bug-table entry in core text."""
    out = []
    for at, (disp, _file, _line, flags) in table(t, "__bug_table", "<iiHH"):
        address = (at + disp) % (1 << 64)
        if in_core_text(t, address):
            out.append((address, bool(flags & BUGFLAG_WARNING)))
    return out


def extable_sites(t: LiveTarget) -> list[int]:
    out = []
    for at, (insn, _fixup, _data) in table(t, "__ex_table", "<iii"):
        address = (at + insn) % (1 << 64)
        if in_core_text(t, address):
            out.append(address)
    return out


def jump_label_sites(t: LiveTarget) -> list[int]:
    out = []
    for at, (code, _target, _key) in table(t, "__jump_table", "<iiq"):
        address = (at + code) % (1 << 64)
        if in_core_text(t, address):
            out.append(address)
    return out


def ordinary_site(t: LiveTarget) -> tuple[int, bytes]:
    """A 5-byte instruction in the middle of FUNC that runs as is anywhere: no
    RIP-relative operand, no branch (so the counting patch can relocate it unchanged)."""
    entry = t.lookup(FUNC)
    for i in insns(t, entry, 64)[1:]:
        if (i.size == 5 and "rip" not in i.op_str and not i.mnemonic.startswith(("j", "call", "ret"))
                and i.bytes[0] != 0xE9):
            return i.address, bytes(i.bytes)
    raise AssertionError(f"no plain 5-byte instruction near the start of {FUNC}")


def counting_patch(patch: int, counter: int, site: int, first: bytes) -> bytes:
    """lock incq [rip+counter]; <first, as is>; jmp site+len(first)."""
    code = b"\xf0\x48\xff\x05" + rel32(patch + 8, counter) + first
    return code + b"\xe9" + rel32(patch + len(code) + 5, site + len(first))


def install_patch(t: LiveTarget, counter: int, site: int, first: bytes) -> int:
    code_at = t.alloc_code(64, near=site)
    code = counting_patch(code_at, counter, site, first)
    t.apply(Change(code=(Write(code_at, t.read(code_at, len(code)), code),)))
    return code_at


def dmesg_after(t: LiveTarget, marker: str) -> list[str]:
    """The kernel log after the line holding ``marker`` (written to /dev/kmsg)."""
    lines = t.exec("dmesg").splitlines()
    at = max(i for i, line in enumerate(lines) if marker in line)
    return lines[at + 1:]


# -- the kernel's answers ------------------------------------------------------------
def test_function_entry_is_an_ftrace_location(target: LiveTarget) -> None:
    entry = target.lookup(FUNC)
    assert target.read(entry, 5) == FTRACE_NOP
    after = insns(target, entry + 5, 16)[0]
    assert target.text_hazards([(entry, 5), (entry, 1), (entry + 4, 1), (entry + 3, 4),
                                (entry + 5, after.size)]) == [
        {"ftrace"}, {"ftrace"}, {"ftrace"}, {"ftrace"}, set()]


def test_ordinary_instruction_has_no_hazard(target: LiveTarget) -> None:
    site, insn = ordinary_site(target)
    assert target.text_hazards([(site, len(insn)), (site, 1), (site + 1, 4)]) == [set()] * 3


def test_bug_table_sites_answer_warn_or_bug(target: LiveTarget) -> None:
    sites = bug_sites(target)
    warns = [a for a, w in sites if w]
    bugs = [a for a, w in sites if not w]
    assert len(warns) > 100 and len(bugs) > 100
    picked = sample(warns) + sample(bugs)
    assert all(target.read(a, 2) == UD2 for a in picked[:20])
    answers = target.text_hazards([(a, 2) for a in picked])
    for address, names in zip(picked, answers, strict=True):
        expected = "warn" if address in set(warns) else "bug"
        assert expected in names, (hex(address), names)
    # a range that only ends on the ud2 still covers it
    assert "warn" in target.text_hazards([(warns[0] - 3, 4)])[0]


def test_exception_table_instructions_answer_extable(target: LiveTarget) -> None:
    sites = sample(extable_sites(target))
    assert len(sites) > 50
    answers = target.text_hazards([(a, 1) for a in sites])
    assert all("extable" in names for names in answers), \
        [(hex(a), n) for a, n in zip(sites, answers, strict=True) if "extable" not in n]
    # the entry is keyed by the instruction's first byte: a range starting before it still has it
    assert "extable" in target.text_hazards([(sites[0] - 2, 3)])[0]
    # ... and one that ends before it, or starts after it, has not (unless another
    # entry is there): the module's index of core text's table answers as the kernel's
    every = set(extable_sites(target))
    near = [(a - 2, 2) for a in sites if not every & {a - 2, a - 1}] + \
        [(a + 1, 2) for a in sites if not every & {a + 1, a + 2}]
    assert len(near) > 50
    answers = target.text_hazards(near)
    assert not [(hex(a), n) for (a, _), n in zip(near, answers, strict=True) if "extable" in n]


def test_jump_label_sites_answer_jump_label(target: LiveTarget) -> None:
    sites = sample(jump_label_sites(target))
    assert len(sites) > 100
    answers = target.text_hazards([(a, 1) for a in sites])
    assert all("jump_label" in names for names in answers), \
        [(hex(a), n) for a, n in zip(sites, answers, strict=True) if "jump_label" not in n]


def test_outside_text_and_blacklisted_code(target: LiveTarget) -> None:
    answers = target.text_hazards([
        (target.lookup("jiffies_64"), 1),       # data
        (target.code_region[0], 5),             # ksim's own patch area
        (target.text[1], 1),                    # just past _etext
        (target.text[1] - 2, 4),                # straddling _etext
        (target.lookup("exc_int3"), 1),         # the int3 path itself (noinstr)
        (target.lookup("kprobe_int3_handler"), 1),  # NOKPROBE_SYMBOL (and traceable)
    ])
    assert answers == [{"not_text"}] * 4 + [{"blacklist"}, {"blacklist", "ftrace"}]
    # kerninst's own text: blacklisted, and outside what pokes may touch
    own = target.lookup("ki_die_notify") + 5
    assert "blacklist" in target.text_hazards([(own, 1)])[0]
    with pytest.raises(OutsideText):
        target.apply(Change(text=(Write(own, target.read(own, 1), target.read(own, 1)),)))


#: called out of line by Linux's int3 path before any notifier sees the trap (kmod: ki_trap_path)
INT3_PATH = ("__rcu_read_lock", "__rcu_read_unlock", "rcu_read_unlock_special")


def die_notifiers_ahead(t: LiveTarget) -> list[int]:
    """The callbacks of die_chain (kernel/notifier.c) that run before kerninst's:
    ``struct atomic_notifier_head`` is a spinlock and then the head pointer;
    ``struct notifier_block`` is notifier_call, next, priority."""
    ours = t.lookup("ki_die_nb")
    nb, out = read_u64(t, t.lookup("die_chain") + 8), []
    while nb and nb != ours:
        out.append(read_u64(t, nb))
        nb = read_u64(t, nb + 8)
    assert nb == ours, "kerninst's die notifier is not on die_chain"
    return out


def test_die_notifiers_ahead_of_kerninsts_are_kept_from_pokes(target: LiveTarget) -> None:
    """The kernel's own hw_breakpoint notifier has kerninst's priority (INT_MAX) and
    registered first, so every int3 goes through it before kerninst's notifier: an
    int3 in it trapped again, and a batch that poked it hung the kernel."""
    ahead = die_notifiers_ahead(target)
    assert target.lookup("hw_breakpoint_exceptions_notify") in ahead
    answers = target.text_hazards([(fn, 1) for fn in ahead])
    assert all("blacklist" in names for names in answers), list(zip(map(hex, ahead), answers, strict=True))
    for fn in ahead:
        before = target.read(fn, 1)
        with pytest.raises(UnsafeSite):
            target.apply(Change(text=(Write(fn, before, b"\xcc"),)))
        assert target.read(fn, 1) == before


@pytest.mark.parametrize("splice", ["jmp", "trap"])
def test_the_int3_paths_own_calls_are_refused_by_module_and_client(target: LiveTarget,
                                                                   splice: str) -> None:
    """An int3 in __rcu_read_lock traps again inside notify_die before kerninst's
    notifier can route it, until irqentry_nmi_enter's BUG: neither the module nor
    the client lets one be written (a jmp splice's poke writes one too, for a moment)."""
    ordinary, insn = ordinary_site(target)
    counter = target.alloc_data(8)
    patch = install_patch(target, counter, ordinary, insn)
    try:
        for name in INT3_PATH:
            site = target.lookup(name)
            before = target.read(site, 8)
            assert "blacklist" in target.text_hazards([(site, 1)])[0], name
            write = (Write(site, before[:1], b"\xcc") if splice == "trap" else
                     Write(site, before[:5], b"\xe9" + rel32(site + 5, patch)))
            with pytest.raises(UnsafeSite):
                target.apply(Change(text=(write,)))
            with pytest.raises(UnsafeSite):
                target.apply(Change(routes=((site, patch),)))
            assert target.read(site, 8) == before, name
    finally:
        target.free_code(patch)
    manager = Manager(target)
    texts = {n: target.read(target.lookup(n), 16) for n in INT3_PATH}
    var = manager.malloc(8)
    for name in INT3_PATH:
        with pytest.raises(KsimError, match="trap or entry path"):
            manager.insert_snippet(manager.point_at(target.lookup(name)),
                                   var.atomic_assign(var + 1), splice=splice)
    assert {n: target.read(target.lookup(n), 16) for n in INT3_PATH} == texts
    # the kernel still runs
    assert target.run(while_cmd=f"{getppid_loop()} 100").output.strip() == "100"
    assert dmesg_problems(target) == []


def test_padding_slots_never_take_bytes_of_a_site_the_kernel_rewrites(target: LiveTarget) -> None:
    """A static call to nothing is ``ret; int3 x4`` in a running kernel, and the
    kernel rewrites all five bytes when the call is updated: the int3s look like a
    function's trailing filler but are no springboard's to take (the module refuses
    the poke, and a whole batch with it).  Every such site of the running kernel."""
    from ksim.image.tables import TextRef

    manager = Manager(target)
    facts, image = manager.facts, target.image
    sites = image.tables.addresses(TextRef.STATIC_CALL)
    text = target.read_many(sites, 5)
    rets = [a for a in sites if text[a] == b"\xc3" + b"\xcc" * 4]
    checked = 0
    for site in rets:
        func = image.function_at(site)
        if func is None or facts._extent(func)[0] != site + 1:  # filler right after the ret
            continue
        slots = facts.padding_slots(site, frozenset())
        assert not any(start < site + 5 and site < start + 5 for start, _ in slots), hex(site)
        checked += 1
    assert checked >= 5, (len(sites), len(rets))


def test_registered_kprobe_and_the_bytes_its_jump_would_cover(target: LiveTarget) -> None:
    site, insn = ordinary_site(target)
    with KprobeCounter(target, site):
        answers = target.text_hazards([
            (site, 1), (site - 3, 4), (site + 1, 4), (site + 4, 1),   # the probe, its 5-byte reach
            (site - 1, 1), (site + 5, 1),                               # outside it
        ])
        assert answers == [{"kprobe"}] * 4 + [set()] * 2
        # (a write of the same byte: refused all the same, and harmless if it were not)
        with pytest.raises(UnsafeSite, match="kprobe"):
            target.apply(Change(text=(Write(site + 1, insn[1:2], insn[1:2]),)))
    assert target.text_hazards([(site, 1)]) == [set()]
    assert target.read(site, len(insn)) == insn
    assert dmesg_problems(target) == []


@pytest.mark.parametrize("length", [0, 17, -1])
def test_malformed_ranges_are_protocol_errors(target: LiveTarget, length: int) -> None:
    with pytest.raises(ProtocolError, match="length"):
        target.conn.request("hazards", ranges=[[target.lookup(FUNC), length]])


def test_malformed_requests_are_protocol_errors(target: LiveTarget) -> None:
    entry = target.lookup(FUNC)
    for ranges in ([[entry]], [[entry, 5, 1]], [[str(entry), 5]], [[entry, True]], [entry, 5],
                   [[-1, 5]], [[(1 << 64) - 2, 5]]):
        with pytest.raises(ProtocolError, match="hazards"):
            target.conn.request("hazards", ranges=ranges)
    with pytest.raises(ProtocolError, match="limit"):
        target.conn.request("hazards", ranges=[[entry, 1]] * (wire.MAX_RANGES + 1))
    with pytest.raises(ProtocolError, match="ranges"):
        target.conn.request("hazards", ranges="all of them")
    assert target.conn.request("hazards", ranges=[])["hazards"] == []
    # many ranges, one answer each
    assert target.text_hazards([(entry, 1)] * 5000) == [{"ftrace"}] * 5000


# -- the module refuses to write such text ----------------------------------------------
def _hazard_sites(t: LiveTarget) -> dict[str, int]:
    warns = [a for a, w in bug_sites(t) if w]
    return {"ftrace": t.lookup(FUNC), "warn": warns[len(warns) // 2],
            "extable": extable_sites(t)[0], "jump_label": jump_label_sites(t)[0]}


def test_pokes_into_hazardous_text_are_refused_and_write_nothing(target: LiveTarget) -> None:
    sites = _hazard_sites(target)
    ordinary, insn = ordinary_site(target)
    counter = target.alloc_data(8)
    patch = install_patch(target, counter, ordinary, insn)
    # A route at the ordinary site: were its int3 wrongly written, a hit would still be served.
    target.apply(Change(routes=((ordinary, patch),)))
    try:
        for name, site in sites.items():
            assert name in target.text_hazards([(site, 1)])[0], name
            before = target.read(site, 8)
            jmp = b"\xe9" + rel32(site + 5, patch)
            for write in (Write(site, before[:1], b"\xcc"), Write(site, before[:5], jmp)):
                with pytest.raises(UnsafeSite, match=name):
                    target.apply(Change(text=(write,)))
            # all or nothing: the harmless write of the batch is not made either
            with pytest.raises(UnsafeSite):
                target.apply(Change(text=(Write(ordinary, insn[:1], b"\xcc"),
                                          Write(site, before[:1], b"\xcc"))))
            with pytest.raises(UnsafeSite, match=name):
                target.apply(Change(routes=((site, patch),)))
            assert target.read(site, 8) == before, name
            assert target.read(ordinary, len(insn)) == insn
    finally:
        target.apply(Change(routes=((ordinary, 0),)))
        target.free_code(patch)
    assert dmesg_problems(target) == []


@pytest.mark.parametrize("splice", ["jmp", "trap"])
def test_ordinary_site_still_pokes_counts_and_restores(target: LiveTarget, splice: str) -> None:
    site, insn = ordinary_site(target)
    counter = target.alloc_data(8)
    patch = install_patch(target, counter, site, insn)
    if splice == "jmp":
        insert = Change(text=(Write(site, insn, b"\xe9" + rel32(site + 5, patch)),))
    else:  # the route and the int3 in one batch; out, the int3 and then its route
        insert = Change(routes=((site, patch),), text=(Write(site, insn[:1], b"\xcc"),))
    target.apply(insert)
    try:
        out = target.run(while_cmd=f"{getppid_loop()} 1000").output
    finally:
        target.apply(Change(routes=tuple((s, 0) for s, _ in insert.routes),
                            text=tuple(w.inverse() for w in insert.text)))
    assert out.strip() == "1000"
    assert 1000 <= read_u64(target, counter) <= 1010
    assert target.read(site, len(insn)) == insn
    target.free_code(patch)
    assert dmesg_problems(target) == []


def test_undo_works_where_a_hazard_appeared_since(target: LiveTarget) -> None:
    """A kprobe registered just before a jmp splice (its optimized jump would cover
    the splice): a new write there is refused, the restore of the original is not."""
    site, insn = ordinary_site(target)
    before = next(i for i in insns(target, target.lookup(FUNC), 64) if i.address + i.size == site)
    assert site - before.address <= 4
    counter = target.alloc_data(8)
    patch = install_patch(target, counter, site, insn)
    other = install_patch(target, counter, site, insn)
    jmp = b"\xe9" + rel32(site + 5, patch)
    target.apply(Change(text=(Write(site, insn, jmp),)))
    try:
        with KprobeCounter(target, before.address) as probe:
            assert "kprobe" in target.text_hazards([(site, 5)])[0]
            target.run(while_cmd=f"{getppid_loop()} 100")
            with pytest.raises(UnsafeSite, match="kprobe"):
                target.apply(Change(text=(Write(site, jmp, b"\xe9" + rel32(site + 5, other)),)))
            target.apply(Change(text=(Write(site, jmp, insn),)))
            assert target.read(site, 5) == insn
            assert probe.count >= 100
    finally:
        if target.read(site, 5) == jmp:
            target.apply(Change(text=(Write(site, jmp, insn),)))
    assert 100 <= read_u64(target, counter) <= 110
    target.free_code(patch)
    target.free_code(other)
    assert dmesg_problems(target) == []


# -- a WARN in a module ----------------------------------------------------------------
@pytest.fixture(scope="module")
def warn_module(testbed: dict[str, Any]) -> Iterator[str]:
    """ksim_warn_test.ko built against the testbed's headers and loaded in the guest.
    Its WARNs are expected: afterwards, when they are dmesg's only complaints,
    the log is cleared so that later tests judge only their own lines."""
    name = tb.load_test_module(WARN_MODULE, testbed, progress=lambda m: print(f"testbed: {m}"))
    yield name
    with LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"]) as t:
        problems = dmesg_problems(t)
        if problems and all(WARN_FUNC in line for line in problems):
            t.exec("dmesg -C")


def _warn_function(t: LiveTarget) -> tuple[int, int, list[capstone.CsInsn]]:
    """ksim_warn_check's address, its WARN ud2 (as the kernel reports it) and its instructions."""
    fn = t.image.function(WARN_FUNC)
    assert fn.address == t.lookup(WARN_FUNC)
    code = insns(t, fn.address, fn.size)
    answers = t.text_hazards([(i.address, i.size) for i in code])
    warns = [i for i, names in zip(code, answers, strict=True) if "warn" in names]
    assert len(warns) == 1 and bytes(warns[0].bytes) == UD2, answers
    assert answers[0] == {"ftrace"}  # modules are built with the fentry nop too
    return fn.address, warns[0].address, code


def _trigger(t: LiveTarget, value: int) -> tuple[int, list[str]]:
    """Run ksim_warn_check(value) in the guest: its result and the new dmesg lines."""
    marker = f"ksim-test: {WARN_FUNC}({value}) {next(_marks)}"
    r = t.conn.request("exec", cmd=f"echo '{marker}' > /dev/kmsg && echo {value} > {WARN_PARAM} "
                                   f"&& cat {WARN_PARAM}", timeout=60.0, reply_timeout=90)
    assert r["rc"] == 0, r
    return int(r["stdout"]), dmesg_after(t, marker)


def _assert_warned_at(lines: list[str], offset: int) -> None:
    text = "\n".join(lines)
    assert re.search(rf"WARNING: .* {WARN_FUNC}\+{offset:#x}/0x[0-9a-f]+ \[ksim_warn_test\]", text), text
    assert "invalid opcode" not in text and "Oops" not in text and "BUG:" not in text, text


def test_module_warn_site_is_found_and_fires_in_place(warn_module: str, target: LiveTarget) -> None:
    address, ud2, code = _warn_function(target)
    assert target.read(ud2, 2) == UD2
    result, lines = _trigger(target, 7)
    assert result == 8 and not any("WARNING" in line for line in lines)
    result, lines = _trigger(target, 42)
    assert result == 44
    _assert_warned_at(lines, ud2 - address)
    with pytest.raises(UnsafeSite, match="warn"):
        target.apply(Change(text=(Write(ud2, UD2[:1], b"\xcc"),)))
    # a jmp at the instruction before it would displace the ud2: refused
    block = next(i for i in code if i.address + i.size == ud2)
    assert ud2 - block.address < 5
    patch = target.alloc_code(64, near=block.address)
    with pytest.raises(UnsafeSite, match="warn"):
        target.apply(Change(text=(Write(block.address, target.read(block.address, 5),
                                        b"\xe9" + rel32(block.address + 5, patch)),)))
    target.free_code(patch)
    assert target.read(ud2, 2) == UD2


def test_splice_next_to_a_warn_never_moves_its_ud2(warn_module: str, testbed: dict[str, Any]) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    try:
        target = m.target
        assert isinstance(target, LiveTarget)
        address, ud2, code = _warn_function(target)
        fn = m.find_function(WARN_FUNC)
        # the block that leads to the WARN: a 5-byte jmp there would cover the ud2
        (point,) = [p for p in m.block_points(fn) if p.address < ud2 < p.address + 5]
        before = target.read(address, fn.size)
        counter = m.malloc(8)
        try:
            handle = m.insert_snippet(point, counter.atomic_assign(counter + 1))
        except KsimError as exc:
            # refused: with a reason, and nothing changed
            assert str(exc)
            assert target.read(address, fn.size) == before
            assert dmesg_problems(target) == [] or all(WARN_FUNC in x for x in dmesg_problems(target))
            return
        patch = m.patch_of(handle)
        for w in patch.writes:
            assert not (w.address < ud2 + 2 and ud2 < w.address + len(w.new)), (patch.tactic, w)
        assert target.read(ud2, 2) == UD2
        result, lines = _trigger(target, 42)
        assert result == 44  # the displaced add ran exactly once
        _assert_warned_at(lines, ud2 - address)
        assert m.read(counter) == 1
        result, lines = _trigger(target, 7)
        assert result == 8 and m.read(counter) == 1 and not any("WARNING" in x for x in lines)
        m.remove_snippet(handle)
        assert target.read(address, fn.size) == before
        print(f"spliced {WARN_FUNC}+{point.address - address:#x} by {patch.tactic}; "
              f"the ud2 at +{ud2 - address:#x} stayed")
    finally:
        m.detach()


def test_module_going_away_takes_its_splices_with_it(warn_module: str, testbed: dict[str, Any],
                                                      target: LiveTarget) -> None:
    """rmmod of a spliced module: kerninst forgets its writes and routes there
    (the text is freed; an undo must never write into whatever reuses it)."""
    address, ud2, code = _warn_function(target)
    block = next(i for i in code if i.address + i.size == ud2)
    other = LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
    try:
        counter = other.alloc_data(8)
        patch = install_patch(other, counter, block.address, bytes(block.bytes))
        other.apply(Change(routes=((block.address, patch),),
                           text=(Write(block.address, bytes(block.bytes[:1]), b"\xcc"),)))
        assert _trigger(target, 7)[0] == 8 and read_u64(other, counter) == 0
        result, lines = _trigger(target, 42)
        assert result == 44 and read_u64(other, counter) == 1
        _assert_warned_at(lines, ud2 - address)
        marker = f"ksim-test: rmmod {next(_marks)}"
        target.exec_checked(f"echo '{marker}' > /dev/kmsg && rmmod {warn_module}")
        assert any(f"module {warn_module} is going: forgot 1 text writes and 1 trap routes" in x
                   for x in dmesg_after(target, marker))
        assert target.text_hazards([(block.address, 1)]) == [{"not_text"}]
        with pytest.raises(OutsideText):
            other.apply(Change(text=(Write(block.address, b"\xcc", bytes(block.bytes[:1])),)))
    finally:
        other.close()  # nothing left to undo: the module forgot the write and the route
        tb.load_test_module(WARN_MODULE, testbed)
    problems = dmesg_problems(target)
    assert all(WARN_FUNC in x for x in problems), problems
