/* The map layouts of kproxy's bpf mode, shared by every program (bpf/kproxy_sock.c) and mirrored byte for byte by
 * ctypes structures in backends/bpf/maps.py (keep both in step; bump MAPS_VERSION there when a layout changes, which
 * renames every pinned map so a new layout never reuses an old map).
 *
 * The shape is Cilium's (bpf/lib/lb.h) and Calico's: a service map keyed by frontend address . port . protocol .
 * slot, where slot 0 is the frontend's master entry (count of backends, verdict flags, affinity timeout, reverse-NAT
 * id) and slots 1..count name backend ids; a backend array id -> address . port . protocol (all zero: no
 * backend; an array, not Cilium's hash: see backends/bpf/__init__.py); LRU maps for the socket reverse
 * translation (UDP replies, getpeername) and for ClientIP affinity; optionally socket storage for connected TCP
 * sockets. Every struct is packed with explicit padding, so Python writes exactly the bytes the programs read.
 *
 * Map sizes and pin paths come from kproxy as macros (KP_SVC_MAX, KP_BE_MAX, KP_NAME_MAX, KP_LRU_MAX, KP_PIN_*), so a
 * restarted
 * kproxy reopens the same pinned maps.
 */
#ifndef KPROXY_LB_H
#define KPROXY_LB_H

/* master entry flags */
#define KP_F_REJECT 0x01   /* no endpoints: the connect/sendmsg fails at once (ECONNREFUSED) */
#define KP_F_DROP 0x02     /* Local policy without local endpoints: left untranslated, the nft companion drops it */
#define KP_F_AFFINITY 0x04 /* ClientIP affinity (keyed by the client's network namespace cookie) */
#define KP_F_EXTERNAL 0x08 /* an externalIP, load-balancer IP or NodePort frontend (informational) */

struct kp_lb4_key {
	__be32 address;
	__be16 dport;
	__u16 slot; /* 0: master entry; 1..count: backend slots */
	__u8 proto;
	__u8 pad[3];
} __attribute__((packed));

struct kp_lb6_key {
	__u32 address[4];
	__be16 dport;
	__u16 slot;
	__u8 proto;
	__u8 pad[3];
} __attribute__((packed));

/* master entry: count, flags, affinity_timeout, rev_nat_id; slot entry: backend_id only. Backend and reverse-NAT ids
 * are 32 bits (a million frontends and backends and more; Cilium's 16-bit ids stop at 65,535: cilium#39236); the
 * slot count stays 16 bits (endpoints of one service port). */
struct kp_lb_service {
	__u32 backend_id;
	__u32 affinity_timeout; /* seconds */
	__u16 count;
	__u8 flags;
	__u8 pad;
	__u32 rev_nat_id;
} __attribute__((packed));

struct kp_lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags;
} __attribute__((packed));

struct kp_lb6_backend {
	__u32 address[4];
	__be16 port;
	__u8 proto;
	__u8 flags;
} __attribute__((packed));

/* socket reverse translation: (socket cookie, backend) -> the frontend the application asked for */
struct kp_rev4_key {
	__u64 cookie;
	__be32 address;
	__be16 port;
	__u16 pad;
} __attribute__((packed));

struct kp_rev4_val {
	__be32 address;
	__be16 port;
	__u16 pad;
	__u32 rev_nat_id;
} __attribute__((packed));

struct kp_rev6_key {
	__u64 cookie;
	__u32 address[4];
	__be16 port;
	__u16 pad;
} __attribute__((packed));

struct kp_rev6_val {
	__u32 address[4];
	__be16 port;
	__u16 pad;
	__u32 rev_nat_id;
} __attribute__((packed));

/* per-socket storage of a connected TCP socket (BPF_MAP_TYPE_SK_STORAGE, only when kproxy defines KP_PIN_PEER4 and
 * KP_PIN_PEER6): the backend it was sent to and the frontend it asked for, freed with the socket, so TCP connections
 * never fill the reverse-NAT LRU that UDP replies and connected-UDP reaping depend on. Read by the programs only
 * (userspace cannot list socket storage), so maps.py needs no mirror of these. */
struct kp_peer4_val {
	__be32 backend;
	__be16 backend_port;
	__be16 frontend_port;
	__be32 frontend;
	__u32 rev_nat_id;
} __attribute__((packed));

struct kp_peer6_val {
	__u32 backend[4];
	__be16 backend_port;
	__be16 frontend_port;
	__u32 frontend[4];
	__u32 rev_nat_id;
} __attribute__((packed));

/* affinity: (client network namespace cookie, frontend's rev_nat_id) -> the backend chosen, when */
struct kp_aff_key {
	__u64 client_cookie;
	__u32 rev_nat_id;
	__u32 pad;
} __attribute__((packed));

struct kp_aff_val {
	__u64 last_used; /* seconds of the monotonic clock */
	__u32 backend_id;
	/* the frontend slot the backend was last found in: the entry is used only while one of the frontend's slots
	 * holds this backend id (ids and reverse-NAT ids are reused after removals, so an id alone may name another
	 * service's backend by then); that slot first, the others when a scale-down moved it (kproxy_sock.c) */
	__u32 slot;
} __attribute__((packed));

/* rev_nat_id -> the service port's name ("ns/name:port/PROTO"), written by kproxy only: the programs never read it;
 * it lets a restarted kproxy, `kproxy show` and the conformance checks name what the maps hold */
struct kp_svc_name {
	char name[128];
};

#endif
