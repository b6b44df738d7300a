"""``kproxy run``: wires one source, the shared cache, the runner, one backend and the servers together.

This is the only place that knows all the parts; each part knows only the layer below it. The flow, as upstream's
ProxyServer (``cmd/kube-proxy/app/server.go``) with one runner shared by the IP families:

    source threads --objects--> ServiceCache --on_change--> runner.run()        (health: update queued)
    runner thread: snapshot -> backend.sync(state, changes) -> commit | retry    (health: updated; metrics)
                   -> service health servers, conntrack reconciler

Threads, in one place: the sources' list/watch threads only write into the cache; one runner thread resolves the
node context (``kproxy.nodeaddr``, once per sync, for the backend, the health servers and the conntrack reconciler)
and calls the backend; the HTTP servers answer from their own threads and read only thread-safe objects (health,
metrics, the backend's ``describe``, which reads the ledger's published snapshot and never waits for a sync). The
backend's ``start`` runs in the main thread before the first sync, its ``close`` after the runner thread has ended.
SIGTERM stops everything *without* touching kernel state, so established connections survive a restart or an
upgrade.

Drift repair (``kproxy.drift``): when the backend declares what announces damage to its kernel state, a watcher
thread hears someone else's change at once and asks for a full sync of the family (``request_full`` and a runner
request, so a storm is served once per min-sync-period), or for the backend's cheap check, which the runner thread
runs between syncs (``runner.check``: ``needs_full`` stays in the runner thread). Every sync and check runs inside
the watcher's own-write window, which is how kproxy's own writes are told apart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kproxy.backend import LedgerProxier
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig, to_kube_proxy_configuration
from kproxy.conntrack import ConntrackReconciler, reconcile_needed, udp_changes
from kproxy.counters import register as register_counters
from kproxy.drift import DriftWatcher
from kproxy.gcpause import collector_paused
from kproxy.metrics import Metrics
from kproxy.model import (
    Changes,
    IPFamily,
    NamespacedName,
    ProxyState,
    ServicePortName,
    SyncResult,
)
from kproxy.nodeaddr import AddressWatch, NodeContext, health_check_addresses, local_addresses, resolve
from kproxy.proxier import Proxier
from kproxy.queries import ServiceFilter, parse_trace_query
from kproxy.readbehind import ReadBehind
from kproxy.runner import BoundedFrequencyRunner
from kproxy.server.health import ProxyHealth
from kproxy.server.http import HealthzServer, MetricsServer
from kproxy.server.service_health import ServiceHealthServer
from kproxy.syncfacts import SyncFacts

log = logging.getLogger(__name__)

# seconds between two settlings of the heap: each collects only what the syncs since the last one left alive
SETTLE_EVERY = 1.0
STOP_TIMEOUT = 120.0  # seconds stop() waits for a sync in progress (a full sync at 10k services takes ~12 s)


class Source(Protocol):
    def start(self) -> Any: ...
    def stop(self) -> Any: ...


SourceFactory = Callable[[ServiceCache], Source]


@dataclass
class SyncStatus:
    """What the last syncs did, for ``/rules`` and logs."""

    syncs: int = 0
    failures: int = 0
    last_error: str | None = None
    last_full: float = 0.0
    last_success: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)


class Daemon:
    """One running proxy: construct, ``start()``, then ``stop()`` (from a signal handler or a test)."""

    def __init__(
        self,
        config: ProxyConfig,
        backend: Proxier,
        source_factory: SourceFactory,
        *,
        metrics: Metrics | None = None,
        reconciler: ConntrackReconciler | None = None,
        event_sink: Callable[[str, str, NamespacedName | None], None] | None = None,
        settle_heap: bool = False,
    ) -> None:
        self.config = config
        # ``kproxy run``'s process: after syncs, at most every SETTLE_EVERY, the heap is settled (gcpause.settle)
        self._settle_heap = settle_heap
        self._settled_at = float("-inf")
        self.backend = backend
        self.families = tuple(config.ip_families)
        self.metrics = metrics or Metrics(self.families)
        self.health = ProxyHealth(self.families, config.health_timeout)
        self.cache = ServiceCache(
            config.node_name,
            service_proxy_name=config.service_proxy_name,
            ip_families=self.families,
            on_change=self._on_change,
            max_service_entries=config.max_service_entries,
        )
        # Upstream passes (minSyncPeriod, syncPeriod, FullSyncPeriod=1h) and polls its iptables canary every
        # syncPeriod in a goroutine of its own. Here the runner also comes back every syncPeriod: a sync with nothing
        # dirty only lets the backend check its canary (cheap), and a *full* rewrite is still due only after
        # full_sync_period (decided in _sync), after a failure, or when the backend asks for one.
        self.runner = BoundedFrequencyRunner(
            "sync-runner",
            self._sync,
            min_interval=config.min_sync_period,
            retry_interval=config.sync_period,
            max_interval=config.sync_period,
            check_fn=self._check,
        )
        self.drift: DriftWatcher | None = None  # made in start(), when the backend declares what to watch
        self.read_behind: ReadBehind[Any, Any, Any, Any, Any] | None = None  # start(): periodic read-backs
        self._checks_owed: set[IPFamily] = set()
        self.drift_repairs = 0  # full syncs asked for because someone else changed or removed this mode's state
        self._checks_lock = threading.Lock()
        self.healthz = HealthzServer(config.healthz_bind_address, self.health, self.metrics)
        self.metrics_server = MetricsServer(
            config.metrics_bind_address,
            self.metrics,
            backend.mode,
            configz=lambda: to_kube_proxy_configuration(self.config),
            rules=self.rules,
            trace=self.trace,
            verify=self.verify,
        )
        self.service_health = ServiceHealthServer(
            self._nodeport_addresses(), self.health, on_listen_error=self._listen_error
        )
        self.node: NodeContext | None = None  # resolved at the start of each sync
        self._after_first_sync: Callable[[], None] | None = None
        self.applied: ProxyState | None = None  # the state of the last successful sync (what /verify checks)
        self.facts = SyncFacts(self.families)  # what metrics and the health servers need, in O(changes)
        self._health_retry = False  # a service health listener failed to open: try again at the next sync
        backend.register_metrics(self.metrics.registry, self.families)
        register_counters(self.metrics.registry, backend, config)  # per-service counters, with --service-counters
        self.reconciler = reconciler if reconciler is not None else ConntrackReconciler()
        self.source = source_factory(self.cache)
        self.status = SyncStatus()
        self._event_sink = event_sink
        self._refused: dict[ServicePortName, str] = {}  # the core's refusals already reported
        self._need_full = True
        self._conntrack_owed = False
        #: the UDP service ports changed since the conntrack reconciler last saw the state (None: anything, after a
        #: full sync or a failed reconciliation), so its view of the state costs the changes, not the table
        self._conntrack_changed: set[ServicePortName] | None = None
        self._last_full_at = 0.0
        self._ready_logged = False
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._lock_counts = threading.Lock()
        self._seen_changes = (0, 0)  # the cache's change totals already counted in the metrics
        self._addresses = AddressWatch()  # this namespace's addresses, read again only when the kernel says so

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(
        self,
        before_sync: Callable[[], None] | None = None,
        after_first_sync: Callable[[], None] | None = None,
    ) -> None:
        """Bind the health and metrics servers (an OSError when a port is taken), run ``before_sync``, then start
        syncing; ``after_first_sync`` runs once, in the runner thread, right after the first successful sync and
        before it is reported (health, metrics). The CLI removes other modes' leftovers there: only once this kproxy
        is sure to run (a second instance that cannot bind leaves the running one's rules alone) and once its own
        rules are in, so a mode switch has no moment without rules (each connection is NATed once, by whichever
        mode's rules meet it first, and both were computed from the same state)."""
        self.healthz.start()
        self.metrics_server.start()
        self._after_first_sync = after_first_sync
        if before_sync is not None:
            before_sync()
        self.backend.start()
        self._start_drift()
        self._start_read_behind()
        self.runner.start()
        self.source.start()
        log.info("kproxy started: mode=%s node=%s", self.backend.mode, self.config.node_name)

    def stop(self) -> None:
        """Stop threads and servers; kernel state stays as it is (never flushed on exit)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.source.stop()
        self.runner.stop(timeout=STOP_TIMEOUT)  # a full sync in progress finishes first (bounded by its length)
        if self.read_behind is not None:
            self.read_behind.stop()
        if self.drift is not None:
            self.drift.stop()
        self.service_health.close()
        self.healthz.close()
        self.metrics_server.close()
        self._addresses.close()
        if self.runner.stopped:
            self.backend.close()
        else:  # never tear down what a running sync uses; the process is about to exit anyway
            log.error("the sync did not end within %gs: backend left open", STOP_TIMEOUT)
        if self._settle_heap:
            collector_paused.unsettle()
        log.info("kproxy stopped; rules left in place")

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # -- cache -> runner -------------------------------------------------------------------------------------
    def _on_change(self) -> None:
        now = time.time()
        stats = self.cache.stats()
        with self._lock_counts:
            services = stats.get("service_changes_total", 0) - self._seen_changes[0]
            endpoints = stats.get("endpoint_changes_total", 0) - self._seen_changes[1]
            self._seen_changes = (self._seen_changes[0] + services, self._seen_changes[1] + endpoints)
        self.metrics.add_changes(services=max(services, 0), endpoints=max(endpoints, 0))
        pending = stats.get("service_changes_pending", 0), stats.get("endpoint_changes_pending", 0)
        self.metrics.set_pending(*pending)
        if self.cache.ready:  # as upstream, whose handlers call Sync() only once initialized: a slow initial
            for fam in self.families:  # list must not turn /healthz and /livez to 503
                self.health.queued_update(fam)
                self.metrics.set_last_queued(fam, now)
        self.health.set_node_eligible(self.cache.node_info().eligible)
        self.runner.run()

    def _nodeport_addresses(self) -> list[str]:
        """Where healthCheckNodePort servers listen: every address (empty list) unless ``--nodeport-addresses``
        names CIDRs, then this node's addresses inside them, as upstream (the node context decides). ``primary``
        (the Node's addresses, known only once the Node is listed) keeps the wildcard."""
        return health_check_addresses(self.config.nodeport_addresses, local_addresses())

    def _listen_error(self, svc: NamespacedName, port: int, why: str) -> None:
        self._health_retry = True  # the next sync tries that listener again, as upstream's
        msg = f"failed to start healthcheck {svc} on port {port}: {why}"
        log.warning(msg)
        if self._event_sink is not None:
            self._event_sink("FailedToStartServiceHealthcheck", msg, svc)

    # -- drift repair ----------------------------------------------------------------------------------------
    def _start_drift(self) -> None:
        spec = self.backend.drift()
        if spec is None:
            return
        self.drift = DriftWatcher(
            spec, self.families, repair=self._drift_repair, check=self._drift_check, netns=self.backend.netns
        )
        self.drift.start()

    def _start_read_behind(self) -> None:
        """The backend's periodic read-back of its kernel state, in a thread of its own (``kproxy.readbehind``),
        when it has one: a due read-back then never makes a sync a full one; a difference it finds is a repair."""
        backend = self.backend
        if isinstance(backend, LedgerProxier) and type(backend).readback_due is not LedgerProxier.readback_due:
            self.read_behind = ReadBehind(backend.ledger, self._lock, self._drift_repair)
            self.read_behind.start()

    def _drift_repair(self, families: frozenset[IPFamily], why: str) -> None:
        """Someone else changed this mode's state (the watcher's thread): a full sync of those families."""
        log.info("drift: %s: repairing %s", why, ", ".join(sorted(f.value for f in families)))
        self.drift_repairs += 1
        self.metrics.count_drift_repair()
        for fam in families:
            self.backend.request_full(fam)
        self.runner.run()

    def _drift_check(self, families: frozenset[IPFamily], why: str) -> None:
        """The backend's cheap check is owed now (the watcher's thread): run by the runner thread (``_check``)."""
        log.debug("drift: %s: checking %s", why, ", ".join(sorted(f.value for f in families)))
        with self._checks_lock:
            self._checks_owed |= families
        self.runner.check()

    def _check(self) -> None:
        """The runner thread's check between syncs: a family whose state is gone gets a full sync now."""
        with self._checks_lock:
            owed, self._checks_owed = self._checks_owed, set()
        if not owed or not self.cache.ready:
            return
        self.metrics.count_drift_check()
        with self._lock, self._own_writes():
            gone = [fam for fam in self.families if fam in owed and self.backend.check_now(fam)]
        if gone:
            log.info("drift: the check found %s state gone: repairing", ", ".join(f.value for f in gone))
            self.drift_repairs += 1
            self.metrics.count_drift_repair()
            self.runner.run()

    @contextlib.contextmanager
    def _own_writes(self) -> Iterator[None]:
        if self.drift is None:
            yield
            return
        with self.drift.own_writes():
            yield

    # -- the sync --------------------------------------------------------------------------------------------
    def _sync(self) -> bool:
        """One run of the runner. True on success; False asks for a retry (the change stays dirty)."""
        with self._own_writes():
            return self._sync_now()

    def _sync_now(self) -> bool:
        if not self.cache.ready:
            if not self._ready_logged:
                log.info("not syncing until Services and EndpointSlices have been received")
                self._ready_logged = True
            return True
        with self._lock:
            now = time.monotonic()
            full = self._need_full or (now - self._last_full_at) >= self.config.full_sync_period
            state, changes = self.cache.snapshot(full=full)
            start = time.perf_counter()
            try:
                self.node = resolve(self.config, state.node, self._addresses.current())
                result = self.backend.sync(state, changes, self.node)
            except Exception as exc:  # a backend bug must not kill the runner; retry as a full sync
                log.exception("sync failed with an exception")
                result = SyncResult(ok=False, full=changes.full, error=f"{type(exc).__name__}: {exc}")
            elapsed = time.perf_counter() - start
            try:
                return self._after_sync(state, changes, result, elapsed)
            finally:  # counted once it is done, the after-first-sync hook included (/rules' "synced")
                self.status.syncs += 1

    def _after_sync(self, state: ProxyState, changes: Changes, result: SyncResult, elapsed: float) -> bool:
        """Record a sync: health, metrics, the cache's commit, the health servers, conntrack; True when nothing is
        left to retry."""
        if not result.ok:
            self._after_failure(changes, result, elapsed)
            return False
        failed: dict[ServicePortName, str] = dict(result.failed)
        self.cache.commit(changes, failed=failed.keys())
        self.applied = state
        first, self._after_first_sync = self._after_first_sync, None
        if first is not None:
            try:
                first()
            except Exception:  # e.g. another mode's cleanup: never a reason to stop proxying
                log.exception("after-first-sync hook failed")
        periodic = changes.full and self.status.last_full > 0  # not the first full sync of this process
        self._record_success(changes, result, failed)
        self.facts.update(state, changes)
        self._observe(changes, result, elapsed, len(failed))
        self._sync_service_health()
        if periodic:
            self._verify_after_periodic(state)
        if self.backend.uses_conntrack_nat:
            self._track_conntrack(changes)
            if self._conntrack_owed or reconcile_needed(changes, state):
                self._conntrack_owed = not self._reconcile_conntrack(state)
        if result.need_full_sync:
            self.runner.run()  # the backend wants a full sync (it says so when it lost track of the kernel)
        if self._settle_heap and (periodic or time.monotonic() - self._settled_at >= SETTLE_EVERY):
            # what this sync and the changes before it left alive joins the frozen heap, collected first; the first
            # call walks everything once, after the first sync's rules are in. The periodic full sync (hourly) gives
            # the whole heap back to the collector first: a frozen object that joined a garbage cycle since (none
            # is known: a unit test checks the cache's churn) is freed then, so no such leak outlives the hour
            if periodic:
                collector_paused.unsettle()
            collector_paused.settle()
            self._settled_at = time.monotonic()
        # Services the kernel refused stay dirty: ask the runner to come back after the retry interval.
        return not failed

    def _sync_service_health(self) -> None:
        """The service health servers' ports and local endpoint counts, handed over (a copy of every service with a
        health port) only when they changed or when a listener could not be opened (each sync tries it again)."""
        if not (self.facts.take_health_changed() or self._health_retry):
            return
        self._health_retry = False
        self.service_health.sync_services(self.facts.health_ports())
        self.service_health.sync_endpoints(self.facts.local_ready())

    def _after_failure(self, changes: Changes, result: SyncResult, elapsed: float) -> None:
        m = self.metrics
        self._need_full = True
        self.status.failures += 1
        self.status.last_error = result.error
        log.error(
            "sync failed (%s sync, %d changed services): %s",
            "full" if changes.full else "partial",
            len(changes.services),
            result.error,
        )
        now_wall = time.time()
        for fam in self.families:
            full = _family_full(result, fam, changes.full)
            if result.failed_families and fam not in result.failed_families:
                # this family was programmed (as upstream's per-family proxiers, it is healthy on its own)
                self.health.updated(fam)
                m.observe_sync(fam, elapsed, full)
                m.observe_phases(fam, result.timings.items())
                m.set_last_synced(fam, now_wall)
                self.backend.observe_sync(fam, result, full=full, ok=True)
                continue
            m.observe_sync(fam, elapsed, full, ok=False)
            self.backend.observe_sync(fam, result, full=full, ok=False)

    def _record_success(self, changes: Changes, result: SyncResult, failed: Mapping[ServicePortName, str]) -> None:
        now_wall = time.time()
        if changes.full or result.full:
            self._last_full_at = time.monotonic()
            self.status.last_full = now_wall
        self._need_full = result.need_full_sync
        self.status.last_success = now_wall
        self.status.last_error = None
        self.status.failed = {f"{spn}/{spn.protocol.value}": why for spn, why in failed.items()}
        if failed:
            log.warning(
                "the kernel refused %d service(s); they were skipped and will be retried: %s",
                len(failed),
                "; ".join(f"{k}: {v}" for k, v in self.status.failed.items()),
            )
        self._report_refused(result.refused)

    def _observe(self, changes: Changes, result: SyncResult, elapsed: float, failed: int) -> None:
        """The metrics of a successful sync, in O(changes) (``self.facts`` is kept up to date from the changes)."""
        m = self.metrics
        now_wall = time.time()
        stats = self.cache.stats()
        for fam in self.families:
            self.health.updated(fam)
            full = _family_full(result, fam, changes.full)
            m.observe_sync(fam, elapsed, full)
            self.backend.observe_sync(fam, result, full=full, ok=True)
            m.count_written(fam, result.family(fam).written)
            m.observe_phases(fam, result.timings.items())
            m.set_last_synced(fam, now_wall)
            m.observe_network_programming(fam, [t for f, t in changes.trigger_times if f is fam], now_wall)
            # upstream counts the service ports whose Local policy drops traffic for want of local endpoints
            internal, external = self.facts.no_local_endpoints(fam)
            m.set_no_local_endpoints(fam, internal=internal, external=external)
        m.set_pending(stats.get("service_changes_pending", 0), stats.get("endpoint_changes_pending", 0))
        m.set_sync_failed_services(failed)
        m.set_refused(result.refused.values())
        m.set_invalid_objects("all", stats.get("invalid_objects", 0))

    def _verify_after_periodic(self, state: ProxyState) -> None:
        """Read the kernel back between syncs (here, in the runner thread): drift the full sync could not repair."""
        try:
            report = self.backend.verify(state, self.node)
            if report is not None:
                self.metrics.set_drift(int(report["drift"]))
        except Exception:
            log.exception("verify after the periodic full sync failed")

    def _report_refused(self, refused: Mapping[ServicePortName, str]) -> None:
        """What the core refused (``kproxy.admission``): in ``/rules`` beside the kernel's refusals (not retried:
        only a change of the objects changes the answer), logged and posted as an Event once per new answer."""
        for spn, why in refused.items():
            self.status.failed[f"{spn}/{spn.protocol.value}"] = f"refused: {why}"
            if self._refused.get(spn) == why:
                continue
            log.warning("service port %s refused: %s", spn, why)
            if self._event_sink is not None:
                reason = "AddressConflict" if why.startswith("address-conflict") else "ServiceOverCapacity"
                self._event_sink(reason, f"service port {spn}/{spn.protocol.value}: {why}", spn.service)
        self._refused = dict(refused)

    def _track_conntrack(self, changes: Changes) -> None:
        """Add a successful sync's UDP changes to what the reconciler has not seen yet (O(changes))."""
        if changes.full:
            self._conntrack_changed = None
        elif self._conntrack_changed is not None:
            self._conntrack_changed.update(udp_changes(changes))

    def _reconcile_conntrack(self, state: ProxyState) -> bool:
        """Reconcile UDP conntrack with the state just programmed; False when it could not finish (then the next
        sync, at the latest the periodic one, tries again: a stale entry must not wait for the next UDP change)."""
        node = self.node or resolve(self.config, state.node)
        start = time.perf_counter()
        changed, self._conntrack_changed = self._conntrack_changed, set()
        try:
            deleted = self.reconciler.reconcile(state, node, self.backend.conntrack_answerers, changed)
        except Exception:  # conntrack trouble must not fail the sync: rules are already in place
            log.exception("conntrack reconciliation failed")
            self._conntrack_changed = None  # whatever it saw of the state, the next one starts from the state alone
            return False
        elapsed = time.perf_counter() - start
        for fam in self.families:
            self.metrics.observe_conntrack(fam, elapsed, deleted.get(fam, 0))
            if deleted.get(fam):
                log.info("conntrack: deleted %d stale %s UDP entries", deleted[fam], fam.value)
        return bool(getattr(self.reconciler, "last_ok", True))

    # -- introspection ---------------------------------------------------------------------------------------
    def trace(self, query: Mapping[str, str]) -> dict[str, Any]:
        """``/trace``: the backend's packet explainer over what it last programmed."""
        src, proto, dst, dport, src_local, dst_local = parse_trace_query(query)
        if not (src_local and dst_local):  # an address of this node is the node, whether or not the flag says so
            node = self.node
            if node is None:
                try:
                    node = resolve(self.config, self.cache.node_info(), local_addresses())
                except Exception as exc:  # netlink errors are not OSErrors; the flags still work
                    log.debug("trace: cannot read this node's addresses: %s", exc)
            mine = set(node.local_addresses) if node is not None else set()
            src_local = src_local or src in mine
            dst_local = dst_local or dst in mine
        out = self.backend.trace(src, proto, dst, dport, src_local=src_local, dst_local=dst_local)
        if out is None:
            raise LookupError(f"mode {self.backend.mode} has no packet explainer")
        return {
            "mode": self.backend.mode,
            "packet": {
                "src": src,
                "proto": proto,
                "dst": dst,
                "dport": dport,
                "srcLocal": src_local,
                "dstLocal": dst_local,
            },
            "trace": out,
        }

    def verify(self) -> dict[str, Any]:
        """``/verify``: the kernel read back and diffed against the state of the last successful sync (services
        missing, different, extra objects; ``drift`` counts them). A LookupError (404) before the first sync or for a
        mode that cannot read its kernel state back."""
        state = self.applied
        if state is None:
            raise LookupError("nothing synced yet")
        report = self.backend.verify(state, self.node)
        if report is None:
            raise LookupError(f"mode {self.backend.mode} cannot read its kernel state back")
        return {"node": self.config.node_name, **report}

    def rules(self, service: str | None = None) -> dict[str, Any]:
        """``/rules``: how each service is programmed (the backend's view) plus the cache's rejections.

        ``service`` (``ns/name[:port][/PROTO]``) narrows it to the ports it names: every port and protocol of the
        service when those are left out. A malformed one is a ValueError (400), one that names nothing programmed
        a LookupError (404)."""
        wanted = ServiceFilter.parse(service) if service else None
        described: dict[str, Any]
        try:
            described = dict(self.backend.describe(wanted.exact if wanted else None))
        except Exception as exc:
            described = {"error": f"describe failed: {exc}"}
        if wanted is not None and isinstance(described.get("services"), Mapping):
            matched = {k: v for k, v in described["services"].items() if wanted.matches(k)}
            if not matched:
                raise LookupError(f"no service port matches {service!r} on this node")
            described = {**described, "services": matched}
            detail = described.get("detail")
            if isinstance(detail, Mapping) and isinstance(detail.get("services"), Mapping):
                kept = {k: v for k, v in detail["services"].items() if k in matched}
                described["detail"] = {**detail, "services": kept}
        return {
            "mode": self.backend.mode,
            "node": self.config.node_name,
            "ready": self.cache.ready,
            "sync": {
                "syncs": self.status.syncs,
                "failures": self.status.failures,
                "lastError": self.status.last_error,
                "lastSuccess": self.status.last_success,
                "lastFull": self.status.last_full,
                "failedServices": self.status.failed,
            },
            "rejectedObjects": self.cache.errors(),
            "backend": described,
        }


def _family_full(result: SyncResult, fam: IPFamily, default: bool) -> bool:
    """Whether the backend synced ``fam`` in full (a backend may do so on its own, after a failure of that family or
    a flush), else ``default`` (when it said nothing of the family)."""
    said = result.families.get(fam)
    return default if said is None else said.full
