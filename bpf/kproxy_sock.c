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
 * Maps: bpf/kproxy_lb.h. The reverse entries are written on every translation (keyed by socket cookie and backend)
 * and checked against the frontend's master entry on use, so a deleted or recreated service is never answered for.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
#include <uapi/linux/errno.h>
#include "kproxy_lb.h"

#define SYS_REJECT 0
#define SYS_PROCEED 1

BPF_TABLE_PINNED("hash", struct kp_lb4_key, struct kp_lb_service, kp_svc4, KP_SVC_MAX, KP_PIN_SVC4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kp_lb4_backend, kp_be4, KP_BE_MAX, KP_PIN_BE4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct kp_rev4_key, struct kp_rev4_val, kp_rev4, KP_LRU_MAX, KP_PIN_REV4);
BPF_TABLE_PINNED("lru_hash", struct kp_aff_key, struct kp_aff_val, kp_aff4, KP_LRU_MAX, KP_PIN_AFF4);
BPF_TABLE_PINNED("hash", __u32, struct kp_svc_name, kp_name4, 65536, KP_PIN_NAME4, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kp_svc_name, kp_name6, 65536, KP_PIN_NAME6, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct kp_lb6_key, struct kp_lb_service, kp_svc6, KP_SVC_MAX, KP_PIN_SVC6, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", __u32, struct kp_lb6_backend, kp_be6, KP_BE_MAX, KP_PIN_BE6, BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lru_hash", struct kp_rev6_key, struct kp_rev6_val, kp_rev6, KP_LRU_MAX, KP_PIN_REV6);
BPF_TABLE_PINNED("lru_hash", struct kp_aff_key, struct kp_aff_val, kp_aff6, KP_LRU_MAX, KP_PIN_AFF6);

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

/* The backend id for a frontend whose master entry is svc: from affinity when it is still valid, else a slot. */
static __always_inline __u32 kp_pick(struct bpf_sock_addr *ctx, struct kp_lb_service *svc, __u32 slot_seed,
				     void *key, __u16 *slot_field, int is6)
{
	struct kp_lb_service *slot;
	__u32 backend_id = 0;
	struct kp_aff_key ak = {};
	struct kp_aff_val *av;
	__u64 now = 0;

	if (svc->flags & KP_F_AFFINITY) {
		ak.client_cookie = bpf_get_netns_cookie(ctx);
		ak.rev_nat_id = svc->rev_nat_id;
		now = kp_now();
		av = is6 ? kp_aff6.lookup(&ak) : kp_aff4.lookup(&ak);
		if (av && av->last_used + svc->affinity_timeout > now && av->slot >= 1 && av->slot <= svc->count) {
			/* still this service's backend: the frontend's slot it came from holds it (see kp_aff_val) */
			__u32 id = av->backend_id;
			*slot_field = (__u16)av->slot;
			slot = is6 ? kp_svc6.lookup(key) : kp_svc4.lookup(key);
			if (slot && slot->backend_id == id) {
				av->last_used = now;
				return id;
			}
		}
	}
	*slot_field = (slot_seed % svc->count) + 1;
	slot = is6 ? kp_svc6.lookup(key) : kp_svc4.lookup(key);
	if (!slot)
		return 0;
	backend_id = slot->backend_id;
	if (svc->flags & KP_F_AFFINITY) {
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

static __always_inline int kp_xlate4(struct bpf_sock_addr *ctx, int by_cookie)
{
	struct kp_lb4_key key = {};
	struct kp_lb_service *svc;
	struct kp_lb4_backend *be;
	__u32 backend_id, seed;
	__u8 proto = kp_proto(ctx);

	if (!proto)
		return SYS_PROCEED;
	key.address = ctx->user_ip4;
	key.dport = (__be16)ctx->user_port;
	key.proto = proto;
	svc = kp_svc4.lookup(&key);
	if (!svc)
		return SYS_PROCEED;
	if (svc->flags & KP_F_REJECT) {
		bpf_set_retval(-ECONNREFUSED);
		return SYS_REJECT;
	}
	if ((svc->flags & KP_F_DROP) || svc->count == 0)
		return SYS_PROCEED;
	seed = by_cookie ? (__u32)kp_cookie(ctx) : bpf_get_prandom_u32();
	backend_id = kp_pick(ctx, svc, seed, &key, &key.slot, 0);
	if (!backend_id)
		return SYS_PROCEED;
	be = kp_be4.lookup(&backend_id);
	if (!be)
		return SYS_PROCEED;
	{
		struct kp_rev4_key rk = {};
		struct kp_rev4_val rv = {};
		rk.cookie = kp_cookie(ctx);
		rk.address = be->address;
		rk.port = be->port;
		rv.address = ctx->user_ip4;
		rv.port = (__be16)ctx->user_port;
		rv.rev_nat_id = svc->rev_nat_id;
		kp_rev4.update(&rk, &rv);
	}
	ctx->user_ip4 = be->address;
	ctx->user_port = be->port;
	return SYS_PROCEED;
}

static __always_inline void kp_rev_xlate4(struct bpf_sock_addr *ctx)
{
	struct kp_rev4_key rk = {};
	struct kp_rev4_val *rv;
	struct kp_lb4_key key = {};
	struct kp_lb_service *svc;

	rk.cookie = kp_cookie(ctx);
	rk.address = ctx->user_ip4;
	rk.port = (__be16)ctx->user_port;
	rv = kp_rev4.lookup(&rk);
	if (!rv)
		return;
	key.address = rv->address;
	key.dport = rv->port;
	key.proto = kp_proto(ctx);
	svc = kp_svc4.lookup(&key);
	if (!svc || svc->rev_nat_id != rv->rev_nat_id) {
		kp_rev4.delete(&rk);
		return;
	}
	ctx->user_ip4 = rv->address;
	ctx->user_port = rv->port;
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

static __always_inline int kp_xlate6(struct bpf_sock_addr *ctx, int by_cookie)
{
	struct kp_lb6_key key = {};
	struct kp_lb_service *svc;
	struct kp_lb6_backend *be;
	__u32 backend_id, seed;
	__u8 proto = kp_proto(ctx);

	if (!proto)
		return SYS_PROCEED;
	key.address[0] = ctx->user_ip6[0];
	key.address[1] = ctx->user_ip6[1];
	key.address[2] = ctx->user_ip6[2];
	key.address[3] = ctx->user_ip6[3];
	key.dport = (__be16)ctx->user_port;
	key.proto = proto;
	svc = kp_svc6.lookup(&key);
	if (!svc)
		return SYS_PROCEED;
	if (svc->flags & KP_F_REJECT) {
		bpf_set_retval(-ECONNREFUSED);
		return SYS_REJECT;
	}
	if ((svc->flags & KP_F_DROP) || svc->count == 0)
		return SYS_PROCEED;
	seed = by_cookie ? (__u32)kp_cookie(ctx) : bpf_get_prandom_u32();
	backend_id = kp_pick(ctx, svc, seed, &key, &key.slot, 1);
	if (!backend_id)
		return SYS_PROCEED;
	be = kp_be6.lookup(&backend_id);
	if (!be)
		return SYS_PROCEED;
	{
		struct kp_rev6_key rk = {};
		struct kp_rev6_val rv = {};
		rk.cookie = kp_cookie(ctx);
		rk.address[0] = be->address[0];
		rk.address[1] = be->address[1];
		rk.address[2] = be->address[2];
		rk.address[3] = be->address[3];
		rk.port = be->port;
		rv.address[0] = ctx->user_ip6[0];
		rv.address[1] = ctx->user_ip6[1];
		rv.address[2] = ctx->user_ip6[2];
		rv.address[3] = ctx->user_ip6[3];
		rv.port = (__be16)ctx->user_port;
		rv.rev_nat_id = svc->rev_nat_id;
		kp_rev6.update(&rk, &rv);
	}
	ctx->user_ip6[0] = be->address[0];
	ctx->user_ip6[1] = be->address[1];
	ctx->user_ip6[2] = be->address[2];
	ctx->user_ip6[3] = be->address[3];
	ctx->user_port = be->port;
	return SYS_PROCEED;
}

static __always_inline void kp_rev_xlate6(struct bpf_sock_addr *ctx)
{
	struct kp_rev6_key rk = {};
	struct kp_rev6_val *rv;
	struct kp_lb6_key key = {};
	struct kp_lb_service *svc;

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
