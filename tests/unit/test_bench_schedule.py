"""The data-path benchmark's schedule, without a lab: who serves whom (every target a server and a client pod of its
own, so each echo server takes one operation per turn of the interleaving), where each target's sockets are made (the
limits' from nodes that never run a proxy, the pod IP's and the ClusterIP's from a loaded node), the calibration
(mode none) with a real run's targets and schedule, and rounds failed for their errors left out whole."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kproxy.bench import datapath, dpconfig, dpstats
from kproxy.lab.cluster import make_plan

LOADED = {"node-1", "node-2"}


def _nodes(pods_per_node: int = dpconfig.PODS_PER_NODE) -> dict[str, str]:
    """pod name -> node name in the benchmark's lab (8 nodes: the conntrack limits are on)."""
    plan = make_plan(8, pods_per_node, ipv6=False, prefix="kpd-")
    return {p.name: p.node for p in plan.pods}


@pytest.mark.parametrize("counters_cost", [False, True])
def test_every_target_has_a_server_and_a_client_pod_of_its_own(counters_cost: bool) -> None:
    cfg = datapath.DatapathConfig(counters_cost=counters_cost)
    targets = datapath.targets_for("nftables", cfg)
    # every target measured has a role, and only those: the reversed ClusterIP only with --counters-cost
    assert set(targets) == set(dpconfig.ROLES) - (set() if counters_cost else {dpconfig.REV})
    servers = [dpconfig.ROLES[t][1] for t in targets]
    clients = [dpconfig.ROLES[t][0] for t in targets]
    assert len(set(servers)) == len(servers), servers  # no server shared: one operation per turn each
    assert len(set(clients)) == len(clients), clients
    nodes = _nodes(cfg.pods_per_node)
    assert set(servers) | set(clients) <= set(nodes)  # every pod exists in the lab the benchmark builds
    # the ClusterIP's only endpoint is its server (the Service written to the lab's API)
    assert dpconfig.ROLES["clusterip"][1] == "pod-2-1"


def test_the_twin_crosses_the_limits_nodes_between_other_pods() -> None:
    nodes = _nodes()
    limit, twin = dpconfig.ROLES["limit"], dpconfig.ROLES[datapath.TWIN]
    assert [nodes[p] for p in limit] == [nodes[p] for p in twin]  # the same path
    assert set(limit).isdisjoint(twin)  # its own pods, so its own server


def test_limits_start_from_nodes_without_a_proxy_and_service_traffic_from_a_loaded_one() -> None:
    nodes = _nodes()
    for t in dpconfig.LIMIT_TARGETS:
        client, server = dpconfig.ROLES[t]
        # a limit's sockets are made in its client's node's cgroup: never one with a proxy's socket programs
        assert nodes[client] not in LOADED and nodes[server] not in LOADED, t
    for t in ("podip", "clusterip"):
        client, server = dpconfig.ROLES[t]
        assert (nodes[client], nodes[server]) == ("node-1", "node-2"), t


def test_the_calibration_runs_a_real_runs_targets() -> None:
    for cfg in (
        datapath.DatapathConfig(),
        datapath.DatapathConfig(conntrack_limits=False),
        datapath.DatapathConfig(twin=False),
    ):
        real = datapath.targets_for("nftables", cfg)
        assert datapath.targets_for(datapath.NONE_MODE, cfg) == real
        assert "clusterip" in real and (datapath.TWIN in real) == cfg.twin


def _fig(ops: int, errors: int) -> dict[str, Any]:
    return {"ops": ops, "errors": errors, "rate": 1000.0, "p50_us": 100.0, "p99_us": 300.0}


def test_a_round_fails_above_the_error_threshold() -> None:
    clean = {"limit": {"crr": _fig(1000, 0), "udp": _fig(1000, 0)}, "podip": {"crr": _fig(1000, 0)}}
    assert dpstats.round_failure(clean) == ""
    one_lost = {**clean, "podip": {"crr": _fig(1000, 5)}}  # 0.5 %: under the threshold
    assert dpstats.round_failure(one_lost) == ""
    lossy = {**clean, "podip": {"crr": _fig(1000, 30)}}  # 3 %
    why = dpstats.round_failure(lossy)
    assert "podip crr: 30 of 1030" in why and "limit" not in why
    assert dpstats.round_failure({"limit": {"rr": _fig(0, 1)}}) != ""  # nothing but a failure


class _Rounds:
    """The bookkeeping side of a DatapathLab (no lab): judged_round answers scripted rounds, so measure_run's
    pairing and leaving-out can be checked. Traffic itself is the integration tests' (test_bench_dp_selftest)."""

    def __init__(self, rounds: list[tuple[dict[str, dict[str, float]], str]]) -> None:
        self.config = datapath.DatapathConfig(rounds=len(rounds), conntrack_limits=False, twin=False)
        self._rounds = list(rounds)

    def progress(self, _msg: str, _advance: int = 0) -> None:
        pass

    def kproxy_cpu(self) -> dict[str, float]:
        return {}

    def path_nodes(self, _target: str) -> list[Any]:
        return [SimpleNamespace(ns="client"), SimpleNamespace(ns="server")]

    def conntrack_count(self, _ns: str) -> float | None:
        return None  # conntrack not loaded: nothing recorded

    def judged_round(self, order: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, int], str]:
        figures, failure = self._rounds.pop(0)
        return {t: figures[t] for t in order}, {t: 0 for t in order}, failure


def test_a_failed_round_is_left_out_whole() -> None:
    good = {"limit": {"conn_rate": 1000.0}, "podip": {"conn_rate": 900.0}, "clusterip": {"conn_rate": 800.0}}
    broken = {"limit": {"conn_rate": 1000.0}, "podip": {"conn_rate": 100.0}, "clusterip": {"conn_rate": 800.0}}
    dl = _Rounds([(good, ""), (broken, "podip crr: 50 of 150 operations failed"), (good, "")])
    run = datapath.measure_run(dl, "nftables", 1, ("limit", "podip", "clusterip"))  # type: ignore[arg-type]
    assert len(run.rounds) == 2 and run.failed_rounds == ["round 2: podip crr: 50 of 150 operations failed"]
    assert run.ratios["podip"]["conn_rate"] == pytest.approx(0.9)
    assert run.medians["podip"]["conn_rate"] == 900.0


def test_a_run_with_most_rounds_failed_is_an_error() -> None:
    good = {"limit": {"conn_rate": 1000.0}, "podip": {"conn_rate": 900.0}, "clusterip": {"conn_rate": 800.0}}
    dl = _Rounds([(good, "x"), (good, "y"), (good, "")])
    with pytest.raises(datapath.DatapathError, match="2 of 3 rounds failed"):
        datapath.measure_run(dl, "nftables", 1, ("limit", "podip", "clusterip"))  # type: ignore[arg-type]
