"""The snippet API builds nodes; the static check refuses ill-formed snippets by cause."""

from __future__ import annotations

import pytest

from ksim.arch import get_arch
from ksim.errors import (
    ArgIndexError,
    BadOperand,
    DivisionByZero,
    NotAssignable,
    PointKindError,
    SlotError,
    SnippetError,
    TooManyCallArgs,
)
from ksim.snippets import POINT_KINDS, check
from ksim.snippets.ast import (
    Arg,
    Assign,
    BinOp,
    Call,
    Compare,
    Const,
    Load,
    LogicalAnd,
    Node,
    Var,
    arg,
    call,
    land,
    load,
    pid,
    retval,
    same,
    seq,
)
from ksim.targets.base import KernelABI, MemRef

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
