"""A small Kubernetes Event recorder: what upstream kube-proxy reports about its node and its services.

Used by the daemon through the official client's events.k8s.io/v1 API, as upstream's recorder does: the
start-up event (`Recorder.Eventf(nodeRef, nil, Normal, "Starting", "StartKubeProxy", "")`, with a node
reference whose UID is the node name) and Warning events about a service (for example
"FailedToStartServiceHealthcheck", regarding the Service with the UID ``namespace/name``, as upstream's health
check server reports it).

Recording is best effort: a failure is logged and counted, never raised, because an API server that refuses
Events must not stop the proxy. And it is asynchronous: `post` (and the daemon's sink from `sink()`) only queues
the event for one worker thread and returns at once, so a slow or hanging API server never holds up the sync
thread. The queue is bounded (an event that does not fit is dropped and counted) and, like client-go's event
correlator, the same (reason, object) is posted at most once per `interval`; the repeats in between are counted
and reported with the next one as its ``series.count``. `stop()` ends the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client import ApiClient

from kproxy.model import NamespacedName

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 300.0  # at most one event per (reason, object) per 5 minutes
DEFAULT_QUEUE = 64
MAX_KEYS = 4096  # (reason, object) pairs remembered for the rate limit

# the events.k8s.io `action` of the daemon's reasons (upstream's where it has one); other reasons get "Sync"
ACTIONS = {"FailedToStartServiceHealthcheck": "Listen", "AddressConflict": "Admit", "ServiceOverCapacity": "Admit"}

EventSink = Callable[[str, str, NamespacedName | None], None]


@dataclass
class _Seen:
    posted_at: float
    repeats: int = 0  # suppressed since posted_at


def _stamp(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class EventRecorder:
    def __init__(
        self,
        api_client: ApiClient,
        node_name: str,
        *,
        controller: str = "kproxy",
        namespace: str = "default",
        timeout: float = 5.0,
        queue_size: int = DEFAULT_QUEUE,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Typed as Any: plain dict bodies and raw responses (_preload_content=False) are not in the client's stubs.
        self._api: Any = kubernetes.client.EventsV1Api(api_client)
        self.node_name = node_name
        self.controller = controller
        self.namespace = namespace  # events about cluster-scoped objects (a Node) live in "default"
        self.timeout = timeout
        self.interval = interval
        self._clock = clock
        self.recorded = 0
        self.failed = 0
        self.dropped = 0  # queue full, or still queued at stop()
        self.suppressed = 0  # repeats within the interval, not posted
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._seen: OrderedDict[tuple[str, NamespacedName | None], _Seen] = OrderedDict()
        self._cond = threading.Condition()
        self._outstanding = 0  # queued or being posted
        self._stopping = False
        self._worker: threading.Thread | None = None

    # --- building and sending

    def _body(
        self,
        reason: str,
        action: str,
        note: str,
        type_: str,
        regarding: NamespacedName | None,
        count: int = 1,
    ) -> dict[str, Any]:
        now = datetime.now(timezone.utc)
        if regarding is None:
            ref = {"kind": "Node", "apiVersion": "v1", "name": self.node_name, "uid": self.node_name}
            namespace, name = self.namespace, self.node_name
        else:
            ref = {
                "kind": "Service",
                "apiVersion": "v1",
                "namespace": regarding.namespace,
                "name": regarding.name,
                "uid": str(regarding),
            }
            namespace, name = regarding.namespace, regarding.name
        body: dict[str, Any] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            # Upstream names events <object>.<hex nanoseconds>, unique per object and moment.
            "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": namespace},
            "eventTime": _stamp(now),
            "reportingController": self.controller,
            "reportingInstance": f"{self.controller}-{self.node_name}",
            "action": action,
            "reason": reason,
            "type": type_,
            "regarding": ref,
        }
        if note:
            body["note"] = note[:1024]
        if count > 1:
            body["series"] = {"count": count, "lastObservedTime": _stamp(now)}
        return body

    def _send(self, body: dict[str, Any]) -> bool:
        try:
            resp = self._api.create_namespaced_event(
                body["metadata"]["namespace"],
                body,
                _preload_content=False,
                _request_timeout=(self.timeout, self.timeout),
            )
            resp.drain_conn()  # the answer's body is not wanted, but an unread one would be the next answer's start
            resp.release_conn()
        except Exception as exc:  # noqa: BLE001 - best effort by design
            self.failed += 1
            log.warning(
                "events: could not record %s/%s about %s: %s",
                body["reason"],
                body["action"],
                body["regarding"].get("name"),
                exc,
            )
            return False
        self.recorded += 1
        return True

    # --- synchronous (start-up, tests)

    def node_event(self, reason: str, action: str, note: str = "", type_: str = "Normal") -> bool:
        """Record an event about this node now, in the caller's thread; True if the server accepted it."""
        return self._send(self._body(reason, action, note, type_, None))

    def starting(self) -> bool:
        """Upstream's start-up event."""
        return self.node_event("Starting", "StartKubeProxy")

    # --- asynchronous, rate-limited

    def post(
        self,
        reason: str,
        note: str,
        regarding: NamespacedName | None = None,
        *,
        type_: str = "Warning",
        action: str = "",
    ) -> bool:
        """Queue an event about a service (or this node when `regarding` is None) and return at once. False when
        it is a repeat within the interval (counted, reported with the next one) or the queue is full (dropped)."""
        key = (reason, regarding)
        with self._cond:
            if self._stopping:
                self.dropped += 1
                return False
            now = self._clock()
            seen = self._seen.get(key)
            if seen is not None and now - seen.posted_at < self.interval:
                seen.repeats += 1
                self.suppressed += 1
                return False
            count = 1 + (seen.repeats if seen is not None else 0)
            body = self._body(reason, action or ACTIONS.get(reason, "Sync"), note, type_, regarding, count)
            try:
                self._queue.put_nowait(body)
            except queue.Full:
                self.dropped += 1
                return False
            self._seen[key] = _Seen(now)
            self._seen.move_to_end(key)
            self._forget()
            self._outstanding += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="event-recorder", daemon=True)
                self._worker.start()
        return True

    def _forget(self) -> None:
        """Keep the rate limit's memory bounded: beyond MAX_KEYS, the pairs posted longest ago are forgotten."""
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)

    def sink(self) -> EventSink:
        """The daemon's event sink: ``(reason, message, service or None)``, queued as a Warning event."""

        def event_sink(reason: str, message: str, regarding: NamespacedName | None) -> None:
            self.post(reason, message, regarding)

        return event_sink

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            try:
                self._send(body)
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued event has been posted (or has failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """End the worker: what is still queued is dropped (counted); a post in flight ends within its timeout."""
        with self._cond:
            self._stopping = True
            worker = self._worker
            while True:
                try:
                    body = self._queue.get_nowait()
                except queue.Empty:
                    break
                if body is not None:
                    self.dropped += 1
                    self._outstanding -= 1
            self._cond.notify_all()
            if worker is not None:
                self._queue.put_nowait(None)  # the queue is empty now: the sentinel fits
        if worker is not None:
            worker.join(timeout)
