"""The census over Debian's arm64 kernel (the flat Image, its kallsyms and the tables
found in it): no instruction the kernel finds or rewrites by address -- a WARN/BUG
``BRK #0x800``, an exception-table entry, either instruction of an ftrace pair, a
jump label -- nor a branch-protection instruction or one inside an exclusive
sequence is ever moved into a patch; indirect calls (BLR) are spliced."""

from __future__ import annotations

import pytest

from ksim.bench.census import FAMILIES, HAZARD_FAMILIES, Census, is_branch_prot, measure

#: the error a point at a site of each family is refused with (a BUG/WARN's BRK #0x800
#: is the kernel's own, not another instrumenter's breakpoint)
ERRORS = {"warn": {"BugSite"}, "bug": {"BugSite"},
          "extable": {"ExtableSite"}, "ftrace": {"FtraceSite"},
          "jump_label": {"JumpLabelSite"}, "branch_prot": {"UnsafeSite"},
          "exclusive": {"UnsafeSite"}}
NOP = 0xD503201F
BRK_BUG = 0xD4210000  # BRK #0x800


@pytest.fixture(scope="module")
def image():
    from ksim.bench import kernel as kmod

    try:
        return kmod.debian_kernel(arch="arm64").load()
    except kmod.KernelUnavailable as exc:  # pragma: no cover - no package registry
        pytest.skip(str(exc))


def test_no_hazard_site_is_moved_on_arm64(image):
    result = measure("vmlinux (arm64)", image, 12, 12)
    assert result["arch"] == "aarch64"
    families = result["families"]
    assert set(families) == set(FAMILIES)
    for family, errors in ERRORS.items():
        f = families[family]
        assert f["sites"] > 100 and f["examined"] > 0, (family, f)
        assert f["moved_now"] == 0, (family, f["moved_now_examples"])
        assert {v.split(":", 1)[1] for v in f["at_site"]} <= errors | {"Blacklisted"}, \
            (family, f["at_site"])
    # without the rules the table sites (but the BRKs) were moved: the census measures
    for family in ("extable", "ftrace", "jump_label", "branch_prot"):
        assert families[family]["moved_without_rules"] >= families[family]["examined"] // 2
    assert families["static_call"]["sites"] == 0  # no static calls on arm64 6.1
    calls = families["indirect_call"]
    assert calls["spliced_at_site"] >= 0.8 * calls["examined"], calls["at_site"]
    assert set(HAZARD_FAMILIES) == set(FAMILIES) - {"indirect_call"}


def test_the_sites_are_what_the_kernel_keeps_there(image):
    """Each family's sites hold the instructions the census says: BRK #0x800 for
    WARN/BUG, the two NOPs of each patchable entry, BRANCH_PROT instructions, and
    every ftrace location as a pair."""
    census = Census(image)

    def word(address: int) -> int:
        return int.from_bytes(image.read(address, 4), "little")

    for family in ("warn", "bug"):
        assert all(word(a) == BRK_BUG for a in census.sites(family))
    ftrace = set(census.sites("ftrace"))
    firsts = {a for a in ftrace if a + 4 in ftrace and a - 4 not in ftrace}
    assert len(firsts) * 2 == len(ftrace) and all(word(a) == NOP for a in ftrace)
    prot = census.sites("branch_prot")[:2000]
    assert prot and all(is_branch_prot(word(a)) for a in prot)
    # the entry point of a traced function lies after its ftrace pair
    func = image.function_at(min(firsts))
    assert census.facts.entry(func).address == min(firsts) + 8
