"""The conformance judge under test: every check that declares a backend conformant must be able to fail.

No root, no lab: a scripted lab (``ScriptedLab``) answers probes from a responder the test writes, a fake clock
moves by each probe's own duration (so "late" and "slow" are exact, and nothing sleeps), and the API is an
in-memory stand-in that records when each object was written. Each failure mode the conformance suite exists to
catch is fed in and must raise ``ScenarioFailure``; each honest case must pass, so a check cannot pass these tests
by failing everything.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kproxy.conformance import checks, sc_changes, sc_udp
from kproxy.conformance.context import Context
from kproxy.conformance.registry import Scenario
from kproxy.conformance.report import NOT_APPLICABLE, PASS
from kproxy.conformance.runner import ConformanceError, Session, declared_not_applicable, requested_modes
from kproxy.conformance.values import SERVICE_NAME_LABEL, Addresses, Probe, ScenarioFailure

# ---------------------------------------------------------------------------------------------------- the fake lab


@dataclass
class R:
    """A probe result as the lab's probe returns it."""

    ok: bool
    reply: str = ""
    error: str = ""
    seconds: float = 0.01


def ans(pod: str, seconds: float = 0.01, seen: str = "198.18.65.10") -> R:
    return R(True, f"{pod} {seen} 40000", seconds=seconds)


def err(word: str, seconds: float = 0.01) -> R:
    return R(False, error=word, seconds=seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@dataclass
class Written:
    at: float
    obj: dict[str, Any]


class Api:
    """CoreV1Api and DiscoveryV1Api in one, in memory: what the scenarios call, recording each write's time."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[Written] = []

    def _put(self, kind: str, body: dict[str, Any]) -> None:
        self.objects[(kind, body["metadata"]["name"])] = body
        self.log.append(Written(self.clock.now, json.loads(json.dumps(body))))

    def create_namespaced_service(self, ns: str, body: dict[str, Any], **_: Any) -> None:
        self._put("Service", body)

    def create_namespaced_endpoint_slice(self, ns: str, body: dict[str, Any], **_: Any) -> None:
        self._put("EndpointSlice", body)

    def _unused(self, *a: Any, **kw: Any) -> None:
        raise AssertionError("create never conflicts here, so read/replace are never called")

    read_namespaced_service = replace_namespaced_service = _unused
    read_namespaced_endpoint_slice = replace_namespaced_endpoint_slice = _unused

    def _list(self, kind: str) -> Any:
        items = [SimpleNamespace(metadata=SimpleNamespace(name=n)) for k, n in self.objects if k == kind]
        return SimpleNamespace(items=items)

    def list_namespaced_service(self, ns: str, **_: Any) -> Any:
        return self._list("Service")

    def list_namespaced_endpoint_slice(self, ns: str, **_: Any) -> Any:
        return self._list("EndpointSlice")

    def delete_namespaced_service(self, name: str, ns: str, **_: Any) -> None:
        self.objects.pop(("Service", name), None)

    def delete_namespaced_endpoint_slice(self, name: str, ns: str, **_: Any) -> None:
        self.objects.pop(("EndpointSlice", name), None)

    def endpoints_at(self, service: str, t: float, delay: float) -> list[str]:
        """The pods of the last slice of ``service`` written at least ``delay`` seconds before ``t``."""
        pods: list[str] = []
        for w in self.log:
            labels = w.obj["metadata"].get("labels", {})
            if w.obj["kind"] == "EndpointSlice" and labels.get(SERVICE_NAME_LABEL) == service and w.at + delay <= t:
                pods = [e["targetRef"]["name"] for e in w.obj["endpoints"]]
        return pods


Responder = Callable[["ScriptedLab", str, str, str, int, dict[str, Any]], R]


@dataclass
class ScriptedLab:
    """Two nodes x 3 pods, an external namespace; ``responder`` answers each probe (one call per probe)."""

    clock: Clock
    responder: Responder
    probes: list[tuple[float, str, str, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = [
            SimpleNamespace(
                name=f"node-{i}", ns=f"kpj-node-{i}", ip4=f"198.18.0.{10 + i}", ip6=f"fd00:198:18::{10 + i}"
            )
            for i in (1, 2)
        ]
        self.pods = [
            SimpleNamespace(
                name=f"pod-{i}-{j}",
                node=f"node-{i}",
                ns=f"kpj-pod-{i}-{j}",
                ip4=f"198.18.{64 + i}.{10 + j}",
                ip6=f"fd00:198:18:{64 + i}::{10 + j}",
            )
            for i in (1, 2)
            for j in range(3)
        ]
        self.external_ns = "kpj-ext"
        self.ipv6 = True

    def probe(self, ns: str, kind: str, host: str, port: int, **kw: Any) -> list[R]:
        out = []
        for _ in range(int(kw.get("count", 1))):
            self.probes.append((self.clock.now, ns, kind, host, port))
            r = self.responder(self, ns, kind, host, port, kw)
            self.clock.now += r.seconds
            out.append(r)
        return out


def make_ctx(responder: Responder, timeout_s: float = 60.0) -> tuple[Context, ScriptedLab, Api]:
    clock = Clock()
    lab = ScriptedLab(clock, responder)
    api = Api(clock)
    ctx = Context(lab, "fake", "judge", Addresses(), timeout_s, clock=clock, sleep=clock.sleep, api=(api, api))
    return ctx, lab, api


def answering(*pods: str, seconds: float = 0.01) -> Responder:
    cycle = iter(range(1 << 30))

    def respond(lab: ScriptedLab, ns: str, kind: str, host: str, port: int, kw: dict[str, Any]) -> R:
        return ans(pods[next(cycle) % len(pods)], seconds) if pods else err("timeout", 1.0)

    return respond


def failing(word: str, seconds: float) -> Responder:
    return lambda *a: err(word, seconds)


# ---------------------------------------------------------------------------------------------------- reach


def test_reach_passes_when_only_the_endpoints_answer_each_at_least_once() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1", "pod-2-0"))
    pr = ctx.reach("kpj-pod-1-0", "198.19.1.2", 80, count=4, only=["pod-1-1", "pod-2-0"], all_of=["pod-1-1", "pod-2-0"])
    assert pr.pods == {"pod-1-1", "pod-2-0"}


def test_reach_fails_on_an_answer_from_a_pod_that_is_not_an_endpoint() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1", "pod-2-2"))
    with pytest.raises(ScenarioFailure, match="not an endpoint it should reach: pod-2-2"):
        ctx.reach("kpj-pod-1-0", "198.19.1.2", 80, count=4, only=["pod-1-1", "pod-2-0"])


def test_reach_fails_when_an_endpoint_never_answers() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"))
    with pytest.raises(ScenarioFailure, match="never answered: pod-2-0"):
        ctx.reach("kpj-pod-1-0", "198.19.1.2", 80, count=10, all_of=["pod-1-1", "pod-2-0"])


def test_reach_fails_on_one_unanswered_probe_among_many() -> None:
    replies = iter([ans("pod-1-1")] * 5 + [err("timeout", 1.0)] + [ans("pod-1-1")] * 4)
    ctx, _, _ = make_ctx(lambda *a: next(replies))
    with pytest.raises(ScenarioFailure, match="1 of 10 probes were not answered") as exc:
        ctx.reach("kpj-pod-1-0", "198.19.1.2", 80, count=10)
    assert "sent: 10 TCP probe(s)" in str(exc.value) and "timeout x1" in str(exc.value)


# ---------------------------------------------------------------------------------------------------- blocked


def test_blocked_refused_rejects_a_timeout() -> None:
    ctx, _, _ = make_ctx(failing("timeout", 1.0))
    with pytest.raises(ScenarioFailure, match="'timeout', not a refusal"):
        ctx.blocked("kpj-pod-1-0", "198.19.1.2", 80, how="refused")


def test_blocked_timeout_rejects_a_refusal() -> None:
    ctx, _, _ = make_ctx(failing("refused", 0.002))
    with pytest.raises(ScenarioFailure, match="'refused', not a timeout"):
        ctx.blocked("kpj-pod-1-0", "198.19.1.2", 80, how="timeout")


def test_blocked_refused_within_rejects_a_slow_refusal() -> None:
    ctx, _, _ = make_ctx(failing("refused", 1.4))
    with pytest.raises(ScenarioFailure, match="the refusal took 1.40 s"):
        ctx.blocked("kpj-pod-1-0", "198.19.1.2", 80, how="refused", within=1.0, timeout=2.0)


def test_blocked_refused_passes_fast_refusals() -> None:
    ctx, _, _ = make_ctx(failing("refused", 0.003))
    ctx.blocked("kpj-pod-1-0", "198.19.1.2", 80, how="refused", within=1.0, count=3)


def test_blocked_fails_when_a_probe_is_answered() -> None:
    replies = iter([err("refused"), ans("pod-1-1")])
    ctx, _, _ = make_ctx(lambda *a: next(replies))
    with pytest.raises(ScenarioFailure, match="must fail was answered"):
        ctx.blocked("kpj-pod-1-0", "198.19.1.2", 80, count=2)


@pytest.mark.parametrize("word", ["unreachable", "timeout", "closed"])
def test_udp_port_unreachable_accepts_only_econnrefused(word: str) -> None:
    """Item 6: "unreachable" of any kind used to pass for UDP; only ICMP port unreachable (ECONNREFUSED) does."""
    ctx, _, _ = make_ctx(failing(word, 0.01))
    with pytest.raises(ScenarioFailure, match="not ICMP port unreachable"):
        ctx.blocked("kpj-pod-1-1", "198.19.1.2", 80, "udp", how="port-unreachable", count=3)
    ctx2, _, _ = make_ctx(failing("refused", 0.01))
    ctx2.blocked("kpj-pod-1-1", "198.19.1.2", 80, "udp", how="port-unreachable", count=3)


# ---------------------------------------------------------------------------------------------------- eventually


def test_eventually_returns_the_first_success() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"))
    tries = iter([False, False, True])

    def check() -> str:
        ctx.expect(next(tries), "not yet")
        return "done"

    assert ctx.eventually(check, timeout=5, interval=0.2) == "done"


def test_eventually_raises_the_last_failure_after_the_timeout_saying_how_long() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"))
    start = ctx.now()
    with pytest.raises(ScenarioFailure, match=r"waiting: never \(still so after 3\.0 s, 16 tries\)"):
        ctx.eventually(lambda: ctx.fail("never"), timeout=3.0, interval=0.2, what="waiting")
    assert ctx.now() - start == pytest.approx(3.0)


def test_eventually_is_capped_by_the_scenario_budget() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"), timeout_s=2.0)
    with pytest.raises(ScenarioFailure, match="still so after 2.0 s"):
        ctx.eventually(lambda: ctx.fail("never"), timeout=30.0)


def test_eventually_lets_a_bug_through_at_once() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"))
    calls = []

    def check() -> None:
        calls.append(1)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        ctx.eventually(check, timeout=10)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------------- _converge


def endpoint_model(delay: float, quirk: Callable[[float, str, list[str]], R | None] | None = None) -> Responder:
    """A ClusterIP whose endpoints follow the API's slices ``delay`` seconds after each write; ``quirk(since the
    last write, client ns, endpoints)`` may answer instead (a stale or partial datapath)."""
    rnd = random.Random(7)

    def respond(lab: ScriptedLab, ns: str, kind: str, host: str, port: int, kw: dict[str, Any]) -> R:
        api = lab.api  # type: ignore[attr-defined]
        svc = next(w.obj for w in api.log if w.obj["kind"] == "Service")["metadata"]["name"]
        last = max(w.at for w in api.log)
        pods = api.endpoints_at(svc, lab.clock.now, delay)
        if quirk is not None:
            r = quirk(lab.clock.now - last, ns, pods)
            if r is not None:
                return r
        return ans(rnd.choice(pods), 0.004) if pods else err("refused", 0.002)

    return respond


def run_churn(responder: Responder) -> Context:
    ctx, lab, api = make_ctx(responder, timeout_s=60.0)
    lab.api = api  # type: ignore[attr-defined]
    sc_changes.endpoint_churn(ctx)
    return ctx


def test_endpoint_churn_passes_an_honest_datapath() -> None:
    ctx = run_churn(endpoint_model(delay=0.6))
    assert "3->1 converged" in ctx.notes[0]


def test_endpoint_churn_fails_a_late_stale_answer() -> None:
    """3 -> 1: converged at 0.6 s, but one removed endpoint answers again 2.2 s after the write (a flapping rule);
    the old judge stopped probing at the first good batch and never saw it."""
    fired = []

    def stale(since: float, ns: str, pods: list[str]) -> R | None:
        if len(pods) == 1 and 2.2 <= since and not fired:
            fired.append(since)
            return ans("pod-1-1")  # one of the three, no longer an endpoint
        return None

    with pytest.raises(ScenarioFailure, match=r"3 -> 1 endpoints: the old state was still seen 2\.\d+ s after"):
        run_churn(endpoint_model(delay=0.6, quirk=stale))


def test_endpoint_churn_fails_when_only_some_of_the_five_answer_in_time() -> None:
    """Item 5: 1 -> 5 where one new endpoint answers at once but the full set only after 3 s; the old judge
    counted the first new answer as converged."""

    def partial(since: float, ns: str, pods: list[str]) -> R | None:
        if len(pods) == 5 and since < 3.0:
            return ans(random.choice(pods[:2]), 0.004)  # one old, one new endpoint only
        return None

    with pytest.raises(ScenarioFailure, match=r"1 -> 5 endpoints: the old state was still seen [23]\.\d+ s after"):
        run_churn(endpoint_model(delay=0.3, quirk=partial))


def test_converge_fails_when_never_converged_within_the_wait() -> None:
    ctx, _, _ = make_ctx(answering("pod-1-1"))
    with pytest.raises(ScenarioFailure, match="never converged within 15 s"):
        sc_changes._converge(ctx, "kpj-pod-1-0", "198.19.1.2", lambda pr: pr.pods == {"pod-2-0"}, "x -> y")


# ---------------------------------------------------------------------------------------------------- _udp_follow


def udp_switch(at: float, old: str = "pod-2-0", new: str = "pod-2-1") -> Responder:
    def respond(lab: ScriptedLab, ns: str, kind: str, host: str, port: int, kw: dict[str, Any]) -> R:
        since = lab.clock.now - lab.t0  # type: ignore[attr-defined]
        return ans(new) if since >= at else err("timeout", float(kw.get("timeout", 0.3)))

    return respond


def follow(at: float) -> str:
    ctx, lab, _ = make_ctx(udp_switch(at))
    lab.t0 = lab.clock.now  # type: ignore[attr-defined]
    client, target = lab.pods[0], lab.pods[4]
    return sc_udp._udp_follow(ctx, client, "198.19.1.2", 40123, target, "backend replaced")


def test_udp_follow_passes_a_switch_within_two_seconds() -> None:
    assert follow(1.2).startswith("backend replaced: between")


def test_udp_follow_fails_a_datagram_sent_after_two_seconds_that_missed() -> None:
    with pytest.raises(ScenarioFailure, match=r"still missed pod-2-1 2\.\d+ s after the change"):
        follow(2.6)


# ---------------------------------------------------------------------------------------------------- restart


def restart_verdict(
    hold: list[R], probes: dict[str, list[R]], t_synced: float = 4.0, t_after_end: float = 6.0
) -> dict[str, list[Any]]:
    ctx, _, _ = make_ctx(answering("pod-2-0"))
    recorded = [(ph, Probe("pod-1-0", "tcp", "198.19.1.2", 80, [r])) for ph, rs in probes.items() for r in rs]
    return checks.judge_restart(ctx, "pod-1-0", "198.19.1.2", "node-1", hold, recorded, 0.0, t_synced, t_after_end)


GOOD_PROBES = {ph: [ans("pod-2-0")] * 3 for ph in ("before", "killed", "restarting", "after")}


def test_restart_passes_an_unbroken_hold_past_the_first_sync() -> None:
    by_phase = restart_verdict([ans("pod-2-0", 0.01)] * 14, GOOD_PROBES)
    assert set(by_phase) == {"before", "killed", "restarting", "after"}


def test_restart_fails_a_held_connection_that_broke_once() -> None:
    hold = [ans("pod-2-0")] * 6 + [err("closed")] + [ans("pod-2-0")] * 7
    with pytest.raises(ScenarioFailure, match="established TCP connection broke"):
        restart_verdict(hold, GOOD_PROBES)


def test_restart_fails_a_hold_whose_last_exchange_came_before_the_first_sync() -> None:
    # 6 exchanges, 0.5 s apart: the last one started ~2.5 s in; the first sync was seen at 4 s
    with pytest.raises(ScenarioFailure, match="no exchange after the restarted kproxy's first sync"):
        restart_verdict([ans("pod-2-0")] * 6, GOOD_PROBES, t_synced=4.0)


def test_restart_judges_a_stamped_hold_by_its_stamps_not_by_summed_intervals() -> None:
    """Seen on the lab under load (bpf, fe13c8d): 41 exchanges whose sleeps each overshot 0.5 s by ~10 %; summing the
    intervals put the last start at 20.5 s, before the first sync at 20.7 s, though it came ~2 s after it. The probe
    now stamps each exchange with its start (``at``, seconds from the hold's start), and the judge reads that."""
    from kproxy.lab.probe import ProbeResult

    stamped = [ProbeResult(True, "pod-2-0 198.18.65.10 40000", seconds=0.001, at=i * 0.555) for i in range(41)]
    assert [ProbeResult.from_json(r.to_json()) for r in stamped] == stamped  # the stamp crosses the probe's JSON
    restart_verdict(stamped, GOOD_PROBES, t_synced=20.7, t_after_end=22.7)
    unstamped = [ProbeResult(True, "pod-2-0 198.18.65.10 40000", seconds=0.001) for _ in range(41)]
    with pytest.raises(ScenarioFailure, match="no exchange after the restarted kproxy's first sync"):
        restart_verdict(unstamped, GOOD_PROBES, t_synced=20.7, t_after_end=22.7)


def test_restart_fails_a_new_connection_refused_while_kproxy_was_dead() -> None:
    probes = dict(GOOD_PROBES, killed=[ans("pod-2-0"), err("refused")])
    with pytest.raises(ScenarioFailure, match="new connections failed around the restart: killed"):
        restart_verdict([ans("pod-2-0")] * 14, probes)


def test_restart_fails_when_no_connection_was_tried_after_the_sync() -> None:
    probes = {k: v for k, v in GOOD_PROBES.items() if k != "after"}
    with pytest.raises(ScenarioFailure, match="no new connection was made in the 2.0 s after"):
        restart_verdict([ans("pod-2-0")] * 14, probes)


# ---------------------------------------------------------------------------------------------------- scale-smoke


def exposition(durations: list[float], written: int = 0, fulls: int = 0) -> str:
    """/metrics text as kproxy exposes it for these syncs: the sync histogram (1 ms x 2^n buckets), the services
    they wrote, and the full syncs among them."""
    reg = CollectorRegistry()
    edges = [0.001 * 2**i for i in range(15)]
    h = Histogram(checks.SYNC_METRIC, "sync", ["ip_family"], registry=reg, buckets=edges)
    h.labels(ip_family="IPv6").observe(9.0)  # another family's series must not count
    for d in durations:
        h.labels(ip_family="IPv4").observe(d)
    w = Counter(checks.WRITTEN_METRIC.removesuffix("_total"), "written", ["ip_family"], registry=reg)
    w.labels(ip_family="IPv4").inc(written)
    w.labels(ip_family="IPv6").inc(10**6)
    f = Histogram(checks.FULL_SYNC_METRIC, "full", ["ip_family"], registry=reg, buckets=edges)
    for _ in range(fulls):
        f.labels(ip_family="IPv4").observe(0.5)
    f.labels(ip_family="IPv6").observe(0.5)
    return generate_latest(reg).decode()


def judge(
    before: list[float], after: list[float], floor: float | None, *, written: int = 0, fulls: int = 0, **kw: Any
) -> str:
    """``written`` services and ``fulls`` full syncs between the two reads."""
    ctx, _, _ = make_ctx(answering())
    b, a = checks.samples(exposition(before)), checks.samples(exposition(after, written, fulls))
    return checks.judge_syncs(ctx, b, a, floor, **kw)


def test_sync_judge_passes_syncs_within_the_floor_bounds() -> None:
    figures = judge([0.05], [0.05, 0.1, 0.2, 0.15, 0.9], floor=0.5, written=2000, full_s=0.6)
    assert "4 IPv4 syncs" in figures and "longest in (0.512, 1.024]" in figures
    assert "2000 services written (2.00 per service), 0 full, 1.35 s in all (2.2 x the bench's full sync" in figures


def test_sync_judge_fails_a_backend_that_rewrites_its_table_on_every_sync() -> None:
    """The lab's nftables run with the table rewritten at every sync (see SCALE_WRITES_PER_SERVICE): every sync
    within the time bounds, but the syncs wrote the growing table again and again."""
    syncs = [0.03] * 100  # mean 0.03 s against a floor of 0.16 s: the time bounds alone pass it
    assert "3000 services written" in judge([], syncs, floor=0.16, written=3000)
    with pytest.raises(ScenarioFailure, match="the syncs wrote 50000 services for 1000 written to the API"):
        judge([], syncs, floor=0.16, written=50_000)
    with pytest.raises(ScenarioFailure, match="wrote 301 services for 100"):
        judge([], syncs, floor=0.16, written=301, services=100)


def test_sync_judge_fails_full_syncs_while_services_arrive() -> None:
    """A backend asking for a full sync after every sync writes little through the ledger but renders the whole
    state each time; one full sync (a failed sync's recovery) is allowed."""
    assert "1 full" in judge([], [0.1] * 20, floor=0.5, written=2000, fulls=1)
    with pytest.raises(ScenarioFailure, match="20 full syncs while services were written"):
        judge([], [0.1] * 20, floor=0.5, written=2000, fulls=20)


def test_sync_judge_needs_the_written_counter() -> None:
    ctx, _, _ = make_ctx(answering())
    text = exposition([0.1]).replace(checks.WRITTEN_METRIC, "kproxy_something_else_total")
    with pytest.raises(ScenarioFailure, match="kproxy_sync_services_written_total is missing"):
        checks.judge_syncs(ctx, checks.samples(exposition([])), checks.samples(text), 0.5)


def test_sync_judge_fails_a_sync_that_ran_past_the_bound() -> None:
    with pytest.raises(ScenarioFailure, match="a sync took longer than 4.096 s"):
        judge([0.05], [0.05] + [0.1] * 30 + [5.0], floor=0.5)  # mean 0.26 s: only the longest is out


def test_sync_judge_max_bound_has_a_minimum_for_modes_with_a_tiny_floor() -> None:
    """A floor of 7 ms (bpf's map writes) would put the max edge at 0.064 s; one 0.1 s sync among 300 fast ones is
    a pause of the shared machine, not the backend: the bound is at least SCALE_MAX_MIN_S (edge 0.256 s)."""
    figures = judge([], [0.001] * 300 + [0.1], floor=0.007)
    assert "longest in (0.064, 0.128]" in figures
    with pytest.raises(ScenarioFailure, match="a sync took longer than 0.256 s"):
        judge([], [0.001] * 300 + [0.3], floor=0.007)


def test_sync_judge_mean_bound_has_a_minimum_for_modes_with_a_tiny_floor() -> None:
    """CI's failing bpf run: 252 syncs with a mean of 5 ms against a floor of 4 ms (the whole state's map writes),
    which is lab scheduling, not the backend. The minimum is per service written: 8 ms for each service a sync
    wrote on average, so syncs costing 19 ms for one service each still fail."""
    figures = judge([], [0.005] * 252, floor=0.004, written=1300)
    assert "mean 0.005 s" in figures
    with pytest.raises(ScenarioFailure, match="the mean sync took 0.019 s, over 0.008 s"):
        judge([], [0.019] * 140, floor=0.004, written=140)


def test_sync_judge_mean_minimum_grows_with_what_each_sync_wrote() -> None:
    """CI's bpf run at e8e9930: 166 syncs wrote 1,224 services (7.4 each) with a mean of 18 ms and 2.97 s in all,
    where runs here wrote 1.4-1.5 per sync with means of 5-7 ms and 4.1-4.6 s in all: the same work, batched
    differently, passes; the same syncs writing one service each (18 ms for one service) fail."""
    figures = judge([], [0.018] * 166, floor=0.008, written=1224)
    assert (
        "the lab's minimum for the mean 0.059 s (0.008 s x 7.4 services written per sync, at most 0.064 s)" in figures
    )
    with pytest.raises(ScenarioFailure, match="the mean sync took 0.018 s, over 0.008 s"):
        judge([], [0.018] * 166, floor=0.008, written=166)


def test_sync_judge_mean_minimum_is_capped() -> None:
    """A bpf sync costing what the whole state costs in the bench (0.1 s at 1,000 x 3) fails however much each sync
    carried: 40 syncs writing 25 services each would allow 0.2 s uncapped."""
    with pytest.raises(ScenarioFailure, match="the mean sync took 0.100 s, over 0.064 s"):
        judge([], [0.1] * 40, floor=0.008, written=1000)


def test_sync_judge_fails_a_mean_over_the_floor() -> None:
    """Item 4: every sync under the old 4.096 s bound, yet 20x slower on average than the honest ones."""
    with pytest.raises(ScenarioFailure, match="the mean sync took 2.000 s, over 0.500 s"):
        judge([], [2.0] * 10, floor=0.5)


def test_sync_judge_fails_when_nothing_synced() -> None:
    with pytest.raises(ScenarioFailure, match="no sync was observed"):
        judge([0.1], [0.1], floor=0.5)


def test_sync_judge_without_a_floor_uses_the_stated_defaults() -> None:
    assert "default bounds" in judge([], [0.1, 0.2], floor=None)
    with pytest.raises(ScenarioFailure, match="mean sync"):
        judge([], [0.9, 0.9], floor=None)


def test_metrics_are_read_with_prometheus_clients_parser() -> None:
    text = exposition([0.003]) + 'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7e9\n'
    parsed = checks.samples(text)
    assert checks.sample_value(parsed, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", ip_family="IPv4") == 1.7e9
    total, count, buckets = checks.histogram(parsed, checks.SYNC_METRIC, ip_family="IPv4")
    assert (total, count, buckets[0.004], buckets[0.002]) == (pytest.approx(0.003), 1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        checks.samples("kubeproxy_x{ip_family=IPv4} 1\n")  # malformed: the parser says so


# ---------------------------------------------------------------------------------------------------- no endpoints


def outside(results: list[R], sent_icmp: int, limited: int) -> None:
    ctx, _, _ = make_ctx(answering())
    checks.judge_outside_reject(ctx, Probe("kpj-ext", "tcp", "198.19.1.2", 80, list(results)), sent_icmp, limited, "n1")


def test_outside_reject_passes_when_the_node_sent_an_icmp_error_for_each_syn() -> None:
    outside([err("refused"), err("refused")], sent_icmp=2, limited=0)
    outside([err("refused"), err("timeout", 2.0)], sent_icmp=1, limited=1)  # the second rate-limited, and counted


def test_outside_reject_fails_one_refusal_out_of_two() -> None:
    """Item 6: one refusal and one silent timeout the node did not account for (a DROP) used to pass."""
    with pytest.raises(ScenarioFailure, match="not rejected by the node"):
        outside([err("refused"), err("timeout", 2.0)], sent_icmp=1, limited=0)


def test_outside_reject_fails_when_no_icmp_error_was_sent_at_all() -> None:
    with pytest.raises(ScenarioFailure, match="not rejected by the node"):
        outside([err("timeout", 2.0), err("timeout", 2.0)], sent_icmp=0, limited=2)


def test_outside_reject_fails_an_answer() -> None:
    with pytest.raises(ScenarioFailure):
        outside([ans("pod-1-1"), err("refused")], sent_icmp=3, limited=0)


# ---------------------------------------------------------------------------------------------------- servers


def test_configz_must_be_upstreams_wrapper_with_the_mode() -> None:
    good = {"kubeproxy.config.k8s.io": {"mode": "iptables", "hostnameOverride": "node-1", "clusterCIDR": "x"}}
    assert checks.configz_problems(json.dumps(good), "iptables", "node-1") == []
    assert checks.configz_problems(json.dumps({"mode": "iptables"}), "iptables", "node-1")  # any object passed before
    assert checks.configz_problems(json.dumps(good), "nftables", "node-1") == ["mode 'iptables', not 'nftables'"]
    assert checks.configz_problems(json.dumps(good), "iptables", "node-2")
    assert checks.configz_problems("[]", "iptables", "node-1")
    assert checks.configz_problems("<html>", "iptables", "node-1")


# ---------------------------------------------------------------------------------------------------- kernel views


def test_view_changes_sees_a_rewrite_through_its_reset_counters() -> None:
    before = [
        "nft nat: [7:420] -A KUBE-SVC-X -j KUBE-SEP-Y",
        "nft nat: -A KUBE-SERVICES -d 198.19.1.2/32 -j KUBE-SVC-X",
    ]
    rising = ["nft nat: [9:540] -A KUBE-SVC-X -j KUBE-SEP-Y", before[1]]
    assert checks.view_changes(before, rising) == []
    reset = ["nft nat: [1:60] -A KUBE-SVC-X -j KUBE-SEP-Y", before[1]]
    assert checks.view_changes(before, reset) == [
        "counters fell [7] -> [1] (rewritten): nft nat: [counters] -A KUBE-SVC-X -j KUBE-SEP-Y"
    ]
    changed = [before[0], "nft nat: -A KUBE-SERVICES -d 198.19.1.3/32 -j KUBE-SVC-X"]
    assert any(c.startswith("gone: ") for c in checks.view_changes(before, changed))
    assert checks.view_changes(before, before[:1]) == ["gone: " + before[1]]
    # nft's counter syntax is understood too
    assert checks.view_changes(["x counter packets 5 bytes 300 y"], ["x counter packets 2 bytes 100 y"])


def test_ignored_service_lookup_in_a_kernel_view() -> None:
    view = {
        "conf-x/barrier-1-node-1:tcp/TCP": ['nat: -A KUBE-SERVICES -m comment --comment "conf-x/barrier-1-node-1:tcp"'],
        "conf-x/other-proxy-2:tcp/TCP": ["nat: -A KUBE-SVC-Z"],
    }
    lines = [ln for v in view.values() for ln in v]
    assert checks.view_keys(view, "conf-x", "barrier-1-node-1") and checks.mentions(lines, "conf-x", "barrier-1-node-1")
    assert checks.view_keys(view, "conf-x", "other-proxy") == []  # other-proxy-2 is another service
    assert checks.mentions(['-m comment --comment "conf-x/headless:tcp cluster IP"'], "conf-x", "headless")
    assert checks.mentions(['--comment "conf-x/marked-headless:tcp"'], "conf-x", "headless") == []


# ---------------------------------------------------------------------------------------------------- the runner


class RunnerLab(ScriptedLab):
    def kproxy_log(self, node: Any) -> str:
        return ""

    def kproxy_running(self, node: Any) -> bool:
        return True


def test_a_part_nothing_exercised_is_its_own_not_applicable_row() -> None:
    """Item 3: cleanup's "starting another mode" half, with one mode installed, is not folded into the pass."""
    clock = Clock()
    lab = RunnerLab(clock, answering())
    api = Api(clock)
    session = Session("fake", lab, clock=clock, sleep=clock.sleep, api=(api, api))

    def scenario(ctx: Context) -> None:
        ctx.note("first half checked")
        ctx.part_not_applicable_here("another-mode", "no second mode installed")

    result = session.run_scenario(Scenario("cleanup", "t", scenario))
    assert (result.status, result.detail) == (PASS, "first half checked")
    assert [(p.scenario, p.status, p.detail) for p in result.parts] == [
        ("cleanup/another-mode", NOT_APPLICABLE, "not on this host: no second mode installed")
    ]

    def failing_scenario(ctx: Context) -> None:
        ctx.part_not_applicable_here("another-mode", "x")
        ctx.fail("broken")

    assert session.run_scenario(Scenario("cleanup", "t", failing_scenario)).parts == ()


def test_a_mode_declaring_an_unknown_scenario_not_applicable_is_refused() -> None:
    class Mode:
        mode = "stub"

        @staticmethod
        def not_applicable(options: Any) -> dict[str, str]:
            return {"restart": "cannot", "clusterip-tpc": "typo"}

    with pytest.raises(ConformanceError, match="clusterip-tpc"):
        declared_not_applicable(Mode, {})
    Mode.not_applicable = staticmethod(lambda options: {"restart": "cannot"})  # type: ignore[method-assign]
    assert declared_not_applicable(Mode, {}) == {"restart": "cannot"}


def test_requested_modes_refuse_a_typo_and_an_empty_list() -> None:
    """Item 9: a typo in KPROXY_CONFORMANCE_MODES or no backend used to leave one skipped test, green."""
    assert requested_modes("", ["iptables"]) == ["iptables"]
    assert requested_modes("iptables, iptables", ["iptables", "nftables"]) == ["iptables"]
    with pytest.raises(ConformanceError, match="iptabels"):
        requested_modes("iptabels", ["iptables"])
    with pytest.raises(ConformanceError, match="nothing to test"):
        requested_modes("", [])


def test_the_judge_names_no_mode() -> None:
    """The conformance package judges every mode alike: no mode-name comparison, no table keyed by mode."""
    import pathlib
    import re

    import kproxy.conformance as pkg
    from kproxy.proxier import MODE_NAMES

    names = "|".join(MODE_NAMES)
    pattern = re.compile(rf"""(==|!=|\bin\b)\s*\(?["']({names})["']|["']({names})["']\s*(:|==|!=)""")
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        hits = [ln for ln in path.read_text().splitlines() if pattern.search(ln)]
        assert not hits, f"{path.name} names a mode: {hits}"


# ------------------------------------------------------------------------------------------- address collision


def collision_probes(phases: dict[str, list[R]]) -> list[tuple[str, Probe]]:
    return [(ph, Probe("pod-1-0", "tcp", "198.19.1.2", 80, [r])) for ph, rs in phases.items() for r in rs]


def test_a_collision_probe_in_flight_when_the_restart_began_is_in_a_declared_gap() -> None:
    """Seen on the lab under load (userspace, fe13c8d): a connection that started while the claim stood and was
    refused once the kill landed was recorded as ``claimed -> restarting`` and failed the scenario, although the mode
    declares new connections while kproxy is down not applicable."""
    probes = collision_probes(
        {
            "claimed": [ans("pod-2-0")] * 3,
            "claimed -> restarting": [err("refused")],
            "restarting": [err("refused")],
            "restarting -> restarted": [err("refused")],
            "restarted": [ans("pod-2-0")] * 3,
        }
    )
    checks.judge_collision(probes, {"pod-2-0"}, gap_ok=True)
    with pytest.raises(ScenarioFailure, match="went elsewhere or failed"):
        checks.judge_collision(probes, {"pod-2-0"}, gap_ok=False)
    # outside the restart nothing may fail, gap or not; and nothing may go to another pod, ever
    for bad in ({"restarted": [err("refused")]}, {"claimed -> restarting": [ans("pod-3-0")]}):
        with pytest.raises(ScenarioFailure):
            checks.judge_collision(probes + collision_probes(bad), {"pod-2-0"}, gap_ok=True)
