"""Periodic sampling of kernel values to the client (KAPI's handleEvents).

    sampler = Sampler(kmgr)
    sampler.add("bios", lambda: kmgr.read(counter), callback=print, interval=0.5)
    sampler.run(seed=1)          # kmgr.run with a progress hook; a last sample at the end

A sample is read from kernel memory by the client: on the emulators between
slices of emulation (the machines' ``progress`` callback), on a live kernel
over the network through the target's ``read`` while the guest runs.  Each
source has its own interval; every source is sampled once more when the run
ends, so a short run still reports its final values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ksim.kapi import Manager
from ksim.targets.base import RunResult


@dataclass
class Sample:
    name: str
    value: Any
    #: seconds since the run started
    at: float


@dataclass
class _Source:
    name: str
    read: Callable[[], Any]
    callback: Callable[[Sample], None] | None
    interval: float
    last: float = float("-inf")
    samples: list[Sample] = field(default_factory=list)


class Sampler:
    def __init__(self, kmgr: Manager) -> None:
        self.kmgr = kmgr
        self._sources: dict[str, _Source] = {}
        self._t0 = time.monotonic()

    def add(self, name: str, read: Callable[[], Any], *,
            callback: Callable[[Sample], None] | None = None, interval: float = 1.0) -> None:
        self._sources[name] = _Source(name, read, callback, interval)

    def remove(self, name: str) -> None:
        self._sources.pop(name, None)

    def samples(self, name: str) -> list[Sample]:
        return list(self._sources[name].samples)

    def handle_events(self, *, force: bool = False) -> int:
        """Sample every source whose interval has passed (all with ``force``);
        returns how many samples were taken."""
        now = time.monotonic()
        taken = 0
        for src in list(self._sources.values()):
            if force or now - src.last >= src.interval:
                src.last = now
                sample = Sample(src.name, src.read(), now - self._t0)
                src.samples.append(sample)
                if src.callback is not None:
                    src.callback(sample)
                taken += 1
        return taken

    def run(self, **options: Any) -> RunResult:
        """Run the kernel, sampling during the run and once at its end."""
        outer = options.pop("progress", None)
        self._t0 = time.monotonic()
        for src in self._sources.values():
            src.last = self._t0  # the first periodic sample comes one interval in

        def progress() -> None:
            self.handle_events()
            if outer is not None:
                outer()

        result = self.kmgr.run(progress=progress, **options)
        self.handle_events(force=True)
        return result
