"""The cache's memory: at most 4 KB per service port with 10 endpoints beyond a fixed base, for objects as a list's
JSON gives them (every repeated name its own string), with names interned and endpoint tuples shared."""

from __future__ import annotations

import json
from typing import Any

from kproxy.bench import memory, synthetic
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, ServicePort

NODE = "node-1"
BOUND = 4096  # bytes per service port with 10 endpoints (issue 22)


def _decoded(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API client hands it over: decoded from JSON, no string shared with another object."""
    decoded: dict[str, Any] = json.loads(json.dumps(obj))
    return decoded


def _filled(n: int, endpoints: int = 10) -> ServiceCache:
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    for i in range(1, n + 1):
        assert cache.upsert_service(_decoded(synthetic.service(i)))
    for i in range(1, n + 1):
        assert cache.upsert_slice(_decoded(synthetic.endpoint_slice(i, endpoints)))
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    return cache


def _bytes(cache: ServiceCache) -> int:
    state, _ = cache.snapshot()
    assert len(state) and not cache.errors()
    figures = memory.walk([memory.Owner("cache", [cache]), memory.Owner("snapshot", [state])])
    return figures["cache"]["bytes"] + figures["snapshot"]["bytes"]


def test_a_service_port_with_10_endpoints_costs_at_most_4_kb() -> None:
    small, large = 200, 1200
    per_port = (_bytes(_filled(large)) - _bytes(_filled(small))) / (large - small)
    assert per_port <= BOUND, f"{per_port:.0f} bytes per service port"


def _ports(cache: ServiceCache) -> list[ServicePort]:
    state, _ = cache.snapshot()
    return sorted(state, key=lambda sp: sp.name)


def test_repeated_names_are_one_string_and_endpoint_tuples_are_shared() -> None:
    a, b = _ports(_filled(2))
    ep_a, ep_b = a.serving_endpoints[0], b.serving_endpoints[0]
    assert ep_a.node_name == ep_b.node_name == NODE and ep_a.node_name is ep_b.node_name
    assert a.name.namespace is b.name.namespace and a.name.port is b.name.port
    # every endpoint is ready: the cluster set is the serving set itself, not an equal copy
    assert a.cluster_endpoints == a.serving_endpoints and a.cluster_endpoints is a.serving_endpoints


def test_a_second_port_of_a_slice_gets_its_own_endpoints_once() -> None:
    """The slice keeps its endpoints with its lowest port number; another port's are built on first use and kept,
    so two snapshots share them."""
    svc = synthetic.service(1)
    svc["spec"]["ports"] = [
        {"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080},
        {"name": "admin", "protocol": "TCP", "port": 81, "targetPort": 9090},
    ]
    eps = synthetic.endpoint_slice(1, 3)
    eps["ports"] = [
        {"name": "admin", "protocol": "TCP", "port": 9090},
        {"name": "http", "protocol": "TCP", "port": 8080},
    ]
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    assert cache.upsert_service(_decoded(svc)) and cache.upsert_slice(_decoded(eps))
    first = {sp.name.port: sp for sp in cache.snapshot()[0]}
    assert [e.port for e in first["http"].serving_endpoints] == [8080] * 3
    assert [e.port for e in first["admin"].serving_endpoints] == [9090] * 3
    assert [e.ip for e in first["http"].serving_endpoints] == [e.ip for e in first["admin"].serving_endpoints]
    svc["metadata"]["labels"]["touched"] = "yes"  # the service is recomputed, its slice is not parsed again
    svc["spec"]["sessionAffinity"] = "ClientIP"
    assert cache.upsert_service(_decoded(svc))
    again = {sp.name.port: sp for sp in cache.snapshot()[0]}
    assert again["admin"].affinity_timeout and not first["admin"].affinity_timeout
    for port in ("http", "admin"):
        assert again[port].serving_endpoints is first[port].serving_endpoints
