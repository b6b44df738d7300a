"""kproxy's two always-on HTTP servers, and the listening-socket helper the service health servers share.

``HealthzServer`` (upstream default ``0.0.0.0:10256``) answers ``/healthz`` and ``/livez`` from ``ProxyHealth``
with upstream's status codes, headers and JSON, and counts ``kubeproxy_proxy_healthz_total{code}`` /
``kubeproxy_proxy_livez_total{code}``. ``MetricsServer`` (upstream default ``127.0.0.1:10249``) serves
``/metrics`` (Prometheus text from kproxy's own registry), ``/proxyMode`` (the mode name as plain text),
``/configz`` (the effective KubeProxyConfiguration under its API group name, as upstream's configz handler does),
``/healthz`` (plain ``ok``) and kproxy's own JSON: ``/rules`` (how services are programmed), ``/verify`` (the kernel
read back against the last sync) and ``/trace``. Any other path gets Go's ``404 page not found``.

``/rules`` query parameters: ``service=ns/name[:port][/PROTO]`` narrows the answer to one service (400 if
malformed, 404 if nothing matches); ``limit=N`` with ``offset=M`` (0-based) or ``page=P`` (1-based, ``limit``
defaulting to ``DEFAULT_PAGE_SIZE``) returns only that slice of the ``services`` mapping, keys in sorted order, with
``"page": {"offset", "limit", "total", "next"}`` added (``next`` is the offset of the following page, null on the
last). Without them the answer is whole, as before. ``/rules`` and ``/verify`` are produced one at a time.

Threads, not asyncio: each server's accept loop runs in a daemon thread and gives each admitted connection a
short-lived daemon thread; how many, and how much of a request is read, is bounded as ``connections`` describes
(hostile clients: slow, oversized, malformed, too many). Handlers only read thread-safe objects (health, metrics,
the callables they were given). Access logs go to the logger at debug level. Wildcard binds (``0.0.0.0``, ``::``
or an empty host) listen dual-stack on ``[::]`` when the host has IPv6, as Go's listener does, and on ``0.0.0.0``
otherwise.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kproxy.config import parse_hostport
from kproxy.metrics import Metrics
from kproxy.server.connections import Admission, BoundedHandler, start_connection
from kproxy.server.health import ProxyHealth

log = logging.getLogger(__name__)

# What Go's promhttp sends for the classic text format (prometheus-client's own default is newer).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
CONFIGZ_GROUP = "kubeproxy.config.k8s.io"  # upstream registers its configz under the API group name
_WILDCARDS = ("", "0.0.0.0", "::")
# How long a /rules or /verify request waits for the one before it (each can take seconds on a large node).
EXPENSIVE_WAIT = 10.0
DEFAULT_PAGE_SIZE = 100  # services per /rules page when ?page= is given without ?limit=
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

    def __init__(
        self,
        status: int,
        content_type: str,
        body: bytes | Sequence[bytes | bytearray],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.body = body
        self.headers = dict(headers or {})


def json_response(status: int, obj: Any, compact: bool = True) -> Response:
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2, sort_keys=False)
    return Response(status, JSON, text.encode(), {"X-Content-Type-Options": "nosniff"})


NOT_FOUND = Response(404, TEXT, b"404 page not found\n", {"X-Content-Type-Options": "nosniff"})


class QuietHandler(BoundedHandler):
    """A bounded request handler (see ``connections``) that answers every method through ``respond`` and logs at
    debug level only."""

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
        pieces = [resp.body] if isinstance(resp.body, bytes) else resp.body  # a long body comes in pieces
        self.send_header("Content-Length", str(sum(len(p) for p in pieces)))
        self.end_headers()
        if send_body:
            for piece in pieces:
                self.wfile.write(piece)  # type: ignore[arg-type]  # any buffer: a bytearray is not copied

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    do_POST = do_GET
    do_PUT = do_GET
    do_DELETE = do_GET
    do_OPTIONS = do_GET


class _Server(socketserver.TCPServer):
    """The accept loop around a socket we bound ourselves (no reverse DNS in server_bind): each connection gets a
    thread only if ``admission`` lets it in, else a canned 503 from this loop, which never waits on a client."""

    def __init__(self, sock: socket.socket, handler: type[QuietHandler], admission: Admission, name: str) -> None:
        address = sock.getsockname()
        socketserver.BaseServer.__init__(self, address, handler)
        sock.setblocking(False)  # a connection reset between select() and accept() must not block the loop
        self.socket = sock
        self.address_family = sock.family
        self.server_name = str(address[0])
        self.server_port = int(address[1])
        self.handler = handler
        self.admission = admission
        self.name = name

    def process_request(self, request: Any, client_address: Any) -> None:
        start_connection(self.admission, None, self.handler, request, client_address, self, self.name)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("%s server: accepting a connection from %s failed", self.name, client_address)


class _BackgroundServer:
    """Common start/close/port for the two servers."""

    name = "http"
    max_connections = 16

    def __init__(self, bind: str) -> None:
        self.bind = bind
        self.host, self._requested_port = parse_hostport(bind, self.name)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        # Room for this many evicted connections still closing: they are already shut down, so they go in
        # microseconds, and a crowd of new connections cannot push the thread count past max_connections + spare.
        spare = max(2, self.max_connections // 4)
        self.admission = Admission(self.max_connections, self.max_connections, spare)

    @property
    def request_deadline(self) -> float:
        """Seconds a connection has for each whole request (see ``connections.REQUEST_DEADLINE``)."""
        return self.admission.request_deadline

    @request_deadline.setter
    def request_deadline(self, seconds: float) -> None:
        self.admission.request_deadline = seconds

    def _handler(self) -> type[QuietHandler]:
        raise NotImplementedError

    def start(self) -> None:
        """Bind and serve in a daemon thread. OSError if the address cannot be bound."""
        if self._server is not None:
            return
        sock = listen_socket(self.host, self._requested_port)
        self._server = _Server(sock, self._handler(), self.admission, self.name)
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
    # Kubelet probes and a few load-balancer checkers per node, each a short request: 64 at once is ample, and the
    # eviction of waiting connections (see connections.Admission) keeps a slow crowd from taking them all.
    max_connections = 64

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


def _query_int(query: Mapping[str, list[str]], name: str, minimum: int) -> int | None:
    values = query.get(name)
    if not values:
        return None
    text = values[0].strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, not {values[0][:40]!r}")
    return int(text)


def parse_page(query: Mapping[str, list[str]]) -> tuple[int, int] | None:
    """``(offset, limit)`` from ``limit`` with ``offset`` or ``page`` (1-based), or None: no paging asked.

    ValueError (400) for a malformed number or for ``offset`` and ``page`` together."""
    limit = _query_int(query, "limit", 1)
    offset = _query_int(query, "offset", 0)
    page = _query_int(query, "page", 1)
    if offset is not None and page is not None:
        raise ValueError("give offset or page, not both")
    if limit is None and offset is None and page is None:
        return None
    size = limit if limit is not None else DEFAULT_PAGE_SIZE
    return (offset if offset is not None else ((page or 1) - 1) * size), size


def page_services(produced: dict[str, Any], offset: int, limit: int) -> dict[str, Any]:
    """``produced`` with its ``services`` mapping (top level, or under ``backend`` as the daemon's ``/rules`` has
    it) cut to ``limit`` service keys from ``offset`` in sorted order, the matching ``detail.services`` alongside,
    and a ``page`` object: ``{"offset", "limit", "total", "next"}`` (``next`` is the next offset, or null)."""
    out = dict(produced)
    holder = out
    if not isinstance(out.get("services"), Mapping) and isinstance(out.get("backend"), Mapping):
        holder = out["backend"] = dict(out["backend"])
    services = holder.get("services")
    keys = sorted(services) if isinstance(services, Mapping) else []
    kept = keys[offset : offset + limit]
    if isinstance(services, Mapping):
        holder["services"] = {k: services[k] for k in kept}
        detail = holder.get("detail")
        if isinstance(detail, Mapping) and isinstance(detail.get("services"), Mapping):
            holder["detail"] = {**detail, "services": {k: v for k, v in detail["services"].items() if k in kept}}
    end = offset + len(kept)
    out["page"] = {"offset": offset, "limit": limit, "total": len(keys), "next": end if end < len(keys) else None}
    return out


class MetricsServer(_BackgroundServer):
    """``/metrics``, ``/proxyMode``, ``/configz``, ``/healthz``, ``/rules``, ``/verify`` and ``/trace``.

    ``configz()`` returns the effective KubeProxyConfiguration as a dict (served as
    ``{"kubeproxy.config.k8s.io": ...}``). ``rules(service)`` returns how services are programmed, for one service
    (``ns/name:port`` from ``?service=``) or all (None); it may raise ValueError (400) or LookupError (404).
    ``/rules`` also takes ``limit`` with ``offset`` or ``page`` (see ``page_services``). ``verify()`` (optional)
    reads the kernel back. ``rules`` and ``verify`` are expensive (several KB per service; a kernel dump), so one
    runs at a time: a request that waits longer than ``EXPENSIVE_WAIT`` for its turn gets 503 with Retry-After.
    ``trace(query)`` (optional) answers ``/trace?src=IP&dst=IP&dport=N&proto=tcp[&src_local=1][&dst_local=1]``:
    where such a packet would go; same error mapping.
    """

    name = "metrics"
    # Scrapers and operators on (by default) 127.0.0.1: a handful at once; /rules and /verify are serialised anyway.
    max_connections = 16

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
        self._expensive = threading.Lock()

    def _serialised(self, produce: Callable[[], dict[str, Any]]) -> Response:
        """``_answer(produce)`` once no other expensive answer is being produced (JSON encoding included)."""
        if not self._expensive.acquire(timeout=EXPENSIVE_WAIT):
            resp = json_response(503, {"error": "busy producing another /rules or /verify answer; retry"})
            resp.headers["Retry-After"] = "1"
            return resp
        try:
            return _answer(produce)
        finally:
            self._expensive.release()

    def _rules(self, query: str) -> Response:
        parsed = parse_qs(query)
        service = (parsed.get("service") or [""])[0] or None
        try:
            page = parse_page(parsed)
        except ValueError as exc:
            return json_response(400, {"error": str(exc)})
        if page is None:
            return self._serialised(lambda: self.rules(service))
        return self._serialised(lambda: page_services(self.rules(service), *page))

    def _handler(self) -> type[QuietHandler]:
        outer = self

        class Handler(QuietHandler):
            def respond(self) -> Response:
                parts = urlsplit(self.path)
                nosniff = {"X-Content-Type-Options": "nosniff"}
                if parts.path == "/metrics":
                    return Response(200, METRICS_CONTENT_TYPE, outer.metrics.exposition_pieces())
                if parts.path == "/proxyMode":
                    return Response(200, TEXT, outer.mode.encode(), nosniff)
                if parts.path == "/healthz":
                    return Response(200, TEXT, b"ok", nosniff)
                if parts.path == "/configz":
                    return json_response(200, {CONFIGZ_GROUP: outer.configz()})
                if parts.path == "/rules":
                    return outer._rules(parts.query)
                if parts.path == "/verify" and outer.verify is not None:
                    return outer._serialised(outer.verify)
                if parts.path == "/trace" and outer.trace is not None:
                    query = {k: v[0] for k, v in parse_qs(parts.query).items() if v}
                    trace = outer.trace
                    return _answer(lambda: trace(query))
                return NOT_FOUND

        return Handler
