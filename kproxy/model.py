"""The node-local data model every part of kproxy speaks.

Sources produce Kubernetes objects (plain JSON-shaped dicts); the cache (``kproxy.cache``) turns them into the
frozen values below; backends receive only these values and never read a Kubernetes object. Everything here is
immutable, slotted and hashable so that snapshots can be shared between threads without copying and compared
cheaply to find what changed.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import sys
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import FrozenInstanceError, dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class IPFamily(str, enum.Enum):
    """An IP family, spelled as Kubernetes spells it (``spec.ipFamilies``, ``addressType``)."""

    V4 = "IPv4"
    V6 = "IPv6"

    @classmethod
    def of(cls, ip: str) -> IPFamily:
        """The family of an address or CIDR string; raises ValueError on garbage."""
        text = ip.split("/", 1)[0]
        return cls.V6 if ipaddress.ip_address(text).version == 6 else cls.V4

    @property
    def label(self) -> str:
        """The ``ip_family`` label value upstream's metrics use."""
        return self.value


class Protocol(str, enum.Enum):
    """An L4 protocol as it appears in ``ServicePort.protocol``."""

    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def lowercase(self) -> str:
        return self.value.lower()


class Verdict(str, enum.Enum):
    """What a backend does with new traffic to one class of a service's addresses.

    Decided once, in the cache (``topology.py``), so every backend behaves the same:
    FORWARD when there are endpoints to send to; REJECT (TCP RST / ICMP port-unreachable, the client fails fast)
    when the service has no usable endpoints anywhere; DROP when the traffic policy is Local and this node has no
    local endpoint while others do (a load balancer's health check then fails and it retries elsewhere).
    """

    FORWARD = "forward"
    REJECT = "reject"
    DROP = "drop"


@dataclass(frozen=True, slots=True, order=True)
class NamespacedName:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """One port of one Service: upstream's ``ServicePortName`` (namespace/name:portName plus protocol).

    ``str()`` is upstream's ``String()`` (``ns/name:port``, ``:port`` omitted when the port is unnamed); backends
    that reproduce upstream's chain-name hashing feed ``str(spn) + protocol.lowercase`` to it.
    """

    namespace: str
    name: str
    port: str
    protocol: Protocol

    @property
    def service(self) -> NamespacedName:
        return NamespacedName(self.namespace, self.name)

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base


def endpoint_label(ip: str, port: int) -> str:
    """An endpoint as kproxy spells it everywhere (logs, ``describe``, counter labels): ``ip:port``, ``[ip]:port``
    for IPv6."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


_NO_HINTS: frozenset[str] = frozenset()
#: an endpoint's rarely read fields (terminating, zone, zone hints, node hints) in the common case
_PLAIN: tuple[bool, str | None, frozenset[str], frozenset[str]] = (False, None, _NO_HINTS, _NO_HINTS)


@functools.lru_cache(maxsize=4096)
def _rare_set(
    terminating: bool, zone: str | None, zone_hints: frozenset[str], node_hints: frozenset[str]
) -> tuple[bool, str | None, frozenset[str], frozenset[str]]:
    return (terminating, zone, zone_hints, node_hints)


def rare_fields(
    terminating: bool, zone: str | None, zone_hints: frozenset[str], node_hints: frozenset[str]
) -> tuple[bool, str | None, frozenset[str], frozenset[str]]:
    """One shared tuple per distinct combination (a cluster has few zones and hint sets): a bounded memo, equal
    values in, the first one out."""
    if not terminating and zone is None and not zone_hints and not node_hints:
        return _PLAIN
    return _rare_set(terminating, zone, zone_hints, node_hints)


class Endpoint:
    """One backend address of a service port, as merged from its EndpointSlices.

    ``is_local`` is decided by the cache (endpoint's ``nodeName`` equals this node's name).

    Frozen, slotted and hashable like the dataclasses here, with the same constructor, fields, equality and repr; a
    class of its own because it is the one value held a million times at 100,000 service ports x 10 endpoints: the
    fields read on every sync (address, port, ready, serving, node name, is_local) have slots of their own, the rarely
    read ones (terminating, zone, zone and node hints) sit in one tuple shared by every endpoint that has the same
    (``rare_fields``), so an endpoint is 7 slots, not 10 (24 bytes each)."""

    __slots__ = ("ip", "port", "ready", "serving", "node_name", "is_local", "_rare")
    __match_args__ = (
        "ip",
        "port",
        "ready",
        "serving",
        "terminating",
        "node_name",
        "zone",
        "is_local",
        "zone_hints",
        "node_hints",
    )

    ip: str
    port: int
    ready: bool
    serving: bool
    node_name: str | None
    is_local: bool
    _rare: tuple[bool, str | None, frozenset[str], frozenset[str]]

    def __init__(
        self,
        ip: str,
        port: int,
        ready: bool = True,
        serving: bool = True,
        terminating: bool = False,
        node_name: str | None = None,
        zone: str | None = None,
        is_local: bool = False,
        zone_hints: frozenset[str] = _NO_HINTS,
        node_hints: frozenset[str] = _NO_HINTS,
    ) -> None:
        _set_ip(self, ip)
        _set_port(self, port)
        _set_ready(self, ready)
        _set_serving(self, serving)
        _set_node(self, node_name)
        _set_local(self, is_local)
        _set_rare(self, rare_fields(terminating, zone, zone_hints, node_hints))

    @property
    def terminating(self) -> bool:
        return self._rare[0]

    @property
    def zone(self) -> str | None:
        return self._rare[1]

    @property
    def zone_hints(self) -> frozenset[str]:
        return self._rare[2]

    @property
    def node_hints(self) -> frozenset[str]:
        return self._rare[3]

    def with_port(self, port: int) -> Endpoint:
        """The same endpoint on another port."""
        return new_endpoint(self.ip, port, self.ready, self.serving, self.node_name, self.is_local, self._rare)

    def _key(self) -> tuple[object, ...]:
        return (self.ip, self.port, self.ready, self.serving, self.node_name, self.is_local, self._rare)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Endpoint:
            return NotImplemented
        return self is other or self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__match_args__)
        return f"Endpoint({fields})"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        return (Endpoint, tuple(getattr(self, name) for name in self.__match_args__))

    @property
    def family(self) -> IPFamily:
        return IPFamily.V6 if ":" in self.ip else IPFamily.V4

    def __str__(self) -> str:
        return endpoint_label(self.ip, self.port)


_ep_new = object.__new__
_set_ip, _set_port, _set_ready, _set_serving, _set_node, _set_local, _set_rare = (
    getattr(Endpoint, name).__set__ for name in Endpoint.__slots__
)


def new_endpoint(
    ip: str,
    port: int,
    ready: bool,
    serving: bool,
    node_name: str | None,
    is_local: bool,
    rare: tuple[bool, str | None, frozenset[str], frozenset[str]],
) -> Endpoint:
    """``Endpoint(...)`` without the keyword handling, for the parsers' hot path (once per endpoint of a list):
    ``rare`` from ``rare_fields``."""
    ep: Endpoint = _ep_new(Endpoint)
    _set_ip(ep, ip)
    _set_port(ep, port)
    _set_ready(ep, ready)
    _set_serving(ep, serving)
    _set_node(ep, node_name)
    _set_local(ep, is_local)
    _set_rare(ep, rare)
    return ep


DEFAULT_AFFINITY_TIMEOUT = 10800  # seconds; upstream's default for sessionAffinityConfig.clientIP.timeoutSeconds


@dataclass(frozen=True, slots=True)
class ServicePort:
    """The node-local truth for one service port in one IP family: addresses, policies and chosen endpoints.

    A dual-stack Service yields two of these (one per family) with the same ``name``. Endpoints are already
    chosen for this node (``topology.categorize_endpoints``): a backend forwards internal traffic (ClusterIP) to
    ``internal_endpoints`` and external traffic (NodePort, externalIPs, load-balancer IPs) to
    ``external_endpoints``, and applies ``internal_verdict`` / ``external_verdict`` when those are empty.
    ``cluster_endpoints`` stays available for upstream's short-circuit: traffic from a local pod or from the node
    itself to an external address of an externalTrafficPolicy=Local service uses the cluster set.
    """

    name: ServicePortName
    family: IPFamily
    cluster_ip: str
    port: int
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    affinity_timeout: int = 0  # seconds of ClientIP affinity; 0 = none
    external_policy_local: bool = False
    internal_policy_local: bool = False
    health_check_node_port: int = 0
    cluster_endpoints: tuple[Endpoint, ...] = ()
    local_endpoints: tuple[Endpoint, ...] = ()
    has_any_endpoints: bool = False
    #: every serving endpoint of the port, before traffic policy and topology choose: what existing flows may
    #: still legitimately reach (the UDP conntrack reconciler keeps entries to these, as upstream does)
    serving_endpoints: tuple[Endpoint, ...] = ()
    #: the Service's metadata.creationTimestamp (RFC 3339, so text order is time order; "" when unknown): the older
    #: of two services claiming one address wins it when nobody holds it yet (``kproxy.admission``)
    created: str = ""

    @property
    def protocol(self) -> Protocol:
        return self.name.protocol

    @property
    def has_external_addresses(self) -> bool:
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def internal_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local_endpoints if self.internal_policy_local else self.cluster_endpoints

    @property
    def external_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local_endpoints if self.external_policy_local else self.cluster_endpoints

    @property
    def internal_verdict(self) -> Verdict:
        if self.internal_endpoints:
            return Verdict.FORWARD
        return Verdict.DROP if self.has_any_endpoints else Verdict.REJECT

    @property
    def external_verdict(self) -> Verdict:
        if self.external_endpoints:
            return Verdict.FORWARD
        return Verdict.DROP if self.has_any_endpoints else Verdict.REJECT

    @property
    def addresses(self) -> tuple[str, ...]:
        """ClusterIP, externalIPs and load-balancer IPs (node ports are addressed by the node's own IPs)."""
        return (self.cluster_ip, *self.external_ips, *self.load_balancer_ips)


class Overlaid(Mapping[K, V], Generic[K, V]):
    """An immutable mapping made of a ``base`` dict and an ``overlay`` of what changed since (``None``: removed),
    neither of which anyone mutates after: a snapshot that costs what changed, not the table (``ServiceCache``
    publishes one per family per snapshot; kproxy.cache says when it starts a new base).

    A lookup asks the overlay, then the base. Iteration, ``keys``/``items``/``values`` and equality read the merged
    dict, built on first use and kept (a full sync reads every entry anyway: one C-level copy of the base).
    """

    __slots__ = ("_base", "_len", "_merged", "_overlay")

    def __init__(self, base: Mapping[K, V], overlay: Mapping[K, V | None], length: int) -> None:
        self._base, self._overlay, self._len = base, overlay, length
        self._merged: dict[K, V] | None = None

    def __getitem__(self, key: K) -> V:
        if key in self._overlay:
            value = self._overlay[key]
            if value is None:
                raise KeyError(key)
            return value
        return self._base[key]

    def get(self, key: K, default: Any = None) -> Any:
        if key in self._overlay:
            value = self._overlay[key]
            return default if value is None else value
        return self._base.get(key, default)

    def __contains__(self, key: object) -> bool:
        if key in self._overlay:
            return self._overlay[key] is not None  # type: ignore[index]
        return key in self._base

    def __len__(self) -> int:
        return self._len

    def merged(self) -> Mapping[K, V]:
        """Every entry in one dict (built once; never mutated)."""
        merged = self._merged
        if merged is None:
            merged = dict(self._base)  # a dict's copy reuses its stored hashes: C speed
            for key, value in self._overlay.items():
                if value is None:
                    merged.pop(key, None)
                else:
                    merged[key] = value
            self._merged = merged
        return merged

    def __iter__(self) -> Iterator[K]:
        return iter(self.merged())

    def keys(self) -> KeysView[K]:
        return self.merged().keys()

    def items(self) -> ItemsView[K, V]:
        return self.merged().items()

    def values(self) -> ValuesView[V]:
        return self.merged().values()

    def __repr__(self) -> str:
        return f"Overlaid({dict(self.merged())!r})"


def _empty_labels() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What kproxy needs to know about its own Node object."""

    name: str
    labels: Mapping[str, str] = field(default_factory=_empty_labels)
    zone: str | None = None
    pod_cidrs: tuple[str, ...] = ()
    addresses: tuple[str, ...] = ()  # status.addresses of type InternalIP / ExternalIP
    eligible: bool = True  # False while the Node is being deleted or tainted ToBeDeletedByClusterAutoscaler

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.labels.items())), self.zone, self.pod_cidrs, self.eligible))


@dataclass(frozen=True, slots=True)
class ProxyState:
    """A consistent snapshot of everything this node must program, per IP family.

    ``services[family][spn]`` is the ServicePort for that family; a family with no services maps to an empty
    mapping. ``generation`` grows with every change the cache absorbed.
    """

    services: Mapping[IPFamily, Mapping[ServicePortName, ServicePort]]
    node: NodeInfo
    generation: int = 0

    def family(self, family: IPFamily) -> Mapping[ServicePortName, ServicePort]:
        return self.services.get(family, MappingProxyType({}))

    def __iter__(self) -> Iterator[ServicePort]:
        for fam in (IPFamily.V4, IPFamily.V6):
            yield from self.family(fam).values()

    def __len__(self) -> int:
        return sum(len(m) for m in self.services.values())

    def get(self, spn: ServicePortName, family: IPFamily) -> ServicePort | None:
        return self.family(family).get(spn)


@dataclass(frozen=True, slots=True)
class Changes:
    """What must be rewritten since the last *successful* sync.

    ``services`` names every service port that was added, changed or removed (in any family); a backend
    rewrites exactly those and may leave everything else alone, unless ``full`` asks for a complete rewrite
    (first sync, after a failure, after a node label change, periodically). ``trigger_times`` holds the
    EndpointSlice trigger times (``endpoints.kubernetes.io/last-change-trigger-time``, seconds since the epoch,
    with the slice's IP family) folded into this sync, for ``kubeproxy_network_programming_duration_seconds``.
    """

    full: bool
    services: frozenset[ServicePortName] = frozenset()
    generation: int = 0
    trigger_times: tuple[tuple[IPFamily, float], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.full and not self.services


def _no_counts() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class FamilySync:
    """What the sync of one IP family did, typed, so no module parses keys.

    ``full``: synced in full; ``written``: service ports written or removed by the batch that committed, with those a
    full sync found in the kernel unwanted and removed (``Applied.leftovers``; 0: nothing changed); ``services``:
    service ports the kernel holds for kproxy afterwards; ``kernel_refusals``: kernel transactions (restores) refused on
    the way, also in a sync that recovered by skipping services (upstream's restore-failure counters). ``rules`` /
    ``rules_last``: per table, the rules the mode holds and the rules its last sync wrote (upstream's
    ``sync_proxy_rules_iptables_total`` / ``_last`` gauges). ``figures``: the backend's own
    counts (map writes, elements added, transactions...), for ``/rules`` and the benchmarks."""

    full: bool = False
    written: int = 0
    services: int = 0
    kernel_refusals: int = 0
    rules: Mapping[str, int] = field(default_factory=_no_counts)
    rules_last: Mapping[str, int] = field(default_factory=_no_counts)
    figures: Mapping[str, int] = field(default_factory=_no_counts)


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What a backend reports after ``sync``.

    ``failed`` lists service ports whose rules the kernel refused: they were skipped, everything else was
    applied, and they stay dirty so the next sync retries them. ``error`` set with ``ok`` False means nothing
    (or not everything) was applied and the whole change must be retried, as a full sync. ``families`` says what
    each family's sync did (``FamilySync``). ``need_full_sync`` asks for a full resync soon (for example, the canary
    chain vanished). ``failed_families`` names the families whose sync failed when ``ok`` is False (empty: all of
    them).
    """

    ok: bool = True
    full: bool = False
    error: str | None = None
    failed: Mapping[ServicePortName, str] = field(default_factory=lambda: MappingProxyType({}))
    families: Mapping[IPFamily, FamilySync] = field(default_factory=lambda: MappingProxyType({}))
    timings: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))  # seconds: render, apply..
    need_full_sync: bool = False
    failed_families: frozenset[IPFamily] = frozenset()
    #: service ports the core's admission refused in whole or in part (an address another service holds, more than
    #: the mode can hold), as ``reason: message``: reported, not retried (the answer changes only with the objects)
    refused: Mapping[ServicePortName, str] = field(default_factory=lambda: MappingProxyType({}))

    def family(self, family: IPFamily) -> FamilySync:
        """What ``family``'s sync did (an empty ``FamilySync`` when the backend said nothing of it)."""
        return self.families.get(family) or _NOTHING


_NOTHING = FamilySync()


#: why the core refuses (part of) a service port before rendering it (``kproxy.admission``; the ``reason`` label of
#: ``kproxy_service_ports_refused`` and the prefix of each ``SyncResult.refused`` text)
REFUSAL_REASONS = ("address-conflict", "capacity")


def parse_ip(text: str) -> str:
    """Canonical text of an IP address (``::ffff:0:1`` style compression for v6); ValueError on garbage."""
    return str(ipaddress.ip_address(text))


def shared_text(text: str) -> str:
    """One string object for a name many objects repeat (namespaces, service, node, zone and port names): a list's
    JSON gives every occurrence its own, 50 to 100 bytes each. Interned strings go when the last user drops them."""
    return sys.intern(text) if type(text) is str else text  # a str subclass cannot be interned
