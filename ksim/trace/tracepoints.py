"""Trace events as places to splice: ``tracepoint:CATEGORY:NAME`` and
``rawtracepoint:NAME`` of bpftrace's language, without BPF (docs/tracepoints.md).

    tp = Tracepoints(manager)
    (event,) = tp.events("sched", "sched_switch")
    site = tp.site(event)          # the points, and how to read the record there
    tp.enable([event])             # a live kernel: the event on, in a private instance
    ... insert snippets at site.points, reading fields at site.record + offset,
        each guarded by site.guard ...
    tp.disable()

An event resolves to a **site**: the points where a snippet runs, and how each
field of the event's record is read there.

* ``syscalls:sys_enter_NAME`` / ``sys_exit_NAME``: the system call's wrapper,
  ``__x64_sys_NAME(const struct pt_regs *regs)`` (the architecture's
  :class:`~ksim.arch.base.SyscallABI` names it), at its entry or at every
  return.  There is no record: ``Site.values`` gives each field's value, the
  arguments read from the pt_regs, ``ret`` the wrapper's return value,
  ``__syscall_nr`` the wrapper's index in ``sys_call_table``.
* any other event: the call of ``trace_event_buffer_commit(&fbuffer)`` in its
  class's function, ``trace_event_raw_event_<class>``, where the record is
  complete at ``fbuffer->entry``; ``fbuffer`` is the call's first argument.
  Several events share a class (DEFINE_EVENT), so ``Site.guard`` tells this
  event's hits: ``fbuffer->trace_file->event_call == &event_<name>``, and, on a
  live kernel, ``fbuffer->trace_file->tr`` is ksim's own trace instance.
* ``rawtracepoint:NAME``: the entry of the same class function, whose
  arguments after ``__data`` (the trace_event_file) are the tracepoint's
  ``TP_PROTO`` arguments: ``arg0`` .. ``arg4``.

A live kernel calls a class function only while its event is enabled in some
trace instance, so :meth:`Tracepoints.enable` enables the events in a private
instance (``instances/ksim-tp-...``, a small buffer) and :meth:`Tracepoints.disable`
disables and removes it.  The toy kernel's events are always on.

Where the list of events and their records' formats come from: a live kernel's
tracefs (``available_events``, ``events/CATEGORY/NAME/format``); an image file,
the toy kernel's, its own tables, read as Linux builds them (``_ftrace_events``,
``__syscalls_metadata``; images/toy/README.md).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ksim.arch.base import Flow, Insn
from ksim.errors import KsimError
from ksim.snippets import ast

if TYPE_CHECKING:
    from ksim.analysis.points import Point
    from ksim.image.image import Image
    from ksim.image.model import Function


# --- errors ---------------------------------------------------------------------------------
class TracepointError(KsimError):
    """A trace event ksim cannot resolve, splice, enable or disable."""

    code = "tracepoint"


class BadTracepointPattern(TracepointError):
    """An attach point's category or name is no event name or wildcard."""

    code = "tracepoint-pattern"


class UnknownTracepoint(TracepointError):
    """No event of the kernel matches; ``suggestions`` holds close names."""

    code = "unknown-tracepoint"

    def __init__(self, what: str, suggestions: Iterable[str] = ()) -> None:
        self.what = what
        self.suggestions = list(suggestions)
        hint = f"; did you mean {', '.join(self.suggestions)}?" if self.suggestions else ""
        super().__init__(f"no trace event {what}{hint}")


class NoTracepointSite(TracepointError):
    """The event exists but has no place ksim can splice (no wrapper, no class
    function, no commit call, a return ksim cannot see)."""

    code = "no-tracepoint-site"


class TraceInstanceError(TracepointError):
    """ksim's private trace instance could not be made, set up or removed."""

    code = "trace-instance"


# --- what an event is -----------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of an event's record, as its ``format`` says."""

    name: str
    offset: int
    size: int
    signed: bool
    #: the C type: "int", "char[16]", "const char *", "__data_loc char[]", "unsigned long"
    ctype: str
    #: element count of a fixed array (char[16] -> 16), else None
    array_len: int | None
    #: a __data_loc field: the u32 at ``offset`` holds (length << 16 | offset in the record)
    data_loc: bool

    @property
    def common(self) -> bool:
        """One of struct trace_entry's fields, in every record (common_pid, ...)."""
        return self.name.startswith("common_")


@dataclass(frozen=True)
class Event:
    category: str
    name: str
    fields: tuple[Field, ...]

    def __str__(self) -> str:
        return f"{self.category}:{self.name}"

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    @property
    def args(self) -> tuple[Field, ...]:
        """The event's own fields (bpftrace's ``args``): all but the common ones."""
        return tuple(f for f in self.fields if not f.common)

    @property
    def syscall(self) -> tuple[str, str] | None:
        """("enter" or "exit", the system call's name) of a syscalls: event."""
        m = _SYSCALL_EVENT.fullmatch(self.name)
        return (m.group(1), m.group(2)) if m and self.category == SYSCALLS else None


@dataclass(frozen=True)
class Site:
    """Where an event's snippet runs and what it reads there."""

    event: Event
    #: Manager points where the snippet runs (an entry, every exit, or calls)
    points: list[Point]
    #: the record's address at the points (None: the event has no record there)
    record: ast.Node | None
    #: field name -> its value at the points (events without a record; rawtracepoint's
    #: arg0..arg4)
    values: dict[str, ast.Node]
    #: true when a hit at the points is this event's (None: always)
    guard: ast.Node | None
    #: the event that must be enabled for the points to run, when not ``event``
    #: itself (a system call's exit read through raw_syscalls:sys_exit)
    enable: Event | None = None


SYSCALLS = "syscalls"
_SYSCALL_EVENT = re.compile(r"sys_(enter|exit)_(\w+)")
#: what an event's category or name may be: its characters and fnmatch's wildcards
_PATTERN = re.compile(r"[A-Za-z0-9_.*?!\[\]-]+")
TRACEFS = "/sys/kernel/tracing"
#: entries of sys_call_table read at most (Linux 6.1 x86-64 has 451)
MAX_SYSCALLS = 4096
#: the fields of struct trace_entry, in every record (trace_define_common_fields)
COMMON_FIELDS = (
    Field("common_type", 0, 2, False, "unsigned short", None, False),
    Field("common_flags", 2, 1, False, "unsigned char", None, False),
    Field("common_preempt_count", 3, 1, False, "unsigned char", None, False),
    Field("common_pid", 4, 4, True, "int", None, False),
)


# --- the kernel's tracing structures --------------------------------------------------------
@dataclass(frozen=True)
class TraceLayout:
    """Offsets in the kernel's tracing structures that sites and the event tables
    read: Linux 6.1's (include/linux/trace_events.h, kernel/trace/trace.h), checked
    against Debian's 6.1 vmlinux (docs/tracepoints.md: every class function tests
    ``file->flags`` at 0x48 and passes ``&fbuffer`` on its stack to
    trace_event_buffer_commit), which the toy kernel keeps (its _Static_asserts).
    ksim.btf will give them per kernel."""

    #: struct trace_event_buffer
    buffer_trace_file: int = 16
    buffer_entry: int = 24
    #: struct trace_event_file
    file_event_call: int = 16
    file_tr: int = 40
    #: struct trace_array: list, then the instance's name
    array_name: int = 16
    #: struct trace_event_call: class, then union { name; tp }, and flags (after
    #: struct trace_event, print_fmt, filter, module and data)
    call_class: int = 16
    call_name: int = 24
    call_flags: int = 112
    #: TRACE_EVENT_FL_TRACEPOINT: the union holds a struct tracepoint *, whose
    #: first member is its name
    flag_tracepoint: int = 0x10
    #: struct trace_event_class
    class_system: int = 0
    class_probe: int = 8
    class_fields: int = 32
    #: struct trace_event_fields: type, name, size, align, is_signed, filter_type, len
    fields_size: int = 40
    #: struct syscall_metadata: name, syscall_nr, nb_args, types, args
    meta_nb_args: int = 12
    meta_types: int = 16
    meta_args: int = 24
    #: sizeof(struct trace_entry): where an event's own fields start
    entry_size: int = 8
    #: struct syscall_trace_enter / _exit: nr, then args[] or ret
    syscall_nr: int = 8
    syscall_args: int = 16


LINUX_6_1 = TraceLayout()

Read = Callable[[int, int], bytes]


def _u64(read: Read, address: int) -> int:
    return int.from_bytes(read(address, 8), "little")


def _s32(read: Read, address: int) -> int:
    return int.from_bytes(read(address, 4), "little", signed=True)


def _cstr(read: Read, address: int, limit: int = 256) -> str:
    """The NUL-terminated string at ``address``, read page by page (never past one)."""
    out = b""
    while len(out) < limit:
        at = address + len(out)
        try:
            chunk = read(at, min(64, 0x1000 - at % 0x1000))
        except KsimError:
            chunk = read(at, 1)     # the string ends near the end of its section
        end = chunk.find(b"\0")
        if end >= 0:
            return (out + chunk[:end]).decode(errors="replace")
        out += chunk
    raise TracepointError(f"no string of at most {limit} bytes at {address:#x}")


# --- format files --------------------------------------------------------------------------
_DECL = re.compile(r"(?P<type>.*?)\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(\[[^\]]*\])*)")


def field_of(decl: str, offset: int, size: int, signed: bool) -> Field:
    """A Field from a declaration as a format file writes it ("char prev_comm[16]",
    "const char * filename", "__data_loc char[] cmd") or a fields_array's type and
    name joined by a space."""
    m = _DECL.fullmatch(decl.strip())
    if m is None or not m.group("type"):
        raise TracepointError(f"cannot read the field declaration {decl!r}")
    ctype = " ".join(m.group("type").split()) + m.group("dims")
    dims = re.fullmatch(r"\[(\d+)\]", m.group("dims"))
    if dims is None:
        dims = re.fullmatch(r".*\[(\d+)\]", ctype)
    data_loc = ctype.startswith("__data_loc")
    array_len = int(dims.group(1)) if dims and not data_loc else None
    return Field(m.group("name"), offset, size, signed, ctype, array_len, data_loc)


def parse_format(text: str, category: str = "", name: str = "") -> Event:
    """An Event from a tracefs ``format`` file (kernel/trace/trace_events.c f_show):
    ``name: N``, ``ID: N``, then ``field:DECL;\\toffset:N;\\tsize:N;\\tsigned:N;`` lines."""
    fields = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("name:") and not name:
            name = line[5:].strip()
        if not line.startswith("field:"):
            continue
        parts = {}
        for item in line.split(";"):
            key, _, value = item.strip().partition(":")
            if key:
                parts[key] = value.strip()
        try:
            fields.append(field_of(parts["field"], int(parts["offset"]), int(parts["size"]),
                                   parts.get("signed", "0") == "1"))
        except (KeyError, ValueError) as exc:
            raise TracepointError(f"{category}:{name}: cannot read the format line "
                                  f"{line!r}") from exc
    if not fields:
        raise TracepointError(f"{category}:{name}: its format lists no field")
    return Event(category, name, tuple(fields))


def syscall_event(kind: str, syscall: str, args: Iterable[tuple[str, str]],
                  layout: TraceLayout = LINUX_6_1) -> Event:
    """syscalls:sys_enter_NAME or sys_exit_NAME as Linux defines its fields
    (kernel/trace/trace_syscalls.c syscall_enter_define_fields: each argument an
    unsigned long, whatever its C type)."""
    fields = list(COMMON_FIELDS)
    fields.append(Field("__syscall_nr", layout.syscall_nr, 4, True, "int", None, False))
    if kind == "enter":
        for i, (ctype, name) in enumerate(args):
            fields.append(field_of(f"{ctype} {name}", layout.syscall_args + 8 * i, 8, False))
    else:
        fields.append(Field("ret", layout.syscall_args, 8, True, "long", None, False))
    return Event(SYSCALLS, f"sys_{kind}_{syscall}", tuple(fields))


# --- where the events are listed ------------------------------------------------------------
class _Catalogue(Protocol):
    """A kernel's trace events: their names, formats and event calls."""

    #: how the kernel's memory is read (the tables, sys_call_table, event calls)
    read: Read
    #: whether the events must be enabled (in tracefs) for their class function to run
    live: bool

    def names(self) -> list[tuple[str, str]]: ...

    def event(self, category: str, name: str) -> Event: ...

    def call(self, event: Event) -> int:
        """The address of the event's struct trace_event_call."""
        ...


class ImageTables:
    """The events an image file lists the way Linux builds them (the toy kernel's;
    images/toy/README.md): ``_ftrace_events`` holds pointers to each event's
    struct trace_event_call, ``__syscalls_metadata`` to each system call's struct
    syscall_metadata.  A field's offset is what Linux's event_define_fields()
    computes: from sizeof(struct trace_entry), each field aligned to its align."""

    live = False

    def __init__(self, image: Image, layout: TraceLayout = LINUX_6_1) -> None:
        self.read: Read = image.read
        self.layout = layout
        self._events: dict[tuple[str, str], Event] = {}
        self._calls: dict[tuple[str, str], int] = {}
        for call in self._pointers(image, "ftrace_events"):
            event = self._event_of(call)
            self._events[event.category, event.name] = event
            self._calls[event.category, event.name] = call
        for meta in self._pointers(image, "syscalls_metadata"):
            for event in self._syscall_events(meta):
                self._events[event.category, event.name] = event

    @staticmethod
    def has_tables(image: Image) -> bool:
        return all(image.find_symbol(f"__{end}_{table}") is not None
                   for end in ("start", "stop") for table in ("ftrace_events", "syscalls_metadata"))

    def _pointers(self, image: Image, table: str) -> list[int]:
        start, stop = image.address_of(f"__start_{table}"), image.address_of(f"__stop_{table}")
        data = self.read(start, stop - start) if stop > start else b""
        return [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data) - 7, 8)]

    def _event_of(self, call: int) -> Event:
        lay, read = self.layout, self.read
        cls = _u64(read, call + lay.call_class)
        name = _u64(read, call + lay.call_name)
        if _s32(read, call + lay.call_flags) & lay.flag_tracepoint:
            name = _u64(read, name)         # struct tracepoint: its name first
        category = _cstr(read, _u64(read, cls + lay.class_system))
        fields = list(COMMON_FIELDS)
        offset = lay.entry_size
        at = _u64(read, cls + lay.class_fields)
        while ctype := _u64(read, at):
            size, align, signed = (_s32(read, at + 16), _s32(read, at + 20), _s32(read, at + 24))
            offset = -(-offset // max(align, 1)) * max(align, 1)
            decl = f"{_cstr(read, ctype)} {_cstr(read, _u64(read, at + 8))}"
            fields.append(field_of(decl, offset, size, bool(signed)))
            offset += size
            at += lay.fields_size
        return Event(category, _cstr(read, name), tuple(fields))

    def _syscall_events(self, meta: int) -> list[Event]:
        lay, read = self.layout, self.read
        name = _cstr(read, _u64(read, meta)).removeprefix("sys_")
        n = _s32(read, meta + lay.meta_nb_args)
        types, names = _u64(read, meta + lay.meta_types), _u64(read, meta + lay.meta_args)
        args = [(_cstr(read, _u64(read, types + 8 * i)), _cstr(read, _u64(read, names + 8 * i)))
                for i in range(n)]
        return [syscall_event("enter", name, args, lay), syscall_event("exit", name, (), lay)]

    def names(self) -> list[tuple[str, str]]:
        return list(self._events)

    def event(self, category: str, name: str) -> Event:
        try:
            return self._events[category, name]
        except KeyError:
            raise UnknownTracepoint(f"{category}:{name}") from None

    def call(self, event: Event) -> int:
        try:
            return self._calls[event.category, event.name]
        except KeyError:
            raise UnknownTracepoint(str(event)) from None


class TraceFS(Protocol):
    """What a target serving a running Linux kernel offers of its tracefs
    (ksim.live.client.LiveTarget.tracefs)."""

    def tracefs(self, file: str, mode: str = "r", data: str = "") -> str: ...


class TraceFSEvents:
    """A running kernel's events, as its tracefs lists them; an event's struct
    trace_event_call is the kernel's symbol ``event_<name>``, checked against the
    event's name and category read through it."""

    live = True

    def __init__(self, fs: TraceFS, image: Image, read: Read,
                 layout: TraceLayout = LINUX_6_1) -> None:
        self.fs, self.image, self.read, self.layout = fs, image, read, layout
        self._names: list[tuple[str, str]] | None = None
        self._known: set[tuple[str, str]] = set()
        self._events: dict[tuple[str, str], Event] = {}

    def names(self) -> list[tuple[str, str]]:
        if self._names is None:
            text = self.fs.tracefs(f"{TRACEFS}/available_events")
            names = (line.strip().partition(":") for line in text.splitlines())
            self._names = [(c, n) for c, sep, n in names if sep and c and n]
            self._known = set(self._names)
        return self._names

    def event(self, category: str, name: str) -> Event:
        key = (category, name)
        if key not in self._events:
            self.names()
            if key not in self._known:
                raise UnknownTracepoint(f"{category}:{name}")
            text = self.fs.tracefs(f"{TRACEFS}/events/{category}/{name}/format")
            self._events[key] = parse_format(text, category, name)
        return self._events[key]

    def call(self, event: Event) -> int:
        symbol = self.image.find_symbol(f"event_{event.name}")
        if symbol is None:
            raise NoTracepointSite(f"{event}: the kernel has no symbol event_{event.name}, its "
                                   "struct trace_event_call")
        lay, read = self.layout, self.read
        name = _u64(read, symbol.address + lay.call_name)
        if _s32(read, symbol.address + lay.call_flags) & lay.flag_tracepoint:
            name = _u64(read, name)
        cls = _u64(read, symbol.address + lay.call_class)
        found = f"{_cstr(read, _u64(read, cls + lay.class_system))}:{_cstr(read, name)}"
        if found != str(event):
            raise NoTracepointSite(f"{event}: event_{event.name} at {symbol.address:#x} is "
                                   f"the event call of {found}")
        return symbol.address


# --- the provider ---------------------------------------------------------------------------
class Tracepoints:
    """The trace events of the kernel a Manager is attached to, their sites, and
    (on a live kernel) the private trace instance that keeps them enabled."""

    def __init__(self, manager: Any, layout: TraceLayout = LINUX_6_1) -> None:
        self.m = manager
        self.image: Image = manager.target.image
        self.arch = manager.arch
        self.layout = layout
        self.catalogue = self._catalogue()
        #: the private instance's name and the events enabled in it
        self.instance: str | None = None
        self.enabled: list[Event] = []
        #: heap word holding the instance's struct trace_array * (0: not enabled),
        #: which a live site's guard compares fbuffer->trace_file->tr with
        self._tr: ast.Var | None = None
        self._syscall_table: dict[int, int] | None = None

    def _catalogue(self) -> _Catalogue:
        if self.image.reads_memory:
            # a running kernel: its tracefs lists what it has now (modules included)
            return TraceFSEvents(cast(TraceFS, self.m.target), self.image,
                                 self.m.copy_from_kernel, self.layout)
        if ImageTables.has_tables(self.image):
            return ImageTables(self.image, self.layout)
        raise TracepointError(f"{self.image.module}: the image lists no trace events (no "
                              "_ftrace_events and __syscalls_metadata tables) and is no "
                              "running kernel with a tracefs")

    # --- events ---------------------------------------------------------------------------
    def events(self, category: str, name: str) -> list[Event]:
        """The events ``category:name`` names, wildcards (fnmatch's) in either,
        sorted; UnknownTracepoint when none does."""
        for part in (category, name):
            if not _PATTERN.fullmatch(part) or part.count("[") != part.count("]"):
                raise BadTracepointPattern(
                    f"tracepoint:{category}:{name}: {part!r} is no event name or wildcard "
                    "(letters, digits, _ - . and the wildcards * ? [...])")
        names = self.catalogue.names()
        found = sorted((c, n) for c, n in names
                       if fnmatch.fnmatchcase(c, category) and fnmatch.fnmatchcase(n, name))
        if not found:
            every = [f"{c}:{n}" for c, n in names]
            close = difflib.get_close_matches(f"{category}:{name}", every, n=3)
            raise UnknownTracepoint(f"{category}:{name}", close)
        return [self.catalogue.event(c, n) for c, n in found]

    # --- sites ----------------------------------------------------------------------------
    def site(self, event: Event) -> Site:
        """Where ``event``'s snippet runs and how its fields are read (module doc);
        NoTracepointSite when it cannot be spliced."""
        which = event.syscall
        if which is not None:
            return self._syscall_site(event, *which)
        fn = self._class_function(event)
        commit = self.image.find_symbol("trace_event_buffer_commit")
        if commit is None:
            raise NoTracepointSite(f"{event}: the kernel has no trace_event_buffer_commit")
        calls = {i.address for i in self._insns(fn)
                 if i.flow is Flow.CALL and i.target == commit.address}
        if not calls:
            raise NoTracepointSite(f"{event}: its class function {fn.name} makes no call to "
                                   "trace_event_buffer_commit")
        points = [p for p in self.m.callsite_points(fn) if p.address in calls]
        # trace_event_buffer_commit(struct trace_event_buffer *fbuffer): the call's
        # first argument, by the calling convention
        fbuffer = ast.reg(self.arch.arg_regs[0])
        record = ast.load(fbuffer + self.layout.buffer_entry, 8)
        file = ast.load(fbuffer + self.layout.buffer_trace_file, 8)
        return self._checked(Site(event, points, record, {}, self._guard(event, file)))

    def raw_site(self, name: str) -> Site:
        """``rawtracepoint:NAME``: the entry of the class function of the event the
        tracepoint ``name`` feeds, where ``arg0`` .. ``arg4`` are the tracepoint's
        first five arguments; the event must be enabled as for ``site``."""
        if any(c in name for c in "*?["):
            raise BadTracepointPattern(f"rawtracepoint:{name}: a raw tracepoint is named "
                                       "whole, without wildcards")
        found = [e for e in self.events("*", name) if e.category != SYSCALLS]
        if not found:
            raise NoTracepointSite(
                f"rawtracepoint:{name}: syscalls:{name} is no tracepoint of its own (the "
                "system calls' tracepoints are raw_syscalls:sys_enter and sys_exit)")
        if len(found) > 1:
            raise BadTracepointPattern(f"rawtracepoint:{name} names {len(found)} tracepoints "
                                       f"({', '.join(map(str, found))}); name one")
        event = found[0]
        fn = self._class_function(event)
        values: dict[str, ast.Node] = {f"arg{i}": ast.arg(i + 1) for i in range(5)}
        file = ast.arg(0)       # __data: the event's trace_event_file
        return self._checked(Site(event, [self.m.entry_point(fn)], None, values,
                                  self._guard(event, file)))

    def _class_function(self, event: Event) -> Function:
        """trace_event_raw_event_<class>: the class's probe, read through the event's
        struct trace_event_call."""
        call = self.catalogue.call(event)
        read = self.catalogue.read
        probe = _u64(read, _u64(read, call + self.layout.call_class) + self.layout.class_probe)
        fn = self.image.function_at(probe)
        if fn is None or fn.address != probe:
            raise NoTracepointSite(f"{event}: its class's probe {probe:#x} is no function's start")
        return fn

    def _guard(self, event: Event, file: ast.Node) -> ast.Node:
        """``file`` (a struct trace_event_file *) is this event's, and on a live
        kernel the one in ksim's instance."""
        lay = self.layout
        mine = ast.load(file + lay.file_event_call, 8) == ast.Const(self.catalogue.call(event))
        if not self.catalogue.live:
            return mine
        if self._tr is None:
            self._tr = self.m.malloc(8)
        return ast.land(mine, ast.load(file + lay.file_tr, 8) == self._tr)

    def _syscall_site(self, event: Event, kind: str, syscall: str) -> Site:
        wrapper = self.arch.syscalls.wrapper_prefix + syscall
        fn = self.image.function(wrapper) if self.image.has_function(wrapper) else None
        if fn is None:
            raise NoTracepointSite(f"{event}: the kernel has no {wrapper} (the system call's "
                                   "wrapper)")
        values: dict[str, ast.Node] = {"common_pid": ast.Pid()}
        nr = self._syscall_numbers().get(fn.address)
        if nr is not None:
            values["__syscall_nr"] = ast.Const(nr)
        if kind == "enter":
            points = [self.m.entry_point(fn)]
            offsets = self.arch.syscalls.arg_offsets
            args = [f for f in event.args if f.name != "__syscall_nr"]
            if len(args) > len(offsets):
                raise NoTracepointSite(f"{event}: {len(args)} arguments, more than the "
                                       f"{len(offsets)} a system call has")
            regs = ast.arg(0)   # the wrapper's const struct pt_regs *
            for f, off in zip(args, offsets, strict=False):
                values[f.name] = ast.load(regs + off, f.size, f.signed)
        else:
            try:
                points = self._returns(event, fn)
            except NoTracepointSite as exc:
                # the wrapper leaves by a tail call: its value is the kernel's own
                # raw_syscalls:sys_exit's, for this system call's number
                if nr is None:
                    raise
                try:
                    return self._raw_exit(event, nr)
                except TracepointError:
                    raise exc from None
            values["ret"] = ast.retval()
        return self._checked(Site(event, points, None, values, None))

    def _raw_exit(self, event: Event, nr: int) -> Site:
        """``syscalls:sys_exit_NAME`` at raw_syscalls:sys_exit's site, guarded by the
        record's ``id`` being the call's number; ``ret`` from its record."""
        raw_event = self.catalogue.event("raw_syscalls", "sys_exit")
        raw = self.site(raw_event)
        ident, ret = raw_event.field("id"), raw_event.field("ret")
        if raw.record is None or ident is None or ret is None:
            raise NoTracepointSite(f"{event}: raw_syscalls:sys_exit has no id and ret to read")
        record = raw.record
        values = {"__syscall_nr": ast.Const(nr), "common_pid": ast.Pid(),
                  "ret": ast.load(record + ret.offset, ret.size, ret.signed)}
        mine = ast.load(record + ident.offset, ident.size, ident.signed) == ast.Const(nr)
        guard = mine if raw.guard is None else ast.land(raw.guard, mine)
        return Site(event, raw.points, None, values, guard, enable=raw_event)

    def _returns(self, event: Event, fn: Function) -> list[Point]:
        """Every exit of ``fn``, each a return (its value known there), or NoTracepointSite."""
        points = self.m.exit_points(fn)
        insns = {i.address: i for i in self._insns(fn)}
        for p in points:
            insn = insns.get(p.address)
            if insn is None or not self._is_return(insn):
                raise NoTracepointSite(
                    f"{event}: {fn.name} leaves at +{p.address - fn.address:#x} by a tail call "
                    f"({insn or 'no instruction'}): its return value is not known there")
        if not points:
            raise NoTracepointSite(f"{event}: {fn.name} never returns")
        return points

    def _is_return(self, insn: Insn) -> bool:
        if insn.flow is Flow.RET:
            return True
        target = self.image.function_at(insn.target) if insn.target is not None else None
        return (insn.flow is Flow.JMP and target is not None
                and self.arch.convention.return_thunk.fullmatch(target.name) is not None)

    def _insns(self, fn: Function) -> list[Insn]:
        return list(self.arch.decode(self.image.code(fn), fn.address))

    def _syscall_numbers(self) -> dict[int, int]:
        """Wrapper address -> its first index in sys_call_table (empty: no table)."""
        if self._syscall_table is None:
            self._syscall_table = {}
            table = self.image.find_symbol("sys_call_table")
            size = 0 if table is None else table.size
            if table is not None and not size:
                # kallsyms gives no sizes: the table runs to the next symbol
                after = min((s.address for s in self.image.symbols if s.address > table.address),
                            default=table.address)
                size = min(after - table.address, 8 * MAX_SYSCALLS)
            if table is not None and size >= 8:
                data = self.catalogue.read(table.address, size - size % 8)
                for i in range(len(data) // 8):
                    self._syscall_table.setdefault(int.from_bytes(data[8 * i:8 * i + 8],
                                                                  "little"), i)
        return self._syscall_table

    def _checked(self, site: Site) -> Site:
        """``site``, when each of its points can be spliced (the Manager's dry run)."""
        if not site.points:
            raise NoTracepointSite(f"{site.event}: no point to splice")
        for p in site.points:
            why = self.m.can_insert(p)
            if why is not None:
                raise NoTracepointSite(f"{site.event}: {p} cannot be spliced: {why}")
        return site

    # --- the private instance (live kernels) --------------------------------------------------
    def enable(self, events: Iterable[Event]) -> None:
        """Make the class functions of ``events`` run: on a live kernel, enable them in
        ksim's private trace instance (made on first use, with a small buffer).  The
        toy kernel's events are always on, and system call events need nothing.
        Idempotent; on an error everything this did is undone."""
        wanted = [e for e in events if e.syscall is None and e not in self.enabled]
        if not self.catalogue.live or not wanted:
            return
        fs = cast(TraceFS, self.m.target)
        try:
            if self.instance is None:
                name = f"ksim-tp-{os.getpid()}-{secrets.token_hex(4)}"
                fs.tracefs(f"{TRACEFS}/instances/{name}", "mkdir")
                self.instance = name
                fs.tracefs(f"{self._dir}/buffer_size_kb", "w", "8")
            for e in wanted:
                fs.tracefs(f"{self._dir}/events/{e.category}/{e.name}/enable", "w", "1")
                self.enabled.append(e)
            if self._tr is None:
                self._tr = self.m.malloc(8)
            self.m.write(self._tr, self._trace_array(self.instance))
        except BaseException as exc:
            try:
                self.disable()
            except KsimError:
                pass
            if isinstance(exc, KsimError) and not isinstance(exc, TracepointError):
                raise TraceInstanceError(f"cannot enable {', '.join(map(str, wanted))} in a "
                                         f"trace instance of ksim's: {exc}") from exc
            raise

    @property
    def _dir(self) -> str:
        return f"{TRACEFS}/instances/{self.instance}"

    def _trace_array(self, name: str) -> int:
        """The struct trace_array of instance ``name``, found on the kernel's list of
        them (ftrace_trace_arrays: the global one, then the instances)."""
        head = self.image.find_symbol("ftrace_trace_arrays")
        if head is None:
            raise TraceInstanceError("the kernel has no ftrace_trace_arrays symbol: the trace "
                                     "instance's trace_array cannot be found")
        read = self.catalogue.read
        at = _u64(read, head.address)
        for _ in range(4096):
            if at == head.address:
                break
            title = _u64(read, at + self.layout.array_name)
            if title and _cstr(read, title) == name:
                return at
            at = _u64(read, at)
        raise TraceInstanceError(f"trace instance {name} is not on ftrace_trace_arrays")

    def disable(self) -> None:
        """Stop counting ksim's instance as this event's, disable its events and remove
        it.  Idempotent; every step is tried, and the first failure raised after."""
        errors: list[KsimError] = []

        def attempt(step: Callable[[], object]) -> None:
            try:
                step()
            except KsimError as exc:
                errors.append(exc)

        if self._tr is not None:
            tr = self._tr
            attempt(lambda: self.m.write(tr, 0))
        if self.instance is not None:
            fs = cast(TraceFS, self.m.target)
            for e in self.enabled:
                path = f"{self._dir}/events/{e.category}/{e.name}/enable"
                attempt(functools.partial(fs.tracefs, path, "w", "0"))
            attempt(lambda: fs.tracefs(self._dir, "rmdir"))
            if not errors:
                self.instance = None
        self.enabled = [] if self.instance is None else self.enabled
        if errors:
            raise TraceInstanceError(f"removing ksim's trace instance: {errors[0]}") from errors[0]
