"""The userspace data path: proxy sockets served by one event loop thread, bytes moved by ``splice`` (zero copy).

One ``Engine`` per backend runs an asyncio event loop in a thread of its own (started by ``UserspaceProxier.start``,
never in ``__init__``), in the backend's network namespace. Everything the loop touches (listeners, balancers,
connections, UDP sessions) is changed only in the loop thread: the runner thread hands over ready-made listening
sockets and endpoint lists with ``Engine.update`` (``call_soon_threadsafe``) and waits until the loop has taken
them, so when a sync returns the data path already uses the new endpoints, and the loop never waits for a sync.

- TCP (``_TcpListener``): accept in batches, pick an endpoint (``Balancer``), connect without blocking with
  upstream's dial timeouts (250 ms, 500 ms, 1 s, 2 s), each failure trying the next endpoint with the client's
  affinity reset; no endpoint left: the client is reset (RST). Then ``_Relay``: per direction a pipe and
  ``os.splice`` socket -> pipe -> socket (no copy through Python), driven by ``add_reader``/``add_writer``, half
  close passed on, an error on either side resets both (splice measured against a recv_into/send relay:
  docs/PERFORMANCE.md).
- UDP (``_UdpListener``): per client address a session with a connected socket to its endpoint; replies go back
  through the proxy socket from the address the client's datagram was redirected to (``IP_PKTINFO``), so conntrack
  reverses the redirect; a session idle longer than the UDP timeout is closed, and sessions to an endpoint that is
  gone are closed at once (the client's next datagram picks a live one).
- ``Balancer``: upstream's ``LoadBalancerRR``: round robin over the endpoints (shuffled on every change), ClientIP
  affinity with its timeout, entries of removed endpoints dropped, stale sessions swept every second.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kproxy.toolkit.netns import enter_netns

log = logging.getLogger(__name__)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)  # upstream's EndpointDialTimeouts
CHUNK = 1 << 20  # bytes per splice / recv
PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ: iperf3 through the proxy 15.2 Gbit/s with 1 MiB pipes, 13.0 with the default 64 KiB
ACCEPT_BATCH = 64
UPDATE_CHUNK = 256  # listeners per step of the loop when a sync hands them over
READ_ROUNDS = 8  # splices per readable event before yielding to the loop
EAGER_READ = True  # see _Dial._connected
SMALL = 1 << 16  # a read shorter than this ends the rounds (spares the EAGAIN of a request/response exchange)
UDP_BATCH = 64
SWEEP_S = 1.0
F_SETPIPE_SZ = 1031
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_LINGER_RST = struct.pack("ii", 1, 0)
IP_PKTINFO = 8
IPV6_RECVPKTINFO = 49
IPV6_PKTINFO = 50

Addr = tuple[str, int]


class Balancer:
    """Round robin with ClientIP affinity for one listener (upstream's ``LoadBalancerRR``, one service port)."""

    __slots__ = ("endpoints", "index", "timeout", "affinity")

    def __init__(self) -> None:
        self.endpoints: list[Addr] = []
        self.index = 0
        self.timeout = 0.0
        self.affinity: dict[str, tuple[Addr, float]] = {}

    def update(self, endpoints: tuple[Addr, ...], timeout: float) -> set[Addr]:
        """New endpoints and affinity timeout; returns the endpoints that went away."""
        old = set(self.endpoints)
        new = set(endpoints)
        if new != old:
            shuffled = list(endpoints)
            random.shuffle(shuffled)  # as upstream: so nodes do not all start on the same endpoint
            self.endpoints = shuffled
            self.index = 0
        if timeout != self.timeout:
            self.affinity.clear()
        self.timeout = timeout
        gone = old - new
        if gone:
            self.affinity = {c: v for c, v in self.affinity.items() if v[0] not in gone}
        return gone

    def next(self, client: str, reset: bool = False) -> Addr | None:
        eps = self.endpoints
        if not eps:
            return None
        now = time.monotonic()
        if self.timeout and not reset:
            hit = self.affinity.get(client)
            if hit is not None and now - hit[1] < self.timeout and hit[0] in eps:
                self.affinity[client] = (hit[0], now)
                return hit[0]
        ep = eps[self.index % len(eps)]
        self.index = (self.index + 1) % len(eps)
        if self.timeout:
            self.affinity[client] = (ep, now)
        return ep

    def sweep(self, now: float) -> None:
        if self.timeout and self.affinity:
            self.affinity = {c: v for c, v in self.affinity.items() if now - v[1] < self.timeout}


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """What the runner thread hands the loop for one proxy socket: its id, the bound socket, its balancing."""

    ident: tuple[Any, ...]
    proto: str
    sock: socket.socket | None  # None: keep the socket the loop already has
    endpoints: tuple[Addr, ...]
    affinity: float


class Engine:
    """The event loop thread and every proxy socket (see the module docstring)."""

    def __init__(self, netns: str | None = None, udp_timeout: float = 0.25) -> None:
        self.netns = netns
        self.udp_timeout = udp_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.listeners: dict[tuple[Any, ...], _TcpListener | _UdpListener] = {}
        self.connections = 0  # open relayed TCP connections
        self.open: set[_Relay | _Dial] = set()  # closed at stop: sockets die with the loop, never left to the GC
        self.peak_connections = 0
        self.accepted = 0
        self.failed_dials = 0
        self.udp_sessions = 0
        #: listeners whose socket stopped listening under the loop (``ss -K``, a closed descriptor): the loop stops
        #: reading them and the proxier's next sync (``needs_full``) binds new ones; written by the loop thread only
        self.dead: set[tuple[Any, ...]] = set()
        #: told (loop thread) of each listener that died: the proxier asks the ledger for a full sync of its family
        self.on_dead: Callable[[tuple[Any, ...]], None] | None = None

    # -- lifecycle (main / runner thread) --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                if self.netns:
                    enter_netns(self.netns)
                loop = asyncio.new_event_loop()
                self.loop = loop
            except BaseException as exc:  # reported to start()
                errors.append(exc)
                ready.set()
                return
            loop.call_soon(ready.set)
            loop.call_later(SWEEP_S, self._sweep)
            try:
                loop.run_forever()
            finally:
                for lst in list(self.listeners.values()):
                    lst.close()
                self.listeners.clear()
                for item in list(self.open):
                    item.abort()
                self.open.clear()
                loop.close()

        self._thread = threading.Thread(target=run, name="kproxy-userspace-datapath", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            self._thread = None
            raise errors[0]

    def stop(self) -> None:
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self.loop = None
        self._thread = None

    def run(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` in the loop thread and wait for its result (the runner thread's way in)."""
        loop = self.loop
        if loop is None:
            raise RuntimeError("the userspace data path is not running")
        done = threading.Event()
        box: list[Any] = []

        def call() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            finally:
                done.set()

        loop.call_soon_threadsafe(call)
        if not done.wait(timeout):
            raise TimeoutError("the userspace data path did not answer")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def update(self, specs: list[ListenerSpec], remove: list[tuple[Any, ...]]) -> None:
        """Open, retarget and close listeners (from the runner thread), in steps of UPDATE_CHUNK so that the loop
        serves connections in between while a full sync hands it thousands."""
        for i in range(0, max(len(specs), len(remove)), UPDATE_CHUNK):
            part, gone = specs[i : i + UPDATE_CHUNK], remove[i : i + UPDATE_CHUNK]
            self.run(lambda part=part, gone=gone: self._update(part, gone))  # type: ignore[misc]

    # -- the loop thread ---------------------------------------------------------------------------------------

    def _update(self, specs: list[ListenerSpec], remove: list[tuple[Any, ...]]) -> None:
        assert self.loop is not None
        for ident in remove:
            self.dead.discard(ident)
            lst = self.listeners.pop(ident, None)
            if lst is not None:
                lst.close()
        for spec in specs:
            lst = self.listeners.get(spec.ident)
            if lst is None:
                if spec.sock is None:
                    continue
                kind = _TcpListener if spec.proto == "tcp" else _UdpListener
                lst = kind(self, spec.sock, spec.ident)
                self.listeners[spec.ident] = lst
            gone = lst.balancer.update(spec.endpoints, spec.affinity)
            if gone and isinstance(lst, _UdpListener):
                lst.drop_sessions(gone)

    def _sweep(self) -> None:
        assert self.loop is not None
        now = time.monotonic()
        for lst in self.listeners.values():
            lst.balancer.sweep(now)
        self.loop.call_later(SWEEP_S, self._sweep)

    def died(self, ident: tuple[Any, ...], why: str) -> None:
        """A listener's socket stopped listening under the loop (loop thread): stop reading it, remember it."""
        if ident not in self.dead:
            log.warning("userspace: proxy socket %s stopped listening (%s): bound anew at the next sync", ident, why)
        self.dead.add(ident)
        if self.on_dead is not None:
            self.on_dead(ident)

    def table(self) -> dict[int, tuple[tuple[Any, ...], frozenset[Addr], float, bool]]:
        """What the loop serves, by socket inode: (ident, endpoints, affinity timeout, dead). Any thread (it runs in
        the loop); ``verify`` reads it (the data path itself, not a record of what was written)."""

        def go() -> dict[int, tuple[tuple[Any, ...], frozenset[Addr], float, bool]]:
            out = {}
            for ident, lst in self.listeners.items():
                try:
                    inode = os.fstat(lst.sock.fileno()).st_ino
                except (OSError, ValueError):
                    continue
                bal = lst.balancer
                out[inode] = (ident, frozenset(bal.endpoints), float(bal.timeout), ident in self.dead)
            return out

        if self.loop is None:
            return {}
        result: dict[int, tuple[tuple[Any, ...], frozenset[Addr], float, bool]] = self.run(go)
        return result

    def detach(self, ident: tuple[Any, ...]) -> socket.socket | None:
        """Take a listener out of the loop and return its socket, open (loop thread; see the proxier's hand-over)."""
        self.dead.discard(ident)
        lst = self.listeners.pop(ident, None)
        if lst is None:
            return None
        return lst.detach()

    def stats(self) -> dict[str, int]:
        return {
            "listeners": len(self.listeners),
            "connections": self.connections,
            "peakConnections": self.peak_connections,
            "accepted": self.accepted,
            "failedDials": self.failed_dials,
            "udpSessions": self.udp_sessions,
        }


# ------------------------------------------------------------------------------------------------------- TCP


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass
    sock.close()


class _TcpListener:
    def __init__(self, engine: Engine, sock: socket.socket, ident: tuple[Any, ...] = ()) -> None:
        self.engine = engine
        self.ident = ident
        self.sock = sock
        self.balancer = Balancer()
        self.family = sock.family
        assert engine.loop is not None
        sock.setblocking(False)
        engine.loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        self.detach().close()

    def detach(self) -> socket.socket:
        loop = self.engine.loop
        if loop is not None and self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())
        return self.sock

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                client, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # not listening any more (ss -K): readable for ever, stop reading
                    self.detach()
                    self.engine.died(self.ident, str(exc))
                    return
                # EMFILE and friends: the client waits in the backlog, try again soon
                log.warning("userspace: accept failed: %s", exc)
                return
            self.engine.accepted += 1
            client.setblocking(False)
            _Dial(self, client, str(addr[0])).attempt()


class _Dial:
    """Connecting one accepted client to an endpoint, with upstream's timeouts and retries."""

    __slots__ = ("listener", "client", "client_ip", "tries", "server", "timer")

    def __init__(self, listener: _TcpListener, client: socket.socket, client_ip: str) -> None:
        self.listener = listener
        self.client = client
        self.client_ip = client_ip
        self.tries = 0
        self.server: socket.socket | None = None
        self.timer: asyncio.TimerHandle | None = None
        listener.engine.open.add(self)

    def abort(self) -> None:
        loop = self.listener.engine.loop
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.server is not None:
            if loop is not None and self.server.fileno() >= 0:
                loop.remove_writer(self.server.fileno())
            self.server.close()
            self.server = None
        _reset(self.client)
        self.listener.engine.open.discard(self)

    def attempt(self) -> None:
        engine = self.listener.engine
        loop = engine.loop
        assert loop is not None
        if self.tries >= len(DIAL_TIMEOUTS):
            engine.failed_dials += 1
            self.abort()
            return
        ep = self.listener.balancer.next(self.client_ip, reset=self.tries > 0)
        if ep is None:  # no endpoints (the redirect rules reject those; this is a race with a sync)
            self.abort()
            return
        fam = socket.AF_INET6 if ":" in ep[0] else socket.AF_INET
        server = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server = server
        rc = server.connect_ex(ep)
        if rc == 0:
            self._connected()
            return
        if rc != errno.EINPROGRESS:
            self._failed()
            return
        loop.add_writer(server.fileno(), self._writable)
        self.timer = loop.call_later(DIAL_TIMEOUTS[self.tries], self._timeout)

    def _writable(self) -> None:
        assert self.server is not None
        loop = self.listener.engine.loop
        assert loop is not None
        loop.remove_writer(self.server.fileno())
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        err = self.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._failed()
        else:
            self._connected()

    def _timeout(self) -> None:
        self.timer = None
        assert self.server is not None
        loop = self.listener.engine.loop
        assert loop is not None
        loop.remove_writer(self.server.fileno())
        self._failed()

    def _failed(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.tries += 1
        self.attempt()

    def _connected(self) -> None:
        assert self.server is not None
        self.listener.engine.open.discard(self)
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        relay = _Relay(self.listener.engine, self.client, self.server)
        if EAGER_READ:
            relay.halves[0].readable()  # the client's request usually waits already: pass it on without a loop turn


class _Relay:
    """Both directions of one proxied connection."""

    __slots__ = ("engine", "a", "b", "halves", "open")

    def __init__(self, engine: Engine, a: socket.socket, b: socket.socket) -> None:
        self.engine = engine
        self.a, self.b = a, b
        engine.connections += 1
        engine.open.add(self)
        engine.peak_connections = max(engine.peak_connections, engine.connections)
        self.open = 2
        self.halves = (_SpliceHalf(self, a, b), _SpliceHalf(self, b, a))
        for h in self.halves:
            h.start()

    def half_done(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.close()

    def abort(self) -> None:
        for h in self.halves:
            h.stop()
        _reset(self.a)
        _reset(self.b)
        self._closed()

    def close(self) -> None:
        for h in self.halves:
            h.stop()
        self.a.close()
        self.b.close()
        self._closed()

    def _closed(self) -> None:
        if self.open >= 0:
            self.engine.connections -= 1
            self.engine.open.discard(self)
            self.open = -1


class _Half:
    __slots__ = ("relay", "src", "dst", "sfd", "dfd", "pending", "eof", "reading", "writing", "done", "loop")

    def __init__(self, relay: _Relay, src: socket.socket, dst: socket.socket) -> None:
        self.relay = relay
        self.src, self.dst = src, dst
        self.sfd, self.dfd = src.fileno(), dst.fileno()
        self.pending = 0
        self.eof = self.reading = self.writing = self.done = False
        loop = relay.engine.loop
        assert loop is not None
        self.loop = loop

    def start(self) -> None:
        self.reading = True
        self.loop.add_reader(self.sfd, self.readable)

    def stop(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sfd)
            self.reading = False
        if self.writing:
            self.loop.remove_writer(self.dfd)
            self.writing = False
        self.release()

    def release(self) -> None:
        pass

    def readable(self) -> None:
        raise NotImplementedError

    def flush(self) -> bool:
        raise NotImplementedError

    def writable(self) -> None:
        try:
            drained = self.flush()
        except OSError:
            self.relay.abort()
            return
        if drained:
            self.loop.remove_writer(self.dfd)
            self.writing = False
            self._drained()

    def _wait_writable(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sfd)
            self.reading = False
        if not self.writing:
            self.loop.add_writer(self.dfd, self.writable)
            self.writing = True

    def _drained(self) -> None:
        if self.eof:
            self._finish()
        elif not self.reading and not self.relay.open < 0:
            self.loop.add_reader(self.sfd, self.readable)
            self.reading = True

    def _finish(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sfd)
            self.reading = False
        if self.done:
            return
        self.done = True
        try:
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.release()
        self.relay.half_done()


class _SpliceHalf(_Half):
    __slots__ = ("pr", "pw")

    def __init__(self, relay: _Relay, src: socket.socket, dst: socket.socket) -> None:
        super().__init__(relay, src, dst)
        self.pr, self.pw = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.pw, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # a smaller pipe only costs throughput

    def release(self) -> None:
        if self.pr >= 0:
            os.close(self.pr)
            os.close(self.pw)
            self.pr = self.pw = -1

    def readable(self) -> None:
        # drain what the socket holds (a few rounds) before going back to the loop: fewer wake-ups per byte
        for _ in range(READ_ROUNDS):
            try:
                n = os.splice(self.sfd, self.pw, CHUNK, flags=SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.relay.abort()
                return
            if n == 0:
                self.eof = True
                self._finish()
                return
            self.pending += n
            try:
                drained = self.flush()
            except OSError:
                self.relay.abort()
                return
            if not drained:
                self._wait_writable()
                return
            if n < SMALL:  # the socket most likely held no more: the level-triggered loop calls again if it did
                return

    def flush(self) -> bool:
        while self.pending:
            try:
                n = os.splice(self.pr, self.dfd, self.pending, flags=SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                return False
            self.pending -= n
        return True


# ------------------------------------------------------------------------------------------------------- UDP


class _UdpSession:
    __slots__ = ("client", "endpoint", "sock", "local", "last")

    def __init__(self, client: Any, endpoint: Addr, sock: socket.socket, local: bytes) -> None:
        self.client = client
        self.endpoint = endpoint
        self.sock = sock
        self.local = local  # the ancillary data that sends replies from the redirected-to address
        self.last = time.monotonic()


class _UdpListener:
    def __init__(self, engine: Engine, sock: socket.socket, ident: tuple[Any, ...] = ()) -> None:
        self.engine = engine
        self.ident = ident
        self.sock = sock
        self.balancer = Balancer()
        self.sessions: dict[Any, _UdpSession] = {}
        self.v6 = sock.family == socket.AF_INET6
        if self.v6:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVPKTINFO, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        sock.setblocking(False)
        assert engine.loop is not None
        self.loop = engine.loop
        self.loop.add_reader(sock.fileno(), self._readable)
        self.sweeper: asyncio.TimerHandle | None = None

    def close(self) -> None:
        self.detach().close()

    def detach(self) -> socket.socket:
        for s in list(self.sessions.values()):
            self._close_session(s)
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
        return self.sock

    def _reply_cmsg(self, anc: list[tuple[int, int, bytes]]) -> bytes:
        for level, kind, data in anc:
            if not self.v6 and level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= 12:
                # in_pktinfo {ifindex, spec_dst, addr}: answer from addr (where the redirect sent the datagram)
                return struct.pack("i4s4s", 0, data[8:12], b"\0\0\0\0")
            if self.v6 and level == socket.IPPROTO_IPV6 and kind == IPV6_PKTINFO and len(data) >= 20:
                return data[:16] + struct.pack("I", 0)
        return b""

    def _readable(self) -> None:
        for _ in range(UDP_BATCH):
            try:
                data, anc, _flags, addr = self.sock.recvmsg(65535, 256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:  # destroyed under us (ss -K): unbound, nothing arrives any more
                    self.detach()
                    self.engine.died(self.ident, str(exc))
                return
            session = self.sessions.get(addr)
            if session is None:
                ep = self.balancer.next(str(addr[0]))
                if ep is None:
                    continue
                fam = socket.AF_INET6 if ":" in ep[0] else socket.AF_INET
                out = socket.socket(fam, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
                try:
                    out.connect(ep)
                except OSError:
                    out.close()
                    continue
                session = _UdpSession(addr, ep, out, self._reply_cmsg(anc))
                self.sessions[addr] = session
                self.engine.udp_sessions += 1
                self.loop.add_reader(out.fileno(), self._reply, session)
                if self.sweeper is None:
                    self.sweeper = self.loop.call_later(self.engine.udp_timeout, self._sweep)
            session.last = time.monotonic()
            try:
                session.sock.send(data)
            except OSError:
                self._close_session(session)

    def _reply(self, session: _UdpSession) -> None:
        level = socket.IPPROTO_IPV6 if self.v6 else socket.IPPROTO_IP
        kind = IPV6_PKTINFO if self.v6 else IP_PKTINFO
        cmsg = [(level, kind, session.local)] if session.local else []
        for _ in range(UDP_BATCH):
            try:
                data = session.sock.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP unreachable from the endpoint: the session ends, the next datagram re-picks
                self._close_session(session)
                return
            session.last = time.monotonic()
            try:
                self.sock.sendmsg([data], cmsg, 0, session.client)
            except OSError:
                pass

    def _close_session(self, session: _UdpSession) -> None:
        if self.sessions.get(session.client) is session:
            del self.sessions[session.client]
            self.engine.udp_sessions -= 1
        if session.sock.fileno() >= 0:
            self.loop.remove_reader(session.sock.fileno())
            session.sock.close()

    def drop_sessions(self, gone: set[Addr]) -> None:
        for s in [s for s in self.sessions.values() if s.endpoint in gone]:
            self._close_session(s)

    def _sweep(self) -> None:
        self.sweeper = None
        if not self.sessions:
            return
        limit = time.monotonic() - self.engine.udp_timeout
        for s in [s for s in self.sessions.values() if s.last < limit]:
            self._close_session(s)
        if self.sessions:
            self.sweeper = self.loop.call_later(max(self.engine.udp_timeout / 2, 0.05), self._sweep)
