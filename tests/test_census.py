"""The census over real kernel code: no instruction the kernel finds or rewrites by
address is ever moved into a patch, each is refused at its own site with its own
error, and indirect calls are spliced (moved with the original return address on the stack) rather than refused."""

from __future__ import annotations

import pytest

from ksim.bench.census import FAMILIES, measure

#: the error a point at a site of each table family is refused with
ERRORS = {"warn": "BugSite", "bug": "BugSite", "extable": "ExtableSite",
          "ftrace": "FtraceSite", "jump_label": "JumpLabelSite", "static_call": "StaticCallSite"}


@pytest.fixture(scope="module")
def kernel(debian_kernel):
    return debian_kernel


def images(kernel):
    from ksim.image import load_image, load_kallsyms

    return {"vmlinux": lambda: load_kallsyms(kernel.kallsyms, kernel.vmlinux),
            "e100.ko": lambda: load_image(kernel.e100), "ext4.ko": lambda: load_image(kernel.ext4)}


@pytest.mark.parametrize("name,per_family", [("e100.ko", 40), ("ext4.ko", 40), ("vmlinux", 15)])
def test_no_table_site_is_ever_moved(kernel, name, per_family):
    result = measure(name, images(kernel)[name](), per_family, 15)
    families = result["families"]
    assert set(families) == set(FAMILIES)
    examined = 0
    for family, error in ERRORS.items():
        f = families[family]
        examined += f["examined"]
        assert f["moved_now"] == 0, (family, f["moved_now_examples"])
        # refused at the site, with the family's own error (or, inside blacklisted
        # code, Blacklisted: checked first)
        assert set(f["at_site"]) <= {"refused:" + error, "refused:Blacklisted"}, f["at_site"]
        # without the rules the same sites were moved: the census measures something
        assert f["moved_without_rules"] >= f["examined"] // 2
    assert examined > 0
    calls = families["indirect_call"]
    if calls["examined"]:
        spliced = calls["spliced_at_site"]
        assert spliced >= 0.8 * calls["examined"], calls["at_site"]
    cov = result["jmp_coverage"]
    # the refusals cost little: entries stay spliceable, block starts drop by a few points
    assert cov["with_rules"]["entry"] >= cov["without_rules"]["entry"] - 0.05
    assert cov["with_rules"]["block"] >= cov["without_rules"]["block"] - 0.10
