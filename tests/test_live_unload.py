"""Unloading the module restores every splice it made, even splices a client kept.
(tests/test_live_arbiter.py unloads with many owners and routes.)"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import struct

import pytest

from ksim.core import Write
from ksim.live.testing import connect, dmesg_problems, plain_site, restart_kerninstd, testbed  # noqa: F401
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_unload_restores_kept_splices(testbed: dict) -> None:
    t = connect(testbed)
    jsite, tsite = plain_site(t, "__x64_sys_getppid"), plain_site(t, "__x64_sys_getpid")
    originals = {jsite: t.read(jsite, 8), tsite: t.read(tsite, 8)}
    patch = t.alloc_code(16, near=jsite)
    # A patch that only runs the displaced (position-independent) instruction and jumps back.
    for site in (jsite, tsite):
        code = originals[site][:5] + b"\xe9" + struct.pack("<i", site + 5 - (patch + 10))
        t.apply(Change(code=(Write(patch, t.read(patch, 10), code),)))
        if site == jsite:
            t.apply(Change(text=(Write(jsite, originals[jsite][:5],
                                       b"\xe9" + struct.pack("<i", patch - (jsite + 5))),)))
            patch = t.alloc_code(16, near=tsite)
        else:
            t.apply(Change(routes=((tsite, patch),),
                           text=(Write(tsite, originals[tsite][:1], b"\xcc"),)))
    t.keep()  # neither kerninstd nor the device's close will undo them: only the unload
    assert t.read(jsite, 1) == b"\xe9" and t.read(tsite, 1) == b"\xcc"
    # kerninstd killed; the guest's init unloads the module (rmmod), loads it and
    # starts kerninstd again.
    t = restart_kerninstd(t, testbed, unload=True)
    try:
        assert {a: t.read(a, 8) for a in originals} == originals
        log = t.exec("dmesg")
        assert "kerninst: unloaded" in log
        assert dmesg_problems(t) == []
    finally:
        t.close()
