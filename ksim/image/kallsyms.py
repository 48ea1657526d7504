"""Images from a symbol list in /proc/kallsyms format plus code from elsewhere.

A line is ``ffffffff81000000 T _stext`` with an optional ``\\t[module]``.  The code
bytes come from a stripped ELF image (section headers kept, symbols gone) or from
a ``reader(addr, size)`` callback (a running kernel, through the live target).

kallsyms has no sizes: a text symbol's function runs up to the next symbol of the
same module (any type, since data placed inside text ends code too), bounded by the
end of its executable section when the sections are known.  Sizes inferred this way
include the padding that follows a function.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import string
import struct
from array import array
from collections.abc import Iterable, Sequence
from itertools import repeat
from pathlib import Path

import xxhash

from ksim.errors import ImageError, MalformedImage
from ksim.image.elf import load_image
from ksim.image.image import DigestOf, Image, MemoryReader, Prefetcher
from ksim.image.model import Section, SymbolTable

_LINE = re.compile(r"^([0-9a-fA-F]{1,16})\s+([A-Za-z?])\s+(\S+)(?:\s+\[(\S+)\])?\s*$")
#: kallsyms type letters that mark code (upper case: global; lower case: local)
#: bytes of a kallsyms file read at most (a distribution kernel's /proc/kallsyms with
#: its modules is some 20 MB; /dev/zero was read until a MemoryError)
MAX_KALLSYMS_BYTES = 256 << 20

_TEXT_TYPES = frozenset("TtWw")
_ABS_TYPES = frozenset("Aa")


def parse_kallsyms(text: str, source: str = "<kallsyms>") -> list[tuple[int, str, str, str]]:
    """(address, type letter, name, module) per line; module is "vmlinux" for the kernel."""
    return list(zip(*kallsyms_columns(text, source), strict=True))


def kallsyms_columns(text: str, source: str = "<kallsyms>"
                     ) -> tuple[list[int], list[str], list[str], list[str]]:
    """The addresses, type letters, names and modules ("vmlinux" for the kernel) of the
    lines of ``text``, as four lists."""
    # The kernel's own format (one space, a tab before the module) matched in one
    # pass over the whole text; anything else goes line by line.
    found = _STRICT.findall(text)
    if found and len(found) == text.count("\n") + (not text.endswith("\n")):
        hexes, letters, names, modules = (list(column) for column in zip(*found, strict=True))
        addresses = list(map(int, hexes, repeat(16)))
        modules = [m or "vmlinux" for m in modules]
    else:
        rows = _parse_lines(text, source)
        if not rows:
            raise MalformedImage(f"{source}: no symbols")
        addresses, letters, names, modules = (list(column) for column in zip(*rows, strict=True))
    if not any(addresses):
        raise MalformedImage(f"{source}: every address is zero (kallsyms read without privilege?)")
    return addresses, letters, names, modules


_STRICT = re.compile(r"^([0-9a-fA-F]{1,16}) ([A-Za-z?]) (\S+)(?:\t\[(\S+)\])?$", re.M)


def _parse_lines(text: str, source: str) -> list[tuple[int, str, str, str]]:
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise MalformedImage(f"{source}:{lineno}: not a kallsyms line: {line[:80]!r}")
        entries.append((int(m.group(1), 16), m.group(2), m.group(3), m.group(4) or "vmlinux"))
    return entries


def load_kallsyms(
    symbols_path: str | os.PathLike[str],
    image_path: str | os.PathLike[str] | None = None,
    reader: MemoryReader | None = None,
    identity: bytes | None = None,
    arch: str = "x86_64",
    prefetch: Prefetcher | None = None,
    digests: tuple[Prefetcher, DigestOf] | None = None,
    *,
    keep_parsed: bool = False,
) -> Image:
    """An Image from a kallsyms-format file, with code from ``image_path`` or ``reader``
    (``identity``: what names the running kernel the reader reads; see Image; ``arch``:
    the ``ksim.arch`` name of its code; ``prefetch`` and ``digests``: the reader's, see
    Image).

    ``keep_parsed`` (without ``image_path``): the symbols as parsed and sized are kept
    beside the file (``FILE.columns``, see :func:`_save_parsed`) and taken from there
    while the file's bytes are those they were made from: a running kernel's 96,732
    symbols in some 25 ms, not 150."""
    source = str(symbols_path)
    try:
        with open(symbols_path, "rb") as f:
            raw = f.read(MAX_KALLSYMS_BYTES + 1)
        if len(raw) > MAX_KALLSYMS_BYTES:
            raise MalformedImage(f"{source}: longer than {MAX_KALLSYMS_BYTES:,} bytes: no "
                                 "kallsyms list is")
    except OSError as exc:
        raise ImageError(f"cannot read symbol file {source!r}: {exc.strerror or exc}") from exc
    kept = kept_path(symbols_path) if keep_parsed and image_path is None else None
    digest = xxhash.xxh3_64_intdigest(raw)
    parsed = _load_parsed(kept, digest) if kept is not None else None
    build_id = None
    if parsed is not None:
        table, sections, binds = parsed
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedImage(f"{source}: not text ({exc})") from exc
        addresses, letters, names, modules = kallsyms_columns(text, source)
        if image_path is not None:
            base = load_image(image_path)
            sections, build_id = base.sections, base.build_id
        else:
            sections = _synthetic_text(addresses, letters, modules)
        table = symbol_table(addresses, letters, names, modules, sections)
        binds = bindings(letters, names)
    image = Image(
        str(image_path if image_path is not None else symbols_path),
        arch,
        "vmlinux",
        sections,
        table,
        bindings=binds,
        reader=reader,
        build_id=build_id,
        identity=identity,
        prefetch=prefetch,
        digests=digests,
    )
    if kept is not None and parsed is None:
        _save_parsed(kept, digest, table, sections, image.bindings)
    return image


# --- the parsed symbols kept beside a kallsyms file -----------------------------------
def kept_path(symbols_path: str | os.PathLike[str]) -> Path:
    """Where ``load_kallsyms(symbols_path, keep_parsed=True)`` keeps the parsed symbols."""
    return Path(f"{os.fspath(symbols_path)}.columns")


_PARSED_MAGIC = b"ksim-kallsyms-columns\0"
#: the layout below; a file of another version is parsed again (and replaced)
_PARSED_VERSION = 1
#: magic, version, the kallsyms file's XXH3-64, the rest's XXH3-64, symbols, then the
#: lengths of the JSON part and of the names
_PARSED_HEAD = struct.Struct(f"<{len(_PARSED_MAGIC)}sIQQQQQ")
_KINDS = ("func", "object", "other")


def _save_parsed(path: Path, digest: int, table: SymbolTable, sections: Sequence[Section],
                 binds: dict[str, str]) -> None:
    """Keep ``table`` (and the sections and bindings it was loaded with: an Image's, those
    of the names that share an address with another function) at ``path``, for a
    kallsyms file of XXH3-64 ``digest``: a header (with the XXH3-64 of the rest), a
    JSON part (the modules, the sections, the bindings), the names joined by newlines
    (no name holds one), then each symbol's address and size (u64), kind (u8) and
    module (u32).  Written to a new file renamed over the old; a cache that cannot be
    written is left as it is."""
    modules = sorted(set(table.modules))
    module_index = {m: i for i, m in enumerate(modules)}
    meta = json.dumps({
        "modules": modules,
        "sections": [[s.name, s.address, s.size] for s in sections],
        "bindings": binds,
    }).encode()
    names = "\n".join(table.names).encode()
    body = b"".join([
        meta, names,
        array("Q", table.addresses).tobytes(), array("Q", table.sizes).tobytes(),
        bytes(map(_KINDS.index, table.kinds)),
        array("I", map(module_index.__getitem__, table.modules)).tobytes(),
    ])
    head = _PARSED_HEAD.pack(_PARSED_MAGIC, _PARSED_VERSION, digest, xxhash.xxh3_64_intdigest(body),
                             len(table), len(meta), len(names))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(head + body)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _load_parsed(path: Path, digest: int
                 ) -> tuple[SymbolTable, tuple[Section, ...], dict[str, str]] | None:
    """What :func:`_save_parsed` kept at ``path`` for a kallsyms file of XXH3-64
    ``digest``; None when there is nothing, or it is for other bytes, of another
    version, or damaged (its own XXH3-64 differs, or its parts do not add up): the
    file is then parsed again."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        magic, version, kept_digest, body_digest, n, meta_len, names_len = \
            _PARSED_HEAD.unpack_from(data)
        if magic != _PARSED_MAGIC or version != _PARSED_VERSION or kept_digest != digest:
            return None
        at = _PARSED_HEAD.size
        if xxhash.xxh3_64_intdigest(memoryview(data)[at:]) != body_digest:
            return None
        meta = json.loads(data[at:at + meta_len])
        at += meta_len
        names = data[at:at + names_len].decode().split("\n") if n else []
        at += names_len
        columns = []
        for code, width in (("Q", 8), ("Q", 8)):
            column = array(code)
            column.frombytes(data[at:at + n * width])
            columns.append(column.tolist())
            at += n * width
        kinds = list(map(_KINDS.__getitem__, data[at:at + n]))
        at += n
        index = array("I")
        index.frombytes(data[at:at + 4 * n])
        modules = list(map(list(meta["modules"]).__getitem__, index))
        at += 4 * n
        sections = tuple(Section(str(name), int(address), int(size), True, False)
                         for name, address, size in meta["sections"])
        binds = {str(k): str(v) for k, v in dict(meta["bindings"]).items()}
        if at != len(data) or not len(names) == len(kinds) == len(modules) == n:
            return None
        return SymbolTable(names, columns[0], columns[1], kinds, modules), sections, binds
    except (ValueError, TypeError, KeyError, IndexError, struct.error, UnicodeDecodeError):
        return None


def to_kallsyms(image: Image) -> str:
    """The image's symbols in kallsyms format (the inverse of :func:`load_kallsyms`)."""
    lines = []
    for sym in image.symbols:
        sec = image.section_at(sym.address)
        if sym.kind == "func" or (sec is not None and sec.executable):
            letter = "T"
        elif sec is None:
            letter = "A"
        elif not sec.data:
            letter = "B"
        else:
            letter = "D" if sec.writable else "R"
        suffix = f"\t[{sym.module}]" if sym.module != "vmlinux" else ""
        lines.append(f"{sym.address:016x} {letter} {sym.name}{suffix}")
    return "\n".join(lines) + "\n"


def _synthetic_text(addresses: Sequence[int], letters: Sequence[str],
                    modules: Sequence[str]) -> tuple[Section, ...]:
    """Without an ELF: one executable region per module, from its first text symbol
    to the first non-text, non-absolute symbol after its last one (``_etext`` in a
    real kallsyms).  The region's data stays empty; bytes come from the reader.
    """
    text: dict[str, list[int]] = {}
    other: dict[str, list[int]] = {}
    for addr, letter, module in zip(addresses, letters, modules, strict=True):
        if letter in _TEXT_TYPES:
            text.setdefault(module, []).append(addr)
        elif letter not in _ABS_TYPES:
            other.setdefault(module, []).append(addr)
    out = []
    for module, addrs in text.items():
        start, last = min(addrs), max(addrs)
        after = [a for a in other.get(module, ()) if a > last]
        end = min(after) if after else last
        if end > start:
            out.append(Section(f".text[{module}]", start, end - start, True, False))
    return tuple(out)


def bindings(letters: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """Each name's binding, as an Image takes them: "global" for an upper-case type
    letter, else "local" (the last line of a name decides)."""
    return dict(zip(names, map(_BINDING_OF.__getitem__, letters), strict=True))


_BINDING_OF = {**{c: "global" for c in string.ascii_uppercase},
               **{c: "local" for c in string.ascii_lowercase + "?"}}


def symbol_table(addresses: Sequence[int], letters: Sequence[str], names: Sequence[str],
                 modules: Sequence[str], sections: Iterable[Section]) -> SymbolTable:
    """The symbols of kallsyms lines (as :func:`kallsyms_columns` gives them), sized.

    A text symbol (T, t, W, w) is a function that runs up to the next symbol of its
    module that is not absolute, or to the end of its executable section; one
    outside every executable section is a label ("other", size 0).  An absolute
    symbol is "other", anything else an "object", both of size 0."""
    exec_sections = sorted((s.address, s.end) for s in sections if s.executable)
    exec_starts = [start for start, _end in exec_sections]
    disjoint = all(a[1] <= b[0] for a, b in zip(exec_sections, exec_sections[1:], strict=False))
    kinds = [_KIND_OF.get(letter, "object") for letter in letters]
    sizes = [0] * len(addresses)
    by_module: dict[str, list[int]] = {}
    for i, module in enumerate(modules):
        by_module.setdefault(module, []).append(i)
    bisect_right = bisect.bisect_right
    for rows in by_module.values():
        starts = sorted({addresses[i] for i in rows if letters[i] not in _ABS_TYPES})
        for i in rows:
            if kinds[i] != "func":
                continue
            addr = addresses[i]
            if disjoint:
                k = bisect_right(exec_starts, addr) - 1
                section_end = exec_sections[k][1] if k >= 0 and addr < exec_sections[k][1] else None
            else:
                section_end = _section_end(exec_sections, addr)
            if section_end is None:
                kinds[i] = "other"      # a text label outside text
                continue
            j = bisect_right(starts, addr)
            end = starts[j] if j < len(starts) else section_end
            sizes[i] = min(end, section_end) - addr
    return SymbolTable.ordered(names, addresses, sizes, kinds, modules)


_KIND_OF = {**{c: "func" for c in _TEXT_TYPES}, **{c: "other" for c in _ABS_TYPES}}


def _section_end(exec_sections: list[tuple[int, int]], addr: int) -> int | None:
    for start, end in exec_sections:
        if start <= addr < end:
            return end
    return None
