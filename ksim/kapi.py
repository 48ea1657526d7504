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

import bisect
import dataclasses
import functools
import gc
import itertools
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from ksim.analysis.points import Point, PointKind
from ksim.analysis.store import flush as flush_store
from ksim.analysis.store import for_batch, store_for
from ksim.arch.base import Arch, CallOperand
from ksim.core import Write
from ksim.errors import (
    AlreadySpliced,
    BadArgument,
    BlockInUse,
    Detached,
    DuplicateHandle,
    HandlerUnsupported,
    KsimError,
    OutsideHeapBlock,
    RelocationError,
    ReplacementError,
    UnknownHandle,
    WriteOutsideHeap,
)
from ksim.image.model import Function
from ksim.snippets import ast
from ksim.snippets.check import ACCESS_SIZES
from ksim.snippets.check import check as check_snippet
from ksim.snippets.codegen import facts as snippet_facts
from ksim.snippets.codegen import gprs, position_independent
from ksim.snippets.verify import Guard, Rules, verify
from ksim.splice import planner
from ksim.splice.areas import Areas
from ksim.splice.patch import Change, Patch
from ksim.splice.sites import SiteFacts
from ksim.targets import open_target
from ksim.targets.base import RunResult, Target

#: a Python handler an emulator calls at a trap: fn(machine, site) -> resume address or None
TrapHook = Callable[[Any, int], "int | None"]


@dataclass(frozen=True, eq=False)
class Handle:
    """One instrumentation of a point, as the Manager's ledger holds it; pass it to
    remove_snippet.  Everything at a point shares the point's one patch:

    ``snippet`` runs before the instruction at the point, ``post`` right after it;
    ``pre_hook``/``post_hook`` are Python handlers an emulator calls from a trap
    there; ``divert`` sends the point's code to a replacement; ``callee`` is a
    call site's new destination."""

    id: int
    point: Point
    snippet: ast.Snippet | None = None
    post: ast.Snippet | None = None
    pre_hook: TrapHook | None = None
    post_hook: TrapHook | None = None
    divert: int | None = None
    callee: int | None = None


@dataclass
class _Splice:
    """One spliced point: what instruments it, in order, and the patch that runs it."""

    point: Point
    tactic: str
    patch: Patch
    handles: list[Handle] = field(default_factory=list)
    #: removes the trap hooks registered for this patch
    unhook: list[Callable[[], None]] = field(default_factory=list)


@dataclass
class CodeBlock:
    """Code the Manager placed in the patch area for a user (a component)."""

    block: int
    #: the bytes reserved at ``block``: fill_code's code lies inside them
    reserved: int = 0
    base: int = 0
    size: int = 0
    old: bytes = b""
    #: addresses in it that may be a replacement's destination (its functions)
    entries: frozenset[int] = frozenset()
    filled: bool = False


class Manager:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.arch: Arch = target.arch
        self.capabilities = caps = target.capabilities
        self._detached = False
        # a target that can ask the kernel itself which text may be touched (a live
        # kernel) answers for every function analysed; emulated kernels have only
        # their image's tables, which SiteFacts reads itself
        self.facts = SiteFacts(target.image, self.arch,
                               ask=target.text_hazards if caps.hazards else None,
                               ask_later=target.ask_hazards if caps.hazards else None,
                               trap_setup=caps.trap_setup)
        # the image's analysis store, which finding and planning points read first,
        # is found and loaded while a remote kernel answers (the heap's first area,
        # taken below, is one such wait)
        target.when_idle(functools.partial(store_for, target.image, build_missing=False))
        arch = self.arch
        #: patch code and heap variables are placed by the Manager inside areas the
        #: target hands out (ksim.splice.areas): planning costs no request
        #: (a detached Manager's areas take nothing more: _live)
        self._code = Areas("patch area", lambda n, near: self._live().alloc_code(n, near),
                           target.free_code, chunk=caps.code_chunk, align=16, read=target.read,
                           fill=caps.code_fill,
                           take_ahead=lambda n, near: self._live().alloc_code_ahead(n, near),
                           reaches=lambda near, lo, hi: (arch.jmp_reaches(near, lo)
                                                         and arch.jmp_reaches(hi, near)))
        # an empty data area stays held while a splice of this Manager is live: a live
        # kernel's module refuses to free a client's heap block then (its patch code may
        # write any of them); the area goes back after the last removal (_unsplice)
        self._data = Areas("data heap", lambda n, _near: self._live().alloc_data(n, 64),
                           target.free_data, chunk=caps.data_chunk, align=8,
                           keep=lambda: bool(self._splices))
        self._splices: dict[int, _Splice] = {}
        #: text byte -> the point whose splice overwrote it (kept as splices change,
        #: so a new plan asks "is this byte taken?" in O(1))
        self._owners: dict[int, int] = {}
        #: code blocks placed for users (components), by allocation address
        self._blocks: dict[int, CodeBlock] = {}
        #: heap blocks this Manager allocated (address -> size): all snippets may write
        self._heap: dict[int, int] = {}
        #: their addresses, sorted (the block a write lies in, by bisection)
        self._heap_starts: list[int] = []
        #: functions snippets may call (address -> name), named by the user
        self._calls: dict[int, str] = {}
        #: patch-area allocations -> how many patches live in them; and the
        #: allocation of each patch placed inside a shared one (a batch's)
        self._code_users: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._ids = itertools.count(1)
        # the per-cpu recursion guard every snippet that calls out runs under
        slots = Guard.slots_for(max(1, caps.nr_cpus))
        self.guard = Guard(self._data.place(Guard.size_for(slots)), slots)

    # --- attach / detach ---------------------------------------------------------
    @classmethod
    def attach(cls, spec: str, **options: Any) -> Manager:
        """Attach to "unicorn:toy", "qemu:toy" or "live://HOST:PORT"."""
        return cls(open_target(spec, **options))

    def detach(self, *, keep: bool = False) -> None:
        """Remove every snippet and let the target go.  With ``keep`` the splices
        stay in the kernel after the client has gone (a live daemon is told so;
        otherwise it undoes a client's splices when it disconnects).  Afterwards
        the Manager changes nothing more (Detached: no splice, allocation, write or
        run; what it reads still reads); detaching again does nothing."""
        if self._detached:
            return
        try:
            if keep:
                if self.capabilities.keep:
                    self.target.keep()
            else:
                self.remove_many([h for s in self._splices.values() for h in s.handles])
                self._data.release_all()
                self._code.release_all()
        finally:
            self._detached = True
            self.target.close()
            # what this process learnt of the image's functions, for the next one
            flush_store(self.target.image)

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # --- finding things ---------------------------------------------------------
    def find_function(self, name: str) -> Function:
        if not isinstance(name, str):
            raise BadArgument(f"a function is named by a str, not {_shown(name)}")
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
        return self.facts.point_at(_int(address, "point_at's address"))

    def _func(self, func: Function | str) -> Function:
        if isinstance(func, Function):
            return func
        return self.find_function(func)

    # --- kernel data memory -------------------------------------------------------
    def malloc(self, size: int = 8) -> ast.Var:
        """A zeroed integer variable of ``size`` bytes (1, 2, 4 or 8) on the kernel's
        data heap (snippets may write it)."""
        size = _var_size(size)
        return ast.Var(self.alloc_data(size), size)

    def malloc_array(self, count: int, size: int = 8) -> list[ast.Var]:
        """``count`` zeroed integer variables of ``size`` bytes each, end to end in one
        block of the data heap (one per point of a batch, say): read_array reads them
        all in one request, and free(vars[0]) frees the block.  No count: no block."""
        count, size = _int(count, "malloc_array's count"), _var_size(size)
        if count < 0:
            raise BadArgument(f"malloc_array's count must not be negative, not {count}")
        if not count:
            return []
        base = self.alloc_data(count * size)
        return [ast.Var(base + size * i, size) for i in range(count)]

    def read_array(self, variables: Sequence[ast.Var]) -> list[int]:
        """The values of ``variables`` from one malloc_array, read at once."""
        variables = [_var(v) for v in _items(variables, "read_array's variables")]
        if not variables:
            return []
        base, size = variables[0].address, variables[0].size
        if any(v.address != base + size * i or v.size != size for i, v in enumerate(variables)):
            raise KsimError("read_array reads the variables of one malloc_array, in order")
        data = self.target.read(base, size * len(variables))
        return [int.from_bytes(data[i:i + size], "little") for i in range(0, len(data), size)]

    def alloc_data(self, size: int, align: int = 8) -> int:
        """A zeroed block of the kernel's data heap that snippets may write (placed in
        an area of the target's: no request unless a new area is needed)."""
        size, align = _int(size, "a heap block's size"), _int(align, "a heap block's alignment")
        if size <= 0:
            raise BadArgument(f"a heap block's size must be positive, not {size}")
        if align <= 0 or align & (align - 1):
            raise BadArgument(f"a heap block's alignment must be a power of two, not {align}")
        address = self._data.place(size, align=align)
        self._heap[address] = size
        bisect.insort(self._heap_starts, address)
        return address

    def free(self, var: ast.Var | int) -> None:
        """Give a heap block back.  Refused (BlockInUse, naming the splice) while an
        inserted snippet still references it: the block would be handed out again
        (to this Manager, or on a live kernel to another client) while the snippet
        still writes it."""
        address = _var(var).address if isinstance(var, ast.Var) else _int(var, "free's address")
        if address not in self._heap:
            raise UnknownHandle(f"{address:#x} is not a block of the data heap from malloc")
        self.check_free(address)
        self._data.release(address)
        del self._heap[address]
        self._heap_starts.remove(address)

    def check_free(self, address: int) -> None:
        """BlockInUse if a snippet inserted here references the heap block at
        ``address``: a Var or table inside it, a miss counter there, or a constant
        pointing into it (a pointer the snippet reads through or hands to a call)."""
        size = self._heap.get(address)
        if size is None:
            raise UnknownHandle(f"{address:#x} is not a block of the data heap from malloc")
        for splice in self._splices.values():
            for h in splice.handles:
                for code, stage in ((h.snippet, "snippet"), (h.post, "post snippet")):
                    if code is not None and _references(code, address, address + size):
                        func = self.target.image.function_at(splice.point.address)
                        where = (f" ({func.name}+{splice.point.address - func.address:#x})"
                                 if func is not None else "")
                        raise BlockInUse(
                            f"the heap block at {address:#x} ({size} bytes) is still used by "
                            f"the {stage} of handle {h.id}, spliced by {splice.tactic} at "
                            f"{splice.point.address:#x}{where}: remove it first, then free")

    def allow_calls(self, *functions: Function | str | int) -> None:
        """Name functions snippets may call (a snippet calling anything else is
        refused, CallNotAllowed).  A snippet that calls out runs under the per-cpu
        recursion guard: a hit while its cpu runs one already is skipped and
        counted (``missed()``)."""
        for f in functions:
            if not isinstance(f, Function | str):
                f = _int(f, "a callable function's address")
            if isinstance(f, int):
                func = self.target.image.function_at(f)
                self._calls[f] = func.name if func is not None and func.address == f else hex(f)
            else:
                func = self._func(f)
                self._calls[func.address] = func.name

    def missed(self) -> int:
        """Hits the recursion guard skipped (a snippet that calls out, hit again on
        its cpu while it ran)."""
        return self.read(ast.Var(self.guard.missed))

    def rules(self) -> Rules:
        """What this Manager's snippets may touch (ksim.snippets.verify)."""
        return Rules.for_target(self.target, writable=self._heap.items(), calls=self._calls,
                                guard=self.guard)

    def read(self, var: ast.Var) -> int:
        var = _var(var)
        return int.from_bytes(self.target.read(var.address, var.size), "little", signed=False)

    def write(self, var: ast.Var, value: int) -> None:
        """Store ``value`` in ``var``, modulo 2**(8 * its size) (a signed value as two's
        complement).  A value no 64-bit integer holds, signed or unsigned (outside
        -2**63 .. 2**64 - 1), is refused (BadArgument), never wrapped."""
        var, value = _var(var), _int(value, "the value written")
        if not -(1 << 63) <= value < 1 << 64:
            raise BadArgument(f"write of {value} to a {var.size}-byte Var at {var.address:#x}: "
                              "no 64-bit integer holds it (a value is -2**63 .. 2**64 - 1); "
                              "nothing was written")
        self._check_held(var.address, var.size, f"write of a {var.size}-byte Var")
        self._live().write(var.address, (value % (1 << (8 * var.size))).to_bytes(var.size, "little"))

    def copy_from_kernel(self, address: int, size: int) -> bytes:
        return self.target.read(address, size)

    def copy_to_kernel(self, address: int, data: bytes) -> None:
        """Write ``data`` at ``address``, which with all of ``data`` lies inside one
        heap block from malloc/alloc_data (OutsideHeapBlock otherwise: nothing is
        written)."""
        address = _int(address, "copy_to_kernel's address")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise BadArgument(f"copy_to_kernel writes bytes, not {_shown(data)}")
        data = bytes(data)
        if not data:
            return
        self._check_held(address, len(data), f"copy_to_kernel of {len(data)} bytes")
        self._live().write(address, data)

    def _check_held(self, address: int, size: int, what: str) -> None:
        """OutsideHeapBlock unless [address, address + size) lies in one heap block
        this Manager allocated: a write never runs into the next block (another
        variable, map or ring of this client's)."""
        i = bisect.bisect_right(self._heap_starts, address) - 1
        if i >= 0:
            start = self._heap_starts[i]
            end = start + self._heap[start]
            if address + size <= end:
                return
            if address < end:
                raise OutsideHeapBlock(
                    f"{what} at {address:#x} runs {address + size - end} bytes past the end of "
                    f"the heap block {start:#x}..{end:#x}; nothing was written")
        raise OutsideHeapBlock(f"{what} at {address:#x} is not inside a heap block from "
                               "malloc or alloc_data; nothing was written")

    def text_snapshot(self) -> dict[int, bytes]:
        """The bytes of every executable section, by address: compare two snapshots
        to check that removals restored the text exactly."""
        return {s.address: self.target.read(s.address, s.size)
                for s in self.target.image.sections if s.executable}

    # --- splicing -----------------------------------------------------------------
    def can_insert(self, point: Point, splice: str = "auto") -> str | None:
        """None if a snippet could be spliced at ``point`` with ``splice``, else why not
        (the very verdict insert_snippet would give).  A dry run: planned where the
        patch would go, with nothing placed and no request of the target."""
        try:
            self.check_insert(point, splice)
        except KsimError as exc:
            return str(exc)
        return None

    def check_insert(self, point: Point, splice: str = "auto") -> None:
        """can_insert's verdict as the error insert_snippet would raise (None: it
        would splice); the same dry run."""
        _point(point)
        planner.policy_tactics(splice)
        self._add(Handle(0, point, ast.Seq(())), splice, dry_run=True)

    @contextmanager
    def one_look(self) -> Iterator[None]:
        """Within the block, what the target says about its text (a live kernel's
        hazards) is asked once for all the batches inside: a wildcard's entry points
        found (spliceable_entries) and then inserted (insert_many) ask one question,
        not two.  The answers are dropped at the end of the block."""
        with self.facts.holding():
            yield

    @contextmanager
    def looking_ahead(self, funcs: Iterable[Function | str]) -> Iterator[None]:
        """Within the block, what finding and planning points in ``funcs`` asks the
        target (a live kernel's hazards of their first bytes, their text and filler,
        the digests of what they reach) is asked at once, ahead, instead of as each
        point needs it (a text's 256 KB chunks read one by one).  Inside one_look the
        answers stay until it ends."""
        with self.facts.asking_ahead([self._func(f) for f in funcs]):
            yield

    def spliceable_entries(self, funcs: Iterable[Function], splice: str = "auto", *,
                           plan: bool = True
                           ) -> tuple[list[tuple[Function, Point]], dict[str, str]]:
        """The entry points of ``funcs`` that ``splice`` can splice (can_insert), each
        with its function, in the order given; and why each other function's cannot
        be (its analysis failed, or can_insert's verdict), by name.

        With ``plan=False`` the entry points are found but not planned: the functions
        left out are those without one (gone, or not analysable) and those whose entry
        is refused whatever the tactic (a hazard there, the blacklist: the planner's
        check_point, with its words).  A caller that then
        inserts them with ``insert_many(..., refused=...)`` plans each point once, not
        twice (a dry run here and the batch's own plan there)."""
        funcs = [self._func(f) for f in _items(funcs, "spliceable_entries' functions")]
        planner.policy_tactics(splice)
        for_batch(self.target.image, len(funcs))
        out: list[tuple[Function, Point]] = []
        refused: dict[str, str] = {}
        with self.facts.asking_ahead(funcs), self._code.holding():
            for f in funcs:
                gone = self.facts.gone(f)
                if gone is not None:
                    refused[f.name] = str(gone)
                    continue
                try:
                    point = self.entry_point(f)
                    if plan:
                        why = self.can_insert(point, splice)
                    else:  # what refuses the point whatever the tactic, without planning
                        why = None
                        self.facts.check_point(point, self._busy(exclude=point.address))
                except KsimError as exc:
                    why = str(exc)
                if why is None:
                    out.append((f, point))
                else:
                    refused[f.name] = why
        return out, refused

    def insert_snippet(self, point: Point, snippet: ast.Snippet | None, *, splice: str = "auto",
                       post: ast.Snippet | None = None, pre_hook: TrapHook | None = None,
                       post_hook: TrapHook | None = None, missed: ast.Var | None = None
                       ) -> Handle:
        """Splice ``snippet`` at ``point``; what is already there runs first.

        ``post`` runs right after the instruction at the point (it must fall
        through).  ``pre_hook``/``post_hook`` are Python handlers, on a target that
        calls Python at a trap (unicorn); a pre hook needs the trap tactic.
        Snippets are verified first (ksim.snippets.verify): one that calls out runs
        under the recursion guard, and a hit it skips is counted in ``missed()``
        and in ``missed`` (an 8-byte variable from malloc) when given."""
        kind = _point(point).kind
        planner.policy_tactics(splice)
        rules = self.rules()
        for code, where in ((snippet, kind), (post, PointKind.INSN)):
            if code is not None:
                check_snippet(code, where, registers=gprs(self.arch),
                              call_operand=self._call_operand(point, [code]))
        # the verifier's output is what runs (calling snippets wrapped in the guard)
        snippet = verify([snippet], rules)[0] if snippet is not None else None
        post = verify([post], rules)[0] if post is not None else None
        if missed is not None:
            if not (isinstance(missed, ast.Var) and type(missed.address) is int
                    and type(missed.size) is int and missed.size == 8 and missed.segment is None
                    and (missed.address, missed.size) in rules.writable):
                shown = (f"at {missed.address:#x}" if isinstance(missed, ast.Var)
                         and type(missed.address) is int else _shown(missed))
                raise WriteOutsideHeap(f"the miss counter {shown} is not an "
                                       "8-byte variable from malloc")
            snippet, post = (dataclasses.replace(s, missed=missed.address)
                             if isinstance(s, ast.Guarded) else s for s in (snippet, post))
        if (pre_hook or post_hook) and not self.capabilities.python_hooks:
            raise HandlerUnsupported(f"{self.target.name} cannot call Python at a trap: "
                                     "use snippet handlers")
        handle = Handle(next(self._ids), point, snippet, post, pre_hook, post_hook)
        return self._add(handle, "trap" if pre_hook else splice)

    def divert(self, point: Point, to: int, *, splice: str = "auto") -> Handle:
        """Send execution arriving at ``point`` to ``to`` instead (function
        replacement); snippets at the point still run first.  ``to`` must be a
        function's entry: the image's, or one of a placed code block's."""
        _point(point)
        planner.policy_tactics(splice)
        self.check_code_entry(_int(to, "divert's destination"))
        return self._add(Handle(next(self._ids), point, divert=to), splice)

    def redirect_call(self, point: Point, to: int) -> Handle:
        """Make the direct call at ``point`` call ``to`` (call-site replacement)."""
        _point(point)
        self.check_code_entry(_int(to, "the call's new destination"))
        if point.address in self._splices:
            raise AlreadySpliced(f"{point.address:#x} is already instrumented: "
                                 "a replaced call site has nothing else at it")
        insn = self.facts.analysis(point).insn_at(point.address)
        try:
            new = self.arch.redirect_call(insn, to)
        except RelocationError as exc:
            raise ReplacementError(str(exc)) from None
        code = self.facts.function_code(point)
        req = self.facts.request(point.address, code, lambda _a: b"", point.address,
                                 busy=self._busy())
        planner.check_point(self.arch, req)
        patch = Patch(point.address, "call", 0, b"", (Write(point.address, insn.raw, new),))
        handle = Handle(next(self._ids), point, callee=to)
        self._live().apply(Change(text=patch.writes))
        self._own(patch, point.address)
        self._splices[point.address] = _Splice(point, "call", patch, [handle])
        return handle

    def remove_snippet(self, handle: Handle) -> None:
        """Take ``handle``'s instrumentation out; the rest at its point stays."""
        current = self._splices.get(_handle(handle).point.address)
        if current is None or not any(h is handle for h in current.handles):
            raise UnknownHandle(f"handle {handle.id} is not inserted")
        rest = [h for h in current.handles if h is not handle]
        if not rest:
            self._unsplice([current])
            return
        self._commit(handle.point, current, self._plan(handle.point, rest, current.tactic), rest)

    remove = remove_snippet

    def insert_many(self, points: Sequence[Point],
                    snippet: ast.Snippet | Callable[[Point], ast.Snippet], *,
                    splice: str = "auto", refused: dict[int, str] | None = None
                    ) -> list[Handle]:
        """Splice a snippet at every one of ``points`` in one step, all or nothing:
        one planning pass, one patch-area allocation, one poke for the patch code
        and one for the text.  ``snippet`` is a snippet, or a function giving the
        snippet of each point.  Points already spliced are refused (use
        insert_snippet there); so is a batch naming a point twice.

        ``refused``: a dict that takes the points the planner refuses (a hazard, no
        safe tactic: can_insert's verdicts), point address -> why, instead of the
        batch failing; the rest goes in, as one step.  A bad snippet or argument
        still fails the whole batch.  The handles returned are those inserted."""
        with _collector_held():
            return self._insert_many(points, snippet, splice, refused)

    def _insert_many(self, points: Sequence[Point],
                     snippet: ast.Snippet | Callable[[Point], ast.Snippet],
                     splice: str, refused: dict[int, str] | None = None) -> list[Handle]:
        """The body of insert_many."""
        points = [_point(p) for p in _items(points, "insert_many's points")]
        planner.policy_tactics(splice)
        for_batch(self.target.image, len(points))
        seen: set[int] = set()
        for p in points:
            if p.address in seen:
                raise AlreadySpliced(f"{p.address:#x} is named twice in one batch")
            if p.address in self._splices:
                raise AlreadySpliced(f"{p.address:#x} is already spliced: insert_many takes "
                                     "points with nothing at them")
            seen.add(p.address)
        rules = self.rules()
        registers = gprs(self.arch)
        handles = []
        for p in points:
            code = snippet(p) if callable(snippet) and not isinstance(snippet, ast.Node) else snippet
            check_snippet(code, p.kind, registers=registers,
                          call_operand=self._call_operand(p, [code]))
            handles.append(Handle(next(self._ids), p, verify([code], rules)[0]))
        if not handles:
            return []
        # a live kernel's hazards of every point's function, asked in one question
        image = self.target.image
        funcs = [f for f in (image.function_at(p.address) for p in points) if f is not None]
        with self.facts.asking_ahead(funcs):
            try:
                return self._insert_batch(handles, splice, refused)
            finally:
                self._code.settle()

    def _insert_batch(self, handles: list[Handle], splice: str,
                      refused: dict[int, str] | None) -> list[Handle]:
        """insert_many's batch: planned, placed in one block, committed."""
        reqs: list[planner.SpliceRequest] = []
        kept: list[Handle] = []
        bounds: list[int] = []
        expected = False
        for h in handles:
            try:
                req = self._request(h.point, [h], splice, _Busy(self._owners, None))
            except KsimError as exc:
                if refused is None:
                    raise
                refused[h.point.address] = str(exc)
                continue
            reqs.append(req)
            kept.append(h)
            # each patch's room, rounded to 16 bytes as the allocator rounds a patch's own
            bound = 0 if req.direct else -(-planner.patch_size_bound(self.arch, req) // 16) * 16
            if bound and not expected:
                # the batch's patch area, asked for now and answered while the rest
                # are compiled and sized (a round trip the batch waited for): as much
                # as this first patch for every point, and a quarter more
                self._code.expect(bound * len(handles) * 5 // 4, h.point.address)
                expected = True
            bounds.append(bound)
        if not reqs:
            return []
        block = self._alloc_code(max(sum(bounds), 16), kept[0].point.address)
        try:
            patches, no = planner.plan_batch(self.arch, reqs, bounds, block,
                                             _Busy(self._owners, None),
                                             prepare=self.facts.prepare_padding)
            if no and refused is None:  # all or nothing
                raise no[min(no)]
            for i, why in no.items():
                cast(dict[int, str], refused)[reqs[i].point] = str(why)
            placed = [(p, h) for p, h in zip(patches, kept, strict=True) if p is not None]
            if not placed:
                self._release_code(block)
                return []
            self._commit_many(block, [p for p, _ in placed], [h for _, h in placed])
        except BaseException:
            self._release_code(block)
            raise
        return [h for _, h in placed]

    def remove_many(self, handles: Sequence[Handle]) -> None:
        """Take ``handles`` out in one step: the points left with nothing are
        restored by one poke; points that keep other instrumentation are re-planned.
        A handle named twice, or one not inserted, is refused before anything is
        taken out."""
        with _collector_held():
            self._remove_many(handles)

    def _remove_many(self, handles: Sequence[Handle]) -> None:
        """The body of remove_many."""
        handles = [_handle(h) for h in _items(handles, "remove_many's handles")]
        seen: set[Handle] = set()
        for h in handles:
            if h in seen:
                raise DuplicateHandle(f"handle {h.id} is named twice: remove_many takes each "
                                      "handle once")
            seen.add(h)
        gone: dict[int, list[Handle]] = {}
        for h in handles:
            current = self._splices.get(h.point.address)
            if current is None or not any(x is h for x in current.handles):
                raise UnknownHandle(f"handle {h.id} is not inserted")
            gone.setdefault(h.point.address, []).append(h)
        self._unsplice([self._splices[a] for a, hs in gone.items()
                        if len(hs) == len(self._splices[a].handles)])
        for address, hs in gone.items():
            if address in self._splices:
                for h in hs:
                    self.remove_snippet(h)

    def splices(self) -> dict[int, tuple[str, int]]:
        """Spliced points: address -> (tactic, number of instrumentations)."""
        return {a: (s.tactic, len(s.handles)) for a, s in self._splices.items()}

    def patch_of(self, handle: Handle) -> Patch:
        current = self._splices.get(_handle(handle).point.address)
        if current is None or not any(h is handle for h in current.handles):
            raise UnknownHandle(f"handle {handle.id} is not inserted")
        return current.patch

    # --- code blocks (components) -------------------------------------------------
    def reserve_code(self, size: int, *, near: int | None = None) -> CodeBlock:
        """Patch-area memory for code the user links (fill it with fill_code)."""
        size = _int(size, "reserve_code's size")
        if size <= 0:
            raise BadArgument(f"reserve_code's size must be positive, not {size}")
        near = self.target.image.functions[0].address if near is None else \
            _int(near, "reserve_code's near")
        block = CodeBlock(self._live().alloc_code(size, near=near), reserved=size)
        self._blocks[block.block] = block
        return block

    def fill_code(self, block: CodeBlock, base: int, code: bytes, *,
                  entries: frozenset[int] = frozenset()) -> None:
        """Put ``code`` at ``base`` (inside ``block``), once."""
        block = _code_block(block)
        if self._blocks.get(block.block) is not block or block.filled:
            raise UnknownHandle(f"code block {block.block:#x} is not reserved and empty")
        base = _int(base, "fill_code's base")
        if not isinstance(code, bytes | bytearray) or not code:
            raise BadArgument(f"fill_code's code must be bytes, not {_shown(code)}")
        code = bytes(code)
        if not block.block <= base <= base + len(code) <= block.block + block.reserved:
            raise BadArgument(f"[{base:#x}, {base + len(code):#x}) is not inside code block "
                              f"[{block.block:#x}, {block.block + block.reserved:#x})")
        old = self.target.read(base, len(code))
        self._live().apply(Change(code=(Write(base, old, code),)))
        block.base, block.size, block.old, block.entries = base, len(code), old, entries
        block.filled = True

    def release_code(self, block: CodeBlock) -> None:
        """Restore and free a block; refused while a splice still goes into it."""
        block = _code_block(block)
        if self._blocks.get(block.block) is not block:
            raise UnknownHandle(f"code block {block.block:#x} is not reserved")
        for splice in self._splices.values():
            for h in splice.handles:
                to = h.divert if h.divert is not None else h.callee
                if to is not None and block.base <= to < block.base + block.size:
                    raise AlreadySpliced(f"{splice.point.address:#x} still goes to {to:#x} "
                                         "in this code: undo that first")
        for address in [a for a in self._calls if block.base <= a < block.base + block.size]:
            del self._calls[address]
        if block.filled:
            code = self.target.read(block.base, block.size)
            self._live().apply(Change(code=(Write(block.base, code, block.old),)))
        self.target.free_code(block.block)
        del self._blocks[block.block]

    def check_code_entry(self, address: int) -> None:
        """Refuse ``address`` as a replacement unless a function starts there."""
        if any(address in b.entries for b in self._blocks.values()):
            return
        func = self.target.image.function_at(address)
        if func is None or func.address != address:
            where = (f"inside {func.name}" if func is not None else "not in any known function")
            raise ReplacementError(f"{address:#x} is not a function's entry ({where}): a "
                                   "replacement is a kernel function or a loaded component's")

        # --- running ------------------------------------------------------------------
    def run(self, **options: Any) -> RunResult:
        return self._live().run(**options)

    @contextmanager
    def oracle(self, address: int) -> Iterator[Any]:
        counter = self.target.oracle_counter(address)
        try:
            yield counter
        finally:
            counter.close()

    # --- internals ------------------------------------------------------------------
    def _live(self) -> Target:
        """The target, to change or run it: refused once the Manager is detached."""
        if self._detached:
            raise Detached("this Manager is detached from its target: it changes nothing "
                           "more (attach again with Manager.attach)")
        return self.target

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

    def _add(self, handle: Handle, splice: str, *, dry_run: bool = False) -> Handle:
        """Plan the point with ``handle`` added and commit (or, dry, only plan)."""
        point = handle.point
        current = self._splices.get(point.address)
        if current is not None and current.tactic not in planner.POLICIES.get(splice, ()):
            raise AlreadySpliced(f"{point.address:#x} is spliced by {current.tactic}, "
                                 f"which policy {splice!r} excludes")
        if current is not None and current.tactic == "call":
            raise AlreadySpliced(f"the call at {point.address:#x} is replaced: "
                                 "a replaced call site has nothing else at it")
        handles = (current.handles if current else []) + [handle]
        new = self._plan(point, handles, current.tactic if current else splice, dry_run=dry_run)
        if not dry_run:
            self._commit(point, current, new, handles)
        return handle

    def _plan(self, point: Point, handles: Sequence[Handle], policy: str,
              *, dry_run: bool = False) -> Patch:
        """Plan against the original text, allocating patch memory for the result.
        On any failure (or a dry run) the allocation is returned; nothing else changes."""
        # the point's own bytes and springboard slot count as free: a re-plan finds
        # the same slot first and re-points it in place
        req = self._request(point, handles, policy, self._busy(exclude=point.address))
        if req.direct:  # straight to the replacement: no patch code
            return planner.plan(self.arch, dataclasses.replace(req, code_address=0))
        size = planner.patch_size_bound(self.arch, req)
        if dry_run:  # where it would go; nothing is placed
            address = self._code.peek(size, point.address)
            return planner.plan(self.arch, dataclasses.replace(req, code_address=address))
        address = self._alloc_code(size, point.address)
        try:
            patch = planner.plan(self.arch, dataclasses.replace(req, code_address=address))
            if len(patch.code) > size:
                raise KsimError(f"patch code ({len(patch.code)} bytes) outgrew its bound ({size})")
        except BaseException:
            self._release_code(address)
            raise
        return patch

    def _request(self, point: Point, handles: Sequence[Handle], policy: str,
                 busy: Container[int]) -> planner.SpliceRequest:
        """The planner's question for everything ``handles`` put at ``point``,
        checked (kprobes' check_kprobe_address_safe) but not yet placed."""
        diverts = {h.divert for h in handles if h.divert is not None}
        if len(diverts) > 1:
            raise AlreadySpliced(f"{point.address:#x} is already replaced "
                                 f"(by {min(diverts - {handles[-1].divert}):#x})")
        if any(h.pre_hook for h in handles) and policy != "trap":
            raise AlreadySpliced(f"{point.address:#x} is spliced by {policy}; a Python pre "
                                 "handler needs the trap tactic")
        pre = [h.snippet for h in handles if h.snippet is not None]
        posts = [h.post for h in handles if h.post is not None]
        post_trap = any(h.post_hook for h in handles)
        func = self.facts.function_code(point)
        live = self.facts.live_at(point)
        abi = self.target.abi
        operand = self._call_operand(point, pre)

        anywhere = position_independent(pre, abi)
        compiled: dict[int, bytes] = {}

        def compile_at(address: int) -> bytes:
            if not pre:
                return b""
            if anywhere and compiled:  # the same bytes at every address: compile once
                return next(iter(compiled.values()))
            if address not in compiled:
                compiled[address] = self.arch.compile_snippets(
                    pre, address, live=live, abi=abi, point_kind=str(point.kind.value),
                    call_operand=operand)
            return compiled[address]

        post = None
        if posts or post_trap:
            after = self._live_after(point)

            def post(address: int) -> bytes:
                if not posts:
                    return b""
                return self.arch.compile_snippets(posts, address, live=after, abi=abi,
                                                  point_kind="insn")

        req = self.facts.request(point.address, func, compile_at, point.address, policy=policy,
                                 busy=busy)
        req = dataclasses.replace(req, post=post, post_trap=post_trap,
                                  divert=next(iter(diverts), None))
        planner.check_point(self.arch, req)
        return req

    def _alloc_code(self, size: int, near: int) -> int:
        address = self._code.place(size, near)
        self._code_users[address] = 1
        return address

    def _release_code(self, address: int) -> None:
        """One patch less in the allocation holding ``address`` (freed with its last)."""
        block = self._block_of.pop(address, address)
        self._code_users[block] -= 1
        if not self._code_users[block]:
            del self._code_users[block]
            self._code.release(block)

    def _live_after(self, point: Point) -> frozenset[str]:
        """Registers live after the instruction at ``point`` (all of them if unknown)."""
        try:
            analysis = self.facts.analysis(point)
            return analysis.live_at(analysis.insn_at(point.address).end)
        except KsimError:
            return frozenset(self.arch.all_regs)

    def _call_operand(self, point: Point, snippets: Sequence[ast.Snippet]) -> CallOperand | None:
        """The operand of the indirect call at ``point``, for snippets that read
        CallTarget (decoded only then: a call whose operand snippet code cannot
        evaluate must not stop other snippets at its point)."""
        if point.kind is not PointKind.CALLSITE or not any(
                snippet_facts(s).call_target for s in snippets):
            return None
        return self.arch.call_operand(self.facts.analysis(point).insn_at(point.address))

    def _hooks(self, patch: Patch, handles: Sequence[Handle]) -> list[Callable[[], None]]:
        """Register the handles' Python trap hooks at this patch's traps."""
        out: list[Callable[[], None]] = []
        if not self.capabilities.python_hooks:
            return out
        add = self.target.add_trap_hook
        for h in handles:
            if h.pre_hook is not None and patch.trap_site is not None:
                out.append(add(patch.trap_site, h.pre_hook))
            if h.post_hook is not None and patch.post_at is not None:
                out.append(add(patch.post_at, h.post_hook))
        return out

    def _commit(self, point: Point, current: _Splice | None, new: Patch,
                handles: list[Handle]) -> None:
        """Put ``new`` in place of ``current`` (or of the original text) as one
        Change, all or nothing: on a failure the hooks and memory are as they were."""
        keep = {site for site, _ in new.routes}
        gone = tuple((site, 0) for site, _ in (current.patch.routes if current else ())
                     if site not in keep)
        code = self._code_writes([new])
        change = Change(code=code, routes=tuple(new.routes) + gone,
                        text=tuple(_transition(current.patch if current else None, new)))
        unhook: list[Callable[[], None]] = []
        try:
            unhook = self._hooks(new, handles)
            self._live().apply(change)
        except BaseException:
            for undo in unhook:
                undo()
            if new.code:
                self._release_code(new.code_address)
            raise
        self._code.wrote(code)
        if current is not None:
            self._retire(current)
        self._own(new, point.address)
        self._splices[point.address] = _Splice(point, new.tactic, new, list(handles), unhook)

    def _commit_many(self, block: int, patches: Sequence[Patch], handles: Sequence[Handle]) -> None:
        """Put fresh patches in (no splice at their points yet) as one Change."""
        code = self._code_writes(patches)
        self._live().apply(Change(code=code, routes=tuple(r for p in patches for r in p.routes),
                                 text=tuple(w for p in patches for w in p.writes)))
        self._code.wrote(code)
        for p, h in zip(patches, handles, strict=True):
            if p.code:
                self._block_of[p.code_address] = block
                self._code_users[block] += 1
            self._own(p, p.point)
            self._splices[p.point] = _Splice(h.point, p.tactic, p, [h])
        self._release_code(block)  # the batch's own hold: the block lives as long as a patch

    def _code_writes(self, patches: Sequence[Patch]) -> tuple[Write, ...]:
        """The patch-area writes that put ``patches``' code in place (the old bytes
        as this Manager last left its areas: no read)."""
        return tuple(Write(p.code_address, self._code.old(p.code_address, len(p.code)), p.code)
                     for p in patches if p.code)

    def _retire(self, splice: _Splice) -> None:
        """Forget an old patch whose text and routes are already gone: its hooks and
        memory."""
        for undo in splice.unhook:
            undo()
        if splice.patch.code:
            self._release_code(splice.patch.code_address)
        self._own(splice.patch, None)

    def _unsplice(self, splices: Sequence[_Splice]) -> None:
        """Take ``splices`` out whole, as one Change: their text restored, then their
        routes cleared; then forget them."""
        self._live().apply(Change(routes=tuple((site, 0) for s in splices for site, _ in s.patch.routes),
                                 text=tuple(w for s in splices for w in s.patch.undo)))
        for splice in splices:
            self._retire(splice)
            del self._splices[splice.point.address]
        if not self._splices:
            self._data.give_back_idle()


def _references(snippet: ast.Node, start: int, end: int) -> bool:
    """Whether ``snippet`` touches memory in [start, end): a Var or an Elem's table
    there (what the verifier lets it write), a Guarded's miss counter, or a constant
    pointing there (read through, or passed to a call)."""
    mask = (1 << 64) - 1

    def meets(lo: int, size: int) -> bool:
        lo &= mask
        return lo < end and start < lo + max(size, 1)

    for node in ast.walk(snippet):
        if isinstance(node, ast.Var):
            if node.segment is None and meets(node.address, node.size):
                return True
        elif isinstance(node, ast.Elem):
            if meets(*node.table):
                return True
        elif isinstance(node, ast.Guarded):
            if node.missed is not None and meets(node.missed, 8):
                return True
        elif isinstance(node, ast.Const):
            if type(node.value) is int and meets(node.value, 1):
                return True
    return False


# --- arguments: a value of the wrong kind is a BadArgument, refused before anything changes ---
def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _int(value: Any, what: str) -> int:
    """``value`` as a plain int; BadArgument for a bool or anything not an int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadArgument(f"{what} must be an int, not {_shown(value)}")
    return int.__int__(value)  # an int subclass's own __int__ or __index__ is not asked


def _var_size(size: Any) -> int:
    size = _int(size, "a variable's size")
    if size not in ACCESS_SIZES:
        raise BadArgument(f"a variable's size must be 1, 2, 4 or 8 bytes, not {size}")
    return size


def _var(var: Any) -> ast.Var:
    """``var`` if it is a Var with an address and size a read or write can use."""
    if not isinstance(var, ast.Var):
        raise BadArgument(f"expected a Var (from malloc), not {_shown(var)}")
    _int(var.address, "a Var's address")
    _var_size(var.size)
    return var


def _point(point: Any) -> Point:
    if not isinstance(point, Point) or isinstance(point.address, bool) or not isinstance(
            point.address, int):
        raise BadArgument(f"expected a Point (from entry_point, point_at, ...), not "
                          f"{_shown(point)}")
    return point


def _code_block(block: Any) -> CodeBlock:
    if not isinstance(block, CodeBlock):
        raise BadArgument(f"expected a CodeBlock (from reserve_code), not {_shown(block)}")
    return block


def _handle(handle: Any) -> Handle:
    if not isinstance(handle, Handle):
        raise BadArgument(f"expected a Handle (from insert_snippet, ...), not {_shown(handle)}")
    return handle


def _items(values: Any, what: str) -> list[Any]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise BadArgument(f"{what} must be a sequence, not {_shown(values)}")
    return list(values)


@contextmanager
def _collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector held off for the length of a batch: planning
    one allocates hundreds of thousands of objects, and with a whole kernel's
    analyses in memory each full collection it triggers walks all of them -- seconds,
    at unpredictable points.  Reference counting still frees what the batch drops;
    cycles wait for the next collection after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
