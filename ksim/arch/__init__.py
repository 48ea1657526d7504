"""Architecture plug-ins, found by name (one package per architecture)."""

from __future__ import annotations

import importlib

from ksim.arch.base import Arch, CallConvention, Flow, Insn

#: architecture name -> module that defines ``ARCH`` (and its aliases)
REGISTRY: dict[str, str] = {
    "x86_64": "ksim.arch.x86_64",
    "x86-64": "ksim.arch.x86_64",
    "amd64": "ksim.arch.x86_64",
    "aarch64": "ksim.arch.aarch64",
    "arm64": "ksim.arch.aarch64",
}

#: the architecture of instructions handed over without one (``build_cfg`` called
#: with decoded instructions alone); everything that has an image uses its ``arch``
DEFAULT_ARCH = "x86_64"


def get_arch(name: str) -> Arch:
    """The architecture object for ``name``; ValueError naming the known ones otherwise."""
    try:
        module = REGISTRY[name.lower()]
    except KeyError:
        known = ", ".join(sorted(set(REGISTRY)))
        raise ValueError(f"unknown architecture {name!r} (known: {known})") from None
    arch: Arch = importlib.import_module(module).ARCH
    return arch


def load_decoder() -> None:
    """Load the instruction decoder every architecture here reads code with
    (capstone's bindings: some 20 ms, most of a warm command's first decode).
    Callers that wait on something else anyway -- a remote kernel's answer --
    load it then; the first decode would load it otherwise."""
    import capstone  # noqa: F401


__all__ = ["DEFAULT_ARCH", "REGISTRY", "Arch", "CallConvention", "Flow", "Insn", "get_arch",
           "load_decoder"]
