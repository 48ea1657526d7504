"""Virtual and wall timers on unicorn:toy and unicorn:toy-arm64 (the vtimer
component built for each image's architecture).

Exact check: with a counter the test can observe (a kernel variable counting
memcpy calls, like a hardware event counter), an independent Python model driven
by address hooks at the same start, stop and context-switch points gives the
same virtual and wall totals.  With the TSC: consistency (vtime <= wall, every
start matched by a stop or still in flight, starts == entries)."""

from __future__ import annotations

import pytest
from conftest import TOY_IMAGES, needs_image, toy_name

from ksim.kapi import Manager
from ksim.timers import VTimers

ITER = 300


@pytest.fixture(params=TOY_IMAGES)
def m(request):
    needs_image(request.param)
    with Manager.attach(f"unicorn:{request.param}") as mgr:
        yield mgr


class Model:
    """The vtimer algorithm, fed by unicorn hooks."""

    def __init__(self, m: Manager, counter) -> None:
        self.m, self.counter = m, counter
        self.slots: dict[int, list[int]] = {}
        self.vtime = self.wall = self.starts = self.stops = 0
        self.cur = m.target.abi.current_task.address

    def now(self) -> int:
        return self.m.read(self.counter)

    def task(self, mach) -> int:
        return mach.read_u64(self.cur)

    def start(self, mach, _a) -> None:
        s = self.slots.setdefault(self.task(mach), [0, 0, 0])
        self.starts += 1
        if s[0] == 0:
            s[1] = s[2] = self.now()
        s[0] += 1

    def stop(self, mach, _a) -> None:
        s = self.slots.get(self.task(mach))
        if not s or not s[0]:
            return
        self.stops += 1
        s[0] -= 1
        if s[0] == 0:
            self.vtime += self.now() - s[1]
            self.wall += self.now() - s[2]
            del self.slots[self.task(mach)]

    def switch(self, mach, _a) -> None:
        prev, nxt = (mach.reg(r) for r in self.m.arch.arg_regs[:2])
        if prev == nxt:
            return
        if prev in self.slots and self.slots[prev][0]:
            self.vtime += self.now() - self.slots[prev][1]
        if nxt in self.slots and self.slots[nxt][0]:
            self.slots[nxt][1] = self.now()


@pytest.mark.parametrize("func", ["context_switch", "vfs_write", "tcp_sendmsg"])
def test_timer_totals_match_a_model_driven_by_hooks(m, func):
    func = toy_name(m, func)
    events = m.malloc()
    count = m.insert_snippet(m.entry_point("memcpy"), events.atomic_assign(events + 1))
    model = Model(m, events)
    hook = m.target.machine.hook_code
    removes = [hook(m.entry_point(func).address, model.start)]
    removes += [hook(p.address, model.stop) for p in m.exit_points(func)]
    removes += [hook(m.entry_point("__switch_to").address, model.switch)]
    with VTimers(m) as vt:
        t = vt.add_vtimer([m.entry_point(func)], m.exit_points(func), counter=events)
        m.run(iterations=ITER)
        v = t.read()
    for r in removes:
        r()
    m.remove_snippet(count)
    assert v.starts == model.starts > 0 and v.stops == model.stops
    assert (v.vtime, v.wall_time) == (model.vtime, model.wall)
    assert v.vtime <= v.wall_time
    if func == "context_switch":  # the timed code switches tasks: virtual < wall
        assert v.switches_out > 0 and v.vtime < v.wall_time


@pytest.mark.parametrize("func", ["context_switch", "fib", "kmalloc"])
def test_tsc_timers_are_consistent(m, func):
    func = toy_name(m, func)
    before = m.text_snapshot()
    with VTimers(m) as vt, m.oracle(m.entry_point(func).address) as entries:
        virt = vt.add_vtimer([m.entry_point(func)], m.exit_points(func))
        wall = vt.add_vtimer([m.entry_point(func)], m.exit_points(func), is_wall=True)
        m.run(iterations=ITER)
        a, b = virt.read(), wall.read()
        assert a.starts == entries.count > 0
        assert a.starts == a.stops + a.in_flight
        assert 0 < a.vtime <= a.wall_time
        # two timers measure slightly different windows (each other's code): compare
        # each with itself
        assert 0 < b.vtime <= b.wall_time
        assert wall.value == b.wall_time and virt.value == a.vtime
        assert a.overflow == 0
    assert m.splices() == {}
    assert m.text_snapshot() == before


def test_timers_sample_during_a_run_and_clean_up(m):
    before = m.text_snapshot()
    patch_area = m.target.read(m.target._code.start, 4096)
    got = []
    vt = VTimers(m)
    vt.add_vtimer([m.entry_point("fib")], m.exit_points("fib"), sample=got.append, interval=0.0)
    vt.sampler.run(iterations=ITER)
    assert got and got[-1].value.starts > 0
    assert [s.value.starts for s in got] == sorted(s.value.starts for s in got)
    vt.cleanup()
    assert m.splices() == {}
    assert m.text_snapshot() == before
    assert m.target.read(m.target._code.start, 4096) == patch_area


def test_the_link_register_is_live_at_a_tail_call_exit():
    """kmalloc's exits on the arm64 toy are tail calls (B kmem_cache_alloc after
    the frame's x30 is restored): the callee returns through x30, so a timer's
    call there must keep it (the convention's link_reg)."""
    needs_image("toy-arm64")
    with Manager.attach("unicorn:toy-arm64") as m:
        code = m.facts.function_code("kmalloc")
        exits = m.exit_points("kmalloc")
        assert exits and all(code.insns[code.index_of(p.address)].mnemonic == "b" for p in exits)
        assert all("x30" in m.facts.live_at(p) for p in exits)
