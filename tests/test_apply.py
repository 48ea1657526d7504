"""Target.apply: one change, all or nothing, on the emulated targets; capabilities
declared, never probed.  (The live kernel's half is tests/test_live_apply.py.)"""

from __future__ import annotations

import ast as pyast
import shutil
from pathlib import Path

import pytest

from ksim.core import Write
from ksim.errors import OverlappingWrites, StaleText, TrapTableFull
from ksim.splice.patch import Change
from ksim.targets import open_target
from ksim.targets.base import Capabilities

KSIM = Path(__file__).resolve().parent.parent / "ksim"

TARGETS = [
    pytest.param("unicorn:toy", id="unicorn"),
    pytest.param("qemu:toy", id="qemu", marks=[pytest.mark.slow, pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")]),
]


@pytest.fixture(scope="module", params=TARGETS)
def target(request):
    t = open_target(request.param)
    yield t
    t.close()


def routes_of(t) -> dict[int, int]:
    """The target's trap routes, as its trap path sees them."""
    if t.name.startswith("qemu:"):
        return dict(t.traps_in_guest())
    return dict(t._traps)


def snapshot(t, code: int, text: int) -> tuple[bytes, bytes, dict[int, int]]:
    return t.read(code, 64), t.read(text, 16), routes_of(t)


def a_change(t, code: int, text: int) -> Change:
    """Patch code, a route and a trap at ``text`` to it: what a trap splice makes."""
    trap = t.arch.trap
    return Change(code=(Write(code, t.read(code, 4), b"\x90\x90\x90\xc3"),),
                  routes=((text, code),),
                  text=(Write(text, t.read(text, len(trap)), trap),))


def test_capabilities_are_declared(target) -> None:
    caps = target.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.traps and not caps.keep and not caps.exec and not caps.hazards
    assert caps.python_hooks == target.name.startswith("unicorn:")
    assert caps.oracles and caps.code_chunk > 0 and caps.data_chunk > 0


def test_a_change_goes_in_whole_and_its_inverse_restores_everything(target) -> None:
    code = target.alloc_code(64, near=0)
    text = target.image.function("start_kernel").address
    before = snapshot(target, code, text)
    change = a_change(target, code, text)
    target.apply(change)
    try:
        assert target.read(code, 4) == change.code[0].new
        assert routes_of(target)[text] == code
        assert target.read(text, len(target.arch.trap)) == target.arch.trap
        # a new patch for the same trap: the route is re-pointed in the same change
        again = Change(code=(Write(code + 16, target.read(code + 16, 1), b"\xc3"),),
                       routes=((text, code + 16),))
        target.apply(again)
        assert routes_of(target)[text] == code + 16
    finally:
        # the trap leaves text, then its route goes: one change
        target.apply(Change(code=tuple(w.inverse() for w in (*change.code, *again.code)),
                            routes=((text, 0),), text=tuple(w.inverse() for w in change.text)))
        target.free_code(code)
    assert snapshot(target, code, text) == before


@pytest.mark.parametrize("bad", ["stale text", "stale code", "overlap"])
def test_a_refused_part_changes_no_byte_and_no_route(target, bad: str) -> None:
    code = target.alloc_code(64, near=0)
    text = target.image.function("start_kernel").address
    try:
        before = snapshot(target, code, text)
        good = a_change(target, code, text)
        other = text + 16
        now = target.read(other, 1)
        if bad == "stale text":
            change = Change(good.code, good.routes,
                            good.text + (Write(other, bytes([now[0] ^ 0xFF]), b"\x90"),))
            error: type[Exception] = StaleText
        elif bad == "stale code":
            change = Change(good.code + (Write(code + 32, b"\x01", b"\x02"),), good.routes,
                            good.text)
            error = StaleText
        else:
            change = Change(good.code, good.routes, good.text + good.text)
            error = OverlappingWrites
        with pytest.raises(error):
            target.apply(change)
        assert snapshot(target, code, text) == before
    finally:
        target.free_code(code)


def test_a_full_trap_table_refuses_the_whole_change(target) -> None:
    if not target.name.startswith("qemu:"):
        pytest.skip("unicorn's trap hook has no table to fill")
    slots = target._slots()
    code = target.alloc_code(64, near=0)
    text = target.image.function("start_kernel").address
    try:
        before = snapshot(target, code, text)
        change = a_change(target, code, text)
        many = Change(change.code, change.routes + tuple((text + 1 + i, code)
                                                         for i in range(slots)), change.text)
        with pytest.raises(TrapTableFull):
            target.apply(many)
        assert snapshot(target, code, text) == before
    finally:
        target.free_code(code)


def test_no_capability_is_found_by_trying() -> None:
    """What a target can do is read from Target.capabilities: generic code never asks a
    target whether it has an attribute (getattr with a default, hasattr)."""
    found = []
    for path in sorted(KSIM.rglob("*.py")):
        tree = pyast.parse(path.read_text(), str(path))
        for node in pyast.walk(tree):
            if isinstance(node, pyast.Call) and isinstance(node.func, pyast.Name) and (
                    node.func.id == "hasattr" or node.func.id == "getattr" and len(node.args) == 3):
                subject = pyast.unparse(node.args[0])
                if "target" in subject or subject in ("t", "self.t"):
                    found.append(f"{path.relative_to(KSIM.parent)}:{node.lineno}: "
                                 f"{pyast.unparse(node)}")
    assert found == []
