/* lib/prandom.c: the kernel's pseudo-random generator (xorshift64*), seeded. */
#include <toy.h>

static u64 prandom_state = 0x9e3779b97f4a7c15ULL;

noinline void prandom_seed(u64 seed)
{
	/* splitmix64 so that nearby seeds give unrelated streams; never zero */
	u64 z = seed + 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	z ^= z >> 31;
	prandom_state = z ? z : 1;
}

noinline u64 prandom_u64(void)
{
	u64 x = prandom_state;

	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	prandom_state = x;
	return x * 0x2545f4914f6cdd1dULL;
}

noinline u32 prandom_u32(void)
{
	return (u32)(prandom_u64() >> 32);
}

noinline u32 prandom_u32_max(u32 ep_ro)
{
	return (u32)(((u64)prandom_u32() * ep_ro) >> 32);
}

u64 prandom_peek_state(void);
noinline u64 prandom_peek_state(void)
{
	return prandom_state;
}
