"""Conformance scenario counters: N new connections (TCP) and N new flows (UDP) to a service show up as N in its
``--service-counters`` metrics on the node that translated them, split by endpoint exactly as the packets went.

Decisions:

- **Counters on for this scenario only.** The switch changes a mode's data path (the userspace relay counts with
  its own relays; a mode may add counting rules), so the rest of the suite keeps running the default path: this
  scenario restarts node-1's kproxy with ``--service-counters`` (the client's node, where every connection of the
  scenario is translated) and restarts it as the session runs it afterwards, also when the scenario fails.
- **What the packets showed** is each probe's answer: the lab's echo servers answer with their pod's name, so every
  connection and every flow has one endpoint, known without asking kproxy. Each UDP flow has a source port of its
  own (consecutive ports from a random base), so no two probes can share a conntrack entry or a relay session.
- **Read from ``/metrics``** with prometheus-client's parser (``kproxy.counters.parse``), what any Prometheus reads,
  in every mode alike. Counts are differences between a read before and one after the traffic.
- **A read newer than the traffic**: a mode whose read is slow (iptables) serves a scrape from its last read, taken
  in the background. A one-endpoint *marker* service created after the traffic, and reached, is counted in every
  read taken after that connection: a read that shows the marker's connection was taken after the traffic (one read
  is one dump of the family). The same marker, before the traffic, fixes the baseline after the readiness probes.
  Reads are polled (bounded by COUNTER_WAIT) until one shows the marker and the expected counts; the last read's
  mismatch is the failure.
- **What is judged**: the service port's connection counter grew by exactly N, each endpoint's by exactly the
  connections the probes saw it answer; where the mode offers bytes or packets (``kproxy_service_counters_offered``),
  the service's grew by at least the payload the probes exchanged, and by at least one packet per connection. A mode
  that offers no connection counter fails (every mode counts connections). Part UDP_PART: the UDP flows, for a mode
  that declares it cannot count them.

The spec is docs/BEHAVIOUR.md's scenario table; ``kproxy.conformance.scenarios`` fixes the order.
"""

from __future__ import annotations

import collections
import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kproxy.conformance.context import Context
from kproxy.conformance.registry import scenario
from kproxy.conformance.steps import (
    START_WAIT,
    cip,
    parsed_exposition,
    start_kproxy,
    started_and_synced,
    two_nodes,
    wait_reach,
)
from kproxy.conformance.values import METRICS_PORT, Probe, answer_pod
from kproxy.counters import Measure, Scrape, parse, service_key
from kproxy.fairness import fairness

COUNTING_FLAG = "--service-counters"
TCP_CONNECTIONS = 60
UDP_FLOWS = 30
UDP_PART = "udp-flows"
COUNTER_WAIT = 30.0  # a slow read (iptables' save, on a busy machine) plus the one in flight before it
SERVICE = "counted"
PAYLOAD = "hello"  # the lab probe's default request line


@dataclass(frozen=True)
class Sent:
    """One service port's traffic as the probes saw it: ``key`` (``kproxy.counters.service_key``), how many new
    connections or flows each endpoint (``ip:port``) answered, and the payload bytes both ways."""

    what: str  # "TCP connections", "UDP flows"
    key: str
    answered: dict[str, int]
    payload_bytes: int

    @property
    def total(self) -> int:
        return sum(self.answered.values())


def sent_from(what: str, key: str, probes: Sequence[Probe], endpoint_of: dict[str, str]) -> Sent:
    """``Sent`` from answered probes; ``endpoint_of``: pod name -> the ``ip:port`` the counters name it by. An
    answer from a pod that is no endpoint is a KeyError (``Context.reach``'s ``only`` has ruled it out)."""
    answered: collections.Counter[str] = collections.Counter()
    payload = 0
    for pr in probes:
        for r in pr.ok:
            answered[endpoint_of[answer_pod(r)]] += 1
            payload += len(PAYLOAD) + 1 + len(str(r.reply)) + 1  # the request line and the answer line
    return Sent(what, key, {ep: answered.get(ep, 0) for ep in endpoint_of.values()}, payload)


def _value(scrape: Scrape, key: str, measure: Measure, endpoint: str | None = None) -> float:
    sample = scrape.services.get(key)
    if sample is None:
        return 0.0
    if endpoint is None:
        return float(sample.total.get(measure.value) or 0.0)
    return float(sample.endpoints.get(endpoint, {}).get(measure.value) or 0.0)


def counted_problems(before: Scrape, after: Scrape, sent: Sent, offered: frozenset[Measure]) -> list[str]:
    """What the counters got wrong about ``sent`` between two reads ([] when nothing): the service's connections,
    each endpoint's, and the bytes and packets the mode offers. Pure, for the unit tests."""
    problems = []
    if sent.key not in after.services:
        return [f"{sent.key} is not in the counters at all"]
    grew = _value(after, sent.key, Measure.CONNECTIONS) - _value(before, sent.key, Measure.CONNECTIONS)
    if grew != sent.total:
        problems.append(f"{sent.key}: connections grew by {grew:g}, not {sent.total}")
    for ep, n in sent.answered.items():
        if ep not in after.services[sent.key].endpoints:
            problems.append(f"{sent.key}: endpoint {ep} has no counter")
            continue
        ep_grew = _value(after, sent.key, Measure.CONNECTIONS, ep) - _value(before, sent.key, Measure.CONNECTIONS, ep)
        if ep_grew != n:
            problems.append(f"{sent.key}: endpoint {ep} grew by {ep_grew:g}, not {n}")
    bounds = {Measure.BYTES: sent.payload_bytes, Measure.PACKETS: sent.total}
    for measure, least in bounds.items():
        if measure in offered:
            got = _value(after, sent.key, measure) - _value(before, sent.key, measure)
            if got < least:
                problems.append(f"{sent.key}: {measure.value} grew by {got:g}, less than {least}")
    return problems


def split_note(before: Scrape, after: Scrape, sent: Sent) -> str:
    """The counted split and its chi-square test against the even split (a figure for the report, not judged)."""
    split = {
        ep: _value(after, sent.key, Measure.CONNECTIONS, ep) - _value(before, sent.key, Measure.CONNECTIONS, ep)
        for ep in sent.answered
    }
    spread = fairness(split)
    test = f", p={spread.p_value:.3g} against the even split" if spread is not None else ""
    return f"{sent.total} {sent.what} counted exactly (" + " ".join(f"{k}:{v:g}" for k, v in split.items()) + test + ")"


# -- the lab side ---------------------------------------------------------------------------------------------------


def read(ctx: Context, node: Any) -> Scrape:
    """The node's counters as its ``/metrics`` serves them."""
    return parsed_exposition(ctx, node, lambda text: parse(text, ctx.now()))


@contextlib.contextmanager
def counting(ctx: Context, node: Any) -> Iterator[None]:
    """kproxy on ``node`` with ``--service-counters`` while the block runs; as the session runs it afterwards."""
    if COUNTING_FLAG in ctx.kproxy_argv:
        yield
        return
    ctx.lab.stop_kproxy(node)
    try:
        ctx.lab.start_kproxy(node, ctx.mode, [*ctx.kproxy_argv, COUNTING_FLAG])
        started_and_synced(ctx, node, None, f"restarted with {COUNTING_FLAG}")
        yield
    finally:
        ctx.lab.stop_kproxy(node)
        start_kproxy(ctx, node, ctx.mode)
        try:  # not bound by the scenario's deadline: the next scenario needs it back whatever happened here
            ctx.lab.wait_kproxy(node, timeout=START_WAIT)
        except Exception as exc:  # the runner reports a kproxy that is not running; this says why it waited
            ctx.note(f"kproxy on {node.name}, restarted without {COUNTING_FLAG}, not healthy yet: {exc}")


def marked_read(ctx: Context, node: Any, client: Any, pod: Any, name: str) -> Scrape:
    """Create the marker service ``name`` (one endpoint, ``pod``), reach it from ``client``, and poll the node's
    reads until one shows its connection: a read taken after everything sent before the marker was reached."""
    marker = ctx.service(name)
    ctx.apply(marker, ctx.slice_for(marker, [pod]))
    wait_reach(ctx, client, cip(marker), 80, only=[pod], what=f"marker service {name}")
    key = service_key(ctx.namespace, name, "tcp", "TCP", "IPv4")
    url = f"GET http://127.0.0.1:{METRICS_PORT}/metrics in {node.ns}"

    def newer() -> Scrape:
        now = read(ctx, node)
        ctx.expect(
            _value(now, key, Measure.CONNECTIONS) >= 1,
            f"no read of the counters on {node.name} newer than the traffic yet",
            sent=url,
            got=f"{key}: {now.services.get(key)}",
            expected=f"the marker {key} with its connection counted",
        )
        return now

    return ctx.eventually(newer, timeout=COUNTER_WAIT, interval=0.3, what=f"counters after marker {name}")


def _traffic(ctx: Context, client: Any, ip: str, pods: Sequence[Any], udp: bool) -> list[Sent]:
    """TCP_CONNECTIONS new connections, and with ``udp`` UDP_FLOWS flows from source ports of their own."""
    endpoint_of = {p.name: f"{p.ip4}:8080" for p in pods}
    tcp = ctx.reach(client, ip, 80, "tcp", count=TCP_CONNECTIONS, timeout=2.0, only=pods)
    out = [sent_from("TCP connections", service_key(ctx.namespace, SERVICE, "tcp", "TCP", "IPv4"), [tcp], endpoint_of)]
    if udp:
        base = 45000 + random.randrange(1000)  # apart from the other UDP scenarios' fixed ports (40000-43000)
        flows = []
        for i in range(UDP_FLOWS):
            pr = ctx.probe(client, ip, 80, "udp", count=1, timeout=2.0, src_port=base + i)
            ctx.expect(
                len(pr.ok) == 1 and pr.pods <= set(endpoint_of),
                f"UDP flow {i + 1} of {UDP_FLOWS} was not answered by an endpoint",
                sent=pr.sent + f" from source port {base + i}",
                got=pr.summary(),
                expected="one answer from " + ", ".join(sorted(endpoint_of)),
            )
            flows.append(pr)
        key = service_key(ctx.namespace, SERVICE, "udp", "UDP", "IPv4")
        out.append(sent_from("UDP flows", key, flows, endpoint_of))
    return out


@scenario(
    "counters",
    "60 TCP connections and 30 UDP flows to a service with 3 endpoints, counted with --service-counters",
    timeout_s=180,
    parts={UDP_PART},
)
def counters(ctx: Context) -> None:
    n1, n2 = two_nodes(ctx)
    client, pods = ctx.pods_on(n1)[0], ctx.pods_on(n2)[:3]
    with counting(ctx, n1):
        offered = read(ctx, n1).offered or frozenset()
        ctx.expect(
            Measure.CONNECTIONS in offered,
            f"mode {ctx.mode} does not count connections with {COUNTING_FLAG}",
            sent=f"GET http://127.0.0.1:{METRICS_PORT}/metrics in {n1.ns}",
            got="kproxy_service_counters_offered: " + (", ".join(sorted(m.value for m in offered)) or "nothing"),
            expected='kproxy_service_counters_offered{measure="connections"} 1',
        )
        udp = not ctx.skips(UDP_PART)
        ports = [ctx.port(80, 8080, name="tcp")] + ([ctx.port(80, 8080, name="udp", protocol="UDP")] if udp else [])
        svc = ctx.service(SERVICE, ports)
        ctx.apply(svc, ctx.slice_for(svc, pods))
        ip = cip(svc)
        wait_reach(ctx, client, ip, 80, only=pods)
        if udp:
            wait_reach(ctx, client, ip, 80, "udp", only=pods)
        before = marked_read(ctx, n1, client, pods[0], "marker-before")
        sent = _traffic(ctx, client, ip, pods, udp)
        marked_read(ctx, n1, client, pods[0], "marker-after")

        def judged() -> Scrape:
            after = read(ctx, n1)
            problems = [p for s in sent for p in counted_problems(before, after, s, offered)]
            ctx.expect(
                not problems,
                "; ".join(problems),
                sent=", ".join(f"{s.total} {s.what} to {s.key}" for s in sent) + f", read from {n1.name}'s /metrics",
                got="; ".join(problems),
                expected="; ".join(f"{s.key}: +{s.total}, per endpoint {s.answered}" for s in sent),
            )
            return after

        after = ctx.eventually(judged, timeout=COUNTER_WAIT, interval=0.3, what="the counters")
    ctx.note("; ".join(split_note(before, after, s) for s in sent))
