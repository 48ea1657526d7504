"""Static call graph: which functions each function calls directly.

Only direct calls whose destination is a function's entry are edges; indirect
calls (function pointers, retpoline thunks) are counted per caller but have no
static callee.  Tail calls (direct jumps to another function's entry) are kept
apart, since the callee then returns to the caller's caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ksim.analysis.function import analyze
from ksim.arch.base import Flow
from ksim.image.image import Image
from ksim.image.model import Function


def callees(image: Image, function: Function | str) -> list[Function]:
    """Functions ``function`` calls directly, by address."""
    return analyze(image, function).callees


@dataclass
class CallGraph:
    #: caller name -> names of functions it calls directly
    calls: dict[str, set[str]] = field(default_factory=dict)
    #: caller name -> names of functions it tail-calls (direct jmp to their entry)
    tail_calls: dict[str, set[str]] = field(default_factory=dict)
    #: caller name -> number of indirect call sites
    indirect: dict[str, int] = field(default_factory=dict)

    def callees(self, name: str) -> set[str]:
        return set(self.calls.get(name, ()))

    def callers(self, name: str) -> set[str]:
        return {caller for caller, called in self.calls.items() if name in called}

    def reachable_from(self, name: str) -> set[str]:
        """Every function reachable from ``name`` by direct calls and tail calls."""
        seen = {name}
        work = [name]
        while work:
            cur = work.pop()
            for nxt in self.calls.get(cur, set()) | self.tail_calls.get(cur, set()):
                if nxt not in seen:
                    seen.add(nxt)
                    work.append(nxt)
        return seen


def call_graph(image: Image, functions: Iterable[Function] | None = None) -> CallGraph:
    """The call graph over ``functions`` (default: every function of the image).

    Scans each function's control flow by linear sweep only (no CFG, no register
    effects), which is what a whole kernel needs to stay affordable.
    """
    from ksim.analysis.abi import support_for

    scan = support_for(image.arch).flows
    graph = CallGraph()
    for func in functions if functions is not None else image.functions:
        calls: set[str] = set()
        tails: set[str] = set()
        indirect = 0
        for _addr, _size, flow, target in scan(image.read(func.address, func.size), func.address):
            if flow is Flow.CALL_INDIRECT:
                indirect += 1
            elif flow in (Flow.CALL, Flow.JMP) and target is not None:
                if target in func:
                    continue
                callee = image.function_at(target)
                if callee is not None and callee.address == target:
                    (calls if flow is Flow.CALL else tails).add(callee.name)
        graph.calls[func.name] = calls
        if tails:
            graph.tail_calls[func.name] = tails
        if indirect:
            graph.indirect[func.name] = indirect
    return graph
