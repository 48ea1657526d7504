"""What an analysis store keeps of each function beyond its record -- learnt by a
batch and saved for the next process -- is what analysing the function now gives:
the registers it or its callees may write, the registers live before its first
instructions and where its code ends.  Compared against the clobber analysis's own walk and the object path's
liveness, after a save and a load, on every function of the test kernels and every
10th of Debian's x86-64 vmlinux.  On an image read from a running kernel, what the
store keeps is used only while everything it depends on has the bytes it was made
from: a callee whose code changed turns it off, and the answer is the changed
code's."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
from analysis_kernel import kernels

from ksim.analysis import analyze, clobbers
from ksim.analysis import store as stores
from ksim.analysis.abi import support_for
from ksim.analysis.points import Point, PointKind
from ksim.analysis.store import HEAD_LIVE, Store, analyze_image, use
from ksim.arch import get_arch
from ksim.errors import KsimError
from ksim.image import Image, load_image
from ksim.image.model import Function
from ksim.splice.sites import SiteFacts


def _without_derived(image: Image, store: Store) -> Image:
    """A second image of the same bytes whose store has the same records and nothing
    derived or learnt: its answers are computed, not looked up."""
    twin = Image(image.path, image.arch, image.module, image.sections, image.symbols,
                 build_id=image.build_id)
    arrays = {name: array(stores._typecode(a), a) for name, a in store._arrays.items()}
    arrays["derived"] = array("B", bytes(len(image.functions)))    # nothing kept
    use(twin, Store(twin, store.key, arrays, store._meta))
    return twin


def _learnt(image: Image, store: Store, funcs, where: Path) -> Store:
    """``store`` after a batch over ``funcs`` (each entry's liveness and code end
    asked for), saved to ``where`` and loaded again for ``image``."""
    derived = store._arrays["derived"]
    for i in range(len(derived)):     # nothing learnt before (a store from disk may have)
        derived[i] = 0
    use(image, store)
    clobbers._CACHE.pop(image, None)
    support = support_for(image.arch)
    facts = SiteFacts(image, get_arch(image.arch))
    for func in funcs:
        clobbers.function_clobbers(image, support, func)
        try:
            facts.function_code(func)
            facts.live_at(Point(func.address, PointKind.ENTRY, func.name))
        except KsimError:
            continue
    assert store._learnt
    store.path = where
    stores.flush(image, least=1)
    loaded = Store.load(where, image)
    assert loaded is not None and not store._learnt
    use(image, loaded)
    return loaded


def _same(image: Image, store: Store, funcs) -> tuple[int, int]:
    """(clobber answers compared, live sets compared)."""
    support = support_for(image.arch)
    twin = _without_derived(image, store)
    facts = SiteFacts(twin, get_arch(image.arch))
    n_clob = n_live = 0
    for func in funcs:
        end = store.code_end(func)
        if end is not None:
            assert end == facts._extent(func)[0], func.name
        derived = store.clobbers(image, func)
        if derived is None:
            continue
        assert derived == clobbers.function_clobbers(twin, support, func), func.name
        n_clob += 1
        try:
            a = analyze(twin, func)
        except KsimError:
            continue
        for insn in a.insns[:HEAD_LIVE]:
            live = store.head_live(image, func, insn.address)
            if live is not None:
                assert live == a.live_at(insn.address), f"{func.name}: {insn}"
                n_live += 1
    return n_clob, n_live


@pytest.mark.parametrize("path", kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_derived_facts_are_the_analysis(path: str, tmp_path: Path) -> None:
    image = load_image(path)
    store = _learnt(image, analyze_image(image, save=False), image.functions, tmp_path / "s.ksa")
    n_clob, n_live = _same(image, store, image.functions)
    ok = sum(1 for s in store._arrays["status"] if s == 0)
    assert n_clob == ok and n_live >= 0.7 * ok, (n_clob, n_live, ok)


def test_derived_facts_on_the_debian_kernel(debian_kernel, tmp_path: Path) -> None:
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    store = stores.store_for(vmlinux, build_missing=False) or analyze_image(vmlinux)
    store = _learnt(vmlinux, store, vmlinux.functions[::10], tmp_path / "s.ksa")
    n_clob, n_live = _same(vmlinux, store, vmlinux.functions[::10])
    assert n_clob > 4000 and n_live > 2 * n_clob, (n_clob, n_live)


@pytest.mark.parametrize("path", kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_a_new_store_has_every_clobber_answer(path: str) -> None:
    """A store is made with the clobbers of every function whose reach has good
    records (Store._settle_clobbers, one pass over the whole image): nothing is left
    for a batch to learn, and each is the clobber analysis's own walk."""
    image = load_image(path)
    store = analyze_image(image, save=False)
    assert not store._learnt
    n_clob, _ = _same(image, store, image.functions)
    ok = sum(1 for s in store._arrays["status"] if s == 0)
    assert n_clob == ok, (n_clob, ok)


def test_a_new_store_has_the_debian_kernels_clobbers(debian_kernel) -> None:
    """The same on Debian's vmlinux, every 10th function (cycles, tail calls into
    .cold parts, retpolines and calls to what is no function)."""
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    store = stores.store_for(vmlinux, build_missing=False) or analyze_image(vmlinux)
    n_clob, _ = _same(vmlinux, store, vmlinux.functions[::10])
    ok = sum(1 for s in store._arrays["status"][::10] if s == 0)
    assert n_clob > 0.95 * ok, (n_clob, ok)


def _nothing_to_learn(image: Image, store: Store, funcs) -> int:
    """A batch's questions over ``funcs`` (each entry's live registers, where its
    code ends) learn nothing: the store was made with the answers.  How many
    functions had them all."""
    use(image, store)
    facts = SiteFacts(image, get_arch(image.arch))
    answered = 0
    for func in funcs:
        i = store.index_of(func)
        try:
            facts._extent(func)
            facts.live_at(facts.entry(func))
        except KsimError:
            continue
        assert not store._learnt, func.name
        answered += i is not None and store._arrays["derived"][i] == 7
    return answered


@pytest.mark.parametrize("path", kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_a_new_store_has_every_entry_answer(path: str) -> None:
    """A store is made with the live registers before every function's first
    instructions and where its code ends (Store._heads, in the build's workers):
    what a batch's first command would learn, its next one finds, and each is the
    object path's answer (``_same``)."""
    image = load_image(path)
    store = analyze_image(image, save=False)
    answered = _nothing_to_learn(image, store, image.functions)
    _n_clob, n_live = _same(image, store, image.functions)
    ok = sum(1 for s in store._arrays["status"] if s == 0)
    assert answered >= 0.7 * ok and n_live >= 0.7 * ok, (answered, n_live, ok)


def test_a_new_store_has_the_debian_kernels_entries(debian_kernel) -> None:
    """The same on Debian's vmlinux, every 10th function."""
    from ksim.image import load_kallsyms

    vmlinux = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    store = analyze_image(vmlinux, save=False)
    funcs = vmlinux.functions[::10]
    answered = _nothing_to_learn(vmlinux, store, funcs)
    _n_clob, n_live = _same(vmlinux, store, funcs)
    ok = sum(1 for s in store._arrays["status"][::10] if s == 0)
    assert answered > 0.9 * ok and n_live > 2 * answered, (answered, n_live, ok)


def test_a_learnt_entry_answers_without_a_view_of_its_function(tmp_path: Path) -> None:
    """live_at of an entry whose live registers the store learnt answers from the
    store, building no record view (a batch over more functions than SiteFacts keeps
    views of made each twice): the analysis's answer.  One the store does not know
    is answered through a view, as before."""
    image = load_image(kernels()[0])
    store = _learnt(image, analyze_image(image, save=False), image.functions, tmp_path / "s.ksa")
    facts = SiteFacts(image, get_arch(image.arch))
    known = [f for f in image.functions if store.head_live(image, f, f.address) is not None]
    assert len(known) >= 5
    for func in known:
        live = facts.live_at(Point(func.address, PointKind.ENTRY, func.name))
        assert live == analyze(image, func).live_at(func.address), func.name
    assert not facts._views
    func = next(f for f in known if len(analyze(image, f).insns) > HEAD_LIVE)
    second = analyze(image, func).insns[HEAD_LIVE]     # past what the store keeps
    assert facts.live_at(Point(second.address, PointKind.INSN, func.name)) == \
        analyze(image, func).live_at(second.address)
    assert list(facts._views) == [func.address]


def test_a_changed_callee_turns_derived_facts_off() -> None:
    """An image read through a reader (a running kernel's kind): once a callee's
    bytes change, its callers' derived clobbers and learnt live sets are not used, and
    the answers are those of the new bytes; the callee's unchanged neighbours keep
    theirs."""
    path = kernels()[0]
    base = load_image(path)
    text = {s.address: bytearray(s.data) for s in base.sections if s.data}

    def read(addr: int, size: int) -> bytes:
        for start, data in text.items():
            if start <= addr and addr + size <= start + len(data):
                return bytes(data[addr - start:addr - start + size])
        raise KsimError(f"nothing at {addr:#x}")

    image = Image(base.path, base.arch, base.module, base.sections, base.symbols,
                  reader=read, identity=b"test-derived")
    store = analyze_image(image, save=False)
    support = support_for(image.arch)
    use(image, store)
    for func in image.functions:    # what a batch over every function learns
        clobbers.function_clobbers(image, support, func)
    # a caller whose callee writes no caller-saved register beyond the arguments
    # the caller could see clobbered; then make the callee write one more
    pick = None
    for func in image.functions:
        i = store.index_of(func)
        if i is None or not store._arrays["derived"][i] & 1:
            continue
        callees = [image.function_at(t) for t in store.summary(func)[2]]
        for callee in callees:
            if callee is None or store.summary(callee) is None:
                continue
            free = support.convention.caller_saved - clobbers.function_clobbers(image, support, callee)
            if "r11" in free and callee.size >= 2 and store.summary(callee)[2] == ():
                pick = func, callee
                break
        if pick:
            break
    assert pick is not None
    caller, callee = pick
    before = store.clobbers(image, caller)
    assert before is not None and "r11" not in clobbers.function_clobbers(image, support, callee)
    use(image, store)
    SiteFacts(image, get_arch(image.arch)).live_at(Point(caller.address, PointKind.ENTRY, caller.name))
    assert store.head_live(image, caller, caller.address) is not None     # learnt
    # `xor %r11d,%r11d` (45 31 db) over the callee's first three bytes: it now writes r11
    at = callee.address
    for start, data in text.items():
        if start <= at < start + len(data):
            data[at - start:at - start + 3] = b"\x45\x31\xdb"
    fresh = Store(image, store.key, store._arrays, store._meta)   # no answer kept yet
    use(image, fresh)
    clobbers._CACHE.pop(image, None)
    clobbers._SUMMARIES.pop(image, None)
    assert not fresh.settled(image, caller)
    # settled, for every function, is whether everything it reaches is current
    def current_reach(func: Function) -> bool:
        seen, work = set(), [func]
        while work:
            f = work.pop()
            if f.address in seen:
                continue
            seen.add(f.address)
            if fresh._current(f) is None:
                return False
            _own, _worst, calls_out, jumps_out = fresh.summary(f)
            work += [c for t in calls_out if (c := image.function_at(t)) is not None and c.address == t]
            work += [c for t in jumps_out if (c := image.function_at(t)) is not None]
        return True

    oracle = {func.address: current_reach(func) for func in image.functions}
    for func in image.functions:
        assert fresh.settled(image, func) == oracle[func.address], func.name
    # ... also when a batch's reach walk came first (Store.reach): a closure whose every
    # record is current is settled at once; one holding the changed callee is not, and
    # each function is then asked about by its own walk
    for funcs in ([f for f in image.functions if oracle[f.address]], list(image.functions)):
        again = Store(image, store.key, store._arrays, store._meta)
        use(image, again)
        again.reach(image, funcs)
        assert again.settled(image, funcs[0]) == oracle[funcs[0].address]
        # the first: every function of the closure answered by the one look
        assert (len(again._settled) >= len(funcs)) == all(oracle[f.address] for f in funcs)
        for func in reversed(image.functions):
            assert again.settled(image, func) == oracle[func.address], func.name
    use(image, fresh)
    assert fresh.clobbers(image, caller) is None and fresh.head_live(image, caller, caller.address) is None
    assert "r11" in clobbers.function_clobbers(image, support, caller)


def test_a_few_facts_learnt_do_not_rewrite_the_store(tmp_path: Path) -> None:
    """Saving the store again costs a command more than working a few functions' facts
    out again costs the next one: under FLUSH_LEARNT facts, flush leaves the file."""
    image = load_image(kernels()[0])
    store = analyze_image(image, save=False)
    use(image, store)
    store.path = tmp_path / "s.ksa"
    func = next(f for f in image.functions if store.index_of(f) is not None)
    # its entry's live registers not made with the store (a function whose reach
    # changed since): the command learns them
    store._arrays["derived"][store.index_of(func)] &= ~stores._LIVE
    SiteFacts(image, get_arch(image.arch)).live_at(Point(func.address, PointKind.ENTRY, func.name))
    assert 0 < store._learnt < stores.FLUSH_LEARNT
    stores.flush(image)
    assert not store.path.exists()
    stores.flush(image, least=1)
    assert Store.load(store.path, image) is not None and store._learnt == 0
