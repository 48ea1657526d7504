"""Helpers shared by the toy kernel's tests: a minimal trap splice built by hand
(int3 at a function's entry, a patch that runs the displaced instruction and
jumps back), independent of ksim's planner so that it can check the kernel and
the machines on their own."""

from __future__ import annotations

import struct

import capstone

BRANCH_PREFIXES = ("j", "loop", "call")


def trap_patch(site: int, patch: int, first: bytes, marker: bytes | None) -> bytes:
    """Patch code for an int3 at ``site``: optional serial marker, the displaced
    instruction, and a jmp back -- the shape of a ksim trap splice."""
    code = b""
    if marker is not None:
        # push rax; push rdx; mov edx, 0x3f8; mov al, marker; out dx, al; pop rdx; pop rax
        code += b"\x50\x52\xba\xf8\x03\x00\x00\xb0" + marker + b"\xee\x5a\x58"
    code += first
    rel = (site + len(first)) - (patch + len(code) + 5)
    return code + b"\xe9" + struct.pack("<i", rel)


def first_insn(memory, address: int) -> bytes:
    """The bytes of the instruction at ``address`` (``memory`` has ``read(address, n)``);
    it must be movable as is: no RIP-relative operand, no branch."""
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    raw = memory.read(address, 16)
    _a, size, mnem, ops = next(md.disasm_lite(raw, address))
    assert "rip" not in ops and not mnem.startswith(BRANCH_PREFIXES)
    return raw[:size]
