"""kerninstd's wire protocol, without a daemon: framing, validation, errors."""

from __future__ import annotations

import struct

import pytest

from ksim.errors import AuthError, KsimError, ProtocolError, StaleText, UnknownSymbol
from ksim.live import protocol as wire


def test_frame_round_trip() -> None:
    msg = {"v": 1, "id": 7, "op": "read", "address": 0xFFFFFFFF81000000, "size": 16}
    frame = wire.encode(msg)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert wire.decode(frame[4:]) == msg


@pytest.mark.parametrize("length", [0, wire.MAX_FRAME + 1, 0xFFFFFFFF])
def test_bad_lengths_are_refused(length: int) -> None:
    with pytest.raises(ProtocolError):
        wire.frame_length(struct.pack(">I", length))


def test_the_frame_limit_before_auth_fits_hello_and_auth() -> None:
    """The small pre-auth limit must never refuse a real client: its biggest id and a MAC fit."""
    big_id = wire.U64_MAX
    hello = wire.encode({"v": wire.VERSION, "id": big_id, "op": "hello"})
    auth = wire.encode({"v": wire.VERSION, "id": big_id, "op": "auth",
                        "mac": wire.mac(b"t" * 64, "00" * 32)})
    for frame in (hello, auth):
        assert wire.frame_length(frame[:4], wire.MAX_AUTH_FRAME) == len(frame) - 4
        assert len(frame) - 4 < wire.MAX_AUTH_FRAME // 4
    with pytest.raises(ProtocolError, match="limit 1024"):
        wire.frame_length(struct.pack(">I", wire.MAX_AUTH_FRAME + 1), wire.MAX_AUTH_FRAME)


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"text"',
                                  b"[" * 100_000 + b"]" * 100_000,      # nested past the parser
                                  b'{"id": ' + b"7" * 5000 + b"}"])   # past int()'s digit limit
def test_bodies_that_are_not_objects_are_refused(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(body)


@pytest.mark.parametrize("message, why", [
    ({"v": 2, "id": 1, "op": "hello"}, "version"),
    ({"v": 1, "op": "hello"}, "id"),
    ({"v": 1, "id": 1, "op": "format_disk"}, "unknown op"),
    ({"v": 1, "id": 1, "op": "read", "address": 1}, "missing"),
    ({"v": 1, "id": 1, "op": "read", "address": "0x10", "size": 8}, "must be int"),
    ({"v": 1, "id": 1, "op": "read", "address": True, "size": 8}, "must be int"),
    ({"v": 1, "id": 1, "op": "write", "address": 1, "data": "zz"}, "not hex"),
    ({"v": True, "id": 1, "op": "hello"}, "version bool true"),
    ({"v": 1, "id": 1 << 64, "op": "hello"}, "integer id"),
    ({"v": 1, "id": 1, "op": "read", "address": 1 << 64, "size": 8}, r"'address' must be int in 0\.\.2\*\*64-1"),
    ({"v": 1, "id": 1, "op": "read", "address": -8, "size": 8}, "got int -8"),
    ({"v": 1, "id": 1, "op": "keep", "keep": 0}, "'keep' must be bool"),
    ({"v": 1, "id": 1, "op": "lookup", "name": "a\0b"}, "'name' contains a NUL"),
    ({"v": 1, "id": 1, "op": "lookup", "name": "\udc80"}, "'name' contains a lone surrogate"),
    ({"v": 1, "id": 1, "op": "exec", "cmd": "true", "timeout": float("inf")}, "finite number"),
    ({"v": 1, "id": 1, "op": "poke", "writes": [[1, "90", "cc"]] * (wire.MAX_WRITES + 1)},
     f"over the limit of {wire.MAX_WRITES}"),
    ({"v": 1, "id": 1, "op": "poke", "writes": [[1, "90", 7]]}, r"'writes\[0\]\.new' must be str"),
    ({"v": 1, "id": 1, "op": "hazards", "ranges": [[1, 17]]}, r"'ranges\[0\]\.length' must be int in 1\.\.16"),
])
def test_malformed_requests_name_their_fault(message: dict, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        wire.check_request(message)


def test_list_items_come_back_checked_and_converted() -> None:
    _, args = wire.check_request({"v": 1, "id": 1, "op": "poke",
                                  "writes": [[(1 << 64) - 1, "90", "cc"]]})
    assert args["writes"] == [((1 << 64) - 1, b"\x90", b"\xcc")]
    _, args = wire.check_request({"v": 1, "id": 1, "op": "hazards", "ranges": [[16, 5]]})
    assert args["ranges"] == [(16, 5)]
    _, args = wire.check_request({"v": 1, "id": 1, "op": "auth", "mac": "ab" * 32})
    assert args["mac"] == b"\xab" * 32
    _, args = wire.check_request({"v": 1, "id": 1, "op": "exec", "cmd": "true", "timeout": 5})
    assert args["timeout"] == 5.0 and isinstance(args["timeout"], float)


def test_defaults_and_hex_arguments() -> None:
    op, args = wire.check_request({"v": 1, "id": 1, "op": "write", "address": 16, "data": "cc90"})
    assert op.name == "write" and args == {"address": 16, "data": b"\xcc\x90"}
    _, args = wire.check_request({"v": 1, "id": 2, "op": "alloc_data", "size": 8})
    assert args == {"size": 8, "align": 8}


def test_only_hello_and_auth_need_no_authentication() -> None:
    assert {name for name, op in wire.OPS.items() if not op.auth} == {"hello", "auth"}


def test_errors_travel_by_code() -> None:
    reply = wire.reply_error(3, StaleText("expected 0f1f440000"))
    assert reply["error"]["code"] == "stale-text"
    with pytest.raises(StaleText, match="expected"):
        wire.raise_for(reply)
    with pytest.raises(AuthError):
        wire.raise_for(wire.reply_error(4, AuthError("wrong token")))
    err = wire.make_error("unknown-symbol", "no such symbol")
    assert isinstance(err, UnknownSymbol)
    assert type(wire.make_error("no-such-code", "x")) is KsimError


def test_mac_depends_on_token_and_nonce() -> None:
    nonce = "00" * 32
    assert wire.mac(b"a" * 32, nonce) != wire.mac(b"b" * 32, nonce)
    assert wire.mac(b"a" * 32, nonce) != wire.mac(b"a" * 32, "01" * 32)
