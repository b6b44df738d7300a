"""``kproxy bench sync``: the synthetic objects are valid Kubernetes objects that the cache accepts in the right
numbers, and a small ``--mode fake`` run (cache only, no kernel) reports sane figures."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import kubernetes_validate
import pytest

from kproxy.bench import mixed, synthetic
from kproxy.bench.sync import (
    BOUND_SERVICES,
    PARTIAL_RATIO_MAX,
    BenchError,
    SyncBench,
    bound_failures,
    run_sync_bench,
)
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, Protocol


def test_objects_validate_against_the_api_schema() -> None:
    for obj in itertools.chain(synthetic.services(12), synthetic.endpoint_slices(12, 3)):
        kubernetes_validate.validate(obj, "1.32", strict=True)
    kubernetes_validate.validate(synthetic.endpoint_slice(5, 3, variant=2), "1.32", strict=True)


def test_generators_are_lazy_and_deterministic() -> None:
    gen = synthetic.services(10**6 // 20)
    assert not isinstance(gen, list)
    first = next(gen)
    assert first == synthetic.service(1)
    assert first["metadata"] == {
        "name": "svc-00001",
        "namespace": "bench",
        "uid": "00000000-0000-4000-8000-000000000001",
        "resourceVersion": "1",
        "labels": {"app": "svc-00001"},
    }
    assert synthetic.cluster_ip(1) == "198.19.0.1"
    assert synthetic.cluster_ip(10_000) == "198.19.39.16"
    with pytest.raises(ValueError):
        synthetic.cluster_ip(synthetic.MAX_SERVICES + 1)
    ips = {synthetic.endpoint_ip(i, j, 10) for i in range(1, 101) for j in range(10)}
    assert len(ips) == 1000 and all(ip.startswith("198.18.") for ip in ips)
    # The variant moves exactly the last endpoint to an address the service did not have.
    before = [e["addresses"][0] for e in synthetic.endpoint_slice(7, 4)["endpoints"]]
    after = [e["addresses"][0] for e in synthetic.endpoint_slice(7, 4, variant=1)["endpoints"]]
    assert before[:3] == after[:3] and after[3] not in before


def test_cache_takes_them_with_the_right_counts() -> None:
    n, e = 50, 4
    cache = ServiceCache(node_name="node-1", ip_families=(IPFamily.V4,))
    for obj in synthetic.services(n):
        assert cache.upsert_service(obj)
    for obj in synthetic.endpoint_slices(n, e):
        assert cache.upsert_slice(obj)
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, changes = cache.snapshot()
    assert not cache.errors()
    assert changes.full and len(state) == n
    ports = list(state)
    assert all(len(sp.cluster_endpoints) == e for sp in ports)
    assert all(sum(ep.is_local for ep in sp.cluster_endpoints) == e // 2 for sp in ports)  # every other: node-1
    assert sum(sp.protocol is Protocol.UDP for sp in ports) == n // synthetic.UDP_EVERY
    assert {sp.cluster_ip for sp in ports} == {synthetic.cluster_ip(i) for i in range(1, n + 1)}


def _check(doc: dict, services: int, endpoints: int, repeat: int) -> None:
    assert doc["mode"] == "fake"
    assert (doc["services"], doc["endpoints"], doc["repeat"]) == (services, endpoints, repeat)
    for key in ("absorb_s", "snapshot_s", "full_sync_s", "partial_sync_s", "rss_mb"):
        assert doc[key] > 0, key
    assert len(doc["partial_sync_runs"]) == repeat and all(r > 0 for r in doc["partial_sync_runs"])
    assert doc["partial_sync_s"] < doc["full_sync_s"]
    assert doc["snapshot_s"] <= doc["full_sync_s"]
    assert doc["floor_s"] is None and doc["ratio"] is None  # the fake backend has no kernel floor
    assert doc["counts"]["IPv4/services"] + doc["counts"]["IPv6/services"] == services  # the ledger's, typed
    assert doc["partial_writes"] == [1] * repeat  # each partial sync wrote its one changed service
    assert doc["partial_ratio"] == pytest.approx(doc["partial_sync_s"] / doc["full_sync_s"])


def test_fake_run_in_process() -> None:
    _check(run_sync_bench("fake", 200, 5, repeat=3).to_json(), 200, 5, 3)


def test_fake_run_from_the_command_line() -> None:
    argv = [sys.executable, "-m", "kproxy.bench", "bench", "sync", "--mode", "fake", "--services", "200"]
    argv += ["--endpoints", "5", "--repeat", "3", "--format", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _check(json.loads(out.stdout), 200, 5, 3)


def test_bad_sizes_are_one_line_errors() -> None:
    for flag, value, why in (("--endpoints", "5000", "--endpoints: at most 1000"), ("--services", "0", "at least 1")):
        argv = [sys.executable, "-m", "kproxy.bench", "bench", "sync", "--mode", "fake", flag, value]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and why in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_datapath_refuses_bad_arguments_before_building_a_lab() -> None:
    """Usage problems are exit code 2 with a one-line reason, and no lab is built for them (the lab itself is
    exercised by tests/integration/test_bench_compare.py)."""
    base = [sys.executable, "-m", "kproxy.bench", "bench", "datapath"]
    out = subprocess.run(
        [*base, "--mode", "no-such-mode", "--services", "1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "no-such-mode" in out.stderr
    out = subprocess.run([*base, "--mode", "none", "--services", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--services" in out.stderr


def test_mixed_state_is_valid_and_claims_nothing_twice() -> None:
    """The mixed state's objects are valid API objects, every kind is there, and no two services share an address,
    protocol and port (the core would refuse the second: the bench fails on any refusal)."""
    n = 200
    for obj in itertools.chain(mixed.services(40), mixed.endpoint_slices(40, 3)):
        kubernetes_validate.validate(obj, "1.32", strict=True)
    assert {mixed.kind(i) for i in range(1, n + 1)} == {*mixed.KINDS.values(), "clusterip"}
    claims: list[tuple[str, str, int]] = []
    for i in itertools.chain(range(1, n + 1), range(mixed.MAX_SERVICES - n, mixed.MAX_SERVICES + 1)):
        svc = mixed.service(i)
        spec, (port,) = svc["spec"], svc["spec"]["ports"]
        proto = port["protocol"]
        addresses = [spec["clusterIP"], *spec.get("externalIPs", ())]
        addresses += [x["ip"] for x in svc["status"]["loadBalancer"].get("ingress", ())]
        claims += [(a, proto, port["port"]) for a in addresses]
        claims += [("node", proto, port["nodePort"])] if port.get("nodePort") else []
        claims += [("node", "TCP", spec["healthCheckNodePort"])] if spec.get("healthCheckNodePort") else []
        assert (mixed.endpoint_slice(i, 3)["endpoints"] == []) == (not mixed.has_endpoints(i))
    assert len(claims) == len(set(claims))
    assert all(30000 <= p <= 32767 for a, _, p in claims if a == "node")
    with pytest.raises(ValueError):
        mixed.service(mixed.MAX_SERVICES + 1)


def test_fake_run_of_the_mixed_state() -> None:
    doc = run_sync_bench("fake", 120, 4, repeat=3, state_name="mixed").to_json()
    assert doc["state"] == "mixed" and doc["counts"]["IPv4/services"] + doc["counts"]["IPv6/services"] == 120
    assert doc["partial_writes"] == [1, 1, 1]
    with pytest.raises(BenchError, match="--state"):
        run_sync_bench("fake", 10, 1, state_name="no-such-state")
    with pytest.raises(BenchError, match="mixed state"):
        run_sync_bench("fake", mixed.MAX_SERVICES + 1, 1, state_name="mixed")


def test_bounds_of_the_figures() -> None:
    """At BOUND_SERVICES a partial sync near the full one (a backend rewriting its table) fails the run, below it
    only the figure is reported; a restart that wrote anything fails at any size."""
    big = SyncBench("fake", BOUND_SERVICES, 10, 3, full_sync_s=2.0, partial_sync_s=0.2, partial_ratio=0.1)
    (why,) = bound_failures(big)
    assert "0.100" in why and str(PARTIAL_RATIO_MAX) in why
    big.partial_ratio = PARTIAL_RATIO_MAX * 0.99
    assert bound_failures(big) == []
    small = SyncBench("fake", BOUND_SERVICES - 1, 10, 3, partial_ratio=0.9)
    assert bound_failures(small) == []
    small.restart_writes = 3
    assert bound_failures(small) == ["the restarted backend wrote 3 services, though nothing changed"]
    small.restart_writes = 0
    assert bound_failures(small) == []


def test_a_refused_service_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two synthetic services on one external IP and port: the core refuses one, and the figures would leave it
    out, so the run fails loudly instead."""
    monkeypatch.setattr(mixed, "external_ip", lambda i: "198.18.128.1")
    with pytest.raises(BenchError, match=r"full sync: the core refused 3 service port\(s\).*address-conflict"):
        run_sync_bench("fake", 40, 2, repeat=1, state_name="mixed")
