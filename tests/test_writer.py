"""x86-64 Writer: exact bytes for each form, cross-checked against keystone."""

from __future__ import annotations

import keystone
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ksim.arch.x86_64.regs import GPR64
from ksim.arch.x86_64.writer import Mem, Writer, absolute, rip_relative
from ksim.errors import CodegenError, OutOfRange

AT = 0xFFFFFFFF81000000
_ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)


def emit(*calls, at: int = AT) -> bytes:
    w = Writer(at)
    for name, *args in calls:
        getattr(w, name)(*args)
    return w.flush()


def ks(text: str, at: int = AT) -> bytes:
    return bytes(_ks.asm(text, at)[0])


# --- exact bytes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,expected",
    [
        (("put_jmp", AT + 0x100), bytes([0xE9, 0xFB, 0x00, 0x00, 0x00])),        # jmp +0xfb
        (("put_jmp_short", AT), bytes([0xEB, 0xFE])),                            # jmp $
        (("put_jcc", "ne", AT + 8), bytes([0x0F, 0x85, 0x02, 0x00, 0x00, 0x00])),  # jnz +2
        (("put_jcc_short", "nz", AT + 4), bytes([0x75, 0x02])),                  # jnz +2
        (("put_call", AT - 0x10), bytes([0xE8, 0xEB, 0xFF, 0xFF, 0xFF])),        # call -0x15
        (("put_call_reg", "r11"), bytes([0x41, 0xFF, 0xD3])),                    # call r11
        (("put_push", "rbp"), bytes([0x55])),                                    # push rbp
        (("put_push", "r12"), bytes([0x41, 0x54])),                              # push r12
        (("put_pop", "r15"), bytes([0x41, 0x5F])),                               # pop r15
        (("put_pushfq",), bytes([0x9C])),                                        # pushfq
        (("put_popfq",), bytes([0x9D])),                                         # popfq
        (("put_mov_reg_imm", "rax", 1), bytes([0xB8, 1, 0, 0, 0])),              # mov eax, 1
        (("put_mov_reg_imm", "r9", -1), bytes([0x49, 0xC7, 0xC1, 0xFF, 0xFF, 0xFF, 0xFF])),  # mov r9, -1
        (("put_mov_reg_imm", "rdx", 0x1_0000_0000),                              # movabs rdx, 2**32
         bytes([0x48, 0xBA, 0, 0, 0, 0, 1, 0, 0, 0])),
        (("put_mov_reg_reg", "rbx", "rsp"), bytes([0x48, 0x89, 0xE3])),          # mov rbx, rsp
        (("put_mov_reg_mem", "rax", Mem(base="rsp", disp=8)),                    # mov rax, [rsp+8]
         bytes([0x48, 0x8B, 0x44, 0x24, 0x08])),
        (("put_mov_reg_mem", "rax", Mem(base="r13")),                            # mov rax, [r13+0]
         bytes([0x49, 0x8B, 0x45, 0x00])),
        (("put_mov_reg_mem", "rax", absolute(0xFFFFFFFF82000000)),               # mov rax, [abs32]
         bytes([0x48, 0x8B, 0x04, 0x25, 0x00, 0x00, 0x00, 0x82])),
        (("put_mov_reg_gs", "rax", 0x1FBC0),                                     # mov rax, gs:[0x1fbc0]
         bytes([0x65, 0x48, 0x8B, 0x04, 0x25, 0xC0, 0xFB, 0x01, 0x00])),
        (("put_mov_reg_mem", "rax", rip_relative(AT + 0x107)),                   # mov rax, [rip+0x100]
         bytes([0x48, 0x8B, 0x05, 0x00, 0x01, 0x00, 0x00])),
        (("put_mov_reg_mem", "rcx", Mem(base="rax", disp=0x10), 4, False),       # mov ecx, [rax+0x10]
         bytes([0x8B, 0x48, 0x10])),
        (("put_mov_mem_reg", Mem(base="rdx"), "rax", 1), bytes([0x88, 0x02])),   # mov [rdx], al
        (("put_mov_mem_reg", Mem(base="rdx"), "rdi", 1), bytes([0x40, 0x88, 0x3A])),  # mov [rdx], dil
        (("put_lea", "rdi", Mem(base="rsp", disp=0x10)),                         # lea rdi, [rsp+0x10]
         bytes([0x48, 0x8D, 0x7C, 0x24, 0x10])),
        (("put_and_reg_imm", "rsp", -16), bytes([0x48, 0x83, 0xE4, 0xF0])),      # and rsp, -16
        (("put_alu_reg_reg", "sub", "rcx", "rax"), bytes([0x48, 0x29, 0xC1])),   # sub rcx, rax
        (("put_imul_reg_reg", "rax", "rcx"), bytes([0x48, 0x0F, 0xAF, 0xC1])),   # imul rax, rcx
        (("put_unary", "idiv", "rcx"), bytes([0x48, 0xF7, 0xF9])),               # idiv rcx
        (("put_shift_cl", "sar", "rax"), bytes([0x48, 0xD3, 0xF8])),             # sar rax, cl
        (("put_cqo",), bytes([0x48, 0x99])),                                     # cqo
        (("put_xchg_reg_reg", "rax", "rcx"), bytes([0x48, 0x87, 0xC8])),         # xchg rax, rcx (87 /r)
        (("put_setcc", "l", "rax"), bytes([0x0F, 0x9C, 0xC0])),                  # setl al
        (("put_lock_add_mem_imm", absolute(0xFFFFFFFF82000000), 1),              # lock add qword [abs], 1
         bytes([0xF0, 0x48, 0x83, 0x04, 0x25, 0x00, 0x00, 0x00, 0x82, 0x01])),
        (("put_lock_xadd", Mem(base="rdx"), "rax"), bytes([0xF0, 0x48, 0x0F, 0xC1, 0x02])),  # lock xadd [rdx], rax
        (("put_lock_cmpxchg", Mem(base="rdx"), "rcx"),                           # lock cmpxchg [rdx], rcx
         bytes([0xF0, 0x48, 0x0F, 0xB1, 0x0A])),
        (("put_rdtsc",), bytes([0x0F, 0x31])),                                   # rdtsc
        (("put_bytes", b"\x90\xcc"), bytes([0x90, 0xCC])),
    ],
)
def test_exact_bytes(call, expected):
    assert emit(call) == expected


# --- keystone agrees ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,text",
    [
        (("put_mov_reg_mem", "r12", Mem(base="r12", index="r9", scale=4, disp=-0x80)),
         "mov r12, qword ptr [r12 + r9*4 - 0x80]"),
        (("put_mov_reg_mem", "rax", Mem(base="rbp", disp=0x12345)), "mov rax, qword ptr [rbp + 0x12345]"),
        (("put_mov_reg_mem", "rax", Mem(base="rcx"), 2, True), "movsx rax, word ptr [rcx]"),
        (("put_mov_reg_mem", "rax", Mem(base="rcx"), 4, True), "movsxd rax, dword ptr [rcx]"),
        (("put_mov_reg_mem", "r8", Mem(base="rcx"), 1, False), "movzx r8d, byte ptr [rcx]"),
        (("put_mov_mem_reg", Mem(base="r14", disp=4), "r10", 2), "mov word ptr [r14 + 4], r10w"),
        (("put_mov_mem_reg", Mem(base="rax"), "rsi", 4), "mov dword ptr [rax], esi"),
        (("put_alu_reg_imm", "cmp", "r13", 0x1000), "cmp r13, 0x1000"),
        (("put_alu_reg_reg", "xor", "r8", "r15"), "xor r8, r15"),
        (("put_test_reg_reg", "rax", "rax"), "test rax, rax"),
        (("put_shift_imm", "shl", "rdx", 32), "shl rdx, 32"),
        (("put_extend", "rax", "rax", 4, True), "movsxd rax, eax"),
        (("put_movzx_reg_reg8", "rax", "rsi"), "movzx eax, sil"),
        (("put_lock_add_mem_imm", Mem(base="rdi"), 0x12345, 4), "lock add dword ptr [rdi], 0x12345"),
        (("put_lock_add_mem_reg", Mem(base="rdi", disp=8), "r9"), "lock add qword ptr [rdi + 8], r9"),
        (("put_lock_xadd", Mem(base="r8"), "rsi", 1), "lock xadd byte ptr [r8], sil"),
        (("put_jmp_reg", "rax"), "jmp rax"),
    ],
)
def test_agrees_with_keystone(call, text):
    assert emit(call) == ks(text)


@given(dst=st.sampled_from(GPR64), src=st.sampled_from(GPR64), op=st.sampled_from(["add", "or", "and", "sub", "xor", "cmp"]))
def test_alu_reg_reg_every_register_pair(dst, src, op):
    assert emit(("put_alu_reg_reg", op, dst, src)) == ks(f"{op} {dst}, {src}")


@given(reg=st.sampled_from(GPR64), base=st.sampled_from(GPR64), disp=st.integers(-(1 << 31), (1 << 31) - 1))
def test_loads_every_base_and_displacement(reg, base, disp):
    assert emit(("put_mov_reg_mem", reg, Mem(base=base, disp=disp))) == ks(
        f"mov {reg}, qword ptr [{base} + {disp}]"
    )


@given(reg=st.sampled_from(GPR64), value=st.integers(0, (1 << 64) - 1))
def test_mov_reg_imm_loads_the_value(reg, value):
    """Whatever form is chosen, capstone reads back the same 64-bit value."""
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    insn = next(md.disasm(emit(("put_mov_reg_imm", reg, value)), AT))
    imm = insn.operands[1].imm
    if insn.operands[0].size == 4:      # mov r32, imm32 zero-extends
        assert imm & 0xFFFFFFFF == value
    else:
        assert imm & ((1 << 64) - 1) == value


# --- labels -------------------------------------------------------------------------------------------
def test_forward_and_backward_labels():
    w = Writer(0x1000)
    top, out = w.new_label("top"), w.new_label("out")
    w.put_label(top)
    w.put_jcc("z", out)          # 0f 84 rel32 -> out
    w.put_jmp_short(top)         # eb f8       -> top
    w.put_label(out)
    w.put_ret()
    assert w.flush() == bytes([0x0F, 0x84, 0x02, 0, 0, 0, 0xEB, 0xF8, 0xC3])


def test_unbound_label_is_an_error():
    w = Writer(0x1000)
    w.put_jmp(w.new_label("nowhere"))
    with pytest.raises(CodegenError, match="nowhere"):
        w.flush()


def test_label_bound_twice_is_an_error():
    w = Writer(0x1000)
    label = w.new_label()
    w.put_label(label)
    with pytest.raises(CodegenError):
        w.put_label(label)


def test_short_jump_to_a_far_label_is_out_of_range():
    w = Writer(0x1000)
    far = w.new_label()
    w.put_jmp_short(far)
    w.put_bytes(b"\x90" * 200)
    w.put_label(far)
    with pytest.raises(OutOfRange):
        w.flush()


# --- reach ----------------------------------------------------------------------------------------------
def test_rel32_out_of_reach():
    with pytest.raises(OutOfRange):
        emit(("put_jmp", AT + (1 << 31) + 5))
    with pytest.raises(OutOfRange):
        emit(("put_call", 0xFFFF888000000000))
    # rip arithmetic wraps modulo 2**64: the top 2 GB reach the bottom 2 GB
    assert emit(("put_call", 0x1000)) == bytes([0xE8]) + (0x1000 - AT - 5 + (1 << 64)).to_bytes(4, "little")
    assert emit(("put_jmp", AT + (1 << 31) + 4)) == bytes([0xE9, 0xFF, 0xFF, 0xFF, 0x7F])


def test_rip_relative_out_of_reach():
    with pytest.raises(OutOfRange):
        emit(("put_mov_reg_mem", "rax", rip_relative(0xFFFF888000000000)))


def test_absolute_operand_must_fit_disp32():
    with pytest.raises(OutOfRange):
        emit(("put_mov_reg_mem", "rax", absolute(0xFFFF888000000000)))


def test_bad_operands_are_errors():
    with pytest.raises(CodegenError):
        emit(("put_alu_reg_imm", "add", "rax", 1 << 40))
    with pytest.raises(CodegenError):
        emit(("put_mov_reg_mem", "rax", Mem(base="rax", index="rsp")))
    with pytest.raises(ValueError):
        emit(("put_push", "eax"))


def test_deterministic():
    calls = [("put_push", "rax"), ("put_mov_reg_imm", "rax", 5), ("put_call", AT + 0x40), ("put_pop", "rax")]
    assert emit(*calls) == emit(*calls)


@given(reg=st.sampled_from(GPR64), base=st.sampled_from(GPR64),
       index=st.sampled_from([r for r in GPR64 if r != "rsp"]), scale=st.sampled_from([1, 2, 4, 8]),
       disp=st.integers(-(1 << 31), (1 << 31) - 1), size=st.sampled_from([1, 2, 4, 8]))
def test_stores_every_addressing_form(reg, base, index, scale, disp, size):
    sub = {1: "b", 2: "w", 4: "d", 8: ""}[size]
    legacy = {"rax": "a", "rcx": "c", "rdx": "d", "rbx": "b"}
    if reg.startswith("r") and reg[1:].isdigit():
        name = reg + sub
    elif size == 8:
        name = reg
    elif reg in legacy:
        name = {1: f"{legacy[reg]}l", 2: f"{legacy[reg]}x", 4: f"e{legacy[reg]}x"}[size]
    else:
        name = {1: f"{reg[1:]}l", 2: reg[1:], 4: f"e{reg[1:]}"}[size]
    width = {1: "byte", 2: "word", 4: "dword", 8: "qword"}[size]
    mem = Mem(base=base, index=index, scale=scale, disp=disp)
    assert emit(("put_mov_mem_reg", mem, reg, size)) == ks(
        f"mov {width} ptr [{base} + {index}*{scale} + {disp}], {name}"
    )
