"""Pure rendering of upstream kube-proxy's iptables layout: ServicePorts in, ``iptables-restore`` text out.

Nothing here touches the kernel, so unit tests assert on exact rules and the benchmark times Python's share apart
from the kernel's. The rule text follows ``pkg/proxy/iptables/proxier.go`` (``syncProxyRules``,
``writeServiceToEndpointRules``, ``iptablesJumpChains``) rule for rule; where kproxy deviates it is said in
``backends/iptables/__init__.py``.

Shape of the output: every service port renders into one ``Fragment`` (its lines in the shared top-level chains,
plus its own ``KUBE-SVC/SVL/EXT/FW/SEP`` chains). ``build_restore`` joins fragments into one restore payload per
family, writing only the dirty services' own chains and only the top-level chains whose content changed; it
records which payload lines belong to which service so a line the kernel refuses can be traced back to it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.config import ProxyConfig
from kproxy.model import Endpoint, IPFamily, NodeInfo, ServicePort, ServicePortName
from kproxy.nodeaddr import LOOPBACK, FamilyContext, LocalDetect, resolve
from kproxy.toolkit.cidr import any_contains

log = logging.getLogger(__name__)

# Top-level chains (upstream's const block).
KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_PROXY_CANARY = "KUBE-PROXY-CANARY"

#: Upstream's largeClusterEndpointsThreshold: above this many endpoints, per-endpoint comments are left out.
LARGE_CLUSTER_ENDPOINTS = 1000

#: Prefixes of the per-service and per-endpoint chains (all in the nat table).
# KUBE-XLB- is the pre-1.24 name of KUBE-SVL-: never written, but swept as stale by a full sync, as upstream does,
# so that an old kube-proxy's chains do not keep stale endpoint chains referenced
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-")

# Keys of the shared chains a fragment contributes to: "table/chain".
F_SERVICES = "filter/" + KUBE_SERVICES
F_EXTERNAL = "filter/" + KUBE_EXTERNAL_SERVICES
F_FORWARD = "filter/" + KUBE_FORWARD
F_NODEPORTS = "filter/" + KUBE_NODEPORTS
F_FIREWALL = "filter/" + KUBE_PROXY_FIREWALL
N_SERVICES = "nat/" + KUBE_SERVICES
N_NODEPORTS = "nat/" + KUBE_NODEPORTS
N_POSTROUTING = "nat/" + KUBE_POSTROUTING
N_MARK_MASQ = "nat/" + KUBE_MARK_MASQ

#: Upstream's order of declaration, per table.
TOP_CHAINS: dict[str, tuple[str, ...]] = {
    "filter": (F_SERVICES, F_EXTERNAL, F_FORWARD, F_NODEPORTS, F_FIREWALL),
    "nat": (N_SERVICES, N_NODEPORTS, N_POSTROUTING, N_MARK_MASQ),
}
ALL_TOP = TOP_CHAINS["filter"] + TOP_CHAINS["nat"]

NODEPORTS_COMMENT = '"kubernetes service nodeports; NOTE: this must be the last rule in this chain"'


@dataclass(frozen=True, slots=True)
class JumpRule:
    """A rule in a built-in chain that leads into kproxy's chains (upstream's ``iptablesJumpChains``)."""

    table: str
    chain: str  # the built-in chain it sits in
    target: str
    comment: str
    extra: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        """The rule as ``iptables-save`` prints it, without ``-A CHAIN``."""
        return " ".join((*self.extra, "-m", "comment", "--comment", quote(self.comment), "-j", self.target))


_NEW = ("-m", "conntrack", "--ctstate", "NEW")
JUMP_RULES: tuple[JumpRule, ...] = (
    JumpRule("filter", "INPUT", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", _NEW),
    JumpRule("filter", "FORWARD", KUBE_EXTERNAL_SERVICES, "kubernetes externally-visible service portals", _NEW),
    JumpRule("filter", "INPUT", KUBE_NODEPORTS, "kubernetes health check service ports"),
    JumpRule("filter", "FORWARD", KUBE_SERVICES, "kubernetes service portals", _NEW),
    JumpRule("filter", "OUTPUT", KUBE_SERVICES, "kubernetes service portals", _NEW),
    JumpRule("filter", "FORWARD", KUBE_FORWARD, "kubernetes forwarding rules"),
    JumpRule("filter", "INPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    JumpRule("filter", "OUTPUT", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    JumpRule("filter", "FORWARD", KUBE_PROXY_FIREWALL, "kubernetes load balancer firewall", _NEW),
    JumpRule("nat", "OUTPUT", KUBE_SERVICES, "kubernetes service portals"),
    JumpRule("nat", "PREROUTING", KUBE_SERVICES, "kubernetes service portals"),
    JumpRule("nat", "POSTROUTING", KUBE_POSTROUTING, "kubernetes postrouting rules"),
)


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


_SVC_HASH: dict[str, str] = {}
_SVC_HASH_MAX = 131_072  # service ports remembered; past it the memo starts over (services churn over a long life)
_SEP_CACHE: dict[tuple[str, str], str] = {}


def port_proto_hash(spn: ServicePortName) -> str:
    """Upstream's ``portProtoHash``: base32(sha256(``ns/name:port`` + ``tcp``))[:16]; memoised, bounded."""
    key = str(spn) + spn.protocol.lowercase
    h = _SVC_HASH.get(key)
    if h is None:
        if len(_SVC_HASH) >= _SVC_HASH_MAX:
            _SVC_HASH.clear()
        h = _SVC_HASH[key] = _hash16(key)
    return h


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


def _sep(base: str, endpoint: str) -> str:
    key = (base, endpoint)
    name = _SEP_CACHE.get(key)
    if name is None:
        if len(_SEP_CACHE) > 500_000:  # bounded: endpoints churn over a long life
            _SEP_CACHE.clear()
        name = _SEP_CACHE[key] = "KUBE-SEP-" + _hash16(base + endpoint)
    return name


def is_service_chain(name: str) -> bool:
    return name.startswith(SERVICE_CHAIN_PREFIXES)


# ----------------------------------------------------------------------------------------------- quoting


_UNSAFE = ("\\", '"', "\n", "\r", "\0")


def quote(text: str) -> str:
    """A double-quoted iptables-restore word: backslash and quote escaped, line breaks removed, at most 256 bytes
    (the comment match's limit). Names arrive validated from the cache; this keeps a bad one from breaking the
    payload (or injecting lines) anyway."""
    if len(text) < 200 and text.isascii() and not any(c in text for c in _UNSAFE):
        return '"' + text + '"'
    clean = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ").replace("\r", " ").replace("\0", "")
    if len(clean.encode()) > 250:
        clean = clean.encode()[:250].decode(errors="ignore").rstrip("\\")
    return '"' + clean + '"'


def _bare(text: str) -> str:
    """A comment word upstream writes unquoted (``ns/svc:port`` in SEP chains); quoted if it is not a plain word."""
    if text and all(c.isalnum() or c in "-./:_" for c in text):
        return text
    return quote(text)


_PROB: dict[int, str] = {}


def probability(n: int) -> str:
    """Upstream's ``%0.10f`` of 1/n, cached."""
    p = _PROB.get(n)
    if p is None:
        p = _PROB[n] = f"{1.0 / n:0.10f}"
    return p


# ----------------------------------------------------------------------------------------------- context


@dataclass(frozen=True, slots=True)
class Context:
    """Everything besides the ServicePort that a family's rules depend on."""

    family: IPFamily
    mark: str  # upstream's masqueradeMark, e.g. 0x004000
    masquerade_all: bool = False
    if_local: str = ""  # LocalTrafficDetector's IfLocal arguments ("-s CIDR", "-i br0", "-i veth+"); "" = cannot tell
    if_not_local: str = ""  # its IfNotLocal arguments
    nodeport_destinations: tuple[tuple[str, ...], ...] = ()  # arguments of each KUBE-SERVICES -> KUBE-NODEPORTS rule
    node_ips: tuple[str, ...] = ()  # the Node's addresses of this family (upstream's nodeIP, for FW chains)
    large_cluster: bool = False  # upstream's largeClusterMode: no per-endpoint comments (a 40% smaller payload)
    random_fully: bool = True
    drop_invalid: bool = True


def make_context(
    config: ProxyConfig,
    node: NodeInfo,
    family: IPFamily,
    large_cluster: bool = False,
) -> Context:
    """The Context of one family from the config and the Node (tests and tools; syncs go through ``context_for``
    with the node context the core resolved)."""
    fc = resolve(config, node, families=(family,)).family(family)
    return context_for(fc, config.masquerade_mark, large_cluster=large_cluster)


def local_matches(local: LocalDetect) -> tuple[str, str]:
    """Upstream's LocalTrafficDetector ``IfLocal`` / ``IfNotLocal`` arguments for one family ("" when it cannot
    tell local traffic apart). Interface names come from validated config (``kproxy.config``)."""
    if local.kind == "cidr":
        return f"-s {local.values[0]}", f"! -s {local.values[0]}"
    if local.kind == "bridge":
        return f"-i {local.values[0]}", f"! -i {local.values[0]}"
    if local.kind == "prefix":
        return f"-i {local.values[0]}+", f"! -i {local.values[0]}+"
    return "", ""


def context_for(fc: FamilyContext, mark: str, large_cluster: bool = False) -> Context:
    """The Context of one family from the node context the core resolved once for this sync and the config's
    masquerade mark (this mode's alone: no other mode marks packets)."""
    if_local, if_not_local = local_matches(fc.local)
    return Context(
        family=fc.family,
        mark=mark,
        masquerade_all=fc.masquerade_all,
        if_local=if_local,
        if_not_local=if_not_local,
        nodeport_destinations=nodeport_destinations(fc),
        node_ips=fc.node_ips,
        large_cluster=large_cluster,
    )


def nodeport_destinations(fc: FamilyContext) -> tuple[tuple[str, ...], ...]:
    """Arguments of each KUBE-SERVICES -> KUBE-NODEPORTS rule of one family, from the node context's NodePort
    addresses (``kproxy.nodeaddr``: ``--nodeport-addresses`` with loopback left out; localhost NodePorts are not
    supported, see __init__.py). Every local address but loopback is ``addrtype LOCAL`` minus loopback; CIDRs are
    ``-d CIDR`` with ``addrtype LOCAL`` (upstream resolves the node's addresses inside each CIDR once per sync;
    matching the CIDR together with dst-type LOCAL selects the same addresses and follows address changes without a
    resync); ``primary`` addresses are ``-d IP``."""
    if fc.nodeport_all_local:
        return (("-m", "addrtype", "--dst-type", "LOCAL", "!", "-d", str(LOOPBACK[fc.family])),)
    dests: list[tuple[str, ...]] = [("-d", ip) for ip in fc.nodeport_ips]
    dests.extend(("-d", c, "-m", "addrtype", "--dst-type", "LOCAL") for c in fc.nodeport_cidrs)
    return tuple(dests)


# ----------------------------------------------------------------------------------------------- fragments


@dataclass(frozen=True, slots=True)
class Fragment:
    """One service port's rules in one family.

    ``top`` maps a shared chain key (``F_SERVICES`` ...) to this service's lines in it; ``chains`` are the nat chains
    it owns (declared in this order), ``rules`` the lines of those chains.
    """

    spn: ServicePortName
    top: Mapping[str, tuple[str, ...]]
    chains: tuple[str, ...]
    rules: tuple[str, ...]

    @property
    def rule_count(self) -> dict[str, int]:
        out = {"filter": 0, "nat": len(self.rules)}
        for key, lines in self.top.items():
            out[key.split("/", 1)[0]] += len(lines)
        return out


def render_service(sp: ServicePort, ctx: Context) -> Fragment:
    """All rules of one service port, as upstream's ``syncProxyRules`` loop body writes them."""
    spn = sp.name
    proto = spn.protocol.lowercase
    name = str(spn)
    h = port_proto_hash(spn)
    svc_chain = "KUBE-SVC-" + h
    svl_chain = "KUBE-SVL-" + h
    ext_chain = "KUBE-EXT-" + h
    fw_chain = "KUBE-FW-" + h
    pmatch = f"-m {proto} -p {proto}"
    port = sp.port

    cluster_eps = sp.cluster_endpoints
    local_eps = sp.local_endpoints
    has_endpoints = sp.has_any_endpoints or bool(cluster_eps or local_eps)
    externally_accessible = sp.has_external_addresses
    internal_local = sp.internal_policy_local
    external_local = sp.external_policy_local and externally_accessible
    # Upstream's UsesClusterEndpoints / UsesLocalEndpoints: Cluster endpoints also serve the eTP=Local short-circuit.
    uses_cluster_chain = bool(cluster_eps) and (not internal_local or externally_accessible)
    uses_local_chain = bool(local_eps) and (internal_local or external_local)
    internal_chain = svl_chain if internal_local else svc_chain
    has_internal = bool(local_eps) if internal_local else bool(cluster_eps)
    external_policy_chain = svl_chain if external_local else svc_chain
    has_external = bool(local_eps) if external_local else bool(cluster_eps)
    uses_ext_chain = has_endpoints and externally_accessible
    lb_chain = ext_chain
    uses_fw = has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
    if uses_fw:
        lb_chain = fw_chain

    if not has_endpoints:
        int_target = ext_target = "REJECT"
        int_comment = ext_comment = quote(f"{name} has no endpoints")
    else:
        int_target = ext_target = "DROP"
        int_comment = ext_comment = quote(f"{name} has no local endpoints")

    n_services: list[str] = []
    n_nodeports: list[str] = []
    f_services: list[str] = []
    f_external: list[str] = []
    f_nodeports: list[str] = []
    f_firewall: list[str] = []

    cip = sp.cluster_ip
    if has_internal:
        n_services.append(
            f"-A KUBE-SERVICES -m comment --comment {quote(name + ' cluster IP')} {pmatch} -d {cip} --dport {port} "
            f"-j {internal_chain}"
        )
    else:
        f_services.append(
            f"-A KUBE-SERVICES -m comment --comment {int_comment} {pmatch} -d {cip} --dport {port} -j {int_target}"
        )
    if sp.external_ips:
        eip_comment = quote(name + " external IP")
        for eip in sp.external_ips:
            if has_endpoints:
                n_services.append(
                    f"-A KUBE-SERVICES -m comment --comment {eip_comment} {pmatch} -d {eip} --dport {port} "
                    f"-j {ext_chain}"
                )
            if not has_external:
                f_external.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} {pmatch} -d {eip} --dport {port} "
                    f"-j {ext_target}"
                )
    if sp.load_balancer_ips:
        lb_comment = quote(name + " loadbalancer IP")
        fw_comment = quote(f"{name} traffic not accepted by {fw_chain}")
        for lbip in sp.load_balancer_ips:
            if has_endpoints:
                n_services.append(
                    f"-A KUBE-SERVICES -m comment --comment {lb_comment} {pmatch} -d {lbip} --dport {port} "
                    f"-j {lb_chain}"
                )
            if uses_fw:
                f_firewall.append(
                    f"-A KUBE-PROXY-FIREWALL -m comment --comment {fw_comment} {pmatch} -d {lbip} --dport {port} "
                    "-j DROP"
                )
        if not has_external:
            for lbip in sp.load_balancer_ips:
                f_external.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} {pmatch} -d {lbip} --dport {port} "
                    f"-j {ext_target}"
                )
    if sp.node_port:
        if has_endpoints:
            n_nodeports.append(
                f"-A KUBE-NODEPORTS -m comment --comment {_bare(name)} {pmatch} --dport {sp.node_port} -j {ext_chain}"
            )
        if not has_external:
            f_external.append(
                f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} -m addrtype --dst-type LOCAL {pmatch} "
                f"--dport {sp.node_port} -j {ext_target}"
            )
    if sp.health_check_node_port:
        f_nodeports.append(
            f"-A KUBE-NODEPORTS -m comment --comment {quote(name + ' health check node port')} -m tcp -p tcp "
            f"--dport {sp.health_check_node_port} -j ACCEPT"
        )

    chains: list[str] = []
    rules: list[str] = []
    if has_internal:
        args = f"-m comment --comment {quote(name + ' cluster IP')} {pmatch} -d {cip} --dport {port}"
        if ctx.masquerade_all:
            rules.append(f"-A {internal_chain} {args} -j KUBE-MARK-MASQ")
        elif ctx.if_not_local:
            rules.append(f"-A {internal_chain} {args} {ctx.if_not_local} -j KUBE-MARK-MASQ")

    if uses_ext_chain:
        chains.append(ext_chain)
        if not external_local:
            rules.append(
                f"-A {ext_chain} -m comment --comment "
                f"{quote('masquerade traffic for ' + name + ' external destinations')} -j KUBE-MARK-MASQ"
            )
        else:
            if ctx.if_local and uses_cluster_chain:
                rules.append(
                    f"-A {ext_chain} -m comment --comment {quote('pod traffic for ' + name + ' external destinations')}"
                    f" {ctx.if_local} -j {svc_chain}"
                )
            rules.append(
                f"-A {ext_chain} -m comment --comment "
                f"{quote('masquerade LOCAL traffic for ' + name + ' external destinations')}"
                " -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
            )
            if uses_cluster_chain:
                rules.append(
                    f"-A {ext_chain} -m comment --comment "
                    f"{quote('route LOCAL traffic for ' + name + ' external destinations')}"
                    f" -m addrtype --src-type LOCAL -j {svc_chain}"
                )
        if has_external:
            rules.append(f"-A {ext_chain} -j {external_policy_chain}")

    if uses_fw:
        chains.append(fw_chain)
        head = f"-A {fw_chain} -m comment --comment {quote(name + ' loadbalancer IP')}"
        for cidr in sp.load_balancer_source_ranges:
            rules.append(f"{head} -s {cidr} -j {ext_chain}")
        # Upstream also admits the LB IPs as sources when a range contains the node IP (VIP-style LBs looping
        # back); kproxy is handed no single node IP, so it admits them when any range holds a node address.
        if any_contains(sp.load_balancer_source_ranges, ctx.node_ips):
            for lbip in sp.load_balancer_ips:
                rules.append(f"{head} -s {lbip} -j {ext_chain}")
        # what falls off the end was not DNATed, so the matching KUBE-PROXY-FIREWALL rule drops it in filter
        dropped = quote(f"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL")
        rules.append(f"-A {fw_chain} -m comment --comment {dropped}")

    affinity = sp.affinity_timeout
    base = name + proto
    names: dict[str, tuple[str, str]] = {}  # "ip:port" -> (SEP chain, "-m comment ..." for "svc -> ip:port")
    if uses_cluster_chain:
        chains.append(svc_chain)
        _lb_rules(rules, svc_chain, base, name, cluster_eps, affinity, names, ctx.large_cluster)
    if uses_local_chain:
        chains.append(svl_chain)
        _lb_rules(rules, svl_chain, base, name, local_eps, affinity, names, ctx.large_cluster)

    # Endpoint chains (upstream's allLocallyReachableEndpoints, dedup by "ip:port").
    seen: set[str] = set()
    bare = "" if ctx.large_cluster else f"-m comment --comment {_bare(name)} "
    eps = (cluster_eps if uses_cluster_chain else ()) + (local_eps if uses_local_chain else ())
    for ep in eps:
        eps_str = str(ep)
        if eps_str in seen:
            continue
        seen.add(eps_str)
        sep = names[eps_str][0]
        chains.append(sep)
        rules.append(f"-A {sep} {bare}-s {ep.ip} -j KUBE-MARK-MASQ")
        if affinity:
            rules.append(f"-A {sep} {bare}-m recent --name {sep} --set {pmatch} -j DNAT --to-destination {eps_str}")
        else:
            rules.append(f"-A {sep} {bare}{pmatch} -j DNAT --to-destination {eps_str}")

    top: dict[str, tuple[str, ...]] = {}
    for key, lines in (
        (N_SERVICES, n_services),
        (N_NODEPORTS, n_nodeports),
        (F_SERVICES, f_services),
        (F_EXTERNAL, f_external),
        (F_NODEPORTS, f_nodeports),
        (F_FIREWALL, f_firewall),
    ):
        if lines:
            top[key] = tuple(lines)
    return Fragment(spn, top, tuple(chains), tuple(rules))


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


def render_fixed(ctx: Context) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Rules of the shared chains that do not belong to any service: key -> (head lines, tail lines)."""
    mark = ctx.mark
    masq = "-A KUBE-POSTROUTING -m comment --comment " + quote("kubernetes service traffic requiring SNAT")
    masq += " -j MASQUERADE" + (" --random-fully" if ctx.random_fully else "")
    forward: list[str] = []
    if ctx.drop_invalid:
        forward.append("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP")
    forward.append(
        f"-A KUBE-FORWARD -m comment --comment {quote('kubernetes forwarding rules')} -m mark --mark {mark}/{mark} "
        "-j ACCEPT"
    )
    forward.append(
        f"-A KUBE-FORWARD -m comment --comment {quote('kubernetes forwarding conntrack rule')} -m conntrack "
        "--ctstate RELATED,ESTABLISHED -j ACCEPT"
    )
    tail = tuple(
        f"-A KUBE-SERVICES -m comment --comment {NODEPORTS_COMMENT} {' '.join(d)} -j KUBE-NODEPORTS"
        for d in ctx.nodeport_destinations
    )
    return {
        N_POSTROUTING: (
            (
                f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
                f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
                masq,
            ),
            (),
        ),
        N_MARK_MASQ: ((f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}",), ()),
        F_FORWARD: (tuple(forward), ()),
        N_SERVICES: ((), tail),
    }


# ----------------------------------------------------------------------------------------------- payload


@dataclass(slots=True)
class Restore:
    """One ``iptables-restore`` payload and the owner of its lines (for mapping "line N failed" to a service)."""

    text: str
    owners: list[tuple[int, int, ServicePortName]] = field(default_factory=list)  # [first, last] 1-based, inclusive
    rules: dict[str, int] = field(default_factory=dict)  # rules written per table

    def owner_of(self, line: int) -> ServicePortName | None:
        for first, last, spn in self.owners:
            if first <= line <= last:
                return spn
        return None


class _Writer:
    """Appends lines, counting them, and notes which service owns each run of lines."""

    __slots__ = ("lines", "owners")

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.owners: list[tuple[int, int, ServicePortName]] = []

    def add(self, lines: Iterable[str]) -> None:
        self.lines.extend(lines)

    def owned(self, lines: Sequence[str], spn: ServicePortName) -> None:
        if lines:
            first = len(self.lines) + 1
            self.lines.extend(lines)
            self.owners.append((first, len(self.lines), spn))


def changed_top_chains(
    old: Mapping[ServicePortName, Fragment],
    new: Mapping[ServicePortName, Fragment | None],
) -> set[str]:
    """Shared chains whose content differs when the fragments in ``new`` replace those in ``old`` (None = removed)."""
    changed: set[str] = set()
    empty: Mapping[str, tuple[str, ...]] = {}
    for spn, frag in new.items():
        before = old.get(spn)
        a = before.top if before is not None else empty
        b = frag.top if frag is not None else empty
        for key in a.keys() | b.keys():
            if a.get(key) != b.get(key):
                changed.add(key)
    return changed


def build_restore(
    ctx: Context,
    fragments: Mapping[ServicePortName, Fragment],
    *,
    write: Iterable[ServicePortName] | None,
    top: Iterable[str] | None,
    delete_chains: Iterable[str] = (),
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
) -> Restore:
    """The restore payload for one family.

    ``fragments`` is every wanted service (in order); ``write`` the services whose own chains are written (None:
    all, a full sync); ``top`` the shared chains to rewrite (None: all); ``delete_chains`` nat chains to flush and
    delete; ``jump_rules`` built-in chain jumps to insert (those missing from the kernel); ``canary`` declares
    KUBE-PROXY-CANARY in mangle, filter and nat (full syncs).
    """
    fixed = render_fixed(ctx)
    top_set = set(ALL_TOP) if top is None else set(top)
    to_write = fragments.keys() if write is None else [s for s in write if s in fragments]
    deleting = sorted(set(delete_chains))
    jumps = list(jump_rules)
    w = _Writer()
    rules = {"filter": 0, "nat": 0}

    if canary:
        w.add(("*mangle", f":{KUBE_PROXY_CANARY} - [0:0]", "COMMIT"))

    for table in ("filter", "nat"):
        keys = [k for k in TOP_CHAINS[table] if k in top_set]
        own = table == "nat" and (to_write or deleting)
        tjumps = [j for j in jumps if j.table == table]
        if not keys and not own and not tjumps and not canary:
            continue
        w.add(("*" + table,))
        if canary:
            w.add((f":{KUBE_PROXY_CANARY} - [0:0]",))
        for key in keys:
            w.add((f":{key.split('/', 1)[1]} - [0:0]",))
        if table == "nat":
            w.add(f":{c} - [0:0]" for spn in to_write for c in fragments[spn].chains)
            w.add(f":{c} - [0:0]" for c in deleting)
        for key in keys:
            head, tail = fixed.get(key, ((), ()))
            w.add(head)
            rules[table] += len(head)
            for spn, frag in fragments.items():
                lines = frag.top.get(key)
                if lines:
                    w.owned(lines, spn)
                    rules[table] += len(lines)
            w.add(tail)
            rules[table] += len(tail)
        if table == "nat":
            for spn in to_write:
                lines = fragments[spn].rules
                w.owned(lines, spn)
                rules["nat"] += len(lines)
            w.add(f"-X {c}" for c in deleting)
        for j in tjumps:
            w.add((f"-I {j.chain} 1 {j.spec}",))
            rules[table] += 1
        w.add(("COMMIT",))
    text = "\n".join(w.lines) + "\n" if w.lines else ""
    return Restore(text=text, owners=w.owners, rules=rules)


def total_rules(ctx: Context, fragments: Mapping[ServicePortName, Fragment]) -> dict[str, int]:
    """Rules in kproxy's chains per table if everything were written (upstream's iptables_total gauges)."""
    out = {"filter": 0, "nat": 0}
    for key, (head, tail) in render_fixed(ctx).items():
        out[key.split("/", 1)[0]] += len(head) + len(tail)
    for frag in fragments.values():
        for table, n in frag.rule_count.items():
            out[table] += n
    return out


def build_restores(
    ctx: Context,
    fragments: Mapping[ServicePortName, Fragment],
    *,
    write: Iterable[ServicePortName] | None,
    top: Iterable[str] | None,
    delete_chains: Iterable[str] = (),
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
    chunk_lines: int | None = None,
) -> list[Restore]:
    """``build_restore``, split into several payloads when ``chunk_lines`` is set and the change is bigger.

    Why: the nf_tables flavour's ``iptables-restore --noflush`` spends time quadratic in the size of one payload (a
    linear search per rule in userspace: 1,000 services x 10 endpoints take 8.7 s in one payload, 2,000 take 43 s,
    and the same lines in 3,000-line payloads take under a second). Each chunk holds whole services' own chains,
    SEP/SVC/EXT/FW together, so every service still changes atomically; the last payload rewrites the shared chains
    (which then start pointing at the new chains), inserts missing jumps and deletes stale chains. Every state in
    between is a consistent mix of old and new services. The legacy flavour commits the whole table per payload,
    so it gets one payload.
    """
    names = list(fragments.keys()) if write is None else [s for s in write if s in fragments]
    size = sum(len(fragments[s].rules) + len(fragments[s].chains) for s in names)
    if chunk_lines is None or size <= chunk_lines:
        return [
            build_restore(
                ctx, fragments, write=names, top=top, delete_chains=delete_chains, jump_rules=jump_rules, canary=canary
            )
        ]
    # KUBE-MARK-MASQ (and KUBE-POSTROUTING with it) go first: every service chunk jumps to KUBE-MARK-MASQ.
    top_set = set(ALL_TOP) if top is None else set(top)
    early = top_set & {N_MARK_MASQ, N_POSTROUTING}
    out: list[Restore] = []
    group: list[ServicePortName] = []
    lines = 0
    for spn in names:
        frag = fragments[spn]
        group.append(spn)
        lines += len(frag.rules) + len(frag.chains)
        if lines >= chunk_lines:
            out.append(build_restore(ctx, fragments, write=group, top=() if out else early))
            group, lines = [], 0
    if group:
        out.append(build_restore(ctx, fragments, write=group, top=() if out else early))
    out.append(
        build_restore(
            ctx,
            fragments,
            write=(),
            top=top_set - early,
            delete_chains=delete_chains,
            jump_rules=jump_rules,
            canary=canary,
        )
    )
    return out


def stream_restores(
    ctx: Context,
    items: Iterable[tuple[ServicePortName, Fragment, bool]],
    *,
    top: Iterable[str] | None,
    delete_chains: Callable[[], Iterable[str]],
    jump_rules: Iterable[JumpRule] = (),
    canary: bool = False,
    chunk_lines: int,
) -> Iterator[Restore]:
    """``build_restores`` for a big full sync, yielding each chunk as soon as its services are rendered.

    ``items`` gives (service, fragment, whether its chains are written) one by one, in order, typically rendering
    each as it is asked for; the caller applies a chunk while the next one is rendered, so rendering overlaps the
    kernel's work instead of preceding it. The payloads are those ``build_restores`` makes for a change bigger than
    ``chunk_lines``: KUBE-MARK-MASQ and KUBE-POSTROUTING in the first, whole services per chunk, and a last one with
    the shared chains (every service's lines), the missing jumps and ``delete_chains()``, asked for at the end.
    """
    top_set = set(ALL_TOP) if top is None else set(top)
    early = top_set & {N_MARK_MASQ, N_POSTROUTING}
    seen: dict[ServicePortName, Fragment] = {}
    group: dict[ServicePortName, Fragment] = {}
    lines = 0
    first = True
    for spn, frag, write in items:
        seen[spn] = frag
        if not write:
            continue
        group[spn] = frag
        lines += len(frag.rules) + len(frag.chains)
        if lines >= chunk_lines:
            yield build_restore(ctx, group, write=None, top=early if first else ())
            first, group, lines = False, {}, 0
    if group or first:
        yield build_restore(ctx, group, write=None, top=early if first else ())
    yield build_restore(
        ctx,
        seen,
        write=(),
        top=top_set - early,
        delete_chains=delete_chains(),
        jump_rules=jump_rules,
        canary=canary,
    )
