"""Strongly connected components of what one node reaches (Tarjan's algorithm,
without recursion: a kernel's call chains run thousands deep).

The clobber analysis (a function writes what every function of its component and
below writes) and the analysis store's ``settled`` (a function's derived facts hold
while everything it reaches is current) both answer per component, callees first.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from typing import TypeVar

N = TypeVar("N", bound=Hashable)


def components(root: N, successors: Callable[[N], Sequence[N]],
               skip: Container[N] = frozenset()) -> Iterator[list[N]]:
    """The strongly connected components of the nodes ``root`` reaches, each given
    once it is complete: a component comes after every component it reaches (callees
    before callers), ``root``'s last.  A node in ``skip`` is not entered (its answer is
    known); ``skip`` is looked at as the walk goes, so a caller that records each
    component's answer in it before asking for the next keeps the walk from entering
    them again.  ``successors`` is asked once per node entered."""
    index: dict[N, int] = {}
    low: dict[N, int] = {}
    edges: dict[N, Sequence[N]] = {}
    stack: list[N] = []
    on_stack: set[N] = set()

    def enter(x: N) -> None:
        index[x] = low[x] = len(index)
        edges[x] = successors(x)
        stack.append(x)
        on_stack.add(x)

    enter(root)
    frames: list[tuple[N, int]] = [(root, 0)]     # (node, its next edge)
    while frames:
        x, k = frames[-1]
        if k < len(edges[x]):
            frames[-1] = (x, k + 1)
            y = edges[x][k]
            if y in skip:
                continue
            if y not in index:
                enter(y)
                frames.append((y, 0))
            elif y in on_stack:
                low[x] = min(low[x], index[y])
            continue
        frames.pop()
        if frames:
            parent = frames[-1][0]
            low[parent] = min(low[parent], low[x])
        if low[x] != index[x]:
            continue
        members = []
        while True:
            m = stack.pop()
            on_stack.discard(m)
            members.append(m)
            if m == x:
                break
        yield members
