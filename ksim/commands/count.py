"""``ksim count FUNC``: count entries of a kernel function (the guide's count_func).

A counter on the kernel's data heap is incremented atomically by a snippet
spliced at FUNC's entry; an independent oracle counts the same entries without
splicing (an exact address hook in unicorn, gdbstub breakpoints or the image's
bookkeeping under QEMU, the kernel's own kprobe on Linux).  The exit status is
non-zero when the two disagree.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, emit_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("count", help="count entries of a kernel function, checked against an oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("function", metavar="FUNC")
    add_target_args(p)
    p.add_argument("--splice", choices=("jmp", "trap", "auto"), default="auto",
                   help="splicing policy (default: auto, the cheapest safe tactic)")
    p.add_argument("--oracle", default="auto",
                   help="independent count to compare with: auto (the target's own), kprobe (live), none")
    p.add_argument("--while", dest="while_cmd", metavar="CMD",
                   help="live targets: run CMD in the guest while counting")
    add_json_flag(p)
    p.set_defaults(func=run)


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", default="toy", help="bundled image for emulator targets (default: toy)")
    p.add_argument("--target", default="unicorn",
                   help="unicorn | qemu | live://HOST:PORT (default: unicorn)")
    p.add_argument("--seed", type=int, default=1, help="workload seed (emulator targets; default 1)")
    p.add_argument("--iterations", type=int, default=None,
                   help="workload iterations (emulator targets; default: the image's)")


def target_spec(args: argparse.Namespace) -> str:
    return args.target if "://" in args.target or ":" in args.target else f"{args.target}:{args.image}"


def count(function: str, spec: str, *, splice: str = "auto", seed: int | None = 1,
          iterations: int | None = None, oracle: str = "auto", while_cmd: str | None = None,
          progress: bool = False) -> dict[str, Any]:
    """Count entries of ``function`` on target ``spec``; return the report as a dict."""
    from ksim.kapi import Manager

    with Manager.attach(spec) as m:
        fn = m.find_function(function)
        point = m.entry_point(fn)
        counter = m.malloc(8)
        handle = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice=splice)
        tactic = m.patch_of(handle).tactic
        ticker = _Ticker(m, counter) if progress else None
        oracle_name, oracle_count = None, None
        options: dict[str, Any] = {"seed": seed, "iterations": iterations}
        if while_cmd is not None:
            options = {"while_cmd": while_cmd}
        if ticker is not None:
            options["progress"] = ticker
        if oracle == "none":
            m.run(**options)
        else:
            with m.oracle(fn.address) as oc:
                m.run(**options)
                oracle_name, oracle_count = oc.name, oc.count
        value = m.read(counter)
        m.remove_snippet(handle)
    report: dict[str, Any] = {
        "function": function, "target": spec, "splice": splice, "tactic": tactic,
        "count": value, "oracle": oracle_count,
    }
    if oracle_name is not None:
        report["oracle_kind"] = oracle_name
    return report


class _Ticker:
    """Prints the counter about once a second while the kernel runs (count_func's loop)."""

    def __init__(self, manager: Any, counter: Any) -> None:
        self.manager, self.counter, self.last = manager, counter, time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= 1.0:
            self.last = now
            print(f"  ... {self.manager.read(self.counter)} so far", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    report = count(args.function, target_spec(args), splice=args.splice, seed=args.seed,
                   iterations=args.iterations, oracle=args.oracle, while_cmd=args.while_cmd,
                   progress=not args.json)
    ok = report["oracle"] is None or report["count"] == report["oracle"]
    if args.json:
        emit_json(report)
    else:
        verdict = "" if report["oracle"] is None else (
            "  (matches the oracle)" if ok else f"  (ORACLE SAYS {report['oracle']})")
        print(f"{report['function']}: {report['count']} entries on {report['target']} "
              f"[{report['tactic']}]{verdict}")
    return 0 if ok else 1
