/*
 * include/trace_events.h: trace events laid out as Linux 6.1 lays them out
 * (include/linux/trace_events.h, include/trace/trace_events.h,
 * include/trace/syscall.h), simplified to one trace array whose events are
 * always on.
 *
 * A tracepoint call, trace_sched_switch(...), goes to __traceiter_sched_switch,
 * which calls every probe registered on __tracepoint_sched_switch: here one, the
 * event class's function trace_event_raw_event_sched_switch(__data, args...),
 * with __data = the event's trace_event_file.  The class function reserves a
 * record (struct trace_event_raw_<class>) through trace_event_buffer_reserve(),
 * fills it in and calls trace_event_buffer_commit(&fbuffer): at that call the
 * record, fbuffer->entry, is complete.  Several events share a class
 * (DEFINE_EVENT): fbuffer->trace_file->event_call says which one it is.
 *
 * What ksim reads from the image (no tracefs here): the section _ftrace_events
 * (__start_ftrace_events .. __stop_ftrace_events), pointers to every event's
 * struct trace_event_call, whose class gives its system, its class function
 * (probe) and its fields_array; and __syscalls_metadata, pointers to each
 * system call's struct syscall_metadata (name, argument types and names).  A
 * field's offset is computed as Linux's event_define_fields() does: from
 * sizeof(struct trace_entry), each field aligned to its align, in order.
 * The layouts below are the ABI ksim relies on (images/toy/README.md); the
 * _Static_asserts in kernel/trace.c pin them.
 */
#ifndef TRACE_EVENTS_H
#define TRACE_EVENTS_H

#include <toy.h>

/* ---- records --------------------------------------------------------- */
struct trace_entry {
	unsigned short type;
	unsigned char flags;
	unsigned char preempt_count;
	int pid;
};

/* A __data_loc field's u32: the data's length << 16 | its offset in the record. */
#define __data_loc(len, off)	((u32)(len) << 16 | (u32)(off))

/* ---- events ---------------------------------------------------------- */
struct trace_event_fields {
	const char *type;
	const char *name;
	int size;
	int align;
	int is_signed;
	int filter_type;
	int len;			/* an array's element count */
};

struct trace_event_call;
struct trace_event_class {
	const char *system;
	void *probe;			/* trace_event_raw_event_<class> */
	void *perf_probe;		/* unused */
	int (*reg)(struct trace_event_call *call, int type, void *data);	/* unused */
	const struct trace_event_fields *fields_array;	/* ends with type == NULL */
};

struct tracepoint_func {
	void *func;
	void *data;
};

struct tracepoint {
	const char *name;		/* first: trace_event_name() reads it */
	int enabled;
	const struct tracepoint_func *funcs;	/* ends with func == NULL */
};

struct hlist_node {
	struct hlist_node *next, **pprev;
};

struct trace_event {
	struct hlist_node node;
	struct list_head list;
	int type;			/* the event's id: common_type of its records */
	void *funcs;
};

#define TRACE_EVENT_FL_TRACEPOINT	0x10	/* name is tp->name (Linux: 1 << 4) */

struct trace_event_call {
	struct list_head list;
	struct trace_event_class *class;
	union {
		char *name;
		struct tracepoint *tp;
	};
	struct trace_event event;
	char *print_fmt;
	void *filter;
	void *module;
	void *data;
	int flags;
};

struct trace_array {
	struct list_head list;
	const char *name;
	u8 *buffer;			/* the ring the records go to */
	u32 buffer_size;
	u32 head;
	u64 entries;			/* records committed */
	u64 overruns;			/* records overwritten */
};

#define EVENT_FILE_FL_ENABLED		0x1
#define EVENT_FILE_FL_SOFT_DISABLED	0x40

struct trace_event_file {
	struct list_head list;
	struct trace_event_call *event_call;
	void *filter;
	void *dir;
	struct trace_array *tr;
	void *system;
	struct list_head triggers;
	unsigned long flags;
};

struct trace_event_buffer {
	void *buffer;
	void *event;
	struct trace_event_file *trace_file;
	void *entry;
	unsigned int trace_ctx;
	struct pt_regs *regs;
};

void *trace_event_buffer_reserve(struct trace_event_buffer *fbuffer,
				 struct trace_event_file *trace_file, unsigned long len);
void trace_event_buffer_commit(struct trace_event_buffer *fbuffer);
extern struct trace_array global_trace;

/* ---- system calls ---------------------------------------------------- */
struct syscall_metadata {
	const char *name;		/* "sys_read" */
	int syscall_nr;			/* Linux sets it at boot; -1 here (ksim reads sys_call_table) */
	int nb_args;
	const char *const *types;
	const char *const *args;
	struct list_head enter_fields;
	struct trace_event_call *enter_event;
	struct trace_event_call *exit_event;
};

/* ---- the tracepoints the kernel calls -------------------------------- */
struct bio;
void __traceiter_sched_switch(void *__data, bool preempt, struct task_struct *prev,
			      struct task_struct *next, unsigned int prev_state);
void __traceiter_sched_waking(void *__data, struct task_struct *p);
void __traceiter_sched_wakeup(void *__data, struct task_struct *p);
void __traceiter_block_rq_insert(void *__data, struct bio *rq);
void __traceiter_block_rq_issue(void *__data, struct bio *rq);
void __traceiter_block_rq_complete(void *__data, struct bio *rq, int error,
				   unsigned int nr_bytes);

static inline void trace_sched_switch(bool preempt, struct task_struct *prev,
				      struct task_struct *next, unsigned int prev_state)
{
	__traceiter_sched_switch(NULL, preempt, prev, next, prev_state);
}

static inline void trace_sched_waking(struct task_struct *p)
{
	__traceiter_sched_waking(NULL, p);
}

static inline void trace_sched_wakeup(struct task_struct *p)
{
	__traceiter_sched_wakeup(NULL, p);
}

static inline void trace_block_rq_insert(struct bio *rq)
{
	__traceiter_block_rq_insert(NULL, rq);
}

static inline void trace_block_rq_issue(struct bio *rq)
{
	__traceiter_block_rq_issue(NULL, rq);
}

static inline void trace_block_rq_complete(struct bio *rq, int error, unsigned int nr_bytes)
{
	__traceiter_block_rq_complete(NULL, rq, error, nr_bytes);
}

#endif /* TRACE_EVENTS_H */
