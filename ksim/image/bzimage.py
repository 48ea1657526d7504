"""The ELF vmlinux inside a compressed x86 kernel (bzImage).

Debian compresses its kernels with xz.  The payload is found by its magic and
decompressed; the first xz stream that holds an ELF file is the kernel (the
magic can also occur by chance earlier in the setup code, hence the loop).
"""

from __future__ import annotations

import lzma

from ksim.errors import MalformedImage

XZ_MAGIC = b"\xfd7zXZ\x00"


def decompress_bzimage(bzimage: bytes) -> bytes:
    start = bzimage.find(XZ_MAGIC)
    while start >= 0:
        try:
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
        except lzma.LZMAError:
            elf = b""
        if elf.startswith(b"\x7fELF"):
            return elf
        start = bzimage.find(XZ_MAGIC, start + 1)
    raise MalformedImage("no xz-compressed ELF kernel inside the bzImage")
