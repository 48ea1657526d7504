/* SPDX-License-Identifier: GPL-2.0 */
/*
 * kerninst.h - the ioctl ABI of /dev/kerninst, ksim's live-kernel driver.
 *
 * This header is the single definition of the ABI.  live/abi.py mirrors it as
 * a table (tests/test_kmod_abi.py checks that the two agree).  Every structure
 * is made of fixed-size little-endian fields with explicit padding so that the
 * layout is the same for every compiler; pointers to user buffers travel as u64.
 *
 * Versioning: KERNINST_ABI_VERSION changes whenever a structure or a command
 * changes meaning.  kerninstd refuses to run against a module whose
 * KERNINST_IOC_VERSION answer differs from the version it was built for.
 */
#ifndef KERNINST_H
#define KERNINST_H

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/ioctl.h>
#else
#include <stdint.h>
#include <sys/ioctl.h>
typedef uint32_t __u32;
typedef uint64_t __u64;
#endif

#define KERNINST_ABI_VERSION 2
#define KERNINST_DEVICE "kerninst"
#define KERNINST_IOC_MAGIC 'K'

/* Limits (also enforced by the module). */
#define KERNINST_MAX_IO 65536        /* bytes per read/write request */
#define KERNINST_MAX_WRITES 64       /* writes per poke batch */
#define KERNINST_MAX_TEXT_WRITE 16   /* bytes per write into kernel text */
#define KERNINST_MAX_CODE_WRITE 4096 /* bytes per write into the patch area */
#define KERNINST_MAX_TRAPS 512       /* trap routes at once */
#define KERNINST_MAX_SPLICES 4096    /* live text writes remembered for unload */
#define KERNINST_NAME_LEN 128        /* symbol name, NUL included */
#define KERNINST_MAX_RANGES 1024     /* ranges per HAZARDS request */

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

struct kerninst_version {
	__u32 version;   /* KERNINST_ABI_VERSION of the loaded module */
	__u32 reserved;
};

struct kerninst_info {
	__u64 text_start;        /* _stext */
	__u64 text_end;          /* _etext */
	__u64 code_start;        /* patch area: executable, within +-2 GB of text */
	__u64 code_size;
	__u64 data_start;        /* data heap: read/write, within +-2 GB of text */
	__u64 data_size;
	__u64 current_task;      /* per-cpu offset of current_task (reached as gs:offset) */
	__u64 cpu_number;        /* per-cpu offset of cpu_number */
	__u32 task_pid_offset;   /* offsetof(struct task_struct, pid) */
	__u32 task_pid_size;     /* sizeof(pid_t) */
	__u32 nr_cpus;           /* num_online_cpus() at load */
	__u32 version;           /* KERNINST_ABI_VERSION */
};

/* Read kernel memory (any address) or write the data heap (only). */
struct kerninst_mem {
	__u64 address;
	__u64 buf;      /* user pointer */
	__u64 size;     /* <= KERNINST_MAX_IO */
};

/* One write of a poke batch: replace old by new at address (len bytes each). */
struct kerninst_write {
	__u64 address;
	__u64 old_buf;  /* user pointer to len expected bytes */
	__u64 new_buf;  /* user pointer to len new bytes */
	__u32 len;
	__u32 reserved;
};

/*
 * A poke batch, applied all or nothing: every write is checked (range, old
 * bytes) before the first one is made.  On -ESTALE, failed_index names the
 * write whose old bytes differ from memory.
 */
struct kerninst_poke {
	__u64 writes;   /* user pointer to count struct kerninst_write */
	__u32 count;    /* <= KERNINST_MAX_WRITES */
	__u32 failed_index;
};

struct kerninst_lookup {
	char name[KERNINST_NAME_LEN];
	__u64 address;  /* out: 0 when unknown (-ENOENT) */
};

/* Route an int3 at site (kernel text) to patch (patch area). */
struct kerninst_trap {
	__u64 site;
	__u64 patch;
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

#define KERNINST_IOC_VERSION    _IOR(KERNINST_IOC_MAGIC, 0x00, struct kerninst_version)
#define KERNINST_IOC_INFO       _IOR(KERNINST_IOC_MAGIC, 0x01, struct kerninst_info)
#define KERNINST_IOC_READ       _IOW(KERNINST_IOC_MAGIC, 0x02, struct kerninst_mem)
#define KERNINST_IOC_WRITE      _IOW(KERNINST_IOC_MAGIC, 0x03, struct kerninst_mem)
#define KERNINST_IOC_POKE       _IOWR(KERNINST_IOC_MAGIC, 0x04, struct kerninst_poke)
#define KERNINST_IOC_LOOKUP     _IOWR(KERNINST_IOC_MAGIC, 0x05, struct kerninst_lookup)
#define KERNINST_IOC_SET_TRAP   _IOW(KERNINST_IOC_MAGIC, 0x06, struct kerninst_trap)
#define KERNINST_IOC_CLEAR_TRAP _IOW(KERNINST_IOC_MAGIC, 0x07, struct kerninst_trap)
/* Wait until no task can still be running in freed patch code (synchronize_rcu_tasks). */
#define KERNINST_IOC_QUIESCE    _IO(KERNINST_IOC_MAGIC, 0x08)
/* The hazards of text ranges (answers through the ranges' user buffer). */
#define KERNINST_IOC_HAZARDS    _IOW(KERNINST_IOC_MAGIC, 0x09, struct kerninst_hazards)

/*
 * Errors (negative errno from ioctl), each one cause:
 *   EFAULT  bad user pointer, or the kernel address cannot be read (no oops)
 *   ERANGE  the address is outside the region the command may touch (text for
 *           pokes and trap sites: core kernel text or a live module's text other
 *           than kerninst's own; the patch area; the data heap)
 *   ESTALE  a poke's old bytes differ from memory; nothing was written
 *   EBUSY   the site already has a trap route, or a trap is still in text;
 *           from open(): the device is already open (one owner at a time)
 *   EPERM   the text has a hazard (KERNINST_HAZARD_*: blacklisted code, an ftrace,
 *           jump-label or static-call site, a kprobe, an exception-table or
 *           bug-table instruction, or a check that could not be made)
 *   EINVAL  malformed request (sizes, overlapping writes, no int3 destination)
 *   ENOSPC  trap table or splice log full
 *   ENOENT  unknown symbol or trap route
 */

#endif /* KERNINST_H */
