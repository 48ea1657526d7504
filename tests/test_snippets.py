"""The snippet API builds nodes; the static check refuses ill-formed snippets by cause."""

from __future__ import annotations

import pytest

from ksim.arch import get_arch
from ksim.core import KernelABI, MemRef
from ksim.errors import (
    ArgIndexError,
    BadOperand,
    CallOperandError,
    DivisionByZero,
    NotAssignable,
    NotIndirectCall,
    PointKindError,
    SlotError,
    SnippetError,
    TooManyCallArgs,
    UnknownRegister,
)
from ksim.snippets import POINT_KINDS, check
from ksim.snippets.ast import (
    Arg,
    Assign,
    BinOp,
    Call,
    CallTarget,
    Compare,
    Const,
    Load,
    LogicalAnd,
    Node,
    Reg,
    Var,
    arg,
    call,
    call_target,
    land,
    load,
    pid,
    reg,
    retval,
    same,
    seq,
)

ARCH = get_arch("x86_64")
ABI = KernelABI(current_task=MemRef(0x1000), task_pid_offset=8)
V = Var(0xFFFFFFFF82000000)


# --- the API only builds nodes --------------------------------------------------------------
def test_operators_build_nodes():
    assert same(V + 1, BinOp("add", V, Const(1)))
    assert same(1 - V, BinOp("sub", Const(1), V))
    assert same(V.assign(V + 1), Assign(V, BinOp("add", V, Const(1))))
    assert same(V == 3, Compare("eq", V, Const(3)))
    assert same(V & 1 | 2, BinOp("or", BinOp("and", V, Const(1)), Const(2)))
    assert same(V >> 2, BinOp("sar", V, Const(2)))
    assert same(land(V, 1), LogicalAnd(V, Const(1)))
    assert not same(V + 1, V + 2)


def test_nodes_have_no_truth_value():
    with pytest.raises(TypeError, match="land/lor/lnot"):
        if V == 3:
            pass


def test_nodes_hash_by_identity():
    assert len({V, V, Var(V.address)}) == 2


# --- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "snippet,kind,error",
    [
        (Const(3).assign(1), "entry", NotAssignable),
        ((V + 1).atomic_assign(1), "entry", NotAssignable),
        (Load(V).assign(1), "entry", NotAssignable),
        (arg(0), "exit", PointKindError),
        (arg(0), "block", PointKindError),
        (V.assign(arg(1)), "callsite", PointKindError),
        (retval(), "entry", PointKindError),
        (retval() + 1, "insn", PointKindError),
        (V / 0, "entry", DivisionByZero),
        (V % Const(0), "entry", DivisionByZero),
        (Arg(6), "entry", ArgIndexError),
        (Arg(-1), "entry", ArgIndexError),
        (call(0x1000, 1, 2, 3, 4, 5, 6, 7), "entry", TooManyCallArgs),
        (V + 1.5, "entry", SlotError),
        (BinOp("add", V, "x"), "entry", SlotError),
        (seq(V, object()), "entry", SlotError),
        (Call(0x1000, (V, None)), "entry", SlotError),
        (Const(1 << 64), "entry", BadOperand),
        (Var(0x1000, size=3), "entry", BadOperand),
        (load(V, 16), "entry", BadOperand),
        (BinOp("pow", V, V), "entry", BadOperand),
        (V, "middle", PointKindError),
        (V.atomic_assign(seq(V.assign(V + 1), 5)), "entry", SlotError),
        (V + Node(), "entry", SlotError),
    ],
)
def test_check_refuses(snippet, kind, error):
    with pytest.raises(error):
        check(snippet, kind)
    assert issubclass(error, SnippetError)


def test_refusal_happens_before_codegen():
    with pytest.raises(DivisionByZero):
        ARCH.compile_snippets([V.assign(1), V / 0], 0x1000, live=frozenset(), abi=ABI)


@pytest.mark.parametrize(
    "snippet,kind",
    [
        (V.assign(V + 1), "entry"),
        (V.assign(arg(5)), "entry"),
        (V.assign(retval()), "exit"),
        (V.atomic_assign(V * 2 + pid()), "block"),
        (call(0x1000, 1, 2, 3, 4, 5, 6), "callsite"),
        (V / (V - 1), "insn"),
        (Const(-(1 << 63)) + Const((1 << 64) - 1), "entry"),
    ],
)
def test_check_accepts(snippet, kind):
    check(snippet, kind)


def test_point_kinds():
    assert POINT_KINDS == {"entry", "exit", "block", "callsite", "insn"}


def test_errors_have_distinct_wire_codes():
    codes = {c.code for c in (NotAssignable, SlotError, PointKindError, DivisionByZero,
                              ArgIndexError, TooManyCallArgs, BadOperand)}
    assert len(codes) == 7


# --- Reg and CallTarget: what they need of the point ----------------------------------------
GPRS = frozenset(ARCH.all_regs) - {"flags"}
INDIRECT = ARCH.call_operand(ARCH.decode_one(bytes.fromhex("ff14f5a0491181"), 0x1000))  # call [rsi*8+disp]
PERCPU = ARCH.call_operand(ARCH.decode_one(bytes.fromhex("65ff142510000000"), 0x1000))  # call gs:[0x10]


@pytest.mark.parametrize(
    "snippet,kind,operand,error",
    [
        (V.assign(CallTarget()), "entry", INDIRECT, NotIndirectCall),
        (V.assign(CallTarget()), "insn", INDIRECT, NotIndirectCall),
        (V.assign(CallTarget()), "callsite", None, NotIndirectCall),    # a direct call
        (V.assign(CallTarget()), "callsite", PERCPU, CallOperandError),
        (V.assign(reg("flags")), "entry", None, UnknownRegister),
        (V.assign(reg("eax")), "entry", None, UnknownRegister),
        (V.assign(Reg(3)), "entry", None, UnknownRegister),
    ],
)
def test_check_refuses_at_the_site(snippet, kind, operand, error):
    with pytest.raises(error):
        check(snippet, kind, registers=GPRS, call_operand=operand)
    assert issubclass(error, SnippetError)


def test_check_accepts_reg_anywhere_and_call_target_at_an_indirect_call():
    for kind in POINT_KINDS:
        check(V.assign(reg("rsp") + reg("r15")), kind, registers=GPRS)
    check(V.assign(call_target()), "callsite", registers=GPRS, call_operand=INDIRECT)


def test_codegen_refuses_a_register_the_architecture_lacks():
    with pytest.raises(UnknownRegister):
        ARCH.compile_snippets([V.assign(reg("xmm0"))], 0x1000, live=frozenset(), abi=ABI)
    with pytest.raises(NotIndirectCall):
        ARCH.compile_snippets([V.assign(call_target())], 0x1000, live=frozenset(), abi=ABI,
                              point_kind="callsite")


def test_call_operands_decoded():
    def op(hex_bytes: str) -> str:
        return str(ARCH.call_operand(ARCH.decode_one(bytes.fromhex(hex_bytes), 0x1000)))

    assert op("ffd0") == "rax"                                   # call rax
    assert op("41ffd3") == "r11"                                 # call r11
    assert op("ff542408") == "[rsp + 0x8]"                       # call [rsp + 8]
    assert op("ff14f5a0491181") == "[rsi*8 + -0x7eeeb660]"       # call [rsi*8 - 0x7eeeb660]
    assert op("ff1510000000") == "[0x1016]"                      # call [rip + 0x10]: absolute
    assert op("65ff142510000000") == "gs:[0x10]"
    assert ARCH.call_operand(ARCH.decode_one(bytes.fromhex("e800000000"), 0x1000)) is None
    with pytest.raises(CallOperandError):                        # call [eax]: addr32
        ARCH.call_operand(ARCH.decode_one(bytes.fromhex("67ff10"), 0x1000))


def test_site_errors_have_their_own_wire_codes():
    codes = {c.code for c in (NotIndirectCall, CallOperandError, UnknownRegister, PointKindError,
                              BadOperand)}
    assert len(codes) == 5
