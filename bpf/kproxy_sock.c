/* kproxy's socket-level load balancer: cgroup sock_addr programs, compiled by bcc when the bpf mode starts
 * (backends/bpf/loader.py), attached with BPF_F_ALLOW_MULTI to the cgroup (v2) the node's processes run in.
 *
 * connect4/6  TCP and connected UDP: a frontend (ClusterIP, externalIP, LB IP, NodePort on a node address) is
 *             rewritten to a backend chosen from the service map; no endpoints: the connect fails with
 *             ECONNREFUSED; Local policy without local endpoints: left alone (the nft companion drops it).
 * sendmsg4/6  unconnected UDP: the same per datagram, the backend chosen by the socket's cookie so one socket
 *             sticks to one backend.
 * recvmsg4/6  unconnected UDP: the reply's source (backend) is rewritten back to the frontend, so the application
 *             sees an answer from the address it asked (strict resolvers drop others).
 * getpeername4/6  the application sees the frontend as its peer.
 *
 * IPv4-mapped IPv6 (::ffff:a.b.c.d): a dual-stack AF_INET6 socket (Java's default) reaching an IPv4 frontend runs
 * the *6 hooks with a mapped address; those hooks look the IPv4 maps up with its last word and write a mapped
 * backend back (Cilium's sock6_xlate_v4_in_v6 and sock6_xlate_rev_v4_in_v6). (An unconnected mapped sendmsg runs
 * sendmsg4 itself: udpv6_sendmsg hands mapped destinations to udp_sendmsg.)
 *
 * A frontend's slot or backend that vanishes between the program's lookups (kproxy shrank or changed the service
 * meanwhile) is looked up again once from a fresh master entry; when it is still missing the connect/sendmsg fails
 * at once with EHOSTUNREACH instead of going out untranslated to an address nothing answers. EHOSTUNREACH, not the
 * no-endpoints ECONNREFUSED: the service has endpoints (its master entry counts them), the failure is a transient
 * of kproxy's update that a retry gets past, and the distinct errno tells it apart when someone debugs a client
 * (newer Cilium answers a missing backend the same way).
 *
 * Maps: bpf/kproxy_lb.h. The reverse entries are written on every translation (keyed by socket cookie and backend,
 * rewritten only when they change) and checked against the frontend's master entry on use, so a deleted or
 * recreated service is never answered for. When kproxy passes KP_PIN_PEER4/6, connected TCP sockets keep theirs in
 * socket storage instead (freed with the socket), so the reverse-NAT LRU holds only UDP sockets' entries.
 *
 * Traffic counters (--service-counters): only when kproxy passes KP_PIN_CNT4/6 (backends/bpf/counters.py). Every
 * backend pick that translates counts one in an array indexed by the backend id (ids are per service port, so an id
 * names one (service port, endpoint)): a TCP or SCTP connect, and for UDP a translation that (re)writes the socket's
 * reverse-NAT entry (a new socket, backend or frontend: a new flow; later datagrams of the flow are not counted).
 * kproxy zeroes a backend's counter with the backend and again when it goes. Without the defines nothing of this is
 * compiled: the programs are today's.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
#include <uapi/linux/errno.h>
#include "kproxy_lb.h"

#define SYS_REJECT 0
#define SYS_PROCEED 1

/* outcomes of one translation attempt (kp_try4/6) and of a whole translation (kp_fwd4/6) */
#define KP_REJECTED 0 /* bpf_set_retval done: the program returns SYS_REJECT */
#define KP_UNTOUCHED 1 /* not a frontend, or left alone (Local policy without local endpoints) */
#define KP_XLATED 2 /* the address and port were rewritten to a backend */
#define KP_MISS 3 /* a slot or backend vanished between lookups: try once more from the master entry */

BPF_TABLE_PINNED("hash", struct kp_lb4_key, struct kp_lb_service, kp_svc4, KP_SVC_MAX, KP_PIN_SVC4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct kp_lb4_backend, kp_be4, KP_BE_MAX, KP_PIN_BE4);
BPF_TABLE_PINNED("lru_hash", struct kp_rev4_key, struct kp_rev4_val, kp_rev4, KP_LRU_MAX, KP_PIN_REV4);
BPF_TABLE_PINNED("lru_hash", struct kp_aff_key, struct kp_aff_val, kp_aff4, KP_LRU_MAX, KP_PIN_AFF4);
BPF_TABLE_PINNED("hash", __u32, struct kp_svc_name, kp_name4, KP_NAME_MAX, KP_PIN_NAME4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kp_svc_name, kp_name6, KP_NAME_MAX, KP_PIN_NAME6, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kp_lb6_key, struct kp_lb_service, kp_svc6, KP_SVC_MAX, KP_PIN_SVC6, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("array", __u32, struct kp_lb6_backend, kp_be6, KP_BE_MAX, KP_PIN_BE6);
BPF_TABLE_PINNED("lru_hash", struct kp_rev6_key, struct kp_rev6_val, kp_rev6, KP_LRU_MAX, KP_PIN_REV6);
BPF_TABLE_PINNED("lru_hash", struct kp_aff_key, struct kp_aff_val, kp_aff6, KP_LRU_MAX, KP_PIN_AFF6);
#if defined(KP_PIN_PEER4) && defined(KP_PIN_PEER6)
/* connected TCP sockets keep their frontend in socket storage (kproxy_lb.h: kp_peer4_val), not in the reverse-NAT
 * LRU: one entry per live connection would push out the UDP entries recvmsg and connected-UDP reaping need */
#define KP_PEER 1
BPF_TABLE_PINNED("sk_storage", int, struct kp_peer4_val, kp_peer4, 0, KP_PIN_PEER4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("sk_storage", int, struct kp_peer6_val, kp_peer6, 0, KP_PIN_PEER6, BPF_F_NO_PREALLOC);
#endif
#if defined(KP_PIN_CNT4) && defined(KP_PIN_CNT6)
/* --service-counters: new connections and flows per backend id (see the header comment) */
#define KP_COUNTERS 1
BPF_TABLE_PINNED("array", __u32, __u64, kp_cnt4, KP_BE_MAX, KP_PIN_CNT4);
BPF_TABLE_PINNED("array", __u32, __u64, kp_cnt6, KP_BE_MAX, KP_PIN_CNT6);

/* one more for the backend, atomically (one counter for all CPUs: why not per-CPU, see backends/bpf/counters.py) */
static __always_inline void kp_count(__u32 backend_id, int is6)
{
	__u64 *c = is6 ? kp_cnt6.lookup(&backend_id) : kp_cnt4.lookup(&backend_id);
	if (c)
		__sync_fetch_and_add(c, 1);
}
/* a connection (TCP, SCTP): every translated connect; a flow (UDP): a translation that wrote the reverse entry */
#define KP_COUNT_CONN(proto, id, is6)                                                                                  \
	if ((proto) != IPPROTO_UDP)                                                                                    \
	kp_count(id, is6)
#define KP_COUNT_FLOW(proto, id, is6)                                                                                  \
	if ((proto) == IPPROTO_UDP)                                                                                    \
	kp_count(id, is6)
#else
#define KP_COUNT_CONN(proto, id, is6)
#define KP_COUNT_FLOW(proto, id, is6)
#endif

/* The master entry's fields, copied out of the map value at once: kproxy may rewrite the entry in place while a
 * program runs, and every decision of one attempt must come from one reading of it. */
struct kp_master {
	__u32 affinity_timeout;
	__u16 count;
	__u32 rev_nat_id;
	__u8 flags;
};

static __always_inline __u64 kp_cookie(void *ctx)
{
	/* bcc 0.26 declares bpf_get_socket_cookie as returning u32; the helper returns u64 */
	__u64 (*get)(void *) = (void *)BPF_FUNC_get_socket_cookie;
	return get(ctx);
}

static __always_inline __u8 kp_proto(struct bpf_sock_addr *ctx)
{
	/* the socket's protocol, not its type: an SCTP socket may be SOCK_STREAM */
	__u32 p = ctx->protocol;
	if (p == IPPROTO_TCP || p == IPPROTO_UDP || p == IPPROTO_SCTP)
		return (__u8)p;
	return 0;
}

static __always_inline __u64 kp_now(void)
{
	return bpf_ktime_get_ns() / 1000000000ULL;
}

static __always_inline void kp_read_master(struct kp_master *m, struct kp_lb_service *svc)
{
	m->affinity_timeout = svc->affinity_timeout;
	m->count = svc->count;
	m->rev_nat_id = svc->rev_nat_id;
	m->flags = svc->flags;
}

/* ::ffff:a.b.c.d: an IPv4 peer of a dual-stack IPv6 socket */
static __always_inline int kp_v4_mapped(struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 && ctx->user_ip6[2] == bpf_htonl(0x0000ffff);
}

/* Slots an affinity entry's backend is looked for in when it is no longer in the slot it was chosen from: a
 * scale-down moves the last slot's backend into the freed one (backends/bpf/plan.py, _stable_slots), and its
 * clients keep it, as upstream's per-endpoint affinity keeps them. In a service with more endpoints, the clients of
 * a backend that moved to a slot beyond these choose again. */
#define KP_AFF_SCAN 256

/* The backend id for a frontend whose master entry is m (key: its slot-0 key, slot_field: the key's slot): from
 * affinity when it is still valid (its backend still in one of the frontend's slots), else a slot; 0 when the slot
 * is gone. */
static __always_inline __u32 kp_pick(struct bpf_sock_addr *ctx, struct kp_master *m, __u32 slot_seed, void *key,
				     __u16 *slot_field, int is6)
{
	struct kp_lb_service *slot;
	__u32 backend_id = 0;
	struct kp_aff_key ak = {};
	struct kp_aff_val *av;
	__u64 now = 0;

	if (m->flags & KP_F_AFFINITY) {
		ak.client_cookie = bpf_get_netns_cookie(ctx);
		ak.rev_nat_id = m->rev_nat_id;
		now = kp_now();
		av = is6 ? kp_aff6.lookup(&ak) : kp_aff4.lookup(&ak);
		if (av && av->last_used + m->affinity_timeout > now) {
			/* still this frontend's backend: the slot it came from holds it (see kp_aff_val) or, after a
			 * scale-down moved it, another of the frontend's slots does (the entry then names that one) */
			__u32 id = av->backend_id;
			__u32 i;
			if (av->slot >= 1 && av->slot <= m->count) {
				*slot_field = (__u16)av->slot;
				slot = is6 ? kp_svc6.lookup(key) : kp_svc4.lookup(key);
				if (slot && slot->backend_id == id) {
					av->last_used = now;
					return id;
				}
			}
			for (i = 1; i <= KP_AFF_SCAN; i++) {
				if (i > m->count)
					break;
				*slot_field = (__u16)i;
				slot = is6 ? kp_svc6.lookup(key) : kp_svc4.lookup(key);
				if (slot && slot->backend_id == id) {
					av->slot = i;
					av->last_used = now;
					return id;
				}
			}
		}
	}
	*slot_field = (slot_seed % m->count) + 1;
	slot = is6 ? kp_svc6.lookup(key) : kp_svc4.lookup(key);
	if (!slot)
		return 0;
	backend_id = slot->backend_id;
	if (m->flags & KP_F_AFFINITY) {
		struct kp_aff_val nv = {};
		nv.last_used = now;
		nv.backend_id = backend_id;
		nv.slot = *slot_field;
		if (is6)
			kp_aff6.update(&ak, &nv);
		else
			kp_aff4.update(&ak, &nv);
	}
	return backend_id;
}

#ifdef KP_PEER
/* The frontend of a connected TCP socket, in its socket storage; 0 when there is no storage to be had. */
static __always_inline int kp_peer_put4(struct bpf_sock_addr *ctx, struct kp_lb4_backend *be, __be32 front,
					__be16 front_port, __u32 rev_nat_id)
{
	struct bpf_sock *sk = ctx->sk;
	struct kp_peer4_val pv = {};
	struct kp_peer4_val *pp;

	if (!sk)
		return 0;
	pv.backend = be->address;
	pv.backend_port = be->port;
	pv.rev_nat_id = rev_nat_id;
	pv.frontend = front;
	pv.frontend_port = front_port;
	pp = kp_peer4.sk_storage_get(sk, &pv, BPF_SK_STORAGE_GET_F_CREATE);
	if (!pp)
		return 0;
	*pp = pv; /* a socket that connects again (after a failed attempt) overwrites */
	return 1;
}

/* getpeername of a connected TCP socket from its storage: 1 when *addr:*port (the backend) was rewritten */
static __always_inline int kp_peer_get4(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port)
{
	struct bpf_sock *sk = ctx->sk;
	struct kp_peer4_val *pp;
	struct kp_lb4_key key = {};
	struct kp_lb_service *svc;

	if (!sk)
		return 0;
	pp = kp_peer4.sk_storage_get(sk, 0, 0);
	if (!pp || pp->backend != *addr || pp->backend_port != *port)
		return 0;
	key.address = pp->frontend;
	key.dport = pp->frontend_port;
	key.proto = IPPROTO_TCP;
	svc = kp_svc4.lookup(&key);
	if (!svc || svc->rev_nat_id != pp->rev_nat_id)
		return 0; /* the service was deleted or recreated: the peer is the backend */
	*addr = pp->frontend;
	*port = pp->frontend_port;
	return 1;
}
#endif

/* One attempt for the IPv4 frontend *addr:*port (network order): KP_XLATED with *addr, *port the backend, or
 * KP_UNTOUCHED, KP_REJECTED, KP_MISS. */
static __always_inline int kp_try4(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port, __u8 proto, __u32 seed)
{
	struct kp_lb4_key key = {};
	struct kp_lb_service *svc;
	struct kp_lb4_backend *be;
	struct kp_master m = {};
	__u32 backend_id;

	key.address = *addr;
	key.dport = *port;
	key.proto = proto;
	svc = kp_svc4.lookup(&key);
	if (!svc)
		return KP_UNTOUCHED;
	kp_read_master(&m, svc);
	if (m.flags & KP_F_REJECT) {
		bpf_set_retval(-ECONNREFUSED);
		return KP_REJECTED;
	}
	if ((m.flags & KP_F_DROP) || m.count == 0)
		return KP_UNTOUCHED;
	backend_id = kp_pick(ctx, &m, seed, &key, &key.slot, 0);
	if (!backend_id)
		return KP_MISS;
	be = kp_be4.lookup(&backend_id);
	if (!be || !be->proto) /* an array entry of no backend is all zero */
		return KP_MISS;
#ifdef KP_PEER
	if (proto == IPPROTO_TCP && kp_peer_put4(ctx, be, *addr, *port, m.rev_nat_id)) {
		KP_COUNT_CONN(proto, backend_id, 0);
		*addr = be->address;
		*port = be->port;
		return KP_XLATED;
	}
#endif
	{
		struct kp_rev4_key rk = {};
		struct kp_rev4_val rv = {};
		struct kp_rev4_val *old;
		rk.cookie = kp_cookie(ctx);
		rk.address = be->address;
		rk.port = be->port;
		rv.address = *addr;
		rv.port = *port;
		rv.rev_nat_id = m.rev_nat_id;
		/* an LRU update takes a fresh node even for an existing key: rewriting the same entry per datagram
		 * would churn the map and push other sockets' entries out */
		old = kp_rev4.lookup(&rk);
		if (!old || old->address != rv.address || old->port != rv.port || old->rev_nat_id != rv.rev_nat_id) {
			kp_rev4.update(&rk, &rv);
			KP_COUNT_FLOW(proto, backend_id, 0);
		}
	}
	KP_COUNT_CONN(proto, backend_id, 0);
	*addr = be->address;
	*port = be->port;
	return KP_XLATED;
}

/* The whole translation of an IPv4 frontend: one retry after a miss, then EHOSTUNREACH (never untranslated). */
static __always_inline int kp_fwd4(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port, int by_cookie)
{
	__u8 proto = kp_proto(ctx);
	__u32 seed;
	int r;

	if (!proto)
		return KP_UNTOUCHED;
	seed = by_cookie ? (__u32)kp_cookie(ctx) : bpf_get_prandom_u32();
	r = kp_try4(ctx, addr, port, proto, seed);
	if (r == KP_MISS)
		r = kp_try4(ctx, addr, port, proto, seed);
	if (r == KP_MISS) {
		bpf_set_retval(-EHOSTUNREACH);
		return KP_REJECTED;
	}
	return r;
}

/* The frontend for a reply from (or the peer) *addr:*port, when this socket was translated to it; 1 when
 * rewritten. */
static __always_inline int kp_rev4_lookup(struct bpf_sock_addr *ctx, __be32 *addr, __be16 *port)
{
	struct kp_rev4_key rk = {};
	struct kp_rev4_val *rv;
	struct kp_lb4_key key = {};
	struct kp_lb_service *svc;

#ifdef KP_PEER
	if (kp_proto(ctx) == IPPROTO_TCP && kp_peer_get4(ctx, addr, port))
		return 1;
#endif
	rk.cookie = kp_cookie(ctx);
	rk.address = *addr;
	rk.port = *port;
	rv = kp_rev4.lookup(&rk);
	if (!rv)
		return 0;
	key.address = rv->address;
	key.dport = rv->port;
	key.proto = kp_proto(ctx);
	svc = kp_svc4.lookup(&key);
	if (!svc || svc->rev_nat_id != rv->rev_nat_id) {
		kp_rev4.delete(&rk);
		return 0;
	}
	*addr = rv->address;
	*port = rv->port;
	return 1;
}

static __always_inline int kp_xlate4(struct bpf_sock_addr *ctx, int by_cookie)
{
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;
	int r = kp_fwd4(ctx, &addr, &port, by_cookie);

	if (r == KP_REJECTED)
		return SYS_REJECT;
	if (r == KP_XLATED) {
		ctx->user_ip4 = addr;
		ctx->user_port = port;
	}
	return SYS_PROCEED;
}

static __always_inline void kp_rev_xlate4(struct bpf_sock_addr *ctx)
{
	__be32 addr = ctx->user_ip4;
	__be16 port = (__be16)ctx->user_port;

	if (kp_rev4_lookup(ctx, &addr, &port)) {
		ctx->user_ip4 = addr;
		ctx->user_port = port;
	}
}

int kp_connect4(struct bpf_sock_addr *ctx)
{
	return kp_xlate4(ctx, 0);
}

int kp_sendmsg4(struct bpf_sock_addr *ctx)
{
	return kp_xlate4(ctx, 1);
}

int kp_recvmsg4(struct bpf_sock_addr *ctx)
{
	kp_rev_xlate4(ctx);
	return SYS_PROCEED;
}

int kp_getpeername4(struct bpf_sock_addr *ctx)
{
	kp_rev_xlate4(ctx);
	return SYS_PROCEED;
}

/* ---------------------------------------------------------------------------------------------------- IPv6 */

#ifdef KP_PEER
static __always_inline int kp_peer_put6(struct bpf_sock_addr *ctx, struct kp_lb6_backend *be, struct kp_lb6_key *front,
					__u32 rev_nat_id)
{
	struct bpf_sock *sk = ctx->sk;
	struct kp_peer6_val pv = {};
	struct kp_peer6_val *pp;

	if (!sk)
		return 0;
	pv.backend[0] = be->address[0];
	pv.backend[1] = be->address[1];
	pv.backend[2] = be->address[2];
	pv.backend[3] = be->address[3];
	pv.backend_port = be->port;
	pv.rev_nat_id = rev_nat_id;
	pv.frontend[0] = front->address[0];
	pv.frontend[1] = front->address[1];
	pv.frontend[2] = front->address[2];
	pv.frontend[3] = front->address[3];
	pv.frontend_port = front->dport;
	pp = kp_peer6.sk_storage_get(sk, &pv, BPF_SK_STORAGE_GET_F_CREATE);
	if (!pp)
		return 0;
	*pp = pv;
	return 1;
}

static __always_inline int kp_peer_get6(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct kp_peer6_val *pp;
	struct kp_lb6_key key = {};
	struct kp_lb_service *svc;

	if (!sk)
		return 0;
	pp = kp_peer6.sk_storage_get(sk, 0, 0);
	if (!pp || pp->backend[0] != ctx->user_ip6[0] || pp->backend[1] != ctx->user_ip6[1] ||
	    pp->backend[2] != ctx->user_ip6[2] || pp->backend[3] != ctx->user_ip6[3] ||
	    pp->backend_port != (__be16)ctx->user_port)
		return 0;
	key.address[0] = pp->frontend[0];
	key.address[1] = pp->frontend[1];
	key.address[2] = pp->frontend[2];
	key.address[3] = pp->frontend[3];
	key.dport = pp->frontend_port;
	key.proto = IPPROTO_TCP;
	svc = kp_svc6.lookup(&key);
	if (!svc || svc->rev_nat_id != pp->rev_nat_id)
		return 0;
	ctx->user_ip6[0] = pp->frontend[0];
	ctx->user_ip6[1] = pp->frontend[1];
	ctx->user_ip6[2] = pp->frontend[2];
	ctx->user_ip6[3] = pp->frontend[3];
	ctx->user_port = pp->frontend_port;
	return 1;
}
#endif

/* One attempt for the IPv6 frontend in ctx: KP_XLATED (ctx rewritten), KP_UNTOUCHED, KP_REJECTED or KP_MISS. */
static __always_inline int kp_try6(struct bpf_sock_addr *ctx, __u8 proto, __u32 seed)
{
	struct kp_lb6_key key = {};
	struct kp_lb_service *svc;
	struct kp_lb6_backend *be;
	struct kp_master m = {};
	__u32 backend_id;

	key.address[0] = ctx->user_ip6[0];
	key.address[1] = ctx->user_ip6[1];
	key.address[2] = ctx->user_ip6[2];
	key.address[3] = ctx->user_ip6[3];
	key.dport = (__be16)ctx->user_port;
	key.proto = proto;
	svc = kp_svc6.lookup(&key);
	if (!svc)
		return KP_UNTOUCHED;
	kp_read_master(&m, svc);
	if (m.flags & KP_F_REJECT) {
		bpf_set_retval(-ECONNREFUSED);
		return KP_REJECTED;
	}
	if ((m.flags & KP_F_DROP) || m.count == 0)
		return KP_UNTOUCHED;
	backend_id = kp_pick(ctx, &m, seed, &key, &key.slot, 1);
	if (!backend_id)
		return KP_MISS;
	be = kp_be6.lookup(&backend_id);
	if (!be || !be->proto)
		return KP_MISS;
#ifdef KP_PEER
	if (proto == IPPROTO_TCP && kp_peer_put6(ctx, be, &key, m.rev_nat_id))
		goto rewrite;
#endif
	{
		struct kp_rev6_key rk = {};
		struct kp_rev6_val rv = {};
		struct kp_rev6_val *old;
		rk.cookie = kp_cookie(ctx);
		rk.address[0] = be->address[0];
		rk.address[1] = be->address[1];
		rk.address[2] = be->address[2];
		rk.address[3] = be->address[3];
		rk.port = be->port;
		rv.address[0] = key.address[0];
		rv.address[1] = key.address[1];
		rv.address[2] = key.address[2];
		rv.address[3] = key.address[3];
		rv.port = key.dport;
		rv.rev_nat_id = m.rev_nat_id;
		old = kp_rev6.lookup(&rk);
		if (!old || old->address[0] != rv.address[0] || old->address[1] != rv.address[1] ||
		    old->address[2] != rv.address[2] || old->address[3] != rv.address[3] || old->port != rv.port ||
		    old->rev_nat_id != rv.rev_nat_id) {
			kp_rev6.update(&rk, &rv);
			KP_COUNT_FLOW(proto, backend_id, 1);
		}
	}
#ifdef KP_PEER
rewrite:
#endif
	KP_COUNT_CONN(proto, backend_id, 1);
	ctx->user_ip6[0] = be->address[0];
	ctx->user_ip6[1] = be->address[1];
	ctx->user_ip6[2] = be->address[2];
	ctx->user_ip6[3] = be->address[3];
	ctx->user_port = be->port;
	return KP_XLATED;
}

static __always_inline int kp_xlate6(struct bpf_sock_addr *ctx, int by_cookie)
{
	__u8 proto;
	__u32 seed;
	int r;

	if (kp_v4_mapped(ctx)) {
		/* an IPv4 frontend reached from a dual-stack socket: the IPv4 maps, a mapped backend written back */
		__be32 addr = ctx->user_ip6[3];
		__be16 port = (__be16)ctx->user_port;
		r = kp_fwd4(ctx, &addr, &port, by_cookie);
		if (r == KP_REJECTED)
			return SYS_REJECT;
		if (r == KP_XLATED) {
			ctx->user_ip6[3] = addr;
			ctx->user_port = port;
		}
		return SYS_PROCEED;
	}
	proto = kp_proto(ctx);
	if (!proto)
		return SYS_PROCEED;
	seed = by_cookie ? (__u32)kp_cookie(ctx) : bpf_get_prandom_u32();
	r = kp_try6(ctx, proto, seed);
	if (r == KP_MISS)
		r = kp_try6(ctx, proto, seed);
	if (r == KP_MISS) {
		bpf_set_retval(-EHOSTUNREACH);
		return SYS_REJECT;
	}
	return r == KP_REJECTED ? SYS_REJECT : SYS_PROCEED;
}

static __always_inline void kp_rev_xlate6(struct bpf_sock_addr *ctx)
{
	struct kp_rev6_key rk = {};
	struct kp_rev6_val *rv;
	struct kp_lb6_key key = {};
	struct kp_lb_service *svc;

	if (kp_v4_mapped(ctx)) {
		/* the peer is a mapped IPv4 backend: the frontend is a mapped IPv4 one */
		__be32 addr = ctx->user_ip6[3];
		__be16 port = (__be16)ctx->user_port;
		if (kp_rev4_lookup(ctx, &addr, &port)) {
			ctx->user_ip6[3] = addr;
			ctx->user_port = port;
		}
		return;
	}
#ifdef KP_PEER
	if (kp_proto(ctx) == IPPROTO_TCP && kp_peer_get6(ctx))
		return;
#endif
	rk.cookie = kp_cookie(ctx);
	rk.address[0] = ctx->user_ip6[0];
	rk.address[1] = ctx->user_ip6[1];
	rk.address[2] = ctx->user_ip6[2];
	rk.address[3] = ctx->user_ip6[3];
	rk.port = (__be16)ctx->user_port;
	rv = kp_rev6.lookup(&rk);
	if (!rv)
		return;
	key.address[0] = rv->address[0];
	key.address[1] = rv->address[1];
	key.address[2] = rv->address[2];
	key.address[3] = rv->address[3];
	key.dport = rv->port;
	key.proto = kp_proto(ctx);
	svc = kp_svc6.lookup(&key);
	if (!svc || svc->rev_nat_id != rv->rev_nat_id) {
		kp_rev6.delete(&rk);
		return;
	}
	ctx->user_ip6[0] = rv->address[0];
	ctx->user_ip6[1] = rv->address[1];
	ctx->user_ip6[2] = rv->address[2];
	ctx->user_ip6[3] = rv->address[3];
	ctx->user_port = rv->port;
}

int kp_connect6(struct bpf_sock_addr *ctx)
{
	return kp_xlate6(ctx, 0);
}

int kp_sendmsg6(struct bpf_sock_addr *ctx)
{
	return kp_xlate6(ctx, 1);
}

int kp_recvmsg6(struct bpf_sock_addr *ctx)
{
	kp_rev_xlate6(ctx);
	return SYS_PROCEED;
}

int kp_getpeername6(struct bpf_sock_addr *ctx)
{
	kp_rev_xlate6(ctx);
	return SYS_PROCEED;
}
