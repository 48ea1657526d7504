/* net/core: socket buffers, the transmit entry and the receive backlog. */
#include <toy.h>

#define SKB_HEADROOM 64
#define BACKLOG_MAX 32
static struct sk_buff *backlog_head, *backlog_tail;
static unsigned int backlog_len;
static struct kmem_cache *skbuff_head_cache;
static u64 skbs_allocated, skbs_freed, backlog_drops, xmit_errors;

noinline struct sk_buff *alloc_skb(u32 size)
{
	struct sk_buff *skb;

	if (!skbuff_head_cache)
		skbuff_head_cache = kmem_cache_create("skbuff_head_cache", sizeof(*skb), NULL);
	skb = kmem_cache_zalloc(skbuff_head_cache);
	if (!skb)
		return NULL;
	skb->head = kmalloc(size + SKB_HEADROOM);
	if (!skb->head) {
		kmem_cache_free(skbuff_head_cache, skb);
		return NULL;
	}
	skb->data = skb->head + SKB_HEADROOM;
	skb->truesize = (u32)ksize(skb->head);
	skbs_allocated++;
	return skb;
}

noinline void kfree_skb(struct sk_buff *skb)
{
	if (!skb)
		return;
	kfree(skb->head);
	kmem_cache_free(skbuff_head_cache, skb);
	skbs_freed++;
}

noinline u8 *skb_put(struct sk_buff *skb, u32 len)
{
	u8 *tail = skb->data + skb->len;

	skb->len += len;
	return tail;
}

noinline u8 *skb_push(struct sk_buff *skb, u32 len)
{
	skb->data -= len;
	skb->len += len;
	return skb->data;
}

noinline u8 *skb_pull(struct sk_buff *skb, u32 len)
{
	if (len > skb->len)
		return NULL;
	skb->len -= len;
	skb->data += len;
	return skb->data;
}

noinline int dev_queue_xmit(struct sk_buff *skb)
{
	struct net_device *dev = &e100_netdev;
	int rc = dev->netdev_ops->ndo_start_xmit(skb, dev);

	if (rc) {
		xmit_errors++;
		kfree_skb(skb);
	}
	return rc;
}

noinline int netif_rx(struct sk_buff *skb)
{
	if (backlog_len >= BACKLOG_MAX) {
		backlog_drops++;
		kfree_skb(skb);
		return 1;
	}
	skb->next = NULL;
	if (backlog_tail)
		backlog_tail->next = skb;
	else
		backlog_head = skb;
	backlog_tail = skb;
	backlog_len++;
	return 0;
}

noinline void net_rx_action(void)
{
	while (backlog_head) {
		struct sk_buff *skb = backlog_head;

		backlog_head = skb->next;
		if (!backlog_head)
			backlog_tail = NULL;
		backlog_len--;
		ip_rcv(skb);
	}
}

u64 skb_checksum_state(u64 h);
noinline u64 skb_checksum_state(u64 h)
{
	h = ksim_mix64(h, skbs_allocated);
	h = ksim_mix64(h, skbs_freed);
	h = ksim_mix64(h, backlog_drops ^ (xmit_errors << 32));
	return ksim_mix64(h, backlog_len);
}
