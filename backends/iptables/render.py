"""Pure rendering of upstream kube-proxy's iptables layout: ServicePorts in, ``iptables-restore`` text out.

Nothing here touches the kernel, so unit tests assert on exact rules and the benchmark times Python's share apart
from the kernel's. The rule text follows ``pkg/proxy/iptables/proxier.go`` (``syncProxyRules``,
``writeServiceToEndpointRules``, ``iptablesJumpChains``) rule for rule; where kproxy deviates it is said in
``backends/iptables/__init__.py``.

Shape of the output: every service port renders into one ``Fragment`` (its lines in the shared top-level chains,
plus its own ``KUBE-SVC/SVL/EXT/FW/SEP`` chains), with upstream's chain names and hashing (here); ``layout`` holds
the shared chains, the context and the fixed rules, ``restore`` joins fragments into restore payloads (both read
through this module too, as the tests always have).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from kproxy.model import Endpoint, ServicePort, ServicePortName
from kproxy.toolkit.cidr import any_contains

from .layout import (
    ALL_TOP,
    F_EXTERNAL,
    F_FIREWALL,
    F_FORWARD,
    F_NODEPORTS,
    F_SERVICES,
    JUMP_RULES,
    KUBE_PROXY_CANARY,
    KUBELET_FIREWALL,
    LARGE_CLUSTER_ENDPOINTS,
    N_MARK_MASQ,
    N_NODEPORTS,
    N_POSTROUTING,
    N_SERVICES,
    NODEPORTS_COMMENT,
    SERVICE_CHAIN_PREFIXES,
    TOP_CHAINS,
    Context,
    Fragment,
    JumpRule,
    bare,
    context_for,
    make_context,
    probability,
    quote,
    render_fixed,
)
from .restore import Restore, build_restore, build_restores, changed_top_chains, stream_restores, total_rules

#: what other modules and the tests read from here: the names and fragments, and the layout's and payloads' names
__all__ = [
    "ALL_TOP",
    "F_EXTERNAL",
    "F_FIREWALL",
    "F_FORWARD",
    "F_NODEPORTS",
    "F_SERVICES",
    "JUMP_RULES",
    "KUBE_PROXY_CANARY",
    "KUBELET_FIREWALL",
    "LARGE_CLUSTER_ENDPOINTS",
    "N_MARK_MASQ",
    "N_NODEPORTS",
    "N_POSTROUTING",
    "N_SERVICES",
    "NODEPORTS_COMMENT",
    "SERVICE_CHAIN_PREFIXES",
    "TOP_CHAINS",
    "Context",
    "Fragment",
    "JumpRule",
    "Restore",
    "build_restore",
    "build_restores",
    "changed_top_chains",
    "context_for",
    "endpoint_chain",
    "external_chain",
    "firewall_chain",
    "is_service_chain",
    "local_chain",
    "make_context",
    "port_proto_hash",
    "probability",
    "quote",
    "render_fixed",
    "render_service",
    "service_chain",
    "stream_restores",
    "total_rules",
]

# ----------------------------------------------------------------------------------------------- names


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)  # 10 bits -> two base32 characters


def _hash16(text: str) -> str:
    """The first 16 characters of base32(sha256(text)): 80 bits = the digest's first 10 bytes, eight 10-bit pairs
    (base64's b32encode is pure Python in 3.11 and dominated a 100k-endpoint render)."""
    n = int.from_bytes(hashlib.sha256(text.encode()).digest()[:10], "big")
    p = _B32_PAIRS
    return (
        p[n >> 70]
        + p[(n >> 60) & 1023]
        + p[(n >> 50) & 1023]
        + p[(n >> 40) & 1023]
        + p[(n >> 30) & 1023]
        + p[(n >> 20) & 1023]
        + p[(n >> 10) & 1023]
        + p[n & 1023]
    )


def port_proto_hash(spn: ServicePortName) -> str:
    """Upstream's ``portProtoHash``: base32(sha256(``ns/name:port`` + ``tcp``))[:16]; memoised, bounded."""
    return _proto_hash(str(spn) + spn.protocol.lowercase)


@functools.lru_cache(maxsize=131_072)  # service ports remembered (services churn over a long life)
def _proto_hash(key: str) -> str:
    return _hash16(key)


def service_chain(spn: ServicePortName) -> str:
    return "KUBE-SVC-" + port_proto_hash(spn)


def local_chain(spn: ServicePortName) -> str:
    return "KUBE-SVL-" + port_proto_hash(spn)


def external_chain(spn: ServicePortName) -> str:
    return "KUBE-EXT-" + port_proto_hash(spn)


def firewall_chain(spn: ServicePortName) -> str:
    return "KUBE-FW-" + port_proto_hash(spn)


def endpoint_chain(spn: ServicePortName, endpoint: str) -> str:
    """``KUBE-SEP-`` + base32(sha256(``ns/name:port`` + ``tcp`` + ``ip:port``))[:16]; cached (100k per full sync)."""
    return _sep(str(spn) + spn.protocol.lowercase, endpoint)


@functools.lru_cache(maxsize=500_000)  # bounded: endpoints churn over a long life
def _sep(base: str, endpoint: str) -> str:
    return "KUBE-SEP-" + _hash16(base + endpoint)


def is_service_chain(name: str) -> bool:
    return name.startswith(SERVICE_CHAIN_PREFIXES)


def render_service(sp: ServicePort, ctx: Context) -> Fragment:
    """All rules of one service port, as upstream's ``syncProxyRules`` loop body writes them."""
    s = _Service(sp, ctx)
    s.cluster_ip()
    s.external_ips()
    s.load_balancer_ips()
    s.node_ports()
    s.masquerade_rules()
    s.external_chain()
    s.firewall_chain()
    s.endpoint_chains()
    return s.fragment()


class _Service:
    """One service port's rules, part by part in upstream's order (``render_service``): its lines in the shared
    chains (``top``), then its own chains and their rules."""

    def __init__(self, sp: ServicePort, ctx: Context) -> None:
        self.sp, self.ctx = sp, ctx
        spn = sp.name
        self.proto = spn.protocol.lowercase
        self.name = str(spn)
        h = port_proto_hash(spn)
        self.svc_chain, self.svl_chain = "KUBE-SVC-" + h, "KUBE-SVL-" + h
        self.ext_chain, self.fw_chain = "KUBE-EXT-" + h, "KUBE-FW-" + h
        self.pmatch = f"-m {self.proto} -p {self.proto}"
        self.cluster_eps, self.local_eps = sp.cluster_endpoints, sp.local_endpoints
        self.has_endpoints = sp.has_any_endpoints or bool(self.cluster_eps or self.local_eps)
        accessible = sp.has_external_addresses
        internal_local = sp.internal_policy_local
        self.external_local = sp.external_policy_local and accessible
        # Upstream's UsesClusterEndpoints / UsesLocalEndpoints: Cluster endpoints also serve the eTP=Local shortcut.
        self.uses_cluster_chain = bool(self.cluster_eps) and (not internal_local or accessible)
        self.uses_local_chain = bool(self.local_eps) and (internal_local or self.external_local)
        self.internal_chain = self.svl_chain if internal_local else self.svc_chain
        self.has_internal = bool(self.local_eps) if internal_local else bool(self.cluster_eps)
        self.external_policy_chain = self.svl_chain if self.external_local else self.svc_chain
        self.has_external = bool(self.local_eps) if self.external_local else bool(self.cluster_eps)
        self.uses_ext_chain = self.has_endpoints and accessible
        self.uses_fw = self.has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
        self.lb_chain = self.fw_chain if self.uses_fw else self.ext_chain
        if not self.has_endpoints:
            self.target, self.comment = "REJECT", quote(f"{self.name} has no endpoints")
        else:
            self.target, self.comment = "DROP", quote(f"{self.name} has no local endpoints")
        self.top: dict[str, list[str]] = {
            key: [] for key in (N_SERVICES, N_NODEPORTS, F_SERVICES, F_EXTERNAL, F_NODEPORTS, F_FIREWALL)
        }
        self.chains: list[str] = []
        self.rules: list[str] = []

    def _match(self, addr: str) -> str:
        return f"{self.pmatch} -d {addr} --dport {self.sp.port}"

    def cluster_ip(self) -> None:
        cip = self.sp.cluster_ip
        if self.has_internal:
            self.top[N_SERVICES].append(
                f"-A KUBE-SERVICES -m comment --comment {quote(self.name + ' cluster IP')} {self._match(cip)} "
                f"-j {self.internal_chain}"
            )
        else:
            self.top[F_SERVICES].append(
                f"-A KUBE-SERVICES -m comment --comment {self.comment} {self._match(cip)} -j {self.target}"
            )

    def _external_reject(self, match: str) -> str:
        return f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {self.comment} {match} -j {self.target}"

    def external_ips(self) -> None:
        if not self.sp.external_ips:
            return
        eip_comment = quote(self.name + " external IP")
        for eip in self.sp.external_ips:
            if self.has_endpoints:
                self.top[N_SERVICES].append(
                    f"-A KUBE-SERVICES -m comment --comment {eip_comment} {self._match(eip)} -j {self.ext_chain}"
                )
            if not self.has_external:
                self.top[F_EXTERNAL].append(self._external_reject(self._match(eip)))

    def load_balancer_ips(self) -> None:
        sp = self.sp
        if not sp.load_balancer_ips:
            return
        lb_comment = quote(self.name + " loadbalancer IP")
        fw_comment = quote(f"{self.name} traffic not accepted by {self.fw_chain}")
        for lbip in sp.load_balancer_ips:
            if self.has_endpoints:
                self.top[N_SERVICES].append(
                    f"-A KUBE-SERVICES -m comment --comment {lb_comment} {self._match(lbip)} -j {self.lb_chain}"
                )
            if self.uses_fw:
                self.top[F_FIREWALL].append(
                    f"-A KUBE-PROXY-FIREWALL -m comment --comment {fw_comment} {self._match(lbip)} -j DROP"
                )
        if not self.has_external:
            for lbip in sp.load_balancer_ips:
                self.top[F_EXTERNAL].append(self._external_reject(self._match(lbip)))

    def node_ports(self) -> None:
        sp, pmatch = self.sp, self.pmatch
        if sp.node_port:
            if self.has_endpoints:
                self.top[N_NODEPORTS].append(
                    f"-A KUBE-NODEPORTS -m comment --comment {bare(self.name)} {pmatch} --dport {sp.node_port} "
                    f"-j {self.ext_chain}"
                )
            if not self.has_external:
                match = f"-m addrtype --dst-type LOCAL {pmatch} --dport {sp.node_port}"
                self.top[F_EXTERNAL].append(self._external_reject(match))
        if sp.health_check_node_port:
            self.top[F_NODEPORTS].append(
                f"-A KUBE-NODEPORTS -m comment --comment {quote(self.name + ' health check node port')} -m tcp -p tcp "
                f"--dport {sp.health_check_node_port} -j ACCEPT"
            )

    def masquerade_rules(self) -> None:
        """Off-cluster sources to the ClusterIP are masqueraded (or all of them, ``--masquerade-all``)."""
        if not self.has_internal:
            return
        ctx = self.ctx
        args = f"-m comment --comment {quote(self.name + ' cluster IP')} {self._match(self.sp.cluster_ip)}"
        if ctx.masquerade_all:
            self.rules.append(f"-A {self.internal_chain} {args} -j KUBE-MARK-MASQ")
        elif ctx.if_not_local:
            self.rules.append(f"-A {self.internal_chain} {args} {ctx.if_not_local} -j KUBE-MARK-MASQ")

    def external_chain(self) -> None:
        if not self.uses_ext_chain:
            return
        ext, name, rules = self.ext_chain, self.name, self.rules
        self.chains.append(ext)
        if not self.external_local:
            comment = quote("masquerade traffic for " + name + " external destinations")
            rules.append(f"-A {ext} -m comment --comment {comment} -j KUBE-MARK-MASQ")
        else:
            if self.ctx.if_local and self.uses_cluster_chain:
                comment = quote("pod traffic for " + name + " external destinations")
                rules.append(f"-A {ext} -m comment --comment {comment} {self.ctx.if_local} -j {self.svc_chain}")
            comment = quote("masquerade LOCAL traffic for " + name + " external destinations")
            rules.append(f"-A {ext} -m comment --comment {comment} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ")
            if self.uses_cluster_chain:
                comment = quote("route LOCAL traffic for " + name + " external destinations")
                rules.append(
                    f"-A {ext} -m comment --comment {comment} -m addrtype --src-type LOCAL -j {self.svc_chain}"
                )
        if self.has_external:
            rules.append(f"-A {ext} -j {self.external_policy_chain}")

    def firewall_chain(self) -> None:
        if not self.uses_fw:
            return
        sp, fw, ext = self.sp, self.fw_chain, self.ext_chain
        self.chains.append(fw)
        head = f"-A {fw} -m comment --comment {quote(self.name + ' loadbalancer IP')}"
        for cidr in sp.load_balancer_source_ranges:
            self.rules.append(f"{head} -s {cidr} -j {ext}")
        # Upstream also admits the LB IPs as sources when a range contains the node IP (VIP-style LBs looping
        # back); kproxy is handed no single node IP, so it admits them when any range holds a node address.
        if any_contains(sp.load_balancer_source_ranges, self.ctx.node_ips):
            for lbip in sp.load_balancer_ips:
                self.rules.append(f"{head} -s {lbip} -j {ext}")
        # what falls off the end was not DNATed, so the matching KUBE-PROXY-FIREWALL rule drops it in filter
        dropped = quote(f"other traffic to {self.name} will be dropped by KUBE-PROXY-FIREWALL")
        self.rules.append(f"-A {fw} -m comment --comment {dropped}")

    def endpoint_chains(self) -> None:
        """The SVC/SVL chains' picks, then the endpoint chains (upstream's allLocallyReachableEndpoints, dedup by
        ``ip:port``)."""
        sp, ctx, name, rules, pmatch = self.sp, self.ctx, self.name, self.rules, self.pmatch
        affinity = sp.affinity_timeout
        base = name + self.proto
        names: dict[str, tuple[str, str]] = {}  # "ip:port" -> (SEP chain, "-m comment ..." for "svc -> ip:port")
        if self.uses_cluster_chain:
            self.chains.append(self.svc_chain)
            _lb_rules(rules, self.svc_chain, base, name, self.cluster_eps, affinity, names, ctx.large_cluster)
        if self.uses_local_chain:
            self.chains.append(self.svl_chain)
            _lb_rules(rules, self.svl_chain, base, name, self.local_eps, affinity, names, ctx.large_cluster)
        seen: set[str] = set()
        comment = "" if ctx.large_cluster else f"-m comment --comment {bare(name)} "
        eps = (self.cluster_eps if self.uses_cluster_chain else ()) + (self.local_eps if self.uses_local_chain else ())
        for ep in eps:
            eps_str = str(ep)
            if eps_str in seen:
                continue
            seen.add(eps_str)
            sep = names[eps_str][0]
            self.chains.append(sep)
            rules.append(f"-A {sep} {comment}-s {ep.ip} -j KUBE-MARK-MASQ")
            if affinity:
                rules.append(
                    f"-A {sep} {comment}-m recent --name {sep} --set {pmatch} -j DNAT --to-destination {eps_str}"
                )
            else:
                rules.append(f"-A {sep} {comment}{pmatch} -j DNAT --to-destination {eps_str}")

    def fragment(self) -> Fragment:
        top = {key: tuple(lines) for key, lines in self.top.items() if lines}
        return Fragment(self.sp.name, top, tuple(self.chains), tuple(self.rules))


def _lb_rules(
    rules: list[str],
    chain: str,
    base: str,
    name: str,
    endpoints: Sequence[Endpoint],
    affinity: int,
    names: dict[str, tuple[str, str]],
    large: bool,
) -> None:
    """Upstream's ``writeServiceToEndpointRules``: affinity checks first, then statistic-random jumps."""
    pairs = []
    for ep in endpoints:
        s = str(ep)
        pair = names.get(s)
        if pair is None:
            comment = "" if large else f"-m comment --comment {quote(name + ' -> ' + s)} "
            pair = names[s] = (_sep(base, s), comment)
        pairs.append(pair)
    if affinity:
        for sep, comment in pairs:
            rules.append(f"-A {chain} {comment}-m recent --name {sep} --rcheck --seconds {affinity} --reap -j {sep}")
    n = len(pairs)
    last = n - 1
    for i, (sep, comment) in enumerate(pairs):
        if i < last:
            rules.append(f"-A {chain} {comment}-m statistic --mode random --probability {probability(n - i)} -j {sep}")
        else:
            rules.append(f"-A {chain} {comment}-j {sep}")
