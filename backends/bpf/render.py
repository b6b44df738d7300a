"""Pure rendering of the bpf mode: one ServicePort plus the family's context to a ``Fragment``: the frontends the
socket programs translate, and the nftables companion table's part for the traffic that does not start in a local
socket. Nothing here touches the kernel or remembers anything between calls: tests/unit/test_bpf_render.py asserts on
fragments. The layout and its reasons are in ``backends/bpf/__init__.py``; ``plan`` turns fragments into map writes,
``companion`` into nft commands.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from kproxy.model import IPFamily, ServicePort, ServicePortName, Verdict
from kproxy.toolkit.cidr import all_but_loopback, collapsed
from kproxy.toolkit.nft import nft_family

from . import maps
from .maps import F_AFFINITY, F_DROP, F_EXTERNAL, F_REJECT, PROTO_NUMBERS

#: the conntrack label the companion's service chains set for postrouting to masquerade (Cluster policy)
MASQ_LABEL = 127


@dataclass(frozen=True, slots=True)
class Context:
    """What a family's fragments depend on besides the ServicePort: the node's NodePort addresses (each gets a
    socket frontend per NodePort, so pods and host processes reach ``<node address>:<nodePort>`` without NAT)."""

    family: IPFamily
    nodeport_addresses: tuple[str, ...] = ()
    #: where the companion table accepts NodePorts of external packets (its ``nodeport-cidrs`` set, as in the
    #: nftables mode): every address but loopback, or ``--nodeport-addresses``' CIDRs and primary addresses
    nodeport_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Frontend:
    """One socket frontend: connects to ``address:port/proto`` go to ``backends`` (or are refused / left alone)."""

    address: str
    port: int
    proto: int
    flags: int
    affinity: int
    backends: tuple[tuple[str, int], ...]

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.address, self.port, self.proto)


@dataclass(frozen=True, slots=True)
class NftPart:
    """The companion table's share of one service: per-service chains (name -> rules) and map elements
    (map, key text, verdict text). Empty for a plain ClusterIP service with endpoints (sockets serve those)."""

    chains: tuple[tuple[str, tuple[str, ...]], ...] = ()
    elements: tuple[tuple[str, str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.chains and not self.elements


@dataclass(frozen=True, slots=True)
class Fragment:
    frontends: tuple[Frontend, ...]
    nft: NftPart = field(default_factory=NftPart)

    @property
    def entries(self) -> int:
        """Service-map entries this fragment needs (a master and one slot per backend, per frontend)."""
        return sum(1 + len(f.backends) for f in self.frontends)

    @property
    def backend_count(self) -> int:
        return len({b for f in self.frontends for b in f.backends})


def _flags(verdict: Verdict, affinity: int, external: bool) -> int:
    f = F_EXTERNAL if external else 0
    if verdict == Verdict.REJECT:
        f |= F_REJECT
    elif verdict == Verdict.DROP:
        f |= F_DROP
    elif affinity:
        f |= F_AFFINITY
    return f


def chain_id(name: ServicePortName) -> str:
    """A short, stable id for a service port's companion chains."""
    return hashlib.sha256(f"{name}/{name.protocol.value}".encode()).hexdigest()[:12]


_EMPTY_NFT = NftPart()


def render(sp: ServicePort, ctx: Context) -> Fragment:
    """The fragment of one service port (see the module docstring)."""
    proto = PROTO_NUMBERS[sp.protocol.value]
    ieps = sp.internal_endpoints
    internal = tuple([(e.ip, e.port) for e in ieps])
    aff = sp.affinity_timeout
    fronts = [
        Frontend(
            sp.cluster_ip, sp.port, proto, _flags(sp.internal_verdict, aff, False), aff if internal else 0, internal
        )
    ]
    if sp.external_ips or sp.load_balancer_ips or sp.node_port:
        # Local sockets (the node's pods and host processes) reaching an external address: upstream's short-circuit
        # for local traffic, the cluster endpoints whatever externalTrafficPolicy says.
        ceps = sp.cluster_endpoints
        cluster = internal if ceps is ieps else tuple([(e.ip, e.port) for e in ceps])
        ext_verdict = Verdict.FORWARD if cluster else (Verdict.DROP if sp.has_any_endpoints else Verdict.REJECT)
        ext_flags = _flags(ext_verdict, aff, True)
        ext_aff = aff if cluster else 0
        seen = {fronts[0].key}
        addrs = [(a, sp.port) for a in (*sp.external_ips, *sp.load_balancer_ips)]
        if sp.node_port:
            addrs += [(a, sp.node_port) for a in ctx.nodeport_addresses]
        for a, p in addrs:
            f = Frontend(a, p, proto, ext_flags, ext_aff, cluster)
            if f.key not in seen:
                seen.add(f.key)
                fronts.append(f)
    elif internal:  # a plain ClusterIP with endpoints: nothing for the companion table (the bulk at scale)
        return Fragment(tuple(fronts), _EMPTY_NFT)
    return Fragment(tuple(fronts), render_nft(sp, ctx))


def _dnat(family: IPFamily, proto: str, backends: tuple[tuple[str, int], ...]) -> str:
    """A DNAT to one of ``backends`` (nft needs the protocol matched before a port mapping)."""
    ip = nft_family(family)
    if len(backends) == 1:
        a, p = backends[0]
        return f"meta l4proto {proto} dnat {ip} to {_hostport(a, p)}"
    items = ", ".join(f"{i} : {a} . {p}" for i, (a, p) in enumerate(backends))
    return f"meta l4proto {proto} dnat {ip} to numgen random mod {len(backends)} map {{ {items} }}"


def _chain_name(kind: str, cid: str, rules: tuple[str, ...]) -> str:
    """Companion chains are immutable: their name carries a digest of their rules, so a changed service gets a new
    chain (its elements switch to it in the same transaction) and adoption compares names only."""
    return f"{kind}-{cid}-" + hashlib.sha256("\n".join(rules).encode()).hexdigest()[:8]


def render_nft(sp: ServicePort, ctx: Context) -> NftPart:
    """The companion table's part: what packets arriving at the node (or from sockets outside the cgroup) need.
    ClusterIPs appear only when their verdict is reject or drop; externalIPs, load-balancer IPs and NodePorts always
    (with the external endpoints, masqueraded under Cluster policy, as upstream)."""
    fam = sp.family
    proto = sp.protocol.lowercase
    cid = chain_id(sp.name)
    chains: list[tuple[str, tuple[str, ...]]] = []
    elements: list[tuple[str, str, str]] = []
    if sp.internal_verdict != Verdict.FORWARD:
        v = "goto kp-reject" if sp.internal_verdict == Verdict.REJECT else "drop"
        elements.append(("svc", f"{sp.cluster_ip} . {proto} . {sp.port}", v))
    if not sp.has_external_addresses:
        return NftPart((), tuple(elements))
    if sp.external_verdict == Verdict.FORWARD:
        rules: tuple[str, ...] = ((f"ct label set {MASQ_LABEL}",) if not sp.external_policy_local else ()) + (
            _dnat(fam, proto, tuple((e.ip, e.port) for e in sp.external_endpoints)),
        )
        s_chain = _chain_name("s", cid, rules)
        chains.append((s_chain, rules))
        verdict = f"goto {s_chain}"
    else:
        verdict = "goto kp-reject" if sp.external_verdict == Verdict.REJECT else "drop"
    for a in sp.external_ips:
        elements.append(("svc", f"{a} . {proto} . {sp.port}", verdict))
    if sp.load_balancer_ips:
        lb_verdict = verdict
        if sp.load_balancer_source_ranges and sp.external_verdict == Verdict.FORWARD:
            ranges = ", ".join(sp.load_balancer_source_ranges)
            fw = (f"{nft_family(fam)} saddr {{ {ranges} }} {verdict}", "drop")
            f_chain = _chain_name("f", cid, fw)
            chains.append((f_chain, fw))
            lb_verdict = f"goto {f_chain}"
        for a in sp.load_balancer_ips:
            elements.append(("svc", f"{a} . {proto} . {sp.port}", lb_verdict))
    if sp.node_port:
        elements.append(("nodeports", f"{proto} . {sp.node_port}", verdict))
    return NftPart(tuple(chains), tuple(elements))


@functools.lru_cache(maxsize=64)
def nodeport_cidrs(
    family: IPFamily, all_local: bool, cidrs: tuple[str, ...] = (), ips: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The companion's ``nodeport-cidrs`` set elements (with ``fib daddr type local``: where external packets reach
    NodePorts): every address but loopback, or the ``--nodeport-addresses`` CIDRs and ``primary`` addresses,
    collapsed (an interval set refuses overlapping elements), single addresses without a prefix length. Cached: the
    same node context gives the same set on every sync."""
    if all_local:
        return collapsed([str(n) for n in all_but_loopback(family)], family)
    return collapsed((*cidrs, *ips), family)


def decoded(fragment: Fragment) -> dict[tuple[str, int, int], tuple[int, int, tuple[tuple[str, int], ...]]]:
    """frontend key -> (flags, affinity, backends in sorted order), as ``verify`` compares ``View`` values (whose
    backends are in slot order: slots keep surviving backends in place, so the kernel's order is not the fragment's),
    without the reverse-NAT id."""
    return {f.key: (f.flags, f.affinity, tuple(sorted(f.backends))) for f in fragment.frontends}


def summary(fragment: Fragment) -> dict[str, object]:
    """The backend's own ``describe()`` detail of one service (and ``kproxy show``'s lines)."""
    return {
        "frontends": [
            {
                "frontend": _hostport(f.address, f.port) + "/" + maps.PROTO_NAMES.get(f.proto, str(f.proto)),
                "verdict": "reject" if f.flags & F_REJECT else "drop" if f.flags & F_DROP else "forward",
                "affinitySeconds": f.affinity,
                "backends": [_hostport(a, p) for a, p in f.backends],
            }
            for f in fragment.frontends
        ],
        "nft": [f"{m} {k} : {v}" for m, k, v in fragment.nft.elements] + [c for c, _ in fragment.nft.chains],
    }


def _hostport(a: str, p: int) -> str:
    return f"[{a}]:{p}" if ":" in a else f"{a}:{p}"
