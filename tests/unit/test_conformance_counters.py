"""The conformance scenario ``counters``' judge: the counts read back from the exposition kproxy's own collector
renders (``kproxy.counters.CounterCollector``, parsed by ``kproxy.counters.parse`` as the scenario reads a node's
/metrics), against what the probes saw answer."""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kproxy.conformance import sc_counters
from kproxy.conformance.context import Context
from kproxy.conformance.sc_counters import Sent, counted_problems, sent_from, split_note
from kproxy.conformance.values import Addresses, Probe, ScenarioFailure
from kproxy.counters import CounterCollector, CounterDump, Counts, Measure, PortCounters, Scrape, parse, service_key
from kproxy.lab.probe import ProbeResult
from kproxy.model import IPFamily, Protocol, ServicePortName

from .test_conformance_judge import Api, Clock, R, ScriptedLab, ans, err

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


# -- the whole scenario on a scripted lab: a node that counts what it translates, serving a stale read ------------


class CountingLab(ScriptedLab):
    """The judge's scripted lab with a node-1 kproxy that can be restarted with ``--service-counters``: every probe
    to a ClusterIP is answered by the service's endpoints in turn and, with counting on, counted for the endpoint
    that answered (``miscount``: the n-th TCP connection counted for another endpoint, a broken mode). ``/metrics``
    is rendered by kproxy's own collector from the *previous* read, as a mode read in the background serves it."""

    def __init__(self, clock: Clock, api: Api, miscount: int = 0) -> None:
        super().__init__(clock, lambda *a: err("timeout"))
        self.api, self.miscount = api, miscount
        self.counting = False
        self.starts: list[list[str]] = []
        self.counts: dict[tuple[str, str, str], collections.Counter[str]] = {}
        self.tcp_seen = 0
        self.udp_ports: list[int] = []
        self._last = ""  # the read a scrape serves: the one before it
        self.responder = self.respond

    def stop_kproxy(self, node: Any) -> None:
        self.counting = False

    def start_kproxy(self, node: Any, mode: str, extra_args: Sequence[str] = ()) -> None:
        self.starts.append(list(extra_args))
        self.counting = "--service-counters" in extra_args
        self._last = self.exposition()

    def wait_kproxy(self, node: Any, timeout: float = 30.0) -> None:
        return None

    def respond(self, lab: ScriptedLab, ns: str, kind: str, host: str, port: int, kw: dict[str, Any]) -> R:
        svc = next(
            (o for (k, _), o in self.api.objects.items() if k == "Service" and o["spec"]["clusterIP"] == host), None
        )
        if svc is None:
            return err("timeout")
        name = svc["metadata"]["name"]
        pods = self.api.endpoints_at(name, self.clock.now, 0.0)
        if not pods:
            return err("refused")
        proto = kind.upper()
        if proto == "UDP" and name == "counted" and kw.get("src_port"):
            self.udp_ports.append(kw["src_port"])
        tally = self.counts.setdefault(
            (name, next(p["name"] for p in svc["spec"]["ports"] if p.get("protocol", "TCP") == proto), proto),
            collections.Counter(),
        )
        pod = pods[sum(tally.values()) % len(pods)]
        if self.counting:
            counted = pod
            if proto == "TCP" and name == "counted":
                self.tcp_seen += 1
                if self.tcp_seen == self.miscount:
                    counted = pods[(pods.index(pod) + 1) % len(pods)]
            tally[counted] += 1
        return ans(pod)

    def exposition(self) -> str:
        pods = {p.name: p for p in self.pods}
        source = Source(frozenset({Measure.CONNECTIONS}) if self.counting else frozenset())
        for (name, port, proto), tally in self.counts.items():
            slice_pods = self.api.endpoints_at(name, self.clock.now, 0.0)
            per_ep = {f"{pods[p].ip4}:8080": Counts(tally.get(p, 0)) for p in slice_pods}
            source.ports[ServicePortName(NS, name, port, Protocol(proto))] = PortCounters.of(per_ep)
        return CounterCollector(source, [IPFamily.V4]).exposition().decode()

    def probe_http(self, ns: str, url: str, timeout: float = 1.0) -> Any:
        if url.endswith("/metrics"):
            served, self._last = self._last, self.exposition()
            return SimpleNamespace(status=200, body=served, error="")
        if "/rules" in url:
            return SimpleNamespace(status=200, body=json.dumps({"sync": {"syncs": 1}}), error="")
        return SimpleNamespace(status=200, body="{}", error="")


def counters_ctx(miscount: int = 0) -> tuple[Context, CountingLab]:
    clock = Clock()
    api = Api(clock)
    lab = CountingLab(clock, api, miscount)
    return Context(lab, "fake", "counters", Addresses(), 180, clock=clock, sleep=clock.sleep, api=(api, api)), lab


def test_the_scenario_passes_a_node_that_counts_what_it_translated() -> None:
    ctx, lab = counters_ctx()
    sc_counters.counters(ctx)
    # restarted with the counters, then as the session runs it
    assert lab.starts == [["--service-counters"], []] and not lab.counting
    assert ctx.notes and ctx.notes[0].startswith("60 TCP connections counted exactly (198.18.66.10:8080:20 ")
    assert "30 UDP flows counted exactly" in ctx.notes[0]
    # each UDP flow from a source port of its own
    assert len(lab.udp_ports) == sc_counters.UDP_FLOWS == len(set(lab.udp_ports))


def test_the_scenario_fails_one_connection_counted_for_another_endpoint_and_restores_kproxy() -> None:
    ctx, lab = counters_ctx(miscount=7)
    with pytest.raises(ScenarioFailure) as failed:
        sc_counters.counters(ctx)
    text = str(failed.value)
    assert "grew by 21, not 20" in text and "grew by 19, not 20" in text and "still so after 30.0 s" in text
    assert lab.starts == [["--service-counters"], []] and not lab.counting  # restored on the way out


def test_the_scenario_fails_a_mode_that_offers_no_counters() -> None:
    ctx, lab = counters_ctx()
    lab.start_kproxy = lambda node, mode, extra_args=(): lab.starts.append(list(extra_args))  # type: ignore[method-assign]
    with pytest.raises(ScenarioFailure, match="does not count connections with --service-counters"):
        sc_counters.counters(ctx)
    assert lab.starts == [["--service-counters"], []]
