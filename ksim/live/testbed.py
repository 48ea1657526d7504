"""The Linux testbed: a Debian 6.1 kernel in QEMU with /dev/kerninst and kerninstd.

    prepare() what up() needs before booting: install what is missing, fetch and
              unpack the kernel, build the module -- each only when the cache
              lacks it, so a complete cache needs no apt and no network
    up()      prepare, make an initramfs, boot QEMU (KVM if it works, TCG
              otherwise), start kerninstd in the guest, wait until it answers
    status()  whether it is up, and where
    exec_()   run a command in the guest (through kerninstd's exec op)
    down()    stop QEMU; no process is left behind

The guest has no root filesystem of its own: it mounts the host's / read-only
over 9p and runs kerninstd with the host's Python in a chroot, so the daemon is
the code in this tree.  Everything downloaded or built lives in
~/.cache/ksim/testbed/ (KSIM_TESTBED_DIR overrides it): the kernel ABI it holds
(kernel.json), the kernel package and its unpacked tree (whose modules.dep gives the
guest's modules), the ELF vmlinux, and kerninst.ko per ABI and source digest.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ksim.errors import MalformedImage, TargetError, TargetTimeout
from ksim.image.bzimage import decompress_bzimage

REPO = Path(__file__).resolve().parents[2]
KMOD_SOURCES = ("kerninst.c", "kerninst.h", "Makefile")
DEFAULT_PORT = 7070
# Modules the guest needs for 9p and the network; guest_modules adds what they depend on.
GUEST_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "virtio_net")
BOOT_TIMEOUT = 300.0

Progress = Callable[[str], None]


def cache_dir() -> Path:
    path = Path(os.environ.get("KSIM_TESTBED_DIR", Path.home() / ".cache" / "ksim" / "testbed"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def token_path() -> Path:
    return cache_dir() / "token"


# -- instances ----------------------------------------------------------------------
# Several guests may run at once, each an *instance*: a name, an architecture, a port,
# and files of its own (state, console, QEMU log, QMP socket, initramfs).  The default
# instance (name "") is the x86-64 testbed on port 7070 whose files lie directly in
# cache_dir(), as they always have; "arm64" is the arm64 testbed (port 7071); any other
# name is a further guest (`ksim testbed up --name b`), its files in
# cache_dir()/instances/NAME.  The kernels, modules and token are shared by all.

ARCHES = ("x86_64", "arm64")
#: the instance `--arch` picks when no name is given, and its default port
ARCH_INSTANCE = {"x86_64": "", "arm64": "arm64"}
DEFAULT_PORTS = {"": DEFAULT_PORT, "arm64": 7071}
_INSTANCE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,23}")


class Instance(NamedTuple):
    """One guest: ``name`` ("" for the default testbed) and ``arch``."""

    name: str
    arch: str

    @property
    def dir(self) -> Path:
        """Where its state, console log, QEMU log, QMP socket and initramfs live."""
        if not self.name:
            return cache_dir()
        path = cache_dir() / "instances" / self.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def label(self) -> str:
        return self.name or "default"

    @property
    def qemu_name(self) -> str:
        """QEMU's -name, by which a stray guest of this instance is recognised."""
        return "ksim-testbed" + (f"-{self.name}" if self.name else "")

    @property
    def default_port(self) -> int | None:
        return DEFAULT_PORTS.get(self.name)


def resolve_instance(name: str | None = None, arch: str | None = None) -> Instance:
    """The instance ``name`` (default: the one ``arch`` names; none: the x86-64 testbed)
    of architecture ``arch`` (default: the one it runs, else arm64 for "arm64" and
    x86_64 for any other name).  The default instance is always x86-64 and "arm64"
    always arm64."""
    if arch is not None and arch not in ARCHES:
        aliases = {"aarch64": "arm64", "x86-64": "x86_64", "amd64": "x86_64", "x86": "x86_64"}
        if arch not in aliases:
            raise TargetError(f"unknown testbed architecture {arch!r} (one of {', '.join(ARCHES)})")
        arch = aliases[arch]
    if name is None:
        name = ARCH_INSTANCE[arch or "x86_64"]
    if name and not _INSTANCE_NAME.fullmatch(name):
        raise TargetError(f"testbed instance name {name!r}: lower-case letters, digits, - and _ "
                          "(at most 24, starting with a letter or digit)")
    fixed = {"": "x86_64", "arm64": "arm64"}.get(name)
    if fixed is not None:
        if arch is not None and arch != fixed:
            raise TargetError(f"the testbed instance {name or 'default'!r} is {fixed}, not {arch} "
                              "(name another instance with --name)")
        return Instance(name, fixed)
    if arch is None:
        state = _read_state(Instance(name, "x86_64"))
        arch = str(state.get("arch", "x86_64")) if state else "x86_64"
    return Instance(name, arch)


def _as_instance(inst: Instance | str | None) -> Instance:
    return inst if isinstance(inst, Instance) else resolve_instance(inst)


def _state_path(inst: Instance | None = None) -> Path:
    return (inst.dir if inst else cache_dir()) / "state.json"


def _quiet(msg: str) -> None:
    pass


def _run(cmd: list[str], *, timeout: float = 600, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TargetTimeout(f"{' '.join(cmd)}: no result after {timeout:g} s") from None
    except FileNotFoundError:
        raise TargetError(f"{cmd[0]}: not installed (not found on PATH)") from None
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise TargetError(f"{' '.join(cmd[:4])}... failed ({proc.returncode}):\n" + "\n".join(tail))
    return proc.stdout


# -- what the host needs ------------------------------------------------------------
# Everything below is checked by the presence of the files it provides, never by
# asking dpkg or apt: once the cache holds the kernel and the built module, `up`
# runs no package tool and needs no network.  apt is asked only for what is missing.

class Need(NamedTuple):
    """Something `up` still has to fetch, install or build."""

    what: str                   # what is missing and what it is for
    package: str | None = None  # the apt package that provides it, if apt installs it


#: where the ABI that the cache holds is recorded (resolve_abi)
KERNEL_RECORD = "kernel.json"


def _installed(package: str) -> bool:
    try:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                              capture_output=True, text=True)
    except FileNotFoundError:  # no dpkg: nothing counts as installed, apt will say more
        return False
    return proc.returncode == 0 and "install ok installed" in proc.stdout


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def _sbin_tool(name: str) -> str | None:
    """``name`` on PATH or in /usr/sbin, /sbin (an ordinary user's PATH often lacks them)."""
    found = shutil.which(name)
    if found:
        return found
    return next((str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name)
                 if p.exists()), None)


def _is_static_elf(path: Path) -> bool:
    """An ELF executable without a program interpreter (PT_INTERP): it runs with no C
    library beside it, as it must in the initramfs."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only (x86_64 host)
                return False
            phoff, = struct.unpack_from("<Q", head, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except (OSError, struct.error, IndexError):
        return False
    PT_INTERP = 3
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != PT_INTERP
               for i in range(len(table) // phentsize if phentsize else 0))


def busybox_path() -> Path | None:
    """The static busybox the initramfs carries (busybox-static).  Debian's `busybox`
    package installs a dynamically linked one at the same path, which would find no C
    library in the initramfs: it does not count."""
    for candidate in (shutil.which("busybox"), "/bin/busybox", "/usr/bin/busybox"):
        if candidate and _is_static_elf(Path(candidate)):
            return Path(candidate)
    return None


def headers_dir(abi: str) -> Path:
    return Path(f"/usr/src/linux-headers-{abi}-amd64")


def _boot_needs() -> list[Need]:
    needs = []
    if shutil.which("qemu-system-x86_64") is None:
        needs.append(Need("qemu-system-x86_64, which boots the guest", "qemu-system-x86"))
    if busybox_path() is None:
        needs.append(Need("a static busybox, the guest's userland in the initramfs",
                          "busybox-static"))
    return needs


def _build_needs(abi: str, what: str) -> list[Need]:
    """What kbuild needs to build ``what`` against the ABI's headers."""
    needs = [Need(f"{tool}, to build {what}", tool) for tool in ("gcc", "make")
             if shutil.which(tool) is None]
    if not (headers_dir(abi) / "Makefile").exists():
        needs.append(Need(f"{headers_dir(abi)}, the kernel headers to build {what} against",
                          f"linux-headers-{abi}-amd64"))
    return needs


def _kernel_complete(root: Path, abi: str, flavour: str = "amd64") -> bool:
    return ((root / ".complete").exists() and (root / "boot" / f"vmlinuz-{abi}-{flavour}").exists()
            and (root / "lib" / "modules" / f"{abi}-{flavour}" / "modules.dep").exists())


def _image_package(abi: str) -> str:
    return f"linux-image-{abi}-amd64-unsigned"


def _cached_debs(abi: str) -> list[Path]:
    return sorted((cache_dir() / "debs").glob(f"{_image_package(abi)}_*.deb"))


def missing(abi: str) -> list[Need]:
    """What `up` would still have to fetch, install or build for kernel ``abi``; empty
    when the cache and the host hold everything, and `up` then needs no network."""
    needs = _boot_needs()
    root = cache_dir() / f"linux-{abi}"
    if not _kernel_complete(root, abi):
        if not _cached_debs(abi):
            needs.append(Need(f"{_image_package(abi)}, the kernel package: neither unpacked in "
                              f"{root} nor downloaded to {cache_dir() / 'debs'}"))
        if _sbin_tool("depmod") is None:
            needs.append(Need("depmod, to index the modules of the kernel package as it is "
                              "unpacked", "kmod"))
    if not module_cached(abi):
        needs += _build_needs(abi, f"kerninst.ko for {abi} (not built for these sources yet)")
    return needs


def _describe(needs: list[Need]) -> str:
    return "\n".join(f"  - {n.what}" + (f" (apt package {n.package})" if n.package else "")
                     for n in needs)


def _provide(needs: list[Need], progress: Progress, offline: bool) -> list[str]:
    """Install with apt (as root) the packages that provide ``needs``; return them.
    Offline, or without root, or when apt fails, the error names every need."""
    packages = list(dict.fromkeys(n.package for n in needs if n.package))
    if not packages:
        return []
    wanted = [n for n in needs if n.package]
    if offline:
        raise TargetError("offline, and the testbed needs what this host lacks:\n"
                          + _describe(wanted))
    if os.geteuid() != 0:
        raise TargetError("the testbed needs what this host lacks:\n" + _describe(wanted)
                          + f"\ninstall as root: apt-get install {' '.join(packages)}")
    progress(f"installing {' '.join(packages)}")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    try:
        try:
            _run(cmd, env=_apt_env(), timeout=900)
        except TargetError as exc:
            # A machine whose package lists were never fetched (or were cleaned) knows
            # no package at all: fetch the lists once and try again.
            if "Unable to locate package" not in str(exc):
                raise
            progress("apt-get update (the package lists lack " + ", ".join(packages) + ")")
            _run(["apt-get", "update"], env=_apt_env(), timeout=900)
            _run(cmd, env=_apt_env(), timeout=900)
    except TargetError as exc:
        raise TargetError("the testbed needs what this host lacks:\n" + _describe(wanted)
                          + f"\nand installing it with apt failed: {exc}") from None
    return packages


def ensure_packages(abi: str, progress: Progress = _quiet, *, offline: bool = False) -> list[str]:
    """Install (as root, with apt) the packages `up` needs for kernel ``abi`` and this
    host lacks (the kernel headers only while kerninst.ko is not built for the ABI and
    the sources); return what was installed."""
    return _provide(missing(abi), progress, offline)


def ensure_tools(packages: tuple[str, ...], progress: Progress = _quiet) -> list[str]:
    """Install (as root, with apt) host packages a benchmark runs in the guest through
    the host's root filesystem (bpftrace); return what was installed."""
    return _provide([Need(f"{p}, which the guest runs from the host's root filesystem", p)
                     for p in packages if not _installed(p)], progress, offline=False)


# -- the kernel ABI -------------------------------------------------------------------
def recorded_abi() -> str | None:
    """The ABI the cache holds: the one recorded when it was resolved, or else the newest
    kernel unpacked in the cache (a cache filled before the record existed)."""
    try:
        abi = json.loads((cache_dir() / KERNEL_RECORD).read_text())["abi"]
        if re.fullmatch(r"6\.1\.0-\d+", str(abi)):
            return str(abi)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    unpacked = [m.group(1) for p in cache_dir().glob("linux-6.1.0-*")
                if (m := re.fullmatch(r"linux-(6\.1\.0-\d+)", p.name))
                and _kernel_complete(p, m.group(1))]
    return max(unpacked, key=lambda v: int(v.rsplit("-", 1)[1])) if unpacked else None


def _record_abi(abi: str) -> None:
    path = cache_dir() / KERNEL_RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"abi": abi, "resolved": time.time()}) + "\n")
    tmp.rename(path)


def _newest_abi_from_apt(progress: Progress) -> str:
    """The newest bookworm kernel ABI with both headers and an unsigned image in apt."""
    pattern = r"^linux-(headers|image)-(6\.1\.0-\d+)-amd64(-unsigned)?$"

    def search() -> list[str]:
        out = _run(["apt-cache", "search", "--names-only",
                    r"^linux-(headers|image)-6\.1\.0-[0-9]+-amd64(-unsigned)?$"])
        headers, images = set(), set()
        for line in out.splitlines():
            m = re.match(pattern, line.split(" - ")[0].strip())
            if m and m.group(1) == "headers" and not m.group(3):
                headers.add(m.group(2))
            elif m and m.group(1) == "image" and m.group(3):
                images.add(m.group(2))
        return sorted(headers & images, key=lambda v: int(v.rsplit("-", 1)[1]))

    found = search()
    if not found:
        progress("apt-get update (no 6.1 kernel packages known yet)")
        _run(["apt-get", "update"], env=_apt_env())
        found = search()
    if not found:
        raise TargetError("no linux-headers-6.1.0-*-amd64 with a matching -unsigned image in apt")
    return found[-1]


def resolve_abi(progress: Progress = _quiet, *, offline: bool = False,
                refresh: bool = False) -> str:
    """The kernel ABI (e.g. 6.1.0-56) the testbed boots: the one the cache holds, so that
    a complete cache boots without apt or network; with ``refresh`` (or an empty cache)
    the newest bookworm ABI apt knows, which is then recorded.  The ABI changes with
    security updates; `ksim testbed up --refresh` moves the testbed to the newest."""
    if not refresh:
        abi = recorded_abi()
        if abi is not None:
            return abi
    if offline:
        raise TargetError(f"offline, and no kernel is cached in {cache_dir()} "
                          + ("(--refresh asks apt for the newest)" if refresh else
                             "(no kernel.json, no unpacked linux-6.1.0-*)")
                          + "; run `ksim testbed prepare` once with network")
    try:
        abi = _newest_abi_from_apt(progress)
    except TargetError as exc:
        raise TargetError(f"no kernel is cached in {cache_dir()}, and apt cannot name the "
                          f"newest 6.1 ABI: {exc}") from None
    _record_abi(abi)
    return abi


# -- kernel, module, initramfs ------------------------------------------------------
def kernel_root(abi: str, progress: Progress = _quiet, *, offline: bool = False) -> Path:
    """The unpacked linux-image-ABI-amd64-unsigned package (vmlinuz and modules), cached."""
    return unpack_kernel(cache_dir() / f"linux-{abi}", cache_dir() / "debs", abi, "amd64",
                         _image_package(abi), progress, offline=offline)


def unpack_kernel(root: Path, debs: Path, abi: str, flavour: str, package: str,
                  progress: Progress = _quiet, *, offline: bool = False,
                  apt_name: str | None = None) -> Path:
    """The kernel package ``package`` (``apt_name`` to apt, e.g. with :arm64) unpacked
    in ``root`` with its modules indexed, downloaded to ``debs`` first if it is not
    there; nothing is done when ``root`` is complete."""
    if _kernel_complete(root, abi, flavour):
        return root
    debs.mkdir(parents=True, exist_ok=True)

    def cached() -> list[Path]:
        return sorted(debs.glob(f"{package}_*.deb"))

    if not cached():
        if offline:
            raise TargetError(f"offline, and {package} is neither unpacked in {root} nor "
                              f"downloaded to {debs}")
        progress(f"downloading {package}")
        try:
            _run(["apt-get", "download", apt_name or package], cwd=debs, timeout=900)
        except TargetError as exc:
            raise TargetError(f"the kernel package {package} is not in {debs}, and "
                              f"downloading it failed: {exc}") from None
    deb = cached()[-1]
    progress(f"unpacking {deb.name}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    _run(["dpkg-deb", "-x", str(deb), str(root)])
    # Debian generates modules.dep in postinst; guest_modules reads it.
    depmod = _sbin_tool("depmod")
    if depmod is None:
        _provide([Need("depmod, to index the modules of the kernel package", "kmod")],
                 progress, offline)
        depmod = _sbin_tool("depmod") or "depmod"
    _run([depmod, "-b", str(root), f"{abi}-{flavour}"])
    (root / ".complete").touch()
    return root


def extract_vmlinux(vmlinuz: Path, out: Path) -> Path:
    """Decompress the bzImage's xz payload to the ELF vmlinux (qemu boots it through its PVH note)."""
    if out.exists():
        return out
    try:
        elf = decompress_bzimage(vmlinuz.read_bytes())
    except MalformedImage as exc:
        raise TargetError(f"{vmlinuz}: {exc}") from None
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(elf)
    tmp.rename(out)
    return out


def _digest(src: Path, sources: tuple[str, ...]) -> str:
    return hashlib.sha256(b"".join((src / n).read_bytes() for n in sources)).hexdigest()[:16]


def _kmod_digest() -> str:
    return _digest(REPO / "kmod", KMOD_SOURCES)


def _module_built(build: Path, ko_name: str, digest: str) -> bool:
    stamp = build / ".source"
    return (build / ko_name).exists() and stamp.exists() and stamp.read_text() == digest


def module_cached(abi: str) -> bool:
    """Whether kerninst.ko is built for ``abi`` from kmod/ as it is now."""
    return _module_built(cache_dir() / f"kmod-{abi}", "kerninst.ko", _kmod_digest())


def _kbuild(src: Path, sources: tuple[str, ...], build: Path, ko_name: str, abi: str,
            progress: Progress, offline: bool = False) -> Path:
    """Build the module in ``src`` with kbuild against the ABI's headers, in ``build``
    (a copy, so the source tree never holds build outputs; rebuilt when the sources change).
    A module already built from these sources needs neither the headers nor a compiler."""
    return kbuild([src / n for n in sources], build, ko_name, headers_dir(abi), progress,
                  needs=lambda: _build_needs(abi, ko_name), offline=offline)


def files_digest(files: list[Path]) -> str:
    """What a module built from ``files`` is cached under (as _digest)."""
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def module_built(files: list[Path], build: Path, ko_name: str) -> bool:
    """Whether ``build`` holds ``ko_name`` built from ``files`` as they are now."""
    return _module_built(build, ko_name, files_digest(files))


def kbuild(files: list[Path], build: Path, ko_name: str, headers: Path, progress: Progress,
           *, make_vars: tuple[str, ...] = (), needs: Callable[[], list[Need]] | None = None,
           offline: bool = False, what: str = "") -> Path:
    """Build ``files`` (a kbuild Makefile and the sources) with kbuild against the kernel
    headers in ``headers`` (``make_vars`` such as ARCH= and CROSS_COMPILE= added), in
    ``build``; rebuilt only when the files change.  Before building, ``needs()`` names
    what the host lacks for it, which is installed.  The compiler's output is kept in
    ``build``.log, which a failure names."""
    digest = files_digest(files)
    ko = build / ko_name
    if _module_built(build, ko_name, digest):
        return ko
    if needs is not None:
        _provide(needs(), progress, offline)
    progress(f"building {ko_name}" + (f" {what}" if what else ""))
    # Built beside the cached build and swapped in only when it succeeded: sources that
    # do not compile leave the previous module in the cache, and a second build running
    # at the same time has a directory of its own.
    work = build.with_name(f"{build.name}.build-{os.getpid()}")
    log = build.with_name(f"{build.name}.log")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        for f in files:
            shutil.copy(f, work / f.name)
        cmd = ["make", "-C", str(headers), f"M={work}", *make_vars, "modules"]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise TargetTimeout(f"{' '.join(cmd)}: no result after 300 s") from None
        except FileNotFoundError:
            raise TargetError("make: not installed (not found on PATH)") from None
        log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}")
        if proc.returncode:
            errors = [line.replace(f"{work}/", "") for line in proc.stdout.splitlines()
                      if "error" in line.lower()]
            shown = (errors or proc.stdout.strip().splitlines())[:8]
            raise TargetError(f"{ko_name}{' ' + what if what else ''} does not build "
                              f"(make exited with {proc.returncode}):\n  "
                              + "\n  ".join(shown) + f"\nthe build log: {log}")
        (work / ".source").write_text(digest)
        shutil.rmtree(build, ignore_errors=True)
        work.rename(build)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ko


def build_module(abi: str, progress: Progress = _quiet, *, offline: bool = False) -> Path:
    """Build kmod/ (kerninst.ko) against the ABI's headers, in the cache."""
    return _kbuild(REPO / "kmod", KMOD_SOURCES, cache_dir() / f"kmod-{abi}", "kerninst.ko", abi,
                   progress, offline)


def build_test_module(src: Path, abi: str, progress: Progress = _quiet,
                      arch: str = "x86_64") -> Path:
    """Build a test module (a directory with a kbuild Makefile and NAME.c, e.g.
    tests/kmod_warn) against the ABI's headers (``arch`` "arm64": cross-built against
    the arm64 ones), into the cache the guest sees through 9p; returns the .ko path,
    which insmod in the guest accepts as is."""
    sources = tuple(sorted(p.name for p in src.iterdir()
                           if p.name in ("Makefile", "Kbuild") or p.suffix in (".c", ".h")))
    (c_file,) = [n for n in sources if n.endswith(".c")]
    if arch == "arm64":
        from ksim.live import arm64bed

        return arm64bed.build_test_module([src / n for n in sources], src.name,
                                          c_file[:-2] + ".ko", abi, progress)
    return _kbuild(src, sources, cache_dir() / f"testmod-{src.name}-{abi}",
                   c_file[:-2] + ".ko", abi, progress)


def load_test_module(src: Path, state: dict[str, Any], progress: Progress = _quiet) -> str:
    """Build the test module in ``src`` and (re)load it in the running testbed; returns its name.
    A module of the same name already loaded is unloaded first, so the guest runs this build."""
    ko = build_test_module(src, str(state["abi"]), progress, str(state.get("arch", "x86_64")))
    name = ko.stem
    out = exec_(f"if grep -q '^{name} ' /proc/modules; then rmmod {name} || exit 3; fi; "
                f"insmod {ko}", timeout=60, instance=str(state.get("instance") or ""))
    if out["rc"] != 0:
        raise TargetError(f"loading {name} in the guest failed ({out['rc']}): "
                          f"{(out['stderr'] or out['stdout']).strip()}")
    return name


def _module_name(path: str) -> str:
    """A module's name as modprobe matches it: the file name without .ko[.xz|.zst|.gz],
    dashes read as underscores."""
    name = path.rsplit("/", 1)[-1]
    name = re.sub(r"\.ko(\.(xz|zst|gz))?$", "", name)
    return name.replace("-", "_")


def guest_modules(root: Path, abi: str, flavour: str = "amd64") -> list[Path]:
    """GUEST_MODULES and what they depend on, in load order: what `modprobe
    --show-depends` prints, read from the unpacked package's modules.dep, so that no
    host tool (nor the host's own kernel's modules) is involved.  Soft dependencies
    (modules.softdep) are optional by definition and not followed; none of these
    modules has one in 6.1."""
    base = root / "lib" / "modules" / f"{abi}-{flavour}"
    try:
        text = (base / "modules.dep").read_text()
    except OSError as exc:
        raise TargetError(f"{base / 'modules.dep'}: {exc.strerror}; the unpacked kernel in "
                          f"{root} is incomplete (remove that directory and the next "
                          "`ksim testbed up` unpacks the package again)") from None
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in text.splitlines():
        path, colon, rest = line.partition(":")
        if colon:
            deps[path.strip()] = rest.split()
            by_name[_module_name(path.strip())] = path.strip()
    order: list[str] = []
    for name in GUEST_MODULES:
        found = by_name.get(_module_name(name))
        if found is None:
            raise TargetError(f"module {name} is not in {base / 'modules.dep'}")
        # depmod lists every module a module needs, each after the ones that need it:
        # loaded in reverse, each finds its own dependencies already in
        for dep in [*reversed(deps[found]), found]:
            if dep not in order:
                order.append(dep)
    return [base / p for p in order]


class Cpio:
    """A newc ("070701") archive, enough for an initramfs."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ino = 1

    def _entry(self, name: str, mode: int, body: bytes = b"") -> None:
        name_b = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(body), 0, 0, 0, 0, len(name_b), 0)
        self.data += b"070701" + b"".join(b"%08x" % f for f in fields) + name_b
        self.data += b"\0" * (-len(self.data) % 4) + body
        self.data += b"\0" * (-len(self.data) % 4)
        self.ino += 1

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, body: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, body)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return bytes(self.data) + b"\0" * (-len(self.data) % 512)


#: what every guest's init does first, whatever its architecture: the kernel's file
#: systems, the modules (kerninst.ko last), the network QEMU's user mode expects
INIT_PROLOGUE = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "ksim-init: loading modules"
for m in $(cat /modules.list); do insmod /modules/$m || echo "ksim-init: insmod $m failed"; done
insmod /kerninst.ko || echo "ksim-init: insmod kerninst.ko FAILED"
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
echo 0 > /proc/sys/kernel/kptr_restrict
# A network device that stalls (virtio_net's "TX timeout", seen under the heaviest
# test load) cuts the host off, and says nothing of why: the first one dumps every
# CPU's backtrace and the blocked tasks into the console log (the guest's
# console.log in the testbed's directory)
echo 1 > /proc/sys/kernel/sysrq
(while sleep 15; do
    if dmesg | grep -q "TX timeout"; then
        echo "ksim-init: the network stalled: every CPU's backtrace and blocked tasks follow"
        echo l > /proc/sysrq-trigger; echo w > /proc/sysrq-trigger; sleep 2
        dmesg | tail -n 600; break
    fi
done) &
"""

#: what every guest's init does last: kerninstd (@ENV@: how it is started, in the
#: guest's view of the userland), restarted when it dies, the module reloaded in
#: between when the file @GUEST_RELOAD@ exists (ksim.live.testing.restart_kerninstd)
INIT_DAEMON = r"""n=0
while [ $n -lt 20 ]; do
    @ENV@ -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp PYTHONDONTWRITEBYTECODE=1 \
        PYTHONPATH=@REPO@ @PYTHON@ -m ksim.live.daemon --listen 0.0.0.0:@PORT@ \
        --token-file @TOKEN@ --device /dev/kerninst --allow-exec
    echo "ksim-init: kerninstd exited ($?)"
    n=$((n + 1))
    if [ -e "@GUEST_RELOAD@" ]; then
        rm -f "@GUEST_RELOAD@"
        rmmod kerninst || break
        echo "ksim-init: kerninst unloaded"
        insmod /kerninst.ko || break
    fi
    echo "ksim-init: restarting kerninstd"
done
poweroff -f
"""

INIT = INIT_PROLOGUE + r"""mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host || echo "ksim-init: 9p mount FAILED"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t tracefs tracefs /host/sys/kernel/tracing
mount -t devtmpfs dev /host/dev
# The guest gets a writable /tmp of its own; a checkout that lives under the
# host's /tmp (a CI clone) stays visible through a bind mount from a staging point.
mkdir -p /hosttmp
mount --bind /host/tmp /hosttmp
mount -t tmpfs tmp /host/tmp
for keep in @KEEP@; do
    mkdir -p "/host$keep"
    mount --bind "/hosttmp${keep#/tmp}" "/host$keep" || echo "ksim-init: cannot keep $keep"
done
echo "ksim-init: starting kerninstd"
cd /
# If kerninstd dies, start it again.  The module stays, and with it every kept
# splice (closing the device undid the others); the new kerninstd reads them
# from the module.  When @RELOAD@ (in the chroot) exists, unload the module
# first (which restores every splice) and load it again: this is how the tests
# check unload (ksim.live.testing.restart_kerninstd).
""" + INIT_DAEMON.replace("@ENV@", "chroot /host /usr/bin/env").replace(
    "@GUEST_RELOAD@", "/host@RELOAD@")

# Made in the guest (under its own /tmp) to have /init reload the module when kerninstd exits.
RELOAD_FLAG = "/tmp/kerninst-reload"


def guest_file(directory: Path, name: str, text: str) -> Path:
    """A file in ``directory`` that the guest reads through its 9p mount of the host,
    named after its content: the guest caches what it read (cache=loose), so a file
    is never rewritten."""
    stem, dot, ext = name.rpartition(".")
    path = directory / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}{dot}{ext}"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def host_python() -> str:
    """The real interpreter binary (a pyenv shim would not work inside the chroot)."""
    return os.path.realpath(sys.executable)


def make_initramfs(root: Path, abi: str, ko: Path, port: int, out: Path) -> Path:
    archive = Cpio()
    for d in ("bin", "dev", "proc", "sys", "host", "modules", "tmp"):
        archive.dir(d)
    busybox = busybox_path()
    if busybox is None:
        raise TargetError("no static busybox on this host (apt package busybox-static)")
    archive.file("bin/busybox", busybox.read_bytes(), 0o755)
    names = []
    for path in guest_modules(root, abi):
        body = path.read_bytes()
        if path.suffix == ".xz":
            body, path = lzma.decompress(body), path.with_suffix("")
        archive.file(f"modules/{path.name}", body)
        names.append(path.name)
    archive.file("modules.list", ("\n".join(names) + "\n").encode())
    archive.file("kerninst.ko", ko.read_bytes())
    keep = " ".join(sorted({str(p) for p in (REPO, Path(host_python()).parent)
                            if str(p).startswith("/tmp/")}))
    init = (INIT.replace("@REPO@", str(REPO)).replace("@PYTHON@", host_python())
            .replace("@KEEP@", keep).replace("@RELOAD@", RELOAD_FLAG)
            .replace("@PORT@", str(port)).replace("@TOKEN@", str(token_path())))
    archive.file("init", init.encode(), 0o755)
    out.write_bytes(archive.finish())
    return out


def ensure_token() -> Path:
    path = token_path()
    if path.exists():
        st = path.stat()
        if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return path
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


# -- qemu ---------------------------------------------------------------------------
def kvm_usable() -> bool:
    """KVM only when /dev/kvm opens and the CPU has hardware virtualisation (vmx/svm)."""
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"^flags\s*:.*\b(vmx|svm)\b", flags, re.M))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # As qemu binds its hostfwd socket: connections in TIME_WAIT do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qemu_command(vmlinux: Path, initramfs: Path, port: int, accel: str,
                 inst: Instance | None = None) -> list[str]:
    """QEMU's command line for the x86-64 instance ``inst`` (default: the default testbed)."""
    inst = inst or Instance("", "x86_64")
    d = inst.dir
    return [
        "qemu-system-x86_64", "-name", inst.qemu_name,
        "-kernel", str(vmlinux), "-initrd", str(initramfs),
        "-append", "console=ttyS0 panic=-1 oops=panic nokaslr quiet loglevel=4",
        "-m", "1G", "-smp", "2",
        # Single-threaded TCG: with one host thread per vCPU (MTTCG), QEMU 7.2 was seen to
        # keep running a stale translation of a byte another vCPU had just restored (an
        # int3 replaced by the original opcode, after the sync IPIs); kprobes' retry of a
        # vanished int3 (kprobe_int3_handler) then loops forever.  Round-robin vCPUs see
        # every code write.  The guest still has two CPUs and real IPIs.
        "-accel", "kvm" if accel == "kvm" else "tcg,thread=single",
        "-cpu", "host" if accel == "kvm" else "max",
        "-display", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{d / 'console.log'}",
        "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off",
        "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:{port}",
        "-device", "virtio-net-pci,netdev=n0,romfile=",
    ]


QEMU_BINARIES = (b"qemu-system-x86_64", b"qemu-system-aarch64")


def _pid_is_qemu(pid: int, inst: Instance | None = None) -> bool:
    """Whether ``pid`` is a testbed's QEMU (``inst``'s, when given)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not cmdline or not cmdline[0].endswith(QEMU_BINARIES):
        return False
    if inst is not None:
        return inst.qemu_name.encode() in cmdline
    return any(arg.startswith(b"ksim-testbed") for arg in cmdline)


def _read_state(inst: Instance | None = None) -> dict[str, Any] | None:
    try:
        return json.loads(_state_path(inst).read_text())
    except (OSError, ValueError):
        return None


def _ping(port: int, timeout: float = 3.0) -> dict[str, Any] | None:
    from ksim.live.client import Connection

    try:
        with Connection("127.0.0.1", port, token_file=str(token_path()), timeout=timeout) as conn:
            return conn.request("info")
    except (OSError, Exception):
        return None


def _boot(command: list[str], inst: Instance, port: int, accel: str, timeout: float,
          progress: Progress) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    d = inst.dir
    console = d / "console.log"
    console.write_bytes(b"")
    (d / "qmp.sock").unlink(missing_ok=True)
    with open(d / "qemu.log", "wb") as qlog:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                stdout=qlog, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    shown = 0
    try:
        while time.monotonic() - start < timeout:
            if proc.poll() is not None:
                raise TargetError(f"qemu ({accel}) exited with {proc.returncode}: "
                                  + (d / "qemu.log").read_text(errors="replace")[-800:]
                                  + _console_tail(inst))
            text = console.read_text(errors="replace")
            for line in text.splitlines()[shown:]:
                if line.startswith("ksim-init:") or "kerninst" in line or "kerninstd:" in line:
                    progress(f"[{time.monotonic() - start:5.1f}s] guest: {line.strip()}")
            shown = len(text.splitlines())
            if "Kernel panic" in text or ("kerninstd exited" in text
                                          and "kerninstd: listening" not in text):
                raise TargetError("guest failed to start kerninstd" + _why_not(text)
                                  + _console_tail(inst))
            if "kerninstd: listening" in text:
                info = _ping(port, timeout=10)
                if info is not None:
                    return proc, info
            time.sleep(0.5)
        raise TargetTimeout(f"kerninstd did not answer within {timeout:g} s ({accel})"
                            + _console_tail(inst))
    except BaseException:
        _stop_pid(proc.pid)
        proc.wait(10)
        raise


def _why_not(console: str) -> str:
    """What the console says about kerninst.ko when it did not load."""
    if "ksim-init: insmod kerninst.ko FAILED" not in console:
        return ""
    said = [line.split("] ", 1)[-1].strip() for line in console.splitlines()
            if re.search(r"\bkerninst: |insmod: can't insert '/kerninst.ko'", line)]
    return (": kerninst.ko did not load in the guest"
            + "".join(f"\n  {line}" for line in dict.fromkeys(said)))


def _console_tail(inst: Instance | None = None, lines: int = 25) -> str:
    try:
        text = ((inst.dir if inst else cache_dir()) / "console.log").read_text(errors="replace")
    except OSError:
        return ""
    return "\nguest console (last lines):\n" + "\n".join(text.splitlines()[-lines:])


def prepare(*, offline: bool = False, refresh: bool = False,
            progress: Progress = _quiet, arch: str = "x86_64",
            module_sources: list[Path] | None = None,
            tools: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything `up` needs before it boots: the kernel ABI, the host's packages, the
    unpacked kernel, its ELF vmlinux, kerninst.ko and the guest's module list.  What the
    cache already holds is used as it is (no apt, no network); what is missing is
    fetched, installed or built.  ``offline`` fetches and installs nothing and names
    all that would need it instead (kerninst.ko is still built when the compiler, make
    and the headers are installed: that needs no network).  ``arch`` "arm64" prepares
    the arm64 testbed (ksim.live.arm64bed), of the same kernel ABI; there,
    ``module_sources`` (a kbuild Makefile and what it builds into kerninst.ko) may
    stand in for kmod/, and ``tools`` (e.g. "bpftrace") are added to the guest's arm64
    userland (the x86-64 guest runs the host's programs: ensure_tools installs them)."""
    abi = resolve_abi(progress, offline=offline, refresh=refresh)
    progress(f"kernel ABI {abi}")
    if resolve_instance(None, arch).arch == "arm64":
        from ksim.live import arm64bed

        return arm64bed.prepare(abi, offline=offline, progress=progress, refresh=refresh,
                                module_sources=module_sources, tools=tools)
    if module_sources is not None:
        raise TargetError("the x86-64 testbed boots kmod/'s kerninst.ko only")
    ensure_tools(tools, progress)
    needs = missing(abi)
    if offline and needs:
        raise TargetError(f"offline, and the testbed cache ({cache_dir()}) or this host lacks "
                          f"what kernel {abi} needs:\n{_describe(needs)}")
    try:
        _provide(needs, progress, offline)  # one apt run for every package
    except TargetError as exc:
        if refresh or not any((n.package or "").startswith("linux-headers-") for n in needs):
            raise
        # the cached ABI may have left the archive (its headers are needed only when
        # kerninst.ko is rebuilt): the newest one is a --refresh away
        raise TargetError(f"{exc}\n(kernel {abi} is the one the cache holds; "
                          "`ksim testbed up --refresh` moves to the newest apt offers)") from None
    root = kernel_root(abi, progress, offline=offline)
    vmlinux = extract_vmlinux(root / "boot" / f"vmlinuz-{abi}-amd64", cache_dir() / f"vmlinux-{abi}")
    ko = build_module(abi, progress, offline=offline)
    return {"abi": abi, "arch": "x86_64", "cache": str(cache_dir()), "kernel_root": str(root),
            "vmlinux": str(vmlinux), "module": str(ko),
            "guest_modules": [str(m) for m in guest_modules(root, abi)]}


def _choose_port(inst: Instance, port: int | None) -> int:
    if port is None:
        default = inst.default_port
        return default if default is not None and _port_free(default) else _free_port()
    if not _port_free(port):
        raise TargetError(f"port {port} on 127.0.0.1 is in use")
    return port


def up(*, port: int | None = None, accel: str = "auto", timeout: float = BOOT_TIMEOUT,
       offline: bool = False, refresh: bool = False, progress: Progress = _quiet,
       instance: Instance | str | None = None, arch: str | None = None,
       module_sources: list[Path] | None = None, tools: tuple[str, ...] = ()) -> dict[str, Any]:
    """Boot the testbed ``instance`` (default: the x86-64 testbed on port 7070; with
    ``arch`` "arm64", the arm64 one on 7071), or return it if it is running, and return
    its state.  ``port`` defaults to the instance's own (7070, 7071), or a free one.
    ``module_sources`` and ``tools``: see prepare."""
    inst = instance if isinstance(instance, Instance) else resolve_instance(instance, arch)
    current = status(inst)
    if current["up"]:
        lacking = [t for t in tools if inst.arch == "arm64" and t not in current.get("tools", [])]
        if lacking:
            raise TargetError(f"the running arm64 testbed's userland has no {', '.join(lacking)}: "
                              "ksim testbed down --arch arm64, then up --arch arm64 "
                              + " ".join(f"--with {t}" for t in lacking))
        progress(f"already up at {current['address']}")
        return current
    if inst.arch == "arm64" and accel == "kvm":
        raise TargetError("the arm64 testbed runs under TCG only (this host is not arm64)")
    down(instance=inst)
    t0 = time.monotonic()
    ready = prepare(offline=offline, refresh=refresh, progress=progress, arch=inst.arch,
                    module_sources=module_sources, tools=tools)
    abi = ready["abi"]
    ensure_token()
    port = _choose_port(inst, port)
    if inst.arch == "arm64":
        from ksim.live import arm64bed

        initramfs = arm64bed.make_initramfs(ready, port, inst.dir / f"initramfs-{abi}-arm64.cpio")
        accels = ["tcg"]
    else:
        initramfs = make_initramfs(Path(ready["kernel_root"]), abi, Path(ready["module"]), port,
                                   inst.dir / f"initramfs-{abi}.cpio")
        accels = ["kvm", "tcg"] if accel == "auto" and kvm_usable() else [
            "tcg" if accel == "auto" else accel]
    prepared = time.monotonic() - t0
    last: Exception | None = None
    for acc in accels:
        if inst.arch == "arm64":
            from ksim.live import arm64bed

            command = arm64bed.qemu_command(ready, initramfs, port, inst)
        else:
            command = qemu_command(Path(ready["vmlinux"]), initramfs, port, acc, inst)
        where = "" if not inst.name else f" as instance {inst.name}"
        progress(f"booting {abi} ({inst.arch}){where} under {acc.upper()}, kerninstd on port {port}")
        t1 = time.monotonic()
        try:
            proc, info = _boot(command, inst, port, acc, timeout, progress)
        except TargetError as exc:
            last = exc
            progress(f"{acc.upper()} boot failed: {str(exc).splitlines()[0]}")
            continue
        state = {
            "up": True, "pid": proc.pid, "port": port, "address": f"live://127.0.0.1:{port}",
            "token_file": str(token_path()), "accel": acc, "abi": abi,
            "kernel": info.get("kernel"), "boot_seconds": round(time.monotonic() - t1, 1),
            "prepare_seconds": round(prepared, 1), "started": time.time(),
            "console": str(inst.dir / "console.log"), "qmp": str(inst.dir / "qmp.sock"),
            "instance": inst.name, "arch": inst.arch, "module": ready["module"],
            "module_source": ready.get("module_source", str(REPO / "kmod")),
            **({"userland": ready["userland"], "tools": ready["tools"]} if "userland" in ready
               else {}),
        }
        _state_path(inst).write_text(json.dumps(state, indent=2))
        progress(f"up in {state['boot_seconds']} s: {state['address']} (token {state['token_file']})")
        return state
    assert last is not None
    raise last


def status(instance: Instance | str | None = None) -> dict[str, Any]:
    """Whether the testbed ``instance`` (default: the x86-64 one) is up, and where."""
    inst = _as_instance(instance)
    state = _read_state(inst)
    if not state or not _pid_is_qemu(int(state.get("pid", 0)), inst):
        return {"up": False, "cache": str(cache_dir()), "instance": inst.name, "arch": inst.arch}
    info = _ping(int(state["port"]))
    return {**state, "up": info is not None, "qemu_running": True, "responding": info is not None}


def instances() -> list[dict[str, Any]]:
    """The status of every instance that has a state file (running or not)."""
    found = [Instance("", "x86_64")] if _state_path().exists() else []
    base = cache_dir() / "instances"
    if base.is_dir():
        found += [resolve_instance(p.name) for p in sorted(base.iterdir())
                  if (p / "state.json").exists() and _INSTANCE_NAME.fullmatch(p.name)]
    return [status(i) for i in found]


def _stop_pid(pid: int, grace: float = 10.0) -> None:
    if not _pid_is_qemu(pid):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _pid_is_qemu(pid):
                return
            try:  # reap it if it is our child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)


def _qmp_quit(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(path))
        f = s.makefile("rwb")
        f.readline()
        for cmd in ("qmp_capabilities", "quit"):
            f.write(json.dumps({"execute": cmd}).encode() + b"\n")
            f.flush()
            f.readline()


def down(progress: Progress = _quiet, *, instance: Instance | str | None = None) -> dict[str, Any]:
    """Stop the testbed ``instance`` (default: the x86-64 one); no other is touched."""
    inst = _as_instance(instance)
    state = _read_state(inst)
    stopped = False
    if state and _pid_is_qemu(int(state.get("pid", 0)), inst):
        pid = int(state["pid"])
        try:
            _qmp_quit(Path(state["qmp"]))
        except OSError:
            pass
        _stop_pid(pid, grace=5.0)
        stopped = True
        progress(f"stopped qemu (pid {pid})")
    _state_path(inst).unlink(missing_ok=True)
    return {"up": False, "stopped": stopped, "instance": inst.name}


def exec_(cmd: str, timeout: float = 120.0, *,
          instance: Instance | str | None = None) -> dict[str, Any]:
    """Run the shell command ``cmd`` in the guest of ``instance`` (default: x86-64)."""
    inst = _as_instance(instance)
    state = _read_state(inst)
    if not state:
        flag = "" if not inst.name else (" --arch arm64" if inst.name == "arm64"
                                         else f" --name {inst.name}")
        raise TargetError(f"the testbed{flag} is not up (ksim testbed up{flag})")
    from ksim.live.client import Connection

    with Connection("127.0.0.1", int(state["port"]), token_file=str(token_path()),
                    timeout=timeout + 10) as conn:
        return conn.request("exec", cmd=cmd, timeout=float(timeout), reply_timeout=timeout + 30)
