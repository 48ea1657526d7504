"""The arm64 testbed: Debian's arm64 kernel of the x86 testbed's ABI in qemu-system-aarch64."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksim.errors import TargetError


def _unavailable() -> TargetError:
    return TargetError("the arm64 testbed cannot boot yet: its kernel, userland and module "
                       "preparation are not in this version of ksim")


def prepare(abi: str, *, offline: bool = False, progress: Any = None) -> dict[str, Any]:
    raise _unavailable()


def make_initramfs(ready: dict[str, Any], port: int, out: Path) -> Path:
    raise _unavailable()


def qemu_command(ready: dict[str, Any], initramfs: Path, port: int, inst: Any) -> list[str]:
    raise _unavailable()
