"""AArch64 writer: exact words (checked against keystone and capstone), reach
limits at their exact edges, labels, and constant loads run in unicorn."""

from __future__ import annotations

import capstone
import keystone
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_aarch64_machine import Machine

from ksim.arch.aarch64 import ARCH
from ksim.arch.aarch64.reader import decode, decode_one
from ksim.arch.aarch64.writer import Writer, mov_imm_words
from ksim.arch.base import Flow
from ksim.errors import CodegenError, OutOfRange, RelocationError

AT = 0xFFFF800010000000
_ks = keystone.Ks(keystone.KS_ARCH_ARM64, keystone.KS_MODE_LITTLE_ENDIAN)
_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)


def asm(src: str, at: int = AT) -> bytes:
    return bytes(_ks.asm(src, at)[0])


def text(code: bytes, at: int = AT) -> str:
    """capstone's reading of ``code``, one instruction per line."""
    return "\n".join(f"{i.mnemonic} {i.op_str}".strip() for i in _cs.disasm(code, at))


def written(put, at: int = AT) -> bytes:
    w = Writer(at)
    put(w)
    return w.flush()


# --- every form against keystone ---------------------------------------------------------------
T = AT + 0x1234 * 4
B = AT - 0x400
CASES = [
    (f"b #{T:#x}", lambda w: w.put_b(T)),
    (f"b #{B:#x}", lambda w: w.put_b(B)),
    (f"bl #{T:#x}", lambda w: w.put_bl(T)),
    (f"b.ne #{B:#x}", lambda w: w.put_b_cond("ne", B)),
    (f"b.hs #{T:#x}", lambda w: w.put_b_cond(2, T)),
    (f"cbz w3, #{T:#x}", lambda w: w.put_cbz("w3", T)),
    (f"cbnz x3, #{B:#x}", lambda w: w.put_cbnz("x3", B)),
    (f"tbz w3, #5, #{T:#x}", lambda w: w.put_tbz("w3", 5, T)),
    (f"tbnz x3, #40, #{B:#x}", lambda w: w.put_tbnz("x3", 40, B)),
    (f"adrp x1, #{AT + 0x5000:#x}", lambda w: w.put_adrp("x1", AT + 0x5123)),
    (f"ldr x1, #{T:#x}", lambda w: w.put_ldr_literal("x1", T)),
    (f"ldr w1, #{B:#x}", lambda w: w.put_ldr_literal("w1", B)),
    (f"ldrsw x1, #{T:#x}", lambda w: w.put_ldr_literal("x1", T, signed=True)),
    (f"prfm pldl1keep, #{T:#x}", lambda w: w.put_prfm_literal(0, T)),
    ("br x3", lambda w: w.put_br("x3")),
    ("blr x16", lambda w: w.put_blr("x16")),
    ("ret", lambda w: w.put_ret()),
    ("ret x5", lambda w: w.put_ret("x5")),
    ("brk #4", lambda w: w.put_brk(4)),
    ("nop", lambda w: w.put_nop()),
    ("dmb ish", lambda w: w.put_dmb_ish()),
    ("movz x1, #0x1234, lsl #16", lambda w: w.put_movz("x1", 0x1234, 16)),
    ("movk x30, #0xffff, lsl #48", lambda w: w.put_movk("x30", 0xFFFF, 48)),
    ("movn x2, #5", lambda w: w.put_movn("x2", 5)),
    ("mov x1, x2", lambda w: w.put_mov_reg("x1", "x2")),
    ("mov x1, sp", lambda w: w.put_mov_reg("x1", "sp")),
    ("mov sp, x1", lambda w: w.put_mov_reg("sp", "x1")),
    ("ldr x1, [x2, #8]", lambda w: w.put_ldr("x1", "x2", 8)),
    ("ldr x1, [sp, #32760]", lambda w: w.put_ldr("x1", "sp", 32760)),
    ("ldur x1, [x2, #-8]", lambda w: w.put_ldr("x1", "x2", -8)),
    ("ldur x1, [x2, #3]", lambda w: w.put_ldr("x1", "x2", 3)),
    ("ldrb w1, [x2, #3]", lambda w: w.put_ldr("x1", "x2", 3, 1)),
    ("ldrh w1, [x2, #4]", lambda w: w.put_ldr("x1", "x2", 4, 2)),
    ("ldr w1, [x2, #4]", lambda w: w.put_ldr("x1", "x2", 4, 4)),
    ("ldrsb x1, [x2, #3]", lambda w: w.put_ldr("x1", "x2", 3, 1, True)),
    ("ldrsh x1, [x2]", lambda w: w.put_ldr("x1", "x2", 0, 2, True)),
    ("ldrsw x1, [x2, #8]", lambda w: w.put_ldr("x1", "x2", 8, 4, True)),
    ("ldursw x1, [x2, #-4]", lambda w: w.put_ldr("x1", "x2", -4, 4, True)),
    ("str x1, [sp, #-16]!", lambda w: w.put_str("x1", "sp", -16, mode="pre")),
    ("ldr x1, [sp], #16", lambda w: w.put_ldr("x1", "sp", 16, mode="post")),
    ("strb w1, [x2, #1]", lambda w: w.put_str("x1", "x2", 1, 1)),
    ("strh w1, [x2, #2]", lambda w: w.put_str("x1", "x2", 2, 2)),
    ("str w1, [x2, #4]", lambda w: w.put_str("x1", "x2", 4, 4)),
    ("stur w1, [x2, #-4]", lambda w: w.put_str("x1", "x2", -4, 4)),
    ("str xzr, [x2]", lambda w: w.put_str("xzr", "x2")),
    ("stp x29, x30, [sp, #-16]!", lambda w: w.put_stp("x29", "x30", "sp", -16, "pre")),
    ("ldp x29, x30, [sp], #16", lambda w: w.put_ldp("x29", "x30", "sp", 16, "post")),
    ("stp x1, x2, [sp, #16]", lambda w: w.put_stp("x1", "x2", "sp", 16)),
    ("ldp x1, x2, [sp, #-512]", lambda w: w.put_ldp("x1", "x2", "sp", -512)),
    ("ldaxr x1, [x2]", lambda w: w.put_ldaxr("x1", "x2")),
    ("ldaxrb w1, [x2]", lambda w: w.put_ldaxr("x1", "x2", 1)),
    ("ldaxr w1, [x2]", lambda w: w.put_ldaxr("x1", "x2", 4)),
    ("stlxr w3, x1, [x2]", lambda w: w.put_stlxr("w3", "x1", "x2")),
    ("stlxrh w3, w1, [x2]", lambda w: w.put_stlxr("w3", "x1", "x2", 2)),
    ("add x1, x2, #4095", lambda w: w.put_add_imm("x1", "x2", 4095)),
    ("add sp, sp, #0x10, lsl #12", lambda w: w.put_add_imm("sp", "sp", 0x10000)),
    ("sub x1, sp, #16", lambda w: w.put_add_imm("x1", "sp", -16)),
    ("subs x1, x2, #1", lambda w: w.put_sub_imm("x1", "x2", 1, flags=True)),
    ("cmp x1, #5", lambda w: w.put_cmp_imm("x1", 5)),
    ("cmn x1, #5", lambda w: w.put_cmp_imm("x1", -5)),
    ("add x1, x2, x3", lambda w: w.put_alu_reg("add", "x1", "x2", "x3")),
    ("sub x1, x2, x3", lambda w: w.put_alu_reg("sub", "x1", "x2", "x3")),
    ("and x1, x2, x3", lambda w: w.put_alu_reg("and", "x1", "x2", "x3")),
    ("orr x1, x2, x3", lambda w: w.put_alu_reg("orr", "x1", "x2", "x3")),
    ("eor x1, x2, x3", lambda w: w.put_alu_reg("eor", "x1", "x2", "x3")),
    ("bic x1, x2, x3", lambda w: w.put_alu_reg("bic", "x1", "x2", "x3")),
    ("cmp x1, x2", lambda w: w.put_cmp_reg("x1", "x2")),
    ("tst x1, x2", lambda w: w.put_tst_reg("x1", "x2")),
    ("neg x1, x2", lambda w: w.put_neg("x1", "x2")),
    ("mvn x1, x2", lambda w: w.put_mvn("x1", "x2")),
    ("mul x1, x2, x3", lambda w: w.put_mul("x1", "x2", "x3")),
    ("msub x1, x2, x3, x4", lambda w: w.put_madd("x1", "x2", "x3", "x4", subtract=True)),
    ("sdiv x1, x2, x3", lambda w: w.put_div("x1", "x2", "x3")),
    ("udiv x1, x2, x3", lambda w: w.put_div("x1", "x2", "x3", signed=False)),
    ("lsl x1, x2, x3", lambda w: w.put_shift_reg("lsl", "x1", "x2", "x3")),
    ("lsr x1, x2, x3", lambda w: w.put_shift_reg("lsr", "x1", "x2", "x3")),
    ("asr x1, x2, x3", lambda w: w.put_shift_reg("asr", "x1", "x2", "x3")),
    ("lsl x1, x2, #3", lambda w: w.put_shift_imm("lsl", "x1", "x2", 3)),
    ("lsr x1, x2, #3", lambda w: w.put_shift_imm("lsr", "x1", "x2", 3)),
    ("asr x1, x2, #63", lambda w: w.put_shift_imm("asr", "x1", "x2", 63)),
    ("sxtb x1, w2", lambda w: w.put_extend("x1", "x2", 1, True)),
    ("sxth x1, w2", lambda w: w.put_extend("x1", "x2", 2, True)),
    ("sxtw x1, w2", lambda w: w.put_extend("x1", "x2", 4, True)),
    ("ubfx x1, x2, #0, #8", lambda w: w.put_extend("x1", "x2", 1, False)),
    ("ubfx x1, x2, #0, #32", lambda w: w.put_extend("x1", "x2", 4, False)),
    ("csel x1, x2, x3, lt", lambda w: w.put_csel("x1", "x2", "x3", "lt")),
    ("cset x1, hi", lambda w: w.put_cset("x1", "hi")),
    ("csinv x1, x2, xzr, ne", lambda w: w.put_csinv("x1", "x2", "xzr", "ne")),
    ("mrs x1, nzcv", lambda w: w.put_mrs("x1", "nzcv")),
    ("msr nzcv, x1", lambda w: w.put_msr("nzcv", "x1")),
    ("mrs x1, cntvct_el0", lambda w: w.put_mrs("x1", "cntvct_el0")),
    ("mrs x1, sp_el0", lambda w: w.put_mrs("x1", "sp_el0")),
    ("mrs x1, tpidr_el1", lambda w: w.put_mrs("x1", "tpidr_el1")),
    ("mrs x1, tpidr_el2", lambda w: w.put_mrs("x1", "tpidr_el2")),
]


@pytest.mark.parametrize("src,put", CASES, ids=[c[0] for c in CASES])
def test_encoding_matches_the_assembler(src, put):
    assert written(put) == asm(src)


@pytest.mark.parametrize("put,reading", [
    (lambda w: w.put_adr("x1", AT + 0x101), f"adr x1, #{AT + 0x101:#x}"),
    (lambda w: w.put_adr("x30", AT - 1), f"adr x30, #{AT - 1:#x}"),
    (lambda w: w.put_udf(), "udf #0"),
    (lambda w: w.put_udf(0x1234), "udf #0x1234"),
])
def test_encodings_keystone_gets_wrong_or_lacks_read_back_by_capstone(put, reading):
    # keystone mis-encodes ADR to an absolute address and has no UDF
    assert text(written(put)) == reading


def test_adr_words():
    assert written(lambda w: w.put_adr("x1", AT + 0x101)) == bytes.fromhex("01080030")
    assert written(lambda w: w.put_adr("x1", AT - 1)) == bytes.fromhex("e1ffff70")


# --- reach, at the exact edges -------------------------------------------------------------------
MB = 1 << 20
REACH = [
    ("b", lambda w, t: w.put_b(t), -128 * MB, 128 * MB - 4),
    ("bl", lambda w, t: w.put_bl(t), -128 * MB, 128 * MB - 4),
    ("b.cond", lambda w, t: w.put_b_cond("eq", t), -MB, MB - 4),
    ("cbz", lambda w, t: w.put_cbz("x0", t), -MB, MB - 4),
    ("cbnz", lambda w, t: w.put_cbnz("w0", t), -MB, MB - 4),
    ("tbz", lambda w, t: w.put_tbz("x0", 63, t), -32 * 1024, 32 * 1024 - 4),
    ("ldr literal", lambda w, t: w.put_ldr_literal("x0", t), -MB, MB - 4),
    ("adr", lambda w, t: w.put_adr("x0", t), -MB, MB - 1),
    ("adrp", lambda w, t: w.put_adrp("x0", t), -4096 * MB, 4096 * MB - 4096),
]


@pytest.mark.parametrize("name,put,lo,hi", REACH, ids=[r[0] for r in REACH])
def test_reach_edges(name, put, lo, hi):
    step = 4096 if name == "adrp" else (1 if name == "adr" else 4)
    for offset in (lo, hi):
        code = written(lambda w, o=offset: put(w, AT + o))
        insn = decode_one(code, AT)
        assert (insn.target if insn.target is not None else insn.pc_ref) == AT + offset
    for offset in (lo - step, hi + step):
        with pytest.raises(OutOfRange):
            written(lambda w, o=offset: put(w, AT + o))


def test_misaligned_branch_targets_are_out_of_range():
    with pytest.raises(OutOfRange, match="aligned"):
        written(lambda w: w.put_b(AT + 2))


def test_reach_wraps_modulo_2_64():
    code = written(lambda w: w.put_b(2**64 - 8), at=0)
    assert code == bytes.fromhex("feffff17")               # b .-8
    assert decode_one(code, 0).target == 2**64 - 8


def test_code_must_be_word_aligned():
    with pytest.raises(CodegenError):
        Writer(AT + 2)
    with pytest.raises(CodegenError):
        Writer(AT).put_bytes(b"\x1f\x20")


@pytest.mark.parametrize("put", [
    lambda w: w.put_ldr("x1", "x2", 257),                    # neither scaled nor imm9
    lambda w: w.put_ldr("x1", "x2", 8, mode="pre", size=3),
    lambda w: w.put_stp("x1", "x2", "sp", 12),               # not a multiple of 8
    lambda w: w.put_add_imm("x1", "x2", 0x1001000),
    lambda w: w.put_mov_reg("x1", "w2"),
    lambda w: w.put_br("sp"),
    lambda w: w.put_alu_reg("add", "sp", "x1", "x2"),        # 31 is xzr here, not sp
    lambda w: w.put_tbz("w1", 32, AT),
    lambda w: w.put_brk(0x10000),
    lambda w: w.put_b_cond("always", AT),
    lambda w: w.put_cset("x1", "al"),
    lambda w: w.put_mrs("x1", "no_such_reg"),
])
def test_unencodable_operands_are_refused(put):
    with pytest.raises(CodegenError):
        written(put)


# --- labels ------------------------------------------------------------------------------------------
def test_labels_forward_and_backward():
    w = Writer(AT)
    top, out = w.new_label("top"), w.new_label("out")
    w.put_label(top)
    w.put_cbz("x0", out)                                     # +12
    w.put_sub_imm("x0", "x0", 1)
    w.put_b(top)                                             # -8
    w.put_label(out)
    w.put_tbnz("x1", 3, top)                                 # -12
    w.put_b_cond("ne", out)                                  # -4
    w.put_adr("x2", out)                                     # -8
    w.put_ldr_literal("x3", top)                             # -24
    assert w.flush() == asm(f"cbz x0, #{AT + 12:#x}; sub x0, x0, #1; b #{AT:#x}; "
                            f"tbnz x1, #3, #{AT:#x}; b.ne #{AT + 12:#x}") + bytes.fromhex(
        "c2ffff10" "43ffff58")                              # adr x2, .-8; ldr x3, .-0x18
    assert text(w.flush()).splitlines()[-2:] == [f"adr x2, #{AT + 12:#x}", f"ldr x3, #{AT:#x}"]


def test_label_out_of_reach_is_found_at_flush():
    w = Writer(AT)
    far = w.new_label()
    w.put_tbz("x0", 0, far)
    w.put_nop(8192)                                          # 32 KB
    w.put_label(far)
    with pytest.raises(OutOfRange):
        w.flush()


def test_unbound_and_twice_bound_labels():
    w = Writer(AT)
    label = w.new_label("x")
    w.put_b(label)
    with pytest.raises(CodegenError, match="never bound"):
        w.flush()
    w.put_label(label)
    with pytest.raises(CodegenError, match="twice"):
        w.put_label(label)


# --- constants -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [
    (0, "mov x5, #0"),
    (0xFFFF, "mov x5, #0xffff"),
    (0x10000, "mov x5, #0x10000"),
    (-1, "mov x5, #-1"),                                     # MOVN
    (-0x10001, "mov x5, #-0x10001"),
    (0x1234_0000_5678, "mov x5, #0x5678\nmovk x5, #0x1234, lsl #32"),
    (0xFFFF_8000_1000_0000, "mov x5, #0x10000000\nmovk x5, #0x8000, lsl #32\n"
                            "movk x5, #0xffff, lsl #48"),     # a tie: MOVZ
    (0xFFFF_FFFF_1000_0000, "mov x5, #-0x10000\nmovk x5, #0x1000, lsl #16"),   # MOVN
    (0x1122_3344_5566_7788, "mov x5, #0x7788\nmovk x5, #0x5566, lsl #16\n"
                            "movk x5, #0x3344, lsl #32\nmovk x5, #0x1122, lsl #48"),
])
def test_constant_loads_are_shortest(value, expected):
    assert text(written(lambda w: w.put_mov_imm("x5", value))) == expected


@settings(max_examples=60, deadline=None)
@given(value=st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**64 - 1, 0xFFFF_0000_FFFF_0000]))
def test_constant_loads_set_the_register_in_unicorn(value):
    m = Machine({AT: 0x1000})
    code = written(lambda w: w.put_mov_imm("x7", value))
    assert len(code) == 4 * len(mov_imm_words(7, value)) <= 16
    m.write(AT, code)
    assert m.run(AT, AT + len(code), {"x7": 0x5A5A})["x7"] == value


# --- the Arch's jumps and call redirection -------------------------------------------------------------
def test_arch_jumps():
    assert ARCH.jmp(AT, AT + 0x100) == asm(f"b #{AT + 0x100:#x}")
    assert ARCH.short_jmp(AT, AT - 0x100) == asm(f"b #{AT - 0x100:#x}")
    assert ARCH.jmp_reaches(AT, AT + 128 * MB - 4) and not ARCH.jmp_reaches(AT, AT + 128 * MB)
    assert ARCH.short_jmp_reaches(AT, AT - 128 * MB) and not ARCH.short_jmp_reaches(AT, AT - 128 * MB - 4)
    assert ARCH.jmp_reaches(0, 2**64 - 4)                   # pc arithmetic wraps
    assert len(ARCH.jmp(AT, AT)) == ARCH.jmp_size == ARCH.short_jmp_size == 4
    with pytest.raises(OutOfRange):
        ARCH.jmp(AT, AT + 128 * MB)
    with pytest.raises(OutOfRange):
        ARCH.short_jmp(AT, AT + 2)


def test_redirect_call_reencodes_bl_in_place():
    bl = next(decode(asm(f"bl #{AT + 0x40:#x}"), AT))
    out = ARCH.redirect_call(bl, AT - 0x1000)
    assert out == asm(f"bl #{AT - 0x1000:#x}")
    assert decode_one(out, AT).flow is Flow.CALL
    with pytest.raises(RelocationError):
        ARCH.redirect_call(bl, AT + 128 * MB)
    with pytest.raises(RelocationError):
        ARCH.redirect_call(next(decode(asm("blr x1"), AT)), AT)
