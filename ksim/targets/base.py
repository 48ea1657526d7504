"""The target contract: what the engine needs of a running kernel.

A target is a kernel ksim can read and change: the toy kernel in unicorn, the toy
kernel in QEMU, a live Linux kernel behind kerninstd.  The planner never talks to
a target.  The Manager takes areas of patch and heap memory from the target and
places patches inside them itself, asks the planner for Patches, and hands the
target one ``Change`` per request (one point or ten thousand), which the target
applies whole or not at all (``apply``: one poke sequence in an emulator, one
request and one module batch on a live kernel).  What a target can do is declared
in ``capabilities``, never found out by trying.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from ksim.core import KernelABI
from ksim.errors import UnknownRunOption

if TYPE_CHECKING:
    from ksim.arch.base import Arch
    from ksim.image.model import Image
    from ksim.splice.patch import Change


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a target can do, declared (the Manager and the commands read it; nothing
    finds it out by calling and catching)."""

    #: trap splicing: the kernel's trap path (or the emulator's hook) sends a trap at
    #: a routed site to its patch
    traps: bool = True
    #: the kernel function that installs the kernel's own trap dispatch, when traps
    #: go through it and the target's changes are in before it runs (QEMU's boot
    #: stop): it, and every function it calls, runs before a trap can be routed, so
    #: the trap tactic is refused there (TrapUnavailable).  None: traps are routed
    #: from the first instruction (an emulator's hook), or the kernel is running
    trap_setup: str | None = None
    #: ``add_trap_hook``: Python called at a trap (an emulator running in-process)
    python_hooks: bool = False
    #: ``text_hazards``: the running kernel says which text it relies on (ftrace,
    #: jump labels, kprobes, ...); without it the image's own tables answer
    hazards: bool = False
    #: ``run(while_cmd=...)`` runs a command in the guest while instrumented
    exec: bool = False
    #: ``keep``: splices may outlive the client that made them
    keep: bool = False
    #: the independent counts ``oracle_counter`` gives (its ``name``s)
    oracles: tuple[str, ...] = ()
    #: CPUs that may run a snippet at once (per-cpu slots of the recursion guard)
    nr_cpus: int = 1
    #: one ``apply``'s limits: writes and route changes together, and new bytes
    #: (None: no limit).  Patch code nothing reaches yet may go ahead in parts
    #: beyond them; text and routes may not.
    max_items: int | None = None
    max_bytes: int | None = None
    #: the size of the patch-area and heap areas the Manager takes at a time and
    #: places patches and variables in itself: a dry run or an insert then costs
    #: no request (a larger request gets an area of its own)
    code_chunk: int = 64 << 10
    data_chunk: int = 4 << 10
    #: what every byte of a new patch area holds, repeated from its start (a live
    #: kernel's module fills freed patch code again before it hands it out): the
    #: Manager knows those bytes without reading them.  b"": read when first needed
    code_fill: bytes = b""
    #: the kernel's release (``uname -r``) where it is a distribution's kernel: its
    #: headers package is found by it (``#include`` in trace programs); "" unknown
    release: str = ""


class Target(Protocol):
    """Implemented by ksim.targets.unicorn, ksim.targets.qemu and ksim.live.client."""

    # read-only to the engine: a target may hold them as attributes or properties
    @property
    def name(self) -> str:
        """Like "unicorn:toy", "qemu:toy", "live://127.0.0.1:7070"."""
        ...

    @property
    def arch(self) -> Arch: ...

    @property
    def image(self) -> Image: ...

    @property
    def abi(self) -> KernelABI: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def read(self, address: int, size: int) -> bytes:
        """Read kernel memory (text or data); TargetFault on a bad address."""
        ...

    def when_idle(self, work: Callable[[], object]) -> None:
        """Do ``work`` -- preparation the engine needs later, such as loading the
        image's analysis store -- while waiting on the kernel's answer to a request
        (a remote kernel's), or never: work that is not done, or fails, is done
        again where it is needed.  A target that waits on nothing drops it."""
        ...

    def apply(self, change: Change) -> None:
        """Make ``change`` (patch code, trap routes, text writes; see Change for the
        order), all or nothing: the only call that changes text or routes.

        Each write's ``old`` bytes are checked against memory first; if any differ,
        StaleText is raised and nothing is changed.  Targets that run while being
        changed use the int3 -> sync -> tail -> sync -> head protocol (ksim.poke).
        A refused part (a hazard, a full trap table, text another client holds)
        raises its own error and changes no byte and no route.
        """
        ...

    def alloc_code(self, size: int, near: int) -> int:
        """An area of executable memory for patches, reachable by a jump from
        ``near``; the Manager places patches inside it."""
        ...

    def alloc_code_ahead(self, size: int, near: int) -> Callable[[], int]:
        """alloc_code asked now and answered when what it returns is called: a live
        kernel sends the request at once and reads its reply then, while the client
        works on (a batch asks for its patch area before it has compiled its patches).
        The area is the caller's once answered (free_code gives it back); a refusal is
        raised by the call."""
        ...

    def free_code(self, address: int) -> None: ...

    def alloc_data(self, size: int, align: int = 8) -> int:
        """A zeroed area of kernel data memory; the Manager places variables in it."""
        ...

    def free_data(self, address: int) -> None: ...

    def write(self, address: int, data: bytes) -> None:
        """Write kernel *data* memory (never text: text changes go through apply)."""
        ...

    def text_hazards(self, ranges: Sequence[tuple[int, int]]) -> list[frozenset[str]]:
        """Why the running kernel relies on each (address, length) text range staying
        as it is (``capabilities.hazards``; otherwise empty sets: the image's tables
        answer)."""
        ...

    def ask_hazards(self, ranges: Sequence[tuple[int, int]]
                    ) -> Callable[[], list[frozenset[str]]]:
        """text_hazards' question, its answers given when the returned function is
        called: a target that answers over a wire sends it now and answers while the
        caller goes on; others answer at once."""
        ...

    def add_trap_hook(self, site: int, fn: Callable[[Any, int], int | None]
                      ) -> Callable[[], None]:
        """Call ``fn(machine, site)`` at the trap at ``site`` (``capabilities.python_hooks``;
        otherwise HandlerUnsupported).  Returns what removes it."""
        ...

    def keep(self, keep: bool = True, name: str | None = None) -> str | None:
        """Leave this client's splices in the kernel when it goes
        (``capabilities.keep``; otherwise TargetError)."""
        ...

    def run(self, *args: Any, **options: Any) -> RunResult:
        """Let the kernel run: the emulators run the seeded workload to its end
        (options: seed, iterations, ...); a live kernel runs a command in the
        guest while instrumented (option: while_cmd).

        Each target takes keyword options only, and only those it can honour
        (wrap ``run`` in ``run_options``): an option it does not take raises
        UnknownRunOption, an impossible value BadRunValue, before anything runs.
        Every target takes ``progress`` (called now and then while the kernel
        runs) and ``timeout`` (seconds; TargetTimeout when the run has not ended
        by then).  Ctrl-C stops a run at a point where the kernel can be changed
        again (see ``HeldInterrupt``) and raises KeyboardInterrupt.  (The
        signature is loose only because each target names its own options.)"""
        ...

    def btf(self, name: str = "vmlinux") -> bytes:
        """The kernel's BTF as it keeps it, raw (``ksim.btf.kernel_btf`` parses it and
        keeps the result per target): ``vmlinux``'s, or module ``name``'s split BTF
        on top of it.  An emulated kernel's comes from its image's ``.BTF``
        section, a live kernel's from ``/sys/kernel/btf/<name>``.  BTFError when the
        kernel has none for ``name``."""
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


# --- run options ----------------------------------------------------------------------
P = ParamSpec("P")
R = TypeVar("R")

def run_options(run: Callable[P, R]) -> Callable[P, R]:
    """Wrap a target's ``run`` so that an option it does not take raises
    UnknownRunOption (naming it, with the closest option it does take) instead of
    being ignored or reaching Python as a bare TypeError."""
    _self, *params = inspect.signature(run).parameters.values()
    if any(p.kind is not p.KEYWORD_ONLY for p in params):
        raise TypeError(f"{run.__qualname__}: a run takes named options only, and names "
                        f"every one (no catch-all)")
    accepted = tuple(p.name for p in params)

    @functools.wraps(run)
    def checked(*args: P.args, **options: P.kwargs) -> R:
        for name in options:
            if name not in accepted:
                target = getattr(args[0], "name", "the target") if args else "the target"
                close = difflib.get_close_matches(name, accepted, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                err = UnknownRunOption(f"{target}: run takes no option {name!r}{hint}; "
                                       f"its options: {', '.join(accepted)}")
                err.option = name  # type: ignore[attr-defined]
                raise err
        return run(*args, **options)

    return checked


def run_option_names(target: object) -> tuple[str, ...]:
    """The options ``target.run`` takes (what a command may pass it)."""
    run = getattr(target, "run")  # noqa: B009 - any object with a run method
    return tuple(p.name for p in inspect.signature(run).parameters.values()
                 if p.kind is p.KEYWORD_ONLY)
