"""A campaign: cases run on an engine, recorded as they come, summed up.

The results file (``--results FILE.jsonl``) gets one JSON line per case as its
chunk completes.  Running the same campaign again with the same file skips the
cases it already holds (by image and case id): an interrupted run resumes.  A
line cut short by an interruption is ignored, and the next record starts on a
line of its own.

The summary counts the campaign's cases (those in the file included) and digests
their verdicts: ``verdicts`` is a BLAKE2b digest of the sorted verdict lines
(``worker.verdict``), so it does not depend on the order the cases completed in,
on the engine or on the number of workers, only on the cases and their outcomes.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ksim.campaign.cases import ARM64_IMAGE, DEFAULT_IMAGE, ImageSource, VerifyCase
from ksim.campaign.engines import LocalEngine, RayEngine
from ksim.campaign.errors import ResultsFileError
from ksim.campaign.worker import DIFFERENT, EQUIVALENT, ERROR, REFUSED, verdict


@dataclass
class Outcome:
    """What a campaign found: every case's record, by case id, and how it ran."""

    source: ImageSource
    records: dict[str, dict[str, Any]]
    engine: str
    workers: int
    #: cases run now (the others came from the results file)
    ran: int = 0
    seconds: float = 0.0
    order: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        statuses = Counter(r["status"] for r in self.records.values())
        refusals = Counter(r["reason"].split(":", 1)[0] for r in self.records.values()
                           if r["status"] == REFUSED)
        tactics = Counter(r["tactic"] for r in self.records.values() if r["status"] == EQUIVALENT)
        bad = [self.records[k] for k in self.order if self.records[k]["status"] in (DIFFERENT, ERROR)]
        return {
            "image": self.source.name,
            "cases": len(self.records),
            "compared": statuses[EQUIVALENT] + statuses[DIFFERENT],
            "equivalent": statuses[EQUIVALENT],
            "non_equivalent": statuses[DIFFERENT],
            "refused": statuses[REFUSED],
            "errors": statuses[ERROR],
            "engine": self.engine,
            "workers": self.workers,
            "verdicts": digest(self.records.values()),
            "ran": self.ran,
            "resumed": len(self.records) - self.ran,
            "seconds": round(self.seconds, 3),
            "cases_per_second": round(self.ran / self.seconds, 2) if self.seconds > 0 else None,
            "tactics": dict(sorted(tactics.items())),
            "refusals": dict(refusals.most_common()),
            "failures": [{"case": r["case"], "status": r["status"], "point": r["point"],
                          "tactic": r.get("tactic"), "why": (r.get("diffs") or [r["reason"]])[0],
                          "reproduce": reproducer(self.source, r["case"])} for r in bad],
        }


def digest(records: Any) -> str:
    lines = sorted(verdict(r) for r in records)
    h = hashlib.blake2b(digest_size=16)
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def reproducer(source: ImageSource, case_id: str) -> str:
    """The one-line command that runs exactly this case again."""
    import shlex

    named = source.name in (DEFAULT_IMAGE, ARM64_IMAGE) or source.name.startswith(DEFAULT_IMAGE + ":")
    image = "" if source.name == DEFAULT_IMAGE else f" --image {shlex.quote(source.name)}"
    kallsyms = f" --kallsyms {shlex.quote(source.kallsyms)}" \
        if source.kallsyms is not None and not named else ""
    return f"ksim verify{image}{kallsyms} --case {shlex.quote(case_id)}"


def read_results(path: Path, image: str) -> dict[str, dict[str, Any]]:
    """The records of ``image`` already in a results file (none when it does not exist)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise ResultsFileError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    with handle:
        for raw in handle:
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a line an interruption cut short
            if (isinstance(record, dict) and record.get("image") == image
                    and isinstance(record.get("case"), str) and "status" in record):
                out[record["case"]] = record
    return out


class _Writer:
    """Appends records to the results file, one line each, flushed as they come."""

    def __init__(self, path: Path | None) -> None:
        self.handle = None
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = path.open("ab")
            if self.handle.tell() and not _ends_with_newline(path):
                self.handle.write(b"\n")
        except OSError as exc:
            raise ResultsFileError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None

    def write(self, records: Sequence[dict[str, Any]]) -> None:
        if self.handle is not None:
            self.handle.write(b"".join(json.dumps(r, sort_keys=True).encode() + b"\n"
                                       for r in records))
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def run(source: ImageSource, cases: Sequence[VerifyCase], engine: LocalEngine | RayEngine, *,
        results: Path | None = None, progress: bool = True, stream: Any = None) -> Outcome:
    """Run the cases not already in ``results`` on ``engine``; every case's record."""
    from ksim.bench.common import Progress

    done = read_results(results, source.name) if results is not None else {}
    wanted = {c.id for c in cases}
    records = {k: r for k, r in done.items() if k in wanted}
    todo = [c for c in cases if c.id not in records]
    outcome = Outcome(source, records, engine.name, engine.workers, order=[c.id for c in cases])
    writer = _Writer(results)
    bar = Progress(len(todo), f"verify {source.name} ({engine.name})", stream or sys.stderr,
                   enabled=progress and bool(todo))
    started = time.perf_counter()
    try:
        if todo:
            for chunk in engine.run(source, todo):
                writer.write(chunk)
                for r in chunk:
                    records[r["case"]] = r
                outcome.ran += len(chunk)
                bad = sum(r["status"] in (DIFFERENT, ERROR) for r in records.values())
                bar.advance(len(chunk), f"{bad} not equivalent" if bad else "")
    finally:
        outcome.seconds = time.perf_counter() - started
        outcome.workers = engine.workers
        writer.close()
        if todo:
            bar.close()
    return outcome
