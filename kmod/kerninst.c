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
 *   - on unload, restore every text byte it changed, in reverse order.
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
 * Trap routes: site -> patch.  Readers are the int3 notifier, in NMI-like
 * context (exc_int3 runs it under irqentry_nmi_enter with interrupts off,
 * arch/x86/kernel/traps.c), so they take no lock: a slot is published by
 * storing patch, then site with release semantics; it is retired by clearing
 * site and then waiting for every CPU to leave the handler (an IPI to all CPUs
 * cannot complete while one of them is still in the interrupts-off handler).
 * Writers hold ki_lock.
 */
struct ki_trap {
	unsigned long site;
	unsigned long patch;
	bool transient;		/* only while a multi-byte poke has its int3 in */
};
static struct ki_trap ki_traps[KERNINST_MAX_TRAPS];
static atomic_t ki_trap_hits = ATOMIC_INIT(0);

/*
 * Every live text write made through the device, oldest first, so that unload
 * can undo them newest first.  A write that restores a record's original
 * bytes removes the record.
 */
struct ki_splice {
	unsigned long addr;
	u32 len;
	u8 orig[KERNINST_MAX_TEXT_WRITE];
	u8 cur[KERNINST_MAX_TEXT_WRITE];
};
static struct ki_splice ki_splices[KERNINST_MAX_SPLICES];
static unsigned int ki_nsplices;

/* Serialises every command (and unload) against each other. */
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
	unsigned long site;
	int i;

	if (val != DIE_INT3 || !regs || user_mode(regs))
		return NOTIFY_DONE;
	/* int3 is a trap: ip already points past the one-byte instruction. */
	site = regs->ip - 1;
	for (i = 0; i < KERNINST_MAX_TRAPS; i++) {
		if (smp_load_acquire(&ki_traps[i].site) == site) {
			regs->ip = READ_ONCE(ki_traps[i].patch);
			atomic_inc(&ki_trap_hits);
			return NOTIFY_STOP;
		}
	}
	return NOTIFY_DONE;
}

static struct notifier_block ki_die_nb = {
	.notifier_call = ki_die_notify,
	.priority = INT_MAX,
};

static struct ki_trap *ki_trap_find(unsigned long site)
{
	int i;

	for (i = 0; i < KERNINST_MAX_TRAPS; i++)
		if (ki_traps[i].site == site)
			return &ki_traps[i];
	return NULL;
}

static struct ki_trap *ki_trap_add(unsigned long site, unsigned long patch, bool transient)
{
	struct ki_trap *t = ki_trap_find(0);

	if (!t)
		return NULL;
	t->transient = transient;
	WRITE_ONCE(t->patch, patch);
	smp_store_release(&t->site, site);
	return t;
}

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

static void ki_trap_retire(struct ki_trap *t)
{
	WRITE_ONCE(t->site, 0);
	ki_sync();
	t->patch = 0;
	t->transient = false;
}

static int ki_traps_in(unsigned long addr, size_t len)
{
	int i, n = 0;

	for (i = 0; i < KERNINST_MAX_TRAPS; i++)
		if (ki_traps[i].site && ki_traps[i].site >= addr && ki_traps[i].site < addr + len)
			n++;
	return n;
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
 * While the int3 is in, a CPU that hits it is sent to @dest by ki_die_notify.
 * A one-byte write is atomic and needs only the final sync.
 * Caller holds text_mutex and ki_lock; @dest was validated.
 */
static int ki_poke_text(unsigned long addr, const u8 *new, u32 len, unsigned long dest)
{
	static const u8 int3 = KI_INT3;
	struct ki_trap *t = NULL;

	if (len > 1) {
		t = ki_trap_add(addr, dest, true);
		if (!t)
			return -ENOSPC;
		ki_text_poke((void *)addr, &int3, 1);
		ki_sync();
		ki_text_poke((void *)(addr + 1), new + 1, len - 1);
		ki_sync();
	}
	ki_text_poke((void *)addr, new, 1);
	ki_sync();
	if (t)
		ki_trap_retire(t);
	return 0;
}

static void ki_splice_log(unsigned long addr, const u8 *old, const u8 *new, u32 len)
{
	int i;

	for (i = ki_nsplices - 1; i >= 0; i--) {
		struct ki_splice *s = &ki_splices[i];

		if (s->addr != addr || s->len != len || memcmp(s->cur, old, len))
			continue;
		if (!memcmp(s->orig, new, len)) {
			memmove(s, s + 1, (ki_nsplices - i - 1) * sizeof(*s));
			ki_nsplices--;
		} else {
			memcpy(s->cur, new, len);
		}
		return;
	}
	/* Capacity was checked before anything was written. */
	ki_splices[ki_nsplices].addr = addr;
	ki_splices[ki_nsplices].len = len;
	memcpy(ki_splices[ki_nsplices].orig, old, len);
	memcpy(ki_splices[ki_nsplices].cur, new, len);
	ki_nsplices++;
}

/*
 * Whether a write puts back what the splice log holds as original, by the log's
 * own rule (the newest record at that place whose current bytes are the
 * write's old bytes).  Undo must always work, even where a hazard appeared
 * since (a kprobe registered nearby, say).
 */
static bool ki_restores(unsigned long addr, const u8 *old, const u8 *new, u32 len)
{
	int i;

	for (i = ki_nsplices - 1; i >= 0; i--) {
		const struct ki_splice *s = &ki_splices[i];

		if (s->addr != addr || s->len != len || memcmp(s->cur, old, len))
			continue;
		return !memcmp(s->orig, new, len);
	}
	return false;
}

struct ki_write {
	unsigned long addr;
	u32 len;
	bool text;
	unsigned long dest;
	u8 *old;
	u8 *new;
};

static void ki_free_writes(struct ki_write *w, u32 n)
{
	u32 i;

	for (i = 0; i < n; i++)
		kfree(w[i].old);
	kfree(w);
}

/* Caller holds ki_lock, ki_hazard_lock() and text_mutex, so the checks hold until the write. */
static int ki_check_write(struct ki_write *w)
{
	if (ki_in_text(w->addr, w->len)) {
		if (w->len > KERNINST_MAX_TEXT_WRITE)
			return -EINVAL;
		if (ki_text_hazards(w->addr, w->len) && !ki_restores(w->addr, w->old, w->new, w->len))
			return -EPERM;
		w->text = true;
		if (w->len > 1) {
			w->dest = ki_int3_dest(w->addr, w->old, w->new, w->len);
			if (!w->dest)
				return -EINVAL;
			/* A trap route inside a multi-byte write would be overwritten. */
			if (ki_traps_in(w->addr, w->len))
				return -EBUSY;
		}
		return 0;
	}
	if (ki_in_code(w->addr, w->len))
		return w->len <= KERNINST_MAX_CODE_WRITE ? 0 : -EINVAL;
	return -ERANGE;
}

static long ki_ioc_poke(struct kerninst_poke __user *uarg)
{
	struct kerninst_poke req;
	struct kerninst_write *uw;
	struct ki_write *w;
	u8 *cur = NULL;
	u32 i, j, ntext = 0;
	long ret = 0;

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
	}
	cur = kmalloc(KERNINST_MAX_CODE_WRITE, GFP_KERNEL);
	if (!cur) {
		ret = -ENOMEM;
		goto out;
	}

	mutex_lock(&ki_lock);
	ki_hazard_lock();
	mutex_lock(ki_text_mutex);
	for (i = 0; i < req.count; i++) {
		ret = ki_check_write(&w[i]);
		if (ret)
			goto unlock;
		ntext += w[i].text;
		for (j = 0; j < i; j++)
			if (w[i].addr < w[j].addr + w[j].len && w[j].addr < w[i].addr + w[i].len) {
				ret = -EINVAL;	/* overlapping writes in one batch */
				goto unlock;
			}
	}
	if (ki_nsplices + ntext > KERNINST_MAX_SPLICES) {
		ret = -ENOSPC;
		goto unlock;
	}
	/* All or nothing: every old byte is checked before the first write. */
	for (i = 0; i < req.count; i++) {
		if (copy_from_kernel_nofault(cur, (void *)w[i].addr, w[i].len)) {
			ret = -EFAULT;
			break;
		}
		if (memcmp(cur, w[i].old, w[i].len)) {
			ret = -ESTALE;
			req.failed_index = i;
			break;
		}
	}
	for (i = 0; !ret && i < req.count; i++) {
		if (!w[i].text) {
			ki_poke_code(w[i].addr, w[i].new, w[i].len);
			continue;
		}
		ret = ki_poke_text(w[i].addr, w[i].new, w[i].len, w[i].dest);
		if (ret) {
			/* Only a full trap table; earlier writes stay and are logged. */
			pr_err("poke %#lx: %ld after %u writes\n", w[i].addr, ret, i);
			break;
		}
		ki_splice_log(w[i].addr, w[i].old, w[i].new, w[i].len);
	}
unlock:
	mutex_unlock(ki_text_mutex);
	ki_hazard_unlock();
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

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size || req.size > KERNINST_MAX_IO)
		return -EINVAL;
	/* Data only: text changes go through the poke protocol. */
	if (!ki_in_data(req.address, req.size))
		return -ERANGE;
	if (copy_from_user((void *)(unsigned long)req.address, u64_to_user_ptr(req.buf), req.size))
		return -EFAULT;
	return 0;
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

static long ki_ioc_set_trap(struct kerninst_trap __user *uarg)
{
	struct kerninst_trap req;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, 1) || !ki_in_code(req.patch, 1))
		return -ERANGE;
	mutex_lock(&ki_lock);
	/* A route is of no use where POKE would refuse the int3 it waits for. */
	ki_hazard_lock();
	if (ki_text_hazards(req.site, 1))
		ret = -EPERM;
	ki_hazard_unlock();
	if (!ret && ki_trap_find(req.site))
		ret = -EBUSY;
	else if (!ret && !ki_trap_add(req.site, req.patch, false))
		ret = -ENOSPC;
	mutex_unlock(&ki_lock);
	return ret;
}

static long ki_ioc_clear_trap(struct kerninst_trap __user *uarg)
{
	struct kerninst_trap req;
	struct ki_trap *t;
	u8 byte;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, 1))
		return -ERANGE;
	mutex_lock(&ki_lock);
	t = ki_trap_find(req.site);
	if (!t || t->transient)
		ret = -ENOENT;
	/* Retiring the route while its int3 is in text would let a hit oops. */
	else if (copy_from_kernel_nofault(&byte, (void *)(unsigned long)req.site, 1))
		ret = -EFAULT;
	else if (byte == KI_INT3)
		ret = -EBUSY;
	else
		ki_trap_retire(t);
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
		/* Tasks preempted inside patch code have left it (as optprobes wait, kernel/kprobes.c). */
		synchronize_rcu_tasks();
		return 0;
	}
	return -ENOTTY;
}

/*
 * One opener at a time: kerninstd allocates inside the patch area and the heap
 * with its own bookkeeping, so a second owner would hand out the same bytes.
 */
static atomic_t ki_busy = ATOMIC_INIT(0);

static int ki_open(struct inode *inode, struct file *file)
{
	return atomic_cmpxchg(&ki_busy, 0, 1) ? -EBUSY : 0;
}

static int ki_release(struct inode *inode, struct file *file)
{
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
	unsigned int i, kept = 0, writes = 0, routes = 0;

	if (state != MODULE_STATE_GOING)
		return NOTIFY_DONE;
	mutex_lock(&ki_lock);
	for (i = 0; i < ki_nsplices; i++) {
		if (within_module(ki_splices[i].addr, mod)) {
			writes++;
			continue;
		}
		if (kept != i)
			ki_splices[kept] = ki_splices[i];
		kept++;
	}
	ki_nsplices = kept;
	for (i = 0; i < KERNINST_MAX_TRAPS; i++)
		if (ki_traps[i].site && within_module(ki_traps[i].site, mod)) {
			ki_trap_retire(&ki_traps[i]);
			routes++;
		}
	mutex_unlock(&ki_lock);
	if (writes || routes)
		pr_info("module %s is going: forgot %u text writes and %u trap routes in its text\n",
			mod->name, writes, routes);
	return NOTIFY_DONE;
}

static struct notifier_block ki_module_nb = {
	.notifier_call = ki_module_notify,
};

/* Undo every live text write still in place, newest first. */
static void ki_unsplice_all(void)
{
	u8 cur[KERNINST_MAX_TEXT_WRITE];
	int i;

	mutex_lock(ki_text_mutex);
	for (i = ki_nsplices - 1; i >= 0; i--) {
		struct ki_splice *s = &ki_splices[i];
		unsigned long dest = ki_int3_dest(s->addr, s->cur, s->orig, s->len);

		if (copy_from_kernel_nofault(cur, (void *)s->addr, s->len) ||
		    memcmp(cur, s->cur, s->len)) {
			pr_warn("text at %#lx changed behind ksim; left as is\n", s->addr);
			continue;
		}
		if (s->len > 1 && !dest) {
			pr_warn("no int3 destination to restore %#lx; left as is\n", s->addr);
			continue;
		}
		if (ki_poke_text(s->addr, s->orig, s->len, dest))
			pr_warn("cannot restore %#lx\n", s->addr);
	}
	ki_nsplices = 0;
	mutex_unlock(ki_text_mutex);
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
	int i;

	/* The device cannot be open here (fops owner pins the module). */
	misc_deregister(&ki_dev);
	unregister_module_notifier(&ki_module_nb);
	mutex_lock(&ki_lock);
	ki_unsplice_all();
	for (i = 0; i < KERNINST_MAX_TRAPS; i++)
		WRITE_ONCE(ki_traps[i].site, 0);
	mutex_unlock(&ki_lock);
	/* atomic_notifier_chain_unregister waits for running notifiers (synchronize_rcu). */
	unregister_die_notifier(&ki_die_nb);
	synchronize_rcu_tasks();
	ki_free_regions();
	pr_info("unloaded (%d trap hits dispatched)\n", atomic_read(&ki_trap_hits));
}

module_init(ki_init);
module_exit(ki_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("ksim live-kernel driver: memory access, text poking, trap dispatch");
MODULE_VERSION("2");
