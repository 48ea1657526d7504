"""The engine's core promises, driven by hypothesis on the toy kernel in unicorn
(each build: x86-64 and arm64):

* a spliced kernel behaves exactly like the original except for the snippet's
  own effects (same workload checksum);
* the snippet runs exactly as often as the point executes (an exact unicorn
  address hook is the oracle);
* removal restores the original text byte for byte.

`--hypothesis-profile=long` runs 10,000 examples (see conftest.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ksim.analysis.points import PointKind
from ksim.errors import NoSafeTactic
from ksim.snippets import ast

SEED = 7
ITERATIONS = 300


@pytest.fixture(scope="module")
def world(image_manager):
    m = image_manager
    base = m.run(seed=SEED, iterations=ITERATIONS)
    text = m.text_snapshot()
    funcs = [f for f in m.target.image.functions
             if not any(lo <= f.address < hi for lo, hi in m.facts.blacklist)]
    return m, base.checksum, text, funcs


def value_exprs(kind: str, scratch: list[ast.Var]) -> st.SearchStrategy:
    leaves = [st.integers(-(2**63), 2**64 - 1).map(ast.Const), st.sampled_from(scratch),
              st.just(ast.Pid()), st.just(ast.Cpu())]
    if kind == "entry":
        leaves.append(st.integers(0, 5).map(ast.Arg))
    if kind == "exit":
        leaves.append(st.just(ast.RetVal()))
    ops = ["add", "sub", "mul", "and", "or", "xor", "shl", "sar"]

    def extend(inner: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.tuples(st.sampled_from(ops), inner, inner).map(lambda t: ast.BinOp(*t)),
            st.tuples(inner, inner).map(lambda t: t[0] == t[1]),
            st.tuples(inner, inner).map(lambda t: t[0] < t[1]),
        )

    return st.recursive(st.one_of(*leaves), extend, max_leaves=6)


def statements(kind: str, scratch: list[ast.Var]) -> st.SearchStrategy:
    expr = value_exprs(kind, scratch)
    assign = st.tuples(st.sampled_from(scratch), expr).map(lambda t: t[0].assign(t[1]))
    cond = st.tuples(expr, assign, st.one_of(st.none(), assign)).map(
        lambda t: ast.If(t[0], t[1], t[2]))
    return st.lists(st.one_of(assign, cond), max_size=3)


@st.composite
def splice_case(draw, funcs, facts):
    func = draw(st.sampled_from(funcs))
    fa = facts.analysis(func)
    kind = draw(st.sampled_from(["entry", "block", "insn", "exit"]))
    if kind == "entry":
        address = fa.points.entry
    elif kind == "block":
        address = draw(st.sampled_from(fa.points.blocks or (fa.points.entry,)))
    elif kind == "exit":
        assume(fa.points.exits)
        address = draw(st.sampled_from(fa.points.exits))
    else:
        address = draw(st.sampled_from([i.address for i in fa.insns]))
    policy = draw(st.sampled_from(["jmp", "trap", "auto"]))
    return func, address, policy


@settings(deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
def test_spliced_kernel_equals_original_but_for_the_snippet(world, data):
    m, checksum, text, funcs = world
    func, address, policy = data.draw(splice_case(funcs, m.facts))
    point = m.point_at(address)
    counter = m.malloc(8)
    scratch = [m.malloc(8) for _ in range(2)]
    body = data.draw(statements(point.kind.value, scratch))
    snippet = ast.Seq([counter.atomic_assign(counter + 1), *body])
    try:
        handle = m.insert_snippet(point, snippet, splice=policy)
    except NoSafeTactic:
        for v in (counter, *scratch):
            m.free(v)
        assume(False)
    try:
        with m.oracle(address) as oracle:
            result = m.run(seed=SEED, iterations=ITERATIONS)
            expected = oracle.count
        assert result.checksum == checksum, f"kernel state changed by {point} [{policy}]"
        assert m.read(counter) == expected, f"{point} [{policy}]"
    finally:
        m.remove_snippet(handle)
        for v in (counter, *scratch):
            m.free(v)
    for start, original in text.items():
        assert m.copy_from_kernel(start, len(original)) == original


@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_several_snippets_at_one_point_run_in_insertion_order(world, data):
    m, checksum, text, funcs = world
    func = data.draw(st.sampled_from(funcs))
    point = m.entry_point(func)
    log = m.malloc(8)
    n = data.draw(st.integers(2, 4))
    handles = []
    try:
        for k in range(1, n + 1):
            # log = log * 10 + k: the final value spells the order the snippets ran in
            handles.append(m.insert_snippet(point, log.assign(log * 10 + k),
                                            splice=data.draw(st.sampled_from(["auto", "trap"]))
                                            if not handles else "auto"))
        m.write(log, 0)
        with m.oracle(point.address) as oracle:
            m.run(seed=SEED, iterations=ITERATIONS)
            hits = oracle.count
        expected = 0
        for _ in range(hits):
            for k in range(1, n + 1):
                expected = (expected * 10 + k) % (1 << 64)
        assert m.read(log) == expected
        assert len(m.splices()) == 1
    finally:
        for h in reversed(handles):
            m.remove_snippet(h)
        m.free(log)
    for start, original in text.items():
        assert m.copy_from_kernel(start, len(original)) == original
    assert m.splices() == {}


def test_entry_points_are_entries(world):
    m, _, _, funcs = world
    assert all(m.entry_point(f).kind is PointKind.ENTRY for f in funcs[:20])
