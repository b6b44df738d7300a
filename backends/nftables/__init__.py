"""The nftables mode: verdict maps in a table of kproxy's own, a number of chains that does not grow with services.

Modules: ``layout`` (pure: the table's names, the fixed part, the shared chains named by endpoint count),
``render`` (pure: ServicePorts -> fragments of map elements; ``fragment``: the fragment as the ledger keeps it,
its elements packed in one text, and its digest; ``transaction``: fragment changes -> transactions), ``plan`` (the
transactions of one batch, and what the kernel holds after each), ``proxier`` (``NftablesProxier``: the ledger's
protocol), ``kernel`` (libnftables in-process through the core's ``kproxy.nftkernel``: applying chunks, reading the
table for ``verify``, the bench's floors), ``adopt`` (reading the table back cheaply), ``trace`` (the packet
explainer), ``cleanup`` (remnants, the per-service kernel view, deleting the two tables), ``localhost``
(localhost NodePorts: listeners on 127.0.0.1 relayed by the core's ``kproxy.relay``), ``counters``
(``--service-counters``: per-endpoint connection counters and their read; ``setdump``: the netlink element dumps).

Layout (table ``kproxy`` in family ``ip`` and again in ``ip6``; nothing outside it):
- ``services`` (from ``nat-prerouting`` at dstnat and ``nat-output`` at -100): ``ip daddr . meta l4proto . th dport
  vmap @service-ips`` (ClusterIPs, externalIPs, load-balancer IPs) and ``ip daddr @nodeport-cidrs fib daddr type
  local meta l4proto . th dport vmap @service-nodeports``.
- An element's verdict is ``goto reject-chain`` (no endpoints: ICMP port unreachable, as upstream),
  ``drop`` (Local policy with no local endpoint) or a goto into a *shared* chain named by what it does and by its
  endpoint count K: ``lb-i-K`` (ClusterIP: masquerade unless a local pod sent it, then ``dnat ip to ip daddr . meta
  l4proto . th dport . numgen random mod K map @backends``), ``lb-a-K`` (always masquerade: externalIPs / LB IPs
  under Cluster policy, ``--masquerade-all``), ``lb-n-K`` (never), ``np-{a,n}-K`` (the same keyed by protocol .
  port in ``@nodeport-backends``), ``lbl-K-J`` / ``npl-K-J`` (externalTrafficPolicy=Local: local pods go to the J
  cluster endpoints in ``@shortcut-backends`` unmasqueraded, the node itself masqueraded, everyone else to the K
  local endpoints, or dropped when K = 0), and ``fw-<chain>`` (load-balancer IPs with source ranges: admit
  ``ip daddr . meta l4proto . th dport . ip saddr @firewall-allow``, a concatenated interval set, else drop).
  ``backends-tcp`` (and ``-udp``, ``-sctp``) holds one element per endpoint slot: ``<service address> . tcp . 80 .
  2 : <pod> . 8080``. One slot map per protocol, each rule prefixed ``meta l4proto tcp``: nft 1.0.6 cannot read
  back a typeof map whose data is ``ip daddr . th dport`` (any later rule using it fails with "conflicting
  protocols specified: ip vs. th"), and data typed ``tcp dport`` makes a rule match TCP only.
- ClientIP affinity is the one per-service state, so only those services get chains of their own: an entry
  chain, a ``pick`` chain per endpoint set (``ip saddr @aff-… goto ep-…`` per endpoint, then ``numgen random mod K
  vmap``), an ``ep`` chain per endpoint (``update @aff-… { ip saddr }``, DNAT) and a dynamic set per endpoint with
  the service's timeout, like upstream's.
- Masquerade without packet marks: a chain that decides to masquerade sets conntrack label bit 127 (``ct label set
  127``), and ``nat-postrouting`` masquerades (``fully-random``) connections with that label, plus DNATed ones whose
  source is their destination (``ip saddr . ip daddr @hairpin``, one ``ep . ep`` element per local endpoint). The
  packet mark (upstream's bit 14) is shared with kubelet, CNIs and policy routing; conntrack labels are unused on a
  Kubernetes node, private to the connection, and need no clearing. ``iifname`` would work in postrouting too, but
  the decision belongs where the service is known.
- The node context lives in three small sets (``local-cidrs``, ``local-ifaces`` for bridge / interface-prefix
  detection, ``nodeport-cidrs``), so no chain depends on it: a context change rewrites a few set elements and the
  service elements whose verdict it changes. An empty chain ``layout-<digest>`` names the fixed part's version.

Why this layout: the kernel pays per chain, superlinearly in a transaction (upstream's chain per service and per
endpoint is 110k chains at 10,000 services x 10 endpoints), while elements are cheap; the figures are in
docs/PERFORMANCE.md. With chains indexed by endpoint count there are a handful of chains whatever the number of
services. An endpoint change is element deletes and adds only (the service's slots, and its digest element): no
chain is rewritten, and the service's entries are rewritten only when their verdict changes (another endpoint
count, no endpoints any more). That keeps a partial sync independent of the table's size: adding an element with a
``goto`` verdict marks the table for validation, and at commit the kernel walks every element of every verdict
map reachable from a base chain (``nf_tables_validate``), O(services) on each such commit. So the fragment digest
lives in a plain set, ``service-digests`` (one element per service port, keyed by its ClusterIP entry, commented
``ns/name:port/PROTO #digest``), and the entries carry their service's name (``ns/name:port/PROTO``), for
``kernel_view`` and adoption; slots carry none (their key extends their entry's, and comments on every slot cost
``nft -f`` a measurable share). The entry maps carry per-element counters: new connections per service address
(``nft list map ip kproxy service-ips``), nearly free since nat chains see only a connection's first packet.
With ``--service-counters`` the table also holds counting sets, an element with its own counter per (service
address or NodePort, endpoint), sharded 64 ways so that the kernel dumps them in linear time, looked up by two
counting chains at the source-NAT hooks, where a connection's first packet arrives after its DNAT (``counters``: new
connections only, and why).

Syncs: one atomic transaction per family per batch. A transaction of element changes only (most partial syncs,
every chunk of a big full sync but its first) is encoded by kproxy itself from the transaction's element lines and
sent as one nf_tables netlink batch (``nlwrite``); anything else (chains, rules, interval sets, sets of their own)
goes through libnftables in-process (no process per change), handed over as a memfd file so a refused element's
line maps back to its service (the ledger retries without it). A batch the kernel refuses changed nothing, and the
same transaction goes to libnftables, whose answer names the line. Why: at 100,000 x 10, libnftables' parse of the
element text was ~16 of a full sync's 27 s of CPU and a few kB per element it parses; the kernel's own share is a
few seconds (docs/PERFORMANCE.md). Elements go in one ``add element`` / ``delete element`` command per map, one
element per line (thousands of small commands cost libnftables several times as much). A partial sync writes the
dirty services' element changes (and a shared chain the first time a count appears, its removal with the last user).
The one exception to "one transaction": a big full sync (over 10,000 elements) is applied as transactions of whole
services, the fixed part and shared chains first (through libnftables), then the services that go (one added in the
same batch may take an address a removed one holds), and the shared chains' removal last, so every service still
changes atomically and every intermediate state is a consistent mix of old and new services (as the iptables
backend's chunked restores). Its chunks of 50,000 elements are netlink batches: each transaction that adds a
``goto`` element makes the kernel walk every verdict-map element at its commit, so fewer, bigger ones cost less
(a chunk libnftables parses stays near 10,000 elements: it holds a few kB per element). Each chunk is applied in the
context's worker thread (``sendmsg`` and libnftables release the GIL) while the next is built (``plan``,
``kernel``). A table being replaced (another layout, or unreadable) is
always one transaction. A full sync (start, after a failure, periodically, or when the table vanished or was
flushed: the fixed chains' rules are checked at most once a second at the start of partial syncs) adopts first: it
reads chain names, every chain's rules by the comment kproxy writes on each (a digest of the rule: one netlink rule
dump, no set elements; a rule deleted, added or replaced by hand, or a flushed table, is seen and rewritten), and
the small maps and sets (``service-ips``, ``service-nodeports``, ``service-digests``, firewall, hairpin, context
sets), never the 100,000-slot
maps (listing the whole table takes seconds at 10k x 10; ``nft list tables`` and ``list chain`` fetch all of it too
in nft 1.0.6); the three with an element per service address by netlink element dumps (``setdump``), in the
background while the ledger renders (``adopt``). A service whose entries and digest match is left alone, so a
restart with nothing changed writes nothing; a changed or vanished service's slot keys follow from its entries'
verdicts (``lb-i-3``: slots 0..2). A table of another layout, or one that cannot be read, is replaced in one
transaction (``add table; delete table; …``), so there is no moment without rules.

What it costs (full, partial and restart syncs, against the kernel's own ``nft -f`` and upstream's layout):
docs/PERFORMANCE.md.

Where kproxy deviates from upstream's nftables mode, and why:
- Names: table ``kproxy`` (upstream ``kube-proxy``), so both can coexist during a migration; maps keep upstream's
  ``service-ips`` / ``service-nodeports`` names and key shapes.
- Reject and drop happen in the nat chains (prerouting / output) on the first packet of a connection, not in filter
  hooks: reject in prerouting is allowed since Linux 5.9 (upstream supports older kernels), and one lookup per new
  connection is cheaper than a filter-hook lookup on every packet.
- No packet mark (see above); no ``cluster-ips-check`` rule rejecting unused ports of ClusterIPs (upstream's
  nftables-only addition; the iptables modes never had it): such packets are routed as without kube-proxy.
- Health-check node ports need no accept rule: an accept in kproxy's table cannot override another table's drop.
- Affinity and source ranges as upstream; hairpin masquerade is per local endpoint (a remote endpoint cannot be
  its own client through this node).
- Localhost NodePorts (``127.0.0.1:NODEPORT`` from the node's own processes; upstream's iptables-mode
  ``localhostNodePorts``, on by default, which upstream's nftables mode dropped and brings back in 1.38 with a small
  userspace TCP proxy, KEP-6032) are served the same way, by a relay rather than by rules (no ``route_localnet``, so
  none of CVE-2020-8558's exposure): one listening socket per NodePort on 127.0.0.1, TCP and UDP, relayed to the
  service's cluster endpoints by the core's relay (``kproxy.relay``, the userspace mode's data path), whenever
  ``--iptables-localhost-nodeports`` (upstream's flag and config field, default true) and ``--nodeport-addresses``
  let loopback in (``kproxy.nodeaddr``; IPv4 only). What it costs: one thread (an asyncio event loop, started with the
  first such listener and idle between connections), one socket per NodePort, and per relayed TCP connection the
  accepted socket, a socket to the endpoint and two pipes (four descriptors: ``splice``), per UDP client a connected
  socket closed after 250 ms idle; each new connection costs the relay an accept, a second handshake and a few
  splices (the userspace mode's figures: docs/PERFORMANCE.md), against a DNAT's nothing. Only the node's own
  processes use it. A NodePort without cluster endpoints has no listener (refused, as the rules reject it);
  SCTP has none. The endpoint sees the node's address as the source, as upstream's masquerade shows it.
- kproxy trusts its own table's content between full syncs: a deleted table is noticed and rebuilt, an element
  edited by hand under an unchanged digest is not. A restart trusts a service's digest for its entries too (it
  reads the entry maps only when a service changed or went: ``adopt``); the next full sync that reads everything
  repairs such an edit, and the drift watcher sees one made while kproxy runs.

Conformance scenarios not applicable to this mode: none.
"""
