"""The KernInst and Kprobes example programs run on unicorn:toy (and those built
on components -- timers, replacement -- and callee watching on unicorn:toy-arm64
and qemu:toy-arm64 too); each checks its own result against an oracle (address
hooks, gdbstub breakpoints, workload bookkeeping) and exits non-zero on a
mismatch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("extra", [[], ["--python"]])
def test_kprobe_count(toy_path, extra):
    assert "oracle" in run_example("kprobe_count.py", "unicorn:toy", "300", *extra)


@pytest.mark.parametrize("extra", [[], ["--python"]])
def test_jprobe_args(toy_path, extra):
    assert "dev 2:" in run_example("jprobe_args.py", "unicorn:toy", "300", *extra)


def test_pid_predicate(toy_path):
    out = run_example("pid_predicate.py", "unicorn:toy", "do_syscall_64", "2", "4")
    assert "oracle" in out


@pytest.mark.parametrize("func", ["context_switch", "fib"])
def test_time_func(toy_path, func):
    assert "virtual" in run_example("time_func.py", "unicorn:toy", func, "300")


def test_replace_function(toy_path):
    assert "undone" in run_example("replace_function.py", "unicorn:toy", "300")


def test_replace_function_call(toy_path):
    assert "undone" in run_example("replace_function_call.py", "unicorn:toy", "300")


def test_watch_callees(toy_path):
    out = run_example("watch_callees.py", "unicorn:toy", "do_syscall_64", "vfs_read", "--iterations", "60")
    assert "__x64_sys_read" in out and "ramfs_file_read" in out and "oracle" in out


def test_count_func_counts_what_the_oracle_counts(toy_path):
    import re

    from ksim.kapi import Manager

    out = run_example("count_func.py", "unicorn:toy", "vmlinux", "tcp_sync_mss")
    counted = int(re.search(r"tcp_sync_mss: (\d+) entries", out).group(1))
    with Manager.attach("unicorn:toy") as m:
        with m.oracle(m.find_function("tcp_sync_mss").address) as oracle:
            m.run()
            assert counted == oracle.count > 0


# --- the component examples on the arm64 toy (components built with aarch64-linux-gnu-gcc) --
def _arm64(target: str, *marks):
    import shutil

    binary = "qemu-system-aarch64" if target.startswith("qemu:") else "aarch64-linux-gnu-gcc"
    return pytest.param(target, id=target, marks=[*marks, pytest.mark.skipif(
        shutil.which(binary) is None or shutil.which("aarch64-linux-gnu-gcc") is None,
        reason="needs gcc-aarch64-linux-gnu (and qemu-system-arm for QEMU)")])


ARM64_TARGETS = [_arm64("unicorn:toy-arm64"), _arm64("qemu:toy-arm64", pytest.mark.slow)]


@pytest.mark.parametrize("target", ARM64_TARGETS)
@pytest.mark.parametrize("example,args,expect", [
    ("time_func.py", ("context_switch", "300"), "switches out"),
    ("time_func.py", ("do_syscall_64", "300"), "invoke_syscall:"),
    ("replace_function.py", ("300",), "undone"),
    ("replace_function_call.py", ("300",), "undone"),
    ("watch_callees.py", ("--iterations", "60"), "__arm64_sys_read"),
])
def test_component_examples_on_the_arm64_toy(target, example, args, expect):
    assert expect in run_example(example, target, *args)
