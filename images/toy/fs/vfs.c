/* fs/read_write.c + fs/open.c + fs/file.c in one: the VFS entry points and a
 * single process-wide file descriptor table. */
#include <toy.h>

static struct file *fd_table[NR_OPEN];
static u64 open_fds[1];
static struct kmem_cache *filp_cachep;
static u64 vfs_reads, vfs_writes, bytes_read, bytes_written, fsyncs;

static noinline int rw_verify_area(struct file *f, loff_t *pos, size_t count)
{
	if ((loff_t)count < 0 || *pos < 0)
		return -EINVAL;
	if (*pos + (loff_t)count > RAMFS_FILE_MAX * 2)
		return -EINVAL;
	return 0;
}

static noinline void file_accessed(struct file *f)
{
	f->f_inode->i_atime = get_jiffies_64();
}

static noinline void file_modified(struct file *f)
{
	f->f_inode->i_mtime = get_jiffies_64();
}

noinline ssize_t vfs_read(struct file *f, char *buf, size_t count, loff_t *pos)
{
	ssize_t ret = rw_verify_area(f, pos, count);

	if (ret)
		return ret;
	ret = f->f_op->read(f, buf, count, pos);
	if (ret > 0) {
		bytes_read += ret;
		file_accessed(f);
	}
	vfs_reads++;
	return ret;
}

noinline ssize_t vfs_write(struct file *f, const char *buf, size_t count, loff_t *pos)
{
	ssize_t ret = rw_verify_area(f, pos, count);

	if (ret)
		return ret;
	ret = f->f_op->write(f, buf, count, pos);
	if (ret > 0) {
		bytes_written += ret;
		file_modified(f);
	}
	vfs_writes++;
	return ret;
}

noinline loff_t vfs_llseek(struct file *f, loff_t off, int whence)
{
	return f->f_op->llseek(f, off, whence);	/* indirect tail call: jmp *%rax */
}

noinline int vfs_fsync(struct file *f)
{
	fsyncs++;
	return f->f_op->fsync(f);	/* indirect tail call: jmp *%rax */
}

noinline struct file *filp_open(const char *name, int flags)
{
	struct inode *inode = ramfs_lookup(name);
	struct file *f;

	if (!inode)
		return NULL;
	f = kmem_cache_zalloc(filp_cachep);
	if (!f)
		return NULL;
	f->f_inode = inode;
	f->f_op = inode->i_fop;
	f->f_flags = (u32)flags;
	f->f_count = 1;
	inode->i_count++;
	if (f->f_op->open(inode, f)) {
		kmem_cache_free(filp_cachep, f);
		return NULL;
	}
	return f;
}

noinline int filp_close(struct file *f)
{
	int ret = f->f_op->release(f->f_inode, f);

	f->f_inode->i_count--;
	kmem_cache_free(filp_cachep, f);
	return ret;
}

noinline int get_unused_fd(void)
{
	unsigned int fd = find_first_zero_bit(open_fds, NR_OPEN);

	if (fd >= NR_OPEN)
		return -ENFILE;
	bitmap_set(open_fds, fd, 1);
	return (int)fd;
}

static noinline void put_unused_fd(unsigned int fd)
{
	bitmap_clear(open_fds, fd, 1);
}

noinline void fd_install(unsigned int fd, struct file *f)
{
	fd_table[fd] = f;
}

noinline struct file *fget(unsigned int fd)
{
	if (fd >= NR_OPEN)
		return NULL;
	return fd_table[fd];
}

noinline int close_fd(unsigned int fd)
{
	struct file *f = fget(fd);

	if (!f)
		return -EBADF;
	fd_table[fd] = NULL;
	put_unused_fd(fd);
	return filp_close(f);	/* tail call */
}

/* The lowest open descriptor at or after "from", or -1. */
int vfs_next_open_fd(unsigned int from);
noinline int vfs_next_open_fd(unsigned int from)
{
	unsigned int fd = find_next_bit(open_fds, NR_OPEN, from);

	return fd < NR_OPEN ? (int)fd : -1;
}

noinline void vfs_init(void)
{
	filp_cachep = kmem_cache_create("filp", sizeof(struct file), NULL);
	ramfs_init();
}

u64 ramfs_checksum(u64 h);
noinline u64 vfs_checksum(u64 h)
{
	h = ksim_mix64(h, vfs_reads);
	h = ksim_mix64(h, vfs_writes);
	h = ksim_mix64(h, bytes_read ^ (bytes_written << 24));
	h = ksim_mix64(h, fsyncs);
	h = ksim_mix64(h, open_fds[0]);
	for (int fd = vfs_next_open_fd(0); fd >= 0; fd = vfs_next_open_fd(fd + 1))
		h = ksim_mix64(h, (u64)fd << 56 | (u64)fd_table[fd]->f_pos);
	return ramfs_checksum(h);
}
