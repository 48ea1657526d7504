"""The ``ksim`` command line.

Each subcommand lives in its own module under ``ksim.commands`` and exposes
``register(subparsers)``; the module's ``run(args)`` returns the exit status.
Every command takes ``--json`` and then prints only JSON on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any

import ksim.commands as commands_pkg
from ksim.errors import KsimError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ksim",
        description="Dynamic kernel instrumentation: points + snippets, spliced by jump or trap "
        "into a kernel running in unicorn, QEMU or live Linux.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands_pkg.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KsimError as exc:
        if getattr(args, "json", False):
            emit_json({"error": exc.code, "message": str(exc)})
        else:
            print(f"ksim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ksim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
