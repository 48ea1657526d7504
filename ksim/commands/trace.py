"""``ksim trace``: run a program in a subset of bpftrace's language (docs/trace.md).

    ksim trace -e 'kprobe:vfs_* { @[func] = count(); }'
    ksim trace examples/time_func.bt --seed 3

Each probe's action is compiled to a snippet and spliced at every point its
attach points name (all in one batch, jmp where safe and a trap otherwise with
the default policy); maps live in the kernel's data heap.  On the emulators the
kernel runs the same seeded workload as ``ksim count`` (same defaults, --seed,
--iterations), so counts can be compared.  BEGIN runs before the run, END after
it, then every map is printed as bpftrace's language prints it (--json: the same
data as JSON).  Ctrl-C stops the run; the maps are printed all the same (exit
status 130) and the kernel's text is restored, as after every trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, emit_json, help_text
from ksim.commands.count import _run_options, add_pid_arg, add_target_args, target_spec
from ksim.targets.base import HeldInterrupt, run_option_names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="run a program in a subset of bpftrace's language",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", metavar="FILE.bt", help="the program's file")
    p.add_argument("-e", dest="program", metavar="PROGRAM", help="the program's text")
    add_target_args(p)
    p.add_argument("--while", dest="while_cmd", metavar="CMD",
                   help="live targets: run CMD in the guest and stop when it ends (without it "
                        "a live trace runs until Ctrl-C or exit())")
    add_pid_arg(p)
    p.add_argument("--splice", choices=("jmp", "trap", "auto"), default="auto",
                   help="splicing policy (default: auto, the cheapest safe tactic)")
    add_json_flag(p)
    p.set_defaults(func=run)


def source_of(args: argparse.Namespace) -> tuple[str, str]:
    """(program text, the name errors give it)."""
    from ksim.trace.errors import TraceError

    if (args.program is None) == (args.file is None):
        raise TraceError("give the program with -e 'PROGRAM' or as FILE.bt (one of them)")
    if args.program is not None:
        return args.program, "stdin"
    try:
        with open(args.file, encoding="utf-8") as f:
            return f.read(), args.file
    except OSError as exc:
        raise TraceError(f"cannot read {args.file}: {exc.strerror}") from None


def trace(source: str, spec: str, *, filename: str = "stdin", splice: str = "auto",
          seed: int | None = None, iterations: int | None = None,
          on_attach: Any = None, out: Any = None, while_cmd: str | None = None,
          pid: int | None = None,
          run_options: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """Run the program ``source`` on target ``spec``; (the report, the text output).

    The report holds the maps (as JSON data), the lost updates per map, the points
    spliced, and whether exit() or Ctrl-C ended the run.  ``on_attach(session)`` is
    called once the probes are spliced, before the run (tests use it to add
    oracles); ``out(text)``, when given, is called with each piece of output as
    soon as it is printed (printf's events while the kernel runs, maps at the end);
    ``run_options`` go to the target's run as they are.  On a live kernel the
    program runs while ``while_cmd`` runs in the guest, or without one until
    Ctrl-C or exit().  With ``pid`` every kernel probe fires only in that process."""
    from ksim.kapi import Manager
    from ksim.trace.parser import parse
    from ksim.trace.session import Exited, TraceSession

    program = parse(source, filename)
    with Manager.attach(spec) as m:
        session = TraceSession(m, program, splice=splice, pid=pid)
        session.out = out
        session.attach()
        interrupted = False
        try:
            if on_attach is not None:
                on_attach(session)
            session.begin()
            live = "while_cmd" in run_option_names(m.target)
            if not session.exited and (session.attached or session.intervals):
                options = _run_options(m, seed, iterations, while_cmd) | (run_options or {})
                progress = session.progress()
                if progress is not None:
                    options["progress"] = progress
                try:
                    if live and "while_cmd" not in options:
                        _until_stopped(progress)
                    elif session.attached:
                        m.run(**options)
                except Exited:
                    pass
                except KeyboardInterrupt:
                    interrupted = True
            session.end()
        finally:
            with HeldInterrupt():  # a second Ctrl-C waits until the text is restored
                session.detach()
        report: dict[str, Any] = {
            "target": spec, "splice": splice,
            "probes": len(session.attached),
            "tactics": {},
            "maps": session.maps_json(),
            "lost": session.lost(),
            "printed": [data for kind, _, data in session.printed if kind == "value"],
            "printf": [data for kind, _, data in session.printed if kind == "printf"],
            "lost_events": session.lost_events(),
            "skipped": session.skipped,
            "exited": session.exited,
            "interrupted": interrupted,
        }
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


def run(args: argparse.Namespace) -> int:
    source, filename = source_of(args)
    attached: dict[str, Any] = {}

    def announce(session: Any) -> None:
        attached["tactics"] = session.tactics()
        if not args.json:
            n = session.probe_count()
            print(f"Attaching {n} probe{'s' if n != 1 else ''}...", flush=True)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    report, _ = trace(source, target_spec(args), filename=filename, splice=args.splice,
                      seed=args.seed, iterations=args.iterations, on_attach=announce,
                      while_cmd=args.while_cmd, pid=args.pid,
                      out=None if args.json else write)
    report["tactics"] = attached.get("tactics", {})
    if args.json:
        emit_json(report)
    else:
        for name, n in report["lost"].items():
            print(f"WARNING: {n} updates of {name} were lost: its table was full", file=sys.stderr)
        for name, why in report["skipped"].items():
            print(f"skipped {name}: {why}", file=sys.stderr)
    return 130 if report["interrupted"] else 0
