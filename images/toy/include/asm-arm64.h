/*
 * What differs on arm64, included by <toy.h> (before its types, so only C's own
 * types here) when __aarch64__ is defined.  The x86 counterparts are the
 * __x86_64__ blocks of <toy.h>.  Constants first (also seen by .S files).
 */
#ifndef ASM_ARM64_H
#define ASM_ARM64_H

/*
 * Memory map (arch/arm64/toy.ld, arch/arm64/head.S).  As Linux arm64 since 5.8
 * (no TEXT_OFFSET), the kernel is linked at KIMAGE_VADDR and loaded at a 2 MiB
 * aligned physical address, KIMAGE_PADDR: 2 MiB into QEMU virt's RAM, whose
 * first MiB is where QEMU puts the DTB for an ELF kernel (it does so only if
 * the DTB fits below the kernel's lowest address).
 * physical = virtual - KIMAGE_VADDR + KIMAGE_PADDR for the kernel image.
 * TTBR1 maps KIMAGE_VADDR.. onto KIMAGE_PADDR.. with 2 MiB blocks
 * (KERNEL_MAP_SIZE); TTBR0 maps the first 2 GiB one to one: 0..1 GiB as Device
 * memory (UART, GIC), 1..2 GiB (RAM: the DTB) as Normal memory.
 */
#define KIMAGE_VADDR		0xffff800008000000
#define RAM_BASE		0x40000000	/* QEMU virt */
#define KIMAGE_PADDR		0x40200000
#define KERNEL_MAP_SIZE		0x2000000	/* 32 MiB */

/*
 * QEMU virt devices (hw/arm/virt.c), identity-mapped through TTBR0: the UART,
 * and the GIC: a GICv2 (distributor, CPU interface) by default, a GICv3
 * (distributor, redistributors, system-register CPU interface) with
 * -M virt,gic-version=3; the DTB tells which (arch/arm64/setup.c).
 */
#define PL011_BASE		0x09000000
#define GICD_BASE		0x08000000
#define GICC_BASE		0x08010000	/* GICv2 */
#define GICR_BASE		0x080a0000	/* GICv3, CPU 0's redistributor */
#define GICD_CTLR		0x000
#define GICD_CTLR_ENABLE_G0	0x1
#define GICD_CTLR_ENABLE_G1	0x2
#define GICD_CTLR_ARE		0x10		/* GICv3, single security state */
#define GICD_ISENABLER		0x100
#define GICC_CTLR		0x000
#define GICC_PMR		0x004
#define GICC_IAR		0x00c
#define GICC_EOIR		0x010
#define GICR_WAKER		0x0014
#define GICR_WAKER_PROCESSOR_SLEEP 0x2
#define GICR_WAKER_CHILDREN_ASLEEP 0x4
#define GICR_SGI_BASE		0x10000
#define GICR_IGROUPR0		0x0080
#define GICR_ISENABLER0		0x0100
#define TIMER_VIRT_INTID	27	/* PPI 11: the EL1 virtual timer (CNTV) */
#define GIC_SPURIOUS_INTID	1020	/* 1020..1023: no interrupt, no EOI */
#define TIMER_HZ		1000	/* as the x86 toy's PIT */

/* ESR_EL1.EC values (ARM ARM D17.2.37) */
#define ESR_ELx_EC_SHIFT	26
#define ESR_ELx_EC_UNKNOWN	0x00
#define ESR_ELx_EC_BRK64	0x3c

/* PSCI 0.2 function ids (QEMU virt implements PSCI through hvc, or smc at EL2) */
#define PSCI_0_2_FN_SYSTEM_OFF	0x84000008
#define PSCI_0_2_FN_SYSTEM_RESET 0x84000009

/* Arm semihosting (QEMU -semihosting): SYS_EXIT with ADP_Stopped_ApplicationExit */
#define SEMIHOST_SYS_EXIT	0x18
#define ADP_STOPPED_APP_EXIT	0x20026

/*
 * The exit codes: QEMU's status with -semihosting is the code itself; they are
 * the x86 toy's isa-debug-exit statuses ((value << 1) | 1), so that a run ends
 * with 33 (ksim_halt) or 35 (a panic) on both architectures.
 */
#define KSIM_EXIT_SUCCESS	33
#define KSIM_EXIT_FAILURE	35

#ifndef __ASSEMBLY__

/*
 * Linux's arm64 names for what the shared sources call by their x86 names:
 * the syscall handlers are __arm64_sys_* (arch/arm64/include/asm/syscall_wrapper.h),
 * invoke_syscall dispatches them (arch/arm64/kernel/syscall.c), and the stack
 * switch is cpu_switch_to (arch/arm64/kernel/entry.S).
 */
#define __x64_sys_read		__arm64_sys_read
#define __x64_sys_write		__arm64_sys_write
#define __x64_sys_open		__arm64_sys_open
#define __x64_sys_close		__arm64_sys_close
#define __x64_sys_lseek		__arm64_sys_lseek
#define __x64_sys_fsync		__arm64_sys_fsync
#define __x64_sys_sched_yield	__arm64_sys_sched_yield
#define __x64_sys_getpid	__arm64_sys_getpid
#define __x64_sys_getppid	__arm64_sys_getppid
#define __x64_sys_getuid	__arm64_sys_getuid
#define __x64_sys_getgid	__arm64_sys_getgid
#define __x64_sys_sync		__arm64_sys_sync
#define __x64_sys_ni_syscall	__arm64_sys_ni_syscall
#define __x64_sys_times		__arm64_sys_times
#define __x64_sys_sendto	__arm64_sys_sendto
#define __x64_sys_brk		__arm64_sys_brk
#define __x64_sys_sethostname	__arm64_sys_sethostname
#define __x64_sys_gettid	__arm64_sys_gettid
#define __x64_sys_uname		__arm64_sys_uname
#define do_syscall_64		invoke_syscall
#define __switch_to_asm		cpu_switch_to

/* Code on the exception paths, which ksim never instruments (arch/arm64/toy.ld) */
#define noinstr		__attribute__((__noinline__, __section__(".noinstr.text")))

/* MMIO (Device-nGnRE through TTBR0): single 32-bit accesses, as Linux's readl/writel. */
static inline void writel(unsigned int v, unsigned long addr)
{
	__asm__ __volatile__("str %w0, [%1]" : : "rZ"(v), "r"(addr) : "memory");
}
static inline unsigned int readl(unsigned long addr)
{
	unsigned int v;

	__asm__ __volatile__("ldr %w0, [%1]" : "=r"(v) : "r"(addr) : "memory");
	return v;
}

/* The x86 toy's rdtsc(): here the virtual count of the generic timer. */
static inline unsigned long long rdtsc(void)
{
	unsigned long long v;

	__asm__ __volatile__("isb; mrs %0, cntvct_el0" : "=r"(v) : : "memory");
	return v;
}

#define COMMAND_LINE_SIZE	512
extern char boot_command_line[COMMAND_LINE_SIZE];
extern unsigned long __fdt_pointer;	/* physical; 0 when no DTB was found */
void setup_arch(void);
void time_init(void);
void parse_boot_params(void);

#endif /* __ASSEMBLY__ */
#endif /* ASM_ARM64_H */
