"""First-fit allocator over one address range (patch area, data heap).

Pure bookkeeping: it hands out addresses and never touches memory, so every
target (unicorn, QEMU, the live daemon) allocates the same way and the same
requests give the same addresses -- which is what makes patches byte-identical
across targets.
"""

from __future__ import annotations

import bisect

from ksim.errors import KsimError, OutOfMemory


class RegionAllocator:
    def __init__(self, start: int, end: int, *, name: str = "region") -> None:
        if end <= start:
            raise ValueError(f"{name}: empty range {start:#x}..{end:#x}")
        self.start, self.end, self.name = start, end, name
        self._free: list[tuple[int, int]] = [(start, end)]   # sorted, coalesced
        self._used: dict[int, int] = {}                      # address -> size

    def alloc(self, size: int, align: int = 16) -> int:
        if size <= 0:
            raise ValueError("allocation size must be positive")
        for i, (lo, hi) in enumerate(self._free):
            addr = (lo + align - 1) // align * align
            if addr + size <= hi:
                pieces = [(lo, addr)] if addr > lo else []
                if addr + size < hi:
                    pieces.append((addr + size, hi))
                self._free[i:i + 1] = pieces
                self._used[addr] = size
                return addr
        raise OutOfMemory(f"{self.name}: no room for {size} bytes "
                          f"({self.bytes_free} of {self.end - self.start} free)")

    def free(self, address: int) -> None:
        size = self._used.pop(address, None)
        if size is None:
            raise KsimError(f"{self.name}: {address:#x} was not allocated here")
        i = bisect.bisect(self._free, (address, address))
        lo, hi = address, address + size
        # merge with the free neighbours on either side, so the list stays coalesced
        if i < len(self._free) and self._free[i][0] == hi:
            hi = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == lo:
            lo = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (lo, hi))

    def allocated(self) -> dict[int, int]:
        return dict(self._used)

    def size_of(self, address: int) -> int:
        return self._used[address]

    @property
    def bytes_free(self) -> int:
        return sum(hi - lo for lo, hi in self._free)
