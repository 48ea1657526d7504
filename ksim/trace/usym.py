"""A user stack's frames named as bpftrace names them: ``ustack``'s symbolizer.

bpftrace keeps a user stack as its addresses and the process's pid, and names the
addresses when it prints the stack, with bcc's symbolizer (``bcc_symcache_resolve``,
src/cc/bcc_syms.cc ``ProcSyms``): the process's executable mappings from
``/proc/PID/maps`` are its modules, and an address in one is looked up among the
symbols of the module's ELF file.  This module does the same from the client, which
reads the traced machine's files through a byte-range reader (kerninstd's
``read_file``, in pieces of at most protocol.MAX_FILE_READ):

- ``parse_maps``: the mappings of /proc/PID/maps; bcc's modules are its executable,
  file-backed ones (``bcc_procutils_each_module``).
- ``ElfFile``: an ELF file's header, program headers (PT_LOAD segments, the build
  id note) and section headers, read from the file's start and its section table;
  ``symbols()`` reads its SHT_SYMTAB and SHT_DYNSYM tables (bcc's ``listsymbols``),
  names left in the string table until a lookup needs one.
- ``Symbols.find``: bcc's ``Module::find_addr`` over the symbols sorted by address:
  the nearest symbol at or below the address whose size covers it, stepping back
  past nested symbols; a symbol of size 0 covers nothing.
- ``UserSymbols``: the per-run symbolizer: an address of a pid to ``name+offset``
  and its module's path, the files cached by (path, device, inode).

What bcc does that this does not: a separate debug file found by
``.gnu_debuglink`` (its CRC is checked over the whole debug file, which would cross
the wire entirely; the build id's ``/usr/lib/debug/.build-id`` file is used, as bcc
tries it first), the vDSO's symbols (read from the process's memory), perf maps
(``/tmp/perf-PID.map``) and C++ demangling.  Among symbols at one address (aliases:
``getppid``, ``__getppid``), bcc takes whichever its unstable sort left last; here
the debug file's and the file's tables are ranked global, weak, then local, the
first in table order winning among equals.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ksim.errors import KsimError, MalformedImage

#: (path, offset, size) -> up to ``size`` bytes of the file from ``offset``, fewer at
#: its end; KsimError when the file cannot be read
RangeReader = Callable[[str, int, int], bytes]

#: the most bytes one read asks for (kerninstd's read_file limit, protocol.MAX_FILE_READ)
PIECE = 64 << 10
#: the most bytes of one table (section headers, a symbol table) read from a file: a
#: corrupt header never makes the client read gigabytes
MAX_TABLE = 64 << 20
#: the bytes read at once from a string table for one name; a longer name reads on
MAX_NAME_PIECE = 256
#: the most bytes of a symbol's name
MAX_NAME = 4096
#: where separate debug files are found by build id (bcc's default root)
DEBUG_ROOT = "/usr/lib/debug"

# ELF (System V gABI); tables, not logic
_ELFMAG = b"\x7fELF"
ET_EXEC, ET_DYN = 2, 3
PT_LOAD, PT_NOTE = 1, 4
SHT_SYMTAB, SHT_NOTE, SHT_DYNSYM = 2, 7, 11
NT_GNU_BUILD_ID = 3
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
#: how a symbol's binding ranks among aliases (higher wins)
_BIND_RANK = {STB_GLOBAL: 2, STB_WEAK: 1}


class Layout(NamedTuple):
    """The structs of one ELF class and byte order."""

    ehdr: struct.Struct
    phdr: struct.Struct
    shdr: struct.Struct
    sym: struct.Struct


def _layout(elfclass: int, order: str) -> Layout:
    if elfclass == 2:
        return Layout(struct.Struct(order + "16sHHIQQQIHHHHHH"), struct.Struct(order + "IIQQQQQQ"),
                      struct.Struct(order + "IIQQQQIIQQ"), struct.Struct(order + "IBBHQQ"))
    return Layout(struct.Struct(order + "16sHHIIIIIHHHHHH"), struct.Struct(order + "IIIIIIII"),
                  struct.Struct(order + "IIIIIIIIII"), struct.Struct(order + "IIIBBH"))


class Segment(NamedTuple):
    """A PT_LOAD program header: where its bytes are in the file and in memory."""

    offset: int
    vaddr: int
    filesz: int


class Section(NamedTuple):
    type: int
    offset: int
    size: int
    link: int
    entsize: int


class Mapping(NamedTuple):
    """A line of /proc/PID/maps (fs/proc/task_mmu.c show_map_vma)."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str

    @property
    def module(self) -> bool:
        """Whether bcc makes a module of it: executable and backed by a file (or the
        vDSO), as bcc_procutils_each_module and bcc_mapping_is_file_backed have it."""
        if len(self.perms) < 3 or self.perms[2] != "x" or not self.path:
            return False
        if self.path == "[vdso]":
            return True
        return not self.path.startswith(("//anon", "/dev/zero", "/anon_hugepage", "[stack",
                                         "/SYSV", "[heap]", "[vsyscall]", "[uprobes]"))


def parse_maps(text: str) -> list[Mapping]:
    """The mappings of a /proc/PID/maps text; a line that is not one is skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "-" not in parts[0]:
            continue
        try:
            lo, _, hi = parts[0].partition("-")
            out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), parts[3],
                               int(parts[4]), parts[5].strip() if len(parts) > 5 else ""))
        except ValueError:
            continue
    return out


class RangeFile:
    """One file read through a RangeReader, in pieces of at most PIECE bytes."""

    def __init__(self, read: RangeReader, path: str) -> None:
        self.read_range, self.path = read, path

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``; MalformedImage when the file ends before."""
        if size > MAX_TABLE:
            raise MalformedImage(f"{self.path}: a table of {size} bytes (over {MAX_TABLE})")
        data = bytearray()
        while len(data) < size:
            piece = self.read_range(self.path, offset + len(data), min(PIECE, size - len(data)))
            if not piece:
                raise MalformedImage(f"{self.path}: {size} bytes from {offset} pass its end")
            data += piece
        return bytes(data)

    def name(self, offset: int) -> str:
        """The NUL-terminated string at ``offset``."""
        data = bytearray()
        while len(data) < MAX_NAME:
            piece = self.read_range(self.path, offset + len(data), MAX_NAME_PIECE)
            end = piece.find(b"\0")
            if end >= 0:
                return (data + piece[:end]).decode("utf-8", "replace")
            if not piece:
                break
            data += piece
        return data.decode("utf-8", "replace")


@dataclass
class Symbols:
    """A module's symbols sorted by address, named when a lookup finds one."""

    #: (start, rank, -order) of each symbol, sorted: aliases rank last-wins
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    #: per symbol in ``keys``' order: (size, the file, its string table's offset + st_name)
    where: list[tuple[int, RangeFile, int]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: list[tuple[int, int, int, int, RangeFile, int]]) -> Symbols:
        """From (start, size, rank, order, file, name offset) rows."""
        rows = sorted(entries, key=lambda r: (r[0], r[2], -r[3]))
        return cls([(r[0], r[2], -r[3]) for r in rows], [(r[1], r[4], r[5]) for r in rows])

    def find(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset) of the symbol covering ``vaddr``, as bcc's Module::find_addr
        finds it: from the last symbol starting at or below it, back while a symbol
        could still be one the others nest in."""
        i = bisect.bisect_right(self.keys, (vaddr, 1 << 62, 1 << 62)) - 1
        if i < 0:
            return None
        limit = self.keys[i][0]
        while i >= 0 and vaddr >= self.keys[i][0]:
            start, (size, f, at) = self.keys[i][0], self.where[i]
            if vaddr < start + size:
                if i not in self.names:
                    self.names[i] = f.name(at)
                return self.names[i], vaddr - start
            if limit > start + size:
                break
            i -= 1
        return None

    def __len__(self) -> int:
        return len(self.keys)


class ElfFile:
    """The headers of an ELF file read through a RangeFile: its type, its PT_LOAD
    segments, its build id and its section table."""

    def __init__(self, f: RangeFile) -> None:
        self.f = f
        ident = f.read(0, 16)
        if ident[:4] != _ELFMAG or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise MalformedImage(f"{f.path}: not an ELF file of a known class and byte order")
        self.layout = _layout(ident[4], "<" if ident[5] == 1 else ">")
        eh = self.layout.ehdr.unpack(f.read(0, self.layout.ehdr.size))
        (_, self.type, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
         _) = eh
        if phnum and phentsize != self.layout.phdr.size:
            raise MalformedImage(f"{f.path}: program headers of {phentsize} bytes")
        if shnum and shentsize != self.layout.shdr.size:
            raise MalformedImage(f"{f.path}: section headers of {shentsize} bytes")
        self.segments: list[Segment] = []
        notes: list[tuple[int, int]] = []
        raw = f.read(phoff, phnum * phentsize) if phnum else b""
        for i in range(phnum):
            ph = self.layout.phdr.unpack_from(raw, i * phentsize)
            if ident[4] == 2:
                p_type, _, p_offset, p_vaddr, _, p_filesz = ph[:6]
            else:
                p_type, p_offset, p_vaddr, _, p_filesz = ph[:5]
            if p_type == PT_LOAD:
                self.segments.append(Segment(p_offset, p_vaddr, p_filesz))
            elif p_type == PT_NOTE:
                notes.append((p_offset, p_filesz))
        self.sections: list[Section] = []
        raw = f.read(shoff, shnum * shentsize) if shnum else b""
        for i in range(shnum):
            sh = self.layout.shdr.unpack_from(raw, i * shentsize)
            _, sh_type, _, _, sh_offset, sh_size, sh_link, _, _, sh_entsize = sh
            self.sections.append(Section(sh_type, sh_offset, sh_size, sh_link, sh_entsize))
        if not notes:
            notes = [(s.offset, s.size) for s in self.sections if s.type == SHT_NOTE]
        self.build_id = self._build_id(notes)

    def _build_id(self, notes: list[tuple[int, int]]) -> bytes | None:
        """The NT_GNU_BUILD_ID note's bytes (the first one, as bcc's find_buildid)."""
        order = self.layout.ehdr.format[0]
        head = struct.Struct(order + "III")
        for offset, size in notes:
            if size > PIECE:
                continue
            data, at = self.f.read(offset, size), 0
            while at + head.size <= len(data):
                namesz, descsz, kind = head.unpack_from(data, at)
                name_at = at + head.size
                desc_at = name_at + (-(-namesz // 4) * 4)
                if kind == NT_GNU_BUILD_ID and data[name_at:name_at + namesz] == b"GNU\0":
                    return data[desc_at:desc_at + descsz]
                at = desc_at + (-(-descsz // 4) * 4)
        return None

    def vaddr(self, m: Mapping, address: int) -> int:
        """The file's virtual address of ``address`` in mapping ``m``: itself in an
        ET_EXEC file (mapped where it was linked); in an ET_DYN one (a shared library,
        a PIE) its file offset (address - start + the mapping's offset) moved by the
        PT_LOAD segment that holds that offset (p_vaddr - p_offset), as bcc's
        __so_calc_mod_offset moves it by its .text section's."""
        if self.type == ET_EXEC:
            return address
        offset = address - m.start + m.offset
        for s in self.segments:
            if s.offset <= offset < s.offset + max(s.filesz, 1):
                return offset + s.vaddr - s.offset
        return offset

    def symbols(self, order_base: int = 0) -> list[tuple[int, int, int, int, RangeFile, int]]:
        """The (start, size, rank, order, file, name offset) of the file's SHT_SYMTAB
        and SHT_DYNSYM symbols bcc lists: a name and a value not zero, any type (bpftrace
        asks bcc for all of them, BCC_SYM_ALL_TYPES)."""
        out = []
        order = order_base
        sym = self.layout.sym
        wide = self.layout.ehdr.size == 64
        for s in self.sections:
            if s.type not in (SHT_SYMTAB, SHT_DYNSYM) or not 0 <= s.link < len(self.sections):
                continue
            if s.entsize != sym.size:
                raise MalformedImage(f"{self.f.path}: symbols of {s.entsize} bytes")
            strtab = self.sections[s.link].offset
            raw = self.f.read(s.offset, s.size)
            for i in range(s.size // sym.size):
                if wide:
                    st_name, st_info, _, _, st_value, st_size = sym.unpack_from(raw, i * sym.size)
                else:
                    st_name, st_value, st_size, st_info, _, _ = sym.unpack_from(raw, i * sym.size)
                if st_name == 0 or st_value == 0:
                    continue
                out.append((st_value, st_size, _BIND_RANK.get(st_info >> 4, 0), order, self.f,
                            strtab + st_name))
                order += 1
        return out


class Module(NamedTuple):
    """A module's file and symbols (None: its file cannot be read as ELF)."""

    elf: ElfFile | None
    symbols: Symbols


class UserSymbols:
    """Names a user address of a process, as bcc names it for bpftrace: the process's
    mappings read once per pid, each file's symbols once per (path, device, inode)."""

    def __init__(self, read: RangeReader) -> None:
        self.read = read
        self._maps: dict[int, list[Mapping]] = {}
        self._modules: dict[tuple[str, str, int], Module] = {}

    def mappings(self, pid: int) -> list[Mapping]:
        """The process's modules' mappings (none when it has exited)."""
        if pid not in self._maps:
            try:
                text = bytearray()
                while len(text) <= MAX_TABLE:
                    piece = self.read(f"/proc/{pid}/maps", len(text), PIECE)
                    text += piece
                    if len(piece) < PIECE:      # a read is short only at the end
                        break
                maps = parse_maps(text.decode("utf-8", "replace"))
            except KsimError:
                maps = []
            self._maps[pid] = [m for m in maps if m.module]
        return self._maps[pid]

    def module(self, m: Mapping) -> Module:
        key = (m.path, m.dev, m.inode)
        if key not in self._modules:
            self._modules[key] = self._load(m.path)
        return self._modules[key]

    def _load(self, path: str) -> Module:
        try:
            elf = ElfFile(RangeFile(self.read, path))
            if elf.type not in (ET_EXEC, ET_DYN):
                return Module(None, Symbols())
            rows = []
            debug = self._debug_file(elf)
            if debug is not None:
                rows += debug.symbols()
            rows += elf.symbols(len(rows))
        except (KsimError, struct.error):
            return Module(None, Symbols())
        return Module(elf, Symbols.of(rows))

    def _debug_file(self, elf: ElfFile) -> ElfFile | None:
        """The separate debug file of ``elf`` by its build id (bcc's
        find_debug_via_buildid): /usr/lib/debug/.build-id/NN/NNNN....debug."""
        if not elf.build_id or len(elf.build_id) < 2:
            return None
        hexid = elf.build_id.hex()
        try:
            return ElfFile(RangeFile(self.read, f"{DEBUG_ROOT}/.build-id/{hexid[:2]}/"
                                                f"{hexid[2:]}.debug"))
        except (KsimError, struct.error):
            return None

    def resolve(self, pid: int, address: int) -> tuple[str, int, str] | None:
        """(name, offset, module path) of ``address`` in process ``pid``; None when no
        module's symbol covers it (bcc's resolve fails: bpftrace prints the address)."""
        for m in self.mappings(pid):
            if m.start <= address < m.end and m.path != "[vdso]":
                mod = self.module(m)
                if mod.elf is None:
                    return None
                found = mod.symbols.find(mod.elf.vaddr(m, address))
                return None if found is None else (found[0], found[1], m.path)
        return None

    def frame(self, pid: int, address: int, perf: bool) -> str:
        """A frame as bpftrace 0.17 prints it (resolve_usym): ``name+offset``, with
        `` (module)`` in perf mode; unresolved, the address as ``0x...`` (and
        `` ([unknown])`` in perf mode)."""
        found = self.resolve(pid, address)
        if found is None:
            return f"0x{address:x}" + (" ([unknown])" if perf else "")
        name, offset, path = found
        return f"{name}+{offset}" + (f" ({path})" if perf else "")


__all__ = ["ElfFile", "Mapping", "RangeFile", "RangeReader", "Symbols", "UserSymbols",
           "parse_maps"]
