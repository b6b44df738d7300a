"""The HTTP servers over real loopback sockets: healthz/livez, the metrics server, per-service health checks."""

from __future__ import annotations

import http.client
import json
import re
import socket
from collections.abc import Iterator

import pytest

from kproxy.metrics import Metrics
from kproxy.model import IPFamily, NamespacedName
from kproxy.server.health import ProxyHealth
from kproxy.server.http import HealthzServer, MetricsServer, listen_socket
from kproxy.server.service_health import ServiceHealthServer, health_body

V4, V6 = IPFamily.V4, IPFamily.V6
HAS_V6 = socket.has_ipv6


def _ipv6_loopback() -> bool:
    if not HAS_V6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_v6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")


def request(host: str, port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- /healthz and /livez --------------------------------------------------------------------------------------


@pytest.fixture
def healthz() -> Iterator[tuple[HealthzServer, ProxyHealth, Metrics, Clock]]:
    clock = Clock()
    health = ProxyHealth([V4, V6], 60.0, clock=clock)
    metrics = Metrics()
    server = HealthzServer("127.0.0.1:0", health, metrics)
    server.start()
    yield server, health, metrics, clock
    server.close()


def test_healthz_and_livez_codes_headers_bodies_and_counters(healthz) -> None:
    server, health, metrics, clock = healthz
    assert server.port != 0 and server.address == f"127.0.0.1:{server.port}"

    # Not synced yet: /healthz is 503 (a node whose rules are not programmed is not ready), /livez is 200.
    status, headers, body = request("127.0.0.1", server.port, "/healthz")
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert json.loads(body) == {
        "lastUpdated": "0001-01-01T00:00:00Z",
        "currentTime": "2023-11-14T22:13:20Z",
        "nodeEligible": True,
        "healthy": False,
    }
    assert request("127.0.0.1", server.port, "/livez")[0] == 200

    health.updated(V4)
    health.updated(V6)
    status, headers, body = request("127.0.0.1", server.port, "/healthz")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    doc = json.loads(body)
    assert (doc["lastUpdated"], doc["currentTime"], doc["nodeEligible"], doc["healthy"]) == (
        "2023-11-14T22:13:20Z",
        "2023-11-14T22:13:20Z",
        True,
        True,
    )

    health.queued_update(V4)
    clock.now += 60
    status, _, body = request("127.0.0.1", server.port, "/healthz")
    assert status == 503 and json.loads(body)["status"]["IPv4"]["healthy"] is False
    status, _, body = request("127.0.0.1", server.port, "/livez")
    assert status == 503 and "nodeEligible" not in json.loads(body)

    health.updated(V4)
    health.set_node_eligible(False)
    assert request("127.0.0.1", server.port, "/healthz")[0] == 503
    assert request("127.0.0.1", server.port, "/livez?x=1")[0] == 200

    assert metrics.value("kubeproxy_proxy_healthz_total", {"code": "200"}) == 1
    assert metrics.value("kubeproxy_proxy_healthz_total", {"code": "503"}) == 3
    assert metrics.value("kubeproxy_proxy_livez_total", {"code": "503"}) == 1
    assert metrics.value("kubeproxy_proxy_livez_total", {"code": "200"}) == 2

    status, headers, body = request("127.0.0.1", server.port, "/metrics")
    assert status == 404 and body == b"404 page not found\n"


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response from ``sock`` read with a single recv(): (head, body). The body is whole only if the server
    wrote the response in one go (see the keep-alive test)."""
    data = sock.recv(65536)
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data
    return head, body


def test_healthz_keep_alive_and_head(healthz) -> None:
    server, health = healthz[0], healthz[1]
    health.updated(V4)
    health.updated(V6)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for _ in range(20):  # one connection, several requests
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
            # Waits for the answer, not a clock: the whole response must come in the first segment. Headers and body
            # written apart would leave the body behind Nagle and the client's delayed ACK (~40 ms per request).
            head, body = read_answer(sock)
            assert head.startswith(b"HTTP/1.1 200 "), head
            length = int(re.search(rb"\r\nContent-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
            assert len(body) == length and json.loads(body)["healthy"] is True
        sock.sendall(b"HEAD /livez HTTP/1.1\r\nHost: test\r\n\r\n")
        head, body = read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200 ") and body == b""


@needs_v6
def test_healthz_binds_ipv6_literal() -> None:
    health = ProxyHealth([V6], 10.0)
    health.updated(V6)
    server = HealthzServer("[::1]:0", health, Metrics())
    server.start()
    try:
        assert server.address == f"[::1]:{server.port}"
        assert request("::1", server.port, "/healthz")[0] == 200
    finally:
        server.close()


@needs_v6
def test_wildcard_bind_is_dual_stack() -> None:
    server = HealthzServer("0.0.0.0:0", ProxyHealth([V4], 10.0), Metrics())
    server.start()
    try:
        assert request("127.0.0.1", server.port, "/livez")[0] == 200
        assert request("::1", server.port, "/livez")[0] == 200
    finally:
        server.close()


def test_close_releases_the_port() -> None:
    server = HealthzServer("127.0.0.1:0", ProxyHealth([V4], 10.0), Metrics())
    server.start()
    port = server.port
    server.close()
    assert refused("127.0.0.1", port)
    listen_socket("127.0.0.1", port).close()  # bindable again at once


# ---- the metrics server ---------------------------------------------------------------------------------------


@pytest.fixture
def metrics_server() -> Iterator[tuple[MetricsServer, Metrics, list[str | None]]]:
    metrics = Metrics([V4])
    asked: list[str | None] = []

    def rules(service: str | None) -> dict[str, object]:
        asked.append(service)
        if service == "bad":
            raise ValueError("service must be ns/name[:port]")
        if service == "default/missing":
            raise KeyError("default/missing")
        return {"mode": "fake", "services": {service or "*": {"IPv4": {"clusterIP": "198.18.0.10"}}}}

    server = MetricsServer(
        "127.0.0.1:0",
        metrics,
        "iptables",
        configz=lambda: {"kind": "KubeProxyConfiguration", "mode": "iptables"},
        rules=rules,
    )
    server.start()
    yield server, metrics, asked
    server.close()


def test_metrics_endpoint(metrics_server) -> None:
    server, metrics, _ = metrics_server
    metrics.observe_sync(V4, 0.01, full=True)
    status, headers, body = request("127.0.0.1", server.port, "/metrics")
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    assert "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram" in text
    assert 'kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1.0' in text
    assert "# TYPE kubeproxy_proxy_healthz_total counter" in text


def test_proxymode_healthz_configz(metrics_server) -> None:
    server = metrics_server[0]
    status, headers, body = request("127.0.0.1", server.port, "/proxyMode")
    assert (status, body) == (200, b"iptables")
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert request("127.0.0.1", server.port, "/healthz")[2] == b"ok"
    status, headers, body = request("127.0.0.1", server.port, "/configz")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"kubeproxy.config.k8s.io": {"kind": "KubeProxyConfiguration", "mode": "iptables"}}
    assert request("127.0.0.1", server.port, "/nothing")[0] == 404


def test_rules_endpoint(metrics_server) -> None:
    server, _, asked = metrics_server
    status, _, body = request("127.0.0.1", server.port, "/rules")
    assert status == 200 and "*" in json.loads(body)["services"]
    status, _, body = request("127.0.0.1", server.port, "/rules?service=default/web:http")
    assert status == 200 and "default/web:http" in json.loads(body)["services"]
    assert request("127.0.0.1", server.port, "/rules?service=bad")[0] == 400
    assert request("127.0.0.1", server.port, "/rules?service=default/missing")[0] == 404
    assert asked == [None, "default/web:http", "bad", "default/missing"]


# ---- per-service health check servers -------------------------------------------------------------------------

A = NamespacedName("default", "web")
B = NamespacedName("shop", "cart")


@pytest.fixture
def hc() -> Iterator[tuple[ServiceHealthServer, ProxyHealth, Clock, list[tuple[NamespacedName, int, str]]]]:
    clock = Clock()
    health = ProxyHealth([V4], 10.0, clock=clock)
    errors: list[tuple[NamespacedName, int, str]] = []
    server = ServiceHealthServer(["127.0.0.1"], health, on_listen_error=lambda *a: errors.append(a))
    yield server, health, clock, errors
    server.close()


def test_service_health_codes_headers_and_body(hc) -> None:
    server, health, clock, errors = hc
    port = free_port()
    server.sync_services({A: port})
    status, headers, body = request("127.0.0.1", port, "/")
    assert status == 503
    assert headers["x-load-balancing-endpoint-weight"] == "0"
    assert headers["content-type"] == "application/json"
    assert headers["x-content-type-options"] == "nosniff"
    assert body == (
        b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "web"\n\t},\n'
        b'\t"localEndpoints": 0,\n\t"serviceProxyHealthy": true\n}'
    )

    server.sync_endpoints({A: 3, B: 9})  # B has no listener: ignored
    status, headers, body = request("127.0.0.1", port, "/any/path?at=all")
    assert status == 200 and headers["x-load-balancing-endpoint-weight"] == "3"
    assert json.loads(body) == {
        "service": {"namespace": "default", "name": "web"},
        "localEndpoints": 3,
        "serviceProxyHealthy": True,
    }
    assert server.services() == {A: (port, 3)}

    health.queued_update(V4)  # the proxy itself goes unhealthy: every service reports 503
    clock.now += 10
    status, headers, body = request("127.0.0.1", port, "/healthz")
    assert status == 503 and headers["x-load-balancing-endpoint-weight"] == "3"
    assert json.loads(body)["serviceProxyHealthy"] is False
    health.updated(V4)
    assert request("127.0.0.1", port, "/", method="HEAD")[0] == 200

    server.sync_endpoints({})  # not named: 0
    assert request("127.0.0.1", port, "/")[0] == 503
    assert errors == []


def test_service_removed_and_port_changed(hc) -> None:
    server = hc[0]
    p1, p2, p3 = free_port(), free_port(), free_port()
    server.sync_services({A: p1, B: p2})
    server.sync_endpoints({A: 1, B: 2})
    assert request("127.0.0.1", p1, "/")[0] == 200 and request("127.0.0.1", p2, "/")[0] == 200

    server.sync_services({A: p3})  # B removed, A moved
    assert refused("127.0.0.1", p1) and refused("127.0.0.1", p2)
    status, headers, _ = request("127.0.0.1", p3, "/")
    assert status == 503 and headers["x-load-balancing-endpoint-weight"] == "0"  # a new listener starts at 0
    server.sync_endpoints({A: 2})
    assert request("127.0.0.1", p3, "/")[0] == 200

    server.sync_services({})
    assert refused("127.0.0.1", p3)
    assert server.services() == {}


def test_listen_error_is_reported_and_other_services_unaffected(hc) -> None:
    server, _, _, errors = hc
    busy = listen_socket("127.0.0.1", 0)
    busy_port = busy.getsockname()[1]
    good = free_port()
    try:
        server.sync_services({A: busy_port, B: good})
        assert len(errors) == 1
        nsn, port, why = errors[0]
        assert (nsn, port) == (A, busy_port) and "in use" in why.lower()
        server.sync_endpoints({A: 1, B: 1})
        assert request("127.0.0.1", good, "/")[0] == 200
        assert set(server.services()) == {B}
    finally:
        busy.close()
    server.sync_services({A: busy_port, B: good})  # retried on the next sync, now that the port is free
    assert len(errors) == 1
    server.sync_endpoints({A: 4})
    status, headers, _ = request("127.0.0.1", busy_port, "/")
    assert status == 200 and headers["x-load-balancing-endpoint-weight"] == "4"


def test_listens_on_every_given_address() -> None:
    health = ProxyHealth([V4], 10.0)
    addresses = ["127.0.0.1", "127.0.0.2"]
    port = free_port()
    server = ServiceHealthServer(addresses, health)
    try:
        server.sync_services({A: port})
        assert sorted(server.bound(A)) == [("127.0.0.1", port), ("127.0.0.2", port)]
        server.sync_endpoints({A: 1})
        assert request("127.0.0.2", port, "/")[0] == 200
        assert refused("127.0.0.3", port)
    finally:
        server.close()
    assert refused("127.0.0.1", port)


@needs_v6
def test_no_addresses_means_every_address() -> None:
    port = free_port("::1")
    server = ServiceHealthServer([], ProxyHealth([V4, V6], 10.0))
    try:
        server.sync_services({A: port})
        server.sync_endpoints({A: 2})
        assert request("127.0.0.1", port, "/")[0] == 200
        assert request("::1", port, "/")[0] == 200
    finally:
        server.close()


def test_body_matches_upstream_template() -> None:
    assert health_body(B, 7, False).decode() == (
        '{\n\t"service": {\n\t\t"namespace": "shop",\n\t\t"name": "cart"\n\t},\n'
        '\t"localEndpoints": 7,\n\t"serviceProxyHealthy": false\n}'
    )
