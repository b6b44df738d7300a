"""kproxy soak's pure parts: the churn's model and writes, the expectation against /rules, the API check, figures.

No lab here: tests/conformance/test_soak.py runs the soak itself. These check that the soak would notice what it
claims to notice (a lost change, a stale endpoint, an object the API dropped) and that its own bookkeeping is right.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest

from kproxy.model import IPFamily
from kproxy.readback import describe_port
from kproxy.soak.churn import NAMESPACE, Churn, PodRef, Write, api_differences
from kproxy.soak.cli import register
from kproxy.soak.expect import differences, expected_services
from kproxy.soak.report import fault_summary, percentile, table

PODS = [
    PodRef("pod-1-1", "node-1", "198.18.65.11", "fd00:198:18:65::11"),
    PodRef("pod-1-2", "node-1", "198.18.65.12", "fd00:198:18:65::12"),
    PodRef("pod-2-1", "node-2", "198.18.66.11", "fd00:198:18:66::11"),
]


def _api_after(writes: list[Write]) -> dict[tuple[str, str], dict[str, Any]]:
    """What a store that took every write holds (with ClusterIPs allocated, as the API would)."""
    held: dict[tuple[str, str], dict[str, Any]] = {}
    ip = 10
    for w in writes:
        key = (w.kind, w.name)
        if w.verb == "delete":
            held.pop(key, None)
            continue
        obj = copy.deepcopy(w.obj)
        if w.kind == "Service":
            old = held.get(key)
            if old is not None:
                ips = old["spec"]["clusterIPs"]
            else:
                ip += 1
                ips = [f"198.19.128.{ip}", f"fd00:198:18:ffff::{ip:x}"][: len(obj["spec"]["ipFamilies"])]
            obj["spec"]["clusterIP"], obj["spec"]["clusterIPs"] = ips[0], ips
        held[key] = obj
    return held


def _split(held: dict[tuple[str, str], dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return (
        [o for (k, _), o in held.items() if k == "Service"],
        [o for (k, _), o in held.items() if k == "EndpointSlice"],
    )


def _rules_of(expected: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A /rules answer that holds exactly ``expected`` (as a node that converged would)."""
    services = {
        key: {fam: {**fields, "applied": True, "failed": None} for fam, fields in fams.items()}
        for key, fams in expected.items()
    }
    return {"mode": "x", "backend": {"mode": "x", "services": services}}


def test_churn_is_bounded_seeded_and_every_step_writes() -> None:
    a, b = Churn(PODS, seed=7, max_services=10), Churn(PODS, seed=7, max_services=10)
    wa = a.anchor() + a.initial(5)
    wb = b.anchor() + b.initial(5)
    for _ in range(300):
        sa, sb = a.step(), b.step()
        assert sa, "a step always writes something"
        wa += sa
        wb += sb
    assert [(w.verb, w.name, w.step) for w in wa] == [(w.verb, w.name, w.step) for w in wb]  # seeded
    assert len(a.services) <= 10
    steps = {w.step for w in wa}
    assert {"create", "delete", "scale_up", "scale_down", "policy_flip", "bad_object"} <= steps
    assert all(w.obj["metadata"]["namespace"] == NAMESPACE for w in wa)


def test_expectation_matches_a_converged_node_and_catches_each_kind_of_loss() -> None:
    churn = Churn(PODS, seed=3)
    writes = churn.anchor() + churn.initial(6)
    for _ in range(80):
        writes += churn.step()
    services, slices = _split(_api_after(writes))
    expected, rejected = expected_services("node-1", services, slices, None)
    assert expected and any(k.startswith(f"{NAMESPACE}/anchor:") for k in expected)
    rules = _rules_of(expected)
    assert differences(expected, rules, namespaces=[NAMESPACE]) == {}

    # a lost delete (the node still programs a service the API no longer has)
    stale = copy.deepcopy(rules)
    stale["backend"]["services"]["soak/gone:p0/TCP"] = {"IPv4": {"applied": True}}
    assert differences(expected, stale, namespaces=[NAMESPACE]) == {"soak/gone:p0/TCP/IPv4": "unexpected"}
    # a lost create
    key = sorted(expected)[0]
    missing = copy.deepcopy(rules)
    del missing["backend"]["services"][key]
    assert set(differences(expected, missing, namespaces=[NAMESPACE])) == {f"{key}/{f}" for f in expected[key]}
    # a lost endpoint change
    anchor = next(k for k in expected if k.startswith("soak/anchor:"))
    old = copy.deepcopy(rules)
    old["backend"]["services"][anchor]["IPv4"]["internalEndpoints"] = ["198.18.65.99:8080"]
    diff = differences(expected, old, namespaces=[NAMESPACE])
    assert list(diff) == [f"{anchor}/IPv4"] and "internalEndpoints" in diff[f"{anchor}/IPv4"]
    # a refused service and one not applied yet
    refused = copy.deepcopy(rules)
    refused["backend"]["services"][anchor]["IPv4"]["failed"] = "kernel said no"
    refused["backend"]["services"][anchor]["IPv6"]["applied"] = False
    assert differences(expected, refused, namespaces=[NAMESPACE]) == {
        f"{anchor}/IPv4": "refused: kernel said no",
        f"{anchor}/IPv6": "not applied",
    }
    # someone else's namespace never counts
    other = copy.deepcopy(rules)
    other["backend"]["services"]["default/kubernetes:https/TCP"] = {"IPv4": {"applied": True}}
    assert differences(expected, other, namespaces=[NAMESPACE]) == {}


def test_bad_objects_are_rejected_and_change_nothing_else() -> None:
    churn = Churn(PODS, seed=11)
    writes = churn.anchor() + churn.initial(4)
    good, _ = expected_services("node-1", *_split(_api_after(writes)), None)
    bad: list[Write] = []
    while len(churn.bad) < 3:
        bad += churn._bad_object()
    expected, rejected = expected_services("node-1", *_split(_api_after(writes + bad)), None)
    assert rejected, "the churn's bad objects must be rejected by the cache"
    for key, fams in good.items():
        assert expected[key] == fams, f"a bad object changed {key}"


def test_policy_flip_is_seen_per_node() -> None:
    churn = Churn(PODS, seed=5, min_services=0)
    writes = churn.initial(1)
    m = next(iter(churn.services.values()))
    m.endpoints = {"IPv4": {"pod-2-1": True}}
    m.families = ["IPv4"]
    writes += churn._slice_write(m, "IPv4", "scale_up")
    m.itp = "Local"
    writes += churn._service_write(m, "policy_flip")
    services, slices = _split(_api_after(writes))
    on1, _ = expected_services("node-1", services, slices, None, (IPFamily.V4,))
    on2, _ = expected_services("node-2", services, slices, None, (IPFamily.V4,))
    key = f"{NAMESPACE}/{m.name}:p0/TCP"
    assert on1[key]["IPv4"]["internalEndpoints"] == []
    assert on2[key]["IPv4"]["internalEndpoints"] == ["198.18.66.11:8080"]


def test_api_differences() -> None:
    churn = Churn(PODS, seed=2)
    writes = churn.anchor() + churn.initial(3)
    for _ in range(40):
        writes += churn.step()
    written = {(w.kind, w.name): w for w in writes}
    held = _api_after(writes)
    assert api_differences(written, set(), held) == {}
    # the API lost an object (a restart that did not load it)
    key = next(k for k in held if k[0] == "EndpointSlice")
    lost = dict(held)
    del lost[key]
    assert api_differences(written, set(), lost) == {f"{key[0]} {key[1]}": "missing"}
    # ... but not when the soak's own last write of it was refused: the soak cannot know which version stands
    assert api_differences(written, {key}, lost) == {}
    # an object that came back after its delete, or that nobody wrote
    deleted = next((w for w in writes[::-1] if w.verb == "delete"), None)
    if deleted is not None and (deleted.kind, deleted.name) not in held:
        back = dict(held)
        back[(deleted.kind, deleted.name)] = {"kind": deleted.kind, "metadata": {"name": deleted.name}}
        assert api_differences(written, set(), back) == {
            f"{deleted.kind} {deleted.name}": "still there after its delete"
        }
    extra = dict(held)
    extra[("Service", "intruder")] = {"kind": "Service", "spec": {}}
    assert api_differences(written, set(), extra) == {"Service intruder": "unexpected"}


def test_percentiles_and_summary() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([0.1, 5.0], 99) == 5.0
    s = fault_summary({"flush": [9.0, 8.0, 10.0]}, {"flush": 1, "http_5xx": 2})
    assert s["flush"] == {"injected": 4, "converged": 3, "unconverged": 1, "p50_s": 9.0, "p99_s": 10.0, "max_s": 10.0}
    assert s["http_5xx"]["injected"] == 2 and s["http_5xx"]["p99_s"] is None


def test_table_names_the_figures() -> None:
    report = {
        "mode": "iptables",
        "duration_s": 60.0,
        "rate": 5.0,
        "nodes": 2,
        "ok": True,
        "changes": {"applied": 300, "api_refused": 0, "retries": 3},
        "lost_changes": 0,
        "drift_checkpoints": 0,
        "drift_final": 0,
        "checkpoints": [{}],
        "packets": {"sent": 4, "failed": 0},
        "new_connections": {"total": 200, "failed": 0, "failed_in_kproxy_restarts": 0, "failed_outside": 0},
        "held_connection": {"alive": True, "exchanges": 120},
        "faults": fault_summary({"kproxy_kill": [0.4]}, {}),
        "faults_not_injected": {"apply_fail": "no switch"},
    }
    text = table(report)
    for word in ("PASS", "lost changes", "kproxy_kill", "apply_fail", "held connection", "open"):
        assert word in text


def test_cli_registers() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["soak", "--mode", "iptables", "--minutes", "0.5", "--faults", "none,flush"])
    assert args.minutes == 0.5 and args.faults == "none,flush" and args.lab_prefix == "kps-"


def test_mode_all_goes_on_after_a_mode_that_cannot_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``make soak`` (``--mode all``): one mode whose lab cannot start must not cost the other modes' reports."""
    import json

    import kproxy.proxier
    import kproxy.soak.run as run_mod

    class FakeSoak:
        def __init__(self, opts: Any, progress: Any = None) -> None:
            self.mode = opts.mode

        def run(self) -> dict[str, Any]:
            if self.mode == "broken":
                raise run_mod.SoakError("the lab did not come up")
            return {"mode": self.mode, "ok": True}

    monkeypatch.setattr(kproxy.proxier, "available_backends", lambda: {"broken": None, "fine": None})
    monkeypatch.setattr(run_mod, "Soak", FakeSoak)
    monkeypatch.setattr(run_mod, "render", lambda report: f"table of {report['mode']}")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "soak.json"
    args = parser.parse_args(["soak", "--mode", "all", "--json", str(out)])
    assert args.func(args) == 2
    reports = json.loads(out.read_text())
    assert reports["fine"]["ok"] is True
    assert reports["broken"] == {"mode": "broken", "ok": False, "error": "the lab did not come up"}
    args = parser.parse_args(["soak", "--mode", "broken"])
    assert args.func(args) == 2


def test_soak_options_are_checked() -> None:
    from kproxy.soak.run import Soak, SoakError, SoakOptions

    with pytest.raises(SoakError):
        Soak(SoakOptions(mode="no-such-mode"))


def test_describe_port_fields_are_the_compared_ones() -> None:
    """The expectation compares what describe() publishes: a field renamed there must not silently stop counting."""
    from kproxy.soak.expect import COMPARED

    churn = Churn(PODS, seed=1)
    services, slices = _split(_api_after(churn.anchor()))
    from kproxy.cache import ServiceCache

    cache = ServiceCache("node-1")
    cache.replace_services(services)
    cache.replace_slices(slices)
    state, _ = cache.snapshot()
    sp = next(iter(state.family(IPFamily.V4).values()))
    assert set(COMPARED) <= set(describe_port(sp, True, None))
