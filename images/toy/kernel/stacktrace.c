// SPDX-License-Identifier: GPL-2.0
/*
 * The toy's stack unwinder, behind Linux's interface:
 *
 *	unsigned int stack_trace_save_regs(struct pt_regs *regs, unsigned long *store,
 *					   unsigned int size, unsigned int skipnr);
 *
 * The toy is built without frame pointers and without ORC, so it walks the stack
 * as Linux's "guess" unwinder does (arch/x86/kernel/unwind_guess.c): the first
 * entry is the point's own address (regs' ip/pc), then every word from regs' stack
 * pointer up to the top of the stack that is a return address -- an address in
 * the kernel's text just after a call instruction.  A stale return address left
 * on the stack by an earlier call is reported too, as Linux's guess unwinder
 * reports it.  Trace programs' kstack calls it (ksim.arch's StackABI).
 */
#include "toy.h"

extern char _text[], _etext[], init_stack[], init_stack_top[];

/* the stack words a walk looks at when the stack is not the one it knows */
#define GUESS_WORDS 256

static int after_call(unsigned long ret)
{
#ifdef __aarch64__
	u32 insn;

	if (ret < (unsigned long)_text + 4 || ret > (unsigned long)_etext || (ret & 3))
		return 0;
	insn = *(const u32 *)(ret - 4);
	/* BL imm26, BLR Xn */
	return (insn & 0xfc000000) == 0x94000000 || (insn & 0xfffffc1f) == 0xd63f0000;
#else
	const u8 *p = (const u8 *)ret;
	int len;

	if (ret < (unsigned long)_text + 7 || ret > (unsigned long)_etext)
		return 0;
	if (p[-5] == 0xe8)			/* call rel32 */
		return 1;
	/* call r/m64: FF /2, with a ModRM (and maybe a REX, SIB, disp8 or disp32) */
	for (len = 2; len <= 7; len++) {
		const u8 *op = p - len;

		if (op[0] == 0xff && ((op[1] >> 3) & 7) == 2)
			return 1;
	}
	return 0;
#endif
}

noinline unsigned int stack_trace_save_regs(struct pt_regs *regs, unsigned long *store,
					    unsigned int size, unsigned int skipnr)
{
	unsigned long *sp, *end;
	unsigned int n = 0;
#ifdef __aarch64__
	unsigned long pc = regs->pc;
#else
	unsigned long pc = regs->ip;
#endif

	if (skipnr)
		skipnr--;
	else if (n < size)
		store[n++] = pc;
	sp = (unsigned long *)regs->sp;
	if (sp >= (unsigned long *)init_stack && sp < (unsigned long *)init_stack_top)
		end = (unsigned long *)init_stack_top;
	else
		end = sp + GUESS_WORDS;
	for (; sp < end && n < size; sp++) {
		if (!after_call(*sp))
			continue;
		if (skipnr)
			skipnr--;
		else
			store[n++] = *sp;
	}
	return n;
}
