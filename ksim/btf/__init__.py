"""Kernel types from BTF, the BPF Type Format: struct layouts, member offsets,
sizes, typedefs, enum constants and function prototypes, for the trace language.

``BTF`` reads a blob (``ksim.btf.reader``); ``kernel_btf(target)`` gets the one of
a target's kernel (``ksim.btf.sources``).  docs/btf.md says why ksim reads BTF
itself rather than through drgn.
"""

from ksim.btf.errors import BTFError
from ksim.btf.reader import BTF, VOID, Field, FuncProto, Member, Type
from ksim.btf.sources import cache_dir, image_btf, kernel_btf

__all__ = [
    "BTF",
    "VOID",
    "BTFError",
    "Field",
    "FuncProto",
    "Member",
    "Type",
    "cache_dir",
    "image_btf",
    "kernel_btf",
]
