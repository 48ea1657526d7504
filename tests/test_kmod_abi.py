"""ksim/live/abi.py mirrors kmod/kerninst.h: checked by compiling the header with gcc."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ksim.live import abi

HEADER = Path(__file__).resolve().parent.parent / "kmod" / "kerninst.h"


def c_values(tmp_path: Path) -> dict[str, int]:
    """sizeof, offsetof and ioctl numbers as the C compiler sees them."""
    lines = [f'#include "{HEADER}"', "#include <stdio.h>", "#include <stddef.h>", "int main(void) {"]
    for name in abi.COMMANDS:
        lines.append(f'printf("IOC_{name} %lu\\n", (unsigned long)KERNINST_IOC_{name});')
    for sname, fields in abi.STRUCTS.items():
        lines.append(f'printf("SIZE_{sname} %zu\\n", sizeof(struct {sname}));')
        for field, _ in fields:
            lines.append(f'printf("OFF_{sname}.{field} %zu\\n", offsetof(struct {sname}, {field}));')
    for limit in abi.LIMITS:
        lines.append(f'printf("LIMIT_{limit} %d\\n", KERNINST_{limit});')
    for name in abi.HAZARDS:
        lines.append(f'printf("HAZARD_{name} %u\\n", KERNINST_HAZARD_{name.upper()});')
    lines.append('printf("ARM64_BRK_IMM %d\\n", KERNINST_ARM64_BRK_IMM);')
    lines.append('printf("CODE_FILL_X86_64 %u\\n", KERNINST_CODE_FILL_X86_64);')
    lines.append('printf("CODE_FILL_ARM64 %u\\n", KERNINST_CODE_FILL_ARM64);')
    lines.append('printf("VERSION %d\\n", KERNINST_ABI_VERSION); return 0; }')
    src, exe = tmp_path / "abi.c", tmp_path / "abi"
    src.write_text("\n".join(lines))
    subprocess.run(["gcc", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_table_matches_the_header(tmp_path: Path) -> None:
    c = c_values(tmp_path)
    assert c["VERSION"] == abi.ABI_VERSION
    for name in abi.COMMANDS:
        assert c[f"IOC_{name}"] == abi.command(name), name
    for sname, fields in abi.STRUCTS.items():
        s = abi.structure(sname)
        assert c[f"SIZE_{sname}"] == s.size, sname
        offset = 0
        for field, fmt in fields:
            assert c[f"OFF_{sname}.{field}"] == offset, f"{sname}.{field}"
            offset += __import__("struct").calcsize("<" + fmt)
    for limit, value in abi.LIMITS.items():
        assert c[f"LIMIT_{limit}"] == value, limit
    for name, bit in abi.HAZARDS.items():
        assert c[f"HAZARD_{name}"] == bit, name
    assert c["ARM64_BRK_IMM"] == abi.ARM64_BRK_IMM
    assert abi.TRAP_IMMEDIATES == {"aarch64": c["ARM64_BRK_IMM"]}
    assert abi.CODE_FILL == {"x86_64": (c["CODE_FILL_X86_64"], 1),
                             "aarch64": (c["CODE_FILL_ARM64"], 4)}


def test_every_ioctl_in_the_header_is_in_the_table() -> None:
    names = set(re.findall(r"#define KERNINST_IOC_(\w+)\s+_IO", HEADER.read_text()))
    assert names == set(abi.COMMANDS)


def test_every_hazard_in_the_header_is_in_the_table() -> None:
    names = set(re.findall(r"#define KERNINST_HAZARD_(\w+)\s", HEADER.read_text()))
    assert names == {n.upper() for n in abi.HAZARDS}
    bits = list(abi.HAZARDS.values())
    assert len(set(bits)) == len(bits) and all(b & (b - 1) == 0 for b in bits)


def test_hazard_names_keep_every_bit() -> None:
    assert abi.hazard_names(0) == []
    assert abi.hazard_names(abi.HAZARDS["ftrace"] | abi.HAZARDS["warn"]) == ["ftrace", "warn"]
    # a bit this side does not know (a newer module) is never dropped silently
    assert abi.hazard_names(1 << 31) == ["unknown"]
    assert abi.hazard_names((1 << 31) | abi.HAZARDS["unknown"]) == ["unknown"]


def test_errno_mapping_names_real_error_codes() -> None:
    from ksim.errors import all_error_classes

    codes = all_error_classes()
    assert all(code in codes for code in abi.ERRORS.values())
    assert abi.error_code("POKE", 116) == "stale-text"  # ESTALE
    assert abi.error_code("READ", 14) == "target-fault"  # EFAULT


def test_every_errno_the_module_returns_has_a_ksim_error() -> None:
    """Each errno kerninst.c returns is named in the table, so the daemon gives a
    specific error for it (capability: EACCES; lockdown: EROFS; a jump written into
    text that leads elsewhere: ENOEXEC), never a generic one."""
    import errno

    source = HEADER.with_name("kerninst.c").read_text()
    returned = set(re.findall(r"-(E[A-Z]+)\b", source))
    mapped = {err for _, err in abi.ERRORS}
    assert returned and all(getattr(errno, name) in mapped for name in returned), \
        sorted(n for n in returned if getattr(errno, n) not in mapped)
    assert abi.error_code("POKE", errno.EROFS) == "locked-down"
    assert abi.error_code("SET_TRAP", errno.EACCES) == "not-privileged"
    assert abi.error_code("POKE", errno.ENOEXEC) == "jump-outside"
    assert abi.error_code("POKE", errno.EPERM) == "blacklisted"   # EPERM stays the hazards'


def test_a_free_refused_for_a_data_block_is_block_in_use() -> None:
    """FREE's EBUSY is a code block a route or a jump still leads into; its ETXTBSY a
    data block whose owner has live patch code (kerninst.h's error list)."""
    import errno

    assert abi.error_code("FREE", errno.EBUSY) == "already-spliced"
    assert abi.error_code("FREE", errno.ETXTBSY) == "block-in-use"
    assert "ETXTBSY FREE of a data block" in HEADER.read_text()


def test_jump_dest_reads_jumps_as_the_module_does() -> None:
    """ki_jump_dest: x86-64 e9 rel32 / eb rel8 at the first byte, arm64 a B (not a BL)."""
    site = 0xFFFF_FFFF_8100_1000
    assert abi.jump_dest("x86_64", site, b"\xe9\x00\x01\x00\x00") == site + 5 + 0x100
    assert abi.jump_dest("x86_64", site, b"\xe9\xfb\xff\xff\xff") == site   # jmp to itself
    assert abi.jump_dest("x86_64", site, b"\xeb\xfe") == site
    assert abi.jump_dest("x86_64", site, b"\x90\xe9\x00\x00\x00\x00") is None
    assert abi.jump_dest("x86_64", site, b"\xe9\x00") is None
    b_fwd = (0x14000000 | 0x40).to_bytes(4, "little")      # b .+0x100
    b_back = (0x14000000 | 0x3FFFFFF).to_bytes(4, "little")  # b .-4
    bl = (0x94000000 | 0x40).to_bytes(4, "little")
    assert abi.jump_dest("aarch64", site, b_fwd) == site + 0x100
    assert abi.jump_dest("aarch64", site, b_back) == site - 4
    assert abi.jump_dest("aarch64", site, bl) is None
    assert abi.jump_dest("aarch64", site, b"\x00\x00") is None


def test_a_wire_table_fits_one_module_call() -> None:
    """kerninstd hands a read_ranges or digests table to the module whole
    (READ_ROWS, DIGEST_ROWS): what the protocol lets a request hold, rows and bytes,
    is what one module call takes, and a digest is the size the module writes."""
    from ksim.live import protocol as wire

    assert wire.MAX_RANGES <= abi.LIMITS["MAX_ROWS"]
    assert wire.MAX_READ <= wire.MAX_DIGESTED <= abi.LIMITS["MAX_ROWS_BYTES"]
    assert wire.DIGEST == abi.LIMITS["DIGEST_SIZE"]
