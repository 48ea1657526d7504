"""kerninstd: serves /dev/kerninst to authenticated ksim clients over TCP.

    kerninstd --listen HOST:PORT --token-file PATH [--device /dev/kerninst] [--allow-exec]
              [--auth-timeout S] [--idle-timeout S] [--max-connections N]
              [--max-unauthenticated N]

One asyncio server; device calls are quick ioctls made from the event loop, so
they are serialised; ``exec`` runs its command as a subprocess and does not
block other clients.  Each client session is one owner in the module, which
knows who holds every text write, trap route and patch-area or data-heap block
and refuses one owner's change over another's (TextOwned).  When a client
disconnects the module undoes what its owner holds, newest first, unless it
sent ``keep``: a kept owner has a name, outlives the session and kerninstd
itself, and is listed (``kept``), taken over (``adopt``) or undone
(``remove_kept``) by a later client.  kerninstd allocates inside the patch area
and the heap -- each made of areas the module adds on demand and takes back
when empty -- and builds its allocators from the module's log when it starts.

Peers that have not authenticated are held to small frames, a deadline and a
count (``Limits``): when the count is reached the oldest of them is closed, so
idle connections can never lock a client with the token out.  Every request is
checked against ``ksim.live.protocol.OPS`` before it is used, and whatever goes wrong
while an op runs is answered as an error: a session ends only when its client
leaves (or says ``bye``).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import hashlib
import hmac
import logging
import os
import re
import resource
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ksim.btf.errors import BTFError
from ksim.errors import (
    AlreadySpliced,
    AuthError,
    Blacklisted,
    BlockInUse,
    JumpOutside,
    KsimError,
    OutOfMemory,
    OutsideText,
    ProtocolError,
    StaleText,
    TargetError,
    TargetFault,
    TargetTimeout,
    TextOwned,
    UnknownHandle,
)
from ksim.live import abi
from ksim.live import protocol as wire
from ksim.live.device import Area, Device, ModuleState, Owner
from ksim.splice import hazards
from ksim.splice.alloc import RegionAllocator

log = logging.getLogger("kerninstd")


def read_token(path: str) -> bytes:
    """The shared secret; refused unless the file is owned by us and private (mode 0600 or less)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise AuthError(f"token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AuthError(f"token file {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise AuthError(f"token file {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise AuthError(f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
                        "it must be readable by its owner only (chmod 600)")
    with open(path, "rb") as f:
        token = f.read().strip()
    if len(token) < 16:
        raise AuthError(f"token file {path} holds fewer than 16 bytes of secret")
    return token


def modules_digest() -> str:
    """Which modules are loaded where: a client's cached kallsyms is stale when this changes."""
    try:
        with open("/proc/modules") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    # name, size and load address; not the reference count, which changes all the time
    key = "\n".join(" ".join(parts[:2] + parts[5:6]) for parts in map(str.split, lines))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the daemon.

    ``auth_timeout``: seconds from accept to a successful ``auth``; a peer that is
    not authenticated by then is closed.  ``idle_timeout``: seconds an authenticated
    session may go without a request (``None``, the default: forever -- a session
    that holds splices is not dropped for being quiet; dropping it undoes them).
    ``max_unauthenticated``: connections not yet authenticated; a new one beyond it
    closes the oldest of them.  ``max_connections``: connections in all; a new one
    beyond it closes the oldest unauthenticated one, or is refused when every
    connection is authenticated (authenticated sessions are never evicted).
    """

    auth_timeout: float = 10.0
    idle_timeout: float | None = None
    max_connections: int = 64
    max_unauthenticated: int = 16

    def __post_init__(self) -> None:
        if not self.auth_timeout > 0:
            raise ValueError("the auth timeout must be positive")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ValueError("the idle timeout must be positive (or None: never)")
        if self.max_connections < 1 or self.max_unauthenticated < 1:
            raise ValueError("connection limits must be at least 1")
        if self.max_unauthenticated > self.max_connections:
            object.__setattr__(self, "max_unauthenticated", self.max_connections)


# File descriptors the daemon needs besides its connections: stdio, the device,
# the listening socket, the event loop's own, /proc and tracefs files, logging.
FD_RESERVE = 32
# Per connection: its socket, and the pipes and pidfd of an exec it may be running.
FDS_PER_CONNECTION = 5
LISTEN_BACKLOG = 100   # connections the kernel queues, and asyncio accepts in one go


def fd_budget(limits: Limits) -> int:
    """File descriptors ``limits`` may take at once: accepted connections wait in the
    backlog's worth of sockets before they are admitted or closed."""
    return FD_RESERVE + LISTEN_BACKLOG + limits.max_connections * FDS_PER_CONNECTION


def fit_fd_limit(limits: Limits) -> Limits:
    """Raise the soft RLIMIT_NOFILE to what ``limits`` needs, or lower the connection
    limits to what the hard limit allows: out of descriptors, asyncio stops accepting
    for a second at a time, and a client with the token could not get in."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fd_budget(limits)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return limits
    fit = max(1, (soft - FD_RESERVE - LISTEN_BACKLOG) // FDS_PER_CONNECTION)
    log.warning("file descriptor limit %d: serving at most %d connections (asked %d)",
                soft, fit, limits.max_connections)
    return replace(limits, max_connections=fit,
                   max_unauthenticated=min(limits.max_unauthenticated, fit))


@dataclass(eq=False)
class Session:
    """One client connection.  ``owner``: its owner in the module, made when it first
    changes something; ``keep_name``: the name it is kept under, if it sent ``keep``."""

    peer: str
    nonce: str = field(default_factory=lambda: secrets.token_hex(32))
    authenticated: bool = False
    owner: int | None = None
    keep_name: str | None = None


# A kept owner's name: what `ksim kept --remove NAME` takes.  "orphan-N" is the
# module's own name for an owner whose text could not all be undone.
KEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}")


def check_keep_name(name: str) -> str:
    if not KEEP_NAME.fullmatch(name) or name.startswith("orphan-"):
        raise ProtocolError(f"keep: argument 'name' must be 1 to 64 letters, digits or ._:@+- "
                            f"(starting with a letter or digit, not orphan-), got {wire.clip(repr(name))}")
    return name


def mirror(start: int, end: int, name: str, blocks: Iterable[tuple[int, int]]) -> RegionAllocator:
    """An allocator over start..end whose allocated blocks are exactly ``blocks``
    (address, size): the module's, when kerninstd starts or after a drop.  Built with
    the allocator's own first-fit rule: allocating, from the start and in address
    order, each gap and then each block, byte-aligned, hands out exactly these
    addresses; the gaps are then given back."""
    region = RegionAllocator(start, end, name=name)
    gaps = []
    cursor = start
    for address, size in sorted(blocks):
        if address < cursor or address + size > end:
            log.error("%s: block %#x+%d overlaps another or leaves the region; not mirrored",
                      name, address, size)
            continue
        if address > cursor:
            gaps.append(region.alloc(address - cursor, 1))
        got = region.alloc(size, 1)
        assert got == address, (hex(got), hex(address))
        cursor = address + size
    for gap in gaps:
        region.free(gap)
    return region


#: the least size of an area kerninstd asks the module to add
GROW = 1 << 20


class Region:
    """The patch area or the data heap: the module's areas of one region, each with a
    first-fit allocator.  ``first`` is the area the module made at load (it stays);
    the others were added on demand and go back once they hold no block."""

    def __init__(self, name: str, kind: str, first: tuple[int, int]) -> None:
        self.name, self.kind, self.first = name, kind, first[0]
        self.areas: dict[int, RegionAllocator] = {}
        self.add(*first)

    def add(self, address: int, size: int, blocks: Iterable[tuple[int, int]] = ()) -> None:
        self.areas[address] = mirror(address, address + size, f"{self.name} {address:#x}", blocks)
        self.areas = dict(sorted(self.areas.items()))

    def alloc(self, size: int, align: int = 16) -> int:
        """The first place that fits, area by area in address order; OutOfMemory if none."""
        for area in self.areas.values():
            try:
                return area.alloc(size, align)
            except OutOfMemory:
                continue
        raise OutOfMemory(f"{self.name}: no room for {size} bytes in {len(self.areas)} areas "
                          f"({self.bytes_free} bytes free)")

    def area_of(self, address: int) -> RegionAllocator | None:
        for area in self.areas.values():
            if area.start <= address < area.end:
                return area
        return None

    def free(self, address: int) -> None:
        area = self.area_of(address)
        if area is None:
            raise KsimError(f"{self.name}: {address:#x} is in none of its areas")
        area.free(address)

    def touches(self, address: int, size: int) -> bool:
        return any(address < a.end and address + size > a.start for a in self.areas.values())

    def idle(self, held: Callable[[int], bool] = lambda _a: True) -> list[int]:
        """The added areas whose every block ``held`` calls not held (none at all by default)."""
        return [start for start, area in self.areas.items() if start != self.first
                and not any(held(b) for b in area.allocated())]

    def allocated(self) -> dict[int, int]:
        """Every block, address -> size, over all areas."""
        return {a: n for area in self.areas.values() for a, n in area.allocated().items()}

    @property
    def bytes_free(self) -> int:
        return sum(a.bytes_free for a in self.areas.values())

    def describe(self) -> list[dict[str, Any]]:
        return [{"region": self.kind, "address": a.start, "size": a.end - a.start,
                 "free": a.bytes_free} for a in self.areas.values()]


def peer_name(writer: asyncio.StreamWriter) -> str:
    # None when the peer reset the connection before it was accepted
    peer = writer.get_extra_info("peername")
    return "{}:{}".format(*peer[:2]) if isinstance(peer, tuple) and len(peer) >= 2 else "?"


def drop(writer: asyncio.StreamWriter, frame: bytes = b"") -> None:
    """Close a connection now, after a last frame: it goes straight into the socket's
    send buffer (it is small and nothing is queued before it) and the kernel delivers
    it after the close, while the descriptor is freed at once."""
    if frame:
        try:
            writer.write(frame)
        except (ConnectionError, RuntimeError):
            pass
    writer.transport.abort()


class Daemon:
    def __init__(self, device: Device, token: bytes, *, allow_exec: bool = False,
                 limits: Limits | None = None) -> None:
        self.device = device
        self.token = token
        self.allow_exec = allow_exec
        self.limits = limits or Limits()
        self.info = device.info()
        self.text = (int(self.info["text_start"]), int(self.info["text_end"]))
        self._first = {"code": (int(self.info["code_start"]), int(self.info["code_size"])),
                       "data": (int(self.info["data_start"]), int(self.info["data_size"]))}
        self.code = Region("patch area", "code", self._first["code"])
        self.data = Region("data heap", "data", self._first["data"])
        # Freed blocks, (region kind, address), are reused only after QUIESCE: a task
        # preempted inside freed patch code must leave it first, and until it has, it
        # may still write the heap blocks that code used.
        self.quarantine: list[tuple[str, int]] = []
        # The module's log is the truth: blocks that kept owners (kept splices of
        # clients gone, perhaps with an earlier kerninstd) hold are never handed out.
        state = device.state()
        self.follow(state)
        for owner in state.owners:
            splices, routes, blocks = state.of(owner.id)
            log.info("kept %s%r: %d text writes, %d trap routes, %d blocks",
                     "orphan " if "orphan" in owner.flags else "", owner.name,
                     len(splices), len(routes), len(blocks))
        self.sessions: set[Session] = set()
        # Connections not yet authenticated, oldest first (dicts keep insertion order).
        self.unauthenticated: dict[Session, asyncio.StreamWriter] = {}
        self.evicted = 0      # unauthenticated connections closed to admit newer ones
        self.refused = 0      # connections refused: every slot held by an authenticated session
        self._warned_at: dict[str, float] = {}
        self._kallsyms: str | None = None
        self._btf: dict[str, tuple[bytes, str]] = {}  # name -> the file and its sha256
        self.handlers = {name: getattr(self, f"op_{name}") for name in wire.OPS}
        #: the module's text writes as last read (None: read them again before a read)
        self._text_view: tuple[Any, ...] | None = None
        self._text_view_at: list[int] = []      # the view's addresses, for bisect

    # -- admission -----------------------------------------------------------------
    def admit(self, session: Session, writer: asyncio.StreamWriter) -> bool:
        """Take a new connection in, closing the oldest unauthenticated ones to make
        room; False when every slot is held by an authenticated session."""
        lim = self.limits
        while len(self.sessions) >= lim.max_connections:
            if not self._evict_oldest():
                return False
        while len(self.unauthenticated) >= lim.max_unauthenticated:
            self._evict_oldest()
        self.sessions.add(session)
        self.unauthenticated[session] = writer
        return True

    def _evict_oldest(self) -> bool:
        if not self.unauthenticated:
            return False
        session = next(iter(self.unauthenticated))
        writer = self.unauthenticated.pop(session)
        self.sessions.discard(session)
        self.evicted += 1
        log.debug("%s: closed, not authenticated, to admit a newer connection", session.peer)
        drop(writer, wire.encode(wire.reply_error(None, AuthError(
            "closed before authentication: too many unauthenticated connections"))))
        if self._may_warn("evicted"):
            log.warning("%d unauthenticated connections closed so far to admit newer ones "
                        "(limits: %d unauthenticated, %d in all)", self.evicted,
                        self.limits.max_unauthenticated, self.limits.max_connections)
        return True

    def _may_warn(self, what: str, every: float = 10.0) -> bool:
        """Whether to log ``what`` now: a flood of connections is reported every few
        seconds, not once per connection."""
        now = time.monotonic()
        if now - self._warned_at.get(what, -every) < every:
            return False
        self._warned_at[what] = now
        return True

    def _forget(self, session: Session) -> None:
        self.sessions.discard(session)
        self.unauthenticated.pop(session, None)

    # -- connection loop ---------------------------------------------------------
    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(peer_name(writer))
        if not self.admit(session, writer):
            self.refused += 1
            log.log(logging.WARNING if self._may_warn("refused") else logging.DEBUG,
                    "%s: refused: all %d connections are authenticated sessions (%d refused so far)",
                    session.peer, self.limits.max_connections, self.refused)
            drop(writer, wire.encode(wire.reply_error(None, TargetError(
                f"kerninstd serves at most {self.limits.max_connections} connections, "
                "all in use; try again later"))))
            return
        log.debug("%s connected", session.peer)
        deadline = asyncio.get_running_loop().time() + self.limits.auth_timeout
        try:
            while True:
                try:
                    body = await self._read_frame(session, reader, deadline)
                except TimeoutError:
                    why = (f"not authenticated within {self.limits.auth_timeout:g} s"
                           if not session.authenticated else
                           f"idle for {self.limits.idle_timeout:g} s")
                    log.log(logging.INFO if session.authenticated else logging.DEBUG,
                            "%s: %s; closing", session.peer, why)
                    err = AuthError(why) if not session.authenticated else TargetTimeout(why)
                    drop(writer, wire.encode(wire.reply_error(None, err)))
                    break
                except ProtocolError as exc:
                    # The stream cannot be resynchronised after a bad length: answer and hang up.
                    log.warning("%s: %s; closing", session.peer, exc)
                    drop(writer, wire.encode(wire.reply_error(None, exc)))
                    break
                if body is None:
                    break
                reply, close = await self.handle(session, body)
                writer.write(self._frame(session, reply))
                if session.authenticated:
                    await writer.drain()
                else:
                    async with asyncio.timeout_at(deadline):
                        await writer.drain()
                if close:
                    break
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the peer went away (or would not read its replies before the deadline)
        except asyncio.CancelledError:
            # The server is shutting down: clean up below and end normally (asyncio 3.11's
            # stream callback would report a cancelled connection task as an error).
            pass
        finally:
            self._forget(session)
            self.cleanup(session)
            writer.close()
            self._quiesce_when_idle()
            log.log(logging.INFO if session.authenticated else logging.DEBUG,
                    "%s disconnected", session.peer)

    async def _read_frame(self, session: Session, reader: asyncio.StreamReader,
                          deadline: float) -> bytes | None:
        """The next frame's body; None at end of stream.  Before authentication the
        frame is small and the whole exchange is due by ``deadline``."""
        if session.authenticated:
            async with asyncio.timeout(self.limits.idle_timeout):
                try:
                    header = await reader.readexactly(wire.HEADER.size)
                except asyncio.IncompleteReadError:
                    return None
            return await reader.readexactly(wire.frame_length(header, wire.MAX_FRAME))
        async with asyncio.timeout_at(deadline):
            try:
                header = await reader.readexactly(wire.HEADER.size)
            except asyncio.IncompleteReadError:
                return None
            return await reader.readexactly(wire.frame_length(header, wire.MAX_AUTH_FRAME))

    def _frame(self, session: Session, reply: dict[str, Any]) -> bytes:
        try:
            return wire.encode(reply)
        except ProtocolError as exc:  # a result too large for one frame
            return wire.encode(wire.reply_error(reply.get("id"), exc))
        except (TypeError, ValueError) as exc:  # a result JSON cannot carry: a daemon bug
            log.exception("%s: cannot encode a reply", session.peer)
            return wire.encode(wire.reply_error(reply.get("id"), KsimError(
                f"kerninstd could not encode its reply: {type(exc).__name__}: {exc}")))

    async def handle(self, session: Session, body: bytes) -> tuple[dict[str, Any], bool]:
        """The reply to one frame and whether to hang up; never raises."""
        request_id = None
        name = "request"
        try:
            message = wire.decode(body)
            request_id = wire.request_id(message)
            op = wire.check_envelope(message)
            name = op.name
            if op.auth and not session.authenticated:
                # before its arguments are even looked at
                raise AuthError(f"{op.name}: not authenticated (hello, then auth)")
            args = wire.check_args(op, message)
            handler = self.handlers[op.name]
            if op.name not in self.READ_ONLY:
                self._text_view = None      # the module's state may change: read it again
            result = handler(session, **args)
            if asyncio.iscoroutine(result):
                result = await result
            return wire.reply_ok(message["id"], **(result or {})), op.name in ("bye",)
        except AuthError as exc:
            log.warning("%s: refused: %s", session.peer, exc)
            return wire.reply_error(request_id, exc), not session.authenticated
        except ProtocolError as exc:
            log.warning("%s: malformed request: %s", session.peer, exc)
            return wire.reply_error(request_id, exc), False
        except KsimError as exc:
            log.info("%s: %s", session.peer, exc)
            return wire.reply_error(request_id, exc), False
        except Exception as exc:
            # A daemon bug (or a device that misbehaves): the client hears of it and its
            # session -- with its splices -- goes on.
            log.exception("%s: %s failed unexpectedly", session.peer, name)
            detail = wire.clip(f"{type(exc).__name__}: {exc}", 300)
            return wire.reply_error(request_id, KsimError(
                f"{name}: kerninstd failed: {detail}")), False

    #: ops that change nothing in the module (text reads see other owners' splices
    #: through the state read before them)
    READ_ONLY = frozenset({"hello", "auth", "info", "kallsyms", "lookup", "read", "read_ranges",
                           "digests", "hazards", "hazard_table", "kept", "btf", "read_file",
                           "cgroup_path"})

    def _splices_view(self) -> tuple[Any, ...]:
        """The module's live text writes by address (a read looks at the few that can
        overlap it), kept until the module's state may change; none when its state
        cannot be read."""
        if self._text_view is None:
            try:
                state = self.device.state()
            except KsimError:
                return ()
            self._text_view = tuple(sorted(state.splices, key=lambda x: x.address))
            self._text_view_at = [x.address for x in self._text_view]
        return self._text_view

    def _as_kernel(self, session: Session, address: int, data: bytes) -> bytes:
        """``data`` read at ``address`` as the kernel's own text: where another owner's
        splice still holds what it wrote, the bytes it replaced (so that a client
        analyses the kernel, not another client's jumps; the module refuses the
        client any change there all the same)."""
        view = self._splices_view()
        end = address + len(data)
        out: bytearray | None = None
        first = bisect.bisect_left(self._text_view_at, address - wire.MAX_RANGE)
        last = bisect.bisect_left(self._text_view_at, end)
        for x in view[first:last]:
            if x.owner == session.owner or x.address >= end or x.address + len(x.cur) <= address:
                continue
            if out is None:
                out = bytearray(data)
            for j, (cur, orig) in enumerate(zip(x.cur, x.orig, strict=True)):
                i = x.address + j - address
                if 0 <= i < len(out) and out[i] == cur:
                    out[i] = orig
        return data if out is None else bytes(out)

    # -- cleanup and the module's log ------------------------------------------------
    def cleanup(self, session: Session) -> None:
        """End a session: unless it is kept, the module undoes everything its owner
        holds (text newest first, then trap routes, then blocks).  What the module
        could not undo stays with the owner, kept as an orphan; the allocators
        follow the module's log, so its blocks are never handed out again."""
        self._text_view = None
        owner, session.owner = session.owner, None
        if owner is None:
            return
        if session.keep_name is not None:
            log.info("%s: its splices stay, kept as %r", session.peer, session.keep_name)
            return
        try:
            self.device.owner_drop(owner)
        except KsimError as exc:
            log.error("%s: cannot undo everything it made: %s", session.peer, exc)
        except Exception:
            log.exception("%s: cannot undo what it made", session.peer)
        self._follow_module()

    def follow(self, state: ModuleState) -> None:
        """Make the allocators hold exactly the areas and blocks the module records
        (freed blocks among them, in quarantine until QUIESCE)."""
        for attr, kind in (("code", "code"), ("data", "data")):
            old: Region = getattr(self, attr)
            areas = [a for a in state.areas if a.region == kind] or [Area(kind, *self._first[kind])]
            first = next((a for a in areas if a.address == self._first[kind][0]), areas[0])
            region = Region(old.name, kind, (first.address, first.size))
            for area in areas:
                blocks = [(b.address, b.size) for b in state.blocks if b.region == kind
                          and area.address <= b.address < area.address + area.size]
                region.add(area.address, area.size, blocks)
            setattr(self, attr, region)
        self.quarantine = [(b.region, b.address) for b in state.blocks if not b.owner]

    def _follow_module(self) -> None:
        try:
            self.follow(self.device.state())
        except Exception:
            # The allocators keep every block they had: none is handed out twice.
            log.exception("cannot read the module's log; the allocators stay as they were")
            return
        try:
            self._shrink()
        except Exception:
            log.exception("cannot give back the areas left empty")

    def _owner(self, session: Session) -> int:
        """The session's owner in the module, made on first use."""
        if session.owner is None:
            session.owner = self.device.owner_new()
        return session.owner

    def _describe(self, state: ModuleState, owner: Owner) -> dict[str, Any]:
        splices, routes, blocks = state.of(owner.id)
        live = next((s.peer for s in self.sessions if s.owner == owner.id), None)
        return {
            "name": owner.name, "owner": owner.id, "orphan": "orphan" in owner.flags,
            "session": live,
            "writes": [{"address": x.address, "orig": x.orig.hex(), "cur": x.cur.hex()}
                       for x in splices],
            "routes": [{"site": r.site, "patch": r.patch} for r in routes],
            "blocks": [{"region": b.region, "address": b.address, "size": b.size} for b in blocks],
        }

    def _kept(self, state: ModuleState, name: str, what: str) -> Owner:
        """The kept owner called ``name``, free to be taken over by this session."""
        for owner in state.owners:
            if "kept" in owner.flags and owner.name == name:
                live = next((s for s in self.sessions if s.owner == owner.id), None)
                if live is not None:
                    raise TextOwned(f"{what}: {name!r} is kept by a session still connected "
                                    f"({live.peer}); it is free once that session ends")
                return owner
        raise UnknownHandle(f"{what}: no kept splice is called {name!r}")

    def _holder(self, state: ModuleState, address: int, size: int, me: int | None) -> str | None:
        """Who other than owner ``me`` holds some of [address, address + size), in words."""
        owners = {x.owner for x in state.splices if x.address < address + size
                  and address < x.address + len(x.cur)}
        owners |= {r.owner for r in state.routes if address <= r.site < address + size}
        owners |= {b.owner for b in state.blocks if b.owner and b.address < address + size
                   and address < b.address + b.size}
        for owner in state.owners:
            if owner.id in owners and owner.id != me:
                live = next((s.peer for s in self.sessions if s.owner == owner.id), None)
                if live is not None:
                    return f"another client's session ({live})"
                return f"the kept splice {owner.name!r}"
        return None

    def _owned(self, session: Session, what: str, places: list[tuple[int, int]]) -> TextOwned:
        """The error for a change the module refused because another owner holds the place."""
        try:
            state = self.device.state()
            held = [(a, n, self._holder(state, a, n, session.owner)) for a, n in places]
            found = "; ".join(f"{a:#x}+{n}: {who}" for a, n, who in held if who)
        except KsimError:
            found = ""
        who = f"held by {found}" if found else "another owner holds it"
        return TextOwned(f"{what} refused: {who}; nothing was changed")

    @staticmethod
    def _undo_step(session: Session, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except KsimError as exc:
            log.error("%s: cannot %s: %s", session.peer, what, exc)
        except Exception:
            log.exception("%s: cannot %s", session.peer, what)

    # -- ops -----------------------------------------------------------------------
    def op_hello(self, session: Session) -> dict[str, Any]:
        return {"server": "kerninstd", "protocol": wire.VERSION, "abi": int(self.info["version"]),
                "nonce": session.nonce, "kernel": os.uname().release}

    def op_auth(self, session: Session, mac: bytes) -> dict[str, Any]:
        expected = bytes.fromhex(wire.mac(self.token, session.nonce))
        if not hmac.compare_digest(expected, mac):
            raise AuthError("wrong token")
        session.authenticated = True
        self.unauthenticated.pop(session, None)
        log.info("%s authenticated", session.peer)
        return {}

    def op_info(self, session: Session) -> dict[str, Any]:
        machine = os.uname().machine
        arch = abi.MACHINES.get(machine, machine)
        return {**self.info, "kernel": os.uname().release, "arch": arch,
                "trap_immediate": abi.TRAP_IMMEDIATES.get(arch),
                # every byte of a code block alloc_code hands out (the module's CLAIM)
                "code_fill": (abi.code_fill(arch) or b"").hex() or None,
                "allow_exec": self.allow_exec,
                "code_free": self.code.bytes_free, "data_free": self.data.bytes_free,
                "areas": self.code.describe() + self.data.describe(),
                "modules": modules_digest()}

    def op_kallsyms(self, session: Session, offset: int) -> dict[str, Any]:
        if offset == 0 or self._kallsyms is None:
            try:
                with open("/proc/kallsyms") as f:
                    self._kallsyms = f.read()
            except OSError as exc:
                raise TargetError(f"kallsyms: /proc/kallsyms: {exc.strerror}") from None
        text = self._kallsyms[offset:offset + wire.KALLSYMS_PAGE]
        end = offset + len(text)
        return {"text": text, "next": end if end < len(self._kallsyms) else None,
                "total": len(self._kallsyms)}

    def op_lookup(self, session: Session, name: str) -> dict[str, Any]:
        return {"address": self.device.lookup(name)}

    def op_read(self, session: Session, address: int, size: int,
                kernel: bool = False) -> dict[str, Any]:
        if address + size > wire.U64_MAX + 1:
            raise ProtocolError(f"read: {address:#x}+{size} passes the end of the address space")
        data = self.device.read(address, size)
        return {"data": (self._as_kernel(session, address, data) if kernel else data).hex()}

    def op_read_ranges(self, session: Session, ranges: bytes,
                       kernel: bool = False) -> dict[str, Any]:
        """op_read of many ranges in one request: ``ranges`` packed as hazard_table's
        rows (address, length); the bytes of each, end to end, and the rows that could
        not be read (zeros in their place)."""
        data, failed = self._read_rows(session, "read_ranges", ranges, wire.MAX_READ, kernel)
        return {"data": data.hex(), "failed": failed}

    def op_digests(self, session: Session, ranges: bytes, kernel: bool = False) -> dict[str, Any]:
        """op_read_ranges as a 64-bit XXH64 of each row (what an analysis record
        keeps of the bytes it was made from), worked out by the module: a client checks
        that text it has records of is unchanged without reading it.  With ``kernel``,
        a row another owner's splice overlaps is given as failed: the client reads
        it (read_ranges with kernel gives its bytes as they were)."""
        sums, failed = self._read_rows(session, "digests", ranges, wire.MAX_DIGESTED, kernel,
                                       digest=True)
        return {"digests": sums.hex(), "failed": failed}

    def _read_rows(self, session: Session, op: str, ranges: bytes, most: int,
                   kernel: bool, digest: bool = False) -> tuple[bytes, list[int]]:
        """The bytes of the packed (address, length) rows end to end, ``most`` in all
        (``digest``: each row's 8-byte XXH64 instead), and the rows that could not be
        read (zeros in their place).  One module call reads (and digests) them all;
        only rows another owner's splice overlaps are looked at one by one."""
        if len(ranges) % wire.RANGE_ROW:
            raise ProtocolError(f"{op}: argument 'ranges' is {len(ranges)} bytes, "
                                f"not a whole number of {wire.RANGE_ROW}-byte rows")
        packed = array.array("Q", ranges)
        if sys.byteorder != "little":
            packed.byteswap()
        starts, lengths = packed[0::2], packed[1::2]
        # checked for the whole table at once, by bounds that hold for every row when
        # they hold for the extremes (an emulated guest's Python pays microseconds a
        # row: summing 3,000 rows' ends was 1.3 ms of a 11 ms request); the row at
        # fault is looked for only when a bound does not hold
        longest = max(lengths, default=0)
        if lengths and (min(lengths) < 1 or longest > wire.MAX_READ
                        or max(starts) > wire.U64_MAX + 1 - longest):
            for i, (address, length) in enumerate(zip(starts, lengths, strict=True)):
                if not 1 <= length <= wire.MAX_READ or address + length > wire.U64_MAX + 1:
                    raise ProtocolError(f"{op}: argument 'ranges[{i}]': {address:#x}+{length} "
                                        f"is not 1..{wire.MAX_READ} bytes inside the address space")
        total = sum(lengths)
        if total > most:
            raise ProtocolError(f"{op}: the ranges hold more than {most} bytes in all")
        if not starts:
            return b"", []
        data, failed = self.device.read_rows(ranges, len(starts), total, digest=digest)
        if kernel:
            data, failed = self._rows_as_kernel(session, starts, lengths, data, failed, digest)
        return data, failed

    def _rows_as_kernel(self, session: Session, starts: Sequence[int], lengths: Sequence[int],
                        data: bytes, failed: list[int], digest: bool) -> tuple[bytes, list[int]]:
        """_read_rows' ``data`` as the kernel's own text (_as_kernel) where another
        owner's splice overlaps a row: that row's bytes made again; or, for a digest,
        the row given as failed (zeros), the client reading its bytes itself (the
        digest is the module's alone: this daemon works out none)."""
        view = self._splices_view()
        foreign = [x.address for x in view if x.owner != session.owner]
        if not foreign:
            return data, failed
        out = bytearray(data)
        unread = set(failed)
        at = 0
        for i, (address, length) in enumerate(zip(starts, lengths, strict=True)):
            here, at = at, at + (wire.DIGEST if digest else length)
            if i in unread or (bisect.bisect_left(foreign, address + length)
                               == bisect.bisect_left(foreign, address - wire.MAX_RANGE)):
                continue
            if digest:
                out[here:at] = bytes(wire.DIGEST)
                unread.add(i)
            else:
                out[here:at] = self._as_kernel(session, address, bytes(out[here:at]))
        return bytes(out), sorted(unread)

    def op_write(self, session: Session, address: int, data: bytes) -> dict[str, Any]:
        if session.owner is None:
            raise TargetFault(f"write: {address:#x}+{len(data)} is not inside a data-heap "
                              "block of this client (text changes go through poke)")
        try:
            self.device.write(address, data, session.owner)
        except TargetFault:
            raise TargetFault(f"write: {address:#x}+{len(data)} is not inside a data-heap "
                              "block of this client (text changes go through poke)") from None
        except TextOwned:
            raise self._owned(session, "write", [(address, len(data))]) from None
        return {}

    def _alloc(self, region: Region, size: int, align: int) -> int:
        """A block of ``region``: where it fits; else, for patch code, where freed code
        was once no task can still run in it (QUIESCE); else in an area the module adds."""
        try:
            return region.alloc(size, align)
        except OutOfMemory:
            pass
        if any(kind == region.kind for kind, _ in self.quarantine):
            self._release_quarantine()
            try:
                return region.alloc(size, align)
            except OutOfMemory:
                pass
        address, got = self.device.area_add(region.kind, max(GROW, size + align))
        region.add(address, got)
        log.info("%s: added an area of %d bytes at %#x (%d areas)", region.name, got, address,
                 len(region.areas))
        return region.alloc(size, align)

    def _alloc_code(self, size: int) -> int:
        return self._alloc(self.code, size, 16)

    def _release_quarantine(self) -> None:
        self.device.quiesce()
        for kind, address in self.quarantine:
            (self.code if kind == "code" else self.data).free(address)
        self.quarantine.clear()

    def _quiesce_when_idle(self) -> None:
        """With no session left, wait out now the tasks that may still run in freed
        patch code (QUIESCE) and free those blocks: the next client's first patch
        block does not wait for it (some 30 ms under emulation, every few commands)."""
        if self.sessions or self.unauthenticated or not self.quarantine:
            return
        try:
            self._release_quarantine()
        except Exception:
            log.exception("cannot free the blocks waiting for QUIESCE")

    def _shrink(self) -> None:
        """Give back the added areas that hold no block: first wait out the tasks that
        may still run in freed patch code (and so still write its heap blocks)."""
        if len(self.code.areas) == 1 and len(self.data.areas) == 1:
            return  # nothing was added
        parked = set(self.quarantine)
        if not (self.code.idle(lambda a: ("code", a) not in parked)
                or self.data.idle(lambda a: ("data", a) not in parked)):
            return
        if self.quarantine:
            self._release_quarantine()
        for region in (self.code, self.data):
            for address in region.idle():
                try:
                    self.device.area_drop(region.kind, address)
                except KsimError as exc:
                    log.error("%s: cannot give back the area at %#x: %s", region.name, address, exc)
                    continue
                del region.areas[address]
                log.info("%s: gave back the area at %#x (%d areas)", region.name, address,
                         len(region.areas))

    def _claim(self, session: Session, region: str, alloc: Region, address: int,
               size: int) -> None:
        try:
            self.device.claim(self._owner(session), region, address, size)
        except BaseException:
            alloc.free(address)
            raise

    def op_alloc_code(self, session: Session, size: int) -> dict[str, Any]:
        address = self._alloc_code(size)
        self._claim(session, "code", self.code, address, size)
        return {"address": address}

    def _free(self, session: Session, region: str, address: int) -> None:
        op, kind = f"free_{region}", "patch" if region == "code" else "data"
        if session.owner is None:
            raise UnknownHandle(f"{op}: {address:#x} is not a {kind} block of this client")
        try:
            self.device.free(session.owner, region, address)
        except UnknownHandle:
            raise UnknownHandle(f"{op}: {address:#x} is not a {kind} block of this client") from None
        except TextOwned:
            raise self._owned(session, op, [(address, 1)]) from None
        except AlreadySpliced:
            raise AlreadySpliced(f"{op}: a trap route or a jump in text still leads into the "
                                 f"patch block at {address:#x}; undo them first") from None
        except BlockInUse:
            live = self._patch_live(session.owner)
            count = f"{live} live splices/routes" if live is not None else "live splices/routes"
            raise BlockInUse(f"{op}: the data block at {address:#x}: this client still has "
                             f"{count} whose patch code may write it; remove them first; "
                             "nothing was freed") from None

    def _patch_live(self, owner: int) -> int | None:
        """How many of ``owner``'s trap routes and text writes, in the module's log, lead
        into patch code of its -- the module's rule for refusing to free its data blocks
        (ki_owner_patch_live); None when the log cannot be read."""
        try:
            state = self.device.state()
        except KsimError:
            return None
        splices, routes, blocks = state.of(owner)
        code = [(b.address, b.address + b.size) for b in blocks if b.region == "code"]
        arch = abi.MACHINES.get(os.uname().machine, abi.MACHINE)
        jumps = [abi.jump_dest(arch, x.address, x.cur) for x in splices]
        return len(routes) + sum(1 for d in jumps if d is not None
                                 and any(lo <= d < hi for lo, hi in code))

    def op_free_code(self, session: Session, address: int) -> dict[str, Any]:
        self._free(session, "code", address)
        self.quarantine.append(("code", address))
        self._shrink()
        return {}

    def op_alloc_data(self, session: Session, size: int, align: int) -> dict[str, Any]:
        if align & (align - 1):
            raise ProtocolError(f"alloc_data: argument 'align' must be a power of two, got {align}")
        address = self._alloc(self.data, size, align)
        self._claim(session, "data", self.data, address, size)
        try:
            self.device.write(address, bytes(size), self._owner(session))
        except Exception:
            self._undo_step(session, f"free the data block at {address:#x}", self.device.free,
                            session.owner, "data", address)
            self.quarantine.append(("data", address))
            raise
        return {"address": address}

    def op_free_data(self, session: Session, address: int) -> dict[str, Any]:
        self._free(session, "data", address)
        self.quarantine.append(("data", address))
        self._shrink()
        return {}

    def _in_code(self, address: int, size: int) -> bool:
        """Whether a write touches the patch area; everything else is text to the module
        (core kernel text or a live module's text; the module refuses anything else)."""
        return self.code.touches(address, size)

    def _refusal(self, what: str, writes: list[tuple[int, bytes, bytes]]) -> KsimError:
        """The error for a poke or trap the module refused with EPERM: the class of
        the most specific hazard it found (ksim.splice.hazards), each write's hazards
        named in the message."""
        text = [(a, len(new)) for a, _, new in writes
                if not self._in_code(a, len(new)) and len(new) <= wire.MAX_RANGE]
        try:
            flags = self.device.hazards(text) if text else []
        except KsimError:
            flags = []
        names = [abi.hazard_names(f) for f in flags]
        found = "; ".join(f"{a:#x}+{n}: {', '.join(ns)}"
                          for (a, n), ns in zip(text, names, strict=True) if ns)
        every = {n for ns in names for n in ns}
        cls = hazards.error_class(every) if every else Blacklisted
        return cls(f"{what} refused: the kernel relies on this text staying as it is: "
                   f"{found or '(the hazard is gone: retry)'}; nothing was written")

    def op_poke(self, session: Session, writes: list[tuple[int, bytes, bytes]],
                routes: list[tuple[int, int]]) -> dict[str, Any]:
        total = 0
        for i, (address, old, new) in enumerate(writes):
            if len(old) != len(new):
                raise ProtocolError(f"poke: argument 'writes[{i}]': old is {len(old)} bytes "
                                    f"and new {len(new)}; they must be the same length")
            if address + len(new) > wire.U64_MAX + 1:
                raise ProtocolError(f"poke: argument 'writes[{i}]': {address:#x}+{len(new)} "
                                    "passes the end of the address space")
            total += len(new)
        if total > wire.MAX_POKE_TOTAL:
            raise ProtocolError(f"poke: argument 'writes': {total} new bytes, over the limit of "
                                f"{wire.MAX_POKE_TOTAL} per batch")
        return self._poke(session, "poke", writes, routes)

    def op_routes(self, session: Session, routes: list[tuple[int, int]]) -> dict[str, Any]:
        return self._poke(session, "routes", [], routes)

    def _poke(self, session: Session, op: str, writes: list[tuple[int, bytes, bytes]],
              routes: list[tuple[int, int]]) -> dict[str, Any]:
        """One batch: the route changes, in order, then the writes; all or nothing."""
        try:
            self.device.poke(writes, self._owner(session), routes)
        except Blacklisted:
            raise self._refusal(op, writes + [(site, b"", b"?") for site, p in routes if p]) from None
        except TextOwned:
            # a route is refused for its site or for the patch it leads to
            places = [(a, len(new)) for a, _, new in writes] + [(site, 1) for site, _ in routes] \
                + [(patch, 1) for _, patch in routes if patch]
            raise self._owned(session, op, places) from None
        except UnknownHandle:
            if not routes:
                raise
            raise UnknownHandle(f"{op}: a route to clear is not one of this client's") from None
        except JumpOutside:
            raise
        except OutsideText as exc:
            code = [f"{a:#x}+{len(new)}" for a, _, new in writes if self._in_code(a, len(new))]
            if not code:
                raise
            raise OutsideText(f"{op} at {', '.join(code)}: inside the patch area but not "
                              "inside a patch block of this client (or another write is "
                              f"outside text: {exc})") from None
        return {}

    def op_hazards(self, session: Session, ranges: list[tuple[int, int]]) -> dict[str, Any]:
        for i, (address, length) in enumerate(ranges):
            if address + length > wire.U64_MAX + 1:
                raise ProtocolError(f"hazards: argument 'ranges[{i}]': {address:#x}+{length} "
                                    "passes the end of the 64-bit address space")
        flags = self.device.hazards(ranges) if ranges else []
        return {"hazards": [abi.hazard_names(f) if f else [] for f in flags]}

    def op_hazard_table(self, session: Session, table: bytes) -> dict[str, Any]:
        """op_hazards for a packed table: the rows go to the module as they are (it
        refuses a range of no length or over MAX_TEXT_WRITE bytes itself), and the
        answer is each row's flags word -- no Python work per row, which in an
        emulated guest cost tens of microseconds each."""
        if len(table) % wire.RANGE_ROW:
            raise ProtocolError(f"hazard_table: argument 'table' is {len(table)} bytes, "
                                f"not a whole number of {wire.RANGE_ROW}-byte rows")
        words = array.array("I", self.device.hazard_table(table))
        if sys.byteorder != "little":
            words.byteswap()
        return {"flags": words[3::4].tobytes().hex()}

    def op_set_trap(self, session: Session, site: int, patch: int) -> dict[str, Any]:
        try:
            self.device.set_trap(site, patch, self._owner(session))
        except Blacklisted:
            raise self._refusal("set_trap", [(site, b"", b"?")]) from None
        except TextOwned:
            raise self._owned(session, f"set_trap {site:#x} -> {patch:#x}",
                              [(site, 1), (patch, 1)]) from None
        return {}

    def op_clear_trap(self, session: Session, site: int) -> dict[str, Any]:
        if session.owner is None:
            raise UnknownHandle(f"clear_trap: no trap of this client at {site:#x}")
        try:
            self.device.clear_trap(site, session.owner)
        except UnknownHandle:
            raise UnknownHandle(f"clear_trap: no trap of this client at {site:#x}") from None
        except TextOwned:
            raise self._owned(session, "clear_trap", [(site, 1)]) from None
        return {}

    def op_keep(self, session: Session, keep: bool, name: str) -> dict[str, Any]:
        if not keep:
            if session.owner is not None and session.keep_name is not None:
                self.device.owner_keep(session.owner, "")
            session.keep_name = None
            return {"name": None}
        owner = self._owner(session)
        name = check_keep_name(name) if name else session.keep_name or f"kept-{owner}"
        self.device.owner_keep(owner, name)
        session.keep_name = name
        return {"name": name}

    def op_kept(self, session: Session) -> dict[str, Any]:
        state = self.device.state()
        return {"kept": [self._describe(state, o) for o in state.owners if "kept" in o.flags]}

    def op_adopt(self, session: Session, name: str) -> dict[str, Any]:
        state = self.device.state()
        kept = self._kept(state, name, "adopt")
        described = self._describe(state, kept)
        self.device.owner_adopt(self._owner(session), name)
        return {"adopted": described}

    def op_remove_kept(self, session: Session, name: str) -> dict[str, Any]:
        state = self.device.state()
        kept = self._kept(state, name, "remove_kept")
        described = self._describe(state, kept)
        try:
            self.device.owner_drop(kept.id)
        except StaleText as exc:
            self._follow_module()
            raise StaleText(f"remove_kept {name!r}: some of its text changed behind ksim and "
                            f"was left as it is; it stays, kept as an orphan ({exc})") from None
        self._follow_module()
        return {"removed": described}

    TRACEFS = "/sys/kernel/tracing/"
    KPROBES_OPTIMIZATION = "/proc/sys/debug/kprobes-optimization"
    #: the only directories mkdir and rmdir may touch: ksim's own trace instances, so
    #: that trace events can be enabled without the global buffer (Documentation/trace/
    #: ftrace.rst, "Instances": mkdir makes a buffer with its own events/, rmdir removes it)
    TRACE_INSTANCE = re.compile(r"/sys/kernel/tracing/instances/ksim-[a-z0-9-]+")

    def op_tracefs(self, session: Session, file: str, mode: str, data: str) -> dict[str, Any]:
        """The kprobe oracle's file accesses, made without a shell (a shell's own
        syscalls would be counted by the probe it sets up); and ksim's trace
        instances made and removed."""
        if mode not in wire.TRACEFS_MODES:
            raise ProtocolError(f"tracefs: argument 'mode' must be r, w or a (a file), or mkdir "
                                f"or rmdir (a ksim instance), got {wire.clip(repr(mode))}")
        path = os.path.normpath(file)
        if mode in ("mkdir", "rmdir"):
            return self._trace_instance(path, file, mode)
        if not (path.startswith(self.TRACEFS) or path == self.KPROBES_OPTIMIZATION):
            raise AuthError(f"tracefs: {wire.clip(repr(file))} is neither under {self.TRACEFS} "
                            f"nor {self.KPROBES_OPTIMIZATION}")
        try:
            if mode == "r":
                with open(path, errors="replace") as f:
                    return {"data": f.read()[:wire.MAX_EXEC_OUTPUT]}
            # os-level I/O: Python's append mode seeks to the end, which tracefs refuses.
            flags = os.O_WRONLY | (os.O_APPEND if mode == "a" else os.O_TRUNC)
            fd = os.open(path, flags)
            try:
                os.write(fd, data.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise TargetError(f"tracefs: {mode} {path}: {exc.strerror}") from None
        return {}

    def _trace_instance(self, path: str, file: str, mode: str) -> dict[str, Any]:
        if not self.TRACE_INSTANCE.fullmatch(path):
            raise AuthError(f"tracefs: {mode} is allowed only for a ksim trace instance, "
                            f"{self.TRACEFS}instances/ksim-NAME (NAME of a-z, 0-9 and -), "
                            f"not {wire.clip(repr(file))}")
        try:
            (os.mkdir if mode == "mkdir" else os.rmdir)(path)
        except OSError as exc:
            raise TargetError(f"tracefs: {mode} {path}: {exc.strerror}") from None
        return {}

    BTF_DIR = "/sys/kernel/btf/"
    #: vmlinux, or a module's name as /sys/kernel/btf lists it (kernel/bpf/btf.c
    #: btf_module_notify: one file per module, named after it)
    BTF_NAME = re.compile(r"[A-Za-z0-9_-]+")

    def op_btf(self, session: Session, name: str, offset: int, length: int) -> dict[str, Any]:
        """A chunk of the kernel's BTF for ``name``, with the whole file's size and
        sha256 (what a client caches it by).  The file is read afresh at offset 0,
        and kept for the chunks after it: a module loaded again has new BTF, and a
        client that sees the digest change mid-way starts again."""
        if not self.BTF_NAME.fullmatch(name):
            raise ProtocolError(f"btf: argument 'name' must be vmlinux or a module's name "
                                f"(letters, digits, _ and -), got {wire.clip(repr(name))}")
        kept = self._btf.get(name)
        if offset == 0 or kept is None:
            kept = self._btf[name] = self._read_btf(name)
        data, digest = kept
        if offset > len(data):
            raise ProtocolError(f"btf: offset {offset} is past the end of {self.BTF_DIR}{name} "
                                f"({len(data)} bytes)")
        return {"size": len(data), "sha256": digest,
                "data": data[offset:offset + length].hex()}

    def _read_btf(self, name: str) -> tuple[bytes, str]:
        path = self.BTF_DIR + name
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            what = ("the kernel was built without BTF (CONFIG_DEBUG_INFO_BTF)" if name == "vmlinux"
                    else "no module of that name is loaded, or it has no BTF")
            raise BTFError(f"btf: no {path}: {what}") from None
        except OSError as exc:
            raise BTFError(f"btf: {path}: {exc.strerror}") from None
        return data, hashlib.sha256(data).hexdigest()

    def op_read_file(self, session: Session, path: str, size: int,
                     offset: int = 0) -> dict[str, Any]:
        """Up to ``size`` bytes from ``offset`` of a regular file (ksim trace's cat(),
        and the ELF files a user stack's frames are named from); fewer at its end.
        Opened without following a last symbolic link and without blocking (a fifo is
        never waited on), then checked to be a regular file before a byte is read."""
        if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            raise wire.TracedFileRefused(f"read_file: {wire.clip(repr(path))} is not an absolute "
                                         "path without '..'")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            raise wire.TracedFileRefused(f"read_file: {path}: {exc.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise wire.TracedFileRefused(f"read_file: {path} is not a regular file")
            data = bytearray()
            while len(data) < size:     # procfs and sysfs files come a page at a time
                chunk = os.pread(fd, size - len(data), offset + len(data))
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            raise wire.TracedFileRefused(f"read_file: {path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        # the offset told back: a client asking from one knows this daemon read from it
        # (an older one ignores the field it does not know, and reads from 0)
        return {"data": bytes(data).hex(), "offset": offset}

    CGROUP_ROOT = "/sys/fs/cgroup"

    def op_cgroup_path(self, session: Session, cgroup: int) -> dict[str, Any]:
        """The cgroup2 path of the cgroup whose id is ``cgroup`` ("/" for the root): the
        directory under /sys/fs/cgroup whose inode number it is (a cgroup's id is its
        kernfs node's, the inode number on 64-bit kernels: fs/kernfs/mount.c
        kernfs_fh_to_dentry), found by a walk of at most MAX_CGROUP_DIRS directories."""
        seen = 0
        stack = [self.CGROUP_ROOT]
        while stack:
            d = stack.pop()
            try:
                if os.stat(d, follow_symlinks=False).st_ino == cgroup:
                    rel = d[len(self.CGROUP_ROOT):]
                    return {"path": rel or "/"}
                entries = list(os.scandir(d))
            except OSError:
                continue            # a cgroup removed meanwhile
            stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
            seen += 1
            if seen > wire.MAX_CGROUP_DIRS:
                break
        raise wire.TracedFileRefused(f"cgroup_path: no cgroup with id {cgroup} under "
                                     f"{self.CGROUP_ROOT}")

    async def op_exec(self, session: Session, cmd: str, timeout: float) -> dict[str, Any]:
        if not self.allow_exec:
            raise AuthError("exec is disabled (kerninstd was not started with --allow-exec)")
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_shell(
                cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise TargetError(f"exec: cannot start {wire.clip(repr(cmd))}: {exc.strerror}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise TargetTimeout(f"exec: {wire.clip(repr(cmd))} still running after {timeout:g} s; killed") from None
        return {"rc": proc.returncode,
                "stdout": out[-wire.MAX_EXEC_OUTPUT:].decode(errors="replace"),
                "stderr": err[-wire.MAX_EXEC_OUTPUT:].decode(errors="replace"),
                "seconds": time.monotonic() - start}

    def op_bye(self, session: Session) -> dict[str, Any]:
        return {}


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    return host or "0.0.0.0", int(port)


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be positive and finite, got {value!r}")
    return seconds


def idle_seconds(value: str) -> float | None:
    """--idle-timeout: 0 (or off, never) keeps idle sessions forever."""
    if value.strip().lower() in ("off", "never"):
        return None
    try:
        if float(value) == 0:
            return None
    except ValueError:
        pass
    return positive_seconds(value)


def positive_count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


async def start(daemon: Daemon, host: str, port: int) -> asyncio.Server:
    """The listening server (port 0: any free port, see ``server.sockets``)."""
    return await asyncio.start_server(daemon.serve_client, host, port, backlog=LISTEN_BACKLOG)


async def serve(daemon: Daemon, host: str, port: int) -> None:
    server = await start(daemon, host, port)
    lim = daemon.limits
    log.info("listening on %s:%d (abi %d, text %#x-%#x, exec %s)", host, port,
             daemon.info["version"], daemon.text[0], daemon.text[1],
             "allowed" if daemon.allow_exec else "disabled")
    log.info("limits: auth within %g s, idle %s, %d connections, %d unauthenticated",
             lim.auth_timeout, "forever" if lim.idle_timeout is None else f"{lim.idle_timeout:g} s",
             lim.max_connections, lim.max_unauthenticated)
    print(f"kerninstd: listening on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kerninstd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 7070),
                        help="HOST:PORT to listen on (default 127.0.0.1:7070)")
    parser.add_argument("--token-file", required=True,
                        help="file holding the shared secret (must be mode 0600, owned by us)")
    parser.add_argument("--device", default="/dev/kerninst")
    parser.add_argument("--allow-exec", action="store_true",
                        help="serve the exec op (run shell commands for clients): testbeds only")
    defaults = Limits()
    parser.add_argument("--auth-timeout", type=positive_seconds, default=defaults.auth_timeout,
                        metavar="SECONDS", help="close a connection not authenticated within "
                        f"this many seconds of connecting (default {defaults.auth_timeout:g})")
    parser.add_argument("--idle-timeout", type=idle_seconds, default=None, metavar="SECONDS",
                        help="close an authenticated session after this many seconds without a "
                        "request, undoing its splices unless it sent keep (default 0: never)")
    parser.add_argument("--max-connections", type=positive_count,
                        default=defaults.max_connections, metavar="N",
                        help="connections in all; beyond it the oldest unauthenticated one is "
                        f"closed, or the new one refused (default {defaults.max_connections})")
    parser.add_argument("--max-unauthenticated", type=positive_count,
                        default=defaults.max_unauthenticated, metavar="N",
                        help="connections not yet authenticated; beyond it the oldest of them "
                        f"is closed (default {defaults.max_unauthenticated})")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="kerninstd: %(levelname)s %(message)s", stream=sys.stderr)
    limits = fit_fd_limit(Limits(auth_timeout=args.auth_timeout, idle_timeout=args.idle_timeout,
                                 max_connections=args.max_connections,
                                 max_unauthenticated=args.max_unauthenticated))
    try:
        token = read_token(args.token_file)
        device = Device(args.device)
    except (KsimError, OSError) as exc:
        print(f"kerninstd: refusing to start: {exc}", file=sys.stderr)
        return 2
    daemon = Daemon(device, token, allow_exec=args.allow_exec, limits=limits)
    host, port = args.listen
    try:
        asyncio.run(serve(daemon, host, port))
    except KeyboardInterrupt:
        pass
    finally:
        for session in list(daemon.sessions):
            daemon.cleanup(session)
        device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
