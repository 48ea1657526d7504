"""The snippet nodes ``ksim trace`` compiles maps to: Frame/Local (scratch variables on
the snippet's stack), Elem (a table element at a computed, clamped index) and
CompareExchange (one lock cmpxchg), run in the snippet machine; their static
check and their verification."""

from __future__ import annotations

import random

import pytest
from snippet_machine import Machine, random_regs

from ksim.arch import get_arch
from ksim.core import KernelABI, MemRef, Region
from ksim.errors import (
    BadOperand,
    NotAssignable,
    ReadOutsideKnownMemory,
    SlotError,
    WriteOutsideHeap,
)
from ksim.snippets import Rules, check, verify
from ksim.snippets.ast import (
    Const,
    Var,
    arg,
    compare_exchange,
    elem,
    frame,
    if_,
    local,
    seq,
)

ARCH = get_arch("x86_64")
ALL_LIVE = frozenset(ARCH.all_regs)
CODE, DATA, STACK = 0x1000000, 0x2000000, 0x3000000
STACK_TOP = STACK + 0x8000 - 0x18
ABI = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10,
                cpu_number=MemRef(DATA + 0x108, size=4), readable=(Region(DATA, DATA + 0x1000),))
TABLE = DATA + 0x400           # 8 words
OUT = DATA + 0x800

_machine: Machine | None = None


def machine() -> Machine:
    global _machine
    if _machine is None:
        _machine = Machine({CODE: 0x10000, DATA: 0x1000, STACK: 0x10000})
    return _machine


def run(snippets, *, regs=None, live=ALL_LIVE, seed=0, point_kind="entry"):
    m = machine()
    code = ARCH.compile_snippets(snippets, CODE, live=live, abi=ABI, point_kind=point_kind)
    before = random_regs(random.Random(seed), STACK_TOP)
    before.update(regs or {})
    after = m.run(code, CODE, before)
    for reg in set(live) | {"rsp"}:
        assert after[reg] == before[reg], reg
    return code


def words(address: int, n: int) -> list[int]:
    return [machine().u64(address + 8 * i) for i in range(n)]


def clear() -> None:
    machine().write(DATA, bytes(0x1000))


def out(i: int = 0) -> Var:
    return Var(OUT + 8 * i)


# --- Frame and Local ---------------------------------------------------------------------
def test_locals_start_at_zero_and_hold_values():
    clear()
    body = frame(3, out(0).assign(local(2)), local(0).assign(arg(0) + 1),
                 local(1).assign(local(0) * 10), out(1).assign(local(1) + local(0)))
    run([body], regs={"rdi": 4})
    assert words(OUT, 2) == [0, 55]


def test_a_frame_yields_its_body_and_leaves_the_stack_balanced():
    clear()
    run([out(0).assign(frame(2, local(1).assign(7), local(1) + 1))], seed=3)
    assert words(OUT, 1) == [8]


# --- Elem --------------------------------------------------------------------------------
def test_elem_reads_and_writes_at_a_computed_index():
    clear()
    t = [elem(TABLE, 8, arg(0) + i) for i in range(2)]
    run([t[0].assign(11), t[1].assign(t[0] + 1)], regs={"rdi": 3})
    assert words(TABLE, 8) == [0, 0, 0, 11, 12, 0, 0, 0]


def test_elem_index_is_clamped_to_the_table():
    clear()
    for index in (8, 1000, -1):
        run([elem(TABLE, 8, arg(0)).assign(elem(TABLE, 8, arg(0)) + 1)], regs={"rdi": index & (2**64 - 1)})
    assert words(TABLE, 9) == [0] * 7 + [3, 0]


def test_narrow_elements():
    clear()
    machine().put64(TABLE, 0xFFFF_FFFF_FFFF_FFFF)
    e = elem(TABLE, 4, 1, size=2, signed=True)
    run([e.assign(-2), out(0).assign(e), out(1).assign(elem(TABLE, 4, 1, size=2))])
    assert words(OUT, 2) == [2**64 - 2, 0xFFFE]
    assert words(TABLE, 1) == [0xFFFF_FFFF_FFFE_FFFF]


def test_atomic_elem_add_is_a_locked_add_and_other_updates_a_cmpxchg_loop():
    clear()
    e = elem(TABLE, 8, arg(0))
    code = run([e.atomic_assign(e + arg(1))], regs={"rdi": 2, "rsi": 5})
    assert bytes([0xF0, 0x48, 0x01]) in code                    # lock add [rdx], rax
    code = run([out(0).assign(e.atomic_assign(if_(arg(1) > e, arg(1), e)))],
               regs={"rdi": 2, "rsi": 9})
    assert bytes([0xF0, 0x48, 0x0F, 0xB1]) in code              # lock cmpxchg
    assert words(TABLE, 3)[2] == 9 and words(OUT, 1) == [9]
    run([out(1).assign(e.atomic_assign(e - 4))], regs={"rdi": 2})
    assert words(TABLE, 3)[2] == 5 and words(OUT, 2)[1] == 5


# --- CompareExchange ---------------------------------------------------------------------
def test_compare_exchange_stores_only_over_the_expected_value():
    clear()
    t = elem(TABLE, 8, 5)
    run([out(0).assign(compare_exchange(t, 0, 42)), out(1).assign(compare_exchange(t, 0, 43)),
         out(2).assign(compare_exchange(out(3), 0, 1))])
    assert words(TABLE, 8)[5] == 42
    assert words(OUT, 4) == [0, 42, 0, 1]


# --- check and verify --------------------------------------------------------------------
@pytest.mark.parametrize("snippet,error", [
    (local(0), SlotError),                                              # outside a Frame
    (frame(1, local(1)), BadOperand),                                   # past its slots
    (frame(1, frame(1, local(0))), SlotError),                          # nested
    (frame(1, local(0).atomic_assign(local(0) + 1)), NotAssignable),
    (elem(TABLE, 0, 0), BadOperand),
    (elem(TABLE, 4, 0, size=3), BadOperand),
    (elem(TABLE, 4, out(0).assign(1)), SlotError),                       # index with an effect
    (compare_exchange(Const(1), 0, 1), NotAssignable),
    (compare_exchange(Var(8, segment="gs"), 0, 1), NotAssignable),
    (elem(TABLE, 4, 0).atomic_assign(seq(elem(TABLE, 4, 1).assign(1), 2)), SlotError),
    (frame(1, elem(TABLE, 4, local(0)).atomic_assign(seq(local(0).assign(1), 2))), SlotError),
])
def test_check_refuses(snippet, error):
    with pytest.raises(error):
        check(snippet, "entry")


def rules(block=(TABLE, 64)) -> Rules:
    return Rules(writable=(block,), readable=(), abi=ABI)


def test_verifier_proves_a_whole_table_inside_a_heap_block():
    ok = frame(1, local(0).assign(arg(0)), elem(TABLE, 8, local(0)).atomic_assign(elem(TABLE, 8, local(0)) + 1),
               compare_exchange(elem(TABLE, 8, 1), 0, 1))
    verify([ok], rules())
    for bad in (elem(TABLE, 9, 0).assign(1), compare_exchange(elem(TABLE + 8, 8, 0), 0, 1)):
        with pytest.raises(WriteOutsideHeap):
            verify([bad], rules())
    with pytest.raises(ReadOutsideKnownMemory):      # a table past the kernel's memory map
        verify([elem(TABLE, 8, 0).assign(elem(DATA + 0x1000 - 8, 2, 0))], rules())
