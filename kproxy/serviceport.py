"""What a Service means for the proxy: its ServicePort templates, one per port and IP family, or why it is refused.

Upstream's ``pkg/proxy/serviceport.go`` (``newBaseServiceInfo``) and the skip rules of ``ShouldSkipService``: a
Service object, exactly as the API returns it, is validated field by field (``kproxy.validation``; one bad field
rejects the object with a ValueError naming it) and reduced to ``ServicePort`` values whose endpoints are not yet
filled in. ``with_endpoints`` completes a template once ``kproxy.topology`` has chosen the endpoints. Nothing here
knows what changed: that is ``kproxy.cache``'s part (upstream's ``servicechangetracker.go``).

Pure; imports ``objects``, ``topology``, ``validation`` and ``model``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kproxy import validation as v
from kproxy.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
    shared_text,
)
from kproxy.objects import LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME, NAMESPACES, Ignored
from kproxy.topology import Categorized

_SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
_POLICIES = ("Cluster", "Local")
_MAX_AFFINITY_TIMEOUT = 86400


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ServiceInfo:
    """A Service reduced to its name and its ServicePort templates (one per port and family).

    The cache swaps ``ports`` for the completed ServicePorts once it has filled in their endpoints, so a port is not
    held twice (a template and its completed copy, ~170 bytes each); only the template's fields are read from them
    (``with_endpoints``, ``as_template``). ``==`` compares those fields (``same_template``): a Service listed again
    unchanged is no change, whichever form is held."""

    key: NamespacedName
    ports: tuple[ServicePort, ...]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ServiceInfo):
            return NotImplemented
        return (
            self.key == other.key
            and len(self.ports) == len(other.ports)
            and all(map(same_template, self.ports, other.ports))
        )

    def __hash__(self) -> int:
        return hash(self.key)


def parse_service(
    obj: Mapping[str, Any], families: Sequence[IPFamily], proxy_name: str
) -> tuple[NamespacedName, ServiceInfo]:
    """A Service object into its ServicePort templates; ``Ignored`` when it is not ours, ValueError when bad.

    The steps run in the order below, so the first bad field met is the one named."""
    obj = v.mapping(obj, "Service")
    meta = v.mapping(obj.get("metadata"), "metadata")
    key = _identity(meta, proxy_name)
    spec = v.mapping(obj.get("spec"), "spec")
    svc_type = v.one_of(spec.get("type"), _SERVICE_TYPES, "spec.type", "ClusterIP")
    if svc_type == "ExternalName":
        raise Ignored("type ExternalName")
    cluster_ips = _cluster_ips(spec)
    ports = _ports(spec)
    external_ips = [
        v.ip_address(x, f"spec.externalIPs[{i}]")
        for i, x in enumerate(v.optional_sequence(spec.get("externalIPs"), "spec.externalIPs"))
    ]
    affinity_timeout = _affinity_timeout(spec)
    etp = v.one_of(spec.get("externalTrafficPolicy"), _POLICIES, "spec.externalTrafficPolicy", "Cluster")
    itp = v.one_of(spec.get("internalTrafficPolicy"), _POLICIES, "spec.internalTrafficPolicy", "Cluster")
    hcnp = v.port_number(spec.get("healthCheckNodePort") or 0, "spec.healthCheckNodePort", allow_zero=True)
    # Only the spec field, as upstream's newBaseServiceInfo: the service.beta.kubernetes.io/load-balancer-source-ranges
    # annotation is for cloud load-balancer controllers, not for the proxy.
    raw_ranges: Sequence[Any] = v.optional_sequence(
        spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges"
    )
    source_ranges = [v.cidr(x, f"spec.loadBalancerSourceRanges[{i}]") for i, x in enumerate(raw_ranges)]
    lb_ips = _load_balancer_ips(obj)

    is_lb = svc_type == "LoadBalancer"
    has_node_ports = svc_type in ("NodePort", "LoadBalancer")
    # Upstream apiservice.ExternallyAccessible / ExternalPolicyLocal / NeedsHealthCheck (service-level).
    externally_accessible = has_node_ports or bool(external_ips)
    external_local = etp == "Local" and externally_accessible
    raw_created = meta.get("creationTimestamp")
    shape = _Shape(
        key=key,
        ports=ports,
        has_node_ports=has_node_ports,
        affinity_timeout=affinity_timeout,
        external_local=external_local,
        internal_local=itp == "Local",
        health_port=hcnp if is_lb and external_local else 0,
        created=raw_created[:64] if isinstance(raw_created, str) else "",
    )
    templates: list[ServicePort] = []
    for fam in families:
        cip = cluster_ips.get(fam)
        if cip is None:
            continue
        # most Services have none of these: no generator and no dict for an empty list
        ext = tuple(dict.fromkeys([ip for ip, f, _ in external_ips if f is fam])) if external_ips else ()
        lbs = tuple(dict.fromkeys([ip for ip, f, _ in lb_ips if f is fam])) if is_lb and lb_ips else ()
        src = tuple(dict.fromkeys([c for c, f in source_ranges if f is fam])) if source_ranges else ()
        templates.extend(_templates(shape, fam, cip, ext, lbs, src))
    return key, ServiceInfo(key, tuple(templates))


def _identity(meta: Mapping[str, Any], proxy_name: str) -> NamespacedName:
    """The Service's name, or ``Ignored`` when its labels give it to another proxy or make it headless."""
    namespace = NAMESPACES(meta.get("namespace"), "metadata.namespace")
    name = v.dns1035_label(meta.get("name"), "metadata.name")
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    if LABEL_SERVICE_PROXY_NAME in labels and not (proxy_name and labels[LABEL_SERVICE_PROXY_NAME] == proxy_name):
        raise Ignored(f"labelled {LABEL_SERVICE_PROXY_NAME}={v.printable(labels[LABEL_SERVICE_PROXY_NAME])}")
    if LABEL_HEADLESS in labels:
        raise Ignored(f"labelled {LABEL_HEADLESS}")
    # interned: the service's slices, its ports and the ledger's records name it too (``model.shared_text``)
    return NamespacedName(namespace, shared_text(name))


def _cluster_ips(spec: Mapping[str, Any]) -> dict[IPFamily, str]:
    """``spec.clusterIP`` / ``spec.clusterIPs``, at most one per family, consistent with ``spec.ipFamilies``;
    ``Ignored`` when headless. Insertion order is the Service's primary family first."""
    cluster_ip = v.optional_string(spec.get("clusterIP"), "spec.clusterIP")
    cluster_ips = [
        v.string(x, f"spec.clusterIPs[{i}]")
        for i, x in enumerate(v.optional_sequence(spec.get("clusterIPs"), "spec.clusterIPs"))
    ]
    first = cluster_ips[0] if cluster_ips else cluster_ip
    if first in ("", "None"):
        raise Ignored("headless (clusterIP None)")
    if len(cluster_ips) > 2:
        raise ValueError(f"spec.clusterIPs: {len(cluster_ips)} addresses, at most 2 (one per family)")
    by_family: dict[IPFamily, str] = {}
    for i, raw in enumerate(cluster_ips or [cluster_ip]):
        what = f"spec.clusterIPs[{i}]" if cluster_ips else "spec.clusterIP"
        text, fam, _ = v.ip_address(raw, what)
        if fam in by_family:
            raise ValueError(f"spec.clusterIPs: two {fam.value} addresses ({by_family[fam]} and {text})")
        by_family[fam] = text
    ordered_families = list(by_family)
    # the same text as clusterIPs[0] (the API server's usual answer) is the same address: parsed once
    if (
        cluster_ip
        and cluster_ips
        and cluster_ip != cluster_ips[0]
        and v.ip_address(cluster_ip, "spec.clusterIP")[0] != by_family[ordered_families[0]]
    ):
        raise ValueError(f"spec.clusterIP {cluster_ip!r} differs from spec.clusterIPs[0] {cluster_ips[0]!r}")
    _check_ip_families(spec, ordered_families)
    return by_family


def _check_ip_families(spec: Mapping[str, Any], ordered_families: Sequence[IPFamily]) -> None:
    """``spec.ipFamilies``: no family twice, and each in the position of its cluster IP."""
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


_PORT_FIELDS = ("name", "protocol", "port", "nodePort")  # what _checked_ports reads of a port


def _ports(spec: Mapping[str, Any]) -> tuple[tuple[str, Protocol, int, int], ...]:
    """``spec.ports`` as (name, protocol, port, nodePort): present, not empty, no name or port/protocol twice.
    Parsed once per distinct list of plain values (``validation.plain_key``): most Services repeat a few."""
    raw_ports = spec.get("ports")
    if raw_ports is None:
        raise ValueError("spec.ports: missing")
    raw_ports = v.sequence(raw_ports, "spec.ports")
    if not raw_ports:
        raise ValueError("spec.ports: empty")
    key = v.plain_key(raw_ports, _PORT_FIELDS)
    return _checked_ports(raw_ports) if key is None else _known_ports(key)


# bounded (input decides what goes in); only accepted lists are kept (a rejection raises, and is not cached), and
# an accepted one holds short names and port numbers only
@functools.lru_cache(maxsize=4096)
def _known_ports(key: tuple[tuple[Any, ...], ...]) -> tuple[tuple[str, Protocol, int, int], ...]:
    return _checked_ports(v.from_key(key, _PORT_FIELDS))


def _checked_ports(raw_ports: Sequence[Any]) -> tuple[tuple[str, Protocol, int, int], ...]:
    ports: list[tuple[str, Protocol, int, int]] = []
    names: set[str] = set()
    numbers: set[tuple[int, Protocol]] = set()
    for i, raw in enumerate(raw_ports):
        what = f"spec.ports[{i}]"
        p = v.mapping(raw, what)
        pname = shared_text(v.port_name(p.get("name"), f"{what}.name"))
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
    return tuple(ports)


def _affinity_timeout(spec: Mapping[str, Any]) -> int:
    """The ClientIP affinity's timeout in seconds (upstream's default when unset), 0 without affinity."""
    affinity = v.one_of(spec.get("sessionAffinity"), ("None", "ClientIP"), "spec.sessionAffinity", "None")
    if affinity != "ClientIP":
        return 0
    config = v.optional_mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
    client = v.optional_mapping(config.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
    timeout = client.get("timeoutSeconds")
    if timeout is None:
        return DEFAULT_AFFINITY_TIMEOUT
    affinity_timeout = v.integer(timeout, "spec.sessionAffinityConfig.clientIP.timeoutSeconds")
    if not 0 < affinity_timeout <= _MAX_AFFINITY_TIMEOUT:
        raise ValueError(
            f"spec.sessionAffinityConfig.clientIP.timeoutSeconds: {affinity_timeout} not in 1..{_MAX_AFFINITY_TIMEOUT}"
        )
    return affinity_timeout


def _load_balancer_ips(obj: Mapping[str, Any]) -> list[tuple[str, IPFamily, int]]:
    """``status.loadBalancer.ingress`` addresses this node captures (ipMode VIP)."""
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
    return lb_ips


class _Shape(NamedTuple):
    """What every template of one Service shares, whatever the family (a tuple: built once per Service, where a
    frozen dataclass's ``__init__`` cost several times as much)."""

    key: NamespacedName
    ports: tuple[tuple[str, Protocol, int, int], ...]
    has_node_ports: bool
    affinity_timeout: int
    external_local: bool
    internal_local: bool
    health_port: int
    created: str


def _templates(
    shape: _Shape, fam: IPFamily, cip: str, ext: tuple[str, ...], lbs: tuple[str, ...], src: tuple[str, ...]
) -> list[ServicePort]:
    """One template per port of the Service, in family ``fam``: ``ServicePort(...)`` with no endpoints, built
    through the slots' descriptors as ``with_endpoints`` builds its copies (once per service port of a list; the
    frozen ``__init__``'s ``object.__setattr__`` by name was most of a template's cost). The result equals what the
    constructor gives (tests/unit/test_cache_absorb.py)."""
    (s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11) = _SP_TEMPLATE
    namespace, name = shape.key.namespace, shape.key.name
    out = []
    for pname, proto, num, node_port in shape.ports:
        sp = _sp_new(ServicePort)
        s0(sp, _new_port_name(namespace, name, pname, proto))
        s1(sp, fam)
        s2(sp, cip)
        s3(sp, num)
        s4(sp, node_port if shape.has_node_ports else 0)
        s5(sp, ext)
        s6(sp, lbs)
        s7(sp, src)
        s8(sp, shape.affinity_timeout)
        s9(sp, shape.external_local)
        s10(sp, shape.internal_local)
        s11(sp, shape.health_port)
        _set_created(sp, shape.created)
        _set_cluster(sp, ())
        _set_local(sp, ())
        _set_has_any(sp, False)
        _set_serving(sp, ())
        out.append(sp)
    return out


_SERVICE_PORT_FIELDS = (
    "name",
    "family",
    "cluster_ip",
    "port",
    "node_port",
    "external_ips",
    "load_balancer_ips",
    "load_balancer_source_ranges",
    "affinity_timeout",
    "external_policy_local",
    "internal_policy_local",
    "health_check_node_port",
    "cluster_endpoints",
    "local_endpoints",
    "has_any_endpoints",
    "serving_endpoints",
    "created",
)
if tuple(f.name for f in dataclasses.fields(ServicePort)) != _SERVICE_PORT_FIELDS:  # pragma: no cover
    raise ImportError("kproxy.model.ServicePort's fields changed: update serviceport.with_endpoints")
_sp_new = ServicePort.__new__
_SP_SETTERS = tuple(getattr(ServicePort, f).__set__ for f in _SERVICE_PORT_FIELDS)
_SP_TEMPLATE = _SP_SETTERS[:12]  # the fields a template already holds
_set_cluster, _set_local, _set_has_any, _set_serving, _set_created = _SP_SETTERS[12:]
_spn_new = ServicePortName.__new__
_SPN_SETTERS = tuple(getattr(ServicePortName, f.name).__set__ for f in dataclasses.fields(ServicePortName))
if len(_SPN_SETTERS) != 4:  # pragma: no cover
    raise ImportError("kproxy.model.ServicePortName's fields changed: update serviceport._new_port_name")


def _new_port_name(namespace: str, name: str, port: str, protocol: Protocol) -> ServicePortName:
    """``ServicePortName(namespace, name, port, protocol)`` through the slots' descriptors (once per template)."""
    spn = _spn_new(ServicePortName)
    set_ns, set_name, set_port, set_proto = _SPN_SETTERS
    set_ns(spn, namespace)
    set_name(spn, name)
    set_port(spn, port)
    set_proto(spn, protocol)
    return spn


#: what a template holds: every field but the endpoint ones
_template_of = operator.attrgetter(*_SERVICE_PORT_FIELDS[:12], "created")
_NO_ENDPOINTS = Categorized()


def same_template(a: ServicePort, b: ServicePort) -> bool:
    """``a`` and ``b`` come from the same template: equal in every field but the endpoint ones."""
    return a is b or bool(_template_of(a) == _template_of(b))


def as_template(sp: ServicePort) -> ServicePort:
    """``sp`` without endpoints: ``sp`` itself when it has none."""
    if sp.has_any_endpoints or sp.cluster_endpoints or sp.local_endpoints or sp.serving_endpoints:
        return with_endpoints(sp, _NO_ENDPOINTS, ())
    return sp


def with_endpoints(t: ServicePort, cat: Categorized, eps: tuple[Endpoint, ...]) -> ServicePort:
    """The template ``t`` with its endpoints: ``dataclasses.replace(t, cluster_endpoints=..., ...)``, built through
    the slots' descriptors (this runs once per service port on a full rebuild, where ``replace``'s introspection and
    the frozen ``__init__``'s ``object.__setattr__`` by name were the costly part: docs/PERFORMANCE.md, "The core").
    The result equals what the constructor gives (tests/unit/test_cache_perf.py)."""
    sp = _sp_new(ServicePort)
    (s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11) = _SP_TEMPLATE
    s0(sp, t.name)
    s1(sp, t.family)
    s2(sp, t.cluster_ip)
    s3(sp, t.port)
    s4(sp, t.node_port)
    s5(sp, t.external_ips)
    s6(sp, t.load_balancer_ips)
    s7(sp, t.load_balancer_source_ranges)
    s8(sp, t.affinity_timeout)
    s9(sp, t.external_policy_local)
    s10(sp, t.internal_policy_local)
    s11(sp, t.health_check_node_port)
    _set_created(sp, t.created)
    _set_cluster(sp, cat.cluster)
    _set_local(sp, cat.local)
    _set_has_any(sp, cat.has_any)
    for e in eps:
        if not e.serving:
            _set_serving(sp, tuple([e for e in eps if e.serving]))
            break
    else:
        _set_serving(sp, eps)
    return sp
