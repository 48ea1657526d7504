"""The kerninst module and kerninstd on a real Debian 6.1 kernel in QEMU (no mocks).

Raw splices here are hand-assembled, without the planner or the Manager, so
that these tests check the module, the daemon and the wire on their own.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from ksim.core import Write
from ksim.errors import (
    AuthError,
    Blacklisted,
    KsimError,
    OutsideText,
    ProtocolError,
    StaleText,
    TargetFault,
    UnknownHandle,
)
from ksim.live import abi
from ksim.live import protocol as wire
from ksim.live.client import Connection, LiveTarget
from ksim.live.testing import (  # noqa: F401
    dmesg_problems,
    getppid_loop,
    plain_site,
    read_u64,
    target,
    testbed,
)
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_getppid"
FTRACE_NOP = bytes.fromhex("0f1f440000")
N = 100_000


def rel32(frm: int, to: int) -> bytes:
    return struct.pack("<i", to - frm)


def counting_patch(patch: int, counter: int, site: int, first: bytes) -> bytes:
    """lock incq [rip+counter]; <first instruction, relocated as is>; jmp site+len(first)."""
    code = b"\xf0\x48\xff\x05" + rel32(patch + 8, counter) + first
    return code + b"\xe9" + rel32(patch + len(code) + 5, site + len(first))


def install_patch(t: LiveTarget, counter: int, site: int, first: bytes) -> tuple[int, bytes]:
    code_at = t.alloc_code(64, near=site)
    code = counting_patch(code_at, counter, site, first)
    t.apply(Change(code=(Write(code_at, t.read(code_at, len(code)), code),)))
    return code_at, code


def test_module_loads_and_reports_its_version(target: LiveTarget) -> None:
    assert target.info["version"] == abi.ABI_VERSION
    assert target.info["text_start"] == 0xFFFFFFFF81000000  # nokaslr
    lsmod = target.exec("cat /proc/modules")
    assert lsmod.startswith("kerninst ") or "\nkerninst " in lsmod
    assert target.exec("ls -l /dev/kerninst").startswith("crw-------")
    # The patch area and heap are reachable by rel32/disp32 from all of kernel text.
    lo, hi = target.text
    for start, end in (target.code_region, target.data_region):
        assert end - lo < 1 << 31 and hi - start < 1 << 31
    # The per-cpu current_task really holds a task whose pid we can read.
    assert target.abi.current_task.segment == "gs" and target.abi.task_pid_offset > 0
    # The functions snippets call, looked up together: kallsyms' addresses.
    image = target.image
    assert target.abi.read_nofault == image.address_of("copy_from_kernel_nofault")
    assert target.abi.read_user_nofault == image.address_of("copy_from_user_nofault")
    assert target.abi.clock_ns == image.address_of("ktime_get_mono_fast_ns")


def test_lookups_asked_together_answer_as_one_by_one(target: LiveTarget) -> None:
    """_looked_up: names asked for at once answer as lookup does, an unknown name
    with lookup's error when it is looked up, a name not asked for by asking."""
    lookup = target._looked_up(["vfs_read", "no_such_function_anywhere", "vfs_read"])
    assert lookup("vfs_read") == target.lookup("vfs_read")
    with pytest.raises(KsimError) as asked_together:
        lookup("no_such_function_anywhere")
    with pytest.raises(KsimError) as asked_alone:
        target.lookup("no_such_function_anywhere")
    assert type(asked_together.value) is type(asked_alone.value)
    assert lookup("vfs_write") == target.lookup("vfs_write")
    assert target.read(target.text[0], 4)          # the connection is in step


def test_read_of_bad_addresses_is_an_error_not_an_oops(target: LiveTarget) -> None:
    for address in (0, 0x1000, 0xFFFF800000000000 - 8, 0xFFFFFFFFFFFFF000):
        with pytest.raises(TargetFault):
            target.read(address, 8)
    assert target.read(target.lookup(FUNC), 5) == FTRACE_NOP
    assert dmesg_problems(target) == []


def test_poke_with_wrong_old_bytes_is_stale_and_changes_nothing(target: LiveTarget) -> None:
    site = plain_site(target, FUNC)
    before = target.read(site, 5)
    wrong = bytes(b ^ 0xFF for b in before)
    with pytest.raises(StaleText) as info:
        target.apply(Change(text=(Write(site, wrong, b"\xe9\x00\x00\x00\x00"),)))
    assert info.value.code == "stale-text"
    # All or nothing: a good first write is not made when the second is stale.
    other = plain_site(target, "__x64_sys_getpid")
    other_before = target.read(other, 5)
    with pytest.raises(StaleText):
        target.apply(Change(text=(Write(other, other_before[:1], b"\xcc"),
                                  Write(site, wrong[:1], b"\xcc"))))
    assert target.read(site, 5) == before and target.read(other, 5) == other_before


def test_writes_outside_their_regions_are_refused(target: LiveTarget) -> None:
    data_symbol = target.lookup("jiffies_64")
    with pytest.raises(OutsideText):
        target.apply(Change(text=(Write(data_symbol, target.read(data_symbol, 1), b"\xcc"),)))
    with pytest.raises(OutsideText):
        target.apply(Change(routes=((data_symbol, target.code_region[0]),)))
    # Text is never written through the data path.
    site = target.lookup(FUNC)
    with pytest.raises(TargetFault):
        target.write(site, b"\xcc")
    # The int3 path itself (noinstr) cannot be spliced.
    exc_int3 = target.lookup("exc_int3")
    with pytest.raises(Blacklisted):
        target.apply(Change(text=(Write(exc_int3, target.read(exc_int3, 1), b"\xcc"),)))
    # a route this client never set cannot be cleared
    with pytest.raises(UnknownHandle):
        target.apply(Change(routes=((site, 0),)))
    assert dmesg_problems(target) == []


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    return s


def _reply(s: socket.socket) -> dict:
    header = s.recv(4, socket.MSG_WAITALL)
    body = b""
    length = wire.frame_length(header)
    while len(body) < length:
        body += s.recv(length - len(body))
    return json.loads(body)


def test_bad_clients_are_refused_with_specific_errors(testbed: dict, target: LiveTarget) -> None:
    port = int(testbed["port"])
    with pytest.raises(AuthError, match="wrong token"):
        Connection("127.0.0.1", port, token=b"0" * 64)
    # An op before auth never reaches the device.
    with _raw(port) as s:
        s.sendall(wire.encode({"v": 1, "id": 1, "op": "read", "address": 0, "size": 8}))
        r = _reply(s)
        assert not r["ok"] and r["error"]["code"] == "auth"
    # A bad frame length: a protocol error, then the daemon hangs up.
    with _raw(port) as s:
        s.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
        assert _reply(s)["error"]["code"] == "protocol"
        assert s.recv(1) == b""
    with _raw(port) as s:
        s.sendall(struct.pack(">I", 0))
        assert _reply(s)["error"]["code"] == "protocol"
    # Not JSON, then an unknown op, then a wrong argument type: each a protocol error.
    with _raw(port) as s:
        s.sendall(struct.pack(">I", 9) + b"{not json")
        assert _reply(s)["error"]["code"] == "protocol"
        s.sendall(wire.encode({"v": 1, "id": 2, "op": "format_disk"}))
        r = _reply(s)
        assert r["error"]["code"] == "protocol" and "unknown op" in r["error"]["message"]
        s.sendall(wire.encode({"v": 9, "id": 3, "op": "hello"}))
        assert _reply(s)["error"]["code"] == "protocol"
    with pytest.raises(ProtocolError):
        target.conn.request("read", address="0x0", size=8)
    assert dmesg_problems(target) == []


def test_disconnect_without_cleanup_leaves_no_splice(testbed: dict, target: LiveTarget) -> None:
    site = plain_site(target, FUNC)
    trap_site = plain_site(target, "__x64_sys_getpid")
    originals = {site: target.read(site, 5), trap_site: target.read(trap_site, 5)}
    other = LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
    counter = other.alloc_data(8)
    patch, _ = install_patch(other, counter, site, originals[site])
    other.apply(Change(text=(Write(site, originals[site], b"\xe9" + rel32(site + 5, patch)),)))
    tpatch, _ = install_patch(other, counter, trap_site, originals[trap_site][:5])
    other.apply(Change(routes=((trap_site, tpatch),),
                       text=(Write(trap_site, originals[trap_site][:1], b"\xcc"),)))
    target.exec(f"{getppid_loop()} 100")
    assert read_u64(other, counter) >= 100
    assert target.read(site, 1) == b"\xe9" and target.read(trap_site, 1) == b"\xcc"
    other.conn.sock.close()  # no bye, no undo: the daemon must clean up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            target.read(a, 5) != b for a, b in originals.items()):
        time.sleep(0.1)
    assert {a: target.read(a, 5) for a in originals} == originals
    assert dmesg_problems(target) == []


def _count_with_oracle(t: LiveTarget, counter: int, insert, remove) -> tuple[int, int]:
    # the kernel's kprobe at the entry (ftrace-based): the splice sits on straight-line
    # code after it, so both count every call; a kprobe on the spliced bytes themselves
    # would make the module refuse the splice
    with t.oracle_counter(t.lookup(FUNC)) as oracle:
        k0, c0 = oracle.count, read_u64(t, counter)
        insert()
        result = t.run(while_cmd=f"{getppid_loop()} {N}")
        remove()
        c1, k1 = read_u64(t, counter), oracle.count
    assert result.output.strip() == str(N)
    return c1 - c0, k1 - k0


def test_raw_jmp_splice_counts_exactly(target: LiveTarget) -> None:
    site = plain_site(target, FUNC)
    original = target.read(site, 5)  # position-independent: copied as is
    counter = target.alloc_data(8)
    patch, _ = install_patch(target, counter, site, original)
    jmp = b"\xe9" + rel32(site + 5, patch)
    counted, oracle = _count_with_oracle(
        target, counter,
        lambda: target.apply(Change(text=(Write(site, original, jmp),))),
        lambda: target.apply(Change(text=(Write(site, jmp, original),))))
    # Background getppid calls (the guest shell reading kprobe_profile) are a handful.
    assert N <= counted <= N + 5
    assert abs(counted - oracle) <= 3
    assert target.read(site, 5) == original
    target.free_code(patch)
    assert dmesg_problems(target) == []


def test_raw_trap_splice_counts_exactly(target: LiveTarget) -> None:
    site = plain_site(target, FUNC)
    original = target.read(site, 5)
    counter = target.alloc_data(8)
    patch, _ = install_patch(target, counter, site, original)

    def insert() -> None:  # the route, then the int3: one batch
        target.apply(Change(routes=((site, patch),), text=(Write(site, original[:1], b"\xcc"),)))

    def remove() -> None:  # the int3 out, then its route: one batch
        target.apply(Change(routes=((site, 0),), text=(Write(site, b"\xcc", original[:1]),)))

    counted, oracle = _count_with_oracle(target, counter, insert, remove)
    assert N <= counted <= N + 5
    assert abs(counted - oracle) <= 3
    assert target.read(site, 5) == original
    assert dmesg_problems(target) == []


def test_round_trip_time(target: LiveTarget) -> None:
    site = target.lookup(FUNC)
    t0 = time.perf_counter()
    for _ in range(50):
        target.read(site, 8)
    rtt = (time.perf_counter() - t0) / 50
    print(f"read round trip: {rtt * 1e3:.2f} ms")
    assert rtt < 0.5


def test_device_has_one_owner(testbed: dict, target: LiveTarget) -> None:
    # A second kerninstd on the same device would allocate the same patch bytes.
    import sys

    token = testbed["token_file"]
    r = target.conn.request(
        "exec", timeout=60.0, reply_timeout=90,
        cmd=f"cd / && {sys.executable} -m ksim.live.daemon --listen 127.0.0.1:7999 "
            f"--token-file {token} --device /dev/kerninst")
    assert r["rc"] == 2 and "busy" in r["stderr"].lower()
