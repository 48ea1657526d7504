"""The Manager: KernInst's KAPI operations with Pythonic names.

    m = Manager.attach("unicorn:toy")
    fn = m.find_function("tcp_sync_mss")
    counter = m.malloc(8)
    h = m.insert_snippet(m.entry_point(fn), counter.assign(counter + 1), splice="jmp")
    m.run(seed=1)
    print(m.read(counter))
    m.remove_snippet(h)
    m.detach()

The Manager is where the layers meet: it asks the analysis for the code around a
point, the planner for a Patch, and the target to apply it.  Every operation is
all or nothing: a refused or failed insert leaves the kernel exactly as it was.
Several snippets at one point share one patch, run in insertion order; adding or
removing one re-plans the patch and re-points the splice in a single poke.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ksim.analysis.points import Point, PointKind
from ksim.arch.base import Arch, CallOperand
from ksim.errors import AlreadySpliced, KsimError, UnknownHandle
from ksim.image.model import Function
from ksim.snippets import ast
from ksim.snippets.check import check as check_snippet
from ksim.snippets.codegen import gprs
from ksim.splice import planner
from ksim.splice.patch import Patch, Write
from ksim.splice.sites import SiteFacts
from ksim.targets import open_target
from ksim.targets.base import RunResult, Target


@dataclass(frozen=True)
class Handle:
    """What insert_snippet returns; pass it to remove_snippet."""

    id: int
    point: Point
    snippet: ast.Snippet


@dataclass
class _Splice:
    """One spliced point: its snippets in order and the patch that runs them."""

    point: Point
    tactic: str
    patch: Patch
    handles: list[Handle] = field(default_factory=list)


class Manager:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.arch: Arch = target.arch
        # a target that can ask the kernel itself which text may be touched (a live
        # kernel) answers for every function analysed; emulated kernels have only
        # their image's tables, which SiteFacts reads itself
        self.facts = SiteFacts(target.image, self.arch, ask=getattr(target, "text_hazards", None))
        self._splices: dict[int, _Splice] = {}
        #: text byte -> the point whose splice overwrote it (kept as splices change,
        #: so a new plan asks "is this byte taken?" in O(1))
        self._owners: dict[int, int] = {}
        self._ids = itertools.count(1)

    # --- attach / detach ---------------------------------------------------------
    @classmethod
    def attach(cls, spec: str, **options: Any) -> Manager:
        """Attach to "unicorn:toy", "qemu:toy" or "live://HOST:PORT"."""
        return cls(open_target(spec, **options))

    def detach(self, *, keep: bool = False) -> None:
        """Remove every snippet and let the target go.  With ``keep`` the splices
        stay in the kernel after the client has gone (a live daemon is told so;
        otherwise it undoes a client's splices when it disconnects)."""
        try:
            if keep:
                keep_splices = getattr(self.target, "keep", None)
                if keep_splices is not None:
                    keep_splices()
            else:
                for splice in list(self._splices.values()):
                    for handle in list(splice.handles):
                        self.remove_snippet(handle)
        finally:
            self.target.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # --- finding things ---------------------------------------------------------
    def find_function(self, name: str) -> Function:
        return self.target.image.function(name)

    def find_module(self, name: str) -> list[Function]:
        return [f for f in self.target.image.functions if f.module == name]

    def entry_point(self, func: Function | str) -> Point:
        return self.facts.entry(self._func(func))

    def exit_points(self, func: Function | str) -> list[Point]:
        return self.facts.points(self._func(func), PointKind.EXIT)

    def block_points(self, func: Function | str) -> list[Point]:
        return self.facts.points(self._func(func), PointKind.BLOCK)

    def callsite_points(self, func: Function | str) -> list[Point]:
        return self.facts.points(self._func(func), PointKind.CALLSITE)

    def point_at(self, address: int) -> Point:
        """An instruction-level point at any address inside a known function."""
        return self.facts.point_at(address)

    def _func(self, func: Function | str) -> Function:
        return self.find_function(func) if isinstance(func, str) else func

    # --- kernel data memory -------------------------------------------------------
    def malloc(self, size: int = 8) -> ast.Var:
        """A zeroed integer variable on the kernel's data heap."""
        return ast.Var(self.target.alloc_data(size), size)

    def free(self, var: ast.Var | int) -> None:
        self.target.free_data(var.address if isinstance(var, ast.Var) else var)

    def read(self, var: ast.Var) -> int:
        return int.from_bytes(self.target.read(var.address, var.size), "little", signed=False)

    def write(self, var: ast.Var, value: int) -> None:
        self.target.write(var.address, (value % (1 << (8 * var.size))).to_bytes(var.size, "little"))

    def copy_from_kernel(self, address: int, size: int) -> bytes:
        return self.target.read(address, size)

    def copy_to_kernel(self, address: int, data: bytes) -> None:
        self.target.write(address, data)

    def text_snapshot(self) -> dict[int, bytes]:
        """The bytes of every executable section, by address: compare two snapshots
        to check that removals restored the text exactly."""
        return {s.address: self.target.read(s.address, s.size)
                for s in self.target.image.sections if s.executable}

    # --- splicing -----------------------------------------------------------------
    def can_insert(self, point: Point, splice: str = "auto") -> str | None:
        """None if a snippet could be spliced at ``point`` with ``splice``, else why not."""
        try:
            self._plan(point, [ast.Seq(())], splice, dry_run=True)
        except KsimError as exc:
            return str(exc)
        return None

    def insert_snippet(self, point: Point, snippet: ast.Snippet, *, splice: str = "auto") -> Handle:
        """Splice ``snippet`` at ``point``; snippets already there run first."""
        check_snippet(snippet, point.kind, registers=gprs(self.arch),
                      call_operand=self._call_operand(point, [snippet]))
        current = self._splices.get(point.address)
        snippets = [h.snippet for h in current.handles] if current else []
        handle = Handle(next(self._ids), point, snippet)
        if current is not None and current.tactic not in planner.POLICIES.get(splice, ()):
            raise AlreadySpliced(
                f"{point.address:#x} is spliced by {current.tactic}, which policy {splice!r} excludes"
            )
        policy = current.tactic if current is not None else splice
        new = self._plan(point, snippets + [snippet], policy)
        self._replace(point, current, new, handles=(current.handles if current else []) + [handle])
        return handle

    def remove_snippet(self, handle: Handle) -> None:
        current = self._splices.get(handle.point.address)
        if current is None or handle not in current.handles:
            raise UnknownHandle(f"snippet handle {handle.id} is not inserted")
        rest = [h for h in current.handles if h != handle]
        if not rest:
            self._unsplice(current)
            return
        new = self._plan(handle.point, [h.snippet for h in rest], current.tactic)
        self._replace(handle.point, current, new, handles=rest)

    def splices(self) -> dict[int, tuple[str, int]]:
        """Spliced points: address -> (tactic, number of snippets)."""
        return {a: (s.tactic, len(s.handles)) for a, s in self._splices.items()}

    def patch_of(self, handle: Handle) -> Patch:
        return self._splices[handle.point.address].patch

    # --- running ------------------------------------------------------------------
    def run(self, **options: Any) -> RunResult:
        return self.target.run(**options)

    @contextmanager
    def oracle(self, address: int) -> Iterator[Any]:
        counter = self.target.oracle_counter(address)
        try:
            yield counter
        finally:
            counter.close()

    # --- internals ------------------------------------------------------------------
    def _busy(self, exclude: int | None = None) -> _Busy:
        """The text bytes splices overwrote, except those of the splice at ``exclude``."""
        return _Busy(self._owners, exclude)

    def _own(self, patch: Patch | None, point: int | None) -> None:
        """Record (``point`` given) or forget (None) the bytes ``patch`` overwrites."""
        if patch is None:
            return
        for address in planner.overwritten(patch):
            if point is None:
                self._owners.pop(address, None)
            else:
                self._owners[address] = point

    def _plan(self, point: Point, snippets: Sequence[ast.Snippet], policy: str,
              *, dry_run: bool = False) -> Patch:
        """Plan against the original text, allocating patch memory for the result.
        On any failure (or a dry run) the allocation is returned; nothing else changes."""
        func = self.facts.function_code(point)
        live = self.facts.live_at(point)
        abi = self.target.abi
        operand = self._call_operand(point, snippets)

        def compile_at(address: int) -> bytes:
            return self.arch.compile_snippets(snippets, address, live=live, abi=abi,
                                              point_kind=str(point.kind.value),
                                              call_operand=operand)

        # the point's own bytes and springboard slot count as free: a re-plan finds
        # the same slot first and re-points it in place
        req = self.facts.request(point.address, func, compile_at, point.address, policy=policy,
                                 busy=self._busy(exclude=point.address))
        planner.check_point(req)
        size = planner.patch_size_bound(self.arch, req)
        address = self.target.alloc_code(size, near=point.address)
        try:
            patch = planner.plan(self.arch, dataclasses.replace(req, code_address=address))
            if len(patch.code) > size:
                raise KsimError(f"patch code ({len(patch.code)} bytes) outgrew its bound ({size})")
        except BaseException:
            self.target.free_code(address)
            raise
        if dry_run:
            self.target.free_code(address)
        return patch

    def _call_operand(self, point: Point, snippets: Sequence[ast.Snippet]) -> CallOperand | None:
        """The operand of the indirect call at ``point``, for snippets that read
        CallTarget (decoded only then: a call whose operand snippet code cannot
        evaluate must not stop other snippets at its point)."""
        if point.kind is not PointKind.CALLSITE or not any(
                isinstance(x, ast.CallTarget) for s in snippets for x in ast.walk(s)):
            return None
        return self.arch.call_operand(self.facts.analysis(point).insn_at(point.address))

    def _install_code(self, patch: Patch) -> None:
        old = self.target.read(patch.code_address, len(patch.code))
        self.target.poke([Write(patch.code_address, old, patch.code)])

    def _replace(self, point: Point, current: _Splice | None, new: Patch,
                 *, handles: list[Handle]) -> None:
        """Put ``new`` in place of ``current`` (or of the original text), atomically."""
        try:
            self._install_code(new)
            if new.trap_site is not None:
                self.target.set_trap(new.trap_site, new.code_address)
            self.target.poke(_transition(current.patch if current else None, new))
        except BaseException:
            if new.trap_site is not None:
                if current is not None and current.patch.trap_site is not None:
                    self.target.set_trap(current.patch.trap_site, current.patch.code_address)
                else:
                    self.target.clear_trap(new.trap_site)
            self.target.free_code(new.code_address)
            raise
        if current is not None:
            self.target.free_code(current.patch.code_address)
            self._own(current.patch, None)
        self._own(new, point.address)
        self._splices[point.address] = _Splice(point, new.tactic, new, list(handles))

    def _unsplice(self, current: _Splice) -> None:
        self.target.poke(list(current.patch.undo))
        if current.patch.trap_site is not None:
            self.target.clear_trap(current.patch.trap_site)
        self.target.free_code(current.patch.code_address)
        self._own(current.patch, None)
        del self._splices[current.point.address]


class _Busy:
    """A read-only view of the Manager's overwritten bytes, less one splice's own."""

    __slots__ = ("_owners", "_exclude")

    def __init__(self, owners: dict[int, int], exclude: int | None) -> None:
        self._owners, self._exclude = owners, exclude

    def __contains__(self, address: object) -> bool:
        owner = self._owners.get(address)  # type: ignore[call-overload]
        return owner is not None and owner != self._exclude

    def __iter__(self) -> Iterator[int]:
        return (a for a, owner in self._owners.items() if owner != self._exclude)


def _transition(old: Patch | None, new: Patch) -> list[Write]:
    """The writes that turn the text spliced by ``old`` (or the original text) into
    the text spliced by ``new``.  Both were planned against the original text, so
    their writes cover the same addresses when the tactic is the same."""
    if old is None:
        return list(new.writes)
    current = {w.address: w for w in old.writes}
    out = [w for w in old.undo if w.address not in {n.address for n in new.writes}]
    for w in new.writes:
        before = current[w.address].new if w.address in current else w.old
        if before != w.new:
            out.append(Write(w.address, before, w.new))
    return out


__all__ = ["Handle", "Manager", "Point", "PointKind"]
