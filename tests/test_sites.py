"""Site facts on the toy kernel seen the way a live kernel is seen: through a
kallsyms list (no sizes, so each function's extent runs to the next symbol and
includes the alignment filler), and with static functions sharing a name."""

from __future__ import annotations

import pytest

from ksim.analysis.points import Point, PointKind
from ksim.arch import get_arch
from ksim.image import load_image, load_kallsyms, to_kallsyms
from ksim.splice import planner
from ksim.splice.sites import SiteFacts

ARCH = get_arch("x86_64")


@pytest.fixture(scope="module")
def images(toy_path, tmp_path_factory):
    elf = load_image(toy_path)
    listing = tmp_path_factory.mktemp("kallsyms") / "kallsyms"
    listing.write_text(to_kallsyms(elf))
    return elf, load_kallsyms(listing, image_path=toy_path)


def test_kallsyms_extents_keep_code_and_give_the_filler_to_the_tail(images):
    elf, ks = images
    elf_facts, ks_facts = SiteFacts(elf, ARCH), SiteFacts(ks, ARCH)
    same = longer = 0
    for func in elf.functions:
        if not ks.has_function(func.name) or ks.function(func.name).address != func.address \
                or ks.function(func.name).end < func.end:  # other symbols inside it
            continue
        a, b = elf_facts.function_code(func), ks_facts.function_code(ks.function(func.name))
        assert b.start == a.start and b.insns[:len(a.insns)] == a.insns, func.name
        if b.end == a.end:
            # the trailing filler is not code in either view, and is the same tail
            assert b.branch_targets == a.branch_targets and b.tail[:len(a.tail)] == a.tail
            same += 1
        else:
            # filler after a call to a noreturn function looks reachable without
            # the ELF's size: kept as code, the conservative side (fewer windows)
            assert b.end > a.end and b.insns[-1].mnemonic.endswith("nop"), func.name
            longer += 1
    assert same > 200 and longer < same / 10


def test_springboards_and_short_functions_work_on_kallsyms_extents(images):
    _, ks = images
    facts = SiteFacts(ks, ARCH)
    patch_area = ks.address_of("ksim_patch_area")
    snippet = bytes([0x90])

    def plan(name, policy):
        func = ks.function(name)
        req = planner.SpliceRequest(
            point=func.address, func=facts.function_code(func), compile=lambda at: snippet,
            code_address=patch_area, policy=policy,
            padding=facts.padding_slots(func.address, frozenset()), blacklist=facts.blacklist)
        return planner.plan(ARCH, req)

    # a loop head 2 bytes after the entry: only a springboard takes a jump
    assert plan("__sw_hweight64", "jmp").tactic == "springboard"
    # a 1-byte ret: the jmp spills over the filler the kallsyms extent included
    assert plan("e100_set_multicast_list", "jmp").tactic == "jmp"


def test_points_resolve_their_function_by_address_not_by_name(images, tmp_path):
    elf, _ = images
    a, b = elf.function("tcp_sync_mss"), elf.function("submit_bio")
    # a listing in which two static functions share the name "twin"
    text = to_kallsyms(elf).replace(f" {a.name}\n", " twin\n").replace(f" {b.name}\n", " twin\n")
    listing = tmp_path / "kallsyms"
    listing.write_text(text)
    ks = load_kallsyms(listing, image_path=elf.path)
    facts = SiteFacts(ks, ARCH)
    for func in (a, b):
        point = Point(func.address, PointKind.ENTRY, "twin")
        code = facts.function_code(point)
        assert code.start == func.address
        assert code.insns[0].raw == elf.read(func.address, code.insns[0].size)
        assert facts.live_at(point) == SiteFacts(elf, ARCH).live_at(
            Point(func.address, PointKind.ENTRY, func.name))


def _one_by_one(facts: SiteFacts, insns) -> dict[int, frozenset[str]]:
    """Each instruction's static hazards looked up alone (what _static_hazards finds
    for the whole span at once)."""
    out = {}
    for insn in insns:
        names = {ref.value for ref in facts.image.tables.refs_in(insn.address, insn.end)}
        if facts.blacklisted(insn.address):
            names.add("blacklist")
        if any(lo <= insn.address < hi for lo, hi in facts.static_call_text):
            names.add("static_call")
        if names:
            out[insn.address] = frozenset(names)
    return out


def test_static_hazards_of_a_span_are_each_instructions_own(debian_kernel):
    """The table entries, blacklist and static-call ranges of every 10th function of
    Debian's vmlinux, found once per function, are what each instruction's own
    lookup finds."""
    from ksim.analysis import analyze

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    facts = SiteFacts(vmlinux, ARCH)
    checked = with_hazards = 0
    for func in vmlinux.functions[::10]:
        try:
            insns = analyze(vmlinux, func).insns
        except Exception:  # noqa: BLE001 - a function that cannot be analysed: not compared
            continue
        found = facts._static_hazards([i.address for i in insns], insns[-1].end) if insns else {}
        assert found == _one_by_one(facts, insns), func.name
        checked += 1
        with_hazards += bool(found)
    assert checked > 4000 and with_hazards > 1000, (checked, with_hazards)
