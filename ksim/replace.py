"""Function replacement (the KernInst guide, section 6.4).

    r = Replacements(kmgr)
    h = r.replace_function("tcp_sync_mss", comp.symbol("tcp_sync_mss_v2"))  # true replacement
    h = r.replace_call(callsite_address, "other_function")                  # call-site replacement
    r.undo(h)                                                               # the original text again

*True replacement* puts an unconditional transfer at the original's first
instruction: a 5-byte ``jmp`` to the replacement when the instructions it
overwrites are safe to overwrite (no branch lands inside them), else an int3
routed by the target's trap dispatch to the replacement (which then starts with
the caller's registers and stack, as after a jump).  *Call-site replacement*
rewrites the rel32 of one direct ``call``.  Both assume the replacement takes
the same arguments.  A replacement is an address, a kernel function's name, or
a function of a component (``ksim.components``) compiled separately.  Every
refusal comes before the text is touched; undo restores it byte for byte.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ksim.arch.base import Flow
from ksim.errors import AlreadySpliced, ReplacementError
from ksim.kapi import Manager
from ksim.splice import hazards, planner
from ksim.splice.patch import Write


@dataclass(frozen=True)
class Replacement:
    id: int
    kind: str            # "function" | "callsite"
    address: int         # the original's entry, or the call site
    replacement: int
    tactic: str          # "jmp" | "trap" | "call"
    writes: tuple[Write, ...]


class Replacements:
    def __init__(self, kmgr: Manager) -> None:
        self.kmgr = kmgr
        self.target = kmgr.target
        self.arch = kmgr.arch
        self.active: dict[int, Replacement] = {}
        self._ids = itertools.count(1)

    def _resolve(self, what: int | str) -> int:
        return what if isinstance(what, int) else self.kmgr.find_function(what).address

    def _busy(self) -> frozenset[int]:
        """Text other splices and replacements have overwritten."""
        out = set(self.kmgr._busy())  # noqa: SLF001 - the Manager's own splices
        for r in self.active.values():
            out |= {a for w in r.writes for a in range(w.address, w.end)}
        return frozenset(out)

    def _check(self, address: int) -> planner.FunctionCode:
        """kprobes-style address checks: boundary, blacklist, already spliced."""
        point = self.kmgr.point_at(address)  # OutsideText, NotOnBoundary
        code = self.kmgr.facts.function_code(point)
        planner.check_point(planner.SpliceRequest(
            point=address, func=code, compile=lambda _a: b"", code_address=address,
            busy=self._busy(), blacklist=self.kmgr.facts.blacklist))
        return code

    def replace_function(self, original: int | str, replacement: int | str,
                         *, splice: str = "auto") -> Replacement:
        start = self._resolve(original)
        new = self._resolve(replacement)
        func = self.target.image.function_at(start)
        if func is None or func.address != start:
            name = func.name if func is not None else "no known function"
            raise ReplacementError(f"{start:#x} is not the entry of {name}")
        if new == start:
            raise ReplacementError("a function cannot replace itself")
        # past an ftrace location, which the kernel owns (the entry point's rule)
        entry = self.kmgr.entry_point(func).address
        code = self._check(entry)
        why = self._jmp_window(code, entry) if splice in ("auto", "jmp") else "trap asked for"
        if why is None and self.arch.jmp_reaches(entry, new):
            old = self.target.read(entry, self.arch.jmp_size)
            jmp = self.arch.jmp(entry, new)
            return self._apply("function", entry, new, "jmp", (Write(entry, old, jmp),))
        if splice == "jmp":
            raise ReplacementError(f"no jmp at {code.name}'s entry: {why or 'out of reach'}")
        # a trap needs one byte: always safe; the dispatch resumes at the replacement
        old = self.target.read(entry, len(self.arch.trap))
        self.target.set_trap(entry, new)
        try:
            return self._apply("function", entry, new, "trap", (Write(entry, old, self.arch.trap),))
        except BaseException:
            self.target.clear_trap(entry)
            raise

    def _jmp_window(self, code: planner.FunctionCode, entry: int) -> str | None:
        """Why a jmp over the instructions from ``entry`` on is unsafe, or None."""
        covered, busy = 0, self._busy()
        for i, insn in enumerate(code.insns[code.index_of(entry):]):
            if covered >= self.arch.jmp_size:
                return None
            if i and insn.address in code.branch_targets:
                return f"a branch lands inside the entry window at {insn.address:#x}"
            if insn.flow in (Flow.CALL, Flow.CALL_INDIRECT) and insn.end - entry < self.arch.jmp_size:
                return "a call returns into the entry window"
            if code.hazards.get(insn.address):
                return (f"the entry window would overwrite {insn.address:#x}, "
                        f"{hazards.describe(code.hazards[insn.address])}")
            if any(a in busy for a in range(insn.address, insn.end)):
                return "the entry window overlaps another splice"
            covered += insn.size
        return None if covered >= self.arch.jmp_size else f"{code.name} is shorter than a jmp"

    def replace_call(self, callsite: int, replacement: int | str) -> Replacement:
        new = self._resolve(replacement)
        code = self._check(callsite)
        insn = code.insns[code.index_of(callsite)]
        if insn.flow is not Flow.CALL or insn.size != 5 or insn.raw[0] != 0xE8:
            raise ReplacementError(f"{insn} is not a direct call rel32")
        rel = new - insn.end
        if not -2**31 <= rel < 2**31:
            raise ReplacementError(f"{new:#x} is out of a call's reach from {callsite:#x}")
        old = self.target.read(callsite, 5)
        if old != insn.raw:
            raise AlreadySpliced(f"the call at {callsite:#x} is already changed")
        call = b"\xe8" + (rel % 2**32).to_bytes(4, "little")
        return self._apply("callsite", callsite, new, "call", (Write(callsite, old, call),))

    def _apply(self, kind: str, address: int, new: int, tactic: str,
               writes: tuple[Write, ...]) -> Replacement:
        self.target.poke(list(writes))
        r = Replacement(next(self._ids), kind, address, new, tactic, writes)
        self.active[r.id] = r
        return r

    def undo(self, r: Replacement) -> None:
        if self.active.get(r.id) is not r:
            raise ReplacementError(f"replacement {r.id} is not in place")
        self.target.poke([w.inverse() for w in reversed(r.writes)])
        if r.tactic == "trap":
            self.target.clear_trap(r.address)
        del self.active[r.id]

    def undo_all(self) -> None:
        for r in list(self.active.values()):
            self.undo(r)
