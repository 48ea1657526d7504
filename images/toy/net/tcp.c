/*
 * net/ipv4: TCP output (tcp_sendmsg -> tcp_transmit_skb -> ip_queue_xmit ->
 * dev_queue_xmit) and input (ip_rcv -> tcp_v4_rcv -> tcp_rcv_established).
 * With the NIC in loopback, every segment a socket sends comes back to it.
 */
#include <toy.h>

enum {
	TCP_ESTABLISHED = 1, TCP_SYN_SENT, TCP_SYN_RECV, TCP_FIN_WAIT1, TCP_FIN_WAIT2,
	TCP_TIME_WAIT, TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK, TCP_LISTEN, TCP_CLOSING,
};

struct iphdr {
	u8 ihl_version;
	u8 tos;
	u16 tot_len;
	u16 id;
	u16 frag_off;
	u8 ttl;
	u8 protocol;
	u16 check;
	u32 saddr, daddr;
};

struct tcphdr {
	u16 source, dest;
	u32 seq, ack_seq;
	u8 doff, flags;
	u16 window, check, urg_ptr;
};

#define TCP_MIN_MSS	88
#define IPPROTO_TCP	6

struct sock tcp_socks[NR_SOCKS];
static u64 tcp_state_changes[12];
static u64 ip_id, ip_in_errors, tcp_in_errors, retransmits;

noinline void tcp_set_state(struct sock *sk, int state)
{
	int old = sk->sk_state;

	/* One arm per state with its own accounting: a dense switch, a jump table. */
	switch (state) {
	case TCP_ESTABLISHED:
		if (old != TCP_ESTABLISHED)
			sk->snd_cwnd = 10;
		break;
	case TCP_SYN_SENT:
		sk->snd_una = sk->snd_nxt;
		break;
	case TCP_SYN_RECV:
		sk->rcv_nxt = 0;
		break;
	case TCP_FIN_WAIT1:
	case TCP_FIN_WAIT2:
		sk->snd_cwnd = max(sk->snd_cwnd / 2, 2U);
		break;
	case TCP_TIME_WAIT:
		del_timer(&sk->retransmit_timer);
		break;
	case TCP_CLOSE:
		sk->snd_una = sk->snd_nxt;
		del_timer(&sk->retransmit_timer);
		break;
	case TCP_CLOSE_WAIT:
		sk->rcv_nxt++;
		break;
	case TCP_LAST_ACK:
		sk->snd_nxt++;
		break;
	case TCP_LISTEN:
		sk->snd_cwnd = 1;
		break;
	case TCP_CLOSING:
		sk->snd_nxt += 2;
		break;
	default:
		return;
	}
	tcp_state_changes[state]++;
	sk->sk_state = state;
}

noinline u32 tcp_sync_mss(struct sock *sk, u32 pmtu)
{
	u32 mss = pmtu - sizeof(struct iphdr) - sizeof(struct tcphdr);

	if (mss < TCP_MIN_MSS)
		mss = TCP_MIN_MSS;
	sk->pmtu = pmtu;
	sk->mss_cache = mss;
	return mss;
}

noinline u32 tcp_current_mss(struct sock *sk)
{
	if (sk->pmtu != e100_netdev.mtu && sk->pmtu > e100_netdev.mtu)
		return tcp_sync_mss(sk, e100_netdev.mtu);	/* tail call */
	return sk->mss_cache;
}

static noinline u16 tcp_v4_check(struct sk_buff *skb)
{
	return csum_fold(csum_partial(skb->data, skb->len, IPPROTO_TCP + skb->len));
}

static noinline int ip_queue_xmit(struct sock *sk, struct sk_buff *skb)
{
	struct iphdr *iph = (struct iphdr *)skb_push(skb, sizeof(*iph));

	iph->ihl_version = 0x45;
	iph->tos = 0;
	iph->tot_len = (u16)skb->len;
	iph->id = (u16)++ip_id;
	iph->frag_off = 0;
	iph->ttl = 64;
	iph->protocol = IPPROTO_TCP;
	iph->check = 0;
	iph->saddr = 0x0a000001;
	iph->daddr = 0x0a000001;
	iph->check = ip_fast_csum(iph, 5);
	return dev_queue_xmit(skb);	/* tail call */
}

static noinline int tcp_transmit_skb(struct sock *sk, struct sk_buff *skb)
{
	struct tcphdr *th = (struct tcphdr *)skb_push(skb, sizeof(*th));
	u32 payload = skb->len - sizeof(*th);

	th->source = (u16)(sk - tcp_socks);
	th->dest = (u16)(sk - tcp_socks);
	th->seq = sk->snd_nxt;
	th->ack_seq = sk->rcv_nxt;
	th->doff = 5 << 4;
	th->flags = 0x18;	/* PSH|ACK */
	th->window = 0xffff;
	th->check = 0;
	th->check = tcp_v4_check(skb);
	sk->snd_nxt += payload;
	sk->segs_out++;
	return ip_queue_xmit(sk, skb);
}

static noinline void tcp_retransmit_timer(struct timer_list *t)
{
	struct sock *sk = container_of(t, struct sock, retransmit_timer);

	if (sk->snd_una != sk->snd_nxt) {
		retransmits++;
		sk->snd_cwnd = 1;
		sk->snd_una = sk->snd_nxt;	/* give up on what is outstanding */
	}
}

static noinline void tcp_rearm_rto(struct sock *sk)
{
	if (sk->snd_una == sk->snd_nxt)
		del_timer(&sk->retransmit_timer);
	else
		mod_timer(&sk->retransmit_timer, jiffies + 4);
}

noinline int tcp_sendmsg(struct sock *sk, const void *buf, size_t size)
{
	const u8 *p = buf;
	size_t copied = 0;
	u32 mss;

	if (sk->sk_state != TCP_ESTABLISHED)
		return -EPERM;
	mss = tcp_current_mss(sk);
	while (copied < size) {
		u32 chunk = (u32)min(size - copied, (size_t)mss);
		struct sk_buff *skb = alloc_skb(chunk + 64);

		if (!skb)
			break;
		memcpy(skb_put(skb, chunk), p + copied, chunk);
		if (tcp_transmit_skb(sk, skb))
			break;
		copied += chunk;
	}
	sk->bytes_sent += copied;
	tcp_rearm_rto(sk);
	return copied ? (int)copied : -EAGAIN;
}

static noinline void tcp_ack(struct sock *sk, u32 ack)
{
	if ((s32)(ack - sk->snd_una) > 0 && (s32)(sk->snd_nxt - ack) >= 0) {
		sk->snd_una = ack;
		if (sk->snd_cwnd < 64)
			sk->snd_cwnd++;
	}
}

/*
 * sock_def_readable: wake the socket's reader.  With the NIC in loopback the
 * reader is the task that sent the segment and is running, so the wakeup finds
 * it awake (a sched_waking without a sched_wakeup); the idle task reads nothing.
 */
static noinline void sk_data_ready(struct sock *sk)
{
	if (current != runqueue.idle)
		wake_up_process(current);
}

static noinline void tcp_rcv_established(struct sock *sk, struct sk_buff *skb,
					 const struct tcphdr *th)
{
	u32 len = skb->len;

	sk->segs_in++;
	sk->bytes_received += len;
	sk->rcv_nxt = th->seq + len;
	/* Loopback: the segment we receive acknowledges what we sent. */
	tcp_ack(sk, th->seq + len);
	tcp_rearm_rto(sk);
	sk_data_ready(sk);
}

noinline int tcp_v4_rcv(struct sk_buff *skb)
{
	const struct tcphdr *th = (const struct tcphdr *)skb->data;
	struct sock *sk;

	if (skb->len < sizeof(*th) || th->dest >= NR_SOCKS) {
		tcp_in_errors++;
		goto drop;
	}
	sk = &tcp_socks[th->dest];
	skb_pull(skb, sizeof(*th));
	if (sk->sk_state == TCP_ESTABLISHED)
		tcp_rcv_established(sk, skb, th);
	else
		tcp_in_errors++;
drop:
	kfree_skb(skb);
	return 0;
}

noinline int ip_rcv(struct sk_buff *skb)
{
	const struct iphdr *iph = (const struct iphdr *)skb->data;

	if (skb->len < sizeof(*iph) || iph->ihl_version != 0x45 ||
	    ip_fast_csum(iph, 5) != 0 || iph->protocol != IPPROTO_TCP) {
		ip_in_errors++;
		kfree_skb(skb);
		return -EINVAL;
	}
	skb_pull(skb, sizeof(*iph));
	return tcp_v4_rcv(skb);	/* tail call */
}

noinline void tcp_init(void)
{
	for (int i = 0; i < NR_SOCKS; i++) {
		struct sock *sk = &tcp_socks[i];
		timer_setup(&sk->retransmit_timer, tcp_retransmit_timer);
		tcp_set_state(sk, TCP_SYN_SENT);
		tcp_set_state(sk, TCP_ESTABLISHED);
		tcp_sync_mss(sk, 576 + 256 * i);
	}
}

noinline u64 net_checksum(u64 h)
{
	u64 skb_checksum_state(u64 h);
	u64 e100_checksum(u64 h);

	for (int i = 0; i < NR_SOCKS; i++) {
		struct sock *sk = &tcp_socks[i];
		h = ksim_mix64(h, (u64)sk->sk_state << 32 | sk->mss_cache);
		h = ksim_mix64(h, (u64)sk->snd_nxt << 32 | sk->snd_una);
		h = ksim_mix64(h, (u64)sk->rcv_nxt << 32 | sk->snd_cwnd);
		h = ksim_mix64(h, sk->bytes_sent ^ (sk->bytes_received << 1));
		h = ksim_mix64(h, sk->segs_out ^ (sk->segs_in << 24));
	}
	for (unsigned int i = 0; i < ARRAY_SIZE(tcp_state_changes); i++)
		h = ksim_mix64(h, tcp_state_changes[i]);
	h = ksim_mix64(h, ip_id ^ (ip_in_errors << 32) ^ (tcp_in_errors << 48));
	h = ksim_mix64(h, retransmits);
	h = skb_checksum_state(h);
	return e100_checksum(h);	/* tail call */
}
