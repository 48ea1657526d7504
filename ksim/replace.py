"""Function replacement (the KernInst guide, section 6.4).

    r = Replacements(kmgr)
    h = r.replace_function("tcp_sync_mss", comp.symbol("tcp_sync_mss_v2"))  # true replacement
    h = r.replace_call(callsite_address, "other_function")                  # call-site replacement
    r.undo(h)                                                               # the original text again

*True replacement* diverts the original's entry point: a 5-byte ``jmp`` to the
replacement when the instructions it overwrites are safe to overwrite (no branch
lands inside them), else an int3 routed by the target's trap dispatch to the
replacement (which then starts with the caller's registers and stack, as after a
jump).  *Call-site replacement* rewrites the rel32 of one direct ``call``.  Both
assume the replacement takes the same arguments.  A replacement is the entry of
a kernel function (by address or name) or of a component's function
(``ksim.components``); anything else is refused.

Both are instrumentations in the Manager's ledger like any snippet: a snippet
inserted at a replaced entry runs before the replacement is entered, and
removing either keeps the other.  Every refusal comes before the text is
touched; undo restores it byte for byte.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ksim.core import Write
from ksim.errors import NoSafeTactic, ReplacementError
from ksim.kapi import Handle, Manager


@dataclass(frozen=True)
class Replacement:
    id: int
    kind: str            # "function" | "callsite"
    address: int         # the original's entry point, or the call site
    replacement: int
    tactic: str          # "jmp" | "jmp+displace" | "springboard" | "trap" | "call"
    writes: tuple[Write, ...]
    handle: Handle


class Replacements:
    def __init__(self, kmgr: Manager) -> None:
        self.kmgr = kmgr
        self.target = kmgr.target
        self.arch = kmgr.arch
        self.active: dict[int, Replacement] = {}
        self._ids = itertools.count(1)

    def _resolve(self, what: int | str) -> int:
        if isinstance(what, int):
            return what
        return self.kmgr.find_function(what).address

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
        entry = self.kmgr.entry_point(func)
        try:
            handle = self.kmgr.divert(entry, new, splice=splice)
        except NoSafeTactic as exc:
            raise ReplacementError(f"no {splice} splice at {func.name}'s entry: {exc}") from None
        return self._record("function", handle, new)

    def replace_call(self, callsite: int, replacement: int | str) -> Replacement:
        new = self._resolve(replacement)
        handle = self.kmgr.redirect_call(self.kmgr.point_at(callsite), new)
        return self._record("callsite", handle, new)

    def _record(self, kind: str, handle: Handle, new: int) -> Replacement:
        patch = self.kmgr.patch_of(handle)
        r = Replacement(next(self._ids), kind, handle.point.address, new, patch.tactic,
                        patch.writes, handle)
        self.active[r.id] = r
        return r

    def undo(self, r: Replacement) -> None:
        if self.active.get(r.id) is not r:
            raise ReplacementError(f"replacement {r.id} is not in place")
        self.kmgr.remove_snippet(r.handle)
        del self.active[r.id]

    def undo_all(self) -> None:
        for r in list(self.active.values()):
            self.undo(r)
