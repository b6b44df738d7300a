"""Node health as upstream kube-proxy defines it: the state behind ``:10256/healthz`` and ``/livez``.

A copy of the semantics of upstream's newest per-family ``ProxyHealthServer`` (``pkg/proxy/healthcheck/
proxy_health.go``): per IP family, ``queued_update`` records the oldest change not yet applied (only if none is
recorded) and ``updated`` records a successful sync and clears it. The proxy is unhealthy iff some family has had an
update queued for ``health_timeout`` or longer (upstream: 2 x syncPeriod). ``/healthz`` additionally requires the
node to be eligible (not being deleted, not tainted ``ToBeDeletedByClusterAutoscaler``); ``/livez`` ignores
eligibility.

Response bodies are what upstream's ``json.Marshal(ProxyHealth)`` writes: compact JSON with, in order,
``lastUpdated``, ``currentTime``, ``nodeEligible`` (``/healthz`` only), ``healthy`` and ``status`` (per family
``{"lastUpdated", "healthy"}``, left out while empty). Times are Go's ``time.Time`` JSON (RFC 3339 with trimmed
fractional seconds, UTC as ``Z``; the zero time is ``0001-01-01T00:00:00Z``). When healthy, ``lastUpdated`` is
reported as the current time, as upstream does for compatibility.

Two deliberate differences from upstream:

- ``/healthz`` answers 503 (``"healthy": false``) until every configured family has synced once. Upstream is
  healthy while starting up (its sync loop marks each family updated before the first sync has run), so a
  DaemonSet readiness probe or a load balancer would count a node whose rules are not yet programmed as ready.
  ``/livez`` and ``healthy()`` (what the healthCheckNodePort servers report) keep upstream's startup grace: a
  liveness probe must not restart a proxy whose first list of a large cluster is slow.
- Upstream only looks at families that have completed at least one sync (it iterates its lastUpdated map), so a
  family whose first sync never succeeds stays "healthy" forever. Here a queued update counts whether or not the
  family ever synced, as upstream's own ``QueuedUpdate`` documentation promises.

The daemon calls queued_update / updated around syncs and set_node_eligible from the Node watch; ``HealthzServer``
renders ``healthz()`` / ``livez()`` and ``ServiceHealthServer`` asks ``healthy()``.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kproxy.model import IPFamily

ZERO_TIME = "0001-01-01T00:00:00Z"


def go_time(ts: float | None) -> str:
    """Seconds since the epoch as Go's ``time.Time`` marshals to JSON (RFC 3339, trailing zeros trimmed)."""
    if ts is None:
        return ZERO_TIME
    micros = round(ts * 1_000_000)
    seconds, frac = divmod(micros, 1_000_000)
    text = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        text += "." + f"{frac:06d}".rstrip("0")
    return text + "Z"


@dataclass(frozen=True, slots=True)
class FamilyHealth:
    last_updated: float | None
    healthy: bool


@dataclass(frozen=True, slots=True)
class Health:
    """One consistent reading: overall health, the newest update of any family, per-family status, and whether
    every configured family has synced at least once."""

    healthy: bool
    last_updated: float | None
    current_time: float
    status: dict[IPFamily, FamilyHealth]
    synced: bool = True


class ProxyHealth:
    """Per-family queued/updated bookkeeping and the /healthz and /livez answers. Thread-safe.

    ``clock`` gives wall-clock seconds for the JSON; ages are measured on ``monotonic`` (by default the system's
    monotonic clock when ``clock`` is ``time.time``, else ``clock`` itself), as Go compares the monotonic
    reading inside ``time.Time``, so a wall-clock step cannot make kproxy look late.
    """

    def __init__(
        self,
        families: Sequence[IPFamily],
        health_timeout: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.families = tuple(families)
        self.health_timeout = health_timeout
        self._clock = clock
        self._mono = monotonic or (time.monotonic if clock is time.time else clock)
        self._lock = threading.Lock()
        self._last_updated: dict[IPFamily, float] = {}  # wall clock
        self._oldest_queued: dict[IPFamily, float] = {}  # monotonic
        self._node_eligible = True  # eligible while starting up, until the Node says otherwise

    def queued_update(self, family: IPFamily) -> None:
        """A change for ``family`` was received and not yet applied (keeps the oldest such time)."""
        with self._lock:
            self._oldest_queued.setdefault(family, self._mono())

    def updated(self, family: IPFamily) -> None:
        """``family`` was synced successfully: nothing is pending for it any more."""
        with self._lock:
            self._oldest_queued.pop(family, None)
            self._last_updated[family] = self._clock()

    def set_node_eligible(self, eligible: bool) -> None:
        with self._lock:
            self._node_eligible = eligible

    @property
    def node_eligible(self) -> bool:
        with self._lock:
            return self._node_eligible

    def health(self) -> Health:
        with self._lock:
            now, mono = self._clock(), self._mono()
            order = list(self.families) + sorted(
                {*self._last_updated, *self._oldest_queued} - set(self.families), key=lambda f: f.value
            )
            status: dict[IPFamily, FamilyHealth] = {}
            for family in order:
                if family not in self._last_updated and family not in self._oldest_queued:
                    continue
                queued = self._oldest_queued.get(family)
                late = queued is not None and mono - queued >= self.health_timeout
                status[family] = FamilyHealth(self._last_updated.get(family), not late)
            last = max(self._last_updated.values(), default=None)
            synced = all(f in self._last_updated for f in self.families)
            return Health(all(s.healthy for s in status.values()), last, now, status, synced)

    def healthy(self) -> bool:
        """The proxy's own health (node eligibility not considered): what service health checks report."""
        return self.health().healthy

    def _body(self, health: Health, healthy: bool, eligible: bool | None, proxy_ok: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "lastUpdated": go_time(health.current_time if healthy else health.last_updated),
            "currentTime": go_time(health.current_time),
        }
        if eligible is not None:
            body["nodeEligible"] = eligible
        body["healthy"] = proxy_ok
        if health.status:
            body["status"] = {
                fam.value: {"lastUpdated": go_time(st.last_updated), "healthy": st.healthy}
                for fam, st in sorted(health.status.items(), key=lambda kv: kv[0].value)
            }
        return body

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """Status code and body of ``/healthz``: 200 iff every family has synced once, none is late and the node is
        eligible, else 503. The body's ``healthy`` is the proxy's part of that (synced and not late)."""
        health = self.health()
        eligible = self.node_eligible
        proxy_ok = health.healthy and health.synced
        ok = proxy_ok and eligible
        return (200 if ok else 503), self._body(health, ok, eligible, proxy_ok)

    def livez(self) -> tuple[int, dict[str, Any]]:
        """Status code and body of ``/livez``: like ``/healthz`` but node eligibility is ignored (and not shown)."""
        health = self.health()
        return (200 if health.healthy else 503), self._body(health, health.healthy, None, health.healthy)
