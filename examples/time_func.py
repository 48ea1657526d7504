#!/usr/bin/env python3
"""time_func -- time a kernel function with a virtual and a wall timer
(the KernInst guide's time_func.C, section 6.2).

    python examples/time_func.py [TARGET] FUNCTION [ITERATIONS]
    python examples/time_func.py unicorn:toy context_switch
    python examples/time_func.py unicorn:toy-arm64 do_syscall_64   # its invoke_syscall

Initialises the timer environment (context-switch code), adds a virtual and a
wall cycle timer with start code at the function's entry and stop code at its
exits, samples both while the kernel runs, and prints the totals.  It checks
what can be checked of cycle counts against an oracle: every entry (counted by
an address hook on unicorn) started the timer, each start was stopped or is
still in flight, and virtual time never exceeds wall time.  The function is named
as on the x86 toy; an image that calls it otherwise is asked for its own name
(ksim.images: ImageSpec.local_name).
"""

from __future__ import annotations

import sys

from ksim import images
from ksim.errors import UnknownImage
from ksim.kapi import Manager
from ksim.timers import VTimers, default_sample_callback


def main(argv: list[str]) -> int:
    if argv and ":" not in argv[0]:
        argv = ["unicorn:toy", *argv]
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    target, func = argv[0], argv[1]
    try:
        func = images.get(target.partition(":")[2]).local_name(func)
    except UnknownImage:
        pass                                    # not a registered image: its own names
    iterations = int(argv[2]) if len(argv) > 2 else 500
    with Manager.attach(target) as kmgr:
        vt = VTimers(kmgr)                      # initialize_vtimer_environment
        start, stops = [kmgr.entry_point(func)], kmgr.exit_points(func)
        virt = vt.add_vtimer(start, stops, is_wall=False, sample=default_sample_callback,
                             interval=0.25)
        wall = vt.add_vtimer(start, stops, is_wall=True)
        with kmgr.oracle(start[0].address) as oracle:
            vt.sampler.run(iterations=iterations)
            entries = oracle.count
        v, w = virt.read(), wall.read()
        print(f"{func}: {v.starts} starts, {v.stops} stops, {v.in_flight} in flight; "
              f"virtual {v.vtime} cycles, wall {w.wall_time} cycles "
              f"({v.switches_out} switches out); oracle {oracle.name}: {entries} entries")
        vt.cleanup()                            # cleanup_vtimer_environment
        ok = (v.starts == entries > 0 and v.starts == v.stops + v.in_flight
              and v.vtime <= v.wall_time and w.vtime <= w.wall_time and not v.overflow)
        if not ok:
            print("MISMATCH with the oracle", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
