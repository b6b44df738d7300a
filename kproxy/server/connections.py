"""Hostile-input limits for kproxy's HTTP servers: which connections get a thread, and how much of a request is read.

Every server (``:10256``, the metrics address, each healthCheckNodePort) faces clients that may be slow, oversized,
malformed or simply too many. This module bounds each of those, with the numbers below:

- ``Admission`` decides, on the accept loop and without blocking, whether a new connection gets a thread. It counts
  connections per key (one key per service for the healthCheckNodePort servers, a single key elsewhere) and in all.
  When a key or the whole server is at its limit, the oldest connection that is only *waiting* (for a request, or
  for the rest of one) is shut down to make room: a health checker sends its request in one segment and is answered
  in microseconds, so the connections that are evicted are the slow and idle ones, and a slowloris crowd cannot keep
  a real checker out. Connections that are being answered are never evicted. When nothing can be evicted the new
  connection gets a canned ``503`` from the accept loop (one non-blocking send) and is closed: never a thread.
- ``BoundedHandler`` reads each request through ``_Reader``: the request line and headers together may take at most
  ``MAX_HEADER_BYTES`` (``431`` beyond), the whole request (waiting for it, its head and any body) must arrive within
  ``REQUEST_DEADLINE`` seconds (``Admission.request_deadline``) in total, not per read (else the connection is
  closed), ``Content-Length`` must be a decimal number (``400`` otherwise, never a traceback), and a body is read
  (and dropped) only up to ``MAX_BODY_BYTES``. Errors are answered as Go's net/http answers them:
  ``text/plain``, ``Connection: close``, ``<code> <reason>[: detail]``. A response must be sent within
  ``RESPONSE_DEADLINE``.

Threads stay (one per admitted connection): the handlers are short, and the bounds above keep their number and
memory small: at most ``limit + spare`` threads per ``Admission``, each holding at most about
``MAX_HEADER_BYTES + RECV_SIZE`` of request bytes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger(__name__)

# A health checker's or Prometheus' request is a few hundred bytes. 16 KiB leaves room for long query strings
# (/rules?service=, /trace) and headers added by proxies, while a connection can make us hold at most this plus one
# read (http.server on its own accepts 100 header lines of 64 KiB each: 6.4 MB per connection).
MAX_HEADER_BYTES = 16 * 1024
RECV_SIZE = 4096  # bytes asked of one recv(): what a connection's buffer can grow by beyond its budget
# From the moment a connection starts waiting for a request to its last byte: a real client sends a request in one
# segment, so 10 s is generous, and a client that dribbles a byte per second (slowloris) is cut off after 10 s in
# all. It is also how long a kept-alive connection may sit idle between requests (its clients simply reconnect).
REQUEST_DEADLINE = 10.0
# Sending one response: a full /rules can be megabytes; a client that reads slower than that loses its answer.
RESPONSE_DEADLINE = 30.0
# A body (no route here reads one) is drained so the connection can be kept alive only up to this size; a larger
# one is not read at all, and the connection is closed after the answer.
MAX_BODY_BYTES = 64 * 1024
# After an error answer, what is read and dropped (at most, and for at most how long) before the socket is closed.
LINGER_BYTES = 64 * 1024
LINGER_TIME = 0.5
# At or above this share of a limit in use, answers carry "Connection: close" so that kept-alive connections
# give their slots back instead of holding them between requests.
CROWDED = 0.75

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: 21\r\n\r\ntoo many connections\n"
)


class HeadTooLarge(Exception):
    """The request line and headers exceeded ``MAX_HEADER_BYTES``."""


class Ticket:
    """One admitted connection's place in its ``Admission``: waiting (evictable) or busy, until released."""

    __slots__ = ("_owner", "key", "sock", "evicted", "released")

    def __init__(self, owner: Admission, key: Hashable, sock: socket.socket) -> None:
        self._owner = owner
        self.key = key
        self.sock = sock
        self.evicted = False
        self.released = False

    def waiting(self) -> None:
        """The connection waits for a request (or the rest of one): it may be evicted to make room."""
        self._owner._set_waiting(self, True)

    def busy(self) -> None:
        """A whole request head has arrived and is being answered: not evictable."""
        self._owner._set_waiting(self, False)

    @property
    def request_deadline(self) -> float:
        return self._owner.request_deadline

    def crowded(self) -> bool:
        """Whether this connection's key or the whole server is near its limit (then do not keep it alive)."""
        return self._owner._crowded(self.key)

    def release(self) -> None:
        """The connection is done; call before closing its socket (eviction shuts sockets down under the lock)."""
        self._owner._release(self)


class Admission:
    """At most ``per_key`` live connections per key and ``limit`` in all, plus at most ``spare`` that were evicted
    and have not finished closing. Thread-safe; ``admit`` never blocks."""

    def __init__(self, per_key: int, limit: int, spare: int) -> None:
        if per_key < 1 or limit < 1 or spare < 0:
            raise ValueError("connection limits must be positive")
        self.per_key, self.limit, self.spare = per_key, limit, spare
        self.request_deadline = REQUEST_DEADLINE  # per server, so that a test can shorten it
        self._lock = threading.Lock()
        self._live: dict[Hashable, int] = {}  # admitted and not evicted, per key
        self._total = 0  # every admitted connection not yet released (evicted ones included): threads
        self._evicting = 0  # evicted, not yet released
        self._waiting: dict[Hashable, OrderedDict[Ticket, None]] = {}  # oldest first
        self.admitted = 0  # counters since start: connections let in, evicted to make room, refused
        self.evictions = 0
        self.refusals = 0

    def admit(self, key: Hashable, sock: socket.socket) -> Ticket | None:
        """A ticket for a new connection (making room by evicting a waiting one if need be), or None: refuse it."""
        with self._lock:
            if self._live.get(key, 0) >= self.per_key:
                victim = self._oldest_waiting(key)
            elif self._total - self._evicting >= self.limit:
                victim = self._oldest_waiting(self._fullest_key())
            else:
                return self._ticket(key, sock)
            if victim is None or self._evicting >= self.spare:
                self.refusals += 1
                return None
            self._evict(victim)
            return self._ticket(key, sock)

    def _ticket(self, key: Hashable, sock: socket.socket) -> Ticket:
        self._live[key] = self._live.get(key, 0) + 1
        self._total += 1
        self.admitted += 1
        ticket = Ticket(self, key, sock)
        # Waiting from the moment it is accepted, so the oldest waiter is the oldest connection, whatever order
        # the threads happen to start in.
        self._waiting.setdefault(key, OrderedDict())[ticket] = None
        return ticket

    def counts(self) -> tuple[int, int]:
        """(connections holding a thread, of which evicted and closing)."""
        with self._lock:
            return self._total, self._evicting

    def _oldest_waiting(self, key: Hashable | None) -> Ticket | None:
        queue = self._waiting.get(key)
        return next(iter(queue)) if queue else None

    def _fullest_key(self) -> Hashable | None:
        """The key with the most live connections among those that have one waiting (evicted from first)."""
        candidates = [k for k, q in self._waiting.items() if q]
        return max(candidates, key=lambda k: self._live.get(k, 0), default=None)

    def _evict(self, victim: Ticket) -> None:
        self._waiting[victim.key].pop(victim, None)
        victim.evicted = True
        self._evicting += 1
        self._drop_live(victim.key)
        self.evictions += 1
        try:  # its thread's blocked recv() returns at once; the socket is closed only after release()
            victim.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _drop_live(self, key: Hashable) -> None:
        left = self._live[key] - 1
        if left:
            self._live[key] = left
        else:
            del self._live[key]

    def _set_waiting(self, ticket: Ticket, waiting: bool) -> None:
        with self._lock:
            if ticket.evicted or ticket.released:
                return
            queue = self._waiting.setdefault(ticket.key, OrderedDict())
            if waiting:
                queue.setdefault(ticket, None)  # a waiter keeps its place; one back from an answer goes last
                return
            queue.pop(ticket, None)
            if not queue:
                del self._waiting[ticket.key]

    def _crowded(self, key: Hashable) -> bool:
        with self._lock:
            live_total = self._total - self._evicting
            return self._live.get(key, 0) >= CROWDED * self.per_key or live_total >= CROWDED * self.limit

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._total -= 1
            if ticket.evicted:
                self._evicting -= 1
                return
            self._drop_live(ticket.key)
            queue = self._waiting.get(ticket.key)
            if queue is not None:
                queue.pop(ticket, None)
                if not queue:
                    del self._waiting[ticket.key]


def refuse(conn: socket.socket) -> None:
    """Answer a connection that gets no thread: one non-blocking send of a canned 503, then close."""
    try:
        conn.setblocking(False)
        conn.send(_BUSY)
    except OSError:
        pass
    finally:
        conn.close()


class _Reader:
    """The request side of a connection: ``readline``/``read`` under a total deadline and, while the request line
    and headers are read, a byte budget. What ``BaseHTTPRequestHandler`` and ``http.client.parse_headers`` call."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._deadline = 0.0
        self._budget: int | None = None
        self.eof = False

    def start(self, deadline: float, budget: int) -> None:
        self._deadline, self._budget = deadline, budget

    def end_head(self) -> None:
        self._budget = None

    def _fill(self) -> bool:
        """One recv() into the buffer; False at end of stream. TimeoutError once the deadline has passed."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(remaining)
        data = self._sock.recv(RECV_SIZE)
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    def _take(self, n: int) -> bytes:
        if self._budget is not None:
            if n > self._budget:
                raise HeadTooLarge(f"request head larger than {MAX_HEADER_BYTES} bytes")
            self._budget -= n
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def readline(self, limit: int = -1) -> bytes:
        """One line with its newline; what is left at end of stream (without one)."""
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                n = end + 1
                break
            if self._budget is not None and len(self._buf) > self._budget:
                raise HeadTooLarge(f"request head larger than {MAX_HEADER_BYTES} bytes")
            if 0 <= limit <= len(self._buf) or self.eof or not self._fill():
                n = len(self._buf)
                break
        return self._take(n if limit < 0 else min(n, limit))

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at end of stream)."""
        while len(self._buf) < n and not self.eof and self._fill():
            pass
        return self._take(min(n, len(self._buf)))

    def close(self) -> None:
        self._buf.clear()


class _Writer:
    """The response side: buffered until ``flush`` (one segment for a small answer), sent within a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def flush(self) -> None:
        if self._buf:
            self._sock.settimeout(RESPONSE_DEADLINE)  # sendall's timeout bounds the whole call
            try:
                self._sock.sendall(self._buf)
            finally:
                self._buf.clear()

    def close(self) -> None:
        self._buf.clear()


class BoundedHandler(BaseHTTPRequestHandler):
    """``BaseHTTPRequestHandler`` with every read bounded (see the module docstring) and Go-style error answers.

    Built by ``serve_connection`` with the connection's ``Ticket``; subclasses implement ``do_<METHOD>``.
    """

    protocol_version = "HTTP/1.1"
    server_version = "kproxy"
    sys_version = ""
    rfile: _Reader  # type: ignore[assignment]
    wfile: _Writer  # type: ignore[assignment]

    def __init__(self, request: socket.socket, client_address: Any, server: Any, ticket: Ticket) -> None:
        self.ticket = ticket
        self._body_unread = False
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        # No Nagle: a response is one write, and a kept-alive client must not wait for a delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = _Reader(self.connection)
        self.wfile = _Writer(self.connection)

    def finish(self) -> None:
        self.rfile.close()
        self.wfile.close()

    def handle_one_request(self) -> None:
        self.close_connection = True
        self._body_unread = False
        self.ticket.waiting()
        self.rfile.start(time.monotonic() + self.ticket.request_deadline, MAX_HEADER_BYTES)
        try:
            if not self._read_head():
                return
            self.ticket.busy()
            if self._check_body():
                method = getattr(self, "do_" + str(self.command), None)
                if method is None:
                    self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
                else:
                    method()
            if self.ticket.crowded():
                self.close_connection = True
        finally:
            self.wfile.flush()

    def _read_head(self) -> bool:
        """Request line and headers, parsed; False when the connection is to be closed (answered or not)."""
        self.command = self.requestline = ""
        self.request_version = "HTTP/0.9"
        try:
            self.raw_requestline = self.rfile.readline(MAX_HEADER_BYTES + 1)
            if not self.raw_requestline.endswith(b"\n"):  # closed (or evicted) before a whole request line
                return False
            if not self.parse_request():  # answered 400/431/505 itself, or an empty line: close
                return False
        except HeadTooLarge as exc:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, str(exc))
            return False
        except (TimeoutError, OSError):  # slow (the deadline), evicted or gone: nobody to answer
            return False
        if self.rfile.eof:  # the headers were cut short by the end of the stream
            return False
        if self.request_version == "HTTP/0.9":  # "GET /": no version, no headers; Go refuses it too
            self.send_error(HTTPStatus.BAD_REQUEST, "malformed HTTP request")
            return False
        self.rfile.end_head()
        return True

    def handle_expect_100(self) -> bool:
        # No "100 Continue": no route reads a body, so the client may as well not send it; it is then not read,
        # and the connection is closed after the answer.
        self._body_unread = True
        return True

    def _check_body(self) -> bool:
        """Validate the framing headers and drop a small body; False when an error has been answered."""
        lengths = self.headers.get_all("Content-Length") or []
        if lengths and (len(set(lengths)) > 1 or not all(_decimal(v) for v in lengths)):
            self.send_error(HTTPStatus.BAD_REQUEST, "invalid Content-Length")
            return False
        coding = self.headers.get("Transfer-Encoding")
        if coding is not None:
            if lengths:
                self.send_error(HTTPStatus.BAD_REQUEST, "both Content-Length and Transfer-Encoding")
                return False
            if coding.strip().lower() != "chunked":
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, "unsupported transfer encoding")
                return False
            self._body_unread = True
        length = int(lengths[0]) if lengths else 0
        if self._body_unread or length > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread, so the stream cannot carry another request
        elif length:
            try:
                got = self.rfile.read(length)
            except (TimeoutError, OSError):
                got = b""
            if len(got) < length:  # too slow or gone: nobody to answer
                self.close_connection = True
                return False
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Go's net/http answer to a bad request: plain text ``<code> <reason>[: message]`` and close."""
        status = HTTPStatus(code)
        self.log_error("%d %s: %s", code, status.phrase, message or "")
        self.close_connection = True
        # A request line too broken to name a version leaves http.server at HTTP/0.9, which would drop the status
        # line: answer in HTTP/1.1 whatever came in.
        self.request_version = self.protocol_version
        body = f"{code} {status.phrase}" + (f": {message[:200]}" if message else "")
        self.send_response_only(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _decimal(value: str) -> bool:
    """Content-Length as RFC 9110 has it: ASCII digits only (no sign, no spaces, no Unicode digits)."""
    value = value.strip()
    return value.isascii() and value.isdigit() and len(value) <= 18


def serve_connection(
    handler: type[BoundedHandler], conn: socket.socket, peer: Any, server: Any, ticket: Ticket, what: str
) -> None:
    """A connection's thread: handle its requests, then release its ticket and close it; never raises."""
    try:
        handler(conn, peer, server, ticket)
    except OSError as exc:  # the client went away, or a send timed out
        log.debug("%s connection from %s: %s", what, peer, exc)
    except Exception:
        log.exception("%s connection from %s failed", what, peer)
    finally:
        _linger(conn)  # still counted: a lingering thread is a thread
        ticket.release()  # before close: an eviction may be shutting this socket down under the lock
        conn.close()


def _linger(conn: socket.socket) -> None:
    """Send our FIN, then read what the client is still sending, for a moment, before closing: closing with unread
    bytes makes the kernel send a reset, which can destroy an error answer (a 431 to a client still sending its
    headers) before the client has read it. Bounded by ``LINGER_BYTES`` and ``LINGER_TIME``; a client that has
    closed (the usual case) or a connection that was evicted ends it at once."""
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_TIME
        drained = 0
        while drained < LINGER_BYTES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            conn.settimeout(remaining)
            data = conn.recv(RECV_SIZE)
            if not data:
                return
            drained += len(data)
    except OSError:
        pass


def start_connection(
    admission: Admission,
    key: Hashable,
    handler: type[BoundedHandler],
    conn: socket.socket,
    peer: Any,
    server: Any,
    what: str,
) -> None:
    """On the accept loop: a thread for ``conn`` if ``admission`` has room (evicting a waiting connection if need
    be), else a canned 503 and close. Never blocks."""
    ticket = admission.admit(key, conn)
    if ticket is None:
        log.debug("%s: connection limit reached, refusing %s", what, peer)
        refuse(conn)
        return
    thread = threading.Thread(
        target=serve_connection, args=(handler, conn, peer, server, ticket, what), name=f"{what}-conn", daemon=True
    )
    try:
        thread.start()
    except RuntimeError:  # the process is out of threads: give the slot back
        ticket.release()
        refuse(conn)
