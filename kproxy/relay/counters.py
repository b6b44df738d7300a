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
- The dump (``dump.py``) is taken in the loop thread (``Engine.run``), so it never races a relay: a snapshot of ints
  and small tuples there, turned into ``PortCounters`` in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .balancer import Addr


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
