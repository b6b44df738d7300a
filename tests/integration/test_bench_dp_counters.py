"""``kproxy bench datapath --counters-cost`` on its own lab (prefix ``kpxc-``, or ``KPROXY_BENCH_DP_LAB_PREFIX``; taken
down also on failure), nftables at one service, a few short rounds: the run's JSON carries counters on / off and the
node asymmetry per metric from both halves (node-2 counting, then node-1), and each half's check that the counting
node's ``/metrics`` grew by the connections made to its ClusterIP target (at least those answered, at most those
sent). The figures themselves are not bounded here (benchmarks judge speed on a quiet machine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from modes import require_mode

from kproxy.bench import datapath, dpcounters
from kproxy.lab.cluster import Lab

pytestmark = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed"),
]

PREFIX = os.environ.get("KPROXY_BENCH_DP_LAB_PREFIX") or "kpxc-"


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_counters_cost_carries_the_ratio_and_the_counter_check() -> None:
    require_mode("nftables")
    cfg = datapath.DatapathConfig(
        rounds=3,
        seconds=0.2,
        iperf_seconds=1.0,
        prefix=PREFIX,
        conntrack_limits=False,
        twin=False,
        idle_seconds=0.0,
        counters_cost=True,
    )
    try:
        result = datapath.run_datapath(["nftables"], [1], cfg)
    finally:
        Lab.down(prefix=PREFIX)
    doc = json.loads(json.dumps(result.to_json()))  # what --format json prints
    assert doc["config"]["counters_cost"] is True and doc["config"]["counters_cost_detail"]
    (run,) = doc["runs"]
    assert not run["error"], run["error"]
    assert run["medians"][datapath.REV]["conn_rate"] > 0 and run["medians"]["clusterip"]["conn_rate"] > 0
    cost = run["counters_cost"]
    assert "error" not in cost, cost.get("error")
    for key in ("ratio", "node_asymmetry"):
        assert {"conn_rate", "conn_p50_us", "rr_p50_us", "udp_p50_us"} <= set(cost[key]), (key, cost[key])
        assert all(v > 0 for v in cost[key].values()), (key, cost[key])
    assert isinstance(cost["within_budget"], bool) and cost["budget"] == {"conn_rate": 0.97}
    halves = cost["halves"]
    assert [h["counting_node"] for h in halves] == list(dpcounters.HALVES)
    assert [h["counted"] for h in halves] == [datapath.REV, "clusterip"]
    for h in halves:
        check = h["check"]
        assert not h["error"] and h["rounds"] >= 2 and "conn_rate" in h["ratio"], h
        # every answered connection was counted on the counting node, and nothing beyond what was sent to it
        assert 0 < check["answered"] <= check["counted"] <= check["sent"] + check["probes_since_start"], check
        assert check["node"] == h["counting_node"] and check["service"].startswith("datapath/"), check
    assert not cost["second_run"]["error"] and cost["second_run"]["medians"]["clusterip"]["conn_rate"] > 0
    assert "counters on / off" in datapath.format_table(result)
    assert not [ns for ns in _netns() if ns.startswith(PREFIX)]
