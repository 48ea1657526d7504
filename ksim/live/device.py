"""/dev/kerninst from user space: each ioctl of ksim/live/abi.py as a method.

Errors come back from the module as a negative errno; they are raised here as
the ksim error class the ABI table names for that command and errno, so the
daemon can carry them over the wire unchanged.  Every request that changes
something names its owner (``owner_new``), the module's unit of who holds what.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ksim.errors import JumpOutside, KsimError, LockedDown, NotPrivileged, StaleText
from ksim.live import abi
from ksim.live.protocol import make_error

#: what an error every command may give means (the errno's own text says little)
_WHY = {
    NotPrivileged.code: "the caller lacks CAP_SYS_ADMIN; nothing was changed",
    LockedDown.code: ("the kernel is locked down (/sys/kernel/security/lockdown): the module "
                      "changes no text nor patch code there, and under confidentiality reads "
                      "nothing; undoing what is in place still works"),
}


def _buffer(data: bytes | int) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(data) if isinstance(data, int) else \
        ctypes.create_string_buffer(bytes(data), len(data))


@dataclass(frozen=True, slots=True)
class Owner:
    id: int
    flags: frozenset[str]   # abi.OWNER_FLAGS names
    name: str               # a kept owner's


@dataclass(frozen=True, slots=True)
class Splice:
    """A live text write: ``orig`` is what a drop or unload puts back."""

    owner: int
    address: int
    orig: bytes
    cur: bytes


@dataclass(frozen=True, slots=True)
class Route:
    owner: int
    site: int
    patch: int


@dataclass(frozen=True, slots=True)
class Block:
    owner: int              # 0: freed patch code, waiting for QUIESCE
    region: str             # abi.REGIONS name
    address: int
    size: int


@dataclass(frozen=True, slots=True)
class Area:
    """An area of the patch area or the data heap (module_alloc memory)."""

    region: str             # abi.REGIONS name
    address: int
    size: int


@dataclass(frozen=True, slots=True)
class ModuleState:
    """The module's log (KERNINST_IOC_STATE): who holds what, text writes oldest first,
    and the areas blocks are claimed in."""

    owners: tuple[Owner, ...]
    splices: tuple[Splice, ...]
    routes: tuple[Route, ...]
    blocks: tuple[Block, ...]
    areas: tuple[Area, ...] = ()

    def of(self, owner: int) -> tuple[list[Splice], list[Route], list[Block]]:
        return ([s for s in self.splices if s.owner == owner],
                [r for r in self.routes if r.owner == owner],
                [b for b in self.blocks if b.owner == owner])


_REGION_NAMES = {v: k for k, v in abi.REGIONS.items()}


class Device:
    """An open /dev/kerninst.  Not thread-safe: the daemon calls it from one thread."""

    def __init__(self, path: str = abi.DEVICE) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except PermissionError as exc:
            raise NotPrivileged(f"{path}: {exc.strerror}: the module lets only a process with "
                                "CAP_SYS_ADMIN open it") from None
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
            why = _WHY.get(code, os.strerror(exc.errno or 0))
            err = make_error(code, f"kerninst {name.lower()}{where}: {why}")
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

    def write(self, address: int, data: bytes, owner: int) -> None:
        """Write into a data-heap block of ``owner``."""
        s = abi.structure("kerninst_mem")
        limit = abi.LIMITS["MAX_IO"]
        for off in range(0, len(data), limit):
            chunk = data[off:off + limit]
            buf = _buffer(chunk)
            self._ioctl("WRITE", s.pack(address=address + off, buf=ctypes.addressof(buf),
                                        size=len(chunk), owner=owner),
                        what=f"{address + off:#x}+{len(chunk)}")

    def poke(self, writes: Sequence[tuple[int, bytes, bytes]], owner: int,
             routes: Sequence[tuple[int, int]] = ()) -> None:
        """Make the route changes ``routes`` (site, patch; patch 0: clear), in order, then
        the (address, old, new) writes, all or nothing, as one batch; StaleText names the
        first mismatch."""
        # every write's old and new bytes in one buffer, each pair at its offset; the
        # tables packed field by field in one go (a batch has thousands of rows)
        blob = b"".join(old + new for _, old, new in writes)
        bbuf = _buffer(blob)
        base = ctypes.addressof(bbuf)
        row = struct.Struct(abi.structure("kerninst_write").format)
        table = bytearray(row.size * len(writes))
        at = 0
        for i, (address, old, new) in enumerate(writes):
            row.pack_into(table, i * row.size, address, base + at, base + at + len(old), len(new), 0)
            at += len(old) + len(new)
        tbuf = _buffer(bytes(table))
        rfmt = abi.structure("kerninst_route").format
        rbuf = _buffer(struct.pack("<" + rfmt[1:] * len(routes),
                                   *(x for route in routes for x in route)))
        ps = abi.structure("kerninst_poke")
        what = ", ".join(f"{a:#x}" for a, _, _ in writes[:8]) + (
            f" and {len(writes) - 8} more" if len(writes) > 8 else "")
        if routes:
            what += f"{'; ' if writes else ''}{len(routes)} route changes"
        try:
            self._ioctl("POKE", ps.pack(writes=ctypes.addressof(tbuf), nr_writes=len(writes),
                                        routes=ctypes.addressof(rbuf), nr_routes=len(routes),
                                        owner=owner),
                        what=what)
        except StaleText as exc:
            index = int(ps.unpack(exc.reply)["failed_index"])  # type: ignore[attr-defined]
            address, old, _ = writes[index]
            raise StaleText(f"poke at {address:#x}: expected {old.hex()} in memory, found "
                            f"{self.read(address, len(old)).hex()}; nothing was written") from None
        except JumpOutside as exc:
            index = int(ps.unpack(exc.reply)["failed_index"])  # type: ignore[attr-defined]
            address, _, new = writes[index]
            raise JumpOutside(f"poke at {address:#x} ({new.hex()}): the jump it makes or changes "
                              "leads neither into kernel or module text nor into a patch block "
                              "of this client's; nothing was written") from None

    def lookup(self, name: str) -> int:
        s = abi.structure("kerninst_lookup")
        raw = name.encode()
        if len(raw) >= abi.LIMITS["NAME_LEN"]:
            raise KsimError(f"symbol name too long: {name!r}")
        return int(s.unpack(self._ioctl("LOOKUP", s.pack(name=raw), what=name))["address"])

    def set_trap(self, site: int, patch: int, owner: int) -> None:
        s = abi.structure("kerninst_trap")
        self._ioctl("SET_TRAP", s.pack(site=site, patch=patch, owner=owner),
                    what=f"{site:#x}->{patch:#x}")

    def clear_trap(self, site: int, owner: int) -> None:
        s = abi.structure("kerninst_trap")
        self._ioctl("CLEAR_TRAP", s.pack(site=site, owner=owner), what=f"{site:#x}")

    # -- owners and blocks -------------------------------------------------------
    def _owner(self, command: str, owner: int, name: str = "") -> bytes:
        s = abi.structure("kerninst_owner")
        raw = name.encode()
        if len(raw) >= abi.LIMITS["NAME_LEN"]:
            raise KsimError(f"owner name too long: {name!r}")
        what = f"{owner}" + (f" {name!r}" if name else "")
        return self._ioctl(command, s.pack(id=owner, name=raw), what=what)

    def owner_new(self) -> int:
        s = abi.structure("kerninst_owner")
        return int(s.unpack(self._ioctl("OWNER_NEW", s.pack()))["id"])

    def owner_keep(self, owner: int, name: str) -> None:
        """Keep ``owner`` past its session under ``name`` ("": no longer kept)."""
        self._owner("OWNER_KEEP", owner, name)

    def owner_adopt(self, owner: int, name: str) -> None:
        """``owner`` takes over everything the kept owner ``name`` holds."""
        self._owner("OWNER_ADOPT", owner, name)

    def owner_drop(self, owner: int) -> None:
        """Undo everything ``owner`` holds and forget it (StaleText: some text was
        changed behind ksim; the owner stays, kept as an orphan)."""
        self._owner("OWNER_DROP", owner)

    def claim(self, owner: int, region: str, address: int, size: int) -> None:
        s = abi.structure("kerninst_block")
        self._ioctl("CLAIM", s.pack(owner=owner, region=abi.REGIONS[region], address=address,
                                    size=size), what=f"{region} {address:#x}+{size}")

    def free(self, owner: int, region: str, address: int) -> None:
        s = abi.structure("kerninst_block")
        self._ioctl("FREE", s.pack(owner=owner, region=abi.REGIONS[region], address=address),
                    what=f"{region} {address:#x}")

    def area_add(self, region: str, size: int) -> tuple[int, int]:
        """A new area of ``region`` of at least ``size`` bytes: (address, size)."""
        s = abi.structure("kerninst_area")
        reply = s.unpack(self._ioctl("AREA_ADD", s.pack(region=abi.REGIONS[region], size=size),
                                     what=f"{region} +{size}"))
        return int(reply["address"]), int(reply["size"])

    def area_drop(self, region: str, address: int) -> None:
        """Give back an area the module added, now empty."""
        s = abi.structure("kerninst_area")
        self._ioctl("AREA_DROP", s.pack(region=abi.REGIONS[region], address=address),
                    what=f"{region} {address:#x}")

    def state(self) -> ModuleState:
        """The module's log.  Asked again, with more room, while it outgrows the buffers."""
        st = abi.structure("kerninst_state")
        kinds = (("owners", "kerninst_owner"), ("splices", "kerninst_splice"),
                 ("routes", "kerninst_trap"), ("blocks", "kerninst_block"),
                 ("areas", "kerninst_area"))
        room = dict.fromkeys((k for k, _ in kinds), 64)
        while True:
            bufs = {k: _buffer(max(1, room[k]) * abi.structure(sname).size) for k, sname in kinds}
            reply = st.unpack(self._ioctl("STATE", st.pack(
                **{k: ctypes.addressof(b) for k, b in bufs.items()},
                **{f"nr_{k}": n for k, n in room.items()})))
            counts = {k: int(reply[f"nr_{k}"]) for k, _ in kinds}
            if all(counts[k] <= room[k] for k in room):
                break
            room = {k: max(room[k], 2 * counts[k]) for k in room}
        rows = {}
        for k, sname in kinds:
            s = abi.structure(sname)
            raw = bufs[k].raw
            rows[k] = [s.unpack(raw[i * s.size:(i + 1) * s.size]) for i in range(counts[k])]
        return ModuleState(
            owners=tuple(Owner(int(o["id"]), frozenset(abi.owner_flag_names(int(o["flags"]))),
                               bytes(o["name"]).split(b"\0", 1)[0].decode(errors="replace"))
                         for o in rows["owners"]),
            splices=tuple(Splice(int(x["owner"]), int(x["address"]),
                                 bytes(x["orig"])[:int(x["len"])], bytes(x["cur"])[:int(x["len"])])
                          for x in rows["splices"]),
            routes=tuple(Route(int(r["owner"]), int(r["site"]), int(r["patch"]))
                         for r in rows["routes"]),
            blocks=tuple(Block(int(b["owner"]), _REGION_NAMES.get(int(b["region"]), "?"),
                               int(b["address"]), int(b["size"])) for b in rows["blocks"]),
            areas=tuple(Area(_REGION_NAMES.get(int(a["region"]), "?"), int(a["address"]),
                             int(a["size"])) for a in rows["areas"]),
        )

    def quiesce(self) -> None:
        self._ioctl("QUIESCE")

    def hazard_table(self, table: bytes) -> bytes:
        """KERNINST_HAZARD_* flags of each row of ``table``, a packed array of struct
        kerninst_range as the module takes it: the table with every row's hazards
        filled in, asked MAX_RANGES rows at a time (no Python work per row: a batch
        asks about hundreds of thousands of instructions)."""
        hs = abi.structure("kerninst_hazards")
        size = struct.calcsize(abi.structure("kerninst_range").format)
        limit = abi.LIMITS["MAX_RANGES"] * size
        out = bytearray()
        for start in range(0, len(table), limit):
            chunk = _buffer(table[start:start + limit])
            self._ioctl("HAZARDS", hs.pack(ranges=ctypes.addressof(chunk), count=len(chunk) // size),
                        what=f"{len(chunk) // size} ranges")
            out += chunk.raw
        return bytes(out)

    def read_rows(self, table: bytes, count: int, size: int, digest: bool = False
                  ) -> tuple[bytes, list[int]]:
        """READ_ROWS (DIGEST_ROWS with ``digest``): ``table`` is ``count`` packed
        (u64 address, u64 length) rows, ``size`` bytes together, within the module's
        MAX_ROWS and MAX_ROWS_BYTES.  Their bytes end to end (or an 8-byte XXH64 of
        each, abi.LIMITS["DIGEST_SIZE"]), and the indexes of the rows that could not
        be read (zeros in their place): one module call, whatever the rows."""
        s = abi.structure("kerninst_rows")
        rows = _buffer(table)
        out = _buffer(count * abi.LIMITS["DIGEST_SIZE"] if digest else size)
        failed = _buffer(8 * ((count + 63) // 64))
        self._ioctl("DIGEST_ROWS" if digest else "READ_ROWS",
                    s.pack(rows=ctypes.addressof(rows), out=ctypes.addressof(out),
                           out_size=len(out), failed=ctypes.addressof(failed), count=count),
                    what=f"{count} rows")
        bits = int.from_bytes(failed.raw, "little")
        missing = []
        while bits:             # the set bits only: a row that failed is rare
            low = bits & -bits
            missing.append(low.bit_length() - 1)
            bits ^= low
        return out.raw, missing

    def hazards(self, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """KERNINST_HAZARD_* flags of each (address, length) range, asked of the module."""
        hs = abi.structure("kerninst_hazards")
        row = struct.Struct(abi.structure("kerninst_range").format)
        limit = abi.LIMITS["MAX_RANGES"]
        out: list[int] = []
        for start in range(0, len(ranges), limit):
            chunk = ranges[start:start + limit]
            table = ctypes.create_string_buffer(
                struct.pack("<" + row.format[1:] * len(chunk), *(x for a, n in chunk for x in (a, n, 0))),
                len(chunk) * row.size)
            self._ioctl("HAZARDS", hs.pack(ranges=ctypes.addressof(table), count=len(chunk)),
                        what=f"{len(chunk)} ranges from {chunk[0][0]:#x}")
            out += [flags for _a, _n, flags in row.iter_unpack(table.raw)]
        return out
