// SPDX-License-Identifier: GPL-2.0
/*
 * kerninst.c - /dev/kerninst, the part of ksim's live target that must run in
 * the kernel.  kerninstd (live/daemon.py) owns the device and serves remote
 * clients; this module only does what user space cannot:
 *
 *   - report where things are (text range, per-cpu offsets, task layout);
 *   - read any kernel address without faulting, write only ksim's data heap;
 *   - own a patch area (executable, reachable by rel32 from kernel text) and a
 *     data heap (reachable by disp32), both from module_alloc();
 *   - answer whether text may be touched, asking the kernel itself (the checks
 *     kprobes makes: ftrace, jump labels, static calls, kprobes, the blacklist,
 *     exception and bug tables);
 *   - change kernel or module text, SMP-safely, with the int3 -> sync -> tail ->
 *     sync -> head protocol, after checking the old bytes and those hazards;
 *   - route int3 hits at ksim's own sites to their patches (a DIE_INT3 notifier);
 *   - know who holds what: every live text write, trap route and patch-area or
 *     heap block belongs to one owner (a client session, or a kept owner that
 *     outlives kerninstd), and no owner may change what another holds;
 *   - undo an owner's text when its session ends or the device is closed, and
 *     every text byte it changed on unload, newest first.
 *
 * The ABI is in kerninst.h.  Written for Linux 6.1 x86-64 (Debian 12).
 */
#define pr_fmt(fmt) "kerninst: " fmt

#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/miscdevice.h>
#include <linux/fs.h>
#include <linux/uaccess.h>
#include <linux/kprobes.h>
#include <linux/kdebug.h>
#include <linux/mutex.h>
#include <linux/slab.h>
#include <linux/mm.h>
#include <linux/sched.h>
#include <linux/smp.h>
#include <linux/percpu.h>
#include <linux/rcupdate.h>
#include <linux/string.h>
#include <linux/bug.h>
#include <linux/notifier.h>
#include <linux/list.h>
#include <linux/hashtable.h>
#include <linux/rculist.h>
#include <linux/moduleparam.h>
#include <asm/current.h>
#include <asm/smp.h>
#include <asm/sync_core.h>
#include <asm/ptrace.h>
#include <asm/unaligned.h>

#include "kerninst.h"

#define KI_CODE_SIZE (1UL << 20)	/* patch area */
#define KI_DATA_SIZE (1UL << 20)	/* data heap */
#define KI_INT3 0xcc
#define KI_JMP32 0xe9
#define KI_JMP8 0xeb
/*
 * How far before a range a kprobe can still cover it: an optimized kprobe
 * replaces its instruction with a 5-byte jmp (JMP32_INSN_SIZE,
 * arch/x86/include/asm/text-patching.h), so one at addr - 4 reaches addr.
 */
#define KI_OPTPROBE_REACH 4

/*
 * Functions the kernel does not export to modules.  They are found through
 * kallsyms_lookup_name, itself unexported since 5.7 (commit 0bd476e6c671), whose
 * address a kprobe registered by name reveals (kernel/kprobes.c resolves
 * symbol_name with kallsyms for us).
 */
typedef unsigned long (*ki_lookup_fn)(const char *name);
static ki_lookup_fn ki_lookup;
static void *(*ki_text_poke)(void *addr, const void *opcode, size_t len);
static struct mutex *ki_text_mutex;
static void *(*ki_module_alloc)(unsigned long size);
static void (*ki_module_memfree)(void *region);
static int (*ki_set_memory_ro)(unsigned long addr, int numpages);
static int (*ki_set_memory_rw)(unsigned long addr, int numpages);
static int (*ki_set_memory_x)(unsigned long addr, int numpages);
static int (*ki_set_memory_nx)(unsigned long addr, int numpages);

/*
 * The kernel's own answers to "may this text be touched?": the checks of
 * check_kprobe_address_safe() (kernel/kprobes.c) and, for the exception
 * tables, of x86 optprobes' can_optimize() (arch/x86/kernel/kprobes/opt.c).
 * None is exported.  Each is optional at load: a missing one is named in
 * dmesg, answered as KERNINST_HAZARD_UNKNOWN, and makes every text poke fail
 * closed (-EPERM) except restores.
 */
static unsigned long (*ki_ftrace_location_range)(unsigned long start, unsigned long end);
static void (*ki_jump_label_lock)(void);
static void (*ki_jump_label_unlock)(void);
static int (*ki_jump_label_text_reserved)(void *start, void *end);
static int (*ki_static_call_text_reserved)(void *start, void *end);
static struct kprobe *(*ki_get_kprobe)(void *addr);
static bool (*ki_within_kprobe_blacklist)(unsigned long addr);
static const struct exception_table_entry *(*ki_search_exception_tables)(unsigned long addr);
static struct bug_entry *(*ki_find_bug)(unsigned long bugaddr);
static struct module *(*ki_module_text_address)(unsigned long addr);

static const struct {
	const char *name;
	void *fn;	/* the pointer above that receives the address */
	u32 hazard;	/* what cannot be checked without it */
} ki_checks[] = {
	{ "ftrace_location_range", &ki_ftrace_location_range, KERNINST_HAZARD_FTRACE },
	{ "jump_label_lock", &ki_jump_label_lock, KERNINST_HAZARD_JUMP_LABEL },
	{ "jump_label_unlock", &ki_jump_label_unlock, KERNINST_HAZARD_JUMP_LABEL },
	{ "jump_label_text_reserved", &ki_jump_label_text_reserved, KERNINST_HAZARD_JUMP_LABEL },
	{ "static_call_text_reserved", &ki_static_call_text_reserved, KERNINST_HAZARD_STATIC_CALL },
	{ "get_kprobe", &ki_get_kprobe, KERNINST_HAZARD_KPROBE },
	{ "within_kprobe_blacklist", &ki_within_kprobe_blacklist, KERNINST_HAZARD_BLACKLIST },
	{ "search_exception_tables", &ki_search_exception_tables, KERNINST_HAZARD_EXTABLE },
	{ "find_bug", &ki_find_bug, KERNINST_HAZARD_BUG | KERNINST_HAZARD_WARN },
	{ "__module_text_address", &ki_module_text_address, KERNINST_HAZARD_NOT_TEXT },
};
static u32 ki_unchecked;	/* hazards some check of which is missing */

static unsigned long ki_text_start, ki_text_end;
static u8 *ki_code;	/* patch area */
static u8 *ki_data;	/* data heap */

/* Sections whose code runs where an int3 or a jump into module memory is fatal. */
static const char *const ki_forbidden[][2] = {
	{ "__entry_text_start", "__entry_text_end" },
	{ "__noinstr_text_start", "__noinstr_text_end" },
	{ "__kprobes_text_start", "__kprobes_text_end" },
};
static unsigned long ki_forbidden_range[ARRAY_SIZE(ki_forbidden)][2];

/*
 * Kernel memory one client may pin: trap routes and live text writes at once.
 * The tables have no fixed size; these bound them, and may be changed at run
 * time (/sys/module/kerninst/parameters/).  A request that would pass one is
 * refused with -ENOSPC before anything changes.
 */
static unsigned int max_routes = KERNINST_MAX_ROUTES;
module_param(max_routes, uint, 0644);
MODULE_PARM_DESC(max_routes, "trap routes at once");
static unsigned int max_splices = KERNINST_MAX_SPLICES;
module_param(max_splices, uint, 0644);
MODULE_PARM_DESC(max_splices, "live text writes at once");

/*
 * Who holds what.  An owner stands for a client session of kerninstd; a kept
 * owner has a name and outlives the session and kerninstd itself.
 */
struct ki_owner {
	struct list_head node;		/* ki_owners */
	u64 id;
	u32 flags;			/* KERNINST_OWNER_* */
	char name[KERNINST_NAME_LEN];	/* a kept owner's */
};
static LIST_HEAD(ki_owners);
static u64 ki_next_owner = 1;

/*
 * Trap routes: site -> patch, in a hash table keyed by site, so that the int3
 * notifier finds one in O(1) however many there are.  The notifier runs in
 * NMI-like context (exc_int3 calls it under irqentry_nmi_enter with interrupts
 * off, arch/x86/kernel/traps.c) and reads the table under RCU only: a route is
 * published with hash_add_rcu (its fields set before it is linked) and retired
 * with hash_del_rcu and then a sync of every CPU (ki_sync: the IPI cannot
 * complete while a CPU is still in the interrupts-off handler), after which it
 * may be freed or reused.  Writers hold ki_lock.
 */
#define KI_ROUTE_BITS 14	/* buckets: chains of ~4 at max_routes' default */
struct ki_route {
	struct hlist_node hnode;	/* ki_routes */
	struct list_head node;		/* a batch being retired */
	unsigned long site;
	unsigned long patch;
	struct ki_owner *owner;		/* NULL: a multi-byte poke's temporary route */
};
static DEFINE_HASHTABLE(ki_routes, KI_ROUTE_BITS);
static unsigned int ki_nroutes;	/* owned routes; temporary ones are not counted */
static atomic_t ki_trap_hits = ATOMIC_INIT(0);

/*
 * The splice log: every live text write made through the device, oldest
 * first, with its owner, so that a drop or unload undoes them newest first.  A
 * write that restores a record's original bytes removes the record.  Each
 * record carries the temporary route its multi-byte pokes use, so that an undo
 * never needs memory it might not get.
 */
struct ki_splice {
	struct list_head node;		/* ki_splices */
	struct ki_owner *owner;
	unsigned long addr;
	u32 len;
	u8 orig[KERNINST_MAX_TEXT_WRITE];
	u8 cur[KERNINST_MAX_TEXT_WRITE];
	struct ki_route bp;
};
static LIST_HEAD(ki_splices);
static unsigned int ki_nsplices;

/*
 * Blocks of the patch area and the data heap, as kerninstd allocated them.  A
 * freed patch block stays here, held by no one, until QUIESCE has waited out
 * the tasks that may still run in it.
 */
struct ki_block {
	struct list_head node;		/* ki_blocks */
	struct ki_owner *owner;		/* NULL: freed patch code, not reusable yet */
	unsigned long addr;
	unsigned long size;
	u32 region;			/* KERNINST_REGION_* */
};
static LIST_HEAD(ki_blocks);

/* Serialises every command (and unload) against each other; nests outside text_mutex. */
static DEFINE_MUTEX(ki_lock);

/* ------------------------------------------------------------------------- */
/* symbol resolution                                                          */

static int ki_find_lookup(void)
{
	struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };
	int ret = register_kprobe(&kp);

	if (ret < 0) {
		pr_err("cannot locate kallsyms_lookup_name (register_kprobe: %d)\n", ret);
		return ret;
	}
	ki_lookup = (ki_lookup_fn)kp.addr;
	unregister_kprobe(&kp);
	return 0;
}

static int ki_resolve(const char *name, void *out)
{
	unsigned long addr = ki_lookup(name);

	if (!addr) {
		pr_err("kernel symbol %s not found\n", name);
		return -ENOENT;
	}
	*(unsigned long *)out = addr;
	return 0;
}

static int ki_resolve_all(void)
{
	int ret = 0;
	size_t i;

	ret |= ki_resolve("text_poke", &ki_text_poke);
	ret |= ki_resolve("text_mutex", &ki_text_mutex);
	ret |= ki_resolve("module_alloc", &ki_module_alloc);
	ret |= ki_resolve("module_memfree", &ki_module_memfree);
	ret |= ki_resolve("set_memory_ro", &ki_set_memory_ro);
	ret |= ki_resolve("set_memory_rw", &ki_set_memory_rw);
	ret |= ki_resolve("set_memory_x", &ki_set_memory_x);
	ret |= ki_resolve("set_memory_nx", &ki_set_memory_nx);
	ret |= ki_resolve("_stext", &ki_text_start);
	ret |= ki_resolve("_etext", &ki_text_end);
	for (i = 0; i < ARRAY_SIZE(ki_forbidden); i++) {
		ret |= ki_resolve(ki_forbidden[i][0], &ki_forbidden_range[i][0]);
		ret |= ki_resolve(ki_forbidden[i][1], &ki_forbidden_range[i][1]);
	}
	if (ret)
		return -ENOENT;
	for (i = 0; i < ARRAY_SIZE(ki_checks); i++) {
		unsigned long addr = ki_lookup(ki_checks[i].name);

		*(unsigned long *)ki_checks[i].fn = addr;
		if (!addr) {
			pr_warn("hazard check unavailable: kernel symbol %s not found; "
				"text pokes will be refused\n", ki_checks[i].name);
			ki_unchecked |= ki_checks[i].hazard;
		}
	}
	/* The jump-label lock and its check go together (jump_label_text_reserved's callers hold it). */
	if (ki_unchecked & KERNINST_HAZARD_JUMP_LABEL) {
		ki_jump_label_lock = NULL;
		ki_jump_label_unlock = NULL;
		ki_jump_label_text_reserved = NULL;
	}
	return 0;
}

/* ------------------------------------------------------------------------- */
/* regions                                                                    */

static bool ki_in(unsigned long addr, size_t len, unsigned long start, unsigned long end)
{
	return addr >= start && len <= end - start && addr - start <= end - start - len;
}

/*
 * Core kernel text: _stext.._etext, which is what core_kernel_text()
 * (kernel/extable.c) accepts once init text has been freed.
 */
static bool ki_core_text(unsigned long addr, size_t len)
{
	return ki_in(addr, len, ki_text_start, ki_text_end);
}

/*
 * The live module whose text holds all of [addr, addr + len), or NULL.  The
 * caller has preemption disabled: __module_text_address requires it
 * (kernel/module/main.c), and it keeps the module from being freed meanwhile.
 */
static struct module *ki_module_text(unsigned long addr, size_t len)
{
	struct module *mod;

	if (!ki_module_text_address || !len || addr + len - 1 < addr)
		return NULL;
	mod = ki_module_text_address(addr);
	if (!mod || mod != ki_module_text_address(addr + len - 1) ||
	    mod->state != MODULE_STATE_LIVE)
		return NULL;
	return mod;
}

/* Text that pokes and trap sites may touch: core kernel text, or a live module's text but ours. */
static bool ki_in_text(unsigned long addr, size_t len)
{
	struct module *mod;

	if (ki_core_text(addr, len))
		return true;
	preempt_disable();
	mod = ki_module_text(addr, len);
	preempt_enable();
	return mod && mod != THIS_MODULE;
}

static bool ki_in_code(unsigned long addr, size_t len)
{
	return ki_in(addr, len, (unsigned long)ki_code, (unsigned long)ki_code + KI_CODE_SIZE);
}

static bool ki_in_data(unsigned long addr, size_t len)
{
	return ki_in(addr, len, (unsigned long)ki_data, (unsigned long)ki_data + KI_DATA_SIZE);
}

/*
 * The CPU's own canonical-address rule, from the paging mode in use.  The
 * kernel's check in copy_from_kernel_nofault_allowed (arch/x86/mm/maccess.c)
 * uses boot_cpu_data.x86_virt_bits, which is 57 when the CPU offers LA57 even
 * if the kernel runs 4-level paging; a non-canonical access then raises #GP and
 * ex_handler_uaccess WARNs.  __VIRTUAL_MASK_SHIFT follows pgtable_l5_enabled().
 */
static bool ki_canonical(unsigned long addr)
{
	unsigned int shift = 64 - (__VIRTUAL_MASK_SHIFT + 1);

	return (unsigned long)((long)(addr << shift) >> shift) == addr;
}

/*
 * Code where an int3 or a jump into module memory is fatal or recursive: the
 * entry, noinstr and kprobes sections, the kprobes blacklist (NOKPROBE_SYMBOL
 * functions, kernel/kprobes.c, which also covers modules' own blacklists), and
 * kerninst itself (its int3 notifier and its poke path).
 */
static bool ki_blacklisted(unsigned long addr, size_t len, struct module *mod)
{
	size_t i, k;

	if (mod == THIS_MODULE)
		return true;
	for (i = 0; i < ARRAY_SIZE(ki_forbidden_range); i++)
		if (addr < ki_forbidden_range[i][1] && addr + len > ki_forbidden_range[i][0])
			return true;
	if (ki_within_kprobe_blacklist)
		for (k = 0; k < len; k++)
			if (ki_within_kprobe_blacklist(addr + k))
				return true;
	return false;
}

/*
 * jump_label_text_reserved() is called with the jump-label lock held (as
 * check_kprobe_address_safe does): a module's jump entries are sorted under it
 * while the module comes up (jump_label_add_module, kernel/jump_label.c).  It
 * nests outside text_mutex, as in jump_label_update -> text_poke_bp.
 */
static void ki_hazard_lock(void)
{
	if (ki_jump_label_lock)
		ki_jump_label_lock();
}

static void ki_hazard_unlock(void)
{
	if (ki_jump_label_unlock)
		ki_jump_label_unlock();
}

/*
 * Why the kernel relies on [addr, addr + len) staying as it is: the checks of
 * check_kprobe_address_safe() (kernel/kprobes.c) over the whole range, plus
 * kprobes whose optimized jump would reach into it and, as x86 optprobes
 * refuse to move them (can_optimize, arch/x86/kernel/kprobes/opt.c),
 * instructions with an exception-table entry.  The exception and bug tables
 * are keyed by an instruction's first byte, so every byte is asked.  The
 * caller holds ki_hazard_lock().
 */
static u32 ki_text_hazards(unsigned long addr, u32 len)
{
	unsigned long end = addr + len - 1, a;
	const struct bug_entry *bug;
	struct module *mod = NULL;
	u32 h = 0;

	if (!len || len > KERNINST_MAX_TEXT_WRITE || end < addr)
		return KERNINST_HAZARD_NOT_TEXT;
	/* Like kprobes: the module cannot go away while preemption is off. */
	preempt_disable();
	if (!ki_core_text(addr, len)) {
		mod = ki_module_text(addr, len);
		if (!mod) {
			h = KERNINST_HAZARD_NOT_TEXT;
			if (ki_unchecked & KERNINST_HAZARD_NOT_TEXT)
				h |= KERNINST_HAZARD_UNKNOWN;
			goto out;
		}
	}
	if (ki_blacklisted(addr, len, mod))
		h |= KERNINST_HAZARD_BLACKLIST;
	/* The end is inclusive in these three (lookup_rec, addr_conflict). */
	if (ki_ftrace_location_range && ki_ftrace_location_range(addr, end))
		h |= KERNINST_HAZARD_FTRACE;
	if (ki_jump_label_text_reserved && ki_jump_label_text_reserved((void *)addr, (void *)end))
		h |= KERNINST_HAZARD_JUMP_LABEL;
	if (ki_static_call_text_reserved && ki_static_call_text_reserved((void *)addr, (void *)end))
		h |= KERNINST_HAZARD_STATIC_CALL;
	/* get_kprobe walks an RCU hash list: preemption off is its read-side section. */
	if (ki_get_kprobe)
		for (a = addr - KI_OPTPROBE_REACH; a <= end; a++)
			if (ki_get_kprobe((void *)a)) {
				h |= KERNINST_HAZARD_KPROBE;
				break;
			}
	for (a = addr; a <= end; a++) {
		if (ki_search_exception_tables && ki_search_exception_tables(a))
			h |= KERNINST_HAZARD_EXTABLE;
		bug = ki_find_bug ? ki_find_bug(a) : NULL;
		if (bug)
			h |= bug->flags & BUGFLAG_WARNING ? KERNINST_HAZARD_WARN : KERNINST_HAZARD_BUG;
	}
	if (ki_unchecked)
		h |= KERNINST_HAZARD_UNKNOWN;
out:
	preempt_enable();
	return h;
}

/* ------------------------------------------------------------------------- */
/* trap dispatch                                                              */

static int ki_die_notify(struct notifier_block *nb, unsigned long val, void *data)
{
	struct die_args *args = data;
	struct pt_regs *regs = args->regs;
	struct ki_route *r;
	unsigned long site;
	int ret = NOTIFY_DONE;

	if (val != DIE_INT3 || !regs || user_mode(regs))
		return NOTIFY_DONE;
	/* int3 is a trap: ip already points past the one-byte instruction. */
	site = regs->ip - 1;
	rcu_read_lock();
	hash_for_each_possible_rcu(ki_routes, r, hnode, site) {
		if (r->site == site) {
			regs->ip = r->patch;
			atomic_inc(&ki_trap_hits);
			ret = NOTIFY_STOP;
			break;
		}
	}
	rcu_read_unlock();
	return ret;
}

static struct notifier_block ki_die_nb = {
	.notifier_call = ki_die_notify,
	.priority = INT_MAX,
};

static void ki_do_sync_core(void *info)
{
	sync_core();
}

/*
 * Serialise every CPU: after this returns, no CPU executes stale instruction
 * bytes and none is still inside the int3 handler (the IPI waits for
 * interrupts to be enabled again).  The same as text_poke_sync(),
 * arch/x86/kernel/alternative.c.
 */
static void ki_sync(void)
{
	on_each_cpu(ki_do_sync_core, NULL, 1);
}

/* The owned route at site; caller holds ki_lock (temporary routes live only inside a poke). */
static struct ki_route *ki_route_at(unsigned long site)
{
	struct ki_route *r;

	hash_for_each_possible(ki_routes, r, hnode, site)
		if (r->site == site)
			return r;
	return NULL;
}

static void ki_route_publish(struct ki_route *r, unsigned long site, unsigned long patch,
			     struct ki_owner *owner)
{
	r->site = site;
	r->patch = patch;
	r->owner = owner;
	hash_add_rcu(ki_routes, &r->hnode, site);
}

static void ki_route_retire(struct ki_route *r)
{
	hash_del_rcu(&r->hnode);
	ki_sync();
	kfree(r);
	ki_nroutes--;
}

/*
 * Retire the owned routes @match selects, all with one sync; the caller holds
 * ki_lock.  Returns how many went.
 */
static unsigned int ki_routes_retire(bool (*match)(const struct ki_route *r, const void *arg),
				     const void *arg)
{
	struct ki_route *r, *next;
	struct hlist_node *tmp;
	LIST_HEAD(gone);
	unsigned int n = 0;
	int bkt;

	hash_for_each_safe(ki_routes, bkt, tmp, r, hnode) {
		if (!match(r, arg))
			continue;
		hash_del_rcu(&r->hnode);
		list_add(&r->node, &gone);
		n++;
	}
	if (!n)
		return 0;
	ki_sync();
	list_for_each_entry_safe(r, next, &gone, node)
		kfree(r);
	ki_nroutes -= n;
	return n;
}

static bool ki_route_of(const struct ki_route *r, const void *owner)
{
	return r->owner == owner;
}

static bool ki_route_any(const struct ki_route *r, const void *unused)
{
	return true;
}

static bool ki_route_within(const struct ki_route *r, const void *mod)
{
	return within_module(r->site, (struct module *)mod);
}

/* Owned routes at a byte of [addr, addr + len). */
static unsigned int ki_routes_in(unsigned long addr, u32 len)
{
	unsigned int n = 0;
	u32 i;

	for (i = 0; i < len; i++)
		n += !!ki_route_at(addr + i);
	return n;
}

/* ------------------------------------------------------------------------- */
/* owners and blocks                                                          */

static bool ki_overlaps(unsigned long a, unsigned long alen, unsigned long b, unsigned long blen)
{
	return a < b + blen && b < a + alen;
}

static struct ki_owner *ki_owner_find(u64 id)
{
	struct ki_owner *o;

	list_for_each_entry(o, &ki_owners, node)
		if (o->id == id)
			return o;
	return NULL;
}

static struct ki_owner *ki_owner_kept(const char *name)
{
	struct ki_owner *o;

	list_for_each_entry(o, &ki_owners, node)
		if ((o->flags & KERNINST_OWNER_KEPT) && !strcmp(o->name, name))
			return o;
	return NULL;
}

/*
 * Whether an owner other than @o holds a byte of [addr, addr + len): a live
 * write of its overlaps the range, or a trap route of its sits in it.  Two
 * owners' ranges never overlap, so at most one other owner can.
 */
static bool ki_text_held(struct ki_owner *o, unsigned long addr, u32 len)
{
	struct ki_splice *s;
	struct ki_route *r;
	u32 i;

	list_for_each_entry(s, &ki_splices, node)
		if (s->owner != o && ki_overlaps(s->addr, s->len, addr, len))
			return true;
	for (i = 0; i < len; i++) {
		r = ki_route_at(addr + i);
		if (r && r->owner != o)
			return true;
	}
	return false;
}

/*
 * Whether [addr, addr + len) lies in one block of @o in @region: 0; else
 * -EADDRINUSE when another owner's block overlaps it, -ERANGE otherwise.
 */
static int ki_check_block(struct ki_owner *o, u32 region, unsigned long addr, unsigned long len)
{
	struct ki_block *b;
	int ret = -ERANGE;

	list_for_each_entry(b, &ki_blocks, node) {
		if (b->region != region || !ki_overlaps(b->addr, b->size, addr, len))
			continue;
		if (b->owner && b->owner != o)
			return -EADDRINUSE;
		if (b->owner == o && ki_in(addr, len, b->addr, b->addr + b->size))
			ret = 0;
	}
	return ret;
}

static struct ki_block *ki_block_find(u32 region, unsigned long addr)
{
	struct ki_block *b;

	list_for_each_entry(b, &ki_blocks, node)
		if (b->region == region && b->addr == addr)
			return b;
	return NULL;
}

/* Caller holds ki_lock: nothing can be claimed meanwhile. */
static void ki_quiesce_locked(void)
{
	struct ki_block *b, *tmp;

	/* Tasks preempted inside patch code have left it (as optprobes wait, kernel/kprobes.c). */
	synchronize_rcu_tasks();
	list_for_each_entry_safe(b, tmp, &ki_blocks, node) {
		if (b->owner)
			continue;
		list_del(&b->node);
		kfree(b);
	}
}

static void ki_block_free(struct ki_block *b)
{
	if (b->region == KERNINST_REGION_CODE) {
		b->owner = NULL;	/* until QUIESCE */
		return;
	}
	list_del(&b->node);
	kfree(b);
}

/* ------------------------------------------------------------------------- */
/* text poking                                                                */

/*
 * Where a CPU that hits the temporary int3 of a multi-byte write must go: the
 * destination of the jump being written, or of the jump being removed.  Both
 * are correct: ksim's patch code ends by jumping back past the site, so
 * running it is equivalent to running the old bytes and to running the new.
 * (text_poke_bp emulates the new instruction instead; ksim restores arbitrary
 * original instructions, which cannot all be emulated.)
 */
static unsigned long ki_jump_dest(unsigned long addr, const u8 *bytes, u32 len)
{
	if (len >= 5 && bytes[0] == KI_JMP32)
		return addr + 5 + (long)(s32)get_unaligned((const u32 *)(bytes + 1));
	if (len >= 2 && bytes[0] == KI_JMP8)
		return addr + 2 + (long)(s8)bytes[1];
	return 0;
}

static unsigned long ki_int3_dest(unsigned long addr, const u8 *old, const u8 *new, u32 len)
{
	unsigned long dest = ki_jump_dest(addr, new, len);

	if (!dest)
		dest = ki_jump_dest(addr, old, len);
	if (dest && (ki_in_code(dest, 1) || ki_in_text(dest, 1)))
		return dest;
	return 0;
}

/* A jump into the patch area must land in a block of the owner that writes it. */
static int ki_check_jump(struct ki_owner *o, unsigned long addr, const u8 *new, u32 len)
{
	unsigned long dest = ki_jump_dest(addr, new, len);

	if (!dest || !ki_in_code(dest, 1))
		return 0;
	return ki_check_block(o, KERNINST_REGION_CODE, dest, 1);
}

/* Write the patch area (not yet reachable from text).  text_poke maps at most two pages. */
static void ki_poke_code(unsigned long addr, const u8 *new, u32 len)
{
	while (len) {
		u32 chunk = min_t(u32, len, PAGE_SIZE - offset_in_page(addr));

		ki_text_poke((void *)addr, new, chunk);
		addr += chunk;
		new += chunk;
		len -= chunk;
	}
}

/*
 * Change live kernel text, SMP-safely (the protocol of text_poke_bp_batch,
 * arch/x86/kernel/alternative.c, and the Intel SDM's cross-modifying code
 * rules, vol. 3 8.1.3):
 *   1. write int3 over the first byte, sync;
 *   2. write the remaining bytes, sync;
 *   3. write the first byte, sync.
 * While the int3 is in, a CPU that hits it is sent to @dest through @bp, a
 * temporary route the caller provides (so this cannot fail).  A one-byte write
 * is atomic and needs only the final sync.  Caller holds text_mutex and
 * ki_lock; @dest was validated.
 */
static void ki_poke_text(unsigned long addr, const u8 *new, u32 len, unsigned long dest,
			 struct ki_route *bp)
{
	static const u8 int3 = KI_INT3;

	if (len > 1) {
		ki_route_publish(bp, addr, dest, NULL);
		ki_text_poke((void *)addr, &int3, 1);
		ki_sync();
		ki_text_poke((void *)(addr + 1), new + 1, len - 1);
		ki_sync();
	}
	ki_text_poke((void *)addr, new, 1);
	ki_sync();
	if (len > 1) {
		hash_del_rcu(&bp->hnode);
		ki_sync();
	}
}

/*
 * @o's newest live write at [addr, addr + len) whose current bytes are @cur:
 * the record a write of old bytes @cur changes, by the log's rule.
 */
static struct ki_splice *ki_splice_find(struct ki_owner *o, unsigned long addr,
					const u8 *cur, u32 len)
{
	struct ki_splice *s;

	list_for_each_entry_reverse(s, &ki_splices, node)
		if (s->owner == o && s->addr == addr && s->len == len && !memcmp(s->cur, cur, len))
			return s;
	return NULL;
}

/*
 * Log a write of @new through record @s: a write back to the original bytes
 * retires the record; a @fresh one (not yet in the log) joins it otherwise.
 */
static void ki_splice_log(struct ki_splice *s, bool fresh, const u8 *new)
{
	if (!memcmp(s->orig, new, s->len)) {
		if (!fresh) {
			list_del(&s->node);
			ki_nsplices--;
		}
		kfree(s);
		return;
	}
	memcpy(s->cur, new, s->len);
	if (fresh) {
		list_add_tail(&s->node, &ki_splices);
		ki_nsplices++;
	}
}

/*
 * Put a record's original bytes back, whatever hazard appeared since: false
 * (logged) when the text no longer holds what ksim wrote.  The caller holds
 * ki_lock and text_mutex, and removes the record.
 */
static bool ki_unsplice(struct ki_splice *s)
{
	u8 cur[KERNINST_MAX_TEXT_WRITE];
	unsigned long dest = ki_int3_dest(s->addr, s->cur, s->orig, s->len);

	if (copy_from_kernel_nofault(cur, (void *)s->addr, s->len) ||
	    memcmp(cur, s->cur, s->len)) {
		pr_warn("text at %#lx changed behind ksim; left as is\n", s->addr);
		return false;
	}
	if (s->len > 1 && !dest) {
		pr_warn("no int3 destination to restore %#lx; left as is\n", s->addr);
		return false;
	}
	ki_poke_text(s->addr, s->orig, s->len, dest, &s->bp);
	return true;
}

struct ki_write {
	unsigned long addr;
	u32 len;
	bool text;
	unsigned long dest;
	struct ki_splice *rec;		/* the owner's record the write changes, if any */
	struct ki_splice *fresh;	/* reserved for a write that starts a record */
	u8 *old;
	u8 *new;
};

static void ki_free_writes(struct ki_write *w, u32 n)
{
	u32 i;

	for (i = 0; i < n; i++) {
		kfree(w[i].old);
		kfree(w[i].fresh);
	}
	kfree(w);
}

/*
 * Whether @o may make write @w, and what it needs.  Caller holds ki_lock,
 * ki_hazard_lock() and text_mutex, so the answers hold until the write.
 */
static int ki_check_write(struct ki_owner *o, struct ki_write *w)
{
	bool restore;
	int ret;

	if (ki_in_text(w->addr, w->len)) {
		if (w->len > KERNINST_MAX_TEXT_WRITE)
			return -EINVAL;
		if (ki_text_held(o, w->addr, w->len))
			return -EADDRINUSE;
		w->rec = ki_splice_find(o, w->addr, w->old, w->len);
		/* Undo must always work, even where a hazard appeared since (a kprobe nearby). */
		restore = w->rec && !memcmp(w->rec->orig, w->new, w->len);
		if (!restore) {
			if (ki_text_hazards(w->addr, w->len))
				return -EPERM;
			ret = ki_check_jump(o, w->addr, w->new, w->len);
			if (ret)
				return ret;
		}
		w->text = true;
		if (w->len > 1) {
			w->dest = ki_int3_dest(w->addr, w->old, w->new, w->len);
			if (!w->dest)
				return -EINVAL;
			/* A trap route inside a multi-byte write would be overwritten. */
			if (ki_routes_in(w->addr, w->len))
				return -EBUSY;
		}
		return 0;
	}
	if (ki_in_code(w->addr, w->len)) {
		if (w->len > KERNINST_MAX_CODE_WRITE)
			return -EINVAL;
		return ki_check_block(o, KERNINST_REGION_CODE, w->addr, w->len);
	}
	return -ERANGE;
}

/* Every write of the batch checked, and the records it needs counted. */
static int ki_check_batch(struct ki_owner *o, struct ki_write *w, u32 count)
{
	u32 i, j, fresh = 0;
	int ret;

	for (i = 0; i < count; i++) {
		ret = ki_check_write(o, &w[i]);
		if (ret)
			return ret;
		for (j = 0; j < i; j++)
			if (ki_overlaps(w[i].addr, w[i].len, w[j].addr, w[j].len))
				return -EINVAL;	/* overlapping writes in one batch */
		if (w[i].text && !w[i].rec) {
			if (!w[i].fresh)
				return -EINVAL;
			fresh++;
		}
	}
	if (ki_nsplices + fresh > READ_ONCE(max_splices))
		return -ENOSPC;
	return 0;
}

/* Whether memory holds every write's old bytes; on -ESTALE, *failed names the first that differs. */
static int ki_check_old(struct ki_write *w, u32 count, u8 *cur, u32 *failed)
{
	u32 i;

	for (i = 0; i < count; i++) {
		if (copy_from_kernel_nofault(cur, (void *)w[i].addr, w[i].len))
			return -EFAULT;
		if (memcmp(cur, w[i].old, w[i].len)) {
			*failed = i;
			return -ESTALE;
		}
	}
	return 0;
}

/* Apply a checked batch; nothing here can fail. */
static void ki_apply(struct ki_owner *o, struct ki_write *w, u32 count)
{
	struct ki_splice *s;
	u32 i;

	for (i = 0; i < count; i++) {
		if (!w[i].text) {
			ki_poke_code(w[i].addr, w[i].new, w[i].len);
			continue;
		}
		s = w[i].rec;
		if (!s) {
			s = w[i].fresh;
			w[i].fresh = NULL;
			s->owner = o;
			s->addr = w[i].addr;
			s->len = w[i].len;
			memcpy(s->orig, w[i].old, w[i].len);
		}
		ki_poke_text(w[i].addr, w[i].new, w[i].len, w[i].dest, &s->bp);
		ki_splice_log(s, !w[i].rec, w[i].new);
	}
}

static long ki_ioc_poke(struct kerninst_poke __user *uarg)
{
	struct kerninst_poke req;
	struct kerninst_write *uw;
	struct ki_owner *o;
	struct ki_write *w;
	u8 *cur = NULL;
	long ret = 0;
	u32 i;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.count || req.count > KERNINST_MAX_WRITES)
		return -EINVAL;
	uw = memdup_user(u64_to_user_ptr(req.writes), req.count * sizeof(*uw));
	if (IS_ERR(uw))
		return PTR_ERR(uw);
	w = kcalloc(req.count, sizeof(*w), GFP_KERNEL);
	if (!w) {
		kfree(uw);
		return -ENOMEM;
	}
	for (i = 0; i < req.count; i++) {
		w[i].addr = uw[i].address;
		w[i].len = uw[i].len;
		if (!w[i].len || w[i].len > KERNINST_MAX_CODE_WRITE) {
			ret = -EINVAL;
			goto out;
		}
		w[i].old = kmalloc(2 * w[i].len, GFP_KERNEL);
		if (!w[i].old) {
			ret = -ENOMEM;
			goto out;
		}
		w[i].new = w[i].old + w[i].len;
		if (copy_from_user(w[i].old, u64_to_user_ptr(uw[i].old_buf), w[i].len) ||
		    copy_from_user(w[i].new, u64_to_user_ptr(uw[i].new_buf), w[i].len)) {
			ret = -EFAULT;
			goto out;
		}
		/* Reserved before any lock: a write that may go into text may start a record. */
		if (w[i].len <= KERNINST_MAX_TEXT_WRITE) {
			w[i].fresh = kzalloc(sizeof(*w[i].fresh), GFP_KERNEL);
			if (!w[i].fresh) {
				ret = -ENOMEM;
				goto out;
			}
		}
	}
	cur = kmalloc(KERNINST_MAX_CODE_WRITE, GFP_KERNEL);
	if (!cur) {
		ret = -ENOMEM;
		goto out;
	}

	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	if (!o) {
		ret = -ESRCH;
		goto unlock_owner;
	}
	ki_hazard_lock();
	mutex_lock(ki_text_mutex);
	/* All or nothing: every write checked, every record reserved, every old byte compared. */
	ret = ki_check_batch(o, w, req.count);
	if (!ret)
		ret = ki_check_old(w, req.count, cur, &req.failed_index);
	if (!ret)
		ki_apply(o, w, req.count);
	mutex_unlock(ki_text_mutex);
	ki_hazard_unlock();
unlock_owner:
	mutex_unlock(&ki_lock);
	if (ret == -ESTALE && copy_to_user(uarg, &req, sizeof(req)))
		ret = -EFAULT;
out:
	kfree(cur);
	kfree(uw);
	ki_free_writes(w, req.count);
	return ret;
}

/* ------------------------------------------------------------------------- */
/* owners                                                                     */

/*
 * Undo everything @o holds: its text writes newest first, then its trap
 * routes, then its blocks; then forget it.  When some text no longer holds
 * what @o wrote (changed behind ksim), that text, the routes and the blocks
 * stay: @o becomes a kept orphan, listed by STATE, whose blocks are never
 * handed out again.  Caller holds ki_lock.
 */
static int ki_owner_drop(struct ki_owner *o)
{
	struct ki_splice *s, *tmp;
	struct ki_block *b, *btmp;
	unsigned int left = 0;

	mutex_lock(ki_text_mutex);
	list_for_each_entry_safe_reverse(s, tmp, &ki_splices, node) {
		if (s->owner != o)
			continue;
		if (!ki_unsplice(s)) {
			left++;
			continue;
		}
		list_del(&s->node);
		ki_nsplices--;
		kfree(s);
	}
	mutex_unlock(ki_text_mutex);
	if (left) {
		o->flags |= KERNINST_OWNER_KEPT | KERNINST_OWNER_ORPHAN;
		if (!o->name[0])
			snprintf(o->name, sizeof(o->name), "orphan-%llu", o->id);
		pr_err("owner %llu: %u text writes could not be undone; kept as %s with its routes and blocks\n",
		       o->id, left, o->name);
		return -ESTALE;
	}
	ki_routes_retire(ki_route_of, o);
	list_for_each_entry_safe(b, btmp, &ki_blocks, node)
		if (b->owner == o)
			ki_block_free(b);
	list_del(&o->node);
	kfree(o);
	return 0;
}

/* Everything @from holds now belongs to @to. */
static void ki_owner_move(struct ki_owner *from, struct ki_owner *to)
{
	struct ki_splice *s;
	struct ki_route *r;
	struct ki_block *b;
	int bkt;

	list_for_each_entry(s, &ki_splices, node)
		if (s->owner == from)
			s->owner = to;
	hash_for_each(ki_routes, bkt, r, hnode)
		if (r->owner == from)
			r->owner = to;
	list_for_each_entry(b, &ki_blocks, node)
		if (b->owner == from)
			b->owner = to;
}

static long ki_ioc_owner_new(struct kerninst_owner __user *uarg)
{
	struct kerninst_owner req = {};
	struct ki_owner *o = kzalloc(sizeof(*o), GFP_KERNEL);

	if (!o)
		return -ENOMEM;
	mutex_lock(&ki_lock);
	o->id = ki_next_owner++;
	list_add_tail(&o->node, &ki_owners);
	req.id = o->id;
	mutex_unlock(&ki_lock);
	/* A lost answer leaves an owner that holds nothing; it goes when the device is closed. */
	return copy_to_user(uarg, &req, sizeof(req)) ? -EFAULT : 0;
}

static long ki_owner_keep(struct ki_owner *o, const char *name)
{
	struct ki_owner *other;

	if (!*name) {
		if (o->flags & KERNINST_OWNER_ORPHAN)
			return -EBUSY;
		o->flags &= ~KERNINST_OWNER_KEPT;
		o->name[0] = 0;
		return 0;
	}
	other = ki_owner_kept(name);
	if (other && other != o)
		return -EEXIST;
	strscpy(o->name, name, sizeof(o->name));
	o->flags |= KERNINST_OWNER_KEPT;
	return 0;
}

static long ki_owner_adopt(struct ki_owner *o, const char *name)
{
	struct ki_owner *kept = ki_owner_kept(name);

	if (!kept)
		return -ENOENT;
	if (kept == o)
		return 0;
	ki_owner_move(kept, o);
	list_del(&kept->node);
	kfree(kept);
	return 0;
}

static long ki_ioc_owner(unsigned int cmd, struct kerninst_owner __user *uarg)
{
	struct kerninst_owner req;
	struct ki_owner *o;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	req.name[KERNINST_NAME_LEN - 1] = 0;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.id);
	if (!o) {
		ret = -ESRCH;
		goto unlock;
	}
	switch (cmd) {
	case KERNINST_IOC_OWNER_KEEP:
		ret = ki_owner_keep(o, req.name);
		break;
	case KERNINST_IOC_OWNER_ADOPT:
		ret = ki_owner_adopt(o, req.name);
		break;
	case KERNINST_IOC_OWNER_DROP:
		ret = ki_owner_drop(o);
		break;
	default:
		ret = -ENOTTY;
	}
unlock:
	mutex_unlock(&ki_lock);
	return ret;
}

/* ------------------------------------------------------------------------- */
/* blocks                                                                     */

static long ki_ioc_claim(struct kerninst_block __user *uarg)
{
	struct kerninst_block req;
	struct ki_block *b, *other;
	struct ki_owner *o;
	bool in, freed = false;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size)
		return -EINVAL;
	if (req.region == KERNINST_REGION_CODE)
		in = ki_in_code(req.address, req.size);
	else if (req.region == KERNINST_REGION_DATA)
		in = ki_in_data(req.address, req.size);
	else
		return -EINVAL;
	if (!in)
		return -ERANGE;
	b = kzalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	if (!o) {
		ret = -ESRCH;
		goto unlock;
	}
	list_for_each_entry(other, &ki_blocks, node) {
		if (other->region != req.region ||
		    !ki_overlaps(other->addr, other->size, req.address, req.size))
			continue;
		if (other->owner) {
			ret = -EADDRINUSE;
			goto unlock;
		}
		freed = true;
	}
	/* Freed patch code is handed out again only once no task can still run in it. */
	if (freed)
		ki_quiesce_locked();
	b->owner = o;
	b->addr = req.address;
	b->size = req.size;
	b->region = req.region;
	list_add_tail(&b->node, &ki_blocks);
	b = NULL;
unlock:
	mutex_unlock(&ki_lock);
	kfree(b);
	return ret;
}

/* Whether a trap route or a live jump still leads into patch block @b. */
static bool ki_block_reached(const struct ki_block *b)
{
	const struct ki_splice *s;
	struct ki_route *r;
	unsigned long dest;
	int bkt;

	hash_for_each(ki_routes, bkt, r, hnode)
		if (ki_in(r->patch, 1, b->addr, b->addr + b->size))
			return true;
	list_for_each_entry(s, &ki_splices, node) {
		dest = ki_jump_dest(s->addr, s->cur, s->len);
		if (dest && ki_in(dest, 1, b->addr, b->addr + b->size))
			return true;
	}
	return false;
}

static long ki_ioc_free(struct kerninst_block __user *uarg)
{
	struct kerninst_block req;
	struct ki_block *b;
	struct ki_owner *o;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	b = ki_block_find(req.region, req.address);
	if (!o)
		ret = -ESRCH;
	else if (!b || !b->owner)
		ret = -ENOENT;
	else if (b->owner != o)
		ret = -EADDRINUSE;
	else if (b->region == KERNINST_REGION_CODE && ki_block_reached(b))
		ret = -EBUSY;
	else
		ki_block_free(b);
	mutex_unlock(&ki_lock);
	return ret;
}

/* ------------------------------------------------------------------------- */
/* the log                                                                    */

static int ki_state_owners(struct kerninst_owner __user *out, u32 room, u32 *n)
{
	struct kerninst_owner e;
	struct ki_owner *o;

	*n = 0;
	list_for_each_entry(o, &ki_owners, node) {
		if (*n < room) {
			memset(&e, 0, sizeof(e));
			e.id = o->id;
			e.flags = o->flags;
			strscpy(e.name, o->name, sizeof(e.name));
			if (copy_to_user(&out[*n], &e, sizeof(e)))
				return -EFAULT;
		}
		++*n;
	}
	return 0;
}

static int ki_state_splices(struct kerninst_splice __user *out, u32 room, u32 *n)
{
	struct kerninst_splice e;
	struct ki_splice *s;

	*n = 0;
	list_for_each_entry(s, &ki_splices, node) {
		if (*n < room) {
			memset(&e, 0, sizeof(e));
			e.owner = s->owner->id;
			e.address = s->addr;
			e.len = s->len;
			memcpy(e.orig, s->orig, s->len);
			memcpy(e.cur, s->cur, s->len);
			if (copy_to_user(&out[*n], &e, sizeof(e)))
				return -EFAULT;
		}
		++*n;
	}
	return 0;
}

static int ki_state_routes(struct kerninst_trap __user *out, u32 room, u32 *n)
{
	struct kerninst_trap e;
	struct ki_route *r;
	int bkt;

	*n = 0;
	hash_for_each(ki_routes, bkt, r, hnode) {
		if (*n < room) {
			e = (struct kerninst_trap){ .site = r->site, .patch = r->patch,
						    .owner = r->owner->id };
			if (copy_to_user(&out[*n], &e, sizeof(e)))
				return -EFAULT;
		}
		++*n;
	}
	return 0;
}

static int ki_state_blocks(struct kerninst_block __user *out, u32 room, u32 *n)
{
	struct kerninst_block e;
	struct ki_block *b;

	*n = 0;
	list_for_each_entry(b, &ki_blocks, node) {
		if (*n < room) {
			e = (struct kerninst_block){ .owner = b->owner ? b->owner->id : 0,
						     .address = b->addr, .size = b->size,
						     .region = b->region };
			if (copy_to_user(&out[*n], &e, sizeof(e)))
				return -EFAULT;
		}
		++*n;
	}
	return 0;
}

static long ki_ioc_state(struct kerninst_state __user *uarg)
{
	struct kerninst_state req;
	int ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	mutex_lock(&ki_lock);
	ret = ki_state_owners(u64_to_user_ptr(req.owners), req.nr_owners, &req.nr_owners);
	if (!ret)
		ret = ki_state_splices(u64_to_user_ptr(req.splices), req.nr_splices, &req.nr_splices);
	if (!ret)
		ret = ki_state_routes(u64_to_user_ptr(req.routes), req.nr_routes, &req.nr_routes);
	if (!ret)
		ret = ki_state_blocks(u64_to_user_ptr(req.blocks), req.nr_blocks, &req.nr_blocks);
	mutex_unlock(&ki_lock);
	if (!ret && copy_to_user(uarg, &req, sizeof(req)))
		ret = -EFAULT;
	return ret;
}

/* ------------------------------------------------------------------------- */
/* other commands                                                             */

static long ki_ioc_read(struct kerninst_mem __user *uarg)
{
	struct kerninst_mem req;
	void *buf;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size || req.size > KERNINST_MAX_IO)
		return -EINVAL;
	if (req.address + req.size < req.address || !ki_canonical(req.address) ||
	    !ki_canonical(req.address + req.size - 1))
		return -EFAULT;
	buf = kmalloc(req.size, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	/* Returns -EFAULT (no oops) for unmapped or user addresses: mm/maccess.c. */
	if (copy_from_kernel_nofault(buf, (void *)(unsigned long)req.address, req.size))
		ret = -EFAULT;
	else if (copy_to_user(u64_to_user_ptr(req.buf), buf, req.size))
		ret = -EFAULT;
	kfree(buf);
	return ret;
}

static long ki_ioc_write(struct kerninst_mem __user *uarg)
{
	struct kerninst_mem req;
	struct ki_owner *o;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size || req.size > KERNINST_MAX_IO)
		return -EINVAL;
	/* Data only: text changes go through the poke protocol. */
	if (!ki_in_data(req.address, req.size))
		return -ERANGE;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	ret = o ? ki_check_block(o, KERNINST_REGION_DATA, req.address, req.size) : -ESRCH;
	if (!ret && copy_from_user((void *)(unsigned long)req.address, u64_to_user_ptr(req.buf),
				   req.size))
		ret = -EFAULT;
	mutex_unlock(&ki_lock);
	return ret;
}

static long ki_ioc_info(void __user *uarg)
{
	struct kerninst_info info = {
		.text_start = ki_text_start,
		.text_end = ki_text_end,
		.code_start = (unsigned long)ki_code,
		.code_size = KI_CODE_SIZE,
		.data_start = (unsigned long)ki_data,
		.data_size = KI_DATA_SIZE,
		/* Per-cpu symbols are offsets from the per-cpu base in GS (zero-based on x86-64). */
		.current_task = (unsigned long)&current_task,
		.cpu_number = (unsigned long)&cpu_number,
		.task_pid_offset = offsetof(struct task_struct, pid),
		.task_pid_size = sizeof(pid_t),
		.nr_cpus = num_online_cpus(),
		.version = KERNINST_ABI_VERSION,
	};

	return copy_to_user(uarg, &info, sizeof(info)) ? -EFAULT : 0;
}

static long ki_ioc_lookup(struct kerninst_lookup __user *uarg)
{
	struct kerninst_lookup req;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	req.name[KERNINST_NAME_LEN - 1] = 0;
	req.address = ki_lookup(req.name);
	if (copy_to_user(uarg, &req, sizeof(req)))
		return -EFAULT;
	return req.address ? 0 : -ENOENT;
}

/* Whether @o may route an int3 at @site to @patch; caller holds ki_lock. */
static int ki_check_trap(struct ki_owner *o, unsigned long site, unsigned long patch)
{
	int ret = 0;

	/* A route is of no use where POKE would refuse the int3 it waits for. */
	ki_hazard_lock();
	if (ki_text_hazards(site, 1))
		ret = -EPERM;
	ki_hazard_unlock();
	if (ret)
		return ret;
	ret = ki_check_block(o, KERNINST_REGION_CODE, patch, 1);
	if (ret)
		return ret;
	if (ki_text_held(o, site, 1))
		return -EADDRINUSE;
	if (ki_route_at(site))
		return -EBUSY;
	if (ki_nroutes >= READ_ONCE(max_routes))
		return -ENOSPC;
	return 0;
}

static long ki_ioc_set_trap(struct kerninst_trap __user *uarg)
{
	struct kerninst_trap req;
	struct ki_route *r;
	struct ki_owner *o;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, 1) || !ki_in_code(req.patch, 1))
		return -ERANGE;
	r = kzalloc(sizeof(*r), GFP_KERNEL);
	if (!r)
		return -ENOMEM;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	ret = o ? ki_check_trap(o, req.site, req.patch) : -ESRCH;
	if (!ret) {
		ki_route_publish(r, req.site, req.patch, o);
		ki_nroutes++;
		r = NULL;
	}
	mutex_unlock(&ki_lock);
	kfree(r);
	return ret;
}

static long ki_ioc_clear_trap(struct kerninst_trap __user *uarg)
{
	struct kerninst_trap req;
	struct ki_owner *o;
	struct ki_route *r;
	u8 byte;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, 1))
		return -ERANGE;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	r = ki_route_at(req.site);
	if (!o)
		ret = -ESRCH;
	else if (!r)
		ret = -ENOENT;
	else if (r->owner != o)
		ret = -EADDRINUSE;
	/* Retiring the route while its int3 is in text would let a hit oops. */
	else if (copy_from_kernel_nofault(&byte, (void *)(unsigned long)req.site, 1))
		ret = -EFAULT;
	else if (byte == KI_INT3)
		ret = -EBUSY;
	else
		ki_route_retire(r);
	mutex_unlock(&ki_lock);
	return ret;
}

static long ki_ioc_hazards(struct kerninst_hazards __user *uarg)
{
	struct kerninst_hazards req;
	struct kerninst_range *r;
	long ret = 0;
	u32 i;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.count || req.count > KERNINST_MAX_RANGES)
		return -EINVAL;
	r = memdup_user(u64_to_user_ptr(req.ranges), req.count * sizeof(*r));
	if (IS_ERR(r))
		return PTR_ERR(r);
	for (i = 0; i < req.count; i++)
		if (!r[i].len || r[i].len > KERNINST_MAX_TEXT_WRITE) {
			ret = -EINVAL;
			goto out;
		}
	ki_hazard_lock();
	for (i = 0; i < req.count; i++) {
		r[i].hazards = ki_text_hazards(r[i].address, r[i].len);
		cond_resched();
	}
	ki_hazard_unlock();
	if (copy_to_user(u64_to_user_ptr(req.ranges), r, req.count * sizeof(*r)))
		ret = -EFAULT;
out:
	kfree(r);
	return ret;
}

static long ki_ioc_quiesce(void)
{
	mutex_lock(&ki_lock);
	ki_quiesce_locked();
	mutex_unlock(&ki_lock);
	return 0;
}

static long ki_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case KERNINST_IOC_VERSION: {
		struct kerninst_version v = { .version = KERNINST_ABI_VERSION };

		return copy_to_user(uarg, &v, sizeof(v)) ? -EFAULT : 0;
	}
	case KERNINST_IOC_INFO:
		return ki_ioc_info(uarg);
	case KERNINST_IOC_READ:
		return ki_ioc_read(uarg);
	case KERNINST_IOC_WRITE:
		return ki_ioc_write(uarg);
	case KERNINST_IOC_POKE:
		return ki_ioc_poke(uarg);
	case KERNINST_IOC_LOOKUP:
		return ki_ioc_lookup(uarg);
	case KERNINST_IOC_SET_TRAP:
		return ki_ioc_set_trap(uarg);
	case KERNINST_IOC_CLEAR_TRAP:
		return ki_ioc_clear_trap(uarg);
	case KERNINST_IOC_HAZARDS:
		return ki_ioc_hazards(uarg);
	case KERNINST_IOC_QUIESCE:
		return ki_ioc_quiesce();
	case KERNINST_IOC_OWNER_NEW:
		return ki_ioc_owner_new(uarg);
	case KERNINST_IOC_OWNER_KEEP:
	case KERNINST_IOC_OWNER_ADOPT:
	case KERNINST_IOC_OWNER_DROP:
		return ki_ioc_owner(cmd, uarg);
	case KERNINST_IOC_CLAIM:
		return ki_ioc_claim(uarg);
	case KERNINST_IOC_FREE:
		return ki_ioc_free(uarg);
	case KERNINST_IOC_STATE:
		return ki_ioc_state(uarg);
	}
	return -ENOTTY;
}

/*
 * One opener at a time: kerninstd allocates inside the patch area and the heap
 * with its own bookkeeping (the module only records the blocks), so a second
 * daemon would pick the same free bytes.
 */
static atomic_t ki_busy = ATOMIC_INIT(0);

static int ki_open(struct inode *inode, struct file *file)
{
	return atomic_cmpxchg(&ki_busy, 0, 1) ? -EBUSY : 0;
}

/*
 * kerninstd is gone (it exited, or was killed): its sessions are over, so
 * every owner that is not kept is dropped, as each session's end would have.
 */
static int ki_release(struct inode *inode, struct file *file)
{
	struct ki_owner *o, *tmp;

	mutex_lock(&ki_lock);
	list_for_each_entry_safe(o, tmp, &ki_owners, node)
		if (!(o->flags & KERNINST_OWNER_KEPT))
			ki_owner_drop(o);
	mutex_unlock(&ki_lock);
	atomic_set(&ki_busy, 0);
	return 0;
}

static const struct file_operations ki_fops = {
	.owner = THIS_MODULE,
	.open = ki_open,
	.release = ki_release,
	.unlocked_ioctl = ki_ioctl,
	.compat_ioctl = NULL,
	.llseek = noop_llseek,
};

static struct miscdevice ki_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = KERNINST_DEVICE,
	.fops = &ki_fops,
	.mode = 0600,
};

/* ------------------------------------------------------------------------- */
/* load and unload                                                            */

static int ki_alloc_regions(void)
{
	ki_code = ki_module_alloc(KI_CODE_SIZE);
	ki_data = ki_module_alloc(KI_DATA_SIZE);
	if (!ki_code || !ki_data)
		return -ENOMEM;
	/* Stray jumps into unused patch space trap instead of running garbage. */
	memset(ki_code, KI_INT3, KI_CODE_SIZE);
	memset(ki_data, 0, KI_DATA_SIZE);
	/* Never writable and executable at once: RO first, then X (STRICT_MODULE_RWX). */
	ki_set_memory_ro((unsigned long)ki_code, KI_CODE_SIZE >> PAGE_SHIFT);
	ki_set_memory_x((unsigned long)ki_code, KI_CODE_SIZE >> PAGE_SHIFT);
	return 0;
}

static void ki_free_regions(void)
{
	if (ki_code) {
		ki_set_memory_nx((unsigned long)ki_code, KI_CODE_SIZE >> PAGE_SHIFT);
		ki_set_memory_rw((unsigned long)ki_code, KI_CODE_SIZE >> PAGE_SHIFT);
		ki_module_memfree(ki_code);
		ki_code = NULL;
	}
	if (ki_data) {
		ki_module_memfree(ki_data);
		ki_data = NULL;
	}
}

/*
 * A module going away takes its text with it: kernel/module/main.c frees it
 * after the MODULE_STATE_GOING notifiers have run.  Forget ksim's writes and
 * trap routes there, as kprobes forgets the probes of a going module
 * (kprobes_module_callback, kernel/kprobes.c).  Nothing is restored: once the
 * module's exit function has run nothing calls its code, and the memory may
 * later hold another module's text, which an undo must never touch.  ki_lock
 * also keeps the module from going while a poke into it is under way.
 */
static int ki_module_notify(struct notifier_block *nb, unsigned long state, void *data)
{
	struct module *mod = data;
	struct ki_splice *s, *tmp;
	unsigned int writes = 0, routes;

	if (state != MODULE_STATE_GOING)
		return NOTIFY_DONE;
	mutex_lock(&ki_lock);
	list_for_each_entry_safe(s, tmp, &ki_splices, node) {
		if (!within_module(s->addr, mod))
			continue;
		list_del(&s->node);
		ki_nsplices--;
		kfree(s);
		writes++;
	}
	routes = ki_routes_retire(ki_route_within, mod);
	mutex_unlock(&ki_lock);
	if (writes || routes)
		pr_info("module %s is going: forgot %u text writes and %u trap routes in its text\n",
			mod->name, writes, routes);
	return NOTIFY_DONE;
}

static struct notifier_block ki_module_nb = {
	.notifier_call = ki_module_notify,
};

/*
 * Undo every live text write, newest first, whoever holds it (only kept
 * owners are left once the device is closed); returns how many could not be.
 */
static unsigned int ki_unsplice_all(void)
{
	struct ki_splice *s, *tmp;
	unsigned int left = 0;

	mutex_lock(ki_text_mutex);
	list_for_each_entry_safe_reverse(s, tmp, &ki_splices, node) {
		if (!ki_unsplice(s))
			left++;
		list_del(&s->node);
		kfree(s);
	}
	ki_nsplices = 0;
	mutex_unlock(ki_text_mutex);
	return left;
}

static void ki_forget_all(void)
{
	struct ki_owner *o, *otmp;
	struct ki_block *b, *btmp;

	ki_routes_retire(ki_route_any, NULL);
	list_for_each_entry_safe(b, btmp, &ki_blocks, node) {
		list_del(&b->node);
		kfree(b);
	}
	list_for_each_entry_safe(o, otmp, &ki_owners, node) {
		list_del(&o->node);
		kfree(o);
	}
}

static int __init ki_init(void)
{
	int ret;

	ret = ki_find_lookup();
	if (ret)
		return ret;
	ret = ki_resolve_all();
	if (ret)
		return ret;
	ret = ki_alloc_regions();
	if (ret)
		goto fail;
	ret = register_die_notifier(&ki_die_nb);
	if (ret)
		goto fail;
	ret = register_module_notifier(&ki_module_nb);
	if (ret) {
		unregister_die_notifier(&ki_die_nb);
		goto fail;
	}
	ret = misc_register(&ki_dev);
	if (ret) {
		unregister_module_notifier(&ki_module_nb);
		unregister_die_notifier(&ki_die_nb);
		goto fail;
	}
	pr_info("abi %d: text %#lx-%#lx, patch area %px+%#lx, data heap %px+%#lx, hazard checks %s\n",
		KERNINST_ABI_VERSION, ki_text_start, ki_text_end,
		ki_code, KI_CODE_SIZE, ki_data, KI_DATA_SIZE,
		ki_unchecked ? "INCOMPLETE (text pokes refused)" : "complete");
	return 0;
fail:
	ki_free_regions();
	return ret;
}

static void __exit ki_exit(void)
{
	unsigned int left, owners = 0;
	struct ki_owner *o;

	/* The device cannot be open here (fops owner pins the module). */
	misc_deregister(&ki_dev);
	unregister_module_notifier(&ki_module_nb);
	mutex_lock(&ki_lock);
	list_for_each_entry(o, &ki_owners, node)
		owners++;
	left = ki_unsplice_all();
	ki_forget_all();
	mutex_unlock(&ki_lock);
	/* atomic_notifier_chain_unregister waits for running notifiers (synchronize_rcu). */
	unregister_die_notifier(&ki_die_nb);
	synchronize_rcu_tasks();
	if (left) {
		/* Text may still jump there: better a leak than a jump into freed memory. */
		pr_err("%u text writes could not be undone; the patch area %px stays allocated\n",
		       left, ki_code);
		ki_code = NULL;
	}
	ki_free_regions();
	pr_info("unloaded (%u kept owners undone, %d trap hits dispatched)\n", owners,
		atomic_read(&ki_trap_hits));
}

module_init(ki_init);
module_exit(ki_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("ksim live-kernel driver: memory access, text poking, trap dispatch");
MODULE_VERSION("3");
