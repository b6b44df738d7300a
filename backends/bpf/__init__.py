"""The bpf mode: socket-level load balancing by cgroup programs that read BPF maps kproxy keeps current, plus a small
nftables companion table for the packets no local socket sends.

Modules, the same rooms as every mode's: ``render`` (pure: ServicePort -> fragment of socket frontends and companion
elements), ``proxier`` (``BpfProxier``: the ledger's protocol), ``adopt`` (the maps read back, claimed and compared),
``cleanup`` (remnants, kernel_view, cleanup), ``trace`` (the explainer, from the maps), ``kernel`` (plans executed
with batched ``bpf(2)`` calls, the open maps and their check, reading back, floors); and the mode's own: ``maps``
(byte layouts mirroring ``bpf/kproxy_lb.h``, pin names, the ``bpf(2)`` commands), ``loader`` (bcc compile, attach
with BPF_F_ALLOW_MULTI, pin folder and cgroup per namespace), ``programs`` (the loaded programs held and pinned, so
detached programs and removed pins are put back without a compile; a restart adopts them), ``index`` (kproxy's index
of the maps: frontends, ids and their allocators), ``plan`` (the ordered plan of map writes), ``decode`` (adoption's
fast decoder), ``companion`` (the nftables companion table), ``sockets`` (ending connected UDP sockets to removed
backends), ``counters`` (the per-service traffic counters of ``--service-counters``), ``probe`` (whether the
mode can run here, bcc's import tried in a child).
C sources: ``bpf/kproxy_sock.c`` (connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6) and ``bpf/kproxy_lb.h``.
IPv4-mapped IPv6 peers (``::ffff:a.b.c.d``, a dual-stack socket reaching an IPv4 service) are translated by the *6
hooks with the IPv4 maps, and get a mapped backend (and a mapped frontend from getpeername) back. A frontend's slot
or backend that vanishes between a program's lookups (kproxy shrinking the service meanwhile) is looked up once more
from a fresh master entry; still missing, the connect or sendmsg fails at once with EHOSTUNREACH (never an
untranslated packet to an address nothing answers; ECONNREFUSED stays the answer of a service with no endpoints).

Maps (pinned in the pin folder, versioned names ``<role><4|6>_v3``; Cilium's and Calico's shape):
- ``svc``: frontend address . port . protocol . slot -> slot 0 {count, flags (reject, drop, affinity, external),
  affinity timeout, reverse-NAT id}, slots 1..count {backend id}. One frontend per ClusterIP, externalIP,
  load-balancer IP, and NodePort on each of the node's NodePort addresses (so pods and host processes reach
  ``<node IP>:<nodePort>`` by socket translation too).
- ``be``: backend id -> address . port . protocol, an array indexed by the id (all zero: no backend). Ids are per
  service (a backend of two services has two ids), so an affinity entry whose backend id is gone is simply stale.
  An array, not Cilium's hash: kproxy hands the ids out densely from 1 (freed ids first), so the id is the index, and
  an array write is a copy where a hash without preallocation allocates an element: 100,000 backends take 0.023 s of
  kernel time instead of 0.080 s (the first sync at 10,000 x 10 writes them while it plans; the hash made the kernel's
  share, not kproxy's planning, the longer of the two). The price is memory fixed at the size: ``--bpf-map-size``
  entries of 8 bytes (IPv4) and 24 bytes (IPv6), 32 MB at the default 1M, where the hash took ~64 bytes per backend
  in use. Reads go only as far as the highest id a service entry names; a delete writes zeros (an array refuses
  deletes), and the programs treat a zero entry as a vanished backend.
- ``rev`` (LRU, 65,536 entries): socket cookie . backend -> frontend . reverse-NAT id, written by UDP connect/sendmsg,
  read by recvmsg (UDP replies come from the frontend) and getpeername; checked against the frontend's master entry
  on use.
- ``peer`` (socket storage, ``BPF_MAP_TYPE_SK_STORAGE``): a connected TCP socket's backend and frontend, freed with
  the socket, read by getpeername; so TCP connections never fill the ``rev`` LRU. Made and pinned by bcc when the
  programs are compiled (``loader.PEER_ROLE``: kproxy's own map creation cannot make these maps without BTF) and read
  by the programs alone (userspace cannot list them: syncs, adoption and the all-maps-present check skip them; the
  check of the attached programs and cleanup know their pins).
- ``aff`` (LRU): client network-namespace cookie . reverse-NAT id -> backend id, last use (ClientIP affinity for
  sockets: there is no client address at connect time; a pod is a network namespace).
- ``name``: reverse-NAT id -> ``ns/name:port/PROTO``, written by kproxy only: adoption, ``kproxy show`` and
  ``kernel_view`` name what the maps hold.

- ``cnt`` (array, only with ``--service-counters``): backend id -> new connections and flows, zeroed by kproxy with
  each backend and when it goes, incremented by the programs at each translating pick (``counters``: what is
  counted, why connections only, why not per-CPU). Without the switch the programs are compiled without it.

Map writes per batch (``plan.plan_service``) in Cilium's safe order: new backends, names, slots, master entries
(their counts last), then slots beyond the new counts and frontends gone, then backends no longer referenced. Only
entries whose bytes change are written, each phase one ``BPF_MAP_UPDATE_BATCH`` / ``DELETE_BATCH`` call (batch calls
are not atomic across elements, so the order is what keeps every intermediate state consistent).

Semantics: no endpoints -> the connect (or UDP sendmsg) fails at once with ECONNREFUSED (``bpf_set_retval``); Local
policy without local endpoints -> the socket is left untranslated and the companion table drops the packet (a
timeout, as upstream's drop); ClientIP affinity with its timeout; traffic policies and terminating fallback come
from the cache's endpoint choice. Local clients reaching an external address use the cluster endpoints (upstream's
short-circuit for local traffic).

The per-packet path: an nftables companion table, not a tc program. Packets that do not start in a socket of the node's
cgroup (an external client to a NodePort, externalIP or LB IP; forwarded packets to a service address with no endpoints)
go through ``kproxy-bpf``: ``ip daddr . meta l4proto . th dport vmap @svc`` and, for NodePorts, ``ip daddr
@nodeport-cidrs fib daddr type local`` as in the nftables mode (the interval set holds ``--nodeport-addresses``' CIDRs
and primary addresses, or every address but loopback: external packets never reach a NodePort on 127.0.0.0/8 or ::1;
a table of the older layout without the set is written again whole), each element a verdict (``goto kp-reject``,
``drop``, or an immutable per-service chain whose name carries the digest of its rules: a conntrack label asking
postrouting to masquerade under Cluster policy, ``dnat to numgen random mod K map {...}``; a firewall chain for
loadBalancerSourceRanges). The table
exists only while some service has a part in it (NodePorts, externalIPs, LB IPs, services without endpoints, Local
policy without local endpoints: whatever ``render.render_nft`` gives elements for) and is deleted when the last such
service goes: its nat chains and ct rules turn conntrack on for every packet of the namespace, pod-to-pod traffic
included (measured by the datapath benchmark's conntrack floor), and a node of plain ClusterIPs then tracks nothing. Why
nftables (measured here): (1) plain ClusterIP services with endpoints, the bulk at scale, never enter the table (sockets
serve them): at 10,000 services x 10 endpoints the table is empty and a sync is map writes only; a partial sync of such
a service makes no nft call at all (bench: 1.2 ms for a whole partial sync at 5,000 x 10, of which 0.08 ms are the map
writes); a service that does need the table costs one libnftables command, 0.14 ms through a kept context; (2) a tc
program needs its own connection tracking for replies (un-DNAT, masquerade, ICMP errors for reject, fragments): the
kernel's conntrack and nat already do it correctly, and external traffic then gets the same datapath as the nftables
mode, measured there; (3) every conformance scenario passes either way, and the nft route was the one that could be
finished and proven in the time given.

Where the pins live: bpffs and cgroups are not scoped by network namespaces. ``--bpf-pin-path`` and
``--bpf-cgroup-path`` choose them (the lab gives every node its own cgroup and ``/sys/fs/bpf/kproxy/lab-<netns>``);
the defaults are per network namespace (``loader.places``) and the default cgroup is an empty child of kproxy's own
cgroup2 mount: on a real node pass the cgroup v2 directory the pods run under (the deploy overlay mounts the host's at
``/run/kproxy/cgroupv2``: ``--bpf-cgroup-path /run/kproxy/cgroupv2``); kproxy refuses this machine's
``/sys/fs/cgroup`` roots. A process started with ``ip netns exec`` gets a fresh /sys
without the machine's bpffs (a bpffs mounted there would be a private instance whose pins vanish with the process);
the lab (``lab_prepare``) therefore binds the machine's bpffs at ``/run/kproxy/bpffs``, where such a process reaches
it (``loader.host_view``). A benchmark in a throwaway namespace with no such bind uses a private bpffs, removed with
it. Every kproxy records its places in ``/run/kproxy/bpf/net-<netns inode>.json``, so another mode's start-up cleans
up without knowing the bpf options; the record carries the namespace's cookie (``SO_NETNS_COOKIE``: the kernel
reuses inodes, never cookies) and is honoured only by the namespace it names. It keeps every place a kproxy of the
namespace used (a restart with another pin folder or cgroup leaves the older ones to cleanup), and a start with
another ``--bpf-cgroup-path`` detaches kproxy's programs from the cgroup the record names first.

Syncs: maps are created and pinned by kproxy with the programs' exact specs (no compiler needed to sync: ``kproxy
bench sync`` never starts programs); ``start()`` compiles with bcc (1-4 s here, in a child process) and bcc reopens
the pins. Full syncs read the maps and the companion table back at the first sync and after a failure; in between
they trust kproxy's own index. Every 25 s (``KERNEL_READ_S``) the maps and the table are read back to find what
someone edited in place: in ``kproxy run`` by the core's read-behind beside the syncs (``kproxy.readbehind``: a
difference asks for a full sync that adopts from the kernel), without one (tests, ``kproxy bench``) as a full sync
that adopts. Before each sync, at most once a second, a check of a few ``bpf(2)`` calls and one ``list tables``:
pinned maps unpinned or replaced, programs detached or reading maps other than the pinned ones, the companion table
gone (``kproxy cleanup`` of another process does all three) -> the maps are pinned again, a full sync writes
everything, then the programs are attached again. ``verify`` reads the maps through the pins (never kproxy's own
fds), the cgroup's attachments and the companion table's rules.

Where it deviates from upstream, and why:
- ClusterIPs are load-balanced for sockets in the node's cgroup (its pods and host processes). A packet forwarded to
  a ClusterIP with endpoints from outside the cluster is not translated (upstream DNATs and masquerades it): such
  traffic is not a supported path of ClusterIPs; ClusterIPs with no endpoints are rejected for it, as upstream.
- Affinity for sockets is per client network namespace (a pod), not per source address; the companion table has no
  affinity for external clients. An affinity entry holds while one of the frontend's slots names its backend: the
  slot it names first (a backend that stays keeps its slot across endpoint changes, ``plan._stable_slots``); when
  a scale-down moved the last slot's backend into a freed slot, the program finds it among the first 256 slots and
  the entry names the new one (upstream keeps affinity per endpoint; Cilium checks a (reverse-NAT id, backend id)
  match map, which kproxy does not keep). Beyond 256 endpoints a moved backend's clients may choose again.
- A connect() to a service with no endpoints, or a UDP sendmsg, fails at once with ECONNREFUSED (upstream's connect
  succeeds and the ICMP error arrives after); EHOSTUNREACH when a slot went missing mid-update (after one retry).
- loadBalancerSourceRanges are enforced for external packets; local sockets to a load-balancer IP are not filtered.
- Connected UDP sockets keep the backend chosen at connect (as every socket LB); when a UDP service loses a backend,
  connected UDP sockets whose peer it was are ended with ``ss -K`` in the namespaces of the cgroup's processes
  (``sockets``; cilium#27300), every removed backend looked for whatever the ``rev`` LRU still holds (an entry pushed
  out of it must not leave a socket pinned to a dead backend), and the client reconnects to a live one; a client that
  reconnects per attempt, as the probe does, reaches the current backends at once (the udp-conntrack scenario). TCP
  connections to a removed backend are left to end by themselves, as with conntrack NAT.
- SCTP is translated at connect like TCP (the companion table handles it for external packets); no tc program, so
  no XDP/tc acceleration of NodePorts.
- A map-size change (``--bpf-map-size``) needs ``kproxy cleanup`` first: a pinned map keeps the size it was made
  with.

Localhost NodePorts (upstream's iptables-mode ``localhostNodePorts``, ``--iptables-localhost-nodeports``, default
true; IPv4, when ``--nodeport-addresses`` lets loopback in: ``kproxy.nodeaddr``) are served at connect(): the core
adds 127.0.0.1 to the family's NodePort addresses, so every NodePort gets a socket frontend at 127.0.0.1:NODEPORT
like the node's other addresses, and a process of the node's cgroup connects (or sends, for UDP) straight to the
chosen endpoint. The programs treat a loopback destination like any other (a map lookup by address, port and
protocol; nothing in them tests for 127.0.0.0/8), no packet ever leaves the loopback device with a loopback source,
so no ``route_localnet`` and nothing in the companion table, whose ``nodeport-cidrs`` keeps loopback out. A process
outside the cgroup connecting to 127.0.0.1:NODEPORT is not translated (refused), as for every socket-level path.

Start-up over another mode: the daemon's ``after_first_sync`` hook removes other modes' leftovers before the first
sync is counted, as for every mode.

Conformance scenarios not applicable to this mode: none. Reported not-applicable by the suite itself: dual-stack's
counter half (the maps carry no packet counters) and udp-conntrack's stale-entry half (pod traffic is translated at
the socket, so with no companion table conntrack stays off in the node's namespace and no entry can go stale).
"""
