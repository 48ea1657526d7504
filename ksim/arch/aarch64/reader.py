"""AArch64 instruction reader: bytes -> :class:`ksim.arch.base.Insn`.

Decoding is capstone's (``CS_ARCH_ARM64``).  Every A64 instruction is one
little-endian 32-bit word (Arm ARM DDI 0487, chapter C1), so a sweep never loses sync;
it stops at the first word capstone does not decode.

Control flow comes from capstone's instruction ids and condition code, never from
the text: ``B`` is a jump (a jcc when it carries a condition other than AL/NV),
``CBZ``/``CBNZ``/``TBZ``/``TBNZ`` jccs, ``BL`` a call, ``BLR`` (and the
pointer-authenticating ``BLRAA``...) an indirect call, ``BR`` (``BRAA``...) an
indirect jump, ``RET``/``RETAA``/``RETAB`` a return, and ``BRK``, ``HLT``,
``UDF``, ``ERET`` (and ``ERETAA``/``ERETAB``, ``DRPS``) stop.  Direct targets and
PC-relative references (``ADR``, ``ADRP``'s page, the literal loads) are computed
from the encoding (:mod:`ksim.arch.aarch64.pcrel`).

Register effects are the ones a liveness analysis needs, in canonical names
(:func:`ksim.arch.aarch64.regs.canonical_reg`: ``w5`` -> ``x5``, ``lr`` -> ``x30``,
the zero register dropped, ``nzcv`` for the flags).  A write to a W register
zero-extends into the X register (Arm ARM, "Register names"), so it is a full write.  They
start from capstone's ``regs_access``, which capstone 5 gets wrong for AArch64 in
ways that matter, and which are corrected here (each rule is covered by a test):

* a register operand whose access capstone leaves unknown (the LSE atomics CAS,
  LDADD, SWP...; the Xt of DC, IC, AT, TLBI, SYS) is read *and* written: a
  conservative answer no liveness analysis can be misled by;
* ``CMP``/``CMN``/``TST`` are ``SUBS``/``ADDS``/``ANDS`` into the zero register, but
  capstone reports their first operand as written: it is only read;
* ``CBZ``/``CBNZ`` and ``B.AL``/``B.NV`` do not read the flags; a plain ``RET``
  reads x30;
* ``SVC`` does not write x30.  ``SVC``, ``HVC`` and ``SMC`` pass arguments and
  results in x0..x17 (SMC Calling Convention, Arm DEN 0028): they read and
  write those, reported as both read and written so no analysis kills them;
* ``MRS Xt, NZCV`` reads the flags, ``MSR NZCV, Xt`` writes them, and an ``MSR``
  to a PSTATE field (DAIFSet, PAN, ...) does not;
* the FlagM instructions (``SETF8``, ``SETF16``, ``RMIF``, ``CFINV``, ``AXFLAG``,
  ``XAFLAG``) change only some flags: they read them as well.

Effects depend on the word with its PC-relative immediate cleared
(:func:`ksim.arch.aarch64.pcrel.class_key`), so they are computed once per such
class and cached.
"""

from __future__ import annotations

from collections.abc import Iterator

import capstone
from capstone import arm64_const as A

from ksim.arch.base import CallOperand, Flow, Insn
from ksim.errors import CallOperandError, DecodeError

from . import pcrel
from .regs import FLAGS, canonical_reg

__all__ = ["classify", "decode", "decode_one", "flows", "call_operand", "canonical_reg"]

# --- control flow: capstone instruction ids -> Flow (data) ----------------------------
_FLOW_BY_ID: dict[int, Flow] = {
    A.ARM64_INS_BL: Flow.CALL,
    A.ARM64_INS_CBZ: Flow.JCC,
    A.ARM64_INS_CBNZ: Flow.JCC,
    A.ARM64_INS_TBZ: Flow.JCC,
    A.ARM64_INS_TBNZ: Flow.JCC,
    **dict.fromkeys((A.ARM64_INS_BLR, A.ARM64_INS_BLRAA, A.ARM64_INS_BLRAAZ,
                     A.ARM64_INS_BLRAB, A.ARM64_INS_BLRABZ), Flow.CALL_INDIRECT),
    **dict.fromkeys((A.ARM64_INS_BR, A.ARM64_INS_BRAA, A.ARM64_INS_BRAAZ,
                     A.ARM64_INS_BRAB, A.ARM64_INS_BRABZ), Flow.JMP_INDIRECT),
    **dict.fromkeys((A.ARM64_INS_RET, A.ARM64_INS_RETAA, A.ARM64_INS_RETAB), Flow.RET),
    **dict.fromkeys((A.ARM64_INS_BRK, A.ARM64_INS_HLT, A.ARM64_INS_UDF, A.ARM64_INS_ERET,
                     A.ARM64_INS_ERETAA, A.ARM64_INS_ERETAB, A.ARM64_INS_DRPS), Flow.STOP),
}
#: B and BC carry a condition: none, AL or NV mean "always" (Arm ARM, "Condition code" table)
_COND_BRANCHES = frozenset({A.ARM64_INS_B, A.ARM64_INS_BC})
_ALWAYS = frozenset({A.ARM64_CC_INVALID, A.ARM64_CC_AL, A.ARM64_CC_NV})
_DIRECT = frozenset({Flow.JMP, Flow.JCC, Flow.CALL})

# --- register-effect corrections (see the module doc) -----------------------------------
_COMPARE_ALIASES = frozenset({A.ARM64_INS_CMP, A.ARM64_INS_CMN, A.ARM64_INS_TST})
_SUPERVISOR_CALLS = frozenset({A.ARM64_INS_SVC, A.ARM64_INS_HVC, A.ARM64_INS_SMC})
_SMCCC_REGS = frozenset(f"x{n}" for n in range(18))
_PARTIAL_FLAG_WRITERS = frozenset({A.ARM64_INS_SETF8, A.ARM64_INS_SETF16, A.ARM64_INS_RMIF,
                                   A.ARM64_INS_CFINV, A.ARM64_INS_AXFLAG, A.ARM64_INS_XAFLAG})
_RETURNS = frozenset({A.ARM64_INS_RET, A.ARM64_INS_RETAA, A.ARM64_INS_RETAB})


def _make_cs(detail: bool) -> capstone.Cs:
    cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
    cs.detail = detail
    return cs


_CS_LITE = _make_cs(False)
_CS_FULL = _make_cs(True)

#: class key (the word without its PC-relative immediate) -> (flow, reads, writes)
_CLASSES: dict[int, tuple[Flow, frozenset[str], frozenset[str]]] = {}
_CLASSES_MAX = 400_000


def _names(insn: capstone.CsInsn, regs: list[int] | tuple[int, ...]) -> set[str]:
    out = set()
    for reg in regs:
        name = canonical_reg(insn.reg_name(reg) or "")
        if name is not None:
            out.add(name)
    return out


def _effects(insn: capstone.CsInsn) -> tuple[frozenset[str], frozenset[str]]:
    """Registers read and written: capstone's, corrected (module doc)."""
    regs_read, regs_write = insn.regs_access()
    reads, writes = _names(insn, regs_read), _names(insn, regs_write)
    if insn.update_flags:
        writes.add(FLAGS)
    if insn.cc not in _ALWAYS:
        reads.add(FLAGS)
    ops = insn.operands
    for op in ops:
        if op.type == A.ARM64_OP_REG and op.access == 0:
            unknown = _names(insn, (op.reg,))
            reads |= unknown
            writes |= unknown
    ident = insn.id
    if ident in _COMPARE_ALIASES:
        reads |= writes - {FLAGS}
        writes &= {FLAGS}
    if ident in (A.ARM64_INS_CBZ, A.ARM64_INS_CBNZ) or (
            ident in _COND_BRANCHES and insn.cc in _ALWAYS):
        reads.discard(FLAGS)
    if ident in _RETURNS and not any(op.type == A.ARM64_OP_REG for op in ops):
        reads.add("x30")
    if ident in _SUPERVISOR_CALLS:
        writes.discard("x30")
        reads |= _SMCCC_REGS
        writes |= _SMCCC_REGS
    if ident in (A.ARM64_INS_MRS, A.ARM64_INS_MSR):
        writes.discard(FLAGS)
        nzcv = any(op.type == A.ARM64_OP_SYS and op.reg == A.ARM64_SYSREG_NZCV for op in ops)
        if nzcv:
            (reads if ident == A.ARM64_INS_MRS else writes).add(FLAGS)
    if ident in _PARTIAL_FLAG_WRITERS:
        reads.add(FLAGS)
        writes.add(FLAGS)
    return frozenset(reads), frozenset(writes)


def _flow(insn: capstone.CsInsn) -> Flow:
    if insn.id in _COND_BRANCHES:
        return Flow.JMP if insn.cc in _ALWAYS else Flow.JCC
    return _FLOW_BY_ID.get(insn.id, Flow.SEQ)


def classify(word: int) -> tuple[Flow, frozenset[str], frozenset[str]]:
    """(flow, registers read, registers written) of the instruction word ``word``;
    DecodeError if capstone does not decode it."""
    key = pcrel.class_key(word)
    hit = _CLASSES.get(key)
    if hit is not None:
        return hit
    insn = next(_CS_FULL.disasm(key.to_bytes(4, "little"), 0, 1), None)
    if insn is None:
        raise DecodeError(f"undecodable word {word:#010x}")
    hit = (_flow(insn), *_effects(insn))
    if len(_CLASSES) >= _CLASSES_MAX:
        _CLASSES.clear()
    _CLASSES[key] = hit
    return hit


def _build(raw: bytes, address: int, mnemonic: str, op_str: str) -> Insn:
    word = int.from_bytes(raw, "little")
    flow, reads, writes = classify(word)
    form = pcrel.form_of(word)
    target = pc_ref = None
    if form is not None:
        where = form.target(word, address)
        if flow in _DIRECT:
            target = where
        elif form in (pcrel.ADR, pcrel.ADRP, pcrel.LDR_LITERAL):
            pc_ref = where
    return Insn(address, 4, raw, mnemonic, op_str, flow, target, pc_ref, reads, writes)


def decode(code: bytes, address: int) -> Iterator[Insn]:
    """Decode ``code`` (placed at ``address``) by linear sweep, one word at a time.

    Stops silently at the first word that does not decode (and ignores a trailing
    partial word); callers that need to know compare the last instruction's end
    with ``address + len(code)``.
    """
    for addr, _size, mnemonic, op_str in _CS_LITE.disasm_lite(code, address):
        at = addr - address
        yield _build(bytes(code[at:at + 4]), addr, mnemonic, op_str)


def decode_one(code: bytes, address: int) -> Insn:
    """Decode the single instruction at the start of ``code``; DecodeError if there is none."""
    for addr, _size, mnemonic, op_str in _CS_LITE.disasm_lite(code[:4], address, 1):
        return _build(bytes(code[:4]), addr, mnemonic, op_str)
    raise DecodeError(f"undecodable bytes at {address:#x}: {bytes(code[:4]).hex() or '(none)'}")


def flows(code: bytes, address: int) -> Iterator[tuple[int, int, Flow, int | None]]:
    """(address, size, flow, direct target) of each instruction of a linear sweep,
    without building :class:`Insn` objects (call graphs)."""
    for addr, _size, _m, _o in _CS_LITE.disasm_lite(code, address):
        at = addr - address
        word = int.from_bytes(code[at:at + 4], "little")
        flow = classify(word)[0]
        form = pcrel.form_of(word) if flow in _DIRECT else None
        yield addr, 4, flow, form.target(word, addr) if form is not None else None


# --- indirect calls --------------------------------------------------------------------------
#: BLR Xn: 1101011 0001 11111 000000 Rn 00000 (Arm ARM, "BLR")
_BLR_MASK, _BLR = 0xFFFFFC1F, 0xD63F0000


def call_operand(insn: Insn) -> CallOperand | None:
    """The register an indirect call takes its destination from (None if ``insn``
    is no indirect call).  ``BLRAA``/``BLRAB`` (and their Z forms) call through a
    pointer signed with a pointer-authentication code: the register holds the
    signed value, not the destination, so snippet code could not evaluate it."""
    if insn.flow is not Flow.CALL_INDIRECT:
        return None
    word = int.from_bytes(insn.raw, "little")
    if word & _BLR_MASK != _BLR:
        raise CallOperandError(f"{insn}: the destination is a pointer-authenticated value")
    return CallOperand(reg=f"x{(word >> 5) & 31}")
