"""The code the benchmarks measure: the paper's four objects, re-chosen in Linux 6.1.

| paper (Linux 2.4.20) | here (Debian 6.1)                                         |
| eepro100.o           | e100.ko (the driver that replaced eepro100 in 2.6.x)     |
| sched.o              | kernel/sched/core.c's functions in vmlinux               |
| slab.o               | mm/slub.c's functions in vmlinux (SLUB is Debian's slab) |
| page_alloc.o         | mm/page_alloc.c's functions in vmlinux                   |

plus the bundled toy kernel.

Which vmlinux functions come from which source file, without DWARF
(Debian's vmlinuz carries no symbol table, only kallsyms): the linker lays out the
``.text`` of each object file in link order (Makefile order), and an object's
functions stay together because the kernel is not built with
``-ffunction-sections`` or LTO.  kallsyms lists functions, static ones included,
by address, so a source file is the contiguous run of functions between a first
and a last *anchor*, chosen by reading the listing and checked here against the
neighbours on both sides, which are known to come from other files (e.g. core.c
begins with its tracepoints, ``__traceiter_sched_kthread_stop``, right after
kernel/groups.c's ``__ia32_sys_setgroups``, and ends with
``call_trace_sched_update_nr_running`` before fair.c's ``update_min_vruntime``).
``__sched`` functions (``__schedule``, ``schedule``, ...) live in ``.sched.text``,
a second run of the same kind.  ``__init`` code (.init.text, freed after boot) is
left out: it cannot be instrumented at run time.  The anchors fit Debian's
6.1.0-x kernels; when an update moves them the benchmark says so instead of
guessing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ksim.arch import DEFAULT_ARCH, Arch, get_arch
from ksim.bench.common import Skip
from ksim.image import Function, Image

#: source file -> runs of (before, first, last, after): ``before`` and ``after`` are
#: the neighbouring functions of other files that confirm the boundaries.
ANCHORS: dict[str, list[tuple[str, str, str, str]]] = {
    "kernel/sched/core.c": [
        ("__ia32_sys_setgroups", "__traceiter_sched_kthread_stop",
         "call_trace_sched_update_nr_running", "update_min_vruntime"),
        ("__sched_text_start", "io_schedule_timeout", "preempt_schedule_irq", "__wait_on_bit_lock"),
    ],
    "mm/slub.c": [
        ("__kernel_unpoison_pages", "validate_show", "slabinfo_write", "folio_migrate_flags"),
    ],
    "mm/page_alloc.c": [
        ("__ia32_sys_process_vm_writev", "build_zonerefs_node", "has_managed_dma", "shuffle_pick_tail"),
    ],
}

#: the paper's names for the objects, in its order (Table 2)
PAPER_NAMES = {
    "e100.ko": "eepro100.o",
    "kernel/sched/core.c": "sched.o",
    "mm/slub.c": "slab.o",
    "mm/page_alloc.c": "page_alloc.o",
    "toy": "-",
}


@dataclass
class CodeSet:
    """Functions of one object, with the image they come from."""

    name: str
    image: Image
    functions: list[Function]
    method: str

    def code(self, func: Function) -> bytes:
        """The function's bytes without the padding after it (int3/nop fill that
        kallsyms-derived sizes include)."""
        return trim_padding(self.image.code(func), func.address, get_arch(self.image.arch))


def trim_padding(code: bytes, address: int, arch: Arch | None = None) -> bytes:
    """Cut the trailing run of alignment fill (x86-64: int3 and nops; the
    architecture's ``is_filler``); ``arch`` is the default one when not given."""
    arch = arch if arch is not None else get_arch(DEFAULT_ARCH)
    end = 0
    for insn in arch.decode(code, address):
        if not arch.is_filler(insn):
            end = insn.end - address
    return code[:end]


def runs_by_anchor(image: Image, runs: list[tuple[str, str, str, str]], label: str) -> list[Function]:
    """The functions of one source file, from its anchor runs (see the module docstring)."""
    order = sorted(image.functions, key=lambda f: f.address)
    index = {f.name: i for i, f in enumerate(order)}
    symbol_at = {s.name: s.address for s in image.symbols}
    out: list[Function] = []
    for before, first, last, after in runs:
        missing = [n for n in (before, first, last, after) if n not in symbol_at]
        if missing:
            raise Skip(f"{label}: anchor symbol(s) {', '.join(missing)} not in this kernel")
        if not (symbol_at[before] <= symbol_at[first] <= symbol_at[last] < symbol_at[after]):
            raise Skip(f"{label}: anchors {before} < {first} <= {last} < {after} are out of order")
        i, j = index.get(first), index.get(last)
        if i is None or j is None:
            raise Skip(f"{label}: anchor {first} or {last} is not a function")
        out.extend(order[i:j + 1])
    return out


def debian_sets(kernel: object) -> Iterator[CodeSet]:
    """e100.ko and the three vmlinux source files (the kernel from ksim.bench.kernel)."""
    from ksim.image import load_image, load_kallsyms

    e100 = load_image(kernel.e100)  # type: ignore[attr-defined]
    yield CodeSet("e100.ko", e100, list(e100.functions), "ELF symbol table (STT_FUNC with sizes)")
    vmlinux = load_kallsyms(kernel.kallsyms, kernel.vmlinux)  # type: ignore[attr-defined]
    for label, runs in ANCHORS.items():
        yield CodeSet(label, vmlinux, runs_by_anchor(vmlinux, runs, label),
                      "kallsyms link-order run between anchors")


def toy_set() -> CodeSet:
    from ksim import images
    from ksim.image import load_image

    image = load_image(images.path("toy"))
    return CodeSet("toy", image, list(image.functions), "ELF symbol table")


def all_sets(ctx: object, *, need_debian: bool = True) -> tuple[list[CodeSet], list[str]]:
    """Every code set available; notes say what is missing and why.

    In smoke mode the Debian kernel is used only when it is already unpacked in
    the cache (tests never download 70 MB)."""
    from ksim.bench import kernel as kmod

    notes: list[str] = []
    sets: list[CodeSet] = []
    if need_debian:
        try:
            if getattr(ctx, "smoke", False) and not kmod.is_cached():
                raise kmod.KernelUnavailable("smoke run: the Debian kernel is not in the cache")
            k = kmod.debian_kernel()
            sets.extend(debian_sets(k))
            notes.append(f"Debian kernel {k.abi} ({k.deb.name})")
        except kmod.KernelUnavailable as exc:
            notes.append(f"Debian kernel objects left out: {exc}")
    sets.append(toy_set())
    return sets, notes
