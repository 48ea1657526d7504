/*
 * block/blk-core.c + drivers/block/brd.c: bios submitted to ram-backed block
 * devices.  Devices are numbered 0..NR_BLKDEV-1; each accounts the sectors it
 * moved, which is what per-device instrumentation of submit_bio should find.
 */
#include <toy.h>
#include <trace_events.h>

static u8 brd_storage[NR_BLKDEV][BLKDEV_SECTORS << SECTOR_SHIFT];
struct block_device blkdevs[NR_BLKDEV];
static struct kmem_cache *bio_cachep;
static u64 bios_submitted, bios_completed, bio_errors, bio_sectors_total;

noinline struct bio *bio_alloc(int dev, unsigned int nr_bytes)
{
	struct bio *bio = kmem_cache_zalloc(bio_cachep);

	if (!bio)
		return NULL;
	bio->bi_dev = dev;
	bio->bi_size = nr_bytes;
	return bio;
}

noinline void bio_put(struct bio *bio)
{
	kmem_cache_free(bio_cachep, bio);
}

noinline void bio_endio(struct bio *bio)
{
	trace_block_rq_complete(bio, bio->bi_status, bio->bi_size);
	bios_completed++;
	if (bio->bi_status)
		bio_errors++;
	if (bio->bi_end_io)
		bio->bi_end_io(bio);
}

static noinline void blk_account_io_start(struct block_device *bdev, struct bio *bio)
{
	bdev->ios++;
	if (bio->bi_opf == REQ_OP_WRITE)
		bdev->sectors_written += bio->bi_size >> SECTOR_SHIFT;
	else
		bdev->sectors_read += bio->bi_size >> SECTOR_SHIFT;
}

static noinline bool bio_check_eod(struct block_device *bdev, struct bio *bio)
{
	u64 nr = bio->bi_size >> SECTOR_SHIFT;

	return bio->bi_sector + nr <= bdev->nr_sectors;
}

static noinline void brd_do_bvec(struct block_device *bdev, struct bio *bio)
{
	u8 *mem = bdev->storage + (bio->bi_sector << SECTOR_SHIFT);

	if (bio->bi_opf == REQ_OP_WRITE) {
		if (!memcmp(mem, bio->bi_buf, bio->bi_size))
			bdev->unchanged_writes++;
		memcpy(mem, bio->bi_buf, bio->bi_size);
		bdev->data_csum = ksim_mix64(bdev->data_csum,
					     csum_partial(mem, bio->bi_size, (u32)bio->bi_sector));
	} else
		memcpy(bio->bi_buf, mem, bio->bi_size);
}

static noinline void brd_submit_bio(struct bio *bio)
{
	brd_do_bvec(&blkdevs[bio->bi_dev], bio);
	bio_endio(bio);		/* tail call */
}

static noinline void submit_bio_noacct(struct bio *bio)
{
	struct block_device *bdev;

	if (bio->bi_dev < 0 || bio->bi_dev >= NR_BLKDEV)
		goto fail;
	bdev = &blkdevs[bio->bi_dev];
	if (!bio_check_eod(bdev, bio) || (bio->bi_size & 511))
		goto fail;
	blk_account_io_start(bdev, bio);
	trace_block_rq_issue(bio);
	bdev->submit(bio);
	return;
fail:
	bio->bi_status = -EIO;
	bio_endio(bio);
}

noinline void submit_bio(struct bio *bio)
{
	trace_block_rq_insert(bio);
	bios_submitted++;
	bio_sectors_total += bio->bi_size >> SECTOR_SHIFT;
	submit_bio_noacct(bio);
}

static noinline void blkdev_bio_end_io_sync(struct bio *bio)
{
	*(int *)bio->bi_private = 1;
}

noinline int blkdev_issue_rw(int dev, sector_t sector, void *buf, u32 size, u32 op)
{
	int done = 0, status;
	struct bio *bio;

	size = min(size, (u32)((BLKDEV_SECTORS - min(sector, (sector_t)BLKDEV_SECTORS)) << SECTOR_SHIFT));
	bio = bio_alloc(dev, size);
	if (!bio)
		return -ENOMEM;
	bio->bi_sector = sector;
	bio->bi_buf = buf;
	bio->bi_opf = op;
	bio->bi_end_io = blkdev_bio_end_io_sync;
	bio->bi_private = &done;
	submit_bio(bio);
	status = done ? bio->bi_status : -EIO;
	bio_put(bio);
	return status;
}

noinline void blk_dev_init(void)
{
	bio_cachep = kmem_cache_create("bio", sizeof(struct bio), NULL);
	for (int i = 0; i < NR_BLKDEV; i++) {
		blkdevs[i].bd_dev = i;
		blkdevs[i].nr_sectors = BLKDEV_SECTORS;
		blkdevs[i].storage = brd_storage[i];
		blkdevs[i].submit = brd_submit_bio;
	}
}

noinline u64 blk_checksum(u64 h)
{
	h = ksim_mix64(h, bios_submitted);
	h = ksim_mix64(h, bios_completed ^ (bio_errors << 40));
	h = ksim_mix64(h, bio_sectors_total);
	for (int i = 0; i < NR_BLKDEV; i++) {
		h = ksim_mix64(h, blkdevs[i].sectors_read);
		h = ksim_mix64(h, blkdevs[i].sectors_written);
		h = ksim_mix64(h, blkdevs[i].ios ^ (blkdevs[i].unchanged_writes << 32));
		h = ksim_mix64(h, blkdevs[i].data_csum);
		/* the first sectors in full; the rest is covered by data_csum */
		h = ksim_mix64(h, crc32_le(0, blkdevs[i].storage, 2 << SECTOR_SHIFT));
	}
	return h;
}
