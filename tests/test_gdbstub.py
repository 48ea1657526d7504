"""The gdbstub client against a real QEMU started with -S and no kernel.

At reset an x86 CPU runs in real mode at CS:IP f000:fff0 with paging off, so
gdbstub addresses are physical: the BIOS is mapped at 0xf0000..0xfffff and RAM
starts at 0.
"""

from __future__ import annotations

import shutil

import pytest

from ksim.errors import TargetDied
from ksim.machine.gdbstub import StopReply, decode_payload, escape, frame

needs_qemu = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")


# --- framing, pure -----------------------------------------------------------------
def test_frame_checksum() -> None:
    assert frame(b"g") == b"$g#67"
    assert frame(b"m0,4") == b"$m0,4#fd"


def test_escape_and_decode_roundtrip() -> None:
    data = b"a$b#c}d*e"
    assert escape(data) == b"a}\x04b}\x03c}]d}\ne"
    assert decode_payload(escape(data)) == data


def test_rle_decoding() -> None:
    # "0* " = '0' then ' ' (32) - 29 = 3 more: "0000" (GDB manual, "Overview")
    assert decode_payload(b"0* ") == b"0000"
    assert decode_payload(b'ab*"c') == b"a" + b"b" * 6 + b"c"
    assert decode_payload(b"x*#") == b"x" * 7


def test_stop_replies() -> None:
    t = StopReply.parse(b"T05thread:01;")
    assert (t.kind, t.signal, t.info, t.exited) == ("T", 5, {"thread": "01"}, False)
    w = StopReply.parse(b"W03")
    assert (w.exited, w.exit_code) == (True, 3)
    assert StopReply.parse(b"X09").signal == 9


# --- against QEMU --------------------------------------------------------------------
@pytest.fixture
def machine():
    from ksim.machine.qemu import QemuMachine

    with QemuMachine(accel="tcg", memory="64M", timeout=10.0) as m:
        yield m


@pytest.mark.slow
@needs_qemu
def test_reset_state_and_vector(machine) -> None:
    gdb = machine.gdb
    assert gdb.halt_reason().signal == 5
    regs = gdb.read_registers()
    assert regs["rip"] == 0xFFF0 and regs["cs"] == 0xF000
    assert gdb.read_register("rip") == 0xFFF0
    # the reset vector holds a far jmp (ea) into the BIOS: same bytes through QMP's xp
    vec = gdb.read_memory(0xFFFF0, 16)
    assert vec[0] == 0xEA
    assert machine.read_physical(0xFFFF0, 16) == vec


@pytest.mark.slow
@needs_qemu
def test_write_read_back_ram_in_chunks(machine) -> None:
    gdb = machine.gdb
    data = bytes((i * 7 + 3) & 0xFF for i in range(10_000))  # several packets
    gdb.write_memory(0x20000, data)
    assert gdb.read_memory(0x20000, len(data)) == data
    assert machine.read_physical(0x20000, 64) == data[:64]


@pytest.mark.slow
@needs_qemu
def test_breakpoint_and_single_step(machine) -> None:
    gdb = machine.gdb
    # a tiny real-mode program in RAM: nop; nop; inc ax; jmp $-3 (back to inc)
    gdb.write_memory(0x7000, bytes.fromhex("9090 40 ebfd".replace(" ", "")))
    gdb.write_register("cs", 0)  # QEMU reloads the segment base from the selector
    gdb.write_register("rip", 0x7000)
    gdb.write_register("rax", 0)
    gdb.set_breakpoint(0x7002)
    stop = gdb.cont(timeout=10)
    assert stop.signal == 5 and gdb.read_register("rip") == 0x7002
    # software breakpoints never show in memory under TCG
    assert gdb.read_memory(0x7000, 5) == bytes.fromhex("909040ebfd")
    # the loop comes back to the breakpoint with ax incremented once
    gdb.cont(timeout=10)
    assert gdb.read_register("rip") == 0x7002 and gdb.read_register("rax") & 0xFFFF == 1
    gdb.remove_breakpoint(0x7002)
    gdb.step()
    assert gdb.read_register("rip") == 0x7003
    # now it loops freely: interrupt stops it
    gdb.resume()
    assert machine.status() == "running"
    stop = gdb.interrupt(timeout=10)
    assert stop.signal == 2
    assert gdb.read_register("rax") & 0xFFFF > 1


@pytest.mark.slow
@needs_qemu
def test_hardware_breakpoint(machine) -> None:
    gdb = machine.gdb
    gdb.write_memory(0x7000, bytes.fromhex("90 90 90 ebfb".replace(" ", "")))
    gdb.write_register("cs", 0)
    gdb.write_register("rip", 0x7000)
    gdb.set_breakpoint(0x7001, hardware=True)
    assert gdb.cont(timeout=10).signal == 5
    assert gdb.read_register("rip") == 0x7001
    gdb.remove_breakpoint(0x7001, hardware=True)


@pytest.mark.slow
@needs_qemu
def test_qmp_stop_reaches_gdb(machine) -> None:
    machine.cont()
    assert machine.status() == "running"
    assert machine.stop().signal == 2
    assert machine.status() == "paused"


@pytest.mark.slow
@needs_qemu
def test_connection_loss_is_target_died(machine) -> None:
    gdb = machine.gdb
    machine.proc.kill()
    machine.proc.wait()
    with pytest.raises(TargetDied):
        gdb.read_memory(0, 4)


@pytest.mark.slow
@needs_qemu
def test_continue_from_a_rep_breakpoint_hits_once_per_execution(machine) -> None:
    """A rep-prefixed instruction keeps its PC for each iteration: continuing from
    a breakpoint on it must run all of them, not stop again at the same address."""
    gdb = machine.gdb
    # 7000: mov cx,5 ; 7003: rep stosb ; 7005: jmp 7000   (real mode, es:di = 0:di)
    gdb.write_memory(0x7000, bytes.fromhex("b90500" "f3aa" "ebf9"))
    gdb.write_register("cs", 0)
    gdb.write_register("es", 0)
    gdb.write_register("rip", 0x7000)
    gdb.write_register("rdi", 0x8000)
    gdb.set_breakpoint(0x7003)
    dis = []
    for _ in range(3):
        assert gdb.cont(timeout=10).signal == 5
        assert gdb.read_register("rip") == 0x7003
        dis.append(gdb.read_register("rdi") & 0xFFFF)
    assert dis == [0x8000, 0x8005, 0x800A]


# --- AArch64: qemu-system-aarch64 -M virt, no kernel ----------------------------------------
needs_qemu_arm64 = pytest.mark.skipif(shutil.which("qemu-system-aarch64") is None,
                                      reason="qemu-system-aarch64 not installed "
                                             "(apt-get install qemu-system-arm)")
VIRT_RAM = 0x40000000  # QEMU virt's RAM; the MMU is off at reset, so addresses are physical


@pytest.mark.slow
@needs_qemu_arm64
def test_aarch64_register_file_breakpoint_and_step() -> None:
    """The AArch64 register file from the stub's target.xml (x0..x30, sp, pc,
    cpsr: the Arch's gdb layout), the program counter named as the Arch names it, and
    breakpoints and steps on four-byte instructions."""
    from ksim.arch import get_arch
    from ksim.machine.qemu import QemuMachine

    layout = get_arch("aarch64").gdb.layout

    with QemuMachine(accel="tcg", memory="64M", timeout=10.0, arch="aarch64") as m:
        gdb = m.gdb
        assert m.accel == "tcg"
        assert [(name, size) for name, (_, _, size) in gdb.regs.items()][:len(layout)] == \
            list(layout)
        assert gdb.pc == get_arch("aarch64").pc_reg == "pc"
        # movz x0, #1; add x0, x0, #1; nop; b .-8 (back to the add)
        program = bytes.fromhex("200080d2" "00040091" "1f2003d5" "feffff17")
        gdb.write_memory(VIRT_RAM, program)
        assert m.read_physical(VIRT_RAM, len(program)) == program
        gdb.write_register("pc", VIRT_RAM)
        gdb.set_breakpoint(VIRT_RAM + 8)
        assert gdb.cont(timeout=10).signal == 5
        assert gdb.read_pc() == VIRT_RAM + 8 and gdb.read_register("x0") == 2
        assert gdb.read_memory(VIRT_RAM, len(program)) == program  # no breakpoint in memory
        # continuing from the breakpoint steps off it: one more trip round the loop
        assert gdb.cont(timeout=10).signal == 5
        assert gdb.read_pc() == VIRT_RAM + 8 and gdb.read_register("x0") == 3
        gdb.remove_breakpoint(VIRT_RAM + 8)
        gdb.step()
        assert gdb.read_pc() == VIRT_RAM + 12
        assert gdb.read_registers()["x0"] == 3
