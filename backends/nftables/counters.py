"""The nftables mode's traffic counters (``--service-counters``): new connections per service port and endpoint, in
named counter objects of kproxy's table.

Decisions:

- **Connections only** (``OFFERED``). The mode's rules are nat chains, which see only a connection's first packet
  (conntrack translates the rest without them): a counter there counts new connections (TCP), new flows (UDP) and
  new associations (SCTP). Packets and bytes would take a rule every packet crosses (a filter-hook chain), a
  per-packet cost the mode does not otherwise pay.
- **Where**: the DNAT happens in shared chains (``numgen random mod K map @backends-tcp``), one rule for every
  service with K endpoints, so no rule belongs to one endpoint. The count is taken after the DNAT instead, in two
  base chains of the source-NAT hooks (``count-postrouting``, ``count-input``, priority 90: before any source NAT,
  which would end the hook's nat chains; a connection reaches exactly one of them, once): ``meta l4proto tcp ct
  status dnat counter name ct original ip daddr . meta l4proto . ct original proto-dst . ip daddr . th dport map
  @endpoint-counters accept`` (the service address the client dialled and the endpoint the DNAT chose; a NodePort
  by protocol and port in ``@nodeport-endpoint-counters``), one rule per protocol and map, since ``ct original
  proto-dst`` has a type only where the transport protocol is known. So every path to an endpoint counts the same
  way: shared chains, ClientIP affinity's own chains, firewalls, Local policy's shortcuts. Connections that are not
  DNATed are not counted: rejected or dropped ones (no (local) endpoints), and localhost NodePorts (the relay's).
- **Named counters, one per (service port, endpoint)**: ``c-<service>-<endpoint>``, the service part a hash of the
  service's comment key, the endpoint part its address and port in hex, so a name is safe nft text by construction,
  says which service it belongs to, and gives back its endpoint (adoption rebuilds a changed service's map elements
  from the kernel's counter names alone). Each of the service's addresses and its NodePort maps the endpoint to that
  one counter; the service's total is the sum of its endpoints'. A counter is written only when its endpoint appears
  and deleted when it goes (``render.change_service``): a partial sync that changes one endpoint leaves the other
  endpoints' counters alone, even when their slots in ``@backends`` move; a restart writes nothing of an unchanged
  service, and a service's counters go with it.
- **One dump per family per read**: one netlink object dump (``NFT_MSG_GETOBJ``, filtered by the kernel to the
  table's counters), parsed here. Not libnftables' ``list counters table ip kproxy``: nft 1.0.6 fetches every
  set element of the table before it lists objects (100,000 slots at 10,000 services x 10 endpoints; later
  versions filter object reads in the kernel), while the dump carries only the counters. Mapped back to service
  ports and endpoints through the ledger's applied fragments (each names its counters, in its endpoints' order);
  that mapping is kept per fragment object.
- **Off** (the default): nothing of this is written; the fixed part, the layout digest and every fragment are what
  they are without counters. Turning it on or off changes the layout digest: the table is replaced whole once.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import Endpoint, IPFamily, ServicePort, ServicePortName
from kproxy.nftkernel import Nft
from kproxy.proxier import BackendError

from . import layout
from .render import Fragment, _digest

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})


def service_part(comment: str) -> str:
    """The service part of its counters' names, from the service's comment key (``Fragment.comment``)."""
    return layout.short_hash(comment, 12)


def counter_name(part: str, ip: str, port: int) -> str:
    """``c-<service part>-<address><port>`` in lowercase hex; ValueError for an address that is not one."""
    if not 0 < port < 65536:
        raise ValueError(f"endpoint port {port} out of range")
    return f"c-{part}-{ipaddress.ip_address(ip).packed.hex()}{port:04x}"


def endpoint_of(name: str) -> tuple[str, str, int] | None:
    """(service part, address, port) of a counter name; None for a name that is not one of kproxy's."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] != "c" or len(parts[2]) not in (12, 36):
        return None
    try:
        raw = bytes.fromhex(parts[2][:-4])
        return parts[1], str(ipaddress.ip_address(raw)), int(parts[2][-4:], 16)
    except ValueError:
        return None


def endpoint_text(ip: str, port: int) -> str:
    """``ip:port``, ``[ip]:port`` for IPv6 (``kproxy.counters``' spelling)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _endpoints(sp: ServicePort) -> list[Endpoint]:
    """Every endpoint any address of the service may DNAT to, once each, in a stable order."""
    return list(dict.fromkeys((*sp.internal_endpoints, *sp.cluster_endpoints, *sp.local_endpoints)))


def _map_elements(
    entries: Iterable[tuple[str, str, str]], eps: list[tuple[str, int, str]]
) -> list[tuple[str, str, str]]:
    """The counter-map elements of a service's entries: each address (or NodePort) with each endpoint to its
    counter."""
    out = []
    for m, key, _ in entries:
        cmap = layout.ENDPOINT_COUNTERS if m == layout.SERVICE_IPS else layout.NODEPORT_ENDPOINT_COUNTERS
        out += [(cmap, f"{key} . {ip} . {port}", name) for ip, port, name in eps]
    return out


def with_counters(frag: Fragment, sp: ServicePort) -> Fragment:
    """``frag`` with its endpoints' counters (``Fragment.counters``) and their map elements, appended after its own
    elements (its first stays its ClusterIP entry); the digest covers them."""
    part = service_part(frag.comment)
    eps = [(ep.ip, ep.port, counter_name(part, ep.ip, ep.port)) for ep in _endpoints(sp)]
    if not eps:
        return frag
    elements = (*frag.elements, *_map_elements(frag.entries, eps))
    digest = _digest(elements, (frag.shared, frag.chains, frag.sets, frag.hairpin))
    return replace(frag, elements=elements, counters=tuple(name for _, _, name in eps), digest=digest)


def skeleton(entries: Mapping[tuple[str, str], str], names: Iterable[str]) -> dict[tuple[str, str], str | None]:
    """The counter-map elements the kernel holds for a service adopted with ``entries`` ((map, key) -> verdict) and
    the counters ``names`` (the kernel's, of its service part): its entries times the endpoints the names give."""
    eps = [(got[1], got[2], name) for name in names if (got := endpoint_of(name)) is not None]
    return {(m, k): v for m, k, v in _map_elements(((m, k, "") for m, k in entries), eps)}


# netlink: nfnetlink's nftables subsystem, its object messages and attributes (linux/netfilter/nf_tables.h)
_GETOBJ = (10 << 8) | 19  # NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETOBJ
_DUMP = 0x1 | 0x300  # NLM_F_REQUEST | NLM_F_DUMP
_DUMP_INTR = 0x10  # NLM_F_DUMP_INTR: the table changed during the dump
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_OBJ_TABLE, _OBJ_NAME, _OBJ_TYPE, _OBJ_DATA = 1, 2, 3, 4
_COUNTER_PACKETS = 2
_OBJECT_COUNTER = 1
_NETLINK_NETFILTER = 12


def _attrs(data: bytes, start: int, end: int) -> dict[int, tuple[int, int]]:
    """Netlink attributes in ``data[start:end]``: type (nested flag dropped) -> (payload start, payload end)."""
    out: dict[int, tuple[int, int]] = {}
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, start)
        if length < 4:
            break
        out[kind & 0x3FFF] = (start + 4, start + length)
        start += (length + 3) & ~3
    return out


def _request(family: IPFamily, seq: int) -> bytes:
    table = layout.TABLE.encode() + b"\0"
    attrs = struct.pack("=HH", 4 + len(table), _OBJ_TABLE) + table + b"\0" * (-len(table) % 4)
    attrs += struct.pack("=HH", 8, _OBJ_TYPE) + struct.pack(">I", _OBJECT_COUNTER)
    nfgen = struct.pack("=BBH", socket.AF_INET if family is IPFamily.V4 else socket.AF_INET6, 0, 0)
    return struct.pack("=IHHII", 16 + len(nfgen) + len(attrs), _GETOBJ, _DUMP, seq, 0) + nfgen + attrs


def parse_dump(chunks: Iterable[bytes]) -> tuple[dict[str, int], bool]:
    """The counters of a netlink object dump (the datagrams it was read in) -> (packets per name, whether the dump
    ended; an interrupted dump, its table changed meanwhile, raises InterruptedError). OSError for an error
    message."""
    out: dict[str, int] = {}
    for data in chunks:
        at = 0
        while at + 16 <= len(data):
            length, kind, flags = struct.unpack_from("=IHH", data, at)
            if length < 16:
                break
            if kind == _NLMSG_DONE:
                return out, True
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, at + 16)
                if code:
                    raise OSError(-code, f"netlink object dump: {os.strerror(-code)}")
            elif flags & _DUMP_INTR:
                raise InterruptedError("the table changed during the dump")
            elif kind == (10 << 8) | 18:  # NFT_MSG_NEWOBJ
                attrs = _attrs(data, at + 20, at + length)
                name, data_at = attrs.get(_OBJ_NAME), attrs.get(_OBJ_DATA)
                if name is not None and data_at is not None:
                    inner = _attrs(data, *data_at).get(_COUNTER_PACKETS)
                    if inner is not None:
                        key = data[name[0] : name[1]].rstrip(b"\0").decode()
                        (out[key],) = struct.unpack_from(">Q", data, inner[0])
            at += (length + 3) & ~3
    return out, False


def _ended(data: bytes) -> bool:
    """Whether a datagram of a dump holds its end (headers only; InterruptedError, OSError as ``parse_dump``)."""
    at = 0
    while at + 16 <= len(data):
        length, kind, flags = struct.unpack_from("=IHH", data, at)
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            parse_dump([data[at : at + length]])
        elif flags & _DUMP_INTR:
            raise InterruptedError("the table changed during the dump")
        at += max(16, (length + 3) & ~3)
    return False


def raw_dump(family: IPFamily) -> list[bytes]:
    """The datagrams of one object dump of the table's counters, in the calling thread's namespace (taken again, up
    to twice, when the table changed during it)."""
    for attempt in range(3):
        chunks: list[bytes] = []
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sock:
            sock.settimeout(30)
            sock.bind((0, 0))
            sock.send(_request(family, attempt + 1))
            try:
                while True:
                    chunks.append(sock.recv(1 << 20))
                    if _ended(chunks[-1]):
                        return chunks
            except InterruptedError:
                continue
    raise OSError(errno.EAGAIN, "netlink object dump: the table kept changing")


def read_names(nft: Nft, family: IPFamily) -> tuple[dict[str, int] | None, str]:
    """Every counter of kproxy's table in ``family`` with its packets, in one netlink object dump (see the module
    docstring); (None, error) on failure. An absent table reads as no counters."""
    try:
        return parse_dump(nft.call(lambda: raw_dump(family)))[0], ""
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return None, str(exc)


def by_service(counts: Mapping[str, int]) -> dict[str, list[str]]:
    """Counter names grouped by their service part."""
    out: dict[str, list[str]] = {}
    for name in counts:
        got = endpoint_of(name)
        if got is not None:
            out.setdefault(got[0], []).append(name)
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    """One fragment's counters and their endpoints, in the fragment's order."""

    fragment: Fragment
    endpoints: tuple[str, ...]


def _plan(fragment: Fragment) -> _Plan:
    eps = []
    for name in fragment.counters:
        got = endpoint_of(name)
        assert got is not None, name  # written by with_counters
        eps.append(endpoint_text(got[1], got[2]))
    return _Plan(fragment, tuple(eps))


def dump(
    family: IPFamily, fragments: Mapping[ServicePortName, Fragment], packets: Mapping[str, int], plans: dict[Any, _Plan]
) -> CounterDump:
    """The CounterDump of ``fragments`` from the named counters' packets. ``plans`` (service port -> plan) is the
    last call's, updated in place. A service whose counters the kernel lacks is left out (not programmed)."""
    ports: dict[ServicePortName, PortCounters] = {}
    for spn, fragment in fragments.items():
        p = plans.get(spn)
        if p is None or p.fragment is not fragment:
            p = plans[spn] = _plan(fragment)
        try:
            conns = tuple([packets[name] for name in fragment.counters])
        except KeyError:
            continue
        ports[spn] = PortCounters(Counts(sum(conns)), p.endpoints, conns)
    for spn in plans.keys() - fragments.keys():
        del plans[spn]  # a service's counters go with it
    return CounterDump(family, ports)


class _Source(Protocol):
    @property
    def nft(self) -> Nft: ...

    def applied(self, family: IPFamily) -> tuple[Any, dict[ServicePortName, Fragment]]: ...


class Reader:
    """A proxier's counter reads: one listing of the table's counters per call, and the plans of the fragments it
    mapped last. Calls come from the scrape's collector, one at a time."""

    def __init__(self, proxier: _Source) -> None:
        self.proxier = proxier
        self._plans: dict[IPFamily, dict[Any, _Plan]] = {}
        self._lock = threading.Lock()

    def read(self, family: IPFamily) -> CounterDump:
        """Every service port the ledger records as applied in ``family``, with its connections per endpoint.
        BackendError when the listing fails."""
        _, fragments = self.proxier.applied(family)
        packets, err = read_names(self.proxier.nft, family)
        if packets is None:
            raise BackendError(f"nft list counters table {layout.FAM[family]} {layout.TABLE}: {err}")
        with self._lock:
            return dump(family, fragments, packets, self._plans.setdefault(family, {}))
