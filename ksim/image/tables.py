"""The kernel's address-keyed tables: instructions Linux finds by their address.

Some kernel instructions are looked up by address at run time, so a splice must
never move them:

* ``__bug_table`` -- the ``ud2`` of each WARN()/BUG(); ``handle_bug`` -> ``report_bug``
  -> ``find_bug`` (lib/bug.c) matches the trapping address against the table;
* ``__ex_table`` -- instructions allowed to fault, with a fix-up
  (``search_exception_tables``, kernel/extable.c);
* ``__mcount_loc`` -- the ``call __fentry__`` (built as a 5-byte nop) of each traceable
  function, patched when ftrace starts (``ftrace_process_locs``, kernel/trace/ftrace.c);
  on arm64 the two instructions of its patchable entry, both recorded here;
* ``__jump_table`` -- jump-label sites, rewritten when a static key flips
  (kernel/jump_label.c);
* ``.static_call_sites`` -- static-call call sites, re-targeted at run time
  (kernel/static_call_inline.c);
* ``_kprobe_blacklist`` -- the functions marked NOKPROBE_SYMBOL (kernel/kprobes.c).

:func:`kernel_tables` reads them from a loaded :class:`~ksim.image.image.Image`.
The bounds come from the linker-script symbols ``__start_X``/``__stop_X``
(include/asm-generic/vmlinux.lds.h) when the image has them -- a vmlinux's symbols or
kallsyms, which also covers a running kernel read through a memory reader -- else
from the section of that name (a module, whose loader finds the tables by section
name: ``find_module_sections``, kernel/module/main.c).  In a .ko the table sections
are relocated by the loader; :mod:`ksim.image.elf` applies those relocations at its
synthetic layout, so the decoding here is the same for kernels and modules.

Formats (Linux 6.1, x86-64; every displacement is relative to the field holding it):

* ``struct bug_entry`` with GENERIC_BUG_RELATIVE_POINTERS and DEBUG_BUGVERBOSE
  (include/asm-generic/bug.h, arch/x86/include/asm/bug.h):
  ``s32 bug_addr_disp; s32 file_disp; u16 line; u16 flags`` -- 12 bytes;
  ``BUGFLAG_WARNING`` is ``1 << 0``;
* ``struct exception_table_entry`` (arch/x86/include/asm/extable.h):
  ``int insn, fixup, data`` -- 12 bytes (``ex_to_insn``, include/linux/extable.h);
* ``struct jump_entry`` with HAVE_ARCH_JUMP_LABEL_RELATIVE (include/linux/jump_label.h):
  ``s32 code; s32 target; long key`` -- 16 bytes (``jump_entry_code``);
* ``struct static_call_site`` (include/linux/static_call_types.h):
  ``s32 addr; s32 key`` -- 8 bytes (``static_call_addr``, kernel/static_call_inline.c);
* ``__mcount_loc`` and ``_kprobe_blacklist``: ``unsigned long`` absolute addresses.

Entries that do not resolve into the image's text are dropped: a zeroed entry (one
whose relocation names a symbol the image does not define) or garbage cannot name an
instruction to protect.  Addresses are kept even where kallsyms puts them inside
another function: the ``__fentry__`` of a weak function whose strong definition won
keeps its record and its code but loses its symbol (``test_for_valid_rec``,
kernel/trace/ftrace.c), and its bytes are still patched at boot.
"""

from __future__ import annotations

import bisect
import enum
import operator
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from ksim.errors import MalformedImage

if TYPE_CHECKING:
    from ksim.image.image import Image


class TextRef(enum.Enum):
    """Why the kernel keeps an instruction's address in a table."""

    WARN = "warn"  # __bug_table entry with BUGFLAG_WARNING (include/asm-generic/bug.h)
    BUG = "bug"  # __bug_table entry without it
    EXTABLE = "extable"  # __ex_table insn address
    FTRACE = "ftrace"  # __mcount_loc entry (the call __fentry__ / its 5-byte nop)
    JUMP_LABEL = "jump_label"  # __jump_table code address
    STATIC_CALL = "static_call"  # .static_call_sites addr


_KINDS = tuple(TextRef)
_BIT = {kind: 1 << i for i, kind in enumerate(_KINDS)}
#: the frozenset of kinds for every bit mask, so that refs_in allocates nothing
_REF_SETS = tuple(
    frozenset(kind for kind in _KINDS if mask & _BIT[kind]) for mask in range(1 << len(_KINDS))
)
_NO_REFS: frozenset[TextRef] = _REF_SETS[0]


class _KindSites(Mapping[TextRef, tuple[int, ...]]):
    """KernelTables.sites of merged tables: each kind's sorted addresses picked out
    of the merged ones when first asked for (a command that loads an analysis store
    asks for few or none; picking all six was 3 ms)."""

    def __init__(self, addrs: list[int], masks: list[int]) -> None:
        self._addrs, self._masks = addrs, masks
        self._made: dict[TextRef, tuple[int, ...]] = {}

    def __getitem__(self, kind: TextRef) -> tuple[int, ...]:
        found = self._made.get(kind)
        if found is None:
            bit = _BIT[kind]    # KeyError for what is no kind, as a dict's
            found = self._made[kind] = tuple(compress(self._addrs, map(bit.__and__, self._masks)))
        return found

    def __iter__(self) -> Iterator[TextRef]:
        return iter(_KINDS)

    def __len__(self) -> int:
        return len(_KINDS)


@dataclass(frozen=True, kw_only=True)
class KernelTables:
    """The recorded text addresses of an image, per :class:`TextRef` kind.

    ``sites`` maps a kind to its addresses (any iterable; kept as sorted, unique
    tuples, one per kind); ``kprobe_blacklist`` holds the ``(start, end)`` extent of
    each NOKPROBE function.
    """

    sites: Mapping[TextRef, Iterable[int]] = field(default_factory=dict, repr=False)
    kprobe_blacklist: tuple[tuple[int, int], ...] = ()
    # every kind's addresses merged: sorted unique addresses and a bit mask of kinds each
    _addrs: list[int] = field(init=False, repr=False, compare=False)
    _masks: list[int] = field(init=False, repr=False, compare=False)

    EMPTY: ClassVar[KernelTables]

    def __post_init__(self) -> None:
        sites = {kind: tuple(sorted(set(self.sites.get(kind, ())))) for kind in _KINDS}
        object.__setattr__(self, "sites", MappingProxyType(sites))
        object.__setattr__(self, "kprobe_blacklist", tuple(sorted(set(self.kprobe_blacklist))))
        merged: dict[int, int] = {}
        for kind, addrs in sites.items():
            bit = _BIT[kind]
            for addr in addrs:
                merged[addr] = merged.get(addr, 0) | bit
        order = sorted(merged)
        object.__setattr__(self, "_addrs", order)
        object.__setattr__(self, "_masks", [merged[a] for a in order])

    @classmethod
    def merged(cls, addrs: Sequence[int], masks: Sequence[int],
               kprobe_blacklist: Iterable[tuple[int, int]]) -> KernelTables:
        """The tables whose every address (sorted, unique) has the kinds of its bit
        mask (what :meth:`packed` gives), without sorting them again: an analysis
        store keeps a running kernel's tables so, and they come back in milliseconds."""
        addrs, masks = list(addrs), list(masks)
        if len(addrs) != len(masks) or any(map(operator.ge, addrs, addrs[1:])) or \
                (masks and not 0 < min(masks) <= max(masks) < 1 << len(_KINDS)):
            raise ValueError("not sorted, unique addresses each with a mask of kinds")
        out = object.__new__(cls)
        object.__setattr__(out, "sites", _KindSites(addrs, masks))
        object.__setattr__(out, "kprobe_blacklist", tuple(sorted(set(kprobe_blacklist))))
        object.__setattr__(out, "_addrs", addrs)
        object.__setattr__(out, "_masks", masks)
        return out

    def packed(self) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Every address, sorted, with its bit mask of kinds, and the blacklist:
        :meth:`merged` of them is these tables."""
        return list(self._addrs), list(self._masks), list(self.kprobe_blacklist)

    def __hash__(self) -> int:
        return hash((tuple(self.sites.items()), self.kprobe_blacklist))

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={n}" for k, n in self.counts().items() if n)
        return f"KernelTables({counts or 'empty'})"

    def refs_in(self, start: int, end: int) -> frozenset[TextRef]:
        """The kinds with a recorded address in ``[start, end)``."""
        addrs = self._addrs
        i = bisect.bisect_left(addrs, start)
        if i == len(addrs) or addrs[i] >= end:
            return _NO_REFS
        j = bisect.bisect_left(addrs, end, i)
        mask = 0
        for m in self._masks[i:j]:
            mask |= m
        return _REF_SETS[mask]

    def refs_at(self, start: int, end: int) -> list[tuple[int, frozenset[TextRef]]]:
        """Each recorded address in ``[start, end)`` with its kinds, in address order."""
        addrs = self._addrs
        i = bisect.bisect_left(addrs, start)
        j = bisect.bisect_left(addrs, end, i)
        return [(addrs[k], _REF_SETS[self._masks[k]]) for k in range(i, j)]

    def addresses(self, kind: TextRef) -> tuple[int, ...]:
        """The recorded addresses of one kind, sorted."""
        return tuple(self.sites[kind])  # already a sorted tuple: no copy

    def counts(self) -> dict[str, int]:
        """How many addresses of each kind (by value), and ``"kprobe_blacklist"`` functions."""
        out = {kind.value: len(self.addresses(kind)) for kind in _KINDS}
        out["kprobe_blacklist"] = len(self.kprobe_blacklist)
        return out


KernelTables.EMPTY = KernelTables()


@dataclass(frozen=True)
class _Table:
    section: str  # its section's name (in a .ko; in a vmlinux it may be folded into another)
    start: str  # the linker-script symbols bounding it (include/asm-generic/vmlinux.lds.h)
    stop: str
    entry: int  # bytes per entry


_BUG_TABLE = _Table("__bug_table", "__start___bug_table", "__stop___bug_table", 12)
_EX_TABLE = _Table("__ex_table", "__start___ex_table", "__stop___ex_table", 12)
_JUMP_TABLE = _Table("__jump_table", "__start___jump_table", "__stop___jump_table", 16)
_STATIC_CALLS = _Table(".static_call_sites", "__start_static_call_sites",
                       "__stop_static_call_sites", 8)
_MCOUNT_LOC = _Table("__mcount_loc", "__start_mcount_loc", "__stop_mcount_loc", 8)
_KPROBE_BLACKLIST = _Table("_kprobe_blacklist", "__start_kprobe_blacklist",
                           "__stop_kprobe_blacklist", 8)
_ALL = (_BUG_TABLE, _EX_TABLE, _JUMP_TABLE, _STATIC_CALLS, _MCOUNT_LOC, _KPROBE_BLACKLIST)

_BUGFLAG_WARNING = 1 << 0
_BUG_ENTRY = struct.Struct("<iiHH")
_EX_ENTRY = struct.Struct("<iii")
_JUMP_ENTRY = struct.Struct("<iiq")
_STATIC_CALL_SITE = struct.Struct("<ii")
_ULONG = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1


def kernel_tables(image: Image) -> KernelTables:
    """The address-keyed tables of ``image``; a table the image lacks is simply empty.

    MalformedImage if a table's size is not a multiple of its entry size.
    """
    bounds = {s.name: s.address for s in image.symbols
              if s.module == image.module and s.name.startswith(("__start_", "__stop_", "__init_"))}
    if image.reads_memory:  # a running kernel's tables: read in one request, not page by page
        image.prefetch([r for r in (_table_span(image, t, bounds) for t in _ALL) if r and r[1]])
    raw = {table.section: _table_bytes(image, table, bounds) for table in _ALL}
    sites: dict[TextRef, list[int]] = {kind: [] for kind in _KINDS}

    base, data = raw[_BUG_TABLE.section]
    for k, (disp, _file, _line, flags) in enumerate(_BUG_ENTRY.iter_unpack(data)):
        kind = TextRef.WARN if flags & _BUGFLAG_WARNING else TextRef.BUG
        sites[kind].append(base + k * _BUG_ENTRY.size + disp)
    base, data = raw[_EX_TABLE.section]
    sites[TextRef.EXTABLE] = [base + k * _EX_ENTRY.size + insn
                              for k, (insn, _fixup, _data) in enumerate(_EX_ENTRY.iter_unpack(data))]
    base, data = raw[_JUMP_TABLE.section]
    sites[TextRef.JUMP_LABEL] = [base + k * _JUMP_ENTRY.size + code
                                 for k, (code, _target, _key) in enumerate(_JUMP_ENTRY.iter_unpack(data))]
    base, data = raw[_STATIC_CALLS.section]
    sites[TextRef.STATIC_CALL] = [
        base + k * _STATIC_CALL_SITE.size + addr
        for k, (addr, _key) in enumerate(_STATIC_CALL_SITE.iter_unpack(data))
    ]
    sites[TextRef.FTRACE] = [addr for (addr,) in _ULONG.iter_unpack(raw[_MCOUNT_LOC.section][1])]
    if getattr(image, "arch", None) == "aarch64":
        # -fpatchable-function-entry=2: __mcount_loc holds the first of the two
        # instructions (``mov x9, x30`` once ftrace_init_nop ran), and the second is
        # the nop ftrace makes a ``bl ftrace_caller`` (dyn_ftrace.ip,
        # ftrace_call_adjust in arch/arm64/include/asm/ftrace.h): both are ftrace's
        sites[TextRef.FTRACE] += [addr + 4 for addr in sites[TextRef.FTRACE]]

    regions = image.text_regions
    starts = [start for start, _end in regions]
    kept = {kind: _in_text(addrs, regions, starts) for kind, addrs in sites.items()}

    blacklist = []
    for (addr,) in _ULONG.iter_unpack(raw[_KPROBE_BLACKLIST.section][1]):
        # the kernel blacklists the whole function around the recorded address
        # (kprobe_add_ksym_blacklist -> kallsyms_lookup_size_offset, kernel/kprobes.c)
        func = image.function_at(addr)
        if func is not None:
            blacklist.append((func.address, func.end))
    if not blacklist and not any(kept.values()):
        return KernelTables.EMPTY
    return KernelTables(sites=kept, kprobe_blacklist=tuple(blacklist))


def _table_span(image: Image, table: _Table, bounds: dict[str, int]) -> tuple[int, int] | None:
    """(address, size) of one table's bytes; None when the image does not hold it, or
    holds it no more (a running kernel's init memory)."""
    start, stop = bounds.get(table.start), bounds.get(table.stop)
    if start is not None and stop is not None:
        if stop < start:
            raise MalformedImage(f"{image.module}: {table.section}: {table.stop} {stop:#x} "
                                 f"is below {table.start} {start:#x}")
        address, size = start, stop - start
    else:
        section = next((s for s in image.sections if s.name == table.section), None)
        if section is None:
            return None
        address, size = section.address, section.size
    if size % table.entry:
        raise MalformedImage(f"{image.module}: {table.section} is {size} bytes, "
                             f"not a multiple of its {table.entry}-byte entries")
    if size and image.reads_memory:
        # A running kernel frees [__init_begin, __init_end) after boot and unmaps it from
        # the kernel image mapping (free_initmem -> free_kernel_image_pages,
        # arch/x86/mm/init.c): __mcount_loc and _kprobe_blacklist live there and are
        # gone by the time anyone can read them.
        init_begin, init_end = bounds.get("__init_begin"), bounds.get("__init_end")
        if init_begin is not None and init_end is not None and init_begin <= address < init_end:
            return None
    return address, size


def _table_bytes(image: Image, table: _Table, bounds: dict[str, int]) -> tuple[int, bytes]:
    """(address, bytes) of one table; (0, b"") when the image does not hold it."""
    span = _table_span(image, table, bounds)
    if span is None:
        return 0, b""
    address, size = span
    if size == 0:
        return address, b""
    if image.reads_memory:
        return address, image.read(address, size)
    section_at = image.section_at(address)
    if section_at is None:
        return 0, b""  # symbols without the bytes behind them (kallsyms alone)
    if address + size > section_at.end:
        raise MalformedImage(f"{image.module}: {table.section} [{address:#x}, {address + size:#x}) "
                             f"runs past the end of section {section_at.name}")
    return address, image.read(address, size)


def _in_text(addrs: Iterable[int], regions: tuple[tuple[int, int], ...],
             starts: list[int]) -> list[int]:
    """The addresses (masked to 64 bits) inside the image's merged text regions."""
    out = []
    for addr in addrs:
        addr &= _MASK64
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < regions[i][1]:
            out.append(addr)
    return out
