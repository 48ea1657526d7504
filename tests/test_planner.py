"""Golden tests of the splice planner: annotated input bytes, exact expected writes and patch code."""

from __future__ import annotations

import pytest

from ksim.arch import get_arch
from ksim.arch.base import Flow
from ksim.core import Write
from ksim.errors import (
    AlreadySpliced,
    Blacklisted,
    BugSite,
    ExtableSite,
    FtraceSite,
    JumpLabelSite,
    NoSafeTactic,
    NotOnBoundary,
    OutsideText,
    OverlappingWrites,
    ProbedSite,
    StaticCallSite,
)
from ksim.splice import planner
from ksim.splice.patch import Patch

ARCH = get_arch("x86_64")
F = 0xFFFFFFFF81000000        # the function under test
P = 0xFFFFFFFF81400000        # the patch area
SNIPPET = bytes([0x90])        # stands for compiled snippet code: one nop


def func(code: bytes, *, targets: set[int] = frozenset(), name: str = "f", unknown=False):
    insns = tuple(ARCH.decode(code, F))
    assert sum(i.size for i in insns) == len(code), "test input must decode completely"
    branch = {F} | set(targets) | {i.target for i in insns if i.flow in (Flow.JMP, Flow.JCC)
                                   and i.target is not None and F <= i.target < F + len(code)}
    return planner.FunctionCode(name, F, F + len(code), insns, frozenset(branch), unknown)


def request(fc, point=F, policy="auto", **kw):
    return planner.SpliceRequest(point=point, func=fc, compile=lambda at: SNIPPET,
                                 code_address=P, policy=policy, **kw)


def rel32(src_end: int, dst: int) -> bytes:
    return (dst - src_end).to_bytes(4, "little", signed=True)


NOP5_XOR_RET = bytes([
    0x0F, 0x1F, 0x44, 0x00, 0x00,   # nop dword [rax+rax]   (5 bytes: the ftrace-style entry)
    0x31, 0xC0,                     # xor eax, eax
    0xC3,                           # ret
])


def test_jmp_over_a_five_byte_instruction():
    patch = planner.plan(ARCH, request(func(NOP5_XOR_RET), policy="jmp"))
    assert patch.tactic == "jmp"
    assert patch.writes == (Write(F, NOP5_XOR_RET[:5], b"\xe9" + rel32(F + 5, P)),)
    # snippet, the relocated nop, then jmp back to F+5
    assert patch.code == SNIPPET + NOP5_XOR_RET[:5] + b"\xe9" + rel32(P + 6 + 5, F + 5)
    assert patch.trap_site is None


PUSH_MOV_XOR = bytes([
    0x55,                           # push rbp
    0x48, 0x89, 0xE5,               # mov rbp, rsp
    0x31, 0xC0,                     # xor eax, eax
    0x5D,                           # pop rbp
    0xC3,                           # ret
])


def test_short_first_instruction_displaces_the_following_ones():
    patch = planner.plan(ARCH, request(func(PUSH_MOV_XOR), policy="jmp"))
    assert patch.tactic == "jmp+displace"
    # push+mov+xor = 6 bytes move; the jmp takes 5 and one int3 pads the sixth
    assert patch.writes == (Write(F, PUSH_MOV_XOR[:6], b"\xe9" + rel32(F + 5, P) + b"\xcc"),)
    assert patch.code == SNIPPET + PUSH_MOV_XOR[:6] + b"\xe9" + rel32(P + 7 + 5, F + 6)


LOOP_NEAR_ENTRY = bytes([
    0x31, 0xC0,                     # F+0: xor eax, eax
    0xFF, 0xC0,                     # F+2: inc eax          <- loop head, a branch target
    0x83, 0xF8, 0x0A,               # F+4: cmp eax, 10
    0x75, 0xF9,                     # F+7: jne F+2
    0xC3,                           # F+9: ret
])


def test_branch_into_the_window_refuses_jmp_and_falls_back_to_trap():
    fc = func(LOOP_NEAR_ENTRY)
    report = planner.PlanReport()
    patch = planner.plan(ARCH, request(fc), report)
    assert patch.tactic == "trap"
    assert patch.writes == (Write(F, b"\x31", b"\xcc"),)
    assert patch.trap_site == F
    assert patch.code == SNIPPET + b"\x31\xc0" + b"\xe9" + rel32(P + 3 + 5, F + 2)
    reasons = {r.tactic: r.reason for r in report.refusals}
    assert "branch lands inside" in reasons["jmp+displace"]
    assert "no free padding" in reasons["springboard"]


def test_springboard_uses_padding_within_short_reach():
    fc = func(LOOP_NEAR_ENTRY)
    pad = (F + 0x10, bytes([0x66, 0x0F, 0x1F, 0x44, 0x00, 0x00]))   # nop word [rax+rax] filler
    patch = planner.plan(ARCH, request(fc, padding=(pad,)))
    assert patch.tactic == "springboard"
    board, head = patch.writes
    assert board == Write(F + 0x10, pad[1][:5], b"\xe9" + rel32(F + 0x15, P))
    assert head == Write(F, b"\x31\xc0", b"\xeb\x0e")          # jmp short F+0x10
    assert [w.address for w in patch.undo] == [F, F + 0x10]     # head restored first


def test_jmp_policy_refuses_with_every_reason():
    with pytest.raises(NoSafeTactic) as exc:
        planner.plan(ARCH, request(func(LOOP_NEAR_ENTRY), policy="jmp"))
    assert set(exc.value.reasons) == {"jmp", "jmp+displace", "springboard"}


def test_window_may_not_run_past_a_ret():
    code = bytes([0x31, 0xC0, 0xC3,  # xor eax,eax; ret   (a 3-byte function)
                  ])
    with pytest.raises(NoSafeTactic) as exc:
        planner.plan(ARCH, request(func(code), policy="jmp"))
    assert "past" in exc.value.reasons["jmp+displace"]


def test_rip_relative_first_instruction_is_relocated():
    code = bytes([
        0x8B, 0x05, 0x10, 0x00, 0x00, 0x00,   # mov eax, [rip+0x10]  -> F+0x16
        0xC3,                                 # ret
    ])
    patch = planner.plan(ARCH, request(func(code), policy="jmp"))
    moved = patch.code[len(SNIPPET):len(SNIPPET) + 6]
    assert moved == bytes([0x8B, 0x05]) + rel32(P + 1 + 6, F + 0x16)


def test_refusals_before_tactics():
    fc = func(NOP5_XOR_RET)
    with pytest.raises(NotOnBoundary):
        planner.plan(ARCH, request(fc, point=F + 1))
    with pytest.raises(OutsideText):
        planner.plan(ARCH, request(fc, point=F + 100))
    with pytest.raises(Blacklisted):
        planner.plan(ARCH, request(fc, blacklist=((F, F + 8),)))
    with pytest.raises(AlreadySpliced):
        planner.plan(ARCH, request(fc, busy=frozenset({F})))


def test_window_overlapping_another_splice_is_refused():
    fc = func(PUSH_MOV_XOR)
    report = planner.PlanReport()
    patch = planner.plan(ARCH, request(fc, busy=frozenset({F + 4})), report)
    assert patch.tactic in ("springboard", "trap")
    assert "overlaps another splice" in {r.tactic: r.reason for r in report.refusals}["jmp+displace"]


def test_unknown_indirect_jump_forbids_displacement_but_not_single_jmp():
    assert planner.plan(ARCH, request(func(NOP5_XOR_RET, unknown=True), policy="jmp")).tactic == "jmp"
    with pytest.raises(NoSafeTactic):
        planner.plan(ARCH, request(func(PUSH_MOV_XOR, unknown=True), policy="jmp"))


def test_same_request_same_bytes():
    a = planner.plan(ARCH, request(func(PUSH_MOV_XOR)))
    b = planner.plan(ARCH, request(func(PUSH_MOV_XOR)))
    assert a == b


def test_a_one_byte_function_takes_a_jmp_over_its_trailing_filler():
    fc = func(bytes([0xC3]))                                    # ret
    fc = planner.FunctionCode(fc.name, fc.start, fc.end, fc.insns, fc.branch_targets,
                              tail=bytes([0x66, 0x0F, 0x1F, 0x44, 0x00, 0x00]))  # nop filler
    patch = planner.plan(ARCH, request(fc, policy="jmp"))
    assert patch.tactic == "jmp"
    assert patch.writes == (Write(F, bytes([0xC3, 0x66, 0x0F, 0x1F, 0x44]),
                                  b"\xe9" + rel32(F + 5, P)),)
    assert patch.code == SNIPPET + b"\xc3" + b"\xe9" + rel32(P + 2 + 5, F + 1)
    # ... but not when a springboard already uses that filler
    with pytest.raises(NoSafeTactic):
        planner.plan(ARCH, request(fc, policy="jmp", busy=frozenset({F + 3})))


def test_a_moved_call_returns_to_the_original_text_not_the_patch():
    code = bytes([
        0xE8, 0x0B, 0x00, 0x00, 0x00,   # F+0: call F+0x10
        0xC3,                           # F+5: ret
    ])
    patch = planner.plan(ARCH, request(func(code), policy="jmp"))
    # push F+5 (sign-extended imm32); jmp F+0x10 -- and no jump back: the callee returns to F+5
    assert patch.code == SNIPPET + b"\x68" + (F + 5 & 0xFFFFFFFF).to_bytes(4, "little") \
        + b"\xe9" + rel32(P + 1 + 5 + 5, F + 0x10)
    trap = planner.plan(ARCH, request(func(code), policy="trap"))
    assert trap.code == patch.code


# --- indirect calls: the callee returns to the text, never into the patch ------------------------
PV_CALL = bytes([
    0xFF, 0x15, 0x10, 0x00, 0x00, 0x00,   # F+0: call [rip+0x10]   (a paravirt call through pv_ops)
    0xC3,                                 # F+6: ret
])


@pytest.mark.parametrize("policy", ["jmp", "trap"])
def test_indirect_call_at_the_point_is_moved_reading_its_operand_first(policy):
    patch = planner.plan(ARCH, request(func(PV_CALL), policy=policy))
    push_mem = b"\xff\x35" + rel32(P + 1 + 6, F + 0x16)       # push [rip -> F+0x16]
    push_top = b"\xff\x34\x24"                                # push qword [rsp]
    ret_addr = b"\x48\xc7\x44\x24\x08" + (F + 6).to_bytes(8, "little")[:4]  # mov [rsp+8], F+6
    # ret: to the callee; no jump back: the callee returns to F+6
    assert patch.code == SNIPPET + push_mem + push_top + ret_addr + b"\xc3"


CALL_REG_AFTER_SHORT = bytes([
    0x55,                   # F+0: push rbp
    0x41, 0xFF, 0xD3,       # F+1: call r11
    0x5D,                   # F+4: pop rbp
    0xC3,                   # F+5: ret
])


def test_a_call_with_instructions_after_it_in_the_window_is_refused():
    fc = func(CALL_REG_AFTER_SHORT)
    report = planner.PlanReport()
    with pytest.raises(NoSafeTactic):
        planner.plan(ARCH, request(fc, policy="jmp+displace"), report)
    assert "call would be displaced" in report.refusals[0].reason


CALL_REG_LAST = bytes([
    0x55,                   # F+0: push rbp
    0x48, 0x89, 0xE5,       # F+1: mov rbp, rsp
    0xFF, 0xD0,             # F+4: call rax         <- the window's last instruction
    0x5D,                   # F+6: pop rbp
    0xC3,                   # F+7: ret
])


def test_indirect_call_ending_a_window_returns_after_the_window():
    patch = planner.plan(ARCH, request(func(CALL_REG_LAST), policy="jmp"))
    assert patch.tactic == "jmp+displace"
    assert patch.writes == (Write(F, CALL_REG_LAST[:6], b"\xe9" + rel32(F + 5, P) + b"\xcc"),)
    push = b"\x68" + (F + 6).to_bytes(8, "little")[:4]
    assert patch.code == SNIPPET + CALL_REG_LAST[:4] + push + b"\xff\xe0"


# --- instructions the kernel finds by address are never moved ---------------------------------
WARN_BEHIND = bytes([
    0x31, 0xC0,             # F+0: xor eax, eax
    0x0F, 0x0B,             # F+2: ud2             <- a WARN site (__bug_table)
    0xC3,                   # F+4: ret
    0xCC, 0xCC, 0xCC,
])


def test_a_window_over_a_warn_site_is_refused_and_trap_leaves_it_in_place():
    fc = func(WARN_BEHIND[:5])
    fc = planner.FunctionCode(fc.name, fc.start, fc.end, fc.insns, fc.branch_targets,
                              tail=WARN_BEHIND[5:], hazards={F + 2: frozenset({"warn"})})
    report = planner.PlanReport()
    patch = planner.plan(ARCH, request(fc, policy="auto"), report)
    assert patch.tactic == "trap"
    assert "WARN site" in report.refusals[0].reason
    assert patch.writes == (Write(F, b"\x31", b"\xcc"),)


@pytest.mark.parametrize("hazard,error", [
    ("warn", BugSite), ("bug", BugSite), ("extable", ExtableSite), ("ftrace", FtraceSite),
    ("jump_label", JumpLabelSite), ("static_call", StaticCallSite), ("kprobe", ProbedSite),
    ("blacklist", Blacklisted),
])
def test_a_hazard_at_the_point_refuses_it_with_its_own_error(hazard, error):
    fc = func(WARN_BEHIND[:5])
    fc = planner.FunctionCode(fc.name, fc.start, fc.end, fc.insns, fc.branch_targets,
                              hazards={F + 2: frozenset({hazard})})
    for policy in ("auto", "jmp", "trap"):
        with pytest.raises(error, match="never overwrites or moves"):
            planner.plan(ARCH, request(fc, point=F + 2, policy=policy))


def test_a_breakpoint_that_is_not_ours_is_never_moved():
    fc = func(bytes([0xCC, 0x31, 0xC0, 0xC3]))
    with pytest.raises(ProbedSite):
        planner.plan(ARCH, request(fc, policy="trap"))


# --- a plan's writes never overlap -------------------------------------------------------------
def test_springboard_slot_is_never_inside_its_own_window():
    # a 1-byte ret function whose 2-byte short jump spills into the filler after it:
    # the first padding slot starts inside that spill
    fc = func(bytes([0xC3]))
    fc = planner.FunctionCode(fc.name, fc.start, fc.end, fc.insns, fc.branch_targets,
                              tail=bytes([0xCC] * 15))
    padding = ((F + 1, bytes([0xCC] * 5)), (F + 6, bytes([0xCC] * 5)))
    patch = planner.plan(ARCH, request(fc, policy="springboard", padding=padding))
    board, head = patch.writes
    assert board.address == F + 6
    assert head == Write(F, b"\xc3\xcc", b"\xeb" + bytes([4]))


def test_a_patch_with_overlapping_writes_cannot_be_built():
    with pytest.raises(OverlappingWrites):
        Patch(F, "springboard", P, b"", (Write(F + 1, b"\xcc" * 5, b"\xe9" + bytes(4)),
                                         Write(F, b"\xc3\xcc", b"\xeb\xff")))


LOOP_AT_THE_POINT = bytes([
    0x48, 0xFF, 0xC8,       # F+0: dec rax        <- the point, a loop head
    0x75, 0xFB,             # F+3: jne F+0        (inside the 5-byte window)
    0xC3,                   # F+5: ret
])


@pytest.mark.parametrize("policy", ["jmp", "trap"])
def test_a_loop_back_to_the_point_runs_the_snippets_again(policy):
    fc = func(LOOP_AT_THE_POINT)
    patch = planner.plan(ARCH, request(fc, policy=policy))
    if policy == "jmp":
        assert patch.tactic == "jmp+displace"
        # snippet; dec rax; jne -> the patch's entry (not the copy of dec); jmp back to F+5
        assert patch.code == (SNIPPET + LOOP_AT_THE_POINT[:3] + b"\x0f\x85" + rel32(P + 10, P)
                              + b"\xe9" + rel32(P + 15, F + 5))
    else:
        assert patch.code == SNIPPET + LOOP_AT_THE_POINT[:3] + b"\xe9" + rel32(P + 9, F + 3)


# --- batches: points that share padding --------------------------------------------------------
def _loop_at(base: int, name: str) -> planner.FunctionCode:
    """LOOP_NEAR_ENTRY at ``base``: only a springboard (or the trap) splices its entry."""
    insns = tuple(ARCH.decode(LOOP_NEAR_ENTRY, base))
    return planner.FunctionCode(name, base, base + len(LOOP_NEAR_ENTRY), insns,
                                frozenset({base, base + 2}), False)


def _at(fc: planner.FunctionCode, policy: str, *padding: tuple[int, bytes]) -> planner.SpliceRequest:
    return planner.SpliceRequest(point=fc.start, func=fc, compile=lambda at: SNIPPET,
                                 code_address=P, policy=policy, padding=padding)


SHARED = (F + 0x20, bytes([0xCC] * 5))   # reached from F and from F + 0x40
OWN = (F - 0x60, bytes([0xCC] * 5))      # reached from F only


def test_a_batch_leaves_the_only_slot_a_later_point_reaches_to_it():
    first, second = _loop_at(F, "f"), _loop_at(F + 0x40, "g")
    reqs = [_at(first, "jmp", SHARED, OWN), _at(second, "jmp", SHARED)]
    # alone, each takes the shared slot (the first it lists)
    assert all(planner.plan(ARCH, r).writes[0].address == SHARED[0] for r in reqs)
    patches, refused = planner.plan_batch(ARCH, reqs, [64, 64], P, frozenset())
    assert refused == {}
    a, b = patches
    assert a is not None and b is not None
    assert a.writes[0] == Write(OWN[0], OWN[1], b"\xe9" + rel32(OWN[0] + 5, P))
    assert b.writes[0] == Write(SHARED[0], SHARED[1], b"\xe9" + rel32(SHARED[0] + 5, P + 64))
    assert (a.code_address, b.code_address) == (P, P + 64)


def test_a_batch_with_more_springboards_than_slots_traps_or_refuses_the_rest():
    fs = [_loop_at(F, "f"), _loop_at(F + 0x40, "g"), _loop_at(F + 0x50, "h")]
    auto = [_at(f, "auto", SHARED) for f in fs]
    patches, refused = planner.plan_batch(ARCH, auto, [64] * 3, P, frozenset())
    assert refused == {}
    assert [p.tactic for p in patches if p is not None] == ["springboard", "trap", "trap"]
    jmp = [_at(f, "jmp", SHARED) for f in fs]
    patches, refused = planner.plan_batch(ARCH, jmp, [64] * 3, P, frozenset())
    assert sorted(refused) == [1, 2] and patches[1] is None and patches[2] is None
    assert "the batch's other springboards hold every slot it reaches" in str(refused[1])
