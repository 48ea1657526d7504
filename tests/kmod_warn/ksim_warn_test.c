// SPDX-License-Identifier: GPL-2.0
/*
 * ksim_warn_test.c - a WARN site in a module, for tests/test_live_sites.py.
 *
 * Writing a number to /sys/module/ksim_warn_test/parameters/value runs
 * ksim_warn_check(number) and keeps its result there; 42 fires the WARN_ON.
 *
 * The WARN's ud2 is found by its address: handle_bug() (arch/x86/kernel/traps.c)
 * looks the faulting ip up in __bug_table (report_bug, lib/bug.c), and a ud2
 * that is not there is an "invalid opcode" oops.  Here the ud2 follows one
 * short instruction at the start of its basic block, so a 5-byte jmp at that
 * block would have to move the ud2 into a patch: exactly what ksim must never
 * do.  (Linux 6.1 x86-64.)
 */

#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/kernel.h>
#include <linux/bug.h>

#define KSIM_WARN_VALUE 42

static int ksim_warn_result;

static noinline int ksim_warn_check(int value)
{
	int ret = value;

	if (unlikely(value == KSIM_WARN_VALUE)) {
		/*
		 * One 3- or 4-byte instruction (add $1 to a register), then the
		 * WARN's ud2: the block is shorter than a 5-byte jmp.  Its effect
		 * shows in the result (44 for 42), so a relocated copy must run
		 * exactly once.
		 */
		asm volatile("add $1, %0" : "+r" (ret));
		WARN_ON(1);
	}
	return ret + 1;
}

static int ksim_warn_set(const char *val, const struct kernel_param *kp)
{
	int value;
	int err = kstrtoint(val, 0, &value);

	if (err)
		return err;
	*(int *)kp->arg = ksim_warn_check(value);
	return 0;
}

static const struct kernel_param_ops ksim_warn_ops = {
	.set = ksim_warn_set,
	.get = param_get_int,
};
module_param_cb(value, &ksim_warn_ops, &ksim_warn_result, 0600);
MODULE_PARM_DESC(value, "write N to run ksim_warn_check(N) (42 WARNs); read its last result");

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("ksim test module: a WARN site reachable from user space");
