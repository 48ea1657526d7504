"""One owner for every byte of text: features composed at one point on unicorn:toy.

Each test is a way composed features used to corrupt a kernel (a probe's post
handler lost when a snippet joined its point, a replaced entry the Manager did
not know about, a refused request that cleared a trap route, a replacement
that was no function).  Every count is checked against the address-hook
oracle, and a refused request is checked to change nothing: text, trap
routes, trap hooks, patch-area and heap allocations.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksim import components
from ksim.errors import AlreadySpliced, KsimError, ReplacementError
from ksim.kapi import Manager
from ksim.probes import KProbe, Probes
from ksim.replace import Replacements

ITER = 150


@pytest.fixture
def m(toy_path):
    with Manager.attach("unicorn:toy") as mgr:
        yield mgr


def state(m: Manager) -> dict[str, Any]:
    """Everything a refused request must leave as it was."""
    t = m.target
    return {
        "text": m.text_snapshot(),
        "routes": dict(t._traps),
        "hooks": {site: list(fns) for site, fns in t._trap_hooks.items()},
        "code": t._code.allocated(),
        "data": t._data.allocated(),
        "patch area": t.read(t._code.start, t._code.end - t._code.start),
        "splices": m.splices(),
    }


def entry(m: Manager, name: str) -> int:
    return m.entry_point(name).address


def test_a_snippet_joining_a_probe_with_a_post_handler_keeps_the_probe_whole(m):
    before = m.text_snapshot()
    probes = Probes(m)
    posts = m.malloc()
    kp = KProbe("tcp_sync_mss", post_handler=posts.atomic_assign(posts + 1))
    probes.register_kprobe(kp)
    hits = m.malloc()
    h = m.insert_snippet(m.point_at(kp.address), hits.atomic_assign(hits + 1))
    with m.oracle(kp.address) as o:
        m.run(iterations=ITER)
    assert o.count > 0
    assert kp.nhit == m.read(posts) == m.read(hits) == o.count
    assert kp.nmissed == 0
    probes.unregister_kprobe(kp)  # the snippet stays, alone at the point
    with m.oracle(kp.address) as o:
        m.run(iterations=ITER)
    assert m.read(hits) == 2 * o.count and m.read(posts) == o.count
    m.remove_snippet(h)
    assert m.text_snapshot() == before


def test_a_python_post_handler_survives_a_replan_of_its_point(m):
    probes = Probes(m)
    seen: list[int] = []
    kp = KProbe("tcp_sync_mss", post_handler=lambda _kp, regs: seen.append(regs.rip))
    probes.register_kprobe(kp)
    hits = m.malloc()
    h = m.insert_snippet(m.point_at(kp.address), hits.atomic_assign(hits + 1), splice="trap")
    m.remove_snippet(h)  # two re-plans: the post trap moved twice
    h = m.insert_snippet(m.point_at(kp.address), hits.atomic_assign(hits + 1), splice="auto")
    with m.oracle(kp.address) as o:
        m.run(iterations=ITER)
    assert len(seen) == kp.nhit == m.read(hits) == o.count > 0
    m.remove_snippet(h)
    probes.unregister_kprobe(kp)
    assert m.target._traps == {} and m.target._trap_hooks == {}


def test_a_replaced_entry_takes_snippets_and_can_insert_agrees(m):
    before = m.text_snapshot()
    r = Replacements(m)
    rep = r.replace_function("tcp_sync_mss", "tcp_current_mss")
    point = m.entry_point("tcp_sync_mss")
    assert m.can_insert(point) is None
    hits = m.malloc()
    h = m.insert_snippet(point, hits.atomic_assign(hits + 1))
    with m.oracle(point.address) as o, m.oracle(entry(m, "tcp_current_mss")) as replacement:
        m.run(iterations=ITER)
    # every call of the original entered the replacement after the snippet ran
    assert m.read(hits) == o.count > 0
    assert replacement.count >= o.count
    r.undo(rep)  # the snippet stays; the original runs again
    with m.oracle(point.address) as o, m.oracle(entry(m, "tcp_current_mss")) as replacement:
        m.run(iterations=ITER)
    assert m.read(hits) == 2 * o.count
    m.remove_snippet(h)
    assert m.text_snapshot() == before


def test_a_refused_request_at_a_trap_replacement_changes_nothing(m):
    baseline = m.run(iterations=ITER).checksum
    r = Replacements(m)
    rep = r.replace_function("tcp_sync_mss", "tcp_current_mss", splice="trap")
    point = m.entry_point("tcp_sync_mss")
    var = m.malloc()
    snap = state(m)
    verdict = m.can_insert(point, "jmp")
    with pytest.raises(AlreadySpliced) as exc:
        m.insert_snippet(point, var.assign(1), splice="jmp")
    assert verdict == str(exc.value)
    assert state(m) == snap
    # the trap route still sends the hit to the replacement
    with m.oracle(entry(m, "tcp_current_mss")) as replacement, m.oracle(point.address) as o:
        m.run(iterations=ITER)
    assert replacement.count >= o.count > 0
    r.undo(rep)
    assert m.run(iterations=ITER).checksum == baseline


@pytest.mark.parametrize("what", ["zero", "data", "mid-instruction", "free patch area", "itself"])
def test_a_replacement_must_be_a_function_entry(m, what):
    image = m.target.image
    fib = image.function("fib")
    to = {
        "zero": 0,
        "data": image.address_of("jiffies"),
        "mid-instruction": fib.address + 1,
        "free patch area": m.target._code.start + 0x800,
        "itself": m.find_function("tcp_sync_mss").address,
    }[what]
    snap = state(m)
    with pytest.raises(ReplacementError):
        Replacements(m).replace_function("tcp_sync_mss", to)
    assert state(m) == snap


def test_a_component_in_use_is_not_unloaded(m):
    src = "int fib_v2(int n) { return n; }"
    comp = components.load(m, components.build_c(src, name="fibv2"))
    r = Replacements(m)
    rep = r.replace_function("fib", comp.symbol("fib_v2"))
    with pytest.raises(AlreadySpliced):
        comp.unload()
    assert comp.loaded
    r.undo(rep)
    comp.unload()
    assert not comp.loaded


def test_can_insert_and_insert_snippet_agree_everywhere_in_a_function(m):
    """Over every instruction of a function with splices around it: the verdict of
    can_insert is the outcome of insert_snippet, and a refusal changes nothing."""
    func = m.find_function("tcp_sync_mss")
    spliced = [m.insert_snippet(p, m.malloc().assign(1)) for p in m.block_points(func)[:2]]
    code = m.facts.function_code(m.entry_point(func))
    var = m.malloc()
    for insn in code.insns:
        point = m.point_at(insn.address)
        for policy in ("jmp", "trap"):
            verdict = m.can_insert(point, policy)
            snap = state(m)
            try:
                h = m.insert_snippet(point, var.assign(2), splice=policy)
            except KsimError as exc:
                assert verdict == str(exc), (hex(insn.address), policy)
                assert state(m) == snap
            else:
                assert verdict is None, (hex(insn.address), policy, verdict)
                m.remove_snippet(h)
    for h in spliced:
        m.remove_snippet(h)
