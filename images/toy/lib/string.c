/* lib/string.c: the byte-string routines every other subsystem uses. */
#include <toy.h>

noinline void *memcpy(void *dst, const void *src, size_t n)
{
	u8 *d = dst;
	const u8 *s = src;

	/* Word copies for the bulk: the kernel copies packet and page data. */
	while (n >= 8) {
		*(u64 *)d = *(const u64 *)s;
		d += 8;
		s += 8;
		n -= 8;
	}
	while (n--)
		*d++ = *s++;
	return dst;
}

noinline void *memset(void *dst, int c, size_t n)
{
	u8 *d = dst;
	u64 w = 0x0101010101010101ULL * (u8)c;

	while (n >= 8) {
		*(u64 *)d = w;
		d += 8;
		n -= 8;
	}
	while (n--)
		*d++ = (u8)c;
	return dst;
}

noinline void *memmove(void *dst, const void *src, size_t n)
{
	u8 *d = dst;
	const u8 *s = src;

	if (d <= s || d >= s + n)
		return memcpy(dst, src, n);	/* tail call */
	d += n;
	s += n;
	while (n--)
		*--d = *--s;
	return dst;
}

noinline int memcmp(const void *a, const void *b, size_t n)
{
	const u8 *x = a, *y = b;

	for (; n; n--, x++, y++)
		if (*x != *y)
			return *x - *y;
	return 0;
}

noinline size_t strlen(const char *s)
{
	const char *p = s;

	while (*p)
		p++;
	return p - s;
}

noinline size_t strnlen(const char *s, size_t max)
{
	size_t n = 0;

	while (n < max && s[n])
		n++;
	return n;
}

noinline int strcmp(const char *a, const char *b)
{
	while (*a && *a == *b) {
		a++;
		b++;
	}
	return (u8)*a - (u8)*b;
}

noinline int strncmp(const char *a, const char *b, size_t n)
{
	for (; n; n--, a++, b++) {
		if (*a != *b)
			return (u8)*a - (u8)*b;
		if (!*a)
			break;
	}
	return 0;
}

noinline char *strcpy(char *dst, const char *src)
{
	char *d = dst;

	while ((*d++ = *src++))
		;
	return dst;
}

noinline size_t strlcpy(char *dst, const char *src, size_t size)
{
	size_t len = strlen(src);

	if (size) {
		size_t n = len >= size ? size - 1 : len;
		memcpy(dst, src, n);
		dst[n] = 0;
	}
	return len;
}

noinline char *strchr(const char *s, int c)
{
	for (; *s != (char)c; s++)
		if (!*s)
			return NULL;
	return (char *)s;
}
