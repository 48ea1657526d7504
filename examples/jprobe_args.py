#!/usr/bin/env python3
"""jprobe_args -- bios and sectors per device (the Red Hat article's jprobebio.c).

    python examples/jprobe_args.py [TARGET] [--python]

jprobebio's entry handler gets generic_make_request's `struct bio *` and
accumulates, per device, the number of bios and of sectors (bi_size / 512).  The
toy kernel's submit_bio(struct bio *) carries bi_size at offset 8 and bi_dev at
offset 12; the snippet handler loads them through arg(0) and adds to one
counter pair per device (devices 0..2).  With --python the entry handler is a
Python function called with the argument (emulators only).  Checked against an
oracle: an address hook at submit_bio that reads the bio from the registers.
"""

from __future__ import annotations

import sys

from ksim.kapi import Manager
from ksim.probes import JProbe, Probes
from ksim.snippets import arg, if_, load, lshr, seq

FUNCTION = "submit_bio"
NDEV = 3
BI_SIZE, BI_DEV = 8, 12   # offsetof(struct bio, bi_size / bi_dev), images/toy/include/toy.h
SECTOR_SHIFT = 9


def main(argv: list[str]) -> int:
    python = "--python" in argv
    args = [a for a in argv if a != "--python"]
    target = args[0] if args else "unicorn:toy"
    iterations = int(args[1]) if len(args) > 1 else 500
    with Manager.attach(target) as kmgr:
        probes = Probes(kmgr)
        bios = [kmgr.malloc(8) for _ in range(NDEV)]
        sectors = [kmgr.malloc(8) for _ in range(NDEV)]
        if python:
            per_dev = {d: [0, 0] for d in range(NDEV)}

            def entry(bio: int) -> None:
                dev = kmgr.target.read(bio + BI_DEV, 4)
                size = int.from_bytes(kmgr.target.read(bio + BI_SIZE, 4), "little")
                d = int.from_bytes(dev, "little", signed=True)
                if d in per_dev:
                    per_dev[d][0] += 1
                    per_dev[d][1] += size >> SECTOR_SHIFT

            jp = JProbe(FUNCTION, entry=entry, nargs=1)
        else:
            dev = load(arg(0) + BI_DEV, 4)
            size = load(arg(0) + BI_SIZE, 4)
            jp = JProbe(FUNCTION, entry=seq(*(
                if_(dev == d, seq(bios[d].atomic_assign(bios[d] + 1),
                                  sectors[d].atomic_assign(sectors[d] + lshr(size, SECTOR_SHIFT))))
                for d in range(NDEV))))
        probes.register_jprobe(jp)

        # the oracle: read the same bio from the registers at an address hook
        want = {d: [0, 0] for d in range(NDEV)}
        machine = getattr(kmgr.target, "machine", None)
        remove = None
        if machine is not None and hasattr(machine, "hook_code"):
            def hook(mach: object, _a: int) -> None:
                bio = mach.reg("rdi")  # type: ignore[attr-defined]
                d = int.from_bytes(mach.read(bio + BI_DEV, 4), "little", signed=True)  # type: ignore[attr-defined]
                if d in want:
                    want[d][0] += 1
                    want[d][1] += int.from_bytes(mach.read(bio + BI_SIZE, 4), "little") >> SECTOR_SHIFT  # type: ignore[attr-defined]

            remove = machine.hook_code(kmgr.find_function(FUNCTION).address, hook)
        kmgr.run(iterations=iterations)
        if remove is not None:
            remove()
        got = per_dev if python else {d: [kmgr.read(bios[d]), kmgr.read(sectors[d])] for d in range(NDEV)}
        probes.unregister_jprobe(jp)
        for d in range(NDEV):
            print(f"dev {d}: {got[d][0]} bios, {got[d][1]} sectors")
        if remove is not None:
            print(f"oracle (address hook): {want}")
            if got != want or not any(b for b, _ in got.values()):
                print("MISMATCH with the oracle", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
