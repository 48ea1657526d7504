/*
 * kernel/sys.c: system calls and their dispatch.  The handlers take a struct
 * pt_regs, as __x64_sys_* do in Linux, and are reached only through sys_call_table
 * from do_syscall_64 (on arm64 __arm64_sys_* and invoke_syscall: <asm-arm64.h>).
 */
#include <toy.h>

u64 syscall_counts[NR_syscalls];
static u64 hostname_gen;
static char hostname[65] = "toy";
static struct sock *const sys_socks = tcp_socks;

static long __x64_sys_read(const struct pt_regs *regs)
{
	struct file *f = fget((unsigned int)regs->di);

	if (!f)
		return -EBADF;
	return vfs_read(f, (char *)regs->si, regs->dx, &f->f_pos);
}

static long __x64_sys_write(const struct pt_regs *regs)
{
	struct file *f = fget((unsigned int)regs->di);

	if (!f)
		return -EBADF;
	return vfs_write(f, (const char *)regs->si, regs->dx, &f->f_pos);
}

static long __x64_sys_open(const struct pt_regs *regs)
{
	struct file *f;
	int fd = get_unused_fd();

	if (fd < 0)
		return fd;
	f = filp_open((const char *)regs->di, (int)regs->si);
	if (!f)
		return -ENOENT;
	fd_install(fd, f);
	return fd;
}

static long __x64_sys_close(const struct pt_regs *regs)
{
	return close_fd((unsigned int)regs->di);
}

static long __x64_sys_lseek(const struct pt_regs *regs)
{
	struct file *f = fget((unsigned int)regs->di);

	if (!f)
		return -EBADF;
	return vfs_llseek(f, (loff_t)regs->si, (int)regs->dx);
}

static long __x64_sys_fsync(const struct pt_regs *regs)
{
	struct file *f = fget((unsigned int)regs->di);

	if (!f)
		return -EBADF;
	return vfs_fsync(f);
}

static long __x64_sys_sched_yield(const struct pt_regs *regs)
{
	do_sched_yield();
	return 0;
}

static long __x64_sys_getpid(const struct pt_regs *regs)
{
	return task_pid_nr(current);
}

static long __x64_sys_getppid(const struct pt_regs *regs)
{
	return task_ppid_nr(current);
}

/* Everyone is root: uid and gid are 0, the whole body is "xor eax,eax; ret". */
static long __x64_sys_getuid(const struct pt_regs *regs)
{
	return 0;
}

static long __x64_sys_getgid(const struct pt_regs *regs)
{
	return 0;
}

/* Nothing to flush in a ram-only kernel. */
static long __x64_sys_sync(const struct pt_regs *regs)
{
	return 0;
}

static long __x64_sys_ni_syscall(const struct pt_regs *regs)
{
	return -ENOSYS;
}

static long __x64_sys_times(const struct pt_regs *regs)
{
	struct task_struct *t = current;

	return (long)(t->utime + t->stime);
}

static long __x64_sys_sendto(const struct pt_regs *regs)
{
	unsigned int sk = (unsigned int)regs->di % NR_SOCKS;

	return tcp_sendmsg(&sys_socks[sk], (const void *)regs->si, regs->dx);
}

static long __x64_sys_brk(const struct pt_regs *regs)
{
	/* A brk "heap" is a kmalloc'd page freed right away: exercises the allocators. */
	void *p = kmalloc(regs->di ? regs->di : 64);

	if (!p)
		return -ENOMEM;
	kfree(p);
	return (long)regs->di;
}

static long __x64_sys_sethostname(const struct pt_regs *regs)
{
	size_t len = regs->si;

	if (len > sizeof(hostname) - 1)
		return -EINVAL;
	/* The caller's buffer may be our own (uname output): copy overlap-safely. */
	memmove(hostname, (const void *)regs->di, len);
	hostname[len] = 0;
	hostname_gen = ksim_mix64(hostname_gen, crc32_le(0, hostname, len));
	return 0;
}

static long __x64_sys_gettid(const struct pt_regs *regs)
{
	return current->pid;
}

static long __x64_sys_uname(const struct pt_regs *regs)
{
	char *buf = (char *)regs->di;
	int n = snprintf(buf, 48, "toy %d.%d #%lu ", 6, 1, (u64)jiffies);

	strcpy(buf + n, hostname);	/* hostname is at most 64 bytes; buf has 2 KiB */
	return n;
}

const sys_call_ptr_t sys_call_table[NR_syscalls] = {
	[0] = __x64_sys_read,
	[1] = __x64_sys_write,
	[2] = __x64_sys_open,
	[3] = __x64_sys_close,
	[4] = __x64_sys_lseek,
	[5] = __x64_sys_fsync,
	[6] = __x64_sys_sched_yield,
	[7] = __x64_sys_getpid,
	[8] = __x64_sys_getppid,
	[9] = __x64_sys_getuid,
	[10] = __x64_sys_getgid,
	[11] = __x64_sys_sync,
	[12] = __x64_sys_ni_syscall,
	[13] = __x64_sys_times,
	[14] = __x64_sys_sendto,
	[15] = __x64_sys_brk,
	[16] = __x64_sys_sethostname,
	[17] = __x64_sys_gettid,
	[18] = __x64_sys_uname,
	[19 ... NR_syscalls - 1] = __x64_sys_ni_syscall,
};

static noinline void syscall_enter_audit(struct pt_regs *regs, unsigned long nr)
{
	regs->orig_ax = nr;
	current->syscalls++;
	syscall_counts[nr]++;
}

noinline long do_syscall_64(struct pt_regs *regs, unsigned long nr)
{
	if (nr >= NR_syscalls)
		return -ENOSYS;
	syscall_enter_audit(regs, nr);
	regs->ax = sys_call_table[nr](regs);
	return (long)regs->ax;
}

u64 syscall_checksum(u64 h);
noinline u64 syscall_checksum(u64 h)
{
	for (unsigned int i = 0; i < NR_syscalls; i++)
		h = ksim_mix64(h, syscall_counts[i]);
	return ksim_mix64(h, hostname_gen);
}
