"""Whole-function decoding at disassembler speed, for analyses of a whole kernel.

:func:`ksim.arch.x86_64.reader.decode` builds one :class:`~ksim.arch.base.Insn` per
instruction, which costs microseconds each in Python; a vmlinux has ~6.6 M
instructions.  :func:`scan` gives the same facts in bulk -- sizes, control flow,
direct targets and register effects -- without an object per instruction:

* capstone decodes the whole function in one ``cs_disasm`` call (detail off) and
  the array of ``cs_insn`` it returns is read in bulk: the sizes are one strided
  slice of it, and one regular expression lifts every (mnemonic, operand text) pair
  out of it at C speed;
* each pair is classified by a table lookup (flow, direct target, filler, effects),
  filled on a miss by :func:`ksim.arch.x86_64.reader.classify` -- the very function
  ``decode`` uses, so the two never disagree;
* the int3 padding that ends most kernel functions (58% of the instructions of the
  Debian 6.1 vmlinux, as kallsyms extents run up to the next symbol) is not decoded
  at all: it is reported as a count of trailing one-byte ``int3``.

The result follows ``ksim.arch.base.CodeScan``: (sizes, codes, targets, tail, tail
code) with
one code per decoded instruction packed as ``flow | filler << 3 | has target << 4 |
effects << 5`` (flow as an index into ``tuple(Flow)``, effects as an index into
:data:`ksim.arch.x86_64.reader.EFFECTS`), and the targets of the instructions that
have one, in order.
"""

from __future__ import annotations

import bisect
import ctypes
import re
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import itemgetter
from typing import cast

import capstone

from ksim.arch.base import EFFECT_SHIFT, FILLER_BIT, FLOW_MASK, FLOWS, TARGET_BIT, Insn

from . import reader
from .regs import FILLERS

__all__ = ["EFFECT_SHIFT", "FILLER_BIT", "FLOWS", "PAD", "TARGET_BIT", "rebuild", "scan", "scan_many"]

#: flow index -> Flow (SEQ is 0): the packing of ksim.arch.base.CodeScan
_FLOW_INDEX = {flow: i for i, flow in enumerate(FLOWS)}
#: the byte that pads functions (int3, SDM "INT n/INTO/INT3/INT1")
PAD = 0xCC
_PAD_BYTE = bytes([PAD])

_INSN = capstone._cs_insn
_INSN_PTR = ctypes.POINTER(_INSN)
_STRIDE = ctypes.sizeof(_INSN)
_SIZE_AT = _INSN.size.offset  # a uint16, little-endian: its first byte is the size (<= 15)
# At fixed offsets of each record: the mnemonic and the operand text, both
# NUL-terminated (what follows a NUL is not necessarily zero).  The lookaheads
# capture them and ".{stride}" moves to the next record.
_PAIRS = re.compile(rb"(?s)(?=.{%d}([^\x00]*))(?=.{%d}([^\x00]*)).{%d}"
                    % (_INSN.mnemonic.offset, _INSN.op_str.offset, _STRIDE))

# "mnemonic operand-text" with every hexadecimal number replaced by "#" (the
# reader's classes) -> packed code: flow, filler, target and effects are all the
# same within a class, and a whole vmlinux has ~49 K classes.
_NUMBER = re.compile(reader._NUMBER.pattern.encode())
_CODES: dict[bytes, int] = {}
_CODES_MAX = 1_000_000
_INT3_CODE: int | None = None


def _sweep_into(records: bytearray, code: bytes, address: int) -> tuple[int, int]:
    """Append the cs_insn records of the linear sweep of ``code`` to ``records``:
    (instructions, bytes they cover)."""
    if not code:
        return 0, 0
    insns = _INSN_PTR()
    lib = capstone._cs
    count = lib.cs_disasm(reader._CS_LITE.csh, code, len(code), address, 0, ctypes.byref(insns))
    if not count:
        return 0, 0
    try:
        last = insns[count - 1]
        records += (ctypes.c_char * (count * _STRIDE)).from_address(ctypes.addressof(insns.contents))
        return count, last.address + last.size - address
    finally:
        lib.cs_free(insns, count)


def _code_of(mnemonic: bytes, op_str: bytes, raw: bytes, address: int) -> int:
    text = mnemonic.decode("ascii")
    flow, target, effects = reader.classify(text, op_str.decode("ascii"), raw, address)
    code = _FLOW_INDEX[flow] | (effects << EFFECT_SHIFT)
    if target is not None:
        code |= TARGET_BIT
    if text.rsplit(" ", 1)[-1] in FILLERS:
        code |= FILLER_BIT
    return code


def int3_code() -> int:
    """The packed code of the one-byte ``int3`` that pads functions."""
    global _INT3_CODE
    if _INT3_CODE is None:
        _INT3_CODE = _code_of(b"int3", b"", bytes([PAD]), 0)
    return _INT3_CODE


def scan(code: bytes, address: int) -> tuple[bytes, list[int], list[int], int, int]:
    """(sizes, codes, targets, tail, tail code) of the linear sweep of ``code`` at
    ``address``.

    The sweep stops at the first bytes that do not decode, as ``decode`` does;
    ``tail`` one-byte instructions of code ``tail code`` (int3) follow the decoded
    ones when the sweep reaches the padding.
    """
    sizes, codes, targets, tails, tail_code = scan_many([(code, address)])
    return sizes[0], codes, targets, tails[0], tail_code if tails[0] else 0


def scan_many(items: Sequence[tuple[bytes, int]]
              ) -> tuple[list[bytes], list[int], list[int], list[int], int]:
    """:func:`scan` of many functions ``(code, address)`` at once: (sizes of each,
    codes of all in order, targets of all in order, tail of each, tail code).

    Each function is decoded on its own, at its own address; the text of all of
    them is then classified in one pass, which is where the time goes.
    """
    counts: list[int] = []
    tails: list[int] = []
    records = bytearray()
    for code, address in items:
        body = code.rstrip(_PAD_BYTE)
        tail = len(code) - len(body)
        mark = len(records)
        count, covered = _sweep_into(records, body, address)
        if tail and covered != len(body):
            # undecodable bytes, or an instruction whose last bytes are 0xcc: sweep it all
            del records[mark:]
            count, covered = _sweep_into(records, code, address)
            tail = 0
        counts.append(count)
        tails.append(tail)
    tail_code = int3_code() if any(tails) else 0
    all_sizes = bytes(records[_SIZE_AT::_STRIDE])
    firsts = list(accumulate(counts, initial=0))
    sizes_of = [all_sizes[firsts[j]:firsts[j + 1]] for j in range(len(counts))]
    pairs = _PAIRS.findall(records)
    del records
    if not pairs:
        return sizes_of, [], [], tails, tail_code
    keys = _NUMBER.sub(b"#", b"\n".join(map(b" ".join, pairs))).split(b"\n")
    found = list(map(_CODES.get, keys))
    if None in found:
        if len(_CODES) > _CODES_MAX:
            _CODES.clear()
        _classify_misses(items, sizes_of, pairs, keys, found)
    codes = cast(list[int], found)
    with_target = bytes(map(TARGET_BIT.__and__, codes))
    targets = list(map(int, map(itemgetter(1), compress(pairs, with_target)), repeat(16)))
    return sizes_of, codes, targets, tails, tail_code


def _classify_misses(items: Sequence[tuple[bytes, int]], sizes_of: list[bytes],
                     pairs: list[tuple[bytes, bytes]], keys: list[bytes], codes: list[int | None]) -> None:
    """Fill the codes ``_CODES`` does not know yet (a new class of instruction text)."""
    firsts = list(accumulate(map(len, sizes_of), initial=0))
    starts: dict[int, list[int]] = {}
    i = codes.index(None)
    while True:
        found = _CODES.get(keys[i])
        if found is None:
            j = bisect.bisect_right(firsts, i) - 1
            if j not in starts:
                starts[j] = list(accumulate(sizes_of[j], initial=0))
            k = i - firsts[j]
            at = starts[j][k]
            code, address = items[j]
            mnemonic, op_str = pairs[i]
            found = _CODES[keys[i]] = _code_of(mnemonic, op_str, code[at:at + sizes_of[j][k]], address + at)
        codes[i] = found
        try:
            i = codes.index(None, i + 1)
        except ValueError:
            break




def rebuild(code: bytes, address: int, sizes: bytes, codes: Sequence[int], targets: Sequence[int],
            effects: Sequence[tuple[frozenset[str], frozenset[str]]]) -> list[Insn]:
    """The instructions a scan of ``code`` found, as objects, with the flows, targets
    and register effects the scan gave them (no register effects are decoded).
    Stops at the first instruction whose size differs from the one recorded."""
    out: list[Insn] = []
    next_target = iter(targets).__next__
    length = sum(sizes)
    for (addr, size, mnemonic, op_str), recorded, packed in zip(
            reader._CS_LITE.disasm_lite(code[:length], address), sizes, codes, strict=False):
        if size != recorded:
            break
        at = addr - address
        reads, writes = effects[packed >> EFFECT_SHIFT]
        out.append(Insn(addr, size, code[at:at + size], mnemonic, op_str, FLOWS[packed & FLOW_MASK],
                        next_target() if packed & TARGET_BIT else None,
                        reader._pc_ref(op_str, addr + size) if "rip" in op_str else None,
                        reads, writes))
    return out
