"""The scenario registry: every scenario registered once by ``@scenario`` beside its function, in docs/BEHAVIOUR.md's
order, with the fields the table had before the scenarios were split by theme."""

from __future__ import annotations

import pytest

from kproxy.conformance import registry, scenarios
from kproxy.conformance.registry import Scenario, scenario

#: the ids, in order, as the single table in scenarios.py listed them before the split (reports, --scenario and
#: docs/BEHAVIOUR.md depend on them)
IDS = (
    "clusterip-tcp",
    "clusterip-udp",
    "multiport",
    "same-port-two-protocols",
    "nodeport",
    "localhost-nodeport",
    "externalip",
    "loadbalancer",
    "no-endpoints-reject",
    "session-affinity",
    "source-ip",
    "hairpin",
    "etp-local",
    "itp-local",
    "terminating-fallback",
    "lifecycle",
    "address-collision",
    "endpoint-churn",
    "port-update",
    "ignored-services",
    "udp-conntrack",
    "udp-stale-flows",
    "restart",
    "cleanup",
    "mode-switch",
    "servers",
    "counters",
    "dual-stack",
    "scale-smoke",
)

#: id -> (function name, needs, timeout_s, parts) where any differs from the defaults ((), 60.0, ())
FIELDS = {
    "session-affinity": ("session_affinity", (), 90.0, ()),
    "localhost-nodeport": ("localhost_nodeport", (), 180.0, ()),
    "etp-local": ("etp_local", (), 90.0, ("client-ip",)),
    "address-collision": ("address_collision", (), 120.0, ("while-down",)),
    "ignored-services": ("ignored_services", (), 60.0, ("kernel-rules",)),
    "udp-conntrack": ("udp_conntrack", (), 90.0, ("stale-entry",)),
    "udp-stale-flows": ("udp_stale_flows", (), 120.0, ("held-socket-re-create",)),
    "restart": ("restart", (), 90.0, ("held-connection", "while-down")),
    "cleanup": ("cleanup", (), 150.0, ()),
    "mode-switch": ("mode_switch", (), 200.0, ("held-connections", "while-down")),
    "dual-stack": ("dual_stack", ("ipv6",), 90.0, ("client-ip", "kernel-counters", "kernel-rules")),
    "scale-smoke": ("scale_smoke", (), 280.0, ()),
    "counters": ("counters", (), 180.0, ("udp-flows",)),
}

TITLES = {
    "clusterip-tcp": "pod -> ClusterIP:port over TCP, 3 endpoints on 2 nodes",
    "same-port-two-protocols": "TCP and UDP on one port number (and one NodePort)",
    "mode-switch": "another mode replaces the running one under traffic, and back",
    "scale-smoke": "1,000 services x 3 endpoints; a random sample of 50 reachable",
}


def test_every_scenario_once_in_order() -> None:
    assert scenarios.SCENARIO_IDS == IDS
    # registered in import order; nothing outside the themes, nothing twice
    assert sorted(s.id for s in registry.registered()) == sorted(IDS)
    assert list(scenarios.BY_ID) == list(IDS)
    assert len({s.run for s in scenarios.SCENARIOS}) == len(IDS)


@pytest.mark.parametrize("sid", IDS)
def test_decorator_fields(sid: str) -> None:
    s = scenarios.BY_ID[sid]
    name, needs, timeout_s, parts = FIELDS.get(sid, (sid.replace("-", "_"), (), 60.0, ()))
    assert (s.run.__name__, sorted(s.needs), s.timeout_s, sorted(s.parts)) == (
        name,
        list(needs),
        timeout_s,
        list(parts),
    )
    assert s.title and s.title == TITLES.get(sid, s.title)
    # registered beside its function: the scenario's module is one of the themes, in the themes' order
    themes = [m.__name__ for m in scenarios.THEMES]
    assert s.run.__module__ in themes
    assert s in registry.registered(s.run.__module__)


def test_themes_run_in_order() -> None:
    themes = [m.__name__ for m in scenarios.THEMES]
    modules = [themes.index(s.run.__module__) for s in scenarios.SCENARIOS]
    assert modules == sorted(modules)


def test_an_id_registered_twice_is_refused() -> None:
    before = registry.registered()
    with pytest.raises(ValueError, match="registered twice"):
        scenario("clusterip-tcp", "again")(lambda ctx: None)
    assert registry.registered() == before


def test_the_decorator_returns_the_function_and_records_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTERED", [])  # a registry of this test's own

    def run(ctx: object) -> None:
        return None

    assert scenario("x-y", "a title", needs=["ipv6"], timeout_s=5, parts=("a", "b"))(run) is run
    assert registry.registered() == (Scenario("x-y", "a title", run, frozenset({"ipv6"}), 5, frozenset({"a", "b"})),)
    assert registry.registered(__name__) == registry.registered()
    assert registry.registered("kproxy.conformance.sc_paths") == ()
