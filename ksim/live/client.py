"""The live target: a Linux kernel behind kerninstd, as a ksim ``Target``.

    from ksim.targets import open_target
    t = open_target("live://127.0.0.1:7070")          # token: the testbed's by default
    t.read(addr, 16); t.apply(Change(text=(Write(addr, old, new),)))
    t.run(while_cmd="./workload")
    t.text_hazards([(addr, 5)])   # [frozenset({"ftrace"})]: the kernel's own answer

``apply`` sends a whole Change -- patch code, trap routes, text writes -- as one
request, which the module makes as one batch, all or nothing.

``Connection`` is the wire client (hello, HMAC auth, request/reply); ``LiveTarget``
adds the Target contract on top of it; ``KprobeCounter`` is the oracle: the
kernel's own kprobe on the same function, through tracefs.
"""

from __future__ import annotations

import array
import bisect
import copy
import hashlib
import itertools
import os
import select
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ksim.arch import load_decoder
from ksim.btf.errors import BTFError
from ksim.core import (
    HeldInterrupt,
    KernelABI,
    MemRef,
    Write,
    check_callback,
    check_seconds,
    check_text,
)
from ksim.errors import (
    HandlerUnsupported,
    KeptNameTaken,
    KsimError,
    OutOfRange,
    ProtocolError,
    TargetDied,
    TargetError,
    TargetTimeout,
    TextOwned,
    TokenFileError,
)
from ksim.live import abi
from ksim.live import protocol as wire
from ksim.splice.patch import Change
from ksim.targets.base import Capabilities, RunResult, run_options

if TYPE_CHECKING:
    from ksim.arch.base import Arch
    from ksim.image.image import Image

REL32 = 1 << 31
#: bytes of kernel text the image reads at a time (and keeps): analysing a function
#: reads a few hundred bytes, and neighbours are analysed next
TEXT_CHUNK = 256 << 10
#: ranges read ahead less than this many bytes apart are read as one (a request's
#: rows each cost the daemon a module call)
PREFETCH_GAP = 1024
PAGE = 4096
#: the largest module text read in one go (a module's symbols far apart -- its init
#: text freed, its text in two allocations -- would span unmapped memory)
MODULE_SPAN = 1 << 20


def default_token_file() -> str:
    from ksim.live.testbed import token_path

    return str(token_path())


#: a token file longer than this is not one (``--token-file /dev/zero`` must not
#: read forever)
MAX_TOKEN_BYTES = 4096


def read_token(path: str | None) -> bytes:
    """The shared secret in the file ``path`` (None: the testbed's), or
    TokenFileError saying why that file cannot be one."""
    where = path or default_token_file()
    try:
        with Path(where).open("rb") as f:  # (this module defines its own open)
            token = f.read(MAX_TOKEN_BYTES + 1).strip()
    except FileNotFoundError:
        raise TokenFileError(f"token file {where}: no such file (give --token-file PATH; "
                             "'ksim testbed up' makes the testbed's)") from None
    except IsADirectoryError:
        raise TokenFileError(f"token file {where} is a directory, not a file") from None
    except OSError as exc:
        raise TokenFileError(f"token file {where}: {exc.strerror or exc}") from None
    if not token:
        raise TokenFileError(f"token file {where} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenFileError(f"token file {where} holds more than {MAX_TOKEN_BYTES} bytes: "
                             "not a token")
    return token


class Connection:
    """One authenticated session with kerninstd."""

    def __init__(self, host: str, port: int, *, token_file: str | None = None,
                 token: bytes | None = None, timeout: float = 30.0,
                 idle: Iterable[Callable[[], object]] = ()) -> None:
        """Connect and authenticate.  ``idle``: work for when_idle, done while the
        daemon answers the greeting (in an emulated guest, some 10 ms)."""
        self.host, self.port, self.timeout = host, port, timeout
        self._ids = itertools.count(1)
        # requests sent whose replies are not read yet, oldest first (kerninstd answers
        # a connection's requests one by one, in order), and replies read early
        self._outstanding: deque[int] = deque()
        self._early: dict[int, dict[str, Any]] = {}
        self._idle: deque[Callable[[], object]] = deque(idle)
        if token is None:  # before connecting: a token file that is no token sends nothing
            token = read_token(token_file)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TargetDied(f"cannot reach kerninstd at {host}:{port}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = self.request("hello")
            if hello.get("protocol") != wire.VERSION:
                raise ProtocolError(f"kerninstd speaks protocol {hello.get('protocol')}, "
                                    f"this client {wire.VERSION}")
            self.server = hello
            self.request("auth", mac=wire.mac(token, hello["nonce"]))
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._idle.clear()
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        try:
            if not self._outstanding or self.sock.fileno() < 0:
                self.sock.sendall(data)     # (a closed socket: OSError, as any send)
                return
            # requests are waiting for replies: the daemon may be blocked writing one
            # this client has not read, and so not reading this request; replies are
            # read (kept for their collect) whenever they come while this one is sent
            view = memoryview(data)
            while view:
                readable, writable, _ = select.select([self.sock], [self.sock], [],
                                                      self.timeout)
                if not readable and not writable:
                    raise TargetTimeout(f"kerninstd at {self.host}:{self.port} takes no request")
                if readable and self._outstanding:
                    self._read_early()
                if writable:
                    view = view[self.sock.send(view):]
        except OSError as exc:  # reset, broken pipe: the daemon or the guest went away
            raise TargetDied(f"kerninstd at {self.host}:{self.port}: {exc.strerror or exc}") from None

    def recv_reply(self, timeout: float | None = None) -> dict[str, Any]:
        self.sock.settimeout(timeout or self.timeout)
        try:
            header = self._recv_exact(wire.HEADER.size)
            return wire.decode(self._recv_exact(wire.frame_length(header)))
        except TimeoutError:
            raise TargetTimeout(f"kerninstd at {self.host}:{self.port} did not answer") from None

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except TimeoutError:
                raise
            except OSError as exc:
                raise TargetDied(f"kerninstd at {self.host}:{self.port}: "
                                 f"{exc.strerror or exc}") from None
            if not chunk:
                raise TargetDied(f"kerninstd at {self.host}:{self.port} closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def request(self, op: str, reply_timeout: float | None = None, **args: Any) -> dict[str, Any]:
        return self.collect(self.send(op, **args), reply_timeout)

    def send(self, op: str, **args: Any) -> int:
        """Send a request without waiting for its reply (collect() gives it): the
        daemon works on it while the client goes on.  Its id."""
        request_id = next(self._ids)
        self.send_raw(wire.encode({"v": wire.VERSION, "id": request_id, "op": op, **args}))
        self._outstanding.append(request_id)
        return request_id

    def collect(self, request_id: int, reply_timeout: float | None = None) -> dict[str, Any]:
        """The reply to the request ``request_id`` sent; the replies to the requests
        sent before it are read first and kept for their own collect()."""
        while request_id not in self._early:
            if not self._outstanding:
                raise ProtocolError(f"no request {request_id} is waiting for its reply")
            if self._idle:
                self._do_idle()     # (it may ask and collect: the loop looks again)
                continue
            self._read_early(reply_timeout)
        return wire.raise_for(self._early.pop(request_id))

    def when_idle(self, work: Callable[[], object]) -> None:
        """Do ``work`` the next time this client waits for a reply, before reading it
        (the work given, in order; none once the connection closes): preparation
        the client needs later -- loading the decoder, the analysis store -- done
        while the daemon works, not after it answers.  Work that fails is dropped:
        it is done again where it is needed, and fails there with its own error."""
        self._idle.append(work)

    def _do_idle(self) -> None:
        work = self._idle.popleft()
        try:
            work()
        except Exception:   # noqa: BLE001 -- preparation only (when_idle)
            pass

    def _read_early(self, reply_timeout: float | None = None) -> None:
        """Read the reply to the oldest request waiting, and keep it for its collect."""
        reply = self.recv_reply(reply_timeout)
        if reply.get("id") is None:  # the daemon's word on the connection (evicted, timed out)
            wire.raise_for(reply)
        expected = self._outstanding.popleft()
        if reply.get("id") != expected:
            raise ProtocolError(f"reply id {reply.get('id')} to request {expected}")
        self._early[expected] = reply


def request_keep(conn: Connection, keep: bool, name: str | None) -> str | None:
    """LiveTarget.keep over ``conn``: the name kept under (None: no longer kept)."""
    try:
        reply = conn.request("keep", keep=keep, name=name or "")
    except TextOwned as exc:
        # the module's one refusal of OWNER_KEEP as text-owned: EEXIST, the name is
        # another kept owner's (kmod/kerninst.c, ksim/live/abi.py)
        if type(exc) is not TextOwned or not keep:
            raise
        raise KeptNameTaken(
            f"a splice is already kept under the name {name or 'kept-OWNER'!r} ({exc}): "
            "choose another name, or adopt or remove that one (ksim kept)") from None
    return None if reply.get("name") is None else str(reply["name"])


def parse_address(rest: str) -> tuple[str, int]:
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise TargetError(f"live target {rest!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class KprobeCounter:
    """The kernel's own kprobe counting hits of one function (tracefs kprobe_profile).

    Placed at the address asked for.  At a function's ftrace location (its
    5-byte entry nop) the kprobe is ftrace-based (KPROBES_ON_FTRACE): ftrace
    rewrites only that nop, which ksim never writes (the module refuses, the
    planner's entry point is the instruction after it), so the two never share
    a byte.  (arm64: a function's first instruction is the ``mov x9, x30`` of its
    two-instruction ftrace location, where the kprobe is a BRK of its own, and the
    planner's entry point is after both.)  Probe optimisation is switched off
    while it exists so that an int3 probe elsewhere stays one and never
    jump-patches bytes near a splice (kernel/kprobes.c optimizes after a delay;
    /proc/sys/debug/kprobes-optimization; a kernel without OPTPROBES has none).
    """

    name = "kprobe"
    TRACEFS = "/sys/kernel/tracing"
    OPTIMIZATION = "/proc/sys/debug/kprobes-optimization"

    def __init__(self, target: LiveTarget, address: int) -> None:
        self.target = target
        self.event = f"ksim_oracle_{os.getpid()}_{address & 0xffffffff:x}"
        symbol, offset = target.symbolize(address)
        self.probe = f"{symbol}+{offset}"
        try:
            self._saved_opt: str | None = target.tracefs(self.OPTIMIZATION).strip() or "1"
        except TargetError:
            self._saved_opt = None  # a kernel without optimized kprobes (arm64) has no such file
        if self._saved_opt is not None:
            target.tracefs(self.OPTIMIZATION, "w", "0")
        target.tracefs(f"{self.TRACEFS}/kprobe_events", "a", f"p:{self.event} {self.probe}\n")
        target.tracefs(f"{self.TRACEFS}/events/kprobes/{self.event}/enable", "w", "1")
        self._closed = False

    @property
    def count(self) -> int:
        for line in self.target.tracefs(f"{self.TRACEFS}/kprobe_profile").splitlines():
            parts = line.split()
            if parts and parts[0] == self.event:
                return int(parts[1])
        raise TargetError(f"kprobe {self.event} missing from kprobe_profile")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t = self.TRACEFS
        self.target.tracefs(f"{t}/events/kprobes/{self.event}/enable", "w", "0")
        self.target.tracefs(f"{t}/kprobe_events", "a", f"-:{self.event}\n")
        if self._saved_opt is not None:
            self.target.tracefs(self.OPTIMIZATION, "w", self._saved_opt)

    def __enter__(self) -> KprobeCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: seconds between two calls of a run's progress callback (trace drains its events)
PROGRESS_PERIOD = 0.2


def _table(rows: Sequence[tuple[int, int]]) -> str:
    """(address, length) rows packed as the module takes them (two little-endian
    u64 each), in hex for the wire."""
    return struct.pack(f"<{2 * len(rows)}Q", *(x for r in rows for x in r)).hex()


def _row_parts(rows: list[tuple[int, int]], most: int) -> Iterator[list[tuple[int, int]]]:
    """(address, length) ``rows`` cut into as few requests' tables as the protocol
    allows: MAX_RANGES rows and ``most`` bytes each (a row over ``most`` on its own).
    Cut by bisection over the rows' running total: a batch's digests are thousands
    of rows."""
    ends = list(itertools.accumulate(n for _a, n in rows))
    i, before = 0, 0
    while i < len(rows):
        j = min(bisect.bisect_right(ends, before + most, i), i + wire.MAX_RANGES)
        j = max(j, i + 1)
        yield rows[i:j]
        i, before = j, ends[j - 1]


#: the guest kallsyms files a cache directory keeps (each with its parsed copy, some 8 MB
#: together): one per kernel identity, and every module loaded or unloaded makes another
KALLSYMS_KEPT = 16


def prune_kallsyms(keep: Path, most: int = KALLSYMS_KEPT) -> list[Path]:
    """Remove the cached kallsyms files beside ``keep``, with their parsed copies, that
    were used least recently (their modification times: a target that uses one touches
    it), so that ``most`` are left, ``keep`` among them.  The files removed."""
    from ksim.image.kallsyms import kept_path

    def used(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    others = sorted((p for p in keep.parent.glob("kallsyms-*.txt") if p != keep), key=used,
                    reverse=True)
    removed = []
    for old in others[max(0, most - 1):]:
        try:
            old.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            continue        # not ours to remove
        try:
            kept_path(old).unlink(missing_ok=True)
        except OSError:
            pass
        removed.append(old)
    return removed


class LiveTarget:
    """ksim's Target protocol over a kerninstd connection."""

    def __init__(self, host: str, port: int, *, token_file: str | None = None,
                 timeout: float = 60.0) -> None:
        self.name = f"live://{host}:{port}"
        self._original: dict[int, int] = {}  # text byte -> its value before our first poke
        self._original_at: list[int] = []     # its addresses, sorted (a read finds its own)
        self._text_chunks: dict[int, bytes] = {}  # the image's reads of kernel text
        self._module_pages: dict[int, bytes] = {}  # ... and of other text, by page
        # ... and the exact ranges a batch read ahead (prefetch_text): starts, bytes
        self._ahead_at: list[int] = []
        self._ahead: list[bytes] = []
        # ... and the digests of ranges a batch checks but need not read (prefetch_digests)
        self._digests: dict[tuple[int, int], int] = {}
        # ... asked for, their replies not read yet: (request id, its rows), and the rows
        self._digest_requests: list[tuple[int, list[tuple[int, int]]]] = []
        self._digests_due: set[tuple[int, int]] = set()
        # ... and the text reads sent, their replies not read yet: (request id, its
        # rows), in the order sent; and every row of them, by address, as (start,
        # end, the request's place in _text_due + _text_done)
        self._text_due: list[tuple[int, list[tuple[int, int]]]] = []
        self._text_done = 0
        self._due_rows: list[tuple[int, int, int]] = []
        self._due_starts: list[int] = []
        self._blocks: dict[int, int] = {}    # this client's patch areas: address -> size
        self._block_starts: list[int] = []   # the same addresses, sorted
        self._data_blocks: dict[int, int] = {}  # ... and its data areas
        self._data_starts: list[int] = []
        # writes into those data areas sent, their replies not read yet (see write)
        self._posted: list[int] = []
        # every use of a kernel decodes its instructions: the decoder is loaded (some
        # 20 ms) while the daemon answers the greeting
        self.conn = Connection(host, port, token_file=token_file, timeout=timeout,
                               idle=(load_decoder,))
        self._token_file, self._timeout = token_file, timeout
        from ksim.images.abi import (
            CLOCK_NS,
            NOFAULT_READERS,
            USER_NOFAULT_READERS,
            linux_clock_ns,
            linux_read_nofault,
            linux_read_user_nofault,
        )

        # the kernel functions snippets call, looked up in the round trip that asks
        # for the daemon's info, not one each (their older names only if a kernel
        # lacks these)
        asked = self.conn.send("info")
        lookup = self._looked_up((NOFAULT_READERS[0], USER_NOFAULT_READERS[0], CLOCK_NS))
        reply = self.conn.collect(asked)
        self.info = {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}
        # the architecture's code readers and writers are loaded while the lookups
        # are answered
        self.conn.when_idle(lambda: self.arch.prepare())
        i = self.info
        self.capabilities = Capabilities(
            traps=True, hazards=True, exec=bool(i.get("allow_exec")), keep=True,
            oracles=(KprobeCounter.name,), nr_cpus=max(1, int(i.get("nr_cpus", 1) or 1)),
            max_items=wire.MAX_WRITES, max_bytes=wire.MAX_POKE_TOTAL,
            release=str(i.get("kernel") or ""),
            code_fill=bytes.fromhex(str(i.get("code_fill") or "")))
        self.text = (int(i["text_start"]), int(i["text_end"]))
        self.code_region = (int(i["code_start"]), int(i["code_start"]) + int(i["code_size"]))
        self.data_region = (int(i["data_start"]), int(i["data_start"]) + int(i["data_size"]))
        self.abi = KernelABI(
            current_task=MemRef(int(i["current_task"]), "gs", 8),
            task_pid_offset=int(i["task_pid_offset"]),
            task_pid_size=int(i["task_pid_size"]),
            task_tgid_offset=int(i["task_tgid_offset"]),
            task_comm_offset=int(i["task_comm_offset"]),
            cpu_number=MemRef(int(i["cpu_number"]), "gs", 4),
            # snippet loads through computed pointers go through it: they cannot fault
            read_nofault=linux_read_nofault(lookup),
            read_user_nofault=linux_read_user_nofault(lookup),
            clock_ns=linux_clock_ns(lookup),
        )

    def _looked_up(self, names: Sequence[str]) -> Callable[[str], int]:
        """``lookup`` with the addresses of ``names`` asked for at once (the requests
        sent together now, every reply read at the first lookup): a name's error is
        raised when it is looked up, as ``lookup`` raises it; a name not among them
        is asked then."""
        asked = {name: self.conn.send("lookup", name=name) for name in dict.fromkeys(names)}
        found: dict[str, int | KsimError] = {}

        def lookup(name: str) -> int:
            while asked:
                other, request_id = asked.popitem()
                try:
                    found[other] = int(self.conn.collect(request_id)["address"])
                except KsimError as exc:
                    found[other] = exc
            answer = found.get(name)
            if answer is None:
                return self.lookup(name)
            if isinstance(answer, KsimError):
                raise answer
            return answer

        return lookup

    # -- what the engine asks for lazily -------------------------------------------
    @cached_property
    def arch(self) -> Arch:
        """The kernel's architecture: as the daemon's info says, else the one the
        kernel module is built for; its trap is the module's."""
        from ksim.arch import get_arch
        from ksim.live.abi import MACHINE

        arch = get_arch(str(self.info.get("arch", MACHINE)))
        immediate = self.info.get("trap_immediate")
        trap = (arch.trap_with(immediate) if isinstance(immediate, int)
                # a kerninstd that gave the trap's bytes instead
                else bytes.fromhex(str(self.info["trap"])) if self.info.get("trap") else arch.trap)
        if trap != arch.trap:
            # the module's trap, the one its routes wait for (on arm64 a BRK of an
            # immediate of its own, not the kprobes one the toy targets take)
            arch = copy.copy(arch)
            arch.trap = trap
        return arch

    @cached_property
    def kallsyms_path(self) -> Path:
        """The guest's /proc/kallsyms, cached per kernel release and text base."""
        from ksim.live.testbed import cache_dir

        # Loading or unloading a module changes the file: the daemon's digest of
        # /proc/modules is part of the name.
        modules = str(self.info.get("modules") or "")
        path = cache_dir() / "-".join(
            x for x in ("kallsyms", str(self.info["kernel"]), f"{self.text[0]:x}", modules) if x)
        path = path.with_name(path.name + ".txt")
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            with tmp.open("w") as f:
                offset: int | None = 0
                while offset is not None:
                    page = self.conn.request("kallsyms", offset=offset)
                    f.write(page["text"])
                    offset = page["next"]
            tmp.rename(path)
            prune_kallsyms(path)
        else:
            try:
                os.utime(path)      # used now: the last a prune removes
            except OSError:
                pass                # another user's cache, read-only here
        return path

    @cached_property
    def image(self) -> Image:
        from ksim.image import load_kallsyms

        # the kallsyms file's name says which kernel, where its text is and which
        # modules are loaded: what an analysis store of this kernel is found by
        return load_kallsyms(self.kallsyms_path, reader=self._image_read, keep_parsed=True,
                             identity=self.kallsyms_path.stem.encode(), arch=self.arch.name,
                             prefetch=self.prefetch_text, digests=(self.prefetch_digests,
                                                                   self.known_digests))

    def _image_read(self, address: int, size: int) -> bytes:
        """What the image reads: core kernel text as it was before this client's pokes
        (and before other owners' splices, which kerninstd reads back as they were),
        fetched TEXT_CHUNK bytes at a time and kept (analysing every function of the
        kernel is then some 50 reads, not one or two per function); anything else
        read as it is now."""
        lo, hi = self.text
        if size <= 0:
            return self.read(address, size)
        if self._text_due:
            self._await_text(address, size)
        i = bisect.bisect_right(self._ahead_at, address) - 1
        if i >= 0 and address + size <= self._ahead_at[i] + len(self._ahead[i]):
            at = address - self._ahead_at[i]
            return self._as_before(address, bytearray(self._ahead[i][at:at + size]))
        if address + size <= lo or hi <= address:
            return self._module_text(address, size)
        if not (lo <= address and address + size <= hi):  # across an end of core text
            return self.read(address, size, kernel=True)
        out = bytearray()
        at = address
        while at < address + size:
            base = lo + (at - lo) // TEXT_CHUNK * TEXT_CHUNK
            chunk = self._text_chunks.get(base)
            if chunk is None:
                chunk = self.read(base, min(TEXT_CHUNK, hi - base), kernel=True)
                self._text_chunks[base] = chunk
            take = min(address + size, base + len(chunk)) - at
            if take <= 0:
                raise TargetError(f"kernel text at {at:#x}: the read of its chunk came back short")
            out += chunk[at - base:at - base + take]
            at += take
        return self._as_before(address, out)

    def prefetch_text(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Read the text ``ranges`` (address, size) ahead for the image, as its reads
        would (``kernel``: other owners' splices as they were), in as few requests as
        they fit: a batch's functions and what analysing them reads are a few MB
        scattered over the kernel, which chunk by chunk would be tens of MB.  Ranges
        less than PREFETCH_GAP bytes apart are read as one.  Kept like the image's
        other reads.  The requests are sent, and each reply read when the image
        first reads a byte it holds."""
        spans: list[list[int]] = []
        for a, n in sorted((int(a), int(n)) for a, n in ranges if n > 0):
            if spans and a <= spans[-1][1] + PREFETCH_GAP:
                spans[-1][1] = max(spans[-1][1], a + n)
            else:
                spans.append([a, a + n])
        have = self._ahead_at
        todo = []
        for a, end in spans:
            i = bisect.bisect_right(have, a) - 1
            if i >= 0 and end <= have[i] + len(self._ahead[i]):
                continue    # read ahead already
            k = bisect.bisect_right(self._due_starts, a) - 1
            if k >= 0 and end <= self._due_rows[k][1]:
                continue    # asked for already, the reply not read yet
            while end - a > wire.MAX_READ:
                todo.append((a, wire.MAX_READ))
                a += wire.MAX_READ
            todo.append((a, end - a))
        # sent now, and read when the image first reads a byte of them (_await_text):
        # the daemon reads while the client goes on
        rows = self._due_rows
        for part in _row_parts(todo, wire.MAX_READ):
            request_id = self.conn.send("read_ranges", ranges=_table(part), kernel=True)
            seq = self._text_done + len(self._text_due)
            self._text_due.append((request_id, part))
            rows += [(a, a + n, seq) for a, n in part]
        if todo:
            rows.sort()
            self._due_starts = [a for a, _, _ in rows]

    def _await_text(self, address: int, size: int) -> None:
        """The replies to the text reads sent (prefetch_text) up to the one that
        holds a byte of ``size`` bytes at ``address`` (the row that starts last at
        or before its end: rows of different reads seldom overlap)."""
        k = bisect.bisect_right(self._due_starts, address + size - 1) - 1
        if k < 0 or self._due_rows[k][1] <= address:
            return
        last = self._due_rows[k][2] - self._text_done
        sent, self._text_due = self._text_due[:last + 1], self._text_due[last + 1:]
        self._text_done += last + 1
        self._due_rows = [r for r in self._due_rows if r[2] >= self._text_done]
        self._due_starts = [a for a, _, _ in self._due_rows]
        got: list[tuple[int, bytes]] = []
        replies, error = self._replies(sent)
        for part, reply in replies:
            data = bytes.fromhex(reply["data"])
            failed = set(reply.get("failed", ()))
            total = sum(n for _, n in part)
            if len(data) != total:
                error = error or ProtocolError(f"read_ranges: {len(data)} bytes for {total}")
                continue
            at = 0
            for k, (a, n) in enumerate(part):
                if k not in failed:     # an unreadable range is read as asked, later
                    got.append((a, data[at:at + n]))
                at += n
        if got:
            # kept disjoint: rows of different reads overlap (a batch's functions, then
            # the neighbours its springboards look at), and a read is looked up in the
            # one piece starting last at or before it
            at_: list[int] = []
            parts: list[list[bytes]] = []
            end = 0
            for a, d in sorted([*zip(self._ahead_at, self._ahead, strict=True), *got]):
                if at_ and a <= end:
                    if a + len(d) > end:
                        parts[-1].append(d[end - a:])
                        end = a + len(d)
                    continue
                at_.append(a)
                parts.append([d])
                end = a + len(d)
            self._ahead_at, self._ahead = at_, [b"".join(p) for p in parts]
        if error is not None:
            raise error

    def prefetch_digests(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Learn the 64-bit XXH64 of each text range (address, size) as the image
        would read it, without reading it (kerninstd's ``digests``): whether a
        function is still the bytes its analysis record was made from, for the
        functions a batch's callees reach, is some MB of text that need not cross the
        wire.  Ranges read ahead already, or known, are not asked again.

        The requests are sent, and their replies read when one of their digests is
        first asked for (known_digest) or another request's reply is: the daemon
        digests while the client analyses the batch's own functions."""
        todo = sorted({(int(a), int(n)) for a, n in ranges
                       if 0 < n <= wire.MAX_READ and (a, n) not in self._digests
                       and (a, n) not in self._digests_due})
        for part in _row_parts(todo, wire.MAX_DIGESTED):
            self._digest_requests.append((self.conn.send("digests", ranges=_table(part),
                                                         kernel=True), part))
            self._digests_due.update(part)

    def _collect_digests(self) -> None:
        """The replies to the digests requests sent (prefetch_digests), all of them."""
        sent, self._digest_requests = self._digest_requests, []
        self._digests_due = set()
        replies, error = self._replies(sent)
        for part, reply in replies:
            data = bytes.fromhex(reply["digests"])
            if len(data) != wire.DIGEST * len(part):
                error = error or ProtocolError(f"digests: {len(data)} bytes for {len(part)} rows")
                continue
            sums = array.array("Q", data)   # (DIGEST: 8 bytes, little-endian)
            if sys.byteorder != "little":
                sums.byteswap()
            self._digests.update(zip(part, sums, strict=True))
            for k in reply.get("failed", ()):   # an unreadable range is read as asked, later
                self._digests.pop(part[k], None)
        if error is not None:
            raise error

    def _replies(self, sent: list[tuple[int, list[tuple[int, int]]]]
                 ) -> tuple[list[tuple[list[tuple[int, int]], dict[str, Any]]], KsimError | None]:
        """The replies to the requests ``sent`` ahead (request id, its rows) that came
        back, each with its rows, and the first error of those that did not.  A
        kerninstd without the op is no error: the image reads those rows as asked."""
        out: list[tuple[list[tuple[int, int]], dict[str, Any]]] = []
        error: KsimError | None = None
        for request_id, part in sent:
            try:
                out.append((part, self.conn.collect(request_id)))
            except ProtocolError as exc:
                if "unknown op" not in str(exc):
                    error = error or exc
            except KsimError as exc:
                error = error or exc
        return out, error

    def known_digest(self, address: int, size: int) -> int | None:
        """The digest prefetch_digests learnt of exactly this range, as the image reads
        it; None when it was not asked, or this client has poked a byte of it since
        (the image reads that byte as it was before)."""
        return self.known_digests(((address, size),))[0]

    def known_digests(self, ranges: Sequence[tuple[int, int]]) -> list[int | None]:
        """known_digest of each of ``ranges``, at once (a batch's reach: thousands)."""
        due = self._digests_due
        if self._digest_requests and any(r in due for r in ranges):
            self._collect_digests()
        found = list(map(self._digests.get, ranges))
        if self._original_at:   # this client poked text: those ranges are read instead
            found = [None if d is not None and self._poked_in(*r) else d
                     for r, d in zip(ranges, found, strict=True)]
        return found

    def _poked_in(self, address: int, size: int) -> list[int]:
        """The text bytes in address..+size this client's pokes changed, by bisection
        (not a look at every byte of every read: a batch pokes some bytes of each of
        thousands of functions, and the next batch reads them all)."""
        at = self._original_at
        return at[bisect.bisect_left(at, address):bisect.bisect_left(at, address + size)]

    def _as_before(self, address: int, out: bytearray) -> bytes:
        """``out``, read at ``address``, with the bytes this client's pokes changed
        back to what they were before them."""
        for a in self._poked_in(address, len(out)):
            out[a - address] = self._original[a]
        return bytes(out)

    def _module_text(self, address: int, size: int) -> bytes:
        """A loaded module's text (or anything outside core text) for the image: the
        module's text read whole the first time (_read_module_span), else a page at a
        time, and kept, as core text is read TEXT_CHUNK at a time (analysing each of
        a module's functions read them one by one).  What is not readable a page at a
        time is read as asked."""
        first, last = address & ~(PAGE - 1), (address + size - 1) & ~(PAGE - 1)
        if first not in self._module_pages:
            self._read_module_span(first)
        pages = []
        for page in range(first, last + PAGE, PAGE):
            data = self._module_pages.get(page)
            if data is None:
                try:
                    data = self._module_pages[page] = self.read(page, PAGE, kernel=True)
                except TargetError:
                    return self.read(address, size, kernel=True)
            pages.append(data)
        out = bytearray(b"".join(pages)[address - first:address - first + size])
        return self._as_before(address, out)

    def _read_module_span(self, page: int) -> None:
        """Every page of the loaded module's text that holds ``page``, in one read
        (its text symbols' pages; analysing a module's functions, or checking what its
        callers call, touches most of them): a request per module, not per page.
        A span that cannot be read whole (a hole in it) is left to page reads."""
        spans = self._module_spans
        i = bisect.bisect_right(spans, (page, 1 << 64)) - 1
        if i < 0 or not spans[i][0] <= page < spans[i][1]:
            return
        start, end = spans[i]
        try:
            data = self.read(start, end - start, kernel=True)
        except TargetError:
            return
        for at in range(start, end, PAGE):
            self._module_pages.setdefault(at, data[at - start:at - start + PAGE])

    @cached_property
    def _module_spans(self) -> list[tuple[int, int]]:
        """Each loaded module's text, as the pages its text symbols lie on (at most
        MODULE_SPAN bytes: a larger module is read a page at a time)."""
        by_module: dict[str, list[int]] = {}
        for address, name in self._symbols:
            module, sep, _ = name.partition(":")
            if sep:
                by_module.setdefault(module, []).append(address)
        spans = []
        for addresses in by_module.values():
            lo, hi = min(addresses) & ~(PAGE - 1), (max(addresses) & ~(PAGE - 1)) + PAGE
            if hi - lo <= MODULE_SPAN:
                spans.append((lo, hi))
        return sorted(spans)

    @cached_property
    def _symbols(self) -> list[tuple[int, str]]:
        """Text symbols, by address; a module's as ``MODULE:NAME`` (kprobe_events' syntax)."""
        out = []
        with self.kallsyms_path.open() as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[1] in "tTwW":
                    out.append((int(parts[0], 16), parts[2]))
                elif len(parts) == 4 and parts[1] in "tTwW" and parts[3].startswith("["):
                    out.append((int(parts[0], 16), f"{parts[3].strip('[]')}:{parts[2]}"))
        out.sort()
        return out

    def symbolize(self, address: int) -> tuple[str, int]:
        """(symbol, offset) of a kernel or module text address."""
        import bisect

        syms = self._symbols
        i = bisect.bisect_right(syms, (address, "\x7f")) - 1
        if i < 0:
            raise TargetError(f"{address:#x} is below every kernel text symbol")
        return syms[i][1], address - syms[i][0]

    def _request(self, op: str, **args: Any) -> dict[str, Any]:
        self._settle_writes()
        return self.conn.request(op, **args)

    def _settle_writes(self) -> None:
        """Read the replies to the data writes sent (see write), all of them; the first
        that failed is raised, with its own error."""
        posted, self._posted = self._posted, []
        error: KsimError | None = None
        for request_id in posted:
            try:
                self.conn.collect(request_id)
            except KsimError as exc:
                error = error or exc
        if error is not None:
            raise error

    def original(self, address: int, size: int) -> bytes:
        """Text as it was before this client's pokes changed it."""
        return self._as_before(address, bytearray(self.read(address, size)))

    # -- memory ---------------------------------------------------------------------
    def when_idle(self, work: Callable[[], object]) -> None:
        """Target.when_idle: done while a request's reply has not come
        (Connection.when_idle)."""
        self.conn.when_idle(work)

    def read(self, address: int, size: int, kernel: bool = False) -> bytes:
        """Kernel memory as it is; ``kernel``: text another client (or a kept splice)
        changed read as it was before (what this client analyses: the kernel's own
        code, not another owner's jumps)."""
        out = bytearray()
        while len(out) < size:
            n = min(wire.MAX_READ, size - len(out))
            args: dict[str, Any] = {"kernel": True} if kernel else {}
            out += bytes.fromhex(self._request("read", address=address + len(out), size=n,
                                               **args)["data"])
        return bytes(out)

    def read_many(self, addresses: Sequence[int], size: int = 16) -> dict[int, bytes]:
        """``size`` bytes at each of ``addresses``, read a span (up to MAX_READ) at a
        time: the text of a batch's points in a few requests, not one each."""
        out: dict[int, bytes] = {}
        addresses = sorted(addresses)
        i = 0
        while i < len(addresses):
            j = i
            while j + 1 < len(addresses) and addresses[j + 1] + size - addresses[i] <= wire.MAX_READ:
                j += 1
            data = self.read(addresses[i], addresses[j] + size - addresses[i])
            out.update({a: data[a - addresses[i]:a - addresses[i] + size] for a in addresses[i:j + 1]})
            i = j + 1
        return out

    def write(self, address: int, data: bytes) -> None:
        """Write kernel data.  A write inside one of this client's data areas is sent
        and its reply read with the next request's, or before the next change is
        applied or command run: the daemon answers a connection's requests in order,
        so this client reads the bytes written, and nothing else sees them before a
        splice goes in or a command runs (a map's first bytes wait for no reply
        while the batch is planned).  A failed write raises there, with its own error."""
        posted = self._in_data_area(address, len(data))
        for off in range(0, len(data), wire.MAX_WRITE):
            chunk = data[off:off + wire.MAX_WRITE]
            if posted:
                self._posted.append(self.conn.send("write", address=address + off, data=chunk.hex()))
            else:
                self._request("write", address=address + off, data=chunk.hex())

    def _in_data_area(self, address: int, size: int) -> bool:
        i = bisect.bisect_right(self._data_starts, address) - 1
        if i < 0:
            return False
        start = self._data_starts[i]
        return address + size <= start + self._data_blocks[start]

    def _block_of(self, address: int) -> int | None:
        """The patch block of this client holding ``address``, if any."""
        i = bisect.bisect_right(self._block_starts, address) - 1
        if i >= 0:
            start = self._block_starts[i]
            if address < start + self._blocks[start]:
                return start
        return None

    def apply(self, change: Change) -> None:
        """Make ``change`` as one request, which the module makes as one batch, all or
        nothing: its route changes and writes checked first (old bytes, hazards, who
        holds what), then patch code, routes set, text (the poke protocol), routes
        cleared.  Text the kernel relies on (see text_hazards) is refused with the
        hazard's own UnsafeSite error (FtraceSite, BugSite, ...), naming the hazards.

        A change over one batch's limits (capabilities.max_items, max_bytes) sends its
        patch code ahead in parts -- nothing reaches that code yet -- and the rest as
        the one batch; text and routes over the limits are refused before anything
        is sent."""
        if not change:
            return
        self._settle_writes()   # what the change's code will read is written first
        step = wire.MAX_POKE_BYTES
        code: list[list[Any]] = [
                [w.address + off, w.old[off:off + step].hex(), w.new[off:off + step].hex()]
                for w in self._coalesced(change.code, step) for off in range(0, len(w.new), step)]
        text = [[w.address, w.old.hex(), w.new.hex()] for w in change.text]
        routes = [[site, patch] for site, patch in change.routes]
        text_bytes = sum(len(w.new) for w in change.text)
        if len(text) + len(routes) > wire.MAX_WRITES or text_bytes > wire.MAX_POKE_TOTAL:
            raise TargetError(f"a change of {len(text)} text writes and {len(routes)} route "
                              f"changes is over the module's batch limits ({wire.MAX_WRITES} "
                              f"writes and route changes, {wire.MAX_POKE_TOTAL} bytes): "
                              "nothing was sent")
        # the code that fits beside the text and routes goes with them; the rest ahead
        room_items = wire.MAX_WRITES - len(text) - len(routes)
        room_bytes = wire.MAX_POKE_TOTAL - text_bytes
        ahead: list[list[Any]] = []
        with_text: list[list[Any]] = []
        used = 0
        for item in reversed(code):
            n = len(item[2]) // 2
            if len(with_text) < room_items and used + n <= room_bytes and not ahead:
                with_text.append(item)
                used += n
            else:
                ahead.append(item)
        ahead.reverse()
        with_text.reverse()
        per = max(1, min(wire.MAX_WRITES, wire.MAX_POKE_TOTAL // step))
        for i in range(0, len(ahead), per):
            part = ahead[i:i + per]
            self.conn.request("poke", reply_timeout=self._batch_timeout(len(part)), writes=part)
        writes = with_text + text
        timeout = self._batch_timeout(len(writes) + len(routes))
        if writes:
            self.conn.request("poke", reply_timeout=timeout, writes=writes, routes=routes)
        else:  # routes alone (the poke op takes one write at least)
            self.conn.request("routes", reply_timeout=timeout, routes=routes)
        known = len(self._original)
        for w in change.text:  # kernel or module text, as it was before this client
            for i, b in enumerate(w.old):
                self._original.setdefault(w.address + i, b)
        if len(self._original) != known:
            self._original_at = sorted(self._original)

    def _coalesced(self, writes: Sequence[Write], step: int) -> list[Write]:
        """``writes`` with each run of adjacent writes into one patch area joined, up to
        ``step`` bytes a write: a batch's patches lie end to end in one area, and the
        daemon and the module then handle a few hundred writes instead of one per
        patch."""
        out: list[Write] = []
        last_block = None
        for w in writes:
            block = self._block_of(w.address)
            prev = out[-1] if out else None
            if (block is not None and block == last_block and prev is not None
                    and prev.end == w.address and len(prev.new) + len(w.new) <= step):
                out[-1] = Write(prev.address, prev.old + w.old, prev.new + w.new)
            else:
                out.append(w)
            last_block = block
        return out

    def _batch_timeout(self, items: int) -> float:
        """How long a batch of ``items`` route changes and writes may take: the daemon
        checks and packs each one (in an emulated guest, tens of microseconds to a
        millisecond), the module pokes each."""
        return self._timeout + 0.01 * items

    def text_hazards(self, ranges: Sequence[tuple[int, int]]) -> list[frozenset[str]]:
        """Why the kernel relies on each (address, length) text range staying as it is,
        asked of the kernel itself: names from ``ksim.live.abi.HAZARDS`` ("ftrace",
        "jump_label", "static_call", "kprobe", "blacklist", "extable", "bug", "warn",
        "not_text", "unknown"); an empty set when the range may be written.
        A length is 1..16 bytes.  Up to MAX_RANGES ranges go in one request: a
        batch's planning asks about all its functions at once (SiteFacts.asking_ahead)."""
        return self.ask_hazards(ranges)()

    def ask_hazards(self, ranges: Sequence[tuple[int, int]]
                    ) -> Callable[[], list[frozenset[str]]]:
        """text_hazards' question sent now; the answers when the returned function is
        called (the daemon answers while the client goes on)."""
        wanted = [(int(a), int(n)) for a, n in ranges]
        ask = list(dict.fromkeys(wanted))
        sent = [(self.conn.send("hazard_table", table=_table(ask[k:k + wire.MAX_RANGES])),
                 ask[k:k + wire.MAX_RANGES]) for k in range(0, len(ask), wire.MAX_RANGES)]
        answered: list[list[frozenset[str]]] = []

        def answers() -> list[frozenset[str]]:
            if answered:
                return answered[0]
            memo: dict[tuple[int, int], frozenset[str]] = {}
            names: dict[int, frozenset[str]] = {0: frozenset()}
            for request_id, chunk in sent:
                reply = self.conn.collect(request_id,
                                          reply_timeout=self._batch_timeout(len(chunk) // 16))
                flags = array.array("I", bytes.fromhex(reply["flags"]))
                if sys.byteorder != "little":
                    flags.byteswap()
                if len(flags) != len(chunk):
                    raise ProtocolError(f"hazard_table: {len(flags)} answers to {len(chunk)} ranges")
                for r, f in zip(chunk, flags, strict=True):
                    found = names.get(f)
                    if found is None:
                        found = names[f] = frozenset(abi.hazard_names(f))
                    memo[r] = found
            answered.append([memo[r] for r in wanted])
            return answered[0]
        return answers

    def alloc_code(self, size: int, near: int | None = None) -> int:
        """A patch area of ``size`` bytes, within a jump's reach of ``near``."""
        return self.alloc_code_ahead(size, near)()

    def alloc_code_ahead(self, size: int, near: int | None = None) -> Callable[[], int]:
        """alloc_code sent now, its reply read when the result is called (the daemon
        answers in order: what the client sends meanwhile is answered after it)."""
        self._settle_writes()
        request_id = self.conn.send("alloc_code", size=size)

        def answer() -> int:
            address = int(self.conn.collect(request_id)["address"])
            bisect.insort(self._block_starts, address)
            self._blocks[address] = size
            if near is not None and not self._reaches(address, size, near):
                self.free_code(address)
                raise OutOfRange(f"patch area {address:#x} is beyond rel32 reach of {near:#x}")
            return address

        return answer

    @staticmethod
    def _reaches(address: int, size: int, near: int) -> bool:
        return -REL32 <= address - near and address + size - near < REL32

    def free_code(self, address: int) -> None:
        self._request("free_code", address=address)
        if self._blocks.pop(address, None) is not None:
            self._block_starts.remove(address)

    def alloc_data(self, size: int, align: int = 8) -> int:
        address = int(self._request("alloc_data", size=size, align=align)["address"])
        bisect.insort(self._data_starts, address)
        self._data_blocks[address] = size
        return address

    def free_data(self, address: int) -> None:
        self._request("free_data", address=address)
        if self._data_blocks.pop(address, None) is not None:
            self._data_starts.remove(address)

    def add_trap_hook(self, site: int, fn: Callable[[Any, int], int | None]
                      ) -> Callable[[], None]:
        raise HandlerUnsupported(f"{self.name} cannot call Python at a trap: "
                                 "use snippet handlers")

    def areas(self) -> list[dict[str, Any]]:
        """The patch area's and the data heap's areas now: region, address, size, free."""
        return list(self._request("info")["areas"])

    def lookup(self, name: str) -> int:
        return int(self._request("lookup", name=name)["address"])

    def tracefs(self, file: str, mode: str = "r", data: str = "") -> str:
        """Read (mode ``r``), write (``w``) or append (``a``) a tracefs file in the
        guest, no shell involved; or make (``mkdir``) or remove (``rmdir``) a ksim
        trace instance, ``/sys/kernel/tracing/instances/ksim-NAME``."""
        return str(self._request("tracefs", file=file, mode=mode, data=data).get("data", ""))

    def read_file(self, path: str, size: int, offset: int = 0) -> bytes:
        """Up to ``size`` bytes (at most protocol.MAX_FILE_READ) from ``offset`` of a
        regular file of the guest, read by kerninstd (ksim trace's cat(), the ELF files
        naming a user stack's frames); fewer at the file's end."""
        args: dict[str, Any] = {"path": path, "size": size}
        if offset:          # left out when 0: a kerninstd without offsets serves it too
            args["offset"] = offset
        reply = self._request("read_file", **args)
        if offset and reply.get("offset") != offset:
            # a kerninstd older than the offset ignores it and reads from 0
            raise wire.TracedFileRefused(f"read_file: {path}: this kerninstd reads a file "
                                         "from its start only (it predates read_file's offset): "
                                         "update it")
        return bytes.fromhex(str(reply["data"]))

    def cgroup_path(self, cgroup_id: int) -> str:
        """The path, under the guest's cgroup2 mount, of the cgroup with that id."""
        return str(self._request("cgroup_path", cgroup=cgroup_id)["path"])

    def btf(self, name: str = "vmlinux") -> bytes:
        """The kernel's BTF: ``/sys/kernel/btf/vmlinux``, or a module's (split BTF on
        top of vmlinux's).  Kept on disk by its sha256 (``ksim.btf.sources.cache_dir``):
        asking again costs one request, which tells the file's digest; the blob
        crosses the wire once per kernel (and per loading of a module)."""
        from ksim.btf.sources import cache_dir

        head = self._request("btf", name=name, offset=0, length=0)
        size, digest = int(head["size"]), str(head["sha256"])
        path = cache_dir() / digest
        try:
            data = path.read_bytes()
        except OSError:
            pass
        else:
            if hashlib.sha256(data).hexdigest() == digest:
                return data
        out = bytearray()
        while len(out) < size:
            reply = self._request("btf", name=name, offset=len(out),
                                  length=min(wire.MAX_BTF_CHUNK, size - len(out)))
            chunk = bytes.fromhex(reply["data"])
            if reply["sha256"] != digest or int(reply["size"]) != size:
                raise BTFError(f"btf: /sys/kernel/btf/{name} changed while it was read "
                               "(a module loaded again?); ask again")
            if not chunk:
                raise ProtocolError(f"btf: an empty chunk at {len(out)} of {size} bytes")
            out += chunk
        data = bytes(out)
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise ProtocolError(f"btf: /sys/kernel/btf/{name} came as {len(data)} bytes that do "
                                f"not hash to the digest kerninstd gave ({size} bytes)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{digest}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a file under its digest's name is always complete
        return data

    def keep(self, keep: bool = True, name: str | None = None) -> str | None:
        """Leave this client's splices in the kernel after it disconnects (and after
        kerninstd restarts), kept under ``name`` (default ``kept-OWNER``); returns the
        name.  ``keep(False)``: undo them at disconnect after all.  KeptNameTaken
        when another kept splice has the name."""
        return request_keep(self.conn, keep, name)

    def kept(self) -> list[dict[str, Any]]:
        """The kept splices in the kernel, each with its ``name``, ``owner``, ``orphan``
        (text it could not undo), ``session`` (the peer still holding it, or None),
        ``writes`` (address, orig and cur hex), ``routes`` and ``blocks``."""
        return list(self._request("kept")["kept"])

    def adopt(self, name: str) -> dict[str, Any]:
        """Take the kept splice ``name`` over: undone when this client disconnects."""
        return dict(self._request("adopt", name=name)["adopted"])

    def remove_kept(self, name: str) -> dict[str, Any]:
        """Undo the kept splice ``name`` now; returns what it held."""
        return dict(self._request("remove_kept", name=name)["removed"])

    # -- running things in the guest ---------------------------------------------------
    def _exec(self, cmd: str, timeout: float) -> dict[str, Any]:
        return self._request("exec", cmd=cmd, timeout=float(timeout), reply_timeout=timeout + 30)

    def _exec_with_progress(self, cmd: str, timeout: float,
                            progress: Callable[[], None]) -> dict[str, Any]:
        outcome: dict[str, Any] = {}
        self._settle_writes()   # the command, on a connection of its own, sees them

        def work() -> None:
            try:
                with Connection(self.conn.host, self.conn.port, token_file=self._token_file,
                                timeout=self._timeout) as side:
                    outcome["reply"] = side.request("exec", cmd=cmd, timeout=float(timeout),
                                                    reply_timeout=timeout + 30)
            except BaseException as exc:  # re-raised in the caller's thread below
                outcome["error"] = exc

        worker = threading.Thread(target=work, name="ksim-live-exec", daemon=True)
        worker.start()
        # Ctrl-C is held while progress() talks over this connection, and raised between
        # two of its calls: never halfway through a request (the reply would be left unread)
        with HeldInterrupt() as held:
            while True:
                worker.join(PROGRESS_PERIOD)
                if not worker.is_alive() or held.pending:
                    break
                progress()
        if "error" in outcome:
            raise outcome["error"]
        return dict(outcome["reply"])

    def exec(self, cmd: str, timeout: float = 120.0) -> str:
        """Run a shell command in the guest; its stdout (any exit status)."""
        return str(self._exec(cmd, timeout)["stdout"])

    def exec_checked(self, cmd: str, timeout: float = 120.0) -> str:
        r = self._exec(cmd, timeout)
        if r["rc"] != 0:
            raise TargetError(f"guest command failed ({r['rc']}): {cmd}\n{r['stderr'].strip()}")
        return str(r["stdout"])

    @run_options
    def run(self, *, while_cmd: str | None = None, timeout: float = 600.0,
            progress: Callable[[], None] | None = None) -> RunResult:
        """Run ``while_cmd`` in the guest (instrumentation stays in while it runs).

        The command runs over a second connection while this one stays free:
        ``progress()`` is called every PROGRESS_PERIOD seconds, and may read counters over
        the network while the guest runs (periodic sampling); Ctrl-C ends the
        wait at once and leaves this connection ready for the clean-up (no reply
        half read).  The daemon kills a command still running after ``timeout``
        seconds: TargetTimeout."""
        check_text("while_cmd", while_cmd)
        check_callback("progress", progress)
        timeout = check_seconds("timeout", timeout)
        if not while_cmd:
            return RunResult()
        r = self._exec_with_progress(while_cmd, timeout, progress or (lambda: None))
        if r["rc"] != 0:
            raise TargetError(f"--while command failed ({r['rc']}): {while_cmd}\n"
                              f"{(r['stderr'] or r['stdout']).strip()[-2000:]}")
        return RunResult(output=r["stdout"], seconds=float(r["seconds"]))

    def oracle_counter(self, address: int) -> KprobeCounter:
        return KprobeCounter(self, address)

    def close(self) -> None:
        try:
            self._posted = []   # their blocks go with the connection
            self.conn.request("bye")
        except (KsimError, OSError):
            pass  # the daemon is gone already: it cleans up on disconnect
        self.conn.close()

    def __enter__(self) -> LiveTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(rest: str, token_file: str | None = None, **options: Any) -> LiveTarget:  # noqa: A001
    """``open_target("live://HOST:PORT")`` lands here."""
    host, port = parse_address(rest)
    timeout = float(options.pop("timeout", 60.0))
    return LiveTarget(host, port, token_file=token_file, timeout=timeout)


if TYPE_CHECKING:
    from ksim.targets.base import Target

    #: mypy checks the class against the target contract
    _CONTRACT: type[Target] = LiveTarget
