"""AArch64 relocator: exact relocated words for every PC-relative form, in reach
and grown, forward and backward; refusals; and the same effect in unicorn."""

from __future__ import annotations

import random

import capstone
import keystone
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_aarch64_machine import GPRS, NZCV_MASK, Machine

from ksim.arch.aarch64 import ARCH
from ksim.arch.aarch64.reader import decode
from ksim.arch.aarch64.relocator import moved_call, relocate, relocated_size
from ksim.arch.aarch64.writer import Writer
from ksim.arch.base import Insn
from ksim.errors import CallInsideRun, RelocationError

OLD = 0xFFFF800010000000
KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
NEAR = OLD + 256 * KB          # beyond TBZ's +-32 KB, within +-1 MB
MID = OLD + 64 * MB            # beyond +-1 MB, within B's +-128 MB
FAR = OLD + 1 * GB             # beyond B, within ADRP's +-4 GB
VFAR = OLD + 64 * GB           # beyond ADRP

_ks = keystone.Ks(keystone.KS_ARCH_ARM64, keystone.KS_MODE_LITTLE_ENDIAN)
_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)


def asm(src: str, at: int) -> bytes:
    return bytes(_ks.asm(src, at)[0])


def text(code: bytes, at: int) -> list[str]:
    return [f"{i.mnemonic} {i.op_str}".strip() for i in _cs.disasm(code, at)]


def insns(code: bytes | str, at: int = OLD) -> list[Insn]:
    raw = bytes.fromhex(code) if isinstance(code, str) else code
    out = list(decode(raw, at))
    assert sum(i.size for i in out) == len(raw), "test input must decode completely"
    return out


def adr(rd: int, at: int, target: int) -> bytes:
    """ADR Xd (Arm ARM C6.2.10): immlo in bits 30:29, immhi in 23:5 (keystone
    mis-encodes ADR to an absolute address)."""
    imm = (target - at) & 0x1FFFFF
    return (0x10000000 | (imm & 3) << 29 | (imm >> 2) << 5 | rd).to_bytes(4, "little")


def kmov(reg: str, low: int) -> str:
    """The shortest constant load of OLD + ``low`` (0xffff_8000_1000_xxxx): MOVN when
    more halfwords are 0xffff than 0, else MOVZ (see writer.mov_imm_words)."""
    if low == 0:
        return (f"movz {reg}, #0x1000, lsl #16; movk {reg}, #0x8000, lsl #32; "
                f"movk {reg}, #0xffff, lsl #48")
    return f"movn {reg}, #{~low & 0xFFFF:#x}; movk {reg}, #0x1000, lsl #16; movk {reg}, #0x8000, lsl #32"


# --- copied ------------------------------------------------------------------------------------
def test_position_independent_instructions_are_copied():
    code = asm("stp x29, x30, [sp, #-16]!; mov x29, sp; ldr x0, [x1, #8]; "
               "add x0, x0, #1; cmp x0, #3; csel x0, x0, x2, ne; ldp x29, x30, [sp], #16; "
               "br x3; ret", OLD)
    assert relocate(insns(code), FAR) == code


# --- B and BL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("new", [NEAR, MID, OLD - 100 * MB])
@pytest.mark.parametrize("target", [OLD + 0x100, OLD - 0x1000])
def test_b_recomputed(new, target):
    code = asm(f"b #{target:#x}", OLD)
    assert relocate(insns(code), new) == asm(f"b #{target:#x}", new)


def test_b_out_of_reach_is_refused():
    code = asm(f"b #{OLD + 0x100:#x}", OLD)
    with pytest.raises(RelocationError, match="b #"):
        relocate(insns(code), FAR)


# A call leaves its return address in x30: relocated, the run's last call sets x30 to
# the original return address and branches (moved_call); BL .+4 only sets x30.
@pytest.mark.parametrize("target", [OLD + 0x100, OLD - 0x1000])
def test_a_last_bl_sets_the_original_return_address_and_branches(target):
    code = asm(f"bl #{target:#x}", OLD)
    expected = asm(kmov("x30", 4) + f"; b #{target:#x}", MID)    # x30 = OLD+4: beyond ADR
    assert relocate(insns(code), MID) == expected == moved_call(insns(code)[0], MID)
    near = relocate(insns(code), NEAR)
    assert near == adr(30, NEAR, OLD + 4) + asm(f"b #{target:#x}", NEAR + 4)
    assert relocated_size(insns(code), MID) == len(expected)


@pytest.mark.parametrize("new", [FAR, VFAR])
def test_a_last_bl_out_of_reach_branches_through_x16(new):
    target = OLD + 0x100
    code = asm(f"bl #{target:#x}", OLD)
    expected = asm(kmov("x30", 4) + "; " + kmov("x16", 0x100) + "; br x16", new)
    assert relocate(insns(code), new) == expected


def test_a_last_blr_is_moved():
    code = asm("add x4, x4, #8; blr x4", OLD)
    out = relocate(insns(code), NEAR)
    assert out == code[:4] + moved_call(insns(code)[1], NEAR + 4)
    assert text(out, NEAR)[1:] == ["mov x16, x4", f"adr x30, #{OLD + 8:#x}", "br x16"]
    assert relocated_size(insns(code), NEAR) == len(out)


@pytest.mark.parametrize("new", [NEAR, FAR])
def test_bl_to_the_next_instruction_sets_x30_to_the_original_address(new):
    code = asm(f"bl #{OLD + 4:#x}; mov x0, x30", OLD)              # the get-pc idiom
    out = relocate(insns(code), new)
    if new == NEAR:
        assert out == adr(30, NEAR, OLD + 4) + code[4:]
    else:
        assert out == asm(kmov("x30", 4) + "; mov x0, x30", new)
    assert relocated_size(insns(code), new) == len(out)


@pytest.mark.parametrize("code", [
    f"bl #{OLD + 0x100:#x}; nop",
    "blr x4; nop",
    f"bl #{OLD + 8:#x}; nop; ret",                                # a local call into the run
    "22083fd7; 1f2003d5",                                         # blraa x1, x2; nop
])
def test_a_call_with_instructions_after_it_is_refused(code):
    raw = (b"".join(bytes.fromhex(w) for w in code.split("; ")) if code[0].isdigit()
           else asm(code, OLD))
    with pytest.raises(CallInsideRun, match="instructions after it"):
        relocate(insns(raw), NEAR)


# --- conditional branches --------------------------------------------------------------------------
@pytest.mark.parametrize("cond,inverse", [("eq", "ne"), ("ne", "eq"), ("hs", "lo"), ("lt", "ge"),
                                          ("gt", "le"), ("mi", "pl"), ("vs", "vc"), ("hi", "ls")])
@pytest.mark.parametrize("target", [OLD + 0x100, OLD - 0x1000])
def test_b_cond_in_reach_and_grown(cond, inverse, target):
    code = asm(f"b.{cond} #{target:#x}", OLD)
    assert relocate(insns(code), NEAR) == asm(f"b.{cond} #{target:#x}", NEAR)
    # beyond +-1 MB: the opposite condition over a B
    assert relocate(insns(code), MID) == asm(f"b.{inverse} #{MID + 8:#x}; b #{target:#x}", MID)


@pytest.mark.parametrize("hexword", ["0e080054", "0f080054"])   # b.al / b.nv .+0x100
def test_always_taken_conditions_grow_to_a_plain_b(hexword):
    assert relocate(insns(hexword), NEAR) == asm(f"b.{'al' if hexword[1] == 'e' else 'nv'} "
                                                  f"#{OLD + 0x100:#x}", NEAR)
    assert relocate(insns(hexword), MID) == asm(f"b #{OLD + 0x100:#x}", MID)


@pytest.mark.parametrize("op,inverse,reg", [("cbz", "cbnz", "w3"), ("cbnz", "cbz", "x3"),
                                            ("cbz", "cbnz", "x30")])
@pytest.mark.parametrize("target", [OLD + 0x100, OLD - 0x1000])
def test_cbz_in_reach_and_grown(op, inverse, reg, target):
    code = asm(f"{op} {reg}, #{target:#x}", OLD)
    assert relocate(insns(code), NEAR) == asm(f"{op} {reg}, #{target:#x}", NEAR)
    assert relocate(insns(code), MID) == asm(f"{inverse} {reg}, #{MID + 8:#x}; b #{target:#x}", MID)


@pytest.mark.parametrize("op,inverse,reg,bit", [("tbz", "tbnz", "w3", 5), ("tbnz", "tbz", "x3", 40),
                                                ("tbz", "tbnz", "x0", 63)])
@pytest.mark.parametrize("target", [OLD + 0x100, OLD - 0x1000])
def test_tbz_in_reach_and_grown(op, inverse, reg, bit, target):
    code = asm(f"{op} {reg}, #{bit}, #{target:#x}", OLD)
    near = OLD + 16 * KB
    assert relocate(insns(code), near) == asm(f"{op} {reg}, #{bit}, #{target:#x}", near)
    # beyond +-32 KB (already at NEAR)
    assert relocate(insns(code), NEAR) == asm(
        f"{inverse} {reg}, #{bit}, #{NEAR + 8:#x}; b #{target:#x}", NEAR)


def test_grown_conditional_branch_out_of_b_reach_is_refused():
    code = asm(f"cbz x0, #{OLD + 0x100:#x}", OLD)
    with pytest.raises(RelocationError, match="cbz x0"):
        relocate(insns(code), FAR)


# --- ADR and ADRP ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref", [OLD + 0x123, OLD - 0x7FF])
def test_adr_in_reach(ref):
    code = adr(1, OLD, ref)
    assert relocate(insns(code), NEAR) == adr(1, NEAR, ref)
    assert text(relocate(insns(code), NEAR), NEAR) == [f"adr x1, #{ref:#x}"]


@pytest.mark.parametrize("ref", [OLD + 0x123, OLD - 0x7FF])
def test_adr_grows_to_adrp_add(ref):
    code = adr(7, OLD, ref)
    expected = asm(f"adrp x7, #{ref & ~0xFFF:#x}; add x7, x7, #{ref & 0xFFF:#x}", FAR)
    assert relocate(insns(code), FAR) == expected


def test_adr_beyond_adrp_reach_becomes_a_constant():
    ref = OLD + 0x123
    expected = asm(kmov("x7", 0x123), VFAR)
    assert relocate(insns(adr(7, OLD, ref)), VFAR) == expected


@pytest.mark.parametrize("page", [OLD + 0x5000, OLD - 0xFFFF_0000, OLD + 0xFFFF_F000])
def test_adrp_recomputes_its_page_delta(page):
    code = asm(f"adrp x2, #{page:#x}", OLD)
    new = OLD + 0x7000
    assert relocate(insns(code), new) == asm(f"adrp x2, #{page:#x}", new)


def test_adrp_from_inside_a_page_recomputes_from_the_new_page():
    code = asm(f"adrp x2, #{OLD + 0x5000:#x}", OLD + 0xFFC)
    new = FAR + 0x804                                     # a different offset in its page
    assert relocate(insns(code, OLD + 0xFFC), new) == asm(f"adrp x2, #{OLD + 0x5000:#x}", new)


def test_adrp_beyond_reach_becomes_a_constant():
    code = asm(f"adrp x2, #{OLD + 0x5000:#x}", OLD)
    assert relocate(insns(code), VFAR) == asm(kmov("x2", 0x5000), VFAR)
    assert relocate(insns(code), OLD + 5 * GB) == asm(kmov("x2", 0x5000), OLD + 5 * GB)
    code = asm(f"adrp x2, #{OLD:#x}", OLD)
    assert relocate(insns(code), VFAR) == asm(kmov("x2", 0), VFAR)


# --- literal loads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", ["ldr x1, #{t:#x}", "ldr w1, #{t:#x}", "ldrsw x1, #{t:#x}",
                                 "prfm pldl1keep, #{t:#x}", "prfm pstl2strm, #{t:#x}"])
@pytest.mark.parametrize("ref", [OLD + 0x400, OLD - 0x1004])
def test_literal_loads_in_reach(src, ref):
    code = asm(src.format(t=ref), OLD)
    assert relocate(insns(code), NEAR) == asm(src.format(t=ref), NEAR)


@pytest.mark.parametrize("src,load", [
    ("ldr x1, #{t:#x}", "ldr x1, [x1, #{lo:#x}]"),
    ("ldr w1, #{t:#x}", "ldr w1, [x1, #{lo:#x}]"),
    ("ldrsw x1, #{t:#x}", "ldrsw x1, [x1, #{lo:#x}]"),
])
def test_literal_loads_grow_to_adrp_and_a_load_through_the_destination(src, load):
    ref = OLD + 0x5408                                    # aligned for every size
    code = asm(src.format(t=ref), OLD)
    expected = asm(f"adrp x1, #{OLD + 0x5000:#x}; " + load.format(lo=0x408), FAR)
    assert relocate(insns(code), FAR) == expected


def test_literal_ldr_x_at_an_odd_word_adds_its_offset_first():
    ref = OLD + 0x5404                                    # 4 mod 8: no scaled offset for a load of 8
    code = asm(f"ldr x9, #{ref:#x}", OLD)
    expected = asm(f"adrp x9, #{OLD + 0x5000:#x}; add x9, x9, #0x404; ldr x9, [x9]", FAR)
    assert relocate(insns(code), FAR) == expected
    # a 4-byte load there is aligned
    code = asm(f"ldr w9, #{ref:#x}", OLD)
    assert relocate(insns(code), FAR) == asm(f"adrp x9, #{OLD + 0x5000:#x}; ldr w9, [x9, #0x404]", FAR)


@pytest.mark.parametrize("src,load", [("ldr x1, #{t:#x}", "ldr x1, [x1]"),
                                      ("ldr w1, #{t:#x}", "ldr w1, [x1]"),
                                      ("ldrsw x1, #{t:#x}", "ldrsw x1, [x1]")])
def test_literal_loads_beyond_adrp_reach_load_through_a_constant(src, load):
    ref = OLD + 0x400
    code = asm(src.format(t=ref), OLD)
    expected = asm(kmov("x1", 0x400) + "; " + load, VFAR)
    assert relocate(insns(code), VFAR) == expected


@pytest.mark.parametrize("new", [MID, FAR, VFAR])
def test_prefetch_out_of_reach_becomes_a_nop(new):
    code = asm(f"prfm pldl1keep, #{OLD + 0x400:#x}", OLD)
    assert relocate(insns(code), new) == asm("nop", new)


@pytest.mark.parametrize("hexword", ["0108009c", "0108005c", "0108001c"])   # ldr q1/d1/s1, .+0x100
def test_simd_literal_loads_move_in_reach_and_are_refused_beyond(hexword):
    out = relocate(insns(hexword), NEAR)
    assert text(out, NEAR)[0].endswith(f"#{OLD + 0x100:#x}")
    with pytest.raises(RelocationError, match="ldr"):
        relocate(insns(hexword), MID)


def test_results_into_the_zero_register():
    # ADR/ADRP XZR compute nothing: a NOP out of reach; LDR XZR still loads (it may
    # fault) and has no register to build the address in: refused out of reach
    assert relocate(insns(adr(31, OLD, OLD + 0x40)), NEAR) == adr(31, NEAR, OLD + 0x40)
    assert relocate(insns(adr(31, OLD, OLD + 0x40)), MID) == asm("nop", MID)
    assert relocate(insns("3f0000b0"), VFAR) == asm("nop", VFAR)      # adrp xzr, .+1 page
    code = bytes.fromhex("1f080058")                                  # ldr xzr, .+0x100
    assert text(relocate(insns(code), NEAR), NEAR) == [f"ldr xzr, #{OLD + 0x100:#x}"]
    with pytest.raises(RelocationError, match="ldr xzr"):
        relocate(insns(code), MID)


# --- runs ----------------------------------------------------------------------------------------------
def test_branches_inside_the_run_go_to_the_copy():
    code = asm(f"mov x0, #0; "                            # 0
               f"cbz x1, #{OLD + 12:#x}; "                 # 4  -> 12 (inside)
               f"b #{OLD:#x}; "                            # 8  -> 0  (inside)
               f"tbnz x2, #3, #{OLD + 4:#x}; "             # 12 -> 4  (inside)
               f"b.eq #{OLD + 20:#x}", OLD)                # 16 -> 20 (the run's end: outside)
    new = FAR                                              # internal branches always reach
    with pytest.raises(RelocationError):
        relocate(insns(code), new)                         # but b.eq to the end does not
    new = MID
    expected = asm(f"mov x0, #0; cbz x1, #{new + 12:#x}; b #{new:#x}; tbnz x2, #3, #{new + 4:#x}; "
                   f"b.ne #{new + 24:#x}; b #{OLD + 20:#x}", new)
    assert relocate(insns(code), new) == expected
    assert relocated_size(insns(code), new) == len(expected)


def test_internal_branches_at_any_distance():
    code = asm(f"cbz x1, #{OLD + 8:#x}; add x0, x0, #1; tbz x0, #0, #{OLD:#x}", OLD)
    for new in (NEAR, FAR, VFAR):
        assert relocate(insns(code), new) == asm(
            f"cbz x1, #{new + 8:#x}; add x0, x0, #1; tbz x0, #0, #{new:#x}", new)


def test_a_grown_branch_moves_the_copies_after_it():
    code = asm(f"b.ne #{OLD + 0x100:#x}; "                 # 0: grows to 8 bytes at MID
               f"cbz x0, #{OLD + 12:#x}; "                 # 4 -> 12 (its copy moves by 4)
               f"add x0, x0, #1; "                         # 8
               f"tbz x0, #1, #{OLD + 4:#x}", OLD)          # 12 -> 4
    expected = asm(f"b.eq #{MID + 8:#x}; b #{OLD + 0x100:#x}; cbz x0, #{MID + 16:#x}; "
                   f"add x0, x0, #1; tbz x0, #1, #{MID + 8:#x}", MID)
    assert relocate(insns(code), MID) == expected


def test_branches_to_the_first_instruction_go_to_first_to():
    entry = MID - 0x40
    code = asm(f"sub x0, x0, #1; cbnz x0, #{OLD:#x}; b.ne #{OLD:#x}; b #{OLD + 4:#x}", OLD)
    expected = asm(f"sub x0, x0, #1; cbnz x0, #{entry:#x}; b.ne #{entry:#x}; b #{MID + 4:#x}", MID)
    assert relocate(insns(code), MID, first_to=entry) == expected
    assert relocate(insns(code), MID) == asm(
        f"sub x0, x0, #1; cbnz x0, #{MID:#x}; b.ne #{MID:#x}; b #{MID + 4:#x}", MID)


def test_first_to_out_of_short_reach_grows():
    entry = OLD                                            # the patch entry is far from the copy
    code = asm(f"nop; cbnz x0, #{OLD:#x}", OLD)
    assert relocate(insns(code), MID, first_to=entry) == asm(
        f"nop; cbz x0, #{MID + 12:#x}; b #{entry:#x}", MID)


def test_bl_to_the_first_instruction_with_a_far_first_to_branches_through_x16():
    code = asm(f"nop; bl #{OLD:#x}", OLD)
    out = relocate(insns(code), FAR, first_to=OLD + 0x40)
    assert out == asm("nop; " + kmov("x30", 8) + "; " + kmov("x16", 0x40) + "; br x16", FAR)


def test_bl_to_the_first_instruction_goes_to_its_copy():
    code = asm(f"nop; bl #{OLD:#x}", OLD)
    assert relocate(insns(code), MID) == asm("nop; " + kmov("x30", 8) + f"; b #{MID:#x}", MID)


# --- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hexword,name", [
    ("417c5fc8", "ldxr"),       # ldxr x1, [x2]
    ("41fc5f88", "ldaxr"),      # ldaxr w1, [x2]
    ("417c03c8", "stxr"),       # stxr w3, x1, [x2]
    ("41fc0388", "stlxr"),      # stlxr w3, w1, [x2]
    ("417c5f08", "ldxrb"),      # ldxrb w1, [x2]
    ("627c0148", "stxrh"),      # stxrh w1, w2, [x3]
    ("61087fc8", "ldxp"),       # ldxp x1, x2, [x3]
    ("61887fc8", "ldaxp"),      # ldaxp x1, x2, [x3]
    ("618824c8", "stlxp"),      # stlxp w4, x1, x2, [x3]
])
def test_exclusive_loads_and_stores_are_refused(hexword, name):
    run = insns("1f2003d5" + hexword)                     # nop; the exclusive
    with pytest.raises(RelocationError, match=f"{name} .*exclusive monitor"):
        relocate(run, NEAR)


def test_non_consecutive_instructions_are_refused():
    a = insns("1f2003d5")
    b = insns("1f2003d5", OLD + 8)
    with pytest.raises(RelocationError, match="consecutive"):
        relocate(a + b, NEAR)


def test_misaligned_destination_is_refused():
    with pytest.raises(RelocationError, match="aligned"):
        relocate(insns("1f2003d5"), NEAR + 2)


def test_instructions_that_are_not_one_word_are_refused():
    raw = bytes.fromhex("1f2003d5")
    with pytest.raises(RelocationError):
        relocate([Insn(OLD, 2, raw[:2], "nop", "")], NEAR)


def test_empty_run():
    assert relocate([], NEAR) == b""
    assert relocated_size([], NEAR) == 0


# --- calls moved out of the text: the return address stays in the text -------------------------------
def test_moved_bl_sets_x30_with_adr_and_branches():
    call = insns(asm(f"bl #{OLD + 0x1000:#x}", OLD))[0]
    new = OLD + 0x8_0000                                  # the return address is within ADR reach
    out = moved_call(call, new)
    assert out == adr(30, new, OLD + 4) + asm(f"b #{OLD + 0x1000:#x}", new + 4)


def test_moved_bl_far_from_the_text_builds_x30():
    call = insns(asm(f"bl #{OLD + 0x1000:#x}", OLD))[0]
    out = moved_call(call, MID)
    assert out == asm(kmov("x30", 4) + f"; b #{OLD + 0x1000:#x}", MID)


def test_moved_bl_beyond_b_reach_branches_through_x16():
    call = insns(asm(f"bl #{OLD + 0x1000:#x}", OLD))[0]
    out = moved_call(call, FAR)
    assert out == asm(kmov("x30", 4) + "; " + kmov("x16", 0x1000) + "; br x16", FAR)


@pytest.mark.parametrize("call,before,jump", [
    ("blr x3", "mov x16, x3", "br x16"),
    ("blr x16", "", "br x16"),
    ("blr x17", "", "br x17"),
    ("blr x30", "mov x16, x30", "br x16"),                # copied before x30 is overwritten
])
def test_moved_blr_branches_through_x16(call, before, jump):
    new = OLD + 0x1000
    insn = insns(asm(call, OLD))[0]
    head = asm(before, new) if before else b""
    expected = head + adr(30, new + len(head), OLD + 4) + asm(jump, new + len(head) + 4)
    assert moved_call(insn, new) == expected


@pytest.mark.parametrize("call,expected", [
    ("22083fd7", ["mov x16, x1", "adr x30", "braa x16, x2"]),          # blraa x1, x2
    ("3e083fd7", ["mov x17, x30", "mov x16, x1", "adr x30", "braa x16, x17"]),  # blraa x1, x30
    ("1e0e3fd7", ["mov x17, x30", "adr x30", "brab x16, x17"]),         # blrab x16, x30
    ("3f0c3fd7", ["mov x16, x1", "adr x30", "brab x16, sp"]),          # blrab x1, sp
    ("7f083fd6", ["mov x16, x3", "adr x30", "braaz x16"]),             # blraaz x3
    ("df0f3fd6", ["mov x16, x30", "adr x30", "brabz x16"]),            # blrabz x30
])
def test_moved_pointer_authenticated_calls_keep_their_key_and_modifier(call, expected):
    new = OLD + 0x1000
    out = text(moved_call(insns(call)[0], new), new)
    assert [t.split(",")[0] if t.startswith("adr") else t for t in out] == expected
    assert f"adr x30, #{OLD + 4:#x}" in out


@pytest.mark.parametrize("hexword", ["60001fd6", "1f2003d5", "c0035fd6"])   # br x3, nop, ret
def test_moved_call_of_a_non_call_is_refused(hexword):
    with pytest.raises(RelocationError, match="not a call"):
        moved_call(insns(hexword)[0], NEAR)


def test_arch_object_delegates():
    code = asm(f"b.ne #{OLD + 0x100:#x}", OLD)
    assert ARCH.relocate(insns(code), MID) == relocate(insns(code), MID)
    call = insns(asm("blr x3", OLD))[0]
    assert ARCH.moved_call(call, NEAR) == moved_call(call, NEAR)


# --- same effect, in unicorn ------------------------------------------------------------------------
# OLD: the run, then at its end a pad that marks the fall-through and goes to EXIT;
# landing pads at LAND (one per branch target) mark which was taken; data at DATA.
DATA, LAND, EXIT = OLD + 0x4000, OLD + 0x2000, OLD + 0xF000      # LAND: within TBZ reach
DISTANCES = (NEAR, MID, FAR, VFAR)
_MACHINE: list[Machine] = []


def machine() -> Machine:
    if not _MACHINE:
        m = Machine({OLD: 0x10000, **{d: 0x1000 for d in DISTANCES}})
        rng = random.Random(7)
        m.write(DATA, bytes(rng.getrandbits(8) for _ in range(0x1000)))
        for k in range(16):
            at = LAND + 0x10 * k
            m.write(at, asm(f"movz x9, #{0x100 + k}; b #{EXIT:#x}", at))
        _MACHINE.append(m)
    return _MACHINE[0]


def land(k: int) -> int:
    return LAND + 0x10 * k


def run_both(code: bytes, new: int, regs: dict[str, int], *, first_to: int | None = None,
             ignore: frozenset[str] = frozenset()) -> tuple[dict[str, int], dict[str, int]]:
    """Run ``code`` at OLD and its relocation at ``new`` (followed by a way back to
    the run's end: B, or through x17 where B does not reach, so x17 is not compared),
    from the same registers; the registers after each."""
    m = machine()
    end = OLD + len(code)
    m.write(OLD, code + asm(f"movz x9, #0xfa11; b #{EXIT:#x}", end))
    moved = relocate(insns(code), new, first_to=first_to)
    w = Writer(new + len(moved))
    if ARCH.jmp_reaches(w.pc, end):
        w.put_b(end)
    else:
        w.put_mov_imm("x17", end)
        w.put_br("x17")
    m.write(new, moved + w.flush())
    results = []
    for start in (OLD, new):
        out = m.run(start, EXIT, dict(regs, x17=0))
        out["nzcv"] &= NZCV_MASK
        results.append({k: v for k, v in out.items() if k not in ignore | {"x17"}})
    return results[0], results[1]


regs_strategy = st.fixed_dictionaries({
    **{f"x{n}": st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 8, 2**63]) for n in range(8)},
    "nzcv": st.integers(0, 15).map(lambda f: f << 28),
})
BASE = {name: 0 for name in GPRS} | {"sp": OLD + 0x3000}

#: one program per PC-relative form: (text, at OLD; or raw bytes), branch targets outside
FORMS = {
    "b.cond": lambda: asm(f"b.gt #{land(1):#x}", OLD),
    "cbz": lambda: asm(f"cbz w1, #{land(2):#x}", OLD),
    "cbnz": lambda: asm(f"cbnz x1, #{land(3):#x}", OLD),
    "tbz": lambda: asm(f"tbz x2, #63, #{land(4):#x}", OLD),
    "tbnz": lambda: asm(f"tbnz w2, #3, #{land(5):#x}", OLD),
    "b": lambda: asm(f"b #{land(6):#x}", OLD),
    "adr": lambda: adr(3, OLD, DATA + 0x123) + adr(4, OLD + 4, OLD - 0x1000),
    "adrp": lambda: asm(f"adrp x3, #{DATA & ~0xFFF:#x}; adrp x4, #{OLD - 0x7654_3000:#x}", OLD),
    "ldr": lambda: asm(f"ldr x3, #{DATA + 0x10:#x}; ldr x4, #{DATA + 0x24:#x}; "
                       f"ldr w5, #{DATA + 0x38:#x}", OLD),
    "ldrsw": lambda: asm(f"ldrsw x3, #{DATA + 0x40:#x}; ldrsw x4, #{DATA + 0x84:#x}", OLD),
    "prfm": lambda: asm(f"prfm pldl1keep, #{DATA:#x}; add x3, x3, #1", OLD),
    "ldr q": lambda: bytes.fromhex("0180019c"),           # ldr q1, .+0x3000 (= DATA)
}
#: forms that cannot be moved that far (no free register for a long jump / SIMD load)
REFUSED = {("b.cond", FAR), ("cbz", FAR), ("cbnz", FAR), ("tbz", FAR), ("tbnz", FAR), ("b", FAR),
           ("ldr q", MID), ("ldr q", FAR)} | {(f, VFAR) for f in
                                               ("b.cond", "cbz", "cbnz", "tbz", "tbnz", "b", "ldr q")}


@pytest.mark.parametrize("new", DISTANCES, ids=["near", "mid", "far", "vfar"])
@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=12, deadline=None)
@given(values=regs_strategy)
def test_each_form_has_the_same_effect_when_moved(form, new, values):
    code = FORMS[form]()
    if (form, new) in REFUSED:
        with pytest.raises(RelocationError):
            relocate(insns(code), new)
        return
    original, moved = run_both(code, new, BASE | values)
    assert original == moved


@settings(max_examples=15, deadline=None)
@given(values=regs_strategy, new=st.sampled_from([NEAR, MID]))
def test_a_loop_back_to_the_first_instruction_has_the_same_effect(values, new):
    values = values | {"x0": values["x0"] % 20}
    code = asm(f"add x1, x1, #3; subs x0, x0, #1; b.hi #{OLD:#x}; "     # while x0 > 1
               f"cbz x0, #{OLD + 4:#x}", OLD)                            # once more from 0: x0 = -1
    original, moved = run_both(code, new, BASE | values)
    assert original == moved


@settings(max_examples=25, deadline=None)
@given(values=regs_strategy, new=st.sampled_from([NEAR, MID]))
def test_moved_bl_and_blr_reach_the_callee_with_the_original_return_address(values, new):
    m = machine()
    callee = land(9)
    for call in (asm(f"bl #{callee:#x}", OLD), asm("blr x5", OLD)):
        m.write(OLD, call)
        m.write(new, moved_call(insns(call)[0], new))
        seen = []
        for start in (OLD, new):
            out = m.run(start, EXIT, BASE | values | {"x5": callee})
            seen.append({k: v for k, v in out.items() if k != "x16"})   # moved: IP0 clobbered
        assert seen[0] == seen[1]
        assert seen[0]["x30"] == OLD + 4


@settings(max_examples=15, deadline=None)
@given(values=regs_strategy, new=st.sampled_from(DISTANCES))
def test_relocated_runs_ending_in_a_call_leave_the_original_return_address(values, new):
    """``add; bl callee`` and ``add; blr x5`` at their place and relocated: the callee
    is reached with the same registers, x30 the original return address."""
    m = machine()
    callee = land(10)
    for call in (f"bl #{callee:#x}", "blr x5"):
        code = asm(f"add x1, x1, #1; {call}", OLD)
        m.write(OLD, code)
        m.write(new, relocate(insns(code), new))
        seen = []
        for start in (OLD, new):
            out = m.run(start, EXIT, BASE | values | {"x5": callee})
            seen.append({k: v for k, v in out.items() if k != "x16"})   # moved: IP0 clobbered
        assert seen[0] == seen[1]
        assert seen[0]["x30"] == OLD + 8


@settings(max_examples=10, deadline=None)
@given(values=regs_strategy, new=st.sampled_from(DISTANCES))
def test_relocated_bl_to_the_next_instruction_reads_the_original_address(values, new):
    code = asm(f"bl #{OLD + 4:#x}; mov x3, x30", OLD)
    original, moved = run_both(code, new, BASE | values)
    assert original == moved
    assert moved["x3"] == OLD + 4


# --- hypothesis-generated runs ----------------------------------------------------------------------
REGS = [f"x{n}" for n in range(8)]


@st.composite
def runs(draw: st.DrawFn) -> tuple[bytes, int]:
    """A run of 1..8 instructions mixing arithmetic, flag setting, conditional and
    unconditional branches (forward inside the run, to its end, or out to a landing
    pad), ADR/ADRP and literal loads; and a distance to move it."""
    new = draw(st.sampled_from(DISTANCES))
    count = draw(st.integers(1, 8))
    far = new in (FAR, VFAR)                    # no branch out of the run reaches back from there
    code = b""
    for i in range(count):
        at = OLD + 4 * i
        reg = draw(st.sampled_from(REGS))
        src = draw(st.sampled_from(REGS))
        inside = [OLD + 4 * j for j in range(i + 1, count)]      # forward: the run ends
        outside = [] if far else [OLD + 4 * count] + [land(k) for k in range(8)]
        kind = draw(st.sampled_from(["alu", "flags", "adr", "adrp", "ldr", "ldrsw", "prfm"]
                                    + (["branch"] if inside or outside else [])))
        if kind == "alu":
            op = draw(st.sampled_from(["add", "sub", "eor"]))
            code += asm(f"{op} {reg}, {src}, {draw(st.sampled_from(REGS))}", at)
        elif kind == "flags":
            code += asm(f"{draw(st.sampled_from(['cmp', 'tst', 'cmn']))} {reg}, {src}", at)
        elif kind == "adr":
            code += adr(int(reg[1:]), at, DATA + draw(st.integers(0, 0xFFF)))
        elif kind == "adrp":
            page = (OLD + draw(st.integers(-(2**31), 2**31))) & ~0xFFF
            code += asm(f"adrp {reg}, #{page & (2**64 - 1):#x}", at)
        elif kind in ("ldr", "ldrsw", "prfm"):
            ref = DATA + 4 * draw(st.integers(0, 0x3FE))
            dst = {"ldr": reg, "ldrsw": reg, "prfm": "pldl1keep"}[kind]
            if kind == "ldr" and draw(st.booleans()):
                dst = "w" + reg[1:]
            code += asm(f"{kind} {dst}, #{ref:#x}", at)
        else:
            target = draw(st.sampled_from(inside + outside))
            form = draw(st.sampled_from(["b.eq", "b.lt", "b.hi", "cbz", "cbnz", "tbz", "tbnz", "b"]))
            operands = {"cbz": f"{reg}, ", "cbnz": f"{reg}, ",
                        "tbz": f"{reg}, #{draw(st.integers(0, 63))}, ",
                        "tbnz": f"{reg}, #{draw(st.integers(0, 63))}, "}.get(form, "")
            branch = asm(f"{form} {operands}#{target:#x}", at)
            assert insns(branch, at)[0].target == target     # keystone wraps what does not fit
            code += branch
    return code, new


@settings(max_examples=150, deadline=None)
@given(run=runs(), values=regs_strategy)
def test_generated_runs_have_the_same_effect_when_moved(run, values):
    code, new = run
    original, moved = run_both(code, new, BASE | values)
    assert original == moved
