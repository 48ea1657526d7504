"""Loading ELF kernels (vmlinux) and kernel modules (.ko) into an :class:`Image`.

The file is checked for structural sanity (header, section table, section extents,
symbol-table entry size) before pyelftools walks it, so that a corrupt file fails
with :class:`MalformedImage` instead of an arbitrary parser exception or a
billion-entry loop.  Any exception a third-party parser raises on malformed input
is wrapped in :class:`MalformedImage` as well: nothing else escapes a loader.

Relocatable modules (.ko, ``ET_REL``) have every section at address 0.  Their
``SHF_ALLOC`` sections are laid out one after another at synthetic addresses from
the architecture's module area (``Arch.module_loader``; honouring each section's
alignment), so that every function has a unique address.  Modules are loaded for
the architectures that declare a module loader (x86-64).  **Relocations are not
applied** to code: a call to another function through an ``R_X86_64_PLT32``
relocation still holds a zero displacement and so decodes as a call to the next
instruction, and PC-relative data references point at the wrong place.  Analysis
of a module's functions is structural only.

The one exception is the address-keyed tables that :mod:`ksim.image.tables` reads
(``__bug_table``, ``__ex_table``, ``__jump_table``, ``.static_call_sites``,
``__mcount_loc``, ``_kprobe_blacklist``): in a .ko they hold zeros until the module
loader applies their ``.rela*`` sections, so their relocations against defined
symbols are applied to those sections' bytes at the synthetic layout, as the
kernel's ``apply_relocate_add`` (arch/x86/kernel/module.c) would at load time,
with the relocation types the architecture's module loader declares.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ksim.arch import get_arch
from ksim.arch.base import ModuleLoader
from ksim.errors import ImageError, KsimError, MalformedImage, UnsupportedImage
from ksim.image.image import Image
from ksim.image.model import Section, Symbol
from ksim.image.reloc import apply_relocation

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

# ELF constants (System V gABI); tables, not logic.
_ELFCLASS = {1: "ELF32", 2: "ELF64"}
_ELFDATA = {1: "little-endian", 2: "big-endian"}
#: the machines ksim has an architecture for: e_machine -> ksim.arch name
_MACHINES = {62: "x86_64", 183: "aarch64"}  # EM_X86_64, EM_AARCH64
#: the same by the names pyelftools gives e_machine
ARCH_OF_MACHINE = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}
_ET_NAMES = {0: "ET_NONE", 1: "ET_REL", 2: "ET_EXEC", 3: "ET_DYN", 4: "ET_CORE"}
_SHT_NULL, _SHT_SYMTAB, _SHT_NOBITS = 0, 2, 8
_SHF_WRITE, _SHF_ALLOC, _SHF_EXECINSTR = 0x1, 0x2, 0x4
_SHN_UNDEF, _SHN_LORESERVE, _SHN_ABS = 0, 0xFF00, 0xFFF1
_STT_KIND = {0: "other", 1: "object", 2: "func"}  # STT_SECTION (3) and STT_FILE (4) are skipped
_STB_NAME = {0: "local", 1: "global", 2: "weak"}
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")
_NOTE = struct.Struct("<III")  # namesz, descsz, type (System V gABI, "Note Section")
_NT_GNU_BUILD_ID = 3

#: sections of a module whose relocations are applied (see the module docstring)
TABLE_SECTIONS = frozenset({
    "__bug_table", "__ex_table", "__jump_table", ".static_call_sites", "__mcount_loc",
    "_kprobe_blacklist",
})
#: relocation type 0 is every architecture's NONE (R_X86_64_NONE, R_AARCH64_NONE): no-op
_R_NONE = 0
#: the end of the 64-bit address space: no section or symbol of an image reaches past it
_TOP = 1 << 64


def load_image(path: str | os.PathLike[str]) -> Image:
    """Load an ELF kernel (x86-64 or AArch64) or a module (of an architecture with a
    module loader: x86-64) from ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO opens at once, writer or not
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO, socket or block device"
            raise ImageError(f"cannot read image {str(path)!r}: {kind}, not a file")
        with open(fd, "rb") as stream:
            return _load(stream, os.fstat(fd).st_size, str(path))
    except OSError as exc:
        raise ImageError(f"cannot read image {str(path)!r}: {exc.strerror or exc}") from exc


def load_image_bytes(data: bytes, path: str = "<memory>") -> Image:
    """Load an image held in memory (same checks as :func:`load_image`)."""
    import io

    return _load(io.BytesIO(data), len(data), path)


def _load(stream: BinaryIO, file_size: int, path: str) -> Image:
    header = stream.read(_EHDR.size)
    _check_header(header, file_size, path)
    _check_sections(stream, header, file_size, path)
    try:
        # pyelftools (with its DWARF readers) only when an ELF file is loaded: a live
        # kernel's image is read from kallsyms, and the import was 25 ms of every command
        from elftools.elf.elffile import ELFFile

        return _build(ELFFile(stream), path)
    except KsimError:
        raise
    except Exception as exc:  # a parser's reaction to corrupt input, whatever its type
        raise MalformedImage(f"{path}: corrupt ELF ({type(exc).__name__}: {exc})") from exc


def _check_header(header: bytes, file_size: int, path: str) -> None:
    if len(header) < 20 or header[:4] != b"\x7fELF":
        raise MalformedImage(f"{path}: not an ELF file (bad magic or too short)")
    ei_class, ei_data = header[4], header[5]
    if ei_class not in _ELFCLASS or ei_data not in _ELFDATA:
        raise MalformedImage(f"{path}: bad ELF identification (class {ei_class}, data {ei_data})")
    machine = struct.unpack_from("<H" if ei_data == 1 else ">H", header, 18)[0]
    if ei_class != 2 or ei_data != 1 or machine not in _MACHINES:
        raise UnsupportedImage(
            f"{path}: {_ELFCLASS[ei_class]} {_ELFDATA[ei_data]} machine {machine}; "
            "only 64-bit little-endian x86-64 (EM_X86_64) and AArch64 (EM_AARCH64) "
            "images are supported"
        )
    if len(header) < _EHDR.size:
        raise MalformedImage(f"{path}: truncated ELF header ({file_size} bytes)")
    e_type = struct.unpack_from("<H", header, 16)[0]
    if e_type == 1 and get_arch(_MACHINES[machine]).module_loader is None:
        raise UnsupportedImage(f"{path}: relocatable {_MACHINES[machine]} modules are not "
                               "supported (ksim has no module loader for the architecture)")


def _check_sections(stream: BinaryIO, header: bytes, file_size: int, path: str) -> None:
    (_ident, e_type, _m, _v, _entry, _phoff, shoff, _flags, _ehsize,
     _phentsize, _phnum, shentsize, shnum, shstrndx) = _EHDR.unpack(header)
    if e_type not in (1, 2, 3):
        raise UnsupportedImage(f"{path}: ELF type {_ET_NAMES.get(e_type, e_type)} is not a kernel or module")
    if shnum == 0 or shentsize != _SHDR.size:
        raise MalformedImage(f"{path}: no usable section header table (e_shnum {shnum}, e_shentsize {shentsize})")
    if shoff + shnum * shentsize > file_size:
        raise MalformedImage(f"{path}: section header table runs past the end of the file")
    if shstrndx >= shnum:
        raise MalformedImage(f"{path}: section name table index {shstrndx} out of range")
    stream.seek(shoff)
    table = stream.read(shnum * shentsize)
    for i, (_name, sh_type, _f, _a, offset, size, link, _info, _align, entsize) in enumerate(
        _SHDR.iter_unpack(table)
    ):
        if sh_type not in (_SHT_NULL, _SHT_NOBITS) and offset + size > file_size:
            raise MalformedImage(f"{path}: section {i} [{offset:#x}, +{size:#x}) runs past the end of the file")
        if sh_type == _SHT_SYMTAB and (entsize != _SYM.size or link >= shnum):
            raise MalformedImage(f"{path}: symbol table {i} has entry size {entsize} / link {link}")


def _build(elf: ELFFile, path: str) -> Image:
    relocatable = elf["e_type"] == "ET_REL"
    arch = ARCH_OF_MACHINE[elf["e_machine"]]
    loader = get_arch(arch).module_loader
    raw_sections = list(elf.iter_sections())
    if relocatable:
        assert loader is not None  # _check_header refused the module otherwise
        bases = _layout(raw_sections, loader.base, path)
    else:
        bases = {i: s["sh_addr"] for i, s in enumerate(raw_sections) if s["sh_flags"] & _SHF_ALLOC}
    module = _module_name(elf, path) if relocatable else "vmlinux"
    relocated = _relocated_tables(raw_sections, bases, loader) if loader and relocatable else {}
    sections = []
    for i, sec in enumerate(raw_sections):
        flags = sec["sh_flags"]
        if i not in bases or sec["sh_size"] == 0:
            continue
        if bases[i] + sec["sh_size"] > _TOP:
            raise MalformedImage(f"{path}: section {sec.name!r} at {bases[i]:#x}, "
                                 f"{sec['sh_size']:#x} bytes, runs past the top of the "
                                 "address space")
        if i in relocated:
            data = relocated[i]
        else:
            data = b"" if sec["sh_type"] == "SHT_NOBITS" else sec.data()
        sections.append(Section(
            name=sec.name, address=bases[i], size=sec["sh_size"],
            executable=bool(flags & _SHF_EXECINSTR), writable=bool(flags & _SHF_WRITE), data=data,
        ))
    symbols, bindings = _symbols(elf, raw_sections, bases, module, relocatable, path)
    return Image(path, arch, module, sections, symbols, bindings=bindings,
                 build_id=_build_id(raw_sections))


def _build_id(raw_sections: list) -> bytes | None:
    """The GNU build id: the descriptor of the note named "GNU" of type
    NT_GNU_BUILD_ID in an SHT_NOTE section (a vmlinux keeps it in ``.notes`` next to
    Xen's notes, whose type numbers overlap)."""
    for sec in raw_sections:
        if sec["sh_type"] != "SHT_NOTE":
            continue
        data = sec.data()
        at = 0
        while at + _NOTE.size <= len(data):
            namesz, descsz, kind = _NOTE.unpack_from(data, at)
            name_at = at + _NOTE.size
            desc_at = name_at + (namesz + 3 & ~3)
            end = desc_at + (descsz + 3 & ~3)
            if end > len(data):
                break
            if kind == _NT_GNU_BUILD_ID and data[name_at:name_at + namesz] == b"GNU\0" and descsz:
                return bytes(data[desc_at:desc_at + descsz])
            at = end
    return None


def _layout(raw_sections: list, cursor: int, path: str) -> dict[int, int]:
    """Synthetic addresses for a relocatable file's SHF_ALLOC sections, in file order
    from ``cursor`` (the module area)."""
    bases: dict[int, int] = {}
    start = cursor
    for i, sec in enumerate(raw_sections):
        if not sec["sh_flags"] & _SHF_ALLOC:
            continue
        align = max(int(sec["sh_addralign"]), 16)
        if align & (align - 1):
            raise MalformedImage(f"{path}: section {sec.name!r} has alignment {align}, "
                                 "not a power of two")
        cursor = (cursor + align - 1) & -align
        bases[i] = cursor
        # keep even empty sections apart so that symbols in them stay distinct
        cursor += max(int(sec["sh_size"]), 1)
        if cursor > _TOP:
            raise MalformedImage(
                f"{path}: the module's sections need more than the {_TOP - start:#x} bytes "
                f"from the module area at {start:#x} to the top of the address space "
                f"(section {sec.name!r}: {sec['sh_size']:#x} bytes)")
    return bases


def _relocated_tables(raw_sections: list, bases: dict[int, int],
                      loader: ModuleLoader) -> dict[int, bytes]:
    """The bytes of each loaded :data:`TABLE_SECTIONS` section of a relocatable file,
    with its ``SHT_RELA`` relocations against defined symbols applied at the
    synthetic layout by the architecture's ``loader``.  Relocations against undefined symbols (a jump entry's static
    key, say) stay unapplied: the fields they fill are not code addresses.
    """
    out: dict[int, bytearray] = {}
    symbol_values: dict[int, list[int | None]] = {}
    for rela in raw_sections:
        if rela["sh_type"] != "SHT_RELA":
            continue
        target = int(rela["sh_info"])
        if target not in bases:
            continue
        table = raw_sections[target]
        if table.name not in TABLE_SECTIONS or table["sh_type"] == "SHT_NOBITS":
            continue
        link = int(rela["sh_link"])
        if link >= len(raw_sections) or raw_sections[link]["sh_type"] != "SHT_SYMTAB":
            raise MalformedImage(f"relocation section {rela.name!r} has no symbol table (link {link})")
        if link not in symbol_values:
            symbol_values[link] = _symbol_values(raw_sections[link].data(), bases)
        values = symbol_values[link]
        data = out.setdefault(target, bytearray(table.data()))
        raw = rela.data()
        if len(raw) % _RELA.size:
            raise MalformedImage(f"relocation section {rela.name!r} is {len(raw)} bytes, "
                                 f"not a multiple of {_RELA.size}")
        base = bases[target]
        for offset, info, addend in _RELA.iter_unpack(raw):
            sym, rtype = info >> 32, info & 0xFFFFFFFF
            if rtype == _R_NONE:
                continue
            kind = loader.relocations.get(rtype)
            if kind is None:
                raise UnsupportedImage(f"{rela.name!r}: relocation type {rtype} at {offset:#x} "
                                       "is not one the kernel's module loader applies")
            if sym >= len(values):
                raise MalformedImage(f"{rela.name!r}: relocation at {offset:#x} names symbol {sym} "
                                     f"of {len(values)}")
            value = values[sym]
            if value is None:
                continue  # undefined (or in a section that is not loaded)
            # out of reach is what apply_relocate_add refuses too ("overflow in
            # relocation type"): a module the kernel would not load
            apply_relocation(data, offset, base + offset, kind, value + addend,
                             f"{table.name}+{offset:#x}", error=MalformedImage)
    return {i: bytes(data) for i, data in out.items()}


def _symbol_values(symtab: bytes, bases: dict[int, int]) -> list[int | None]:
    """Each symbol's laid-out address (section base + value; a section symbol's value
    is 0), or None when it is undefined or lives in a section that is not loaded."""
    values: list[int | None] = []
    for _name, _info, _other, shndx, value, _size in _SYM.iter_unpack(symtab):
        if shndx == _SHN_ABS:
            values.append(value)
        elif shndx == _SHN_UNDEF or shndx >= _SHN_LORESERVE or shndx not in bases:
            values.append(None)
        else:
            values.append(bases[shndx] + value)
    return values


def _module_name(elf: ELFFile, path: str) -> str:
    """The name ``modinfo`` reports (``name=`` in .modinfo), else the file's stem."""
    modinfo = elf.get_section_by_name(".modinfo")
    if modinfo is not None and modinfo["sh_type"] != "SHT_NOBITS":
        for entry in modinfo.data().split(b"\0"):
            if entry.startswith(b"name="):
                return entry[5:].decode("utf-8", "replace")
    return Path(path).name.split(".", 1)[0].replace("-", "_")


def _symbols(
    elf: ELFFile, raw_sections: list, bases: dict[int, int], module: str, relocatable: bool,
    path: str,
) -> tuple[list[Symbol], dict[str, str]]:
    # Symbol tables are parsed with struct rather than pyelftools' per-symbol
    # construct parsing: a vmlinux has ~150 K symbols and this is ~20x faster.
    symbols: list[Symbol] = []
    bindings: dict[str, str] = {}
    for sec in raw_sections:
        if sec["sh_type"] != "SHT_SYMTAB":
            continue
        strtab = raw_sections[sec["sh_link"]].data()
        for st_name, st_info, _other, shndx, value, size in _SYM.iter_unpack(sec.data()):
            kind = _STT_KIND.get(st_info & 0xF)
            if kind is None or shndx == _SHN_UNDEF or st_name == 0:
                continue
            if shndx == _SHN_ABS:
                address = value
            elif shndx >= _SHN_LORESERVE or shndx not in bases:
                continue  # common symbols, or symbols of non-loaded sections
            else:
                address = bases[shndx] + value if relocatable else value
            end = strtab.index(b"\0", st_name)
            name = strtab[st_name:end].decode("utf-8")
            if address + size > _TOP:
                raise MalformedImage(f"{path}: symbol {name!r} at {address:#x}, {size:#x} "
                                     "bytes, runs past the top of the address space")
            if name[0] == "$" and kind == "other":
                continue  # an AArch64 mapping symbol ($x code, $d data: ELF for the Arm 64-bit
                #           Architecture, "Mapping symbols"), not a name of anything
            symbols.append(Symbol(name, address, size, kind if shndx != _SHN_ABS else "other", module))
            if kind == "func":
                bindings[name] = _STB_NAME.get(st_info >> 4, "global")
    return symbols, bindings
