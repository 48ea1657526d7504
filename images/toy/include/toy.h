/*
 * Common definitions of the toy kernel: types, attributes, the subsystem
 * structures and every cross-file prototype.  Included by C and by assembly
 * (only the #defines above __ASSEMBLY__ are visible to .S files).  What differs
 * by architecture is under __x86_64__ here, or in <asm-arm64.h>.
 */
#ifndef TOY_H
#define TOY_H
#define THREAD_SIZE		16384
#define NR_TASKS		6	/* init_task (pid 0) + 5 workers */
#define KSIM_TRAP_SLOTS		1024
/* struct task_struct offsets used by __switch_to_asm (checked by _Static_assert). */
#define TASK_threadsp		0
#define TASK_pid		16
#define TASK_comm		144
#define TASK_struct_size	160

#if defined(__x86_64__)
#define __START_KERNEL_map	0xffffffff80000000
#define IRQ0_VECTOR		0x20
/* isa-debug-exit: QEMU exits with status (value << 1) | 1. */
#define DEBUG_EXIT_PORT		0xf4
#define DEBUG_EXIT_SUCCESS	0x10	/* exit status 33 */
#define DEBUG_EXIT_FAILURE	0x11	/* exit status 35 */
#elif defined(__aarch64__)
#include <asm-arm64.h>
#endif
#ifndef __ASSEMBLY__
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char s8;
typedef short s16;
typedef int s32;
typedef long long s64;
typedef unsigned long size_t;
typedef long ssize_t;
typedef long loff_t;
typedef u64 sector_t;
typedef _Bool bool;
#define true 1
#define false 0
#define NULL ((void *)0)

#define noinline	__attribute__((noinline))
#define __noreturn	__attribute__((noreturn))
#define __aligned(x)	__attribute__((aligned(x)))
#define __used		__attribute__((used))
#define __section(s)	__attribute__((section(s)))
#define barrier()	__asm__ __volatile__("" ::: "memory")
#define ARRAY_SIZE(a)	(sizeof(a) / sizeof((a)[0]))
#define offsetof(t, m)	__builtin_offsetof(t, m)
#define container_of(p, t, m) ((t *)((char *)(p) - offsetof(t, m)))
#define min(a, b)	((a) < (b) ? (a) : (b))
#define max(a, b)	((a) > (b) ? (a) : (b))
#define READ_ONCE(x)	(*(volatile __typeof__(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile __typeof__(x) *)&(x) = (v))

#define EPERM	1
#define ENOENT	2
#define EIO	5
#define EBADF	9
#define ENOMEM	12
#define EFAULT	14
#define EBUSY	16
#define EINVAL	22
#define ENFILE	23
#define ENOSPC	28
#define ENOSYS	38
#define EAGAIN	11

#ifdef __x86_64__	/* ---- port I/O, the TSC (arm64: <asm-arm64.h>) ------------ */
static inline void outb(u8 v, u16 port)
{
	__asm__ __volatile__("outb %0, %1" : : "a"(v), "Nd"(port));
}
static inline void outl(u32 v, u16 port)
{
	__asm__ __volatile__("outl %0, %1" : : "a"(v), "Nd"(port));
}
static inline u8 inb(u16 port)
{
	u8 v;
	__asm__ __volatile__("inb %1, %0" : "=a"(v) : "Nd"(port));
	return v;
}
static inline u64 rdtsc(void)
{
	u32 lo, hi;
	__asm__ __volatile__("rdtsc" : "=a"(lo), "=d"(hi));
	return ((u64)hi << 32) | lo;
}
#endif
/* ---- lists ----------------------------------------------------------- */
struct list_head {
	struct list_head *next, *prev;
};
static inline void INIT_LIST_HEAD(struct list_head *l) { l->next = l->prev = l; }
static inline bool list_empty(const struct list_head *l) { return l->next == l; }
static inline void list_add_tail(struct list_head *n, struct list_head *h)
{
	n->prev = h->prev;
	n->next = h;
	h->prev->next = n;
	h->prev = n;
}
static inline void list_del(struct list_head *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->next = n->prev = n;
}

/* ---- lib ------------------------------------------------------------- */
void *memcpy(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
void *memmove(void *dst, const void *src, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
size_t strnlen(const char *s, size_t max);
int strcmp(const char *a, const char *b);
int strncmp(const char *a, const char *b, size_t n);
char *strcpy(char *dst, const char *src);
size_t strlcpy(char *dst, const char *src, size_t size);
char *strchr(const char *s, int c);
u32 crc32_le(u32 crc, const void *p, size_t len);
void crc32_init(void);
u16 crc16(u16 crc, const u8 *p, size_t len);
u32 csum_partial(const void *buf, size_t len, u32 sum);
u16 csum_fold(u32 sum);
u16 ip_fast_csum(const void *iph, unsigned int ihl);
u64 hash_64(u64 val, unsigned int bits);
u64 ksim_mix64(u64 h, u64 v);
int vsnprintf(char *buf, size_t size, const char *fmt, __builtin_va_list ap);
int snprintf(char *buf, size_t size, const char *fmt, ...);
int printk(const char *fmt, ...);
void serial_init(void);
void serial_putc(char c);
void serial_write(const char *s, size_t n);
u64 simple_strtoull(const char *s, const char **end, unsigned int base);
void prandom_seed(u64 seed);
u32 prandom_u32(void);
u64 prandom_u64(void);
u32 prandom_u32_max(u32 ep_ro);
void bitmap_set(u64 *map, unsigned int start, unsigned int len);
void bitmap_clear(u64 *map, unsigned int start, unsigned int len);
unsigned int find_first_zero_bit(const u64 *map, unsigned int size);
unsigned int find_next_bit(const u64 *map, unsigned int size, unsigned int off);
unsigned int bitmap_weight(const u64 *map, unsigned int nbits);
/* lib/hweight.S: hand-written, loop heads within 5 bytes of the entry */
unsigned int __sw_hweight64(u64 w);
void __memzero_qwords(void *dst, size_t nqwords);
u64 fib(unsigned int n);

/* binary search tree (lib/bst.c), recursive walks */
struct bst_node {
	u64 key;
	u64 value;
	struct bst_node *left, *right;
};
struct bst_node *bst_insert(struct bst_node *root, struct bst_node *node);
struct bst_node *bst_find(struct bst_node *root, u64 key);
unsigned int bst_count(const struct bst_node *root);
unsigned int bst_depth(const struct bst_node *root);
u64 bst_sum(const struct bst_node *root);

/* ---- mm -------------------------------------------------------------- */
#define PAGE_SHIFT	12
#define PAGE_SIZE	4096UL
#define MAX_ORDER	7
#define NR_POOL_PAGES	256

struct page {
	struct list_head lru;
	u32 flags;
	s32 order;		/* order of the free block it heads, -1 if none */
	void *slab_cache;	/* owning kmem_cache when used by the slab */
	void *freelist;
	u32 inuse;
	u32 _pad;
};
#define PG_buddy	0x1
#define PG_slab		0x2
#define PG_reserved	0x4

struct free_area {
	struct list_head free_list;
	u64 nr_free;
};

void mem_init(void);
struct page *__alloc_pages(unsigned int order);
void __free_pages(struct page *page, unsigned int order);
void *page_address(const struct page *page);
struct page *virt_to_page(const void *addr);
u64 page_to_pfn(const struct page *page);
unsigned long __get_free_pages(unsigned int order);
unsigned long get_zeroed_page(void);
void free_pages(unsigned long addr, unsigned int order);
u64 nr_free_pages(void);
extern struct free_area free_area[MAX_ORDER];
extern struct page mem_map[NR_POOL_PAGES];
extern u64 pgalloc_count, pgfree_count;

struct kmem_cache {
	const char *name;
	u32 size;
	u32 objs_per_slab;
	struct list_head slabs_partial;
	struct list_head slabs_full;
	u64 active_objs;
	u64 total_allocs;
	u64 total_frees;
	u64 nr_slabs;
	void (*ctor)(void *obj);
};
struct kmem_cache *kmem_cache_create(const char *name, u32 size, void (*ctor)(void *));
void *kmem_cache_alloc(struct kmem_cache *s);
void *kmem_cache_zalloc(struct kmem_cache *s);
void kmem_cache_free(struct kmem_cache *s, void *obj);
void *kmalloc(size_t size);
void *kzalloc(size_t size);
void kfree(const void *obj);
size_t ksize(const void *obj);
void kmem_cache_init(void);
unsigned int kmalloc_index(size_t size);
u64 slab_checksum(u64 h);
extern struct kmem_cache kmem_caches[];
extern unsigned int nr_kmem_caches;

/* ---- sched ----------------------------------------------------------- */
struct thread_struct {
	u64 sp;
};

#define TASK_RUNNING		0
#define TASK_INTERRUPTIBLE	1

struct task_struct {
	struct thread_struct thread;	/* must stay first: TASK_threadsp */
	volatile long state;
	int pid;
	int prio;
	struct task_struct *parent;
	struct list_head run_list;
	u64 vruntime;
	u64 exec_start;
	u64 sum_exec_runtime;
	u64 utime, stime;
	u64 nvcsw, nivcsw;
	u64 syscalls;
	u64 need_resched;
	void (*fn)(void *);
	void *arg;
	void *stack;
	char comm[16];
};

struct rq {
	struct list_head tasks;
	unsigned int nr_running;
	u64 nr_switches;
	u64 clock;
	struct task_struct *curr;
	struct task_struct *idle;
	u64 nr_waking;		/* wake_up_process() calls (sched_waking events) */
	u64 nr_wakeups;		/* tasks they woke (sched_wakeup events) */
};

extern struct task_struct *current_task;
extern struct task_struct init_task;
extern struct rq runqueue;
extern int cpu_number;
#define current (current_task)

void sched_init(void);
struct task_struct *kernel_thread(void (*fn)(void *), void *arg, const char *name);
void schedule(void);
void do_sched_yield(void);
void scheduler_tick(void);
void wake_up_process(struct task_struct *p);
int task_pid_nr(const struct task_struct *t);
int task_ppid_nr(const struct task_struct *t);
void __noreturn ret_from_fork(void);
struct task_struct *__switch_to_asm(struct task_struct *prev, struct task_struct *next);
struct task_struct *__switch_to(struct task_struct *prev, struct task_struct *next);
void schedule_tail(struct task_struct *prev);
u64 sched_checksum(u64 h);

/* ---- time ------------------------------------------------------------ */
extern u64 jiffies;
extern u64 irq_ticks;
struct timer_list {
	struct list_head entry;
	u64 expires;
	void (*function)(struct timer_list *);
	u64 fired;
	bool pending;
};
void init_timers(void);
void timer_setup(struct timer_list *t, void (*fn)(struct timer_list *));
void add_timer(struct timer_list *t);
int del_timer(struct timer_list *t);
int mod_timer(struct timer_list *t, u64 expires);
void do_timer(unsigned long ticks);
u64 get_jiffies_64(void);
void update_process_times(int user_tick);
void run_timer_softirq(void);
void account_process_tick(struct task_struct *p, int user_tick);
u64 timer_checksum(u64 h);

/* ---- syscalls ------------------------------------------------------- */
#ifdef __aarch64__
/*
 * Linux arm64's layout (arch/arm64/include/asm/ptrace.h): x0..x30, sp, pc,
 * pstate, orig_x0, syscallno.  The shared code's x86 names alias the registers
 * that play their part: di, si, dx, r10, r8, r9 are the arguments x0..x5, ax
 * the syscall number x8 (the handler's result goes back through ax as on x86).
 */
struct pt_regs {
	union {
		u64 regs[31];
		struct {
			u64 di, si, dx, r10, r8, r9, x6, x7, ax;
		};
	};
	u64 sp, pc, pstate;
	u64 orig_ax;		/* Linux: orig_x0 */
	s32 syscallno;
	u32 unused2;
};
#else
struct pt_regs {
	u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8, ax, cx, dx, si, di;
	u64 orig_ax, ip, cs, flags, sp, ss;
};
#endif
typedef long (*sys_call_ptr_t)(const struct pt_regs *);
#define NR_syscalls 24
extern const sys_call_ptr_t sys_call_table[NR_syscalls];
long do_syscall_64(struct pt_regs *regs, unsigned long nr);
extern u64 syscall_counts[NR_syscalls];


/* ---- fs ------------------------------------------------------------- */
struct file;
struct inode;
struct file_operations {
	ssize_t (*read)(struct file *, char *, size_t, loff_t *);
	ssize_t (*write)(struct file *, const char *, size_t, loff_t *);
	int (*open)(struct inode *, struct file *);
	int (*release)(struct inode *, struct file *);
	int (*fsync)(struct file *);
	loff_t (*llseek)(struct file *, loff_t, int);
};
#define RAMFS_FILE_MAX	2048
struct inode {
	u64 i_ino;
	u64 i_size;
	u64 i_atime, i_mtime;
	u32 i_count;
	int i_bdev;		/* block device backing fsync, -1 for none */
	const struct file_operations *i_fop;
	char name[24];
	u8 *data;
	struct bst_node node;	/* in the ramfs directory tree, keyed by name hash */
};
struct file {
	struct inode *f_inode;
	const struct file_operations *f_op;
	loff_t f_pos;
	u32 f_count;
	u32 f_flags;
};
#define NR_OPEN 16
#define SEEK_SET 0
#define SEEK_CUR 1
#define SEEK_END 2
void vfs_init(void);
ssize_t vfs_read(struct file *f, char *buf, size_t count, loff_t *pos);
ssize_t vfs_write(struct file *f, const char *buf, size_t count, loff_t *pos);
struct file *filp_open(const char *name, int flags);
int filp_close(struct file *f);
loff_t vfs_llseek(struct file *f, loff_t off, int whence);
int vfs_fsync(struct file *f);
struct file *fget(unsigned int fd);
int get_unused_fd(void);
void fd_install(unsigned int fd, struct file *f);
int close_fd(unsigned int fd);
void ramfs_init(void);
struct inode *ramfs_lookup(const char *name);
struct inode *ramfs_create(const char *name, int bdev);
extern const char *const ramfs_names[];
extern const unsigned int nr_ramfs_names;
u64 vfs_checksum(u64 h);

/* ---- block ---------------------------------------------------------- */
#define SECTOR_SHIFT	9
#define NR_BLKDEV	3
#define BLKDEV_SECTORS	128
struct bio;
struct block_device {
	int bd_dev;
	u64 nr_sectors;
	u64 sectors_read, sectors_written;
	u64 ios;
	u64 data_csum;	/* running checksum of everything written */
	u64 unchanged_writes;
	u8 *storage;
	void (*submit)(struct bio *);
};
#define REQ_OP_READ	0
#define REQ_OP_WRITE	1
struct bio {
	sector_t bi_sector;
	u32 bi_size;
	int bi_dev;
	u32 bi_opf;
	int bi_status;
	u8 *bi_buf;
	void (*bi_end_io)(struct bio *);
	void *bi_private;
};
void blk_dev_init(void);
void submit_bio(struct bio *bio);
struct bio *bio_alloc(int dev, unsigned int nr_bytes);
void bio_put(struct bio *bio);
void bio_endio(struct bio *bio);
int blkdev_issue_rw(int dev, sector_t sector, void *buf, u32 size, u32 op);
u64 blk_checksum(u64 h);
extern struct block_device blkdevs[NR_BLKDEV];

/* ---- net ------------------------------------------------------------ */
struct sk_buff {
	struct sk_buff *next;
	u32 len;
	u32 protocol;
	u8 *head;
	u8 *data;
	u32 truesize;
	u32 csum;
};
struct net_device;
struct net_device_ops {
	int (*ndo_open)(struct net_device *);
	int (*ndo_start_xmit)(struct sk_buff *, struct net_device *);
	void (*ndo_set_rx_mode)(struct net_device *);
	int (*ndo_get_stats)(struct net_device *);
};
struct net_device {
	const char *name;
	const struct net_device_ops *netdev_ops;
	u32 mtu;
	u64 tx_packets, tx_bytes, rx_packets, rx_bytes, rx_dropped;
	void *priv;
};
struct sk_buff *alloc_skb(u32 size);
void kfree_skb(struct sk_buff *skb);
u8 *skb_put(struct sk_buff *skb, u32 len);
u8 *skb_push(struct sk_buff *skb, u32 len);
u8 *skb_pull(struct sk_buff *skb, u32 len);
int dev_queue_xmit(struct sk_buff *skb);
int netif_rx(struct sk_buff *skb);
void net_rx_action(void);
void e100_probe(void);
int e100_intr(int irq, void *dev_id);
int e100_poll(int budget);
void e100_watchdog(struct timer_list *t);
extern struct net_device e100_netdev;

struct sock {
	int sk_state;
	u32 mss_cache;
	u32 pmtu;
	u32 snd_nxt, snd_una, rcv_nxt;
	u32 snd_cwnd;
	u64 bytes_sent, bytes_received, segs_out, segs_in;
	struct timer_list retransmit_timer;
};
void tcp_init(void);
int tcp_sendmsg(struct sock *sk, const void *buf, size_t size);
u32 tcp_sync_mss(struct sock *sk, u32 pmtu);
u32 tcp_current_mss(struct sock *sk);
void tcp_set_state(struct sock *sk, int state);
int tcp_v4_rcv(struct sk_buff *skb);
int ip_rcv(struct sk_buff *skb);
u64 net_checksum(u64 h);
extern struct sock tcp_socks[];
#define NR_SOCKS 4

/* ---- arch ----------------------------------------------------------- */
void trap_init(void);
void pit_init(void);
void local_irq_enable(void);
void local_irq_disable(void);
void __noreturn ksim_halt(void);
void __noreturn ksim_fail(const char *why);
void start_kernel(void);
u64 ksim_bench_target(u64 x);

/* The ksim ABI (images/toy/README.md) */
struct ksim_trap {
	u64 site;
	u64 patch;
};
extern struct ksim_trap ksim_trap_table[KSIM_TRAP_SLOTS];
extern u64 ksim_trap_count;
extern volatile u64 ksim_workload_seed, ksim_workload_iterations;
extern volatile u64 ksim_workload_checksum, ksim_workload_done;
extern volatile u64 ksim_bench_calls, ksim_bench_cycles;
extern u32 pvh_start_info_pa;

#endif /* __ASSEMBLY__ */
#endif /* TOY_H */
