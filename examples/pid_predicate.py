#!/usr/bin/env python3
"""pid_predicate -- count a function's entries by the listed processes only
(the KernInst guide's pid_predicate.C, section 6.3).

    python examples/pid_predicate.py [TARGET] FUNCTION PID [PID...]
    python examples/pid_predicate.py unicorn:toy do_syscall_64 2 4

As count_func, but the increment is predicated on the current pid:
`if (pid == p0 || pid == p1 || ...) counter += 1`.  On unicorn the count is
checked against an oracle: an address hook at the entry that reads the current
task's pid from kernel memory (current_task->pid).
"""

from __future__ import annotations

import sys

from ksim.kapi import Manager
from ksim.snippets import if_, lor, pid


def main(argv: list[str]) -> int:
    if argv and ":" not in argv[0]:
        argv = ["unicorn:toy", *argv]
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    target, func_name, pids = argv[0], argv[1], [int(p) for p in argv[2:]]
    with Manager.attach(target) as kmgr:
        entry = kmgr.entry_point(func_name)
        counter = kmgr.malloc(8)
        # the guide's check_pids: pid == p0 || pid == p1 || ...
        check_pids = pid() == pids[0]
        for p in pids[1:]:
            check_pids = lor(check_pids, pid() == p)
        handle = kmgr.insert_snippet(entry, if_(check_pids, counter.atomic_assign(counter + 1)))

        machine = getattr(kmgr.target, "machine", None)
        oracle = {"by_pid": {}}
        remove = None
        if machine is not None and hasattr(machine, "hook_code"):
            abi = kmgr.target.abi

            def hook(mach: object, _a: int) -> None:
                task = mach.read_u64(abi.current_task.address)  # type: ignore[attr-defined]
                p = int.from_bytes(mach.read(task + abi.task_pid_offset, abi.task_pid_size),  # type: ignore[attr-defined]
                                   "little", signed=True)
                oracle["by_pid"][p] = oracle["by_pid"].get(p, 0) + 1

            remove = machine.hook_code(entry.address, hook)
        iterations = 500
        kmgr.run(iterations=iterations)
        counted = kmgr.read(counter)
        kmgr.remove_snippet(handle)
        print(f"{func_name}: {counted} entries by pids {pids}")
        if remove is not None:
            remove()
            by_pid = oracle["by_pid"]
            expected = sum(by_pid.get(p, 0) for p in pids)
            print(f"oracle (address hook reading current->pid): {expected} "
                  f"of {sum(by_pid.values())}; per pid {dict(sorted(by_pid.items()))}")
            if counted != expected or expected == sum(by_pid.values()):
                print("MISMATCH with the oracle (or the predicate excluded nothing)",
                      file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
