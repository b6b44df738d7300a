"""The event recorder posts from its own thread, bounded and rate-limited: a hanging API server never holds up the
caller (the daemon's sync thread), repeats of one (reason, object) are posted once per interval with a count.
Against a loopback server that never answers, and against the API stand-in (127.0.0.1 only, no root)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kproxy.cli import _make_source_factory
from kproxy.config import ProxyConfig
from kproxy.lab.apiserver import ApiServer, serve
from kproxy.model import NamespacedName
from kproxy.sources.events import EventRecorder
from kproxy.sources.kube import make_api_client
from kproxy.sources.recording import RecordingSink

NODE = "node-1"
REASON = "FailedToStartServiceHealthcheck"
HTTP_TIMEOUT = 30.0  # what a synchronous post to the hanging server would cost, at least


class HangingServer:
    """Accepts connections and reads requests, and never answers."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        self.got_request = threading.Condition()
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                with self.got_request:
                    self.requests += 1
                    self.got_request.notify_all()
        except OSError:
            pass

    def wait_requests(self, n: int, timeout: float = 10.0) -> bool:
        with self.got_request:
            return self.got_request.wait_for(lambda: self.requests >= n, timeout)

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone would not
        except OSError:
            pass
        self.listener.close()  # new connections are refused from now on
        self._thread.join(5)
        assert not self._thread.is_alive()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


@pytest.fixture
def hanging() -> Iterator[HangingServer]:
    server = HangingServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)], bookmark_interval=0.5)
    try:
        yield server
    finally:
        server.close()


def test_the_daemons_event_sink_returns_at_once_on_a_hanging_api_server(hanging: HangingServer) -> None:
    config = ProxyConfig(master=f"http://127.0.0.1:{hanging.port}", hostname_override=NODE)
    factory, event_sink = _make_source_factory(config)
    assert event_sink is not None
    source = factory(RecordingSink())
    try:
        start = time.monotonic()
        for i in range(20):  # a sync that finds 20 health-check ports taken
            svc = NamespacedName("default", f"s{i}")
            event_sink(REASON, f"failed to start healthcheck {svc} on port {30000 + i}: in use", svc)
            # Queued, not posted: a synchronous post would wait for the server's answer (its timeout) each time.
            assert time.monotonic() - start < 2.0, i
        assert hanging.wait_requests(1)  # the worker did try (the "Starting" event first), and hangs there
    finally:
        hanging.close()  # the post in flight fails now, and the source's stop ends the recorder
        source.stop()


def test_a_full_queue_drops_and_counts_and_stop_ends_the_worker(hanging: HangingServer) -> None:
    client = make_api_client(master=f"http://127.0.0.1:{hanging.port}")
    rec = EventRecorder(client, NODE, timeout=HTTP_TIMEOUT, queue_size=4)
    try:
        sink = rec.sink()
        sink(REASON, "first", NamespacedName("default", "s0"))
        assert hanging.wait_requests(1)  # in flight, and hanging: the queue is empty again
        start = time.monotonic()
        for i in range(1, 8):
            sink(REASON, "more", NamespacedName("default", f"s{i}"))
        assert time.monotonic() - start < 2.0
        assert rec.dropped == 3 and rec.recorded == 0  # 4 queued behind the hanging one, 3 did not fit
        assert not rec.flush(0.2)  # nothing went through
    finally:
        hanging.close()
        rec.stop(timeout=10)
        client.close()
    assert rec._worker is not None and not rec._worker.is_alive()
    assert rec.dropped + rec.failed == 8 and rec.recorded == 0  # queued ones dropped at stop, or failed


def test_repeats_are_posted_once_per_interval_with_a_count(api: ApiServer) -> None:
    client = make_api_client(master=api.url)
    now = [1000.0]
    rec = EventRecorder(client, NODE, interval=300.0, clock=lambda: now[0])
    sink = rec.sink()
    web, db = NamespacedName("default", "web"), NamespacedName("default", "db")
    try:
        for _ in range(5):
            sink(REASON, "failed to start healthcheck default/web on port 30001: in use", web)
        sink(REASON, "failed to start healthcheck default/db on port 30002: in use", db)
        assert rec.flush(10)
        events = events_about(api)
        assert sorted(e["regarding"]["name"] for e in events) == ["db", "web"]
        assert rec.suppressed == 4 and rec.recorded == 2
        ev = next(e for e in events if e["regarding"]["name"] == "web")
        # upstream's health-check event: regarding the Service, UID namespace/name, action Listen, in its namespace
        assert ev["regarding"] == {"kind": "Service", "apiVersion": "v1", "namespace": "default", "name": "web",
                                   "uid": "default/web"}  # fmt: skip
        assert (ev["type"], ev["reason"], ev["action"]) == ("Warning", REASON, "Listen")
        assert ev["metadata"]["namespace"] == "default" and "series" not in ev

        now[0] += 299.0
        sink(REASON, "still in use", web)
        assert rec.flush(10) and len(events_about(api)) == 2  # still within the interval
        now[0] += 2.0
        sink(REASON, "still in use", web)
        assert rec.flush(10)
        latest = [e for e in events_about(api) if e["regarding"]["name"] == "web" and "series" in e]
        assert len(latest) == 1 and latest[0]["series"]["count"] == 6  # 5 suppressed + this one
        assert latest[0]["note"] == "still in use"
    finally:
        rec.stop()
        client.close()


def events_about(api: ApiServer) -> list[dict[str, Any]]:
    items, _rv = api.store.list("events.k8s.io", "default")
    return [e for e in items if e.get("regarding", {}).get("kind") == "Service"]
