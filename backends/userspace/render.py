"""Pure rendering of the userspace mode: one ServicePort to a ``Fragment`` (its redirect elements and the listeners
its proxy sockets serve), and the nftables text of this mode's own table.

Nothing here touches the kernel or a socket, so unit tests assert on exact fragments and commands; a batch's
transaction (``Tx``: the table's fixed part, its sets, the element diff) is built here too, from plain values. The
layout and the reasons for it are in ``backends/userspace/__init__.py``.

A fragment names its listeners by *role*: ``c`` serves every address of the service (internal and external traffic
go to the same endpoints), or ``i`` (ClusterIP) and ``e`` (NodePort, externalIPs, load-balancer IPs) when a Local
traffic policy makes the two endpoint sets differ. Redirect elements carry the role in place of the proxy port;
``proxier`` allocates one proxy socket (and port) per (service port, role) and writes the port.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, Verdict
from kproxy.nodeaddr import LOCALHOST, FamilyContext
from kproxy.toolkit.cidr import Network, all_but_loopback
from kproxy.toolkit.keys import service_key as service_key
from kproxy.toolkit.nft import nft_family as nft_family
from kproxy.toolkit.nft import owner_at

TABLE = "kproxy-userspace"
#: bumped whenever the fixed part's shape changes: a table of another layout is replaced whole
LAYOUT = "layout-kproxy-userspace-3"

SERVICE_IPS = "service-ips"  # address . proto . port : verdict
SERVICE_PORTS = "service-ports"  # address . proto . port : proxy port
SERVICE_NODEPORTS = "service-nodeports"  # proto . port : verdict
NODEPORT_PORTS = "nodeport-ports"  # proto . port : proxy port
FIREWALL = "firewall-allow"  # address . proto . port . source interval
NODEPORT_CIDRS = "nodeport-cidrs"
PROXY_PORTS = "proxy-ports"  # the proxy port range (an interval of inet_service): the guard's match
#: maps and sets whose elements belong to one service each (comment: the service key)
SERVICE_MAPS = (SERVICE_IPS, SERVICE_PORTS, SERVICE_NODEPORTS, NODEPORT_PORTS, FIREWALL)
PORT_MAPS = {SERVICE_IPS: SERVICE_PORTS, SERVICE_NODEPORTS: NODEPORT_PORTS}

REDIRECT_SVC = "redirect-svc"
REDIRECT_NP = "redirect-np"
REJECT = "reject-chain"
FIREWALL_CHAIN = "firewall"
GUARD = "proxy-guard"

V_REDIRECT_SVC = f"goto {REDIRECT_SVC}"
V_REDIRECT_NP = f"goto {REDIRECT_NP}"
V_REJECT = f"goto {REJECT}"
V_FIREWALL = f"goto {FIREWALL_CHAIN}"
V_DROP = "drop"

ROLES = ("c", "i", "e")


def _addr_type(family: IPFamily) -> str:
    return "ipv4_addr" if family == IPFamily.V4 else "ipv6_addr"


def _daddr(family: IPFamily) -> str:
    return "ip daddr" if family == IPFamily.V4 else "ip6 daddr"


def _saddr(family: IPFamily) -> str:
    return "ip saddr" if family == IPFamily.V4 else "ip6 saddr"


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:-")


def comment_key(key: str) -> str:
    """A service key safe for an nft comment (quoted, at most 128 bytes): Kubernetes names are DNS labels, so a key
    is safe as it is; anything else is replaced, and an overlong key is cut and keeps a hash of the whole."""
    if len(key) <= 110 and _SAFE.issuperset(key):
        return key
    clean = "".join(c if c in _SAFE else "_" for c in key)
    return clean[:96] + "~" + hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Listener:
    """One proxy socket's work: where its connections go and how they are balanced."""

    role: str
    endpoints: tuple[tuple[str, int], ...]
    affinity: int  # ClientIP affinity timeout in seconds, 0 = none


@dataclass(frozen=True, slots=True)
class Entry:
    """One redirect element: in ``map`` (``service-ips`` / ``service-nodeports``), ``key`` (nft text), the verdict,
    and for a redirect the role of the listener whose port goes into the port map under the same key."""

    map: str
    key: str
    verdict: str
    role: str = ""


@dataclass(frozen=True, slots=True)
class Fragment:
    """What one service port renders to (compared with ``==`` by the ledger)."""

    key: str  # ns/name[:port]/PROTO
    family: IPFamily
    proto: str  # tcp / udp
    entries: tuple[Entry, ...]
    firewall: tuple[str, ...]  # firewall-allow keys
    listeners: tuple[Listener, ...]
    unsupported: str = ""  # why the mode cannot serve it (SCTP)

    @property
    def comment(self) -> str:
        return comment_key(self.key)

    def roles(self) -> tuple[str, ...]:
        return tuple(lst.role for lst in self.listeners)

    def kernel_elements(self, ports: dict[str, int]) -> frozenset[tuple[str, str, str]]:
        """The (map, key, value) elements this service owns in the kernel, with its listeners' ``ports``."""
        out: set[tuple[str, str, str]] = set()
        for e in self.entries:
            out.add((e.map, e.key, e.verdict))
            if e.role:
                out.add((PORT_MAPS[e.map], e.key, str(ports[e.role])))
        out.update((FIREWALL, k, "") for k in self.firewall)
        return frozenset(out)


def _eps(endpoints: tuple[Endpoint, ...]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted({(e.ip, e.port) for e in endpoints}))


def render_service(sp: ServicePort) -> Fragment:
    """One service port's fragment (see the module docstring)."""
    fam = sp.family
    proto = sp.protocol.lowercase
    key = service_key(sp.name)
    if sp.protocol is Protocol.SCTP:
        # no SCTP proxy socket (as upstream's userspace mode; this kernel has no SCTP sockets either): the service's
        # addresses reject new associations, so clients fail fast instead of leaking out by the default route
        keys = [(SERVICE_IPS, f"{a} . {proto} . {sp.port}") for a in dict.fromkeys(sp.addresses) if a]
        if sp.node_port:
            keys.append((SERVICE_NODEPORTS, f"{proto} . {sp.node_port}"))
        return Fragment(
            key,
            fam,
            proto,
            tuple(Entry(m, k, V_REJECT) for m, k in keys),
            (),
            (),
            unsupported="SCTP is not supported by the userspace mode: its traffic is rejected",
        )
    iv, ev = sp.internal_verdict, sp.external_verdict
    internal_eps, external_eps = sp.internal_endpoints, sp.external_endpoints
    internal = _eps(internal_eps)
    external = internal if external_eps is internal_eps else _eps(external_eps)
    listeners: list[Listener] = []
    i_role = e_role = ""
    if iv is Verdict.FORWARD and ev is Verdict.FORWARD and internal == external:
        i_role = e_role = "c"
        listeners.append(Listener("c", internal, sp.affinity_timeout))
    else:
        if iv is Verdict.FORWARD:
            i_role = "i"
            listeners.append(Listener("i", internal, sp.affinity_timeout))
        if sp.has_external_addresses and ev is Verdict.FORWARD:
            e_role = "e"
            listeners.append(Listener("e", external, sp.affinity_timeout))

    def verdict(v: Verdict, redirect: str) -> str:
        if v is Verdict.FORWARD:
            return redirect
        return V_REJECT if v is Verdict.REJECT else V_DROP

    entries: list[Entry] = []
    firewall: list[str] = []
    if sp.cluster_ip:
        int_v = verdict(iv, V_REDIRECT_SVC)
        entries.append(Entry(SERVICE_IPS, f"{sp.cluster_ip} . {proto} . {sp.port}", int_v, i_role))
    ext_v = verdict(ev, V_REDIRECT_SVC)
    for ip in sp.external_ips:
        entries.append(Entry(SERVICE_IPS, f"{ip} . {proto} . {sp.port}", ext_v, e_role))
    for ip in sp.load_balancer_ips:
        k = f"{ip} . {proto} . {sp.port}"
        if sp.load_balancer_source_ranges and ev is not Verdict.REJECT:
            entries.append(Entry(SERVICE_IPS, k, V_FIREWALL, e_role))
            firewall.extend(f"{k} . {cidr}" for cidr in sorted(sp.load_balancer_source_ranges) if _fam(cidr) == fam)
        else:
            entries.append(Entry(SERVICE_IPS, k, ext_v, e_role))
    if sp.node_port:
        entries.append(Entry(SERVICE_NODEPORTS, f"{proto} . {sp.node_port}", verdict(ev, V_REDIRECT_NP), e_role))
    # roles only where the verdict redirects (a reject/drop element has no port)
    redirects = (V_REDIRECT_SVC, V_REDIRECT_NP, V_FIREWALL)
    entries = [e if e.verdict in redirects else Entry(e.map, e.key, e.verdict) for e in entries]
    # two addresses of one service can coincide (an externalIP equal to an LB IP): the first wins
    seen: set[tuple[str, str]] = set()
    unique = []
    for e in entries:
        if (e.map, e.key) not in seen:
            seen.add((e.map, e.key))
            unique.append(e)
    return Fragment(key, fam, proto, tuple(unique), tuple(firewall), tuple(listeners))


def _fam(cidr: str) -> IPFamily:
    return IPFamily.V6 if ":" in cidr else IPFamily.V4


# ------------------------------------------------------------------------------------------------ the table


def fixed_commands(family: IPFamily) -> list[str]:
    """The table's fixed part (maps, chains, hooks): ``add`` commands, harmless when they exist already."""
    f, t = nft_family(family), TABLE
    at = _addr_type(family)
    d, s = _daddr(family), _saddr(family)
    return [
        f"add table {f} {t}",
        f"add chain {f} {t} {LAYOUT}",
        f"add map {f} {t} {SERVICE_IPS} {{ type {at} . inet_proto . inet_service : verdict; }}",
        f"add map {f} {t} {SERVICE_PORTS} {{ type {at} . inet_proto . inet_service : inet_service; }}",
        f"add map {f} {t} {SERVICE_NODEPORTS} {{ type inet_proto . inet_service : verdict; }}",
        f"add map {f} {t} {NODEPORT_PORTS} {{ type inet_proto . inet_service : inet_service; }}",
        f"add set {f} {t} {NODEPORT_CIDRS} {{ type {at}; flags interval; }}",
        f"add set {f} {t} {FIREWALL} {{ type {at} . inet_proto . inet_service . {at}; flags interval; }}",
        f"add chain {f} {t} {REDIRECT_SVC}",
        f"add rule {f} {t} {REDIRECT_SVC} meta l4proto {{ tcp, udp }} redirect to : {d} . meta l4proto . th dport "
        f"map @{SERVICE_PORTS}",
        f"add chain {f} {t} {REDIRECT_NP}",
        f"add rule {f} {t} {REDIRECT_NP} meta l4proto {{ tcp, udp }} redirect to : meta l4proto . th dport "
        f"map @{NODEPORT_PORTS}",
        f"add chain {f} {t} {REJECT}",
        f"add rule {f} {t} {REJECT} reject",
        f"add chain {f} {t} {FIREWALL_CHAIN}",
        f"add rule {f} {t} {FIREWALL_CHAIN} {d} . meta l4proto . th dport . {s} @{FIREWALL} goto {REDIRECT_SVC}",
        f"add rule {f} {t} {FIREWALL_CHAIN} drop",
        f"add chain {f} {t} services",
        f"add rule {f} {t} services {d} . meta l4proto . th dport vmap @{SERVICE_IPS}",
        f"add rule {f} {t} services {d} @{NODEPORT_CIDRS} fib daddr type local meta l4proto . th dport "
        f"vmap @{SERVICE_NODEPORTS}",
        f"add chain {f} {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}",
        *_martian_guard(family),
        f"add rule {f} {t} prerouting jump services",
        f"add chain {f} {t} output {{ type nat hook output priority -100; policy accept; }}",
        f"add rule {f} {t} output jump services",
        *guard_commands(family),
    ]


def _martian_guard(family: IPFamily) -> list[str]:
    """Packets from outside to a loopback address are martians the kernel drops after routing; a redirect before
    routing would rewrite them to the receiving interface's address and let them in (CVE-2020-8558's exposure, which
    upstream closes with ``route_localnet``'s drop rule). So localhost NodePorts (127.0.0.1 in ``nodeport-cidrs``)
    are redirected on the output path only: prerouting leaves loopback destinations alone."""
    if family != IPFamily.V4:
        return []  # ::1 is never a NodePort address (kproxy.nodeaddr)
    return [f"add rule ip {TABLE} prerouting ip daddr 127.0.0.0/8 return"]


def guard_commands(family: IPFamily) -> list[str]:
    """The input guard: a new connection (or UDP flow) to a port of the proxy port range is taken only when a
    redirect of this table sent it there (conntrack marks a redirected flow ``dnat``); anything else, a client
    dialling ``nodeIP:<proxy port>`` straight past the service rules (and past ``loadBalancerSourceRanges``), is
    refused as a closed port would be. Replies to the node's own connections from a port of the range (a range
    that overlaps the ephemeral one) are another flow's reply direction and pass."""
    f, t = nft_family(family), TABLE
    return [
        f"add set {f} {t} {PROXY_PORTS} {{ type inet_service; flags interval; }}",
        f"add chain {f} {t} {GUARD}",
        f"add rule {f} {t} {GUARD} ct direction reply accept",
        f"add rule {f} {t} {GUARD} ct status dnat accept",
        f"add rule {f} {t} {GUARD} reject with tcp reset",  # nft adds the implied "meta l4proto tcp" itself
        f"add rule {f} {t} {GUARD} reject",
        f"add chain {f} {t} input {{ type filter hook input priority filter; policy accept; }}",
        f"add rule {f} {t} input meta l4proto {{ tcp, udp }} th dport @{PROXY_PORTS} jump {GUARD}",
    ]


def proxy_ports_element(port_range: tuple[int, int]) -> str:
    """The ``proxy-ports`` set's one element for ``(first, last)``."""
    lo, hi = port_range
    return f"{lo}-{hi}" if hi > lo else str(lo)


def nodeport_cidrs(ctx: FamilyContext) -> tuple[str, ...]:
    """Where NodePorts answer, as nft interval elements: every address but loopback, or ``--nodeport-addresses``;
    and 127.0.0.1 when the core serves localhost NodePorts (reached from the node only: ``_martian_guard``)."""
    localhost = [ipaddress.ip_network(f"{LOCALHOST}/32")] if ctx.localhost_nodeports else []
    if ctx.nodeport_all_local:
        return _ranges(sorted([*all_but_loopback(ctx.family), *localhost]))  # type: ignore[type-var]
    out = list(ctx.nodeport_cidrs) + [f"{ip}/{32 if ctx.family == IPFamily.V4 else 128}" for ip in ctx.nodeport_ips]
    out += [str(n) for n in localhost]
    return tuple(sorted(set(out)))


def _ranges(nets: Sequence[Network]) -> tuple[str, ...]:
    """Adjacent networks merged into ``a-b`` ranges (nft refuses overlapping and prefers few intervals)."""
    spans: list[list[int]] = []
    for n in nets:
        lo, hi = int(n.network_address), int(n.broadcast_address)
        if spans and spans[-1][1] + 1 == lo:
            spans[-1][1] = hi
        else:
            spans.append([lo, hi])
    cls = ipaddress.IPv4Address if nets[0].version == 4 else ipaddress.IPv6Address
    out = [f"{cls(lo)}-{cls(hi)}" if hi > lo else str(cls(lo)) for lo, hi in spans]
    return tuple(out)


def element_line(family: IPFamily, op: str, map_: str, key: str, value: str, comment: str) -> str:
    """One ``add``/``delete element`` command (delete: key only)."""
    f = nft_family(family)
    if op == "delete":
        return f"delete element {f} {TABLE} {map_} {{ {key} }}"
    data = f" : {value}" if value else ""
    return f'add element {f} {TABLE} {map_} {{ {key} comment "{comment}"{data} }}'


# ------------------------------------------------------------------------------------------------ transactions

ElemKey = tuple[str, str]  # (map, key)
Elements = frozenset[tuple[str, str, str]]  # (map, key, value) of one service


@dataclass(slots=True)
class Tx:
    """One transaction's lines and, per line, the service that owns it (to map a refused line back)."""

    lines: list[str] = field(default_factory=list)
    owners: list[ServicePortName | None] = field(default_factory=list)

    def add(self, line: str, owner: ServicePortName | None = None) -> None:
        self.lines.append(line)
        self.owners.append(owner)

    def owner_of(self, line: int) -> ServicePortName | None:
        return owner_at(self.owners, line)

    def text(self) -> str:
        return "".join(ln + "\n" for ln in self.lines)

    def figures(self) -> dict[str, int]:
        return {
            "commands": len(self.lines),
            "elements_added": sum(1 for ln in self.lines if ln.startswith("add element")),
            "elements_deleted": sum(1 for ln in self.lines if ln.startswith("delete element")),
        }


def table_lines(
    tx: Tx, family: IPFamily, *, fresh: bool, replace: bool, cidrs: tuple[str, ...] | None, span: str | None
) -> None:
    """A full batch's table part: the fixed part when ``fresh`` (a table there, ``replace``: deleted in the same
    transaction), and the ``nodeport-cidrs`` and guard's ``proxy-ports`` sets rewritten with ``cidrs`` and ``span``
    (None: the kernel holds them already)."""
    f, t = nft_family(family), TABLE
    if fresh:
        if replace:  # unreadable or another layout: replaced in one transaction
            tx.add(f"add table {f} {t}")
            tx.add(f"delete table {f} {t}")
        for line in fixed_commands(family):
            tx.add(line)
    if cidrs is not None:
        if not fresh:
            tx.add(f"flush set {f} {t} {NODEPORT_CIDRS}")
        if cidrs:
            tx.add(f"add element {f} {t} {NODEPORT_CIDRS} {{ {', '.join(cidrs)} }}")
    if span is not None:
        if not fresh:
            tx.add(f"flush set {f} {t} {PROXY_PORTS}")
        tx.add(f"add element {f} {t} {PROXY_PORTS} {{ {span} }}")


def full_element_lines(
    tx: Tx,
    family: IPFamily,
    kernel: Mapping[ElemKey, tuple[str, str]],
    want: Mapping[ServicePortName, Elements],
    comments: Mapping[ServicePortName, str],
) -> None:
    """A full batch's elements: what ``want`` holds against what the ``kernel`` holds ((map, key) -> (value,
    comment)): deletes of what differs or nobody wants, then adds."""
    if not kernel:  # nothing there (a fresh table): every element is an add, no diff to compute
        for spn, elems in want.items():
            c = comments[spn]
            for m, k, v in elems:
                tx.add(element_line(family, "add", m, k, v, c), spn)
        return
    desired: dict[ElemKey, tuple[str, ServicePortName]] = {}
    for spn, elems in want.items():
        for m, k, v in elems:
            desired[(m, k)] = (v, spn)
    for mk, (v, c) in kernel.items():
        if mk not in desired or desired[mk][0] != v or comments.get(desired[mk][1]) != c:
            tx.add(element_line(family, "delete", mk[0], mk[1], "", ""))
    for mk, (v, spn) in desired.items():
        if mk not in kernel or kernel[mk][0] != v or kernel[mk][1] != comments[spn]:
            tx.add(element_line(family, "add", mk[0], mk[1], v, comments[spn]), spn)


def delta_element_lines(
    tx: Tx,
    family: IPFamily,
    names: Iterable[ServicePortName],
    written: Mapping[ServicePortName, Elements],
    want: Mapping[ServicePortName, Elements],
    comments: Mapping[ServicePortName, str],
) -> None:
    """A partial batch's elements: for each of ``names``, what was ``written`` against what it ``want``s now (a
    service absent from ``want`` is removed): every delete first, then the adds."""
    adds: list[tuple[str, str, str, ServicePortName]] = []
    for spn in names:
        old_keys = {(m, k): v for m, k, v in written.get(spn, frozenset())}
        new_keys = {(m, k): v for m, k, v in want.get(spn, frozenset())}
        for mk, v in old_keys.items():
            if new_keys.get(mk) != v:
                tx.add(element_line(family, "delete", mk[0], mk[1], "", ""), spn)
        adds += [(m, k, v, spn) for (m, k), v in new_keys.items() if old_keys.get((m, k)) != v]
    for m, k, v, spn in adds:
        tx.add(element_line(family, "add", m, k, v, comments[spn]), spn)
