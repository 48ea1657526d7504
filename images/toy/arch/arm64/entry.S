/*
 * arch/arm64/entry.S: the 64-bit entry, the exception vectors (the ksim BRK
 * dispatcher, the timer interrupt, exceptions), the stack switch, semihosting,
 * and the ksim patch area.  The code is in .entry.text, which ksim never
 * instruments (arch/arm64/toy.ld).
 */
#include <toy.h>

/*
 * Exception frame (struct exc_regs in arch/arm64/traps.c): x0..x30, the
 * interrupted sp, elr, spsr, esr, far.  Every vector entry allocates it on the
 * current stack (EL1h: the interrupted code's own stack; no red zone on arm64)
 * and saves x0..x3 into it; the paths that need more save more.
 */
#define S_X0		0
#define S_X2		16
#define S_SP		248
#define S_PC		256
#define S_ESR		272
#define S_FRAME_SIZE	288

	.section .entry.text, "ax"

/* The ksim ABI's layout constants as absolute symbols (checked in kernel/sched.c). */
	.globl KSIM_TASK_PID_OFFSET, KSIM_TASK_COMM_OFFSET, KSIM_TASK_STRUCT_SIZE
	.set KSIM_TASK_PID_OFFSET, TASK_pid
	.set KSIM_TASK_COMM_OFFSET, TASK_comm
	.set KSIM_TASK_STRUCT_SIZE, TASK_struct_size

/*
 * ksim_entry64: needs SP = init_stack_top, EL1, and the kernel's virtual
 * addresses (the MMU on with head.S's tables, or unicorn's virtual TLB) plus
 * the device pages one to one.  head.S arrives here; unicorn may start here.
 */
	.globl ksim_entry64
	.type ksim_entry64, @function
	.p2align 4
ksim_entry64:
	msr	daifset, #0xf
	mov	x29, #0
	mov	x30, #0
	adrp	x0, init_task
	add	x0, x0, :lo12:init_task
	msr	sp_el0, x0			/* current, as Linux arm64 keeps it */
	bl	trap_init			/* VBAR_EL1 */
	bl	serial_init
	bl	setup_arch			/* the DTB: command line, PSCI conduit */
	bl	time_init			/* GIC and the generic timer */
	bl	start_kernel
1:	wfi
	b	1b
	.size ksim_entry64, . - ksim_entry64

/*
 * The vector table (ARM ARM D1.10.2): 16 entries of 0x80 bytes, for exceptions
 * from EL1 with SP_EL0 (never used: the kernel runs on SP_EL1), from EL1 with
 * SP_EL1, and from EL0 (none: there is no user space).
 */
	.macro	ventry_save
	sub	sp, sp, #S_FRAME_SIZE
	stp	x0, x1, [sp, #S_X0]
	stp	x2, x3, [sp, #S_X2]
	.endm

	.macro	ventry_bad offset
	.balign	0x80
	ventry_save
	mov	x0, #\offset
	b	exception_common
	.endm

	.globl vectors
	.type vectors, @function
	.balign	2048
vectors:
	ventry_bad 0x000			/* EL1t: synchronous */
	ventry_bad 0x080			/* EL1t: IRQ */
	ventry_bad 0x100			/* EL1t: FIQ */
	ventry_bad 0x180			/* EL1t: SError */

	.balign	0x80				/* 0x200, EL1h synchronous: BRK or an exception */
	ventry_save
	mrs	x0, esr_el1
	lsr	x0, x0, #ESR_ELx_EC_SHIFT
	cmp	x0, #ESR_ELx_EC_BRK64
	b.eq	ksim_brk_entry
	mov	x0, #0x200
	b	exception_common

	.balign	0x80				/* 0x280, EL1h IRQ */
	ventry_save
	b	timer_interrupt

	ventry_bad 0x300			/* EL1h: FIQ */
	ventry_bad 0x380			/* EL1h: SError */
	ventry_bad 0x400			/* EL0 AArch64 */
	ventry_bad 0x480
	ventry_bad 0x500
	ventry_bad 0x580
	ventry_bad 0x600			/* EL0 AArch32 */
	ventry_bad 0x680
	ventry_bad 0x700
	ventry_bad 0x780
	.balign	0x80
	.size vectors, . - vectors

/*
 * BRK (ESR_EL1.EC 0x3c), from the EL1h synchronous vector, which allocated the
 * frame and saved x0..x3.  ELR_EL1 is the address of the BRK itself (a BRK's
 * preferred return address), so it is the spliced site, whatever its immediate.
 * If the site is in ksim_trap_table, ELR_EL1 becomes the patch and eret resumes
 * there with every register, sp, and PSTATE (NZCV, DAIF: from SPSR_EL1) exactly
 * as the interrupted code had them: as if the BRK had been a branch to the
 * patch.  Only x0..x3 are used, and restored.
 */
	.globl ksim_brk_entry
	.type ksim_brk_entry, @function
	.p2align 4
ksim_brk_entry:
	mrs	x0, elr_el1			/* site of the BRK */
	adrp	x1, ksim_trap_count
	ldr	x1, [x1, :lo12:ksim_trap_count]
	mov	x2, #KSIM_TRAP_SLOTS
	cmp	x1, x2
	csel	x1, x2, x1, hi			/* never scan past the table */
	adrp	x2, ksim_trap_table
	add	x2, x2, :lo12:ksim_trap_table
1:	cbz	x1, .Lbrk_unknown
	ldr	x3, [x2], #16			/* entry.site; x2 -> the next entry */
	cmp	x3, x0
	b.eq	.Lbrk_found
	sub	x1, x1, #1
	b	1b
.Lbrk_found:
	ldur	x3, [x2, #-8]			/* entry.patch */
	msr	elr_el1, x3			/* resume at the patch */
	ldp	x2, x3, [sp, #S_X2]
	ldp	x0, x1, [sp, #S_X0]
	add	sp, sp, #S_FRAME_SIZE
	eret
.Lbrk_unknown:
	bl	ksim_unknown_trap		/* x0 = site; prints a panic line, exits QEMU: no return */
	b	.
	.size ksim_brk_entry, . - ksim_brk_entry

/*
 * IRQ: the virtual timer's tick counts irq_ticks and rearms the timer, nothing
 * else, so that the workload's functions run the same number of times under
 * QEMU as in unicorn (where no interrupt is delivered).  Other interrupt ids
 * (none is enabled) are acknowledged and dropped.  GICv2 through its CPU
 * interface's registers, GICv3 through ICC_IAR1_EL1 / ICC_EOIR1_EL1 (gic_v3,
 * set by setup_arch).  x0 = gic_v3, x1 = IAR, x2 = interrupt id.
 */
	.globl timer_interrupt
	.type timer_interrupt, @function
	.p2align 4
timer_interrupt:
	adrp	x0, gic_v3
	ldrb	w0, [x0, :lo12:gic_v3]
	cbnz	w0, 1f
	mov	x3, #GICC_BASE
	ldr	w1, [x3, #GICC_IAR]
	b	2f
1:	mrs	x1, icc_iar1_el1
2:	and	w2, w1, #0xffffff
	cmp	w2, #TIMER_VIRT_INTID
	b.ne	3f
	adrp	x3, irq_ticks
	ldr	x2, [x3, :lo12:irq_ticks]
	add	x2, x2, #1
	str	x2, [x3, :lo12:irq_ticks]
	adrp	x3, timer_interval
	ldr	x2, [x3, :lo12:timer_interval]
	msr	cntv_tval_el0, x2
	b	4f
3:	cmp	w2, #GIC_SPURIOUS_INTID
	b.hs	6f				/* spurious: no EOI */
4:	cbnz	w0, 5f
	mov	x3, #GICC_BASE
	str	w1, [x3, #GICC_EOIR]
	b	6f
5:	msr	icc_eoir1_el1, x1
6:	ldp	x2, x3, [sp, #S_X2]
	ldp	x0, x1, [sp, #S_X0]
	add	sp, sp, #S_FRAME_SIZE
	eret
	.size timer_interrupt, . - timer_interrupt

/*
 * Every other exception: save the whole frame and call do_exception(vector
 * offset, frame), which panics -- or, for the semihosting HLT that QEMU treats
 * as undefined without -semihosting, steps over it and returns, and the frame
 * is restored.
 */
	.type exception_common, @function
	.p2align 4
exception_common:
	stp	x4, x5, [sp, #32]
	stp	x6, x7, [sp, #48]
	stp	x8, x9, [sp, #64]
	stp	x10, x11, [sp, #80]
	stp	x12, x13, [sp, #96]
	stp	x14, x15, [sp, #112]
	stp	x16, x17, [sp, #128]
	stp	x18, x19, [sp, #144]
	stp	x20, x21, [sp, #160]
	stp	x22, x23, [sp, #176]
	stp	x24, x25, [sp, #192]
	stp	x26, x27, [sp, #208]
	stp	x28, x29, [sp, #224]
	add	x1, sp, #S_FRAME_SIZE		/* the interrupted sp */
	stp	x30, x1, [sp, #240]
	mrs	x1, elr_el1
	mrs	x2, spsr_el1
	stp	x1, x2, [sp, #S_PC]
	mrs	x1, esr_el1
	mrs	x2, far_el1
	stp	x1, x2, [sp, #S_ESR]
	mov	x1, sp
	bl	do_exception
	ldp	x1, x2, [sp, #S_PC]
	msr	elr_el1, x1
	msr	spsr_el1, x2
	ldp	x2, x3, [sp, #16]
	ldp	x4, x5, [sp, #32]
	ldp	x6, x7, [sp, #48]
	ldp	x8, x9, [sp, #64]
	ldp	x10, x11, [sp, #80]
	ldp	x12, x13, [sp, #96]
	ldp	x14, x15, [sp, #112]
	ldp	x16, x17, [sp, #128]
	ldp	x18, x19, [sp, #144]
	ldp	x20, x21, [sp, #160]
	ldp	x22, x23, [sp, #176]
	ldp	x24, x25, [sp, #192]
	ldp	x26, x27, [sp, #208]
	ldp	x28, x29, [sp, #224]
	ldr	x30, [sp, #240]
	ldp	x0, x1, [sp, #S_X0]
	add	sp, sp, #S_FRAME_SIZE
	eret
	.size exception_common, . - exception_common

/*
 * struct task_struct *cpu_switch_to(prev, next) (the shared code's
 * __switch_to_asm): save prev's callee-saved registers on its stack and its sp
 * in prev->thread.sp, load next's, and finish in C (__switch_to), which
 * returns prev on next's stack.
 *
 * thread.sp points 32 bytes into the 96-byte frame, so that the 64 bytes above
 * it are the frame kernel_thread() builds for a new task (kernel/sched.c, in
 * the x86 toy's push order):
 *   sp-32: x25 x26 x27 x28 | sp+0: x21 x22 x23 x20 (arg) x19 (fn) x29 (0)
 *   x30 (ret_from_fork) x24 (0).
 * For a new task the four words below sp are unused stack (zero) and sp ends
 * at the top of its stack; __switch_to then returns into ret_from_fork.
 */
	.globl cpu_switch_to
	.type cpu_switch_to, @function
	.p2align 4
cpu_switch_to:
	sub	sp, sp, #96
	stp	x25, x26, [sp]
	stp	x27, x28, [sp, #16]
	stp	x21, x22, [sp, #32]
	stp	x23, x20, [sp, #48]
	stp	x19, x29, [sp, #64]
	stp	x30, x24, [sp, #80]
	add	x9, sp, #32
	str	x9, [x0, #TASK_threadsp]
	ldr	x9, [x1, #TASK_threadsp]
	sub	sp, x9, #32
	ldp	x25, x26, [sp]
	ldp	x27, x28, [sp, #16]
	ldp	x21, x22, [sp, #32]
	ldp	x23, x20, [sp, #48]
	ldp	x19, x29, [sp, #64]
	ldp	x30, x24, [sp, #80]
	add	sp, sp, #96
	msr	sp_el0, x1			/* current */
	b	__switch_to
	.size cpu_switch_to, . - cpu_switch_to

/* First return of a new task: x0 = prev (from __switch_to), x19 = fn, x20 = arg. */
	.globl ret_from_fork
	.type ret_from_fork, @function
	.p2align 4
ret_from_fork:
	bl	schedule_tail
	mov	x0, x20
	blr	x19				/* fn(arg); kernel threads never return */
	udf	#0
	.size ret_from_fork, . - ret_from_fork

/*
 * long semihosting_call(op, arg): an Arm semihosting call (HLT #0xf000), which
 * QEMU implements with -semihosting.  Without it the HLT is undefined and
 * do_exception returns -1 past it.
 */
	.globl semihosting_call
	.type semihosting_call, @function
	.p2align 4
semihosting_call:
	hlt	#0xf000
	ret
	.size semihosting_call, . - semihosting_call

/* ksim's patch area: 1 MiB right after the text, filled with BRK #0. */
	.section .ksim_patch, "awx", @progbits
	.balign 4096
	.fill 0x40000, 4, 0xd4200000

	.section .bss..page_aligned, "aw", @nobits
	.balign 4096
	.globl init_stack, init_stack_top
init_stack:
	.skip THREAD_SIZE
init_stack_top:

	.section .note.GNU-stack, "", @progbits
