"""The arm64 testbed's preparation without booting it (ksim.live.arm64bed).

QEMU's command line, the usr-merge of the unpacked userland, the paths the guest
shares, the module sources, and -- when the testbed cache holds them -- that the
cached arm64 userland has every extension module `import ksim.live.daemon` loads and
that a complete cache prepares with no package tool, compiler or network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ksim.errors import TargetError
from ksim.live import arm64bed
from ksim.live import testbed as tb

ROOT = Path(__file__).resolve().parents[1]


def test_qemu_boots_the_image_on_virt_with_a_pac_and_bti_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KSIM_TESTBED_DIR", str(tmp_path))
    inst = tb.resolve_instance(None, "arm64")
    ready = {"vmlinux": "/cache/arm64/linux/boot/vmlinuz-6.1.0-56-arm64"}
    cmd = arm64bed.qemu_command(ready, tmp_path / "initrd", 7071, inst)
    assert cmd[0] == "qemu-system-aarch64"
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert cmd[cmd.index("-M") + 1] == "virt" and cmd[cmd.index("-cpu") + 1] == "max,pauth-impdef=on"
    assert cmd[cmd.index("-kernel") + 1] == ready["vmlinux"]
    assert cmd[cmd.index("-name") + 1] == "ksim-testbed-arm64"
    assert "console=ttyAMA0" in opts.get("-append", cmd[cmd.index("-append") + 1])
    assert cmd[cmd.index("-accel") + 1] == "tcg,thread=single"
    assert f"file:{tmp_path / 'instances' / 'arm64' / 'console.log'}" in cmd
    assert "user,id=n0,hostfwd=tcp:127.0.0.1:7071-:7071" in cmd
    assert "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot" in cmd


def test_the_userland_is_usr_merged(tmp_path):
    (tmp_path / "lib" / "aarch64-linux-gnu").mkdir(parents=True)
    (tmp_path / "lib" / "aarch64-linux-gnu" / "libc.so.6").write_text("c")
    (tmp_path / "lib" / "ld-linux-aarch64.so.1").symlink_to("aarch64-linux-gnu/ld-2.36.so")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "busybox").write_text("b")
    (tmp_path / "usr" / "lib" / "python3.11").mkdir(parents=True)
    arm64bed._merge_usr(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usr"]
    assert (tmp_path / "usr" / "lib" / "aarch64-linux-gnu" / "libc.so.6").read_text() == "c"
    assert os.readlink(tmp_path / "usr" / "lib" / "ld-linux-aarch64.so.1") == \
        "aarch64-linux-gnu/ld-2.36.so"  # relative links keep pointing where they did
    assert (tmp_path / "usr" / "bin" / "busybox").exists()
    assert (tmp_path / "usr" / "lib" / "python3.11").is_dir()


def test_the_guest_shares_the_checkout_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KSIM_TESTBED_DIR", str(tmp_path))
    assert arm64bed.shared_paths() == sorted([str(tb.REPO), str(tmp_path)])
    inside = tb.REPO / ".cache-for-test"
    monkeypatch.setenv("KSIM_TESTBED_DIR", str(inside))
    try:
        assert arm64bed.shared_paths() == [str(tb.REPO)]  # the outer one is enough
    finally:
        inside.rmdir()


def test_module_sources_of_a_directory():
    files = arm64bed.module_dir_sources(arm64bed.STANDIN)
    assert [f.name for f in files] == ["Makefile", "kerninst.c", "kerninst.h"]
    assert files[-1] == tb.REPO / "kmod" / "kerninst.h"  # the ABI, from kmod/
    with pytest.raises(TargetError, match="no such directory"):
        arm64bed.module_dir_sources(ROOT / "no-such-dir")
    with pytest.raises(TargetError, match="no kbuild Makefile"):
        arm64bed.module_dir_sources(ROOT / "ksim")


def test_an_image_without_the_arm64_magic_is_refused(tmp_path):
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "vmlinuz-6.1.0-56-arm64").write_bytes(b"MZ" + bytes(100))
    with pytest.raises(TargetError, match="not an arm64 kernel Image"):
        arm64bed.kernel_image(tmp_path, "6.1.0-56")


@pytest.fixture(scope="module")
def arm64_cache() -> None:
    """The arm64 testbed's cache, filled when a new machine has none yet (as `ksim
    testbed prepare --arch arm64 --kmod tests/kmod_arm64_standin` fills it: the kernel,
    the userland, the stand-in module these tests build against); skipped only where
    no package registry answers."""
    from ksim.errors import KsimError

    try:
        tb.prepare(arch="arm64", module_sources=arm64bed.module_dir_sources(arm64bed.STANDIN),
                   progress=lambda m: print(f"testbed arm64: {m}", flush=True))
    except KsimError as exc:
        pytest.skip(f"the arm64 testbed's cache cannot be filled: {exc}")


@pytest.mark.usefixtures("arm64_cache")
def test_kerninstd_imports_no_emulator_or_disassembler_and_the_userland_has_its_modules():
    """kerninstd must start on the guest's bare Debian Python: what `import
    ksim.live.daemon` loads is the standard library and ksim's pure-Python code."""
    code = ("import sys, ksim.live.daemon, json; "
            "print(json.dumps(sorted(sys.modules))); print(json.dumps(sorted("
            "m.__file__.rsplit('/', 1)[1].split('.')[0] for m in list(sys.modules.values()) "
            "if getattr(m, '__file__', None) and m.__file__.endswith('.so'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    names, extensions = json.loads(out[0]), json.loads(out[1])
    assert not [n for n in names if n.split(".")[0] in ("capstone", "unicorn", "keystone")]
    # site's own (an editable install's finder, a site-packages hook) aside
    assert not [n for n in names if n.split(".")[0] not in sys.stdlib_module_names
                and n.split(".")[0] not in ("ksim", "sitecustomize", "usercustomize", "certifi",
                                            "_distutils_hack", "__main__")
                and not n.startswith("__editable__")], names
    made = sorted(arm64bed.arm64_dir().glob("userland-*"))
    if not made:
        pytest.skip("no arm64 userland in the testbed cache (ksim testbed prepare --arch arm64)")
    dynload = made[-1] / "usr" / "lib" / "python3.11" / "lib-dynload"
    theirs = {p.name.split(".")[0] for p in dynload.iterdir()}
    # Debian builds many extension modules into the interpreter (the host's Python may
    # have them as files): their init functions are in the binary
    python = (made[-1] / arm64bed.PYTHON.lstrip("/")).read_bytes()
    builtin = {n for n in extensions if f"PyInit_{n}\0".encode() in python}
    assert set(extensions) - {"_cffi_backend"} <= theirs | builtin


def _complete(abi: str | None) -> str:
    if abi is None or not (arm64bed.arm64_dir() / f"linux-{abi}" / ".complete").exists() \
            or not list(arm64bed.arm64_dir().glob("userland-*/.complete")):
        pytest.skip("the arm64 testbed cache is not filled (ksim testbed prepare --arch arm64)")
    files = arm64bed.module_dir_sources(arm64bed.STANDIN)
    if not tb.module_built(files, arm64bed.arm64_dir() / f"{arm64bed._build_name(files)}-{abi}",
                           "kerninst.ko"):
        pytest.skip("the stand-in module is not built for these sources")
    return abi


@pytest.mark.usefixtures("arm64_cache")
def test_a_complete_cache_prepares_with_no_package_tool(tmp_path):
    abi = _complete(tb.recorded_abi())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("qemu-system-aarch64",):  # what prepare may look for, and nothing else
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                               text=True).stdout.strip()
        if found:
            (bindir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bindir)}
    proc = subprocess.run([sys.executable, "-m", "ksim", "testbed", "prepare", "--arch", "arm64",
                           "--offline", "--json", "--kmod", str(arm64bed.STANDIN)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ready = json.loads(proc.stdout)
    assert ready["abi"] == abi and ready["arch"] == "arm64"
    assert {Path(m).name for m in ready["guest_modules"]} >= {
        "virtio_pci.ko", "9pnet_virtio.ko", "9p.ko", "virtio_net.ko"}
    out = arm64bed.make_initramfs(ready, 7071, tmp_path / "initramfs.cpio")
    data = out.read_bytes()
    assert data.startswith(b"070701") and b"--listen 0.0.0.0:7071" in data
    assert f"mount --bind /host{ready['userland']}/usr /usr".encode() in data
