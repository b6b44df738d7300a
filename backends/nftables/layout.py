"""kproxy's nftables layout: the table's names, the fixed part (maps, sets, base and helper chains) and the
shared chains indexed by endpoint count, whose rules follow from their names.

Pure: nothing here touches the kernel. The layout and the reasons for it are in ``backends/nftables/__init__.py``;
``render`` turns service ports into fragments and transactions over these names.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
from collections.abc import Iterable

from kproxy.model import IPFamily, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.toolkit.cidr import all_but_loopback, collapsed
from kproxy.toolkit.keys import service_key

TABLE = "kproxy"
#: bumped whenever the fixed part's shape changes: a table of another layout is replaced whole (see proxier)
LAYOUT = "kproxy-nftables-layout-2"
#: conntrack label bit that asks nat-postrouting to masquerade a connection (see __init__.py: no packet marks)
MASQ_LABEL = 127

# maps and sets (names shown by `nft list table`, readable like upstream's service-ips / service-nodeports)
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
#: one element per service port, keyed by its ClusterIP entry, whose comment carries the fragment digest: a plain set,
#: so rewriting it costs no verdict-map validation (see __init__.py)
SERVICE_DIGESTS = "service-digests"
BACKENDS = "backends"
SHORTCUT_BACKENDS = "shortcut-backends"
NODEPORT_BACKENDS = "nodeport-backends"
NODEPORT_SHORTCUT_BACKENDS = "nodeport-shortcut-backends"
FIREWALL = "firewall-allow"
HAIRPIN = "hairpin"
LOCAL_CIDRS = "local-cidrs"
LOCAL_IFACES = "local-ifaces"
NODEPORT_CIDRS = "nodeport-cidrs"
# --service-counters only (``counters``): sets of (service address or NodePort, endpoint), a counter on each element,
# each kind sharded over COUNT_SHARDS sets (``endpoint-counters-07``) by the low bits of the service address or of
# the NodePort: the kernel's element dump restarts its walk of a set at every ~32 KB continuation, so dumping one set
# of n elements costs O(n^2); small sets keep the read linear (backends/nftables/counters.py)
ENDPOINT_COUNTERS = "endpoint-counters"
NODEPORT_ENDPOINT_COUNTERS = "nodeport-endpoint-counters"
COUNT_SHARDS = 64  # a power of two: the count chains pick a shard with one mask and one verdict-map lookup
COUNT_CHAINS = {
    # nat chains at the source-NAT hooks see a connection's first packet after its DNAT; before any masquerade (a
    # chain after one that set up source NAT is not reached), so below srcnat (100)
    "count-postrouting": "type nat hook postrouting priority 90; policy accept;",
    "count-input": "type nat hook input priority 90; policy accept;",
}
#: the shard chains' name stems: ``count-ep-07`` looks up ``endpoint-counters-07``, ``count-np-07`` the NodePorts'
COUNT_SHARD_CHAIN = {ENDPOINT_COUNTERS: "count-ep", NODEPORT_ENDPOINT_COUNTERS: "count-np"}

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
    SERVICE_DIGESTS,
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

FAM = {IPFamily.V4: "ip", IPFamily.V6: "ip6"}
ADDR = {IPFamily.V4: "ipv4_addr", IPFamily.V6: "ipv6_addr"}


# ----------------------------------------------------------------------------------------------- names


B32 = "abcdefghijklmnopqrstuvwxyz234567"
B32_PAIRS = tuple(B32[v & 31] + B32[v >> 5] for v in range(1024))  # 10 bits, lower 5 first: 50 in five lookups


def short_hash(text: str, n: int = 10) -> str:
    """``n`` base32 characters of sha256(text) (lowercase: nft prints names as given)."""
    v = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    out = []
    for _ in range(n):
        out.append(B32[v & 31])
        v >>= 5
    return "".join(out)


_SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:-")


@functools.lru_cache(maxsize=200_000)  # bounded: services churn over a long life
def comment_key(key: str) -> str:
    """A service key short and safe enough for an nft comment (128 bytes, quoted): Kubernetes names are DNS labels,
    so a key is safe as it is; an overlong one (a 63-character namespace and name and a port name) is cut and keeps
    a hash of the whole. Memoised: called for every element written."""
    if len(key) <= 110 and _SAFE_CHARS.issuperset(key):
        return key
    clean = "".join(c if c in _SAFE_CHARS else "_" for c in key)
    return clean[:96] + "~" + short_hash(key, 12)


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


def set_declarations(family: IPFamily, counters: bool = False) -> list[tuple[str, str, str]]:
    """(kind, name, spec) of every map and set of the fixed part (``counters``: with ``--service-counters``)."""
    fam = FAM[family]
    addr = ADDR[family]
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
        ("set", SERVICE_DIGESTS, f"type {addr} . inet_proto . inet_service;"),
        *slots,
        ("set", FIREWALL, f"type {addr} . inet_proto . inet_service . {addr}; flags interval;"),
        ("set", HAIRPIN, f"type {addr} . {addr};"),
        *(
            [
                *(
                    ("set", name, f"type {addr} . inet_proto . inet_service . {addr} . inet_service; counter;")
                    for name in count_shards(ENDPOINT_COUNTERS)
                ),
                *(
                    ("set", name, f"type inet_proto . inet_service . {addr} . inet_service; counter;")
                    for name in count_shards(NODEPORT_ENDPOINT_COUNTERS)
                ),
            ]
            if counters
            else []
        ),
    ]


def count_shards(kind: str) -> tuple[str, ...]:
    """The counting sets of one kind (ENDPOINT_COUNTERS or NODEPORT_ENDPOINT_COUNTERS), shard 0 first."""
    return tuple(f"{kind}-{i:02d}" for i in range(COUNT_SHARDS))


def address_shard(address: str) -> int:
    """The shard of a service address's counting elements: the low bits of its last byte, as the count chains'
    ``ct original ip daddr & 0.0.0.63`` (``ip6``: ``& ::3f``) takes them."""
    return ipaddress.ip_address(address).packed[-1] & (COUNT_SHARDS - 1)


def counting_set(entry_map: str, entry_key: str) -> str:
    """The counting set of an entry's elements: ``service-ips`` ``198.19.0.65 . tcp . 80`` -> ``endpoint-counters-01``
    (by address), ``service-nodeports`` ``tcp . 30080`` -> ``nodeport-endpoint-counters-32`` (by port)."""
    if entry_map == SERVICE_IPS:
        return f"{ENDPOINT_COUNTERS}-{address_shard(entry_key.split(' . ', 1)[0]):02d}"
    return f"{NODEPORT_ENDPOINT_COUNTERS}-{int(entry_key.rsplit(' . ', 1)[1]) & (COUNT_SHARDS - 1):02d}"


def _count_chain_rules(family: IPFamily) -> dict[str, tuple[str, ...]]:
    """The counting chains' rules: the two base chains pick a shard chain by the original destination's low bits
    (one verdict-map lookup, whatever COUNT_SHARDS), which looks the connection up in its counting set; a connection
    counted through its address is not looked up again by port (``accept`` ends the base chain)."""
    fam = FAM[family]
    # per protocol: ``ct original proto-dst`` has a type only where the transport protocol is known
    key = f"meta l4proto . ct original proto-dst . {fam} daddr . th dport"

    def low(i: int) -> str:  # the address whose last byte is i: 0.0.0.7, ::7
        return str(ipaddress.IPv4Address(i) if family is IPFamily.V4 else ipaddress.IPv6Address(i))

    ep, np = COUNT_SHARD_CHAIN[ENDPOINT_COUNTERS], COUNT_SHARD_CHAIN[NODEPORT_ENDPOINT_COUNTERS]
    by_address = ", ".join(f"{low(i)} : jump {ep}-{i:02d}" for i in range(COUNT_SHARDS))
    by_port = ", ".join(f"{i} : jump {np}-{i:02d}" for i in range(COUNT_SHARDS))
    dispatch = (
        f"ct status dnat ct original {fam} daddr & {low(COUNT_SHARDS - 1)} vmap {{ {by_address} }}",
        *(
            f"meta l4proto {p} ct status dnat ct original proto-dst & {COUNT_SHARDS - 1} vmap {{ {by_port} }}"
            for p in PROTOCOLS
        ),
    )
    out: dict[str, tuple[str, ...]] = {}
    for i, (a, n) in enumerate(
        zip(count_shards(ENDPOINT_COUNTERS), count_shards(NODEPORT_ENDPOINT_COUNTERS), strict=True)
    ):
        out[f"{ep}-{i:02d}"] = tuple(f"meta l4proto {p} ct original {fam} daddr . {key} @{a} accept" for p in PROTOCOLS)
        out[f"{np}-{i:02d}"] = tuple(f"meta l4proto {p} {key} @{n} accept" for p in PROTOCOLS)
    return {**out, **{chain: dispatch for chain in COUNT_CHAINS}}


def fixed_chain_rules(family: IPFamily, counters: bool = False) -> dict[str, tuple[str, ...]]:
    """The rules of the fixed chains (adoption compares their tags; ``counters``: with ``--service-counters``)."""
    fam = FAM[family]
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
        **(_count_chain_rules(family) if counters else {}),
    }


BASE_SPECS = {
    "nat-prerouting": "type nat hook prerouting priority dstnat; policy accept;",
    "nat-output": "type nat hook output priority -100; policy accept;",
    "nat-postrouting": "type nat hook postrouting priority srcnat; policy accept;",
}


def layout_chain(family: IPFamily, counters: bool = False) -> str:
    """An empty chain whose name carries a digest of the fixed part: adoption reads chain names only (cheap), and a
    table of another layout (an older kproxy, or ``--service-counters`` turned on or off) is replaced whole."""
    text = repr((LAYOUT, set_declarations(family), fixed_chain_rules(family), BASE_SPECS))
    if counters:
        text += repr((set_declarations(family, True), fixed_chain_rules(family, True), COUNT_CHAINS))
    return "layout-" + short_hash(text, 10)


def rule_tag(rule: str) -> str:
    """The comment kproxy writes on a rule: a digest of its text. Adoption and ``verify`` read the comments back over
    netlink (no set elements fetched, unlike any ``nft list``), so a rule deleted, added or replaced by hand, or a
    flushed chain, is seen without parsing nft's printed rules."""
    return "k" + short_hash(rule, 10)


def rule_command(fam: str, chain: str, rule: str) -> str:
    return f'add rule {fam} {TABLE} {chain} {rule} comment "{rule_tag(rule)}"'


def fixed_commands(
    family: IPFamily, *, chains: Iterable[str] | None = None, declare: bool = True, counters: bool = False
) -> list[str]:
    """Commands that create the table, its maps and sets, and (re)write the fixed chains named in ``chains`` (None:
    all). ``add`` of an existing table, map or chain changes nothing, so this is safe on a loaded table."""
    fam = FAM[family]
    out: list[str] = []
    if declare:
        out.append(f'add table {fam} {TABLE} {{ comment "{LAYOUT}"; }}')
        for kind, name, spec in set_declarations(family, counters):
            out.append(f"add {kind} {fam} {TABLE} {name} {{ {spec} }}")
        out.append(f"add chain {fam} {TABLE} {layout_chain(family, counters)}")
    rules = fixed_chain_rules(family, counters)
    every = (*FIXED_CHAINS, *(c for c in rules if c not in FIXED_CHAINS))  # the counting chains after the rest
    todo = every if chains is None else tuple(c for c in every if c in set(chains))
    for chain in every:  # declared first: they jump to each other
        if chain in todo:
            base = BASE_SPECS.get(chain) or COUNT_CHAINS.get(chain)
            out.append(f"add chain {fam} {TABLE} {chain}" + (f" {{ {base} }}" if base else ""))
    for chain in todo:
        out.append(f"flush chain {fam} {TABLE} {chain}")
        out.extend(rule_command(fam, chain, r) for r in rules[chain])
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


@functools.lru_cache(maxsize=10_000)
def is_shared_chain(name: str) -> bool:
    return bool(_SHARED.match(name)) or (name.startswith("fw-") and is_shared_chain(name[3:]))


def is_service_chain(name: str) -> bool:
    """Per-service chains (ClientIP affinity, and the firewall in front of them)."""
    return name.startswith(("svc-", "ext-", "pick-", "ep-", "fw-svc-", "fw-ext-"))


def masq_rule(m: str) -> tuple[str, ...]:
    if m == "i":
        return (f"jump {MASQ_INTERNAL}",)
    if m == "a":
        return (f"ct label set {MASQ_LABEL}",)
    return ()


def shortcut_rules(fam: str, target: str) -> tuple[str, ...]:
    return (
        f"{fam} saddr @{LOCAL_CIDRS} goto {target}",
        f"iifname @{LOCAL_IFACES} goto {target}",
        f"fib saddr type local ct label set {MASQ_LABEL} goto {target}",
    )


def shared_chain_rules(name: str, family: IPFamily) -> tuple[str, ...]:
    """The rules of a shared chain, from its name (see above); ValueError for a name that is not one."""
    fam = FAM[family]
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
        return (*masq_rule(parts[1]), *dnat(addr_key, int(parts[2]), BACKENDS))
    if parts[0] == "sc":
        return dnat(addr_key, int(parts[1]), SHORTCUT_BACKENDS)
    if parts[0] == "np":
        return (*masq_rule(parts[1]), *dnat(port_key, int(parts[2]), NODEPORT_BACKENDS))
    if parts[0] == "npsc":
        return dnat(port_key, int(parts[1]), NODEPORT_SHORTCUT_BACKENDS)
    k, j = int(parts[1]), int(parts[2])
    if parts[0] == "lbl":
        tail = f"goto lb-n-{k}" if k else "drop"
        return (*shortcut_rules(fam, f"sc-{j}"), tail)
    tail = f"goto np-n-{k}" if k else "drop"
    return (*shortcut_rules(fam, f"npsc-{j}"), tail)


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
