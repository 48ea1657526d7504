/*
 * arch/arm64/head.S: the boot entry and the boot page tables.
 *
 * QEMU (-M virt -kernel toy.elf) loads the PT_LOAD segments at their physical
 * addresses and starts primary_entry (the ELF entry, translated to its physical
 * address 0x40200000) at EL1 (EL2 with virtualization=on), MMU off.  x0 holds
 * the DTB's physical address under the Linux boot protocol; QEMU's ELF path
 * leaves x0 = 0 and puts the DTB at the start of RAM instead, so both places
 * are checked for the FDT magic.  The DTB's physical address is left in
 * __fdt_pointer (0 if there is none).
 *
 * The page tables are static (built by the assembler and the linker, not at
 * run time): TTBR1 maps the kernel, TTBR0 maps the first 2 GiB one to one (the
 * devices, and RAM for the instructions right after the MMU goes on).  Then
 * primary_entry moves to the kernel's virtual addresses and jumps to
 * ksim_entry64 with SP = init_stack_top.  Unicorn may start at ksim_entry64
 * directly (arch/arm64/entry.S) or here.
 */
#include <toy.h>

#define pa(x)		((x) - KIMAGE_VADDR + KIMAGE_PADDR)

/* MAIR_EL1: Attr0 Device-nGnRE, Attr1 Normal write-back (read/write-allocate) */
#define MT_DEVICE	0
#define MT_NORMAL	1
#define MAIR_VALUE	((0x04 << (8 * MT_DEVICE)) | (0xff << (8 * MT_NORMAL)))

/* Block and table descriptors (ARM ARM D8.3), 4 KiB granule */
#define PMD_TYPE_TABLE	0x3
#define PMD_TYPE_SECT	0x1
#define PMD_ATTRINDX(t)	((t) << 2)
#define PMD_SECT_S	(3 << 8)	/* inner shareable */
#define PMD_SECT_AF	(1 << 10)
#define PMD_SECT_PXN	(1 << 53)
#define PMD_SECT_UXN	(1 << 54)
/*
 * Kernel memory: EL1 read/write/execute (the patch area is written and run).
 * Neither PXN nor UXN: there is no EL0, and unicorn 2.1 refuses EL1 instruction
 * fetches from a block with either bit set.
 */
#define SECT_NORMAL	(PMD_TYPE_SECT | PMD_ATTRINDX(MT_NORMAL) | PMD_SECT_S | PMD_SECT_AF)
#define SECT_DEVICE	(PMD_TYPE_SECT | PMD_ATTRINDX(MT_DEVICE) | PMD_SECT_AF | PMD_SECT_PXN | PMD_SECT_UXN)

/* TCR_EL1: TTBR0 39-bit (starts at level 1), TTBR1 48-bit (level 0), 4 KiB, WBWA, IS */
#define TCR_T0SZ	(64 - 39)
#define TCR_T1SZ	((64 - 48) << 16)
#define TCR_IRGN0	(1 << 8)
#define TCR_ORGN0	(1 << 10)
#define TCR_SH0		(3 << 12)
#define TCR_TG0_4K	(0 << 14)
#define TCR_IRGN1	(1 << 24)
#define TCR_ORGN1	(1 << 26)
#define TCR_SH1		(3 << 28)
#define TCR_TG1_4K	(2 << 30)
#define TCR_IPS_SHIFT	32
#define TCR_VALUE	(TCR_T0SZ | TCR_IRGN0 | TCR_ORGN0 | TCR_SH0 | TCR_TG0_4K | \
			 TCR_T1SZ | TCR_IRGN1 | TCR_ORGN1 | TCR_SH1 | TCR_TG1_4K)

/* SCTLR_EL1: M, C, SA, I and the ARMv8.0 RES1 bits; little-endian, no WXN, no alignment checks */
#define SCTLR_EL1_RES1	((1 << 29) | (1 << 28) | (1 << 23) | (1 << 22) | (1 << 20) | (1 << 11))
#define SCTLR_EL1_MMU_ON (SCTLR_EL1_RES1 | (1 << 12) | (1 << 3) | (1 << 2) | (1 << 0))

#define FDT_MAGIC_LE	0xedfe0dd0	/* 0xd00dfeed, big-endian, read little-endian */

	.section .head.text, "ax"
	/* Runs at its physical address: not an STT_FUNC (as Linux's SYM_CODE). */
	.globl primary_entry
primary_entry:
	mov	x21, x0				/* DTB (Linux boot protocol) or 0 */
	mrs	x9, CurrentEL
	cmp	x9, #(2 << 2)
	b.ne	1f
	/* EL2 (QEMU virt,virtualization=on): run the kernel at EL1. */
	mov	x9, #(1 << 31)			/* HCR_EL2.RW: EL1 is AArch64 */
	msr	hcr_el2, x9
	mov	x9, #3				/* CNTHCTL_EL2.EL1PCTEN | EL1PCEN */
	msr	cnthctl_el2, x9
	msr	cntvoff_el2, xzr
	mrs	x9, id_aa64pfr0_el1		/* a GICv3 CPU interface: let EL1 use it */
	ubfx	x9, x9, #24, #4
	cbz	x9, 2f
	mov	x9, #0x9			/* ICC_SRE_EL2.SRE | Enable */
	msr	icc_sre_el2, x9
	isb
2:
	ldr	x9, =SCTLR_EL1_RES1
	msr	sctlr_el1, x9
	mov	x9, #0x3c5			/* SPSR: EL1h, D, A, I, F masked */
	msr	spsr_el2, x9
	adr	x9, 1f
	msr	elr_el2, x9
	eret
1:	msr	daifset, #0xf

	/* The DTB: x0 if it holds the FDT magic, else the start of RAM, else none. */
	mov	x9, x21
	bl	fdt_probe
	cbnz	x9, 3f
	ldr	x9, =RAM_BASE
	bl	fdt_probe
3:	mov	x21, x9

	ldr	x9, =MAIR_VALUE
	msr	mair_el1, x9
	ldr	x9, =TCR_VALUE
	mrs	x10, id_aa64mmfr0_el1		/* IPS = the CPU's PARange (at most 48 bits) */
	and	x10, x10, #0xf
	cmp	x10, #5
	mov	x11, #5
	csel	x10, x11, x10, hi
	orr	x9, x9, x10, lsl #TCR_IPS_SHIFT
	msr	tcr_el1, x9
	adrp	x9, idmap_pg_dir		/* adrp is PC-relative: physical addresses here */
	msr	ttbr0_el1, x9
	adrp	x9, swapper_pg_dir
	msr	ttbr1_el1, x9
	isb
	tlbi	vmalle1
	dsb	nsh
	isb
	ldr	x9, =SCTLR_EL1_MMU_ON
	msr	sctlr_el1, x9
	isb
	ic	iallu
	dsb	nsh
	isb

	/* Still at the identity-mapped physical address: go to the kernel map. */
	ldr	x9, =__primary_switched
	br	x9
__primary_switched:
	ldr	x9, =init_stack_top
	mov	sp, x9
	adrp	x9, __fdt_pointer
	str	x21, [x9, :lo12:__fdt_pointer]
	b	ksim_entry64

/* x9 = x9 if it is 8-aligned, in idmap's RAM and starts with the FDT magic, else 0 (uses x10, x11) */
fdt_probe:
	ldr	x10, =RAM_BASE
	cmp	x9, x10
	b.lo	1f
	ldr	x10, =(RAM_BASE + 0x40000000 - 0x40)
	cmp	x9, x10
	b.hs	1f
	tst	x9, #7
	b.ne	1f
	ldr	w10, [x9]
	ldr	w11, =FDT_MAGIC_LE
	cmp	w10, w11
	b.ne	1f
	ret
1:	mov	x9, #0
	ret
	.ltorg

/*
 * The boot page tables, complete in the ELF file.
 *   idmap_pg_dir (TTBR0, level 1): [0] 0..1 GiB Device, [1] 1..2 GiB Normal.
 *   swapper_pg_dir (TTBR1, level 0) -> swapper_pud (level 1) -> swapper_pmd
 *   (level 2): 16 2-MiB blocks, KIMAGE_VADDR.. -> KIMAGE_PADDR.. (32 MiB).
 */
	.section .data..page_aligned, "aw"
	.balign 4096
	.globl idmap_pg_dir, swapper_pg_dir
idmap_pg_dir:
	.quad	0x00000000 + SECT_DEVICE
	.quad	0x40000000 + SECT_NORMAL
	.fill	510, 8, 0
swapper_pg_dir:
	.fill	256, 8, 0
	.quad	pa(swapper_pud) + PMD_TYPE_TABLE	/* VA bits 47:39 of KIMAGE_VADDR = 256 */
	.fill	255, 8, 0
swapper_pud:
	.quad	pa(swapper_pmd) + PMD_TYPE_TABLE	/* bits 38:30 = 0 */
	.fill	511, 8, 0
swapper_pmd:
	.fill	(KIMAGE_VADDR >> 21) & 0x1ff, 8, 0	/* bits 29:21 = 64 */
	.set	.Lpa, KIMAGE_PADDR
	.rept	KERNEL_MAP_SIZE >> 21
	.quad	.Lpa + SECT_NORMAL
	.set	.Lpa, .Lpa + 0x200000
	.endr
	.fill	512 - ((KIMAGE_VADDR >> 21) & 0x1ff) - (KERNEL_MAP_SIZE >> 21), 8, 0

	.section .note.GNU-stack, "", @progbits
