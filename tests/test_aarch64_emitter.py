"""Generated AArch64 snippet code, run in unicorn: effects right (against a Python
reference of the snippet semantics), live registers, sp and flags kept."""

from __future__ import annotations

import random

import capstone
import keystone
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aarch64_machine import GPRS, NZCV_MASK, Machine, random_regs
from unicorn import arm64_const as a64

from ksim.arch.aarch64 import ARCH
from ksim.arch.aarch64.emitter import BASE_CLOBBERS, AArch64Emitter
from ksim.arch.aarch64.reader import decode
from ksim.arch.base import CallOperand
from ksim.core import KernelABI, MemRef, Region
from ksim.errors import CodegenError
from ksim.snippets import ast
from ksim.snippets.ast import (
    BinOp,
    Compare,
    Const,
    Guard,
    Guarded,
    Var,
    arg,
    call,
    call_target,
    comm,
    compare_exchange,
    cpu,
    elem,
    frame,
    if_,
    land,
    lnot,
    load,
    local,
    lor,
    pid,
    reg,
    retval,
    tgid,
    tsc,
)
from ksim.snippets.codegen import compile_snippets

MASK = (1 << 64) - 1
ALL_LIVE = frozenset(ARCH.all_regs)
CODE = 0xFFFF800010000000
CALLEE = 0xFFFF800010800000
NOFAULT = CALLEE + 0x400
DATA = 0xFFFF800011000000
PERCPU = 0xFFFF800012000000                  # this cpu's per-cpu area (TPIDR_EL1)
STACK = 0xFFFF800013000000
STACK_TOP = STACK + 0x8000
ABI = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10, task_pid_size=4,
                task_tgid_offset=0x14, task_comm_offset=0x20,
                cpu_number=MemRef(DATA + 0x108, size=4))
PERCPU_ABI = KernelABI(current_task=MemRef(0x40, segment="gs"), task_pid_offset=0x18,
                       task_pid_size=4, cpu_number=MemRef(0x48, segment="gs", size=4))
_ks = keystone.Ks(keystone.KS_ARCH_ARM64, keystone.KS_MODE_LITTLE_ENDIAN)
_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)

# The callee records x0..x7 and its sp at entry, trashes every caller-saved register
# and the flags, and returns the sum of its (at most six) arguments.
CALLEE_ASM = "; ".join(
    [f"mov x16, #{(DATA + 0x800) & 0xFFFF:#x}", f"movk x16, #{(DATA >> 16) & 0xFFFF:#x}, lsl #16",
     f"movk x16, #{(DATA >> 32) & 0xFFFF:#x}, lsl #32", f"movk x16, #{DATA >> 48:#x}, lsl #48"]
    + [f"str x{n}, [x16, #{8 * n}]" for n in range(8)]
    + ["mov x17, sp", "str x17, [x16, #64]", "add x0, x0, x1", "add x0, x0, x2", "add x0, x0, x3",
       "add x0, x0, x4", "add x0, x0, x5"]
    + [f"mov x{n}, #{0x5500 + n}" for n in range(1, 19)]
    + ["cmp x1, x2", "ret"])
# copy_from_kernel_nofault(dst=x0, src=x1, size=x2): copies from DATA's page only
NOFAULT_ASM = "; ".join([
    f"mov x4, #{DATA & 0xFFFF:#x}", f"movk x4, #{(DATA >> 16) & 0xFFFF:#x}, lsl #16",
    f"movk x4, #{(DATA >> 32) & 0xFFFF:#x}, lsl #32", f"movk x4, #{DATA >> 48:#x}, lsl #48",
    "sub x5, x1, x4", "cmp x5, #0xff8", "b.hi fault",
    "copy: cbz x2, done", "ldrb w3, [x1], #1", "strb w3, [x0], #1", "sub x2, x2, #1", "b copy",
    "done: mov x0, #0", "ret",
    "fault: mov x0, #-14", "ret"])

_machine: list[Machine] = []


def machine() -> Machine:
    if not _machine:
        m = Machine({CODE: 0x10000, CALLEE: 0x1000, DATA: 0x1000, PERCPU: 0x1000, STACK: 0x10000})
        m.write(CALLEE, bytes(_ks.asm(CALLEE_ASM, CALLEE)[0]))
        m.write(NOFAULT, bytes(_ks.asm(NOFAULT_ASM, NOFAULT)[0]))
        m.uc.reg_write(a64.UC_ARM64_REG_TPIDR_EL1, PERCPU)
        _machine.append(m)
    return _machine[0]


def compile_(snippets, *, live=ALL_LIVE, abi=ABI, point_kind="entry", at=CODE, **kw) -> bytes:
    return ARCH.compile_snippets(snippets, at, live=frozenset(live), abi=abi, point_kind=point_kind,
                                 **kw)


def run(snippets, *, live=ALL_LIVE, abi=ABI, point_kind="entry", regs=None, seed=0, **kw):
    """Compile, run once with random registers; check live registers, sp and flags."""
    m = machine()
    code = compile_(snippets, live=live, abi=abi, point_kind=point_kind, **kw)
    m.write(CODE, code)
    before = random_regs(random.Random(seed), STACK_TOP)
    before.update(regs or {})
    after = m.run(CODE, CODE + len(code), before, count=1_000_000)
    for name in set(live) | {"sp"}:
        mask = NZCV_MASK if name == "nzcv" else MASK
        assert after[name] & mask == before[name] & mask, \
            f"{name} changed: {before[name]:#x} -> {after[name]:#x}"
    return after, code


def var(offset: int, size: int = 8, signed: bool = False) -> Var:
    return Var(DATA + offset, size, signed)


def listing(code: bytes, at: int = CODE) -> list[str]:
    return [f"{i.mnemonic} {i.op_str}".strip() for i in _cs.disasm(code, at)]


# --- the reference semantics (ksim.snippets.ast module doc) ------------------------------------
def signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def ref_binop(op: str, a: int, b: int) -> int:
    sa, sb = signed(a), signed(b)
    if op == "div":
        if sb == 0:
            return MASK
        q = abs(sa) // abs(sb) * (1 if (sa < 0) == (sb < 0) else -1)
        return q & MASK
    if op == "mod":
        if sb == 0:
            return a & MASK
        q = abs(sa) // abs(sb) * (1 if (sa < 0) == (sb < 0) else -1)
        return (sa - q * sb) & MASK
    return {
        "add": a + b, "sub": a - b, "mul": a * b, "and": a & b, "or": a | b, "xor": a ^ b,
        "shl": a << (b & 63), "sar": sa >> (b & 63), "shr": (a & MASK) >> (b & 63),
    }[op] & MASK


def ref_compare(op: str, a: int, b: int) -> int:
    sa, sb = signed(a), signed(b)
    return int({"eq": a == b, "ne": a != b, "lt": sa < sb, "le": sa <= sb, "gt": sa > sb,
                "ge": sa >= sb, "ult": a < b, "ule": a <= b, "ugt": a > b, "uge": a >= b}[op])


EDGES = [0, 1, 2, 3, 63, 64, 0xFFF, 0x1000, 2**31, 2**32, 2**63 - 1, 2**63, MASK, MASK - 1]
values = st.sampled_from(EDGES) | st.integers(0, MASK)
BINOPS = ["add", "sub", "mul", "div", "mod", "and", "or", "xor", "shl", "sar", "shr"]
COMPARES = ["eq", "ne", "lt", "le", "gt", "ge", "ult", "ule", "ugt", "uge"]


# --- values -------------------------------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(op=st.sampled_from(BINOPS), a=values, b=values, immediate=st.booleans())
def test_binary_operators_match_the_reference(op, a, b, immediate):
    immediate = immediate and not (op in ("div", "mod") and b == 0)   # refused by the check
    m = machine()
    m.put64(DATA, a)
    m.put64(DATA + 8, b)
    right = Const(b) if immediate else var(8)
    run([var(16).assign(BinOp(op, var(0), right))])
    assert m.u64(DATA + 16) == ref_binop(op, a, b)


@settings(max_examples=80, deadline=None)
@given(op=st.sampled_from(COMPARES), a=values, b=values | st.integers(-4095, 4095),
       immediate=st.booleans())
def test_comparisons_match_the_reference(op, a, b, immediate):
    m = machine()
    b &= MASK
    m.put64(DATA, a)
    m.put64(DATA + 8, b)
    right = Const(b) if immediate else var(8)
    run([var(16).assign(Compare(op, var(0), right))])
    assert m.u64(DATA + 16) == ref_compare(op, a, b)


@pytest.mark.parametrize("a", [0, 1, 5, MASK, 2**63])
def test_unary_operators(a):
    m = machine()
    m.put64(DATA, a)
    run([var(8).assign(-var(0)), var(16).assign(~var(0)), var(24).assign(lnot(var(0)))])
    assert (m.u64(DATA + 8), m.u64(DATA + 16), m.u64(DATA + 24)) == (-a & MASK, ~a & MASK, int(a == 0))


def test_narrow_variables_wrap_and_extend():
    m = machine()
    m.put64(DATA, MASK)
    m.put64(DATA + 8, 0)
    b, w, out = var(0, 1), var(1, 2, signed=True), var(8)
    run([b.assign(b + 1), out.assign(w)])
    assert m.read(DATA, 1) == b"\x00"          # 0xff + 1 wrapped in one byte
    assert m.u64(DATA + 8) == MASK             # 0xffff sign-extended


@pytest.mark.parametrize("size,signed_", [(1, False), (1, True), (2, False), (2, True),
                                          (4, False), (4, True), (8, False)])
def test_loads_extend_and_stores_write_the_low_bytes(size, signed_):
    m = machine()
    m.write(DATA, bytes([0x80 | size]) * 8)
    m.put64(DATA + 8, 0)
    m.put64(DATA + 16, MASK)
    run([var(8).assign(var(0, size, signed_)), var(16, size).assign(0)])
    raw = int.from_bytes(bytes([0x80 | size]) * size, "little")
    expected = (raw - (1 << 8 * size)) & MASK if signed_ and size < 8 else raw
    assert m.u64(DATA + 8) == expected
    assert m.u64(DATA + 16) == MASK & ~((1 << 8 * size) - 1)


def test_control_flow_and_short_circuit():
    m = machine()
    for x in (0, 1, 7):
        m.put64(DATA, x)
        m.put64(DATA + 16, 0)
        hit = var(16).assign(var(16) + 1)        # counts evaluations of the right side
        run([var(8).assign(if_(var(0) > 3, 100, 200)),
             var(24).assign(land(var(0), seq_value(hit))),
             var(32).assign(lor(var(0), seq_value(hit)))])
        assert m.u64(DATA + 8) == (100 if x > 3 else 200)
        assert m.u64(DATA + 24) == int(x != 0)
        assert m.u64(DATA + 32) == 1
        assert m.u64(DATA + 16) == 1             # land's right side when x, lor's when not


def seq_value(node):
    """``node`` as an expression that yields 1."""
    return ast.seq(node, 1)


# --- memory: tables, frames, loads through pointers -----------------------------------------------
@pytest.mark.parametrize("index,expected", [(0, 0), (2, 2), (3, 3), (4, 3), (MASK, 3)])
def test_elements_are_clamped(index, expected):
    m = machine()
    table = DATA + 0x200
    for i in range(4):
        m.put64(table + 4 * i, 0)
    m.put64(DATA, index)
    run([elem(table, 4, var(0), size=4).assign(7)])
    got = [int.from_bytes(m.read(table + 4 * i, 4), "little") for i in range(4)]
    assert got == [7 if i == expected else 0 for i in range(4)]


def test_frame_locals_start_at_zero_and_are_private():
    m = machine()
    m.put64(DATA, 5)
    run([var(8).assign(frame(2, local(0).assign(var(0) * 2), local(1).assign(local(0) + local(1) + 1),
                              local(1)))])
    assert m.u64(DATA + 8) == 11


def test_checked_load_reads_inside_the_regions_and_zero_outside():
    m = machine()
    abi = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10,
                    readable=(Region(DATA, DATA + 0x100), Region(PERCPU, PERCPU + 0x10)))
    m.put64(DATA + 0x40, 0x1122334455667788)
    m.put64(PERCPU + 8, 0x99)
    for ptr, expected in ((DATA + 0x40, 0x1122334455667788), (DATA + 0xF8, m.u64(DATA + 0xF8)),
                          (DATA + 0xF9, 0), (DATA - 8, 0), (PERCPU + 8, 0x99), (0, 0)):
        m.put64(DATA + 0x300, ptr)
        run([var(0x308).assign(load(var(0x300)))], abi=abi)
        assert m.u64(DATA + 0x308) == expected, hex(ptr)


def test_nofault_load_calls_the_function_and_reads_zero_on_failure():
    m = machine()
    abi = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10, read_nofault=NOFAULT)
    m.put64(DATA + 0x40, 0xFEDCBA9876543210)
    for ptr, size, signed_, expected in ((DATA + 0x40, 8, False, 0xFEDCBA9876543210),
                                         (DATA + 0x40, 2, True, 0x3210),
                                         (DATA + 0x47, 1, True, 0xFFFFFFFFFFFFFFFE),
                                         (STACK, 8, False, 0)):
        m.put64(DATA + 0x300, ptr)
        run([var(0x308).assign(load(var(0x300), size, signed_))], abi=abi)
        assert m.u64(DATA + 0x308) == expected


# --- atomics ---------------------------------------------------------------------------------------
def test_atomic_increment_is_an_exclusive_loop_without_flags():
    m = machine()
    m.put64(DATA, 41)
    c = var(0)
    _, code = run([c.atomic_assign(c + 1)], live=frozenset({"nzcv"}))
    assert m.u64(DATA) == 42
    text = listing(code)
    assert [t.split()[0] for t in text[-4:]] == ["ldaxr", "add", "stlxr", "cbnz"]
    assert not any("nzcv" in t for t in text)       # no flag is touched: none saved


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_atomic_updates_of_every_size(size):
    m = machine()
    m.put64(DATA, 0xF0F0F0F0F0F0F0F0)
    m.put64(DATA + 8, 0)
    v = var(0, size)
    run([var(8).assign(v.atomic_assign(v - 1)), v.atomic_assign(v * 3)])
    bits = 8 * size
    start = 0xF0F0F0F0F0F0F0F0 & ((1 << bits) - 1)
    assert m.u64(DATA + 8) == (start - 1) & ((1 << bits) - 1)
    assert m.u64(DATA) & ((1 << bits) - 1) == (start - 1) * 3 & ((1 << bits) - 1)
    assert m.u64(DATA) >> bits == 0xF0F0F0F0F0F0F0F0 >> bits if size < 8 else True


@pytest.mark.parametrize("size", [1, 4, 8])
def test_compare_exchange(size):
    m = machine()
    m.put64(DATA, 0x1111111111111111)
    mask = (1 << 8 * size) - 1
    v = var(0, size)
    run([var(8).assign(compare_exchange(v, 0x22, 0x33)),             # fails: no store
         var(16).assign(compare_exchange(v, 0x1111111111111111, 0x44))])  # low bytes match
    assert m.u64(DATA + 8) == 0x1111111111111111 & mask
    assert m.u64(DATA + 16) == 0x1111111111111111 & mask
    assert m.u64(DATA) & mask == 0x44


def test_atomic_table_elements():
    m = machine()
    table = DATA + 0x400
    for i in range(4):
        m.put64(table + 8 * i, i)
    m.put64(DATA, 2)
    e = elem(table, 4, var(0))
    run([e.atomic_assign(e + 10), e.atomic_assign(e * 2),
         var(8).assign(compare_exchange(elem(table, 4, Const(1)), 1, 5))])
    assert [m.u64(table + 8 * i) for i in range(4)] == [0, 5, 24, 3]
    assert m.u64(DATA + 8) == 1


# --- the point's registers --------------------------------------------------------------------------
def test_point_registers_arguments_and_sp():
    m = machine()
    regs = {"x0": 10, "x3": 33, "x9": 99, "x30": 0x3030}
    run([var(0).assign(arg(0) + arg(3)), var(8).assign(reg("x9")), var(16).assign(reg("sp")),
         var(24).assign(reg("x30"))], regs=regs, live=frozenset({"x0"}))
    assert (m.u64(DATA), m.u64(DATA + 8), m.u64(DATA + 16), m.u64(DATA + 24)) == (
        43, 99, STACK_TOP, 0x3030)


def test_point_flags_register():
    m = machine()
    run([var(0).assign(reg("nzcv"))], regs={"nzcv": 0xA000_0000})
    assert m.u64(DATA) == 0xA000_0000


def test_return_value_at_an_exit():
    m = machine()
    run([var(0).assign(retval() * 2)], point_kind="exit", regs={"x0": 21})
    assert m.u64(DATA) == 42


def test_call_target_of_an_indirect_call():
    m = machine()
    run([var(0).assign(call_target())], point_kind="callsite", regs={"x3": 0xABC},
        call_operand=CallOperand(reg="x3"))
    assert m.u64(DATA) == 0xABC


def test_point_register_read_directly_when_untouched():
    code = compile_([var(0x20).assign(arg(4))], live=frozenset({"x4"}))
    assert listing(code)[0] == "mov x9, x4"


# --- calls -------------------------------------------------------------------------------------------
def test_call_passes_arguments_in_x0_to_x5_and_returns_x0():
    m = machine()
    after, code = run([var(0).assign(call(CALLEE, 1, 2, 3, arg(2), 5, 6))], regs={"x2": 40})
    assert m.u64(DATA) == 1 + 2 + 3 + 40 + 5 + 6
    assert [m.u64(DATA + 0x800 + 8 * n) for n in range(6)] == [1, 2, 3, 40, 5, 6]
    assert m.u64(DATA + 0x840) % 16 == 0                     # sp aligned at the callee's entry
    assert "blr x16" in listing(code)


@settings(max_examples=20, deadline=None)
@given(depth=st.integers(0, 5))
def test_call_inside_temporaries_keeps_sp_aligned(depth):
    m = machine()
    expr = call(CALLEE, 1, 0, 0, 0, 0, 0)                   # the callee sums six arguments
    for i in range(depth):
        expr = Const(i) + expr
    run([var(0).assign(expr)])
    assert m.u64(DATA) == 1 + sum(range(depth))
    assert m.u64(DATA + 0x840) % 16 == 0


# --- kernel ABI ----------------------------------------------------------------------------------------
def test_task_fields_through_the_abi():
    m = machine()
    task = DATA + 0x200
    m.put64(DATA + 0x100, task)
    m.write(task + 0x10, (1234).to_bytes(4, "little") + (77).to_bytes(4, "little"))
    m.write(task + 0x20, b"swapper/0\0\0\0\0\0\0\0")
    m.write(DATA + 0x108, (3).to_bytes(4, "little"))
    run([var(0).assign(pid()), var(8).assign(tgid()), var(16).assign(comm(0)), var(24).assign(cpu())])
    assert (m.u64(DATA), m.u64(DATA + 8), m.read(DATA + 16, 8), m.u64(DATA + 24)) == (
        1234, 77, b"swapper/", 3)


def test_per_cpu_variables_are_relative_to_tpidr_el1():
    m = machine()
    task = DATA + 0x200
    m.put64(PERCPU + 0x40, task)
    m.write(task + 0x18, (4321).to_bytes(4, "little"))
    m.write(PERCPU + 0x48, (5).to_bytes(4, "little"))
    pc = Var(0x80, 8, segment="gs")
    m.put64(PERCPU + 0x80, 10)
    _, code = run([var(0).assign(pid()), var(8).assign(cpu()), pc.assign(pc + 1),
                   pc.atomic_assign(pc + 2)], abi=PERCPU_ABI)
    assert (m.u64(DATA), m.u64(DATA + 8), m.u64(PERCPU + 0x80)) == (4321, 5, 13)
    assert "mrs x9, tpidr_el1" in listing(code)


def test_per_cpu_register_is_selectable():
    e = AArch64Emitter(CODE, percpu_sysreg="tpidr_el2")
    e.begin(frozenset(), False)
    e.load(0x10, 8, False, "gs")
    assert listing(e.end())[0] == "mrs x9, tpidr_el2"


def test_guarded_body_runs_once_and_counts_a_miss():
    m = machine()
    g = Guard(DATA + 0x500, slots=1)
    for a in (g.missed, g.flag(0), DATA + 0x530):
        m.put64(a, 0)
    body = var(0x530).assign(var(0x530) + 1)
    run([Guarded(body, g)])
    assert (m.u64(DATA + 0x530), m.u64(g.flag(0)), m.u64(g.missed)) == (1, 0, 0)
    m.put64(g.flag(0), 1)                                     # held: missed
    run([Guarded(body, g)])
    assert (m.u64(DATA + 0x530), m.u64(g.missed)) == (1, 1)


def test_cycle_counter():
    m = machine()
    run([var(0).assign(tsc()), var(8).assign(tsc())])
    assert 0 < m.u64(DATA) <= m.u64(DATA + 8)


# --- frames, registers and flags kept ---------------------------------------------------------------
SAMPLES = [
    lambda: var(0).assign(var(0) + 1),
    lambda: var(0).atomic_assign(var(0) + var(8)),
    lambda: var(0).atomic_assign(var(0) * 3 + 1),
    lambda: var(8).assign(var(0) / 7 + var(0) % 5),
    lambda: var(8).assign(tsc()),
    lambda: var(8).assign(call(CALLEE, 1, 2, 3, 4, 5, 6)),
    lambda: if_(var(0) > 3, var(8).assign(pid() << 2), var(8).assign(cpu())),
    lambda: var(8).assign(arg(0) + arg(3) + arg(5)),
    lambda: var(8).assign(reg("x9") + reg("x12") + reg("nzcv")),
]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(SAMPLES) - 1), live=st.sets(st.sampled_from(sorted(ARCH.all_regs))),
       seed=st.integers(0, 2**32))
def test_live_registers_and_flags_preserved(which, live, seed):
    machine().put64(DATA + 0x100, DATA + 0x200)              # current task -> a task
    run([SAMPLES[which]()], live=live | {"x19"}, seed=seed)


def test_flags_saved_only_when_live_and_clobbered():
    s = [var(0).assign(var(0) + 1)]
    assert not any("nzcv" in t for t in listing(compile_(s, live=frozenset({"nzcv"}))))
    s = [var(0).assign(var(0) / 3)]                          # cmp: the flags are written
    text = listing(compile_(s, live=frozenset({"nzcv"})))
    assert text[:3] == ["sub sp, sp, #0x10", "mrs x9, nzcv", "str x9, [sp]"]
    assert text[-3:] == ["ldr x9, [sp]", "msr nzcv, x9", "add sp, sp, #0x10"]
    text = listing(compile_(s, live=frozenset({"nzcv", "x9"})))
    assert text[:4] == ["sub sp, sp, #0x10", "str x9, [sp]", "mrs x9, nzcv", "str x9, [sp, #8]"]
    assert text[-4:] == ["ldr x9, [sp, #8]", "msr nzcv, x9", "ldr x9, [sp]", "add sp, sp, #0x10"]
    assert not any("nzcv" in t for t in listing(compile_(s, live=frozenset())))


def test_saves_exactly_the_clobbered_live_registers():
    s = [var(0).assign(var(0) + 1)]
    # x0..x8 and the callee-saved registers are never clobbered without a call
    code = compile_(s, live=frozenset({"x0", "x19", "x29", "x30"}))
    assert listing(code)[0].startswith("mov x9")
    text = listing(compile_(s, live=frozenset({"x9", "x11", "x12"})))
    assert text[:2] == ["sub sp, sp, #0x10", "stp x9, x11, [sp]"]           # x12 never written
    assert text[-2:] == ["ldp x9, x11, [sp]", "add sp, sp, #0x10"]


def test_same_input_same_bytes_and_a_length_independent_of_the_address():
    s = [var(0).atomic_assign(var(0) * 3), if_(pid() == 7, call(CALLEE, 1, arg(2)))]
    first = compile_(s)
    assert compile_(list(s)) == first
    assert len(compile_(s, at=CODE + 0x1234_5678)) == len(first)


def test_clobbers_and_writes():
    e = AArch64Emitter(CODE)
    assert e.clobbers(False) == BASE_CLOBBERS == {"x9", "x10", "x11", "x12", "x13", "nzcv"}
    assert e.clobbers(True) >= {f"x{n}" for n in range(19)} | {"x30", "nzcv"}
    code = compile_snippets(ARCH, [var(0).assign(var(0) + 1)], lambda: e, live=frozenset())
    assert e.writes() == {"x9", "x11"}
    assert sum(1 for _ in decode(code, CODE)) * 4 == len(code)


def test_calls_need_a_calling_frame():
    e = AArch64Emitter(CODE)
    e.begin(frozenset(), False)
    with pytest.raises(CodegenError):
        e.call(CALLEE, 0)
    with pytest.raises(CodegenError):
        e.load_nofault(CALLEE, 8, False)


def test_unknown_segment_and_live_register_are_refused():
    e = AArch64Emitter(CODE)
    e.begin(frozenset(), False)
    with pytest.raises(CodegenError):
        e.load(0, 8, False, "fs")
    with pytest.raises(CodegenError):
        compile_([var(0).assign(1)], live=frozenset({"rax"}))


def test_random_registers_include_every_gpr():
    assert set(random_regs(random.Random(0), STACK_TOP)) == set(GPRS) | {"sp", "nzcv"}


def test_samples_in_a_row_each_stop_at_their_end():
    """Many snippets run one after another at one address: blocks translated for an
    earlier, longer one and chained to must not carry a run past its end."""
    rng = random.Random(1)
    regs = sorted(ARCH.all_regs)
    machine().put64(DATA + 0x100, DATA + 0x200)
    for _ in range(120):
        which = rng.randrange(len(SAMPLES))
        live = set(rng.sample(regs, rng.randrange(len(regs))))
        run([SAMPLES[which]()], live=live | {"x19"}, seed=rng.getrandbits(32))
