"""Batch insert and remove on unicorn:toy: every spliceable function entry at once,
each count against the address-hook oracle; a batch that cannot be applied
whole changes nothing; removal restores the text byte for byte."""

from __future__ import annotations

from typing import Any

import pytest

from ksim.errors import AlreadySpliced, KsimError
from ksim.kapi import Manager

ITER = 100


@pytest.fixture
def m(toy_path):
    with Manager.attach("unicorn:toy") as mgr:
        yield mgr


def state(m: Manager) -> dict[str, Any]:
    t = m.target
    return {"text": m.text_snapshot(), "routes": dict(t._traps), "code": t._code.allocated(),
            "data": t._data.allocated(), "splices": m.splices(),
            "patch area": t.read(t._code.start, t._code.end - t._code.start)}


def spliceable_entries(m: Manager, policy: str) -> list:
    return [p for _, p in m.spliceable_entries(m.target.image.functions, policy)[0]]


@pytest.mark.parametrize("policy", ["auto", "trap"])
def test_every_spliceable_entry_counts_exactly_and_detaches_byte_for_byte(m, policy):
    before = state(m)
    points = spliceable_entries(m, policy)
    assert len(points) > 50
    counters = {p.address: m.malloc() for p in points}
    handles = m.insert_many(points, lambda p: counters[p.address].atomic_assign(
        counters[p.address] + 1), splice=policy)
    assert len(m.splices()) == len(points)
    # one allocation holds every patch
    assert len(m.target._code.allocated()) == 1
    oracles = {a: m.target.oracle_counter(a) for a in counters}
    try:
        m.run(iterations=ITER)
    finally:
        for o in oracles.values():
            o.close()
    reached = [a for a in counters if oracles[a].count]
    assert len(reached) > 20
    for a, var in counters.items():
        assert m.read(var) == oracles[a].count, hex(a)
    m.remove_many(handles)
    for var in counters.values():
        m.free(var)
    assert state(m) == before


def test_a_batch_with_one_refused_point_changes_nothing(m):
    points = spliceable_entries(m, "auto")[:40]
    bad = m.point_at(m.find_function("ksim_unknown_trap").address)  # the trap path: blacklisted
    var = m.malloc()
    before = state(m)
    with pytest.raises(KsimError):
        m.insert_many(points[:20] + [bad] + points[20:], var.atomic_assign(var + 1))
    assert state(m) == before
    short = [p for p in points if m.can_insert(p, "jmp") is not None]
    if short:  # a point no jmp tactic fits, in a jmp-only batch: refused as a whole
        with pytest.raises(KsimError):
            m.insert_many(points, var.atomic_assign(var + 1), splice="jmp")
        assert state(m) == before

def test_a_batch_that_takes_refusals_inserts_the_rest_and_says_why(m):
    """insert_many(..., refused=...): the refused point is left out with can_insert's
    own verdict, the others go in as one step and count exactly; removing them
    restores everything, byte for byte."""
    points = spliceable_entries(m, "auto")[:40]
    bad = m.point_at(m.find_function("ksim_unknown_trap").address)
    why = m.can_insert(bad)
    assert why is not None
    var = m.malloc()
    before = state(m)
    refused: dict[int, str] = {}
    handles = m.insert_many(points[:20] + [bad] + points[20:], var.atomic_assign(var + 1),
                            refused=refused)
    assert refused == {bad.address: why}
    assert sorted(h.point.address for h in handles) == sorted(p.address for p in points)
    assert set(m.splices()) == {p.address for p in points}
    assert len(m.target._code.allocated()) == len(before["code"]) + 1
    oracles = [m.target.oracle_counter(p.address) for p in points]
    try:
        m.run(iterations=ITER)
    finally:
        for o in oracles:
            o.close()
    assert m.read(var) == sum(o.count for o in oracles) > 0
    m.remove_many(handles)
    assert state(m) == before
    # all refused: nothing inserted, nothing allocated
    assert m.insert_many([bad], var.atomic_assign(var + 1), refused=refused) == []
    assert state(m) == before



def test_a_batch_refuses_spliced_and_repeated_points(m):
    points = spliceable_entries(m, "auto")[:5]
    var = m.malloc()
    h = m.insert_snippet(points[0], var.assign(1))
    before = state(m)
    with pytest.raises(AlreadySpliced):
        m.insert_many(points, var.assign(2))
    with pytest.raises(AlreadySpliced):
        m.insert_many(points[1:] + points[1:2], var.assign(2))
    assert state(m) == before
    m.remove_snippet(h)


def test_removing_part_of_a_batch_keeps_the_rest_and_the_shared_block(m):
    points = spliceable_entries(m, "auto")[:30]
    counters = {p.address: m.malloc() for p in points}
    handles = m.insert_many(points, lambda p: counters[p.address].atomic_assign(
        counters[p.address] + 1))
    extra = m.insert_snippet(points[3], counters[points[3].address].atomic_assign(
        counters[points[3].address] + 1))  # re-plans one point out of the shared block
    m.remove_many(handles[:10])
    assert len(m.splices()) == 20 + 1
    m.remove_snippet(extra)
    oracles = {p.address: m.target.oracle_counter(p.address) for p in points[10:]}
    try:
        m.run(iterations=ITER)
    finally:
        for o in oracles.values():
            o.close()
    for p in points[10:]:
        assert m.read(counters[p.address]) == oracles[p.address].count
    m.remove_many(handles[10:])
    assert m.target._code.allocated() == {}


def test_a_patch_areas_bytes_are_read_as_far_as_its_patches_reach(m):
    """The Manager keeps a patch area's bytes as it last wrote them, so that a patch's
    write carries its old bytes: read from the target the first time, only as far as
    what is placed reaches, then further for the next batch; always the target's."""
    from ksim.splice.areas import SHADOW_READ

    points = spliceable_entries(m, "jmp")
    counter = m.malloc()
    reads: list[tuple[int, int]] = []
    real = m.target.read
    m._code._read = lambda a, n: (reads.append((a, n)), real(a, n))[1]
    bump = counter.atomic_assign(counter + 1)
    first = m.insert_many(points[:4], lambda p: bump, splice="jmp")
    (area,) = m._code._areas.values()
    covered = len(area.shadow)
    assert area.cursor - area.start <= covered == SHADOW_READ < area.size
    assert bytes(area.shadow) == real(area.start, covered)
    # one by one: no read while the patches stay inside what was read
    handles = list(first)
    while True:
        handles.append(m.insert_snippet(points[len(handles)], bump, splice="jmp"))
        if area.cursor - area.start > covered:
            break
        assert len(reads) == 1
    # past it: one more read, of SHADOW_READ bytes or more from where the first ended
    handles += m.insert_many(points[len(handles):len(handles) + 4], lambda p: bump, splice="jmp")
    assert len(area.shadow) >= area.cursor - area.start > covered and len(reads) == 2
    assert bytes(area.shadow) == real(area.start, len(area.shadow))
    assert reads[1][0] == area.start + covered
    m.remove_many(handles)
    m.run(iterations=10)
    assert m.read(counter) == 0
