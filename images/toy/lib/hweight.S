/*
 * lib/hweight.S: two routines written by hand so that a loop head (a branch
 * target) sits at entry+2, inside the first 5 bytes: a 5-byte jmp spliced at
 * the entry would overwrite the target of the loop's back edge.
 */
#include <toy.h>

	.text

/* unsigned int __sw_hweight64(u64 w): population count, one bit per turn. */
	.globl __sw_hweight64
	.type __sw_hweight64, @function
	.p2align 4
__sw_hweight64:
	xorl	%eax, %eax		/* entry+0, 2 bytes */
1:	testq	%rdi, %rdi		/* entry+2: loop head */
	jz	2f
	leaq	-1(%rdi), %rdx
	andq	%rdx, %rdi		/* clear the lowest set bit */
	incl	%eax
	jmp	1b
2:	ret
	.size __sw_hweight64, . - __sw_hweight64

/* void __memzero_qwords(void *dst, size_t nqwords): nqwords must be > 0. */
	.globl __memzero_qwords
	.type __memzero_qwords, @function
	.p2align 4
__memzero_qwords:
	xorl	%eax, %eax		/* entry+0, 2 bytes */
1:	movq	%rax, (%rdi)		/* entry+2: loop head */
	addq	$8, %rdi
	decq	%rsi
	jnz	1b
	ret
	.size __memzero_qwords, . - __memzero_qwords

	.section .note.GNU-stack, "", @progbits
