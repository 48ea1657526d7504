"""Move consecutive A64 instructions elsewhere with the same effect.

Each instruction is classified once (:class:`_Item`): copied as it is, or one of
the PC-relative forms of :mod:`ksim.arch.aarch64.pcrel`, which are re-encoded for
the new place.  A form has *levels*, tried in order, the first that reaches
being used:

==========================  ==============================================================
original                    levels (each one used only when the one before cannot reach)
==========================  ==============================================================
``B label``                 ``B`` (+-128 MB); refused beyond: no register is known free
``BL .+4``                  x30 set to the original return address (``ADR x30``;
                            ``MOVZ/MOVK x30``) and on with the next instruction
``BL label``, ``BLR Xn``    the run's last instruction only: :func:`moved_call`'s form,
(and BLRAA ...)             x30 set to the original return address and a branch
``B.cond``, ``CBZ/CBNZ``,   the same, re-encoded (+-1 MB / +-32 KB); the opposite
``TBZ/TBNZ``                condition over a ``B``: ``B.!cond/CBNZ/TBNZ .+8; B label``
                            (B.AL and B.NV, which always branch: ``B label``)
``ADR Xd, label``           ``ADR``; ``ADRP Xd, label; ADD Xd, Xd, #lo12``;
                            ``MOVZ/MOVK Xd, #label``
``ADRP Xd, page``           ``ADRP``; ``MOVZ/MOVK Xd, #page``
``LDR Wt/Xt, label``,       the literal load re-encoded; ``ADRP Xt, label`` and a load
``LDRSW Xt, label``         through Xt (``LDR Xt, [Xt, #lo12]`` when lo12 is a multiple
                            of the access size, else ``ADD Xt, Xt, #lo12; LDR Xt, [Xt]``);
                            ``MOVZ/MOVK Xt, #label; LDR Xt, [Xt]``.  Xt is about to be
                            overwritten by the load, so it is free to hold the address.
``PRFM <op>, label``        ``PRFM`` re-encoded; ``NOP``: a prefetch is a hint with no
                            architectural effect (Arm ARM, "PRFM"), dropping it is exact
``ADR/ADRP XZR, label``     re-encoded; ``NOP``: the result goes nowhere
``LDR St/Dt/Qt, label``,    the literal load re-encoded; refused beyond +-1 MB, as no
``LDR XZR/WZR, label``      general-purpose register is known free to hold the address
==========================  ==============================================================

A branch whose target is an instruction of the run goes to that instruction's
copy (to ``first_to`` for the first one, when given); an address an ``ADR``,
``ADRP`` or literal load refers to is data and keeps its original value.  The
sizes of the copies depend on where their targets are, so the layout is found by
relaxation: every item starts at level 0, items that do not reach move up a
level, and the layout is recomputed until nothing moves (levels only grow and
are bounded, so this ends).

A call leaves its return address in x30, where the callee, the kernel's unwinders
and the get-pc idiom (``BL .+4; MOV Xd, x30``) read it: a plain ``BL`` at the new
place would leave its copy's address.  So a call moves only in forms that leave
the original one, as on x86-64: the run's last call as :func:`moved_call` writes
it (the callee returns to the original text right after the call, where the
run's copy jumps back to anyway), ``BL .+4`` as the address alone.  A call with
instructions after it in the run is refused (CallInsideRun): returning to the
original text would skip the rest of the copy.

Refused (RelocationError naming the instruction): a branch into the middle of an
instruction, instructions that are not consecutive, a relocated branch out of
every level's reach, any instruction capstone calls PC-relative that the table
above does not know (a copied one would point elsewhere), and the exclusive
loads and stores (``LDXR``, ``LDAXR``, ``STXR``, ``STLXR``, their byte, halfword
and pair forms).  An exclusive pair only succeeds if nothing disturbs the
exclusive monitor between its two halves; a moved half puts the branch to the
patch, the snippets' own memory accesses (and their own exclusives), or a trap's
exception return between them, each of which may clear the monitor (Arm ARM
"Load-Exclusive and Store-Exclusive instruction usage restrictions"),
so the store-exclusive could fail on every retry of its loop.

:func:`moved_call` is the other half: a call moved out of the text whose return
address must stay in the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import capstone
from capstone import arm64_const as A

from ksim.arch.base import Insn, check_consecutive, check_relocation_arguments
from ksim.errors import CallInsideRun, OutOfRange, RelocationError

from . import pcrel
from .regs import AL, IP0, IP1, NV
from .writer import WORD, Writer, mov_imm_words

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = True

#: exclusive loads and stores (Arm ARM C6.2 LDXR ... STLXP), refused (module doc)
_EXCLUSIVES = frozenset({
    A.ARM64_INS_LDXR, A.ARM64_INS_LDXRB, A.ARM64_INS_LDXRH, A.ARM64_INS_LDXP,
    A.ARM64_INS_LDAXR, A.ARM64_INS_LDAXRB, A.ARM64_INS_LDAXRH, A.ARM64_INS_LDAXP,
    A.ARM64_INS_STXR, A.ARM64_INS_STXRB, A.ARM64_INS_STXRH, A.ARM64_INS_STXP,
    A.ARM64_INS_STLXR, A.ARM64_INS_STLXRB, A.ARM64_INS_STLXRH, A.ARM64_INS_STLXP,
})
#: the bit that turns CBZ into CBNZ and TBZ into TBNZ (its "op" field)
_NZ_BIT = 1 << 24
#: the bit that turns BR into BLR, BRAA into BLRAA, ... ("opc" bit 0 of the branch-register class)
_LINK_BIT = 1 << 21
#: BLR Xn and the pointer-authenticating BLRAA/BLRAB Xn, Xm and
#: BLRAAZ/BLRABZ Xn: 1101011 Z 0 0 1 11111 0000 1 M Rn Rm
_BLR_MASK, _BLR = 0xFFFFFC1F, 0xD63F0000
_BLRA_MASK, _BLRA = 0xFEFFF800, 0xD63F0800


@dataclass(frozen=True, slots=True)
class _Item:
    """One instruction and how it is relocated."""

    insn: Insn
    #: "copy", "b", "bl", "blr", "cond", "adr", "adrp", "load"; "droppable": a NOP
    #: when out of reach (no architectural effect); "near_only": refused out of
    #: reach; placed in a run (:func:`_placed`): "link" (BL .+4), "moved_bl" and
    #: "moved_blr" (the run's last call)
    kind: str
    word: int
    form: pcrel.Form | None = None
    target: int = 0     # branch target or the address referred to (original)

    @property
    def levels(self) -> int:
        return {"copy": 1, "b": 1, "bl": 1, "blr": 1, "cond": 2, "adr": 3, "adrp": 2,
                "load": 3, "droppable": 2, "near_only": 1, "link": 2, "moved_bl": 1,
                "moved_blr": 1}[self.kind]


def _is_blr(word: int) -> bool:
    return word & _BLR_MASK == _BLR or word & _BLRA_MASK == _BLRA


def _word(insn: Insn) -> int:
    if len(insn.raw) != WORD or insn.size != WORD:
        raise RelocationError(f"{insn}: not one 4-byte A64 instruction")
    if insn.address % WORD:
        raise RelocationError(f"{insn}: not 4-byte aligned")
    return int.from_bytes(insn.raw, "little")


def classify(insn: Insn) -> _Item:
    """How ``insn`` is relocated; RelocationError for what cannot be moved."""
    word = _word(insn)
    form = pcrel.form_of(word)
    decoded = next(_cs.disasm(insn.raw, insn.address, 1), None)
    if decoded is None:
        raise RelocationError(f"{insn}: bytes do not decode")
    if decoded.id in _EXCLUSIVES:
        raise RelocationError(
            f"{insn}: an exclusive load/store cannot be moved: code between it and its "
            "other half may clear the exclusive monitor, and its loop never succeed")
    if form is None:
        if _is_blr(word):
            return _Item(insn, "blr", word)
        if decoded.group(A.ARM64_GRP_BRANCH_RELATIVE) and any(
                op.type == A.ARM64_OP_IMM for op in decoded.operands):
            raise RelocationError(f"{insn}: unknown PC-relative form {word:#010x}")
        return _Item(insn, "copy", word)
    target = form.target(word, insn.address)
    to_zr = word & 31 == 31                 # Rd/Rt 31: the zero register
    if form is pcrel.LDR_LITERAL:
        opc, simd = word >> 30, bool(word & (1 << 26))
        if not simd and opc == 3:
            kind = "droppable"              # PRFM
        elif simd or to_zr:
            kind = "near_only"              # no general-purpose register to build an address in
        else:
            kind = "load"
        return _Item(insn, kind, word, form, target)
    if form in (pcrel.ADR, pcrel.ADRP):
        kind = "droppable" if to_zr else form.name
        return _Item(insn, kind, word, form, target)
    kind = {pcrel.B: "b", pcrel.BL: "bl"}.get(form, "cond")
    return _Item(insn, kind, word, form, target)


def _placed(item: _Item, *, last: bool) -> _Item:
    """How a call moves at its place in a run (module doc); other items as they are."""
    if item.kind == "bl" and item.target == item.insn.end:
        return dataclasses.replace(item, kind="link")
    if item.kind not in ("bl", "blr"):
        return item
    if not last:
        raise CallInsideRun(
            f"{item.insn}: a call with instructions after it cannot be relocated: at a new "
            "place it would leave another return address in x30 than the original's")
    return dataclasses.replace(item, kind=f"moved_{item.kind}")


def _is_always(item: _Item) -> bool:
    """B.AL / B.NV: a conditional encoding that always branches."""
    return pcrel.B_COND.matches(item.word) and item.word & 0xF in (AL, NV)


def _inverted(word: int) -> int:
    """The branch with the opposite condition (B.cond: flip bit 0 of the condition,
    Arm ARM "Condition code" table; CBZ <-> CBNZ, TBZ <-> TBNZ: flip the op bit)."""
    return word ^ 1 if pcrel.B_COND.matches(word) else word ^ _NZ_BIT


def _load_through(rt: int, word: int) -> int:
    """The load a literal load ``word`` becomes through [Xt] (unsigned offset 0):
    LDR Wt / LDR Xt / LDRSW Xt."""
    return {0: 0xB9400000, 1: 0xF9400000, 2: 0xB9800000}[word >> 30] | rt << 5 | rt


def _size_of(word: int) -> int:
    return {0: 4, 1: 8, 2: 4}[word >> 30]


class Relocator:
    """Relocates one run of consecutive instructions to ``new_address``.

    ``first_to``: where a branch to the run's first instruction goes instead of its
    copy (a patch's entry: a loop that comes back to a spliced point must run the
    snippets again, as every arrival at the point in the original text does)."""

    def __init__(self, insns: Sequence[Insn], new_address: int, *, first_to: int | None = None) -> None:
        check_consecutive(insns)
        if new_address % WORD:
            raise RelocationError(f"A64 code cannot be placed at {new_address:#x}: not 4-byte aligned")
        last = len(insns) - 1
        self.items = [_placed(classify(i), last=k == last) for k, i in enumerate(insns)]
        self.new_address = new_address
        self.first_to = first_to
        self.start = insns[0].address if insns else 0
        self.end = insns[-1].end if insns else 0
        self.levels = [0] * len(self.items)
        # a moved call's size depends on where its destination's copy is: until the
        # first layout, every copy is taken to be at the start (the run is far
        # shorter than B's reach, so the size a copy's address gives is the same)
        self.at = [new_address] * len(self.items)
        self.at = self._layout()
        self._relax()

    # --- layout -------------------------------------------------------------------------
    def _layout(self) -> list[int]:
        at, pc = [], self.new_address
        for item, level in zip(self.items, self.levels, strict=True):
            at.append(pc)
            pc += self._size(item, level, pc)
        return at

    def _relax(self) -> None:
        while True:
            moved = False
            for i, item in enumerate(self.items):
                while not self._reaches(item, self.levels[i], self.at[i]):
                    self.levels[i] += 1
                    moved = True
                    if self.levels[i] >= item.levels:
                        raise RelocationError(
                            f"{item.insn}: {item.target:#x} is out of its reach from "
                            f"{self.at[i]:#x}, and it has no longer form")
            if not moved:
                return
            self.at = self._layout()

    def _dest(self, item: _Item) -> int:
        """A branch target, moved into the relocated copy when it lies in the run."""
        target = item.target
        if not self.start <= target < self.end:
            return target
        if target == self.start and self.first_to is not None:
            return self.first_to
        index, rest = divmod(target - self.start, WORD)
        if rest:
            raise RelocationError(f"{item.insn}: branches into the middle of an instruction")
        return self.at[index]

    def _size(self, item: _Item, level: int, at: int) -> int:
        kind = item.kind
        if kind in ("moved_bl", "moved_blr"):
            w = Writer(at)
            self._write_moved(w, item)
            return w.pc - at
        if kind == "link":
            return WORD if level == 0 else WORD * len(mov_imm_words(0, item.insn.end))
        if level == 0:
            return WORD
        if kind == "cond":
            return WORD if _is_always(item) else 2 * WORD
        if kind == "adr":
            return 2 * WORD if level == 1 else WORD * len(mov_imm_words(0, item.target))
        if kind == "adrp":
            return WORD * len(mov_imm_words(0, item.target))
        if kind == "load":
            if level == 1:
                aligned = (item.target & 0xFFF) % _size_of(item.word) == 0
                return (2 if aligned else 3) * WORD
            return WORD * (len(mov_imm_words(0, item.target)) + 1)
        return WORD                                   # droppable -> nop

    def _reaches(self, item: _Item, level: int, at: int) -> bool:
        kind, form = item.kind, item.form
        if kind == "link":
            return level > 0 or pcrel.ADR.reaches(at, item.insn.end)
        if form is None or kind == "moved_bl":        # a moved call reaches anywhere
            return True
        if kind in ("b", "cond"):
            dest = self._dest(item)
            if level == 0:
                return form.reaches(at, dest)
            return pcrel.B.reaches(at + (0 if _is_always(item) else WORD), dest)
        if level == 0:
            return form.reaches(at, item.target)
        if level == 1 and kind in ("adr", "load"):
            return pcrel.ADRP.reaches(at, item.target & ~0xFFF)
        return True

    # --- emission -----------------------------------------------------------------------
    def run(self) -> bytes:
        w = Writer(self.new_address)
        for item, level, at in zip(self.items, self.levels, self.at, strict=True):
            try:
                self._write(w, item, level)
            except OutOfRange as e:                    # pragma: no cover - relaxation checked
                raise RelocationError(f"{item.insn} at {w.pc:#x}: {e}") from e
            if w.pc - at != self._size(item, level, at):   # pragma: no cover - a layout bug
                raise RelocationError(f"{item.insn}: relocated size differs from its layout")
        return w.flush()

    def _write(self, w: Writer, item: _Item, level: int) -> None:
        kind, word = item.kind, item.word
        if kind == "copy":
            w.put_word(word)
        elif kind in ("moved_bl", "moved_blr"):
            self._write_moved(w, item)
        elif kind == "link":
            _set_return_address(w, item.insn.end, far=level > 0)
        elif kind in ("b", "cond"):
            dest = self._dest(item)
            if level == 0:
                w.put_pcrel(word, dest)
            elif _is_always(item):
                w.put_b(dest)
            else:                         # !cond .+8 (over the B); B dest
                w.put_pcrel(_inverted(word), w.pc + 2 * WORD)
                w.put_b(dest)
        elif level == 0:
            w.put_pcrel(word, item.target)
        elif kind == "droppable":
            w.put_nop()
        else:
            self._write_grown(w, item, level)

    def _write_moved(self, w: Writer, item: _Item) -> None:
        """The run's last call, as :func:`moved_call` writes it (a BL's destination
        moved into the copy when it lies in the run)."""
        if item.kind == "moved_bl":
            _put_moved_bl(w, item.insn, self._dest(item))
        else:
            w.put_word(_through_scratch(w, item.insn, item.word) & ~_LINK_BIT)

    def _write_grown(self, w: Writer, item: _Item, level: int) -> None:
        """ADR, ADRP and literal loads beyond their reach: the address built in the
        destination register (which the instruction overwrites anyway)."""
        rd = item.word & 31
        xd = f"x{rd}"
        if item.kind == "adrp" or (item.kind == "adr" and level == 2):
            w.put_mov_imm(xd, item.target)
        elif item.kind == "adr":
            w.put_adrp(xd, item.target)
            w.put_add_imm(xd, xd, item.target & 0xFFF)
        elif level == 1:
            lo12 = item.target & 0xFFF
            w.put_adrp(xd, item.target)
            size = _size_of(item.word)
            if lo12 % size == 0:
                w.put_word(_load_through(rd, item.word) | (lo12 // size) << 10)
            else:
                w.put_add_imm(xd, xd, lo12)
                w.put_word(_load_through(rd, item.word))
        else:
            w.put_mov_imm(xd, item.target)
            w.put_word(_load_through(rd, item.word))


def relocate(insns: Sequence[Insn], new_address: int, *, first_to: int | None = None) -> bytes:
    """Re-encode consecutive ``insns`` to run at ``new_address`` (see the module doc,
    and :class:`Relocator` for ``first_to``)."""
    check_relocation_arguments(insns, new_address=new_address, first_to=first_to)
    if not insns:
        return b""
    return Relocator(insns, new_address, first_to=first_to).run()


def relocated_size(insns: Sequence[Insn], new_address: int, *, first_to: int | None = None) -> int:
    """How many bytes ``relocate`` produces for ``insns`` at ``new_address`` (it
    depends on the address: forms grow only when they do not reach)."""
    if not insns:
        return 0
    r = Relocator(insns, new_address, first_to=first_to)
    return r.at[-1] - new_address + r._size(r.items[-1], r.levels[-1], r.at[-1])


# --- a call moved out of the text ---------------------------------------------------------
def moved_call(insn: Insn, at: int) -> bytes:
    """Code at ``at`` with the effect of the call ``insn`` executed where it was:
    x30 holds the original return address ``insn.end``, then control goes to the
    callee.  The callee then returns to the text, never into the patch, so a patch
    can be freed while a callee still runs, and unwinders see the original caller.

    * ``BL label``  -> x30 = return address; ``B label`` (or, beyond +-128 MB,
      ``MOVZ/MOVK x16, #label; BR x16``)
    * ``BLR Xn``    -> ``MOV x16, Xn``; x30 = return address; ``BR x16``
    * ``BLRAA Xn, Xm`` (and BLRAB, BLRAAZ, BLRABZ) -> the same with ``BRAA x16, Xm``
      (the modifier copied to x17 first when it is x16 or x30)

    The return address is set with ``ADR x30`` when it is within +-1 MB of the patch,
    else with ``MOVZ/MOVK``.  x16 and x17 (IP0/IP1) are free at any call: AAPCS64
    (6.1.1) lets a linker veneer between a caller and its callee clobber them, so no
    callee expects a value in them and no caller relies on them across a call.  They
    are also the registers a ``BR`` must use to land on a callee's ``BTI c``
    (Arm ARM, "PSTATE.BTYPE"): a ``BR Xn`` through another register faults there.
    """
    check_relocation_arguments([insn], at=at)
    word = _word(insn)
    w = Writer(at)
    if pcrel.BL.matches(word):
        _put_moved_bl(w, insn, pcrel.BL.target(word, insn.address))
        return w.flush()
    if _is_blr(word):
        w.put_word(_through_scratch(w, insn, word) & ~_LINK_BIT)
        return w.flush()
    raise RelocationError(f"{insn}: not a call")


def _put_moved_bl(w: Writer, insn: Insn, dest: int) -> None:
    """x30 = ``insn``'s original return address; a branch to ``dest`` (through x16
    beyond B's reach: AAPCS64 lets a call veneer clobber IP0)."""
    _set_return_address(w, insn.end)
    if pcrel.B.reaches(w.pc, dest):
        w.put_b(dest)
    else:
        w.put_mov_imm(IP0, dest)
        w.put_br(IP0)


def _through_scratch(w: Writer, insn: Insn, word: int) -> int:
    """Copy an indirect call's target (and PAC modifier) into x16 (x17), set x30;
    return the call's word rewritten to use them."""
    n = (word >> 5) & 31
    pac = word & _BLR_MASK != _BLR
    zero_modifier = not pac or word & (1 << 24) == 0
    if n == 31:                                        # pragma: no cover - not encodable
        raise RelocationError(f"{insn}: no target register")
    if pac and not zero_modifier:
        m = word & 31
        if m in (16, 30):                              # about to be overwritten: x17
            w.put_mov_reg(IP1, f"x{m}")
            word = (word & ~31) | 17
    if n not in (16, 17):
        w.put_mov_reg(IP0, f"x{n}")
        word = (word & ~(31 << 5)) | 16 << 5
    _set_return_address(w, insn.end)
    return word


def _set_return_address(w: Writer, address: int, *, far: bool | None = None) -> None:
    """x30 = ``address``: ``ADR`` within its reach, else ``MOVZ/MOVK`` (``far``
    forces the choice: a layout level)."""
    if far is None:
        far = not pcrel.ADR.reaches(w.pc, address)
    if far:
        w.put_mov_imm("x30", address)
    else:
        w.put_adr("x30", address)
