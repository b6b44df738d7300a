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

What it compares the entries with is kept, not rebuilt: a ``TargetMap`` per family holds the UDP service
address:ports and their service ports, brought up to date from the service ports the syncs since the last call
changed (the daemon hands them over; a full sync or nothing known walks the table), so a reconciliation after a
partial sync costs the changes plus the dump, whatever the table's size. Who may answer for an address is asked of
the state only for the addresses the dump names.

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
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pyroute2 import Conntrack
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from kproxy.model import Changes, IPFamily, Protocol, ProxyState, ServicePort, ServicePortName
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

_NOBODY = _Target(frozenset())  # a service address gone since the last reconciliation: nothing may answer


def serving_endpoints(sp: ServicePort) -> Iterable[tuple[str, int]]:
    return ((ep.ip, ep.port) for ep in sp.serving_endpoints)


def _allowed(sp: ServicePort, answerers: Answerers) -> frozenset[AddrPort]:
    return frozenset((_canon(ip), port) for ip, port in answerers(sp))


def service_targets(
    state: ProxyState, family: IPFamily, node_ips: Collection[str], answerers: Answerers = serving_endpoints
) -> dict[AddrPort, _Target]:
    """Every UDP service address:port of one family (ClusterIP, externalIPs, LB IPs, node IP:nodePort) mapped to
    what may answer for it (``answerers``). Pure, O(services): the reference the reconciler's ``TargetMap`` keeps
    up to date in O(changes), exposed for tests."""
    nodes = _family_nodes(node_ips, family)
    out: dict[AddrPort, set[AddrPort]] = {}
    for sp in state.family(family).values():
        if sp.protocol is not Protocol.UDP:
            continue
        allowed = _allowed(sp, answerers)
        for key in _addresses(sp, nodes):
            # Two service ports cannot own one address:port/UDP in a valid cluster; if a broken state says they
            # do, the union keeps either one's endpoints alive rather than deleting a live flow.
            out.setdefault(key, set()).update(allowed)
    return {key: _Target(frozenset(eps)) for key, eps in out.items()}


def _family_nodes(node_ips: Iterable[str], family: IPFamily) -> tuple[str, ...]:
    """The node addresses of ``family``, canonical, each once, in a stable order (so two calls compare equal)."""
    return tuple(sorted({_canon(ip) for ip in node_ips if IPFamily.of(ip) == family}))


def _addresses(sp: ServicePort, node_ips: Iterable[str]) -> Iterable[AddrPort]:
    for addr in sp.addresses:
        if addr:
            yield _canon(addr), sp.port
    if sp.node_port:
        for ip in node_ips:
            yield ip, sp.node_port


def _own_keys(sp: ServicePort) -> tuple[AddrPort, ...]:
    """``sp``'s service address:ports, node ports apart; the state's own address text when it is canonical already
    (it is, from the cache), so the map holds no second copy of it."""
    out = []
    for addr in sp.addresses:
        if addr:
            canon = _canon(addr)
            out.append((addr if canon == addr else canon, sp.port))
    return tuple(dict.fromkeys(out))


class TargetMap:
    """One family's UDP service address:ports and the service ports that own each, kept up to date from the changed
    service ports alone, so the reconciliation after a partial sync costs what changed, not the table.

    It holds addresses, never endpoints: who may answer for an address is asked of the state, through the backend's
    answerers, only when a conntrack entry names it (``target``), so it is always today's answer (a userspace
    proxy's answerers follow its sockets and this node's addresses) and the map costs a few hundred bytes per UDP
    service port. Node ports are keyed on ``nodes``; a change of those re-keys only the service ports with a node
    port. Beside the map it keeps, without copying either, how today's addresses differ from those of the last
    reconciliation (``known``): ``gone`` (known, no target now: kubernetes#141371's deleted service) and ``new``.
    ``targets()`` equals ``service_targets`` plus the gone addresses (tests/unit/test_conntrack_targets.py).
    """

    def __init__(self, family: IPFamily) -> None:
        self.family = family
        self.nodes: tuple[str, ...] = ()
        self.built = False
        self._own: dict[ServicePortName, tuple[tuple[AddrPort, ...], int]] = {}  # own keys, node port
        self._owners: dict[AddrPort, ServicePortName | tuple[ServicePortName, ...]] = {}  # one owner, or several
        self._node_ported: set[ServicePortName] = set()
        self.gone: set[AddrPort] = set()
        self.new: set[AddrPort] = set()

    def __bool__(self) -> bool:
        return bool(self._owners) or bool(self.gone)

    @property
    def has_node_ports(self) -> bool:
        return bool(self._node_ported)

    def update(self, state: ProxyState, changed: Iterable[ServicePortName] | None) -> None:
        """Take ``state``: only the ``changed`` service ports can differ from the last update's (None: anything)."""
        if changed is None or not self.built:
            self._rebuild(state)
            return
        services = state.family(self.family)
        for spn in changed:
            if spn.protocol is Protocol.UDP:
                self._set(spn, services.get(spn))

    def set_nodes(self, node_ips: Iterable[str]) -> None:
        """Key node ports on the addresses of this family among ``node_ips`` from now on."""
        nodes = _family_nodes(node_ips, self.family)
        if nodes == self.nodes:
            return
        entries = [(spn, self._own[spn]) for spn in self._node_ported]
        for spn, entry in entries:
            self._unkey(spn, entry)
        self.nodes = nodes
        for spn, entry in entries:
            self._key(spn, entry)

    def target(self, state: ProxyState, key: AddrPort, answerers: Answerers) -> _Target | None:
        """What may answer for ``key`` in ``state`` (the state of the last ``update``); None: not a service
        address:port of this family, then an entry to it is none of the reconciler's business."""
        owners = self._owners.get(key)
        if owners is None:
            return _NOBODY if key in self.gone else None
        services = state.family(self.family)
        if not isinstance(owners, tuple):
            sp = services.get(owners)
            return _Target(_allowed(sp, answerers)) if sp is not None else _NOBODY
        # several owners (a broken state): the union keeps either one's endpoints alive, as ``service_targets``
        allowed = [_allowed(sp, answerers) for sp in (services.get(spn) for spn in owners) if sp is not None]
        return _Target(frozenset().union(*allowed))

    def targets(self, state: ProxyState, answerers: Answerers = serving_endpoints) -> dict[AddrPort, _Target]:
        """Every address this reconciliation looks at and its target: O(the map), for tests."""
        out = {key: self.target(state, key, answerers) for key in (*self._owners, *self.gone)}
        return {key: t for key, t in out.items() if t is not None}

    def reconciled(self, ok: bool) -> None:
        """A reconciliation ended: ``known`` becomes today's addresses, or, when it could not finish, today's and
        the ones it knew (so the gone addresses are tried again)."""
        if ok:
            self.gone.clear()
        self.new.clear()

    def _rebuild(self, state: ProxyState) -> None:
        """Build the map from ``state`` alone, O(services): known (today's minus new, plus gone) is kept."""
        known = (self._owners.keys() - self.new) | self.gone
        self._own, self._owners, self._node_ported = {}, {}, set()
        self.gone, self.new = set(), set()
        for sp in state.family(self.family).values():
            if sp.protocol is Protocol.UDP:
                self._set(sp.name, sp)
        self.gone = known - self._owners.keys()
        self.new = set(self._owners.keys() - known)
        self.built = True

    def _set(self, spn: ServicePortName, sp: ServicePort | None) -> None:
        old = self._own.pop(spn, None)
        if old is not None:
            self._unkey(spn, old)
            self._node_ported.discard(spn)
        if sp is None or sp.protocol is not Protocol.UDP:
            return
        entry = self._own[spn] = (_own_keys(sp), sp.node_port or 0)
        if entry[1]:
            self._node_ported.add(spn)
        self._key(spn, entry)

    def _keys(self, entry: tuple[tuple[AddrPort, ...], int]) -> Iterable[AddrPort]:
        own, node_port = entry
        if not node_port:
            return own
        return dict.fromkeys((*own, *((ip, node_port) for ip in self.nodes)))

    def _key(self, spn: ServicePortName, entry: tuple[tuple[AddrPort, ...], int]) -> None:
        owners_of = self._owners
        for key in self._keys(entry):
            owners = owners_of.get(key)
            if owners is None:
                owners_of[key] = spn
                if key in self.gone:
                    self.gone.discard(key)
                else:
                    self.new.add(key)
            elif isinstance(owners, tuple):
                owners_of[key] = (*owners, spn)
            else:
                owners_of[key] = (owners, spn)

    def _unkey(self, spn: ServicePortName, entry: tuple[tuple[AddrPort, ...], int]) -> None:
        owners_of = self._owners
        for key in self._keys(entry):
            owners = owners_of[key]
            if isinstance(owners, tuple):
                rest = tuple(o for o in owners if o != spn)
                owners_of[key] = rest[0] if len(rest) == 1 else rest
                continue
            del owners_of[key]
            if key in self.new:
                self.new.discard(key)
            else:
                self.gone.add(key)


def is_stale(orig_dst: AddrPort, reply_src: AddrPort, target: _Target) -> bool:
    """Whether an entry to a service address contradicts the state (pure; see the module docstring)."""
    if reply_src == orig_dst:  # never DNATed: cached "no endpoints" (rejected or dropped)
        return target.has_endpoints
    return reply_src not in target.endpoints


def udp_changes(changes: Changes) -> Iterator[ServicePortName]:
    """The UDP service ports ``changes`` names (the only ones the reconciler looks at)."""
    return (spn for spn in changes.services if spn.protocol is Protocol.UDP)


def reconcile_needed(changes: Changes, state: ProxyState) -> bool:
    """Whether a sync of ``changes`` can have made UDP entries stale: a UDP service port changed (or was removed),
    or a full sync (which may follow missed changes) while any UDP service port exists."""
    if any(udp_changes(changes)):
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
        #: per family, the UDP service address:ports and how they differ from those of the last reconciliation: a
        #: service deleted since has no target in the state, and the flows still rewritten to its endpoints must go
        #: too (upstream's kubernetes#141371)
        self.maps: dict[IPFamily, TargetMap] = {f: TargetMap(f) for f in self.families}

    def _socket(self, family: IPFamily) -> Any:
        kwargs: dict[str, Any] = {"nfgen_family": _AF[family]}
        if self.netns is not None:
            kwargs["netns"] = self.netns
        return Conntrack(**kwargs)

    def reconcile(
        self,
        state: ProxyState,
        node_ips: NodeContext | Collection[str],
        answerers: Answerers = serving_endpoints,
        changed: Collection[ServicePortName] | None = None,
    ) -> dict[IPFamily, int]:
        """Delete the stale UDP entries of every family; returns how many were deleted per family.

        ``node_ips`` is this sync's node context (node ports answer on its NodePort addresses and on the Node's own
        addresses), or a plain list of addresses to which every address of the namespace is added (nodePortAddresses
        empty: every local address); ``answerers`` says who may answer a service port's
        flows (the backend's ``conntrack_answerers``). ``changed``: the only service ports that may differ from the
        state of the last call (the syncs' changes since); None (anything may have) walks every service port.
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
                deleted[family] = self._reconcile_family(state, family, addrs, answerers, local, changed)
        finally:
            self.last_duration = time.monotonic() - start
        return deleted

    def update_targets(
        self,
        state: ProxyState,
        family: IPFamily,
        node_ips: Collection[str],
        changed: Collection[ServicePortName] | None,
        *,
        local: bool = False,
    ) -> TargetMap:
        """``family``'s target map brought up to ``state`` (``changed``: see ``reconcile``), node ports keyed on
        ``node_ips`` (and, with ``local``, every address of the namespace): the reconciliation before its dump."""
        targets = self.maps[family]
        try:
            targets.update(state, changed)
        except BaseException:
            targets.built = False  # half updated: the next call builds it again from its state
            raise
        if local and targets.has_node_ports:
            try:
                node_ips = {*node_ips, *local_addresses(self.netns)}
            except (NetlinkError, OSError) as exc:
                log.warning("conntrack: listing local addresses failed, node ports matched on node IPs only: %s", exc)
        targets.set_nodes(node_ips)
        return targets

    def _reconcile_family(
        self,
        state: ProxyState,
        family: IPFamily,
        node_ips: Collection[str],
        answerers: Answerers,
        local: bool,
        changed: Collection[ServicePortName] | None,
    ) -> int:
        targets = self.update_targets(state, family, node_ips, changed, local=local)
        if not targets:  # no UDP service address now, none gone since the last time
            targets.reconciled(True)
            return 0
        memo: dict[AddrPort, _Target | None] = {}

        def lookup(key: AddrPort) -> _Target | None:
            if key not in memo:
                memo[key] = targets.target(state, key, answerers)
            return memo[key]

        count, ok = self._delete_stale(family, lookup)
        # what this family now holds; after a failure the gone addresses stay known, so the next call retries them
        targets.reconciled(ok)
        self.last_ok = self.last_ok and ok
        return count

    def _delete_stale(self, family: IPFamily, targets: Callable[[AddrPort], _Target | None]) -> tuple[int, bool]:
        """Delete the entries whose target (``targets``: None for an address that is not a service's) they
        contradict: (how many, whether every step worked)."""
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
                target = targets(orig_dst)
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
