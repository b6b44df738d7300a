"""Upstream kube-proxy's iptables layout: the shared chains' names, the jumps from the built-in chains, the family's
rendering context, the fragment one service port renders to, and the fixed rules of the shared chains.

Pure: nothing here touches the kernel. Names and rule text follow ``pkg/proxy/iptables/proxier.go``
(``iptablesJumpChains``, ``syncProxyRules``' fixed rules); where kproxy deviates it is said in
``backends/iptables/__init__.py``. ``render`` turns service ports into fragments over these names, ``restore`` joins
fragments into ``iptables-restore`` payloads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, NodeInfo, ServicePortName
from kproxy.nodeaddr import LOCALHOST, LOOPBACK, FamilyContext, LocalDetect, resolve

# Top-level chains (upstream's const block).
KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_PROXY_CANARY = "KUBE-PROXY-CANARY"
#: kubelet's chain (``pkg/kubelet/kubelet_network_linux.go``), of which upstream writes a copy holding the one rule
#: that mitigates ``route_localnet`` (CVE-2020-8558) while it serves localhost NodePorts (``kubeletFirewallChain``)
KUBELET_FIREWALL = "KUBE-FIREWALL"

#: Upstream's largeClusterEndpointsThreshold: above this many endpoints, per-endpoint comments are left out.
LARGE_CLUSTER_ENDPOINTS = 1000

#: Prefixes of the per-service and per-endpoint chains (all in the nat table).
# KUBE-XLB- is the pre-1.24 name of KUBE-SVL-: never written, but swept as stale by a full sync, as upstream does,
# so that an old kube-proxy's chains do not keep stale endpoint chains referenced
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-", "KUBE-XLB-")
#: the chains of one service port, named by its port hash (a KUBE-SEP- chain is an endpoint's)
PORT_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-XLB-")

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
F_KUBELET_FIREWALL = "filter/" + KUBELET_FIREWALL

#: Upstream's order of declaration, per table.
TOP_CHAINS: dict[str, tuple[str, ...]] = {
    "filter": (F_SERVICES, F_EXTERNAL, F_FORWARD, F_NODEPORTS, F_FIREWALL),
    "nat": (N_SERVICES, N_NODEPORTS, N_POSTROUTING, N_MARK_MASQ),
}
ALL_TOP = TOP_CHAINS["filter"] + TOP_CHAINS["nat"]
#: the shared chains written as well while localhost NodePorts are served (``top_chains``); kubelet's, so never
#: counted as kproxy's by ``verify`` nor removed by ``cleanup``, as upstream
LOCALHOST_TOP_CHAINS: dict[str, tuple[str, ...]] = {
    "filter": (*TOP_CHAINS["filter"], F_KUBELET_FIREWALL),
    "nat": TOP_CHAINS["nat"],
}

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
        """The rule as ``iptables-save`` prints it, without ``-A CHAIN`` (no comment match for kubelet's)."""
        comment = ("-m", "comment", "--comment", quote(self.comment)) if self.comment else ()
        return " ".join((*self.extra, *comment, "-j", self.target))


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
#: upstream's ``iptablesKubeletJumpChains``, ensured with the others while localhost NodePorts are served
KUBELET_JUMP_RULES: tuple[JumpRule, ...] = (
    JumpRule("filter", "INPUT", KUBELET_FIREWALL, ""),
    JumpRule("filter", "OUTPUT", KUBELET_FIREWALL, ""),
)


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


def bare(text: str) -> str:
    """A comment word upstream writes unquoted (``ns/svc:port`` in SEP chains); quoted if it is not a plain word."""
    if text and all(c.isalnum() or c in "-./:_" for c in text):
        return text
    return quote(text)


@functools.lru_cache(maxsize=65_536)
def probability(n: int) -> str:
    """Upstream's ``%0.10f`` of 1/n, cached."""
    return f"{1.0 / n:0.10f}"


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
    #: localhost NodePorts served (``FamilyContext.localhost_nodeports``): KUBE-FIREWALL's rule and ``route_localnet``
    localhost_nodeports: bool = False

    @property
    def top_chains(self) -> Mapping[str, tuple[str, ...]]:
        """The shared chains a full sync declares and fills, per table (upstream's order)."""
        return LOCALHOST_TOP_CHAINS if self.localhost_nodeports else TOP_CHAINS

    @property
    def jump_rules(self) -> tuple[JumpRule, ...]:
        """The jumps from the built-in chains a full sync ensures."""
        return JUMP_RULES + KUBELET_JUMP_RULES if self.localhost_nodeports else JUMP_RULES


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
        localhost_nodeports=fc.localhost_nodeports,
    )


def nodeport_destinations(fc: FamilyContext) -> tuple[tuple[str, ...], ...]:
    """Arguments of each KUBE-SERVICES -> KUBE-NODEPORTS rule of one family, from the node context's NodePort
    addresses (``kproxy.nodeaddr``: ``--nodeport-addresses`` with loopback left out, localhost NodePorts decided
    apart). Every local address is ``addrtype LOCAL``, minus loopback unless localhost NodePorts are served (as
    upstream: ``! -d 127.0.0.0/8`` when ``localhostNodePorts`` is off, ``! -d ::1/128`` always); CIDRs are ``-d CIDR``
    with ``addrtype LOCAL`` (upstream resolves the node's addresses inside each CIDR once per sync; matching the CIDR
    together with dst-type LOCAL selects the same addresses and follows address changes without a resync);
    ``primary`` addresses, and 127.0.0.1 when a CIDR lets loopback in, are ``-d IP``."""
    if fc.nodeport_all_local:
        local = ("-m", "addrtype", "--dst-type", "LOCAL")
        return ((*local,) if fc.localhost_nodeports else (*local, "!", "-d", str(LOOPBACK[fc.family])),)
    dests: list[tuple[str, ...]] = [("-d", ip) for ip in fc.nodeport_ips]
    dests.extend(("-d", c, "-m", "addrtype", "--dst-type", "LOCAL") for c in fc.nodeport_cidrs)
    if fc.localhost_nodeports:
        dests.append(("-d", LOCALHOST))
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
        **({F_KUBELET_FIREWALL: ((LOCALNET_DROP,), ())} if ctx.localhost_nodeports else {}),
    }


#: upstream's CVE-2020-8558 mitigation (``syncProxyRules``, and kubelet's identical copy): with ``route_localnet=1``
#: a packet from elsewhere to 127.0.0.0/8 would be routed in; dropped unless it belongs to a DNATed connection
LOCALNET_DROP = (
    f"-A {KUBELET_FIREWALL} -m comment --comment {quote('block incoming localnet connections')} -d 127.0.0.0/8 "
    "! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
)
