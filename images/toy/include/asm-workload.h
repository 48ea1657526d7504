/*
 * init/main.c's per-architecture adjustments, included after <toy.h>.
 *
 * C leaves unspecified the order in which a call's arguments are evaluated.
 * The workload's OP_MSS step passes two PRNG draws as tcp_sync_mss's
 * arguments: gcc evaluates them right to left on x86-64 (the mtu is drawn
 * first) and left to right on aarch64.  arm64 draws the mtu first too, so that
 * a seed gives the same run, the same counts and the same checksum on both.
 */
#ifndef ASM_WORKLOAD_H
#define ASM_WORKLOAD_H

#ifdef __aarch64__
#define tcp_sync_mss(sk, pmtu)	({ u32 __pmtu = (pmtu); (tcp_sync_mss)((sk), __pmtu); })
#endif

#endif /* ASM_WORKLOAD_H */
