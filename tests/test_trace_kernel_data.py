"""Kernel data in trace programs on the live testbed: kfunc arguments typed by the
kernel's BTF, tracepoints (a syscall's, a scheduler event's), raw tracepoints,
strings read from user and kernel memory, join() of an argv.

The oracle is the workload itself: a program the guest runs does a known number
of things with a marker only it uses (a path of its own, its own name), so each
count filtered by the marker is exact; the kernel's own kprobe on the function
(tracefs kprobe_profile) counts at least as many hits over a window that holds
ksim's."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.commands.trace import trace
from ksim.live.testing import connect, program, testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]

OPENS, FORKS = 37, 5
MARK = "/tmp/ksim-kdata-marker"

WORKLOAD = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
int main(void)
{
    int i;
    for (i = 0; i < OPENS; i++) {
        int fd = open("MARK", O_RDONLY | O_CREAT, 0600);
        if (fd < 0)
            return 1;
        close(fd);
    }
    for (i = 0; i < FORKS; i++) {
        pid_t p = fork();
        if (p == 0)
            _exit(0);
        waitpid(p, 0, 0);
    }
    unlink("MARK");
    return 0;
}
""".replace("OPENS", str(OPENS)).replace("FORKS", str(FORKS)).replace("MARK", MARK)

PROGRAM = r"""
kfunc:do_sys_openat2 /str(args->filename) == "MARK"/ {
    @kfunc = count(); @how[args->how->flags & 0x40] = count();
}
tracepoint:syscalls:sys_enter_openat /str(args->filename) == "MARK"/ {
    @enter[comm] = count(); @tid[tid] = 1;
}
tracepoint:syscalls:sys_exit_openat /@tid[tid]/ { @fds = count(); @neg = sum(args->ret < 0); }
tracepoint:sched:sched_process_fork /args->parent_comm == "ksimkdata"/ {
    @forks[args->parent_comm, args->parent_pid == pid] = count();
}
rawtracepoint:sched_process_fork /((struct task_struct *)arg0)->comm == "ksimkdata"/ {
    @raw = count();
}
""".replace("MARK", MARK)


def test_kernel_data_counts_exactly_what_the_workload_did(testbed) -> None:
    work = program("ksimkdata", WORKLOAD)
    t = connect(testbed)
    try:
        oracle = t.oracle_counter(t.lookup("do_sys_openat2"))
        try:
            report, _ = trace(PROGRAM, testbed["address"], while_cmd=str(work))
        finally:
            seen = oracle.count
            oracle.close()
    finally:
        t.close()
    maps = report["maps"]
    assert maps["@kfunc"] == OPENS and seen >= OPENS
    assert maps["@how"] == {str(0x40): OPENS}           # O_CREAT, through args->how->flags
    assert maps["@enter"] == {"ksimkdata": OPENS}
    # every exit of openat by the workload's thread: its opens (and the loader's)
    assert maps["@fds"] >= OPENS and maps["@neg"] == 0
    assert maps["@forks"] == {"ksimkdata,1": FORKS}
    assert maps["@raw"] == FORKS


def test_join_prints_an_argv_from_user_memory(testbed) -> None:
    report, text = trace('tracepoint:syscalls:sys_enter_execve /str(args->filename) == '
                         '"/bin/echo"/ { join(args->argv); }', testbed["address"],
                         while_cmd="/bin/echo ksim one two >/dev/null")
    assert "/bin/echo ksim one two\n" in report["printf"], report["printf"]


def test_kstack_is_the_chain_of_calls_that_reached_the_probe(testbed) -> None:
    """kstack at do_sys_openat2, over the workload's own opens: every stack starts in
    the probed function, and each further frame is a return address just after a
    call instruction -- a direct call to the frame before it, or an indirect one
    (the kernel's text, decoded here, is the oracle).  A function that reached the
    next by a tail call (a jump) has no frame of its own: the call then targets it,
    and it jumps to the frame before."""
    from ksim.kapi import Manager

    work = program("ksimkdata", WORKLOAD)
    report, _ = trace('kprobe:do_sys_openat2 /comm == "ksimkdata"/ { @[kstack] = count(); '
                      '@n = count(); }', testbed["address"], while_cmd=str(work))
    stacks = report["maps"]["@"]
    assert sum(stacks.values()) == report["maps"]["@n"] >= OPENS
    with Manager.attach(testbed["address"]) as m:
        image = m.target.image
        for text in stacks:
            frames = [line.strip() for line in text.strip().splitlines()]
            assert len(frames) >= 3 and frames[0].startswith("do_sys_openat2+"), text
            for callee, caller in zip(frames, frames[1:], strict=False):
                name, _, off = caller.rpartition("+")
                fn = image.function(name)
                ret = fn.address + int(off)
                # decoded from the function's start: instruction boundaries are known
                code = m.copy_from_kernel(fn.address, int(off))
                calls = [i for i in m.arch.decode(code, fn.address)
                         if i.address + i.size == ret and i.flow.name == "CALL"]
                assert calls, f"{caller} follows no call ({text})"
                target = calls[0].target
                if target is None:
                    continue
                called = image.function_at(target)
                wanted = image.function(callee.rpartition("+")[0])
                if called.address != wanted.address:
                    jumps = {i.target for i in m.arch.decode(image.code(called), called.address)
                             if i.flow.name == "JMP"}
                    assert wanted.address in jumps, f"{called.name} reaches no {wanted.name}"
