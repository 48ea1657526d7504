"""What a loaded kernel image looks like to the rest of ksim (pure data + lookups)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    address: int
    size: int
    executable: bool
    writable: bool
    #: file contents (b"" for NOBITS sections such as .bss)
    data: bytes = field(repr=False, default=b"")

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    address: int
    size: int
    kind: str  # "func", "object", "other"
    module: str


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    address: int
    size: int
    module: str

    @property
    def end(self) -> int:
        return self.address + self.size

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and self.address <= address < self.end


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 module attribute
    # Image needs the types above, so it lives in ksim.image.image; it is
    # reachable from here too for modules that import the image model by name.
    if name == "Image":
        from ksim.image.image import Image

        return Image
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
