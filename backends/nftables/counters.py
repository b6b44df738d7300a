"""The nftables mode's traffic counters (``--service-counters``): new connections per service port and endpoint,
in per-element counters of two sets of kproxy's table.

Decisions:

- **Connections only** (``OFFERED``). The mode's rules are nat chains, which see only a connection's first packet
  (conntrack translates the rest without them): a counter there counts new connections (TCP), new flows (UDP) and
  new associations (SCTP). Packets and bytes would take a rule every packet crosses (a filter-hook chain), a
  per-packet cost the mode does not otherwise pay.
- **Where**: the DNAT happens in shared chains (``numgen random mod K map @backends-tcp``), one rule for every
  service with K endpoints, so no rule belongs to one endpoint. The count is taken after the DNAT instead, in two
  base chains of the source-NAT hooks (``count-postrouting``, ``count-input``, priority 90: before any source NAT,
  which would end the hook's nat chains; a connection reaches exactly one of them, once): ``meta l4proto tcp ct
  status dnat ct original ip daddr . meta l4proto . ct original proto-dst . ip daddr . th dport @endpoint-counters
  accept`` (the service address the client dialled and the endpoint the DNAT chose; a NodePort by protocol and
  port in ``@nodeport-endpoint-counters``), one rule per protocol and set, since ``ct original proto-dst`` has a
  type only where the transport protocol is known. A lookup that finds an element counts on the element's own
  counter. So every path to an endpoint counts the same way: shared chains, ClientIP affinity's own chains,
  firewalls, Local policy's shortcuts. Connections that are not DNATed are not counted: rejected or dropped ones (no
  (local) endpoints), and localhost NodePorts (the relay's).
- **Elements, not named counter objects**: one element per (service address or NodePort, endpoint), an ordinary
  element of the service's fragment (so the ledger's diff writes only the changed endpoints' elements, a partial
  sync leaves the other endpoints' counts alone even when their slots in ``@backends`` move, a restart writes
  nothing of an unchanged service, and a service's elements go with it). Named counters were tried first: with
  100,000 counter objects in the table, libnftables 1.0.6 fetches every object before any command, and a one-element
  partial sync took seconds. An endpoint's count is the sum over the service's addresses; the service's total is
  the sum of its endpoints'.
- **One netlink element dump of the two sets per family per read**, parsed here (keys from their raw bytes). Not
  libnftables' ``list set``: nft 1.0.6 fetches every element of the table and formats each, tens of seconds at
  10,000 services x 10 endpoints. Mapped back to service ports and endpoints through the ledger's applied
  fragments (their counting elements, whose keys end in the endpoint); that mapping is kept per fragment object.
  Adoption reads the same dump when some service changed while kproxy was down, to find its old elements.
- **Off** (the default): nothing of this is written; the fixed part, the layout digest and every fragment are what
  they are without counters. Turning it on or off changes the layout digest: the table is replaced whole once.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import Endpoint, IPFamily, ServicePort, ServicePortName, endpoint_label
from kproxy.nftkernel import Nft
from kproxy.proxier import BackendError

from . import layout
from .render import Fragment, _digest

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})


def _endpoints(sp: ServicePort) -> list[Endpoint]:
    """Every endpoint any address of the service may DNAT to, once each, in a stable order."""
    return list(dict.fromkeys((*sp.internal_endpoints, *sp.cluster_endpoints, *sp.local_endpoints)))


COUNTING = (layout.ENDPOINT_COUNTERS, layout.NODEPORT_ENDPOINT_COUNTERS)
_SET_OF = {layout.SERVICE_IPS: layout.ENDPOINT_COUNTERS, layout.SERVICE_NODEPORTS: layout.NODEPORT_ENDPOINT_COUNTERS}


def with_counters(frag: Fragment, sp: ServicePort) -> Fragment:
    """``frag`` with a counting element per (entry, endpoint) appended after its own elements (its first stays its
    ClusterIP entry); the digest covers them."""
    eps = _endpoints(sp)
    if not eps:
        return frag
    extra = [(_SET_OF[m], f"{key} . {ep.ip} . {ep.port}", "") for m, key, _ in frag.entries for ep in eps]
    elements = (*frag.elements, *extra)
    return replace(
        frag, elements=elements, digest=_digest(elements, (frag.shared, frag.chains, frag.sets, frag.hairpin))
    )


def entry_of(setname: str, key: str) -> tuple[str, str]:
    """The (entry map, entry key) a counting element belongs to: its key without the endpoint's two fields."""
    entry = key.rsplit(" . ", 2)[0]
    return (layout.SERVICE_IPS if setname == layout.ENDPOINT_COUNTERS else layout.SERVICE_NODEPORTS), entry


def by_entry(counts: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Counting elements ((set, key) as ``read_counts`` gives them) grouped by their entry."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for setname, key in counts:
        out.setdefault(entry_of(setname, key), []).append((setname, key))
    return out


def skeleton(
    entries: Iterable[tuple[str, str]], held: Mapping[tuple[str, str], list[tuple[str, str]]]
) -> dict[tuple[str, str], str | None]:
    """The counting elements the kernel holds for a service adopted with ``entries`` ((map, key) pairs)."""
    return {mk: "" for entry in entries for mk in held.get(entry, ())}


# netlink: nfnetlink's nftables subsystem, its set-element messages and attributes (linux/netfilter/nf_tables.h)
_SUBSYS = 10 << 8  # NFNL_SUBSYS_NFTABLES
_GETSETELEM, _NEWSETELEM = 13, 12
_DUMP = 0x1 | 0x300  # NLM_F_REQUEST | NLM_F_DUMP
_DUMP_INTR = 0x10  # NLM_F_DUMP_INTR: the set changed during the dump
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_LIST_TABLE, _LIST_SET, _LIST_ELEMENTS = 1, 2, 3  # NFTA_SET_ELEM_LIST_*
_ELEM_KEY, _ELEM_EXPR, _ELEM_EXPRESSIONS = 1, 7, 11  # NFTA_SET_ELEM_*
_DATA_VALUE, _EXPR_NAME, _EXPR_DATA, _COUNTER_PACKETS = 1, 1, 2, 2
_NETLINK_NETFILTER = 12
_PROTO_NAMES = {6: "tcp", 17: "udp", 132: "sctp"}


def _attrs(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """Netlink attributes in ``data[start:end]``: (type without the nested flag, payload start, payload end)."""
    out = []
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, start)
        if length < 4:
            break
        out.append((kind & 0x3FFF, start + 4, start + length))
        start += (length + 3) & ~3
    return out


def _nla(payload: bytes) -> bytes:
    return payload + b"\0" * (-len(payload) % 4)


def _request(family: IPFamily, setname: str, seq: int) -> bytes:
    table, name = layout.TABLE.encode() + b"\0", setname.encode() + b"\0"
    attrs = struct.pack("=HH", 4 + len(table), _LIST_TABLE) + _nla(table)
    attrs += struct.pack("=HH", 4 + len(name), _LIST_SET) + _nla(name)
    nfgen = struct.pack("=BBH", socket.AF_INET if family is IPFamily.V4 else socket.AF_INET6, 0, 0)
    header = struct.pack("=IHHII", 16 + len(nfgen) + len(attrs), _SUBSYS | _GETSETELEM, _DUMP, seq, 0)
    return header + nfgen + attrs


def key_text(setname: str, family: IPFamily, raw: bytes) -> str:
    """A counting element's key from its bytes (each field in 4-byte registers), spelled as ``with_counters``
    writes it: ``198.19.0.1 . tcp . 80 . 198.18.1.1 . 8080`` (a NodePort's: ``tcp . 30080 . 198.18.1.1 . 8080``)."""
    af, n = (socket.AF_INET, 4) if family is IPFamily.V4 else (socket.AF_INET6, 16)
    at, parts = 0, []
    if setname == layout.ENDPOINT_COUNTERS:
        parts.append(socket.inet_ntop(af, raw[:n]))
        at = n
    parts.append(_PROTO_NAMES.get(raw[at], str(raw[at])))
    parts.append(str(int.from_bytes(raw[at + 4 : at + 6], "big")))
    parts.append(socket.inet_ntop(af, raw[at + 8 : at + 8 + n]))
    parts.append(str(int.from_bytes(raw[at + 8 + n : at + 10 + n], "big")))
    return " . ".join(parts)


def _packets(data: bytes, start: int, end: int) -> int | None:
    """The packets of a counter expression (NFTA_EXPR_NAME "counter", NFTA_EXPR_DATA)."""
    attrs = _attrs(data, start, end)
    if not any(k == _EXPR_NAME and data[a:b].rstrip(b"\0") == b"counter" for k, a, b in attrs):
        return None
    for k, a, b in attrs:
        if k == _EXPR_DATA:
            for k2, a2, _ in _attrs(data, a, b):
                if k2 == _COUNTER_PACKETS:
                    return int(struct.unpack_from(">Q", data, a2)[0])
    return None


def _element(data: bytes, start: int, end: int) -> tuple[bytes, int] | None:
    """(key bytes, packets) of one NFTA_LIST_ELEM."""
    key, packets = None, None
    for kind, a, b in _attrs(data, start, end):
        if kind == _ELEM_KEY:
            key = next((data[a2:b2] for k2, a2, b2 in _attrs(data, a, b) if k2 == _DATA_VALUE), None)
        elif kind == _ELEM_EXPR:
            packets = _packets(data, a, b)
        elif kind == _ELEM_EXPRESSIONS:  # more than one expression: a list of them
            packets = next((p for _, a2, b2 in _attrs(data, a, b) if (p := _packets(data, a2, b2)) is not None), None)
    return None if key is None or packets is None else (key, packets)


def parse_dump(setname: str, family: IPFamily, chunks: Iterable[bytes]) -> tuple[dict[tuple[str, str], int], bool]:
    """A netlink element dump of a counting set (the datagrams it was read in) -> (packets per (set, key), whether
    the dump ended). InterruptedError when the set changed during the dump, OSError for an error message."""
    out: dict[tuple[str, str], int] = {}
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
                    raise OSError(-code, f"netlink element dump of {setname}: {os.strerror(-code)}")
            elif flags & _DUMP_INTR:
                raise InterruptedError(f"{setname} changed during the dump")
            elif kind == _SUBSYS | _NEWSETELEM:
                for k, a, b in _attrs(data, at + 20, at + length):
                    if k == _LIST_ELEMENTS:
                        for _, a2, b2 in _attrs(data, a, b):
                            got = _element(data, a2, b2)
                            if got is not None:
                                out[(setname, key_text(setname, family, got[0]))] = got[1]
            at += (length + 3) & ~3
    return out, False


def _ended(data: bytes, setname: str, family: IPFamily) -> bool:
    """Whether a datagram of a dump holds its end (headers only; errors raised as ``parse_dump`` raises them)."""
    at = 0
    while at + 16 <= len(data):
        length, kind, flags = struct.unpack_from("=IHH", data, at)
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            parse_dump(setname, family, [data[at : at + length]])
        elif flags & _DUMP_INTR:
            raise InterruptedError(f"{setname} changed during the dump")
        at += max(16, (length + 3) & ~3)
    return False


def raw_dump(family: IPFamily, setname: str) -> list[bytes]:
    """The datagrams of one element dump of a counting set, in the calling thread's namespace (taken again, up to
    twice, when the set changed during it)."""
    for attempt in range(3):
        chunks: list[bytes] = []
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sock:
            sock.settimeout(30)
            sock.bind((0, 0))
            sock.send(_request(family, setname, attempt + 1))
            try:
                while True:
                    chunks.append(sock.recv(1 << 20))
                    if _ended(chunks[-1], setname, family):
                        return chunks
            except InterruptedError:
                continue
    raise OSError(errno.EAGAIN, f"netlink element dump of {setname}: the set kept changing")


def read_counts(nft: Nft, family: IPFamily) -> tuple[dict[tuple[str, str], int] | None, str]:
    """Every counting element of kproxy's table in ``family`` ((set, key) -> packets), in one element dump of each
    counting set over netlink (see the module docstring); (None, error) on failure."""

    def go() -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for setname in COUNTING:
            got, _ = parse_dump(setname, family, raw_dump(family, setname))
            out.update(got)
        return out

    try:
        return nft.call(go), ""
    except OSError as exc:
        return None, str(exc)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One fragment's endpoints and, per counting element, the index of its endpoint."""

    fragment: Fragment
    endpoints: tuple[str, ...]
    keys: tuple[tuple[tuple[str, str], int], ...]


def _plan(fragment: Fragment) -> _Plan:
    index: dict[str, int] = {}
    keys = []
    for m, key, _ in fragment.elements:
        if m in COUNTING:
            _, ip, port = key.rsplit(" . ", 2)
            ep = endpoint_label(ip, int(port))
            keys.append(((m, key), index.setdefault(ep, len(index))))
    return _Plan(fragment, tuple(index), tuple(keys))


def dump(
    family: IPFamily,
    fragments: Mapping[ServicePortName, Fragment],
    packets: Mapping[tuple[str, str], int],
    plans: dict[ServicePortName, _Plan],
) -> CounterDump:
    """The CounterDump of ``fragments`` from the counting elements' packets. ``plans`` (service port -> plan) is the
    last call's, updated in place. A service whose elements the kernel lacks is left out (not programmed)."""
    ports: dict[ServicePortName, PortCounters] = {}
    for spn, fragment in fragments.items():
        p = plans.get(spn)
        if p is None or p.fragment is not fragment:
            p = plans[spn] = _plan(fragment)
        conns = [0] * len(p.endpoints)
        try:
            for mk, i in p.keys:
                conns[i] += packets[mk]
        except KeyError:
            continue
        ports[spn] = PortCounters(Counts(sum(conns)), p.endpoints, tuple(conns))
    for spn in plans.keys() - fragments.keys():
        del plans[spn]  # a service's counters go with it
    return CounterDump(family, ports)


class _Source(Protocol):
    @property
    def nft(self) -> Nft: ...

    def applied(self, family: IPFamily) -> tuple[Any, dict[ServicePortName, Fragment]]: ...


class Reader:
    """A proxier's counter reads: one element dump of the counting sets per call, and the plans of the fragments it
    mapped last. Calls come from the scrape's collector, one at a time."""

    def __init__(self, proxier: _Source) -> None:
        self.proxier = proxier
        self._plans: dict[IPFamily, dict[ServicePortName, _Plan]] = {}
        self._lock = threading.Lock()

    def read(self, family: IPFamily) -> CounterDump:
        """Every service port the ledger records as applied in ``family``, with its connections per endpoint.
        BackendError when the dump fails."""
        _, fragments = self.proxier.applied(family)
        packets, err = read_counts(self.proxier.nft, family)
        if packets is None:
            raise BackendError(f"{layout.FAM[family]} {layout.TABLE}: reading the counting sets: {err}")
        with self._lock:
            return dump(family, fragments, packets, self._plans.setdefault(family, {}))
