"""AArch64 reader: flow, targets, PC-relative references and register effects,
checked against annotated words and against capstone's own operands."""

from __future__ import annotations

import capstone
import keystone
import pytest
from capstone import arm64_const as A

from ksim.arch.aarch64 import ARCH
from ksim.arch.aarch64.reader import call_operand, classify, decode, decode_one, flows
from ksim.arch.base import CallOperand, Flow
from ksim.errors import CallOperandError, DecodeError

AT = 0xFFFF800010000000
_ks = keystone.Ks(keystone.KS_ARCH_ARM64, keystone.KS_MODE_LITTLE_ENDIAN)
_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = True


def asm(src: str, at: int = AT) -> bytes:
    return bytes(_ks.asm(src, at)[0])


def one(code: bytes | str, at: int = AT):
    raw = bytes.fromhex(code) if isinstance(code, str) else code
    insn = decode_one(raw, at)
    assert insn.size == 4 and insn.raw == raw[:4]
    return insn


# --- control flow ---------------------------------------------------------------------------
@pytest.mark.parametrize("src,flow,offset", [
    ("b #{t}", Flow.JMP, 0x100),
    ("b #{t}", Flow.JMP, -0x7FF_FFFC),                    # B reaches -128 MB
    ("bl #{t}", Flow.CALL, 0x7FF_FFFC),
    ("b.ne #{t}", Flow.JCC, 0x40),
    ("b.ge #{t}", Flow.JCC, -0x100000),                   # B.cond reaches -1 MB
    ("cbz w3, #{t}", Flow.JCC, 0xFFFFC),
    ("cbnz x3, #{t}", Flow.JCC, -8),
    ("tbz w3, #5, #{t}", Flow.JCC, 0x7FFC),               # TBZ reaches +32 KB - 4
    ("tbnz x3, #40, #{t}", Flow.JCC, -0x8000),
])
def test_direct_branches_have_their_flow_and_target(src, flow, offset):
    target = AT + offset
    insn = one(asm(src.format(t=hex(target))))
    assert (insn.flow, insn.target, insn.pc_ref) == (flow, target, None)
    # the target is the one capstone's operand names
    full = next(_cs.disasm(insn.raw, AT))
    assert full.operands[-1].imm & (2**64 - 1) == target


@pytest.mark.parametrize("hexword,flow", [
    ("0e080054", Flow.JMP),        # b.al .+0x100: always taken
    ("0f080054", Flow.JMP),        # b.nv .+0x100: always taken too (Arm ARM C1.2.4)
    ("10080054", Flow.JCC),        # bc.eq .+0x100 (FEAT_HBC)
])
def test_conditional_encodings_that_always_branch_are_jumps(hexword, flow):
    insn = one(hexword)
    assert (insn.flow, insn.target) == (flow, AT + 0x100)


@pytest.mark.parametrize("hexword,flow", [
    ("60001fd6", Flow.JMP_INDIRECT),   # br x3
    ("7f081fd6", Flow.JMP_INDIRECT),   # braaz x3
    ("2208 1fd7", Flow.JMP_INDIRECT),  # braa x1, x2
    ("80003fd6", Flow.CALL_INDIRECT),  # blr x4
    ("22083fd7", Flow.CALL_INDIRECT),  # blraa x1, x2
    ("7f083fd6", Flow.CALL_INDIRECT),  # blraaz x3
    ("c0035fd6", Flow.RET),            # ret
    ("a0005fd6", Flow.RET),            # ret x5
    ("ff0b5fd6", Flow.RET),            # retaa
    ("ff0f5fd6", Flow.RET),            # retab
    ("800020d4", Flow.STOP),           # brk #4
    ("000040d4", Flow.STOP),           # hlt #0
    ("00000000", Flow.STOP),           # udf #0
    ("e0039fd6", Flow.STOP),           # eret
    ("ff0b9fd6", Flow.STOP),           # eretaa
    ("1f2003d5", Flow.SEQ),            # nop
    ("010000d4", Flow.SEQ),            # svc #0 (returns)
    ("3f2303d5", Flow.SEQ),            # paciasp
])
def test_flow_of_other_control_transfers(hexword, flow):
    insn = one(hexword.replace(" ", ""))
    assert insn.flow is flow
    assert insn.target is None


def test_backward_target_wraps_modulo_2_64():
    insn = one(bytes.fromhex("ffffff17"), at=0)                # b .-4 at address 0
    assert insn.target == 2**64 - 4


# --- PC-relative references -------------------------------------------------------------------
@pytest.mark.parametrize("hexword,ref", [
    ("01080010", AT + 0x100),           # adr x1, .+0x100
    ("e1ffff70", AT - 1),               # adr x1, .-1
    ("01008090", AT - 0x1_0000_0000),   # adrp x1, page-0x100000 pages (-4 GB)
    ("e1ff7ff0", AT + 0xFFFF_F000),     # adrp x1, +0xfffff pages (+4 GB - 4 KB)
    ("01080058", AT + 0x100),           # ldr x1, .+0x100
    ("01f8ff18", AT - 0x100),           # ldr w1, .-0x100
    ("01080098", AT + 0x100),           # ldrsw x1, .+0x100
    ("000800d8", AT + 0x100),           # prfm pldl1keep, .+0x100
    ("0108009c", AT + 0x100),           # ldr q1, .+0x100
    ("e1ffff5c", AT - 4),               # ldr d1, .-4
])
def test_pc_relative_references(hexword, ref):
    insn = one(hexword)
    assert (insn.pc_ref, insn.target, insn.flow) == (ref, None, Flow.SEQ)
    full = next(_cs.disasm(insn.raw, AT))
    assert full.operands[-1].imm & (2**64 - 1) == ref


def test_adrp_refers_to_the_page_of_its_own_page():
    at = AT + 0x7F4                                            # not page-aligned
    insn = one(bytes.fromhex("01000090"), at)                  # adrp x1, .+0 pages
    assert insn.pc_ref == AT


# --- register effects -------------------------------------------------------------------------
def effects(code: bytes | str) -> tuple[set[str], set[str]]:
    insn = one(code)
    return set(insn.reads), set(insn.writes)


@pytest.mark.parametrize("src,reads,writes", [
    ("mov w1, w2", {"x2"}, {"x1"}),                            # a W write is a full write
    ("mov x1, xzr", set(), {"x1"}),                            # the zero register is no register
    ("add x1, sp, #16", {"sp"}, {"x1"}),
    ("adds x1, x2, x3", {"x2", "x3"}, {"x1", "nzcv"}),
    ("csel x1, x2, x3, eq", {"x2", "x3", "nzcv"}, {"x1"}),
    ("adc x1, x2, x3", {"x2", "x3", "nzcv"}, {"x1"}),
    ("ccmp x1, x2, #0, ne", {"x1", "x2", "nzcv"}, {"nzcv"}),
    ("cmp w1, #3", {"x1"}, {"nzcv"}),                          # capstone says w1 is written
    ("cmn x1, #4", {"x1"}, {"nzcv"}),
    ("tst x1, x2", {"x1", "x2"}, {"nzcv"}),
    ("cmp x1, x2", {"x1", "x2"}, {"nzcv"}),
    ("movk x1, #5, lsl #16", {"x1"}, {"x1"}),                  # keeps the other halfwords
    ("bfi x1, x2, #3, #4", {"x1", "x2"}, {"x1"}),
    ("stp x29, x30, [sp, #-16]!", {"x29", "x30", "sp"}, {"sp"}),
    ("ldp x29, x30, [sp], #16", {"sp"}, {"x29", "x30", "sp"}),
    ("ldr x1, [x2, #8]!", {"x2"}, {"x1", "x2"}),
    ("str x1, [sp, #8]", {"x1", "sp"}, set()),
    ("ldr w1, [x2, w3, sxtw]", {"x2", "x3"}, {"x1"}),
    ("bl #{t}", set(), {"x30"}),
    ("blr x4", {"x4"}, {"x30"}),
    ("ret", {"x30"}, set()),                                   # capstone omits x30
    ("ret x5", {"x5"}, set()),
    ("cbz w3, #{t}", {"x3"}, set()),                           # capstone adds the flags
    ("b.ne #{t}", {"nzcv"}, set()),
    ("adrp x1, #{page}", set(), {"x1"}),
    ("ldr w2, #{t}", set(), {"x2"}),
    ("mrs x1, nzcv", {"nzcv"}, {"x1"}),
    ("msr nzcv, x1", {"x1"}, {"nzcv"}),
    ("msr daifset, #2", set(), set()),                         # capstone says nzcv is written
    ("fcmp d1, d2", set(), {"nzcv"}),                          # SIMD/FP registers are not tracked
    ("fcsel d1, d2, d3, ne", {"nzcv"}, set()),
])
def test_register_effects(src, reads, writes):
    assert effects(asm(src.format(t=hex(AT + 0x40), page=hex(AT + 0x1000)))) == (reads, writes)


@pytest.mark.parametrize("hexword,reads,writes", [
    ("0e080054", set(), set()),                                # b.al reads no flags
    ("627ca1c8", {"x1", "x2", "x3"}, {"x1", "x2"}),            # cas x1, x2, [x3]: unknown access
    ("620021f8", {"x1", "x2", "x3"}, {"x1", "x2"}),            # ldadd x1, x2, [x3]
    ("217e0bd5", {"x1"}, {"x1"}),                              # dc civac, x1: capstone reads nothing
    ("2d08003a", {"x1", "nzcv"}, {"x1", "nzcv"}),              # setf8 w1: writes N, Z, V only
    ("1f4000d5", {"nzcv"}, {"nzcv"}),                          # cfinv
    ("ff0b5fd6", {"x30", "sp"}, set()),                        # retaa: x30 and its modifier sp
    ("3f2303d5", {"x30", "sp"}, {"x30"}),                      # paciasp
])
def test_register_effects_capstone_gets_wrong_or_leaves_out(hexword, reads, writes):
    assert effects(hexword) == (reads, writes)


@pytest.mark.parametrize("hexword", ["010000d4", "020000d4", "030000d4"])   # svc, hvc, smc #0
def test_supervisor_calls_read_and_write_the_smccc_registers(hexword):
    reads, writes = effects(hexword)
    smccc = {f"x{n}" for n in range(18)}
    assert reads == writes == smccc                            # and no x30 (capstone's svc has lr)


def test_effects_do_not_depend_on_the_branch_or_literal_offset():
    assert classify(0x14000001) == classify(0x17FFFFFF)        # b +4, b -4
    assert classify(0x58000041) == classify(0x58FFFFE1)        # ldr x1, +8 / -4


# --- sweeps -----------------------------------------------------------------------------------
def test_decode_sweeps_every_word_and_stops_at_the_first_undecodable():
    code = asm("mov x0, #1; add x1, x1, #1") + bytes.fromhex("ffffffff") + asm("ret")
    insns = list(decode(code, AT))
    assert [i.address for i in insns] == [AT, AT + 4]
    assert all(i.size == 4 for i in insns)


def test_decode_ignores_a_trailing_partial_word():
    insns = list(decode(asm("nop; nop") + b"\x1f\x20", AT))
    assert [i.mnemonic for i in insns] == ["nop", "nop"]


@pytest.mark.parametrize("code", [b"", b"\xff\xff\xff\xff", b"\x1f\x20"])
def test_decode_one_refuses_what_does_not_decode(code):
    with pytest.raises(DecodeError):
        decode_one(code, AT)


def test_flows_agree_with_decode():
    code = asm(f"b #{AT + 0x40:#x}; cbz x1, #{AT - 8:#x}; blr x2; ret; add x0, x0, #1; bl #{AT:#x}", AT)
    fast = list(flows(code, AT))
    slow = [(i.address, i.size, i.flow, i.target) for i in decode(code, AT)]
    assert fast == slow


# --- indirect calls -----------------------------------------------------------------------------
def test_call_operand_of_blr_is_its_register():
    assert call_operand(one("80003fd6")) == CallOperand(reg="x4")        # blr x4
    assert call_operand(one("c0033fd6")) == CallOperand(reg="x30")       # blr x30
    assert ARCH.call_operand(one("80003fd6")) == CallOperand(reg="x4")


@pytest.mark.parametrize("hexword", ["22083fd7", "7f083fd6", "3f0c3fd7"])  # blraa, blraaz, blrab
def test_call_operand_of_a_pointer_authenticated_call_is_refused(hexword):
    with pytest.raises(CallOperandError):
        call_operand(one(hexword))


@pytest.mark.parametrize("hexword", ["60001fd6", "c0035fd6", "1f2003d5"])  # br, ret, nop
def test_call_operand_of_other_instructions_is_none(hexword):
    assert call_operand(one(hexword)) is None


def test_arch_trap_is_the_kprobes_brk():
    trap = one(ARCH.trap)
    assert (trap.mnemonic, trap.op_str, trap.flow) == ("brk", "#4", Flow.STOP)
    full = next(_cs.disasm(ARCH.trap, AT))
    assert full.id == A.ARM64_INS_BRK


def test_arch_padding_is_udf():
    pad = one(bytes([ARCH.pad_byte]) * 4)
    assert (pad.mnemonic, pad.flow) == ("udf", Flow.STOP)
    assert ARCH.pad_word == bytes([ARCH.pad_byte]) * 4


def test_arch_register_sets_and_convention():
    cc = ARCH.convention
    assert ARCH.arg_regs == cc.arg_regs == tuple(f"x{n}" for n in range(8))
    assert ARCH.ret_reg == cc.ret_reg == "x0"
    assert cc.callee_saved == {f"x{n}" for n in range(19, 30)}
    assert cc.preserved_across_calls == cc.callee_saved | {"sp"}
    assert ARCH.all_regs == cc.all_regs == {f"x{n}" for n in range(31)} | {"sp", "nzcv"}
    assert cc.caller_saved == {f"x{n}" for n in range(19)} | {"x30", "nzcv"}
    assert ARCH.flags_reg in ARCH.all_regs
    assert ARCH.pc_reg == "pc"
    assert cc.special_callee.match("_mcount") and not cc.special_callee.match("kmalloc")
    assert not cc.indirect_thunk.match("__x86_indirect_thunk_rax")


@pytest.mark.parametrize("hexword,breakpoint,filler", [
    ("800020d4", True, False),      # brk #0x4 (kprobes)
    ("a00020d4", True, False),      # brk #0x5 (uprobes)
    ("00e03fd4", True, False),      # brk #0xff00 (any immediate)
    ("000130d4", True, False),      # brk #0x8008 (kCFI)
    ("010000d4", False, False),     # svc #0
    ("000140d4", True, False),      # hlt #0x8
    ("1f2003d5", False, True),      # nop
    ("00000000", False, True),      # udf #0: the padding word
    ("01000000", False, False),     # udf #1
    ("3f2303d5", False, False),     # paciasp
])
def test_breakpoints_and_filler(hexword, breakpoint, filler):
    insn = one(hexword)
    assert ARCH.is_breakpoint(insn) is breakpoint
    assert ARCH.is_filler(insn) is filler


def test_arch_scans_and_jump_tables():
    code = asm(f"cbz x0, #{AT + 8:#x}; br x1; ret", AT)
    assert list(ARCH.flow_scan()(code, AT)) == list(flows(code, AT))
    assert ARCH.code_scan() is None
    br = list(decode(code, AT))[1]
    assert ARCH.jump_tables.table_read(br) is None and ARCH.jump_tables.jump_reg(br) is None
