/* drivers/tty/amba-pl011.c: polled PL011 UART output (QEMU virt's UART0, arm64). */
#include <toy.h>

#define UART01x_DR		0x00
#define UART01x_FR		0x18
#define UART011_IBRD		0x24
#define UART011_FBRD		0x28
#define UART011_LCRH		0x2c
#define UART011_CR		0x30
#define UART011_IMSC		0x38
#define UART01x_FR_TXFF		0x20
#define UART01x_LCRH_WLEN_8	0x60
#define UART01x_LCRH_FEN	0x10
#define UART01x_CR_UARTEN	0x001
#define UART011_CR_TXE		0x100
#define UART011_CR_RXE		0x200

noinline void serial_init(void)
{
	writel(0, PL011_BASE + UART011_CR);	/* disabled while it is set up */
	writel(0, PL011_BASE + UART011_IMSC);	/* no UART interrupts: output is polled */
	writel(13, PL011_BASE + UART011_IBRD);	/* 115200 baud from a 24 MHz clock */
	writel(1, PL011_BASE + UART011_FBRD);
	writel(UART01x_LCRH_WLEN_8 | UART01x_LCRH_FEN, PL011_BASE + UART011_LCRH);	/* 8n1, FIFOs */
	writel(UART01x_CR_UARTEN | UART011_CR_TXE | UART011_CR_RXE, PL011_BASE + UART011_CR);
}

noinline void serial_putc(char c)
{
	while (readl(PL011_BASE + UART01x_FR) & UART01x_FR_TXFF)
		;
	writel((u8)c, PL011_BASE + UART01x_DR);
}

noinline void serial_write(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (s[i] == '\n')
			serial_putc('\r');
		serial_putc(s[i]);
	}
}
