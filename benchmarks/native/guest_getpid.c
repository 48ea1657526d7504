/*
 * Guest program for the live per-hit benchmark: rdtsc around N getpid system
 * calls, REPEATS times; prints the minimum and median cycles per call as JSON.
 * Built statically on the host and run inside the testbed guest (which sees the
 * host's root filesystem), so it needs no libc of the guest's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline unsigned long long tsc(void)
{
	unsigned lo, hi, aux;
	__asm__ __volatile__("rdtscp; lfence" : "=a"(lo), "=d"(hi), "=c"(aux) :: "memory");
	return ((unsigned long long)hi << 32) | lo;
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

	for (int r = 0; r < repeats; r++) {
		unsigned long long t0 = tsc();
		for (long i = 0; i < calls; i++)
			syscall(SYS_getpid);
		per[r] = (double)(tsc() - t0) / calls;
	}
	qsort(per, repeats, sizeof(double), cmp);
	printf("{\"calls\": %ld, \"repeats\": %d, \"min_cycles_per_call\": %.2f, "
	       "\"median_cycles_per_call\": %.2f}\n", calls, repeats, per[0], per[repeats / 2]);
	return 0;
}
