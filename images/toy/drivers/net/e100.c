/*
 * drivers/net/e100.c: a driver modelled on the Intel 8255x (e100): a ring of
 * command blocks (CBs) for transmit, a ring of receive frame descriptors
 * (RFDs), commands to the CU/RU through the System Control Block, and an
 * interrupt handler that acks status and polls both rings.
 *
 * The "hardware" is simulated in memory by e100_hw_*: it is in internal
 * loopback mode, so every transmitted frame is received again.  No port or
 * MMIO access is made, so unicorn and QEMU behave identically.
 */
#include <toy.h>

#define CB_RING		16
#define RFD_RING	8
#define RFD_BUF		1536

/* SCB commands (8255x manual, table 14) */
enum scb_cmd {
	cuc_nop = 0,
	cuc_start = 1,
	cuc_resume = 2,
	cuc_dump_addr = 3,
	cuc_dump_stats = 4,
	cuc_load_base = 5,
	cuc_dump_reset = 6,
	ruc_start = 7,
	ruc_resume = 8,
	ruc_abort = 9,
	ruc_load_base = 10,
};

/* SCB status / ack bits */
#define stat_ack_cx	0x80
#define stat_ack_fr	0x40
#define stat_ack_cna	0x20
#define stat_ack_rnr	0x10
#define cb_complete	0x8000
#define cb_ok		0x2000
#define rfd_complete	0x8000

struct cb {
	u16 status;
	u16 command;
	u32 len;
	struct sk_buff *skb;
};

struct rfd {
	u16 status;
	u16 actual_size;
	u8 data[RFD_BUF];
};

struct nic {
	struct cb cbs[CB_RING];
	unsigned int cb_to_use, cb_to_clean, cbs_avail;
	struct rfd rfds[RFD_RING];
	unsigned int rfd_to_use, rfd_to_clean, hw_rfd;
	u8 scb_stat_ack;
	bool cu_running, ru_running, irq_enabled;
	u64 cmds[11];
	u64 stats_dumps, rnr_events, intr_count, intr_spurious, polls;
	u32 base;
	u16 hdr_crc;
	struct timer_list watchdog;
};

static struct nic e100_nic;

static int e100_open(struct net_device *dev);
static int e100_xmit_frame(struct sk_buff *skb, struct net_device *dev);
static int e100_get_stats(struct net_device *dev);

/* The multicast filter is not modelled: this op is a bare "ret". */
static void e100_set_multicast_list(struct net_device *dev)
{
}

static const struct net_device_ops e100_netdev_ops = {
	.ndo_open = e100_open,
	.ndo_start_xmit = e100_xmit_frame,
	.ndo_set_rx_mode = e100_set_multicast_list,
	.ndo_get_stats = e100_get_stats,
};

struct net_device e100_netdev = {
	.name = "eth0",
	.netdev_ops = &e100_netdev_ops,
	.mtu = 1500,
	.priv = &e100_nic,
};

/* --- the simulated 8255x ------------------------------------------------- */

/* The RU takes one frame from the wire; without a free RFD it stops (RNR). */
static noinline void e100_hw_receive(struct nic *nic, const u8 *frame, u32 len)
{
	struct rfd *rfd = &nic->rfds[nic->hw_rfd];

	if (!nic->ru_running || (rfd->status & rfd_complete)) {
		nic->scb_stat_ack |= stat_ack_rnr;
		nic->ru_running = false;
		e100_netdev.rx_dropped++;
		return;
	}
	len = min(len, (u32)RFD_BUF);
	memcpy(rfd->data, frame, len);
	rfd->actual_size = (u16)len;
	rfd->status = rfd_complete | cb_ok;
	nic->hw_rfd = (nic->hw_rfd + 1) % RFD_RING;
	nic->scb_stat_ack |= stat_ack_fr;
}

/* The CU walks the CB ring from cb_to_clean and executes pending transmits. */
static noinline void e100_hw_cu_run(struct nic *nic)
{
	unsigned int i = nic->cb_to_clean;

	for (unsigned int n = 0; n < CB_RING; n++, i = (i + 1) % CB_RING) {
		struct cb *cb = &nic->cbs[i];
		if (!cb->skb || (cb->status & cb_complete))
			continue;
		e100_hw_receive(nic, cb->skb->data, cb->skb->len);	/* loopback */
		cb->status = cb_complete | cb_ok;
		nic->scb_stat_ack |= stat_ack_cx;
	}
	nic->scb_stat_ack |= stat_ack_cna;
}

/* Command dispatch of the SCB: a dense switch, compiled to a jump table. */
static noinline int e100_exec_cmd(struct nic *nic, enum scb_cmd cmd, u32 arg)
{
	nic->cmds[cmd]++;
	switch (cmd) {
	case cuc_nop:
		break;
	case cuc_start:
		nic->cu_running = true;
		e100_hw_cu_run(nic);
		break;
	case cuc_resume:
		if (!nic->cu_running)
			return -EIO;
		e100_hw_cu_run(nic);
		break;
	case cuc_dump_addr:
		nic->base = arg;
		break;
	case cuc_dump_stats:
		nic->stats_dumps++;
		break;
	case cuc_load_base:
		nic->base = arg & ~0xfU;
		break;
	case cuc_dump_reset:
		nic->stats_dumps++;
		e100_netdev.rx_dropped = 0;
		break;
	case ruc_start:
		nic->ru_running = true;
		nic->hw_rfd = arg % RFD_RING;
		break;
	case ruc_resume:
		nic->ru_running = true;
		nic->rnr_events++;
		break;
	case ruc_abort:
		nic->ru_running = false;
		break;
	case ruc_load_base:
		nic->base = arg;
		break;
	default:
		return -EINVAL;
	}
	return 0;
}

/* --- the driver ------------------------------------------------------------ */

static noinline void e100_enable_irq(struct nic *nic)
{
	nic->irq_enabled = true;
}

static noinline void e100_disable_irq(struct nic *nic)
{
	nic->irq_enabled = false;
}

static noinline void e100_rx_alloc_list(struct nic *nic)
{
	for (unsigned int i = 0; i < RFD_RING; i++)
		nic->rfds[i].status = 0;
	nic->rfd_to_use = nic->rfd_to_clean = 0;
}

static noinline void e100_alloc_cbs(struct nic *nic)
{
	memset(nic->cbs, 0, sizeof(nic->cbs));
	nic->cb_to_use = nic->cb_to_clean = 0;
	nic->cbs_avail = CB_RING;
}

static noinline int e100_hw_init(struct nic *nic)
{
	e100_exec_cmd(nic, cuc_load_base, 0);
	e100_exec_cmd(nic, ruc_load_base, 0);
	e100_exec_cmd(nic, cuc_dump_addr, 0x1000);
	return e100_exec_cmd(nic, cuc_dump_reset, 0);
}

static noinline void e100_start_receiver(struct nic *nic)
{
	e100_exec_cmd(nic, ruc_start, nic->rfd_to_clean);
}

static int e100_open(struct net_device *dev)
{
	struct nic *nic = dev->priv;

	e100_alloc_cbs(nic);
	e100_rx_alloc_list(nic);
	e100_hw_init(nic);
	e100_start_receiver(nic);
	e100_exec_cmd(nic, cuc_start, 0);
	e100_enable_irq(nic);
	timer_setup(&nic->watchdog, e100_watchdog);
	nic->watchdog.expires = get_jiffies_64() + 8;
	add_timer(&nic->watchdog);
	return 0;
}

static noinline void e100_xmit_prepare(struct nic *nic, struct cb *cb, struct sk_buff *skb)
{
	cb->command = 0x4000 | 0x0004;	/* cb_s | cb_tx */
	cb->status = 0;
	cb->len = skb->len;
	cb->skb = skb;
	/* The 8255x computes a CRC over the frame; model it over its first bytes. */
	nic->hdr_crc = crc16(nic->hdr_crc, skb->data, min(skb->len, 16U));
}

static int e100_xmit_frame(struct sk_buff *skb, struct net_device *dev)
{
	struct nic *nic = dev->priv;
	struct cb *cb;

	if (!nic->cbs_avail)
		return -EBUSY;	/* ring full: caller drops */
	cb = &nic->cbs[nic->cb_to_use];
	nic->cb_to_use = (nic->cb_to_use + 1) % CB_RING;
	nic->cbs_avail--;
	e100_xmit_prepare(nic, cb, skb);
	dev->tx_packets++;
	dev->tx_bytes += skb->len;
	if (e100_exec_cmd(nic, cuc_resume, 0))
		e100_exec_cmd(nic, cuc_start, 0);
	return 0;
}

static noinline int e100_tx_clean(struct nic *nic)
{
	int cleaned = 0;

	while (nic->cbs_avail < CB_RING) {
		struct cb *cb = &nic->cbs[nic->cb_to_clean];
		if (!(cb->status & cb_complete))
			break;
		kfree_skb(cb->skb);
		cb->skb = NULL;
		cb->status = 0;
		nic->cb_to_clean = (nic->cb_to_clean + 1) % CB_RING;
		nic->cbs_avail++;
		cleaned++;
	}
	return cleaned;
}

static noinline int e100_rx_indicate(struct nic *nic, struct rfd *rfd)
{
	struct sk_buff *skb = alloc_skb(rfd->actual_size);

	if (!skb) {
		e100_netdev.rx_dropped++;
		return -ENOMEM;
	}
	memcpy(skb_put(skb, rfd->actual_size), rfd->data, rfd->actual_size);
	e100_netdev.rx_packets++;
	e100_netdev.rx_bytes += rfd->actual_size;
	return netif_rx(skb);
}

static noinline int e100_rx_clean(struct nic *nic, int budget)
{
	int done = 0;

	while (done < budget) {
		struct rfd *rfd = &nic->rfds[nic->rfd_to_clean];
		if (!(rfd->status & rfd_complete))
			break;
		e100_rx_indicate(nic, rfd);
		rfd->status = 0;
		nic->rfd_to_clean = (nic->rfd_to_clean + 1) % RFD_RING;
		done++;
	}
	/* Receiver stopped for lack of buffers: restart it now there are some. */
	if (!nic->ru_running)
		e100_exec_cmd(nic, ruc_resume, 0);
	return done;
}

noinline int e100_poll(int budget)
{
	struct nic *nic = &e100_nic;
	int work;

	nic->polls++;
	work = e100_rx_clean(nic, budget);
	e100_tx_clean(nic);
	if (work < budget)
		e100_enable_irq(nic);
	net_rx_action();
	return work;
}

noinline int e100_intr(int irq, void *dev_id)
{
	struct nic *nic = dev_id ? dev_id : &e100_nic;
	u8 stat_ack = nic->scb_stat_ack;

	nic->intr_count++;
	if (!stat_ack || !nic->irq_enabled) {
		nic->intr_spurious++;
		return 0;	/* IRQ_NONE */
	}
	nic->scb_stat_ack = 0;	/* ack */
	if (stat_ack & stat_ack_rnr)
		nic->rnr_events++;
	e100_disable_irq(nic);
	e100_poll(16);
	return 1;		/* IRQ_HANDLED */
}

static int e100_get_stats(struct net_device *dev)
{
	struct nic *nic = dev->priv;

	return e100_exec_cmd(nic, cuc_dump_stats, 0);
}

noinline void e100_watchdog(struct timer_list *t)
{
	struct nic *nic = container_of(t, struct nic, watchdog);

	e100_netdev.netdev_ops->ndo_get_stats(&e100_netdev);
	e100_netdev.netdev_ops->ndo_set_rx_mode(&e100_netdev);
	if (!nic->cu_running)
		e100_exec_cmd(nic, cuc_start, 0);
	else
		e100_exec_cmd(nic, cuc_nop, 0);
	mod_timer(t, jiffies + 8);
}

noinline void e100_probe(void)
{
	e100_netdev.netdev_ops->ndo_open(&e100_netdev);
}

u64 e100_checksum(u64 h);
noinline u64 e100_checksum(u64 h)
{
	struct nic *nic = &e100_nic;

	h = ksim_mix64(h, e100_netdev.tx_packets);
	h = ksim_mix64(h, e100_netdev.tx_bytes);
	h = ksim_mix64(h, e100_netdev.rx_packets);
	h = ksim_mix64(h, e100_netdev.rx_bytes ^ (e100_netdev.rx_dropped << 40));
	h = ksim_mix64(h, nic->cb_to_use | nic->cb_to_clean << 8 | nic->rfd_to_clean << 16 |
			  (u64)nic->hw_rfd << 24 | (u64)nic->cbs_avail << 32);
	for (unsigned int i = 0; i < ARRAY_SIZE(nic->cmds); i++)
		h = ksim_mix64(h, nic->cmds[i]);
	h = ksim_mix64(h, nic->intr_count ^ (nic->intr_spurious << 20) ^ (nic->polls << 40));
	h = ksim_mix64(h, nic->hdr_crc);
	return ksim_mix64(h, nic->rnr_events ^ (nic->stats_dumps << 32));
}
