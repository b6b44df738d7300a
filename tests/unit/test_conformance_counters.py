"""The conformance scenario ``counters``' judge: the counts read back from the exposition kproxy's own collector
renders (``kproxy.counters.CounterCollector``, parsed by ``kproxy.counters.parse`` as the scenario reads a node's
/metrics), against what the probes saw answer."""

from __future__ import annotations

from collections.abc import Mapping

from kproxy.conformance import sc_counters
from kproxy.conformance.sc_counters import Sent, counted_problems, sent_from, split_note
from kproxy.conformance.values import Probe
from kproxy.counters import CounterCollector, CounterDump, Counts, Measure, PortCounters, Scrape, parse, service_key
from kproxy.lab.probe import ProbeResult
from kproxy.model import IPFamily, Protocol, ServicePortName

NS = "conf-counters"
TCP = ServicePortName(NS, "counted", "tcp", Protocol.TCP)
KEY = service_key(NS, "counted", "tcp", "TCP", "IPv4")
EPS = {"pod-2-1": "198.18.66.10:8080", "pod-2-2": "198.18.66.11:8080", "pod-2-3": "198.18.66.12:8080"}


class Source:
    """A backend's counters as its dump hands them over (what ``Proxier.counters`` returns)."""

    def __init__(self, offered: frozenset[Measure]) -> None:
        self.counters_offered = offered
        self.ports: dict[ServicePortName, PortCounters] = {}

    def counters(self, family: IPFamily) -> CounterDump:
        return CounterDump(family, dict(self.ports))


def scrape(source: Source, per_endpoint: Mapping[str, Counts], at: float) -> Scrape:
    """Set the service's counters, render /metrics' text with the real collector, read it back."""
    source.ports[TCP] = PortCounters.of(dict(per_endpoint))
    return parse(CounterCollector(source, [IPFamily.V4]).exposition().decode(), at)


def probes(pods: list[str]) -> Probe:
    results = [ProbeResult(True, f"{p} 198.18.65.10 {40000 + i}") for i, p in enumerate(pods)]
    return Probe("pod-1-1", "tcp", "198.19.0.5", 80, results)


def test_sent_from_counts_each_answer_for_its_endpoint_and_the_payload() -> None:
    pr = probes(["pod-2-1", "pod-2-2", "pod-2-1"])
    sent = sent_from("TCP connections", KEY, [pr], EPS)
    assert sent.answered == {"198.18.66.10:8080": 2, "198.18.66.11:8080": 1, "198.18.66.12:8080": 0}
    assert sent.total == 3
    # each connection: "hello\n" sent, the answer line and its newline back
    assert sent.payload_bytes == sum(6 + len(r.reply) + 1 for r in pr.results)


def test_exact_counts_pass_and_any_difference_is_named() -> None:
    source = Source(frozenset({Measure.CONNECTIONS, Measure.BYTES}))
    start = {ep: Counts(5, None, 100) for ep in EPS.values()}
    before = scrape(source, start, 1.0)
    answered = {"198.18.66.10:8080": 25, "198.18.66.11:8080": 20, "198.18.66.12:8080": 15}
    sent = Sent("TCP connections", KEY, answered, payload_bytes=60 * 30)
    after = {ep: Counts(5 + n, None, 100 + 31 * n) for ep, n in answered.items()}
    assert counted_problems(before, scrape(source, after, 2.0), sent, source.counters_offered) == []

    # one connection counted for the wrong endpoint: the service's total is right, two endpoints are not
    wrong = dict(after)
    wrong["198.18.66.10:8080"] = Counts(5 + 24, None, 100 + 31 * 25)
    wrong["198.18.66.11:8080"] = Counts(5 + 21, None, 100 + 31 * 20)
    problems = counted_problems(before, scrape(source, wrong, 3.0), sent, source.counters_offered)
    assert problems == [
        f"{KEY}: endpoint 198.18.66.10:8080 grew by 24, not 25",
        f"{KEY}: endpoint 198.18.66.11:8080 grew by 21, not 20",
    ]

    # a stale read (the traffic not in it yet): every count short, and the bytes under the payload
    problems = counted_problems(before, before, sent, source.counters_offered)
    assert problems[0] == f"{KEY}: connections grew by 0, not 60"
    assert problems[-1] == f"{KEY}: bytes grew by 0, less than 1800"


def test_a_measure_the_mode_does_not_offer_is_not_judged() -> None:
    source = Source(frozenset({Measure.CONNECTIONS}))
    before = scrape(source, {ep: Counts(0) for ep in EPS.values()}, 1.0)
    answered = {"198.18.66.10:8080": 1, "198.18.66.11:8080": 1, "198.18.66.12:8080": 1}
    after = scrape(source, {ep: Counts(1) for ep in EPS.values()}, 2.0)
    assert "bytes" not in after.services[KEY].total
    assert counted_problems(before, after, Sent("TCP connections", KEY, answered, 999), source.counters_offered) == []


def test_a_service_missing_from_the_counters_or_an_endpoint_without_a_counter() -> None:
    source = Source(frozenset({Measure.CONNECTIONS}))
    empty = parse(CounterCollector(source, [IPFamily.V4]).exposition().decode(), 0.0)
    sent = Sent("TCP connections", KEY, {"198.18.66.10:8080": 2}, 0)
    assert counted_problems(empty, empty, sent, source.counters_offered) == [f"{KEY} is not in the counters at all"]
    after = scrape(source, {"198.18.66.11:8080": Counts(2)}, 1.0)
    # the service's total is right (2), but the endpoint that answered has no counter of its own
    assert counted_problems(empty, after, sent, source.counters_offered) == [
        f"{KEY}: endpoint 198.18.66.10:8080 has no counter"
    ]


def test_the_note_gives_the_counted_split_and_its_test() -> None:
    source = Source(frozenset({Measure.CONNECTIONS}))
    before = scrape(source, {ep: Counts(0) for ep in EPS.values()}, 1.0)
    answered = {"198.18.66.10:8080": 20, "198.18.66.11:8080": 20, "198.18.66.12:8080": 20}
    after = scrape(source, {ep: Counts(20) for ep in EPS.values()}, 2.0)
    note = split_note(before, after, Sent("TCP connections", KEY, answered, 0))
    # an exactly even split: chi-square 0, p-value 1
    assert note.startswith("60 TCP connections counted exactly (198.18.66.10:8080:20 ")
    assert note.endswith("p=1 against the even split)")


def test_the_scenario_declares_its_udp_part() -> None:
    from kproxy.conformance.scenarios import BY_ID

    assert BY_ID["counters"].parts == frozenset({sc_counters.UDP_PART})
    assert BY_ID["counters"].run is sc_counters.counters
