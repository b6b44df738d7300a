"""Bad objects are logged, reported by errors() and skipped one at a time; good objects are never disturbed, and an
invalid update keeps the last good version."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest

from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, Protocol, ServicePort, ServicePortName

from .cache_objects import NODE, endpoint, endpoint_slice, node, service

V4 = IPFamily.V4
WEB = ServicePortName("default", "web", "http", Protocol.TCP)
BAD = ServicePortName("default", "bad", "http", Protocol.TCP)

Mutator = Callable[[dict[str, Any]], Any]


def good_cache() -> tuple[ServiceCache, ServicePort]:
    cache = ServiceCache(NODE)
    assert cache.upsert_service(service())
    assert cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.18.1.1"), endpoint("198.18.1.2")]))
    state, changes = cache.snapshot()
    cache.commit(changes)
    sp = state.get(WEB, V4)
    assert sp is not None and len(sp.cluster_endpoints) == 2
    return cache, sp


def setter(path: str, value: Any) -> Mutator:
    """Set obj[a][b][0][c] = value for path 'a.b.0.c' (creating dicts on the way); value DELETE removes it."""

    def mutate(obj: dict[str, Any]) -> None:
        parts = path.split(".")
        cur: Any = obj
        for part in parts[:-1]:
            cur = cur[int(part)] if isinstance(cur, list) else cur.setdefault(part, {})
        last = parts[-1]
        if value is DELETE:
            del cur[last]
        elif isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value

    return mutate


DELETE = object()
LONG = "a" * 64

BAD_SERVICES: list[tuple[str, Mutator, str]] = [
    # invalid IPs
    ("clusterIP out of range", setter("spec.clusterIPs", ["198.18.0.300"]), "not an IP address"),
    ("clusterIP garbage", lambda o: o["spec"].update(clusterIP="nope", clusterIPs=["nope"]), "not an IP address"),
    # (leading zeros are read as decimal, as upstream's ParseIPSloppy: see test_cache; five parts are not an address)
    ("clusterIP with five parts", setter("spec.clusterIPs", ["198.18.0.1.1"]), "not an IP address"),
    ("externalIP invalid", setter("spec.externalIPs", ["198.18.5.x"]), "spec.externalIPs[0]"),
    (
        "ingress IP invalid",
        lambda o: o.update(status={"loadBalancer": {"ingress": [{"ip": "1.2.3"}]}}),
        "status.loadBalancer.ingress[0].ip",
    ),
    ("source range invalid", setter("spec.loadBalancerSourceRanges", ["198.18.0.0/33"]), "not a CIDR"),
    # ports out of range
    ("port 0", setter("spec.ports.0.port", 0), "out of range"),
    ("port 70000", setter("spec.ports.0.port", 70000), "out of range"),
    ("port negative", setter("spec.ports.0.port", -80), "out of range"),
    ("nodePort 70000", setter("spec.ports.0.nodePort", 70000), "spec.ports[0].nodePort"),
    ("healthCheckNodePort 99999", setter("spec.healthCheckNodePort", 99999), "spec.healthCheckNodePort"),
    (
        "affinity timeout 0",
        lambda o: o["spec"].update(
            sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}
        ),
        "not in 1..86400",
    ),
    # mixed families
    ("two IPv4 clusterIPs", setter("spec.clusterIPs", ["198.18.0.20", "198.18.0.21"]), "two IPv4"),
    (
        "two IPv6 clusterIPs",
        lambda o: o["spec"].update(clusterIP="fd00::1", clusterIPs=["fd00::1", "fd00::2"]),
        "two IPv6",
    ),
    ("ipFamilies disagree", setter("spec.ipFamilies", ["IPv6"]), "spec.ipFamilies[0]"),
    ("ipFamilies repeated", setter("spec.ipFamilies", ["IPv4", "IPv4"]), "listed twice"),
    ("clusterIP differs from clusterIPs[0]", setter("spec.clusterIP", "198.18.0.99"), "differs"),
    ("three clusterIPs", setter("spec.clusterIPs", ["198.18.0.20", "fd00::1", "198.18.0.21"]), "at most 2"),
    # missing fields
    ("no metadata", setter("metadata", DELETE), "metadata"),
    ("no name", setter("metadata.name", DELETE), "metadata.name"),
    ("no namespace", setter("metadata.namespace", DELETE), "metadata.namespace"),
    ("no spec", setter("spec", DELETE), "spec"),
    ("no ports", setter("spec.ports", DELETE), "spec.ports: missing"),
    ("empty ports", setter("spec.ports", []), "spec.ports: empty"),
    ("port without number", setter("spec.ports.0.port", DELETE), "spec.ports[0].port: missing"),
    # duplicate ports
    (
        "duplicate port name",
        setter("spec.ports", [{"name": "http", "port": 80}, {"name": "http", "port": 81}]),
        "duplicate port name",
    ),
    (
        "duplicate port+protocol",
        setter("spec.ports", [{"name": "a", "port": 80}, {"name": "b", "port": 80, "protocol": "TCP"}]),
        "duplicate port 80/TCP",
    ),
    ("two unnamed ports", setter("spec.ports", [{"port": 80}, {"port": 81}]), "duplicate port name"),
    # absurd / malformed names
    ("namespace too long", setter("metadata.namespace", LONG), "more than the 63"),
    ("name too long", setter("metadata.name", LONG), "more than the 63"),
    ("huge name", setter("metadata.name", "x" * 100_000), "more than the 63"),
    ("name uppercase", setter("metadata.name", "Bad"), "DNS-1035"),
    ("name starts with a digit", setter("metadata.name", "1bad"), "DNS-1035"),
    ("namespace with a dot", setter("metadata.namespace", "a.b"), "DNS-1123 label"),
    ("port name too long", setter("spec.ports.0.name", "a" * 64), "more than the 63"),
    ("port name uppercase", setter("spec.ports.0.name", "HTTP"), "DNS-1123 label"),
    ("port name trailing dash", setter("spec.ports.0.name", "http-"), "DNS-1123 label"),
    ("port name with a dot", setter("spec.ports.0.name", "a.b"), "DNS-1123 label"),
    # wrong types
    ("port as string", setter("spec.ports.0.port", "80"), "expected an integer"),
    ("port as bool", setter("spec.ports.0.port", True), "expected an integer"),
    ("port as float", setter("spec.ports.0.port", 80.0), "expected an integer"),
    ("spec as list", setter("spec", []), "spec: expected an object"),
    ("ports as dict", setter("spec.ports", {"name": "http", "port": 80}), "expected a list"),
    ("port entry as string", setter("spec.ports", ["80/TCP"]), "spec.ports[0]: expected an object"),
    ("metadata as string", setter("metadata", "default/bad"), "metadata: expected an object"),
    ("labels as list", setter("metadata.labels", ["a=b"]), "metadata.labels"),
    ("label value as int", setter("metadata.labels", {"a": 1}), "metadata.labels[a]"),
    ("externalIPs as string", setter("spec.externalIPs", "198.18.5.5"), "expected a list"),
    ("clusterIP as int", setter("spec.clusterIP", 12), "spec.clusterIP"),
    (
        "timeout as string",
        lambda o: o["spec"].update(
            sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": "60"}}
        ),
        "timeoutSeconds",
    ),
    ("unknown protocol", setter("spec.ports.0.protocol", "ICMP"), "unknown protocol"),
    ("unknown type", setter("spec.type", "Weird"), "spec.type"),
    ("unknown eTP", setter("spec.externalTrafficPolicy", "Sometimes"), "spec.externalTrafficPolicy"),
    ("unknown iTP", setter("spec.internalTrafficPolicy", 1), "spec.internalTrafficPolicy"),
    ("ingress as dict", lambda o: o.update(status={"loadBalancer": {"ingress": {"ip": "198.18.9.9"}}}), "ingress"),
]


@pytest.mark.parametrize(("mutate", "reason"), [c[1:] for c in BAD_SERVICES], ids=[c[0] for c in BAD_SERVICES])
def test_bad_service_is_skipped(mutate: Mutator, reason: str | None, caplog: pytest.LogCaptureFixture) -> None:
    cache, good = good_cache()
    obj = service("bad", cluster_ip="198.18.0.20")
    mutate(obj)
    with caplog.at_level(logging.WARNING, logger="kproxy.cache"):
        assert cache.upsert_service(obj) is False
    errors = cache.errors()
    assert len(errors) == 1, errors
    ((label, why),) = errors.items()
    assert label.startswith("Service ") and len(label) < 250
    if reason is not None:
        assert reason in why, why
    warnings = [r for r in caplog.records if r.name == "kproxy.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and label in warnings[0].getMessage() and why in warnings[0].getMessage()
    state, changes = cache.snapshot()
    assert state.get(WEB, V4) == good and len(state) == 1
    assert changes.empty
    assert cache.stats()["invalid_objects"] == 1


def test_not_a_mapping_at_all(caplog: pytest.LogCaptureFixture) -> None:
    cache, good = good_cache()
    for junk in (None, "Service", ["a"], 42):
        assert cache.upsert_service(junk) is False  # type: ignore[arg-type]
        assert cache.upsert_slice(junk) is False  # type: ignore[arg-type]
    assert set(cache.errors()) == {"Service ?/?", "EndpointSlice ?/?"}
    assert cache.snapshot()[0].get(WEB, V4) == good


BAD_SLICES: list[tuple[str, Mutator, str]] = [
    ("address invalid", setter("endpoints.0.addresses", ["198.18.1.300"]), "endpoints[0].addresses[0]"),
    ("address garbage", setter("endpoints.0.addresses", ["pod-a"]), "not an IP address"),
    ("address is a CIDR", setter("endpoints.0.addresses", ["198.18.1.3/32"]), "not an IP address"),
    ("IPv6 address in IPv4 slice", setter("endpoints.0.addresses", ["fd00:198:18::1"]), "in an IPv4 slice"),
    ("second address of the other family", setter("endpoints.0.addresses", ["198.18.1.3", "fd00::3"]), "addresses[1]"),
    (
        "IPv4 address in IPv6 slice",
        lambda o: o.update(addressType="IPv6"),
        "IPv4 address 198.18.1.3 in an IPv6 slice",
    ),
    ("port 0", setter("ports.0.port", 0), "out of range"),
    ("port 65536", setter("ports.0.port", 65536), "out of range"),
    ("port as string", setter("ports.0.port", "8080"), "expected an integer"),
    ("unknown addressType", setter("addressType", "IPv5"), "addressType"),
    ("missing addressType", setter("addressType", DELETE), "addressType"),
    ("endpoint without addresses", setter("endpoints.0.addresses", DELETE), "endpoints[0].addresses"),
    ("endpoint with empty addresses", setter("endpoints.0.addresses", []), "empty"),
    ("ready as string", setter("endpoints.0.conditions.ready", "yes"), "conditions.ready"),
    ("serving as int", setter("endpoints.0.conditions.serving", 1), "conditions.serving"),
    ("endpoints as dict", setter("endpoints", {"addresses": ["198.18.1.3"]}), "endpoints: expected a list"),
    ("endpoint as string", setter("endpoints", ["198.18.1.3"]), "endpoints[0]: expected an object"),
    ("too many endpoints", lambda o: o.update(endpoints=[endpoint("198.18.1.3")] * 1001), "more than 1000"),
    (
        "duplicate port names",
        setter("ports", [{"name": "http", "port": 1}, {"name": "http", "port": 2}]),
        "duplicate port",
    ),
    ("port name uppercase", setter("ports.0.name", "HTTP"), "DNS-1123 label"),
    ("slice name too long", setter("metadata.name", "a" * 254), "more than the 253"),
    ("slice name with underscore", setter("metadata.name", "web_bad"), "DNS-1123 subdomain"),
    ("namespace too long", setter("metadata.namespace", LONG), "more than the 63"),
    ("service-name label invalid", setter("metadata.labels", {"kubernetes.io/service-name": "Web"}), "DNS-1035"),
    ("nodeName invalid", setter("endpoints.0.nodeName", "Node A"), "nodeName"),
    ("zone too long", setter("endpoints.0.zone", "z" * 64), "zone"),
    ("hints as list", setter("endpoints.0.hints", [{"name": "z1"}]), "hints"),
    ("hint without name", setter("endpoints.0.hints", {"forZones": [{}]}), "forZones[0].name"),
    ("no metadata", setter("metadata", DELETE), "metadata"),
]


@pytest.mark.parametrize(("mutate", "reason"), [c[1:] for c in BAD_SLICES], ids=[c[0] for c in BAD_SLICES])
def test_bad_slice_is_skipped(mutate: Mutator, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    cache, good = good_cache()
    obj = endpoint_slice("web-bad", endpoints=[endpoint("198.18.1.3")])
    mutate(obj)
    with caplog.at_level(logging.WARNING, logger="kproxy.cache"):
        assert cache.upsert_slice(obj) is False
    errors = cache.errors()
    assert len(errors) == 1, errors
    ((label, why),) = errors.items()
    assert label.startswith("EndpointSlice ") and len(label) < 250
    assert reason in why, why
    warnings = [r for r in caplog.records if r.name == "kproxy.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and label in warnings[0].getMessage()
    state, changes = cache.snapshot()
    assert state.get(WEB, V4) == good and changes.empty
    assert cache.stats()["endpoints"] == 2


def test_duplicate_endpoints_count_once(caplog: pytest.LogCaptureFixture) -> None:
    cache, good = good_cache()
    cache.upsert_service(service("other", cluster_ip="198.18.0.30"))
    dup = endpoint_slice(
        "other-1",
        service_name="other",
        endpoints=[endpoint("198.18.2.1"), endpoint("198.18.2.2"), endpoint("198.18.2.1", node=NODE)],
    )
    with caplog.at_level(logging.WARNING, logger="kproxy.cache"):
        assert cache.upsert_slice(dup) is True  # accepted, with the duplicate counted once
    assert "duplicate address 198.18.2.1" in cache.errors()["EndpointSlice default/other-1"]
    assert any("duplicate address" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    state, _ = cache.snapshot()
    other = state.get(ServicePortName("default", "other", "http", Protocol.TCP), V4)
    assert other is not None and [e.ip for e in other.cluster_endpoints] == ["198.18.2.1", "198.18.2.2"]
    assert other.cluster_endpoints[0].is_local  # the local copy is preferred, as across slices
    assert state.get(WEB, V4) == good
    # Fixed: the note goes away.
    cache.upsert_slice(endpoint_slice("other-1", service_name="other", endpoints=[endpoint("198.18.2.1")]))
    assert cache.errors() == {}


def test_invalid_update_keeps_last_good_version(caplog: pytest.LogCaptureFixture) -> None:
    cache, _ = good_cache()
    v2 = service(ports=[{"name": "http", "port": 81}])
    assert cache.upsert_service(v2)
    state, changes = cache.snapshot()
    cache.commit(changes)
    good = state.get(WEB, V4)
    assert good is not None and good.port == 81
    calls: list[int] = []
    cache._on_change = lambda: calls.append(1)  # noqa: SLF001 - test hook
    bad = copy.deepcopy(v2)
    bad["spec"]["ports"][0]["port"] = 99999
    with caplog.at_level(logging.WARNING, logger="kproxy.cache"):
        assert not cache.upsert_service(bad)
    assert "Service default/web" in cache.errors() and calls == []
    state, changes = cache.snapshot()
    assert state.get(WEB, V4) == good and changes.empty
    # A relist carrying the bad version keeps the good one too (it is present, only invalid).
    cache.replace_services([bad])
    assert cache.snapshot()[0].get(WEB, V4) == good and "Service default/web" in cache.errors()
    # The same for slices.
    bad_slice = endpoint_slice(endpoints=[endpoint("198.18.1.999")])
    assert not cache.upsert_slice(bad_slice)
    assert cache.snapshot()[0].get(WEB, V4) == good and "EndpointSlice default/web-abc" in cache.errors()
    # Valid again: errors cleared, the new version used.
    assert cache.upsert_service(service(ports=[{"name": "http", "port": 82}]))
    assert cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.18.1.7")]))
    assert cache.errors() == {}
    sp = cache.snapshot()[0].get(WEB, V4)
    assert sp is not None and sp.port == 82 and [e.ip for e in sp.cluster_endpoints] == ["198.18.1.7"]


def test_errors_of_deleted_or_relisted_away_objects_are_forgotten() -> None:
    cache, _ = good_cache()
    broken = service("bad")
    broken["spec"]["ports"] = []
    cache.upsert_service(broken)
    cache.upsert_slice(endpoint_slice("bad-1", endpoints=[{"addresses": ["x"]}]))
    assert len(cache.errors()) == 2
    cache.delete_service("default", "bad")
    assert list(cache.errors()) == ["EndpointSlice default/bad-1"]
    cache.replace_slices([endpoint_slice()])
    assert cache.errors() == {}


def test_bad_node_keeps_last_good(caplog: pytest.LogCaptureFixture) -> None:
    cache = ServiceCache(NODE)
    cache.set_node(node(zone="z1", pod_cidrs=["198.18.64.0/24"]))
    with caplog.at_level(logging.WARNING, logger="kproxy.cache"):
        cache.set_node(node(zone="z2", pod_cidrs=["198.18.64.0/99"]))
        cache.set_node(node(zone="z2", addresses=[{"type": "InternalIP", "address": "nope"}]))
        bad_labels = node()
        bad_labels["metadata"]["labels"] = {"topology.kubernetes.io/zone": ["z2"]}
        cache.set_node(bad_labels)
    assert cache.node_info().zone == "z1" and cache.node_info().pod_cidrs == ("198.18.64.0/24",)
    assert "Node node-a" in cache.errors()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3
    cache.set_node(node(zone="z2"))
    assert cache.errors() == {} and cache.node_info().zone == "z2"


def test_many_bad_objects_do_not_disturb_a_good_one() -> None:
    cache, good = good_cache()
    for _name, mutate, _ in BAD_SERVICES:
        obj = service("bad", cluster_ip="198.18.0.20")
        mutate(obj)
        cache.upsert_service(obj)
    for _name, mutate, _ in BAD_SLICES:
        obj = endpoint_slice("web-bad", endpoints=[endpoint("198.18.1.3")])
        mutate(obj)
        cache.upsert_slice(obj)
    state, changes = cache.snapshot()
    assert state.get(WEB, V4) == good and len(state) == 1 and changes.empty
    assert cache.stats()["invalid_objects"] >= 2
