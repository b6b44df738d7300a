"""The bpf mode's localhost NodePorts, rendered (pure; no root): the core's decision puts 127.0.0.1 among the family's
NodePort addresses, so every NodePort gets a socket frontend there (served at connect(), no rule), while the
companion table's ``nodeport-cidrs`` (external packets) keeps loopback out."""

from __future__ import annotations

from kproxy.backends.bpf import render
from kproxy.backends.bpf.proxier import BpfProxier
from kproxy.config import ProxyConfig
from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import resolve

NODE = NodeInfo("node-1", addresses=("198.18.0.11",))
ADDRS = ("127.0.0.1", "198.18.0.11")


def sp(proto: Protocol = Protocol.TCP) -> ServicePort:
    eps = (Endpoint("198.18.65.11", 8080, node_name="node-2"),)
    return ServicePort(
        ServicePortName("ns1", "np", "p", proto),
        IPFamily.V4,
        "198.19.0.1",
        80,
        node_port=30080,
        cluster_endpoints=eps,
        has_any_endpoints=True,
        serving_endpoints=eps,
    )


def context(cfg: ProxyConfig) -> render.Context:
    fc = resolve(cfg, NODE, ADDRS, families=(IPFamily.V4,)).family(IPFamily.V4)
    proxier = BpfProxier.__new__(BpfProxier)  # context() reads only its arguments: no maps, no programs
    return proxier.context(fc, ProxyState({}, NODE))  # type: ignore[arg-type]


def test_a_frontend_on_127_0_0_1_per_nodeport() -> None:
    ctx = context(ProxyConfig())
    assert "127.0.0.1" in ctx.nodeport_addresses
    assert not any(c.startswith("127.") for c in ctx.nodeport_cidrs)  # external packets: never loopback
    for proto, number in ((Protocol.TCP, 6), (Protocol.UDP, 17)):
        fronts = {f.key: f for f in render.render(sp(proto), ctx).frontends}
        local = fronts[("127.0.0.1", 30080, number)]
        assert local.backends == (("198.18.65.11", 8080),)
        assert fronts[("198.18.0.11", 30080, number)].backends == local.backends  # as the node's own address


def test_none_when_off() -> None:
    for cfg in (ProxyConfig(localhost_nodeports=False), ProxyConfig(nodeport_addresses=("198.18.0.0/24",))):
        ctx = context(cfg)
        assert "127.0.0.1" not in ctx.nodeport_addresses
        assert not [f for f in render.render(sp(), ctx).frontends if f.address == "127.0.0.1"]
