"""Builders of ServicePorts and a render context for the iptables render tests (not a test module)."""

from __future__ import annotations

from kproxy.backends.iptables import render
from kproxy.config import ProxyConfig
from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ServicePort, ServicePortName

CFG = ProxyConfig(cluster_cidrs=("198.18.0.0/16", "fd00:198:18::/56"))
NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",), addresses=("198.19.255.1",))
CTX4 = render.make_context(CFG, NODE, IPFamily.V4)


def spn(name: str, port: str = "http", proto: Protocol = Protocol.TCP, ns: str = "ns1") -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def ep(ip: str, port: int = 8080, local: bool = False) -> Endpoint:
    return Endpoint(ip, port, is_local=local, node_name="node-a" if local else "node-b")


def svc(name: str, eps: tuple[Endpoint, ...] = (), **kw: object) -> ServicePort:
    """Service port ``ns1/<name>:http`` (TCP 80), IPv6 when its ``cluster_ip`` is; keywords override fields."""
    fam = IPFamily.V6 if ":" in str(kw.get("cluster_ip", "")) else IPFamily.V4
    base: dict[str, object] = dict(
        name=spn(name),
        family=fam,
        cluster_ip="198.18.200.1",
        port=80,
        cluster_endpoints=eps,
        has_any_endpoints=bool(eps),
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


def lines(sp: ServicePort, ctx: render.Context = CTX4) -> list[str]:
    """Every rule of one service port: its lines in the shared chains, then its own chains'."""
    frag = render.render_service(sp, ctx)
    out: list[str] = []
    for key in render.ALL_TOP:
        out.extend(frag.top.get(key, ()))
    out.extend(frag.rules)
    return out
