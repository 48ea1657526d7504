"""``ksim demo``: instrument the toy kernel with jmp and with trap splicing.

Counts the entries of a handful of functions -- including the splicing hard
cases: a function shorter than 5 bytes, one whose first instruction is
RIP-relative, a recursive one, one reached only through the syscall table --
under both policies, checks every count against an exact address hook, and
reports what each splice costs the workload in emulated instructions per hit.
"""

from __future__ import annotations

import argparse
from typing import Any

from ksim.cli import add_json_flag, count_arg, emit_json, help_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="count toy-kernel functions with jmp and trap splicing",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="toy", help="bundled image to instrument (default: toy)")
    p.add_argument("--seed", type=count_arg, default=1, help="workload seed (default: 1)")
    p.add_argument("--functions", nargs="+", metavar="FUNC",
                   help="functions to count (default: the image's hard cases and a few others)")
    add_json_flag(p)
    p.set_defaults(func=run)


EXTRA = ("tcp_sync_mss", "submit_bio", "kmem_cache_alloc", "schedule")


def default_functions(image: str = "toy") -> list[str]:
    """The first function of each hard case and EXTRA, by the names ``image`` gives them."""
    from ksim import images
    from ksim.images.toy import HARD_CASES

    picked: list[str] = []
    for case in ("short", "rip_relative_entry", "branch_near_entry", "recursive", "syscall_only"):
        for name in HARD_CASES.get(case, [])[:1]:
            if name not in picked:
                picked.append(name)
    local = images.get(image).local_name
    return [local(f) for f in picked + [f for f in EXTRA if f not in picked]]


def demo(image: str = "toy", seed: int = 1, functions: list[str] | None = None,
         *, out: Any = None) -> list[dict[str, Any]]:
    from ksim.kapi import Manager

    functions = functions or default_functions(image)
    rows: list[dict[str, Any]] = []
    with Manager.attach(f"unicorn:{image}") as m:
        base = m.run(seed=seed, count_instructions=True)
        for name in functions:
            fn = m.find_function(name)
            for policy in ("jmp", "trap"):
                counter = m.malloc(8)
                h = m.insert_snippet(m.entry_point(fn), counter.atomic_assign(counter + 1),
                                     splice=policy)
                tactic = m.patch_of(h).tactic
                with m.oracle(fn.address) as oracle:
                    result = m.run(seed=seed, count_instructions=True)
                    expected = oracle.count
                count = m.read(counter)
                m.remove_snippet(h)
                m.free(counter)
                assert result.instructions is not None and base.instructions is not None
                extra = result.instructions - base.instructions
                row = {"function": name, "size": fn.size, "policy": policy, "tactic": tactic,
                       "count": count, "oracle": expected, "ok": count == expected,
                       "checksum_unchanged": result.checksum == base.checksum,
                       "insns_per_hit": round(extra / count, 2) if count else None}
                rows.append(row)
                if out is not None:
                    _print_row(row, out)
    return rows


_HEADER = f"{'function':<26}{'size':>5}  {'policy':<7}{'tactic':<14}{'count':>8}{'oracle':>8}  {'insns/hit':>9}"


def _print_row(row: dict[str, Any], out: Any) -> None:
    per_hit = "-" if row["insns_per_hit"] is None else f"{row['insns_per_hit']:.1f}"
    flag = "" if row["ok"] and row["checksum_unchanged"] else "   <-- MISMATCH"
    print(f"{row['function']:<26}{row['size']:>5}  {row['policy']:<7}{row['tactic']:<14}"
          f"{row['count']:>8}{row['oracle']:>8}  {per_hit:>9}{flag}", file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    import sys

    if not args.json:
        print(f"ksim demo: counting entries on unicorn:{args.image} (seed {args.seed}); "
              "oracle = an exact unicorn address hook on the entry", flush=True)
        print(_HEADER)
    rows = demo(args.image, args.seed, args.functions, out=None if args.json else sys.stdout)
    if args.json:
        emit_json(rows)
    else:
        jmp = [r["insns_per_hit"] for r in rows if r["policy"] == "jmp" and r["insns_per_hit"]]
        trap = [r["insns_per_hit"] for r in rows if r["policy"] == "trap" and r["insns_per_hit"]]
        if jmp and trap:
            print(f"\nmean emulated instructions per hit: jmp {sum(jmp) / len(jmp):.1f}, "
                  f"trap {sum(trap) / len(trap):.1f} (in unicorn a trap costs one interrupt "
                  "hook instead of kernel instructions; see `ksim bench per-hit` for cycles)")
        print("every count matches its oracle and the workload's final state is unchanged"
              if all(r["ok"] and r["checksum_unchanged"] for r in rows) else "MISMATCHES above")
    return 0 if all(r["ok"] and r["checksum_unchanged"] for r in rows) else 1
