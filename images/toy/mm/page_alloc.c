/* mm/page_alloc.c: a binary buddy allocator over a 1 MiB pool of 4 KiB pages. */
#include <toy.h>

static u8 page_pool[NR_POOL_PAGES * PAGE_SIZE] __aligned(4096);
struct page mem_map[NR_POOL_PAGES];
struct free_area free_area[MAX_ORDER];
u64 pgalloc_count, pgfree_count;

noinline u64 page_to_pfn(const struct page *page)
{
	return page - mem_map;
}

noinline void *page_address(const struct page *page)
{
	return page_pool + (page_to_pfn(page) << PAGE_SHIFT);
}

noinline struct page *virt_to_page(const void *addr)
{
	return &mem_map[((const u8 *)addr - page_pool) >> PAGE_SHIFT];
}

static noinline void set_buddy_order(struct page *page, unsigned int order)
{
	page->flags |= PG_buddy;
	page->order = (s32)order;
}

static noinline void clear_buddy_order(struct page *page)
{
	page->flags &= ~PG_buddy;
	page->order = -1;
}

static noinline bool page_is_buddy(const struct page *buddy, unsigned int order)
{
	return (buddy->flags & PG_buddy) && buddy->order == (s32)order;
}

static noinline void add_to_free_list(struct page *page, unsigned int order)
{
	list_add_tail(&page->lru, &free_area[order].free_list);
	free_area[order].nr_free++;
	set_buddy_order(page, order);
}

static noinline void del_from_free_list(struct page *page, unsigned int order)
{
	list_del(&page->lru);
	free_area[order].nr_free--;
	clear_buddy_order(page);
}

/* Split a 2^high block down to 2^low, giving the upper halves back. */
static noinline void expand(struct page *page, unsigned int low, unsigned int high)
{
	unsigned long size = 1UL << high;

	while (high > low) {
		high--;
		size >>= 1;
		add_to_free_list(&page[size], high);
	}
}

static noinline struct page *__rmqueue(unsigned int order)
{
	for (unsigned int o = order; o < MAX_ORDER; o++) {
		struct free_area *area = &free_area[o];
		struct page *page;

		if (list_empty(&area->free_list))
			continue;
		page = container_of(area->free_list.next, struct page, lru);
		del_from_free_list(page, o);
		expand(page, order, o);
		return page;
	}
	return NULL;
}

static noinline void __free_one_page(struct page *page, unsigned int order)
{
	u64 pfn = page_to_pfn(page);

	while (order < MAX_ORDER - 1) {
		u64 buddy_pfn = pfn ^ (1UL << order);
		struct page *buddy = &mem_map[buddy_pfn];

		if (!page_is_buddy(buddy, order))
			break;
		del_from_free_list(buddy, order);
		pfn &= buddy_pfn;
		order++;
	}
	add_to_free_list(&mem_map[pfn], order);
}

noinline struct page *__alloc_pages(unsigned int order)
{
	struct page *page;

	if (order >= MAX_ORDER)
		return NULL;
	page = __rmqueue(order);
	if (page) {
		page->flags &= ~PG_reserved;
		pgalloc_count++;
	}
	return page;
}

noinline void __free_pages(struct page *page, unsigned int order)
{
	pgfree_count++;
	page->slab_cache = NULL;
	page->flags &= ~PG_slab;
	__free_one_page(page, order);
}

noinline unsigned long __get_free_pages(unsigned int order)
{
	struct page *page = __alloc_pages(order);

	return page ? (unsigned long)page_address(page) : 0;
}

noinline unsigned long get_zeroed_page(void)
{
	unsigned long addr = __get_free_pages(0);

	if (addr)
		__memzero_qwords((void *)addr, PAGE_SIZE / 8);
	return addr;
}

noinline void free_pages(unsigned long addr, unsigned int order)
{
	if (addr)
		__free_pages(virt_to_page((void *)addr), order);
}

noinline u64 nr_free_pages(void)
{
	u64 n = 0;

	for (unsigned int o = 0; o < MAX_ORDER; o++)
		n += free_area[o].nr_free << o;
	return n;
}

noinline void mem_init(void)
{
	for (unsigned int o = 0; o < MAX_ORDER; o++) {
		INIT_LIST_HEAD(&free_area[o].free_list);
		free_area[o].nr_free = 0;
	}
	for (unsigned int i = 0; i < NR_POOL_PAGES; i++) {
		INIT_LIST_HEAD(&mem_map[i].lru);
		mem_map[i].flags = PG_reserved;
		mem_map[i].order = -1;
	}
	for (unsigned int i = 0; i < NR_POOL_PAGES; i += 1U << (MAX_ORDER - 1))
		add_to_free_list(&mem_map[i], MAX_ORDER - 1);
}
