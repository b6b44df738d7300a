"""Hostile clients against the real servers on loopback: slow, oversized, malformed and too many connections.

Each test drives real sockets at ``HealthzServer`` (``:10256``), the healthCheckNodePort servers or the metrics
server and checks that they answer what they should (400, 431, 503), that their threads and memory stay bounded,
and that ``/healthz`` and another service's health check still answer 200 meanwhile. Client counts are small and
every wait is bounded (socket timeouts, ``eventually``).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from kproxy.metrics import Metrics
from kproxy.model import IPFamily, NamespacedName
from kproxy.server.health import ProxyHealth
from kproxy.server.http import HealthzServer, MetricsServer
from kproxy.server.service_health import ServiceHealthServer

V4 = IPFamily.V4
A = NamespacedName("default", "web")
B = NamespacedName("shop", "cart")
HOST = "127.0.0.1"
# A request head that never ends: what a slowloris client has sent so far.
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: "


def get(port: int, path: str = "/healthz") -> int:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def settled(server: object, connections: int = 0) -> bool:
    """``server`` has taken in at least ``connections`` connections (admitted or refused: none is left in the listen
    backlog) and none it evicted is still closing. Always true for a server without an admission book."""
    admission = getattr(server, "admission", None)
    if admission is None:
        return True
    return admission.admitted + admission.refusals >= connections and admission.counts()[1] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` and read everything the server answers until it closes (or 5 s pass)."""
    with socket.create_connection((HOST, port), timeout=5) as sock:
        sock.sendall(raw)
        chunks = []
        try:
            while data := sock.recv(65536):
                chunks.append(data)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def slow_clients(stack: ExitStack, port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each sent the start of a request head and then nothing."""
    socks = []
    for _ in range(count):
        sock = stack.enter_context(socket.create_connection((HOST, port), timeout=5))
        try:
            sock.sendall(PARTIAL)
        except OSError:  # refused (503) or already evicted: the server closed it, as it may
            pass
        socks.append(sock)
    return socks


@pytest.fixture
def healthz() -> Iterator[HealthzServer]:
    health = ProxyHealth([V4], 60.0)
    health.updated(V4)
    server = HealthzServer(f"{HOST}:0", health, Metrics())
    server.start()
    yield server
    server.close()


@pytest.fixture
def services() -> Iterator[tuple[ServiceHealthServer, int, int]]:
    health = ProxyHealth([V4], 60.0)
    health.updated(V4)
    server = ServiceHealthServer([HOST], health)
    pa, pb = free_port(), free_port()
    server.sync_services({A: pa, B: pb})
    server.sync_endpoints({A: 1, B: 1})
    yield server, pa, pb
    server.close()


MALFORMED = [
    (b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n", b"400 Bad Request"),
    (b"GET /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n", b"400 Bad Request"),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"400 Bad Request"),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxy", b"400 Bad Request"),
    (b"POST / HTTP/1.1\r\nContent-Length: \xd9\xa3\r\n\r\n", b"400 Bad Request"),  # an Arabic-Indic digit
    (b"GARBAGE\r\n\r\n", b"400 Bad Request"),
    (b"GET / HTTP/x.y\r\n\r\n", b"400 Bad Request"),
    (b"GET /\r\n\r\n", b"400 Bad Request"),  # HTTP/0.9
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", b"501 Not Implemented"),
]


@pytest.mark.parametrize("which", ["healthz", "service"])
def test_malformed_requests_get_a_400_and_no_traceback(
    which: str, healthz: HealthzServer, services: tuple[ServiceHealthServer, int, int], capfd: Any, caplog: Any
) -> None:
    port = healthz.port if which == "healthz" else services[1]
    caplog.set_level("DEBUG")
    for raw, status in MALFORMED:
        answer = exchange(port, raw)
        assert answer.startswith(b"HTTP/1.1 " + status), (raw, answer)
        assert b"Connection: close" in answer and b"Content-Type: text/plain; charset=utf-8" in answer
    # A well-formed POST with a small body still works, and the connection stays usable.
    answer = exchange(port, b"POST /healthz HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= 30]
    assert get(healthz.port) == 200 and get(services[2]) == 200


@pytest.mark.parametrize("which", ["healthz", "service"])
def test_oversized_heads_get_431_and_memory_stays_bounded(
    which: str, healthz: HealthzServer, services: tuple[ServiceHealthServer, int, int]
) -> None:
    """Ten clients each send ~5.7 MB of header lines (95 of 60 KB, under http.server's own limits of 100 lines of
    64 KiB) and then stall: each gets a 431 after 16 KiB, and the servers' Python memory grows by far less than
    what was sent."""
    port = healthz.port if which == "healthz" else services[1]
    line = b"X-Big: " + b"a" * 60_000 + b"\r\n"
    answers: list[bytes] = []

    def client() -> None:
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sending = threading.Thread(target=_send_quietly, args=(sock, [PARTIAL[:-8]] + [line] * 95), daemon=True)
            sending.start()
            try:
                answers.append(sock.recv(4096))
            except OSError as exc:
                answers.append(repr(exc).encode())
            sending.join(5)

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        clients = [threading.Thread(target=client, daemon=True) for _ in range(10)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(10)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(answers) == 10 and all(a.startswith(b"HTTP/1.1 431 ") for a in answers), answers[:2]
    # 10 x 5.7 MB were sent; the servers may hold about 20 KB per connection (plus the test's own 60 KB line).
    assert peak < 4_000_000, f"Python memory grew by {peak} bytes"
    assert get(healthz.port) == 200 and get(services[2]) == 200


def _send_quietly(sock: socket.socket, parts: list[bytes]) -> None:
    try:
        for part in parts:
            sock.sendall(part)
    except OSError:  # the server answered 431 and closed: expected
        pass


def test_slowloris_is_cut_off_by_a_whole_request_deadline(healthz: HealthzServer) -> None:
    """A client that dribbles its head a byte at a time (each recv() succeeding) is closed once the whole-request
    deadline passes, not kept for as long as it keeps dribbling."""
    healthz.request_deadline = 1.0  # the server's own is 10 s
    head = PARTIAL + b"x" * 40 + b"\r\n\r\n"
    with socket.create_connection((HOST, healthz.port), timeout=5) as sock:
        started = time.monotonic()
        sent = 0
        closed = False
        for byte in head:  # bounded: at 50 ms a byte the whole head takes about 4.5 s
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sent += 1
            readable, _, _ = select.select([sock], [], [], 0.05)  # the dribble's pace, and the event we wait for
            if readable:
                closed = sock.recv(4096) == b""
                break
        elapsed = time.monotonic() - started
    assert closed and sent < len(head), f"still connected after {sent} bytes and {elapsed:.1f} s"
    assert 0.8 <= elapsed < 3.0 and sent > 5  # many successful reads, one deadline for all of them
    assert get(healthz.port) == 200


def test_healthz_answers_while_slow_clients_exceed_its_limit(healthz: HealthzServer) -> None:
    """Twice as many slowloris connections as the server's limit: the oldest waiting ones are evicted, a real
    /healthz still gets 200, and the server's threads stay bounded (no thread per connection)."""
    limit = getattr(healthz, "max_connections", 64)
    before = threading.active_count()
    with ExitStack() as stack:
        slow = slow_clients(stack, healthz.port, 2 * limit)
        eventually(lambda: settled(healthz, 2 * limit))
        # Evicted connections close at once: what is left is at most one thread per connection of the limit.
        eventually(lambda: threading.active_count() - before <= limit)
        assert get(healthz.port) == 200
        eventually(lambda: settled(healthz))
        assert get(healthz.port, "/livez") == 200
        eventually(lambda: threading.active_count() - before <= limit)
        # The oldest slow client was closed by the server to make room, and every one past the limit made room
        # (evicting an older one) or, while too many evicted ones were still closing, got a 503.
        assert _closed_by_server(slow[0])
        assert healthz.admission.evictions + healthz.admission.refusals >= limit


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (evicted: at once; refused: after a 503), waiting at most 5 s."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_one_services_slow_clients_do_not_starve_another(services: tuple[ServiceHealthServer, int, int]) -> None:
    """The issue's case: more slow clients against service A than all services' connections together: A's own
    checker and service B's still get 200, and A holds no more threads than its budget."""
    from kproxy.server import service_health

    budget = getattr(service_health, "PER_SERVICE_CONNECTIONS", 16)
    server, pa, pb = services
    before = threading.active_count()
    with ExitStack() as stack:
        slow_clients(stack, pa, service_health.MAX_CONNECTIONS + 8)
        eventually(lambda: settled(server, service_health.MAX_CONNECTIONS + 8))
        assert get(pb) == 200  # B has a budget of its own
        eventually(lambda: threading.active_count() - before <= budget)
        eventually(lambda: settled(server))
        assert get(pa) == 200  # a slow client of A was evicted to make room
        eventually(lambda: threading.active_count() - before <= budget)


def test_all_services_under_slow_clients_still_answer(monkeypatch: Any) -> None:
    """Slow clients against every service fill the server-wide cap: a checker of any service still gets its 200
    (room is made in the service holding the most connections)."""
    from kproxy.server import service_health

    # Small numbers, the same rule: 3 services x budget 4, at most 6 connections in all.
    monkeypatch.setattr(service_health, "PER_SERVICE_CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(service_health, "MAX_CONNECTIONS", 6)
    monkeypatch.setattr(service_health, "EVICTING_SPARE", 3, raising=False)
    health = ProxyHealth([V4], 60.0)
    health.updated(V4)
    before = threading.active_count()
    server = ServiceHealthServer([HOST], health)
    c = NamespacedName("default", "db")
    ports = {A: free_port(), B: free_port(), c: free_port()}
    try:
        server.sync_services(ports)
        server.sync_endpoints(dict.fromkeys(ports, 1))
        with ExitStack() as stack:
            for port in ports.values():
                slow_clients(stack, port, 4)
            eventually(lambda: settled(server, 12))
            eventually(lambda: threading.active_count() - before <= 6 + 1)  # and the acceptor thread
            for port in ports.values():
                eventually(lambda: settled(server))
                assert get(port) == 200
            eventually(lambda: threading.active_count() - before <= 6 + 1)
    finally:
        server.close()


def test_excess_connections_get_a_fast_503_and_no_thread(monkeypatch: Any) -> None:
    """When every connection is busy being answered (none can be evicted), a new one is answered 503 by the
    accept loop itself and closed: no thread is started for it."""
    entered = threading.Semaphore(0)
    release = threading.Event()

    def trace(query: Any) -> dict[str, Any]:
        entered.release()
        release.wait(10)
        return {"ok": True}

    class Small(MetricsServer):
        max_connections = 3

    server = Small(f"{HOST}:0", Metrics([V4]), "fake", configz=dict, rules=lambda s: {}, trace=trace)
    server.start()
    results: list[object] = []

    def client() -> None:
        try:
            results.append(get(server.port, "/trace"))
        except Exception as exc:  # noqa: BLE001 - recorded, and the assertion below shows it
            results.append(exc)

    try:
        busy = [threading.Thread(target=client, daemon=True) for _ in "abc"]
        for t in busy:
            t.start()
        for _ in busy:
            assert entered.acquire(timeout=5)
        threads_before = threading.active_count()
        answer = exchange(server.port, b"")  # connect and wait: the 503 comes unasked
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        assert b"Retry-After: 1" in answer and answer.endswith(b"too many connections\n")
        assert threading.active_count() == threads_before
        assert server.admission.refusals >= 1
        release.set()
        for t in busy:
            t.join(5)
        assert results == [200, 200, 200]
        eventually(lambda: server.admission.counts()[0] == 0)  # their threads have finished
        assert get(server.port, "/healthz") == 200
    finally:
        release.set()
        server.close()


@pytest.fixture
def rules_server(monkeypatch: Any) -> Iterator[tuple[MetricsServer, dict[str, Any]]]:
    from kproxy.server import http as http_module

    monkeypatch.setattr(http_module, "EXPENSIVE_WAIT", 0.2, raising=False)
    state: dict[str, Any] = {"active": 0, "most": 0, "calls": 0, "entered": threading.Event(), "gate": None}
    lock = threading.Lock()
    names = ["ns/e:p", "ns/a:p", "ns/d:p", "ns/b:p", "ns/c:p"]

    def rules(service: str | None) -> dict[str, Any]:
        with lock:
            state["active"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["active"])
        try:
            gate = state["gate"]
            if gate is not None:
                state["gate"] = None
                state["entered"].set()
                gate.wait(10)
            wanted = [n for n in names if service is None or n.startswith(service)]
            return {
                "mode": "fake",
                "backend": {
                    "services": {n: {"IPv4": {"n": n}} for n in wanted},
                    "detail": {"services": {n: {"rules": [n]} for n in wanted}, "chains": 3},
                },
            }
        finally:
            with lock:
                state["active"] -= 1

    server = MetricsServer(f"{HOST}:0", Metrics([V4]), "fake", configz=dict, rules=rules, verify=lambda: rules(None))
    server.start()
    yield server, state
    server.close()


def _json(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_rules_and_verify_are_produced_one_at_a_time(rules_server: tuple[MetricsServer, dict[str, Any]]) -> None:
    server, state = rules_server
    gate = threading.Event()
    state["gate"] = gate
    first: list[int] = []
    t = threading.Thread(target=lambda: first.append(_json(server.port, "/rules")[0]), daemon=True)
    t.start()
    try:
        assert state["entered"].wait(5)  # the first /rules is being produced (and holds the turn)
        for path in ("/rules", "/verify", "/rules?service=ns/a"):
            status, body = _json(server.port, path)
            assert status == 503 and "busy" in body["error"], (path, body)
        assert get(server.port, "/healthz") == 200  # cheap routes do not wait
    finally:
        gate.set()
        t.join(5)
    assert first == [200]
    assert _json(server.port, "/verify")[0] == 200
    assert state["most"] == 1 and state["calls"] == 2


def test_rules_pages(rules_server: tuple[MetricsServer, dict[str, Any]]) -> None:
    server = rules_server[0]
    status, body = _json(server.port, "/rules?limit=2")
    assert status == 200
    assert list(body["backend"]["services"]) == ["ns/a:p", "ns/b:p"]
    assert list(body["backend"]["detail"]["services"]) == ["ns/a:p", "ns/b:p"]
    assert body["backend"]["detail"]["chains"] == 3
    assert body["page"] == {"offset": 0, "limit": 2, "total": 5, "next": 2}
    status, body = _json(server.port, "/rules?limit=2&page=3")
    assert list(body["backend"]["services"]) == ["ns/e:p"] and body["page"]["next"] is None
    status, body = _json(server.port, "/rules?offset=1&limit=3")
    assert list(body["backend"]["services"]) == ["ns/b:p", "ns/c:p", "ns/d:p"]
    assert body["page"] == {"offset": 1, "limit": 3, "total": 5, "next": 4}
    status, body = _json(server.port, "/rules?service=ns/c&limit=10")
    assert list(body["backend"]["services"]) == ["ns/c:p"] and body["page"]["total"] == 1
    status, body = _json(server.port, "/rules")  # no paging asked: whole, no page object
    assert len(body["backend"]["services"]) == 5 and "page" not in body
    for bad in ("limit=0", "limit=abc", "offset=-1", "page=0", "offset=1&page=2&limit=1", "limit=9999999999"):
        status, body = _json(server.port, "/rules?" + bad)
        assert status == 400 and body["error"], bad


def test_admission_rules() -> None:
    """The admission book on its own (socket pairs stand in for connections): per-key and total limits, eviction
    of the oldest waiting connection (from the key itself, else from the fullest key), busy ones never evicted,
    at most ``spare`` evicted connections still closing, and "crowded" near a limit."""
    from kproxy.server.connections import Admission

    book = Admission(per_key=2, limit=3, spare=1)
    with ExitStack() as stack:

        def conn() -> socket.socket:
            ours, theirs = socket.socketpair()
            stack.enter_context(ours)
            stack.enter_context(theirs)
            return ours

        a1, a2 = book.admit("a", conn()), book.admit("a", conn())
        assert a1 is not None and a2 is not None and not a1.evicted
        assert a1.crowded()  # 2 of 2 for "a"
        a3 = book.admit("a", conn())  # "a" is full: its oldest waiter goes
        assert a3 is not None and a1.evicted and not a2.evicted
        assert book.counts() == (3, 1)
        assert book.admit("a", conn()) is None  # the one evicted is still closing: no more spare
        a1.release()
        assert book.counts() == (2, 0)
        a2.busy()
        a3.busy()
        b1 = book.admit("b", conn())
        assert b1 is not None  # 3 of 3 in all
        assert book.admit("a", conn()) is None  # "a" full and all its connections busy
        b1.waiting()
        c1 = book.admit("c", conn())  # all full: the fullest key with a waiter is "b"
        assert c1 is not None and b1.evicted
        assert book.refusals == 2 and book.evictions == 2
        for t in (a2, a3, b1, c1):
            t.release()
        assert book.counts() == (0, 0)
