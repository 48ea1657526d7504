"""Facts about splice sites, taken from the analysis, in the form the planner wants.

This is the only place that knows both the analysis (CFG, liveness) and the
planner's inputs (FunctionCode, padding slots, the blacklist), so neither has to
know the other.
"""

from __future__ import annotations

import bisect
from functools import cached_property, lru_cache

from ksim.analysis.cfg import EdgeKind
from ksim.analysis.function import FunctionAnalysis, analyze
from ksim.analysis.points import Point, PointKind
from ksim.arch.base import Arch, Flow
from ksim.errors import OutsideText
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
    def __init__(self, image, arch: Arch) -> None:  # image: ksim.image.Image
        self.image = image
        self.arch = arch

    # --- analysis -------------------------------------------------------------------
    def analysis(self, func: Function | str) -> FunctionAnalysis:
        return analyze(self.image, func)

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
        return self.analysis(point.function).live_at(point.address)

    # --- what the planner needs -------------------------------------------------------
    @lru_cache(maxsize=4096)  # noqa: B019 - one SiteFacts per attached image
    def function_code(self, name: str) -> FunctionCode:
        fa = self.analysis(name)
        cfg = fa.cfg
        targets = {fa.function.address}
        targets |= {e.dst for e in cfg.edges if e.kind is not EdgeKind.FALLTHROUGH}
        targets |= {i.target for i in cfg.insns
                    if i.flow in (Flow.JMP, Flow.JCC) and i.target is not None}
        for table in cfg.tables.values():
            targets |= set(table.entries)
        return FunctionCode(
            name=fa.function.name, start=fa.function.address, end=fa.function.end,
            insns=tuple(cfg.insns), branch_targets=frozenset(targets),
            unknown_indirect=bool(cfg.unresolved) or bool(cfg.misaligned),
            tail=self._tail(fa.function),
        )

    def _tail(self, func: Function) -> bytes:
        """The filler between ``func`` and the next function, if it is only filler."""
        later = [f.address for f in self.image.functions if f.address >= func.end]
        end = min(later, default=func.end)
        if not (0 < end - func.end <= 64) or not self.image.is_text(func.end):
            return b""
        data = self.image.read(func.end, end - func.end)
        return data if _is_filler(self.arch, data, func.end) else b""

    @cached_property
    def _padding(self) -> list[tuple[int, int]]:
        """Free slots of jmp_size bytes in the padding between functions: bytes no
        symbol covers, that are all trap/nop filler, inside text."""
        size = self.arch.jmp_size
        funcs = sorted(self.image.functions, key=lambda f: f.address)
        slots: list[tuple[int, int]] = []
        for f, g in zip(funcs, funcs[1:], strict=False):
            lo, hi = f.end, g.address
            if hi - lo < size or hi - lo > 64 or not self.image.is_text(lo):
                continue
            if not _is_filler(self.arch, self.image.read(lo, hi - lo), lo):
                continue
            slots += [(a, a + size) for a in range(lo, hi - size + 1, size)]
        return slots

    def padding_slots(self, near: int, busy: frozenset[int]) -> tuple[tuple[int, bytes], ...]:
        """Padding slots within short-jump reach of ``near`` that no splice uses,
        with their original bytes."""
        reach = 128 + self.arch.short_jmp_size
        starts = [s for s, _ in self._padding]
        i = bisect.bisect_left(starts, near - reach)
        out = []
        for lo, hi in self._padding[i:]:
            if lo > near + reach:
                break
            if not any(a in busy for a in range(lo, hi)):
                out.append((lo, self.image.read(lo, hi - lo)))
        return tuple(out)

    @cached_property
    def blacklist(self) -> tuple[tuple[int, int], ...]:
        ranges = []
        for start, end in BLACKLIST_RANGES:
            try:
                ranges.append((self.image.address_of(start), self.image.address_of(end)))
            except Exception:  # the image has no such section
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
        # capstone spells prefixed filler "data16 nop", "cs nop": look at the last word
        if insn.mnemonic.rsplit(" ", 1)[-1] not in ("nop", "int3"):
            return False
        covered += insn.size
    return covered == len(data)
