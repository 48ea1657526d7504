"""Applying one ELF relocation described as data (:class:`ksim.arch.base.Relocation`).

Architectures declare their relocation types as tables; this is the one place
that computes and stores a relocated field, for the component linker
(``ksim.components``) and the image loader's module tables (``ksim.image.elf``).
"""

from __future__ import annotations

from ksim.arch.base import Relocation
from ksim.errors import KsimError, LinkError

_MASK64 = (1 << 64) - 1


def apply_relocation(blob: bytearray, off: int, place: int, kind: Relocation, value: int,
                     name: str, error: type[KsimError] = LinkError) -> None:
    """Apply one relocation of ``kind`` at ``blob[off:]`` (at address ``place``), whose
    symbol plus addend is ``value`` (S + A); ``error`` when it does not fit."""
    if kind.page:
        x = (value & ~0xFFF) - (place & ~0xFFF)
    else:
        x = value - place if kind.pcrel else value
    x &= _MASK64
    x = x - (1 << 64) if x >> 63 else x        # signed, as the address arithmetic wraps
    if kind.range is not None and not kind.range[0] <= x < kind.range[1]:
        raise error(f"{kind.name} against {name!r} at {place:#x} is out of reach "
                    f"({x:#x} not in [{kind.range[0]:#x}, {kind.range[1]:#x}))")
    if x & ((1 << kind.shift) - 1):
        raise error(f"{kind.name} against {name!r} at {place:#x}: {x:#x} is not a "
                    f"multiple of {1 << kind.shift}")
    if off + kind.size > len(blob):
        raise error(f"{kind.name} against {name!r} at {place:#x} runs past the end "
                    f"({len(blob)} bytes)")
    v = (x >> kind.shift) & ((1 << kind.bits) - 1)
    if not kind.fields:
        blob[off:off + kind.size] = v.to_bytes(kind.size, "little")
        return
    word = int.from_bytes(blob[off:off + kind.size], "little")
    for lsb, width in kind.fields:
        mask = (1 << width) - 1
        word = (word & ~(mask << lsb)) | ((v & mask) << lsb)
        v >>= width
    blob[off:off + kind.size] = word.to_bytes(kind.size, "little")
