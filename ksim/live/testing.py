"""pytest fixtures and helpers for tests against the live testbed.

Test modules import the fixtures they use (``from ksim.live.testing import testbed,
target``).  ``testbed`` is session-scoped: the first test boots the testbed (or
finds it already up), and the session ends by stopping it only if it started it.
``testbed_arm64`` and ``target_arm64`` do the same for the arm64 testbed, and
``instance_testbed(NAME)`` boots a further guest of its own (a second x86-64 one
for a fleet, say) for as long as its ``with`` block lasts.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ksim.core import Write
from ksim.errors import KsimError, TargetDied, TargetError
from ksim.live import testbed as tb
from ksim.live.client import LiveTarget
from ksim.splice.patch import Change

GETPPID_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
/* Calls getppid() exactly N times (glibc's getppid is a plain syscall, never cached). */
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, i, s = 0;
    for (i = 0; i < n || n < 0; i++)
        s += getppid();
    printf("%ld\n", i);
    return s == 0;
}
"""

# Lines of dmesg that mean the kernel was hurt.
BAD_DMESG = re.compile(r"Oops|BUG:|WARNING:|general protection|Kernel panic|ftrace bug|"
                       r"kerninst: .*(cannot|changed)")


def program(name: str, source: str, arch: str = "x86_64") -> Path:
    """Compile a static C program on the host, into the cache the guest sees through 9p
    (at the same path in the x86-64 and the arm64 guest); for ``arch`` "arm64" with
    aarch64-linux-gnu-gcc, installing libc6-dev-arm64-cross (its static C library)
    when it is missing."""
    if arch == "arm64":
        from ksim.live import arm64bed

        out = arm64bed.arm64_dir() / "bin" / name
        cc = arm64bed.cross_cc()
    else:
        out, cc = tb.cache_dir() / "bin" / name, "gcc"
    src = out.with_suffix(".c")
    out.parent.mkdir(exist_ok=True)
    if not out.exists() or not src.exists() or src.read_text() != source:
        src.write_text(source)
        subprocess.run([cc, "-O2", "-static", "-o", str(out), str(src)], check=True)
    return out


def getppid_loop(arch: str = "x86_64") -> Path:
    return program("getppid_loop", GETPPID_LOOP, arch)


def rel32(frm: int, to: int) -> bytes:
    """The rel32 field of an x86-64 branch ending at ``frm`` that leads to ``to``."""
    return struct.pack("<i", to - frm)


def jmp(site: int, dest: int) -> bytes:
    """A 5-byte x86-64 ``jmp dest`` placed at ``site``."""
    return b"\xe9" + rel32(site + 5, dest)


def install_patch(t: LiveTarget, counter: int, site: int, insn: bytes) -> int:
    """lock incq [rip+counter]; <insn, as is>; jmp site+len(insn) -- in a new block of t's."""
    patch = t.alloc_code(64, near=site)
    code = b"\xf0\x48\xff\x05" + rel32(patch + 8, counter) + insn
    code += b"\xe9" + rel32(patch + len(code) + 5, site + len(insn))
    t.apply(Change(code=(Write(patch, t.read(patch, len(code)), code),)))
    return patch


def plain_site(target: LiveTarget, name: str) -> int:
    """The first instruction of ``name`` that a raw 5-byte splice may cover and copy
    as it is: at least 5 bytes, straight-line, not PC-relative, and no hazard the
    kernel reports (its first bytes are the ftrace location, which the kernel owns)."""
    return plain_insn(target, name)[0]


def plain_insn(target: LiveTarget, name: str) -> tuple[int, bytes]:
    """plain_site's instruction: its address and all its bytes (a patch that
    displaces it copies them all and jumps back past them)."""
    from ksim.arch.base import Flow

    start = target.lookup(name)
    code = target.read(start, 64)
    insns = list(target.arch.decode(code, start))
    hazards = target.text_hazards([(i.address, i.size) for i in insns])
    for insn, found in zip(insns, hazards, strict=True):
        if (insn.address > start and insn.size >= 5 and insn.flow is Flow.SEQ
                and insn.pc_ref is None and not found):
            return insn.address, code[insn.address - start:insn.address - start + insn.size]
    raise AssertionError(f"{name} has no plain 5-byte instruction in its first 64 bytes")


def dmesg_problems(target: LiveTarget) -> list[str]:
    return [line for line in target.exec("dmesg").splitlines() if BAD_DMESG.search(line)]


def read_u64(target: LiveTarget, address: int) -> int:
    return int(struct.unpack("<Q", target.read(address, 8))[0])


def own_log(target: LiveTarget) -> dict[str, Any]:
    """What the module's own log holds for ``target``'s session (its text writes,
    routes and blocks): the session is listed as kept, under a name of its own, for the
    moment of the look (so ``target`` must not be kept already)."""
    name = f"log-of-{os.getpid()}-{id(target):x}"
    target.keep(name=name)
    try:
        (mine,) = [k for k in target.kept() if k["name"] == name]
    finally:
        target.keep(False)
    return mine


def routes_of(target: LiveTarget) -> dict[int, int]:
    """The trap routes the module holds for ``target``'s session (site -> patch)."""
    return {int(r["site"]): int(r["patch"]) for r in own_log(target)["routes"]}


def connect(testbed: dict[str, Any], timeout: float = 90.0) -> LiveTarget:
    """A new client, waiting (up to ``timeout``) for kerninstd to answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
        except (KsimError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def restart_kerninstd(t: LiveTarget, testbed: dict[str, Any], *, unload: bool = False) -> LiveTarget:
    """Kill kerninstd (the parent of the shell its exec op runs) and return a client
    of the next one, which the guest's /init starts; with ``unload``, /init unloads
    the module (undoing every splice) and loads it again in between.  ``t`` ends."""
    flag = f"touch {tb.RELOAD_FLAG} && " if unload else ""
    try:
        t.exec(f"{flag}kill -KILL $PPID")
    except (TargetDied, OSError):
        pass
    else:
        raise AssertionError("kerninstd survived kill -KILL")
    t.close()
    return connect(testbed)


def which_testbed() -> tb.Instance:
    """The x86-64 testbed the tests use: the default one, or KSIM_TESTBED_INSTANCE's."""
    return tb.resolve_instance(os.environ.get("KSIM_TESTBED_INSTANCE") or None)


@pytest.fixture(scope="session")
def testbed() -> Iterator[dict[str, Any]]:
    """The x86-64 testbed, booted once per session (stopped at the end if this booted
    it); KSIM_TESTBED_INSTANCE=NAME: the named instance (``ksim testbed up --name
    NAME``) instead, so that two test runs need not share one kernel."""
    inst = which_testbed()
    already = tb.status(inst)["up"]
    state = tb.up(instance=inst, progress=lambda m: print(f"testbed: {m}", flush=True))
    yield state
    if not already:
        tb.down(instance=inst)


@pytest.fixture
def target(testbed: dict[str, Any]) -> Iterator[LiveTarget]:
    t = LiveTarget("127.0.0.1", int(testbed["port"]), token_file=testbed["token_file"])
    yield t
    t.close()


def _say(name: str) -> tb.Progress:
    return lambda m: print(f"testbed {name}: {m}", flush=True)


@contextmanager
def instance_testbed(name: str, *, arch: str | None = None, port: int | None = None,
                     timeout: float = tb.BOOT_TIMEOUT,
                     module_sources: list[Path] | None = None,
                     tools: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """The testbed instance ``name`` (``arch`` x86_64 unless it is "arm64"), booted on
    ``port`` (default: its own, else a free one) or found running; stopped at the end
    only if this booted it.  ``with instance_testbed("b", port=7072) as b:`` gives a
    second x86-64 guest beside the default testbed."""
    inst = tb.resolve_instance(name, arch)
    already = tb.status(inst)["up"]
    state = tb.up(instance=inst, port=port, timeout=timeout, progress=_say(inst.label),
                  module_sources=module_sources, tools=tools)
    try:
        yield state
    finally:
        if not already:
            tb.down(instance=inst)


@pytest.fixture(scope="session")
def testbed_arm64() -> Iterator[dict[str, Any]]:
    """The arm64 testbed (instance "arm64", port 7071), booted once per session with
    kmod/'s kerninst.ko and Debian's arm64 bpftrace in its userland (the benchmarks'
    rows run beside it).  While kmod/ does not build for arm64 it boots with the
    stand-in (tests/kmod_arm64_standin), and the state says so: ``standin`` holds the
    build's error; tests that need the real module take ``kerninst_arm64``, which
    skips them then.  A running arm64 testbed is used as it is."""
    from ksim.live import arm64bed

    inst = tb.resolve_instance("arm64")
    already = tb.status(inst)["up"]
    standin: str | None = None
    try:
        state = tb.up(instance=inst, progress=_say("arm64"), tools=("bpftrace",))
    except TargetError as exc:
        if "does not build" not in str(exc) and "kerninst.ko did not load" not in str(exc):
            raise
        standin = str(exc).split("\nguest console")[0]
        _say("arm64")(f"booting with the stand-in module: {standin}")
        state = tb.up(instance=inst, progress=_say("arm64"),
                      module_sources=arm64bed.module_dir_sources(arm64bed.STANDIN))
    if standin is None and state.get("module_source") != str(tb.REPO / "kmod"):
        standin = f"the running arm64 testbed's module is built from {state.get('module_source')}"
    try:
        yield {**state, "standin": standin}
    finally:
        if not already:
            tb.down(instance=inst)


@pytest.fixture
def kerninst_arm64(testbed_arm64: dict[str, Any]) -> dict[str, Any]:
    """The arm64 testbed, running kmod/'s kerninst.ko (the test is skipped if it runs the
    stand-in)."""
    if testbed_arm64["standin"]:
        pytest.skip("the arm64 testbed runs the stand-in module: kmod/ does not build for "
                    f"arm64: {testbed_arm64['standin']}")
    return testbed_arm64


@pytest.fixture
def target_arm64(testbed_arm64: dict[str, Any]) -> Iterator[LiveTarget]:
    t = connect(testbed_arm64)
    yield t
    t.close()
