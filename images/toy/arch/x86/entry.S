/*
 * arch/x86/entry.S: the 64-bit entry, interrupt entries (the ksim int3
 * dispatcher, the timer, exceptions), the stack switch, and the ksim patch area.
 */
#include <toy.h>

	.text

/* The ksim ABI's layout constants as absolute symbols (checked in kernel/sched.c). */
	.globl KSIM_TASK_PID_OFFSET, KSIM_TASK_COMM_OFFSET, KSIM_TASK_STRUCT_SIZE
	.set KSIM_TASK_PID_OFFSET, TASK_pid
	.set KSIM_TASK_COMM_OFFSET, TASK_comm
	.set KSIM_TASK_STRUCT_SIZE, TASK_struct_size

/*
 * ksim_entry64: needs only %rsp = init_stack_top.  Unicorn starts here;
 * QEMU's PVH path arrives here from pvh_start64 in long mode.
 */
	.globl ksim_entry64
	.type ksim_entry64, @function
	.p2align 4
ksim_entry64:
	cld
	cli
	xorl	%ebp, %ebp
	call	trap_init		/* builds and loads the IDT */
	call	serial_init
	call	pit_init
	call	start_kernel
1:	hlt
	jmp	1b
	.size ksim_entry64, . - ksim_entry64

/*
 * #BP (vector 3), interrupt gate.  The CPU pushed SS, RSP, RFLAGS, CS, RIP
 * (Intel SDM vol. 3, 6.14.2); RIP is the address after the int3, so the
 * spliced site is RIP - 1.  If the site is in ksim_trap_table, the saved RIP
 * becomes the patch and iretq resumes there with every register, the flags
 * and RSP exactly as the interrupted code had them: as if the int3 had been
 * a jmp to the patch.  Only rax, rcx, rdx are used, and restored.
 */
	.globl ksim_int3_entry
	.type ksim_int3_entry, @function
	.p2align 4
ksim_int3_entry:
	pushq	%rax
	pushq	%rcx
	pushq	%rdx
	movq	24(%rsp), %rax			/* saved RIP */
	decq	%rax				/* site of the int3 */
	movq	ksim_trap_count(%rip), %rcx
	leaq	ksim_trap_table(%rip), %rdx
	cmpq	$KSIM_TRAP_SLOTS, %rcx
	jbe	1f
	movl	$KSIM_TRAP_SLOTS, %ecx		/* never scan past the table */
1:	testq	%rcx, %rcx
	jz	.Lint3_unknown
	cmpq	(%rdx), %rax
	je	.Lint3_found
	addq	$16, %rdx
	decq	%rcx
	jmp	1b
.Lint3_found:
	movq	8(%rdx), %rax
	movq	%rax, 24(%rsp)			/* resume at the patch */
	popq	%rdx
	popq	%rcx
	popq	%rax
	iretq
.Lint3_unknown:
	movq	%rax, %rdi
	andq	$-16, %rsp
	call	ksim_unknown_trap		/* prints a panic line, exits QEMU: no return */
	ud2
	.size ksim_int3_entry, . - ksim_int3_entry

/* IRQ0 (PIT), interrupt gate: counts and EOIs, nothing else, so that the
 * workload's function counts do not depend on when interrupts arrive. */
	.globl timer_interrupt
	.type timer_interrupt, @function
	.p2align 4
timer_interrupt:
	pushq	%rax
	incq	irq_ticks(%rip)
	movb	$0x20, %al			/* non-specific EOI to the master 8259 */
	outb	%al, $0x20
	popq	%rax
	iretq
	.size timer_interrupt, . - timer_interrupt

/* Other PIC lines (spurious IRQ7 included): EOI both PICs and return. */
	.globl spurious_interrupt
	.type spurious_interrupt, @function
	.p2align 4
spurious_interrupt:
	pushq	%rax
	movb	$0x20, %al
	outb	%al, $0xa0
	outb	%al, $0x20
	popq	%rax
	iretq
	.size spurious_interrupt, . - spurious_interrupt

/*
 * Exceptions other than #BP: a stub per vector pushes a dummy error code
 * where the CPU pushes none, then the vector; common code calls
 * do_exception(vector, frame), which panics.
 */
	.macro EXC_STUB vec, has_err
	.p2align 3
exc_stub_\vec:
	.if \has_err == 0
	pushq	$0
	.endif
	pushq	$\vec
	jmp	exception_common
	.endm

	.globl exception_stubs
	.type exception_stubs, @function
	.p2align 4
exception_stubs:
	EXC_STUB 0, 0
	EXC_STUB 1, 0
	EXC_STUB 2, 0
	EXC_STUB 3, 0
	EXC_STUB 4, 0
	EXC_STUB 5, 0
	EXC_STUB 6, 0
	EXC_STUB 7, 0
	EXC_STUB 8, 1
	EXC_STUB 9, 0
	EXC_STUB 10, 1
	EXC_STUB 11, 1
	EXC_STUB 12, 1
	EXC_STUB 13, 1
	EXC_STUB 14, 1
	EXC_STUB 15, 0
	EXC_STUB 16, 0
	EXC_STUB 17, 1
	EXC_STUB 18, 0
	EXC_STUB 19, 0
	EXC_STUB 20, 0
	EXC_STUB 21, 1
	.size exception_stubs, . - exception_stubs

	.section .rodata
	.balign 8
	.globl exception_stub_table
exception_stub_table:
	.irp v, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21
	.quad exc_stub_\v
	.endr
	.text

	.type exception_common, @function
	.p2align 4
exception_common:
	movq	(%rsp), %rdi			/* vector */
	leaq	8(%rsp), %rsi			/* error code, then the CPU frame */
	andq	$-16, %rsp
	call	do_exception			/* panics: no return */
	ud2
	.size exception_common, . - exception_common

/*
 * struct task_struct *__switch_to_asm(prev, next): save prev's callee-saved
 * registers on its stack and its %rsp in prev->thread.sp, load next's, and
 * finish in C (__switch_to), which returns prev on next's stack.
 */
	.globl __switch_to_asm
	.type __switch_to_asm, @function
	.p2align 4
__switch_to_asm:
	pushq	%rbp
	pushq	%rbx
	pushq	%r12
	pushq	%r13
	pushq	%r14
	pushq	%r15
	movq	%rsp, TASK_threadsp(%rdi)
	movq	TASK_threadsp(%rsi), %rsp
	popq	%r15
	popq	%r14
	popq	%r13
	popq	%r12
	popq	%rbx
	popq	%rbp
	jmp	__switch_to
	.size __switch_to_asm, . - __switch_to_asm

/* First return of a new task (kernel_thread built its stack): rax = prev. */
	.globl ret_from_fork
	.type ret_from_fork, @function
	.p2align 4
ret_from_fork:
	movq	%rax, %rdi
	call	schedule_tail
	movq	%r12, %rdi
	call	*%rbx				/* fn(arg); kernel threads never return */
	ud2
	.size ret_from_fork, . - ret_from_fork

/* ksim's patch area: 1 MiB right after the text, filled with int3. */
	.section .ksim_patch, "awx", @progbits
	.balign 4096
	.fill 0x100000, 1, 0xcc

	.section .bss..page_aligned, "aw", @nobits
	.balign 4096
	.globl init_stack, init_stack_top
init_stack:
	.skip THREAD_SIZE
init_stack_top:

	.section .note.GNU-stack, "", @progbits
