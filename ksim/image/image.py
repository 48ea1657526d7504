"""A loaded kernel image: sections, symbols, functions and lookups over them.

Built by a loader (``ksim.image.elf.load_image``, ``ksim.image.kallsyms.load_kallsyms``);
pure data afterwards.  Lookups by address use sorted tables and bisection so that a
whole vmlinux (tens of thousands of functions) stays cheap.
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ksim.errors import ImageError, KsimError, UnknownSymbol
from ksim.image.model import Function, Section, Symbol, SymbolTable

if TYPE_CHECKING:
    from ksim.image.tables import KernelTables

#: reads ``size`` bytes at ``addr`` from a running kernel (raises on a bad address)
MemoryReader = Callable[[int, int], bytes]
#: told the (address, size) ranges a reader is about to be asked for (Image.prefetch)
Prefetcher = Callable[[Sequence[tuple[int, int]]], None]
#: the digests (ksim.analysis.store.code_digest) of exactly the ranges (address, size)
#: as the reader would read them, each when known without reading it, else None
#: (Image.known_digests)
DigestOf = Callable[[Sequence[tuple[int, int]]], "list[int | None]"]

_BINDING_RANK = {"global": 0, "weak": 1, "local": 2}


class Image:
    """A kernel (``module == "vmlinux"``) or a kernel module, ready for analysis."""

    def __init__(
        self,
        path: str,
        arch: str,
        module: str,
        sections: Iterable[Section],
        symbols: Iterable[Symbol] | SymbolTable,
        *,
        bindings: dict[str, str] | None = None,
        reader: MemoryReader | None = None,
        build_id: bytes | None = None,
        identity: bytes | None = None,
        prefetch: Prefetcher | None = None,
        digests: tuple[Prefetcher, DigestOf] | None = None,
    ) -> None:
        self.path = path
        self._prefetch = prefetch
        self._digests = digests
        #: the ELF's GNU build id (``.note.gnu.build-id``), when the file has one
        self.build_id = build_id
        #: for an image read from a running kernel: what names that kernel (release,
        #: where its text is, which modules are loaded), so that what is learnt about
        #: it can be found again; it does not vouch for the bytes, which can change
        self.identity = identity
        self.arch = arch
        self.module = module
        self.sections: tuple[Section, ...] = tuple(sorted(sections, key=lambda s: (s.address, -s.size)))
        #: every symbol, in (address, name) order
        self.symbols = symbols if isinstance(symbols, SymbolTable) else SymbolTable.of(symbols)
        self._reader = reader
        # the first symbol of each name (in address order) is the one a name means: its
        # place in the table
        names = self.symbols.names
        self._by_name: dict[str, int] = dict(zip(reversed(names), range(len(names) - 1, -1, -1), strict=True))
        self.functions, self._func_by_name, ranked = _functions(self.symbols, bindings or {})
        #: the bindings ("global", "weak", "local") of the names that share an address
        #: with another function's: the ones that decide which name names it, and all
        #: an image keeps (a copy of it ranks the same names)
        self.bindings = {n: bindings[n] for n in ranked if n in bindings} if bindings else {}
        self._func_starts = [f.address for f in self.functions]
        self._sym_starts = self.symbols.addresses
        self._sec_starts = [s.address for s in self.sections]
        self.text_regions: tuple[tuple[int, int], ...] = merge_ranges(
            (s.address, s.end) for s in self.sections if s.executable and s.size
        )
        #: what analyses keep of this image, by the analysis: it lives and dies with
        #: the image (a module-level map keyed by the image would keep it alive
        #: through its own values, which refer to it)
        self.memos: dict[str, Any] = {}

    def __repr__(self) -> str:
        return (f"<Image {self.module} {self.path!r}: {len(self.sections)} sections, "
                f"{len(self.functions)} functions>")

    # --- names ---------------------------------------------------------------
    def function(self, name: str) -> Function:
        """The function called ``name`` (or one of its aliases); UnknownSymbol otherwise."""
        func = self._func_by_name.get(name)
        if func is None:
            raise UnknownSymbol(name, difflib.get_close_matches(name, self._func_by_name, n=5))
        return func

    def has_function(self, name: str) -> bool:
        return name in self._func_by_name

    def find_symbol(self, name: str) -> Symbol | None:
        """The symbol named ``name``, or None (no suggestions looked for)."""
        i = self._by_name.get(name)
        return None if i is None else self.symbols[i]

    def symbol(self, name: str) -> Symbol:
        """Any symbol (function, object, absolute constant) by name."""
        sym = self.find_symbol(name)
        if sym is None:
            raise UnknownSymbol(name, difflib.get_close_matches(name, self._by_name, n=5))
        return sym

    def names_at(self, addr: int) -> list[str]:
        """Every symbol name whose address is exactly ``addr`` (in symbol order)."""
        return [sym.name for sym in self._symbols_at(addr)]

    def _symbols_at(self, addr: int) -> tuple[Symbol, ...]:
        """The symbols at exactly ``addr``: found in the sorted symbols, not by a table
        of every address (a command asks about a few of a kernel's 100,000 symbols)."""
        i = bisect.bisect_left(self._sym_starts, addr)
        return self.symbols[i:bisect.bisect_right(self._sym_starts, addr, i)]

    def symbol_containing(self, addr: int) -> Symbol | None:
        """The sized symbol (object or function) whose extent contains ``addr``."""
        i = bisect.bisect_right(self._sym_starts, addr) - 1
        starts, sizes = self._sym_starts, self.symbols.sizes
        for j in range(i, max(i - 16, -1), -1):
            if starts[j] <= addr < starts[j] + sizes[j]:
                return self.symbols[j]
        return None

    def address_of(self, name: str) -> int:
        return self.symbol(name).address

    def aliases(self, func: Function) -> list[str]:
        """Every name under which ``func`` is known (its own first)."""
        # an alias is a function symbol at its address (_functions)
        others = sorted({sym.name for sym in self._symbols_at(func.address)
                         if sym.name != func.name and self._func_by_name.get(sym.name) == func})
        return [func.name, *others]

    # --- addresses -------------------------------------------------------------
    @property
    def function_starts(self) -> Sequence[int]:
        """Every function's address, in the functions' order (not to be changed)."""
        return self._func_starts

    def function_at(self, addr: int) -> Function | None:
        """The function whose bytes contain ``addr``, or None."""
        i = bisect.bisect_right(self._func_starts, addr) - 1
        # functions may nest (a larger one listed before a smaller one at a later
        # address); look back a little rather than assume they are disjoint
        for j in range(i, max(i - 8, -1), -1):
            if addr in self.functions[j]:
                return self.functions[j]
        return None

    def section_at(self, addr: int) -> Section | None:
        i = bisect.bisect_right(self._sec_starts, addr) - 1
        for j in range(i, max(i - 8, -1), -1):
            sec = self.sections[j]
            if sec.address <= addr < sec.end:
                return sec
        return None

    def is_text(self, addr: int) -> bool:
        return any(start <= addr < end for start, end in self.text_regions)

    def read(self, addr: int, size: int) -> bytes:
        """``size`` bytes at ``addr`` (zeros for NOBITS sections such as .bss)."""
        if size < 0:
            raise ValueError(f"negative size {size}")
        if self._reader is not None:
            return bytes(self._reader(addr, size))
        sec = self.section_at(addr)
        if sec is None or addr + size > sec.end:
            raise ImageError(f"{self.module}: [{addr:#x}, {addr + size:#x}) is not inside one section")
        if not sec.data:
            return bytes(size)
        off = addr - sec.address
        chunk = sec.data[off : off + size]
        return chunk + bytes(size - len(chunk))

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Tell the reader the ranges (address, size) about to be read, so that it
        reads them in a few requests (a running kernel's reader); nothing otherwise."""
        if self._prefetch is not None and ranges:
            self._prefetch(ranges)

    def prefetch_digests(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Tell the reader the ranges whose digests (``known_digest``) are about to be
        asked for, not their bytes (a running kernel's reader learns them in a few
        requests, none of the bytes crossing the wire); nothing otherwise."""
        if self._digests is not None and ranges:
            self._digests[0](ranges)

    def known_digest(self, addr: int, size: int) -> int | None:
        """The digest of the ``size`` bytes at ``addr`` as ``read`` would give them, when
        the reader knows it without reading them; None otherwise (read them)."""
        return self.known_digests(((addr, size),))[0]

    def known_digests(self, ranges: Sequence[tuple[int, int]]) -> list[int | None]:
        """known_digest of each of ``ranges`` (address, size), asked at once: a batch
        checks the thousands of functions its functions reach."""
        if self._digests is None:
            return [None] * len(ranges)
        return self._digests[1](ranges)

    def freed(self, address: int) -> bool:
        """Whether a running kernel has freed the memory at ``address``: its init
        code and data, ``[__init_begin, __init_end)``, which it frees after boot and
        unmaps (free_initmem), though kallsyms still names the functions there.  A
        file's image frees nothing."""
        span = self._init_span
        return span is not None and span[0] <= address < span[1]

    @cached_property
    def _init_span(self) -> tuple[int, int] | None:
        if self._reader is None:
            return None
        begin, end = self.find_symbol("__init_begin"), self.find_symbol("__init_end")
        if begin is None or end is None or end.address <= begin.address:
            return None
        return begin.address, end.address

    @property
    def reads_memory(self) -> bool:
        """Whether the bytes come from a running kernel (a reader) rather than a file."""
        return self._reader is not None

    def frozen(self) -> Image:
        """This image with every function's bytes read now and kept: reading the copy
        never calls the reader again (forked processes can analyse it).  A read the
        kept bytes do not cover raises :class:`SnapshotMiss` and is noted (see
        :meth:`take_misses`).  A function whose bytes cannot be read is left out of what is kept."""
        if self._reader is None:
            return self
        pieces: list[tuple[int, bytes]] = []
        # runs of functions, with the filler between them (a read is one wire request)
        runs: list[list[int]] = []
        for lo, hi in merge_ranges((f.address, f.end) for f in self.functions if f.size):
            if runs and lo - runs[-1][1] <= 4096:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        for lo, hi in runs:
            try:
                pieces.append((lo, self.read(lo, hi - lo)))
            except KsimError:  # a hole somewhere: function by function
                first = bisect.bisect_left(self._func_starts, lo)
                last = bisect.bisect_left(self._func_starts, hi)
                for f in self.functions[first:last]:
                    if f.size:
                        try:
                            pieces.append((f.address, self.read(f.address, f.size)))
                        except KsimError:
                            pass
        pieces.sort()
        return Image(self.path, self.arch, self.module, self.sections, self.symbols,
                     bindings=self.bindings, reader=_Snapshot(pieces), build_id=self.build_id,
                     identity=self.identity)

    def take_misses(self) -> list[tuple[int, int]]:
        """The reads a frozen image could not answer since the last call, as
        (address, size); always empty for any other image."""
        reader = self._reader
        if not isinstance(reader, _Snapshot):
            return []
        out, reader.misses = reader.misses, []
        return out

    def code(self, func: Function | str) -> bytes:
        """The bytes of a function."""
        if isinstance(func, str):
            func = self.function(func)
        return self.read(func.address, func.size)

    @cached_property
    def content_id(self) -> bytes:
        """What identifies these bytes: the build id when the file has one, else a hash
        of every section (name, place, flags and contents).  An image read from a
        running kernel has neither: its text is patched at boot (alternatives,
        ftrace, static calls) and differs from any file."""
        if self.reads_memory:
            if self.identity is not None:
                return b"memory:" + self.identity
            raise ImageError(f"{self.module}: the bytes come from a running kernel; they have no fixed identity")
        if self.build_id:
            return b"build-id:" + self.build_id
        digest = hashlib.blake2b(digest_size=32)
        for sec in self.sections:
            digest.update(f"{sec.name}\0{sec.address:x}\0{sec.size:x}\0{sec.executable:d}{sec.writable:d}\0"
                          .encode())
            digest.update(hashlib.blake2b(sec.data, digest_size=32).digest())
        return b"content:" + digest.digest()

    @cached_property
    def tables(self) -> KernelTables:
        """The kernel's address-keyed tables (bug, exception, ftrace, jump-label,
        static-call sites and the kprobe blacklist), read on first use (unless
        known_tables gave them)."""
        from ksim.image.tables import kernel_tables

        return kernel_tables(self)

    def known_tables(self, tables: KernelTables) -> None:
        """The image's tables as read before, from this same image (its analysis
        store keeps them, by the image's identity): ``tables`` then answers
        without reading them, unless it has read them already."""
        self.__dict__.setdefault("tables", tables)


def merge_ranges(regions: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Address ranges (start, end) merged into disjoint sorted ones."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(regions):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return tuple(out)


def _name_rank(name: str, bindings: dict[str, str]) -> tuple[int, int, int, str]:
    """Which alias names a function: global over weak over local, then fewer
    leading underscores (``sys_foo`` over ``__sys_foo``), then the shortest."""
    stripped = len(name) - len(name.lstrip("_"))
    return (_BINDING_RANK.get(bindings.get(name, "global"), 0), stripped, len(name), name)


def _functions(
    symbols: SymbolTable, bindings: dict[str, str]
) -> tuple[tuple[Function, ...], dict[str, Function], set[str]]:
    """Functions from STT_FUNC symbols with a size (sorted by address), one per start
    address (and module), their names, and the names ranked by ``bindings``.

    Symbols at the same address are aliases of one function (``SYM_FUNC_ALIAS``,
    ``__x64_sys_*`` pairs); the largest size wins, so that the function covers
    every alias's bytes, and the name ranked first (_name_rank) names it.
    """
    starts, sizes, names_of, modules_of = (symbols.addresses, symbols.sizes, symbols.names,
                                           symbols.modules)
    sized = [i for i, kind, size in zip(range(len(starts)), symbols.kinds, sizes, strict=True)
             if kind == "func" and size > 0]
    functions: list[Function] = []
    by_name: dict[str, Function] = {}
    ranked: set[str] = set()
    i, count = 0, len(sized)
    while i < count:  # symbols come sorted by address: aliases are neighbours
        first = sized[i]
        address = starts[first]
        j = i + 1
        while j < count and starts[sized[j]] == address:
            j += 1
        if j == i + 1:
            func = Function(names_of[first], address, sizes[first], modules_of[first])
            functions.append(func)
            by_name.setdefault(func.name, func)
        else:
            modules: dict[str, list[Symbol]] = {}
            for sym in (symbols[k] for k in sized[i:j]):
                modules.setdefault(sym.module, []).append(sym)
            for module, group in modules.items():
                names = sorted({s.name for s in group}, key=lambda n: _name_rank(n, bindings))
                ranked.update(names)
                func = Function(names[0], address, max(s.size for s in group), module)
                functions.append(func)
                for name in names:
                    by_name.setdefault(name, func)
        i = j
    return tuple(functions), by_name, ranked


class SnapshotMiss(ImageError):
    """A read of a frozen image (:meth:`Image.frozen`) outside the bytes it kept."""


class _Snapshot:
    """Bytes read once, by address: the reader of a frozen image."""

    def __init__(self, pieces: list[tuple[int, bytes]]) -> None:
        self._starts = [lo for lo, _data in pieces]
        self._pieces = pieces
        #: reads that were outside the kept bytes (address, size)
        self.misses: list[tuple[int, int]] = []

    def __call__(self, address: int, size: int) -> bytes:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            lo, data = self._pieces[i]
            if address + size <= lo + len(data):
                return data[address - lo:address - lo + size]
        self.misses.append((address, size))
        raise SnapshotMiss(f"[{address:#x}, {address + size:#x}) was not read when the image was frozen")
