"""Facts about splice sites, taken from the analysis, in the form the planner wants.

This is the only place that knows both the analysis (CFG, liveness) and the
planner's inputs (FunctionCode, padding slots, the blacklist), so neither has to
know the other.
"""

from __future__ import annotations

import bisect
from collections.abc import Container
from functools import cached_property, lru_cache

from ksim.analysis.cfg import EdgeKind
from ksim.analysis.function import FunctionAnalysis, analyze
from ksim.analysis.points import Point, PointKind, is_filler_insn, is_padding
from ksim.arch.base import Arch, Flow
from ksim.errors import KsimError, OutsideText
from ksim.image.model import Function
from ksim.splice.planner import FunctionCode

#: code ksim must never splice, as (start symbol, end symbol) pairs: the Linux
#: sections kprobes refuses (kernel/kprobes.c: within_kprobe_blacklist and the
#: noinstr/entry sections), and the toy kernel's own trap path and boot code.
BLACKLIST_RANGES = (
    ("__kprobes_text_start", "__kprobes_text_end"),
    ("__noinstr_text_start", "__noinstr_text_end"),
    ("__entry_text_start", "__entry_text_end"),
    ("__irqentry_text_start", "__irqentry_text_end"),
    ("__ksim_noinstr_start", "__ksim_noinstr_end"),
)
#: single functions on the trap path (an int3 there would recurse)
BLACKLIST_FUNCTIONS = (
    "do_int3", "exc_int3", "notify_die", "atomic_notifier_call_chain", "poke_int3_handler",
    "kprobe_int3_handler", "ksim_halt",
)


class SiteFacts:
    """Site facts for one image.  Functions are resolved by address wherever a
    point is given: kernels have several static functions of the same name."""

    def __init__(self, image, arch: Arch) -> None:  # image: ksim.image.Image
        self.image = image
        self.arch = arch
        self._starts = [f.address for f in image.functions]

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
        return Point(self.analysis(func).points.entry, PointKind.ENTRY, func.name)

    def points(self, func: Function, kind: PointKind) -> list[Point]:
        p = self.analysis(func).points
        addresses = {PointKind.EXIT: p.exits, PointKind.BLOCK: p.blocks,
                     PointKind.CALLSITE: p.callsites}[kind]
        return [Point(a, kind, func.name) for a in addresses]

    def point_at(self, address: int) -> Point:
        func = self.image.function_at(address)
        if func is None:
            raise OutsideText(f"{address:#x} is not inside a known function")
        fa = self.analysis(func)
        fa.insn_at(address)  # NotOnBoundary if it is not an instruction start
        p = fa.points
        kind = (PointKind.ENTRY if address == p.entry else PointKind.EXIT if address in p.exits
                else PointKind.CALLSITE if address in p.callsites
                else PointKind.BLOCK if address in p.blocks else PointKind.INSN)
        return Point(address, kind, func.name)

    def live_at(self, point: Point) -> frozenset[str]:
        return self.analysis(point).live_at(point.address)

    # --- what the planner needs -------------------------------------------------------
    def function_code(self, what: Function | Point | str) -> FunctionCode:
        return self._function_code(self.function_of(what))

    @lru_cache(maxsize=8192)  # noqa: B019 - one SiteFacts per attached image
    def _function_code(self, func: Function) -> FunctionCode:
        """The function's code for the planner.  Trailing alignment filler that no
        path reaches (int3/nop blocks, which kallsyms-derived extents include) is
        not code: it becomes the ``tail`` a window may spill over, together with
        the filler between this function and the next."""
        fa = self.analysis(func)
        cfg = fa.cfg
        code_end = func.end
        for block in reversed(list(cfg.blocks.values())):
            if block.start < code_end and block.end >= code_end and is_padding(block):
                code_end = block.start
            else:
                break
        if code_end == func.address:  # all filler: keep it as it is
            code_end = func.end
        targets = {func.address}
        targets |= {e.dst for e in cfg.edges if e.kind is not EdgeKind.FALLTHROUGH}
        targets |= {i.target for i in cfg.insns
                    if i.flow in (Flow.JMP, Flow.JCC) and i.target is not None}
        for table in cfg.tables.values():
            targets |= set(table.entries)
        inner = self.image.read(code_end, func.end - code_end) if code_end < func.end else b""
        return FunctionCode(
            name=func.name, start=func.address, end=code_end,
            insns=tuple(i for i in cfg.insns if i.address < code_end),
            branch_targets=frozenset(targets),
            unknown_indirect=bool(cfg.unresolved) or bool(cfg.misaligned),
            tail=inner + self._gap_after(func),
        )

    def _gap_after(self, func: Function) -> bytes:
        """The filler between ``func`` and the next function, if it is only filler."""
        i = bisect.bisect_left(self._starts, func.end)
        end = self._starts[i] if i < len(self._starts) else func.end
        if not (0 < end - func.end <= 64) or not self.image.is_text(func.end):
            return b""
        data = self.image.read(func.end, end - func.end)
        return data if _is_filler(self.arch, data, func.end) else b""

    def padding_slots(self, near: int, busy: Container[int]) -> tuple[tuple[int, bytes], ...]:
        """Free jmp-sized slots in the filler after the functions around ``near``
        (within short-jump reach), with their original bytes."""
        size, reach = self.arch.jmp_size, 128 + self.arch.short_jmp_size
        lo = bisect.bisect_left(self._starts, near - 4 * reach)
        hi = bisect.bisect_right(self._starts, near + reach)
        out = []
        for func in self.image.functions[max(lo - 1, 0):hi]:
            try:
                code = self.function_code(func)
            except KsimError:  # undecodable or unanalysable neighbour: no slots there
                continue
            for start in range(code.end, code.end + len(code.tail) - size + 1, size):
                if abs(start - near) > reach or any(a in busy for a in range(start, start + size)):
                    continue
                out.append((start, code.tail[start - code.end:start - code.end + size]))
        return tuple(out)

    @cached_property
    def blacklist(self) -> tuple[tuple[int, int], ...]:
        ranges = []
        for start, end in BLACKLIST_RANGES:
            try:
                ranges.append((self.image.address_of(start), self.image.address_of(end)))
            except KsimError:  # the image has no such section
                continue
        for name in BLACKLIST_FUNCTIONS:
            if self.image.has_function(name):
                f = self.image.function(name)
                ranges.append((f.address, f.end))
        return tuple(ranges)


def _is_filler(arch: Arch, data: bytes, address: int) -> bool:
    if all(b == arch.pad_byte for b in data):
        return True
    covered = 0
    for insn in arch.decode(data, address):
        if not is_filler_insn(insn):
            return False
        covered += insn.size
    return covered == len(data)
