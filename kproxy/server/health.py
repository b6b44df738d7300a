"""Node health as upstream kube-proxy defines it: the state behind ``:10256/healthz`` and ``/livez``.

A copy of the semantics of upstream's newest per-family ``ProxyHealthServer`` (``pkg/proxy/healthcheck/
proxy_health.go``): per IP family, ``queued_update`` records the oldest change not yet applied (only if none is
recorded) and ``updated`` records a successful sync and clears it. kproxy is unhealthy iff some family has had an
update queued for ``health_timeout`` or longer (upstream: 2 x syncPeriod). It is healthy while starting up.
``/healthz`` additionally requires the node to be eligible (not being deleted, not tainted
``ToBeDeletedByClusterAutoscaler``); ``/livez`` ignores eligibility.

Response bodies are what upstream's ``json.Marshal(ProxyHealth)`` writes: compact JSON with, in order,
``lastUpdated``, ``currentTime``, ``nodeEligible`` (``/healthz`` only), ``healthy`` and ``status`` (per family
``{"lastUpdated", "healthy"}``, left out while empty). Times are Go's ``time.Time`` JSON (RFC 3339 with trimmed
fractional seconds, UTC as ``Z``; the zero time is ``0001-01-01T00:00:00Z``). When healthy, ``lastUpdated`` is
reported as the current time, as upstream does for compatibility.

One deliberate difference: upstream only looks at families that have completed at least one sync (it iterates
its lastUpdated map), so a family whose first sync never succeeds stays "healthy" forever. Here a queued update
counts whether or not the family ever synced, as upstream's own ``QueuedUpdate`` documentation promises.

Who uses it: the daemon (queued_update / updated around syncs, set_node_eligible from the Node watch), the
HTTP servers (``HealthzServer`` renders ``healthz()`` / ``livez()``; ``ServiceHealthServer`` asks ``healthy()``).
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
    """One consistent reading: overall health, the newest update of any family, and per-family status."""

    healthy: bool
    last_updated: float | None
    current_time: float
    status: dict[IPFamily, FamilyHealth]


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
            return Health(all(s.healthy for s in status.values()), last, now, status)

    def healthy(self) -> bool:
        """The proxy's own health (node eligibility not considered): what service health checks report."""
        return self.health().healthy

    def _body(self, health: Health, healthy: bool, eligible: bool | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "lastUpdated": go_time(health.current_time if healthy else health.last_updated),
            "currentTime": go_time(health.current_time),
        }
        if eligible is not None:
            body["nodeEligible"] = eligible
        body["healthy"] = health.healthy
        if health.status:
            body["status"] = {
                fam.value: {"lastUpdated": go_time(st.last_updated), "healthy": st.healthy}
                for fam, st in sorted(health.status.items(), key=lambda kv: kv[0].value)
            }
        return body

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """Status code and body of ``/healthz``: 200 iff healthy and the node is eligible, else 503."""
        health = self.health()
        eligible = self.node_eligible
        ok = health.healthy and eligible
        return (200 if ok else 503), self._body(health, ok, eligible)

    def livez(self) -> tuple[int, dict[str, Any]]:
        """Status code and body of ``/livez``: like ``/healthz`` but node eligibility is ignored (and not shown)."""
        health = self.health()
        return (200 if health.healthy else 503), self._body(health, health.healthy, None)
