"""``ksim verify``: check that every splice keeps the kernel's behaviour (docs/verify.md).

    ksim verify [--image debian|debian:MODULE.ko|debian-arm64|toy|toy-arm64|PATH]
                [--functions PATTERN] [--points KINDS] [--sample K]
                [--cases N] [--seed S] [--program FILE.bt] [--cluster ADDRESS]
                [--workers N] [--results FILE.jsonl] [--json]
    ksim verify [--image ...] --case ID

Each case runs a kernel function in unicorn from a point twice, on the original
text and on the text spliced as the Manager would splice it (the planner asked
with --splice's policy, the snippet at the point), from the same seeded machine
state, and compares what both runs did (ksim.differential): equivalent, refused
by the planner (an answer too), or NOT equivalent.

The image is the testbed's Debian kernel unless --image names another.  The
points are those of the functions --functions names (comma-separated names,
wildcards, NAME+OFFSET, or 'all', the default): their entries, or the kinds
--points names (entry, exit, block, callsite); or those a ksim trace program's
kprobe and kretprobe probes splice (--program).  --sample K checks a seeded
sample of K of them.  Each point gets --cases seeded cases (default 1),
their seeds derived from --seed.

Cases run on local processes (--workers, default one per CPU) or on a Ray
cluster (--cluster ADDRESS, or RAY_ADDRESS).  A progress bar goes to stderr;
--results FILE.jsonl gets one JSON line per case as it comes, and a run with the
same file skips the cases it holds.  The summary names every case that is not
equivalent with the command that runs it again (--case ID), which prints what
differs.  The exit status is 1 when a case is not equivalent or could not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ksim.cli import add_json_flag, count_arg, emit_json, help_text

#: at most this many cases in one campaign (points times --cases): each is held in
#: memory before the first runs (2**64 cases at one point ended in a MemoryError);
#: the largest campaigns of docs/verify.md have some 50,000
MAX_CASES = 1_000_000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check splices against the original code, case by case",
                       description=help_text(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default=None, metavar="IMAGE",
                   help="debian (default: the testbed's Debian kernel), debian:e100.ko or "
                        "debian:ext4.ko (its modules), debian-arm64 (Debian's arm64 kernel), "
                        "toy, toy-arm64, or the path of a vmlinux or module")
    p.add_argument("--kallsyms", default=None, metavar="FILE",
                   help="with --image PATH: a symbol list (/proc/kallsyms format) for an ELF "
                        "without symbols")
    p.add_argument("--functions", default="all", metavar="PATTERN",
                   help="names, wildcards, NAME+OFFSET, or 'all' (default), comma-separated")
    p.add_argument("--points", default="entry", metavar="KINDS",
                   help="which points of each function: entry (default), exit, block, callsite, "
                        "comma-separated")
    p.add_argument("--sample", type=count_arg, default=None, metavar="K",
                   help="a seeded sample of K of the points")
    p.add_argument("--cases", type=count_arg, default=1, metavar="N",
                   help="seeded cases per point (default 1)")
    p.add_argument("--seed", type=count_arg, default=0, metavar="S",
                   help="the campaign's seed (default 0): the cases' seeds derive from it")
    p.add_argument("--program", default=None, metavar="FILE.bt",
                   help="check the points a ksim trace program's kprobe and kretprobe probes "
                        "splice (instead of --functions)")
    p.add_argument("--splice", default="auto", metavar="POLICY",
                   help="the policy the planner is asked with: auto (default), jmp, trap, or "
                        "one tactic exactly (jmp+displace, springboard)")
    p.add_argument("--snippet", default="counter", choices=("counter", "empty"),
                   help="the snippet at every point (default: an entry counter)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="run on this Ray cluster (default: RAY_ADDRESS, else local processes)")
    p.add_argument("--workers", type=count_arg, default=None, metavar="N",
                   help="processes (local; default one per CPU) or tasks in flight (Ray; "
                        "default the cluster's CPUs)")
    p.add_argument("--results", default=None, metavar="FILE.jsonl",
                   help="append each case's result to FILE as a JSON line; cases already "
                        "there are skipped (a run resumes)")
    p.add_argument("--case", default=None, metavar="ID",
                   help="run exactly this case (a summary's reproducer) and print what differs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ksim.campaign import campaign, cases, engines, worker
    from ksim.campaign.errors import BadCase

    if args.workers == 0:
        raise BadCase("--workers must be at least 1")
    if args.cases == 0:
        raise BadCase("--cases must be at least 1")
    cases.check_policy(args.splice)
    if args.case is not None:
        for flag, given in (("--functions", args.functions != "all"), ("--program", args.program),
                            ("--sample", args.sample is not None), ("--cluster", args.cluster),
                            ("--results", args.results)):
            if given:
                raise BadCase(f"--case runs one case here: it takes no {flag}")
    if args.program is not None and args.points != "entry":
        raise BadCase("--program's probes say which points are spliced: it takes no --points")
    if args.program is not None and args.functions != "all":
        raise BadCase("give the points with --functions or --program, not both")
    source = cases.image_source(args.image, args.kallsyms)
    key = engines.image_key(source)
    check = worker.checker(key, source)
    if args.case is not None:
        return _one_case(check, args)
    if args.program is not None:
        from ksim.campaign.program import program_targets

        targets = cases.sample_of(program_targets(args.program, check.harness.facts),
                                  args.sample, args.seed)
    else:
        targets = cases.select(check.image, args.functions, sample=args.sample, seed=args.seed,
                               kinds=_kinds(args.points), facts=check.harness.facts)
    if len(targets) * args.cases > MAX_CASES:
        raise BadCase(f"{len(targets):,} points with --cases {args.cases:,} make more than "
                      f"{MAX_CASES:,} cases: fewer points (--functions, --sample) or cases")
    todo = cases.make_cases(targets, args.cases, args.seed, args.splice, args.snippet)
    engine = engines.engine_for(args.cluster, args.workers)
    try:
        engine.connect()
        outcome = campaign.run(source, todo, engine,
                               results=Path(args.results) if args.results else None,
                               progress=not args.no_progress)
    finally:
        engine.close()
    summary = outcome.summary()
    summary["points"] = len(targets)
    if args.json:
        emit_json(summary)
    else:
        print_summary(summary)
    return 1 if summary["non_equivalent"] or summary["errors"] else 0


def _kinds(text: str) -> tuple[str, ...]:
    from ksim.campaign.cases import POINT_KINDS
    from ksim.campaign.errors import BadCase

    kinds = tuple(k.strip() for k in text.split(","))
    bad = [k for k in kinds if k not in POINT_KINDS]
    if bad or not kinds:
        raise BadCase(f"--points {text!r}: {', '.join(map(repr, bad)) or 'nothing'} is no kind of "
                      f"point (one or more of {', '.join(POINT_KINDS)})")
    return tuple(dict.fromkeys(kinds))


def _one_case(check: Any, args: argparse.Namespace) -> int:
    from ksim.campaign import cases
    from ksim.campaign.worker import DIFFERENT, ERROR

    case = cases.parse_case(check.image, args.case)
    record = check.run(case)
    if args.json:
        emit_json(record)
    else:
        print(describe(record))
    return 1 if record["status"] in (DIFFERENT, ERROR) else 0


def describe(record: dict[str, Any]) -> str:
    head = f"{record['case']} at {record['point']}"
    status = record["status"]
    if status == "equivalent":
        return f"{head}: equivalent ({record['tactic']}; {record['executed']} insns, {record['exit']})"
    if status == "refused":
        return f"{head}: refused: {record['reason']}"
    if status == "error":
        return f"{head}: ERROR: {record['reason']}"
    lines = [f"{head}: NOT equivalent ({record['tactic']}; moved {record.get('moved', '?')})"]
    lines += [f"    {d}" for d in record["diffs"]]
    return "\n".join(lines)


def print_summary(s: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    rate = f", {s['cases_per_second']} cases/s" if s["cases_per_second"] else ""
    resumed = f", {s['resumed']} from the results file" if s["resumed"] else ""
    print(f"ksim verify {s['image']}: {s['cases']} cases at {s['points']} points on {s['engine']} "
          f"({s['workers']} workers), {s['seconds']} s{rate}{resumed}", file=out)
    tactics = ", ".join(f"{k} {v}" for k, v in s["tactics"].items())
    refusals = ", ".join(f"{k} {v}" for k, v in s["refusals"].items())
    print(f"  equivalent      {s['equivalent']:>8}" + (f"  ({tactics})" if tactics else ""), file=out)
    print(f"  refused         {s['refused']:>8}" + (f"  ({refusals})" if refusals else ""), file=out)
    print(f"  not equivalent  {s['non_equivalent']:>8}", file=out)
    if s["errors"]:
        print(f"  errors          {s['errors']:>8}", file=out)
    print(f"  verdicts        {s['verdicts']}", file=out)
    for f in s["failures"]:
        what = "NOT equivalent" if f["status"] == "not-equivalent" else "ERROR"
        print(f"{what}: {f['point']} [{f['tactic'] or '-'}]: {f['why']}", file=out)
        print(f"  {f['reproduce']}", file=out)
