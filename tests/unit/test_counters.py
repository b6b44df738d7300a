"""Per-service traffic counters without a kernel: the dump type, the opt-in switch, the metric families the collector
renders from the fake's dump (parsed back with prometheus-client's own parser), and the chi-square test."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import ConfigError, ProxyConfig, build_config, load_config_file, to_kube_proxy_configuration
from kproxy.counters import ALL_MEASURES, Counts, Measure, PortCounters, metric_name, register
from kproxy.fairness import chi2_sf, fairness, gamma_q
from kproxy.fake import FakeProxier
from kproxy.metrics import Metrics
from kproxy.model import IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.proxier import Proxier

A = ServicePortName("demo", "a", "http", Protocol.TCP)
B = ServicePortName("demo", "b", "", Protocol.UDP)
ON = ProxyConfig(service_counters=True, ip_families=(IPFamily.V4, IPFamily.V6))


def program(fake: FakeProxier, family: IPFamily, *names: ServicePortName) -> None:
    with fake.lock:
        for spn in names:
            fake.programmed[(family.value, spn)] = ServicePort(spn, family, "198.19.0.1", 80)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def labels(spn: ServicePortName, family: str, endpoint: str | None = None) -> tuple[tuple[str, str], ...]:
    out = {"namespace": spn.namespace, "service": spn.name, "port": spn.port, "protocol": spn.protocol.value}
    out["family"] = family
    if endpoint is not None:
        out["endpoint"] = endpoint
    return tuple(sorted(out.items()))


def test_port_counters_by_columns() -> None:
    pc = PortCounters.of({"10.0.0.1:80": Counts(3, 30, 3000), "10.0.0.2:80": Counts(1, 10, 1000)})
    assert pc.total == Counts(4, 40, 4000)
    assert pc.endpoints == ("10.0.0.1:80", "10.0.0.2:80") and pc.bytes == (3000, 1000)
    assert pc.per_endpoint()["10.0.0.2:80"] == Counts(1, 10, 1000)
    # a measure one endpoint lacks is no column at all: None, never a false 0
    partial = PortCounters.of({"10.0.0.1:80": Counts(3, 30, None), "10.0.0.2:80": Counts(1, 10, 5)})
    assert partial.bytes is None and partial.total.bytes is None and partial.total.packets == 40
    assert PortCounters.of({"10.0.0.1:80": Counts(2)}).total == Counts(2, None, None)
    with pytest.raises(ValueError, match="2 connections values for 1 endpoints"):
        PortCounters(Counts(0), ("10.0.0.1:80",), (1, 2))


def test_the_switch_is_off_by_default_and_set_by_file_or_flag(tmp_path: Path) -> None:
    assert ProxyConfig().service_counters is False
    assert Proxier.counters_offered == frozenset()
    conf = tmp_path / "c.yaml"
    conf.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nserviceCounters: true\n"
    )
    cfg = build_config(load_config_file(conf), {})
    assert cfg.service_counters is True and to_kube_proxy_configuration(cfg)["serviceCounters"] is True
    assert build_config(load_config_file(conf), {"service_counters": False}).service_counters is False
    conf.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nserviceCounters: 3\n")
    with pytest.raises(ConfigError, match="serviceCounters"):
        build_config(load_config_file(conf), {})
    from kproxy.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--service-counters"])
    assert config_from_args(args).service_counters is True
    assert config_from_args(build_parser().parse_args(["run"])).service_counters is False


def test_off_registers_nothing() -> None:
    m = Metrics((IPFamily.V4,))
    assert register(m.registry, FakeProxier(), ProxyConfig()) is None
    assert b"kproxy_service_counters_offered" not in m.exposition()


def test_families_from_the_fake_dump() -> None:
    fake = FakeProxier(ON)
    program(fake, IPFamily.V4, A, B)
    program(fake, IPFamily.V6, A)
    fake.set_counters(
        IPFamily.V4, A, PortCounters.of({"10.0.0.1:8080": Counts(7, 70, 7000), "10.0.0.2:8080": Counts(3, 30, 3000)})
    )
    fake.set_counters(IPFamily.V4, B, PortCounters(Counts(5, 9, 900), ("10.0.0.3:53",), (4,), (8,), (800,)))
    fake.set_counters(IPFamily.V6, A, PortCounters.of({"[fd00::1]:8080": Counts(2, 20, 2000)}))
    m = Metrics((IPFamily.V4, IPFamily.V6))
    register(m.registry, fake, ON)
    got = samples(m.exposition().decode())
    svc_conn, ep_conn = metric_name(Measure.CONNECTIONS), metric_name(Measure.CONNECTIONS, endpoint=True)
    assert got[(svc_conn, labels(A, "IPv4"))] == 10
    assert got[(svc_conn, labels(B, "IPv4"))] == 5  # the service's own count, beyond its endpoints' 4
    assert got[(svc_conn, labels(A, "IPv6"))] == 2
    assert got[(ep_conn, labels(A, "IPv4", "10.0.0.1:8080"))] == 7
    assert got[(ep_conn, labels(A, "IPv6", "[fd00::1]:8080"))] == 2
    assert got[(metric_name(Measure.BYTES), labels(A, "IPv4"))] == 10000  # packets and bytes per service port
    assert got[(metric_name(Measure.PACKETS), labels(B, "IPv4"))] == 9
    assert not [k for k in got if k[0] in (metric_name(m, endpoint=True) for m in (Measure.PACKETS, Measure.BYTES))]
    for measure in Measure:
        assert got[("kproxy_service_counters_offered", (("measure", measure.value),))] == 1
    # the registry's collect() (what any other reader sees) says the same, and so do the ordinary metrics
    assert m.value(svc_conn, dict(labels(A, "IPv4"))) == 10
    assert m.value("kproxy_drift_services") == -1
    # a service the mode no longer programs: its counters go with it
    with fake.lock:
        del fake.programmed[("IPv4", A)]
    got = samples(m.exposition().decode())
    assert (svc_conn, labels(A, "IPv4")) not in got and (svc_conn, labels(A, "IPv6")) in got


class ConnectionsOnly(FakeProxier):
    counters_offered: ClassVar[frozenset[Measure]] = frozenset({Measure.CONNECTIONS})


def test_a_measure_not_offered_has_no_family_and_odd_names_are_escaped() -> None:
    fake = ConnectionsOnly(ON)
    odd = ServicePortName('we"ird', "x\\y", "p{1}", Protocol.SCTP)
    program(fake, IPFamily.V4, odd)
    fake.set_counters(IPFamily.V4, odd, PortCounters.of({"10.0.0.1:1": Counts(1, 5, 50)}))
    registry = CollectorRegistry()  # any prometheus-client registry: an ordinary collector there
    register(registry, fake, ON)
    names = {f.name for f in registry.collect()}
    assert "kproxy_service_connections" in names and "kproxy_endpoint_connections" in names
    assert not {n for n in names if "bytes" in n or "packets" in n}
    assert registry.get_sample_value("kproxy_service_counters_offered", {"measure": "bytes"}) == 0
    assert (
        registry.get_sample_value(
            "kproxy_endpoint_connections_total", {**dict(labels(odd, "IPv4")), "endpoint": "10.0.0.1:1"}
        )
        == 1
    )


def test_a_scrape_at_10k_services_of_10_endpoints_renders_every_sample() -> None:
    """The budget's shape (docs/PERFORMANCE.md has the time and memory): every sample, once, parseable."""
    fake = FakeProxier(ON)
    for s in range(10_000):
        spn = ServicePortName("ns", f"svc-{s}", "http", Protocol.TCP)
        fake.programmed[("IPv4", spn)] = None  # type: ignore[assignment]  # only membership counts here
        eps = {f"10.{s // 256}.{s % 256}.{e}:8080": Counts(s + e, 10 * (s + e), 1000 * (s + e)) for e in range(10)}
        fake.set_counters(IPFamily.V4, spn, PortCounters.of(eps))
    m = Metrics((IPFamily.V4,))
    register(m.registry, fake, ProxyConfig(service_counters=True, ip_families=(IPFamily.V4,)))
    text = m.exposition().decode()
    assert text.count("\nkproxy_endpoint_connections_total{") == 100_000
    assert text.count("\nkproxy_service_connections_total{") == 10_000
    assert text.count("\nkproxy_service_bytes_total{") == 10_000 and "kproxy_endpoint_bytes_total" not in text
    assert (
        'kproxy_endpoint_connections_total{namespace="ns",service="svc-9999",port="http",protocol="TCP",'
        'family="IPv4",endpoint="10.39.15.9:8080"} 10008\n' in text
    )
    assert text == m.exposition().decode()  # the second scrape reuses the formats: the same text


@pytest.mark.parametrize(
    ("x", "dof", "p"),
    [  # chi-square table: critical values at the upper-tail probability p
        (3.841, 1, 0.05),
        (6.635, 1, 0.01),
        (10.828, 1, 0.001),
        (5.991, 2, 0.05),
        (11.070, 5, 0.05),
        (18.307, 10, 0.05),
        (23.209, 10, 0.01),
        (9.342, 10, 0.5),
        (43.773, 30, 0.05),
        (149.449, 100, 0.001),
    ],
)
def test_chi2_survival_matches_the_table(x: float, dof: int, p: float) -> None:
    assert chi2_sf(x, dof) == pytest.approx(p, rel=2e-3)


def test_gamma_and_fairness_edges() -> None:
    assert gamma_q(1.0, 2.0) == pytest.approx(math.exp(-2.0), rel=1e-12)  # Q(1, x) = e^-x
    assert chi2_sf(0.0, 4) == 1.0 and chi2_sf(1e6, 4) == pytest.approx(0.0, abs=1e-300)
    with pytest.raises(ValueError):
        chi2_sf(1.0, 0)
    even = fairness([250, 250, 250, 250])
    assert even is not None and even.chi2 == 0 and even.p_value == 1.0 and even.ratio == 1.0
    skew = fairness({"a": 900, "b": 100})
    assert skew is not None and skew.chi2 == 640 and skew.p_value < 1e-100
    assert (skew.max_share, skew.min_share, skew.ratio) == (0.9, 0.1, pytest.approx(9.0))
    assert fairness([5]) is None and fairness([0, 0]) is None
    assert fairness([3, 0]).as_dict()["maxMinRatio"] is None  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        fairness([1, -1])


def test_fake_offers_every_measure() -> None:
    assert FakeProxier.counters_offered == ALL_MEASURES


def test_a_slow_text_is_made_in_the_background_and_a_scrape_never_waits() -> None:
    """iptables reads its counters with a save of the nat table (seconds at 10,000 services): once making the text
    took the scrape budget or more, a scrape serves the last text while the next is made in the background, one at
    a time; the first scrape makes its own."""
    import threading

    from kproxy.counters import SCRAPE_BUDGET_S, CounterCollector, CounterDump

    release, asked = threading.Event(), threading.Event()
    reads: list[int] = []
    a = ServicePortName("ns", "a", "http", Protocol.TCP)

    class Slow:
        counters_offered = frozenset({Measure.CONNECTIONS})

        def counters(self, family: IPFamily) -> CounterDump:
            reads.append(1)
            if len(reads) > 1:
                asked.set()
                assert release.wait(30)
            return CounterDump(family, {a: PortCounters(Counts(len(reads)), ("10.0.0.1:80",), (len(reads),))})

    def total(text: bytes) -> float:
        return samples(text.decode())[(metric_name(Measure.CONNECTIONS), labels(a, "IPv4"))]

    c = CounterCollector(Slow(), (IPFamily.V4,))
    assert total(c.exposition()) == 1  # the first text: made at the scrape
    c._took = SCRAPE_BUDGET_S  # that took the whole budget
    assert total(c.exposition()) == 1  # the last text, at once, while the next read waits on ``release``
    assert asked.wait(30) and total(c.exposition()) == 1 and len(reads) == 2  # one background making at a time
    release.set()
    c.settle()
    assert c._text is not None and total(b"".join(c._text)) == 2  # made in the background: the next one served


def test_a_text_copies_a_ports_lines_only_while_its_counters_are_the_same_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nftables mode hands back the same ``PortCounters`` object for a port whose counts did not change, and
    the next text copies that port's bytes from the last one, unformatted; a new object (new counts, or new
    endpoints) is formatted again."""
    from kproxy import counters
    from kproxy.counters import CounterCollector, CounterDump

    spn = ServicePortName("ns", "web", "http", Protocol.TCP)
    other = ServicePortName("ns", "db", "sql", Protocol.TCP)
    current: dict[str, PortCounters] = {}
    formatted: list[ServicePortName] = []
    real = counters._formats

    def counting(family: IPFamily, name: ServicePortName, endpoints: tuple[str, ...]) -> Any:
        formatted.append(name)
        return real(family, name, endpoints)

    monkeypatch.setattr(counters, "_formats", counting)

    class Source:
        counters_offered = frozenset({Measure.CONNECTIONS, Measure.PACKETS})

        def counters(self, family: IPFamily) -> CounterDump:
            return CounterDump(family, {spn: current["pc"], other: current["other"]})

    def value(text: str, name: ServicePortName, endpoint: str | None) -> float:
        key = (metric_name(Measure.CONNECTIONS, endpoint is not None), labels(name, "IPv4", endpoint))
        return samples(text)[key]

    c = CounterCollector(Source(), (IPFamily.V4,))
    current["pc"] = PortCounters(Counts(3, 30), ("10.0.0.1:80", "10.0.0.2:80"), (1, 2))
    current["other"] = PortCounters(Counts(5, 50), ("10.0.1.1:5432",), (5,))
    first = c.exposition().decode()
    assert value(first, spn, None) == 3 and value(first, spn, "10.0.0.2:80") == 2 and formatted == [spn, other]
    assert c.exposition().decode() == first and formatted == [spn, other]  # both copied from the last text
    current["pc"] = PortCounters(Counts(7, 70), ("10.0.0.1:80", "10.0.0.2:80"), (3, 4))  # new counts: new object
    second = c.exposition().decode()
    assert formatted == [spn, other, spn]  # only the changed port formatted; the other copied, at its new place
    assert value(second, spn, None) == 7 and value(second, spn, "10.0.0.1:80") == 3 and value(second, other, None) == 5
    current["pc"] = PortCounters(Counts(7, 70), ("10.0.0.3:80",), (7,))  # new endpoints
    third = c.exposition().decode()
    assert value(third, spn, "10.0.0.3:80") == 7 and "10.0.0.1:80" not in third and value(third, other, None) == 5
    assert third.count("kproxy_service_packets_total{") == 2
