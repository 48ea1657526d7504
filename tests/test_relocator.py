"""x86-64 relocator: annotated input bytes, exact relocated bytes, and equal effect in unicorn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from snippet_machine import STATUS_FLAGS, Machine
from unicorn import UC_ERR_EXCEPTION, UcError
from unicorn.x86_const import UC_X86_REG_RIP

from ksim.arch import Flow, Insn, get_arch
from ksim.arch.x86_64.reader import decode
from ksim.arch.x86_64.relocator import moved_call, relocate, relocated_size
from ksim.errors import CallInsideRun, RelocationError

ARCH = get_arch("x86_64")
OLD = 0xFFFFFFFF81000000
NEW = 0xFFFFFFFFA0000000          # 0x1f000000 above: within ±2 GB


def insns(code: bytes, at: int = OLD):
    out = list(decode(code, at))
    assert sum(i.size for i in out) == len(code), "test input must decode completely"
    return out


def rel32(value: int) -> bytes:
    return value.to_bytes(4, "little", signed=True)


def test_rip_relative_load():
    code = bytes([0x48, 0x8B, 0x05, 0x10, 0x00, 0x00, 0x00])     # mov rax, [rip+0x10] -> OLD+0x17
    expected = bytes([0x48, 0x8B, 0x05]) + rel32(OLD + 0x17 - (NEW + 7))
    assert relocate(insns(code), NEW) == expected


def test_rip_relative_store_with_immediate_after_the_displacement():
    code = bytes([0xC7, 0x05, 0x08, 0x00, 0x00, 0x00,             # mov dword [rip+8], 0x11223344
                  0x44, 0x33, 0x22, 0x11])
    expected = bytes([0xC7, 0x05]) + rel32(OLD + 0x12 - (NEW + 10)) + bytes([0x44, 0x33, 0x22, 0x11])
    assert relocate(insns(code), NEW) == expected


def test_jcc_rel8_becomes_rel32():
    code = bytes([0x75, 0x02])                                    # jnz +2 -> OLD+4
    expected = bytes([0x0F, 0x85]) + rel32(OLD + 4 - (NEW + 6))  # jnz rel32
    assert relocate(insns(code), NEW) == expected


def test_jcc_rel32_recomputed():
    code = bytes([0x0F, 0x8E, 0x00, 0x01, 0x00, 0x00])            # jle +0x100 -> OLD+0x106
    assert relocate(insns(code), NEW) == bytes([0x0F, 0x8E]) + rel32(OLD + 0x106 - (NEW + 6))


def test_jmp_rel8_becomes_rel32():
    code = bytes([0xEB, 0x10])                                    # jmp +0x10 -> OLD+0x12
    assert relocate(insns(code), NEW) == bytes([0xE9]) + rel32(OLD + 0x12 - (NEW + 5))


def test_a_last_call_pushes_the_original_return_address_and_jumps():
    code = bytes([0xE8, 0x00, 0x10, 0x00, 0x00])                  # call +0x1000 -> OLD+0x1005
    expected = (bytes([0x68]) + (OLD + 5).to_bytes(8, "little")[:4]   # push OLD+5 (sign-extended)
                + bytes([0xE9]) + rel32(OLD + 0x1005 - (NEW + 10)))    # jmp OLD+0x1005
    assert relocate(insns(code), NEW) == expected
    assert relocate(insns(code), NEW) == moved_call(insns(code)[0], NEW)


@pytest.mark.parametrize(
    "code,head",
    [
        (bytes([0xE3, 0x10]), bytes([0xE3])),                     # jrcxz +0x10
        (bytes([0x67, 0xE3, 0x10]), bytes([0x67, 0xE3])),         # jecxz +0x10
        (bytes([0xE2, 0x10]), bytes([0xE2])),                     # loop +0x10
        (bytes([0xE1, 0x10]), bytes([0xE1])),                     # loope +0x10
        (bytes([0xE0, 0x10]), bytes([0xE0])),                     # loopne +0x10
    ],
)
def test_rel8_only_loops_are_expanded(code, head):
    target = OLD + len(code) + 0x10
    tail = bytes([0x02, 0xEB, 0x05, 0xE9])                        # op +2; jmp short +5; jmp rel32
    expected = head + tail + rel32(target - (NEW + len(head) + 8))
    assert relocate(insns(code), NEW) == expected


def test_xbegin_abort_address_recomputed():
    code = bytes([0xC7, 0xF8, 0x00, 0x02, 0x00, 0x00])            # xbegin +0x200 -> OLD+0x206
    assert relocate(insns(code), NEW) == bytes([0xC7, 0xF8]) + rel32(OLD + 0x206 - (NEW + 6))


def test_other_instructions_are_copied():
    code = bytes([0x55,                                           # push rbp
                  0x48, 0x89, 0xE5,                               # mov rbp, rsp
                  0x41, 0x54,                                     # push r12
                  0x48, 0x8B, 0x47, 0x08,                         # mov rax, [rdi+8]
                  0xC3])                                          # ret
    assert relocate(insns(code), NEW) == code


def test_branches_inside_the_run_go_to_the_copy():
    code = bytes([0x31, 0xC0,                                     # 0: xor eax, eax
                  0x74, 0x02,                                     # 2: jz +2 -> 6 (inside)
                  0xEB, 0xFA,                                     # 4: jmp -6 -> 0 (inside)
                  0xE3, 0xFA])                                    # 6: jrcxz -6 -> 2 (inside)
    out = relocate(insns(code), NEW)
    # new layout: xor @0 (2), jz @2 (6), jmp @8 (5), jrcxz expansion @13 (9)
    expected = (bytes([0x31, 0xC0])
                + bytes([0x0F, 0x84]) + rel32(13 - 8)             # -> copy of offset 6
                + bytes([0xE9]) + rel32(0 - 13)                   # -> copy of offset 0
                + bytes([0xE3, 0x02, 0xEB, 0x05, 0xE9]) + rel32(2 - 22))  # -> copy of offset 2
    assert out == expected
    assert relocated_size(insns(code)) == len(out)


def test_branch_to_the_end_of_the_run_stays_in_place():
    code = bytes([0x75, 0x00])                                    # jnz +0 -> OLD+2 (run end)
    assert relocate(insns(code), NEW) == bytes([0x0F, 0x85]) + rel32(OLD + 2 - (NEW + 6))


def test_out_of_range_rip_relative_is_refused():
    code = bytes([0x48, 0x8B, 0x05, 0x10, 0x00, 0x00, 0x00])     # mov rax, [rip+0x10]
    with pytest.raises(RelocationError):
        relocate(insns(code), OLD - 0x9000_0000)


def test_out_of_range_call_and_jcc_are_refused():
    with pytest.raises(RelocationError):
        relocate(insns(bytes([0xE8, 0, 0x10, 0, 0])), 0xFFFF888000000000)   # call +0x1000
    with pytest.raises(RelocationError):
        relocate(insns(bytes([0x74, 0x00])), 0xFFFF888000000000)         # jz +0


def test_branch_into_the_middle_of_an_instruction_is_refused():
    code = bytes([0xEB, 0x01,                                     # jmp +1 -> OLD+3 (middle of mov)
                  0x48, 0x89, 0xE5])                              # mov rbp, rsp
    with pytest.raises(RelocationError, match="middle"):
        relocate(insns(code), NEW)


def test_non_consecutive_instructions_are_refused():
    a = insns(bytes([0x90]))
    b = insns(bytes([0x90]), OLD + 5)
    with pytest.raises(RelocationError, match="consecutive"):
        relocate(a + b, NEW)


def test_operand_size_prefixed_branch_is_refused():
    raw = bytes([0x66, 0xE9, 0x00, 0x00, 0x00, 0x00])            # o16 jmp (rel16 on AMD)
    with pytest.raises(RelocationError):
        relocate([Insn(OLD, len(raw), raw, "jmp", "", Flow.JMP, OLD + 6)], NEW)


def test_arch_object_delegates():
    code = bytes([0x75, 0x02])
    assert ARCH.relocate(insns(code), NEW) == relocate(insns(code), NEW)
    assert ARCH.jmp(OLD, NEW) == bytes([0xE9]) + rel32(NEW - OLD - 5)
    assert ARCH.short_jmp(OLD, OLD + 0x81) == bytes([0xEB, 0x7F])
    assert not ARCH.short_jmp_reaches(OLD, OLD + 0x82)
    assert not ARCH.jmp_reaches(OLD, 0xFFFF888000000000)
    assert ARCH.jmp_reaches(OLD, 0x1000)        # rip arithmetic wraps modulo 2**64


# --- same effect, in unicorn ---------------------------------------------------------------------------
CODE_OLD, CODE_NEW, DATA, STACK = 0x400000, 0x7FFF0000, 0x500000, 0x600000
HIGH_OLD = 0x7FFF12340000       # a return address there is no sign-extended imm32
# A run with a RIP-relative load, a rel8 jcc and jmp, jrcxz and loop, all landing in
# the run or at its end.  rax accumulates which paths were taken.
RUN = bytes([
    0x48, 0x8B, 0x05, 0xF9, 0xFF, 0x0F, 0x00,   # 00: mov rax, [rip+0xffff9] -> DATA
    0x48, 0x85, 0xD2,                           # 07: test rdx, rdx
    0x74, 0x04,                                 # 0a: jz +4 -> 10
    0x48, 0x83, 0xC0, 0x01,                     # 0c: add rax, 1
    0xE3, 0x06,                                 # 10: jrcxz +6 -> 18
    0x48, 0x83, 0xC0, 0x10,                     # 12: add rax, 0x10
    0xE2, 0xFA,                                 # 16: loop -6 -> 12
    0x48, 0x83, 0xF2, 0x07,                     # 18: xor rdx, 7
    0xEB, 0x00,                                 # 1c: jmp +0 -> 1e (end)
])


@settings(max_examples=40, deadline=None)
@given(rcx=st.integers(0, 20), rdx=st.integers(0, 3), value=st.integers(0, 2**64 - 1))
def test_relocated_run_has_the_same_effect(rcx, rdx, value):
    m = Machine({CODE_OLD: 0x1000, CODE_NEW: 0x1000, DATA: 0x1000, STACK: 0x1000})
    m.put64(DATA, value)
    run_insns = insns(RUN, CODE_OLD)
    end = CODE_OLD + len(RUN)
    moved = relocate(run_insns, CODE_NEW)
    moved += ARCH.jmp(CODE_NEW + len(moved), end)
    results = []
    for at, code in ((CODE_OLD, RUN), (CODE_NEW, moved)):
        m.write(at, code)
        m.set_regs({"rax": 0, "rcx": rcx, "rdx": rdx, "rsp": STACK + 0x800})
        m.uc.emu_start(at, end, count=10_000)
        regs = m.regs()
        results.append((regs["rax"], regs["rcx"], regs["rdx"]))
    assert results[0] == results[1]


# --- position-dependent encodings that must not be copied verbatim ------------------------------
@pytest.mark.parametrize(
    "code,expected_head,length,target",
    [
        (bytes([0x48, 0xEB, 0x10]), bytes([0xE9]), 3, 0x13),                     # rex.w jmp +0x10
        (bytes([0x40, 0xE9, 0x10, 0, 0, 0]), bytes([0xE9]), 6, 0x16),            # rex jmp rel32
        (bytes([0x41, 0x0F, 0x84, 0x10, 0, 0, 0]), bytes([0x0F, 0x84]), 7, 0x17),  # rex.b je rel32
        (bytes([0x48, 0x74, 0x10]), bytes([0x0F, 0x84]), 3, 0x13),               # rex.w je rel8
        (bytes([0x48, 0xE8, 0x10, 0, 0, 0]),                                     # rex.w call:
         bytes([0x68]) + (OLD + 6).to_bytes(8, "little")[:4] + bytes([0xE9]), 6, 0x16),  # push; jmp
        (bytes([0x3E, 0x48, 0xEB, 0x10]), bytes([0x3E, 0xE9]), 4, 0x14),         # ds rex.w jmp
    ],
)
def test_rex_prefixed_relative_branches_are_relocated(code, expected_head, length, target):
    out = relocate(insns(code), NEW)
    assert out == expected_head + rel32(OLD + target - (NEW + len(expected_head) + 4))


def test_rex_prefixed_jrcxz_is_expanded():
    code = bytes([0x48, 0xE3, 0x10])                              # rex.w jrcxz +0x10 -> OLD+0x13
    expected = bytes([0xE3, 0x02, 0xEB, 0x05, 0xE9]) + rel32(OLD + 0x13 - (NEW + 9))
    assert relocate(insns(code), NEW) == expected


def test_eip_relative_operand_is_rebased_modulo_4g():
    code = bytes([0x67, 0x8B, 0x05, 0x10, 0x00, 0x00, 0x00])     # mov eax, [eip+0x10]
    # the 32-bit address is the low half of OLD+7+0x10; a disp32 from NEW+7 reaches it mod 2**32
    target = (OLD + 0x17) & 0xFFFFFFFF
    disp = (target - (NEW + 7)) & 0xFFFFFFFF
    assert relocate(insns(code), NEW) == bytes([0x67, 0x8B, 0x05]) + disp.to_bytes(4, "little")


def test_sixteen_bit_xbegin_is_refused():
    raw = bytes([0x66, 0xC7, 0xF8, 0x10, 0x00])                  # xbegin rel16
    assert sum(i.size for i in decode(raw, OLD)) == len(raw)
    with pytest.raises(RelocationError, match="66-prefixed"):
        relocate(insns(raw), NEW)


def test_sixteen_bit_jcc_is_refused():
    raw = bytes([0x66, 0x0F, 0x84, 0x10, 0x00, 0x00, 0x00])      # o16 je (rel16 on AMD)
    with pytest.raises(RelocationError):
        relocate([Insn(OLD, len(raw), raw, "je", "", Flow.JCC, OLD + 0x17)], NEW)


def test_unknown_relative_branch_forms_are_refused_not_copied():
    raw = bytes([0x48, 0x66, 0xE9, 0x10, 0x00, 0x00, 0x00])      # rex before 66: rex ignored
    with pytest.raises(RelocationError):
        relocate([Insn(OLD, len(raw), raw, "jmp", "", Flow.JMP, OLD + 0x17)], NEW)


# --- calls moved out of the text: the return address stays in the text -------------------------
PUSH_RET = bytes([0x68]) + (OLD + 5).to_bytes(8, "little")[:4]  # push imm32 (sign-extended)


def test_moved_direct_call_pushes_the_original_return_address():
    code = bytes([0xE8, 0x00, 0x10, 0x00, 0x00])                  # call +0x1000 -> OLD+0x1005
    out = moved_call(insns(code)[0], NEW)
    assert out == PUSH_RET + bytes([0xE9]) + rel32(OLD + 0x1005 - (NEW + 10))


def test_moved_direct_call_out_of_rel32_reach_jumps_through_memory():
    code = bytes([0xE8, 0x00, 0x10, 0x00, 0x00])
    far = 0xFFFF888000000000
    out = moved_call(insns(code)[0], far)
    assert out == PUSH_RET + bytes([0xFF, 0x25, 0, 0, 0, 0]) + (OLD + 0x1005).to_bytes(8, "little")


def test_moved_call_with_a_return_address_above_4g_pushes_it_in_two_halves():
    at = 0x7FFF12340000                                           # a user-space-like address
    code = bytes([0xE8, 0x00, 0x10, 0x00, 0x00])
    out = moved_call(insns(code, at)[0], at + 0x100)
    ret = at + 5
    assert out == (bytes([0x48, 0x8D, 0x64, 0x24, 0xF8])           # lea rsp, [rsp-8]
                   + bytes([0xC7, 0x04, 0x24]) + (ret & 0xFFFFFFFF).to_bytes(4, "little")
                   + bytes([0xC7, 0x44, 0x24, 0x04]) + (ret >> 32).to_bytes(4, "little")
                   + bytes([0xE9]) + rel32(at + 0x1005 - (at + 0x100 + 20 + 5)))


def moved_through_memory(push: bytes, ret: int) -> bytes:
    """``moved_call``'s form of a call through memory: ``push`` (the call's operand as
    ``push m64``); ``push qword [rsp]``; ``mov qword [rsp+8], ret``; ``ret``."""
    return (push + bytes([0xFF, 0x34, 0x24])                                  # push qword [rsp]
            + bytes([0x48, 0xC7, 0x44, 0x24, 0x08]) + (ret & 0xFFFFFFFF).to_bytes(4, "little")
            + bytes([0xC3]))                                                  # ret


def test_moved_paravirt_call_pushes_the_rebased_operand():
    code = bytes([0xFF, 0x15, 0x10, 0x00, 0x00, 0x00])            # call [rip+0x10] -> OLD+0x16
    out = moved_call(insns(code)[0], NEW)
    push = bytes([0xFF, 0x35]) + rel32(OLD + 0x16 - (NEW + 6))    # push [rip -> OLD+0x16]
    assert out == moved_through_memory(push, OLD + 6)


def test_moved_eip_relative_call_pushes_the_rebased_operand():
    code = bytes([0x67, 0xFF, 0x15, 0x10, 0x00, 0x00, 0x00])      # call [eip+0x10]
    out = moved_call(insns(code)[0], NEW)
    push = bytes([0x67, 0xFF, 0x35]) + rel32(signed32(OLD + 0x17 - (NEW + 7)))
    assert out == moved_through_memory(push, OLD + 7)


def signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


@pytest.mark.parametrize(
    "code,jmp",
    [
        (bytes([0xFF, 0xD0]), bytes([0xFF, 0xE0])),                          # call rax -> jmp rax
        (bytes([0x41, 0xFF, 0xD3]), bytes([0x41, 0xFF, 0xE3])),              # call r11 -> jmp r11
        (bytes([0x3E, 0xFF, 0xD0]), bytes([0x3E, 0xFF, 0xE0])),              # notrack call rax
    ],
)
def test_moved_call_through_a_register_becomes_push_and_jmp(code, jmp):
    insn = insns(code)[0]
    push = bytes([0x68]) + (insn.end & 0xFFFFFFFF).to_bytes(4, "little")
    assert moved_call(insn, NEW) == push + jmp


@pytest.mark.parametrize(
    "code,push",
    [
        (bytes([0xFF, 0x50, 0x08]), bytes([0xFF, 0x70, 0x08])),              # call [rax+8]
        (bytes([0x41, 0xFF, 0x53, 0x10]), bytes([0x41, 0xFF, 0x73, 0x10])),  # call [r11+0x10]
        (bytes([0xFF, 0x14, 0xF5, 0x00, 0x10, 0x00, 0x81]),
         bytes([0xFF, 0x34, 0xF5, 0x00, 0x10, 0x00, 0x81])),                 # call [rsi*8 + table]
        (bytes([0x3E, 0xFF, 0x50, 0x08]), bytes([0x3E, 0xFF, 0x70, 0x08])),  # notrack call [rax+8]
        (bytes([0x65, 0xFF, 0x14, 0x25, 0x10, 0, 0, 0]),
         bytes([0x65, 0xFF, 0x34, 0x25, 0x10, 0, 0, 0])),                    # call gs:[0x10]
        # rsp-based: push computes the address from rsp before it decrements it, as the
        # call does (SDM "PUSH"): the same displacement
        (bytes([0xFF, 0x54, 0x24, 0x08]), bytes([0xFF, 0x74, 0x24, 0x08])),  # call [rsp+8]
        (bytes([0xFF, 0x14, 0x24]), bytes([0xFF, 0x34, 0x24])),              # call [rsp]
        (bytes([0xFF, 0x54, 0x24, 0x7C]), bytes([0xFF, 0x74, 0x24, 0x7C])),  # call [rsp+0x7c]
        (bytes([0xFF, 0x94, 0x24, 0x00, 0x01, 0, 0]),
         bytes([0xFF, 0xB4, 0x24, 0x00, 0x01, 0, 0])),                       # call [rsp+0x100]
        (bytes([0x67, 0xFF, 0x54, 0x24, 0x08]),
         bytes([0x67, 0xFF, 0x74, 0x24, 0x08])),                             # call [esp+8]
    ],
)
def test_moved_call_through_memory_reads_its_operand_first(code, push):
    insn = insns(code)[0]
    assert moved_call(insn, NEW) == moved_through_memory(push, insn.end)


def test_moved_call_through_memory_with_a_return_address_above_4g_stores_it_in_two_halves():
    at = 0x7FFF12340000
    code = bytes([0xFF, 0x50, 0x08])                              # call [rax+8]
    ret = at + 3
    assert moved_call(insns(code, at)[0], at + 0x100) == (
        bytes([0xFF, 0x70, 0x08, 0xFF, 0x34, 0x24])               # push [rax+8]; push [rsp]
        + bytes([0xC7, 0x44, 0x24, 0x08]) + (ret & 0xFFFFFFFF).to_bytes(4, "little")
        + bytes([0xC7, 0x44, 0x24, 0x0C]) + (ret >> 32).to_bytes(4, "little")
        + bytes([0xC3]))


@pytest.mark.parametrize(
    "code",
    [
        bytes([0xFF, 0xD4]),                                      # call rsp
        bytes([0xFF, 0x1D, 0, 0, 0, 0]),                          # lcall [rip]
        bytes([0x66, 0xFF, 0xD0]),                                # call ax
        bytes([0xF2, 0xFF, 0x50, 0x08]),                          # bnd call [rax+8]
    ],
)
def test_unmovable_calls_are_refused(code):
    decoded = list(decode(code, OLD))
    if not decoded or decoded[0].size != len(code):
        pytest.skip("not decodable in 64-bit mode")
    with pytest.raises(RelocationError):
        moved_call(decoded[0], NEW)


@settings(max_examples=30, deadline=None)
@given(reg_value=st.integers(0, 2**32 - 1), operand=st.sampled_from(["reg", "rip", "rsp"]),
       flags=st.integers(0, 2**12 - 1))
def test_moved_indirect_call_has_the_effect_of_the_call(reg_value, operand, flags):
    """Run ``call`` at its place and ``moved_call`` elsewhere: the same callee is reached
    with the same stack, holding the same (original) return address, and the same
    registers and flags."""
    m = Machine({CODE_OLD: 0x1000, CODE_NEW: 0x1000, DATA: 0x1000, STACK: 0x1000})
    callee = CODE_OLD + 0x800 + (reg_value % 0x100)
    code = {"reg": bytes([0xFF, 0xD0]),                                      # call rax
            "rip": bytes([0xFF, 0x15]) + rel32(DATA - (CODE_OLD + 6)),       # call [rip -> DATA]
            "rsp": bytes([0xFF, 0x54, 0x24, 0x10])}[operand]                 # call [rsp+0x10]
    m.put64(DATA, callee)
    regs = {"rax": callee, "rsp": STACK + 0x800, "flags": 0x2 | (flags & STATUS_FLAGS)}
    seen = []
    for at, run in ((CODE_OLD, code), (CODE_NEW, moved_call(insns(code, CODE_OLD)[0], CODE_NEW))):
        m.put64(STACK + 0x810, callee)
        out = _run_to(m, at, run, callee, regs)
        seen.append((out, m.u64(out["rsp"]), m.u64(out["rsp"] + 8)))
    assert seen[0] == seen[1]
    assert seen[0][0]["rip"] == callee and seen[0][1] == CODE_OLD + len(code)


@pytest.mark.parametrize("operand", ["rip", "reg", "table"])
@pytest.mark.parametrize("at", [CODE_OLD, HIGH_OLD], ids=["imm32", "halves"])
def test_a_moved_call_whose_operand_faults_leaves_the_stack_as_the_call_does(operand, at):
    """The read of the operand faults: neither the call nor its moved form has
    changed rsp, the flags or the stack (the moved form read before it pushed)."""
    new, unmapped = at + 0x10000, at + 0x8000
    m = Machine({at: 0x1000, new: 0x1000, STACK: 0x1000})
    code = {"rip": bytes([0xFF, 0x15]) + rel32(unmapped - (at + 6)),       # call [rip -> unmapped]
            "reg": bytes([0xFF, 0x50, 0x08]),                              # call [rax+8]
            "table": bytes([0xFF, 0x14, 0xF5]) + rel32(0x300000)}[operand]  # call [rsi*8 + table]
    regs = {"rax": unmapped, "rsi": 0x10, "rsp": STACK + 0x800, "flags": 0x2 | STATUS_FLAGS}
    seen = []
    for where, run in ((at, code), (new, moved_call(insns(code, at)[0], new))):
        m.write(STACK, bytes(0x1000))
        m.write(where, run)
        m.set_regs(regs)
        with pytest.raises(UcError) as fault:
            m.uc.emu_start(where, where + len(run), count=100)
        out = m.regs() | {"rip": m.uc.reg_read(UC_X86_REG_RIP) - where}
        seen.append((fault.value.errno, out, m.read(STACK, 0x1000)))
    assert seen[0] == seen[1]
    assert seen[0][0] == UC_ERR_EXCEPTION and seen[0][1]["rsp"] == STACK + 0x800


# --- calls inside a relocated run: the return address they leave is the original's ----------------
# frida-gum's vectors (tests/core/arch-x86/x86relocator.c): call_near_relative_to_next_instruction
# and call_near_gnu_get_pc_thunk / call_near_android_get_pc_thunk
CALL_NEXT_POP = bytes([0xE8, 0x00, 0x00, 0x00, 0x00,             # call +0
                       0x59])                                     # pop rcx
GET_PC_THUNK = bytes([0xE8, 0x01, 0x00, 0x00, 0x00,               # call +1 (the thunk)
                      0xCC,                                       # int3
                      0x8B, 0x0C, 0x24,                           # mov ecx, [rsp]
                      0xC3])                                      # ret
ANDROID_GET_PC_THUNK = GET_PC_THUNK[:6] + bytes([0x8B, 0x1C, 0x24, 0xC3])   # mov ebx, [rsp]


def test_call_to_the_next_instruction_pushes_the_original_address():
    out = relocate(insns(CALL_NEXT_POP), NEW)
    assert out == bytes([0x68]) + (OLD + 5).to_bytes(8, "little")[:4] + bytes([0x59])  # push; pop rcx
    assert relocated_size(insns(CALL_NEXT_POP)) == len(out)


def test_call_to_the_next_instruction_above_4g_pushes_it_in_two_halves():
    at = 0x7FFF12340000
    ret = at + 5
    out = relocate(insns(CALL_NEXT_POP, at), at + 0x100)
    assert out == (bytes([0x48, 0x8D, 0x64, 0x24, 0xF8])                 # lea rsp, [rsp-8]
                   + bytes([0xC7, 0x04, 0x24]) + (ret & 0xFFFFFFFF).to_bytes(4, "little")
                   + bytes([0xC7, 0x44, 0x24, 0x04]) + (ret >> 32).to_bytes(4, "little")
                   + bytes([0x59]))
    assert relocated_size(insns(CALL_NEXT_POP, at)) == len(out)


@pytest.mark.parametrize("vector", [GET_PC_THUNK, ANDROID_GET_PC_THUNK], ids=["gnu", "android"])
def test_get_pc_thunk_call_is_moved_so_the_thunk_reads_the_original_address(vector):
    call = insns(vector)[:1]                                      # frida reads the call alone
    out = relocate(call, NEW)
    assert out == (bytes([0x68]) + (OLD + 5).to_bytes(8, "little")[:4]   # push OLD+5
                   + bytes([0xE9]) + rel32(OLD + 6 - (NEW + 10)))        # jmp the thunk
    assert relocated_size(call) == len(out)


@pytest.mark.parametrize("vector", [GET_PC_THUNK, ANDROID_GET_PC_THUNK], ids=["gnu", "android"])
def test_get_pc_thunk_call_with_its_thunk_after_it_in_the_run_is_refused(vector):
    with pytest.raises(CallInsideRun, match="instructions after it"):
        relocate(insns(vector), NEW)


@pytest.mark.parametrize("code", [
    bytes([0xFF, 0xD0]),                                          # call rax
    bytes([0x41, 0xFF, 0xD3]),                                    # call r11
    bytes([0xFF, 0x15, 0x10, 0x00, 0x00, 0x00]),                  # call [rip+0x10]
    bytes([0xFF, 0x54, 0x24, 0x08]),                              # call [rsp+8]
    bytes([0xFF, 0x14, 0x24]),                                    # call [rsp]
    bytes([0xFF, 0x54, 0x24, 0x7C]),                              # call [rsp+0x7c]
    bytes([0x3E, 0xFF, 0xD0]),                                    # notrack call rax
])
def test_a_last_indirect_call_is_moved(code):
    head = bytes([0x48, 0x89, 0xF8])                              # mov rax, rdi
    run = insns(head + code)
    out = relocate(run, NEW)
    assert out == head + moved_call(run[1], NEW + len(head))
    assert relocated_size(run) == len(out)


@pytest.mark.parametrize("code", [
    bytes([0xE8, 0x00, 0x10, 0x00, 0x00, 0x90]),                  # call +0x1000; nop
    bytes([0xFF, 0xD0, 0x90]),                                    # call rax; nop
    bytes([0xFF, 0x15, 0x10, 0x00, 0x00, 0x00, 0x90]),            # call [rip+0x10]; nop
    bytes([0xE8, 0x01, 0x00, 0x00, 0x00, 0x90, 0xC3]),            # call +1 (inside the run); nop; ret
])
def test_a_call_with_instructions_after_it_is_refused(code):
    with pytest.raises(CallInsideRun):
        relocate(insns(code), NEW)
    with pytest.raises(CallInsideRun):
        relocated_size(insns(code))


@pytest.mark.parametrize("code", [
    bytes([0xFF, 0x1D, 0, 0, 0, 0]),                              # lcall [rip]
    bytes([0xFF, 0xD4]),                                          # call rsp
    bytes([0xF2, 0xFF, 0x50, 0x08]),                              # bnd call [rax+8]
])
def test_a_last_call_that_cannot_be_moved_is_refused(code):
    with pytest.raises(RelocationError):
        relocate(insns(code), NEW)


def test_a_last_call_out_of_jmp_reach_is_refused():
    with pytest.raises(RelocationError, match="reach|range"):
        relocate(insns(bytes([0xE8, 0x00, 0x10, 0x00, 0x00])), 0xFFFF888000000000)


def test_a_last_call_back_into_the_run_goes_to_the_copy():
    code = bytes([0x90,                                           # 0: nop
                  0xE8, 0xFA, 0xFF, 0xFF, 0xFF])                  # 1: call -6 -> 0 (the run's start)
    out = relocate(insns(code), NEW)
    assert out == bytes([0x90, 0x68]) + (OLD + 6).to_bytes(8, "little")[:4] + bytes([0xE9]) + rel32(-11)
    assert relocate(insns(code), NEW, first_to=NEW - 0x40)[-4:] == rel32(-0x40 - 11)


def _run_to(m: Machine, at: int, code: bytes, until: int, regs: dict[str, int]) -> dict[str, int]:
    m.write(at, code)
    m.set_regs(regs)
    m.uc.emu_start(at, until, count=100)
    return m.regs() | {"rip": m.uc.reg_read(UC_X86_REG_RIP)}


def test_relocated_get_pc_idioms_see_the_original_address_in_unicorn():
    """``call +0; pop rcx`` and a call of a get-pc thunk, at their place and relocated:
    the address each reads is the original's, and the stack is as it was."""
    m = Machine({CODE_OLD: 0x1000, CODE_NEW: 0x1000, STACK: 0x1000})
    regs = {"rcx": 0, "rsp": STACK + 0x800}
    m.write(CODE_OLD, GET_PC_THUNK)                               # the thunk stays in the text
    thunk_call = relocate(insns(GET_PC_THUNK, CODE_OLD)[:1], CODE_NEW)
    original = _run_to(m, CODE_OLD, GET_PC_THUNK[:5], CODE_OLD + 5, regs)
    moved = _run_to(m, CODE_NEW, thunk_call, CODE_OLD + 5, regs)  # returns to the text
    assert original["rcx"] == moved["rcx"] == CODE_OLD + 5
    assert original["rsp"] == moved["rsp"] == STACK + 0x800

    pop = relocate(insns(CALL_NEXT_POP, CODE_OLD + 0x100), CODE_NEW + 0x100)
    m.write(CODE_OLD + 0x100, CALL_NEXT_POP)
    original = _run_to(m, CODE_OLD + 0x100, CALL_NEXT_POP, CODE_OLD + 0x106, regs)
    moved = _run_to(m, CODE_NEW + 0x100, pop, CODE_NEW + 0x100 + len(pop), regs)
    assert original["rcx"] == moved["rcx"] == CODE_OLD + 0x105
    assert original["rsp"] == moved["rsp"] == STACK + 0x800


@pytest.mark.parametrize("call", [
    bytes([0xFF, 0xD0]),                                          # call rax
    bytes([0xFF, 0x15]) + rel32(DATA - (CODE_OLD + 3 + 6)),       # call [rip -> DATA]
    bytes([0xE8]) + rel32(0x800 - 8),                             # call CODE_OLD+0x800
])
def test_a_relocated_call_pushes_the_original_return_address_in_unicorn(call):
    """A run ending in a call, at its place and relocated: the callee is reached with
    the same stack, whose top is the original return address."""
    m = Machine({CODE_OLD: 0x1000, CODE_NEW: 0x1000, DATA: 0x1000, STACK: 0x1000})
    callee = CODE_OLD + 0x800
    m.put64(DATA, callee)
    code = bytes([0x48, 0x89, 0xF8]) + call                       # mov rax, rdi; call ...
    regs = {"rdi": callee, "rax": 0, "rsp": STACK + 0x800}
    seen = []
    for at, run in ((CODE_OLD, code), (CODE_NEW, relocate(insns(code, CODE_OLD), CODE_NEW))):
        out = _run_to(m, at, run, callee, regs)
        seen.append((out["rip"], out["rsp"], m.u64(out["rsp"]), out["rax"]))
    assert seen[0] == seen[1]
    assert seen[0][2] == CODE_OLD + len(code)
