/* mm/slab.c: a small slab allocator: one page per slab, an embedded freelist. */
#include <toy.h>

#define MAX_CACHES 24
struct kmem_cache kmem_caches[MAX_CACHES];
unsigned int nr_kmem_caches;

static const u32 kmalloc_sizes[] = { 32, 64, 128, 256, 512, 1024, 2048 };
static struct kmem_cache *kmalloc_caches[ARRAY_SIZE(kmalloc_sizes)];

noinline struct kmem_cache *kmem_cache_create(const char *name, u32 size, void (*ctor)(void *))
{
	struct kmem_cache *s;

	if (nr_kmem_caches >= MAX_CACHES || size > PAGE_SIZE)
		return NULL;
	s = &kmem_caches[nr_kmem_caches++];
	s->name = name;
	s->size = (size + 7) & ~7U;
	if (s->size < 16)
		s->size = 16;
	s->objs_per_slab = PAGE_SIZE / s->size;
	INIT_LIST_HEAD(&s->slabs_partial);
	INIT_LIST_HEAD(&s->slabs_full);
	s->ctor = ctor;
	return s;
}

/* Take a fresh page and thread every object onto its freelist. */
static noinline struct page *cache_grow(struct kmem_cache *s)
{
	struct page *page = __alloc_pages(0);
	u8 *base;
	void **prev;

	if (!page)
		return NULL;
	page->flags |= PG_slab;
	page->slab_cache = s;
	page->inuse = 0;
	base = page_address(page);
	prev = &page->freelist;
	for (u32 i = 0; i < s->objs_per_slab; i++) {
		*prev = base + i * s->size;
		prev = (void **)(base + i * s->size);
	}
	*prev = NULL;
	list_add_tail(&page->lru, &s->slabs_partial);
	s->nr_slabs++;
	return page;
}

static noinline void *slab_get_obj(struct kmem_cache *s, struct page *page)
{
	void *obj = page->freelist;

	page->freelist = *(void **)obj;
	page->inuse++;
	if (!page->freelist) {
		list_del(&page->lru);
		list_add_tail(&page->lru, &s->slabs_full);
	}
	return obj;
}

noinline void *kmem_cache_alloc(struct kmem_cache *s)
{
	struct page *page;
	void *obj;

	if (list_empty(&s->slabs_partial) && !cache_grow(s))
		return NULL;
	page = container_of(s->slabs_partial.next, struct page, lru);
	obj = slab_get_obj(s, page);
	s->active_objs++;
	s->total_allocs++;
	if (s->ctor)
		s->ctor(obj);
	return obj;
}

noinline void *kmem_cache_zalloc(struct kmem_cache *s)
{
	void *obj = kmem_cache_alloc(s);

	if (obj)
		memset(obj, 0, s->size);
	return obj;
}

static noinline void slab_put_obj(struct kmem_cache *s, struct page *page, void *obj)
{
	bool was_full = page->freelist == NULL;

	*(void **)obj = page->freelist;
	page->freelist = obj;
	page->inuse--;
	if (was_full) {
		list_del(&page->lru);
		list_add_tail(&page->lru, &s->slabs_partial);
	}
	if (!page->inuse) {
		/* An empty slab goes back to the page allocator. */
		list_del(&page->lru);
		s->nr_slabs--;
		__free_pages(page, 0);
	}
}

noinline void kmem_cache_free(struct kmem_cache *s, void *obj)
{
	if (!obj)
		return;
	slab_put_obj(s, virt_to_page(obj), obj);
	s->active_objs--;
	s->total_frees++;
}

noinline unsigned int kmalloc_index(size_t size)
{
	unsigned int i = 0;

	while (i < ARRAY_SIZE(kmalloc_sizes) - 1 && kmalloc_sizes[i] < size)
		i++;
	return i;
}

noinline void *kmalloc(size_t size)
{
	if (size > kmalloc_sizes[ARRAY_SIZE(kmalloc_sizes) - 1])
		return (void *)__get_free_pages(0);
	return kmem_cache_alloc(kmalloc_caches[kmalloc_index(size)]);	/* tail call */
}

noinline void *kzalloc(size_t size)
{
	void *p = kmalloc(size);

	if (p)
		memset(p, 0, size);
	return p;
}

noinline size_t ksize(const void *obj)
{
	struct page *page = virt_to_page(obj);

	if (page->flags & PG_slab)
		return ((struct kmem_cache *)page->slab_cache)->size;
	return PAGE_SIZE;
}

noinline void kfree(const void *obj)
{
	struct page *page;

	if (!obj)
		return;
	page = virt_to_page(obj);
	if (page->flags & PG_slab)
		kmem_cache_free(page->slab_cache, (void *)obj);
	else
		__free_pages(page, 0);
}

noinline void kmem_cache_init(void)
{
	static const char *const names[] = {
		"kmalloc-32", "kmalloc-64", "kmalloc-128", "kmalloc-256",
		"kmalloc-512", "kmalloc-1k", "kmalloc-2k",
	};

	for (unsigned int i = 0; i < ARRAY_SIZE(kmalloc_sizes); i++)
		kmalloc_caches[i] = kmem_cache_create(names[i], kmalloc_sizes[i], NULL);
}

noinline u64 slab_checksum(u64 h)
{
	for (unsigned int i = 0; i < nr_kmem_caches; i++) {
		struct kmem_cache *s = &kmem_caches[i];
		h = ksim_mix64(h, s->active_objs);
		h = ksim_mix64(h, s->total_allocs);
		h = ksim_mix64(h, s->total_frees);
		h = ksim_mix64(h, s->nr_slabs);
	}
	return h;
}
