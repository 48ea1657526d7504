"""A trace program on a Manager: maps allocated, probes resolved and spliced in one
batch, BEGIN and END run by the client, maps read back and printed.

    with Manager.attach("unicorn:toy") as m:
        s = TraceSession(m, parse("kprobe:vfs_* { @[func] = count(); }"))
        s.attach()
        try:
            s.begin(); m.run(seed=1); s.end()
        finally:
            s.detach()
        print(s.output())

BEGIN and END actions are interpreted here, over the same maps (read and written
through the Manager): the kernel is not running while they do.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ksim.analysis.points import PointKind
from ksim.errors import KsimError, OutOfMemory, UnknownSymbol
from ksim.live.protocol import MAX_FILE_READ
from ksim.snippets import ast

from . import syntax as t
from .compiler import (
    BINOPS,
    COMPARES,
    STATEMENTS,
    PathCall,
    ProbeCompiler,
    Site,
    analyse,
    constant_key,
    map_refs,
)
from .errors import TraceError, TraceSemanticError, TraceUnsupported
from .events import RING_BYTES, Action, Drain, Ring, allocate_ring, render
from .maps import (
    CGROUP_PATHS,
    ERRNO,
    MASK,
    PROBES,
    SYMBOLIZE,
    SYSCALL,
    SYSCALL_NAMES,
    TUPLE,
    USER_SYMBOLIZE,
    USERNAMES,
    MapLayout,
    MapUse,
    Sizing,
    Table,
    TupleValue,
    decode,
    encode_extreme,
    is_named,
    is_text,
    layout_size,
    place,
    scalar,
    shrink,
    signed,
    size_map,
    tuple_items,
    width,
)
from .output import MapPrinter, syscall_namer, username_namer
from .traced import TracedMachine
from .types import CType, TypeSystem
from .usym import UserSymbols


class Unwinder(NamedTuple):
    """What kstack's code calls: the kernel's stack_trace_save_regs, the bytes of a
    struct pt_regs, (byte offset, what it holds) of the members it reads, and the
    bytes between the Frame's slots."""

    save: int
    regs_bytes: int
    fields: tuple[tuple[int, str], ...]
    slot_bytes: int = 8


class UserUnwinder(NamedTuple):
    """What ustack's code calls: the kernel's stack_trace_save_user (None: it cannot,
    ``why`` says why), and the bytes between the Frame's slots."""

    save: int | None
    why: str = ""
    slot_bytes: int = 8


#: the kernel's walker of the current task's user frames (kernel/stacktrace.c, with
#: CONFIG_USER_STACKTRACE_SUPPORT): unsigned int stack_trace_save_user(unsigned long
#: *store, unsigned int size)
SAVE_USER = "stack_trace_save_user"


@dataclass
class Attached:
    """One spliced point and what runs there."""

    point: Any
    site: Site
    probes: list[t.Probe] = field(default_factory=list)


#: probe actions one program may splice, a probe at N points counting N (bpftrace's
#: max_probes, 1024 by default there: ksim's default lets kprobe:* attach on a whole
#: kernel, a few times over, and keeps the compilation to a minute or so)
MAX_PROBE_POINTS = 200_000


class Exited(Exception):
    """An action called exit(): the run stops (raised from the run's progress)."""


class Output(NamedTuple):
    """One piece of what a program prints: its kind ("printf", "time", "value", "map",
    "hist", "lost_events", "lost_keys"), its text, and its data for JSON
    (ksim.trace.output.record)."""

    kind: str
    text: str
    data: Any


class TraceSession:
    def __init__(self, manager: Any, program: t.Program, *, splice: str = "auto",
                 pid: int | None = None, max_map_keys: int | None = None) -> None:
        self.m = manager
        if program.includes:
            # the headers' #define constants, from the running kernel's headers package
            from .parser import parse
            from .preprocess import release_include_dirs, system_include_dirs

            dirs = release_include_dirs(manager.target.capabilities.release) + \
                system_include_dirs()
            if dirs:
                try:
                    program = parse(program.source, program.filename, program.params, dirs)
                except TraceError as exc:
                    raise exc.located(program.source, program.filename) from None
        #: only this process's hits run the probes' actions (None: every process's)
        self.pid = pid
        self.program = program
        self.splice = splice
        #: the keys a map whose keys are computed holds: the caller's setting, else the
        #: program's config, else bpftrace's default (None)
        self.max_map_keys = max_map_keys if max_map_keys is not None else \
            program.config.get("max_map_keys")
        self.skipped: dict[str, str] = {}
        self.tracepoints: Any = None
        #: the tracepoint events the probes attach to (enabled while attached)
        self._events: list[Any] = []
        #: the profile probes' samplers
        self._samplers: list[Any] = []
        #: the probes (as ``probe`` names them) the attach points expanded to, and the
        #: wildcards that matched nothing
        self._probe_names: set[str] = set()
        self._unmatched: set[str] = set()
        #: a wildcard's entry points, not planned when found: the batch plans them once
        #: and those it refuses are skipped (see attach)
        self._deferred: set[int] = set()
        self._unwinder: Unwinder | None | bool = False
        self._user_unwinder: UserUnwinder | None = None
        self._path_call: PathCall | None | bool = False
        self.types = TypeSystem(load=self._btf)
        #: a representative point of each probe, typing its expressions
        self._typing_sites: dict[int, Site | None] = {}
        #: the traced machine's files (cat, cgroup_path)
        self.traced = TracedMachine(manager.target)
        #: names a user stack's frames (ustack) from the traced machine's files
        self.user_symbols = UserSymbols(self.traced.read)
        try:
            self.analysis = analyse(program, self.types, self.typing_site)
            if not self.traced.live:
                _refuse_cgroup_path(program, manager.target)
        except TraceError as exc:
            raise exc.located(program.source, program.filename) from None
        self.names: list[str] = []
        self._name_at: dict[str, int] = {}
        self.layouts: dict[str, MapLayout] = {}
        self.tables: dict[str, Table] = {}
        #: once detached, nothing in the kernel changes the maps: what the client read
        #: of them, by (address, size), kept until it writes to one (END's output and
        #: the report read each map once, not once each)
        self._still: dict[tuple[int, int], bytes] | None = None
        #: per keyed map, the records constant keys got before the run, and the
        #: numbers of those that have words of their own instead
        self.placed: dict[str, dict[tuple[int, ...], int]] = {}
        self.direct: dict[str, dict[tuple[int, ...], int]] = {}
        #: seconds spent attaching (resolving, allocating, compiling, splicing) and
        #: detaching (all probes out)
        self.timings: dict[str, float] = {}
        self.stop: ast.Var | None = None
        #: the status exit(code) gave (0 without a code)
        self.exit_code = 0
        #: the kernel's clock at the first hit (elapsed)
        self.start: ast.Var | None = None
        #: rand: the kernel's get_random_u32, or a generator's state word in the heap
        self.rand_call: int | None = None
        self.rand_state: ast.Var | None = None
        self.attached: dict[tuple[int, Any], Attached] = {}
        self.handles: list[Any] = []
        #: everything the program printed, in order
        self.printed: list[Output] = []
        self.exited = False
        self.ring: Ring | None = None
        self.drain: Drain | None = None
        #: called with each Output as soon as it is printed (printf while running)
        self.out: Callable[[Output], None] | None = None
        #: (period in ns, probe, its name as ``probe`` gives it: interval:s:1 for i:s:1)
        #: of every interval attach point; when each runs next
        self.intervals: list[tuple[int, t.Probe, str]] = [
            (ap.period_ns, p, "interval:" + ap.text.partition(":")[2])
            for p in program.probes for ap in p.points
            if ap.provider == "interval" and ap.period_ns]
        self._next_interval: list[int | None] = [None] * len(self.intervals)

    # --- setting up -------------------------------------------------------------------------
    def _btf(self) -> Any:
        """The kernel's BTF, or None when it has none (types are then only the C base
        types and the program's own struct definitions)."""
        from ksim.btf import kernel_btf

        try:
            return kernel_btf(self.m)
        except KsimError:
            return None

    def typing_site(self, probe: t.Probe) -> Site | None:
        """The site a probe's expressions are typed at: its first kernel attach point's
        first point (a kfunc's prototype, a tracepoint's fields)."""
        if id(probe) in self._typing_sites:
            return self._typing_sites[id(probe)]
        site: Site | None = None
        for ap in probe.points:
            if ap.provider in t.CLIENT_PROVIDERS:
                site = Site("client", "", ap.text)
                break
            if ap.provider == "kprobe":
                site = Site("entry" if ap.offset is None else "insn", ap.func, ap.text)
                break
            if ap.provider == "kretprobe":
                site = Site("exit", ap.func, ap.text)
                break
            if ap.provider == "profile":
                site = Site("sample", "", ap.text)
                break
            found = self._typed_sites(ap, first=True)
            if found:
                site = found[0][1]
                break
        self._typing_sites[id(probe)] = site
        return site

    def _typed_sites(self, ap: t.AttachPoint, first: bool = False) -> list[tuple[Any, Site]]:
        """kfunc, kretfunc and tracepoint attach points: their points, each with the
        arguments its probe reads (``first``: only a representative one, typed but not
        resolved to points)."""
        if ap.provider in t.FUNC_PROVIDERS:
            return self._func_sites(ap, first)
        if ap.provider == "tracepoint":
            return self._tracepoint_sites(ap, first)
        if ap.provider == "rawtracepoint":
            return self._raw_tracepoint_sites(ap, first)
        raise TraceUnsupported(f"{ap.provider} probes are not supported yet", ap.loc)

    def _func_site(self, ap: t.AttachPoint, name: str) -> Site | None:
        """A kfunc's or kretfunc's site at function ``name``: its parameters from BTF
        (None: no prototype; recorded as skipped)."""
        proto = self.types.func(name)
        probe_name = f"{ap.provider}:{name}"
        if proto is None:
            why = ("the kernel has no BTF" if self.types.btf is None
                   else "the kernel's BTF has no prototype for it")
            self.skipped[probe_name] = why
            if not ap.wildcard:
                raise TraceSemanticError(f"{probe_name}: {why}", ap.loc)
            return None
        params, ret = proto
        if ap.provider == "kfunc":
            args = tuple((pname, ct, ast.Arg(i)) for i, (pname, ct) in enumerate(params[:6]))
            return Site("entry", name, probe_name, args=args, d_path=self.path_call())
        # kretfunc: the arguments' registers are gone at a return; retval is typed
        return Site("exit", name, probe_name, args=(), ret=ret, d_path=self.path_call())

    def _func_sites(self, ap: t.AttachPoint, first: bool) -> list[tuple[Any, Site]]:

        image = self.m.target.image
        if first:
            names = sorted({f.name for f in image.functions
                            if fnmatch.fnmatchcase(f.name, ap.func)}) if ap.wildcard else [ap.func]
            for name in names:
                site = self._func_site(ap, name)
                if site is not None:
                    return [(None, site)]
            return []
        out: list[tuple[Any, Site]] = []
        if ap.provider == "kfunc":
            for point in self._entries(ap, ap.func):
                func = image.function_at(point.address)
                site = self._func_site(ap, func.name if func else ap.func)
                if site is not None:
                    out.append((point, site))
            return out
        from ksim.commands.count import matching_functions

        funcs = matching_functions(image, ap.func)
        if not funcs and not ap.wildcard:
            funcs = [self.m.find_function(ap.func)]
        for f in funcs:
            site = self._func_site(ap, f.name)
            if site is not None:
                out += [(p, site) for p in self._returns(f, site.probe)]
        return out

    def _returns(self, f: Any, key: str) -> list[Any]:
        """Every return point of ``f``, when each can be spliced; else none, and why
        is kept in ``skipped`` under ``key``."""
        try:
            exits = self.m.exit_points(f)
        except KsimError as exc:
            self.skipped[key] = str(exc)
            return []
        why = next((w for w in (self.m.can_insert(p, self.splice) for p in exits) if w), None)
        if not exits or why is not None:
            self.skipped[key] = why or "no return instruction"
            return []
        return exits

    def _tracepoint_sites(self, ap: t.AttachPoint, first: bool) -> list[tuple[Any, Site]]:
        from .tracepoints import Tracepoints

        if self.tracepoints is None:
            self.tracepoints = Tracepoints(self.m)
        events = self.tracepoints.events(ap.category, ap.func)
        if not events:
            raise TraceSemanticError(f"{ap.text}: no tracepoint matches", ap.loc)
        out: list[tuple[Any, Site]] = []
        for ev in events[:1] if first else events:
            probe_name = f"tracepoint:{ev.category}:{ev.name}"
            try:
                tp = self.tracepoints.site(ev)
            except KsimError as exc:
                if not ap.wildcard and len(events) == 1:
                    raise
                self.skipped[probe_name] = str(exc)
                continue
            site = Site("event", ev.name, probe_name, args=self._event_args(tp), guard=tp.guard)
            if first:
                return [(None, site)]
            self._events.append(tp.enable or ev)
            out += [(p, site) for p in tp.points]
        return out

    def _raw_tracepoint_sites(self, ap: t.AttachPoint, first: bool) -> list[tuple[Any, Site]]:
        """rawtracepoint:NAME: the entry of the class function of the event the
        tracepoint feeds (ksim.trace.tracepoints.Tracepoints.raw_site), arg0.. the
        tracepoint's own arguments, typed by the class function's BTF prototype."""
        from .tracepoints import Tracepoints

        if self.tracepoints is None:
            self.tracepoints = Tracepoints(self.m)
        names = sorted({e.name for e in self.tracepoints.events("*", ap.func)
                        if e.category != "syscalls"}) if ap.wildcard else [ap.func]
        out: list[tuple[Any, Site]] = []
        for name in names[:1] if first else names:
            probe_name = f"rawtracepoint:{name}"
            try:
                tp = self.tracepoints.raw_site(name)
            except KsimError as exc:
                if not ap.wildcard:
                    raise
                self.skipped[probe_name] = str(exc)
                continue
            fn = self.m.target.image.function_at(tp.points[0].address)
            proto = self.types.func(fn.name) if fn is not None else None
            args = () if proto is None else tuple(
                (pname, ct, ast.Arg(i + 1)) for i, (pname, ct) in enumerate(proto[0][1:6]))
            site = Site("entry", name, probe_name, args=args, guard=tp.guard, arg_base=1)
            if first:
                return [(None, site)]
            self._events.append(tp.event)
            out += [(p, site) for p in tp.points]
        return out

    def _profile_sites(self, ap: t.AttachPoint) -> list[tuple[Any, Site]]:
        from .profile import sampler

        assert ap.period_ns is not None
        unit, value = ("hz", 10**9 // ap.period_ns) if ap.text.split(":")[1] == "hz" \
            else ("us", max(1, ap.period_ns // 1000))
        smp = sampler(self.m, unit, value)
        self._samplers.append(smp)
        site = Site("sample", "", ap.text, guard=smp.guard)
        return [(p, site) for p in smp.points]

    def _event_args(self, tp: Any) -> tuple[tuple[str, Any, Any], ...]:
        """A tracepoint's fields as ``args``: each read at the record (or computed at
        the syscall's wrapper)."""
        from .types import integer, pointer

        args = []
        for f in tp.event.fields:
            if f.name.startswith("common_"):
                continue
            ctype = " ".join(f.ctype.replace("__data_loc", "").split())
            if f.data_loc:
                # the u32 at the field holds the string's length << 16 | its offset
                n = self.analysis_strlen()
                ct = CType("array", n, False, "char[]", integer(1, True, "char"), n)
                node: Any = tp.record + (ast.load(tp.record + f.offset, 4) & ast.Const(0xFFFF))
            elif f.array_len is not None:
                if tp.record is None and f.name not in tp.values:
                    continue
                elem = integer(max(1, f.size // max(1, f.array_len)), f.signed,
                               ctype.split("[")[0].strip())
                ct = CType("array", f.size, False, ctype, elem, f.array_len)
                node = tp.record + f.offset if tp.record is not None else tp.values[f.name]
            else:
                if "*" in ctype:
                    try:
                        ct = self.types.named(ctype)
                    except TraceError:
                        ct = pointer(integer(1, True, "char"))
                else:
                    ct = integer(f.size if f.size in (1, 2, 4, 8) else 8, f.signed, ctype)
                if f.name in tp.values:
                    node = tp.values[f.name]
                elif tp.record is None:
                    continue            # a syscall event's field with no value there
                else:
                    node = ast.load(tp.record + f.offset, f.size if f.size in (1, 2, 4, 8) else 8,
                                    f.signed)
            args.append((f.name, ct, node))
        return tuple(args)

    def unwinder(self) -> Unwinder | None:
        """How kstack asks this kernel to unwind: its stack_trace_save_regs, and where
        the architecture's unwinder reads the point's registers in struct pt_regs
        (from BTF); None when the kernel has either not."""
        if self._unwinder is not False:
            return self._unwinder  # type: ignore[return-value]
        self._unwinder = None
        abi = self.m.arch.stack
        try:
            save = self.m.target.image.address_of(abi.save)
            regs = self.types.named("struct pt_regs")
        except (KsimError, TraceError):
            return None
        fields = []
        for path, what in abi.registers:
            ct, bits = regs, 0
            for part in path.split("."):
                if part.isdigit():
                    bits += int(part) * ct.ref.size * 8
                    ct = ct.ref
                    continue
                m = ct.member(part)
                if m is None:
                    return None
                bits, ct = bits + m[0], m[2]
            fields.append((bits // 8, what))
        self.m.allow_calls(save)
        self._unwinder = Unwinder(save, regs.size, tuple(fields), abi.slot_bytes)
        return self._unwinder

    def user_unwinder(self) -> UserUnwinder:
        """How ustack asks this kernel for the task's user frames: its
        stack_trace_save_user, which snippets may then call.  An emulated kernel runs
        no user space, and a kernel without the function has no walker ksim knows."""
        if self._user_unwinder is None:
            slot = self.m.arch.stack.slot_bytes
            if not self.traced.live:
                self._user_unwinder = UserUnwinder(None, "an emulated kernel runs no user "
                                                   "space: no task has a user stack to walk",
                                                   slot)
                return self._user_unwinder
            try:
                save = int(self.m.target.image.address_of(SAVE_USER))
            except KsimError:
                self._user_unwinder = UserUnwinder(
                    None, f"this kernel has no {SAVE_USER} (Linux's walk of a task's user "
                    "frames, kernel/stacktrace.c, built with CONFIG_USER_STACKTRACE_SUPPORT)",
                    slot)
                return self._user_unwinder
            self.m.allow_calls(save)
            self._user_unwinder = UserUnwinder(save, "", slot)
        return self._user_unwinder

    def path_call(self) -> PathCall | None:
        """What path() calls on this kernel: its d_path, which snippets may then call;
        None when the program calls no path() or the kernel has no d_path."""
        if self._path_call is not False:
            return self._path_call  # type: ignore[return-value]
        self._path_call = None
        if _calls(self.program, "path"):
            try:
                address = int(self.m.find_function("d_path").address)
            except KsimError:
                return None
            self.m.allow_calls(address)
            self._path_call = PathCall(address, self.m.arch.stack.slot_bytes)
        return self._path_call

    def symbol(self, address: int) -> str:
        """``function+offset`` of a kernel address, as bpftrace prints a stack's frame."""
        f = self.m.target.image.function_at(address)
        if f is None:
            return f"0x{address:x}"
        return f"{f.name}+{address - f.address}"

    def lookup(self, name: str) -> int:
        """A kernel symbol's address (kaddr, jiffies)."""
        try:
            return int(self.m.target.image.address_of(name))
        except KsimError as exc:
            raise TraceSemanticError(f"the kernel has no symbol {name!r}: {exc}") from None

    def analysis_strlen(self) -> int:
        return int(self.program.config.get("max_strlen", 64))

    def name_index(self, name: str) -> int:
        """The index of ``name`` in the program's table of names (a dict: a kprobe on
        every function of a kernel names tens of thousands)."""
        at = self._name_at.get(name)
        if at is None:
            at = self._name_at[name] = len(self.names)
            self.names.append(name)
        return at

    def table(self, name: str) -> Table:
        return self.tables[name]

    def placed_record(self, lay: MapLayout, key: tuple[int, ...]) -> tuple[str, int] | None:
        """Where constant ``key`` is: ("record", r) or ("direct", n) (None: searched for)."""
        name = lay.type.name
        if key in self.placed[name]:
            return "record", self.placed[name][key]
        if key in self.direct[name]:
            return "direct", self.direct[name][key]
        return None

    def uses(self) -> dict[str, MapUse]:
        """What each keyed map's accesses key it by, over every point the probes were
        resolved to: the constant keys (``func`` and ``probe`` of each point, integer
        literals) and whether some key is computed."""
        out = {name: MapUse() for name, mtype in self.analysis.maps.items() if mtype.keys}
        sites: dict[int, list[Site]] = {}
        for at in self.attached.values():
            for probe in at.probes:
                sites.setdefault(id(probe), []).append(at.site)
        for probe in self.program.probes:
            kernel = not any(ap.provider in t.CLIENT_PROVIDERS for ap in probe.points)
            for ref in map_refs(probe):
                use = out[ref.name]
                for site in sites.get(id(probe), []) if kernel else [None]:
                    key = tuple(constant_key(k, site, self.name_index) for k in ref.keys)
                    if None in key:  # computed at every point alike
                        use.computed = True
                        use.kernel_computed |= kernel
                        break
                    use.consts[key] = None  # type: ignore[index]
        return out

    def allocate(self) -> None:
        """The stop flag, the event ring and every map, each map sized by what keys it
        (ksim.trace.maps.size_map); constant keys get their records."""
        if self.analysis.exits:
            self.stop = self.m.malloc(8)
        if "elapsed" in self.program.source:
            self.start = self.m.malloc(8)
        if _uses_rand(self.program):
            try:
                self.rand_call = int(self.m.find_function("get_random_u32").address)
                self.m.allow_calls(self.rand_call)
            except KsimError:
                # no such function (the toy kernel): a generator in the snippet
                self.rand_state = self.m.malloc(8)
        if self.analysis.formats:
            pages = self.program.config.get("perf_rb_pages")
            # bpftrace's perf_rb_pages sizes its event buffers: ksim's one ring
            limit = max(4096, int(pages) * 4096) if isinstance(pages, int) else RING_BYTES
            while True:
                try:     # as large as the heap allows, down to 64 records
                    self.ring = allocate_ring(self.m.alloc_data, self.analysis.formats, limit)
                    break
                except OutOfMemory:
                    if limit <= 4096:
                        raise
                    limit //= 2
            self.drain = Drain(self.ring, self.m.copy_from_kernel, self.m.copy_to_kernel, self.names)
        uses = self.uses()
        sizings = {name: size_map(use, self.max_map_keys) for name, use in uses.items()}
        while True:
            try:
                self._allocate_maps(sizings)
                break
            except OutOfMemory as exc:
                # the heap is short: a map sized by default (4,096 keys, as bpftrace)
                # holds half as many, the largest first; a size the program set stays
                smaller = {name: (layout_size(self.analysis.maps[name], s), s2)
                           for name, s in sizings.items() if (s2 := shrink(uses[name], s))}
                if not smaller:
                    sizes = ", ".join(f"{name} {layout_size(mtype, sizings.get(name, Sizing(1, 0, 1)))} "
                                      "bytes" for name, mtype in sorted(self.analysis.maps.items()))
                    raise OutOfMemory(f"the data heap has no room for the maps ({sizes}): "
                                      f"{exc}") from None
                name = max(smaller, key=lambda n: smaller[n][0])
                sizings[name] = smaller[name][1]
        for name, lay in self.layouts.items():
            if not lay.keyed:
                continue
            consts = uses[name].consts if lay.sizing.place else {}
            placed, image = place(lay, consts)
            self.placed[name] = placed
            self.direct[name] = {key: n for n, key in enumerate(uses[name].consts)} \
                if lay.direct else {}
            if any(image):
                self.m.copy_to_kernel(lay.base, image)
            # a map the kernel never searches is indexed by the client alone
            self.tables[name] = Table(lay, self._map_read, self._map_write,
                                      placed if not lay.slots else None, self.direct[name])

    def _allocate_maps(self, sizings: dict[str, Sizing]) -> None:
        """One block per map, all or none."""
        for lay in self.layouts.values():
            self.m.free(lay.base)
        self.layouts.clear()
        for name, mtype in sorted(self.analysis.maps.items()):
            lay = MapLayout(mtype, 0, sizings.get(name, Sizing(1, 0, 1)), self.names)
            lay.base = self.m.alloc_data(lay.size)
            self.layouts[name] = lay
            self.tables[name] = Table(lay, self._map_read, self._map_write)

    def _map_read(self, address: int, size: int) -> bytes:
        """A map's bytes, as they are now (once detached: as read last, see _still)."""
        if self._still is None:
            return self.m.copy_from_kernel(address, size)
        found = self._still.get((address, size))
        if found is None:
            found = self._still[address, size] = self.m.copy_from_kernel(address, size)
        return found

    def _map_write(self, address: int, data: bytes) -> None:
        if self._still is not None:
            self._still.clear()
        self.m.copy_to_kernel(address, data)

    def resolve(self) -> None:
        """The points every kprobe/kretprobe attach point names."""
        from .parser import TraceLimit

        failed: list[TraceError] = []
        # each probe's action compiled at each of its points: bounded, as bpftrace's
        # max_probes bounds its probes (the program's setting, if it gives one)
        limit, actions = int(self.program.config.get("max_probes") or MAX_PROBE_POINTS), 0
        for probe in self.program.probes:
            client = [ap.provider in t.CLIENT_PROVIDERS for ap in probe.points]
            if any(client) and not all(client):
                raise TraceUnsupported(
                    "a probe sharing one action between kernel probes and BEGIN, END or interval "
                    "is not supported", probe.points[client.index(True)].loc).located(
                        self.program.source, self.program.filename)
            for ap in probe.points:
                if ap.provider in t.CLIENT_PROVIDERS:
                    continue
                try:
                    found = self._points(ap)
                except KsimError as exc:
                    if isinstance(exc, TraceError):
                        if exc.loc is None:     # a provider's error: at its attach point
                            exc.loc = ap.loc
                        raise exc.located(self.program.source, self.program.filename) from None
                    # as bpftrace: an attach point that names nothing is skipped, and
                    # is an error only when no probe of the program attaches
                    failed.append(TraceSemanticError(str(exc), ap.loc))
                    self.skipped[ap.text] = str(exc)
                    if ap.wildcard:     # bpftrace counts a named function it misses
                        self._unmatched.add(ap.text)
                    continue
                for point, site in found:
                    self._probe_names.add(site.probe)
                    at = self.attached.setdefault((point.address, point.kind),
                                                  Attached(point, site))
                    if at.site.kind != site.kind:
                        raise TraceSemanticError(
                            f"{ap.text}: {point.address:#x} is both a {at.site.kind} and a "
                            f"{site.kind} point", ap.loc).located(self.program.source,
                                                                  self.program.filename)
                    if probe not in at.probes:
                        at.probes.append(probe)
                        actions += 1
                if actions > limit:
                    raise TraceLimit(f"the program's probes attach at more than {limit} points "
                                     "(each function or event an attach point names counts; "
                                     "max_probes)", ap.loc).located(self.program.source,
                                                                    self.program.filename)
        if not self.attached and any(ap.provider not in t.CLIENT_PROVIDERS
                                     for p in self.program.probes for ap in p.points):
            if failed:
                raise failed[0].located(self.program.source, self.program.filename)
            raise TraceSemanticError("no probe could be attached")

    def _points(self, ap: t.AttachPoint) -> list[tuple[Any, Site]]:

        image = self.m.target.image
        if ap.provider in (*t.FUNC_PROVIDERS, "tracepoint"):
            return self._typed_sites(ap)
        if ap.provider == "profile":
            return self._profile_sites(ap)
        if ap.provider == "rawtracepoint":
            return self._typed_sites(ap)
        if ap.provider == "kprobe":
            what = ap.func if ap.offset is None else f"{ap.func}+{ap.offset:#x}"
            out = []
            for point in self._entries(ap, what):
                func = image.function_at(point.address)
                kind = "entry" if point.kind is PointKind.ENTRY else "insn"
                name = func.name if func else hex(point.address)
                # ``probe`` names the probe a wildcard expanded to, as bpftrace's does:
                # kprobe:vfs_read, kprobe:vfs_read+5 (whatever the attach point said)
                at = "" if ap.offset is None else f"+{ap.offset}"
                out.append((point, Site(kind, name, f"kprobe:{name}{at}")))
            return out
        # kretprobe: every return of every matching function
        from ksim.commands.count import matching_functions

        funcs = matching_functions(image, ap.func)
        if not funcs:
            if ap.wildcard:
                raise UnknownSymbol(ap.func, [])
            funcs = [self.m.find_function(ap.func)]
        out = []
        for f in funcs:
            out += [(p, Site("exit", f.name, f"kretprobe:{f.name}"))
                    for p in self._returns(f, f.name)]
        if not out and not ap.wildcard:
            raise KsimError(f"kretprobe:{ap.func} cannot be spliced: {self.skipped.get(ap.func)}")
        return out

    def _entries(self, ap: t.AttachPoint, what: str) -> list[Any]:
        """The points ``what`` names for ``ap`` (resolve_points); a wildcard's entries
        are not planned here but by the batch, which skips those it refuses (attach)."""
        from ksim.commands.count import resolve_points

        points, skipped = resolve_points(self.m, what, self.splice, plan=not ap.wildcard)
        self.skipped.update(skipped)
        if ap.wildcard:
            self._deferred.update(p.address for p, _ in points)
        return [p for p, _ in points]

    def snippet(self, point: Any) -> ast.Node:
        at = self.attached[(point.address, point.kind)]
        parts = []
        for probe in at.probes:
            site = dataclasses.replace(at.site, address=point.address)
            compiler = ProbeCompiler(self.layouts, site, stop=self.stop,
                                     name_index=self.name_index, placed=self.placed_record,
                                     ring=self.ring, clock=self.clock, analysis=self.analysis,
                                     lookup=self.lookup, start=self.start,
                                     unwinder=self.unwinder() if "kstack" in self.program.source
                                     else None,
                                     user_unwinder=self.user_unwinder()
                                     if "ustack" in self.program.source else None,
                                     user_reads=self.m.target.abi.read_user_nofault is not None)
            compiler.rand_call, compiler.rand_state = self.rand_call, self.rand_state
            try:
                parts.append(compiler.compile(probe))
            except TraceError as exc:
                raise exc.located(self.program.source, self.program.filename) from None
        body = parts[0] if len(parts) == 1 else ast.Seq(tuple(parts))
        from ksim.commands.count import pid_filter

        return pid_filter(self.pid, body)

    @property
    def clock(self) -> int | None:
        """The kernel function ``nsecs`` calls (None: the cycle counter)."""
        return self.m.target.abi.clock_ns

    def attach(self) -> None:
        """Resolve the probes, allocate the maps (sized by the points found), compile
        and splice them in one batch; ``timings["attach_s"]`` is how long it took."""
        start = time.perf_counter()
        self._still = None
        SYMBOLIZE[:] = [self.symbol]        # kernel addresses in output: this kernel's
        USER_SYMBOLIZE[:] = [self.user_symbols.frame]   # user ones: the traced machine's files
        CGROUP_PATHS[:] = [self.traced.cgroup_path]
        SYSCALL_NAMES[:] = [syscall_namer(self.m.target.image, self.m.copy_from_kernel)]
        USERNAMES[:] = [username_namer(lambda path: self.traced.cat(path, MAX_FILE_READ))]
        if self.clock is not None:
            self.m.allow_calls(self.clock)
        user_reader = self.m.target.abi.read_user_nofault
        if user_reader is not None:
            self.m.allow_calls(user_reader)
        try:
            # the kernel is asked about the points' text once, for finding them and
            # for planning them
            with self.m.one_look():
                self.resolve()
                self.allocate()
                points = [a.point for a in self.attached.values()]
                snippets = {(a.point.address, a.point.kind): self.snippet(a.point)
                            for a in self.attached.values()}
                if self._events:
                    self.tracepoints.enable(self._events)
                # a batch names each address once: an entry and an exit point at one
                # address (a return hooked at the entry) go in batches of their own
                batches: list[list[Any]] = []
                taken: list[set[int]] = []      # each batch's addresses
                for p in points:
                    for batch, addresses in zip(batches, taken, strict=True):
                        if p.address not in addresses:
                            batch.append(p)
                            addresses.add(p.address)
                            break
                    else:
                        batches.append([p])
                        taken.append({p.address})
                for batch in batches:
                    refused: dict[int, str] = {}
                    self.handles += self.m.insert_many(
                        batch, lambda p: snippets[(p.address, p.kind)], splice=self.splice,
                        refused=refused if self._deferred else None)
                    self._skip_refused(batch, refused)
        except BaseException:
            # refused: nothing stays changed (splices of earlier batches, maps, ring)
            try:
                if self.handles:
                    self.m.remove_many(self.handles)
                    self.handles = []
                self.free()
            finally:
                self._release()
            raise
        self.timings["attach_s"] = time.perf_counter() - start

    def _skip_refused(self, batch: list[Any], refused: dict[int, str]) -> None:
        """Skip the points of ``batch`` the planner refused, each a wildcard's function
        (kept in ``skipped``, as bpftrace skips a function it cannot attach); a point
        named on its own that was refused fails the attach with its own error."""
        for p in batch:
            why = refused.get(p.address)
            if why is None:
                continue
            if p.address not in self._deferred:
                self.m.check_insert(p, self.splice)  # its own error, typed
                raise KsimError(why)
            at = self.attached.pop((p.address, p.kind))
            self.skipped[at.site.function] = why
        if refused:
            self._probe_names &= {a.site.probe for a in self.attached.values()}
        if not self.attached and not self.handles:
            raise TraceSemanticError("no probe could be attached: " + next(iter(refused.values())))

    def free(self) -> None:
        """Give the maps, the event ring and the flags back to the kernel's heap (after
        the maps were read: a session's output is made before)."""
        for lay in self.layouts.values():
            self.m.free(lay.base)
        self.layouts.clear()
        self._still = None
        if self.ring is not None:
            self.m.free(self.ring.header)
            self.m.free(self.ring.base)
            self.ring = None
        for var in (self.stop, self.start, self.rand_state):
            if var is not None:
                self.m.free(var)
        self.stop = self.start = self.rand_state = None

    def _release(self) -> None:
        """What attaching set up besides splices: enabled events, samplers' words."""
        if self.tracepoints is not None:
            self.tracepoints.disable()
        if self._samplers:
            from .profile import release

            for smp in self._samplers:
                release(self.m, smp)
            self._samplers = []

    def detach(self) -> None:
        start = time.perf_counter()
        try:
            if self.handles:
                self.m.remove_many(self.handles)
                self.handles = []
        finally:
            self._release()
        if not self.handles:
            self._still = {}
        self.timings["detach_s"] = time.perf_counter() - start

    def tactics(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.handles:
            tactic = self.m.patch_of(h).tactic
            out[tactic] = out.get(tactic, 0) + 1
        return out

    # --- running ----------------------------------------------------------------------------
    def progress(self) -> Callable[[], None] | None:
        """A progress callback that drains printf's events and ends the run once an
        action called exit()."""
        stop = self.stop
        if stop is None and self.drain is None and not self.intervals:
            return None

        def check() -> None:
            self.events()
            if stop is not None and self.m.read(stop):
                raise Exited()
            self.run_intervals()
            if self.exited:         # an interval action called exit()
                raise Exited()

        return check

    def run_intervals(self, now: int | None = None) -> None:
        """Run each interval probe whose period has passed since it last ran (once
        per call, however many periods went by), by the host's monotonic clock."""
        now = time.monotonic_ns() if now is None else now
        for i, (period, probe, name) in enumerate(self.intervals):
            due = self._next_interval[i]
            if due is None:
                self._next_interval[i] = now + period
            elif now >= due:
                self._next_interval[i] = now + period
                try:
                    Interpreter(self, name).run(probe)
                except TraceError as exc:
                    raise exc.located(self.program.source, self.program.filename) from None

    def emit(self, kind: str, text: str, data: Any) -> None:
        out = Output(kind, text, data)
        self.printed.append(out)
        if self.out is not None:
            self.out(out)

    def events(self) -> None:
        """Print the events printf published since the last call."""
        if self.drain is not None:
            for item in self.drain():
                if isinstance(item, str):
                    self.emit("printf", item, item)
                else:
                    self.act(item)

    def act(self, action: Action) -> None:
        """An event a kernel probe's action sent the client: print or clear a map as
        it is now, print a value, print a file of the traced machine (cat)."""
        if action.kind == "print":
            name, top, div = action.args
            self.print_map(name, top, div)
        elif action.kind == "clear":
            self.table(action.args[0]).clear()
        elif action.kind == "value":
            text, value = action.args
            self.emit("value", text, value)
        elif action.kind == "cat":
            text = self.traced.cat(action.args[0])
            self.emit("printf", text, text)

    def lost_events(self) -> int:
        return self.drain.lost() if self.drain is not None else 0

    def begin(self) -> None:
        self._special("BEGIN")

    def end(self) -> None:
        self.events()
        if self.lost_events():
            self.emit("lost_events", f"Lost {self.lost_events()} events\n", self.lost_events())
        if self.stop is not None and (flag := self.m.read(self.stop)):
            self.exited = True
            self.exit_code = (flag - 1) & 0xFF     # exit(code) stored code + 1
        self._special("END")
        for name in sorted(self.layouts):
            self.print_map(name)
        for lost in self.lost_keys():
            self.emit("lost_keys", lost_text(lost), lost)

    def probe_count(self) -> int:
        """The probes, counted as bpftrace's "Attaching N probes..." counts them before
        it attaches: every function or event a kernel attach point expanded to (a
        kretprobe's returns are one probe; two events of one class are two), every one
        skipped (bpftrace counts an attach point it then fails to attach, a function it
        names that is not there too) but not a wildcard that matches nothing, and every
        BEGIN, END and interval attach point."""
        return len(self._probe_names) + len(set(self.skipped) - self._unmatched) + sum(
            1 for p in self.program.probes for ap in p.points if ap.provider in t.CLIENT_PROVIDERS)

    def _special(self, which: str) -> None:
        for probe in self.program.probes:
            if any(ap.provider == which for ap in probe.points):
                try:
                    Interpreter(self, which).run(probe)
                except TraceError as exc:
                    raise exc.located(self.program.source, self.program.filename) from None

    # --- reading maps ----------------------------------------------------------------------------
    def print_map(self, name: str, top: int = 0, div: int = 1) -> None:
        """Print a map; ``top``: only its ``top`` largest entries; ``div``: its values
        divided by ``div`` (print(@m, top, div))."""
        lay = self.layouts[name]
        if lay.type.kind is None:
            return
        entries = self.table(name).entries()
        printer = MapPrinter(lay)
        if top > 0:
            entries = dict(printer.sorted(entries)[-top:])
        if div > 1 and not printer.hist and lay.type.kind in ("int", "count", "sum", "min",
                                                               "max", "avg"):
            entries = {k: [signed(w) // div & MASK for w in v] if lay.type.kind not in
                       ("min", "max", "avg") else v for k, v in entries.items()}
        text = printer.text(entries)
        if text:  # "hist" or "map", as bpftrace's JSON output names them
            self.emit("hist" if printer.hist else "map", text + "\n", {name: printer.json(entries)})

    def report(self, target: str, splice: str, tactics: dict[str, int], interrupted: bool,
               start: float) -> dict[str, Any]:
        """What ``ksim trace --json`` says of a run that ended (``start``: when the
        command began, by time.perf_counter)."""
        return {
            "target": target, "splice": splice,
            "probes": len(self.attached),
            "tactics": tactics,
            "maps": self.maps_json(),
            "lost": self.lost(),
            "lost_keys": self.lost_keys(),
            "printed": [data for kind, _, data in self.printed if kind == "value"],
            "printf": [data for kind, _, data in self.printed if kind == "printf"],
            "lost_events": self.lost_events(),
            "skipped": self.skipped,
            "exited": self.exited,
            "exit_code": self.exit_code,
            "interrupted": interrupted,
            "stats": {"probes": len(self.attached),
                      "attach_s": self.timings.get("attach_s", 0.0),
                      "detach_s": self.timings.get("detach_s", 0.0),
                      "end_to_end_s": time.perf_counter() - start},
        }

    def maps_json(self) -> dict[str, Any]:
        out = {}
        for name in sorted(self.layouts):
            lay = self.layouts[name]
            if lay.type.kind is not None:
                entries = self.table(name).entries()
                if entries:  # as bpftrace: an empty map is not printed
                    out[name] = MapPrinter(lay).json(entries)
        return out

    def lost(self) -> dict[str, int]:
        """Updates of each map that found no record for their key."""
        return {name: n for name in sorted(self.layouts) if (n := self.table(name).lost())}

    def lost_keys(self) -> list[dict[str, Any]]:
        """Each map that lost updates: how many, how many keys it holds, its
        max_map_keys, and whether it is full (else no free index slot was near)."""
        out = []
        for name, n in self.lost().items():
            lay = self.layouts[name]
            used = self.table(name).records_used()
            out.append({"map": name, "lost": n, "keys": used,
                        "max_map_keys": lay.sizing.max_map_keys, "full": used >= lay.capacity})
        return out

    def output(self) -> str:
        return "".join(text for _, text, _ in self.printed)


class _Break(Exception):
    """break, in an action the client runs."""


class _Continue(Exception):
    """continue, in an action the client runs."""


class _Return(Exception):
    """return, in an action the client runs."""


class Interpreter:
    """BEGIN, END and interval actions, run by the client over the maps in the kernel's
    heap."""

    def __init__(self, session: TraceSession, which: str) -> None:
        self.s = session
        self.which = which
        self.vars: dict[str, Any] = {}

    def run(self, probe: t.Probe) -> None:
        if probe.pred is not None and not self.expr(probe.pred):
            return
        try:
            self.block(probe.body)
        except _Return:
            pass

    def block(self, stmts: tuple[t.Stmt, ...]) -> None:
        for s in stmts:
            self.stmt(s)

    def loop(self, s: t.While) -> None:
        """At most as many passes as the kernel's probes make (parser.MAX_LOOP, or the
        loop's own bound): a loop still going then stops, as there."""
        from .parser import MAX_LOOP

        for _ in range(MAX_LOOP if s.bound is None else s.bound):
            if not self.expr(s.cond) or not self.loop_pass(s.body):
                return
            self.block(s.step)

    def for_map(self, s: t.ForMap) -> None:
        """The body once per entry of the map as it is now, ``$var`` its (key, value)."""
        for key, value in self.s.table(s.map.name).decoded():
            self.vars[s.var] = TupleValue((key, value))
            if not self.loop_pass(s.body):
                return

    def loop_pass(self, body: tuple[t.Stmt, ...]) -> bool:
        """One pass of a loop's body; False when it breaks out of the loop."""
        try:
            self.block(body)
        except _Break:
            return False
        except _Continue:
            pass
        return True

    def stmt(self, s: t.Stmt) -> None:
        if isinstance(s, t.While):
            self.loop(s)
        elif isinstance(s, t.ForMap):
            self.for_map(s)
        elif isinstance(s, t.Break):
            raise _Break()
        elif isinstance(s, t.Continue):
            raise _Continue()
        elif isinstance(s, t.Return):
            raise _Return()
        elif isinstance(s, t.If):
            self.block(s.then if self.expr(s.cond) else s.orelse)
        elif isinstance(s, t.Assign):
            if isinstance(s.target, t.Scratch):
                value = self.value(s.value)
                if s.op != "=":
                    old = self.vars.get(s.target.name, 0)
                    if isinstance(old, str) or isinstance(value, str):
                        raise TraceSemanticError("a string can only be assigned", s.loc)
                    value = self.binop(s.op[:-1], old, value, s.loc)
                self.vars[s.target.name] = value
            else:
                self.assign_map(s.target, s.op, s.value)
        elif isinstance(s, t.ExprStmt):
            e = s.expr
            if isinstance(e, t.Call) and e.name in STATEMENTS:
                self.call(e)
            else:
                self.expr(e)

    def call(self, e: t.Call) -> None:
        if e.name == "printf":
            assert isinstance(e.args[0], t.Str)
            words: list[int] = []
            kinds: list[str] = []
            for a in e.args[1:]:
                v = self.s.name_index(self.which) if isinstance(a, t.Builtin) \
                    and a.name in ("func", "probe") else self.value(a)
                if isinstance(v, str):
                    raw = v.encode()
                    n = -(-(len(raw) + 1) // 8) * 8
                    kinds.append(f"str:{n}")
                    words += text_words(v, n)
                else:
                    kinds.append("name" if isinstance(a, t.Builtin) and a.name in ("func", "probe")
                                 else "int")
                    words.append(v)
            text = render(e.args[0].value, words, self.s.names, kinds)
            self.s.emit("printf", text, text)
            return
        if e.name == "delete" and len(e.args) == 2 and isinstance(e.args[0], t.MapRef):
            keys = e.args[1].items if isinstance(e.args[1], t.Tuple) else (e.args[1],)
            ref = t.MapRef(e.args[0].loc, e.args[0].name, tuple(keys))
            self.s.table(ref.name).delete(self.keys(ref))
            return
        if e.name == "exit":
            self.s.exited = True
            self.s.exit_code = (self.expr(e.args[0]) & 0xFF) if e.args else 0
            if self.s.stop is not None:     # the kernel's probes stop updating at once
                self.s.m.write(self.s.stop, self.s.exit_code + 1)
            return
        if e.name == "time":
            fmt = e.args[0].value if e.args and isinstance(e.args[0], t.Str) else "%H:%M:%S\n"
            text = time.strftime(fmt)
            self.s.emit("time", text, text)
            return
        if e.name == "print" and e.args and not isinstance(e.args[0], t.MapRef):
            value = self.value(e.args[0])
            self.s.emit("value", f"{value}\n", value)
            return
        if e.name == "zero":
            e = t.Call(e.loc, "clear", e.args, e.name_loc)
        first = e.args[0]
        assert isinstance(first, t.MapRef)
        ref = first
        if e.name == "print":
            extra = [self.expr(x) for x in e.args[1:3]]
            self.s.print_map(ref.name, *extra)
        elif e.name == "clear":
            self.s.table(ref.name).clear()
        else:
            self.s.table(ref.name).delete(self.keys(ref))

    def keys(self, ref: t.MapRef) -> tuple[int, ...]:
        kinds = self.s.analysis.maps[ref.name].keys or ()
        items = [x for k in ref.keys for x in (k.items if isinstance(k, t.Tuple) else (k,))]
        out: list[int] = []
        for k, kind in zip(items, kinds, strict=False):
            out += self.words(self.value(k), kind)
        return tuple(out)

    def words(self, v: Any, kind: str) -> list[int]:
        """``v`` held as ``kind``: a string's bytes in words, a tuple's items' words,
        or one word."""
        if isinstance(v, tuple) and kind.startswith(TUPLE):
            items = tuple_items(kind)
            if len(v) != len(items):
                raise TraceSemanticError(f"a tuple of {len(items)} items is held here")
            return [w for x, k in zip(v, items, strict=True) for w in self.words(x, k)]
        if isinstance(v, str):
            if kind != "comm" and not kind.startswith("str:"):
                raise TraceSemanticError(f"a string where a value of kind {kind} is held")
            return text_words(v, width(kind) * 8)
        return [v & MASK]

    def value(self, e: t.Expr) -> Any:
        """An integer, or a string's text (or what a value prints as: a tuple, a name)."""
        if isinstance(e, t.Str):
            return e.value
        if isinstance(e, t.Tuple):
            return TupleValue(self.value(x) for x in e.items)
        if isinstance(e, t.Scratch) and isinstance(self.vars.get(e.name), tuple | str):
            return self.vars[e.name]
        if isinstance(e, t.Field) and isinstance(whole := self.value(e.operand), tuple):
            if not e.name.isdigit() or int(e.name) >= len(whole):
                raise TraceSemanticError(f"a tuple's items are .0 to .{len(whole) - 1}, not "
                                         f".{e.name}", e.loc)
            return whole[int(e.name)]
        if isinstance(e, t.Call) and e.name in ("strerror", "syscall_name") and e.args:
            return decode(ERRNO if e.name == "strerror" else SYSCALL, [self.expr(e.args[0])],
                          self.s.names)
        if isinstance(e, t.MapRef):
            lay = self.s.table(e.name).layout
            if is_named(lay.type.kind):
                table = self.s.table(e.name)
                slot = table.find(self.keys(e), claim=False)
                if slot is None or not table.get(slot, lay.present):
                    return 0
                return decode(lay.type.kind or "", [table.get(slot, lay.value0 + i)
                                                    for i in range(lay.type.value_words)],
                              self.s.names)
            if is_text(lay.type.kind):
                table = self.s.table(e.name)
                slot = table.find(self.keys(e), claim=False)
                if slot is None or not table.get(slot, lay.present):
                    return ""
                return str(decode(lay.type.kind or "", [table.get(slot, lay.value0 + i)
                                                        for i in range(lay.type.value_words)],
                                  self.s.names))
        if isinstance(e, t.Ternary):
            return self.value(e.then) if self.expr(e.cond) else self.value(e.orelse)
        if isinstance(e, t.Call) and e.name == "str" and e.args:
            # at most max_strlen, as the kernel's probes read it (not a read of n bytes)
            limit = self.s.analysis.strlen
            if len(e.args) > 1:
                limit = min(self.expr(e.args[1]), limit)
            v = self.value(e.args[0])
            if isinstance(v, str):
                return v[:max(0, limit - 1)]
            try:        # a kernel address: its string, as the kernel's probes read it
                raw = self.s.m.copy_from_kernel(v, max(1, limit))
            except KsimError:
                return ""
            return raw.split(b"\0", 1)[0][:max(0, limit - 1)].decode("utf-8", "replace")
        return self.expr(e)

    def assign_map(self, ref: t.MapRef, op: str, value: t.Expr) -> None:
        table = self.s.table(ref.name)
        lay = table.layout
        kind = lay.type.kind
        slot = table.find(self.keys(ref), claim=True)
        if slot is None:       # no record left: lost, as the kernel's updates are
            table.count_lost()
            return
        if kind is not None and (width(kind) > 1 or is_text(kind)) and op == "=":
            table.put(slot, lay.present, 1)
            for i, w in enumerate(self.words(self.value(value), kind)):
                table.put(slot, lay.value0 + i, w)
            return
        arg = 0
        if isinstance(value, t.Call) and value.name in ("count", "sum", "min", "max", "avg",
                                                         "hist", "lhist") and op == "=":
            arg = self.expr(value.args[0]) if value.args else 0
        else:
            arg = self.expr(value)
        table.put(slot, lay.present, 1)
        w = lay.value0
        old = table.get(slot, w)
        if kind == "count":
            table.put(slot, w, old + 1)
        elif kind == "sum":
            table.put(slot, w, old + arg)
        elif kind == "avg":
            table.put(slot, w, old + arg)
            table.put(slot, w + 1, table.get(slot, w + 1) + 1)
        elif kind in ("min", "max"):
            table.put(slot, w, max(old, encode_extreme(kind, arg)))
        elif kind in ("hist", "lhist"):
            b = w + bucket(lay, arg)
            table.put(slot, b, table.get(slot, b) + 1)
        elif op == "=":
            table.put(slot, w, arg)
        else:
            table.put(slot, w, self.binop(op[:-1], signed(old), arg, ref.loc))

    def expr(self, e: t.Expr) -> int:
        if isinstance(e, t.Int):
            return e.value
        if isinstance(e, t.Builtin):
            if e.name == "nsecs":
                return time.monotonic_ns()
            if e.name in ("pid", "tid", "cpu"):
                return 0
            raise TraceSemanticError(f"The {e.name} builtin has no value in BEGIN, END or "
                                     "interval", e.loc)
        if isinstance(e, t.Scratch):
            if e.name not in self.vars:
                raise TraceSemanticError(f"Undefined or undeclared variable: ${e.name}", e.loc)
            v = self.vars[e.name]
            if isinstance(v, str):
                raise TraceSemanticError(f"${e.name} holds a string, not an integer", e.loc)
            return v
        if isinstance(e, t.Cast):
            v = self.expr(e.operand)
            ct = self.s.types.named(e.type, e.loc)
            if ct.kind == "int" and ct.size < 8:
                v &= (1 << (8 * ct.size)) - 1
                if ct.signed and v >> (8 * ct.size - 1):
                    v -= 1 << (8 * ct.size)
            return v
        if isinstance(e, t.SizeOf) and e.type is not None:
            return self.s.types.named(e.type, e.loc).size
        if isinstance(e, t.Call) and e.name == "has_key" and e.args \
                and isinstance(e.args[0], t.MapRef):
            ref = t.MapRef(e.args[0].loc, e.args[0].name, tuple(e.args[1:]))
            table = self.s.table(ref.name)
            slot = table.find(self.keys(ref), claim=False)
            return int(slot is not None and bool(table.get(slot, table.layout.present)))
        if isinstance(e, t.MapRef):
            table = self.s.table(e.name)
            lay = table.layout
            if lay.type.kind in ("hist", "lhist"):
                raise TraceSemanticError(f"{e.name} holds a {lay.type.kind}, which has no "
                                         "integer value", e.loc)
            slot = table.find(self.keys(e), claim=False)
            if slot is None or not table.get(slot, lay.present):
                return 0
            return scalar(lay.type.kind, [table.get(slot, lay.value0 + i)
                                          for i in range(lay.type.value_words)])
        if isinstance(e, t.Binary):
            left = self.expr(e.left)
            if e.op == "&&":
                return int(bool(left) and bool(self.expr(e.right)))
            if e.op == "||":
                return int(bool(left) or bool(self.expr(e.right)))
            return self.binop(e.op, left, self.expr(e.right), e.loc)
        if isinstance(e, t.Unary):
            v = self.expr(e.operand)
            return {"!": int(not v), "~": signed(~v), "-": signed(-v), "+": v}[e.op]
        if isinstance(e, t.Ternary):
            return self.expr(e.then) if self.expr(e.cond) else self.expr(e.orelse)
        if isinstance(e, t.Call) and e.name == "len" and e.args \
                and isinstance(e.args[0], t.MapRef):
            return len(self.s.table(e.args[0].name).decoded())
        if isinstance(e, t.Call) and e.name == "strcontains" and len(e.args) == 2:
            hay, needle = self.value(e.args[0]), self.value(e.args[1])
            return int(isinstance(hay, str) and isinstance(needle, str) and needle in hay)
        if isinstance(e, t.Field):
            v = self.value(e)
            if isinstance(v, int):
                return v
            raise TraceSemanticError("this expression has no integer value", e.loc)
        if isinstance(e, t.Call) and e.name == "ksym" and len(e.args) == 1:
            return self.expr(e.args[0])             # held as the address, printed by name
        if isinstance(e, t.Call) and e.name == "kaddr" and len(e.args) == 1 \
                and isinstance(e.args[0], t.Str):
            return self.s.lookup(e.args[0].value)
        if isinstance(e, t.Deref):
            # a kernel address's 8 bytes, as the kernel's probes read them
            address = self.expr(e.operand) & MASK
            return signed(int.from_bytes(self.s.m.copy_from_kernel(address, 8), "little"))
        raise TraceSemanticError("this expression has no integer value", e.loc)

    def binop(self, op: str, a: int, b: int, loc: Any) -> int:
        """The snippets' semantics (ksim.snippets.ast), in Python."""
        a, b = signed(a), signed(b)
        if op in COMPARES:
            return int({"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b,
                        ">=": a >= b}[op])
        assert op in BINOPS
        if op in ("/", "%"):
            if b == 0:
                return -1 if op == "/" else a
            q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
            return signed(q if op == "/" else a - q * b)
        if op in ("<<", ">>"):
            return signed(a << (b & 63)) if op == "<<" else a >> (b & 63)
        return signed({"+": a + b, "-": a - b, "*": a * b, "&": a & b, "|": a | b,
                       "^": a ^ b}[op])


def _refuse_cgroup_path(program: t.Program, target: Any) -> None:
    """cgroup_path() on an emulated kernel: refused, where the program calls it."""
    from .parser import _children

    stack: list[Any] = [x for p in program.probes for x in (*p.body, p.pred) if x is not None]
    while stack:
        node = stack.pop()
        if isinstance(node, t.Call) and node.name == "cgroup_path":
            raise TraceUnsupported(f"cgroup_path() names a cgroup of the traced machine: "
                                   f"{target.name} is an emulated kernel without cgroups (it "
                                   "runs on live:// targets)", node.name_loc or node.loc)
        stack += _children(node)


def _calls(program: t.Program, name: str) -> bool:
    """Whether some probe's filter or action calls function ``name``."""
    from .parser import _children

    stack: list[Any] = [x for p in program.probes for x in (*p.body, p.pred) if x is not None]
    while stack:
        node = stack.pop()
        if isinstance(node, t.Call) and node.name == name:
            return True
        stack += _children(node)
    return False


def _uses_rand(program: t.Program) -> bool:
    """Whether a kernel probe's action reads rand."""
    from .parser import _children

    for probe in program.probes:
        if all(ap.provider in t.CLIENT_PROVIDERS for ap in probe.points):
            continue
        stack: list[Any] = [*probe.body, *([probe.pred] if probe.pred is not None else [])]
        while stack:
            node = stack.pop()
            if isinstance(node, t.Builtin) and node.name == "rand":
                return True
            stack += _children(node)
    return False


def text_words(text: str, size: int) -> list[int]:
    """A string's bytes (cut to ``size`` - 1, NUL padded to ``size``) as words."""
    raw = text.encode()[:size - 1].ljust(size, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, size, 8)]


def lost_text(lost: dict[str, Any]) -> str:
    """The warning for a map that lost updates (one of ``lost_keys()``)."""
    head = f"WARNING: {lost['map']}: {lost['lost']} update{'s' if lost['lost'] != 1 else ''} lost: "
    if lost["full"]:
        return head + f"the map is full (max_map_keys={lost['max_map_keys']})\n"
    return head + (f"no free index slot within {PROBES} of their keys' hash (the map holds "
                   f"{lost['keys']} of max_map_keys={lost['max_map_keys']})\n")


def bucket(lay: MapLayout, v: int) -> int:
    """The histogram bucket of ``v`` (what the snippet computes)."""
    v = signed(v)
    if lay.type.kind == "lhist":
        assert lay.type.lhist is not None
        lo, hi, step = lay.type.lhist
        if v < lo:
            return 0
        if v > hi:
            return 1 + (hi - lo) // step
        return 1 + (v - lo) // step
    if v < 0:
        return 0
    if v == 0:
        return 1
    return 2 + v.bit_length() - 1


__all__ = ["Exited", "Interpreter", "Output", "TraceSession", "bucket", "lost_text"]
