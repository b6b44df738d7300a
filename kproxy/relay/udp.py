"""The relay's UDP side: a session per client address with a connected socket to its endpoint.

Replies go back through the proxy socket from the address the client's datagram was redirected to (``IP_PKTINFO``),
so conntrack reverses the redirect; a session idle longer than the UDP timeout is closed, and sessions to an
endpoint that is gone are closed at once (the client's next datagram picks a live one). With ``--service-counters``
(the listener's ``tally``, else None) a new session counts as a flow of its endpoint and every datagram's payload
is added to the bytes, both directions (``counters``). Loop thread only.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import time
from typing import Any

from kproxy.config import parse_duration

from .balancer import Addr, Balancer
from .counters import Tally
from .stats import Host, Ident

UDP_BATCH = 64
IP_PKTINFO = 8
IPV6_RECVPKTINFO = 49
IPV6_PKTINFO = 50


class Duration(float):
    """The UDP idle timeout (the mode's ``udp_timeout`` option): seconds, given as upstream's durations (``250ms``,
    ``1s``, ``2m``) or a plain number of seconds, parsed by the core's one duration parser (finite, within Go's
    range); must be greater than 0, as upstream's udpIdleTimeout."""

    def __new__(cls, text: str | float = 0.0) -> Duration:
        value = parse_duration(text, "udp-idle-timeout")
        if value <= 0:
            raise ValueError(f"udp-idle-timeout: {text!r} must be greater than 0")
        return super().__new__(cls, value)


class _UdpSession:
    __slots__ = ("client", "endpoint", "sock", "local", "last")

    def __init__(self, client: Any, endpoint: Addr, sock: socket.socket, local: bytes) -> None:
        self.client = client
        self.endpoint = endpoint
        self.sock = sock
        self.local = local  # the ancillary data that sends replies from the redirected-to address
        self.last = time.monotonic()


class UdpListener:
    """One UDP proxy socket: a session per client address, replies sent back through it."""

    def __init__(self, engine: Host, sock: socket.socket, ident: Ident = ()) -> None:
        self.engine = engine
        self.ident = ident
        self.sock = sock
        self.balancer = Balancer()
        self.tally = Tally() if engine.counting else None
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
        tally = self.tally
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
            if tally is not None:
                tally.bytes += len(data)
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
                if tally is not None:
                    tally.connected(ep)
                self.engine.counters.udp_sessions += 1
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
        tally = self.tally
        for _ in range(UDP_BATCH):
            try:
                data = session.sock.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP unreachable from the endpoint: the session ends, the next datagram re-picks
                self._close_session(session)
                return
            session.last = time.monotonic()
            if tally is not None:
                tally.bytes += len(data)
            try:
                self.sock.sendmsg([data], cmsg, 0, session.client)
            except OSError:
                pass

    def _close_session(self, session: _UdpSession) -> None:
        if self.sessions.get(session.client) is session:
            del self.sessions[session.client]
            self.engine.counters.udp_sessions -= 1
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
