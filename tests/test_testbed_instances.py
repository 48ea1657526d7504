"""Testbed instances: names, architectures, ports and files of their own (no guest booted).

A private KSIM_TESTBED_DIR keeps these away from the shared testbed's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ksim.errors import TargetError
from ksim.live import testbed as tb


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KSIM_TESTBED_DIR", str(tmp_path))
    return tmp_path


def test_the_default_instance_keeps_its_files_where_they_were(private_cache):
    inst = tb.resolve_instance()
    assert inst == tb.Instance("", "x86_64")
    assert inst.dir == private_cache
    assert tb._state_path(inst) == private_cache / "state.json"
    assert inst.default_port == 7070 and inst.qemu_name == "ksim-testbed"
    cmd = tb.qemu_command(private_cache / "vmlinux", private_cache / "initrd", 7070, "tcg", inst)
    assert cmd == tb.qemu_command(private_cache / "vmlinux", private_cache / "initrd", 7070, "tcg")
    assert f"file:{private_cache / 'console.log'}" in cmd
    assert f"unix:{private_cache / 'qmp.sock'},server=on,wait=off" in cmd


def test_arch_names_the_arm64_instance():
    assert tb.resolve_instance(None, "arm64") == tb.Instance("arm64", "arm64")
    assert tb.resolve_instance("arm64") == tb.Instance("arm64", "arm64")
    assert tb.resolve_instance(None, "aarch64") == tb.Instance("arm64", "arm64")
    assert tb.resolve_instance("arm64").default_port == 7071


def test_a_named_instance_has_files_and_a_qemu_name_of_its_own(private_cache):
    b = tb.resolve_instance("b")
    assert b == tb.Instance("b", "x86_64")
    assert b.dir == private_cache / "instances" / "b" and b.dir.is_dir()
    assert b.default_port is None and b.qemu_name == "ksim-testbed-b"
    cmd = tb.qemu_command(private_cache / "v", private_cache / "i", 7072, "tcg", b)
    assert cmd[cmd.index("-name") + 1] == "ksim-testbed-b"
    assert f"file:{b.dir / 'console.log'}" in cmd
    assert "user,id=n0,hostfwd=tcp:127.0.0.1:7072-:7072" in cmd


def test_a_named_instance_keeps_the_architecture_it_runs(private_cache):
    c = tb.resolve_instance("c", "arm64")
    tb._state_path(c).write_text(json.dumps({"pid": 0, "arch": "arm64"}))
    assert tb.resolve_instance("c") == tb.Instance("c", "arm64")


@pytest.mark.parametrize("name, arch, why", [
    ("", "arm64", "is x86_64, not arm64"),
    ("arm64", "x86_64", "is arm64, not x86_64"),
    ("B", None, "lower-case letters"),
    ("../x", None, "lower-case letters"),
    ("b", "sparc", "unknown testbed architecture 'sparc'"),
])
def test_refused_instances(name, arch, why):
    with pytest.raises(TargetError, match=why):
        tb.resolve_instance(name, arch)


def test_an_instance_not_up_is_reported_down_and_exec_names_it():
    assert tb.status("b") == {"up": False, "cache": str(tb.cache_dir()), "instance": "b",
                              "arch": "x86_64"}
    with pytest.raises(TargetError, match=r"testbed --name b is not up \(ksim testbed up --name b\)"):
        tb.exec_("true", instance="b")
    with pytest.raises(TargetError, match=r"--arch arm64 is not up"):
        tb.exec_("true", instance="arm64")
    assert tb.down(instance="b") == {"up": False, "stopped": False, "instance": "b"}


def _ksim(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ksim", "testbed", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ,
                                                      "KSIM_TESTBED_DIR": str(cache)})


def test_the_command_line_names_the_instance(private_cache):
    proc = _ksim("status", "--name", "b", "--json", cache=private_cache)
    assert proc.returncode == 1 and json.loads(proc.stdout)["instance"] == "b"
    proc = _ksim("status", "--arch", "arm64", "--json", cache=private_cache)
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {"up": False, "cache": str(private_cache),
                                       "instance": "arm64", "arch": "arm64"}
    proc = _ksim("exec", "--arch", "arm64", "--", "true", cache=private_cache)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "the testbed --arch arm64 is not up (ksim testbed up --arch arm64)" in proc.stderr
    proc = _ksim("down", "--name", "b", cache=private_cache)
    assert proc.returncode == 0 and proc.stdout == "was not running\n"
    proc = _ksim("up", "--arch", "arm64", "--accel", "kvm", cache=private_cache)
    assert proc.returncode != 0 and "runs under TCG only" in proc.stderr
    proc = _ksim("status", "--all", "--json", cache=private_cache)
    assert proc.returncode == 0 and json.loads(proc.stdout) == []
