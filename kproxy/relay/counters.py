"""The relay's traffic counters (``--service-counters``): per listener, new connections and flows per
endpoint and the bytes relayed, and the one dump per family the collector reads (``kproxy.counters``).

Decisions:

- What is counted: **connections** (a TCP client connected to an endpoint, or reset because none answered; a new UDP
  session, which is a flow) per endpoint, and **bytes** per service port: the payload the relay received from
  clients and from endpoints, both directions summed (TCP stream bytes, UDP datagram payloads; no headers, unlike
  the kernel modes' packet lengths). **Packets are not offered**: a relay reads a byte stream, not packets (one splice
  carries many segments, and the kernel's per-socket segment counts are the relay's own two connections with their
  ACKs, not the client's packets), and a per-datagram count for UDP alone would make the measure mean two things.
- Nothing exists when counting is off: a listener's ``tally`` is None and its relays are the plain ones. TCP bytes
  cost no work per splice, on or off: each relay half already keeps running totals of the bytes it took from its
  socket and gave to the other (what waits in its pipe is their difference), and a counting relay adds its halves'
  totals to the tally when it ends; a dump adds those of the relays still open. No syscall either (``TCP_INFO``'s
  ``tcpi_bytes_received`` would cost two per connection, a few microseconds, and counts the FIN as a byte). UDP adds
  each datagram's length when counting (no total exists per datagram otherwise); off, one ``is None`` test per
  datagram.
- A tally belongs to its listener: a service port's counters go when its proxy socket is closed (service removed, a
  socket bound anew after it died), and the counts of an endpoint go when the endpoint leaves the balancer. They do
  not survive a restart: the process holds them, as it holds the connections. A service port with two proxy sockets
  (a Local policy's ``i`` and ``e`` roles) is summed over both.
- The dump is taken in the loop thread (``Engine.run``), so it never races a relay: a snapshot of ints and small
  tuples there, turned into ``PortCounters`` in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from kproxy.counters import CounterDump, Counts, PortCounters
from kproxy.model import IPFamily, ServicePortName

from .balancer import Addr
from .stats import Ident

if TYPE_CHECKING:
    from .datapath import Engine
    from .tcp import TcpListener
    from .udp import UdpListener

DUMP_TIMEOUT_S = 10.0


class Metered(Protocol):
    """An open TCP relay that can say how many bytes it took from its two sockets so far."""

    def moved(self) -> int: ...


class Tally:
    """One listener's counters, changed in the loop thread only."""

    __slots__ = ("connections", "endpoints", "bytes", "live")

    def __init__(self) -> None:
        self.connections = 0  # every client the listener took on: connected, or reset because no endpoint answered
        self.endpoints: dict[Addr, int] = {}  # connections (TCP) and sessions (UDP) per endpoint
        self.bytes = 0  # bytes of closed TCP relays, and of every UDP datagram, both directions
        self.live: set[Metered] = set()  # open TCP relays: their bytes are read from the kernel at a dump

    def connected(self, ep: Addr) -> None:
        self.connections += 1
        self.endpoints[ep] = self.endpoints.get(ep, 0) + 1

    def refused(self) -> None:
        self.connections += 1

    def closed(self, relay: Metered) -> None:
        """A TCP relay ends: its bytes join the closed ones (before its sockets close)."""
        if relay in self.live:
            self.live.discard(relay)
            self.bytes += relay.moved()

    def forget(self, gone: Iterable[Addr]) -> None:
        """Endpoints that left the balancer: their counts go (the service's total keeps them)."""
        for ep in gone:
            self.endpoints.pop(ep, None)

    def moved(self) -> int:
        return self.bytes + sum(r.moved() for r in self.live)


def endpoint_key(ep: Addr) -> str:
    return f"[{ep[0]}]:{ep[1]}" if ":" in ep[0] else f"{ep[0]}:{ep[1]}"


#: what the loop thread hands over per listener: its service port, its endpoints, and its tally's figures
_Row = tuple[ServicePortName, tuple[Addr, ...], dict[Addr, int], int, int]


def _snapshot(listeners: Mapping[Ident, TcpListener | UdpListener], family: IPFamily) -> list[_Row]:
    """Loop thread: every counting listener of ``family`` (idents ``(family, service port, role)``)."""
    rows = []
    for ident, lst in listeners.items():
        tally = lst.tally
        if tally is None or ident[0] != family:
            continue
        rows.append((ident[1], tuple(lst.balancer.endpoints), dict(tally.endpoints), tally.connections, tally.moved()))
    return rows


def dump(engine: Engine, family: IPFamily) -> CounterDump:
    """Every proxy socket's counters in ``family``, read in the loop thread in one step (``datapath.Engine``); an
    engine not running has none."""
    if engine.loop is None:
        return CounterDump(family, {})
    try:
        rows: list[_Row] = engine.run(lambda: _snapshot(engine.listeners, family), DUMP_TIMEOUT_S)
    except RuntimeError:  # stopped meanwhile
        return CounterDump(family, {})
    merged: dict[ServicePortName, tuple[dict[Addr, int], int, int]] = {}
    for spn, eps, per_ep, conns, moved in rows:
        seen, total, nbytes = merged.get(spn, ({}, 0, 0))
        for ep in eps:
            seen[ep] = seen.get(ep, 0) + per_ep.get(ep, 0)
        merged[spn] = (seen, total + conns, nbytes + moved)
    ports = {
        spn: PortCounters.of({endpoint_key(ep): Counts(seen[ep]) for ep in sorted(seen)}, Counts(total, None, nbytes))
        for spn, (seen, total, nbytes) in merged.items()
    }
    return CounterDump(family, ports)
