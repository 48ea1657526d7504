"""kerninstd's wire protocol: length-prefixed JSON messages.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON,
one object per frame.  Requests carry ``v`` (the protocol version), ``id`` (an
integer the reply echoes) and ``op`` (a row of ``OPS``) plus the op's arguments;
replies carry ``v``, ``id``, ``ok`` and either the op's results or ``error``:
``{"code": <ksim.errors code>, "message": ...}``.  Byte strings travel as hex.

A session: ``hello`` (the daemon answers with a nonce) -> ``auth`` with
``mac = HMAC-SHA256(token, nonce)`` -> any op.  The token itself never crosses
the wire.  Until ``auth`` succeeds a frame is at most ``MAX_AUTH_FRAME`` bytes.

Every argument of every op is declared in ``OPS`` with its type and range
(``Arg``); ``check_request`` refuses anything else with a ProtocolError that
names the op and the argument, before the daemon uses any of it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from ksim.errors import KsimError, ProtocolError, TargetError, UnknownSymbol, all_error_classes
from ksim.live.abi import LIMITS

VERSION = 1
HEADER = struct.Struct(">I")
# The largest frame either side accepts: a kallsyms page fits, and so does a poke batch
# of every function's patch code (old and new bytes as hex, MAX_POKE_BYTES of new bytes).
MAX_FRAME = 80 << 20
# The largest frame before authentication.  hello is ~30 bytes and auth ~110 (a
# 64-digit MAC); 1 KiB leaves room for longer ids or extra fields while an
# unauthenticated peer can make the daemon buffer only this much per frame.
MAX_AUTH_FRAME = 1 << 10
MAX_READ = 1 << 20           # bytes per read op
MAX_DIGESTED = LIMITS["MAX_ROWS_BYTES"]   # bytes a digests op reads (and hashes) in all
DIGEST = LIMITS["DIGEST_SIZE"]           # bytes of a digests row's digest (XXH64)
MAX_WRITE = 1 << 20          # bytes per write op
KALLSYMS_PAGE = 2 << 20      # characters of /proc/kallsyms per page
MAX_EXEC_OUTPUT = 512 << 10  # characters of exec output kept (each of stdout, stderr): fits a frame even JSON-escaped
MAX_RANGES = 1 << 18         # text ranges per hazards op: a batch of thousands of functions in one
MAX_RANGE = LIMITS["MAX_TEXT_WRITE"]   # bytes per hazards range
RANGE_ROW = 16               # bytes of a struct kerninst_range (u64 address, u32 len, u32 hazards)
MAX_WRITES = LIMITS["MAX_WRITES"]      # writes per poke, and route changes (the module's batch limits)
MAX_POKE_TOTAL = LIMITS["MAX_POKE_BYTES"]  # new bytes per poke, its writes together
MAX_POKE_BYTES = LIMITS["MAX_CODE_WRITE"]  # bytes per poke write (text writes are 16 at most)
MAX_NAME = LIMITS["NAME_LEN"] - 1      # UTF-8 bytes of a symbol name (the module adds a NUL)
MAX_KEEP_NAME = 64           # characters of a kept splice's name
MAX_PATH = 4095              # UTF-8 bytes of a tracefs path (PATH_MAX less its NUL)
MAX_CMD = (128 << 10) - 1    # UTF-8 bytes of an exec command: one execve argument (MAX_ARG_STRLEN)
MAX_ALIGN = 4096             # data-heap alignment: the heap itself is only page-aligned
MAX_EXEC_TIMEOUT = 7 * 86400.0   # seconds
# Bytes of a /sys/kernel/btf file per btf op: a Debian vmlinux's 4.3 MB in one reply,
# whose hex (twice the bytes) stays well inside a frame.
MAX_BTF_CHUNK = 8 << 20
MAX_BTF_NAME = 64            # UTF-8 bytes of a BTF name: vmlinux or a module's (MODULE_NAME_LEN is 56)
#: the most bytes of a file read_file returns (ksim trace's cat(), bpftrace's
#: max_cat_bytes is 10 KiB by default)
MAX_FILE_READ = 64 << 10
#: the largest offset read_file starts at: its end (offset + size) stays a file
#: offset (off_t), which pread(2) refuses past
MAX_FILE_OFFSET = (1 << 63) - 1 - MAX_FILE_READ
#: cgroup directories cgroup_path looks through for an id, at most
MAX_CGROUP_DIRS = 100_000
#: tracefs modes: a file's read (r), write (w) or append (a); a ksim instance's mkdir or rmdir
TRACEFS_MODES = ("r", "w", "a", "mkdir", "rmdir")
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Arg:
    """What one argument may be.

    ``kind`` is int, number (int or float), bool, str, hex (bytes as hex digits)
    or list.  For int and number, ``lo``..``hi`` bound the value; for str (in UTF-8
    bytes), hex (in bytes) and list (in items) they bound the length.  A list's
    items are lists of the ``fields`` (name, Arg), in order.
    """

    kind: str
    lo: int | float = 0
    hi: int | float = U64_MAX
    fields: tuple[tuple[str, Arg], ...] = ()


def integer(lo: int = 0, hi: int = U64_MAX) -> Arg:
    return Arg("int", lo, hi)


def text(lo: int = 0, hi: int = MAX_FRAME) -> Arg:
    return Arg("str", lo, hi)


def hexbytes(lo: int = 0, hi: int = MAX_FRAME) -> Arg:
    return Arg("hex", lo, hi)


def items(hi: int, lo: int = 0, **fields: Arg) -> Arg:
    return Arg("list", lo, hi, tuple(fields.items()))


U64 = integer()              # an address or an offset
SIZE = integer(1)            # a size: positive, within u64
BOOL = Arg("bool")


@dataclass(frozen=True, slots=True)
class Op:
    """One message kind: its arguments (name -> what it may be) and whether it needs auth."""

    name: str
    args: dict[str, Arg]
    auth: bool = True
    doc: str = ""


# Message kinds, as data.  Every argument is checked against its Arg before an op runs.
OPS: dict[str, Op] = {op.name: op for op in (
    Op("hello", {}, auth=False, doc="protocol version and an auth nonce"),
    Op("auth", {"mac": hexbytes(32, 32)}, auth=False, doc="HMAC-SHA256(token, nonce) as hex"),
    Op("info", {}, doc="module info: text range, regions, per-cpu offsets, task layout"),
    Op("kallsyms", {"offset": U64}, doc="a page of /proc/kallsyms from a character offset"),
    Op("lookup", {"name": text(1, MAX_NAME)}, doc="address of a kernel symbol"),
    Op("read", {"address": U64, "size": integer(1, MAX_READ), "kernel": BOOL},
       doc="kernel memory, never faults (kernel: text other owners spliced as it was)"),
    Op("read_ranges", {"ranges": hexbytes(RANGE_ROW, MAX_RANGES * RANGE_ROW), "kernel": BOOL},
       doc="op read for many ranges: packed rows (u64 address, u64 length), each 1.."
           "MAX_READ bytes and MAX_READ in all -> their bytes end to end (a batch's "
           "functions in one request, not the chunks around them) and the indexes of "
           "the rows that could not be read (zeros in their place)"),
    Op("digests", {"ranges": hexbytes(RANGE_ROW, MAX_RANGES * RANGE_ROW), "kernel": BOOL},
       doc="what read_ranges would give, as a digest per row: rows as read_ranges', "
           "MAX_DIGESTED bytes in all -> each row's 64-bit XXH64 (8 bytes, little-endian "
           "as the analysis store keeps them), end to end, and the rows that could not "
           "be read (zeros in their place; with kernel, also those another owner's "
           "splice overlaps: their bytes as they were come from read_ranges): whether text is still the bytes a record "
           "was made from, without its bytes crossing the wire"),
    Op("write", {"address": U64, "data": hexbytes(1, MAX_WRITE)}, doc="data heap only"),
    Op("alloc_code", {"size": SIZE}, doc="patch-area block (reachable by rel32 from text)"),
    Op("free_code", {"address": U64},
       doc="refused (already-spliced) while a trap route or a jump in text leads into it"),
    Op("alloc_data", {"size": SIZE, "align": integer(1, MAX_ALIGN)}, doc="zeroed data-heap block"),
    Op("free_data", {"address": U64},
       doc="refused (block-in-use) while this client has live patch code: any trap route "
           "of its, or any jump in text into one of its patch blocks (which may write it)"),
    Op("poke", {"writes": items(MAX_WRITES, lo=1, address=U64, old=hexbytes(1, MAX_POKE_BYTES),
                                new=hexbytes(1, MAX_POKE_BYTES)),
                "routes": items(MAX_WRITES, site=U64, patch=U64)},
       doc="[[site, patch], ...] route changes (patch 0: clear), in order, then "
           "[[address, old hex, new hex], ...] writes: one batch, all or nothing"),
    Op("routes", {"routes": items(MAX_WRITES, lo=1, site=U64, patch=U64)},
       doc="[[site, patch], ...] route changes alone (patch 0: clear), in order, all or nothing"),
    Op("set_trap", {"site": U64, "patch": U64}),
    Op("clear_trap", {"site": U64}),
    Op("hazards", {"ranges": items(MAX_RANGES, address=U64, length=integer(1, MAX_RANGE))},
       doc="[[address, length], ...] -> why the kernel relies on each text range staying as it is"),
    Op("hazard_table", {"table": hexbytes(RANGE_ROW, MAX_RANGES * RANGE_ROW)},
       doc="packed struct kerninst_range rows (address, len, 0) -> flags: each row's "
           "KERNINST_HAZARD_* as a little-endian u32, packed (a whole batch at once)"),
    Op("keep", {"keep": BOOL, "name": text(0, MAX_KEEP_NAME)},
       doc="leave this client's splices in place when it disconnects, kept under a name "
           "(given, or kept-OWNER) that a later client lists, adopts or removes; false: no more"),
    Op("kept", {}, doc="the kept splices: name, text writes, trap routes and blocks of each"),
    Op("adopt", {"name": text(1, MAX_KEEP_NAME)},
       doc="take a kept splice over: it is this client's from now on (undone when it leaves)"),
    Op("remove_kept", {"name": text(1, MAX_KEEP_NAME)},
       doc="undo a kept splice now: its text restored, routes cleared, blocks freed"),
    Op("tracefs", {"file": text(1, MAX_PATH), "mode": text(1, 5), "data": text()},
       doc="read (mode r), write (w) or append (a) a tracefs file or kprobes-optimization; "
           "mkdir or rmdir a ksim trace instance (/sys/kernel/tracing/instances/ksim-NAME)"),
    Op("btf", {"name": text(1, MAX_BTF_NAME), "offset": U64, "length": integer(0, MAX_BTF_CHUNK)},
       doc="a chunk of /sys/kernel/btf/NAME (vmlinux or a module), with the file's size "
           "and sha256 (length 0: size and digest only)"),
    Op("read_file", {"path": text(1, MAX_PATH), "size": integer(1, MAX_FILE_READ),
                     "offset": integer(0, MAX_FILE_OFFSET)},
       doc="up to size bytes from offset (0: the file's first bytes) of a regular file of "
           "the guest, by its absolute path (ksim trace's cat(), and the ELF files whose "
           "symbols name a user stack's frames) -> the bytes, and the offset read from "
           "(which a kerninstd older than the field, ignoring it, does not tell): nothing "
           "else (a directory, a device, a fifo) is opened for reading"),
    Op("cgroup_path", {"cgroup": U64},
       doc="the path under the cgroup2 mount (/sys/fs/cgroup) of the cgroup whose id "
           "(its directory's inode number, the kernel's kernfs node id) is given"),
    Op("exec", {"cmd": text(1, MAX_CMD), "timeout": Arg("number", 1e-3, MAX_EXEC_TIMEOUT)},
       doc="run a shell command (--allow-exec only)"),
    Op("bye", {}, doc="close the session (cleanup as on disconnect)"),
)}

# Arguments an op may leave out, with their defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    "kallsyms": {"offset": 0},
    "read": {"kernel": False},
    "read_ranges": {"kernel": False},
    "digests": {"kernel": False},
    "poke": {"routes": []},
    "alloc_data": {"align": 8},
    "keep": {"keep": True, "name": ""},
    "exec": {"timeout": 60.0},
    "tracefs": {"mode": "r", "data": ""},
    "btf": {"offset": 0, "length": 0},
    "read_file": {"offset": 0},
}

# a chunk of BTF as hex, with its reply's other fields, fits a frame
assert 2 * MAX_BTF_CHUNK + 4096 < MAX_FRAME


class TracedFileRefused(TargetError):
    """read_file or cgroup_path refused: not an absolute path of a regular file, a
    file that cannot be read, no cgroup with that id."""

    code = "traced-file"


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, limit: int = MAX_FRAME) -> int:
    (length,) = HEADER.unpack(header)
    if length == 0 or length > limit:
        raise ProtocolError(f"bad frame length {length} (limit {limit})")
    return length


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError besides JSONDecodeError: an integer literal over Python's digit limit;
        # RecursionError: arrays or objects nested deeper than the parser goes.
        raise ProtocolError(f"frame is not JSON: {clip(str(exc))}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


def request_id(message: dict[str, Any]) -> int | None:
    """The request's id if it is one a reply can echo (an integer in u64 range)."""
    value = message.get("id")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX:
        return value
    return None


def check_envelope(message: dict[str, Any]) -> Op:
    """The version, id and op of a request; its arguments are check_args's."""
    v = message.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v != VERSION:
        raise ProtocolError(f"protocol version {_show(v)}, expected {VERSION}")
    if request_id(message) is None:
        raise ProtocolError(f"request without an integer id in 0..2**64-1 (got {_show(message.get('id'))})")
    name = message.get("op")
    op = OPS.get(name) if isinstance(name, str) else None
    if op is None:
        raise ProtocolError(f"unknown op {_show(name)}")
    return op


def check_args(op: Op, message: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments, each checked against its Arg (defaults filled, hex decoded,
    list items as tuples).  Fields the op does not define are ignored."""
    args = dict(DEFAULTS.get(op.name, {}))
    for key, arg in op.args.items():
        if key in message:
            args[key] = check_value(op.name, key, message[key], arg)
        elif key not in args:
            raise ProtocolError(f"{op.name}: missing argument {key!r}")
    return args


def check_request(message: dict[str, Any]) -> tuple[Op, dict[str, Any]]:
    """Validate a request against OPS; return the op and its arguments (defaults filled)."""
    op = check_envelope(message)
    return op, check_args(op, message)


def check_value(op: str, path: str, value: Any, arg: Arg) -> Any:
    """``value`` as ``arg`` allows it, or a ProtocolError naming the op and the argument."""
    where = f"{op}: argument {path!r}"
    kind = arg.kind
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool) or not arg.lo <= value <= arg.hi:
            raise ProtocolError(f"{where} must be int in {_bounds(arg)}, got {_show(value)}")
        return value
    if kind == "number":
        # an int is compared as it is: one past a float's range never becomes one
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or (isinstance(value, float) and not math.isfinite(value))
                or not arg.lo <= value <= arg.hi):
            raise ProtocolError(f"{where} must be a finite number in {_bounds(arg)}, got {_show(value)}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be bool (true or false), got {_show(value)}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be str, got {_show(value)}")
        check_text(where, value)
        _check_length(where, len(value.encode()), arg, "bytes of UTF-8")
        return value
    if kind == "hex":
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be str of hex digits, got {_show(value)}")
        data = bytes_arg(op, path, value)
        _check_length(where, len(data), arg, "bytes")
        return data
    if kind == "list":
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be list, got {_show(value)}")
        _check_length(where, len(value), arg, "items")
        if not arg.fields:
            return value
        fast = _items_fast(value, arg.fields)
        if fast is not None:
            return fast
        names = [name for name, _ in arg.fields]
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, list) or len(item) != len(names):
                at = f"{path}[{i}]"
                raise ProtocolError(f"{op}: argument {at!r} must be a list [{', '.join(names)}], "
                                    f"got {_show(item)}")
            out.append(tuple(check_value(op, f"{path}[{i}].{name}", x, field)
                             for (name, field), x in zip(arg.fields, item, strict=True)))
        return out
    raise AssertionError(f"{op}: argument {path!r} has no checker for kind {kind!r}")


def _items_fast(value: list[Any], fields: tuple[tuple[str, Arg], ...]) -> list[tuple[Any, ...]] | None:
    """The items of a list argument, checked and converted as check_value would, without
    building a message per field (a poke batch has thousands of items); None when an
    item is not plainly right, for check_value to name the fault."""
    kinds = [(f.kind, f.lo, f.hi) for _, f in fields]
    if any(k not in ("int", "hex") for k, _, _ in kinds):
        return None
    n = len(kinds)
    out = []
    try:
        for item in value:
            if type(item) is not list or len(item) != n:
                return None
            row: list[Any] = []
            for (kind, lo, hi), x in zip(kinds, item, strict=True):
                if kind == "int":
                    if type(x) is not int or not lo <= x <= hi:
                        return None
                    row.append(x)
                else:
                    if type(x) is not str:
                        return None
                    data = bytes.fromhex(x)
                    if not lo <= len(data) <= hi:
                        return None
                    row.append(data)
            out.append(tuple(row))
    except ValueError:
        return None
    return out


def check_text(where: str, value: str) -> None:
    """A string the daemon may pass on: no NUL (C strings and paths end there) and no
    lone surrogate (it has no UTF-8 form; JSON can carry one as a \\uD800 escape)."""
    at = value.find("\0")
    if at >= 0:
        raise ProtocolError(f"{where} contains a NUL character (at index {at})")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ProtocolError(f"{where} contains a lone surrogate "
                            f"(U+{ord(value[exc.start]):04X} at index {exc.start}): not UTF-8") from None


def _check_length(where: str, n: int, arg: Arg, unit: str) -> None:
    if n < arg.lo:
        raise ProtocolError(f"{where} has {n} {unit}, fewer than {_num(arg.lo)}")
    if n > arg.hi:
        raise ProtocolError(f"{where} has {n} {unit}, over the limit of {_num(arg.hi)}")


def _bounds(arg: Arg) -> str:
    hi = "2**64-1" if arg.hi == U64_MAX else _num(arg.hi)
    return f"{_num(arg.lo)}..{hi}"


def _num(x: int | float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _show(value: Any) -> str:
    """A value for an error message: its JSON type and a bounded rendering."""
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if isinstance(value, int):
        return f"int {value}" if value.bit_length() <= 128 else f"int of {value.bit_length()} bits"
    if value is None:
        return "null"
    kind = {str: "str", float: "number", list: "list", dict: "object"}.get(type(value), "value")
    if isinstance(value, list | dict):
        return f"{kind} of {len(value)} items"
    return f"{kind} {clip(repr(value))}"


def clip(s: str, limit: int = 80) -> str:
    return s if len(s) <= limit else s[:limit] + "..."


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
    if not isinstance(error, dict):     # a malformed reply: its error is no object
        raise ProtocolError(f"a reply's error is {type(error).__name__}, not an object: "
                            f"{_show(error)}")
    raise make_error(str(error.get("code", "ksim")), str(error.get("message", "request failed")))


def mac(token: bytes, nonce: str) -> str:
    return hmac.new(token, bytes.fromhex(nonce), hashlib.sha256).hexdigest()
