"""Differential runs of AArch64 kernel code, original versus spliced
(ksim.differential.harness with AArch64's DifferentialRules).

The arm64 toy kernel at every function's entry, by jmp and by trap, with several
seeds, and at random points by every tactic; then Debian's 6.1 arm64 kernel
(``debian_kernel(arch="arm64")``: the package's flat Image with the symbols of its
own kallsyms table) at a few thousand random points.  Every case must come out
equivalent or refused with a reason.  The harness must also be able to fail on
AArch64: a clobbered live register and an ADRP copied unfixed are caught.

The number of random Debian cases is KSIM_DIFF_CASES, else 3,000 (about a minute):

    KSIM_DIFF_CASES=20000 pytest tests/test_differential_arm64.py
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
from conftest import needs_image

from ksim.differential import Case, Harness, Planned, random_cases, tally
from ksim.errors import KsimError
from ksim.image.tables import TextRef
from ksim.splice.patch import Patch
from ksim.splice.planner import FunctionCode

TACTICS = ("jmp", "springboard", "trap")
#: BRK #0x800 (BUG/WARN), NOP
BRK_BUG, NOP = 0xD4210000, 0xD503201F


def case_count() -> int:
    env = os.environ.get("KSIM_DIFF_CASES")
    return int(env) if env else 3000


@pytest.fixture(scope="module")
def toy() -> Harness:
    from ksim import images
    from ksim.image import load_image

    needs_image("toy-arm64")
    return Harness(load_image(images.path("toy-arm64")))


@pytest.fixture(scope="module")
def debian() -> Harness:
    from ksim.bench import kernel as kmod

    try:
        kernel = kmod.debian_kernel(arch="arm64")
    except kmod.KernelUnavailable as exc:  # pragma: no cover - no package registry
        pytest.skip(str(exc))
    return Harness(kernel.load())


def check(results, name: str, count: int) -> dict:
    counts = tally(results)
    wrong = [r for r in results if not r.equivalent and not r.refused]
    assert not wrong, "\n".join(r.describe() for r in wrong)
    assert all(r.reason for r in results if r.refused)
    spliced = [r for r in results if r.equivalent]
    assert len(spliced) >= 0.4 * count, counts
    assert sum(r.executed for r in spliced) >= 3 * len(spliced), counts
    return counts


# --- the arm64 toy -------------------------------------------------------------------
def test_every_toy_function_entry_is_equivalent(toy):
    """Every function of toy-arm64 spliced at its entry by jmp and by trap, with
    the counter and the empty snippet, three seeds each."""
    cases = []
    for func in toy.image.functions:
        try:
            entry = toy.facts.entry(func).address
        except KsimError:  # unanalysable: the planner would refuse it too
            entry = func.address
        for tactic in ("jmp", "trap"):
            for seed in (1, 2, 3):
                snippet = "counter" if seed != 2 else "empty"
                cases.append(Case(func.name, entry, tactic, snippet, seed, "entry"))
    started = time.monotonic()
    results = [toy.run_case(c) for c in cases]
    counts = check(results, "toy-arm64", len(cases))
    print(f"\ntoy-arm64 entries: {len(cases)} cases in {time.monotonic() - started:.1f} s: "
          f"{counts}")
    spliced = {r.tactic for r in results if r.equivalent}
    assert spliced == {"jmp", "trap"}, counts
    # the counter counted: the patch ran as often as the entry was reached
    assert sum(r.hits for r in results if r.equivalent and r.case.snippet == "counter") > 100


def test_random_toy_points_are_equivalent(toy):
    """Random points of every kind (entries, blocks, call sites, any instruction,
    the tricky ones) by every tactic."""
    count = 1000
    results = [toy.run_case(c) for c in random_cases(toy, count, seed=3)]
    counts = check(results, "toy-arm64", count)
    print(f"\ntoy-arm64 random: {counts}")
    assert {r.tactic for r in results if r.equivalent} == set(TACTICS), counts


# --- the harness can fail -------------------------------------------------------------
def live_points(harness: Harness, register: str, tactic: str, limit: int):
    """Cases at points where ``register`` is live and ``tactic`` plans."""
    found = 0
    for func in harness.image.functions:
        try:
            insns = harness.facts.function_code(func).insns
        except KsimError:
            continue
        for insn in insns[2:]:
            case = Case(func.name, insn.address, tactic, "counter", 1)
            try:
                live = harness.facts.live_at(harness.facts.point_at(insn.address))
                harness.plan(case)
            except KsimError:
                continue
            if register in live:
                yield case
                found += 1
                if found >= limit:
                    return
                break


def assert_caught(harness: Harness, cases: list[Case], **wrong) -> list[str]:
    """Every case, planned right, is equivalent; made wrong, it is not (where the
    original run gets as far as the point)."""
    diffs = []
    for case in cases:
        right = harness.run_case(case)
        assert right.equivalent, right.describe()
        if not right.hits:
            continue
        broken = harness.run_case(case, **wrong)
        assert broken.status == "not-equivalent", broken.describe()
        diffs.append(broken.describe())
    assert len(diffs) >= 3, "too few of the cases reached their point"
    return diffs


def test_caught_a_clobbered_live_register(toy):
    """Snippet code that zeroes x19 where x19 is live is caught."""
    def zero_x19(code: bytes, address: int) -> bytes:
        return (0xD2800013).to_bytes(4, "little") + code  # mov x19, #0

    cases = [dataclasses.replace(c, seed=s) for c in live_points(toy, "x19", "jmp", 8)
             for s in (1, 2)]
    diffs = assert_caught(toy, cases, compile_hook=zero_x19)
    assert all("x19" in d for d in diffs), diffs


def test_caught_an_unfixed_adrp(toy):
    """An ADRP copied into the patch with its original bytes computes the patch's
    page, not the original's: caught."""
    cases: list[Case] = []
    for func in toy.image.functions:
        try:
            insns = toy.facts.function_code(func).insns
        except KsimError:
            continue
        for insn in insns:
            if insn.mnemonic == "adrp":
                made = [Case(func.name, insn.address, t, "empty", s)
                        for t in ("jmp", "trap") for s in (1, 2)]
                try:
                    toy.plan(made[0])
                except KsimError:  # blacklisted, or no tactic there
                    continue
                cases += made
        if len(cases) >= 24:
            break

    def unfixed(planned: Planned) -> Patch:
        insn = planned.moved[0]
        copy = next(c for c, original in planned.copies.items() if original == insn.address)
        at = copy - planned.patch.code_address
        code = planned.patch.code[:at] + insn.raw + planned.patch.code[at + insn.size:]
        return dataclasses.replace(planned.patch, code=code)

    planned = [c for c in cases if not toy.run_case(c).refused]
    assert_caught(toy, planned, transform=unfixed)


# --- Debian's arm64 kernel --------------------------------------------------------------
def test_debian_arm64_tables(debian):
    """The tables found in the Image by their content hold what the kernel keeps
    there: BUG/WARN sites are BRK #0x800, exception table sites loads and stores,
    ftrace sites the patchable entry's NOP, jump labels a NOP or a B."""
    image = debian.image

    def word(address: int) -> int:
        return int.from_bytes(image.read(address, 4), "little")

    tables = image.tables
    counts = tables.counts()
    assert counts["warn"] > 1000 and counts["bug"] > 500, counts
    assert counts["extable"] > 300 and counts["ftrace"] > 30000, counts
    assert counts["jump_label"] > 3000, counts
    assert all(word(a) == BRK_BUG for k in (TextRef.WARN, TextRef.BUG)
               for a in tables.addresses(k))
    assert all(word(a) & 0x0A000000 == 0x08000000 for a in tables.addresses(TextRef.EXTABLE))
    assert all(word(a) == NOP for a in tables.addresses(TextRef.FTRACE))
    assert all(word(a) == NOP or word(a) >> 26 == 0b000101
               for a in tables.addresses(TextRef.JUMP_LABEL))
    # relocated: the per-cpu offset and kallsyms' pointers are addresses again
    assert image.function("start_kernel").address >> 48 == 0xFFFF


def test_debian_arm64_random_cases_are_equivalent(debian):
    count = max(10, case_count())
    # the liveness analysis costs most of a case's time: cases share functions
    rng = random.Random(20261127)
    pool = rng.sample(debian.image.functions, max(30, count // 30))
    started = time.monotonic()
    results = [debian.run_case(c) for c in random_cases(debian, count, seed=1, functions=pool)]
    counts = check(results, "Debian arm64 vmlinux", count)
    print(f"\nDebian arm64 vmlinux: {count} cases in {time.monotonic() - started:.1f} s: "
          f"{counts}")
    if count >= 100:
        assert {r.tactic for r in results if r.equivalent} == set(TACTICS), counts


# --- findings on Debian's arm64 kernel --------------------------------------------------
def test_snippet_saves_are_not_the_originals_writes(debian):
    """round_jiffies_up_relative+0x4 (its second patchable-entry NOP), counter by
    jmp: the snippet saves x13 (zero) at what becomes the function's frame, the
    very bytes the function writes next; the harness took that save for the
    function's write and then the function's own write for an extra one."""
    func = debian.image.function("round_jiffies_up_relative")

    def blind(code: FunctionCode) -> FunctionCode:
        # planned as if the kernel's tables did not exist (ftrace may claim the NOP)
        return dataclasses.replace(code, hazards={})

    result = debian.run_case(Case(func.name, func.address + 4, "jmp", "counter", 3209701049),
                             code_hook=blind)
    assert result.equivalent, result.describe()


@pytest.mark.parametrize("tactic", ["jmp", "trap"])
def test_no_splice_inside_an_exclusive_sequence(debian, tactic):
    """rtnl_getlink+0x368 is ``sub w3, w1, w2`` between ``ldxr w1, [x5]`` and
    ``stlxr w4, w3, [x5]`` (an atomic decrement's LL/SC loop).  Spliced with the
    counter, the snippet's own LDAXR/STLXR made the function's STLXR fail every
    time and its retry loop ran the snippet until the budget (the patch ran 101
    times, the point was reached twice).  The point and the store-exclusive are
    refused, as kprobes refuses them; the instructions around the loop splice."""
    func = debian.image.function("rtnl_getlink")
    for offset in (0x368, 0x36C):
        result = debian.run_case(Case(func.name, func.address + offset, tactic, "counter",
                                      2603569354))
        assert result.refused and "store-exclusive" in result.reason, result.describe()
    for offset in (0x360, 0x370):
        result = debian.run_case(Case(func.name, func.address + offset, tactic, "counter",
                                      2603569354))
        assert result.equivalent, result.describe()


def test_exclusive_sequences():
    """AArch64's in_exclusive_sequence: after a load-exclusive up to its
    store-exclusive, looking back at most 32 instructions (kprobes' rule)."""
    from ksim.arch import get_arch

    arch = get_arch("aarch64")
    words = [0x91025AC5,   # add x5, x22, #0x96
             0x885F7CA1,   # ldxr w1, [x5]
             0x4B020023,   # sub w3, w1, w2
             0x8804FCA3,   # stlxr w4, w3, [x5]
             0x35FFFFA4,   # cbnz w4, .-12
             0xD65F03C0]   # ret
    code = b"".join(w.to_bytes(4, "little") for w in words)
    insns = list(arch.decode(code, 0xFFFF800008000000))
    assert [i.mnemonic for i in insns] == ["add", "ldxr", "sub", "stlxr", "cbnz", "ret"]
    assert [arch.in_exclusive_sequence(insns, k) for k in range(len(insns))] == \
        [False, False, True, True, False, False]
    # beyond 32 instructions back, a load-exclusive is not looked for
    far = [insns[1]] + [insns[2]] * 32 + [insns[3]]
    assert not arch.in_exclusive_sequence(far, 33)
    assert arch.in_exclusive_sequence(far, 32)
    assert not get_arch("x86_64").in_exclusive_sequence(insns, 2)
