"""The ``.BTF`` section of an ELF file: a vmlinux (where it is loaded, and the kernel
serves it as /sys/kernel/btf/vmlinux) or a module's ``.ko`` (split BTF on vmlinux's).

Only the section headers and the section itself are read: a vmlinux is some 60 MB,
its BTF 4 MB.  ELF64 and ELF32, either byte order (System V gABI, "Sections").
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from ksim.btf.errors import BTFError

SECTION = ".BTF"
_SHT_NOBITS = 8
#: per ELF class: the header's (e_shoff, e_shentsize, e_shnum, e_shstrndx) and a
#: section header's (sh_name, sh_type, sh_offset, sh_size), as struct formats
_LAYOUT = {
    1: ("16xHHIIIIIHHHHHH", "IIIIIIIIII", 52),
    2: ("16xHHIQQQIHHHHHH", "IIQQQQIIQQ", 64),
}


def btf_section(path_or_bytes: str | os.PathLike[str] | bytes) -> bytes:
    """The bytes of the ELF's ``.BTF`` section; BTFError when it is not an ELF file or
    has none."""
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        import io

        return _section(io.BytesIO(bytes(path_or_bytes)), len(path_or_bytes), "<memory>")
    where = str(path_or_bytes)
    try:
        with open(path_or_bytes, "rb") as f:
            return _section(f, os.fstat(f.fileno()).st_size, where)
    except OSError as exc:
        raise BTFError(f"cannot read {where}: {exc.strerror or exc}") from None


def elf_name(path_or_bytes: str | os.PathLike[str] | bytes, module: bool) -> str:
    """What BTF read from a file is called: vmlinux, or a module's name (its file's
    stem, as the kernel names /sys/kernel/btf/<module>)."""
    if not module:
        return "vmlinux"
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        return "module"
    return Path(path_or_bytes).name.split(".", 1)[0].replace("-", "_")


def _section(f: BinaryIO, size: int, where: str) -> bytes:
    ident = f.read(16)
    if len(ident) < 16 or ident[:4] != b"\x7fELF":
        raise BTFError(f"{where}: not an ELF file (bad magic or too short)")
    elf_class, data = ident[4], ident[5]
    if elf_class not in _LAYOUT or data not in (1, 2):
        raise BTFError(f"{where}: bad ELF identification (class {elf_class}, data {data})")
    e = "<" if data == 1 else ">"
    header_format, shdr_format, header_size = _LAYOUT[elf_class]
    f.seek(0)
    header = f.read(header_size)
    if len(header) < header_size:
        raise BTFError(f"{where}: truncated ELF header")
    fields = struct.unpack(e + header_format, header)
    shoff, shentsize, shnum, shstrndx = fields[5], fields[10], fields[11], fields[12]
    shdr = struct.Struct(e + shdr_format)
    if shnum == 0 or shentsize != shdr.size or shoff + shnum * shentsize > size:
        raise BTFError(f"{where}: no usable section header table")
    f.seek(shoff)
    sections = [_fields(shdr.unpack(raw)) for raw in _chunks(f.read(shnum * shentsize), shdr.size)]
    if shstrndx >= shnum:
        raise BTFError(f"{where}: section name table index {shstrndx} out of range")
    names = _contents(f, size, sections[shstrndx], where)
    for name_off, sh_type, offset, length in sections:
        end = names.find(b"\0", name_off)
        if name_off < len(names) and names[name_off:end] == SECTION.encode():
            if sh_type == _SHT_NOBITS:
                break
            return _contents(f, size, (name_off, sh_type, offset, length), where)
    raise BTFError(f"{where}: no {SECTION} section (built without BTF: CONFIG_DEBUG_INFO_BTF, "
                   "or pahole -J)")


def _fields(raw: tuple[int, ...]) -> tuple[int, int, int, int]:
    return raw[0], raw[1], raw[4], raw[5]


def _chunks(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data) - n + 1, n)]


def _contents(f: BinaryIO, size: int, section: tuple[int, int, int, int], where: str) -> bytes:
    _name, _type, offset, length = section
    if offset + length > size:
        raise BTFError(f"{where}: a section [{offset:#x}, +{length:#x}) runs past the end of the file")
    f.seek(offset)
    return f.read(length)
