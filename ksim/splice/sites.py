"""Facts about splice sites, taken from the analysis, in the form the planner wants.

This is the only place that knows both the analysis (CFG, liveness) and the
planner's inputs (FunctionCode, padding slots, the blacklist), so neither has to
know the other.

It is also the one answer to "may this instruction be touched": every
instruction of a function gets its hazards (``ksim.splice.hazards``) from the
kernel image's own tables (``__bug_table``, ``__ex_table``, ``__mcount_loc``,
``__jump_table``, ``.static_call_sites``, ``_kprobe_blacklist``), from ksim's
blacklist, and, when the target can answer, from the kernel itself (a live
kernel knows its modules, its dynamic ftrace state and its registered kprobes).
The planner refuses on them; can_insert, insert_snippet, probes, replacements
and the command line all plan through here, so they all give the same verdict.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cached_property, lru_cache

from ksim.analysis.abi import support_for
from ksim.analysis.callgraph import call_graph
from ksim.analysis.cfg import EdgeKind
from ksim.analysis.clobbers import own_writes
from ksim.analysis.function import FunctionAnalysis, analyze, classify_target, standard_indirect
from ksim.analysis.liveness import Target
from ksim.analysis.points import Point, PointKind, is_padding
from ksim.analysis.record import TAIL_KEPT, Instructions, RecordView, view
from ksim.analysis.store import HEAD_LIVE, Store, store_for
from ksim.arch.base import Arch, Flow, Insn
from ksim.errors import KsimError, OutsideText
from ksim.image.image import merge_ranges
from ksim.image.model import Function
from ksim.splice import hazards as hz
from ksim.splice.planner import FunctionCode, SpliceRequest, check_point

#: code ksim must never splice, as (start symbol, end symbol) pairs: the Linux
#: sections kprobes refuses (kernel/kprobes.c: within_kprobe_blacklist and the
#: noinstr/entry sections), and the toy kernel's own trap path and boot code.
BLACKLIST_RANGES = (
    ("__kprobes_text_start", "__kprobes_text_end"),
    ("__noinstr_text_start", "__noinstr_text_end"),
    ("__entry_text_start", "__entry_text_end"),
    ("__irqentry_text_start", "__irqentry_text_end"),
    ("__ksim_noinstr_start", "__ksim_noinstr_end"),
    # ftrace's own trampolines (arch/x86/kernel/ftrace_64.S): the kernel rewrites the
    # calls inside them (ftrace_call, ftrace_regs_call, ftrace_graph_call) whenever a
    # tracer or an ftrace-based kprobe comes or goes, so a splice there goes stale
    ("ftrace_caller", "ftrace_caller_end"),
    ("ftrace_regs_caller", "ftrace_regs_caller_end"),
)
#: single functions on the trap path (an int3 there would recurse)
BLACKLIST_FUNCTIONS = (
    "do_int3", "exc_int3", "notify_die", "atomic_notifier_call_chain", "poke_int3_handler",
    "kprobe_int3_handler", "ksim_halt",
    # Linux's int3 path out of line and outside every blacklist: notify_die's notifier
    # chain takes rcu_read_lock(), a call under CONFIG_PREEMPT_RCU; an int3 there (a
    # trap route, or a poke's temporary int3) traps again before any notifier can
    # route it, until the NMI count overflows (kmod/kerninst.c: ki_trap_path)
    "__rcu_read_lock", "__rcu_read_unlock", "rcu_read_unlock_special",
    "__rcu_irq_enter_check_tick",
    # a die notifier with kerninst's priority, registered before it, so called first
    # on every int3 (a live kernel's module finds every such notifier: ki_die_ahead)
    "hw_breakpoint_exceptions_notify",
    # the rest of ftrace's trampoline code, which the kernel patches or copies into
    # the trampolines it makes (the labels of ftrace_64.S that kallsyms lists apart)
    "ftrace_call", "ftrace_regs_call", "ftrace_graph_call", "ftrace_caller_op_ptr",
    "ftrace_regs_caller_op_ptr", "ftrace_regs_caller_jmp", "ftrace_epilogue", "ftrace_stub",
    "ftrace_stub_graph", "return_to_handler",
    # the toy kernel's entry, trap and interrupt paths (images/toy/arch/x86/entry.S):
    # an int3 in its own int3 handler recurses, and a jump there runs on an
    # interrupt frame the patch knows nothing of
    "ksim_entry64", "pvh_start32", "ksim_int3_entry", "ksim_unknown_trap", "timer_interrupt",
    "spurious_interrupt", "exception_stubs", "exception_common", "__switch_to_asm",
    "ret_from_fork",
)

#: asks a running kernel about text ranges (address, length): the hazard names of each
HazardQuery = Callable[[Sequence[tuple[int, int]]], list[frozenset[str]]]
#: the same question sent now, its answers given when the returned function is called
#: (Target.ask_hazards: the kernel answers while the client goes on)
LaterHazardQuery = Callable[[Sequence[tuple[int, int]]], Callable[[], list[frozenset[str]]]]

#: bytes of a function's start whose instructions a batch asks the kernel about ahead
#: (asking_ahead): those an entry point's window starts in -- past an endbr64 and a
#: 5-byte ftrace location (arm64: two instructions), the instructions a jump's bytes
#: displace.  An instruction starting further in is asked about, with the rest of
#: its function, when a point needs it
HEAD = 24
#: functions a batch's questions go in together (asking_ahead): the client analyses one
#: chunk's functions while the kernel answers for the next ones
AHEAD_CHUNK = 512
#: record views kept (_view): a point's liveness and its function's FunctionCode are
#: kept apart, so a view is needed only while its function is first looked at
VIEWS = 4096


class SiteFacts:
    """Site facts for one image.  Functions are resolved by address wherever a
    point is given: kernels have several static functions of the same name."""

    def __init__(self, image, arch: Arch, *, ask: HazardQuery | None = None,
                 ask_later: LaterHazardQuery | None = None,
                 trap_setup: str | None = None) -> None:
        # image: ksim.image.Image; ask: the target's own answer (a live kernel), if any,
        # and ask_later the same question answered later (else ask's, at once);
        # trap_setup: the function that installs the kernel's trap dispatch, when a
        # trap cannot be routed until it has run (Capabilities.trap_setup)
        self.image = image
        self.arch = arch
        self._ask = ask
        self._ask_later = ask_later if ask_later is not None or ask is None else _at_once(ask)
        self._trap_setup = trap_setup
        self._ahead: dict[tuple[int, int], frozenset[str]] | None = None  # see asking_ahead
        #: questions of asking_ahead not answered yet, in the order they were sent:
        #: (sequence number, ranges, their answers when called); and each range's
        #: question by its sequence number
        self._due: deque[tuple[int, list[tuple[int, int]], Callable[[], list[frozenset[str]]]]] \
            = deque()
        self._due_at: dict[tuple[int, int], int] = {}
        self._sent = 0
        #: the functions the answers in _ahead are about (and whose text is read ahead)
        self._looked: set[int] = set()
        self._starts = [f.address for f in image.functions]
        #: registers live at each point asked about (a few bytes each, kept for every
        #: point, unlike the analyses they come from; see live_at)
        self._live: dict[int, frozenset[str]] = {}
        #: functions seen through their records (_view), the most recently used
        self._views: OrderedDict[int, RecordView | None] = OrderedDict()
        self._targets: dict[int, Target] = {}
        #: the functions whose reach a batch has had checked (_checked_ahead)
        self._reached: set[int] = set()
        # memos of this SiteFacts alone (an lru_cache on the methods would be the
        # class's, and would keep every SiteFacts and its image alive after detach)
        self._function_code = lru_cache(maxsize=1 << 16)(self._code_of)
        self._extent = lru_cache(maxsize=1 << 16)(self._extent_of)

    def function_of(self, what: Function | Point | str) -> Function:
        if isinstance(what, Function):
            return what
        if isinstance(what, Point):
            func = self.image.function_at(what.address)
            if func is None:
                raise OutsideText(f"{what.address:#x} is not inside a known function")
            return func
        return self.image.function(what)

    # --- analysis -------------------------------------------------------------------
    def analysis(self, what: Function | Point | str) -> FunctionAnalysis:
        return analyze(self.image, self.function_of(what))

    def entry(self, func: Function) -> Point:
        """The function's entry point.  When the function starts with an ftrace
        location (x86-64: the 5-byte ``call __fentry__`` / nop the kernel rewrites
        when tracing starts; arm64: its two patchable-entry instructions, ``mov x9,
        x30`` and the nop ftrace makes a ``bl``), the entry point is the instruction
        after it: it runs exactly as often, with the same arguments, and ftrace keeps
        its bytes -- also while a tracer (a kprobe, bpftrace) uses that location,
        even one whose breakpoint sits in it now (arm64: a kprobe at +0 is a BRK over
        ``mov x9, x30``)."""
        address = func.address if self._view(func) is not None else self.analysis(func).points.entry
        code = self.function_code(func)
        for insn in code.insns:
            if insn.address != address or "ftrace" not in code.hazards.get(address, ()) \
                    or (insn.flow not in (Flow.SEQ, Flow.CALL) and not self.arch.is_breakpoint(insn)) \
                    or insn.end >= code.end:
                break
            address = insn.end
        return Point(address, PointKind.ENTRY, func.name)

    def points(self, func: Function, kind: PointKind) -> list[Point]:
        """The function's exits, block starts or call sites.  An ftrace location is
        no point (the kernel owns it): the entry block starts after the fentry call,
        which is no call site (the running kernel has a nop or ftrace's call there)."""
        p = self.analysis(func).points
        addresses = list({PointKind.EXIT: p.exits, PointKind.BLOCK: p.blocks,
                          PointKind.CALLSITE: p.callsites}[kind])
        ftrace = {a for a, names in self.function_code(func).hazards.items() if "ftrace" in names}
        if ftrace:
            entry = self.entry(func).address
            addresses = sorted({entry if a == p.entry else a for a in addresses} - ftrace) \
                if kind is PointKind.BLOCK else [a for a in addresses if a not in ftrace]
        return [Point(a, kind, func.name) for a in addresses]

    def point_at(self, address: int) -> Point:
        func = self.image.function_at(address)
        if func is None:
            raise OutsideText(f"{address:#x} is not inside a known function")
        fa = self.analysis(func)
        fa.insn_at(address)  # NotOnBoundary if it is not an instruction start
        p = fa.points
        kind = (PointKind.ENTRY if address in (p.entry, self.entry(func).address) else PointKind.EXIT if address in p.exits
                else PointKind.CALLSITE if address in p.callsites
                else PointKind.BLOCK if address in p.blocks else PointKind.INSN)
        return Point(address, kind, func.name)

    def live_at(self, point: Point) -> frozenset[str]:
        """Registers live at ``point``.  Kept per point, as the planner's view of each
        function (function_code) is kept for up to 65,536 functions, while the
        analyses they come from are kept for CACHE_FUNCTIONS only: a batch planned
        after a pass over every function of a kernel analyses none of them again."""
        live = self._live.get(point.address)
        if live is None:
            func = self.function_of(point)
            # a function's first instructions (entry points): as a batch learnt them,
            # while the function and everything it reaches are as they were then (its
            # record current: the point is one of its instructions' starts) -- without
            # a view of it, which a batch of more functions than VIEWS made when it
            # found its entries, and would make again
            kept = store_for(self.image, build_missing=False)
            if kept is not None and not self.image.freed(func.address):
                live = kept.head_live(self.image, func, point.address)
            if live is None:
                live = self._live_seen(func, point, kept)
            self._live[point.address] = live
        return live

    def _live_seen(self, func: Function, point: Point, kept: Store | None) -> frozenset[str]:
        """live_at's answer from the function's record view (what is live before a
        head instruction is learnt for the store), else from its analysis."""
        seen = self._view(func)
        if seen is None or not seen.is_boundary(point.address):
            return self.analysis(point).live_at(point.address)
        head = seen.addresses[:HEAD_LIVE]
        if kept is None or point.address not in head:
            return seen.live_before(point.address)
        found = seen.live_head(len(head))
        kept.learn_head(self.image, func, found)
        return found[head.index(point.address)]

    def _classify(self, target: int) -> Target:
        """What a call or jump to ``target`` reaches (analysis.function.classify_target),
        asked once per target for every function viewed: most calls go to a few
        hundred functions."""
        found = self._targets.get(target)
        if found is None:
            found = self._targets[target] = classify_target(self.image, support_for(self.image.arch),
                                                            target)
        return found

    def _view(self, func: Function) -> RecordView | None:
        """The function seen through its record in the analysis store, current with
        the bytes it is read from now (ksim.analysis.record: what a batch of entry
        points asks, without an object per instruction); None when the store has no
        current record of it, or it needs the objects (then ``analysis`` answers)."""
        if func.address in self._views:
            self._views.move_to_end(func.address)
            return self._views[func.address]
        kept = store_for(self.image, build_missing=False)
        comp = kept.get(func) if kept is not None else None
        found = None
        if comp is not None:
            support = support_for(self.image.arch)
            image = self.image
            # what its own instructions write: its current record's (clobbers.summary
            # would check the record current once more), freed text's the summary's
            own = own_writes(image, support, func) if image.freed(func.address) else comp.own_writes
            found = view(support, image.read(func.address, func.size), comp, self._classify,
                         lambda insn: standard_indirect(image, support, insn),
                         support.convention.caller_saved - own)
        self._views[func.address] = found
        if len(self._views) > VIEWS:
            self._views.popitem(last=False)
        return found

    # --- what the planner needs -------------------------------------------------------
    def function_code(self, what: Function | Point | str) -> FunctionCode:
        return self._function_code(self.function_of(what))

    def _code_of(self, func: Function) -> FunctionCode:
        """The function's code for the planner.  Trailing alignment filler that no
        path reaches (int3/nop blocks, which kallsyms-derived extents include) is
        not code: it becomes the ``tail`` a window may spill over, together with
        the filler between this function and the next."""
        code_end, tail = self._extent(func)
        seen = self._view(func)
        if seen is not None:
            lazy = seen.insns.upto(code_end)
            return FunctionCode(
                name=func.name, start=func.address, end=code_end, insns=lazy,
                branch_targets=seen.branch_targets(), unknown_indirect=seen.misaligned(),
                tail=tail, hazards=self.hazards(lazy), addresses=lazy.addresses)
        cfg = self.analysis(func).cfg
        targets = {func.address}
        targets |= {e.dst for e in cfg.edges if e.kind is not EdgeKind.FALLTHROUGH}
        targets |= {i.target for i in cfg.insns
                    if i.flow in (Flow.JMP, Flow.JCC) and i.target is not None}
        for table in cfg.tables.values():
            targets |= set(table.entries)
        insns = tuple(i for i in cfg.insns if i.address < code_end)
        return FunctionCode(
            name=func.name, start=func.address, end=code_end,
            insns=insns,
            branch_targets=frozenset(targets),
            unknown_indirect=bool(cfg.unresolved) or bool(cfg.misaligned),
            tail=tail,
            hazards=self.hazards(insns),
        )

    def _extent_of(self, func: Function) -> tuple[int, bytes]:
        """Where the function's code ends, and the filler after it (its trailing
        unreachable int3/nop blocks and the filler up to the next function): what a
        neighbour's padding slots need, without the rest of its FunctionCode."""
        seen = self._view(func)
        if seen is not None:
            kept = store_for(self.image, build_missing=False)
            code_end = kept.code_end(func) if kept is not None else None
            if code_end is None:
                code_end = seen.code_end()
                if kept is not None:
                    kept.learn_code_end(func, code_end)
        else:
            cfg = self.analysis(func).cfg
            code_end = func.end
            for block in reversed(list(cfg.blocks.values())):
                if block.start < code_end and block.end >= code_end and is_padding(block, self.arch):
                    code_end = block.start
                else:
                    break
            if code_end == func.address:  # all filler: keep it as it is
                code_end = func.end
        # the filler a window may spill over or a springboard may use is within a few
        # hundred bytes: an extent that runs over a megabyte of it to the next symbol
        # is not read whole
        size = func.end - code_end
        inner = self.image.read(code_end, min(size, TAIL_KEPT)) if size else b""
        return code_end, inner + (self._gap_after(func) if size <= TAIL_KEPT else b"")

    def hazards(self, insns: Sequence[Insn]) -> Mapping[int, frozenset[str]]:
        """Why the kernel needs each of ``insns`` left alone (only those with a reason).
        A running kernel's answer is asked when an instruction is first looked up
        (_KernelHazards): a batch of entries asks about its functions' first bytes
        only, in one question (asking_ahead).  Instructions decoded on demand
        (ksim.analysis.record.Instructions) are not decoded for it."""
        if isinstance(insns, Instructions):
            # a function seen through its record: sizes looked up, no list of them made
            if not len(insns):
                return {}
            starts: Sequence[int] = insns.addresses
            size_at: Callable[[int], int | None] = insns.size_at
            spans: Callable[[], list[tuple[int, int]]] = insns.spans
        else:
            if not insns:
                return {}
            starts = [i.address for i in insns]
            size_at = {i.address: i.size for i in insns}.get

            def spans() -> list[tuple[int, int]]:
                return [(i.address, i.size) for i in insns]
        last = starts[-1]
        static = self._static_hazards(starts, last + (size_at(last) or 1))
        if self._ask is None:
            return static
        return _KernelHazards(self, size_at, spans, static)

    def _static_hazards(self, starts: Sequence[int], hi: int) -> dict[int, frozenset[str]]:
        """The image's tables' and ksim's own reasons for each instruction at
        ``starts`` (in order, end to end up to ``hi``; no question to the kernel):
        each table entry, blacklisted start and static-call range found once for the
        span and given to the instruction holding it, not looked for instruction by
        instruction."""
        out: dict[int, frozenset[str]] = {}
        if not starts:
            return out
        lo = starts[0]
        refs = self.image.tables.refs_at(lo, hi)
        black = self._blacklist_meets(lo, hi)
        calls = [(a, b) for a, b in self.static_call_text if a < hi and lo < b]
        if not refs and not black and not calls:
            return out   # most functions touch no table entry, blacklist or static call
        found: dict[int, set[str]] = {}
        for address, kinds in refs:
            k = bisect.bisect_right(starts, address) - 1
            found.setdefault(starts[k], set()).update(ref.value for ref in kinds)
        if black or calls:
            for address in starts:
                if black and self.blacklisted(address):
                    found.setdefault(address, set()).add("blacklist")
                if any(a <= address < b for a, b in calls):
                    found.setdefault(address, set()).add("static_call")
        return {a: frozenset(found[a]) for a in sorted(found)}

    def _blacklist_meets(self, lo: int, hi: int) -> bool:
        """Whether a blacklisted range overlaps [lo, hi)."""
        starts, ends = self._blacklist_index  # disjoint and sorted
        i = bisect.bisect_left(starts, hi) - 1  # the last range starting below hi
        return i >= 0 and ends[i] > lo

    def gone(self, func: Function) -> KsimError | None:
        """The refusal of a function the batch's question found is no text at all (its
        first byte "not_text": init code the kernel freed, or no module's), as the
        planner would give it for its entry; None when it was not asked or is text."""
        self._await((func.address, 1))
        found = (self._ahead or {}).get((func.address, 1))
        if found is None or "not_text" not in found:
            return None
        return hz.error_for(func.address, {"not_text"}, what=f"{func.name}+0x0")

    def asked_ahead(self, ranges: Sequence[tuple[int, int]]) -> list[frozenset[str]] | None:
        """The batch's answers for ``ranges`` when asking_ahead covered all of them."""
        ahead = self._ahead
        if ahead is None:
            return None
        out = []
        for r in ranges:
            self._await(r)
            found = ahead.get(r)
            if found is None:  # asked byte by byte (a function the store had no record of)
                found = frozenset()
                for k in range(r[1]):
                    self._await((r[0] + k, 1))
                    byte = ahead.get((r[0] + k, 1))
                    if byte is None:
                        return None
                    found |= byte
            out.append(found)
        return out

    def _await(self, r: tuple[int, int]) -> None:
        """The answers of asking_ahead's questions up to the one about ``r``, if it
        was asked and is not answered yet (the kernel answers them in order)."""
        seq = self._due_at.get(r)
        if seq is None:
            return
        while self._due and self._due[0][0] <= seq:
            _, ranges, answers = self._due.popleft()
            for q in ranges:
                self._due_at.pop(q, None)
            assert self._ahead is not None
            self._ahead.update(zip(ranges, answers(), strict=True))

    def _drop_due(self) -> None:
        """Questions not awaited (a block left early): their answers are read and
        dropped, so that none is left to a later request."""
        due, self._due, self._due_at = self._due, deque(), {}
        for _, _, answers in due:
            try:
                answers()
            except KsimError:
                pass  # the block is left already; what failed is not needed

    @contextmanager
    def asking_ahead(self, funcs: Sequence[Function]) -> Iterator[None]:
        """Within the block, the target's hazards (a live kernel's answer) of the
        first HEAD bytes of every function of ``funcs`` -- where an entry point's
        window lies -- come from questions asked first: a batch over N functions
        asks once per AHEAD_CHUNK functions, not N times, all sent at once and each
        answered when first needed, and about a few instructions of each, not all (an
        instruction further in is asked about, with the rest of its function, when
        a point there needs it).  Instructions are known ahead from the image's
        analysis store; functions it has no record of are asked about when
        analysed.  The answers are dropped at the end of the block (a running
        kernel's hazards change; the kernel checks every write again anyway).

        Inside another asking_ahead block (``holding``), only what the outer block
        has no answer for is asked, and the answers stay until the outer block ends:
        finding a batch's entry points and then planning them asks once."""
        if self._ask is None:
            yield
            return
        outer = self._ahead is not None
        funcs = [f for f in funcs if f.address not in self._looked]   # asked about already
        # without a store (a batch too small to build one), every head byte by byte
        kept = store_for(self.image, build_missing=False)
        assert self._ask_later is not None
        known = self._ahead if self._ahead is not None else {}
        self._ahead = known
        self._looked.update(f.address for f in funcs)
        reading = kept is not None and bool(funcs) and self.image.reads_memory
        # what is read ahead leaves out the text a running kernel freed (its init
        # code): nothing of a function gone is read, and the question refuses it
        here = [f for f in funcs if not self.image.freed(f.address)] if reading else []
        # in chunks, each chunk's question and text sent at once and answered when
        # first needed: the kernel answers for the next chunks while the client
        # analyses the first
        for k in range(0, len(funcs), AHEAD_CHUNK):
            chunk = funcs[k:k + AHEAD_CHUNK]
            ranges = [r for r in dict.fromkeys(
                r for func in chunk for r in self._head_ranges(func, kept))
                if r not in known and r not in self._due_at]
            if ranges:
                self._sent += 1
                self._due.append((self._sent, ranges, self._ask_later(ranges)))
                self._due_at.update(dict.fromkeys(ranges, self._sent))
            if reading:
                mine = {f.address for f in chunk}
                self.image.prefetch(self._read_ahead([f for f in here if f.address in mine]))
                if k == 0 and here:
                    # the kernel's tables (which the first hazards read) after the first
                    # chunk: waited for, and its answers with them
                    _ = self.image.tables
        if reading and kept is not None:
            # the digests come last: the daemon digests while the functions are analysed
            self.image.prefetch_digests(self._checked_ahead(kept, here))
        if outer:
            yield
            return
        try:
            yield
        finally:
            self._drop_due()
            self._ahead = None
            self._looked = set()

    def _head_ranges(self, func: Function, kept: Store | None) -> list[tuple[int, int]]:
        """What asking_ahead asks about ``func``: its first byte (one that is not text
        any more, init code the kernel freed, is refused before anything of it is
        analysed) and the instructions of its first HEAD bytes, by the store's sizes
        (not checked against the running kernel's bytes: that would read every
        function before the question; a function that changed is asked about again
        when analysed, at its real ranges)."""
        out = [(func.address, 1)]
        sizes = kept.sizes(func) if kept is not None else None
        if sizes is None:
            # no record of its instructions: each byte of its head, and an
            # instruction's answer is its bytes' (a byte's hazards are those of
            # any range holding it, so the union is never less than the range's own)
            return out + [(func.address + k, 1) for k in range(1, min(HEAD, func.size))]
        at = func.address
        for size in sizes:
            if at >= func.address + HEAD:
                break
            out.append((at, size))
            at += size
        return out

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block, every asking_ahead's answers stay (see asking_ahead)."""
        with self.asking_ahead(()):
            yield

    def _read_ahead(self, funcs: Sequence[Function]) -> list[tuple[int, int]]:
        """The text planning ``funcs`` reads: each function with the filler after it
        (_gap_after)."""
        return [(func.address, self._gap_end(func) - func.address) for func in funcs]

    def _checked_ahead(self, kept: Store, funcs: Sequence[Function]) -> list[tuple[int, int]]:
        """The text whose records analysing ``funcs`` relies on without reading it:
        every function they reach, other than themselves (Store.reach: their clobbers
        decide what is live at a call), each checked current by its digest.  What an
        earlier batch reached is not walked again (its digests are known: the
        target keeps them like the text it read ahead)."""
        mine = {f.address for f in funcs}
        found = kept.reach(self.image, funcs, self._reached)
        self._reached.update(f.address for f in found)
        return [(f.address, f.size) for f in found if f.address not in mine]

    def _gap_end(self, func: Function) -> int:
        """Where the gap after ``func`` ends: the next function's start when it is at
        most 64 bytes on (a gap that may be alignment filler), else ``func``'s end."""
        i = bisect.bisect_left(self._starts, func.end)
        if i < len(self._starts) and self._starts[i] - func.end <= 64:
            return self._starts[i]
        return func.end

    def _gap_after(self, func: Function) -> bytes:
        """The filler between ``func`` and the next function, if it is only filler."""
        end = self._gap_end(func)
        if end == func.end or not self.image.is_text(func.end):
            return b""
        data = self.image.read(func.end, end - func.end)
        return data if _is_filler(self.arch, data, func.end) else b""

    def request(self, point: int, code: FunctionCode, compile: Callable[[int], bytes],
                code_address: int, *, policy: str = "auto",
                busy: Container[int] = frozenset()) -> SpliceRequest:
        """The planner's question for ``point``, with the padding slots (less those
        ``busy`` holds) and the blacklist that every request carries.  Move it to
        another patch address with ``dataclasses.replace(req, code_address=...)``."""
        return SpliceRequest(point=point, func=code, compile=compile, code_address=code_address,
                             policy=policy, busy=busy,
                             padding=_Slots(lambda: self.padding_slots(point, busy)),
                             blacklist=self.blacklist, trap_unready=self.trap_unready)

    def check_point(self, point: Point, busy: Container[int] = frozenset()) -> None:
        """The planner's checks of ``point`` that no tactic changes (planner.check_point:
        a hazard or the blacklist at the point), without planning it."""
        code = self.function_code(point)
        check_point(self.arch, self.request(point.address, code, lambda _a: b"", point.address,
                                            busy=busy))

    @cached_property
    def trap_unready(self) -> tuple[tuple[int, int, str], ...]:
        """(start, end, why) of the code that runs before the kernel's own trap
        dispatch exists: the function that installs it (``trap_setup``) and every
        function it calls, directly or by a tail call, transitively.  A trap there
        reaches no handler (the toy under QEMU: no IDT yet, the CPU triple-faults)."""
        setup = self._trap_setup
        if setup is None or not self.image.has_function(setup):
            return ()
        out = []
        seen, work = {setup}, [setup]
        while work:
            name = work.pop()
            func = self.image.function(name)
            why = (f"{name} installs the kernel's trap handler: until it returns, a trap "
                   "reaches none" if name == setup else
                   f"{name} runs inside {setup}, before the kernel's trap handler is installed")
            out.append((func.address, func.end, why))
            graph = call_graph(self.image, [func])
            for callee in graph.callees(name) | graph.tail_calls.get(name, set()):
                if callee not in seen:
                    seen.add(callee)
                    work.append(callee)
        return tuple(sorted(out))

    def padding_slots(self, near: int, busy: Container[int]) -> tuple[tuple[int, bytes], ...]:
        """Free jmp-sized slots in the filler after the functions around ``near``
        (within short-jump reach), with their original bytes."""
        around = self._around(near)
        self.image.prefetch(self._read_ahead(around))  # a running kernel's: one request
        return self._unhazardous(self._padding_near(near, around, busy), self.arch.jmp_size)

    def prepare_padding(self, points: Sequence[int]) -> None:
        """Ask at once what padding_slots asks for each of ``points``: the text of the
        functions around them, in one read, and the hazards of every slot they may
        use, in one question whose answers stay for the asking_ahead block (outside
        one, nothing is asked ahead).  A batch's points left for springboards are
        planned with no further round trip."""
        if self._ask is None or self._ahead is None or not points:
            return
        arounds = [self._around(p) for p in points]
        self.image.prefetch(self._read_ahead(list({f.address: f for fs in arounds for f in fs}
                                                  .values())))
        ranges = [r for r in dict.fromkeys(
            (a, 1) for p, fs in zip(points, arounds, strict=True)
            for start, _ in self._padding_near(p, fs, frozenset())
            for a in range(start, start + self.arch.jmp_size)) if r not in self._ahead]
        if ranges:
            self._ahead.update(zip(ranges, self._ask(ranges), strict=True))

    def _around(self, near: int) -> list[Function]:
        """The functions whose filler (at most the function's own, then 64 bytes) a
        short jump at ``near`` may reach."""
        reach = 128 + self.arch.short_jmp_size
        lo = bisect.bisect_left(self._starts, near - 4 * reach)
        hi = bisect.bisect_right(self._starts, near + reach)
        return [f for f in self.image.functions[max(lo - 1, 0):hi] if f.end + 64 >= near - reach]

    def _padding_near(self, near: int, around: Sequence[Function], busy: Container[int]
                      ) -> tuple[tuple[int, bytes], ...]:
        """padding_slots before the target's hazards are asked."""
        size, reach = self.arch.jmp_size, 128 + self.arch.short_jmp_size
        out = []
        for func in around:
            try:
                end, tail = self._extent(func)
            except KsimError:  # undecodable or unanalysable neighbour: no slots there
                continue
            for start in range(end, end + len(tail) - size + 1, size):
                if abs(start - near) > reach or any(a in busy for a in range(start, start + size)):
                    continue
                # filler that is part of a site the kernel rewrites: a static call's
                # ``ret; int3...`` or a jump label's nop may become a jmp of its own
                if self.image.tables.refs_in(start - size + 1, start + size) \
                        or self.blacklisted(start):
                    continue
                out.append((start, tail[start - end:start - end + size]))
        return tuple(out)

    def _unhazardous(self, slots: tuple[tuple[int, bytes], ...], size: int
                     ) -> tuple[tuple[int, bytes], ...]:
        """The slots the target (a live kernel) finds no hazard in: asked in one
        question, or answered from the batch's question when it covered every byte."""
        if self._ask is None or not slots:
            return slots
        ahead = self._ahead or {}
        bytes_ = [[(a, 1) for a in range(start, start + size)] for start, _ in slots]
        for rs in bytes_:
            for r in rs:
                self._await(r)
        if all(r in ahead for rs in bytes_ for r in rs):
            clear = [not any(ahead[r] for r in rs) for rs in bytes_]
        else:
            clear = [not names for names in self._ask([(start, size) for start, _ in slots])]
        return tuple(slot for slot, ok in zip(slots, clear, strict=True) if ok)

    @cached_property
    def static_call_text(self) -> tuple[tuple[int, int], ...]:
        """The static-call trampolines (``.static_call.text``): the kernel rewrites
        their jump whenever a static call is updated (arch_static_call_transform,
        arch/x86/kernel/static_call.c), without looking at what is there."""
        ranges = [(s.address, s.end) for s in self.image.sections if s.name == ".static_call.text"]
        first = self.image.find_symbol("__static_call_text_start")
        last = self.image.find_symbol("__static_call_text_end")
        if first is not None and last is not None:
            ranges.append((first.address, last.address))
        return tuple(ranges)

    def blacklisted(self, address: int) -> bool:
        starts, ends = self._blacklist_index
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < ends[i]

    @cached_property
    def _blacklist_index(self) -> tuple[list[int], list[int]]:
        """The blacklist merged into disjoint sorted ranges, for bisection."""
        merged = merge_ranges(self.blacklist)
        return [lo for lo, _ in merged], [hi for _, hi in merged]

    @cached_property
    def blacklist(self) -> tuple[tuple[int, int], ...]:
        """Code ranges never to instrument: the sections and functions above and the
        kernel's own NOKPROBE_SYMBOL list (``_kprobe_blacklist``)."""
        ranges = list(self.image.tables.kprobe_blacklist)
        for start, end in BLACKLIST_RANGES:
            first, last = self.image.find_symbol(start), self.image.find_symbol(end)
            if first is not None and last is not None:  # else the image has no such section
                ranges.append((first.address, last.address))
        for name in BLACKLIST_FUNCTIONS:
            if self.image.has_function(name):
                f = self.image.function(name)
                ranges.append((f.address, f.end))
        return tuple(ranges)


class _Slots(Sequence[tuple[int, bytes]]):
    """A request's padding slots, found when the planner first looks at them: only
    the springboard tactic does, and finding them analyses the neighbouring functions."""

    def __init__(self, find: Callable[[], tuple[tuple[int, bytes], ...]]) -> None:
        self._find: Callable[[], tuple[tuple[int, bytes], ...]] | None = find
        self._slots: tuple[tuple[int, bytes], ...] = ()

    def _get(self) -> tuple[tuple[int, bytes], ...]:
        if self._find is not None:
            self._slots, self._find = self._find(), None
        return self._slots

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._get())


def _is_filler(arch: Arch, data: bytes, address: int) -> bool:
    if all(b == arch.pad_byte for b in data):
        return True
    covered = 0
    for insn in arch.decode(data, address):
        if not arch.is_filler(insn):
            return False
        covered += insn.size
    return covered == len(data)


def _at_once(ask: HazardQuery) -> LaterHazardQuery:
    """``ask`` as a LaterHazardQuery: answered when asked, given when called."""
    def later(ranges: Sequence[tuple[int, int]]) -> Callable[[], list[frozenset[str]]]:
        answers = ask(ranges)
        return lambda: answers
    return later


class _KernelHazards(Mapping[int, frozenset[str]]):
    """One function's hazards: the image's and ksim's own (``static``) at once, the
    running kernel's asked when an instruction is first looked up -- from the
    batch's question if it covered it (SiteFacts.asking_ahead), else for every
    instruction of the function not known yet, in one question."""

    __slots__ = ("_facts", "_size_at", "_spans", "_static", "_kernel", "_complete")

    def __init__(self, facts: SiteFacts, size_at: Callable[[int], int | None],
                 spans: Callable[[], list[tuple[int, int]]],
                 static: dict[int, frozenset[str]]) -> None:
        # size_at: an instruction's size by its address (None: none there); spans:
        # every instruction's (address, size), made only when all are asked about
        self._facts, self._size_at, self._spans, self._static = facts, size_at, spans, static
        self._kernel: dict[int, frozenset[str]] = {}
        self._complete = False

    def _learn(self, address: int | None) -> None:
        """The kernel's answer for the instruction at ``address`` (None: for all)."""
        if self._complete or (address is not None and address in self._kernel):
            return
        facts = self._facts
        if address is not None:
            size = self._size_at(address)
            if size is None:
                return  # not an instruction of this function: nothing to ask
            found = facts.asked_ahead([(address, size)])
            if found is not None:
                self._kernel[address] = found[0]
                return
        ranges = [(a, n) for a, n in self._spans() if a not in self._kernel]
        assert facts._ask is not None
        answers = facts.asked_ahead(ranges) or facts._ask(ranges)
        self._kernel.update(zip((a for a, _ in ranges), answers, strict=True))
        self._complete = True

    def __getitem__(self, address: int) -> frozenset[str]:
        self._learn(address)
        found = self._static.get(address, frozenset()) | self._kernel.get(address, frozenset())
        if not found:
            raise KeyError(address)
        return found

    def __iter__(self) -> Iterator[int]:
        self._learn(None)
        return iter([a for a in dict.fromkeys([*self._static, *self._kernel]) if a in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, int):
            return False
        self._learn(address)
        return bool(self._static.get(address) or self._kernel.get(address))
