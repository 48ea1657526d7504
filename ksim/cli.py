"""The ``ksim`` command line.

Each subcommand lives in its own module under ``ksim.commands`` and exposes
``register(subparsers)``; the module's ``run(args)`` returns the exit status.
Every command takes ``--json`` and then prints only JSON on stdout.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import pkgutil
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import ksim.commands as commands_pkg
from ksim.errors import KsimError, UsageError


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a command line is a UsageError (its
    subcommands' parsers are of this class too): main prints it as argparse does, or
    as a JSON error record under --json."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message, self.format_usage())


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``command`` (the first word of one) naming a
    subcommand, that subcommand's alone: a command imports its own module, not all
    eleven (20 ms of its start)."""
    parser = Parser(
        prog="ksim",
        description="Dynamic kernel instrumentation: points + snippets, spliced by jump or trap "
        "into a kernel running in unicorn, QEMU or live Linux.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show the program's version number and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    names = sorted(info.name for info in pkgutil.iter_modules(commands_pkg.__path__))
    for name in [command] if command in names else names:
        module = importlib.import_module(f"{commands_pkg.__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


class _Version(argparse.Action):
    """--version: the distribution's version looked up when asked for (importlib.metadata
    is 20 ms of a command's start)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"ksim {version()}")     # on stdout, as argparse's own version action
        parser.exit()


def version() -> str:
    """The installed distribution's version (the source tree's, when run from it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ksim")
    except PackageNotFoundError:
        return "unknown"


def help_text(doc: str | None) -> str:
    """A module docstring as a command's --help text: reStructuredText literals
    (double backquotes) and roles (:class:`X`) shown as plain text."""
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")


def count_arg(text: str) -> int:
    """argparse type of a count or seed: a whole number from 0 to 2**64-1 (decimal or 0x...)."""
    try:
        value = int(text, 10)
    except ValueError:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**64-1, not {value}")
    return value


def emit_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def wants_json(argv: Sequence[str]) -> bool:
    """--json among the options (before a ``--``, after which words are operands)."""
    words = list(argv)
    return "--json" in words[:words.index("--")] if "--" in words else "--json" in words


#: the collector's threshold for its youngest generation in a command (Python's
#: default is 700): a command holds a kernel's symbols, text and analysis store,
#: millions of objects that live as long as it does, and attaching to thousands of
#: functions makes objects fast enough that the default collects several times a
#: millisecond and scans the old generations over and over (some 5% of ``ksim
#: trace 'kprobe:t*'``'s attach on the testbed).  400,000 against 50,000: 0.62 s
#: against 0.68 s for re*'s attach (five runs of each, interleaved), the same for t*,
#: the same peak memory
GC_YOUNG = 400_000


@contextmanager
def kept_for_the_command() -> Iterator[Any]:
    """What the command's attach makes -- the kernel's analyses and the plans of
    thousands of probes, which live until the command ends -- kept out of the cyclic
    collector's scans until then: the collector is held through the attach, and what
    exists when it ends is frozen (gc.freeze), not scanned by a collection of a
    million young objects: a first ``ksim trace 'kprobe:re*'`` attaches in 0.92-1.02 s,
    against 1.08-1.16 s (three runs of each, interleaved, each on a store made
    afresh); a second is the same.  Unfrozen when the command ends, so that a
    process running commands one after another (the tests) collects their garbage
    as before."""
    froze = False

    @contextmanager
    def keep() -> Iterator[None]:
        nonlocal froze
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            gc.freeze()
            froze = True
            if was:
                gc.enable()

    try:
        yield keep
    finally:
        if froze:
            gc.unfreeze()


def main(argv: Sequence[str] | None = None) -> int:
    gc.set_threshold(GC_YOUNG, 20, 100)
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(words[0] if words else None)
    try:
        args = parser.parse_args(words)
    except UsageError as exc:
        # exit status 2 as argparse's own refusal; under --json its record on stdout
        if wants_json(words):
            emit_json({"error": exc.code, "message": str(exc)})
        else:
            sys.stderr.write(exc.usage)
            print(f"{exc.prog}: error: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left is seen here
        return status
    except KsimError as exc:
        if getattr(args, "json", False):
            emit_json({"error": exc.code, "message": str(exc)})
        else:
            print(f"ksim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if getattr(args, "json", False):
            emit_json({"error": "interrupted", "message": "interrupted (SIGINT)"})
        print("ksim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``ksim ... | head``): stop quietly, as Unix tools do;
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def run() -> NoReturn:
    """The ``ksim`` executable (and ``python -m ksim``): :func:`main`, and then the
    process ends without the interpreter's teardown.  A command holds a kernel's
    symbols, text, analysis store and the plans of its probes, a million objects or
    more, and freeing them one by one at exit took 130-180 ms of a ``ksim trace``
    (some 20% of its wall time), after its output was complete.  Everything a normal
    exit does that anyone could see still happens: the exit handlers run (a QEMU
    machine is stopped, temporary directories are removed), the standard streams are
    flushed, and the exit status is main's.  With a thread other than a daemon still
    running, the process exits as usual, which waits for it."""
    try:
        status = main()
    except SystemExit as exc:
        # argparse's --help and its own refusals, and any command that exits
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    threading = sys.modules.get("threading")
    if threading is not None and any(t.is_alive() and not t.daemon
                                     for t in threading.enumerate()
                                     if t is not threading.main_thread()):
        sys.exit(status)
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass    # a reader that left, a stream closed: as the interpreter's own flush
    os._exit(status)


if __name__ == "__main__":
    run()
