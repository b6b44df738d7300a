"""The soak's reference model: from the API's Services and EndpointSlices to what each service address must do.

A small, independent reading of the semantics the soak's churn uses (``kproxy.soak.churn``), written from the
behavioural spec and not from kproxy's cache, so that comparing it with real packets is a comparison with something
other than kproxy itself. For every service port and address family the model says which addresses exist (the
ClusterIP, and the NodePort on every node address when the type is NodePort) and, for a client on a given node,
whether a connection there must be answered (and by which pod addresses and target ports), rejected or dropped:

* a Service counts when it has a ClusterIP of the family and is of type ClusterIP or NodePort; a port is valid when
  its name is a DNS label (or absent on a one-port service), its number is 1..65535 and its protocol TCP, UDP or
  SCTP; a Service with an invalid port is rejected whole (the churn's bad Services have one port, so "the port" and
  "the Service" cannot be told apart here);
* its endpoints are those of every EndpointSlice labelled with its name whose addressType is the family: each
  address that is a valid address of that family, with the slice's port of the same name and protocol, counted once,
  used when ``conditions.ready`` is not false (the churn never writes terminating endpoints);
* no usable endpoint at all: every address of the port rejects; otherwise the ClusterIP answers from the usable
  endpoints, or with internalTrafficPolicy Local from those on the client's node, and drops when there are none
  there; a NodePort (externalTrafficPolicy Cluster) answers from every usable endpoint;
* what the model does not cover (another type, an externalTrafficPolicy Local, externalIPs, load-balancer IPs,
  a NodePort the API did not allocate) is listed in ``Model.outside`` and never checked, rather than checked wrong.

Pure (no I/O, nothing of kproxy imported): tests/unit/test_soak_model.py checks it on its own.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROTOCOLS = ("TCP", "UDP", "SCTP")
FAMILIES = ("IPv4", "IPv6")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

ANSWER, REJECT, DROP = "answer", "reject", "drop"


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    node: str


@dataclass(frozen=True)
class Expect:
    """What one connection must meet: ``answer`` from one of ``endpoints`` (address, port), ``reject`` or ``drop``."""

    outcome: str
    endpoints: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class PortModel:
    """One service port in one address family."""

    service: str  # "ns/name"
    name: str  # the port's name ("" for an unnamed single port)
    protocol: str
    family: str
    cluster_ip: str
    port: int
    node_port: int | None
    internal_local: bool
    endpoints: tuple[Endpoint, ...]  # the usable ones, sorted

    @property
    def key(self) -> str:
        """``ns/name[:port]/PROTO``, the key kproxy's ``kernel_view`` and ``/rules`` use."""
        return f"{self.service}{':' + self.name if self.name else ''}/{self.protocol}"

    def cluster_ip_expect(self, client_node: str) -> Expect:
        """What a connection from a pod on ``client_node`` to the ClusterIP must meet."""
        if not self.endpoints:
            return Expect(REJECT)
        eps = [e for e in self.endpoints if not self.internal_local or e.node == client_node]
        if not eps:
            return Expect(DROP)
        return Expect(ANSWER, frozenset((e.address, e.port) for e in eps))

    def node_port_expect(self) -> Expect:
        """What a connection to a node address at the NodePort must meet (externalTrafficPolicy Cluster)."""
        if not self.endpoints:
            return Expect(REJECT)
        return Expect(ANSWER, frozenset((e.address, e.port) for e in self.endpoints))


@dataclass
class Model:
    """``ports``: (key, family) -> PortModel; ``rejected``/``outside``: ``ns/name`` of a Service -> why;
    ``cluster_ips``: ``ns/name`` -> every ClusterIP the API gave it (also for rejected Services)."""

    ports: dict[tuple[str, str], PortModel] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    outside: dict[str, str] = field(default_factory=dict)
    cluster_ips: dict[str, list[str]] = field(default_factory=dict)

    def of(self, service: str) -> list[PortModel]:
        return [pm for pm in self.ports.values() if pm.service == service]

    def keys(self, family: str) -> set[str]:
        return {key for key, fam in self.ports if fam == family}


def _family_of(text: Any) -> str | None:
    """``IPv4``/``IPv6`` for a valid single address, else None (a prefix, a bad octet, not a string)."""
    if not isinstance(text, str):
        return None
    try:
        return "IPv4" if ipaddress.ip_address(text).version == 4 else "IPv6"
    except ValueError:
        return None


def _port_problem(p: Mapping[str, Any], single: bool) -> str | None:
    name = p.get("name") or ""
    if not isinstance(name, str) or (name and not _DNS_LABEL.fullmatch(name)) or (not name and not single):
        return f"port name {name!r} is not a DNS label"
    port = p.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return f"port {port!r} is out of range"
    if (p.get("protocol") or "TCP") not in PROTOCOLS:
        return f"protocol {p.get('protocol')!r} is not TCP, UDP or SCTP"
    return None


def _outside(spec: Mapping[str, Any]) -> str | None:
    kind = spec.get("type") or "ClusterIP"
    if kind not in ("ClusterIP", "NodePort"):
        return f"type {kind}"
    if kind == "NodePort" and (spec.get("externalTrafficPolicy") or "Cluster") != "Cluster":
        return "externalTrafficPolicy Local"
    if spec.get("externalIPs") or spec.get("loadBalancerIP"):
        return "externalIPs"
    if kind == "NodePort" and not all(p.get("nodePort") for p in spec.get("ports") or []):
        return "a NodePort the API did not allocate"
    return None


def _endpoints(slices: Iterable[Mapping[str, Any]], family: str, name: str, protocol: str) -> tuple[Endpoint, ...]:
    """The usable endpoints of the port ``name``/``protocol`` in the service's slices of ``family``."""
    found: set[Endpoint] = set()
    for sl in slices:
        if sl.get("addressType") != family:
            continue
        ports = [
            p
            for p in sl.get("ports") or []
            if (p.get("name") or "") == name and (p.get("protocol") or "TCP") == protocol
        ]
        if not ports or not isinstance(ports[0].get("port"), int):
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            node = str(ep.get("nodeName") or "")
            for addr in (ep.get("addresses") or [])[:1]:  # the first address is the endpoint's, as upstream
                if _family_of(addr) == family:
                    found.add(Endpoint(addr, int(ports[0]["port"]), node))
    return tuple(sorted(found, key=lambda e: (e.address, e.port)))


def build(
    services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]], *, namespace: str | None = None
) -> Model:
    """The model of every Service (of ``namespace`` when given) and its EndpointSlices."""
    by_service: dict[str, list[Mapping[str, Any]]] = {}
    for sl in slices:
        meta = sl.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if owner:
            by_service.setdefault(f"{meta.get('namespace')}/{owner}", []).append(sl)
    model = Model()
    for svc in services:
        meta = svc.get("metadata") or {}
        if namespace is not None and meta.get("namespace") != namespace:
            continue
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        spec = svc.get("spec") or {}
        ips = [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if _family_of(ip)]
        model.cluster_ips[key] = ips
        ports = list(spec.get("ports") or [])
        problems = [why for p in ports if (why := _port_problem(p, len(ports) == 1))]
        if problems or not ports:
            model.rejected[key] = problems[0] if problems else "no ports"
            continue
        why = _outside(spec)
        if why:
            model.outside[key] = why
            continue
        for ip in ips:
            family = _family_of(ip)
            assert family is not None
            for p in ports:
                proto = p.get("protocol") or "TCP"
                pm = PortModel(
                    service=key,
                    name=p.get("name") or "",
                    protocol=proto,
                    family=family,
                    cluster_ip=ip,
                    port=int(p["port"]),
                    node_port=int(p["nodePort"]) if spec.get("type") == "NodePort" else None,
                    internal_local=spec.get("internalTrafficPolicy") == "Local",
                    endpoints=_endpoints(by_service.get(key, []), family, p.get("name") or "", proto),
                )
                model.ports[(pm.key, family)] = pm
    return model
