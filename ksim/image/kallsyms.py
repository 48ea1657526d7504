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
import os
import re
from collections.abc import Iterable

from ksim.errors import ImageError, MalformedImage
from ksim.image.elf import load_image
from ksim.image.image import DigestOf, Image, MemoryReader, Prefetcher
from ksim.image.model import Section, Symbol

_LINE = re.compile(r"^([0-9a-fA-F]{1,16})\s+([A-Za-z?])\s+(\S+)(?:\s+\[(\S+)\])?\s*$")
#: kallsyms type letters that mark code (upper case: global; lower case: local)
#: bytes of a kallsyms file read at most (a distribution kernel's /proc/kallsyms with
#: its modules is some 20 MB; /dev/zero was read until a MemoryError)
MAX_KALLSYMS_BYTES = 256 << 20

_TEXT_TYPES = frozenset("TtWw")
_ABS_TYPES = frozenset("Aa")


def parse_kallsyms(text: str, source: str = "<kallsyms>") -> list[tuple[int, str, str, str]]:
    """(address, type letter, name, module) per line; module is "vmlinux" for the kernel."""
    # The kernel's own format (one space, a tab before the module) matched in one
    # pass over the whole text; anything else goes line by line.
    found = _STRICT.findall(text)
    if found and len(found) == text.count("\n") + (not text.endswith("\n")):
        entries = [(int(a, 16), t, n, m or "vmlinux") for a, t, n, m in found]
    else:
        entries = _parse_lines(text, source)
    if not entries:
        raise MalformedImage(f"{source}: no symbols")
    if all(addr == 0 for addr, *_ in entries):
        raise MalformedImage(f"{source}: every address is zero (kallsyms read without privilege?)")
    return entries


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
) -> Image:
    """An Image from a kallsyms-format file, with code from ``image_path`` or ``reader``
    (``identity``: what names the running kernel the reader reads; see Image; ``arch``:
    the ``ksim.arch`` name of its code; ``prefetch`` and ``digests``: the reader's, see
    Image)."""
    source = str(symbols_path)
    try:
        with open(symbols_path, "rb") as f:
            raw = f.read(MAX_KALLSYMS_BYTES + 1)
        if len(raw) > MAX_KALLSYMS_BYTES:
            raise MalformedImage(f"{source}: longer than {MAX_KALLSYMS_BYTES:,} bytes: no "
                                 "kallsyms list is")
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ImageError(f"cannot read symbol file {source!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise MalformedImage(f"{source}: not text ({exc})") from exc
    entries = parse_kallsyms(text, source)
    build_id = None
    if image_path is not None:
        base = load_image(image_path)
        sections, build_id = base.sections, base.build_id
    else:
        sections = _synthetic_text(entries)
    symbols = list(_with_sizes(entries, sections))
    return Image(
        str(image_path if image_path is not None else symbols_path),
        arch,
        "vmlinux",
        sections,
        symbols,
        bindings={name: "global" if t.isupper() else "local" for _a, t, name, _m in entries},
        reader=reader,
        build_id=build_id,
        identity=identity,
        prefetch=prefetch,
        digests=digests,
    )


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


def _synthetic_text(entries: list[tuple[int, str, str, str]]) -> tuple[Section, ...]:
    """Without an ELF: one executable region per module, from its first text symbol
    to the first non-text, non-absolute symbol after its last one (``_etext`` in a
    real kallsyms).  The region's data stays empty; bytes come from the reader.
    """
    text: dict[str, list[int]] = {}
    other: dict[str, list[int]] = {}
    for addr, letter, _name, module in entries:
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


def _with_sizes(
    entries: list[tuple[int, str, str, str]], sections: Iterable[Section]
) -> Iterable[Symbol]:
    exec_sections = sorted((s.address, s.end) for s in sections if s.executable)
    exec_starts = [start for start, _end in exec_sections]
    disjoint = all(a[1] <= b[0] for a, b in zip(exec_sections, exec_sections[1:], strict=False))
    by_module: dict[str, list[tuple[int, str, str]]] = {}
    for addr, letter, name, module in entries:
        by_module.setdefault(module, []).append((addr, letter, name))
    out: list[Symbol] = []
    append = out.append
    bisect_right = bisect.bisect_right
    for module, items in by_module.items():
        items.sort()
        starts = sorted({addr for addr, letter, _n in items if letter not in _ABS_TYPES})
        for addr, letter, name in items:
            if letter in _TEXT_TYPES:
                if disjoint:
                    k = bisect_right(exec_starts, addr) - 1
                    section_end = exec_sections[k][1] if k >= 0 and addr < exec_sections[k][1] else None
                else:
                    section_end = _section_end(exec_sections, addr)
                if section_end is None:
                    append(Symbol(name, addr, 0, "other", module))  # a text label outside text
                    continue
                i = bisect_right(starts, addr)
                end = starts[i] if i < len(starts) else section_end
                append(Symbol(name, addr, min(end, section_end) - addr, "func", module))
            elif letter in _ABS_TYPES:
                append(Symbol(name, addr, 0, "other", module))
            else:
                append(Symbol(name, addr, 0, "object", module))
    return out


def _section_end(exec_sections: list[tuple[int, int]], addr: int) -> int | None:
    for start, end in exec_sections:
        if start <= addr < end:
            return end
    return None
