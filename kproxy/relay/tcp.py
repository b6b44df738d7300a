"""The relay's TCP side: a proxy socket's accepts, the dial to an endpoint, and the relay.

- ``TcpListener``: accept in batches (``ACCEPT_BATCH``) and hand each client to a ``_Dial``.
- ``_Dial``: pick an endpoint (the listener's ``Balancer``), connect without blocking with upstream's dial timeouts
  (250 ms, 500 ms, 1 s, 2 s), each failure trying the next endpoint with the client's affinity reset; no endpoint
  left: the client is reset (RST).
- ``_Relay``: per direction a pipe and ``os.splice`` socket -> pipe -> socket (no copy through Python), driven by
  ``add_reader``/``add_writer``, a few splices per wake-up; half close passed on; an error on either side resets
  both. Why splice and what the pipe size buys: docs/PERFORMANCE.md.
- With ``--service-counters`` (the listener's ``tally``, else None): ``_CountedRelay`` in place of ``_Relay``, which
  counts the connection for its endpoint and adds the bytes its halves moved when it closes (``counters``); the
  splice path is the same code either way (each half keeps running totals of the bytes it took and gave, which is
  the bookkeeping of what waits in its pipe, and the count).

Everything here runs in the engine's loop thread (``kproxy.relay.datapath``).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import socket
import struct

from .balancer import Addr, Balancer
from .counters import Tally
from .stats import Host, Ident

log = logging.getLogger(__name__)

DIAL_TIMEOUTS = (0.25, 0.5, 1.0, 2.0)  # upstream's EndpointDialTimeouts
CHUNK = 1 << 20  # bytes per splice
PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ: larger pipes carry more per splice (docs/PERFORMANCE.md)
ACCEPT_BATCH = 64
READ_ROUNDS = 8  # splices per readable event before yielding to the loop
SMALL = 1 << 16  # a read shorter than this ends the rounds (spares the EAGAIN of a request/response exchange)
F_SETPIPE_SZ = 1031
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_LINGER_RST = struct.pack("ii", 1, 0)


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    except OSError:
        pass
    sock.close()


class TcpListener:
    """One TCP proxy socket: accepts in batches and dials an endpoint for each client."""

    def __init__(self, engine: Host, sock: socket.socket, ident: Ident = ()) -> None:
        self.engine = engine
        self.ident = ident
        self.sock = sock
        self.balancer = Balancer()
        self.tally = Tally() if engine.counting else None
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
                log.warning("relay: accept failed: %s", exc)
                return
            self.engine.counters.accepted += 1
            client.setblocking(False)
            _Dial(self, client, str(addr[0])).attempt()


class _Dial:
    """Connecting one accepted client to an endpoint, with upstream's timeouts and retries."""

    __slots__ = ("listener", "client", "client_ip", "tries", "server", "timer", "ep")

    def __init__(self, listener: TcpListener, client: socket.socket, client_ip: str) -> None:
        self.listener = listener
        self.client = client
        self.client_ip = client_ip
        self.tries = 0
        self.server: socket.socket | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.ep: Addr | None = None
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
            engine.counters.failed_dials += 1
            self._refused()
            return
        ep = self.listener.balancer.next(self.client_ip, reset=self.tries > 0)
        if ep is None:  # no endpoints (the redirect rules reject those; this is a race with a sync)
            self._refused()
            return
        self.ep = ep
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

    def _refused(self) -> None:
        if self.listener.tally is not None:
            self.listener.tally.refused()
        self.abort()

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
        tally = self.listener.tally
        if tally is None:
            relay = _Relay(self.listener.engine, self.client, self.server)
        else:
            assert self.ep is not None
            tally.connected(self.ep)
            relay = _CountedRelay(self.listener.engine, self.client, self.server, tally)
        relay.halves[0].readable()  # the client's request usually waits already: pass it on without a loop turn


class _Relay:
    """Both directions of one proxied connection."""

    __slots__ = ("engine", "a", "b", "halves", "open")

    def __init__(self, engine: Host, a: socket.socket, b: socket.socket) -> None:
        self.engine = engine
        self.a, self.b = a, b
        engine.counters.opened()
        engine.open.add(self)
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
            self.engine.counters.connections -= 1
            self.engine.open.discard(self)
            self.open = -1


class _CountedRelay(_Relay):
    """A relay of a counting listener: in its tally's open relays until it ends, then its bytes join the tally's."""

    __slots__ = ("tally",)

    def __init__(self, engine: Host, a: socket.socket, b: socket.socket, tally: Tally) -> None:
        self.tally = tally
        tally.live.add(self)
        super().__init__(engine, a, b)

    def moved(self) -> int:
        """Bytes taken from the client and from the endpoint so far (the halves' own running totals)."""
        return self.halves[0].taken + self.halves[1].taken

    def abort(self) -> None:
        self.tally.closed(self)
        super().abort()

    def close(self) -> None:
        self.tally.closed(self)
        super().close()


class _Half:
    __slots__ = ("relay", "src", "dst", "sfd", "dfd", "taken", "given", "eof", "reading", "writing", "done", "loop")

    def __init__(self, relay: _Relay, src: socket.socket, dst: socket.socket) -> None:
        self.relay = relay
        self.src, self.dst = src, dst
        self.sfd, self.dfd = src.fileno(), dst.fileno()
        # running totals of the bytes taken from ``src`` into the pipe and given from it to ``dst``: what waits in
        # the pipe is their difference, and ``taken`` is this direction's byte count (``--service-counters``)
        self.taken = self.given = 0
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
            self.taken += n
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
        while self.given < self.taken:
            try:
                n = os.splice(self.pr, self.dfd, self.taken - self.given, flags=SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                return False
            self.given += n
        return True
