"""The shared cache: which objects count, how they become ServicePorts, and how Changes / commit track dirtiness."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest

from kproxy.cache import ServiceCache
from kproxy.model import Changes, IPFamily, Protocol, ProxyState, ServicePort, ServicePortName, Verdict

from .cache_objects import NODE, endpoint, endpoint_slice, node, service

V4, V6 = IPFamily.V4, IPFamily.V6
HTTP = ServicePortName("default", "web", "http", Protocol.TCP)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_cache(**kwargs: Any) -> ServiceCache:
    kwargs.setdefault("clock", Clock())
    return ServiceCache(NODE, **kwargs)


def snap(cache: ServiceCache, full: bool = False) -> tuple[ProxyState, Changes]:
    return cache.snapshot(full=full)


def port(cache: ServiceCache, spn: ServicePortName = HTTP, family: IPFamily = V4) -> ServicePort | None:
    state, _ = cache.snapshot()
    return state.get(spn, family)


def must(cache: ServiceCache, spn: ServicePortName = HTTP, family: IPFamily = V4) -> ServicePort:
    sp = port(cache, spn, family)
    assert sp is not None, f"{spn} ({family.value}) missing"
    return sp


def ep_ips(eps: tuple[Any, ...]) -> list[str]:
    return [e.ip for e in eps]


# ---------------------------------------------------------------------------------------------- ServicePorts


def test_basic_clusterip_service() -> None:
    cache = make_cache()
    assert cache.upsert_service(service())
    assert cache.upsert_slice(
        endpoint_slice(endpoints=[endpoint("198.18.1.2"), endpoint("198.18.1.1", node=NODE), endpoint("198.18.1.10")])
    )
    sp = must(cache)
    assert sp.family is V4 and sp.cluster_ip == "198.18.0.10" and sp.port == 80 and sp.protocol is Protocol.TCP
    assert sp.node_port == 0 and sp.external_ips == () and sp.load_balancer_ips == () and sp.affinity_timeout == 0
    assert not sp.external_policy_local and not sp.internal_policy_local and sp.health_check_node_port == 0
    # Sorted by address (numerically), port from the slice.
    assert ep_ips(sp.cluster_endpoints) == ["198.18.1.1", "198.18.1.2", "198.18.1.10"]
    assert {e.port for e in sp.cluster_endpoints} == {8080}
    assert [e.is_local for e in sp.cluster_endpoints] == [True, False, False]
    assert sp.local_endpoints == () and sp.has_any_endpoints
    assert sp.internal_verdict is Verdict.FORWARD and sp.external_verdict is Verdict.FORWARD


def test_unnamed_port_and_default_protocol() -> None:
    cache = make_cache()
    cache.upsert_service(service(ports=[{"port": 53, "protocol": "UDP"}, {"port": 53, "name": "tcp"}]))
    cache.upsert_slice(endpoint_slice(ports=[{"port": 5353, "protocol": "UDP"}, {"name": "tcp", "port": 5354}]))
    udp = must(cache, ServicePortName("default", "web", "", Protocol.UDP))
    tcp = must(cache, ServicePortName("default", "web", "tcp", Protocol.TCP))
    assert str(udp.name) == "default/web" and udp.cluster_endpoints[0].port == 5353
    assert tcp.cluster_endpoints[0].port == 5354


def test_no_matching_slice_port_rejects() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    assert must(cache).internal_verdict is Verdict.REJECT
    # A slice whose port name or protocol differs does not feed this port.
    cache.upsert_slice(endpoint_slice(ports=[{"name": "other", "port": 8080}]))
    cache.upsert_slice(endpoint_slice("web-udp", ports=[{"name": "http", "port": 8080, "protocol": "UDP"}]))
    sp = must(cache)
    assert sp.cluster_endpoints == () and not sp.has_any_endpoints
    assert sp.internal_verdict is Verdict.REJECT and sp.external_verdict is Verdict.REJECT


def test_slices_merge_and_dedup() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_slice(endpoint_slice("web-b", endpoints=[endpoint("198.18.1.3"), endpoint("198.18.1.1")]))
    cache.upsert_slice(endpoint_slice("web-a", endpoints=[endpoint("198.18.1.2"), endpoint("198.18.1.1", node=NODE)]))
    sp = must(cache)
    assert ep_ips(sp.cluster_endpoints) == ["198.18.1.1", "198.18.1.2", "198.18.1.3"]
    # The same ip:port in two slices counts once, and the local copy wins (as upstream).
    assert sp.cluster_endpoints[0].is_local
    # Different target port numbers in two slices (a rolling targetPort change) are different endpoints.
    cache.upsert_slice(
        endpoint_slice("web-c", endpoints=[endpoint("198.18.1.1")], ports=[{"name": "http", "port": 9090}])
    )
    sp = must(cache)
    assert [str(e) for e in sp.cluster_endpoints] == [
        "198.18.1.1:8080",
        "198.18.1.1:9090",
        "198.18.1.2:8080",
        "198.18.1.3:8080",
    ]
    cache.delete_slice("default", "web-b")
    cache.delete_slice("default", "web-c")
    assert ep_ips(must(cache).cluster_endpoints) == ["198.18.1.1", "198.18.1.2"]


def test_endpoint_conditions_defaults() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    raw = [
        {"addresses": ["198.18.1.1"]},  # no conditions at all: ready, serving, not terminating
        {"addresses": ["198.18.1.2"], "conditions": {"ready": False}},  # serving follows ready
        {"addresses": ["198.18.1.3"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["198.18.1.4", "198.18.1.5"], "zone": "z1"},  # only addresses[0] counts
    ]
    cache.upsert_slice(endpoint_slice(endpoints=raw))
    state, _ = cache.snapshot()
    sp = state.get(HTTP, V4)
    assert sp is not None
    assert ep_ips(sp.cluster_endpoints) == ["198.18.1.1", "198.18.1.4"]
    e4 = sp.cluster_endpoints[1]
    assert e4.zone == "z1" and e4.node_name is None and not e4.is_local
    e1 = sp.cluster_endpoints[0]
    assert (e1.ready, e1.serving, e1.terminating) == (True, True, False)
    # Nothing ready: the serving-terminating one is used.
    cache.upsert_slice(endpoint_slice(endpoints=raw[1:3]))
    sp = must(cache)
    assert ep_ips(sp.cluster_endpoints) == ["198.18.1.3"]
    e3 = sp.cluster_endpoints[0]
    assert (e3.ready, e3.serving, e3.terminating) == (False, True, True)
    cache.upsert_slice(endpoint_slice(endpoints=raw[1:2]))
    assert must(cache).internal_verdict is Verdict.REJECT


# ---------------------------------------------------------------------------------------------- filtering


@pytest.mark.parametrize(
    ("labels", "proxy_name", "kept"),
    [
        ({}, "", True),
        ({"service.kubernetes.io/service-proxy-name": "other"}, "", False),
        ({"service.kubernetes.io/service-proxy-name": "other"}, "kproxy", False),
        ({"service.kubernetes.io/service-proxy-name": "kproxy"}, "kproxy", True),
        ({"service.kubernetes.io/service-proxy-name": ""}, "", False),
        ({"service.kubernetes.io/headless": ""}, "", False),
        ({"service.kubernetes.io/headless": "", "service.kubernetes.io/service-proxy-name": "kproxy"}, "kproxy", False),
        ({"app": "web"}, "kproxy", True),
    ],
)
def test_label_filtering(labels: dict[str, str], proxy_name: str, kept: bool) -> None:
    cache = make_cache(service_proxy_name=proxy_name)
    assert cache.upsert_service(service(labels=labels)) is kept
    assert (port(cache) is not None) is kept
    assert cache.errors() == {}


def test_label_added_then_removed() -> None:
    seen: list[int] = []
    cache = make_cache(on_change=lambda: seen.append(1))
    cache.upsert_service(service())
    cache.upsert_slice(endpoint_slice())
    state, changes = cache.snapshot()
    cache.commit(changes)
    assert state.get(HTTP, V4) is not None
    assert not cache.upsert_service(service(labels={"service.kubernetes.io/service-proxy-name": "someone-else"}))
    state, changes = cache.snapshot()
    assert state.get(HTTP, V4) is None and changes.services == {HTTP}
    cache.commit(changes)
    assert cache.upsert_service(service())  # the label removed: the service is back, with its endpoints
    state, changes = cache.snapshot()
    sp = state.get(HTTP, V4)
    assert sp is not None and sp.has_any_endpoints and changes.services == {HTTP}
    assert len(seen) == 4


@pytest.mark.parametrize(
    "obj",
    [
        service(cluster_ip="None"),
        service(cluster_ip=""),
        service(cluster_ip=[]),
        service(type_="ExternalName", cluster_ip="", externalName="example.com", ports=[]),
    ],
    ids=["clusterIP None", "clusterIP empty", "no clusterIP", "ExternalName"],
)
def test_headless_and_external_name_skipped(obj: dict[str, Any]) -> None:
    cache = make_cache()
    cache.upsert_service(service())
    assert port(cache) is not None
    assert not cache.upsert_service(obj)  # an update to headless removes the service
    state, _ = cache.snapshot()
    assert len(state) == 0 and cache.errors() == {} and cache.stats()["services"] == 0


@pytest.mark.parametrize(
    ("obj", "families"),
    [
        (endpoint_slice(address_type="FQDN", endpoints=[{"addresses": ["example.com"]}]), (V4, V6)),
        (endpoint_slice(service_name=None), (V4, V6)),
        (endpoint_slice(address_type="IPv6", endpoints=[endpoint("fd00:198:18::1")]), (V4,)),
        (endpoint_slice(address_type="IPv4"), (V6,)),
    ],
    ids=["FQDN", "no service-name label", "IPv6 slice on IPv4-only", "IPv4 slice on IPv6-only"],
)
def test_slices_ignored(obj: dict[str, Any], families: tuple[IPFamily, ...]) -> None:
    cache = make_cache(ip_families=families)
    assert not cache.upsert_slice(obj)
    assert cache.errors() == {} and cache.stats()["endpoints"] == 0


def test_slice_losing_its_label_is_removed() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_slice(endpoint_slice())
    assert must(cache).has_any_endpoints
    assert not cache.upsert_slice(endpoint_slice(service_name=None))
    assert not must(cache).has_any_endpoints


def test_slice_moving_to_another_service() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    cache.upsert_slice(endpoint_slice("shared"))
    assert must(cache).has_any_endpoints
    cache.upsert_slice(endpoint_slice("shared", service_name="api"))
    assert not must(cache).has_any_endpoints
    assert must(cache, ServicePortName("default", "api", "http", Protocol.TCP)).has_any_endpoints


# ---------------------------------------------------------------------------------------------- families


def test_ipv6_service_and_slice() -> None:
    cache = make_cache()
    cache.upsert_service(service(cluster_ip="fd00:198:18:0:0:0:0:10"))
    cache.upsert_slice(endpoint_slice(address_type="IPv6", endpoints=[endpoint("fd00:198:18::1:1")]))
    state, _ = cache.snapshot()
    assert state.get(HTTP, V4) is None
    sp = state.get(HTTP, V6)
    assert sp is not None and sp.cluster_ip == "fd00:198:18::10"
    assert str(sp.cluster_endpoints[0]) == "[fd00:198:18::1:1]:8080"


def test_dual_stack_gives_two_ports_with_one_name() -> None:
    cache = make_cache()
    svc = service(
        cluster_ip=["198.18.0.10", "fd00:198:18::10"],
        ipFamilies=["IPv4", "IPv6"],
        externalIPs=["198.18.5.5", "fd00:198:18::5:5"],
        loadBalancerSourceRanges=["198.18.100.0/24", "fd00:198:18:100::/64"],
        type_="LoadBalancer",
        status={"loadBalancer": {"ingress": [{"ip": "198.18.9.9"}, {"ip": "fd00:198:18::9:9"}]}},
    )
    svc["spec"]["ports"][0]["nodePort"] = 30080
    cache.upsert_service(svc)
    cache.upsert_slice(endpoint_slice("web-v4"))
    cache.upsert_slice(endpoint_slice("web-v6", address_type="IPv6", endpoints=[endpoint("fd00:198:18::1:1")]))
    state, changes = cache.snapshot()
    v4, v6 = state.get(HTTP, V4), state.get(HTTP, V6)
    assert v4 is not None and v6 is not None and v4.name == v6.name == HTTP
    assert changes.services == {HTTP} and len(state) == 2
    assert (v4.cluster_ip, v6.cluster_ip) == ("198.18.0.10", "fd00:198:18::10")
    assert (v4.external_ips, v6.external_ips) == (("198.18.5.5",), ("fd00:198:18::5:5",))
    assert (v4.load_balancer_ips, v6.load_balancer_ips) == (("198.18.9.9",), ("fd00:198:18::9:9",))
    assert v4.load_balancer_source_ranges == ("198.18.100.0/24",)
    assert v6.load_balancer_source_ranges == ("fd00:198:18:100::/64",)
    assert v4.node_port == v6.node_port == 30080
    assert ep_ips(v4.cluster_endpoints) == ["198.18.1.1"] and ep_ips(v6.cluster_endpoints) == ["fd00:198:18::1:1"]
    # An IPv6 slice change dirties the name but leaves the IPv4 value alone.
    cache.commit(changes)
    cache.upsert_slice(endpoint_slice("web-v6", address_type="IPv6", endpoints=[endpoint("fd00:198:18::1:2")]))
    state2, changes2 = cache.snapshot()
    assert changes2.services == {HTTP}
    assert state2.get(HTTP, V4) is v4 and state2.get(HTTP, V6) != v6
    # A single-family node only sees its family.
    only4 = make_cache(ip_families=(V4,))
    only4.upsert_service(svc)
    state, _ = only4.snapshot()
    assert state.get(HTTP, V6) is None and state.get(HTTP, V4) is not None


# ---------------------------------------------------------------------------------------------- policies


def lb_service(**kw: Any) -> dict[str, Any]:
    svc = service(type_="LoadBalancer", **kw)
    svc["spec"]["ports"][0]["nodePort"] = 30080
    return svc


@pytest.mark.parametrize(
    ("obj", "expect"),
    [
        (service(), dict(node_port=0, external_policy_local=False, health_check_node_port=0)),
        (
            service(externalTrafficPolicy="Local"),  # no external addresses: eTP means nothing
            dict(external_policy_local=False),
        ),
        (
            service(externalTrafficPolicy="Local", externalIPs=["198.18.5.5"]),
            dict(external_policy_local=True, external_ips=("198.18.5.5",), health_check_node_port=0),
        ),
        (
            lb_service(externalTrafficPolicy="Local", healthCheckNodePort=31000),
            dict(node_port=30080, external_policy_local=True, health_check_node_port=31000),
        ),
        (
            lb_service(externalTrafficPolicy="Cluster", healthCheckNodePort=31000),
            dict(node_port=30080, external_policy_local=False, health_check_node_port=0),
        ),
        (
            service(internalTrafficPolicy="Local"),
            dict(internal_policy_local=True, external_policy_local=False),
        ),
        (service(sessionAffinity="ClientIP"), dict(affinity_timeout=10800)),
        (
            service(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
            dict(affinity_timeout=60),
        ),
        (
            service(sessionAffinity="None", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
            dict(affinity_timeout=0),
        ),
        (
            lb_service(
                status={
                    "loadBalancer": {
                        "ingress": [
                            {"ip": "198.18.9.9"},
                            {"hostname": "lb.example.com"},
                            {"ip": "198.18.9.10", "ipMode": "Proxy"},
                            {"ip": "198.18.9.11", "ipMode": "VIP"},
                            {"ip": "fd00:198:18::9"},
                        ]
                    }
                }
            ),
            dict(load_balancer_ips=("198.18.9.9", "198.18.9.11")),
        ),
        (
            # status left over from an earlier LoadBalancer type does not count
            service(status={"loadBalancer": {"ingress": [{"ip": "198.18.9.9"}]}}),
            dict(load_balancer_ips=()),
        ),
        (
            lb_service(loadBalancerSourceRanges=[" 198.18.100.7/24", "198.18.200.0/25", "fd00:198:18::/64"]),
            dict(load_balancer_source_ranges=("198.18.100.0/24", "198.18.200.0/25")),
        ),
        (
            lb_service(
                annotations={"service.beta.kubernetes.io/load-balancer-source-ranges": "198.18.100.0/24, 198.18.7.0/24"}
            ),
            dict(load_balancer_source_ranges=()),  # the annotation is for cloud controllers; upstream ignores it
        ),
        (
            lb_service(
                loadBalancerSourceRanges=["198.18.50.0/24"],
                annotations={"service.beta.kubernetes.io/load-balancer-source-ranges": "198.18.100.0/24"},
            ),
            dict(load_balancer_source_ranges=("198.18.50.0/24",)),
        ),
        (service(type_="NodePort", ports=[{"name": "http", "port": 80, "nodePort": 30001}]), dict(node_port=30001)),
        (service(ports=[{"name": "http", "port": 80, "nodePort": 30001}]), dict(node_port=0)),
    ],
    ids=[
        "plain",
        "eTP Local without external",
        "eTP Local externalIPs",
        "LB eTP Local hcnp",
        "LB eTP Cluster no hcnp",
        "iTP Local",
        "affinity default",
        "affinity timeout",
        "affinity off",
        "LB ingress filtering",
        "ingress ignored for ClusterIP",
        "source ranges canonical + family",
        "source ranges annotation ignored",
        "source ranges spec only",
        "NodePort",
        "nodePort ignored for ClusterIP",
    ],
)
def test_service_fields(obj: dict[str, Any], expect: dict[str, Any]) -> None:
    cache = make_cache()
    assert cache.upsert_service(obj), cache.errors()
    sp = must(cache)
    for field_name, value in expect.items():
        assert getattr(sp, field_name) == value, field_name


@pytest.mark.parametrize(
    ("spec", "local_eps", "internal", "external"),
    [
        # no endpoints anywhere: reject everything
        ({}, None, Verdict.REJECT, None),
        ({"type": "NodePort"}, None, Verdict.REJECT, Verdict.REJECT),
        ({"type": "NodePort", "externalTrafficPolicy": "Local"}, None, Verdict.REJECT, Verdict.REJECT),
        ({"internalTrafficPolicy": "Local"}, None, Verdict.REJECT, None),
        # iTP=Local, endpoints only elsewhere: drop ClusterIP traffic (a ClusterIP has no external verdict)
        ({"internalTrafficPolicy": "Local"}, False, Verdict.DROP, None),
        ({"internalTrafficPolicy": "Local"}, True, Verdict.FORWARD, None),
        ({"type": "NodePort", "internalTrafficPolicy": "Local"}, False, Verdict.DROP, Verdict.FORWARD),
        # eTP=Local NodePort, endpoints only elsewhere: external dropped, internal forwarded
        ({"type": "NodePort", "externalTrafficPolicy": "Local"}, False, Verdict.FORWARD, Verdict.DROP),
        ({"type": "NodePort", "externalTrafficPolicy": "Local"}, True, Verdict.FORWARD, Verdict.FORWARD),
        ({"type": "NodePort"}, False, Verdict.FORWARD, Verdict.FORWARD),
    ],
)
def test_verdicts(spec: dict[str, Any], local_eps: bool | None, internal: Verdict, external: Verdict | None) -> None:
    cache = make_cache()
    spec = dict(spec)
    svc = service(type_=spec.pop("type", "ClusterIP"), **spec)
    svc["spec"]["ports"][0]["nodePort"] = 30080
    cache.upsert_service(svc)
    if local_eps is not None:
        cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.18.1.1", node=NODE if local_eps else "node-b")]))
    sp = must(cache)
    assert sp.internal_verdict is internal
    assert sp.has_external_addresses is (external is not None)
    if external is not None:
        assert sp.external_verdict is external


def test_local_sets_and_terminating_fallback() -> None:
    cache = make_cache()
    svc = service(type_="NodePort", externalTrafficPolicy="Local")
    svc["spec"]["ports"][0]["nodePort"] = 30080
    cache.upsert_service(svc)
    cache.upsert_slice(
        endpoint_slice(
            endpoints=[
                endpoint("198.18.1.1", node=NODE, ready=False, serving=True, terminating=True),
                endpoint("198.18.1.2", node="node-b"),
            ]
        )
    )
    sp = must(cache)
    assert ep_ips(sp.cluster_endpoints) == ["198.18.1.2"]
    assert ep_ips(sp.local_endpoints) == ["198.18.1.1"]  # terminating local fallback
    assert ep_ips(sp.external_endpoints) == ["198.18.1.1"] and ep_ips(sp.internal_endpoints) == ["198.18.1.2"]
    assert set(ep_ips(sp.serving_endpoints)) == {"198.18.1.1", "198.18.1.2"}


# ---------------------------------------------------------------------------------------------- topology / node


def hinted_slice() -> dict[str, Any]:
    return endpoint_slice(
        endpoints=[
            endpoint("198.18.1.1", zone="z1", for_zones=["z1"]),
            endpoint("198.18.1.2", zone="z2", for_zones=["z2"]),
        ]
    )


def test_zone_hints_follow_node_zone_and_zone_change_is_full() -> None:
    calls: list[int] = []
    cache = make_cache(on_change=lambda: calls.append(1))
    cache.set_node(node(zone="z1"))
    cache.upsert_service(service())
    cache.upsert_slice(hinted_slice())
    state, changes = cache.snapshot()
    assert ep_ips(state.get(HTTP, V4).cluster_endpoints) == ["198.18.1.1"]  # type: ignore[union-attr]
    assert state.node.zone == "z1"
    cache.commit(changes)
    assert not cache.snapshot()[1].full
    calls.clear()
    cache.set_node(node(zone="z2"))
    assert calls == [1]
    state, changes = cache.snapshot()
    assert changes.full and changes.services == {HTTP}
    assert ep_ips(state.get(HTTP, V4).cluster_endpoints) == ["198.18.1.2"]  # type: ignore[union-attr]
    # Until a full Changes is committed, every snapshot stays full.
    assert cache.snapshot()[1].full
    cache.commit(changes)
    assert not cache.snapshot()[1].full
    # No zone label: no zone filtering.
    cache.set_node(node())
    state, changes = cache.snapshot()
    assert changes.full and ep_ips(state.get(HTTP, V4).cluster_endpoints) == ["198.18.1.1", "198.18.1.2"]  # type: ignore[union-attr]


def test_node_hints() -> None:
    cache = make_cache()
    cache.set_node(node(zone="z1"))
    cache.upsert_service(service())
    cache.upsert_slice(
        endpoint_slice(
            endpoints=[
                endpoint("198.18.1.1", for_zones=["z1"], for_nodes=["node-b"]),
                endpoint("198.18.1.2", for_zones=["z1"], for_nodes=[NODE]),
            ]
        )
    )
    assert ep_ips(must(cache).cluster_endpoints) == ["198.18.1.2"]


def test_node_info_and_eligibility() -> None:
    calls: list[int] = []
    cache = make_cache(on_change=lambda: calls.append(1))
    assert cache.node_info().name == NODE and cache.node_info().eligible
    cache.set_node(node("someone-else", zone="zz", deleting=True))
    assert cache.node_info().zone is None and cache.node_info().eligible and calls == []
    cache.set_node(
        node(
            zone="z1",
            labels={"kubernetes.io/os": "linux"},
            pod_cidrs=["198.18.64.0/24", "fd00:198:18:64::/64"],
            addresses=[
                {"type": "InternalIP", "address": "198.18.200.1"},
                {"type": "Hostname", "address": "node-a"},
                {"type": "ExternalIP", "address": "fd00:198:18::200:1"},
            ],
        )
    )
    info = cache.node_info()
    assert info.zone == "z1" and info.labels["kubernetes.io/os"] == "linux" and info.eligible
    assert info.pod_cidrs == ("198.18.64.0/24", "fd00:198:18:64::/64")
    assert info.addresses == ("198.18.200.1", "fd00:198:18::200:1")
    _, changes = cache.snapshot()
    cache.commit(changes)
    calls.clear()
    # Eligibility alone needs no resync, but on_change fires so node health hears of it.
    same = node(
        zone="z1",
        labels={"kubernetes.io/os": "linux"},
        pod_cidrs=["198.18.64.0/24", "fd00:198:18:64::/64"],
        addresses=[
            {"type": "InternalIP", "address": "198.18.200.1"},
            {"type": "ExternalIP", "address": "fd00:198:18::200:1"},
        ],
        taints=[{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}],
    )
    cache.set_node(same)
    assert not cache.node_info().eligible and calls == [1]
    assert not cache.snapshot()[1].full
    same["spec"]["taints"] = []
    same["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cache.set_node(same)
    assert not cache.node_info().eligible
    same["metadata"].pop("deletionTimestamp")
    cache.set_node(same)
    assert cache.node_info().eligible and calls == [1, 1]  # ineligible -> eligible, each heard once
    # The podCIDR fallback, and deletion of the Node.
    single = node(zone="z1", labels={"kubernetes.io/os": "linux"})
    single["spec"] = {"podCIDR": "198.18.65.0/24"}
    cache.set_node(single)
    assert cache.node_info().pod_cidrs == ("198.18.65.0/24",)
    cache.set_node(None)
    assert not cache.node_info().eligible and cache.node_info().zone is None and cache.snapshot()[1].full


# ---------------------------------------------------------------------------------------------- changes / commit


def test_first_snapshot_is_full_and_commit_clears() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    state, changes = cache.snapshot()
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    assert changes.full and changes.services == {HTTP, api} and state.generation == changes.generation
    cache.commit(changes)
    state2, changes2 = cache.snapshot()
    assert changes2.empty and changes2.generation == changes.generation
    assert state2.family(V4) == state.family(V4)
    assert cache.snapshot(full=True)[1].full


def test_empty_cache_first_snapshot_is_full() -> None:
    cache = make_cache()
    state, changes = cache.snapshot()
    assert changes.full and not changes.services and len(state) == 0
    assert isinstance(state.services[V4], MappingProxyType) and isinstance(state.services[V6], MappingProxyType)


def test_only_changed_ports_are_dirty() -> None:
    cache = make_cache()
    two_ports = [{"name": "http", "port": 80}, {"name": "https", "port": 443}]
    cache.upsert_service(service(ports=two_ports))
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    cache.upsert_slice(endpoint_slice(ports=[{"name": "http", "port": 8080}, {"name": "https", "port": 8443}]))
    cache.commit(cache.snapshot()[1])
    # An endpoint of the https port only: only https is dirty.
    cache.upsert_slice(endpoint_slice(ports=[{"name": "http", "port": 8080}, {"name": "https", "port": 9443}]))
    https = ServicePortName("default", "web", "https", Protocol.TCP)
    _, changes = cache.snapshot()
    assert changes.services == {https} and not changes.full
    cache.commit(changes)
    # Re-applying an identical object changes nothing (a relist, a resync).
    calls: list[int] = []
    cache._on_change = lambda: calls.append(1)  # noqa: SLF001 - test hook
    assert cache.upsert_service(service(ports=two_ports))
    assert cache.snapshot()[1].empty and calls == []
    # A port removed: it is dirty, and gone from the state.
    cache.upsert_service(service(ports=two_ports[:1]))
    state, changes = cache.snapshot()
    assert changes.services == {https} and state.get(https, V4) is None
    # A service that changes only in ways that do not matter for proxying is not dirty.
    cache.commit(changes)
    cache.upsert_service(service(ports=two_ports[:1], labels={"team": "a"}))
    assert cache.snapshot()[1].empty


def test_change_during_sync_stays_dirty() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    _, first = cache.snapshot()
    cache.commit(first)
    cache.upsert_slice(endpoint_slice())
    state, changes = cache.snapshot()  # the runner starts a sync of this
    assert changes.services == {HTTP}
    cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.18.1.9")]))  # arrives during the sync
    cache.commit(changes)
    state, changes2 = cache.snapshot()
    assert changes2.services == {HTTP} and changes2.generation > changes.generation
    assert ep_ips(state.get(HTTP, V4).cluster_endpoints) == ["198.18.1.9"]  # type: ignore[union-attr]
    cache.commit(changes2)
    assert cache.snapshot()[1].empty


def test_failed_sync_loses_nothing() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    _, first = cache.snapshot()
    # The first sync failed: commit not called. Everything, and the full flag, stay.
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    _, second = cache.snapshot()
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    assert second.full and second.services == {HTTP, api}
    cache.commit(second)
    _, third = cache.snapshot()
    assert third.empty


def test_failed_services_stay_dirty() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    _, changes = cache.snapshot()
    cache.commit(changes, failed=[api])
    _, again = cache.snapshot()
    assert again.services == {api} and not again.full
    cache.commit(again)
    assert cache.snapshot()[1].empty


def test_a_service_refused_by_a_full_sync_is_retried_by_the_next_partial_one() -> None:
    """A full sync rewrites services that did not change; one the kernel refuses then must not wait for the next
    full sync (an hour by default) to be tried again."""
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    api = ServicePortName("default", "api", "http", Protocol.TCP)
    cache.commit(cache.snapshot()[1])
    _, full = cache.snapshot(full=True)
    assert full.full and not full.services
    cache.commit(full, failed=[api])
    _, again = cache.snapshot()
    assert again.services == {api} and not again.full
    cache.commit(again)
    assert cache.snapshot()[1].empty


def test_delete_service_marks_its_ports_dirty() -> None:
    cache = make_cache()
    cache.upsert_service(service(cluster_ip=["198.18.0.10", "fd00:198:18::10"]))
    cache.commit(cache.snapshot()[1])
    cache.delete_service("default", "web")
    cache.delete_service("default", "never-existed")
    state, changes = cache.snapshot()
    assert changes.services == {HTTP} and len(state) == 0


def test_trigger_times() -> None:
    clock = Clock(1_000_000.0)
    cache = make_cache(clock=clock)
    cache.upsert_service(service())
    cache.commit(cache.snapshot()[1])
    clock.now = 1_000_010.0
    cache.upsert_service(service(externalIPs=["198.18.5.5"]))
    old = "1970-01-02T00:00:00Z"  # before the cache started: not ours to measure
    new = "1970-01-12T13:46:50.5Z"  # 1_000_010.5
    cache.upsert_slice(endpoint_slice("s-old", annotations={"endpoints.kubernetes.io/last-change-trigger-time": old}))
    cache.upsert_slice(endpoint_slice("s-new", annotations={"endpoints.kubernetes.io/last-change-trigger-time": new}))
    _, changes = cache.snapshot()
    # only slices carry trigger times (a Service change has none, as upstream), with the slice's family
    assert changes.trigger_times == ((IPFamily.V4, 1_000_010.5),)
    # Kept until committed, gone after.
    assert cache.snapshot()[1].trigger_times == ((IPFamily.V4, 1_000_010.5),)
    cache.commit(changes)
    assert cache.snapshot()[1].trigger_times == ()


def test_state_is_immutable_and_stable() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    state, changes = cache.snapshot()
    cache.commit(changes)
    with pytest.raises(TypeError):
        state.services[V4][HTTP] = state.services[V4][HTTP]  # type: ignore[index]
    cache.upsert_service(service("api", cluster_ip="198.18.0.11"))
    cache.delete_service("default", "web")
    state2, _ = cache.snapshot()
    assert HTTP in state.services[V4] and len(state.services[V4]) == 1  # the old snapshot is untouched
    assert HTTP not in state2.services[V4] and len(state2.services[V4]) == 1


# ---------------------------------------------------------------------------------------------- relist, readiness


def test_replace_deletes_absent_objects() -> None:
    cache = make_cache()
    cache.upsert_service(service())
    cache.upsert_service(service("gone", cluster_ip="198.18.0.12"))
    cache.upsert_slice(endpoint_slice())
    cache.upsert_slice(endpoint_slice("gone-1", service_name="gone"))
    cache.commit(cache.snapshot()[1])
    cache.replace_services([service(), service("new", cluster_ip="198.18.0.13")])
    cache.replace_slices([endpoint_slice()])
    state, changes = cache.snapshot()
    gone = ServicePortName("default", "gone", "http", Protocol.TCP)
    new = ServicePortName("default", "new", "http", Protocol.TCP)
    assert changes.services == {gone, new}
    assert state.get(gone, V4) is None and state.get(new, V4) is not None and state.get(HTTP, V4) is not None
    assert cache.stats()["services"] == 2 and cache.stats()["endpoints"] == 1


def test_readiness_needs_both_lists() -> None:
    calls: list[int] = []
    cache = make_cache(on_change=lambda: calls.append(1))
    assert not cache.ready
    cache.replace_services([])
    assert not cache.ready and calls == []
    cache.mark_synced("nodes")
    assert not cache.ready
    cache.mark_synced("endpointslices")
    assert cache.ready and calls == [1]  # becoming ready asks for the first sync
    cache.mark_synced("endpointslices")
    assert calls == [1]
    with pytest.raises(ValueError, match="unknown kind"):
        cache.mark_synced("pods")
    other = make_cache()
    other.replace_slices([])
    other.mark_synced("services")
    assert other.ready


def test_on_change_is_called_outside_the_lock() -> None:
    holder: dict[str, ServiceCache] = {}
    seen: list[dict[str, int]] = []

    def callback() -> None:
        seen.append(holder["c"].stats())  # would deadlock if called under the cache's lock

    cache = make_cache(on_change=callback)
    holder["c"] = cache
    actions: list[Callable[[], Any]] = [
        lambda: cache.upsert_service(service()),
        lambda: cache.upsert_slice(endpoint_slice()),
        lambda: cache.delete_slice("default", "web-abc"),
        lambda: cache.delete_service("default", "web"),
        lambda: cache.replace_services([service()]),
        lambda: cache.replace_slices([endpoint_slice()]),
        lambda: cache.set_node(node(zone="z9")),
    ]
    worker = threading.Thread(target=lambda: [a() for a in actions], daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "on_change was called with the lock held"
    assert len(seen) == len(actions)


def test_stats() -> None:
    cache = make_cache()
    cache.upsert_service(service(cluster_ip=["198.18.0.10", "fd00:198:18::10"]))
    cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.18.1.1"), endpoint("198.18.1.2")]))
    cache.upsert_slice({"metadata": {"name": "broken"}})
    s = cache.stats()
    assert s["service_changes_total"] == 1 and s["endpoint_changes_total"] == 1
    assert s["service_changes_pending"] == 1 and s["endpoint_changes_pending"] == 1
    assert s["invalid_objects"] == 1 and s["services"] == 1 and s["endpoints"] == 2
    cache.snapshot()
    s = cache.stats()
    assert s["service_changes_pending"] == 0 and s["endpoint_changes_pending"] == 0 and s["service_ports"] == 2


def test_concurrent_writers_and_snapshots() -> None:
    """Two writers and the runner at once: snapshot generations never go back, and every slice whose upsert had
    returned before a snapshot began is in that snapshot (its service has endpoints); at the end, all 400 are."""
    cache = make_cache()
    stop = threading.Event()
    written: list[str] = []  # services whose slice upsert has returned (list.append is atomic)
    problems: list[str] = []
    snapshots = [0]

    def writer(offset: int) -> None:
        for i in range(200):
            name = f"s{offset}-{i}"
            cache.upsert_service(service(name, cluster_ip=f"198.18.{offset}.{i}"))
            cache.upsert_slice(endpoint_slice(f"{name}-x", service_name=name))
            written.append(name)

    def runner() -> None:
        last = -1
        while not stop.is_set() and len(problems) < 5:
            done = list(written)  # taken before the snapshot: each of these is complete in the cache already
            state, changes = cache.snapshot()
            snapshots[0] += 1
            if state.generation < last or changes.generation != state.generation:
                problems.append(f"generation {last} -> state {state.generation}, changes {changes.generation}")
            last = state.generation
            for name in done:
                sp = state.get(ServicePortName("default", name, "http", Protocol.TCP), V4)
                if sp is None or not sp.has_any_endpoints:
                    problems.append(f"{name}'s slice was written before snapshot {state.generation}, which has {sp}")
                    break
            cache.commit(changes)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (1, 2)]
    reader = threading.Thread(target=runner)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    reader.join(timeout=60)
    assert not problems, problems
    assert snapshots[0] > 1  # the runner did run alongside the writers
    state, _ = cache.snapshot()
    assert len(state) == 400
    assert all(sp.has_any_endpoints for sp in state)


def test_bulk_rebuild_leaves_the_garbage_collector_as_it_was() -> None:
    cache = make_cache()
    cache.replace_services([service(f"s{i}", cluster_ip=f"198.18.{i // 256}.{i % 256}") for i in range(600)])
    assert gc.isenabled()
    state, _ = cache.snapshot()
    assert len(state) == 600 and gc.isenabled()
    gc.disable()
    try:
        cache.replace_services([])
        cache.snapshot()
        assert not gc.isenabled()  # someone else's choice is left alone
    finally:
        gc.enable()


def test_node_never_seen_stays_eligible() -> None:
    cache = make_cache()
    cache.set_node(None)  # a manifest folder without a Node: upstream keeps the node eligible
    assert cache.node_info().eligible
    cache.set_node(node())
    cache.set_node(None)  # seen, then gone: being deleted
    assert not cache.node_info().eligible


def test_port_names_are_dns_labels_as_the_api_server_checks() -> None:
    # Service and EndpointSlice port names are DNS-1123 labels (up to 63 characters, digits allowed), not the
    # 15-character IANA_SVC_NAME of container ports: a valid Service must never be rejected for its port name.
    cache = make_cache()
    long_name = "prometheus-metrics-tls"
    assert cache.upsert_service(service(ports=[{"name": long_name, "port": 80}, {"name": "80", "port": 81}]))
    assert not cache.errors()


def test_missing_serving_condition_means_serving() -> None:
    # upstream endpointslicecache.go: serving == nil || *serving; a terminating endpoint without the condition is
    # still the terminating fallback
    cache = make_cache()
    cache.upsert_service(service())
    cond = {"ready": False, "terminating": True}
    cache.upsert_slice(endpoint_slice("web-1", endpoints=[dict(endpoint("198.18.1.3"), conditions=cond)]))
    sp = must(cache)
    assert [e.ip for e in sp.cluster_endpoints] == ["198.18.1.3"] and sp.cluster_endpoints[0].serving


def test_leading_zero_ipv4_is_read_as_decimal_as_upstreams_parse_ip_sloppy() -> None:
    """API servers before 1.22 accepted IPv4 parts with leading zeros and still hold such objects; upstream parses
    them with ParseIPSloppy (decimal), so a whole Service must not be refused for it."""
    cache = make_cache()
    cache.upsert_service(
        service(
            cluster_ip="198.018.0.010",
            type_="LoadBalancer",
            externalIPs=["198.019.100.0005"],
            loadBalancerSourceRanges=["198.018.001.0/24"],
            status={"loadBalancer": {"ingress": [{"ip": "198.019.200.01"}]}},
        )
    )
    cache.upsert_slice(endpoint_slice(endpoints=[endpoint("198.018.1.001")]))
    sp = port(cache)
    assert sp is not None and not cache.errors()
    assert sp.cluster_ip == "198.18.0.10" and sp.external_ips == ("198.19.100.5",)
    assert sp.load_balancer_ips == ("198.19.200.1",) and sp.load_balancer_source_ranges == ("198.18.1.0/24",)
    assert [e.ip for e in sp.cluster_endpoints] == ["198.18.1.1"]
    # still not an address: refused, and named
    cache.upsert_service(service("bad", cluster_ip="198.18.0.11", externalIPs=["198.0256.1.1"]))
    assert any("198.0256.1.1" in why for why in cache.errors().values())


def test_a_list_that_fails_part_way_still_asks_for_a_sync_for_what_it_upserted() -> None:
    """The API source streams a list into ``replace_*`` page by page; when a later page fails, the objects of the
    earlier ones are already in the cache. Without a notification they would wait for an unrelated change: the
    relist finds them unchanged and asks for nothing."""
    calls: list[int] = []
    cache = ServiceCache(NODE, ip_families=(IPFamily.V4,), on_change=lambda: calls.append(1))

    def pages(objs: list[dict[str, Any]]) -> Any:
        yield from objs
        raise ConnectionError("the second page's request failed")

    with pytest.raises(ConnectionError):
        cache.replace_services(pages([service("a", cluster_ip="198.18.0.21")]))
    assert calls == [1]
    with pytest.raises(ConnectionError):
        cache.replace_slices(pages([endpoint_slice("a-1", service_name="a", endpoints=[endpoint("10.0.0.5")])]))
    assert calls == [1, 1]
    with pytest.raises(ConnectionError):
        cache.replace_services(pages([service("a", cluster_ip="198.18.0.21")]))  # nothing new: nothing asked
    assert calls == [1, 1]
