"""The userspace mode: upstream's first proxier (kube-proxy's ``pkg/proxy/userspace``, removed in 1.26), rebuilt
to be fast. kproxy itself holds one proxy socket per service port and relays every connection; redirect rules in a
table of this mode's own send service traffic to those sockets.

Modules: ``render`` (pure: a ServicePort to a fragment of redirect elements and listeners; the table's text and a
batch's transaction), ``proxier`` (``UserspaceProxier``: the ledger's protocol, one nft transaction per batch),
``adopt`` (the table and the data path read back, for adoption and for ``kproxy verify``), ``cleanup`` (remnants,
kernel view, deleting the tables), ``trace`` (the packet explainer), ``kernel`` (libnftables, the socket tables, the
open-file limit, the bench's floor), ``ports`` (``--proxy-port-range`` and the proxy port allocator). The data path
is the core's relay, ``kproxy.relay`` (the event loop thread, TCP accept/dial/splice, UDP sessions, round robin and
affinity, counters), which the nftables mode shares for its localhost NodePorts. libnftables is reached through the
core's ``kproxy.nftkernel``.

Layout (table ``kproxy-userspace`` in family ``ip`` and again in ``ip6``; nothing outside it, never another table;
the nftables mode's table is named ``kproxy``):
- ``services`` (jumped to from ``prerouting`` at dstnat, for pods and other hosts, and from ``output`` at -100, for
  the node's own processes): ``ip daddr . meta l4proto . th dport vmap @service-ips`` (ClusterIPs, externalIPs,
  load-balancer IPs) and ``ip daddr @nodeport-cidrs fib daddr type local meta l4proto . th dport vmap
  @service-nodeports`` (NodePorts on ``--nodeport-addresses``, loopback excluded, plus 127.0.0.1 when the core
  serves localhost NodePorts). ``prerouting`` first returns for loopback destinations (IPv4): a packet from outside
  to 127.0.0.1 is a martian the kernel would drop, and a redirect before routing would let it in, so localhost
  NodePorts are redirected on the output path only, to the node's own processes, with no ``route_localnet``.
- An element's verdict is ``goto redirect-svc`` / ``goto redirect-np`` (``redirect to : ip daddr . meta l4proto .
  th dport map @service-ports``: the proxy socket's port for that address, or by protocol . node port in
  ``@nodeport-ports``), ``goto firewall`` (load-balancer IPs with ``loadBalancerSourceRanges``: the source must be in
  ``@firewall-allow``, else drop), ``goto reject-chain`` (no endpoints: ICMP port unreachable, so TCP is refused at
  once and UDP sees port-unreachable, as upstream) or ``drop`` (a Local policy with no local endpoint). REDIRECT
  sends pod traffic to the receiving interface's first address and the node's own to loopback; the proxy socket
  listens on the wildcard address, so every one of them reaches it.
- ``input`` (filter hook input) guards the proxy ports: ``meta l4proto { tcp, udp } th dport @proxy-ports jump
  proxy-guard``, where ``proxy-ports`` holds the proxy port range (one interval) and ``proxy-guard`` accepts a flow's
  reply direction (the node's own connections from a port of the range, should it overlap the ephemeral one) and a
  flow conntrack marks ``dnat`` (a redirect of this table sent it), and refuses anything else as a closed port would
  (TCP reset, ICMP port unreachable). So a client dialling ``nodeIP:<proxy port>`` straight, past the service rules
  and a load balancer's ``loadBalancerSourceRanges``, is refused, from outside, from pods and from the node alike;
  every redirected path (ClusterIP, NodePort, externalIP, load-balancer IP) passes. Why a rule, not a bound
  address: REDIRECT sends outside traffic to the receiving interface's address, so a socket bound to loopback
  would need DNAT to 127.0.0.1 and ``route_localnet`` (itself an exposure, CVE-2020-8558), and IPv6 has no such
  route to ``::1`` at all; ``ct status dnat`` is the kernel's own record that the flow was redirected, in both
  families. The range is matched whole (fixed, one element): ports of it that no proxy socket holds are refused to
  direct connections too, which is what reserving the range means.
- Every element carries its service's key (``ns/name:port/PROTO``) as comment: ``kernel_view`` and adoption group by
  it. An empty chain ``layout-kproxy-userspace-1`` names the layout; a table of another layout is replaced whole in
  one transaction.

Proxy sockets: one per service port (upstream's design), or two when a Local traffic policy gives ClusterIP traffic
and external traffic different endpoints (roles ``i`` and ``e``; ``c`` when they agree). A port comes from
``--proxy-port-range`` (upstream's flag and config field ``portRange``: ``BEGIN-END``, ``BEGIN+SIZE`` or one port;
default 20000-29999, a range of its own below the NodePort range 30000-32767 and the kernel's ephemeral range
32768-60999, so proxy sockets neither use up the node's outgoing ports nor sit where other programs expect random
ports; empty, ``0`` or ``0-0``: upstream's "random", the namespace's ``ip_local_port_range``). The range is the
capacity (``proxy_port_capacity()``: sockets per address family and protocol); a service port that finds every
port of it held is refused with ``ProxyPortsExhausted`` (the ledger reports it failed, the others are served).
Upstream's design was
kept rather than one socket per protocol with ``SO_ORIGINAL_DST``: that option exists for TCP only (UDP would need
TPROXY and ``IP_RECVORIGDSTADDR``), it costs a getsockopt per connection, and a socket per port costs one
descriptor (``start`` raises the soft open-file limit to the hard one).

Data path (``kproxy.relay``): one asyncio event loop in a thread of its own, in the backend's namespace; no thread
per connection. TCP: accept in batches, round robin over the endpoints the cache chose (shuffled on each change),
ClientIP affinity with the service's timeout (entries of removed endpoints dropped at once, stale ones swept every
second), dial without blocking with upstream's timeouts 250 ms, 500 ms, 1 s, 2 s, each failure moving to the next
endpoint with the client's affinity reset; no endpoint reachable: the client is reset. Bytes move with ``os.splice``
socket -> pipe (1 MiB) -> socket, a few splices per wake-up. UDP: a session per client address with a connected
socket to its endpoint, replies sent from the address the client's datagram was redirected to (``IP_PKTINFO``, so
conntrack reverses the redirect), closed after ``--udp-timeout`` idle (upstream's default 250 ms) or at once when its
endpoint goes away (the conntrack reconciler keeps the client's redirect entry: ``conntrack_answerers`` names the
node's addresses and the proxy ports). The runner thread hands the loop new sockets and endpoint lists in one step
and waits until it took them: a sync never stops the loop for longer than that step, endpoint changes apply to the
next connection at once, and connections through a changed or deleted service keep running until they close.

Why splice: bytes move from socket to socket without being copied through Python, a third more throughput than
``recv_into``/``send``; one event loop rather than a thread per connection, with several splices per wake-up. A new
connection costs the proxy an accept, a second handshake and a few splices: the loop thread is busy with syscalls,
not Python. The measurements behind this (relays, pipe sizes, the lab's data-path ratios): docs/PERFORMANCE.md.

Syncs: one libnftables transaction per family per batch, element changes only. Order: proxy sockets are bound and
listening before a redirect names them (connections wait in the backlog until the loop takes the socket), and are
closed only after the redirect is gone; an endpoint change writes nothing to the kernel (the loop's balancer takes
the new list). Full batches diff everything wanted against what ``adopt`` read, so a restart rebinds the ports its
rules name (``SO_REUSEADDR``) and writes nothing when it can; a second instance in the same process (``kproxy bench
sync``'s restart figure) takes the sockets over from the first; a restart with another range binds every socket anew
inside it and rewrites ``proxy-ports``. kproxy picks proxy ports itself, walking the range: the kernel's bind(0)
searches for a free port for every socket, which is far slower at thousands of sockets. libnftables (1.0.6)
``select()``s on its netlink socket and aborts the process when that descriptor is 1024 or above, so its context is
opened before any proxy socket (``kproxy.nftkernel``). The "is my table still there" check before a partial sync lists
the one-element ``proxy-ports`` set, at most once a second per family: nft 1.0.6 lists a chain by fetching the whole
table. What syncs cost: docs/PERFORMANCE.md.

Verify and repair: ``verify`` names a service whose elements, verdicts or marks differ, whose fixed rules (the
redirect, the ``services`` vmap, the hooks, the input guard) are gone (a rule deleted by hand, a flushed table),
whose ``proxy-ports`` set no longer holds the range (its proxy sockets open to direct connections), or whose proxy
port has no socket of this process listening, one serving another service, or one another process took; stray
elements, foreign rules and sockets serving unwanted services are ``extra``. A full sync replaces a table whose
fixed part is damaged (in one transaction, the sockets kept) and binds new sockets for those no longer listening
(from the kernel's socket table); the data path notices a listener destroyed under it (``ss -K``: accept fails with
EINVAL) and the next partial sync becomes a full one. Before partial syncs, at most once a second, kproxy lists the
small ``proxy-ports`` set (a deleted table, or the set emptied or changed: the guard off), and at most once per sync
period the table without elements to compare the fixed rules (a flushed table keeps its sets; a deleted rule).

Restart: established connections are the proxy process's own sockets, so they end when it stops (by nature of this
mode; upstream's userspace proxier behaved the same); the redirect rules stay, and new connections are refused from
the moment the process dies until the restarted one has bound its ports again (its start-up), then flow. The rules
are only ever changed by atomic transactions, so there is no moment without them.

Where kproxy deviates from upstream's userspace mode, and why:
- nftables instead of iptables ``KUBE-PORTALS-*`` chains: one lookup per new connection whatever the number of
  services, and atomic element changes; reject and drop happen in the nat chains on the first packet.
- Upstream relayed in two goroutines per connection with ``io.Copy``; this relays with splice in one event loop.
- Local traffic policies are honoured (upstream's userspace mode predates them). SCTP is not proxied (as upstream;
  this kernel has no SCTP sockets either): its service addresses reject new associations, with a warning.
- Localhost NodePorts (upstream's ``localhostNodePorts``, an iptables-mode feature there) are served natively:
  127.0.0.1:NODEPORT from the node's own processes is redirected to the proxy socket like any NodePort (IPv4, when
  ``--iptables-localhost-nodeports`` and ``--nodeport-addresses`` let it: ``kproxy.nodeaddr``). The proxy ports take
  only redirected traffic (the input guard above); upstream's were reachable directly on every address of the node,
  from any host, and came from the ephemeral range by default.

Conformance: ``source-ip`` is not applicable (the endpoint sees the node, never the client's address); declared parts
(``UserspaceProxier.not_applicable_parts``): the client address of ``etp-local`` and ``dual-stack``, the held
connections of ``restart`` and ``mode-switch`` (an established connection is one of the proxy process's own sockets
and ends with that process), and the while-down window of ``restart``, ``mode-switch`` and ``address-collision``.
"""
