/*
 * init/main.c: start_kernel, the seeded workload and the per-hit benchmark.
 *
 * The workload is deterministic: a PRNG seeded from ksim_workload_seed picks
 * each step's operation and arguments, and nothing depends on time or on
 * interrupts (the timer interrupt only counts irq_ticks, which is left out of
 * the checksum).  Same seed, same function counts and same checksum, on
 * unicorn and on QEMU.
 */
#include <toy.h>
#include <asm-workload.h>
/* The ksim ABI: the loader may overwrite these before the kernel starts. */
volatile u64 ksim_workload_seed = 0x5eed0001;
volatile u64 ksim_workload_iterations = 3000;
volatile u64 ksim_workload_checksum;
volatile u64 ksim_workload_done;
volatile u64 ksim_bench_calls;
volatile u64 ksim_bench_cycles;

#define NR_WORKERS	(NR_TASKS - 1)
#define WORKER_FDS	3
#define WORKER_SLOTS	6
#define WORKER_PAGES	3

struct worker {
	int fds[WORKER_FDS];
	void *slots[WORKER_SLOTS];
	struct page *pages[WORKER_PAGES];
	u8 page_order[WORKER_PAGES];
	u64 steps;
	u64 result;
	char buf[RAMFS_FILE_MAX];
};

enum workload_op {
	OP_SYSCALL_CHEAP, OP_READ, OP_WRITE, OP_OPEN_CLOSE, OP_FSYNC, OP_BIO,
	OP_KMALLOC, OP_PAGES, OP_SEND, OP_NIC_IRQ, OP_TICK, OP_YIELD, OP_MSS,
	OP_FIB, OP_MISC_SYSCALL, OP_TCP_STATE, NR_OPS
};

static struct worker workers[NR_WORKERS];
static u64 workload_iter;
static u64 op_counts[NR_OPS];
static u64 bench_sink;

static noinline long sys(unsigned long nr, u64 a0, u64 a1, u64 a2)
{
	struct pt_regs regs = { .di = a0, .si = a1, .dx = a2, .ax = nr };

	return do_syscall_64(&regs, nr);
}

static noinline int worker_fd(struct worker *w)
{
	unsigned int i = prandom_u32_max(WORKER_FDS);

	if (w->fds[i] < 0) {
		const char *name = ramfs_names[prandom_u32_max(nr_ramfs_names)];
		w->fds[i] = (int)sys(2, (u64)name, 0, 0);	/* open */
	}
	return w->fds[i];
}

static noinline void worker_fill(struct worker *w, size_t n)
{
	u64 x = prandom_u64() | 1;
	u64 *q = (u64 *)w->buf;

	/* A word at a time: the data only has to be seed-dependent, not costly. */
	for (size_t i = 0; i < (n + 7) / 8; i++) {
		q[i] = x;
		x = x * 6364136223846793005ULL + 1442695040888963407ULL;
	}
}

static noinline void op_kmalloc(struct worker *w)
{
	unsigned int i = prandom_u32_max(WORKER_SLOTS);

	if (w->slots[i]) {
		kfree(w->slots[i]);
		w->slots[i] = NULL;
	} else {
		size_t size = 8 + prandom_u32_max(1500);
		w->slots[i] = (prandom_u32() & 3) ? kmalloc(size) : kzalloc(size);
		if (w->slots[i])
			*(u64 *)w->slots[i] = size;
	}
}

static noinline void op_pages(struct worker *w)
{
	unsigned int i = prandom_u32_max(WORKER_PAGES);

	if (w->pages[i]) {
		if (prandom_u32() & 1)
			__free_pages(w->pages[i], w->page_order[i]);
		else
			free_pages((unsigned long)page_address(w->pages[i]), w->page_order[i]);
		w->pages[i] = NULL;
	} else if (prandom_u32_max(8) == 0) {
		unsigned long addr = get_zeroed_page();
		if (addr) {
			w->pages[i] = virt_to_page((void *)addr);
			w->page_order[i] = 0;
		}
	} else {
		w->page_order[i] = (u8)prandom_u32_max(4);
		w->pages[i] = __alloc_pages(w->page_order[i]);
	}
}

static noinline void op_tick(void)
{
	/* What the timer interrupt does in Linux, driven deterministically. */
	do_timer(1);
	update_process_times(prandom_u32() & 1);
	run_timer_softirq();
	if (current->need_resched)
		schedule();
}

/* One step of the workload: a dense switch, compiled to a jump table. */
static noinline void workload_step(struct worker *w, enum workload_op op)
{
	static const unsigned long cheap[] = { 7, 8, 9, 10, 11, 12, 13, 17, 23 };
	int fd;
	long n;

	op_counts[op]++;
	switch (op) {
	case OP_SYSCALL_CHEAP:
		w->result += sys(cheap[prandom_u32_max(ARRAY_SIZE(cheap))], 0, 0, 0);
		break;
	case OP_READ:
		fd = worker_fd(w);
		if (prandom_u32_max(4) == 0)
			sys(4, fd, prandom_u32_max(64), 0);	/* lseek SEEK_SET */
		n = sys(0, fd, (u64)w->buf, 16 + prandom_u32_max(512));
		if (n > 0)
			w->result = ksim_mix64(w->result, crc32_le(0, w->buf, n));
		else
			sys(4, fd, 0, 0);
		break;
	case OP_WRITE:
		fd = worker_fd(w);
		n = 8 + prandom_u32_max(256);
		worker_fill(w, n);
		if (sys(1, fd, (u64)w->buf, n) < 0)
			sys(4, fd, 0, 0);
		break;
	case OP_OPEN_CLOSE: {
		unsigned int i = prandom_u32_max(WORKER_FDS);
		if (w->fds[i] >= 0) {
			sys(3, w->fds[i], 0, 0);	/* close */
			w->fds[i] = -1;
		} else {
			worker_fd(w);
		}
		break;
	}
	case OP_FSYNC:
		sys(5, worker_fd(w), 0, 0);
		break;
	case OP_BIO: {
		int dev = (int)prandom_u32_max(NR_BLKDEV);
		sector_t sector = prandom_u32_max(BLKDEV_SECTORS);
		u32 size = (1 + prandom_u32_max(4)) << SECTOR_SHIFT;
		u32 op = prandom_u32() & 1;
		if (op == REQ_OP_WRITE)
			worker_fill(w, size);
		blkdev_issue_rw(dev, sector, w->buf, size, op);
		break;
	}
	case OP_KMALLOC:
		op_kmalloc(w);
		break;
	case OP_PAGES:
		op_pages(w);
		break;
	case OP_SEND:
		n = 16 + prandom_u32_max(1200);
		worker_fill(w, n);
		sys(14, prandom_u32_max(NR_SOCKS), (u64)w->buf, n);
		break;
	case OP_NIC_IRQ:
		e100_intr(11, NULL);
		break;
	case OP_TICK:
		op_tick();
		break;
	case OP_YIELD:
		sys(6, 0, 0, 0);
		break;
	case OP_MSS:
		tcp_sync_mss(&tcp_socks[prandom_u32_max(NR_SOCKS)], 256 + prandom_u32_max(1300));
		break;
	case OP_FIB:
		w->result += fib(4 + prandom_u32_max(7));
		break;
	case OP_MISC_SYSCALL:
		switch (prandom_u32_max(3)) {
		case 0:
			sys(18, (u64)w->buf, 0, 0);		/* uname */
			break;
		case 1:
			sys(16, (u64)w->buf, 1 + prandom_u32_max(32), 0);	/* sethostname */
			break;
		default:
			sys(15, 16 + prandom_u32_max(3000), 0, 0);	/* brk */
			break;
		}
		break;
	case OP_TCP_STATE: {
		struct sock *sk = &tcp_socks[prandom_u32_max(NR_SOCKS)];
		tcp_set_state(sk, 1 + (int)prandom_u32_max(11));
		tcp_set_state(sk, 1);	/* back to ESTABLISHED so it keeps sending */
		break;
	}
	default:
		break;
	}
	w->steps++;
}

noinline u64 ksim_compute_checksum(void)
{
	u64 prandom_peek_state(void);
	u64 syscall_checksum(u64 h);
	u64 h = 0xcbf29ce484222325ULL;

	h = ksim_mix64(h, ksim_workload_seed);
	h = ksim_mix64(h, workload_iter);
	h = ksim_mix64(h, prandom_peek_state());
	for (unsigned int i = 0; i < NR_OPS; i++)
		h = ksim_mix64(h, op_counts[i]);
	for (unsigned int i = 0; i < NR_WORKERS; i++) {
		h = ksim_mix64(h, workers[i].steps);
		h = ksim_mix64(h, workers[i].result);
	}
	h = sched_checksum(h);
	h = slab_checksum(h);
	for (unsigned int o = 0; o < MAX_ORDER; o++)
		h = ksim_mix64(h, free_area[o].nr_free);
	h = ksim_mix64(h, pgalloc_count ^ (pgfree_count << 32));
	h = ksim_mix64(h, nr_free_pages());
	h = timer_checksum(h);
	h = syscall_checksum(h);
	h = vfs_checksum(h);
	h = blk_checksum(h);
	return net_checksum(h);
}

static noinline void __noreturn workload_finish(void)
{
	ksim_workload_checksum = ksim_compute_checksum();
	ksim_workload_done = 1;
	printk("toy: seed=0x%lx iterations=%lu checksum=0x%016lx\n",
	       ksim_workload_seed, workload_iter, ksim_workload_checksum);
	printk("toy: irq_ticks=%lu switches=%lu\n", irq_ticks, runqueue.nr_switches);
	ksim_halt();
}

static noinline void worker_thread(void *arg)
{
	struct worker *w = arg;

	for (;;) {
		if (workload_iter >= ksim_workload_iterations)
			workload_finish();
		workload_iter++;
		workload_step(w, (enum workload_op)prandom_u32_max(NR_OPS));
	}
}

static noinline void workload_start(void)
{
	static const char *const names[NR_WORKERS] = {
		"kworker/0:1", "sshd", "postgres", "nginx", "jbd2/sda1",
	};

	prandom_seed(ksim_workload_seed);
	for (unsigned int i = 0; i < NR_WORKERS; i++) {
		for (unsigned int j = 0; j < WORKER_FDS; j++)
			workers[i].fds[j] = -1;
		if (!kernel_thread(worker_thread, &workers[i], names[i]))
			ksim_fail("kernel_thread failed");
	}
	/* init_task becomes the idle task: it runs only if no worker can. */
	for (;;)
		schedule();
}

/* The function the per-hit benchmark calls; a few instructions of real work. */
noinline u64 ksim_bench_target(u64 x)
{
	return (x ^ (x >> 7)) * 0x9e3779b97f4a7c15ULL + 1;
}

static noinline void __noreturn ksim_bench_run(u64 calls)
{
	u64 acc = 1, t0, t1;

	t0 = rdtsc();
	for (u64 i = 0; i < calls; i++) {
		acc = ksim_bench_target(acc);
		/* the result must be "used" each time, or gcc (which sees that the
		 * target is pure) drops the calls and measures an empty loop */
		asm volatile("" : "+r"(acc) : : "memory");
	}
	t1 = rdtsc();
	ksim_bench_cycles = t1 - t0;
	bench_sink = acc;
	printk("toy: bench calls=%lu cycles=%lu\n", calls, ksim_bench_cycles);
	ksim_halt();
}

#ifdef __x86_64__	/* seed=N iterations=N bench=N on the PVH command line (QEMU -append) */
static noinline void parse_boot_params(void)
{
	const u32 *si;
	const char *p;

	if (!pvh_start_info_pa)
		return;
	si = (const u32 *)(u64)pvh_start_info_pa;	/* identity-mapped */
	if (si[0] != 0x336ec578 || !*(const u64 *)(si + 6))
		return;
	p = (const char *)*(const u64 *)(si + 6);	/* hvm_start_info.cmdline_paddr */
	while (*p) {
		if (!strncmp(p, "seed=", 5))
			ksim_workload_seed = simple_strtoull(p + 5, &p, 0);
		else if (!strncmp(p, "iterations=", 11))
			ksim_workload_iterations = simple_strtoull(p + 11, &p, 0);
		else if (!strncmp(p, "bench=", 6))
			ksim_bench_calls = simple_strtoull(p + 6, &p, 0);
		while (*p && *p != ' ')
			p++;
		while (*p == ' ')
			p++;
	}
}
#endif
noinline void start_kernel(void)
{
	printk("toy: ksim toy kernel booting\n");
	parse_boot_params();
	crc32_init();
	mem_init();
	kmem_cache_init();
	sched_init();
	init_timers();
	vfs_init();
	blk_dev_init();
	tcp_init();
	e100_probe();
	local_irq_enable();
	if (ksim_bench_calls)
		ksim_bench_run(ksim_bench_calls);
	workload_start();
}

#ifdef __aarch64__
/*
 * seed=N iterations=N bench=N on the command line: the DTB's /chosen/bootargs
 * (QEMU -append), which setup_arch() (arch/arm64/setup.c) copied.
 */
noinline void parse_boot_params(void)
{
	const char *p = boot_command_line;

	while (*p) {
		if (!strncmp(p, "seed=", 5))
			ksim_workload_seed = simple_strtoull(p + 5, &p, 0);
		else if (!strncmp(p, "iterations=", 11))
			ksim_workload_iterations = simple_strtoull(p + 11, &p, 0);
		else if (!strncmp(p, "bench=", 6))
			ksim_bench_calls = simple_strtoull(p + 6, &p, 0);
		while (*p && *p != ' ')
			p++;
		while (*p == ' ')
			p++;
	}
}
#endif
