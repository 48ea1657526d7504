"""The persistent analysis store: every function's compact analysis, kept on disk
per image, so that the next process starts without analysing anything.

:func:`build` analyses every function of an image (:func:`ksim.analysis.sweep.sweep`,
the same answers as :func:`ksim.analysis.compact.compute` for a run of functions at
once), spread over the machine's cores (forked workers, each on runs of functions
of about equal work); :class:`Store` answers for one function
(:meth:`Store.get`, a :class:`~ksim.analysis.compact.Compact`) and for the whole image
(:meth:`Store.totals`, :meth:`Store.function_points`).  ``analyze()`` builds its
instructions and CFG from the store when the image has one, and the clobber
analysis reads its per-function summaries from it, so attaching to N functions
analyses those N functions and no callee.

**Where and under which key.**  ``$KSIM_CACHE/analysis/<key>.ksa`` (``~/.cache/ksim``
when KSIM_CACHE is unset; ``$KSIM_ANALYSIS_CACHE`` names another directory;
``KSIM_ANALYSIS_STORE=off`` turns stores off).  A directory keeps the stores last
saved or loaded up to ``$KSIM_ANALYSIS_CACHE_MB`` (:func:`prune`).  The key hashes :data:`ANALYSIS_VERSION`, the decoder
(architecture and capstone's version), the image's identity (its GNU build id, else
a hash of every section; see ``Image.content_id``), its module name and its whole
function table (address and size of every function: a vmlinux loaded with its ELF
symbols and the same file loaded with kallsyms extents are different analyses).
The file repeats the key and the function table, and both are checked on load.

**A running kernel.**  Its text is patched at boot (alternatives, ftrace, static
calls) and changes while it runs (static keys, tracers, other tools' patches), so no
file names its bytes.  Its image has an ``identity`` instead (the live target's:
kernel release, text address, loaded modules), which is the store's key, and every
record keeps a digest of the bytes it was made from (``digest``): a record is used
only while the function's bytes read now have that digest.  Building reads the
kernel's text once (:meth:`Image.frozen`); it is not built behind the user's back
(it costs a read of all text and a whole-kernel analysis) but when a batch asks
for many functions (:func:`for_batch`).

**Format** (all little-endian): a header (magic, :data:`ANALYSIS_VERSION`, key, body
length, the body's XXH3-64: a check against a damaged file, 1 ms for a kernel's 39 MB
on every load where a CRC-32 took 5 and a cryptographic digest 25; the key itself
is BLAKE2b), then the body: a directory of named arrays
(name, ``array`` type code, length) followed by their bytes, 8-byte aligned.  Arrays
per function (``addr``, ``size``, ``status``, counts, ``own`` ...) and the data they
count (``sizes``, ``codes``, ``targets``, points ...) concatenated in function order,
with where each function's items start (``start_*``); the effects tables of every
chunk of functions (their codes index them), chunk after chunk; ``meta`` is JSON:
per chunk, the register names and how many effects it has; the jump tables; the
errors of functions that could not be read.

**Corruption.**  A file that is missing, short, from another version, for another
key or function table, or whose digest does not match its body, is ignored (and
replaced when the store is rebuilt).  A record whose bytes no longer decode as
recorded is not used either (``compact.StaleRecord``): ``analyze()`` then analyses
the function afresh.  Writes go to a temporary file in the same
directory, then ``os.replace``: a reader sees the old file or the new one, whole.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
import weakref
from array import array
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import accumulate
from operator import attrgetter
from pathlib import Path
from typing import Any, cast, overload

import xxhash

from ksim.analysis.abi import support_for
from ksim.analysis.cfg import JumpTable
from ksim.analysis.compact import Compact
from ksim.analysis.points import FunctionPoints
from ksim.analysis.scc import components
from ksim.errors import KsimError
from ksim.image.image import Image
from ksim.image.model import Function
from ksim.image.tables import KernelTables

#: bump whenever the analysis (what compact.compute or the decoder derive) or this
#: file format changes: older files are then ignored
ANALYSIS_VERSION = 9

_MAGIC = b"KSIMANA\x00"
_HEADER = struct.Struct("<8sI4x32sQQ")  # magic, version, key, body length, body's XXH3-64
_ENTRY = struct.Struct("<16scxxxxxxxQ")    # name, array type code, length in bytes
_SUFFIX = ".ksa"

#: images with at least this many functions get a store built the first time the
#: clobber analysis needs one (smaller ones are quick to analyse function by function)
AUTO_BUILD_FUNCTIONS = 5000

# per function
_PER_FUNCTION = {
    "addr": "Q", "size": "Q", "status": "B", "n_insns": "I", "tail": "I", "tail_code": "I",
    "n_targets": "I", "blocks": "I", "n_exits": "I", "n_bpoints": "I", "n_calls": "I",
    "own": "Q", "worst": "B", "n_calls_out": "I", "n_jumps_out": "I", "chunk": "I",
    "digest": "Q",
}
# what the per-function counts count, concatenated in function order
_DATA = {"sizes": "B", "codes": "I", "targets": "Q", "exits": "Q", "bpoints": "Q",
         "calls": "Q", "calls_out": "Q", "jumps_out": "Q"}
#: every chunk's table of instruction effects, (reads, writes) masks in turn, chunk
#: after chunk (meta's chunks say how many pairs each has: an array, not JSON, which
#: was 5 ms of every load)
_EFFECTS = {"effects": "Q"}
_COUNTED_BY = {"sizes": "n_insns", "codes": "n_insns", "targets": "n_targets", "exits": "n_exits",
               "bpoints": "n_bpoints", "calls": "n_calls", "calls_out": "n_calls_out",
               "jumps_out": "n_jumps_out"}
_OK, _FAILED = 0, 1
#: what the store knows of a function beyond its record: the registers it and its
#: callees may write (``clob``), the registers live before each of its first
#: HEAD_LIVE instructions (``live0``...) and where its code ends; register sets as
#: masks over ``meta["derived_regs"]``; ``derived`` says which of them a function
#: has (_CLOB, _LIVE, _END bits).  Made with the store for every function whose
#: reach has good records (_settle_clobbers, _heads); what a batch finds missing (a
#: function whose reach was not current then) it learns and keeps here for the next
#: process (``learn_clobbers``, ``learn_head``, ``learn_code_end``; saved by
#: :func:`flush`).  Made with the store too: the index of every function each one
#: calls or jumps into (``succ``)
HEAD_LIVE = 3
_DERIVED = {"derived": "B", "clob": "Q", **{f"live{k}": "Q" for k in range(HEAD_LIVE)},
            "code_end": "I", "n_succ": "I"}
_CLOB, _LIVE, _END = 1, 2, 4
#: ... and, counted by ``n_succ``, the index of every function each one calls or
#: jumps into (the clobber analysis's edges), found once instead of by address
_DERIVED_DATA = {"succ": "I"}
#: the image's address-keyed tables (KernelTables.packed: every address with its
#: bit mask of kinds; the kprobe blacklist's extents, start and end in turn), made
#: with the store: a running kernel's are a request and a parse every process
_TABLES = {"table_addrs": "Q", "table_kinds": "B", "table_blacklist": "Q"}
#: the functions' indices in the order of their names, made with the store: a glob's
#: literal prefix (``tcp_*``) is found by bisection (``named``), not by matching every
#: name of a kernel (50,000 in 6 ms)
_NAMES = {"name_order": "I"}
#: the count arrays (each counts a data array's items per function, ``succ`` too)
_COUNTERS = (*dict.fromkeys(_COUNTED_BY.values()), "n_succ")


def _start_name(counter: str) -> str:
    """The name of the array keeping where the items ``counter`` counts start."""
    return f"start_{counter[2:]}"


#: where each function's items start in what a count array counts (the counts'
#: running sums, one more than there are functions), kept in the file: summing a
#: kernel's 50,000 counts nine times was 9 ms of every process that loads it
_STARTS = {_start_name(counter): "I" for counter in _COUNTERS}


class StoreError(KsimError):
    """A store file that cannot be used (missing, corrupt, for something else)."""


def cache_dir() -> Path:
    """$KSIM_ANALYSIS_CACHE, else the ksim cache root's ``analysis/``."""
    own = os.environ.get("KSIM_ANALYSIS_CACHE")
    if own:
        return Path(own)
    from ksim.images import cache_root

    return cache_root() / "analysis"


def _decoder_identity(arch: str) -> str:
    """The decoder the records were made with, by its installed distribution's version
    (the metadata beside the package, found without importing it: a command finds its
    store before it decodes anything, and capstone's import, 15 ms, then runs while
    the kernel answers the command's first questions); its own ``__version__`` where
    no one distribution is found."""
    import importlib.util

    spec = importlib.util.find_spec("capstone")
    if spec is not None and spec.origin is not None:
        site = Path(spec.origin).parent.parent
        found = [*site.glob("capstone-*.dist-info"), *site.glob("capstone-*.egg-info")]
        if len(found) == 1:
            return f"{arch}/capstone-{found[0].name[len('capstone-'):].rsplit('.', 1)[0]}"
    import capstone

    return f"{arch}/capstone-{capstone.__version__}"


def image_key(image: Image) -> bytes:
    """The 32-byte key of ``image``'s analysis (see the module docstring); worked out
    once per image (finding its store and checking it both need it)."""
    found = image.memos.get("store_key")
    if found is None:
        found = image.memos["store_key"] = _image_key(image)
    return bytes(found)


def _image_key(image: Image) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"ksim-analysis/{ANALYSIS_VERSION}/{_decoder_identity(image.arch)}/{image.module}\0"
                  .encode())
    digest.update(image.content_id)
    addresses, sizes = _function_table(image)
    digest.update(addresses)
    digest.update(sizes)
    return digest.digest()


def _function_table(image: Image) -> tuple[array, array]:
    """Every function's address, and every function's size: made once per image (its
    key and a store's check of its function table both need them)."""
    found = image.memos.get("function_table")
    if found is None:
        functions = image.functions
        found = image.memos["function_table"] = (array("Q", image.function_starts),
                                                 array("Q", [f.size for f in functions]))
    return found


def path_for(image: Image, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"{image_key(image).hex()[:40]}{_SUFFIX}"


#: the megabytes of stores a cache directory keeps (``$KSIM_ANALYSIS_CACHE_MB``): a
#: running kernel's identity changes with every module it loads, and each identity
#: has a store of some 40 MB
CACHE_MB = 1024


def prune(directory: Path, *, keep: Path | None = None) -> list[Path]:
    """Remove the stores of ``directory`` least recently saved or loaded (their files'
    modification times) until the rest fit in ``$KSIM_ANALYSIS_CACHE_MB`` (default
    :data:`CACHE_MB`); ``keep`` (the store just saved) is never removed, nor is
    anything but a store.  The removed paths, oldest first."""
    try:
        budget = int(os.environ.get("KSIM_ANALYSIS_CACHE_MB", CACHE_MB)) << 20
    except ValueError:
        budget = CACHE_MB << 20
    found = []
    for path in directory.glob(f"*{_SUFFIX}"):
        try:
            st = path.stat()
        except OSError:
            continue  # removed meanwhile (another process pruning)
        found.append((st.st_mtime, st.st_size, path))
    found.sort(reverse=True)  # the most recently used first
    used, removed = 0, []
    for _when, size, path in found:
        used += size
        if used > budget and path != keep:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed[::-1]


# --- the store --------------------------------------------------------------------------
class _Effects(Sequence[tuple[frozenset[str], frozenset[str]]]):
    """A chunk's table of (reads, writes), each entry's names made when first asked
    for (a chunk has thousands; a function uses a few dozen)."""

    __slots__ = ("_store", "_chunk", "_raw", "_made", "__weakref__")

    def __init__(self, store: Store, chunk: int) -> None:
        self._store, self._chunk = store, chunk
        start = store._effect_starts[chunk]
        # (reads, writes) masks in turn
        self._raw = store._arrays["effects"][2 * start:2 * store._effect_starts[chunk + 1]]
        self._made: list[tuple[frozenset[str], frozenset[str]] | None] = [None] * (len(self._raw) // 2)

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, i: int) -> tuple[frozenset[str], frozenset[str]]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[frozenset[str], frozenset[str]]]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        found = self._made[i]
        if found is None:
            found = self._made[i] = (self._store._names(self._chunk, self._raw[2 * i]),
                                     self._store._names(self._chunk, self._raw[2 * i + 1]))
        return found


class _Offsets(dict[str, Sequence[int]]):
    """Where each function's items start in the arrays a count array counts (its
    running sums): as the file keeps them (_STARTS), else summed when first asked for."""

    def __init__(self, arrays: dict[str, Any]) -> None:
        super().__init__()
        self._arrays = arrays

    def __missing__(self, counter: str) -> Sequence[int]:
        kept = self._arrays.get(_start_name(counter))
        found = self[counter] = (kept if kept is not None
                                 else list(accumulate(self._arrays[counter], initial=0)))
        return found


class Store:
    """Every function's compact analysis of one image (read-only)."""

    def __init__(self, image: Image, key: bytes, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self.key = key
        self._arrays = arrays
        self._meta = meta
        functions = image.functions
        addr, size = arrays["addr"], arrays["size"]
        addresses, sizes = _function_table(image)     # as the key hashed them
        if len(addr) != len(functions) or addr != addresses or size != sizes:
            raise StoreError("the store's function table is not the image's")
        self._addr = addr
        # a running kernel's bytes can change (static keys, ftrace, static calls, other
        # tools' patches): every record is checked against the bytes read now
        self._image = weakref.ref(image) if image.reads_memory else None
        self._offsets = _Offsets(arrays)
        for name in (*_PER_FUNCTION, *_DERIVED):
            if len(arrays[name]) != len(functions):
                raise StoreError(f"array {name!r} holds {len(arrays[name])} items for {len(functions)} functions")
        for name, counter in (*_COUNTED_BY.items(), ("succ", "n_succ")):
            starts = self._offsets[counter]
            if len(starts) != len(functions) + 1 or starts[0] or starts[-1] != len(arrays[name]):
                raise StoreError(f"array {name!r} holds {len(arrays[name])} items, not what "
                                 f"{counter!r} counts")
        self._chunks = meta["chunks"]
        self._effect_starts = list(accumulate((c["n_effects"] for c in self._chunks), initial=0))
        if self._effect_starts[-1] * 2 != len(arrays["effects"]):
            raise StoreError("the chunks' effects are not the effects array")
        self._effects: dict[int, _Effects] = {}
        self._masks: dict[tuple[int, int], frozenset[str]] = {}
        self._regs: dict[int, list[str]] = {}
        self._tables: dict[str, list] = meta["tables"]
        if "table_addrs" in arrays:     # the image's own tables, as read when the store was made
            extents = arrays["table_blacklist"]
            try:
                tables = KernelTables.merged(arrays["table_addrs"], arrays["table_kinds"],
                                             zip(extents[0::2], extents[1::2], strict=True))
            except ValueError as exc:
                raise StoreError(f"the store's kernel tables: {exc}") from None
            image.known_tables(tables)
        self._derived_regs: list[str] = meta.get("derived_regs", [])
        self._derived_bits = {r: 1 << k for k, r in enumerate(self._derived_regs)}
        self._derived_masks: dict[frozenset[str], int | None] = {}
        self._derived_names: dict[int, frozenset[str]] = {}
        #: functions whose whole reach has current records (settled), or not
        self._settled: dict[int, bool] = {}
        #: the functions a reach walk gave since (their closure under the edges, with
        #: the walks before), checked at once when settled is next asked; and whether
        #: no function was found unsettled so far (then a closure whose every record
        #: is current is settled as a whole, without a walk per function)
        self._pending: list[int] = []
        self._all_settled = True
        #: where the store is kept (None: nowhere), and the facts it learnt since
        self.path: Path | None = None
        self._learnt = 0

    # --- one function ----------------------------------------------------------------
    def index_of(self, func: Function) -> int | None:
        i = bisect.bisect_left(self._addr, func.address)
        if i < len(self._addr) and self._addr[i] == func.address and self._arrays["size"][i] == func.size:
            return i
        return None

    def sizes(self, func: Function) -> bytes | None:
        """The instruction sizes recorded for ``func``, without reading its bytes to
        check they are still the ones analysed (None when it has no good record): a
        guess at where its instructions lie, to ask about ranges ahead; what is then
        asked about a range holds for those bytes whatever lies there."""
        i = self.index_of(func)
        if i is None or self._arrays["status"][i] != _OK:
            return None
        offsets = self._offsets[_COUNTED_BY["sizes"]]
        return self._arrays["sizes"][offsets[i]:offsets[i + 1]].tobytes()

    def get(self, func: Function) -> Compact | None:
        """The compact analysis of ``func``; None when it is not in the store or could
        not be analysed (its bytes could not be read: a fresh analysis says why)."""
        i = self._current(func)
        return self._record(i, func) if i is not None else None

    def _record(self, i: int, func: Function) -> Compact:
        """Record ``i`` (of ``func``), whatever the bytes are now."""
        a = self._arrays
        chunk = a["chunk"][i]

        def part(name: str) -> array:
            offsets = self._offsets[_COUNTED_BY[name]]
            return a[name][offsets[i]:offsets[i + 1]]

        tables = tuple(JumpTable(jump, table, reg, tuple(entries))
                       for jump, table, reg, entries in self._tables.get(str(i), ()))
        return Compact(
            start=func.address, end=func.end, sizes=part("sizes").tobytes(), codes=part("codes"),
            targets=part("targets"), tail=a["tail"][i], tail_code=a["tail_code"][i],
            effects=self._effects_of(chunk), tables=tables, blocks=a["blocks"][i],
            exits=tuple(part("exits")), block_points=tuple(part("bpoints")), callsites=tuple(part("calls")),
            own_writes=self._names(chunk, a["own"][i]), worst=bool(a["worst"][i]),
            calls_out=tuple(part("calls_out")), jumps_out=tuple(part("jumps_out")),
        )

    def named(self, image: Image, prefix: str) -> list[Function] | None:
        """The functions of ``image`` whose names start with ``prefix``, in address
        order, found by bisection in the store's name index; None when the store has
        none (one made before it had)."""
        order = self._arrays.get("name_order")
        if order is None:
            return None
        functions = image.functions
        lo = bisect.bisect_left(order, prefix, key=lambda j: functions[j].name)
        hi = lo
        while hi < len(order) and functions[order[hi]].name.startswith(prefix):
            hi += 1
        return [functions[j] for j in sorted(order[lo:hi])]

    def reach(self, image: Image, funcs: Iterable[Function],
              known: Container[int] = frozenset()) -> list[Function]:
        """``funcs`` and every function they call or jump into, transitively, as the
        records say (the clobber analysis's edges, ``succ``), without reading
        anything (a function without a good record ends the walk): what analysing
        ``funcs`` reads, their callees' clobbers included, to be read ahead of it.
        The walk does not enter the functions at ``known`` addresses (their reach was
        found before), nor gives them."""
        a = self._arrays
        succ, at, status, addr = a["succ"], self._offsets["n_succ"], a["status"], self._addr
        functions = image.functions
        seen: dict[int, Function] = {}
        # the walk is over the records' indices (succ holds them); a function given
        # that has no record ends it there
        work: list[int] = []
        for func in funcs:
            if func.address in seen or func.address in known:
                continue
            i = self.index_of(func)
            if i is None:
                seen[func.address] = func
            else:
                work.append(i)
        # breadth first, a level at a time: the edges of a level gathered by set
        # updates, not pushed and popped one by one
        walked: set[int] = set()
        level = {i for i in work if addr[i] not in known}
        while level:
            walked |= level
            after: set[int] = set()
            for i in level:
                if status[i] == _OK:
                    after.update(succ[at[i]:at[i + 1]])
            after -= walked
            level = {i for i in after if addr[i] not in known} if known else after
        order = sorted(walked)
        self._pending += order
        for i in order:
            seen.setdefault(functions[i].address, functions[i])
        return list(seen.values())

    def summary(self, func: Function) -> tuple[frozenset[str], bool, tuple[int, ...], tuple[int, ...]] | None:
        """(registers written, worst, calls out, jumps out) of ``func`` -- what the
        clobber analysis needs, without the rest of its record; None as for get()."""
        i = self._current(func)
        if i is None:
            return None
        a = self._arrays
        calls, jumps = self._offsets["n_calls_out"], self._offsets["n_jumps_out"]
        return (self._names(a["chunk"][i], a["own"][i]), bool(a["worst"][i]),
                tuple(a["calls_out"][calls[i]:calls[i + 1]]), tuple(a["jumps_out"][jumps[i]:jumps[i + 1]]))

    # --- what batches learnt of a function and its reach -----------------------------------
    def clobbers(self, image: Image, func: Function) -> frozenset[str] | None:
        """The registers ``func`` or anything it reaches may write
        (clobbers.function_clobbers), as a batch learnt them (learn_clobbers); None
        when none was learnt, or not every function it reaches has a current record
        (``settled``)."""
        i = self.index_of(func)
        if i is None or not self._arrays["derived"][i] & _CLOB or not self.settled(image, func):
            return None
        return self._derived_set(self._arrays["clob"][i])

    def head_live(self, image: Image, func: Function, address: int) -> frozenset[str] | None:
        """The registers live just before the instruction at ``address``, one of
        ``func``'s first HEAD_LIVE, as a batch learnt them (learn_head); None when it
        is not one of them, none was learnt, or not every function ``func`` reaches
        has a current record."""
        i = self.index_of(func)
        if i is None or not self._arrays["derived"][i] & _LIVE:
            return None
        at = func.address
        offsets = self._offsets["n_insns"]
        sizes = self._arrays["sizes"]
        for k in range(min(HEAD_LIVE, offsets[i + 1] - offsets[i])):
            if at == address:
                return (self._derived_set(self._arrays[f"live{k}"][i])
                        if self.settled(image, func) else None)
            at += sizes[offsets[i] + k]
        return None

    def learn_clobbers(self, image: Image, func: Function, written: frozenset[str]) -> None:
        """Keep what ``func`` or anything it reaches may write (``written``, as the
        clobber analysis found it while everything ``func`` reaches was current:
        ``settled``) for clobbers(), here and, once flushed, in the next process."""
        i = self.index_of(func)
        a = self._arrays
        if i is None or a["derived"][i] & _CLOB or not self.settled(image, func):
            return
        m = self._derived_mask(written)
        if m is not None:
            a["clob"][i] = m
            a["derived"][i] |= _CLOB
            self._learnt += 1

    def learn_head(self, image: Image, func: Function, live: Sequence[frozenset[str]]) -> None:
        """Keep the registers live before ``func``'s first instructions (``live``, as
        the analysis found them while everything ``func`` reaches was current:
        ``settled``) for head_live, here and, once flushed, in the next process."""
        i = self.index_of(func)
        a = self._arrays
        if i is None or a["derived"][i] & _LIVE or not self.settled(image, func):
            return
        masks = self._head_masks(i, live)
        if masks is not None:
            self._keep_head(i, masks)
            self._learnt += 1

    def learn_code_end(self, func: Function, end: int) -> None:
        """Keep where ``func``'s code ends (RecordView.code_end of its current record)."""
        i = self.index_of(func)
        if i is None or self._arrays["derived"][i] & _END or not func.address <= end <= func.end:
            return
        self._keep_code_end(i, end - func.address)
        self._learnt += 1

    def _head_masks(self, i: int, live: Sequence[frozenset[str]]) -> tuple[int, ...] | None:
        """``live`` (the registers live before function ``i``'s first instructions) as
        the masks kept of them; None when it covers too few of its instructions (its
        first HEAD_LIVE, filler left out) or names a register the masks cannot."""
        offsets = self._offsets["n_insns"]
        n = min(HEAD_LIVE, offsets[i + 1] - offsets[i])
        if len(live) < n:
            return None
        masks = tuple(self._derived_mask(names) for names in live[:n])
        return None if None in masks else cast(tuple[int, ...], masks)

    def _keep_head(self, i: int, masks: Sequence[int]) -> None:
        a = self._arrays
        for k, m in enumerate(masks):
            a[f"live{k}"][i] = m
        a["derived"][i] |= _LIVE

    def _keep_code_end(self, i: int, offset: int) -> None:
        self._arrays["code_end"][i] = offset
        self._arrays["derived"][i] |= _END

    def _derived_mask(self, names: frozenset[str]) -> int | None:
        """``names`` as a mask over the derived registers (None: one is not among them);
        a few hundred distinct sets serve a whole kernel, each worked out once."""
        found = self._derived_masks.get(names, -1)
        if found == -1:
            bits = self._derived_bits
            found = 0
            for name in names:
                bit = bits.get(name)
                if bit is None:
                    found = None
                    break
                found |= bit
            self._derived_masks[names] = found
        return found

    def code_end(self, func: Function) -> int | None:
        """Where ``func``'s code ends (RecordView.code_end: before its trailing filler
        no path reaches), as learnt from its record -- which the caller has checked
        is current (a view of it was made); None when nothing was learnt."""
        i = self.index_of(func)
        if i is None or not self._arrays["derived"][i] & _END:
            return None
        return func.address + self._arrays["code_end"][i]

    def settled(self, image: Image, func: Function) -> bool:
        """Whether ``func`` and every function it calls or jumps into, transitively
        (the clobber analysis's edges), have current records: then what was learnt
        over that reach is what analysing them now gives.  Init text the kernel
        freed counts as settled, with no edges: the analysis takes it as the
        convention's worst whatever its bytes (clobbers.summary).  Strongly connected
        components (Tarjan, without recursion), each answer kept: a batch's checks
        cost one walk of what its functions reach."""
        root = self.index_of(func)
        if root is None:
            return False
        memo = self._settled
        functions = image.functions
        freed = image.freed
        if self._pending:
            # what reach walks gave, closed under the edges: when every record there
            # is current (or freed text) and nothing was unsettled before, all of
            # it is settled, with one look at each instead of a walk per function
            pending, self._pending = self._pending, []
            if self._all_settled and self._all_current(pending, freed):
                memo.update(dict.fromkeys(pending, True))
            else:
                self._all_settled = False
        found = memo.get(root)
        if found is not None:
            return found
        edges = self._edges(image)
        for members in components(root, edges, memo):
            ok = all(freed(functions[m].address) or self._current_at(m, functions[m])
                     for m in members) and all(memo.get(c, True) for m in members for c in edges(m))
            for m in members:
                memo[m] = ok
            if not ok:
                self._all_settled = False
        return memo[root]

    def _edges(self, image: Image) -> Callable[[int], Sequence[int]]:
        """The functions each function (by index) calls or jumps into, by index: what
        ``settled`` and the clobbers a store is made with walk.  Init text the kernel
        freed has none: it is the convention's worst whatever its bytes (and calls)."""
        succ, at = self._arrays["succ"], self._offsets["n_succ"]
        functions, freed = image.functions, image.freed
        return lambda i: () if freed(functions[i].address) else succ[at[i]:at[i + 1]]

    def _settle_clobbers(self, image: Image, unknown: Sequence[bool]) -> None:
        """Fill ``clob`` for every function the store can answer for: what the clobber
        analysis (clobbers.function_clobbers) gives, for the whole image at once, on
        bit masks over the edges (``_edges``) -- every record was just made from the
        bytes read now, so each function whose reach has good records is settled.  A
        batch's first command then has its callees' clobbers without a walk of their
        summaries (some 0.2 ms a function).  The same rules: a function writes what
        its own instructions write, the convention's worst when it makes an indirect
        call or calls what is no function (``unknown``: each function's) or is init
        text the kernel freed, and what every function it reaches writes; a cycle of
        two or more, the convention's worst; never the stack pointer.  A function that
        reaches one without a good record, or writes a register the derived masks
        cannot name, is left to be learnt."""
        cc = support_for(image.arch).convention
        worst_mask = self._derived_mask(cc.caller_saved)
        if worst_mask is None:
            return
        keep = ~(self._derived_mask(frozenset({cc.stack_reg})) or 0)
        a = self._arrays
        status, own, worst, chunk = a["status"], a["own"], a["worst"], a["chunk"]
        freed = [image.freed(f.address) for f in image.functions]
        edges = self._edges(image)
        bad = -1                # no answer: a record missing below, or a register unnamed
        converted: dict[tuple[int, int], int | None] = {}   # (chunk, its mask): derived

        def base(i: int) -> int:
            if freed[i]:
                return worst_mask
            if status[i] != _OK:
                return bad
            key = (chunk[i], own[i])
            if key not in converted:
                converted[key] = self._derived_mask(self._names(*key))
            m = converted[key]
            if m is None:
                return bad
            return m | worst_mask if worst[i] or unknown[i] else m

        solved: dict[int, int] = {}
        for root in range(len(freed)):
            if root in solved:
                continue
            for members in components(root, edges, solved):
                inside = set(members)
                written = worst_mask if len(members) > 1 else 0
                for m in members:
                    b = base(m)
                    if b == bad:
                        written = bad
                        break
                    written |= b
                    for c in edges(m):
                        if c not in inside:
                            w = solved[c]
                            if w == bad:
                                written = bad
                                break
                            written |= w
                    if written == bad:
                        break
                result = written & keep if written != bad else bad
                for m in members:
                    solved[m] = result
        clob, derived = a["clob"], a["derived"]
        for i, w in solved.items():
            if w != bad:
                clob[i] = w
                derived[i] |= _CLOB

    def _heads(self, image: Image, lo: int, hi: int) -> list[tuple[int, tuple[int, ...] | None, int | None]]:
        """What a batch would learn of the entries of functions ``lo`` to ``hi`` (by
        index; learn_head, learn_code_end) from the records just made of ``image``'s
        bytes (a frozen copy: nothing is read again): per function that has any, its
        index, the masks of its first instructions' live registers (None: not
        known) and where its code ends (its offset; None: not known).  Functions
        whose clobbers are not settled (a record missing in their reach), and init
        text the kernel freed, are left to be learnt."""
        from ksim.analysis.function import named_target, standard_indirect
        from ksim.analysis.liveness import Target, TargetKind
        from ksim.analysis.record import view

        support = support_for(image.arch)
        caller_saved = support.convention.caller_saved
        a = self._arrays
        status, derived, clob, chunk, own = a["status"], a["derived"], a["clob"], a["chunk"], a["own"]
        functions = image.functions
        targets: dict[int, Target | None] = {}

        class Unsettled(Exception):
            pass

        def classify(target: int) -> Target:
            # classify_target's answer, with the clobbers _settle_clobbers found
            if target not in targets:
                named = named_target(image, support, target)
                if isinstance(named, Function):
                    j = self.index_of(named)
                    targets[target] = (Target(TargetKind.FUNCTION, clobbers=self._derived_set(clob[j]))
                                       if j is not None and derived[j] & _CLOB else None)
                else:
                    targets[target] = named
            found = targets[target]
            if found is None:
                raise Unsettled
            return found

        def indirect(insn: Any) -> bool:
            return standard_indirect(image, support, insn)

        out: list[tuple[int, tuple[int, ...] | None, int | None]] = []
        for i in range(lo, hi):
            func = functions[i]
            if status[i] != _OK or not derived[i] & _CLOB or image.freed(func.address):
                continue
            try:
                seen = view(support, image.read(func.address, func.size), self._record(i, func),
                            classify, indirect, caller_saved - self._names(chunk[i], own[i]))
                if seen is None:
                    continue
                live = seen.live_head(len(seen.addresses[:HEAD_LIVE]))
                end = seen.code_end()
            except (Unsettled, KsimError):
                continue
            out.append((i, self._head_masks(i, live),
                        end - func.address if func.address <= end <= func.end else None))
        return out

    def _settle_heads(self, found: Iterable[tuple[int, tuple[int, ...] | None, int | None]]) -> None:
        """Keep what ``_heads`` found, as learn_head and learn_code_end keep it."""
        for i, masks, end in found:
            if masks is not None:
                self._keep_head(i, masks)
            if end is not None:
                self._keep_code_end(i, end)

    def _derived_set(self, mask: int) -> frozenset[str]:
        names = self._derived_names.get(mask)
        if names is None:
            regs = self._derived_regs
            names = self._derived_names[mask] = frozenset(r for k, r in enumerate(regs) if mask >> k & 1)
        return names

    def _current(self, func: Function) -> int | None:
        """The index of ``func``'s record if it was analysed and (for an image read
        from a running kernel) its bytes are still the ones analysed."""
        i = self.index_of(func)
        return i if i is not None and self._current_at(i, func) else None

    def _current_at(self, i: int, func: Function) -> bool:
        """_current for record ``i``, ``func``'s."""
        if self._arrays["status"][i] != _OK:
            return False
        if self._image is not None:
            image = self._image()
            known = image.known_digest(func.address, func.size) if image is not None else None
            if known is not None:   # the reader knows it without the bytes
                return known == self._arrays["digest"][i]
            try:
                code = image.read(func.address, func.size) if image is not None else None
            except KsimError:
                code = None
            if code is None or code_digest(code) != self._arrays["digest"][i]:
                return False
        return True

    def _all_current(self, indices: Iterable[int], freed: Callable[[int], bool]) -> bool:
        """Whether every record at ``indices`` is current (_current_at), or its function
        is text the kernel ``freed``: one pass, the digests the reader knows compared
        as they come (a batch's reach is some thousands of functions)."""
        a = self._arrays
        status, digest, size, addr = a["status"], a["digest"], a["size"], self._addr
        image = self._image() if self._image is not None else None
        checked = [i for i in indices if not freed(addr[i])]
        if any(status[i] != _OK for i in checked):
            return False
        if image is None:
            return True
        found = image.known_digests([(addr[i], size[i]) for i in checked])
        for i, known in zip(checked, found, strict=True):
            if known is None:
                if not self._current_at(i, image.functions[i]):
                    return False
            elif known != digest[i]:
                return False
        return True

    def _names(self, chunk: int, mask: int) -> frozenset[str]:
        """The register names a chunk's bit mask stands for (a few hundred distinct
        masks serve a whole kernel: each is built once)."""
        key = (chunk, mask)
        names = self._masks.get(key)
        if names is None:
            regs = self._chunks[chunk]["regs"]
            names = self._masks[key] = frozenset(r for k, r in enumerate(regs) if mask >> k & 1)
        return names

    def _effects_of(self, chunk: int) -> Sequence[tuple[frozenset[str], frozenset[str]]]:
        found = self._effects.get(chunk)
        if found is None:
            found = self._effects[chunk] = _Effects(self, chunk)
        return found

    # --- the whole image ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._addr)

    def totals(self) -> dict[str, int]:
        """Functions analysed and failed, instructions, blocks and points of the image."""
        a = self._arrays
        ok = [s == _OK for s in a["status"]]
        return {
            "functions": sum(ok), "failed": len(ok) - sum(ok),
            "instructions": sum(a["n_insns"]) + sum(a["tail"]), "blocks": sum(a["blocks"]),
            "points": sum(ok) + sum(a["n_exits"]) + sum(a["n_bpoints"]) + sum(a["n_calls"]),
            "bytes": sum(s for s, good in zip(a["size"], ok, strict=True) if good),
        }

    def function_points(self, image: Image) -> Iterator[FunctionPoints]:
        """The points of every function analysed, in address order."""
        a = self._arrays
        exits, bpoints, calls = a["exits"], a["bpoints"], a["calls"]
        ex, bp, ca = (self._offsets[n] for n in ("n_exits", "n_bpoints", "n_calls"))
        for i, func in enumerate(image.functions):
            if a["status"][i] == _OK:
                yield FunctionPoints(func.name, func.address, tuple(exits[ex[i]:ex[i + 1]]),
                                     tuple(bpoints[bp[i]:bp[i + 1]]), tuple(calls[ca[i]:ca[i + 1]]))

    # --- bytes ------------------------------------------------------------------------------
    def body(self) -> bytes:
        starts = {_start_name(counter): array("I", self._offsets[counter]) for counter in _COUNTERS}
        return _encode({**self._arrays, **starts}, self._meta)

    def save(self, path: Path) -> None:
        """Write the store to ``path`` atomically (a temporary file, then rename)."""
        self.path = path
        self._learnt = 0
        body = self.body()
        header = _HEADER.pack(_MAGIC, ANALYSIS_VERSION, self.key, len(body), _digest(body))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(header)
                out.write(body)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users' processes out
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        prune(path.parent, keep=path)

    @classmethod
    def load(cls, path: Path, image: Image) -> Store | None:
        """The store at ``path`` for ``image``; None when there is none or it cannot be
        trusted (short, corrupt, another version, key or function table)."""
        try:
            data = _mapped(path)
        except (OSError, ValueError):   # missing, unreadable, empty
            return None
        try:
            store = cls.from_bytes(data, image)
            store.path = path
        except (StoreError, ValueError, KeyError, TypeError, IndexError, struct.error,
                UnicodeDecodeError, OverflowError):
            return None
        try:
            os.utime(path)  # used now: the last a prune removes (see prune)
        except OSError:
            pass  # another user's cache, read-only here
        return store

    @classmethod
    def from_bytes(cls, data: bytes | mmap.mmap, image: Image) -> Store:
        """The store ``data`` holds (a store file's bytes, or the file mapped: its
        arrays are then views of the mapping, read-only, but for what a batch learns)."""
        if len(data) < _HEADER.size:
            raise StoreError("short file")
        magic, version, key, length, digest = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != ANALYSIS_VERSION:
            raise StoreError(f"not a version-{ANALYSIS_VERSION} analysis store")
        if key != image_key(image):
            raise StoreError("the store is for another image")
        body = memoryview(data)[_HEADER.size:]
        if len(body) != length or _digest(body) != digest:
            raise StoreError("the store's body is damaged")
        arrays, meta = _decode(body, views=True)
        return cls(image, key, arrays, meta)


def _mapped(path: Path) -> mmap.mmap:
    """The file at ``path`` mapped read-only and private, its pages mapped at once: a
    store of some 36 MB is there in a millisecond, where reading it and copying its
    arrays out took 30.  A save replaces the file (a new one is renamed over it), so a
    mapping keeps the bytes it was made of."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                         prot=mmap.PROT_READ)


def _typecode(arr: array | memoryview) -> str:
    """An array's type code, or a view's format (the same letters)."""
    return arr.typecode if isinstance(arr, array) else arr.format


def code_digest(code: bytes) -> int:
    """What a record keeps of the bytes it was made from: their XXH64 (seed 0), as a
    live kernel's module digests text without it leaving the kernel (kmod's
    DIGEST_ROWS, lib/xxhash.c).  Not a cryptographic hash: it tells the bytes a record
    was made from from the bytes there now, which only who can write kernel text
    could make collide."""
    return xxhash.xxh64_intdigest(code)


def _digest(body: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(body)


def _encode(arrays: dict[str, array], meta: dict[str, Any]) -> bytes:
    entries: list[tuple[str, str, bytes]] = [(name, _typecode(arr), arr.tobytes())
                                             for name, arr in arrays.items()]
    entries.append(("meta", "J", json.dumps(meta, separators=(",", ":")).encode()))
    head = struct.pack("<I", len(entries)) + b"".join(
        _ENTRY.pack(name.encode(), code.encode(), len(raw)) for name, code, raw in entries)
    out = [head, bytes(-len(head) % 8)]
    for _name, _code, raw in entries:
        out += [raw, bytes(-len(raw) % 8)]
    return b"".join(out)


def _decode(body: memoryview, *, derived: bool = True, views: bool = False
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and meta of a body (a worker's part has nothing derived yet);
    ``views``: the arrays a store only reads are views of ``body``, not copies (those a
    batch learns into, _DERIVED, are copied)."""
    (count,) = struct.unpack_from("<I", body)
    if count > 256:
        raise StoreError(f"{count} arrays")
    at = 4 + count * _ENTRY.size
    at += -at % 8
    arrays: dict[str, Any] = {}
    meta: dict[str, Any] | None = None
    for k in range(count):
        raw_name, code, length = _ENTRY.unpack_from(body, 4 + k * _ENTRY.size)
        name = raw_name.rstrip(b"\0").decode()
        if at + length > len(body):
            raise StoreError(f"array {name!r} runs past the end")
        chunk = body[at:at + length]
        if code == b"J":
            meta = json.loads(bytes(chunk))
        else:
            typecode = code.decode()
            expected = (_PER_FUNCTION.get(name) or _DATA.get(name) or _DERIVED.get(name)
                        or _DERIVED_DATA.get(name) or _TABLES.get(name) or _STARTS.get(name)
                        or _EFFECTS.get(name) or _NAMES.get(name))
            if expected != typecode:
                raise StoreError(f"array {name!r} has type {typecode!r}")
            if views and name not in _DERIVED:
                if length % array(typecode).itemsize:
                    raise StoreError(f"array {name!r} is not a whole number of items")
                arrays[name] = chunk.cast(typecode)
            else:
                arr = array(typecode)
                arr.frombytes(chunk)
                arrays[name] = arr
        at += length + (-length % 8)
    missing = (set(_PER_FUNCTION) | set(_DATA)
               | (set(_DERIVED) | set(_DERIVED_DATA) | set(_EFFECTS) if derived else set())) - set(arrays)
    if meta is None or missing:
        raise StoreError(f"the store lacks {sorted(missing) or ['meta']}")
    return arrays, meta


# --- building -------------------------------------------------------------------------------
#: what forked workers work on: the image they analyse, then the store and image
#: whose entries they settle
_WORK: Any = None


def build(image: Image, *, jobs: int | None = None) -> Store:
    """Analyse every function of ``image`` (in ``jobs`` processes; default: one per
    core) into a store (not saved: see :meth:`Store.save`).  An image read from a
    running kernel is analysed from a frozen copy (:meth:`Image.frozen`): its bytes
    are read once, and the workers never use the reader."""
    source = image
    image = image.frozen()
    functions = image.functions
    jobs = max(1, jobs if jobs is not None else os.cpu_count() or 1)
    parts = _parts(image, jobs * 6) if jobs > 1 and len(functions) > 64 else [(0, len(functions))]
    workers = jobs if jobs > 1 and len(parts) > 1 and _can_fork() else 1
    bodies = _over_parts(image, _analyse_forked, lambda lo, hi: _analyse(image, lo, hi), parts,
                         workers)
    decoded = [_decode(memoryview(b), derived=False) for b in bodies]
    for k, (_arrays, part_meta) in enumerate(decoded):
        if part_meta.get("missed"):
            # the frozen copy lacked memory the analysis reads (a jump table): this
            # part again, here, where the image's own reader can answer
            decoded[k] = _decode(memoryview(_analyse(source, *parts[k])), derived=False)
    arrays, meta = _merge(decoded)
    arrays.update({name: array(code, bytes(array(code).itemsize * len(functions)))
                   for name, code in _DERIVED.items()})
    arrays.update({name: array(code) for name, code in _DERIVED_DATA.items()})
    unknown = _successors(image, arrays)
    meta["derived_regs"] = sorted(support_for(image.arch).convention.all_regs)
    addrs, kinds, blacklist = source.tables.packed()
    arrays.update(table_addrs=array("Q", addrs), table_kinds=array("B", kinds),
                  table_blacklist=array("Q", [x for extent in blacklist for x in extent]))
    names = [f.name for f in functions]
    arrays["name_order"] = array("I", sorted(range(len(functions)), key=names.__getitem__))
    store = Store(source, image_key(source), arrays, meta)
    store._settle_clobbers(source, unknown)
    # the entries' live registers and code ends, as a batch would learn them, in as
    # many processes as the analysis (2.9 s for Debian's 50,000 functions in one)
    for part in _over_parts((store, image), _heads_forked,
                            lambda lo, hi: store._heads(image, lo, hi), parts, workers):
        store._settle_heads(part)
    return store


def _over_parts(work: Any, forked: Callable[[tuple[int, int]], Any],
                here: Callable[[int, int], Any], parts: list[tuple[int, int]],
                jobs: int) -> list[Any]:
    """``here`` over each of ``parts`` (runs of functions, by index); with more than one
    job, ``forked`` in that many forked workers instead, which find ``work`` in _WORK."""
    if jobs < 2:
        return [here(lo, hi) for lo, hi in parts]
    global _WORK
    _WORK = work
    import multiprocessing  # a build's (loading a store needs none of it)

    try:
        with multiprocessing.get_context("fork").Pool(min(jobs, len(parts))) as pool:
            return pool.map(forked, parts, chunksize=1)
    finally:
        _WORK = None


def _successors(image: Image, a: dict[str, array]) -> list[bool]:
    """Fill ``succ`` / ``n_succ``: the functions each function calls or jumps into
    (clobbers.callees), by index -- the edges ``Store.settled`` walks.  Whether each
    function calls or jumps to something that is not a function."""
    from ksim.analysis.clobbers import callees

    functions = image.functions
    index = {f.address: i for i, f in enumerate(functions)}
    calls, jumps = a["n_calls_out"], a["n_jumps_out"]
    at_call = at_jump = 0
    unknowns = []
    for i in range(len(functions)):
        found, unknown = callees(image, a["calls_out"][at_call:at_call + calls[i]],
                                 a["jumps_out"][at_jump:at_jump + jumps[i]])
        at_call += calls[i]
        at_jump += jumps[i]
        a["succ"].extend(index[f.address] for f in found)
        a["n_succ"][i] = len(found)
        unknowns.append(unknown)
    return unknowns


def _can_fork() -> bool:
    # forking a process with other threads may copy a lock another thread holds
    import multiprocessing

    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


def _parts(image: Image, count: int) -> list[tuple[int, int]]:
    """``count`` runs of functions with about as much work each: the bytes before
    their padding (which costs next to nothing), plus a little per function."""
    functions = image.functions
    padding = bytes([support_for(image.arch).arch.pad_byte])
    weights = []
    for f in functions:
        try:
            weights.append(64 + len(image.read(f.address, f.size).rstrip(padding)))
        except KsimError:
            weights.append(64)
    total = sum(weights) or 1
    bounds = [0]
    acc = 0
    for i, w in enumerate(weights):
        acc += w
        if acc * count >= total * len(bounds) and i + 1 < len(functions):
            bounds.append(i + 1)
    bounds.append(len(functions))
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def _analyse_forked(part: tuple[int, int]) -> bytes:
    assert _WORK is not None
    return _analyse(_WORK, *part)


def _heads_forked(part: tuple[int, int]) -> list[tuple[int, tuple[int, ...] | None, int | None]]:
    store, image = _WORK
    return store._heads(image, *part)


#: functions are swept in groups of about this many bytes of code (small enough for
#: the decoder's records of a group to stay in the processor's caches)
_GROUP_BYTES = 1 << 14


def _analyse(image: Image, lo: int, hi: int) -> bytes:
    """The store body (arrays and meta) of functions ``lo`` to ``hi`` of ``image``."""
    from ksim.analysis.sweep import Row, sweep

    support = support_for(image.arch)
    arrays = {name: array(code) for name, code in {**_PER_FUNCTION, **_DATA}.items()}
    regs = sorted(support.convention.all_regs)
    bit = {r: 1 << k for k, r in enumerate(regs)}
    tables: dict[str, list] = {}
    errors: dict[str, str] = {}

    def mask(names: frozenset[str]) -> int:
        out = 0
        for name in names:
            if name not in bit:
                bit[name] = 1 << len(regs)
                regs.append(name)
            out |= bit[name]
        return out

    a = arrays
    missed_any = False
    for group_lo, group_hi in _groups(image.functions, lo, hi):
        group = image.functions[group_lo:group_hi]
        image.take_misses()
        rows, sizes, codes, targets, tail_code = sweep(image, support, group)
        missed = image.take_misses()
        if missed:
            # a frozen image lacked bytes the analysis read (a jump table's): which
            # function asked is not known, so the group is analysed afresh when used
            where = ", ".join(f"{a:#x}+{n}" for a, n in missed[:3])
            rows = [f"the analysis read memory the frozen image does not hold ({where})"] * len(group)
            sizes, codes, targets = b"", [], []
            missed_any = True
        a["sizes"].frombytes(sizes)
        a["codes"].extend(codes)
        a["targets"].extend(targets)
        ok = [r for r in rows if isinstance(r, Row)]
        for i, row in enumerate(rows, start=group_lo):
            if isinstance(row, Row):
                if row.tables:
                    tables[str(i)] = [[t.jump, t.table, t.index_reg, list(t.entries)] for t in row.tables]
            else:
                errors[str(i)] = row
        a["addr"].extend(f.address for f in group)
        a["size"].extend(f.size for f in group)
        a["status"].extend(_OK if isinstance(r, Row) else _FAILED for r in rows)
        for name, value in _COLUMNS:
            a[name].extend(value(r) if isinstance(r, Row) else 0 for r in rows)
        a["tail_code"].extend(tail_code if isinstance(r, Row) and r.tail else 0 for r in rows)
        a["own"].extend(mask(r.own_writes) if isinstance(r, Row) else 0 for r in rows)
        a["chunk"].extend(0 for _ in rows)
        a["digest"].extend(code_digest(image.read(f.address, f.size)) if isinstance(r, Row) else 0
                           for f, r in zip(group, rows, strict=True))
        for row in ok:
            a["exits"].extend(row.exits)
            a["bpoints"].extend(row.block_points)
            a["calls"].extend(row.callsites)
            a["calls_out"].extend(row.calls_out)
            a["jumps_out"].extend(row.jumps_out)
    effects = [[mask(r), mask(w)] for r, w in list(support.effects)]
    meta = {"chunks": [{"first": lo, "regs": regs, "effects": effects}], "tables": tables,
            "errors": errors, "missed": missed_any}
    return _encode(arrays, meta)


#: per-function arrays filled from a sweep's rows
_COLUMNS: tuple[tuple[str, Callable[[Any], int]], ...] = (
    ("n_insns", attrgetter("instructions")), ("tail", attrgetter("tail")),
    ("n_targets", attrgetter("targets")), ("blocks", attrgetter("blocks")),
    ("n_exits", lambda r: len(r.exits)), ("n_bpoints", lambda r: len(r.block_points)),
    ("n_calls", lambda r: len(r.callsites)), ("worst", attrgetter("worst")),
    ("n_calls_out", lambda r: len(r.calls_out)), ("n_jumps_out", lambda r: len(r.jumps_out)),
)


def _groups(functions: tuple[Function, ...], lo: int, hi: int) -> list[tuple[int, int]]:
    """Runs of functions from ``lo`` to ``hi`` of about _GROUP_BYTES bytes each."""
    out = []
    start, acc = lo, 0
    for i in range(lo, hi):
        acc += functions[i].size
        if acc >= _GROUP_BYTES:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < hi:
        out.append((start, hi))
    return out


def _merge(parts: list[tuple[dict[str, array], dict[str, Any]]]) -> tuple[dict[str, array], dict[str, Any]]:
    """The parts' arrays and meta as one store's: each part is a chunk, its effects
    (a part's list of masks) in the effects array."""
    arrays = {name: array(code) for name, code in {**_PER_FUNCTION, **_DATA, **_EFFECTS}.items()}
    meta: dict[str, Any] = {"chunks": [], "tables": {}, "errors": {}}
    for k, (part, part_meta) in enumerate(parts):
        for name, arr in part.items():
            if name == "chunk":
                arrays[name].extend([k] * len(arr))
            else:
                arrays[name].extend(arr)
        for chunk in part_meta["chunks"]:
            effects = chunk["effects"]
            arrays["effects"].extend(x for pair in effects for x in pair)
            meta["chunks"].append({"first": chunk["first"], "regs": chunk["regs"],
                                   "n_effects": len(effects)})
        meta["tables"].update(part_meta["tables"])
        meta["errors"].update(part_meta["errors"])
    return arrays, meta


# --- which store an image has -------------------------------------------------------------------
_UNSET = object()
_STORES: weakref.WeakKeyDictionary[Image, Any] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether stores are used at all (``KSIM_ANALYSIS_STORE=off`` turns them off)."""
    return os.environ.get("KSIM_ANALYSIS_STORE", "auto").lower() not in ("off", "0", "no", "false")


def store_for(image: Image, *, build_missing: bool | None = None) -> Store | None:
    """The analysis store of ``image``: loaded from disk once per image, or built
    (and saved) when there is none and ``build_missing`` says so (default: when the
    image has :data:`AUTO_BUILD_FUNCTIONS` functions or more).  None when the image
    has none, or cannot have one (it is read from a running kernel that has no
    identity).  An image read from a running kernel is not built for by default."""
    found = _STORES.get(image, _UNSET)
    if isinstance(found, Store):
        return found
    if found is None:
        return None  # pinned: no store
    if not enabled() or (image.reads_memory and image.identity is None) or sys.byteorder != "little":
        _STORES[image] = None
        return None
    if found is _UNSET:
        store = Store.load(path_for(image), image)
        if store is not None:
            _STORES[image] = store
            return store
        _STORES[image] = False  # looked: none on disk
    if build_missing is None:
        # a running kernel's store costs a read of all its text: built when asked
        build_missing = len(image.functions) >= AUTO_BUILD_FUNCTIONS and not image.reads_memory
    if not build_missing:
        return None
    return analyze_image(image)


#: a batch over at least this many functions builds the image's store if it has none
#: (on a running kernel: one read of its text and a whole-kernel analysis, instead of
#: some milliseconds per function analysed alone)
BATCH_BUILD_FUNCTIONS = 1000


def for_batch(image: Image, functions: int) -> Store | None:
    """The store a batch over ``functions`` functions of ``image`` should use: the one
    it has, or (for :data:`BATCH_BUILD_FUNCTIONS` functions or more) a new one."""
    return store_for(image, build_missing=True if functions >= BATCH_BUILD_FUNCTIONS else None)


def analyze_image(image: Image, *, jobs: int | None = None, save: bool = True) -> Store:
    """Analyse every function of ``image`` into a store, keep it for the image, and
    (unless ``save`` is False) save it for the next process."""
    store = build(image, jobs=jobs)
    if save and enabled() and (not image.reads_memory or image.identity is not None):
        try:
            store.save(path_for(image))
        except OSError:
            pass  # a read-only cache: the store still serves this process
    _STORES[image] = store
    return store


def use(image: Image, store: Store | None) -> None:
    """Pin the store ``image`` uses (None: none at all), whatever is on disk."""
    _STORES[image] = store


#: facts a process must have learnt for its store to be saved again: rewriting the
#: store (some 36 MB for a kernel) costs a command 0.07-0.14 s once; working the facts
#: out again costs every later command 0.15-0.4 ms a fact (a probe's entry: its
#: liveness and code end, two facts).  A command over some 100 functions learns 200:
#: saved, the next one attaches in 40 ms less
FLUSH_LEARNT = 64


def flush(image: Image, *, least: int = FLUSH_LEARNT) -> None:
    """Save what ``image``'s store learnt (``learn_clobbers``, ``learn_head``,
    ``learn_code_end``) where it is kept, for the next process, once it is ``least``
    facts or more; nothing when it is kept nowhere (a read-only cache keeps it for
    this process only)."""
    kept = _STORES.get(image)
    if isinstance(kept, Store) and kept._learnt >= max(1, least) and kept.path is not None \
            and enabled():
        try:
            kept.save(kept.path)
        except OSError:
            pass
