"""The mixed synthetic state of ``kproxy bench sync --state mixed``: the default state's services (``synthetic``) with
the external paths a real cluster has, so that a benchmark also times NodePorts, externalIPs, load-balancer IPs,
``externalTrafficPolicy: Local`` and services without endpoints (and, in the bpf mode, the nftables companion table
that only external traffic needs).

Service ``i`` keeps its ClusterIP, port and endpoints from ``synthetic``; its kind follows ``i % 20``:

- 1: ``NodePort`` (eTP Cluster);
- 2: ``LoadBalancer`` with a load-balancer IP and a node port, eTP Local (and a health-check node port);
- 3: ``ClusterIP`` with an external IP, eTP Local;
- 4: ``LoadBalancer`` with a load-balancer IP and no node port, eTP Cluster;
- 11: ``ClusterIP`` with an external IP, eTP Cluster;
- 5 and 15: no endpoints (an EndpointSlice with none);
- others: plain ``ClusterIP`` (every tenth one UDP, as in the default state).

Every address a service claims is its own (the core refuses two services on one address, protocol and port):
external IPs from 198.18.128.0/18 and load-balancer IPs from 198.18.192.0/18, both indexed by ``i``, and node
ports (and health-check node ports) handed out in order from 30000-32767 to the services that need them, which is
what bounds the state's size (MAX_SERVICES).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

from kproxy.bench import synthetic

EXTERNAL_NET = ipaddress.ip_network("198.18.128.0/18")
LB_NET = ipaddress.ip_network("198.18.192.0/18")
NODE_PORT_BASE = 30000
NODE_PORT_COUNT = 32767 - NODE_PORT_BASE + 1
PERIOD = 20
KINDS = {
    1: "nodeport",
    2: "lb-local",
    3: "externalip-local",
    4: "lb",
    5: "no-endpoints",
    11: "externalip",
    15: "no-endpoints",
}
#: node ports used per PERIOD services: kind 1 takes one, kind 2 two (its health-check node port too)
_PORTS_PER_PERIOD = 3
MAX_SERVICES = min(
    EXTERNAL_NET.num_addresses - 2, LB_NET.num_addresses - 2, NODE_PORT_COUNT * PERIOD // _PORTS_PER_PERIOD - PERIOD
)


def kind(i: int) -> str:
    return KINDS.get(i % PERIOD, "clusterip")


def has_endpoints(i: int) -> bool:
    return kind(i) != "no-endpoints"


def external_ip(i: int) -> str:
    return str(EXTERNAL_NET.network_address + i)


def lb_ip(i: int) -> str:
    return str(LB_NET.network_address + i)


def _node_ports(i: int) -> tuple[int, int]:
    """(node port, health-check node port) of service ``i`` (0: none): the services before it in the same order
    took the ports below."""
    periods, rest = divmod(i, PERIOD)
    used = periods * _PORTS_PER_PERIOD + (rest > 1) * 1 + (rest > 2) * 2  # kinds 1 and 2 before i
    k = kind(i)
    if k == "nodeport":
        return NODE_PORT_BASE + used, 0
    if k == "lb-local":
        return NODE_PORT_BASE + used, NODE_PORT_BASE + used + 1
    return 0, 0


def service(i: int) -> dict[str, Any]:
    """Service ``i`` of the mixed state, as the API returns it."""
    if not 1 <= i <= MAX_SERVICES:
        raise ValueError(f"service index {i} outside 1..{MAX_SERVICES} (the mixed state's node ports and addresses)")
    svc = synthetic.service(i)
    spec, k = svc["spec"], kind(i)
    node_port, hc_port = _node_ports(i)
    if k in ("nodeport", "lb", "lb-local"):
        spec["type"] = "LoadBalancer" if k.startswith("lb") else "NodePort"
        spec["externalTrafficPolicy"] = "Cluster"
    if node_port:
        spec["ports"][0]["nodePort"] = node_port
    if k.startswith("lb"):
        spec["allocateLoadBalancerNodePorts"] = bool(node_port)
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": lb_ip(i), "ipMode": "VIP"}]}}
    if k.startswith("externalip"):
        spec["externalIPs"] = [external_ip(i)]
        spec["externalTrafficPolicy"] = "Cluster"
    if k.endswith("-local"):
        spec["externalTrafficPolicy"] = "Local"
    if hc_port:
        spec["healthCheckNodePort"] = hc_port
    return svc


def endpoint_slice(i: int, n_endpoints: int, *, variant: int = 0) -> dict[str, Any]:
    """The one EndpointSlice of service ``i`` (empty for a service without endpoints)."""
    return synthetic.endpoint_slice(i, n_endpoints if has_endpoints(i) else 0, variant=variant)


def services(n: int) -> Iterator[dict[str, Any]]:
    for i in range(1, n + 1):
        yield service(i)


def endpoint_slices(n: int, n_endpoints: int) -> Iterator[dict[str, Any]]:
    for i in range(1, n + 1):
        yield endpoint_slice(i, n_endpoints)
