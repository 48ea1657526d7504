"""Running cases: one Harness per process and image, each case's result as a record.

A record is the JSON line ``ksim verify`` writes for a case::

    {"image": "debian", "case": "vfs_read:auto:counter:17", "status": "equivalent",
     "point": "vfs_read+0x5", "tactic": "jmp+displace", "reason": "", "diffs": [],
     "executed": 14, "exit": "return at 0x...", "seconds": 0.008}

``status`` is the harness's (equivalent, refused, not-equivalent) or ``error``: the
run itself failed (an emulation that did not end, a bug of the harness), which is
reported like a non-equivalence, never dropped.  Everything in a record but
``seconds`` is a function of the case and the image alone: ``verdict`` keeps the
part the campaign's digest is made of.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ksim.campaign.cases import ImageSource, VerifyCase
from ksim.differential import Case, Harness
from ksim.errors import KsimError

#: statuses of a record
EQUIVALENT, REFUSED, DIFFERENT, ERROR = "equivalent", "refused", "not-equivalent", "error"


class Checker:
    """One image's harness in this process, and the cases it runs."""

    def __init__(self, source: ImageSource, store: bytes | None = None) -> None:
        self.source = source
        self.image = source.load()
        if store is not None:
            from ksim.analysis import store as stores

            stores.use(self.image, stores.Store.from_bytes(store, self.image))
        self.harness = Harness(self.image)

    def store_bytes(self) -> bytes | None:
        """The analysis store this image uses here, as its file holds it (to ship to
        workers elsewhere), building it when the image is large enough to want one."""
        from ksim.analysis import store as stores

        found = stores.store_for(self.image)
        if found is None:
            return None
        path = stores.path_for(self.image)
        try:
            data = path.read_bytes()
        except OSError:
            found.save(path)
            data = path.read_bytes()
        return data

    def case_of(self, case: VerifyCase) -> Case:
        """The harness's case: the point resolved as the Manager resolves it."""
        func = self.image.function_at(case.function)
        if func is None or func.address != case.function:
            raise KsimError(f"no function at {case.function:#x}")
        if case.offset is None:
            address, kind = self.harness.facts.entry(func).address, "entry"
        else:
            address, kind = func.address + case.offset, "insn"
        return Case(func.name, address, case.policy, case.snippet, case.seed, kind)

    def run(self, case: VerifyCase) -> dict[str, Any]:
        started = time.perf_counter()
        record: dict[str, Any] = {"image": self.source.name, "case": case.id}
        try:
            try:
                hcase = self.case_of(case)
            except KsimError as exc:  # no entry point to be found: the Manager refuses too
                record.update(status=REFUSED, point=case.point, tactic=None,
                              reason=f"{type(exc).__name__}: {exc}", diffs=[], executed=0, exit=None)
            else:
                r = self.harness.run_case(hcase)
                record.update(status=r.status, point=r.where, tactic=r.tactic, reason=r.reason,
                              diffs=list(r.diffs), executed=r.executed,
                              exit=None if r.exit is None else str(r.exit))
                if r.status == DIFFERENT:
                    record["moved"] = r.moved
        except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, not lost
            record.update(status=ERROR, point=case.point, tactic=None,
                          reason=f"{type(exc).__name__}: {exc}", diffs=[], executed=0, exit=None)
        record["seconds"] = round(time.perf_counter() - started, 6)
        return record

    def run_many(self, cases: Sequence[VerifyCase]) -> list[dict[str, Any]]:
        return [self.run(c) for c in cases]


def verdict(record: dict[str, Any]) -> str:
    """What a campaign's digest keeps of a record: the case and its outcome."""
    return "\t".join([record["case"], record["status"], record.get("tactic") or "-",
                      record.get("reason") or "", " | ".join(record.get("diffs") or ())])


# --- one checker per process and image ----------------------------------------------------
_CHECKERS: dict[str, Checker] = {}


def checker(key: str, source: ImageSource | None = None, store: bytes | None = None) -> Checker:
    """This process's checker for image ``key``, made from ``source`` the first time."""
    found = _CHECKERS.get(key)
    if found is None:
        if source is None:
            raise KsimError(f"no image {key} loaded in this process")
        found = _CHECKERS[key] = Checker(source, store)
    return found


def forget() -> None:
    """Drop this process's checkers (the next campaign loads its image afresh)."""
    _CHECKERS.clear()


def has_checker(key: str) -> bool:
    return key in _CHECKERS


def run_chunk(key: str, cases: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Run cases (as VerifyCase.as_tuple) on this process's checker for ``key``."""
    return checker(key).run_many([VerifyCase(*c) for c in cases])
