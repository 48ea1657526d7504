"""The generic analyses on AArch64 code: blocks and edges from the reader's flow,
and liveness from its register effects and the AArch64 calling convention."""

from __future__ import annotations

import keystone

from ksim.analysis.cfg import EdgeKind, build_cfg
from ksim.analysis.liveness import Liveness, Target, TargetKind
from ksim.arch.aarch64 import ARCH
from ksim.arch.aarch64.reader import decode

AT = 0xFFFF800010000000
OTHER = AT + 0x1000
_ks = keystone.Ks(keystone.KS_ARCH_ARM64, keystone.KS_MODE_LITTLE_ENDIAN)

# 00 stp x29, x30, [sp, #-16]!   04 mov x29, sp      08 cmp x0, #4
# 0c b.hi .+0x14 (-> 20)         10 add x0, x0, x1   14 bl OTHER
# 18 cbnz x0, .-0x10 (-> 08)     1c mov x0, #0       20 ldp x29, x30, [sp], #16
# 24 ret
SOURCE = (f"stp x29, x30, [sp, #-16]!; mov x29, sp; cmp x0, #4; b.hi #{AT + 0x20:#x}; "
          f"add x0, x0, x1; bl #{OTHER:#x}; cbnz x0, #{AT + 8:#x}; mov x0, #0; "
          f"ldp x29, x30, [sp], #16; ret")


def function():
    code = bytes(_ks.asm(SOURCE, AT)[0])
    insns = list(decode(code, AT))
    assert len(insns) * 4 == len(code)
    return build_cfg(insns, AT, AT + len(code), arch=ARCH)


def test_blocks_and_edges():
    cfg = function()
    assert sorted(cfg.blocks) == [AT, AT + 8, AT + 0x10, AT + 0x18, AT + 0x1C, AT + 0x20]
    edges = {(e.src - AT, e.dst - AT, e.kind) for e in cfg.edges}
    assert (0x8, 0x20, EdgeKind.TAKEN) in edges
    assert (0x8, 0x10, EdgeKind.NOT_TAKEN) in edges
    assert (0x10, 0x18, EdgeKind.CALL_RETURN) in edges
    assert (0x18, 0x8, EdgeKind.TAKEN) in edges
    assert cfg.unresolved == () and cfg.misaligned == ()


def test_liveness_follows_the_reader_and_the_convention():
    cfg = function()
    live = Liveness(cfg, ARCH.convention, lambda target: Target(TargetKind.FUNCTION),
                    preserved=frozenset())
    # the flags: set by cmp, read by b.hi, dead elsewhere
    assert "nzcv" in live.live_after(AT + 8) and "nzcv" not in live.live_at(AT + 8)
    assert "nzcv" not in live.live_after(AT + 0xC)
    # the arguments read before the call; x30 saved by stp, read again by ret
    assert {"x0", "x1", "x30", "x29", "sp"} <= live.live_at(AT)
    # scratch registers no path reads are dead at the entry
    assert not {"x9", "x16", "x17"} & live.live_at(AT)
    # the call's result is read by cbnz; the call itself reads the arguments
    assert "x0" in live.live_after(AT + 0x14)
    assert set(ARCH.arg_regs) <= live.live_at(AT + 0x14)
