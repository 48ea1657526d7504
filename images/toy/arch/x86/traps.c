/* arch/x86/kernel/{traps,idt,i8259,i8253}.c: the IDT, the PIC, the PIT, halting. */
#include <toy.h>

struct gate_desc {
	u16 offset_low;
	u16 segment;
	u8 ist;
	u8 type_attr;
	u16 offset_middle;
	u32 offset_high;
	u32 reserved;
} __attribute__((packed));

struct desc_ptr {
	u16 size;
	u64 address;
} __attribute__((packed));

#define __KERNEL_CS		0x08
#define GATE_INTERRUPT		0x8e	/* present, DPL 0, 64-bit interrupt gate */
#define NR_EXCEPTION_STUBS	22

static struct gate_desc idt_table[256] __aligned(16);
/*
 * In .data (not .bss) so that the table is in the ELF file: a loader can fill
 * it in the image itself before booting, under QEMU as under unicorn.
 */
struct ksim_trap ksim_trap_table[KSIM_TRAP_SLOTS] __section(".data");
u64 ksim_trap_count __section(".data");

extern const u64 exception_stub_table[NR_EXCEPTION_STUBS];
void ksim_int3_entry(void);
void timer_interrupt(void);
void spurious_interrupt(void);

static noinline void set_intr_gate(unsigned int n, u64 addr)
{
	struct gate_desc *g = &idt_table[n];

	g->offset_low = (u16)addr;
	g->segment = __KERNEL_CS;
	g->ist = 0;
	g->type_attr = GATE_INTERRUPT;
	g->offset_middle = (u16)(addr >> 16);
	g->offset_high = (u32)(addr >> 32);
	g->reserved = 0;
}

static noinline void load_idt(const struct desc_ptr *dtr)
{
	__asm__ __volatile__("lidt %0" : : "m"(*dtr));
}

noinline void trap_init(void)
{
	static struct desc_ptr idt_descr;

	for (unsigned int i = 0; i < NR_EXCEPTION_STUBS; i++)
		set_intr_gate(i, exception_stub_table[i]);
	set_intr_gate(3, (u64)ksim_int3_entry);
	set_intr_gate(IRQ0_VECTOR, (u64)timer_interrupt);
	for (unsigned int i = IRQ0_VECTOR + 1; i < IRQ0_VECTOR + 16; i++)
		set_intr_gate(i, (u64)spurious_interrupt);
	idt_descr.size = sizeof(idt_table) - 1;
	idt_descr.address = (u64)idt_table;
	load_idt(&idt_descr);
}

/* 8259A: remap IRQ 0-15 to vectors 0x20-0x2f, unmask only IRQ0 (the PIT). */
static noinline void init_8259A(void)
{
	outb(0xff, 0x21);
	outb(0xff, 0xa1);
	outb(0x11, 0x20);		/* ICW1: edge, cascade, ICW4 */
	outb(IRQ0_VECTOR, 0x21);	/* ICW2: master base */
	outb(0x04, 0x21);		/* ICW3: slave on IRQ2 */
	outb(0x01, 0x21);		/* ICW4: 8086 mode */
	outb(0x11, 0xa0);
	outb(IRQ0_VECTOR + 8, 0xa1);
	outb(0x02, 0xa1);
	outb(0x01, 0xa1);
	outb(0xfe, 0x21);		/* mask all but IRQ0 */
	outb(0xff, 0xa1);
}

/* 8253/8254 channel 0, mode 2 (rate generator), 1193182 / 1193 ~ 1000 Hz. */
noinline void pit_init(void)
{
	init_8259A();
	outb(0x34, 0x43);
	outb(1193 & 0xff, 0x40);
	outb(1193 >> 8, 0x40);
}

noinline void local_irq_enable(void)
{
	__asm__ __volatile__("sti" ::: "memory");
}

noinline void local_irq_disable(void)
{
	__asm__ __volatile__("cli" ::: "memory");
}

static noinline void __noreturn debug_exit(u32 code)
{
	outl(code, DEBUG_EXIT_PORT);
	for (;;)
		__asm__ __volatile__("cli; hlt");
}

/* The end of every run: unicorn stops when it reaches this address; under
 * QEMU isa-debug-exit makes the emulator exit with status 33. */
noinline void __noreturn ksim_halt(void)
{
	debug_exit(DEBUG_EXIT_SUCCESS);
}

noinline void __noreturn ksim_fail(const char *why)
{
	printk("toy: panic: %s\n", why);
	debug_exit(DEBUG_EXIT_FAILURE);
}

void __noreturn ksim_unknown_trap(u64 site);
noinline void __noreturn ksim_unknown_trap(u64 site)
{
	printk("toy: panic: int3 at %p is not in ksim_trap_table (%lu entries)\n",
	       (void *)site, ksim_trap_count);
	debug_exit(DEBUG_EXIT_FAILURE);
}

void __noreturn do_exception(u64 vector, const u64 *frame);
noinline void __noreturn do_exception(u64 vector, const u64 *frame)
{
	/* frame: error code, RIP, CS, RFLAGS, RSP, SS */
	printk("toy: panic: exception %lu error %lx at rip %p rsp %p\n",
	       vector, frame[0], (void *)frame[1], (void *)frame[4]);
	debug_exit(DEBUG_EXIT_FAILURE);
}
