"""This node's context, resolved once per sync: how local traffic is told apart, where NodePorts answer, which
addresses are this node's. Every backend, the service health servers and the conntrack reconciler read the same
frozen value, so they can never disagree about "is this address the node" or "is this packet from a local pod".

Upstream spreads this over ``pkg/proxy/util/localdetector.go`` (LocalTrafficDetector: ``--detect-local-mode``
ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix) and ``pkg/proxy/util/nodeport_addresses.go``
(``--nodeport-addresses``: CIDRs or ``primary``; none, or a 0.0.0.0/0 / ::/0, means every local address). The
decisions are made here in kproxy's terms; each backend spells them in its own syntax (``-s CIDR`` / ``-i br0`` for
iptables, ``ip saddr CIDR`` / ``iifname "veth*"`` for nftables, a prefix check in a BPF program).

Localhost NodePorts (upstream's ``iptables.localhostNodePorts``, ``--iptables-localhost-nodeports``, default true)
are decided here once, per family, and every mode serves them from ``FamilyContext.localhost_nodeports``: NodePorts
answer on 127.0.0.1 to the node's own processes when the flag is on, the family is IPv4 (``[::1]:NODEPORT`` never
worked upstream: IPv6 has no ``route_localnet``) and ``--nodeport-addresses`` lets loopback in (none given, a
match-all CIDR, or a CIDR holding 127.0.0.1; upstream's ``ContainsIPv4Loopback``; ``primary`` alone does not).
``--nodeport-addresses`` keeps its meaning for every other address: the CIDRs a backend matches leave loopback out
(a CIDR around it is split into the CIDRs around it) and 127.0.0.1 is carried by the flag alone, so no backend
matches loopback by accident; a loopback CIDR that does not serve (the flag off, or IPv6) is said once in the log,
as upstream says it. How each mode serves it (route_localnet and upstream's rules, a redirect on the output path, a
connect-time frontend, a relay) is in its package docstring.

The node's own addresses come from netlink (``local_addresses``). The daemon reads them through an
``AddressWatch``: again only after the kernel announced an address change, so a sync in the steady state makes no
netlink call at all (a fresh netlink socket per sync was a measurable part of every sync: docs/PERFORMANCE.md,
"The core").
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, NodeInfo

log = logging.getLogger(__name__)

LOOPBACK = {IPFamily.V4: ipaddress.ip_network("127.0.0.0/8"), IPFamily.V6: ipaddress.ip_network("::1/128")}
#: where localhost NodePorts answer (IPv4 only)
LOCALHOST = "127.0.0.1"


@functools.lru_cache(maxsize=256)
def _log_once(msg: str, *args: object) -> None:
    # resolve() runs on every sync: say each (message, address) once per process (bounded: addresses are input)
    log.error(msg, *args)


@dataclass(frozen=True, slots=True)
class LocalDetect:
    """How traffic from this node's pods is recognised (upstream's LocalTrafficDetector), for one family.

    ``kind``: ``cidr`` (source address in ``values``: the cluster CIDR, or this node's pod CIDR), ``bridge``
    (arrives on the bridge interface ``values[0]``), ``prefix`` (arrives on an interface whose name starts with
    ``values[0]``), or ``none`` (cannot tell: upstream's no-op detector, which masquerades nothing for off-cluster
    sources and short-circuits nothing).
    """

    kind: str = "none"
    values: tuple[str, ...] = ()

    @property
    def implemented(self) -> bool:
        return self.kind != "none"


@dataclass(frozen=True, slots=True)
class FamilyContext:
    """Everything about this node that rules of one IP family depend on, besides the ServicePorts."""

    family: IPFamily
    local: LocalDetect = LocalDetect()
    #: NodePorts answer on every local address but loopback (no ``--nodeport-addresses``, or a match-all CIDR)
    nodeport_all_local: bool = True
    #: otherwise: CIDRs whose local addresses accept NodePorts (loopback excluded, a CIDR around it split)
    nodeport_cidrs: tuple[str, ...] = ()
    #: ``primary``: the Node object's own addresses of this family (each a single address)
    nodeport_ips: tuple[str, ...] = ()
    #: the Node object's addresses of this family (upstream's nodeIP: load-balancer source ranges, health servers)
    node_ips: tuple[str, ...] = ()
    #: every address this network namespace holds in this family, loopback included
    local_addresses: tuple[str, ...] = ()
    masquerade_all: bool = False
    #: NodePorts answer on 127.0.0.1 to the node's own processes (see the module docstring; IPv4 only)
    localhost_nodeports: bool = False

    @property
    def nodeport_addresses(self) -> tuple[str, ...]:
        """The addresses of this node that accept NodePorts now (resolved against ``local_addresses``), 127.0.0.1
        last when localhost NodePorts are served."""
        loop = LOOPBACK[self.family]
        mine = [ipaddress.ip_address(a) for a in self.local_addresses]
        if self.nodeport_all_local:
            out = [str(a) for a in mine if a not in loop]
        else:
            nets = [ipaddress.ip_network(c) for c in self.nodeport_cidrs]
            out = [str(a) for a in mine if any(a in n for n in nets)]
            out += [ip for ip in self.nodeport_ips if ip not in out]
        if self.localhost_nodeports:
            out.append(LOCALHOST)
        return tuple(out)

    def without_addresses(self) -> FamilyContext:
        """This context minus the live address list: what rules that match addresses by kind (``fib daddr type
        local``, ``addrtype LOCAL``) depend on, so an address change need not rewrite them."""
        return FamilyContext(
            self.family,
            self.local,
            self.nodeport_all_local,
            self.nodeport_cidrs,
            self.nodeport_ips,
            self.node_ips,
            (),
            self.masquerade_all,
            self.localhost_nodeports,
        )


def _empty() -> Mapping[IPFamily, FamilyContext]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class NodeContext:
    """The node's context for every family kproxy runs (see the module docstring)."""

    node_name: str = ""
    families: Mapping[IPFamily, FamilyContext] = field(default_factory=_empty)

    def family(self, family: IPFamily) -> FamilyContext:
        found = self.families.get(family)
        return found if found is not None else FamilyContext(family)

    @property
    def local_addresses(self) -> tuple[str, ...]:
        return tuple(a for fc in self.families.values() for a in fc.local_addresses)

    @property
    def nodeport_addresses(self) -> tuple[str, ...]:
        """Every family's NodePort addresses (the health servers' and the conntrack reconciler's)."""
        return tuple(a for fc in self.families.values() for a in fc.nodeport_addresses)

    def __hash__(self) -> int:
        return hash((self.node_name, tuple(sorted(self.families.items()))))


def local_detect(config: ProxyConfig, node: NodeInfo, family: IPFamily) -> LocalDetect:
    """Upstream's LocalTrafficDetector choice for one family (``--detect-local-mode``)."""
    mode = config.detect_local_mode
    if mode == "NodeCIDR":
        cidrs = tuple(c for c in node.pod_cidrs if IPFamily.of(c) == family)[:1]
        return LocalDetect("cidr", cidrs) if cidrs else LocalDetect()
    if mode == "BridgeInterface":
        return LocalDetect("bridge", (config.pod_bridge_interface,)) if config.pod_bridge_interface else LocalDetect()
    if mode == "InterfaceNamePrefix":
        prefix = config.pod_interface_name_prefix
        return LocalDetect("prefix", (prefix,)) if prefix else LocalDetect()
    cidrs = config.cluster_cidrs_for(family)[:1]
    return LocalDetect("cidr", cidrs) if cidrs else LocalDetect()


def nodeports(addrs: Sequence[str], node: NodeInfo, family: IPFamily) -> tuple[bool, tuple[str, ...], tuple[str, ...]]:
    """``--nodeport-addresses`` for one family: (every local address but loopback, CIDRs, primary addresses).

    As upstream: no CIDR of this family, or one that is 0.0.0.0/0 or ::/0, means every local address (loopback
    excluded here: localhost NodePorts are ``localhost_nodeports``' alone). ``primary`` means the Node's addresses of
    the family."""
    loop = LOOPBACK[family]
    cidrs, primary = _family_cidrs(addrs, node, family)
    if (not cidrs and not primary) or any(n.prefixlen == 0 for n in cidrs):
        return True, (), ()
    ips: list[str] = []
    for ip in primary:
        if ipaddress.ip_address(ip) in loop:
            _log_once("--nodeport-addresses: node address %s is loopback; it is not a NodePort address", ip)
            continue
        ips.append(ip)
    out: list[str] = []
    for net in cidrs:
        if net.subnet_of(loop):  # type: ignore[arg-type]
            continue  # localhost NodePorts: localhost_nodeports() decides
        parts = sorted(net.address_exclude(loop)) if loop.subnet_of(net) else [net]  # type: ignore[arg-type]
        out.extend(str(p) for p in parts)
    return False, tuple(out), tuple(ips)


def _family_cidrs(
    addrs: Sequence[str], node: NodeInfo, family: IPFamily
) -> tuple[list[ipaddress.IPv4Network | ipaddress.IPv6Network], list[str]]:
    """``--nodeport-addresses``' CIDRs of one family, and the Node's addresses of the family if ``primary`` is named."""
    cidrs: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    primary: list[str] = []
    for item in addrs:
        if item == "primary":
            primary.extend(ip for ip in node.addresses if IPFamily.of(ip) == family)
            continue
        try:
            net = ipaddress.ip_network(item, strict=False)
        except ValueError:
            continue
        if (net.version == 6) == (family == IPFamily.V6):
            cidrs.append(net)
    return cidrs, primary


def localhost_nodeports(config: ProxyConfig, node: NodeInfo, family: IPFamily) -> bool:
    """Whether NodePorts answer on 127.0.0.1 in ``family`` (see the module docstring): upstream's decision in
    ``NewProxier`` (``localhostNodePorts`` and ``nodePortAddresses.ContainsIPv4Loopback()``), IPv4 only."""
    cidrs, primary = _family_cidrs(config.nodeport_addresses, node, family)
    lets_in = (not cidrs and not primary) or any(
        n.prefixlen == 0 or ipaddress.ip_address(LOCALHOST) in n for n in cidrs
    )
    named = [n for n in cidrs if n.prefixlen and n.overlaps(LOOPBACK[family])]  # type: ignore[arg-type]
    if family == IPFamily.V6:
        for net in named:
            _log_once("--nodeport-addresses includes localhost %s: localhost NodePorts are not supported on IPv6", net)
        return False
    if not config.localhost_nodeports:
        for net in named:
            _log_once("--nodeport-addresses includes localhost %s but --iptables-localhost-nodeports=false", net)
        return False
    return lets_in


def resolve(
    config: ProxyConfig,
    node: NodeInfo,
    addresses: Iterable[str] = (),
    families: Sequence[IPFamily] | None = None,
) -> NodeContext:
    """The node's context for ``families`` (default: the config's) from the config, the Node object and this
    namespace's ``addresses`` (``local_addresses()``; pure, so tests pass their own)."""
    fams = tuple(families) if families is not None else tuple(config.ip_families)
    addrs = [str(ipaddress.ip_address(a)) for a in addresses]
    out: dict[IPFamily, FamilyContext] = {}
    for fam in fams:
        all_local, cidrs, ips = nodeports(config.nodeport_addresses, node, fam)
        out[fam] = FamilyContext(
            family=fam,
            local=local_detect(config, node, fam),
            nodeport_all_local=all_local,
            nodeport_cidrs=cidrs,
            nodeport_ips=ips,
            node_ips=tuple(ip for ip in node.addresses if IPFamily.of(ip) == fam),
            local_addresses=tuple(a for a in addrs if IPFamily.of(a) == fam),
            masquerade_all=config.masquerade_all,
            localhost_nodeports=localhost_nodeports(config, node, fam),
        )
    return NodeContext(config.node_name, MappingProxyType(out))


def health_check_addresses(nodeport_addresses: Sequence[str], addresses: Iterable[str]) -> list[str]:
    """Where healthCheckNodePort servers listen, as upstream's service health server: every address (an empty list:
    the wildcard) unless ``--nodeport-addresses`` names CIDRs, then this node's ``addresses`` inside any of them,
    loopback included when a CIDR names it (health checks are plain sockets, not NodePort rules). ``primary`` (the
    Node's addresses, known only once the Node is listed) keeps the wildcard."""
    nets = []
    for c in nodeport_addresses:
        if c == "primary":
            continue
        try:
            nets.append(ipaddress.ip_network(c, strict=False))
        except ValueError:
            continue
    if not nets:
        return []
    return [a for a in addresses if any(ipaddress.ip_address(a) in n for n in nets)]


def local_addresses(netns: str | None = None) -> list[str]:
    """This network namespace's addresses (pyroute2, netlink), or those of the named namespace."""
    from pyroute2 import IPRoute, NetNS

    with NetNS(netns) if netns else IPRoute() as ipr:
        out = []
        for msg in ipr.get_addr():
            # IFA_LOCAL is the address itself; IFA_ADDRESS is the peer's on point-to-point links (tunnels)
            addr = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            if addr:
                out.append(str(addr))
        return out


# rtnetlink multicast groups (linux/rtnetlink.h): address added or removed
_RTMGRP_IPV4_IFADDR = 0x10
_RTMGRP_IPV6_IFADDR = 0x100


class AddressWatch:
    """This network namespace's addresses (``local_addresses()``), read again only after the kernel announced an
    address change. A netlink socket subscribed to the IPv4 and IPv6 address groups is drained by a daemon thread,
    which marks the copy stale on every message (and on an overrun, ENOBUFS: events were lost); ``current()`` reads
    netlink only when the copy is stale, so in the steady state it makes no system call. The copy is marked fresh
    before it is read: a change announced during the read makes the next call read again. Without a netlink socket
    (no permission) every call reads, as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stale = True
        self._cached: tuple[str, ...] = ()
        self._sock: socket.socket | None = None
        self._started = False
        self._closed = threading.Event()
        self.reads = 0  # netlink reads so far (tests, diagnostics)

    def _start(self) -> None:
        self._started = True
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            sock.bind((0, _RTMGRP_IPV4_IFADDR | _RTMGRP_IPV6_IFADDR))
            sock.settimeout(5.0)  # wakes now and then to notice close()
        except OSError as exc:
            log.debug("no netlink address events (%s): this node's addresses are read on every sync", exc)
            return
        self._sock = sock
        threading.Thread(target=self._listen, args=(sock,), name="address-watch", daemon=True).start()

    def _listen(self, sock: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                try:
                    sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError as exc:
                    with self._lock:
                        self._stale = True
                        if exc.errno != errno.ENOBUFS:  # not an overrun: stop listening, read on every call
                            self._sock = None
                    if exc.errno != errno.ENOBUFS:
                        log.debug("netlink address events ended (%s): addresses are read on every sync", exc)
                        return
                    continue
                with self._lock:
                    self._stale = True
        finally:
            sock.close()

    def current(self) -> list[str]:
        """The namespace's addresses now (a fresh list)."""
        with self._lock:
            if not self._started:
                self._start()
            if self._sock is None:
                fresh = None
            elif not self._stale:
                return list(self._cached)
            else:
                self._stale = False
                fresh = True
        try:
            addrs = local_addresses()
        except BaseException:
            with self._lock:
                self._stale = True
            raise
        self.reads += 1
        if fresh:
            with self._lock:
                self._cached = tuple(addrs)
        return addrs

    def close(self) -> None:
        self._closed.set()
