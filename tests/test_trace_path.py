"""path() and ustack in trace programs.

path(p [, size]) calls the kernel's own d_path from the snippet, only where the
kernel lets bpf_d_path run (kfunc and kretfunc probes of btf_allowlist_d_path's
functions).  On the live testbed the oracles are the workload itself (a static
program that closes files of known names, a path longer than max_strlen among
them, and a pipe whose inode number it writes down) and bpftrace 0.17 running
the same program over the same workload in the guest.  Offline (unicorn:toy,
which has no d_path) and on the testbed: the refusals, each where the program
says it.  ustack stays refused, saying why."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import hashlib
import shlex

import pytest

from ksim.cli import main
from ksim.commands.trace import trace
from ksim.live.testing import connect, program, testbed  # noqa: F401

DIR = "/tmp/ksimpath"
LONG_DIR = f"{DIR}/0123456789abcdef0123456789abcdef"
LONG = f"{LONG_DIR}/0123456789abcdef0123456789abcdef/file"
SHORT = f"{DIR}/short"
INO = f"{DIR}/pipe-ino"
ROUNDS = 5

WORKLOAD = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
int main(void)
{
    struct stat st;
    int i, fd, p[2];
    FILE *f;
    mkdir("DIR", 0700);
    mkdir("LONG_DIR", 0700);
    mkdir("LONG_DIR/0123456789abcdef0123456789abcdef", 0700);
    for (i = 0; i < ROUNDS; i++) {
        fd = open("SHORT", O_RDONLY | O_CREAT, 0600);
        if (fd < 0)
            return 1;
        close(fd);
        fd = open("LONG", O_RDONLY | O_CREAT, 0600);
        if (fd < 0)
            return 1;
        close(fd);
    }
    if (pipe(p) || fstat(p[0], &st))
        return 1;
    f = fopen("INO", "w");
    if (!f)
        return 1;
    fprintf(f, "%lu\n", (unsigned long)st.st_ino);
    fclose(f);
    close(p[0]);
    close(p[1]);
    return 0;
}
""".replace("LONG_DIR", LONG_DIR).replace("SHORT", SHORT).replace("LONG", LONG) \
    .replace("INO", INO).replace("ROUNDS", str(ROUNDS)).replace("DIR", DIR)


MQ_WORKLOAD = r"""
#include <fcntl.h>
#include <mqueue.h>
int main(void)
{
    int i;
    for (i = 0; i < ROUNDS; i++) {
        mqd_t q = mq_open("/ksimq", O_CREAT | O_RDWR, 0600, 0);
        if (q == (mqd_t)-1)
            return 1;
        mq_close(q);
    }
    mq_unlink("/ksimq");
    return 0;
}
""".replace("ROUNDS", str(ROUNDS))


def build(name: str, source: str) -> tuple[str, str]:
    """(the workload's comm, its path in the guest): named after its source, as the
    guest's 9p mount (cache=loose) may keep serving an older binary of the same name."""
    comm = name + hashlib.sha256(source.encode()).hexdigest()[:6]
    return comm, str(program(comm, source))


def d_path(name: str, buflen: int, dname: bool = False) -> str:
    """What d_path leaves for bpftrace to print, from the name alone: the name when it
    fits with its NUL; else (-ENAMETOOLONG) the buffer prepend() filled with the
    name's tail, or nothing at all for a name a d_dname makes (dynamic_dname(),
    fs/d_path.c)."""
    if len(name) + 1 <= buflen:
        return name
    return "" if dname else name[len(name) - (buflen - 1):]


def closes(ino: int) -> list[str]:
    """The names of the files the workload closes, in its order."""
    return [SHORT, LONG] * ROUNDS + [INO] + [f"pipe:[{ino}]"] * 2


# --- refused where the kernel would not run d_path ----------------------------------------
@pytest.mark.parametrize("source, message, span", [
    ('kfunc:filp_close { printf("%s\\n", path(args->f)); }',
     "path() calls the kernel's d_path, and this kernel has no such function", "1:35-39"),
    ('kprobe:filp_close { printf("%s\\n", path(arg0)); }',
     "function path() is not supported in kprobe probes: only in kfunc and kretfunc probes",
     "1:36-40"),
    ('kfunc:vfs_read { @[path(args->f)] = count(); }',
     "the kernel lets d_path run only in probes of security_file_permission", "1:20-24"),
    ('BEGIN { printf("%s\\n", path(0)); }',
     "function path() is not supported in BEGIN probes", "1:24-28"),
])
def test_path_is_refused_where_the_kernel_would_not_run_d_path(capsys, toy_path, source,
                                                               message, span):
    assert main(["trace", "-e", source]) == 2
    err = capsys.readouterr().err
    assert message in err and f"stdin:{span}:" in err, err


@pytest.mark.parametrize("source, span", [
    ("kprobe:vfs_read { @[ustack] = count(); }", "21-27"),
    ("kprobe:vfs_read { @[ustack(perf, 3)] = count(); }", "21-36"),
])
def test_ustack_is_refused_on_the_toy_which_has_no_user_space(capsys, toy_path, source, span):
    assert main(["trace", "-e", source]) == 2
    err = capsys.readouterr().err
    assert (f"stdin:1:{span}: ERROR: ustack is not supported on this kernel: an emulated "
            "kernel runs no user space: no task has a user stack to walk") in err, err


# --- on the live kernel (the testbed) -------------------------------------------------------
def guest_pipe_ino(tb: dict) -> int:
    t = connect(tb)
    try:
        return int(t.exec_checked(f"cat {INO}"))
    finally:
        t.close()


@pytest.mark.live
def test_path_prints_what_the_workload_closed_and_what_bpftrace_prints(testbed):
    """kfunc:filp_close: path() of each file the workload closes is its name, a name
    longer than max_strlen its tail, a pipe's pipe:[INODE]; with a size, the tail
    d_path leaves in that many bytes (nothing for a pipe's name that does not fit).
    bpftrace 0.17 prints the same lines for path() over the same workload."""
    comm, work = build("ksimpath", WORKLOAD)
    report, _ = trace(f'kfunc:filp_close /comm == "{comm}"/ {{ printf("%s|%s|%s\\n", '
                      'path(args->filp->f_path), path(args->filp->f_path, 16), '
                      'path(args->filp->f_path, 4)); }', testbed["address"], while_cmd=work)
    names = closes(guest_pipe_ino(testbed))
    ours = [line.rstrip("\n").split("|") for line in report["printf"]][:len(names)]
    assert ours == [[d_path(n, 64), d_path(n, 16, n.startswith("pipe:")),
                     d_path(n, 4, n.startswith("pipe:"))] for n in names]
    assert ours[1][0] == LONG[-63:] and len(LONG) > 64     # the tail, as d_path leaves it

    prog = f'kfunc:filp_close /comm == "{comm}"/ {{ printf("%s\\n", path(args->filp->f_path)); }}'
    theirs = bpftrace_lines(testbed, prog, work, len(names))
    assert theirs == [d_path(n, 64) for n in closes(guest_pipe_ino(testbed))]


def bpftrace_lines(tb: dict, prog: str, work: str, n: int) -> list[str]:
    """The first ``n`` lines bpftrace prints running ``prog`` over ``work`` in the guest."""
    t = connect(tb)
    try:
        out = t.exec_checked(f"timeout 300 bpftrace -e {shlex.quote(prog)} -c {work}", timeout=400)
    finally:
        t.close()
    lines = out.splitlines()
    return lines[lines.index("Attaching 1 probe...") + 1:][:n]


@pytest.mark.live
def test_path_of_a_kretfunc_s_return_value(testbed):
    """kretfunc:dentry_open: path(retval->f_path) of the file each mq_open(3) of the
    workload opens (do_mq_open calls dentry_open on the queue's mqueue inode): the
    queue's name in its internal mount, once per call, as bpftrace prints it."""
    comm, work = build("ksimmq", MQ_WORKLOAD)
    prog = (f'kretfunc:dentry_open /comm == "{comm}"/ '
            '{ printf("%s\\n", path(retval->f_path)); }')
    report, _ = trace(prog, testbed["address"], while_cmd=work)
    assert report["printf"] == ["/ksimq\n"] * ROUNDS
    assert bpftrace_lines(testbed, prog, work, ROUNDS + 1) == ["/ksimq"] * ROUNDS + [""]


@pytest.mark.live
def test_path_of_a_pointer_argument_in_an_allowed_function(testbed):
    """kfunc:security_inode_getattr's const struct path *: stat(1) of a file names it."""
    report, _ = trace('kfunc:security_inode_getattr /comm == "stat"/ '
                      '{ @[path(args->path)] = count(); }', testbed["address"],
                      while_cmd="stat /etc/hostname /proc/version >/dev/null")
    seen = report["maps"]["@"]
    assert seen.get("/etc/hostname", 0) >= 1 and seen.get("/proc/version", 0) >= 1, seen


@pytest.mark.live
@pytest.mark.parametrize("source, message, span", [
    ('kfunc:vfs_open { printf("%s\\n", path(args->path)); }',
     "the kernel lets d_path run only in probes of", "1:33-37"),
    ('kfunc:filp_close { printf("%s\\n", path((struct path *)args->filp)); }',
     "path() takes a struct path that the probed function's arguments", "1:40-65"),
    ('kfunc:filp_close { printf("%s\\n", path(args->filp)); }',
     "path() takes a struct path or a pointer to one (struct file * given)", "1:40-50"),
    ('kfunc:filp_close { $f = args->filp; printf("%s\\n", path($f->f_path)); }',
     "path() takes a struct path that the probed function's arguments", "1:57-67"),
])
def test_path_refusals_on_the_live_kernel(capsys, testbed, source, message, span):
    """Refused before anything is spliced, where the program says it; bpftrace (the
    kernel's verifier) refuses path() in vfs_open too.  A struct path reached through
    a variable is refused too, though bpftrace takes it: ksim does not follow where a
    variable's pointer came from."""
    assert main(["trace", "--target", testbed["address"], "-e", source]) == 2
    err = capsys.readouterr().err
    assert message in err and f"stdin:{span}:" in err, err
    if "vfs_open" in source:
        t = connect(testbed)
        try:
            out = t.exec(f"timeout 120 bpftrace -e {shlex.quote(source)} 2>&1; echo rc=$?", 200)
        finally:
            t.close()
        assert "helper bpf_d_path not supported in probe" in out and "rc=0" not in out, out
