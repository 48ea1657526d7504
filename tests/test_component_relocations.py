"""Linking components: every relocation type each architecture's table applies,
checked word by word against GNU ld linking the same object at the same
addresses, and by hand for a few (annotated); and the refusals (an unknown type,
out of reach, misaligned, another architecture's object) before anything moves.

The objects are assembled with the real toolchains (gcc, aarch64-linux-gnu-gcc)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import needs_image
from elftools.elf.elffile import ELFFile

from ksim import components
from ksim.arch import get_arch
from ksim.components import RelocatableObject
from ksim.errors import ComponentUnsupported, LinkError
from ksim.kapi import Manager

A64 = get_arch("aarch64").component_toolchain
X64 = get_arch("x86_64").component_toolchain
assert A64 is not None and X64 is not None

#: where the tests place the AArch64 object, and the symbols it refers to
BASE = 0xFFFF800008010000
NEAR = BASE + 0x2000                 # in every branch's reach (TBZ: +-32 KB)
FAR = BASE + 0x76543210              # in ADRP's +-4 GB only; 16-byte aligned
SMALL = 0x12345678                   # fits ABS32

#: one instruction or datum per relocation type R_AARCH64_* 257..299 the table has
A64_SOURCE = """
	.text
	.globl	f
	.type	f, %function
f:
	adrp	x0, far				// 0x00 ADR_PREL_PG_HI21 (275)
	add	x0, x0, :lo12:far		// 0x04 ADD_ABS_LO12_NC (277)
	ldrb	w1, [x0, :lo12:far+1]		// 0x08 LDST8_ABS_LO12_NC (278)
	ldrh	w1, [x0, :lo12:far+2]		// 0x0c LDST16_ABS_LO12_NC (284)
	ldr	w1, [x0, :lo12:far+4]		// 0x10 LDST32_ABS_LO12_NC (285)
	ldr	x1, [x0, :lo12:far+8]		// 0x14 LDST64_ABS_LO12_NC (286)
	ldr	q1, [x0, :lo12:far+16]		// 0x18 LDST128_ABS_LO12_NC (299)
	adr	x2, near			// 0x1c ADR_PREL_LO21 (274)
	bl	near				// 0x20 CALL26 (283)
	b	near				// 0x24 JUMP26 (282)
	b.eq	near				// 0x28 CONDBR19 (280)
	cbz	x0, near			// 0x2c CONDBR19
	tbz	x0, #3, near			// 0x30 TSTBR14 (279)
	adrp	x3, table			// 0x34 against the .data section
	add	x3, x3, :lo12:table		// 0x38
	ret					// 0x3c
	.data
	.p2align 3
table:
	.quad	far				// ABS64 (257)
	.quad	f				// ABS64 against .text
	.word	small				// ABS32 (258)
	.word	near - .			// PREL32 (261)
"""

X64_SOURCE = """
	.text
	.globl	f
	.type	f, @function
f:
	call	near@PLT			# PLT32 (4)
	call	near				# PC32 (2), as written by hand
	movq	$far, %rax			# 32S (11)
	movl	$small, %eax			# 32 (10)
	leaq	table(%rip), %rdx		# PC32 against .data
	ret
	.data
	.p2align 3
table:
	.quad	far				# 64 (1)
	.quad	f
"""


def _assemble(tc, source: str, tmp_path: Path, name: str = "obj") -> bytes:
    if shutil.which(tc.compiler) is None:
        pytest.skip(f"{tc.compiler} is not installed (apt-get install {tc.package})")
    src, obj = tmp_path / f"{name}.S", tmp_path / f"{name}.o"
    src.write_text(source)
    subprocess.run([tc.compiler, "-c", "-o", str(obj), str(src)], check=True)
    return obj.read_bytes()


def _ld_sections(tc, obj: bytes, tmp_path: Path, sections: dict[str, int],
                 symbols: dict[str, int]) -> dict[str, bytes]:
    """GNU ld's bytes of each section, linked at the same addresses."""
    ld = tc.compiler.removesuffix("gcc") + "ld"
    (tmp_path / "in.o").write_bytes(obj)
    out = tmp_path / "ld.elf"
    args = [ld, "-static", "-nostdlib", "-e", "0", "-o", str(out), str(tmp_path / "in.o")]
    args += [f"--section-start={n}={a:#x}" for n, a in sections.items()]
    args += [f"--defsym={n}={a:#x}" for n, a in symbols.items()]
    subprocess.run(args, check=True, capture_output=True)
    elf = ELFFile(out.open("rb"))
    return {n: elf.get_section_by_name(n).data() for n in sections}


def _relocation_types(obj: bytes) -> set[int]:
    import io

    elf = ELFFile(io.BytesIO(obj))
    return {r["r_info_type"] for s in elf.iter_sections() if s.name.startswith(".rela")
            for r in s.iter_relocations()}


def _words(blob: bytes, off: int, n: int) -> list[int]:
    return [int.from_bytes(blob[off + 4 * i:off + 4 * i + 4], "little") for i in range(n)]


# --- AArch64 -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def a64_obj(tmp_path_factory) -> bytes:
    return _assemble(A64, A64_SOURCE, tmp_path_factory.mktemp("a64"))


A64_SYMBOLS = {"near": NEAR, "far": FAR, "small": SMALL}


def test_the_object_has_every_aarch64_relocation_type_the_table_applies(a64_obj):
    assert A64 is not None
    assert _relocation_types(a64_obj) == set(A64.relocations)


def test_aarch64_relocations_equal_gnu_ld(a64_obj, tmp_path):
    linked = RelocatableObject(a64_obj, A64).link(BASE, A64_SYMBOLS.__getitem__)
    ld = _ld_sections(A64, a64_obj, tmp_path, linked.sections, A64_SYMBOLS)
    for name, data in ld.items():
        off = linked.sections[name] - BASE
        assert linked.blob[off:off + len(data)].hex() == data.hex(), name
    assert linked.symbols == {"f": BASE}
    assert linked.functions == frozenset({BASE})


def test_aarch64_relocated_words_by_hand(a64_obj):
    linked = RelocatableObject(a64_obj, A64).link(BASE, A64_SYMBOLS.__getitem__)
    assert [hex(w) for w in _words(linked.blob, 0, 13)] == [hex(w) for w in [
        0xF03B2A00,   # adrp x0, far: Page(far) - Page(P) = 0x76543 pages, immlo 3, immhi 0x1d950
        0x91084000,   # add x0, x0, #0x210
        0x39484401,   # ldrb w1, [x0, #0x211]      (imm12 = 0x211)
        0x79442401,   # ldrh w1, [x0, #0x212]     (imm12 = 0x212 / 2)
        0xB9421401,   # ldr w1, [x0, #0x214]      (/ 4)
        0xF9410C01,   # ldr x1, [x0, #0x218]      (/ 8)
        0x3DC08801,   # ldr q1, [x0, #0x220]      (/ 16)
        0x1000FF22,   # adr x2, near: 0x1fe4 from 0x1c, immlo 0, immhi 0x7f9
        0x940007F8,   # bl near: (0x2000 - 0x20) / 4
        0x140007F7,   # b near
        0x5400FEC0,   # b.eq near: imm19 0x7f6
        0xB400FEA0,   # cbz x0, near: imm19 0x7f5
        0x3618FE80,   # tbz x0, #3, near: imm14 0x7f4
    ]]
    data = linked.sections[".data"] - BASE
    assert int.from_bytes(linked.blob[data:data + 8], "little") == FAR
    assert int.from_bytes(linked.blob[data + 8:data + 16], "little") == BASE
    assert int.from_bytes(linked.blob[data + 16:data + 20], "little") == SMALL
    place = linked.sections[".data"] + 20
    assert int.from_bytes(linked.blob[data + 20:data + 24], "little", signed=True) == NEAR - place


@pytest.mark.parametrize("source,symbols,kind", [
    ("bl ext", {"ext": BASE + (128 << 20)}, "R_AARCH64_CALL26"),
    ("b ext", {"ext": BASE - (128 << 20) - 4}, "R_AARCH64_JUMP26"),
    ("b.ne ext", {"ext": BASE + (1 << 20)}, "R_AARCH64_CONDBR19"),
    ("tbnz w0, #1, ext", {"ext": BASE + (32 << 10)}, "R_AARCH64_TSTBR14"),
    ("adr x0, ext", {"ext": BASE + (1 << 20)}, "R_AARCH64_ADR_PREL_LO21"),
    ("adrp x0, ext", {"ext": BASE + (4 << 30)}, "R_AARCH64_ADR_PREL_PG_HI21"),
    (".data\n.word ext", {"ext": FAR}, "R_AARCH64_ABS32"),
])
def test_aarch64_out_of_reach_is_refused(tmp_path, source, symbols, kind):
    obj = RelocatableObject(_assemble(A64, f".text\nf: {source}\n", tmp_path), A64)
    with pytest.raises(LinkError, match=f"{kind} against 'ext' .* out of reach"):
        obj.link(BASE, symbols.__getitem__)
    # one step nearer (a branch's unit, ADRP's page) it links
    step = -4 if "ADRP" not in kind else -4096
    nearer = {n: a + step if a > BASE else a - step for n, a in symbols.items()}
    if kind != "R_AARCH64_ABS32":
        obj.link(BASE, nearer.__getitem__)


def test_a_misaligned_scaled_offset_is_refused(tmp_path):
    obj = RelocatableObject(_assemble(A64, ".text\nf: ldr x1, [x0, :lo12:ext+4]\n", tmp_path), A64)
    with pytest.raises(LinkError, match="LDST64_ABS_LO12_NC .* not a multiple of 8"):
        obj.link(BASE, {"ext": FAR}.__getitem__)


def test_an_unknown_relocation_type_is_refused_by_name(tmp_path):
    obj = _assemble(A64, ".text\nf: movz x0, #:abs_g0:ext\n", tmp_path)
    with pytest.raises(LinkError, match=r"relocation R_AARCH64_MOVW_UABS_G0 \(263\) is not "
                                        r"supported.*R_AARCH64_CALL26 \(283\)"):
        RelocatableObject(obj, A64)


def test_refusals_on_the_arm64_toy_leave_the_patch_area_alone(tmp_path):
    needs_image("toy-arm64")
    with Manager.attach("unicorn:toy-arm64") as m:
        code = m.target._code
        before, used = m.target.read(code.start, 256), code.allocated()
        text = m.text_snapshot()
        with pytest.raises(LinkError, match="R_AARCH64_MOVW_UABS_G0"):
            components.load(m, _assemble(A64, ".text\nf: movz x0, #:abs_g0:jiffies\n", tmp_path))
        with pytest.raises(LinkError, match="EM_AARCH64 relocatable object .* not EM_X86_64"):
            components.load(m, _assemble(X64, ".text\nf: ret\n", tmp_path, "x86"))
        with pytest.raises(LinkError, match="unresolved symbols: no_such_symbol"):
            components.load(m, _assemble(A64, ".text\nf: bl no_such_symbol\n", tmp_path, "u"))
        assert m.target.read(code.start, 256) == before and code.allocated() == used
        assert m.text_snapshot() == text


def test_a_component_reaches_kernel_data_through_adrp(tmp_path):
    """Built from C for the arm64 toy: ADRP + LDR of a kernel variable, linked
    where it was loaded, reads the kernel's own address."""
    needs_image("toy-arm64")
    with Manager.attach("unicorn:toy-arm64") as m:
        comp = components.load(m, components.build_c(
            "extern unsigned long jiffies;\nunsigned long *where(void) { return &jiffies; }\n",
            arch=m.arch, name="where"))
        at = comp.symbol("where")
        insns = list(m.arch.decode(m.target.read(at, 8), at))
        assert [i.mnemonic for i in insns] == ["adrp", "add"]
        jiffies = m.target.image.address_of("jiffies")
        assert insns[0].pc_ref == jiffies & ~0xFFF
        assert f"#{jiffies & 0xFFF:#x}" in insns[1].op_str
        comp.unload()


# --- x86-64 ------------------------------------------------------------------------------
def test_x86_64_relocations_equal_gnu_ld(tmp_path):
    base = 0xFFFFFFFF82000000
    symbols = {"near": base + 0x1000, "far": 0xFFFFFFFF81234560, "small": SMALL}
    obj = _assemble(X64, X64_SOURCE, tmp_path)
    assert _relocation_types(obj) == set(X64.relocations)
    linked = RelocatableObject(obj, X64).link(base, symbols.__getitem__)
    ld = _ld_sections(X64, obj, tmp_path, linked.sections, symbols)
    for name, data in ld.items():
        off = linked.sections[name] - base
        assert linked.blob[off:off + len(data)].hex() == data.hex(), name
    # e8 rel32: near - (base + 5)
    assert linked.blob[:5] == b"\xe8" + (0x1000 - 5).to_bytes(4, "little")
    with pytest.raises(LinkError, match="R_X86_64_32 against 'small'"):
        RelocatableObject(obj, X64).link(base, {**symbols, "small": 2**32}.__getitem__)


def test_a_missing_compiler_names_its_debian_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ComponentUnsupported,
                       match="aarch64-linux-gnu-gcc is not installed.*gcc-aarch64-linux-gnu"):
        components.build_c("int f(void) { return 1; }", arch="aarch64", name="nogcc")
