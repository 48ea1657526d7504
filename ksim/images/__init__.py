"""Bundled kernel images: a registry, and builds from source into a cache.

``build(name)`` runs the image's Makefile into
``$KSIM_CACHE/images/<name>-<hash>/`` (``~/.cache/ksim`` when KSIM_CACHE is
unset), where the hash covers every source file and the compiler's version:
changing a source file gives a new directory, so a stale build is never used.
A file lock makes concurrent builds (parallel tests, several processes) wait
for one another instead of racing.  ksim builds an image on first use
(``path(name)``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ksim.errors import ImageBuildError, UnknownImage
from ksim.images import toy


def _images_dir() -> Path:
    """KSIM_IMAGES_DIR; else images/ at the top of the source tree (next to the ksim
    package); else the copy an installed, non-editable ksim carries (setup.py)."""
    if os.environ.get("KSIM_IMAGES_DIR"):
        return Path(os.environ["KSIM_IMAGES_DIR"])
    tree = Path(__file__).resolve().parent.parent.parent / "images"
    return tree if tree.is_dir() else Path(__file__).resolve().parent / "src"


IMAGES_DIR = _images_dir()


@dataclass(frozen=True, slots=True)
class ImageSpec:
    name: str
    arch: str
    #: directory holding the Makefile and sources
    source_dir: Path
    #: file name of the built ELF inside the build directory
    elf_name: str
    description: str = ""
    #: extra arguments to make (the architecture), part of the build's identity
    make_args: tuple[str, ...] = ()
    #: the C compiler the Makefile uses with these arguments
    compiler: str = "gcc"
    #: (name in the x86 toy, name here) for functions this build names otherwise
    renames: tuple[tuple[str, str], ...] = ()

    def local_name(self, name: str) -> str:
        """What this image calls the x86 toy's function ``name`` (ksim.images.toy
        lists the toy's functions by their x86 names)."""
        return dict(self.renames).get(name, name)


_REGISTRY: dict[str, ImageSpec] = {
    "toy": ImageSpec(
        name="toy",
        arch="x86_64",
        source_dir=IMAGES_DIR / "toy",
        elf_name="toy.elf",
        description="the toy x86-64 kernel (C, gcc -mcmodel=kernel), bootable by QEMU (PVH)",
    ),
    "toy-arm64": ImageSpec(
        name="toy-arm64",
        arch="aarch64",
        source_dir=IMAGES_DIR / "toy",
        elf_name="toy.elf",
        description="the toy kernel built for AArch64 (aarch64-linux-gnu-gcc), bootable by "
                    "qemu-system-aarch64 -M virt",
        make_args=("ARCH=arm64",),
        compiler="aarch64-linux-gnu-gcc",
        renames=tuple(toy.ARM64_NAMES.items()),
    ),
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> ImageSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownImage(f"unknown image {name!r}; known images: {', '.join(names())}") from None


def cache_root() -> Path:
    root = os.environ.get("KSIM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "ksim"


def _sources(spec: ImageSpec) -> list[Path]:
    if not (spec.source_dir / "Makefile").is_file():
        raise ImageBuildError(f"image {spec.name!r}: no Makefile in {spec.source_dir}")
    out = []
    for p in sorted(spec.source_dir.rglob("*")):
        rel = p.relative_to(spec.source_dir)
        if p.is_file() and rel.parts[0] != "build" and p.suffix in {".c", ".h", ".S", ".ld", ""}:
            out.append(p)
    return out


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              check=False).stdout.splitlines()[0]
    except (OSError, IndexError):
        return f"{compiler}: not found"


def source_hash(name: str) -> str:
    """Hash of the image's sources (paths and contents), its make arguments and the
    versions of the compiler and of pahole (which writes the image's BTF)."""
    spec = get(name)
    h = hashlib.sha256(_compiler_version(spec.compiler).encode())
    h.update(_compiler_version("pahole").encode() + b"\0")
    if spec.make_args:  # the x86 image's hash stays what it was
        h.update(" ".join(spec.make_args).encode() + b"\0")
    for p in _sources(spec):
        h.update(str(p.relative_to(spec.source_dir)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_dir(name: str) -> Path:
    return cache_root() / "images" / f"{name}-{source_hash(name)}"


def build(name: str, force: bool = False) -> Path:
    """Build the image (if not already built for these sources) and return its ELF path."""
    spec = get(name)
    out = build_dir(name)
    elf = out / spec.elf_name
    if elf.is_file() and not force:
        return elf
    try:
        return _build_locked(spec, out, force)
    except OSError as exc:
        # KSIM_CACHE a regular file, a directory that cannot be created or written
        raise ImageBuildError(f"cannot build image {name!r} in the cache {cache_root()} "
                              f"($KSIM_CACHE, else ~/.cache/ksim): {exc.filename or out}: "
                              f"{exc.strerror or exc}") from exc


def _build_locked(spec: ImageSpec, out: Path, force: bool) -> Path:
    """``build``'s make into ``out``, under the build's lock (OSError: the cache
    cannot be written)."""
    elf = out / spec.elf_name
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if elf.is_file() and not force:
            return elf  # another process built it while we waited
        obj = out / "obj"
        if force and obj.exists():
            shutil.rmtree(obj)
        obj.mkdir(parents=True, exist_ok=True)
        cmd = ["make", "-C", str(spec.source_dir), f"O={obj}", "-j2", *spec.make_args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise ImageBuildError(f"cannot run make for image {spec.name!r}: {exc}") from exc
        built = obj / spec.elf_name
        if proc.returncode != 0 or not built.is_file():
            err = ImageBuildError(
                f"building image {spec.name!r} failed (make exited {proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-4000:]}")
            err.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
            raise err
        # Publish atomically: an ELF at the final path is always complete.
        tmp = out / f".{spec.elf_name}.tmp"
        shutil.copyfile(built, tmp)
        os.replace(tmp, elf)
    return elf


def path(name: str) -> Path:
    """The built ELF of an image, building it first if needed."""
    return build(name)
