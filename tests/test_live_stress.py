"""1,000 insert/remove cycles on a function two vCPUs hit continuously."""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import struct
import time

import pytest

from ksim.core import Write
from ksim.live.client import LiveTarget
from ksim.live.testing import (  # noqa: F401
    dmesg_problems,
    getppid_loop,
    plain_site,
    read_u64,
    target,
    testbed,
)
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

CYCLES = 1000


def test_thousand_splice_cycles_under_load(target: LiveTarget) -> None:
    site = plain_site(target, "__x64_sys_getppid")
    start_bytes = target.read(site, 16)
    original = start_bytes[:5]
    counter = target.alloc_data(8)
    patch = target.alloc_code(64, near=site)
    code = b"\xf0\x48\xff\x05" + struct.pack("<i", counter - (patch + 8)) + original
    code += b"\xe9" + struct.pack("<i", site + 5 - (patch + len(code) + 5))
    target.apply(Change(code=(Write(patch, target.read(patch, len(code)), code),)))
    jmp = b"\xe9" + struct.pack("<i", patch - (site + 5))
    loop = getppid_loop()
    # Two endless callers, one per vCPU, for the whole run.
    target.exec_checked(f"for i in 1 2; do {loop} -1 >/dev/null 2>&1 & echo $! >> /tmp/stress.pids; done")
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        for i in range(CYCLES):
            if i % 2:  # trap splice: route then int3 in one batch; int3 out then unroute in one
                target.apply(Change(routes=((site, patch),),
                                    text=(Write(site, original[:1], b"\xcc"),)))
                target.apply(Change(routes=((site, 0),),
                                    text=(Write(site, b"\xcc", original[:1]),)))
            else:      # jmp splice, through the int3 -> sync -> tail -> sync -> head protocol
                target.apply(Change(text=(Write(site, original, jmp),)))
                target.apply(Change(text=(Write(site, jmp, original),)))
        seconds = time.monotonic() - t0
    finally:
        target.exec("kill $(cat /tmp/stress.pids); rm -f /tmp/stress.pids")
    hits = read_u64(target, counter)
    print(f"{CYCLES} cycles in {seconds:.1f} s ({seconds / CYCLES * 1e3:.1f} ms per cycle), "
          f"{hits} hits counted while spliced")
    assert hits > 0
    assert target.read(site, 16) == start_bytes
    assert dmesg_problems(target) == []
