/*
 * Native per-hit harness: the toy kernel's C code run as a normal process (the way
 * User-Mode Linux runs a kernel), spliced by ksim's own planner and codegen.
 *
 * The toy kernel's sources are compiled with the kernel's flags except
 * -mcmodel=kernel (position-dependent, linked -no-pie), their symbols prefixed
 * "toy_" so that they cannot clash with libc.  ksim (Python) plans each splice
 * against this executable's text and sends the plan on stdin:
 *
 *   variant NAME CALLS REPEATS      start a variant (per-call cycles over CALLS calls,
 *                                   REPEATS times; the minimum and median are reported)
 *   area ADDR SIZE                  mmap ADDR..ADDR+SIZE read-write-execute at exactly ADDR
 *   code ADDR HEX                   copy bytes (patch code, counters) into an area
 *   write ADDR HEX                  write bytes into this process's own text (mprotect'ed
 *                                   writable around the write); undone after the variant
 *   trap SITE PATCH                 int3 at SITE goes to PATCH (SIGTRAP handler sets RIP)
 *   counter ADDR                    a u64 the snippet increments: reported after the run
 *   run                             measure, report one JSON line on stdout, undo everything
 *
 * Cycles are TSC ticks (rdtsc fenced with lfence; rdtscp at the end), which run at the
 * processor's reference rate.  The trap path is a user-space trap: int3 -> kernel ->
 * SIGTRAP handler -> sigreturn, i.e. two kernel entries per hit, heavier than a
 * kernel's in-kernel int3 handler.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

typedef unsigned long long u64;

u64 toy_ksim_bench_target(u64 x);

#define MAX_TRAPS 16
#define MAX_WRITES 16
#define MAX_AREAS 8

static struct { u64 site, patch; } traps[MAX_TRAPS];
static int ntraps;
static struct { u64 addr; size_t len; unsigned char old[64]; } writes[MAX_WRITES];
static int nwrites;
static struct { u64 addr; size_t size; } areas[MAX_AREAS];
static int nareas;
static u64 counter_addr;
static volatile u64 sink;

static inline u64 tsc_begin(void)
{
	unsigned lo, hi;
	__asm__ __volatile__("lfence; rdtsc; lfence" : "=a"(lo), "=d"(hi) :: "memory");
	return ((u64)hi << 32) | lo;
}

static inline u64 tsc_end(void)
{
	unsigned lo, hi, aux;
	__asm__ __volatile__("rdtscp; lfence" : "=a"(lo), "=d"(hi), "=c"(aux) :: "memory");
	return ((u64)hi << 32) | lo;
}

static void on_trap(int sig, siginfo_t *info, void *uctx)
{
	ucontext_t *uc = uctx;
	u64 site = (u64)uc->uc_mcontext.gregs[REG_RIP] - 1;	/* int3 is a trap: RIP is past it */

	(void)sig; (void)info;
	for (int i = 0; i < ntraps; i++) {
		if (traps[i].site == site) {
			uc->uc_mcontext.gregs[REG_RIP] = (long long)traps[i].patch;
			return;
		}
	}
	fprintf(stderr, "harness: int3 at %#llx is not a ksim trap site\n", site);
	_exit(3);
}

static size_t unhex(const char *hex, unsigned char *out, size_t max)
{
	size_t n = 0;
	while (hex[0] && hex[1] && hex[0] != '\n' && n < max) {
		unsigned v;
		sscanf(hex, "%2x", &v);
		out[n++] = (unsigned char)v;
		hex += 2;
	}
	return n;
}

static void text_write(u64 addr, const unsigned char *bytes, size_t len)
{
	long page = sysconf(_SC_PAGESIZE);
	u64 lo = addr & ~(u64)(page - 1), hi = (addr + len + page - 1) & ~(u64)(page - 1);

	if (mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE | PROT_EXEC)) {
		perror("harness: mprotect text");
		exit(2);
	}
	memcpy((void *)addr, bytes, len);
	__builtin___clear_cache((char *)addr, (char *)addr + len);
	mprotect((void *)lo, hi - lo, PROT_READ | PROT_EXEC);
}

static int cmp_u64(const void *a, const void *b)
{
	u64 x = *(const u64 *)a, y = *(const u64 *)b;
	return x < y ? -1 : x > y;
}

static void run_variant(const char *name, u64 calls, int repeats)
{
	u64 *samples = calloc(repeats, sizeof(u64));
	u64 acc = 1, t0, t1, empty = ~0ULL;

	/* the cost of the timing itself, subtracted from nothing but reported */
	for (int r = 0; r < 32; r++) {
		t0 = tsc_begin();
		t1 = tsc_end();
		if (t1 - t0 < empty)
			empty = t1 - t0;
	}
	for (u64 i = 0; i < calls / 10 + 1; i++)	/* warm caches and predictors */
		acc = toy_ksim_bench_target(acc);
	for (int r = 0; r < repeats; r++) {
		t0 = tsc_begin();
		for (u64 i = 0; i < calls; i++)
			acc = toy_ksim_bench_target(acc);
		t1 = tsc_end();
		samples[r] = t1 - t0;
	}
	sink = acc;
	qsort(samples, repeats, sizeof(u64), cmp_u64);
	printf("{\"variant\": \"%s\", \"calls\": %llu, \"repeats\": %d, "
	       "\"min_cycles_per_call\": %.3f, \"median_cycles_per_call\": %.3f, "
	       "\"max_cycles_per_call\": %.3f, \"timer_overhead\": %llu, \"counter\": %llu, "
	       "\"result\": %llu}\n",
	       name, calls, repeats, (double)samples[0] / calls,
	       (double)samples[repeats / 2] / calls, (double)samples[repeats - 1] / calls,
	       empty, counter_addr ? *(volatile u64 *)counter_addr : 0ULL, acc);
	fflush(stdout);
	free(samples);
}

static void undo(void)
{
	for (int i = nwrites - 1; i >= 0; i--)
		text_write(writes[i].addr, writes[i].old, writes[i].len);
	for (int i = 0; i < nareas; i++)
		munmap((void *)areas[i].addr, areas[i].size);
	nwrites = nareas = ntraps = 0;
	counter_addr = 0;
}

int main(void)
{
	static char line[1 << 16];
	static unsigned char buf[1 << 15];
	char name[64] = "";
	u64 calls = 0;
	int repeats = 0, failed = 0;
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_trap;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGTRAP, &sa, NULL);

	if (getenv("HARNESS_INFO")) {
		printf("{\"target\": %llu}\n", (u64)(uintptr_t)&toy_ksim_bench_target);
		return 0;
	}
	while (fgets(line, sizeof(line), stdin)) {
		u64 a, b;
		char hex[sizeof(line)];

		if (sscanf(line, "variant %63s %llu %d", name, &calls, &repeats) == 3) {
			failed = 0;
		} else if (failed) {
			if (strncmp(line, "run", 3) == 0)
				undo();
		} else if (sscanf(line, "area %llx %llx", &a, &b) == 2) {
			void *p = mmap((void *)a, b, PROT_READ | PROT_WRITE | PROT_EXEC,
				       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
			if (p != (void *)a) {
				printf("{\"variant\": \"%s\", \"error\": \"mmap at %#llx failed\"}\n", name, a);
				fflush(stdout);
				if (p != MAP_FAILED)
					munmap(p, b);
				failed = 1;
				continue;
			}
			areas[nareas].addr = a;
			areas[nareas++].size = b;
		} else if (sscanf(line, "code %llx %s", &a, hex) == 2) {
			size_t n = unhex(hex, buf, sizeof(buf));
			memcpy((void *)a, buf, n);
		} else if (sscanf(line, "write %llx %s", &a, hex) == 2) {
			size_t n = unhex(hex, buf, 64);
			writes[nwrites].addr = a;
			writes[nwrites].len = n;
			memcpy(writes[nwrites++].old, (void *)a, n);
			text_write(a, buf, n);
		} else if (sscanf(line, "trap %llx %llx", &a, &b) == 2) {
			traps[ntraps].site = a;
			traps[ntraps++].patch = b;
		} else if (sscanf(line, "counter %llx", &a) == 1) {
			counter_addr = a;
		} else if (strncmp(line, "run", 3) == 0) {
			run_variant(name, calls, repeats);
			undo();
		}
	}
	return 0;
}
