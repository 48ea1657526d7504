"""Periodic sampling over the network: counters read from a live kernel while a
guest program runs, checked against the kernel's own kprobe at the end."""

from __future__ import annotations

import pytest

from ksim.kapi import Manager
from ksim.live.testing import getppid_loop, testbed  # noqa: F401 - testbed is a fixture
from ksim.sampling import Sampler

pytestmark = [pytest.mark.live, pytest.mark.slow]
FUNC = "__x64_sys_getppid"


def test_samples_arrive_while_the_guest_runs(testbed):  # noqa: F811
    m = Manager.attach(testbed["address"])
    try:
        fn = m.find_function(FUNC)
        counter = m.malloc(8)
        h = m.insert_snippet(m.entry_point(fn), counter.atomic_assign(counter + 1), splice="jmp")
        seen: list[int] = []
        sampler = Sampler(m)
        sampler.add("getppid", lambda: m.read(counter), callback=lambda s: seen.append(s.value),
                    interval=0.5)
        n = 3_000_000
        with m.oracle(fn.address) as oracle:
            sampler.run(while_cmd=f"{getppid_loop()} {n}")
            expected = oracle.count
        final = m.read(counter)
        m.remove_snippet(h)
    finally:
        m.detach()
    # several samples during the run, rising, the last one the final count
    assert len(seen) >= 3, seen
    assert seen == sorted(seen) and seen[0] < final
    assert seen[-1] == final
    assert n <= final <= expected + 5 and expected - 5 <= final
