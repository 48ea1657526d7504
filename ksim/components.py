"""The component repository: code compiled separately, loaded into the kernel.

KernInst calls complex functions (timer routines, replacement functions) in C
code outside the snippets.  Here a component is a relocatable object built with
the kernel's code model (``gcc -c -mcmodel=kernel -mno-red-zone -fno-pic ...``),
loaded into the patch area (its text, rodata, data and bss in one block), with
its relocations applied and its undefined symbols linked against the kernel's
symbols.  Snippets then ``call()`` its functions, and function replacement can
jump to them.

    comp = load(kmgr, build_c(source_text))
    comp.symbol("vt_start")
    comp.unload()

Only the relocation kinds a -mcmodel=kernel object uses are supported
(R_X86_64_64, PC32, PLT32, 32, 32S); anything else is a LinkError, refused
before the kernel is touched.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection
from elftools.elf.sections import SymbolTableSection

from ksim import images
from ksim.arch import get_arch
from ksim.errors import ComponentBuildError, ComponentUnsupported, LinkError, UnknownSymbol
from ksim.kapi import CodeBlock, Manager

#: the kernel's code generation flags (images/toy/Makefile, Linux's arch/x86/Makefile)
CFLAGS = (
    "-O2", "-std=gnu11", "-ffreestanding", "-nostdlib", "-mcmodel=kernel", "-mno-red-zone",
    "-fno-pic", "-fno-pie", "-mgeneral-regs-only", "-fcf-protection=none",
    "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-common",
    "-mpreferred-stack-boundary=3", "-Wall",
)
#: where bundled components' sources live
SOURCE_DIR = Path(__file__).resolve().parent / "component_src"

#: the architecture whose objects build_c() compiles and load() links
ARCH = "x86_64"

# x86-64 psABI relocation types (System V AMD64 ABI, Table 4.10)
R_X86_64_64, R_X86_64_PC32, R_X86_64_PLT32, R_X86_64_32, R_X86_64_32S = 1, 2, 4, 10, 11
SHN_UNDEF = "SHN_UNDEF"


def build_c(source: str, *, include: tuple[Path, ...] = (), name: str = "component") -> Path:
    """Compile C source to a relocatable object in ksim's cache (by content hash)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ComponentBuildError("gcc is not installed")
    flags = list(CFLAGS) + [f"-I{p}" for p in include]
    key = hashlib.sha256("\0".join([source, *flags]).encode()).hexdigest()[:16]
    out_dir = images.cache_root() / "components"
    out = out_dir / f"{name}-{key}.o"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{name}-{key}.c"
    src.write_text(source)
    tmp = out.with_suffix(".o.tmp")
    proc = subprocess.run([gcc, *flags, "-c", "-o", str(tmp), str(src)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ComponentBuildError(f"gcc failed on {name}:\n{proc.stderr}")
    tmp.replace(out)  # atomic: concurrent builds never see half an object
    return out


def bundled(name: str) -> Path:
    """Build one of ksim's own components (``ksim/component_src/NAME.c``)."""
    return build_c((SOURCE_DIR / f"{name}.c").read_text(), name=name)


@dataclass
class Component:
    """A loaded object: where its pieces went, and how to take it out."""

    kmgr: Manager
    base: int
    size: int
    symbols: dict[str, int]
    sections: dict[str, int]
    #: the Manager's record of the placed code (base may lie above its start)
    block: CodeBlock | None = field(repr=False, default=None)
    loaded: bool = True

    def symbol(self, name: str) -> int:
        try:
            return self.symbols[name]
        except KeyError:
            raise UnknownSymbol(name, sorted(self.symbols)[:5]) from None

    def unload(self) -> None:
        """Restore the patch area and free it; refused (AlreadySpliced) while a
        replacement still goes into the component."""
        if not self.loaded or self.block is None:
            return
        self.kmgr.release_code(self.block)
        self.loaded = False


def load(kmgr: Manager, obj: Path | bytes) -> Component:
    """Load a relocatable object into the patch area, linked against the kernel."""
    if kmgr.arch is not get_arch(ARCH):
        raise ComponentUnsupported(
            f"components are {ARCH} objects and {kmgr.target.name} runs {kmgr.arch.name}: "
            "loading C components (and the timers built on them) is not available on "
            "this architecture")
    data = obj.read_bytes() if isinstance(obj, Path) else obj
    elf = ELFFile(io.BytesIO(data))
    if elf["e_type"] != "ET_REL" or elf["e_machine"] != "EM_X86_64":
        raise LinkError("a component is an x86-64 relocatable object (ET_REL)")
    layout, size, align = _layout(elf)
    if not layout:
        raise LinkError("the object has no code or data")
    image = kmgr.target.image
    # all resolution happens before anything is allocated: a refusal changes nothing
    symtab = elf.get_section_by_name(".symtab")
    if not isinstance(symtab, SymbolTableSection):
        raise LinkError("the object has no symbol table")
    undefined = {s.name for s in symtab.iter_symbols()
                 if s["st_shndx"] == SHN_UNDEF and s.name}
    missing = sorted(n for n in undefined if not _has_symbol(image, n))
    if missing:
        raise LinkError(f"unresolved symbols: {', '.join(missing)}")
    # the allocator aligns to 16: take slack and align the block's start ourselves
    block = kmgr.reserve_code(size + align - 16)
    base = -(-block.block // align) * align
    try:
        sections = {name: base + off for name, (off, _) in layout.items()}
        blob = bytearray(size)
        for off, sec in layout.values():
            if sec["sh_type"] != "SHT_NOBITS":
                blob[off:off + sec["sh_size"]] = sec.data()
        index = {elf.get_section(i).name: i for i in range(elf.num_sections())}
        by_index = {index[name]: addr for name, addr in sections.items()}

        def address_of(sym) -> int:  # type: ignore[no-untyped-def]
            if sym["st_shndx"] == SHN_UNDEF:
                return _kernel_symbol(image, sym.name)
            if sym["st_shndx"] == "SHN_ABS":
                return int(sym["st_value"])
            sec_addr = by_index.get(sym["st_shndx"])
            if sec_addr is None:
                raise LinkError(f"symbol {sym.name!r} is in a section that is not loaded")
            return sec_addr + int(sym["st_value"])

        for rel in elf.iter_sections():
            if not isinstance(rel, RelocationSection):
                continue
            target_name = elf.get_section(rel["sh_info"]).name
            if target_name not in layout:
                continue  # relocations of debug info and the like
            off0 = layout[target_name][0]
            for r in rel.iter_relocations():
                sym = symtab.get_symbol(r["r_info_sym"])
                _apply(blob, off0 + r["r_offset"], base + off0 + r["r_offset"],
                       r["r_info_type"], address_of(sym) + r["r_addend"], sym.name)
        symbols = {s.name: address_of(s) for s in symtab.iter_symbols()
                   if s.name and s["st_shndx"] not in (SHN_UNDEF, "SHN_ABS")
                   and s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT", "STT_NOTYPE")
                   and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")}
        functions = frozenset(address_of(s) for s in symtab.iter_symbols()
                              if s["st_info"]["type"] == "STT_FUNC"
                              and s["st_shndx"] not in (SHN_UNDEF, "SHN_ABS"))
        kmgr.fill_code(block, base, bytes(blob), entries=functions)
    except BaseException:
        kmgr.release_code(block)
        raise
    return Component(kmgr, base, size, symbols, sections, block)


def _layout(elf: ELFFile) -> tuple[dict[str, tuple[int, Any]], int, int]:
    """Offsets of the allocated sections in one block (text first, then data),
    the block's size, and the alignment its start needs."""
    layout: dict[str, tuple[int, Any]] = {}
    off, max_align = 0, 16
    secs = [s for s in elf.iter_sections() if s["sh_flags"] & 0x2 and s["sh_size"]]  # SHF_ALLOC
    secs.sort(key=lambda s: (not s["sh_flags"] & 0x4, s["sh_type"] == "SHT_NOBITS"))  # exec first
    for sec in secs:
        align = max(int(sec["sh_addralign"]), 1)
        if align & (align - 1) or align > 4096:
            raise LinkError(f"section {sec.name} wants {align}-byte alignment")
        max_align = max(max_align, align)
        off = (off + align - 1) // align * align
        layout[sec.name] = (off, sec)
        off += int(sec["sh_size"])
    return layout, max(off, 1), max_align


def _has_symbol(image, name: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        image.address_of(name)
    except Exception:  # noqa: BLE001 - any lookup failure means "not there"
        return False
    return True


def _kernel_symbol(image, name: str) -> int:  # type: ignore[no-untyped-def]
    return int(image.address_of(name))


def _apply(blob: bytearray, off: int, place: int, kind: int, value: int, name: str) -> None:
    if kind == R_X86_64_64:
        blob[off:off + 8] = (value % 2**64).to_bytes(8, "little")
        return
    if kind in (R_X86_64_PC32, R_X86_64_PLT32):
        value -= place
        lo, hi = -2**31, 2**31
    elif kind == R_X86_64_32:
        lo, hi = 0, 2**32
    elif kind == R_X86_64_32S:
        value = value - 2**64 if value >= 2**63 else value
        lo, hi = -2**31, 2**31
    else:
        raise LinkError(f"relocation type {kind} against {name!r} is not supported")
    if not lo <= value < hi:
        raise LinkError(f"relocation against {name!r} does not fit in 32 bits ({value:#x})")
    blob[off:off + 4] = (value % 2**32).to_bytes(4, "little")
