"""verify: ``ksim verify``'s cases per second, on local processes and on Ray.

One campaign (the Debian vmlinux: a seeded sample of function entries, one case
each, the default entry counter and policy) run four ways, each from the same
parent process with the image and its analysis store loaded once:

* **local, 1 and 2 workers**: ``LocalEngine`` (one worker: in this process; two:
  forked processes);
* **Ray, 1 and 2 workers**: ``RayEngine`` on a local Ray cluster started here
  (``ray start --head`` on 127.0.0.1 and one more node, one CPU each), with at
  most 1 or 2 tasks in flight.

Each run is a campaign from a cold start, as a user's is: the image is loaded and
its analysis store read in its time (local: by this process, before the workers
fork; Ray: the files and the store put into the object store, then fetched and
loaded by each worker process of a new Ray job), and no function has been
analysed yet.  Joining the cluster (``ray.init``) is not counted.

Every run must give the same verdict digest (checked: the benchmark fails
otherwise).  ``--quick`` checks fewer points; the smoke mode (tests) runs the
toy kernel on local processes only.  Without Ray installed the Ray rows are
skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ksim.bench.common import Context, Section, Skip, Table
from ksim.errors import KsimError

NAME = "verify"
TITLE = "ksim verify: cases per second, local processes and Ray, 1 and 2 workers"


# --- a local Ray cluster ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_command() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise Skip("no ray command (pip install 'ksim[cluster]')")
    return found


@contextmanager
def local_ray(nodes: int = 2, cpus: int = 1, *, timeout: float = 120.0) -> Iterator[str]:
    """A Ray cluster of ``nodes`` nodes with ``cpus`` CPUs each on 127.0.0.1, for as
    long as the with block: its address (``HOST:PORT``).  Each ``ray start`` runs in
    a session of its own, and the cluster is stopped by signalling those process
    groups only (SIGTERM, then SIGKILL): other Ray clusters on the machine are left
    alone, as ``ray stop`` would not leave them."""
    ray = _ray_command()
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ksray", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    groups: list[int] = []
    address = f"127.0.0.1:{port}"

    def start(args: list[str]) -> None:
        proc = subprocess.Popen([ray, "start", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                                 "--disable-usage-stats",
                                 f"--dashboard-agent-listen-port={free_port()}",
                                 f"--metrics-export-port={free_port()}", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        groups.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{out[-2000:]}")

    try:
        start(["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"])
        for _ in range(nodes - 1):
            start([f"--address={address}"])
        yield address
    finally:
        stop_groups(groups)
        shutil.rmtree(temp, ignore_errors=True)


def stop_groups(groups: list[int], grace: float = 10.0) -> None:
    """SIGTERM the process groups, SIGKILL what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            try:
                os.killpg(g, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(g) for g in groups):
            time.sleep(0.2)
        if not any(_alive(g) for g in groups):
            return


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


# --- the benchmark -------------------------------------------------------------------------
def _campaign(ctx: Context) -> tuple[Any, list[Any]]:
    from ksim.campaign import cases, engines, worker

    if ctx.smoke:
        source = cases.image_source("toy")
        points = None
    else:
        try:
            source = cases.image_source(None)
        except KsimError as exc:
            raise Skip(f"no Debian kernel: {exc}") from None
        points = ctx.pick(1000, 300, None)
    check = worker.checker(engines.image_key(source), source)
    targets = cases.select(check.image, "all", sample=points, seed=1)
    return source, cases.make_cases(targets, 1, seed=1)


def run(ctx: Context) -> Section:
    from ksim.campaign import campaign, worker
    from ksim.campaign.engines import LocalEngine, RayEngine

    source, todo = _campaign(ctx)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def measure(engine: Any) -> None:
        worker.forget()  # a cold start: the image loaded again, nothing analysed
        outcome = campaign.run(source, todo, engine, progress=ctx.progress, stream=ctx.stream)
        s = outcome.summary()
        rows.append({"engine": engine.name, "workers": engine.workers, "cases": s["cases"],
                     "seconds": s["seconds"], "cases_per_second": s["cases_per_second"],
                     "verdicts": s["verdicts"], "non_equivalent": s["non_equivalent"],
                     "refused": s["refused"], "errors": s["errors"]})

    for workers in (1, 2):
        measure(LocalEngine(workers))
    ray_note: dict[str, Any] = {}
    if not ctx.smoke:
        try:
            import ray  # noqa: F401
        except ImportError:
            ray_note = {"skipped": "Ray is not installed (pip install 'ksim[cluster]')"}
        else:
            with local_ray(nodes=2, cpus=1) as address:
                for workers in (1, 2):
                    engine = RayEngine(address, workers)
                    try:
                        t0 = time.perf_counter()
                        engine.connect()  # a new job: new worker processes
                        ray_note[f"ray_connect_{workers}_s"] = round(time.perf_counter() - t0, 3)
                        measure(engine)
                    finally:
                        engine.close()
    digests = {r["verdicts"] for r in rows}
    if len(digests) != 1:
        raise RuntimeError(f"the engines disagree: {[(r['engine'], r['workers'], r['verdicts']) for r in rows]}")
    notes.append(f"{len(todo)} cases on {source.name}; every run's verdict digest "
                 f"{digests.pop()}")
    if ray_note.get("skipped"):
        notes.append(f"ray: skipped: {ray_note['skipped']}")
    table = Table("cases per second", ["engine", "workers", "cases", "seconds", "cases/s",
                                       "not equivalent", "refused"],
                  [[r["engine"], r["workers"], r["cases"], r["seconds"], r["cases_per_second"],
                    r["non_equivalent"], r["refused"]] for r in rows])
    # the machine may be shared: its load says how much of it the runs had
    notes.append(f"load average (1, 5, 15 min) before: {_load(load_before)}, "
                 f"after: {_load(os.getloadavg())} on {os.cpu_count()} CPUs")
    return Section({"rows": rows, **ray_note}, [table], notes,
                   {"image": source.name, "cases": len(todo), "cpus": os.cpu_count(),
                    "load_average_before": list(load_before),
                    "load_average_after": list(os.getloadavg())})


def _load(values: tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def plot(entry: dict[str, Any], path: str) -> None:
    from ksim.bench.common import pyplot, save

    plt = pyplot()
    rows = entry["results"]["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['engine']} x{r['workers']}" for r in rows]
    ax.bar(labels, [r["cases_per_second"] or 0 for r in rows], color="#4477aa")
    ax.set_ylabel("cases per second")
    ax.set_title("ksim verify")
    save(fig, path)


def document(ctx: Context, *, out: Any = sys.stdout, json_path: str | None = None,
             plot_path: str | None = None) -> dict[str, Any]:
    """``ksim bench verify``: this benchmark's results document (schema ksim-bench/1),
    as the runner makes one for the others."""
    from ksim.bench import runner
    from ksim.bench.common import SCHEMA, jsonable, machine_info, now_iso

    doc: dict[str, Any] = {"schema": SCHEMA, "machine": machine_info(), "started": now_iso(),
                           "mode": ctx.mode, "benchmarks": {}}
    t0 = time.perf_counter()
    try:
        section = run(ctx)
    except Skip as exc:
        entry: dict[str, Any] = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the document keeps the cause
        if os.environ.get("KSIM_BENCH_RAISE"):
            raise
        entry = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    else:
        entry = {"status": "ok", "title": TITLE, "params": jsonable(section.params),
                 "results": jsonable(section.results),
                 "tables": [t.as_dict() for t in section.tables], "notes": list(section.notes)}
    entry["seconds"] = time.perf_counter() - t0
    doc["benchmarks"][NAME] = entry
    if plot_path and entry["status"] == "ok":
        plot(entry, plot_path)
        entry["plot"] = os.path.basename(plot_path)
    doc["finished"] = now_iso()
    if out is not None:
        runner.print_entry(NAME, entry, out)
    if json_path:
        runner.write_json(doc, json_path)
    return doc
