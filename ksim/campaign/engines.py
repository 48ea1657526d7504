"""Where a campaign's cases run: local processes, or a Ray cluster.

Both take the cases in chunks and hand back each chunk's records as it completes
(in whatever order), so the caller can write them as they come.  A case's record
depends on the case and the image only, never on the chunk, the worker or the
engine.

* ``LocalEngine``: the image is loaded (and its analysis store read) once in this
  process, then forked into ``workers`` processes (one: this process runs them).
* ``RayEngine``: the image's files and its analysis store go into Ray's object
  store once (``ray.put``); a task is a chunk of cases, handed the references
  (nested in a list, so that Ray does not fetch them for every task); a worker
  process fetches them the first time it sees the image, writes the files into
  its temporary directory and keeps its harness for the tasks that follow.  At
  most ``workers`` tasks are in flight (default: the cluster's CPUs).
"""

from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing
import os
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ksim.campaign import worker
from ksim.campaign.cases import ImageSource, VerifyCase
from ksim.campaign.errors import ClusterUnavailable

Records = list[dict[str, Any]]
#: the most cases in one chunk (a chunk's records come back at once)
MAX_CHUNK = 64
#: the install command named when Ray is missing
RAY_EXTRA = "pip install 'ksim[cluster]'"


def chunks(cases: Sequence[VerifyCase], workers: int) -> list[list[tuple[Any, ...]]]:
    """Cases in chunks: about eight per worker, at most MAX_CHUNK cases each."""
    size = max(1, min(MAX_CHUNK, math.ceil(len(cases) / (8 * max(1, workers)))))
    return [[c.as_tuple() for c in cases[i:i + size]] for i in range(0, len(cases), size)]


def image_key(source: ImageSource) -> str:
    """The image's files' digest: which checker a worker process keeps for it."""
    h = hashlib.blake2b(digest_size=16)
    for path in (source.elf, source.kallsyms):
        if path is not None:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        h.update(b"\0")
    return h.hexdigest()


class LocalEngine:
    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = max(1, workers or os.cpu_count() or 1)

    def connect(self) -> None:
        """Nothing to join: the processes are started by run()."""

    def close(self) -> None:
        """Nothing to leave: run()'s processes are gone when it returns."""

    def run(self, source: ImageSource, cases: Sequence[VerifyCase]) -> Iterator[Records]:
        key = image_key(source)
        check = worker.checker(key, source)
        check.store_bytes()  # loaded (or built) here, once, before the fork
        parts = chunks(cases, self.workers)
        if self.workers == 1 or len(parts) == 1 or not _can_fork():
            for part in parts:
                yield worker.run_chunk(key, part)
            return
        context = multiprocessing.get_context("fork")
        with context.Pool(min(self.workers, len(parts))) as pool:
            yield from pool.imap_unordered(_local_chunk, [(key, part) for part in parts])


def _local_chunk(job: tuple[str, list[tuple[Any, ...]]]) -> Records:
    return worker.run_chunk(*job)


def _can_fork() -> bool:
    # forking a process with other threads may copy a lock another thread holds
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


class RayEngine:
    name = "ray"

    def __init__(self, address: str, workers: int | None = None) -> None:
        self.address = address
        self.requested = workers
        self.workers = workers or 0

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError as exc:
            raise ClusterUnavailable(f"--cluster needs Ray, which is not installed ({exc}): "
                                     f"{RAY_EXTRA}") from None
        if not ray.is_initialized():
            _reachable(self.address)
            try:
                ray.init(address=self.address, logging_level=logging.ERROR, log_to_driver=False,
                         include_dashboard=False, configure_logging=True)
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds when it cannot connect
                raise ClusterUnavailable(f"cannot reach the Ray cluster at {self.address!r}: "
                                         f"{type(exc).__name__}: {exc}") from None
        return ray

    def connect(self) -> None:
        """Join the cluster now (run() does it too): a cluster that cannot be reached
        is an error before anything starts."""
        ray = self._ray()
        if not self.workers:
            self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def run(self, source: ImageSource, cases: Sequence[VerifyCase]) -> Iterator[Records]:
        ray = self._ray()
        if not self.workers:
            self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        key = image_key(source)
        # the store this image uses (loaded, or built and saved, here once)
        store = worker.checker(key, source).store_bytes()
        refs = [ray.put(source.files()), ray.put(store)]
        task = ray.remote(num_cpus=1, max_retries=1)(_ray_chunk)
        pending = list(reversed(chunks(cases, self.workers)))
        running: list[Any] = []
        while pending or running:
            while pending and len(running) < self.workers:
                running.append(task.remote(key, (source.name, source.base), refs, pending.pop()))
            done, running = ray.wait(running, num_returns=1)
            for ref in done:
                try:
                    records = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    for other in running:
                        ray.cancel(other)
                    raise ClusterUnavailable(f"the Ray cluster at {self.address} failed a task "
                                             f"(the cases recorded so far are kept): "
                                             f"{type(exc).__name__}: {exc}") from None
                yield records

    def close(self) -> None:
        try:
            import ray
        except ImportError:
            return
        if ray.is_initialized():
            ray.shutdown()


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT address answers (ray.init waits for ever for one that does not)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "ray://...": Ray's own forms
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ClusterUnavailable(f"cannot reach the Ray cluster at {address!r}: "
                                 f"{exc.strerror or exc}") from None


def _ray_chunk(key: str, image: tuple[str, int | None], refs: list[Any],
               cases: list[tuple[Any, ...]]) -> Records:
    """A Ray task: a chunk of cases on this worker process's checker for the image
    (its name and base), made from the object store's copy the first time."""
    if not worker.has_checker(key):
        import ray

        files, store = ray.get(refs)
        directory = Path(tempfile.gettempdir()) / "ksim-verify" / key
        worker.checker(key, ImageSource.from_files(image[0], files, directory, image[1]), store)
    return worker.run_chunk(key, cases)


def engine_for(cluster: str | None, workers: int | None) -> LocalEngine | RayEngine:
    """``--cluster ADDRESS`` (else RAY_ADDRESS): Ray; neither: local processes."""
    address = cluster or os.environ.get("RAY_ADDRESS")
    if address:
        return RayEngine(address, workers)
    return LocalEngine(workers)
