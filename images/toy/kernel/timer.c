/*
 * kernel/timer.c: jiffies, the tick path (update_process_times ->
 * scheduler_tick) and soft timers run from run_timer_softirq.  The workload
 * drives ticks itself so that they are deterministic; the hardware timer
 * interrupt only counts irq_ticks (arch/{x86,arm64}/entry.S).
 */
#include <toy.h>

u64 jiffies = 0;	/* kept in .data on purpose: accessed RIP-relative at function entries */
u64 irq_ticks;
static struct list_head timer_list_head;
static u64 timers_fired;
static u64 softirq_runs;

noinline void do_timer(unsigned long ticks)
{
	jiffies += ticks;
}

noinline u64 get_jiffies_64(void)
{
	return jiffies;
}

noinline void timer_setup(struct timer_list *t, void (*fn)(struct timer_list *))
{
	INIT_LIST_HEAD(&t->entry);
	t->function = fn;
	t->pending = false;
	t->expires = 0;
}

static noinline void enqueue_timer(struct timer_list *t)
{
	/* Kept sorted by expiry, so the softirq only looks at the head. */
	struct list_head *pos = timer_list_head.next;

	while (pos != &timer_list_head &&
	       container_of(pos, struct timer_list, entry)->expires <= t->expires)
		pos = pos->next;
	list_add_tail(&t->entry, pos);
	t->pending = true;
}

static noinline void detach_timer(struct timer_list *t)
{
	list_del(&t->entry);
	t->pending = false;
}

noinline void add_timer(struct timer_list *t)
{
	if (!t->pending)
		enqueue_timer(t);
}

noinline int del_timer(struct timer_list *t)
{
	if (!t->pending)
		return 0;
	detach_timer(t);
	return 1;
}

noinline int mod_timer(struct timer_list *t, u64 expires)
{
	int was = del_timer(t);

	t->expires = expires;
	enqueue_timer(t);
	return was;
}

static noinline void call_timer_fn(struct timer_list *t)
{
	t->fired++;
	timers_fired++;
	t->function(t);
}

noinline void run_timer_softirq(void)
{
	softirq_runs++;
	while (!list_empty(&timer_list_head)) {
		struct timer_list *t = container_of(timer_list_head.next, struct timer_list, entry);
		if (t->expires > jiffies)
			break;
		detach_timer(t);
		call_timer_fn(t);
	}
}

noinline void account_process_tick(struct task_struct *p, int user_tick)
{
	if (user_tick)
		p->utime++;
	else
		p->stime++;
}

noinline void update_process_times(int user_tick)
{
	account_process_tick(current, user_tick);
	scheduler_tick();
}

noinline void init_timers(void)
{
	INIT_LIST_HEAD(&timer_list_head);
}

noinline u64 timer_checksum(u64 h)
{
	h = ksim_mix64(h, jiffies);
	h = ksim_mix64(h, timers_fired);
	return ksim_mix64(h, softirq_runs);	/* tail call */
}
