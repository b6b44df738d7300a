"""One small object must not expand without bound: the cache refuses a Service whose ports expand to more entries
(addresses + endpoints, summed over its ports) than ``--max-service-entries``, reports it and serves the rest.

On the code before this check, a 17 KB Service (100 ports x 1,000 externalIPs) was handed to every backend whole (it
rendered to 100,100 iptables rules and a 12.8 MB payload).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.cache import ServiceCache
from kproxy.config import DEFAULT_MAX_SERVICE_ENTRIES, ConfigError, ProxyConfig, build_config, load_config_file
from kproxy.model import IPFamily, Protocol, ServicePortName

from .cache_objects import NODE, endpoint, endpoint_slice, service

V4 = IPFamily.V4
HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def absurd() -> dict[str, object]:
    """100 ports x 1,000 externalIPs: about 17 KB of YAML."""
    ports = [{"name": f"p{i}", "port": 1000 + i, "protocol": "TCP", "targetPort": 8080} for i in range(100)]
    ext = [f"198.19.{100 + i // 250}.{1 + i % 250}" for i in range(1000)]
    return service("absurd", cluster_ip="198.19.0.20", ports=ports, externalIPs=ext)


def test_an_absurd_service_is_refused_and_a_good_one_next_to_it_served() -> None:
    cache = ServiceCache(NODE)
    assert cache.upsert_service(service("web", cluster_ip="198.19.0.10"))
    cache.upsert_service(absurd())
    cache.replace_slices([endpoint_slice("web-1", service_name="web")])
    cache.mark_synced("services")
    state, _ = cache.snapshot()
    assert [spn.name for spn in state.family(V4)] == ["web"]
    why = cache.errors()["Service default/absurd"]
    assert why.startswith("expands to 100100 entries") and "--max-service-entries 100000" in why
    # the same Service shrunk under the cap is served, and the error goes
    cache.upsert_service(service("absurd", cluster_ip="198.19.0.20", externalIPs=["198.19.100.1"]))
    state, _ = cache.snapshot()
    assert ServicePortName("default", "absurd", "http", Protocol.TCP) in state.family(V4)
    assert "Service default/absurd" not in cache.errors()


def test_endpoints_count_too_and_the_cap_is_configurable() -> None:
    cache = ServiceCache(NODE, max_service_entries=10)
    cache.upsert_service(service("web", cluster_ip="198.19.0.10"))
    eps = [endpoint(f"198.18.1.{i}") for i in range(1, 9)]  # 1 address + 8 endpoints: 9 entries
    cache.upsert_slice(endpoint_slice("web-1", service_name="web", endpoints=eps))
    state, _ = cache.snapshot()
    assert len(state.family(V4)) == 1
    more = [*eps, endpoint("198.18.1.9"), endpoint("198.18.1.10")]  # 11 entries
    cache.upsert_slice(endpoint_slice("web-1", service_name="web", endpoints=more))
    state, changes = cache.snapshot()
    assert not state.family(V4) and ServicePortName("default", "web", "http", Protocol.TCP) in changes.services
    assert cache.errors()["Service default/web"].startswith("expands to 11 entries")


def test_the_cap_from_flags_and_the_config_file(tmp_path: Path) -> None:
    assert ProxyConfig().max_service_entries == DEFAULT_MAX_SERVICE_ENTRIES == 100_000
    conf = tmp_path / "kproxy.yaml"
    conf.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmaxServiceEntries: 500\n"
    )
    assert build_config(load_config_file(conf), {}).max_service_entries == 500
    assert build_config(load_config_file(conf), {"max_service_entries": 7}).max_service_entries == 7
    for bad in (0, -1, 10**9, True):
        with pytest.raises(ConfigError, match="maxServiceEntries"):
            build_config({}, {"max_service_entries": bad})


def test_port_range_from_the_config_file_reaches_the_userspace_mode(tmp_path: Path) -> None:
    conf = tmp_path / "kproxy.yaml"
    conf.write_text(f"{HEAD}portRange: 30000-30100\n")
    cfg = build_config(load_config_file(conf), {"backend_options": {"other": 1}})
    assert dict(cfg.backend_options) == {"proxy_port_range": "30000-30100", "other": 1}
    flags = build_config(load_config_file(conf), {"backend_options": {"proxy_port_range": "31000-31010"}})
    assert flags.backend_options["proxy_port_range"] == "31000-31010"  # the flag wins
