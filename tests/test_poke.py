"""The text-change protocol: old bytes checked first, then int3 -> tail -> head."""

import pytest

from ksim.core import Write
from ksim.errors import StaleText
from ksim.poke import apply, protocol_steps

NOP5 = bytes([0x0F, 0x1F, 0x44, 0x00, 0x00])      # nop dword [rax+rax]
JMP = bytes([0xE9, 0x10, 0x20, 0x30, 0x40])       # jmp rel32


def memory(data: bytes):
    mem = bytearray(data)
    log: list[tuple[int, bytes]] = []

    def write(addr: int, chunk: bytes) -> None:
        log.append((addr, chunk))
        mem[addr:addr + len(chunk)] = chunk

    return mem, log, (lambda a, n: bytes(mem[a:a + n])), write


def test_multibyte_write_goes_trap_tail_head_with_a_sync_after_each():
    mem, log, read, write = memory(NOP5 + b"\xc3")
    syncs = []
    apply([Write(0, NOP5, JMP)], read=read, write=write, trap=b"\xcc",
          sync=lambda: syncs.append(len(log)))
    assert log == [(0, b"\xcc"), (1, JMP[1:]), (0, b"\xe9")]
    assert syncs == [1, 2, 3]
    assert bytes(mem) == JMP + b"\xc3"


def test_every_intermediate_state_starts_with_the_trap_or_is_whole():
    # a CPU fetching the site between steps sees either the old bytes, a trap
    # at the head, or the new bytes -- never a half-written instruction
    steps = protocol_steps([Write(0, NOP5, JMP)], b"\xcc")
    state = bytearray(NOP5)
    for step in steps[:-1]:
        for addr, data in step:
            state[addr:addr + len(data)] = data
        assert state[0] == 0xCC


def test_stale_old_bytes_change_nothing():
    mem, log, read, write = memory(NOP5 + JMP)
    writes = [Write(0, NOP5, JMP), Write(5, NOP5, JMP)]   # the second is stale
    with pytest.raises(StaleText):
        apply(writes, read=read, write=write, trap=b"\xcc")
    assert log == [] and bytes(mem) == NOP5 + JMP


def test_single_byte_writes_are_one_step():
    assert protocol_steps([Write(3, b"\x55", b"\xcc")], b"\xcc") == [[(3, b"\xcc")]]


# AArch64: the trap (BRK #0x004) and every instruction are one 4-byte word
BRK = bytes.fromhex("800020d4")
B_OLD = bytes.fromhex("70180014")                 # b +0x61c0
B_NEW = bytes.fromhex("84190014")                 # b +0x6610: differs in the first byte only


def test_a_word_trap_rewrites_one_word_in_one_store():
    """An aligned word store is atomic for instruction fetch on AArch64: one
    instruction is rewritten in one step, never a trap head over it whose tail
    the protocol would then skip (the tail of B_NEW equals B_OLD's)."""
    mem, log, read, write = memory(B_OLD + B_OLD)
    apply([Write(0, B_OLD, B_NEW)], read=read, write=write, trap=BRK)
    assert log == [(0, B_NEW)] and bytes(mem) == B_NEW + B_OLD


def test_a_word_trap_heads_a_longer_write():
    mem, log, read, write = memory(B_OLD + B_OLD + B_OLD)
    apply([Write(0, B_OLD + B_OLD, B_NEW + B_NEW)], read=read, write=write, trap=BRK)
    assert log == [(0, BRK), (4, B_NEW), (0, B_NEW)]
    assert bytes(mem) == B_NEW + B_NEW + B_OLD
