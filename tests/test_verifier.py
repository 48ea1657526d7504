"""The snippet verifier: refusals by cause before anything is compiled; fault-safe
loads and the recursion guard run in unicorn (the snippet machine, and the toy
kernel through the Manager)."""

from __future__ import annotations

import dataclasses
import random

import keystone
import pytest
from snippet_machine import Machine, random_regs

from ksim.arch import get_arch
from ksim.arch.x86_64.writer import Mem, Writer
from ksim.core import KernelABI, MemRef, Region
from ksim.errors import (
    CallNotAllowed,
    NoRecursionGuard,
    ReadOutsideKnownMemory,
    SlotError,
    SnippetError,
    UnsafeLoad,
    VerifierError,
    WriteOutsideHeap,
    all_error_classes,
)
from ksim.snippets import Guard, Guarded, Rules, check, verify
from ksim.snippets.ast import Const, Load, Var, arg, call, cpu, load, same, seq

ARCH = get_arch("x86_64")
ALL_LIVE = frozenset(ARCH.all_regs)

# the snippet machine's memory: code, a fault-safe reader, data, stack
CODE, READER, DATA, STACK = 0x1000000, 0x1100000, 0x2000000, 0x3000000
STACK_TOP = STACK + 0x8000 - 0x18          # deliberately not 16-aligned
UNMAPPED = 0x5000000                       # in no region of the machine: a read faults
CPU_NUMBER = MemRef(DATA + 0x108, size=4)
PLAIN = KernelABI(current_task=MemRef(DATA + 0x100), task_pid_offset=0x10, cpu_number=CPU_NUMBER)
CHECKED = dataclasses.replace(PLAIN, readable=(Region(DATA, DATA + 0x1000),))
NOFAULT = dataclasses.replace(PLAIN, read_nofault=READER)

BLOCK = (DATA + 0x200, 0x20)               # a heap block the session owns
GUARD = Guard(DATA + 0x800, slots=4)
TEXT = (0xFFFFFFFF81000000, 0x5000)


def rules(abi: KernelABI = CHECKED, **kw) -> Rules:
    base = dict(writable=(BLOCK,), readable=(TEXT,), text=(TEXT,), calls={READER: "reader"},
                guard=GUARD, abi=abi)
    base.update(kw)
    return Rules(**base)


def var(offset: int, size: int = 8, signed: bool = False) -> Var:
    return Var(BLOCK[0] + offset, size, signed)


# --- refusals, by cause -----------------------------------------------------------------------
@pytest.mark.parametrize("snippet,error,words", [
    (Var(TEXT[0]).assign(1), WriteOutsideHeap, "kernel text"),
    (Var(TEXT[0] + 0x10, 1).atomic_assign(Var(TEXT[0] + 0x10, 1) + 1), WriteOutsideHeap, "kernel text"),
    (Var(BLOCK[0] + 0x1C, 8).assign(1), WriteOutsideHeap, "runs past"),
    (Var(BLOCK[0] - 4, 8).assign(1), WriteOutsideHeap, "runs past"),
    (Var(DATA + 0x600).assign(1), WriteOutsideHeap, "not inside a heap block"),
    (Var(0x10, segment="gs").assign(1), WriteOutsideHeap, "per-cpu"),
    (Var(GUARD.flag(2)).assign(0), WriteOutsideHeap, "recursion guard"),
    (seq(var(0).assign(1), Var(TEXT[0]).assign(var(0))), WriteOutsideHeap, "kernel text"),
    (call(0xFFFFFFFF81001234), CallNotAllowed, "0xffffffff81001234"),
    (var(0).assign(call(READER, call(READER + 0x40))), CallNotAllowed, "allow_calls"),
    (var(0).assign(Var(UNMAPPED)), ReadOutsideKnownMemory, "memory map"),
    (var(0).assign(load(UNMAPPED, 4)), ReadOutsideKnownMemory, "memory map"),
    (var(0).assign(Var(0x5000, segment="gs")), ReadOutsideKnownMemory, "per-cpu"),
])
def test_refusals_are_specific(snippet, error, words):
    check(snippet, "entry")
    with pytest.raises(error, match=words):
        verify([snippet], rules())


def test_a_dynamic_load_without_a_safe_mechanism_is_refused():
    s = var(0).assign(load(var(8)))
    with pytest.raises(UnsafeLoad):
        verify([s], rules(PLAIN))
    with pytest.raises(UnsafeLoad):
        verify([s], rules(None))
    # a constant read outside known memory: no way to make it safe either
    with pytest.raises(ReadOutsideKnownMemory, match="no fault-safe read"):
        verify([var(0).assign(Var(UNMAPPED))], rules(PLAIN))


def test_a_call_needs_the_guard():
    with pytest.raises(NoRecursionGuard):
        verify([call(READER)], rules(guard=None))
    # a load through read_nofault is a call too
    with pytest.raises(NoRecursionGuard):
        verify([var(0).assign(load(var(8)))], rules(NOFAULT, guard=None))


def test_a_hand_written_guard_is_refused():
    with pytest.raises(SlotError):
        verify([seq(Guarded(var(0).assign(1), GUARD))], rules())


def test_error_classes_have_distinct_wire_codes():
    classes = (VerifierError, WriteOutsideHeap, ReadOutsideKnownMemory, UnsafeLoad, CallNotAllowed,
               NoRecursionGuard)
    registered = all_error_classes()
    assert len({c.code for c in classes}) == len(classes)
    for c in classes:
        assert issubclass(c, SnippetError) and registered[c.code] is c


# --- what verify returns ----------------------------------------------------------------------------
def test_writes_inside_owned_blocks_pass_unchanged():
    s = [var(0).assign(var(0) + 1), var(0x18, 8).atomic_assign(var(0x18) + var(0)),
         var(0x1F, 1).assign(Var(TEXT[0] + 8, 2))]
    out = verify(s, rules())
    assert all(same(a, b) for a, b in zip(out, s, strict=True))


def test_a_constant_pointer_into_known_memory_becomes_a_plain_read():
    (out,) = verify([var(0).assign(load(TEXT[0] + 8, 2, signed=True))], rules())
    assert same(out, var(0).assign(Var(TEXT[0] + 8, 2, signed=True)))


def test_reads_without_a_map_go_through_read_nofault():
    (out,) = verify([var(0).assign(Var(UNMAPPED, 4))], rules(NOFAULT))
    assert same(out, Guarded(var(0).assign(Load(Const(UNMAPPED), 4)), GUARD))


def test_declared_per_cpu_data_is_readable():
    abi = dataclasses.replace(CHECKED, current_task=MemRef(0x40, "gs"))
    verify([var(0).assign(Var(0x40, segment="gs"))], rules(abi))
    verify([var(0).assign(Var(0x5000, 4, segment="gs"))], rules(percpu=((0x5000, 8),)))


def test_calling_snippets_are_guarded_once():
    s = [var(0).assign(1), var(8).assign(call(READER, arg(0)))]
    out = verify(s, rules())
    assert same(out[0], s[0])
    assert same(out[1], Guarded(s[1], GUARD))
    again = verify(out, rules())
    assert all(same(a, b) for a, b in zip(again, out, strict=True))
    for x in out:
        check(x, "entry")


def test_guarded_output_is_still_verified():
    with pytest.raises(WriteOutsideHeap):
        verify([Guarded(Var(TEXT[0]).assign(1), GUARD)], rules())


# --- generated code in the snippet machine --------------------------------------------------------
def assemble(text: str, address: int) -> bytes:
    ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
    return bytes(ks.asm(text, address)[0])


# copy_from_kernel_nofault's contract over the machine's data page: rdx bytes from rsi
# to rdi if they lie inside it (return 0), else -EFAULT; it records its rsp at entry
# and trashes caller-saved registers and the flags, as a kernel function may
READER_ASM = f"""
    mov qword ptr [{DATA + 0xF00:#x}], rsp
    mov rax, rsi
    mov rcx, {DATA:#x}
    sub rax, rcx
    mov rcx, 0x1000
    sub rcx, rdx
    cmp rax, rcx
    ja fail
    mov rcx, rdx
    rep movsb
    xor eax, eax
    jmp out
fail:
    mov rax, -14
out:
    mov r8, 0x9999; mov r9, 0xaaaa; mov r10, 0xbbbb; mov r11, 0xcccc; mov rsi, 1; mov rdi, 2
    cmp r8, r9
    ret
"""

_machine: Machine | None = None


def machine() -> Machine:
    global _machine
    if _machine is None:
        _machine = Machine({CODE: 0x10000, READER: 0x1000, DATA: 0x1000, STACK: 0x10000})
        _machine.write(READER, assemble(READER_ASM, READER))
    return _machine


def run(snippets, abi, *, live=ALL_LIVE, seed=0):
    """Compile, run once with random registers; live registers, rsp and flags kept."""
    m = machine()
    code = ARCH.compile_snippets(snippets, CODE, live=frozenset(live), abi=abi)
    before = random_regs(random.Random(seed), STACK_TOP)
    after = m.run(code, CODE, before)
    for reg in set(live) | {"rsp"}:
        assert after[reg] == before[reg], f"{reg} changed"
    return code


@pytest.mark.parametrize("abi", [CHECKED, NOFAULT], ids=["checked", "nofault"])
@pytest.mark.parametrize("pointer,size,signed,expected", [
    (DATA + 0x300, 8, False, 0x8877665544332211),
    (DATA + 0x300, 2, True, 0x2211),
    (DATA + 0x307, 1, True, (1 << 64) - 0x78),          # 0x88 sign-extended
    (DATA + 0xFF8, 8, False, 0x0123456789ABCDEF),       # the last 8 bytes of the map
    (DATA + 0xFFC, 8, False, 0),                        # straddles the map's end
    (DATA - 1, 1, False, 0),
    (UNMAPPED, 8, False, 0),
    (0xFFFF888000000000, 4, False, 0),
    ((1 << 64) - 4, 8, False, 0),                       # wraps around the address space
])
def test_dynamic_loads_read_mapped_memory_and_yield_0_elsewhere(abi, pointer, size, signed, expected):
    m = machine()
    m.put64(DATA + 0x300, 0x8877665544332211)
    m.put64(DATA + 0xFF8, 0x0123456789ABCDEF)
    m.put64(var(8).address, pointer)
    m.put64(var(0).address, 0x5555)
    (s,) = verify([var(0).assign(load(var(8), size, signed))], rules(abi))
    run([s], abi)
    assert m.u64(var(0).address) == expected


def test_the_fault_safe_reader_is_called_on_an_aligned_stack():
    m = machine()
    for pending in range(3):
        m.put64(var(8).address, DATA + 0x300)
        expr = load(var(8), 4)
        for _ in range(pending):
            expr = Const(1) + expr
        (s,) = verify([var(0).assign(expr)], rules(NOFAULT))
        run([s], NOFAULT, seed=pending)
        assert m.u64(DATA + 0xF00) % 16 == 8
        assert m.u64(var(0).address) == pending + 0x44332211


def test_plain_and_checked_code_does_not_depend_on_placement():
    s = [var(0).assign(load(var(8), 2) + load(var(0x10)))]
    for abi in (CHECKED, NOFAULT):
        (v,) = verify(s, rules(abi))
        near = ARCH.compile_snippets([v], CODE + 0x100, live=ALL_LIVE, abi=abi)
        far = ARCH.compile_snippets([v], 0x7FFF00000000, live=ALL_LIVE, abi=abi)
        assert len(near) == len(far)


def _guard_state(m):
    return m.u64(GUARD.missed), [m.u64(GUARD.flag(i)) for i in range(GUARD.slots)]


@pytest.mark.parametrize("cpu_number,held,runs", [
    (0, [], True),
    (6, [0, 1, 3], True),          # cpu 6 takes flag 6 & 3 = 2
    (6, [2], False),
    (2, [2], False),
])
def test_the_guard_runs_the_body_only_when_the_cpus_flag_is_free(cpu_number, held, runs):
    m = machine()
    m.write(GUARD.address, bytes(GUARD.size))
    for i in held:
        m.put64(GUARD.flag(i), 1)
    m.write(CPU_NUMBER.address, cpu_number.to_bytes(4, "little") + b"\xee\xee\xee\xee")
    m.put64(var(0).address, 10)
    body = seq(var(0).assign(var(0) + 1), var(8).assign(cpu()))
    run([Guarded(body, GUARD)], CHECKED, seed=cpu_number)
    missed, flags = _guard_state(m)
    assert m.u64(var(0).address) == (11 if runs else 10)
    assert missed == (0 if runs else 1)
    assert flags == [1 if i in held else 0 for i in range(GUARD.slots)]   # given back


def test_the_guard_around_a_call_keeps_registers_and_counts_nested_misses():
    """The body calls the reader with the flag held: a second guarded snippet run
    meanwhile (here: right after, flag forced held) is skipped and counted."""
    m = machine()
    m.write(GUARD.address, bytes(GUARD.size))
    m.write(CPU_NUMBER.address, (1).to_bytes(4, "little"))
    m.put64(DATA + 0x300, 7)
    out = verify([var(0).assign(call(READER, var(0x10).address, DATA + 0x300, 8))], rules())
    for seed in range(3):
        run(out, CHECKED, seed=seed)
    assert m.u64(var(0x10).address) == 7 and _guard_state(m) == (0, [0, 0, 0, 0])
    m.put64(GUARD.flag(1), 1)
    run(out, CHECKED)
    assert _guard_state(m) == (1, [0, 1, 0, 0])


def test_guard_layout():
    assert [Guard.slots_for(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    g = Guard(0x1000, 4)
    assert (g.size, g.missed, g.flag(0), g.flag(3)) == (40, 0x1000, 0x1008, 0x1020)
    for bad in (Guard(0x1000, 3), Guard(0x1004, 4), Guard(0x1000, 0)):
        with pytest.raises(SnippetError):
            check(Guarded(Const(0), bad))


def test_xchg_encoding():
    w = Writer(0x1000)
    w.put_xchg_mem_reg(Mem(base="rax"), "rcx")        # xchg [rax], rcx
    w.put_xchg_mem_reg(Mem(base="r8", disp=8), "rdx")  # xchg [r8 + 8], rdx
    assert w.flush() == bytes([0x48, 0x87, 0x08,
                               0x49, 0x87, 0x50, 0x08])


# --- the toy kernel, through the Manager ---------------------------------------------------------------
@pytest.fixture
def heap(toy_manager):
    blocks: list[int] = []

    def alloc(size: int = 8) -> int:
        blocks.append(toy_manager.alloc_data(size))
        return blocks[-1]

    yield alloc
    for b in blocks:
        toy_manager.free(b)


def test_refusals_on_the_toy_kernel(toy_manager, heap):
    m = toy_manager
    fn = m.find_function("hash_64")
    guard = Guard(heap(Guard.size_for(1)))
    counter = Var(heap(8))
    r = Rules.for_target(m.target, writable=[(counter.address, 8)], calls={fn.address: fn.name},
                         guard=guard)
    with pytest.raises(WriteOutsideHeap, match="kernel text"):
        verify([Var(fn.address, 4).assign(0xCCCCCCCC)], r)
    with pytest.raises(WriteOutsideHeap, match="kernel text"):          # the patch area too
        verify([Var(m.target.image.address_of("ksim_patch_area")).assign(0)], r)
    with pytest.raises(WriteOutsideHeap, match="runs past"):
        verify([Var(counter.address + 4).assign(1)], r)
    with pytest.raises(CallNotAllowed, match="hash_64"):
        verify([call(m.find_function("crc32_le").address, 0, 0, 0)], r)
    plain = dataclasses.replace(r, abi=dataclasses.replace(m.target.abi, readable=()))
    with pytest.raises(UnsafeLoad):
        verify([counter.assign(load(arg(0)))], plain)
    verify([counter.assign(counter + 1)], r)


def test_a_load_of_an_unmapped_address_yields_0_on_the_toy_kernel(toy_manager, heap):
    m = toy_manager
    baseline = m.run(seed=1).checksum
    ptr, good, out, bad = (Var(heap(8)) for _ in range(4))
    m.write(ptr, 0xDEAD00000000)                 # mapped nowhere
    m.write(good, good.address)                  # a pointer to itself
    m.write(bad, 77)
    r = Rules.for_target(m.target, writable=[(v.address, 8) for v in (ptr, good, out, bad)])
    snippet = seq(bad.assign(load(ptr)), out.assign(load(good) + load(ptr + 8, 4)))
    (s,) = verify([snippet], r)
    h = m.insert_snippet(m.entry_point("hash_64"), s)
    try:
        assert m.run(seed=1).checksum == baseline
    finally:
        m.remove_snippet(h)
    assert m.read(bad) == 0 and m.read(out) == good.address


def test_a_snippet_calling_the_function_it_instruments_nests_once(toy_path):
    """hash_64's entry calls hash_64: the nested hit finds the flag held and is counted
    as missed; the run ends as without instrumentation, the patch area intact."""
    from ksim.kapi import Manager

    with Manager.attach("unicorn:toy") as m:
        _nests_once(m)


def _nests_once(m):
    fn = m.find_function("hash_64")
    baseline = m.run(seed=1).checksum
    with m.oracle(fn.address) as calls:
        m.run(seed=1)
    hits = calls.count
    assert hits > 0
    result = m.malloc(8)
    guard = m.guard
    m.allow_calls(fn)                    # the user names the function as callable
    s = result.assign(call(fn.address, arg(0), arg(1)))
    h = m.insert_snippet(m.entry_point(fn), s)
    area = m.target.image.address_of("ksim_patch_area")
    size = m.target.image.address_of("ksim_patch_area_end") - area
    text = m.text_snapshot()
    try:
        before = m.target.read(area, size)
        with m.oracle(fn.address) as calls:
            assert m.run(seed=1).checksum == baseline
        assert m.target.read(area, size) == before
        assert m.text_snapshot() == text
    finally:
        m.remove_snippet(h)
    assert calls.count == 2 * hits                              # each hit calls once more
    assert m.read(Var(guard.missed)) == hits                    # ... and that nested hit missed
    assert m.read(Var(guard.flag(0))) == 0
    assert m.read(result) != 0


def test_a_call_the_user_did_not_name_is_refused_before_anything_changes():
    """Unverified, this snippet recursed until it faulted and wrecked the patch area."""
    from ksim.kapi import Manager

    with Manager.attach("unicorn:toy") as m:
        fn = m.find_function("hash_64")
        result = m.malloc(8)
        area = m.target.read(m.target._code.start, m.target._code.end - m.target._code.start)
        with pytest.raises(CallNotAllowed):
            m.insert_snippet(m.entry_point(fn), result.assign(call(fn.address, arg(0), arg(1))))
        assert m.splices() == {}
        assert m.target.read(m.target._code.start, len(area)) == area


# --- the Manager verifies every snippet itself ------------------------------------------------
def test_the_manager_refuses_before_changing_anything(toy_manager):
    m = toy_manager
    fn = m.find_function("hash_64")
    text = m.text_snapshot()
    with pytest.raises(WriteOutsideHeap):
        m.insert_snippet(m.entry_point(fn), Var(fn.address).assign(0))
    with pytest.raises(CallNotAllowed):
        m.insert_snippet(m.entry_point(fn), call(fn.address, arg(0), arg(1)))
    with pytest.raises(WriteOutsideHeap):
        counter = m.malloc(8)
        m.insert_snippet(m.entry_point(fn), Var(counter.address + 4).assign(1))
    assert m.text_snapshot() == text and m.splices() == {}


def test_the_manager_guards_a_snippet_calling_its_own_function(toy_manager):
    m = toy_manager
    fn = m.find_function("hash_64")
    baseline = m.run(seed=1).checksum
    result = m.malloc(8)
    m.allow_calls(fn)                    # the user names the function as callable
    h = m.insert_snippet(m.entry_point(fn), result.assign(call(fn.address, arg(0), arg(1))))
    try:
        assert m.run(seed=1).checksum == baseline
        assert m.missed() > 0           # the guard's missed counter
    finally:
        m.remove_snippet(h)


# --- the call allow-list takes exactly ints -------------------------------------------------------
class _Liar(int):
    """An int that says it equals (and hashes as) the allowed reader, at another address."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return hash(READER)


@pytest.mark.parametrize("address", [_Liar(0xFFFFFFFF81001234), True, _Liar(READER)],
                         ids=["liar", "bool", "liar-same-value"])
def test_a_call_to_an_int_subclass_is_refused(address):
    snippet = var(0).assign(call(address))
    with pytest.raises(CallNotAllowed, match="plain int"):
        verify([snippet], rules(calls={READER: "reader", 1: "one"}))


def test_an_allow_list_entry_that_is_not_an_int_allows_nothing():
    with pytest.raises(CallNotAllowed, match="not allowed"):
        verify([var(0).assign(call(READER))], rules(calls={_Liar(READER): "liar"}))
