#!/usr/bin/env python3
"""count_func -- count the entries of a kernel function (the KernInst guide's count_func.C).

    python examples/count_func.py [TARGET] [MODULE] FUNCTION
    python examples/count_func.py unicorn:toy vmlinux tcp_sync_mss

The steps are the guide's: attach; find the module and the function's entry
point; allocate a counter and set it to zero; build the AST `counter += 1`;
insert it at the entry; then run the kernel, printing the counter every second.
"""

from __future__ import annotations

import sys
import time

from ksim.kapi import Manager


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 3:
        print(__doc__, file=sys.stderr)
        return 2
    target = argv[0] if len(argv) > 1 else "unicorn:toy"
    module = argv[1] if len(argv) > 2 else None
    func_name = argv[-1]

    # 1. attach to the kernel (here the toy kernel in unicorn; "live://HOST:PORT" for Linux)
    with Manager.attach(target) as kmgr:
        # 2. find the module and the function of interest, and its entry point
        func = kmgr.find_function(func_name)
        if module is not None and func.module != module:
            print(f"{func_name} is in module {func.module}, not {module}", file=sys.stderr)
            return 1
        entry = kmgr.entry_point(func)

        # 3. space for the counter, on the kernel's data heap, initialised to zero
        counter = kmgr.malloc(8)
        kmgr.write(counter, 0)

        # 4. the AST: counter = counter + 1, atomically (safe on SMP)
        increment = counter.atomic_assign(counter + 1)

        # 5. splice it in: from now on every entry runs it
        handle = kmgr.insert_snippet(entry, increment)
        print(f"counting {func_name} at {entry.address:#x} "
              f"({kmgr.patch_of(handle).tactic} splice)")

        # 6. the main loop: run the kernel, print the counter every second
        last = [time.monotonic()]

        def every_second() -> None:
            if time.monotonic() - last[0] >= 1.0:
                last[0] = time.monotonic()
                print(f"{func_name}: {kmgr.read(counter)}")

        kmgr.run(progress=every_second)
        print(f"{func_name}: {kmgr.read(counter)} entries in the workload")
        kmgr.remove_snippet(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
