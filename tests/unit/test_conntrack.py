"""The conntrack reconciler's pure part: which service addresses it watches, which entries it calls stale, and
when the daemon needs to run it. (tests/integration/test_conntrack.py runs it against real conntrack entries.)"""

from __future__ import annotations

from kproxy.conntrack import is_stale, reconcile_needed, service_targets
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

UDP = ServicePortName("ns", "dns", "dns", Protocol.UDP)
TCP = ServicePortName("ns", "web", "http", Protocol.TCP)


def _sp(spn: ServicePortName, fam: IPFamily, cip: str, eps: tuple[Endpoint, ...], **kw: object) -> ServicePort:
    kw.setdefault("serving_endpoints", eps)
    return ServicePort(spn, fam, cip, 53, cluster_endpoints=eps, has_any_endpoints=bool(eps), **kw)  # type: ignore[arg-type]


def _state(*sps: ServicePort) -> ProxyState:
    services: dict[IPFamily, dict[ServicePortName, ServicePort]] = {IPFamily.V4: {}, IPFamily.V6: {}}
    for sp in sps:
        services[sp.family][sp.name] = sp
    return ProxyState(services=services, node=NodeInfo("node-1"))


def test_targets_cover_every_udp_address_of_the_family() -> None:
    ep = Endpoint("198.18.64.5", 5353)
    local = Endpoint("198.18.64.6", 5353, is_local=True)
    sp = _sp(
        UDP,
        IPFamily.V4,
        "198.19.0.10",
        (ep,),
        node_port=30053,
        external_ips=("198.18.200.1",),
        load_balancer_ips=("198.18.200.2",),
        local_endpoints=(local,),
        serving_endpoints=(ep, local),
        external_policy_local=True,
    )
    v6 = _sp(UDP, IPFamily.V6, "fd00:198:18::a", (Endpoint("fd00:198:18:1::5", 5353),))
    tcp = _sp(TCP, IPFamily.V4, "198.19.0.11", (ep,))
    state = _state(sp, v6, tcp)
    targets = service_targets(state, IPFamily.V4, ["198.18.0.1", "fd00:198:18::1"])
    assert set(targets) == {("198.19.0.10", 53), ("198.18.200.1", 53), ("198.18.200.2", 53), ("198.18.0.1", 30053)}
    # Every endpoint the node may still reach for the port counts, whichever policy picks it now.
    assert all(t.endpoints == {("198.18.64.5", 5353), ("198.18.64.6", 5353)} for t in targets.values())
    v6_targets = service_targets(state, IPFamily.V6, ["198.18.0.1", "fd00:0198:0018::1"])
    assert set(v6_targets) == {("fd00:198:18::a", 53)}  # no node port on the v6 port; canonical text


def test_stale_rules() -> None:
    (target,) = service_targets(_state(_sp(UDP, IPFamily.V4, "198.19.0.10", (Endpoint("198.18.64.5", 5353),))),
                                IPFamily.V4, []).values()  # fmt: skip
    vip = ("198.19.0.10", 53)
    assert not is_stale(vip, ("198.18.64.5", 5353), target)  # DNATed to a live endpoint
    assert is_stale(vip, ("198.18.64.9", 5353), target)  # DNATed to a gone endpoint
    assert is_stale(vip, ("198.18.64.5", 9999), target)  # same pod, old target port
    assert is_stale(vip, vip, target)  # never DNATed, and the service has endpoints now
    (empty,) = service_targets(_state(_sp(UDP, IPFamily.V4, "198.19.0.10", ())), IPFamily.V4, []).values()
    assert is_stale(vip, ("198.18.64.5", 5353), empty)  # zero endpoints: DNATed entries all go (#139628)
    assert not is_stale(vip, vip, empty)  # the cached rejection is right while there are no endpoints


def test_reconcile_needed() -> None:
    udp = _sp(UDP, IPFamily.V4, "198.19.0.10", ())
    tcp = _sp(TCP, IPFamily.V4, "198.19.0.11", ())
    assert reconcile_needed(Changes(full=False, services=frozenset({UDP})), _state(tcp))  # also a removed one
    assert not reconcile_needed(Changes(full=False, services=frozenset({TCP})), _state(udp, tcp))
    assert reconcile_needed(Changes(full=True), _state(udp))
    assert not reconcile_needed(Changes(full=True), _state(tcp))
    assert not reconcile_needed(Changes(full=False), _state(udp))


def test_flows_to_serving_terminating_endpoints_survive() -> None:
    # One ready endpoint and one serving-but-terminating: traffic now goes to the ready one only, but an existing
    # UDP flow to the terminating pod must survive until that pod stops serving (upstream cleanup.go).
    from kproxy.cache import ServiceCache

    cache = ServiceCache("node-1", ip_families=(IPFamily.V4,))
    cache.upsert_service(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"namespace": "ns", "name": "dns"},
            "spec": {"clusterIP": "198.19.0.10", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]},
        }
    )
    conds = [{"ready": True}, {"ready": False, "serving": True, "terminating": True}]
    cache.upsert_slice(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"namespace": "ns", "name": "dns-1", "labels": {"kubernetes.io/service-name": "dns"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"}],
            "endpoints": [
                {"addresses": [f"198.18.64.{5 + i}"], "conditions": c, "nodeName": "node-2"}
                for i, c in enumerate(conds)
            ],
        }
    )
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, _ = cache.snapshot()
    (sp,) = state
    assert [e.ip for e in sp.cluster_endpoints] == ["198.18.64.5"]
    (target,) = service_targets(state, IPFamily.V4, []).values()
    assert not is_stale(("198.19.0.10", 53), ("198.18.64.6", 5353), target)
    assert is_stale(("198.19.0.10", 53), ("198.18.64.7", 5353), target)


def test_targets_follow_the_backends_answerers() -> None:
    """Who may answer a UDP flow is the backend's to say: a proxy that answers from the node keeps its flows."""
    from types import MappingProxyType

    from kproxy.conntrack import service_targets
    from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

    name = ServicePortName("ns", "dns", "dns", Protocol.UDP)
    ep = Endpoint("198.18.65.11", 53)
    sp = ServicePort(name, IPFamily.V4, "198.19.0.10", 53, cluster_endpoints=(ep,), serving_endpoints=(ep,))
    state = ProxyState({IPFamily.V4: MappingProxyType({name: sp})}, NodeInfo("n"))
    default = service_targets(state, IPFamily.V4, [])
    assert default[("198.19.0.10", 53)].endpoints == {("198.18.65.11", 53)}
    proxied = service_targets(state, IPFamily.V4, [], lambda _sp: [("198.18.0.11", 40123)])
    assert proxied[("198.19.0.10", 53)].endpoints == {("198.18.0.11", 40123)}
