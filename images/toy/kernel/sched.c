/*
 * kernel/sched.c: a uniprocessor scheduler with real stack switches.
 * Runnable tasks sit on one runqueue; the one with the smallest vruntime runs
 * next (ties broken by queue order), as in CFS.  init_task (pid 0) is the idle
 * task and runs only when nothing else can.
 */
#include <toy.h>
#include <trace_events.h>

_Static_assert(offsetof(struct task_struct, thread.sp) == TASK_threadsp,
	       "__switch_to_asm relies on thread.sp being at TASK_threadsp");

int cpu_number;	/* uniprocessor: always 0 */
struct rq runqueue;
struct task_struct init_task = {
	.state = TASK_RUNNING,
	.pid = 0,
	.prio = 120,
	.parent = &init_task,
	.comm = "swapper/0",
};
struct task_struct *current_task = &init_task;

/* arch/{x86,arm64}/entry.S turn these into the absolute ELF symbols ksim reads. */
_Static_assert(offsetof(struct task_struct, pid) == TASK_pid, "TASK_pid is stale");
_Static_assert(offsetof(struct task_struct, comm) == TASK_comm, "TASK_comm is stale");
_Static_assert(sizeof(struct task_struct) == TASK_struct_size, "TASK_struct_size is stale");

static u8 task_stacks[NR_TASKS][THREAD_SIZE] __aligned(16);
static struct kmem_cache *task_struct_cachep;
static int last_pid;
#define SCHED_GRANULARITY 96	/* vruntime units: about two ticks */

noinline int task_pid_nr(const struct task_struct *t)
{
	return t->pid;
}

noinline int task_ppid_nr(const struct task_struct *t)
{
	return t->parent->pid;
}

static noinline void enqueue_task(struct rq *rq, struct task_struct *p)
{
	list_add_tail(&p->run_list, &rq->tasks);
	rq->nr_running++;
}

static noinline void dequeue_task(struct rq *rq, struct task_struct *p)
{
	list_del(&p->run_list);
	rq->nr_running--;
}

static noinline u64 min_vruntime(struct rq *rq)
{
	u64 m = ~0ULL;

	for (struct list_head *l = rq->tasks.next; l != &rq->tasks; l = l->next) {
		struct task_struct *p = container_of(l, struct task_struct, run_list);
		if (p->vruntime < m)
			m = p->vruntime;
	}
	return m;
}

noinline void wake_up_process(struct task_struct *p)
{
	runqueue.nr_waking++;
	trace_sched_waking(p);
	if (p->state == TASK_RUNNING && p->run_list.next != &p->run_list)
		return;
	p->state = TASK_RUNNING;
	/* A waking task starts at the queue's minimum so it cannot starve others. */
	if (runqueue.nr_running)
		p->vruntime = max(p->vruntime, min_vruntime(&runqueue));
	enqueue_task(&runqueue, p);
	runqueue.nr_wakeups++;
	trace_sched_wakeup(p);
}

static noinline void update_curr(struct rq *rq)
{
	struct task_struct *curr = rq->curr;
	u64 delta = rq->clock - curr->exec_start;

	curr->exec_start = rq->clock;
	curr->sum_exec_runtime += delta;
	curr->vruntime += delta * 1024 / (u64)(curr->prio - 100 + 1);
}

static noinline struct task_struct *pick_next_task(struct rq *rq)
{
	struct task_struct *best = NULL;

	for (struct list_head *l = rq->tasks.next; l != &rq->tasks; l = l->next) {
		struct task_struct *p = container_of(l, struct task_struct, run_list);
		if (p->state != TASK_RUNNING)
			continue;
		if (!best || p->vruntime < best->vruntime)
			best = p;
	}
	return best ? best : rq->idle;
}

noinline struct task_struct *__switch_to(struct task_struct *prev, struct task_struct *next)
{
	current_task = next;
	next->exec_start = runqueue.clock;
	return prev;
}

static noinline void finish_task_switch(struct task_struct *prev)
{
	prev->need_resched = 0;
	local_irq_enable();
}

noinline void schedule_tail(struct task_struct *prev)
{
	finish_task_switch(prev);
}

static noinline void context_switch(struct rq *rq, struct task_struct *prev,
				    struct task_struct *next)
{
	trace_sched_switch(prev->need_resched != 0, prev, next, (unsigned int)prev->state);
	rq->curr = next;
	rq->nr_switches++;
	/* Interrupts stay off while the stack is being switched (back on below,
	 * or in schedule_tail for a task's first run). */
	local_irq_disable();
	prev = __switch_to_asm(prev, next);
	/* Now running on next's stack; "prev" is whoever switched to us. */
	finish_task_switch(prev);
}

noinline void schedule(void)
{
	struct rq *rq = &runqueue;
	struct task_struct *prev = current, *next;

	update_curr(rq);
	next = pick_next_task(rq);
	if (prev->need_resched)
		prev->nivcsw++;
	else
		prev->nvcsw++;
	if (next != prev)
		context_switch(rq, prev, next);
	else
		prev->need_resched = 0;
}

static noinline void task_tick_fair(struct rq *rq, struct task_struct *curr)
{
	update_curr(rq);
	if (curr != rq->idle && curr->vruntime > min_vruntime(rq) + SCHED_GRANULARITY)
		curr->need_resched = 1;
}

/* sched_yield(): go behind every task of equal vruntime, then schedule. */
noinline void do_sched_yield(void)
{
	struct task_struct *p = current;

	if (p != runqueue.idle) {
		dequeue_task(&runqueue, p);
		enqueue_task(&runqueue, p);
	}
	schedule();
}

noinline void scheduler_tick(void)
{
	struct rq *rq = &runqueue;

	rq->clock = jiffies;
	task_tick_fair(rq, rq->curr);
}

noinline struct task_struct *kernel_thread(void (*fn)(void *), void *arg, const char *name)
{
	struct task_struct *p;
	u64 *sp;
	int slot = last_pid + 1;

	if (slot >= NR_TASKS)
		return NULL;
	p = kmem_cache_zalloc(task_struct_cachep);
	if (!p)
		return NULL;
	p->pid = ++last_pid;
	p->parent = current;
	p->prio = 120 - (p->pid % 3);	/* a few priorities, so vruntimes differ */
	p->fn = fn;
	p->arg = arg;
	p->stack = task_stacks[slot];
	strlcpy(p->comm, name, sizeof(p->comm));
	INIT_LIST_HEAD(&p->run_list);

	/*
	 * The first switch to p pops r15, r14, r13, r12, rbx, rbp (as pushed by
	 * __switch_to_asm), then __switch_to returns into ret_from_fork, which calls
	 * fn(arg) from rbx/r12.  arm64 reads the same slots (arch/arm64/entry.S).
	 */
	sp = (u64 *)(task_stacks[slot] + THREAD_SIZE);
	*--sp = 0;				/* fake return address of fn: stops unwinding */
	*--sp = (u64)ret_from_fork;		/* return address (arm64: lr) */
	*--sp = 0;				/* rbp (arm64: fp) */
	*--sp = (u64)fn;			/* rbx (arm64: x19) */
	*--sp = (u64)arg;			/* r12 (arm64: x20) */
	*--sp = 0;				/* r13 */
	*--sp = 0;				/* r14 */
	*--sp = 0;				/* r15 */
	p->thread.sp = (u64)sp;
	p->state = TASK_INTERRUPTIBLE;
	wake_up_process(p);
	return p;
}

noinline void sched_init(void)
{
	INIT_LIST_HEAD(&runqueue.tasks);
	INIT_LIST_HEAD(&init_task.run_list);
	init_task.thread.sp = 0;
	init_task.stack = NULL;
	runqueue.curr = &init_task;
	runqueue.idle = &init_task;
	current_task = &init_task;
	task_struct_cachep = kmem_cache_create("task_struct", sizeof(struct task_struct), NULL);
}

noinline u64 sched_checksum(u64 h)
{
	h = ksim_mix64(h, runqueue.nr_switches);
	h = ksim_mix64(h, runqueue.nr_running);
	for (struct list_head *l = runqueue.tasks.next; l != &runqueue.tasks; l = l->next) {
		struct task_struct *p = container_of(l, struct task_struct, run_list);
		h = ksim_mix64(h, (u64)p->pid << 32 | (u32)p->prio);
		h = ksim_mix64(h, p->vruntime);
		h = ksim_mix64(h, p->nvcsw ^ (p->nivcsw << 20));
		h = ksim_mix64(h, p->syscalls);
		h = ksim_mix64(h, p->utime ^ (p->stime << 16));
	}
	return h;
}
