"""The relay's engine: proxy sockets served by one event loop thread, bytes moved by ``splice`` (zero copy).

One ``Engine`` per user runs an asyncio event loop in a thread of its own (started by the backend's ``start``,
never in its ``__init__``), in the backend's network namespace: the userspace mode relays every service through
it, the nftables mode its localhost NodePorts alone. Everything the loop touches (listeners, balancers,
connections, UDP sessions) is changed only in the loop thread: the runner thread hands over ready-made listening
sockets and endpoint lists with ``Engine.update`` (``call_soon_threadsafe``) and waits until the loop has taken
them, so when a sync returns the data path already uses the new endpoints, and the loop never waits for a sync.
The listeners are ``tcp.TcpListener`` (accept, dial, splice relay) and ``udp.UdpListener`` (sessions); each balances
with a ``balancer.Balancer``; the counters are ``stats.Stats``, and with ``counting`` (``--service-counters``) each
listener's ``counters.Tally``, read in one step of the loop by ``dump.dump``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kproxy.toolkit.netns import enter_netns

from .balancer import Addr
from .stats import Closable, Ident, Stats
from .tcp import TcpListener
from .udp import UdpListener

log = logging.getLogger(__name__)

UPDATE_CHUNK = 256  # listeners per step of the loop when a sync hands them over
SWEEP_S = 1.0


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """What the runner thread hands the loop for one proxy socket: its id, the bound socket, its balancing."""

    ident: Ident
    proto: str
    sock: socket.socket | None  # None: keep the socket the loop already has
    endpoints: tuple[Addr, ...]
    affinity: float


class Engine:
    """The event loop thread and every proxy socket (see the module docstring)."""

    def __init__(
        self,
        netns: str | None = None,
        udp_timeout: float = 0.25,
        counting: bool = False,
        name: str = "kproxy-relay",
    ) -> None:
        self.netns = netns
        self.name = name  # the loop thread's name, and the log's
        self.udp_timeout = udp_timeout
        self.counting = counting
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.listeners: dict[Ident, TcpListener | UdpListener] = {}
        self.counters = Stats()
        self.open: set[Closable] = set()  # closed at stop: sockets die with the loop, never left to the GC
        #: listeners whose socket stopped listening under the loop (``ss -K``, a closed descriptor): the loop stops
        #: reading them and the proxier's next sync (``needs_full``) binds new ones; written by the loop thread only
        self.dead: set[Ident] = set()
        #: told (loop thread) of each listener that died: the proxier asks the ledger for a full sync of its family
        self.on_dead: Callable[[Ident], None] | None = None

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

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
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
            raise RuntimeError(f"{self.name}: the relay is not running")
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
            raise TimeoutError(f"{self.name}: the relay did not answer")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def update(self, specs: list[ListenerSpec], remove: list[Ident]) -> None:
        """Open, retarget and close listeners (from the runner thread), in steps of UPDATE_CHUNK so that the loop
        serves connections in between while a full sync hands it thousands."""
        for i in range(0, max(len(specs), len(remove)), UPDATE_CHUNK):
            part, gone = specs[i : i + UPDATE_CHUNK], remove[i : i + UPDATE_CHUNK]
            self.run(lambda part=part, gone=gone: self._update(part, gone))  # type: ignore[misc]

    # -- the loop thread ---------------------------------------------------------------------------------------

    def _update(self, specs: list[ListenerSpec], remove: list[Ident]) -> None:
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
                kind = TcpListener if spec.proto == "tcp" else UdpListener
                lst = kind(self, spec.sock, spec.ident)
                self.listeners[spec.ident] = lst
            gone = lst.balancer.update(spec.endpoints, spec.affinity)
            if gone and isinstance(lst, UdpListener):
                lst.drop_sessions(gone)
            if gone and lst.tally is not None:
                lst.tally.forget(gone)

    def _sweep(self) -> None:
        assert self.loop is not None
        now = time.monotonic()
        for lst in self.listeners.values():
            lst.balancer.sweep(now)
        self.loop.call_later(SWEEP_S, self._sweep)

    def died(self, ident: Ident, why: str) -> None:
        """A listener's socket stopped listening under the loop (loop thread): stop reading it, remember it."""
        if ident not in self.dead:
            log.warning("%s: proxy socket %s stopped listening (%s): bound anew at next sync", self.name, ident, why)
        self.dead.add(ident)
        if self.on_dead is not None:
            self.on_dead(ident)

    def table(self) -> dict[int, tuple[Ident, frozenset[Addr], float, bool]]:
        """What the loop serves, by socket inode: (ident, endpoints, affinity timeout, dead). Any thread (it runs in
        the loop); ``verify`` reads it (the data path itself, not a record of what was written)."""

        def go() -> dict[int, tuple[Ident, frozenset[Addr], float, bool]]:
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
        result: dict[int, tuple[Ident, frozenset[Addr], float, bool]] = self.run(go)
        return result

    def detach(self, ident: Ident) -> socket.socket | None:
        """Take a listener out of the loop and return its socket, open (loop thread; see the proxier's hand-over)."""
        self.dead.discard(ident)
        lst = self.listeners.pop(ident, None)
        if lst is None:
            return None
        return lst.detach()

    def stats(self) -> dict[str, int]:
        """The listeners and the counters (``stats.Stats``), for ``describe()``."""
        return {"listeners": len(self.listeners), **self.counters.as_dict()}
