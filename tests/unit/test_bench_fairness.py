"""``kproxy compare``'s fairness column: the split read back from the exposition kproxy's own collector renders,
its chi-square test (``kproxy.fairness``) in results.json's entry and in the report's table, and the options."""

from __future__ import annotations

import json
import shlex

from kproxy.bench import report, spread
from kproxy.bench.compare import compare_command
from kproxy.cli import build_parser
from kproxy.counters import CounterCollector, CounterDump, Counts, Measure, PortCounters, Scrape, parse
from kproxy.fairness import fairness
from kproxy.model import IPFamily, Protocol, ServicePortName

SPN = ServicePortName(spread.NAMESPACE, spread.NAME, "tcp", Protocol.TCP)
EPS = [f"198.18.66.{10 + i}:8080" for i in range(spread.ENDPOINTS)]


class Source:
    counters_offered = frozenset({Measure.CONNECTIONS})

    def __init__(self) -> None:
        self.ports: dict[ServicePortName, PortCounters] = {}

    def counters(self, family: IPFamily) -> CounterDump:
        return CounterDump(family, dict(self.ports))


def read(source: Source, conns: list[int]) -> Scrape:
    source.ports[SPN] = PortCounters.of({ep: Counts(n) for ep, n in zip(EPS, conns, strict=True)})
    return parse(CounterCollector(source, [IPFamily.V4]).exposition().decode(), 0.0)


def entry(mode: str, before: list[int], after: list[int]) -> dict[str, object]:
    source = Source()
    split = spread.counted_split(read(source, before), read(source, after), EPS)
    answered = {ep: a - b for ep, a, b in zip(EPS, after, before, strict=True)}
    return spread.fairness_entry(mode, split, answered, sum(answered.values()))


def test_the_entry_is_the_counted_difference_and_its_test() -> None:
    e = entry("iptables", [3, 1, 0, 2], [3 + 90, 1 + 60, 0 + 80, 2 + 70])
    assert e["counted"] == dict(zip(EPS, [90, 60, 80, 70], strict=True))
    assert e["counted_equals_answered"] is True and e["connections"] == 300 and e["endpoints"] == 4
    expected = fairness([90, 60, 80, 70])
    assert expected is not None and e["fairness"] == expected.as_dict()
    f = e["fairness"]
    assert isinstance(f, dict)
    # the numbers behind the column: (90-75)^2+(60-75)^2+(80-75)^2+(70-75)^2 over 75
    assert f["chi2"] == (225 + 225 + 25 + 25) / 75 and f["dof"] == 3
    assert f["maxShare"] == 0.3 and f["minShare"] == 0.2 and abs(f["maxMinRatio"] - 1.5) < 1e-12
    json.dumps(e)  # results.json takes it as is


def test_an_uneven_split_has_a_small_p_and_an_idle_endpoint_an_infinite_ratio() -> None:
    even = entry("a", [0] * 4, [75] * 4)["fairness"]
    skewed = entry("b", [0] * 4, [150, 150, 0, 0])["fairness"]
    assert isinstance(even, dict) and isinstance(skewed, dict)
    assert even["pValue"] == 1.0 and even["chi2"] == 0.0
    assert skewed["pValue"] < 1e-30 and skewed["maxMinRatio"] is None  # inf is not JSON: None
    nothing = entry("c", [5] * 4, [5] * 4)
    assert nothing["fairness"] is None


def test_counted_and_answered_disagreeing_is_reported() -> None:
    source = Source()
    split = spread.counted_split(read(source, [0] * 4), read(source, [10, 10, 10, 10]), EPS)
    e = spread.fairness_entry("x", split, dict(zip(EPS, [11, 9, 10, 10], strict=True)), 40)
    assert e["counted_equals_answered"] is False


def test_the_report_table_shows_each_modes_test() -> None:
    runs = [entry("iptables", [0] * 4, [90, 60, 80, 70]), entry("userspace", [0] * 4, [75] * 4)]
    runs.append({"mode": "bpf", "connections": 300, "fairness": None, "error": "kproxy on node-1 is not running"})
    results = {"fairness": {"connections": 300, "endpoints": 4, "runs": runs}}
    lines = report.fairness_section(results)
    text = "\n".join(lines)
    f = fairness([90, 60, 80, 70])
    assert f is not None
    row = f"| iptables | 300 | {f.chi2:.2f} (3) | {f.p_value:.3g} | 30.0% | 20.0% | 1.50 | yes |"
    assert row in text
    assert "| userspace | 300 | 0.00 (3) | 1 | 25.0% | 25.0% | 1.00 | yes |" in text
    assert "| bpf | 300 | failed: kproxy on node-1 is not running | - | - | - | - | - |" in text
    assert "300 new TCP connections from one pod to a ClusterIP with 4 endpoints" in text
    assert report.fairness_section({"fairness": None}) == []  # compare --no-fairness: no section
    full = report.render({"command": "kproxy compare", "machine": {}, **results}, [])
    assert row in full


def test_compare_spells_out_the_fairness_options() -> None:
    parser = build_parser()
    for given in (["compare"], ["compare", "--no-fairness"], ["compare", "--fairness-connections", "50"]):
        args = parser.parse_args(given)
        command = compare_command(args)
        again = parser.parse_args(shlex.split(command)[1:])
        assert vars(again) == vars(args), command
    assert parser.parse_args(["compare"]).fairness_connections == spread.CONNECTIONS


def test_the_service_has_one_endpoint_per_server_pod() -> None:
    class Pod:
        def __init__(self, i: int) -> None:
            self.ip4, self.node, self.name = f"198.18.66.{10 + i}", "node-2", f"pod-2-{i + 1}"

    svc, eps = spread.service_objects([Pod(i) for i in range(spread.ENDPOINTS)])
    assert svc["spec"]["clusterIP"] == spread.CLUSTER_IP
    assert [e["addresses"][0] + ":8080" for e in eps["endpoints"]] == EPS
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == svc["metadata"]["name"]


def test_each_entry_names_the_command_that_measures_it_alone() -> None:
    from kproxy.bench.compare import _fairness_argv

    parser = build_parser()
    args = parser.parse_args(["compare", "--fairness-connections", "120", "--lab-prefix", "kpz-"])
    again = parser.parse_args(_fairness_argv("userspace", args))
    assert again.modes == "userspace" and again.fairness_connections == 120 and again.lab_prefix == "kpz-"
    assert again.no_sync and again.no_datapath and not again.no_fairness
