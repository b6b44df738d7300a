"""The one shared cache: Services, EndpointSlices and this node's Node in; ProxyState snapshots and Changes out.

Sources (list/watch threads, the manifest folder, the lab's API stand-in) feed it Kubernetes objects as plain
JSON-shaped dicts, exactly as the API returns them. Every object is validated and parsed at once into compact
internal values (the raw dicts are never kept); a bad object is logged, reported by ``errors()`` and skipped on
its own, and an invalid *update* keeps the last good version of that object, so one broken manifest loses
nothing. Service semantics live here (which objects count, how slices merge and deduplicate, IP families,
policies, addresses), with endpoint selection delegated to ``kproxy.topology``.

The runner thread takes ``snapshot()``: it recomputes only the services touched since the previous snapshot,
marks dirty exactly the ``ServicePortName``s whose value changed, appeared or disappeared, and returns an
immutable ``ProxyState`` plus ``Changes``. Dirty entries carry the generation in which they became dirty and are
removed only by ``commit()`` after a successful sync, so a change that arrives during a sync stays dirty and a
failed sync loses nothing (the bug upstream had: kubernetes#112604).

Who uses it: sources write into it; the runner and daemon read snapshots, commit, and read ``stats()`` /
``errors()`` / ``node_info()`` for metrics, health and ``/rules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

from kproxy import validation as v
from kproxy.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    Changes,
    Endpoint,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)
from kproxy.topology import Categorized, categorize_endpoints, uses_cluster_endpoints, uses_local_endpoints

log = logging.getLogger(__name__)

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_ZONE = "topology.kubernetes.io/zone"
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"
SYNC_KINDS = ("services", "endpointslices", "nodes")

_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_POLICIES = ("Cluster", "Local")
_MAX_SLICE_ENDPOINTS = 1000  # the API server's limits for one EndpointSlice
_MAX_SLICE_PORTS = 100
_MAX_AFFINITY_TIMEOUT = 86400
_NO_HINTS: frozenset[str] = frozenset()
_GC_PAUSE_OVER = 500  # services recomputed in one snapshot


# --------------------------------------------------------------------------------------------------------------
# Parsed, compact forms of the objects (what the cache keeps instead of the raw dicts)


@dataclasses.dataclass(frozen=True, slots=True)
class _Service:
    """A Service reduced to its ServicePort templates (one per port and family, endpoints not yet filled in)."""

    ports: tuple[ServicePort, ...]


# One endpoint of a slice before a port number is attached: (sort key, ip, ready, serving, terminating, nodeName,
# zone, is_local, zone hints, node hints). A tuple, not an object: there are 100k of them at bench scale.
_RawEndpoint = tuple[int, str, bool, bool, bool, "str | None", "str | None", bool, frozenset[str], frozenset[str]]


@dataclasses.dataclass(slots=True, eq=False)
class _Slice:
    service: NamespacedName
    family: IPFamily
    ports: dict[tuple[str, Protocol], int]  # (port name, protocol) -> port number
    endpoints: tuple[_RawEndpoint, ...]  # sorted by address
    trigger_time: float | None
    warning: str | None
    memo: dict[int, tuple[Endpoint, ...]] = dataclasses.field(default_factory=dict)

    def same_as(self, other: _Slice) -> bool:
        return (
            self.service == other.service
            and self.family == other.family
            and self.ports == other.ports
            and self.endpoints == other.endpoints
        )

    def endpoints_for(self, port: int) -> tuple[Endpoint, ...]:
        """The slice's endpoints with ``port`` attached, built once: every snapshot shares the same objects."""
        eps = self.memo.get(port)
        if eps is None:
            eps = tuple(Endpoint(r[1], port, r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]) for r in self.endpoints)
            self.memo[port] = eps
        return eps


class _Ignored(Exception):
    """The object is valid but not ours (labels, headless, ExternalName, FQDN, another family)."""


def _clip(text: str) -> str:
    return text if len(text) <= 100 else f"{text[:80]}...({len(text)} chars)"


def _label(kind: str, namespace: str, name: str) -> str:
    return f"{kind} {_clip(namespace)}/{_clip(name)}"


def _object_label(kind: str, obj: Any) -> tuple[str, str, str]:
    """Best-effort (label, namespace, name) of an object for logs and ``errors()``, even when it is malformed."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    ns = name = "?"
    if isinstance(meta, Mapping):
        if isinstance(meta.get("namespace"), str):
            ns = meta["namespace"]
        if isinstance(meta.get("name"), str):
            name = meta["name"]
    return _label(kind, ns, name), ns, name


def _parse_time(text: str) -> float | None:
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def parse_service(
    obj: Mapping[str, Any], families: Sequence[IPFamily], proxy_name: str
) -> tuple[NamespacedName, _Service]:
    """A Service object into its ServicePort templates; ``_Ignored`` when it is not ours, ValueError when bad."""
    obj = v.mapping(obj, "Service")
    meta = v.mapping(obj.get("metadata"), "metadata")
    namespace = v.dns1123_label(meta.get("namespace"), "metadata.namespace")
    name = v.dns1035_label(meta.get("name"), "metadata.name")
    key = NamespacedName(namespace, name)
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    if LABEL_SERVICE_PROXY_NAME in labels and not (proxy_name and labels[LABEL_SERVICE_PROXY_NAME] == proxy_name):
        raise _Ignored(f"labelled {LABEL_SERVICE_PROXY_NAME}={labels[LABEL_SERVICE_PROXY_NAME]}")
    if LABEL_HEADLESS in labels:
        raise _Ignored(f"labelled {LABEL_HEADLESS}")

    spec = v.mapping(obj.get("spec"), "spec")
    svc_type = v.one_of(spec.get("type"), _SERVICE_TYPES, "spec.type", "ClusterIP")
    if svc_type == "ExternalName":
        raise _Ignored("type ExternalName")

    cluster_ip = v.optional_string(spec.get("clusterIP"), "spec.clusterIP")
    cluster_ips = [
        v.string(x, f"spec.clusterIPs[{i}]")
        for i, x in enumerate(v.optional_sequence(spec.get("clusterIPs"), "spec.clusterIPs"))
    ]
    first = cluster_ips[0] if cluster_ips else cluster_ip
    if first in ("", "None"):
        raise _Ignored("headless (clusterIP None)")
    if len(cluster_ips) > 2:
        raise ValueError(f"spec.clusterIPs: {len(cluster_ips)} addresses, at most 2 (one per family)")
    by_family: dict[IPFamily, str] = {}
    ordered_families: list[IPFamily] = []
    for i, raw in enumerate(cluster_ips or [cluster_ip]):
        what = f"spec.clusterIPs[{i}]" if cluster_ips else "spec.clusterIP"
        text, fam, _ = v.ip_address(raw, what)
        if fam in by_family:
            raise ValueError(f"spec.clusterIPs: two {fam.value} addresses ({by_family[fam]} and {text})")
        by_family[fam] = text
        ordered_families.append(fam)
    if cluster_ip and cluster_ips and v.ip_address(cluster_ip, "spec.clusterIP")[0] != by_family[ordered_families[0]]:
        raise ValueError(f"spec.clusterIP {cluster_ip!r} differs from spec.clusterIPs[0] {cluster_ips[0]!r}")
    seen_families: set[IPFamily] = set()
    for i, raw in enumerate(v.optional_sequence(spec.get("ipFamilies"), "spec.ipFamilies")):
        fam = v.ip_family(raw, f"spec.ipFamilies[{i}]")
        if fam in seen_families:
            raise ValueError(f"spec.ipFamilies: {fam.value} listed twice")
        seen_families.add(fam)
        if i < len(ordered_families) and ordered_families[i] != fam:
            raise ValueError(
                f"spec.ipFamilies[{i}] is {fam.value} but the cluster IP in that position is"
                f" {ordered_families[i].value}"
            )

    raw_ports = spec.get("ports")
    if raw_ports is None:
        raise ValueError("spec.ports: missing")
    raw_ports = v.sequence(raw_ports, "spec.ports")
    if not raw_ports:
        raise ValueError("spec.ports: empty")
    ports: list[tuple[str, Protocol, int, int]] = []
    names: set[str] = set()
    numbers: set[tuple[int, Protocol]] = set()
    for i, raw in enumerate(raw_ports):
        what = f"spec.ports[{i}]"
        p = v.mapping(raw, what)
        pname = v.port_name(p.get("name"), f"{what}.name")
        proto = v.protocol(p.get("protocol"), f"{what}.protocol")
        if p.get("port") is None:
            raise ValueError(f"{what}.port: missing")
        num = v.port_number(p.get("port"), f"{what}.port")
        node_port = v.port_number(p.get("nodePort") or 0, f"{what}.nodePort", allow_zero=True)
        if pname in names:
            raise ValueError(f"{what}.name: duplicate port name {pname!r}")
        if (num, proto) in numbers:
            raise ValueError(f"{what}: duplicate port {num}/{proto.value}")
        names.add(pname)
        numbers.add((num, proto))
        ports.append((pname, proto, num, node_port))

    external_ips = [
        v.ip_address(x, f"spec.externalIPs[{i}]")
        for i, x in enumerate(v.optional_sequence(spec.get("externalIPs"), "spec.externalIPs"))
    ]
    affinity = v.one_of(spec.get("sessionAffinity"), ("None", "ClientIP"), "spec.sessionAffinity", "None")
    affinity_timeout = 0
    if affinity == "ClientIP":
        config = v.optional_mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
        client = v.optional_mapping(config.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
        timeout = client.get("timeoutSeconds")
        affinity_timeout = DEFAULT_AFFINITY_TIMEOUT
        if timeout is not None:
            affinity_timeout = v.integer(timeout, "spec.sessionAffinityConfig.clientIP.timeoutSeconds")
            if not 0 < affinity_timeout <= _MAX_AFFINITY_TIMEOUT:
                raise ValueError(
                    f"spec.sessionAffinityConfig.clientIP.timeoutSeconds: {affinity_timeout} not in"
                    f" 1..{_MAX_AFFINITY_TIMEOUT}"
                )
    etp = v.one_of(spec.get("externalTrafficPolicy"), _POLICIES, "spec.externalTrafficPolicy", "Cluster")
    itp = v.one_of(spec.get("internalTrafficPolicy"), _POLICIES, "spec.internalTrafficPolicy", "Cluster")
    hcnp = v.port_number(spec.get("healthCheckNodePort") or 0, "spec.healthCheckNodePort", allow_zero=True)

    # Only the spec field, as upstream's newBaseServiceInfo: the service.beta.kubernetes.io/load-balancer-source-ranges
    # annotation is for cloud load-balancer controllers, not for the proxy.
    raw_ranges: Sequence[Any] = v.optional_sequence(
        spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges"
    )
    source_ranges = [v.cidr(x, f"spec.loadBalancerSourceRanges[{i}]") for i, x in enumerate(raw_ranges)]

    lb_ips: list[tuple[str, IPFamily, int]] = []
    status = v.optional_mapping(obj.get("status"), "status")
    lb_status = v.optional_mapping(status.get("loadBalancer"), "status.loadBalancer")
    for i, raw in enumerate(v.optional_sequence(lb_status.get("ingress"), "status.loadBalancer.ingress")):
        what = f"status.loadBalancer.ingress[{i}]"
        ingress = v.mapping(raw, what)
        ip = v.optional_string(ingress.get("ip"), f"{what}.ip")
        mode = v.one_of(ingress.get("ipMode"), ("VIP", "Proxy"), f"{what}.ipMode", "VIP")
        if ip:
            parsed = v.ip_address(ip, f"{what}.ip")
            # ipMode Proxy: the load balancer itself proxies to the node, so the VIP must not be captured here.
            if mode == "VIP":
                lb_ips.append(parsed)

    is_lb = svc_type == "LoadBalancer"
    has_node_ports = svc_type in ("NodePort", "LoadBalancer")
    # Upstream apiservice.ExternallyAccessible / ExternalPolicyLocal / NeedsHealthCheck (service-level).
    externally_accessible = has_node_ports or bool(external_ips)
    external_local = etp == "Local" and externally_accessible
    internal_local = itp == "Local"
    health_port = hcnp if is_lb and external_local else 0

    templates: list[ServicePort] = []
    for fam in families:
        cip = by_family.get(fam)
        if cip is None:
            continue
        ext = tuple(dict.fromkeys(ip for ip, f, _ in external_ips if f is fam))
        lbs = tuple(dict.fromkeys(ip for ip, f, _ in lb_ips if f is fam)) if is_lb else ()
        src = tuple(dict.fromkeys(c for c, f in source_ranges if f is fam))
        for pname, proto, num, node_port in ports:
            templates.append(
                ServicePort(
                    name=ServicePortName(namespace, name, pname, proto),
                    family=fam,
                    cluster_ip=cip,
                    port=num,
                    node_port=node_port if has_node_ports else 0,
                    external_ips=ext,
                    load_balancer_ips=lbs,
                    load_balancer_source_ranges=src,
                    affinity_timeout=affinity_timeout,
                    external_policy_local=external_local,
                    internal_policy_local=internal_local,
                    health_check_node_port=health_port,
                )
            )
    return key, _Service(tuple(templates))


def parse_slice(
    obj: Mapping[str, Any], families: Sequence[IPFamily], node_name: str, since: float
) -> tuple[tuple[str, str], _Slice]:
    """An EndpointSlice into its compact form; ``_Ignored`` when it is not ours, ValueError when bad."""
    obj = v.mapping(obj, "EndpointSlice")
    meta = v.mapping(obj.get("metadata"), "metadata")
    namespace = v.dns1123_label(meta.get("namespace"), "metadata.namespace")
    name = v.dns1123_subdomain(meta.get("name"), "metadata.name")
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    service_name = labels.get(LABEL_SERVICE_NAME)
    if service_name is None:
        raise _Ignored(f"no {LABEL_SERVICE_NAME} label")
    v.dns1035_label(service_name, f"metadata.labels[{LABEL_SERVICE_NAME}]")
    address_type = v.string(obj.get("addressType"), "addressType")
    if address_type == "FQDN":
        raise _Ignored("addressType FQDN")
    family = v.ip_family(address_type, "addressType")
    if family not in families:
        raise _Ignored(f"addressType {family.value} is not served here")

    raw_ports = v.optional_sequence(obj.get("ports"), "ports")
    if len(raw_ports) > _MAX_SLICE_PORTS:
        raise ValueError(f"ports: {len(raw_ports)} entries, more than {_MAX_SLICE_PORTS}")
    ports: dict[tuple[str, Protocol], int] = {}
    for i, raw in enumerate(raw_ports):
        what = f"ports[{i}]"
        p = v.mapping(raw, what)
        pname = v.port_name(p.get("name"), f"{what}.name")
        proto = v.protocol(p.get("protocol"), f"{what}.protocol")
        if (pname, proto) in ports:
            raise ValueError(f"{what}: duplicate port {pname!r}/{proto.value}")
        if p.get("port") is None:
            continue  # "all ports": upstream's proxy has nothing to program for it either
        ports[(pname, proto)] = v.port_number(p.get("port"), f"{what}.port")

    raw_endpoints = v.optional_sequence(obj.get("endpoints"), "endpoints")
    if len(raw_endpoints) > _MAX_SLICE_ENDPOINTS:
        raise ValueError(f"endpoints: {len(raw_endpoints)} entries, more than {_MAX_SLICE_ENDPOINTS}")
    by_ip: dict[str, _RawEndpoint] = {}
    duplicates: list[str] = []
    for i, raw in enumerate(raw_endpoints):
        entry = _endpoint_fast(raw, family, node_name)
        if entry is None:
            entry = _endpoint_checked(raw, f"endpoints[{i}]", family, node_name)
        ip, is_local = entry[1], entry[7]
        if ip in by_ip:
            duplicates.append(f"endpoints[{i}]: duplicate address {ip} (counted once)")
            if not is_local:
                continue  # as upstream: of two copies, prefer the one that says it is local
        by_ip[ip] = entry

    trigger_time = None
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        stamp = annotations.get(ANNOTATION_TRIGGER_TIME)
        if isinstance(stamp, str):
            when = _parse_time(stamp)
            # Older than our start: the change was programmed by someone else (an earlier kproxy), not us.
            if when is not None and when > since:
                trigger_time = when

    endpoints = tuple(sorted(by_ip.values(), key=lambda r: r[0]))
    return (namespace, name), _Slice(
        service=NamespacedName(namespace, service_name),
        family=family,
        ports=ports,
        endpoints=endpoints,
        trigger_time=trigger_time,
        warning="; ".join(duplicates) or None,
    )


# Names and zones already validated: a cluster has few of them and every slice repeats them.
_known_node_names: set[str] = set()
_known_zones: set[str] = set()
_KNOWN_LIMIT = 100_000


def _endpoint_fast(raw: Any, family: IPFamily, node_name: str) -> _RawEndpoint | None:
    """The common, well-formed IPv4 endpoint without building a single message string; None: use the checked
    path (which gives the precise error, or parses the unusual-but-valid case)."""
    if type(raw) is not dict or family is not IPFamily.V4 or "hints" in raw:
        return None
    addresses = raw.get("addresses")
    if type(addresses) is not list or len(addresses) != 1 or type(addresses[0]) is not str:
        return None
    ip = addresses[0]
    try:
        sort_key = int.from_bytes(socket.inet_pton(socket.AF_INET, ip), "big")
    except OSError:
        return None
    cond = raw.get("conditions")
    if cond is None:
        cond = {}
    elif type(cond) is not dict:
        return None
    ready, serving, terminating = cond.get("ready"), cond.get("serving"), cond.get("terminating")
    if ready is None:
        ready = True
    elif ready is not True and ready is not False:
        return None
    if serving is None:  # upstream (endpointslicecache.go) and the v1 API: a missing serving condition is true
        serving = True
    elif serving is not True and serving is not False:
        return None
    if terminating is None:
        terminating = False
    elif terminating is not True and terminating is not False:
        return None
    ep_node = raw.get("nodeName")
    if ep_node is not None and (type(ep_node) is not str or ep_node not in _known_node_names):
        return None
    zone = raw.get("zone")
    if zone is not None and (type(zone) is not str or zone not in _known_zones):
        return None
    return (sort_key, ip, ready, serving, terminating, ep_node, zone, ep_node == node_name, _NO_HINTS, _NO_HINTS)


def _endpoint_checked(raw: Any, what: str, family: IPFamily, node_name: str) -> _RawEndpoint:
    ep = v.mapping(raw, what)
    addresses = v.sequence(ep.get("addresses"), f"{what}.addresses")
    if not addresses:
        raise ValueError(f"{what}.addresses: empty")
    parsed = [v.ip_address(a, f"{what}.addresses[{j}]") for j, a in enumerate(addresses)]
    for j, (text, fam, _) in enumerate(parsed):
        if fam is not family:
            raise ValueError(f"{what}.addresses[{j}]: {fam.value} address {text} in an {family.value} slice")
    ip, _, sort_key = parsed[0]
    cond = v.optional_mapping(ep.get("conditions"), f"{what}.conditions")
    ready_c = v.optional_bool(cond.get("ready"), f"{what}.conditions.ready")
    serving_c = v.optional_bool(cond.get("serving"), f"{what}.conditions.serving")
    terminating_c = v.optional_bool(cond.get("terminating"), f"{what}.conditions.terminating")
    ready = True if ready_c is None else ready_c
    serving = True if serving_c is None else serving_c
    terminating = False if terminating_c is None else terminating_c
    ep_node = ep.get("nodeName")
    if ep_node is not None:
        ep_node = v.dns1123_subdomain(ep_node, f"{what}.nodeName")
        if len(_known_node_names) < _KNOWN_LIMIT:
            _known_node_names.add(ep_node)
    zone = ep.get("zone")
    if zone is not None:
        zone = v.label_value(zone, f"{what}.zone")
        if len(_known_zones) < _KNOWN_LIMIT:
            _known_zones.add(zone)
    zone_hints, node_hints = _NO_HINTS, _NO_HINTS
    hints = ep.get("hints")
    if hints is not None:
        hints = v.mapping(hints, f"{what}.hints")
        zone_hints = _hint_names(hints.get("forZones"), f"{what}.hints.forZones")
        node_hints = _hint_names(hints.get("forNodes"), f"{what}.hints.forNodes")
    return (sort_key, ip, ready, serving, terminating, ep_node, zone, ep_node == node_name, zone_hints, node_hints)


def _hint_names(value: Any, what: str) -> frozenset[str]:
    names = []
    for i, raw in enumerate(v.optional_sequence(value, what)):
        hint = v.mapping(raw, f"{what}[{i}]")
        names.append(v.string(hint.get("name"), f"{what}[{i}].name"))
    return frozenset(names) if names else _NO_HINTS


def parse_node(obj: Mapping[str, Any]) -> NodeInfo:
    """A Node object into NodeInfo; ValueError when bad."""
    obj = v.mapping(obj, "Node")
    meta = v.mapping(obj.get("metadata"), "metadata")
    name = v.dns1123_subdomain(meta.get("name"), "metadata.name")
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    spec = v.optional_mapping(obj.get("spec"), "spec")
    raw_cidrs = v.optional_sequence(spec.get("podCIDRs"), "spec.podCIDRs")
    if not raw_cidrs and spec.get("podCIDR"):
        raw_cidrs = [spec.get("podCIDR")]
    pod_cidrs = tuple(v.cidr(c, f"spec.podCIDRs[{i}]")[0] for i, c in enumerate(raw_cidrs))
    eligible = not meta.get("deletionTimestamp")
    for i, raw in enumerate(v.optional_sequence(spec.get("taints"), "spec.taints")):
        taint = v.mapping(raw, f"spec.taints[{i}]")
        if v.optional_string(taint.get("key"), f"spec.taints[{i}].key") == TAINT_TO_BE_DELETED:
            eligible = False
    status = v.optional_mapping(obj.get("status"), "status")
    addresses = []
    for i, raw in enumerate(v.optional_sequence(status.get("addresses"), "status.addresses")):
        entry = v.mapping(raw, f"status.addresses[{i}]")
        if entry.get("type") in ("InternalIP", "ExternalIP"):
            addresses.append(v.ip_address(entry.get("address"), f"status.addresses[{i}].address")[0])
    return NodeInfo(
        name=name,
        labels=MappingProxyType(labels),
        zone=labels.get(LABEL_ZONE) or None,
        pod_cidrs=pod_cidrs,
        addresses=tuple(dict.fromkeys(addresses)),
        eligible=eligible,
    )


@contextlib.contextmanager
def _gc_paused(active: bool) -> Iterator[None]:
    """Hold off the cyclic garbage collector during a bulk rebuild or relist.

    Those allocate ~10 acyclic objects per endpoint while the process holds a large heap (at 10k services, the
    API client's list of objects too); the collector would walk that heap again and again for nothing, a third
    to a half of the time. Reference counting still frees everything; the collector resumes afterwards.
    """
    pause = active and gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause:
            gc.enable()


def _sort_key(ep: Endpoint) -> tuple[bytes, int]:
    fam = socket.AF_INET6 if ":" in ep.ip else socket.AF_INET
    return socket.inet_pton(fam, ep.ip), ep.port


# --------------------------------------------------------------------------------------------------------------


class ServiceCache:
    """Thread-safe (one lock) store of this node's view of Services and EndpointSlices; see the module docstring.

    Methods fed by sources may be called from any thread; ``snapshot``/``commit`` from the runner thread.
    ``on_change`` is called outside the lock after any accepted change that may need a sync, and once when the
    cache becomes ``ready``.

    Choices worth knowing:
    - ``Changes.full`` stays set until a full ``Changes`` is committed: the first snapshot, and every snapshot
      after a change of this node's labels (topology) or of its pod CIDRs / addresses (backends read those from
      ``ProxyState.node``). An eligibility change alone (deletion, autoscaler taint) needs no sync.
    - ``Changes.trigger_times`` holds every trigger time folded into a snapshot whose sync is not committed yet,
      so a failed sync's times are reported by the sync that finally programs them; only changes that altered
      some ServicePort count.
    - A slice port without ``name`` is matched as the unnamed port (upstream skips it; hand-written manifests
      omit it), a slice port without ``port`` is skipped, as upstream.
    - ``errors()`` also lists slices that were accepted but carried duplicate endpoints (counted once).
    """

    def __init__(
        self,
        node_name: str,
        *,
        service_proxy_name: str = "",
        ip_families: Sequence[IPFamily] = (IPFamily.V4, IPFamily.V6),
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._node_name = node_name
        self._proxy_name = service_proxy_name
        self._families = tuple(ip_families)
        self._on_change = on_change
        self._start = clock()  # slice trigger times older than this were programmed by someone else
        self._lock = threading.Lock()

        self._services: dict[NamespacedName, _Service] = {}
        self._slices: dict[NamespacedName, dict[str, _Slice]] = {}  # service -> slice name -> slice
        self._slice_owner: dict[tuple[str, str], NamespacedName] = {}  # (namespace, slice name) -> service
        self._node = NodeInfo(node_name)
        self._node_seen = False

        # What the last snapshot handed out, per family, and which (family, port) each service contributed.
        self._current: dict[IPFamily, dict[ServicePortName, ServicePort]] = {f: {} for f in IPFamily}
        self._views: dict[IPFamily, Mapping[ServicePortName, ServicePort]] = {f: MappingProxyType({}) for f in IPFamily}
        self._stale_views: set[IPFamily] = set()
        self._ports_of: dict[NamespacedName, tuple[tuple[IPFamily, ServicePortName], ...]] = {}

        self._generation = 0
        self._touched: set[NamespacedName] = set()
        self._touched_services: set[NamespacedName] = set()
        self._touched_endpoints: set[NamespacedName] = set()
        self._pending_triggers: dict[NamespacedName, list[tuple[IPFamily, float]]] = {}
        # (generation, family, wall time) of slice changes not yet committed
        self._triggers: list[tuple[int, IPFamily, float]] = []
        self._dirty: dict[ServicePortName, int] = {}  # name -> generation in which it became dirty
        self._full_owed: int | None = 0  # a full sync is owed for changes up to this generation

        self._synced: set[str] = set()
        self._errors: dict[str, str] = {}
        self._service_changes_total = 0
        self._endpoint_changes_total = 0
        self._endpoint_count = 0

    # ---------------------------------------------------------------------------------------------- sources

    def upsert_service(self, obj: Mapping[str, Any]) -> bool:
        accepted, changed = self._upsert_service(obj)
        if changed:
            self._notify()
        return accepted

    def delete_service(self, namespace: str, name: str) -> None:
        key = NamespacedName(namespace, name)
        with self._lock:
            self._errors.pop(_label("Service", namespace, name), None)
            changed = self._drop_service(key)
        if changed:
            self._notify()

    def replace_services(self, objs: Iterable[Mapping[str, Any]]) -> None:
        present: set[tuple[str, str]] = set()
        changed = False
        with _gc_paused(True):
            for obj in objs:
                _, ns, name = _object_label("Service", obj)
                present.add((ns, name))
                changed |= self._upsert_service(obj)[1]
        with self._lock:
            for key in [k for k in self._services if (k.namespace, k.name) not in present]:
                changed |= self._drop_service(key)
            self._forget_errors("Service", present)
            became_ready = self._mark_synced("services")
        if changed or became_ready:
            self._notify()

    def upsert_slice(self, obj: Mapping[str, Any]) -> bool:
        accepted, changed = self._upsert_slice(obj)
        if changed:
            self._notify()
        return accepted

    def delete_slice(self, namespace: str, name: str) -> None:
        with self._lock:
            self._errors.pop(_label("EndpointSlice", namespace, name), None)
            changed = self._drop_slice((namespace, name))
        if changed:
            self._notify()

    def replace_slices(self, objs: Iterable[Mapping[str, Any]]) -> None:
        present: set[tuple[str, str]] = set()
        changed = False
        with _gc_paused(True):
            for obj in objs:
                _, ns, name = _object_label("EndpointSlice", obj)
                present.add((ns, name))
                changed |= self._upsert_slice(obj)[1]
        with self._lock:
            for key in [k for k in self._slice_owner if k not in present]:
                changed |= self._drop_slice(key)
            self._forget_errors("EndpointSlice", present)
            became_ready = self._mark_synced("endpointslices")
        if changed or became_ready:
            self._notify()

    def set_node(self, obj: Mapping[str, Any] | None) -> None:
        """This node's Node object (others are ignored); None when it is absent.

        Upstream's node eligibility starts true and only a Node that is being deleted (or tainted for deletion)
        makes it false, so a Node that was seen and then vanished is ineligible, while one never seen (a manifest
        folder without a Node) leaves the node eligible."""
        label = f"Node {_clip(self._node_name)}"
        if obj is None:
            with self._lock:
                seen = self._node_seen
            node = NodeInfo(self._node_name, eligible=not seen)
        else:
            meta = obj.get("metadata") if isinstance(obj, Mapping) else None
            if isinstance(meta, Mapping) and isinstance(meta.get("name"), str) and meta["name"] != self._node_name:
                return
            try:
                node = parse_node(obj)
            except Exception as exc:  # one bad object must never take the cache down
                self._reject(label, exc)
                return
        with self._lock:
            self._errors.pop(label, None)
            self._node_seen = self._node_seen or obj is not None
            old, self._node = self._node, node
            resync = False
            if dict(old.labels) != dict(node.labels):
                # Topology labels (the zone) decide endpoint choice for every service.
                self._touched.update(self._services)
                self._touched.update(self._slices)
                resync = True
            if old.pod_cidrs != node.pod_cidrs or old.addresses != node.addresses:
                resync = True
            if resync:
                self._generation += 1
                self._full_owed = self._generation
        # Eligibility alone needs no resync, but whoever reports node health must hear of it.
        if resync or old.eligible != node.eligible:
            self._notify()

    def mark_synced(self, kind: str) -> None:
        if kind not in SYNC_KINDS:
            raise ValueError(f"mark_synced: unknown kind {kind!r}, expected one of {SYNC_KINDS}")
        with self._lock:
            became_ready = self._mark_synced(kind)
        if became_ready:
            self._notify()

    @property
    def ready(self) -> bool:
        """Both Services and EndpointSlices have been listed once (upstream writes no rules before that)."""
        with self._lock:
            return self._is_ready()

    # ---------------------------------------------------------------------------------------------- runner

    def snapshot(self, full: bool = False) -> tuple[ProxyState, Changes]:
        with self._lock:
            gen = self._generation
            with _gc_paused(len(self._touched) > _GC_PAUSE_OVER):
                for key in self._touched:
                    if self._recompute(key, gen):
                        for fam, when in self._pending_triggers.get(key, ()):
                            self._triggers.append((gen, fam, when))
            self._touched.clear()
            self._touched_services.clear()
            self._touched_endpoints.clear()
            self._pending_triggers.clear()
            for fam in self._stale_views:
                self._views[fam] = MappingProxyType(dict(self._current[fam]))
            self._stale_views.clear()
            state = ProxyState(services=MappingProxyType(dict(self._views)), node=self._node, generation=gen)
            changes = Changes(
                full=full or self._full_owed is not None,
                services=frozenset(self._dirty),
                generation=gen,
                trigger_times=tuple((fam, t) for _, fam, t in self._triggers),
            )
        return state, changes

    def commit(self, changes: Changes, failed: Collection[ServicePortName] = ()) -> None:
        """A sync of ``changes`` succeeded (except for ``failed``): forget what it applied, keep anything newer.
        ``failed`` services are dirty afterwards whatever they were before (a full sync rewrites services that did
        not change; one the kernel refused must be retried by the next partial sync, not the next full one)."""
        gen = changes.generation
        failed_set = set(failed)
        with self._lock:
            for spn in [s for s, g in self._dirty.items() if g <= gen and s not in failed_set]:
                del self._dirty[spn]
            for spn in failed_set:
                self._dirty.setdefault(spn, gen)
            self._triggers = [tr for tr in self._triggers if tr[0] > gen]
            if changes.full and self._full_owed is not None and self._full_owed <= gen:
                self._full_owed = None

    def node_info(self) -> NodeInfo:
        with self._lock:
            return self._node

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "service_changes_total": self._service_changes_total,
                "endpoint_changes_total": self._endpoint_changes_total,
                "service_changes_pending": len(self._touched_services),
                "endpoint_changes_pending": len(self._touched_endpoints),
                "services": len(self._services),
                "service_ports": sum(len(m) for m in self._current.values()),
                "endpoints": self._endpoint_count,
                "invalid_objects": len(self._errors),
            }

    def errors(self) -> dict[str, str]:
        """``"Service ns/name"`` / ``"EndpointSlice ns/name"`` / ``"Node name"`` -> why the current version of
        that object was rejected (its last good version, if any, is still in use), or, for a slice accepted with
        duplicate endpoints, what was dropped."""
        with self._lock:
            return dict(self._errors)

    # ---------------------------------------------------------------------------------------------- internals

    def _notify(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # a broken callback must not break the source thread
                log.exception("on_change callback failed")

    def _reject(self, label: str, exc: BaseException) -> None:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        log.warning("%s rejected: %s", label, reason)
        with self._lock:
            self._errors[label] = reason

    def _forget_errors(self, kind: str, present: set[tuple[str, str]]) -> None:
        wanted = {_label(kind, ns, name) for ns, name in present}
        for label in [k for k in self._errors if k.startswith(kind + " ") and k not in wanted]:
            del self._errors[label]

    def _is_ready(self) -> bool:
        return "services" in self._synced and "endpointslices" in self._synced

    def _mark_synced(self, kind: str) -> bool:
        was = self._is_ready()
        self._synced.add(kind)
        return not was and self._is_ready()

    def _touch(self, key: NamespacedName, endpoints: bool, when: tuple[IPFamily, float] | None) -> None:
        self._generation += 1
        self._touched.add(key)
        if endpoints:
            self._touched_endpoints.add(key)
            self._endpoint_changes_total += 1
        else:
            self._touched_services.add(key)
            self._service_changes_total += 1
        if when is not None:
            self._pending_triggers.setdefault(key, []).append(when)

    def _upsert_service(self, obj: Mapping[str, Any]) -> tuple[bool, bool]:
        """(accepted, changed)."""
        try:
            key, svc = parse_service(obj, self._families, self._proxy_name)
        except _Ignored as why:
            label, ns, name = _object_label("Service", obj)
            key = NamespacedName(ns, name)
            log.debug("%s ignored: %s", label, why)
            with self._lock:
                self._errors.pop(label, None)
                changed = self._drop_service(key)
            return False, changed
        except Exception as exc:  # one bad object must never take the cache down
            self._reject(_object_label("Service", obj)[0], exc)
            return False, False
        with self._lock:
            if self._errors:
                self._errors.pop(_label("Service", key.namespace, key.name), None)
            if self._services.get(key) == svc:
                return True, False
            self._services[key] = svc
            self._touch(key, endpoints=False, when=None)  # as upstream, only slices carry trigger times
        return True, True

    def _drop_service(self, key: NamespacedName) -> bool:
        if self._services.pop(key, None) is None:
            return False
        self._touch(key, endpoints=False, when=None)
        return True

    def _upsert_slice(self, obj: Mapping[str, Any]) -> tuple[bool, bool]:
        try:
            skey, parsed = parse_slice(obj, self._families, self._node_name, self._start)
        except _Ignored as why:
            label, ns, name = _object_label("EndpointSlice", obj)
            log.debug("%s ignored: %s", label, why)
            with self._lock:
                self._errors.pop(label, None)
                changed = self._drop_slice((ns, name))
            return False, changed
        except Exception as exc:  # one bad object must never take the cache down
            self._reject(_object_label("EndpointSlice", obj)[0], exc)
            return False, False
        label = _label("EndpointSlice", *skey) if parsed.warning or self._errors else ""
        if parsed.warning:
            log.warning("%s: %s", label, parsed.warning)
        with self._lock:
            if parsed.warning:
                self._errors[label] = parsed.warning
            elif self._errors:
                self._errors.pop(label, None)
            owner = self._slice_owner.get(skey)
            if owner is not None:
                old = self._slices[owner][skey[1]]
                if old.same_as(parsed):
                    return True, False
                if owner != parsed.service:
                    self._drop_slice(skey)
                else:
                    self._endpoint_count -= len(old.endpoints)
            self._slices.setdefault(parsed.service, {})[skey[1]] = parsed
            self._slice_owner[skey] = parsed.service
            self._endpoint_count += len(parsed.endpoints)
            when = None if parsed.trigger_time is None else (parsed.family, parsed.trigger_time)
            self._touch(parsed.service, endpoints=True, when=when)
        return True, True

    def _drop_slice(self, skey: tuple[str, str]) -> bool:
        owner = self._slice_owner.pop(skey, None)
        if owner is None:
            return False
        slices = self._slices[owner]
        old = slices.pop(skey[1])
        if not slices:
            del self._slices[owner]
        self._endpoint_count -= len(old.endpoints)
        self._touch(owner, endpoints=True, when=None)
        return True

    def _recompute(self, key: NamespacedName, gen: int) -> bool:
        """Rebuild one service's ServicePorts; mark dirty those whose value changed. True if any did."""
        new: dict[tuple[IPFamily, ServicePortName], ServicePort] = {}
        svc = self._services.get(key)
        if svc is not None:
            by_name = self._slices.get(key)
            slices = [by_name[n] for n in sorted(by_name)] if by_name else []
            zone = self._node.zone
            for tmpl in svc.ports:
                eps = _merge(slices, tmpl)
                if eps:
                    has_external = tmpl.has_external_addresses
                    internal, external = tmpl.internal_policy_local, tmpl.external_policy_local
                    cat = categorize_endpoints(
                        eps,
                        uses_cluster=uses_cluster_endpoints(internal, external, has_external),
                        uses_local=uses_local_endpoints(internal, external, has_external),
                        node_name=self._node_name,
                        zone=zone,
                    )
                    tmpl = _with_endpoints(tmpl, cat, eps)
                new[(tmpl.family, tmpl.name)] = tmpl
        changed = False
        for fam, spn in self._ports_of.pop(key, ()):
            if (fam, spn) not in new:
                del self._current[fam][spn]
                self._dirty[spn] = gen
                self._stale_views.add(fam)
                changed = True
        for (fam, spn), sp in new.items():
            current = self._current[fam]
            if current.get(spn) != sp:
                current[spn] = sp
                self._dirty[spn] = gen
                self._stale_views.add(fam)
                changed = True
        if new:
            self._ports_of[key] = tuple(new)
        return changed


def _with_endpoints(t: ServicePort, cat: Categorized, eps: tuple[Endpoint, ...]) -> ServicePort:
    # Spelled out rather than dataclasses.replace: this runs once per service port on a full rebuild, and
    # replace's field introspection costs more than the rest of the rebuild together.
    return ServicePort(
        name=t.name,
        family=t.family,
        cluster_ip=t.cluster_ip,
        port=t.port,
        node_port=t.node_port,
        external_ips=t.external_ips,
        load_balancer_ips=t.load_balancer_ips,
        load_balancer_source_ranges=t.load_balancer_source_ranges,
        affinity_timeout=t.affinity_timeout,
        external_policy_local=t.external_policy_local,
        internal_policy_local=t.internal_policy_local,
        health_check_node_port=t.health_check_node_port,
        cluster_endpoints=cat.cluster,
        local_endpoints=cat.local,
        has_any_endpoints=cat.has_any,
        serving_endpoints=eps if all(e.serving for e in eps) else tuple(e for e in eps if e.serving),
    )


def _merge(slices: list[_Slice], tmpl: ServicePort) -> tuple[Endpoint, ...]:
    """The endpoints of one service port merged over all the service's slices of its family (sorted by name)."""
    want = (tmpl.name.port, tmpl.name.protocol)
    parts = []
    for sl in slices:
        if sl.family is not tmpl.family:
            continue
        num = sl.ports.get(want)
        if num is not None and sl.endpoints:
            parts.append(sl.endpoints_for(num))
    if not parts:
        return ()
    if len(parts) == 1:
        return parts[0]
    merged: dict[tuple[str, int], Endpoint] = {}
    for part in parts:
        for ep in part:
            k = (ep.ip, ep.port)
            # The same ip:port in two slices counts once; as upstream, prefer the copy that says it is local.
            if ep.is_local or k not in merged:
                merged[k] = ep
    return tuple(sorted(merged.values(), key=_sort_key))
