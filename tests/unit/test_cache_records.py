"""What the cache keeps per object, pinned: its bytes per service port under tracemalloc (every allocation it holds,
not a walk of what it reaches), and the compact records behind that figure: a Service's record holds the completed
ServicePorts in place of their templates, a service's one slice is kept without a dict around it, a service's slices
share its one NamespacedName, and an endpoint keeps its rarely read fields in one shared tuple."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import pickle
import tracemalloc
from typing import Any

import pytest

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.endpointslices import EndpointSliceCache, parse_slice
from kproxy.model import Endpoint, IPFamily, NamespacedName, Protocol, ServicePortName
from kproxy.serviceport import as_template, parse_service, same_template, with_endpoints
from kproxy.topology import categorize_endpoints

from .cache_objects import endpoint, endpoint_slice, service

V4 = IPFamily.V4
NODE = "node-1"
WEB = NamespacedName("default", "web")
HTTP = ServicePortName("default", "web", "http", Protocol.TCP)
#: bytes per service port with 10 endpoints, cache and snapshot together, as tracemalloc counts them: fe13c8d held
#: 3,248, the compact records ~2,100-2,300
BOUND = 2700


def _decoded(obj: dict[str, Any]) -> dict[str, Any]:
    """As the API client hands an object over: decoded from JSON, no string shared with another object."""
    decoded: dict[str, Any] = json.loads(json.dumps(obj))
    return decoded


def _held_bytes(n: int) -> int:
    """Bytes allocated and still held after n bench services x 10 endpoints are absorbed, snapshotted and committed."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    cache = ServiceCache(node_name=NODE, ip_families=(V4,))
    cache.replace_services(_decoded(synthetic.service(i)) for i in range(1, n + 1))
    cache.replace_slices(_decoded(synthetic.endpoint_slice(i, 10)) for i in range(1, n + 1))
    state, changes = cache.snapshot()
    cache.commit(changes)
    assert len(state) == n and not cache.errors()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    del cache, state, changes
    return held


def test_a_service_port_with_10_endpoints_holds_at_most_2700_bytes() -> None:
    # 1,000 and 2,000: the cache's dicts are equally full at both sizes, so the slope is the per-port cost
    small, large = 1000, 2000
    # once untraced first: the interpreter's table of interned strings grows to hold the names (and keeps its size),
    # so a resize of it (~2 MB, whenever earlier tests left it nearly full) is not counted as the cache's
    _held_bytes(large)
    tracemalloc.start()
    try:
        per_port = (_held_bytes(large) - _held_bytes(small)) / (large - small)
    finally:
        tracemalloc.stop()
    assert per_port <= BOUND, f"{per_port:.0f} bytes per service port"


def _filled(cache: ServiceCache, endpoints: int = 2) -> None:
    cache.upsert_service(service())
    eps = [endpoint(f"198.18.1.{i}") for i in range(1, endpoints + 1)]
    cache.upsert_slice(endpoint_slice("web-1", endpoints=eps))


def test_the_service_record_holds_the_published_service_ports_not_templates() -> None:
    calls: list[int] = []
    cache = ServiceCache(NODE, ip_families=(V4,), on_change=lambda: calls.append(1))
    _filled(cache)
    state, changes = cache.snapshot()
    cache.commit(changes)
    published = state.get(HTTP, V4)
    assert published is not None and len(published.cluster_endpoints) == 2
    (held,) = cache._services[WEB].ports
    assert held is published
    # the same Service listed again is no change, although the record holds a completed port and the parse a template
    calls.clear()
    assert cache.upsert_service(service())
    assert not calls and cache.snapshot()[1].empty
    cache.replace_services([service()])
    state, changes = cache.snapshot()
    assert changes.empty and state.get(HTTP, V4) is published
    # a change of the Service itself is one
    assert cache.upsert_service(service(sessionAffinity="ClientIP"))
    state, changes = cache.snapshot()
    sp = state.get(HTTP, V4)
    assert HTTP in changes.services and sp is not None and sp.affinity_timeout and len(sp.cluster_endpoints) == 2
    (held,) = cache._services[WEB].ports
    assert held is sp


def test_a_service_whose_endpoints_go_keeps_a_bare_template() -> None:
    cache = ServiceCache(NODE, ip_families=(V4,))
    _filled(cache)
    cache.snapshot()
    cache.delete_slice("default", "web-1")
    state, _ = cache.snapshot()
    sp = state.get(HTTP, V4)
    assert sp is not None and not sp.cluster_endpoints and not sp.has_any_endpoints and not sp.serving_endpoints
    (held,) = cache._services[WEB].ports
    assert held is sp


def test_a_refused_service_keeps_templates_without_endpoints_and_comes_back() -> None:
    cache = ServiceCache(NODE, ip_families=(V4,), max_service_entries=4)
    _filled(cache)
    assert cache.snapshot()[0].get(HTTP, V4) is not None
    cache.upsert_slice(endpoint_slice("web-1", endpoints=[endpoint(f"198.18.1.{i}") for i in range(1, 6)]))
    assert cache.snapshot()[0].get(HTTP, V4) is None
    (held,) = cache._services[WEB].ports
    assert not held.cluster_endpoints and not held.serving_endpoints  # no stale endpoints kept alive
    cache.upsert_slice(endpoint_slice("web-1", endpoints=[endpoint("198.18.1.9")]))
    sp = cache.snapshot()[0].get(HTTP, V4)
    assert sp is not None and [e.ip for e in sp.cluster_endpoints] == ["198.18.1.9"]


def test_template_fields_compare_and_strip() -> None:
    _, info = parse_service(service(), (V4,), "")
    (tmpl,) = info.ports
    _, sl = parse_slice(endpoint_slice(), (V4,), NODE, 0.0)
    eps = sl.endpoints_for(8080)
    cat = categorize_endpoints(eps, uses_cluster=True, uses_local=False, node_name=NODE, zone=None)
    full = with_endpoints(tmpl, cat, eps)
    assert full != tmpl and same_template(full, tmpl)
    assert as_template(full) == tmpl and as_template(tmpl) is tmpl
    _, other = parse_service(service(cluster_ip="198.18.0.11"), (V4,), "")
    assert not same_template(other.ports[0], full) and other != info
    _, again = parse_service(service(), (V4,), "")
    assert again == info and hash(again) == hash(info)


def _slice(name: str, *ips: str, service_name: str = "web") -> tuple[tuple[str, str], Any]:
    eps = [endpoint(ip) for ip in ips]
    return parse_slice(endpoint_slice(name, service_name=service_name, endpoints=eps), (V4,), NODE, 0.0)


def test_a_service_with_one_slice_keeps_it_bare_and_a_second_makes_a_dict() -> None:
    cache = EndpointSliceCache()
    key_b, b = _slice("web-b", "198.18.1.2")
    key_a, a = _slice("web-a", "198.18.1.1")
    assert cache.update(key_b, b) == (True, None)
    assert cache._by_service[WEB] is b
    assert cache.update(key_a, a) == (True, None)
    assert [s.name for s in cache.for_service(WEB)] == ["web-a", "web-b"]  # by name, whatever the arrival order
    assert a.service is b.service  # one NamespacedName for the service's slices
    assert sorted(cache.keys()) == [key_a, key_b] and cache.endpoint_count == 2
    _, b2 = _slice("web-b", "198.18.1.2", "198.18.1.3")
    assert cache.update(key_b, b2) == (True, None) and cache.endpoint_count == 3
    assert cache.remove(key_a) == WEB
    assert cache._by_service[WEB] is b2 and cache.for_service(WEB) == [b2]
    assert cache.service_key(WEB) is b2.service
    assert cache.remove(key_b) == WEB and not cache._by_service and not list(cache.keys())
    assert cache.service_key(WEB) is None and cache.endpoint_count == 0


def test_a_slice_moving_to_another_service_leaves_the_first() -> None:
    cache = EndpointSliceCache()
    key, first = _slice("web-a", "198.18.1.1")
    cache.update(key, first)
    _, moved = _slice("web-a", "198.18.1.1", service_name="api")
    assert cache.update(key, moved) == (True, WEB)
    assert cache.for_service(WEB) == [] and cache.for_service(NamespacedName("default", "api")) == [moved]
    with pytest.raises(ValueError, match="another name"):
        cache.update(("default", "other"), moved)


@pytest.mark.parametrize("service_first", [True, False])
def test_the_service_and_its_slices_share_one_name_whichever_comes_first(service_first: bool) -> None:
    cache = ServiceCache(NODE, ip_families=(V4,))
    if service_first:
        assert cache.upsert_service(service()) and cache.upsert_slice(endpoint_slice("web-1"))
    else:
        assert cache.upsert_slice(endpoint_slice("web-1")) and cache.upsert_service(service())
    (sl,) = cache._slices.for_service(WEB)
    assert cache._services[WEB].key is sl.service
    assert cache.snapshot()[0].get(HTTP, V4) is not None


def test_an_endpoint_is_a_frozen_value_with_its_rare_fields_shared() -> None:
    hints = frozenset({"zone-1"})
    a = Endpoint("198.18.1.1", 8080, terminating=True, node_name="node-a", zone="zone-1", zone_hints=hints)
    b = Endpoint("198.18.1.2", 8080, terminating=True, node_name="node-a", zone="zone-1", zone_hints=hints)
    assert (a.terminating, a.zone, a.zone_hints, a.node_hints) == (True, "zone-1", hints, frozenset())
    assert a._rare is b._rare  # one tuple for every endpoint with the same rare fields
    assert Endpoint("198.18.1.3", 80)._rare is Endpoint("198.18.1.4", 81)._rare
    same = Endpoint("198.18.1.1", 8080, True, True, True, "node-a", "zone-1", False, hints, frozenset())
    assert a == same and hash(a) == hash(same) and a != b and a != "198.18.1.1:8080"
    assert a != Endpoint("198.18.1.1", 8080, terminating=True, node_name="node-a", zone="zone-2", zone_hints=hints)
    assert repr(Endpoint("198.18.1.1", 80)) == (
        "Endpoint(ip='198.18.1.1', port=80, ready=True, serving=True, terminating=False, node_name=None, zone=None,"
        " is_local=False, zone_hints=frozenset(), node_hints=frozenset())"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ip = "198.18.1.9"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del a.port
    for twin in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert twin == a and twin.zone_hints == hints and twin.family is V4
    moved = a.with_port(9090)
    assert moved.port == 9090 and moved._rare is a._rare and (moved.ip, moved.node_name) == (a.ip, a.node_name)
    assert str(Endpoint("fd00:198:18::1", 53)) == "[fd00:198:18::1]:53"


def _names(cache: ServiceCache) -> set[str]:
    return {sp.name.port for sp in cache.snapshot()[0]}


def test_the_ports_a_service_no_longer_has_go_without_a_record_per_service() -> None:
    """The cache keeps a Service's previous record only from its change to the next snapshot: a renamed port, a
    Service replaced twice between snapshots, deleted and added again, or refused and then changed, all leave
    exactly the ports the Service has now."""
    dns = {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353}
    http = {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}
    cache = ServiceCache(NODE, ip_families=(V4,), max_service_entries=2)
    cache.upsert_service(service(ports=[http]))
    assert _names(cache) == {"http"}
    cache.upsert_service(service(ports=[dns]))
    cache.upsert_service(service(ports=[{**dns, "name": "dns2"}]))  # twice before a snapshot
    state, changes = cache.snapshot()
    assert {sp.name.port for sp in state} == {"dns2"}
    assert {spn.port for spn in changes.services} == {"http", "dns2"}
    cache.commit(changes)
    cache.delete_service("default", "web")
    cache.upsert_service(service(ports=[http]))
    assert _names(cache) == {"http"}
    cache.upsert_service(service(ports=[http, dns]))  # 1 address x 2 ports + 0 endpoints: 2 entries, fits
    assert _names(cache) == {"http", "dns"}
    cache.upsert_service(service(ports=[http, dns], externalIPs=["198.18.5.5"]))  # 4 entries: refused
    assert _names(cache) == set() and "Service default/web" in cache.errors()
    cache.upsert_service(service(ports=[dns]))
    assert _names(cache) == {"dns"}
    cache.delete_service("default", "web")
    assert _names(cache) == set() and not cache._replaced
