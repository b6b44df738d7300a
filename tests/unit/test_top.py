"""``kproxy top`` and ``kproxy show --service`` against a real metrics server: a daemon running the fake backend
with --service-counters, the counters set as its "kernel" would count them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy import top
from kproxy.cli import main
from kproxy.config import ProxyConfig
from kproxy.counters import Counts, Measure, PortCounters, register
from kproxy.daemon import Daemon
from kproxy.fake import FakeProxier
from kproxy.metrics import Metrics
from kproxy.model import IPFamily, Protocol, ServicePortName
from kproxy.sources.files import FilesSource
from tests.unit.test_daemon import NoConntrack, eventually, programmed, service, slice_, write

A = ServicePortName("demo", "a", "http", Protocol.TCP)
Z = ServicePortName("demo", "z", "http", Protocol.TCP)


@pytest.fixture
def counting(tmp_path: Path) -> Iterator[tuple[Daemon, FakeProxier]]:
    cfg = ProxyConfig(
        hostname_override="node-1",
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
        min_sync_period=0.0,
        sync_period=0.5,
        manifests=str(tmp_path),
        service_counters=True,
        ip_families=(IPFamily.V4,),
    )
    fake = FakeProxier(cfg)
    metrics = Metrics(cfg.ip_families)
    register(metrics.registry, fake, cfg)  # what the daemon's wiring does with --service-counters
    daemon = Daemon(
        cfg,
        fake,
        lambda sink: FilesSource(sink, tmp_path, cfg.node_name, poll_interval=0.1),
        metrics=metrics,
        reconciler=NoConntrack(),  # type: ignore[arg-type]
    )
    write(tmp_path, "a.yaml", service("a", "198.19.0.1"), slice_("a-1", "a", ["198.18.65.10", "198.18.65.11"]))
    write(tmp_path, "z.yaml", service("z", "198.19.0.9"), slice_("z-1", "z", ["198.18.65.19"]))
    daemon.start()
    try:
        eventually(lambda: {"a", "z"} <= set(programmed(fake)))
        fake.set_counters(
            IPFamily.V4,
            A,
            PortCounters.of({"198.18.65.10:8080": Counts(90, 900, 9000), "198.18.65.11:8080": Counts(10, 100, 1000)}),
        )
        fake.set_counters(IPFamily.V4, Z, PortCounters.of({"198.18.65.19:8080": Counts(500, 5, 50)}))
        yield daemon, fake
    finally:
        daemon.stop()


def test_top_once_json(counting: tuple[Daemon, FakeProxier], capsys: pytest.CaptureFixture[str]) -> None:
    daemon, _ = counting
    address = f"127.0.0.1:{daemon.metrics_server.port}"
    assert main(["top", "--metrics-address", address, "--once", "--format", "json", "--interval", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["offered"] == ["bytes", "connections", "packets"] and data["intervalSeconds"] is None
    assert [r["service"] for r in data["services"]] == ["demo/z:http/TCP IPv4", "demo/a:http/TCP IPv4"]  # busiest first
    a = data["services"][1]
    assert (a["connections"], a["bytes"], a["connectionsPerSecond"]) == (100, 10000, None)
    shares = {e["endpoint"]: (e["share"], e["shareVsEven"]) for e in a["endpoints"]}
    assert shares == {"198.18.65.10:8080": (0.9, pytest.approx(1.8)), "198.18.65.11:8080": (0.1, pytest.approx(0.2))}
    assert a["fairness"]["chi2"] == 64 and a["fairness"]["pValue"] < 1e-10
    assert (
        main(["top", "--metrics-address", address, "--once", "--sort", "bytes", "--format", "json", "--interval", "0"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["services"][0]["service"] == "demo/a:http/TCP IPv4"
    assert main(["top", "--metrics-address", address, "--once", "--interval", "0"]) == 0
    table = capsys.readouterr().out
    assert "demo/a:http/TCP IPv4" in table and "90.0% (even 50.0%, x1.80)" in table


def test_show_service_has_the_counters(
    counting: tuple[Daemon, FakeProxier], capsys: pytest.CaptureFixture[str]
) -> None:
    daemon, _ = counting
    address = f"127.0.0.1:{daemon.metrics_server.port}"
    assert main(["show", "--service", "demo/a", "--metrics-bind-address", address, "--format", "json"]) == 0
    counters = json.loads(capsys.readouterr().out)["counters"]
    assert [r["service"] for r in counters["services"]] == ["demo/a:http/TCP IPv4"]
    assert counters["services"][0]["connections"] == 100
    assert main(["show", "--service", "demo/a", "--metrics-bind-address", address]) == 0
    assert "198.18.65.11:8080" in capsys.readouterr().out


def test_top_says_when_counters_are_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ProxyConfig(metrics_bind_address="127.0.0.1:0", healthz_bind_address="127.0.0.1:0", manifests=str(tmp_path))
    daemon = Daemon(cfg, FakeProxier(cfg), lambda sink: FilesSource(sink, tmp_path, "node-1"), reconciler=NoConntrack())  # type: ignore[arg-type]
    daemon.start()
    try:
        address = f"127.0.0.1:{daemon.metrics_server.port}"
        assert main(["top", "--metrics-address", address, "--once", "--interval", "0"]) == 1
        assert "--service-counters" in capsys.readouterr().err
    finally:
        daemon.stop()


def test_rates_between_two_scrapes_and_a_reset() -> None:
    def scrape(at: float, conns: tuple[int, int], nbytes: int) -> top.Scrape:
        sample = top.ServiceSample(
            total={"connections": sum(conns), "bytes": nbytes},
            endpoints={"e1": {"connections": conns[0]}, "e2": {"connections": conns[1]}},
        )
        return top.Scrape(at, frozenset({Measure.CONNECTIONS, Measure.BYTES}), {"demo/a/TCP IPv4": sample})

    (row,) = top.figures(scrape(12.0, (40, 20), 5000), scrape(10.0, (10, 10), 1000))
    assert (row["connectionsPerSecond"], row["bytesPerSecond"]) == (20.0, 2000.0)
    assert [e["share"] for e in row["endpoints"]] == [0.75, 0.25]  # of the rate, not of the totals
    (reset,) = top.figures(scrape(12.0, (4, 2), 500), scrape(10.0, (10, 10), 1000))
    assert reset["connectionsPerSecond"] == 3.0  # went down: re-created, counted from zero
    rendered = top.render([row], frozenset({Measure.CONNECTIONS}), 10)
    assert "n/a" in rendered  # bytes not offered: said so, not 0
