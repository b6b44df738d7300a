"""Pure rendering of kproxy's nftables layout: ServicePorts in, map elements and ``nft -f`` transaction text out.

Nothing here touches the kernel, so unit tests assert on exact elements and commands and the benchmark times
Python's share apart from the kernel's. The layout and the reasons for it are in ``backends/nftables/__init__.py``.

Shape of the output: every service port renders into one ``Fragment`` (``fragment.py``: what the ledger keeps, its
elements as one text): its elements in the shared maps (keyed by
address . protocol . port, or protocol . port for NodePorts, entries carrying the service's comment), the names of the
shared count-indexed chains it jumps to (``lb-i-3``), and, only for ClientIP affinity, chains and dynamic sets of its
own. ``Transaction`` turns fragment changes into one transaction: element deletes and adds, per-service chains
written or removed, shared chains created on first use. The fixed part of the table (base chains, maps, the
masquerade helper) is ``layout.fixed_commands``; it does not depend on the node context, which lives in three small sets
(``local-cidrs``, ``local-ifaces``, ``nodeport-cidrs``) rendered by ``context_elements``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kproxy.model import Endpoint, IPFamily, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.cidr import any_contains, collapsed
from kproxy.toolkit.keys import service_key as service_key
from kproxy.toolkit.nft import nft_family as nft_family

from .fragment import ENTRY_MAPS, Element, Fragment, canonical_shared, digest_of, parse_elements
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
    SERVICE_DIGESTS,
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
    rule_command,
    service_chain_id,
    shared_chain_needs,
    shared_chain_rules,
    short_hash,
    shortcut_rules,
    slot_map,
)
from .localhost import listen_for

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
    "Element",
    "Fragment",
    "Transaction",
    "change_service",
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
        head = f"{_SLOT_NAMES[proto]}|{key} . "
        lines = [f"{SERVICE_IPS}|{key}|goto {chain}"]
        lines += [f"{head}{i}|{ep.ip} . {ep.port}" for i, ep in enumerate(eps)]
        text = "\n".join(lines)
        shared = canonical_shared((chain,))
        local = [f"{ep.ip} . {ep.ip}" for ep in eps if ep.is_local or ep.node_name is None]
        if local:
            hairpin = tuple(dict.fromkeys(local))
    elif sp.has_any_endpoints or sp.cluster_endpoints or sp.local_endpoints:
        text = f"{SERVICE_IPS}|{key}|drop"
    else:
        text = f"{SERVICE_IPS}|{key}|goto {REJECT_CHAIN}"
    return Fragment(
        service_key(sp.name),
        text,
        shared,
        hairpin_text="\n".join(hairpin),
        digest=digest_of(text, (shared, (), (), hairpin)),
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


Owner = ServicePortName | None


@dataclass(slots=True)
class _Group:
    """The elements of one map in one ``add element`` / ``delete element`` command: their lines and, line for line,
    the service each belongs to (two lists, not a tuple per element: a full sync writes millions)."""

    texts: list[str] = field(default_factory=list)
    owners: list[Owner] = field(default_factory=list)


@dataclass(slots=True)
class Transaction:
    """One atomic ``nft`` transaction for one family, built in order: declarations, chain contents, element
    deletes, element adds, removals. Elements are grouped into one ``add element`` / ``delete element`` command per
    map with one element per line (thousands of small commands cost libnftables far more than one long one), and
    every line that belongs to one service is recorded as its, so a refused element (libnftables names its line)
    names the service to leave out."""

    family: IPFamily
    head: list[str] = field(default_factory=list)  # table, maps, fixed chains, context sets
    declare: list[tuple[str, Owner]] = field(default_factory=list)  # chains and sets to create
    fill: list[tuple[str, Owner]] = field(default_factory=list)  # chain rules
    deletes: dict[str, _Group] = field(default_factory=dict)  # map -> keys
    adds: dict[str, _Group] = field(default_factory=dict)  # map -> elements
    tail: list[tuple[str, Owner]] = field(default_factory=list)  # chain and set removals
    elements_added: int = 0
    elements_deleted: int = 0

    @property
    def fam(self) -> str:
        return FAM[self.family]

    def _grouped(self, verb: str, groups: dict[str, _Group]) -> list[tuple[str, Owner]]:
        out: list[tuple[str, Owner]] = []
        for m, g in groups.items():
            if not g.texts:
                continue
            out.append((f"{verb} element {self.fam} {TABLE} {m} {{", None))
            last = len(g.texts) - 1
            out.extend((text if i == last else text + ",", g.owners[i]) for i, text in enumerate(g.texts))
            out.append(("}", None))
        return out

    def _grouped_text(self, verb: str, groups: dict[str, _Group]) -> list[str]:
        """``_grouped``'s lines as text, without a tuple per line."""
        return [
            f"{verb} element {self.fam} {TABLE} {m} {{\n" + ",\n".join(g.texts) + "\n}\n"
            for m, g in groups.items()
            if g.texts
        ]

    def lines(self) -> list[tuple[str, Owner]]:
        return (
            [(h, None) for h in self.head]
            + self.declare
            + self.fill
            + self._grouped("delete", self.deletes)
            + self._grouped("add", self.adds)
            + self.tail
        )

    def text(self) -> str:
        """``lines()`` as one text, one line each."""
        parts = [h + "\n" for h in self.head]
        parts += [line + "\n" for line, _ in (*self.declare, *self.fill)]
        parts += self._grouped_text("delete", self.deletes)
        parts += self._grouped_text("add", self.adds)
        parts += [line + "\n" for line, _ in self.tail]
        return "".join(parts)

    def owner_of(self, lineno: int) -> Owner:
        """The service owning 1-based line ``lineno`` of ``text()``."""
        lines = self.lines()
        return lines[lineno - 1][1] if 0 < lineno <= len(lines) else None

    def empty(self) -> bool:
        return not (self.head or self.declare or self.fill or self.deletes or self.adds or self.tail)

    # -- building blocks

    def _group(self, groups: dict[str, _Group], m: str) -> _Group:
        g = groups.get(m)
        if g is None:
            g = groups[m] = _Group()
        return g

    def add_elements(self, elements: Iterable[Element], comment: str | None, owner: Owner) -> None:
        c = f' comment "{comment}"' if comment else ""
        for m, k, v in elements:
            g = self._group(self.adds, m)
            g.texts.append(f"{k}{c} : {v}" if v else f"{k}{c}")
            g.owners.append(owner)
            self.elements_added += 1

    def add_fragment(self, frag: Fragment, owner: Owner) -> None:
        """Every element of ``frag`` into an empty place (a full sync into an empty table): its slots and other
        uncommented elements first, then its firewall elements, its entries, its digest (commented), each from its
        ``map|key|value`` line without making the tuples."""
        comment = f' comment "{comment_key(frag.key)}"'
        later: list[tuple[str, str]] = []  # firewall elements and entries, commented, in that order
        entries: list[tuple[str, str]] = []
        adds = self.adds
        n = 0
        for line in frag.text.split("\n"):
            m, _, kv = line.partition("|")
            if m in ENTRY_MAPS:
                entries.append((m, kv))
                continue
            if m == FIREWALL:
                later.append((m, kv))
                continue
            g = adds.get(m) or self._group(adds, m)
            # "key|value" to "key : value"; a set element's "key|" to "key" (no key or value holds a "|")
            g.texts.append(kv[:-1] if kv[-1] == "|" else kv.replace("|", " : "))
            g.owners.append(owner)
            n += 1
        for m, kv in (*later, *entries):
            k, _, v = kv.partition("|")
            g = adds.get(m) or self._group(adds, m)
            g.texts.append(f"{k}{comment} : {v}" if v else f"{k}{comment}")
            g.owners.append(owner)
            n += 1
        self.elements_added += n
        self.add_elements(((SERVICE_DIGESTS, frag.digest_key, ""),), frag.digest_comment, owner)

    def delete_keys(self, keys: Iterable[tuple[str, str]], owner: Owner) -> None:
        for m, k in keys:
            g = self._group(self.deletes, m)
            g.texts.append(k)
            g.owners.append(owner)
            self.elements_deleted += 1

    def add_shared_chain(self, name: str, *, exists: bool = False) -> None:
        """Declare and fill a shared chain; ``exists``: the kernel holds it with other rules (edited by hand), which
        are flushed first."""
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", None))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", None))
        self.fill.extend((rule_command(fam, name, r), None) for r in shared_chain_rules(name, self.family))

    def delete_chain(self, name: str, owner: ServicePortName | None) -> None:
        fam = self.fam
        self.tail.append((f"delete chain {fam} {TABLE} {name}", owner))

    def write_chain(self, name: str, rules: Sequence[str], owner: ServicePortName | None, *, exists: bool) -> None:
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", owner))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", owner))
        self.fill.extend((rule_command(fam, name, r), owner) for r in rules)

    def flush_chain(self, name: str, owner: ServicePortName | None) -> None:
        """Emptied before anything is deleted (a removed service's chains jump to each other)."""
        self.declare.append((f"flush chain {self.fam} {TABLE} {name}", owner))

    def add_set(self, name: str, spec: str, owner: ServicePortName | None) -> None:
        self.declare.insert(0, (f"add set {self.fam} {TABLE} {name} {{ {spec} }}", owner))

    def delete_set(self, name: str, owner: ServicePortName | None) -> None:
        self.tail.append((f"delete set {self.fam} {TABLE} {name}", owner))


def element_keys(frag: Fragment) -> dict[tuple[str, str], str]:
    """(map, key) -> value of a fragment's elements."""
    return {(m, k): v for m, k, v in parse_elements(frag.text)}


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
    after a restart): every element whose value is unknown is deleted and written again. An entry whose verdict is
    unchanged is left alone (adding a verdict-map element makes the kernel validate every element of the table's
    verdict maps at commit); the digest element changes with the digest."""
    if old is None and not old_keys and not old_chains and not old_sets:
        if new is not None:  # the common case of a full sync into an empty table: no diff to make
            tx.add_fragment(new, spn)
            for name, spec in new.sets:
                tx.add_set(name, spec, spn)
            for name, rules in new.chains:
                tx.write_chain(name, rules, spn, exists=False)
        return
    _change_elements(tx, spn, old, new, old_keys)
    _change_chains(tx, spn, old, new, old_chains, old_sets)


def _change_elements(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    old_keys: Mapping[tuple[str, str], str | None] | None,
) -> None:
    skeleton = old_keys or {}
    before: Mapping[tuple[str, str], str | None] = (
        element_keys(old) if old is not None else {k: v for k, v in skeleton.items() if k[0] != SERVICE_DIGESTS}
    )
    after = element_keys(new) if new is not None else {}
    old_digest = old.digest_key if old is not None else next((k for m, k in skeleton if m == SERVICE_DIGESTS), None)
    digest_changed = old is None or new is None or old.digest != new.digest or old.digest_key != new.digest_key
    dels = [mk for mk, v in before.items() if (nv := after.get(mk)) is None or nv != v]
    if old_digest is not None and digest_changed:
        dels.append((SERVICE_DIGESTS, old_digest))
    if dels:
        tx.delete_keys(dels, spn)
    if new is None:
        return
    adds = [(mk[0], mk[1], v) for mk, v in after.items() if mk not in before or before[mk] != v]
    entries = [e for e in adds if e[0] in (SERVICE_IPS, SERVICE_NODEPORTS)]
    others = [e for e in adds if e[0] not in (SERVICE_IPS, SERVICE_NODEPORTS)]
    if others:
        # slots carry no comment (their key starts with their entry's, which names the service)
        tx.add_elements((e for e in others if e[0] != FIREWALL), None, spn)
        tx.add_elements((e for e in others if e[0] == FIREWALL), new.comment, spn)
    if entries:
        tx.add_elements(entries, new.comment, spn)
    if digest_changed:
        tx.add_elements(((SERVICE_DIGESTS, new.digest_key, ""),), new.digest_comment, spn)


def _change_chains(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    old_chains: Iterable[str],
    old_sets: Iterable[str],
) -> None:
    """Per-service chains and sets (ClientIP affinity)."""
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
