"""The soak's reference model on its own, its packet plan and verdicts, the sweep on real loopback sockets, and the
fault schedule's whole cycles.

The model (kproxy.soak.model) is what the soak's packets are judged against, so it is checked here by hand-built
objects with known answers, and once against kproxy's cache over a long churn: two independent readings of the
same objects must agree (when they do not, one of them is wrong, and the soak would report the difference).
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.model import IPFamily
from kproxy.soak.churn import BAD_SERVICE_PORTS, NAMESPACE, Churn, PodRef, Write
from kproxy.soak.expect import expected_services
from kproxy.soak.model import ANSWER, DROP, REJECT, Expect, build
from kproxy.soak.packets import Target, judge, plan
from kproxy.soak.run import fault_schedule

PODS = [
    PodRef("pod-1-1", "node-1", "198.18.65.11", "fd00:198:18:65::11"),
    PodRef("pod-1-2", "node-1", "198.18.65.12", "fd00:198:18:65::12"),
    PodRef("pod-2-1", "node-2", "198.18.66.11", "fd00:198:18:66::11"),
]
POD_OF = {p.ip4: p.name for p in PODS} | {p.ip6: p.name for p in PODS}
NODE_IPS = {"node-1": {"IPv4": "198.18.0.11", "IPv6": "fd00:198:18::11"}, "node-2": {"IPv4": "198.18.0.12", "IPv6": ""}}
CLIENTS = {"node-1": "pod-1-1", "node-2": "pod-2-1"}


def _service(name: str, *, ports: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    ports = ports or [{"name": "p0", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    base = {"type": "ClusterIP", "clusterIP": "198.19.0.1", "clusterIPs": ["198.19.0.1"], "ports": ports}
    return {"kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {**base, **spec}}


def _slice(service: str, suffix: str, family: str, endpoints: list[tuple[str, bool, str]], ports: Any = None) -> Any:
    return {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-{suffix}",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "ports": ports if ports is not None else [{"name": "p0", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [addr], "conditions": {"ready": ready}, "nodeName": node} for addr, ready, node in endpoints
        ],
    }


def test_ports_families_and_usable_endpoints() -> None:
    ports = [
        {"name": "p0", "port": 80, "targetPort": 8080, "protocol": "TCP"},
        {"name": "u0", "port": 80, "targetPort": 8080, "protocol": "UDP"},
        {"name": "p1", "port": 81, "targetPort": 8081, "protocol": "TCP"},
    ]
    slice_ports = [
        {"name": "p0", "port": 8080, "protocol": "TCP"},
        {"name": "u0", "port": 8080, "protocol": "UDP"},
        {"name": "p1", "port": 8081, "protocol": "TCP"},
    ]
    svc = _service("web", ports=ports, clusterIPs=["198.19.0.1", "fd00:198:18:ffff::1"], ipFamilies=["IPv4", "IPv6"])
    slices = [
        _slice("web", "v4", "IPv4", [("198.18.65.11", True, "node-1"), ("198.18.65.12", False, "node-1")], slice_ports),
        # the same endpoint in a second slice counts once; a bad address is no endpoint and spoils nothing else
        _slice("web", "v4b", "IPv4", [("198.18.65.11", True, "node-1"), ("198.18.65.300", True, "n2")], slice_ports),
        _slice("web", "v6", "IPv6", [("fd00:198:18:66::11", True, "node-2")], slice_ports[:1]),
        # another family's address in a slice, and a slice of another service, are not this family's endpoints
        _slice("web", "mix", "IPv6", [("198.18.66.11", True, "node-2")], slice_ports),
        _slice("other", "v4", "IPv4", [("198.18.66.11", True, "node-2")], slice_ports),
    ]
    m = build([svc], slices, namespace=NAMESPACE)
    assert m.keys("IPv4") == {"soak/web:p0/TCP", "soak/web:u0/UDP", "soak/web:p1/TCP"}
    assert m.keys("IPv6") == m.keys("IPv4")
    p1 = m.ports[("soak/web:p1/TCP", "IPv4")]
    assert p1.cluster_ip == "198.19.0.1" and p1.port == 81 and p1.node_port is None
    assert p1.cluster_ip_expect("node-2") == Expect(ANSWER, frozenset({("198.18.65.11", 8081)}))
    udp6 = m.ports[("soak/web:u0/UDP", "IPv6")]
    assert udp6.cluster_ip == "fd00:198:18:ffff::1" and udp6.cluster_ip_expect("node-1") == Expect(REJECT)
    tcp6 = m.ports[("soak/web:p0/TCP", "IPv6")]
    assert tcp6.cluster_ip_expect("node-1") == Expect(ANSWER, frozenset({("fd00:198:18:66::11", 8080)}))


def test_local_policy_no_endpoints_and_node_ports() -> None:
    svc = _service("np", type="NodePort", internalTrafficPolicy="Local", externalTrafficPolicy="Cluster")
    svc["spec"]["ports"][0]["nodePort"] = 30080
    only_node2 = [_slice("np", "v4", "IPv4", [("198.18.66.11", True, "node-2")])]
    pm = build([svc], only_node2).ports[("soak/np:p0/TCP", "IPv4")]
    assert pm.cluster_ip_expect("node-1") == Expect(DROP)  # local policy, endpoints elsewhere only
    assert pm.cluster_ip_expect("node-2") == Expect(ANSWER, frozenset({("198.18.66.11", 8080)}))
    assert pm.node_port == 30080 and pm.node_port_expect() == Expect(ANSWER, frozenset({("198.18.66.11", 8080)}))
    not_ready = [_slice("np", "v4", "IPv4", [("198.18.66.11", False, "node-2")])]
    pm = build([svc], not_ready).ports[("soak/np:p0/TCP", "IPv4")]
    assert pm.cluster_ip_expect("node-1") == pm.cluster_ip_expect("node-2") == pm.node_port_expect() == Expect(REJECT)


def test_bad_services_are_rejected_and_what_is_outside_is_not_judged() -> None:
    services = [_service(f"bad{i}", ports=[copy.deepcopy(p)]) for i, p in enumerate(BAD_SERVICE_PORTS)]
    services.append(_service("two", ports=[{"port": 80, "protocol": "TCP"}, {"port": 81, "protocol": "TCP"}]))
    services.append(_service("lb", type="LoadBalancer"))
    services.append(_service("local", type="NodePort", externalTrafficPolicy="Local"))
    services.append(_service("unallocated", type="NodePort"))
    services.append({**_service("elsewhere"), "metadata": {"name": "elsewhere", "namespace": "default"}})
    m = build(services, [], namespace=NAMESPACE)
    assert set(m.rejected) == {f"soak/bad{i}" for i in range(len(BAD_SERVICE_PORTS))} | {"soak/two"}
    assert set(m.outside) == {"soak/lb", "soak/local", "soak/unallocated"}
    assert not m.ports
    assert m.cluster_ips["soak/bad0"] == ["198.19.0.1"]  # its address is tried: nothing may answer there


def _api_after(writes: list[Write]) -> dict[tuple[str, str], dict[str, Any]]:
    """What a store that took every write holds, with ClusterIPs and NodePorts allocated as the API would."""
    held: dict[tuple[str, str], dict[str, Any]] = {}
    seq = 10
    for w in writes:
        key = (w.kind, w.name)
        if w.verb == "delete":
            held.pop(key, None)
            continue
        obj = copy.deepcopy(w.obj)
        if w.kind == "Service":
            old = held.get(key)
            seq += 1
            ips = old["spec"]["clusterIPs"] if old else [f"198.19.128.{seq}", f"fd00:198:18:ffff::{seq:x}"]
            obj["spec"]["clusterIPs"] = ips[: len(obj["spec"]["ipFamilies"])]
            obj["spec"]["clusterIP"] = ips[0]
            if obj["spec"]["type"] == "NodePort":
                for i, p in enumerate(obj["spec"]["ports"]):
                    p["nodePort"] = 30000 + seq * 4 + i
        held[key] = obj
    return held


def test_the_model_and_kproxys_cache_agree_over_a_long_churn() -> None:
    churn = Churn(PODS, seed=3, max_services=16)
    writes = churn.anchor() + churn.initial(10)
    compared = 0
    for step in range(300):
        writes += churn.step()
        if step % 10:
            continue
        held = _api_after(writes)
        services = [o for (k, _), o in held.items() if k == "Service"]
        slices = [o for (k, _), o in held.items() if k == "EndpointSlice"]
        model = build(services, slices, namespace=NAMESPACE)
        assert not model.outside
        for node in ("node-1", "node-2"):
            cache, rejected = expected_services(node, services, slices, None, (IPFamily.V4, IPFamily.V6))
            assert {k.split(" ")[-1] for k in rejected if k.startswith("Service")} == set(model.rejected)
            for fam in ("IPv4", "IPv6"):
                assert model.keys(fam) == {k for k, fams in cache.items() if fam in fams}
            for (key, fam), pm in model.ports.items():
                want = cache[key][fam]
                e = pm.cluster_ip_expect(node)
                assert {ANSWER: "forward"}.get(e.outcome, e.outcome) == want["internal"], (key, fam, node)
                eps = sorted(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in e.endpoints)
                assert eps == sorted(want["internalEndpoints"]), (key, fam, node)
                assert (pm.node_port or 0) == (want["nodePort"] or 0), key
                if pm.node_port:
                    ext = pm.node_port_expect()
                    assert {ANSWER: "forward"}.get(ext.outcome, ext.outcome) == want["external"], key
                compared += 1
    assert compared > 1000
    assert {w.step for w in writes} >= {"udp_flip", "port_flip", "type_flip", "policy_flip", "bad_object"}


def _dual_node_port() -> Any:
    ports = [
        {"name": "p0", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30001},
        {"name": "u0", "port": 80, "targetPort": 8080, "protocol": "UDP", "nodePort": 30002},
        {"name": "p1", "port": 81, "targetPort": 8081, "protocol": "TCP", "nodePort": 30003},
    ]
    svc = _service("np", ports=ports, type="NodePort", clusterIPs=["198.19.0.1", "fd00:198:18:ffff::1"])
    sp = [{"name": n, "port": p, "protocol": pr} for n, p, pr in (("p0", 8080, "TCP"), ("u0", 8080, "UDP"))]
    sp.append({"name": "p1", "port": 8081, "protocol": "TCP"})
    slices = [
        _slice("np", "v4", "IPv4", [("198.18.65.12", True, "node-1")], sp),
        _slice("np", "v6", "IPv6", [("fd00:198:18:66::11", True, "node-2")], sp),
    ]
    return build([svc, _service("gone", clusterIPs=["198.19.0.9"])], slices)


def test_the_plan_tries_every_port_family_and_address_from_every_node() -> None:
    model = _dual_node_port()
    targets = plan(model, ["soak/np"], CLIENTS, NODE_IPS, absent={"soak/old": ["198.19.0.7"]})
    # 3 ports x 2 clients x (ClusterIP + the NodePort of every node with an address of the family): 2 + 1 there
    v4 = [t for t in targets if t.host in ("198.19.0.1", "198.18.0.11", "198.18.0.12")]
    v6 = [t for t in targets if t.host in ("fd00:198:18:ffff::1", "fd00:198:18::11")]
    assert len(v4) == 3 * 2 * 3 and len(v6) == 3 * 2 * 2
    assert {(t.proto, t.port) for t in targets if t.host == "198.18.0.12"} == {
        ("tcp", 30001),
        ("udp", 30002),
        ("tcp", 30003),
    }
    assert {t.client for t in targets} == {"pod-1-1", "pod-2-1"}
    removed = [t for t in targets if t.expect is None]
    assert [(t.host, t.port, t.client) for t in removed] == [("198.19.0.7", 80, "pod-1-1")]
    assert len({t.id for t in targets}) == len(targets)
    assert all(t.attempts == 3 for t in targets if t.expect and t.expect.outcome == ANSWER)


def _t(expect: Expect | None, proto: str = "tcp") -> Target:
    return Target("t0", "pod-1-1", proto, "198.19.0.1", 81, "soak/np:p1/TCP IPv4 ClusterIP", expect, 2, 1.0)


def _ok(pod: str, port: int) -> dict[str, Any]:
    return {"ok": True, "reply": f"{pod} 198.18.65.11 40000 port={port} proto=tcp", "error": ""}


def _err(word: str) -> dict[str, Any]:
    return {"ok": False, "reply": "", "error": word}


def test_verdicts_name_what_was_sent_and_what_came_back() -> None:
    answer = Expect(ANSWER, frozenset({("198.18.65.12", 8081)}))
    assert judge(_t(answer), [_ok("pod-1-2", 8081)] * 2, POD_OF) is None
    verdict = judge(_t(answer), [_ok("pod-1-2", 8081), _ok("pod-2-1", 8081)], POD_OF)
    assert verdict is not None and verdict[0] == "wrong"
    assert "198.19.0.1:81 from pod-1-1" in verdict[1] and "pod-2-1:8081" in verdict[1] and "pod-1-2:8081" in verdict[1]
    assert judge(_t(answer), [_ok("pod-1-2", 8080)] * 2, POD_OF) == (  # the right pod, the wrong target port
        "wrong",
        "soak/np:p1/TCP IPv4 ClusterIP: 2 tcp to 198.19.0.1:81 from pod-1-1: got pod-1-2:8080, pod-1-2:8080,"
        " want one of pod-1-2:8081",
    )
    lost = judge(_t(answer), [_ok("pod-1-2", 8081), _err("timeout")], POD_OF)
    assert lost is not None and lost[0] == "lost" and "timeout" in lost[1]
    assert judge(_t(answer), None, POD_OF) is not None  # no result at all is never a pass
    assert judge(_t(Expect(REJECT)), [_err("refused")], POD_OF) is None
    assert judge(_t(Expect(REJECT)), [_err("timeout")], POD_OF) == (
        "wrong",
        "soak/np:p1/TCP IPv4 ClusterIP: 1 tcp to 198.19.0.1:81 from pod-1-1: got timeout, want rejected (refused)",
    )
    assert judge(_t(Expect(REJECT)), [_ok("pod-1-2", 8081)], POD_OF) is not None
    assert judge(_t(Expect(DROP)), [_err("timeout")], POD_OF) is None
    assert judge(_t(Expect(DROP)), [_err("refused")], POD_OF) is not None
    assert judge(_t(None), [_err("timeout")], POD_OF) is None and judge(_t(None), [_err("refused")], POD_OF) is None
    gone = judge(_t(None), [_ok("pod-1-2", 8080)], POD_OF)
    assert gone is not None and gone[0] == "wrong" and "gone" in gone[1]
    # an unconnected UDP socket's answer from the pod itself (the source not translated back) is wrong
    udp = _t(answer, "udp")
    assert judge(udp, [_ok("pod-1-2", 8081), {**_ok("pod-1-2", 8081), "source": "198.19.0.1:81"}], POD_OF) is None
    stray = judge(udp, [_ok("pod-1-2", 8081), {**_ok("pod-1-2", 8081), "source": "198.18.65.12:8081"}], POD_OF)
    assert stray is not None and stray[0] == "wrong" and "answered from 198.18.65.12:8081" in stray[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def echo() -> Iterator[int]:
    """kproxy.lab.echo (the lab pods' server) on a free loopback port, TCP and UDP."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        argv = [sys.executable, "-m", "kproxy.lab.echo", "--name", "pod-x", "--ports", str(port), "--no-ipv6"]
        proc = subprocess.Popen([*argv, "--ready-file", str(ready)])
        try:
            deadline = time.monotonic() + 20
            while not ready.exists():  # the server creates it once bound
                assert proc.poll() is None and time.monotonic() < deadline, "the echo server did not come up"
                time.sleep(0.02)
            yield port
        finally:
            proc.terminate()
            proc.wait(10)


def test_the_sweep_sends_real_packets_and_the_verdicts_follow(echo: int) -> None:
    closed = _free_port()
    answer = Expect(ANSWER, frozenset({("127.0.0.1", echo)}))
    targets = [
        Target("a", "c", "tcp", "127.0.0.1", echo, "tcp echo", answer, 3, 2.0),
        Target("b", "c", "udp", "127.0.0.1", echo, "udp echo", answer, 3, 2.0),
        Target("c", "c", "tcp", "127.0.0.1", closed, "tcp closed", Expect(REJECT), 1, 2.0),
        Target("d", "c", "udp", "127.0.0.1", closed, "udp closed", Expect(REJECT), 1, 2.0),
        Target("e", "c", "tcp", "127.0.0.1", closed, "tcp closed, want an answer", answer, 1, 2.0),
    ]
    request = json.dumps({"workers": 4, "targets": [t.request() for t in targets]})
    proc = subprocess.run(
        [sys.executable, "-m", "kproxy.soak.sweep"], input=request.encode(), capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert sorted(results) == ["a", "b", "c", "d", "e"] and len(results["a"]) == len(results["b"]) == 3
    pods = {"127.0.0.1": "pod-x"}
    assert [judge(t, results[t.id], pods) for t in targets[:4]] == [None] * 4
    assert results["a"][0]["reply"].startswith("pod-x 127.0.0.1 ") and f"port={echo}" in results["a"][0]["reply"]
    # the second UDP attempt went from an unconnected socket and says where its answer came from
    assert [r.get("source") for r in results["b"]] == [None, f"127.0.0.1:{echo}", None]
    verdict = judge(targets[4], results["e"], pods)
    assert verdict is not None and verdict[0] == "lost" and "refused" in verdict[1]


def test_the_fault_schedule_runs_whole_cycles_only() -> None:
    kinds = ("none", "flush", "kproxy_kill")
    assert list(fault_schedule(kinds, lambda: True)) == list(kinds)  # time already up: still one whole cycle
    assert list(fault_schedule(kinds, lambda: True, cycles=2)) == list(kinds) * 2
    calls = iter([False, False, True])
    assert list(fault_schedule(kinds, lambda: next(calls))) == list(kinds) * 3
    assert list(fault_schedule(kinds, lambda: False, stop=lambda: True)) == list(kinds)


def test_writes_name_their_service() -> None:
    churn = Churn(PODS, seed=2, min_services=0)
    writes = churn.initial(2)
    while len(churn.bad) < 4:
        writes += churn._bad_object()
    for _ in range(40):
        writes += churn.step()
    names = set(churn.services) | {n for _, n in churn.bad}
    for w in writes:
        assert w.service == (w.name if w.kind == "Service" else w.obj["metadata"]["name"].rsplit("-", 1)[0])
        if w.kind == "EndpointSlice" and w.verb == "put":
            assert w.service == w.obj["metadata"]["labels"]["kubernetes.io/service-name"]
    assert names <= {w.service for w in writes}


def test_cycles_and_sample_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy.soak import run

    monkeypatch.setattr(run, "_modes", lambda: ["x"])
    for bad in (run.SoakOptions(mode="x", cycles=-1), run.SoakOptions(mode="x", cycles=run.MAX_CYCLES + 1)):
        with pytest.raises(run.SoakError, match="--cycles"):
            run.Soak(bad)
    with pytest.raises(run.SoakError, match="--sample"):
        run.Soak(run.SoakOptions(mode="x", sample=0))


def test_the_model_is_independent_of_kproxy() -> None:
    """The model must not borrow kproxy's reading of the objects (the cache, topology, the service-port code)."""
    import ast

    import kproxy.soak.model as model_module

    tree = ast.parse(Path(model_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported and not {m for m in imported if m.split(".")[0] == "kproxy"}, imported
