"""Move consecutive x86-64 instructions elsewhere with the same effect.

A small pipeline in the manner of frida-gum's ``GumX86Relocator``: each
instruction is classified once (relative branch form, RIP-relative operand, or
position-independent), its size at the new place is computed, and then it is
written relocated:

* ``jmp rel8/rel32``        -> ``jmp rel32``                (e9 cd)
* ``jcc rel8/rel32``        -> ``jcc rel32``                (0f 80+cc cd)
* ``call rel32`` to the next instruction (``call $+5``, the get-pc idiom) ->
  push of the original return address, and on with the next instruction
* a call, direct or indirect, as the run's last instruction -> :func:`moved_call`'s
  form: the original return address on the stack and control at the callee
  (``push imm; jmp rel32``, ``push imm; jmp reg``; through memory ``push m64;
  push [rsp]; mov [rsp+8], imm; ret``, which reads the operand first)
* ``xbegin rel32``          -> ``xbegin rel32``, recomputed (c7 f8 cd)
* ``jrcxz/jecxz/loop/loope/loopne rel8`` (no rel32 form exists, SDM "JCC" and
  "LOOP/LOOPcc") -> ``op +2; jmp short +5; jmp rel32 target``
* RIP-relative memory operand -> same bytes, disp32 recomputed
  (SDM Vol. 2A, 2.2.1.6: the displacement is relative to the *next* instruction)
* EIP-relative operand (``67`` + RIP-relative, SDM Vol. 1, 3.5.1: the 32-bit
  address is the low half of next-EIP + disp32) -> disp32 recomputed modulo 2**32
* anything else is copied.

A REX prefix in front of a relative branch (``48 eb``, ``41 0f 84``, ``48 e8``)
changes nothing in 64-bit mode (the operand size of near branches is forced to
64 bits, SDM Vol. 2A, 2.2.1.7) and is dropped; a 16-bit operand size (``66``) or
anything else the decoder calls a relative branch but this table does not know
is refused, never copied: a copied relative branch would go somewhere else.

A call leaves its return address on the stack, where the callee and the kernel's
unwinders read it: a plain call at the new place would push its copy's address.  So
a call is moved only in forms that push the original one (SDM "CALL": the pushed
address is the next instruction's).  A call that is the run's last instruction
becomes :func:`moved_call`'s form: the callee returns to the original text right
after the call -- where a run's relocated copy jumps back to anyway -- so a get-pc
thunk (``call __x86.get_pc_thunk.bx``: ``mov ebx, [esp]; ret``) reads the original
address: the effect frida-gum's vector ``call_near_gnu_get_pc_thunk`` asks for
(frida-gum reads the thunk and inlines it as ``mov ebx, imm``; a relocator given
only the run calls it).  A call to the next instruction only pushes its address
(frida-gum's ``call_near_relative_to_next_instruction``).  Any other call with instructions
after it in the run is refused (CallInsideRun): returning to the original text
would skip the rest of the copy, and a plain call would push the wrong address.
Far calls (``ff /3``) and anything else the decoder calls a call are refused.

A branch whose target is an instruction of the run itself goes to that
instruction's relocated copy.  Every long form is chosen regardless of the
distance, so the layout does not depend on targets and one pass of sizes
suffices.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import capstone
from capstone import x86 as cs_x86

from ksim.arch.base import Insn, check_consecutive, check_relocation_arguments
from ksim.errors import CallInsideRun, OutOfRange, RelocationError

from .writer import INT32, Writer, fits, rel32_reaches, signed64

#: legacy prefixes (SDM Vol. 2A, 2.1.1)
_LEGACY_PREFIXES = frozenset({0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0x66, 0x67})
#: rel8-only conditional loops: jrcxz (e3), loop (e2), loope (e1), loopne (e0)
_LOOPS = frozenset({0xE0, 0xE1, 0xE2, 0xE3})
_REX = range(0x40, 0x50)
#: the opcode of the near indirect call (ff /2) and jmp (ff /4)
_FF = 0xFF

_MASK64 = (1 << 64) - 1
_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


@dataclass(frozen=True, slots=True)
class _Form:
    """How one instruction is relocated."""

    #: "jmp", "jcc", "call", "icall" (ff /2), "xbegin", "loop", "riprel", "eiprel",
    #: "copy"; placed in a run (Relocator): "pushret" (a call to the next
    #: instruction), "moved" / "imoved" (a run's last call, direct / indirect)
    kind: str
    prefixes: bytes = b""
    opcode: int = 0           # jcc: condition nibble; loop: the e0..e3 opcode
    target: int = 0           # branch target, or the absolute address a RIP operand reaches
    disp_offset: int = 0      # riprel: where the disp32 sits in the instruction

    def size(self, insn: Insn) -> int:
        extra = {"jmp": 5, "jcc": 6, "call": 5, "xbegin": 6, "loop": 2 + 2 + 5}
        if self.kind in extra:
            return len(self.prefixes) + extra[self.kind]
        if self.kind == "pushret":
            return _push_size(insn.end)
        if self.kind == "moved":
            return _push_size(insn.end) + 5
        if self.kind == "imoved":
            return len(_moved_indirect(insn, None))
        return insn.size


def _split_prefixes(raw: bytes) -> tuple[bytes, bytes]:
    """(legacy prefixes, the rest from the opcode on).  REX bytes are dropped: one
    is only meaningful right before the opcode, and none changes a near branch."""
    legacy = bytearray()
    n = 0
    while n < len(raw) and (raw[n] in _LEGACY_PREFIXES or raw[n] in _REX):
        if raw[n] in _LEGACY_PREFIXES:
            legacy.append(raw[n])
        n += 1
    return bytes(legacy), raw[n:]


def _rel(insn: Insn, field: bytes) -> int:
    rel = int.from_bytes(field, "little", signed=True)
    return (insn.end + rel) & _MASK64


def _branch_form(insn: Insn) -> _Form | None:
    prefixes, rest = _split_prefixes(insn.raw)
    op = rest[0] if rest else None
    if op in (0xEB, 0xE9, 0xE8) or (op is not None and 0x70 <= op <= 0x7F) or op in _LOOPS or (
        op == 0x0F and len(rest) >= 2 and 0x80 <= rest[1] <= 0x8F
    ) or (op == 0xC7 and len(rest) >= 2 and rest[1] == 0xF8):
        if 0x66 in prefixes and op not in _LOOPS:
            # operand-size override on a near branch truncates rIP on some CPUs (AMD);
            # a 16-bit xbegin truncates its abort address (SDM Vol. 2D, "XBEGIN")
            raise RelocationError(f"{insn}: 66-prefixed relative branch is not relocatable")
    if op == 0xEB and len(rest) == 2:
        return _Form("jmp", prefixes, target=_rel(insn, rest[1:]))
    if op == 0xE9 and len(rest) == 5:
        return _Form("jmp", prefixes, target=_rel(insn, rest[1:]))
    if op == 0xE8 and len(rest) == 5:
        return _Form("call", prefixes, target=_rel(insn, rest[1:]))
    if op is not None and 0x70 <= op <= 0x7F and len(rest) == 2:
        return _Form("jcc", prefixes, op & 0xF, _rel(insn, rest[1:]))
    if op == 0x0F and len(rest) == 6 and 0x80 <= rest[1] <= 0x8F:
        return _Form("jcc", prefixes, rest[1] & 0xF, _rel(insn, rest[2:]))
    if op in _LOOPS and len(rest) == 2:
        return _Form("loop", prefixes, op, _rel(insn, rest[1:]))
    if op == 0xC7 and len(rest) == 6 and rest[1] == 0xF8:
        # xbegin rel32 (SDM Vol. 2D, "XBEGIN"): the abort address is a rel32 target
        return _Form("xbegin", prefixes, target=_rel(insn, rest[2:]))
    return None


def _decoded(insn: Insn) -> capstone.CsInsn:
    decoded = next(_cs.disasm(insn.raw, insn.address), None)
    if decoded is None or decoded.size != insn.size:
        raise RelocationError(f"{insn}: bytes do not decode as one instruction")
    return decoded


def _pc_relative_form(insn: Insn, decoded: capstone.CsInsn) -> _Form | None:
    """A memory operand relative to the instruction pointer (RIP, or EIP under 67)."""
    for op in decoded.operands:
        if op.type != cs_x86.X86_OP_MEM or op.mem.base not in (cs_x86.X86_REG_RIP, cs_x86.X86_REG_EIP):
            continue
        at = decoded.disp_offset
        if not 0 < at <= insn.size - 4:
            raise RelocationError(f"{insn}: no 32-bit displacement where the decoder puts it")
        disp = struct.unpack_from("<i", insn.raw, at)[0]
        if op.mem.base == cs_x86.X86_REG_EIP:
            return _Form("eiprel", target=(insn.end + disp) & 0xFFFFFFFF, disp_offset=at)
        return _Form("riprel", target=(insn.end + disp) & _MASK64, disp_offset=at)
    return None


@lru_cache(maxsize=1 << 16)
def classify(insn: Insn) -> _Form:
    """How ``insn`` moves (pure: an instruction's form is a function of the
    instruction, so a batch that plans a window twice decodes it once)."""
    if len(insn.raw) != insn.size:
        raise RelocationError(f"{insn}: raw bytes and size disagree")
    branch = _branch_form(insn)
    if branch is not None:
        return branch
    kind, at, base = _decoded_shape(bytes(insn.raw))
    if kind == "undecodable":
        raise RelocationError(f"{insn}: bytes do not decode as one instruction")
    # whatever the decoder knows to be relative and the table above does not: refuse
    if kind == "relative":
        raise RelocationError(f"{insn}: relative branch form {insn.raw.hex()} is not relocatable")
    if kind == "call":
        if not _is_near_indirect_call(insn):
            raise RelocationError(f"{insn}: only near calls (e8, ff /2) can be relocated")
        return _Form("icall")
    if kind == "pc":
        if not 0 < at <= insn.size - 4:
            raise RelocationError(f"{insn}: no 32-bit displacement where the decoder puts it")
        disp = struct.unpack_from("<i", insn.raw, at)[0]
        if base == cs_x86.X86_REG_EIP:
            return _Form("eiprel", target=(insn.end + disp) & 0xFFFFFFFF, disp_offset=at)
        return _Form("riprel", target=(insn.end + disp) & _MASK64, disp_offset=at)
    return _Form("copy")


@lru_cache(maxsize=1 << 16)
def _decoded_shape(raw: bytes) -> tuple[str, int, int]:
    """What the decoder's full detail says of the instruction ``raw`` that matters to
    :func:`classify` beyond its branch forms: ("undecodable" | "relative" | "call" |
    "pc" | "other", the offset of a PC-relative operand's disp32, its base register).
    It depends on the bytes only, not on where they lie: the kernel's functions
    share a few prologues, decoded once."""
    decoded = next(_cs.disasm(raw, 0), None)
    if decoded is None or decoded.size != len(raw):
        return "undecodable", 0, 0
    if decoded.group(capstone.CS_GRP_BRANCH_RELATIVE) or decoded.mnemonic == "xbegin":
        return "relative", 0, 0
    if decoded.group(capstone.CS_GRP_CALL):
        return "call", 0, 0
    for op in decoded.operands:
        if op.type != cs_x86.X86_OP_MEM or op.mem.base not in (cs_x86.X86_REG_RIP, cs_x86.X86_REG_EIP):
            continue
        return "pc", decoded.disp_offset, op.mem.base
    return "other", 0, 0


def _is_near_indirect_call(insn: Insn) -> bool:
    _prefixes, rest = _split_prefixes(insn.raw)
    return len(rest) >= 2 and rest[0] == _FF and (rest[1] >> 3) & 7 == 2


def _placed(insn: Insn, form: _Form, *, last: bool) -> _Form:
    """How a call moves at its place in a run (module doc); other forms as they are."""
    if form.kind == "call" and form.target == insn.end:
        return _Form("pushret")
    if form.kind not in ("call", "icall"):
        return form
    if not last:
        raise CallInsideRun(
            f"{insn}: a call with instructions after it cannot be relocated: at a new "
            "place it would leave another return address than the original's")
    if form.kind == "icall":
        _moved_indirect(insn, None)         # refused now, not when written
        return _Form("imoved")
    return _Form("moved", target=form.target)


class Relocator:
    """Relocates one run of consecutive instructions to ``new_address``.

    ``first_to``: where a branch to the run's first instruction goes instead of its
    copy (a patch's entry: a loop that comes back to a spliced point must run the
    snippets again, as every arrival at the point in the original text does)."""

    def __init__(self, insns: Sequence[Insn], new_address: int, *, first_to: int | None = None) -> None:
        check_consecutive(insns)
        self.insns = list(insns)
        self.new_address = new_address
        self.first_to = first_to
        last = len(self.insns) - 1
        self.forms = [_placed(i, classify(i), last=k == last) for k, i in enumerate(self.insns)]
        self.new_of: dict[int, int] = {}
        pc = new_address
        for insn, form in zip(self.insns, self.forms, strict=True):
            self.new_of[insn.address] = pc
            pc += form.size(insn)
        self.start = self.insns[0].address if self.insns else 0
        self.end = self.insns[-1].end if self.insns else 0

    def _dest(self, insn: Insn, target: int) -> int:
        """A branch target, moved into the relocated copy when it lies in the run."""
        if not self.start <= target < self.end:
            return target
        if target == self.start and self.first_to is not None:
            return self.first_to
        if target not in self.new_of:
            raise RelocationError(f"{insn}: branches into the middle of an instruction")
        return self.new_of[target]

    def run(self) -> bytes:
        w = Writer(self.new_address)
        for insn, form in zip(self.insns, self.forms, strict=True):
            try:
                self._write(w, insn, form)
            except OutOfRange as e:
                raise RelocationError(f"{insn} at {w.pc:#x}: {e}") from e
        return w.flush()

    def _write(self, w: Writer, insn: Insn, form: _Form) -> None:
        w.put_bytes(form.prefixes)
        if form.kind == "jmp":
            w.put_jmp(self._dest(insn, form.target))
        elif form.kind == "jcc":
            w.put_jcc(form.opcode, self._dest(insn, form.target))
        elif form.kind == "pushret":
            _push_return_address(w, insn.end)
        elif form.kind == "moved":
            _push_return_address(w, insn.end)
            w.put_jmp(self._dest(insn, form.target))
        elif form.kind == "imoved":
            w.put_bytes(_moved_indirect(insn, w.pc))
        elif form.kind == "xbegin":
            w.put_xbegin(self._dest(insn, form.target))
        elif form.kind == "loop":
            # op +2 (taken: to the long jmp); jmp short +5 (not taken: skip it)
            w.put_bytes(bytes([form.opcode, 0x02, 0xEB, 0x05]))
            w.put_jmp(self._dest(insn, form.target))
        elif form.kind in ("riprel", "eiprel"):
            raw = bytearray(insn.raw)
            _rebase(raw, insn, form, w.pc)
            w.put_bytes(bytes(raw))
        else:
            w.put_bytes(insn.raw)


def _rebase(raw: bytearray, insn: Insn, form: _Form, pc: int) -> None:
    """Rewrite the disp32 in ``raw`` (``insn``'s bytes, or a re-encoding of the same
    length) so that its RIP/EIP-relative operand, run at ``pc``, reaches the same
    address.  An EIP-relative address wraps at 4 GB, so some disp32 always does."""
    disp = form.target - (pc + insn.size)
    if form.kind == "riprel":
        disp = signed64(disp)
        if not fits(disp, INT32):
            raise RelocationError(
                f"{insn}: RIP-relative operand to {form.target:#x} out of reach from {pc:#x}")
    raw[form.disp_offset:form.disp_offset + 4] = (disp & 0xFFFFFFFF).to_bytes(4, "little")


def relocate(insns: Sequence[Insn], new_address: int, *, first_to: int | None = None) -> bytes:
    """Re-encode consecutive ``insns`` to run at ``new_address`` (see module doc and
    :class:`Relocator` for ``first_to``)."""
    check_relocation_arguments(insns, new_address=new_address, first_to=first_to)
    return Relocator(insns, new_address, first_to=first_to).run()


def relocated_size(insns: Sequence[Insn]) -> int:
    """How many bytes ``relocate`` will produce for ``insns`` (independent of the address)."""
    last = len(insns) - 1
    return sum(_placed(i, classify(i), last=k == last).size(i) for k, i in enumerate(insns))


# --- a call moved out of the text ---------------------------------------------------

def moved_call(insn: Insn, at: int) -> bytes:
    """Code at ``at`` with the effect of the call ``insn`` executed where it was:
    the return address on the stack is the original ``insn.end``, and control is
    at the callee.  The callee then returns to the text, never into the patch, so
    a patch can be freed while a callee still runs (a task asleep in schedule()),
    and unwinders see the original caller.  Neither a register nor the flags
    change on the way (SDM "PUSH", "MOV", "JMP" and "RET" leave the flags alone).

    * ``call rel32``      -> push return address; ``jmp rel32`` (or ``jmp [rip]`` + the
      absolute target when rel32 cannot reach it)
    * ``call reg`` (ff /2) -> push return address; ``jmp reg`` (ff /4)
    * ``call m64`` (ff /2) -> ``push m64`` (ff /6, the call's own operand); ``push
      qword [rsp]``; ``mov qword [rsp+8], return address``; ``ret``.  A call reads
      its operand before it pushes (SDM "CALL": the target is fetched, then the
      return address pushed), so a read that faults leaves the stack as it was;
      ``push m64`` reads first as well, and computes an operand based on ``rsp``
      from ``rsp`` before the decrement (SDM "PUSH"), as the call does: the
      operand is the call's, unchanged (a RIP/EIP-relative displacement
      re-based).  With no register free, the callee's address must wait on the
      stack, at or above ``rsp`` (kernel code has no red zone: an interrupt writes
      below it), on top of the return address: hence the copy, and ``ret`` to
      take it from there.  A return address that is no sign-extended 32-bit immediate is
      stored in two 32-bit halves.  What still differs: the slot below the
      return address is written (dead once ``ret`` ran; a stack fault there alone
      stops the moved form where the call would have run on), and ``ret`` has no
      matching call for the return-stack predictor

    RelocationError for what cannot keep that promise: far calls, 16-bit operand
    sizes, a call through ``rsp`` itself, a lock/rep/bnd-prefixed call through
    memory.
    """
    check_relocation_arguments([insn], at=at)
    form = _branch_form(insn)
    if form is None:
        return _moved_indirect(insn, at)
    if form.kind != "call":
        raise RelocationError(f"{insn}: not a call")
    w = Writer(at)
    _push_return_address(w, insn.end)
    if rel32_reaches(w.pc + 5, form.target):
        w.put_jmp(form.target)
    else:  # jmp qword ptr [rip+0]; .quad target (SDM "JMP": FF /4)
        w.put_bytes(b"\xff\x25\x00\x00\x00\x00" + (form.target & _MASK64).to_bytes(8, "little"))
    return w.flush()


def _push_size(address: int) -> int:
    """The length of :func:`_push_return_address`'s code for ``address``."""
    return 5 if fits(signed64(address), INT32) else 5 + 7 + 8


def _push_return_address(w: Writer, address: int) -> None:
    """Push a 64-bit constant without touching a register or the flags: ``push
    imm32`` when the sign-extended immediate is the address (SDM "PUSH"), else
    ``lea rsp, [rsp-8]`` and two 32-bit stores."""
    if _push_size(address) == 5:
        w.put_bytes(b"\x68" + (address & 0xFFFFFFFF).to_bytes(4, "little"))
        return
    w.put_bytes(b"\x48\x8d\x64\x24\xf8")                                  # lea rsp, [rsp-8]
    _store_at_rsp(w, 0, address)


def _store_at_rsp(w: Writer, disp: int, address: int) -> None:
    """``[rsp + disp] = address`` (0 <= disp < 0x7c) without a register or the flags:
    ``mov qword [rsp + disp], imm32`` when the sign-extended immediate is the
    address (SDM "MOV": REX.W C7 /0), else two 32-bit stores (C7 /0)."""
    def slot(d: int) -> bytes:                  # ModRM /0 + SIB base rsp (+ disp8)
        return b"\x04\x24" if d == 0 else b"\x44\x24" + bytes([d])

    if fits(signed64(address), INT32):
        w.put_bytes(b"\x48\xc7" + slot(disp) + (address & 0xFFFFFFFF).to_bytes(4, "little"))
        return
    lo, hi = address & 0xFFFFFFFF, (address >> 32) & 0xFFFFFFFF
    w.put_bytes(b"\xc7" + slot(disp) + lo.to_bytes(4, "little")
                + b"\xc7" + slot(disp + 4) + hi.to_bytes(4, "little"))


def _moved_indirect(insn: Insn, pc: int | None) -> bytes:
    """:func:`moved_call`'s code for the near indirect call ``insn`` run at ``pc``
    (None: only its length matters, a RIP-relative displacement is left as it is)."""
    prefixes, rest = _split_prefixes(insn.raw)
    modrm_at = len(insn.raw) - len(rest) + 1
    if not rest or rest[0] != _FF or len(rest) < 2 or (rest[1] >> 3) & 7 != 2:
        raise RelocationError(f"{insn}: only near indirect calls (ff /2) can be moved")
    if 0x66 in prefixes:
        raise RelocationError(f"{insn}: a 16-bit indirect call is not relocatable")
    decoded = _decoded(insn)
    op = decoded.operands[0]
    w = Writer(0 if pc is None else pc)
    if op.type == cs_x86.X86_OP_REG:
        if op.reg in (cs_x86.X86_REG_RSP, cs_x86.X86_REG_ESP):
            raise RelocationError(f"{insn}: a call through the stack pointer is not relocatable")
        _push_return_address(w, insn.end)
        w.put_bytes(_with_reg_field(insn.raw, modrm_at, 4))                 # jmp reg (ff /4)
        return w.flush()
    if set(prefixes) & {0xF0, 0xF2, 0xF3}:
        # meaningless or reserved on PUSH (SDM Vol. 2A, 2.1.1); no kernel call has them
        raise RelocationError(f"{insn}: a lock/rep/bnd-prefixed call through memory is not "
                              "relocatable")
    if op.mem.index in (cs_x86.X86_REG_RSP, cs_x86.X86_REG_ESP):
        raise RelocationError(f"{insn}: operand indexed by the stack pointer")
    push = bytearray(_with_reg_field(insn.raw, modrm_at, 6))                # push m64 (ff /6)
    form = _pc_relative_form(insn, decoded)
    if form is not None and pc is not None:
        _rebase(push, insn, form, pc)           # same length, at pc: the same next address
    w.put_bytes(bytes(push))                    # the callee's address, read before rsp moves
    w.put_bytes(b"\xff\x34\x24")                # push qword [rsp]: it again
    _store_at_rsp(w, 8, insn.end)               # the first copy becomes the return address
    w.put_ret()                                 # pop the callee's address into rip
    return w.flush()


def _with_reg_field(raw: bytes, modrm_at: int, reg: int) -> bytes:
    """``raw`` with the ModRM reg field (the opcode extension of ff /n) set to ``reg``."""
    out = bytearray(raw)
    out[modrm_at] = (out[modrm_at] & 0xC7) | (reg << 3)
    return bytes(out)
