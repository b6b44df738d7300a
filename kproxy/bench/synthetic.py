"""Synthetic Services and EndpointSlices for ``kproxy bench sync``, shaped exactly as the API server returns them.

Generated lazily (``TimedPages``: a page of 500 at a time, its generation timed apart so a bench can leave the
generator's time out of the cache's), so feeding 100,000 services x 10 endpoints never holds the whole input in
memory (the benchmark measures the cache's and the backend's memory, not the generator's). Everything is
deterministic: service ``i`` always gets the same ClusterIP, ports and endpoints, so a run can regenerate one
object later and change it (``variant``) to time a partial sync.

- namespace ``bench``, services ``svc-00001`` ...;
- IPv4 ClusterIPs: service i <= 65,534 in 198.19.0.0/16 (as before, so figures at those sizes are unchanged), the
  rest in 198.18.128.0/17, 198.18.32.0/19 and 198.18.16.0/20: 110,584 in all (MAX_SERVICES). A /12, as real
  clusters use, cannot be had in IPv4 here: test addresses come from 198.18.0.0/15 only (CONTRIBUTING.md), and
  198.18.0.0/20 (the lab's fabric) and 198.18.64.0/18 (the endpoints, the lab's pod CIDRs) are left out. IPv6
  (``ipv6=True``): ClusterIPs from fd00:198:18:ff:1::/108, a /12's worth (1,048,574), inside the lab's routed
  fd00:198:18:ff::/64;
- endpoints from 198.18.64.0/18 (16,382 addresses, reused across services when N x E is larger) or, in IPv6, from
  fd00:198:18:7f::/64 (never reused); every other one on ``node-1`` (the benchmark's own node, so local endpoints
  exist) and the rest on ``node-2``;
- every ``udp_every``-th service is UDP (a DNS-like port 53 -> 5353), the others TCP 80 -> 8080; with
  ``ports_every`` > 0, every ``ports_every``-th service also has https 443 -> 8443 and metrics 9090 -> 9090 (three
  service ports, one EndpointSlice listing the three): ``service_ports`` counts them, since the cache, the ledger
  and every per-service figure count service ports, not Services.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

NAMESPACE = "bench"
NODES = ("node-1", "node-2")
SERVICE_BLOCKS = tuple(
    ipaddress.IPv4Network(b) for b in ("198.19.0.0/16", "198.18.128.0/17", "198.18.32.0/19", "198.18.16.0/20")
)
SERVICE_NET6 = ipaddress.IPv6Network("fd00:198:18:ff:1::/108")
ENDPOINT_NET = ipaddress.ip_network("198.18.64.0/18")
ENDPOINT_NET6 = ipaddress.IPv6Network("fd00:198:18:7f::/64")
MAX_SERVICES = sum(b.num_addresses - 2 for b in SERVICE_BLOCKS)
MAX_SERVICES6 = SERVICE_NET6.num_addresses - 2
_EP_BASE = int(ENDPOINT_NET.network_address) + 1
_EP_POOL = ENDPOINT_NET.num_addresses - 2
UDP_EVERY = 10
MAX_ENDPOINTS = 1000  # per service: one EndpointSlice holds at most 1000 endpoints
PAGE = 500  # objects generated at once by TimedPages: kproxy.sources.kube's page size
#: the ports a multi-port service has besides its first: (name, protocol, service port, target port)
EXTRA_PORTS = (("https", "TCP", 443, 8443), ("metrics", "TCP", 9090, 9090))


def service_name(i: int) -> str:
    return f"svc-{i:05d}"


def cluster_ip(i: int, ipv6: bool = False) -> str:
    if ipv6:
        if not 1 <= i <= MAX_SERVICES6:
            raise ValueError(f"service index {i} outside 1..{MAX_SERVICES6} ({SERVICE_NET6})")
        return str(SERVICE_NET6.network_address + i)
    if not 1 <= i <= MAX_SERVICES:
        raise ValueError(f"service index {i} outside 1..{MAX_SERVICES} (the IPv4 service blocks)")
    k = i
    for block in SERVICE_BLOCKS:
        if k <= block.num_addresses - 2:
            return str(block.network_address + k)
        k -= block.num_addresses - 2
    raise AssertionError("unreachable: MAX_SERVICES is the blocks' sum")


def is_udp(i: int, udp_every: int = UDP_EVERY) -> bool:
    return udp_every > 0 and i % udp_every == 0


def is_multiport(i: int, ports_every: int = 0) -> bool:
    return ports_every > 0 and i % ports_every == 0


def service_ports(n: int, *, ports_every: int = 0) -> int:
    """How many service ports services 1..n have: what the cache holds and the ledger counts."""
    return n + (n // ports_every) * len(EXTRA_PORTS) if ports_every > 0 else n


def _ports(i: int, udp_every: int, ports_every: int) -> list[tuple[str, str, int, int]]:
    """(name, protocol, service port, target port) of each port of service i."""
    first = ("dns", "UDP", 53, 5353) if is_udp(i, udp_every) else ("http", "TCP", 80, 8080)
    return [first, *EXTRA_PORTS] if is_multiport(i, ports_every) else [first]


def endpoint_ip(i: int, j: int, n_endpoints: int, variant: int = 0, ipv6: bool = False) -> str:
    """Address of endpoint j of service i; ``variant`` > 0 moves the last endpoint to another address."""
    k = (i - 1) * n_endpoints + j
    if variant and j == n_endpoints - 1:
        k += variant * 7919  # a prime step: lands on an address this service does not use for any realistic E
    if ipv6:
        return str(ENDPOINT_NET6.network_address + 1 + k)
    return str(ipaddress.ip_address(_EP_BASE + k % _EP_POOL))


def service(i: int, *, udp_every: int = UDP_EVERY, ports_every: int = 0, ipv6: bool = False) -> dict[str, Any]:
    """Service ``i`` as the API returns it (ClusterIP type, single-stack IPv4 or IPv6)."""
    name = service_name(i)
    ip = cluster_ip(i, ipv6)
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
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ipFamilies": ["IPv6" if ipv6 else "IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster",
            "sessionAffinity": "None",
            "selector": {"app": name},
            "ports": [
                {"name": pname, "protocol": proto, "port": port, "targetPort": target}
                for pname, proto, port, target in _ports(i, udp_every, ports_every)
            ],
        },
        "status": {"loadBalancer": {}},
    }


def endpoint_slice(
    i: int,
    n_endpoints: int,
    *,
    variant: int = 0,
    udp_every: int = UDP_EVERY,
    ports_every: int = 0,
    ipv6: bool = False,
) -> dict[str, Any]:
    """The one EndpointSlice of service ``i`` with ``n_endpoints`` ready endpoints (at most 1000 per slice, as the
    API allows; more would need several slices)."""
    if not 0 <= n_endpoints <= MAX_ENDPOINTS:
        raise ValueError("an EndpointSlice holds at most 1000 endpoints")
    name = service_name(i)
    endpoints = []
    for j in range(n_endpoints):
        node = NODES[j % len(NODES)]
        endpoints.append(
            {
                "addresses": [endpoint_ip(i, j, n_endpoints, variant, ipv6)],
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
        "addressType": "IPv6" if ipv6 else "IPv4",
        "endpoints": endpoints,
        "ports": [
            {"name": pname, "protocol": proto, "port": target}
            for pname, proto, _, target in _ports(i, udp_every, ports_every)
        ],
    }


def services(n: int, *, udp_every: int = UDP_EVERY, ports_every: int = 0, ipv6: bool = False) -> Iterator[dict]:
    for i in range(1, n + 1):
        yield service(i, udp_every=udp_every, ports_every=ports_every, ipv6=ipv6)


def endpoint_slices(
    n: int, n_endpoints: int, *, udp_every: int = UDP_EVERY, ports_every: int = 0, ipv6: bool = False
) -> Iterator[dict[str, Any]]:
    for i in range(1, n + 1):
        yield endpoint_slice(i, n_endpoints, udp_every=udp_every, ports_every=ports_every, ipv6=ipv6)


class TimedPages:
    """Objects generated a page (``PAGE``) at a time, each page's generation timed apart and summed in ``seconds``:
    whoever feeds them to the cache subtracts these from its clock (a real process gets the objects from JSON, not
    from this generator), while only one page is alive at once (a run weighs the cache, not the generator's
    objects)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def paged(self, make: Callable[[int], dict[str, Any]], n: int) -> Iterator[dict[str, Any]]:
        """``make(1)`` ... ``make(n)``, a page at a time."""
        for start in range(1, n + 1, PAGE):
            t0 = perf_counter()
            page = [make(i) for i in range(start, min(start + PAGE, n + 1))]
            self.seconds += perf_counter() - t0
            yield from page
