"""``--image`` values: a bundled image name ("toy") or a path to an ELF file."""

from __future__ import annotations

import os

from ksim.errors import UnknownImage
from ksim.image.elf import load_image
from ksim.image.image import Image

_LOADED: dict[str, Image] = {}


def image_path(spec: str) -> str:
    """The ELF path ``spec`` names: an existing file, else a bundled image (built on demand)."""
    if os.path.exists(spec) or os.sep in spec or spec.endswith((".elf", ".ko", ".o")):
        return spec
    try:
        from ksim import images
    except ImportError as exc:  # pragma: no cover - the package ships with ksim
        raise UnknownImage(f"no bundled images available ({exc})") from exc
    resolve = getattr(images, "path", None)
    if resolve is None:
        raise UnknownImage(f"no bundled image {spec!r}: this build has no bundled images")
    return str(resolve(spec))


def open_image(spec: str) -> Image:
    """Load (once per process) the image ``spec`` names."""
    path = image_path(spec)
    key = os.path.realpath(path)
    if key not in _LOADED:
        _LOADED[key] = load_image(path)
    return _LOADED[key]
