"""Localhost NodePorts in the nftables mode: ``127.0.0.1:NODEPORT`` served by a relay on the node, as upstream's
KEP-6032 brings them back to its nftables mode (a small userspace proxy), not by rules.

Why a relay and not a DNAT: a packet from 127.0.0.1 DNATed to a pod leaves the loopback device with a loopback
source, which the kernel drops as a martian unless ``route_localnet=1`` (upstream's iptables mode sets it, and with
it CVE-2020-8558's exposure, which it then closes with an extra drop rule). A listener on 127.0.0.1 needs neither:
the node's process connects to a real socket, and the relay dials the endpoint from the node's own address.

What is served: when the core decides the node serves localhost NodePorts (``FamilyContext.localhost_nodeports``:
``--iptables-localhost-nodeports``, ``--nodeport-addresses``, IPv4 only), one listener per NodePort on 127.0.0.1,
TCP and UDP alike (the core's relay, ``kproxy.relay``: TCP accepted and spliced with upstream's dial timeouts; UDP
as sessions, one connected socket per client address, closed after the relay's idle timeout of 250 ms). The
endpoints are the service's cluster endpoints whatever ``externalTrafficPolicy`` says: traffic from the node itself
to one of its own addresses is upstream's short-circuited local traffic. A service without cluster endpoints has
no listener, so the node's client is refused at once (upstream rejects it too). SCTP is not relayed (the kernel's
SCTP sockets are not used by the relay): its localhost NodePort is closed.

Nothing here touches nftables: the listeners are what ``LocalhostRelay`` holds, given per service by the fragment
(``Listen``, pure, rendered with the rest of the service) so a full sync sets exactly the wanted listeners and a
partial sync changes only the dirty services'.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kproxy.model import IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import LOCALHOST, FamilyContext
from kproxy.relay.datapath import Engine, ListenerSpec
from kproxy.relay.listen import listening_socket

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Listen:
    """One localhost NodePort: ``127.0.0.1:port/proto`` relayed to ``endpoints`` (ClientIP ``affinity`` in
    seconds, 0 = none)."""

    proto: str  # tcp / udp
    port: int
    endpoints: tuple[tuple[str, int], ...]
    affinity: int


def listen_for(sp: ServicePort, ctx: FamilyContext) -> Listen | None:
    """The localhost listener one service port needs (None: none; see the module docstring). Pure."""
    if not ctx.localhost_nodeports or ctx.family != IPFamily.V4 or not sp.node_port:
        return None
    if sp.protocol not in (Protocol.TCP, Protocol.UDP):
        return None
    endpoints = tuple(sorted({(e.ip, e.port) for e in sp.cluster_endpoints}))
    if not endpoints:
        return None
    return Listen(sp.protocol.lowercase, sp.node_port, endpoints, sp.affinity_timeout)


def _ident(name: ServicePortName) -> tuple[IPFamily, ServicePortName]:
    return (IPFamily.V4, name)


def _bound(proto: str, port: int) -> socket.socket:
    """A socket on 127.0.0.1:``port``, listening for TCP."""
    return listening_socket(socket.AF_INET, proto, LOCALHOST, port)


class LocalhostRelay:
    """The listeners on 127.0.0.1 and the relay's event loop (started with the first listener, in the backend's
    network namespace, so its sockets are bound there)."""

    def __init__(self, netns: str | None = None) -> None:
        self.engine = Engine(netns, name="kproxy-nftables-localhost")
        self.held: dict[ServicePortName, Listen] = {}
        #: services whose port could not be bound (another program holds 127.0.0.1:port): name -> why
        self.failed: dict[ServicePortName, str] = {}

    def close(self) -> None:
        """Stop the loop; its sockets close with it (SIGTERM and restarts: the next process binds them again)."""
        self.engine.stop()
        self.held.clear()
        self.failed.clear()

    def apply(self, changes: Mapping[ServicePortName, Listen | None], *, full: bool) -> None:
        """Make the relay hold ``changes`` (None: no listener for that service); ``full``: every other listener
        goes too. A port that cannot be bound is logged and recorded in ``failed``, the rest is served."""
        remove: list[ServicePortName] = [n for n in self.held if full and n not in changes]
        specs: list[ListenerSpec] = []
        binds: list[tuple[ServicePortName, Listen]] = []
        for name, want in changes.items():
            have = self.held.get(name)
            if want is None or (have is not None and (have.proto, have.port) != (want.proto, want.port)):
                if have is not None:
                    remove.append(name)
            if want is None:
                self.failed.pop(name, None)
                continue
            if have is not None and (have.proto, have.port) == (want.proto, want.port):
                if have != want:
                    specs.append(ListenerSpec(_ident(name), want.proto, None, want.endpoints, float(want.affinity)))
                    self.held[name] = want
                continue
            binds.append((name, want))
        if not (remove or specs or binds):
            return
        if binds and self.engine.loop is None:
            self.engine.start()  # the thread exists only while some NodePort is served on localhost
        if self.engine.loop is None:  # nothing was ever bound: nothing to remove either
            return
        for name in remove:
            self.held.pop(name, None)
        if remove:
            self.engine.update([], [_ident(n) for n in remove])  # first: a port moving to another service is free
        specs += self._bind(binds)
        self.engine.update(specs, [])

    def _bind(self, binds: Iterable[tuple[ServicePortName, Listen]]) -> list[ListenerSpec]:
        out: list[ListenerSpec] = []
        for name, want in binds:
            try:
                sock: socket.socket = self.engine.run(lambda w=want: _bound(w.proto, w.port))  # type: ignore[misc]
            except OSError as exc:
                why = errno.errorcode.get(exc.errno or 0, str(exc))
                if self.failed.get(name) != why:
                    log.error(
                        "localhost NodePort %s:%d/%s of %s not served: %s", LOCALHOST, want.port, want.proto, name, exc
                    )
                self.failed[name] = why
                continue
            self.failed.pop(name, None)
            self.held[name] = want
            out.append(ListenerSpec(_ident(name), want.proto, sock, want.endpoints, float(want.affinity)))
        return out

    def stats(self) -> dict[str, object]:
        """For ``describe()``: the listeners, the relay's counters, the ports that could not be bound."""
        out: dict[str, object] = {"listeners": len(self.held), "running": self.engine.loop is not None}
        if self.engine.loop is not None:
            out.update(self.engine.stats())
        if self.failed:
            out["notBound"] = {str(n): why for n, why in sorted(self.failed.items(), key=lambda kv: str(kv[0]))}
        return out
