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
- **One dump per family per scrape**: ``iptables -t nat -L -nvx`` through the backend's kernel helper (it prints the
  same counters as ``iptables-save -c -t nat`` and takes about half the time at 10,000 services x 10 endpoints on the
  nf_tables flavour, see docs/PERFORMANCE.md). Chain names are mapped back to service ports and endpoints from the
  ledger's applied fragments (each fragment's DNAT rules name their SEP chain and endpoint); that mapping is kept per
  fragment object and made again only for a fragment that changed.
- **Lifetime**: counters live in the kernel's rules. A restart that adopts the kernel's chains (it writes nothing for
  an unchanged service) keeps them; a service whose chains are written again (its endpoints changed, a full rewrite)
  starts at 0, because the backend's ``iptables-restore --counters`` payloads carry no ``[packets:bytes]`` and so
  set 0. A service the kernel does not hold (its chains are missing from the dump) is left out of the dump.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
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
# ``iptables -L -nvx``: a chain's header, and a rule's row "PACKETS BYTES TARGET ..."
_CHAIN = re.compile(r"^Chain (KUBE-SEP-[A-Z2-7]{16}) |^ *(\d+) +\d+ +DNAT ", re.M)


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
    return _Plan(fragment, tuple(chains), tuple(endpoints))


def parse_listing(text: str) -> dict[str, int]:
    """``iptables -t nat -L -nvx`` -> packets of each ``KUBE-SEP-`` chain's DNAT rule (summed, should a chain hold
    more than one)."""
    out: dict[str, int] = {}
    chain: str | None = None
    for m in _CHAIN.finditer(text):
        name, packets = m.group(1), m.group(2)
        if name is not None:
            chain = name
            out.setdefault(name, 0)
        elif chain is not None:
            out[chain] += int(packets)
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
            conns = tuple([packets[c] for c in p.chains])
        except KeyError:
            continue  # the kernel does not hold this service's chains (flushed by someone): not programmed
        ports[spn] = PortCounters(Counts(sum(conns)), p.endpoints, conns)
    for spn in plans.keys() - fragments.keys():
        del plans[spn]  # a service's counters go with it
    return CounterDump(family, ports)


_plans: weakref.WeakKeyDictionary[object, dict[IPFamily, dict[ServicePortName, _Plan]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def read(proxier: _Source, family: IPFamily) -> CounterDump:
    """Every service port the ledger records as applied in ``family``, with its connections per endpoint, from one
    listing of the nat table. BackendError when the listing fails."""
    _, fragments = proxier.applied(family)
    kernel = proxier.kernel
    res = kernel.run([binary("", family, kernel.flavour), *kernel.wait(family), "-t", "nat", "-L", "-nvx"])
    if not res.ok:
        raise BackendError(f"{binary('', family, kernel.flavour)} -t nat -L -nvx: {res.stderr.strip()}")
    packets = parse_listing(res.stdout)
    with _lock:
        plans = _plans.setdefault(proxier, {}).setdefault(family, {})
        return dump(family, fragments, packets, plans)
