"""The bpf mode's traffic counters (``--service-counters``): new connections and flows per service port and endpoint,
counted by the socket programs at the backend pick and read in one map dump per family.

Decisions:

- **Connections only** (``OFFERED``). The programs run at connect() and sendmsg(), once per connection (TCP, SCTP)
  or per datagram of an unconnected UDP socket: they pick a backend and rewrite an address, and never see the
  packets or bytes that follow on the connected socket. Counting those would take another program on every packet
  (a cgroup skb program, or a tc program) that the mode does not otherwise run (a per-packet cost it does not pay,
  and a socket-to-service lookup per packet to attribute it), so the mode offers connections only.
- **What is counted, where**: a per-CPU hash ``cnt4``/``cnt6`` (``maps.COUNTER_ROLE``) keyed by the backend id: ids
  are per service port (a backend of two services has two ids), so an id names one (service port, endpoint). The
  programs add one per translating pick: every TCP/SCTP connect, and for UDP a translation that (re)writes the
  socket's reverse-NAT entry (a new socket, backend or frontend: one per flow, not per datagram; a flow whose entry
  the reverse-NAT LRU pushed out counts again). Per-CPU: no cache line shared between CPUs per busy backend. The
  programs only increment a counter kproxy made: each new backend's counter is written (zero) with the backend,
  before any slot names it, and deleted with it (``plan.Plan.counting``), so a reused id starts at 0 and a deleted
  service's counters go with its backends. A full sync that reads the maps back also repairs the counters
  (``repair``: missing ones zeroed, others deleted), e.g. after counters were switched on over existing maps.
- **What is not counted**: connections refused or dropped for want of endpoints (no backend is picked: the service
  total is its endpoints' sum); sockets outside the cgroup; and the companion nftables table's traffic (external
  clients to NodePorts, externalIPs and load-balancer IPs, DNATed by nft rules, not by the programs): those are not
  in these counters.
- **Off by default, and then absent**: the counter maps exist only in a program compiled with ``KP_PIN_CNT4/6``
  (``loader.compile_programs`` with ``Places.counters``); without the switch the programs are today's, no counter
  map is made, and a start unpins the ones an earlier kproxy left (``kernel.OpenMaps``).
- **One dump per read**: one ``BPF_MAP_LOOKUP_BATCH`` walk of the counter map (per-CPU values summed column-wise,
  ``per_cpu_sums``), mapped back to service ports and endpoints through ``Names``, which the runner thread keeps
  from kproxy's index as it applies batches (a whole rebuild on full batches, the changed services on partial ones)
  and the scrape copies under a lock.
- **Lifetime**: the counter maps are pinned, so counts survive a restart (adoption writes nothing when nothing
  changed), and turning the switch off and on again starts from zero.
"""

from __future__ import annotations

import array
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from kproxy.batch import Batch
from kproxy.counters import CounterDump, Counts, Measure, PortCounters
from kproxy.model import IPFamily, ServicePortName
from kproxy.proxier import BackendError

from . import loader, maps
from .index import FamilyIndex, FrontState
from .plan import Plan

#: What the mode counts (``Proxier.counters_offered``): connections, see the module's docstring.
OFFERED: frozenset[Measure] = frozenset({Measure.CONNECTIONS})

#: one service port's backend ids and their endpoints (``ip:port``, ``[ip]:port``), in slot order
Ids = tuple[tuple[int, ...], tuple[str, ...]]


def endpoint_text(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


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
        out[name] = (tuple([bid for bid, _ in pairs]), tuple([endpoint_text(be[0], be[1]) for _, be in pairs]))
    return out


def per_cpu_sums(values: bytes, cpus: int) -> array.array[int]:
    """Per-CPU u64 values (``cpus`` slots per entry, as bpf(2) hands them over) summed per entry, column-wise: each
    CPU's column is laid into lanes of a big integer with room for the carries, the integers added, the low 8 bytes
    of each lane kept (a sum beyond 2^64 wraps, as the kernel's counters do). No Python step per entry."""
    width = maps.COUNTER_SLOT.size
    stride = width * cpus
    if len(values) % stride:
        raise ValueError(f"{len(values)} bytes are not whole per-CPU values of {cpus} CPUs")
    n = len(values) // stride
    little = sys.byteorder == "little"
    if cpus == 1:
        out = array.array("Q", values)
    else:
        lane = width + max(1, (cpus.bit_length() + 7) // 8)
        total = 0
        for cpu in range(cpus):
            buf = bytearray(lane * n)
            for j in range(width):  # byte j of this CPU's slot, least significant first
                src = values[cpu * width + (j if little else width - 1 - j) :: stride]
                buf[j::lane] = src
            total += int.from_bytes(buf, "little")
        summed = total.to_bytes(lane * n + 1, "little")
        low = bytearray(width * n)
        for j in range(width):
            low[(j if little else width - 1 - j) :: width] = summed[j : lane * n : lane]
        out = array.array("Q", bytes(low))
    return out


def _ids(keys: bytes) -> array.array[int]:
    """Counter (and backend) keys, concatenated, as ids."""
    ids = array.array("I", keys)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def decode(keys: bytes, values: bytes, cpus: int) -> dict[int, int]:
    """The counter map as read (keys and per-CPU values, each concatenated): backend id -> connections."""
    return dict(zip(_ids(keys), per_cpu_sums(values, cpus), strict=True))


def dump(family: IPFamily, names: Mapping[ServicePortName, Ids], counts: Mapping[int, int]) -> CounterDump:
    """The CounterDump of every service port in ``names`` from the counts per backend id (an id the map lacks: 0)."""
    get = counts.get
    ports: dict[ServicePortName, PortCounters] = {}
    for name, (ids, endpoints) in names.items():
        conns = tuple([get(i, 0) for i in ids])
        ports[name] = PortCounters(Counts(sum(conns)), endpoints, conns)
    return CounterDump(family, ports)


def read_map(fd: int) -> dict[int, int]:
    """Backend id -> connections of one counter map, in one walk (``BPF_MAP_LOOKUP_BATCH``)."""
    cpus = maps.possible_cpus()
    size = maps.counter_value_size()
    keys, values = maps.lookup_raw(fd, maps.COUNTER_KEY.size, size, chunk=max(1024, (1 << 20) // size))
    return decode(keys, values, cpus)


def repair(the_plan: Plan, index: FamilyIndex, present: Iterable[int]) -> None:
    """A full batch that read the maps back: zero the counters of backends that have none (counters switched on over
    existing maps), delete the counters of ids no backend holds, and no delete of a counter that is not there.
    After planning (``index`` as the plan leaves it), before the plan's remaining steps are taken."""
    have = set(present)
    pack = maps.COUNTER_KEY.pack
    planned = set(_ids(b"".join([k for p in (the_plan, *the_plan.drained) for k in (*p.bulk_be.keys, *p.be_put)])))
    the_plan.cnt_put += [pack(b) for b in sorted(index.backends.keys() - have - planned)]
    freed = list(_ids(b"".join(the_plan.be_del)))
    dels = [b for b in freed if b in have]
    gone = set(freed)
    dels += sorted(b for b in have - index.backends.keys() - gone - planned)
    the_plan.cnt_del = [pack(b) for b in dels]


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
        path = places.pin(maps.COUNTER_ROLE, family)
        try:
            fd = maps.obj_get(str(path))
        except OSError as exc:
            raise BackendError(f"bpf: the counter map {path} cannot be opened: {exc}") from None
        try:
            counts = read_map(fd)
        except OSError as exc:
            raise BackendError(f"bpf: reading the counter map {path}: {exc}") from None
        finally:
            os.close(fd)
        return dump(family, names, counts)
