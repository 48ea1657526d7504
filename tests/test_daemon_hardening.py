"""kerninstd against careless and hostile peers: frame limits, deadlines, connection
caps and request validation, with the daemon's own asyncio server running in this
process.

No kernel is needed: every op these tests make a daemon answer (hello, auth, info,
bye, and every malformed request) is answered without touching the device.  The
daemon gets ``NoDevice``, which holds the layout and the module's log a daemon reads
when it starts and fails on any other use, and each test says which uses it expects
(almost always none).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ksim.errors import KsimError, ProtocolError, TargetTimeout
from ksim.live import abi, daemon
from ksim.live import protocol as wire
from ksim.live.client import Connection
from ksim.live.device import Block, ModuleState, Owner

TOKEN = b"k" * 32
LAYOUT = {
    "version": abi.ABI_VERSION,
    "text_start": 0xFFFFFFFF81000000, "text_end": 0xFFFFFFFF82000000,
    "code_start": 0xFFFFFFFFC0000000, "code_size": 1 << 20,
    "data_start": 0xFFFFFFFFC0200000, "data_size": 1 << 20,
}


class NoDevice:
    """Stands where /dev/kerninst would.  A daemon reads its layout and the module's
    log (``log``, empty unless a test says otherwise); any other call is recorded in
    ``used`` and fails."""

    def __init__(self) -> None:
        self.used: list[str] = []
        self.log = ModuleState((), (), (), ())

    def info(self) -> dict[str, int]:
        return dict(LAYOUT)

    def state(self) -> ModuleState:
        return self.log

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def use(*args: Any, **kwargs: Any) -> Any:
            self.used.append(name)
            raise RuntimeError(f"the device was used: {name}")

        return use


class Running:
    """A Daemon behind its real server (``daemon.start``) on an event loop in a thread;
    the tests talk to it over TCP like any client."""

    def __init__(self, limits: daemon.Limits) -> None:
        self.device = NoDevice()
        self.daemon = daemon.Daemon(self.device, TOKEN, limits=limits)  # type: ignore[arg-type]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kerninstd", daemon=True)
        self.thread.start()
        self.server = self.run(daemon.start(self.daemon, "127.0.0.1", 0))
        self.port = int(self.server.sockets[0].getsockname()[1])

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the daemon's loop: its state is read where it is changed."""
        async def call() -> Any:
            return fn()
        return self.run(call())

    def counts(self) -> tuple[int, int]:
        """(connections, unauthenticated connections) the daemon holds."""
        return self.on_loop(lambda: (len(self.daemon.sessions), len(self.daemon.unauthenticated)))

    def wait_for(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.on_loop(what):
            if time.monotonic() > deadline:
                raise AssertionError("the daemon did not get there in time")
            time.sleep(0.01)

    def connect(self, **kwargs: Any) -> Connection:
        return Connection("127.0.0.1", self.port, token=TOKEN, timeout=5.0, **kwargs)

    def raw(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5.0)

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            await self.server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def make(**limits: Any) -> Running:
        running = Running(daemon.Limits(**limits))
        started.append(running)
        return running

    yield make
    for running in started:
        running.close()


def send(s: socket.socket, message: dict[str, Any]) -> None:
    s.sendall(wire.encode(message))


def reply(s: socket.socket) -> dict[str, Any]:
    header = s.recv(4, socket.MSG_WAITALL)
    assert len(header) == 4, "the daemon closed the connection without a reply"
    body = s.recv(wire.frame_length(header), socket.MSG_WAITALL)
    return wire.decode(body)


def closed(s: socket.socket) -> bool:
    """Whether the daemon has closed (or reset) the connection, everything it sent read."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def hello(s: socket.socket, request_id: int = 1) -> dict[str, Any]:
    send(s, {"v": 1, "id": request_id, "op": "hello"})
    return reply(s)


# -- before authentication ------------------------------------------------------------
def test_a_big_frame_before_auth_is_refused_without_reading_it(serve) -> None:
    d = serve()
    with d.raw() as s:
        start = time.monotonic()
        s.sendall(struct.pack(">I", wire.MAX_FRAME))   # 8 MiB announced, none of it sent
        r = reply(s)
        assert r["error"]["code"] == "protocol"
        assert f"bad frame length {wire.MAX_FRAME} (limit {wire.MAX_AUTH_FRAME})" in r["error"]["message"]
        assert closed(s)
        assert time.monotonic() - start < 1.0
    d.wait_for(lambda: not d.daemon.sessions)
    assert d.device.used == []


def test_the_small_frame_limit_holds_until_auth_and_no_longer(serve) -> None:
    d = serve()
    frame = {"v": 1, "id": 1, "op": "hello", "pad": ""}
    frame["pad"] = "x" * (wire.MAX_AUTH_FRAME - len(json.dumps(frame, separators=(",", ":"))))
    with d.raw() as s:                        # exactly the limit: answered
        send(s, frame)
        assert reply(s)["ok"]
        send(s, {**frame, "pad": frame["pad"] + "x"})   # one byte more: refused, closed
        assert "limit 1024" in reply(s)["error"]["message"] and closed(s)
    with d.connect() as c:                    # authenticated: frames up to MAX_FRAME
        assert c.request("info", pad="x" * (1 << 20))["text_start"] == LAYOUT["text_start"]
    assert d.device.used == []


def test_idle_work_runs_while_a_reply_is_awaited(serve) -> None:
    """Connection's idle work: what is given when connecting is done while the
    greeting is answered (connected, not yet authenticated); work given later is done
    at the next wait for a reply, all of it, in order -- work that asks the daemon
    itself included, its own wait doing the rest -- and work that fails is dropped,
    the session going on.  Work left at close is dropped."""
    d = serve()
    done: list[Any] = []

    def first() -> None:
        d.wait_for(lambda: len(d.daemon.unauthenticated) == 1)
        done.append(d.counts())

    def fails() -> None:
        done.append("fails")
        raise RuntimeError("the work went wrong")

    def asks() -> None:
        done.append("asks")
        done.append(conn.request("info")["text_start"])

    with d.connect(idle=(first,)) as conn:
        assert done == [(1, 1)]                   # one connection, not authenticated yet
        assert d.counts() == (1, 0)
        for work in (fails, asks, lambda: done.append("third")):
            conn.when_idle(work)
        assert conn.request("info")["ok"]
        assert done == [(1, 1), "fails", "asks", "third", LAYOUT["text_start"]]
        assert conn.request("info")["ok"] and len(done) == 5
        conn.when_idle(lambda: done.append("never"))
    assert "never" not in done
    d.wait_for(lambda: not d.daemon.sessions)
    assert d.device.used == []


def test_idle_and_slow_peers_are_closed_at_the_auth_timeout(serve) -> None:
    d = serve(auth_timeout=0.5)
    start = time.monotonic()
    idle, slow, greeted = d.raw(), d.raw(), d.raw()
    assert "nonce" in hello(greeted)          # a hello is not an auth: the deadline stands
    # One byte every 50 ms: the frame would take 1.6 s; the daemon hangs up at 0.5 s.
    for byte in wire.encode({"v": 1, "id": 1, "op": "hello"}):
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            break
        if select.select([slow], [], [], 0.05)[0]:
            break
    for s in (idle, greeted):
        r = reply(s)
        assert r["error"]["code"] == "auth" and "within 0.5 s" in r["error"]["message"]
    for s in (idle, slow, greeted):
        try:
            while s.recv(4096):               # the slow one's last frame, if it got there
                pass
        except ConnectionResetError:
            pass
        s.close()
    elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 1.5, elapsed
    d.wait_for(lambda: not d.daemon.sessions)
    # The deadline is for authenticating: a session that did so may stay idle.
    with d.connect() as c:
        time.sleep(0.7)
        assert c.request("info")["ok"]
    assert d.device.used == []


def test_the_oldest_unauthenticated_connection_makes_room(serve) -> None:
    d = serve(max_unauthenticated=2)
    a, b = d.raw(), d.raw()
    hello(a), hello(b)
    with d.raw() as c:
        hello(c)
        r = reply(a)                          # a, the oldest, is told and closed
        assert r["error"]["code"] == "auth" and "too many unauthenticated" in r["error"]["message"]
        assert closed(a)
        assert hello(b, 2)["ok"]              # b is still served
        with d.connect() as legit:            # and so is a client with the token: b goes
            assert legit.request("info")["ok"]
        assert reply(b)["error"]["code"] == "auth" and closed(b)
    a.close(), b.close()
    assert d.daemon.evicted == 2


def test_when_every_slot_is_authenticated_a_newcomer_is_refused_promptly(serve) -> None:
    d = serve(max_connections=3)
    sessions = [d.connect() for _ in range(3)]
    with d.raw() as s:
        start = time.monotonic()
        r = reply(s)
        assert r["error"]["code"] == "target" and "at most 3 connections" in r["error"]["message"]
        assert closed(s) and time.monotonic() - start < 1.0
    assert d.daemon.refused == 1
    sessions.pop().close()                    # one leaves ...
    d.wait_for(lambda: len(d.daemon.sessions) == 2)
    with d.connect() as c:                    # ... and a client with the token gets in
        assert c.request("info")["ok"]
    d.wait_for(lambda: len(d.daemon.sessions) == 2)
    # An unauthenticated connection holding the last slot gives it up to a newcomer.
    with d.raw() as idle:
        hello(idle)
        with d.connect() as c:
            assert c.request("info")["ok"]
        assert reply(idle)["error"]["code"] == "auth" and closed(idle)
    for c in sessions:
        c.close()
    assert d.device.used == []


def _enough_descriptors(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def test_a_client_gets_in_while_a_thousand_idle_connections_are_open(serve) -> None:
    _enough_descriptors(4096)
    d = serve()                               # the defaults: 16 unauthenticated, 64 in all
    lim = d.daemon.limits
    fds_before = len(os.listdir("/proc/self/fd"))
    idle = []
    try:
        start = time.monotonic()
        # In batches the daemon's thread keeps up with (it shares this process): beyond
        # the listen backlog the kernel would drop SYNs and the connects would wait 1 s.
        for batch in range(1, 21):
            idle += [d.raw() for _ in range(50)]
            d.wait_for(lambda n=50 * batch: d.daemon.evicted + len(d.daemon.unauthenticated) == n)
        opened = time.monotonic() - start
        # The daemon holds at most its cap of them; the test's own 1,000 sockets stay open.
        assert d.counts()[1] <= lim.max_unauthenticated
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 1000 + lim.max_connections
        start = time.monotonic()
        with d.connect() as c:
            assert c.request("info")["text_start"] == LAYOUT["text_start"]
            got_in = time.monotonic() - start
            assert d.counts()[0] <= lim.max_unauthenticated + 1
    finally:
        for s in idle:
            s.close()
    assert got_in < 1.0, got_in
    print(f"1000 idle connections opened in {opened:.2f} s; a client got in in {got_in * 1e3:.1f} ms")
    assert d.device.used == []


def test_sessions_stay_while_idle_unless_an_idle_timeout_is_asked_for(serve) -> None:
    assert daemon.Limits().idle_timeout is None
    d = serve(idle_timeout=0.3)
    with d.connect() as c:
        start = time.monotonic()
        r = c.recv_reply(timeout=3.0)
        assert r["error"]["code"] == TargetTimeout.code and "idle for 0.3 s" in r["error"]["message"]
        assert closed(c.sock) and 0.25 < time.monotonic() - start < 1.0
    d.wait_for(lambda: not d.daemon.sessions)


def test_connection_limits_fit_the_descriptor_limit(monkeypatch) -> None:
    monkeypatch.setattr(daemon.resource, "getrlimit", lambda _: (200, 200))

    def setrlimit(*_: Any) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(daemon.resource, "setrlimit", setrlimit)
    fit = daemon.fit_fd_limit(daemon.Limits())
    assert daemon.fd_budget(fit) <= 200
    assert fit.max_unauthenticated <= fit.max_connections == 13


def test_options_set_the_limits() -> None:
    with pytest.raises(SystemExit):
        daemon.main(["--token-file", "x", "--max-connections", "0"])
    with pytest.raises(SystemExit):
        daemon.main(["--token-file", "x", "--auth-timeout", "nan"])
    assert daemon.idle_seconds("0") is None and daemon.idle_seconds("30") == 30.0
    assert daemon.Limits(max_connections=4, max_unauthenticated=16).max_unauthenticated == 4


# -- after authentication: malformed requests ----------------------------------------
U64 = 1 << 64
def _rows(*rows: tuple[int, int]) -> str:
    """(address, length) rows packed as read_ranges and digests take them, as hex."""
    return b"".join(struct.pack("<QQ", a, n) for a, n in rows).hex()


MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("u64 overflow", {"op": "read", "address": U64, "size": 8},
     r"read: argument 'address' must be int in 0\.\.2\*\*64-1, got int 18446744073709551616"),
    ("negative address", {"op": "read", "address": -1, "size": 8},
     r"read: argument 'address' must be int in 0\.\.2\*\*64-1, got int -1"),
    ("bool where int", {"op": "read", "address": 0, "size": True},
     r"read: argument 'size' must be int in 1\.\.1048576, got bool true"),
    ("str where int", {"op": "set_trap", "site": "0x10", "patch": 0},
     r"set_trap: argument 'site' must be int .*got str '0x10'"),
    ("float where int", {"op": "free_data", "address": 1.5}, r"free_data: argument 'address' must be int"),
    ("size over the read limit", {"op": "read", "address": 0, "size": (1 << 20) + 1},
     r"read: argument 'size' must be int in 1\.\.1048576"),
    ("read past 2**64", {"op": "read", "address": U64 - 4, "size": 8},
     r"read: 0xfffffffffffffffc\+8 passes the end of the address space"),
    ("trap site overflow", {"op": "clear_trap", "site": U64 + 1}, r"clear_trap: argument 'site'"),
    ("patch overflow", {"op": "set_trap", "site": 0, "patch": 1 << 70},
     r"set_trap: argument 'patch' must be int .*got int 1180591620717411303424"),
    ("huge integer", {"op": "kallsyms", "offset": 1 << 200},
     r"kallsyms: argument 'offset' must be int .*got int of 201 bits"),
    ("negative offset", {"op": "kallsyms", "offset": -3}, r"kallsyms: argument 'offset'"),
    ("zero size", {"op": "alloc_code", "size": 0}, r"alloc_code: argument 'size' must be int in 1\.\."),
    ("align not a power of two", {"op": "alloc_data", "size": 8, "align": 24},
     r"alloc_data: argument 'align' must be a power of two, got 24"),
    ("align too large", {"op": "alloc_data", "size": 8, "align": 1 << 20},
     r"alloc_data: argument 'align' must be int in 1\.\.4096"),
    ("int where bool", {"op": "keep", "keep": 1}, r"keep: argument 'keep' must be bool \(true or false\), got int 1"),
    ("null where bool", {"op": "keep", "keep": None}, r"keep: argument 'keep' must be bool .*got null"),
    ("NUL in a symbol name", {"op": "lookup", "name": "jiffies\0_64"},
     r"lookup: argument 'name' contains a NUL character \(at index 7\)"),
    ("lone surrogate in a symbol name", {"op": "lookup", "name": "sys_\ud800"},
     r"lookup: argument 'name' contains a lone surrogate \(U\+D800 at index 4\)"),
    ("symbol name too long", {"op": "lookup", "name": "x" * 200},
     r"lookup: argument 'name' has 200 bytes of UTF-8, over the limit of 127"),
    ("empty symbol name", {"op": "lookup", "name": ""}, r"lookup: argument 'name' has 0 bytes"),
    ("NUL in a tracefs path", {"op": "tracefs", "file": "/sys/kernel/tracing/kprobe_events\0x"},
     r"tracefs: argument 'file' contains a NUL"),
    ("lone surrogate in tracefs data", {"op": "tracefs", "file": "/sys/kernel/tracing/x",
                                        "mode": "w", "data": "\udfff"},
     r"tracefs: argument 'data' contains a lone surrogate \(U\+DFFF"),
    ("bad tracefs mode", {"op": "tracefs", "file": "/sys/kernel/tracing/x", "mode": "x"},
     r"tracefs: argument 'mode' must be r, w or a"),
    ("NUL in a command", {"op": "exec", "cmd": "true\0rm -rf /"}, r"exec: argument 'cmd' contains a NUL"),
    ("NaN timeout", {"op": "exec", "cmd": "true", "timeout": float("nan")},
     r"exec: argument 'timeout' must be a finite number in 0\.001\.\.604800, got number nan"),
    ("infinite timeout", {"op": "exec", "cmd": "true", "timeout": float("inf")},
     r"exec: argument 'timeout' must be a finite number"),
    ("bool timeout", {"op": "exec", "cmd": "true", "timeout": True},
     r"exec: argument 'timeout' must be a finite number .*got bool true"),
    ("too many writes", {"op": "poke", "writes": [[LAYOUT["text_start"], "90", "cc"]] * (wire.MAX_WRITES + 1)},
     rf"poke: argument 'writes' has {wire.MAX_WRITES + 1} items, over the limit of {wire.MAX_WRITES}"),
    ("no writes", {"op": "poke", "writes": []}, r"poke: argument 'writes' has 0 items, fewer than 1"),
    ("write address overflow", {"op": "poke", "writes": [[U64, "90", "cc"]]},
     r"poke: argument 'writes\[0\]\.address' must be int"),
    ("write past 2**64", {"op": "poke", "writes": [[U64 - 1, "9090", "cccc"]]},
     r"poke: argument 'writes\[0\]': 0xffffffffffffffff\+2 passes the end"),
    ("write of two lengths", {"op": "poke", "writes": [[LAYOUT["text_start"], "90", "cccc"]]},
     r"poke: argument 'writes\[0\]': old is 1 bytes and new 2"),
    ("write not hex", {"op": "poke", "writes": [[LAYOUT["text_start"], "zz", "cc"]]},
     r"poke: argument 'writes\[0\]\.old' is not hex"),
    ("write too long", {"op": "poke", "writes": [[LAYOUT["code_start"], "00" * 4097, "cc" * 4097]]},
     r"poke: argument 'writes\[0\]\.old' has 4097 bytes, over the limit of 4096"),
    ("write not a triple", {"op": "poke", "writes": [[LAYOUT["text_start"], "90"]]},
     r"poke: argument 'writes\[0\]' must be a list \[address, old, new\], got list of 2 items"),
    ("writes not a list", {"op": "poke", "writes": {"0": "90"}},
     r"poke: argument 'writes' must be list, got object"),
    ("too many ranges", {"op": "hazards", "ranges": [[LAYOUT["text_start"], 1]] * (wire.MAX_RANGES + 1)},
     rf"hazards: argument 'ranges' has {wire.MAX_RANGES + 1} items, over the limit of {wire.MAX_RANGES}"),
    ("range length a bool", {"op": "hazards", "ranges": [[LAYOUT["text_start"], True]]},
     r"hazards: argument 'ranges\[0\]\.length' must be int in 1\.\.16, got bool true"),
    ("range past 2**64", {"op": "hazards", "ranges": [[U64 - 2, 5]]},
     r"hazards: argument 'ranges\[0\]': 0xfffffffffffffffe\+5 passes the end"),
    # row tables (read_ranges, digests): bounds checked for the whole table, the row
    # at fault named; a row only a loose bound suspects is not one (test below)
    ("row past 2**64", {"op": "digests", "ranges": _rows((0x1000, 4), (U64 - 2, 5))},
     r"digests: argument 'ranges\[1\]': 0xfffffffffffffffe\+5 is not 1\.\."),
    ("row of no bytes", {"op": "read_ranges", "ranges": _rows((0x1000, 4), (0x2000, 0))},
     r"read_ranges: argument 'ranges\[1\]': 0x2000\+0 is not 1\.\."),
    ("row over a read", {"op": "digests", "ranges": _rows((0x1000, wire.MAX_READ + 1))},
     rf"digests: argument 'ranges\[0\]': 0x1000\+{wire.MAX_READ + 1} is not 1\.\."),
    ("rows over a read in all", {"op": "read_ranges", "ranges": _rows(*[(0x1000, wire.MAX_READ)] * 2)},
     rf"read_ranges: the ranges hold more than {wire.MAX_READ} bytes in all"),
    ("part of a row", {"op": "digests", "ranges": _rows((0x1000, 4), (0x2000, 4))[:-2]},
     r"digests: argument 'ranges' is 31 bytes, not a whole number of 16-byte rows"),
    ("empty data", {"op": "write", "address": LAYOUT["data_start"], "data": ""},
     r"write: argument 'data' has 0 bytes, fewer than 1"),
    ("missing argument", {"op": "read", "address": 0}, r"read: missing argument 'size'"),
    ("negative file offset", {"op": "read_file", "path": "/etc/hostname", "size": 8, "offset": -1},
     rf"read_file: argument 'offset' must be int in 0\.\.{wire.MAX_FILE_OFFSET}, got int -1"),
    ("file offset past off_t", {"op": "read_file", "path": "/etc/hostname", "size": 8,
                                "offset": wire.MAX_FILE_OFFSET + 1},
     rf"read_file: argument 'offset' must be int in 0\.\.{wire.MAX_FILE_OFFSET}, got int "
     rf"{wire.MAX_FILE_OFFSET + 1}"),
    ("file offset a str", {"op": "read_file", "path": "/etc/hostname", "size": 8, "offset": "0x10"},
     r"read_file: argument 'offset' must be int .*got str '0x10'"),
    ("file read over the limit", {"op": "read_file", "path": "/etc/hostname",
                                  "size": wire.MAX_FILE_READ + 1, "offset": 0},
     rf"read_file: argument 'size' must be int in 1\.\.{wire.MAX_FILE_READ}, got int "
     rf"{wire.MAX_FILE_READ + 1}"),
    ("unknown op", {"op": "\ud800" * 1000}, r"unknown op str '\\ud800.*\.\.\.$"),
    ("version true", {"op": "info", "v": True}, r"protocol version bool true, expected 1"),
]


def _request(c: Connection, fields: dict[str, Any]) -> dict[str, Any]:
    request_id = next(c._ids)
    c.send_raw(wire.encode({"v": 1, "id": request_id, **fields}))
    r = c.recv_reply()
    assert r["id"] == request_id
    return r


@pytest.mark.parametrize("fields, message", [(f, m) for _, f, m in MALFORMED],
                         ids=[name for name, _, _ in MALFORMED])
def test_each_malformed_field_has_its_own_error_and_the_session_goes_on(
        serve, fields: dict[str, Any], message: str) -> None:
    d = serve()
    with d.connect() as c:
        r = _request(c, fields)
        assert not r["ok"] and r["error"]["code"] == "protocol"
        assert re.search(message, r["error"]["message"]), r["error"]["message"]
        assert c.request("info")["ok"]
    assert d.device.used == []


def test_rows_a_loose_bound_suspects_are_read(serve) -> None:
    """A table whose highest start and longest row would pass 2**64 together, though
    no row does, is not refused: the device is asked (NoDevice fails the request)."""
    d = serve()
    with d.connect() as c:
        r = _request(c, {"op": "digests", "ranges": _rows((0x1000, 4096), (U64 - 8, 8))})
        assert not r["ok"] and "device was used: read_rows" in r["error"]["message"]
    assert d.device.used == ["read_rows"]


@pytest.mark.parametrize("body, message", [
    (b'{"v":1,"id":' + b"9" * 5000 + b',"op":"info"}', "not JSON"),
    (b'{"v":1,"id":1,"op":"info","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not JSON"),
    (b'{"v":1,"id":1,"op":"info","x":"\xff"}', "not JSON"),
    (b'[1,2]', "not a JSON object"),
    (json.dumps({"v": 1, "id": 1 << 64, "op": "info"}).encode(), "without an integer id"),
    (json.dumps({"v": 1, "id": -1, "op": "info"}).encode(), "without an integer id"),
])
def test_frames_that_are_not_requests_are_answered_and_the_session_goes_on(
        serve, body: bytes, message: str) -> None:
    d = serve()
    with d.connect() as c:
        c.send_raw(struct.pack(">I", len(body)) + body)
        r = c.recv_reply()
        assert r["id"] is None and r["error"]["code"] == "protocol" and message in r["error"]["message"]
        assert c.request("info")["ok"]
    assert d.device.used == []


def test_malformed_requests_leave_the_session_and_its_splices_alone(serve) -> None:
    d = serve()
    with d.connect() as c:
        session = d.on_loop(lambda: next(s for s in d.daemon.sessions if s.authenticated))

        def holds_splices() -> None:          # as if it had spliced, then sent keep
            session.owner, session.keep_name = 7, "mine"

        d.on_loop(holds_splices)
        for _, fields, _ in MALFORMED:
            assert _request(c, fields)["error"]["code"] == "protocol"
        assert c.request("info")["ok"]
        assert d.on_loop(lambda: (session.owner, session.keep_name)) == (7, "mine")
        assert d.on_loop(lambda: session in d.daemon.sessions)
        c.request("bye")
    d.wait_for(lambda: not d.daemon.sessions)
    assert d.device.used == []                # kept: nothing undone, nothing touched


def test_an_unexpected_failure_in_an_op_is_an_error_reply(serve, caplog) -> None:
    d = serve()
    with d.connect() as c:
        with pytest.raises(KsimError, match="lookup: kerninstd failed: RuntimeError: "
                                            "the device was used: lookup") as info:
            c.request("lookup", name="jiffies")
        assert not isinstance(info.value, ProtocolError)
        assert c.request("info")["ok"]        # the session goes on
    assert d.device.used == ["lookup"]
    assert any(r.name == "kerninstd" and r.exc_info and "lookup failed unexpectedly" in r.getMessage()
               for r in caplog.records)


def test_a_session_that_ends_is_dropped_and_its_blocks_follow_the_module(serve) -> None:
    """A session's cleanup is one drop of its owner in the module.  Here the drop
    fails (this device fails every use) and the module's log still holds the
    session's block: the daemon's allocator keeps it, so it is never handed out."""
    d = serve()
    with d.connect() as c:
        session = d.on_loop(lambda: next(s for s in d.daemon.sessions if s.authenticated))

        def own_a_block() -> int:
            session.owner = 7
            address = d.daemon.data.alloc(64)
            d.device.log = ModuleState(
                owners=(Owner(7, frozenset({"kept", "orphan"}), "orphan-7"),), splices=(),
                routes=(), blocks=(Block(7, "data", address, 64),))
            return address

        address = d.on_loop(own_a_block)
        c.request("bye")
    d.wait_for(lambda: not d.daemon.sessions)
    assert d.device.used == ["owner_drop"]
    assert d.on_loop(lambda: d.daemon.data.allocated()) == {address: 64}
    # Once the module's log no longer has it, neither has the allocator.
    d.device.log = ModuleState((), (), (), ())
    with d.connect() as c:
        session = d.on_loop(lambda: next(s for s in d.daemon.sessions if s.authenticated))
        d.on_loop(lambda: setattr(session, "owner", 8))
        c.request("bye")
    d.wait_for(lambda: not d.daemon.sessions)
    assert d.on_loop(lambda: d.daemon.data.allocated()) == {}


def test_read_file_reads_from_an_offset_and_refuses_what_it_did(serve, tmp_path) -> None:
    """read_file's offset: the bytes from there (fewer at the file's end, none past
    it), 0 when left out; the refusals are the same from any offset."""
    data = bytes(range(256)) * 1024                 # 256 KiB, past one read's limit
    path = tmp_path / "blob"
    path.write_bytes(data)
    d = serve()
    with d.connect() as c:
        def read(**args: Any) -> bytes:
            reply = c.request("read_file", path=str(path), **args)
            assert reply["offset"] == args.get("offset", 0)     # told back: read from there
            return bytes.fromhex(reply["data"])

        assert read(size=16) == data[:16]
        assert read(size=16, offset=0) == data[:16]
        assert read(size=wire.MAX_FILE_READ, offset=100_000) == data[100_000:100_000 + (64 << 10)]
        assert read(size=100, offset=len(data) - 10) == data[-10:]
        assert read(size=100, offset=len(data)) == b""
        assert read(size=wire.MAX_FILE_READ, offset=wire.MAX_FILE_OFFSET) == b""
        for bad, why in ((str(tmp_path), "is not a regular file"),
                         (str(tmp_path / "none"), "No such file or directory"),
                         (str(tmp_path / ".." / "blob"), "is not an absolute path without '..'")):
            with pytest.raises(wire.TracedFileRefused, match=re.escape(why)):
                c.request("read_file", path=bad, size=8, offset=4096)
    assert d.device.used == []
