"""The bpf mode's traffic counters (``--service-counters``): new connections and flows per service port and endpoint,
counted by the socket programs at the backend pick and read in one map dump per family.

Decisions:

- **Connections only** (``OFFERED``). The programs run at connect() and sendmsg(), once per connection (TCP, SCTP)
  or per datagram of an unconnected UDP socket: they pick a backend and rewrite an address, and never see the
  packets or bytes that follow on the connected socket. Counting those would take another program on every packet
  (a cgroup skb program, or a tc program) that the mode does not otherwise run (a per-packet cost it does not pay,
  and a socket-to-service lookup per packet to attribute it), so the mode offers connections only.
- **What is counted, where**: an array ``cnt4``/``cnt6`` (``maps.COUNTER_ROLE``) indexed by the backend id, like the
  backend array: ids are per service port (a backend of two services has two ids), so an id names one (service
  port, endpoint). The programs add one (atomically) per translating pick: every TCP/SCTP connect, and for UDP a
  translation that (re)writes the socket's reverse-NAT entry (a new socket, backend or frontend: one per flow, not
  per datagram; a flow whose entry the reverse-NAT LRU pushed out counts again). kproxy zeroes a backend's counter
  with the backend, before any slot names it, and again when it goes (``plan.Plan.counting``): a reused id starts
  at 0 and a deleted service's counters go with its backends.
- **Why not a per-CPU map** (figures: docs/PERFORMANCE.md): a per-CPU hash costs kproxy, not the programs: every
  counter kproxy writes or deletes from userspace is a per-CPU allocation or free (the first sync at 10,000 x 10
  took seconds longer), and a read copies every CPU's slot of every entry (over the scrape budget at scale, growing
  with the CPUs); a per-CPU array preallocates ``--bpf-map-size`` x CPUs x 8 bytes (1 GB at the default on 128 CPUs).
  The array costs 8 bytes per entry (8 MB per family at the default size, only with the switch), its writes are
  copies and a read is one batch as far as the highest id in use. The price is one atomic add on a cache line the
  CPUs share per 8 backend ids: nothing beside a connect() until many CPUs connect to the same service at once.
- **What is not counted**: connections refused or dropped for want of endpoints (no backend is picked: the service
  total is its endpoints' sum); sockets outside the cgroup; and the companion nftables table's traffic (external
  clients to NodePorts, externalIPs and load-balancer IPs, DNATed by nft rules, not by the programs).
- **Off by default, and then absent**: the counter maps exist only in a program compiled with ``KP_PIN_CNT4/6``
  (``loader.compile_programs`` with ``Places.counters``); without the switch the programs are today's, no counter
  map is made, and a start unpins the ones an earlier kproxy left (``kernel.OpenMaps``): switched on again, counting
  starts from zero.
- **One dump per read**: one ``BPF_MAP_LOOKUP_BATCH`` of the array up to the highest id in use, mapped back to service
  ports and endpoints through ``Names``, which the runner thread keeps from kproxy's index as it applies batches (a
  whole rebuild on full batches, the changed services on partial ones) and a read copies under a lock.
- **Lifetime**: the counter maps are pinned, so counts survive a restart (adoption writes nothing when nothing
  changed).
"""

from __future__ import annotations

import array
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kproxy.batch import Batch
from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import IPFamily, ServicePortName, endpoint_label
from kproxy.proxier import BackendError

from . import loader, maps
from .index import FamilyIndex, FrontState

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})

#: one service port's backend ids and their endpoints (``ip:port``, ``[ip]:port``), in slot order
Ids = tuple[tuple[int, ...], tuple[str, ...]]


def all_ids(index: FamilyIndex, names: Iterable[ServicePortName] | None = None) -> dict[ServicePortName, Ids]:
    """Each service port's backend ids and endpoints as ``index`` holds them (the slots of every frontend it owns, in
    slot order); only ``names`` when given. One pass over the frontends."""
    found: dict[ServicePortName, dict[int, tuple[str, int, int] | None]] = {}
    backends = index.backends
    fronts: Iterable[FrontState]
    if names is None:
        fronts = index.fronts.values()
    else:
        fronts = [index.fronts[k] for n in names for k in index.owned.get(n, ()) if k in index.fronts]
    for st in fronts:
        owner = st.owner
        if owner is None:
            continue
        mine = found.get(owner)
        if mine is None:
            mine = found[owner] = {}
        slots = st.slots[: st.master.count]
        mine.update(zip(slots, map(backends.get, slots), strict=True))  # frontends of one service share its backend ids
    out: dict[ServicePortName, Ids] = {}
    for name, held in found.items():
        pairs = [(bid, be) for bid, be in held.items() if be is not None]
        out[name] = (tuple([bid for bid, _ in pairs]), tuple([endpoint_label(be[0], be[1]) for _, be in pairs]))
    return out


def dump(family: IPFamily, names: Mapping[ServicePortName, Ids], counts: Sequence[int]) -> CounterDump:
    """The CounterDump of every service port in ``names`` from the counts indexed by backend id."""
    take = counts.__getitem__
    ports: dict[ServicePortName, PortCounters] = {}
    for name, (ids, endpoints) in names.items():
        conns = tuple(map(take, ids))
        ports[name] = PortCounters(Counts(sum(conns)), endpoints, conns)
    return CounterDump(family, ports)


def read_map(fd: int, upto: int) -> array.array[int]:
    """The counters of backend ids 0 .. ``upto``, indexed by id, in one ``BPF_MAP_LOOKUP_BATCH``."""
    _, values = maps.lookup_array(fd, maps.COUNTER_KEY.size, maps.COUNTER_VALUE.size, upto + 1)
    counts = array.array("Q", values)
    if sys.byteorder != "little":
        counts.byteswap()
    if len(counts) <= upto:  # an array shorter than the highest id (no such id can be in use): zeros
        counts.extend(bytes(8 * (upto + 1 - len(counts))))
    return counts


class Names:
    """Per family, each programmed service port's backend ids and endpoints (``Ids``): written by the runner thread
    after each applied batch, copied by a read (a scrape) under the lock."""

    def __init__(self, families: Iterable[IPFamily]) -> None:
        self._lock = threading.Lock()
        self._names: dict[IPFamily, dict[ServicePortName, Ids]] = {f: {} for f in families}

    def applied(self, family: IPFamily, index: FamilyIndex, batch: Batch[Any, Any, Any, Any]) -> None:
        """After ``batch`` is in the kernel and ``index`` says what it holds: a full batch names every service port
        anew, a partial one the ones it changed."""
        if batch.full:
            fresh = all_ids(index)
            wanted = {n: fresh.get(n, ((), ())) for n in batch.wanted}
            with self._lock:
                self._names[family] = wanted
            return
        changed = [d.name for d in batch.deltas if d.new_fragment is not None]
        got = all_ids(index, changed)
        with self._lock:
            mine = self._names[family]
            for d in batch.deltas:
                if d.new_fragment is None:
                    mine.pop(d.name, None)  # its counters go with it
            for name in changed:
                mine[name] = got.get(name, ((), ()))

    def forget(self) -> None:
        with self._lock:
            for f in self._names:
                self._names[f] = {}

    def read(self, family: IPFamily, places: loader.Places) -> CounterDump:
        """One walk of the family's pinned counter map (through the pin: never a fd the runner thread may retire),
        mapped to the service ports kproxy programs now. BackendError when the map cannot be read."""
        with self._lock:
            names = dict(self._names.get(family, {}))
        top = max((max(ids) for ids, _ in names.values() if ids), default=0)
        path = places.pin(maps.COUNTER_ROLE, family)
        try:
            fd = maps.obj_get(str(path))
        except OSError as exc:
            raise BackendError(f"bpf: the counter map {path} cannot be opened: {exc}") from None
        try:
            counts = read_map(fd, top)
        except OSError as exc:
            raise BackendError(f"bpf: reading the counter map {path}: {exc}") from None
        finally:
            os.close(fd)
        return dump(family, names, counts)
