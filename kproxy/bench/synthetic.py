"""Synthetic Services and EndpointSlices for ``kproxy bench sync``, shaped exactly as the API server returns them.

Generated lazily, one object at a time, so feeding 10,000 services x 10 endpoints never holds the whole input in
memory (the benchmark measures the cache's and the backend's memory, not the generator's). Everything is
deterministic: service ``i`` always gets the same ClusterIP, ports and endpoints, so a run can regenerate one
object later and change it (``variant``) to time a partial sync.

- namespace ``bench``, services ``svc-00001`` ...; ClusterIPs from 198.19.0.0/16 (65,534 fit);
- endpoints from 198.18.64.0/18 (16,382 addresses, reused across services when N x E is larger), every other one
  on ``node-1`` (the benchmark's own node, so local endpoints exist) and the rest on ``node-2``;
- every ``udp_every``-th service is UDP (a DNS-like port 53 -> 5353), the others TCP 80 -> 8080.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

NAMESPACE = "bench"
NODES = ("node-1", "node-2")
SERVICE_NET = ipaddress.ip_network("198.19.0.0/16")
ENDPOINT_NET = ipaddress.ip_network("198.18.64.0/18")
MAX_SERVICES = SERVICE_NET.num_addresses - 2
_EP_BASE = int(ENDPOINT_NET.network_address) + 1
_EP_POOL = ENDPOINT_NET.num_addresses - 2
UDP_EVERY = 10
MAX_ENDPOINTS = 1000  # per service: one EndpointSlice holds at most 1000 endpoints


def service_name(i: int) -> str:
    return f"svc-{i:05d}"


def cluster_ip(i: int) -> str:
    if not 1 <= i <= MAX_SERVICES:
        raise ValueError(f"service index {i} outside 1..{MAX_SERVICES} (198.19.0.0/16)")
    return str(SERVICE_NET.network_address + i)


def is_udp(i: int, udp_every: int = UDP_EVERY) -> bool:
    return udp_every > 0 and i % udp_every == 0


def _port(i: int, udp_every: int) -> tuple[str, str, int, int]:
    """(name, protocol, service port, target port) of service i."""
    return ("dns", "UDP", 53, 5353) if is_udp(i, udp_every) else ("http", "TCP", 80, 8080)


def endpoint_ip(i: int, j: int, n_endpoints: int, variant: int = 0) -> str:
    """Address of endpoint j of service i; ``variant`` > 0 moves the last endpoint to another address."""
    k = (i - 1) * n_endpoints + j
    if variant and j == n_endpoints - 1:
        k += variant * 7919  # a prime step: lands on an address this service does not use for any realistic E
    return str(ipaddress.ip_address(_EP_BASE + k % _EP_POOL))


def service(i: int, *, udp_every: int = UDP_EVERY) -> dict[str, Any]:
    """Service ``i`` as the API returns it (ClusterIP type, one port, single-stack IPv4)."""
    name = service_name(i)
    pname, proto, port, target = _port(i, udp_every)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"00000000-0000-4000-8000-{i:012d}",
            "resourceVersion": str(i),
            "labels": {"app": name},
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip(i),
            "clusterIPs": [cluster_ip(i)],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster",
            "sessionAffinity": "None",
            "selector": {"app": name},
            "ports": [{"name": pname, "protocol": proto, "port": port, "targetPort": target}],
        },
        "status": {"loadBalancer": {}},
    }


def endpoint_slice(i: int, n_endpoints: int, *, variant: int = 0, udp_every: int = UDP_EVERY) -> dict[str, Any]:
    """The one EndpointSlice of service ``i`` with ``n_endpoints`` ready endpoints (at most 1000 per slice, as the
    API allows; more would need several slices)."""
    if not 0 <= n_endpoints <= MAX_ENDPOINTS:
        raise ValueError("an EndpointSlice holds at most 1000 endpoints")
    name = service_name(i)
    pname, proto, _, target = _port(i, udp_every)
    endpoints = []
    for j in range(n_endpoints):
        node = NODES[j % len(NODES)]
        endpoints.append(
            {
                "addresses": [endpoint_ip(i, j, n_endpoints, variant)],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": node,
                "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": f"{name}-pod-{j}"},
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-bench",
            "namespace": NAMESPACE,
            "uid": f"00000000-0000-4000-9000-{i:012d}",
            "resourceVersion": str(i + variant * 1_000_000),
            "generateName": f"{name}-",
            "labels": {"kubernetes.io/service-name": name, "endpointslice.kubernetes.io/managed-by": "bench"},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": pname, "protocol": proto, "port": target}],
    }


def services(n: int, *, udp_every: int = UDP_EVERY) -> Iterator[dict[str, Any]]:
    for i in range(1, n + 1):
        yield service(i, udp_every=udp_every)


def endpoint_slices(n: int, n_endpoints: int, *, udp_every: int = UDP_EVERY) -> Iterator[dict[str, Any]]:
    for i in range(1, n + 1):
        yield endpoint_slice(i, n_endpoints, udp_every=udp_every)
