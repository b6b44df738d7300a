"""``kproxy bench sync``: the synthetic objects are valid Kubernetes objects that the cache accepts in the right
numbers, and a small ``--mode fake`` run (cache only, no kernel) reports sane figures."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import kubernetes_validate
import pytest

from kproxy.bench import synthetic
from kproxy.bench.sync import run_sync_bench
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
        synthetic.cluster_ip(70_000)
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
    assert doc["counts"] == {"services": services}


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
