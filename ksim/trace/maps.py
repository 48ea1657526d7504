"""Maps in the kernel's data heap: layout, hashing, and the client's side of them.

Each map is one heap block (``Manager.alloc_data``) of 8-byte words, a table of
``slots`` records of ``stride`` words::

    unkeyed map (one record)     [present, value...]
    keyed map   (slots records)  [tag, key_0 .. key_k-1, present, value...]
    lost counter (keyed maps)    one word of its own block: updates that found no slot

A keyed map is a hash table with open addressing.  The keys hash to a 64-bit
``h`` (:func:`hash_keys`, computed the same way by snippet code, :func:`hash_tree`);
``tag = h | 1`` is never 0, and the probe sequence starts at the top ``log2(slots)``
bits of ``h`` and goes on linearly for at most ``probes`` slots.  A record is
claimed by a compare-and-swap of its tag from 0 (``lock cmpxchg``, the
CompareExchange node); only the winner writes the keys.  A lookup stops at the
first empty record (records are never emptied: ``delete`` clears ``present`` and
the values, and the keys stay).  A racing updater of the same key that finds the
tag set but the keys not written yet moves on and may claim a second record for
the key: the client merges records with equal keys when it reads the map, so a
race costs a record, never a count.  An update that finds no record among its
``probes`` counts one lost update.

Values (``value...``) by kind: ``int``/``count``/``sum`` one word; ``min``/``max``
one word holding the value biased so that an unsigned maximum is the answer (max:
``x ^ 2**63``; min: ``~(x ^ 2**63)``) and 0 means "none yet"; ``avg`` the sum and
the count; ``hist`` 65 power-of-two buckets; ``lhist`` ``(max - min) / step + 2``
linear buckets (both as bpftrace's language computes them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ksim.snippets import ast

MASK = (1 << 64) - 1
SIGN = 1 << 63
WORD = 8
#: the hash: a multiply-xorshift over the keys (constants from splitmix64)
SEED = 0x9E3779B97F4A7C15
MULT = 0xBF58476D1CE4E5B9
#: records a keyed update or lookup examines before it gives up
PROBES = 8
#: a keyed map's table is sized to at most this many bytes (and 64..4096 records)
TABLE_BYTES = 64 * 1024
HIST_BUCKETS = 65


#: words a key (or a printf argument) of each kind takes; one unless named here
WIDTH = {"comm": 2}


@dataclass
class MapType:
    """What the program says of a map: its key kinds and its value kind."""

    name: str
    #: per key: "int", "ksym" / "probe" (a name, held as an index into ``names``), or
    #: "comm" (a task's name, its bytes held in two words)
    keys: tuple[str, ...] | None = None
    #: int, count, sum, min, max, avg, hist, lhist (None: only read or deleted so far)
    kind: str | None = None
    lhist: tuple[int, int, int] | None = None

    @property
    def value_words(self) -> int:
        if self.kind == "avg":
            return 2
        if self.kind == "hist":
            return HIST_BUCKETS
        if self.kind == "lhist":
            assert self.lhist is not None
            lo, hi, step = self.lhist
            return (hi - lo) // step + 2
        return 1


@dataclass
class MapLayout:
    """Where a map lives and how its records are laid out."""

    type: MapType
    base: int
    slots: int
    probes: int
    lost: int | None
    #: strings keys of kind ksym/probe stand for (shared by every map of a program)
    names: list[str] = field(default_factory=list)

    @property
    def keyed(self) -> bool:
        return bool(self.type.keys)

    @property
    def nkeys(self) -> int:
        """Words of a record's key (a comm key takes two)."""
        return key_words(self.type.keys or ())

    @property
    def tag(self) -> int:
        return 0

    @property
    def key0(self) -> int:
        return 1

    @property
    def present(self) -> int:
        return 1 + self.nkeys if self.keyed else 0

    @property
    def value0(self) -> int:
        return self.present + 1

    @property
    def stride(self) -> int:
        return self.value0 + self.type.value_words

    @property
    def words(self) -> int:
        return self.slots * self.stride

    @property
    def size(self) -> int:
        return WORD * self.words

    @property
    def bits(self) -> int:
        return self.slots.bit_length() - 1

    # --- snippet side ------------------------------------------------------------------
    def word(self, slot: ast.Node | int, index: int | ast.Node) -> ast.Node:
        """Word ``index`` of record ``slot`` (both may be computed): a Var when the
        address is constant, else an Elem of the whole table."""
        if isinstance(slot, int) and isinstance(index, int):
            return ast.Var(self.base + WORD * (slot * self.stride + index))
        at = ast.lift(slot * self.stride) + index
        return ast.Elem(self.base, self.words, at)


def key_words(kinds: Sequence[str]) -> int:
    """Words a key of these kinds is held in."""
    return sum(WIDTH.get(k, 1) for k in kinds)


def layout_for(mtype: MapType, alloc: Callable[[int], int], names: list[str]) -> MapLayout:
    """Allocate ``mtype``'s table (and lost counter) with ``alloc(size) -> address``."""
    if not mtype.keys:
        words = 1 + mtype.value_words
        return MapLayout(mtype, alloc(WORD * words), 1, 1, None, names)
    stride = 2 + key_words(mtype.keys) + mtype.value_words
    slots = 64
    while slots < 4096 and 2 * slots * stride * WORD <= TABLE_BYTES:
        slots *= 2
    base = alloc(WORD * slots * stride)
    return MapLayout(mtype, base, slots, min(PROBES, slots), alloc(WORD), names)


# --- hashing ----------------------------------------------------------------------------------
def hash_keys(keys: Sequence[int]) -> int:
    """The 64-bit hash of a key tuple (what :func:`hash_tree` computes in the kernel)."""
    h = SEED
    for k in keys:
        h = ((h ^ (k & MASK)) * MULT) & MASK
        h ^= h >> 29
    return h


def hash_tree(keys: Sequence[ast.Node]) -> ast.Node:
    h: ast.Node = ast.Const(SEED)
    for k in keys:
        h = (h ^ k) * ast.Const(MULT)
        h = h ^ ast.lshr(h, 29)
    return h


def start_slot(h: int, layout: MapLayout) -> int:
    return h >> (64 - layout.bits) if layout.bits else 0


# --- the client's side: a map's records read back ---------------------------------------------
class Table:
    """A map's records as the client sees them: read, written back, merged."""

    def __init__(self, layout: MapLayout, read: Callable[[int, int], bytes],
                 write: Callable[[int, bytes], None]) -> None:
        self.layout = layout
        self._read, self._write = read, write

    def words(self) -> list[int]:
        raw = self._read(self.layout.base, self.layout.size)
        return [int.from_bytes(raw[i:i + WORD], "little") for i in range(0, len(raw), WORD)]

    def record(self, words: list[int], slot: int) -> list[int]:
        s = self.layout.stride
        return words[slot * s:(slot + 1) * s]

    def entries(self) -> dict[tuple[int, ...], list[int]]:
        """Key tuple -> value words of every present record, records of one key merged."""
        lay = self.layout
        words = self.words()
        out: dict[tuple[int, ...], list[int]] = {}
        for slot in range(lay.slots):
            rec = self.record(words, slot)
            if lay.keyed and rec[lay.tag] == 0 or not rec[lay.present]:
                continue
            key = tuple(rec[lay.key0:lay.key0 + lay.nkeys]) if lay.keyed else ()
            values = rec[lay.value0:]
            out[key] = merge(lay.type.kind, out[key], values) if key in out else values
        return out

    def lost(self) -> int:
        if self.layout.lost is None:
            return 0
        return int.from_bytes(self._read(self.layout.lost, WORD), "little")

    def find(self, key: Sequence[int], claim: bool) -> int | None:
        """The record of ``key`` (claimed when ``claim`` and absent), as the kernel's
        code would find it; None when absent (or, claiming, when no record is free)."""
        lay = self.layout
        if not lay.keyed:
            return 0
        words = self.words()
        h = hash_keys(key)
        tag, slot = h | 1, start_slot(h, lay)
        for _ in range(lay.probes):
            rec = self.record(words, slot)
            if rec[lay.tag] == tag and tuple(rec[lay.key0:lay.key0 + lay.nkeys]) == tuple(
                    k & MASK for k in key):
                return slot
            if rec[lay.tag] == 0:
                if not claim:
                    return None
                self.put(slot, lay.tag, tag)
                for i, k in enumerate(key):
                    self.put(slot, lay.key0 + i, k)
                return slot
            slot = (slot + 1) % lay.slots
        return None

    def put(self, slot: int, index: int, value: int) -> None:
        address = self.layout.base + WORD * (slot * self.layout.stride + index)
        self._write(address, (value & MASK).to_bytes(WORD, "little"))

    def get(self, slot: int, index: int) -> int:
        address = self.layout.base + WORD * (slot * self.layout.stride + index)
        return int.from_bytes(self._read(address, WORD), "little")

    def clear(self) -> None:
        """Every record no longer present, its values 0.  Tags and keys stay: records
        claimed before the run for constant keys (which snippets address directly)
        must stay theirs."""
        lay = self.layout
        words = self.words()
        for slot in range(lay.slots):
            for i in range(lay.present, lay.stride):
                words[slot * lay.stride + i] = 0
        self._write(lay.base, b"".join(w.to_bytes(WORD, "little") for w in words))

    def delete(self, key: Sequence[int]) -> None:
        """The record(s) of ``key`` no longer present, their values 0 (the keys stay, so
        that lookups that probe past them still do)."""
        lay = self.layout
        words = self.words()
        for slot in range(lay.slots):
            rec = self.record(words, slot)
            if lay.keyed and (rec[lay.tag] == 0 or tuple(rec[lay.key0:lay.key0 + lay.nkeys])
                              != tuple(k & MASK for k in key)):
                continue
            for i in range(lay.present, lay.stride):
                self.put(slot, i, 0)


def merge(kind: str | None, a: list[int], b: list[int]) -> list[int]:
    """Value words of two records of one key, merged."""
    if kind in ("min", "max"):
        return [max(a[0], b[0])]            # both biased so that the larger wins
    if kind == "int":
        return b
    return [(x + y) & MASK for x, y in zip(a, b, strict=True)]


def signed(value: int) -> int:
    value &= MASK
    return value - (1 << 64) if value & SIGN else value


def encode_extreme(kind: str, value: int) -> int:
    """A min/max map's stored word for ``value``."""
    u = (value & MASK) ^ SIGN
    return u if kind == "max" else (~u) & MASK


def decode_extreme(kind: str, word: int) -> int:
    u = word if kind == "max" else (~word) & MASK
    return signed(u ^ SIGN)


def scalar(kind: str | None, values: list[int]) -> int:
    """The integer a map's value words stand for (what reading ``@m[k]`` yields)."""
    if kind in ("min", "max"):
        return decode_extreme(kind, values[0])
    if kind == "avg":
        total, count = signed(values[0]), values[1]
        if not count:
            return 0
        q = abs(total) // count            # truncating toward zero, as C's division
        return q if total >= 0 else -q
    if kind == "count":
        return values[0]
    return signed(values[0])


def comm_text(words: Sequence[int]) -> str:
    """A task's name from the words it is held in (NUL padded)."""
    raw = b"".join((w & MASK).to_bytes(WORD, "little") for w in words)
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def decode_key(kinds: Sequence[str], words: Sequence[int], names: Sequence[str]) -> list[Any]:
    """A key's parts from its words: an int, or the text of a name or a comm."""
    out: list[Any] = []
    at = 0
    for kind in kinds:
        n = WIDTH.get(kind, 1)
        part = words[at:at + n]
        at += n
        if kind == "comm":
            out.append(comm_text(part))
        elif kind in ("ksym", "probe", "name"):
            out.append(names[part[0]] if 0 <= part[0] < len(names) else "")
        else:
            out.append(signed(part[0]))
    return out


__all__ = ["HIST_BUCKETS", "MapLayout", "MapType", "Table", "WIDTH", "comm_text", "decode_key",
           "hash_keys", "hash_tree", "key_words", "layout_for", "scalar"]
