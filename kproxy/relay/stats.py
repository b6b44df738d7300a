"""The relay's statistics, and what its listeners share with the engine that runs them.

The counters are changed only in the loop thread (no lock: one writer); ``Engine.stats`` reads them for
``describe()``. ``Host`` is the engine as a listener sees it (``tcp``, ``udp``): the loop, the set of open dials
and relays closed with the loop, the counters, the UDP idle timeout, whether listeners count their traffic per
service (``counters``) and where a listener reports that its socket
stopped listening. A protocol rather than the engine's class, so the listeners do not import the engine that
imports them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

Ident = tuple[Any, ...]  # a listener's id: (family, service port, role) for the proxier


@dataclass(slots=True)
class Stats:
    """What the data path did, since it started."""

    connections: int = 0  # relayed TCP connections open now
    peak_connections: int = 0
    accepted: int = 0
    failed_dials: int = 0  # clients reset because no endpoint answered
    udp_sessions: int = 0  # UDP client sessions open now

    def opened(self) -> None:
        """A relayed connection opened."""
        self.connections += 1
        self.peak_connections = max(self.peak_connections, self.connections)

    def as_dict(self) -> dict[str, int]:
        return {
            "connections": self.connections,
            "peakConnections": self.peak_connections,
            "accepted": self.accepted,
            "failedDials": self.failed_dials,
            "udpSessions": self.udp_sessions,
        }


class Closable(Protocol):
    def abort(self) -> None: ...


class Host(Protocol):
    """The engine as its listeners use it (loop thread only)."""

    loop: asyncio.AbstractEventLoop | None
    udp_timeout: float
    #: ``--service-counters``: each listener keeps a ``counters.Tally`` (None when off: nothing counts)
    counting: bool
    counters: Stats
    #: dials and relays in progress: aborted when the loop stops, so their sockets never wait for the collector
    open: set[Closable]

    def died(self, ident: Ident, why: str) -> None:
        """A listener's socket stopped listening under the loop."""
        ...
