"""Liveness: structural sanity, and a semantic oracle in unicorn.

The oracle runs a function twice from the same state: once as is, once with every
register liveness reports dead overwritten with garbage before *every*
instruction of every function of the kernel (the flags too, when they are dead).
Both runs must end with the same return registers, callee-saved registers,
registers the function's whole call tree never writes, and memory: a register wrongly reported dead shows up as a
difference.
"""

from __future__ import annotations

import random

import pytest
from analysis_kernel import fixture_kernel, kernels, toy_kernel
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ksim.analysis import analyze
from ksim.arch.base import Flow
from ksim.arch.x86_64.convention import LINUX as CC
from ksim.image import Image, load_image


@pytest.fixture(scope="module", params=kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def image(request: pytest.FixtureRequest) -> Image:
    return load_image(request.param)


@pytest.fixture(scope="module")
def fixture() -> Image:
    return load_image(fixture_kernel())


def test_stack_pointer_always_live(image: Image) -> None:
    for func in image.functions:
        a = analyze(image, func)
        assert all("rsp" in a.live_at(i.address) for i in a.insns), func.name


def test_entry_arguments_read_are_live(image: Image) -> None:
    """An argument register the entry block reads before writing it is live at entry."""
    for func in image.functions:
        a = analyze(image, func)
        entry = a.live_at(func.address)
        written: set[str] = set()
        for insn in a.blocks[0].insns:
            if insn.flow in (Flow.CALL, Flow.CALL_INDIRECT):
                break
            for reg in set(insn.reads) - written:
                if reg in CC.arg_regs:
                    assert reg in entry, f"{func.name}: {reg} read by {insn}"
            written |= insn.writes


def test_callee_saved_live_at_entry_and_returns(image: Image) -> None:
    """A function that returns must give its caller the callee-saved registers back:
    they are live at its entry and at every ret (code that never returns, such as
    an entry point, may overwrite them freely)."""
    for func in image.functions:
        a = analyze(image, func)
        if any(i.flow is Flow.RET for i in a.insns):
            assert CC.callee_saved <= a.live_at(func.address), func.name
        for insn in a.insns:
            if insn.flow is Flow.RET:
                live = a.live_at(insn.address)
                assert CC.callee_saved | {"rax", "rsp"} <= live, f"{func.name}: {insn}"


def test_unknown_flow_keeps_everything(fixture: Image) -> None:
    halt = analyze(fixture, "halt")
    assert halt.live_at(halt.function.address) == CC.all_regs  # hlt: a stop instruction
    notrack = analyze(fixture, "classify")
    jcc = next(i for i in notrack.insns if i.flow is Flow.JCC)
    assert "flags" in notrack.live_at(jcc.address)


def test_ipa_ra_values_survive_calls(fixture: Image) -> None:
    """gcc keeps ``a`` in rcx across calls to add3, which never writes rcx."""
    keeps = analyze(fixture, "keeps")
    calls = [i for i in keeps.insns if i.flow is Flow.CALL]
    assert len(calls) == 2
    assert "rcx" in keeps.live_after(calls[0].address)
    assert "rcx" in keeps.live_at(calls[1].address)
    # and add3 itself keeps rcx live at its return: a caller may rely on it
    add3 = analyze(fixture, "add3")
    ret = next(i for i in add3.insns if i.flow is Flow.RET)
    assert {"rcx", "r8", "r10"} <= add3.live_at(ret.address)


def test_dead_registers_exist(fixture: Image) -> None:
    """Liveness is not trivially 'everything': right after a call the caller-saved
    registers the callee writes are dead until defined."""
    a = analyze(fixture, "add3")
    assert "rax" not in a.live_at(a.function.address)


# --- the semantic oracle ------------------------------------------------------------
KBASE = 0xFFFFFFFF80000000      # kernel virtual base: physical = virtual - KBASE
SCRATCH = 0xFFFFFFFF90000000    # zeroed memory for pointer arguments, and the stack
SCRATCH_SIZE = 0x20000
SENTINEL = SCRATCH + SCRATCH_SIZE - 0x1000  # return address: emulation stops there
STATUS_FLAGS = 0x8D5            # CF PF AF ZF SF OF
UC_REGS: dict[str, int] = {}


def _regs() -> dict[str, int]:
    if not UC_REGS:
        from unicorn import x86_const as X

        for name in ("rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
                     "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"):
            UC_REGS[name] = getattr(X, f"UC_X86_REG_{name.upper()}")
        UC_REGS["flags"] = X.UC_X86_REG_EFLAGS
        UC_REGS["rip"] = X.UC_X86_REG_RIP
    return UC_REGS


class Machine:
    def __init__(self, image: Image) -> None:
        from unicorn import (
            UC_ARCH_X86,
            UC_HOOK_CODE,
            UC_HOOK_TLB_FILL,
            UC_MODE_64,
            UC_PROT_ALL,
            UC_TLB_VIRTUAL,
            Uc,
        )

        self.image = image
        uc = Uc(UC_ARCH_X86, UC_MODE_64)
        uc.ctl_set_tlb_mode(UC_TLB_VIRTUAL)

        def fill(uc, vaddr, access, entry, data):  # noqa: ANN001 - unicorn callback
            if vaddr < KBASE:
                return False
            entry.paddr = vaddr - KBASE
            entry.perms = UC_PROT_ALL
            return True

        uc.hook_add(UC_HOOK_TLB_FILL, fill)
        spans = [(s.address, s.end) for s in image.sections if s.address >= KBASE]
        spans.append((SCRATCH, SCRATCH + SCRATCH_SIZE))
        mapped: set[int] = set()
        for start, end in spans:
            for page in range((start - KBASE) & ~0xFFF, end - KBASE, 0x1000):
                if page not in mapped:
                    uc.mem_map(page, 0x1000, UC_PROT_ALL)
                    mapped.add(page)
        for sec in image.sections:
            if sec.data and sec.address >= KBASE:
                uc.mem_write(sec.address - KBASE, sec.data)
        uc.mem_write(SENTINEL - KBASE, b"\xcc" * 16)
        # One code hook, installed before anything is translated (a hook added later
        # may miss blocks already translated); clean runs leave ``clobber`` None.
        self.clobber: dict[int, frozenset[str]] | None = None
        self.garbage = random.Random(0)
        text = image.text_regions
        uc.hook_add(UC_HOOK_CODE, self._on_insn, begin=text[0][0], end=text[-1][1])
        self.uc = uc
        self.snapshot = uc.context_save()
        self.memory = {start: uc.mem_read(start - KBASE, end - start) for start, end in spans}
        # compared after a run: the image's memory and the pointer-argument area,
        # not the stack (dead slots below the stack pointer may differ)
        self.compared = [(s, e) for s, e in spans if s != SCRATCH] + [(SCRATCH, SCRATCH + 0x8000)]

    def reset(self) -> None:
        for start, data in self.memory.items():
            self.uc.mem_write(start - KBASE, bytes(data))
        self.uc.context_restore(self.snapshot)

    def _on_insn(self, uc, address: int, size: int, data: object) -> None:  # noqa: ANN001
        live = self.clobber.get(address) if self.clobber is not None else None
        if live is None:
            return
        regs = _regs()
        for name in CC.all_regs - live:
            if name == "flags":
                # flip the status flags only; keep bit 1 (always set) and clear
                # the control bits (TF, DF, ...), which a status-flag clobber never
                # touches and an odd read-back of EFLAGS mid-block might carry
                flipped = (uc.reg_read(regs["flags"]) ^ STATUS_FLAGS) & STATUS_FLAGS
                uc.reg_write(regs["flags"], flipped | 0x2)
            else:
                uc.reg_write(regs[name], self.garbage.getrandbits(64))

    def run(self, func_addr: int, args: list[int], clobber: dict[int, frozenset[str]] | None,
            seed: int) -> tuple[dict[str, int], bytes] | None:
        from unicorn import UcError

        uc = self.uc
        regs = _regs()
        self.reset()
        rng = random.Random(seed)
        for name, reg in regs.items():
            if name not in ("flags", "rip"):
                uc.reg_write(reg, rng.getrandbits(64))
        uc.reg_write(regs["flags"], 0x2)
        for reg, value in zip(CC.arg_regs, args, strict=True):
            uc.reg_write(regs[reg], value)
        rsp = SCRATCH + SCRATCH_SIZE - 0x2000
        uc.mem_write(rsp - KBASE, SENTINEL.to_bytes(8, "little"))
        uc.reg_write(regs["rsp"], rsp)
        self.clobber = clobber
        self.garbage = random.Random(seed ^ 0x5EED)
        try:
            uc.emu_start(func_addr, SENTINEL, count=20_000)
        except UcError:
            return None
        finally:
            self.clobber = None
        if uc.reg_read(regs["rip"]) != SENTINEL or uc.reg_read(regs["rsp"]) != rsp + 8:
            return None
        state = {name: uc.reg_read(reg) for name, reg in regs.items() if name != "rip"}
        memory = b"".join(bytes(uc.mem_read(s - KBASE, e - s)) for s, e in self.compared)
        return state, memory


def _live_map(image: Image) -> dict[int, frozenset[str]]:
    out: dict[int, frozenset[str]] = {}
    for func in image.functions:
        a = analyze(image, func)
        for insn in a.insns:
            out[insn.address] = a.live_at(insn.address)
    return out


_MACHINES: dict[str, tuple[Machine, dict[int, frozenset[str]]]] = {}


def _machine(path: str) -> tuple[Machine, dict[int, frozenset[str]]]:
    if path not in _MACHINES:
        image = load_image(path)
        _MACHINES[path] = (Machine(image), _live_map(image))
    return _MACHINES[path]


ARG = st.one_of(st.integers(0, 12), st.just(SCRATCH + 0x100), st.integers(0, 2**64 - 1))


def _oracle(path: str, name: str, args: list[int], seed: int) -> None:
    machine, live = _machine(path)
    func = machine.image.function(name)
    clean = machine.run(func.address, args, None, seed)
    assume(clean is not None)  # faulted or did not return: nothing to compare
    dirty = machine.run(func.address, args, live, seed)
    assert dirty is not None, f"{name}{tuple(args)}: the clobbered run faulted"
    # registers the whole call tree never writes must come back unchanged too
    from ksim.analysis.abi import support_for
    from ksim.analysis.clobbers import function_clobbers

    untouched = CC.caller_saved - function_clobbers(machine.image, support_for("x86_64"), func)
    must_match = CC.at_return | untouched
    for reg in sorted(must_match):
        assert dirty[0][reg] == clean[0][reg], f"{name}{tuple(args)}: {reg} differs"
    assert dirty[1] == clean[1], f"{name}{tuple(args)}: memory differs"


FIXTURE_FUNCS = ["classify", "classify_reg", "classify_notrack", "add3", "keeps", "tail_caller",
                 "checked", "sum_list", "note"]


@pytest.mark.parametrize("name", FIXTURE_FUNCS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.lists(ARG, min_size=6, max_size=6), seed=st.integers(0, 2**32))
def test_oracle_fixture(name: str, args: list[int], seed: int) -> None:
    _oracle(fixture_kernel(), name, args, seed)


@pytest.mark.skipif(toy_kernel() is None, reason="the toy kernel cannot be built yet")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), args=st.lists(ARG, min_size=6, max_size=6), seed=st.integers(0, 2**32))
def test_oracle_toy(data: st.DataObject, args: list[int], seed: int) -> None:
    machine, _live = _machine(toy_kernel())
    name = data.draw(st.sampled_from([f.name for f in machine.image.functions]))
    _oracle(toy_kernel(), name, args, seed)


def _walked(lv) -> dict[int, frozenset[str]]:
    """The fixed point found the plain way: walk every block's instructions, in
    rounds over all blocks, until a round changes nothing."""
    blocks = lv.cfg.blocks
    live_in = {start: frozenset() for start in blocks}
    changed = True
    while changed:
        changed = False
        for start in reversed(list(blocks)):
            new = lv._through(blocks[start], live_in, record=False)
            changed |= new != live_in[start]
            live_in[start] = new
    return live_in


def _same_fixed_point(image: Image, funcs) -> int:
    compared = 0
    for func in funcs:
        try:
            lv = analyze(image, func).liveness
        except Exception:  # noqa: BLE001 - a function that cannot be analysed: not compared
            continue
        assert lv.live_in == _walked(lv), func.name
        compared += 1
    return compared


def test_block_summaries_give_the_walked_fixed_point(image: Image) -> None:
    """Every function of the kernel: the solver's per-block transfers (composed once
    from the instructions) reach exactly the fixed point of walking the instructions."""
    assert _same_fixed_point(image, image.functions) >= 0.9 * len(image.functions)


def test_block_summaries_on_the_debian_kernel(debian_kernel) -> None:
    """The same over every 25th function of Debian's vmlinux (calls into thunks, tail
    calls, jump tables, noreturn calls: what a toy kernel has little of)."""
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    assert _same_fixed_point(vmlinux, vmlinux.functions[::25]) > 1500
