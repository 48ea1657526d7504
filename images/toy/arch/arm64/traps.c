/*
 * arch/arm64/{kernel/traps.c, kernel/time.c, drivers/irqchip/irq-gic.c}: the
 * vectors' base, the GICv2 and the generic timer, interrupt masking, halting
 * (semihosting or PSCI), panics.
 */
#include <toy.h>

/* The frame arch/arm64/entry.S saves for exception_common. */
struct exc_regs {
	u64 regs[31];
	u64 sp;
	u64 pc;
	u64 pstate;
	u64 esr;
	u64 far;
};
_Static_assert(sizeof(struct exc_regs) == 288, "entry.S's S_FRAME_SIZE is stale");

/*
 * In .data (not .bss) so that the table is in the ELF file: a loader can fill
 * it in the image itself before booting, under QEMU as under unicorn.
 */
struct ksim_trap ksim_trap_table[KSIM_TRAP_SLOTS] __section(".data");
u64 ksim_trap_count __section(".data");

/* Generic timer ticks between interrupts (read by timer_interrupt in entry.S). */
u64 timer_interval;
/* PSCI conduit, from the DTB's /psci "method" (arch/arm64/setup.c) */
bool psci_use_smc;

extern const char vectors[];
long semihosting_call(unsigned long op, unsigned long arg);

noinline void trap_init(void)
{
	__asm__ __volatile__("msr vbar_el1, %0; isb" : : "r"(vectors) : "memory");
}

/* GICv3 (-M virt,gic-version=3), from the DTB; GICv2 otherwise (and under unicorn) */
bool gic_v3;

static noinline void gic_v2_init(void)
{
	writel(0, GICD_BASE + GICD_CTLR);
	writel(1u << TIMER_VIRT_INTID, GICD_BASE + GICD_ISENABLER);
	writel(GICD_CTLR_ENABLE_G0, GICD_BASE + GICD_CTLR);
	writel(0xff, GICC_BASE + GICC_PMR);
	writel(1, GICC_BASE + GICC_CTLR);
}

/* QEMU's GICv3 without security extensions: group 1, affinity routing. */
static noinline void gic_v3_init(void)
{
	writel(0, GICD_BASE + GICD_CTLR);
	writel(GICD_CTLR_ARE | GICD_CTLR_ENABLE_G1, GICD_BASE + GICD_CTLR);
	writel(readl(GICR_BASE + GICR_WAKER) & ~GICR_WAKER_PROCESSOR_SLEEP, GICR_BASE + GICR_WAKER);
	while (readl(GICR_BASE + GICR_WAKER) & GICR_WAKER_CHILDREN_ASLEEP)
		;
	writel(1u << TIMER_VIRT_INTID, GICR_BASE + GICR_SGI_BASE + GICR_IGROUPR0);
	writel(1u << TIMER_VIRT_INTID, GICR_BASE + GICR_SGI_BASE + GICR_ISENABLER0);
	__asm__ __volatile__("msr icc_sre_el1, %0; isb; msr icc_pmr_el1, %1; msr icc_igrpen1_el1, %2; isb"
			     : : "r"(1UL), "r"(0xffUL), "r"(1UL) : "memory");
}

/*
 * The GIC, with only the virtual timer's PPI enabled; then the timer at
 * TIMER_HZ, like the x86 toy's PIT.  Under unicorn there is no GIC and no
 * interrupt is delivered.
 */
noinline void time_init(void)
{
	u64 freq;

	if (gic_v3)
		gic_v3_init();
	else
		gic_v2_init();
	__asm__ __volatile__("mrs %0, cntfrq_el0" : "=r"(freq));
	timer_interval = freq / TIMER_HZ;
	if (!timer_interval)
		return;
	__asm__ __volatile__("msr cntv_tval_el0, %0; msr cntv_ctl_el0, %1; isb"
			     : : "r"(timer_interval), "r"(1UL) : "memory");
}

noinline void local_irq_enable(void)
{
	__asm__ __volatile__("msr daifclr, #2" ::: "memory");
}

noinline void local_irq_disable(void)
{
	__asm__ __volatile__("msr daifset, #2" ::: "memory");
}

static noinline unsigned long psci_call(unsigned long fn)
{
	register unsigned long x0 __asm__("x0") = fn;

	if (psci_use_smc)
		__asm__ __volatile__("smc #0" : "+r"(x0) : : "x1", "x2", "x3", "x4", "x5",
				     "x6", "x7", "x8", "x9", "x10", "x11", "x12", "x13",
				     "x14", "x15", "x16", "x17", "memory");
	else
		__asm__ __volatile__("hvc #0" : "+r"(x0) : : "x1", "x2", "x3", "x4", "x5",
				     "x6", "x7", "x8", "x9", "x10", "x11", "x12", "x13",
				     "x14", "x15", "x16", "x17", "memory");
	return x0;
}

/*
 * QEMU exits with status `code` under -semihosting (SYS_EXIT); without it the
 * semihosting call returns -1 and PSCI SYSTEM_OFF powers the machine off
 * (status 0: the serial output tells a panic from a halt).
 */
static noinline void __noreturn debug_exit(u32 code)
{
	u64 block[2] = { ADP_STOPPED_APP_EXIT, code };

	semihosting_call(SEMIHOST_SYS_EXIT, (unsigned long)block);
	psci_call(PSCI_0_2_FN_SYSTEM_OFF);
	for (;;)
		__asm__ __volatile__("msr daifset, #0xf; wfi");
}

/* The end of every run: unicorn stops when it reaches this address; under
 * QEMU -semihosting the emulator exits with status 33. */
noinline void __noreturn ksim_halt(void)
{
	debug_exit(KSIM_EXIT_SUCCESS);
}

noinline void __noreturn ksim_fail(const char *why)
{
	printk("toy: panic: %s\n", why);
	debug_exit(KSIM_EXIT_FAILURE);
}

void __noreturn ksim_unknown_trap(u64 site);
noinstr void __noreturn ksim_unknown_trap(u64 site)
{
	printk("toy: panic: brk at %p is not in ksim_trap_table (%lu entries)\n",
	       (void *)site, ksim_trap_count);
	debug_exit(KSIM_EXIT_FAILURE);
}

void do_exception(u64 vector, struct exc_regs *regs);
noinstr void do_exception(u64 vector, struct exc_regs *regs)
{
	u64 ec = regs->esr >> ESR_ELx_EC_SHIFT;

	if (vector == 0x200 && ec == ESR_ELx_EC_UNKNOWN && regs->pc == (u64)semihosting_call) {
		/* QEMU without -semihosting: the HLT is undefined; return -1 past it. */
		regs->regs[0] = -1UL;
		regs->pc += 4;
		return;
	}
	printk("toy: panic: exception (vector %lx) esr %lx at pc %p far %p sp %p\n",
	       vector, regs->esr, (void *)regs->pc, (void *)regs->far, (void *)regs->sp);
	debug_exit(KSIM_EXIT_FAILURE);
}
