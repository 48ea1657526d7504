/* drivers/tty/serial_8250.c: polled COM1 (16550 UART) output. */
#include <toy.h>

#define COM1		0x3f8
#define UART_THR	0
#define UART_IER	1
#define UART_FCR	2
#define UART_LCR	3
#define UART_MCR	4
#define UART_LSR	5
#define UART_LSR_THRE	0x20

noinline void serial_init(void)
{
	outb(0x00, COM1 + UART_IER);	/* no UART interrupts: output is polled */
	outb(0x80, COM1 + UART_LCR);	/* DLAB */
	outb(0x01, COM1 + 0);		/* 115200 baud */
	outb(0x00, COM1 + 1);
	outb(0x03, COM1 + UART_LCR);	/* 8n1 */
	outb(0xc7, COM1 + UART_FCR);
	outb(0x03, COM1 + UART_MCR);
}

noinline void serial_putc(char c)
{
	while (!(inb(COM1 + UART_LSR) & UART_LSR_THRE))
		;
	outb((u8)c, COM1 + UART_THR);
}

noinline void serial_write(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (s[i] == '\n')
			serial_putc('\r');
		serial_putc(s[i]);
	}
}
