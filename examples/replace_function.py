#!/usr/bin/env python3
"""replace_function -- true function replacement (the KernInst guide's
replace_function.C, section 6.4), with a replacement compiled separately.

    python examples/replace_function.py [TARGET] [ITERATIONS]
    python examples/replace_function.py unicorn:toy-arm64

tcp_sync_mss(sk, pmtu) is replaced by a C version from the component repository
(built for the kernel's architecture -- gcc -c -mcmodel=kernel on x86-64,
aarch64-linux-gnu-gcc -c -mcmodel=small on arm64 -- loaded into the patch area,
linked against the kernel's e100_netdev) that also reserves 12 bytes for TCP timestamps and
clamps to the NIC's MTU, and counts its calls.  Checks: the workload's checksum
changes while the replacement is in, the replacement ran once per entry of the
original (address hook), and undo brings the checksum back.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ksim import components
from ksim.kapi import Manager
from ksim.replace import Replacements

ROOT = Path(__file__).resolve().parents[1]
SOURCE = r"""
#include <toy.h>

u64 tcp_sync_mss_v2_calls;

u32 tcp_sync_mss_v2(struct sock *sk, u32 pmtu)
{
	u32 mss;

	if (pmtu > e100_netdev.mtu)		/* a kernel symbol, linked at load time */
		pmtu = e100_netdev.mtu;
	mss = pmtu - 20 - 20 - 12;	/* IP and TCP headers, TCP timestamps */
	if (mss < 88)
		mss = 88;
	sk->pmtu = pmtu;
	sk->mss_cache = mss;
	tcp_sync_mss_v2_calls++;
	return mss;
}
"""


def main(argv: list[str]) -> int:
    target = argv[0] if argv else "unicorn:toy"
    iterations = int(argv[1]) if len(argv) > 1 else 500
    with Manager.attach(target) as kmgr:
        baseline = kmgr.run(iterations=iterations).checksum
        obj = components.build_c(SOURCE, arch=kmgr.arch,
                                 include=(ROOT / "images" / "toy" / "include",),
                                 name="tcp_sync_mss_v2")
        comp = components.load(kmgr, obj)
        repl = Replacements(kmgr)
        r = repl.replace_function("tcp_sync_mss", comp.symbol("tcp_sync_mss_v2"))
        calls = comp.symbol("tcp_sync_mss_v2_calls")
        with kmgr.oracle(kmgr.find_function("tcp_sync_mss").address) as oracle:
            replaced = kmgr.run(iterations=iterations).checksum
            entries = oracle.count
        ran = int.from_bytes(kmgr.copy_from_kernel(calls, 8), "little")
        repl.undo(r)
        comp.unload()
        restored = kmgr.run(iterations=iterations).checksum
        print(f"checksum {baseline:#x} -> replaced ({r.tactic}) {replaced:#x} -> undone {restored:#x}")
        print(f"tcp_sync_mss_v2 ran {ran} times; oracle {oracle.name}: {entries} entries")
        if not (replaced != baseline and restored == baseline and ran == entries > 0):
            print("MISMATCH", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
