/* lib/vsprintf.c: formatted output (a subset of the kernel's vsnprintf) and printk. */
#include <toy.h>

struct printf_buf {
	char *buf;
	size_t size;
	size_t pos;
};

static noinline void pb_putc(struct printf_buf *pb, char c)
{
	if (pb->pos + 1 < pb->size)
		pb->buf[pb->pos] = c;
	pb->pos++;
}

static noinline void pb_number(struct printf_buf *pb, u64 num, unsigned int base,
			       int width, bool zero, bool upper, bool neg)
{
	const char *digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
	char tmp[24];
	int i = 0;

	do {
		tmp[i++] = digits[num % base];
		num /= base;
	} while (num);
	if (neg)
		width--;
	if (neg && zero)
		pb_putc(pb, '-');
	for (; width > i; width--)
		pb_putc(pb, zero ? '0' : ' ');
	if (neg && !zero)
		pb_putc(pb, '-');
	while (i)
		pb_putc(pb, tmp[--i]);
}

static noinline void pb_string(struct printf_buf *pb, const char *s, int width)
{
	size_t n;

	if (!s)
		s = "(null)";
	n = strlen(s);
	for (; width > (int)n; width--)
		pb_putc(pb, ' ');
	while (*s)
		pb_putc(pb, *s++);
}

/* The conversion switch is dense over 'X'..'x' and compiles to a jump table. */
noinline int vsnprintf(char *buf, size_t size, const char *fmt, __builtin_va_list ap)
{
	struct printf_buf pb = { buf, size, 0 };

	for (; *fmt; fmt++) {
		int width = 0, longs = 0;
		bool zero = false;
		u64 v;

		if (*fmt != '%') {
			pb_putc(&pb, *fmt);
			continue;
		}
		fmt++;
		if (*fmt == '0') {
			zero = true;
			fmt++;
		}
		while (*fmt >= '0' && *fmt <= '9')
			width = width * 10 + (*fmt++ - '0');
		while (*fmt == 'l') {
			longs++;
			fmt++;
		}
		switch (*fmt) {
		case 'd':
		case 'i': {
			s64 s = longs ? __builtin_va_arg(ap, s64) : __builtin_va_arg(ap, int);
			pb_number(&pb, s < 0 ? -(u64)s : (u64)s, 10, width, zero, false, s < 0);
			break;
		}
		case 'u':
			v = longs ? __builtin_va_arg(ap, u64) : __builtin_va_arg(ap, unsigned int);
			pb_number(&pb, v, 10, width, zero, false, false);
			break;
		case 'x':
		case 'X':
			v = longs ? __builtin_va_arg(ap, u64) : __builtin_va_arg(ap, unsigned int);
			pb_number(&pb, v, 16, width, zero, *fmt == 'X', false);
			break;
		case 'o':
			v = longs ? __builtin_va_arg(ap, u64) : __builtin_va_arg(ap, unsigned int);
			pb_number(&pb, v, 8, width, zero, false, false);
			break;
		case 'p':
			pb_putc(&pb, '0');
			pb_putc(&pb, 'x');
			pb_number(&pb, (u64)__builtin_va_arg(ap, void *), 16, 16, true, false, false);
			break;
		case 's':
			pb_string(&pb, __builtin_va_arg(ap, const char *), width);
			break;
		case 'c':
			pb_putc(&pb, (char)__builtin_va_arg(ap, int));
			break;
		case '%':
			pb_putc(&pb, '%');
			break;
		case 0:
			fmt--;
			break;
		default:
			pb_putc(&pb, '%');
			pb_putc(&pb, *fmt);
			break;
		}
	}
	if (pb.size)
		pb.buf[pb.pos < pb.size ? pb.pos : pb.size - 1] = 0;
	return (int)pb.pos;
}

noinline int snprintf(char *buf, size_t size, const char *fmt, ...)
{
	__builtin_va_list ap;
	int n;

	__builtin_va_start(ap, fmt);
	n = vsnprintf(buf, size, fmt, ap);
	__builtin_va_end(ap);
	return n;
}

noinline int printk(const char *fmt, ...)
{
	static char printk_buf[256];
	__builtin_va_list ap;
	int n;

	__builtin_va_start(ap, fmt);
	n = vsnprintf(printk_buf, sizeof(printk_buf), fmt, ap);
	__builtin_va_end(ap);
	serial_write(printk_buf, strnlen(printk_buf, sizeof(printk_buf)));
	return n;
}

noinline u64 simple_strtoull(const char *s, const char **end, unsigned int base)
{
	u64 v = 0;

	if (!base) {
		base = 10;
		if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
			base = 16;
			s += 2;
		}
	}
	for (;; s++) {
		unsigned int d;
		if (*s >= '0' && *s <= '9')
			d = *s - '0';
		else if (*s >= 'a' && *s <= 'f')
			d = *s - 'a' + 10;
		else if (*s >= 'A' && *s <= 'F')
			d = *s - 'A' + 10;
		else
			break;
		if (d >= base)
			break;
		v = v * base + d;
	}
	if (end)
		*end = s;
	return v;
}
