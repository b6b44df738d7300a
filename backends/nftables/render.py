"""Pure rendering of kproxy's nftables layout: ServicePorts in, map elements and ``nft -f`` transaction text out.

Nothing here touches the kernel, so unit tests assert on exact elements and commands and the benchmark times
Python's share apart from the kernel's. The layout and the reasons for it are in ``backends/nftables/__init__.py``.

Shape of the output: every service port renders into one ``Fragment`` (``fragment.py``: what the ledger keeps, its
elements packed in one text): its elements in the shared maps (keyed by address . protocol . port, or protocol . port
for NodePorts, entries carrying the service's comment), the names of the shared count-indexed chains it jumps to
(``lb-i-3``), and, only for ClientIP affinity, chains and dynamic sets of its own. ``Transaction`` and
``change_service`` (``transaction.py``, re-exported here) turn fragment changes into one transaction: element deletes
and adds, per-service chains written or removed, shared chains created on first use. The fixed part of the table (base
chains, maps, the masquerade helper) is ``layout.fixed_commands``; it does not depend on the node context, which lives
in three small sets (``local-cidrs``, ``local-ifaces``, ``nodeport-cidrs``) rendered by ``context_elements``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kproxy.model import Endpoint, IPFamily, ServicePort
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.cidr import any_contains, collapsed
from kproxy.toolkit.keys import service_key as service_key
from kproxy.toolkit.nft import nft_family as nft_family

from .fragment import Element, Fragment, canonical_shared, digest_of
from .layout import (
    ADDR,
    BACKENDS,
    FAM,
    FIREWALL,
    FIXED_CHAINS,
    LAYOUT,
    LOCAL_CIDRS,
    LOCAL_IFACES,
    MASQ_LABEL,
    NODEPORT_BACKENDS,
    NODEPORT_CIDRS,
    NODEPORT_SHORTCUT_BACKENDS,
    PROTOCOLS,
    REJECT_CHAIN,
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    SERVICES,
    SHORTCUT_BACKENDS,
    TABLE,
    comment_key,
    context_elements,
    fixed_chain_rules,
    fixed_commands,
    is_service_chain,
    layout_chain,
    masq_rule,
    service_chain_id,
    shared_chain_needs,
    shared_chain_rules,
    short_hash,
    shortcut_rules,
    slot_map,
)
from .localhost import listen_for
from .transaction import Transaction, change_service, element_keys

#: what other modules and the tests read from here: the fragments and transactions, and the layout's names they
#: spell
__all__ = [
    "FIXED_CHAINS",
    "LAYOUT",
    "LOCAL_CIDRS",
    "LOCAL_IFACES",
    "MASQ_LABEL",
    "NODEPORT_CIDRS",
    "SERVICES",
    "TABLE",
    "Element",
    "Fragment",
    "Transaction",
    "change_service",
    "comment_key",
    "context_elements",
    "element_keys",
    "fixed_chain_rules",
    "fixed_commands",
    "layout_chain",
    "nft_family",
    "render_service",
    "service_key",
]


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
    frag = _render_general(sp, ctx)
    listen = listen_for(sp, ctx)
    return frag if listen is None else replace(frag, localhost=listen)


def _render_general(sp: ServicePort, ctx: FamilyContext) -> Fragment:
    b = _General(sp, ctx)
    b.hairpins()
    if b.affinity and b.has_endpoints:
        b.affinity_endpoints()
    b.cluster_ip()
    b.external_addresses()
    b.node_port()
    return b.fragment()


class _General:
    """``render_service``'s general path (affinity, external addresses, NodePorts, traffic policies), one part per
    method, all appending to the fragment's lists in the order the elements are written."""

    def __init__(self, sp: ServicePort, ctx: FamilyContext) -> None:
        self.sp, self.ctx = sp, ctx
        self.proto = sp.name.protocol.lowercase
        self.fam = FAM[sp.family]
        self.cluster_eps = sp.cluster_endpoints
        self.local_eps = sp.local_endpoints
        self.has_endpoints = sp.has_any_endpoints or bool(self.cluster_eps or self.local_eps)
        self.internal_eps = sp.internal_endpoints
        self.external_eps = self.local_eps if sp.external_policy_local else self.cluster_eps
        self.masq_internal = "a" if ctx.masquerade_all else ("n" if not ctx.local.implemented else "i")
        self.affinity = sp.affinity_timeout > 0
        self.sid = service_chain_id(sp.name) if self.affinity else ""
        self.aff_ids: dict[str, str] = {}
        self.elements: list[Element] = []
        self.shared: list[str] = []
        self.chains: list[tuple[str, tuple[str, ...]]] = []
        self.sets: list[tuple[str, str]] = []
        self.hairpin: list[str] = []

    def _has_chain(self, name: str) -> bool:
        return any(c[0] == name for c in self.chains)

    def hairpins(self) -> None:
        sp = self.sp
        for eps in (self.internal_eps, self.external_eps if sp.has_external_addresses else ()):
            for ep in eps:
                if _local(ep):
                    h = f"{ep.ip} . {ep.ip}"
                    if h not in self.hairpin:
                        self.hairpin.append(h)

    def affinity_endpoints(self) -> None:
        """ClientIP affinity: chains of the service's own (upstream's per-endpoint sets, refreshed on every use)."""
        sp, sid = self.sp, self.sid
        timeout = sp.affinity_timeout
        needed: list[Endpoint] = []
        external = self.cluster_eps if sp.has_external_addresses else ()
        for ep in (*self.internal_eps, *external, *self.external_eps):
            if str(ep) not in self.aff_ids:
                self.aff_ids[str(ep)] = short_hash(str(ep), 8)
                needed.append(ep)
        for ep in needed:
            e = self.aff_ids[str(ep)]
            setname = f"aff-{sid}-{e}-{timeout}"  # a new timeout is a new set (the chain using it is rewritten)
            self.sets.append((setname, f"type {ADDR[sp.family]}; flags dynamic,timeout; timeout {timeout}s;"))
            target = f"{ep.ip}:{ep.port}" if sp.family == IPFamily.V4 else f"[{ep.ip}]:{ep.port}"
            update = f"update @{setname} {{ {self.fam} saddr }}"
            dnat = f"meta l4proto {self.proto} dnat {self.fam} to {target}"
            self.chains.append((f"ep-{sid}-{e}-{timeout}", (update, dnat)))

    def pick(self, which: str, eps: Sequence[Endpoint]) -> str:
        sid, t = self.sid, self.sp.affinity_timeout
        name = f"pick-{sid}-{which}"
        if self._has_chain(name):
            return name
        ids = [self.aff_ids[str(ep)] for ep in eps]
        rules = [f"{self.fam} saddr @aff-{sid}-{e}-{t} goto ep-{sid}-{e}-{t}" for e in ids]
        vm = ", ".join(f"{i} : goto ep-{sid}-{e}-{t}" for i, e in enumerate(ids))
        rules.append(f"numgen random mod {len(eps)} vmap {{ {vm} }}")
        self.chains.append((name, tuple(rules)))
        return name

    def _affinity_target(self, eps: Sequence[Endpoint], masq: str, local_policy: bool, verdict_empty: str) -> str:
        sid = self.sid
        if not local_policy:
            if not eps:
                return verdict_empty
            name = f"svc-{sid}-{masq}"
            if not self._has_chain(name):
                picked = self.pick("c" if eps is self.cluster_eps else "l", eps)
                self.chains.append((name, (*masq_rule(masq), f"goto {picked}")))
            return f"goto {name}"
        name = f"ext-{sid}"
        if not self._has_chain(name):
            rules = list(shortcut_rules(self.fam, self.pick("c", self.cluster_eps))) if self.cluster_eps else []
            rules.append(f"goto {self.pick('l', self.local_eps)}" if self.local_eps else "drop")
            self.chains.append((name, tuple(rules)))
        return f"goto {name}"

    def target(self, eps: Sequence[Endpoint], masq: str, *, nodeport: bool, local_policy: bool) -> str:
        """The verdict of one address class: a goto into the chain that picks an endpoint (or reject/drop)."""
        verdict_empty = "drop"
        if not self.has_endpoints:
            return f"goto {REJECT_CHAIN}"
        if self.affinity:
            return self._affinity_target(eps, masq, local_policy, verdict_empty)
        if local_policy:
            k, j = len(self.local_eps), len(self.cluster_eps)
            if not j:
                return verdict_empty if not k else f"goto {'npl' if nodeport else 'lbl'}-{k}-{j}"
            name = f"{'npl' if nodeport else 'lbl'}-{k}-{j}"
        else:
            if not eps:
                return verdict_empty
            name = f"{'np' if nodeport else 'lb'}-{masq}-{len(eps)}"
        for need in (*shared_chain_needs(name), name):
            if need not in self.shared:
                self.shared.append(need)
        return f"goto {name}"

    def cluster_ip(self) -> None:
        sp, proto = self.sp, self.proto
        key = f"{sp.cluster_ip} . {proto} . {sp.port}"
        target = self.target(self.internal_eps, self.masq_internal, nodeport=False, local_policy=False)
        self.elements.append((SERVICE_IPS, key, target))
        if target.startswith("goto lb-"):
            mapname = slot_map(BACKENDS, proto)
            self.elements.extend((mapname, f"{key} . {i}", _ep(ep)) for i, ep in enumerate(self.internal_eps))

    def external_addresses(self) -> None:
        """externalIPs, load-balancer IPs (behind the firewall when source ranges are set)."""
        sp, proto = self.sp, self.proto
        local_policy = sp.external_policy_local and sp.has_external_addresses
        uses_fw = self.has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
        allow_lb_sources = uses_fw and any_contains(sp.load_balancer_source_ranges, self.ctx.node_ips)
        sources = (*sp.load_balancer_source_ranges, *(sp.load_balancer_ips if allow_lb_sources else ()))
        firewall_sources = collapsed(sources, sp.family) if uses_fw else ()
        for addr, is_lb in [(a, False) for a in sp.external_ips] + [(a, True) for a in sp.load_balancer_ips]:
            key = f"{addr} . {proto} . {sp.port}"
            target = self.target(self.external_eps, "a", nodeport=False, local_policy=local_policy)
            if is_lb and uses_fw and target.startswith("goto "):
                target = self._firewalled(target[5:])
                for cidr in firewall_sources:
                    self.elements.append((FIREWALL, f"{key} . {cidr}", ""))
            self.elements.append((SERVICE_IPS, key, target))
            primary, shortcut = slot_map(BACKENDS, proto), slot_map(SHORTCUT_BACKENDS, proto)
            _fill_external(self.elements, key, target, sp, primary, shortcut)

    def _firewalled(self, inner: str) -> str:
        fw = f"fw-{inner}"
        if is_service_chain(inner):
            if not self._has_chain(fw):
                self.chains.append((fw, shared_chain_rules(fw, self.sp.family)))
        elif fw not in self.shared:
            self.shared.append(fw)
        return f"goto {fw}"

    def node_port(self) -> None:
        sp, proto = self.sp, self.proto
        if not sp.node_port:
            return
        key = f"{proto} . {sp.node_port}"
        local_policy = sp.external_policy_local and sp.has_external_addresses
        target = self.target(self.external_eps, "a", nodeport=True, local_policy=local_policy)
        self.elements.append((SERVICE_NODEPORTS, key, target))
        primary, shortcut = slot_map(NODEPORT_BACKENDS, proto), slot_map(NODEPORT_SHORTCUT_BACKENDS, proto)
        _fill_external(self.elements, key, target, sp, primary, shortcut)

    def fragment(self) -> Fragment:
        # dict order kept: elements are written in this order
        elements = tuple(dict.fromkeys(self.elements))
        shared, chains, sets, hairpin = tuple(self.shared), tuple(self.chains), tuple(self.sets), tuple(self.hairpin)
        return Fragment.of(service_key(self.sp.name), elements, shared, chains, sets, hairpin)


def _render_cluster_ip_only(sp: ServicePort, ctx: FamilyContext) -> Fragment:
    """``render_service`` for the common case (a ClusterIP only, no affinity), without the general path's closures:
    the same fragment, in a fraction of the time."""
    proto = sp.name.protocol._value_.lower()  # not the enum's ``value`` property: once per service of a full sync
    key = f"{sp.cluster_ip} . {proto} . {sp.port}"
    eps = sp.internal_endpoints
    shared: tuple[str, ...] = ()
    hairpin: tuple[str, ...] = ()
    if eps:
        masq = "a" if ctx.masquerade_all else ("n" if not ctx.local.implemented else "i")
        chain = f"lb-{masq}-{len(eps)}"
        # ``pack``'s text: a slot's line "backends-tcp|<entry key> . 0|<endpoint>" is "backends-tcp|~0|<endpoint>";
        # the digest's input, every line whole, made from it in one C call (``unpack``)
        slots = f"\n{_SLOT_NAMES[proto]}|~"
        text = f"{SERVICE_IPS}|{key}|goto {chain}{slots}" + slots.join(
            [f"{i}|{ep.ip} . {ep.port}" for i, ep in enumerate(eps)]
        )
        whole = text.replace("|~", f"|{key} . ")
        shared = canonical_shared((chain,))
        local = [f"{ep.ip} . {ep.ip}" for ep in eps if ep.is_local or ep.node_name is None]
        if local:
            hairpin = tuple(dict.fromkeys(local))
    elif sp.has_any_endpoints or sp.cluster_endpoints or sp.local_endpoints:
        text = whole = f"{SERVICE_IPS}|{key}|drop"
    else:
        text = whole = f"{SERVICE_IPS}|{key}|goto {REJECT_CHAIN}"
    return Fragment(
        service_key(sp.name),
        text,
        shared,
        hairpin_text="\n".join(hairpin),
        digest=digest_of(whole, (shared, (), (), hairpin)),
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
