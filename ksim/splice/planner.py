"""The splice planner: pure functions from code facts to a :class:`Patch`.

Nothing here touches a target.  Given the instructions of the function around a
point, the branch targets the CFG knows, the registers live at the point, the
snippets and an address in the patch area, :func:`plan` returns the writes that
splice the point and the patch code that goes with them.  Tactics are tried in
order (as in e9patch), each returning a Patch or a reason why it cannot:

``jmp``          a 5-byte ``jmp rel32`` over the instruction at the point (>= 5 bytes);
``jmp+displace`` the same when the first instruction is shorter: the following
                 instructions are displaced into the patch too, but only when no
                 other branch lands inside the overwritten bytes and they stay in
                 the function (KernInst's rule: a thread must never resume in the
                 middle of a rewritten window);
``springboard``  a 2-byte short jump to a 5-byte jump placed in nearby padding
                 between functions (where the 5-byte window is not safe);
``trap``         a 1-byte trap instruction; the target's trap dispatch sends the hit
                 to the patch (always safe when the instruction can be relocated).

The patch code is the same for every tactic: the snippets, then the displaced
original instructions relocated, then a jump back after them.  A trap dispatch
arrives at the patch with the registers, flags and stack of the interrupted
code, exactly as a jump would, so one patch layout serves all tactics.

Everything that instruments one point shares its one patch, so re-planning
the point keeps all of it:

* a *post stage* (kprobes' post handler) goes right after the relocated
  instruction at the point, before the rest of the window; it may begin with a
  trap routed to just after itself (an emulator's Python post handler);
* a *divert* (function replacement) ends the patch with a jump to the
  replacement instead of the original instructions; with nothing else at the
  point the splice goes straight to the replacement (no patch code at all).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from ksim.arch.base import Arch, Flow, Insn
from ksim.core import Write
from ksim.errors import (
    AlreadySpliced,
    HandlerUnsupported,
    KsimError,
    NoSafeTactic,
    NotOnBoundary,
    OutsideText,
    RelocationError,
    TrapUnavailable,
    UnknownPolicy,
)
from ksim.splice import hazards as hz
from ksim.splice.patch import Patch

#: the tactics, cheapest first (cost per hit: a jump, two jumps, a trap)
JMP_TACTICS = ("jmp", "jmp+displace", "springboard")
#: the springboard tactic's refusal when every slot in reach is taken or none exists
NO_SLOT = "no free padding within short-jump reach"

POLICIES: dict[str, tuple[str, ...]] = {
    "jmp": JMP_TACTICS,
    "trap": ("trap",),
    "auto": JMP_TACTICS + ("trap",),
}
#: the policies proper (POLICIES also takes each tactic by name)
_POLICY_NAMES = tuple(POLICIES)

#: instruction kinds that may be displaced (moved into the patch) behind the point.
#: A call may only be the last one: it is moved as a transfer to the callee with
#: the original return address on the stack (Arch.moved_call: x86-64 pushes it and
#: jumps, or, through memory, reads the operand first and returns to the callee), so
#: nothing after it may be in the patch.
#: A displaced STOP/RET/JMP ends the run, so it may only be the last one too.
_DISPLACEABLE = frozenset({Flow.SEQ, Flow.JCC})
_ENDS_RUN = frozenset({Flow.JMP, Flow.RET, Flow.JMP_INDIRECT, Flow.STOP})


@dataclass(frozen=True)
class FunctionCode:
    """What the planner needs to know about the function around a point."""

    name: str
    start: int
    end: int
    insns: Sequence[Insn]
    #: every address some branch (direct, jump table, or the entry itself) may reach
    branch_targets: frozenset[int]
    #: an indirect jump whose destinations are unknown: displacement is unsafe
    unknown_indirect: bool = False
    #: alignment filler right after the function (never executed, no symbol):
    #: a window ending in a ret/jmp may spill over it
    tail: bytes = b""
    #: instruction address -> why the kernel needs that instruction left alone
    #: (names of ksim.splice.hazards.HAZARDS); such an instruction is never moved
    hazards: Mapping[int, frozenset[str]] = field(default_factory=dict)
    #: every instruction's start when known without its object (``insns`` may then
    #: decode each when first indexed: ksim.analysis.record.Instructions)
    addresses: Sequence[int] | None = None

    def index_of(self, address: int) -> int:
        if self.addresses is not None:
            i = bisect.bisect_left(self.addresses, address)
            if i < len(self.addresses) and self.addresses[i] == address:
                return i
            raise NotOnBoundary(f"{address:#x} is not on an instruction boundary of {self.name}")
        lo, hi = 0, len(self.insns)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.insns[mid].address < address:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.insns) and self.insns[lo].address == address:
            return lo
        raise NotOnBoundary(f"{address:#x} is not on an instruction boundary of {self.name}")


@dataclass(frozen=True)
class SpliceRequest:
    """One planning question: splice ``point`` of ``func`` with this code."""

    point: int
    func: FunctionCode
    #: compile(address) -> the snippets' machine code placed at ``address``
    compile: Callable[[int], bytes]
    #: where the patch code goes
    code_address: int
    policy: str = "auto"
    #: addresses already overwritten by other splices (their windows)
    busy: Container[int] = frozenset()
    #: free padding slots usable for springboards: (address, current bytes); only the
    #: springboard tactic reads them (they may be found when it first does)
    padding: Sequence[tuple[int, bytes]] = ()
    #: blacklisted ranges (start, end): never splice there
    blacklist: tuple[tuple[int, int], ...] = ()
    #: (start, end, why) of code that runs before the kernel's trap dispatch exists:
    #: the trap tactic is refused there (SiteFacts.trap_unready)
    trap_unready: tuple[tuple[int, int, str], ...] = ()
    #: post(address) -> the post stage's code placed at ``address``: it runs right
    #: after the instruction at the point (which must fall through)
    post: Callable[[int], bytes] | None = None
    #: the post stage begins with a trap routed to just after it
    post_trap: bool = False
    #: where the point's code continues instead of the original instructions
    #: (function replacement): the window is overwritten, never run
    divert: int | None = None

    @property
    def direct(self) -> bool:
        """A divert with nothing else at the point: the splice goes straight to it."""
        return (self.divert is not None and self.post is None
                and not self.compile(self.code_address))

    @property
    def dest(self) -> int:
        """Where the splice sends execution: the patch code, or the divert."""
        return self.divert if self.direct and self.divert is not None else self.code_address


@dataclass(frozen=True)
class Refusal:
    tactic: str
    reason: str


@dataclass
class PlanReport:
    """What each tactic said; filled by :func:`plan` for error messages and coverage."""

    refusals: list[Refusal] = field(default_factory=list)


def plan(arch: Arch, req: SpliceRequest, report: PlanReport | None = None) -> Patch:
    """Return the Patch of the first tactic (in policy order) that can splice the point.

    Raises NotOnBoundary / OutsideText / Blacklisted / AlreadySpliced before
    trying tactics, and NoSafeTactic (with every tactic's reason) when none fits.
    """
    return plan_with(arch, req, policy_tactics(req.policy), report)


def policy_tactics(policy: str) -> tuple[str, ...]:
    """The tactics a policy tries, in order; UnknownPolicy, naming the policies,
    for anything else."""
    tactics = POLICIES.get(policy) if isinstance(policy, str) else None
    if tactics is None:
        shown = repr(policy) if isinstance(policy, str) else f"{type(policy).__name__} {policy!r}"
        singles = [p for p in POLICIES if p not in _POLICY_NAMES]
        raise UnknownPolicy(f"unknown splice policy {shown[:80]}: the policies are "
                            f"{', '.join(_POLICY_NAMES)} (or one tactic by name: "
                            f"{', '.join(singles)})")
    return tactics


def plan_with(arch: Arch, req: SpliceRequest, tactics: Sequence[str],
              report: PlanReport | None = None) -> Patch:
    """:func:`plan` with the given tactics, in order, in place of the policy's."""
    check_point(arch, req)
    if tuple(tactics) == ("trap",):
        why = _trap_unready(req)
        if why is not None:
            raise TrapUnavailable(f"{req.point:#x} ({req.func.name}+{req.point - req.func.start:#x}): "
                                  f"{why}; a trap there cannot be routed (the kernel would die), "
                                  "a jump can splice it (policy jmp or auto)")
    report = report if report is not None else PlanReport()
    for tactic in tactics:
        result = TACTICS[tactic](arch, req)
        if isinstance(result, Patch):
            return result
        report.refusals.append(Refusal(tactic, result))
    raise NoSafeTactic(req.point, {r.tactic: r.reason for r in report.refusals})


def plan_batch(arch: Arch, reqs: Sequence[SpliceRequest], bounds: Sequence[int], block: int,
               busy: Container[int], prepare: Callable[[Sequence[int]], None] | None = None
               ) -> tuple[list[Patch | None], dict[int, NoSafeTactic]]:
    """Plan many points at once: each request's patch code at ``block`` plus the
    bounds of the requests before it, every window ``busy`` for the others.

    Points whose policy puts the springboard after other tactics try those first,
    in order; the points left for springboards then share the padding slots by a
    maximum matching (each point's slots are the ones it reaches), so that a slot
    the first of two points would take is left to the second when it is the only
    one that point reaches.  What gets no slot takes the policy's later tactics
    (the trap), or is refused.  ``prepare``, when given, is told the points left
    for springboards before their padding is looked at (a live target asks about
    all of it at once).  Returns each request's patch (None when refused) and the
    refusals, by index."""
    claimed = _Claimed(busy)
    at = list(accumulate(bounds[:-1], initial=block)) if reqs else []
    patches: list[Patch | None] = [None] * len(reqs)
    refused: dict[int, NoSafeTactic] = {}
    waiting: dict[int, tuple[tuple[str, ...], PlanReport]] = {}

    def claim(i: int, patch: Patch) -> None:
        if len(patch.code) > bounds[i]:
            raise KsimError(f"patch code ({len(patch.code)} bytes) outgrew its bound")
        claimed.take(overwritten(patch))
        patches[i] = patch

    def placed(i: int, **changes: Any) -> SpliceRequest:
        return replace(reqs[i], busy=claimed, code_address=at[i], **changes)

    for i, req in enumerate(reqs):
        tactics = policy_tactics(req.policy)
        k = tactics.index("springboard") if "springboard" in tactics else len(tactics)
        report = PlanReport()
        try:
            claim(i, plan_with(arch, placed(i), tactics[:k], report))
        except NoSafeTactic as exc:
            if k == len(tactics):
                refused[i] = exc
            else:
                waiting[i] = (tactics[k + 1:], report)
    if prepare is not None and waiting:
        prepare([reqs[i].point for i in waiting])
    slots = {i: springboard_slots(arch, placed(i)) for i in waiting}
    match = _match({i: [lo for lo, _ in s] for i, s in slots.items() if not isinstance(s, str)})
    for i, (later, report) in waiting.items():
        found = slots[i]
        if i in match:
            only = tuple(slot for slot in reqs[i].padding if slot[0] == match[i])
            try:
                claim(i, plan_with(arch, placed(i, padding=only), ("springboard",), report))
                continue
            except NoSafeTactic:
                pass
        elif isinstance(found, str):
            report.refusals.append(Refusal("springboard", found))
        elif not found:
            report.refusals.append(Refusal("springboard", NO_SLOT))
        else:
            report.refusals.append(Refusal("springboard", f"{NO_SLOT}: the batch's other "
                                                          "springboards hold every slot it reaches"))
        try:
            claim(i, plan_with(arch, placed(i), later, report))
        except NoSafeTactic as exc:
            refused[i] = exc
    return patches, refused


class _Claimed:
    """``busy`` and the bytes a batch's patches overwrite so far."""

    __slots__ = ("_busy", "_mine")

    def __init__(self, busy: Container[int]) -> None:
        self._busy, self._mine = busy, set[int]()

    def take(self, addresses: Iterable[int]) -> None:
        self._mine.update(addresses)

    def __contains__(self, address: object) -> bool:
        return address in self._mine or address in self._busy


def _match(wants: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """A maximum matching of points to slots (Kuhn's augmenting paths, breadth first),
    points tried in order, each point's slots in its own order: point -> slot."""
    slot_of: dict[int, int] = {}
    point_of: dict[int, int] = {}
    for root in wants:
        came: dict[int, int] = {}  # slot -> the point whose search reached it
        queue, head, free = [root], 0, None
        while head < len(queue) and free is None:
            point = queue[head]
            head += 1
            for slot in wants[point]:
                if slot in came:
                    continue
                came[slot] = point
                if slot not in point_of:
                    free = slot
                    break
                queue.append(point_of[slot])
        while free is not None:  # flip the path: each point on it takes the next slot
            point = came[free]
            before = slot_of.get(point)
            slot_of[point], point_of[free] = free, point
            free = before
    return slot_of


def check_point(arch: Arch, req: SpliceRequest) -> None:
    """Every check that does not depend on the tactic (kprobes' check_kprobe_address_safe).

    Every tactic moves the instruction at the point, so a hazard there refuses
    the point itself, with the hazard's own error class."""
    func = req.func
    if not (func.start <= req.point < func.end):
        raise OutsideText(f"{req.point:#x} is outside {func.name} ({func.start:#x}..{func.end:#x})")
    first = func.insns[func.index_of(req.point)]  # NotOnBoundary
    found = _must_stay(arch, func, first)
    if any(lo <= req.point < hi for lo, hi in req.blacklist):
        found.add("blacklist")
    if found:
        raise hz.error_for(req.point, found, what=f"{func.name}+{req.point - func.start:#x}")
    if req.point in req.busy:
        raise AlreadySpliced(f"{req.point:#x} lies inside bytes another splice overwrote")
    if req.post is not None and req.divert is not None:
        raise HandlerUnsupported(f"{req.point:#x} is diverted (replaced): the instruction "
                                 "there never runs, so it has no post stage")
    if req.post is not None and first.flow is not Flow.SEQ:
        raise HandlerUnsupported(f"a post handler needs an instruction that falls through; "
                                 f"{first.mnemonic} at {first.address:#x} does not")


def _must_stay(arch: Arch, func: FunctionCode, insn: Insn) -> set[str]:
    """Why ``insn`` may be neither overwritten nor moved: its hazards, and a
    breakpoint that is not ours (another instrumenter's)."""
    found = set(func.hazards.get(insn.address, ()))
    if arch.is_breakpoint(insn) and not found & {"bug", "warn"}:
        # (a BUG/WARN site's breakpoint, where the architecture's BUG is one, is the
        # kernel's own: refused as that)
        found.add("breakpoint")
    try:
        index = func.index_of(insn.address)
    except NotOnBoundary:  # filler a window spills over, past the function's code
        return found
    if arch.in_exclusive_sequence(func.insns, index):
        found.add("exclusive")
    return found


# --- the window of instructions a tactic overwrites ----------------------------------
def _window(arch: Arch, req: SpliceRequest, size: int) -> tuple[Insn, ...] | str:
    """The instructions that must move to the patch so that ``size`` bytes at the
    point can be overwritten; or the reason why that is unsafe.  The window may
    spill over the filler after the function when its last instruction never
    falls through (a 1-byte ``ret`` function followed by padding)."""
    func = req.func
    i = func.index_of(req.point)
    run: list[Insn] = []
    covered = 0
    while covered < size:
        if i >= len(func.insns):
            spill = size - covered
            if run and run[-1].flow in _ENDS_RUN and len(func.tail) >= spill and not any(
                    a in req.busy for a in range(func.end, func.end + spill)):
                break
            return f"the {size}-byte window runs past the end of {func.name}"
        insn = func.insns[i]
        if run:
            if insn.address in func.branch_targets:
                return f"a branch lands inside the {size}-byte window (at {insn.address:#x})"
            if run[-1].flow in _ENDS_RUN:
                return f"the {size}-byte window runs past an unconditional transfer at {run[-1].address:#x}"
            if insn.flow not in _DISPLACEABLE and insn.flow not in _ENDS_RUN and (
                    insn.flow not in (Flow.CALL, Flow.CALL_INDIRECT)):
                return f"cannot displace {insn.mnemonic} at {insn.address:#x}"
            found = _must_stay(arch, func, insn)
            if found:
                return f"the {size}-byte window would move {insn.address:#x}, {hz.describe(found)}"
        if insn.address != req.point and any(
            a in req.busy for a in range(insn.address, insn.end)
        ):
            return f"the window overlaps another splice at {insn.address:#x}"
        run.append(insn)
        covered += insn.size
        i += 1
    if len(run) > 1 and func.unknown_indirect:
        return "the function has an indirect jump whose targets are unknown"
    if any(insn.flow in (Flow.CALL, Flow.CALL_INDIRECT) for insn in run[:-1]):
        return "a call would be displaced with instructions after it"
    return tuple(run)


def _patch_code(arch: Arch, req: SpliceRequest,
                moved: Sequence[Insn]) -> tuple[bytes, int | None] | str:
    """snippets + relocated originals + jump back (the same for every tactic), with
    the post stage (if any) after the first of them; or why the moved instructions
    cannot be relocated.  Returns the code and where its post stage begins.

    A call among the moved instructions (only ever the last), direct or
    indirect, is moved by ``Arch.moved_call``: it pushes the original return
    address and jumps, so the callee returns to the original text, never into
    the patch; the patch can be freed while the callee still runs (a task asleep
    in schedule() when the splice is removed) and unwinders see the real caller."""
    at = req.code_address
    if req.direct:
        return b"", None
    code = req.compile(at)
    if req.divert is not None:
        if not arch.jmp_reaches(at + len(code), req.divert):
            return f"the replacement at {req.divert:#x} is out of jmp reach of the patch"
        return code + arch.jmp(at + len(code), req.divert), None

    def moved_code(insns: Sequence[Insn], where: int) -> bytes:
        # a branch of the window back to the point (a loop head) arrives at the
        # point again: it goes to the patch's entry, so the snippets run on every arrival
        if insns[-1].flow in (Flow.CALL, Flow.CALL_INDIRECT):
            head = arch.relocate(insns[:-1], where, first_to=at) if len(insns) > 1 else b""
            return head + arch.moved_call(insns[-1], where + len(head))
        return arch.relocate(insns, where, first_to=at)

    chunks = [moved[:1], moved[1:]] if req.post is not None else [moved]
    post_at = None
    try:
        for i, chunk in enumerate(chunks):
            if chunk:
                code += moved_code(chunk, at + len(code))
            if i == 0 and req.post is not None:
                post_at = at + len(code)
                if req.post_trap:
                    code += arch.trap
                code += req.post(at + len(code))
    except RelocationError as exc:
        return f"cannot move the original instructions: {exc}"
    last = moved[-1]
    if last.flow not in (Flow.CALL, Flow.CALL_INDIRECT):
        code += arch.jmp(at + len(code), last.end)
    return code, post_at


def _patch(arch: Arch, req: SpliceRequest, tactic: str, moved: Sequence[Insn],
           writes: Sequence[Write], *, trap: bool = False) -> Patch | str:
    """The Patch of a tactic that overwrites ``writes`` and moves ``moved``."""
    built = _patch_code(arch, req, moved)
    if isinstance(built, str):
        return built
    code, post_at = built
    routes = [(req.point, req.dest)] if trap else []
    if req.post_trap and post_at is not None:
        routes.append((post_at, post_at + len(arch.trap)))
    return Patch(req.point, tactic, req.code_address, code, tuple(writes),
                 trap_site=req.point if trap else None, routes=tuple(routes), post_at=post_at)


def _overwrite(moved: Sequence[Insn], head: bytes, pad: int, tail: bytes = b"") -> Write:
    """Replace the moved instructions (and, if they are too short, the start of the
    filler after them) by ``head`` followed by pad bytes (never executed)."""
    old = b"".join(insn.raw for insn in moved)
    if len(old) < len(head):
        old += tail[: len(head) - len(old)]
    return Write(moved[0].address, old, head + bytes([pad]) * (len(old) - len(head)))


def _tactic_jmp(arch: Arch, req: SpliceRequest, *, displace: bool) -> Patch | str:
    if not arch.jmp_reaches(req.point, req.dest):
        return f"{'the patch area' if req.dest == req.code_address else 'the replacement'} " \
               f"at {req.dest:#x} is out of jmp range"
    moved = _window(arch, req, arch.jmp_size)
    if isinstance(moved, str):
        return moved
    if displace != (len(moved) > 1):
        return ("not needed: the instruction at the point suffices" if displace else
                f"the instruction at the point is {moved[0].size} bytes, "
                f"shorter than a {arch.jmp_size}-byte jmp")
    write = _overwrite(moved, arch.jmp(req.point, req.dest), arch.pad_byte, req.func.tail)
    return _patch(arch, req, "jmp+displace" if displace else "jmp", moved, (write,))


def springboard_slots(arch: Arch, req: SpliceRequest) -> tuple[tuple[int, bytes], ...] | str:
    """Every free padding slot a springboard at the point can use (in ``req.padding``
    order, with the bytes its jump replaces), or why the point takes no short jump."""
    found = _springboard(arch, req)
    return found if isinstance(found, str) else found[1]


def _springboard(arch: Arch, req: SpliceRequest
                 ) -> tuple[tuple[Insn, ...], tuple[tuple[int, bytes], ...]] | str:
    """The short jump's window and the free slots it reaches, or why it has none."""
    moved = _window(arch, req, arch.short_jmp_size)
    if isinstance(moved, str):
        return moved
    # the window itself may spill into the padding: its bytes are no slot
    window_end = max(moved[-1].end, req.point + arch.short_jmp_size)
    return tuple(moved), tuple(
        (lo, filler[: arch.jmp_size])
        for lo, filler in req.padding
        if len(filler) >= arch.jmp_size
        and (lo >= window_end or lo + arch.jmp_size <= req.point)
        and arch.short_jmp_reaches(req.point, lo)
        and arch.jmp_reaches(lo, req.dest)
        and not any(a in req.busy for a in range(lo, lo + arch.jmp_size))
    )


def _tactic_springboard(arch: Arch, req: SpliceRequest) -> Patch | str:
    found = _springboard(arch, req)
    if isinstance(found, str):
        return found
    moved, slots = found
    if not slots:
        return NO_SLOT
    slot = slots[0]
    board = Write(slot[0], slot[1], arch.jmp(slot[0], req.dest))
    head = _overwrite(moved, arch.short_jmp(req.point, slot[0]), arch.pad_byte, req.func.tail)
    # the board goes in first: the short jump must never land on padding
    return _patch(arch, req, "springboard", moved, (board, head))


def _trap_unready(req: SpliceRequest) -> str | None:
    """Why a trap at the point could not be routed (None: it can)."""
    return next((why for lo, hi, why in req.trap_unready if lo <= req.point < hi), None)


def _tactic_trap(arch: Arch, req: SpliceRequest) -> Patch | str:
    why = _trap_unready(req)
    if why is not None:
        return f"{why}; a trap there cannot be routed"
    first = req.func.insns[req.func.index_of(req.point)]
    write = Write(req.point, first.raw[: len(arch.trap)], arch.trap)
    return _patch(arch, req, "trap", (first,), (write,), trap=True)


TACTICS: dict[str, Callable[[Arch, SpliceRequest], Patch | str]] = {
    "jmp": lambda arch, req: _tactic_jmp(arch, req, displace=False),
    "jmp+displace": lambda arch, req: _tactic_jmp(arch, req, displace=True),
    "springboard": _tactic_springboard,
    "trap": _tactic_trap,
}
# a single tactic may be asked for by name too (re-planning keeps a point's tactic)
POLICIES.update({name: (name,) for name in TACTICS if name not in POLICIES})


def patch_size_bound(arch: Arch, req: SpliceRequest) -> int:
    """An upper bound on the patch code size, to allocate before the final plan:
    the snippets at a provisional address, plus generous room for relocation
    (each displaced instruction can grow, e.g. jcc rel8 -> rel32) and the jump back."""
    body = len(req.compile(req.code_address))
    if req.post is not None:
        body += len(req.post(req.code_address)) + len(arch.trap)
    return body + 4 * 16 + 2 * arch.jmp_size + 16


def overwritten(patch: Patch) -> frozenset[int]:
    """Every text address a patch's writes change (its 'busy' footprint)."""
    return frozenset(a for w in patch.writes for a in range(w.address, w.end))
