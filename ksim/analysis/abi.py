"""What analysis needs to know about an architecture and the kernel's calling habits.

Analysis is generic; it reaches the decoder, the bulk scans and the calling
convention through :func:`support_for` (keyed by ``Image.arch``), which asks the
architecture plug-in (``ksim.arch.get_arch``) for all of them and never tests an
architecture's name itself.  Conventions are data, one per architecture, in its
package (``Arch.convention``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ksim.arch.base import (
    EFFECT_SHIFT,
    FILLER_BIT,
    FLOW_MASK,
    FLOWS,
    TARGET_BIT,
    Arch,
    CallConvention,
    CodeScan,
    CodeScanMany,
    CodeScans,
    Effects,
    Flow,
    FlowScan,
    Insn,
    Rebuild,
)
from ksim.errors import UnsupportedImage

__all__ = [
    "EFFECT_SHIFT", "FILLER_BIT", "FLOWS", "FLOW_MASK", "TARGET_BIT", "ArchSupport",
    "CallConvention", "CodeScan", "CodeScanMany", "Effects", "FlowScan", "Rebuild", "support_for",
]

_FLOW_INDEX = {flow: i for i, flow in enumerate(FLOWS)}


@dataclass(frozen=True)
class ArchSupport:
    arch: Arch
    name: str
    decode: Callable[[bytes, int], Iterator[Insn]]
    convention: CallConvention
    flows: FlowScan
    scan: CodeScan
    scan_many: CodeScanMany
    rebuild: Rebuild
    #: (reads, writes) by the effects index of a code (grows as new effects are met)
    effects: Effects


_CACHE: dict[str, ArchSupport] = {}


def _slow_flows(decode: Callable[[bytes, int], Iterator[Insn]]) -> FlowScan:
    def scan(code: bytes, address: int) -> Iterator[tuple[int, int, Flow, int | None]]:
        for insn in decode(code, address):
            yield insn.address, insn.size, insn.flow, insn.target

    return scan


def _slow_scan(arch: Arch) -> CodeScans:
    """A CodeScan from an architecture's ``decode`` (one object per instruction)."""
    decode = arch.decode
    table: list[tuple[frozenset[str], frozenset[str]]] = []
    ids: dict[tuple[frozenset[str], frozenset[str]], int] = {}

    def scan(code: bytes, address: int) -> tuple[bytes, list[int], list[int], int, int]:
        sizes, codes, targets = bytearray(), [], []
        for insn in decode(code, address):
            key = (insn.reads, insn.writes)
            if key not in ids:
                ids[key] = len(table)
                table.append(key)
            packed = _FLOW_INDEX[insn.flow] | ids[key] << EFFECT_SHIFT
            if arch.is_filler(insn):
                packed |= FILLER_BIT
            if insn.target is not None:
                packed |= TARGET_BIT
                targets.append(insn.target)
            sizes.append(insn.size)
            codes.append(packed)
        return bytes(sizes), codes, targets, 0, 0

    def rebuild(code: bytes, address: int, sizes: bytes, codes: Sequence[int],
                targets: Sequence[int], effects: Effects) -> list[Insn]:
        out = []
        for insn, size in zip(decode(code[:sum(sizes)], address), sizes, strict=False):
            if insn.size != size:
                break
            out.append(insn)
        return out

    def scan_many(items: Sequence[tuple[bytes, int]]
                  ) -> tuple[list[bytes], list[int], list[int], list[int], int]:
        sizes_of, codes, targets, tails = [], [], [], []
        for code, address in items:
            sizes, c, t, tail, _code = scan(code, address)
            sizes_of.append(sizes)
            codes += c
            targets += t
            tails.append(tail)
        return sizes_of, codes, targets, tails, 0

    return scan, scan_many, rebuild, table


def support_for(arch_name: str) -> ArchSupport:
    """The decoder, scans and calling convention (from the architecture plug-in) for an image."""
    if arch_name not in _CACHE:
        from ksim.arch import get_arch

        try:
            arch = get_arch(arch_name)
        except ValueError as exc:
            raise UnsupportedImage(str(exc)) from exc
        flows = arch.flow_scan() or _slow_flows(arch.decode)
        scan, scan_many, rebuild, effects = arch.code_scan() or _slow_scan(arch)
        _CACHE[arch_name] = ArchSupport(arch, arch.name, arch.decode, arch.convention, flows,
                                        scan, scan_many, rebuild, effects)
    return _CACHE[arch_name]
