#!/usr/bin/env python3
"""replace_function_call -- call-site replacement (the KernInst guide's
replace_function_call.C, section 6.4).

    python examples/replace_function_call.py [TARGET] [ITERATIONS]

One direct call of tcp_sync_mss -- the workload's (workload_step) -- is
retargeted to tcp_sync_mss_v2, a C version from the component repository
(examples/replace_function.py); the kernel's other calls still reach the
original.  Checks: the replacement ran exactly as often as that call site
executed (address hook), the original's entry count dropped by as much, and
undo restores the workload's checksum.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replace_function import ROOT, SOURCE  # noqa: E402

from ksim import components  # noqa: E402
from ksim.arch.base import Flow  # noqa: E402
from ksim.kapi import Manager  # noqa: E402
from ksim.replace import Replacements  # noqa: E402

CALLER, CALLEE = "workload_step", "tcp_sync_mss"


def main(argv: list[str]) -> int:
    target = argv[0] if argv else "unicorn:toy"
    iterations = int(argv[1]) if len(argv) > 1 else 500
    with Manager.attach(target) as kmgr:
        callee = kmgr.find_function(CALLEE).address
        code = kmgr.facts.function_code(CALLER)
        sites = [p.address for p in kmgr.callsite_points(CALLER)
                 if (i := code.insns[code.index_of(p.address)]).flow is Flow.CALL
                 and i.target == callee]
        if len(sites) != 1:
            print(f"expected one call of {CALLEE} in {CALLER}, found {len(sites)}", file=sys.stderr)
            return 1
        site = sites[0]
        with kmgr.oracle(callee) as before:
            baseline = kmgr.run(iterations=iterations).checksum
        comp = components.load(kmgr, components.build_c(
            SOURCE, arch=kmgr.arch, include=(ROOT / "images" / "toy" / "include",),
            name="tcp_sync_mss_v2"))
        repl = Replacements(kmgr)
        r = repl.replace_call(site, comp.symbol("tcp_sync_mss_v2"))
        with kmgr.oracle(site) as at_site, kmgr.oracle(callee) as original:
            replaced = kmgr.run(iterations=iterations).checksum
        ran = int.from_bytes(kmgr.copy_from_kernel(comp.symbol("tcp_sync_mss_v2_calls"), 8), "little")
        repl.undo(r)
        comp.unload()
        restored = kmgr.run(iterations=iterations).checksum
        print(f"call at {site:#x} in {CALLER}: tcp_sync_mss_v2 ran {ran} times, "
              f"the call site ran {at_site.count}; {CALLEE} entries {before.count} -> {original.count}")
        print(f"checksum {baseline:#x} -> {replaced:#x} -> undone {restored:#x}")
        if not (ran == at_site.count > 0 and original.count == before.count - ran
                and replaced != baseline and restored == baseline):
            print("MISMATCH", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
