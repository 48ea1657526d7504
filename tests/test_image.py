"""Image loading: ELF kernels and modules, kallsyms lists, and refusing bad input."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from analysis_kernel import ABS_VALUE, fixture_kernel, fixture_module, toy_kernel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksim.arch import get_arch
from ksim.errors import ImageError, KsimError, MalformedImage, UnknownSymbol, UnsupportedImage
from ksim.image import (
    Image,
    load_image,
    load_image_bytes,
    load_kallsyms,
    parse_kallsyms,
    to_kallsyms,
)
from ksim.image.kallsyms import symbol_table
from ksim.image.model import Section, Symbol, SymbolTable


@pytest.fixture(scope="module")
def kernel() -> Image:
    return load_image(fixture_kernel())


@pytest.fixture(scope="module")
def kernel_bytes() -> bytes:
    return Path(fixture_kernel()).read_bytes()


def test_kernel_basics(kernel: Image) -> None:
    assert kernel.arch == "x86_64" and kernel.module == "vmlinux"
    names = [f.name for f in kernel.functions]
    assert {"classify", "add3", "keeps", "_start", "note"} <= set(names)
    addrs = [f.address for f in kernel.functions]
    assert addrs == sorted(addrs) and len(set(addrs)) == len(addrs)
    assert all(f.size > 0 for f in kernel.functions)
    assert kernel.text_regions and all(kernel.is_text(f.address) for f in kernel.functions)
    assert not kernel.is_text(kernel.address_of("counter"))


def test_function_lookup(kernel: Image) -> None:
    add3 = kernel.function("add3")
    assert kernel.function_at(add3.address) == add3
    assert kernel.function_at(add3.end - 1) == add3
    assert kernel.function_at(0x1000) is None
    assert kernel.code(add3) == kernel.read(add3.address, add3.size)
    assert kernel.code("add3").endswith(b"\xc3")


def test_unknown_name_suggests(kernel: Image) -> None:
    with pytest.raises(UnknownSymbol) as info:
        kernel.function("clasify")
    assert "classify" in info.value.suggestions
    assert "did you mean" in str(info.value)
    with pytest.raises(UnknownSymbol):
        kernel.symbol("no_such_thing_at_all")


def test_symbols_and_absolute(kernel: Image) -> None:
    assert kernel.address_of("KSIM_TEST_ABS") == ABS_VALUE
    counter = kernel.symbol("counter")
    assert counter.kind == "object" and counter.size == 8
    assert kernel.symbol("add3").kind == "func"


def test_read_nobits_is_zero(kernel: Image) -> None:
    tasks = kernel.symbol("tasks")  # .bss
    assert kernel.read(tasks.address, tasks.size) == bytes(tasks.size)
    with pytest.raises(ImageError):
        kernel.read(0x10, 4)


def test_aliases_are_one_function(tmp_path: Path) -> None:
    src = tmp_path / "a.S"
    src.write_text(".text\n.globl f\n.type f,@function\n.globl __f_alias\n.type __f_alias,@function\n"
                   "f:\n__f_alias:\n ret\n.size f, 1\n.size __f_alias, 1\n")
    elf = tmp_path / "a.elf"
    subprocess.run(["gcc", "-c", str(src), "-o", str(tmp_path / "a.o")], check=True)
    subprocess.run(["ld", "-Ttext=0xffffffff81000000", "-o", str(elf), str(tmp_path / "a.o")],
                   check=True, capture_output=True)
    image = load_image(elf)
    assert [f.name for f in image.functions] == ["f"]
    assert image.function("__f_alias") == image.function("f")
    assert image.aliases(image.function("f")) == ["f", "__f_alias"]


def test_module_layout() -> None:
    module = load_image(fixture_module())
    assert module.module == "module"
    addrs = [f.address for f in module.functions]
    loader = get_arch(module.arch).module_loader
    assert loader is not None
    assert len(set(addrs)) == len(addrs) and min(addrs) >= loader.base
    spans = sorted((s.address, s.end) for s in module.sections)
    assert all(a_end <= b_start for (_a, a_end), (b_start, _b) in zip(spans, spans[1:], strict=False))
    note = module.function("note")
    assert module.read(note.address, note.size)  # bytes come from the laid-out section


@pytest.mark.skipif(shutil.which("objcopy") is None, reason="needs objcopy")
def test_kallsyms_round_trip(kernel: Image, tmp_path: Path) -> None:
    syms = tmp_path / "kallsyms"
    syms.write_text(to_kallsyms(kernel))
    stripped = tmp_path / "vmlinux.stripped"
    subprocess.run(["objcopy", "--strip-all", fixture_kernel(), str(stripped)], check=True)
    assert load_image(stripped).functions == ()  # no symbols left in it
    for image in (load_kallsyms(syms, stripped), load_kallsyms(syms, reader=kernel.read)):
        assert [f.address for f in image.functions] == [f.address for f in kernel.functions]
        assert [f.name for f in image.functions] == [f.name for f in kernel.functions]
        for ours, real in zip(image.functions, kernel.functions, strict=True):
            # sizes run to the next symbol: they include the padding after a function
            assert ours.size >= real.size
            assert image.read(real.address, real.size) == kernel.code(real)
        assert image.address_of("KSIM_TEST_ABS") == ABS_VALUE


def test_kallsyms_parsing(tmp_path: Path) -> None:
    entries = parse_kallsyms("ffffffff81000000 T _stext\nffffffffc0001000 t e100_probe\t[e100]\n")
    assert entries == [(0xFFFFFFFF81000000, "T", "_stext", "vmlinux"),
                       (0xFFFFFFFFC0001000, "t", "e100_probe", "e100")]
    with pytest.raises(MalformedImage, match="not a kallsyms line"):
        parse_kallsyms("hello world\n")
    with pytest.raises(MalformedImage, match="zero"):
        parse_kallsyms("0000000000000000 T _stext\n0000000000000000 T foo\n")
    bad = tmp_path / "bin"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(MalformedImage):
        load_kallsyms(bad)


def _sized_as_specified(rows: list[tuple[int, str, str, str]],
                        sections: list[Section]) -> list[Symbol]:
    """What a kallsyms list's symbols are, symbol by symbol as kallsyms' module doc
    says (the oracle of the loader's column-wise sizing): a text symbol is a function
    up to the next start of its module that is not absolute, within its executable
    section; outside every one a label; an absolute symbol "other"; the rest objects.
    In (address, name) order, equal ones as listed."""
    out = []
    for addr, letter, name, module in rows:
        if letter in "TtWw":
            section = next((s for s in sections if s.executable and s.address <= addr < s.end),
                           None)
            if section is None:
                out.append(Symbol(name, addr, 0, "other", module))
                continue
            later = [a for a, t, _n, m in rows if m == module and t not in "Aa" and a > addr]
            end = min([*later, section.end])
            out.append(Symbol(name, addr, end - addr, "func", module))
        else:
            out.append(Symbol(name, addr, 0, "other" if letter in "Aa" else "object", module))
    return sorted(out, key=lambda s: (s.address, s.name))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from("TtWwAaDdbBrR?"),
                          st.sampled_from(["vmlinux", "vmlinux", "e100", "ext4"])),
                min_size=1, max_size=30),
       st.lists(st.tuples(st.integers(0, 40), st.integers(1, 16)), max_size=3))
def test_kallsyms_symbols_are_sized_as_specified(lines, spans) -> None:
    """The loader's symbols, kinds and sizes equal a symbol-by-symbol reading of the
    rules, with explicit executable sections and with the ones kallsyms implies."""
    base = 0xFFFFFFFF81000000
    rows = [(base + 4 * a, letter, f"s{i}", module)
            for i, (a, letter, module) in enumerate(lines)]
    text = "".join(f"{a:016x} {t} {n}" + ("" if m == "vmlinux" else f"\t[{m}]") + "\n"
                   for a, t, n, m in rows)
    if not any(a for a, *_ in rows):
        return
    sections = [Section(f".t{i}", base + 4 * a, 4 * n, True, False)
                for i, (a, n) in enumerate(spans)]
    if all(a[1] <= b[0] for a, b in zip(sorted((s.address, s.end) for s in sections),
                                        sorted((s.address, s.end) for s in sections)[1:],
                                        strict=False)):
        addresses, letters, names, modules = (list(c) for c in zip(*rows, strict=True))
        table = symbol_table(addresses, letters, names, modules, sections)
        assert list(table) == _sized_as_specified(rows, sections)
    image = load_kallsyms_text(text)
    assert list(image.symbols) == _sized_as_specified(rows, list(image.sections))
    assert tuple(image.symbols) == image.symbols[:]
    for name in {n for _a, _t, n, _m in rows}:
        assert image.find_symbol(name) == next(s for s in image.symbols if s.name == name)


def load_kallsyms_text(text: str) -> Image:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".kallsyms") as f:
        f.write(text)
        f.flush()
        return load_kallsyms(f.name, reader=lambda address, size: bytes(size))


def _seen(image: Image) -> tuple:
    """What an Image built from a kallsyms file is, for comparing two of them."""
    return (list(image.symbols), image.functions, image.sections,
            {name: image.function(name) for name in image._func_by_name},
            [image.aliases(f) for f in image.functions])


def test_parsed_kallsyms_kept_beside_the_file_give_the_same_image(kernel: Image,
                                                                  tmp_path: Path) -> None:
    """keep_parsed: the symbols parsed and sized once are kept (FILE.columns) and give
    the very image parsing gives, aliases' names included; a file whose bytes changed
    is parsed again and its columns replaced."""
    text = to_kallsyms(kernel) + (
        "ffffffff81f00000 t __do_sys_foo\nffffffff81f00000 T __x64_sys_foo\n"
        "ffffffff81f00000 t _foo\nffffffff81f00040 T after_foo\n"
        "ffffffff81f00080 D data_end\nffffffffc0001000 t e100_probe\t[e100]\n"
        "ffffffffc0001000 t e100_alias\t[e100]\nffffffffc0001040 d e100_data\t[e100]\n")
    syms = tmp_path / "kallsyms"
    syms.write_text(text)
    read = lambda address, size: bytes(size)  # noqa: E731
    parsed = load_kallsyms(syms, reader=read)
    assert not (tmp_path / "kallsyms.columns").exists()
    first = load_kallsyms(syms, reader=read, keep_parsed=True)
    kept = tmp_path / "kallsyms.columns"
    assert kept.exists() and _seen(first) == _seen(parsed)
    again = load_kallsyms(syms, reader=read, keep_parsed=True)
    assert _seen(again) == _seen(parsed)
    assert again.function("__do_sys_foo").name == parsed.function("_foo").name == "__x64_sys_foo"
    before = kept.read_bytes()
    syms.write_text(text + "ffffffff81f000c0 T late\n")
    changed = load_kallsyms(syms, reader=read, keep_parsed=True)
    assert changed.find_symbol("late") is not None and kept.read_bytes() != before
    assert _seen(changed) == _seen(load_kallsyms(syms, reader=read))


@pytest.mark.parametrize("damage", ["truncated", "flipped", "version", "empty", "directory"])
def test_damaged_kept_columns_are_parsed_again(tmp_path: Path, damage: str) -> None:
    """Kept columns that cannot be trusted (cut short, a byte changed anywhere, another
    version, empty, not a file) are not used: the kallsyms file is parsed again."""
    text = ("ffffffff81000000 T _stext\nffffffff81000010 T f\nffffffff81000010 t g\n"
            "ffffffff81000040 T h\nffffffff81000080 D _etext\n"
            "ffffffffc0001000 t m\t[mod]\nffffffffc0001040 d md\t[mod]\n")
    syms = tmp_path / "kallsyms"
    syms.write_text(text)
    read = lambda address, size: bytes(size)  # noqa: E731
    expected = _seen(load_kallsyms(syms, reader=read))
    load_kallsyms(syms, reader=read, keep_parsed=True)
    kept = tmp_path / "kallsyms.columns"
    data = bytearray(kept.read_bytes())
    for at in range(0, len(data), max(1, len(data) // 40)) if damage == "flipped" else [0]:
        copy = bytearray(data)
        if damage == "truncated":
            copy = copy[:len(copy) // 2]
        elif damage == "flipped":
            copy[at] ^= 0x41
        elif damage == "version":
            copy[len(b"ksim-kallsyms-columns\0")] += 1
        elif damage == "empty":
            copy = bytearray()
        if damage == "directory":
            kept.unlink()
            kept.mkdir()
        else:
            kept.write_bytes(bytes(copy))
        image = load_kallsyms(syms, reader=read, keep_parsed=True)
        assert _seen(image) == expected, (damage, at)


def test_a_symbol_table_is_in_address_and_name_order_and_made_when_asked() -> None:
    rows = [Symbol("b", 8, 1, "func", "vmlinux"), Symbol("a", 8, 2, "object", "vmlinux"),
            Symbol("c", 4, 0, "other", "m"), Symbol("a", 8, 3, "func", "vmlinux")]
    table = SymbolTable.of(rows)
    assert list(table) == sorted(rows, key=lambda s: (s.address, s.name))
    assert table[0] == rows[2] and table[-1] == rows[0] and table[1] == rows[1]
    assert table[1:3] == (rows[1], rows[3]) and table[5:] == () and len(table) == 4
    with pytest.raises(IndexError):
        table[4]
    with pytest.raises(ValueError):
        SymbolTable(["a"], [1, 2], [0], ["func"], ["vmlinux"])
    image = Image("t", "x86_64", "vmlinux", [Section(".text", 0, 64, True, False)], rows)
    assert image.find_symbol("a") == rows[1] and image.symbol_containing(9) == rows[3]
    assert image.names_at(8) == ["a", "a", "b"] and image.find_symbol("z") is None


def test_a_kallsyms_file_without_an_end_is_refused_at_the_bound(tmp_path: Path) -> None:
    """/dev/zero was read until a MemoryError; a file past the bound is a
    MalformedImage, read no further than the bound."""
    from ksim.image.kallsyms import MAX_KALLSYMS_BYTES

    if Path("/dev/zero").exists():
        with pytest.raises(MalformedImage, match="/dev/zero: longer than"):
            load_kallsyms("/dev/zero")
    past = tmp_path / "kallsyms"
    with open(past, "wb") as f:
        f.write(b"ffffffff81000000 T _stext\n")
        f.truncate(MAX_KALLSYMS_BYTES + 1)                  # sparse: no disk taken
    with pytest.raises(MalformedImage, match="longer than"):
        load_kallsyms(past)


def test_a_fifo_or_a_directory_is_an_image_error_at_once(tmp_path: Path) -> None:
    """A FIFO without a writer: open() waited forever (the command hung)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ImageError, match="a FIFO, socket or block device, not a file"):
        load_image(fifo)
    with pytest.raises(ImageError, match="a directory, not a file"):
        load_image(tmp_path)


def test_missing_file_is_an_image_error(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="cannot read"):
        load_image(tmp_path / "nope.elf")


def test_not_elf_and_truncated(kernel_bytes: bytes) -> None:
    with pytest.raises(MalformedImage, match="not an ELF"):
        load_image_bytes(b"#!/bin/sh\necho hi\n")
    with pytest.raises(MalformedImage):
        load_image_bytes(kernel_bytes[:40])
    with pytest.raises(MalformedImage):
        load_image_bytes(kernel_bytes[: len(kernel_bytes) // 2])


def test_wrong_machine_class_or_order(kernel_bytes: bytes) -> None:
    arm = bytearray(kernel_bytes)
    struct.pack_into("<H", arm, 18, 40)  # EM_ARM: no ksim architecture
    with pytest.raises(UnsupportedImage, match="x86-64 .* and AArch64"):
        load_image_bytes(bytes(arm))
    elf32 = bytearray(kernel_bytes)
    elf32[4] = 1
    with pytest.raises(UnsupportedImage):
        load_image_bytes(bytes(elf32))
    big = bytearray(kernel_bytes)
    big[5] = 2
    with pytest.raises(UnsupportedImage):
        load_image_bytes(bytes(big))


def _check_mutant(data: bytes) -> None:
    from ksim.analysis import analyze

    try:
        image = load_image_bytes(data)
    except (MalformedImage, UnsupportedImage):
        return
    for func in image.functions[:6]:
        try:
            analyze(image, func).points  # noqa: B018 - analysis of odd code may refuse, not crash
        except KsimError:
            pass


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_images_fail_cleanly(kernel_bytes: bytes, data: st.DataObject) -> None:
    blob = bytearray(kernel_bytes)
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "header"]))
    if kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "insert":
        at = data.draw(st.integers(0, len(blob)))
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        hi = 64 if kind == "header" else len(blob) - 1
        for _ in range(data.draw(st.integers(1, 8))):
            at = data.draw(st.integers(0, hi))
            blob[at] ^= data.draw(st.integers(1, 255))
    _check_mutant(bytes(blob))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_section_headers_fail_cleanly(kernel_bytes: bytes, data: st.DataObject) -> None:
    """Corrupt fields of the section header table and symbol table, where parsers break."""
    blob = bytearray(kernel_bytes)
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shnum, = struct.unpack_from("<H", blob, 0x3C)
    for _ in range(data.draw(st.integers(1, 4))):
        at = shoff + data.draw(st.integers(0, shnum * 64 - 1))
        blob[at] = data.draw(st.integers(0, 255))
    _check_mutant(bytes(blob))


@pytest.mark.skipif(toy_kernel() is None, reason="the toy kernel cannot be built yet")
def test_toy_kernel_loads() -> None:
    toy = load_image(toy_kernel())
    assert toy.module == "vmlinux" and toy.functions
    assert toy.symbol("KSIM_TASK_PID_OFFSET")


def test_a_bzimage_without_an_elf_payload_is_refused():
    import lzma

    from ksim.image.bzimage import decompress_bzimage

    with pytest.raises(MalformedImage):
        decompress_bzimage(b"MZ" + bytes(64))
    not_elf = lzma.compress(b"not a kernel", format=lzma.FORMAT_XZ)
    with pytest.raises(MalformedImage):
        decompress_bzimage(b"setup code" + not_elf)
    elf = b"\x7fELF" + bytes(60)
    assert decompress_bzimage(b"setup" + not_elf + lzma.compress(elf, format=lzma.FORMAT_XZ)) == elf


def test_a_module_laid_out_past_the_top_of_the_address_space_is_refused(tmp_path: Path) -> None:
    """Sections of a .o laid out from the module area run past 2**64 (a 2 GiB .bss
    ahead of a function): a MalformedImage, not addresses the analysis cannot store."""
    src = tmp_path / "big.s"
    src.write_text('\t.section .bss.big,"aw",@nobits\nbig:\t.zero 0x80000000\n'
                   '\t.section .text.after,"ax",@progbits\n\t.globl f\n\t.type f,@function\n'
                   'f:\tret\n\t.size f, .-f\n')
    obj = tmp_path / "big.o"
    subprocess.run(["gcc", "-c", str(src), "-o", str(obj)], check=True)
    with pytest.raises(MalformedImage, match="top of the address space"):
        load_image(obj)
    src.write_text(src.read_text().replace("0x80000000", "0x1000"))  # the same, in reach
    subprocess.run(["gcc", "-c", str(src), "-o", str(obj)], check=True)
    assert [f.name for f in load_image(obj).functions] == ["f"]
