"""The arm64 testbed (`ksim testbed up --arch arm64`): Debian's arm64 kernel of the x86
testbed's ABI in qemu-system-aarch64, kerninstd running on Debian's arm64 Python.

One guest per session (ksim.live.testing.testbed_arm64; about 6 s to boot under TCG
once the cache is filled).  While kmod/ does not build for arm64 the guest runs the
stand-in module (tests/kmod_arm64_standin) and test_kerninst_builds_for_arm64 is an
expected failure naming the compiler's errors and the build log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ksim.errors import TargetError
from ksim.live import arm64bed, testing
from ksim.live import testbed as tb
from ksim.live.client import Connection
from ksim.live.testing import getppid_loop

pytestmark = [pytest.mark.live, pytest.mark.slow]
testbed_arm64 = testing.testbed_arm64  # the session's arm64 guest (a fixture)
ROOT = Path(__file__).resolve().parents[1]


def _ksim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ksim", "testbed", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=os.environ.copy())


def test_status_prints_its_address(testbed_arm64):
    proc = _ksim("status", "--arch", "arm64", "--json")
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert state["up"] and state["arch"] == "arm64" and state["instance"] == "arm64"
    assert state["address"] == f"live://127.0.0.1:{testbed_arm64['port']}"
    assert state["abi"] == tb.recorded_abi()  # the x86 testbed's kernel ABI
    assert state["accel"] == "tcg"


def test_exec_runs_in_an_aarch64_guest_of_that_kernel(testbed_arm64):
    proc = _ksim("exec", "--arch", "arm64", "--", "uname -m; uname -r")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["aarch64", f"{testbed_arm64['abi']}-arm64"]
    # the exit status and standard error come back as they are
    proc = _ksim("exec", "--arch", "arm64", "--", "echo oops >&2; exit 3")
    assert proc.returncode == 3 and proc.stderr == "oops\n"


def test_kerninstd_answers_from_the_arm64_kernel(testbed_arm64):
    with Connection("127.0.0.1", int(testbed_arm64["port"]),
                    token_file=testbed_arm64["token_file"], timeout=30) as conn:
        info = conn.request("info")
        assert info["kernel"] == f"{testbed_arm64['abi']}-arm64"
        assert info["allow_exec"] is True
        # kerninstd itself is Debian's arm64 Python running this checkout's code
        out = conn.request("exec", cmd="cat /proc/$PPID/cmdline | tr '\\0' ' '; echo; "
                           "python3.11 -c 'import platform, sys; print(platform.machine(), "
                           "sys.version_info[:2])'", timeout=60.0, reply_timeout=90.0)
    assert out["rc"] == 0, out["stderr"]
    cmdline, machine = out["stdout"].splitlines()
    assert cmdline.startswith(f"{arm64bed.PYTHON} -m ksim.live.daemon --listen 0.0.0.0:")
    assert machine == "aarch64 (3, 11)"


def test_the_cpu_has_pointer_authentication_and_bti(testbed_arm64):
    """-cpu max: the kernel's paciasp/autiasp really sign and check (not NOPs)."""
    out = tb.exec_("grep -m1 Features /proc/cpuinfo; dmesg | grep 'CPU features: detected'",
                   instance="arm64")
    lines = out["stdout"].splitlines()
    assert {"paca", "pacg", "bti"} <= set(lines[0].split(":", 1)[1].split())
    # the kernel turned them on for itself (QEMU's cheap pauth-impdef algorithm)
    detected = "\n".join(lines[1:])
    assert "Address authentication (IMP DEF algorithm)" in detected
    assert "Branch Target Identification" in detected


def test_a_host_program_cross_built_runs_in_the_guest(testbed_arm64):
    """Test programs for the arm64 guest are cross-built static, in the cache it shares."""
    loop = getppid_loop("arm64")
    out = tb.exec_(f"{loop} 1000", instance="arm64")
    assert out["rc"] == 0 and out["stdout"] == "1000\n", out


def test_the_default_testbed_is_another_instance(testbed_arm64):
    assert testbed_arm64["port"] != tb.DEFAULT_PORT
    assert Path(testbed_arm64["console"]).parent == tb.cache_dir() / "instances" / "arm64"
    x86 = tb.status()
    if x86["up"]:  # both run at once, each its own kernel
        assert x86["kernel"].endswith("-amd64") and x86["pid"] != testbed_arm64["pid"]


def test_kerninst_loads_in_the_guest(testbed_arm64):
    """kmod/'s kerninst.ko, not the stand-in, is what kerninstd drives."""
    if testbed_arm64["standin"]:
        pytest.xfail(f"the arm64 testbed runs the stand-in: {testbed_arm64['standin']}")
    out = tb.exec_("grep '^kerninst ' /proc/modules; ls -l /dev/kerninst", instance="arm64")
    assert out["rc"] == 0 and out["stdout"].startswith("kerninst "), out


def test_kerninst_builds_for_arm64(testbed_arm64):
    abi = testbed_arm64["abi"]
    try:
        ko = arm64bed.build_module(abi)
    except TargetError as exc:
        assert "the build log: " in str(exc) and Path(str(exc).rsplit(": ", 1)[1]).exists()
        pytest.xfail(f"kmod/ does not build for arm64 yet: {exc}")
    head = ko.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64


def test_bpftrace_runs_in_a_guest_whose_userland_has_it():
    """`up --arch arm64 --with bpftrace`: Debian's arm64 bpftrace and its libraries in
    the userland (a guest of its own, with the stand-in module: bpftrace needs none),
    its kprobe counting a cross-built program's getppid calls exactly."""
    loop = getppid_loop("arm64")
    with testing.instance_testbed("arm64-bpftrace", arch="arm64", tools=("bpftrace",),
                                  module_sources=arm64bed.module_dir_sources(
                                      arm64bed.STANDIN)) as state:
        assert state["tools"] == ["bpftrace"]
        out = tb.exec_(
            "bpftrace -e 'kprobe:__arm64_sys_getppid { @n = count(); } "
            "interval:s:15 { exit(); }' > /tmp/bt.out 2>&1 & "
            "until grep -q Attaching /tmp/bt.out; do sleep 0.5; done; sleep 1; "
            f"{loop} 2000; wait; cat /tmp/bt.out", timeout=120, instance="arm64-bpftrace")
    assert out["rc"] == 0, out
    assert "@n: 2000" in out["stdout"].split("2000\n", 1)[1], out["stdout"]
    # down stopped that guest and no other
    assert not tb._pid_is_qemu(int(state["pid"]))
    assert not tb.status("arm64-bpftrace")["up"] and tb.status("arm64")["up"]
