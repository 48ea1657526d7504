"""What cat(), cgroup_path() and ustack's symbolizer read: the traced machine's
files, which bpftrace reads in its user space, on the traced machine itself.

ksim's client runs on another host than a live kernel, so on ``live://`` they go
through kerninstd (``read_file``, from an offset, and ``cgroup_path``, read-only ops
bounded by protocol.MAX_FILE_READ and MAX_CGROUP_DIRS).  An emulated kernel (``unicorn:``,
``qemu:``) has no filesystem: cat() reads the client's own file, which stands for
it, and cgroup_path() is refused before anything is spliced (there are no
cgroups to name).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from ksim.errors import KsimError

#: the bytes cat() prints at most (bpftrace's max_cat_bytes)
MAX_CAT_BYTES = 10240


class GuestFiles(Protocol):
    """What a target serving a running Linux kernel offers of its machine's files
    (ksim.live.client.LiveTarget)."""

    def read_file(self, path: str, size: int, offset: int = 0) -> bytes: ...

    def cgroup_path(self, cgroup_id: int) -> str: ...


class TracedMachine:
    """The files of the machine whose kernel a session traces."""

    def __init__(self, target: Any) -> None:
        self.target = target
        #: a running kernel (its machine's files are read through kerninstd)
        self.live = bool(target.image.reads_memory)
        self._cgroups: dict[int, str] = {}

    def cat(self, path: str, limit: int = MAX_CAT_BYTES) -> str:
        """The file's first ``limit`` bytes as text, or bpftrace's error for a file
        it cannot read."""
        try:
            if self.live:
                raw = cast(GuestFiles, self.target).read_file(path, limit)
            else:
                with open(path, "rb") as f:
                    raw = f.read(limit)
        except (KsimError, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            return f"ERROR: failed to open file '{path}': {why}\n"
        return raw.decode("utf-8", "replace")

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the file from ``offset`` (fewer at its end), for
        ustack's symbolizer (a ksim.trace.usym.RangeReader); KsimError when the file
        cannot be read."""
        if self.live:
            return cast(GuestFiles, self.target).read_file(path, size, offset)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(size)
        except OSError as exc:
            raise KsimError(f"{path}: {exc.strerror}") from None

    def cgroup_path(self, cgroup_id: int) -> str:
        """bpftrace's text for a cgroup id: ``unified:PATH`` (the cgroup2 hierarchy);
        empty for a cgroup the machine's cgroup2 mount does not have (none mounted),
        as bpftrace prints it."""
        if cgroup_id not in self._cgroups:
            try:
                path = "unified:" + cast(GuestFiles, self.target).cgroup_path(cgroup_id)
            except KsimError:
                path = ""
            self._cgroups[cgroup_id] = path
        return self._cgroups[cgroup_id]


__all__ = ["GuestFiles", "MAX_CAT_BYTES", "TracedMachine"]
