"""A bundled kernel image (the toy kernel) emulated in unicorn.

The machine maps the ELF's PT_LOAD segments at their physical addresses and
translates the kernel's virtual addresses onto them with unicorn's virtual TLB
(``UC_TLB_VIRTUAL`` plus a ``UC_HOOK_TLB_FILL`` hook): in unicorn's default mode
addresses are physical, and a fetch at a high canonical address (0xffff800000000000
and above, so 0xffffffff81000000 too) fails with UC_ERR_FETCH_UNMAPPED even after
``mem_map`` succeeded (unicorn 2.1.4).  The hook runs on TLB misses only, so it
costs nothing measurable.  The patch area and the data heap are part of the loaded
segments, so they have the same addresses here as under QEMU.

A run starts at ``ksim_entry64`` with the stack pointer at ``init_stack_top``
and ends when execution reaches ``ksim_halt``.  What differs between
architectures -- the CPU, the devices (serial output captured, the kernel's
exit path ending the run, timers and interrupt controllers ignored: no
interrupt is ever delivered, so runs are deterministic), the registers at entry
and which interrupt is the breakpoint -- is the image's board
(ksim.machine.boards), chosen by the ELF's machine; everything here is shared.

Every Python callback runs through one wrapper: an exception raised inside a
hook is kept, emulation is stopped, and the exception is re-raised after
``emu_start`` returns -- never swallowed.

Slices
    A run that is resumed after a stop -- one with a ``progress`` callback, which
    reads the kernel between slices -- is a series of ``emu_start`` calls, each
    bounded by a number of instructions (unicorn's ``count``), never by time.
    Unicorn counts with a code hook of its own, placed first in the hook list;
    when a slice's budget is spent it asks for a stop *before* the next
    instruction's other code hooks run, so that instruction runs at the start of
    the next slice with its hooks called once (an exact-address oracle hook counts
    each execution once).  Such a stop falls on an instruction boundary where
    nothing is half done: never between an int3 and its interrupt hook, never
    after a hook that wrote RIP (unicorn drops a pending stop request when a hook
    redirects execution).  Between slices the run calls ``progress()`` and checks
    its timeout and a held Ctrl-C (``HeldInterrupt``: SIGINT only sets a flag
    during a run).  Slices are sized to take about SLICE_SECONDS.  The kernel
    executes the same instructions however a run is sliced, so counters, oracle
    counts, checksums and instruction counts do not depend on the slicing
    (``count_instructions`` adds a block's instructions when the block is
    entered; a slice that stops inside it takes back those it did not run).

    The count hook costs 10-20 ns per instruction (it about halves the speed of a
    run without Python hooks), so a run without ``progress`` is one unbounded
    ``emu_start``.  Its timeout and Ctrl-C are watched from another thread
    (``_Watchdog``), whose stop may fall anywhere -- between an int3 and its
    interrupt hook, after an oracle hook and before its instruction -- so such a
    run is never resumed: it ends in TargetTimeout or KeyboardInterrupt, and a
    count read after it may include one hit in flight, as any interrupted count.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import unicorn
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from ksim.arch import get_arch
from ksim.core import HeldInterrupt, check_callback, check_count, check_flag, check_seconds
from ksim.errors import BadRunValue, EmulationError, MalformedImage, TargetTimeout
from ksim.image.elf import ARCH_OF_MACHINE
from ksim.images import toy
from ksim.machine.boards import EXIT_SUCCESS, Board

PAGE = 0x1000

_UNMAPPED = {
    unicorn.UC_ERR_READ_UNMAPPED: "read of unmapped memory",
    unicorn.UC_ERR_WRITE_UNMAPPED: "write to unmapped memory",
    unicorn.UC_ERR_FETCH_UNMAPPED: "fetch from unmapped memory",
    unicorn.UC_ERR_READ_PROT: "read of protected memory",
    unicorn.UC_ERR_WRITE_PROT: "write to protected memory",
    unicorn.UC_ERR_FETCH_PROT: "fetch from non-executable memory",
    unicorn.UC_ERR_READ_UNALIGNED: "unaligned read",
    unicorn.UC_ERR_WRITE_UNALIGNED: "unaligned write",
    unicorn.UC_ERR_FETCH_UNALIGNED: "unaligned fetch",
}

_ACCESS = {
    unicorn.UC_MEM_READ_UNMAPPED: "read",
    unicorn.UC_MEM_WRITE_UNMAPPED: "write",
    unicorn.UC_MEM_FETCH_UNMAPPED: "fetch",
    unicorn.UC_MEM_READ_PROT: "read",
    unicorn.UC_MEM_WRITE_PROT: "write",
    unicorn.UC_MEM_FETCH_PROT: "fetch",
}

_TLB_ACCESS = {unicorn.UC_MEM_READ: "read", unicorn.UC_MEM_WRITE: "write",
               unicorn.UC_MEM_FETCH: "fetch"}

#: how long a slice of a run should take: how soon Ctrl-C, the timeout and
#: progress() are seen (see "Slices" in the module doc)
SLICE_SECONDS = 0.1
#: instructions in a run's first slice (~10-20 ms), and the bounds of later ones
FIRST_SLICE, MIN_SLICE, MAX_SLICE = 1_000_000, 10_000, 1 << 32


@dataclass(frozen=True, slots=True)
class MachineResult:
    """What one run produced."""

    #: ksim_workload_checksum (0 in benchmark mode)
    checksum: int
    #: everything the kernel wrote to COM1
    serial: str
    #: instructions emulated (None unless run(count_instructions=True))
    instructions: int | None
    #: True when execution reached ksim_halt
    halted: bool
    #: the status the kernel exited with (QEMU's: the x86 debug-exit port's, the
    #: arm64 semihosting exit code), else None
    exit_status: int | None
    #: ksim_bench_cycles (benchmark mode) else 0
    bench_cycles: int
    seconds: float
    #: emu_start calls the run took (see "Slices" in the module doc)
    slices: int = 1


class UnicornMachine:
    """The toy kernel (or any image following its ABI) in unicorn."""

    def __init__(self, elf_path: str | Path) -> None:
        self.path = Path(elf_path)
        e_machine, self.symbols, self.functions, segments = _read_elf(self.path)
        for name in (toy.ENTRY, toy.HALT, toy.INIT_STACK_TOP):
            if name not in self.symbols:
                raise MalformedImage(f"{self.path}: no symbol {name!r}: not a ksim image")
        offsets = {vaddr - paddr for vaddr, paddr, _, _, _ in segments}
        if len(offsets) != 1:
            raise MalformedImage(f"{self.path}: segments do not share one virtual-physical offset")
        self._offset = offsets.pop()
        lo = min(paddr for _, paddr, _, _, _ in segments) & ~(PAGE - 1)
        hi = -(-max(paddr + memsz for _, paddr, memsz, _, _ in segments) // PAGE) * PAGE
        self._phys = (lo, hi)
        self._virt = (lo + self._offset, hi + self._offset)
        pristine = bytearray(hi - lo)
        self._text: list[tuple[int, int]] = []
        for vaddr, paddr, memsz, data, executable in segments:
            pristine[paddr - lo:paddr - lo + len(data)] = data
            if executable:
                self._text.append((vaddr, vaddr + memsz))
        self._pristine = bytes(pristine)

        arch = ARCH_OF_MACHINE.get(e_machine)
        if arch is None:
            raise MalformedImage(f"{self.path}: no unicorn machine for {e_machine} "
                                 f"(known: {', '.join(ARCH_OF_MACHINE)})")
        self._e_machine = e_machine
        cpu = get_arch(arch).emulation
        self._board: Board = cpu.board(self, cpu)
        self._uc = self._board.create()
        self._uc.ctl_set_tlb_mode(unicorn.UC_TLB_VIRTUAL)  # type: ignore[attr-defined]
        self._uc.mem_map(lo, hi - lo, unicorn.UC_PROT_ALL)
        self._uc.mem_write(lo, self._pristine)

        self._pending: BaseException | None = None
        self._fault: tuple[str, int] | None = None
        self._serial = bytearray()
        self._exit_status: int | None = None
        self._dirty = False
        self._interrupt_fns: list[Callable[[UnicornMachine, int], None]] = []
        self._block_sizes: dict[tuple[int, int], int] = {}
        self._icount = 0
        #: (address, size, instructions) of the block entered last (count_instructions)
        self._last_block: tuple[int, int, int] | None = None
        self._md = self._board.disassembler()
        self._hooks: list[int] = []

        self._add(unicorn.UC_HOOK_TLB_FILL, self._on_tlb_fill)
        self._add(unicorn.UC_HOOK_MEM_INVALID, self._on_mem_invalid)
        self._add(unicorn.UC_HOOK_INTR, self._on_interrupt)
        self._board.install()
        self._icount_hook: int | None = None
        #: whether translated blocks call unicorn's count hook (see "Slices")
        self._counting = False

    # --- symbols ---------------------------------------------------------------
    def address_of(self, name: str) -> int:
        try:
            return self.symbols[name]
        except KeyError:
            raise EmulationError(f"{self.path.name} has no symbol {name!r}") from None

    def symbolize(self, address: int) -> str:
        """``name+0xoff`` for an address inside a function, else the hex address."""
        for name, start, size in self.functions:
            if start <= address < start + max(size, 1):
                return f"{name}+{address - start:#x}"
        return f"{address:#x}"

    def region(self, start: str, end: str) -> tuple[int, int]:
        """(start, end) addresses of a region delimited by two symbols."""
        return self.address_of(start), self.address_of(end)

    @property
    def patch_area(self) -> tuple[int, int]:
        return self.region(toy.PATCH_AREA, toy.PATCH_AREA_END)

    @property
    def heap(self) -> tuple[int, int]:
        return self.region(toy.HEAP, toy.HEAP_END)

    # --- memory and registers ---------------------------------------------------
    def _phys_of(self, address: int, size: int) -> int:
        lo, hi = self._virt
        if size < 0 or not (lo <= address and address + size <= hi):
            raise EmulationError(f"{address:#x}..+{size:#x} is outside the image's memory "
                                 f"({lo:#x}..{hi:#x})")
        return address - self._offset

    def read(self, address: int, size: int) -> bytes:
        return bytes(self._uc.mem_read(self._phys_of(address, size), size))

    def write(self, address: int, data: bytes) -> None:
        self._uc.mem_write(self._phys_of(address, len(data)), bytes(data))
        end = address + len(data)
        if any(address < t_hi and t_lo < end for t_lo, t_hi in self._text):
            # Changed code: drop translated blocks and cached instruction counts.
            self._uc.ctl_remove_cache(address, end)
            self._block_sizes.clear()

    def read_u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def write_u64(self, address: int, value: int) -> None:
        self.write(address, (value & (2**64 - 1)).to_bytes(8, "little"))

    def reg(self, name: str) -> int:
        return int(self._uc.reg_read(self._reg_id(name)))

    def set_reg(self, name: str, value: int) -> None:
        self._uc.reg_write(self._reg_id(name), value)

    def _reg_id(self, name: str) -> int:
        try:
            return self._board.regs[name.lower()]
        except KeyError:
            raise EmulationError(f"unknown {self._e_machine} register {name!r}") from None

    @property
    def pc(self) -> int:
        """The program counter."""
        return self.reg(self._board.pc)

    def set_pc(self, address: int) -> None:
        """Resume at ``address`` (from a hook: the instruction there runs next)."""
        self.set_reg(self._board.pc, address)

    def trap_site(self, vector: int) -> int | None:
        """In an interrupt hook: the address of the breakpoint (the architecture's
        trap instruction) that raised interrupt ``vector``, None when ``vector``
        is no breakpoint.  x86-64: int3 is interrupt 3 and RIP is past it;
        AArch64: BRK is EXCP_BKPT and PC is on it."""
        return self._board.trap_site(vector)

    # --- hooks ------------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run a hook; keep the first exception and stop instead of losing it."""

        def guarded(uc: unicorn.Uc, *args: Any) -> Any:
            try:
                return fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised after emu_start
                if self._pending is None:
                    self._pending = exc
                uc.emu_stop()
                return False

        return guarded

    def _add(self, kind: int, fn: Callable[..., Any], begin: int = 1, end: int = 0,
             arg1: int = 0) -> int:
        handle = self._uc.hook_add(kind, self._guard(fn), None, begin, end, arg1)
        self._hooks.append(handle)
        return handle

    def hook_code(self, address: int, fn: Callable[[UnicornMachine, int], Any]) -> Callable[[], None]:
        """Call ``fn(machine, address)`` each time the instruction at ``address`` runs.

        Returns a function that removes the hook.
        """
        handle = self._add(unicorn.UC_HOOK_CODE, lambda addr, size, _u: fn(self, addr),
                           begin=address, end=address)
        # A block translated before the hook existed would not call it.
        self._uc.ctl_remove_cache(address, address + 1)

        def remove() -> None:
            if handle in self._hooks:
                self._hooks.remove(handle)
                self._uc.hook_del(handle)
                self._uc.ctl_remove_cache(address, address + 1)

        return remove

    def hook_interrupt(self, fn: Callable[[UnicornMachine, int], None]) -> Callable[[], None]:
        """Call ``fn(machine, vector)`` on each interrupt (``trap_site(vector)`` says
        whether it is a breakpoint, and where)."""
        self._interrupt_fns.append(fn)
        return lambda: self._interrupt_fns.remove(fn) if fn in self._interrupt_fns else None

    def use_trap_table(self) -> Callable[[], None]:
        """Dispatch int3 through the kernel's own ``ksim_trap_table``, as its #BP handler does.

        Unicorn delivers a breakpoint to a hook instead of the kernel's vectors;
        this hook does what the kernel's handler does under QEMU: find the site,
        look it up in entries [0, ksim_trap_count) and resume at its patch.
        """
        table, count = self.address_of(toy.TRAP_TABLE), self.address_of(toy.TRAP_COUNT)

        def dispatch(machine: UnicornMachine, vector: int) -> None:
            site = machine.trap_site(vector)
            if site is None:
                raise EmulationError(f"unexpected interrupt {vector} at "
                                     f"{machine.symbolize(machine.pc)}")
            n = min(machine.read_u64(count), toy.TRAP_SLOTS)
            raw = machine.read(table, 16 * n)
            for i in range(n):
                s, patch = struct.unpack_from("<QQ", raw, 16 * i)
                if s == site:
                    machine.set_pc(patch)
                    return
            raise EmulationError(f"breakpoint at {machine.symbolize(site)} is not in "
                                 "ksim_trap_table")

        return self.hook_interrupt(dispatch)

    def _on_tlb_fill(self, vaddr: int, access: int, entry: Any, _user: Any) -> bool:
        lo, hi = self._virt
        # the whole address: unicorn's AArch64 fill takes paddr as the address
        # itself (a page-aligned one sends every fetch to its page's start); x86-64
        # masks it either way
        if lo <= vaddr < hi:
            entry.paddr = vaddr - self._offset
        elif any(base <= vaddr < base + size for base, size in self._board.identity):
            entry.paddr = vaddr  # a device, mapped one to one
        else:
            # No mapping: the CPU faults (unicorn reports it as an exception).
            self._fault = (_TLB_ACCESS.get(access, "access"), vaddr)
            return False
        entry.perms = unicorn.UC_PROT_ALL
        return True

    def _on_mem_invalid(self, access: int, address: int, size: int, value: int, _user: Any) -> bool:
        self._fault = (_ACCESS.get(access, "access"), address)
        return False

    def _exit(self, status: int) -> None:
        """The kernel asked to end the run with ``status`` (a board's exit device)."""
        self._exit_status = status
        self._uc.emu_stop()

    def _on_interrupt(self, vector: int, _user: Any) -> None:
        if vector in self._board.fault_vectors and self._fault is not None:
            kind, address = self._fault
            err = EmulationError(f"page fault: {kind} at unmapped {address:#x} "
                                 f"(pc {self.symbolize(self.pc)})")
            err.address = address  # type: ignore[attr-defined]
            raise err
        failure = self._board.interrupt_error(vector)
        if failure is not None:
            raise failure
        if not self._interrupt_fns:
            raise EmulationError(f"interrupt {vector} at {self.symbolize(self.pc)} "
                                 "and no interrupt hook")
        for fn in list(self._interrupt_fns):
            fn(self, vector)

    def _on_block(self, address: int, size: int, _user: Any) -> None:
        n = self._instructions_in(address, size)
        self._icount += n
        self._last_block = (address, size, n)

    def _instructions_in(self, address: int, size: int) -> int:
        key = (address, size)
        n = self._block_sizes.get(key)
        if n is None:
            code = bytes(self._uc.mem_read(address - self._offset, size))
            n = sum(1 for _ in self._md.disasm_lite(code, address))
            self._block_sizes[key] = n
        return n

    def _end_slice(self, pc: int) -> None:
        """A slice stopped at ``pc`` before running it: the block hook counted the
        whole block ``pc`` lies in, so take back the instructions from ``pc`` on
        (the next slice enters a block at ``pc`` and counts them then)."""
        block, self._last_block = self._last_block, None
        if block is not None and block[0] <= pc < block[0] + block[1]:
            address, _, n = block
            self._icount -= n - self._instructions_in(address, pc - address)

    # --- running ----------------------------------------------------------------
    def reset(self) -> None:
        """Reload pristine memory (text, data, patch area, heap); hooks stay."""
        lo, _ = self._phys
        self._uc.mem_write(lo, self._pristine)
        self._uc.ctl_remove_cache(self._virt[0], self._virt[1])
        self._block_sizes.clear()
        self._dirty = False

    def run(self, seed: int | None = None, iterations: int | None = None,
            bench_calls: int | None = None, count_instructions: bool = False,
            timeout: float = 60.0, progress: Callable[[], None] | None = None,
            slices: Iterable[int] | None = None) -> MachineResult:
        """Start at ksim_entry64 and run until ksim_halt.

        ``seed``, ``iterations`` and ``bench_calls`` are written to the ABI
        globals first (None keeps the image's value).  A machine runs once per
        reset(): the kernel's data is not pristine after a run.

        With ``progress`` (or ``slices``) the run goes in slices (module doc):
        between two, ``progress()`` is called, TargetTimeout is raised once
        ``timeout`` seconds have passed, and Ctrl-C raises KeyboardInterrupt with
        the kernel stopped on an instruction boundary.  ``slices`` gives the
        instruction budgets of the first slices (adapted to SLICE_SECONDS after
        them); the results do not depend on it.  Without either, the run goes in
        one piece, and the timeout and Ctrl-C end it wherever it is.
        """
        timeout = check_run(seed=seed, iterations=iterations, bench_calls=bench_calls,
                            count_instructions=count_instructions, timeout=timeout,
                            progress=progress)
        if self._dirty:
            raise EmulationError("the machine already ran: call reset() before running again")
        self._dirty = True
        for name, value in ((toy.WORKLOAD_SEED, seed), (toy.WORKLOAD_ITERATIONS, iterations),
                            (toy.BENCH_CALLS, bench_calls)):
            if value is not None:
                self.write_u64(self.address_of(name), value)
        self._serial.clear()
        self._board.reset()
        self._exit_status = None
        self._pending = None
        self._fault = None
        self._icount = 0
        self._last_block = None
        if count_instructions and self._icount_hook is None:
            self._icount_hook = self._add(unicorn.UC_HOOK_BLOCK, self._on_block)
            self._uc.ctl_remove_cache(self._virt[0], self._virt[1])
        elif not count_instructions and self._icount_hook is not None:
            self._hooks.remove(self._icount_hook)
            self._uc.hook_del(self._icount_hook)
            self._icount_hook = None

        self._board.enter(self.address_of(toy.INIT_STACK_TOP))
        halt = self.address_of(toy.HALT)
        start = time.perf_counter()
        pc = self.address_of(toy.ENTRY)
        done = 1
        with HeldInterrupt() as ctrl_c:
            if progress is None and slices is None:
                pc = self._run_whole(pc, halt, start, timeout, ctrl_c)
            else:
                pc, done = self._run_sliced(pc, halt, start, timeout, ctrl_c, progress,
                                            _Budgets(slices))
        if self._exit_status is not None and self._exit_status != EXIT_SUCCESS:
            raise EmulationError(f"the kernel failed (exit status {self._exit_status} at "
                                 f"{self.symbolize(pc)}); serial: {self._serial_text()[-500:]!r}")
        return MachineResult(
            checksum=self.read_u64(self.address_of(toy.WORKLOAD_CHECKSUM)),
            serial=self._serial_text(),
            instructions=self._icount if count_instructions else None,
            halted=pc == halt,
            exit_status=self._exit_status,
            bench_cycles=self.read_u64(self.address_of(toy.BENCH_CYCLES)),
            seconds=time.perf_counter() - start,
            slices=done,
        )

    def _run_sliced(self, pc: int, halt: int, start: float, timeout: float,
                    ctrl_c: HeldInterrupt, progress: Callable[[], None] | None,
                    budgets: _Budgets) -> tuple[int, int]:
        """Run to ``halt`` in slices of counted instructions (module doc);
        (where it stopped, slices taken)."""
        if not self._counting:
            # unicorn adds its count hook when counts are first asked for, and a
            # block translated before it would not count: translate afresh
            self._uc.ctl_remove_cache(self._virt[0], self._virt[1])
            self._counting = True
        done = 0
        while True:
            budget, began = budgets.next(), time.perf_counter()
            self._emulate(pc, halt, budget)
            done += 1
            pc = self.pc
            if pc == halt or self._exit_status is not None:
                return pc, done
            self._end_slice(pc)
            budgets.took(budget, time.perf_counter() - began)
            ctrl_c.deliver()  # stopped on an instruction boundary: Ctrl-C may end it here
            if time.perf_counter() - start >= timeout:
                raise self._timeout(pc, start)
            if progress is not None:
                progress()

    def _run_whole(self, pc: int, halt: int, start: float, timeout: float,
                   ctrl_c: HeldInterrupt) -> int:
        """Run to ``halt`` in one emu_start at full speed; a watchdog ends it at
        the timeout or on Ctrl-C (module doc).  Where it stopped."""
        self._counting = False  # count 0: unicorn drops its count hook and its blocks
        with _Watchdog(self._uc, start + timeout, sigint=ctrl_c.holding) as watchdog:
            failure = self._emulate(pc, halt, 0, raise_fault=False)
        pc = self.pc
        if watchdog.fired is not None and pc != halt and self._exit_status is None:
            # abandoned where the watchdog's stop fell (perhaps mid-dispatch, hence
            # an emulator error): never resumed
            if watchdog.fired == "interrupt":
                ctrl_c.deliver()
                raise KeyboardInterrupt  # a handler that returned cannot resume it
            raise self._timeout(pc, start) from failure
        if failure is not None:
            raise failure
        return pc

    def _timeout(self, pc: int, start: float) -> TargetTimeout:
        return TargetTimeout(f"no halt after {time.perf_counter() - start:.1f} s; pc at "
                             f"{self.symbolize(pc)}; serial: {self._serial_text()[-300:]!r}")

    def _emulate(self, pc: int, until: int, count: int,
                 raise_fault: bool = True) -> EmulationError | None:
        """One emu_start.  An exception a hook kept is raised; an emulator error
        is raised as an EmulationError (or returned, with ``raise_fault`` false)."""
        try:
            self._uc.emu_start(pc, until, count=count)
        except unicorn.UcError as exc:
            if self._pending is not None:
                raise self._take_pending() from exc
            failure = self._fault_error(exc)
            if raise_fault:
                raise failure from None
            return failure
        if self._pending is not None:
            raise self._take_pending()
        return None

    def _take_pending(self) -> BaseException:
        exc, self._pending = self._pending, None
        assert exc is not None
        return exc

    def _fault_error(self, exc: unicorn.UcError) -> EmulationError:
        pc = self.pc
        where = self.symbolize(pc)
        if exc.errno == unicorn.UC_ERR_EXCEPTION and self._fault is not None:
            kind, address = self._fault
            address = self._effective_address(pc, address)
            err = EmulationError(f"page fault: {kind} at unmapped {address:#x} "
                                 f"(pc {pc:#x}, {where})")
        elif exc.errno in _UNMAPPED:
            kind, address = self._fault or (_UNMAPPED[exc.errno], pc)
            err = EmulationError(f"{_UNMAPPED[exc.errno]}: {kind} at {address:#x} "
                                 f"(pc {pc:#x}, {where})")
        elif exc.errno == unicorn.UC_ERR_INSN_INVALID:
            address = pc
            err = EmulationError(f"invalid instruction at {pc:#x} ({where}): "
                                 f"{self.read(pc, 8).hex() if self._in_image(pc) else '?'}")
        else:
            address = pc
            err = EmulationError(f"{exc} at pc {pc:#x} ({where})")
        err.address = address  # type: ignore[attr-defined]
        return err

    def _effective_address(self, pc: int, page: int) -> int:
        """The exact address a faulting instruction used (the TLB only sees its page)."""
        return self._board.effective_address(pc, page) if self._in_image(pc) else page

    def _in_image(self, address: int) -> bool:
        return self._virt[0] <= address < self._virt[1] - 8

    def _serial_text(self) -> str:
        return self._serial.decode("utf-8", "replace").replace("\r\n", "\n")

    @property
    def serial(self) -> str:
        return self._serial_text()

    def close(self) -> None:
        for handle in self._hooks:
            try:
                self._uc.hook_del(handle)
            except unicorn.UcError:
                pass
        self._hooks.clear()
        self._interrupt_fns.clear()

    def __enter__(self) -> UnicornMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_run(*, seed: object, iterations: object, bench_calls: object,
              count_instructions: object, timeout: object, progress: object) -> float:
    """BadRunValue for a run option no run can use; the timeout as a float."""
    for option, value in (("seed", seed), ("iterations", iterations),
                          ("bench_calls", bench_calls)):
        check_count(option, value)
    check_flag("count_instructions", count_instructions)
    check_callback("progress", progress)
    return check_seconds("timeout", timeout)


class _Watchdog:
    """Ends an unsliced run from another thread: at its deadline, or on Ctrl-C.

    While the main thread is inside emu_start with no Python hook to run, Python
    runs no signal handler; Ctrl-C is seen through the wakeup fd to which
    Python's C-level handler writes the signal's number (``signal.set_wakeup_fd``;
    a wakeup fd set before is fed what arrives).  The stop is asked for again
    every few ms until emu_start returns, since unicorn drops a stop request
    that coincides with a hook redirecting execution.  ``fired`` says why it
    stopped the run ("timeout", "interrupt"), None if it did not.
    """

    _WAKE = b"\0"  # what __exit__ writes to end the wait (no signal has number 0)

    def __init__(self, uc: unicorn.Uc, deadline: float, *, sigint: bool) -> None:
        self._uc, self._deadline, self._sigint = uc, deadline, sigint
        self.fired: str | None = None
        self._done = threading.Event()
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._watch, name="ksim-unicorn-watchdog",
                                        daemon=True)

    def __enter__(self) -> _Watchdog:
        if self._sigint:
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            if self.fired is not None:
                self._uc.emu_stop()
                self._done.wait(0.005)
                continue
            left = self._deadline - time.perf_counter()
            if left <= 0:
                self.fired = "timeout"
                continue
            if select.select([self._read], [], [], left)[0]:
                with contextlib.suppress(BlockingIOError):
                    self._signalled(os.read(self._read, 512))

    def _signalled(self, numbers: bytes) -> None:
        forward = numbers.replace(self._WAKE, b"")
        if forward and self._previous_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self._previous_fd, forward)
        if self._sigint and int(signal.SIGINT) in forward:
            self.fired = "interrupt"

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        with contextlib.suppress(OSError):
            os.write(self._write, self._WAKE)
        self._thread.join()
        if self._sigint:
            signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)


class _Budgets:
    """Instruction budgets of a run's slices: those given first, then adapted so
    that a slice takes about SLICE_SECONDS."""

    def __init__(self, given: Iterable[int] | None) -> None:
        self._given: Iterator[int] | None = iter(given) if given is not None else None
        self._next = FIRST_SLICE

    def next(self) -> int:
        if self._given is not None:
            budget = next(self._given, None)
            if budget is not None:
                if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                    raise BadRunValue(f"slices must be positive instruction counts, not {budget!r}")
                return budget
            self._given = None
        return self._next

    def took(self, budget: int, seconds: float) -> None:
        scale = min(max(SLICE_SECONDS / max(seconds, 1e-4), 0.25), 4.0)
        self._next = int(min(max(budget * scale, MIN_SLICE), MAX_SLICE))


def _read_elf(path: Path) -> tuple[str, dict[str, int], list[tuple[str, int, int]],
                                   list[tuple[int, int, int, bytes, bool]]]:
    """The ELF machine, symbols, functions (sorted) and PT_LOAD segments
    (vaddr, paddr, memsz, data, exec)."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            e_machine = elf["e_machine"]
            segments = [
                (seg["p_vaddr"], seg["p_paddr"], seg["p_memsz"], seg.data(),
                 bool(seg["p_flags"] & 1))
                for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"
            ]
            symbols: dict[str, int] = {}
            functions: list[tuple[str, int, int]] = []
            symtab = elf.get_section_by_name(".symtab")
            for sym in symtab.iter_symbols() if isinstance(symtab, SymbolTableSection) else ():
                if not sym.name or sym.name.startswith("$"):
                    continue  # AArch64 mapping symbols ($x, $d) are no names
                symbols.setdefault(sym.name, sym["st_value"])
                if sym["st_info"]["type"] == "STT_FUNC":
                    functions.append((sym.name, sym["st_value"], sym["st_size"]))
    except OSError as exc:
        raise MalformedImage(f"cannot read {path}: {exc}") from exc
    except Exception as exc:  # pyelftools raises a variety of errors on bad input
        if isinstance(exc, MalformedImage):
            raise
        raise MalformedImage(f"{path}: malformed ELF: {exc}") from exc
    if not segments:
        raise MalformedImage(f"{path}: no PT_LOAD segments")
    functions.sort(key=lambda f: f[1])
    return e_machine, symbols, functions, segments
