"""A function seen through its compact record (ksim.analysis.record) says exactly
what its instructions and CFG as objects say: the instructions, where the code
ends, the branch targets, the unknown indirect flows, the hazards, the entry point
and the registers live before every instruction (found forward from it, and by
the whole function's solve).  Compared through SiteFacts
(which uses the view when the store has a current record) against SiteFacts
without views, on every function of the test kernels, every 20th of Debian's
x86-64 vmlinux and every 20th of its arm64 Image."""

from __future__ import annotations

import pytest
from analysis_kernel import kernels

from ksim.analysis import analyze
from ksim.analysis.record import _names
from ksim.analysis.store import HEAD_LIVE, analyze_image, store_for, use
from ksim.arch import get_arch
from ksim.arch.base import Flow
from ksim.errors import KsimError
from ksim.image import Image, load_image
from ksim.splice.sites import SiteFacts


@pytest.fixture(scope="module", params=kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def image(request) -> Image:
    img = load_image(request.param)
    use(img, analyze_image(img, save=False))
    return img


def _same(image: Image, funcs) -> tuple[int, int]:
    """(functions compared, functions the view declined)."""
    arch = get_arch(image.arch)
    fast, slow = SiteFacts(image, arch), SiteFacts(image, arch)
    slow._view = lambda _func: None  # type: ignore[method-assign]  # the object path only
    compared = declined = 0
    for func in funcs:
        try:
            a = analyze(image, func)
        except KsimError:
            continue
        seen = fast._view(func)
        if seen is None:
            declined += 1
            continue
        # the view keeps TAIL_KEPT bytes of trailing filler as instructions
        kept = len(seen.insns)
        assert list(seen.insns) == list(a.insns[:kept]), func.name
        assert all(i.size == 1 and i.flow is Flow.STOP for i in a.insns[kept:]), func.name
        f, s = fast.function_code(func), slow.function_code(func)
        assert (f.name, f.start, f.end, f.branch_targets, f.unknown_indirect, f.tail) == \
            (s.name, s.start, s.end, s.branch_targets, s.unknown_indirect, s.tail), func.name
        assert list(f.insns) == list(s.insns), func.name
        assert dict(f.hazards) == dict(s.hazards), func.name
        assert [f.index_of(i.address) for i in s.insns] == list(range(len(s.insns)))
        assert fast.entry(func) == slow.entry(func), func.name
        assert fast._extent(func) == slow._extent(func), func.name
        # a batch's question (the first instructions: the last found forward, those
        # before it by their own effects)
        assert seen.live_head(HEAD_LIVE) == [a.live_at(i.address) for i in a.insns[:HEAD_LIVE]], \
            func.name
        # the whole function's solve at every instruction; the search forward from an
        # instruction (_live_ahead) at the first eight and every fifth
        for k, insn in enumerate(a.insns[:kept]):
            live = a.live_at(insn.address)
            assert seen.live_before(insn.address) == live, f"{func.name}: {insn}"
            if k < 8 or k % 5 == 0:
                assert _names(seen._live_ahead(k)) == live, f"{func.name}: {insn} (ahead)"
        compared += 1
    return compared, declined


def test_views_say_what_the_objects_say(image: Image) -> None:
    compared, declined = _same(image, image.functions)
    assert compared >= 0.7 * (compared + declined), (compared, declined)


def test_views_on_the_debian_kernel(debian_kernel) -> None:
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    if store_for(vmlinux, build_missing=False) is None:
        use(vmlinux, analyze_image(vmlinux))
    compared, declined = _same(vmlinux, vmlinux.functions[::20])
    assert compared > 2000 and compared >= 0.8 * (compared + declined), (compared, declined)


def test_views_on_the_debian_arm64_kernel() -> None:
    from ksim.bench import kernel as kmod

    try:
        arm64 = kmod.debian_kernel(arch="arm64").load()
    except kmod.KernelUnavailable as exc:  # pragma: no cover - no package registry
        pytest.skip(str(exc))
    if store_for(arm64, build_missing=False) is None:
        use(arm64, analyze_image(arm64))
    compared, declined = _same(arm64, arm64.functions[::20])
    assert compared > 1000 and compared >= 0.8 * (compared + declined), (compared, declined)


def test_views_of_extents_that_run_over_filler(debian_kernel) -> None:
    """kallsyms extents that run over a megabyte of int3 to the next symbol: a few
    instructions and 1 MB of filler (srso_alias_safe_ret) say what the objects say;
    filler alone (__kprobes_text_end, 1.7 MB) is seen too, and its entry refused with
    the planner's words for an int3 that is not ksim's."""
    from ksim.analysis.record import TAIL_KEPT
    from ksim.errors import ProbedSite
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    if store_for(vmlinux, build_missing=False) is None:
        use(vmlinux, analyze_image(vmlinux))
    srso = vmlinux.function("srso_alias_safe_ret")
    assert srso.size > 100 * TAIL_KEPT
    assert _same(vmlinux, [srso]) == (1, 0)
    filler = vmlinux.function("__kprobes_text_end")
    facts = SiteFacts(vmlinux, get_arch(vmlinux.arch))
    assert filler.size > 100 * TAIL_KEPT and facts._view(filler) is not None
    with pytest.raises(ProbedSite, match="is an int3 that is not ksim's"):
        facts.check_point(facts.entry(filler))
