"""The sync bench's synthetic state past one /16 of ClusterIPs, in both families, with multi-port services: every
address distinct, inside the test ranges, and the cache's service-port count what ``service_ports`` says."""

from __future__ import annotations

import ipaddress

import pytest

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily

TEST_V4 = ipaddress.ip_network("198.18.0.0/15")
TEST_V6 = ipaddress.ip_network("fd00:198:18::/48")
LAB_FABRIC = ipaddress.ip_network("198.18.0.0/20")


def test_ipv4_cluster_ips_go_past_one_slash16_and_stay_distinct_in_the_test_range() -> None:
    assert synthetic.MAX_SERVICES >= 100_000
    ips = [ipaddress.ip_address(synthetic.cluster_ip(i)) for i in range(1, synthetic.MAX_SERVICES + 1)]
    assert len(set(ips)) == synthetic.MAX_SERVICES
    assert all(ip in TEST_V4 for ip in ips)
    assert not any(ip in synthetic.ENDPOINT_NET or ip in LAB_FABRIC for ip in ips)
    assert synthetic.cluster_ip(65_534) == "198.19.255.254"  # the first 65,534 as before
    assert synthetic.cluster_ip(65_535) == "198.18.128.1"
    with pytest.raises(ValueError):
        synthetic.cluster_ip(synthetic.MAX_SERVICES + 1)


def test_ipv6_cluster_ips_span_a_slash12s_worth() -> None:
    assert synthetic.MAX_SERVICES6 == 2**20 - 2
    last = ipaddress.ip_address(synthetic.cluster_ip(synthetic.MAX_SERVICES6, ipv6=True))
    assert last in TEST_V6 and last in ipaddress.ip_network("fd00:198:18:ff::/64")
    sample = {synthetic.cluster_ip(i, ipv6=True) for i in range(1, 300_001, 7)}
    assert len(sample) == len(range(1, 300_001, 7))


@pytest.mark.parametrize("ipv6", [False, True])
def test_multiport_services_count_as_service_ports_in_the_cache(ipv6: bool) -> None:
    n, e, every = 60, 4, 7
    family = IPFamily.V6 if ipv6 else IPFamily.V4
    cache = ServiceCache(node_name="node-1", ip_families=(family,))
    for obj in synthetic.services(n, ports_every=every, ipv6=ipv6):
        assert cache.upsert_service(obj)
    for obj in synthetic.endpoint_slices(n, e, ports_every=every, ipv6=ipv6):
        assert cache.upsert_slice(obj)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, _ = cache.snapshot()
    assert not cache.errors()
    assert len(state) == synthetic.service_ports(n, ports_every=every) == n + (n // every) * 2
    ports = list(state)
    assert all(len(sp.cluster_endpoints) == e for sp in ports)
    multi = [sp for sp in ports if sp.name.port == "metrics"]
    assert len(multi) == n // every and all(sp.port == 9090 for sp in multi)
    assert {sp.cluster_ip for sp in ports} == {synthetic.cluster_ip(i, ipv6) for i in range(1, n + 1)}
    assert synthetic.service_ports(n) == n  # no multi-port services unless asked


def test_the_datapath_bench_never_programs_a_synthetic_service_on_its_own_addresses() -> None:
    """At 100,000 services the synthetic set reaches 198.19.200.10 (the datapath bench's target ClusterIP) and
    198.19.255.254 (its NAT floor's rule): the bench skips those indexes, and still programs N distinct services."""
    from kproxy.bench.dpobjects import RESERVED_IPS, synthetic_index

    ips = [synthetic.cluster_ip(synthetic_index(k)) for k in range(1, 100_001)]
    assert len(set(ips)) == 100_000 and not set(ips) & RESERVED_IPS
