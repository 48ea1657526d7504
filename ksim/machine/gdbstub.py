"""A small GDB remote-serial-protocol client (the subset QEMU's gdbstub speaks).

Packets are ``$payload#cs`` where ``cs`` is the modulo-256 sum of the payload
bytes in two hex digits; the receiver answers ``+`` (good) or ``-`` (resend)
until both sides agree on ``QStartNoAckMode``.  In payloads the bytes ``$ # } *``
are escaped as ``}`` followed by the byte xor 0x20, and a stub may
run-length-encode a reply as ``X*n`` (repeat X ``ord(n) - 29`` more times).
(GDB manual, "Remote Protocol": "Overview", "Packets", "Stop Reply Packets".)

Memory access goes through the stub's view of the guest: QEMU translates the
address with the guest's *current* page tables (``cpu_memory_rw_debug``), so a
kernel's virtual addresses work once it has enabled paging; before that, while
paging is off, addresses are physical.

Errors: a reply that does not come in time raises TargetTimeout; a closed or
reset connection raises TargetDied; an ``Exx`` reply to a memory access raises
TargetFault.
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from ksim.errors import ProtocolError, TargetDied, TargetFault, TargetTimeout

#: signals a stop reply carries (POSIX numbering, as gdb uses on the wire)
SIGINT, SIGTRAP = 2, 5

_ESCAPE = frozenset(b"$#}*")
_DEFAULT_PACKET_SIZE = 4096


@dataclass(frozen=True, slots=True)
class StopReply:
    """A decoded stop reply: ``T05thread:01;`` / ``S05`` / ``W00`` / ``X09``."""

    kind: str  # "T"/"S": stopped by a signal; "W": exited; "X": killed by a signal
    signal: int | None = None
    exit_code: int | None = None
    info: dict[str, str] = field(default_factory=dict)
    raw: str = ""

    @property
    def exited(self) -> bool:
        return self.kind in ("W", "X")

    @classmethod
    def parse(cls, payload: bytes) -> StopReply:
        text = payload.decode("ascii", "replace")
        if not text or text[0] not in "TSWX":
            raise ProtocolError(f"not a stop reply: {text!r}")
        kind, num = text[0], int(text[1:3], 16)
        if kind == "W":
            return cls("W", exit_code=num, raw=text)
        if kind == "X":
            return cls("X", signal=num, raw=text)
        info = {}
        for part in text[3:].split(";"):
            key, sep, value = part.partition(":")
            if sep:
                info[key] = value
        return cls(kind, signal=num, info=info, raw=text)


def checksum(payload: bytes) -> int:
    return sum(payload) & 0xFF


def escape(data: bytes) -> bytes:
    out = bytearray()
    for b in data:
        if b in _ESCAPE:
            out += bytes((0x7D, b ^ 0x20))
        else:
            out.append(b)
    return bytes(out)


def frame(payload: bytes) -> bytes:
    """``$payload#cs`` (the payload must already be escaped)."""
    return b"$" + payload + b"#" + b"%02x" % checksum(payload)


def decode_payload(raw: bytes) -> bytes:
    """Undo escaping and run-length encoding of a received payload."""
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b == 0x7D:  # '}' escapes the next byte
            i += 1
            out.append(raw[i] ^ 0x20)
        elif b == 0x2A:  # '*' repeats the previous byte ord(n) - 29 times
            i += 1
            out += out[-1:] * (raw[i] - 29)
        else:
            out.append(b)
        i += 1
    return bytes(out)


class GdbStub:
    """One connection to a gdbstub.  Not thread-safe: one caller at a time."""

    def __init__(self, host: str, port: int, *, timeout: float = 10.0,
                 connect_timeout: float = 10.0, alive: object = None,
                 xml_arch: str, registers: tuple[tuple[str, int], ...], pc: str) -> None:
        """Connect (retrying until ``connect_timeout``: the stub may still be
        starting) and negotiate features.  ``alive`` is an optional callable
        returning False once the process behind the stub is gone, so that a
        dead emulator is reported at once instead of after the timeout.

        ``xml_arch`` is the qSupported ``xmlRegisters`` hint, ``registers`` the
        'g' packet's layout when the stub serves no target.xml, ``pc`` the
        program counter's name (the architecture's: ``Arch.gdb``, ``Arch.pc_reg``)."""
        self.host, self.port, self.timeout = host, port, timeout
        self.pc, self._xml_arch, self._fallback_regs = pc, xml_arch, registers
        self._alive = alive
        self._buf = bytearray()
        self._ack = True
        self._running = False
        #: breakpoints set through this client: address -> hardware?
        self.breakpoints: dict[int, bool] = {}
        self.packet_size = _DEFAULT_PACKET_SIZE
        self.features: dict[str, str] = {}
        self.sock = self._connect(connect_timeout)
        try:
            self._negotiate()
            self.regs = self._register_layout()
        except BaseException:
            self.sock.close()
            raise

    # --- transport ----------------------------------------------------------
    def _connect(self, connect_timeout: float) -> socket.socket:
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=1.0)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if self._alive is not None and not self._alive():  # type: ignore[operator]
                    raise TargetDied(f"gdbstub {self.host}:{self.port}: the emulator exited") from e
                if time.monotonic() > deadline:
                    raise TargetTimeout(
                        f"gdbstub {self.host}:{self.port}: no connection within "
                        f"{connect_timeout:.0f} s ({e})") from e
                time.sleep(0.05)

    def _recv_some(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TargetTimeout(f"gdbstub {self.host}:{self.port}: no reply in time")
        # wake up at least every half second to notice a dead emulator early
        self.sock.settimeout(min(left, 0.5))
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            if self._alive is not None and not self._alive():  # type: ignore[operator]
                raise TargetDied(f"gdbstub {self.host}:{self.port}: the emulator exited") from None
            return
        except OSError as e:
            self._running = False
            raise TargetDied(f"gdbstub {self.host}:{self.port}: connection lost ({e})") from e
        if not chunk:
            self._running = False
            raise TargetDied(f"gdbstub {self.host}:{self.port}: connection closed by the stub")
        self._buf += chunk

    def _send_raw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise TargetDied(f"gdbstub {self.host}:{self.port}: connection lost ({e})") from e

    def _read_packet(self, deadline: float) -> bytes:
        """The next ``$...#cs`` packet's decoded payload (acks and noise skipped)."""
        while True:
            start = self._buf.find(b"$")
            if start >= 0:
                end = self._buf.find(b"#", start)
                if end >= 0 and len(self._buf) >= end + 3:
                    raw = bytes(self._buf[start + 1:end])
                    cs = self._buf[end + 1:end + 3]
                    del self._buf[:end + 3]
                    try:
                        good = int(cs, 16) == checksum(raw)
                    except ValueError:
                        good = False
                    if self._ack:
                        self._send_raw(b"+" if good else b"-")
                    if good:
                        return decode_payload(raw)
                    continue
            elif self._buf:
                # only acks ('+'/'-') or stray bytes before the next packet
                self._buf.clear()
            self._recv_some(deadline)

    def _send_packet(self, payload: bytes, deadline: float) -> None:
        packet = frame(payload)
        for _ in range(5):
            self._send_raw(packet)
            if not self._ack:
                return
            # wait for the ack; a '$' means a packet arrived first (left in the buffer)
            while True:
                for i, b in enumerate(self._buf):
                    if b in b"+-":
                        del self._buf[:i + 1]
                        if b == 0x2B:
                            return
                        break
                    if b == 0x24:
                        break
                else:
                    self._recv_some(deadline)
                    continue
                break
        raise ProtocolError(f"gdbstub {self.host}:{self.port}: packet refused 5 times")

    def command(self, payload: str | bytes, timeout: float | None = None) -> bytes:
        """Send one packet and return the reply's payload."""
        if self._running:
            raise ProtocolError("the guest is running: stop it before sending commands")
        data = payload.encode() if isinstance(payload, str) else payload
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._send_packet(escape(data), deadline)
        return self._read_packet(deadline)

    def _ok(self, payload: str | bytes, what: str) -> None:
        reply = self.command(payload)
        if reply != b"OK":
            raise ProtocolError(f"gdbstub: {what} refused: {reply.decode(errors='replace')!r}")

    # --- setup --------------------------------------------------------------
    def _negotiate(self) -> None:
        reply = self.command(f"qSupported:multiprocess-;swbreak+;hwbreak+;xmlRegisters={self._xml_arch}")
        for item in reply.decode().split(";"):
            if "=" in item:
                key, value = item.split("=", 1)
                self.features[key] = value
            elif item:
                self.features[item[:-1]] = item[-1]
        if "PacketSize" in self.features:
            self.packet_size = int(self.features["PacketSize"], 16)
        if self.features.get("QStartNoAckMode") == "+":
            # the reply to this packet is still acknowledged; later ones are not
            if self.command("QStartNoAckMode") == b"OK":
                self._ack = False

    def _xfer(self, annex: str) -> str:
        data, offset = b"", 0
        while True:
            reply = self.command(f"qXfer:features:read:{annex}:{offset:x},{self.packet_size - 16:x}")
            if not reply or reply[:1] not in b"ml":
                raise ProtocolError(f"gdbstub: cannot read {annex}: {reply!r}")
            data += reply[1:]
            offset += len(reply) - 1
            if reply[:1] == b"l":
                return data.decode()

    def _register_layout(self) -> dict[str, tuple[int, int, int]]:
        """name -> (regnum, offset in the 'g' packet, size), from target.xml when offered."""
        regs: list[tuple[str, int]] = []
        if self.features.get("qXfer:features:read") == "+":
            try:
                regs = self._xml_regs("target.xml")
            except (ProtocolError, ET.ParseError):
                regs = []
        out: dict[str, tuple[int, int, int]] = {}
        offset = 0
        for num, (name, size) in enumerate(regs or self._fallback_regs):
            out[name] = (num, offset, size)
            offset += size
        return out

    def _xml_regs(self, annex: str) -> list[tuple[str, int]]:
        text = re.sub(r"<!DOCTYPE[^>]*>", "", self._xfer(annex))
        root = ET.fromstring(text)
        regs: list[tuple[str, int]] = []
        for el in root.iter():
            tag = el.tag.rsplit("}", 1)[-1]
            if tag == "include":
                regs += self._xml_regs(el.attrib["href"])
            elif tag == "reg":
                regs.append((el.attrib["name"], int(el.attrib["bitsize"]) // 8))
        return regs

    # --- queries ------------------------------------------------------------
    def halt_reason(self) -> StopReply:
        return StopReply.parse(self.command("?"))

    def read_registers(self) -> dict[str, int]:
        """The general registers (those the 'g' packet carries), little-endian."""
        blob = bytes.fromhex(self.command("g").decode())
        return {name: int.from_bytes(blob[off:off + size], "little")
                for name, (_, off, size) in self.regs.items() if off + size <= len(blob)}

    def read_register(self, name: str) -> int:
        num, _, size = self.regs[name]
        reply = self.command(f"p{num:x}")
        if reply.startswith(b"E") or not reply:
            raise ProtocolError(f"gdbstub: cannot read register {name}: {reply!r}")
        return int.from_bytes(bytes.fromhex(reply.decode()), "little")

    def read_pc(self) -> int:
        return self.read_register(self.pc)

    def write_register(self, name: str, value: int) -> None:
        num, _, size = self.regs[name]
        self._ok(f"P{num:x}={value.to_bytes(size, 'little').hex()}", f"writing {name}")

    # --- memory -------------------------------------------------------------
    @property
    def _chunk(self) -> int:
        # hex doubles every byte; leave room for the command and the framing
        return max(16, (self.packet_size - 64) // 2)

    def read_memory(self, address: int, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            n = min(self._chunk, size - len(out))
            a = address + len(out)
            reply = self.command(f"m{a:x},{n:x}")
            if not reply or reply.startswith(b"E"):
                raise TargetFault(f"cannot read {n} bytes at {a:#x} through the gdbstub "
                                  f"({reply.decode(errors='replace') or 'empty reply'})")
            chunk = bytes.fromhex(reply.decode())
            if not chunk:
                raise TargetFault(f"cannot read at {a:#x} through the gdbstub (short read)")
            out += chunk
        return bytes(out)

    def write_memory(self, address: int, data: bytes) -> None:
        for i in range(0, len(data), self._chunk):
            piece = data[i:i + self._chunk]
            a = address + i
            reply = self.command(f"M{a:x},{len(piece):x}:{piece.hex()}")
            if reply != b"OK":
                raise TargetFault(f"cannot write {len(piece)} bytes at {a:#x} through the "
                                  f"gdbstub ({reply.decode(errors='replace') or 'empty reply'})")

    # --- breakpoints --------------------------------------------------------
    def set_breakpoint(self, address: int, *, hardware: bool = False) -> None:
        """Z0 (software) or Z1 (hardware).  QEMU's TCG keeps both outside guest
        memory, so they never show up in bytes read back."""
        self._ok(f"Z{int(hardware)},{address:x},1", f"breakpoint at {address:#x}")
        self.breakpoints[address] = hardware

    def remove_breakpoint(self, address: int, *, hardware: bool = False) -> None:
        self._ok(f"z{int(hardware)},{address:x},1", f"removing breakpoint at {address:#x}")
        self.breakpoints.pop(address, None)

    # --- execution ----------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._running

    def resume(self) -> None:
        """Continue ('c') without waiting; collect the stop with wait()."""
        if self._running:
            return
        self._step_off_breakpoint()
        self._send_packet(b"c", time.monotonic() + self.timeout)
        self._running = True

    def wait(self, timeout: float | None = None) -> StopReply:
        """Wait for the running guest to stop; TargetTimeout if it does not
        (the guest keeps running: call interrupt() to stop it)."""
        if not self._running:
            raise ProtocolError("the guest is not running")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        reply = StopReply.parse(self._read_packet(deadline))
        self._running = False
        return reply

    def poll(self) -> StopReply | None:
        """A stop reply if one has arrived, else None (does not block)."""
        try:
            return self.wait(timeout=0.001)
        except TargetTimeout:
            return None

    def cont(self, timeout: float | None = None) -> StopReply:
        self.resume()
        return self.wait(timeout)

    def step(self) -> StopReply:
        if self._running:
            raise ProtocolError("the guest is running: stop it before stepping")
        address = self._pc_if_breakpoint()
        if address is None:
            return StopReply.parse(self.command("s"))
        hardware = self.breakpoints.pop(address)
        self._ok(f"z{int(hardware)},{address:x},1", "lifting a breakpoint to step")
        try:
            return StopReply.parse(self.command("s"))
        finally:
            self.set_breakpoint(address, hardware=hardware)

    def _pc_if_breakpoint(self) -> int | None:
        if not self.breakpoints:
            return None
        pc = self.read_pc()
        return pc if pc in self.breakpoints else None

    #: bound on the steps taken to leave a breakpoint's address (a rep-prefixed
    #: instruction stays there for one step per iteration; "jmp ." forever)
    MAX_STEP_OFF = 100_000

    def _step_off_breakpoint(self) -> None:
        """Leave the breakpoint the guest is stopped at, without hitting it again.

        QEMU reports a breakpoint again at once when continued from its own
        address, so (as gdb does) lift it, step, put it back.  A step can also
        return without executing anything (QEMU's main loop kicked the vCPU),
        and a rep-prefixed instruction keeps the PC for each iteration: step
        until the PC moves, or a counted breakpoint would count one hit twice."""
        address = self._pc_if_breakpoint()
        if address is None:
            return
        hardware = self.breakpoints.pop(address)
        self._ok(f"z{int(hardware)},{address:x},1", "lifting a breakpoint to step")
        try:
            for _ in range(self.MAX_STEP_OFF):
                reply = StopReply.parse(self.command("s"))
                if reply.exited or self.read_pc() != address:
                    break
        finally:
            self.set_breakpoint(address, hardware=hardware)

    def interrupt(self, timeout: float | None = None) -> StopReply:
        """Stop a running guest (the out-of-band ^C byte) and return its stop reply."""
        if not self._running:
            return self.halt_reason()
        self._send_raw(b"\x03")
        return self.wait(timeout)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
