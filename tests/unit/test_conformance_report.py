"""The conformance report formats (table, JSON, JUnit) and the scenario table's shape; no root, no lab."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kproxy.conformance.report import (
    FAIL,
    NOT_APPLICABLE,
    PASS,
    Report,
    Result,
    format_table,
    from_json,
    to_json,
    to_junit,
)
from kproxy.conformance.scenarios import SCENARIO_IDS, SCENARIOS

from .test_docs import behaviour_ids

#: the scenario ids of docs/BEHAVIOUR.md's table (the spec), in its order
BEHAVIOUR_IDS = behaviour_ids((Path(__file__).resolve().parents[2] / "docs" / "BEHAVIOUR.md").read_text())


def sample() -> Report:
    return Report(
        "iptables",
        [
            Result("clusterip-tcp", PASS, "60 probes: 60 answered", 1.234567),
            Result("loadbalancer", FAIL, "a probe that must fail was answered; sent: 2 TCP probe(s)\nsecond line", 3.5),
            Result("restart", NOT_APPLICABLE, "iptables: no such thing", 0.0),
        ],
        wall_seconds=12.5,
    )


def test_json_has_exactly_the_documented_shape() -> None:
    doc = json.loads(to_json(sample()))
    assert set(doc) == {"mode", "results"}
    assert doc["mode"] == "iptables"
    assert [set(r) for r in doc["results"]] == [{"scenario", "status", "detail", "seconds"}] * 3
    assert [r["status"] for r in doc["results"]] == ["pass", "fail", "not-applicable"]
    assert doc["results"][0]["seconds"] == pytest.approx(1.2346)
    assert from_json(to_json(sample())).results[1] == Result("loadbalancer", FAIL, sample().results[1].detail, 3.5)


def test_table_shows_reasons_for_fail_and_not_applicable_only() -> None:
    other = Report("nftables", [Result("clusterip-tcp", FAIL, "x" * 300, 2.0)], wall_seconds=2.0)
    text = format_table([sample(), other], width=60)
    lines = text.splitlines()
    assert lines[0].split() == ["scenario", "iptables", "nftables"]
    row = next(ln for ln in lines if ln.startswith("clusterip-tcp"))
    assert " pass " in row and "FAIL: xxx" in row and row.endswith("...")
    lb = next(ln for ln in lines if ln.startswith("loadbalancer"))
    assert "FAIL: a probe that must fail was answered" in lb and "second line" not in text.split("\n", 3)[0]
    assert "\n" not in lb  # multi-line details are folded into one cell
    assert "not-applicable: iptables: no such thing" in text
    assert next(ln for ln in lines if ln.startswith("restart")).split()[-1] == "-"  # nftables has no result
    assert "iptables: 1 passed, 1 failed, 1 not applicable in 12.5 s" in text


def test_junit_one_testcase_per_scenario_with_failure_and_skipped() -> None:
    root = ET.fromstring(to_junit([sample()]))
    assert root.tag == "testsuites" and root.get("tests") == "3" and root.get("failures") == "1"
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name") == "kproxy-conformance-iptables" and suite.get("skipped") == "1"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["clusterip-tcp", "loadbalancer", "restart"]
    assert cases["clusterip-tcp"].find("failure") is None and cases["clusterip-tcp"].find("skipped") is None
    failure = cases["loadbalancer"].find("failure")
    assert failure is not None and failure.text == sample().results[1].detail
    assert failure.get("message") == "a probe that must fail was answered; sent: 2 TCP probe(s)"
    skipped = cases["restart"].find("skipped")
    assert skipped is not None and skipped.get("message") == "iptables: no such thing"
    assert cases["loadbalancer"].get("time") == "3.500"


def test_unknown_status_is_refused() -> None:
    with pytest.raises(ValueError, match="status"):
        Result("x", "passed")


def test_report_ok_and_counts() -> None:
    rep = sample()
    assert not rep.ok and [r.scenario for r in rep.failed] == ["loadbalancer"]
    assert rep.counts() == {PASS: 1, FAIL: 1, NOT_APPLICABLE: 1}
    assert Report("bpf", [Result("a", NOT_APPLICABLE, "why")]).ok  # not-applicable is not a failure


def test_scenario_table_is_behaviours_table_in_order() -> None:
    assert list(SCENARIO_IDS) == BEHAVIOUR_IDS
    assert all(s.timeout_s < 300 for s in SCENARIOS)  # each fits pytest's per-test timeout
    assert all(callable(s.run) and s.title for s in SCENARIOS)


def test_runner_selects_in_table_order_and_names_unknown_ids() -> None:
    from kproxy.conformance.runner import ConformanceError, select

    assert [s.id for s in select(["servers", "clusterip-tcp"])] == ["clusterip-tcp", "servers"]
    assert len(select(None)) == len(SCENARIOS)
    with pytest.raises(ConformanceError, match="nope"):
        select(["nope"])


def test_addresses_are_unique_and_inside_the_plan() -> None:
    import ipaddress

    from kproxy.conformance.values import Addresses

    a = Addresses()
    v4 = [a.cluster_ip() for _ in range(1200)]
    assert len(set(v4)) == 1200
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("198.19.0.0/18") for ip in v4)
    assert not any(ip.endswith((".0", ".255")) for ip in v4)
    assert ipaddress.ip_address(a.cluster_ip("IPv6")) in ipaddress.ip_network("fd00:198:18:ff::/112")
    assert a.external_ip().startswith("198.19.100.") and a.lb_ip().startswith("198.19.200.")
    ports = [a.node_port() for _ in range(10)]
    assert len(set(ports)) == 10 and all(30000 <= p <= 32767 for p in ports)


def _ctx():  # type: ignore[no-untyped-def]
    """A Context over the lab's pure plan (no namespaces, no API calls): for the object builders."""
    from types import SimpleNamespace

    from kubernetes import client

    from kproxy.conformance.context import Context
    from kproxy.conformance.values import Addresses
    from kproxy.lab.cluster import make_plan

    plan = make_plan(2, 3, ipv6=True)
    lab = SimpleNamespace(
        nodes=list(plan.nodes),
        pods=list(plan.pods),
        external_ns=plan.external_ns,
        ipv6=True,
        api_client=lambda: client.ApiClient(client.Configuration(host="http://127.0.0.1:9")),
    )
    return Context(lab, "iptables", "unit", Addresses(), 60.0)


def test_built_objects_are_valid_kubernetes_objects() -> None:
    import kubernetes_validate

    ctx = _ctx()
    pods = ctx.pods_on(ctx.nodes[0])[:2] + ctx.pods_on(ctx.nodes[1])[:1]
    objs = []
    plain = ctx.service("plain")
    objs += [plain, ctx.slice_for(plain, pods)]
    lb = ctx.service(
        "lb",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=ctx.addresses.node_port(),
        loadBalancerSourceRanges=["198.18.0.2/32"],
        externalIPs=[ctx.addresses.external_ip()],
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 2}},
    )
    objs += [lb, ctx.slice_for(lb, pods, ready=False, serving=True, terminating=True)]
    named = ctx.service("named", [ctx.port(80, "http", name="web"), ctx.port(81, 8081, name="udp", protocol="UDP")])
    objs += [named, ctx.slice_for(named, pods, ports=[{"name": "web", "port": 8081, "protocol": "TCP"}])]
    ds = ctx.service("ds", families=("IPv4", "IPv6"), internalTrafficPolicy="Local")
    objs += [ds, ctx.slice_for(ds, pods, family="IPv4"), ctx.slice_for(ds, pods, family="IPv6")]
    objs += [
        ctx.service("hl", cluster_ip=None),
        ctx.service("en", type="ExternalName", externalName="a.example.invalid"),
    ]
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    assert lb["spec"]["ports"][0]["nodePort"] >= 30000 and plain["spec"]["clusterIP"].startswith("198.19.")
    assert [_ for _ in ds["spec"]["clusterIPs"] if ":" in _] and ds["spec"]["ipFamilyPolicy"] == "RequireDualStack"
    v6 = ctx.slice_for(ds, pods, family="IPv6")
    assert v6["addressType"] == "IPv6" and v6["endpoints"][0]["addresses"] == [pods[0].ip6]
    assert v6["metadata"]["labels"]["kubernetes.io/service-name"] == "ds"
    assert {e["nodeName"] for e in v6["endpoints"]} == {"node-1", "node-2"}
    with pytest.raises(ValueError, match="named targetPort"):
        ctx.slice_for(named, pods)


def test_failure_text_says_what_was_sent_got_and_expected() -> None:
    from kproxy.conformance.values import ScenarioFailure, summarize
    from kproxy.lab.probe import ProbeResult

    results = [ProbeResult(True, "pod-1-2 198.18.65.11 4000"), ProbeResult(False, error="timeout", seconds=1.0)]
    text = summarize(results)
    assert text == "2 probes: 1 answered (pod-1-2 x1), 1 failed (timeout x1) after 1.00-1.00 s"
    exc = ScenarioFailure("not all answered", sent="2 TCP probes", got=text, expected="all answered")
    assert str(exc) == f"not all answered; sent: 2 TCP probes; got: {text}; expected: all answered"


def test_health_body_check_follows_upstreams_proxy_health_json() -> None:
    from kproxy.conformance.checks import health_body_problems

    t = "2026-11-22T13:24:09.803943Z"
    assert health_body_problems({"lastUpdated": t, "currentTime": t, "nodeEligible": True}, "/healthz") == []
    newer = {
        "lastUpdated": t,
        "currentTime": t,
        "healthy": True,
        "status": {"IPv4": {"lastUpdated": t, "healthy": True}},
    }
    assert health_body_problems(newer, "/livez") == []
    assert health_body_problems({**newer, "nodeEligible": True}, "/healthz") == []
    assert health_body_problems({"lastUpdated": t, "currentTime": t}, "/healthz") == [
        "missing nodeEligible",
        "nodeEligible is not true",
    ]
    assert health_body_problems({"lastUpdated": "yesterday", "currentTime": t, "x": 1}, "/livez") == [
        "unknown keys x",
        "lastUpdated 'yesterday' is not an RFC 3339 time",
    ]
    assert "nodeEligible on /livez" in health_body_problems(
        {"lastUpdated": t, "currentTime": t, "nodeEligible": True}, "/livez"
    )


def test_cli_registers_conformance_with_its_flags() -> None:
    import argparse

    from kproxy.conformance.cli import _modes, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["conformance", "--mode", "iptables", "--mode", "iptables", "--scenario", "servers", "--junit", "x.xml"]
    )
    assert args.mode == ["iptables", "iptables"] and args.scenario == ["servers"] and args.junit == "x.xml"
    assert args.format == "table" and not args.keep_lab and not args.reuse_lab and callable(args.func)
    assert _modes(args.mode) == ["iptables"]


def test_a_running_lab_is_not_replaced_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone's live lab under the prefix: `kproxy conformance` refuses instead of taking it down, naming the
    flags; with replace_lab it goes ahead (Lab.up, which replaces it), and the CLI knows --replace-lab. A leftover
    whose processes are gone is replaced without asking."""
    import kproxy.proxier
    from kproxy.conformance.cli import register
    from kproxy.conformance.runner import ConformanceError, Session
    from kproxy.lab.cluster import Lab

    monkeypatch.setattr(kproxy.proxier, "availability", lambda mode: kproxy.proxier.Availability(True))
    live: list[object] = [object()]  # a live lab under the prefix; emptied below: a killed run's leftover
    monkeypatch.setattr(Lab, "live", classmethod(lambda cls, prefix=None: live[0] if live else None))
    brought_up: list[str | None] = []

    def up(cls, **kw):  # type: ignore[no-untyped-def]
        brought_up.append(kw.get("prefix"))
        raise RuntimeError("no lab in unit tests")

    monkeypatch.setattr(Lab, "up", classmethod(up))
    with pytest.raises(ConformanceError, match="--reuse-lab.*--replace-lab"):
        Session.open("iptables", prefix="kpx-")
    with pytest.raises(ConformanceError, match="invalid lab prefix 'kp'"):  # one-line error, no traceback
        Session.open("iptables", prefix="kp")
    assert brought_up == []
    with pytest.raises(ConformanceError, match="did not come up"):
        Session.open("iptables", prefix="kpx-", replace_lab=True)
    assert brought_up == ["kpx-"]
    live.clear()  # nothing of the lab runs any more: replaced without being asked
    with pytest.raises(ConformanceError, match="did not come up"):
        Session.open("iptables", prefix="kpx-")
    assert brought_up == ["kpx-", "kpx-"]

    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["conformance", "--mode", "iptables", "--replace-lab"])
    assert args.replace_lab and not args.reuse_lab


def test_scenarios_the_lab_cannot_run_are_recorded_as_lab_gaps() -> None:
    """Not-applicable for want of IPv6 (the lab's shape) is a gap the command fails on; a mode's own
    not-applicable scenario is not."""
    from types import SimpleNamespace

    from kproxy.conformance.runner import Session, select

    (dual,) = select(["dual-stack"])
    session = Session("iptables", SimpleNamespace(ipv6=False, state={}))
    result = session.run_scenario(dual)
    assert result.status == NOT_APPLICABLE and "lacks ipv6" in result.detail
    assert session.lab_gaps == ["dual-stack"]
    session.not_applicable["dual-stack"] = "this mode cannot"
    session.lab_gaps.clear()
    result = session.run_scenario(dual)
    assert result.status == NOT_APPLICABLE and result.detail == "iptables: this mode cannot"
    assert session.lab_gaps == []
