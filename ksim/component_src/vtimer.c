/*
 * vtimer: the KernInst timer library's kernel side (guide section 6.2).
 *
 * A timer accumulates counter events (cycles by default) between its start and
 * stop points, per cpu and recursion-safe: only a task's outermost start/stop
 * pair counts (depth).  "Virtual" time excludes the time a task spends switched
 * out inside the timed code: vt_switch, called at the context switch with the
 * outgoing and incoming tasks, banks the outgoing task's running time and
 * restarts the incoming task's clock (each timer has its own call there, since
 * each reads its own counter).  "Wall" time runs from outermost start
 * to stop regardless.  State lives in kernel data the client allocated and
 * reads while sampling, so this code keeps nothing of its own.
 */
typedef unsigned long u64;

#define VT_SLOTS 64		/* tasks inside one timer's code at once */
#define VT_CPUS 8		/* per-cpu totals; cpu numbers wrap */

struct vt_slot {
	u64 task;		/* current task pointer, 0: free */
	u64 depth;		/* nesting of start points in this task */
	u64 start;		/* counter when the task last started or resumed */
	u64 wall_start;		/* counter at the outermost start */
};

struct vtimer {
	u64 total[VT_CPUS];	/* virtual events */
	u64 wall[VT_CPUS];	/* wall events */
	u64 starts, stops;	/* outermost and nested */
	u64 overflow;		/* starts dropped: no free slot */
	u64 switches_out;	/* times a task was switched out inside the code */
	struct vt_slot slot[VT_SLOTS];
};

static struct vt_slot *vt_find(struct vtimer *t, u64 task)
{
	for (int i = 0; i < VT_SLOTS; i++)
		if (t->slot[i].task == task)
			return &t->slot[i];
	return 0;
}

void vt_start(struct vtimer *t, u64 task, u64 cpu, u64 now)
{
	struct vt_slot *s = vt_find(t, task);

	if (!s) {
		s = vt_find(t, 0);
		if (!s) {
			t->overflow++;
			return;
		}
		s->task = task;
		s->depth = 0;
	}
	t->starts++;
	if (s->depth++ == 0) {
		s->start = now;
		s->wall_start = now;
	}
}

void vt_stop(struct vtimer *t, u64 task, u64 cpu, u64 now)
{
	struct vt_slot *s = vt_find(t, task);

	if (!s || !s->depth)
		return;		/* a stop whose start ran before the timer existed */
	t->stops++;
	if (--s->depth == 0) {
		t->total[cpu % VT_CPUS] += now - s->start;
		t->wall[cpu % VT_CPUS] += now - s->wall_start;
		s->task = 0;
	}
}

void vt_switch(struct vtimer *t, u64 prev, u64 next, u64 cpu, u64 now)
{
	struct vt_slot *s;

	if (prev == next)
		return;
	s = vt_find(t, prev);
	if (s && s->depth) {
		t->total[cpu % VT_CPUS] += now - s->start;
		t->switches_out++;
	}
	s = vt_find(t, next);
	if (s && s->depth)
		s->start = now;
}
