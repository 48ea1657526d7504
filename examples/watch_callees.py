#!/usr/bin/env python3
"""watch_callees -- learn where indirect calls go at run time (the KernInst guide's
watch_callees.C, section 6.5).

    python examples/watch_callees.py [TARGET] [FUNCTION...] [--iterations N] [--seed S]
    python examples/watch_callees.py unicorn:toy do_syscall_64
    python examples/watch_callees.py unicorn:toy-arm64      # its invoke_syscall

Every indirect call site of the functions (default: the toy kernel's syscall
dispatch, `sys_call_table[nr](regs)` in do_syscall_64) gets a snippet recording
the call's destination in a small table in kernel data (ksim.callees).  Functions
are named as on the x86 toy; an image that calls one otherwise (the arm64 toy's
invoke_syscall) is asked for its own name (ksim.images: ImageSpec.local_name).  After the
workload the example prints each site and the functions it reached, merges them
into the static call graph, and unwatches (the text must come back byte for byte).

The destinations are checked against an oracle.  On unicorn it is an exact
address hook on each call site that computes the destination from the registers
and memory at that moment; on other targets (qemu:toy) it is that same hook on
unicorn running the same image and workload (same seed and iterations).  Any mismatch
exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ksim import images
from ksim.analysis import call_graph
from ksim.arch.base import CallOperand
from ksim.callees import CalleeWatcher, evaluate_operand
from ksim.errors import UnknownImage
from ksim.kapi import Manager


def image_of(target: str) -> images.ImageSpec | None:
    """The registered image a target spec names (``unicorn:toy-arm64``), if any."""
    try:
        return images.get(target.partition(":")[2])
    except UnknownImage:
        return None


def watch(target: str, functions: list[str], seed: int, iterations: int, *, report: bool
          ) -> tuple[dict[int, set[int]], dict[int, set[int]] | None]:
    """(destinations the watcher recorded, destinations the hook oracle saw or None)."""
    with Manager.attach(target) as kmgr:
        image = kmgr.target.image
        funcs = [kmgr.find_function(f) for f in functions]
        text = [kmgr.copy_from_kernel(f.address, f.size) for f in funcs]
        watcher = CalleeWatcher(kmgr, slots=32)
        points = watcher.watch(functions)
        if not points:
            print(f"no indirect call sites in {', '.join(functions)}", file=sys.stderr)
            return {}, {}

        machine = getattr(kmgr.target, "machine", None)
        oracle: dict[int, set[int]] | None = None
        removes = []
        if machine is not None and hasattr(machine, "hook_code"):
            oracle = {p.address: set() for p in points}
            for p in points:
                op = watcher.sites[p.address].operand

                def hook(mach: Any, address: int, op: CallOperand = op) -> None:
                    assert oracle is not None
                    oracle[address].add(evaluate_operand(op, mach.reg, mach.read))

                removes.append(machine.hook_code(p.address, hook))

        kmgr.run(seed=seed, iterations=iterations)
        for remove in removes:
            remove()
        seen = watcher.destinations()
        overflow = watcher.overflows()
        if report:
            for p in points:
                site = watcher.sites[p.address]
                tactic = kmgr.splices()[p.address][0]
                print(f"{p.function} {p.address:#x}: call {site.operand} ({tactic} splice), "
                      f"{len(seen[p.address])} destinations, overflow {overflow[p.address]}")
                for dest in sorted(seen[p.address]):
                    print(f"    {dest:#x}  {watcher.name_of(dest)}")
            graph = call_graph(image, funcs)
            static = {f: set(graph.calls.get(f, ())) for f in functions}
            new = watcher.merge_into(graph)
            for f in functions:
                print(f"call graph of {f}: {len(static[f])} static callees, "
                      f"{len(graph.calls[f])} with the observed ones "
                      f"({len({e for e in new if e[0] == f})} new edges)")
        watcher.unwatch()
        if [kmgr.copy_from_kernel(f.address, f.size) for f in funcs] != text:
            print("MISMATCH: unwatch did not restore the text", file=sys.stderr)
            sys.exit(1)
        if report:
            print("unwatched; text restored byte for byte")
        if any(overflow.values()):
            print(f"MISMATCH: table overflow {overflow}", file=sys.stderr)
            sys.exit(1)
        return seen, oracle


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", help="[TARGET] [FUNCTION...]")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args(argv)
    args = opts.args
    target = args.pop(0) if args and ":" in args[0] else "unicorn:toy"
    spec = image_of(target)
    functions = [spec.local_name(f) if spec else f for f in args or ["do_syscall_64"]]

    seen, oracle = watch(target, functions, opts.seed, opts.iterations, report=True)
    source = "address hooks on the call sites"
    if oracle is None:
        emulated = f"unicorn:{spec.name if spec else 'toy'}"
        _, oracle = watch(emulated, functions, opts.seed, opts.iterations, report=False)
        source += f" ({emulated}, same workload)"
    assert oracle is not None
    print(f"oracle ({source}): {sum(len(d) for d in oracle.values())} destinations "
          f"at {len(oracle)} sites")
    if seen != oracle:
        for address in sorted(set(seen) | set(oracle)):
            got, want = seen.get(address, set()), oracle.get(address, set())
            if got != want:
                print(f"MISMATCH at {address:#x}: recorded {sorted(map(hex, got))}, "
                      f"oracle {sorted(map(hex, want))}", file=sys.stderr)
        return 1
    if not any(oracle.values()):
        print("MISMATCH: the workload made no indirect call at the watched sites", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
