/*
 * fs/ramfs.c: files kept in memory, found through a binary search tree keyed
 * by a hash of the name.  Files created with a backing block device write
 * their contents there on fsync.
 */
#include <toy.h>

#define NR_INODES 16
static struct inode inodes[NR_INODES];
static u8 file_data[NR_INODES][RAMFS_FILE_MAX];
static unsigned int nr_inodes;
static struct bst_node *ramfs_root;
static u64 ino_bitmap[1];

const char *const ramfs_names[] = {
	"/etc/passwd", "/etc/hostname", "/var/log/messages", "/tmp/a", "/tmp/b",
	"/home/user/notes", "/proc/stat", "/dev/sda1.img", "/dev/sdb1.img", "/srv/www/index.html",
};
const unsigned int nr_ramfs_names = ARRAY_SIZE(ramfs_names);

static noinline u64 ramfs_name_hash(const char *name)
{
	return hash_64(crc32_le(~0U, name, strlen(name)), 48);
}

static noinline ssize_t ramfs_file_read(struct file *f, char *buf, size_t count, loff_t *pos)
{
	struct inode *inode = f->f_inode;

	if ((u64)*pos >= inode->i_size)
		return 0;
	count = min(count, (size_t)(inode->i_size - (u64)*pos));
	memcpy(buf, inode->data + *pos, count);
	*pos += count;
	return (ssize_t)count;
}

static noinline ssize_t ramfs_file_write(struct file *f, const char *buf, size_t count,
					 loff_t *pos)
{
	struct inode *inode = f->f_inode;

	if ((u64)*pos >= RAMFS_FILE_MAX)
		return -ENOSPC;
	count = min(count, (size_t)(RAMFS_FILE_MAX - *pos));
	memcpy(inode->data + *pos, buf, count);
	*pos += count;
	if ((u64)*pos > inode->i_size)
		inode->i_size = *pos;
	return (ssize_t)count;
}

/* Opening and releasing a ramfs file needs no work: both are "xor eax,eax; ret". */
static int ramfs_open(struct inode *inode, struct file *f)
{
	return 0;
}

static int ramfs_release(struct inode *inode, struct file *f)
{
	return 0;
}

static noinline int ramfs_fsync(struct file *f)
{
	struct inode *inode = f->f_inode;
	u32 size = (u32)((inode->i_size + 511) & ~511ULL);
	sector_t sector = (inode->i_ino * (RAMFS_FILE_MAX >> SECTOR_SHIFT)) % BLKDEV_SECTORS;

	if (inode->i_bdev < 0 || !size)
		return 0;
	return blkdev_issue_rw(inode->i_bdev, sector, inode->data, size, REQ_OP_WRITE);
}

static noinline loff_t generic_file_llseek(struct file *f, loff_t off, int whence)
{
	loff_t pos;

	switch (whence) {
	case SEEK_SET:
		pos = off;
		break;
	case SEEK_CUR:
		pos = f->f_pos + off;
		break;
	case SEEK_END:
		pos = (loff_t)f->f_inode->i_size + off;
		break;
	default:
		return -EINVAL;
	}
	if (pos < 0 || pos > RAMFS_FILE_MAX)
		return -EINVAL;
	f->f_pos = pos;
	return pos;
}

static const struct file_operations ramfs_file_operations = {
	.read = ramfs_file_read,
	.write = ramfs_file_write,
	.open = ramfs_open,
	.release = ramfs_release,
	.fsync = ramfs_fsync,
	.llseek = generic_file_llseek,
};

noinline struct inode *ramfs_lookup(const char *name)
{
	struct bst_node *n = bst_find(ramfs_root, ramfs_name_hash(name));
	struct inode *inode;

	if (!n)
		return NULL;
	inode = container_of(n, struct inode, node);
	/* Equal hashes are not equal names. */
	return strcmp(inode->name, name) ? NULL : inode;
}

noinline struct inode *ramfs_create(const char *name, int bdev)
{
	struct inode *inode;
	unsigned int ino = find_first_zero_bit(ino_bitmap, NR_INODES);

	if (ino >= NR_INODES || !strchr(name, '/'))
		return NULL;
	bitmap_set(ino_bitmap, ino, 1);
	inode = &inodes[ino];
	inode->i_ino = ino;
	inode->i_bdev = bdev;
	inode->i_fop = &ramfs_file_operations;
	inode->data = file_data[ino];
	strlcpy(inode->name, name, sizeof(inode->name));
	inode->node.key = ramfs_name_hash(name);
	inode->node.value = ino;
	ramfs_root = bst_insert(ramfs_root, &inode->node);
	nr_inodes++;
	return inode;
}

noinline void ramfs_init(void)
{
	for (unsigned int i = 0; i < nr_ramfs_names; i++) {
		struct inode *inode = ramfs_create(ramfs_names[i], (int)(i % (NR_BLKDEV + 1)) - 1);
		int n = snprintf((char *)inode->data, RAMFS_FILE_MAX, "%s: file %u of %u\n",
				 ramfs_names[i], i, nr_ramfs_names);
		inode->i_size = (u64)n;
	}
}

u64 ramfs_checksum(u64 h);
noinline u64 ramfs_checksum(u64 h)
{
	h = ksim_mix64(h, bst_count(ramfs_root));
	h = ksim_mix64(h, bst_depth(ramfs_root));
	h = ksim_mix64(h, bst_sum(ramfs_root));
	h = ksim_mix64(h, bitmap_weight(ino_bitmap, NR_INODES));
	for (unsigned int i = 0; i < nr_inodes; i++) {
		h = ksim_mix64(h, inodes[i].i_size);
		h = ksim_mix64(h, inodes[i].i_atime ^ (inodes[i].i_mtime << 32));
		h = ksim_mix64(h, crc32_le(0, inodes[i].data, inodes[i].i_size));
	}
	return h;
}
