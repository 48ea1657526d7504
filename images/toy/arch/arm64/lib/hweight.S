/*
 * arch/arm64/lib/hweight.S: the two routines lib/hweight.S writes by hand on
 * x86, written by hand here too so that a loop head (a branch target) sits at
 * entry+4, the second instruction: a splice longer than one instruction at
 * the entry would overwrite the target of the loop's back edge.
 */
#include <toy.h>

	.text

/* unsigned int __sw_hweight64(u64 w): population count, one bit per turn. */
	.globl __sw_hweight64
	.type __sw_hweight64, @function
	.p2align 4
__sw_hweight64:
	mov	w1, #0			/* entry+0 */
1:	cbz	x0, 2f			/* entry+4: loop head */
	sub	x2, x0, #1
	and	x0, x0, x2		/* clear the lowest set bit */
	add	w1, w1, #1
	b	1b
2:	mov	w0, w1
	ret
	.size __sw_hweight64, . - __sw_hweight64

/* void __memzero_qwords(void *dst, size_t nqwords): nqwords must be > 0. */
	.globl __memzero_qwords
	.type __memzero_qwords, @function
	.p2align 4
__memzero_qwords:
	lsl	x1, x1, #3		/* entry+0: bytes */
1:	subs	x1, x1, #8		/* entry+4: loop head */
	str	xzr, [x0, x1]
	b.ne	1b
	ret
	.size __memzero_qwords, . - __memzero_qwords

	.section .note.GNU-stack, "", @progbits
