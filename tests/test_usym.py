"""ustack's symbolizer (ksim.trace.usym) on this host's real files and processes.

The oracles are independent of the code under test: binutils' ``readelf -Ws``
for what a file's symbol tables hold, and, for the offset arithmetic of a mapped
PIE and of a shared library mapped at a non-zero offset, addresses the running
processes tell themselves (a program printing its own functions' addresses, the
dynamic loader's dlsym through ctypes).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ksim.live.protocol import TracedFileRefused
from ksim.trace.usym import ElfFile, Mapping, RangeFile, Symbols, UserSymbols, parse_maps

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
pytestmark = pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("gcc") is None
                                or not os.path.exists(LIBC),
                                reason="needs binutils' readelf, gcc and an x86-64 glibc")


class HostFiles:
    """A RangeReader over this host's files, counting the bytes it hands out."""

    def __init__(self) -> None:
        self.bytes = 0
        self.reads = 0

    def __call__(self, path: str, offset: int, size: int) -> bytes:
        assert size <= 64 << 10, "a read past kerninstd's read_file limit"
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as exc:          # as kerninstd refuses it
            raise TracedFileRefused(f"read_file: {path}: {exc.strerror}") from None
        self.bytes += len(data)
        self.reads += 1
        return data


def readelf_symbols(path: str) -> set[tuple[int, int, str]]:
    """(value, size, name) of the symbols bcc lists from ``path``'s symbol tables
    (a name and a value not zero), as readelf prints them."""
    out = subprocess.run(["readelf", "-Ws", path], check=True, capture_output=True,
                         text=True).stdout
    rows = set()
    dynamic = False
    for line in out.splitlines():
        if line.startswith("Symbol table"):
            dynamic = "'.dynsym'" in line
        m = re.match(r"\s*\d+: ([0-9a-f]+)\s+(\S+)\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)", line)
        if m is None or int(m.group(1), 16) == 0:
            continue
        size = int(m.group(2), 16) if m.group(2).startswith("0x") else int(m.group(2))
        # readelf adds a .dynsym symbol's version (@VERSION, @@VERSION), which
        # .gnu.version holds apart from the name; a .symtab name may hold one itself
        name = m.group(3).split("@")[0] if dynamic else m.group(3)
        rows.add((int(m.group(1), 16), size, name))
    return rows


def our_symbols(path: str) -> set[tuple[int, int, str]]:
    f = RangeFile(HostFiles(), path)
    return {(start, size, f.name(at)) for start, size, _, _, f, at in ElfFile(f).symbols()}


@pytest.mark.parametrize("path", ["/bin/bash", LIBC])
def test_a_files_symbols_are_the_ones_readelf_lists(path: str) -> None:
    """/bin/bash and libc.so.6 are stripped: their .dynsym alone, each of its named
    symbols with a value, name, address and size as readelf prints them."""
    ours = our_symbols(path)
    assert len(ours) > 1000
    assert ours == readelf_symbols(path)


def test_libcs_debug_file_is_found_by_its_build_id() -> None:
    reader = HostFiles()
    elf = ElfFile(RangeFile(reader, LIBC))
    out = subprocess.run(["readelf", "-n", LIBC], check=True, capture_output=True,
                         text=True).stdout
    assert elf.build_id is not None and elf.build_id.hex() in out
    debug = UserSymbols(reader)._debug_file(elf)
    if debug is None:
        pytest.skip("libc6-dbg is not installed: libc has no separate debug file here")
    assert {(a, s, n) for a, s, _, _, f, at in debug.symbols()
            for n in [f.name(at)]} == readelf_symbols(debug.f.path)


def test_maps_lines_are_parsed_and_bcc_modules_picked() -> None:
    maps = parse_maps(
        "55d0c5a00000-55d0c5a2e000 r--p 00000000 08:01 1234                       /usr/bin/bash\n"
        "55d0c5a2e000-55d0c5b0d000 r-xp 0002e000 08:01 1234                       /usr/bin/bash\n"
        "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n"
        "7f0000001000-7f0000002000 r-xp 00000000 00:00 0                          [heap]\n"
        "7ffd3c5f0000-7ffd3c5f2000 r-xp 00000000 00:00 0                          [vdso]\n"
        "7f0000003000-7f0000004000 r-xp 00001000 08:01 99    /tmp/a name with spaces (deleted)\n"
        "not a mapping\n")
    assert maps[1] == Mapping(0x55d0c5a2e000, 0x55d0c5b0d000, "r-xp", 0x2e000, "08:01", 1234,
                              "/usr/bin/bash")
    assert maps[5].path == "/tmp/a name with spaces (deleted)" and maps[5].inode == 99
    assert [m.path for m in maps if m.module] == ["/usr/bin/bash", "[vdso]",
                                                  "/tmp/a name with spaces (deleted)"]


def test_nested_and_zero_size_symbols_are_found_as_bcc_finds_them() -> None:
    """bcc's own example (src/cc/bcc_syms.cc, Module::find_addr): bar nested in foo;
    an address past bar's end but inside foo is foo's; a zero-size symbol covers
    nothing, and the walk back stops at a symbol that cannot hold the address."""
    f = RangeFile(lambda path, offset, size: b"goo\0foo\0bar\0baz\0mark\0"[offset:offset + size],
                  "strtab")
    syms = Symbols.of([(0x0 + 0x100, 0x6, 2, 0, f, 0), (0x6 + 0x100, 0x10, 2, 1, f, 4),
                       (0x8 + 0x100, 0x4, 2, 2, f, 8), (0x16 + 0x100, 0x10, 2, 3, f, 12),
                       (0x40 + 0x100, 0, 2, 4, f, 16)])
    assert syms.find(0x112) == ("foo", 0xc)
    assert syms.find(0x109) == ("bar", 1)
    assert syms.find(0x100) == ("goo", 0)
    assert syms.find(0x125) == ("baz", 0xf)
    assert syms.find(0x126) is None             # past baz, before mark
    assert syms.find(0x140) is None             # mark has no size
    assert syms.find(0xff) is None


PIE = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) static int ksim_static_leaf(int x) { return x * 3 + getpid(); }
__attribute__((noinline)) int ksim_global_fn(int x) { return ksim_static_leaf(x) + 1; }
int main(void)
{
    printf("%p %p\n", (void *)ksim_static_leaf, (void *)ksim_global_fn);
    fflush(stdout);
    read(0, (char[1]){0}, 1);      /* stays mapped until its stdin closes */
    return ksim_global_fn(1) == 0;
}
"""


def test_a_running_pies_functions_are_named_at_the_addresses_it_prints(tmp_path: Path) -> None:
    """A PIE (loaded at a random base) with a .symtab: the address its own code takes
    of a static and of a global function name that function, at offset 0 and on."""
    src = tmp_path / "ksimpie.c"
    src.write_text(PIE)
    exe = tmp_path / "ksimpie"
    subprocess.run(["gcc", "-O1", "-fPIE", "-pie", "-fno-omit-frame-pointer", "-o", str(exe),
                    str(src)], check=True)
    p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        leaf, glob = (int(x, 16) for x in p.stdout.readline().split())
        reader = HostFiles()
        syms = UserSymbols(reader)
        assert syms.resolve(p.pid, leaf) == ("ksim_static_leaf", 0, str(exe))
        assert syms.resolve(p.pid, glob + 3) == ("ksim_global_fn", 3, str(exe))
        assert syms.frame(p.pid, glob + 3, perf=True) == f"ksim_global_fn+3 ({exe})"
        assert syms.frame(p.pid, 0x10, perf=False) == "0x10"
        assert syms.frame(p.pid, 0x10, perf=True) == "0x10 ([unknown])"
        # the file's tables are read in bounded pieces, not whole
        assert reader.bytes < exe.stat().st_size + (64 << 10)
        # a ustack's words (its pid, then its frames, zeros after) as bpftrace 0.17
        # prints them in each mode, a key's frames indented by 4, a value's by 8
        from ksim.trace.maps import USER_SYMBOLIZE, decode, decode_key

        words = [p.pid, leaf + 1, glob + 3, 0x10, 0, 0]
        USER_SYMBOLIZE[:] = [syms.frame]
        try:
            assert decode("ustack:5:bpftrace", words, []) == (
                "\n        ksim_static_leaf+1\n        ksim_global_fn+3\n        0x10\n")
            assert decode_key(["ustack:5:bpftrace"], words, []) == [
                "\n    ksim_static_leaf+1\n    ksim_global_fn+3\n    0x10\n"]
            assert decode("ustack:5:perf", words, []) == (
                f"\n\t{leaf + 1:x} ksim_static_leaf+1 ({exe})\n\t{glob + 3:x} ksim_global_fn+3 "
                f"({exe})\n\t10 0x10 ([unknown])\n")
            assert decode("ustack:5:raw", words, []) == f"\n{leaf + 1:x}\n{glob + 3:x}\n10\n"
            assert decode("ustack:5:bpftrace", [p.pid] + [0] * 5, []) == ""    # no frame
        finally:
            USER_SYMBOLIZE.clear()
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(10)
    # a process that has exited has no mappings: its addresses print as they are
    assert UserSymbols(HostFiles()).frame(p.pid, leaf, perf=False) == f"0x{leaf:x}"


def test_libc_mapped_at_a_non_zero_offset_names_what_dlsym_found() -> None:
    """libc.so.6's text is mapped from a file offset not 0 in this very process:
    the address the dynamic loader gives for getppid and write, plus an offset, is
    named as that function (or an alias at its address, as readelf lists them)."""
    libc = ctypes.CDLL(LIBC)
    maps = [m for m in parse_maps(Path(f"/proc/{os.getpid()}/maps").read_text())
            if m.path.endswith("libc.so.6") and m.module]
    assert maps and all(m.offset > 0 for m in maps)
    elf = ElfFile(RangeFile(HostFiles(), LIBC))
    debug = UserSymbols(HostFiles())._debug_file(elf)
    at: dict[int, set[str]] = {}
    for path in (LIBC, *([debug.f.path] if debug is not None else [])):
        for value, _, name in readelf_symbols(path):
            at.setdefault(value, set()).add(name)
    syms = UserSymbols(HostFiles())
    for fn, offset in (("getppid", 0), ("write", 7)):
        address = ctypes.cast(getattr(libc, fn), ctypes.c_void_p).value
        assert address is not None
        name, off, path = syms.resolve(os.getpid(), address + offset) or ("", 0, "")
        assert off == offset and os.path.realpath(path) == os.path.realpath(LIBC)
        aliases = next(names for names in at.values() if fn in names)
        assert name in aliases, (fn, name, aliases)
