"""Where a kernel's BTF comes from, and the one entry point the compiler calls.

    from ksim.btf import kernel_btf
    btf = kernel_btf(target)                 # or a Manager: its target's
    btf.member(btf.struct("task_struct"), "comm")
    kernel_btf(target, "virtio_net")         # a module's split BTF, on vmlinux's

Each target gives its kernel's BTF as bytes (``Target.btf``): an emulated kernel
from its image's ``.BTF`` section (``image_btf``), a live kernel from
``/sys/kernel/btf/<name>`` over kerninstd's ``btf`` op, kept on disk under the
blob's sha256 (``cache_dir``).  Parsed BTF is kept per target: a target's kernel
does not change under it (a module loaded again is the exception; a new target
sees its new BTF).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from ksim.btf.elf import SECTION, btf_section
from ksim.btf.errors import BTFError
from ksim.btf.reader import BTF

if TYPE_CHECKING:
    from ksim.image.image import Image
    from ksim.kapi import Manager
    from ksim.targets.base import Target

VMLINUX = "vmlinux"

_PARSED: weakref.WeakKeyDictionary[object, dict[str, BTF]] = weakref.WeakKeyDictionary()


def kernel_btf(target_or_manager: Target | Manager, module: str | None = None) -> BTF:
    """The BTF of the target's kernel (``module`` None), or of one of its modules
    (split BTF on the kernel's), parsed once per target."""
    from ksim.kapi import Manager

    target = target_or_manager.target if isinstance(target_or_manager, Manager) else target_or_manager
    name = module or VMLINUX
    parsed = _PARSED.setdefault(target, {})
    btf = parsed.get(name)
    if btf is None:
        base = None if name == VMLINUX else kernel_btf(target)
        btf = parsed[name] = BTF.from_bytes(target.btf(name), base=base, name=name)
    return btf


def image_btf(image: Image, name: str = VMLINUX) -> bytes:
    """The BTF of the kernel an image holds (``Target.btf`` of the emulated targets):
    its ``.BTF`` section, loaded (a Linux vmlinux) or not (the toy's, which pahole
    adds).  An image is one kernel without modules."""
    if name != VMLINUX:
        raise BTFError(f"{image.path}: no BTF for module {name!r}: the image is a kernel "
                       "without modules")
    for section in image.sections:
        if section.name == SECTION and section.data:
            return section.data
    if image.reads_memory:
        raise BTFError(f"{image.path}: the image is read from a running kernel and has no "
                       f"{SECTION} section")
    return btf_section(image.path)


def cache_dir() -> Path:
    """Where a live kernel's BTF is kept, one file per blob named by its sha256."""
    from ksim.images import cache_root

    return cache_root() / "btf"
