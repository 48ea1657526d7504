"""The plain data and checks every layer of ksim shares, below all of them.

What snippets know of a kernel's data layout (``KernelABI``, ``MemRef``,
``Region``), a change of bytes (``Write``), the checks of a run's options and the
holding of Ctrl-C during a run.  Nothing here imports another ksim module but
``ksim.errors``: the architectures, the machines, the targets and the planner all
build on it without importing one another.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ksim.errors import BadRunValue


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
    #: offset of the thread-group id (the same size as the pid; None: no thread
    #: groups, a task's pid is its process's)
    task_tgid_offset: int | None = None
    #: offset of the task's name, ``char comm[16]`` (None: the kernel has none)
    task_comm_offset: int | None = None
    #: where the current cpu's number lives (None: a uniprocessor kernel, cpu is 0)
    cpu_number: MemRef | None = None
    #: a kernel function with copy_from_kernel_nofault's contract, ``(dst, src, size)
    #: -> 0, or -EFAULT without faulting`` (mm/maccess.c): snippet code reads memory at
    #: computed addresses through it (None: the kernel has none ksim knows)
    read_nofault: int | None = None
    #: the same contract for user-space addresses (Linux's copy_from_user_nofault):
    #: a Load marked ``user`` reads through it (None: as any Load)
    read_user_nofault: int | None = None
    #: when the kernel's memory map is fixed and known (the toy kernel's): every region
    #: a read may touch.  A computed address outside them reads as 0 instead of
    #: faulting, checked inline; preferred over ``read_nofault`` (no call)
    readable: tuple[Region, ...] = ()
    #: a kernel function ``u64 f(void)`` giving monotonic nanoseconds, callable from any
    #: context, NMI included (Linux's ktime_get_mono_fast_ns); None: the kernel has no
    #: clock source (the toy kernel), time is read as cycles (rdtsc)
    clock_ns: int | None = None


@dataclass(frozen=True, slots=True)
class Region:
    start: int
    end: int

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and self.start <= address < self.end

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Write:
    """Replace ``old`` by ``new`` at ``address`` (same length)."""

    address: int
    old: bytes
    new: bytes

    def __post_init__(self) -> None:
        if len(self.old) != len(self.new):
            raise ValueError("a Write must keep the length of the bytes it replaces")

    def inverse(self) -> Write:
        return Write(self.address, self.new, self.old)

    @property
    def end(self) -> int:
        return self.address + len(self.new)


#: workload values are u64 kernel globals (ksim_workload_seed, ...)
U64_LIMIT = 1 << 64


def check_count(option: str, value: object, *, limit: int = U64_LIMIT) -> None:
    """None (keep the default) or a whole number in [0, limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRunValue(f"{option} must be a whole number, not {value!r}")
    if not 0 <= value < limit:
        raise BadRunValue(f"{option} must be between 0 and {limit - 1}, not {value}")


def check_seconds(option: str, value: object) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise BadRunValue(f"{option} must be a positive number of seconds, not {value!r}")
    return float(value)


def check_callback(option: str, value: object) -> None:
    if value is not None and not callable(value):
        raise BadRunValue(f"{option} must be a function to call, not {value!r}")


def check_text(option: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise BadRunValue(f"{option} must be a string, not {value!r}")


def check_flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise BadRunValue(f"{option} must be True or False, not {value!r}")


class HeldInterrupt:
    """Ctrl-C during a run, held until the run is at a point where it can stop.

    While open -- in the main thread, where SIGINT has a Python handler -- SIGINT
    only sets ``pending``.  A run checks it at its own safe points (between
    emulator slices, between waits for a stop reply), stops the kernel there and
    calls ``deliver()``, which puts the previous handler back and calls it: Python's
    default handler raises KeyboardInterrupt at that point, never inside an
    emulator hook or halfway through a socket exchange.  Without a Python handler
    to defer (another thread, SIGINT ignored) it holds nothing.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Callable[[int, FrameType | None], Any] | None = None

    def __enter__(self) -> HeldInterrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._hold)
        return self

    @property
    def holding(self) -> bool:
        """Whether SIGINT is held here (so that a run can wait for it)."""
        return self._previous is not None

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def _restore(self) -> Callable[[int, FrameType | None], Any] | None:
        previous, self._previous = self._previous, None
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        return previous

    def deliver(self) -> None:
        """Hand a held Ctrl-C to the handler it was meant for (no-op if none came)."""
        if not self.pending:
            return
        self.pending = False
        previous = self._restore()
        if previous is not None:
            previous(signal.SIGINT, None)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.deliver()  # a Ctrl-C that came after the last check
        self._restore()
