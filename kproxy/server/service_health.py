"""Per-service ``healthCheckNodePort`` servers for ``externalTrafficPolicy: Local`` load balancers.

Upstream's ``pkg/proxy/healthcheck/service_health.go``, behaviour for behaviour: one listener per service per node
address (every address when none are given), opened when a service gains a health-check port, closed when it
loses it, closed and reopened when the port changes; a listener that cannot be opened is reported (the daemon
turns it into the Warning Event ``FailedToStartServiceHealthcheck``) and leaves every other service alone, and is
tried again on the next sync. Any path answers 200 iff the service has local endpoints and the proxy is healthy,
else 503, with ``X-Load-Balancing-Endpoint-Weight: <local endpoints>`` and upstream's tab-indented JSON body.

Threads: a cluster may have hundreds of such services, so instead of a thread per listener one acceptor thread
waits on every listening socket with a selector and hands each accepted connection to a short-lived daemon
thread. Each service has a budget of its own (``PER_SERVICE_CONNECTIONS``) within a cap for all of them
(``MAX_CONNECTIONS``): when a service or the whole server is at its limit, the oldest connection that is only
waiting (idle, or dribbling its request) is evicted, from that service first, else from the service holding the most
connections, so slow clients of one service, or of all, cannot keep another service's load balancer from its
answer. Requests are read under the bounds of ``connections`` (header bytes, a whole-request deadline, 400 for
malformed ones). The daemon calls ``sync_services`` and ``sync_endpoints`` after every sync.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import NamespacedName
from kproxy.server.connections import Admission, start_connection
from kproxy.server.health import ProxyHealth
from kproxy.server.http import JSON, QuietHandler, Response, listen_socket

log = logging.getLogger(__name__)

# A load balancer checks a node from a few prober hosts, each with a short request every few seconds: 16 at once per
# service is ample, and bounds what slow clients of one service can hold.
PER_SERVICE_CONNECTIONS = 16
# Threads for all services together (each holds at most about 20 KB of request): past it, eviction makes room.
MAX_CONNECTIONS = 256
# Evicted connections still closing (already shut down, gone in microseconds): the thread count stays below
# MAX_CONNECTIONS + EVICTING_SPARE however fast new connections come.
EVICTING_SPARE = 64

ListenError = Callable[[NamespacedName, int, str], None]


def health_body(nsn: NamespacedName, count: int, healthy: bool) -> bytes:
    """Upstream's body, byte for byte: dedented tab-indented JSON with no trailing newline."""
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {_go_quote(nsn.namespace)},\n'
        f'\t\t"name": {_go_quote(nsn.name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {count},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


def _go_quote(text: str) -> str:
    # Kubernetes names are DNS labels, so %q and JSON quoting agree on every name that can occur.
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


@dataclass
class _Instance:
    nsn: NamespacedName
    port: int
    sockets: list[socket.socket] = field(default_factory=list)
    endpoints: int = 0


class ServiceHealthServer:
    """Health-check listeners for every service with a ``healthCheckNodePort``. Thread-safe."""

    def __init__(
        self,
        node_addresses: Sequence[str],
        proxy_health: ProxyHealth,
        on_listen_error: ListenError | None = None,
    ) -> None:
        # An empty list means every address: one dual-stack wildcard listener (see http.listen_socket).
        self.addresses: tuple[str, ...] = tuple(node_addresses) or ("",)
        self.proxy_health = proxy_health
        self.on_listen_error = on_listen_error
        self._lock = threading.Lock()
        self._services: dict[NamespacedName, _Instance] = {}
        # The selector, its wake-up pair and the acceptor thread exist from the first listener on.
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self.admission = Admission(PER_SERVICE_CONNECTIONS, MAX_CONNECTIONS, EVICTING_SPARE)
        self._closed = False
        self._thread: threading.Thread | None = None  # started with the first listener

    # ---- the daemon's side ---------------------------------------------------------------------------------

    def sync_services(self, ports: Mapping[NamespacedName, int]) -> None:
        """Make exactly these services (health-check port each) listen; close the rest."""
        failed: list[tuple[NamespacedName, int, str]] = []
        with self._lock:
            if self._closed:
                return
            for nsn, inst in list(self._services.items()):
                if ports.get(nsn) != inst.port:
                    log.info("closing healthcheck for %s on port %d", nsn, inst.port)
                    self._close_instance(inst)
                    del self._services[nsn]
            for nsn, port in ports.items():
                if nsn in self._services:
                    continue
                inst = _Instance(nsn, port)
                error = self._open_instance(inst)
                if error is not None:
                    failed.append((nsn, port, error))
                    continue
                log.info("opened healthcheck for %s on port %d", nsn, port)
                self._services[nsn] = inst
        # Outside the lock: the callback may do anything (post an Event through the API).
        for nsn, port, error in failed:
            log.error("failed to start healthcheck %s on port %d: %s", nsn, port, error)
            if self.on_listen_error is not None:
                try:
                    self.on_listen_error(nsn, port, error)
                except Exception:
                    log.exception("on_listen_error callback failed")

    def sync_endpoints(self, counts: Mapping[NamespacedName, int]) -> None:
        """Local endpoint count per service; services not named get 0, unknown services are ignored."""
        with self._lock:
            for nsn, inst in self._services.items():
                inst.endpoints = counts.get(nsn, 0)

    def services(self) -> dict[NamespacedName, tuple[int, int]]:
        """Listening services: port and current local endpoint count (for ``/rules`` and tests)."""
        with self._lock:
            return {nsn: (i.port, i.endpoints) for nsn, i in self._services.items()}

    def bound(self, nsn: NamespacedName) -> list[tuple[str, int]]:
        """The addresses a service's listeners are bound to (host, port)."""
        with self._lock:
            inst = self._services.get(nsn)
            return [s.getsockname()[:2] for s in inst.sockets] if inst else []

    def close(self) -> None:
        """Close every listener and stop the acceptor thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for inst in self._services.values():
                self._close_instance(inst)
            self._services.clear()
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        for res in (self._selector, self._wake_r, self._wake_w):
            if res is not None:
                res.close()

    # ---- listeners -----------------------------------------------------------------------------------------

    def _open_instance(self, inst: _Instance) -> str | None:
        """Listen on every address; on any failure close what was opened (so a retry can take the port)."""
        selector = self._acceptor()
        for host in self.addresses:
            try:
                sock = listen_socket(host, inst.port)
            except OSError as exc:
                self._close_instance(inst)
                where = f"[{host}]" if ":" in host else host or "*"
                return f"listen {where}:{inst.port}: {exc.strerror or exc}"
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, inst.nsn)
            inst.sockets.append(sock)
        return None

    def _acceptor(self) -> selectors.BaseSelector:
        """The selector the acceptor thread waits on, creating both on first use (called with the lock held)."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
            self._thread = threading.Thread(
                target=self._accept_loop, args=(self._selector, self._wake_r), name="service-health", daemon=True
            )
            self._thread.start()
        return self._selector

    def _close_instance(self, inst: _Instance) -> None:
        for sock in inst.sockets:
            if self._selector is not None:
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
            sock.close()
        inst.sockets.clear()

    def _wake(self) -> None:
        if self._wake_w is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _accept_loop(self, selector: selectors.BaseSelector, wake_r: socket.socket) -> None:
        while True:
            try:
                events = selector.select()
            except (OSError, ValueError):  # the selector was closed under us
                return
            for key, _ in events:
                if key.data is None:
                    try:
                        while wake_r.recv(512):
                            pass
                    except OSError:
                        pass
                    continue
                self._accept(key.fileobj, key.data)  # type: ignore[arg-type]
            with self._lock:
                if self._closed:
                    return

    def _accept(self, sock: socket.socket, nsn: NamespacedName) -> None:
        try:
            conn, peer = sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # closed between select and accept
            log.debug("healthcheck accept for %s: %s", nsn, exc)
            return
        start_connection(self.admission, nsn, _Handler, conn, peer, _Context(self, nsn), "service-health")

    def _answer(self, nsn: NamespacedName) -> Response:
        with self._lock:
            inst = self._services.get(nsn)
            count = inst.endpoints if inst is not None else 0
        healthy = self.proxy_health.healthy()
        status = 200 if count != 0 and healthy else 503
        headers = {"X-Content-Type-Options": "nosniff", "X-Load-Balancing-Endpoint-Weight": str(count)}
        return Response(status, JSON, health_body(nsn, count, healthy), headers)


@dataclass(frozen=True)
class _Context:
    """Stands in for socketserver's ``server`` argument: what the handler needs to answer."""

    owner: ServiceHealthServer
    nsn: NamespacedName


class _Handler(QuietHandler):
    server: _Context  # type: ignore[assignment]

    def respond(self) -> Response:
        return self.server.owner._answer(self.server.nsn)
