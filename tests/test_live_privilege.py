"""What the kernel module itself checks before it changes anything (issue
"Hardening, round two"), on the live testbed's Debian 6.1 kernel, no mocks:

* CAP_SYS_ADMIN: opening /dev/kerninst without it is EPERM (checked before
  the one-opener rule: with it, the open is EBUSY, kerninstd holding the device);
  a descriptor used by a process without it (kerninstd's own, taken with
  pidfd_getfd, the capability then dropped) gets EACCES for every command but
  VERSION -- which kerninstd reports as NotPrivileged.
* Jumps written into text: a jump must lead into kernel or module text or into a
  patch block of the writer's own.  A 5-byte jmp into kernel data, into the
  client's own heap block or into kerninst's own text, a single e9 byte that
  completes a jump with the bytes after it, and new displacement bytes for a jump
  ksim wrote are refused (JumpOutside) with nothing written.

The writes go to ``__x64_sys_swapoff``, which nothing in the guest calls: were a
check wrong, the bad jump would sit there unexecuted until the undo.

Lockdown is in tests/test_live_lockdown.py (a testbed of its own: lockdown cannot
be lifted)."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import json
import struct

import pytest

from ksim.core import Write
from ksim.errors import JumpOutside, TextOwned
from ksim.live import abi
from ksim.live.client import LiveTarget
from ksim.live.testing import (  # noqa: F401
    connect,
    dmesg_problems,
    jmp,
    plain_insn,
    rel32,
    target,
    testbed,
)
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

FUNC = "__x64_sys_swapoff"

#: run in the guest with kerninstd's pid: its /dev/kerninst descriptor, taken with
#: pidfd_getfd, used with CAP_SYS_ADMIN and then without it
GETFD = r"""
import ctypes, errno, fcntl, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid = int(sys.argv[1])
(version, version_size), (info, info_size), (owner_new, owner_size) = (
    tuple(map(int, a.split(":"))) for a in sys.argv[2:5])
fdnum = next(int(n) for n in os.listdir(f"/proc/{pid}/fd")
             if os.readlink(f"/proc/{pid}/fd/{n}") == "/dev/kerninst")
pidfd = libc.syscall(434, pid, 0)                     # pidfd_open
fd = libc.syscall(438, pidfd, fdnum, 0)               # pidfd_getfd
assert pidfd >= 0 and fd >= 0, ctypes.get_errno()

def call(request, size):
    try:
        fcntl.ioctl(fd, request, bytearray(size), True)
        return 0
    except OSError as exc:
        return exc.errno

out = {"with": {"version": call(version, version_size), "info": call(info, info_size)}}
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()
assert libc.syscall(125, ctypes.byref(header), data) == 0      # capget
data[0].effective &= ~(1 << 21)                                 # CAP_SYS_ADMIN
data[0].permitted &= ~(1 << 21)
assert libc.syscall(126, ctypes.byref(header), data) == 0      # capset
out["without"] = {"version": call(version, version_size), "info": call(info, info_size),
                  "owner_new": call(owner_new, owner_size)}
print(json.dumps(out))
"""

OPEN = ("python3 -c \"import os, errno\ntry:\n os.open('/dev/kerninst', os.O_RDWR)\n"
        "except OSError as e:\n print(errno.errorcode[e.errno])\"")


def test_the_device_needs_cap_sys_admin(target: LiveTarget) -> None:
    # with the capability the open gets as far as the one-opener rule
    assert target.exec_checked(OPEN).strip() == "EBUSY"
    drop = "setpriv --bounding-set -sys_admin --inh-caps -sys_admin"
    assert target.exec_checked(f"{drop} {OPEN}").strip() == "EPERM"


def test_every_command_but_version_needs_cap_sys_admin(target: LiveTarget) -> None:
    script = "/tmp/ksim-getfd.py"
    target.exec_checked(f"cat > {script} <<'EOF'\n{GETFD}\nEOF")
    args = [f"{abi.command(n)}:{abi.structure(s).size}" for n, s in (
        ("VERSION", "kerninst_version"), ("INFO", "kerninst_info"), ("OWNER_NEW", "kerninst_owner"))]
    out = json.loads(target.exec_checked(f"python3 {script} $PPID {' '.join(args)}"))
    assert out["with"] == {"version": 0, "info": 0}
    assert out["without"] == {"version": 0, "info": 13, "owner_new": 13}   # EACCES
    assert target.read(target.text[0], 8)  # kerninstd's own descriptor goes on working


def refused(t: LiveTarget, change: Change, site: int, error=JumpOutside) -> None:
    before = t.read(site, 16)
    with pytest.raises(error) as info:
        t.apply(change)
    assert t.read(site, 16) == before
    if error is JumpOutside:
        assert f"poke at {change.text[0].address:#x}" in str(info.value)


def test_a_jump_written_into_text_must_lead_to_text_or_own_patch_code(
        testbed: dict, target: LiveTarget) -> None:
    t = target
    site, insn = plain_insn(t, FUNC)
    orig = t.read(site, 16)
    heap = t.alloc_data(64)
    for dest in (t.lookup("jiffies_64"), heap, t.lookup("ki_die_notify")):
        refused(t, Change(text=(Write(site, orig[:5], jmp(site, dest)),)), site)
    # with patch code of its own in the same batch, a jump elsewhere is still refused
    patch = t.alloc_code(64, near=site)
    code = insn + jmp(patch + len(insn), site + len(insn))
    refused(t, Change(code=(Write(patch, t.read(patch, len(code)), code),),
                      text=(Write(site, orig[:5], jmp(site, heap)),)), site)
    assert t.read(patch, len(code)) != code
    # another client's patch block: its owner's
    other = connect(testbed)
    try:
        theirs = other.alloc_code(64, near=site)
        refused(t, Change(text=(Write(site, orig[:5], jmp(site, theirs)),)), site, TextOwned)
        other.free_code(theirs)
    finally:
        other.close()
    t.free_code(patch)
    t.free_data(heap)
    assert dmesg_problems(t) == []


def test_a_single_e9_byte_completing_a_jump_is_checked(target: LiveTarget) -> None:
    """kerninst knows no instruction boundaries: one e9 byte makes a jump with the
    four bytes after it, which lead wherever they happen to point."""
    t = target
    start = t.lookup(FUNC)
    text = t.text
    code = t.read(start, 64)
    insns = list(t.arch.decode(code, start))
    hazards = t.text_hazards([(i.address, 1) for i in insns])
    for insn, found in zip(insns, hazards, strict=True):
        dest = insn.address + 5 + struct.unpack("<i", t.read(insn.address + 1, 4))[0]
        if found or text[0] <= dest < text[1] or 0xFFFFFFFFA0000000 <= dest:
            continue  # could land in text, or in a module's
        refused(t, Change(text=(Write(insn.address, insn.raw[:1], b"\xe9"),)), insn.address)
        break
    else:
        pytest.skip(f"every instruction of {FUNC}'s first 64 bytes could lead into text")


def test_new_displacement_bytes_of_a_ksim_jump_are_checked(target: LiveTarget) -> None:
    t = target
    site, insn = plain_insn(t, FUNC)
    orig = t.read(site, 16)
    patch = t.alloc_code(64, near=site)
    code = insn + jmp(patch + len(insn), site + len(insn))
    splice = Write(site, orig[:5], jmp(site, patch))
    t.apply(Change(code=(Write(patch, t.read(patch, len(code)), code),), text=(splice,)))
    try:
        bad = rel32(site + 5, t.lookup("jiffies_64"))
        refused(t, Change(text=(Write(site + 1, splice.new[1:], bad),)), site)
        refused(t, Change(text=(Write(site + 3, splice.new[3:], bad[2:]),)), site)
        assert t.read(site, 5) == splice.new
    finally:
        t.apply(Change(text=(Write(site, splice.new, orig[:5]),)))
        t.free_code(patch)
    assert t.read(site, 16) == orig
