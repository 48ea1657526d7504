/* SPDX-License-Identifier: GPL-2.0 */
/*
 * kerninst.h - the ioctl ABI of /dev/kerninst, ksim's live-kernel driver.
 *
 * This header is the single definition of the ABI.  ksim/live/abi.py mirrors it as
 * a table (tests/test_kmod_abi.py checks that the two agree).  Every structure
 * is made of fixed-size little-endian fields with explicit padding so that the
 * layout is the same for every compiler; pointers to user buffers travel as u64.
 *
 * Versioning: KERNINST_ABI_VERSION changes whenever a structure or a command
 * changes meaning.  kerninstd refuses to run against a module whose
 * KERNINST_IOC_VERSION answer differs from the version it was built for.
 *
 * Owners: the module is the last arbiter of who may change what.  Every live
 * text write, trap route and patch-area or data-heap block belongs to one
 * owner, a number the module hands out (KERNINST_IOC_OWNER_NEW); kerninstd
 * makes one per client session and names it in every request that changes
 * something.  A request over bytes, a route or a block another owner holds is
 * refused (-EADDRINUSE).  An owner is dropped (everything it holds undone) when
 * its session ends, or when the device is closed, unless it is kept: a kept
 * owner has a name, survives kerninstd, and is listed (KERNINST_IOC_STATE),
 * re-adopted by name (KERNINST_IOC_OWNER_ADOPT) or dropped by a later session.
 *
 * Privilege and lockdown: open needs CAP_SYS_ADMIN (-EPERM), and so does every
 * command but VERSION (-EACCES: the caller may hold a descriptor it did not open,
 * or have dropped the capability since).  In a locked-down kernel
 * (security_locked_down: LOCKDOWN_DBG_WRITE_KERNEL, integrity) nothing is
 * changed -- a write into text or the patch area, a trap route set -- and under
 * confidentiality nothing is read (LOCKDOWN_DBG_READ_KERNEL): -EROFS.  Undo
 * (restoring text, clearing routes, dropping owners) is never refused.
 *
 * Jumps: a write into text that makes a jump (x86-64: jmp rel32 or rel8 from its
 * first byte, a single e9/eb byte completing one, or new displacement bytes of a
 * jump ksim wrote; arm64: a B or BL instruction it writes) must lead into kernel
 * or module text or into a patch block of the writing owner: -EADDRINUSE into
 * another owner's block, -ENOEXEC anywhere else.
 *
 * Architectures: x86-64 and arm64, with the same structures and commands.  On
 * arm64 a text write and a trap site are whole instructions (4-byte aligned
 * address and length, else -EINVAL), the trap is BRK #KERNINST_ARM64_BRK_IMM,
 * a batch's text writes all go in at once under stop_machine (as
 * aarch64_insn_patch_text does), and the per-cpu offsets of INFO are from
 * TPIDR_EL1's per-cpu base (current_task: a per-cpu slot holding the current
 * task, __entry_task's; 0 when none was found).
 */
#ifndef KERNINST_H
#define KERNINST_H

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/ioctl.h>
#else
#include <stdint.h>
#include <sys/ioctl.h>
typedef uint8_t __u8;
typedef uint32_t __u32;
typedef uint64_t __u64;
#endif

#define KERNINST_ABI_VERSION 7
#define KERNINST_DEVICE "kerninst"
#define KERNINST_IOC_MAGIC 'K'

/* Limits (also enforced by the module). */
#define KERNINST_MAX_IO 65536        /* bytes per read/write request */
#define KERNINST_MAX_WRITES 262144   /* writes per poke batch (and route changes) */
#define KERNINST_MAX_POKE_BYTES (16 << 20) /* new bytes per poke batch, its writes together */
#define KERNINST_MAX_TEXT_WRITE 16   /* bytes per write into kernel text */
#define KERNINST_MAX_CODE_WRITE 4096 /* bytes per write into the patch area */
#define KERNINST_MAX_ROUTES 65536    /* trap routes at once: default of parameter max_routes */
#define KERNINST_MAX_SPLICES 65536   /* live text writes at once: default of parameter max_splices */
#define KERNINST_NAME_LEN 128        /* symbol or kept-owner name, NUL included */
#define KERNINST_MAX_RANGES 1024     /* ranges per HAZARDS request */
#define KERNINST_MAX_AREA_BYTES (256 << 20) /* patch area and heap, all areas: default of parameter max_area_bytes */
#define KERNINST_MAX_ROWS 262144     /* rows per READ_ROWS or DIGEST_ROWS request */
#define KERNINST_MAX_ROWS_BYTES (32 << 20) /* bytes such a request reads, its rows together */
#define KERNINST_DIGEST_SIZE 8       /* bytes of a DIGEST_ROWS row's digest */

/*
 * Hazards: why the kernel relies on text staying as it is.  The checks are
 * those kprobes makes before it touches text (check_kprobe_address_safe() in
 * kernel/kprobes.c, and can_optimize() in arch/x86/kernel/kprobes/opt.c for
 * the exception tables).  POKE refuses a write into text with any of them
 * (-EPERM), except a write that restores the original bytes of an earlier one.
 */
#define KERNINST_HAZARD_FTRACE      (1u << 0) /* an ftrace location (ftrace_location_range) */
#define KERNINST_HAZARD_JUMP_LABEL  (1u << 1) /* a jump-label site (jump_label_text_reserved) */
#define KERNINST_HAZARD_STATIC_CALL (1u << 2) /* a static-call site (static_call_text_reserved) */
#define KERNINST_HAZARD_KPROBE      (1u << 3) /* a kprobe at a byte of the range or <= 4 bytes before */
#define KERNINST_HAZARD_BLACKLIST   (1u << 4) /* kprobes blacklist, entry/noinstr/kprobes text, kerninst */
#define KERNINST_HAZARD_EXTABLE     (1u << 5) /* an instruction with an exception-table entry starts here */
#define KERNINST_HAZARD_BUG         (1u << 6) /* the ud2 of a BUG() (find_bug) */
#define KERNINST_HAZARD_WARN        (1u << 7) /* the ud2 of a WARN() (find_bug, BUGFLAG_WARNING) */
#define KERNINST_HAZARD_NOT_TEXT    (1u << 8) /* neither core kernel text nor one live module's text */
#define KERNINST_HAZARD_UNKNOWN     (1u << 9) /* a check could not be made (a kernel symbol is missing) */
/* arm64 only (an x86-64 module never sets them): */
#define KERNINST_HAZARD_BRANCH_PROT (1u << 10) /* a BTI landing pad, or a pointer-authentication
						* check kprobes refuses to step (autiasp, retaa, ...) */
#define KERNINST_HAZARD_EXCLUSIVE   (1u << 11) /* after a load-exclusive, before its store-exclusive
						* (kprobes' is_probed_address_atomic) */

/*
 * The trap ksim routes: int3 (0xcc) on x86-64; on arm64 BRK with this
 * immediate, one no kernel user takes (arch/arm64/include/asm/brk-imm.h:
 * kprobes 0x004-0x006, FAULT 0x100, kgdb 0x400-0x7ff, BUG/WARN 0x800, KASAN
 * 0x900-0x9ff, CFI 0x8000-0x83ff).
 */
#define KERNINST_ARM64_BRK_IMM 0x2b5

/*
 * What every byte of unused patch code holds: x86-64's int3; on arm64 the
 * instruction BRK #0x100 (AARCH64_BREAK_FAULT, as the BPF JIT fills its holes),
 * little-endian.  A code block CLAIM hands out holds nothing else, whatever patch
 * code of a freed block was there before: a client knows a new block's bytes
 * without reading them.
 */
#define KERNINST_CODE_FILL_X86_64 0xcc
#define KERNINST_CODE_FILL_ARM64 0xd4202000

struct kerninst_version {
	__u32 version;   /* KERNINST_ABI_VERSION of the loaded module */
	__u32 reserved;
};

struct kerninst_info {
	__u64 text_start;        /* _stext */
	__u64 text_end;          /* _etext */
	__u64 code_start;        /* the first patch area: executable, within +-2 GB of text */
	__u64 code_size;         /* (more areas are added on demand: AREA_ADD, STATE) */
	__u64 data_start;        /* the first data heap area: read/write, within +-2 GB of text */
	__u64 data_size;
	__u64 current_task;      /* per-cpu offset of current_task (reached as gs:offset) */
	__u64 cpu_number;        /* per-cpu offset of cpu_number */
	__u32 task_pid_offset;   /* offsetof(struct task_struct, pid) */
	__u32 task_pid_size;     /* sizeof(pid_t) */
	__u32 nr_cpus;           /* num_online_cpus() at load */
	__u32 version;           /* KERNINST_ABI_VERSION */
	__u32 task_tgid_offset;  /* offsetof(struct task_struct, tgid): a process's pid */
	__u32 task_comm_offset;  /* offsetof(struct task_struct, comm): char[TASK_COMM_LEN] */
};

/* Read kernel memory (any address) or write a data-heap block of owner (only). */
struct kerninst_mem {
	__u64 address;
	__u64 buf;      /* user pointer */
	__u64 size;     /* <= KERNINST_MAX_IO */
	__u64 owner;    /* WRITE: the block's owner; READ: ignored */
};

/* One write of a poke batch: replace old by new at address (len bytes each). */
struct kerninst_write {
	__u64 address;
	__u64 old_buf;  /* user pointer to len expected bytes */
	__u64 new_buf;  /* user pointer to len new bytes */
	__u32 len;
	__u32 reserved;
};

/* One route change of a poke batch: route an int3 at site to patch, or (patch 0) no more. */
struct kerninst_route {
	__u64 site;
	__u64 patch;    /* a patch-area block of the owner; 0: clear the owner's route at site */
};

/*
 * A poke batch by owner, applied all or nothing: its route changes first, in
 * order (each as SET_TRAP or CLEAR_TRAP would make it), then its writes, all
 * at once.  Every route change and every write is checked (range, hazards,
 * who holds the bytes, old bytes) and everything the batch needs (routes,
 * splice-log records with their temporary trap routes) is reserved before the
 * first byte changes.  The writes into text go in with one int3 -> sync ->
 * tail -> sync -> head -> sync sequence for the whole batch, as
 * text_poke_bp_batch does (arm64: under stop_machine, as
 * aarch64_insn_patch_text does).  On -ESTALE, failed_index names the write whose old
 * bytes differ from memory; on -ENOEXEC, the write whose jump leads outside.
 */
struct kerninst_poke {
	__u64 writes;   /* user pointer to nr_writes struct kerninst_write */
	__u64 routes;   /* user pointer to nr_routes struct kerninst_route */
	__u64 owner;
	__u32 nr_writes;     /* <= KERNINST_MAX_WRITES */
	__u32 nr_routes;     /* <= KERNINST_MAX_WRITES */
	__u32 failed_index;  /* out */
	__u32 reserved;
};

struct kerninst_lookup {
	char name[KERNINST_NAME_LEN];
	__u64 address;  /* out: 0 when unknown (-ENOENT) */
};

/* Route an int3 at site (kernel text) to patch (a patch-area block of owner). */
struct kerninst_trap {
	__u64 site;
	__u64 patch;    /* CLEAR_TRAP: ignored */
	__u64 owner;
};

/* One range of a HAZARDS request: [address, address + len), len 1..KERNINST_MAX_TEXT_WRITE. */
struct kerninst_range {
	__u64 address;
	__u32 len;
	__u32 hazards;  /* out: KERNINST_HAZARD_* */
};

/* Ask the kernel about count ranges at once; each answer lands in its range's hazards. */
struct kerninst_hazards {
	__u64 ranges;   /* user pointer to count struct kerninst_range */
	__u32 count;    /* 1..KERNINST_MAX_RANGES */
	__u32 reserved;
};

/*
 * Many reads in one request: count rows at rows, each two u64 (address, length),
 * length >= 1 and KERNINST_MAX_ROWS_BYTES in all.  READ_ROWS puts the rows' bytes
 * end to end at out; DIGEST_ROWS puts each row's KERNINST_DIGEST_SIZE-byte XXH64
 * at out instead (lib/xxhash.c, seed 0, little-endian: what xxhash.xxh64_intdigest
 * gives, as 8 little-endian bytes), so that a client checks
 * text against what it knows without the bytes leaving the kernel.  out_size is
 * what that takes (the rows' lengths together, or 8 bytes a row).  A row that
 * cannot be read (unmapped, or a user address) is zeros, its digest too, and its
 * bit is set in failed: a bitmap of count bits, bit i in u64 word i / 64.
 */
struct kerninst_rows {
	__u64 rows;      /* user pointer to count (u64 address, u64 length) pairs */
	__u64 out;       /* user pointer to out_size bytes */
	__u64 out_size;
	__u64 failed;    /* user pointer to (count + 63) / 64 u64 words (out) */
	__u32 count;     /* 1..KERNINST_MAX_ROWS */
	__u32 reserved;
};

/* Owners (see the top of this file). */
#define KERNINST_OWNER_KEPT   (1u << 0) /* outlives its session; re-adopted by name */
#define KERNINST_OWNER_ORPHAN (1u << 1) /* a drop could not undo all its text: kept, never reused */

struct kerninst_owner {
	__u64 id;                      /* OWNER_NEW: out; the others: in */
	__u32 flags;                   /* KERNINST_OWNER_* (STATE: out) */
	__u32 reserved;
	char name[KERNINST_NAME_LEN];  /* OWNER_KEEP: the name to keep under ("": keep no more);
					* OWNER_ADOPT: the kept owner to take over */
};

/* The two regions a block is claimed in. */
#define KERNINST_REGION_CODE 1         /* patch area */
#define KERNINST_REGION_DATA 2         /* data heap */

/*
 * A block of the patch area or of the data heap.  kerninstd allocates; the
 * module records who holds each block (CLAIM, FREE), so that pokes, trap
 * routes and heap writes stay inside their owner's blocks and a restarted
 * kerninstd never hands out a block a kept owner still uses.  A freed patch
 * block is held by no one (owner 0) until QUIESCE: a task may still be running
 * in it.
 */
struct kerninst_block {
	__u64 owner;
	__u64 address;
	__u64 size;
	__u32 region;   /* KERNINST_REGION_* */
	__u32 reserved;
};

/*
 * An area of the patch area or of the data heap.  The module makes one of
 * each at load (INFO names them) and more on demand (AREA_ADD): module_alloc
 * memory, within rel32 reach of kernel text (arm64: module space, within a
 * B's +-128 MB of it without KASLR), patch areas filled with int3 (arm64: BRK
 * #0x100) and never writable and executable at once.  An added area that holds no block
 * goes back (AREA_DROP).
 */
struct kerninst_area {
	__u64 address;  /* AREA_ADD: out; AREA_DROP: in */
	__u64 size;     /* AREA_ADD: in (rounded up to pages), out */
	__u32 region;   /* KERNINST_REGION_* */
	__u32 reserved;
};

/* One live text write, as STATE lists it: orig is what unload or a drop puts back. */
struct kerninst_splice {
	__u64 owner;
	__u64 address;
	__u32 len;
	__u32 reserved;
	__u8 orig[KERNINST_MAX_TEXT_WRITE];
	__u8 cur[KERNINST_MAX_TEXT_WRITE];
};

/*
 * The module's log: every owner, live text write (oldest first), trap route,
 * block and area.  Each nr_* says, in, how many entries its user array has room
 * for and, out, how many there are; only as many as fit are written, so a
 * caller that finds nr_* grown past its room asks again with more.
 */
struct kerninst_state {
	__u64 owners;   /* user pointer to struct kerninst_owner[nr_owners] */
	__u64 splices;  /* struct kerninst_splice[nr_splices] */
	__u64 routes;   /* struct kerninst_trap[nr_routes] */
	__u64 blocks;   /* struct kerninst_block[nr_blocks] */
	__u64 areas;    /* struct kerninst_area[nr_areas] */
	__u32 nr_owners;
	__u32 nr_splices;
	__u32 nr_routes;
	__u32 nr_blocks;
	__u32 nr_areas;
	__u32 reserved;
};

#define KERNINST_IOC_VERSION    _IOR(KERNINST_IOC_MAGIC, 0x00, struct kerninst_version)
#define KERNINST_IOC_INFO       _IOR(KERNINST_IOC_MAGIC, 0x01, struct kerninst_info)
#define KERNINST_IOC_READ       _IOW(KERNINST_IOC_MAGIC, 0x02, struct kerninst_mem)
#define KERNINST_IOC_WRITE      _IOW(KERNINST_IOC_MAGIC, 0x03, struct kerninst_mem)
#define KERNINST_IOC_POKE       _IOWR(KERNINST_IOC_MAGIC, 0x04, struct kerninst_poke)
#define KERNINST_IOC_LOOKUP     _IOWR(KERNINST_IOC_MAGIC, 0x05, struct kerninst_lookup)
#define KERNINST_IOC_SET_TRAP   _IOW(KERNINST_IOC_MAGIC, 0x06, struct kerninst_trap)
#define KERNINST_IOC_CLEAR_TRAP _IOW(KERNINST_IOC_MAGIC, 0x07, struct kerninst_trap)
/* Wait until no task can still run in freed patch code (synchronize_rcu_tasks); forget those blocks. */
#define KERNINST_IOC_QUIESCE    _IO(KERNINST_IOC_MAGIC, 0x08)
/* The hazards of text ranges (answers through the ranges' user buffer). */
#define KERNINST_IOC_HAZARDS    _IOW(KERNINST_IOC_MAGIC, 0x09, struct kerninst_hazards)
/* A new owner (for a client session). */
#define KERNINST_IOC_OWNER_NEW  _IOR(KERNINST_IOC_MAGIC, 0x0a, struct kerninst_owner)
/* Keep an owner past its session under a name, or ("") no more. */
#define KERNINST_IOC_OWNER_KEEP _IOW(KERNINST_IOC_MAGIC, 0x0b, struct kerninst_owner)
/* Owner id takes over everything the kept owner called name holds. */
#define KERNINST_IOC_OWNER_ADOPT _IOW(KERNINST_IOC_MAGIC, 0x0c, struct kerninst_owner)
/* Undo everything an owner holds: text newest first, then routes, then blocks; forget it. */
#define KERNINST_IOC_OWNER_DROP _IOW(KERNINST_IOC_MAGIC, 0x0d, struct kerninst_owner)
/* Record a block kerninstd allocated as owner's; FREE gives it back (not while it may be in use). */
#define KERNINST_IOC_CLAIM      _IOW(KERNINST_IOC_MAGIC, 0x0e, struct kerninst_block)
#define KERNINST_IOC_FREE       _IOW(KERNINST_IOC_MAGIC, 0x0f, struct kerninst_block)
/* The module's log (owners, text writes, routes, blocks). */
#define KERNINST_IOC_STATE      _IOWR(KERNINST_IOC_MAGIC, 0x10, struct kerninst_state)
/* Add an area to the patch area or the data heap; give an added, empty one back. */
#define KERNINST_IOC_AREA_ADD   _IOWR(KERNINST_IOC_MAGIC, 0x11, struct kerninst_area)
#define KERNINST_IOC_AREA_DROP  _IOW(KERNINST_IOC_MAGIC, 0x12, struct kerninst_area)
/* Read many ranges of kernel memory at once, as their bytes or as a digest of each. */
#define KERNINST_IOC_READ_ROWS  _IOW(KERNINST_IOC_MAGIC, 0x13, struct kerninst_rows)
#define KERNINST_IOC_DIGEST_ROWS _IOW(KERNINST_IOC_MAGIC, 0x14, struct kerninst_rows)

/*
 * Errors (negative errno from ioctl), each one cause:
 *   EFAULT  bad user pointer, or the kernel address cannot be read (no oops)
 *   ERANGE  the address is outside the region the command may touch (text for
 *           pokes and trap sites: core kernel text or a live module's text other
 *           than kerninst's own; a block of the owner in the patch area, for
 *           code pokes and trap patches, or in the data heap, for WRITE)
 *   ESTALE  a poke's old bytes differ from memory; nothing was written.  From
 *           OWNER_DROP: text changed behind kerninst, so some writes were left
 *           in place; the owner stays, as a kept orphan, with its blocks
 *   EADDRINUSE  the bytes, trap route or block belong to another owner (another
 *           session, or a kept owner); nothing was changed
 *   EBUSY   the owner's site already has a trap route, a trap is still in text,
 *           a multi-byte write would cover the owner's own route, a code
 *           block to free is still the target of a route or a jump, an orphan was
 *           asked to stop being kept, or an area to drop still holds a block
 *           (or is one the module made at load);
 *           from open(): the device is already open (one opener at a time)
 *   ETXTBSY FREE of a data block while its owner has live patch code (any trap
 *           route of its, or any jump in text into one of its code blocks),
 *           which may write the block; nothing was freed
 *   EEXIST  OWNER_KEEP: another kept owner has that name
 *   EPERM   the text has a hazard (KERNINST_HAZARD_*: blacklisted code, an ftrace,
 *           jump-label or static-call site, a kprobe, an exception-table or
 *           bug-table instruction, or a check that could not be made)
 *   EINVAL  malformed request (sizes, a row count or out_size that does not
 *           match its rows, overlapping writes, two changes of one
 *           route in a batch, no int3 destination: an int3 written into text
 *           needs a route at its site; arm64: a text write or trap site that is
 *           not whole 4-byte aligned instructions, a trap not written alone)
 *   ENOSPC  max_routes trap routes or max_splices text writes are live, or
 *           max_area_bytes of areas; nothing was changed
 *   ENOMEM  the kernel has no memory for a record; nothing was changed
 *   ENOENT  unknown symbol, trap route, block, area, or kept owner name
 *   ESRCH   unknown owner id
 */

#endif /* KERNINST_H */
