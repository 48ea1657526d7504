"""``ksim bench NAME``: jmp-versus-trap benchmarks (see benchmarks/README.md)."""

from __future__ import annotations

import argparse
import os
import sys

from ksim.cli import emit_json
from ksim.errors import OutputFileError

NAMES = ("per-hit", "sizes", "offset", "coverage", "census", "batch", "analysis", "cli", "verify",
         "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark (jmp versus trap splicing, coverage, analysis time)",
        description="Run a benchmark: a progress bar on stderr, a table on stdout (--json: the results "
        "document instead), and optionally the document in a file (--output) and a PNG plot.  'all' runs every benchmark; with "
        "--plot FILE.png it writes FILE-NAME.png per benchmark.")
    p.add_argument("name", choices=NAMES, metavar="NAME", help=" | ".join(NAMES))
    p.add_argument("--quick", action="store_true", help="smaller sizes (all of them in a few minutes)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: tiny sizes
    p.add_argument("--json", action="store_true",
                   help="print only the results document (JSON) on stdout, not the tables")
    p.add_argument("--output", "-o", metavar="FILE",
                   help="also write the results document to FILE (after each benchmark, so a "
                        "long run keeps what it measured)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (matplotlib, Agg)")
    p.add_argument("--arch", choices=("x86_64", "arm64"), default="x86_64",
                   help="the live testbed per-hit and batch run on (arm64: `ksim testbed up "
                        "--arch arm64 --with bpftrace`, only its live parts run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def check_output(flag: str, path: str) -> None:
    """OutputFileError unless ``path`` can be written: not a directory, in a directory
    that exists and can be written (checked before a benchmark runs, so that a long
    run does not end in a traceback with its results lost)."""
    where = os.path.dirname(path) or "."
    if not path or os.path.isdir(path):
        raise OutputFileError(f"{flag} {path!r}: a directory, not a file to write")
    if not os.path.isdir(where):
        raise OutputFileError(f"{flag} {path!r}: no directory {where!r} to write it in")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputFileError(f"{flag} {path!r}: the directory {where!r} cannot be written")


def run(args: argparse.Namespace) -> int:
    from ksim.bench import runner
    from ksim.bench.common import Context

    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        if path is not None:
            check_output(flag, path)

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    ctx = Context(mode=mode, progress=not args.no_progress, arch=args.arch)
    if args.name == "verify":  # ksim verify's engines (ksim/bench/verify.py), not part of "all"
        from ksim.bench import verify

        doc = verify.document(ctx, out=None if args.json else sys.stdout, json_path=args.output,
                              plot_path=args.plot)
    else:
        doc = runner.run(runner.names_for(args.name), ctx, out=None if args.json else sys.stdout,
                         json_path=args.output, plot_path=args.plot)
    if args.json:
        emit_json(doc)
    failed = [n for n, e in doc["benchmarks"].items() if e["status"] == "error"]
    if failed:
        print(f"ksim bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
