"""The target contract: what the engine needs of a running kernel.

A target is a kernel ksim can read and change: the toy kernel in unicorn, the toy
kernel in QEMU, a live Linux kernel behind kerninstd.  The planner never talks to
a target; the Manager asks the target for memory, asks the planner for a Patch,
and hands the Patch's writes to the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ksim.arch.base import Arch
    from ksim.image.model import Image
    from ksim.splice.patch import Write


@dataclass(frozen=True, slots=True)
class MemRef:
    """A memory location as the kernel's code reaches it.

    ``segment`` is None for an absolute address, or "gs" for a per-cpu offset
    (Linux x86-64 reaches per-cpu data as gs:offset).
    """

    address: int
    segment: str | None = None
    size: int = 8


@dataclass(frozen=True, slots=True)
class KernelABI:
    """What snippets need to know about the kernel's data layout."""

    #: where the pointer to the current task lives
    current_task: MemRef
    #: offset and size of the pid field in the task structure
    task_pid_offset: int
    task_pid_size: int = 4
    #: where the current cpu's number lives (None: a uniprocessor kernel, cpu is 0)
    cpu_number: MemRef | None = None
    #: a kernel function with copy_from_kernel_nofault's contract, ``(dst, src, size)
    #: -> 0, or -EFAULT without faulting`` (mm/maccess.c): snippet code reads memory at
    #: computed addresses through it (None: the kernel has none ksim knows)
    read_nofault: int | None = None
    #: when the kernel's memory map is fixed and known (the toy kernel's): every region
    #: a read may touch.  A computed address outside them reads as 0 instead of
    #: faulting, checked inline; preferred over ``read_nofault`` (no call)
    readable: tuple[Region, ...] = ()


@dataclass(frozen=True, slots=True)
class Region:
    start: int
    end: int

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and self.start <= address < self.end

    @property
    def size(self) -> int:
        return self.end - self.start


class Target(Protocol):
    """Implemented by ksim.targets.unicorn, ksim.targets.qemu and live.client."""

    #: "unicorn:toy", "qemu:toy", "live://127.0.0.1:7070"
    name: str
    arch: Arch
    image: Image
    abi: KernelABI

    def read(self, address: int, size: int) -> bytes:
        """Read kernel memory (text or data); TargetFault on a bad address."""
        ...

    def poke(self, writes: Sequence[Write]) -> None:
        """Apply text writes, all or nothing.

        Each write's ``old`` bytes are checked against memory first; if any differ,
        StaleText is raised and nothing is written.  Targets that run while being
        changed use the int3 -> sync -> tail -> sync -> head protocol (ksim.poke).
        """
        ...

    def alloc_code(self, size: int, near: int) -> int:
        """Executable memory for a patch, reachable by a jmp from ``near``."""
        ...

    def free_code(self, address: int) -> None: ...

    def alloc_data(self, size: int, align: int = 8) -> int:
        """Zeroed kernel data memory (counters, timers)."""
        ...

    def free_data(self, address: int) -> None: ...

    def write(self, address: int, data: bytes) -> None:
        """Write kernel *data* memory (never text: text changes go through poke)."""
        ...

    def set_trap(self, site: int, patch: int) -> None:
        """Route a trap instruction at ``site`` to ``patch`` (before the trap is poked)."""
        ...

    def clear_trap(self, site: int) -> None:
        """Forget a trap route (after the trap bytes are gone)."""
        ...

    def run(self, **options: object) -> RunResult:
        """Let the kernel run: the emulators run the seeded workload to its end
        (options: seed, iterations, progress callback); a live kernel runs a
        command in the guest while instrumented (option: while_cmd)."""
        ...

    def oracle_counter(self, address: int) -> OracleCounter:
        """An independent count of executions of ``address`` that does not use
        splicing (unicorn: an exact address hook; QEMU: gdbstub breakpoints or the
        image's bookkeeping; live: the kernel's own kprobe).  Counts while the
        returned object is open."""
        ...

    def close(self) -> None: ...


class OracleCounter(Protocol):
    name: str  # "unicorn-address-hook", "gdbstub-breakpoint", "kprobe", ...

    @property
    def count(self) -> int: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class RunResult:
    """What a run reports; fields a target cannot know stay None."""

    checksum: int | None = None
    instructions: int | None = None
    output: str = ""
    seconds: float = 0.0
