"""The points a ``ksim trace`` program splices, for ``ksim verify --program``.

The program is parsed by ksim trace's own parser; its probes' attach points are
resolved as ``ksim trace`` resolves them: ``kprobe:FUNC`` (a name or a wildcard)
at each function's entry, ``kprobe:FUNC+OFFSET`` at that instruction,
``kretprobe:FUNC`` at every return of the function.  BEGIN, END and interval
probes splice nothing.  Other providers (kfunc, tracepoint, profile, ...) need a
running kernel's BTF, tracepoints or timers to resolve, and are refused.

The snippet checked at those points is the campaign's (the entry counter by
default), not the program's compiled code: the harness tells a snippet's own
writes apart from the function's by the counter's address, and a program's maps
live elsewhere.
"""

from __future__ import annotations

import fnmatch
import os

from ksim.analysis.points import PointKind
from ksim.campaign.cases import Target, point_name
from ksim.campaign.errors import BadCase
from ksim.errors import KsimError, UnknownSymbol
from ksim.image.image import Image
from ksim.image.model import Function
from ksim.splice.sites import SiteFacts

#: providers whose probes splice nothing
NO_SPLICE = ("BEGIN", "END", "interval")
SUPPORTED = ("kprobe", "kretprobe")


def program_targets(path: str, facts: SiteFacts) -> list[Target]:
    """The points the program at ``path`` splices (see the module doc)."""
    from ksim.commands.trace import MAX_PROGRAM_BYTES
    from ksim.trace.parser import parse

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO opens at once, writer or not
        os.set_blocking(fd, True)       # and reads as empty without one (its end)
        with open(fd, "rb") as stream:
            raw = stream.read(MAX_PROGRAM_BYTES + 1)     # /dev/zero was read until a MemoryError
    except OSError as exc:
        raise BadCase(f"--program {path!r}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PROGRAM_BYTES:
        raise BadCase(f"--program {path!r}: longer than {MAX_PROGRAM_BYTES:,} bytes (ksim trace "
                      "reads no longer program)")
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadCase(f"--program {path!r}: not UTF-8 text") from None
    program = parse(source, path)
    image = facts.image
    chosen: dict[tuple[int, int | None], Target] = {}

    def add(func: Function, offset: int | None) -> None:
        chosen.setdefault((func.address, offset),
                          Target(point_name(image, func, offset), func, offset))

    for probe in program.probes:
        for ap in probe.points:
            if ap.provider in NO_SPLICE:
                continue
            if ap.provider not in SUPPORTED:
                raise BadCase(f"--program {path}: {ap.text or ap.provider} -- ksim verify takes "
                              f"the splices of {' and '.join(SUPPORTED)} probes only ({ap.provider} "
                              "probes are resolved against a running kernel)")
            funcs = _functions(image, ap.func)
            if ap.provider == "kprobe":
                for f in funcs:
                    if ap.offset and f.size and ap.offset >= f.size:
                        raise BadCase(f"--program {path}: {ap.text}: the offset {ap.offset:#x} "
                                      f"is past the end of {f.name}")
                    add(f, ap.offset or None)
                continue
            for f in funcs:
                try:
                    exits = facts.points(f, PointKind.EXIT)
                except KsimError:
                    add(f, None)  # its cases say why the function cannot be spliced
                    continue
                for p in exits:
                    add(f, p.address - f.address)
    if not chosen:
        raise BadCase(f"--program {path}: no kprobe or kretprobe probe: nothing is spliced")
    return sorted(chosen.values(), key=lambda t: (t.func.address, t.offset or 0))


def _functions(image: Image, pattern: str) -> list[Function]:
    if set("*?[") & set(pattern):
        found = {f.address: f for f in image.functions if fnmatch.fnmatchcase(f.name, pattern)}
        if not found:
            raise UnknownSymbol(pattern, [])
        return [found[a] for a in sorted(found)]
    return [image.function(pattern)]
