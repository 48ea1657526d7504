"""Unloading the module restores every splice it made, even splices a client kept."""

# ruff: noqa: F811  (pytest fixtures imported from live.testing are parameters here)
from __future__ import annotations

import struct
import time

import pytest

from ksim.errors import KsimError, TargetDied
from ksim.splice.patch import Write
from live.client import LiveTarget
from live.testing import dmesg_problems, plain_site, testbed  # noqa: F401

pytestmark = [pytest.mark.live, pytest.mark.slow]


def _connect(testbed: dict, timeout: float = 90.0) -> LiveTarget:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
        except (KsimError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_unload_restores_kept_splices(testbed: dict) -> None:
    t = _connect(testbed)
    jsite, tsite = plain_site(t, "__x64_sys_getppid"), plain_site(t, "__x64_sys_getpid")
    originals = {jsite: t.read(jsite, 8), tsite: t.read(tsite, 8)}
    patch = t.alloc_code(16, near=jsite)
    # A patch that only runs the displaced (position-independent) instruction and jumps back.
    for site in (jsite, tsite):
        code = originals[site][:5] + b"\xe9" + struct.pack("<i", site + 5 - (patch + 10))
        t.poke([Write(patch, t.read(patch, 10), code)])
        if site == jsite:
            t.poke([Write(jsite, originals[jsite][:5],
                          b"\xe9" + struct.pack("<i", patch - (jsite + 5)))])
            patch = t.alloc_code(16, near=tsite)
        else:
            t.set_trap(tsite, patch)
            t.poke([Write(tsite, originals[tsite][:1], b"\xcc")])
    t.keep()  # the daemon will not undo them: only the module's unload can
    assert t.read(jsite, 1) == b"\xe9" and t.read(tsite, 1) == b"\xcc"
    with pytest.raises((TargetDied, OSError)):
        t.exec("kill -KILL $PPID")  # the shell's parent is kerninstd
    t.close()
    # The guest's init unloads the module (rmmod) and starts it and kerninstd again.
    t = _connect(testbed)
    try:
        assert {a: t.read(a, 8) for a in originals} == originals
        log = t.exec("dmesg")
        assert "kerninst: unloaded" in log
        assert dmesg_problems(t) == []
    finally:
        t.close()
