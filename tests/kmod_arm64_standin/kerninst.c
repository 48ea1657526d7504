// SPDX-License-Identifier: GPL-2.0
/*
 * A stand-in for kerninst.ko on the arm64 testbed while kmod/ does not build for
 * arm64: /dev/kerninst answering VERSION, INFO (the ABI version, the CPU count,
 * this module's own text page as "text" and two vmalloc'd buffers as the patch
 * area and heap, which nothing writes) and STATE (nothing held), so that kerninstd
 * starts and the
 * testbed's boot, userland, network and exec op can be tested.  Every other
 * command is ENOTTY: it changes nothing.  Built with kmod/kerninst.h beside it.
 */
#include <linux/cpumask.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/uaccess.h>
#include <linux/vmalloc.h>

#include "kerninst.h"

#define STANDIN_AREA (64 << 10)
static void *standin_code, *standin_data;

static long standin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case KERNINST_IOC_VERSION: {
		struct kerninst_version v = { .version = KERNINST_ABI_VERSION };

		return copy_to_user(uarg, &v, sizeof(v)) ? -EFAULT : 0;
	}
	case KERNINST_IOC_INFO: {
		struct kerninst_info info = {
			.version = KERNINST_ABI_VERSION,
			.nr_cpus = num_online_cpus(),
			.text_start = (unsigned long)standin_ioctl & PAGE_MASK,
			.text_end = ((unsigned long)standin_ioctl & PAGE_MASK) + PAGE_SIZE,
			.code_start = (unsigned long)standin_code,
			.code_size = STANDIN_AREA,
			.data_start = (unsigned long)standin_data,
			.data_size = STANDIN_AREA,
		};

		return copy_to_user(uarg, &info, sizeof(info)) ? -EFAULT : 0;
	}
	case KERNINST_IOC_STATE: {
		struct kerninst_state st;

		if (copy_from_user(&st, uarg, sizeof(st)))
			return -EFAULT;
		st.nr_owners = st.nr_splices = st.nr_routes = st.nr_blocks = st.nr_areas = 0;
		return copy_to_user(uarg, &st, sizeof(st)) ? -EFAULT : 0;
	}
	default:
		return -ENOTTY;
	}
}

static const struct file_operations standin_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = standin_ioctl,
};

static struct miscdevice standin_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = KERNINST_DEVICE,
	.fops = &standin_fops,
	.mode = 0600,
};

static int __init standin_init(void)
{
	int err;

	standin_code = vzalloc(STANDIN_AREA);
	standin_data = vzalloc(STANDIN_AREA);
	if (!standin_code || !standin_data) {
		err = -ENOMEM;
		goto fail;
	}
	err = misc_register(&standin_dev);
	if (!err)
		return 0;
fail:
	vfree(standin_code);
	vfree(standin_data);
	return err;
}

static void __exit standin_exit(void)
{
	misc_deregister(&standin_dev);
	vfree(standin_code);
	vfree(standin_data);
}

module_init(standin_init);
module_exit(standin_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kerninst stand-in: VERSION, INFO and STATE only (arm64 testbed tests)");
