"""The nftables mode's traffic counters (``--service-counters``): new connections per service port and endpoint,
in per-element counters of kproxy's counting sets.

Decisions:

- **Connections only** (``OFFERED``). The mode's rules are nat chains, which see only a connection's first packet
  (conntrack translates the rest without them): a counter there counts new connections (TCP), new flows (UDP) and
  new associations (SCTP). Packets and bytes would take a rule every packet crosses (a filter-hook chain), a
  per-packet cost the mode does not otherwise pay.
- **Where**: the DNAT happens in shared chains (``numgen random mod K map @backends-tcp``), one rule for every
  service with K endpoints, so no rule belongs to one endpoint. The count is taken after the DNAT instead, in two
  base chains of the source-NAT hooks (``count-postrouting``, ``count-input``, priority 90: before any source NAT,
  which would end the hook's nat chains; a connection reaches exactly one of them, once), by an element lookup of
  ``ct original ip daddr . meta l4proto . ct original proto-dst . ip daddr . th dport`` (the service address the
  client dialled and the endpoint the DNAT chose; a NodePort's by protocol and port), one rule per protocol, since
  ``ct original proto-dst`` has a type only where the transport protocol is known. A lookup that finds an element
  counts on the element's own counter. So every path to an endpoint counts the same way: shared chains, ClientIP
  affinity's own chains, firewalls, Local policy's shortcuts. Connections that are not DNATed are not counted:
  rejected or dropped ones (no (local) endpoints), and localhost NodePorts (the relay's).
- **Sharded sets**: the elements of each kind are spread over ``layout.COUNT_SHARDS`` sets (``endpoint-counters-07``,
  ``nodeport-endpoint-counters-07``) by the low bits of the service address (of the NodePort), and the base chains
  pick the shard's chain with one verdict-map lookup on the same bits of the original destination
  (``layout.counting_set`` places an element as the kernel looks it up). Why: the kernel answers a set's element
  dump in ~32 KB pieces and, for each, walks the set again from its start, skipping what it sent: a dump of one set
  of n elements costs O(n^2), of small sets O(n) (measured: docs/PERFORMANCE.md).
- **Elements, not named counter objects**: one element per (service address or NodePort, endpoint), an ordinary
  element of the service's fragment (so the ledger's diff writes only the changed endpoints' elements, a partial
  sync leaves the other endpoints' counts alone even when their slots in ``@backends`` move, a restart writes
  nothing of an unchanged service, and a service's elements go with it). Named counters were tried first: with
  100,000 counter objects in the table, libnftables 1.0.6 fetches every object before any command, and a one-element
  partial sync took seconds. An endpoint's count is the sum over the service's addresses; the service's total is
  the sum of its endpoints'.
- **One netlink element dump of each counting set per family per read**, on one socket (``setdump``), keyed by the
  elements' raw key bytes: no key is formatted. Not libnftables' ``list set``: nft 1.0.6 fetches every element of
  the table and formats each, tens of seconds at 10,000 services x 10 endpoints. Mapped back to service ports and
  endpoints through the ledger's applied fragments: per fragment object a plan (its elements' key bytes, made once)
  and the last PortCounters it gave, handed out again while the counts stay. Adoption reads the same dumps with the
  keys spelled as written (``read_counts``) when some service changed while kproxy was down, to find its old
  elements.
- **Off** (the default): nothing of this is written; the fixed part, the layout digest and every fragment are what
  they are without counters. Turning it on or off changes the layout digest: the table is replaced whole once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import Endpoint, IPFamily, ServicePort, ServicePortName, endpoint_label
from kproxy.nftkernel import Nft
from kproxy.proxier import BackendError

from . import layout, setdump
from .fragment import Fragment

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})


def _endpoints(sp: ServicePort) -> list[Endpoint]:
    """Every endpoint any address of the service may DNAT to, once each, in a stable order."""
    return list(dict.fromkeys((*sp.internal_endpoints, *sp.cluster_endpoints, *sp.local_endpoints)))


#: the counting sets (every shard of both kinds) and the kind of each
_KIND = {name: kind for kind in layout.COUNT_SHARD_CHAIN for name in layout.count_shards(kind)}
COUNTING = tuple(_KIND)


def with_counters(frag: Fragment, sp: ServicePort) -> Fragment:
    """``frag`` with a counting element per (entry, endpoint) appended after its own elements (its first stays its
    ClusterIP entry), each in its entry's shard (``layout.counting_set``); the digest covers them."""
    eps = _endpoints(sp)
    if not eps:
        return frag
    extra = [
        (shard, f"{key} . {ep.ip} . {ep.port}", "")
        for m, key, _ in frag.entries
        for shard in (layout.counting_set(m, key),)
        for ep in eps
    ]
    return frag.extended(extra)


def entry_of(setname: str, key: str) -> tuple[str, str]:
    """The (entry map, entry key) a counting element belongs to: its key without the endpoint's two fields."""
    entry = key.rsplit(" . ", 2)[0]
    return (layout.SERVICE_IPS if _KIND[setname] == layout.ENDPOINT_COUNTERS else layout.SERVICE_NODEPORTS), entry


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


# A counting element's key in the kernel: each field in 4-byte registers (an address 4 or 16 bytes, the protocol one
# byte and a port two, big-endian, each padded with zeros), the service address's fields first (a NodePort's key has
# none): 20 bytes (16 for a NodePort's) in IPv4, 44 (28) in IPv6, so the two kinds never share a key.
_PROTO_NAMES = {6: "tcp", 17: "udp", 132: "sctp"}
_PROTO_NUMBERS = {v: k for k, v in _PROTO_NAMES.items()}
_AF = {IPFamily.V4: socket.AF_INET, IPFamily.V6: socket.AF_INET6}


def entry_text(family: IPFamily, raw: bytes, address: bool = True) -> str:
    """An entry's key (``service-ips``, ``service-digests``: ``address``; ``service-nodeports``: not) from the
    kernel's bytes, spelled as ``render`` writes it: ``198.19.0.1 . tcp . 80``, ``tcp . 30080``; ``entry_bytes``'
    inverse."""
    n = 4 if family is IPFamily.V4 else 16
    at = n if address else 0
    proto = _PROTO_NAMES.get(raw[at]) or str(raw[at])
    port = int.from_bytes(raw[at + 4 : at + 6], "big")
    return f"{socket.inet_ntop(_AF[family], raw[:n])} . {proto} . {port}" if address else f"{proto} . {port}"


def key_text(setname: str, family: IPFamily, raw: bytes) -> str:
    """A counting element's key from its bytes, spelled as ``with_counters`` writes it: ``198.19.0.1 . tcp . 80 .
    198.18.1.1 . 8080`` (a NodePort's: ``tcp . 30080 . 198.18.1.1 . 8080``)."""
    n = 4 if family is IPFamily.V4 else 16
    address = _KIND.get(setname, setname) == layout.ENDPOINT_COUNTERS
    at = n + 8 if address else 8
    ep = socket.inet_ntop(_AF[family], raw[at : at + n])
    return f"{entry_text(family, raw, address)} . {ep} . {int.from_bytes(raw[at + n : at + n + 2], 'big')}"


def _port(port: str) -> bytes:
    return int(port).to_bytes(2, "big") + b"\0\0"


def entry_bytes(family: IPFamily, entry: str) -> bytes:
    """The first fields of a counting element's key, its entry's (``198.19.0.1 . tcp . 80``, ``tcp . 30080``)."""
    fields = entry.split(" . ")
    head = socket.inet_pton(_AF[family], fields.pop(0)) if len(fields) == 3 else b""
    proto, port = fields
    return head + bytes((_PROTO_NUMBERS[proto], 0, 0, 0)) + _port(port)


def key_bytes(family: IPFamily, text: str) -> bytes:
    """``key_text``'s inverse: the kernel's bytes of a counting element's key as ``with_counters`` spells it."""
    entry, ip, port = text.rsplit(" . ", 2)
    return entry_bytes(family, entry) + socket.inet_pton(_AF[family], ip) + _port(port)


def parse_dump(setname: str, family: IPFamily, chunks: Iterable[bytes]) -> tuple[dict[tuple[str, str], int], bool]:
    """``setdump.parse_raw`` with the keys spelled as ``with_counters`` writes them: ((set, key) -> packets, whether
    the dump ended)."""
    got, ended = setdump.parse_raw(setname, chunks)
    return {(setname, key_text(setname, family, k)): v for k, v in got.items()}, ended


raw_dump = setdump.raw_dump


def read_counts(nft: Nft, family: IPFamily) -> tuple[dict[tuple[str, str], int] | None, str]:
    """Every counting element of kproxy's table in ``family`` ((set, key) -> packets), in one element dump of each
    counting set over netlink (see the module docstring); (None, error) on failure. Adoption's and the tests' read;
    the scrape's is ``Reader.read``, by the keys' bytes."""

    def go() -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for setname, chunks in setdump.raw_dumps(family, COUNTING):
            got, _ = setdump.parse_raw(setname, chunks)
            out.update(((setname, key_text(setname, family, k)), v) for k, v in got.items())
        return out

    try:
        return nft.call(go), ""
    except OSError as exc:
        return None, str(exc)


def read_raw(
    nft: Nft, family: IPFamily, seconds: dict[str, float] | None = None
) -> tuple[dict[bytes, int] | None, str]:
    """Every counting element of kproxy's table in ``family`` (the key's bytes -> packets: no key is formatted), in
    one element dump of each counting set on one netlink socket; (None, error) on failure. ``seconds`` gets the
    time spent in the dumps (``dump``: the kernel and the socket) and in parsing them (``parse``)."""

    def go() -> dict[bytes, int]:
        out: dict[bytes, int] = {}
        parse = 0.0
        t0 = time.perf_counter()
        for setname, chunks in setdump.raw_dumps(family, COUNTING):
            p0 = time.perf_counter()
            out.update(setdump.parse_raw(setname, chunks)[0])
            parse += time.perf_counter() - p0
        if seconds is not None:
            seconds.update(dump=time.perf_counter() - t0 - parse, parse=parse)
        return out

    try:
        return nft.call(go), ""
    except OSError as exc:
        return None, str(exc)


@dataclass(slots=True)
class _Plan:
    """One fragment's endpoints, its counting elements' keys (bytes) and, per key, the index of its endpoint (None
    when the keys are the endpoints in order: a service with one address); ``last``: what the last read made of it,
    handed out again while its counts stay the same (most services' between two scrapes)."""

    fragment: Fragment
    endpoints: tuple[str, ...]
    keys: tuple[bytes, ...]
    index: tuple[int, ...] | None
    last: PortCounters | None = None


def _plan(family: IPFamily, fragment: Fragment) -> _Plan:
    index: dict[str, int] = {}
    keys, at = [], []
    heads: dict[str, bytes] = {}  # an entry's part of its elements' keys, made once per entry
    for m, key, _ in fragment.elements:
        if m in _KIND:
            entry, ip, port = key.rsplit(" . ", 2)
            head = heads.get(entry) or heads.setdefault(entry, entry_bytes(family, entry))
            keys.append(head + socket.inet_pton(_AF[family], ip) + _port(port))
            at.append(index.setdefault(endpoint_label(ip, int(port)), len(index)))
    simple = at == list(range(len(at)))
    return _Plan(fragment, tuple(index), tuple(keys), None if simple else tuple(at))


def dump(
    family: IPFamily,
    fragments: Mapping[ServicePortName, Fragment],
    packets: Mapping[bytes, int],
    plans: dict[int, _Plan],
) -> CounterDump:
    """The CounterDump of ``fragments`` from the counting elements' packets (by key bytes, ``read_raw``). ``plans``
    (a fragment's id -> its plan, which holds it: an id is not reused while its plan lives) is the last call's,
    updated in place. A service whose elements the kernel lacks is left out (not programmed)."""
    ports: dict[ServicePortName, PortCounters] = {}
    get = packets.__getitem__
    for spn, fragment in fragments.items():
        p = plans.get(id(fragment))
        if p is None:
            p = plans[id(fragment)] = _plan(family, fragment)
        try:
            values = tuple(map(get, p.keys))
        except KeyError:
            continue
        if p.index is not None:  # several addresses: an endpoint's count is the sum over them
            conns = [0] * len(p.endpoints)
            for i, v in zip(p.index, values, strict=True):
                conns[i] += v
            values = tuple(conns)
        last = p.last
        if last is None or last.connections != values:
            last = p.last = PortCounters(Counts(sum(values)), p.endpoints, values)
        ports[spn] = last
    if len(plans) > len(fragments):  # every fragment has its plan: more plans are those of fragments gone
        live = {id(f) for f in fragments.values()}
        for gone in plans.keys() - live:
            del plans[gone]  # a service's counters go with it
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
        self._plans: dict[IPFamily, dict[int, _Plan]] = {}
        self._lock = threading.Lock()
        #: the last read's seconds: ``dump`` (kernel and socket), ``parse``, ``map`` (to service ports)
        self.seconds: dict[str, float] = {}

    def read(self, family: IPFamily) -> CounterDump:
        """Every service port the ledger records as applied in ``family``, with its connections per endpoint.
        BackendError when the dump fails."""
        _, fragments = self.proxier.applied(family)
        seconds: dict[str, float] = {}
        packets, err = read_raw(self.proxier.nft, family, seconds)
        if packets is None:
            raise BackendError(f"{layout.FAM[family]} {layout.TABLE}: reading the counting sets: {err}")
        with self._lock:
            t0 = time.perf_counter()
            out = dump(family, fragments, packets, self._plans.setdefault(family, {}))
            self.seconds = {**seconds, "map": time.perf_counter() - t0}
            return out
