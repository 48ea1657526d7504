"""Generated snippet code, run in unicorn: effects right, live registers and flags kept."""

from __future__ import annotations

import random

import keystone
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snippet_machine import GPRS, Machine, random_regs

from ksim.arch import get_arch
from ksim.core import KernelABI, MemRef
from ksim.errors import CodegenError, SnippetError
from ksim.snippets import ast, check
from ksim.snippets.ast import (
    Const,
    If,
    Var,
    arg,
    call,
    cpu,
    if_,
    land,
    lnot,
    load,
    lor,
    lshr,
    pid,
    retval,
    seq,
    tsc,
    uge,
    ult,
)

ARCH = get_arch("x86_64")
MASK = (1 << 64) - 1
ALL_LIVE = frozenset(ARCH.all_regs)

# low addresses: absolute disp32 operands
CODE, DATA, STACK = 0x1000000, 0x2000000, 0x3000000
CALLEE = 0x1100000
STACK_TOP = STACK + 0x8000 - 0x18          # deliberately not 16-aligned
ABI = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10, task_pid_size=4,
                cpu_number=MemRef(DATA + 0x108, size=4))
GS_ABI = KernelABI(current_task=MemRef(0x40, segment="gs"), task_pid_offset=0x18,
                   task_pid_size=4, cpu_number=MemRef(0x48, segment="gs", size=4))

_machine: Machine | None = None


def machine() -> Machine:
    global _machine
    if _machine is None:
        _machine = Machine({CODE: 0x10000, CALLEE: 0x1000, DATA: 0x1000, STACK: 0x10000})
        _machine.write(CALLEE, assemble(CALLEE_ASM, CALLEE))
    return _machine


def assemble(text: str, address: int) -> bytes:
    ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
    return bytes(ks.asm(text, address)[0])


# The callee records its arguments and its rsp at entry, trashes every
# caller-saved register and the flags, and returns the sum of its arguments.
CALLEE_ASM = f"""
    mov qword ptr [{DATA + 0x800:#x}], rdi
    mov qword ptr [{DATA + 0x808:#x}], rsi
    mov qword ptr [{DATA + 0x810:#x}], rdx
    mov qword ptr [{DATA + 0x818:#x}], rcx
    mov qword ptr [{DATA + 0x820:#x}], r8
    mov qword ptr [{DATA + 0x828:#x}], r9
    mov qword ptr [{DATA + 0x830:#x}], rsp
    lea rax, [rdi + rsi]
    add rax, rdx
    add rax, rcx
    add rax, r8
    add rax, r9
    mov rcx, 0x5555; mov rdx, 0x6666; mov rsi, 0x7777; mov rdi, 0x8888
    mov r8, 0x9999; mov r9, 0xaaaa; mov r10, 0xbbbb; mov r11, 0xcccc
    cmp rcx, rdx
    ret
"""


def run(snippets, *, live=ALL_LIVE, abi=ABI, point_kind="entry", regs=None, seed=0, at=CODE):
    """Compile, run once with random registers; check live registers, rsp and flags."""
    m = machine()
    code = ARCH.compile_snippets(snippets, at, live=frozenset(live), abi=abi, point_kind=point_kind)
    before = random_regs(random.Random(seed), STACK_TOP)
    before.update(regs or {})
    after = m.run(code, at, before)
    for reg in set(live) | {"rsp"}:
        assert after[reg] == before[reg], f"{reg} changed: {before[reg]:#x} -> {after[reg]:#x}"
    return after, code


def var(offset: int, size: int = 8, signed: bool = False) -> Var:
    return Var(DATA + offset, size, signed)


# --- basic effects ---------------------------------------------------------------------
def test_counter_increment_runs_three_times():
    m = machine()
    m.put64(DATA, 0)
    c = var(0)
    for i in range(3):
        run([c.assign(c + 1)], seed=i)
    assert m.u64(DATA) == 3


def test_snippets_run_in_order():
    m = machine()
    a, b = var(0), var(8)
    m.put64(DATA, 5)
    run([a.assign(a * 10), b.assign(a + 1), a.assign(0)])
    assert m.u64(DATA + 8) == 51 and m.u64(DATA) == 0


def test_same_input_same_bytes():
    s = [var(0).atomic_assign(var(0) * 3), if_(pid() == 7, call(CALLEE, 1, arg(2)))]
    first = ARCH.compile_snippets(s, CODE, live=ALL_LIVE, abi=ABI)
    again = ARCH.compile_snippets(list(s), CODE, live=ALL_LIVE, abi=ABI)
    assert first == again


def test_narrow_variables_wrap_and_extend():
    m = machine()
    m.put64(DATA, 0xFFFF_FFFF_FFFF_FFFF)
    b, w, out = var(0, 1), var(1, 2, signed=True), var(8)
    m.put64(DATA + 8, 0)
    run([b.assign(b + 1), out.assign(w)])
    assert m.read(DATA, 1) == b"\x00"          # 0xff + 1 wrapped in one byte
    assert m.u64(DATA + 8) == (0xFFFF - 1 - 0xFFFF) & MASK  # 0xffff sign-extended = -1


# --- register and flag preservation ---------------------------------------------------------
SAMPLES = [
    lambda: var(0).assign(var(0) + 1),
    lambda: var(0).atomic_assign(var(0) + var(8)),
    lambda: var(0).atomic_assign(var(0) * 3 + 1),
    lambda: var(8).assign(var(0) / 7 + var(0) % 5),
    lambda: var(8).assign(tsc()),
    lambda: var(8).assign(call(CALLEE, 1, 2, 3, 4, 5, 6)),
    lambda: if_(var(0) > 3, var(8).assign(pid() << 2), var(8).assign(cpu())),
    lambda: var(8).assign(arg(0) + arg(3) + arg(5)),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(SAMPLES) - 1),
    live=st.sets(st.sampled_from(sorted(ARCH.all_regs))),
    seed=st.integers(0, 2**32),
)
def test_live_registers_and_flags_preserved(which, live, seed):
    machine().put64(DATA + 0x100, DATA + 0x200)      # current task -> a task
    run([SAMPLES[which]()], live=live | {"rbx"}, seed=seed)


def test_flags_not_saved_when_dead():
    code = ARCH.compile_snippets([var(0).assign(var(0) + 1)], CODE, live=frozenset(), abi=ABI)
    assert b"\x9c" not in code[:1] and not code.endswith(b"\x9d")


def test_saves_exactly_the_clobbered_live_registers():
    s = [var(0).assign(var(0) + 1)]
    # rbx and r12 are never clobbered without a call: nothing to save
    code = ARCH.compile_snippets(s, CODE, live=frozenset({"rbx", "r12"}), abi=ABI)
    assert code[0] not in (0x53, 0x41, 0x9C)
    code = ARCH.compile_snippets(s, CODE, live=frozenset({"rax", "flags"}), abi=ABI)
    assert code[:2] == bytes([0x9C, 0x50])          # pushfq; push rax
    assert code[-2:] == bytes([0x58, 0x9D])         # pop rax; popfq


def test_point_register_read_directly_when_untouched():
    """Arg(4) is r8, which code without calls never writes: no save, a plain mov."""
    m = machine()
    code = ARCH.compile_snippets([var(0x20).assign(arg(4))], CODE, live=frozenset({"r8"}), abi=ABI)
    assert code[:3] == bytes([0x4C, 0x89, 0xC0])          # mov rax, r8
    run([var(0x20).assign(arg(4))], regs={"r8": 1234}, live=frozenset({"r8"}))
    assert m.u64(DATA + 0x20) == 1234


def test_unknown_live_register_refused():
    with pytest.raises(CodegenError):
        ARCH.compile_snippets([var(0).assign(1)], CODE, live=frozenset({"xmm0"}), abi=ABI)


# --- atomics ---------------------------------------------------------------------------------
def test_atomic_increment_is_one_locked_add():
    """KernInst's count_func: the whole patch is pushfq; lock add; popfq."""
    m = machine()
    m.put64(DATA, 41)
    c = var(0)
    _, code = run([c.atomic_assign(c + 1)])
    assert m.u64(DATA) == 42
    assert code == bytes([0x9C,                                   # pushfq
                          0xF0, 0x48, 0x83, 0x04, 0x25]           # lock add qword [DATA], 1
                         + list(DATA.to_bytes(4, "little")) + [0x01,
                          0x9D])                                  # popfq


def test_atomic_increment_whose_value_is_used_uses_lock_xadd():
    m = machine()
    m.put64(DATA, 41)
    m.put64(DATA + 8, 0)
    c = var(0)
    _, code = run([var(8).assign(c.atomic_assign(c + var(0x10)))], live=frozenset())
    assert bytes([0xF0, 0x48, 0x0F, 0xC1]) in code     # lock xadd
    assert m.u64(DATA) == m.u64(DATA + 8) == 41 + m.u64(DATA + 0x10)


def test_atomic_subtract_and_reversed_add():
    m = machine()
    m.put64(DATA, 100)
    c = var(0)
    run([c.atomic_assign(c - 30), c.atomic_assign(5 + c)])
    assert m.u64(DATA) == 75


def test_atomic_general_update_uses_cmpxchg_loop():
    m = machine()
    m.put64(DATA, 7)
    m.put64(DATA + 8, 0)
    c, out = var(0), var(8)
    _, code = run([out.assign(c.atomic_assign(c * c + c))])
    assert m.u64(DATA) == 56 and m.u64(DATA + 8) == 56
    assert bytes([0xF0, 0x48, 0x0F, 0xB1]) in code     # lock cmpxchg


def test_atomic_on_a_4_byte_variable():
    m = machine()
    m.write(DATA, (0xFFFFFFFF).to_bytes(4, "little") + b"\xaa\xbb\xcc\xdd")
    c = var(0, 4)
    run([c.atomic_assign(c + 2), var(0x10, 4).atomic_assign(var(0x10, 4) | 6)])
    assert m.read(DATA, 8) == (1).to_bytes(4, "little") + b"\xaa\xbb\xcc\xdd"


# --- calls, arguments, return values -------------------------------------------------------------
@pytest.mark.parametrize("pending", [0, 1, 2])
def test_call_with_six_args_reaches_callee(pending):
    """Temporaries pending on the stack (0, 1, 2) must not break the callee's alignment."""
    m = machine()
    out = var(0x40)
    expr: ast.Node = call(CALLEE, 1, 2, 3, 4, 5, 6)
    for _ in range(pending):
        expr = Const(0) + expr
    run([out.assign(expr)], seed=pending)
    assert [m.u64(DATA + 0x800 + 8 * i) for i in range(6)] == [1, 2, 3, 4, 5, 6]
    assert m.u64(DATA + 0x830) % 16 == 8          # rsp at entry: 16-aligned before the call
    assert m.u64(DATA + 0x40) == 21


def test_args_read_after_a_call_clobbered_them():
    m = machine()
    regs = {"rdi": 10, "rsi": 20, "rdx": 30, "rcx": 40, "r8": 50, "r9": 60}
    out = var(0x48)
    run([call(CALLEE), out.assign(arg(0) + arg(1) + arg(2) + arg(3) + arg(4) + arg(5))], regs=regs)
    assert m.u64(DATA + 0x48) == 210


def test_args_passed_through_to_a_call():
    m = machine()
    regs = {"rdi": 1, "rsi": 2, "rdx": 3, "rcx": 4, "r8": 5, "r9": 6}
    run([call(CALLEE, arg(5), arg(4), arg(3), arg(2), arg(1), arg(0))], regs=regs, live=frozenset())
    assert [m.u64(DATA + 0x800 + 8 * i) for i in range(6)] == [6, 5, 4, 3, 2, 1]


def test_retval_at_exit():
    m = machine()
    out = var(0x50)
    after, _ = run([out.assign(retval() * 2)], point_kind="exit", regs={"rax": 21})
    assert m.u64(DATA + 0x50) == 42 and after["rax"] == 21


# --- counters, pid, cpu ------------------------------------------------------------------------------
def test_rdtsc_reads_a_counter():
    m = machine()
    a, b = var(0x58), var(0x60)
    run([a.assign(tsc()), b.assign(tsc())])
    assert 0 < m.u64(DATA + 0x58) <= m.u64(DATA + 0x60)


def test_pid_and_cpu_via_absolute_memrefs():
    m = machine()
    task = DATA + 0x200
    m.put64(DATA + 0x100, task)
    m.write(task + 0x10, (4242).to_bytes(4, "little") + b"\xff\xff\xff\xff")
    m.write(DATA + 0x108, (3).to_bytes(4, "little") + b"\xee\xee\xee\xee")
    run([var(0x68).assign(pid()), var(0x70).assign(cpu())])
    assert m.u64(DATA + 0x68) == 4242 and m.u64(DATA + 0x70) == 3


def test_pid_and_cpu_via_gs_relative_memrefs():
    m = machine()
    percpu = DATA + 0x400
    task = DATA + 0x300
    m.uc.reg_write(__import__("unicorn").x86_const.UC_X86_REG_GS_BASE, percpu)
    m.put64(percpu + 0x40, task)
    m.write(percpu + 0x48, (5).to_bytes(4, "little") + b"\xee\xee\xee\xee")
    m.write(task + 0x18, (777).to_bytes(4, "little"))
    _, code = run([var(0x78).assign(pid()), var(0x80).assign(cpu())], abi=GS_ABI)
    assert m.u64(DATA + 0x78) == 777 and m.u64(DATA + 0x80) == 5
    assert 0x65 in code                      # gs segment override
    # a per-cpu variable
    m.put64(percpu + 0x50, 9)
    run([Var(0x50, segment="gs").atomic_assign(Var(0x50, segment="gs") + 1)], abi=GS_ABI)
    assert m.u64(percpu + 0x50) == 10


def test_load_through_pointer():
    m = machine()
    m.put64(DATA + 0x90, DATA + 0x98)
    m.put64(DATA + 0x98, 0x1122334455667788)
    out = var(0xA0)
    run([out.assign(load(var(0x90), 2) + load(var(0x90) + 6, 2, signed=True))])
    assert m.u64(DATA + 0xA0) == 0x7788 + 0x1122


def test_without_cpu_number_the_cpu_is_zero():
    m = machine()
    abi = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10)
    m.put64(DATA + 0xA8, 99)
    run([var(0xA8).assign(cpu())], abi=abi)
    assert m.u64(DATA + 0xA8) == 0


# --- kernel-like addresses -------------------------------------------------------------------------------
def test_kernel_addresses_far_data_and_far_callee():
    """Code in the module area, data in the kernel image (absolute disp32) and in the
    direct map (beyond ±2 GB: movabs), and a callee out of rel32 reach."""
    code_at, near, far = 0xFFFFFFFFC0001000, 0xFFFFFFFF82000000, 0xFFFF888000100000
    far_fn = 0xFFFF888000200000
    m = Machine({code_at: 0x1000, near: 0x1000, far: 0x1000, far_fn: 0x1000,
                 STACK: 0x10000, DATA: 0x1000})
    m.write(far_fn, assemble("lea rax, [rdi + rsi]; ret", far_fn))
    m.put64(near, 5)
    m.put64(far, 7)
    a, b = Var(near), Var(far)
    s = [a.atomic_assign(a + b), b.assign(call(far_fn, a, 100)), Var(far + 8).assign(a * 2)]
    code = ARCH.compile_snippets(s, code_at, live=ALL_LIVE, abi=ABI)
    before = random_regs(random.Random(1), STACK_TOP)
    after = m.run(code, code_at, before)
    assert {r: after[r] for r in GPRS} == {r: before[r] for r in GPRS}
    assert after["flags"] == before["flags"]
    assert (m.u64(near), m.u64(far), m.u64(far + 8)) == (12, 112, 24)


# --- expression semantics: Python reference vs generated code -------------------------------------------
def s64(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def div(a: int, b: int) -> int:
    a, b = s64(a), s64(b)
    if b == 0:
        return MASK
    if b == -1:
        return -a & MASK
    q = abs(a) // abs(b)
    return (q if (a < 0) == (b < 0) else -q) & MASK


def mod(a: int, b: int) -> int:
    a, b = s64(a), s64(b)
    if b == 0:
        return a & MASK
    if b == -1:
        return 0
    return (a - s64(div(a, b)) * b) & MASK


BIN = {
    "add": lambda a, b: (a + b) & MASK,
    "sub": lambda a, b: (a - b) & MASK,
    "mul": lambda a, b: (a * b) & MASK,
    "div": div,
    "mod": mod,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: (a << (b & 63)) & MASK,
    "sar": lambda a, b: (s64(a) >> (b & 63)) & MASK,
    "shr": lambda a, b: a >> (b & 63),
}
CMP = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "lt": lambda a, b: s64(a) < s64(b), "le": lambda a, b: s64(a) <= s64(b),
    "gt": lambda a, b: s64(a) > s64(b), "ge": lambda a, b: s64(a) >= s64(b),
    "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b,
    "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b,
}
VARS = [var(0x100 + 8 * i) for i in range(3)]


ARG_VALUES = [3, MASK, 1 << 63, 0, 12345, 7]
ARG_REGS = dict(zip(ARCH.arg_regs, ARG_VALUES, strict=True))


def evaluate(node, mem: dict[int, int]) -> int:
    """The documented semantics, in Python (variables are 8-byte)."""
    t = type(node)
    if t is ast.Arg:
        return ARG_VALUES[node.n]
    if t is ast.AtomicAssign:
        mem[node.target.address] = evaluate(node.value, mem)
        return mem[node.target.address]
    if t is ast.Const:
        return node.value & MASK
    if t is ast.Var:
        return mem[node.address]
    if t is ast.BinOp:
        return BIN[node.op](evaluate(node.left, mem), evaluate(node.right, mem))
    if t is ast.Unary:
        v = evaluate(node.operand, mem)
        return -v & MASK if node.op == "neg" else ~v & MASK
    if t is ast.Compare:
        return int(CMP[node.op](evaluate(node.left, mem), evaluate(node.right, mem)))
    if t is ast.LogicalAnd:
        return int(evaluate(node.left, mem) != 0 and evaluate(node.right, mem) != 0)
    if t is ast.LogicalOr:
        return int(evaluate(node.left, mem) != 0 or evaluate(node.right, mem) != 0)
    if t is ast.LogicalNot:
        return int(evaluate(node.operand, mem) == 0)
    if t is ast.If:
        if evaluate(node.cond, mem):
            return evaluate(node.then, mem)
        return 0 if node.orelse is None else evaluate(node.orelse, mem)
    if t is ast.Assign:
        mem[node.target.address] = evaluate(node.value, mem)
        return mem[node.target.address]
    raise AssertionError(t)


interesting = st.sampled_from([0, 1, 2, 3, 7, 63, 64, MASK, 1 << 63, (1 << 63) - 1, 0x1234_5678_9ABC])
consts = st.one_of(interesting, st.integers(0, MASK)).map(Const)
leaves = st.one_of(consts, st.sampled_from(VARS), st.integers(0, 5).map(arg))


def _extend(children):
    return st.one_of(
        st.builds(ast.BinOp, st.sampled_from(sorted(BIN)), children, children),
        st.builds(ast.Unary, st.sampled_from(["neg", "not"]), children),
        st.builds(ast.Compare, st.sampled_from(sorted(CMP)), children, children),
        st.builds(land, children, children),
        st.builds(lor, children, children),
        st.builds(lnot, children),
        st.builds(If, children, children, st.one_of(st.none(), children)),
        st.builds(lambda v, e: v.assign(e), st.sampled_from(VARS), children),
        st.builds(lambda v, e: v.atomic_assign(e), st.sampled_from(VARS), children),
    )


def _passes_check(node) -> bool:
    """Trees the static check refuses (constant zero divisor, an atomic value that
    assigns its own target) are not generated."""
    try:
        check(node, "entry")
    except SnippetError:
        return False
    return True


expressions = st.recursive(leaves, _extend, max_leaves=12).filter(_passes_check)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=expressions, values=st.lists(st.one_of(interesting, st.integers(0, MASK)),
                                         min_size=3, max_size=3))
def test_expressions_match_python_semantics(expr, values):
    m = machine()
    mem = {}
    for v, value in zip(VARS, values, strict=True):
        m.put64(v.address, value)
        mem[v.address] = value
    result = var(0x180)
    expected = evaluate(expr, mem)
    run([result.assign(expr)], live=frozenset({"rax", "rdx", "rdi", "rcx", "flags"}), regs=ARG_REGS)
    assert m.u64(DATA + 0x180) == expected
    for v in VARS:
        assert m.u64(v.address) == mem[v.address]


@pytest.mark.parametrize(
    "a,b,q,r",
    [
        (7, 2, 3, 1), (-7, 2, -3, -1), (7, -2, -3, 1), (-7, -2, 3, -1),
        (5, 0, -1, 5), (-(1 << 63), -1, -(1 << 63), 0), (-(1 << 63), 1, -(1 << 63), 0),
    ],
)
def test_division_is_signed_truncating_and_never_faults(a, b, q, r):
    m = machine()
    x, y = var(0x1A0), var(0x1A8)
    m.put64(x.address, a)
    m.put64(y.address, b)
    run([var(0x1B0).assign(x / y), var(0x1B8).assign(x % y)])
    assert s64(m.u64(DATA + 0x1B0)) == q and s64(m.u64(DATA + 0x1B8)) == r


def test_unsigned_comparisons_and_logical_shift():
    m = machine()
    x = var(0x1C0)
    m.put64(x.address, MASK)
    run([var(0x1C8).assign(ult(1, x) + (uge(x, 0) << 1) + ((x < 0) << 2)),
         var(0x1D0).assign(lshr(x, 60))])
    assert m.u64(DATA + 0x1C8) == 7 and m.u64(DATA + 0x1D0) == 0xF


def test_logical_operators_short_circuit():
    m = machine()
    hits = var(0x1E0)
    m.put64(hits.address, 0)
    run([land(0, hits.assign(hits + 1)), lor(1, hits.assign(hits + 1)),
         land(1, hits.assign(hits + 10)), lor(0, hits.assign(hits + 100))])
    assert m.u64(hits.address) == 110


def test_seq_value_and_empty_seq():
    m = machine()
    run([var(0x1E8).assign(seq(1, 2, 3) + seq())])
    assert m.u64(DATA + 0x1E8) == 3


def test_code_length_does_not_depend_on_the_address():
    """The planner sizes a patch by compiling at a provisional address."""
    far_data = 0xFFFF888000100000
    s = [var(0).atomic_assign(var(0) + 1), Var(far_data).assign(call(CALLEE, 1, Var(far_data))),
         var(8).assign(pid())]
    near = ARCH.compile_snippets(s, CODE + 0x100, live=ALL_LIVE, abi=ABI)
    far = ARCH.compile_snippets(s, 0x7FFF00000000, live=ALL_LIVE, abi=ABI)  # callee out of rel32 reach
    assert len(near) == len(far) and near != far


# --- registers at the point, and an indirect call's destination ------------------------------
@pytest.mark.parametrize("calls", [False, True])
def test_reg_reads_every_register_as_it_was_at_the_point(calls):
    """Each general-purpose register, rsp included, as the point had it: also the ones
    the code clobbers (saved) and, after a call, the caller-saved ones."""
    m = machine()
    names = list(GPRS)
    body = [call(CALLEE)] if calls else []
    body += [var(0x100 + 8 * i).assign(ast.reg(name)) for i, name in enumerate(names)]
    after, _ = run(body, seed=7)
    for i, name in enumerate(names):
        assert m.u64(DATA + 0x100 + 8 * i) == after[name], name


def test_reg_rsp_with_temporaries_pending():
    m = machine()
    run([var(0x60).assign(Const(1) + (Const(2) + ast.reg("rsp")))], live=frozenset({"flags", "rax"}))
    assert m.u64(DATA + 0x60) == STACK_TOP + 3


def operand(asm: str):
    insn = ARCH.decode_one(assemble(asm, 0x1000), 0x1000)
    return ARCH.call_operand(insn)


@pytest.mark.parametrize("asm,regs,table", [
    ("call rax", {"rax": 0x1234_5678_9ABC}, {}),
    ("call r11", {"r11": 0xFFFFFFFF81000000}, {}),
    (f"call qword ptr [rsi*8 + {DATA + 0x200:#x}]", {"rsi": 3}, {DATA + 0x218: 0xFFFFFFFF81002950}),
    ("call qword ptr [rbx + r12*4 + 0x10]", {"rbx": DATA + 0x300, "r12": 2}, {DATA + 0x318: 0xCAFE}),
    ("call qword ptr [rax + 8]", {"rax": DATA + 0x400}, {DATA + 0x408: 0xBEEF}),
    ("call qword ptr [rsp + 0x10]", {}, {STACK_TOP + 0x10: 0xF00D}),
])
def test_call_target_is_the_destination_the_call_would_take(asm, regs, table):
    m = machine()
    op = operand(asm)
    for address, value in table.items():
        m.put64(address, value)
    expected = next(iter(table.values())) if table else next(iter(regs.values()))
    for calls in (False, True):
        body = ([call(CALLEE)] if calls else []) + [var(0x68).assign(ast.call_target())]
        code = ARCH.compile_snippets(body, CODE, live=ALL_LIVE, abi=ABI, point_kind="callsite",
                                     call_operand=op)
        before = random_regs(random.Random(3), STACK_TOP)
        before.update(regs)
        after = m.run(code, CODE, before)
        assert after == before
        assert m.u64(DATA + 0x68) == expected, (asm, calls)


def test_call_target_rip_relative_is_an_absolute_load():
    m = machine()
    # call [rip + disp] at CODE - 0x100 refers to DATA + 0x500
    at = CODE - 0x100
    insn = ARCH.decode_one(assemble(f"call qword ptr [rip + {DATA + 0x500 - (at + 6):#x}]", at), at)
    m.put64(DATA + 0x500, 0x5151)
    code = ARCH.compile_snippets([var(0x70).assign(ast.call_target())], CODE, live=ALL_LIVE,
                                 abi=ABI, point_kind="callsite", call_operand=ARCH.call_operand(insn))
    m.run(code, CODE, random_regs(random.Random(1), STACK_TOP))
    assert m.u64(DATA + 0x70) == 0x5151


def test_a_local_address_is_a_buffer_of_the_frame_s_slots():
    """LocalAddress(s + n - 1) is the start of the n slots from s as one buffer,
    each slot 8 bytes above the next: a callee given it reads the slots' values
    in order (here the callee sums the six words it is pointed at)."""
    words = [0x11, 0x2200, 0x330000, 0x44 << 24, 0x55 << 32, 0x66 << 40]
    body = [ast.Local(i).assign(w) for i, w in enumerate(words)]
    # the buffer's k-th word is slot 5 - k
    args = [load(ast.LocalAddress(5) + 8 * k) for k in range(6)]
    snippet = ast.Frame(7, seq(*body, Var(DATA + 0x40).assign(
        call(CALLEE, *args)), Var(DATA + 0x48).assign(load(ast.LocalAddress(0)))))
    before = random_regs(random.Random(3), STACK_TOP)
    m = machine()
    code = ARCH.compile_snippets([snippet], CODE, live=ALL_LIVE, abi=None, point_kind="entry")
    m.write(DATA + 0x40, bytes(16))
    m.run(code, CODE, before)
    def u64(address: int) -> int:
        return int.from_bytes(m.read(address, 8), "little")

    recorded = [u64(DATA + 0x800 + 8 * k) for k in range(6)]
    assert recorded == list(reversed(words)) and u64(DATA + 0x40) == sum(words)
    assert u64(DATA + 0x48) == words[0]
