"""The pieces of ``kproxy bench datapath --counters-cost`` that need no root (kproxy.bench.dpcounters): the swap's
arithmetic (counters on / off and the node asymmetry from the two halves), the counter check's bounds against a real
exposition text, the option and its targets, the second target service, and the table and report lines."""

from __future__ import annotations

from dataclasses import dataclass

import kubernetes_validate
import pytest

from kproxy.bench import datapath, dpconfig, dpcounters, dpobjects, report
from kproxy.cli import build_parser
from kproxy.counters import Scrape, parse
from kproxy.lab.cluster import LabPod

COST, ASYM = 0.95, 1.02  # what the counters cost, and how much faster the reverse path is without them


@dataclass
class _Pod:
    node: str


class _Lab:
    """What dpcounters asks a DatapathLab: its targets, each target's client pod's node, the counting node's
    ``/metrics`` text (one answer per read, the last repeated) and the operations made so far."""

    def __init__(self, texts: list[str] | None = None, made: dict[str, dict[str, int]] | None = None) -> None:
        self.config = datapath.DatapathConfig(counters_cost=True)
        self.all_targets = dpconfig.targets_for("nftables", self.config)
        self.texts = texts or []
        self.made = made or {}

    def client_of(self, target: str) -> _Pod:
        return _Pod("node-" + dpconfig.ROLES[target][0].split("-")[1])  # pod-2-3 runs on node-2

    def read_counters(self, node: str) -> Scrape:
        text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
        return parse(text, 0.0)


def _exposition(count: int) -> str:
    labels = 'namespace="datapath",service="target-rev",port="tcp",protocol="TCP",family="IPv4"'
    return (
        "# TYPE kproxy_service_counters_offered gauge\n"
        'kproxy_service_counters_offered{measure="connections"} 1.0\n'
        "# TYPE kproxy_service_connections_total counter\n"
        f"kproxy_service_connections_total{{{labels}}} {count}\n"
    )


def _half(counted_speed: float, uncounted_speed: float, counted: str, uncounted: str) -> datapath.DatapathRun:
    run = datapath.DatapathRun(mode="nftables", services=1)
    for wobble in (0.9, 1.0, 1.1):  # the machine's drift hits both paths of a round alike
        base = 1000.0 * wobble
        run.rounds.append(
            {
                counted: {"conn_rate": base * counted_speed, "conn_p50_us": 100.0 / wobble / counted_speed},
                uncounted: {"conn_rate": base * uncounted_speed, "conn_p50_us": 100.0 / wobble / uncounted_speed},
            }
        )
    return run


def test_the_swap_separates_the_counters_cost_from_the_paths_difference() -> None:
    dl = _Lab()
    assert dpcounters.counted_target(dl, "node-2") == dpconfig.REV  # type: ignore[arg-type]
    assert dpcounters.counted_target(dl, "node-1") == "clusterip"  # type: ignore[arg-type]
    first = _half(COST * ASYM, 1.0, dpconfig.REV, "clusterip")  # node-2 counts the reverse path
    second = _half(COST, ASYM, "clusterip", dpconfig.REV)  # node-1 counts the ClusterIP path
    first.counters_cost = {"check": {"node": "node-2", "counted": 10}}
    entry = dpcounters.cost_entry(dl, first, second)  # type: ignore[arg-type]
    for metric in ("conn_rate", "conn_p50_us"):
        assert entry["ratio"][metric] == pytest.approx(COST, abs=1e-3)
        assert entry["node_asymmetry"][metric] == pytest.approx(ASYM, abs=1e-3)
    assert entry["within_budget"] is False and entry["budget"] == {"conn_rate": dpconfig.COUNTERS_BUDGET}
    assert entry["halves"][0]["ratio"]["conn_rate"] == pytest.approx(COST * ASYM, abs=1e-3)
    assert entry["halves"][0]["check"] == {"node": "node-2", "counted": 10} and entry["halves"][1]["check"] is None
    second.error = "measuring: no counters"
    assert dpcounters.cost_entry(dl, first, second)["error"] == "the swapped half: measuring: no counters"  # type: ignore[arg-type]


def test_the_counter_check_wants_every_answered_connection_and_no_more_than_were_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dpcounters, "COUNTED_TIMEOUT", 0.0)
    made = {dpconfig.REV: {"crr_ok": 100, "crr_sent": 110, "rr_sent": 3, "probes": 2}}
    key = dpcounters.key_of(dpconfig.REV)
    for after, ok in ((600, True), (615, True), (599, False), (616, False)):
        dl = _Lab([_exposition(after)])
        w = dpcounters.CounterWatch("node-2", dpconfig.REV, key, 500.0, {"crr_ok": 0, "crr_sent": 0, "rr_sent": 0})
        dl.made = made
        if ok:
            check = dpcounters.verify(dl, w)  # type: ignore[arg-type]
            assert check["counted"] == after - 500 and check["answered"] == 100 and check["sent"] == 113
        else:
            with pytest.raises(dpconfig.DatapathError, match="does not count what it translates"):
                dpcounters.verify(dl, w)  # type: ignore[arg-type]


def test_watch_wants_the_other_node_without_counters_and_the_counting_node_with_them() -> None:
    uncounted = "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n"
    dl = _Lab([_exposition(7)])
    with pytest.raises(dpconfig.DatapathError, match="node-1 serves service counters"):
        dpcounters.watch(dl, "node-2")  # type: ignore[arg-type]
    dl = _Lab([uncounted])
    with pytest.raises(dpconfig.DatapathError, match="counts no connections"):
        dpcounters.watch(dl, "node-2")  # type: ignore[arg-type]


def test_the_option_adds_the_reverse_target_and_a_pod_per_node() -> None:
    args = build_parser().parse_args(["bench", "datapath", "--mode", "nftables", "--counters-cost"])
    assert args.counters_cost is True
    plain, counted = datapath.DatapathConfig(), datapath.DatapathConfig(counters_cost=True)
    assert dpconfig.REV not in datapath.targets_for("nftables", plain) and plain.pods_per_node == 2
    assert dpconfig.REV in datapath.targets_for("nftables", counted) and counted.pods_per_node == 3
    assert counted.describe()["counters_cost"] is True and not plain.describe()["counters_cost_detail"]
    # the reverse target has its own client and server pod, the third of each loaded node
    assert dpconfig.ROLES[dpconfig.REV] == ("pod-2-3", "pod-1-3")
    assert len({p for pods in dpconfig.ROLES.values() for p in pods}) == 2 * len(dpconfig.ROLES)
    pod = LabPod(name="pod-1-3", node="node-1", ns="kpd-p1-3", ip4="198.18.65.13", ip6="")
    for obj in dpobjects.target_objects(pod, *dpconfig.CLUSTER_IPS[dpconfig.REV]):
        kubernetes_validate.validate(obj, "1.32", strict=True)
    svc = dpobjects.target_objects(pod, *dpconfig.CLUSTER_IPS[dpconfig.REV])[0]
    assert svc["metadata"]["name"] == dpconfig.REV_NAME and svc["spec"]["clusterIP"] == dpconfig.REV_CLUSTER_IP


def _cost_result() -> dpconfig.DatapathResult:
    dl = _Lab()
    first = _half(0.98 * ASYM, 1.0, dpconfig.REV, "clusterip")
    second = _half(0.98, ASYM, "clusterip", dpconfig.REV)
    check = {"node": "node-2", "target": dpconfig.REV, "service": dpcounters.key_of(dpconfig.REV)}
    first.counters_cost = {"check": {**check, "counted": 1234, "answered": 1230, "sent": 1240}}
    first.medians = {
        "limit": {"conn_rate": 1000.0},
        "clusterip": {"conn_rate": 900.0},
        dpconfig.REV: {"conn_rate": 910.0},
    }
    first.counters_cost = dpcounters.cost_entry(dl, first, second)  # type: ignore[arg-type]
    res = dpconfig.DatapathResult(config=datapath.DatapathConfig(rounds=3, counters_cost=True).describe())
    res.runs.append(first)
    return res


def test_the_table_and_the_report_show_the_counters_cost() -> None:
    res = _cost_result()
    table = datapath.format_table(res)
    assert "counters on / off (--service-counters)" in table and "node-2 counting" in table
    assert "budget: conn_rate on/off >= 0.97: within" in table
    assert "counted on node-2: 1,234 new connections to datapath/target-rev:tcp/TCP IPv4" in table
    text = report.render({"command": "kproxy bench datapath", "datapath": res.to_json()}, [])
    assert "### What the service counters cost" in text
    row = next(line for line in text.splitlines() if line.startswith("| nftables | 1 | on / off |"))
    assert row.startswith("| nftables | 1 | on / off | 0.980 |") and row.endswith("| within |")
    assert "| nftables | 1 | asymmetry | 1.020 |" in text
    assert "| nftables | 1 | clusterip_rev | 910 |" in text and "clusterip_rev/limit" in table
    assert "node-2 counted 1,234 new connections to `datapath/target-rev:tcp/TCP IPv4`" in text
