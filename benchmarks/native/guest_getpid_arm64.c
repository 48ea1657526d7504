/*
 * Guest program for the live per-hit benchmark on the arm64 testbed: the virtual
 * counter (CNTVCT_EL0, read after an ISB) around N getpid system calls, REPEATS
 * times; prints the minimum and median counter ticks per call as JSON, and the
 * counter's frequency (CNTFRQ_EL0).  Cross-built statically on the host
 * (aarch64-linux-gnu-gcc) into the cache the guest mounts over 9p.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline unsigned long long ticks(void)
{
	unsigned long long v;
	__asm__ __volatile__("isb; mrs %0, cntvct_el0" : "=r"(v) :: "memory");
	return v;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	long calls = argc > 1 ? atol(argv[1]) : 100000;
	int repeats = argc > 2 ? atoi(argv[2]) : 5;
	double *per = calloc(repeats, sizeof(double));
	unsigned long long hz;

	__asm__ __volatile__("mrs %0, cntfrq_el0" : "=r"(hz));
	for (int r = 0; r < repeats; r++) {
		unsigned long long t0 = ticks();
		for (long i = 0; i < calls; i++)
			syscall(SYS_getpid);
		per[r] = (double)(ticks() - t0) / calls;
	}
	qsort(per, repeats, sizeof(double), cmp);
	printf("{\"calls\": %ld, \"repeats\": %d, \"min_cycles_per_call\": %.2f, "
	       "\"median_cycles_per_call\": %.2f, \"counter_hz\": %llu, "
	       "\"min_ns_per_call\": %.1f}\n", calls, repeats, per[0], per[repeats / 2], hz,
	       per[0] * 1e9 / (double)hz);
	return 0;
}
