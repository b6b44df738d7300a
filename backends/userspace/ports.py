"""The userspace mode's proxy ports: ``--proxy-port-range`` and the allocator that binds proxy sockets in it.

A port is free when no socket of this process holds it and bind() takes it; a service port that finds none is
refused (``ProxyPortsExhausted``) and the rest of the batch goes on. The default range (``DEFAULT_PORT_RANGE``) is a
range of its own below the NodePort range and the kernel's ephemeral range, so proxy sockets neither use up the
node's outgoing ports nor sit where other programs expect random ports; an empty range is upstream's "random": the
namespace's ``ip_local_port_range``. kproxy picks the ports itself, walking the range from a cursor: the kernel's
bind(0) searches its tables for a free port on every call, which costs far more at thousands of sockets
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import errno
import itertools
import logging
import random
import resource
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kproxy.model import IPFamily, ServicePortName
from kproxy.proxier import BackendError
from kproxy.relay.listen import listening_socket

log = logging.getLogger(__name__)

#: the proxy port range when none is given: below the NodePort range (30000-32767) and the kernel's ephemeral range
#: (32768-60999), above the node components' own ports (10248-10260: kubelet, kube-proxy's health and metrics)
DEFAULT_PORT_RANGE = "20000-29999"
FLOOR_BATCH = 2000  # sockets bind_seconds holds at once

Held = tuple[int, str, int]  # (socket family, protocol, port)


#: descriptors kept back from proxy sockets: relayed connections (six each), libnftables' memfd, netlink and the API
#: connections; a table that took every descriptor for sockets could not even be written
FD_RESERVE = 4096


def descriptor_budget() -> int | None:
    """How many proxy sockets the open-file limit leaves room for: the hard limit (which
    ``kernel.raise_open_file_limit`` lifts the soft one to) less ``FD_RESERVE``; None when unlimited."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return None if hard == resource.RLIM_INFINITY else max(0, hard - FD_RESERVE)


def parse_port_range(text: str) -> tuple[int, int] | None:
    """Upstream's ``--proxy-port-range``: ``BEGIN-END``, ``BEGIN+SIZE`` or one port (inclusive); empty, ``0`` or
    ``0-0`` for upstream's "random": the kernel's ephemeral range (``ip_local_port_range``). ValueError on anything
    else, naming the flag."""
    t = (text or "").strip()
    if t in ("", "0", "0-0"):
        return None
    try:
        if "+" in t:
            a, _, n = t.partition("+")
            lo, hi = int(a), int(a) + int(n) - 1
        else:
            a, sep, b = t.partition("-")
            lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        lo = hi = 0
    if not (0 < lo <= hi <= 65535):
        raise ValueError(f"--proxy-port-range {text!r}: expected BEGIN-END, BEGIN+SIZE or PORT within 1-65535")
    return lo, hi


class PortRange(str):
    """A ``--proxy-port-range`` value, checked when given (``parse_port_range``)."""

    def __new__(cls, text: str = "") -> PortRange:
        parse_port_range(text)
        return super().__new__(cls, text.strip())


class ProxyPortsExhausted(BackendError):
    """Every port of the proxy port range is held (by this proxy's sockets or by other sockets) for one address
    family and protocol: the service port that needed one more is refused, and says why."""

    def __init__(self, family: IPFamily, proto: str, span: tuple[int, int], held: int, busy: int) -> None:
        self.family, self.proto, self.span, self.held, self.busy = family, proto, span, held, busy
        lo, hi = span
        super().__init__(
            f"no proxy port free in --proxy-port-range {lo}-{hi} ({hi - lo + 1} ports) for {family.value} "
            f"{proto.upper()}: {held} held by this proxy's sockets, {busy} by other sockets; widen the range"
        )


def socket_family(fam: IPFamily) -> int:
    return int(socket.AF_INET if fam == IPFamily.V4 else socket.AF_INET6)


class PortPool:
    """The range in effect and the ports this process's proxy sockets hold in it, per socket family and protocol.
    ``in_namespace`` runs a function in the backend's namespace (the thread where its sockets are made): the
    kernel's ephemeral range is read there."""

    def __init__(self, port_range: tuple[int, int] | None, in_namespace: Callable[[Callable[[], Any]], Any]) -> None:
        self.range = port_range  # None: the namespace's ip_local_port_range
        self.used: set[Held] = set()  # taken by this process's proxy sockets
        self._in_namespace = in_namespace
        self._cursor: dict[tuple[int, str], int] = {}  # where the next search starts, per family and protocol
        self._auto: tuple[int, int] | None = None

    def span(self) -> tuple[int, int]:
        """The range in effect, inclusive: ``--proxy-port-range``, else the backend namespace's
        ``ip_local_port_range`` (read there once)."""
        if self.range is not None:
            return self.range
        if self._auto is None:
            self._in_namespace(self._local_range)
        return self._local_range()

    def capacity(self) -> int:
        """How many proxy sockets fit, per address family and protocol: the range's size."""
        lo, hi = self.span()
        return hi - lo + 1

    def contains(self, port: int) -> bool:
        lo, hi = self.span()
        return lo <= port <= hi

    def take(self, af: int, proto: str, port: int) -> None:
        """``port`` is held by a socket of this process (one bound here, or taken over from another instance)."""
        self.used.add((af, proto, port))

    def release(self, af: int, proto: str, port: int) -> None:
        self.used.discard((af, proto, port))

    def candidates(self, af: int, proto: str) -> Iterator[int]:
        """Ports to try, from a cursor that walks the range skipping those this process holds."""
        lo, hi = self.span()
        n = hi - lo + 1
        start = self._cursor.get((af, proto))
        if start is None:
            start = random.randrange(n)
        for i in range(n):
            off = (start + i) % n
            port = lo + off
            if (af, proto, port) not in self.used:
                self._cursor[(af, proto)] = off + 1
                yield port

    def _local_range(self) -> tuple[int, int]:
        if self._auto is None:
            try:
                with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:  # the calling thread's namespace
                    a, b = fh.read().split()[:2]
                self._auto = (int(a), int(b))
            except (OSError, ValueError):
                self._auto = (32768, 60999)
        return self._auto

    def bind(self, fam: IPFamily, proto: str, preferred: int | None) -> tuple[socket.socket, int]:
        """A proxy socket bound (and listening, for TCP) on the wildcard address, in the calling thread's namespace:
        ``preferred`` when free and in the range (a restart keeps the ports its rules name), else the next free port
        of the range. ProxyPortsExhausted when every port of the range is taken; OSError on any other failure."""
        af = socket_family(fam)
        first = [preferred] if preferred and self.contains(preferred) else []
        busy = 0
        for port in itertools.chain(first, self.candidates(af, proto)):
            try:
                sock = _bound(af, proto, port)
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise OSError(exc.errno, f"proxy socket {proto}/{port}: {exc.strerror}") from None
                busy += port not in first
                continue
            self.take(af, proto, port)
            return sock, port
        lo, hi = self.span()
        held = sum(1 for a, p, n in self.used if a == af and p == proto and lo <= n <= hi)
        raise ProxyPortsExhausted(fam, proto, (lo, hi), held, busy)


def _bound(af: int, proto: str, port: int) -> socket.socket:
    """One wildcard socket on ``port``, listening for TCP."""
    return listening_socket(af, proto, "", port)


def bind_seconds(fam: IPFamily, tcp_n: int, udp_n: int) -> float | None:
    """Seconds binding (and for TCP listening on) ``tcp_n`` + ``udp_n`` wildcard sockets takes in the calling
    thread's namespace (the bench's floor), None when binding failed (logged). Explicit ports, as ``PortPool`` picks
    them, in batches closed in between: this process still holds its own proxy sockets and the descriptor limit is
    shared."""
    af = socket_family(fam)
    lo = 20000
    spent = 0.0
    try:
        for proto, n in (("tcp", tcp_n), ("udp", udp_n)):
            for first in range(0, n, FLOOR_BATCH):
                socks = []
                t1 = time.perf_counter()
                try:
                    for i in range(first, min(n, first + FLOOR_BATCH)):
                        socks.append(_bound(af, proto, lo + i % 40000))
                    spent += time.perf_counter() - t1
                finally:
                    for so in socks:
                        so.close()
    except OSError as exc:
        log.warning("floor: binding %d sockets failed: %s", tcp_n + udp_n, exc)
        return None
    return spent


Ident = tuple[IPFamily, ServicePortName, str]  # (family, service port, role): one proxy socket


class Sockets(dict[Ident, int]):
    """Every proxy socket the data path holds, and its port; also their roles by (family, service port) and their
    count per family, so that a partial batch looks up its services' sockets instead of walking every one. Written
    only through ``put``, ``take`` and ``clear``."""

    def __init__(self) -> None:
        super().__init__()
        self._roles: dict[tuple[IPFamily, ServicePortName], set[str]] = {}
        self._count: dict[IPFamily, int] = {}

    def put(self, ident: Ident, port: int) -> None:
        if ident not in self:
            self._count[ident[0]] = self._count.get(ident[0], 0) + 1
            self._roles.setdefault((ident[0], ident[1]), set()).add(ident[2])
        self[ident] = port

    def take(self, ident: Ident) -> int:
        port = self.pop(ident)
        self._count[ident[0]] -= 1
        roles = self._roles[(ident[0], ident[1])]
        roles.discard(ident[2])
        if not roles:
            del self._roles[(ident[0], ident[1])]
        return port

    def clear(self) -> None:
        super().clear()
        self._roles.clear()
        self._count.clear()

    def of(self, family: IPFamily, names: Iterable[ServicePortName]) -> list[Ident]:
        """The sockets of these service ports in ``family``."""
        return [(family, spn, role) for spn in names for role in self._roles.get((family, spn), ())]

    def count(self, family: IPFamily) -> int:
        return self._count.get(family, 0)
