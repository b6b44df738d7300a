"""kproxy's two always-on HTTP servers, and the listening-socket helper the service health servers share.

``HealthzServer`` (upstream default ``0.0.0.0:10256``) answers ``/healthz`` and ``/livez`` from ``ProxyHealth``
with upstream's status codes, headers and JSON, and counts ``kubeproxy_proxy_healthz_total{code}`` /
``kubeproxy_proxy_livez_total{code}``. ``MetricsServer`` (upstream default ``127.0.0.1:10249``) serves
``/metrics`` (Prometheus text from kproxy's own registry), ``/proxyMode`` (the mode name as plain text),
``/configz`` (the effective KubeProxyConfiguration under its API group name, as upstream's configz handler does),
``/healthz`` (plain ``ok``) and kproxy's ``/rules[?service=ns/name:port]`` (how services are programmed, as JSON).
Any other path gets Go's ``404 page not found``.

Threads, not asyncio: each server is a ``ThreadingHTTPServer`` in a daemon thread, one short-lived daemon thread
per connection; handlers only read thread-safe objects (health, metrics, the callables they were given). Access
logs go to this module's logger at debug level. Wildcard binds (``0.0.0.0``, ``::`` or an empty host) listen
dual-stack on ``[::]`` when the host has IPv6, as Go's listener does, and on ``0.0.0.0`` otherwise.

Who uses it: the daemon (starts both), ``service_health`` (``listen_socket``), tests.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import generate_latest

from kproxy.config import parse_hostport
from kproxy.metrics import Metrics
from kproxy.server.health import ProxyHealth

log = logging.getLogger(__name__)

# What Go's promhttp sends for the classic text format (prometheus-client's own default is newer).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
CONFIGZ_GROUP = "kubeproxy.config.k8s.io"  # upstream registers its configz under the API group name
_WILDCARDS = ("", "0.0.0.0", "::")
_IDLE_TIMEOUT = 30.0  # seconds a kept-alive connection may sit idle
_SHUTDOWN_POLL = 0.1  # seconds: how quickly close() stops the accept loop (socketserver polls for shutdown)


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 literal; a wildcard means every address).

    Raises OSError (e.g. EADDRINUSE) when the address cannot be bound.
    """
    if host in _WILDCARDS:
        if socket.has_ipv6:
            try:
                return _bind(socket.AF_INET6, "::", port, backlog, dual_stack=True)
            except OSError as exc:
                if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                    raise
        return _bind(socket.AF_INET, "0.0.0.0", port, backlog)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bind(family, host, port, backlog)


def _bind(family: socket.AddressFamily, host: str, port: int, backlog: int, dual_stack: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class Response:
    """What a route returns: status, content type, body, extra headers."""

    __slots__ = ("status", "content_type", "body", "headers")

    def __init__(self, status: int, content_type: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.content_type = content_type
        self.body = body
        self.headers = dict(headers or {})


def json_response(status: int, obj: Any, compact: bool = True) -> Response:
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2, sort_keys=False)
    return Response(status, JSON, text.encode(), {"X-Content-Type-Options": "nosniff"})


NOT_FOUND = Response(404, TEXT, b"404 page not found\n", {"X-Content-Type-Options": "nosniff"})


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that answers every method through ``respond`` and logs at debug level only."""

    protocol_version = "HTTP/1.1"
    timeout = _IDLE_TIMEOUT
    # One buffered write per response (flushed by handle_one_request) and no Nagle: otherwise headers and body
    # go out as two segments and a keep-alive client waits ~40 ms for the delayed ACK on every request.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True
    server_version = "kproxy"
    sys_version = ""

    def respond(self) -> Response:  # overridden
        return NOT_FOUND

    def _serve(self, send_body: bool = True) -> None:
        try:
            resp = self.respond()
        except Exception:
            log.exception("HTTP handler for %s failed", self.path)
            resp = Response(500, TEXT, b"internal error\n")
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        for name, value in resp.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(resp.body)))
        self.end_headers()
        if send_body:
            self.wfile.write(resp.body)

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_POST(self) -> None:
        self._drain_body()
        self._serve()

    do_PUT = do_POST
    do_DELETE = do_GET
    do_OPTIONS = do_GET

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= 1 << 20:
            self.rfile.read(length)
        elif length:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer around a socket we bound ourselves (no reverse DNS in server_bind)."""

    daemon_threads = True

    def __init__(self, sock: socket.socket, handler: type[BaseHTTPRequestHandler]) -> None:
        address = sock.getsockname()
        socketserver.BaseServer.__init__(self, address, handler)
        self.socket = sock
        self.address_family = sock.family
        self.server_name = str(address[0])
        self.server_port = int(address[1])


class _BackgroundServer:
    """Common start/close/port for the two servers."""

    name = "http"

    def __init__(self, bind: str) -> None:
        self.bind = bind
        self.host, self._requested_port = parse_hostport(bind, self.name)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def _handler(self) -> type[QuietHandler]:
        raise NotImplementedError

    def start(self) -> None:
        """Bind and serve in a daemon thread. OSError if the address cannot be bound."""
        if self._server is not None:
            return
        sock = listen_socket(self.host, self._requested_port)
        self._server = _Server(sock, self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(_SHUTDOWN_POLL,), name=f"{self.name}-server", daemon=True
        )
        self._thread.start()
        log.info("%s server listening on %s", self.name, self.address)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); before start(), the configured one."""
        return self._server.server_port if self._server is not None else self._requested_port

    @property
    def address(self) -> str:
        """``HOST:PORT`` actually bound, IPv6 in brackets."""
        host = self._server.server_name if self._server is not None else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def close(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(5)


class HealthzServer(_BackgroundServer):
    """``/healthz`` and ``/livez`` exactly as upstream's proxy health server answers them."""

    name = "healthz"

    def __init__(self, bind: str, health: ProxyHealth, metrics: Metrics) -> None:
        super().__init__(bind)
        self.health = health
        self.metrics = metrics

    def _handler(self) -> type[QuietHandler]:
        health, metrics = self.health, self.metrics

        class Handler(QuietHandler):
            def respond(self) -> Response:
                path = urlsplit(self.path).path
                if path == "/healthz":
                    code, body = health.healthz()
                    metrics.count_healthz(code)
                elif path == "/livez":
                    code, body = health.livez()
                    metrics.count_livez(code)
                else:
                    return NOT_FOUND
                return json_response(code, body)

        return Handler


def _answer(produce: Callable[[], dict[str, Any]]) -> Response:
    """JSON of ``produce()``; ValueError -> 400, LookupError -> 404, both with the message."""
    try:
        return json_response(200, produce(), compact=False)
    except ValueError as exc:
        return json_response(400, {"error": str(exc)})
    except LookupError as exc:
        return json_response(404, {"error": str(exc)})


class MetricsServer(_BackgroundServer):
    """``/metrics``, ``/proxyMode``, ``/configz``, ``/healthz``, ``/rules`` and ``/trace``.

    ``configz()`` returns the effective KubeProxyConfiguration as a dict (served as
    ``{"kubeproxy.config.k8s.io": ...}``). ``rules(service)`` returns how services are programmed, for one service
    (``ns/name:port`` from ``?service=``) or all (None); it may raise ValueError (400) or LookupError (404).
    ``trace(query)`` (optional) answers ``/trace?src=IP&dst=IP&dport=N&proto=tcp[&src_local=1][&dst_local=1]``:
    where such a packet would go; same error mapping.
    """

    name = "metrics"

    def __init__(
        self,
        bind: str,
        metrics: Metrics,
        mode: str,
        configz: Callable[[], dict[str, Any]],
        rules: Callable[[str | None], dict[str, Any]],
        trace: Callable[[Mapping[str, str]], dict[str, Any]] | None = None,
        verify: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(bind)
        self.metrics = metrics
        self.mode = mode
        self.configz = configz
        self.rules = rules
        self.trace = trace
        self.verify = verify

    def _handler(self) -> type[QuietHandler]:
        outer = self

        class Handler(QuietHandler):
            def respond(self) -> Response:
                parts = urlsplit(self.path)
                nosniff = {"X-Content-Type-Options": "nosniff"}
                if parts.path == "/metrics":
                    return Response(200, METRICS_CONTENT_TYPE, generate_latest(outer.metrics.registry))
                if parts.path == "/proxyMode":
                    return Response(200, TEXT, outer.mode.encode(), nosniff)
                if parts.path == "/healthz":
                    return Response(200, TEXT, b"ok", nosniff)
                if parts.path == "/configz":
                    return json_response(200, {CONFIGZ_GROUP: outer.configz()})
                if parts.path == "/rules":
                    values = parse_qs(parts.query).get("service") or [""]
                    service = values[0] or None
                    return _answer(lambda: outer.rules(service))
                if parts.path == "/verify" and outer.verify is not None:
                    return _answer(outer.verify)
                if parts.path == "/trace" and outer.trace is not None:
                    query = {k: v[0] for k, v in parse_qs(parts.query).items() if v}
                    trace = outer.trace
                    return _answer(lambda: trace(query))
                return NOT_FOUND

        return Handler
