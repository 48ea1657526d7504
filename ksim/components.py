"""The component repository: code compiled separately, loaded into the kernel.

KernInst calls complex functions (timer routines, replacement functions) in C
code outside the snippets.  Here a component is a relocatable object built with
the kernel's code model for the kernel's architecture (its
``Arch.component_toolchain``: x86-64 ``gcc -c -mcmodel=kernel -mno-red-zone
-fno-pic ...``, AArch64 ``aarch64-linux-gnu-gcc -c -mcmodel=small -fno-pic
-mgeneral-regs-only ...``), loaded into the patch area (its text, rodata, data
and bss in one block), with its relocations applied and its undefined symbols
linked against the kernel's symbols.  Snippets then ``call()`` its functions,
and function replacement can jump to them.

    comp = load(kmgr, build_c(source_text, arch=kmgr.arch))
    comp.symbol("vt_start")
    comp.unload()

Only the relocation types in the architecture's table are applied (each with
its reach checked); anything else, an unresolved symbol, or an object of another
architecture is a LinkError, refused before the kernel is touched.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elftools.elf.descriptions import describe_reloc_type
from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection
from elftools.elf.sections import SymbolTableSection

from ksim import images
from ksim.arch import DEFAULT_ARCH, Arch, get_arch
from ksim.arch.base import ComponentToolchain
from ksim.errors import ComponentBuildError, ComponentUnsupported, LinkError, UnknownSymbol
from ksim.image.reloc import apply_relocation
from ksim.kapi import CodeBlock, Manager

#: where bundled components' sources live
SOURCE_DIR = Path(__file__).resolve().parent / "component_src"

SHN_UNDEF = "SHN_UNDEF"


def toolchain(arch: Arch | str | None = None) -> ComponentToolchain:
    """The architecture's component toolchain (default: ``ksim.arch.DEFAULT_ARCH``);
    ComponentUnsupported when components are not available on it."""
    if arch is None:
        arch = DEFAULT_ARCH
    a = get_arch(arch) if isinstance(arch, str) else arch
    tc = a.component_toolchain
    if tc is None:
        raise ComponentUnsupported(f"C components are not available on {a.name}")
    return tc


def build_c(source: str, *, arch: Arch | str | None = None, include: tuple[Path, ...] = (),
            name: str = "component") -> Path:
    """Compile C source to a relocatable object for ``arch`` (an Arch or its name;
    default ``ksim.arch.DEFAULT_ARCH``; a Manager's is ``kmgr.arch``) in ksim's
    cache (by content hash).  ComponentUnsupported when the architecture's compiler
    is not installed (naming the package that installs it)."""
    tc = toolchain(arch)
    gcc = shutil.which(tc.compiler)
    if gcc is None:
        raise ComponentUnsupported(
            f"{tc.compiler} is not installed: components for this architecture need it "
            f"(apt-get install {tc.package})")
    flags = [*tc.cflags, *(f"-I{p}" for p in include)]
    key = hashlib.sha256("\0".join([tc.compiler, source, *flags]).encode()).hexdigest()[:16]
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
        raise ComponentBuildError(f"{tc.compiler} failed on {name}:\n{proc.stderr}")
    tmp.replace(out)  # atomic: concurrent builds never see half an object
    return out


def bundled(name: str, arch: Arch | str | None = None) -> Path:
    """Build one of ksim's own components (``ksim/component_src/NAME.c``) for ``arch``."""
    return build_c((SOURCE_DIR / f"{name}.c").read_text(), arch=arch, name=name)


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


@dataclass(frozen=True)
class Linked:
    """An object linked at ``base``: the block's bytes, where its sections and
    global symbols are, and its functions' entries."""

    base: int
    blob: bytes
    sections: dict[str, int]
    symbols: dict[str, int]
    functions: frozenset[int]


class RelocatableObject:
    """A component's relocatable object, checked for one toolchain: the right
    machine, something to load, and only relocation types the toolchain applies.
    Linking it (:meth:`link`) is pure: bytes and addresses in, bytes out."""

    def __init__(self, data: bytes, tc: ComponentToolchain) -> None:
        self.tc = tc
        self.elf = elf = ELFFile(io.BytesIO(data))
        if elf["e_type"] != "ET_REL" or elf["e_machine"] != tc.elf_machine:
            raise LinkError(
                f"a component is a {tc.elf_machine} relocatable object (ET_REL), not "
                f"{elf['e_machine']} {elf['e_type']}: build it for the kernel's architecture "
                "(build_c(..., arch=kmgr.arch))")
        self.layout, self.size, self.align = _layout(elf)
        if not self.layout:
            raise LinkError("the object has no code or data")
        symtab = elf.get_section_by_name(".symtab")
        if not isinstance(symtab, SymbolTableSection):
            raise LinkError("the object has no symbol table")
        self.symtab = symtab
        self.undefined = frozenset(s.name for s in symtab.iter_symbols()
                                   if s["st_shndx"] == SHN_UNDEF and s.name)
        self.relocs = list(_relocations(elf, self.layout))
        unknown = sorted({r["r_info_type"] for _, r in self.relocs} - set(tc.relocations))
        if unknown:
            names = ", ".join(f"{describe_reloc_type(t, elf)} ({t})" for t in unknown)
            raise LinkError(f"relocation {names} is not supported in a component (supported: "
                            f"{', '.join(_names(tc))})")

    def link(self, base: int, resolve: Callable[[str], int]) -> Linked:
        """The object placed at ``base`` (aligned to ``self.align``), its undefined
        symbols at ``resolve(name)``; LinkError when a relocation does not fit."""
        if base % self.align:
            raise LinkError(f"{base:#x} is not {self.align}-byte aligned")
        elf = self.elf
        sections = {name: base + off for name, (off, _) in self.layout.items()}
        blob = bytearray(self.size)
        for off, sec in self.layout.values():
            if sec["sh_type"] != "SHT_NOBITS":
                blob[off:off + sec["sh_size"]] = sec.data()
        index = {elf.get_section(i).name: i for i in range(elf.num_sections())}
        by_index = {index[name]: addr for name, addr in sections.items()}

        def address_of(sym) -> int:  # type: ignore[no-untyped-def]
            if sym["st_shndx"] == SHN_UNDEF:
                return resolve(sym.name)
            if sym["st_shndx"] == "SHN_ABS":
                return int(sym["st_value"])
            sec_addr = by_index.get(sym["st_shndx"])
            if sec_addr is None:
                raise LinkError(f"symbol {sym.name!r} is in a section that is not loaded")
            return sec_addr + int(sym["st_value"])

        for off0, r in self.relocs:
            sym = self.symtab.get_symbol(r["r_info_sym"])
            apply_relocation(blob, off0 + r["r_offset"], base + off0 + r["r_offset"],
                             self.tc.relocations[r["r_info_type"]],
                             address_of(sym) + r["r_addend"], sym.name or "section")
        defined = [s for s in self.symtab.iter_symbols()
                   if s["st_shndx"] not in (SHN_UNDEF, "SHN_ABS")]
        symbols = {s.name: address_of(s) for s in defined
                   if s.name and s["st_info"]["type"] in ("STT_FUNC", "STT_OBJECT", "STT_NOTYPE")
                   and s["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")}
        functions = frozenset(address_of(s) for s in defined if s["st_info"]["type"] == "STT_FUNC")
        return Linked(base, bytes(blob), sections, symbols, functions)


def load(kmgr: Manager, obj: Path | bytes) -> Component:
    """Load a relocatable object into the patch area, linked against the kernel."""
    tc = kmgr.arch.component_toolchain
    if tc is None:
        raise ComponentUnsupported(
            f"{kmgr.target.name} runs {kmgr.arch.name}: loading C components (and the "
            "timers built on them) is not available on this architecture")
    # every check that needs no address happens before anything is allocated
    ro = RelocatableObject(obj.read_bytes() if isinstance(obj, Path) else obj, tc)
    image = kmgr.target.image
    missing = sorted(n for n in ro.undefined if not _has_symbol(image, n))
    if missing:
        raise LinkError(f"unresolved symbols: {', '.join(missing)}")
    # the allocator aligns to 16: take slack and align the block's start ourselves
    block = kmgr.reserve_code(ro.size + ro.align - 16)
    base = -(-block.block // ro.align) * ro.align
    try:
        linked = ro.link(base, lambda name: _kernel_symbol(image, name))
        kmgr.fill_code(block, base, linked.blob, entries=linked.functions)
    except BaseException:
        kmgr.release_code(block)
        raise
    return Component(kmgr, base, ro.size, linked.symbols, linked.sections, block)


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


def _relocations(elf: ELFFile, layout: dict[str, tuple[int, Any]]) -> Any:
    """(offset of the section in the block, relocation) of every relocation of a
    loaded section (not those of debug info and the like)."""
    for rel in elf.iter_sections():
        if not isinstance(rel, RelocationSection):
            continue
        target_name = elf.get_section(rel["sh_info"]).name
        if target_name in layout:
            for r in rel.iter_relocations():
                yield layout[target_name][0], r


def _names(tc: ComponentToolchain) -> list[str]:
    return [f"{r.name} ({n})" for n, r in sorted(tc.relocations.items())]
