"""``ksim count FUNC``: count entries of kernel functions (the guide's count_func).

FUNC is a function's name, a wildcard over names (``'vfs_*'``, ``'tcp_?et*'``:
every matching function whose entry can be spliced; the others are listed as
skipped), ``NAME+OFFSET`` (an instruction inside a function) or an address
(``0xffffffff81234567``).  OFFSET and the address are decimal or hexadecimal
with ``0x``; a number with a leading zero (``0777``: octal?) is refused.  A counter on the kernel's data heap is incremented
atomically by a snippet spliced at each point, all of them in one batch; an
independent oracle counts the same executions without splicing (an exact
address hook in unicorn, gdbstub breakpoints or the image's bookkeeping under
QEMU, the kernel's own kprobe on Linux).  The exit status is non-zero when the
two disagree anywhere.

Ctrl-C stops the run at once: what was counted so far is printed (exit status
130) and the kernel's text is restored, as after every count.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
import time
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any, cast

from ksim.cli import add_json_flag, count_arg, emit_json, help_text, kept_for_the_command
from ksim.core import HeldInterrupt
from ksim.errors import KsimError, PointSyntaxError, UnknownOracle
from ksim.targets.base import run_option_names

#: the oracles targets have (unicorn, QEMU, live), by the name their counters report
ORACLE_KINDS = ("unicorn-address-hook", "gdbstub-breakpoint", "kprobe")
#: what --oracle takes: the target's own, none, or one by name
ORACLES = ("auto", "none", *ORACLE_KINDS)
#: the workload seed on targets that take one, unless --seed says otherwise
DEFAULT_SEED = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("count", help="count entries of a kernel function, checked against an oracle",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("function", metavar="FUNC",
                   help="a function name, a wildcard ('vfs_*'), NAME+OFFSET or an address")
    add_target_args(p)
    p.add_argument("--splice", choices=("jmp", "trap", "auto"), default="auto",
                   help="splicing policy (default: auto, the cheapest safe tactic)")
    p.add_argument("--oracle", default="auto", choices=ORACLES,
                   help="independent count to compare with: auto (the target's own: "
                   "unicorn-address-hook, gdbstub-breakpoint on qemu, kprobe on live), "
                   "one of those by name, or none")
    p.add_argument("--while", dest="while_cmd", metavar="CMD",
                   help="live targets: run CMD in the guest while counting")
    add_pid_arg(p)
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


def add_pid_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=count_arg, default=None, metavar="PID",
                   help="count only hits in this process (its thread group: every thread)")


def pid_filter(pid: int | None, body: Any) -> Any:
    """``body`` run only when the current task belongs to process ``pid`` (None: always)."""
    from ksim.snippets import ast

    return body if pid is None else ast.If(ast.Tgid() == ast.Const(pid), body)


def target_spec(args: argparse.Namespace) -> str:
    return args.target if "://" in args.target or ":" in args.target else f"{args.target}:{args.image}"


def count(function: str, spec: str, *, splice: str = "auto", seed: int | None = None,
          iterations: int | None = None, oracle: str = "auto", while_cmd: str | None = None,
          progress: bool = False, pid: int | None = None) -> dict[str, Any]:
    """Count executions of the points ``function`` names (see the module doc) on
    target ``spec``; return the report as a dict: one point's fields at the top
    level, and one row per point under ``rows``.

    ``seed`` is DEFAULT_SEED on a target that takes one; the target refuses
    options it does not take (``while_cmd`` on an emulator, ``seed`` on a live
    kernel) and impossible values.  ``oracle`` is one of ORACLES.  If Ctrl-C
    stops the run, the report holds what was counted until then and
    ``interrupted`` is true (a count and its oracle may then differ by a hit
    in flight).  The splices are removed whatever happens.  With ``pid`` only hits in
    that process count; the targets' oracles count every process, so there is none
    (``oracle`` must be "auto" or "none")."""
    from ksim.kapi import Manager

    if oracle not in ORACLES:
        raise UnknownOracle(f"unknown oracle {oracle!r}: choose from {', '.join(ORACLES)}")
    parse_point(function)  # refused before anything is attached
    if pid is not None:
        if oracle not in ("auto", "none"):
            raise UnknownOracle(f"the {oracle} oracle counts every process: with --pid "
                                "choose --oracle none (or auto)")
        oracle = "none"
    with Manager.attach(spec) as m, kept_for_the_command() as keep:
        wildcard = parse_point(function).wildcard
        with keep(), m.one_look():  # the kernel asked about the points' text once
            points, skipped = resolve_points(m, function, splice, plan=not wildcard)
            variables = m.malloc_array(len(points))
            counters = {p.address: v for (p, _), v in zip(points, variables, strict=True)}
            # a wildcard's entries are planned once, by the batch: those it refuses are
            # skipped (and say why), as spliceable_entries' would have been
            refused: dict[int, str] | None = {} if wildcard else None
            handles = m.insert_many([p for p, _ in points],
                                    lambda p: pid_filter(pid, counters[p.address].atomic_assign(
                                        counters[p.address] + 1)),
                                    splice=splice, refused=refused)
        spliced = [p.address not in (refused or ()) for p, _ in points]
        for (p, _), label, ok in zip(points, labels(m, points), spliced, strict=True):
            if not ok:
                skipped[label] = cast(dict[int, str], refused)[p.address]
        if not any(spliced):
            raise none_spliced(function, skipped)
        points = [pa for pa, ok in zip(points, spliced, strict=True) if ok]
        oracles: dict[int, Any] = {}
        try:
            tactics = {h.point.address: m.patch_of(h).tactic for h in handles}
            options = _run_options(m, seed, iterations, while_cmd)
            if progress:
                options["progress"] = _Ticker(m, variables)
            if oracle != "none":
                for p, at in points:
                    oracles[p.address] = m.target.oracle_counter(at)
                    name = oracles[p.address].name
                    if oracle != "auto" and name != oracle:
                        raise UnknownOracle(f"{spec} has no {oracle} oracle (its oracle is "
                                            f"{name}; --oracle auto picks it)")
            # counted from the moment every oracle counts too: on a live kernel other
            # processes run the function while the oracles are being set up
            start = m.read_array(variables) if oracles else [0] * len(variables)
            interrupted = _run(m, options)
            counts = [n - n0 for n, n0, ok in zip(m.read_array(variables), start, spliced,
                                                   strict=True) if ok]
            rows = [{"function": label, "address": p.address, "tactic": tactics[p.address],
                     "count": n,
                     "oracle": oracles[p.address].count if oracles else None}
                    for (p, _), label, n in zip(points, labels(m, points), counts, strict=True)]
        finally:
            with HeldInterrupt():  # a second Ctrl-C waits until the text is restored
                for o in oracles.values():
                    o.close()
                m.remove_many(handles)
    report: dict[str, Any] = {"function": function, "target": spec, "splice": splice,
                              "interrupted": interrupted, "rows": rows, "skipped": skipped,
                              "pid": pid}
    if len(rows) == 1:
        report.update(tactic=rows[0]["tactic"], count=rows[0]["count"], oracle=rows[0]["oracle"])
    if oracles:
        report["oracle_kind"] = next(iter(oracles.values())).name
    return report


# --- the point grammar ------------------------------------------------------------
#:   POINT   := WILDCARD | NAME | NAME "+" NUMBER | NUMBER      (NUMBER: an address)
#:   NUMBER  := "0" | [1-9][0-9]* | "0" [xX] [0-9a-fA-F]+       (ASCII digits only)
#:   NAME    := printable ASCII, no space, not starting with a digit, no "+"
#:   WILDCARD:= a NAME with at least one of * ? [ (fnmatch), no "+OFFSET"
_NUMBER = re.compile(r"(?:0|[1-9][0-9]*|0[xX][0-9a-fA-F]+)\Z")
_NAME = re.compile(r"[!-~]+\Z")
#: what ends a glob's literal prefix (fnmatch's special characters)
_GLOB_SPECIAL = re.compile(r"[*?\[]")
_WILDCARD = frozenset("*?[")
#: a kernel symbol name's most characters (KSYM_NAME_LEN, include/linux/kallsyms.h)
MAX_NAME = 512


@dataclass(frozen=True)
class PointSpec:
    """A point as ``ksim count`` names it: a function ``name`` (a wildcard when
    ``wildcard``), with an ``offset`` into it; or an ``address``."""

    name: str | None = None
    offset: int = 0
    address: int | None = None
    wildcard: bool = False


def parse_point(what: Any) -> PointSpec:
    """``what`` read by the point grammar above; PointSyntaxError saying where it
    does not follow it."""
    if not isinstance(what, str):
        raise PointSyntaxError(f"a point is named by a string, not {type(what).__name__}")
    shown = repr(what) if len(what) <= 80 else repr(what[:80]) + "..."
    if not what:
        raise PointSyntaxError("an empty point: name a function, NAME+OFFSET or an address")
    if len(what) > MAX_NAME + 24:
        raise PointSyntaxError(f"{shown}: longer than any point ({MAX_NAME} characters of a "
                               "name, and an offset)")
    base, plus, offset = what.partition("+")
    if plus:
        if not base:
            raise PointSyntaxError(f"{shown}: no function name before '+' (NAME+OFFSET)")
        if _WILDCARD & set(base):
            raise PointSyntaxError(f"{shown}: a wildcard names functions' entries; it takes "
                                   "no +OFFSET")
        if base[0].isascii() and base[0].isdigit():
            raise PointSyntaxError(f"{shown}: NAME+OFFSET takes a function's name before '+', "
                                   f"not {base!r} (an address is given alone)")
        return PointSpec(_name(base, shown, f"{base!r} before '+' is not a function's name"),
                         offset=_number(offset, "offset", shown))
    if base[0].isascii() and base[0].isdigit():
        return PointSpec(address=_number(base, "address", shown))
    return PointSpec(_name(base, shown, "neither an address nor a function's name nor a wildcard"),
                     wildcard=bool(_WILDCARD & set(base)))


def _name(name: str, shown: str, what: str) -> str:
    if not _NAME.match(name):
        raise PointSyntaxError(f"{shown}: {what} (a name is printable ASCII without spaces)")
    if len(name) > MAX_NAME:
        raise PointSyntaxError(f"{shown}: a function name has at most {MAX_NAME} characters")
    return name


def _number(text: str, what: str, shown: str) -> int:
    """An offset or address: decimal, or hexadecimal with 0x (module doc)."""
    if not text:
        raise PointSyntaxError(f"{shown}: no {what} after '+'")
    if not _NUMBER.match(text):
        if "+" in text:
            why = "one function and one offset only"
        elif text[0] == "0" and text[1:].isascii() and text[1:].isdigit():
            why = (f"{text!r} has a leading zero (octal?); write it in decimal without the "
                   "zero, or in hexadecimal with 0x")
        elif text[:2] in ("0x", "0X"):
            why = (f"{text!r} has no hexadecimal digits after 0x" if len(text) == 2
                   else f"{text!r} is not hexadecimal (0-9, a-f)")
        else:
            why = f"{text!r} is not a number (decimal, or hexadecimal with 0x)"
        raise PointSyntaxError(f"{shown}: the {what} {why}")
    value = int(text, 0)
    if value >= 1 << 64:
        raise PointSyntaxError(f"{shown}: the {what} {text} is beyond 64 bits")
    return value


def matching_functions(image: Any, pattern: str) -> list[Any]:
    """The functions whose names match the glob ``pattern`` (fnmatchcase), in address
    order, one per name and address: a name several functions have (static functions
    of different files) means the last of them.  Those whose names start with the
    glob's literal prefix are found in the kernel's analysis store's name index when
    it has one, else every name is matched."""
    from ksim.analysis.store import store_for

    match = re.compile(fnmatch.translate(pattern)).match    # fnmatchcase, compiled once
    prefix = _GLOB_SPECIAL.split(pattern, maxsplit=1)[0]
    kept = store_for(image, build_missing=False) if prefix else None
    indexed = kept.named(image, prefix) if kept is not None else None
    functions = image.functions if indexed is None else indexed
    matched = list(compress(functions, map(match, map(attrgetter("name"), functions))))
    last = {f.name: f for f in matched}
    out, seen = [], set()
    for f in matched:
        if last[f.name] is f and f.address not in seen:   # an alias matched: no new point
            seen.add(f.address)
            out.append(f)
    return out


def resolve_points(m: Any, what: str, splice: str, *, plan: bool = True
                   ) -> tuple[list[tuple[Any, int]], dict[str, str]]:
    """The points ``what`` names (see :func:`parse_point`), each with the address its
    oracle watches (a function's own address for its entry), and the functions a
    wildcard matched whose entry cannot be spliced (name -> why).  With ``plan=False``
    a wildcard's entries are not planned here: the caller inserts them with
    ``insert_many(..., refused=...)``, which plans each once and leaves out (and
    says why) those that cannot be spliced."""
    from ksim.errors import OutsideText, UnknownSymbol

    spec = parse_point(what)
    image = m.target.image
    if spec.wildcard:
        funcs = matching_functions(image, what)
        if not funcs:
            raise UnknownSymbol(what, [])
        found, skipped = m.spliceable_entries(funcs, splice, plan=plan)
        out = [(point, f.address) for f, point in found]
        if not out:
            raise none_spliced(what, skipped)
        return out, skipped
    if spec.address is not None:
        point = m.point_at(spec.address)
        return [(point, point.address)], {}
    fn = m.find_function(spec.name)
    if spec.offset:
        if fn.size and spec.offset >= fn.size:
            raise OutsideText(f"{what}: the offset {spec.offset:#x} is past the end of {fn.name} "
                              f"({fn.size:#x} bytes)")
        point = m.point_at(fn.address + spec.offset)
        return [(point, point.address)], {}
    with m.looking_ahead([fn]):     # its text and hazards in one go, not chunk by chunk
        return [(m.entry_point(fn), fn.address)], {}


def none_spliced(what: str, skipped: dict[str, str]) -> KsimError:
    """The error of a wildcard none of whose functions can be spliced."""
    return KsimError(f"no function matching {what!r} can be spliced "
                     f"({len(skipped)} matched; e.g. {next(iter(skipped.items()))})")


def labels(m: Any, points: list[tuple[Any, int]]) -> list[str]:
    """``name`` for a function's entry, ``name+0xOFF`` for any other point."""
    out = []
    for p, oracle_at in points:
        f = m.target.image.function_at(p.address)
        if f is None:
            out.append(f"{p.address:#x}")
        elif oracle_at == f.address:
            out.append(f.name)
        else:
            out.append(f"{f.name}+{p.address - f.address:#x}")
    return out


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
    """Prints the total count about once a second while the kernel runs (count_func's loop)."""

    def __init__(self, manager: Any, counters: list[Any]) -> None:
        self.manager, self.counters, self.last = manager, counters, time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= 1.0:
            self.last = now
            total = sum(self.manager.read_array(self.counters))
            print(f"  ... {total} so far", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    report = count(args.function, target_spec(args), splice=args.splice, seed=args.seed,
                   iterations=args.iterations, oracle=args.oracle, while_cmd=args.while_cmd,
                   progress=not args.json, pid=args.pid)
    rows = report["rows"]
    ok = all(r["oracle"] is None or r["count"] == r["oracle"] for r in rows)
    if args.json:
        emit_json(report)
    elif len(rows) == 1 and not report["skipped"]:
        r = rows[0]
        if report["interrupted"]:
            oracle = "" if r["oracle"] is None else f"; the oracle had {r['oracle']}"
            print(f"{r['function']}: {r['count']} entries so far on {report['target']} "
                  f"[{r['tactic']}]  (interrupted{oracle})")
        else:
            verdict = "" if r["oracle"] is None else (
                "  (matches the oracle)" if r["count"] == r["oracle"]
                else f"  (ORACLE SAYS {r['oracle']})")
            print(f"{r['function']}: {r['count']} entries on {report['target']} "
                  f"[{r['tactic']}]{verdict}")
    else:
        print_table(report)
    if report["interrupted"]:
        return 130
    return 0 if ok else 1


def print_table(report: dict[str, Any]) -> None:
    """One row per point, most counted first (bpftrace's map order, reversed)."""
    rows = sorted(report["rows"], key=lambda r: (-r["count"], r["function"]))
    width = max([len("FUNCTION")] + [len(r["function"]) for r in rows])
    print(f"{'FUNCTION':<{width}}  {'COUNT':>10}  {'ORACLE':>10}  TACTIC")
    for r in rows:
        oracle = "-" if r["oracle"] is None else str(r["oracle"])
        mark = "" if r["oracle"] is None or r["oracle"] == r["count"] else "  MISMATCH"
        print(f"{r['function']:<{width}}  {r['count']:>10}  {oracle:>10}  {r['tactic']}{mark}")
    total = sum(r["count"] for r in rows)
    note = "  (interrupted)" if report["interrupted"] else ""
    print(f"{len(rows)} points on {report['target']}, {total} hits{note}")
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}", file=sys.stderr)
