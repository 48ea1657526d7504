"""/dev/kerninst from user space: each ioctl of live/abi.py as a method.

Errors come back from the module as a negative errno; they are raised here as
the ksim error class the ABI table names for that command and errno, so the
daemon can carry them over the wire unchanged.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from collections.abc import Sequence
from typing import Any

from ksim.errors import KsimError, StaleText
from live import abi
from live.protocol import make_error


def _buffer(data: bytes | int) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(data) if isinstance(data, int) else \
        ctypes.create_string_buffer(bytes(data), len(data))


class Device:
    """An open /dev/kerninst.  Not thread-safe: the daemon calls it from one thread."""

    def __init__(self, path: str = abi.DEVICE) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            got = self.version()
            if got != abi.ABI_VERSION:
                raise KsimError(f"{path}: module ABI version {got}, "
                                f"this kerninstd speaks {abi.ABI_VERSION}")
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- the ioctl primitive ---------------------------------------------------
    def _ioctl(self, name: str, arg: bytes | None = None, what: str = "") -> bytes:
        request = abi.command(name)
        buf = bytearray(arg) if arg is not None else None
        try:
            if buf is None:
                fcntl.ioctl(self.fd, request, 0)
            else:
                fcntl.ioctl(self.fd, request, buf, True)
        except OSError as exc:
            code = abi.error_code(name, exc.errno or 0)
            where = f" {what}" if what else ""
            err = make_error(code, f"kerninst {name.lower()}{where}: {os.strerror(exc.errno or 0)}")
            err.reply = bytes(buf) if buf is not None else b""  # type: ignore[attr-defined]
            raise err from None
        return bytes(buf) if buf is not None else b""

    # -- commands --------------------------------------------------------------
    def version(self) -> int:
        s = abi.structure("kerninst_version")
        return int(s.unpack(self._ioctl("VERSION", s.pack()))["version"])

    def info(self) -> dict[str, Any]:
        s = abi.structure("kerninst_info")
        return s.unpack(self._ioctl("INFO", s.pack()))

    def read(self, address: int, size: int) -> bytes:
        out = bytearray()
        limit = abi.LIMITS["MAX_IO"]
        s = abi.structure("kerninst_mem")
        while len(out) < size:
            n = min(limit, size - len(out))
            buf = _buffer(n)
            at = address + len(out)
            self._ioctl("READ", s.pack(address=at, buf=ctypes.addressof(buf), size=n),
                        what=f"{at:#x}+{n}")
            out += buf.raw[:n]
        return bytes(out)

    def write(self, address: int, data: bytes) -> None:
        s = abi.structure("kerninst_mem")
        limit = abi.LIMITS["MAX_IO"]
        for off in range(0, len(data), limit):
            chunk = data[off:off + limit]
            buf = _buffer(chunk)
            self._ioctl("WRITE", s.pack(address=address + off, buf=ctypes.addressof(buf),
                                        size=len(chunk)), what=f"{address + off:#x}+{len(chunk)}")

    def poke(self, writes: Sequence[tuple[int, bytes, bytes]]) -> None:
        """Apply (address, old, new) writes all or nothing; StaleText names the first mismatch."""
        ws = abi.structure("kerninst_write")
        keep: list[ctypes.Array[ctypes.c_char]] = []
        table = bytearray()
        for address, old, new in writes:
            ob, nb = _buffer(old), _buffer(new)
            keep += (ob, nb)
            table += ws.pack(address=address, old_buf=ctypes.addressof(ob),
                             new_buf=ctypes.addressof(nb), len=len(new))
        tbuf = _buffer(bytes(table))
        ps = abi.structure("kerninst_poke")
        try:
            self._ioctl("POKE", ps.pack(writes=ctypes.addressof(tbuf), count=len(writes)),
                        what=", ".join(f"{a:#x}" for a, _, _ in writes))
        except StaleText as exc:
            index = int(ps.unpack(exc.reply)["failed_index"])  # type: ignore[attr-defined]
            address, old, _ = writes[index]
            raise StaleText(f"poke at {address:#x}: expected {old.hex()} in memory, found "
                            f"{self.read(address, len(old)).hex()}; nothing was written") from None

    def lookup(self, name: str) -> int:
        s = abi.structure("kerninst_lookup")
        raw = name.encode()
        if len(raw) >= abi.LIMITS["NAME_LEN"]:
            raise KsimError(f"symbol name too long: {name!r}")
        return int(s.unpack(self._ioctl("LOOKUP", s.pack(name=raw), what=name))["address"])

    def set_trap(self, site: int, patch: int) -> None:
        s = abi.structure("kerninst_trap")
        self._ioctl("SET_TRAP", s.pack(site=site, patch=patch), what=f"{site:#x}->{patch:#x}")

    def clear_trap(self, site: int) -> None:
        s = abi.structure("kerninst_trap")
        self._ioctl("CLEAR_TRAP", s.pack(site=site), what=f"{site:#x}")

    def quiesce(self) -> None:
        self._ioctl("QUIESCE")

    def hazards(self, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """KERNINST_HAZARD_* flags of each (address, length) range, asked of the module."""
        rs, hs = abi.structure("kerninst_range"), abi.structure("kerninst_hazards")
        limit = abi.LIMITS["MAX_RANGES"]
        out: list[int] = []
        for start in range(0, len(ranges), limit):
            chunk = ranges[start:start + limit]
            table = ctypes.create_string_buffer(b"".join(rs.pack(address=a, len=n) for a, n in chunk),
                                                len(chunk) * rs.size)
            self._ioctl("HAZARDS", hs.pack(ranges=ctypes.addressof(table), count=len(chunk)),
                        what=f"{len(chunk)} ranges from {chunk[0][0]:#x}")
            raw = table.raw
            out += [int(rs.unpack(raw[i * rs.size:(i + 1) * rs.size])["hazards"])
                    for i in range(len(chunk))]
        return out
