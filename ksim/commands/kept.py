"""``ksim kept --target live://HOST:PORT [--remove NAME ... | --remove-all]``:
the kept splices of a live kernel.

A client that sent ``keep`` leaves its splices in the kernel after it
disconnects, under a name; they survive kerninstd restarts too, since the
kernel module's log is the truth.  Without options, list them: each name with
its text writes (address, symbol, original and current bytes), trap routes and
patch-area and heap blocks.  ``--remove NAME`` undoes one (its text restored
byte for byte, routes cleared, blocks freed); ``--remove-all`` every one that
no connected client still holds.  An "orphan" is a client's leftovers that the
module could not undo (its text was changed behind ksim).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ksim.cli import add_json_flag, emit_json, help_text
from ksim.errors import KsimError

if TYPE_CHECKING:
    from ksim.live.client import LiveTarget


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kept", help="list or remove the kept splices of a live kernel",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="live://HOST:PORT",
                   help="the kerninstd to ask (ksim testbed up prints the testbed's)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the shared secret (default: the testbed's token)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--remove", action="append", default=[], metavar="NAME",
                      help="undo the kept splice NAME (may be given more than once)")
    what.add_argument("--remove-all", action="store_true",
                      help="undo every kept splice no connected client holds")
    add_json_flag(p)
    p.set_defaults(func=run)


def _open(args: argparse.Namespace) -> LiveTarget:
    from ksim.live.client import LiveTarget, parse_address

    if not args.target.startswith("live://"):
        raise KsimError(f"ksim kept: --target must be live://HOST:PORT, got {args.target!r}")
    host, port = parse_address(args.target[len("live://"):])
    return LiveTarget(host, port, token_file=args.token_file)


def _where(t: LiveTarget, address: int) -> str:
    try:
        symbol, offset = t.symbolize(address)
    except KsimError:
        return f"{address:#x}"
    return f"{address:#x} {symbol}+{offset:#x}"


def _show(t: LiveTarget, kept: dict[str, Any], verb: str = "") -> None:
    flags = [f for f in ("orphan",) if kept["orphan"]]
    if kept["session"]:
        flags.append(f"held by {kept['session']}")
    print(f"{verb}{kept['name']}" + (f" ({', '.join(flags)})" if flags else "")
          + f": {len(kept['writes'])} text writes, {len(kept['routes'])} trap routes, "
          f"{len(kept['blocks'])} blocks")
    for w in kept["writes"]:
        print(f"  write  {_where(t, w['address'])}: {w['orig']} -> {w['cur']}")
    for r in kept["routes"]:
        print(f"  route  {_where(t, r['site'])} -> {r['patch']:#x}")
    for b in kept["blocks"]:
        print(f"  block  {b['region']} {b['address']:#x}+{b['size']}")


def run(args: argparse.Namespace) -> int:
    with _open(args) as t:
        kept = t.kept()
        names = list(args.remove)
        if args.remove_all:
            names = [k["name"] for k in kept if not k["session"]]
        if not names:
            if args.json:
                emit_json({"target": args.target, "kept": kept})
            elif not kept:
                print("no kept splices")
            for k in [] if args.json else kept:
                _show(t, k)
            return 0
        removed, failed = [], []
        for name in names:
            try:
                removed.append(t.remove_kept(name))
            except KsimError as exc:
                failed.append({"name": name, "error": exc.code, "message": str(exc)})
        if args.json:
            emit_json({"target": args.target, "removed": removed, "failed": failed,
                       "kept": t.kept()})
        else:
            for k in removed:
                _show(t, k, verb="removed ")
            for f in failed:
                print(f"ksim kept: cannot remove {f['name']}: {f['message']}", file=sys.stderr)
        return 1 if failed else 0
