"""``ksim count FUNC``: count entries of a kernel function (the guide's count_func).

A counter on the kernel's data heap is incremented atomically by a snippet
spliced at FUNC's entry; an independent oracle counts the same entries without
splicing (an exact address hook in unicorn, gdbstub breakpoints or the image's
bookkeeping under QEMU, the kernel's own kprobe on Linux).  The exit status is
non-zero when the two disagree.

Ctrl-C stops the run at once: what was counted so far is printed (exit status
130) and the kernel's text is restored, as after every count.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, count_arg, emit_json
from ksim.errors import UnknownOracle
from ksim.targets.base import HeldInterrupt, run_option_names

#: the oracles targets have (unicorn, QEMU, live), by the name their counters report
ORACLE_KINDS = ("unicorn-address-hook", "gdbstub-breakpoint", "kprobe")
#: what --oracle takes: the target's own, none, or one by name
ORACLES = ("auto", "none", *ORACLE_KINDS)
#: the workload seed on targets that take one, unless --seed says otherwise
DEFAULT_SEED = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("count", help="count entries of a kernel function, checked against an oracle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("function", metavar="FUNC")
    add_target_args(p)
    p.add_argument("--splice", choices=("jmp", "trap", "auto"), default="auto",
                   help="splicing policy (default: auto, the cheapest safe tactic)")
    p.add_argument("--oracle", default="auto", choices=ORACLES,
                   help="independent count to compare with: auto (the target's own: "
                   "unicorn-address-hook, gdbstub-breakpoint on qemu, kprobe on live), "
                   "one of those by name, or none")
    p.add_argument("--while", dest="while_cmd", metavar="CMD",
                   help="live targets: run CMD in the guest while counting")
    add_json_flag(p)
    p.set_defaults(func=run)


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", default="toy", help="bundled image for emulator targets (default: toy)")
    p.add_argument("--target", default="unicorn",
                   help="unicorn | qemu | live://HOST:PORT (default: unicorn)")
    p.add_argument("--seed", type=count_arg, default=None,
                   help=f"workload seed (emulator targets; default {DEFAULT_SEED})")
    p.add_argument("--iterations", type=count_arg, default=None,
                   help="workload iterations (emulator targets; default: the image's)")


def target_spec(args: argparse.Namespace) -> str:
    return args.target if "://" in args.target or ":" in args.target else f"{args.target}:{args.image}"


def count(function: str, spec: str, *, splice: str = "auto", seed: int | None = None,
          iterations: int | None = None, oracle: str = "auto", while_cmd: str | None = None,
          progress: bool = False) -> dict[str, Any]:
    """Count entries of ``function`` on target ``spec``; return the report as a dict.

    ``seed`` is DEFAULT_SEED on a target that takes one; the target refuses
    options it does not take (``while_cmd`` on an emulator, ``seed`` on a live
    kernel) and impossible values.  ``oracle`` is one of ORACLES.  If Ctrl-C
    stops the run, the report holds what was counted until then and
    ``interrupted`` is true (the count and the oracle may then differ by a hit
    in flight).  The splice is removed whatever happens."""
    from ksim.kapi import Manager

    if oracle not in ORACLES:
        raise UnknownOracle(f"unknown oracle {oracle!r}: choose from {', '.join(ORACLES)}")
    with Manager.attach(spec) as m:
        fn = m.find_function(function)
        point = m.entry_point(fn)
        counter = m.malloc(8)
        handle = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice=splice)
        try:
            tactic = m.patch_of(handle).tactic
            options = _run_options(m, seed, iterations, while_cmd)
            if progress:
                options["progress"] = _Ticker(m, counter)
            oracle_name, oracle_count, interrupted = None, None, False
            if oracle == "none":
                interrupted = _run(m, options)
            else:
                with m.oracle(fn.address) as oc:
                    if oracle != "auto" and oc.name != oracle:
                        raise UnknownOracle(f"{spec} has no {oracle} oracle (its oracle is "
                                            f"{oc.name}; --oracle auto picks it)")
                    interrupted = _run(m, options)
                    oracle_name, oracle_count = oc.name, oc.count
            value = m.read(counter)
        finally:
            with HeldInterrupt():  # a second Ctrl-C waits until the text is restored
                m.remove_snippet(handle)
    report: dict[str, Any] = {
        "function": function, "target": spec, "splice": splice, "tactic": tactic,
        "count": value, "oracle": oracle_count, "interrupted": interrupted,
    }
    if oracle_name is not None:
        report["oracle_kind"] = oracle_name
    return report


def _run_options(m: Any, seed: int | None, iterations: int | None,
                 while_cmd: str | None) -> dict[str, Any]:
    """The run options asked for, and the default seed where the target takes one."""
    options: dict[str, Any] = {}
    if seed is not None or "seed" in run_option_names(m.target):
        options["seed"] = DEFAULT_SEED if seed is None else seed
    if iterations is not None:
        options["iterations"] = iterations
    if while_cmd is not None:
        options["while_cmd"] = while_cmd
    return options


def _run(m: Any, options: dict[str, Any]) -> bool:
    """Run; True if Ctrl-C stopped the run (the target has stopped the kernel)."""
    try:
        m.run(**options)
    except KeyboardInterrupt:
        return True
    return False


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
    elif report["interrupted"]:
        oracle = "" if report["oracle"] is None else f"; the oracle had {report['oracle']}"
        print(f"{report['function']}: {report['count']} entries so far on {report['target']} "
              f"[{report['tactic']}]  (interrupted{oracle})")
    else:
        verdict = "" if report["oracle"] is None else (
            "  (matches the oracle)" if ok else f"  (ORACLE SAYS {report['oracle']})")
        print(f"{report['function']}: {report['count']} entries on {report['target']} "
              f"[{report['tactic']}]{verdict}")
    if report["interrupted"]:
        return 130
    return 0 if ok else 1
