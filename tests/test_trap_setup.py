"""Traps where a trap can be routed, and a full trap table named as such (issue
"Hardening, round two").

Under QEMU the toy kernel's own handler routes traps, and it exists only once
``trap_init`` has loaded the IDT (VBAR_EL1 on arm64); ksim's changes go in before
(at ``ksim_entry64``).  A trap in ``trap_init`` or a function it calls
(``set_intr_gate``, ``load_idt``) reached no handler: the toy died at boot and
``ksim count`` said "gdbstub ... Broken pipe".  The trap tactic is now refused
there (TrapUnavailable, saying why) before anything changes; a jump still splices
those points and counts them right.  Unicorn routes traps by a hook from the
first instruction, so there a trap at ``trap_init`` counts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from ksim.errors import NoSafeTactic, TrapTableFull, TrapUnavailable
from ksim.image.elf import load_image
from ksim.images import path as image_path
from ksim.images import toy
from ksim.kapi import Handle, Manager
from ksim.snippets import ast
from ksim.splice import planner
from ksim.splice.patch import Patch
from ksim.splice.sites import SiteFacts

needs_qemu = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="needs qemu-system-x86_64")
EARLY = ("trap_init", "set_intr_gate", "load_idt")


def test_the_code_before_the_trap_handler_is_trap_init_and_what_it_calls():
    image = load_image(image_path("toy"))
    facts = SiteFacts(image, None, trap_setup=toy.TRAP_SETUP)  # type: ignore[arg-type]
    unready = {image.function_at(lo).name: (lo, hi) for lo, hi, _ in facts.trap_unready}
    assert set(unready) == set(EARLY)
    for name, (lo, hi) in unready.items():
        f = image.function(name)
        assert (lo, hi) == (f.address, f.end)
    assert SiteFacts(image, None).trap_unready == ()  # type: ignore[arg-type]


def snapshot(m):
    t = m.target
    return (m.text_snapshot(), list(t._traps), t.traps_in_guest(), t._code.allocated(),
            t._data.allocated(), m.splices())


@pytest.fixture(scope="module")
def qemu():
    m = Manager.attach("qemu:toy")
    yield m
    m.detach()


@pytest.mark.slow
@needs_qemu
def test_qemu_refuses_a_trap_before_the_trap_handler_and_counts_a_jump_there(qemu):
    m = qemu
    counter = m.malloc(8)
    before = snapshot(m)
    for name in EARLY:
        point = m.entry_point(name)
        with pytest.raises(TrapUnavailable, match=rf"\({name}\+0x0\): {name} (installs|runs inside trap_init)"):
            m.insert_snippet(point, counter.atomic_assign(counter + 1), splice="trap")
        assert "cannot be routed" in m.can_insert(point, "trap")
        assert m.can_insert(point, "jmp") is None
        assert snapshot(m) == before
        with pytest.raises(TrapUnavailable):
            m.insert_many([point, m.entry_point("serial_init")], ast.Seq(()), splice="trap")
        assert snapshot(m) == before
    # a jump at each counts each call, as the oracle does; a trap just after trap_init works
    counters = {name: m.malloc(8) for name in (*EARLY, "serial_init")}
    hs = [m.insert_snippet(m.entry_point(name), v.atomic_assign(v + 1),
                           splice="trap" if name == "serial_init" else "jmp")
          for name, v in counters.items()]
    oracles = {name: m.target.oracle_counter(m.entry_point(name).address) for name in counters}
    try:
        m.run(seed=1, iterations=1)
        got = {name: m.read(v) for name, v in counters.items()}
        assert got == {name: o.count for name, o in oracles.items()}
        assert got["trap_init"] == got["load_idt"] == got["serial_init"] == 1
        assert got["set_intr_gate"] > 1
    finally:
        for o in oracles.values():
            o.close()
        m.remove_many(hs)
        for v in (*counters.values(), counter):
            m.free(v)


@pytest.mark.slow
@needs_qemu
def test_under_a_policy_with_jumps_the_trap_tactic_gives_its_reason(qemu):
    """Policy auto still splices these points by a jump; its trap tactic, asked
    alone, refuses with the reason (what NoSafeTactic lists when no jump fits)."""
    m = qemu
    point = m.entry_point("load_idt")
    req = m._request(point, [Handle(0, point, ast.Seq(()))], "auto", m._busy())
    req = replace(req, code_address=m._code.peek(64, point.address))
    assert planner.TACTICS["trap"](m.arch, req) == (
        "load_idt runs inside trap_init, before the kernel's trap handler is installed; "
        "a trap there cannot be routed")
    assert isinstance(planner.TACTICS["jmp+displace"](m.arch, req), Patch)
    # a springboard with no padding to land in: the trap was the last resort
    with pytest.raises(NoSafeTactic, match="trap: load_idt runs inside trap_init"):
        planner.plan_with(m.arch, replace(req, padding=()), ("springboard", "trap"))


def test_unicorn_routes_a_trap_at_trap_init(toy_manager):
    m = toy_manager
    assert m.target.capabilities.trap_setup is None
    v = m.malloc(8)
    h = m.insert_snippet(m.entry_point("trap_init"), v.atomic_assign(v + 1), splice="trap")
    try:
        m.run(seed=1, iterations=1)
        assert m.read(v) == 1
    finally:
        m.remove_snippet(h)
        m.free(v)


@pytest.mark.slow
@needs_qemu
def test_ksim_count_names_the_cause():
    run = subprocess.run([sys.executable, "-m", "ksim", "count", "trap_init", "--target", "qemu",
                          "--splice", "trap", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    record = json.loads(run.stdout)
    assert record["error"] == "trap-unavailable"
    assert "trap_init installs the kernel's trap handler" in record["message"]
    assert "Broken pipe" not in run.stdout + run.stderr


@pytest.mark.slow
@needs_qemu
def test_a_full_trap_table_is_trap_table_full_and_changes_nothing(qemu):
    m = qemu
    slots = m.target._slots()
    points = []
    for f in m.target.image.functions:
        if f.name in EARLY:
            continue
        try:
            points += [p for p in m.block_points(f) if m.can_insert(p, "trap") is None]
        except Exception:  # noqa: BLE001 - a function the analysis refuses gives no point
            continue
        if len(points) > slots:
            break
    assert len(points) > slots
    before = snapshot(m)
    with pytest.raises(TrapTableFull, match=f"full \\({slots} trap sites\\)"):
        m.insert_many(points[:slots + 1], ast.Seq(()), splice="trap")
    assert snapshot(m) == before
