"""The nftables mode's localhost NodePorts, rendered (pure; no root): which service ports get a listener on
127.0.0.1 (``backends/nftables/localhost.py``), that it rides in the fragment without touching the table's elements
or digest, and that the core's decision (``FamilyContext.localhost_nodeports``) turns it on and off."""

from __future__ import annotations

import dataclasses

from kproxy.backends.nftables import render
from kproxy.backends.nftables.localhost import Listen, listen_for
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext, LocalDetect

OFF = FamilyContext(IPFamily.V4, local=LocalDetect("cidr", ("198.18.0.0/16",)))
ON = dataclasses.replace(OFF, localhost_nodeports=True)


def svc(name: str, eps: tuple[Endpoint, ...], proto: Protocol = Protocol.TCP, **kw: object) -> ServicePort:
    base: dict[str, object] = dict(
        name=ServicePortName("ns1", name, "p", proto),
        family=IPFamily.V4,
        cluster_ip="198.19.0.1",
        port=80,
        node_port=30080,
        cluster_endpoints=eps,
        has_any_endpoints=bool(eps),
        serving_endpoints=eps,
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


A, B = Endpoint("198.18.1.5", 8080, node_name="n1"), Endpoint("198.18.2.5", 8080, node_name="n2")


def test_a_listener_per_nodeport_with_the_cluster_endpoints() -> None:
    sp = svc("web", (B, A), affinity_timeout=30)
    assert listen_for(sp, ON) == Listen("tcp", 30080, (("198.18.1.5", 8080), ("198.18.2.5", 8080)), 30)
    assert listen_for(svc("dns", (A,), Protocol.UDP), ON) == Listen("udp", 30080, (("198.18.1.5", 8080),), 0)
    # the node's own traffic short-circuits to the cluster endpoints whatever externalTrafficPolicy says
    local = svc("l", (A, B), external_policy_local=True, local_endpoints=())
    assert listen_for(local, ON) is not None and len(listen_for(local, ON).endpoints) == 2  # type: ignore[union-attr]


def test_no_listener() -> None:
    assert listen_for(svc("web", (A,)), OFF) is None  # the core said no (flag off, or loopback not let in)
    assert listen_for(svc("web", (A,), node_port=0), ON) is None  # no NodePort
    assert listen_for(svc("empty", ()), ON) is None  # no endpoints: nothing listens, so the client is refused
    assert listen_for(svc("s", (A,), Protocol.SCTP), ON) is None  # the relay has no SCTP
    v6 = dataclasses.replace(ON, family=IPFamily.V6)
    assert listen_for(svc("w6", (Endpoint("fd00::5", 8080),), family=IPFamily.V6, cluster_ip="fd00::1"), v6) is None


def test_it_rides_in_the_fragment_without_changing_the_table() -> None:
    sp = svc("web", (A, B))
    on, off = render.render_service(sp, ON), render.render_service(sp, OFF)
    assert on.localhost == listen_for(sp, ON) and off.localhost is None
    # the table's share is the context's alone: elements and digest as without localhost NodePorts
    assert (on.elements, on.digest, on.shared) == (off.elements, off.digest, off.shared)
    assert on != off  # yet the fragments differ, so a change of the decision rewrites the relay's listeners
    assert render.render_service(svc("c", (A,), node_port=0), ON).localhost is None
