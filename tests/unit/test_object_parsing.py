"""The parsers below the cache, on their own: kproxy.serviceport (a Service into per-family ServicePort templates),
kproxy.endpointslices (a slice, the per-service slice cache and the merge) and kproxy.objects (Nodes, what is not
ours). The cache's own tests (test_cache.py, test_bad_input.py) cover the same semantics through ServiceCache."""

from __future__ import annotations

import pytest

from kproxy.endpointslices import EndpointSliceCache, merge_endpoints, parse_slice
from kproxy.model import IPFamily, NamespacedName, Protocol, ServicePortName
from kproxy.objects import Ignored, object_label, parse_node
from kproxy.serviceport import parse_service

from .cache_objects import endpoint, endpoint_slice, node, service

BOTH = (IPFamily.V4, IPFamily.V6)


def test_service_into_one_template_per_port_and_family() -> None:
    obj = service(
        cluster_ip=["198.18.0.10", "fd00:198:18::10"],
        ports=[{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}],
        ipFamilies=["IPv4", "IPv6"],
    )
    key, info = parse_service(obj, BOTH, "")
    assert key == NamespacedName("default", "web")
    got = {(sp.family, sp.name.port, sp.cluster_ip) for sp in info.ports}
    assert got == {
        (IPFamily.V4, "http", "198.18.0.10"),
        (IPFamily.V4, "dns", "198.18.0.10"),
        (IPFamily.V6, "http", "fd00:198:18::10"),
        (IPFamily.V6, "dns", "fd00:198:18::10"),
    }
    assert all(not sp.cluster_endpoints and not sp.has_any_endpoints for sp in info.ports)  # templates only
    _, v4_only = parse_service(obj, (IPFamily.V4,), "")
    assert {sp.family for sp in v4_only.ports} == {IPFamily.V4}


def test_not_ours_is_ignored_and_bad_is_a_value_error() -> None:
    with pytest.raises(Ignored):
        parse_service(service(type_="ExternalName"), BOTH, "")
    with pytest.raises(Ignored):
        parse_service(service(cluster_ip="None"), BOTH, "")
    with pytest.raises(ValueError, match="spec.ports: empty"):
        parse_service(service(ports=[]), BOTH, "")
    with pytest.raises(Ignored):
        parse_slice(endpoint_slice(address_type="FQDN"), BOTH, "node-a", 0.0)
    assert object_label("Service", {"metadata": "junk"}) == ("Service ?/?", "?", "?")


def test_slice_cache_tracks_owners_and_counts() -> None:
    cache = EndpointSliceCache()
    key, first = parse_slice(endpoint_slice(endpoints=[endpoint("198.18.1.1"), endpoint("198.18.1.2")]), BOTH, "n", 0)
    assert cache.update(key, first) == (True, None)
    _, same = parse_slice(endpoint_slice(endpoints=[endpoint("198.18.1.2"), endpoint("198.18.1.1")]), BOTH, "n", 0)
    assert cache.update(key, same) == (False, None)  # same endpoints, another order: no change
    _, moved = parse_slice(endpoint_slice(service_name="api", endpoints=[endpoint("198.18.1.3")]), BOTH, "n", 0)
    assert cache.update(key, moved) == (True, NamespacedName("default", "web"))
    assert cache.for_service(NamespacedName("default", "web")) == []
    assert list(cache.services()) == [NamespacedName("default", "api")] and cache.endpoint_count == 1
    assert cache.remove(key) == NamespacedName("default", "api")
    assert cache.remove(key) is None and cache.endpoint_count == 0 and not list(cache.keys())


def test_merge_counts_an_address_once_preferring_the_local_copy() -> None:
    _, a = parse_slice(endpoint_slice("web-a", endpoints=[endpoint("198.18.1.1", node="node-b")]), BOTH, "node-a", 0)
    _, b = parse_slice(
        endpoint_slice("web-b", endpoints=[endpoint("198.18.1.1", node="node-a"), endpoint("198.18.1.0")]),
        BOTH,
        "node-a",
        0,
    )
    _, info = parse_service(service(), BOTH, "")
    (tmpl,) = info.ports
    assert tmpl.name == ServicePortName("default", "web", "http", Protocol.TCP)
    merged = merge_endpoints([a, b], tmpl)
    assert [(e.ip, e.port, e.is_local) for e in merged] == [("198.18.1.0", 8080, False), ("198.18.1.1", 8080, True)]


def test_node() -> None:
    info = parse_node(node(zone="z1", pod_cidrs=["198.18.64.0/24"], taints=[{"key": "ToBeDeletedByClusterAutoscaler"}]))
    assert info.zone == "z1" and info.pod_cidrs == ("198.18.64.0/24",) and not info.eligible
