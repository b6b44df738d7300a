"""The scale run's parts that need no lab (kproxy.bench.apiscale, kproxy.bench.apiscale_probe): its objects are
valid API objects the stand-in takes in bulk, the histogram quantiles, the list phase read from the stand-in's
request log, and the sweep against real echo servers on loopback (no root)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import kubernetes
import kubernetes_validate
import pytest

from kproxy.bench import apiscale, apiscale_probe, synthetic
from kproxy.lab.apiserver import ApiServer, serve
from kproxy.lab.cluster import LabPod
from kproxy.sources.kube import KubeSource
from kproxy.sources.recording import RecordingSink

PODS = [
    LabPod(f"pod-{n}-{j}", f"kpa-n{n}-p{j}", f"node-{n}", f"198.18.{64 + n}.{10 + j}", "")
    for n in (1, 2)
    for j in (1, 2, 3)
]


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)], history=100_000)
    try:
        yield server
    finally:
        server.close()


def test_objects_are_valid_and_the_churn_moves_one_endpoint_to_another_pod() -> None:
    cfg = apiscale.ScaleConfig(mode="nftables", services=40, endpoints=4, ports_every=10)
    objs = list(apiscale.objects(cfg, PODS))
    assert len(objs) == 80
    for obj in objs[:6]:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    svc, eps = objs[18], objs[19]  # service 10: three ports
    assert [p["port"] for p in svc["spec"]["ports"]] == [80, 443, 9090]
    assert [p["port"] for p in eps["ports"]] == [8080, 8443, 9090]
    before = [e["addresses"][0] for e in eps["endpoints"]]
    moved = apiscale.endpoint_slice(10, cfg, PODS, variant=3, trigger=1_700_000_000.25)
    kubernetes_validate.validate(moved, "1.32", strict=True)
    after = [e["addresses"][0] for e in moved["endpoints"]]
    assert after[:3] == before[:3] and after[3] not in before and len(set(after)) == 4
    stamp = moved["metadata"]["annotations"]["endpoints.kubernetes.io/last-change-trigger-time"]
    assert stamp == "2023-11-14T22:13:20.250000Z"
    assert synthetic.service_ports(40, ports_every=10) == 48


def test_quantiles_interpolate_within_buckets_as_histogram_quantile() -> None:
    cumulative = {0.0: 0.0, 0.25: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert apiscale.quantile(0.5, cumulative) == pytest.approx(0.25)
    assert apiscale.quantile(0.7, cumulative) == pytest.approx(0.375)
    assert apiscale.quantile(0.99, cumulative) == pytest.approx(0.95)
    assert apiscale.quantile(0.5, {0.25: 0.0, float("inf"): 0.0}) is None


def test_one_sync_counts_once_though_kproxy_observes_it_for_each_family() -> None:
    """kproxy observes every sync (and its phases) once per configured family: the report reads the IPv4 series
    (the scale lab's family), not their sum, which counted each full sync twice."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kproxy.metrics import Metrics
    from kproxy.model import IPFamily

    m = Metrics((IPFamily.V4, IPFamily.V6))
    for fam in (IPFamily.V4, IPFamily.V6):
        m.observe_sync(fam, 9.5, full=True)
        m.observe_phases(fam, [("render", 1.5), ("apply", 8.0)])
    parsed: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for sample in family.samples:
            parsed.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    got = apiscale.sync_phases(parsed)
    assert got["full_syncs"] == {"count": 1.0, "sum_s": 9.5}
    assert got["phases"] == {"apply": {"count": 1.0, "sum_s": 8.0}, "render": {"count": 1.0, "sum_s": 1.5}}


def test_the_lists_absorbed_moment_is_the_last_sync_queued_for_the_lab_family() -> None:
    """The report's ``absorbed_s``: kproxy's last-queued gauge of the IPv4 family (the other family's unset gauge
    is 0), in seconds after kproxy's start; None before anything was queued."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kproxy.metrics import Metrics
    from kproxy.model import IPFamily

    m = Metrics((IPFamily.V4, IPFamily.V6))

    def parsed() -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        return out

    assert apiscale.queued_at(parsed(), 1000.0) is None
    m.set_last_queued(IPFamily.V4, 1012.5)
    assert apiscale.queued_at(parsed(), 1000.0) == 12.5


def test_bulk_load_then_kproxy_lists_in_pages_and_the_log_shows_them(api: ApiServer) -> None:
    cfg = apiscale.ScaleConfig(mode="nftables", services=700, endpoints=3, ports_every=7)
    cfgc = kubernetes.client.Configuration()
    cfgc.host = api.url
    with kubernetes.client.ApiClient(cfgc) as client:
        apiscale.load(client, api.url, cfg, PODS)
        sink = RecordingSink()
        start = api.requests[-1].time if api.requests else 0.0
        source = KubeSource(sink, client, "node-1", resync_backoff=(0.05, 0.4), watch_timeout=3)
        try:
            source.start()
            assert source.wait_synced(30)
        finally:
            source.stop()
        assert len(sink.services) == 700 and len(sink.slices) == 700
        phase = apiscale.list_phase(apiscale.requests_log(client, api.url), "127.0.0.1", start)
        assert phase["pages"] == 4  # 2 pages of services and 2 of slices (pages of 500)
        with pytest.raises(RuntimeError, match="refused"):
            apiscale.bulk(client, api.url, [apiscale.service(1, cfg)])  # exists already: 409 in the failures


def echo_server() -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def serve_forever() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                if conn.recv(100):
                    conn.sendall(b"pod-1-1 127.0.0.1 1\n")

    thread = threading.Thread(target=serve_forever, daemon=True)
    thread.start()
    return srv, thread


def test_the_sweep_reports_who_answered_and_why_not() -> None:
    srv, thread = echo_server()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port, dead = srv.getsockname()[1], closed.getsockname()[1]
        out = asyncio.run(apiscale_probe.sweep([("127.0.0.1", port), ("127.0.0.1", dead)], 1.0, 0.1, 0.5, 8))
    finally:
        srv.close()
        closed.close()
        thread.join(5)
    answered = out["answered"]
    assert isinstance(answered, dict) and list(answered) == [f"127.0.0.1:{port}"]
    assert isinstance(out["errors"], dict) and out["errors"].get("refused", 0) >= 2
    assert isinstance(out["rounds"], int) and 2 <= out["rounds"] <= 11
    json.dumps(out)
