"""The KernelABI of a bundled image, read from its own symbols.

The toy kernel is uniprocessor-style: ``current_task`` and ``cpu_number`` are
plain globals (absolute addresses), and it exports the pid field's offset in
``struct task_struct`` as the absolute symbol ``KSIM_TASK_PID_OFFSET``.
"""

from __future__ import annotations

from ksim.image import Image
from ksim.targets.base import KernelABI, MemRef


def toy_abi(image: Image) -> KernelABI:
    return KernelABI(
        current_task=MemRef(image.address_of("current_task"), None, 8),
        task_pid_offset=image.address_of("KSIM_TASK_PID_OFFSET"),
        task_pid_size=4,
        cpu_number=MemRef(image.address_of("cpu_number"), None, 4),
    )
