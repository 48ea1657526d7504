/*
 * kernel/trace.c: the trace events of the toy kernel, as Linux 6.1's
 * TRACE_EVENT / DECLARE_EVENT_CLASS / DEFINE_EVENT expand them
 * (include/trace/trace_events.h, kernel/trace/trace_events.c), written out:
 * records, class functions, events, tracepoints; and the system calls'
 * metadata (include/trace/syscall.h).  See <trace_events.h>.
 *
 *   sched:sched_switch                       class sched_switch
 *   sched:sched_waking, sched:sched_wakeup   class sched_wakeup_template
 *   block:block_rq_insert, block:block_rq_issue   class block_rq
 *   block:block_rq_complete                  class block_rq_completion
 *   syscalls:sys_enter_NAME, sys_exit_NAME   the __x64_sys_NAME wrappers
 *                                            (kernel/sys.c), from __syscalls_metadata
 */
#include <toy.h>
#include <trace_events.h>

typedef u32 dev_t;
typedef int pid_t;
typedef unsigned short umode_t;
typedef long off_t;

#define TASK_COMM_LEN		16
#define TASK_REPORT_MAX		0x100	/* prev_state of a preempted task */
#define RAMDISK_MAJOR		1
#define MINORBITS		20
#define MKDEV(ma, mi)		(((ma) << MINORBITS) | (mi))
#define RWBS_LEN		8

/* What ksim relies on (images/toy/README.md), at Linux 6.1's offsets. */
_Static_assert(sizeof(struct trace_entry) == 8, "struct trace_entry");
_Static_assert(offsetof(struct trace_event_buffer, trace_file) == 16, "fbuffer->trace_file");
_Static_assert(offsetof(struct trace_event_buffer, entry) == 24, "fbuffer->entry");
_Static_assert(offsetof(struct trace_event_file, event_call) == 16, "file->event_call");
_Static_assert(offsetof(struct trace_event_file, tr) == 40, "file->tr");
_Static_assert(offsetof(struct trace_event_file, flags) == 72, "file->flags");
_Static_assert(offsetof(struct trace_array, name) == 16, "tr->name");
_Static_assert(offsetof(struct trace_event_call, class) == 16, "call->class");
_Static_assert(offsetof(struct trace_event_call, tp) == 24, "call->tp");
_Static_assert(offsetof(struct trace_event_call, event.type) == 64, "call->event.type");
_Static_assert(offsetof(struct trace_event_call, flags) == 112, "call->flags");
_Static_assert(offsetof(struct trace_event_class, system) == 0, "class->system");
_Static_assert(offsetof(struct trace_event_class, probe) == 8, "class->probe");
_Static_assert(offsetof(struct trace_event_class, fields_array) == 32, "class->fields_array");
_Static_assert(sizeof(struct trace_event_fields) == 40, "struct trace_event_fields");
_Static_assert(offsetof(struct trace_event_fields, is_signed) == 24, "field->is_signed");
_Static_assert(offsetof(struct syscall_metadata, nb_args) == 12, "meta->nb_args");
_Static_assert(offsetof(struct syscall_metadata, args) == 24, "meta->args");

/* ---- the one trace array: a ring of records ------------------------------ */
static u8 global_trace_buffer[16384] __aligned(8);
struct trace_array global_trace = {
	.name = "",
	.buffer = global_trace_buffer,
	.buffer_size = sizeof(global_trace_buffer),
};

noinline void *trace_event_buffer_reserve(struct trace_event_buffer *fbuffer,
					  struct trace_event_file *trace_file, unsigned long len)
{
	struct trace_array *tr = trace_file->tr;
	u32 size = (u32)((len + 7) & ~7UL);
	struct trace_entry *ent;

	if (size > tr->buffer_size)
		return NULL;
	if (tr->head + size > tr->buffer_size) {	/* overwrite mode: start again */
		tr->head = 0;
		tr->overruns++;
	}
	ent = (struct trace_entry *)(tr->buffer + tr->head);
	tr->head += size;
	ent->type = (unsigned short)trace_file->event_call->event.type;
	ent->flags = 0;
	ent->preempt_count = 0;
	ent->pid = current->pid;
	fbuffer->buffer = tr;
	fbuffer->event = ent;
	fbuffer->trace_file = trace_file;
	fbuffer->trace_ctx = 0;
	fbuffer->regs = NULL;
	fbuffer->entry = ent;
	return ent;
}

noinline void trace_event_buffer_commit(struct trace_event_buffer *fbuffer)
{
	struct trace_array *tr = fbuffer->buffer;

	tr->entries++;
}

static inline bool trace_trigger_soft_disabled(struct trace_event_file *file)
{
	return file->flags & EVENT_FILE_FL_SOFT_DISABLED;
}

/* ---- fields_array entries, as Linux's __field / __array / __string ------- */
#define __stringify_1(x)	#x
#define __stringify(x)		__stringify_1(x)
#define is_signed_type(type)	(((type)(-1)) < (type)1)
#define __field(_type, _item)	{ .type = #_type, .name = #_item, .size = sizeof(_type), \
				  .align = __alignof__(_type), .is_signed = is_signed_type(_type) },
#define __array(_type, _item, _len) { .type = #_type "[" __stringify(_len) "]", .name = #_item, \
				  .size = sizeof(_type[_len]), .align = __alignof__(_type), \
				  .is_signed = is_signed_type(_type), .len = _len },
#define __string(_item)		{ .type = "__data_loc char[]", .name = #_item, .size = 4, \
				  .align = 4, .is_signed = is_signed_type(char) },
#define FIELDS_END		{ .type = NULL }

/* The probe a tracepoint calls, and its iterator (TP_PROTO and TP_ARGS). */
#define TP_PROTO(...)		__VA_ARGS__
#define TP_ARGS(...)		__VA_ARGS__
#define DEFINE_TRACEITER(_name, proto, args)					\
	noinline void __traceiter_##_name(void *__data, proto)			\
	{									\
		const struct tracepoint_func *it;				\
										\
		for (it = __tracepoint_##_name.funcs; it->func; it++)		\
			((void (*)(void *, proto))it->func)(it->data, args);	\
	}

#define DEFINE_EVENT_CLASS(_class, _system)					\
	static struct trace_event_class event_class_##_class = {		\
		.system = _system,						\
		.probe = trace_event_raw_event_##_class,			\
		.fields_array = trace_event_fields_##_class,			\
	};

/* One event of a class: its call, its file in the trace array, its tracepoint
 * (whose one probe is the class function, called with the file as __data) and
 * the pointer in _ftrace_events that lists it. */
#define DEFINE_EVENT(_class, _name, _id, proto, args)				\
	static struct trace_event_file __file_##_name;				\
	static const struct tracepoint_func __tp_funcs_##_name[] = {		\
		{ trace_event_raw_event_##_class, &__file_##_name }, { NULL, NULL } }; \
	struct tracepoint __tracepoint_##_name = {				\
		.name = #_name, .enabled = 1, .funcs = __tp_funcs_##_name,	\
	};									\
	static struct trace_event_call event_##_name = {			\
		.class = &event_class_##_class,					\
		.tp = &__tracepoint_##_name,					\
		.event = { .type = _id },					\
		.flags = TRACE_EVENT_FL_TRACEPOINT,				\
	};									\
	static struct trace_event_file __file_##_name = {			\
		.event_call = &event_##_name,					\
		.tr = &global_trace,						\
		.flags = EVENT_FILE_FL_ENABLED,					\
	};									\
	static struct trace_event_call *__event_##_name				\
		__used __section("_ftrace_events") = &event_##_name;		\
	DEFINE_TRACEITER(_name, TP_PROTO(proto), TP_ARGS(args))

/* ---- sched:sched_switch ---------------------------------------------------- */
struct trace_event_raw_sched_switch {
	struct trace_entry ent;
	char prev_comm[TASK_COMM_LEN];
	pid_t prev_pid;
	int prev_prio;
	long prev_state;
	char next_comm[TASK_COMM_LEN];
	pid_t next_pid;
	int next_prio;
	char __data[];
};

static const struct trace_event_fields trace_event_fields_sched_switch[] = {
	__array(char, prev_comm, TASK_COMM_LEN)
	__field(pid_t, prev_pid)
	__field(int, prev_prio)
	__field(long, prev_state)
	__array(char, next_comm, TASK_COMM_LEN)
	__field(pid_t, next_pid)
	__field(int, next_prio)
	FIELDS_END
};

static noinline void trace_event_raw_event_sched_switch(void *__data, bool preempt,
							struct task_struct *prev,
							struct task_struct *next,
							unsigned int prev_state)
{
	struct trace_event_file *trace_file = __data;
	struct trace_event_buffer fbuffer;
	struct trace_event_raw_sched_switch *entry;

	if (trace_trigger_soft_disabled(trace_file))
		return;
	entry = trace_event_buffer_reserve(&fbuffer, trace_file, sizeof(*entry));
	if (!entry)
		return;
	memcpy(entry->next_comm, next->comm, TASK_COMM_LEN);
	entry->prev_pid = prev->pid;
	entry->prev_prio = prev->prio;
	entry->prev_state = preempt ? TASK_REPORT_MAX : (long)prev_state;
	memcpy(entry->prev_comm, prev->comm, TASK_COMM_LEN);
	entry->next_pid = next->pid;
	entry->next_prio = next->prio;
	trace_event_buffer_commit(&fbuffer);
}

DEFINE_EVENT_CLASS(sched_switch, "sched")
DEFINE_EVENT(sched_switch, sched_switch, 1,
	     TP_PROTO(bool preempt, struct task_struct *prev, struct task_struct *next,
		      unsigned int prev_state),
	     TP_ARGS(preempt, prev, next, prev_state))

/* ---- sched:sched_waking, sched:sched_wakeup: one class --------------------- */
struct trace_event_raw_sched_wakeup_template {
	struct trace_entry ent;
	char comm[TASK_COMM_LEN];
	pid_t pid;
	int prio;
	int target_cpu;
	char __data[];
};

static const struct trace_event_fields trace_event_fields_sched_wakeup_template[] = {
	__array(char, comm, TASK_COMM_LEN)
	__field(pid_t, pid)
	__field(int, prio)
	__field(int, target_cpu)
	FIELDS_END
};

static noinline void trace_event_raw_event_sched_wakeup_template(void *__data,
								 struct task_struct *p)
{
	struct trace_event_file *trace_file = __data;
	struct trace_event_buffer fbuffer;
	struct trace_event_raw_sched_wakeup_template *entry;

	if (trace_trigger_soft_disabled(trace_file))
		return;
	entry = trace_event_buffer_reserve(&fbuffer, trace_file, sizeof(*entry));
	if (!entry)
		return;
	memcpy(entry->comm, p->comm, TASK_COMM_LEN);
	entry->pid = p->pid;
	entry->prio = p->prio;
	entry->target_cpu = cpu_number;
	trace_event_buffer_commit(&fbuffer);
}

DEFINE_EVENT_CLASS(sched_wakeup_template, "sched")
DEFINE_EVENT(sched_wakeup_template, sched_waking, 2,
	     TP_PROTO(struct task_struct *p), TP_ARGS(p))
DEFINE_EVENT(sched_wakeup_template, sched_wakeup, 3,
	     TP_PROTO(struct task_struct *p), TP_ARGS(p))

/* ---- block:block_rq_insert, block:block_rq_issue: one class ---------------- */
static noinline void blk_fill_rwbs(char *rwbs, u32 opf)
{
	int i = 0;

	rwbs[i++] = opf == REQ_OP_WRITE ? 'W' : 'R';
	rwbs[i] = '\0';
}

struct trace_event_raw_block_rq {
	struct trace_entry ent;
	dev_t dev;
	sector_t sector;
	unsigned int nr_sector;
	unsigned int bytes;
	char rwbs[RWBS_LEN];
	char comm[TASK_COMM_LEN];
	u32 __data_loc_cmd;
	char __data[];
};

static const struct trace_event_fields trace_event_fields_block_rq[] = {
	__field(dev_t, dev)
	__field(sector_t, sector)
	__field(unsigned int, nr_sector)
	__field(unsigned int, bytes)
	__array(char, rwbs, RWBS_LEN)
	__array(char, comm, TASK_COMM_LEN)
	__string(cmd)
	FIELDS_END
};

static noinline void trace_event_raw_event_block_rq(void *__data, struct bio *rq)
{
	struct trace_event_file *trace_file = __data;
	struct trace_event_buffer fbuffer;
	struct trace_event_raw_block_rq *entry;

	if (trace_trigger_soft_disabled(trace_file))
		return;
	entry = trace_event_buffer_reserve(&fbuffer, trace_file, sizeof(*entry) + 1);
	if (!entry)
		return;
	entry->dev = MKDEV(RAMDISK_MAJOR, (dev_t)rq->bi_dev);
	entry->sector = rq->bi_sector;
	entry->nr_sector = rq->bi_size >> SECTOR_SHIFT;
	entry->bytes = rq->bi_size;
	entry->__data_loc_cmd = __data_loc(1, offsetof(struct trace_event_raw_block_rq, __data));
	entry->__data[0] = '\0';	/* no SCSI command: "" */
	blk_fill_rwbs(entry->rwbs, rq->bi_opf);
	memcpy(entry->comm, current->comm, TASK_COMM_LEN);
	trace_event_buffer_commit(&fbuffer);
}

DEFINE_EVENT_CLASS(block_rq, "block")
DEFINE_EVENT(block_rq, block_rq_insert, 4, TP_PROTO(struct bio *rq), TP_ARGS(rq))
DEFINE_EVENT(block_rq, block_rq_issue, 5, TP_PROTO(struct bio *rq), TP_ARGS(rq))

/* ---- block:block_rq_complete ------------------------------------------------- */
struct trace_event_raw_block_rq_completion {
	struct trace_entry ent;
	dev_t dev;
	sector_t sector;
	unsigned int nr_sector;
	int error;
	char rwbs[RWBS_LEN];
	u32 __data_loc_cmd;
	char __data[];
};

static const struct trace_event_fields trace_event_fields_block_rq_completion[] = {
	__field(dev_t, dev)
	__field(sector_t, sector)
	__field(unsigned int, nr_sector)
	__field(int, error)
	__array(char, rwbs, RWBS_LEN)
	__string(cmd)
	FIELDS_END
};

static noinline void trace_event_raw_event_block_rq_completion(void *__data, struct bio *rq,
							       int error, unsigned int nr_bytes)
{
	struct trace_event_file *trace_file = __data;
	struct trace_event_buffer fbuffer;
	struct trace_event_raw_block_rq_completion *entry;

	if (trace_trigger_soft_disabled(trace_file))
		return;
	entry = trace_event_buffer_reserve(&fbuffer, trace_file, sizeof(*entry) + 1);
	if (!entry)
		return;
	entry->dev = MKDEV(RAMDISK_MAJOR, (dev_t)rq->bi_dev);
	entry->sector = rq->bi_sector;
	entry->nr_sector = nr_bytes >> SECTOR_SHIFT;
	entry->error = error;
	blk_fill_rwbs(entry->rwbs, rq->bi_opf);
	entry->__data_loc_cmd = __data_loc(1, offsetof(struct trace_event_raw_block_rq_completion,
						       __data));
	entry->__data[0] = '\0';
	trace_event_buffer_commit(&fbuffer);
}

DEFINE_EVENT_CLASS(block_rq_completion, "block")
DEFINE_EVENT(block_rq_completion, block_rq_complete, 6,
	     TP_PROTO(struct bio *rq, int error, unsigned int nr_bytes),
	     TP_ARGS(rq, error, nr_bytes))

/* ---- syscalls: what SYSCALL_DEFINEn records (include/linux/syscalls.h) ---- */
#define SYSCALL_METADATA(sname, nb, types_, args_)				\
	static struct syscall_metadata __syscall_meta_##sname = {		\
		.name = "sys" #sname,						\
		.syscall_nr = -1,						\
		.nb_args = nb,							\
		.types = types_,						\
		.args = args_,							\
	};									\
	static struct syscall_metadata *__p_syscall_meta_##sname		\
		__used __section("__syscalls_metadata") = &__syscall_meta_##sname;
#define SYSCALL_ARGS(sname, ...)						\
	static const char *const __args_##sname[] = { __VA_ARGS__ };
#define SYSCALL_TYPES(sname, ...)						\
	static const char *const __types_##sname[] = { __VA_ARGS__ };
#define SYSCALL_DEFINE0(sname)	SYSCALL_METADATA(_##sname, 0, NULL, NULL)
#define SYSCALL_DEFINEn(sname, n)						\
	SYSCALL_METADATA(_##sname, n, __types_##sname, __args_##sname)

SYSCALL_TYPES(read, "unsigned int", "char *", "size_t")
SYSCALL_ARGS(read, "fd", "buf", "count")
SYSCALL_DEFINEn(read, 3)
SYSCALL_TYPES(write, "unsigned int", "const char *", "size_t")
SYSCALL_ARGS(write, "fd", "buf", "count")
SYSCALL_DEFINEn(write, 3)
SYSCALL_TYPES(open, "const char *", "int", "umode_t")
SYSCALL_ARGS(open, "filename", "flags", "mode")
SYSCALL_DEFINEn(open, 3)
SYSCALL_TYPES(close, "unsigned int")
SYSCALL_ARGS(close, "fd")
SYSCALL_DEFINEn(close, 1)
SYSCALL_TYPES(lseek, "unsigned int", "off_t", "unsigned int")
SYSCALL_ARGS(lseek, "fd", "offset", "whence")
SYSCALL_DEFINEn(lseek, 3)
SYSCALL_TYPES(fsync, "unsigned int")
SYSCALL_ARGS(fsync, "fd")
SYSCALL_DEFINEn(fsync, 1)
SYSCALL_DEFINE0(sched_yield)
SYSCALL_DEFINE0(getpid)
SYSCALL_DEFINE0(getppid)
SYSCALL_DEFINE0(getuid)
SYSCALL_DEFINE0(getgid)
SYSCALL_DEFINE0(sync)
SYSCALL_TYPES(times, "struct tms *")
SYSCALL_ARGS(times, "tbuf")
SYSCALL_DEFINEn(times, 1)
SYSCALL_TYPES(sendto, "int", "void *", "size_t", "unsigned int", "struct sockaddr *", "int")
SYSCALL_ARGS(sendto, "fd", "buff", "len", "flags", "addr", "addr_len")
SYSCALL_DEFINEn(sendto, 6)
SYSCALL_TYPES(brk, "unsigned long")
SYSCALL_ARGS(brk, "brk")
SYSCALL_DEFINEn(brk, 1)
SYSCALL_TYPES(sethostname, "char *", "int")
SYSCALL_ARGS(sethostname, "name", "len")
SYSCALL_DEFINEn(sethostname, 2)
SYSCALL_DEFINE0(gettid)
SYSCALL_TYPES(uname, "struct old_utsname *")
SYSCALL_ARGS(uname, "name")
SYSCALL_DEFINEn(uname, 1)
