"""The real kernel the benchmarks measure: Debian's 6.1 amd64 package.

``debian_kernel()`` returns the paths of a decompressed ELF ``vmlinux``, its symbol
list in /proc/kallsyms format, ``e100.ko`` and ``ext4.ko`` — all under ``~/.cache/ksim/``.

* The package is ``linux-image-<abi>-amd64-unsigned``, fetched with
  ``apt-get download`` (no installation; the host's kernel is not touched) and
  unpacked with ``dpkg-deb -x``.  A .deb the live testbed already fetched into
  ``~/.cache/ksim/testbed/`` is reused, and so is the testbed's own helper when
  ``ksim.live.testbed`` provides one.
* ``vmlinuz`` is a bzImage: its payload is an xz stream holding ``vmlinux`` as an
  ELF with section headers but no symbol table (arch/x86/boot/compressed/Makefile
  strips it with ``objcopy -S``).
* Symbols come from the kallsyms table the kernel carries in ``.rodata``
  (scripts/kallsyms.c): ``kallsyms_offsets`` (s32, base-relative with absolute
  per-cpu symbols), ``kallsyms_relative_base``, ``kallsyms_num_syms``,
  ``kallsyms_names`` (length-prefixed token strings; a length byte with bit 7 set
  takes a second byte), ``kallsyms_markers``, ``kallsyms_seqs_of_names`` (6.1.y
  backport), ``kallsyms_token_table`` and ``kallsyms_token_index``.  The first
  character of each expanded name is its type letter, as in /proc/kallsyms.
"""

from __future__ import annotations

import glob
import os
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ksim.errors import KsimError, MalformedImage
from ksim.image.bzimage import decompress_bzimage as bzimage_payload

CACHE = Path(os.environ.get("KSIM_CACHE", Path.home() / ".cache" / "ksim"))
BENCH_CACHE = CACHE / "bench"
PACKAGE_GLOB = "linux-image-*-amd64-unsigned_*_amd64.deb"
E100 = "lib/modules/{abi}/kernel/drivers/net/ethernet/intel/e100.ko"
EXT4 = "lib/modules/{abi}/kernel/fs/ext4/ext4.ko"


class KernelUnavailable(KsimError):
    """The Debian kernel package could not be fetched or unpacked."""


@dataclass(frozen=True)
class DebianKernel:
    abi: str            # e.g. "6.1.0-56-amd64"
    deb: Path
    vmlinux: Path       # decompressed ELF, no symbols
    kallsyms: Path      # /proc/kallsyms format, extracted from the image
    e100: Path
    ext4: Path

    def as_dict(self) -> dict[str, str]:
        return {"abi": self.abi, "package": self.deb.name}


def debian_kernel() -> DebianKernel:
    """Fetch (once) and unpack the Debian kernel; everything stays in ~/.cache/ksim."""
    deb = _find_or_fetch_deb()
    abi = _abi_of(deb)
    root = BENCH_CACHE / abi
    vmlinux, syms = root / "vmlinux", root / "kallsyms"
    e100, ext4 = root / E100.format(abi=abi), root / EXT4.format(abi=abi)
    if not ext4.exists():
        root.mkdir(parents=True, exist_ok=True)
        _unpack(deb, root, ["./" + EXT4.format(abi=abi)])
    if not (vmlinux.exists() and syms.exists() and e100.exists()):
        root.mkdir(parents=True, exist_ok=True)
        _unpack(deb, root, [f"./boot/vmlinuz-{abi}", "./" + E100.format(abi=abi)])
        vmlinuz = root / "boot" / f"vmlinuz-{abi}"
        tmp = vmlinux.with_suffix(".tmp")
        tmp.write_bytes(decompress_bzimage(vmlinuz.read_bytes()))
        tmp.replace(vmlinux)
        text = to_kallsyms_text(extract_kallsyms(vmlinux.read_bytes()))
        syms.write_text(text)
    return DebianKernel(abi, deb, vmlinux, syms, e100, ext4)


def is_cached() -> bool:
    """Whether an unpacked kernel is already in the cache (no download, no unpacking)."""
    return any((d / "kallsyms").exists() and (d / "vmlinux").exists()
               for d in BENCH_CACHE.glob("*-amd64"))


def _unpack(deb: Path, root: Path, members: list[str]) -> None:
    """``dpkg-deb --fsys-tarfile | tar -x MEMBERS``: only the files needed (the whole
    package unpacks to ~470 MB of modules)."""
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as dpkg:
        tar = subprocess.run(["tar", "-x", "-C", str(root), *members], stdin=dpkg.stdout,
                             capture_output=True, text=True, timeout=600)
        dpkg.wait(timeout=600)
    if tar.returncode != 0 or dpkg.returncode != 0:
        raise KernelUnavailable(f"unpacking {deb.name}: {tar.stderr.strip()[-400:]}")


def _find_or_fetch_deb() -> Path:
    for directory in (CACHE / "testbed", BENCH_CACHE):
        found = sorted(glob.glob(str(directory / PACKAGE_GLOB)))
        if found:
            return Path(found[-1])
    try:  # the live testbed's own fetcher, when it has one
        from ksim.live import testbed  # type: ignore[attr-defined]

        fetch = getattr(testbed, "fetch_kernel_package", None)
        if fetch is not None:
            return Path(fetch())
    except ImportError:
        pass
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    name = _newest_package_name()
    _run(["apt-get", "download", name], cwd=BENCH_CACHE)
    found = sorted(glob.glob(str(BENCH_CACHE / PACKAGE_GLOB)))
    if not found:
        raise KernelUnavailable(f"apt-get download {name} left no package in {BENCH_CACHE}")
    return Path(found[-1])


def _newest_package_name() -> str:
    """The newest linux-image-<abi>-amd64-unsigned apt knows (the ABI changes with updates)."""
    out = _run(["apt-cache", "search", "--names-only", r"^linux-image-[0-9.]+-[0-9]+-amd64-unsigned$"])
    names = re.findall(r"^(linux-image-(\S+)-amd64-unsigned)\s", out, re.M)
    if not names:
        raise KernelUnavailable("apt knows no linux-image-*-amd64-unsigned package (run apt-get update)")

    def key(item: tuple[str, str]) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", item[1])]

    return max(names, key=key)[0]


def _abi_of(deb: Path) -> str:
    m = re.match(r"linux-image-(.+-amd64)-unsigned_", deb.name)
    if m is None:
        raise KernelUnavailable(f"unexpected package name {deb.name}")
    return m.group(1)


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{' '.join(cmd)}: {exc}") from exc
    if proc.returncode != 0:
        raise KernelUnavailable(f"{' '.join(cmd)}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


# --- bzImage -> vmlinux ------------------------------------------------------------
def decompress_bzimage(bzimage: bytes) -> bytes:
    """The ELF vmlinux inside a bzImage, as a benchmark input."""
    try:
        return bzimage_payload(bzimage)
    except MalformedImage as exc:
        raise KernelUnavailable(str(exc)) from None


# --- the kallsyms table ---------------------------------------------------------------
def extract_kallsyms(elf_bytes: bytes) -> list[tuple[int, str, str]]:
    """(address, type letter, name) for every symbol of the kernel's own kallsyms table."""
    import io

    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(elf_bytes))
    rodata = elf.get_section_by_name(".rodata")
    if rodata is None:
        raise KernelUnavailable("vmlinux has no .rodata")
    data = rodata.data()
    table, tokens = _token_table(data)
    count, names_at = _num_syms(data, table, tokens)
    names, _ = _names(data, names_at, count, tokens)
    base = struct.unpack_from("<Q", data, names_at - 16)[0]
    for pad in (0, 4):
        offsets_at = names_at - 16 - pad - 4 * count
        offsets = struct.unpack_from(f"<{count}i", data, offsets_at)
        addrs = [o if o >= 0 else base - 1 - o for o in offsets]
        text = [a for a in addrs if a >= base]
        if text == sorted(text):
            break
    else:
        raise KernelUnavailable("kallsyms_offsets not found before kallsyms_num_syms")
    return [(a, n[:1].decode(), n[1:].decode("ascii", "replace")) for a, n in zip(addrs, names, strict=False)]


def to_kallsyms_text(symbols: list[tuple[int, str, str]]) -> str:
    return "".join(f"{a:016x} {t} {n}\n" for a, t, n in sorted(symbols))


def _token_table(data: bytes) -> tuple[int, list[bytes]]:
    """kallsyms_token_table: 256 NUL-terminated strings, the digits as single
    characters among them, followed (8-aligned) by kallsyms_token_index (u16 offsets)."""
    digits = b"".join(bytes([c]) + b"\0" for c in b"0123456789")
    for m in re.finditer(re.escape(digits), data):
        start = m.start()
        for _ in range(ord("0")):  # back to token 0
            if start < 2 or data[start - 1] != 0:
                break
            start = data.rfind(b"\0", 0, start - 1) + 1
        offsets, k = [], start
        for _ in range(256):
            end = data.find(b"\0", k)
            if end <= k:
                break
            offsets.append(k - start)
            k = end + 1
        index_at = (k + 7) & ~7
        if len(offsets) == 256 and data[index_at:index_at + 512] == struct.pack("<256H", *offsets):
            return start, [data[start + o:data.index(b"\0", start + o)] for o in offsets]
    raise KernelUnavailable("kallsyms_token_table not found")


def _num_syms(data: bytes, table: int, tokens: list[bytes]) -> tuple[int, int]:
    """kallsyms_num_syms (a u32 in an 8-byte slot) is the one, going back from the
    token table, whose name stream decodes into names that all start with a type letter."""
    for at in range(table & ~7, 8, -8):
        count, high = struct.unpack_from("<II", data, at)
        if not (1000 < count < 4_000_000 and high == 0):
            continue
        try:
            names, end = _names(data, at + 8, min(count, 200), tokens)
        except (IndexError, ValueError):
            continue
        if all(re.fullmatch(rb"[A-Za-z][\x21-\x7e]+", n) for n in names):
            return count, at + 8
    raise KernelUnavailable("kallsyms_num_syms not found")


def _names(data: bytes, at: int, count: int, tokens: list[bytes]) -> tuple[list[bytes], int]:
    out = []
    for _ in range(count):
        n = data[at]
        at += 1
        if n & 0x80:
            n = (n & 0x7F) | (data[at] << 7)
            at += 1
        if n == 0:
            raise ValueError("empty kallsyms name")
        out.append(b"".join(tokens[b] for b in data[at:at + n]))
        at += n
    return out, at
