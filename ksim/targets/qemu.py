"""The QEMU target: a bundled kernel image booted in qemu-system-x86_64 or
qemu-system-aarch64 (``qemu:toy``, ``qemu:toy-arm64``).

How it works
    QEMU starts stopped (``-S``) and boots the image: the x86 toy through its
    PVH ELF note, the arm64 toy as an ELF kernel of ``-M virt`` (at its
    physical entry, MMU off).  The machine's architecture comes from the image
    (``ksim.machine.qemu.PROFILES``: binary, machine, exit device, register
    file).  The target lets it run to a gdbstub breakpoint on ``ksim_entry64``,
    the 64-bit entry the boot path reaches once it has turned on the kernel's
    page tables, and where unicorn starts: from then on the gdbstub reads and
    writes kernel *virtual* addresses, and no kernel code that ksim may
    instrument has run.
    That stop is where ksim's changes go in, as unicorn puts them in before it
    starts.
    ``run()`` writes the workload globals (``ksim_workload_seed``...), lets the
    kernel run, and stops it at a breakpoint on ``ksim_halt`` -- QEMU stays
    alive, so memory can still be read after the run.

Repeated runs
    Like the unicorn target, every run boots the kernel afresh (pristine kernel
    data: a new QEMU process) but keeps what ksim put there: the kernel text
    (with its splices), the patch area, the data heap (counters accumulate over
    runs) and the trap routes.  They are read back from the stopped guest and
    written into the new one at its ``ksim_entry64`` stop.  The Manager needs to
    do nothing between runs.

Trap dispatch
    The toy kernel's own handler (x86: #BP on int3; arm64: the EL1 synchronous
    vector on BRK), the same ``struct ksim_trap { u64 site; u64 patch; }``
    table on both: the routes of a change (``apply``) edit the dense
    ``ksim_trap_table[0:ksim_trap_count]`` in guest memory (removal moves the
    last entry into the hole), mirrored in Python so that a new boot gets the
    same table.  That handler exists only once ``trap_init`` has loaded the IDT
    (VBAR_EL1 on arm64), and ksim's changes go in before it runs (at
    ``ksim_entry64``): a trap in ``trap_init`` or a function it calls
    (``set_intr_gate``, ``load_idt``) would reach no handler, and the kernel would
    die at boot.  ``capabilities.trap_setup`` names it; the planner refuses the
    trap tactic there (TrapUnavailable), and a jump still splices such a point.

Oracle
    ``oracle_counter(address)`` counts gdbstub breakpoint hits on ``address``
    during runs.  QEMU's TCG breakpoints are checked on the guest's program
    counter, outside guest memory: they neither change nor see the spliced text
    (a jump or trap at the point still stops there first), so the count is
    independent of splicing.  Every hit stops the VM and costs a gdbstub round
    trip (about 0.1-1 ms here), so keep iteration counts small when counting.

Cycles
    ``run(bench_calls=N)`` returns in ``RunResult.bench_cycles`` what the image
    measured around N calls of ``ksim_bench_target``: rdtsc on x86, the generic
    timer's virtual count (CNTVCT_EL0, QEMU virt's 62.5 MHz) on arm64.  Under
    TCG both are emulated (derived from the host clock, not from executed guest
    instructions): treat the figures as emulated time, good for comparing
    variants measured the same way, never as hardware cycles.

Exit
    A kernel that panics (a trap its table does not route) ends QEMU with
    status 35, through isa-debug-exit on x86 and semihosting's SYS_EXIT on
    arm64; the run raises TargetDied with the serial tail.

Acceleration: KVM when it boots the kernel, TCG otherwise (``target.accel``);
arm64 kernels run under TCG.
"""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ksim import poke
from ksim.arch import get_arch
from ksim.btf.sources import image_btf
from ksim.core import HeldInterrupt, check_callback, check_count, check_flag, check_seconds
from ksim.errors import (
    BadRunValue,
    HandlerUnsupported,
    KsimError,
    TargetDied,
    TargetError,
    TargetFault,
    TargetTimeout,
    TrapTableFull,
)
from ksim.image.elf import load_image
from ksim.images import toy
from ksim.images.abi import toy_abi
from ksim.machine.gdbstub import SIGTRAP, GdbStub
from ksim.machine.qemu import QemuMachine
from ksim.splice.alloc import RegionAllocator
from ksim.splice.patch import Change
from ksim.targets.base import Capabilities, RunResult, run_options

#: what QEMU's exit status says the toy kernel did (the same on both
#: architectures: include/asm-arm64.h makes semihosting's codes isa-debug-exit's)
EXIT_STATUSES = {toy.QEMU_EXIT_SUCCESS: "the kernel exited",
                 toy.QEMU_EXIT_FAILURE: "the kernel panicked"}
#: where the target stops a fresh boot to put ksim's changes in (see module doc)
BOOT_STOP = toy.ENTRY
#: where a workload ends (it would exit QEMU); the target stops there so memory stays readable
HALT = toy.HALT
#: longest wait for a stop reply before run() looks at Ctrl-C, its timeout and progress
POLL_SECONDS = 0.2


@dataclass(slots=True)
class QemuRunResult(RunResult):
    """RunResult plus what only this target knows."""

    #: ksim_bench_cycles: the counter's delta around the bench calls (rdtsc on
    #: x86, CNTVCT_EL0 on arm64; emulated under TCG)
    bench_cycles: int | None = None
    #: "kvm" or "tcg"
    accel: str | None = None
    #: seconds spent booting a new QEMU before this run (0 on the first run)
    boot_seconds: float = 0.0


class _BreakpointCounter:
    """The QEMU oracle: gdbstub breakpoint hits on one address, counted by the target."""

    name = "gdbstub-breakpoint"

    def __init__(self, target: QemuTarget, address: int) -> None:
        self._target, self.address, self._count = target, address, 0

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        self._target._drop_counter(self)


def _physical_map(path: Path) -> tuple[tuple[int, int, int], ...]:
    """(virtual start, virtual end, physical start) of every PT_LOAD segment:
    where QEMU loaded the image, which the boot page tables map one to one."""
    from elftools.elf.elffile import ELFFile

    with builtins.open(path, "rb") as f:
        return tuple((seg["p_vaddr"], seg["p_vaddr"] + seg["p_memsz"], seg["p_paddr"])
                     for seg in ELFFile(f).iter_segments() if seg["p_type"] == "PT_LOAD")


def _image_path(rest: str) -> Path:
    path = Path(rest)
    if path.is_file():
        return path
    from ksim import images

    return Path(images.path(rest))


class QemuTarget:
    #: the toy kernel's own trap path routes traps (no Python at a trap), once its
    #: trap_init has installed it: ksim's changes go in at ksim_entry64, before that;
    #: the oracle is a gdbstub breakpoint
    capabilities = Capabilities(traps=True, trap_setup=toy.TRAP_SETUP,
                                oracles=("gdbstub-breakpoint",))

    def __init__(self, image: str = "toy", *, accel: str = "auto", timeout: float = 10.0,
                 boot_timeout: float = 60.0, qemu: str | None = None) -> None:
        """Boot ``image`` (a bundled image name or an ELF path) to ``ksim_entry64``.

        ``timeout`` bounds each gdbstub/QMP exchange, ``boot_timeout`` a boot."""
        self.path = _image_path(image)
        self.name = f"qemu:{image}"
        self.image = load_image(self.path)
        self.arch = get_arch(self.image.arch)
        self._physical = _physical_map(self.path)
        self.abi = toy_abi(self.image)
        sym = self.image.address_of
        self._sym = sym
        self._code = RegionAllocator(sym(toy.PATCH_AREA), sym(toy.PATCH_AREA_END),
                                     name="patch area")
        self._data = RegionAllocator(sym(toy.HEAP), sym(toy.HEAP_END), name="data heap")
        #: the patch area as the image holds it (x86-64: int3; the arm64 toy: BRK #0)
        self._code_filler = self.image.read(self._code.start, self._code.end - self._code.start)
        # kernel text proper; the patch area is carried over by its allocations
        # (free patch memory holds the image's filler, as in a fresh image)
        self._text = [(s.address, s.size) for s in self.image.sections
                      if s.executable and not self._code.start <= s.address < self._code.end]
        self._traps: list[tuple[int, int]] = []  # mirror of ksim_trap_table[0:count]
        self._counters: list[_BreakpointCounter] = []
        self._timeout, self._boot_timeout, self._accel_choice = timeout, boot_timeout, accel
        self._qemu = qemu
        self.machine: QemuMachine | None = None
        #: the kernel has run since its boot (so the next run boots a new QEMU)
        self.ran = False
        self.boot_seconds = self._boot(accel)

    # --- booting ----------------------------------------------------------------------
    @property
    def accel(self) -> str | None:
        return self.machine.accel if self.machine else None

    def _boot(self, accel: str) -> float:
        start = time.monotonic()
        self.machine = QemuMachine(self.path, accel=accel, timeout=self._timeout,
                                   qemu=self._qemu, arch=self.image.arch,
                                   boot_check=self._boot_to_start)
        gdb = self.machine.gdb
        assert gdb is not None
        gdb.set_breakpoint(self._sym(HALT))
        for counter in self._counters:
            gdb.set_breakpoint(counter.address)
        self.ran = False
        return time.monotonic() - start

    def _boot_to_start(self, machine: QemuMachine) -> None:
        """Run a fresh QEMU to the ksim_entry64 breakpoint (the boot check too:
        an accelerator that cannot get there is given up)."""
        gdb = machine.gdb
        assert gdb is not None
        where = self._sym(BOOT_STOP)
        gdb.set_breakpoint(where)
        try:
            stop = gdb.cont(timeout=self._boot_timeout)
        except TargetTimeout:
            with contextlib.suppress(KsimError):
                gdb.interrupt(timeout=2)
            raise TargetTimeout(machine._describe(
                f"the kernel did not reach {BOOT_STOP} within {self._boot_timeout:.0f} s "
                f"({gdb.pc} {_safe_pc(gdb)}); serial:\n{machine.serial_text()[-1000:]}")) from None
        pc = gdb.read_pc()
        if stop.exited or pc != where:
            raise TargetError(machine._describe(
                f"boot stopped at {pc:#x} ({stop.raw}), not at {BOOT_STOP} {where:#x}"))
        gdb.remove_breakpoint(where)

    def _reboot(self) -> float:
        """A new QEMU with pristine kernel data and ksim's text, patch area,
        heap and trap routes carried over."""
        self._check_alive()
        keep = [*self._text, *self._code.allocated().items(), *self._data.allocated().items()]
        saved = [(a, self.read(a, n)) for a, n in keep]
        old = self.machine
        self.machine = None
        if old is not None:
            old.close()
        seconds = self._boot(old.accel if old and old.accel else self._accel_choice)
        gdb = self._gdb()
        for a, data in saved:
            gdb.write_memory(a, data)
        self._write_trap_table()
        return seconds

    # --- memory -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.machine is not None and not self.machine.alive():
            raise TargetDied(f"{self.name}: QEMU ended in an earlier run (exit status "
                             f"{self.machine.exit_status}), taking ksim's changes with it; "
                             f"open the target again")

    def _gdb(self) -> GdbStub:
        """The gdbstub of a stopped guest."""
        if self.machine is None or self.machine.gdb is None:
            raise TargetDied(f"{self.name} is closed")
        self._check_alive()
        gdb = self.machine.gdb
        if gdb.running:
            # only run() lets the guest run, and it owns the stop reply
            raise TargetError(f"{self.name}: the kernel is running; during a run only "
                              f"read() works")
        return gdb

    def when_idle(self, work: Callable[[], object]) -> None:
        """Nothing: this target waits on no remote answer (Target.when_idle)."""

    def read(self, address: int, size: int) -> bytes:
        """Kernel memory.  While a run is in progress (a progress callback
        reading a counter) the image's addresses are read through QMP's ``xp``
        on the physical address QEMU loaded them at, without stopping the guest."""
        machine = self.machine
        if machine is not None and machine.gdb is not None and machine.gdb.running:
            for lo, hi, physical in self._physical:
                if lo <= address and address + size <= hi:
                    return machine.read_physical(physical + address - lo, size)
        return self._gdb().read_memory(address, size)

    def write(self, address: int, data: bytes) -> None:
        if not (self._data.start <= address and address + len(data) <= self._data.end):
            raise TargetFault(f"{address:#x} is not kernel data ksim may write "
                              f"(text changes go through poke)")
        self._gdb().write_memory(address, data)

    def _write_raw(self, address: int, data: bytes) -> None:
        self._gdb().write_memory(address, data)

    def apply(self, change: Change) -> None:
        """Make ``change`` with the VM stopped (Target.apply): every old byte and the
        trap table's room are checked first (nothing changes when one is wrong),
        then the code, the routes and the text go in (ksim.poke's order, which for
        a stopped guest is simply all of them)."""
        self._gdb()  # a running or closed guest is refused before anything is checked
        poke.apply_change(change, read=self.read, write=self._write_raw, trap=self.arch.trap,
                          route=self._route, check_routes=self._check_room)

    def _slots(self) -> int:
        return self.image.symbol(toy.TRAP_TABLE).size // toy.TRAP_ENTRY_SIZE or toy.TRAP_SLOTS

    def _check_room(self, change: Change) -> None:
        routed = {site for site, _ in self._traps}
        after = (routed | {site for site, _ in change.sets}) - set(change.clears)
        grows = len(after) - len(routed)
        if grows > 0 and len(after) > self._slots():
            raise TrapTableFull(f"ksim_trap_table is full ({self._slots()} trap sites): "
                                f"{grows} more cannot be routed; nothing was changed")

    def _route(self, site: int, patch: int | None) -> int | None:
        before = next((p for s, p in self._traps if s == site), None)
        if patch is None:
            self._clear_trap(site)
        else:
            self._set_trap(site, patch)
        return before

    def text_hazards(self, ranges: Sequence[tuple[int, int]]) -> list[frozenset[str]]:
        """No kernel to ask: the image's tables answer (capabilities.hazards)."""
        return [frozenset() for _ in ranges]

    def ask_hazards(self, ranges: Sequence[tuple[int, int]]
                    ) -> Callable[[], list[frozenset[str]]]:
        answers = self.text_hazards(ranges)
        return lambda: answers

    def add_trap_hook(self, site: int, fn: Callable[[Any, int], int | None]
                      ) -> Callable[[], None]:
        raise HandlerUnsupported(f"{self.name} cannot call Python at a trap: "
                                 "use snippet handlers")

    def keep(self, keep: bool = True, name: str | None = None) -> str | None:
        raise TargetError(f"{self.name}: splices end with QEMU (capabilities.keep)")

    def alloc_code(self, size: int, near: int) -> int:
        # the whole patch area is within a jump's reach of the kernel text
        # (rel32 on x86, B's +-128 MB on arm64), and the unicorn target
        # allocates the same way: the same requests get the same addresses
        return self._code.alloc(size, 16)

    def alloc_code_ahead(self, size: int, near: int) -> Callable[[], int]:
        """The area at once (nothing to wait for in-process), handed over when asked."""
        address = self.alloc_code(size, near)
        return lambda: address

    def free_code(self, address: int) -> None:
        """Free a patch block, its bytes back to the image's filler there, as the
        unicorn target does: removal leaves the patch area as the image has it."""
        size = self._code.size_of(address)
        offset = address - self._code.start
        self._write_raw(address, self._code_filler[offset:offset + size])
        self._code.free(address)

    def alloc_data(self, size: int, align: int = 8) -> int:
        address = self._data.alloc(size, align)
        try:
            self._write_raw(address, bytes(size))
        except BaseException:
            self._data.free(address)
            raise
        return address

    def free_data(self, address: int) -> None:
        self._data.free(address)

    # --- traps ----------------------------------------------------------------------------
    def _set_trap(self, site: int, patch: int) -> None:
        for i, (s, _) in enumerate(self._traps):
            if s == site:
                self._traps[i] = (site, patch)
                self._write_trap_entry(i)
                return
        if len(self._traps) >= self._slots():
            raise TrapTableFull(f"ksim_trap_table is full ({self._slots()} trap sites)")
        self._traps.append((site, patch))
        # the entry first, then the count: the handler only looks below the count
        self._write_trap_entry(len(self._traps) - 1)
        self._write_trap_count()

    def _clear_trap(self, site: int) -> None:
        index = next((i for i, (s, _) in enumerate(self._traps) if s == site), None)
        if index is None:
            return
        last = len(self._traps) - 1
        # fill the hole with the last entry first, then shrink the count: at no
        # moment is a routed site missing from [0, count) (the guest is stopped
        # anyway, but the table stays valid for a kernel that would be running)
        self._traps[index] = self._traps[last]
        if index < last:
            self._write_trap_entry(index)
        self._traps.pop()
        self._write_trap_count()

    def _write_trap_entry(self, i: int) -> None:
        site, patch = self._traps[i]
        self._write_raw(self._sym(toy.TRAP_TABLE) + i * toy.TRAP_ENTRY_SIZE,
                        site.to_bytes(8, "little") + patch.to_bytes(8, "little"))

    def _write_trap_count(self) -> None:
        self._write_raw(self._sym(toy.TRAP_COUNT), len(self._traps).to_bytes(8, "little"))

    def _write_trap_table(self) -> None:
        for i in range(len(self._traps)):
            self._write_trap_entry(i)
        self._write_trap_count()

    def traps_in_guest(self) -> list[tuple[int, int]]:
        """ksim_trap_table[0:ksim_trap_count] as the guest holds it."""
        count = int.from_bytes(self.read(self._sym(toy.TRAP_COUNT), 8), "little")
        raw = self.read(self._sym(toy.TRAP_TABLE), count * toy.TRAP_ENTRY_SIZE) if count else b""
        return [(int.from_bytes(raw[i:i + 8], "little"), int.from_bytes(raw[i + 8:i + 16], "little"))
                for i in range(0, len(raw), toy.TRAP_ENTRY_SIZE)]

    # --- running --------------------------------------------------------------------------
    def _set_u64(self, name: str, value: int) -> None:
        self._write_raw(self._sym(name), (value % (1 << 64)).to_bytes(8, "little"))

    def _get_u64(self, name: str) -> int:
        return int.from_bytes(self.read(self._sym(name), 8), "little")

    @run_options
    def run(self, *, seed: int | None = None, iterations: int | None = None,
            bench_calls: int | None = None, count_instructions: bool = False,
            progress: Callable[[], None] | None = None,
            timeout: float = 600.0) -> QemuRunResult:
        """Run the workload to ``ksim_halt`` (see the module doc for repeated runs).

        ``progress()`` is called about once a second while the kernel runs.
        TargetTimeout after ``timeout`` seconds (the guest is stopped, QEMU kept);
        TargetDied if QEMU ends (the kernel failed: the serial tail says why).
        Ctrl-C stops the guest where it is (within POLL_SECONDS) and raises
        KeyboardInterrupt with the guest stopped, so ksim can still change it.
        ``count_instructions`` is there for callers that compare with unicorn:
        QEMU cannot count them (BadRunValue if asked to)."""
        for option, value in (("seed", seed), ("iterations", iterations),
                              ("bench_calls", bench_calls)):
            check_count(option, value)
        check_flag("count_instructions", count_instructions)
        if count_instructions:
            raise BadRunValue(f"{self.name} cannot count instructions (unicorn targets can)")
        check_callback("progress", progress)
        timeout = check_seconds("timeout", timeout)
        boot = self._reboot() if self.ran else 0.0
        for name, value in ((toy.WORKLOAD_SEED, seed), (toy.WORKLOAD_ITERATIONS, iterations),
                            (toy.BENCH_CALLS, bench_calls)):
            if value is not None:
                self._set_u64(name, value)
        machine = self.machine
        assert machine is not None and machine.gdb is not None
        gdb, halt = machine.gdb, self._sym(HALT)
        counters = {c.address: c for c in self._counters}
        start = time.monotonic()
        deadline, next_tick = start + timeout, start + 1.0
        self.ran = True
        with HeldInterrupt() as ctrl_c:
            gdb.resume()
            while True:
                if ctrl_c.pending:
                    self._stop_guest(counters)
                    ctrl_c.deliver()  # KeyboardInterrupt with the guest stopped
                    gdb.resume()  # (a handler that does not raise lets the run go on)
                now = time.monotonic()
                if now >= deadline:
                    self._stop_guest(counters)
                    raise TargetTimeout(
                        f"{self.name}: the workload did not reach {HALT} within {timeout:g} s "
                        f"(stopped at {gdb.read_pc():#x})")
                if progress is not None and now >= next_tick:
                    progress()
                    next_tick = now + 1.0
                try:
                    stop = gdb.wait(timeout=max(0.01, min(next_tick, deadline,
                                                          now + POLL_SECONDS) - now))
                except TargetTimeout:
                    continue  # still running: time for the checks above
                except TargetDied as e:
                    raise self._ended(machine.wait_exit(), "QEMU ended") from e
                if stop.exited:
                    # the stub reports the exit first (semihosting's SYS_EXIT: W<code>)
                    raise self._ended(stop.exit_code, f"the kernel exited ({stop.raw})")
                pc = gdb.read_pc()
                if pc == halt:
                    break
                counter = counters.get(pc)
                if counter is not None and stop.signal == SIGTRAP:
                    counter._count += 1
                    if not ctrl_c.pending:
                        gdb.resume()  # steps off the breakpoint first
                    continue
                raise TargetError(f"{self.name}: unexpected stop at {pc:#x} ({stop.raw})")
        seconds = time.monotonic() - start
        return QemuRunResult(
            checksum=self._get_u64(toy.WORKLOAD_CHECKSUM),
            output=machine.serial_text(), seconds=seconds,
            bench_cycles=self._get_u64(toy.BENCH_CYCLES) if bench_calls else None,
            accel=machine.accel, boot_seconds=boot)

    def _ended(self, status: int | None, otherwise: str) -> TargetDied:
        """The error for a QEMU that ended during a run, with status ``status``."""
        machine = self.machine
        assert machine is not None
        machine.wait_exit()  # reaped: the next run says QEMU has ended, not "connection lost"
        why = EXIT_STATUSES.get(status if status is not None else -1, otherwise)
        return TargetDied(f"{self.name}: {why} during the run (QEMU exit status {status}); "
                          f"serial:\n{machine.serial_text()[-2000:]}")

    def _stop_guest(self, counters: dict[int, _BreakpointCounter]) -> None:
        """Stop a running guest where it is; a counted breakpoint it reports
        having hit just before is counted."""
        machine = self.machine
        if machine is None or machine.gdb is None or not machine.gdb.running:
            return
        stop = machine.stop()
        if stop.signal == SIGTRAP and not stop.exited:
            counter = counters.get(machine.gdb.read_pc())
            if counter is not None:
                counter._count += 1

    def btf(self, name: str = "vmlinux") -> bytes:
        """The image's BTF (its .BTF section): a kernel without modules."""
        return image_btf(self.image, name)

    def oracle_counter(self, address: int) -> _BreakpointCounter:
        counter = _BreakpointCounter(self, address)
        self._gdb().set_breakpoint(address)
        self._counters.append(counter)
        return counter

    def _drop_counter(self, counter: _BreakpointCounter) -> None:
        if counter not in self._counters:
            return
        self._counters.remove(counter)
        # a QEMU that has ended (the kernel panicked) has no breakpoints left to remove
        if self.machine is not None and self.machine.gdb is not None and self.machine.alive() and \
                all(c.address != counter.address for c in self._counters) and \
                counter.address != self._sym(HALT):
            self._gdb().remove_breakpoint(counter.address)

    def close(self) -> None:
        machine, self.machine = self.machine, None
        if machine is not None:
            machine.close()

    def __enter__(self) -> QemuTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _safe_pc(gdb: GdbStub) -> str:
    try:
        return f"{gdb.read_pc():#x}"
    except KsimError:
        return "unknown"


def open(rest: str, **options: Any) -> QemuTarget:  # noqa: A001 - the registry's entry point
    return QemuTarget(rest, **options)


if TYPE_CHECKING:
    from ksim.targets.base import Target

    #: mypy checks the class against the target contract
    _CONTRACT: type[Target] = QemuTarget
