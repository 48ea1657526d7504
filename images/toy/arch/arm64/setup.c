/*
 * arch/arm64/{kernel/setup.c, drivers/of/fdt.c}: what the boot loader tells the
 * kernel, read from the flattened device tree head.S found: the command line
 * (/chosen/bootargs: QEMU -append), the PSCI conduit (/psci method) and the
 * GIC's version (a node compatible with "arm,gic-v3").
 */
#include <toy.h>

#define FDT_MAGIC	0xd00dfeed
#define FDT_BEGIN_NODE	0x1
#define FDT_END_NODE	0x2
#define FDT_PROP	0x3
#define FDT_NOP		0x4

/* struct fdt_header: big-endian 32-bit fields (devicetree specification 5.2) */
#define FDT_OFF_MAGIC		0
#define FDT_OFF_TOTALSIZE	4
#define FDT_OFF_DT_STRUCT	8
#define FDT_OFF_DT_STRINGS	12
#define FDT_OFF_SIZE_DT_STRUCT	36

unsigned long __fdt_pointer;	/* written by head.S */
char boot_command_line[COMMAND_LINE_SIZE];
extern bool psci_use_smc, gic_v3;

static inline u32 fdt32(const void *p)
{
	return __builtin_bswap32(*(const u32 *)p);
}

/* The value (and length) of property `prop` of the root's child `node`, or NULL. */
static noinline const char *fdt_getprop(const u8 *fdt, const char *node, const char *prop,
					u32 *lenp)
{
	const u8 *p = fdt + fdt32(fdt + FDT_OFF_DT_STRUCT);
	const u8 *end = p + fdt32(fdt + FDT_OFF_SIZE_DT_STRUCT);
	const char *strings = (const char *)fdt + fdt32(fdt + FDT_OFF_DT_STRINGS);
	int depth = 0;
	bool in_node = false;

	while (p < end) {
		u32 tag = fdt32(p);

		p += 4;
		if (tag == FDT_BEGIN_NODE) {
			size_t n = strlen((const char *)p);

			if (++depth == 2)	/* the root is depth 1 */
				in_node = !strcmp((const char *)p, node);
			p += (n + 4) & ~3UL;
		} else if (tag == FDT_END_NODE) {
			if (depth-- == 2)
				in_node = false;
		} else if (tag == FDT_PROP) {
			u32 len = fdt32(p), nameoff = fdt32(p + 4);

			if (in_node && depth == 2 && !strcmp(strings + nameoff, prop)) {
				*lenp = len;
				return (const char *)p + 8;
			}
			p += 8 + ((len + 3) & ~3U);
		} else if (tag != FDT_NOP) {
			break;		/* FDT_END, or not a tree */
		}
	}
	return NULL;
}

/* Whether some node's "compatible" list holds `compat`. */
static noinline bool fdt_has_compatible(const u8 *fdt, const char *compat)
{
	const u8 *p = fdt + fdt32(fdt + FDT_OFF_DT_STRUCT);
	const u8 *end = p + fdt32(fdt + FDT_OFF_SIZE_DT_STRUCT);
	const char *strings = (const char *)fdt + fdt32(fdt + FDT_OFF_DT_STRINGS);

	while (p < end) {
		u32 tag = fdt32(p);

		p += 4;
		if (tag == FDT_BEGIN_NODE) {
			p += (strlen((const char *)p) + 4) & ~3UL;
		} else if (tag == FDT_PROP) {
			u32 len = fdt32(p), nameoff = fdt32(p + 4);
			const char *v = (const char *)p + 8, *vend = v + len;

			if (!strcmp(strings + nameoff, "compatible"))
				for (; v < vend; v += strlen(v) + 1)
					if (!strcmp(v, compat))
						return true;
			p += 8 + ((len + 3) & ~3U);
		} else if (tag != FDT_END_NODE && tag != FDT_NOP) {
			break;
		}
	}
	return false;
}

noinline void setup_arch(void)
{
	const u8 *fdt;
	const char *s;
	u32 len;

	if (!__fdt_pointer)
		return;
	fdt = (const u8 *)__fdt_pointer;	/* RAM is identity-mapped (TTBR0) */
	if (fdt32(fdt + FDT_OFF_MAGIC) != FDT_MAGIC ||
	    __fdt_pointer + fdt32(fdt + FDT_OFF_TOTALSIZE) > RAM_BASE + 0x40000000UL)
		return;
	s = fdt_getprop(fdt, "chosen", "bootargs", &len);
	if (s && len)
		strlcpy(boot_command_line, s, min((size_t)len, sizeof(boot_command_line)));
	s = fdt_getprop(fdt, "psci", "method", &len);
	if (s && len && !strcmp(s, "smc"))
		psci_use_smc = true;
	gic_v3 = fdt_has_compatible(fdt, "arm,gic-v3");
}
