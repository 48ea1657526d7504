/* lib/crc32.c: checksums (CRC-32, CRC-16, the Internet checksum) and hashing. */
#include <toy.h>

static u32 crc32_table[256];

noinline void crc32_init(void)
{
	for (u32 i = 0; i < 256; i++) {
		u32 c = i;
		for (int k = 0; k < 8; k++)
			c = (c & 1) ? 0xedb88320 ^ (c >> 1) : c >> 1;
		crc32_table[i] = c;
	}
}

noinline u32 crc32_le(u32 crc, const void *p, size_t len)
{
	const u8 *b = p;

	while (len--)
		crc = crc32_table[(crc ^ *b++) & 0xff] ^ (crc >> 8);
	return crc;
}

noinline u16 crc16(u16 crc, const u8 *p, size_t len)
{
	while (len--) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = (crc & 1) ? (crc >> 1) ^ 0xa001 : crc >> 1;
	}
	return crc;
}

/* The Internet checksum (RFC 1071) in native byte order, 32 bits at a time. */
noinline u32 csum_partial(const void *buf, size_t len, u32 sum)
{
	const u8 *b = buf;
	u64 s = sum;

	while (len >= 4) {
		s += *(const u32 *)b;
		b += 4;
		len -= 4;
	}
	if (len >= 2) {
		s += *(const u16 *)b;
		b += 2;
		len -= 2;
	}
	if (len)
		s += *b;
	while (s >> 32)
		s = (s & 0xffffffff) + (s >> 32);
	return (u32)s;
}

noinline u16 csum_fold(u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (u16)~sum;
}

noinline u16 ip_fast_csum(const void *iph, unsigned int ihl)
{
	return csum_fold(csum_partial(iph, ihl * 4, 0));	/* tail call */
}

noinline u64 hash_64(u64 val, unsigned int bits)
{
	return (val * 0x61c8864680b583ebULL) >> (64 - bits);
}

/* FNV-1a style 64-bit mixing of one word into a running checksum. */
noinline u64 ksim_mix64(u64 h, u64 v)
{
	for (int i = 0; i < 8; i++) {
		h ^= (v >> (8 * i)) & 0xff;
		h *= 0x100000001b3ULL;
	}
	return h;
}
