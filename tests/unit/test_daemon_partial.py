"""What the runner thread does in a partial sync costs the changes, not the table: the same Python calls at 300 and
1,200 services; the service health servers get their table only when it changed (or a listener is owed another
try), the conntrack reconciler only the UDP changes."""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kproxy.bench import synthetic
from kproxy.config import ProxyConfig
from kproxy.conntrack import ConntrackReconciler
from kproxy.daemon import Daemon
from kproxy.fake import FakeProxier
from kproxy.model import Changes, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.sources.files import FilesSource

LB = ServicePortName("ns", "lb", "http", Protocol.TCP)
WEB = ServicePortName("ns", "web", "http", Protocol.TCP)


class NoConntrack:
    def reconcile(self, *args: object, **kwargs: object) -> dict[IPFamily, int]:
        return {}


class HealthRecorder:
    """Stands in for the service health servers: records what the daemon hands them; ``fail`` makes the next
    ``sync_services`` report a listener it could not open, as the real one does through its callback."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.calls: list[dict[Any, int]] = []
        self.fail = 0

    def sync_services(self, ports: dict[Any, int]) -> None:
        self.calls.append(dict(ports))
        if self.fail:
            self.fail -= 1
            for svc, port in ports.items():
                self.daemon._listen_error(svc, port, "address already in use")

    def sync_endpoints(self, counts: object) -> None:
        pass

    def close(self) -> None:
        pass


def _state(web_port: int) -> ProxyState:
    lb = ServicePort(LB, IPFamily.V4, "198.19.0.1", 80, health_check_node_port=31000, external_policy_local=True)
    web = ServicePort(WEB, IPFamily.V4, "198.19.0.2", web_port)
    return ProxyState({IPFamily.V4: MappingProxyType({LB: lb, WEB: web})}, NodeInfo("node-1"))


def test_the_health_servers_hear_only_of_changes_and_of_listeners_to_retry(tmp_path: Path) -> None:
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
    )
    daemon = Daemon(cfg, FakeProxier(cfg), lambda sink: FilesSource(sink, tmp_path, "node-1"), reconciler=NoConntrack())  # type: ignore[arg-type]
    real, rec = daemon.service_health, HealthRecorder(daemon)
    daemon.service_health = rec  # type: ignore[assignment]
    ok = SyncResult(ok=True)
    try:
        daemon._after_sync(_state(80), Changes(full=True), ok, 0.0)
        assert rec.calls == [{LB.service: 31000}]
        for port in (81, 82, 83):  # another service changes: the health servers' table did not
            daemon._after_sync(_state(port), Changes(full=False, services=frozenset({WEB})), ok, 0.0)
        assert len(rec.calls) == 1
        rec.fail = 1  # a full sync hands the table over again; its listener fails to open...
        daemon._after_sync(_state(83), Changes(full=True), ok, 0.0)
        daemon._after_sync(_state(84), Changes(full=False, services=frozenset({WEB})), ok, 0.0)
        assert len(rec.calls) == 3  # ...so the next sync tries it again, with nothing changed
        daemon._after_sync(_state(85), Changes(full=False, services=frozenset({WEB})), ok, 0.0)
        assert len(rec.calls) == 3  # it opened: nothing more to do
    finally:
        daemon.service_health = real
        daemon.stop()


class _Recorder:
    """Records what the daemon hands the reconciler."""

    def __init__(self) -> None:
        self.changed: list[object] = []
        self.last_ok = True

    def reconcile(
        self, state: object, node_ips: object, answerers: object = None, changed: object = None
    ) -> dict[IPFamily, int]:
        self.changed.append(None if changed is None else set(changed))  # type: ignore[call-overload]
        return {}


def test_the_daemon_hands_the_reconciler_the_udp_changes_since_it_last_ran(tmp_path: Path) -> None:
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
    )
    rec = _Recorder()
    daemon = Daemon(cfg, FakeProxier(cfg), lambda sink: FilesSource(sink, tmp_path, "node-1"), reconciler=rec)  # type: ignore[arg-type]
    udp, tcp = ServicePortName("ns", "dns", "dns", Protocol.UDP), WEB
    sp = ServicePort(udp, IPFamily.V4, "198.19.0.1", 53)
    state = ProxyState({IPFamily.V4: MappingProxyType({udp: sp})}, NodeInfo("node-1"))
    ok = SyncResult(ok=True)
    try:
        daemon._after_sync(state, Changes(full=True), ok, 0.0)
        daemon._after_sync(state, Changes(full=False, services=frozenset({tcp})), ok, 0.0)  # nothing for conntrack
        daemon._after_sync(state, Changes(full=False, services=frozenset({udp, tcp})), ok, 0.0)
        daemon._after_sync(state, Changes(full=True), ok, 0.0)
        assert rec.changed == [None, {udp}, None]  # a full sync: anything may have changed
    finally:
        daemon.stop()


class _NoDump(ConntrackReconciler):
    """The reconciler up to its dump (O(conntrack entries), not of the table; tests/integration/test_conntrack.py
    runs it on a real table): what it does with the state is what this test counts."""

    def _delete_stale(self, family: IPFamily, targets: object) -> tuple[int, bool]:
        return 0, True


def _partial_calls(tmp_path: Path, n: int, runs: int = 6) -> dict[tuple[str, int, str], int]:
    """Python calls per function over ``runs`` partial syncs of the runner thread's whole path (snapshot, node
    context, ledger and fake backend, commit, facts, metrics, health servers, conntrack) at ``n`` UDP services."""
    cfg = ProxyConfig(
        mode="iptables",
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        ip_families=(IPFamily.V4,),
    )
    folder = tmp_path / str(n)
    folder.mkdir()
    reconciler = _NoDump(families=(IPFamily.V4,))
    daemon = Daemon(cfg, FakeProxier(cfg), lambda sink: FilesSource(sink, folder, "node-1"), reconciler=reconciler)
    real, daemon.service_health = daemon.service_health, HealthRecorder(daemon)  # type: ignore[assignment]
    profile = cProfile.Profile()
    try:
        daemon.cache.replace_services(synthetic.services(n, udp_every=1))
        daemon.cache.replace_slices(synthetic.endpoint_slices(n, 2, udp_every=1))
        assert daemon._sync_now()
        for r in range(runs):
            daemon.cache.upsert_slice(synthetic.endpoint_slice(1 + (r * 7919) % n, 2, variant=r + 1, udp_every=1))
            profile.enable()
            assert daemon._sync_now()
            profile.disable()
    finally:
        daemon.service_health = real
        daemon.stop()
    return {key: counts[1] for key, counts in pstats.Stats(profile).stats.items()}  # type: ignore[attr-defined]


def test_a_partial_sync_makes_the_same_calls_whatever_the_tables_size(tmp_path: Path) -> None:
    """No step of the runner thread's partial sync walks the table in Python: four times the services, the same
    calls (a walk would add thousands; a few more equality checks of one service's values are not a walk)."""
    runs = 6
    small, big = _partial_calls(tmp_path, 300, runs), _partial_calls(tmp_path, 1200, runs)
    grown = {f"{k[0].rsplit('/', 1)[-1]}:{k[1]}:{k[2]}": (small.get(k, 0), v) for k, v in big.items()}
    assert {k: c for k, c in grown.items() if c[1] > c[0] + 2 * runs} == {}
