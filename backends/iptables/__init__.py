"""The iptables mode: upstream kube-proxy's iptables chain layout, applied with ``iptables-restore --noflush``.

This is kproxy's reference backend: its rules are upstream's (``pkg/proxy/iptables/proxier.go``, ~1.33) rule for
rule, so people who read kube-proxy's chains read these, and the conformance suite's expectations can be checked
against the rules first.

Modules: ``layout`` (pure: upstream's shared chains, the jumps into them, the family's context, the fragment type,
the fixed rules), ``render`` (pure: a ServicePort -> its fragment, with upstream's chain names and hashing),
``restore`` (pure: fragments -> restore payloads, chunking), ``proxier`` (``IptablesProxier``: the ledger's protocol,
one round of a batch; the ledger keeps what is applied and runs the refusal rounds), ``adopt`` (the canonical
comparison of rules, for adoption and ``verify``), ``kernel`` (the only place that runs iptables binaries: flavour
detection, applying payloads, the reads for adoption and ``verify``, the bench's floors), ``cleanup`` (``remnants``
and the per-service ``kernel_view`` read from ``iptables-save``, the pure selection of what to delete, and
``cleanup_leftovers()``), ``trace`` (the packet explainer).

Layout (upstream's names and hashing):
- filter: ``KUBE-SERVICES`` (REJECT/DROP for service IPs without usable endpoints), ``KUBE-EXTERNAL-SERVICES``
  (the same for externalIPs / LB IPs / NodePorts), ``KUBE-NODEPORTS`` (ACCEPT healthCheckNodePorts),
  ``KUBE-PROXY-FIREWALL`` (DROP for LB traffic not admitted by loadBalancerSourceRanges), ``KUBE-FORWARD``
  (drop ctstate INVALID, accept marked, accept RELATED,ESTABLISHED); jumps from INPUT/FORWARD/OUTPUT as
  upstream's ``iptablesJumpChains``.
- nat: ``KUBE-SERVICES`` (ClusterIP -> SVC/SVL, externalIP -> EXT, LB IP -> FW or EXT, last rule -> KUBE-NODEPORTS),
  ``KUBE-NODEPORTS`` (-> EXT), ``KUBE-POSTROUTING`` (MASQUERADE --random-fully marked packets), ``KUBE-MARK-MASQ``;
  per service port ``KUBE-SVC-`` (Cluster policy: off-cluster masquerade, ClientIP affinity ``recent --rcheck``,
  ``statistic`` random with ``%0.10f`` probabilities), ``KUBE-SVL-`` (Local policy), ``KUBE-EXT-`` (external
  destinations: masquerade for Cluster policy, pod / LOCAL short-circuit for Local), ``KUBE-FW-`` (source
  ranges), and per endpoint ``KUBE-SEP-`` (hairpin masquerade, ``recent --set``, DNAT). Chain names are
  base32(sha256(``ns/name:port`` + ``tcp``))[:16], plus ``ip:port`` for SEP chains.
- ``KUBE-PROXY-CANARY`` in mangle, nat and filter of both families.
- Localhost NodePorts (upstream's ``localhostNodePorts``, ``--iptables-localhost-nodeports``, default true; IPv4
  only, and only when ``--nodeport-addresses`` lets loopback in: ``kproxy.nodeaddr``), as upstream: the last
  ``KUBE-SERVICES`` rule matches every local address, loopback included (``! -d 127.0.0.0/8`` only when they are
  off; ``! -d ::1/128`` always), ``net.ipv4.conf.all.route_localnet=1`` is set (checked on every full sync, never
  set back), and upstream's copy of kubelet's ``KUBE-FIREWALL`` in filter holds the CVE-2020-8558 mitigation
  (``block incoming localnet connections``: ``-d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate
  RELATED,ESTABLISHED,DNAT -j DROP``), jumped to from INPUT and OUTPUT (``iptablesKubeletJumpChains``). Like
  upstream, a full sync declares that chain (so it holds that one rule) while localhost NodePorts are served, and
  neither ``cleanup`` nor turning them off removes it (it is kubelet's). The node's own client at 127.0.0.1 is
  masqueraded by the ``KUBE-EXT-`` chain's rules (Cluster policy: every external destination; Local policy:
  ``addrtype --src-type LOCAL``), which is what upstream's older ``-s 127.0.0.0/8 -j KUBE-MARK-MASQ`` did.

Where kproxy deviates from upstream, and why:
- Shared chains (KUBE-SERVICES, KUBE-NODEPORTS, ...) are rewritten only when a dirty service's lines in them
  changed, not on every sync: rewriting KUBE-SERVICES is costly at 10,000 services (docs/PERFORMANCE.md); an endpoint
  change does not touch it.
- On the nf_tables flavour a big change (a full sync) is split into payloads of ~3,000 lines, each holding whole
  services (their SEP, SVC/SVL, EXT and FW chains together), KUBE-MARK-MASQ in the first, the shared chains,
  missing jumps and stale-chain deletions in the last. ``iptables-nft-restore --noflush`` (1.8.9) spends time
  quadratic in a payload's size, so one payload for thousands of services takes minutes where chunks take seconds
  (docs/PERFORMANCE.md, iptables mode). Each service still changes atomically and each
  intermediate state is a consistent mix of old and new services. The legacy flavour gets one payload. A big full
  sync streams: chunk N+1's text is built while iptables-restore applies chunk N (``render.stream_restores``).
- Jumps from the built-in chains are inserted (``-I CHAIN 1``) inside the full sync's payload when
  ``iptables-save`` shows them missing, instead of one ``iptables -C``/``-I`` pair per rule: the same result,
  atomically, without 24 process starts.
- Full syncs adopt: they read ``iptables-save -t nat`` once and rewrite only the services whose chains differ from
  what the kernel holds (compared rule by rule in a canonical form, ``adopt.py``), plus the shared chains. Upstream
  rewrites everything on every full sync; here a restart at 10,000 services leaves unchanged services' rules and
  counters alone and costs seconds instead of rewriting every chain, and a chain changed behind kproxy's back
  is still repaired. Stale service chains are found from the same read on full syncs and from what kproxy itself
  wrote on partial syncs (upstream reads ``iptables-save`` once per sync period). Jumps are checked with
  ``iptables -S <built-in chain>``.
- Payload chunks grow with the table already in the kernel (3,000 lines into an empty table, up to 12,000 into a
  loaded one), because each nf_tables payload first fetches every rule of the table.
- The canary is checked at the start of a partial sync (mangle and nat, one ``iptables -S`` each per family) at
  most once per sync period, rather than by a polling goroutine; a missing canary makes that family's sync a full
  one. A flush is therefore repaired by the first sync after the next check, within a sync period plus the time
  until the next sync (the runner syncs at least once per sync period).
- A service whose rules the kernel refuses is reported in ``SyncResult.failed`` and the rest is applied; upstream
  fails the whole restore (which leaves every old rule in place). A refused update keeps the service's previously
  applied rules, as upstream would; a service with no previous rules (or whose previous rules are refused too) is
  left out, treated as absent (no REJECT either).
- ``--nodeport-addresses`` CIDRs become ``-d CIDR -m addrtype --dst-type LOCAL`` (the node's addresses in that
  CIDR, following address changes without a resync) instead of one rule per address found at sync time;
  ``primary`` uses the Node's addresses.
- The INVALID drop in KUBE-FORWARD is always written (upstream omits it when nf_conntrack_tcp_be_liberal is set).
- Upstream's largeClusterMode (more than 1,000 endpoints: no per-endpoint comments) is kept.
- ``cleanup`` deletes only the built-in chains' jumps into kproxy's chains; an owned chain another program's chain
  jumps to (CNI portmap's ``CNI-HOSTPORT -j KUBE-MARK-MASQ``) is kept with what it reaches, and
  ``KUBE-POSTROUTING`` with ``KUBE-MARK-MASQ``. Upstream's cleanup restore fails on such a chain and so keeps the
  whole table.
- A stale chain whose deletion the kernel refuses (another chain still jumps to it) is left in place and the sync
  retried without deletions, rather than failing every sync; the next full sync tries again.

What a partial sync costs is set by the kernel, not by the payload: on nf_tables every commit that adds a rule
walks every rule reachable from each base chain (``nf_tables_validate``), once per hook that reaches it (the
late-2025 memoisation, "netfilter: nf_tables: avoid chain re-validation if possible", keys on the hook, so
PREROUTING and OUTPUT still walk the whole service table each). So a partial sync of a few rules costs what the
walk costs, and ``kproxy bench sync`` reports that floor with the jumps (``partial_floor_s``) and without them
(``unhooked_s``); the legacy flavour replaces the whole table on every restore. The figures: docs/PERFORMANCE.md.

Conformance scenarios not applicable to this mode: none.
"""
