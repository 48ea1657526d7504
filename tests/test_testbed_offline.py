"""The testbed boots from a complete cache without package tools or network.

The steps before the boot (``testbed.prepare``: the kernel ABI, the host's needs,
the unpacked kernel, vmlinux, kerninst.ko, the guest's module list) run here with a
PATH that holds every tool of this host except apt, dpkg, modprobe/depmod, make and
gcc: any use of one of them fails, so a pass shows none was used.  QEMU is not
booted (the shared testbed may be running from the same cache); the initramfs is
written to a temporary file.  With an empty or partial cache the error names
what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ksim.live import testbed as tb

ROOT = Path(__file__).resolve().parents[1]
#: the tools a complete cache must not need: apt and dpkg (network, package state),
#: modprobe/depmod (module lists), and the compiler and make (building kerninst.ko)
FORBIDDEN = ("apt", "dpkg", "modprobe", "depmod", "kmod", "insmod", "make", "gcc", "cc",
             "c89", "c99", "x86_64-linux-gnu-gcc")


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + "-") or name.startswith("gcc-")
               or name.startswith("x86_64-linux-gnu-gcc") for f in FORBIDDEN)


@pytest.fixture(scope="module")
def bare_path(tmp_path_factory) -> str:
    """A directory of links to every program on this host's PATH but the forbidden ones."""
    bindir = tmp_path_factory.mktemp("bin")
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]:
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = bindir / entry.name
            if not _forbidden(entry.name) and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    for tool in ("apt-get", "apt-cache", "dpkg-query", "modprobe", "depmod", "make", "gcc"):
        assert shutil.which(tool, path=str(bindir)) is None
    return str(bindir)


def _ksim(args: list[str], path: str, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    if cache is not None:
        env["KSIM_TESTBED_DIR"] = str(cache)
    return subprocess.run([sys.executable, "-m", "ksim", *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def _complete_abi() -> str:
    abi = tb.recorded_abi()
    if abi is None:
        pytest.skip(f"no kernel in the testbed cache {tb.cache_dir()} (ksim testbed prepare fills it)")
    if not tb.module_cached(abi):
        pytest.skip(f"kerninst.ko is not built for {abi} from kmod/ as it is now (the next "
                    "`ksim testbed up` builds it)")
    gaps = tb.missing(abi)
    if gaps:
        pytest.skip(f"the testbed cache is not complete for {abi}: "
                    + "; ".join(n.what for n in gaps))
    return abi


def test_complete_cache_prepares_with_no_package_tool(bare_path, monkeypatch, tmp_path):
    abi = _complete_abi()
    # the command line, offline: nothing may be fetched
    proc = _ksim(["testbed", "prepare", "--offline", "--json"], bare_path)
    assert proc.returncode == 0, proc.stderr
    ready = json.loads(proc.stdout)
    assert ready["abi"] == abi
    assert Path(ready["module"]).name == "kerninst.ko"
    # and the functions `up` calls, not offline: they too find everything in the cache
    monkeypatch.setenv("PATH", bare_path)
    same = tb.prepare()
    assert same == ready
    mods = [Path(m) for m in same["guest_modules"]]
    assert {m.name for m in mods} >= {"virtio_pci.ko", "9pnet_virtio.ko", "9p.ko", "virtio_net.ko"}
    out = tb.make_initramfs(Path(same["kernel_root"]), abi, Path(same["module"]), 7070,
                            tmp_path / "initramfs.cpio")
    data = out.read_bytes()
    assert data.startswith(b"070701")
    listed = [m.name.encode() for m in mods]
    assert b"\n".join(listed) + b"\n" in data  # modules.list: the load order, as cached


def test_guest_modules_load_in_modprobes_order():
    """modules.dep read in Python gives what `modprobe --show-depends` gives (the oracle)."""
    abi = _complete_abi()
    modprobe = shutil.which("modprobe") or "/usr/sbin/modprobe"
    if not os.path.exists(modprobe):
        pytest.skip("modprobe (kmod) is not installed: nothing to compare with")
    root = tb.cache_dir() / f"linux-{abi}"
    out = subprocess.run([modprobe, "-d", str(root), "-S", f"{abi}-amd64", "--show-depends",
                          "-a", *tb.GUEST_MODULES], capture_output=True, text=True, check=True).stdout
    theirs: list[Path] = []
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] == ["insmod"] and Path(parts[1]) not in theirs:
            theirs.append(Path(parts[1]))
    assert tb.guest_modules(root, abi) == theirs


def test_empty_cache_offline_names_what_is_missing(bare_path, tmp_path):
    proc = _ksim(["testbed", "prepare", "--offline"], bare_path, tmp_path)
    assert proc.returncode != 0
    assert "offline, and no kernel is cached in " + str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr
    # not offline: apt would be asked, and this PATH has none
    proc = _ksim(["testbed", "prepare"], bare_path, tmp_path)
    assert proc.returncode != 0
    assert "apt-cache: not installed" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "debs").exists()


def test_partial_cache_names_the_build_tools(bare_path, tmp_path):
    """The kernel is cached, kerninst.ko is not: building it needs gcc and make, which
    this PATH lacks; offline, the error lists them (and nothing is built)."""
    abi = _complete_abi()
    (tmp_path / f"linux-{abi}").symlink_to(tb.cache_dir() / f"linux-{abi}")
    proc = _ksim(["testbed", "prepare", "--offline"], bare_path, tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"lacks what kernel {abi} needs" in proc.stderr
    assert "gcc, to build kerninst.ko" in proc.stderr and "make, to build kerninst.ko" in proc.stderr
    assert not (tmp_path / f"kmod-{abi}").exists()


def test_static_busybox_is_told_from_a_dynamic_program():
    assert not tb._is_static_elf(Path(os.path.realpath(sys.executable)))
    found = tb.busybox_path()
    if found is None:
        pytest.skip("busybox-static is not installed")
    assert tb._is_static_elf(found)


@pytest.mark.parametrize("argv,message", [
    (["up", "--port", "-1"], "argument --port: a port is a whole number from 1 to 65535"),
    (["up", "--port", "65536"], "argument --port: a port is a whole number from 1 to 65535"),
    (["up", "--port", "0x50"], "argument --port: a port is a whole number from 1 to 65535"),
    (["up", "--timeout", "nan"], "argument --timeout: a timeout is a number of seconds above 0"),
    (["up", "--timeout", "-5"], "argument --timeout: a timeout is a number of seconds above 0"),
    (["exec", "--timeout", "inf", "--", "true"], "argument --timeout: a timeout is a number"),
    (["exec", "--timeout", "0", "--", "true"], "argument --timeout: a timeout is a number"),
    (["exec"], "ksim testbed exec: no command"),
])
def test_impossible_arguments_are_refused_before_anything_is_started(capsys, argv, message):
    """Nothing boots and nothing is asked of a testbed: a usage error, as JSON under
    --json (exit status 2 either way)."""
    from ksim.cli import main

    with pytest.raises(SystemExit) as info:
        status = main(["testbed", *argv[:1], "--json", *argv[1:]])
        raise SystemExit(status)
    out = json.loads(capsys.readouterr().out)
    assert info.value.code == 2 and out["error"] == "usage" and message in out["message"]
