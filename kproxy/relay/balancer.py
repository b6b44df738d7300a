"""Round robin with ClientIP affinity for one proxy socket: upstream's ``LoadBalancerRR`` (one service port).

The endpoints are shuffled on every change (as upstream, so nodes do not all start on the same one); an affinity
entry lasts the service's timeout from its last use, entries of removed endpoints are dropped at once and stale
ones by the engine's sweep every second. Loop thread only.
"""

from __future__ import annotations

import random
import time

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
