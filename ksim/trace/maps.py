"""Maps in the kernel's data heap: layout, sizing, hashing, and the client's side.

Each map is one heap block (``Manager.alloc_data``) of 8-byte words::

    map without keys   [present, value...]
    keyed map          header   [used, lost]
                       index    ``slots`` words: 0 (empty) or hi32(h) << 32 | record + 1
                       direct   ``direct`` words, one per constant key: 0 or record + 1
                       records  ``capacity`` records of [key_0 .. key_k-1, present, value...]

A keyed map holds at most ``capacity`` keys: bpftrace's ``max_map_keys``.  Records
are handed out in order by ``used`` (a bump counter); an update whose key has no
record and gets none (the map is full) adds one to ``lost``, which the client
reports at the end.  How many records a map gets (:func:`size_map`): exactly as
many as the keys it can have when every key is a constant (``func``, ``probe``, an
integer literal) -- a kprobe on 35,000 functions gets 35,000 records for
``@[func]`` -- otherwise the program's ``max_map_keys``, or 4,096 as bpftrace's
default (fewer when the heap cannot hold that many: :func:`shrink`).

Constant keys are placed by the client before the run (:func:`place`): the snippet
addresses the record directly (a plain Var).  When a map has more constant keys
than it may hold (a program's max_map_keys below the functions its ``@[func]``
probes), each constant key has a word of its own instead (``direct``), which the
first update of the key claims a record for: the first keys to arrive get the
records, as in bpftrace, with no search.  Keys computed at run time are found
by the snippet through the index, a hash table with open addressing: the keys
hash to a 64-bit ``h`` (:func:`hash_keys`, computed the same way by snippet code,
:func:`hash_tree`); the search starts at slot ``h >> (64 - log2(slots))`` and goes
on linearly for at most ``probes`` slots.  A slot is claimed by a compare-and-swap
from 0 (``lock cmpxchg``, the CompareExchange node) after a record was reserved
by a compare-and-swap of ``used`` below ``capacity``; only the winner writes the
keys into its record.  Index slots are never emptied (``delete`` clears
``present`` and the values), so a search stops at the first empty slot.  A racing
updater of the same key that finds the slot taken but the record's keys not
written yet moves on and may claim a second record for the key: the client merges
records with equal keys when it reads the map, so a race costs a record, never a
count.  The index has four slots per record and a search examines up to 12: a
run that fills a 4,096-key map finds no free slot in its window about once in 20
fills (lost updates the client reports, with the map not full).

Maps whose every kernel access has a constant key have no index in the kernel
at all: the client keeps it (a dict), so placing 35,000 keys costs no search.

Values (``value...``) by kind: ``int``/``count``/``sum`` one word; ``min``/``max``
one word holding the value biased so that an unsigned maximum is the answer (max:
``x ^ 2**63``; min: ``~(x ^ 2**63)``) and 0 means "none yet"; ``avg`` the sum and
the count; ``hist`` 65 power-of-two buckets; ``lhist`` ``(max - min) / step + 2``
linear buckets (both as bpftrace's language computes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ksim.snippets import ast

MASK = (1 << 64) - 1
SIGN = 1 << 63
WORD = 8
#: the hash: a multiply-xorshift over the keys (constants from splitmix64)
SEED = 0x9E3779B97F4A7C15
MULT = 0xBF58476D1CE4E5B9
#: an index entry: the hash's upper half beside the record's number (plus one)
HI = MASK ^ 0xFFFFFFFF
LO = 0xFFFFFFFF
#: index slots a keyed update or lookup examines before it gives up (unrolled in
#: the snippet: each is code)
PROBES = 12
#: index slots per record: at a load of a quarter, a window of 12 is full about
#: once in 20 runs that fill 4,096 keys (a simulation of linear probing)
INDEX_PER_RECORD = 4
#: compare-and-swaps of ``used`` a snippet tries to reserve a record (each failed
#: one means another cpu reserved one meanwhile)
RESERVE_TRIES = 3
#: bpftrace's default max_map_keys, for a map whose keys are computed
DEFAULT_MAX_MAP_KEYS = 4096
#: a map sized by default holds no fewer keys than this when the heap is short
MIN_DEFAULT_KEYS = 64
#: the largest max_map_keys: a record's number must fit the index entry's low half
MAX_MAP_KEYS = 1 << 31
#: words of a keyed map's header: used, lost
HEADER = 2
HIST_BUCKETS = 65


#: words a key (or a printf argument) of each kind takes; one unless named here
#: (and ``str:N``, a string of N bytes: N / 8)
WIDTH = {"comm": 2, "inet": 3}
#: kinds whose words hold text (a string's bytes, NUL padded)
TEXT_KINDS = ("comm",)


def width(kind: str) -> int:
    """Words a value of ``kind`` is held in."""
    if kind.startswith(TUPLE):
        return sum(width(k) for k in tuple_items(kind))
    if kind.startswith("str:"):
        return -(-int(kind[4:]) // WORD)
    if kind.startswith("kstack:"):
        return int(kind.split(":")[1])
    if kind.startswith("ustack:"):
        return 1 + int(kind.split(":")[1])        # the pid, then the frames
    if kind.startswith("buf:"):
        return 1 + -(-int(kind[4:]) // WORD)
    if kind.startswith("bytes:"):
        return -(-int(kind[6:]) // WORD)
    return WIDTH.get(kind, 1)


#: a tuple's kind: this prefix, then the JSON list of its items' kinds (an item
#: may be a tuple itself)
TUPLE = "tuple:"


def tuple_kind(items: Sequence[str]) -> str:
    """The kind of a tuple whose items have these kinds."""
    return TUPLE + json.dumps(list(items), separators=(",", ":"))


def tuple_items(kind: str) -> list[str]:
    """The kinds of a tuple kind's items."""
    return list(json.loads(kind[len(TUPLE):]))


class TupleValue(tuple):  # type: ignore[type-arg]
    """A tuple's decoded items: printed as bpftrace prints a tuple, ``(a, b, c)`` (a
    string item as its text); a list in JSON (:func:`plain`)."""

    def __str__(self) -> str:
        return "(" + ", ".join(str(x) for x in self) + ")"


def plain(value: Any) -> Any:
    """A decoded value as JSON holds it: a tuple as a list of its items."""
    if isinstance(value, TupleValue):
        return [plain(x) for x in value]
    return value


#: the kinds whose values the client names: errno numbers (strerror), system call
#: numbers (syscall_name), MAC addresses (macaddr), uids (username)
ERRNO, SYSCALL, MAC, USERNAME = "strerror", "syscall", "macaddr", "username"


def is_text(kind: str | None) -> bool:
    return kind is not None and (kind in TEXT_KINDS or kind.startswith("str:"))


def is_decoded(kind: str | None) -> bool:
    """Whether a map value of ``kind`` prints as something other than its integer."""
    return kind is not None and (kind in VALUE_KINDS or is_text(kind)
                                 or kind.startswith(("kstack:", "ustack:", "tm:", "buf:", "bytes:",
                                                     TUPLE)))


def is_named(kind: str | None) -> bool:
    """Whether a value of ``kind`` is, to the program, what it prints as (a tuple, an
    errno's or a system call's name, a MAC address, pton's bytes), not a number."""
    return kind is not None and (kind in (ERRNO, SYSCALL, MAC, USERNAME)
                                 or kind.startswith((TUPLE, "bytes:")))


#: value kinds a map holds as a plain value (assigned, not aggregated) that are not
#: integers: strings, names, addresses printed as symbols, addresses of the network
VALUE_KINDS = ("comm", "ksym", "probe", "kaddr", "inet", "ptr", "cgroup_path", ERRNO, SYSCALL,
               MAC, USERNAME)


#: how a kernel address is named (set by the client: the kernel's symbols)
SYMBOLIZE: list[Callable[[int], str]] = []


#: how a user address of a process is named: (pid, address, perf mode) -> its frame's
#: text (set by the client: the traced machine's files, ksim.trace.usym)
USER_SYMBOLIZE: list[Callable[[int, int, bool], str]] = []


#: how a cgroup's id is named (set by the client: the traced machine's cgroups)
CGROUP_PATHS: list[Callable[[int], str]] = []


#: how a system call's number is named (set by the client: the kernel's table)
SYSCALL_NAMES: list[Callable[[int], str]] = []
#: bpftrace's text for a number its table has no name for
UNKNOWN_SYSCALL = "Unknown syscall"
#: how a uid is named (set by the client: the traced machine's /etc/passwd)
USERNAMES: list[Callable[[int], str]] = []


def errno_text(n: int) -> str:
    """strerror(n) as bpftrace 0.17's user space prints it: the C library's strerror(3)
    of n as a C int (its low 32 bits, signed: "Unknown error -2" for -2)."""
    import os

    n &= 0xFFFFFFFF
    return os.strerror(n - (1 << 32) if n >> 31 else n)


def mac_text(word: int) -> str:
    """macaddr()'s text: six bytes, in memory order, as upper-case hex with colons."""
    return ":".join(f"{b:02X}" for b in (word & MASK).to_bytes(WORD, "little")[:6])


def bytes_text(words: Sequence[int], n: int) -> str:
    """An array of ``n`` bytes (pton()'s) as bpftrace prints an integer array."""
    raw = b"".join((w & MASK).to_bytes(WORD, "little") for w in words)[:n]
    return "[" + ",".join(str(b) for b in raw) + "]"


def symbol_text(address: int) -> str:
    for f in SYMBOLIZE[-1:]:
        return f(address)
    return f"0x{address & MASK:x}"


def buf_text(words: Sequence[int]) -> str:
    """buf()'s bytes as bpftrace's %r prints them: printable ASCII as it is, any
    other byte as \\xNN."""
    raw = b"".join((w & MASK).to_bytes(WORD, "little") for w in words[1:])[:words[0] & MASK]
    return "".join(chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in raw)


#: the spaces before a stack's frame in "bpftrace" mode: bpftrace 0.17 indents a map
#: key's by 4, a value's (printed, or printf's %s) by 8 (BPFtrace::get_stack's indent)
KEY_INDENT, VALUE_INDENT = 4, 8


def stack_text(words: Sequence[int], mode: str, indent: int = VALUE_INDENT) -> str:
    """A kernel stack as bpftrace prints it: a line per frame, "bpftrace" mode
    ``sym+off`` indented, "perf" mode ``\taddress sym+off``, "raw" mode the
    addresses."""
    frames = [w & MASK for w in words]
    if 0 in frames:
        frames = frames[:frames.index(0)]
    if mode == "raw":
        return "".join(f"\n{f:x}" for f in frames) + "\n"
    if mode == "perf":
        return "".join(f"\n\t{f:x} {symbol_text(f)}" for f in frames) + "\n"
    return "".join(f"\n{' ' * indent}{symbol_text(f)}" for f in frames) + "\n"


def user_frame_text(pid: int, address: int, perf: bool) -> str:
    for f in USER_SYMBOLIZE[-1:]:
        return f(pid, address, perf)
    return f"0x{address:x}" + (" ([unknown])" if perf else "")


def ustack_text(words: Sequence[int], mode: str, indent: int = VALUE_INDENT) -> str:
    """A user stack (its pid, then its frames) as bpftrace 0.17 prints it
    (BPFtrace::get_stack): as a kernel stack, each frame named in the process's files
    (``sym+off``, with `` (module)`` in perf mode); no text at all for a stack with no
    frame (a kernel thread's: bpftrace's stack id is then -EFAULT, printed as "")."""
    pid, frames = words[0] & 0xFFFFFFFF, [w & MASK for w in words[1:]]
    if 0 in frames:
        frames = frames[:frames.index(0)]
    if not frames:
        return ""
    if mode == "raw":
        return "".join(f"\n{f:x}" for f in frames) + "\n"
    if mode == "perf":
        return "".join(f"\n\t{f:x} {user_frame_text(pid, f, True)}" for f in frames) + "\n"
    return "".join(f"\n{' ' * indent}{user_frame_text(pid, f, False)}" for f in frames) + "\n"


def inet_text(words: Sequence[int]) -> str:
    """ntop()'s text from its words: the family, then the address's 16 bytes."""
    import socket

    family = words[0] if words else 0
    raw = b"".join((w & MASK).to_bytes(WORD, "little") for w in words[1:3])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[:16])
    return socket.inet_ntop(socket.AF_INET, raw[:4])


def decode(kind: str, part: Sequence[int], names: Sequence[str]) -> Any:
    """The value a key part or a map value of ``kind`` stands for."""
    if is_text(kind):
        return comm_text(part)
    if kind in ("ksym", "probe", "name"):
        return names[part[0]] if 0 <= part[0] < len(names) else ""
    if kind == "kaddr":
        return symbol_text(part[0]).partition("+")[0]   # ksym(): the symbol's name
    if kind == "ptr":
        return f"0x{part[0] & MASK:x}"
    if kind == "cgroup_path":
        for f in CGROUP_PATHS[-1:]:
            return f(part[0] & MASK)
        return str(part[0] & MASK)
    if kind == "inet":
        return inet_text(part)
    if kind == ERRNO:
        return errno_text(part[0])
    if kind == SYSCALL:
        for f in SYSCALL_NAMES[-1:]:
            return f(signed(part[0]))
        return UNKNOWN_SYSCALL
    if kind == MAC:
        return mac_text(part[0])
    if kind == USERNAME:
        for f in USERNAMES[-1:]:
            return f(part[0] & 0xFFFFFFFF)
        return ""
    if kind.startswith("bytes:"):
        return bytes_text(part, int(kind[6:]))
    if kind.startswith(TUPLE):
        items, at = [], 0
        for k in tuple_items(kind):
            n = width(k)
            items.append(decode(k, part[at:at + n], names))
            at += n
        return TupleValue(items)
    if kind.startswith("kstack:"):
        return stack_text(part, kind.split(":")[2])
    if kind.startswith("ustack:"):
        return ustack_text(part, kind.split(":")[2])
    if kind.startswith("buf:"):
        return buf_text(part)
    if kind.startswith("tm:"):
        # strftime(): the time the client reads it at (events are read as they come)
        import time

        return time.strftime(kind[3:])
    return signed(part[0])


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
    #: an avg kept for stats() (printed as count, average and total)
    stats: bool = False
    #: a pointer map's values' type (what reading @m[k] gives, to follow with ->)
    ctype: Any = None

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
        return width(self.kind or "int")


@dataclass(frozen=True)
class Sizing:
    """How many keys a keyed map holds and how they are found."""

    #: records: the most keys the map holds
    capacity: int
    #: index slots in the kernel (0: every kernel access has a constant key, placed
    #: by the client, which keeps the index itself)
    slots: int
    #: the max_map_keys a full map reports (the capacity, or the setting it came from)
    max_map_keys: int
    #: the capacity came from the default and may be lowered to fit the heap
    flexible: bool = False
    #: the constant keys get their records before the run (False when they are more
    #: than the capacity: then the first keys to arrive get the records, as in bpftrace)
    place: bool = True
    #: words of constant keys not placed, each the record its key got (when no kernel
    #: access computes a key; otherwise they are searched for through the index)
    direct: int = 0

    @property
    def probes(self) -> int:
        return min(PROBES, self.slots)


@dataclass
class MapUse:
    """What the program does with a keyed map, found before it is placed."""

    #: constant key tuples, in the order they are first used (the kernel's and the client's)
    consts: dict[tuple[int, ...], None] = field(default_factory=dict)
    #: some access (anywhere) has a key computed when it runs
    computed: bool = False
    #: some kernel access has a key computed when it runs
    kernel_computed: bool = False


def index_slots(capacity: int) -> int:
    """The index of a map that holds ``capacity`` keys: a power of two, four per key."""
    return 1 << max(4, (INDEX_PER_RECORD * capacity - 1).bit_length())


def size_map(use: MapUse, max_map_keys: int | None) -> Sizing:
    """A keyed map's size: exactly its constant keys when every key is one (more than
    the default if need be, fewer than the setting), else ``max_map_keys`` (the
    program's or the default)."""
    n = len(use.consts)
    if not use.computed and (max_map_keys is None or n <= max_map_keys):
        capacity, setting, flexible = max(n, 1), max(n, 1), False
    elif max_map_keys is not None:
        capacity, setting, flexible = max_map_keys, max_map_keys, False
    else:
        capacity, setting, flexible = DEFAULT_MAX_MAP_KEYS, DEFAULT_MAX_MAP_KEYS, True
    return _sizing(use, capacity, setting, flexible)


def _sizing(use: MapUse, capacity: int, setting: int, flexible: bool) -> Sizing:
    place = len(use.consts) <= capacity
    # the kernel searches the index when some kernel access computes its key
    # (constant keys then too, when they are not placed: one key, one record)
    kernel = use.kernel_computed
    direct = len(use.consts) if not place and not kernel else 0
    return Sizing(capacity, index_slots(capacity) if kernel else 0, setting, flexible, place,
                  direct)


def shrink(use: MapUse, sizing: Sizing) -> Sizing | None:
    """A default-sized map at half its capacity (None: it is as small as it goes)."""
    if not sizing.flexible or sizing.capacity <= MIN_DEFAULT_KEYS:
        return None
    half = max(sizing.capacity // 2, MIN_DEFAULT_KEYS)
    return _sizing(use, half, half, True)


@dataclass
class MapLayout:
    """Where a map lives and how its records are laid out."""

    type: MapType
    base: int
    sizing: Sizing = field(default_factory=lambda: Sizing(1, 0, 1))
    #: strings keys of kind ksym/probe stand for (shared by every map of a program)
    names: list[str] = field(default_factory=list)

    @property
    def keyed(self) -> bool:
        return bool(self.type.keys)

    @property
    def capacity(self) -> int:
        return self.sizing.capacity if self.keyed else 1

    @property
    def slots(self) -> int:
        return self.sizing.slots if self.keyed else 0

    @property
    def direct(self) -> int:
        return self.sizing.direct if self.keyed else 0

    @property
    def probes(self) -> int:
        return self.sizing.probes

    @property
    def bits(self) -> int:
        return self.slots.bit_length() - 1

    @property
    def nkeys(self) -> int:
        """Words of a record's key (a comm key takes two)."""
        return key_words(self.type.keys or ())

    @property
    def key0(self) -> int:
        return 0

    @property
    def present(self) -> int:
        return self.nkeys

    @property
    def value0(self) -> int:
        return self.present + 1

    @property
    def stride(self) -> int:
        return self.value0 + self.type.value_words

    @property
    def header(self) -> int:
        return HEADER if self.keyed else 0

    @property
    def used(self) -> int | None:
        """Address of the count of records handed out (None: a map without keys)."""
        return self.base if self.keyed else None

    @property
    def lost(self) -> int | None:
        """Address of the count of updates that found no record."""
        return self.base + WORD if self.keyed else None

    @property
    def index(self) -> int:
        return self.base + WORD * self.header

    @property
    def direct_base(self) -> int:
        return self.index + WORD * self.slots

    @property
    def records(self) -> int:
        return self.direct_base + WORD * self.direct

    @property
    def words(self) -> int:
        return self.header + self.slots + self.direct + self.capacity * self.stride

    @property
    def size(self) -> int:
        return WORD * self.words

    # --- snippet side ------------------------------------------------------------------
    def word(self, record: ast.Node | int, index: int | ast.Node) -> ast.Node:
        """Word ``index`` of record ``record`` (both may be computed): a Var when the
        address is constant, else an Elem of the whole table of records."""
        if isinstance(record, int) and isinstance(index, int):
            return ast.Var(self.records + WORD * (record * self.stride + index))
        at = ast.lift(record * self.stride) + index
        return ast.Elem(self.records, self.capacity * self.stride, at)

    def slot(self, i: ast.Node) -> ast.Node:
        """Index slot ``i`` (computed)."""
        return ast.Elem(self.index, self.slots, i)

    def direct_word(self, n: int) -> ast.Var:
        """The word of constant key number ``n`` (0, or its record + 1)."""
        return ast.Var(self.direct_base + WORD * n)


def key_words(kinds: Sequence[str]) -> int:
    """Words a key of these kinds is held in."""
    return _key_words(tuple(kinds))


@lru_cache(maxsize=4096)
def _key_words(kinds: tuple[str, ...]) -> int:
    # a program has a few key shapes, asked about at every probe's every access
    return sum(width(k) for k in kinds)


def layout_size(mtype: MapType, sizing: Sizing) -> int:
    return MapLayout(mtype, 0, sizing).size


def layout_for(mtype: MapType, alloc: Callable[[int], int], names: list[str],
               sizing: Sizing | None = None) -> MapLayout:
    """Allocate ``mtype``'s block with ``alloc(size) -> address``."""
    sizing = sizing or size_map(MapUse(computed=bool(mtype.keys), kernel_computed=bool(mtype.keys)),
                                None)
    lay = MapLayout(mtype, 0, sizing, names)
    lay.base = alloc(lay.size)
    return lay


# --- hashing ----------------------------------------------------------------------------------
def hash_keys(keys: Sequence[int]) -> int:
    """The 64-bit hash of a key tuple (what :func:`hash_tree` computes in the kernel)."""
    h = SEED
    for k in keys:
        h = ((h ^ (k & MASK)) * MULT) & MASK
        h ^= h >> 29
    return h


def hash_tree(keys: Sequence[ast.Node]) -> ast.Node:
    """:func:`hash_keys` as one expression (each step reads the one before twice:
    for a few keys only)."""
    h: ast.Node = ast.Const(SEED)
    for k in keys:
        h = (h ^ k) * ast.Const(MULT)
        h = h ^ ast.lshr(h, 29)
    return h


def hash_into(keys: Sequence[ast.Node], h: ast.Node) -> list[ast.Node]:
    """:func:`hash_keys` as statements accumulating in ``h`` (a Local): code that
    grows with the keys, not with a power of them."""
    code: list[ast.Node] = [h.assign(ast.Const(SEED))]
    for k in keys:
        code += [h.assign((h ^ k) * ast.Const(MULT)), h.assign(h ^ ast.lshr(h, 29))]
    return code


def start_slot(h: int, layout: MapLayout) -> int:
    return h >> (64 - layout.bits) if layout.bits else 0


def entry(h: int, record: int) -> int:
    """The index entry of a key hashing to ``h`` held in ``record``."""
    return (h & HI) | (record + 1)


# --- before the run: constant keys placed --------------------------------------------------
def place(lay: MapLayout, keys: Iterable[tuple[int, ...]]) -> tuple[dict[tuple[int, ...], int], bytes]:
    """Records for constant ``keys`` (each masked to 64 bits), in order, and the bytes
    of the block's start that hold them (header, index, records: one write).  A key
    whose index window is full gets no record (the snippet searches for it when it
    runs); so does every key once the capacity is reached, and every key of a map
    with direct words (the first update of each claims one)."""
    placed: dict[tuple[int, ...], int] = {}
    index = [0] * lay.slots
    for key in keys:
        if len(placed) >= lay.capacity or lay.direct:
            break
        if lay.slots:
            h = hash_keys(key)
            at = start_slot(h, lay)
            for _ in range(lay.probes):
                if index[at] == 0:
                    index[at] = entry(h, len(placed))
                    break
                at = (at + 1) & (lay.slots - 1)
            else:
                continue
        placed[key] = len(placed)
    words = [len(placed), 0, *index, *([0] * lay.direct)]
    for key in placed:
        rec = [0] * lay.stride
        rec[lay.key0:lay.key0 + len(key)] = key
        words += rec
    return placed, b"".join((w & MASK).to_bytes(WORD, "little") for w in words)


# --- the client's side: a map's records read back ---------------------------------------------
class Table:
    """A map's records as the client sees them: read, written back, merged.

    ``placed`` is the client's index of a map the kernel never searches (key ->
    record); ``direct`` numbers the constant keys that have words of their own;
    other keys are searched through the index in the kernel, as a snippet
    searches it.  The client's claims are plain writes, not atomic with
    the kernel's: they happen in BEGIN and END, when the kernel's probes do not
    run, and in interval actions (where a key added at the moment a probe adds
    one may take the same record)."""

    def __init__(self, layout: MapLayout, read: Callable[[int, int], bytes],
                 write: Callable[[int, bytes], None],
                 placed: dict[tuple[int, ...], int] | None = None,
                 direct: dict[tuple[int, ...], int] | None = None) -> None:
        self.layout = layout
        self._read, self._write = read, write
        self.placed = {} if placed is None else placed
        self.direct = direct or {}

    def _u64s(self, address: int, n: int) -> list[int]:
        raw = self._read(address, WORD * n) if n else b""
        return [int.from_bytes(raw[i:i + WORD], "little") for i in range(0, len(raw), WORD)]

    def _put_u64s(self, address: int, words: Sequence[int]) -> None:
        self._write(address, b"".join((w & MASK).to_bytes(WORD, "little") for w in words))

    def records_used(self) -> int:
        """Records handed out so far (1 for a map without keys)."""
        lay = self.layout
        if lay.used is None:
            return 1
        return min(self._u64s(lay.used, 1)[0], lay.capacity)

    def record_words(self) -> list[int]:
        """The words of every record handed out, in one read."""
        lay = self.layout
        return self._u64s(lay.records, self.records_used() * lay.stride)

    def record(self, words: list[int], record: int) -> list[int]:
        s = self.layout.stride
        return words[record * s:(record + 1) * s]

    def entries(self) -> dict[tuple[int, ...], list[int]]:
        """Key tuple -> value words of every present record, records of one key merged."""
        lay = self.layout
        words = self.record_words()
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(len(words) // lay.stride):
            rec = self.record(words, r)
            if not rec[lay.present]:
                continue
            key = tuple(rec[lay.key0:lay.key0 + lay.nkeys])
            values = rec[lay.value0:]
            out[key] = merge(lay.type.kind, out[key], values) if key in out else values
        return out

    def decoded(self) -> list[tuple[Any, Any]]:
        """Every present entry as (key, value), as the program sees them: a key of one
        part that part, of several a tuple; a value its integer, or what it prints as
        (a string, a name, a tuple).  In the order the records were taken."""
        lay = self.layout
        kind = lay.type.kind or "int"
        out: list[tuple[Any, Any]] = []
        for key, values in self.entries().items():
            parts = decode_key(lay.type.keys or (), key, lay.names)
            value = decode(kind, values, lay.names) if is_decoded(kind) else scalar(kind, values)
            out.append((parts[0] if len(parts) == 1 else TupleValue(parts), value))
        return out

    def lost(self) -> int:
        if self.layout.lost is None:
            return 0
        return self._u64s(self.layout.lost, 1)[0]

    def count_lost(self) -> None:
        """One more update that found no record (the client's own)."""
        if self.layout.lost is not None:
            self._put_u64s(self.layout.lost, [self.lost() + 1])

    def find(self, key: Sequence[int], claim: bool) -> int | None:
        """The record of ``key`` (claimed when ``claim`` and absent), as the kernel's
        code would find it; None when absent (or, claiming, when it gets no record)."""
        lay = self.layout
        if not lay.keyed:
            return 0
        key = tuple(k & MASK for k in key)
        if key in self.direct:
            word = lay.direct_base + WORD * self.direct[key]
            held = self._u64s(word, 1)[0]
            if held or not claim:
                return held - 1 if held else None
            record = self._reserve(key)
            if record is not None:
                self._put_u64s(word, [record + 1])
            return record
        if not lay.slots:
            if key in self.placed or not claim:
                return self.placed.get(key)
            record = self._reserve(key)
            if record is not None:
                self.placed[key] = record
            return record
        h = hash_keys(key)
        at = start_slot(h, lay)
        for _ in range(lay.probes):
            slot = lay.index + WORD * at
            e = self._u64s(slot, 1)[0]
            if e == 0:
                if not claim:
                    return None
                record = self._reserve(key)
                if record is not None:
                    self._put_u64s(slot, [entry(h, record)])
                return record
            if e & HI == h & HI:
                record = (e & LO) - 1
                base = lay.records + WORD * record * lay.stride
                if tuple(self._u64s(base + WORD * lay.key0, lay.nkeys)) == key:
                    return record
            at = (at + 1) & (lay.slots - 1)
        return None

    def _reserve(self, key: tuple[int, ...]) -> int | None:
        """A new record holding ``key`` (None: the map is full)."""
        lay = self.layout
        assert lay.used is not None
        used = self._u64s(lay.used, 1)[0]
        if used >= lay.capacity:
            return None
        self._put_u64s(lay.used, [used + 1])
        self._put_u64s(lay.records + WORD * (used * lay.stride + lay.key0), key)
        return used

    def put(self, record: int, index: int, value: int) -> None:
        address = self.layout.records + WORD * (record * self.layout.stride + index)
        self._put_u64s(address, [value])

    def get(self, record: int, index: int) -> int:
        address = self.layout.records + WORD * (record * self.layout.stride + index)
        return self._u64s(address, 1)[0]

    def clear(self) -> None:
        """Every record no longer present, its values 0.  Keys and the index stay:
        records placed before the run for constant keys (which snippets address
        directly) must stay theirs.  A map without keys that held a value stays
        present, at 0, as bpftrace prints it (``@: 0``)."""
        lay = self.layout
        words = self.record_words()
        first = lay.present + (0 if lay.keyed else 1)
        for r in range(len(words) // lay.stride):
            for i in range(first, lay.stride):
                words[r * lay.stride + i] = 0
        if words:
            self._put_u64s(lay.records, words)

    def delete(self, key: Sequence[int]) -> None:
        """The record(s) of ``key`` no longer present, their values 0 (the keys stay, so
        that searches that go past them still do)."""
        lay = self.layout
        key = tuple(k & MASK for k in key)
        words = self.record_words()
        for r in range(len(words) // lay.stride):
            rec = self.record(words, r)
            if lay.keyed and tuple(rec[lay.key0:lay.key0 + lay.nkeys]) != key:
                continue
            base = lay.records + WORD * (r * lay.stride + lay.present)
            self._put_u64s(base, [0] * (lay.stride - lay.present))


#: value kinds that aggregate (two records of one key merge by adding)
AGGREGATE_KINDS = ("count", "sum", "avg", "hist", "lhist")


def merge(kind: str | None, a: list[int], b: list[int]) -> list[int]:
    """Value words of two records of one key, merged."""
    if kind in ("min", "max"):
        return [max(a[0], b[0])]            # both biased so that the larger wins
    if kind not in AGGREGATE_KINDS:
        return b                            # a value assigned: the later one
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
        n = width(kind)
        if kind.startswith(("kstack:", "ustack:")):
            text = stack_text if kind[0] == "k" else ustack_text
            out.append(text(words[at:at + n], kind.split(":")[2], KEY_INDENT))
        else:
            out.append(decode(kind, words[at:at + n], names))
        at += n
    return out


__all__ = ["DEFAULT_MAX_MAP_KEYS", "HIST_BUCKETS", "MapLayout", "MapType", "MapUse", "Sizing",
           "Table", "WIDTH", "comm_text", "decode", "decode_key", "hash_into", "hash_keys",
           "hash_tree", "is_decoded", "plain", "tuple_items", "tuple_kind", "is_text", "key_words", "layout_for", "place", "scalar",
           "shrink", "size_map", "width"]
