"""The kernel's address-keyed tables (ksim.image.tables) read from real images.

Hand-built objects (gcc) check every format and the relocation of a .ko's tables
against addresses known from their labels; the Debian kernel and two of its modules
check the result on real files, decoding the instruction at every recorded address.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from ksim import images
from ksim.arch.x86_64.reader import decode_one
from ksim.bench import kernel as debian
from ksim.errors import MalformedImage
from ksim.image import Image, load_image, load_kallsyms
from ksim.image.tables import KernelTables, TextRef, kernel_tables

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ld") is None,
                               reason="gcc and ld build the hand-made objects")

# One function with a site of every kind, each entry written the way the kernel's
# macros write it (arch/x86/include/asm/bug.h, asm/extable.h, asm/jump_label.h,
# asm/static_call.h, the compiler's __mcount_loc, NOKPROBE_SYMBOL), a second one
# in .init.text, and one bug entry pointing at data (to be dropped).
TABLES_S = r"""
    .text
    .globl f_sites
    .type f_sites, @function
f_sites:
mcount_site:
    call __fentry__
warn_site:
    ud2
    .pushsection __bug_table, "aw"
    .long warn_site - .
    .long 0
    .short 12
    .short 0x0901               /* BUGFLAG_WARNING | BUGFLAG_TAINT(TAINT_WARN) */
    .popsection
bug_site:
    ud2
    .pushsection __bug_table, "aw"
    .long bug_site - .
    .long 0
    .short 13
    .short 0
    .popsection
extable_site:
    movq (%rdi), %rax
    .pushsection __ex_table, "a"
    .long extable_site - .
    .long fixup - .
    .long 0
    .popsection
jump_site:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
    .pushsection __jump_table, "aw"
    .balign 8
    .long jump_site - .
    .long fixup - .
    .quad some_key - .
    .popsection
static_call_site:
    call other
    .pushsection .static_call_sites, "aw"
    .long static_call_site - .
    .long some_key - .
    .popsection
fixup:
    ret
    .size f_sites, . - f_sites
    .pushsection __mcount_loc, "a"
    .quad mcount_site
    .popsection
    .pushsection _kprobe_blacklist, "aw"
    .quad f_sites
    .popsection

    .section .init.text, "ax"
    .globl f_init
    .type f_init, @function
f_init:
init_bug_site:
    ud2
    .pushsection __bug_table, "aw"
    .long init_bug_site - .
    .long 0
    .short 14
    .short 0
    .popsection
    ret
    .size f_init, . - f_init

    .data
data_label:
    .quad 0
    .pushsection __bug_table, "aw"
    .long data_label - .
    .long 0
    .short 15
    .short 0
    .popsection
"""

# A vmlinux linked from the same object: ld defines __start___bug_table and
# __stop___bug_table (orphan sections named like C identifiers) when referenced.
LINKED_S = r"""
    .data
    .quad __start___bug_table, __stop___bug_table
"""

TRUNCATED_S = r"""
    .text
f:  ud2
    ret
    .pushsection __bug_table, "aw"
    .long f - .
    .long 0
    .short 1                    /* 10 bytes: the flags field is missing */
    .popsection
"""

EXPECTED = {
    TextRef.WARN: ["warn_site"],
    TextRef.BUG: ["bug_site", "init_bug_site"],
    TextRef.EXTABLE: ["extable_site"],
    TextRef.FTRACE: ["mcount_site"],
    TextRef.JUMP_LABEL: ["jump_site"],
    TextRef.STATIC_CALL: ["static_call_site"],
}


def _assemble(tmp: Path, name: str, source: str) -> Path:
    src, obj = tmp / f"{name}.S", tmp / f"{name}.o"
    src.write_text(source)
    subprocess.run(["gcc", "-c", str(src), "-o", str(obj)], check=True, capture_output=True)
    return obj


def _check_hand_built(image: Image) -> None:
    tables = image.tables
    for kind, labels in EXPECTED.items():
        assert tables.addresses(kind) == tuple(sorted(image.address_of(n) for n in labels)), kind
    f_sites = image.function("f_sites")
    assert tables.kprobe_blacklist == ((f_sites.address, f_sites.end),)
    assert tables.counts() == {"warn": 1, "bug": 2, "extable": 1, "ftrace": 1, "jump_label": 1,
                               "static_call": 1, "kprobe_blacklist": 1}
    warn = image.address_of("warn_site")
    assert tables.refs_in(warn, warn + 2) == {TextRef.WARN}
    assert tables.refs_in(f_sites.address, f_sites.end) == frozenset(TextRef)
    f_init = image.function("f_init")
    assert tables.refs_in(f_init.address, f_init.end) == {TextRef.BUG}
    assert tables.refs_in(warn + 1, image.address_of("bug_site")) == frozenset()


@needs_gcc
def test_relocatable_object_tables(tmp_path: Path) -> None:
    """A .ko-style object: the table sections hold zeros until their relocations apply."""
    obj = _assemble(tmp_path, "sites", TABLES_S)
    image = load_image(obj)
    bug_table = next(s for s in image.sections if s.name == "__bug_table")
    assert bug_table.size == 4 * 12 and bug_table.data != bytes(bug_table.size)
    _check_hand_built(image)


@needs_gcc
def test_linked_kernel_tables(tmp_path: Path) -> None:
    """The same sites linked into an executable: symbol-bounded and section tables."""
    objs = [_assemble(tmp_path, "sites", TABLES_S), _assemble(tmp_path, "linked", LINKED_S)]
    elf = tmp_path / "vmlinux"
    subprocess.run(["ld", "-nostdlib", "-static", "-Ttext=0xffffffff81000000", "-e", "f_sites",
                    "--defsym=__fentry__=0xffffffff81000000", "--defsym=other=0xffffffff81000000",
                    "--defsym=some_key=0xffffffff81000000", *map(str, objs), "-o", str(elf)],
                   check=True, capture_output=True)
    image = load_image(elf)
    assert image.address_of("__stop___bug_table") - image.address_of("__start___bug_table") == 48
    _check_hand_built(image)


@needs_gcc
def test_truncated_table_is_malformed(tmp_path: Path) -> None:
    image = load_image(_assemble(tmp_path, "truncated", TRUNCATED_S))
    with pytest.raises(MalformedImage, match="__bug_table"):
        kernel_tables(image)


def test_toy_kernel_has_no_tables() -> None:
    image = load_image(images.path("toy"))
    assert image.tables is KernelTables.EMPTY and image.tables is image.tables
    assert set(image.tables.counts().values()) == {0}
    func = image.functions[0]
    assert image.tables.refs_in(func.address, func.end) == frozenset()


def test_lookup_semantics() -> None:
    tables = KernelTables(sites={TextRef.WARN: [0x30, 0x10, 0x10], TextRef.FTRACE: (0x20,),
                                 TextRef.JUMP_LABEL: [0x20]},
                          kprobe_blacklist=((0x100, 0x180), (0x0, 0x40)))
    assert tables.addresses(TextRef.WARN) == (0x10, 0x30)
    assert tables.addresses(TextRef.BUG) == ()
    assert tables.kprobe_blacklist == ((0x0, 0x40), (0x100, 0x180))
    assert tables.counts() == {"warn": 2, "bug": 0, "extable": 0, "ftrace": 1, "jump_label": 1,
                               "static_call": 0, "kprobe_blacklist": 2}
    assert tables.refs_in(0x10, 0x11) == {TextRef.WARN}
    assert tables.refs_in(0x11, 0x20) == frozenset()  # end is exclusive
    assert tables.refs_in(0x11, 0x21) == {TextRef.FTRACE, TextRef.JUMP_LABEL}
    assert tables.refs_in(0, 0x100) == {TextRef.WARN, TextRef.FTRACE, TextRef.JUMP_LABEL}
    assert tables.refs_in(0x31, 0x1000) == frozenset()
    assert tables.refs_in(0x30, 0x30) == frozenset()
    assert KernelTables.EMPTY.refs_in(0, 1 << 64) == frozenset()
    same = KernelTables(sites={TextRef.WARN: (0x10, 0x30), TextRef.FTRACE: [0x20],
                               TextRef.JUMP_LABEL: (0x20,)},
                        kprobe_blacklist=((0x0, 0x40), (0x100, 0x180)))
    assert same == tables and hash(same) == hash(tables)
    assert "warn=2" in repr(tables)


# --- the Debian kernel ------------------------------------------------------------

#: per kernel ABI: what the tables of vmlinux, e100.ko and ext4.ko hold (every entry
#: resolves into text, so these are the tables' entry counts too)
COUNTS = {
    "6.1.0-56-amd64": {
        "vmlinux": {"warn": 5796, "bug": 1947, "extable": 600, "ftrace": 40521,
                    "jump_label": 6299, "static_call": 4085, "kprobe_blacklist": 178},
        "e100": {"warn": 2, "bug": 0, "extable": 0, "ftrace": 73, "jump_label": 0,
                 "static_call": 0, "kprobe_blacklist": 0},
        "ext4": {"warn": 177, "bug": 359, "extable": 0, "ftrace": 854, "jump_label": 249,
                 "static_call": 382, "kprobe_blacklist": 0},
    },
}


@pytest.fixture(scope="module")
def kernel(debian_kernel):
    return debian_kernel


@pytest.fixture(scope="module")
def vmlinux(kernel: debian.DebianKernel) -> Image:
    return load_kallsyms(kernel.kallsyms, kernel.vmlinux)


def _insn(image: Image, addr: int):
    sec = image.section_at(addr)
    assert sec is not None and sec.executable, hex(addr)
    return decode_one(image.read(addr, min(15, sec.end - addr)), addr)


def _check_sites(image: Image, tables: KernelTables) -> None:
    """What every recorded address must hold, whatever the image."""
    for kind in (TextRef.WARN, TextRef.BUG):
        for addr in tables.addresses(kind):
            assert image.read(addr, 2) == b"\x0f\x0b", (kind, hex(addr))  # ud2
    for addr in tables.addresses(TextRef.EXTABLE):
        assert image.is_text(addr) and image.function_at(addr) is not None, hex(addr)
        _insn(image, addr)
    for addr in tables.addresses(TextRef.JUMP_LABEL):
        insn = _insn(image, addr)
        assert (insn.mnemonic, insn.size) in {("nop", 2), ("nop", 5), ("jmp", 2), ("jmp", 5)}, (
            hex(addr), insn)
    for addr in tables.addresses(TextRef.STATIC_CALL):
        insn = _insn(image, addr)  # a call, or a jmp where the call is a tail call
        assert insn.mnemonic in ("call", "jmp") and insn.size == 5, (hex(addr), insn)
    for start, end in tables.kprobe_blacklist:
        func = image.function_at(start)
        assert func is not None and (func.address, func.end) == (start, end)


def test_vmlinux_tables(kernel: debian.DebianKernel, vmlinux: Image) -> None:
    t0 = time.perf_counter()
    tables = kernel_tables(vmlinux)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"kernel_tables took {elapsed:.2f} s"
    expected = COUNTS.get(kernel.abi, {}).get("vmlinux")
    if expected is not None:
        assert tables.counts() == expected
    assert min(tables.counts().values()) > 0
    _check_sites(vmlinux, tables)


def test_vmlinux_ftrace_sites(vmlinux: Image) -> None:
    """The Debian vmlinux keeps ``call __fentry__`` (ftrace turns them into nops at
    boot); almost all open a function.  The rest are the __fentry__ of weak functions
    whose strong definition won: their code stays, their symbol does not, so kallsyms
    puts them inside the function before (ftrace marks such records disabled:
    test_for_valid_rec, kernel/trace/ftrace.c)."""
    fentry = vmlinux.address_of("__fentry__")
    inside = 0
    for addr in vmlinux.tables.addresses(TextRef.FTRACE):
        raw = vmlinux.read(addr, 5)
        assert raw == b"\x0f\x1f\x44\x00\x00" or (
            raw[0] == 0xE8 and addr + 5 + int.from_bytes(raw[1:], "little", signed=True) == fentry
        ), hex(addr)
        func = vmlinux.function_at(addr)
        assert func is not None, hex(addr)
        inside += func.address != addr
    assert inside < len(vmlinux.tables.addresses(TextRef.FTRACE)) // 50


def test_image_tables_property(vmlinux: Image) -> None:
    tables = vmlinux.tables
    assert tables is vmlinux.tables
    func = vmlinux.function("do_one_initcall")
    refs = tables.refs_in(func.address, func.end)
    assert TextRef.FTRACE in refs and tables.refs_in(func.address, func.address + 1) == {TextRef.FTRACE}


def test_running_kernel_image(vmlinux: Image, kernel: debian.DebianKernel) -> None:
    """kallsyms plus a memory reader (the live target's image): the tables come from
    memory, except those in init memory, which a running kernel has freed."""
    reads: list[tuple[int, int]] = []

    def reader(addr: int, size: int) -> bytes:
        reads.append((addr, size))
        return vmlinux.read(addr, size)

    live = load_kallsyms(kernel.kallsyms, reader=reader)
    tables = kernel_tables(live)
    init = (live.address_of("__init_begin"), live.address_of("__init_end"))
    assert reads and all(not init[0] <= addr < init[1] for addr, _size in reads)
    full = vmlinux.tables
    for kind in TextRef:
        want = () if kind is TextRef.FTRACE else full.addresses(kind)
        assert tables.addresses(kind) == want, kind
    assert tables.kprobe_blacklist == ()


@pytest.mark.parametrize("name", ["e100", "ext4"])
def test_module_tables(kernel: debian.DebianKernel, name: str) -> None:
    image = load_image(getattr(kernel, name))
    tables = image.tables
    expected = COUNTS.get(kernel.abi, {}).get(name)
    if expected is not None:
        assert tables.counts() == expected
    assert tables.counts()["ftrace"] > 0 and tables.counts()["warn"] > 0
    _check_sites(image, tables)
    # relocations are not applied to code: the call __fentry__ reads e8 00 00 00 00,
    # and it opens its function
    for addr in tables.addresses(TextRef.FTRACE):
        assert image.read(addr, 5) == b"\xe8\x00\x00\x00\x00", hex(addr)
        func = image.function_at(addr)
        assert func is not None and func.address == addr, hex(addr)
    # the sites are spread over the module's text sections
    sections = Counter(image.section_at(a).name for kind in TextRef for a in tables.addresses(kind))
    assert ".text" in sections


def test_packed_tables_come_back_the_same(vmlinux: Image) -> None:
    """What an analysis store keeps of a kernel's tables (KernelTables.packed) gives
    the same tables back (KernelTables.merged): Debian's vmlinux, every kind; what is
    not sorted, unique addresses with masks of kinds is refused."""
    tables = vmlinux.tables
    addrs, masks, blacklist = tables.packed()
    assert len(addrs) > 10000 and blacklist
    again = KernelTables.merged(addrs, masks, blacklist)
    assert again == tables and hash(again) == hash(tables) and again.counts() == tables.counts()
    for kind in TextRef:
        assert again.addresses(kind) == tables.addresses(kind)
    assert again.refs_at(addrs[100], addrs[200]) == tables.refs_at(addrs[100], addrs[200])
    for bad in ((addrs[::-1], masks[::-1]), (addrs, [0] * len(masks)), (addrs[:-1], masks)):
        with pytest.raises(ValueError):
            KernelTables.merged(*bad, blacklist)
