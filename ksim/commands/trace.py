"""``ksim trace``: run a program in a subset of bpftrace's language (docs/trace.md).

    ksim trace -e 'kprobe:vfs_* { @[func] = count(); }'
    ksim trace examples/time_func.bt --seed 3

Each probe's action is compiled to a snippet and spliced at every point its
attach points name (all in one batch, jmp where safe and a trap otherwise with
the default policy); maps live in the kernel's data heap.  On the emulators the
kernel runs the same seeded workload as ``ksim count`` (same defaults, --seed,
--iterations), so counts can be compared.  BEGIN runs before the run, END after
it, then every map is printed as bpftrace's language prints it (--json: the same
data as JSON lines).  Ctrl-C stops the run; the maps are printed all the same (exit
status 130) and the kernel's text is restored, as after every trace.

Fleets (docs/trace.md): --target with a comma-separated list of targets, or
--fleet FILE (one ADDRESS [TOKEN_FILE] a line), runs the program on every host at
once and prints the maps merged (--by-host: each host's); printf's lines are
prefixed with the host; a host that fails is reported and the others go on (exit
status 1).  --prometheus HOST:PORT serves the maps as Prometheus metrics while the
trace runs (one target or many).

--json writes one JSON record per line, in the order things happen, as bpftrace's
``-f json`` does (attached_probes, printf, time, value, map, hist, lost_events),
then ksim's own: lost_keys (a map that had no room for a key), summary (maps,
lost updates, points spliced, tactics, skipped attach points, how the run ended)
and last stats (probes, attach_s, detach_s, end_to_end_s: seconds measured in
this process).  --stats prints the stats line on stderr without --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, help_text, kept_for_the_command
from ksim.commands.count import _run_options, add_pid_arg, add_target_args, target_spec
from ksim.core import HeldInterrupt
from ksim.targets.base import run_option_names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="run a program in a subset of bpftrace's language",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", metavar="FILE.bt", help="the program's file")
    p.add_argument("params", nargs="*", metavar="ARG",
                   help="the program's positional parameters, $1, $2, ... ($# is how many)")
    p.add_argument("-e", dest="program", metavar="PROGRAM", help="the program's text")
    add_target_args(p)
    p.add_argument("--while", dest="while_cmd", metavar="CMD",
                   help="live targets: run CMD in the guest and stop when it ends (without it "
                        "a live trace runs until Ctrl-C or exit())")
    add_pid_arg(p)
    p.add_argument("--splice", choices=("jmp", "trap", "auto"), default="auto",
                   help="splicing policy (default: auto, the cheapest safe tactic)")
    p.add_argument("--max-map-keys", type=_max_map_keys, metavar="N",
                   help="keys a map whose keys are computed holds (bpftrace's max_map_keys; "
                        "over the program's config block; default 4096)")
    p.add_argument("--stats", action="store_true",
                   help="print how long attaching, detaching and the whole run took (stderr)")
    p.add_argument("--fleet", metavar="FILE",
                   help="run on every host FILE names (one ADDRESS [TOKEN_FILE] a line), "
                        "as --target A,B,... does")
    p.add_argument("--by-host", action="store_true",
                   help="a fleet prints each host's maps (prefixed with the host), not the "
                        "merged ones")
    p.add_argument("--prometheus", metavar="HOST:PORT", type=_prometheus_address,
                   help="serve the maps as Prometheus metrics at http://HOST:PORT/metrics "
                        "while the trace runs")
    add_json_flag(p)
    p.set_defaults(func=run)


def _prometheus_address(text: str) -> str:
    from ksim.trace.prometheus import parse_address

    return parse_address(text)


def _max_map_keys(text: str) -> int:
    from ksim.trace.maps import MAX_MAP_KEYS

    try:
        n = int(text, 0)
    except ValueError:
        n = 0
    if not 0 < n <= MAX_MAP_KEYS:
        raise argparse.ArgumentTypeError(f"expecting an integer from 1 to {MAX_MAP_KEYS}, "
                                         f"not {text!r}")
    return n


#: bytes of a program file ksim trace reads (bpftrace's own tools are under 10 KB; a
#: file without an end, /dev/zero, was read until a MemoryError)
MAX_PROGRAM_BYTES = 1 << 20


def source_of(args: argparse.Namespace) -> tuple[str, str]:
    """(program text, the name errors give it)."""
    from ksim.trace.errors import TraceError

    if args.program is not None and args.file is not None:
        # -e 'PROGRAM' ARG...: the first positional is a parameter, not a file
        args.params = [args.file, *args.params]
        args.file = None
    if (args.program is None) == (args.file is None):
        raise TraceError("give the program with -e 'PROGRAM' or as FILE.bt (one of them)")
    for what, text in (("the program", args.program), *(
            (f"parameter ${i}", p) for i, p in enumerate(args.params or (), 1))):
        # a command line's bytes that are not UTF-8 come as lone surrogates
        if text is not None and not _is_utf8(text):
            raise TraceError(f"{what} is not UTF-8 text")
    if args.program is not None:
        return args.program, "stdin"
    from ksim.trace.parser import TraceLimit

    try:
        fd = os.open(args.file, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, writer or not
        os.set_blocking(fd, True)       # and reads as empty without one (its end)
        with open(fd, "rb") as f:
            raw = f.read(MAX_PROGRAM_BYTES + 1)
    except OSError as exc:
        raise TraceError(f"cannot read {args.file}: {exc.strerror}") from None
    if len(raw) > MAX_PROGRAM_BYTES:
        raise TraceLimit(f"the program file is longer than {MAX_PROGRAM_BYTES:,} bytes "
                         "(it is read whole before it is parsed)").located("", args.file)
    try:
        return raw.decode("utf-8"), args.file
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise TraceError(f"not UTF-8 text (byte {exc.start}, line {line}: "
                         f"{raw[exc.start:exc.start + 1]!r})").located("", args.file) from None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def trace(source: str, spec: str, *, filename: str = "stdin", splice: str = "auto",
          seed: int | None = None, iterations: int | None = None,
          on_attach: Any = None, out: Any = None, while_cmd: str | None = None,
          pid: int | None = None, max_map_keys: int | None = None,
          run_options: dict[str, Any] | None = None,
          params: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """Run the program ``source`` on target ``spec``; (the report, the text output).

    The report holds the maps (as JSON data), the lost updates per map, the points
    spliced, whether exit() or Ctrl-C ended the run, and ``stats`` (seconds spent
    attaching and detaching, and on the whole call).  ``on_attach(session)`` is
    called once the probes are spliced, before the run (tests use it to add
    oracles); ``out(output)``, when given, is called with each Output as soon as it
    is printed (printf's events while the kernel runs, maps at the end);
    ``run_options`` go to the target's run as they are.  The program runs over the
    emulators' seeded workload; on a live kernel while ``while_cmd`` runs in the
    guest, or without one until Ctrl-C or exit() -- a program of BEGIN and END
    alone too, as in bpftrace.  With ``pid`` every kernel probe fires only in that
    process; ``max_map_keys`` overrides the program's config."""
    from ksim.errors import UnknownRunOption
    from ksim.kapi import Manager
    from ksim.trace.parser import parse
    from ksim.trace.session import Exited, TraceSession

    start = time.perf_counter()
    program = parse(source, filename, tuple(params))
    with Manager.attach(spec) as m, kept_for_the_command() as keep:
        live = "while_cmd" in run_option_names(m.target)
        if while_cmd is not None and not live:
            # refused before anything is spliced, not by the run once it is
            raise UnknownRunOption(f"--while runs a command in a live kernel's guest; {spec} "
                                   "runs its own seeded workload (--seed, --iterations)")
        session = TraceSession(m, program, splice=splice, pid=pid, max_map_keys=max_map_keys)
        session.out = out
        with keep():
            session.attach()
        interrupted = False
        try:
            if on_attach is not None:
                on_attach(session)
            session.begin()
            # a program of BEGIN and END alone runs too (the workload, the --while
            # command, or until Ctrl-C), as bpftrace runs it until Ctrl-C
            if not session.exited:
                options = _run_options(m, seed, iterations, while_cmd) | (run_options or {})
                progress = session.progress()
                if progress is not None:
                    options["progress"] = progress
                try:
                    if live and "while_cmd" not in options:
                        _until_stopped(progress)
                    else:
                        m.run(**options)
                except Exited:
                    pass
                except KeyboardInterrupt:
                    interrupted = True
            # as bpftrace: the probes are gone before END runs and the maps print
            with HeldInterrupt():  # a second Ctrl-C waits until the text is restored
                session.detach()
            session.end()
        finally:
            if session.handles:
                with HeldInterrupt():
                    session.detach()
        report = session.report(spec, splice, {}, interrupted, start)
    return report, session.output()


def _until_stopped(progress: Any, period: float = 0.2) -> None:
    """A live kernel runs on its own: wait for Ctrl-C (KeyboardInterrupt, raised
    between two calls of ``progress``, never halfway through one of its requests) or
    exit() (Exited, raised by ``progress``), draining events meanwhile."""
    with HeldInterrupt() as held:
        while not held.pending:
            if progress is not None:
                progress()
            time.sleep(period)


def _fleet_wanted(args: argparse.Namespace) -> bool:
    """Whether the command runs as a fleet: many targets, a fleet file, or a
    Prometheus endpoint (served by the fleet's machinery, for one target too)."""
    return bool(getattr(args, "fleet", None) or "," in (args.target or "")
                or getattr(args, "prometheus", None))


def _json_line(value: Any) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def _traced(args: argparse.Namespace, source: str, filename: str, announce: Any,
            write: Any) -> dict[str, Any]:
    """The report of tracing ``source``; a RecursionError (a tree deeper than the
    passes that walk it can go: the parser bounds nesting, so this is a last resort)
    is a TraceLimit, after the session restored the text on its way out."""
    from ksim.trace.parser import TraceLimit

    try:
        report, _ = trace(source, target_spec(args), filename=filename, splice=args.splice,
                          seed=args.seed, iterations=args.iterations, on_attach=announce,
                          while_cmd=args.while_cmd, pid=args.pid, max_map_keys=args.max_map_keys,
                          out=write, params=tuple(args.params or ()))
    except RecursionError:
        raise TraceLimit("the program is nested too deeply to compile").located(
            source, filename) from None
    return report


def run(args: argparse.Namespace) -> int:
    from ksim.errors import KsimError
    from ksim.trace.output import record

    attached: dict[str, Any] = {}

    def announce(session: Any) -> None:
        attached["tactics"] = session.tactics()
        n = session.probe_count()
        if args.json:
            _json_line({"type": "attached_probes", "data": {"probes": n}})
        else:
            print(f"Attaching {n} probe{'s' if n != 1 else ''}...", flush=True)

    def write(out: Any) -> None:
        if args.json:
            _json_line(record(out.kind, out.data))
            return
        # warnings (a map without room for a key) go where bpftrace's warnings go
        stream = sys.stderr if out.kind == "lost_keys" else sys.stdout
        stream.write(out.text)
        stream.flush()

    if _fleet_wanted(args):
        return _run_fleet(args)
    try:
        source, filename = source_of(args)
        report = _traced(args, source, filename, announce, write)
    except KsimError as exc:
        if not args.json:
            raise
        # one line, like every other record: a reader of JSON lines sees the error
        _json_line({"type": "error", "error": exc.code, "message": str(exc)})
        return 2
    report["tactics"] = attached.get("tactics", {})
    stats = report.pop("stats")
    if args.json:
        _json_line({"type": "summary", "data": report})
        _json_line({"type": "stats", **stats})
    else:
        for name, why in report["skipped"].items():
            print(f"skipped {name}: {why}", file=sys.stderr)
        if args.stats:
            print("stats: " + " ".join(f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in stats.items()), file=sys.stderr)
    return 130 if report["interrupted"] else report.get("exit_code", 0)


class _FleetPrinter:
    """A fleet's output on stdout (JSON lines with --json), a host's lines prefixed
    ``[host] `` (a ``host`` field in JSON), failures on stderr."""

    def __init__(self, args: argparse.Namespace) -> None:
        import threading

        self.json = bool(args.json)
        self.lock = threading.Lock()
        #: per host, whether its text so far ends a line (a prefix goes before the next)
        self.at_line: dict[str, bool] = {}

    def output(self, host: str | None, out: Any) -> None:
        from ksim.trace.output import record

        with self.lock:
            if self.json:
                rec = record(out.kind, out.data)
                _json_line(rec if host is None else {**rec, "host": host})
                return
            stream = sys.stderr if out.kind == "lost_keys" else sys.stdout
            text = out.text
            if host is not None:
                lines = text.splitlines(keepends=True)
                start = self.at_line.get(host, True)
                text = "".join((f"[{host}] " if (i or start) and line != "\n" else "") + line
                               for i, line in enumerate(lines))
                if lines:
                    self.at_line[host] = lines[-1].endswith("\n")
            stream.write(text)
            stream.flush()

    def attached(self, run: Any, session: Any) -> None:
        n = session.probe_count()
        with self.lock:
            if self.json:
                rec: dict[str, Any] = {"type": "attached_probes", "data": {"probes": n}}
                _json_line(rec if run.fleet.single else {**rec, "host": run.label})
            else:
                head = "" if run.fleet.single else f"[{run.label}] "
                print(f"{head}Attaching {n} probe{'s' if n != 1 else ''}...", flush=True)

    def host_failed(self, run: Any, exc: BaseException) -> None:
        from ksim.errors import KsimError

        code = exc.code if isinstance(exc, KsimError) else type(exc).__name__
        with self.lock:
            if self.json:
                _json_line({"type": "host_error", "host": run.label, "target": run.host.spec,
                            "stage": run.stage, "error": code, "message": str(exc)})
            print(f"ksim: host {run.label} failed ({run.stage}): {str(exc).strip()}", file=sys.stderr,
                  flush=True)


def _fleet_hosts(args: argparse.Namespace) -> list[Any]:
    from ksim.trace.errors import TraceError
    from ksim.trace.fleet import hosts, parse_targets, read_fleet

    if args.fleet:
        if "," in (args.target or "") or args.target != "unicorn":
            raise TraceError("give the hosts with --fleet FILE or --target A,B,... (one of them)")
        return hosts(read_fleet(args.fleet))
    specs = parse_targets(args.target)
    return hosts([(s if "://" in s or ":" in s else f"{s}:{args.image}", t) for s, t in specs])


def _run_fleet(args: argparse.Namespace) -> int:
    """The program on every host of the fleet (ksim.trace.fleet), maps merged; with
    --prometheus, served as metrics while it runs."""
    from ksim.errors import KsimError
    from ksim.trace.fleet import Fleet, Options

    printer = _FleetPrinter(args)
    exporter = None
    try:
        source, filename = source_of(args)
        fleet_hosts = _fleet_hosts(args)
        options = Options(splice=args.splice, seed=args.seed, iterations=args.iterations,
                          while_cmd=args.while_cmd, pid=args.pid,
                          max_map_keys=args.max_map_keys, params=tuple(args.params or ()))
        fleet = Fleet(source, fleet_hosts, filename=filename, options=options, sink=printer,
                      by_host=args.by_host)
        if args.prometheus:
            from ksim.trace.prometheus import Exporter

            try:
                exporter = Exporter(args.prometheus)
            except OSError as exc:
                from ksim.trace.errors import TraceError

                raise TraceError(f"cannot serve Prometheus metrics at {args.prometheus}: "
                                 f"{exc.strerror or exc}") from None
            fleet.exporter = exporter
            print(f"serving Prometheus metrics at {exporter.url}", file=sys.stderr, flush=True)
        result = fleet.run()
    except KsimError as exc:
        if not args.json:
            raise
        _json_line({"type": "error", "error": exc.code, "message": str(exc)})
        return 2
    finally:
        if exporter is not None:
            exporter.close()
    if fleet.single and result.ok:
        report = dict(result.ok[0].report or {})
        stats = report.pop("stats")
    else:
        report, stats = result.summary(), {
            r.label: (r.report or {}).get("stats") for r in result.ok}
    if args.json:
        _json_line({"type": "summary", "data": report})
        _json_line({"type": "stats", **(stats if fleet.single else {"hosts": stats})})
    else:
        for r in result.ok:
            for name, why in (r.report or {}).get("skipped", {}).items():
                head = "" if fleet.single else f"[{r.label}] "
                print(f"{head}skipped {name}: {why}", file=sys.stderr)
        if result.failed:
            print(f"ksim: {len(result.failed)} of {len(result.runs)} host"
                  f"{'s' if len(result.runs) != 1 else ''} failed: "
                  + ", ".join(r.label for r in result.failed), file=sys.stderr)
        if args.stats:
            for r in result.ok:
                head = "" if fleet.single else f"[{r.label}] "
                st = (r.report or {}).get("stats", {})
                print(head + "stats: " + " ".join(
                    f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in st.items()), file=sys.stderr)
    return result.status
