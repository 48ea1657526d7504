"""Differential runs of real kernel code, original versus spliced (ksim.differential.harness).

The Debian 6.1 vmlinux, e100.ko and ext4.ko run in unicorn from seeded random points,
once as they are and once spliced by the planner; every case must come out
equivalent or refused.  The harness must also be able to fail: deliberately wrong
patches (a RIP-relative operand left unfixed, a clobbered live register, a moved
call that returns into the patch, a WARN moved out of the bug table's sight) are
each caught.

The number of random cases per image is KSIM_DIFF_CASES, else the hypothesis
profile's ``max_examples`` (ci: 300, long: 10,000):

    KSIM_DIFF_CASES=20000 pytest tests/test_differential.py
    pytest tests/test_differential.py --hypothesis-profile=long
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
from hypothesis import settings

from ksim.arch.base import Flow
from ksim.arch.x86_64.writer import Writer
from ksim.differential import Case, Harness, Planned, random_cases, tally
from ksim.errors import KsimError
from ksim.splice.patch import Patch
from ksim.splice.planner import FunctionCode

TACTICS = ("jmp", "jmp+displace", "springboard", "trap")


def case_count() -> int:
    env = os.environ.get("KSIM_DIFF_CASES")
    return int(env) if env else settings().max_examples


@pytest.fixture(scope="module")
def kernel(debian_kernel):
    return debian_kernel


@pytest.fixture(scope="module")
def harnesses(kernel):
    from ksim.image import load_image, load_kallsyms

    made: dict[str, Harness] = {}

    def get(name: str) -> Harness:
        if name not in made:
            image = {"vmlinux": lambda: load_kallsyms(kernel.kallsyms, kernel.vmlinux),
                     "e100.ko": lambda: load_image(kernel.e100),
                     "ext4.ko": lambda: load_image(kernel.ext4)}[name]()
            made[name] = Harness(image)
        return made[name]

    return get


def function_pool(harness: Harness, name: str, count: int) -> list | None:
    """All functions of a module; a seeded sample of vmlinux's (its liveness
    analysis costs up to a second per function, so cases share functions there),
    with the paravirt call sites of the bug report."""
    if name != "vmlinux":
        return None
    size = max(30, count // 10)
    rng = random.Random(20261123)
    pool = rng.sample(harness.image.functions, size)
    return pool + [harness.image.function(n) for n in ("resched_cpu", "__pmd")]


@pytest.mark.parametrize("name", ["e100.ko", "ext4.ko", "vmlinux"])
def test_random_cases_are_equivalent(harnesses, name):
    harness = harnesses(name)
    count = max(10, case_count())
    started = time.monotonic()
    results = [harness.run_case(case) for case in
               random_cases(harness, count, seed=1, functions=function_pool(harness, name, count))]
    seconds = time.monotonic() - started
    counts = tally(results)
    print(f"\n{name}: {count} cases in {seconds:.1f} s: {counts}")
    wrong = [r for r in results if not r.equivalent and not r.refused]
    assert not wrong, "\n".join(r.describe() for r in wrong)
    spliced = [r for r in results if r.equivalent]
    # the planner must splice a good share of them, and the spliced code must run
    assert len(spliced) >= 0.4 * count, counts
    assert sum(r.executed for r in spliced) >= 3 * len(spliced), counts
    assert sum(r.executed >= 5 for r in spliced) >= 0.25 * len(spliced), counts
    if count >= 100:
        assert {r.tactic for r in spliced} == set(TACTICS), counts
    assert all(r.reason for r in results if r.refused)


def test_a_case_runs_the_same_every_time(harnesses):
    harness = harnesses("e100.ko")
    for case in random_cases(harness, 20, seed=7):
        first, again = harness.run_case(case), harness.run_case(case)
        assert (first.status, first.diffs, first.exit, first.executed, first.hits) == \
            (again.status, again.diffs, again.exit, again.executed, again.hits), case


# --- the harness can fail -------------------------------------------------------------
def resched(harness: Harness, offset: int, tactic: str, snippet: str = "counter",
            seed: int = 1) -> Case:
    func = harness.image.function("resched_cpu")
    return Case(func.name, func.address + offset, tactic, snippet, seed)


def assert_caught(harness: Harness, cases: list[Case], **wrong) -> list[str]:
    """Every case, planned right, is equivalent; made wrong, it is not."""
    diffs = []
    for case in cases:
        right = harness.run_case(case)
        if right.refused:  # the tactic does not fit there: nothing to break
            continue
        assert right.equivalent, right.describe()
        broken = harness.run_case(case, **wrong)
        assert broken.status == "not-equivalent", broken.describe()
        diffs.append(broken.describe())
    assert len(diffs) >= len(cases) // 2, "too few of the cases could be planned"
    return diffs


def test_caught_an_unfixed_rip_relative_operand(harnesses):
    """stop_nmi+0x5 is ``add dword ptr [rip + X], 1`` (a counter in .data): its copy
    in the patch keeps the original displacement and updates the wrong address."""
    harness = harnesses("vmlinux")
    func = harness.image.function("stop_nmi")

    def unfixed(planned: Planned) -> Patch:
        insn = planned.moved[0]
        assert insn.pc_ref is not None and insn.flow is Flow.SEQ
        copy = next(c for c, original in planned.copies.items() if original == insn.address)
        at = copy - planned.patch.code_address
        code = planned.patch.code[:at] + insn.raw + planned.patch.code[at + insn.size:]
        return dataclasses.replace(planned.patch, code=code)

    cases = [Case(func.name, func.address + 5, tactic, snippet, seed)
             for tactic in ("jmp", "trap") for snippet in ("empty", "counter") for seed in (1, 2)]
    diffs = assert_caught(harness, cases, transform=unfixed)
    assert all("write" in d for d in diffs), diffs


def test_caught_a_clobbered_live_register(harnesses):
    """At resched_cpu+0x5 (after the fentry call) rbx is live (the function saves
    it): snippet code that zeroes it is caught."""
    harness = harnesses("vmlinux")
    case = resched(harness, 0x5, "jmp+displace")
    assert "rbx" in harness.facts.live_at(harness.facts.point_at(case.address))

    def xor_rbx(code: bytes, address: int) -> bytes:
        return b"\x31\xdb" + code  # xor ebx, ebx

    cases = [dataclasses.replace(case, tactic=t, seed=s)
             for t in ("jmp+displace", "springboard", "trap") for s in (1, 2, 3)]
    assert_caught(harness, cases, compile_hook=xor_rbx)


def test_caught_a_moved_call_that_returns_into_the_patch(harnesses):
    """resched_cpu+0x24 is a direct call; copied as a plain relocated call, its
    return address points into the patch instead of the original text."""
    harness = harnesses("vmlinux")
    arch = harness.arch

    def plain_call(planned: Planned) -> Patch:
        # the relocator itself never moves a call as a plain call: written by hand here
        at = planned.patch.code_address + len(planned.body)
        call = planned.moved[-1]
        assert call.flow is Flow.CALL and call.target is not None
        head = arch.relocate(planned.moved[:-1], at)
        w = Writer(at + len(head))
        w.put_call(call.target)
        moved = head + w.flush()
        code = planned.body + moved + arch.jmp(at + len(moved), call.end)
        return dataclasses.replace(planned.patch, code=code)

    cases = [resched(harness, 0x24, t, s, seed)
             for t in ("jmp", "trap") for s in ("empty", "counter") for seed in (1, 2)]
    diffs = assert_caught(harness, cases, transform=plain_call)
    assert all("call" in d or "exit" in d for d in diffs)


def warn_windows(harness: Harness):
    """Points whose 5-byte window would take a WARN's ud2 along (straight-line code
    up to it): (case, the ud2's address)."""
    facts = harness.facts
    for warn in sorted(harness.warn_sites):
        func = harness.image.function_at(warn)
        if func is None:
            continue
        try:
            insns = facts.function_code(func).insns
        except KsimError:  # an unanalysable function has no candidates
            continue
        index = {i.address: k for k, i in enumerate(insns)}.get(warn)
        if index is None:
            continue
        for k in range(index - 1, max(index - 4, -1), -1):
            point = insns[k]
            if warn + 2 - point.address < 5 or any(i.flow is not Flow.SEQ for i in insns[k:index]):
                continue
            if warn - point.address < 5:
                yield Case(func.name, point.address, "jmp+displace", "counter", 1), warn


def blind(code: FunctionCode) -> FunctionCode:
    """The planner's view of a function as if the kernel's tables did not exist."""
    return dataclasses.replace(code, hazards={})


def warn_case(harness: Harness) -> tuple[Case, int]:
    """The first WARN window whose planned-without-hazards patch moves the ud2 and
    whose original run reaches it, with a seed that gets there."""
    for case, warn in warn_windows(harness):
        try:
            planned = harness.plan(case, code_hook=blind)
        except KsimError:  # other rules refuse it: try the next
            continue
        if warn not in {i.address for i in planned.moved}:
            continue
        for seed in range(1, 8):
            seeded = dataclasses.replace(case, seed=seed)
            original, _ = harness.runs(seeded, code_hook=blind)
            if warn in original.warnings:
                return seeded, warn
    raise AssertionError(f"{harness.image.module}: no WARN window reached")


def test_caught_a_warn_moved_into_the_patch(harnesses):
    """Planned as if the bug table did not exist, a window that takes a WARN's ud2
    into the patch is caught: the kernel would no longer find it (an oops instead
    of a warning)."""
    harness = harnesses("ext4.ko")
    case, warn = warn_case(harness)
    broken = harness.run_case(case, code_hook=blind)
    assert broken.status == "not-equivalent", broken.describe()
    assert any("WARN" in d for d in broken.diffs), broken.describe()


# --- regressions from the bug report ---------------------------------------------------
@pytest.mark.parametrize("function,offset", [("resched_cpu", 0x54), ("__pmd", 0)])
@pytest.mark.parametrize("tactic", TACTICS)
def test_paravirt_indirect_call_sites(harnesses, function, offset, tactic):
    """``call qword ptr [rip + X]`` through pv_ops, displaced or trapped: equivalent
    (the callee returns to the original text) or refused with a reason."""
    harness = harnesses("vmlinux")
    func = harness.image.function(function)
    for snippet in ("empty", "counter"):
        for seed in (1, 2, 3):
            result = harness.run_case(Case(function, func.address + offset, tactic, snippet, seed))
            assert result.equivalent or (result.refused and result.reason), result.describe()
            if result.equivalent:
                original, _ = harness.runs(result.case)
                assert original.calls, "the pv_ops call must have been stepped over"


def test_warn_site_in_a_displacement_window(harnesses):
    """The planner as it is: a jmp+displace window over a reachable WARN's ud2 is
    equivalent or refused with a reason."""
    harness = harnesses("ext4.ko")
    case, warn = warn_case(harness)
    for tactic in TACTICS:
        result = harness.run_case(dataclasses.replace(case, tactic=tactic))
        assert result.equivalent or (result.refused and result.reason), result.describe()


@pytest.mark.parametrize("function,offset,seed", [("delay_loop", 0x20, 1),
                                                  ("sk_forced_mem_schedule", 0x98, 1)])
def test_loop_head_in_a_displacement_window(harnesses, function, offset, seed):
    """A loop head whose backward branch lies in the 5-byte window (delay_loop's
    ``dec rax; jne .-3``, this_cpu_cmpxchg's ``cmpxchg gs:[rcx], esi; jne .-4``):
    moved into the patch, the branch must come back through the snippets, which
    run each time the point is reached; equivalent or refused with a reason."""
    harness = harnesses("vmlinux")
    func = harness.image.function(function)
    for tactic in TACTICS:
        result = harness.run_case(Case(function, func.address + offset, tactic, "counter", seed))
        assert result.equivalent or (result.refused and result.reason), result.describe()


# --- what the harness compares ----------------------------------------------------------
@pytest.mark.parametrize("function,tactic,seed", [
    ("tk_debug_account_sleep_time.cold", "auto", 2015878982),
    ("pvh_start_xen", "auto", 2967574583),
])
def test_harness_compares_only_what_is_defined(harnesses, function, tactic, seed):
    """Two cases over every entry of the vmlinux (ksim verify) that differed in what
    the harness compared, not in what the splice did: the flags idiv leaves
    undefined (unicorn keeps the previous instruction's, which the snippet's lock
    add changed), and an exit at lgdt described by its relocated copy's text."""
    harness = harnesses("vmlinux")
    func = harness.image.function(function)
    result = harness.run_case(Case(function, func.address, tactic, "counter", seed))
    assert result.equivalent, result.describe()
