#!/usr/bin/env python3
"""kprobe_count -- count bios submitted (the Red Hat article's kprobebio.c).

    python examples/kprobe_count.py [TARGET] [--python]

kprobebio registers a kprobe on generic_make_request whose pre_handler counts
calls; the toy kernel (and Linux 6.1) name that entry point submit_bio.  The
handler is a snippet (`count += 1`, compiled into the kernel, every target) or,
with --python, a Python function called from the trap (emulators only).  The
count is checked against an independent oracle: an address hook in unicorn,
the kernel's own kprobe on Linux.
"""

from __future__ import annotations

import sys

from ksim.kapi import Manager
from ksim.probes import KProbe, Probes

FUNCTION = "submit_bio"


def main(argv: list[str]) -> int:
    python = "--python" in argv
    args = [a for a in argv if a != "--python"]
    target = args[0] if args else "unicorn:toy"
    iterations = int(args[1]) if len(args) > 1 else 500
    with Manager.attach(target) as kmgr:
        probes = Probes(kmgr)
        if python:
            calls = [0]

            def pre_handler(kp: KProbe, regs: object) -> None:
                calls[0] += 1

            kp = KProbe(FUNCTION, pre_handler=pre_handler)
        else:
            count = kmgr.malloc(8)
            kp = KProbe(FUNCTION, pre_handler=count.atomic_assign(count + 1))
        probes.register_kprobe(kp)           # init_module: register_kprobe(&kp)
        with kmgr.oracle(kmgr.find_function(FUNCTION).address) as oracle:
            kmgr.run(iterations=iterations)
            expected = oracle.count
        seen = calls[0] if python else kmgr.read(count)
        probes.unregister_kprobe(kp)         # cleanup_module: unregister_kprobe(&kp)
        print(f"{FUNCTION}: {seen} calls (nhit {kp.nhit}, nmissed {kp.nmissed}; "
              f"oracle {oracle.name}: {expected})")
        if not (seen == kp.nhit == expected > 0):
            print("MISMATCH with the oracle", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
