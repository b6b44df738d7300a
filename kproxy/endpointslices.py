"""What an EndpointSlice means for the proxy, and every slice of every service, merged per service port.

Upstream's ``pkg/proxy/endpointslicecache.go``: endpoints move between the slices of a service, so slices are kept
one by one (``EndpointSliceCache``, by service and slice name) and merged per service port when the service is
rebuilt (``merge_endpoints``: the same ip:port in two slices counts once, preferring the copy that says it is local).
``parse_slice`` validates a slice field by field (``kproxy.validation``) into a compact ``SliceInfo``; the common
well-formed IPv4 endpoint takes a fast path that builds no message string (it runs once per endpoint). Nothing
here knows what changed since the last sync: that is ``kproxy.cache``'s part (upstream's
``endpointschangetracker.go``).

``kproxy.cache``'s lock guards the ``EndpointSliceCache`` it owns (this module takes no lock).
Pure apart from that cache; imports ``objects``, ``validation`` and ``model``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import socket
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kproxy import validation as v
from kproxy.model import (
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    new_endpoint,
    rare_fields,
    shared_text,
)
from kproxy.objects import ANNOTATION_TRIGGER_TIME, LABEL_SERVICE_NAME, NAMESPACES, Ignored, parse_time

_MAX_SLICE_ENDPOINTS = 1000  # the API server's limits for one EndpointSlice
_MAX_SLICE_PORTS = 100
_NO_HINTS: frozenset[str] = frozenset()

SliceKey = tuple[str, str]  # (namespace, slice name)


# One endpoint of a slice as parsed, before a port number is attached: (sort key, ip, ready, serving, nodeName,
# is_local, the rarely read fields as ``model.rare_fields`` shares them). Only while a slice is parsed: a slice keeps
# Endpoint objects.
RawEndpoint = tuple[int, str, bool, bool, "str | None", bool, "tuple[bool, str | None, frozenset[str], frozenset[str]]"]

PortItems = tuple[tuple[tuple[str, Protocol], int], ...]


# One mapping per distinct port set (most slices of a cluster say ``http/TCP 8080``) and one frozenset per hint set,
# not one per slice or endpoint: bounded memos (input decides what goes in), equal values in, the first one out.
@functools.lru_cache(maxsize=4096)
def _port_set(items: PortItems) -> Mapping[tuple[str, Protocol], int]:
    return MappingProxyType(dict(items))


@functools.lru_cache(maxsize=4096)
def _hint_set(names: frozenset[str]) -> frozenset[str]:
    return names


@dataclasses.dataclass(slots=True, eq=False)
class SliceInfo:
    """An EndpointSlice reduced to what the proxy reads.

    ``name`` is the slice's own name (its namespace is the service's). ``endpoints`` are ``Endpoint`` objects
    sorted by address, carrying ``base_port`` (the lowest of the slice's port numbers, 0 without ports): the raw
    parse is not kept. The endpoints of another port of the slice are built once on first use (``endpoints_for``)
    and kept, so every snapshot shares the same objects."""

    service: NamespacedName
    name: str
    family: IPFamily
    ports: Mapping[tuple[str, Protocol], int]  # (port name, protocol) -> port number (shared, read-only)
    endpoints: tuple[Endpoint, ...]  # sorted by address, with base_port
    trigger_time: float | None
    warning: str | None
    base_port: int = 0
    memo: dict[int, tuple[Endpoint, ...]] | None = None

    def same_as(self, other: SliceInfo) -> bool:
        return (
            self.service == other.service
            and self.family == other.family
            and self.ports == other.ports
            and self.endpoints == other.endpoints
        )

    def endpoints_for(self, port: int) -> tuple[Endpoint, ...]:
        """The slice's endpoints with ``port`` attached, built once: every snapshot shares the same objects."""
        if port == self.base_port:
            return self.endpoints
        if self.memo is None:
            self.memo = {}
        eps = self.memo.get(port)
        if eps is None:
            eps = self.memo[port] = tuple([e.with_port(port) for e in self.endpoints])
        return eps


_PLAIN = rare_fields(False, None, _NO_HINTS, _NO_HINTS)


def _new_endpoint(r: RawEndpoint, port: int) -> Endpoint:
    """``Endpoint(...)`` of a parsed endpoint on ``port``, through ``model.new_endpoint`` (this runs once per endpoint
    of a full rebuild: docs/PERFORMANCE.md, "The core"). The object is the same: same class, same field values, same
    hash and equality (tests/unit/test_cache_perf.py compares them)."""
    return new_endpoint(r[1], port, r[2], r[3], r[4], r[5], r[6])


def parse_slice(
    obj: Mapping[str, Any], families: Sequence[IPFamily], node_name: str, since: float
) -> tuple[SliceKey, SliceInfo]:
    """An EndpointSlice into its compact form; ``Ignored`` when it is not ours, ValueError when bad."""
    obj = v.mapping(obj, "EndpointSlice")
    meta = v.mapping(obj.get("metadata"), "metadata")
    # names every slice repeats are interned: one string per namespace, service, node, zone and port name, not one
    # per object (a list's JSON gives each occurrence its own)
    namespace = NAMESPACES(meta.get("namespace"), "metadata.namespace")
    name = v.dns1123_subdomain(meta.get("name"), "metadata.name")
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    service_name = labels.get(LABEL_SERVICE_NAME)
    if service_name is None:
        raise Ignored(f"no {LABEL_SERVICE_NAME} label")
    service_name = shared_text(v.dns1035_label(service_name, f"metadata.labels[{LABEL_SERVICE_NAME}]"))
    address_type = v.string(obj.get("addressType"), "addressType")
    if address_type == "FQDN":
        raise Ignored("addressType FQDN")
    family = v.ip_family(address_type, "addressType")
    if family not in families:
        raise Ignored(f"addressType {family.value} is not served here")

    raw_ports = v.optional_sequence(obj.get("ports"), "ports")
    if len(raw_ports) > _MAX_SLICE_PORTS:
        raise ValueError(f"ports: {len(raw_ports)} entries, more than {_MAX_SLICE_PORTS}")
    key = v.plain_key(raw_ports, _PORT_FIELDS)
    shared_ports = _checked_ports(raw_ports) if key is None else _known_ports(key)
    # the shared mapping's numbers: one int object per distinct port set, not one per slice (a list's JSON gives
    # every slice its own 8080)
    base_port = min(shared_ports.values(), default=0)
    raw_endpoints = v.optional_sequence(obj.get("endpoints"), "endpoints")
    if len(raw_endpoints) > _MAX_SLICE_ENDPOINTS:
        raise ValueError(f"endpoints: {len(raw_endpoints)} entries, more than {_MAX_SLICE_ENDPOINTS}")
    endpoints, duplicates = _endpoints(raw_endpoints, family, node_name, base_port)

    trigger_time = None
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        stamp = annotations.get(ANNOTATION_TRIGGER_TIME)
        if isinstance(stamp, str):
            when = parse_time(stamp)
            # Older than our start: the change was programmed by someone else (an earlier kproxy), not us.
            if when is not None and when > since:
                trigger_time = when

    return (namespace, name), SliceInfo(
        service=NamespacedName(namespace, service_name),
        name=name,
        family=family,
        ports=shared_ports,
        endpoints=endpoints,
        trigger_time=trigger_time,
        warning="; ".join(duplicates) or None,
        base_port=base_port,
    )


_PORT_FIELDS = ("name", "protocol", "port")  # what _checked_ports reads of a port


# a slice's ports parsed once per distinct list of plain values (``validation.plain_key``): most slices of a cluster
# say ``http/TCP 8080``; bounded, and only accepted lists are kept (a rejection raises, and is not cached)
@functools.lru_cache(maxsize=4096)
def _known_ports(key: tuple[tuple[Any, ...], ...]) -> Mapping[tuple[str, Protocol], int]:
    return _checked_ports(v.from_key(key, _PORT_FIELDS))


def _checked_ports(raw_ports: Sequence[Any]) -> Mapping[tuple[str, Protocol], int]:
    """A slice's ports: (name, protocol) -> number, a port without a number left out; the shared mapping."""
    ports: dict[tuple[str, Protocol], int] = {}
    for i, raw in enumerate(raw_ports):
        what = f"ports[{i}]"
        p = v.mapping(raw, what)
        pname = shared_text(v.port_name(p.get("name"), f"{what}.name"))
        proto = v.protocol(p.get("protocol"), f"{what}.protocol")
        if (pname, proto) in ports:
            raise ValueError(f"{what}: duplicate port {pname!r}/{proto.value}")
        if p.get("port") is None:
            continue  # "all ports": upstream's proxy has nothing to program for it either
        ports[(pname, proto)] = v.port_number(p.get("port"), f"{what}.port")
    return _port_set(tuple(ports.items()))


def _endpoints(
    raw_endpoints: Sequence[Any], family: IPFamily, node_name: str, port: int
) -> tuple[tuple[Endpoint, ...], list[str]]:
    """A slice's endpoints on ``port``, sorted by address, each address once (of two copies the local one, as
    upstream), and a note per duplicate. Each is built once, straight from its entry (no intermediate record), and
    the sort is skipped when the slice lists them in order already (the EndpointSlice controller's usual order)."""
    by_ip: dict[str, tuple[int, Endpoint]] = {}
    duplicates: list[str] = []
    ordered, last = True, -1
    for i, raw in enumerate(raw_endpoints):
        entry = _endpoint_fast(raw, family, node_name, port)
        if entry is None:
            checked = _endpoint_checked(raw, f"endpoints[{i}]", family, node_name)
            entry = (checked[0], _new_endpoint(checked, port))
        key, ep = entry
        ip = ep.ip
        if ip in by_ip:
            duplicates.append(f"endpoints[{i}]: duplicate address {ip} (counted once)")
            if ep.is_local:
                by_ip[ip] = entry  # as upstream: of two copies, prefer the one that says it is local
            continue
        by_ip[ip] = entry
        if key <= last:
            ordered = False
        last = key
    if ordered:
        return tuple([ep for _, ep in by_ip.values()]), duplicates
    return tuple([ep for _, ep in sorted(by_ip.values(), key=_first)]), duplicates


_first = operator.itemgetter(0)


# A cluster has few node names and zones and every endpoint repeats them: each checked once and shared (bounded:
# slices are input)
_NODE_NAMES = v.Known(v.dns1123_subdomain, 16384)
_ZONES = v.Known(v.label_value, 4096)
_known_node, _known_zone = _NODE_NAMES.known.get, _ZONES.known.get
_inet_pton, _AF_INET, _from_bytes = socket.inet_pton, socket.AF_INET, int.from_bytes


def _endpoint_fast(raw: Any, family: IPFamily, node_name: str, port: int) -> tuple[int, Endpoint] | None:
    """The common, well-formed IPv4 endpoint on ``port`` and its sort key, without building a single message
    string; None: use the checked path (which gives the precise error, or parses the unusual-but-valid case)."""
    if type(raw) is not dict or family is not IPFamily.V4 or "hints" in raw:
        return None
    addresses = raw.get("addresses")
    if type(addresses) is not list or len(addresses) != 1 or type(addresses[0]) is not str:
        return None
    ip = addresses[0]
    try:
        sort_key = _from_bytes(_inet_pton(_AF_INET, ip), "big")
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
    if ep_node is not None:
        if type(ep_node) is not str:
            return None
        ep_node = _known_node(ep_node) or _NODE_NAMES.shared(ep_node)  # the table first: one lookup, no call
        if ep_node is None:
            return None
    zone = raw.get("zone")
    if zone is not None:
        if type(zone) is not str:
            return None
        zone = _known_zone(zone) or _ZONES.shared(zone)
        if zone is None:
            return None
    rare = _PLAIN if terminating is False and zone is None else rare_fields(terminating, zone, _NO_HINTS, _NO_HINTS)
    return sort_key, new_endpoint(ip, port, ready, serving, ep_node, ep_node == node_name, rare)


def _endpoint_checked(raw: Any, what: str, family: IPFamily, node_name: str) -> RawEndpoint:
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
        ep_node = _NODE_NAMES(ep_node, f"{what}.nodeName")
    zone = ep.get("zone")
    if zone is not None:
        zone = _ZONES(zone, f"{what}.zone")
    zone_hints, node_hints = _NO_HINTS, _NO_HINTS
    hints = ep.get("hints")
    if hints is not None:
        hints = v.mapping(hints, f"{what}.hints")
        zone_hints = _hint_names(hints.get("forZones"), f"{what}.hints.forZones")
        node_hints = _hint_names(hints.get("forNodes"), f"{what}.hints.forNodes")
    rare = rare_fields(terminating, zone, zone_hints, node_hints)
    return (sort_key, ip, ready, serving, ep_node, ep_node == node_name, rare)


def _hint_names(value: Any, what: str) -> frozenset[str]:
    names = []
    for i, raw in enumerate(v.optional_sequence(value, what)):
        hint = v.mapping(raw, f"{what}[{i}]")
        names.append(v.string(hint.get("name"), f"{what}[{i}].name"))
    if not names:
        return _NO_HINTS
    return _hint_set(frozenset(shared_text(n) for n in names))


class EndpointSliceCache:
    """Every accepted slice by the service it belongs to (upstream's EndpointSliceCache, without its pending/applied
    split: ``ServiceCache.snapshot`` is the check-out). Not locked: the owning ``ServiceCache`` holds its lock.

    Kept small, since it holds one entry per slice of the cluster: a service with one slice (the common case) maps
    to that ``SliceInfo`` itself, not to a dict of one (an empty-ish dict costs ~180 bytes, more than the slice's own
    record); only a second slice makes it a dict by slice name. Owners are kept per namespace, by slice name, so no
    (namespace, name) tuple is stored per slice; every slice of a service names it with one ``NamespacedName``."""

    def __init__(self) -> None:
        self._by_service: dict[NamespacedName, SliceInfo | dict[str, SliceInfo]] = {}
        self._owner: dict[str, dict[str, NamespacedName]] = {}  # namespace -> slice name -> service
        self.endpoint_count = 0

    def update(self, key: SliceKey, parsed: SliceInfo) -> tuple[bool, NamespacedName | None]:
        """Store a slice: (changed, the service it belonged to before if that was another one)."""
        namespace, name = key
        if parsed.name != name or parsed.service.namespace != namespace:
            raise ValueError(f"slice {namespace}/{name} stored under another name ({parsed.service}: {parsed.name})")
        owner = self._owner.get(namespace, {}).get(name)
        moved_from = None
        if owner is not None:
            old = self._slice(owner, name)
            if old.same_as(parsed):
                return False, None
            if owner != parsed.service:
                self.remove(key)
                moved_from = owner
            else:
                self.endpoint_count -= len(old.endpoints)
        held = self._by_service.get(parsed.service)
        if held is None:
            self._by_service[parsed.service] = parsed
        elif isinstance(held, SliceInfo):
            parsed.service = held.service  # one NamespacedName per service, not one per slice
            self._by_service[parsed.service] = parsed if held.name == name else {held.name: held, name: parsed}
        else:
            parsed.service = next(iter(held.values())).service
            held[name] = parsed
        self._owner.setdefault(namespace, {})[name] = parsed.service
        self.endpoint_count += len(parsed.endpoints)
        return True, moved_from

    def _slice(self, service: NamespacedName, name: str) -> SliceInfo:
        held = self._by_service[service]
        return held if isinstance(held, SliceInfo) else held[name]

    def remove(self, key: SliceKey) -> NamespacedName | None:
        """Forget a slice: the service it belonged to, None if it was unknown."""
        namespace, name = key
        names = self._owner.get(namespace)
        owner = names.pop(name, None) if names is not None else None
        if owner is None:
            return None
        if not names:
            del self._owner[namespace]
        held = self._by_service[owner]
        if isinstance(held, SliceInfo):
            old = held
            del self._by_service[owner]
        else:
            old = held.pop(name)
            if len(held) == 1:
                self._by_service[owner] = next(iter(held.values()))  # one slice left: the slice itself again
        self.endpoint_count -= len(old.endpoints)
        return owner

    def for_service(self, service: NamespacedName) -> list[SliceInfo]:
        """The service's slices sorted by name (so a merge is the same whatever order they arrived in)."""
        held = self._by_service.get(service)
        if held is None:
            return []
        if isinstance(held, SliceInfo):
            return [held]
        return [held[n] for n in sorted(held)]

    def service_key(self, service: NamespacedName) -> NamespacedName | None:
        """The ``NamespacedName`` object the slices of ``service`` name it with (None without slices), so the
        Service's own record can share it."""
        held = self._by_service.get(service)
        if held is None:
            return None
        return held.service if isinstance(held, SliceInfo) else next(iter(held.values())).service

    def keys(self) -> Iterable[SliceKey]:
        return [(namespace, name) for namespace, names in self._owner.items() for name in names]

    def services(self) -> Iterable[NamespacedName]:
        """Services with at least one slice."""
        return self._by_service.keys()


def merge_endpoints(slices: list[SliceInfo], tmpl: ServicePort) -> tuple[Endpoint, ...]:
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


def _sort_key(ep: Endpoint) -> tuple[bytes, int]:
    fam = socket.AF_INET6 if ":" in ep.ip else socket.AF_INET
    return socket.inet_pton(fam, ep.ip), ep.port
