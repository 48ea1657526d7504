"""ksim.btf: the BTF reader against bpftool, on the toy kernels, the Debian testbed's
vmlinux and one of its modules (split BTF); hand-built blobs for the kinds and
encodings those lack and for malformed input; where BTF comes from on each target.

bpftool (``bpftool btf dump file F format raw``, Debian's bpftool package) is the
oracle: every type's kind, name, size, references, members and offsets must be what
it prints.  Offsets of known members are checked against bpftool's numbers (and
against the toy's own absolute symbols), never against numbers written here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_image
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksim import images
from ksim.btf import BTF, BTFError, Type, cache_dir, image_btf, kernel_btf
from ksim.btf.elf import btf_section
from ksim.btf.reader import KIND_NUMBER
from ksim.errors import AuthError, ProtocolError, TargetError
from ksim.live.testing import connect, testbed  # noqa: F401 - a fixture

TESTBED = Path.home() / ".cache" / "ksim" / "testbed"


def _kernel_files(abi: str) -> tuple[Path, Path]:
    """The testbed kernel ``abi``'s ELF vmlinux and one of its modules (virtio_net)."""
    return (TESTBED / f"vmlinux-{abi}",
            TESTBED / f"linux-{abi}" / "lib" / "modules" / f"{abi}-amd64" / "kernel" / "drivers"
            / "net" / "virtio_net.ko")


def _testbed_abi() -> str | None:
    from ksim.live import testbed as tb

    return tb.recorded_abi()


#: the kernel the testbed's cache holds (the newest Debian ABI when it was prepared);
#: found again once testbed_kernel has prepared a new machine's cache
VMLINUX, MODULE = _kernel_files(_testbed_abi() or "none")
BPFTOOL = shutil.which("bpftool") or next(
    (p for p in ("/usr/sbin/bpftool", "/sbin/bpftool") if Path(p).exists()), None)

needs_bpftool = pytest.mark.skipif(BPFTOOL is None, reason="needs bpftool (apt-get install bpftool)")
needs_vmlinux = pytest.mark.usefixtures("testbed_kernel")
needs_module = pytest.mark.usefixtures("testbed_kernel")


@pytest.fixture(scope="session")
def testbed_kernel() -> None:
    """The testbed's kernel files (its ELF vmlinux, the unpacked package's modules):
    prepared when a new machine lacks them, as `ksim testbed prepare` does; skipped
    only where no package registry answers."""
    global VMLINUX, MODULE
    if VMLINUX.exists() and MODULE.exists():
        return
    from ksim.errors import KsimError
    from ksim.live import testbed as tb

    try:
        tb.prepare(progress=lambda m: print(f"testbed: {m}", flush=True))
    except KsimError as exc:
        pytest.skip(f"the testbed's kernel cannot be prepared: {exc}")
    VMLINUX, MODULE = _kernel_files(_testbed_abi() or "none")
    if not (VMLINUX.exists() and MODULE.exists()):
        pytest.skip(f"the testbed's kernel files are absent after prepare ({VMLINUX}, {MODULE})")


# --- the oracle: bpftool's raw dump ---------------------------------------------------
_TYPE_LINE = re.compile(r"\[(\d+)\] (\w+) '([^']*)'(.*)")
_ITEM_LINE = re.compile(r"\t'([^']*)' (.*)")
_SECINFO_LINE = re.compile(r"\ttype_id=(\d+) offset=(\d+) size=(\d+)")
_PAIR = re.compile(r"(\w+)=([^\s,]+)")


def bpftool_raw(path: Path, base: Path | None = None) -> dict[int, dict[str, Any]]:
    """bpftool's raw dump of the BTF in ``path`` (an ELF or a raw blob), by type id:
    kind, name ("" for anonymous), its key=value fields and its items."""
    assert BPFTOOL is not None
    cmd = [BPFTOOL, "btf", "dump", *(["-B", str(base)] if base else []), "file", str(path),
           "format", "raw"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    types: dict[int, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in out.splitlines():
        m = _TYPE_LINE.fullmatch(line)
        if m:
            name = "" if m[3] == "(anon)" else m[3]
            current = {"kind": m[2].lower(), "name": name, "fields": dict(_PAIR.findall(m[4])),
                       "items": []}
            types[int(m[1])] = current
            continue
        s = _SECINFO_LINE.match(line)
        if s:
            current["items"].append(tuple(int(x) for x in s.groups()))
            continue
        i = _ITEM_LINE.fullmatch(line)
        assert i, f"bpftool printed a line this test cannot read: {line!r}"
        current["items"].append(("" if i[1] == "(anon)" else i[1], dict(_PAIR.findall(i[2]))))
    return types


def _val(text: str) -> int:
    return int(text.removesuffix("ULL").removesuffix("LL"))


_INT_ENCODING = {"(none)": (False, False, False), "SIGNED": (True, False, False),
                 "CHAR": (False, True, False), "BOOL": (False, False, True)}


def same_as_bpftool(t: Type, o: dict[str, Any]) -> None:
    """``t`` is what bpftool says type ``t.id`` is."""
    f, items = o["fields"], o["items"]
    assert (t.kind, t.name) == (o["kind"], o["name"]), t
    kind = t.kind
    if "size" in f:
        assert t.size == int(f["size"]), t
    if kind == "int":
        assert (t.int_offset, t.bits) == (int(f["bits_offset"]), int(f["nr_bits"])), t
        assert (t.signed, t.is_char, t.is_bool) == _INT_ENCODING[f["encoding"]], t
    elif kind in ("ptr", "const", "volatile", "restrict", "typedef", "type_tag", "func", "var"):
        assert t.ref == int(f["type_id"]), t
    if kind == "array":
        assert (t.ref, t.index_type, t.nelems) == (
            int(f["type_id"]), int(f["index_type_id"]), int(f["nr_elems"])), t
    elif kind in ("struct", "union"):
        assert len(t.fields) == int(f["vlen"]) == len(items), t
        for field, (name, m) in zip(t.fields, items, strict=True):
            assert (field.name, field.type_id, field.bit_offset, field.bitfield_size) == (
                name, int(m["type_id"]), int(m["bits_offset"]), int(m.get("bitfield_size", 0))), t
    elif kind in ("enum", "enum64"):
        assert t.signed == (f["encoding"] == "SIGNED"), t
        assert list(t.values) == [(name, _val(m["val"])) for name, m in items], t
    elif kind == "fwd":
        assert t.fwd_kind == f["fwd_kind"], t
    elif kind == "func":
        assert t.linkage == f["linkage"], t
    elif kind == "func_proto":
        assert t.ref == int(f["ret_type_id"]), t
        assert list(t.params) == [(name, int(m["type_id"])) for name, m in items], t
    elif kind == "var":
        assert t.linkage == f["linkage"], t
    elif kind == "datasec":
        assert list(t.entries) == items, t
    elif kind == "decl_tag":
        assert (t.ref, t.component) == (int(f["type_id"]), int(f["component_idx"])), t


def all_same_as_bpftool(btf: BTF, oracle: dict[int, dict[str, Any]]) -> None:
    assert sorted(oracle) == list(range(btf.start_id, btf.nr_types))
    for t in btf.types():
        same_as_bpftool(t, oracle[t.id])


def oracle_struct(oracle: dict[int, dict[str, Any]], name: str) -> int:
    return next(i for i, o in sorted(oracle.items()) if o["kind"] == "struct" and o["name"] == name)


def oracle_offset(oracle: dict[int, dict[str, Any]], type_id: int, name: str) -> int | None:
    """bpftool's bit offset of member ``name`` of record ``type_id``, searched through
    anonymous members (through typedefs), summing their offsets."""
    for member, m in oracle[type_id]["items"]:
        if member == name:
            return int(m["bits_offset"])
    for member, m in oracle[type_id]["items"]:
        inner = int(m["type_id"])
        while oracle[inner]["kind"] in ("typedef", "const", "volatile"):
            inner = int(oracle[inner]["fields"]["type_id"])
        if member == "" and oracle[inner]["kind"] in ("struct", "union"):
            found = oracle_offset(oracle, inner, name)
            if found is not None:
                return int(m["bits_offset"]) + found
    return None


# --- blobs built by hand ----------------------------------------------------------------
class Blob:
    """A BTF blob built type by type (btf.rst's encoding), little-endian unless asked."""

    def __init__(self, start_id: int = 1, start_str: int = 0, endian: str = "<") -> None:
        self.e = endian
        self.types = bytearray()
        self.strings = bytearray(b"\0")
        self.start_id, self.start_str = start_id, start_str
        self.count = 0

    def s(self, text: str) -> int:
        if not text:
            return 0
        at = self.strings.find(b"\0" + text.encode() + b"\0")
        if at >= 0:
            return self.start_str + at + 1
        at = len(self.strings)
        self.strings += text.encode() + b"\0"
        return self.start_str + at

    def add(self, kind: str, name: str = "", word: int = 0, vlen: int = 0, flag: bool = False,
            extra: bytes = b"") -> int:
        info = KIND_NUMBER[kind] << 24 | vlen | (1 << 31 if flag else 0)
        self.types += struct.pack(self.e + "III", self.s(name), info, word) + extra
        self.count += 1
        return self.start_id + self.count - 1

    def int(self, name: str, size: int, signed: bool = False, bits: int | None = None,
            offset: int = 0, char: bool = False, boolean: bool = False) -> int:
        enc = (1 if signed else 0) | (2 if char else 0) | (4 if boolean else 0)
        data = enc << 24 | offset << 16 | (8 * size if bits is None else bits)
        return self.add("int", name, size, extra=struct.pack(self.e + "I", data))

    def ref(self, kind: str, to: int, name: str = "") -> int:
        return self.add(kind, name, to)

    def array(self, elem: int, index: int, n: int) -> int:
        return self.add("array", extra=struct.pack(self.e + "III", elem, index, n))

    def record(self, name: str, size: int, members: list[tuple[str, int, int, int]],
               union: bool = False, flag: bool | None = None) -> int:
        flag = any(bits for *_, bits in members) if flag is None else flag
        extra = b"".join(struct.pack(self.e + "III", self.s(n), t, (bits << 24 | off) if flag else off)
                         for n, t, off, bits in members)
        return self.add("union" if union else "struct", name, size, len(members), flag, extra)

    def enum(self, name: str, values: list[tuple[str, int]], signed: bool = False,
             size: int = 4) -> int:
        extra = b"".join(struct.pack(self.e + ("Ii" if signed else "II"), self.s(n), v)
                         for n, v in values)
        return self.add("enum", name, size, len(values), signed, extra)

    def enum64(self, name: str, values: list[tuple[str, int]], signed: bool = False) -> int:
        extra = b"".join(struct.pack(self.e + "III", self.s(n), v & 0xFFFFFFFF, (v >> 32) & 0xFFFFFFFF)
                         for n, v in values)
        return self.add("enum64", name, 8, len(values), signed, extra)

    def proto(self, ret: int, params: list[tuple[str, int]]) -> int:
        extra = b"".join(struct.pack(self.e + "II", self.s(n), t) for n, t in params)
        return self.add("func_proto", "", ret, len(params), extra=extra)

    def func(self, name: str, proto: int, linkage: int = 1) -> int:
        return self.add("func", name, proto, vlen=linkage)

    def var(self, name: str, type_id: int, linkage: int = 1) -> int:
        return self.add("var", name, type_id, extra=struct.pack(self.e + "I", linkage))

    def datasec(self, name: str, size: int, entries: list[tuple[int, int, int]]) -> int:
        extra = b"".join(struct.pack(self.e + "III", *e) for e in entries)
        return self.add("datasec", name, size, len(entries), extra=extra)

    def decl_tag(self, name: str, type_id: int, component: int) -> int:
        return self.add("decl_tag", name, type_id, extra=struct.pack(self.e + "i", component))

    def bytes(self, **header: int) -> bytes:
        h = {"magic": 0xEB9F, "version": 1, "flags": 0, "hdr_len": 24, "type_off": 0,
             "type_len": len(self.types), "str_off": len(self.types), "str_len": len(self.strings)}
        h.update(header)
        return struct.pack(self.e + "HBBIIIII", *h.values()) + bytes(self.types) + bytes(self.strings)


def every_kind(endian: str = "<") -> tuple[bytes, dict[str, int]]:
    """A blob with a type of every kind and the encodings the kernel's BTF lacks:
    the legacy bitfield encoding, signed enums, enum64, tags, variables, varargs."""
    b = Blob(endian=endian)
    ids: dict[str, int] = {}
    ids["int"] = b.int("int", 4, signed=True)
    ids["uint"] = b.int("unsigned int", 4)
    ids["char"] = b.int("char", 1, char=True)
    ids["bool"] = b.int("_Bool", 1, boolean=True)
    ids["long"] = b.int("long int", 8, signed=True)
    ids["u64"] = b.ref("typedef", b.int("long long unsigned int", 8), "u64")
    ids["float"] = b.add("float", "double", 8)
    ids["char_p"] = b.ref("ptr", ids["char"])
    ids["const_char"] = b.ref("const", ids["char"])
    ids["const_char_p"] = b.ref("ptr", ids["const_char"])
    ids["char_p_const"] = b.ref("const", ids["char_p"])
    ids["volatile_int"] = b.ref("volatile", ids["int"])
    ids["restrict_p"] = b.ref("restrict", ids["char_p"])
    ids["comm"] = b.array(ids["char"], ids["int"], 16)
    ids["matrix"] = b.array(b.array(ids["int"], ids["int"], 3), ids["int"], 2)
    ids["matrix_p"] = b.ref("ptr", ids["matrix"])
    ids["fwd"] = b.add("fwd", "opaque")
    ids["fwd_union"] = b.add("fwd", "opaque_union", flag=True)
    ids["user"] = b.ref("type_tag", ids["char"], "user")
    ids["user_p"] = b.ref("ptr", ids["user"])
    # a bitfield in the legacy encoding: the INT holds 3 bits at offset 2
    ids["bits3"] = b.int("unsigned int", 4, bits=3, offset=2)
    inner = b.record("", 8, [("lo", ids["uint"], 0, 0), ("hi", ids["uint"], 32, 0)])
    anon_union = b.record("", 8, [("whole", ids["u64"], 0, 0), ("", inner, 0, 0)], union=True)
    ids["flags"] = b.record("flags", 8, [("a", ids["uint"], 0, 1), ("b", ids["uint"], 1, 4),
                                         ("", ids["uint"], 5, 3), ("c", ids["uint"], 8, 24),
                                         ("d", ids["uint"], 32, 0)])
    ids["legacy"] = b.record("legacy", 4, [("x", ids["bits3"], 4, 0), ("y", ids["uint"], 0, 0)],
                             flag=False)
    ids["task"] = b.record("task", 48, [("pid", ids["int"], 0, 0), ("", anon_union, 64, 0),
                                        ("comm", ids["comm"], 128, 0),
                                        ("next", 0, 256, 0),  # patched below: struct task *
                                        ("state", ids["volatile_int"], 320, 0)])
    ids["task_p"] = b.ref("ptr", ids["task"])
    # the member "next" is a struct task *: patch its type id in (records come first)
    at = b.types.rfind(struct.pack(endian + "III", b.s("next"), 0, 256))
    b.types[at + 4:at + 8] = struct.pack(endian + "I", ids["task_p"])
    ids["task_t"] = b.ref("typedef", ids["task"], "task_t")
    ids["u"] = b.record("u", 8, [("i", ids["int"], 0, 0), ("l", ids["long"], 0, 0)], union=True)
    ids["color"] = b.enum("color", [("RED", 0), ("GREEN", 1), ("BLUE", 2)])
    ids["signed_enum"] = b.enum("sign", [("NEG", -1), ("MIN", -(1 << 31))], signed=True)
    ids["big"] = b.enum64("big", [("BIG", 1 << 40), ("HUGE", (1 << 64) - 1)])
    ids["sbig"] = b.enum64("sbig", [("SNEG", -(1 << 40))], signed=True)
    ids["read_proto"] = b.proto(ids["long"], [("task", ids["task_p"]), ("buf", ids["char_p"]),
                                              ("count", ids["u64"])])
    ids["read"] = b.func("task_read", ids["read_proto"], linkage=1)
    ids["printf_proto"] = b.proto(ids["int"], [("fmt", ids["const_char_p"]), ("", 0)])
    ids["printf"] = b.func("printf", ids["printf_proto"], linkage=0)
    ids["void_proto"] = b.proto(0, [])
    ids["idle"] = b.func("idle", ids["void_proto"], linkage=2)
    ids["handler"] = b.ref("ptr", ids["read_proto"])
    ids["ops"] = b.record("ops", 8, [("read", ids["handler"], 0, 0)])
    ids["var"] = b.var("current_task", ids["task_p"])
    ids["datasec"] = b.datasec(".data..percpu", 8, [(ids["var"], 0, 8)])
    ids["decl_tag"] = b.decl_tag("noinline", ids["read"], -1)
    ids["param_tag"] = b.decl_tag("user", ids["read"], 1)
    return b.bytes(), ids


# --- the toy kernels ---------------------------------------------------------------------
TOYS = [pytest.param("toy", id="x86_64"), pytest.param("toy-arm64", id="arm64")]


@pytest.mark.parametrize("image", TOYS)
def test_the_toy_kernels_carry_btf_and_their_loaded_bytes_do_not_change(image: str) -> None:
    """pahole -J adds a .BTF section that is not loaded: every section that is loaded
    (text first) is byte for byte the linker's output, which the build keeps."""
    from elftools.elf.elffile import ELFFile

    needs_image(image)
    elf = images.path(image)
    linked = elf.parent / "obj" / "toy-nobtf.elf"

    def loaded(path: Path) -> tuple[dict[str, tuple[int, bytes]], list[str]]:
        with open(path, "rb") as f:
            e = ELFFile(f)
            names = [s.name for s in e.iter_sections()]
            return {s.name: (s["sh_addr"], s.data()) for s in e.iter_sections()
                    if s["sh_flags"] & 2}, names

    with_btf, names = loaded(elf)
    without, names_before = loaded(linked)
    assert ".text" in with_btf and with_btf == without
    assert ".BTF" in names and ".BTF" not in names_before
    assert BTF.from_elf(elf).nr_types > 100


@needs_bpftool
@pytest.mark.parametrize("image", TOYS)
def test_every_type_of_the_toy_kernels_is_what_bpftool_says(image: str) -> None:
    needs_image(image)
    elf = images.path(image)
    btf = BTF.from_elf(elf)
    all_same_as_bpftool(btf, bpftool_raw(elf))
    btf.validate()


@pytest.mark.parametrize("image", TOYS)
def test_the_toy_task_layout_is_what_its_own_symbols_say(image: str) -> None:
    """The toy exports offsetof and sizeof of its task_struct as absolute symbols
    (KSIM_TASK_*): BTF, from DWARF, must agree with what the compiler put there."""
    from ksim.image import load_image

    needs_image(image)
    elf = images.path(image)
    img = load_image(elf)
    btf = BTF.from_bytes(image_btf(img))
    task = btf.struct("task_struct")
    assert btf.sizeof(task) == img.address_of("KSIM_TASK_STRUCT_SIZE")
    pid = btf.member(task, "pid")
    assert pid.offset == img.address_of("KSIM_TASK_PID_OFFSET") and pid.bitfield_size == 0
    assert btf.is_integer(pid.type) == (4, True)
    comm = btf.member(task, "comm")
    assert comm.offset == img.address_of("KSIM_TASK_COMM_OFFSET")
    assert btf.describe(comm.type).startswith("char [")


# --- the Debian testbed's vmlinux ---------------------------------------------------------
@pytest.fixture(scope="module")
def vmlinux(testbed_kernel: None) -> BTF:
    return BTF.from_elf(VMLINUX)


@pytest.fixture(scope="module")
def vmlinux_oracle(testbed_kernel: None) -> dict[int, dict[str, Any]]:
    if BPFTOOL is None:
        pytest.skip("needs bpftool (apt-get install bpftool)")
    return bpftool_raw(VMLINUX)


@needs_vmlinux
def test_loading_the_kernel_and_finding_a_struct_takes_well_under_a_second() -> None:
    start = time.perf_counter()
    btf = BTF.from_elf(VMLINUX)
    task = btf.struct("task_struct")
    btf.member(task, "comm")
    took = time.perf_counter() - start
    assert btf.nr_types > 100_000
    assert took < 1.0, f"{took:.2f} s"


def test_every_type_of_the_kernel_is_what_bpftool_says(vmlinux, vmlinux_oracle) -> None:
    all_same_as_bpftool(vmlinux, vmlinux_oracle)


def test_the_whole_kernel_validates(vmlinux) -> None:
    vmlinux.validate()


@pytest.mark.parametrize("struct_name,path", [
    ("task_struct", ["pid"]),
    ("task_struct", ["comm"]),
    ("task_struct", ["tgid"]),
    ("sock", ["__sk_common", "skc_family"]),
    ("sock", ["__sk_common", "skc_dport"]),       # in anonymous structs and unions
    ("sock", ["__sk_common", "skc_flags"]),       # in an anonymous union
    ("sock", ["__sk_common", "skc_reuse"]),       # a bitfield
    ("sk_buff", ["len"]),
    ("sk_buff", ["dev"]),                         # in an anonymous union in one
    ("sk_buff", ["protocol"]),                    # in struct_group(headers, ...)
    ("sk_buff", ["pkt_type"]),                    # a bitfield there
    ("file", ["f_pos"]),
])
def test_member_offsets_are_bpftools(vmlinux, vmlinux_oracle, struct_name: str,
                                     path: list[str]) -> None:
    expected, record = 0, oracle_struct(vmlinux_oracle, struct_name)
    for part in path:
        found = oracle_offset(vmlinux_oracle, record, part)
        assert found is not None, part
        expected += found
        record = _oracle_member_type(vmlinux_oracle, record, part)
    member = vmlinux.member(vmlinux.struct(struct_name), ".".join(path))
    assert member.bit_offset == expected
    assert member.name == path[-1]


def _oracle_member_type(oracle: dict[int, dict[str, Any]], type_id: int, name: str) -> int:
    for member, m in oracle[type_id]["items"]:
        if member == name:
            return int(m["type_id"])
    for member, m in oracle[type_id]["items"]:
        if member == "" and oracle[int(m["type_id"])]["kind"] in ("struct", "union"):
            try:
                return _oracle_member_type(oracle, int(m["type_id"]), name)
            except StopIteration:
                continue
    raise StopIteration


def test_known_facts_of_the_debian_kernel(vmlinux) -> None:
    btf = vmlinux
    task = btf.struct("struct task_struct")
    assert btf.strip(btf.member(task, "pid").type).name == "int"
    assert btf.describe(btf.member(task, "pid").type) == "pid_t"
    assert btf.describe(btf.member(task, "comm").type) == "char [16]"
    assert btf.sizeof(btf.member(task, "comm").type) == 16
    assert btf.describe(btf.member(task, "real_parent").type) == "struct task_struct *"
    assert btf.sizeof(task) == task.size
    sock = btf.struct("sock")
    family = btf.member(sock, "__sk_common.skc_family")
    assert btf.describe(family.type) == "short unsigned int"
    assert btf.is_integer(family.type) == (2, False)
    with pytest.raises(BTFError, match=r"struct sock has no member 'skc_family'"):
        btf.member(sock, "skc_family")   # a macro for __sk_common.skc_family in C
    reuse = btf.member(btf.struct("sock_common"), "skc_reuse")
    assert reuse.bitfield_size == 4
    # members() flattens anonymous members: sock_common's skc_flags is one of them
    names = [m.name for m in btf.members(btf.struct("sock_common"))]
    assert "skc_flags" in names and "skc_family" in names and "" not in names
    assert btf.describe(btf.member(btf.struct("file_operations"), "read").type) == \
        "ssize_t (*)(struct file *, char *, size_t, loff_t *)"
    assert btf.describe(btf.find("u64")) == "u64"
    assert btf.describe(btf.find("unsigned int", "int")) == "unsigned int"
    assert btf.pointer_size == 8
    assert btf.enumerator("TCP_ESTABLISHED") == 1
    assert btf.enumerator("no_such_constant_anywhere") is None
    assert btf.find("list_head") == btf.struct("list_head")
    assert btf.find("no_such_type_anywhere") is None
    with pytest.raises(BTFError, match=r"no struct no_such_struct in the kernel's BTF"):
        btf.struct("no_such_struct")


def test_function_prototypes(vmlinux) -> None:
    btf = vmlinux
    proto = btf.func("vfs_read")
    assert proto is not None and proto.name == "vfs_read" and not proto.variadic
    assert [name for name, _ in proto.params] == ["file", "buf", "count", "pos"]
    assert [btf.describe(t) for _, t in proto.params] == ["struct file *", "char *", "size_t",
                                                          "loff_t *"]
    assert proto.ret is not None and btf.describe(proto.ret) == "ssize_t"
    printk = btf.func("_printk")
    assert printk is not None and printk.variadic
    assert [btf.describe(t) for _, t in printk.params] == ["const char *"]
    assert btf.describe(btf.find("vfs_read", "func")) == \
        "ssize_t vfs_read(struct file *, char *, size_t, loff_t *)"
    assert btf.func("no_such_function") is None


@needs_module
@needs_bpftool
def test_a_modules_split_btf_is_what_bpftool_says(vmlinux) -> None:
    module = BTF.from_elf(MODULE, base=vmlinux)
    assert module.name == "virtio_net" and module.start_id == vmlinux.nr_types
    all_same_as_bpftool(module, bpftool_raw(MODULE, base=VMLINUX))
    module.validate()
    info = module.struct("virtnet_info")           # the module's own struct ...
    dev = module.member(info, "dev")                 # ... pointing at one of vmlinux's
    assert module.describe(dev.type) == "struct net_device *"
    assert dev.type.id < module.start_id
    assert module.struct("net_device") is vmlinux.struct("net_device")
    assert module.func("virtnet_probe") is not None


# --- hand-built blobs: every kind, both bitfield encodings ---------------------------------
@pytest.fixture(scope="module")
def blob() -> tuple[BTF, dict[str, int], bytes]:
    data, ids = every_kind()
    return BTF.from_bytes(data, name="test"), ids, data


@needs_bpftool
def test_every_kind_is_read_as_bpftool_reads_it(blob, tmp_path: Path) -> None:
    btf, _ids, data = blob
    raw = tmp_path / "every-kind.btf"
    raw.write_bytes(data)
    all_same_as_bpftool(btf, bpftool_raw(raw))
    btf.validate()


def test_big_endian_btf_reads_as_little_endian_does(blob) -> None:
    little, _ids, _ = blob
    data, _ = every_kind(">")
    assert data[:2] == bytes.fromhex("eb9f")
    big = BTF.from_bytes(data, name="test")
    big.validate()
    assert list(big.types()) == list(little.types())


def test_bitfields_in_both_encodings(blob) -> None:
    btf, ids, _ = blob
    flags = btf.type(ids["flags"])
    assert flags.kind_flag
    got = [(m.name, m.bit_offset, m.bitfield_size) for m in btf.members(flags)]
    assert got == [("a", 0, 1), ("b", 1, 4), ("c", 8, 24), ("d", 32, 0)]  # the unnamed one is padding
    legacy = btf.type(ids["legacy"])
    assert not legacy.kind_flag
    x = btf.member(legacy, "x")
    assert (x.bit_offset, x.bitfield_size) == (4 + 2, 3)    # the INT's offset and bits
    assert btf.member(legacy, "y").bitfield_size == 0


def test_anonymous_members_are_searched_and_flattened(blob) -> None:
    btf, ids, _ = blob
    task = btf.type(ids["task_t"])                     # through the typedef
    assert btf.member(task, "whole").bit_offset == 64
    assert btf.member(task, "hi").bit_offset == 64 + 32
    assert [m.name for m in btf.members(task)] == ["pid", "whole", "lo", "hi", "comm", "next",
                                                   "state"]
    assert btf.member(task, "next").type.id == ids["task_p"]
    assert btf.member(btf.type(ids["u"]), "l").bit_offset == 0


def test_spellings(blob) -> None:
    btf, ids, _ = blob
    spelled = {name: btf.describe(btf.type(ids[name])) for name in (
        "char_p", "const_char_p", "char_p_const", "volatile_int", "restrict_p", "comm", "matrix",
        "matrix_p", "fwd", "fwd_union", "user_p", "task_p", "u", "color", "big", "read", "printf",
        "idle", "handler", "var", "u64", "float")}
    assert spelled == {
        "char_p": "char *", "const_char_p": "const char *", "char_p_const": "char *const",
        "volatile_int": "volatile int", "restrict_p": "char *restrict", "comm": "char [16]",
        "matrix": "int [2][3]", "matrix_p": "int (*)[2][3]", "fwd": "struct opaque",
        "fwd_union": "union opaque_union", "user_p": "char *", "task_p": "struct task *",
        "u": "union u", "color": "enum color", "big": "enum big",
        "read": "long int task_read(struct task *, char *, u64)",
        "printf": "int printf(const char *, ...)", "idle": "void idle(void)",
        "handler": "long int (*)(struct task *, char *, u64)",
        "var": "struct task *current_task", "u64": "u64", "float": "double"}
    assert btf.describe(btf.type(0)) == "void"


def test_sizes_strip_and_predicates(blob) -> None:
    btf, ids, _ = blob
    t = btf.type
    assert btf.sizeof(t(ids["matrix"])) == 24 and btf.sizeof(t(ids["task_p"])) == 8
    assert btf.sizeof(t(ids["task_t"])) == 48 and btf.sizeof(t(ids["char_p_const"])) == 8
    assert btf.sizeof(t(ids["var"])) == 8 and btf.sizeof(t(ids["big"])) == 8
    for name, why in (("fwd", "only declared"), ("read", "is a function"),
                      ("read_proto", "no size")):
        with pytest.raises(BTFError, match=why):
            btf.sizeof(t(ids[name]))
    with pytest.raises(BTFError, match="void has no size"):
        btf.sizeof(t(0))
    assert btf.strip(t(ids["task_t"])).id == ids["task"]
    assert btf.strip(t(ids["user"])).id == ids["char"]
    assert btf.is_pointer(t(ids["char_p_const"])) and not btf.is_pointer(t(ids["comm"]))
    assert btf.is_array(t(ids["comm"])) and btf.is_record(t(ids["task_t"]))
    assert btf.is_integer(t(ids["color"])) == (4, False)
    assert btf.is_integer(t(ids["u64"])) == (8, False)
    assert btf.is_integer(t(ids["signed_enum"])) == (4, True)
    assert btf.is_integer(t(ids["float"])) is None
    assert t(ids["char"]).is_char and t(ids["bool"]).is_bool
    assert t(ids["comm"]).elem == ids["char"]


def test_names_enumerators_and_prototypes(blob) -> None:
    btf, ids, _ = blob
    assert btf.find("task").id == ids["task"]
    assert btf.find("struct task").id == ids["task"]
    assert btf.find("task_t").id == ids["task_t"]
    assert btf.find("opaque").kind == "fwd"
    with pytest.raises(BTFError, match="struct opaque is only declared"):
        btf.struct("opaque")
    with pytest.raises(BTFError, match=r"no struct nothing in test's BTF"):
        btf.struct("struct nothing")
    assert btf.struct("union u").id == ids["u"] and btf.struct("u").id == ids["u"]
    with pytest.raises(BTFError, match="unknown BTF kind 'structure'"):
        btf.find("task", "structure")
    assert btf.find("big", "enum").id == ids["big"]
    assert btf.find("enum color").id == ids["color"]
    assert (btf.enumerator("BLUE"), btf.enumerator("NEG"), btf.enumerator("MIN")) == (2, -1, -(1 << 31))
    assert (btf.enumerator("BIG"), btf.enumerator("HUGE"), btf.enumerator("SNEG")) == (
        1 << 40, (1 << 64) - 1, -(1 << 40))
    proto = btf.func("task_read")
    assert proto is not None and [n for n, _ in proto.params] == ["task", "buf", "count"]
    assert proto.ret is not None and proto.ret.id == ids["long"]
    idle = btf.func("idle")
    assert idle is not None and idle.params == () and idle.ret is None
    assert btf.type(ids["idle"]).linkage == "extern"
    assert btf.type(ids["param_tag"]).component == 1
    with pytest.raises(BTFError, match=r"no member 'nope'"):
        btf.member(btf.type(ids["task"]), "nope")
    with pytest.raises(BTFError, match="not a struct or union"):
        btf.member(btf.type(ids["task_p"]), "pid")


def test_split_btf_continues_its_base(blob) -> None:
    base, ids, _ = blob
    mod = Blob(start_id=base.nr_types, start_str=len(every_kind()[0]) and base._end_str)
    priv = mod.record("mod_priv", 16, [("task", ids["task_p"], 0, 0), ("n", ids["int"], 64, 0)])
    mod.func("mod_init", mod.proto(ids["int"], []))
    split = BTF.from_bytes(mod.bytes(), base=base, name="mod")
    assert split.start_id == base.nr_types and split.type(priv).name == "mod_priv"
    assert split.describe(split.member(split.type(priv), "task").type) == "struct task *"
    assert split.struct("task").id == ids["task"]        # the base's, through the split
    assert split.enumerator("GREEN") == 1
    assert split.func("mod_init") is not None and base.func("mod_init") is None
    with pytest.raises(BTFError, match=r"type id 999 is out of range: mod's BTF has types"):
        split.type(999)


# --- malformed blobs ------------------------------------------------------------------------
def _bad(data: bytes, message: str, base: BTF | None = None) -> None:
    with pytest.raises(BTFError, match=message):
        BTF.from_bytes(data, base=base, name="bad").validate()


def test_malformed_headers_are_refused_with_their_cause() -> None:
    data, _ = every_kind()
    _bad(b"", r"bad: truncated BTF header: 0 bytes, a header is 24")
    _bad(data[:20], r"truncated BTF header: 20 bytes")
    _bad(b"\x00\x00" + data[2:], r"not BTF: magic 0000, expected 0xeb9f")
    _bad(data[:2] + b"\x02" + data[3:], r"BTF version 2")
    b = Blob()
    b.int("int", 4)
    _bad(b.bytes(hdr_len=16), r"header length 16")
    _bad(b.bytes(type_len=1000), r"the type section \[0, \+1000\) runs past the end")
    _bad(b.bytes(str_len=1000), r"the string section .* runs past the end")
    _bad(b.bytes(type_off=2, type_len=12), r"not 4-byte aligned")


def test_malformed_types_are_refused_with_their_cause() -> None:
    b = Blob()
    b.int("int", 4)
    b.ref("ptr", 7)                                       # to a type that does not exist
    _bad(b.bytes(), r"type 2 \(ptr\): its referenced type is type id 7, out of range")
    b = Blob()
    b.add("int", "x" * 3, 4, extra=b"")                   # an INT without its encoding word
    _bad(b.bytes(), r"type 1 at offset 0 of the type section is truncated")
    b = Blob()
    b.int("int", 4)
    b.types += struct.pack("<III", 0, 25 << 24, 0)
    _bad(b.bytes(), r"type 2 at offset 16 has unknown kind 25")
    b = Blob()
    b.add("typedef", "", 0)
    b.types[0:4] = struct.pack("<I", 4000)                # a name past the strings
    _bad(b.bytes(), r"type 1 \(typedef\): string offset 4000 is past the end of the string section")
    b = Blob()
    b.ref("typedef", 2, "a")
    b.ref("typedef", 1, "b")                              # a -> b -> a
    with pytest.raises(BTFError, match=r"chain of typedefs and qualifiers loops back to type 1"):
        BTF.from_bytes(b.bytes(), name="bad").sizeof(BTF.from_bytes(b.bytes()).type(1))
    _bad(b.bytes(), r"loops back")
    b = Blob()
    b.ref("const", 2)
    b.ref("ptr", 1)                                       # const -> ptr -> const -> ...
    _bad(b.bytes(), r"a chain of more than \d+ types")
    b = Blob()
    b.record("self", 8, [("", 1, 0, 0)])                  # a struct inside itself, anonymously
    _bad(b.bytes(), r"contains itself through anonymous members")
    b = Blob()
    b.int("int", 4)
    _bad(b.bytes(str_len=len(b.strings) - 1), r"the string section does not end with a NUL")
    _bad(b"\x9f\xeb\x01\x00" + struct.pack("<IIIII", 24, 0, 0, 0, 1) + b"x",
         r"the string section does not start with an empty string")


@given(data=st.data())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_corrupted_or_truncated_blobs_raise_btf_errors_only(data) -> None:
    """Whatever a blob's bytes, reading all of it either works or raises BTFError."""
    blob, _ = every_kind()
    raw = bytearray(blob)
    cut = data.draw(st.integers(0, len(raw)), label="length")
    raw = raw[:cut] if data.draw(st.booleans(), label="truncate") else raw
    for _ in range(data.draw(st.integers(0, 6), label="flips")):
        if raw:
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[at] = data.draw(st.integers(0, 255), label="byte")
    try:
        btf = BTF.from_bytes(bytes(raw), name="fuzz")
        btf.validate()
        for t in btf.types():
            if t.kind not in ("fwd", "func", "func_proto"):
                btf.sizeof(t)
        for name in ("task", "u", "flags"):
            btf.find(name)
            btf.func("task_read")
            btf.enumerator("RED")
    except BTFError:
        pass


# --- ELF files ---------------------------------------------------------------------------
def test_elf_files_without_btf_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BTFError, match="not an ELF file"):
        btf_section(b"not an elf")
    with pytest.raises(BTFError, match="cannot read"):
        btf_section(tmp_path / "absent")
    obj = tmp_path / "plain.o"
    src = tmp_path / "plain.c"
    src.write_text("int x;\n")
    subprocess.run(["gcc", "-c", "-o", str(obj), str(src)], check=True)
    with pytest.raises(BTFError, match=r"no \.BTF section"):
        BTF.from_elf(obj)
    linked = images.path("toy")
    assert btf_section(linked.read_bytes()) == btf_section(linked)


# --- where BTF comes from ------------------------------------------------------------------
def test_kernel_btf_of_an_emulated_target_is_its_images_and_kept() -> None:
    from ksim.kapi import Manager

    m = Manager.attach("unicorn:toy")
    try:
        btf = kernel_btf(m.target)
        assert kernel_btf(m) is btf                  # a Manager means its target, and kept
        assert btf.struct("task_struct").size == m.target.image.address_of("KSIM_TASK_STRUCT_SIZE")
        with pytest.raises(BTFError, match="no BTF for module 'virtio_net'"):
            kernel_btf(m, "virtio_net")
    finally:
        m.detach()


# --- a live kernel ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(testbed: dict[str, Any]) -> Iterator[Any]:  # noqa: F811 - ksim.live.testing's fixture
    t = connect(testbed)
    yield t
    t.close()


@contextmanager
def counting(t: Any) -> Iterator[list[str]]:
    """The ops ``t`` sends while the block runs."""
    sent: list[str] = []
    request = t.conn.request

    def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(op)
        return request(op, *args, **kwargs)

    t.conn.request = counted
    try:
        yield sent
    finally:
        t.conn.request = request


@pytest.mark.live
@pytest.mark.slow
@needs_vmlinux
def test_live_btf_is_the_kernels_section_byte_for_byte_and_cached(live) -> None:
    expected = btf_section(VMLINUX)
    cached = cache_dir() / hashlib.sha256(expected).hexdigest()
    cached.unlink(missing_ok=True)
    with counting(live) as sent:
        assert live.btf() == expected
    assert cached.read_bytes() == expected
    assert sent.count("btf") == len(sent) >= 2           # its digest, then the bytes
    with counting(live) as sent:
        assert live.btf("vmlinux") == expected
    assert sent == ["btf"]                               # the digest only: the cache answers
    cached.write_bytes(b"stale")                         # a cache file that lies is not used
    assert live.btf() == expected and cached.read_bytes() == expected


@pytest.mark.live
@pytest.mark.slow
def test_live_module_btf_is_split_btf_on_vmlinux(live) -> None:
    loaded = live.exec("ls /sys/kernel/btf").split()
    assert "vmlinux" in loaded and "virtio_net" in loaded
    btf = kernel_btf(live, "virtio_net")
    assert btf.base is kernel_btf(live) and btf.name == "virtio_net"
    assert btf.member(btf.struct("virtnet_info"), "dev").type.id < btf.start_id
    if MODULE.exists():
        assert live.btf("virtio_net") == btf_section(MODULE)
    assert btf.struct("task_struct") is kernel_btf(live).struct("task_struct")


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("name,error,message", [
    ("../vmlinux", ProtocolError, r"btf: argument 'name' must be vmlinux or a module's name"),
    ("a/b", ProtocolError, r"must be vmlinux or a module's name"),
    (".", ProtocolError, r"must be vmlinux or a module's name"),
    ("x" * 65, ProtocolError, r"btf: argument 'name' has 65 bytes of UTF-8, over the limit of 64"),
    ("no_such_module", BTFError, r"btf: no /sys/kernel/btf/no_such_module: no module of that "
                                 r"name is loaded"),
])
def test_live_btf_names_are_checked(live, name: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        live.btf(name)


@pytest.mark.live
@pytest.mark.slow
def test_live_trace_instances_are_made_and_removed(live) -> None:
    instance = f"/sys/kernel/tracing/instances/ksim-test-{os.getpid()}"
    live.tracefs(instance, "mkdir")
    try:
        assert live.tracefs(f"{instance}/tracing_on").strip() == "1"
        assert f"ksim-test-{os.getpid()}" in live.exec("ls /sys/kernel/tracing/instances")
        with pytest.raises(TargetError, match="File exists"):
            live.tracefs(instance, "mkdir")
    finally:
        live.tracefs(instance + "/", "rmdir")
    assert f"ksim-test-{os.getpid()}" not in live.exec("ls /sys/kernel/tracing/instances")
    with pytest.raises(TargetError, match="No such file"):
        live.tracefs(instance, "rmdir")


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("file,mode", [
    ("/sys/kernel/tracing/instances/other", "mkdir"),           # not a ksim instance
    ("/sys/kernel/tracing/instances/ksim-UPPER", "mkdir"),
    ("/sys/kernel/tracing/instances/ksim-", "mkdir"),
    ("/sys/kernel/tracing/instances/ksim-x/../../../../tmp/ksim-x", "mkdir"),
    ("/sys/kernel/tracing/instances/ksim-x/events", "mkdir"),    # inside an instance
    ("/tmp/ksim-x", "mkdir"),
    ("/sys/kernel/tracing/events", "rmdir"),
    ("/sys/kernel/tracing/instances", "rmdir"),
])
def test_live_trace_instances_elsewhere_are_refused(live, file: str, mode: str) -> None:
    with pytest.raises(AuthError, match=rf"tracefs: {mode} is allowed only for a ksim trace instance"):
        live.tracefs(file, mode)


@pytest.mark.live
@pytest.mark.slow
def test_live_tracefs_modes_are_checked(live) -> None:
    with pytest.raises(ProtocolError, match=r"tracefs: argument 'mode' must be r, w or a \(a file\), "
                                            r"or mkdir or rmdir"):
        live.tracefs("/sys/kernel/tracing/instances/ksim-x", "mkdi")
    with pytest.raises(ProtocolError, match=r"argument 'mode' has 6 bytes of UTF-8"):
        live.tracefs("/sys/kernel/tracing/instances/ksim-x", "mkdirs")
