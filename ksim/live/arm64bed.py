"""The arm64 testbed: Debian's arm64 kernel of the x86 testbed's ABI in qemu-system-aarch64.

``ksim testbed up --arch arm64`` (the testbed instance "arm64", kerninstd on port
7071) comes here for what differs from the x86-64 testbed (ksim.live.testbed):

    kernel    linux-image-ABI-arm64-unsigned, of the ABI the x86 testbed records,
              fetched with `apt-get download` (after `dpkg --add-architecture arm64`
              and `apt-get update`) and unpacked with dpkg-deb; nothing is installed
    module    kmod/ cross-built with kbuild (ARCH=arm64 CROSS_COMPILE=aarch64-linux-gnu-)
              against linux-headers-ABI-arm64 unpacked in the cache, whose scripts
              and tools are the host's own linux-kbuild-6.1 (x86-64 programs)
    userland  the guest cannot run the host's x86-64 root as the x86 guest does, so
              kerninstd runs with Debian's arm64 Python: python3.11-minimal,
              libpython3.11-minimal/-stdlib and the C libraries kerninstd's
              extension modules load, plus busybox-static, unpacked (usr-merged, the
              standard library compiled to .pyc on the host) in the cache and
              mounted by the guest from the host over 9p; ksim itself is the source
              tree of this checkout, shared the same way, so the daemon is this
              tree's code as on x86
    qemu      qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on under TCG

Everything lives in ~/.cache/ksim/testbed/arm64/, keyed by the ABI (kernel, headers,
module) and by the packages' versions (userland): once it is filled `up` needs
neither apt nor the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ksim.errors import TargetError
from ksim.live import testbed as tb

ARCH = "arm64"       # Debian's name, and the kernel flavour
MACHINE = "aarch64"  # uname -m in the guest
CROSS_COMPILE = "aarch64-linux-gnu-"
#: what kerninstd needs of Debian's arm64 packages: the interpreter and its standard
#: library, and the shared libraries of the extension modules `import ksim.live.daemon`
#: loads (_ctypes: libffi; _hashlib, _ssl: libssl; zlib, bz2, lzma; pyexpat: libexpat),
#: libgcc_s (glibc loads it to unwind a cancelled thread), and busybox for /init and
#: the exec op's shell.  The standard library's other dependencies (readline, ncurses,
#: sqlite, Berkeley DB, ...) serve modules kerninstd never imports.
USERLAND_PACKAGES = ("libc6", "libgcc-s1", "zlib1g", "libexpat1", "libssl3", "libffi8",
                     "liblzma5", "libbz2-1.0", "libpython3.11-minimal",
                     "libpython3.11-stdlib", "python3.11-minimal", "busybox-static")
PYTHON = "/usr/bin/python3.11"
#: The CPU: `max` has every feature QEMU 7.2 emulates for ARMv8.x-A, among them PAC
#: (ARMv8.3) and BTI (ARMv8.5), which Debian's kernel uses (CONFIG_ARM64_PTR_AUTH_KERNEL:
#: paciasp/autiasp in its functions; CONFIG_ARM64_BTI for user space): on a CPU
#: without them those instructions are NOPs, and a splice near them would not be
#: tested as it behaves on a real ARMv8.3+ server.  pauth-impdef=on replaces QARMA,
#: whose emulation costs much of TCG's time on every call and return, with QEMU's
#: cheaper implementation-defined algorithm (pointer authentication still works).
CPU = "max,pauth-impdef=on"


def arm64_dir() -> Path:
    path = tb.cache_dir() / ARCH
    path.mkdir(parents=True, exist_ok=True)
    return path


def headers_root(abi: str) -> Path:
    """The unpacked linux-headers-ABI-arm64 tree kbuild builds against."""
    return arm64_dir() / f"headers-{abi}" / "usr" / "src" / f"linux-headers-{abi}-{ARCH}"


def common_headers(abi: str) -> Path:
    """The arch-independent headers the arm64 Makefile includes by absolute path."""
    return Path(f"/usr/src/linux-headers-{abi}-common")


KBUILD = Path("/usr/lib/linux-kbuild-6.1")


# -- apt, for a foreign architecture ---------------------------------------------------
def foreign_arch_enabled() -> bool:
    try:
        out = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True,
                             text=True).stdout
    except FileNotFoundError:
        return False
    return ARCH in out.split()


def _enable_foreign_arch(progress: tb.Progress) -> None:
    """`dpkg --add-architecture arm64` and `apt-get update` (as root), so that apt
    can name and download arm64 packages (nothing arm64 is installed)."""
    if foreign_arch_enabled():
        return
    if os.geteuid() != 0:
        raise TargetError("the arm64 testbed fetches Debian's arm64 packages, and apt does not "
                          "know the arm64 architecture yet; as root: dpkg --add-architecture "
                          "arm64 && apt-get update")
    progress("dpkg --add-architecture arm64; apt-get update")
    tb._run(["dpkg", "--add-architecture", ARCH])
    tb._run(["apt-get", "update"], env=tb._apt_env(), timeout=900)


def download(packages: list[str], dest: Path, progress: tb.Progress, *,
             offline: bool = False) -> None:
    """`apt-get download` the arm64 ``packages`` into ``dest``."""
    if offline:
        raise TargetError(f"offline, and {dest} lacks the arm64 packages "
                          + ", ".join(packages))
    _enable_foreign_arch(progress)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = ["apt-get", "download", *(f"{p}:{ARCH}" for p in packages)]
    progress(f"downloading {', '.join(packages)} ({ARCH})")
    try:
        try:
            tb._run(cmd, cwd=dest, env=tb._apt_env(), timeout=900)
        except TargetError as exc:
            # the architecture was added but the package lists predate it
            if "Unable to locate package" not in str(exc) or os.geteuid() != 0:
                raise
            progress("apt-get update (the package lists lack arm64 packages)")
            tb._run(["apt-get", "update"], env=tb._apt_env(), timeout=900)
            tb._run(cmd, cwd=dest, env=tb._apt_env(), timeout=900)
    except TargetError as exc:
        raise TargetError(f"downloading Debian's arm64 packages ({', '.join(packages)}) "
                          f"to {dest} failed: {exc}") from None


def _debs(dest: Path, package: str) -> list[Path]:
    """The downloaded .deb files of ``package`` (arm64, or arch-independent), oldest first."""
    return sorted([*dest.glob(f"{package}_*_{ARCH}.deb"), *dest.glob(f"{package}_*_all.deb")],
                  key=lambda p: p.stat().st_mtime)


# -- the kernel -----------------------------------------------------------------------
def image_package(abi: str) -> str:
    return f"linux-image-{abi}-{ARCH}-unsigned"


def kernel_root(abi: str, progress: tb.Progress = tb._quiet, *, offline: bool = False) -> Path:
    """linux-image-ABI-arm64-unsigned unpacked (its Image and modules), cached."""
    root = arm64_dir() / f"linux-{abi}"
    if not tb._kernel_complete(root, abi, ARCH) and not offline:
        _enable_foreign_arch(progress)
    return tb.unpack_kernel(root, arm64_dir() / "debs", abi, ARCH, image_package(abi),
                            progress, offline=offline,
                            apt_name=f"{image_package(abi)}:{ARCH}")


def kernel_image(root: Path, abi: str) -> Path:
    """Debian's arm64 vmlinuz is the kernel's uncompressed Image, which qemu boots."""
    image = root / "boot" / f"vmlinuz-{abi}-{ARCH}"
    with open(image, "rb") as f:
        head = f.read(64)
    if head[56:60] != b"ARM\x64":  # the arm64 Image header's magic (Documentation/arm64/booting.rst)
        raise TargetError(f"{image} is not an arm64 kernel Image (no ARM\\x64 magic)")
    return image


# -- the module -----------------------------------------------------------------------
def _headers_complete(abi: str) -> bool:
    root = headers_root(abi)
    return (root / ".complete").exists() and (root / "Makefile").exists()


def headers(abi: str, progress: tb.Progress = tb._quiet, *, offline: bool = False) -> Path:
    """linux-headers-ABI-arm64 unpacked in the cache, its scripts and tools (links into
    linux-kbuild-6.1 of the same architecture) pointed at the host's linux-kbuild."""
    root = headers_root(abi)
    if _headers_complete(abi):
        return root
    package = f"linux-headers-{abi}-{ARCH}"
    debs = arm64_dir() / "debs"
    if not _debs(debs, package):
        download([package], debs, progress, offline=offline)
    deb = _debs(debs, package)[-1]
    top = arm64_dir() / f"headers-{abi}"
    work = top.with_name(f"{top.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
        tb._run(["dpkg-deb", "-x", str(deb), str(work)])
        tree = work / root.relative_to(top)
        for name in ("scripts", "tools"):
            (tree / name).unlink(missing_ok=True)
            (tree / name).symlink_to(KBUILD / name)
        (tree / ".complete").touch()
        shutil.rmtree(top, ignore_errors=True)
        _publish(work, top)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def _publish(work: Path, final: Path) -> None:
    """Rename the finished ``work`` to ``final``; if another `up` or `prepare` made
    ``final`` first (the same packages, so the same content), keep theirs."""
    try:
        work.rename(final)
    except OSError:
        if not final.is_dir():
            raise


def _build_needs(abi: str) -> list[tb.Need]:
    what = f"to cross-build kerninst.ko for {abi}-{ARCH}"
    needs = [tb.Need(f"{tool}, {what}", pkg) for tool, pkg in
             ((f"{CROSS_COMPILE}gcc-12", "gcc-aarch64-linux-gnu"), ("make", "make"))
             if shutil.which(tool) is None]
    if not (common_headers(abi) / "Makefile").exists():
        needs.append(tb.Need(f"{common_headers(abi)}, which the arm64 headers' Makefile "
                             "includes", f"linux-headers-{abi}-common"))
    if not (KBUILD / "scripts" / "basic" / "fixdep").exists():
        needs.append(tb.Need(f"{KBUILD}, the host's kbuild programs (fixdep, modpost), {what}",
                             "linux-kbuild-6.1"))
    return needs


def module_sources_default() -> list[Path]:
    return [tb.REPO / "kmod" / n for n in tb.KMOD_SOURCES]


def module_dir_sources(directory: Path) -> list[Path]:
    """What kbuild builds a kerninst.ko from in ``directory``: its Makefile (or Kbuild),
    .c and .h files, and kmod/kerninst.h (the ABI) when it has no copy of its own."""
    if not directory.is_dir():
        raise TargetError(f"{directory}: no such directory (the module sources to build)")
    directory = directory.resolve()
    files = sorted(p for p in directory.iterdir()
                   if p.name in ("Makefile", "Kbuild") or p.suffix in (".c", ".h"))
    if not any(p.name in ("Makefile", "Kbuild") for p in files):
        raise TargetError(f"{directory}: no kbuild Makefile")
    if not any(p.name == "kerninst.h" for p in files):
        files.append(tb.REPO / "kmod" / "kerninst.h")
    return files


STANDIN = tb.REPO / "tests" / "kmod_arm64_standin"


def _build_name(files: list[Path]) -> str:
    """The cache directory's name for a module built from ``files`` (not kmod/)."""
    return f"kmod-{hashlib.sha256(str(files).encode()).hexdigest()[:8]}"


def cross_cc(progress: tb.Progress = tb._quiet) -> str:
    """aarch64-linux-gnu-gcc with a static C library for arm64 test programs
    (libc6-dev-arm64-cross), installed when missing."""
    needs = []
    if shutil.which(f"{CROSS_COMPILE}gcc") is None:
        needs.append(tb.Need("the arm64 cross compiler, for test programs", "gcc-aarch64-linux-gnu"))
    if not Path(f"/usr/{CROSS_COMPILE[:-1]}/lib/libc.a").exists():
        needs.append(tb.Need("arm64's static C library, for test programs",
                             "libc6-dev-arm64-cross"))
    tb._provide(needs, progress, offline=False)
    return f"{CROSS_COMPILE}gcc"


def build_module(abi: str, progress: tb.Progress = tb._quiet, *, offline: bool = False,
                 sources: list[Path] | None = None) -> Path:
    """kmod/ (or ``sources``: a Makefile and the files it builds) cross-built for arm64
    against the ABI's arm64 headers, in the cache; rebuilt when the sources change."""
    files = sources or module_sources_default()
    build = arm64_dir() / f"{'kmod' if sources is None else _build_name(files)}-{abi}"
    if tb.module_built(files, build, "kerninst.ko"):  # no headers, compiler or network
        return build / "kerninst.ko"
    tb._provide(_build_needs(abi), progress, offline)
    tree = headers(abi, progress, offline=offline)
    return tb.kbuild(files, build, "kerninst.ko", tree, progress,
                     make_vars=(f"ARCH={ARCH}", f"CROSS_COMPILE={CROSS_COMPILE}"),
                     needs=lambda: _build_needs(abi), offline=offline, what=f"for {ARCH}")


def build_test_module(files: list[Path], name: str, ko_name: str, abi: str,
                      progress: tb.Progress = tb._quiet) -> Path:
    """A test module (ksim.live.testbed.build_test_module) cross-built for arm64."""
    build = arm64_dir() / f"testmod-{name}-{abi}"
    if tb.module_built(files, build, ko_name):
        return build / ko_name
    tb._provide(_build_needs(abi), progress, False)
    return tb.kbuild(files, build, ko_name, headers(abi, progress), progress,
                     make_vars=(f"ARCH={ARCH}", f"CROSS_COMPILE={CROSS_COMPILE}"),
                     needs=lambda: _build_needs(abi), what=f"for {ARCH}")


# -- the userland ---------------------------------------------------------------------
def _userland_dirs() -> list[Path]:
    return sorted(p for p in arm64_dir().glob("userland-*") if (p / ".complete").exists())


#: Programs the userland may carry besides kerninstd's Python, by name (`up --with`):
#: the package, and the program it puts in /usr/bin.  bpftrace's closure is 23 packages
#: (LLVM 14, clang 14, libbpfcc, ICU, z3, ...): 57 MB of downloads, 280 MB unpacked.
TOOLS = {"bpftrace": ("bpftrace", "bpftrace")}


def _has_tools(root: Path, tools: tuple[str, ...]) -> bool:
    return all((root / "usr" / "bin" / TOOLS[t][1]).exists() for t in tools)


def _closure(packages: list[str]) -> list[str]:
    """``packages`` and what they depend on (Depends and Pre-Depends), arm64 or all,
    as apt names them."""
    out = tb._run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                   "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances",
                   *(f"{p}:{ARCH}" for p in packages)])
    found = []
    for line in out.splitlines():
        if line.startswith((" ", "<")):
            continue
        name = line.strip()
        if name.endswith(f":{ARCH}"):
            name = name[:-len(ARCH) - 1]
        elif ":" in name:
            continue  # another architecture's (an amd64 alternative)
        found.append(name)
    return list(dict.fromkeys(found))


def check_tools(tools: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise TargetError(f"the arm64 userland cannot carry {', '.join(unknown)} "
                          f"(it can carry: {', '.join(TOOLS)})")
    return tuple(sorted(set(tools)))


def userland(progress: tb.Progress = tb._quiet, *, offline: bool = False,
             refresh: bool = False, tools: tuple[str, ...] = ()) -> Path:
    """The arm64 userland kerninstd runs on (USERLAND_PACKAGES unpacked, usr-merged,
    the standard library compiled) and ``tools`` (TOOLS) with their dependencies, named
    after the packages it was made of.  The newest complete one that has the tools is
    used as it is; with ``refresh`` (or none yet) the packages apt offers now are
    downloaded and a new one made if they changed."""
    tools = check_tools(tools)
    made = [d for d in _userland_dirs() if _has_tools(d, tools)]
    if made and not refresh:
        return max(made, key=lambda p: p.stat().st_mtime)
    debs = arm64_dir() / "debs"
    packages = list(USERLAND_PACKAGES)
    if tools:
        if offline:
            raise TargetError(f"offline, and no arm64 userland in {arm64_dir()} has "
                              + ", ".join(tools))
        _enable_foreign_arch(progress)
        packages += [p for p in _closure([TOOLS[t][0] for t in tools]) if p not in packages]
    missing = [p for p in packages if not _debs(debs, p)]
    if missing or refresh:
        download(packages if refresh else missing, debs, progress, offline=offline)
    files = [_debs(debs, p)[-1] for p in packages]
    key = hashlib.sha256("\n".join(f.name for f in files).encode()).hexdigest()[:12]
    root = arm64_dir() / f"userland-{key}"
    if (root / ".complete").exists():
        return root
    progress(f"unpacking the arm64 userland ({len(files)} packages"
             + (f", with {', '.join(tools)})" if tools else ")"))
    work = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
        for f in files:
            tb._run(["dpkg-deb", "-x", str(f), str(work)])
        _merge_usr(work)
        _compile_stdlib(work, progress)
        (work / ".complete").write_text(json.dumps([f.name for f in files], indent=1) + "\n")
        _publish(work, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def _merge_usr(root: Path) -> None:
    """Move /bin, /sbin and /lib under /usr, as Debian's merged /usr has them: the guest
    mounts /usr alone and links /lib to usr/lib (where the dynamic loader is)."""
    for top in ("bin", "sbin", "lib"):
        src = root / top
        if not src.is_dir() or src.is_symlink():
            continue
        for dirpath, _dirs, names in os.walk(src):
            rel = Path(dirpath).relative_to(root)
            dest = root / "usr" / rel
            dest.mkdir(parents=True, exist_ok=True)
            for name in names:
                os.replace(Path(dirpath) / name, dest / name)
        shutil.rmtree(src)


def _compile_stdlib(root: Path, progress: tb.Progress) -> None:
    """Compile the standard library to .pyc with the host's Python 3.11 (bytecode does
    not depend on the CPU): Debian compiles it when the package is installed, and
    without it the guest's Python would compile asyncio and the rest under TCG at every
    start of kerninstd.  Skipped, at that cost only, when the host has no 3.11."""
    python = next((p for p in (sys.executable, shutil.which("python3.11"))
                   if p and _python_minor(p) == "3.11"), None)
    if python is None:
        progress("no Python 3.11 on the host: the arm64 standard library stays uncompiled")
        return
    lib = root / "usr" / "lib" / "python3.11"
    tb._run([python, "-m", "compileall", "-q", "-j", "0", "-d", "/usr/lib/python3.11",
             "-x", r"/(test|idlelib|lib2to3|tkinter|turtledemo)/", str(lib)], timeout=600)


def _python_minor(python: str) -> str:
    try:
        return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# -- prepare, initramfs, qemu ---------------------------------------------------------
def boot_needs() -> list[tb.Need]:
    return [tb.Need("qemu-system-aarch64, which boots the arm64 guest", "qemu-system-arm")
            ] if shutil.which("qemu-system-aarch64") is None else []


def prepare(abi: str, *, offline: bool = False, progress: tb.Progress = tb._quiet,
            refresh: bool = False, module_sources: list[Path] | None = None,
            tools: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything the arm64 guest needs before it boots, from the cache when it holds it."""
    tb._provide(boot_needs(), progress, offline)
    root = kernel_root(abi, progress, offline=offline)
    image = kernel_image(root, abi)
    land = userland(progress, offline=offline, refresh=refresh, tools=tools)
    ko = build_module(abi, progress, offline=offline, sources=module_sources)
    return {"abi": abi, "arch": ARCH, "cache": str(arm64_dir()), "kernel_root": str(root),
            "vmlinux": str(image), "module": str(ko), "userland": str(land),
            "module_source": str((module_sources or module_sources_default())[0].parent),
            "tools": [t for t in TOOLS if _has_tools(land, (t,))],
            "guest_modules": [str(m) for m in tb.guest_modules(root, abi, ARCH)]}


INIT = tb.INIT_PROLOGUE + r"""mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mount -t tmpfs tmp /tmp
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host || echo "ksim-init: 9p mount FAILED"
# The arm64 userland (Python, its libraries) is /usr, from the host's cache; /lib is
# a link to usr/lib in this initramfs.  The checkout and the testbed cache (the
# token, test programs and modules) are where they are on the host.
mount --bind /host@USERLAND@/usr /usr || echo "ksim-init: no arm64 userland"
for p in @SHARE@; do
    mkdir -p "$p"
    mount --bind "/host$p" "$p" || echo "ksim-init: cannot share $p"
done
echo "ksim-init: starting kerninstd"
cd /
# As on x86 (ksim.live.testbed.INIT): kerninstd restarted when it dies, the module
# reloaded in between when @RELOAD@ exists.
""" + tb.INIT_DAEMON.replace("@ENV@", "/bin/env").replace("@GUEST_RELOAD@", "@RELOAD@")


def shared_paths() -> list[str]:
    """Host directories the guest mounts at the same path: the checkout (kerninstd's
    code) and the testbed cache (token, programs and modules tests hand the guest)."""
    paths = {str(tb.REPO), str(tb.cache_dir())}
    # one inside the other: the outer one is enough
    return sorted(p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths))


def make_initramfs(ready: dict[str, Any], port: int, out: Path) -> Path:
    land = Path(ready["userland"])
    busybox = land / "usr" / "bin" / "busybox"
    if not tb._is_static_elf(busybox):
        raise TargetError(f"{busybox}: not a static busybox (the userland is incomplete: "
                          f"remove {land} and `up` makes it again)")
    archive = tb.Cpio()
    for d in ("bin", "dev", "proc", "sys", "host", "modules", "tmp", "usr", "etc"):
        archive.dir(d)
    archive.symlink("lib", "usr/lib")
    archive.file("bin/busybox", busybox.read_bytes(), 0o755)
    names = []
    for path in map(Path, ready["guest_modules"]):
        archive.file(f"modules/{path.name}", path.read_bytes())
        names.append(path.name)
    archive.file("modules.list", ("\n".join(names) + "\n").encode())
    archive.file("kerninst.ko", Path(ready["module"]).read_bytes())
    init = (INIT.replace("@USERLAND@", str(land)).replace("@REPO@", str(tb.REPO))
            .replace("@SHARE@", " ".join(shared_paths())).replace("@PYTHON@", PYTHON)
            .replace("@RELOAD@", tb.RELOAD_FLAG).replace("@PORT@", str(port))
            .replace("@TOKEN@", str(tb.token_path())))
    archive.file("init", init.encode(), 0o755)
    out.write_bytes(archive.finish())
    return out


def qemu_command(ready: dict[str, Any], initramfs: Path, port: int,
                 inst: tb.Instance) -> list[str]:
    d = inst.dir
    return [
        "qemu-system-aarch64", "-name", inst.qemu_name,
        "-M", "virt", "-cpu", CPU,
        "-kernel", ready["vmlinux"], "-initrd", str(initramfs),
        "-append", "console=ttyAMA0 panic=-1 oops=panic nokaslr quiet loglevel=4",
        "-m", "1G", "-smp", "2",
        # single-threaded TCG, as on x86 (ksim.live.testbed.qemu_command): every vCPU
        # sees each code write
        "-accel", "tcg,thread=single",
        "-display", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{d / 'console.log'}",
        "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off",
        "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:{port}",
        "-device", "virtio-net-pci,netdev=n0,romfile=",
    ]
