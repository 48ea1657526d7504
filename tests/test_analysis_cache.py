"""The persistent analysis store: what it keeps equals a fresh analysis; it is keyed
to its image; a damaged or foreign file is never used, and is rebuilt.

The whole-kernel tests take a sample of the Debian vmlinux's functions as an image
of their own (same sections, same extents), so that building its store takes
seconds; the whole vmlinux is under ``slow``.
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest
from analysis_kernel import fixture_kernel, kernels

from ksim.analysis import analyze, store
from ksim.analysis.abi import support_for
from ksim.analysis.compact import compute
from ksim.analysis.function import FunctionAnalysis
from ksim.arch.base import Flow
from ksim.image import Image, load_image, load_kallsyms

SUPPORT = support_for("x86_64")


def _fresh(image: Image) -> Image:
    """The same image, loaded anew, that never uses a store."""
    twin = Image(image.path, image.arch, image.module, image.sections, image.symbols,
                 build_id=image.build_id)
    store.use(twin, None)
    return twin


def _same(cached: FunctionAnalysis, fresh: FunctionAnalysis) -> None:
    name = fresh.function.name
    assert cached.insns == fresh.insns, name
    assert cached.cfg.blocks == fresh.cfg.blocks, name
    assert cached.edges == fresh.edges, name
    assert cached.tables == fresh.tables, name
    assert cached.points == fresh.points, name
    assert cached.callsites == fresh.callsites, name
    for insn in fresh.insns:
        assert cached.live_at(insn.address) == fresh.live_at(insn.address), f"{name}: {insn}"
        assert cached.live_after(insn.address) == fresh.live_after(insn.address), f"{name}: {insn}"


def _check_store(image: Image, built: store.Store, sample: list) -> None:
    """Every function's stored analysis equals its compact analysis, and a sample of
    them, rebuilt from the store, equals a fresh analysis, liveness included."""
    for func in image.functions:
        kept = built.get(func)
        try:
            ref = compute(image, SUPPORT, func)
        except Exception:  # noqa: BLE001 - unreadable: the store has no entry either
            assert kept is None
            continue
        assert kept is not None and kept.same_analysis(ref), func.name
    store.use(image, built)
    fresh = _fresh(image)
    for func in sample:
        _same(analyze(image, func), analyze(fresh, func))


@pytest.fixture(scope="module", params=kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def small(request: pytest.FixtureRequest) -> Image:
    return load_image(request.param)


def test_store_equals_fresh_analysis(small: Image, tmp_path: Path) -> None:
    built = store.build(small, jobs=1)
    path = tmp_path / "a.ksa"
    built.save(path)
    loaded = store.Store.load(path, small)
    assert loaded is not None and loaded.totals() == built.totals()
    _check_store(small, loaded, list(small.functions))


def test_a_store_keeps_its_images_kernel_tables(small: Image, tmp_path: Path) -> None:
    """The store keeps the image's address-keyed tables (bug, extable, jump-label,
    static-call sites, the kprobe blacklist): an image the store is loaded for has
    them without reading them again, equal to what reading them gives; a store whose
    tables are not sorted, unique addresses is refused."""
    from ksim.image.tables import kernel_tables

    built = store.build(small, jobs=1)
    path = tmp_path / "t.ksa"
    built.save(path)
    twin = _fresh(small)
    assert "tables" not in twin.__dict__
    assert store.Store.load(path, twin) is not None
    assert "tables" in twin.__dict__            # given by the store, not read
    assert twin.tables == kernel_tables(small) and twin.tables.counts() == small.tables.counts()
    # tables whose addresses are out of order (the test kernels have few or none)
    arrays, meta = store._decode(memoryview(built.body()))
    arrays["table_addrs"], arrays["table_kinds"] = array("Q", [0x20, 0x10]), array("B", [1, 1])
    twin = _fresh(small)
    with pytest.raises(store.StoreError, match="kernel tables"):
        store.Store(twin, built.key, arrays, meta)
    assert "tables" not in twin.__dict__        # a refused store gives the image nothing


def test_parallel_build_equals_serial(small: Image) -> None:
    serial, parallel = store.build(small, jobs=1), store.build(small, jobs=2)
    assert serial.totals() == parallel.totals()
    for func in small.functions:
        a, b = serial.get(func), parallel.get(func)
        assert (a is None) == (b is None) and (a is None or a.same_analysis(b)), func.name
    # what the workers found of the entries (Store._heads), and the name index
    for name in ("derived", "clob", "code_end", "name_order",
                 *(f"live{k}" for k in range(store.HEAD_LIVE))):
        assert serial._arrays[name] == parallel._arrays[name], name


def test_a_stores_name_index_finds_what_matching_every_name_finds(small: Image,
                                                                    tmp_path: Path) -> None:
    """Store.named: the functions whose names start with a prefix, in address order,
    found by bisection in the index saved with the store -- the same functions as a
    look at every name, for every prefix of one to three characters the image's names
    start with, the empty prefix and prefixes no name has."""
    built = store.build(small, jobs=1)
    built.save(tmp_path / "n.ksa")
    loaded = store.Store.load(tmp_path / "n.ksa", small)
    assert loaded is not None
    prefixes = {f.name[:k] for f in small.functions for k in (1, 2, 3)}
    for prefix in sorted(prefixes | {"", "~", "\x7f", "zzzz_none"}):
        assert loaded.named(small, prefix) == [f for f in small.functions
                                               if f.name.startswith(prefix)], prefix


def test_whole_image_points_agree_with_analyze(small: Image) -> None:
    built = store.build(small, jobs=1)
    fresh = _fresh(small)
    points = {p.entry: p for p in built.function_points(small)}
    for func in small.functions:
        assert points[func.address] == analyze(fresh, func).points, func.name
    totals = built.totals()
    assert totals["instructions"] == sum(len(analyze(fresh, f).insns) for f in small.functions)
    assert totals["blocks"] == sum(len(analyze(fresh, f).blocks) for f in small.functions)


# --- keys -----------------------------------------------------------------------------------
def test_keys_tell_images_apart(tmp_path: Path) -> None:
    paths = kernels()
    images = [load_image(p) for p in paths]
    keys = {store.image_key(i) for i in images}
    assert len(keys) == len(images)
    assert store.image_key(load_image(paths[0])) == store.image_key(images[0])  # stable
    # the same file with other function extents is another analysis
    kallsyms = tmp_path / "kallsyms"
    from ksim.image import to_kallsyms

    kallsyms.write_text(to_kallsyms(images[0]))
    assert store.image_key(load_kallsyms(kallsyms, paths[0])) != store.image_key(images[0])


def test_a_store_serves_only_its_image(tmp_path: Path) -> None:
    fixture, toy = (load_image(p) for p in kernels()[:2]) if len(kernels()) > 1 else (None, None)
    if fixture is None:
        pytest.skip("needs two kernels")
    path = tmp_path / "s.ksa"
    store.build(fixture, jobs=1).save(path)
    assert store.Store.load(path, toy) is None
    assert store.Store.load(path, fixture) is not None


def test_an_image_read_from_memory_has_no_store() -> None:
    elf = load_image(fixture_kernel())
    live = Image(elf.path, elf.arch, elf.module, elf.sections, elf.symbols,
                 reader=lambda addr, size: elf.read(addr, size))
    assert store.store_for(live, build_missing=True) is None


# --- damage -----------------------------------------------------------------------------------
@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KSIM_ANALYSIS_CACHE", str(tmp_path))
    return tmp_path


def _damaged(data: bytes, how: str) -> bytes:
    if how == "flipped byte":
        k = len(data) * 2 // 3
        return data[:k] + bytes([data[k] ^ 0x40]) + data[k + 1:]
    if how == "truncated":
        return data[:len(data) // 2]
    if how == "empty":
        return b""
    if how == "old version":
        return data[:8] + (store.ANALYSIS_VERSION + 1).to_bytes(4, "little") + data[12:]
    if how == "garbage":
        return random.Random(7).randbytes(len(data))
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "empty", "old version", "garbage"])
def test_a_damaged_store_is_ignored_and_rebuilt(cache: Path, how: str) -> None:
    image = load_image(fixture_kernel())
    first = store.analyze_image(image, jobs=1)
    path = store.path_for(image)
    good = path.read_bytes()
    path.write_bytes(_damaged(good, how))
    again = load_image(fixture_kernel())
    assert store.Store.load(path, again) is None
    assert store.store_for(again, build_missing=False) is None  # never used ...
    rebuilt = store.store_for(load_image(fixture_kernel()), build_missing=True)  # ... but rebuilt
    assert rebuilt is not None and rebuilt.totals() == first.totals()
    on_disk = store.Store.load(path, load_image(fixture_kernel()))  # and saved again, whole
    assert on_disk is not None and len(path.read_bytes()) > len(good) // 2
    for func in image.functions:
        assert on_disk.get(func).same_analysis(first.get(func)), func.name
    assert not [p for p in cache.iterdir() if p.suffix != ".ksa"]  # no temporary file left


def test_a_store_of_another_image_under_this_name_is_ignored(cache: Path) -> None:
    fixture_path, toy_path = (kernels() + [None])[:2]
    if toy_path is None:
        pytest.skip("needs two kernels")
    fixture, toy = load_image(fixture_path), load_image(toy_path)
    store.analyze_image(toy, jobs=1)
    store.path_for(toy).replace(store.path_for(fixture))
    assert store.Store.load(store.path_for(fixture), fixture) is None
    assert store.store_for(fixture, build_missing=False) is None


def test_analyze_uses_the_store_on_disk(cache: Path) -> None:
    image = load_image(fixture_kernel())
    store.analyze_image(image, jobs=1)
    again = load_image(fixture_kernel())  # a new process would do the same
    kept = store.store_for(again, build_missing=False)
    assert kept is not None
    fresh = _fresh(again)
    for func in again.functions:
        _same(analyze(again, func), analyze(fresh, func))


def test_a_stale_record_falls_back_to_a_fresh_analysis(cache: Path) -> None:
    """Bytes that no longer decode as recorded (a store kept across a change of the
    image that kept its identity) give a fresh analysis, not the stored one."""
    image = load_image(fixture_kernel())
    built = store.build(image, jobs=1)
    func = image.function("keeps")
    sections = [s if not s.executable else type(s)(s.name, s.address, s.size, s.executable, s.writable,
                                                   s.data.replace(image.code(func)[:3], b"\x06\x06\x06", 1))
                for s in image.sections]
    patched = Image(image.path, image.arch, image.module, sections, image.symbols)
    store.use(patched, built)
    fa = analyze(patched, func)
    assert fa.insns == tuple(SUPPORT.decode(patched.code(func), func.address))


# --- a real kernel ------------------------------------------------------------------------------
def _vmlinux_sample(kernel, count: int) -> tuple[Image, list]:
    """A sample of the vmlinux's functions (with kallsyms extents) as an image of
    their own: the same sections, the sampled functions' symbols."""
    full = load_kallsyms(kernel.kallsyms, kernel.vmlinux)
    rng = random.Random(20)
    picked = set(rng.sample(range(len(full.functions)), count))
    names = {full.functions[i].name for i in picked}
    symbols = [s for s in full.symbols if s.kind != "func" or s.name in names]
    image = Image(full.path, full.arch, full.module, full.sections, symbols, build_id=full.build_id)
    return image, [f for f in image.functions if f.size < 20_000]


def test_vmlinux_sample_store_equals_fresh(debian_kernel, cache: Path) -> None:
    image, funcs = _vmlinux_sample(debian_kernel, 400)
    assert len(image.functions) >= 390
    built = store.analyze_image(image, jobs=2)
    reloaded = store.Store.load(store.path_for(image), image)
    assert reloaded is not None
    sample = random.Random(3).sample(funcs, 40)
    assert any(i.flow is Flow.CALL for f in sample for i in analyze(_fresh(image), f).insns)
    _check_store(image, reloaded, sample)
    assert built.totals() == reloaded.totals()


@pytest.mark.slow
def test_whole_vmlinux_store(debian_kernel, cache: Path) -> None:
    image = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    built = store.analyze_image(image)
    totals = built.totals()
    assert totals["functions"] == len(image.functions) - totals["failed"]
    again = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    kept = store.store_for(again, build_missing=False)
    assert kept is not None and kept.totals() == totals
    fresh = _fresh(again)
    for func in random.Random(5).sample(list(again.functions), 60):
        ref = compute(again, SUPPORT, func)
        assert kept.get(func).same_analysis(ref), func.name
        _same(analyze(again, func), analyze(fresh, func))


# --- a running kernel's image ------------------------------------------------------------------
def _memory_image(elf: Image, memory: bytearray, base: int, reads: list | None = None) -> Image:
    """``elf`` as a running kernel's image would be: symbols, and bytes read from
    ``memory`` (which the test may change), named by an identity."""
    def read(addr: int, size: int) -> bytes:
        if reads is not None:
            reads.append((addr, size))
        return bytes(memory[addr - base:addr - base + size])

    return Image(elf.path, elf.arch, elf.module, elf.sections, elf.symbols, reader=read,
                 identity=b"test-kernel/1")


def _text(elf: Image) -> tuple[bytearray, int]:
    """The kernel's memory: every section of the file at its address."""
    lo = min(s.address for s in elf.sections if s.address)
    hi = max(s.end for s in elf.sections if s.address)
    memory = bytearray(hi - lo)
    for s in elf.sections:
        if s.address and s.data:
            memory[s.address - lo:s.address - lo + len(s.data)] = s.data
    return memory, lo


def test_a_running_kernels_store_is_built_from_one_read_and_found_again(cache: Path) -> None:
    elf = load_image(fixture_kernel())
    memory, base = _text(elf)
    reads: list = []
    live = _memory_image(elf, memory, base, reads)
    assert store.store_for(live, build_missing=None) is None  # not built behind the user's back
    built = store.analyze_image(live, jobs=2)
    # the frozen copy read the run of functions at once; a part whose analysis reads
    # memory beyond the functions (this kernel has jump tables) is analysed again here
    assert reads[0][0] <= elf.functions[0].address and reads[0][0] + reads[0][1] >= elf.functions[-1].end
    assert built.totals() == store.build(elf, jobs=1).totals()
    again = _memory_image(elf, memory, base)  # a new process, the same kernel
    kept = store.store_for(again, build_missing=False)
    assert kept is not None
    fresh = _fresh(elf)
    for func in again.functions:
        _same(analyze(again, func), analyze(fresh, func))


def test_a_running_kernels_record_is_used_only_while_its_bytes_are_the_same(cache: Path) -> None:
    elf = load_image(fixture_kernel())
    memory, base = _text(elf)
    live = _memory_image(elf, memory, base)
    built = store.analyze_image(live, jobs=1)
    func, other = elf.function("keeps"), elf.function("calls_keeps") \
        if elf.has_function("calls_keeps") else elf.functions[0]
    assert built.get(func) is not None and built.summary(func) is not None
    # the kernel changes the function (a static key flips, a tracer patches it):
    # a 5-byte nop becomes a 5-byte jmp, the same instruction sizes, another flow
    at = func.address - base
    memory[at:at + 3] = b"\x06\x06\x06"
    assert built.get(func) is None and built.summary(func) is None
    assert built.get(other) is not None or other == func
    fa = analyze(live, func)
    assert fa.insns == tuple(SUPPORT.decode(bytes(memory[at:at + func.size]), func.address))


# --- the directory's size ----------------------------------------------------------------------
def test_saving_prunes_the_least_recently_used_stores(cache: Path, monkeypatch) -> None:
    import os

    old = []
    for k in range(4):  # four stores of another kernel, 1 MiB each, used an hour apart
        path = cache / f"{k:040x}.ksa"
        path.write_bytes(bytes(1 << 20))
        os.utime(path, (1_000_000 + 3600 * k, 1_000_000 + 3600 * k))
        old.append(path)
    (cache / "notes.txt").write_text("not a store")
    monkeypatch.setenv("KSIM_ANALYSIS_CACHE_MB", "2")
    image = load_image(fixture_kernel())
    store.analyze_image(image, jobs=1)          # saved: the newest, always kept
    mine = store.path_for(image)
    # what fits in 2 MiB with the new store: the most recently used of the others
    assert sorted(p.name for p in cache.iterdir()) == sorted([mine.name, old[3].name, "notes.txt"])
    # loading a store makes it the most recently used: of it and the other, which
    # do not both fit in 1 MiB, it is the one kept (it was the older before)
    os.utime(mine, (1_000_000, 1_000_000))
    assert store.Store.load(mine, load_image(fixture_kernel())) is not None
    monkeypatch.setenv("KSIM_ANALYSIS_CACHE_MB", "1")
    assert store.prune(cache) == [old[3]]
    assert mine.exists()
    # a budget smaller than the store just saved keeps that store and removes the rest
    monkeypatch.setenv("KSIM_ANALYSIS_CACHE_MB", "0")
    store.analyze_image(load_image(fixture_kernel()), jobs=1)
    assert sorted(p.name for p in cache.iterdir()) == sorted([mine.name, "notes.txt"])
