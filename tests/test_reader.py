"""x86-64 reader: flow, targets, RIP-relative references and register effects."""

from __future__ import annotations

import subprocess

import pytest
from analysis_kernel import fixture_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

from ksim.arch.base import Flow
from ksim.arch.x86_64.reader import ALL_REGS, decode, decode_lite, decode_one, insn_lengths
from ksim.errors import DecodeError

BASE = 0xFFFFFFFF81000000

# (hex, mnemonic, flow, target offset from BASE or None)
FLOW_CASES = [
    ("e9 fb 00 00 00", "jmp", Flow.JMP, 0x100),           # jmp rel32
    ("eb fe", "jmp", Flow.JMP, 0x0),                      # jmp $
    ("74 10", "je", Flow.JCC, 0x12),                      # je rel8
    ("0f 85 00 01 00 00", "jne", Flow.JCC, 0x106),        # jne rel32
    ("e3 02", "jrcxz", Flow.JCC, 0x4),                    # jrcxz: a conditional branch
    ("e2 fe", "loop", Flow.JCC, 0x0),                     # loop: a conditional branch
    ("e8 00 00 00 00", "call", Flow.CALL, 0x5),           # call next
    ("ff d0", "call", Flow.CALL_INDIRECT, None),          # call *%rax
    ("ff 15 10 00 00 00", "call", Flow.CALL_INDIRECT, None),  # call *0x10(%rip)
    ("ff e0", "jmp", Flow.JMP_INDIRECT, None),            # jmp *%rax
    ("3e ff e0", "notrack jmp", Flow.JMP_INDIRECT, None),  # notrack jmp *%rax
    ("ff 24 fd 00 10 00 81", "jmp", Flow.JMP_INDIRECT, None),  # jmp *T(,%rdi,8)
    ("c3", "ret", Flow.RET, None),
    ("f3 c3", "repz ret", Flow.RET, None),
    ("c2 08 00", "ret", Flow.RET, None),                  # ret $8
    ("f4", "hlt", Flow.STOP, None),
    ("0f 0b", "ud2", Flow.STOP, None),
    ("cc", "int3", Flow.STOP, None),
    ("48 cf", "iretq", Flow.STOP, None),
    ("48 0f 07", "sysretq", Flow.STOP, None),
    ("48 01 d8", "add", Flow.SEQ, None),                  # add %rbx,%rax
    ("0f 05", "syscall", Flow.SEQ, None),
]


@pytest.mark.parametrize("hexcode,mnemonic,flow,target", FLOW_CASES)
def test_flow_and_target(hexcode: str, mnemonic: str, flow: Flow, target: int | None) -> None:
    insn = decode_one(bytes.fromhex(hexcode), BASE)
    assert insn.mnemonic == mnemonic
    assert insn.flow is flow
    assert insn.target == (None if target is None else BASE + target)
    assert insn.raw == bytes.fromhex(hexcode)
    assert insn.size == len(insn.raw) and insn.end == BASE + insn.size


@pytest.mark.parametrize("hexcode,ref", [
    ("48 8b 05 10 00 00 00", 0x7 + 0x10),      # mov 0x10(%rip),%rax
    ("48 8d 3d f9 ff ff ff", 0x0),             # lea -7(%rip),%rdi: itself
    ("c6 05 01 00 00 00 01", 0x7 + 0x1),       # movb $1,1(%rip): disp before the imm
    ("65 48 8b 05 00 01 00 00", 0x8 + 0x100),  # mov %gs:0x100(%rip),%rax
    ("ff 15 10 00 00 00", 0x6 + 0x10),         # call *0x10(%rip)
])
def test_pc_ref_is_absolute(hexcode: str, ref: int) -> None:
    assert decode_one(bytes.fromhex(hexcode), BASE).pc_ref == BASE + ref


def test_no_pc_ref_without_rip() -> None:
    assert decode_one(bytes.fromhex("48 8b 04 c5 00 10 00 81"), BASE).pc_ref is None


# (hex, reads, writes) with registers as the liveness analysis must see them
EFFECT_CASES = [
    ("48 01 d8", {"rax", "rbx"}, {"rax", "flags"}),                     # add %rbx,%rax
    ("89 c8", {"rcx"}, {"rax"}),                                        # mov %ecx,%eax: full write
    ("88 c8", {"rcx", "rax"}, {"rax"}),                                 # mov %cl,%al: partial
    ("66 89 c8", {"rcx", "rax"}, {"rax"}),                              # mov %cx,%ax: partial
    ("45 89 c8", {"r9"}, {"r8"}),                                       # mov %r9d,%r8d
    ("31 c0", set(), {"rax", "flags"}),                                 # xor %eax,%eax: zeroing
    ("30 c0", {"rax"}, {"rax", "flags"}),                               # xor %al,%al keeps the rest
    ("ff c0", {"rax", "flags"}, {"rax", "flags"}),                      # inc: CF survives
    ("48 0f 44 c1", {"rax", "rcx", "flags"}, {"rax"}),                  # cmove: may not write
    ("0f b1 0b", {"rax", "rbx", "rcx", "flags"}, {"rax", "flags"}),     # cmpxchg %ecx,(%rbx)
    ("d3 e0", {"rax", "rcx", "flags"}, {"rax", "flags"}),               # shl %cl,%eax: cl may be 0
    ("fc", {"flags"}, {"flags"}),                                       # cld: DF only
    ("9c", {"rsp", "flags"}, {"rsp"}),                                  # pushf
    ("e8 00 00 00 00", {"rsp"}, {"rsp"}),                               # call: no rip
    ("0f 05", set(), {"rcx", "r11", "flags"}),                          # syscall
    ("0f 30", {"rax", "rcx", "rdx"}, set()),                            # wrmsr
    ("0f 38 f0 c0", None, None),                                        # placeholder: skipped
]


@pytest.mark.parametrize("hexcode,reads,writes", [c for c in EFFECT_CASES if c[1] is not None])
def test_register_effects(hexcode: str, reads: set[str], writes: set[str]) -> None:
    insn = decode_one(bytes.fromhex(hexcode), BASE)
    assert set(insn.reads) == reads, str(insn)
    assert set(insn.writes) == writes, str(insn)


def test_decode_stops_at_undecodable_bytes() -> None:
    code = bytes.fromhex("90 90 06 90")  # 06 (push es) is invalid in 64-bit mode
    insns = list(decode(code, BASE))
    assert [i.address for i in insns] == [BASE, BASE + 1]


def test_decode_one_raises() -> None:
    with pytest.raises(DecodeError, match="undecodable"):
        decode_one(b"\x06", BASE)
    with pytest.raises(DecodeError):
        decode_one(b"", BASE)
    with pytest.raises(DecodeError):
        decode_one(b"\x48\x8b", BASE)  # truncated


def test_lite_paths_agree() -> None:
    code = bytes.fromhex("55 48 89 e5 e8 00 00 00 00 5d c3")
    full = [(i.address, i.size, i.mnemonic, i.op_str) for i in decode(code, BASE)]
    assert list(decode_lite(code, BASE)) == full
    assert list(insn_lengths(code, BASE)) == [(a, s) for a, s, _m, _o in full]


def test_lengths_match_objdump() -> None:
    """Instruction boundaries of a real kernel image agree with binutils."""
    from ksim.image import load_image

    path = fixture_kernel()
    image = load_image(path)
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path],
                          capture_output=True, text=True, check=True).stdout
    theirs = set()
    for line in dump.splitlines():
        head, sep, _rest = line.partition(":\t")
        head = head.strip()
        if sep and head and all(c in "0123456789abcdef" for c in head):
            theirs.add(int(head, 16))
    ours = set()
    for func in image.functions:
        ours |= {i.address for i in decode(image.code(func), func.address)}
    assert ours and ours <= theirs


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=48))
def test_random_bytes_decode_safely(code: bytes) -> None:
    addr = BASE
    for insn in decode(code, BASE):
        assert insn.address == addr and 1 <= insn.size <= 15
        assert insn.raw == code[addr - BASE : addr - BASE + insn.size]
        assert insn.reads <= ALL_REGS and insn.writes <= ALL_REGS
        assert (insn.target is not None) == (insn.flow in (Flow.JMP, Flow.JCC, Flow.CALL))
        addr = insn.end
    try:
        first = decode_one(code, BASE)
    except DecodeError:
        assert addr == BASE
    else:
        assert first.address == BASE


def test_flow_scan_agrees_with_decode() -> None:
    from ksim.arch.x86_64.reader import flows

    code = bytes.fromhex("e8 00 00 00 00 74 02 ff e0 eb fe c3 ff d0 f4")
    assert list(flows(code, BASE)) == [(i.address, i.size, i.flow, i.target) for i in decode(code, BASE)]
