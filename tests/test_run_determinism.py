"""A unicorn run is the same however it is sliced, and Ctrl-C stops it cleanly.

Real unicorn throughout.  The run is cut into ``emu_start`` slices bounded by an
instruction count (ksim.machine.unicorn, "Slices"); these tests cut the same
run in very different ways and compare everything it reports: the spliced
snippets' counters, the exact-address oracles, the checksum and the number of
instructions.  Before, a slice that ended on an oracle's instruction counted that
instruction twice, and ``ksim count`` in text mode (which slices the run for its
progress line) disagreed with its own oracle now and then.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import threading
import time

import pytest

from ksim.cli import main
from ksim.kapi import Manager

SEED, ITERATIONS = 3, 100
#: fib is entered through a jmp splice, kmem_cache_alloc through an int3 (trap)
SPLICED = (("fib", "jmp"), ("kmem_cache_alloc", "trap"))


@pytest.fixture(scope="module")
def spliced(toy_path):
    m = Manager.attach("unicorn:toy")
    counters = {}
    for name, policy in SPLICED:
        fn = m.find_function(name)
        counter = m.malloc(8)
        m.insert_snippet(m.entry_point(fn), counter.atomic_assign(counter + 1), splice=policy)
        counters[fn.address] = counter
    yield m, counters
    m.detach()


def measure(m, counters, **options):
    """Everything one run reports: counter deltas, oracle counts, checksum, instructions."""
    before = {a: m.read(c) for a, c in counters.items()}
    with m.oracle(min(counters)) as first, m.oracle(max(counters)) as second:
        result = m.run(seed=SEED, iterations=ITERATIONS, count_instructions=True, **options)
        oracles = {min(counters): first.count, max(counters): second.count}
    snippets = {a: m.read(c) - before[a] for a, c in counters.items()}
    return snippets, oracles, result.checksum, result.instructions


def test_slicing_changes_nothing(spliced):
    m, counters = spliced
    machine = m.target.machine
    reference = measure(m, counters)  # the default slices: a few for a run this short
    snippets, oracles, _, instructions = reference
    assert snippets == oracles and all(n > 0 for n in snippets.values())
    assert instructions and instructions > 100_000

    stops: list[int] = []

    def progress():  # called between slices, with the machine stopped
        stops.append(machine.reg("rip"))

    rng = random.Random(20261121)
    ways = {
        "tiny": itertools.repeat(997),
        "random": iter(lambda: rng.randint(1, 48), None),
        "one then large": itertools.chain([1], itertools.repeat(50_000)),
    }
    for way, slices in ways.items():
        stops.clear()
        assert measure(m, counters, progress=progress, slices=slices) == reference, way
        assert len(stops) > 1, way
        if way == "random":
            # The run is deterministic, so these boundaries are always the same ones:
            # thousands of slices, some ending on each oracle's instruction -- the
            # jmp splice's site, and the int3 of the trap splice.
            assert len(stops) > 3000
            assert all(stops.count(address) > 0 for address in counters), \
                {hex(a): stops.count(a) for a in counters}


def test_slicing_changes_nothing_without_instruction_counting(spliced):
    m, counters = spliced
    rng = random.Random(5)
    runs = []
    for slices in (None, iter(lambda: rng.randint(1, 64), None), itertools.repeat(333)):
        before = {a: m.read(c) for a, c in counters.items()}
        with m.oracle(min(counters)) as oracle:
            r = m.run(seed=SEED + 1, iterations=ITERATIONS, slices=slices)
            runs.append(({a: m.read(c) - before[a] for a, c in counters.items()},
                         oracle.count, r.checksum, r.instructions))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0][min(counters)] == runs[0][1] > 0


def test_count_in_text_mode_matches_its_oracle(capsys, toy_path):
    """`ksim count fib --iterations 30000`, text mode (a progress line, so a sliced
    run) used to report a false mismatch in most runs."""
    for _ in range(3):
        status = main(["count", "fib", "--iterations", "30000"])
        out = capsys.readouterr().out
        assert status == 0 and "(matches the oracle)" in out, out


@contextlib.contextmanager
def sigint_after(seconds: float):
    """Ctrl-C from another thread after ``seconds`` (never after the block: a late
    SIGINT would stop the test session)."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_ctrl_c_stops_a_run_at_once_and_the_machine_runs_again(spliced, sliced):
    """Sliced, the run stops between two slices; whole (no progress callback), a
    watchdog thread stops it wherever it is, and it is abandoned."""
    m, counters = spliced
    before = signal.getsignal(signal.SIGINT)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), sigint_after(0.3):
        m.run(seed=SEED, iterations=10**12, progress=(lambda: None) if sliced else None)
    assert time.monotonic() - start < 0.3 + 1.0
    assert signal.getsignal(signal.SIGINT) is before
    # the next run boots afresh and reports what an uninterrupted run reports
    assert measure(m, counters) == measure(m, counters, slices=itertools.repeat(4096))


@pytest.mark.parametrize("mode", ["text", "json"])
def test_ctrl_c_in_count_prints_the_partial_count_and_restores_the_text(
        capsys, monkeypatch, toy_path, mode):
    attached: list[Manager] = []
    attach = Manager.attach.__func__  # type: ignore[attr-defined]

    def spy(cls, spec, **options):
        m = attach(cls, spec, **options)
        attached.append(m)
        return m

    monkeypatch.setattr(Manager, "attach", classmethod(spy))
    start = time.monotonic()
    json_flag = ["--json"] if mode == "json" else []
    with sigint_after(1.0):
        status = main(["count", "fib", "--iterations", str(10**12), "--splice", "trap",
                       *json_flag])
    assert time.monotonic() - start < 1.0 + 5.0
    out = capsys.readouterr().out
    assert status == 130
    if mode == "json":
        report = json.loads(out)
        assert report["interrupted"] is True and report["count"] > 0 and report["oracle"] > 0
    else:
        assert "entries so far" in out and "(interrupted; the oracle had" in out, out
    (m,) = attached
    for section in m.target.image.sections:
        if section.executable and section.data:
            assert m.target.read(section.address, section.size) == section.data, section.name
