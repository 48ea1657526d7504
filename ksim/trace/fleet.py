"""One trace program on a fleet of targets, its maps merged (docs/trace.md, Fleets).

    ksim trace -e 'kprobe:vfs_read { @[comm] = count(); }' \\
        --target live://10.0.0.1:7070,live://10.0.0.2:7070

Each host gets a session of its own (a Manager, a TraceSession) in a thread of its
own: they connect, attach (each in its own batch), run and detach at once.  A host
that cannot be reached, refuses the program or goes away halfway is reported and
left out; the others go on.

What the fleet prints:

- printf's events (the kernel's, drained as they come) as each host prints them,
  each line prefixed ``[host] `` when the fleet has more than one host;
- BEGIN, interval and END actions run on every host over its own maps (clear(),
  delete() and exit() act on that host); what they print is merged, one action at a
  time: the k-th run of an interval probe on every host is one group, printed once
  every host still running delivered it.  A map they print (``print(@m)``, the maps
  at the end) is printed once, merged over the hosts; a line that is the same on
  every host is printed once (time()'s too: the client's clock), a line that
  differs is printed per host, prefixed.  The k-th run of an interval probe is due
  at one time on every host (the fleet's clock), so a group covers one window;
- exit() on any host ends the run on every host (the program asked to stop).

Merging (:func:`merge_value`): count and sum add, hist and lhist add bucket by
bucket, min and max keep the smaller and the larger, avg and stats add their sums
and their counts (the average is the total's, never an average of averages).  A
value a program assigns (``@m[k] = x``, a string, a name) is not an aggregate:
the merged map holds the last host's value, in the fleet's order.  Keys are
merged by what they print as (a function's name, a comm, an integer): each host's
names and addresses are its own kernel's.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from .maps import (
    MASK,
    SYMBOLIZE,
    USER_SYMBOLIZE,
    MapLayout,
    MapType,
    decode,
    decode_key,
    is_decoded,
    merge,
    signed,
)
from .output import MapPrinter
from .session import Exited, Interpreter, Output, TraceSession

#: decoding a key or an event names addresses through SYMBOLIZE and USER_SYMBOLIZE,
#: which are global: one host at a time decodes, with its own kernel's symbols and its
#: own machine's files
_DECODING = threading.Lock()


@contextmanager
def decoding(session: TraceSession) -> Iterator[None]:
    with _DECODING:
        SYMBOLIZE[:] = [session.symbol]
        USER_SYMBOLIZE[:] = [session.user_symbols.frame]
        yield


# --- hosts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """One target of a fleet: the label its output and metrics carry, its spec, and
    the token file of a live one (None: the default)."""

    label: str
    spec: str
    token_file: str | None = None


def label_of(spec: str) -> str:
    """``live://h:p`` is ``h:p``; any other target is its spec."""
    return spec[len("live://"):] if spec.startswith("live://") else spec


def hosts(specs: Sequence[tuple[str, str | None]]) -> list[Host]:
    """Hosts of (spec, token file) pairs; a label given twice gets ``#2``, ``#3``..."""
    out: list[Host] = []
    seen: dict[str, int] = {}
    for spec, token in specs:
        label = label_of(spec)
        n = seen[label] = seen.get(label, 0) + 1
        out.append(Host(label if n == 1 else f"{label}#{n}", spec, token))
    return out


def parse_targets(text: str) -> list[tuple[str, str | None]]:
    """``--target`` as a comma-separated list of target specs."""
    from .errors import TraceError

    specs = [s.strip() for s in text.split(",")]
    if any(not s for s in specs):
        raise TraceError(f"an empty target in the list {text!r}")
    return [(s, None) for s in specs]


#: bytes of a fleet file read at most (some 30,000 hosts; a file without an end,
#: /dev/zero, was read until a MemoryError)
MAX_FLEET_BYTES = 1 << 20


def read_fleet(path: str) -> list[tuple[str, str | None]]:
    """A fleet file: one host a line, ``ADDRESS [TOKEN_FILE]`` (an address without a
    scheme is ``live://ADDRESS``); blank lines and ``#`` comments are skipped."""
    from .errors import TraceError
    from .parser import TraceLimit

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO opens at once, writer or not
        os.set_blocking(fd, True)       # and reads as empty without one (its end)
        with open(fd, "rb") as f:
            raw = f.read(MAX_FLEET_BYTES + 1)
        if len(raw) > MAX_FLEET_BYTES:
            raise TraceLimit(f"the fleet file {path} is longer than {MAX_FLEET_BYTES:,} bytes")
        lines = raw.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the fleet file {path}: {exc}") from None
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(lines, 1):
        words = line.partition("#")[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise TraceError(f"{path}:{n}: expecting ADDRESS [TOKEN_FILE], not {line.strip()!r}")
        spec = words[0] if ":" in words[0] and (
            "://" in words[0] or not words[0].rpartition(":")[2].isdigit()) \
            else f"live://{words[0]}"
        out.append((spec, words[1] if len(words) == 2 else None))
    if not out:
        raise TraceError(f"the fleet file {path} names no host")
    return out


# --- maps, merged ----------------------------------------------------------------------------
#: a value: its words (aggregates, integers assigned), or the text a decoded value
#: prints as (a string, a name)
Value = list[int] | str


@dataclass
class MapSnapshot:
    """A map as one host (or a merge of hosts) holds it, keys by what they print as."""

    name: str
    kind: str | None
    #: the kinds of the key's parts (None: a map without keys)
    keys: tuple[str, ...] | None
    lhist: tuple[int, int, int] | None = None
    stats: bool = False
    entries: dict[tuple[Any, ...], Value] = field(default_factory=dict)

    @property
    def decoded(self) -> bool:
        return is_decoded(self.kind)


def snapshot(lay: MapLayout, entries: dict[tuple[int, ...], list[int]]) -> MapSnapshot:
    """``entries`` (Table.entries()) with keys and decoded values as they print (under
    :func:`decoding` when they name kernel addresses)."""
    ty = lay.type
    snap = MapSnapshot(ty.name, ty.kind, ty.keys, ty.lhist, ty.stats)
    for key, values in entries.items():
        parts = tuple(decode_key(ty.keys or (), key, lay.names)) if ty.keys else ()
        value: Value = str(decode(ty.kind or "int", values, lay.names)) \
            if is_decoded(ty.kind) else list(values)
        held = snap.entries.get(parts)
        snap.entries[parts] = value if held is None else merge_value(ty.kind, held, value)
    return snap


def merge_value(kind: str | None, a: Value, b: Value) -> Value:
    """Two values of one key merged: aggregates combined (maps.merge: count, sum, avg,
    stats, hist and lhist added word by word; min and max by their biased words), a
    value assigned (an integer, a string, a name) the later one's."""
    if isinstance(a, str) or isinstance(b, str) or kind in (None, "int") or is_decoded(kind):
        return b
    return merge(kind, a, b)


def merge_snapshots(snaps: Sequence[MapSnapshot]) -> MapSnapshot:
    """One map of the hosts' maps of one name (in the fleet's order)."""
    first = snaps[0]
    out = MapSnapshot(first.name, first.kind, first.keys, first.lhist, first.stats)
    for snap in snaps:
        for key, value in snap.entries.items():
            held = out.entries.get(key)
            out.entries[key] = value if held is None else merge_value(out.kind, held, value)
    return out


def _order(part: Any) -> tuple[int, Any]:
    return (0, part) if isinstance(part, int) else (1, str(part))


def printable(snap: MapSnapshot) -> tuple[MapLayout, dict[tuple[int, ...], list[int]]]:
    """A layout and entries MapPrinter prints ``snap`` from: every key part and
    decoded value a name (the layout's names, in order, so that equal values print
    in the order of their keys)."""
    texts = {p for key in snap.entries for p in key}
    names = [str(p) for p in sorted(texts, key=_order)]
    names += sorted({v for v in snap.entries.values() if isinstance(v, str)} - set(names))
    at = {n: i for i, n in enumerate(names)}
    kind = "ksym" if snap.decoded else snap.kind
    ty = MapType(snap.name, ("ksym",) * len(snap.keys) if snap.keys else None, kind,
                 snap.lhist, snap.stats)
    entries = {tuple(at[str(p)] for p in key): ([at[v]] if isinstance(v, str) else list(v))
               for key, v in snap.entries.items()}
    return MapLayout(ty, 0, names=names), entries


def map_output(snap: MapSnapshot, top: int = 0, div: int = 1) -> Output | None:
    """What print(@m, top, div) prints of ``snap`` (as TraceSession.print_map; None:
    an empty map, which is not printed)."""
    if snap.kind is None:
        return None
    lay, entries = printable(snap)
    printer = MapPrinter(lay)
    if top > 0:
        entries = dict(printer.sorted(entries)[-top:])
    if div > 1 and not printer.hist and snap.kind in ("int", "count", "sum"):
        entries = {k: [signed(w) // div & MASK for w in v] for k, v in entries.items()}
    text = printer.text(entries)
    if not text:
        return None
    return Output("hist" if printer.hist else "map", text + "\n", {snap.name: printer.json(entries)})


def maps_json(snaps: dict[str, MapSnapshot]) -> dict[str, Any]:
    """Maps as the JSON summary holds them (TraceSession.maps_json)."""
    out = {}
    for name in sorted(snaps):
        snap = snaps[name]
        if snap.kind is not None and snap.entries:
            lay, entries = printable(snap)
            out[name] = MapPrinter(lay).json(entries)
    return out


# --- one host's session ------------------------------------------------------------------------
@dataclass
class MapPrint:
    """A map a client-side action printed on one host: its snapshot, print()'s
    arguments, and what the host printed of it (None: empty there)."""

    snap: MapSnapshot
    top: int
    div: int
    out: Output | None


Item = Output | MapPrint


class FleetSession(TraceSession):
    """A TraceSession whose client-side actions' output goes to the fleet, one
    action at a time (``HostRun.deliver``), and whose events go to it as they come."""

    def __init__(self, manager: Any, program: Any, run: HostRun, **options: Any) -> None:
        super().__init__(manager, program, **options)
        self.host_run = run
        self._batch: list[Item] | None = None
        self._printing: list[Output] | None = None
        #: per interval probe, how many times it ran
        self._ticks = [0] * len(self.intervals)

    def emit(self, kind: str, text: str, data: Any) -> None:
        out = Output(kind, text, data)
        self.printed.append(out)
        if self._printing is not None:
            self._printing.append(out)
        elif self._batch is not None:
            self._batch.append(out)
        else:
            self.host_run.forward(out)

    def events(self) -> None:
        batch, self._batch = self._batch, None     # the kernel's events go as they come
        try:
            with decoding(self):
                super().events()
        finally:
            self._batch = batch

    def print_map(self, name: str, top: int = 0, div: int = 1) -> None:
        lay = self.layouts[name]
        if lay.type.kind is None:
            return
        self._printing = []
        try:
            with decoding(self):
                snap = snapshot(lay, self.table(name).entries())
                super().print_map(name, top, div)
        finally:
            outs, self._printing = self._printing, None
        item = MapPrint(snap, top, div, outs[0] if outs else None)
        if self._batch is not None:
            self._batch.append(item)
        elif item.out is not None:
            self.host_run.forward(item.out)

    def _action(self, tag: tuple[Any, ...], action: Callable[[], None]) -> None:
        self._batch = []
        try:
            action()
        finally:
            batch, self._batch = self._batch, None
            self.host_run.deliver(tag, batch)

    def begin(self) -> None:
        self._action(("BEGIN",), super().begin)

    def end(self) -> None:
        self._action(("END",), super().end)

    def run_intervals(self, now: int | None = None) -> None:
        """As TraceSession.run_intervals (once per call, however many periods went
        by), each run one action, by the fleet's clock: the k-th run of an interval
        probe on every host is due at one time, k periods after the first host
        started running, so that a group's maps cover one window on every host."""
        now = time.monotonic_ns() if now is None else now
        epoch = self.host_run.fleet.epoch(now)
        for i, (period, probe, name) in enumerate(self.intervals):
            k = (now - epoch) // period
            if k > self._ticks[i]:
                self._ticks[i] = k
                self._action(("interval", i, k), functools.partial(self._interval, probe, name))

    def _interval(self, probe: Any, name: str) -> None:
        from .errors import TraceError

        try:
            Interpreter(self, name).run(probe)
        except TraceError as exc:
            raise exc.located(self.program.source, self.program.filename) from None

    def snapshots(self) -> dict[str, MapSnapshot]:
        """Every map as it is now (for the summary and for Prometheus)."""
        out = {}
        with decoding(self):
            for name, lay in sorted(self.layouts.items()):
                if lay.type.kind is not None:
                    out[name] = snapshot(lay, self.table(name).entries())
        return out


# --- the fleet ---------------------------------------------------------------------------------
@dataclass
class Options:
    """What every host's session is given (as ``ksim.commands.trace.trace`` takes it)."""

    splice: str = "auto"
    seed: int | None = None
    iterations: int | None = None
    while_cmd: str | None = None
    pid: int | None = None
    max_map_keys: int | None = None
    params: tuple[str, ...] = ()
    #: seconds between two snapshots of a running host's maps (for Prometheus)
    refresh: float = 1.0
    #: seconds a live host without --while sleeps between two drains
    period: float = 0.2


class HostRun:
    """One host's session, run in a thread of its own."""

    def __init__(self, fleet: Fleet, host: Host) -> None:
        self.fleet = fleet
        self.host = host
        self.label = host.label
        #: connecting, attached, done, failed
        self.state = "connecting"
        self.error: BaseException | None = None
        #: where it failed: connect, attach, run, end
        self.stage = "connect"
        self.report: dict[str, Any] | None = None
        self.final: dict[str, MapSnapshot] = {}
        #: the action groups this host delivered; per interval probe, its last run
        self.delivered: set[tuple[Any, ...]] = set()
        self.ticks: dict[int, int] = {}
        self.thread = threading.Thread(target=self.main, name=f"ksim-fleet-{host.label}",
                                       daemon=True)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed") or ("END",) in self.delivered

    def forward(self, out: Output) -> None:
        self.fleet.sink.output(self.fleet.prefix(self), out)

    def deliver(self, tag: tuple[Any, ...], items: list[Item]) -> None:
        self.delivered.add(tag)
        if tag[0] == "interval":
            self.ticks[tag[1]] = tag[2]
        self.fleet.merger.deliver(self, tag, items)

    def past(self, tag: tuple[Any, ...]) -> bool:
        """Whether this host will not deliver ``tag`` (it ended, or ran the interval
        probe of a later window: it started after that window)."""
        if tag == ("END",):
            return self.state in ("done", "failed")
        if self.finished:
            return True
        return tag[0] == "interval" and self.ticks.get(tag[1], 0) > tag[2]

    def main(self) -> None:
        try:
            self._traced()
            self.state = "done"
        except Exception as exc:  # a host's failure is reported; the others go on
            self.error = exc
            self.state = "failed"
            if self.fleet.exporter is not None:     # its maps are no longer known
                self.fleet.exporter.forget(self.label)
            self.fleet.sink.host_failed(self, exc)
        finally:
            self.fleet.merger.flush()

    def _traced(self) -> None:
        from ksim.commands.count import _run_options
        from ksim.errors import UnknownRunOption
        from ksim.kapi import Manager
        from ksim.targets.base import run_option_names

        fleet, opts = self.fleet, self.fleet.options
        start = time.perf_counter()
        options = {"token_file": self.host.token_file} if self.host.token_file else {}
        with Manager.attach(self.host.spec, **options) as m:
            live = "while_cmd" in run_option_names(m.target)
            if opts.while_cmd is not None and not live:
                raise UnknownRunOption(f"--while runs a command in a live kernel's guest; "
                                       f"{self.host.spec} runs its own seeded workload")
            self.stage = "attach"
            session = FleetSession(m, fleet.program, self, splice=opts.splice, pid=opts.pid,
                                   max_map_keys=opts.max_map_keys)
            session.attach()
            tactics = session.tactics()
            self.state = "attached"
            fleet.sink.attached(self, session)
            interrupted = False
            try:
                self.stage = "run"
                session.begin()
                if not session.exited and not fleet.stop.is_set():
                    interrupted = self._run(m, session, live, _run_options(
                        m, opts.seed, opts.iterations, opts.while_cmd))
                session.detach()
                self.stage = "end"
                session.end()
                self.final = session.snapshots()
                fleet.publish(self, self.final)
            finally:
                if session.handles:
                    session.detach()
            self.report = session.report(self.host.spec, opts.splice, tactics, interrupted, start)

    def _run(self, m: Any, session: FleetSession, live: bool, options: dict[str, Any]) -> bool:
        """Run until the workload or the --while command ends, exit() or the fleet
        stops (Ctrl-C, another host's exit()); True when the fleet was stopped."""
        fleet, progress = self.fleet, session.progress()
        last = [0.0]

        def check() -> None:
            if progress is not None:
                progress()
            if time.monotonic() - last[0] >= fleet.options.refresh:
                last[0] = time.monotonic()
                if fleet.exporter is not None:
                    fleet.publish(self, session.snapshots())
                else:
                    self._heartbeat(session)
            if fleet.stop.is_set():
                raise Exited()

        try:
            if live and "while_cmd" not in options:
                while True:
                    check()
                    time.sleep(fleet.options.period)
            else:
                m.run(**options, progress=check)
        except Exited:
            fleet.stop.set()        # exit() here, or the fleet stopped: every host stops
        return fleet.interrupted


    @staticmethod
    def _heartbeat(session: FleetSession) -> None:
        """One word of a map read: a live host that went away is found while the
        others run (a program that prints or has intervals talks to it anyway)."""
        for lay in session.layouts.values():
            session.m.target.read(lay.base, 8)
            return


class Merger:
    """Groups the hosts' client-side actions (BEGIN, the k-th run of an interval
    probe, END) and prints each group once every host still running delivered it,
    in the order the groups first came."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.lock = threading.RLock()
        self.pending: dict[tuple[Any, ...], dict[str, list[Item]]] = {}

    def deliver(self, run: HostRun, tag: tuple[Any, ...], items: list[Item]) -> None:
        with self.lock:
            self.pending.setdefault(tag, {})[run.label] = items
        self.flush()

    def flush(self) -> None:
        with self.lock:
            # END last: a host that ended early delivers it before the others' intervals
            for tag in sorted(self.pending, key=lambda tag: tag == ("END",)):
                got = self.pending[tag]
                waiting = [r for r in self.fleet.runs if r.label not in got and not r.past(tag)]
                if waiting:
                    return
                del self.pending[tag]
                self.fleet.print_group([(r, got[r.label]) for r in self.fleet.runs
                                        if r.label in got])


class Sink(Protocol):
    """Where a fleet's output goes (the command's printer; a test's list)."""

    def output(self, host: str | None, out: Output) -> None:
        """``out`` as one host printed it (``host``: its label) or merged (None)."""

    def attached(self, run: HostRun, session: TraceSession) -> None:
        """A host's probes are spliced."""

    def host_failed(self, run: HostRun, exc: BaseException) -> None:
        """A host could not be reached, refused the program or went away."""


class Quiet:
    """A Sink that prints nothing (the results are in the FleetResult)."""

    def output(self, host: str | None, out: Output) -> None:
        pass

    def attached(self, run: HostRun, session: TraceSession) -> None:
        pass

    def host_failed(self, run: HostRun, exc: BaseException) -> None:
        pass


class Fleet:
    """A program on every host at once (module doc)."""

    def __init__(self, source: str, hosts: Sequence[Host], *, filename: str = "stdin",
                 options: Options | None = None, sink: Sink | None = None,
                 by_host: bool = False, exporter: Any = None) -> None:
        from .parser import parse

        self.options = options or Options()
        self.program = parse(source, filename, tuple(self.options.params))
        self.runs = [HostRun(self, h) for h in hosts]
        self.sink: Sink = sink or Quiet()
        self.by_host = by_host
        #: a Prometheus exporter (ksim.trace.prometheus) the hosts' maps are published to
        self.exporter = exporter
        self.merger = Merger(self)
        self.stop = threading.Event()
        self.interrupted = False
        self._epoch: int | None = None
        self._epoch_lock = threading.Lock()

    @property
    def single(self) -> bool:
        return len(self.runs) == 1

    def prefix(self, run: HostRun) -> str | None:
        return None if self.single else run.label

    def epoch(self, now: int) -> int:
        """When the first host started running (monotonic ns): interval probes' runs
        are due every period after it."""
        with self._epoch_lock:
            if self._epoch is None:
                self._epoch = now
            return self._epoch

    def publish(self, run: HostRun, snaps: dict[str, MapSnapshot]) -> None:
        if self.exporter is not None:
            self.exporter.publish(run.label, snaps)

    def run(self) -> FleetResult:
        """Run on every host; Ctrl-C (in the main thread) stops every host's run, and
        each detaches and runs END as one host's trace does."""
        from ksim.core import HeldInterrupt

        for r in self.runs:
            r.thread.start()
        with HeldInterrupt() as held:
            while any(r.thread.is_alive() for r in self.runs):
                if held.pending:
                    # the first Ctrl-C stops every host's run; a later one waits, as one
                    # host's trace holds it, until every host's text is restored
                    held.pending = False
                    self.interrupted = True
                    self.stop.set()
                for r in self.runs:
                    r.thread.join(0.1)
        self.merger.flush()
        return FleetResult(self)

    # --- printing a group --------------------------------------------------------------
    def print_group(self, got: list[tuple[HostRun, list[Item]]]) -> None:
        """One client-side action's output of every host (module doc)."""
        sink = self.sink
        if self.single:
            for _, items in got:
                for item in items:
                    out = item.out if isinstance(item, MapPrint) else item
                    if out is not None:
                        sink.output(None, out)
            return
        if not got:
            return
        maps: list[dict[tuple[str, int], MapPrint]] = []
        lines: list[list[Output]] = []
        for _, items in got:
            seen: dict[str, int] = {}
            m: dict[tuple[str, int], MapPrint] = {}
            ls: list[Output] = []
            for item in items:
                if isinstance(item, MapPrint):
                    n = seen[item.snap.name] = seen.get(item.snap.name, 0) + 1
                    m[(item.snap.name, n)] = item
                else:
                    ls.append(item)
            maps.append(m)
            lines.append(ls)
        done_maps: set[tuple[str, int]] = set()
        at = 0
        seen_first: dict[str, int] = {}
        for item in got[0][1]:
            if isinstance(item, MapPrint):
                n = seen_first[item.snap.name] = seen_first.get(item.snap.name, 0) + 1
                self._print_map(got, maps, (item.snap.name, n))
                done_maps.add((item.snap.name, n))
            else:
                self._print_line(got, lines, at)
                at += 1
        for i, (run, _) in enumerate(got):
            for out in lines[i][at:]:
                sink.output(run.label, out)
            for key in maps[i]:
                if key not in done_maps:
                    self._print_map(got, maps, key)
                    done_maps.add(key)

    def _print_line(self, got: list[tuple[HostRun, list[Item]]], lines: list[list[Output]],
                    at: int) -> None:
        mine = [ls[at] if at < len(ls) else None for ls in lines]
        first = mine[0]
        # time() prints the client's clock (one clock for every host): once
        if first is not None and all(o is not None and (
                o.text == first.text or o.kind == first.kind == "time") for o in mine):
            self.sink.output(None, first)
            return
        for (run, _), out in zip(got, mine, strict=True):
            if out is not None:
                self.sink.output(run.label, out)

    def _print_map(self, got: list[tuple[HostRun, list[Item]]],
                   maps: list[dict[tuple[str, int], MapPrint]], key: tuple[str, int]) -> None:
        prints = [(run, m[key]) for (run, _), m in zip(got, maps, strict=True) if key in m]
        if self.by_host:
            for run, p in prints:
                if p.out is not None:
                    self.sink.output(run.label, p.out)
            return
        first = prints[0][1]
        out = map_output(merge_snapshots([p.snap for _, p in prints]), first.top, first.div)
        if out is not None:
            self.sink.output(None, out)


class FleetResult:
    """What a fleet's run gave: every host's report or failure, and the merged maps."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.runs = fleet.runs
        self.ok = [r for r in self.runs if r.state == "done"]
        self.failed = [r for r in self.runs if r.state != "done"]
        names = sorted({n for r in self.ok for n in r.final})
        self.maps = {n: merge_snapshots([r.final[n] for r in self.ok if n in r.final])
                     for n in names}

    def failure(self, run: HostRun) -> dict[str, Any]:
        from ksim.errors import KsimError

        exc = run.error
        code = exc.code if isinstance(exc, KsimError) else type(exc).__name__
        return {"host": run.label, "target": run.host.spec, "stage": run.stage,
                "error": code, "message": str(exc)}

    def summary(self) -> dict[str, Any]:
        """The JSON summary: the merged maps, each host's report, the failures."""
        return {
            "hosts": {r.label: r.report for r in self.ok},
            "maps": maps_json(self.maps),
            "failed": [self.failure(r) for r in self.failed],
            "interrupted": self.fleet.interrupted,
        }

    @property
    def status(self) -> int:
        """1 when some host failed, 2 when every one did; else as one host's trace
        (130 after Ctrl-C, else the status exit() gave)."""
        if self.failed:
            return 2 if not self.ok else 1
        if self.fleet.interrupted:
            return 130
        return max((r.report or {}).get("exit_code", 0) for r in self.ok)


__all__ = ["MAX_FLEET_BYTES", "Fleet", "FleetResult", "FleetSession", "Host", "MapSnapshot",
           "Options", "Sink", "hosts", "label_of", "map_output", "maps_json", "merge_snapshots",
           "merge_value", "parse_targets", "printable", "read_fleet", "snapshot"]
