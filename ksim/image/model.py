"""What a loaded kernel image looks like to the rest of ksim (pure data + lookups)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import overload


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


class SymbolTable(Sequence[Symbol]):
    """An image's symbols in (address, name) order, kept as five columns.  A running
    kernel has some 100,000 symbols and a command looks at a few: a :class:`Symbol` is
    made when one is asked for (making every one at the start took 60 ms of a live
    command).  The columns are read-only by convention, like the image."""

    __slots__ = ("names", "addresses", "sizes", "kinds", "modules")

    def __init__(self, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
                 kinds: Sequence[str], modules: Sequence[str]) -> None:
        """Columns already in (address, name) order; :meth:`ordered` puts them in it."""
        if not len(names) == len(addresses) == len(sizes) == len(kinds) == len(modules):
            raise ValueError("a symbol table's columns differ in length")
        self.names, self.addresses, self.sizes = names, addresses, sizes
        self.kinds, self.modules = kinds, modules

    @classmethod
    def ordered(cls, names: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
                kinds: Sequence[str], modules: Sequence[str]) -> SymbolTable:
        """The table of these columns in (address, name) order; symbols equal in both
        keep the order given."""
        n = len(names)
        order = [i for _a, _n, i in sorted(zip(addresses, names, range(n), strict=True))]
        if order == list(range(n)):     # in order already (a file's symbols mostly are)
            return cls(names, addresses, sizes, kinds, modules)
        pick = itemgetter(*order)
        return cls(pick(names), pick(addresses), pick(sizes), pick(kinds), pick(modules))

    @classmethod
    def of(cls, symbols: Iterable[Symbol]) -> SymbolTable:
        """The table of ``symbols``, in (address, name) order."""
        rows = list(symbols)
        return cls.ordered([s.name for s in rows], [s.address for s in rows],
                           [s.size for s in rows], [s.kind for s in rows],
                           [s.module for s in rows])

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, index: int) -> Symbol: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Symbol, ...]: ...

    def __getitem__(self, index: int | slice) -> Symbol | tuple[Symbol, ...]:
        if isinstance(index, slice):
            return tuple(map(self._make, range(*index.indices(len(self.names)))))
        if index < 0:
            index += len(self.names)
        if not 0 <= index < len(self.names):
            raise IndexError("symbol index out of range")
        return self._make(index)

    def _make(self, i: int) -> Symbol:
        return Symbol(self.names[i], self.addresses[i], self.sizes[i], self.kinds[i],
                      self.modules[i])

    def __iter__(self) -> Iterator[Symbol]:
        return map(Symbol, self.names, self.addresses, self.sizes, self.kinds, self.modules)

    def __repr__(self) -> str:
        return f"<SymbolTable of {len(self.names)} symbols>"


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 module attribute
    # Image needs the types above, so it lives in ksim.image.image; it is
    # reachable from here too for modules that import the image model by name.
    if name == "Image":
        from ksim.image.image import Image

        return Image
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
