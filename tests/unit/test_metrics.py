"""Metric names, types, labels and buckets in the text exposition equal upstream kube-proxy's."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.metrics import NETWORK_PROGRAMMING_BUCKETS, SYNC_BUCKETS, Metrics
from kproxy.model import FamilySync, IPFamily, SyncResult

# Upstream's v1.34 metric reference for kube-proxy: exposed name -> (TYPE, label names).
UPSTREAM = {
    "kubeproxy_sync_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": ("gauge", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": ("gauge", {"ip_family"}),
    "kubeproxy_network_programming_duration_seconds": ("histogram", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_endpoint_changes_total": ("counter", set()),
    "kubeproxy_sync_proxy_rules_service_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_service_changes_total": ("counter", set()),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": ("gauge", {"ip_family", "traffic_policy"}),
    "kubeproxy_proxy_healthz_total": ("counter", {"code"}),
    "kubeproxy_proxy_livez_total": ("counter", {"code"}),
    "kubeproxy_conntrack_reconciler_deleted_entries_total": ("counter", {"ip_family"}),
    "kubeproxy_conntrack_reconciler_sync_duration_seconds": ("histogram", {"ip_family"}),
}

# Registered by the iptables backend only, as upstream's RegisterMetrics(mode) does (the nftables backend's own are
# tested with it).
UPSTREAM_IPTABLES = {
    "kubeproxy_sync_proxy_rules_iptables_total": ("gauge", {"ip_family", "table"}),
    "kubeproxy_sync_proxy_rules_iptables_last": ("gauge", {"ip_family", "table"}),
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total": ("counter", {"ip_family"}),
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total": ("counter", {"ip_family"}),
}
UPSTREAM.update(UPSTREAM_IPTABLES)


def iptables_metrics(families: list[IPFamily] | None = None) -> tuple[Metrics, IptablesProxier]:
    """The metrics a daemon in iptables mode exposes: the common ones plus the backend's own (no kernel touched)."""
    fams = families if families is not None else [IPFamily.V4, IPFamily.V6]
    m = Metrics(fams)
    backend = IptablesProxier(ProxyConfig(ip_families=tuple(fams) or (IPFamily.V4,)))
    backend.register_metrics(m.registry, fams)
    return m, backend


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def exposition(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        out.append((match.group(1), labels, float(match.group(3))))
    return out


def touch_everything(m: Metrics, backend: IptablesProxier) -> None:
    v4 = IPFamily.V4
    m.observe_sync(v4, 0.02, full=True)
    m.observe_sync(v4, 0.01, full=False)
    m.set_last_synced(v4, 1700000000.0)
    m.set_last_queued(v4, 1699999999.0)
    m.observe_network_programming(v4, [1699999998.0], now=1700000000.0)
    m.add_changes(services=2, endpoints=3)
    m.set_pending(services=1, endpoints=4)
    done = FamilySync(kernel_refusals=1, rules={"nat": 120}, rules_last={"nat": 30})
    backend.observe_sync(v4, SyncResult(ok=False, families={v4: done}), full=False, ok=False)
    m.set_no_local_endpoints(v4, internal=1, external=2)
    m.count_healthz(200)
    m.count_livez(503)
    m.observe_conntrack(v4, 0.003, deleted=5)


def test_every_upstream_metric_is_exposed_with_its_type() -> None:
    text = exposition(iptables_metrics()[0])
    for name, (kind, _) in UPSTREAM.items():
        assert f"# TYPE {name} {kind}\n" in text, name
        assert f"# HELP {name} " in text, name


def test_labels_match_upstream() -> None:
    m, backend = iptables_metrics()
    touch_everything(m, backend)
    seen: dict[str, set[str]] = {}
    for name, labels, _ in samples(exposition(m)):
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in UPSTREAM else name
        if base in UPSTREAM:
            seen.setdefault(base, set()).update(set(labels) - {"le"})
    for name, (_, labels) in UPSTREAM.items():
        assert seen.get(name) == labels, name


def test_no_created_series_and_nothing_unexpected_under_kubeproxy_prefix() -> None:
    m, backend = iptables_metrics([IPFamily.V4, IPFamily.V6])
    touch_everything(m, backend)
    text = exposition(m)
    assert "_created" not in text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE kubeproxy_")}
    assert families == set(UPSTREAM)


def test_buckets_are_upstreams() -> None:
    assert SYNC_BUCKETS[0] == 0.001 and len(SYNC_BUCKETS) == 15 and SYNC_BUCKETS[-1] == pytest.approx(16.384)
    assert NETWORK_PROGRAMMING_BUCKETS[:4] == (0.0, 0.25, 0.5, 1.0)
    assert NETWORK_PROGRAMMING_BUCKETS[61:63] == (59.0, 60.0)
    assert NETWORK_PROGRAMMING_BUCKETS[-8:] == (115.0, 120.0, 150.0, 180.0, 210.0, 240.0, 270.0, 300.0)
    assert len(NETWORK_PROGRAMMING_BUCKETS) == 1 + 2 + 59 + 12 + 7
    m = Metrics()
    m.observe_sync(IPFamily.V6, 0.005, full=True)
    les = [
        labels["le"]
        for name, labels, _ in samples(exposition(m))
        if name == "kubeproxy_sync_proxy_rules_duration_seconds_bucket"
    ]
    assert len(les) == 16 and les[0] == "0.001" and les[-1] == "+Inf"


def test_mode_metrics_are_the_backends_own() -> None:
    """No mode's metrics without its backend: a node in another mode exposes none of iptables' series."""
    text = exposition(Metrics([IPFamily.V4]))
    assert not any(name in text for name in UPSTREAM_IPTABLES)


def test_helpers_set_values() -> None:
    m, backend = iptables_metrics()
    touch_everything(m, backend)
    v4 = {"ip_family": "IPv4"}
    assert m.value("kubeproxy_sync_proxy_rules_duration_seconds_count", v4) == 2
    assert m.value("kubeproxy_sync_full_proxy_rules_duration_seconds_count", v4) == 1
    assert m.value("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", v4) == 1
    assert m.value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", v4) == 1700000000.0
    assert m.value("kubeproxy_network_programming_duration_seconds_sum", v4) == 2.0
    assert m.value("kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert m.value("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 4
    assert m.value("kubeproxy_sync_proxy_rules_iptables_total", {**v4, "table": "nat"}) == 120
    assert m.value("kubeproxy_sync_proxy_rules_no_local_endpoints_total", {**v4, "traffic_policy": "external"}) == 2
    assert m.value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1
    assert m.value("kubeproxy_proxy_livez_total", {"code": "503"}) == 1
    assert m.value("kubeproxy_conntrack_reconciler_deleted_entries_total", v4) == 5
    assert m.value("kproxy_syncs_total", {**v4, "result": "success"}) == 2


def test_families_start_at_zero_and_counts_feed_iptables_gauges() -> None:
    m, backend = iptables_metrics([IPFamily.V6])
    v6 = {"ip_family": "IPv6"}
    assert m.value("kubeproxy_sync_proxy_rules_iptables_restore_failures_total", v6) == 0
    assert m.value("kubeproxy_sync_proxy_rules_iptables_restore_failures_total", {"ip_family": "IPv4"}) is None
    families = {
        IPFamily.V6: FamilySync(full=True, services=3, rules={"filter": 7}, rules_last={"filter": 2}),
        IPFamily.V4: FamilySync(rules={"filter": 99}),
    }
    backend.observe_sync(IPFamily.V6, SyncResult(families=families), full=True, ok=True)
    assert m.value("kubeproxy_sync_proxy_rules_iptables_total", {**v6, "table": "filter"}) == 7
    assert m.value("kubeproxy_sync_proxy_rules_iptables_last", {**v6, "table": "filter"}) == 2


def test_network_programming_ignores_future_trigger_times() -> None:
    m = Metrics()
    m.observe_network_programming(IPFamily.V4, [10.0, 30.0], now=20.0)
    assert m.value("kubeproxy_network_programming_duration_seconds_count", {"ip_family": "IPv4"}) == 1


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.count_healthz(200)
    assert b.value("kubeproxy_proxy_healthz_total", {"code": "200"}) is None


def test_sync_failures_feed_the_modes_own_counters() -> None:
    m, backend = iptables_metrics([IPFamily.V4])
    v4 = {"ip_family": "IPv4"}
    failed = SyncResult(ok=False, error="refused")  # failed before naming a refusal: one failure
    backend.observe_sync(IPFamily.V4, failed, full=True, ok=False)
    backend.observe_sync(IPFamily.V4, failed, full=False, ok=False)
    # as upstream: every failed restore counts, and a partial one counts in the partial counter as well
    assert m.value("kubeproxy_sync_proxy_rules_iptables_restore_failures_total", v4) == 2
    assert m.value("kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", v4) == 1
    # the daemon reports a failed sync through observe_sync(ok=False) too: counted once there, not twice
    m.observe_sync(IPFamily.V4, 0.1, False, ok=False)
    assert m.value("kproxy_syncs_total", {**v4, "result": "failure"}) == 1


def test_nftables_metrics_are_upstreams_and_its_own() -> None:
    """The nftables mode registers upstream's nftables-mode metrics (and the iptables mode's are absent)."""
    from kproxy.backends.nftables.proxier import NftablesProxier

    m = Metrics([IPFamily.V4])
    backend = NftablesProxier(ProxyConfig(ip_families=(IPFamily.V4,)))
    backend.register_metrics(m.registry, [IPFamily.V4])
    text = exposition(m)
    for name in (
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
        "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
    ):
        assert f"# TYPE {name} counter\n" in text, name
    assert not any(name in text for name in UPSTREAM_IPTABLES)
    backend.observe_sync(IPFamily.V4, SyncResult(ok=False, error="refused"), full=False, ok=False)
    assert m.value("kubeproxy_sync_proxy_rules_nftables_sync_failures_total", {"ip_family": "IPv4"}) == 1
