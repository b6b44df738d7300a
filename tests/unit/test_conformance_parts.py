"""Declared not-applicable parts, lab gaps in pytest, and the verdicts of the parts issue 21 added: a mode says up
front which parts of a scenario it cannot do (``not_applicable_parts``), the exact sets are pinned here, an
undeclared part fails the scenario, a lab gap fails the pytest case as it fails ``kproxy conformance``, and the
long-lived UDP socket's, udp-stale-flows' and the restart's verdicts hold without the parts a mode declares away."""

from __future__ import annotations

from typing import Any

import conformance.test_conformance as entry
import pytest

from kproxy.conformance import checks
from kproxy.conformance.context import Context
from kproxy.conformance.registry import Scenario
from kproxy.conformance.report import FAIL, NOT_APPLICABLE, PASS
from kproxy.conformance.runner import (
    ConformanceError,
    Session,
    declared_not_applicable,
    declared_not_applicable_parts,
)
from kproxy.conformance.scenarios import BY_ID
from kproxy.conformance.values import Probe, ScenarioFailure
from kproxy.proxier import MODE_NAMES, backend_class

from .test_conformance_judge import Api, Clock, R, RunnerLab, ans, answering, err, make_ctx

# What each mode cannot do, exactly: a scenario or part added to a mode's declaration, or dropped from it, fails here.
SCENARIOS_NOT_APPLICABLE: dict[str, set[str]] = {
    "userspace": {"source-ip"},
    "iptables": set(),
    "nftables": set(),
    "bpf": set(),
}
PARTS_NOT_APPLICABLE: dict[str, dict[str, set[str]]] = {
    "userspace": {
        "etp-local": {"client-ip"},
        "address-collision": {"while-down"},
        "dual-stack": {"client-ip", "kernel-counters"},
        "restart": {"held-connection", "while-down"},
        "mode-switch": {"held-connections", "while-down"},
    },
    "iptables": {},
    "nftables": {},
    "bpf": {"udp-conntrack": {"stale-entry"}, "dual-stack": {"kernel-counters"}},
}


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_declares_exactly_these(mode: str) -> None:
    cls = backend_class(mode)
    options = cls.option_values({})
    assert set(declared_not_applicable(cls, options)) == SCENARIOS_NOT_APPLICABLE[mode]
    parts = declared_not_applicable_parts(cls, options)
    assert {sid: set(p) for sid, p in parts.items()} == PARTS_NOT_APPLICABLE[mode]
    assert all(reason.strip() for p in parts.values() for reason in p.values())  # every part says why


def test_a_declaration_of_a_part_no_scenario_has_is_refused() -> None:
    class Mode:
        mode = "stub"

        @staticmethod
        def not_applicable_parts(options: Any) -> dict[str, dict[str, str]]:
            return {"restart": {"held-conection": "typo"}, "no-such-scenario": {"x": "y"}}

    with pytest.raises(ConformanceError, match="no-such-scenario, restart/held-conection"):
        declared_not_applicable_parts(Mode, {})
    Mode.not_applicable_parts = staticmethod(lambda options: {"restart": {"held-connection": "own sockets"}})  # type: ignore[method-assign]
    assert declared_not_applicable_parts(Mode, {}) == {"restart": {"held-connection": "own sockets"}}


def _session(ipv6: bool = True) -> Session:
    clock = Clock()
    lab = RunnerLab(clock, answering())
    lab.ipv6 = ipv6
    api = Api(clock)
    return Session("fake", lab, clock=clock, sleep=clock.sleep, api=(api, api))


def test_a_declared_part_is_left_out_and_reported_with_the_modes_reason() -> None:
    session = _session()
    session.not_applicable_parts = {"restart": {"held-connection": "its own sockets"}}
    checked: list[str] = []

    def scenario(ctx: Context) -> None:
        if not ctx.skips("held-connection"):
            checked.append("held")
        ctx.note("new connections checked")

    result = session.run_scenario(Scenario("restart", "t", scenario, parts=frozenset({"held-connection"})))
    assert (result.status, result.detail, checked) == (PASS, "new connections checked", [])
    assert [(p.scenario, p.status, p.detail) for p in result.parts] == [
        ("restart/held-connection", NOT_APPLICABLE, "declared by mode fake: its own sockets")
    ]


def test_an_undeclared_part_found_not_applicable_fails_the_scenario() -> None:
    """udp-conntrack's stale-entry half used to be dropped whenever no conntrack entry was seen (by a filter that
    could not see a DNATed flow's entry): a part found at run time and not declared is a failure now."""
    session = _session()

    def scenario(ctx: Context) -> None:
        ctx.part_not_applicable("stale-entry", "no conntrack entry seen")

    result = session.run_scenario(Scenario("udp-conntrack", "t", scenario, parts=frozenset({"stale-entry"})))
    assert result.status == FAIL and result.parts == ()
    assert "part stale-entry found not applicable but not declared by mode fake" in result.detail
    assert "no conntrack entry seen" in result.detail


def test_a_declared_part_the_scenario_never_reached_fails_it() -> None:
    session = _session()
    session.not_applicable_parts = {"restart": {"while-down": "x"}}
    result = session.run_scenario(Scenario("restart", "t", lambda ctx: None, parts=frozenset({"while-down"})))
    assert result.status == FAIL and "declares part while-down not applicable, but the scenario never reached it" in (
        result.detail
    )


class _Labs:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.parts: list[str] = []

    def get(self, mode: str) -> Session:
        return self.session


def _outcome(session: Session, scenario_id: str) -> tuple[str, str]:
    """What the pytest case makes of one scenario: ("fail" | "skip" | "pass", message); a skip is caught here, so a
    case that should fail and skips fails this test rather than skipping it."""
    try:
        entry.test_scenario(_Labs(session), "fake", scenario_id)
    except pytest.fail.Exception as exc:
        return "fail", str(exc)
    except pytest.skip.Exception as exc:
        return "skip", str(exc)
    return "pass", ""


def test_a_lab_gap_fails_the_pytest_case() -> None:
    """dual-stack on a lab without IPv6: `kproxy conformance` fails the run; the pytest case used to skip."""
    session = _session(ipv6=False)
    verdict, message = _outcome(session, "dual-stack")
    assert verdict == "fail", (verdict, message)
    assert "not checked, this lab cannot run it: the lab lacks ipv6" in message
    assert session.lab_gaps == ["dual-stack"]


def test_a_scenario_the_mode_declares_away_still_skips_in_pytest() -> None:
    session = _session()
    session.not_applicable = {"source-ip": "the endpoint sees the node"}
    assert _outcome(session, "source-ip") == ("skip", "not applicable to fake: fake: the endpoint sees the node")


def test_a_passing_case_lists_its_parts_for_the_summary() -> None:
    session = _session()
    session.not_applicable_parts = {"restart": {"held-connection": "its own sockets"}}
    labs = _Labs(session)
    sc_restart = BY_ID["restart"]
    real = sc_restart.run
    try:
        object.__setattr__(sc_restart, "run", lambda ctx: ctx.skips("held-connection"))
        entry.test_scenario(labs, "fake", "restart")
    finally:
        object.__setattr__(sc_restart, "run", real)
    assert labs.parts == ["fake restart/held-connection: declared by mode fake: its own sockets"]


# ------------------------------------------------------------------------------------- the long-lived UDP socket


def _socket(log: list[tuple[float, str]], done: tuple[str, ...] = ()) -> str:
    ctx, _, _ = make_ctx(answering())
    return checks.judge_udp_socket(ctx, log, 100.0, "pod-2-0", "pod-2-1", "pod-1-0 -> 198.19.1.2:80", done)


BEFORE = [(99.0 + 0.1 * i, "pod-2-0") for i in range(8)]


def test_a_socket_that_follows_passes() -> None:
    log = BEFORE + [(100.0 + 0.1 * i, "pod-2-0") for i in range(5)] + [(100.6 + 0.1 * i, "pod-2-1") for i in range(5)]
    assert _socket(log) == "long-lived socket: first answer from pod-2-1 at +0.60 s, the same socket throughout"


def test_a_socket_ended_by_the_mode_and_replaced_by_the_client_passes_and_says_so() -> None:
    log = BEFORE + [(100.3, "!ECONNABORTED+reconnect")] + [(100.4 + 0.1 * i, "pod-2-1") for i in range(4)]
    assert _socket(log).endswith("first answer from pod-2-1 at +0.40 s after 1 reconnect(s) on a socket error")


def test_a_socket_still_pinned_to_the_old_backend_fails() -> None:
    """cilium#27300: a connected socket translated once keeps its backend for ever."""
    log = BEFORE + [(100.0 + 0.1 * i, "pod-2-0") for i in range(40)]
    with pytest.raises(ScenarioFailure, match=r"did not follow .* within 2 s: at \+2\.\d\d s still pod-2-0"):
        _socket(log)


def test_a_socket_that_reached_the_new_backend_late_fails() -> None:
    log = BEFORE + [(100.0 + 0.1 * i, "!timeout") for i in range(25)] + [(102.6, "pod-2-1")]
    with pytest.raises(ScenarioFailure, match=r"still !timeout"):
        _socket(log)


def test_a_socket_that_never_had_the_old_backend_proves_nothing() -> None:
    with pytest.raises(ScenarioFailure, match="not answered by pod-2-0 alone before the change"):
        _socket([(99.5, "pod-2-1"), (100.5, "pod-2-1")])
    with pytest.raises(ScenarioFailure, match="no datagram before the change"):
        _socket([(100.5, "pod-2-1")], ("exit 1: boom",))


# ------------------------------------------------------------------------------------- restart without its parts


def _restart(probes: dict[str, list[R]], hold: list[R]) -> None:
    ctx, _, _ = make_ctx(answering("pod-2-0"))
    recorded = [(ph, Probe("pod-1-0", "tcp", "198.19.1.2", 80, [r])) for ph, rs in probes.items() for r in rs]
    checks.judge_restart(ctx, "pod-1-0", "198.19.1.2", "node-1", hold, recorded, 0.0, 4.0, 6.0, False, False)


def test_restart_without_hold_and_down_window_judges_before_and_after() -> None:
    down = {"killed": [err("refused")] * 3, "restarting": [err("refused")]}
    _restart({"before": [ans("pod-2-0")], **down, "after": [ans("pod-2-0")] * 3}, [])
    with pytest.raises(ScenarioFailure, match="failed around the restart: after"):
        _restart({"before": [ans("pod-2-0")], **down, "after": [ans("pod-2-0"), err("refused")]}, [])
    with pytest.raises(ScenarioFailure, match="no new connection was made in the 2.0 s after"):
        _restart({"before": [ans("pod-2-0")], **down}, [])


# ------------------------------------------------------------------------------------- udp-stale-flows' phases

T0, T1, T2, T3 = 100.0, 110.0, 120.0, 130.0  # scale to zero, back up, Service deleted, re-created
PHASES = [
    checks.UdpPhase(float("-inf"), "", "pod-2-1"),
    checks.UdpPhase(T0, "the scale to zero", None),
    checks.UdpPhase(T1, "the scale back up", "pod-2-2"),
    checks.UdpPhase(T2, "the Service's deletion", None),
    checks.UdpPhase(T3, "its re-creation on the same ClusterIP", "pod-2-3", "held-socket-re-create"),
]


def _every(start: float, end: float, word: str) -> list[tuple[float, str]]:
    return [(start + 0.1 * i, word) for i in range(round((end - start) / 0.1))]


def _phases(log: list[tuple[float, str]], skip: tuple[str, ...] = ()) -> list[str]:
    ctx, _, _ = make_ctx(answering())
    return checks.judge_udp_phases(
        ctx, log, PHASES, subject="the long-lived UDP socket", sent="one socket", bound=1.0, skip=skip
    )


def _honest(stale_after_delete: str = "!timeout", re_created: str = "pod-2-3") -> list[tuple[float, str]]:
    """A record of a client that follows every change at +0.3 s (or not, where the arguments say)."""
    return (
        _every(90.0, T0 + 0.3, "pod-2-1")
        + _every(T0 + 0.3, T1, "!ECONNREFUSED")
        + _every(T1, T1 + 0.3, "!ECONNREFUSED")
        + _every(T1 + 0.3, T2 + 0.3, "pod-2-2")
        + _every(T2 + 0.3, T3, stale_after_delete)
        + _every(T3, T3 + 0.3, "!timeout")
        + _every(T3 + 0.3, T3 + 5, re_created)
    )


def test_a_client_that_follows_every_change_within_the_bound_passes() -> None:
    assert _phases(_honest()) == [
        "unanswered from +0.30 s",
        "first answer from pod-2-2 at +0.30 s",
        "unanswered from +0.30 s",
        "first answer from pod-2-3 at +0.30 s",
    ]


def test_a_flow_left_behind_by_a_deleted_service_fails() -> None:
    """kubernetes#141371: the Service is gone, its flow still reaches the endpoint it had."""
    with pytest.raises(
        ScenarioFailure, match=r"still answered 1 s after the Service's deletion: at \+1\.\d\d s by pod-2-2"
    ):
        _phases(_honest(stale_after_delete="pod-2-2"))


def test_a_flow_kept_on_its_endpoint_after_a_scale_to_zero_fails() -> None:
    """kubernetes#139628: no endpoints, yet the flow still reaches the one it was DNATed to."""
    log = _every(90.0, T1, "pod-2-1") + [(t, w) for t, w in _honest() if t >= T1]
    with pytest.raises(ScenarioFailure, match=r"still answered 1 s after the scale to zero: at \+1\.\d\d s by pod-2-1"):
        _phases(log)


def test_a_phase_without_datagrams_after_the_bound_tested_nothing() -> None:
    log = [(t, w) for t, w in _honest() if not T0 + 0.5 < t < T1]
    with pytest.raises(ScenarioFailure, match="sent no datagram from \\+1 s after the scale to zero on"):
        _phases(log)


def test_a_failed_part_is_named_and_a_declared_one_not_judged() -> None:
    stuck = _honest(re_created="!timeout")
    with pytest.raises(ScenarioFailure, match=r"to pod-2-3 within 1 s: at \+1\.\d\d s still !timeout \(part held-s"):
        _phases(stuck)
    assert _phases(stuck, skip=("held-socket-re-create",))[-1] == (
        "not judged (part held-socket-re-create declared not applicable)"
    )


def test_every_failed_phase_is_named_in_one_failure() -> None:
    log = _every(90.0, T1, "pod-2-1") + [(t, w) for t, w in _honest(stale_after_delete="pod-2-2") if t >= T1]
    with pytest.raises(ScenarioFailure, match=r"^2 failures: .*after the scale to zero.* \| .*after the Service's del"):
        _phases(log)
