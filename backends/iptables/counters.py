"""The iptables mode's traffic counters (``--service-counters``): new connections per service port and endpoint,
read from the packet counters of kproxy's rules in the nat table.

Decisions:

- **Connections only** (``OFFERED``). A nat rule sees only the first packet of a connection: conntrack translates
  the rest without consulting the nat table, so the packet counter of a nat rule counts new connections (TCP), new
  flows (UDP) and new associations (SCTP), and the packets and bytes of a connection never reach it. Counting those
  would take a rule per service in a table every packet crosses (filter or mangle), a per-packet cost the mode does
  not otherwise pay.
- **Where**: per endpoint, the packet counter of its ``KUBE-SEP-`` chain's DNAT rule; per service port, the sum of
  its endpoints', because every connection the mode NATs takes exactly one DNAT rule (through ``KUBE-SVC-`` or
  ``KUBE-SVL-``, from the ClusterIP, an external IP, a load balancer IP or a NodePort alike). Not the jumps in
  ``KUBE-SERVICES`` / ``KUBE-NODEPORTS``: those shared chains are rewritten (their counters restarting at 0) whenever
  any service is added or removed, while a service's own chains are rewritten only when that service changes.
  Connections the mode does not NAT are not counted: those rejected or dropped for want of (local) endpoints (their
  rules are in the filter table).
- **One dump per family per scrape**: ``iptables-save -c -t nat`` through the backend's kernel helper.
  ``iptables -t nat -L -nvx`` prints the same counters but is no faster on the nf_tables flavour (both fetch and print
  every rule of the table) and prints 60 % more text, three times as long to parse (figures: docs/PERFORMANCE.md).
  Chain names are mapped back to service ports and endpoints from the ledger's applied fragments (each fragment's
  DNAT rules name their SEP chain and endpoint); that mapping is kept per fragment object and made again only for a
  fragment that changed.
- **Lifetime**: counters live in the kernel's rules. A restart keeps them: its full sync adopts the chains the kernel
  holds as wanted and writes nothing of them. A service whose own chains are written again (its endpoints changed,
  or its chains were not as wanted) starts at 0: the rewritten rules are new rules, and the backend's payloads carry
  no ``[packets:bytes]`` for its ``iptables-restore --counters`` to carry over. A service the kernel does not hold
  (its chains missing from the save) is left out of the dump; a service port without endpoints has no nat rules
  and is reported with 0 connections.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol

from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import IPFamily, ServicePortName
from kproxy.proxier import BackendError

from .kernel import Kernel, binary
from .render import Context, Fragment

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})

_DNAT_PREFIX = "-A KUBE-SEP-"
_DNAT = " -j DNAT --to-destination "
# a SEP chain's DNAT rule in ``iptables-save -c``: "[PACKETS:BYTES] -A KUBE-SEP-... -j DNAT ..."
_SAVED_DNAT = re.compile(r"^\[(\d+):\d+\] -A (KUBE-SEP-[A-Z2-7]{16}) [^\n]*-j DNAT ", re.M)


class _Source(Protocol):
    """What ``read`` needs of the proxier."""

    @property
    def kernel(self) -> Kernel: ...

    def applied(self, family: IPFamily) -> tuple[Context | None, dict[ServicePortName, Fragment]]: ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """One fragment's endpoints (as its DNAT rules write them) and their SEP chains, in the fragment's order."""

    fragment: Fragment
    chains: tuple[str, ...]
    endpoints: tuple[str, ...]
    take: Callable[[Mapping[str, int]], tuple[int, ...]]  # the chains' counts out of the save's, in one C call


def plan(fragment: Fragment) -> _Plan:
    """Which SEP chain counts which endpoint of ``fragment`` (from its DNAT rules)."""
    chains: list[str] = []
    endpoints: list[str] = []
    for rule in fragment.rules:
        if rule.startswith(_DNAT_PREFIX):
            at = rule.find(_DNAT)
            if at > 0:
                chains.append(rule[3 : rule.index(" ", 3)])
                endpoints.append(rule[at + len(_DNAT) :].split(" ", 1)[0])
    return _Plan(fragment, tuple(chains), tuple(endpoints), _taker(chains))


def _taker(chains: list[str]) -> Callable[[Mapping[str, int]], tuple[int, ...]]:
    """The chains' counts as a tuple (KeyError when one is missing)."""
    if len(chains) > 1:
        take: Callable[[Mapping[str, int]], tuple[int, ...]] = itemgetter(*chains)
        return take
    one = chains[0] if chains else None
    return lambda packets: () if one is None else (packets[one],)


def parse_save(text: str) -> dict[str, int]:
    """``iptables-save -c -t nat`` -> packets of each ``KUBE-SEP-`` chain's DNAT rule (summed, should a chain hold
    more than one)."""
    out: dict[str, int] = {}
    for m in _SAVED_DNAT.finditer(text):
        chain = m.group(2)
        out[chain] = out.get(chain, 0) + int(m.group(1))
    return out


def dump(
    family: IPFamily,
    fragments: Mapping[ServicePortName, Fragment],
    packets: Mapping[str, int],
    plans: dict[ServicePortName, _Plan],
) -> CounterDump:
    """The CounterDump of ``fragments`` from the DNAT rules' packet counters. ``plans`` (service port -> plan) is
    the last call's, updated in place: a fragment's plan is made again only when the fragment changed."""
    ports: dict[ServicePortName, PortCounters] = {}
    for spn, fragment in fragments.items():
        p = plans.get(spn)
        if p is None or p.fragment is not fragment:
            p = plans[spn] = plan(fragment)
        try:
            conns = p.take(packets)
        except KeyError:
            continue  # the kernel does not hold this service's chains (flushed by someone): not programmed
        ports[spn] = PortCounters(Counts(sum(conns)), p.endpoints, conns)
    for spn in plans.keys() - fragments.keys():
        del plans[spn]  # a service's counters go with it
    return CounterDump(family, ports)


class Reader:
    """A proxier's counter reads: one save of the nat table per call, and the plans of the fragments it mapped last
    (made again only for a fragment that changed). Calls come from the scrape's collector, one at a time."""

    def __init__(self, proxier: _Source) -> None:
        self.proxier = proxier
        self._plans: dict[IPFamily, dict[ServicePortName, _Plan]] = {}
        self._lock = threading.Lock()

    def read(self, family: IPFamily) -> CounterDump:
        """Every service port the ledger records as applied in ``family``, with its connections per endpoint, from
        one save of the nat table. BackendError when the save fails."""
        _, fragments = self.proxier.applied(family)
        kernel = self.proxier.kernel
        res = kernel.save(family, "nat", counters=True)
        if not res.ok:
            raise BackendError(f"{binary('save', family, kernel.flavour)} -c -t nat: {res.stderr.strip()}")
        packets = parse_save(res.stdout)
        with self._lock:
            return dump(family, fragments, packets, self._plans.setdefault(family, {}))
