"""A yardstick, never a mode: upstream kube-proxy's nftables layout for the benchmark's synthetic state, timed with
``nft -f`` in a network namespace of its own, so ``kproxy bench sync --reference upstream-nftables`` reports
upstream's time beside kproxy's in one run (docs/PERFORMANCE.md: "ahead of upstream" is a ratio, not a claim).

The layout follows upstream kube-proxy's ``pkg/proxy/nftables/proxier.go`` (written here from its description, not
copied): table ``ip kube-proxy`` with upstream's base chains and jumps,
the ``cluster-ips`` set and the ``service-ips`` / ``no-endpoint-services`` / ``service-nodeports`` /
``no-endpoint-nodeports`` / ``firewall-ips`` verdict maps; per service port a chain
``service-<HASH>-ns/name/proto/port`` (masquerade mark for off-cluster sources, then an anonymous
``numgen random mod N vmap { i : goto endpoint-... }``) and per endpoint a chain
``endpoint-<HASH>-ns/name/proto/port__IP/PORT`` (hairpin mark, ``dnat to``). ``<HASH>`` is upstream's
``hashAndTruncate``: the first 8 characters of base32(sha256(name)). Only what the synthetic state holds is rendered
(ClusterIP services with cluster traffic policy, with or without endpoints); anything else is counted as skipped.

Timing, each with ``time.perf_counter`` around the ``nft -f`` process (so nft's own parsing is included, as it is in
upstream's knftables, which pipes the same text to ``nft -f -``):

- ``full_s``: the whole first transaction into an empty namespace;
- ``partial_s``: median over the runs of the transaction upstream writes when one endpoint of one service moves
  (the service's chains added and flushed and their rules written again, the new endpoint chain created, the stale
  one flushed), and ``partial_cleanup_s`` the later transaction that deletes the stale chains (upstream waits at
  least a second before it);
- ``render_s``: generating the full text in Python (upstream does this in Go; not part of ``full_s``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, ServicePort

NAME = "upstream-nftables"
REFERENCES = (NAME,)
TABLE = "kube-proxy"
MASQ_MARK = "0x00004000"  # 1 << 14, upstream's default masquerade bit
CLUSTER_CIDR = "198.18.64.0/18"
SERVICE_CIDR = "198.19.0.0/16"
CHAIN_NAME_BASE_MAX = 240
NETNS_PREFIX = "kpb-"  # the sync bench's prefix: a namespace left by a killed run is removed by the next bench
NFT_TIMEOUT = 3600.0
#: endpoints (services x endpoints) up to which the reference runs unless told otherwise: upstream's layout took
#: 68 s in nft -f at 10,000 x 10 here (PERFORMANCE.md), so bigger states are opt-in
DEFAULT_MAX_ENDPOINTS = 50_000

_SAFE = re.compile(r"^[A-Za-z0-9_./:-]+$")


class ReferenceError_(RuntimeError):
    """The reference could not be rendered or applied; the message says why."""


@dataclass
class ReferenceBench:
    """Upstream's nftables layout for one synthetic state; ``to_json()`` is the documented output."""

    layout: str
    services: int
    endpoints: int
    repeat: int
    full_s: float = 0.0
    partial_s: float = 0.0
    partial_runs: list[float] = field(default_factory=list)
    partial_cleanup_s: float = 0.0
    render_s: float = 0.0
    chains: int = 0
    rules: int = 0
    elements: int = 0
    lines: int = 0
    skipped: int = 0
    nft_version: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def hash_and_truncate(name: str) -> str:
    """Upstream's ``hashAndTruncate``: 8 characters of base32(sha256(name)), a dash, the name, capped at 240."""
    encoded = base64.b32encode(hashlib.sha256(name.encode()).digest()).decode()
    out = f"{encoded[:8]}-{name}"
    return out if len(out) <= CHAIN_NAME_BASE_MAX else out[: CHAIN_NAME_BASE_MAX - 3] + "..."


def _check(word: str) -> str:
    # names and addresses reach nft's text: only the characters upstream's chain names and addresses may hold
    if not _SAFE.match(word):
        raise ReferenceError_(f"refusing {word!r} in nft text")
    return word


def service_chain(sp: ServicePort) -> str:
    n = sp.name
    return _check("service-" + hash_and_truncate(f"{n.namespace}/{n.name}/{n.protocol.value.lower()}/{n.port}"))


def endpoint_chain(sp: ServicePort, ip: str, port: int) -> str:
    n = sp.name
    base = f"{n.namespace}/{n.name}/{n.protocol.value.lower()}/{n.port}__{ip.replace(':', '.')}/{port}"
    return _check("endpoint-" + hash_and_truncate(base))


@dataclass
class Counts:
    chains: int = 0
    rules: int = 0
    elements: int = 0
    skipped: int = 0


def render_base(counts: Counts) -> list[str]:
    """The table, base chains, helper chains, sets and maps, and the jumps between them (a fresh table)."""
    t = f"ip {TABLE}"
    out = [f'add table {t} {{ comment "rules for kube-proxy" ; }}']
    base = [
        ("filter-prerouting", "filter", "prerouting", "-110"),
        ("filter-input", "filter", "input", "-110"),
        ("filter-forward", "filter", "forward", "-110"),
        ("filter-output", "filter", "output", "-110"),
        ("filter-output-post-dnat", "filter", "output", "-90"),
        ("nat-prerouting", "nat", "prerouting", "-100"),
        ("nat-output", "nat", "output", "-100"),
        ("nat-postrouting", "nat", "postrouting", "100"),
    ]
    for name, typ, hook, prio in base:
        out.append(f"add chain {t} {name} {{ type {typ} hook {hook} priority {prio} ; }}")
    helpers = (
        "services",
        "service-endpoints-check",
        "nodeport-endpoints-check",
        "firewall-check",
        "cluster-ips-check",
        "masquerading",
        "mark-for-masquerade",
        "reject-chain",
    )
    out += [f"add chain {t} {c}" for c in helpers]
    counts.chains += len(base) + len(helpers)
    vsvc = "ipv4_addr . inet_proto . inet_service : verdict"
    vnp = "inet_proto . inet_service : verdict"
    out += [
        f'add set {t} cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}',
        f'add map {t} service-ips {{ type {vsvc} ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }}',
        f'add map {t} service-nodeports {{ type {vnp} ; comment "NodePort traffic" ; }}',
        f'add map {t} no-endpoint-services {{ type {vsvc} ; comment "vmap to drop or reject packets to services'
        ' with no endpoints" ; }',
        f'add map {t} no-endpoint-nodeports {{ type {vnp} ; comment "vmap to drop or reject packets to service'
        ' nodeports with no endpoints" ; }',
        f'add map {t} firewall-ips {{ type {vsvc} ; comment "destinations that are subject to'
        ' LoadBalancerSourceRanges" ; }',
    ]
    rules = [
        ("filter-prerouting", "ct state new jump firewall-check"),
        ("filter-input", "ct state new jump nodeport-endpoints-check"),
        ("filter-input", "ct state new jump service-endpoints-check"),
        ("filter-forward", "ct state new jump service-endpoints-check"),
        ("filter-forward", "ct state new jump cluster-ips-check"),
        ("filter-output", "ct state new jump service-endpoints-check"),
        ("filter-output", "ct state new jump firewall-check"),
        ("filter-output-post-dnat", "ct state new jump cluster-ips-check"),
        ("nat-prerouting", "jump services"),
        ("nat-output", "jump services"),
        ("nat-postrouting", "jump masquerading"),
        ("reject-chain", "reject"),
        ("mark-for-masquerade", f"mark set mark or {MASQ_MARK}"),
        ("masquerading", f"mark and {MASQ_MARK} == 0 return"),
        ("masquerading", f"mark set mark xor {MASQ_MARK}"),
        ("masquerading", "masquerade fully-random"),
        ("services", "ip daddr . meta l4proto . th dport vmap @service-ips"),
        ("services", "fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"),
        ("service-endpoints-check", "ip daddr . meta l4proto . th dport vmap @no-endpoint-services"),
        ("nodeport-endpoints-check", "ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports"),
        ("firewall-check", "ip daddr . meta l4proto . th dport vmap @firewall-ips"),
        ("cluster-ips-check", 'ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"'),
        ("cluster-ips-check", f'ip daddr {{ {SERVICE_CIDR} }} drop comment "Drop traffic to unallocated ClusterIPs"'),
    ]
    out += [f"add rule {t} {chain} {rule}" for chain, rule in rules]
    counts.rules += len(rules)
    return out


def render_service_chains(sp: ServicePort, counts: Counts, *, flush: bool = False) -> list[str]:
    """The service chain and its endpoint chains (``flush``: as a partial sync rewrites an existing service)."""
    t = f"ip {TABLE}"
    proto = sp.protocol.value.lower()
    eps = sp.internal_endpoints
    if not eps:
        return []
    out: list[str] = []
    svc = service_chain(sp)
    ep_chains = [(endpoint_chain(sp, e.ip, e.port), e) for e in eps]
    for chain in [svc, *(c for c, _ in ep_chains)]:
        out.append(f"add chain {t} {chain}")
        if flush:
            out.append(f"flush chain {t} {chain}")
    counts.chains += 1 + len(ep_chains)
    cip = _check(sp.cluster_ip)
    out.append(
        f"add rule {t} {svc} ip daddr {cip} {proto} dport {sp.port} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"
    )
    vmap = " , ".join(f"{i} : goto {c}" for i, (c, _) in enumerate(ep_chains))
    out.append(f"add rule {t} {svc} numgen random mod {len(ep_chains)} vmap {{ {vmap} }}")
    counts.rules += 2
    for chain, e in ep_chains:
        ip = _check(e.ip)
        out.append(f"add rule {t} {chain} ip saddr {ip} jump mark-for-masquerade")
        out.append(f"add rule {t} {chain} meta l4proto {proto} dnat to {ip}:{e.port}")
        counts.rules += 2
    return out


def render_service_elements(sp: ServicePort, counts: Counts) -> list[str]:
    t = f"ip {TABLE}"
    proto = sp.protocol.value.lower()
    cip = _check(sp.cluster_ip)
    out = [f"add element {t} cluster-ips {{ {cip} }}"]
    if sp.internal_endpoints:
        out.append(f"add element {t} service-ips {{ {cip} . {proto} . {sp.port} : goto {service_chain(sp)} }}")
    else:
        verdict = "drop" if sp.has_any_endpoints else "goto reject-chain"
        out.append(f"add element {t} no-endpoint-services {{ {cip} . {proto} . {sp.port} : {verdict} }}")
    counts.elements += 2
    return out


def render_full(state: Iterable[ServicePort], counts: Counts) -> list[str]:
    """Upstream's first sync of ``state`` into an empty namespace, as one transaction."""
    out = render_base(counts)
    for sp in state:
        if sp.family is not IPFamily.V4 or sp.has_external_addresses or sp.internal_policy_local:
            counts.skipped += 1  # not in the synthetic state; the yardstick renders only what it is timed on
            continue
        out += render_service_chains(sp, counts)
        out += render_service_elements(sp, counts)
    return out


def render_partial(old: ServicePort, new: ServicePort) -> tuple[list[str], list[str]]:
    """(the partial sync's transaction, the later one deleting stale chains) when ``old`` became ``new``."""
    counts = Counts()
    tx = render_service_chains(new, counts, flush=True)
    active = {endpoint_chain(new, e.ip, e.port) for e in new.internal_endpoints}
    stale = [c for c in (endpoint_chain(old, e.ip, e.port) for e in old.internal_endpoints) if c not in active]
    tx += [f"flush chain ip {TABLE} {c}" for c in stale]
    return tx, [f"delete chain ip {TABLE} {c}" for c in stale]


# --- the run --------------------------------------------------------------------------------------------------


def _nft_version() -> str:
    try:
        return subprocess.run(["nft", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def _apply(ns: str, lines: Sequence[str]) -> float:
    """Seconds ``ip netns exec NS nft -f FILE`` took; ReferenceError_ with nft's complaint if it failed."""
    with tempfile.NamedTemporaryFile("w", prefix="kproxy-ref-", suffix=".nft", delete=False) as f:
        f.write("\n".join(lines) + "\n")
        path = f.name
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "-f", path], capture_output=True, text=True, timeout=NFT_TIMEOUT
        )
        elapsed = time.perf_counter() - t0
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise ReferenceError_(f"nft -f of the reference failed: {proc.stderr.strip()[-1500:]}")
    return elapsed


def _cache_state(n_services: int, n_endpoints: int) -> tuple[ServiceCache, Any]:
    cache = ServiceCache(node_name="node-1", ip_families=(IPFamily.V4,))
    for svc in synthetic.services(n_services):
        cache.upsert_service(svc)
    for eps in synthetic.endpoint_slices(n_services, n_endpoints):
        cache.upsert_slice(eps)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, changes = cache.snapshot()
    cache.commit(changes, failed=())
    return cache, state


def run_reference(n_services: int, n_endpoints: int, repeat: int = 5, layout: str = NAME) -> ReferenceBench:
    """Render upstream's layout for the synthetic state the sync bench uses and time it in a namespace of its own
    (``kpb-<pid>``, removed afterwards). Changes are the sync bench's: service ``1 + (r * 7919) % N`` gets variant
    ``r + 1`` of its slice (its last endpoint moves)."""
    if layout != NAME:
        raise ReferenceError_(f"unknown reference {layout!r}: choose one of {', '.join(REFERENCES)}")
    if os.geteuid() != 0:
        raise ReferenceError_("the reference needs root (it creates a network namespace)")
    out = ReferenceBench(layout=layout, services=n_services, endpoints=n_endpoints, repeat=repeat)
    out.nft_version = _nft_version()
    cache, state = _cache_state(n_services, n_endpoints)
    counts = Counts()
    t0 = time.perf_counter()
    lines = render_full(state, counts)
    out.render_s = time.perf_counter() - t0
    out.chains, out.rules, out.elements, out.skipped, out.lines = (
        counts.chains,
        counts.rules,
        counts.elements,
        counts.skipped,
        len(lines),
    )
    ns = f"{NETNS_PREFIX}{os.getpid()}"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        out.full_s = _apply(ns, lines)
        del lines
        cleanups: list[float] = []
        for r in range(repeat):
            i = 1 + (r * 7919) % n_services
            old = {sp.name: sp for sp in state}
            cache.upsert_slice(synthetic.endpoint_slice(i, n_endpoints, variant=r + 1))
            state, changes = cache.snapshot()
            cache.commit(changes, failed=())
            tx: list[str] = []
            later: list[str] = []
            for spn in changes.services:
                new_sp, old_sp = state.get(spn, IPFamily.V4), old.get(spn)
                if new_sp is not None and old_sp is not None:
                    a, b = render_partial(old_sp, new_sp)
                    tx += a
                    later += b
            out.partial_runs.append(_apply(ns, tx))
            if later:
                cleanups.append(_apply(ns, later))
        out.partial_s = statistics.median(out.partial_runs) if out.partial_runs else 0.0
        out.partial_cleanup_s = statistics.median(cleanups) if cleanups else 0.0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=120)
    return out
