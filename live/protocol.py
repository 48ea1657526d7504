"""kerninstd's wire protocol: length-prefixed JSON messages.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON,
one object per frame.  Requests carry ``v`` (the protocol version), ``id`` (an
integer the reply echoes) and ``op`` (a row of ``OPS``) plus the op's arguments;
replies carry ``v``, ``id``, ``ok`` and either the op's results or ``error``:
``{"code": <ksim.errors code>, "message": ...}``.  Byte strings travel as hex.

A session: ``hello`` (the daemon answers with a nonce) -> ``auth`` with
``mac = HMAC-SHA256(token, nonce)`` -> any op.  The token itself never crosses
the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

from ksim.errors import KsimError, ProtocolError, UnknownSymbol, all_error_classes

VERSION = 1
HEADER = struct.Struct(">I")
MAX_FRAME = 8 << 20          # the largest frame either side accepts (a kallsyms page fits)
MAX_READ = 1 << 20           # bytes per read op
MAX_WRITE = 1 << 20          # bytes per write op
KALLSYMS_PAGE = 2 << 20      # characters of /proc/kallsyms per page
MAX_EXEC_OUTPUT = 512 << 10  # characters of exec output kept (each of stdout, stderr): fits a frame even JSON-escaped
MAX_RANGES = 4096            # text ranges per hazards op
MAX_RANGE = 16               # bytes per hazards range (the module's KERNINST_MAX_TEXT_WRITE)


@dataclass(frozen=True, slots=True)
class Op:
    """One message kind: its arguments (name -> type) and whether it needs auth."""

    name: str
    args: dict[str, str]
    auth: bool = True
    doc: str = ""


# Message kinds, as data.  Argument types: int, hex (bytes), str, list, bool, float.
OPS: dict[str, Op] = {op.name: op for op in (
    Op("hello", {}, auth=False, doc="protocol version and an auth nonce"),
    Op("auth", {"mac": "str"}, auth=False, doc="HMAC-SHA256(token, nonce) as hex"),
    Op("info", {}, doc="module info: text range, regions, per-cpu offsets, task layout"),
    Op("kallsyms", {"offset": "int"}, doc="a page of /proc/kallsyms from a character offset"),
    Op("lookup", {"name": "str"}, doc="address of a kernel symbol"),
    Op("read", {"address": "int", "size": "int"}, doc="kernel memory, never faults"),
    Op("write", {"address": "int", "data": "hex"}, doc="data heap only"),
    Op("alloc_code", {"size": "int"}, doc="patch-area block (reachable by rel32 from text)"),
    Op("free_code", {"address": "int"}),
    Op("alloc_data", {"size": "int", "align": "int"}, doc="zeroed data-heap block"),
    Op("free_data", {"address": "int"}),
    Op("poke", {"writes": "list"}, doc="[[address, old hex, new hex], ...] all or nothing"),
    Op("set_trap", {"site": "int", "patch": "int"}),
    Op("clear_trap", {"site": "int"}),
    Op("hazards", {"ranges": "list"},
       doc="[[address, length], ...] -> why the kernel relies on each text range staying as it is"),
    Op("keep", {"keep": "bool"}, doc="leave this client's splices in place when it disconnects"),
    Op("tracefs", {"file": "str", "mode": "str", "data": "str"},
       doc="read (mode r), write (w) or append (a) a tracefs file or kprobes-optimization"),
    Op("exec", {"cmd": "str", "timeout": "float"}, doc="run a shell command (--allow-exec only)"),
    Op("bye", {}, doc="close the session (cleanup as on disconnect)"),
)}

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "hex": (str,), "str": (str,), "list": (list,), "bool": (bool,),
    "float": (int, float),
}
# Arguments an op may leave out, with their defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    "kallsyms": {"offset": 0},
    "alloc_data": {"align": 8},
    "keep": {"keep": True},
    "exec": {"timeout": 60.0},
    "tracefs": {"mode": "r", "data": ""},
}


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length == 0 or length > MAX_FRAME:
        raise ProtocolError(f"bad frame length {length} (limit {MAX_FRAME})")
    return length


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


def check_request(message: dict[str, Any]) -> tuple[Op, dict[str, Any]]:
    """Validate a request against OPS; return the op and its arguments (defaults filled)."""
    if message.get("v") != VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r}, expected {VERSION}")
    if not isinstance(message.get("id"), int):
        raise ProtocolError("request without an integer id")
    name = message.get("op")
    op = OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise ProtocolError(f"unknown op {name!r}")
    args = dict(DEFAULTS.get(op.name, {}))
    for key, kind in op.args.items():
        if key in message:
            value = message[key]
            if not isinstance(value, _TYPES[kind]) or (kind == "int" and isinstance(value, bool)):
                raise ProtocolError(f"{op.name}: argument {key!r} must be {kind}")
            args[key] = bytes_arg(op.name, key, str(value)) if kind == "hex" else value
        elif key not in args:
            raise ProtocolError(f"{op.name}: missing argument {key!r}")
    return op, args


def bytes_arg(op: str, key: str, value: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{op}: argument {key!r} is not hex") from None


def reply_ok(request_id: int, **results: Any) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "ok": True, **results}


def reply_error(request_id: int | None, exc: KsimError) -> dict[str, Any]:
    return {"v": VERSION, "id": request_id, "ok": False,
            "error": {"code": exc.code, "message": str(exc)}}


def make_error(code: str, message: str) -> KsimError:
    """The ksim error for a wire code (KsimError itself for a code this side does not know)."""
    cls = all_error_classes().get(code, KsimError)
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    if isinstance(err, UnknownSymbol):
        err.name, err.suggestions = message, []
    return err


def raise_for(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok"):
        return reply
    error = reply.get("error") or {}
    raise make_error(str(error.get("code", "ksim")), str(error.get("message", "request failed")))


def mac(token: bytes, nonce: str) -> str:
    return hmac.new(token, bytes.fromhex(nonce), hashlib.sha256).hexdigest()
