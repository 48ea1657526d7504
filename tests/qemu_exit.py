"""Run a QEMU that exits by itself (a toy kernel booted to its end), for the tests."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_to_exit(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd``; return (exit status, serial output with \\n line ends).  The test
    fails if it has not exited within ``timeout`` seconds.  No QEMU outlives it."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"QEMU did not exit within {timeout} s; output:\n{out.decode(errors='replace')[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.decode(errors="replace").replace("\r\n", "\n")
