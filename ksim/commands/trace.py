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
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, help_text
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
    add_json_flag(p)
    p.set_defaults(func=run)


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
    try:
        with open(args.file, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TraceError(f"cannot read {args.file}: {exc.strerror}") from None
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
    with Manager.attach(spec) as m:
        live = "while_cmd" in run_option_names(m.target)
        if while_cmd is not None and not live:
            # refused before anything is spliced, not by the run once it is
            raise UnknownRunOption(f"--while runs a command in a live kernel's guest; {spec} "
                                   "runs its own seeded workload (--seed, --iterations)")
        session = TraceSession(m, program, splice=splice, pid=pid, max_map_keys=max_map_keys)
        session.out = out
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
        report: dict[str, Any] = {
            "target": spec, "splice": splice,
            "probes": len(session.attached),
            "tactics": {},
            "maps": session.maps_json(),
            "lost": session.lost(),
            "lost_keys": session.lost_keys(),
            "printed": [data for kind, _, data in session.printed if kind == "value"],
            "printf": [data for kind, _, data in session.printed if kind == "printf"],
            "lost_events": session.lost_events(),
            "skipped": session.skipped,
            "exited": session.exited,
            "exit_code": session.exit_code,
            "interrupted": interrupted,
        }
    report["stats"] = {"probes": len(session.attached),
                       "attach_s": session.timings.get("attach_s", 0.0),
                       "detach_s": session.timings.get("detach_s", 0.0),
                       "end_to_end_s": time.perf_counter() - start}
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
