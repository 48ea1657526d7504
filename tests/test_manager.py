"""The Manager on unicorn:toy: refusals change nothing, handles, re-planning, data memory."""

from __future__ import annotations

import pytest

from ksim.errors import (
    AlreadySpliced,
    KsimError,
    NoSafeTactic,
    NotOnBoundary,
    OutsideText,
    SnippetError,
    StaleText,
    UnknownHandle,
)
from ksim.images.toy import HARD_CASES
from ksim.snippets import ast

SEED, ITER = 3, 200


def text_of(m):
    return m.text_snapshot()


def state(m):
    """What a refused insert must leave untouched: text, routes, allocations."""
    t = m.target
    return (text_of(m), dict(t._traps), t._code.allocated(), t._data.allocated(), m.splices())


def counter_snippet(m):
    c = m.malloc(8)
    return c, c.atomic_assign(c + 1)


def test_refusals_are_specific_and_change_nothing(toy_manager):
    m = toy_manager
    fn = m.find_function("tcp_sync_mss")
    c, snip = counter_snippet(m)
    before = state(m)
    with pytest.raises(NotOnBoundary):
        m.point_at(fn.address + 1)
    with pytest.raises(OutsideText):
        m.point_at(m.target.image.address_of("ksim_heap"))
    with pytest.raises(SnippetError):
        m.insert_snippet(m.entry_point(fn), c.assign(ast.RetVal()))       # RetVal at an entry
    with pytest.raises(SnippetError):
        m.insert_snippet(m.entry_point(fn), c.assign(c / 0))              # division by zero
    short = m.find_function(HARD_CASES["short"][0])
    if m.can_insert(m.entry_point(short), "jmp") is not None:
        with pytest.raises(NoSafeTactic):
            m.insert_snippet(m.entry_point(short), snip, splice="jmp")
    assert state(m) == before
    m.free(c)


def test_stale_text_refuses_the_insert_and_frees_its_patch(toy_manager):
    m = toy_manager
    fn = m.find_function("submit_bio")
    point = m.entry_point(fn)
    c, snip = counter_snippet(m)
    original = m.copy_from_kernel(point.address, 1)
    m.target.machine.write(point.address, b"\xf4")       # someone else changed the text
    before = state(m)
    with pytest.raises(StaleText):
        m.insert_snippet(point, snip, splice="trap")
    assert state(m) == before
    m.target.machine.write(point.address, original)
    m.free(c)


def test_point_inside_another_splice_is_refused(toy_manager):
    m = toy_manager
    fn = m.find_function("tcp_sync_mss")
    c, snip = counter_snippet(m)
    h = m.insert_snippet(m.entry_point(fn), snip, splice="jmp")
    patch = m.patch_of(h)
    inside = [i.address for i in m.facts.analysis(fn).insns
              if patch.writes[-1].address < i.address < patch.writes[-1].end]
    try:
        for address in inside:
            before = state(m)
            with pytest.raises(AlreadySpliced):
                m.insert_snippet(m.point_at(address), snip)
            assert state(m) == before
        before = state(m)
        with pytest.raises(AlreadySpliced):     # the point is jmp-spliced; trap excluded
            m.insert_snippet(m.entry_point(fn), snip, splice="trap")
        assert state(m) == before
    finally:
        m.remove_snippet(h)
    with pytest.raises(UnknownHandle):
        m.remove_snippet(h)
    m.free(c)


def test_removing_one_of_two_snippets_keeps_the_other_counting(toy_manager):
    m = toy_manager
    fn = m.find_function("kmem_cache_alloc")
    point = m.entry_point(fn)
    original = text_of(m)
    a, sa = counter_snippet(m)
    b, sb = counter_snippet(m)
    ha = m.insert_snippet(point, sa)
    hb = m.insert_snippet(point, sb)
    with m.oracle(fn.address) as oracle:
        m.run(seed=SEED, iterations=ITER)
        first = oracle.count
    assert m.read(a) == m.read(b) == first > 0
    m.remove_snippet(ha)
    m.write(a, 0)
    m.write(b, 0)
    with m.oracle(fn.address) as oracle:
        m.run(seed=SEED, iterations=ITER)
        second = oracle.count
    assert (m.read(a), m.read(b)) == (0, second)
    m.remove_snippet(hb)
    assert text_of(m) == original
    m.free(a)
    m.free(b)


def test_data_memory_round_trip(toy_manager):
    m = toy_manager
    v = m.malloc(8)
    assert m.read(v) == 0
    m.write(v, 0x1122334455667788)
    assert m.copy_from_kernel(v.address, 8) == bytes.fromhex("8877665544332211")
    m.copy_to_kernel(v.address, b"\x01" * 8)
    assert m.read(v) == 0x0101010101010101
    m.free(v)


def test_an_array_of_variables_is_one_block_read_at_once(toy_manager):
    m = toy_manager
    a = m.malloc_array(5)
    assert [v.address for v in a] == [a[0].address + 8 * i for i in range(5)]
    assert m.read_array(a) == [0] * 5
    for i, v in enumerate(a):
        m.write(v, 1000 + i)
    assert m.read_array(a) == [m.read(v) for v in a] == [1000, 1001, 1002, 1003, 1004]
    with pytest.raises(KsimError, match="one malloc_array, in order"):
        m.read_array([a[1], a[0]])
    m.free(a[0])


def test_an_exception_in_a_hook_is_reraised_after_the_run(toy_manager):
    m = toy_manager
    fn = m.find_function("schedule")

    class Boom(Exception):
        pass

    def explode(*_):
        raise Boom("from a hook")

    remove = m.target.machine.hook_code(fn.address, explode)
    try:
        with pytest.raises(Boom):
            m.run(seed=SEED, iterations=ITER)
    finally:
        remove()


def test_check_insert_raises_the_verdict_can_insert_gives_as_text(toy_manager):
    m = toy_manager
    fn = m.find_function("tcp_sync_mss")
    before = state(m)
    assert m.check_insert(m.entry_point(fn)) is None and m.can_insert(m.entry_point(fn)) is None
    h = m.insert_snippet(m.entry_point(fn), ast.Seq(()), splice="jmp")
    covered = [w for w in m.patch_of(h).writes if w.end - w.address > 1]
    second = next(i.address for i in m.facts.function_code(fn).insns
                  if covered[0].address < i.address < covered[0].end)
    with pytest.raises(AlreadySpliced) as info:
        m.check_insert(m.point_at(second))
    assert m.can_insert(m.point_at(second)) == str(info.value)
    m.remove_snippet(h)
    assert state(m) == before


@pytest.mark.parametrize("image", ["toy", "toy-arm64"])
def test_a_detached_manager_keeps_nothing_alive(image):
    """What a Manager analysed (the image, its analyses and store, the site facts)
    goes with it: a process that attaches again and again does not grow."""
    import gc
    import weakref

    from conftest import needs_image

    from ksim.kapi import Manager

    needs_image(image)
    refs = []
    for _ in range(2):
        with Manager.attach(f"unicorn:{image}") as m:
            fn = m.find_function(m.target.image.functions[len(m.target.image.functions) // 2].name)
            c, snippet = counter_snippet(m)
            for name in ("kmalloc", fn.name):
                try:
                    h = m.insert_snippet(m.entry_point(name), snippet)
                except KsimError:
                    continue
                m.run(seed=SEED, iterations=20)
                m.remove_snippet(h)
            m.free(c)
            refs += [weakref.ref(m.target.image), weakref.ref(m.facts), weakref.ref(m.target)]
        del m, fn, c, snippet
    gc.collect()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
