"""Maps printed the way bpftrace's language prints them, and as JSON.

Text (at exit, and for ``print(@m)``): one ``@name[key]: value`` line per key,
sorted by value (ascending, as bpftrace's language sorts count, sum, int, min and
max maps; averages by average; histograms by their total count), then a blank
line.  A histogram prints its non-empty range of buckets::

    @:
    [4, 8)                 3 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|
    [8, 16)                1 |@@@@@@@@@@@@@@@@@                                   |

(a 16-wide left-aligned label, an 8-wide count, a bar of up to 52 '@').
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .maps import (
    ERRNO,
    HIST_BUCKETS,
    SYSCALL,
    TUPLE,
    UNKNOWN_SYSCALL,
    MapLayout,
    decode,
    decode_key,
    is_decoded,
    merge,
    plain,
    scalar,
    signed,
)

BAR = 52


def hist_label(power: int) -> str:
    """``2**power`` with a K/M/G/T suffix for every ten powers."""
    for suffix, at in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if power >= at:
            return f"{1 << (power - at)}{suffix}"
    return str(1 << power)


def lhist_label(n: int) -> str:
    if n == 0:
        return "0"
    if n % (1 << 20) == 0:
        return f"{n // (1 << 20)}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def hist_rows(values: list[int]) -> list[tuple[str, dict[str, int], int]]:
    """(label, JSON bounds, count) of each bucket from the first to the last non-empty."""
    used = [i for i, v in enumerate(values) if v]
    if not used:
        return []
    rows = []
    for i in range(used[0], used[-1] + 1):
        if i == 0:
            label, bounds = "(..., 0)", {"max": -1}
        elif i == 1:
            label, bounds = "[0]", {"min": 0, "max": 0}
        elif i == 2:
            label, bounds = "[1]", {"min": 1, "max": 1}
        else:
            label = f"[{hist_label(i - 2)}, {hist_label(i - 1)})"
            bounds = {"min": 1 << (i - 2), "max": (1 << (i - 1)) - 1}
        rows.append((label, bounds, values[i]))
    return rows


def lhist_rows(values: list[int], lo: int, hi: int, step: int) -> list[tuple[str, dict[str, int], int]]:
    used = [i for i, v in enumerate(values) if v]
    if not used:
        return []
    buckets = (hi - lo) // step
    rows = []
    for i in range(used[0], used[-1] + 1):
        if i == 0:
            label, bounds = f"(..., {lhist_label(lo)})", {"max": lo - 1}
        elif i == buckets + 1:
            label, bounds = f"[{lhist_label(hi)}, ...)", {"min": hi}
        else:
            a, b = (i - 1) * step + lo, i * step + lo
            label, bounds = f"[{lhist_label(a)}, {lhist_label(b)})", {"min": a, "max": b - 1}
        rows.append((label, bounds, values[i]))
    return rows


def _rows(lay: MapLayout, values: list[int]) -> list[tuple[str, dict[str, int], int]]:
    if lay.type.kind == "lhist":
        assert lay.type.lhist is not None
        return lhist_rows(values, *lay.type.lhist)
    return hist_rows(values[:HIST_BUCKETS])


def hist_text(rows: list[tuple[str, dict[str, int], int]]) -> str:
    top = max((c for _, _, c in rows), default=0)
    out = []
    for label, _, count in rows:
        bar = "@" * int(count / top * BAR) if top else ""
        out.append(f"{label:<16}{count:>8} |{bar:<{BAR}}|\n")
    return "".join(out)


class MapPrinter:
    """Formats one map's entries (``Table.entries()``), keys by the program's names."""

    def __init__(self, lay: MapLayout) -> None:
        self.lay = lay

    @property
    def hist(self) -> bool:
        return self.lay.type.kind in ("hist", "lhist")

    def key_parts(self, key: tuple[int, ...]) -> list[str]:
        return [str(p) for p in decode_key(self.lay.type.keys or (), key, self.lay.names)]

    def merged(self, entries: dict[tuple[int, ...], list[int]]) -> dict[tuple[int, ...], list[int]]:
        """Entries whose keys print the same merged: keys holding numbers the client
        names (strerror's, syscall_name's) are strings to bpftrace, so two numbers of
        one name ("Unknown syscall") are one key."""
        if not any(k in (ERRNO, SYSCALL) for k in self.lay.type.keys or ()):
            return entries
        out: dict[tuple[int, ...], list[int]] = {}
        first: dict[tuple[str, ...], tuple[int, ...]] = {}
        for key, values in entries.items():
            at = first.setdefault(tuple(self.key_parts(key)), key)
            out[at] = merge(self.lay.type.kind, out[at], values) if at in out else values
        return out

    def sorted(self, entries: dict[tuple[int, ...], list[int]]) -> list[tuple[tuple[int, ...], list[int]]]:
        entries = self.merged(entries)
        def order(item: tuple[tuple[int, ...], list[int]]) -> tuple[int, tuple[int, ...]]:
            key, values = item
            if self.hist:
                return (sum(values), key)
            kind = self.lay.type.kind
            if is_decoded(kind):
                return (0, key)
            return (scalar(kind, values), key)
        return sorted(entries.items(), key=order)

    def value_text(self, values: list[int]) -> str:
        kind = self.lay.type.kind or "int"
        if self.lay.type.stats:
            count, total = values[1], signed(values[0])
            avg = (abs(total) // count) * (1 if total >= 0 else -1) if count else 0
            return f"count {count}, average {avg}, total {total}"
        if is_decoded(kind):
            return str(decode(kind, values, self.lay.names))
        return str(scalar(kind, values))

    def text(self, entries: dict[tuple[int, ...], list[int]]) -> str:
        """The map as bpftrace's language prints it (empty string: an empty map)."""
        name = self.lay.type.name
        lines = []
        for key, values in self.sorted(entries):
            head = name + (f"[{', '.join(self.key_parts(key))}]" if self.lay.keyed else "")
            if self.hist:
                lines.append(f"{head}: \n{hist_text(_rows(self.lay, values))}")
            else:
                lines.append(f"{head}: {self.value_text(values)}")
        if not lines:
            return ""
        if self.hist:       # each histogram ends its own last line; one blank line between
            return "\n".join(lines)
        return "\n".join(lines) + "\n"

    def json(self, entries: dict[tuple[int, ...], list[int]]) -> Any:
        """The map's data as bpftrace's JSON output holds it: a value (or a histogram's
        bucket list) for a map without keys, else {"k1,k2": value}."""
        def value(values: list[int]) -> Any:
            if self.hist:
                return [{**bounds, "count": count} for _, bounds, count in _rows(self.lay, values)]
            kind = self.lay.type.kind
            if kind is not None and kind.startswith(TUPLE):
                return plain(decode(kind, values, self.lay.names))   # a list, as bpftrace's
            if is_decoded(kind) or self.lay.type.stats:
                return self.value_text(values)
            return scalar(kind, values)

        items = self.sorted(entries)
        if not self.lay.keyed:
            return value(items[0][1]) if items else None
        return {",".join(self.key_parts(k)): value(v) for k, v in items}


#: the prefixes of a system call's function in sys_call_table (x86-64, arm64)
SYSCALL_PREFIX = re.compile(r"__(?:x64|arm64)_sys_(\w+)")


def syscall_namer(image: Any, read: Callable[[int, int], bytes]) -> Callable[[int], str]:
    """syscall_name()'s text for each number: the name of the function the kernel's
    sys_call_table holds at that index (``__x64_sys_read``: "read"), as bpftrace's
    table for the target's architecture names it; "Unknown syscall" for an index past
    the table or holding ``sys_ni_syscall``.  The table is read on first use
    (kallsyms gives no sizes: it runs to the next symbol, at most MAX_SYSCALLS)."""
    names: list[str] | None = None

    def table() -> list[str]:
        from .tracepoints import MAX_SYSCALLS

        sym = image.find_symbol("sys_call_table")
        if sym is None:
            return []
        size = sym.size or min(min((s.address for s in image.symbols if s.address > sym.address),
                                   default=sym.address) - sym.address, 8 * MAX_SYSCALLS)
        data = read(sym.address, size - size % 8) if size >= 8 else b""
        out = []
        for i in range(0, len(data), 8):
            f = image.function_at(int.from_bytes(data[i:i + 8], "little"))
            m = SYSCALL_PREFIX.fullmatch(f.name) if f is not None else None
            out.append(m.group(1) if m is not None and m.group(1) != "ni_syscall"
                       else UNKNOWN_SYSCALL)
        return out

    def name(n: int) -> str:
        nonlocal names
        if names is None:
            names = table()
        return names[n] if 0 <= n < len(names) else UNKNOWN_SYSCALL

    return name


def username_namer(read: Callable[[str], str]) -> Callable[[int], str]:
    """username's text for each uid, as bpftrace 0.17 names it (resolve_uid): the first
    field of the first line of the traced machine's /etc/passwd whose third field is
    the uid; empty when none is (or the file cannot be read).  ``read(path)``: the
    file's text (read once, on first use)."""
    users: dict[str, str] | None = None

    def name(uid: int) -> str:
        nonlocal users
        if users is None:
            users = {}
            for line in read("/etc/passwd").splitlines():
                fields = line.split(":")
                if len(fields) > 2:
                    users.setdefault(fields[2], fields[0])
        return users.get(str(uid), "")

    return name


def record(kind: str, data: Any) -> dict[str, Any]:
    """One piece of output as a JSON lines record, as bpftrace's ``-f json`` writes it:
    ``{"type": "printf", "data": "..."}``, ``{"type": "map", "data": {"@m": ...}}``,
    ``{"type": "hist", ...}``, ``{"type": "time", ...}``, ``{"type": "value", ...}``,
    ``{"type": "lost_events", "data": {"events": N}}``; and ksim's own
    ``{"type": "lost_keys", "data": {"map", "lost", "keys", "max_map_keys", "full"}}``."""
    if kind == "lost_events":
        return {"type": kind, "data": {"events": data}}
    return {"type": kind, "data": data}


__all__ = ["MapPrinter", "record", "hist_label", "hist_rows", "hist_text", "lhist_label", "lhist_rows"]
