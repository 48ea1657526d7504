"""A locked-down kernel (issue "Hardening, round two"): the module changes nothing
there, as the kernel refuses its own debuggers' writes, and undo still works.

Lockdown is the kernel's own, set at run time (``echo integrity >
/sys/kernel/security/lockdown``), and it cannot be lifted until the next boot.  So
this test boots a testbed of its own (KSIM_TESTBED_DIR pointing at a private
cache that shares the kernel with the shared testbed's, kerninst.ko built afresh
from kmod/), locks it down, and stops it; the shared testbed is never locked.

Under integrity: an insert (jmp or trap), a raw text write, a route and a write of
patch code are LockedDown with nothing changed; reading, the heap and a splice made
before keep working, and that splice comes out byte for byte.  Under
confidentiality reads of kernel memory are LockedDown too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ksim.core import Write
from ksim.errors import LockedDown
from ksim.kapi import Manager
from ksim.live import testbed as tb
from ksim.live.client import _table
from ksim.live.testing import dmesg_problems, getppid_loop, plain_insn
from ksim.splice.patch import Change

pytestmark = [pytest.mark.live, pytest.mark.slow]

LOCKDOWN = "/sys/kernel/security/lockdown"
FUNC = "__x64_sys_getppid"
OTHER = "__x64_sys_getpid"
N = 2_000


@pytest.fixture(scope="module")
def locked_testbed() -> Iterator[dict[str, Any]]:
    shared = tb.cache_dir()
    abi = tb.recorded_abi()
    if abi is None:
        pytest.skip("the shared testbed's cache holds no kernel (ksim testbed prepare)")
    private = shared.parent / "testbed-lockdown"
    private.mkdir(exist_ok=True)
    for name in (f"linux-{abi}", f"vmlinux-{abi}", "kernel.json", "debs"):
        link = private / name
        if (shared / name).exists() and not link.exists():
            link.symlink_to(shared / name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KSIM_TESTBED_DIR", str(private))
        tb.down()  # a private testbed left by an interrupted run
        state = tb.up(offline=True, progress=lambda m: print(f"lockdown testbed: {m}", flush=True))
        assert state["token_file"].startswith(str(private))  # not the shared testbed
        try:
            yield state
        finally:
            tb.down()


def test_a_locked_down_kernel_is_changed_by_nobody(locked_testbed: dict[str, Any]) -> None:
    state = locked_testbed
    m = Manager.attach(state["address"], token_file=state["token_file"])
    t = m.target
    try:
        levels = t.exec(f"mountpoint -q /sys/kernel/security || mount -t securityfs securityfs "
                        f"/sys/kernel/security; cat {LOCKDOWN} 2>/dev/null || true").strip()
        if "integrity" not in levels:
            pytest.skip(f"the guest kernel has no lockdown LSM ({LOCKDOWN}: {levels!r})")
        assert levels.startswith("[none]"), levels
        fn, other = m.find_function(FUNC), m.find_function(OTHER)
        original = m.copy_from_kernel(fn.address, 16)
        counter = m.malloc(8)
        h = m.insert_snippet(m.entry_point(fn), counter.atomic_assign(counter + 1), splice="jmp")
        spliced = m.copy_from_kernel(fn.address, 16)
        site, insn = plain_insn(t, OTHER)
        patch = t.alloc_code(64, near=site)

        t.exec_checked(f"echo integrity > {LOCKDOWN}")
        assert "[integrity]" in t.exec(f"cat {LOCKDOWN}")
        before = (m.copy_from_kernel(other.address, 32), m.splices())
        for policy in ("jmp", "trap"):
            with pytest.raises(LockedDown, match="locked down"):
                m.insert_snippet(m.entry_point(other), counter.atomic_assign(counter + 1),
                                 splice=policy)
            assert (m.copy_from_kernel(other.address, 32), m.splices()) == before
        orig, code = t.read(site, 5), t.read(patch, 4)
        for change in (Change(text=(Write(site, orig[:1], b"\xcc"),), routes=((site, patch),)),
                       Change(routes=((site, patch),)),
                       Change(code=(Write(patch, code, b"\x90\x90\x90\xc3"),))):
            with pytest.raises(LockedDown):
                t.apply(change)
        assert t.read(site, 5) == orig and t.read(patch, 4) == code
        # what is in place keeps working, reads and the heap too
        m.write(counter, 0)
        m.run(while_cmd=f"{getppid_loop()} {N}")
        assert N <= m.read(counter) <= N + 2
        # and undo always works
        m.remove_snippet(h)
        assert m.copy_from_kernel(fn.address, 16) == original != spliced
        t.free_code(patch)
        m.free(counter)
        assert any("Lockdown:" in line and "kgdb/kdb to write kernel RAM" in line
                   for line in t.exec("dmesg").splitlines())
        assert dmesg_problems(t) == []

        t.exec_checked(f"echo confidentiality > {LOCKDOWN}")
        with pytest.raises(LockedDown):
            m.copy_from_kernel(fn.address, 16)
        for op in ("read_ranges", "digests"):     # the module's many-row reads too
            with pytest.raises(LockedDown):
                t.conn.request(op, ranges=_table([(fn.address, 16)]), kernel=False)
    finally:
        m.detach()

