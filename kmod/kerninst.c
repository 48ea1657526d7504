// SPDX-License-Identifier: GPL-2.0
/*
 * kerninst.c - /dev/kerninst, the part of ksim's live target that must run in
 * the kernel.  kerninstd (ksim/live/daemon.py) owns the device and serves remote
 * clients; this module only does what user space cannot:
 *
 *   - report where things are (text range, per-cpu offsets, task layout);
 *   - read any kernel address without faulting, write only ksim's data heap;
 *   - own a patch area (executable, reachable by rel32 from kernel text; arm64:
 *     by a B, +-128 MB, without KASLR) and a data heap (reachable by disp32),
 *     both made of areas from module_alloc() that are added on demand and given
 *     back when empty;
 *   - answer whether text may be touched, asking the kernel itself (the checks
 *     kprobes makes: ftrace, jump labels, static calls, kprobes, the blacklist,
 *     exception and bug tables; on arm64 also BTI landing pads, the
 *     pointer-authentication checks kprobes will not step and exclusive
 *     sequences), with the kernel's
 *     tables indexed at load where kallsyms lists them;
 *   - change kernel or module text, SMP-safely, after checking the old bytes and
 *     those hazards, for a whole batch of writes at once: on x86-64 with the
 *     int3 -> sync -> tail -> sync -> head protocol (as text_poke_bp_batch
 *     does), on arm64 under stop_machine (as aarch64_insn_patch_text does);
 *   - route trap hits at ksim's own sites to their patches (x86-64: int3, a
 *     DIE_INT3 notifier; arm64: BRK #KERNINST_ARM64_BRK_IMM, a break hook);
 *   - know who holds what: every live text write, trap route and patch-area or
 *     heap block belongs to one owner (a client session, or a kept owner that
 *     outlives kerninstd), and no owner may change what another holds;
 *   - let only CAP_SYS_ADMIN use it, change nothing in a locked-down kernel, and
 *     write no jump into text that leads anywhere but text or the writer's own
 *     patch code;
 *   - undo an owner's text when its session ends or the device is closed, and
 *     every text byte it changed on unload, newest first.
 *
 * The ABI is in kerninst.h.  Written for Linux 6.1 (Debian 12) on x86-64 and
 * arm64.  As kprobes splits kernel/kprobes.c from arch/<arch>/kernel/kprobes,
 * everything that depends on the instruction set or the trap path is behind a
 * small internal contract, one section per architecture ("the architecture's
 * half", below); the rest is shared:
 *
 *   KI_TRAP_LEN, ki_trap_insn        the trap ksim routes (x86: int3; arm64: BRK
 *                                    #KERNINST_ARM64_BRK_IMM), as text bytes
 *   KI_INSN_ALIGN                    text writes and trap sites start and end
 *                                    on it (x86: 1; arm64: whole instructions)
 *   KI_PROBE_REACH, KI_FTRACE_LEAD   how far before a range a kprobe, and after
 *                                    it an ftrace location, still cover it
 *   KI_JUMP_ENTRY_SIZE               a jump-label site's size without
 *                                    arch_jump_entry_size
 *   ki_arch_resolve()                the architecture's unexported symbols
 *   ki_arch_trap_register/unregister route trap hits (ki_trap_dispatch)
 *   ki_arch_text_hazards()           hazards only the architecture knows
 *   ki_arch_check_text_write()       what a text write may hold
 *   ki_arch_write_dest()             where a CPU meeting a write half-made goes
 *   ki_arch_check_jumps()            the jumps a text write makes, checked
 *   ki_jump_dest()                   where a jump ksim writes leads
 *   ki_arch_poke_text_batch()        write a checked batch of text writes
 *   ki_poke_code()                   write patch code (not yet reachable)
 *   ki_arch_fill_code()              what unused patch code holds
 *   ki_arch_refill_code()            freed patch code made unused again
 *   ki_arch_cpus_lock/unlock()       taken before the hazard and text locks
 *   ki_sync(), ki_canonical(), ki_arch_info()
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
#include <linux/sort.h>
#include <linux/vmalloc.h>
#include <linux/jump_label.h>
#include <linux/static_call.h>
#include <linux/capability.h>
#include <linux/security.h>
#include <linux/cpu.h>
#include <linux/bitops.h>
#include <linux/xxhash.h>
#include <asm/current.h>
#include <asm/smp.h>
#include <asm/ptrace.h>
#include <asm/unaligned.h>
#ifdef CONFIG_X86_64
#include <asm/sync_core.h>
#include <asm/text-patching.h>
#elif defined(CONFIG_ARM64)
#include <linux/delay.h>
#include <asm/brk-imm.h>
#include <asm/cacheflush.h>
#include <asm/debug-monitors.h>
#include <asm/insn.h>
#include <asm/patching.h>
#else
#error "kerninst is written for x86-64 and arm64"
#endif

#include "kerninst.h"

#define KI_CODE_SIZE (1UL << 20)	/* the first patch area */
#define KI_DATA_SIZE (1UL << 20)	/* the first data heap area */
/* Route changes, writes and text pokes between two chances to reschedule. */
#define KI_RESCHED_EVERY 256
/*
 * A span poke (ki_poke_phase) joins writes at most this many bytes apart: every
 * byte text_poke writes costs as well.  Under QEMU/TCG each store into a page
 * of translated code invalidates translations: on the testbed some 0.2-0.3 us
 * a byte against ~26 us a text_poke, so whole-page spans (10,000 function
 * entries with the jmp policy: 7,015 pokes of 13.5 MB, 2.6 s) cost more than
 * one poke per write (30,252 pokes of 78 KB, 0.8 s).  With 64: 27,270 pokes,
 * 0.75 s; for 30,000 entries 68,056 pokes, 2.7 s, against 90,657 and 3.2 s
 * one per write (128: 52,495, 2.6 s, but no gain for 10,000).
 */
#define KI_SPAN_GAP 64
#ifdef CONFIG_X86_64
#define KI_INT3 0xcc
#define KI_JMP32 0xe9
#define KI_JMP8 0xeb
#define KI_TRAP_LEN 1
#define KI_INSN_ALIGN 1
/*
 * How far before a range a kprobe can still cover it: an optimized kprobe
 * replaces its instruction with a 5-byte jmp (JMP32_INSN_SIZE,
 * arch/x86/include/asm/text-patching.h), so one at addr - 4 reaches addr.
 */
#define KI_PROBE_REACH 4
/* An ftrace location is the 5-byte call itself (ftrace_location_range answers for it). */
#define KI_FTRACE_LEAD 0
#define KI_JUMP_ENTRY_SIZE JMP32_INSN_SIZE
static const u8 ki_trap_insn[KI_TRAP_LEN] = { KI_INT3 };
#else /* CONFIG_ARM64 */
/* BRK #KERNINST_ARM64_BRK_IMM: the Arm ARM's BRK, imm16 in bits 20:5 */
#define KI_BRK (AARCH64_BREAK_MON | (KERNINST_ARM64_BRK_IMM << 5))
#define KI_TRAP_LEN AARCH64_INSN_SIZE
#define KI_INSN_ALIGN AARCH64_INSN_SIZE
/* arm64 has no optimized kprobes: a kprobe's BRK covers its own instruction only. */
#define KI_PROBE_REACH 0
/*
 * A function's ftrace site is two instructions (-fpatchable-function-entry=2,
 * DYNAMIC_FTRACE_WITH_REGS): "mov x9, x30", which ftrace_init_nop writes at
 * boot, then the nop ftrace turns into "bl ftrace_caller".  dyn_ftrace's ip is
 * the second (ftrace_call_adjust, arch/arm64/include/asm/ftrace.h); ftrace_caller
 * relies on the first having run just before it, so both are the location.
 */
#define KI_FTRACE_LEAD AARCH64_INSN_SIZE
#define KI_JUMP_ENTRY_SIZE AARCH64_INSN_SIZE
static const u8 ki_trap_insn[KI_TRAP_LEN] = {
	KI_BRK & 0xff, (KI_BRK >> 8) & 0xff, (KI_BRK >> 16) & 0xff, KI_BRK >> 24,
};
#endif

/*
 * Functions the kernel does not export to modules.  They are found through
 * kallsyms_lookup_name, itself unexported since 5.7 (commit 0bd476e6c671), whose
 * address a kprobe registered by name reveals (kernel/kprobes.c resolves
 * symbol_name with kallsyms for us).
 */
typedef unsigned long (*ki_lookup_fn)(const char *name);
static ki_lookup_fn ki_lookup;
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
/*
 * Optional: faster answers.  arch_jump_entry_size (arch/x86/kernel/jump_label.c)
 * tells a 2-byte jump-label site from a 5-byte one (without it every site
 * counts as 5 bytes: stricter); kallsyms_lookup_size_offset lets the
 * blacklist be asked once per symbol instead of once per byte.
 */
static int (*ki_arch_jump_entry_size)(struct jump_entry *entry);
static int (*ki_kallsyms_lookup_size_offset)(unsigned long addr, unsigned long *size,
					     unsigned long *offset);

static const struct {
	const char *name;
	void *fn;	/* the pointer above that receives the address */
	u32 hazard;	/* what cannot be checked without it */
} ki_checks[] = {
	{ "ftrace_location_range", &ki_ftrace_location_range, KERNINST_HAZARD_FTRACE },
	{ "jump_label_lock", &ki_jump_label_lock, KERNINST_HAZARD_JUMP_LABEL },
	{ "jump_label_unlock", &ki_jump_label_unlock, KERNINST_HAZARD_JUMP_LABEL },
	{ "jump_label_text_reserved", &ki_jump_label_text_reserved, KERNINST_HAZARD_JUMP_LABEL },
#ifdef CONFIG_HAVE_STATIC_CALL_INLINE	/* else there are no static-call sites in text */
	{ "static_call_text_reserved", &ki_static_call_text_reserved, KERNINST_HAZARD_STATIC_CALL },
#endif
	{ "get_kprobe", &ki_get_kprobe, KERNINST_HAZARD_KPROBE },
	{ "within_kprobe_blacklist", &ki_within_kprobe_blacklist, KERNINST_HAZARD_BLACKLIST },
	{ "search_exception_tables", &ki_search_exception_tables, KERNINST_HAZARD_EXTABLE },
	{ "find_bug", &ki_find_bug, KERNINST_HAZARD_BUG | KERNINST_HAZARD_WARN },
	{ "__module_text_address", &ki_module_text_address, KERNINST_HAZARD_NOT_TEXT },
};
static u32 ki_unchecked;	/* hazards some check of which is missing */

static unsigned long ki_text_start, ki_text_end;

/*
 * The patch area and the data heap: areas of module_alloc() memory (the module
 * space, within +-2 GB of kernel text, so a rel32 jump and a disp32 reach
 * them), one of each made at load and more added on demand (AREA_ADD).  A
 * patch area is filled with int3, made RO then X, and written only with
 * text_poke; a heap area is RW+NX.  Writers hold ki_lock.
 */
struct ki_area {
	struct list_head node;		/* ki_areas */
	unsigned long start;
	unsigned long size;
	u32 region;			/* KERNINST_REGION_* */
	bool first;			/* made at load; stays until unload */
};
static LIST_HEAD(ki_areas);
static unsigned long ki_area_bytes;	/* all areas together */
static struct ki_area *ki_first_code, *ki_first_data;

/* Sections whose code runs where an int3 or a jump into module memory is fatal. */
static const char *const ki_forbidden[][2] = {
	{ "__entry_text_start", "__entry_text_end" },
	{ "__noinstr_text_start", "__noinstr_text_end" },
	{ "__kprobes_text_start", "__kprobes_text_end" },
};
static unsigned long ki_forbidden_range[ARRAY_SIZE(ki_forbidden)][2];

/*
 * Functions the kernel's int3 path calls out of line before a die notifier
 * (kerninst's) sees the trap, and that no blacklist covers: exc_int3 ->
 * do_int3 -> notify_die, whose atomic notifier chain takes rcu_read_lock(),
 * out of line under CONFIG_PREEMPT_RCU (kernel/rcu/tree_plugin.h).  An int3
 * there -- a trap route or the temporary int3 of a multi-byte poke -- traps
 * again before any handler can route it, until the NMI nesting count
 * overflows (BUG in irqentry_nmi_enter).  A name the kernel lacks is skipped.
 */
static const char *const ki_trap_path[] = {
	"__rcu_read_lock", "__rcu_read_unlock", "rcu_read_unlock_special",
	"__rcu_irq_enter_check_tick",
};
static unsigned long ki_trap_path_range[ARRAY_SIZE(ki_trap_path)][2];

/*
 * The die notifiers the int3 path calls before kerninst's, whose code an int3
 * in would trap again just the same: notifiers of one priority run in the
 * order they registered, and the kernel's own may take INT_MAX too
 * (hw_breakpoint_exceptions_notify, arch/x86/kernel/hw_breakpoint.c).  Found
 * by walking die_chain (kernel/notifier.c) once kerninst's is registered and
 * whenever a module has come or gone; written under ki_lock.
 */
#define KI_DIE_AHEAD 16
#ifdef CONFIG_X86_64
static struct atomic_notifier_head *ki_die_chain;
#endif
static unsigned long ki_die_ahead[KI_DIE_AHEAD][2];
static unsigned int ki_die_nahead;

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
static unsigned long max_area_bytes = KERNINST_MAX_AREA_BYTES;
module_param(max_area_bytes, ulong, 0644);
MODULE_PARM_DESC(max_area_bytes, "bytes of patch area and data heap at once, all areas together");

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
 * never needs memory it might not get.  A hash table keyed by address finds
 * the records at or near a place without walking the log (newest first within
 * a bucket).
 */
#define KI_SPLICE_BITS 14
struct ki_splice {
	struct list_head node;		/* ki_splices */
	struct hlist_node hnode;	/* ki_splice_at */
	struct ki_owner *owner;
	unsigned long addr;
	u32 len;
	u8 orig[KERNINST_MAX_TEXT_WRITE];
	u8 cur[KERNINST_MAX_TEXT_WRITE];
	struct ki_route bp;
};
static LIST_HEAD(ki_splices);
static DEFINE_HASHTABLE(ki_splice_at, KI_SPLICE_BITS);
static unsigned int ki_nsplices;

/*
 * Blocks of the patch area and the data heap, as kerninstd allocated them.  A
 * freed block stays here, held by no one, until QUIESCE has waited out the
 * tasks that may still run in it: patch code, and a heap block that patch
 * code just taken out of text may still write (a task preempted in the patch).
 */
struct ki_block {
	struct list_head node;		/* ki_blocks */
	struct ki_owner *owner;		/* NULL: freed, not reusable yet */
	unsigned long addr;
	unsigned long size;
	u32 region;			/* KERNINST_REGION_* */
};
static LIST_HEAD(ki_blocks);

/* Serialises every command (and unload) against each other; nests outside text_mutex. */
static DEFINE_MUTEX(ki_lock);

/* ------------------------------------------------------------------------- */
/* privilege and lockdown                                                     */

/*
 * Lockdown (security/lockdown/lockdown.c): a locked-down kernel lets nobody
 * change its code, root included.  kprobes are refused at LOCKDOWN_KPROBES
 * (__register_trace_kprobe, kernel/trace/trace_kprobe.c), a confidentiality
 * reason: a probe runs the kernel's own handler.  kerninst writes code its
 * clients made into text and the patch area, as a debugger writing kernel
 * memory does, so it asks the integrity reason kgdb asks before a write
 * (LOCKDOWN_DBG_WRITE_KERNEL, kernel/debug/debug_core.c), and kgdb's
 * confidentiality reason before a read of any address (LOCKDOWN_DBG_READ_KERNEL).
 * Asked at every request: lockdown may be raised at run time (echo integrity >
 * /sys/kernel/security/lockdown) and is never lowered.  Undo is never refused
 * (a restore, clearing a route, dropping an owner): it only takes kerninst's
 * changes out.  The answer is -EROFS, as -EPERM is the hazards' errno.
 */
static int ki_write_locked(void)
{
	return security_locked_down(LOCKDOWN_DBG_WRITE_KERNEL) ? -EROFS : 0;
}

static int ki_read_locked(void)
{
	return security_locked_down(LOCKDOWN_DBG_READ_KERNEL) ? -EROFS : 0;
}

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

#ifdef CONFIG_X86_64
/* --- the architecture's half (x86-64): symbols -------------------------- */
static void *(*ki_text_poke)(void *addr, const void *opcode, size_t len);

static int ki_arch_resolve(void)
{
	int ret = ki_resolve("text_poke", &ki_text_poke);

	ret |= ki_resolve("text_mutex", &ki_text_mutex);
	ki_die_chain = (void *)ki_lookup("die_chain");
	if (!ki_die_chain)
		pr_warn("kernel symbol die_chain not found: die notifiers ahead of kerninst's "
			"are not kept from text pokes\n");
	return ret;
}
#else /* CONFIG_ARM64 */
/* --- the architecture's half (arm64): symbols ----------------------------- */
static int (*ki_patch_text_nosync)(void *addr, u32 insn);
static int (*ki_patch_text)(void *addrs[], u32 insns[], int cnt);
static void (*ki_register_kernel_break_hook)(struct break_hook *hook);
static void (*ki_unregister_kernel_break_hook)(struct break_hook *hook);
/*
 * kallsyms lists data symbols only with KALLSYMS_ALL, which Debian's arm64
 * kernel leaves out: text_mutex cannot be found there.  On arm64 no other
 * writer of text takes it but kprobes' arming (jump labels and ftrace write
 * under their own locks, with aarch64_insn_patch_text_nosync's patch_lock per
 * instruction), and a batch goes in under stop_machine, which no CPU is inside
 * a write of another's during; without the kernel's, a mutex of kerninst's
 * serialises its own pokes.
 */
static DEFINE_MUTEX(ki_own_text_mutex);

static int ki_arch_resolve(void)
{
	int ret = 0;

	ret |= ki_resolve("aarch64_insn_patch_text_nosync", &ki_patch_text_nosync);
	ret |= ki_resolve("aarch64_insn_patch_text", &ki_patch_text);
	ret |= ki_resolve("register_kernel_break_hook", &ki_register_kernel_break_hook);
	ret |= ki_resolve("unregister_kernel_break_hook", &ki_unregister_kernel_break_hook);
	ki_text_mutex = (void *)ki_lookup("text_mutex");
	if (!ki_text_mutex)
		ki_text_mutex = &ki_own_text_mutex;
	return ret;
}

/*
 * The per-cpu slot that holds the current task.  arm64 keeps current in SP_EL0
 * and in the per-cpu __entry_task (entry_task_switch, arch/arm64/kernel/
 * process.c), a data symbol kallsyms lacks without KALLSYMS_ALL.  So it is found
 * as the slot near cpu_number whose value is current on every CPU, asked on each
 * CPU (an IPI, where current is the task that CPU switched to last) in
 * KI_CURRENT_ROUNDS rounds and in the loading task: __entry_task, or the
 * runqueue's curr, which the scheduler sets just before it.
 */
#define KI_CURRENT_WINDOW (512UL << 10)	/* bytes each side of cpu_number */
#define KI_CURRENT_ROUNDS 4
static unsigned long *ki_current_slots;	/* a bit per 8-byte slot of the window */
static unsigned long ki_entry_task;

static void ki_current_round(void *unused)
{
	unsigned long start = ALIGN_DOWN((unsigned long)&cpu_number, 8) - KI_CURRENT_WINDOW;
	unsigned long base = (unsigned long)this_cpu_ptr(&cpu_number) - (unsigned long)&cpu_number;
	unsigned long i, val;

	for_each_set_bit(i, ki_current_slots, 2 * KI_CURRENT_WINDOW / 8)
		if (copy_from_kernel_nofault(&val, (void *)(start + base + 8 * i), sizeof(val)) ||
		    val != (unsigned long)current)
			clear_bit(i, ki_current_slots);
}

static void ki_find_current(void)
{
	unsigned long n = 2 * KI_CURRENT_WINDOW / 8, i;
	int round;

	ki_current_slots = kvzalloc(BITS_TO_LONGS(n) * sizeof(long), GFP_KERNEL);
	if (!ki_current_slots)
		return;
	bitmap_fill(ki_current_slots, n);
	for (round = 0; round < KI_CURRENT_ROUNDS; round++) {
		preempt_disable();
		ki_current_round(NULL);
		preempt_enable();
		on_each_cpu(ki_current_round, NULL, 1);
		msleep(5);
	}
	i = find_first_bit(ki_current_slots, n);
	if (i < n)
		ki_entry_task = ALIGN_DOWN((unsigned long)&cpu_number, 8) - KI_CURRENT_WINDOW + 8 * i;
	else
		pr_warn("no per-cpu slot holds the current task: INFO's current_task is 0\n");
	kvfree(ki_current_slots);
	ki_current_slots = NULL;
}
#endif

static int ki_resolve_all(void)
{
	int ret = 0;
	size_t i;

	ret |= ki_arch_resolve();
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
	ki_arch_jump_entry_size = (void *)ki_lookup("arch_jump_entry_size");
	ki_kallsyms_lookup_size_offset = (void *)ki_lookup("kallsyms_lookup_size_offset");
	for (i = 0; i < ARRAY_SIZE(ki_trap_path); i++) {
		unsigned long addr = ki_lookup(ki_trap_path[i]), size = 1, offset;

		if (!addr)
			continue;
		/* without symbol sizes, the entry alone: where every route and poke of it starts */
		if (ki_kallsyms_lookup_size_offset)
			ki_kallsyms_lookup_size_offset(addr, &size, &offset);
		ki_trap_path_range[i][0] = addr;
		ki_trap_path_range[i][1] = addr + size;
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

/* The area of @region that holds all of [addr, addr + len), or NULL. */
static struct ki_area *ki_area_of(u32 region, unsigned long addr, size_t len)
{
	struct ki_area *a;

	list_for_each_entry(a, &ki_areas, node)
		if (a->region == region && ki_in(addr, len, a->start, a->start + a->size))
			return a;
	return NULL;
}

static bool ki_in_code(unsigned long addr, size_t len)
{
	return ki_area_of(KERNINST_REGION_CODE, addr, len) != NULL;
}

static bool ki_in_data(unsigned long addr, size_t len)
{
	return ki_area_of(KERNINST_REGION_DATA, addr, len) != NULL;
}

/*
 * The CPU's own canonical-address rule, from the paging mode in use.  The
 * kernel's check in copy_from_kernel_nofault_allowed (arch/x86/mm/maccess.c)
 * uses boot_cpu_data.x86_virt_bits, which is 57 when the CPU offers LA57 even
 * if the kernel runs 4-level paging; a non-canonical access then raises #GP and
 * ex_handler_uaccess WARNs.  __VIRTUAL_MASK_SHIFT follows pgtable_l5_enabled().
 */
#ifdef CONFIG_X86_64
static bool ki_canonical(unsigned long addr)
{
	unsigned int shift = 64 - (__VIRTUAL_MASK_SHIFT + 1);

	return (unsigned long)((long)(addr << shift) >> shift) == addr;
}
#else /* CONFIG_ARM64 */
/* arm64: an address of the TTBR0 or TTBR1 half, its top bits copies of bit VA_BITS - 1. */
static bool ki_canonical(unsigned long addr)
{
	unsigned int shift = 64 - VA_BITS;

	return (unsigned long)((long)(addr << shift) >> shift) == addr;
}
#endif

/*
 * within_kprobe_blacklist() walks the whole blacklist (thousands of entries:
 * every symbol of the entry, noinstr and kprobes sections) and looks the
 * symbol's name up; its answer for a core kernel symbol never changes, so it
 * is asked once per symbol and remembered.
 */
#define KI_BLACKLIST_MEMO_BITS 12
struct ki_bl_memo {
	struct hlist_node node;
	unsigned long symbol;
	bool blacklisted;
};
static DEFINE_HASHTABLE(ki_bl_memo, KI_BLACKLIST_MEMO_BITS);
static DEFINE_SPINLOCK(ki_bl_memo_lock);

static bool ki_core_symbol_blacklisted(unsigned long symbol)
{
	struct ki_bl_memo *m;
	unsigned long flags;
	bool black;

	spin_lock_irqsave(&ki_bl_memo_lock, flags);
	hash_for_each_possible(ki_bl_memo, m, node, symbol)
		if (m->symbol == symbol) {
			black = m->blacklisted;
			spin_unlock_irqrestore(&ki_bl_memo_lock, flags);
			return black;
		}
	spin_unlock_irqrestore(&ki_bl_memo_lock, flags);
	black = ki_within_kprobe_blacklist(symbol);
	m = kmalloc(sizeof(*m), GFP_ATOMIC | __GFP_NOWARN);
	if (m) {	/* without memory, asked again next time */
		m->symbol = symbol;
		m->blacklisted = black;
		spin_lock_irqsave(&ki_bl_memo_lock, flags);
		hash_add(ki_bl_memo, &m->node, symbol);
		spin_unlock_irqrestore(&ki_bl_memo_lock, flags);
	}
	return black;
}

static void ki_bl_memo_free(void)
{
	struct ki_bl_memo *m;
	struct hlist_node *tmp;
	int bkt;

	hash_for_each_safe(ki_bl_memo, bkt, tmp, m, node) {
		hash_del(&m->node);
		kfree(m);
	}
}

/*
 * Code where an int3 or a jump into module memory is fatal or recursive: the
 * entry, noinstr and kprobes sections, the kprobes blacklist (NOKPROBE_SYMBOL
 * functions, kernel/kprobes.c, which also covers modules' own blacklists), the
 * int3 path's functions no blacklist covers (ki_trap_path) and the die
 * notifiers it calls before kerninst's (ki_die_ahead), and kerninst itself
 * (its int3 notifier and its poke path).
 */
static bool ki_blacklisted(unsigned long addr, size_t len, struct module *mod)
{
	unsigned long end = addr + len - 1, a, size, offset, next;
	size_t i;

	if (mod == THIS_MODULE)
		return true;
	for (i = 0; i < ARRAY_SIZE(ki_forbidden_range); i++)
		if (addr < ki_forbidden_range[i][1] && addr + len > ki_forbidden_range[i][0])
			return true;
	for (i = 0; i < ARRAY_SIZE(ki_trap_path_range); i++)
		if (addr < ki_trap_path_range[i][1] && addr + len > ki_trap_path_range[i][0])
			return true;
	for (i = 0; i < READ_ONCE(ki_die_nahead); i++)
		if (addr < ki_die_ahead[i][1] && addr + len > ki_die_ahead[i][0])
			return true;
	if (!ki_within_kprobe_blacklist)
		return false;
	/*
	 * The blacklist is made of whole symbols (kprobe_add_ksym_blacklist and
	 * within_kprobe_blacklist's suffixed-symbol rule, kernel/kprobes.c): one
	 * byte of each symbol the range overlaps answers for all of it.  Without
	 * kallsyms_lookup_size_offset, every byte is asked.
	 */
	for (a = addr; a <= end; a = next) {
		next = a + 1;
		if (ki_kallsyms_lookup_size_offset &&
		    ki_kallsyms_lookup_size_offset(a, &size, &offset) && offset < size &&
		    a - offset + size > a) {
			next = a - offset + size;
			if (!mod ? ki_core_symbol_blacklisted(a - offset) : ki_within_kprobe_blacklist(a))
				return true;
		} else if (ki_within_kprobe_blacklist(a)) {
			return true;
		}
		if (next <= a)
			break;
	}
	return false;
}

/*
 * The kernel's tables of text it rewrites or looks up by address -- jump-label
 * sites, static-call sites, BUG()/WARN() ud2s -- indexed at load: the kernel's
 * own lookups walk whole tables (jump_label_text_reserved, kernel/jump_label.c,
 * decodes the instruction of every site before the range; find_bug, lib/bug.c,
 * scans every entry), milliseconds per range under emulation.  Core kernel
 * text's tables never change after boot; a module's are read from its struct
 * module at each question (they are small).
 */
struct ki_hz {
	unsigned long addr;
	u32 len;
	u32 flags;	/* KERNINST_HAZARD_* */
};
static struct ki_hz *ki_core_hz;	/* sorted by address */
static unsigned int ki_core_nhz;
static u32 ki_core_hz_reach;		/* the longest entry */
/*
 * The index holds core text's exception-table entries too: a range's
 * instructions are then one search, not one search_exception_tables() a byte
 * (which also walks the module and BPF tables, where no core text address is),
 * some 40% of a hazard question under emulation.
 */
static bool ki_core_extable;

/* lib/bug.c's bug_addr() */
static unsigned long ki_bug_addr(const struct bug_entry *bug)
{
#ifdef CONFIG_GENERIC_BUG_RELATIVE_POINTERS
	return (unsigned long)&bug->bug_addr_disp + bug->bug_addr_disp;
#else
	return bug->bug_addr;
#endif
}

static u32 ki_bug_flag(const struct bug_entry *bug)
{
	return bug->flags & BUGFLAG_WARNING ? KERNINST_HAZARD_WARN : KERNINST_HAZARD_BUG;
}

/* The instruction an exception-table entry is for (lib/extable.c's ex_to_insn). */
static unsigned long ki_extable_insn(const struct exception_table_entry *e)
{
#ifdef ARCH_HAS_RELATIVE_EXTABLE	/* asm/extable.h */
	return (unsigned long)&e->insn + e->insn;
#else
	return e->insn;
#endif
}

/* What addr_conflict() in kernel/jump_label.c takes a site to cover. */
static u32 ki_jump_size(struct jump_entry *entry)
{
	return ki_arch_jump_entry_size ? ki_arch_jump_entry_size(entry) : KI_JUMP_ENTRY_SIZE;
}

#ifdef CONFIG_HAVE_STATIC_CALL_INLINE
/* static_call_addr() and static_call_is_init() of kernel/static_call_inline.c */
static unsigned long ki_static_call_addr(const struct static_call_site *site)
{
	return (long)site->addr + (long)&site->addr;
}

static bool ki_static_call_is_init(const struct static_call_site *site)
{
	return ((long)site->key + (long)&site->key) & STATIC_CALL_SITE_INIT;
}
#endif

static int ki_hz_cmp(const void *a, const void *b)
{
	const struct ki_hz *x = a, *y = b;

	return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* [start, stop) of a table the linker script delimits, or 0 entries. */
static unsigned long ki_table(const char *start, const char *stop, size_t entry, void **base)
{
	unsigned long a = ki_lookup(start), b = ki_lookup(stop);

	*base = (void *)a;
	return a && b > a ? (b - a) / entry : 0;
}

/*
 * Index core kernel text's jump-label sites (those of init text are gone, as
 * jump_label_text_reserved skips them once the system runs), static-call sites
 * and bug-table entries.  Without an index the kernel's own lookups answer.
 */
static void ki_index_core_tables(void)
{
	struct jump_entry *jumps;
	struct bug_entry *bugs;
	struct exception_table_entry *ex;
	unsigned long nj, nb, ns = 0, nx, i, n = 0;
	struct ki_hz *z;
#ifdef CONFIG_HAVE_STATIC_CALL_INLINE
	struct static_call_site *sites;
#endif

	nj = ki_table("__start___jump_table", "__stop___jump_table", sizeof(*jumps), (void **)&jumps);
	nb = ki_table("__start___bug_table", "__stop___bug_table", sizeof(*bugs), (void **)&bugs);
	nx = ki_table("__start___ex_table", "__stop___ex_table", sizeof(*ex), (void **)&ex);
#ifdef CONFIG_HAVE_STATIC_CALL_INLINE
	ns = ki_table("__start_static_call_sites", "__stop_static_call_sites", sizeof(*sites),
		      (void **)&sites);
	if (!ns && ki_static_call_text_reserved)
		return;
#endif
	if ((!nj && ki_jump_label_text_reserved) || (!nb && ki_find_bug))
		return;
	z = kvmalloc_array(nj + nb + ns + nx, sizeof(*z), GFP_KERNEL);
	if (!z)
		return;
	for (i = 0; i < nj; i++)
		if (!jump_entry_is_init(&jumps[i]))
			z[n++] = (struct ki_hz){ jump_entry_code(&jumps[i]), ki_jump_size(&jumps[i]),
						 KERNINST_HAZARD_JUMP_LABEL };
	for (i = 0; i < nb; i++)
		z[n++] = (struct ki_hz){ ki_bug_addr(&bugs[i]), KI_INSN_ALIGN, ki_bug_flag(&bugs[i]) };
#ifdef CONFIG_HAVE_STATIC_CALL_INLINE
	for (i = 0; i < ns; i++)
		if (!ki_static_call_is_init(&sites[i]))
			z[n++] = (struct ki_hz){ ki_static_call_addr(&sites[i]), CALL_INSN_SIZE,
						 KERNINST_HAZARD_STATIC_CALL };
#endif
	/* keyed by the instruction's first byte, as search_exception_tables looks */
	for (i = 0; i < nx; i++)
		z[n++] = (struct ki_hz){ ki_extable_insn(&ex[i]), KI_INSN_ALIGN,
					 KERNINST_HAZARD_EXTABLE };
	sort(z, n, sizeof(*z), ki_hz_cmp, NULL);
	for (i = 0; i < n; i++)
		ki_core_hz_reach = max(ki_core_hz_reach, z[i].len);
	ki_core_hz = z;
	ki_core_nhz = n;
	ki_core_extable = nx > 0;
	pr_info("indexed %lu jump-label sites, %lu static-call sites, %lu bug-table entries, "
		"%lu exception-table entries\n", nj, ns, nb, nx);
}

/* What index @hz (@n entries by address, none longer than @reach) records over [addr, end]. */
static u32 ki_hz_search(const struct ki_hz *hz, unsigned int n, u32 reach, unsigned long addr,
			unsigned long end)
{
	unsigned int lo = 0, hi = n, mid;
	const struct ki_hz *z;
	u32 h = 0;

	while (lo < hi) {	/* the first entry that starts after end */
		mid = lo + (hi - lo) / 2;
		if (hz[mid].addr <= end)
			lo = mid + 1;
		else
			hi = mid;
	}
	while (lo > 0) {
		z = &hz[--lo];
		if (z->addr + reach <= addr)
			break;
		if (z->addr + z->len > addr)
			h |= z->flags;
	}
	return h;
}

/* What the index records over [addr, end] (end inclusive, as in addr_conflict). */
static u32 ki_core_table_hazards(unsigned long addr, unsigned long end)
{
	return ki_hz_search(ki_core_hz, ki_core_nhz, ki_core_hz_reach, addr, end);
}

/* The same from a live module's own tables, as the kernel's module lookups read them. */
static u32 ki_module_table_hazards(struct module *mod, unsigned long addr, unsigned long end)
{
	unsigned long a;
	unsigned int i;
	u32 h = 0;

#ifdef CONFIG_JUMP_LABEL
	for (i = 0; i < mod->num_jump_entries; i++) {
		struct jump_entry *e = &mod->jump_entries[i];

		a = jump_entry_code(e);
		if (!jump_entry_is_init(e) && a <= end && a + ki_jump_size(e) > addr)
			h |= KERNINST_HAZARD_JUMP_LABEL;
	}
#endif
#ifdef CONFIG_HAVE_STATIC_CALL_INLINE
	for (i = 0; i < mod->num_static_call_sites; i++) {
		a = ki_static_call_addr(&mod->static_call_sites[i]);
		if (!ki_static_call_is_init(&mod->static_call_sites[i]) && a <= end &&
		    a + CALL_INSN_SIZE > addr)
			h |= KERNINST_HAZARD_STATIC_CALL;
	}
#endif
#ifdef CONFIG_GENERIC_BUG
	for (i = 0; i < mod->num_bugs; i++) {
		a = ki_bug_addr(&mod->bug_table[i]);
		if (a + KI_INSN_ALIGN > addr && a <= end)
			h |= ki_bug_flag(&mod->bug_table[i]);
	}
#endif
	return h;
}

/* The kernel's own (slow) answers, where there is no index. */
static u32 ki_kernel_table_hazards(unsigned long addr, unsigned long end)
{
	const struct bug_entry *bug;
	unsigned long a;
	u32 h = 0;

	if (ki_jump_label_text_reserved && ki_jump_label_text_reserved((void *)addr, (void *)end))
		h |= KERNINST_HAZARD_JUMP_LABEL;
	if (ki_static_call_text_reserved && ki_static_call_text_reserved((void *)addr, (void *)end))
		h |= KERNINST_HAZARD_STATIC_CALL;
	/* instructions start on KI_INSN_ALIGN: the one holding addr, and every one after */
	for (a = ALIGN_DOWN(addr, KI_INSN_ALIGN); a <= end; a += KI_INSN_ALIGN) {
		bug = ki_find_bug ? ki_find_bug(a) : NULL;
		if (bug)
			h |= ki_bug_flag(bug);
	}
	return h;
}

#ifdef CONFIG_X86_64
/* --- the architecture's half (x86-64): hazards ---------------------------- */

/* Every x86 hazard is one of the kernel's tables, asked above. */
static u32 ki_arch_text_hazards(unsigned long addr, unsigned long end, struct module *mod)
{
	return 0;
}

static void ki_arch_index(void)
{
}

static void ki_arch_index_free(void)
{
}

/* What a hazard-lock holder takes first: nothing on x86. */
static void ki_arch_cpus_lock(void)
{
}

static void ki_arch_cpus_unlock(void)
{
}
#else /* CONFIG_ARM64 */
/* --- the architecture's half (arm64): hazards ----------------------------- */

/*
 * Alternatives (.altinstructions) are no hazard at run time: arm64 keeps the
 * table in init memory (__alt_instructions is between __inittext_begin and
 * __inittext_end, arch/arm64/kernel/vmlinux.lds.S), applies it once at boot
 * (apply_alternatives_all) and frees it with the rest of init; a module's are
 * applied before its text runs.  Nothing rewrites an alternative after that, and
 * its instructions are moved as any others.  ki_arch_index finds the current
 * task instead (it needs the CPUs up, as the tables do).
 */
static void ki_arch_index(void)
{
	ki_find_current();
}

static void ki_arch_index_free(void)
{
}

/* The HINT space (Arm ARM C6.2 "HINT"): CRm:op2 in bits 11:5. */
#define KI_HINT_MASK 0xfffff01fu
#define KI_HINT 0xd503201fu
#define KI_HINT_OP(insn) (((insn) >> 5) & 0x7f)

/*
 * Branch protection.  A BTI instruction is a landing pad: with BTI enforced, a
 * BR/BLR to anything else takes a Branch Target exception, and so does one to
 * ksim's B written over it (as do PACIASP/PACIBSP, implicit landing pads, when
 * the kernel is built for BTI).  The pointer-authentication checks (AUT*,
 * RETAA/RETAB) are what kprobes refuses to step (aarch64_insn_is_steppable_hint,
 * arch/arm64/kernel/probes/decode-insn.c): they authenticate LR against SP
 * where they stand.  PACIASP and the other signing hints kprobes steps out of
 * line, and so may ksim move them, with SP and LR as at the site.
 */
static bool ki_branch_prot(u32 insn)
{
	if ((insn & 0xfffffbffu) == 0xd65f0bffu)	/* RETAA, RETAB */
		return true;
	if ((insn & KI_HINT_MASK) != KI_HINT)
		return false;
	switch (KI_HINT_OP(insn)) {
	case 0x20: case 0x22: case 0x24: case 0x26:	/* BTI, BTI c, BTI j, BTI jc */
		return true;
	case 0x0c: case 0x0e:				/* AUTIA1716, AUTIB1716 */
	case 0x1c: case 0x1d: case 0x1e: case 0x1f:	/* AUTIAZ, AUTIASP, AUTIBZ, AUTIBSP */
		return true;
#ifdef CONFIG_ARM64_BTI_KERNEL
	case 0x19: case 0x1b:				/* PACIASP, PACIBSP: landing pads */
		return true;
#endif
	}
	return false;
}

/*
 * Whether the instruction at @a is inside an exclusive sequence: after a
 * load-exclusive with no store-exclusive between, looking back at most
 * KI_ATOMIC_CONTEXT instructions and not before the symbol that holds @a -- the
 * test of kprobes' arm_kprobe_decode_insn (is_probed_address_atomic,
 * arch/arm64/kernel/probes/decode-insn.c: MAX_ATOMIC_CONTEXT_SIZE).  A trap or a
 * patch run there clears the exclusive monitor (an exception return does, and
 * the patch's own exclusives), and the store-exclusive then fails on every retry.
 * Without symbol sizes the test is not made, as kprobes skips it.
 */
#define KI_ATOMIC_CONTEXT (128 / AARCH64_INSN_SIZE)
static bool ki_in_exclusive(unsigned long a)
{
	unsigned long size, offset, stop, at;
	u32 insn;

	if (!ki_kallsyms_lookup_size_offset || !ki_kallsyms_lookup_size_offset(a, &size, &offset))
		return false;
	stop = a - min_t(unsigned long, offset & ~3UL, KI_ATOMIC_CONTEXT * AARCH64_INSN_SIZE);
	for (at = a; at > stop; ) {
		at -= AARCH64_INSN_SIZE;
		if (copy_from_kernel_nofault(&insn, (void *)at, sizeof(insn)))
			return false;
		insn = le32_to_cpu(insn);
		if (aarch64_insn_is_store_ex(insn))
			return false;
		if (aarch64_insn_is_load_ex(insn))
			return true;
	}
	return false;
}

static u32 ki_arch_text_hazards(unsigned long addr, unsigned long end, struct module *mod)
{
	unsigned long a;
	u32 h = 0, insn;

	for (a = ALIGN_DOWN(addr, AARCH64_INSN_SIZE); a <= end; a += AARCH64_INSN_SIZE) {
		if (copy_from_kernel_nofault(&insn, (void *)a, sizeof(insn)))
			return h | KERNINST_HAZARD_NOT_TEXT;
		if (ki_branch_prot(le32_to_cpu(insn)))
			h |= KERNINST_HAZARD_BRANCH_PROT;
		if (ki_in_exclusive(a))
			h |= KERNINST_HAZARD_EXCLUSIVE;
	}
	return h;
}

/*
 * aarch64_insn_patch_text stops the machine with the CPU hotplug lock held:
 * taken before the jump-label lock and text_mutex, as static_key_enable and
 * kprobes' arm_kprobe take it.
 */
static void ki_arch_cpus_lock(void)
{
	cpus_read_lock();
}

static void ki_arch_cpus_unlock(void)
{
	cpus_read_unlock();
}
#endif

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
 * are keyed by an instruction's first byte, so every byte where an instruction
 * may start is asked (x86-64: every byte; arm64: every 4-byte aligned one,
 * from the instruction that holds addr).  The caller holds ki_hazard_lock().
 */
static u32 ki_text_hazards(unsigned long addr, u32 len)
{
	unsigned long end = addr + len - 1, a;
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
	if (ki_ftrace_location_range && ki_ftrace_location_range(addr, end + KI_FTRACE_LEAD))
		h |= KERNINST_HAZARD_FTRACE;
	/* Jump labels, static calls and the bug table (the module's tables are read under the jump-label lock). */
	if (mod)
		h |= ki_module_table_hazards(mod, addr, end);
	else if (ki_core_hz)
		h |= ki_core_table_hazards(addr, end);
	else
		h |= ki_kernel_table_hazards(addr, end);
	h |= ki_arch_text_hazards(addr, end, mod);
	/* get_kprobe walks an RCU hash list: preemption off is its read-side section. */
	if (ki_get_kprobe)
		for (a = ALIGN_DOWN(addr, KI_INSN_ALIGN) - KI_PROBE_REACH; a <= end;
		     a += KI_INSN_ALIGN)
			if (ki_get_kprobe((void *)a)) {
				h |= KERNINST_HAZARD_KPROBE;
				break;
			}
	/* core text's entries are in the index (ki_core_extable: it was built with them) */
	if (mod || !ki_core_extable)
		for (a = ALIGN_DOWN(addr, KI_INSN_ALIGN); a <= end; a += KI_INSN_ALIGN)
			if (ki_search_exception_tables && ki_search_exception_tables(a))
				h |= KERNINST_HAZARD_EXTABLE;
	if (ki_unchecked)
		h |= KERNINST_HAZARD_UNKNOWN;
out:
	preempt_enable();
	return h;
}

/* ------------------------------------------------------------------------- */
/* trap dispatch                                                              */

/*
 * The patch a trap at @site goes to, or 0: called from the architecture's trap
 * handler, in NMI-like context, reading the routes under RCU only.
 */
static unsigned long ki_trap_patch(unsigned long site)
{
	struct ki_route *r;
	unsigned long patch = 0;

	rcu_read_lock();
	hash_for_each_possible_rcu(ki_routes, r, hnode, site) {
		if (r->site == site) {
			patch = r->patch;
			atomic_inc(&ki_trap_hits);
			break;
		}
	}
	rcu_read_unlock();
	return patch;
}

#ifdef CONFIG_X86_64
/* --- the architecture's half (x86-64): the int3 path's die notifier ------- */

static int ki_die_notify(struct notifier_block *nb, unsigned long val, void *data)
{
	struct die_args *args = data;
	struct pt_regs *regs = args->regs;
	unsigned long patch;

	if (val != DIE_INT3 || !regs || user_mode(regs))
		return NOTIFY_DONE;
	/* int3 is a trap: ip already points past the one-byte instruction. */
	patch = ki_trap_patch(regs->ip - 1);
	if (!patch)
		return NOTIFY_DONE;
	regs->ip = patch;
	return NOTIFY_STOP;
}

static struct notifier_block ki_die_nb = {
	.notifier_call = ki_die_notify,
	.priority = INT_MAX,
};

/* Caller holds ki_lock (or is the module's init, before the device exists). */
static void ki_find_die_ahead(void)
{
	struct notifier_block *nb;
	unsigned int n = 0;

	if (!ki_die_chain)
		return;
	rcu_read_lock();
	for (nb = rcu_dereference(ki_die_chain->head); nb && nb != &ki_die_nb;
	     nb = rcu_dereference(nb->next)) {
		unsigned long fn = (unsigned long)nb->notifier_call, size = 1, offset = 0;

		if (n == KI_DIE_AHEAD) {
			pr_warn("more than %d die notifiers ahead of kerninst's: the rest are "
				"not kept from text pokes\n", KI_DIE_AHEAD);
			break;
		}
		/* without symbol sizes, the entry alone: where routes and pokes of it start */
		if (ki_kallsyms_lookup_size_offset &&
		    ki_kallsyms_lookup_size_offset(fn, &size, &offset))
			fn -= offset;
		else
			size = 1;
		ki_die_ahead[n][0] = fn;
		ki_die_ahead[n][1] = fn + size;
		n++;
	}
	rcu_read_unlock();
	WRITE_ONCE(ki_die_nahead, n);
}

static int ki_arch_trap_register(void)
{
	int ret = register_die_notifier(&ki_die_nb);

	if (!ret)
		ki_find_die_ahead();
	return ret;
}

static void ki_arch_trap_unregister(void)
{
	/* atomic_notifier_chain_unregister waits for running notifiers (synchronize_rcu). */
	unregister_die_notifier(&ki_die_nb);
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

#else /* CONFIG_ARM64 */
/* --- the architecture's half (arm64): a kernel break hook ------------------ */

/*
 * A BRK #KERNINST_ARM64_BRK_IMM in kernel text (el1_dbg -> do_debug_exception
 * -> brk_handler -> call_break_hook, arch/arm64/kernel/debug-monitors.c, all
 * noinstr or NOKPROBE_SYMBOL: the kprobes blacklist keeps pokes out of them).
 * BRK is an exception taken with ELR on the instruction itself: the site is
 * the pc, and the CPU resumes wherever the pc is set.
 */
static int ki_brk_handler(struct pt_regs *regs, unsigned long esr)
{
	unsigned long patch;

	if (user_mode(regs))
		return DBG_HOOK_ERROR;
	patch = ki_trap_patch(instruction_pointer(regs));
	if (!patch)
		return DBG_HOOK_ERROR;	/* the kernel's "Unexpected kernel BRK" */
	instruction_pointer_set(regs, patch);
	return DBG_HOOK_HANDLED;
}

static struct break_hook ki_brk_hook = {
	.fn = ki_brk_handler,
	.imm = KERNINST_ARM64_BRK_IMM,
};

/* No die notifier runs on the BRK path before the break hooks. */
static void ki_find_die_ahead(void)
{
}

static int ki_arch_trap_register(void)
{
	ki_register_kernel_break_hook(&ki_brk_hook);
	return 0;
}

static void ki_arch_trap_unregister(void)
{
	/* unregister_debug_hook waits for running hooks (synchronize_rcu). */
	ki_unregister_kernel_break_hook(&ki_brk_hook);
}

static void ki_do_isb(void *info)
{
	isb();
}

/*
 * Serialise every CPU: after this returns, every CPU has taken an interrupt
 * (a context synchronisation event) since the caller's last write, and none is
 * still inside the BRK handler with a route (it runs with interrupts masked,
 * so the IPI waits for it).
 */
static void ki_sync(void)
{
	on_each_cpu(ki_do_isb, NULL, 1);
}
#endif

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
	unsigned long a;
	u32 i;

	/* A record overlapping the range starts at most MAX_TEXT_WRITE - 1 bytes before it. */
	for (a = addr - (KERNINST_MAX_TEXT_WRITE - 1); a != addr + len; a++)
		hash_for_each_possible(ki_splice_at, s, hnode, a)
			if (s->addr == a && s->owner != o && ki_overlaps(s->addr, s->len, addr, len))
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
	b->owner = NULL;	/* until QUIESCE */
}

/* ------------------------------------------------------------------------- */
/* text poking                                                                */

static void ki_resched(u32 i)
{
	if (i % KI_RESCHED_EVERY == KI_RESCHED_EVERY - 1)
		cond_resched();
}

/*
 * One write of a batch.  A write into text has its record (an existing one of
 * the owner, or one reserved for it) and, when it is longer than a byte, the
 * destination of the temporary int3 it goes in through.
 */
struct ki_write {
	unsigned long addr;
	u32 len;
	bool text;
	bool fresh;			/* its record joins the log with it */
	bool int3;			/* writes an int3 into text: needs a route at its site */
	unsigned long dest;
	struct ki_splice *rec;
	const u8 *old;
	const u8 *new;
};

#ifdef CONFIG_X86_64
/* --- the architecture's half (x86-64): text poking ------------------------- */

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

	/*
	 * The new bytes' jump when it leads into text or the patch area, else the
	 * old bytes': a CPU at the temporary int3 may go either way.  Text may
	 * jump elsewhere: an alternative that static_cpu_has() left as a jmp into
	 * .altinstr_aux, outside _stext.._etext.  Restoring such an instruction
	 * under a splice goes through the splice's own jump to its patch.
	 */
	if (dest && (ki_in_code(dest, 1) || ki_in_text(dest, 1)))
		return dest;
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

/* The three writing steps of ki_poke_text_batch. */
enum ki_phase {
	KI_PHASE_INT3,			/* int3 over each multi-byte write's first byte */
	KI_PHASE_TAIL,			/* the remaining bytes of each multi-byte write */
	KI_PHASE_HEAD,			/* the first byte of every write */
};

/*
 * The bytes write @w changes in @phase: [*at, *at + the length returned),
 * to be set to *bytes; 0 when the phase leaves it alone.
 */
static u32 ki_phase_bytes(const struct ki_write *w, enum ki_phase phase, unsigned long *at,
			  const u8 **bytes)
{
	static const u8 int3 = KI_INT3;

	switch (phase) {
	case KI_PHASE_INT3:
		if (w->len < 2)
			return 0;
		*at = w->addr;
		*bytes = &int3;
		return 1;
	case KI_PHASE_TAIL:
		if (w->len < 2)
			return 0;
		*at = w->addr + 1;
		*bytes = w->new + 1;
		return w->len - 1;
	case KI_PHASE_HEAD:
	default:
		*at = w->addr;
		*bytes = w->new;
		return 1;
	}
}

/* A span's new contents; used under text_mutex, which every caller of ki_poke_text_batch holds. */
static u8 ki_span[PAGE_SIZE];

/*
 * One step of ki_poke_text_batch: every write's bytes of @phase, with one
 * text_poke per span of text inside one page.  The writes from @w[i] on whose
 * bytes of this phase lie in the page of @w[i]'s, each within KI_SPAN_GAP bytes
 * of the span so far, make one span, from the lowest of those bytes to the
 * highest (at most a page); the span's current bytes are read,
 * this phase's bytes laid over them, and the whole span is written at once
 * (nothing, when that changes no byte).  A write whose bytes of the phase cross
 * a page boundary (a tail at the end of a page) is written alone, as is a span
 * of one write.  So are the writes of a span that is not all core text or all
 * one live module's text (a module that is no longer live, say): only bytes
 * known to be text are ever rewritten.  Reschedules every KI_RESCHED_EVERY
 * writes, between spans.
 */
static void ki_poke_phase(struct ki_write *w, u32 n, enum ki_phase phase)
{
	unsigned long at, lo, hi, page;
	const u8 *bytes;
	u32 i = 0, j, k, len, in_span, since = 0;

	for (; i < n; since += j - i, i = j) {
		if (since >= KI_RESCHED_EVERY) {	/* a 35,000-write batch must not hog the CPU */
			cond_resched();
			since = 0;
		}
		j = i + 1;
		len = ki_phase_bytes(&w[i], phase, &at, &bytes);
		if (!len)
			continue;
		page = at & PAGE_MASK;
		if (at + len > page + PAGE_SIZE) {
			ki_text_poke((void *)at, bytes, len);
			continue;
		}
		lo = at;
		hi = at + len;
		in_span = 1;
		for (; j < n; j++) {
			len = ki_phase_bytes(&w[j], phase, &at, &bytes);
			if (!len)
				continue;
			if ((at & PAGE_MASK) != page || at + len > page + PAGE_SIZE ||
			    at > hi + KI_SPAN_GAP || at + len + KI_SPAN_GAP < lo)
				break;
			lo = min(lo, at);
			hi = max(hi, at + len);
			in_span++;
		}
		if (in_span > 1 && ki_in_text(lo, hi - lo)) {
			memcpy(ki_span, (const void *)lo, hi - lo);
			for (k = i; k < j; k++) {
				len = ki_phase_bytes(&w[k], phase, &at, &bytes);
				if (len)
					memcpy(ki_span + (at - lo), bytes, len);
			}
			if (memcmp(ki_span, (const void *)lo, hi - lo))
				ki_text_poke((void *)lo, ki_span, hi - lo);
			continue;
		}
		for (k = i; k < j; k++) {
			len = ki_phase_bytes(&w[k], phase, &at, &bytes);
			if (len)
				ki_text_poke((void *)at, bytes, len);
		}
	}
}

/*
 * Change live kernel text, SMP-safely, for a whole batch of non-overlapping
 * writes at once: the protocol of text_poke_bp_batch
 * (arch/x86/kernel/alternative.c) and the Intel SDM's cross-modifying code
 * rules (vol. 3 8.1.3):
 *   1. route each multi-byte write's site to its destination, all of them,
 *      then write int3 over each one's first byte; sync;
 *   2. write the remaining bytes of each; sync;
 *   3. write the first byte of every write (one-byte writes are atomic to
 *      instruction fetch and need only this step); sync;
 *   4. retire the temporary routes; sync.
 * A CPU that hits a temporary int3 meanwhile is sent to its destination
 * through the route the write's record carries (so nothing here can fail).
 *
 * Each of steps 1-3 costs one text_poke per span of nearby writes in one page,
 * not one per write (ki_poke_phase): every text_poke switches to the poking mm
 * and back and flushes, and a batch of function entries has writes close
 * together (a short jmp and its springboard in the padding after the
 * function, the entries of small neighbouring functions).
 * A span is written from its current bytes, read under text_mutex, with the
 * step's bytes laid over them; the bytes between the batch's sites (and the
 * bytes of its writes that the step does not change) are written with the
 * value they already hold.  That is not a modification: the SDM's
 * cross-modifying code rule (vol. 3 8.1.3) is about bytes that change while
 * another processor may fetch them, and these do not change, so no CPU can
 * fetch anything but what is there now (a one-byte store already makes other
 * CPUs drop and fetch again its whole cache line, the neighbouring
 * instructions with it; and text_poke_bp_batch itself rewrites a tail whose
 * new bytes equal the old ones).  What was read stays current until the span is
 * written: every other writer of kernel and module text (jump labels, static
 * calls, alternatives, kprobes, optprobes, ftrace, BPF trampolines) holds
 * text_mutex while it writes, through the whole of its own
 * text_poke_bp_batch.  Between two syncs the bytes of one step may land in
 * any order, as they could one write at a time; every write, and so each of
 * two writes in one span, still goes through the steps in the protocol's
 * order, each step's bytes in that step's span.
 *
 * @w is sorted by address (so that a page's writes are next to one another;
 * in any order the result would be the same, with more text_pokes).  Caller
 * holds text_mutex and ki_lock; the destinations were validated.
 */
static void ki_poke_text_batch(struct ki_write *w, u32 n)
{
	u32 i, multi = 0;

	/*
	 * Every temporary route first, then the int3s: a route may lead to
	 * another write of the batch (a short jmp into a springboard in the
	 * padding after a function), and text_poke itself runs kernel functions
	 * (switch_mm_irqs_off -> invalidate_user_asid) that the batch may patch.
	 */
	for (i = 0; i < n; i++) {
		if (w[i].len < 2)
			continue;
		ki_route_publish(&w[i].rec->bp, w[i].addr, w[i].dest, NULL);
		multi++;
	}
	if (multi) {
		ki_poke_phase(w, n, KI_PHASE_INT3);
		ki_sync();
		ki_poke_phase(w, n, KI_PHASE_TAIL);
		ki_sync();
	}
	ki_poke_phase(w, n, KI_PHASE_HEAD);
	ki_sync();
	if (multi) {
		for (i = 0; i < n; i++)
			if (w[i].len > 1)
				hash_del_rcu(&w[i].rec->bp.hnode);
		ki_sync();
	}
}

static void ki_arch_poke_text_batch(struct ki_write *w, u32 n)
{
	ki_poke_text_batch(w, n);
}

/* Any bytes may be written into text. */
static int ki_arch_check_text_write(const struct ki_write *w)
{
	return 0;
}

/* A multi-byte write goes in through a temporary int3, whose destination it needs. */
static int ki_arch_write_dest(struct ki_write *w)
{
	if (w->len < 2)
		return 0;
	w->dest = ki_int3_dest(w->addr, w->old, w->new, w->len);
	return w->dest ? 0 : -EINVAL;
}

/* Unused patch code holds int3 (KERNINST_CODE_FILL_X86_64). */
static void ki_arch_fill_code(void *base, unsigned long size)
{
	memset(base, KERNINST_CODE_FILL_X86_64, size);
}

/*
 * Patch code no task can run any more (freed, then quiesced) holding int3 again:
 * a page at a time, and only a page that holds something else.  Caller holds
 * text_mutex and ki_lock.
 */
static void ki_arch_refill_code(unsigned long addr, unsigned long size)
{
	static u8 fill[PAGE_SIZE];

	if (fill[0] != KERNINST_CODE_FILL_X86_64)
		ki_arch_fill_code(fill, sizeof(fill));
	while (size) {
		u32 chunk = min_t(unsigned long, size, PAGE_SIZE - offset_in_page(addr));

		if (memchr_inv((void *)addr, KERNINST_CODE_FILL_X86_64, chunk))
			ki_text_poke((void *)addr, fill, chunk);
		addr += chunk;
		size -= chunk;
		cond_resched();
	}
}

static void ki_arch_info(struct kerninst_info *info)
{
	/* Per-cpu symbols are offsets from the per-cpu base in GS (zero-based on x86-64). */
	info->current_task = (unsigned long)&current_task;
	info->cpu_number = (unsigned long)&cpu_number;
}

#else /* CONFIG_ARM64 */
/* --- the architecture's half (arm64): text poking -------------------------- */

struct ki_batch;
static int ki_check_jump_dest(struct ki_batch *b, unsigned long dest);

/*
 * A B or BL's destination (imm26, +-128 MB), where ksim's jumps and the
 * kernel's direct calls lead; 0 for any other instruction.
 */
static unsigned long ki_insn_dest(unsigned long addr, u32 insn)
{
	if (!aarch64_insn_is_b(insn) && !aarch64_insn_is_bl(insn))
		return 0;
	return addr + (long)sign_extend64((insn & 0x03ffffffu) << 2, 27);
}

/* Where a jump ksim wrote at @addr leads: a B at its first instruction (0: none). */
static unsigned long ki_jump_dest(unsigned long addr, const u8 *bytes, u32 len)
{
	u32 insn;

	if (len < AARCH64_INSN_SIZE)
		return 0;
	insn = get_unaligned_le32(bytes);
	return aarch64_insn_is_b(insn) ? ki_insn_dest(addr, insn) : 0;
}

/*
 * A text write of whole instructions: a 4-byte aligned address and length.  A
 * BRK #KERNINST_ARM64_BRK_IMM goes in alone (a 4-byte write), so that its
 * route is checked where it stands.
 */
static int ki_arch_check_text_write(const struct ki_write *w)
{
	u32 i;

	if (!IS_ALIGNED(w->addr | w->len, AARCH64_INSN_SIZE))
		return -EINVAL;
	for (i = 0; w->len > KI_TRAP_LEN && i < w->len; i += AARCH64_INSN_SIZE)
		if (get_unaligned_le32(w->new + i) == KI_BRK)
			return -EINVAL;
	return 0;
}

/* A batch goes in under stop_machine: no CPU meets a write half made. */
static int ki_arch_write_dest(struct ki_write *w)
{
	return 0;
}

/* Patch code is written an instruction at a time, each word as it will be with @new laid over. */
static void ki_poke_code(unsigned long addr, const u8 *new, u32 len)
{
	unsigned long at = ALIGN_DOWN(addr, AARCH64_INSN_SIZE), end = addr + len;
	u8 word[AARCH64_INSN_SIZE];
	u32 i, n = 0;

	for (; at < end; at += AARCH64_INSN_SIZE) {
		memcpy(word, (const void *)at, sizeof(word));
		for (i = 0; i < AARCH64_INSN_SIZE; i++)
			if (at + i >= addr && at + i < end)
				word[i] = new[at + i - addr];
		WARN_ON_ONCE(ki_patch_text_nosync((void *)at, get_unaligned_le32(word)));
		ki_resched(n++);
	}
}

/*
 * Change live kernel text for a whole batch of non-overlapping writes at once.
 * One instruction's 4-byte aligned store is single-copy atomic to instruction
 * fetch, but the Arm ARM lets another CPU execute an instruction that changes
 * under it only between a few kinds (B, BL, NOP, BRK, ...: "concurrent
 * modification and execution of instructions"), and ksim replaces arbitrary
 * ones.  So, as kprobes arms and disarms its BRKs in 6.1
 * (aarch64_insn_patch_text, arch/arm64/kernel/patching.c), every instruction of
 * the batch is written with aarch64_insn_patch_text_nosync (the fixmap alias,
 * then the cache maintenance to the point of unification) while stop_machine
 * holds every other CPU, which then executes an ISB.  No temporary trap is
 * needed: no CPU runs kernel text meanwhile.  A batch of more than
 * KI_STOP_WORDS instructions takes several stops, each of whole writes (the
 * patch code they lead to is in before the first; between two stops a CPU may
 * meet some of the batch's writes and not others, as on x86 between two
 * syncs).  Caller holds cpus_read_lock (as stop_machine_cpuslocked requires),
 * text_mutex and ki_lock.
 */
/* A stop_machine's instructions; used under text_mutex, which every caller holds. */
#define KI_STOP_WORDS 1024
static void *ki_stop_addrs[KI_STOP_WORDS];
static u32 ki_stop_insns[KI_STOP_WORDS];

static void ki_arch_poke_text_batch(struct ki_write *w, u32 n)
{
	u32 i, k, words = 0;

	for (i = 0; i < n; i++) {
		/* A write is never split: whole writes per stop (a batch of up to 256 in one). */
		if (words + w[i].len / AARCH64_INSN_SIZE > KI_STOP_WORDS) {
			WARN_ON_ONCE(ki_patch_text(ki_stop_addrs, ki_stop_insns, words));
			words = 0;
		}
		for (k = 0; k < w[i].len; k += AARCH64_INSN_SIZE, words++) {
			ki_stop_addrs[words] = (void *)(w[i].addr + k);
			ki_stop_insns[words] = get_unaligned_le32(w[i].new + k);
		}
	}
	if (words)
		WARN_ON_ONCE(ki_patch_text(ki_stop_addrs, ki_stop_insns, words));
}

/*
 * The B or BL instructions text write @w makes (ksim writes whole
 * instructions), checked (ki_check_jump_dest).
 */
static int ki_arch_check_jumps(struct ki_batch *b, struct ki_write *w)
{
	unsigned long dest;
	u32 i;
	int ret;

	for (i = 0; i < w->len; i += AARCH64_INSN_SIZE) {
		dest = ki_insn_dest(w->addr + i, get_unaligned_le32(w->new + i));
		if (!dest)
			continue;
		ret = ki_check_jump_dest(b, dest);
		if (ret)
			return ret;
	}
	return 0;
}

/*
 * Unused patch code holds BRK #FAULT_BRK_IMM, as the BPF JIT fills its holes
 * (KERNINST_CODE_FILL_ARM64).
 */
static void ki_arch_fill_code(void *base, unsigned long size)
{
	u32 *p = base;
	unsigned long i;

	BUILD_BUG_ON(AARCH64_BREAK_FAULT != KERNINST_CODE_FILL_ARM64);
	for (i = 0; i < size / sizeof(*p); i++)
		p[i] = cpu_to_le32(KERNINST_CODE_FILL_ARM64);
}

/*
 * Patch code no task can run any more (freed, then quiesced) holding the fill
 * again: only the instructions that hold something else are written.  Caller
 * holds text_mutex and ki_lock.
 */
static void ki_arch_refill_code(unsigned long addr, unsigned long size)
{
	unsigned long at, end = addr + size;
	u32 n = 0;

	for (at = addr; at + AARCH64_INSN_SIZE <= end; at += AARCH64_INSN_SIZE) {
		if (get_unaligned_le32((const void *)at) == KERNINST_CODE_FILL_ARM64)
			continue;
		WARN_ON_ONCE(ki_patch_text_nosync((void *)at, KERNINST_CODE_FILL_ARM64));
		ki_resched(n++);
	}
}

static void ki_arch_info(struct kerninst_info *info)
{
	/* Per-cpu symbols are offsets from this CPU's base in TPIDR_EL1 (__my_cpu_offset). */
	info->current_task = ki_entry_task;
	info->cpu_number = (unsigned long)&cpu_number;
}
#endif

/*
 * @o's newest live write at [addr, addr + len) whose current bytes are @cur:
 * the record a write of old bytes @cur changes, by the log's rule.
 */
static struct ki_splice *ki_splice_find(struct ki_owner *o, unsigned long addr,
					const u8 *cur, u32 len)
{
	struct ki_splice *s;

	hash_for_each_possible(ki_splice_at, s, hnode, addr)
		if (s->owner == o && s->addr == addr && s->len == len && !memcmp(s->cur, cur, len))
			return s;
	return NULL;
}

static void ki_splice_forget(struct ki_splice *s)
{
	list_del(&s->node);
	hash_del(&s->hnode);
	ki_nsplices--;
	kfree(s);
}

/*
 * Log a write of @new through record @s: a write back to the original bytes
 * retires the record; a @fresh one (not yet in the log) joins it otherwise.
 */
static void ki_splice_log(struct ki_splice *s, bool fresh, const u8 *new)
{
	if (!memcmp(s->orig, new, s->len)) {
		if (fresh)
			kfree(s);
		else
			ki_splice_forget(s);
		return;
	}
	memcpy(s->cur, new, s->len);
	if (fresh) {
		list_add_tail(&s->node, &ki_splices);
		hash_add(ki_splice_at, &s->hnode, s->addr);
		ki_nsplices++;
	}
}

static int ki_cmp_write_addr(const void *a, const void *b)
{
	unsigned long x = ((const struct ki_write *)a)->addr, y = ((const struct ki_write *)b)->addr;

	return x < y ? -1 : x > y;
}

/*
 * Put back the original bytes of up to @n records, whatever hazard appeared
 * since, as one batch; @s lists them newest first and they do not overlap.
 * A record whose text no longer holds what ksim wrote is left (logged); so is
 * a multi-byte one with no int3 destination.  Restored records are removed
 * from the log.  Returns how many were left.  Caller holds ki_lock and
 * text_mutex; @w has room for @n.
 */
static unsigned int ki_unsplice_batch(struct ki_splice **s, u32 n, struct ki_write *w)
{
	u8 cur[KERNINST_MAX_TEXT_WRITE];
	unsigned int left = 0;
	u32 i, k = 0;

	for (i = 0; i < n; i++) {
		if (copy_from_kernel_nofault(cur, (void *)s[i]->addr, s[i]->len) ||
		    memcmp(cur, s[i]->cur, s[i]->len)) {
			pr_warn("text at %#lx changed behind ksim; left as is\n", s[i]->addr);
			left++;
			continue;
		}
		w[k] = (struct ki_write){ .addr = s[i]->addr, .len = s[i]->len, .text = true,
					  .rec = s[i], .old = s[i]->cur, .new = s[i]->orig };
		if (ki_arch_write_dest(&w[k])) {
			pr_warn("no int3 destination to restore %#lx; left as is\n", s[i]->addr);
			left++;
			continue;
		}
		k++;
	}
	if (!k)
		return left;
	sort(w, k, sizeof(*w), ki_cmp_write_addr, NULL);	/* by address, for the span pokes */
	ki_arch_poke_text_batch(w, k);
	for (i = 0; i < k; i++)
		ki_splice_forget(w[i].rec);
	return left;
}

/*
 * Undo the records @match selects, newest first, whoever holds them, in
 * batches of records that do not overlap one another; returns how many could
 * not be undone (they stay in the log).  Without memory for a batch, one
 * record at a time (each carries its own temporary route: an undo never waits
 * for memory).  Caller holds ki_lock and text_mutex.
 */
static unsigned int ki_unsplice_where(bool (*match)(const struct ki_splice *s, const void *arg),
				      const void *arg)
{
	struct ki_splice *s, *tmp, *one[1];
	struct ki_splice **batch;
	struct ki_write *w, w1[1];
	unsigned int left = 0;
	u32 n = 0, room = 0, i;

	list_for_each_entry(s, &ki_splices, node)
		room += match(s, arg);
	if (!room)
		return 0;
	batch = kvmalloc_array(room, sizeof(*batch), GFP_KERNEL);
	w = kvmalloc_array(room, sizeof(*w), GFP_KERNEL);
	if (!batch || !w) {
		kvfree(batch);
		kvfree(w);
		batch = one;
		w = w1;
		room = 1;
	}
	list_for_each_entry_safe_reverse(s, tmp, &ki_splices, node) {
		if (!match(s, arg))
			continue;
		for (i = 0; i < n; i++)
			if (ki_overlaps(s->addr, s->len, batch[i]->addr, batch[i]->len))
				break;
		if (i < n || n == room) {	/* an older record under a newer one: after it */
			left += ki_unsplice_batch(batch, n, w);
			n = 0;
			cond_resched();
		}
		batch[n++] = s;
	}
	left += ki_unsplice_batch(batch, n, w);
	if (batch != one) {
		kvfree(batch);
		kvfree(w);
	}
	return left;
}

static bool ki_splice_of(const struct ki_splice *s, const void *owner)
{
	return s->owner == owner;
}

static bool ki_splice_any(const struct ki_splice *s, const void *unused)
{
	return true;
}

/*
 * One route change of a batch, with the route it adds (reserved) or retires,
 * and for a set at a site its owner routes already, the route it replaces.
 */
struct ki_rop {
	unsigned long site;
	unsigned long patch;		/* 0: clear */
	struct ki_route *route;
	struct ki_route *old;		/* a set that re-points this owner's route */
};

/* A poke batch: its route changes, its writes, and the order they are checked in. */
struct ki_batch {
	struct ki_owner *o;
	struct ki_rop *r;
	u32 nr;
	u32 *rsorted;			/* route changes by site */
	struct ki_write *w;
	u32 nw;
	u32 *wsorted;			/* writes by address */
	struct ki_write *tw;		/* the text writes, by address, as applied */
	u8 *bytes;			/* every write's old then new bytes */
	struct ki_splice **fresh;	/* records reserved for text writes */
	u32 nfresh;
	u32 failed;
};

static int ki_cmp_rop(const void *a, const void *b, const void *batch)
{
	const struct ki_batch *k = batch;
	unsigned long x = k->r[*(const u32 *)a].site, y = k->r[*(const u32 *)b].site;

	return x < y ? -1 : x > y;
}

static int ki_cmp_write(const void *a, const void *b, const void *batch)
{
	const struct ki_batch *k = batch;
	unsigned long x = k->w[*(const u32 *)a].addr, y = k->w[*(const u32 *)b].addr;

	return x < y ? -1 : x > y;
}

/* The batch's change of the route at @site, or NULL. */
static struct ki_rop *ki_batch_rop(struct ki_batch *b, unsigned long site)
{
	u32 lo = 0, hi = b->nr, mid;

	while (lo < hi) {
		mid = lo + (hi - lo) / 2;
		if (b->r[b->rsorted[mid]].site < site)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < b->nr && b->r[b->rsorted[lo]].site == site ? &b->r[b->rsorted[lo]] : NULL;
}

/* Whether a route is at @site once the batch's route changes are made. */
static bool ki_routed_after(struct ki_batch *b, unsigned long site)
{
	struct ki_rop *op = ki_batch_rop(b, site);

	return op ? op->patch != 0 : ki_route_at(site) != NULL;
}

/*
 * Whether @o may route an int3 at @site to @patch; caller holds ki_lock.  A
 * route is of no use where POKE would refuse the int3 it waits for.  In a
 * batch (@old given), a site @o routes already is re-pointed: *@old is the
 * route the new one replaces (a patch planned again, its trap kept).
 */
static int ki_check_trap(struct ki_owner *o, unsigned long site, unsigned long patch,
			 struct ki_route **old)
{
	struct ki_route *r;
	int ret;

	if (!ki_in_text(site, KI_TRAP_LEN) || !ki_in_code(patch, 1))
		return -ERANGE;
	if (!IS_ALIGNED(site | patch, KI_INSN_ALIGN))
		return -EINVAL;
	ret = ki_write_locked();
	if (ret)
		return ret;
	if (ki_text_hazards(site, KI_TRAP_LEN))
		return -EPERM;
	ret = ki_check_block(o, KERNINST_REGION_CODE, patch, 1);
	if (ret)
		return ret;
	if (ki_text_held(o, site, KI_TRAP_LEN))
		return -EADDRINUSE;
	r = ki_route_at(site);
	if (r && old && r->owner == o) {
		*old = r;
		return 0;
	}
	if (r)
		return -EBUSY;
	return 0;
}

/* The write of @b that covers @addr, or NULL (b->wsorted is sorted by address). */
static struct ki_write *ki_batch_write_at(struct ki_batch *b, unsigned long addr)
{
	u32 lo = 0, hi = b->nw, mid;
	struct ki_write *w;

	while (lo < hi) {
		mid = lo + (hi - lo) / 2;
		if (b->w[b->wsorted[mid]].addr <= addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (!lo)
		return NULL;
	w = &b->w[b->wsorted[lo - 1]];
	return addr < w->addr + w->len ? w : NULL;
}

/*
 * Where a jump text write makes leads, checked: into text (core kernel text or
 * a live module's) or into a patch block of @b's owner.  -EADDRINUSE into
 * another owner's block; -ENOEXEC anywhere else (the patch area between
 * blocks, data, kerninst itself, user space).
 */
static int ki_check_jump_dest(struct ki_batch *b, unsigned long dest)
{
	int ret;

	if (ki_in_text(dest, 1))
		return 0;
	if (ki_in_code(dest, 1)) {
		ret = ki_check_block(b->o, KERNINST_REGION_CODE, dest, 1);
		return ret == -ERANGE ? -ENOEXEC : ret;
	}
	return -ENOEXEC;
}

#ifdef CONFIG_X86_64
/* --- the architecture's half (x86-64): the jumps a write makes ------------- */

/* The byte at @addr once batch @b is made: its write's new byte there, else memory's. */
static int ki_byte_after(struct ki_batch *b, unsigned long addr, u8 *byte)
{
	struct ki_write *w = ki_batch_write_at(b, addr);

	if (w) {
		*byte = w->new[addr - w->addr];
		return 0;
	}
	return copy_from_kernel_nofault(byte, (void *)addr, 1) ? -EFAULT : 0;
}

/*
 * The jump at @at once batch @b is made (jmp rel32 or jmp rel8; none: 0), when
 * it ends past @reach, checked (ki_check_jump_dest).
 */
static int ki_check_jump_at(struct ki_batch *b, unsigned long at, unsigned long reach)
{
	unsigned long dest;
	u8 insn[5];
	u32 i, n;
	int ret;

	ret = ki_byte_after(b, at, &insn[0]);
	if (ret)
		return ret;
	n = insn[0] == KI_JMP32 ? 5 : insn[0] == KI_JMP8 ? 2 : 0;
	if (!n || at + n <= reach)
		return 0;
	for (i = 1; i < n; i++) {
		ret = ki_byte_after(b, at + i, &insn[i]);
		if (ret)
			return ret;
	}
	dest = ki_jump_dest(at, insn, n);
	return ki_check_jump_dest(b, dest);
}

/* Whether ksim wrote a jump's first byte at @at: a write of @b or a live record starts there. */
static bool ki_written_at(struct ki_batch *b, unsigned long at)
{
	struct ki_write *w = ki_batch_write_at(b, at);
	struct ki_splice *s;

	if (w)
		return w->addr == at;
	hash_for_each_possible(ki_splice_at, s, hnode, at)
		if (s->addr == at)
			return true;
	return false;
}

/*
 * Every jump text write @w makes or changes, checked (ki_check_jump_at): the
 * one that starts at its first byte -- a 5-byte jmp, a 2-byte short jmp, or a
 * single e9 or eb byte that makes one of the bytes after it -- and one that ksim
 * started up to 4 bytes before it, whose displacement it changes.  kerninst
 * knows no instruction boundaries: an e9 byte of the kernel's own before @w (an
 * immediate's, say) is not taken for a jump.  ksim writes whole instructions
 * from their first byte, so its jumps are all found.
 */
static int ki_arch_check_jumps(struct ki_batch *b, struct ki_write *w)
{
	unsigned long at;
	int ret = ki_check_jump_at(b, w->addr, w->addr);

	for (at = w->addr - 4; !ret && at != w->addr; at++)
		if (ki_written_at(b, at))
			ret = ki_check_jump_at(b, at, w->addr);
	return ret;
}
#endif

/*
 * Whether @o may retire its route at @site: not while an int3 is still there,
 * unless a write of the same batch takes it out (the route then goes after the
 * text writes: ki_apply).
 */
static int ki_check_untrap(struct ki_batch *b, unsigned long site, struct ki_route **route)
{
	struct ki_owner *o = b->o;
	struct ki_route *r = ki_route_at(site);
	struct ki_write *w;
	u8 insn[KI_TRAP_LEN];

	if (!ki_in_text(site, KI_TRAP_LEN))
		return -ERANGE;
	if (!r)
		return -ENOENT;
	if (r->owner != o)
		return -EADDRINUSE;
	if (copy_from_kernel_nofault(insn, (void *)site, KI_TRAP_LEN))
		return -EFAULT;
	if (!memcmp(insn, ki_trap_insn, KI_TRAP_LEN)) {
		/* ksim writes a trap alone, so one write takes it out whole */
		w = ki_batch_write_at(b, site);
		if (!w || site + KI_TRAP_LEN > w->addr + w->len ||
		    !memcmp(w->new + (site - w->addr), ki_trap_insn, KI_TRAP_LEN))
			return -EBUSY;
	}
	*route = r;
	return 0;
}

/* The batch's route changes, in order; each one as SET_TRAP or CLEAR_TRAP would check it. */
static int ki_check_rops(struct ki_batch *b)
{
	long routes = ki_nroutes;
	u32 i;
	int ret;

	for (i = 1; i < b->nr; i++)
		if (b->r[b->rsorted[i]].site == b->r[b->rsorted[i - 1]].site)
			return -EINVAL;	/* two changes of one route */
	for (i = 0; i < b->nr; i++) {
		struct ki_rop *op = &b->r[i];

		if (op->patch) {
			ret = ki_check_trap(b->o, op->site, op->patch, &op->old);
			routes += !op->old;
		} else {
			ret = ki_check_untrap(b, op->site, &op->route);
			routes--;
		}
		if (ret)
			return ret;
		ki_resched(i);
	}
	if (routes > READ_ONCE(max_routes) && routes > ki_nroutes)
		return -ENOSPC;
	return 0;
}

/*
 * Whether @b's owner may make write @w, and what it needs.  Caller holds
 * ki_lock, ki_hazard_lock() and text_mutex, so the answers hold until the
 * write.
 */
static int ki_check_write(struct ki_batch *b, struct ki_write *w)
{
	struct ki_owner *o = b->o;
	bool restore;
	int ret;
	u32 i;

	if (ki_in_text(w->addr, w->len)) {
		if (w->len > KERNINST_MAX_TEXT_WRITE || ki_arch_check_text_write(w))
			return -EINVAL;
		if (ki_text_held(o, w->addr, w->len))
			return -EADDRINUSE;
		w->rec = ki_splice_find(o, w->addr, w->old, w->len);
		/* Undo must always work, even where a hazard appeared since (a kprobe nearby). */
		restore = w->rec && !memcmp(w->rec->orig, w->new, w->len);
		if (!restore) {
			ret = ki_write_locked();
			if (ret)
				return ret;
			if (ki_text_hazards(w->addr, w->len))
				return -EPERM;
			ret = ki_arch_check_jumps(b, w);
			if (ret) {
				b->failed = w - b->w;
				return ret;
			}
			w->int3 = w->len == KI_TRAP_LEN && !memcmp(w->new, ki_trap_insn, KI_TRAP_LEN);
		}
		w->text = true;
		ret = ki_arch_write_dest(w);
		if (ret)
			return ret;
		if (w->len > KI_TRAP_LEN) {
			/* A trap route inside a multi-instruction write would be overwritten. */
			for (i = 0; i < w->len; i++)
				if (ki_routed_after(b, w->addr + i))
					return -EBUSY;
		}
		return 0;
	}
	if (ki_in_code(w->addr, w->len)) {
		ret = ki_write_locked();
		return ret ? ret : ki_check_block(o, KERNINST_REGION_CODE, w->addr, w->len);
	}
	return -ERANGE;
}

/* Every write of the batch checked, and the records it needs counted. */
static int ki_check_writes(struct ki_batch *b)
{
	u32 i, fresh = 0;
	int ret;

	for (i = 1; i < b->nw; i++) {
		struct ki_write *x = &b->w[b->wsorted[i - 1]], *y = &b->w[b->wsorted[i]];

		if (ki_overlaps(x->addr, x->len, y->addr, y->len))
			return -EINVAL;	/* overlapping writes in one batch */
	}
	for (i = 0; i < b->nw; i++) {
		ret = ki_check_write(b, &b->w[i]);
		if (ret)
			return ret;
		fresh += b->w[i].text && !b->w[i].rec;
		ki_resched(i);
	}
	if (fresh > b->nfresh)
		return -EINVAL;
	if (ki_nsplices + fresh > READ_ONCE(max_splices) && fresh)
		return -ENOSPC;
	return 0;
}

/* Whether memory holds every write's old bytes; on -ESTALE, b->failed names the first that differs. */
static int ki_check_old(struct ki_batch *b)
{
	u8 cur[64];
	u32 i, done, n;

	for (i = 0; i < b->nw; i++) {
		struct ki_write *w = &b->w[i];

		for (done = 0; done < w->len; done += n) {
			n = min_t(u32, sizeof(cur), w->len - done);
			if (copy_from_kernel_nofault(cur, (void *)(w->addr + done), n))
				return -EFAULT;
			if (memcmp(cur, w->old + done, n)) {
				b->failed = i;
				return -ESTALE;
			}
		}
	}
	return 0;
}

/* An int3 with no route at its site would oops the CPU that hits it. */
static int ki_check_int3_routes(struct ki_batch *b)
{
	u32 i;

	for (i = 0; i < b->nw; i++)
		if (b->w[i].int3 && !ki_routed_after(b, b->w[i].addr))
			return -EINVAL;
	return 0;
}

static void ki_route_unhash(struct ki_rop *op, struct list_head *gone)
{
	hash_del_rcu(&op->route->hnode);
	list_add(&op->route->node, gone);
	ki_nroutes--;
}

/*
 * Apply a checked batch; nothing here can fail.  The order: routes set (a
 * re-pointed route is replaced, the new one published first, so that a trap
 * finds one or the other), patch code, text, then the routes cleared: an int3
 * the batch takes out keeps its route until it is gone from text.  Where a
 * multi-byte write covers a cleared route's site, the write's temporary route
 * is published at the head of the same bucket while both exist, so a trap there
 * takes the write's way.  Retired routes are freed after a sync: no CPU is
 * still in the int3 handler with one.
 */
static void ki_apply(struct ki_batch *b)
{
	struct ki_route *r, *next;
	LIST_HEAD(gone);
	u32 i, n = 0, fresh = 0;

	for (i = 0; i < b->nr; i++) {
		struct ki_rop *op = &b->r[i];

		if (op->patch) {
			ki_route_publish(op->route, op->site, op->patch, b->o);
			op->route = NULL;
			if (op->old) {
				hash_del_rcu(&op->old->hnode);
				list_add(&op->old->node, &gone);
			} else {
				ki_nroutes++;
			}
		}
	}
	/* Patch code first: a CPU may be sent to it as soon as an int3 or a jump is in text. */
	for (i = 0; i < b->nw; i++) {
		if (!b->w[i].text)
			ki_poke_code(b->w[i].addr, b->w[i].new, b->w[i].len);
		ki_resched(i);
	}
	/* The text writes, by address, each with its record. */
	for (i = 0; i < b->nw; i++) {
		struct ki_write w = b->w[b->wsorted[i]];

		if (!w.text)
			continue;
		w.fresh = !w.rec;
		if (w.fresh) {
			w.rec = b->fresh[fresh];
			b->fresh[fresh++] = NULL;
			w.rec->owner = b->o;
			w.rec->addr = w.addr;
			w.rec->len = w.len;
			memcpy(w.rec->orig, w.old, w.len);
		}
		b->tw[n++] = w;
	}
	if (n)
		ki_arch_poke_text_batch(b->tw, n);
	for (i = 0; i < n; i++)
		ki_splice_log(b->tw[i].rec, b->tw[i].fresh, b->tw[i].new);
	for (i = 0; i < b->nr; i++)
		if (!b->r[i].patch && b->r[i].route)
			ki_route_unhash(&b->r[i], &gone);
	if (!list_empty(&gone)) {
		ki_sync();	/* no CPU is still in the handler with a retired route */
		list_for_each_entry_safe(r, next, &gone, node)
			kfree(r);
	}
}

static void ki_batch_free(struct ki_batch *b)
{
	u32 i;

	for (i = 0; i < b->nr; i++)
		if (b->r[i].patch)
			kfree(b->r[i].route);	/* reserved, not published */
	for (i = 0; i < b->nfresh; i++)
		kfree(b->fresh[i]);
	kvfree(b->r);
	kvfree(b->rsorted);
	kvfree(b->w);
	kvfree(b->wsorted);
	kvfree(b->tw);
	kvfree(b->bytes);
	kvfree(b->fresh);
}

/*
 * Copy a poke request in and reserve what it may need, before any lock: the
 * routes it adds, a record for each write that may go into text.
 */
static int ki_batch_load(struct ki_batch *b, const struct kerninst_poke *req)
{
	struct kerninst_write *uw = NULL;
	struct kerninst_route *ur = NULL;
	u64 total = 0;
	u32 i;
	int ret = 0;

	b->nr = req->nr_routes;
	b->nw = req->nr_writes;
	if (b->nr) {
		ur = vmemdup_user(u64_to_user_ptr(req->routes), array_size(b->nr, sizeof(*ur)));
		if (IS_ERR(ur))
			return PTR_ERR(ur);
	}
	if (b->nw) {
		uw = vmemdup_user(u64_to_user_ptr(req->writes), array_size(b->nw, sizeof(*uw)));
		if (IS_ERR(uw)) {
			kvfree(ur);
			return PTR_ERR(uw);
		}
	}
	for (i = 0; i < b->nw; i++) {
		if (!uw[i].len || uw[i].len > KERNINST_MAX_CODE_WRITE) {
			ret = -EINVAL;
			goto out;
		}
		total += uw[i].len;
	}
	if (total > KERNINST_MAX_POKE_BYTES) {
		ret = -EINVAL;
		goto out;
	}
	b->r = kvcalloc(b->nr, sizeof(*b->r), GFP_KERNEL);
	b->rsorted = kvmalloc_array(b->nr, sizeof(u32), GFP_KERNEL);
	b->w = kvcalloc(b->nw, sizeof(*b->w), GFP_KERNEL);
	b->wsorted = kvmalloc_array(b->nw, sizeof(u32), GFP_KERNEL);
	b->tw = kvmalloc_array(b->nw, sizeof(*b->tw), GFP_KERNEL);
	b->bytes = kvmalloc(2 * total + 1, GFP_KERNEL);
	b->fresh = kvcalloc(b->nw, sizeof(*b->fresh), GFP_KERNEL);
	if ((b->nr && (!b->r || !b->rsorted)) ||
	    (b->nw && (!b->w || !b->wsorted || !b->tw || !b->fresh)) || !b->bytes) {
		ret = -ENOMEM;
		goto out;
	}
	for (i = 0; i < b->nr; i++) {
		b->r[i].site = ur[i].site;
		b->r[i].patch = ur[i].patch;
		b->rsorted[i] = i;
		if (b->r[i].patch) {
			b->r[i].route = kzalloc(sizeof(*b->r[i].route), GFP_KERNEL);
			if (!b->r[i].route) {
				ret = -ENOMEM;
				goto out;
			}
		}
	}
	total = 0;
	for (i = 0; i < b->nw; i++) {
		struct ki_write *w = &b->w[i];
		u8 *old = b->bytes + 2 * total;

		w->addr = uw[i].address;
		w->len = uw[i].len;
		w->old = old;
		w->new = old + w->len;
		b->wsorted[i] = i;
		total += w->len;
		if (copy_from_user(old, u64_to_user_ptr(uw[i].old_buf), w->len) ||
		    copy_from_user(old + w->len, u64_to_user_ptr(uw[i].new_buf), w->len)) {
			ret = -EFAULT;
			goto out;
		}
		/* A write that may go into text may start a record. */
		if (w->len <= KERNINST_MAX_TEXT_WRITE) {
			b->fresh[b->nfresh] = kzalloc(sizeof(**b->fresh), GFP_KERNEL);
			if (!b->fresh[b->nfresh]) {
				ret = -ENOMEM;
				goto out;
			}
			b->nfresh++;
		}
	}
out:
	kvfree(ur);
	kvfree(uw);
	return ret;
}

static long ki_ioc_poke(struct kerninst_poke __user *uarg)
{
	struct kerninst_poke req;
	struct ki_batch b = {};
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (req.nr_writes > KERNINST_MAX_WRITES || req.nr_routes > KERNINST_MAX_WRITES)
		return -EINVAL;
	ret = ki_batch_load(&b, &req);
	if (ret)
		goto out;

	mutex_lock(&ki_lock);
	b.o = ki_owner_find(req.owner);
	if (!b.o) {
		ret = -ESRCH;
		goto unlock_owner;
	}
	sort_r(b.rsorted, b.nr, sizeof(u32), ki_cmp_rop, NULL, &b);
	sort_r(b.wsorted, b.nw, sizeof(u32), ki_cmp_write, NULL, &b);
	ki_arch_cpus_lock();
	ki_hazard_lock();
	mutex_lock(ki_text_mutex);
	/* All or nothing: every change checked, everything reserved, every old byte compared. */
	ret = ki_check_rops(&b);
	if (!ret)
		ret = ki_check_writes(&b);
	if (!ret)
		ret = ki_check_old(&b);
	if (!ret)
		ret = ki_check_int3_routes(&b);
	if (!ret)
		ki_apply(&b);
	mutex_unlock(ki_text_mutex);
	ki_hazard_unlock();
	ki_arch_cpus_unlock();
unlock_owner:
	mutex_unlock(&ki_lock);
	if (ret == -ESTALE || ret == -ENOEXEC) {
		req.failed_index = b.failed;
		if (copy_to_user(uarg, &req, sizeof(req)))
			ret = -EFAULT;
	}
out:
	ki_batch_free(&b);
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
	struct ki_block *b, *btmp;
	unsigned int left;

	ki_arch_cpus_lock();
	mutex_lock(ki_text_mutex);
	left = ki_unsplice_where(ki_splice_of, o);
	mutex_unlock(ki_text_mutex);
	ki_arch_cpus_unlock();
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
	bool freed = false;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size)
		return -EINVAL;
	if (req.region != KERNINST_REGION_CODE && req.region != KERNINST_REGION_DATA)
		return -EINVAL;
	b = kzalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	mutex_lock(&ki_lock);
	if (!ki_area_of(req.region, req.address, req.size)) {
		ret = -ERANGE;
		goto unlock;
	}
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
	/* A freed block is handed out again only once no task can still run in (or write) it. */
	if (freed)
		ki_quiesce_locked();
	/* ... and a code block holding only the fill (kerninst.h: CLAIM), whatever freed
	 * patch code left there: a client knows its bytes without reading them. */
	if (req.region == KERNINST_REGION_CODE) {
		mutex_lock(ki_text_mutex);
		ki_arch_refill_code(req.address, req.size);
		mutex_unlock(ki_text_mutex);
	}
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

/*
 * Whether patch code of @o may run: a trap route or a live jump in text into
 * one of its code blocks (ki_block_reached).  The module cannot tell which data
 * blocks that code writes (x86-64 code holds their addresses as displacements
 * or immediates, AArch64 code as MOVZ/MOVK immediates, and a client's own word
 * would not bind the clients this protects against), so while any of it is
 * live every data block of @o counts as written.
 */
static bool ki_owner_patch_live(const struct ki_owner *o)
{
	const struct ki_block *b;

	list_for_each_entry(b, &ki_blocks, node)
		if (b->region == KERNINST_REGION_CODE && b->owner == o && ki_block_reached(b))
			return true;
	return false;
}

/*
 * FREE: a code block is refused (-EBUSY) while a route or a live jump leads
 * into it; a data block (-ETXTBSY) while its owner has any live patch code
 * (ki_owner_patch_live), which may write it: freed, the block would go to
 * another client's next allocation while that code still writes it.
 */
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
	else if (b->region == KERNINST_REGION_DATA && ki_owner_patch_live(o))
		ret = -ETXTBSY;
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

static int ki_state_areas(struct kerninst_area __user *out, u32 room, u32 *n)
{
	struct kerninst_area e;
	struct ki_area *a;

	*n = 0;
	list_for_each_entry(a, &ki_areas, node) {
		if (*n < room) {
			e = (struct kerninst_area){ .address = a->start, .size = a->size,
						    .region = a->region };
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
	if (!ret)
		ret = ki_state_areas(u64_to_user_ptr(req.areas), req.nr_areas, &req.nr_areas);
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
	ret = ki_read_locked();
	if (ret)
		return ret;
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

/*
 * READ_ROWS and DIGEST_ROWS: each row read a KERNINST_MAX_IO piece at a time
 * (copy_from_kernel_nofault: no oops on an unmapped address), then copied out
 * or hashed (XXH64: a tenth of BLAKE2s's time, which an emulated guest spent
 * 30 ms on for the 800 KB of text a command's callees reach).  A row that
 * cannot be read is reported in the failed bitmap, with zeros in its place;
 * only a bad user buffer fails the request.
 */
static long ki_ioc_rows(unsigned int cmd, struct kerninst_rows __user *uarg)
{
	bool digest = cmd == KERNINST_IOC_DIGEST_ROWS;
	struct kerninst_rows req;
	u64 *rows = NULL, *failed = NULL;
	u8 *buf = NULL;
	u64 total = 0, at = 0;
	size_t words;
	u32 i;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.count || req.count > KERNINST_MAX_ROWS || req.reserved)
		return -EINVAL;
	ret = ki_read_locked();
	if (ret)
		return ret;
	words = BITS_TO_U64(req.count);
	rows = kvmalloc_array(req.count, 2 * sizeof(u64), GFP_KERNEL);
	failed = kvcalloc(words, sizeof(u64), GFP_KERNEL);
	buf = kmalloc(KERNINST_MAX_IO, GFP_KERNEL);
	if (!rows || !failed || !buf) {
		ret = -ENOMEM;
		goto out;
	}
	if (copy_from_user(rows, u64_to_user_ptr(req.rows), req.count * 2 * sizeof(u64))) {
		ret = -EFAULT;
		goto out;
	}
	for (i = 0; i < req.count; i++) {
		u64 len = rows[2 * i + 1];

		if (!len || len > KERNINST_MAX_ROWS_BYTES || rows[2 * i] + len < rows[2 * i]) {
			ret = -EINVAL;
			goto out;
		}
		total += len;
	}
	if (total > KERNINST_MAX_ROWS_BYTES ||
	    req.out_size != (digest ? (u64)req.count * KERNINST_DIGEST_SIZE : total)) {
		ret = -EINVAL;
		goto out;
	}
	for (i = 0; i < req.count; i++) {
		u64 address = rows[2 * i], len = rows[2 * i + 1], done = 0;
		u8 __user *dst = (u8 __user *)u64_to_user_ptr(req.out) + at;
		u8 sum[KERNINST_DIGEST_SIZE] = { 0 };
		struct xxh64_state state;
		bool bad = !ki_canonical(address) || !ki_canonical(address + len - 1);

		if (digest)
			xxh64_reset(&state, 0);
		while (!bad && done < len) {
			size_t n = min_t(u64, len - done, KERNINST_MAX_IO);

			if (copy_from_kernel_nofault(buf, (void *)(unsigned long)(address + done), n)) {
				bad = true;
			} else if (digest) {
				xxh64_update(&state, buf, n);
			} else if (copy_to_user(dst + done, buf, n)) {
				ret = -EFAULT;
				goto out;
			}
			done += n;
		}
		if (bad) {
			failed[i / 64] |= 1ULL << (i % 64);
			if (!digest && clear_user(dst, len)) {
				ret = -EFAULT;
				goto out;
			}
		} else if (digest) {
			put_unaligned_le64(xxh64_digest(&state), sum);
		}
		if (digest && copy_to_user(dst, sum, sizeof(sum))) {
			ret = -EFAULT;
			goto out;
		}
		at += digest ? KERNINST_DIGEST_SIZE : len;
		cond_resched();
	}
	if (copy_to_user(u64_to_user_ptr(req.failed), failed, words * sizeof(u64)))
		ret = -EFAULT;
out:
	kfree(buf);
	kvfree(failed);
	kvfree(rows);
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
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	/* Data only: text changes go through the poke protocol. */
	if (!ki_in_data(req.address, req.size))
		ret = -ERANGE;
	else
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
		.code_start = ki_first_code->start,
		.code_size = ki_first_code->size,
		.data_start = ki_first_data->start,
		.data_size = ki_first_data->size,
		.task_pid_offset = offsetof(struct task_struct, pid),
		.task_pid_size = sizeof(pid_t),
		.nr_cpus = num_online_cpus(),
		.task_tgid_offset = offsetof(struct task_struct, tgid),
		.task_comm_offset = offsetof(struct task_struct, comm),
		.version = KERNINST_ABI_VERSION,
	};

	BUILD_BUG_ON(sizeof(((struct task_struct *)NULL)->comm) != 16);
	ki_arch_info(&info);
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
	struct ki_route *r;
	struct ki_owner *o;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, KI_TRAP_LEN))
		return -ERANGE;
	r = kzalloc(sizeof(*r), GFP_KERNEL);
	if (!r)
		return -ENOMEM;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	ki_hazard_lock();
	ret = o ? ki_check_trap(o, req.site, req.patch, NULL) : -ESRCH;
	ki_hazard_unlock();
	if (!ret && ki_nroutes >= READ_ONCE(max_routes))
		ret = -ENOSPC;
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
	struct ki_route *r = NULL;
	long ret;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!ki_in_text(req.site, KI_TRAP_LEN))
		return -ERANGE;
	mutex_lock(&ki_lock);
	o = ki_owner_find(req.owner);
	/* Retiring the route while its int3 is in text would let a hit oops. */
	if (o) {
		struct ki_batch alone = { .o = o };	/* no writes of its own */

		ret = ki_check_untrap(&alone, req.site, &r);
	} else {
		ret = -ESRCH;
	}
	if (!ret)
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

/* ------------------------------------------------------------------------- */
/* areas                                                                      */

/*
 * A new area of @region, at least @size bytes: module_alloc memory (within
 * rel32 reach of kernel text).  Patch code is filled with int3, so that a
 * stray jump into unused space traps instead of running garbage, and is never
 * writable and executable at once: RO first, then X (STRICT_MODULE_RWX).
 */
static struct ki_area *ki_area_new(u32 region, unsigned long size)
{
	struct ki_area *a = kzalloc(sizeof(*a), GFP_KERNEL);
	void *base;

	if (!a)
		return NULL;
	size = PAGE_ALIGN(size);
	base = ki_module_alloc(size);
	if (!base) {
		kfree(a);
		return NULL;
	}
	a->start = (unsigned long)base;
	a->size = size;
	a->region = region;
	if (region == KERNINST_REGION_CODE) {
		ki_arch_fill_code(base, size);
		ki_set_memory_ro(a->start, size >> PAGE_SHIFT);
		ki_set_memory_x(a->start, size >> PAGE_SHIFT);
	} else {
		memset(base, 0, size);
	}
	list_add_tail(&a->node, &ki_areas);
	ki_area_bytes += size;
	return a;
}

static void ki_area_free(struct ki_area *a)
{
	if (a->region == KERNINST_REGION_CODE) {
		ki_set_memory_nx(a->start, a->size >> PAGE_SHIFT);
		ki_set_memory_rw(a->start, a->size >> PAGE_SHIFT);
	}
	ki_module_memfree((void *)a->start);
	list_del(&a->node);
	ki_area_bytes -= a->size;
	kfree(a);
}

/* Whether a block (held or in quarantine), a route or a live jump is inside area @a. */
static bool ki_area_used(const struct ki_area *a)
{
	const struct ki_splice *s;
	struct ki_block *b;
	struct ki_route *r;
	unsigned long dest;
	int bkt;

	list_for_each_entry(b, &ki_blocks, node)
		if (b->region == a->region && ki_overlaps(b->addr, b->size, a->start, a->size))
			return true;
	if (a->region != KERNINST_REGION_CODE)
		return false;
	hash_for_each(ki_routes, bkt, r, hnode)
		if (ki_in(r->patch, 1, a->start, a->start + a->size))
			return true;
	list_for_each_entry(s, &ki_splices, node) {
		dest = ki_jump_dest(s->addr, s->cur, s->len);
		if (dest && ki_in(dest, 1, a->start, a->start + a->size))
			return true;
	}
	return false;
}

static long ki_ioc_area_add(struct kerninst_area __user *uarg)
{
	struct kerninst_area req;
	struct ki_area *a;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if (!req.size || req.size > KERNINST_MAX_AREA_BYTES * 16UL ||
	    (req.region != KERNINST_REGION_CODE && req.region != KERNINST_REGION_DATA))
		return -EINVAL;
	mutex_lock(&ki_lock);
	if (ki_area_bytes + PAGE_ALIGN(req.size) > READ_ONCE(max_area_bytes)) {
		ret = -ENOSPC;
	} else {
		a = ki_area_new(req.region, req.size);
		if (!a) {
			ret = -ENOMEM;
		} else {
			req.address = a->start;
			req.size = a->size;
		}
	}
	mutex_unlock(&ki_lock);
	if (!ret && copy_to_user(uarg, &req, sizeof(req)))
		ret = -EFAULT;	/* the area stays, empty: STATE lists it, AREA_DROP gives it back */
	return ret;
}

static long ki_ioc_area_drop(struct kerninst_area __user *uarg)
{
	struct kerninst_area req;
	struct ki_area *a;
	long ret = 0;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	mutex_lock(&ki_lock);
	a = ki_area_of(req.region, req.address, 1);
	if (!a || a->start != req.address)
		ret = -ENOENT;
	else if (a->first || ki_area_used(a))
		ret = -EBUSY;
	else
		ki_area_free(a);
	mutex_unlock(&ki_lock);
	return ret;
}

static long ki_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	/*
	 * Every command but VERSION reads or changes any kernel memory: the caller
	 * needs CAP_SYS_ADMIN, as at open, also when it holds a descriptor someone
	 * else opened or has dropped the capability since (-EACCES: -EPERM is the
	 * hazards' errno).
	 */
	if (cmd != KERNINST_IOC_VERSION && !capable(CAP_SYS_ADMIN))
		return -EACCES;
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
	case KERNINST_IOC_AREA_ADD:
		return ki_ioc_area_add(uarg);
	case KERNINST_IOC_AREA_DROP:
		return ki_ioc_area_drop(uarg);
	case KERNINST_IOC_READ_ROWS:
	case KERNINST_IOC_DIGEST_ROWS:
		return ki_ioc_rows(cmd, uarg);
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
	/* Root without CAP_SYS_ADMIN (a container, a dropped bounding set) may not splice. */
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
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
	ki_first_code = ki_area_new(KERNINST_REGION_CODE, KI_CODE_SIZE);
	ki_first_data = ki_area_new(KERNINST_REGION_DATA, KI_DATA_SIZE);
	if (!ki_first_code || !ki_first_data)
		return -ENOMEM;
	ki_first_code->first = true;
	ki_first_data->first = true;
	return 0;
}

/* Free every area; with @keep_code, patch areas stay allocated (text may still jump there). */
static void ki_free_regions(bool keep_code)
{
	struct ki_area *a, *tmp;

	list_for_each_entry_safe(a, tmp, &ki_areas, node) {
		if (keep_code && a->region == KERNINST_REGION_CODE) {
			list_del(&a->node);
			kfree(a);
			continue;
		}
		ki_area_free(a);
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

	if (state == MODULE_STATE_LIVE) {	/* its init may have registered a die notifier */
		mutex_lock(&ki_lock);
		ki_find_die_ahead();
		mutex_unlock(&ki_lock);
		return NOTIFY_DONE;
	}
	if (state != MODULE_STATE_GOING)
		return NOTIFY_DONE;
	mutex_lock(&ki_lock);
	ki_find_die_ahead();	/* its exit has unregistered its die notifiers by now */
	list_for_each_entry_safe(s, tmp, &ki_splices, node) {
		if (!within_module(s->addr, mod))
			continue;
		ki_splice_forget(s);
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
	unsigned int left;

	ki_arch_cpus_lock();
	mutex_lock(ki_text_mutex);
	left = ki_unsplice_where(ki_splice_any, NULL);
	list_for_each_entry_safe(s, tmp, &ki_splices, node)
		ki_splice_forget(s);
	mutex_unlock(ki_text_mutex);
	ki_arch_cpus_unlock();
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
	ki_index_core_tables();
	ki_arch_index();
	ret = ki_arch_trap_register();
	if (ret)
		goto fail;
	ret = register_module_notifier(&ki_module_nb);
	if (ret) {
		ki_arch_trap_unregister();
		goto fail;
	}
	ret = misc_register(&ki_dev);
	if (ret) {
		unregister_module_notifier(&ki_module_nb);
		ki_arch_trap_unregister();
		goto fail;
	}
	pr_info("abi %d: text %#lx-%#lx, patch area %#lx+%#lx, data heap %#lx+%#lx, hazard checks %s\n",
		KERNINST_ABI_VERSION, ki_text_start, ki_text_end,
		ki_first_code->start, ki_first_code->size, ki_first_data->start, ki_first_data->size,
		ki_unchecked ? "INCOMPLETE (text pokes refused)" : "complete");
	return 0;
fail:
	ki_free_regions(false);
	kvfree(ki_core_hz);
	ki_arch_index_free();
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
	ki_arch_trap_unregister();
	synchronize_rcu_tasks();
	if (left)
		/* Text may still jump there: better a leak than a jump into freed memory. */
		pr_err("%u text writes could not be undone; the patch areas stay allocated\n", left);
	ki_free_regions(left != 0);
	kvfree(ki_core_hz);
	ki_arch_index_free();
	ki_bl_memo_free();
	pr_info("unloaded (%u kept owners undone, %d trap hits dispatched)\n", owners,
		atomic_read(&ki_trap_hits));
}

module_init(ki_init);
module_exit(ki_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("ksim live-kernel driver: memory access, text poking, trap dispatch");
MODULE_VERSION("4");
