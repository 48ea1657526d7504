/* lib/bitmap.c: bitmaps of u64 words (used for the fd table and inode numbers). */
#include <toy.h>

noinline void bitmap_set(u64 *map, unsigned int start, unsigned int len)
{
	for (unsigned int i = start; i < start + len; i++)
		map[i / 64] |= 1ULL << (i % 64);
}

noinline void bitmap_clear(u64 *map, unsigned int start, unsigned int len)
{
	for (unsigned int i = start; i < start + len; i++)
		map[i / 64] &= ~(1ULL << (i % 64));
}

noinline unsigned int find_first_zero_bit(const u64 *map, unsigned int size)
{
	for (unsigned int i = 0; i < size; i++)
		if (!(map[i / 64] & (1ULL << (i % 64))))
			return i;
	return size;
}

noinline unsigned int find_next_bit(const u64 *map, unsigned int size, unsigned int off)
{
	for (unsigned int i = off; i < size; i++)
		if (map[i / 64] & (1ULL << (i % 64)))
			return i;
	return size;
}

noinline unsigned int bitmap_weight(const u64 *map, unsigned int nbits)
{
	unsigned int w = 0;

	for (unsigned int i = 0; i < nbits / 64; i++)
		w += __sw_hweight64(map[i]);
	if (nbits % 64)
		w += __sw_hweight64(map[nbits / 64] & ((1ULL << (nbits % 64)) - 1));
	return w;
}
