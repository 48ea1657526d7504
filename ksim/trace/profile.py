"""``profile:hz:N`` without perf: a snippet on the kernel's tick, guarded by a
per-cpu schedule (docs/profile.md).

    s = sampler(m, "hz", 99)
    handles = m.insert_many(s.points, lambda p: ast.if_(s.guard, action))
    ...
    m.remove_many(handles); release(m, s)

bpftrace's profile probe is perf's cpu-clock event: an hrtimer per cpu that fires
N times a second.  ksim has no perf, so it splices the function the kernel runs
on every cpu at each tick of that cpu, ``update_process_times``
(kernel/time/timer.c; called by ``tick_sched_handle`` in NO_HZ and high-resolution
mode and by ``tick_periodic`` otherwise), and lets the action run only when the
cpu's next sample is due.  The due times live in one heap block, per cpu:

    next[cpu]   0 until the cpu's first tick; then the time its next sample is due
    now[cpu]    the clock as this tick read it (a scratch word: a tick's snippet
                runs with interrupts off, so nothing else on the cpu touches it)

A tick reads the clock once.  The first tick of a cpu only starts its schedule
(``next = now + period``: like perf, the first sample comes one period in).  A
later tick samples when ``now >= next`` and moves ``next`` on by one period, so
samples keep the rate on average however the ticks jitter; a cpu that fell a
whole period behind (its tick was stopped while it idled) takes one sample and
starts again from ``now + period`` instead of catching up with a burst.  A
clock more than a period behind ``next`` (an emulated kernel booted again under
the same heap) starts the schedule again too.

Samples are therefore at most one per tick: a rate above the kernel's tick rate
(HZ) is refused (``BadProfileRate``), not silently lowered.  A cpu whose tick is
stopped (NO_HZ idle) takes no samples while it sleeps, where perf would sample
its idle task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ksim.analysis.points import Point
from ksim.errors import KsimError
from ksim.images import toy
from ksim.snippets import ast

from .errors import TraceError

if TYPE_CHECKING:
    from ksim.kapi import Manager

#: nanoseconds per unit of a period; hz is a rate (bpftrace's profile units)
UNITS = {"hz": 0, "s": 10**9, "ms": 10**6, "us": 10**3}
#: the longest period accepted: due times stay far from 64-bit wrap-around
MAX_PERIOD_NS = 1 << 62
NSEC_PER_SEC = 10**9


class ProfileError(TraceError):
    """A profile probe ksim cannot sample."""

    code = "profile"


class BadProfileUnit(ProfileError):
    """A unit other than hz, s, ms and us."""

    code = "profile-unit"


class BadProfileRate(ProfileError):
    """A period that is not positive, too long, or shorter than the kernel's tick."""

    code = "profile-rate"


class NoTickPath(ProfileError):
    """The kernel has no tick function ksim knows, or it cannot be spliced."""

    code = "no-tick-path"


@dataclass(frozen=True)
class TickPath:
    """How one kind of kernel ticks, as names of its symbols (tried in order)."""

    #: runs once per tick on every cpu whose tick runs
    function: str
    #: a variable counting ticks (the clock is it times the tick's length); None:
    #: the KernelABI's nanosecond clock function
    ticks: str | None
    #: a variable holding the tick's length in ns, or that length
    tick_ns: str | int
    #: a per-cpu variable pointing to the interrupted context's pt_regs at the function
    regs: str | None
    #: symbols the kernel must have for this path to be its own
    requires: tuple[str, ...] = ()


TICK_PATHS = (
    # Linux: tick_sched_timer -> tick_sched_handle(ts, regs) -> update_process_times(
    # user_mode(regs)), and tick_periodic -> update_process_times(user_mode(get_irq_regs())).
    # regs is get_irq_regs(), the per-cpu __irq_regs that the interrupt entry set
    # (include/asm-generic/irq_regs.h).  tick_nsec is the tick's length in ns
    # (kernel/time/ntp.c: NSEC_PER_SEC / HZ, as NTP's frequency adjusts it).
    TickPath("update_process_times", None, "tick_nsec", "__irq_regs"),
    # The toy (images/toy/init/main.c op_tick): its workload calls do_timer(1), then
    # update_process_times, so jiffies counts exactly those ticks; it exports no tick
    # length, and its hardware timer (PIT, arm64 TIMER_HZ) runs at 1000 Hz, so a
    # jiffy is 1 ms.  The tick is called from the workload, not an interrupt: no regs.
    TickPath("update_process_times", toy.JIFFIES, 1_000_000, None, requires=(toy.IRQ_TICKS,)),
)


@dataclass(frozen=True)
class Sampler:
    """What ``sampler`` set up: splice ``if (guard) action`` at each point."""

    period_ns: int
    #: the Manager's points where the snippet is spliced
    points: list[Point]
    #: true exactly when this cpu's sample is due; advances the cpu's schedule, so
    #: evaluate it once per hit
    guard: ast.Node
    #: the interrupted context's pt_regs address at the points (None: not known)
    regs: ast.Node | None
    #: the kernel's tick length (1e9 / HZ)
    tick_ns: int = 0
    #: the heap block of the schedule: next[cpus], then now[cpus]
    table: int = 0
    cpus: int = 1
    function: str = ""

    @property
    def hz(self) -> int:
        """The kernel's tick rate, the highest sampling rate."""
        return round(NSEC_PER_SEC / self.tick_ns) if self.tick_ns else 0


@dataclass(frozen=True)
class Tick:
    """A kernel's tick path, resolved: where to splice, its clock, its rate."""

    path: TickPath
    point: Point
    tick_ns: int
    clock: ast.Node
    regs: ast.Node | None
    #: functions the clock calls (the Manager must allow them)
    calls: tuple[int, ...] = ()

    @property
    def hz(self) -> int:
        return round(NSEC_PER_SEC / self.tick_ns)


def period_ns(unit: str, value: int) -> int:
    """The period ``profile:UNIT:VALUE`` asks for, in ns (for hz, ``10**9 // N``, as
    ksim.trace.parser computes it)."""
    if unit not in UNITS:
        raise BadProfileUnit(f"profile:{unit}:{value}: unknown unit {unit!r}: "
                             "expecting hz, s, ms or us")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadProfileRate(f"profile:{unit}:{value}: the {'rate' if unit == 'hz' else 'period'} "
                             "must be a positive integer")
    if unit == "hz":
        if value > NSEC_PER_SEC:
            raise BadProfileRate(f"profile:hz:{value} is faster than one sample per nanosecond")
        return NSEC_PER_SEC // value
    period = value * UNITS[unit]
    if period > MAX_PERIOD_NS:
        raise BadProfileRate(f"profile:{unit}:{value}: a period longer than "
                             f"{MAX_PERIOD_NS // NSEC_PER_SEC} s is not supported")
    return period


def tick_of(manager: Manager) -> Tick:
    """The first of TICK_PATHS the kernel has all of (read: its tick's length)."""
    image, abi = manager.target.image, manager.target.abi
    tried = []
    for path in TICK_PATHS:
        names = [path.function, *path.requires]
        names += [n for n in (path.ticks, path.tick_ns) if isinstance(n, str)]
        missing = [n for n in names if image.find_symbol(n) is None]
        if path.ticks is None and abi.clock_ns is None:
            missing.append("a nanosecond clock function")
        if missing:
            tried.append(f"{path.function} ({', '.join(missing)} missing)")
            continue
        return _resolve(manager, path)
    raise NoTickPath("no tick function found to sample from: " + "; ".join(tried))


def _resolve(manager: Manager, path: TickPath) -> Tick:
    image, abi = manager.target.image, manager.target.abi
    if isinstance(path.tick_ns, int):
        tick_ns = path.tick_ns
    else:
        tick_ns = int.from_bytes(manager.copy_from_kernel(image.address_of(path.tick_ns), 8),
                                 "little")
        if not 0 < tick_ns <= NSEC_PER_SEC:
            raise NoTickPath(f"{path.tick_ns} reads {tick_ns}: not a tick's length in ns")
        # the nominal length (TICK_NSEC), whatever NTP made of it
        tick_ns = round(NSEC_PER_SEC / round(NSEC_PER_SEC / tick_ns))
    if path.ticks is None:
        assert abi.clock_ns is not None       # tick_of chose this path for it
        clock: ast.Node = ast.Call(abi.clock_ns, ())
        calls: tuple[int, ...] = (abi.clock_ns,)
    else:
        clock, calls = ast.Var(image.address_of(path.ticks), 8) * tick_ns, ()
    regs = None
    percpu = abi.cpu_number
    if path.regs is not None and percpu is not None and image.find_symbol(path.regs) is not None:
        # a per-cpu variable, addressed as the ABI addresses the cpu's number
        regs = ast.Var(image.address_of(path.regs), 8, segment=percpu.segment)
    try:
        point = manager.entry_point(path.function)
        why = manager.can_insert(point)
    except KsimError as exc:
        why = str(exc)
    if why is not None:
        raise NoTickPath(f"the tick function {path.function} cannot be spliced: {why}")
    return Tick(path, point, tick_ns, clock, regs, calls)


def due(table: int, cpus: int, period: int, clock: ast.Node) -> ast.Node:
    """The guard: 1 when this cpu's sample is due by ``clock``, which it reads once,
    moving the cpu's due time on (``table``: next[cpus], then now[cpus], zeroed)."""
    nxt = ast.Elem(table, cpus, ast.Cpu())
    now = ast.Elem(table + 8 * cpus, cpus, ast.Cpu())
    then = nxt + period
    return ast.seq(
        now.assign(clock),
        # the cpu's first tick starts its schedule; so does a clock that went back
        # more than a period (next is never further ahead otherwise): an emulated
        # kernel booted again under the same heap
        ast.if_(ast.lor(nxt == 0, ast.ult(now + period, nxt)),
                ast.seq(nxt.assign(now + period), 0),
                ast.if_(ast.ult(now, nxt),
                        0,
                        # one sample; a cpu a whole period behind starts again from now
                        ast.seq(nxt.assign(ast.if_(ast.ult(now, then), then, now + period)),
                                1))))


def sampler(manager: Manager, unit: str, value: int) -> Sampler:
    """Sample every cpu at ``profile:UNIT:VALUE``: checks everything, then allocates
    the schedule (one heap block; ``release`` frees it)."""
    period = period_ns(unit, value)
    tick = tick_of(manager)
    too_fast = value > tick.hz if unit == "hz" else period * tick.hz < NSEC_PER_SEC
    if too_fast:
        raise BadProfileRate(
            f"profile:{unit}:{value} asks for more than {tick.hz} samples a second per cpu: "
            f"samples are taken at the kernel's tick ({tick.path.function}), every "
            f"{tick.tick_ns / 1e6:g} ms (HZ={tick.hz})")
    cpus = max(1, int(manager.target.capabilities.nr_cpus))
    if tick.calls:
        manager.allow_calls(*tick.calls)
    table = manager.alloc_data(2 * 8 * cpus)
    return Sampler(period, [tick.point], due(table, cpus, period, tick.clock), tick.regs,
                   tick_ns=tick.tick_ns, table=table, cpus=cpus, function=tick.path.function)


def release(manager: Manager, sampler: Sampler) -> None:
    """Free what ``sampler`` allocated (splices at its points are the caller's)."""
    manager.free(sampler.table)
