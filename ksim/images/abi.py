"""The KernelABI of a bundled image, read from its own symbols; and what a live
Linux kernel offers snippet code for fault-safe reads.

The toy kernel is uniprocessor-style: ``current_task`` and ``cpu_number`` are
plain globals (absolute addresses), and it exports the pid field's offset in
``struct task_struct`` as the absolute symbol ``KSIM_TASK_PID_OFFSET`` (and its
name's, ``KSIM_TASK_COMM_OFFSET``).  Its
memory map is fixed: the image's sections are mapped (by the PT_LOAD segments in
unicorn, by the boot page tables' first GiB under QEMU, arch/x86/boot.S) and
nothing else a snippet may read is, so those sections are the ABI's ``readable``
regions.
"""

from __future__ import annotations

from collections.abc import Callable

from ksim.core import KernelABI, MemRef, Region
from ksim.errors import KsimError
from ksim.image import Image
from ksim.image.image import merge_ranges

PAGE = 0x1000

#: Linux functions with copy_from_kernel_nofault's contract, newest name first
#: (``probe_kernel_read`` before v5.8, mm/maccess.c)
NOFAULT_READERS = ("copy_from_kernel_nofault", "probe_kernel_read")


def toy_abi(image: Image) -> KernelABI:
    return KernelABI(
        current_task=MemRef(image.address_of("current_task"), None, 8),
        task_pid_offset=image.address_of("KSIM_TASK_PID_OFFSET"),
        task_pid_size=4,
        task_comm_offset=image.address_of("KSIM_TASK_COMM_OFFSET"),
        cpu_number=MemRef(image.address_of("cpu_number"), None, 4),
        readable=mapped_regions(image),
    )


def mapped_regions(image: Image) -> tuple[Region, ...]:
    """The pages holding the image's loaded sections, merged."""
    pages = ((s.address & -PAGE, -(-s.end // PAGE) * PAGE)
             for s in image.sections if s.address and s.size)
    return tuple(Region(lo, hi) for lo, hi in merge_ranges(pages))


#: Linux's clock for snippet code: monotonic, lock-free, NMI-safe (kernel/time/timekeeping.c)
CLOCK_NS = "ktime_get_mono_fast_ns"


def linux_clock_ns(lookup: Callable[[str], int]) -> int | None:
    """The address of the running kernel's ktime_get_mono_fast_ns, or None."""
    try:
        return lookup(CLOCK_NS) or None
    except KsimError:
        return None


#: Linux's copy_from_user_nofault (mm/maccess.c, v5.8+; probe_user_read before)
USER_NOFAULT_READERS = ("copy_from_user_nofault", "probe_user_read")


def linux_read_user_nofault(lookup: Callable[[str], int]) -> int | None:
    """The address of the running kernel's copy_from_user_nofault, or None."""
    return linux_read_nofault(lookup, USER_NOFAULT_READERS)


def linux_read_nofault(lookup: Callable[[str], int],
                       names: tuple[str, ...] = NOFAULT_READERS) -> int | None:
    """The address of the running kernel's copy_from_kernel_nofault (or its older
    name), asked of ``lookup``; None when the kernel has neither."""
    for name in names:
        try:
            address = lookup(name)
        except KsimError:
            continue
        if address:
            return address
    return None
