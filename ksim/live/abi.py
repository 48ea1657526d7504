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

ABI_VERSION = 7
DEVICE = "/dev/kerninst"
#: the architecture (a ``ksim.arch`` name) of a live kernel whose daemon names none:
#: kmod/kerninst.c is built for x86-64 and arm64, and the module's info names no
#: architecture, so kerninstd says which one it runs on (its info's "arch", from
#: ``uname -m``: ``MACHINES``), and a daemon that does not is taken for x86-64
#: (``LiveTarget.arch``).
MACHINE = "x86_64"
IOC_MAGIC = "K"

# Limits, as in kerninst.h.
LIMITS: dict[str, int] = {
    "MAX_IO": 65536,
    "MAX_WRITES": 262144,        # writes per poke batch (and route changes)
    "MAX_POKE_BYTES": 16 << 20,  # new bytes per poke batch, its writes together
    "MAX_TEXT_WRITE": 16,
    "MAX_CODE_WRITE": 4096,
    "MAX_ROUTES": 65536,     # default of the module parameter max_routes
    "MAX_SPLICES": 65536,    # default of the module parameter max_splices
    "NAME_LEN": 128,
    "MAX_RANGES": 1024,
    "MAX_AREA_BYTES": 256 << 20,  # all areas: default of the module parameter max_area_bytes
    "MAX_ROWS": 262144,             # rows per READ_ROWS or DIGEST_ROWS request
    "MAX_ROWS_BYTES": 32 << 20,     # bytes such a request reads, its rows together
    "DIGEST_SIZE": 8,               # bytes of a DIGEST_ROWS row's digest (XXH64)
}

# Hazard name -> its KERNINST_HAZARD_* bit: why the kernel relies on text staying
# as it is.  The names are the wire names (ksim.live.protocol's ``hazards`` op).
HAZARDS: dict[str, int] = {
    "ftrace": 1 << 0,       # an ftrace location (ftrace_location_range)
    "jump_label": 1 << 1,   # a jump-label site (jump_label_text_reserved)
    "static_call": 1 << 2,  # a static-call site (static_call_text_reserved)
    "kprobe": 1 << 3,       # a registered kprobe at a byte of the range or up to 4 bytes before
    "blacklist": 1 << 4,    # kprobes blacklist; entry, noinstr, kprobes text; kerninst itself
    "extable": 1 << 5,      # an instruction with an exception-table entry starts in the range
    "bug": 1 << 6,          # the ud2 of a BUG() (find_bug)
    "warn": 1 << 7,         # the ud2 of a WARN() (find_bug, BUGFLAG_WARNING)
    "not_text": 1 << 8,     # neither core kernel text nor one live module's text
    "unknown": 1 << 9,      # a check could not be made (its kernel symbol is missing)
    # arm64 only (an x86-64 module never sets them)
    "branch_prot": 1 << 10,  # a BTI landing pad, or a pointer-authentication check
    "exclusive": 1 << 11,    # between a load-exclusive and its store-exclusive
}

#: KERNINST_ARM64_BRK_IMM: the immediate of the BRK the arm64 module routes
ARM64_BRK_IMM = 0x2B5
#: the immediate of the trap the module routes, by the architecture its kernel runs
#: (a ``ksim.arch`` name) where that trap has one: a client writes the Arch's
#: ``trap_with(immediate)`` where a route waits (x86-64's int3 has none)
TRAP_IMMEDIATES: dict[str, int] = {"aarch64": ARM64_BRK_IMM}
#: KERNINST_CODE_FILL_*: what every byte of unused patch code holds, and so every
#: code block the module's CLAIM hands out, by the architecture (a ``ksim.arch``
#: name): the header's number and its width in bytes, little-endian (code_fill)
CODE_FILL: dict[str, tuple[int, int]] = {"x86_64": (0xCC, 1), "aarch64": (0xD4202000, 4)}
#: ``uname -m`` of a kernel the module runs on -> that architecture's ``ksim.arch`` name
MACHINES: dict[str, str] = {"x86_64": "x86_64", "aarch64": "aarch64"}

# KERNINST_OWNER_* flag name -> bit.
OWNER_FLAGS: dict[str, int] = {
    "kept": 1 << 0,     # outlives its session; re-adopted by name
    "orphan": 1 << 1,   # a drop could not undo all its text: kept, its blocks never reused
}

# KERNINST_REGION_* name -> value: where a block is claimed.
REGIONS: dict[str, int] = {"code": 1, "data": 2}

# struct name -> ((field, format), ...); every field little-endian, no implicit padding.
STRUCTS: dict[str, tuple[tuple[str, str], ...]] = {
    "kerninst_version": (("version", "I"), ("reserved", "I")),
    "kerninst_info": (
        ("text_start", "Q"), ("text_end", "Q"),
        ("code_start", "Q"), ("code_size", "Q"),
        ("data_start", "Q"), ("data_size", "Q"),
        ("current_task", "Q"), ("cpu_number", "Q"),
        ("task_pid_offset", "I"), ("task_pid_size", "I"),
        ("nr_cpus", "I"), ("version", "I"), ("task_tgid_offset", "I"), ("task_comm_offset", "I"),
    ),
    "kerninst_mem": (("address", "Q"), ("buf", "Q"), ("size", "Q"), ("owner", "Q")),
    "kerninst_write": (
        ("address", "Q"), ("old_buf", "Q"), ("new_buf", "Q"), ("len", "I"), ("reserved", "I"),
    ),
    "kerninst_route": (("site", "Q"), ("patch", "Q")),
    "kerninst_poke": (
        ("writes", "Q"), ("routes", "Q"), ("owner", "Q"),
        ("nr_writes", "I"), ("nr_routes", "I"), ("failed_index", "I"), ("reserved", "I"),
    ),
    "kerninst_lookup": (("name", f"{LIMITS['NAME_LEN']}s"), ("address", "Q")),
    "kerninst_trap": (("site", "Q"), ("patch", "Q"), ("owner", "Q")),
    "kerninst_range": (("address", "Q"), ("len", "I"), ("hazards", "I")),
    "kerninst_hazards": (("ranges", "Q"), ("count", "I"), ("reserved", "I")),
    "kerninst_rows": (
        ("rows", "Q"), ("out", "Q"), ("out_size", "Q"), ("failed", "Q"), ("count", "I"),
        ("reserved", "I"),
    ),
    "kerninst_owner": (
        ("id", "Q"), ("flags", "I"), ("reserved", "I"), ("name", f"{LIMITS['NAME_LEN']}s"),
    ),
    "kerninst_block": (
        ("owner", "Q"), ("address", "Q"), ("size", "Q"), ("region", "I"), ("reserved", "I"),
    ),
    "kerninst_area": (("address", "Q"), ("size", "Q"), ("region", "I"), ("reserved", "I")),
    "kerninst_splice": (
        ("owner", "Q"), ("address", "Q"), ("len", "I"), ("reserved", "I"),
        ("orig", f"{LIMITS['MAX_TEXT_WRITE']}s"), ("cur", f"{LIMITS['MAX_TEXT_WRITE']}s"),
    ),
    "kerninst_state": (
        ("owners", "Q"), ("splices", "Q"), ("routes", "Q"), ("blocks", "Q"), ("areas", "Q"),
        ("nr_owners", "I"), ("nr_splices", "I"), ("nr_routes", "I"), ("nr_blocks", "I"),
        ("nr_areas", "I"), ("reserved", "I"),
    ),
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
    "HAZARDS": ("w", 0x09, "kerninst_hazards"),
    "OWNER_NEW": ("r", 0x0A, "kerninst_owner"),
    "OWNER_KEEP": ("w", 0x0B, "kerninst_owner"),
    "OWNER_ADOPT": ("w", 0x0C, "kerninst_owner"),
    "OWNER_DROP": ("w", 0x0D, "kerninst_owner"),
    "CLAIM": ("w", 0x0E, "kerninst_block"),
    "FREE": ("w", 0x0F, "kerninst_block"),
    "STATE": ("rw", 0x10, "kerninst_state"),
    "AREA_ADD": ("rw", 0x11, "kerninst_area"),
    "AREA_DROP": ("w", 0x12, "kerninst_area"),
    "READ_ROWS": ("w", 0x13, "kerninst_rows"),
    "DIGEST_ROWS": ("w", 0x14, "kerninst_rows"),
}

# (command or "*", errno) -> ksim error code (ksim.errors); the first match wins.
ERRORS: dict[tuple[str, int], str] = {
    ("POKE", errno.ESTALE): "stale-text",
    ("POKE", errno.ERANGE): "outside-text",
    ("POKE", errno.EPERM): "blacklisted",
    ("POKE", errno.EBUSY): "already-spliced",
    ("POKE", errno.ENOSPC): "out-of-memory",
    ("POKE", errno.ENOENT): "unknown-handle",          # a route to clear is none of its owner's
    ("POKE", errno.ENOEXEC): "jump-outside",          # a jump written into text leads elsewhere
    ("SET_TRAP", errno.ERANGE): "outside-text",
    ("SET_TRAP", errno.EPERM): "blacklisted",
    ("SET_TRAP", errno.EBUSY): "already-spliced",
    ("SET_TRAP", errno.ENOSPC): "out-of-memory",
    ("CLEAR_TRAP", errno.ERANGE): "outside-text",
    ("CLEAR_TRAP", errno.EBUSY): "already-spliced",
    ("CLEAR_TRAP", errno.ENOENT): "unknown-handle",
    ("LOOKUP", errno.ENOENT): "unknown-symbol",
    ("WRITE", errno.ERANGE): "target-fault",
    ("OWNER_KEEP", errno.EEXIST): "text-owned",       # another kept owner has the name
    ("OWNER_KEEP", errno.EBUSY): "already-spliced",   # an orphan stays kept
    ("OWNER_ADOPT", errno.ENOENT): "unknown-handle",
    ("OWNER_DROP", errno.ESTALE): "stale-text",       # text changed behind ksim: kept as an orphan
    ("CLAIM", errno.ERANGE): "target-fault",
    ("FREE", errno.ENOENT): "unknown-handle",
    ("FREE", errno.EBUSY): "already-spliced",         # a route or a live jump still leads there
    ("FREE", errno.ETXTBSY): "block-in-use",          # a data block: its owner's patch code is live
    ("AREA_ADD", errno.ENOSPC): "out-of-memory",       # max_area_bytes
    ("AREA_DROP", errno.ENOENT): "unknown-handle",
    ("*", errno.EACCES): "not-privileged",            # no CAP_SYS_ADMIN (open: EPERM)
    ("*", errno.EROFS): "locked-down",                # the kernel is locked down
    ("*", errno.EADDRINUSE): "text-owned",
    ("*", errno.ESRCH): "unknown-handle",             # no such owner
    ("*", errno.ENOMEM): "out-of-memory",
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
        """The structure with ``values``; fields not named are zero (b"" for byte arrays)."""
        return struct.pack(self.format, *(values.get(n, b"" if f.endswith("s") else 0)
                                          for n, f in self.fields))

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


def jump_dest(arch: str, address: int, cur: bytes) -> int | None:
    """Where the jump a text write holds leads, as the module reads it (ki_jump_dest):
    on x86-64 a jmp rel32 (e9) or jmp rel8 (eb) at its first byte, on arm64 (``arch``
    "aarch64") a B at its first instruction; None for anything else."""
    if arch == "aarch64":
        if len(cur) < 4:
            return None
        insn = int.from_bytes(cur[:4], "little")
        if insn & 0xFC000000 != 0x14000000:  # B imm26 (Arm ARM C6.2.26)
            return None
        offset = (insn & 0x03FFFFFF) << 2
        offset -= (offset & (1 << 27)) << 1
    elif len(cur) >= 5 and cur[0] == 0xE9:
        offset = 5 + int.from_bytes(cur[1:5], "little", signed=True)
    elif len(cur) >= 2 and cur[0] == 0xEB:
        offset = 2 + int.from_bytes(cur[1:2], "little", signed=True)
    else:
        return None
    return (address + offset) & (1 << 64) - 1


def code_fill(arch: str) -> bytes | None:
    """What every byte of a new patch block of the module holds on ``arch``, repeated
    (CODE_FILL): a client knows a new block's bytes without reading them.  None where
    the module is not built for ``arch``."""
    found = CODE_FILL.get(arch)
    return None if found is None else found[0].to_bytes(found[1], "little")


def owner_flag_names(flags: int) -> list[str]:
    """The names of the KERNINST_OWNER_* bits set in ``flags``."""
    return [name for name, bit in OWNER_FLAGS.items() if flags & bit]


def hazard_names(flags: int) -> list[str]:
    """The names of the KERNINST_HAZARD_* bits set in ``flags``, in table order."""
    names = [name for name, bit in HAZARDS.items() if flags & bit]
    unknown_bits = flags & ~sum(HAZARDS.values())
    if unknown_bits:  # a newer module: never drop a hazard silently
        names.append("unknown")
    return list(dict.fromkeys(names))
