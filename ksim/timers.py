"""Virtual and wall timers: the KernInst timer library (guide section 6.2).

    vt = VTimers(kmgr)                                   # initialize_vtimer_environment
    t = vt.add_vtimer([kmgr.entry_point(f)], kmgr.exit_points(f), is_wall=False,
                      sample=print, interval=1.0)        # add_vtimer
    vt.sampler.run(seed=1)                               # runs, sampling
    t.read()                                             # TimerValue
    vt.remove_vtimers([t]); vt.cleanup()                 # cleanup_vtimer_environment

The start and stop routines and the context-switch routine are C code in the
component repository (``ksim/component_src/vtimer.c``), built for the kernel's
architecture and loaded into it;
snippets at the points call them with the timer's kernel address, the current
task, the cpu and the counter (``tsc()`` by default, or any snippet expression:
KAPI's hwcounter kinds).  Per timer, per cpu: a virtual total (excluding time a
task is switched out inside the timed code) and a wall total (outermost start
to stop).  Recursion-safe: only a task's outermost start/stop pair counts.

Each timer also calls the switch routine at the context-switch points: the entry
of ``__switch_to(prev, next)`` (both toy kernels', Linux x86-64's and arm64's),
where the outgoing and incoming tasks are the first two arguments.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ksim import components
from ksim.analysis.points import Point
from ksim.errors import KsimError
from ksim.kapi import Handle, Manager
from ksim.sampling import Sample, Sampler
from ksim.snippets import ast
from ksim.snippets.ast import arg, call, cpu, tsc

# struct layout of vtimer.c (all u64)
VT_SLOTS, VT_CPUS, VT_MAX = 64, 8, 32
SLOT_WORDS = 4
TIMER_WORDS = 2 * VT_CPUS + 4 + SLOT_WORDS * VT_SLOTS
#: where the kernel switches tasks: function, (argument of prev, argument of next)
SWITCH_POINTS = (("__switch_to", 0, 1),)


@dataclass(frozen=True)
class TimerValue:
    """One reading of a timer (events of its counter)."""

    virtual: tuple[int, ...]   # per cpu
    wall: tuple[int, ...]      # per cpu
    starts: int
    stops: int
    overflow: int
    switches_out: int
    #: start points still open (tasks inside the timed code right now), by depth
    in_flight: int

    @property
    def vtime(self) -> int:
        return sum(self.virtual)

    @property
    def wall_time(self) -> int:
        return sum(self.wall)


@dataclass(eq=False)
class VTimer:
    id: int
    address: int
    is_wall: bool
    handles: list[Handle] = field(default_factory=list)
    owner: VTimers | None = field(default=None, repr=False)

    def read(self) -> TimerValue:
        assert self.owner is not None
        return self.owner.read(self)

    @property
    def value(self) -> int:
        """What the timer reports: wall or virtual time, summed over cpus."""
        v = self.read()
        return v.wall_time if self.is_wall else v.vtime


class VTimers:
    """The timer environment of one attached kernel."""

    def __init__(self, kmgr: Manager, sampler: Sampler | None = None) -> None:
        self.kmgr = kmgr
        self.sampler = sampler if sampler is not None else Sampler(kmgr)
        self.component = components.load(kmgr, components.bundled("vtimer", kmgr.arch))
        # the timer snippets call the component's entry points, and only those
        kmgr.allow_calls(*(self.component.symbol(f) for f in ("vt_start", "vt_stop", "vt_switch")))
        self.timers: dict[int, VTimer] = {}
        image = kmgr.target.image
        self.switch_points = [(kmgr.entry_point(name), prev, nxt)
                              for name, prev, nxt in SWITCH_POINTS if image.has_function(name)]
        if not self.switch_points:
            self.component.unload()
            raise KsimError("no context-switch point found: virtual time cannot be kept")

    def current_task(self) -> ast.Var:
        ref = self.kmgr.target.abi.current_task
        return ast.Var(ref.address, 8, segment=ref.segment)

    def add_vtimer(self, start_points: Sequence[Point], stop_points: Sequence[Point], *,
                   is_wall: bool = False, counter: ast.Node | None = None,
                   sample: Callable[[Sample], None] | None = None,
                   interval: float = 1.0) -> VTimer:
        """Start code at ``start_points``, stop code at ``stop_points``; the timer's
        value is sampled to ``sample`` every ``interval`` seconds of a sampler run."""
        if len(self.timers) >= VT_MAX:
            raise KsimError(f"at most {VT_MAX} timers at once")
        slot = next(i for i in range(VT_MAX) if i not in {t.id for t in self.timers.values()})
        address = self.kmgr.alloc_data(8 * TIMER_WORDS)
        timer = VTimer(slot, address, is_wall, owner=self)
        now = counter if counter is not None else tsc()
        sym = self.component.symbol
        try:
            # the switch code first: a start can then never run without it
            for p, prev, nxt in self.switch_points:
                timer.handles.append(self.kmgr.insert_snippet(
                    p, call(sym("vt_switch"), address, arg(prev), arg(nxt), cpu(), now)))
            for points, fn in ((start_points, "vt_start"), (stop_points, "vt_stop")):
                for p in points:
                    timer.handles.append(self.kmgr.insert_snippet(
                        p, call(sym(fn), address, self.current_task(), cpu(), now)))
        except BaseException:
            for h in reversed(timer.handles):
                self.kmgr.remove_snippet(h)
            self.kmgr.free(address)
            raise
        self.timers[slot] = timer
        if sample is not None:
            self.sampler.add(f"vtimer{slot}", timer.read, callback=sample, interval=interval)
        return timer

    def remove_vtimers(self, timers: Iterable[VTimer]) -> None:
        for t in list(timers):
            for h in reversed(t.handles):
                self.kmgr.remove_snippet(h)
            t.handles.clear()
            del self.timers[t.id]
            self.sampler.remove(f"vtimer{t.id}")
            self.kmgr.free(t.address)

    def cleanup(self) -> None:
        """Remove every timer and the context-switch code; unload the component."""
        self.remove_vtimers(list(self.timers.values()))
        self.component.unload()

    def read(self, timer: VTimer) -> TimerValue:
        words = struct.unpack(f"<{TIMER_WORDS}Q", self.kmgr.target.read(timer.address, 8 * TIMER_WORDS))
        slots = words[2 * VT_CPUS + 4:]
        in_flight = sum(slots[i * SLOT_WORDS + 1] for i in range(VT_SLOTS) if slots[i * SLOT_WORDS])
        return TimerValue(virtual=words[:VT_CPUS], wall=words[VT_CPUS:2 * VT_CPUS],
                          starts=words[2 * VT_CPUS], stops=words[2 * VT_CPUS + 1],
                          overflow=words[2 * VT_CPUS + 2], switches_out=words[2 * VT_CPUS + 3],
                          in_flight=in_flight)

    def __enter__(self) -> VTimers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def default_sample_callback(sample: Sample) -> None:
    """The guide's default_sample_callback: print the sample."""
    v = sample.value
    print(f"[{sample.at:7.3f}s] {sample.name}: virtual {v.vtime} wall {v.wall_time} "
          f"starts {v.starts} stops {v.stops}")
