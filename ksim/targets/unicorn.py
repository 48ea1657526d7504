"""The unicorn target: a bundled kernel image emulated in-process.

The image reserves its own patch area and data heap (``ksim_patch_area``,
``ksim_heap``), so patches get the same addresses here as under QEMU.  Trap
dispatch is unicorn's interrupt hook, on every architecture: the trap at a
spliced site (x86-64 ``int3``, AArch64 ``BRK #0x004``) reaches the hook instead
of the kernel's own handler, the machine says which site raised it
(``UnicornMachine.trap_site``), and the hook resumes execution at the site's
patch -- with the registers, flags and stack the kernel had, as a jump would.

On AArch64 the kernel's vectors could do it instead (they dispatch a BRK through
``ksim_trap_table`` under QEMU), but the hook is what the x86-64 target does, and
only it can call Python at a trap (``add_trap_hook``: Python probe handlers) and
count trap hits; the kernel's route is tested by the QEMU target.

A run boots the kernel afresh (pristine data) but keeps what ksim put there:
the spliced text, the patch area and the data heap (counters accumulate over
runs, like KernInst's on a running kernel).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ksim import images, poke
from ksim.arch import get_arch
from ksim.btf.sources import image_btf
from ksim.errors import EmulationError, TargetError, TargetFault
from ksim.image.elf import load_image
from ksim.images.abi import toy_abi
from ksim.machine.unicorn import UnicornMachine, check_run
from ksim.splice.alloc import RegionAllocator
from ksim.splice.patch import Change
from ksim.targets.base import Capabilities, RunResult, run_options

#: what an in-process emulator can do: traps reach Python, which may call handlers
CAPABILITIES = Capabilities(traps=True, python_hooks=True, oracles=("unicorn-address-hook",))


@dataclass
class _HookCounter:
    """The unicorn oracle: an exact address hook, independent of splicing."""

    name = "unicorn-address-hook"
    _count: int
    _remove: Callable[[], None]

    @property
    def count(self) -> int:
        return self._count

    def close(self) -> None:
        self._remove()


class UnicornTarget:
    capabilities = CAPABILITIES

    def __init__(self, image_name: str = "toy") -> None:
        path = images.path(image_name)
        self.name = f"unicorn:{image_name}"
        self.image = load_image(path)
        self.arch = get_arch(self.image.arch)
        self.abi = toy_abi(self.image)
        self.machine = UnicornMachine(path)
        sym = self.image.address_of
        self._code = RegionAllocator(sym("ksim_patch_area"), sym("ksim_patch_area_end"),
                                     name="patch area")
        self._data = RegionAllocator(sym("ksim_heap"), sym("ksim_heap_end"), name="data heap")
        #: the patch area as the image holds it
        self._code_filler = self.machine.read(self._code.start, self._code.end - self._code.start)
        self._traps: dict[int, int] = {}
        self._trap_hooks: dict[int, list[Callable[[UnicornMachine, int], int | None]]] = {}
        self._text = [(s.address, s.size) for s in self.image.sections if s.executable]
        self.trap_hits = 0
        self.machine.hook_interrupt(self._on_interrupt)

    # --- memory -------------------------------------------------------------------
    def when_idle(self, work: Callable[[], object]) -> None:
        """Nothing: this target waits on no remote answer (Target.when_idle)."""

    def read(self, address: int, size: int) -> bytes:
        try:
            return self.machine.read(address, size)
        except EmulationError as exc:
            raise TargetFault(f"cannot read {size} bytes at {address:#x}: {exc}") from exc

    def write(self, address: int, data: bytes) -> None:
        if not any(lo <= address < lo + n for lo, n in self._heap_regions()):
            raise TargetFault(f"{address:#x} is not kernel data ksim may write (text changes go through poke)")
        self.machine.write(address, data)

    def _heap_regions(self) -> list[tuple[int, int]]:
        return [(self._data.start, self._data.end - self._data.start)]

    def apply(self, change: Change) -> None:
        """Make ``change`` whole (Target.apply); the emulator is stopped between runs."""
        poke.apply_change(change, read=self.read, write=self.machine.write,
                          trap=self.arch.trap, route=self._route)

    def _route(self, site: int, patch: int | None) -> int | None:
        before = self._traps.pop(site, None)
        if patch is not None:
            self._traps[site] = patch
        return before

    def text_hazards(self, ranges: Sequence[tuple[int, int]]) -> list[frozenset[str]]:
        """No running kernel to ask: the image's tables answer (capabilities.hazards)."""
        return [frozenset() for _ in ranges]

    def ask_hazards(self, ranges: Sequence[tuple[int, int]]
                    ) -> Callable[[], list[frozenset[str]]]:
        answers = self.text_hazards(ranges)
        return lambda: answers

    def keep(self, keep: bool = True, name: str | None = None) -> str | None:
        raise TargetError(f"{self.name}: splices end with the emulator (capabilities.keep)")

    def alloc_code(self, size: int, near: int) -> int:
        return self._code.alloc(size, 16)

    def alloc_code_ahead(self, size: int, near: int) -> Callable[[], int]:
        """The area at once (nothing to wait for in-process), handed over when asked."""
        address = self.alloc_code(size, near)
        return lambda: address

    def free_code(self, address: int) -> None:
        """Free a patch block, its bytes back to the image's filler there (x86-64:
        int3; the arm64 toy's BRK #0), so that removal leaves the text as it was."""
        size = self._code.size_of(address)
        offset = address - self._code.start
        self.machine.write(address, self._code_filler[offset:offset + size])
        self._code.free(address)

    def alloc_data(self, size: int, align: int = 8) -> int:
        address = self._data.alloc(size, align)
        self.machine.write(address, bytes(size))
        return address

    def free_data(self, address: int) -> None:
        self._data.free(address)

    # --- traps -------------------------------------------------------------------
    def add_trap_hook(self, site: int, fn: Callable[[UnicornMachine, int], int | None]
                      ) -> Callable[[], None]:
        """Call ``fn(machine, site)`` each time the trap at ``site`` is taken, before
        execution resumes at its patch (Python probe handlers).  RIP is still just past
        the trap (x86-64) or on it (AArch64); ``fn`` may return an address to resume at
        instead of the patch.
        Returns a function that removes the hook."""
        self._trap_hooks.setdefault(site, []).append(fn)

        def remove() -> None:
            hooks = self._trap_hooks.get(site, [])
            if fn in hooks:
                hooks.remove(fn)
            if not hooks:
                self._trap_hooks.pop(site, None)

        return remove

    def _on_interrupt(self, machine: UnicornMachine, vector: int) -> None:
        site = machine.trap_site(vector)
        if site is None:
            raise EmulationError(f"unexpected interrupt {vector} at {machine.pc:#x}")
        patch = self._traps.get(site)
        if patch is None:
            raise EmulationError(f"trap at {site:#x} is not a ksim trap site")
        self.trap_hits += 1
        resume = patch
        for fn in list(self._trap_hooks.get(site, ())):
            redirect = fn(machine, site)
            if redirect is not None:
                resume = redirect
        machine.set_pc(resume)

    # --- running -----------------------------------------------------------------
    @run_options
    def run(self, *, seed: int | None = None, iterations: int | None = None,
            bench_calls: int | None = None, count_instructions: bool = False,
            progress: Callable[[], None] | None = None, timeout: float = 60.0,
            slices: Iterable[int] | None = None) -> RunResult:
        """Run the workload from a fresh boot to ksim_halt (module doc).

        As UnicornMachine.run: ``progress()`` is called between slices of the
        run (about every 0.1 s), TargetTimeout after ``timeout`` seconds, and
        Ctrl-C stops the run (KeyboardInterrupt), leaving everything ksim put in
        the kernel as it was.  ``slices`` sets the emulator's first slice
        budgets; a run's results do not depend on them, nor on ``progress``."""
        check_run(seed=seed, iterations=iterations, bench_calls=bench_calls,
                  count_instructions=count_instructions, timeout=timeout, progress=progress)
        keep = [(lo, hi - lo) for lo, hi in ((self._code.start, self._code.end),
                                              (self._data.start, self._data.end))]
        keep += self._text
        saved = [(a, self.machine.read(a, n)) for a, n in keep]
        self.machine.reset()
        for a, data in saved:
            self.machine.write(a, data)
        start = time.perf_counter()
        result = self.machine.run(seed=seed, iterations=iterations, bench_calls=bench_calls,
                                  count_instructions=count_instructions, progress=progress,
                                  timeout=timeout, slices=slices)
        return RunResult(checksum=result.checksum, instructions=result.instructions,
                         output=result.serial, seconds=time.perf_counter() - start)

    def btf(self, name: str = "vmlinux") -> bytes:
        """The image's BTF (its .BTF section): a kernel without modules."""
        return image_btf(self.image, name)

    def oracle_counter(self, address: int) -> _HookCounter:
        counter = _HookCounter(0, lambda: None)

        def hit(*_: object) -> None:
            counter._count += 1

        counter._remove = self.machine.hook_code(address, hit)
        return counter

    def close(self) -> None:
        self.machine.close()


def open(rest: str, **options: Any) -> UnicornTarget:  # noqa: A001 - the registry's entry point
    return UnicornTarget(rest, **options)


if TYPE_CHECKING:
    from ksim.targets.base import Target

    #: mypy checks the class against the target contract
    _CONTRACT: type[Target] = UnicornTarget
