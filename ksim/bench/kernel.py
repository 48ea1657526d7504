"""The real kernels the benchmarks measure: Debian's 6.1 amd64 package (and its
arm64 counterpart, ``debian_kernel(arch="arm64")``, see below).

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

arm64 (``linux-image-<abi>-arm64-unsigned``, fetched the same way once
``dpkg --add-architecture arm64`` and ``apt-get update`` have run):

* ``vmlinuz`` is the flat ``Image`` (arch/arm64/kernel/image.h: the header's
  ``text_offset`` at 8, ``image_size`` at 16, bss included; gzip'd in some
  packages), loaded at ``_text``; there is no ELF in the package, and its
  ``System.map`` is a one-line stub ("The real System.map is in the
  linux-image-<version>-dbg package").  The -dbg package's ELF vmlinux with
  its full symbol table is some 800 MB; the Image's own kallsyms table (the
  same decoder as amd64's, offsets relative to ``kallsyms_relative_base``
  without absolute per-cpu symbols) names every function, which is what the
  differential runs need.  It has no data symbols (CONFIG_KALLSYMS_ALL is off
  on arm64), so the section bounds come from the text symbols (``_etext``,
  ``_sinittext``, ``_einittext``) and the header.
* The kernel is relocatable and linked with ``--no-apply-dynamic-relocs``
  (arch/arm64/Makefile): every absolute pointer in the Image is zero until
  ``__relocate_kernel`` (arch/arm64/kernel/pi/relocate.c in later kernels,
  head.S in 6.1) applies ``.rela.dyn``.  Its R_AARCH64_RELATIVE entries
  (``Elf64_Rela``: offset, info 1027, addend) are found as the one long run of
  them and applied for the link address (no KASLR displacement), which also
  gives ``kallsyms_relative_base``.
* The address-keyed tables are found by their content and their
  ``__start_``/``__stop_`` symbols added to the kallsyms file:
  ``__bug_table`` (12-byte entries whose first field leads to a ``BRK #0x800``),
  ``__ex_table`` (12-byte entries whose instruction and fix-up both lead into
  text, sorted by instruction as scripts/sorttable leaves them),
  ``__jump_table`` (16-byte entries whose code is a NOP or a B and whose target
  is text) and ``__mcount_loc`` (ascending absolute text addresses, after
  relocation).  ``load_arm64_image`` makes the Image from both.
"""

from __future__ import annotations

import glob
import os
import re
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from ksim.errors import KsimError, MalformedImage
from ksim.image.bzimage import decompress_bzimage as bzimage_payload

if TYPE_CHECKING:
    from ksim.image.image import Image

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


@dataclass(frozen=True)
class DebianArm64Kernel:
    abi: str            # e.g. "6.1.0-56-arm64"
    deb: Path
    image: Path         # the flat Image, relocated for its link address (no ELF)
    kallsyms: Path      # /proc/kallsyms format: the Image's own table, plus the
                        # bounds of the tables found in it
    base: int           # where the Image is linked (_text)

    def as_dict(self) -> dict[str, str]:
        return {"abi": self.abi, "package": self.deb.name}

    def load(self) -> Image:
        return load_arm64_image(self.image, self.kallsyms, self.base)


@overload
def debian_kernel(arch: Literal["amd64"] = "amd64") -> DebianKernel: ...


@overload
def debian_kernel(arch: Literal["arm64"]) -> DebianArm64Kernel: ...


def debian_kernel(arch: str = "amd64") -> DebianKernel | DebianArm64Kernel:
    """Fetch (once) and unpack the Debian kernel of ``arch`` ("amd64" or "arm64");
    everything stays in ~/.cache/ksim."""
    if arch == "arm64":
        return _debian_arm64_kernel()
    if arch != "amd64":
        raise KernelUnavailable(f"no Debian kernel for {arch!r} (amd64 or arm64)")
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
        # back to token 0, which is the one kallsyms_token_index follows; the
        # digits are not always token 48 (arm64)
        for _ in range(256):
            found = _tokens_at(data, start)
            if found is not None:
                return start, found
            if start < 2 or data[start - 1] != 0:
                break
            previous = data.rfind(b"\0", 0, start - 1) + 1
            # token 0 may follow a non-NUL byte (arm64: kallsyms_seqs_of_names)
            for at in range(start - 2, previous, -1):
                found = _tokens_at(data, at)
                if found is not None:
                    return at, found
            start = previous
    raise KernelUnavailable("kallsyms_token_table not found")


def _tokens_at(data: bytes, start: int) -> list[bytes] | None:
    """The 256 tokens of a kallsyms_token_table at ``start``, if kallsyms_token_index
    follows them there."""
    offsets, k = [], start
    for _ in range(256):
        end = data.find(b"\0", k)
        if end <= k:
            break
        offsets.append(k - start)
        k = end + 1
    index_at = (k + 7) & ~7
    if len(offsets) == 256 and data[index_at:index_at + 512] == struct.pack("<256H", *offsets):
        return [data[start + o:data.index(b"\0", start + o)] for o in offsets]
    return None


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


# --- arm64: the flat Image ----------------------------------------------------------
ARM64_PACKAGE_GLOB = "linux-image-*-arm64-unsigned_*_arm64.deb"
#: Elf64_Rela's r_info of R_AARCH64_RELATIVE (aaelf64 5.7.12): type 1027, no symbol
_R_AARCH64_RELATIVE = 1027
#: BUG()/WARN(): BRK #BUG_BRK_IMM (arch/arm64/include/asm/brk-imm.h)
_BRK_BUG = 0xD4200000 | 0x800 << 5
_NOP = 0xD503201F
#: fewest entries a run of content must have to be taken for a table
_TABLE_MIN = 64


def _debian_arm64_kernel() -> DebianArm64Kernel:
    deb = _find_or_fetch(ARM64_PACKAGE_GLOB, "arm64")
    m = re.match(r"linux-image-(.+-arm64)-unsigned_", deb.name)
    if m is None:
        raise KernelUnavailable(f"unexpected package name {deb.name}")
    abi = m.group(1)
    root = BENCH_CACHE / abi
    image, syms, based = root / "Image", root / "kallsyms", root / "base"
    if not (image.exists() and syms.exists() and based.exists()):
        root.mkdir(parents=True, exist_ok=True)
        _unpack(deb, root, [f"./boot/vmlinuz-{abi}"])
        raw = (root / "boot" / f"vmlinuz-{abi}").read_bytes()
        if raw[:2] == b"\x1f\x8b":
            import gzip

            raw = gzip.decompress(raw)
        data, base, symbols = arm64_image(raw)
        tmp = image.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(image)
        syms.write_text(to_kallsyms_text(symbols))
        based.write_text(f"{base:#x}\n")
    return DebianArm64Kernel(abi, deb, image, syms, int(based.read_text(), 16))


def _find_or_fetch(pattern: str, arch: str) -> Path:
    found = sorted(glob.glob(str(BENCH_CACHE / pattern)))
    if found:
        return Path(found[-1])
    BENCH_CACHE.mkdir(parents=True, exist_ok=True)
    out = _run(["apt-cache", "search", "--names-only",
                rf"^linux-image-[0-9.]+-[0-9]+-{arch}-unsigned$"])
    names = re.findall(rf"^(linux-image-(\S+)-{arch}-unsigned)\s", out, re.M)
    if not names:
        raise KernelUnavailable(f"apt knows no linux-image-*-{arch}-unsigned package (run "
                                f"dpkg --add-architecture {arch}; apt-get update)")
    name = max(names, key=lambda item: [int(x) for x in re.findall(r"\d+", item[1])])[0]
    _run(["apt-get", "download", f"{name}:{arch}"], cwd=BENCH_CACHE)
    found = sorted(glob.glob(str(BENCH_CACHE / pattern)))
    if not found:
        raise KernelUnavailable(f"apt-get download {name}:{arch} left no package in {BENCH_CACHE}")
    return Path(found[-1])


def arm64_image(raw: bytes) -> tuple[bytes, int, list[tuple[int, str, str]]]:
    """(the Image relocated for its link address, that address, its symbols with
    the tables' bounds) of an arm64 Image (see the module docstring)."""
    if raw[56:60] != b"ARM\x64":
        raise KernelUnavailable("not an arm64 Image (no ARM\\x64 magic at 56)")
    data = bytearray(raw)
    relocations = _rela_run(raw)
    base = min(addend for _offset, addend in relocations) & ~0x1FFFFF
    for offset, addend in relocations:
        at = offset - base
        if not 0 <= at <= len(data) - 8:
            raise KernelUnavailable(f"relocation at {offset:#x} outside the Image")
        struct.pack_into("<Q", data, at, addend)
    symbols = _arm64_kallsyms(bytes(data))
    named = {n: a for a, _t, n in symbols}
    if not base < named.get("_stext", 0) < named.get("_etext", 0) <= base + len(data):
        raise KernelUnavailable(f"_stext.._etext is not text of an Image linked at {base:#x}")
    # the header is _text (kallsyms keeps no symbol before _stext)
    image_size = struct.unpack_from("<Q", raw, 16)[0]
    symbols += [(base, "T", "_text"), (base + max(image_size, len(data)), "B", "_end")]
    named["_text"] = base
    text = (named["_text"], named["_etext"])
    init = (named["_sinittext"], named["_einittext"])
    symbols += _arm64_tables(bytes(data), base, (text, init))
    return bytes(data), base, symbols


def _rela_run(raw: bytes) -> list[tuple[int, int]]:
    """(offset, addend) of every entry of .rela.dyn: the longest run of 24-byte
    R_AARCH64_RELATIVE entries."""
    info = struct.pack("<Q", _R_AARCH64_RELATIVE)
    best: list[tuple[int, int]] = []
    run: list[tuple[int, int]] = []
    previous = -1
    for m in re.finditer(re.escape(info), raw):
        at = m.start() - 8
        if at % 8 or at < 0:
            continue
        if at != previous + 24:
            run = []
        offset, _info, addend = struct.unpack_from("<QQQ", raw, at)
        run.append((offset, addend))
        previous = at
        if len(run) > len(best):
            best = run
    if len(best) < 1000:
        raise KernelUnavailable("no .rela.dyn in the Image")
    return best


def _arm64_kallsyms(data: bytes) -> list[tuple[int, str, str]]:
    """The kallsyms table of a relocated Image: CONFIG_KALLSYMS_BASE_RELATIVE
    without absolute per-cpu symbols, every address kallsyms_relative_base plus
    an unsigned offset."""
    table, tokens = _token_table(data)
    count, names_at = _num_syms(data, table, tokens)
    names, _ = _names(data, names_at, count, tokens)
    base = struct.unpack_from("<Q", data, names_at - 16)[0]
    for pad in (0, 4):
        offsets = struct.unpack_from(f"<{count}I", data, names_at - 16 - pad - 4 * count)
        addrs = [base + o for o in offsets]
        if addrs == sorted(addrs):
            break
    else:
        raise KernelUnavailable("kallsyms_offsets not found before kallsyms_num_syms")
    return [(a, n[:1].decode(), n[1:].decode("ascii", "replace"))
            for a, n in zip(addrs, names, strict=True)]


def _arm64_tables(data: bytes, base: int,
                  texts: tuple[tuple[int, int], ...]) -> list[tuple[int, str, str]]:
    """``__start_X``/``__stop_X`` of the tables found in the Image by their content."""
    import array

    def in_text(address: int) -> bool:
        return any(lo <= address < hi for lo, hi in texts) and not address & 3

    def word(address: int) -> int:
        return int.from_bytes(data[address - base:address - base + 4], "little")

    lo = texts[0][1] - base  # the tables lie past the text
    lo += -lo & 7
    words = array.array("i")
    words.frombytes(data[lo:len(data) - (len(data) - lo) % 4])
    (tlo, thi), (ilo, ihi) = texts
    # the 4-byte fields that lead into text (relative to themselves)
    leads = bytearray(len(words))
    for k, v in enumerate(words):
        to = base + lo + 4 * k + v
        if (tlo <= to < thi or ilo <= to < ihi) and not to & 3:
            leads[k] = 1

    def longest(ok: Callable[[int], bool], stride: int, count: int | None = None) -> tuple[int, int]:
        """(first index, length) of the longest run of ``ok`` items ``stride`` apart,
        among ``count`` items (the words' tables: all but the last stride)."""
        count = len(words) - stride if count is None else count
        best, start, n = (0, 0), 0, 0
        for phase in range(stride):
            n = 0
            for k in range(phase, count, stride):
                if ok(k):
                    if n == 0:
                        start = k
                    n += 1
                    if n > best[1]:
                        best = (start, n)
                else:
                    n = 0
        return best

    def target(k: int) -> int:
        return base + lo + 4 * k + words[k]

    out: list[tuple[int, str, str]] = []

    def add(name: str, found: tuple[int, int], entry: int, unit: int = 4) -> None:
        start, n = found
        if n >= _TABLE_MIN:
            at = base + lo + unit * start
            out.extend([(at, "D", f"__start_{name}"), (at + n * entry, "D", f"__stop_{name}")])

    # (a BUG in exit text, which kallsyms does not bound, too)
    top = base + len(data)
    add("__bug_table", longest(lambda k: base <= target(k) < top and not target(k) & 3
                               and word(target(k)) == _BRK_BUG, 3), 12)
    # (.altinstructions has the same shape, but its instructions are not all
    # loads and stores: "Loads and Stores" is op0 x1x0, Arm ARM C4.1)
    add("__ex_table", longest(lambda k: bool(leads[k] and leads[k + 1])
                              and word(target(k)) & 0x0A000000 == 0x08000000
                              and (k < 3 or target(k - 3) <= target(k)), 3), 12)
    add("__jump_table", longest(lambda k: bool(leads[k] and leads[k + 1]) and (
        word(target(k)) == _NOP or word(target(k)) >> 26 == 0b000101), 4), 16)
    # __mcount_loc: absolute addresses of the first of each function's two
    # patchable-entry NOPs (-fpatchable-function-entry=2)
    quads = array.array("Q")
    quads.frombytes(data[lo:len(data) - (len(data) - lo) % 8])
    add("mcount_loc", longest(lambda k: in_text(quads[k]) and word(quads[k]) == _NOP, 1,
                              len(quads)), 8, unit=8)
    return out


def load_arm64_image(image: Path, kallsyms: Path, base: int) -> Image:
    """An arm64 kernel Image from its flat bytes and its symbols (what
    :func:`debian_kernel` ``(arch="arm64")`` made): text from ``_text`` to
    ``_etext``, read-only data to ``_sinittext``, init text to ``_einittext``,
    data to the end of the file and bss to ``_end``."""
    from ksim.image.image import Image
    from ksim.image.kallsyms import bindings, kallsyms_columns, symbol_table
    from ksim.image.model import Section

    data = image.read_bytes()
    addresses, letters, names, modules = kallsyms_columns(kallsyms.read_text(), str(kallsyms))
    at = dict(zip(names, addresses, strict=True))

    def section(name: str, lo: int, hi: int, executable: bool, writable: bool,
                with_data: bool = True) -> Section:
        return Section(name, lo, hi - lo, executable, writable,
                       data[lo - base:hi - base] if with_data else b"")

    end_of_file = base + len(data)
    sections = (
        section(".text", base, at["_etext"], True, False),
        section(".rodata", at["_etext"], at["_sinittext"], False, False),
        section(".init.text", at["_sinittext"], at["_einittext"], True, False),
        section(".data", at["_einittext"], end_of_file, False, True),
        section(".bss", end_of_file, max(at["_end"], end_of_file), False, True, False),
    )
    return Image(str(image), "aarch64", "vmlinux", sections,
                 symbol_table(addresses, letters, names, modules, sections),
                 bindings=bindings(letters, names))
