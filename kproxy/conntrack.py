"""The UDP stale-entry reconciler: delete conntrack entries that would keep UDP clients on a dead or wrong path.

UDP has no connection to close, so a client that sends from one fixed source port (a DNS resolver, a game
client) matches the same conntrack entry for as long as it keeps talking, and netfilter never consults the NAT
rules again for it. Two kinds of entry therefore outlive the rules that made them:

(a) entries DNATed to an endpoint that is gone: the client keeps talking into the void, even after the rules
    point elsewhere, and even after the service has lost all its endpoints (the reject rule matches the service
    address, but these packets were already rewritten to the dead endpoint: kubernetes#139628);
(b) entries that were never DNATed (reply source == original destination: the packet met "no endpoints" and was
    rejected or dropped) once the service has endpoints again: the client keeps being rejected;
(c) entries DNATed for a service that was deleted: today's state has no target for its address, so the reconciler
    remembers the UDP service addresses of its last pass and treats one gone since as a target nothing may answer
    (kubernetes#141371, where upstream left such flows behind).

Like upstream's ``pkg/proxy/conntrack/cleanup.go`` ``CleanStaleEntries`` since kubernetes#126130, this works
from STATE, not from events: after each successful sync it dumps the UDP entries and deletes those that
contradict the state just programmed, so a missed event, a failed sync or a restart cannot leave a stale entry
behind. An endpoint that still serves is never stale, whichever traffic policy, topology hint or terminating
state selects it now: like upstream ("we do not take traffic policies, topology, or terminating status of the
service into account"), the allowed set of a service port is every serving endpoint
(``ServicePort.serving_endpoints``), and the ip:port pair must match, so an endpoint whose target port changed
counts as gone. Entries whose original destination is not a service address, and
non-UDP entries, are never touched.

Node ports are matched on the node context's NodePort addresses (``kproxy.nodeaddr``: what ``--nodeport-addresses``
selects of this namespace's addresses) and the Node's own addresses. Upstream matches the node port alone, on any
destination; restricting it to local addresses keeps forwarded pod traffic to some remote host's port 30053 out of
it. Who may answer a flow is the backend's to say (``Proxier.conntrack_answerers``): every serving endpoint for the
NAT modes, the node itself for a proxy that answers from its own sockets.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from pyroute2 import Conntrack
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from kproxy.model import Changes, IPFamily, Protocol, ProxyState, ServicePort
from kproxy.nodeaddr import NodeContext, local_addresses

log = logging.getLogger(__name__)

_AF = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}
_UDP = socket.IPPROTO_UDP

# (address, port) as conntrack reports them, addresses in canonical text form.
AddrPort = tuple[str, int]


def _canon(ip: str) -> str:
    return str(ipaddress.ip_address(ip))


@dataclass(frozen=True, slots=True)
class _Target:
    """What may legitimately answer for one service address:port: the endpoints, and whether there are any."""

    endpoints: frozenset[AddrPort]

    @property
    def has_endpoints(self) -> bool:
        return bool(self.endpoints)


#: who may answer a flow to a service port: the backend's ``Proxier.conntrack_answerers`` (default: every serving
#: endpoint; a userspace proxy answers from the node instead)
Answerers = Callable[[ServicePort], Iterable[tuple[str, int]]]


def serving_endpoints(sp: ServicePort) -> Iterable[tuple[str, int]]:
    return ((ep.ip, ep.port) for ep in sp.serving_endpoints)


def service_targets(
    state: ProxyState, family: IPFamily, node_ips: Collection[str], answerers: Answerers = serving_endpoints
) -> dict[AddrPort, _Target]:
    """Every UDP service address:port of one family (ClusterIP, externalIPs, LB IPs, node IP:nodePort) mapped to
    what may answer for it (``answerers``). Pure; the reconciler's view of the state, exposed for tests."""
    nodes = [_canon(ip) for ip in node_ips if IPFamily.of(ip) == family]
    out: dict[AddrPort, set[AddrPort]] = {}
    for sp in state.family(family).values():
        if sp.protocol is not Protocol.UDP:
            continue
        allowed = frozenset((_canon(ip), port) for ip, port in answerers(sp))
        for key in _addresses(sp, nodes):
            # Two service ports cannot own one address:port/UDP in a valid cluster; if a broken state says they
            # do, the union keeps either one's endpoints alive rather than deleting a live flow.
            out.setdefault(key, set()).update(allowed)
    return {key: _Target(frozenset(eps)) for key, eps in out.items()}


def _addresses(sp: ServicePort, node_ips: list[str]) -> Iterable[AddrPort]:
    for addr in sp.addresses:
        if addr:
            yield _canon(addr), sp.port
    if sp.node_port:
        for ip in node_ips:
            yield ip, sp.node_port


def is_stale(orig_dst: AddrPort, reply_src: AddrPort, target: _Target) -> bool:
    """Whether an entry to a service address contradicts the state (pure; see the module docstring)."""
    if reply_src == orig_dst:  # never DNATed: cached "no endpoints" (rejected or dropped)
        return target.has_endpoints
    return reply_src not in target.endpoints


def reconcile_needed(changes: Changes, state: ProxyState) -> bool:
    """Whether a sync of ``changes`` can have made UDP entries stale: a UDP service port changed (or was removed),
    or a full sync (which may follow missed changes) while any UDP service port exists."""
    if any(spn.protocol is Protocol.UDP for spn in changes.services):
        return True
    return changes.full and any(sp.protocol is Protocol.UDP for sp in state)


class ConntrackReconciler:
    """Deletes stale UDP conntrack entries, per IP family, in the current network namespace (or ``netns``).

    ``reconcile`` is called from the one runner thread; it opens its netlink sockets per call (pyroute2's sync
    API binds a socket to the thread's event loop, and a dump every sync period is cheap next to the sync).
    ``last_duration`` is the wall time of the last ``reconcile`` in seconds, for the metrics.
    """

    def __init__(self, netns: str | None = None, families: Collection[IPFamily] = (IPFamily.V4, IPFamily.V6)):
        self.netns = netns
        self.families = tuple(families)
        self.last_duration = 0.0
        self.last_ok = True  # False after a reconciliation that could not finish: one is still owed
        #: the UDP service address:ports of the last reconciliation per family: a service deleted since has no target
        #: in the state, and the flows still rewritten to its endpoints must go too (upstream's kubernetes#141371)
        self._known: dict[IPFamily, frozenset[AddrPort]] = {}

    def _socket(self, family: IPFamily) -> Any:
        kwargs: dict[str, Any] = {"nfgen_family": _AF[family]}
        if self.netns is not None:
            kwargs["netns"] = self.netns
        return Conntrack(**kwargs)

    def reconcile(
        self, state: ProxyState, node_ips: NodeContext | Collection[str], answerers: Answerers = serving_endpoints
    ) -> dict[IPFamily, int]:
        """Delete the stale UDP entries of every family; returns how many were deleted per family.

        ``node_ips`` is this sync's node context (node ports answer on its NodePort addresses and on the Node's own
        addresses), or a plain list of addresses to which every address of the namespace is added (nodePortAddresses
        empty: every local address); ``answerers`` says who may answer a service port's
        flows (the backend's ``conntrack_answerers``).
        A family whose dump or deletes fail is logged and counted as far as it got, and ``last_ok`` turns False so
        the caller knows a reconciliation is still owed (the daemon retries it on its next sync).
        """
        start = time.monotonic()
        self.last_ok = True
        deleted: dict[IPFamily, int] = {}
        try:
            if isinstance(node_ips, NodeContext):
                ctx = node_ips
                addrs: Collection[str] = {
                    *ctx.nodeport_addresses,
                    *(ip for f in ctx.families.values() for ip in f.node_ips),
                }
                local = False
            else:
                addrs, local = node_ips, True
            for family in self.families:
                deleted[family] = self._reconcile_family(state, family, addrs, answerers, local)
        finally:
            self.last_duration = time.monotonic() - start
        return deleted

    def _reconcile_family(
        self, state: ProxyState, family: IPFamily, node_ips: Collection[str], answerers: Answerers, local: bool
    ) -> int:
        known = self._known.get(family, frozenset())
        if not known and not any(sp.protocol is Protocol.UDP for sp in state.family(family).values()):
            return 0
        if local and any(sp.node_port and sp.protocol is Protocol.UDP for sp in state.family(family).values()):
            try:
                node_ips = {*node_ips, *local_addresses(self.netns)}
            except (NetlinkError, OSError) as exc:
                log.warning("conntrack: listing local addresses failed, node ports matched on node IPs only: %s", exc)
        current = service_targets(state, family, node_ips, answerers)
        # a service address gone since the last reconciliation: nothing may answer for it any more
        targets = {**{key: _Target(frozenset()) for key in known - current.keys()}, **current}
        count, ok = self._delete_stale(family, targets) if targets else (0, True)
        # what this family now holds; after a failure the gone addresses stay known, so the next call retries them
        self._known[family] = frozenset(current) if ok else known | frozenset(current)
        self.last_ok = self.last_ok and ok
        return count

    def _delete_stale(self, family: IPFamily, targets: dict[AddrPort, _Target]) -> tuple[int, bool]:
        """Delete the entries to ``targets`` that contradict them: (how many, whether every step worked)."""
        ok = True
        af = _AF[family]
        count = 0
        ct = self._socket(family)
        try:
            stale = []
            # The kernel filters on protocol (CTA_FILTER, >= 5.8); pyroute2 filters again on our side.
            for entry in ct.dump_entries(tuple_orig=NFCTAttrTuple(family=af, proto=_UDP)):
                orig, reply = entry.tuple_orig, entry.tuple_reply
                if orig.family != af or orig.proto != _UDP or orig.daddr is None or reply.saddr is None:
                    continue
                orig_dst = (_canon(orig.daddr), int(orig.dport))
                target = targets.get(orig_dst)
                if target is None:
                    continue
                if is_stale(orig_dst, (_canon(reply.saddr), int(reply.sport)), target):
                    stale.append(orig)
            for tup in stale:
                try:
                    ct.entry("del", tuple_orig=tup)
                    count += 1
                except NetlinkError as exc:
                    if exc.code != errno.ENOENT:  # gone meanwhile (timed out): nothing to do
                        ok = False
                        log.warning("conntrack: deleting %s failed: %s", tup, exc)
        except (NetlinkError, OSError) as exc:
            ok = False
            log.warning("conntrack: %s reconcile failed after %d deletions: %s", family.value, count, exc)
        finally:
            ct.close()
        log.debug("conntrack: deleted %d stale %s UDP entries", count, family.value)
        return count, ok
