"""The daemon end to end without a kernel: manifest folder -> cache -> runner -> FakeProxier, with the real
health and metrics servers on loopback. Proves the wiring: readiness gating, partial syncs, retries after a
failed sync without losing the change, kernel-refused services, health and metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kproxy.config import ProxyConfig
from kproxy.daemon import Daemon
from kproxy.fake import FakeProxier
from kproxy.model import IPFamily, Protocol, ServicePortName
from kproxy.queries import ServiceFilter
from kproxy.sources.files import FilesSource


class NoConntrack:
    """The fake backend has no datapath, so there is no conntrack table to reconcile."""

    def reconcile(
        self, state: object, node_ips: object, answerers: object = None, changed: object = None
    ) -> dict[IPFamily, int]:
        return {}


def service(name: str, ip: str, port: int = 80, **spec: object) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": "demo", "name": name},
        "spec": {
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            **spec,
        },
    }


def slice_(name: str, svc: str, ips: list[str], node: str = "node-1") -> dict[str, object]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"namespace": "demo", "name": name, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": node} for ip in ips],
    }


def write(folder: Path, name: str, *objs: dict[str, object]) -> None:
    (folder / name).write_text(yaml.safe_dump_all(objs))


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s: {check.__doc__ or check}")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Daemon, FakeProxier, Path]]:
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        sync_period=0.5,
        manifests=str(tmp_path),
    )
    fake = FakeProxier(cfg)
    daemon = Daemon(
        cfg, fake, lambda sink: FilesSource(sink, tmp_path, cfg.node_name, poll_interval=0.1), reconciler=NoConntrack()
    )  # type: ignore[arg-type]
    daemon.start()
    try:
        yield daemon, fake, tmp_path
    finally:
        daemon.stop()


def programmed(fake: FakeProxier) -> dict[str, list[str]]:
    with fake.lock:
        return {sp.name.name: [str(e) for e in sp.internal_endpoints] for sp in fake.programmed.values()}


def test_sync_health_metrics(running: tuple[Daemon, FakeProxier, Path]) -> None:
    daemon, fake, folder = running
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10", "198.18.65.11"]))
    eventually(lambda: programmed(fake).get("a") == ["198.18.65.10:8080", "198.18.65.11:8080"])
    assert fake.syncs[0].full  # the first sync is full
    hz, mp = daemon.healthz.port, daemon.metrics_server.port
    code, body = get(f"http://127.0.0.1:{hz}/healthz")
    assert code == 200 and json.loads(body)["nodeEligible"] is True, body
    code, body = get(f"http://127.0.0.1:{mp}/metrics")
    assert code == 200
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
    ):
        assert name in body
    assert get(f"http://127.0.0.1:{mp}/proxyMode") == (200, "fake")
    code, body = get(f"http://127.0.0.1:{mp}/rules")
    rules = json.loads(body)
    assert rules["ready"] is True and rules["node"] == "node-1"
    assert "demo/a:http/TCP" in rules["backend"]["services"]
    # ?service= narrows it: ns/name covers every port and protocol; malformed is 400, unknown 404
    write(folder, "z.yaml", service("z", "198.19.0.9"), slice_("z-1", "z", ["198.18.65.19"]))
    eventually(lambda: "z" in programmed(fake))
    for query in ("demo/a", "demo/a:http", "demo/a:http/tcp"):
        code, body = get(f"http://127.0.0.1:{mp}/rules?service={query}")
        assert code == 200 and list(json.loads(body)["backend"]["services"]) == ["demo/a:http/TCP"], (query, body)
    assert get(f"http://127.0.0.1:{mp}/rules?service=garbage")[0] == 400
    assert get(f"http://127.0.0.1:{mp}/rules?service=demo/nope")[0] == 404
    assert get(f"http://127.0.0.1:{mp}/rules?service=demo/a:http/UDP")[0] == 404

    # one endpoint change -> a partial sync naming only that service
    before = len(fake.syncs)
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10"]))
    eventually(lambda: programmed(fake).get("a") == ["198.18.65.10:8080"])
    partial = [c for c in fake.syncs[before:] if c.services]
    assert partial and not partial[-1].full
    assert partial[-1].services == frozenset({ServicePortName("demo", "a", "http", Protocol.TCP)})


def test_failed_sync_loses_nothing(running: tuple[Daemon, FakeProxier, Path]) -> None:
    """A change a failed sync carried is still in the next successful sync's ``changes.services``. (That b ends up
    programmed proves nothing by itself: the retry is a full sync, which programs every service whether or not
    the change was kept.)"""
    daemon, fake, folder = running
    b = ServicePortName("demo", "b", "http", Protocol.TCP)
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10"]))
    eventually(lambda: "a" in programmed(fake))
    with fake.lock:
        fake.fail_next = 1_000_000  # every sync fails until the change has been carried by a failed one
        before = len(fake.syncs)
    write(folder, "b.yaml", service("b", "198.19.0.2"), slice_("b-1", "b", ["198.18.65.20"]))

    def failed_with_b() -> bool:
        with fake.lock:
            return any(b in c.services for c in fake.syncs[before:])

    eventually(failed_with_b)
    with fake.lock:
        first_good = len(fake.syncs)  # every sync so far failed; the next one succeeds
        fake.fail_next = 0
    eventually(lambda: "b" in programmed(fake), timeout=15)
    assert daemon.status.failures >= 1
    with fake.lock:
        success = fake.syncs[first_good]
    assert b in success.services, success


def test_restore_failures_are_counted_for_the_family_that_had_them(running: tuple[Daemon, FakeProxier, Path]) -> None:
    """Upstream's restore-failure counters per IP family: a family that failed counts its refused restores, the one
    that synced counts none; refusals in a sync that recovered (services skipped) are counted too."""
    from types import MappingProxyType

    from kproxy.backends.iptables.proxier import IptablesProxier
    from kproxy.model import Changes, FamilySync, SyncResult

    daemon, fake, _ = running
    # the counters are the iptables mode's own: its metrics on this daemon's registry, fed as the daemon feeds them
    iptables = IptablesProxier(daemon.config)  # never synced: nothing touches the kernel
    iptables.register_metrics(daemon.metrics.registry, daemon.families)
    fake.observe_sync = iptables.observe_sync  # type: ignore[method-assign]
    state, _ = daemon.cache.snapshot()
    m = daemon.metrics
    v4, v6 = {"ip_family": "IPv4"}, {"ip_family": "IPv6"}
    name = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    partial = "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"
    before = {f: m.value(name, f) or 0.0 for f in ("IPv4", "IPv6")}
    failed = SyncResult(
        ok=False,
        error="IPv6: refused",
        families=MappingProxyType({IPFamily.V6: FamilySync(kernel_refusals=2)}),
        failed_families=frozenset({IPFamily.V6}),
    )
    assert daemon._after_sync(state, Changes(full=False), failed, 0.01) is False
    assert (m.value(name, v4) or 0.0) - before["IPv4"] == 0
    assert (m.value(name, v6) or 0.0) - before["IPv6"] == 2 and (m.value(partial, v6) or 0.0) >= 2
    recovered = SyncResult(ok=True, families=MappingProxyType({IPFamily.V4: FamilySync(full=True, kernel_refusals=1)}))
    assert daemon._after_sync(state, Changes(full=True), recovered, 0.01) is True
    assert (m.value(name, v4) or 0.0) - before["IPv4"] == 1
    # a family that failed before any restore (its kernel could not be read) counts none; one the backend synced
    # in full on its own (its FamilySync says full) is not a partial failure though the daemon asked for a partial sync
    v6_partial = m.value(partial, v6) or 0.0
    early = SyncResult(ok=False, error="IPv6: save failed", failed_families=frozenset({IPFamily.V6}))
    assert daemon._after_sync(state, Changes(full=False), early, 0.01) is False
    assert (m.value(name, v6) or 0.0) - before["IPv6"] == 2
    own_full = SyncResult(
        ok=False,
        error="IPv6: refused",
        families=MappingProxyType({IPFamily.V6: FamilySync(full=True, kernel_refusals=1)}),
        failed_families=frozenset({IPFamily.V6}),
    )
    assert daemon._after_sync(state, Changes(full=False), own_full, 0.01) is False
    assert (m.value(name, v6) or 0.0) - before["IPv6"] == 3 and m.value(partial, v6) == v6_partial


def test_refused_service_is_reported_and_others_apply(running: tuple[Daemon, FakeProxier, Path]) -> None:
    daemon, fake, folder = running
    bad = ServicePortName("demo", "bad", "http", Protocol.TCP)
    with fake.lock:
        fake.reject[bad] = "line 7 failed"
    write(
        folder,
        "x.yaml",
        service("bad", "198.19.0.3"),
        service("good", "198.19.0.4"),
        slice_("good-1", "good", ["198.18.65.30"]),
    )
    eventually(lambda: "good" in programmed(fake))
    eventually(lambda: "demo/bad:http/TCP" in daemon.status.failed)
    assert "bad" not in programmed(fake)
    code, body = get(f"http://127.0.0.1:{daemon.metrics_server.port}/rules")
    assert json.loads(body)["sync"]["failedServices"] == {"demo/bad:http/TCP": "line 7 failed"}


def test_service_filter() -> None:
    exact = ServiceFilter.parse("ns/name:http/udp")
    assert exact.exact == ServicePortName("ns", "name", "http", Protocol.UDP)
    assert exact.matches("ns/name:http/UDP") and not exact.matches("ns/name:http/TCP")
    any_port = ServiceFilter.parse("ns/name")
    assert any_port.exact is None
    assert all(any_port.matches(k) for k in ("ns/name:http/TCP", "ns/name/UDP", "ns/name:dns/UDP"))
    assert not any_port.matches("ns/name2:http/TCP") and not any_port.matches("ns2/name:http/TCP")
    unnamed = ServiceFilter.parse("ns/name:")  # the unnamed port only
    assert unnamed.matches("ns/name/TCP") and not unnamed.matches("ns/name:http/TCP")
    for bad in ("ns", "garbage", "ns/", "/name", "ns/name:p/XYZ", "a/b/c/d"):
        with pytest.raises(ValueError):
            ServiceFilter.parse(bad)


def node(taint: bool) -> dict[str, object]:
    spec: dict[str, object] = {"podCIDRs": ["198.18.65.0/24"]}
    if taint:
        spec["taints"] = [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "spec": spec}


def test_node_eligibility_and_change_counters(running: tuple[Daemon, FakeProxier, Path]) -> None:
    daemon, fake, folder = running
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10"]), node(taint=False))
    eventually(lambda: "a" in programmed(fake))
    hz, mp = daemon.healthz.port, daemon.metrics_server.port
    assert get(f"http://127.0.0.1:{hz}/healthz")[0] == 200

    def counter(name: str) -> float:
        for line in get(f"http://127.0.0.1:{mp}/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not exposed")

    assert counter("kubeproxy_sync_proxy_rules_service_changes_total") >= 1
    assert counter("kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 1
    before = counter("kubeproxy_sync_proxy_rules_endpoint_changes_total")
    # a taint alone (no service change) must reach /healthz: the node is being drained
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10"]), node(taint=True))
    eventually(lambda: get(f"http://127.0.0.1:{hz}/healthz")[0] == 503)
    assert json.loads(get(f"http://127.0.0.1:{hz}/healthz")[1])["nodeEligible"] is False
    assert get(f"http://127.0.0.1:{hz}/livez")[0] == 200  # livez ignores eligibility
    write(folder, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.11"]), node(taint=False))
    eventually(lambda: get(f"http://127.0.0.1:{hz}/healthz")[0] == 200)
    eventually(lambda: counter("kubeproxy_sync_proxy_rules_endpoint_changes_total") > before)


def test_trace_endpoint(running: tuple[Daemon, FakeProxier, Path]) -> None:
    daemon, fake, folder = running
    mp = daemon.metrics_server.port
    # the fake backend has no packet explainer: 404 with the reason; bad queries: 400 naming the fault
    code, body = get(f"http://127.0.0.1:{mp}/trace?src=198.18.65.11&dst=198.19.0.1&dport=80")
    assert code == 404 and "no packet explainer" in json.loads(body)["error"]
    for query, fault in [
        ("src=198.18.65.11&dst=198.19.0.1", "dport"),
        ("src=nonsense&dst=198.19.0.1&dport=80", "nonsense"),
        ("src=198.18.65.11&dst=fd00:198:18::1&dport=80", "families"),
        ("src=198.18.65.11&dst=198.19.0.1&dport=80&proto=icmp", "proto"),
    ]:
        code, body = get(f"http://127.0.0.1:{mp}/trace?{query}")
        assert code == 400 and fault in json.loads(body)["error"], (query, body)

    asked: list[tuple[object, ...]] = []

    def explain(src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False):  # type: ignore[no-untyped-def]
        asked.append((src, proto, dst, dport, src_local, dst_local))
        return {"verdict": "DNAT", "to": ["198.18.65.10:8080"]}

    fake.trace = explain  # type: ignore[method-assign]
    code, body = get(f"http://127.0.0.1:{mp}/trace?src=198.18.0.2&dst=198.18.0.11&dport=30080&proto=UDP&dst_local=1")
    assert code == 200, body
    assert json.loads(body)["trace"] == {"verdict": "DNAT", "to": ["198.18.65.10:8080"]}
    assert asked == [("198.18.0.2", "udp", "198.18.0.11", 30080, False, True)]
    # an address of this node is the node without the flag (here the test's own loopback address)
    code, body = get(f"http://127.0.0.1:{mp}/trace?src=127.0.0.1&dst=198.19.0.1&dport=80")
    assert code == 200 and json.loads(body)["packet"]["srcLocal"] is True, body
    assert asked[-1] == ("127.0.0.1", "tcp", "198.19.0.1", 80, True, False)


def test_health_check_servers_follow_nodeport_addresses(tmp_path: Path) -> None:
    def daemon_with(cidrs: tuple[str, ...]) -> Daemon:
        cfg = ProxyConfig(
            nodeport_addresses=cidrs,
            healthz_bind_address="127.0.0.1:0",
            metrics_bind_address="127.0.0.1:0",
            hostname_override="node-1",
        )
        return Daemon(
            cfg, FakeProxier(cfg), lambda sink: FilesSource(sink, tmp_path, "node-1"), reconciler=NoConntrack()
        )  # type: ignore[arg-type]

    assert daemon_with(()).service_health.addresses == ("",)  # every address
    assert daemon_with(("127.0.0.0/8",)).service_health.addresses == ("127.0.0.1",)
    assert daemon_with(("primary",)).service_health.addresses == ("",)


def test_local_ready_endpoints_counts_a_dual_stack_pod_once() -> None:
    from types import MappingProxyType

    from kproxy.model import Endpoint, NodeInfo, ProxyState, ServicePort

    spn = ServicePortName("demo", "lb", "http", Protocol.TCP)
    v4 = (
        Endpoint("198.18.65.10", 8080, is_local=True),
        Endpoint("198.18.65.11", 8080, is_local=True, ready=False),
        Endpoint("198.18.66.10", 8080),  # on another node
    )
    v6 = (Endpoint("fd00:198:18:65::10", 8080, is_local=True),)
    sps = {
        IPFamily.V4: ServicePort(
            spn, IPFamily.V4, "198.19.0.1", 80, health_check_node_port=31000, serving_endpoints=v4
        ),
        IPFamily.V6: ServicePort(
            spn, IPFamily.V6, "fd00:198:18:ff::1", 80, health_check_node_port=31000, serving_endpoints=v6
        ),
    }
    state = ProxyState({f: MappingProxyType({spn: sp}) for f, sp in sps.items()}, NodeInfo("node-1"))
    assert facts(state).local_ready() == {spn.service: 1}


def test_local_ready_endpoints_of_a_load_balancer_without_ingress_yet() -> None:
    """eTP=Local, no node ports and no ingress IP yet: no external address, so the traffic policy chose no local
    set; upstream's LocalReadyEndpoints still counts the ready local pod, so the health check answers 200."""
    from kproxy.cache import ServiceCache

    cache = ServiceCache("node-1", ip_families=(IPFamily.V4,))
    spec = {"healthCheckNodePort": 32000, "allocateLoadBalancerNodePorts": False}
    cache.upsert_service(service("lb", "198.19.0.9", type="LoadBalancer", externalTrafficPolicy="Local", **spec))
    cache.upsert_slice(slice_("lb-1", "lb", ["198.18.65.10"]))
    cache.upsert_slice(slice_("lb-2", "lb", ["198.18.66.10"], node="node-2"))
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, _ = cache.snapshot()
    svc = ServicePortName("demo", "lb", "http", Protocol.TCP).service
    assert facts(state).health_ports() == {svc: 32000}
    assert facts(state).local_ready() == {svc: 1}


def facts(state: Any) -> Any:
    from kproxy.model import Changes
    from kproxy.syncfacts import SyncFacts

    got = SyncFacts((IPFamily.V4, IPFamily.V6))
    got.update(state, Changes(full=True))
    return got


class FlakyConntrack:
    """Fails its first reconciliation (as a netlink dump can), then succeeds."""

    def __init__(self) -> None:
        self.calls = 0
        self.last_ok = True

    def reconcile(
        self, state: object, node_ips: object, answerers: object = None, changed: object = None
    ) -> dict[IPFamily, int]:
        self.calls += 1
        self.last_ok = self.calls > 1
        return {}


def test_a_failed_conntrack_reconcile_is_retried_without_a_new_change(tmp_path: Path) -> None:
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        sync_period=0.3,
    )
    fake = FakeProxier(cfg)
    ct = FlakyConntrack()
    daemon = Daemon(cfg, fake, lambda sink: FilesSource(sink, tmp_path, "node-1", poll_interval=0.1), reconciler=ct)  # type: ignore[arg-type]
    udp = service("dns", "198.19.0.53")
    udp["spec"]["ports"] = [{"name": "dns", "port": 53, "protocol": "UDP"}]  # type: ignore[index]
    write(tmp_path, "a.yaml", udp)
    daemon.start()
    try:
        eventually(lambda: ct.calls >= 2)  # the periodic sync retried it: nothing else changed
        calls = ct.calls
        time.sleep(1.0)
        assert ct.calls == calls  # and once it succeeded, no more reconciling without UDP changes
    finally:
        daemon.stop()


def test_before_sync_runs_once_the_ports_are_bound_and_not_when_they_are_taken(tmp_path: Path) -> None:
    """The CLI removes other modes' leftovers in ``before_sync``: after the servers are bound, before any sync;
    a second kproxy whose port is taken fails first and removes nothing."""
    import socket

    def make(healthz: str) -> tuple[Daemon, FakeProxier]:
        cfg = ProxyConfig(
            mode="iptables",
            hostname_override="node-1",
            healthz_bind_address=healthz,
            metrics_bind_address="127.0.0.1:0",
            min_sync_period=0.0,
            manifests=str(tmp_path),
        )
        fake = FakeProxier(cfg)
        source = lambda sink: FilesSource(sink, tmp_path, cfg.node_name, poll_interval=0.1)  # noqa: E731
        return Daemon(cfg, fake, source, reconciler=NoConntrack()), fake  # type: ignore[arg-type]

    seen: list[tuple[int, int]] = []
    daemon, fake = make("127.0.0.1:0")
    daemon.start(before_sync=lambda: seen.append((daemon.healthz.port, len(fake.syncs))))
    try:
        assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] == 0
        eventually(lambda: len(fake.syncs) > 0)
    finally:
        daemon.stop()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        second, _ = make(f"127.0.0.1:{taken.getsockname()[1]}")
        called: list[bool] = []
        with pytest.raises(OSError):
            second.start(before_sync=lambda: called.append(True))
        second.stop()
        assert called == []


def test_after_first_sync_runs_once_after_the_first_sync_and_before_it_is_reported(tmp_path: Path) -> None:
    """The CLI removes other modes' leftovers there: once this mode's rules are in (a mode switch has no gap), and
    before health and metrics say it synced (so "synced" means "the old mode is gone" too)."""
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        manifests=str(tmp_path),
    )
    fake = FakeProxier(cfg)
    source = lambda sink: FilesSource(sink, tmp_path, cfg.node_name, poll_interval=0.1)  # noqa: E731
    daemon = Daemon(cfg, fake, source, reconciler=NoConntrack())  # type: ignore[arg-type]
    seen: list[tuple[int, float | None]] = []
    synced = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"

    def hook() -> None:
        seen.append((len(fake.syncs), daemon.metrics.value(synced, {"ip_family": "IPv4"})))
        raise RuntimeError("a failing cleanup must not stop the proxy")

    daemon.start(after_first_sync=hook)
    try:
        eventually(lambda: len(fake.syncs) >= 2 or bool(daemon.metrics.value(synced, {"ip_family": "IPv4"})))
        daemon.runner.run()
        eventually(lambda: len(fake.syncs) >= 2)
        assert len(seen) == 1 and seen[0][0] == 1 and not seen[0][1]  # once, after sync 1, before it was reported
        assert daemon.metrics.value(synced, {"ip_family": "IPv4"})
    finally:
        daemon.stop()


def _settling_daemon(tmp_path: Path, **periods: float) -> tuple[Daemon, FakeProxier]:
    """``kproxy run``'s daemon (its heap settled after syncs) over a fake and one service in a manifest folder."""
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        manifests=str(tmp_path),
        **periods,  # type: ignore[arg-type]
    )
    write(tmp_path, "a.yaml", service("web", "10.96.0.10"), slice_("web-1", "web", ["10.0.0.5"]))
    fake = FakeProxier(cfg)
    source = lambda sink: FilesSource(sink, tmp_path, cfg.node_name, poll_interval=0.1)  # noqa: E731
    return Daemon(cfg, fake, source, reconciler=NoConntrack(), settle_heap=True), fake  # type: ignore[arg-type]


def test_kproxy_runs_heap_is_settled_after_a_sync_and_given_back_at_stop(tmp_path: Path) -> None:
    """``kproxy run`` settles its heap after syncs (kproxy.gcpause.settle): the cache's objects are then out of the
    collector's walks, so a churn's full collections walk only what changed since; stop gives the heap back."""
    import gc

    daemon, fake = _settling_daemon(tmp_path, sync_period=0.5)
    daemon.start()
    try:
        eventually(lambda: daemon.status.syncs >= 1 and "web" in programmed(fake))
        services = daemon.cache._services
        assert services and not any(o is services for o in gc.get_objects())
    finally:
        daemon.stop()
    assert gc.get_freeze_count() == 0


def test_the_periodic_full_sync_gives_the_settled_heap_back_to_the_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen object that joined a garbage cycle would never be freed: the periodic full sync unsettles the heap
    (a whole collection) before settling it again, so no such leak outlives the full sync period."""
    import gc

    from kproxy.gcpause import collector_paused

    unsettled: list[float] = []
    real = collector_paused.unsettle

    def counting() -> None:
        unsettled.append(time.monotonic())
        real()

    monkeypatch.setattr(collector_paused, "unsettle", counting)
    daemon, _ = _settling_daemon(tmp_path, sync_period=0.2, full_sync_period=0.2)
    daemon.start()
    try:
        eventually(lambda: daemon.status.syncs >= 3 and bool(unsettled))  # a periodic full sync came, and unsettled
    finally:
        daemon.stop()
    assert gc.get_freeze_count() == 0
