"""Per-service traffic counters (``--service-counters``): the one value every mode hands over, and its metrics.

Decisions:

- A mode reads its counters from the kernel in **one dump per family** (nftables counters in one listing,
  ``iptables-save -c``, one BPF map iteration, the userspace relay's own tallies) and returns a ``CounterDump``:
  per service port, the service's own counts and each endpoint's. Nothing walks 10,000 services in Python beyond
  turning that dump into exposition lines.
- What is counted: **connections** (new TCP connections, new UDP flows, new SCTP associations), which every mode
  counts, and **packets** and **bytes** where the mode counts them without a per-packet cost it would not otherwise
  pay. A mode declares which (``Proxier.counters_offered``); a measure it does not offer is ``None`` in ``Counts``,
  never 0, and its metric family is absent, so ``kproxy top`` and the docs say "n/a" rather than a false zero.
- One family of metrics whatever the mode: ``kproxy_service_{connections,packets,bytes}_total{namespace, service,
  port, protocol, family}`` and ``kproxy_endpoint_..._total{..., endpoint}``, plus
  ``kproxy_service_counters_offered{measure}`` (1 or 0), so a reader knows what the mode offers. ``port`` is the
  port's name (empty for an unnamed port), as in ``ns/name[:port]/PROTO``; ``endpoint`` is ``ip:port`` (``[ip]:port``
  for IPv6).
- The collector renders its own exposition text: prometheus-client's formatter costs tens of microseconds per
  sample, seconds for 100,000 endpoint series, so ``kproxy.metrics`` appends this text to the registry's and the
  collector's ``collect()`` (for any other reader of the registry) parses that same text: one renderer. The budget
  (a scrape at 10,000 services x 10 endpoints) is measured in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import ProxyConfig
from kproxy.metrics import Registry
from kproxy.model import IPFamily, ServicePortName


class Measure(str, enum.Enum):
    """What a mode can count per service port and endpoint."""

    CONNECTIONS = "connections"  # new TCP connections, new UDP flows, new SCTP associations
    PACKETS = "packets"
    BYTES = "bytes"


ALL_MEASURES: frozenset[Measure] = frozenset(Measure)


@dataclass(frozen=True, slots=True)
class Counts:
    """Counters of one service port or one endpoint since the kernel object holding them was made. ``packets`` and
    ``bytes`` are None where the mode cannot count them (never 0 for "unknown")."""

    connections: int
    packets: int | None = None
    bytes: int | None = None

    def get(self, measure: Measure) -> int | None:
        if measure is Measure.CONNECTIONS:
            return self.connections
        return self.packets if measure is Measure.PACKETS else self.bytes


def _sum(column: tuple[int, ...] | None) -> int | None:
    return None if column is None else sum(column)


@dataclass(frozen=True, slots=True)
class PortCounters:
    """One service port's counters in one family. ``total``: what the kernel counted for the service itself (it may
    exceed the endpoints' sum: connections rejected for want of endpoints). Per endpoint, by columns in
    ``endpoints`` order (``ip:port``, ``[ip]:port`` for IPv6): ``connections``, and ``packets`` / ``bytes`` (None:
    not counted). Columns, not one object per endpoint: a dump of 100,000 endpoints stays a few MB and a scrape
    formats a port's endpoints in one call."""

    total: Counts
    endpoints: tuple[str, ...] = ()
    connections: tuple[int, ...] = ()
    packets: tuple[int, ...] | None = None
    bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.endpoints)
        p, b = self.packets, self.bytes
        if len(self.connections) == n and (p is None or len(p) == n) and (b is None or len(b) == n):
            return  # the common case, without walking Measure: a read makes one per service port
        for measure in Measure:
            column = self.column(measure)
            if column is not None and len(column) != n:
                raise ValueError(f"PortCounters: {len(column)} {measure.value} values for {n} endpoints")

    @classmethod
    def of(cls, endpoints: Mapping[str, Counts], total: Counts | None = None) -> PortCounters:
        """From per-endpoint counts; ``total`` defaults to their sum (a mode that counts per endpoint only). A
        measure is a column only when every endpoint has it."""
        eps = tuple(endpoints)
        values = tuple(endpoints.values())
        conns = tuple(c.connections for c in values)
        packets = None if any(c.packets is None for c in values) else tuple(c.packets or 0 for c in values)
        bytes_ = None if any(c.bytes is None for c in values) else tuple(c.bytes or 0 for c in values)
        if total is None:
            total = Counts(sum(conns), _sum(packets), _sum(bytes_))
        return cls(total, eps, conns, packets, bytes_)

    def column(self, measure: Measure) -> tuple[int, ...] | None:
        if measure is Measure.CONNECTIONS:
            return self.connections
        return self.packets if measure is Measure.PACKETS else self.bytes

    def per_endpoint(self) -> dict[str, Counts]:
        p, b = self.packets, self.bytes
        return {
            ep: Counts(self.connections[i], None if p is None else p[i], None if b is None else b[i])
            for i, ep in enumerate(self.endpoints)
        }


@dataclass(frozen=True, slots=True)
class CounterDump:
    """Every service port's counters in one family, read from the kernel in one go. A service the mode no longer
    programs is absent (its counters go with it)."""

    family: IPFamily
    ports: Mapping[ServicePortName, PortCounters]


class CounterSource(Protocol):
    """What the collector needs of a backend (``kproxy.proxier.Proxier`` has both)."""

    @property
    def counters_offered(self) -> frozenset[Measure]: ...

    def counters(self, family: IPFamily) -> CounterDump | None: ...


# ------------------------------------------------------------------------------------------------- exposition

LABELS = ("namespace", "service", "port", "protocol", "family")
ENDPOINT_LABEL = "endpoint"
OFFERED = "kproxy_service_counters_offered"
_HELP = {
    Measure.CONNECTIONS: "New connections (TCP), new flows (UDP) and new associations (SCTP)",
    Measure.PACKETS: "Packets",
    Measure.BYTES: "Bytes",
}
_NEEDS_ESCAPE = re.compile(r'[\\"\n]')


#: What the endpoint families carry: connections only. Packets and bytes are per service port: per endpoint they
#: would triple a scrape at 10,000 services x 10 endpoints (46 MB of text against 15 MB, over the scrape budget in
#: docs/BEHAVIOUR.md), and which endpoint takes a service's traffic is its share of new connections.
ENDPOINT_MEASURES = frozenset({Measure.CONNECTIONS})


#: the scrape budget (docs/BEHAVIOUR.md): a counter text whose last making (the read and its formatting) took this
#: long or more is made in the background, the last one served meanwhile
SCRAPE_BUDGET_S = 0.2


def metric_name(measure: Measure, endpoint: bool = False) -> str:
    """The exposed name: ``kproxy_service_connections_total``, ``kproxy_endpoint_bytes_total``, ..."""
    return f"kproxy_{'endpoint' if endpoint else 'service'}_{measure.value}_total"


def _esc(value: str) -> str:
    if _NEEDS_ESCAPE.search(value) is None:
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _offered_text(offered: frozenset[Measure]) -> str:
    lines = [
        f"# HELP {OFFERED} Whether this mode counts the measure per service port and endpoint (--service-counters)\n",
        f"# TYPE {OFFERED} gauge\n",
    ]
    lines += [f'{OFFERED}{{measure="{m.value}"}} {int(m in offered)}\n' for m in Measure]
    return "".join(lines)


#: one service port's format strings: its endpoints, its service line's and its endpoint lines' (the metric name
#: is argument 0, the values follow), so a text formats one port's endpoints in one C call
_Format = tuple[tuple[str, ...], str, str]


@dataclass(slots=True)
class _Port:
    """Where the last text holds one service port: the ``PortCounters`` it formatted, and per piece of that text
    (a service family and an endpoint family per measure) the start and end of the port's lines. A read that hands
    back the same ``PortCounters`` object (the nftables mode does for a port whose counts did not change) has its
    bytes copied from there, unformatted; nothing of a port's text is kept twice."""

    pc: PortCounters
    spans: tuple[int, ...]


_Ports = dict[tuple[IPFamily, ServicePortName], _Port]


def _formats(family: IPFamily, spn: ServicePortName, endpoints: tuple[str, ...]) -> _Format:
    labels = (
        (
            f'namespace="{_esc(spn.namespace)}",service="{_esc(spn.name)}",port="{_esc(spn.port)}",'
            f'protocol="{spn.protocol.value}",family="{family.value}"'
        )
        .replace("{", "{{")
        .replace("}", "}}")
    )
    service = "{0}{{" + labels + "}} {1}\n"
    lines = [
        "{0}{{" + labels + ',endpoint="' + _esc(ep).replace("{", "{{").replace("}", "}}") + '"}} {' + str(i + 1) + "}\n"
        for i, ep in enumerate(endpoints)
    ]
    return endpoints, service, "".join(lines)


def _head(measure: Measure, endpoint: bool) -> str:
    name = metric_name(measure, endpoint)
    what = "endpoint of a service port" if endpoint else "service port"
    return f"# HELP {name} {_HELP[measure]} per {what}, as the kernel counted them\n# TYPE {name} counter\n"


def _lines(
    pc: PortCounters, fmt: _Format, measures: Sequence[Measure], names: Sequence[tuple[str, str]]
) -> list[bytes]:
    """One port's encoded lines, a piece each: per measure its service line and its endpoint lines (empty where it
    has no value)."""
    _, service_fmt, endpoint_fmt = fmt
    out = []
    for measure, (service_name, endpoint_name) in zip(measures, names, strict=True):
        total = pc.total.get(measure)
        column = pc.column(measure) if measure in ENDPOINT_MEASURES else None
        out.append(service_fmt.format(service_name, total).encode() if total is not None else b"")
        out.append(endpoint_fmt.format(endpoint_name, *column).encode() if column else b"")
    return out


def _families(
    dumps: Sequence[CounterDump],
    measures: Sequence[Measure],
    old: _Ports,
    old_pieces: Sequence[bytearray],
    new: _Ports,
) -> list[bytearray]:
    """Per measure, the service family's and the endpoint family's text (the pieces), in one walk over the dumps:
    the hot loop of a text. A port whose counters are the object the last text formatted is copied from
    ``old_pieces`` (that text's, ``old`` says where); any other is formatted. Byte arrays, grown in place."""
    names = [(metric_name(m), metric_name(m, endpoint=True)) for m in measures]
    pieces = [
        bytearray(text.encode())
        for m in measures
        for text in (_head(m, False), _head(m, True) if m in ENDPOINT_MEASURES else "")
    ]
    views = [memoryview(p) for p in old_pieces] if len(old_pieces) == len(pieces) else None
    for dump in dumps:
        family = dump.family
        for spn, pc in dump.ports.items():
            key = (family, spn)
            port = old.get(key)
            spans: list[int] = []
            if port is not None and port.pc is pc and views is not None:
                at = port.spans
                for i, piece in enumerate(pieces):
                    spans.append(len(piece))
                    piece += views[i][at[2 * i] : at[2 * i + 1]]
                    spans.append(len(piece))
            else:
                lines = _lines(pc, _formats(family, spn, pc.endpoints), measures, names)
                for piece, line in zip(pieces, lines, strict=True):
                    spans.append(len(piece))
                    piece += line
                    spans.append(len(piece))
            new[key] = _Port(pc, tuple(spans))
    for v in views or ():
        v.release()
    return pieces


class CounterCollector:
    """A prometheus-client collector over a backend's dumps, one per family per scrape. ``exposition()`` is what
    ``/metrics`` serves; ``collect()`` parses that same text for any other reader of the registry.

    A scrape's counter text is the backend's read plus its formatting. When the last one took less than
    ``SCRAPE_BUDGET_S`` the scrape makes its own; otherwise it serves the text the last one made and starts the
    next in the background (one at a time), so a scrape never waits for the kernel or the formatting at scale (the
    iptables mode's read is a save of the nat table: seconds at 10,000 services) and serves counters one scrape
    old."""

    def __init__(self, source: CounterSource, families: Iterable[IPFamily]) -> None:
        self.source = source
        self.families = tuple(families)
        self._ports: _Ports = {}  # where the last text holds each port: a removed service's entry goes with the next
        self._pieces: list[bytearray] = []  # the last text's pieces (what ``_ports`` points into)
        self._lock = threading.Lock()  # the fields below
        self._build = threading.Lock()  # one text made at a time
        self._text: list[bytes | bytearray] | None = None  # the last text made, served while the next is made
        self._took = 0.0  # how long the last text took to make
        self._making: threading.Thread | None = None

    def dumps(self) -> list[CounterDump]:
        """A fresh read of every family (the backend's dumps)."""
        out = []
        for family in self.families:
            dump = self.source.counters(family)
            if dump is not None:
                out.append(dump)
        return out

    def _make(self) -> list[bytes | bytearray]:
        """Read and format: the offered gauge, then per offered measure the service and the endpoint family."""
        with self._build:
            t0 = time.monotonic()
            try:
                offered = frozenset(self.source.counters_offered)
                new: _Ports = {}
                parts = _families(self.dumps(), [m for m in Measure if m in offered], self._ports, self._pieces, new)
                self._ports, self._pieces = new, parts
                text: list[bytes | bytearray] = [_offered_text(offered).encode(), *(p for p in parts if p)]
                with self._lock:
                    self._text = text
                return text
            finally:
                with self._lock:
                    self._took, self._making = time.monotonic() - t0, None

    def write(self, out: list[bytes | bytearray]) -> None:
        """Append the counter families' text (Prometheus text format 0.0.4) to ``out``, a piece per family. A
        measure not offered has no family at all."""
        with self._lock:
            slow, text = self._took >= SCRAPE_BUDGET_S, self._text
            if slow and text is not None and self._making is None:
                self._making = threading.Thread(target=self._make, name="kproxy-counters", daemon=True)
                self._making.start()
        if not slow or text is None:
            text = self._make()
        out.extend(text)

    def exposition(self) -> bytes:
        out: list[bytes | bytearray] = []
        self.write(out)
        return b"".join(out)

    @property
    def made_s(self) -> float:
        """How long the last text took to make (the read and its formatting)."""
        with self._lock:
            return self._took

    def settle(self, timeout: float = 60.0) -> None:
        """Wait for a text being made in the background (benchmarks, tests)."""
        with self._lock:
            making = self._making
        if making is not None:
            making.join(timeout)

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: a scrape's worth of work for nothing

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self.exposition().decode())


def register(registry: object, proxier: CounterSource, config: ProxyConfig) -> CounterCollector | None:
    """Put the counter families on the daemon's registry when ``config.service_counters`` is on (None otherwise).
    On kproxy's own registry (``kproxy.metrics.Registry``) ``/metrics`` takes the collector's own text; on any other
    prometheus-client registry it is an ordinary collector."""
    if not config.service_counters:
        return None
    collector = CounterCollector(proxier, config.ip_families)
    if isinstance(registry, Registry):
        registry.register_text(collector)
    else:
        registry.register(collector)  # type: ignore[attr-defined]
    return collector


# ------------------------------------------------------------------------------------------------- reading it back
# What any Prometheus reads, parsed with prometheus-client's own text parser: ``kproxy top``, the conformance scenario
# ``counters`` and ``kproxy compare``'s fairness column read a node's counters this way, so each sees what a scrape
# serves and nothing of a mode's own.


@dataclass
class ServiceSample:
    """One service port's counters in one family at one scrape: measure -> value, and per endpoint."""

    total: dict[str, float] = field(default_factory=dict)
    endpoints: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Scrape:
    """What one ``/metrics`` answer says about the counters. ``offered`` is None when counters are off there."""

    at: float
    offered: frozenset[Measure] | None
    services: dict[str, ServiceSample]


def service_key(namespace: str, name: str, port: str, protocol: str, family: str) -> str:
    """``ns/name[:port]/PROTO IPv4``: the ``describe()`` key plus the family."""
    base = f"{namespace}/{name}" + (f":{port}" if port else "")
    return f"{base}/{protocol} {family}"


def parse(text: str, at: float) -> Scrape:
    """The counter samples of an exposition text."""
    names = {metric_name(m, e): (m, e) for m in Measure for e in (False, True)}
    offered: set[Measure] | None = None
    services: dict[str, ServiceSample] = {}
    for family in text_string_to_metric_families(text):
        if family.name == OFFERED:
            offered = {Measure(s.labels["measure"]) for s in family.samples if s.value and _measure(s.labels)}
            continue
        for sample in family.samples:
            which = names.get(sample.name)
            if which is None:
                continue
            measure, endpoint = which
            key = service_key(*(sample.labels.get(label, "") for label in LABELS))
            entry = services.setdefault(key, ServiceSample())
            if endpoint:
                entry.endpoints.setdefault(sample.labels.get(ENDPOINT_LABEL, ""), {})[measure.value] = sample.value
            else:
                entry.total[measure.value] = sample.value
    return Scrape(at, None if offered is None else frozenset(offered), services)


def _measure(labels: dict[str, str]) -> bool:
    return labels.get("measure") in {m.value for m in Measure}
