"""x86-64 instruction reader: bytes -> :class:`ksim.arch.base.Insn`.

Decoding is capstone's.  Full capstone detail is slow (~0.09 M insn/s against
~0.8 M insn/s for ``disasm_lite``), so the reader sweeps with ``disasm_lite`` and
asks for detail only for what the mnemonic and operand text cannot give: the
registers read and written.  Those depend only on the instruction's text, and not
on the numbers in it (see ``_NUMBER``), so they are computed once per class of
text and cached; :func:`classify` is the one place that turns a text into flow,
target and effects, for ``decode`` and for the bulk scan of whole kernels
(:mod:`ksim.arch.x86_64.scan`) alike.  The detail is read through capstone's C
interface (``cs_regs_access``), not the binding's per-instruction objects.

Register effects are reported the way a liveness analysis needs them:

* sub-registers map to their 64-bit names (``eax``, ``ax``, ``al``, ``ah`` -> ``rax``);
* a write to a 32-bit register zero-extends into the full register (Intel SDM vol. 1,
  3.4.1.1), so it is a full write;
* a write to an 8- or 16-bit register keeps the rest of the register, and
  conditional writes (cmovcc, cmpxchg, bsf/bsr, ...) may not happen: such
  registers are reported as read as well as written, so no analysis kills them;
* ``flags`` stands for the status flags plus DF; an instruction that writes only
  some of them (inc/dec, cld, shifts by ``cl``, which leave flags alone when the
  count is zero) also reads ``flags``.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator

import capstone
from capstone import x86_const as X

from ksim.arch.base import CallOperand, Flow, Insn
from ksim.errors import CallOperandError, DecodeError

from .regs import ALL_REGS, GPR64

__all__ = [
    "GPRS",
    "ALL_REGS",
    "EFFECTS",
    "canonical_reg",
    "classify",
    "detail",
    "reg_width",
    "decode",
    "decode_one",
    "decode_lite",
    "flows",
    "insn_lengths",
    "call_operand",
]

#: the sixteen general-purpose registers by their 64-bit names, in encoding order
GPRS: tuple[str, ...] = GPR64

# Sub-register names -> (64-bit name, width in bits).  Data, not code.
_LEGACY = {  # 64, 32, 16, low 8, high 8
    "rax": ("eax", "ax", "al", "ah"),
    "rcx": ("ecx", "cx", "cl", "ch"),
    "rdx": ("edx", "dx", "dl", "dh"),
    "rbx": ("ebx", "bx", "bl", "bh"),
    "rsp": ("esp", "sp", "spl", None),
    "rbp": ("ebp", "bp", "bpl", None),
    "rsi": ("esi", "si", "sil", None),
    "rdi": ("edi", "di", "dil", None),
}
_REG_WIDTH: dict[str, tuple[str, int]] = {}
for _full, (_r32, _r16, _r8, _r8h) in _LEGACY.items():
    _REG_WIDTH.update({_full: (_full, 64), _r32: (_full, 32), _r16: (_full, 16), _r8: (_full, 8)})
    if _r8h:
        _REG_WIDTH[_r8h] = (_full, 8)
for _n in range(8, 16):
    _REG_WIDTH.update({f"r{_n}": (f"r{_n}", 64), f"r{_n}d": (f"r{_n}", 32),
                       f"r{_n}w": (f"r{_n}", 16), f"r{_n}b": (f"r{_n}", 8)})
_REG_WIDTH["rflags"] = ("flags", 64)
_REG_WIDTH["eflags"] = ("flags", 64)
_REG_WIDTH["flags"] = ("flags", 64)


def canonical_reg(name: str) -> str | None:
    """The 64-bit name of a general-purpose (sub-)register, "flags", or None."""
    hit = _REG_WIDTH.get(name)
    return hit[0] if hit else None


def reg_width(name: str) -> int | None:
    """Width in bits of a general-purpose (sub-)register name, or None."""
    hit = _REG_WIDTH.get(name)
    return hit[1] if hit else None


# --- control flow: tables by mnemonic (prefixes such as notrack/bnd/rep stripped) ---
_JCC = frozenset({
    "ja", "jae", "jb", "jbe", "je", "jg", "jge", "jl", "jle", "jne", "jno", "jnp", "jns",
    "jo", "jp", "js", "jcxz", "jecxz", "jrcxz", "loop", "loope", "loopne",
    "xbegin",  # falls through, or resumes at its abort address
})
_RET = frozenset({"ret", "retf", "retfq"})
_STOP = frozenset({
    "hlt", "ud0", "ud1", "ud2", "int3", "int1", "iret", "iretd", "iretq",
    "sysret", "sysretq", "sysexit", "sysexitq", "sysenter", "vmlaunch", "vmresume",
})
_JMP = frozenset({"jmp", "ljmp"})
_CALL = frozenset({"call", "lcall"})

# --- register effects capstone 5 leaves out (checked against the SDM) --------------
_EXTRA_READS: dict[str, frozenset[str]] = {
    "cmpxchg": frozenset({"rax"}),
    "monitor": frozenset({"rax", "rcx", "rdx"}),
    "monitorx": frozenset({"rax", "rcx", "rdx"}),
    "mwait": frozenset({"rax", "rcx"}),
    "mwaitx": frozenset({"rax", "rcx", "rbx"}),
    "wrpkru": frozenset({"rax", "rcx", "rdx"}),
    "rdpkru": frozenset({"rcx"}),
    # hypercalls pass their arguments in registers the decoder cannot know
    "vmcall": frozenset(GPRS),
    "vmmcall": frozenset(GPRS),
}
_EXTRA_WRITES: dict[str, frozenset[str]] = {
    "cmpxchg": frozenset({"rax", "flags"}),
    "syscall": frozenset({"rcx", "r11"}),
    "rdpkru": frozenset({"rax", "rdx"}),
}
# Instructions whose register writes may not happen, or happen only in part.
_CONDITIONAL_WRITE_PREFIXES = ("cmov", "cmpxchg", "bsf", "bsr", "xbegin")
# Zeroing idioms: the result does not depend on the operand ("xor eax, eax").
_ZEROING = frozenset({"xor", "sub"})

_STATUS_FLAGS = ("AF", "CF", "SF", "ZF", "PF", "OF")
_FLAGS_WRITE_KINDS = ("MODIFY", "RESET", "SET", "UNDEFINED")


def _flag_mask(kinds: tuple[str, ...], flags: tuple[str, ...]) -> int:
    mask = 0
    for kind in kinds:
        for flag in flags:
            mask |= getattr(X, f"X86_EFLAGS_{kind}_{flag}", 0)
    return mask


_ALL_FLAGS = ("AF", "CF", "SF", "ZF", "PF", "OF", "DF", "IF", "TF", "NT", "RF", "AC", "0F")
_FLAGS_TESTED = _flag_mask(("TEST", "PRIOR"), _ALL_FLAGS)
_FLAGS_WRITTEN = _flag_mask(_FLAGS_WRITE_KINDS, _ALL_FLAGS)
#: per status flag, the bits meaning "this instruction gives it a new value"
_STATUS_WRITE_MASKS = tuple(_flag_mask(_FLAGS_WRITE_KINDS, (f,)) for f in _STATUS_FLAGS)

_HEX = re.compile(r"^(?:0x[0-9a-f]+|[0-9]+)$")
_RIP_DISP = re.compile(r"\[rip(?: ([+-]) (0x[0-9a-f]+|[0-9]+))?\]")


def _make_cs(detail: bool) -> capstone.Cs:
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = detail
    return cs


_CS_LITE = _make_cs(False)
_CS_FULL = _make_cs(True)

#: every distinct (reads, writes) pair met so far; an instruction's effects are an
#: index into it (append-only, so an index stays valid for the life of the process)
EFFECTS: list[tuple[frozenset[str], frozenset[str]]] = []
_EFFECT_IDS: dict[tuple[frozenset[str], frozenset[str]], int] = {}

# Register effects depend on the operation and its registers, never on the value
# of an immediate, a displacement or a RIP-relative offset (capstone's access
# tables are per opcode).  So they are computed once per *class* of instruction
# text -- the text with every hexadecimal number replaced by "#" -- which a whole
# vmlinux has ~40 K of, against ~270 K distinct texts (checked equal, text by text,
# on the Debian 6.1 vmlinux, even with decimal numbers merged as well).  Register
# names hold no "0x".
_NUMBER = re.compile(r"0x[0-9a-f]+")
# (mnemonic, normalised operand text) -> effect index
_CLASSES: dict[tuple[str, str], int] = {}
# (mnemonic, operand text) -> effect index; "" for the operand of a direct branch,
# whose effects do not depend on its target.  Bounded so that a whole-kernel sweep
# cannot grow it without limit.
_EFFECTS_BY_TEXT: dict[tuple[str, str], int] = {}
_EFFECTS_MAX = 400_000


def _base(mnemonic: str) -> str:
    """The operation without its prefixes ("notrack jmp" -> "jmp", "repz ret" -> "ret")."""
    return mnemonic.rsplit(" ", 1)[-1]


def _branch_kinds(mnemonic: str) -> tuple[Flow | None, Flow]:
    """(flow when the operand is an immediate target, flow otherwise) for a mnemonic."""
    base = _base(mnemonic)
    if base in _JCC:
        return Flow.JCC, Flow.JCC
    if base in _JMP:
        return (Flow.JMP if base == "jmp" else None), Flow.JMP_INDIRECT
    if base in _CALL:
        return (Flow.CALL if base == "call" else None), Flow.CALL_INDIRECT
    if base in _RET:
        return None, Flow.RET
    if base in _STOP:
        return None, Flow.STOP
    return None, Flow.SEQ


# full mnemonic (with prefixes) -> _branch_kinds(mnemonic); filled as mnemonics are met
_KINDS: dict[str, tuple[Flow | None, Flow]] = {}


def _pc_ref(op_str: str, end: int) -> int | None:
    if "rip" not in op_str:
        return None
    m = _RIP_DISP.search(op_str)
    if m is None:
        return None
    disp = int(m.group(2), 0) if m.group(2) else 0
    return (end - disp if m.group(1) == "-" else end + disp) & 0xFFFFFFFFFFFFFFFF


def _intern_effects(reads: frozenset[str], writes: frozenset[str]) -> int:
    key = (reads, writes)
    index = _EFFECT_IDS.get(key)
    if index is None:
        index = _EFFECT_IDS[key] = len(EFFECTS)
        EFFECTS.append(key)
    return index


def _effects(raw: bytes, address: int, mnemonic: str, op_str: str) -> tuple[frozenset[str], frozenset[str]]:
    """Registers read and written, from capstone's detail plus the rules above."""
    regs_read, regs_write, eflags = _detail(raw, address)
    base = _base(mnemonic)
    reads: set[str] = set()
    writes: set[str] = set()
    for reg in regs_read:
        hit = _reg_by_id(reg)
        if hit:
            reads.add(hit[0])
    for reg in regs_write:
        hit = _reg_by_id(reg)
        if hit:
            writes.add(hit[0])
            if hit[1] < 32:  # partial write: the rest of the register survives
                reads.add(hit[0])
    if eflags & _FLAGS_TESTED:
        reads.add("flags")
    if eflags & _FLAGS_WRITTEN:
        writes.add("flags")
    reads |= _EXTRA_READS.get(base, frozenset())
    writes |= _EXTRA_WRITES.get(base, frozenset())
    if "flags" in writes:
        partial = not all(eflags & m for m in _STATUS_WRITE_MASKS)
        # a shift or rotate by cl leaves every flag alone when the count is zero
        if partial or (base[:2] in ("sh", "sa", "ro", "rc") and "cl" in op_str):
            reads.add("flags")
    repeated = mnemonic.startswith("rep") and " " in mnemonic  # may run zero times
    if base.startswith(_CONDITIONAL_WRITE_PREFIXES) or repeated:
        reads |= writes
    if base in _ZEROING:
        ops = [o.strip() for o in op_str.split(",")]
        # only 32/64-bit forms: "xor al, al" keeps the rest of rax
        if len(ops) == 2 and ops[0] == ops[1] and _REG_WIDTH.get(ops[0], ("", 0))[1] >= 32:
            reads.discard(_REG_WIDTH[ops[0]][0])
    reads.discard("rip")
    writes.discard("rip")
    return frozenset(reads), frozenset(writes)


# --- capstone's detail, read through its C interface -------------------------------
# The Python binding copies the whole detail structure into Python objects for
# every instruction (~80 us); the registers and flags are all that is needed here.
_INSN_PTR = ctypes.POINTER(capstone._cs_insn)
_REG_NAMES: dict[int, tuple[str, int] | None] = {}


def _detail(raw: bytes, address: int) -> tuple[list[int], list[int], int]:
    """(registers read, registers written, eflags) of the instruction ``raw`` at
    ``address``, as capstone's ``cs_regs_access`` and x86 detail report them."""
    cs = _CS_FULL
    insns = _INSN_PTR()
    count = capstone._cs.cs_disasm(cs.csh, raw, len(raw), address, 1, ctypes.byref(insns))
    if not count:
        raise DecodeError(f"undecodable bytes at {address:#x}: {raw.hex()}")
    try:
        reads = (ctypes.c_uint16 * 64)()
        writes = (ctypes.c_uint16 * 64)()
        n_reads, n_writes = ctypes.c_uint8(), ctypes.c_uint8()
        status = capstone._cs.cs_regs_access(cs.csh, insns, ctypes.byref(reads), ctypes.byref(n_reads),
                                             ctypes.byref(writes), ctypes.byref(n_writes))
        if status != capstone.CS_ERR_OK:
            raise DecodeError(f"no register access for {raw.hex()} at {address:#x} (capstone {status})")
        eflags = insns[0].detail.contents.arch.x86.flags.eflags
        return reads[:n_reads.value], writes[:n_writes.value], eflags
    finally:
        capstone._cs.cs_free(insns, count)


def _reg_by_id(reg: int) -> tuple[str, int] | None:
    """(64-bit name, width) of capstone's register ``reg``; None if liveness ignores it."""
    if reg not in _REG_NAMES:
        name = capstone._cs.cs_reg_name(_CS_FULL.csh, reg)
        _REG_NAMES[reg] = _REG_WIDTH.get(name.decode("ascii")) if name else None
    return _REG_NAMES[reg]


def classify(mnemonic: str, op_str: str, raw: bytes, address: int) -> tuple[Flow, int | None, int]:
    """(flow, direct target, index into :data:`EFFECTS`) of one decoded instruction."""
    kinds = _KINDS.get(mnemonic)
    if kinds is None:
        kinds = _KINDS[mnemonic] = _branch_kinds(mnemonic)
    direct, flow = kinds
    target = None
    key = (mnemonic, op_str)
    if direct is not None and op_str[:2] == "0x" and _HEX.match(op_str):
        # the effects of a direct branch do not depend on its target: one cache entry
        flow, target, key = direct, int(op_str, 16), (mnemonic, "")
    effects = _EFFECTS_BY_TEXT.get(key)
    if effects is None:
        norm = (mnemonic, _NUMBER.sub("#", key[1]))
        effects = _CLASSES.get(norm)
        if effects is None:
            effects = _CLASSES[norm] = _intern_effects(*_effects(bytes(raw), address, mnemonic, op_str))
        if len(_EFFECTS_BY_TEXT) >= _EFFECTS_MAX:
            _EFFECTS_BY_TEXT.clear()
        _EFFECTS_BY_TEXT[key] = effects
    return flow, target, effects


def _build(code: bytes, offset: int, address: int, size: int, mnemonic: str, op_str: str) -> Insn:
    raw = bytes(code[offset : offset + size])
    flow, target, effects = classify(mnemonic, op_str, raw, address)
    reads, writes = EFFECTS[effects]
    pc_ref = _pc_ref(op_str, address + size) if "rip" in op_str else None
    return Insn(address, size, raw, mnemonic, op_str, flow, target, pc_ref, reads, writes)


def decode(code: bytes, address: int) -> Iterator[Insn]:
    """Decode ``code`` (placed at ``address``) by linear sweep.

    Stops silently at the first bytes that do not decode; callers that need to
    know compare the last instruction's end with ``address + len(code)``.
    """
    for addr, size, mnemonic, op_str in _CS_LITE.disasm_lite(code, address):
        yield _build(code, addr - address, addr, size, mnemonic, op_str)


def sweep_writes(code: bytes, address: int) -> tuple[frozenset[str], int]:
    """(every register the instructions of a linear sweep of ``code`` write, as
    :func:`decode` gives each one's ``writes``; how many bytes the sweep decoded),
    without building the instructions."""
    written: set[str] = set()
    length = 0
    for addr, size, mnemonic, op_str in _CS_LITE.disasm_lite(code, address):
        offset = addr - address
        _flow, _target, effects = classify(mnemonic, op_str, bytes(code[offset:offset + size]), addr)
        written |= EFFECTS[effects][1]
        length += size
    return frozenset(written), length


def decode_one(code: bytes, address: int) -> Insn:
    """Decode the single instruction at the start of ``code``; DecodeError if there is none."""
    for addr, size, mnemonic, op_str in _CS_LITE.disasm_lite(code[:15], address, 1):
        return _build(code, 0, addr, size, mnemonic, op_str)
    raise DecodeError(f"undecodable bytes at {address:#x}: {bytes(code[:15]).hex() or '(none)'}")


def decode_lite(code: bytes, address: int) -> Iterator[tuple[int, int, str, str]]:
    """Fast path: (address, size, mnemonic, op_str) only, no register effects."""
    return _CS_LITE.disasm_lite(code, address)


def flows(code: bytes, address: int) -> Iterator[tuple[int, int, Flow, int | None]]:
    """Fast path for control flow only: (address, size, flow, direct target) of each
    instruction of a linear sweep, without register effects (call graphs)."""
    for addr, size, mnemonic, op_str in _CS_LITE.disasm_lite(code, address):
        kinds = _KINDS.get(mnemonic)
        if kinds is None:
            kinds = _KINDS[mnemonic] = _branch_kinds(mnemonic)
        direct, flow = kinds
        if direct is not None and op_str[:2] == "0x" and _HEX.match(op_str):
            yield addr, size, direct, int(op_str, 16)
        else:
            yield addr, size, flow, None


def insn_lengths(code: bytes, address: int) -> Iterator[tuple[int, int]]:
    """Fastest path: (address, size) of each instruction of a linear sweep."""
    for addr, size, _m, _o in _CS_LITE.disasm_lite(code, address):
        yield addr, size


def detail(insn: Insn) -> capstone.CsInsn:
    """Capstone's full decoding of ``insn``, operands and all.  It is slow (see the
    module doc): for the few instructions whose operands matter, never a sweep."""
    return next(_CS_FULL.disasm(insn.raw, insn.address, 1))


def call_operand(insn: Insn) -> CallOperand | None:
    """The operand an indirect call reads its destination from (None if ``insn`` is
    not an indirect call).  Capstone's detail gives base, index, scale, disp and
    segment (SDM Vol. 2A, 2.1.5: the effective address is base + index*scale + disp);
    a RIP-relative operand becomes its absolute address (``pc_ref``)."""
    if insn.flow is not Flow.CALL_INDIRECT or _base(insn.mnemonic) != "call":
        return None
    full = detail(insn)
    op = full.operands[0]
    if op.type == X.X86_OP_REG:
        return CallOperand(reg=_full_width(full.reg_name(op.reg), insn))
    base = full.reg_name(op.mem.base) if op.mem.base else None
    index = full.reg_name(op.mem.index) if op.mem.index else None
    segment = full.reg_name(op.mem.segment) if op.mem.segment else None
    if base == "rip":
        assert insn.pc_ref is not None
        return CallOperand(disp=insn.pc_ref, size=op.size, segment=segment)
    return CallOperand(base=base and _full_width(base, insn), index=index and _full_width(index, insn),
                       scale=op.mem.scale, disp=op.mem.disp, size=op.size, segment=segment)


def _full_width(name: str, insn: Insn) -> str:
    """A 64-bit register name; a narrower one (addr32 addressing) is refused: the
    address would wrap at 4 GB, which the snippet's 64-bit arithmetic does not do."""
    if reg_width(name) != 64:
        raise CallOperandError(f"{insn}: operand register {name} is not 64 bits wide")
    return name
