"""Upstream kube-proxy's Prometheus metrics, on a registry of kproxy's own.

Names, types, label names and buckets are upstream's (``pkg/proxy/metrics/metrics.go``, v1.34 metric reference),
so dashboards, alerts and runbooks written for kube-proxy read kproxy unchanged. This module holds the metrics every
mode has; a mode's own (upstream's ``sync_proxy_rules_iptables_*``, ``sync_proxy_rules_nftables_*``, ...) are declared
by its backend (``Proxier.register_metrics`` on this registry, fed by ``Proxier.observe_sync``), as upstream's
``RegisterMetrics(mode)`` registers them only for the mode that runs. A few kproxy-only metrics live under the
``kproxy_`` prefix and are documented where they are defined.

The registry is not prometheus-client's global one, so tests (and several kproxy instances in one process, as the
lab runs them) never share counters. It hides prometheus-client's ``*_created`` series, which upstream does not
expose. Counters are declared without the ``_total`` suffix because prometheus-client appends it on exposition;
the exposed names equal upstream's exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from kproxy.model import REFUSAL_REASONS, IPFamily

PREFIX = "kubeproxy_"


def exponential_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    """Go's ``prometheus.ExponentialBuckets``."""
    return tuple(start * factor**i for i in range(count))


def linear_buckets(start: float, width: float, count: int) -> tuple[float, ...]:
    """Go's ``prometheus.LinearBuckets``."""
    return tuple(start + width * i for i in range(count))


SYNC_BUCKETS = exponential_buckets(0.001, 2, 15)  # 1 ms .. 16.384 s
# Upstream's merge() starts from a one-element zero slice, so the histogram really has a 0 bucket first.
NETWORK_PROGRAMMING_BUCKETS = (
    (0.0,)
    + linear_buckets(0.25, 0.25, 2)  # 0.25 s, 0.5 s
    + linear_buckets(1, 1, 59)  # 1 .. 59 s
    + linear_buckets(60, 5, 12)  # 60 .. 115 s
    + linear_buckets(120, 30, 7)  # 2 .. 5 min
)


class TextCollector(Protocol):
    """A collector that renders its own exposition text (``kproxy.counters``: 100,000s of series, which
    prometheus-client's formatter takes seconds over); ``collect()`` yields the same families for other readers."""

    def collect(self) -> Iterable[Metric]: ...

    def write(self, out: list[bytes | bytearray]) -> None: ...


class Registry(CollectorRegistry):
    """A registry whose exposition leaves out prometheus-client's ``*_created`` samples (upstream has none), and
    appends the text of its ``TextCollector``s (``exposition()``, what ``/metrics`` serves)."""

    def __init__(self) -> None:
        super().__init__()
        self._text: list[TextCollector] = []

    def register_text(self, collector: TextCollector) -> None:
        self._text.append(collector)

    def exposition(self) -> list[bytes | bytearray]:
        """The text format in pieces, in order: prometheus-client's for the ordinary metrics, then each text
        collector's own (100,000s of counter lines are tens of MB: the pieces go to the socket one after another,
        never joined into a second copy)."""
        out: list[bytes | bytearray] = [generate_latest(_Collecting(self._own))]
        for collector in list(self._text):
            collector.write(out)
        return out

    def collect(self) -> Iterator[Metric]:
        yield from self._own()
        for collector in list(self._text):
            yield from collector.collect()

    def _own(self) -> Iterator[Metric]:
        for metric in super().collect():
            samples = [s for s in metric.samples if not s.name.endswith("_created")]
            if len(samples) == len(metric.samples):
                yield metric
                continue
            copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            copy.samples = samples
            yield copy


class _Collecting:
    """What ``generate_latest`` takes: anything with ``collect()``."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect


class Metrics:
    """Every metric kproxy exports, one attribute per upstream metric, plus helpers the daemon calls.

    ``families``: the IP families this node proxies; their per-family counters are created at zero so that
    ``rate()`` and ``increase()`` work from the first scrape.
    """

    def __init__(self, families: Sequence[IPFamily] = ()) -> None:
        self.registry: Registry = Registry()
        # Declared in upstream's order, which is also the exposition's.
        self._declare_sync_timing()
        self._declare_change_tracking()
        self._declare_health_and_conntrack()
        self._declare_kproxy_own()
        self._zero_families(families)

    def _declare_sync_timing(self) -> None:
        """Sync durations and timestamps, per family."""
        r = self.registry
        fam = ["ip_family"]
        self.sync_proxy_rules_duration_seconds = Histogram(
            PREFIX + "sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_full_proxy_rules_duration_seconds = Histogram(
            PREFIX + "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_partial_proxy_rules_duration_seconds = Histogram(
            PREFIX + "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_proxy_rules_last_timestamp_seconds = Gauge(
            PREFIX + "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            fam,
            registry=r,
        )
        self.sync_proxy_rules_last_queued_timestamp_seconds = Gauge(
            PREFIX + "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            fam,
            registry=r,
        )
        self.network_programming_duration_seconds = Histogram(
            PREFIX + "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            fam,
            buckets=NETWORK_PROGRAMMING_BUCKETS,
            registry=r,
        )

    def _declare_change_tracking(self) -> None:
        """Pending and absorbed Service / EndpointSlice changes (no ip_family label upstream), and the
        Local-policy services without endpoints."""
        r = self.registry
        self.sync_proxy_rules_endpoint_changes_pending = Gauge(
            PREFIX + "sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes", registry=r
        )
        self.sync_proxy_rules_endpoint_changes_total = Counter(
            PREFIX + "sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes", registry=r
        )
        self.sync_proxy_rules_service_changes_pending = Gauge(
            PREFIX + "sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes", registry=r
        )
        self.sync_proxy_rules_service_changes_total = Counter(
            PREFIX + "sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", registry=r
        )

        self.sync_proxy_rules_no_local_endpoints_total = Gauge(
            PREFIX + "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["ip_family", "traffic_policy"],
            registry=r,
        )

    def _declare_health_and_conntrack(self) -> None:
        """The health endpoints' answers and the conntrack reconciler."""
        r = self.registry
        fam = ["ip_family"]
        self.proxy_healthz_total = Counter(
            PREFIX + "proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"], registry=r
        )
        self.proxy_livez_total = Counter(
            PREFIX + "proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r
        )

        # Conntrack reconciler.
        self.conntrack_reconciler_deleted_entries_total = Counter(
            PREFIX + "conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            fam,
            registry=r,
        )
        self.conntrack_reconciler_sync_duration_seconds = Histogram(
            PREFIX + "conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=r,
        )

    def _declare_kproxy_own(self) -> None:
        """kproxy's own: what upstream cannot tell you (documented where each is defined)."""
        r = self.registry
        self.kproxy_sync_failed_services = Gauge(
            "kproxy_sync_failed_services",
            "Service ports whose rules the kernel refused in the last sync (kept dirty and retried)",
            registry=r,
        )
        self.kproxy_service_ports_refused = Gauge(
            "kproxy_service_ports_refused",
            "Service ports refused in whole or in part before rendering, by reason: address-conflict (an address "
            "another service holds) or capacity (more than this mode holds)",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.kproxy_service_ports_refused.labels(reason).set(0)
        self.kproxy_invalid_objects = Gauge(
            "kproxy_invalid_objects",
            "Kubernetes objects ignored because they failed validation, by kind",
            ["kind"],
            registry=r,
        )
        self.kproxy_drift_services = Gauge(
            "kproxy_drift_services",
            "Service ports (and stray objects) whose kernel state differs from what kproxy wants, found by reading the "
            "kernel back after the last periodic full sync (kproxy verify); -1 before the first check",
            registry=r,
        )
        self.kproxy_drift_services.set(-1)
        self.kproxy_drift_checks_total = Counter(
            "kproxy_drift_checks",
            'Cheap "is my state still there" checks the drift watcher asked for between syncs (its poll, or a change'
            " it could not attribute), run by the runner thread (kproxy.drift)",
            registry=r,
        )
        self.kproxy_drift_repairs_total = Counter(
            "kproxy_drift_repairs",
            "Full syncs asked for because someone else changed or removed this mode's kernel state (kproxy.drift)",
            registry=r,
        )
        self.kproxy_syncs_total = Counter(
            "kproxy_syncs",
            "Backend syncs by IP family and result (success or failure)",
            ["ip_family", "result"],
            registry=r,
        )
        self.kproxy_sync_services_written = Counter(
            "kproxy_sync_services_written",
            "Service ports the successful syncs wrote or removed, by IP family (the core's per-service deltas; a sync"
            " that changed nothing adds 0)",
            ["ip_family"],
            registry=r,
        )
        self.kproxy_sync_phase_duration_seconds = Histogram(
            "kproxy_sync_phase_duration_seconds",
            "Seconds spent in one phase of a sync (the backend's SyncResult.timings: render, apply, ...)",
            ["ip_family", "phase"],
            buckets=SYNC_BUCKETS,
            registry=r,
        )

    def _zero_families(self, families: Sequence[IPFamily]) -> None:
        """Per-family series start at zero, so rate() and increase() work from the first scrape."""
        for family in families:
            label = family.label
            self.conntrack_reconciler_deleted_entries_total.labels(label)
            self.kproxy_sync_services_written.labels(label)
            for policy in ("internal", "external"):
                self.sync_proxy_rules_no_local_endpoints_total.labels(label, policy).set(0)

    # ---- helpers the daemon calls -------------------------------------------------------------------------

    def observe_sync(self, family: IPFamily, seconds: float, full: bool, ok: bool = True) -> None:
        """One backend sync of one family took ``seconds`` (observed whatever the outcome, as upstream does)."""
        label = family.label
        self.sync_proxy_rules_duration_seconds.labels(label).observe(seconds)
        which = self.sync_full_proxy_rules_duration_seconds if full else self.sync_partial_proxy_rules_duration_seconds
        which.labels(label).observe(seconds)
        self.kproxy_syncs_total.labels(label, "success" if ok else "failure").inc()

    def count_written(self, family: IPFamily, services: int) -> None:
        """A successful sync of ``family`` wrote or removed this many service ports."""
        self.kproxy_sync_services_written.labels(family.label).inc(services)

    def observe_phases(self, family: IPFamily, timings: Iterable[tuple[str, float]]) -> None:
        """A backend's ``SyncResult.timings`` items (phase name, seconds)."""
        for phase, seconds in timings:
            self.kproxy_sync_phase_duration_seconds.labels(family.label, phase).observe(seconds)

    def set_last_synced(self, family: IPFamily, when: float | None = None) -> None:
        """Rules of ``family`` were successfully synced at ``when`` (seconds since the epoch; default now)."""
        self.sync_proxy_rules_last_timestamp_seconds.labels(family.label).set(time.time() if when is None else when)

    def set_last_queued(self, family: IPFamily, when: float | None = None) -> None:
        """A sync of ``family`` was queued at ``when`` (seconds since the epoch; default now)."""
        value = time.time() if when is None else when
        self.sync_proxy_rules_last_queued_timestamp_seconds.labels(family.label).set(value)

    def add_changes(self, services: int = 0, endpoints: int = 0) -> None:
        """The cache absorbed this many Service / EndpointSlice changes."""
        if services:
            self.sync_proxy_rules_service_changes_total.inc(services)
        if endpoints:
            self.sync_proxy_rules_endpoint_changes_total.inc(endpoints)

    def set_pending(self, services: int, endpoints: int) -> None:
        """Service / endpoint changes received but not yet synced."""
        self.sync_proxy_rules_service_changes_pending.set(services)
        self.sync_proxy_rules_endpoint_changes_pending.set(endpoints)

    def observe_network_programming(
        self, family: IPFamily, trigger_times: Iterable[float], now: float | None = None
    ) -> None:
        """Latency from each object change (``Changes.trigger_times``, epoch seconds) to its successful sync.

        Negative values (clock skew between the node and the control plane) are dropped, as upstream's guard does.
        """
        done = time.time() if now is None else now
        hist = self.network_programming_duration_seconds.labels(family.label)
        for t in trigger_times:
            if done >= t:
                hist.observe(done - t)

    def set_no_local_endpoints(self, family: IPFamily, internal: int, external: int) -> None:
        """Services with a Local traffic policy and no local endpoints, per policy (upstream's labels)."""
        self.sync_proxy_rules_no_local_endpoints_total.labels(family.label, "internal").set(internal)
        self.sync_proxy_rules_no_local_endpoints_total.labels(family.label, "external").set(external)

    def observe_conntrack(self, family: IPFamily, seconds: float, deleted: int) -> None:
        """One conntrack reconcile of ``family``: its duration and the flows it deleted."""
        self.conntrack_reconciler_sync_duration_seconds.labels(family.label).observe(seconds)
        if deleted:
            self.conntrack_reconciler_deleted_entries_total.labels(family.label).inc(deleted)

    def count_healthz(self, code: int) -> None:
        self.proxy_healthz_total.labels(str(code)).inc()

    def count_livez(self, code: int) -> None:
        self.proxy_livez_total.labels(str(code)).inc()

    def set_drift(self, count: int) -> None:
        self.kproxy_drift_services.set(count)

    def count_drift_check(self) -> None:
        self.kproxy_drift_checks_total.inc()

    def count_drift_repair(self) -> None:
        self.kproxy_drift_repairs_total.inc()

    def set_sync_failed_services(self, count: int) -> None:
        self.kproxy_sync_failed_services.set(count)

    def set_refused(self, refused: Iterable[str]) -> None:
        """``refused``: one ``reason: message`` per refused service port (``SyncResult.refused``)."""
        counts = dict.fromkeys(REFUSAL_REASONS, 0)
        for why in refused:
            reason = why.split(":", 1)[0]
            counts[reason] = counts.get(reason, 0) + 1
        for reason, n in counts.items():
            self.kproxy_service_ports_refused.labels(reason).set(n)

    def set_invalid_objects(self, kind: str, count: int) -> None:
        self.kproxy_invalid_objects.labels(kind).set(count)

    def exposition_pieces(self) -> list[bytes | bytearray]:
        """What ``/metrics`` serves, in pieces written one after another (tens of MB with per-service counters)."""
        return self.registry.exposition()

    def exposition(self) -> bytes:
        """What ``/metrics`` serves, as one text (tests and tools)."""
        return b"".join(self.registry.exposition())

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The current value of one exposed sample (for tests and ``kproxy show``); None if absent."""
        return self.registry.get_sample_value(name, labels or {})
