"""Kernel images: loading ELF kernels, modules and kallsyms symbol lists."""

from ksim.image.elf import load_image, load_image_bytes
from ksim.image.image import Image, MemoryReader
from ksim.image.kallsyms import load_kallsyms, parse_kallsyms, to_kallsyms
from ksim.image.model import Function, Section, Symbol

__all__ = [
    "Function",
    "Image",
    "MemoryReader",
    "Section",
    "Symbol",
    "load_image",
    "load_image_bytes",
    "load_kallsyms",
    "parse_kallsyms",
    "to_kallsyms",
]
