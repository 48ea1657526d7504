"""unicorn:toy-arm64: the arm64 toy kernel as a ksim target in unicorn.

The machine (ksim.machine.unicorn with the AArch64 board) runs the workload with
the x86 toy's checksum for the same seed, deterministically however a run is
sliced; a BRK reaches the target's interrupt hook and its patch.  Every function
the workload enters is counted under jmp and under trap splicing, each count
equal to an exact unicorn address hook on its entry, the workload's checksum
unchanged, and the text byte-identical once the splice is removed.  ``ksim
count`` and ``ksim demo`` do the same from the command line.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from ksim import images
from ksim.cli import main
from ksim.commands.count import count
from ksim.commands.demo import default_functions
from ksim.core import Write
from ksim.errors import Blacklisted, EmulationError, TargetTimeout
from ksim.images import toy
from ksim.kapi import Manager
from ksim.splice.patch import Change

IMAGE = "toy-arm64"
SPEC = f"unicorn:{IMAGE}"
SEED, ITER = 11, 100
HAVE_COMPILER = shutil.which("aarch64-linux-gnu-gcc") is not None

pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="aarch64-linux-gnu-gcc is not installed "
                                                          "(apt-get install gcc-aarch64-linux-gnu)")


@functools.cache
def entered() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(functions the workload enters that ksim may instrument, those it must never
    touch), by an address hook on every function's entry (seed SEED, ITER iterations)."""
    if not HAVE_COMPILER:
        return (), ()
    with Manager.attach(SPEC) as m:
        funcs = m.target.image.functions
        hooks = {f.name: m.target.oracle_counter(f.address) for f in funcs}
        m.run(seed=SEED, iterations=ITER)
        reached = [f for f in funcs if hooks[f.name].count]
        for h in hooks.values():
            h.close()
        never = {f.name for f in reached
                 if any(lo <= f.address < hi for lo, hi in m.facts.blacklist)}
        return (tuple(f.name for f in reached if f.name not in never), tuple(sorted(never)))


@pytest.fixture(scope="module")
def m():
    with Manager.attach(SPEC) as mgr:
        yield mgr


@pytest.fixture(scope="module")
def pristine(m):
    """The checksum of a run without instrumentation, and the text."""
    return m.run(seed=SEED, iterations=ITER).checksum, m.text_snapshot()


# --- the machine -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 42, toy.DEFAULT_SEED])
def test_workload_checksum_equals_the_x86_toys(m, seed):
    with Manager.attach("unicorn:toy") as x86:
        want = x86.run(seed=seed, iterations=500).checksum
    result = m.run(seed=seed, iterations=500)
    assert result.checksum == want != 0
    assert f"seed={seed:#x} iterations=500 checksum={want:#x}" in result.output


def test_runs_are_deterministic_however_sliced(m):
    whole = m.run(seed=5, iterations=300, count_instructions=True)
    sliced = m.run(seed=5, iterations=300, count_instructions=True, slices=[1, 7, 1000, 33_333])
    ticks: list[int] = []
    paced = m.run(seed=5, iterations=300, count_instructions=True,
                  progress=lambda: ticks.append(1))
    assert whole.checksum == sliced.checksum == paced.checksum
    assert whole.instructions == sliced.instructions == paced.instructions > 100_000
    assert whole.output == sliced.output == paced.output


def test_bench_mode_runs_the_bench_loop(m):
    result = m.run(bench_calls=1000)
    assert result.checksum == 0 and "toy: bench calls=1000 cycles=" in result.output


@pytest.mark.parametrize("paced", [False, True])
def test_a_run_past_its_timeout_stops(m, paced):
    options = {"progress": lambda: None} if paced else {}
    with pytest.raises(TargetTimeout, match="no halt after"):
        m.run(seed=1, iterations=10_000_000, timeout=0.3, **options)
    assert m.run(seed=1, iterations=50).checksum == m.run(seed=1, iterations=50).checksum


def _poked(m, name: str, word: bytes):
    """Run with ``word`` over ``name``'s first instruction, put back afterwards."""
    at = m.find_function(name).address
    old = m.target.read(at, 4)
    m.target.apply(Change(text=(Write(at, old, word),)))
    try:
        with pytest.raises(EmulationError) as info:
            m.run(seed=SEED, iterations=ITER)
    finally:
        m.target.apply(Change(text=(Write(at, word, old),)))
    return at, info.value


def test_a_brk_no_splice_routes_is_an_error(m, pristine):
    at, err = _poked(m, "kmalloc", m.arch.trap)
    assert f"trap at {at:#x} is not a ksim trap site" in str(err)
    assert m.run(seed=SEED, iterations=ITER).checksum == pristine[0]


def test_an_undefined_instruction_is_an_error(m, pristine):
    at, err = _poked(m, "kmalloc", m.arch.pad_word)
    assert f"invalid instruction at {at:#x} (kmalloc+0x0)" in str(err)
    assert m.run(seed=SEED, iterations=ITER).checksum == pristine[0]


def test_trap_hits_are_counted_by_the_target(m):
    c = m.malloc(8)
    h = m.insert_snippet(m.entry_point("kmalloc"), c.atomic_assign(c + 1), splice="trap")
    before = m.target.trap_hits
    m.run(seed=SEED, iterations=ITER)
    assert m.target.trap_hits - before == m.read(c) > 0
    m.remove_snippet(h)
    m.free(c)


# --- every function the workload reaches -----------------------------------------------------------
def test_the_workload_reaches_most_of_the_kernel():
    ok, never = entered()
    assert len(ok) > 200
    # the boot path and the stack switch run, and are never instrumented
    assert {toy.ENTRY, "cpu_switch_to", "ret_from_fork"} <= set(never)


@pytest.mark.parametrize("name", entered()[1])
def test_never_instrumented_code_is_refused(m, name):
    c = m.malloc(8)
    with pytest.raises(Blacklisted):
        m.insert_snippet(m.entry_point(name), c.atomic_assign(c + 1))
    m.free(c)
    assert m.splices() == {}


@pytest.mark.parametrize("policy", ["jmp", "trap"])
@pytest.mark.parametrize("name", entered()[0])
def test_entry_count_equals_the_oracle(m, pristine, name, policy):
    checksum, text = pristine
    fn = m.find_function(name)
    c = m.malloc(8)
    h = m.insert_snippet(m.entry_point(fn), c.atomic_assign(c + 1), splice=policy)
    try:
        assert m.patch_of(h).tactic == policy
        with m.oracle(fn.address) as oracle:
            result = m.run(seed=SEED, iterations=ITER)
            expected = oracle.count
        assert m.read(c) == expected > 0
        assert result.checksum == checksum
    finally:
        m.remove_snippet(h)
        m.free(c)
    assert m.text_snapshot() == text


# --- the command line --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["jmp", "trap"])
def test_ksim_count_of_every_function_equals_its_oracle(policy):
    report = count("*", SPEC, splice=policy, seed=SEED, iterations=ITER)
    rows = {r["function"]: r for r in report["rows"]}
    assert all(r["count"] == r["oracle"] for r in rows.values())
    assert all(r["tactic"] == policy for r in rows.values())
    reached = {name for name, r in rows.items() if r["oracle"]}
    assert reached == set(entered()[0])
    assert set(entered()[1]) <= set(report["skipped"])


def test_ksim_count_command(capsys):
    name = images.get(IMAGE).local_name("__x64_sys_getpid")
    assert main(["count", name, "--image", IMAGE, "--target", "unicorn", "--splice", "trap",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == SPEC and report["count"] == report["oracle"] > 0


def test_ksim_demo_on_the_arm64_image(capsys):
    defaults = default_functions(IMAGE)
    with Manager.attach(SPEC) as m:
        assert all(m.target.image.has_function(f) for f in defaults)
    assert "__arm64_sys_read" in defaults
    # three of them: the demo runs the whole workload, counting instructions, 2 runs each
    assert main(["demo", "--image", IMAGE, "--json", "--functions", "__arm64_sys_read",
                 "do_timer", "e100_set_multicast_list"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6
    assert all(r["ok"] and r["checksum_unchanged"] and r["count"] > 0 for r in rows)


@pytest.mark.parametrize("command,shows", [(["funcs"], "ksim_entry64"),
                                           (["disasm", "kmalloc"], "cmp x0, #0x800"),
                                           (["points", "kmalloc"], "entry ")])
def test_analysis_commands_read_the_arm64_image(capsys, command, shows):
    assert main([*command, "--image", IMAGE]) == 0
    assert shows in capsys.readouterr().out
