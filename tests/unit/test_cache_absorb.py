"""What absorbing a list and taking the first snapshot cost, counted in work rather than time (issue 22's restart:
the cache was the largest part of it): a well-formed object builds no label or message string, a slice's endpoints
are built straight from their entries and sorted only when listed out of order, a port's topology is settled at the
first endpoint without hints, and the fast paths give exactly what the general ones give (hypothesis)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kproxy.endpointslices as endpointslices
import kproxy.objects as objects
import kproxy.serviceport as serviceport
import kproxy.validation as validation
from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.model import Endpoint, IPFamily, ServicePortName
from kproxy.serviceport import parse_service
from kproxy.topology import categorize_endpoints, topology_mode

from .cache_objects import endpoint, endpoint_slice, service

NODE = "node-1"
V4, V6 = IPFamily.V4, IPFamily.V6
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None)


class _Counter:
    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


def test_a_well_formed_list_and_its_snapshot_build_no_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels (``"Service ns/name"``, escaped for logs) are for rejected objects: before, each object of a list
    built one to find its name, each label entry its message, and the snapshot one per service."""
    clip = _Counter(objects.clip)
    printable = _Counter(validation.printable)
    monkeypatch.setattr(objects, "clip", clip)
    monkeypatch.setattr(validation, "printable", printable)
    n = 50
    cache = ServiceCache(node_name=NODE, ip_families=(V4,))
    cache.replace_services(synthetic.service(i) for i in range(1, n + 1))
    cache.replace_slices(synthetic.endpoint_slice(i, 4) for i in range(1, n + 1))
    state, _ = cache.snapshot()
    assert len(state) == n and not cache.errors()
    assert (clip.calls, printable.calls) == (0, 0)
    # a rejected object still gets its label, and a bad label entry its message
    bad = synthetic.service(n + 1)
    bad["metadata"]["labels"] = {"app": 7}
    cache.replace_services([*(synthetic.service(i) for i in range(1, n + 1)), bad])
    assert "metadata.labels[app]: expected a string" in cache.errors()[f"Service bench/{synthetic.service_name(n + 1)}"]
    assert clip.calls and printable.calls


def test_an_ordered_slice_is_not_sorted_and_an_unordered_one_is(monkeypatch: pytest.MonkeyPatch) -> None:
    sorts = _Counter(sorted)
    monkeypatch.setattr(endpointslices, "sorted", sorts, raising=False)
    ips = [f"198.18.1.{i}" for i in (1, 2, 3, 10, 20)]
    _, ordered = endpointslices.parse_slice(endpoint_slice(endpoints=[endpoint(ip) for ip in ips]), (V4,), NODE, 0)
    assert sorts.calls == 0 and [e.ip for e in ordered.endpoints] == ips
    shuffled = [ips[3], ips[0], ips[4], ips[2], ips[1]]
    _, other = endpointslices.parse_slice(endpoint_slice(endpoints=[endpoint(ip) for ip in shuffled]), (V4,), NODE, 0)
    assert sorts.calls == 1 and other.endpoints == ordered.endpoints


def test_the_first_ready_endpoint_without_hints_settles_the_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _Counter(lambda ep: ep._rare[3])
    monkeypatch.setattr(Endpoint, "node_hints", property(reads))
    eps = tuple(Endpoint(f"198.18.1.{i}", 80, node_name="node-2") for i in range(1, 11))
    assert topology_mode(eps, NODE, None) == ""
    assert reads.calls == 1  # before: one per ready endpoint
    cat = categorize_endpoints(eps, uses_cluster=True, uses_local=False, node_name=NODE, zone=None)
    assert cat.cluster is eps and cat.has_any


# -- the fast paths against the general ones

hint_sets = st.sampled_from([(), ("zone-a",), ("zone-b",), ("zone-a", "zone-b")])
node_hint_sets = st.sampled_from([(), (NODE,), ("node-2",)])
endpoint_st = st.builds(
    lambda ready, serving, terminating, local, zones, nodes: Endpoint(
        "198.18.1.1",
        80,
        ready=ready,
        serving=serving,
        terminating=terminating,
        node_name=NODE if local else "node-2",
        is_local=local,
        zone_hints=frozenset(zones),
        node_hints=frozenset(nodes),
    ),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    hint_sets,
    node_hint_sets,
)


def _reference_mode(endpoints: list[Endpoint], node_name: str, zone: str | None) -> str:
    """Upstream's topologyModeFromHints, as plainly as it reads."""
    ready = [ep for ep in endpoints if ep.ready]
    if not ready:
        return ""
    if all(ep.node_hints for ep in ready) and any(node_name in ep.node_hints for ep in ready):
        return "PreferSameNode"
    if all(ep.zone_hints for ep in ready) and zone is not None and any(zone in ep.zone_hints for ep in ready):
        return "PreferSameZone"
    return ""


@SETTINGS
@given(st.lists(endpoint_st, max_size=8), st.sampled_from([None, "zone-a", "zone-c"]))
def test_topology_mode_is_upstreams(endpoints: list[Endpoint], zone: str | None) -> None:
    assert topology_mode(endpoints, NODE, zone) == _reference_mode(endpoints, NODE, zone)


raw_endpoint_st = st.fixed_dictionaries(
    {"addresses": st.lists(st.sampled_from(["198.18.1.9", "198.18.1.10", "198.18.2.1", "198.18.1.77"]), min_size=1)},
    optional={
        "conditions": st.fixed_dictionaries(
            {},
            optional={
                "ready": st.sampled_from([True, False, None]),
                "serving": st.sampled_from([True, False, None]),
                "terminating": st.sampled_from([True, False, None]),
            },
        ),
        "nodeName": st.sampled_from([NODE, "node-2", None]),
        "zone": st.sampled_from(["zone-a", None]),
    },
)


@SETTINGS
@given(st.lists(raw_endpoint_st, max_size=8), st.randoms(use_true_random=False))
def test_the_fast_slice_path_gives_what_the_checked_path_gives(raw: list[dict[str, Any]], rnd: random.Random) -> None:
    """Every endpoint through the fast path (which builds each Endpoint at once and sorts only when needed) and every
    one through the checked path: the same endpoints, in the same order, and the same duplicate notes."""
    rnd.shuffle(raw)
    obj = endpoint_slice(endpoints=raw)
    fast = endpointslices.parse_slice(obj, (V4,), NODE, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(endpointslices, "_endpoint_fast", lambda *a: None)
        checked = endpointslices.parse_slice(obj, (V4,), NODE, 0)
    assert fast[0] == checked[0]
    assert fast[1].endpoints == checked[1].endpoints and fast[1].warning == checked[1].warning
    keys = [int.from_bytes(bytes(map(int, e.ip.split("."))), "big") for e in fast[1].endpoints]
    assert keys == sorted(set(keys))


@pytest.mark.parametrize(
    "obj",
    [
        service(),
        service(cluster_ip=["198.18.0.10", "fd00:198:18::a"], ipFamilies=["IPv4", "IPv6"]),
        service(
            type_="LoadBalancer",
            ports=[
                {"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080},
                {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
            ],
            externalIPs=["198.18.5.5", "198.18.5.5", "fd00:198:18::5"],
            externalTrafficPolicy="Local",
            healthCheckNodePort=31000,
            loadBalancerSourceRanges=["198.18.6.0/24"],
            sessionAffinity="ClientIP",
            status={"loadBalancer": {"ingress": [{"ip": "198.18.7.7"}, {"ip": "198.18.7.8", "ipMode": "Proxy"}]}},
        ),
    ],
)
def test_templates_equal_the_constructors(obj: dict[str, Any]) -> None:
    _, info = parse_service(obj, (V4, V6), "")
    assert info.ports
    for t in info.ports:
        # the same field values through the dataclasses' own __init__
        built = dataclasses.replace(t, name=ServicePortName(t.name.namespace, t.name.name, t.name.port, t.protocol))
        assert type(t) is type(built) and t == built and hash(t) == hash(built)
        assert type(t.name) is type(built.name) and t.name == built.name and hash(t.name) == hash(built.name)
        assert dataclasses.astuple(t) == dataclasses.astuple(built)


def test_a_port_list_many_objects_repeat_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    names = _Counter(validation.port_name)
    monkeypatch.setattr(validation, "port_name", names)
    ports = [{"name": "memo-probe", "port": 8443, "protocol": "TCP", "targetPort": 9443}]
    slice_ports = [{"name": "memo-probe", "port": 9443, "protocol": "TCP"}]
    cache = ServiceCache(node_name=NODE, ip_families=(V4,))
    n = 30
    for i in range(1, n + 1):
        assert cache.upsert_service(service(f"web-{i}", cluster_ip=f"198.18.0.{i}", ports=ports))
        eps = [endpoint(f"198.18.1.{i}")]
        assert cache.upsert_slice(
            endpoint_slice(f"web-{i}-a", service_name=f"web-{i}", endpoints=eps, ports=slice_ports)
        )
    assert names.calls <= 2  # before: one per Service and one per slice
    state, _ = cache.snapshot()
    assert len(state) == n and all(sp.port == 8443 and sp.cluster_endpoints[0].port == 9443 for sp in state)


port_value = st.one_of(
    st.none(),
    st.sampled_from(["", "http", "dns", "TCP", "UDP", "SCTP", "tcp", "Bad_Name", "80"]),
    st.integers(-1, 70000),
    st.booleans(),
    st.floats(allow_nan=False, max_value=1e5, min_value=-1),
    st.just([80]),
)
port_entry = st.one_of(
    st.dictionaries(st.sampled_from(["name", "protocol", "port", "nodePort", "targetPort"]), port_value),
    st.sampled_from([None, "x", 80, []]),
)


def _outcome(parse: Any, arg: Any) -> Any:
    try:
        return ("ok", parse(arg))
    except ValueError as exc:
        return ("error", str(exc))


@SETTINGS
@given(st.lists(port_entry, min_size=1, max_size=4))
def test_memoized_port_parses_give_what_the_parsers_give(raw: list[Any]) -> None:
    """The memo answers exactly as the parser: the same ports, or the same error naming the same field."""
    assert _outcome(serviceport._ports, {"ports": raw}) == _outcome(serviceport._checked_ports, raw)
    assert _outcome(serviceport._ports, {"ports": raw}) == _outcome(serviceport._ports, {"ports": raw})
    slice_obj = endpoint_slice(ports=raw)
    memo = _outcome(lambda o: endpointslices.parse_slice(o, (V4,), NODE, 0)[1].ports, slice_obj)
    assert memo == _outcome(endpointslices._checked_ports, raw)
