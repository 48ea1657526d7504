"""Targets: kernels ksim can instrument.  ``open_target(spec)`` picks one by scheme.

    unicorn:toy                the toy kernel emulated in-process
    qemu:toy                   the toy kernel booted in qemu-system-x86_64
    live://HOST:PORT           a live Linux kernel behind kerninstd

Each target module exposes ``open(rest: str, **options) -> Target``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ksim.core import KernelABI, MemRef, Region
from ksim.errors import TargetError
from ksim.targets.base import RunResult, Target

# scheme -> module implementing it (data, not code: new targets add a row)
SCHEMES: dict[str, str] = {
    "unicorn": "ksim.targets.unicorn",
    "qemu": "ksim.targets.qemu",
    "live": "ksim.live.client",
}


def parse_spec(spec: str) -> tuple[str, str]:
    """Split "unicorn:toy" -> ("unicorn", "toy"), "live://h:p" -> ("live", "h:p")."""
    scheme, sep, rest = spec.partition(":")
    if not sep or scheme not in SCHEMES:
        raise TargetError(
            f"unknown target {spec!r}: expected one of "
            + ", ".join(f"{s}:IMAGE" if s != "live" else "live://HOST:PORT" for s in SCHEMES)
        )
    rest = rest[2:] if rest.startswith("//") else rest
    if not rest:
        raise TargetError(f"target {spec!r} names no image or address")
    return scheme, rest


def open_target(spec: str, **options: Any) -> Target:
    scheme, rest = parse_spec(spec)
    module = importlib.import_module(SCHEMES[scheme])
    target: Target = module.open(rest, **options)
    return target


__all__ = ["KernelABI", "MemRef", "Region", "RunResult", "Target", "open_target", "parse_spec"]
