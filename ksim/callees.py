"""Callee watching: the destinations of indirect calls, learned at run time
(KernInst's "Dynamic Callsite Watching", guide section 6.5).

The static call graph (``ksim.analysis.call_graph``) has no edges for calls
through function pointers.  A :class:`CalleeWatcher` splices, at each indirect
call site, a snippet that records the call's destination (``CallTarget``) into a
small table of its own in kernel data; reading the tables back gives, per site,
the set of functions the site reached, and :meth:`CalleeWatcher.merge_into` adds
them to a call graph.

    watcher = CalleeWatcher(kmgr)
    watcher.watch("do_syscall_64")
    kmgr.run(iterations=100)
    for site, dests in watcher.destinations().items(): ...
    watcher.merge_into(graph)
    watcher.unwatch()

Table format (one per watched site, on the kernel data heap, 8-byte words)::

    word 0         overflow: calls whose destination found no free slot
    word 1 .. N    slots: destinations seen; 0 = empty

The slots form a set filled in order: a destination goes into the first slot that
holds it or is empty, by a compare-and-swap from 0 (``lock cmpxchg``, through the
snippet's ``AtomicAssign``).  Slots are never emptied, so the non-empty slots are
always a prefix and a destination is never stored twice, even when CPUs race for a
slot: the loser's compare-and-swap sees the winner's value, and moves on to the next
slot unless that value is its own.  When all N slots hold other destinations the
overflow word is incremented instead (a ``lock add``).  The probe order is fixed,
not hashed, because a snippet addresses kernel data by constant addresses only; a
site with more than a handful of destinations pays one compare per slot before its
own, which is why the default table is small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ksim.analysis.callgraph import CallGraph
from ksim.analysis.points import Point, PointKind
from ksim.arch.base import CallOperand
from ksim.errors import KsimError, NotIndirectCall
from ksim.image.model import Function
from ksim.kapi import Handle, Manager
from ksim.snippets import ast
from ksim.snippets.ast import Var, call_target, if_, land, lnot, lor

#: slots per site when the caller does not say
SLOTS = 16
WORD = 8


@dataclass(frozen=True)
class WatchedSite:
    """One watched indirect call site: its point, the call's operand, its table."""

    point: Point
    operand: CallOperand
    table: int
    slots: int
    handle: Handle

    @property
    def overflow(self) -> Var:
        return Var(self.table)

    def slot(self, i: int) -> Var:
        return Var(self.table + WORD * (1 + i))


def record_snippet(table: int, slots: int) -> ast.Node:
    """Insert the call's destination into the set at ``table`` (format above)."""
    dest = call_target()
    recorded: ast.Node | None = None
    for i in reversed(range(slots)):
        s = Var(table + WORD * (1 + i))
        # a plain read first: a slot already holding ``dest`` (the common case once
        # the site is warm) costs no locked write
        claim = land(s == 0, s.atomic_assign(if_(s == 0, dest, s)) == dest)
        here = lor(s == dest, claim)
        recorded = here if recorded is None else lor(here, recorded)
    overflow = Var(table)
    assert recorded is not None
    return if_(lnot(recorded), overflow.atomic_assign(overflow + 1))


def evaluate_operand(op: CallOperand, reg: Callable[[str], int],
                     read: Callable[[int, int], bytes]) -> int:
    """The destination of an indirect call from a stopped machine's registers and
    memory (an oracle's view: SDM Vol. 2A, 2.1.5, base + index*scale + disp)."""
    if op.reg is not None:
        return reg(op.reg)
    address = op.disp
    if op.base is not None:
        address += reg(op.base)
    if op.index is not None:
        address += reg(op.index) * op.scale
    return int.from_bytes(read(address & ((1 << 64) - 1), op.size), "little")


class CalleeWatcher:
    """Watches indirect call sites through a Manager; see the module docstring."""

    def __init__(self, manager: Manager, *, slots: int = SLOTS, splice: str = "auto") -> None:
        if slots < 1:
            raise ValueError("a watched site needs at least one slot")
        self.kmgr = manager
        self.slots = slots
        self.splice = splice
        self.sites: dict[int, WatchedSite] = {}
        #: indirect call sites left out of a function's watch: address -> why
        self.skipped: dict[int, str] = {}

    # --- which sites -------------------------------------------------------------------
    def indirect_sites(self, func: Function | str) -> list[Point]:
        """The call-site points of ``func`` that are indirect calls."""
        return [p for p in self.kmgr.callsite_points(func) if self._operand(p) is not None]

    def _operand(self, point: Point) -> CallOperand | None:
        insn = self.kmgr.facts.analysis(point).insn_at(point.address)
        return self.kmgr.arch.call_operand(insn)

    def _targets(self, what: Function | str | Point | Iterable[Function | str | Point]
                 ) -> list[tuple[Point, bool]]:
        """(point, named explicitly) for everything ``what`` asks to watch."""
        items = [what] if isinstance(what, Function | str | Point) else list(what)
        out: list[tuple[Point, bool]] = []
        for item in items:
            if isinstance(item, Point):
                out.append((item, True))
            else:
                out += [(p, False) for p in self.kmgr.callsite_points(item)]
        return out

    # --- watching ------------------------------------------------------------------------
    def watch(self, what: Function | str | Point | Iterable[Function | str | Point]) -> list[Point]:
        """Record destinations at every indirect call site of the given functions, or
        at the given call-site points.  All or nothing: on a refusal every site this
        call added is unwatched again.  Returns the points now watched.

        A point given explicitly must be an indirect call (NotIndirectCall); a
        function's direct calls are passed over, and so are its indirect calls whose
        operand snippet code cannot evaluate (noted in ``skipped`` with the reason)."""
        added: list[WatchedSite] = []
        try:
            for point, explicit in self._targets(what):
                if point.address in self.sites:
                    continue
                site = self._watch_one(point, explicit)
                if site is not None:
                    added.append(site)
                    self.sites[point.address] = site
        except BaseException:
            for site in reversed(added):
                self._unwatch_one(site)
            raise
        return [s.point for s in added]

    def _watch_one(self, point: Point, explicit: bool) -> WatchedSite | None:
        if point.kind is not PointKind.CALLSITE:
            point = self.kmgr.point_at(point.address)
        try:
            operand = self._operand(point) if point.kind is PointKind.CALLSITE else None
        except KsimError as exc:
            if explicit:
                raise
            self.skipped[point.address] = str(exc)
            return None
        if operand is None:
            if explicit:
                raise NotIndirectCall(f"{point} is not an indirect call")
            return None
        if operand.segment is not None and not explicit:
            self.skipped[point.address] = f"segment-relative operand {operand}"
            return None
        table = self.kmgr.alloc_data(WORD * (1 + self.slots))
        try:
            handle = self.kmgr.insert_snippet(point, record_snippet(table, self.slots),
                                              splice=self.splice)
        except BaseException:
            self.kmgr.free(table)
            raise
        return WatchedSite(point, operand, table, self.slots, handle)

    def unwatch(self) -> None:
        """Remove every recording snippet (the text is restored byte for byte) and
        free the tables."""
        for address in list(self.sites):
            self._unwatch_one(self.sites.pop(address))

    def _unwatch_one(self, site: WatchedSite) -> None:
        self.kmgr.remove_snippet(site.handle)
        self.kmgr.free(site.table)
        self.sites.pop(site.point.address, None)

    # --- reading back ------------------------------------------------------------------------
    def _table(self, site: WatchedSite) -> list[int]:
        raw = self.kmgr.copy_from_kernel(site.table, WORD * (1 + site.slots))
        return [int.from_bytes(raw[i:i + WORD], "little") for i in range(0, len(raw), WORD)]

    def destinations(self) -> dict[int, set[int]]:
        """Call-site address -> the destinations recorded there."""
        return {a: {d for d in self._table(s)[1:] if d} for a, s in self.sites.items()}

    def overflows(self) -> dict[int, int]:
        """Call-site address -> calls whose destination found no free slot."""
        return {a: self._table(s)[0] for a, s in self.sites.items()}

    def name_of(self, address: int) -> str:
        """A destination by the image's symbols: ``func``, ``func+0x10``, or the hex
        address when it lies in no known function."""
        func = self.kmgr.target.image.function_at(address)
        if func is None:
            return f"{address:#x}"
        return func.name if func.address == address else f"{func.name}+{address - func.address:#x}"

    def callees(self) -> dict[int, set[str]]:
        """Call-site address -> the names of the functions it reached."""
        return {a: {self.name_of(d) for d in ds} for a, ds in self.destinations().items()}

    def merge_into(self, graph: CallGraph) -> set[tuple[str, str]]:
        """Add the observed edges (caller -> callee name) to ``graph.calls``; returns
        the edges that were not there before."""
        new: set[tuple[str, str]] = set()
        for address, names in self.callees().items():
            caller = self.sites[address].point.function
            known = graph.calls.setdefault(caller, set())
            new |= {(caller, n) for n in names - known}
            known |= names
        return new


__all__ = ["SLOTS", "CalleeWatcher", "WatchedSite", "evaluate_operand", "record_snippet"]
