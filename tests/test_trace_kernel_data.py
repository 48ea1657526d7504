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
    for (i = 0; i < %(opens)d; i++) {
        int fd = open("%(mark)s", O_RDONLY | O_CREAT, 0600);
        if (fd < 0)
            return 1;
        close(fd);
    }
    for (i = 0; i < %(forks)d; i++) {
        pid_t p = fork();
        if (p == 0)
            _exit(0);
        waitpid(p, 0, 0);
    }
    unlink("%(mark)s");
    return 0;
}
""" % {"opens": OPENS, "forks": FORKS, "mark": MARK}

PROGRAM = r"""
kfunc:do_sys_openat2 /str(args->filename) == "%(mark)s"/ {
    @kfunc = count(); @how[args->how->flags & 0x40] = count();
}
tracepoint:syscalls:sys_enter_openat /str(args->filename) == "%(mark)s"/ {
    @enter[comm] = count(); @tid[tid] = 1;
}
tracepoint:syscalls:sys_exit_openat /@tid[tid]/ { @fds = count(); @neg = sum(args->ret < 0); }
tracepoint:sched:sched_process_fork /args->parent_comm == "ksimkdata"/ {
    @forks[args->parent_comm, args->parent_pid == pid] = count();
}
rawtracepoint:sched_process_fork /((struct task_struct *)arg0)->comm == "ksimkdata"/ {
    @raw = count();
}
""" % {"mark": MARK}


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
