"""kerninstd: serves /dev/kerninst to authenticated ksim clients over TCP.

    kerninstd --listen HOST:PORT --token-file PATH [--device /dev/kerninst] [--allow-exec]

One asyncio server; device calls are quick ioctls made from the event loop, so
they are serialised; ``exec`` runs its command as a subprocess and does not
block other clients.  Each client owns what it made (text writes, trap routes,
patch-area and data-heap blocks); when it disconnects they are undone, newest
first, unless it sent ``keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ksim.errors import (
    AuthError,
    Blacklisted,
    KsimError,
    OutsideText,
    ProtocolError,
    TargetError,
    TargetFault,
    TargetTimeout,
    UnknownHandle,
)
from ksim.splice import hazards
from ksim.splice.alloc import RegionAllocator
from live import abi
from live import protocol as wire
from live.device import Device

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


@dataclass
class TextWrite:
    address: int
    orig: bytes
    cur: bytes


@dataclass(eq=False)
class Session:
    peer: str
    nonce: str = field(default_factory=lambda: secrets.token_hex(32))
    authenticated: bool = False
    keep: bool = False
    text: list[TextWrite] = field(default_factory=list)
    traps: set[int] = field(default_factory=set)
    code: set[int] = field(default_factory=set)
    data: set[int] = field(default_factory=set)

    def log_write(self, address: int, old: bytes, new: bytes) -> None:
        """The module's splice-log rule: a write that restores a record's bytes retires it."""
        for i in range(len(self.text) - 1, -1, -1):
            rec = self.text[i]
            if rec.address == address and rec.cur == old:
                if new == rec.orig:
                    del self.text[i]
                else:
                    rec.cur = new
                return
        self.text.append(TextWrite(address, old, new))


class Daemon:
    def __init__(self, device: Device, token: bytes, *, allow_exec: bool = False) -> None:
        self.device = device
        self.token = token
        self.allow_exec = allow_exec
        self.info = device.info()
        self.text = (int(self.info["text_start"]), int(self.info["text_end"]))
        cs, csz = int(self.info["code_start"]), int(self.info["code_size"])
        ds, dsz = int(self.info["data_start"]), int(self.info["data_size"])
        self.code = RegionAllocator(cs, cs + csz, name="patch area")
        self.data = RegionAllocator(ds, ds + dsz, name="data heap")
        # Freed patch code is reused only after QUIESCE: a task preempted inside it must leave first.
        self.quarantine: list[int] = []
        self.sessions: set[Session] = set()
        self._kallsyms: str | None = None
        self.handlers = {name: getattr(self, f"op_{name}") for name in wire.OPS}

    # -- connection loop ---------------------------------------------------------
    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        session = Session(peer)
        self.sessions.add(session)
        log.info("%s connected", peer)
        try:
            while True:
                try:
                    header = await reader.readexactly(wire.HEADER.size)
                except asyncio.IncompleteReadError:
                    break
                try:
                    length = wire.frame_length(header)
                except ProtocolError as exc:
                    # The stream cannot be resynchronised after a bad length: answer and hang up.
                    log.warning("%s: %s; closing", peer, exc)
                    writer.write(wire.encode(wire.reply_error(None, exc)))
                    await writer.drain()
                    break
                body = await reader.readexactly(length)
                reply, close = await self.handle(session, body)
                try:
                    frame = wire.encode(reply)
                except ProtocolError as exc:  # a result too large for one frame
                    frame = wire.encode(wire.reply_error(reply.get("id"), exc))
                writer.write(frame)
                await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.sessions.discard(session)
            self.cleanup(session)
            writer.close()
            log.info("%s disconnected", peer)

    async def handle(self, session: Session, body: bytes) -> tuple[dict[str, Any], bool]:
        request_id = None
        try:
            message = wire.decode(body)
            request_id = message.get("id") if isinstance(message.get("id"), int) else None
            op, args = wire.check_request(message)
            if op.auth and not session.authenticated:
                raise AuthError(f"{op.name}: not authenticated (hello, then auth)")
            handler = self.handlers[op.name]
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

    # -- cleanup -----------------------------------------------------------------
    def cleanup(self, session: Session) -> None:
        if session.keep:
            log.info("%s: keeping %d text writes, %d traps", session.peer,
                     len(session.text), len(session.traps))
            return
        for rec in reversed(session.text):
            try:
                self.device.poke([(rec.address, rec.cur, rec.orig)])
            except KsimError as exc:
                log.error("%s: cannot undo the write at %#x: %s", session.peer, rec.address, exc)
        session.text.clear()
        for site in sorted(session.traps):
            try:
                self.device.clear_trap(site)
            except KsimError as exc:
                log.error("%s: cannot clear the trap at %#x: %s", session.peer, site, exc)
        session.traps.clear()
        for address in list(session.code):
            self._free_code(session, address)
        for address in list(session.data):
            self.data.free(address)
        session.data.clear()

    def _free_code(self, session: Session, address: int) -> None:
        session.code.discard(address)
        self.quarantine.append(address)

    # -- ops -----------------------------------------------------------------------
    def op_hello(self, session: Session) -> dict[str, Any]:
        return {"server": "kerninstd", "protocol": wire.VERSION, "abi": int(self.info["version"]),
                "nonce": session.nonce, "kernel": os.uname().release}

    def op_auth(self, session: Session, mac: str) -> dict[str, Any]:
        expected = wire.mac(self.token, session.nonce)
        if not hmac.compare_digest(expected, mac):
            raise AuthError("wrong token")
        session.authenticated = True
        log.info("%s authenticated", session.peer)
        return {}

    def op_info(self, session: Session) -> dict[str, Any]:
        return {**self.info, "kernel": os.uname().release, "allow_exec": self.allow_exec,
                "code_free": self.code.bytes_free, "data_free": self.data.bytes_free,
                "modules": modules_digest()}

    def op_kallsyms(self, session: Session, offset: int) -> dict[str, Any]:
        if offset == 0 or self._kallsyms is None:
            with open("/proc/kallsyms") as f:
                self._kallsyms = f.read()
        text = self._kallsyms[offset:offset + wire.KALLSYMS_PAGE]
        end = offset + len(text)
        return {"text": text, "next": end if end < len(self._kallsyms) else None,
                "total": len(self._kallsyms)}

    def op_lookup(self, session: Session, name: str) -> dict[str, Any]:
        return {"address": self.device.lookup(name)}

    def op_read(self, session: Session, address: int, size: int) -> dict[str, Any]:
        if not 0 < size <= wire.MAX_READ:
            raise ProtocolError(f"read: size {size} outside 1..{wire.MAX_READ}")
        return {"data": self.device.read(address, size).hex()}

    def _data_block(self, address: int, size: int) -> None:
        for start, length in self.data.allocated().items():
            if start <= address and address + size <= start + length:
                return
        raise TargetFault(f"{address:#x}+{size} is not inside an allocated data-heap block "
                          "(text changes go through poke)")

    def op_write(self, session: Session, address: int, data: bytes) -> dict[str, Any]:
        if not 0 < len(data) <= wire.MAX_WRITE:
            raise ProtocolError(f"write: size {len(data)} outside 1..{wire.MAX_WRITE}")
        self._data_block(address, len(data))
        self.device.write(address, data)
        return {}

    def op_alloc_code(self, session: Session, size: int) -> dict[str, Any]:
        if size <= 0:
            raise ProtocolError("alloc_code: size must be positive")
        try:
            address = self.code.alloc(size, 16)
        except KsimError:
            if not self.quarantine:
                raise
            self._release_quarantine()
            address = self.code.alloc(size, 16)
        session.code.add(address)
        return {"address": address}

    def _release_quarantine(self) -> None:
        self.device.quiesce()
        for address in self.quarantine:
            self.code.free(address)
        self.quarantine.clear()

    def op_free_code(self, session: Session, address: int) -> dict[str, Any]:
        if address not in session.code:
            raise UnknownHandle(f"free_code: {address:#x} is not a patch block of this client")
        self._free_code(session, address)
        return {}

    def op_alloc_data(self, session: Session, size: int, align: int) -> dict[str, Any]:
        if size <= 0 or align <= 0 or align & (align - 1):
            raise ProtocolError("alloc_data: size must be positive and align a power of two")
        address = self.data.alloc(size, align)
        try:
            self.device.write(address, bytes(size))
        except KsimError:
            self.data.free(address)
            raise
        session.data.add(address)
        return {"address": address}

    def op_free_data(self, session: Session, address: int) -> dict[str, Any]:
        if address not in session.data:
            raise UnknownHandle(f"free_data: {address:#x} is not a data block of this client")
        session.data.discard(address)
        self.data.free(address)
        return {}

    def _in_code(self, address: int, size: int) -> bool:
        """Whether a write touches the patch area; everything else is text to the module
        (core kernel text or a live module's text; the module refuses anything else)."""
        return address < self.code.end and address + size > self.code.start

    def _check_code_write(self, session: Session, address: int, size: int) -> None:
        allocated = self.code.allocated()
        for start in session.code:
            if start <= address and address + size <= start + allocated[start]:
                return
        raise OutsideText(f"poke at {address:#x}+{size}: inside the patch area but not "
                          "inside a patch block of this client")

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
        cls = hazards.HAZARDS[min(every, key=list(hazards.HAZARDS).index)][0] \
            if every & set(hazards.HAZARDS) else Blacklisted
        return cls(f"{what} refused: the kernel relies on this text staying as it is: "
                   f"{found or '(the hazard is gone: retry)'}; nothing was written")

    def op_poke(self, session: Session, writes: list[Any]) -> dict[str, Any]:
        parsed: list[tuple[int, bytes, bytes]] = []
        for item in writes:
            if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], int)
                    or not all(isinstance(x, str) for x in item[1:])):
                raise ProtocolError("poke: each write is [address, old hex, new hex]")
            address = item[0]
            old = wire.bytes_arg("poke", "old", item[1])
            new = wire.bytes_arg("poke", "new", item[2])
            if len(old) != len(new) or not old:
                raise ProtocolError(f"poke at {address:#x}: old and new differ in length or are empty")
            if self._in_code(address, len(new)):
                self._check_code_write(session, address, len(new))
            parsed.append((address, old, new))
        if not parsed:
            raise ProtocolError("poke: no writes")
        try:
            self.device.poke(parsed)
        except Blacklisted:
            raise self._refusal("poke", parsed) from None
        for address, old, new in parsed:
            if not self._in_code(address, len(new)):
                session.log_write(address, old, new)
        return {}

    def op_hazards(self, session: Session, ranges: list[Any]) -> dict[str, Any]:
        if len(ranges) > wire.MAX_RANGES:
            raise ProtocolError(f"hazards: {len(ranges)} ranges exceed the limit of {wire.MAX_RANGES}")
        parsed: list[tuple[int, int]] = []
        for item in ranges:
            if (not isinstance(item, list) or len(item) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                raise ProtocolError("hazards: each range is [address, length] (two integers)")
            address, length = item
            if not 0 < length <= wire.MAX_RANGE:
                raise ProtocolError(f"hazards: range at {address:#x}: length {length} "
                                    f"outside 1..{wire.MAX_RANGE}")
            if not 0 <= address <= (1 << 64) - length:
                raise ProtocolError(f"hazards: address {address} is not a 64-bit address")
            parsed.append((address, length))
        flags = self.device.hazards(parsed) if parsed else []
        return {"hazards": [abi.hazard_names(f) for f in flags]}

    def op_set_trap(self, session: Session, site: int, patch: int) -> dict[str, Any]:
        try:
            self.device.set_trap(site, patch)
        except Blacklisted:
            raise self._refusal("set_trap", [(site, b"", b"?")]) from None
        session.traps.add(site)
        return {}

    def op_clear_trap(self, session: Session, site: int) -> dict[str, Any]:
        if site not in session.traps:
            raise UnknownHandle(f"clear_trap: no trap of this client at {site:#x}")
        self.device.clear_trap(site)
        session.traps.discard(site)
        return {}

    def op_keep(self, session: Session, keep: bool) -> dict[str, Any]:
        session.keep = keep
        return {}

    TRACEFS = "/sys/kernel/tracing/"
    KPROBES_OPTIMIZATION = "/proc/sys/debug/kprobes-optimization"

    def op_tracefs(self, session: Session, file: str, mode: str, data: str) -> dict[str, Any]:
        """The kprobe oracle's file accesses, made without a shell (a shell's own
        syscalls would be counted by the probe it sets up)."""
        path = os.path.normpath(file)
        if not (path.startswith(self.TRACEFS) or path == self.KPROBES_OPTIMIZATION):
            raise AuthError(f"tracefs: {file!r} is neither under {self.TRACEFS} "
                            f"nor {self.KPROBES_OPTIMIZATION}")
        if mode not in ("r", "w", "a"):
            raise ProtocolError(f"tracefs: mode {mode!r} is not r, w or a")
        try:
            if mode == "r":
                with open(path) as f:
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

    async def op_exec(self, session: Session, cmd: str, timeout: float) -> dict[str, Any]:
        if not self.allow_exec:
            raise AuthError("exec is disabled (kerninstd was not started with --allow-exec)")
        start = time.monotonic()
        proc = await asyncio.create_subprocess_shell(
            cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise TargetTimeout(f"exec: {cmd!r} still running after {timeout:g} s; killed") from None
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


async def serve(daemon: Daemon, host: str, port: int) -> None:
    server = await asyncio.start_server(daemon.serve_client, host, port)
    log.info("listening on %s:%d (abi %d, text %#x-%#x, exec %s)", host, port,
             daemon.info["version"], daemon.text[0], daemon.text[1],
             "allowed" if daemon.allow_exec else "disabled")
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
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="kerninstd: %(levelname)s %(message)s", stream=sys.stderr)
    try:
        token = read_token(args.token_file)
        device = Device(args.device)
    except (KsimError, OSError) as exc:
        print(f"kerninstd: refusing to start: {exc}", file=sys.stderr)
        return 2
    daemon = Daemon(device, token, allow_exec=args.allow_exec)
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
