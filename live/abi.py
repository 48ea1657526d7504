"""The /dev/kerninst ioctl ABI as data: a mirror of kmod/kerninst.h.

Structures are tables of (field, struct-format) in declaration order, commands
are rows (direction, number, structure), and errno values map to ksim error
codes per command.  tests/test_kmod_abi.py checks this table against the C
header, so the two cannot drift apart silently.
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass

ABI_VERSION = 1
DEVICE = "/dev/kerninst"
IOC_MAGIC = "K"

# Limits, as in kerninst.h.
LIMITS: dict[str, int] = {
    "MAX_IO": 65536,
    "MAX_WRITES": 64,
    "MAX_TEXT_WRITE": 16,
    "MAX_CODE_WRITE": 4096,
    "MAX_TRAPS": 512,
    "MAX_SPLICES": 4096,
    "NAME_LEN": 128,
}

# struct name -> ((field, format), ...); every field little-endian, no implicit padding.
STRUCTS: dict[str, tuple[tuple[str, str], ...]] = {
    "kerninst_version": (("version", "I"), ("reserved", "I")),
    "kerninst_info": (
        ("text_start", "Q"), ("text_end", "Q"),
        ("code_start", "Q"), ("code_size", "Q"),
        ("data_start", "Q"), ("data_size", "Q"),
        ("current_task", "Q"), ("cpu_number", "Q"),
        ("task_pid_offset", "I"), ("task_pid_size", "I"),
        ("nr_cpus", "I"), ("version", "I"),
    ),
    "kerninst_mem": (("address", "Q"), ("buf", "Q"), ("size", "Q")),
    "kerninst_write": (
        ("address", "Q"), ("old_buf", "Q"), ("new_buf", "Q"), ("len", "I"), ("reserved", "I"),
    ),
    "kerninst_poke": (("writes", "Q"), ("count", "I"), ("failed_index", "I")),
    "kerninst_lookup": (("name", f"{LIMITS['NAME_LEN']}s"), ("address", "Q")),
    "kerninst_trap": (("site", "Q"), ("patch", "Q")),
}

# _IOC directions (include/uapi/asm-generic/ioctl.h)
IOC_NONE, IOC_WRITE, IOC_READ = 0, 1, 2
_DIRS = {"": IOC_NONE, "r": IOC_READ, "w": IOC_WRITE, "rw": IOC_READ | IOC_WRITE}

# command -> (direction as seen from user space, number, structure)
COMMANDS: dict[str, tuple[str, int, str | None]] = {
    "VERSION": ("r", 0x00, "kerninst_version"),
    "INFO": ("r", 0x01, "kerninst_info"),
    "READ": ("w", 0x02, "kerninst_mem"),
    "WRITE": ("w", 0x03, "kerninst_mem"),
    "POKE": ("rw", 0x04, "kerninst_poke"),
    "LOOKUP": ("rw", 0x05, "kerninst_lookup"),
    "SET_TRAP": ("w", 0x06, "kerninst_trap"),
    "CLEAR_TRAP": ("w", 0x07, "kerninst_trap"),
    "QUIESCE": ("", 0x08, None),
}

# (command or "*", errno) -> ksim error code (ksim.errors); the first match wins.
ERRORS: dict[tuple[str, int], str] = {
    ("POKE", errno.ESTALE): "stale-text",
    ("POKE", errno.ERANGE): "outside-text",
    ("POKE", errno.EPERM): "blacklisted",
    ("POKE", errno.EBUSY): "already-spliced",
    ("POKE", errno.ENOSPC): "out-of-memory",
    ("SET_TRAP", errno.ERANGE): "outside-text",
    ("SET_TRAP", errno.EPERM): "blacklisted",
    ("SET_TRAP", errno.EBUSY): "already-spliced",
    ("SET_TRAP", errno.ENOSPC): "out-of-memory",
    ("CLEAR_TRAP", errno.ERANGE): "outside-text",
    ("CLEAR_TRAP", errno.EBUSY): "already-spliced",
    ("CLEAR_TRAP", errno.ENOENT): "unknown-handle",
    ("LOOKUP", errno.ENOENT): "unknown-symbol",
    ("WRITE", errno.ERANGE): "target-fault",
    ("*", errno.EFAULT): "target-fault",
    ("*", errno.EINVAL): "protocol",
    ("*", errno.ENOTTY): "protocol",
}


@dataclass(frozen=True, slots=True)
class Struct:
    name: str
    fields: tuple[tuple[str, str], ...]

    @property
    def format(self) -> str:
        return "<" + "".join(f for _, f in self.fields)

    @property
    def size(self) -> int:
        return struct.calcsize(self.format)

    def pack(self, **values: int | bytes) -> bytes:
        return struct.pack(self.format, *(values.get(n, 0) for n, _ in self.fields))

    def unpack(self, data: bytes) -> dict[str, int | bytes]:
        return dict(zip((n for n, _ in self.fields), struct.unpack(self.format, data), strict=True))


def structure(name: str) -> Struct:
    return Struct(name, STRUCTS[name])


def ioc(direction: int, number: int, size: int, magic: str = IOC_MAGIC) -> int:
    """_IOC() of include/uapi/asm-generic/ioctl.h (x86: 2 dir bits, 14 size bits)."""
    return (direction << 30) | (size << 16) | (ord(magic) << 8) | number


def command(name: str) -> int:
    direction, number, sname = COMMANDS[name]
    size = structure(sname).size if sname else 0
    return ioc(_DIRS[direction], number, size)


def error_code(command_name: str, err: int) -> str:
    return ERRORS.get((command_name, err)) or ERRORS.get(("*", err)) or "target"
