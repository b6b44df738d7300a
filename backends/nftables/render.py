"""Pure rendering of kproxy's nftables layout: ServicePorts in, map elements and ``nft -f`` transaction text out.

Nothing here touches the kernel, so unit tests assert on exact elements and commands and the benchmark times
Python's share apart from the kernel's. The layout and the reasons for it are in ``backends/nftables/__init__.py``.

Shape of the output: every service port renders into one ``Fragment``: its elements in the shared maps (keyed by
address . protocol . port, or protocol . port for NodePorts, entries carrying the service's comment), the names of the
shared count-indexed chains it jumps to (``lb-i-3``), and, only for ClientIP affinity, chains and dynamic sets of its
own. ``Transaction`` turns fragment changes into one transaction: element deletes and adds, per-service chains
written or removed, shared chains created on first use. The fixed part of the table (base chains, maps, the
masquerade helper) is ``fixed_commands``; it does not depend on the node context, which lives in three small sets
(``local-cidrs``, ``local-ifaces``, ``nodeport-cidrs``) rendered by ``context_elements``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import Endpoint, IPFamily, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.cidr import all_but_loopback, any_contains, collapsed
from kproxy.toolkit.keys import service_key as service_key
from kproxy.toolkit.nft import nft_family as nft_family

TABLE = "kproxy"
#: bumped whenever the fixed part's shape changes: a table of another layout is replaced whole (see proxier)
LAYOUT = "kproxy-nftables-layout-1"
#: conntrack label bit that asks nat-postrouting to masquerade a connection (see __init__.py: no packet marks)
MASQ_LABEL = 127

# maps and sets (names shown by `nft list table`, readable like upstream's service-ips / service-nodeports)
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
BACKENDS = "backends"
SHORTCUT_BACKENDS = "shortcut-backends"
NODEPORT_BACKENDS = "nodeport-backends"
NODEPORT_SHORTCUT_BACKENDS = "nodeport-shortcut-backends"
FIREWALL = "firewall-allow"
HAIRPIN = "hairpin"
LOCAL_CIDRS = "local-cidrs"
LOCAL_IFACES = "local-ifaces"
NODEPORT_CIDRS = "nodeport-cidrs"

SLOT_BASES = (BACKENDS, SHORTCUT_BACKENDS, NODEPORT_BACKENDS, NODEPORT_SHORTCUT_BACKENDS)
PROTOCOLS = ("tcp", "udp", "sctp")


def slot_map(base: str, proto: str) -> str:
    """The slot map of one protocol: ``backends-tcp``. One per protocol because nft 1.0.6 cannot read back a typeof
    map whose data is ``ip daddr . th dport`` ("conflicting protocols specified: ip vs. th" on any later rule that
    uses it), and data typed ``tcp dport`` makes the DNAT rule match TCP only."""
    return f"{base}-{proto}"


#: maps whose elements belong to one service each (keyed so that two services never share a key)
SERVICE_MAPS = (
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    *(slot_map(b, p) for b in SLOT_BASES for p in PROTOCOLS),
    FIREWALL,
)
CONTEXT_SETS = (LOCAL_CIDRS, LOCAL_IFACES, NODEPORT_CIDRS)

# fixed chains
REJECT_CHAIN = "reject-chain"
MASQ_INTERNAL = "masq-internal"
SERVICES = "services"
BASE_CHAINS = ("nat-prerouting", "nat-output", "nat-postrouting")
FIXED_CHAINS = (REJECT_CHAIN, MASQ_INTERNAL, SERVICES, *BASE_CHAINS)

_FAM = {IPFamily.V4: "ip", IPFamily.V6: "ip6"}
_ADDR = {IPFamily.V4: "ipv4_addr", IPFamily.V6: "ipv6_addr"}


# ----------------------------------------------------------------------------------------------- names


_B32 = "abcdefghijklmnopqrstuvwxyz234567"


def short_hash(text: str, n: int = 10) -> str:
    """``n`` base32 characters of sha256(text) (lowercase: nft prints names as given)."""
    v = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    out = []
    for _ in range(n):
        out.append(_B32[v & 31])
        v >>= 5
    return "".join(out)


_SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:-")
_COMMENT_KEYS: dict[str, str] = {}


def comment_key(key: str) -> str:
    """A service key short and safe enough for an nft comment (128 bytes, quoted): Kubernetes names are DNS labels,
    so a key is safe as it is; an overlong one (a 63-character namespace and name and a port name) is cut and keeps
    a hash of the whole. Memoised: called for every element written."""
    out = _COMMENT_KEYS.get(key)
    if out is None:
        if len(key) <= 110 and _SAFE_CHARS.issuperset(key):
            out = key
        else:
            clean = "".join(c if c in _SAFE_CHARS else "_" for c in key)
            out = clean[:96] + "~" + short_hash(key, 12)
        if len(_COMMENT_KEYS) > 200_000:  # bounded: services churn over a long life
            _COMMENT_KEYS.clear()
        _COMMENT_KEYS[key] = out
    return out


def service_chain_id(spn: ServicePortName) -> str:
    """The per-service part of affinity chain and set names."""
    return short_hash(service_key(spn), 12)


# ----------------------------------------------------------------------------------------------- context


def context_elements(ctx: FamilyContext) -> dict[str, tuple[str, ...]]:
    """The elements of the three context sets: pod traffic by source CIDR or by interface, NodePort addresses."""
    cidrs: tuple[str, ...] = ()
    ifaces: tuple[str, ...] = ()
    if ctx.local.kind == "cidr":
        cidrs = collapsed(ctx.local.values, ctx.family)
    elif ctx.local.kind == "bridge":
        ifaces = tuple(f'"{_ifname(v)}"' for v in ctx.local.values)
    elif ctx.local.kind == "prefix":
        ifaces = tuple(f'"{_ifname(v)}*"' for v in ctx.local.values)
    return {LOCAL_CIDRS: cidrs, LOCAL_IFACES: ifaces, NODEPORT_CIDRS: nodeport_cidrs(ctx)}


def nodeport_cidrs(ctx: FamilyContext) -> tuple[str, ...]:
    """Where NodePorts answer (with ``fib daddr type local``): every address but loopback, or the given CIDRs and
    ``primary`` addresses."""
    if ctx.nodeport_all_local:
        return tuple(str(n) for n in all_but_loopback(ctx.family))
    # collapsed: the interval set refuses overlapping elements (a CIDR inside another, a primary address in a CIDR)
    return collapsed((*ctx.nodeport_cidrs, *ctx.nodeport_ips), ctx.family)


_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def _ifname(name: str) -> str:
    if not _IFNAME.match(name):
        raise ValueError(f"interface name {name!r} is not one nft can match safely")
    return name


# ----------------------------------------------------------------------------------------------- fixed part


def set_declarations(family: IPFamily) -> list[tuple[str, str, str]]:
    """(kind, name, spec) of every map and set of the fixed part."""
    fam = _FAM[family]
    addr = _ADDR[family]
    slot = f"typeof {fam} daddr . meta l4proto . th dport . numgen random mod 2 : {fam} daddr . {{}} dport;"
    np_slot = f"typeof meta l4proto . th dport . numgen random mod 2 : {fam} daddr . {{}} dport;"
    slots = [
        ("map", slot_map(base, p), (np_slot if base.startswith("nodeport") else slot).format(p))
        for base in SLOT_BASES
        for p in PROTOCOLS
    ]
    return [
        ("set", LOCAL_CIDRS, f"type {addr}; flags interval;"),
        ("set", LOCAL_IFACES, "type ifname; flags interval;"),
        ("set", NODEPORT_CIDRS, f"type {addr}; flags interval;"),
        # counters on the entries: new connections per service address (nat chains see only a connection's first
        # packet), shown by `nft list map` and kernel_view; a rewritten entry starts from zero
        ("map", SERVICE_IPS, f"type {addr} . inet_proto . inet_service : verdict; counter;"),
        ("map", SERVICE_NODEPORTS, "type inet_proto . inet_service : verdict; counter;"),
        *slots,
        ("set", FIREWALL, f"type {addr} . inet_proto . inet_service . {addr}; flags interval;"),
        ("set", HAIRPIN, f"type {addr} . {addr};"),
    ]


def fixed_chain_rules(family: IPFamily) -> dict[str, tuple[str, ...]]:
    """The rules of the fixed chains, exactly as ``nft list chain`` prints them (adoption compares them)."""
    fam = _FAM[family]
    return {
        REJECT_CHAIN: ("reject",),
        MASQ_INTERNAL: (
            f"{fam} saddr @{LOCAL_CIDRS} return",
            f"iifname @{LOCAL_IFACES} return",
            f"ct label set {MASQ_LABEL}",
        ),
        SERVICES: (
            f"{fam} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}",
            f"{fam} daddr @{NODEPORT_CIDRS} fib daddr type local meta l4proto . th dport vmap @{SERVICE_NODEPORTS}",
        ),
        "nat-prerouting": (f"jump {SERVICES}",),
        "nat-output": (f"jump {SERVICES}",),
        "nat-postrouting": (
            f"ct label {MASQ_LABEL} masquerade fully-random",
            f"ct status dnat {fam} saddr . {fam} daddr @{HAIRPIN} masquerade fully-random",
        ),
    }


BASE_SPECS = {
    "nat-prerouting": "type nat hook prerouting priority dstnat; policy accept;",
    "nat-output": "type nat hook output priority -100; policy accept;",
    "nat-postrouting": "type nat hook postrouting priority srcnat; policy accept;",
}


def layout_chain(family: IPFamily) -> str:
    """An empty chain whose name carries a digest of the fixed part: adoption reads chain names only (cheap), and a
    table of another layout (an older kproxy) is replaced whole instead of patched."""
    text = repr((LAYOUT, set_declarations(family), fixed_chain_rules(family), BASE_SPECS))
    return "layout-" + short_hash(text, 10)


def rule_tag(rule: str) -> str:
    """The comment kproxy writes on a rule: a digest of its text. Adoption and ``verify`` read the comments back over
    netlink (no set elements fetched, unlike any ``nft list``), so a rule deleted, added or replaced by hand, or a
    flushed chain, is seen without parsing nft's printed rules."""
    return "k" + short_hash(rule, 10)


def _rule(fam: str, chain: str, rule: str) -> str:
    return f'add rule {fam} {TABLE} {chain} {rule} comment "{rule_tag(rule)}"'


def fixed_commands(family: IPFamily, *, chains: Iterable[str] | None = None, declare: bool = True) -> list[str]:
    """Commands that create the table, its maps and sets, and (re)write the fixed chains named in ``chains`` (None:
    all). ``add`` of an existing table, map or chain changes nothing, so this is safe on a loaded table."""
    fam = _FAM[family]
    out: list[str] = []
    if declare:
        out.append(f'add table {fam} {TABLE} {{ comment "{LAYOUT}"; }}')
        for kind, name, spec in set_declarations(family):
            out.append(f"add {kind} {fam} {TABLE} {name} {{ {spec} }}")
        out.append(f"add chain {fam} {TABLE} {layout_chain(family)}")
    rules = fixed_chain_rules(family)
    todo = FIXED_CHAINS if chains is None else tuple(c for c in FIXED_CHAINS if c in set(chains))
    for chain in FIXED_CHAINS:  # declared first: they jump to each other
        if chain in todo:
            base = BASE_SPECS.get(chain)
            out.append(f"add chain {fam} {TABLE} {chain}" + (f" {{ {base} }}" if base else ""))
    for chain in todo:
        out.append(f"flush chain {fam} {TABLE} {chain}")
        out.extend(_rule(fam, chain, r) for r in rules[chain])
    return out


# ----------------------------------------------------------------------------------------------- shared chains

# Shared chains, named by what they do and how many endpoints they pick from; their rules are a function of the name:
#   lb-{i|a|n}-K   DNAT a service address to one of K endpoints in @backends (i: masquerade unless the source is a
#                  local pod; a: always; n: never)
#   sc-K           the same from @shortcut-backends (eTP=Local addresses: the cluster endpoints for pods and the node)
#   np-{a|n}-K     a NodePort to one of K endpoints in @nodeport-backends; npsc-K from @nodeport-shortcut-backends
#   lbl-K-J        an eTP=Local address: local pods go to sc-J, the node to sc-J masqueraded, the rest to lb-n-K
#                  (K = 0: dropped); npl-K-J the same for a NodePort
#   fw-<chain>     admits sources listed in @firewall-allow for the address to <chain>, drops the rest
_SHARED = re.compile(r"^(lb-[ian]-\d+|sc-\d+|np-[an]-\d+|npsc-\d+|lbl-\d+-\d+|npl-\d+-\d+)$")


_IS_SHARED: dict[str, bool] = {}


def is_shared_chain(name: str) -> bool:
    got = _IS_SHARED.get(name)
    if got is None:
        got = bool(_SHARED.match(name)) or (name.startswith("fw-") and is_shared_chain(name[3:]))
        if len(_IS_SHARED) > 10_000:
            _IS_SHARED.clear()
        _IS_SHARED[name] = got
    return got


def is_service_chain(name: str) -> bool:
    """Per-service chains (ClientIP affinity, and the firewall in front of them)."""
    return name.startswith(("svc-", "ext-", "pick-", "ep-", "fw-svc-", "fw-ext-"))


def _masq_rule(m: str) -> tuple[str, ...]:
    if m == "i":
        return (f"jump {MASQ_INTERNAL}",)
    if m == "a":
        return (f"ct label set {MASQ_LABEL}",)
    return ()


def _shortcut_rules(fam: str, target: str) -> tuple[str, ...]:
    return (
        f"{fam} saddr @{LOCAL_CIDRS} goto {target}",
        f"iifname @{LOCAL_IFACES} goto {target}",
        f"fib saddr type local ct label set {MASQ_LABEL} goto {target}",
    )


def shared_chain_rules(name: str, family: IPFamily) -> tuple[str, ...]:
    """The rules of a shared chain, from its name (see above); ValueError for a name that is not one."""
    fam = _FAM[family]
    parts = name.split("-")
    if name.startswith("fw-"):
        inner = name[3:]
        if not is_shared_chain(inner) and not is_service_chain(inner):
            raise ValueError(f"not a kproxy firewall chain: {name}")
        return (f"{fam} daddr . meta l4proto . th dport . {fam} saddr @{FIREWALL} goto {inner}", "drop")
    if not _SHARED.match(name):
        raise ValueError(f"not a kproxy shared chain: {name}")
    addr_key = f"{fam} daddr . meta l4proto . th dport"
    port_key = "meta l4proto . th dport"

    def dnat(key: str, k: int, base: str) -> tuple[str, ...]:
        return tuple(
            f"meta l4proto {p} dnat {fam} to {key} . numgen random mod {k} map @{slot_map(base, p)}" for p in PROTOCOLS
        )

    if parts[0] == "lb":
        return (*_masq_rule(parts[1]), *dnat(addr_key, int(parts[2]), BACKENDS))
    if parts[0] == "sc":
        return dnat(addr_key, int(parts[1]), SHORTCUT_BACKENDS)
    if parts[0] == "np":
        return (*_masq_rule(parts[1]), *dnat(port_key, int(parts[2]), NODEPORT_BACKENDS))
    if parts[0] == "npsc":
        return dnat(port_key, int(parts[1]), NODEPORT_SHORTCUT_BACKENDS)
    k, j = int(parts[1]), int(parts[2])
    if parts[0] == "lbl":
        tail = f"goto lb-n-{k}" if k else "drop"
        return (*_shortcut_rules(fam, f"sc-{j}"), tail)
    tail = f"goto np-n-{k}" if k else "drop"
    return (*_shortcut_rules(fam, f"npsc-{j}"), tail)


def shared_chain_needs(name: str) -> tuple[str, ...]:
    """The shared chains a shared chain jumps to (they must exist first)."""
    if name.startswith("fw-"):
        inner = name[3:]
        return (*shared_chain_needs(inner), inner) if is_shared_chain(inner) else ()
    parts = name.split("-")
    if parts[0] in ("lbl", "npl"):
        k, j = int(parts[1]), int(parts[2])
        sc = f"sc-{j}" if parts[0] == "lbl" else f"npsc-{j}"
        base = (f"lb-n-{k}",) if parts[0] == "lbl" else (f"np-n-{k}",)
        return (sc, *(base if k else ()))
    return ()


# ----------------------------------------------------------------------------------------------- fragments

Element = tuple[str, str, str]  # (map or set, key, value; "" for a set)


@dataclass(frozen=True, slots=True)
class Fragment:
    """One service port's share of the table in one family (compared with ==; ``digest`` is written into the
    comments of its ``service-ips`` / ``service-nodeports`` elements, so adoption compares services by reading
    those two small maps only).

    ``elements``: its elements in the shared maps; ``shared``: the shared chains it jumps to; ``chains``/``sets``:
    chains and dynamic sets of its own (ClientIP affinity only); ``hairpin``: ``ep . ep`` elements of its local
    endpoints (shared by every service, never removed by a partial sync: a DNATed packet whose source is its
    destination always needs masquerading, whichever service it came through).
    """

    key: str
    elements: tuple[Element, ...]
    shared: tuple[str, ...] = ()
    chains: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sets: tuple[tuple[str, str], ...] = ()
    hairpin: tuple[str, ...] = ()
    digest: str = ""

    @property
    def comment(self) -> str:
        return comment_key(self.key)

    @property
    def digest_comment(self) -> str:
        return f"{comment_key(self.key)} #{self.digest}"

    @property
    def entries(self) -> tuple[Element, ...]:
        """Its ``service-ips`` and ``service-nodeports`` elements (the user-visible keys)."""
        return tuple(e for e in self.elements if e[0] in (SERVICE_IPS, SERVICE_NODEPORTS))


def _digest(elements: Sequence[Element], rest: Sequence[object]) -> str:
    """A stable digest (across processes: not ``hash()``) of a fragment's content, 50 bits in base32."""
    text = "\n".join(["|".join(e) for e in elements])
    if any(rest):
        text += repr(rest)
    n = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return "".join([_B32[(n >> (5 * i)) & 31] for i in range(10)])


def _ep(ep: Endpoint) -> str:
    return f"{ep.ip} . {ep.port}"


def _local(ep: Endpoint) -> bool:
    # a hairpin is a local pod reaching itself; an endpoint whose node is unknown might be one
    return ep.is_local or ep.node_name is None


def render_service(sp: ServicePort, ctx: FamilyContext) -> Fragment:
    """One service port's fragment (see ``Fragment``), with upstream's semantics: ClusterIP traffic to the internal
    endpoints (masquerading off-cluster sources), external traffic (NodePorts, externalIPs, load-balancer IPs) to the
    external endpoints (masqueraded under Cluster policy; under Local policy, local pods and the node itself
    short-circuit to the cluster endpoints), reject without endpoints, drop under Local policy without local ones,
    loadBalancerSourceRanges as a firewall, ClientIP affinity in chains of the service's own."""
    if not sp.affinity_timeout and not sp.has_external_addresses:
        return _render_cluster_ip_only(sp, ctx)
    return _render_general(sp, ctx)


def _render_general(sp: ServicePort, ctx: FamilyContext) -> Fragment:
    spn = sp.name
    proto = spn.protocol.lowercase
    port = sp.port
    fam = _FAM[sp.family]
    cluster_eps = sp.cluster_endpoints
    local_eps = sp.local_endpoints
    has_endpoints = sp.has_any_endpoints or bool(cluster_eps or local_eps)
    internal_eps = sp.internal_endpoints
    ext_local = sp.external_policy_local
    external_eps = local_eps if ext_local else cluster_eps
    masq_internal = "a" if ctx.masquerade_all else ("n" if not ctx.local.implemented else "i")
    elements: list[Element] = []
    shared: list[str] = []
    chains: list[tuple[str, tuple[str, ...]]] = []
    sets: list[tuple[str, str]] = []
    hairpin: list[str] = []
    affinity = sp.affinity_timeout > 0

    def fill(mapname: str, prefix: str, eps: Sequence[Endpoint]) -> None:
        for i, ep in enumerate(eps):
            elements.append((mapname, f"{prefix} . {i}", _ep(ep)))

    for eps in (internal_eps, external_eps if sp.has_external_addresses else ()):
        for ep in eps:
            if _local(ep):
                h = f"{ep.ip} . {ep.ip}"
                if h not in hairpin:
                    hairpin.append(h)

    # --- ClientIP affinity: chains of the service's own (upstream's per-endpoint sets, refreshed on every use)
    aff_ids: dict[str, str] = {}
    sid = service_chain_id(spn) if affinity else ""
    if affinity and has_endpoints:
        timeout = sp.affinity_timeout
        needed: list[Endpoint] = []
        for ep in (*internal_eps, *(cluster_eps if sp.has_external_addresses else ()), *external_eps):
            if str(ep) not in aff_ids:
                aff_ids[str(ep)] = short_hash(str(ep), 8)
                needed.append(ep)
        for ep in needed:
            e = aff_ids[str(ep)]
            setname = f"aff-{sid}-{e}-{timeout}"  # a new timeout is a new set (the chain using it is rewritten)
            sets.append((setname, f"type {_ADDR[sp.family]}; flags dynamic,timeout; timeout {timeout}s;"))
            target = f"{ep.ip}:{ep.port}" if sp.family == IPFamily.V4 else f"[{ep.ip}]:{ep.port}"
            chains.append(
                (
                    f"ep-{sid}-{e}-{timeout}",
                    (f"update @{setname} {{ {fam} saddr }}", f"meta l4proto {proto} dnat {fam} to {target}"),
                )
            )

        def pick(which: str, eps: Sequence[Endpoint]) -> str:
            name = f"pick-{sid}-{which}"
            if any(c[0] == name for c in chains):
                return name
            t = sp.affinity_timeout
            rules = [
                f"{fam} saddr @aff-{sid}-{aff_ids[str(ep)]}-{t} goto ep-{sid}-{aff_ids[str(ep)]}-{t}" for ep in eps
            ]
            vm = ", ".join(f"{i} : goto ep-{sid}-{aff_ids[str(ep)]}-{t}" for i, ep in enumerate(eps))
            rules.append(f"numgen random mod {len(eps)} vmap {{ {vm} }}")
            chains.append((name, tuple(rules)))
            return name

    def service_target(
        eps: Sequence[Endpoint], masq: str, *, nodeport: bool, local_policy: bool, verdict_empty: str
    ) -> str:
        """The verdict of one address class: a goto into the chain that picks an endpoint (or reject/drop)."""
        if not has_endpoints:
            return f"goto {REJECT_CHAIN}"
        if affinity:
            if not local_policy:
                if not eps:
                    return verdict_empty
                name = f"svc-{sid}-{masq}"
                if not any(c[0] == name for c in chains):
                    chains.append((name, (*_masq_rule(masq), f"goto {pick('c' if eps is cluster_eps else 'l', eps)}")))
                return f"goto {name}"
            name = f"ext-{sid}"
            if not any(c[0] == name for c in chains):
                rules = list(_shortcut_rules(fam, pick("c", cluster_eps))) if cluster_eps else []
                rules.append(f"goto {pick('l', local_eps)}" if local_eps else "drop")
                chains.append((name, tuple(rules)))
            return f"goto {name}"
        if local_policy:
            k, j = len(local_eps), len(cluster_eps)
            if not j:
                return verdict_empty if not k else f"goto {'npl' if nodeport else 'lbl'}-{k}-{j}"
            name = f"{'npl' if nodeport else 'lbl'}-{k}-{j}"
        else:
            if not eps:
                return verdict_empty
            name = f"{'np' if nodeport else 'lb'}-{masq}-{len(eps)}"
        for need in (*shared_chain_needs(name), name):
            if need not in shared:
                shared.append(need)
        return f"goto {name}"

    # ClusterIP
    cip_key = f"{sp.cluster_ip} . {proto} . {port}"
    cip_target = service_target(
        internal_eps,
        masq_internal,
        nodeport=False,
        local_policy=False,
        verdict_empty="drop",
    )
    elements.append((SERVICE_IPS, cip_key, cip_target))
    if cip_target.startswith("goto lb-"):
        fill(slot_map(BACKENDS, proto), cip_key, internal_eps)

    # external addresses: externalIPs, load-balancer IPs (behind the firewall when source ranges are set)
    ext_local_policy = ext_local and sp.has_external_addresses
    uses_fw = has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
    allow_lb_sources = uses_fw and any_contains(sp.load_balancer_source_ranges, ctx.node_ips)
    firewall_sources = (
        collapsed((*sp.load_balancer_source_ranges, *(sp.load_balancer_ips if allow_lb_sources else ())), sp.family)
        if uses_fw
        else ()
    )
    for addr, is_lb in [(a, False) for a in sp.external_ips] + [(a, True) for a in sp.load_balancer_ips]:
        key = f"{addr} . {proto} . {port}"
        target = service_target(external_eps, "a", nodeport=False, local_policy=ext_local_policy, verdict_empty="drop")
        if is_lb and uses_fw and target.startswith("goto "):
            inner = target[5:]
            fw = f"fw-{inner}"
            if is_service_chain(inner):
                if not any(c[0] == fw for c in chains):
                    chains.append((fw, shared_chain_rules(fw, sp.family)))
            elif fw not in shared:
                shared.append(fw)
            target = f"goto {fw}"
            for cidr in firewall_sources:
                elements.append((FIREWALL, f"{key} . {cidr}", ""))
        elements.append((SERVICE_IPS, key, target))
        _fill_external(elements, key, target, sp, slot_map(BACKENDS, proto), slot_map(SHORTCUT_BACKENDS, proto))

    # NodePort
    if sp.node_port:
        key = f"{proto} . {sp.node_port}"
        target = service_target(external_eps, "a", nodeport=True, local_policy=ext_local_policy, verdict_empty="drop")
        elements.append((SERVICE_NODEPORTS, key, target))
        _fill_external(
            elements,
            key,
            target,
            sp,
            slot_map(NODEPORT_BACKENDS, proto),
            slot_map(NODEPORT_SHORTCUT_BACKENDS, proto),
        )

    # dict order kept: elements are written in this order
    elements_t = tuple(dict.fromkeys(elements))
    parts = (tuple(shared), tuple(chains), tuple(sets), tuple(hairpin))
    return Fragment(
        key=service_key(spn),
        elements=elements_t,
        shared=tuple(shared),
        chains=tuple(chains),
        sets=tuple(sets),
        hairpin=tuple(hairpin),
        digest=_digest(elements_t, parts),
    )


def _render_cluster_ip_only(sp: ServicePort, ctx: FamilyContext) -> Fragment:
    """``render_service`` for the common case (a ClusterIP only, no affinity), without the general path's closures:
    the same fragment, a third of the time (10,000 services render in ~0.3 s)."""
    proto = sp.name.protocol.lowercase
    key = f"{sp.cluster_ip} . {proto} . {sp.port}"
    eps = sp.internal_endpoints
    shared: tuple[str, ...] = ()
    hairpin: tuple[str, ...] = ()
    if eps:
        masq = "a" if ctx.masquerade_all else ("n" if not ctx.local.implemented else "i")
        chain = f"lb-{masq}-{len(eps)}"
        slots = _SLOT_NAMES[proto]
        elements = [(SERVICE_IPS, key, "goto " + chain)]
        elements += [(slots, f"{key} . {i}", f"{ep.ip} . {ep.port}") for i, ep in enumerate(eps)]
        shared = (chain,)
        local = [f"{ep.ip} . {ep.ip}" for ep in eps if ep.is_local or ep.node_name is None]
        if local:
            hairpin = tuple(dict.fromkeys(local))
    elif sp.has_any_endpoints or sp.cluster_endpoints or sp.local_endpoints:
        elements = [(SERVICE_IPS, key, "drop")]
    else:
        elements = [(SERVICE_IPS, key, f"goto {REJECT_CHAIN}")]
    elements_t = tuple(elements)
    return Fragment(
        key=service_key(sp.name),
        elements=elements_t,
        shared=shared,
        hairpin=hairpin,
        digest=_digest(elements_t, (shared, (), (), hairpin)),
    )


_SLOT_NAMES = {p: slot_map(BACKENDS, p) for p in PROTOCOLS}


def _fill_external(
    elements: list[Element], key: str, target: str, sp: ServicePort, primary: str, shortcut: str
) -> None:
    """Backend slots behind an external address or a NodePort, from the shared chain its verdict names."""
    inner = target[5:] if target.startswith("goto ") else ""
    if inner.startswith("fw-"):
        inner = inner[3:]
    parts = inner.split("-")
    if parts[0] in ("lb", "np"):
        eps = sp.cluster_endpoints
        for i, ep in enumerate(eps):
            elements.append((primary, f"{key} . {i}", _ep(ep)))
    elif parts[0] in ("lbl", "npl"):
        for i, ep in enumerate(sp.local_endpoints):
            elements.append((primary, f"{key} . {i}", _ep(ep)))
        for i, ep in enumerate(sp.cluster_endpoints):
            elements.append((shortcut, f"{key} . {i}", _ep(ep)))


# ----------------------------------------------------------------------------------------------- transactions


@dataclass(slots=True)
class Transaction:
    """One atomic ``nft`` transaction for one family, built in order: declarations, chain contents, element
    deletes, element adds, removals. Elements are grouped into one ``add element`` / ``delete element`` command per
    map with one element per line (thousands of small commands cost libnftables far more than one long one), and
    every line that belongs to one service is recorded as its, so a refused element (libnftables names its line)
    names the service to leave out."""

    family: IPFamily
    head: list[str] = field(default_factory=list)  # table, maps, fixed chains, context sets
    declare: list[tuple[str, ServicePortName | None]] = field(default_factory=list)  # chains and sets to create
    fill: list[tuple[str, ServicePortName | None]] = field(default_factory=list)  # chain rules
    deletes: dict[str, list[tuple[str, ServicePortName | None]]] = field(default_factory=dict)  # map -> keys
    adds: dict[str, list[tuple[str, ServicePortName | None]]] = field(default_factory=dict)  # map -> elements
    tail: list[tuple[str, ServicePortName | None]] = field(default_factory=list)  # chain and set removals
    elements_added: int = 0
    elements_deleted: int = 0

    @property
    def fam(self) -> str:
        return _FAM[self.family]

    def _grouped(
        self, verb: str, groups: dict[str, list[tuple[str, ServicePortName | None]]]
    ) -> list[tuple[str, ServicePortName | None]]:
        out: list[tuple[str, ServicePortName | None]] = []
        for m, items in groups.items():
            if not items:
                continue
            out.append((f"{verb} element {self.fam} {TABLE} {m} {{", None))
            last = len(items) - 1
            out.extend((text if i == last else text + ",", owner) for i, (text, owner) in enumerate(items))
            out.append(("}", None))
        return out

    def lines(self) -> list[tuple[str, ServicePortName | None]]:
        return (
            [(h, None) for h in self.head]
            + self.declare
            + self.fill
            + self._grouped("delete", self.deletes)
            + self._grouped("add", self.adds)
            + self.tail
        )

    def text(self) -> str:
        return "".join(line + "\n" for line, _ in self.lines())

    def owner_of(self, lineno: int) -> ServicePortName | None:
        """The service owning 1-based line ``lineno`` of ``text()``."""
        lines = self.lines()
        return lines[lineno - 1][1] if 0 < lineno <= len(lines) else None

    def empty(self) -> bool:
        return not (self.head or self.declare or self.fill or self.deletes or self.adds or self.tail)

    # -- building blocks

    def add_elements(self, elements: Iterable[Element], comment: str | None, owner: ServicePortName | None) -> None:
        c = f' comment "{comment}"' if comment else ""
        for m, k, v in elements:
            self.adds.setdefault(m, []).append((f"{k}{c} : {v}" if v else f"{k}{c}", owner))
            self.elements_added += 1

    def delete_keys(self, keys: Iterable[tuple[str, str]], owner: ServicePortName | None) -> None:
        for m, k in keys:
            self.deletes.setdefault(m, []).append((k, owner))
            self.elements_deleted += 1

    def add_shared_chain(self, name: str, *, exists: bool = False) -> None:
        """Declare and fill a shared chain; ``exists``: the kernel holds it with other rules (edited by hand), which
        are flushed first."""
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", None))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", None))
        self.fill.extend((_rule(fam, name, r), None) for r in shared_chain_rules(name, self.family))

    def delete_chain(self, name: str, owner: ServicePortName | None) -> None:
        fam = self.fam
        self.tail.append((f"delete chain {fam} {TABLE} {name}", owner))

    def write_chain(self, name: str, rules: Sequence[str], owner: ServicePortName | None, *, exists: bool) -> None:
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", owner))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", owner))
        self.fill.extend((_rule(fam, name, r), owner) for r in rules)

    def flush_chain(self, name: str, owner: ServicePortName | None) -> None:
        """Emptied before anything is deleted (a removed service's chains jump to each other)."""
        self.declare.append((f"flush chain {self.fam} {TABLE} {name}", owner))

    def add_set(self, name: str, spec: str, owner: ServicePortName | None) -> None:
        self.declare.insert(0, (f"add set {self.fam} {TABLE} {name} {{ {spec} }}", owner))

    def delete_set(self, name: str, owner: ServicePortName | None) -> None:
        self.tail.append((f"delete set {self.fam} {TABLE} {name}", owner))


def element_keys(frag: Fragment) -> dict[tuple[str, str], str]:
    """(map, key) -> value of a fragment's elements."""
    return {(m, k): v for m, k, v in frag.elements}


def change_service(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    *,
    old_keys: Mapping[tuple[str, str], str | None] | None = None,
    old_chains: Iterable[str] = (),
    old_sets: Iterable[str] = (),
) -> None:
    """Add to ``tx`` what turns ``old`` into ``new`` for one service (None: absent). ``old_keys`` (values None when
    unknown) / ``old_chains`` / ``old_sets`` stand for ``old`` when only the kernel's skeleton of it is known (adopted
    after a restart): every element whose value is unknown is deleted and written again."""
    if old is None and not old_keys and not old_chains and not old_sets:
        if new is not None:  # the common case of a full sync into an empty table: no diff to make
            kinds = (SERVICE_IPS, SERVICE_NODEPORTS)
            tx.add_elements((e for e in new.elements if e[0] not in kinds and e[0] != FIREWALL), None, spn)
            tx.add_elements((e for e in new.elements if e[0] == FIREWALL), new.comment, spn)
            tx.add_elements((e for e in new.elements if e[0] in kinds), new.digest_comment, spn)
            for name, spec in new.sets:
                tx.add_set(name, spec, spn)
            for name, rules in new.chains:
                tx.write_chain(name, rules, spn, exists=False)
        return
    before: Mapping[tuple[str, str], str | None] = element_keys(old) if old is not None else (old_keys or {})
    after = element_keys(new) if new is not None else {}
    digest_changed = old is None or new is None or old.digest != new.digest
    dels = []
    adds: list[Element] = []
    for mk, v in before.items():
        nv = after.get(mk)
        if nv is None or nv != v or (digest_changed and mk[0] in (SERVICE_IPS, SERVICE_NODEPORTS)):
            dels.append(mk)
    for mk, v in after.items():
        if mk not in before or before[mk] != v or (digest_changed and mk[0] in (SERVICE_IPS, SERVICE_NODEPORTS)):
            adds.append((mk[0], mk[1], v))
    if dels:
        tx.delete_keys(dels, spn)
    if new is not None and adds:
        entries = [e for e in adds if e[0] in (SERVICE_IPS, SERVICE_NODEPORTS)]
        others = [e for e in adds if e[0] not in (SERVICE_IPS, SERVICE_NODEPORTS)]
        if others:
            # slots carry no comment (their key starts with their entry's, which names the service): 6% of nft -f
            tx.add_elements((e for e in others if e[0] != FIREWALL), None, spn)
            tx.add_elements((e for e in others if e[0] == FIREWALL), new.comment, spn)
        if entries:
            tx.add_elements(entries, new.digest_comment, spn)

    # per-service chains and sets (ClientIP affinity)
    old_chain_rules = dict(old.chains) if old is not None else {c: None for c in old_chains}
    new_chain_rules = dict(new.chains) if new is not None else {}
    old_set_specs = dict(old.sets) if old is not None else {s: None for s in old_sets}
    new_set_specs = dict(new.sets) if new is not None else {}
    for name, spec in new_set_specs.items():
        if name not in old_set_specs:  # the timeout is part of the name: a set never changes in place
            tx.add_set(name, spec, spn)
    for name, rules in new_chain_rules.items():
        if old_chain_rules.get(name) != rules:
            tx.write_chain(name, rules, spn, exists=name in old_chain_rules)
    gone_chains = [c for c in old_chain_rules if c not in new_chain_rules]
    for name in gone_chains:
        tx.flush_chain(name, spn)
    for name in gone_chains:
        tx.delete_chain(name, spn)
    for name in old_set_specs:
        if name not in new_set_specs:
            tx.delete_set(name, spn)
