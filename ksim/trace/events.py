"""printf(): an event ring in the kernel's data heap, drained by the client while
the kernel runs.

Layout (8-byte words)::

    header   [head, tail, lost]
    ring     records of [seq, format, arg_0 .. arg_n] (n: the widest format's words)

A snippet reserves record ``h = head`` by a compare-and-swap of ``head`` from ``h``
to ``h + 1`` (CompareExchange), only while ``h - tail < records`` (the ring is not
full); it writes the format's number and the arguments, then ``seq = h + 1`` last,
which publishes the record (x86-64 keeps stores in order, SDM Vol. 3A 9.2.2).  An
event that finds the ring full, or loses the race for ``head``, is counted in
``lost``.  The client reads records from ``tail`` while their ``seq`` says they are
published, formats them, and stores the new ``tail`` for the producers to see.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ksim.snippets import ast

from .maps import MASK, TUPLE, WORD, decode, key_words, plain, signed, width

#: a format standing for time(FORMAT) (as ksim.trace.compiler writes it)
TIME_FORMAT = "\0time\0"
#: one standing for join(ARRAY, DELIMITER)
JOIN_FORMAT = "\0join\0"
#: print(@m)/clear(@m)/zero(@m), print(value), cat(FILE) in a kernel probe's action
#: (as ksim.trace.compiler writes them): done by the client as it drains them
MAP_FORMAT, VALUE_FORMAT, CAT_FORMAT = "\0map\0", "\0value\0", "\0cat\0"


class Action(NamedTuple):
    """An event the client acts on rather than prints as it is: ``kind`` "print" or
    "clear" (``args`` the map's name, top, div), "value" (the text and the value),
    "cat" (the file's name)."""

    kind: str
    args: tuple[Any, ...]
RECORDS = 8192
#: argument words of a record when the program's formats need no more
MIN_ARGS = 7
#: the most argument words one printf may have (strings take a word per 8 bytes)
MAX_ARGS = 64
#: the most bytes the ring takes
RING_BYTES = 768 * 1024
#: the widest field (width or precision) a printf conversion may ask for
#: (bpftrace has no bound of its own: its %999999999d grew the output to gigabytes)
MAX_FIELD = 1024
#: one conversion of a printf format: flags, width, precision, length, conversion
SPEC = re.compile(r"%(?P<flags>[-+ 0#]*)(?P<width>\d*)(?:\.(?P<prec>\d+))?"
                  r"(?P<length>hh|h|ll|l|z|j|t)?(?P<conv>[diuxXocsr%])")


def conversions(fmt: str) -> list[str]:
    """The conversion letter of each argument ``fmt`` takes ("%%" takes none)."""
    return [m.group("conv") for m in SPEC.finditer(fmt) if m.group("conv") != "%"]


def too_wide(fmt: str) -> str | None:
    """The first conversion of ``fmt`` whose width or precision is over MAX_FIELD."""
    for m in SPEC.finditer(fmt):
        for n in (m.group("width"), m.group("prec")):
            # compared as text first: a 5,000-digit width is not converted
            if n and (len(n.lstrip("0")) > len(str(MAX_FIELD)) or int(n) > MAX_FIELD):
                return m.group(0)
    return None


def unknown_conversion(fmt: str) -> str | None:
    """The first '%...' of ``fmt`` that is not a conversion this printf knows."""
    rest = SPEC.sub("", fmt)
    at = rest.find("%")
    return None if at < 0 else rest[at:at + 3]


def render(fmt: str, args: Sequence[int], names: Sequence[str],
           kinds: Sequence[str] | None = None) -> str:
    """``fmt`` with its conversions filled as C's printf would (64-bit integers;
    ``%s`` takes a name's index, or a comm's words when its kind says "comm").  A
    field wider than MAX_FIELD (which the compiler refuses) is a TraceLimit."""
    wide = too_wide(fmt)
    if wide is not None:
        from .parser import TraceLimit

        raise TraceLimit(f"printf: {wide!r} asks for a field wider than {MAX_FIELD} characters")
    words = list(args)
    values: list[Any] = []
    for kind in kinds if kinds is not None else ["int"] * len(words):
        n = width(kind)
        part, words = words[:n], words[n:]
        values.append(part[0] if kind in ("int", "name") and part else
                      decode(kind, part or [0] * n, names))
    it = iter(values)

    def one(m: re.Match[str]) -> str:
        conv = m.group("conv")
        if conv == "%":
            return "%"
        v = next(it, 0)
        if isinstance(v, str):     # a string, or a buffer's text (%r)
            spec = f"%{m.group('flags')}{m.group('width')}"
            if m.group("prec") is not None:
                spec += f".{m.group('prec')}"
            return (spec + "s") % v
        spec = f"%{m.group('flags')}{m.group('width')}"
        if m.group("prec") is not None:
            spec += f".{m.group('prec')}"
        if conv == "s":
            return (spec + "s") % (names[v] if 0 <= v < len(names) else "")
        if conv == "c":
            return (spec + "c") % chr(v & 0xFF)
        if conv in "di":
            return (spec + "d") % signed(v)
        return (spec + ("d" if conv == "u" else conv)) % (v & MASK)

    return SPEC.sub(one, fmt)


@dataclass
class Ring:
    header: int
    base: int
    #: (format, kind of each argument), as compiler.Analysis.formats
    formats: list[tuple[str, tuple[str, ...]]]
    #: records, a power of two; words per record
    records: int = RECORDS
    stride: int = 2 + MIN_ARGS

    @property
    def head(self) -> ast.Var:
        return ast.Var(self.header)

    @property
    def tail(self) -> ast.Var:
        return ast.Var(self.header + WORD)

    @property
    def lost(self) -> ast.Var:
        return ast.Var(self.header + 2 * WORD)

    def word(self, h: ast.Node, index: int) -> ast.Elem:
        return ast.Elem(self.base, self.records * self.stride,
                        (h & ast.Const(self.records - 1)) * self.stride + index)

    def emit(self, h: ast.Local, fmt: int, args: Sequence[ast.Node]) -> ast.Node:
        """Reserve a record (``h`` a free Local), fill it, publish it; or count it lost."""
        lost = self.lost.atomic_assign(self.lost + 1)
        fill = ast.seq(self.word(h, 1).assign(fmt),
                       *(self.word(h, 2 + i).assign(a) for i, a in enumerate(args)),
                       self.word(h, 0).assign(h + 1))
        reserve = ast.CompareExchange(self.head, h, h + 1) == h
        return ast.seq(h.assign(self.head),
                       ast.If(ast.ult(h - self.tail, ast.Const(self.records)),
                              ast.If(reserve, fill, lost), lost))


def allocate_ring(alloc: Callable[[int], int],
                  formats: list[tuple[str, tuple[str, ...]]], limit: int = RING_BYTES) -> Ring:
    """The ring for ``formats``: as many argument words per record as the widest
    format needs, and as many records (a power of two, at most RECORDS) as fit
    RING_BYTES."""
    stride = 2 + max([MIN_ARGS, *(key_words(kinds) for _, kinds in formats)])
    records = RECORDS
    while records > 64 and records * stride * WORD > limit:
        records //= 2
    base = alloc(records * stride * WORD)       # the large block first: if it does not
    return Ring(alloc(3 * WORD), base, formats, records, stride)   # fit, nothing is taken


class Drain:
    """The client's side: published records, in order, formatted."""

    def __init__(self, ring: Ring, read: Callable[[int, int], bytes],
                 write: Callable[[int, bytes], None], names: Sequence[str]) -> None:
        self.ring, self._read, self._write, self.names = ring, read, write, names
        self.tail = 0

    def _word(self, address: int) -> int:
        return int.from_bytes(self._read(address, WORD), "little")

    def _records(self, head: int) -> list[list[int]]:
        """Records ``tail`` .. ``head - 1`` (at most the ring's), read in one request,
        or two where they wrap around the ring's end."""
        ring = self.ring
        size = WORD * ring.stride
        first, n = self.tail % ring.records, min(head - self.tail, ring.records)
        runs = [(first, min(n, ring.records - first))]
        if runs[0][1] < n:
            runs.append((0, n - runs[0][1]))
        out: list[list[int]] = []
        for start, count in runs:
            raw = self._read(ring.base + size * start, size * count)
            words = [int.from_bytes(raw[i:i + WORD], "little") for i in range(0, len(raw), WORD)]
            out += [words[j * ring.stride:(j + 1) * ring.stride] for j in range(count)]
        return out

    def __call__(self) -> list[str | Action]:
        ring = self.ring
        head = self._word(ring.header)
        out: list[str | Action] = []
        for rec in self._records(head) if self.tail < head else []:
            if rec[0] != self.tail + 1:
                break                       # reserved, not yet published
            fmt, kinds = ring.formats[rec[1]]
            if fmt.startswith(MAP_FORMAT):
                op, name, top, div = fmt[len(MAP_FORMAT):].split("\0")
                out.append(Action(op, (name, int(top), int(div))))
            elif fmt == VALUE_FORMAT and kinds[0].startswith(TUPLE):
                value = decode(kinds[0], rec[2:2 + key_words(kinds)], self.names)
                out.append(Action("value", (f"{value}\n", plain(value))))
            elif fmt == VALUE_FORMAT:
                kind = kinds[0]
                words = rec[2:2 + key_words(kinds)]
                text = render("%d" if kind == "int" else "%s", words, self.names, kinds)
                out.append(Action("value", (text + "\n", signed(words[0]) if kind == "int"
                                            else text)))
            elif fmt.startswith(CAT_FORMAT):
                out.append(Action("cat", (fmt[len(CAT_FORMAT):],)))
            elif fmt.startswith(TIME_FORMAT):      # time(): when the client sees it
                out.append(time.strftime(fmt[len(TIME_FORMAT):]))
            elif fmt.startswith(JOIN_FORMAT):    # join(): the strings up to the first empty
                parts = render("%s\0" * len(kinds), rec[2:2 + key_words(kinds)], self.names,
                               kinds).split("\0")
                shown = parts[:parts.index("")] if "" in parts else parts
                out.append(fmt[len(JOIN_FORMAT):].join(shown) + "\n")
            else:
                out.append(render(fmt, rec[2:2 + key_words(kinds)], self.names, kinds))
            self.tail += 1
        self._write(ring.header + WORD, self.tail.to_bytes(WORD, "little"))
        return out

    def lost(self) -> int:
        return self._word(self.ring.header + 2 * WORD)


__all__ = ["Action", "Drain", "MAX_ARGS", "MAX_FIELD", "too_wide", "RECORDS", "Ring", "allocate_ring", "conversions", "render"]
