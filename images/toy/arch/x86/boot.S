/*
 * arch/x86/boot.S: the PVH entry.  QEMU (-kernel toy.elf) finds the
 * XEN_ELFNOTE_PHYS32_ENTRY note, loads the PT_LOAD segments at their physical
 * addresses and enters pvh_start32 in 32-bit protected mode, paging off, with
 * %ebx = physical address of struct hvm_start_info (xen/include/public/
 * arch-x86/hvm/start_info.h).  We build page tables mapping the first 1 GiB
 * both at 0 (identity) and at __START_KERNEL_map (where the kernel is linked),
 * enter long mode and jump to ksim_entry64.  Unicorn skips all of this and
 * starts at ksim_entry64 directly.
 */
#include <toy.h>

#define pa(x)		((x) - __START_KERNEL_map)
#define X86_CR0_PE	0x00000001
#define X86_CR0_PG	0x80000000
#define X86_CR4_PAE	0x00000020
#define MSR_EFER	0xc0000080
#define EFER_LME	0x00000100
#define __KERNEL_CS	0x08
#define __KERNEL_DS	0x10

	.section .head.text, "ax"
	.code32
	/* 32-bit code: deliberately not typed @function (as Linux's SYM_CODE), so that
	 * tools listing STT_FUNC symbols never decode it as 64-bit code. */
	.globl pvh_start32
pvh_start32:
	cli
	cld
	movl	%ebx, pa(pvh_start_info_pa)
	movl	$pa(boot_stack_top), %esp

	lgdt	pa(boot_gdt_desc)
	movl	$__KERNEL_DS, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss

	/* 512 2-MiB pages: physical 0..1 GiB */
	movl	$pa(boot_pd), %edi
	xorl	%ecx, %ecx
1:	movl	%ecx, %eax
	shll	$21, %eax
	orl	$0x83, %eax			/* present | writable | 2 MiB page */
	movl	%eax, (%edi,%ecx,8)
	movl	$0, 4(%edi,%ecx,8)
	incl	%ecx
	cmpl	$512, %ecx
	jne	1b

	/* PML4[0] -> PDPT_low[0] -> PD ; PML4[511] -> PDPT_high[510] -> PD */
	movl	$pa(boot_pd) + 0x3, %eax
	movl	%eax, pa(boot_pdpt_low)
	movl	%eax, pa(boot_pdpt_high) + 510 * 8
	movl	$pa(boot_pdpt_low) + 0x3, %eax
	movl	%eax, pa(boot_pml4)
	movl	$pa(boot_pdpt_high) + 0x3, %eax
	movl	%eax, pa(boot_pml4) + 511 * 8

	movl	%cr4, %eax
	orl	$X86_CR4_PAE, %eax
	movl	%eax, %cr4
	movl	$pa(boot_pml4), %eax
	movl	%eax, %cr3
	movl	$MSR_EFER, %ecx
	rdmsr
	orl	$EFER_LME, %eax
	wrmsr
	movl	%cr0, %eax
	orl	$(X86_CR0_PG | X86_CR0_PE), %eax
	movl	%eax, %cr0
	ljmp	$__KERNEL_CS, $pa(pvh_start64)

	.code64
pvh_start64:
	/* Still running at the identity-mapped address: go to the kernel map. */
	movabsq	$1f, %rax
	jmp	*%rax
1:	xorl	%eax, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %fs
	movl	%eax, %gs
	movl	%eax, %ss
	movabsq	$init_stack_top, %rsp
	movabsq	$ksim_entry64, %rax
	jmp	*%rax

	.section .data..page_aligned, "aw"
	.balign 4096
boot_pml4:	.fill 512, 8, 0
boot_pdpt_low:	.fill 512, 8, 0
boot_pdpt_high:	.fill 512, 8, 0
boot_pd:	.fill 512, 8, 0

	.section .data, "aw"
	.balign 16
boot_gdt:
	.quad	0x0000000000000000		/* null */
	.quad	0x00af9a000000ffff		/* 0x08: 64-bit code, DPL 0 */
	.quad	0x00cf92000000ffff		/* 0x10: flat data */
boot_gdt_end:
boot_gdt_desc:
	.word	boot_gdt_end - boot_gdt - 1
	.long	pa(boot_gdt)

	.globl pvh_start_info_pa
pvh_start_info_pa:
	.long	0

	.balign 16
boot_stack:
	.fill 256, 1, 0
boot_stack_top:

	/* XEN_ELFNOTE_PHYS32_ENTRY (18): the physical 32-bit entry, for QEMU's PVH loader */
	.section .note.Xen, "a", @note
	.balign 4
	.long	2f - 1f
	.long	4f - 3f
	.long	18
1:	.asciz	"Xen"
2:	.balign 4
3:	.long	pa(pvh_start32)
4:	.balign 4

	.section .note.GNU-stack, "", @progbits
