"""The module's batched text poke writes several sites of one page with one text_poke
per step (kmod/kerninst.c, ki_poke_phase): the span's current bytes with the step's
bytes laid over them.  Against a live kernel, a dense batch (every spliceable entry of a
few pages of text, with the springboards of the jmp policy and the routes of the trap
policy) must change no byte between its sites, and put every page back byte for byte.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.kapi import Manager
from ksim.live.client import LiveTarget
from ksim.live.testing import dmesg_problems, testbed  # noqa: F401
from ksim.snippets import ast

pytestmark = [pytest.mark.live, pytest.mark.slow]

PAGE = 4096
PAGES = 4           # of text around __x64_sys_getppid (kernel/sys.c)


@pytest.mark.parametrize("policy", ["jmp", "trap"])
def test_a_dense_batch_changes_only_its_own_bytes_and_comes_out_byte_for_byte(
        testbed, policy: str) -> None:
    m = Manager.attach(testbed["address"], token_file=testbed["token_file"])
    t: LiveTarget = m.target
    try:
        lo = (m.find_function("__x64_sys_getppid").address & ~(PAGE - 1)) - PAGE
        hi = lo + PAGES * PAGE
        funcs = [f for f in t.image.functions if lo <= f.address < hi - 64]
        points = [p for _, p in m.spliceable_entries(funcs, policy)[0]]
        assert len(points) >= 8 * PAGES, "too few spliceable entries for a dense batch"
        before = t.read(lo, hi - lo + PAGE)
        base = m.alloc_data(8 * len(points))
        var = {p.address: ast.Var(base + 8 * i, 8) for i, p in enumerate(points)}
        handles = m.insert_many(points, lambda p: var[p.address].atomic_assign(var[p.address] + 1),
                                splice=policy)
        try:
            during = t.read(lo, hi - lo + PAGE)
            written = bytearray(len(before))      # 1 where a write of the batch put its bytes
            per_page: dict[int, int] = {}
            for h in handles:
                patch = m.patch_of(h)
                for w in patch.writes + patch.extra:
                    if not lo <= w.address < hi + PAGE:
                        continue                  # patch code, not text
                    assert during[w.address - lo:w.address - lo + len(w.new)] == w.new
                    written[w.address - lo:w.address - lo + len(w.new)] = b"\x01" * len(w.new)
                    per_page[w.address // PAGE] = per_page.get(w.address // PAGE, 0) + 1
            assert max(per_page.values()) >= 4, "no page with several writes: no span was poked"
            changed = [lo + i for i in range(len(before)) if before[i] != during[i] and not written[i]]
            assert changed == [], f"bytes between the sites changed: {[hex(a) for a in changed[:8]]}"
            t.exec_checked("ls -R /proc/sys > /dev/null; cat /proc/meminfo > /dev/null")
        finally:
            m.remove_many(handles)
        assert t.read(lo, hi - lo + PAGE) == before
        m.free(base)
        assert dmesg_problems(t) == []
    finally:
        m.detach()
