"""``analyze(image, function)``: everything analysis knows about one function.

The result is computed once per (image, function) and cached (weakly on the image,
so that dropping an image drops its analyses).  When the image has an analysis
store (``ksim.analysis.store``), the instructions and CFG are rebuilt from it
rather than decoded, and the clobber analysis behind liveness reads its callees'
summaries from it: attaching to a function analyses that function only.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from ksim.analysis.abi import ArchSupport, support_for
from ksim.analysis.cfg import CFG, Block, Edge, JumpTable, build_cfg
from ksim.analysis.clobbers import function_clobbers, own_writes
from ksim.analysis.liveness import Liveness, Target, TargetKind
from ksim.analysis.points import FunctionPoints, Point, PointKind, find_points
from ksim.arch.base import Flow, Insn
from ksim.errors import NotOnBoundary, OutsideText
from ksim.image.image import Image
from ksim.image.model import Function


@dataclass(frozen=True, slots=True)
class CallSite:
    address: int
    #: destination of a direct call (None for an indirect one)
    target: int | None
    #: name of the called function when the target is a known function's entry
    callee: str | None
    indirect: bool


@dataclass
class FunctionAnalysis:
    image: Image
    function: Function
    cfg: CFG
    points: FunctionPoints
    callsites: tuple[CallSite, ...]
    _support: ArchSupport = field(repr=False)
    _liveness: Liveness | None = field(default=None, repr=False)
    _starts: list[int] = field(default_factory=list, repr=False)

    # --- structure --------------------------------------------------------------------
    @property
    def insns(self) -> tuple[Insn, ...]:
        return self.cfg.insns

    @property
    def blocks(self) -> list[Block]:
        return list(self.cfg.blocks.values())

    @property
    def edges(self) -> tuple[Edge, ...]:
        return self.cfg.edges

    @property
    def tables(self) -> dict[int, JumpTable]:
        return self.cfg.tables

    @property
    def callees(self) -> list[Function]:
        """Functions this one calls directly (each once, by address)."""
        out = {}
        for site in self.callsites:
            if site.callee is not None:
                func = self.image.function(site.callee)
                out[func.address] = func
        return [out[a] for a in sorted(out)]

    def is_boundary(self, address: int) -> bool:
        """Whether an instruction of this function starts at ``address``."""
        i = bisect.bisect_left(self._starts, address)
        return i < len(self._starts) and self._starts[i] == address

    def insn_at(self, address: int) -> Insn:
        """The instruction starting at ``address``; NotOnBoundary / OutsideText otherwise."""
        if address not in self.function:
            raise OutsideText(f"{address:#x} is not inside {self.function.name}")
        i = bisect.bisect_left(self._starts, address)
        if i < len(self._starts) and self._starts[i] == address:
            return self.cfg.insns[i]
        raise NotOnBoundary(f"{address:#x} is not the start of an instruction of {self.function.name}")

    def block_at(self, address: int) -> Block:
        block = self.cfg.block_at(address)
        if block is None:
            raise OutsideText(f"{address:#x} is not inside {self.function.name}")
        return block

    def all_points(self, *, insns: bool = False) -> list[Point]:
        out = self.points.all()
        if insns:
            out += [Point(i.address, PointKind.INSN, self.function.name) for i in self.insns]
        return out

    # --- liveness ---------------------------------------------------------------------
    @property
    def liveness(self) -> Liveness:
        if self._liveness is None:
            preserved = self._support.convention.caller_saved - own_writes(
                self.image, self._support, self.function)
            self._liveness = Liveness(self.cfg, self._support.convention, self._classify,
                                      self._standard_indirect, preserved)
        return self._liveness

    def live_at(self, address: int) -> frozenset[str]:
        """Registers live just before the instruction at ``address``."""
        self.insn_at(address)
        return self.liveness.live_at(address)

    def live_after(self, address: int) -> frozenset[str]:
        self.insn_at(address)
        return self.liveness.live_after(address)

    def _classify(self, target: int) -> Target:
        return classify_target(self.image, self._support, target)

    def _standard_indirect(self, insn: Insn) -> bool:
        return standard_indirect(self.image, self._support, insn)


def standard_indirect(image: Image, support: ArchSupport, insn: Insn) -> bool:
    """An indirect call follows the convention unless it goes through a table of
    custom-convention calls (paravirt ops)."""
    if insn.pc_ref is None:
        return True
    sym = image.symbol_containing(insn.pc_ref)
    names = [sym.name] if sym else image.names_at(insn.pc_ref)
    return not any(support.convention.special_call_table.match(n) for n in names)


def classify_target(image: Image, support: ArchSupport, target: int) -> Target:
    """What a direct call or jump to ``target`` reaches, for the calling convention.
    What its names say is worked out once per image and target (named_target); a
    function's clobbers are asked each time (they follow its bytes)."""
    found = named_target(image, support, target)
    if isinstance(found, Target):
        return found
    return Target(TargetKind.FUNCTION, clobbers=function_clobbers(image, support, found))


def named_target(image: Image, support: ArchSupport, target: int) -> Target | Function:
    """classify_target's answer where the names decide it; else the function called
    (worked out once per image and target: many functions call the same few)."""
    named = image.memos.setdefault("call_targets", {})
    found = named.get(target)
    if found is None:
        found = named[target] = _named_target(image, support, target)
    return found


def _named_target(image: Image, support: ArchSupport, target: int) -> Target | Function:
    """named_target, worked out."""
    cc = support.convention
    func = image.function_at(target)
    names = image.names_at(target)
    if func is not None and func.address == target:
        names = image.aliases(func) + names
    for name in names:
        if cc.return_thunk.match(name):
            return Target(TargetKind.RETURN)
        m = cc.indirect_thunk.match(name)
        if m:
            return Target(TargetKind.THUNK, m.group(1))
    if func is None or func.address != target:
        return Target(TargetKind.UNKNOWN)
    if any(cc.special_callee.match(n) or ".cold" in n for n in names):
        return Target(TargetKind.UNKNOWN)
    return func


#: analyses kept per image (in its memos), the most recently used: a pass over every function of a
#: kernel (50,000) must not keep every instruction of it, but a batch of ten thousand
#: should find each of its functions' analysis again when it is planned (some 200 KB
#: each)
CACHE_FUNCTIONS = 12288


def _from_store(image: Image, support: ArchSupport, func: Function) -> CFG | None:
    """The CFG of ``func`` rebuilt from the image's analysis store, if it has one."""
    from ksim.analysis.compact import StaleRecord, cfg_of
    from ksim.analysis.store import store_for

    kept = store_for(image, build_missing=False)
    comp = kept.get(func) if kept is not None else None
    if comp is None:
        return None
    try:
        return cfg_of(support, image, func, comp)[1]
    except StaleRecord:
        return None  # the bytes are not what the store was made from: analyse afresh


def analyze(image: Image, function: Function | str) -> FunctionAnalysis:
    """The analysis of ``function`` (a name or a Function of ``image``), cached."""
    func = image.function(function) if isinstance(function, str) else function
    per_image: OrderedDict[int, FunctionAnalysis] = image.memos.setdefault("analyses", OrderedDict())
    key = func.address
    cached = per_image.get(key)
    if cached is not None and cached.function == func:
        per_image.move_to_end(key)
        return cached
    support = support_for(image.arch)
    cfg = _from_store(image, support, func)
    if cfg is None:
        insns = list(support.decode(image.read(func.address, func.size), func.address))
        cfg = build_cfg(insns, func.address, func.end, image.read, arch=support.arch)
    sites = []
    for insn in cfg.insns:
        if insn.flow is Flow.CALL:
            callee = image.function_at(insn.target) if insn.target is not None else None
            name = callee.name if callee is not None and callee.address == insn.target else None
            sites.append(CallSite(insn.address, insn.target, name, False))
        elif insn.flow is Flow.CALL_INDIRECT:
            sites.append(CallSite(insn.address, None, None, True))
    result = FunctionAnalysis(
        image=image, function=func, cfg=cfg, points=find_points(cfg, func.name, support.arch),
        callsites=tuple(sites), _support=support, _starts=[i.address for i in cfg.insns],
    )
    per_image[key] = result
    per_image.move_to_end(key)
    if len(per_image) > CACHE_FUNCTIONS:
        per_image.popitem(last=False)
    return result
