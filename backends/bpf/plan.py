"""The bpf mode's write planner: the ordered plan of map writes that turns what the index says the maps hold into
what a batch's fragments want, updating the index as if the writes were done.

The order is Cilium's and is what keeps every intermediate state consistent (batch calls are not atomic across
elements): new backends, names, slots, master entries (their counts last), then slots beyond the new counts and
frontends gone, then backends no longer referenced. Only entries whose bytes change are written. Pure: nothing here
touches the kernel (``kernel.run_steps`` executes a plan); tests/unit/test_bpf_render.py asserts on the entries a
plan writes and on their order.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

from kproxy.model import IPFamily, ServicePortName
from kproxy.toolkit.keys import service_key
from kproxy.toolkit.mappings import dict_of

from . import maps
from .index import PTON, FamilyIndex, FrontState
from .index import ids as slot_ids
from .index import ports as port_table
from .maps import Master
from .render import Fragment, Frontend


@dataclass(slots=True)
class Bulk:
    """One put phase's entries of services planned whole and new (``_plan_new``): a byte string of keys and one of
    values per service, joined once per batch; no object per entry. Their keys are new to the plan (a fresh frontend,
    fresh backend ids), so they go before the phase's other puts and no delete of the plan precedes them."""

    keys: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    count: int = 0

    def packed(self) -> tuple[maps.Packed, maps.Packed]:
        """Keys and values, each one byte string; the per-service pieces are let go (replaced by the joined ones,
        which the batch calls read anyway): a drained chunk no longer holds ~30 small objects per service until the
        whole sync ends."""
        kb, vb = b"".join(self.keys), b"".join(self.values)
        self.keys, self.values = [kb], [vb]
        return maps.Packed(kb, len(kb) // self.count), maps.Packed(vb, len(vb) // self.count)


@dataclass
class Plan:
    """Map writes in the safe order: ``be_put`` (new backends), ``slot_put``, ``master_put`` (counts last),
    ``svc_del`` (slots beyond the new counts, frontends gone), ``be_del`` (backends no longer referenced). The bulk
    of a first sync (new services with one frontend) goes to ``bulk_be``, ``bulk_slot``, ``bulk_master`` instead,
    written at the head of their phase."""

    be_put: dict[bytes, bytes] = field(default_factory=dict)
    name_put: dict[bytes, bytes] = field(default_factory=dict)
    slot_put: dict[bytes, bytes] = field(default_factory=dict)
    master_put: dict[bytes, bytes] = field(default_factory=dict)
    svc_del: list[bytes] = field(default_factory=list)
    be_del: list[bytes] = field(default_factory=list)
    name_del: list[bytes] = field(default_factory=list)
    bulk_be: Bulk = field(default_factory=Bulk)
    bulk_slot: Bulk = field(default_factory=Bulk)
    bulk_master: Bulk = field(default_factory=Bulk)
    #: frontends this plan removed (their deletes run after every put: a later service may not take the bulk path
    #: for one of them, its puts would be deleted again)
    gone_fronts: set[tuple[str, int, int]] = field(default_factory=set)
    #: put phases handed to the kernel already (``drain_puts``), kept so ``finish_plan`` and ``writes`` see them
    drained: list[Plan] = field(default_factory=list)
    #: ids this plan frees: reusable only once the plan is in the kernel (``release``). Reused within the plan, a
    #: freed backend id would be rewritten to another service's pod while the old slots still name it (every put
    #: runs before every delete), and a connect to the old service would reach the other's pod meanwhile.
    freed_backends: list[int] = field(default_factory=list)
    freed_revs: list[int] = field(default_factory=list)
    #: ``--service-counters``: each new backend's counter is zeroed right after the backend is written, before a
    #: slot names it, and zeroed again when the backend goes (``counters``)
    counting: bool = False
    #: ``sweep`` ran: the free lists were rebuilt from the index (``release`` then checks each freed id against them)
    swept: bool = False
    #: service ports the sweep removed that nothing wants (``Applied.leftovers``)
    leftovers: int = 0

    def release(self, index: FamilyIndex) -> None:
        """The plan is in the kernel: its freed ids may be handed out again (those below the next fresh id: a full
        sync's sweep may have lowered it, and an id at or above it comes back as a fresh one), each once (the sweep
        may have listed it already among the holes below the highest id: twice in the free list, one id went to two
        backends).

        O(freed ids) unless this plan swept or the index holds a reverse-NAT id under two names: a freed id was in
        use until this plan, so it cannot be in a free list already (the free lists never hold an id in use); only
        the sweep rebuilds them, and only adoption's ``claim`` gives one id to two names (``shared_revs``). Sets of
        the whole index here made every partial sync O(services)."""
        free_b, free_r = index.free_backends, index.free_revs
        have_b: set[int] | tuple[()] = set(free_b) if self.swept else ()
        for b in dict.fromkeys(self.freed_backends):
            if b < index.next_backend and b not in index.backends and b not in have_b:
                free_b.append(b)
        have_r: set[int] | tuple[()] = set(free_r) if self.swept else ()
        shared = self.swept or index.shared_revs  # a full batch's claims may have shared an id the sweep freed
        used_revs: set[int] | tuple[()] = set(index.rev_ids.values()) if shared and self.freed_revs else ()
        for r in dict.fromkeys(self.freed_revs):
            if r < index.next_rev and r not in used_revs and r not in have_r:
                free_r.append(r)
        self.freed_backends, self.freed_revs = [], []

    @property
    def writes(self) -> int:
        return (
            sum(len(x) for x in (self.be_put, self.name_put, self.slot_put, self.master_put))
            + sum(b.count for b in (self.bulk_be, self.bulk_slot, self.bulk_master))
            + sum(len(x) for x in (self.svc_del, self.be_del, self.name_del))
            + sum(p.writes for p in self.drained)
            + (self._counter_writes() if self.counting else 0)
        )

    def _counter_writes(self) -> int:
        return len(self.be_put) + self.bulk_be.count + len(self.be_del)

    def written(self, phase: str) -> dict[bytes, bytes]:
        """Key -> value of one put phase ("be", "name", "slot", "master") as executing the plan leaves it, drained
        chunks and bulk entries included (for tests and explanations; the sync executes ``ordered``)."""
        out: dict[bytes, bytes] = {}
        for p in (*self.drained, self):
            bulk = getattr(p, f"bulk_{phase}", None)
            if bulk is not None and bulk.count:
                out.update(zip(*bulk.packed(), strict=True))
            out.update(getattr(p, f"{phase}_put"))
        return out

    def drain_puts(self) -> list[tuple[str, str, Sequence[bytes], Sequence[bytes]]]:
        """The put phases planned so far, in execution order, to be written now (a large full sync writes one chunk
        of services while it plans the next); deletes stay until ``finish_plan``. Per service the order holds:
        its backends, name and slots before its master, every delete after every put."""
        done = Plan(
            self.be_put,
            self.name_put,
            self.slot_put,
            self.master_put,
            bulk_be=self.bulk_be,
            bulk_slot=self.bulk_slot,
            bulk_master=self.bulk_master,
            counting=self.counting,
        )
        self.drained.append(done)
        self.be_put, self.name_put, self.slot_put, self.master_put = {}, {}, {}, {}
        self.bulk_be, self.bulk_slot, self.bulk_master = Bulk(), Bulk(), Bulk()
        return done.ordered()

    def ordered(self) -> list[tuple[str, str, Sequence[bytes], Sequence[bytes]]]:
        """(map role, op, keys, values) in execution order (not the drained phases)."""
        out: list[tuple[str, str, Sequence[bytes], Sequence[bytes]]] = []

        def put(role: str, bulk: Bulk | None, entries: dict[bytes, bytes]) -> None:
            if bulk is not None and bulk.count:
                out.append((role, "put", *bulk.packed()))
            if entries:
                out.append((role, "put", list(entries), list(entries.values())))

        put("be", self.bulk_be, self.be_put)
        if self.counting:
            self._counters_put(out)
        put("name", None, self.name_put)
        put("svc", self.bulk_slot, self.slot_put)
        put("svc", self.bulk_master, self.master_put)
        if self.svc_del:
            out.append(("svc", "del", list(self.svc_del), []))
        if self.be_del:
            out.append(("be", "del", list(self.be_del), []))
        if self.counting and self.be_del:
            out.append((maps.COUNTER_ROLE, "del", list(self.be_del), []))
        if self.name_del:
            out.append(("name", "del", list(self.name_del), []))
        return out

    def _counters_put(self, out: list[tuple[str, str, Sequence[bytes], Sequence[bytes]]]) -> None:
        """The counters of this plan's new backends (their keys are the backends' ids), zero."""
        blob = b"".join([*self.bulk_be.keys, *self.be_put])
        if blob:
            keys = maps.Packed(blob, maps.COUNTER_KEY.size)
            out.append((maps.COUNTER_ROLE, "put", keys, maps.zero_values(len(keys), maps.COUNTER_VALUE.size)))


_ID = struct.Struct("<I")
_SLOT_VALUE = struct.Struct("<I12x")  # a slot entry: backend_id, the rest zero (see maps.slot_value)
_SLOTS = 65536  # a frontend's slot numbers are 16 bits


def _key_tails(proto: int, upto: int) -> tuple[bytes, ...]:
    """The tails of a service-map key after address . port (slot in host order, protocol, padding) of ``proto`` for
    slots 0..``upto`` at least: a power of two of them, so a service's slot count picks one of 17 tables per protocol
    (a slot count is an endpoint count: all 65,536 up front would cost ~3 MB per protocol)."""
    return _tails_upto(proto, min(max(64, 1 << upto.bit_length()), _SLOTS))


@functools.lru_cache(maxsize=64)
def _tails_upto(proto: int, size: int) -> tuple[bytes, ...]:
    end = bytes((proto, 0, 0, 0))
    return tuple(i.to_bytes(2, "little") + end for i in range(size))


def remove_front(plan: Plan, index: FamilyIndex, key: tuple[str, int, int], st: FrontState) -> None:
    """Plan the deletion of one frontend's entries (master first) and forget it in ``index``."""
    head = PTON[index.family](key[0]) + port_table()[key[1]]
    tails = _key_tails(key[2], len(st.slots))
    # the master first (Cilium's order): a connect() racing the removal then finds the service whole or gone, never
    # a master counting slots already deleted
    for slot in range(len(st.slots) + 1):
        plan.svc_del.append(head + tails[slot])
    plan.gone_fronts.add(key)
    index.drop_front(key)


def plan_service(
    index: FamilyIndex,
    name: ServicePortName,
    new: Fragment | None,
    plan: Plan,
    *,
    keep_fronts: Iterable[tuple[str, int, int]] = (),
) -> None:
    """Add to ``plan`` the writes that make ``name`` hold ``new`` (None: remove it), and update ``index`` as if they
    were done. Frontends in ``keep_fronts`` belong to another service and are never removed here.

    Written for speed (a full sync at 10,000 x 10 plans 220,000 writes): key bytes from the address (``PTON``) and
    cached port and slot pieces, one concatenation per entry; a new service with one frontend (the bulk of a first
    sync) one per phase (``_plan_new``)."""
    mine = index.owned.get(name)
    if (
        mine is None
        and new is not None
        and len(new.frontends) == 1
        and not index.free_backends
        and _plan_new(index, name, new.frontends[0], plan)
    ):
        return
    keep = set(keep_fronts) if keep_fronts else ()
    fronts = index.fronts
    owned = {k: fronts[k] for k in mine if k in fronts} if mine else {}
    old_ids: dict[bytes, int] = {}  # address . port bytes -> backend id
    endpoint = index.backends.endpoint
    for st in owned.values():
        for bid in st.slots:
            ep = endpoint(bid)
            if ep is not None:
                old_ids.setdefault(ep, bid)
    if new is None:
        _plan_removal(index, name, owned, old_ids, keep, plan)
        return
    rev = _named_rev(index, name, plan)
    ids = _backend_ids(index, new, old_ids, plan)
    for f in new.frontends:
        _plan_front(index, name, f, [ids[b] for b in f.backends], rev, plan)
    if owned:
        wanted = {f.key for f in new.frontends}
        for k, st in owned.items():
            if k not in wanted and k not in keep:
                remove_front(plan, index, k, st)
        _free_backends(index, set(old_ids.values()) - set(ids.values()), plan)


def _free_backends(index: FamilyIndex, bids: Iterable[int], plan: Plan) -> None:
    """Plan the removal of backends no slot of their service names any more (their ids freed with the plan)."""
    for bid in bids:
        plan.be_del.append(_ID.pack(bid))
        index.backends.discard(bid)
        plan.freed_backends.append(bid)


def _plan_removal(
    index: FamilyIndex,
    name: ServicePortName,
    owned: Mapping[tuple[str, int, int], FrontState],
    old_ids: Mapping[bytes, int],
    keep: Iterable[tuple[str, int, int]],
    plan: Plan,
) -> None:
    """A service gone: its frontends (but those in ``keep``), its backends, its reverse-NAT id and name."""
    for k, st in owned.items():
        if k not in keep:
            remove_front(plan, index, k, st)
    _free_backends(index, set(old_ids.values()), plan)
    rev = index.rev_ids.pop(name, None)
    if rev is not None:
        plan.freed_revs.append(rev)
        index.rev_names.pop(rev, None)
        plan.name_del.append(maps.name_key(rev))


def _backend_ids(
    index: FamilyIndex, new: Fragment, old_ids: Mapping[bytes, int], plan: Plan
) -> dict[tuple[str, int], int]:
    """Each backend of ``new`` with its id: the one it had in this service, else a freed or fresh one (its backend
    entry planned)."""
    put_raw = index.backends.put_raw
    pton = PTON[index.family]
    be_put = plan.be_put
    free = index.free_backends
    nb = index.next_backend
    port_bytes = port_table()
    pack_id = _ID.pack
    ids: dict[tuple[str, int], int] = {}
    for f in new.frontends:
        tail2 = bytes((f.proto, 0))
        for b in f.backends:
            if b in ids:
                continue
            ep = pton(b[0]) + port_bytes[b[1]]
            known = old_ids.get(ep) if old_ids else None
            if known is None:
                if free:
                    known = free.pop()
                else:
                    known = nb
                    nb += 1
                value = ep + tail2
                put_raw(known, value)
                be_put[pack_id(known)] = value
            ids[b] = known
    index.next_backend = nb
    return ids


def _plan_front(index: FamilyIndex, name: ServicePortName, f: Frontend, bids: list[int], rev: int, plan: Plan) -> None:
    """One frontend's slots and master entry: only the slots whose backend changes, the master when it changes, the
    slots beyond a smaller count deleted."""
    key = f.key
    cur = index.fronts.get(key)
    old_slots: Sequence[int] = cur.slots if cur is not None else ()
    slots = _stable_slots(old_slots, bids)
    master = Master(len(slots), f.flags, f.affinity, rev)
    # key bytes: address . port (network order), then slot (host order), protocol, padding
    head = PTON[index.family](f.address) + port_table()[f.port]
    n_old = len(old_slots)
    tails = _key_tails(f.proto, max(n_old, len(slots)))
    slot_put = plan.slot_put
    pack_slot = _SLOT_VALUE.pack
    if n_old == 0:
        for i, bid in enumerate(slots, start=1):
            slot_put[head + tails[i]] = pack_slot(bid)
    else:
        for i, bid in enumerate(slots, start=1):
            if i > n_old or old_slots[i - 1] != bid:
                slot_put[head + tails[i]] = pack_slot(bid)
    if cur is None or cur.master != master:
        plan.master_put[head + tails[0]] = maps.master_value(master)
    for i in range(n_old, len(slots), -1):
        plan.svc_del.append(head + tails[i])
    index.put_front(key, FrontState(name, master, slot_ids(slots)))


def _named_rev(index: FamilyIndex, name: ServicePortName, plan: Plan) -> int:
    """The service's reverse-NAT id (a new one if it has none), with its names-map entry planned if not there yet."""
    rev = index.rev_ids.get(name)
    if rev is None:
        rev = index.rev_ids[name] = index.alloc_rev()
    text = service_key(name)
    if index.rev_names.get(rev) != text:
        index.rev_names[rev] = text
        plan.name_put[maps.name_key(rev)] = maps.name_value(text)
    return rev


_PACKERS_UPTO = 1024  # counts above it are packed entry by entry


def _ids_packer(n: int, one: str) -> struct.Struct | None:
    """The ``struct`` packing ``n`` backend ids as keys (``one`` = "I"), or as slot values ("I12x": id, 12 zero
    bytes); None above ``_PACKERS_UPTO``."""
    return _packer(n, one) if n <= _PACKERS_UPTO else None


@functools.lru_cache(maxsize=2 * _PACKERS_UPTO)
def _packer(n: int, one: str) -> struct.Struct:
    return struct.Struct("<" + one * n)


def _plan_new(index: FamilyIndex, name: ServicePortName, f: Frontend, plan: Plan) -> bool:
    """A service the index does not hold, with one frontend nobody holds or removed in this plan, and fresh backend
    ids in a row: its entries go to the plan's bulk phases, each phase's keys and values as one byte string built
    with C-level joins and packs. False (nothing done): not such a service, the general path plans it."""
    key = f.key
    fronts = index.fronts
    if key in fronts or key in plan.gone_fronts:
        return False
    bes = f.backends
    n = len(bes)
    if len(set(bes)) != n:
        return False
    rev = _named_rev(index, name, plan)
    proto = f.proto
    nb = index.next_backend
    bids = range(nb, nb + n)
    index.next_backend = nb + n
    port_bytes = port_table()
    pton = PTON[index.family]
    head = pton(f.address) + port_bytes[f.port]
    tails = _key_tails(proto, n)
    if n:
        tail2 = bytes((proto, 0))
        be = plan.bulk_be
        ids = _ids_packer(n, "I")
        be.keys.append(ids.pack(*bids) if ids is not None else b"".join(map(_ID.pack, bids)))
        ips, ports = zip(*bes, strict=True)
        if ports.count(ports[0]) == n:  # one target port (the usual case): address . (port . proto . flags) ...
            sep = port_bytes[ports[0]] + tail2
            values = sep.join(map(pton, ips)) + sep
        else:
            values = b"".join([pton(a) + port_bytes[p] + tail2 for a, p in bes])
        be.values.append(values)
        be.count += n
        index.backends.put_run(nb, values)  # the table holds what the array will
        sl = plan.bulk_slot
        sl.keys.append(head + head.join(tails[1 : n + 1]))
        vals = _ids_packer(n, "I12x")
        sl.values.append(vals.pack(*bids) if vals is not None else b"".join(map(_SLOT_VALUE.pack, bids)))
        sl.count += n
    master = Master(n, f.flags, f.affinity, rev)
    ms = plan.bulk_master
    ms.keys.append(head + tails[0])
    ms.values.append(maps.master_value(master))
    ms.count += 1
    fronts[key] = FrontState(name, master, slot_ids(bids))
    index.entries += 1 + n
    index.owned[name] = (key,)
    return True


def sweep(index: FamilyIndex, wanted: Mapping[ServicePortName, Fragment], plan: Plan) -> None:
    """A full batch's last planning step: remove frontends nobody owns, backends no frontend references, names of no
    service; then the allocators start again from what is left (the holes below the highest backend id first: the
    backend array's indexes are the ids, so ids stay below its size while the backends fit in it)."""
    fronts = index.fronts
    # owners and names are compared with ``wanted`` by the hashes both dicts store (``index.owned`` holds every
    # owner: a ServicePortName's own hash is a Python call, one per service port of a full batch twice over)
    wanted_names = dict_of(wanted)
    gone = set(index.owned).difference(wanted_names)
    for owner in [o for o in gone if not index.owned[o]]:  # a service whose frontends all moved to others
        del index.owned[owner]
        gone.discard(owner)
    if gone:
        doomed = [k for k, st in fronts.items() if st.owner is None or st.owner not in wanted_names]
    else:
        doomed = [k for k, st in fronts.items() if st.owner is None]
    owners = {fronts[k].owner for k in doomed}
    # a restart's frontends are owned once claimed (``adopt.claim_all``): an unwanted one's service port is its
    # reverse-NAT id (one per service port, read back from the maps); orphan slots (no master, id 0) are no port's
    unowned = {fronts[k].master.rev_nat_id for k in doomed if fronts[k].owner is None} - {0}
    plan.leftovers = len(owners - {None}) + len(unowned)
    for k in doomed:
        remove_front(plan, index, k, fronts[k])
    for bid in index.backends.unused(chain.from_iterable(st.slots for st in fronts.values())):
        plan.be_del.append(_ID.pack(bid))
        del index.backends[bid]
    live_revs = {st.master.rev_nat_id for st in fronts.values()}
    for name in set(index.rev_ids).difference(wanted_names):
        del index.rev_ids[name]
    named = set(index.rev_ids.values())
    index.shared_revs = len(named) < len(index.rev_ids)
    held = live_revs | named
    for rev in sorted(index.rev_names.keys() - held):
        plan.name_del.append(maps.name_key(rev))
        del index.rev_names[rev]
    index.free_revs.clear()
    index.next_backend = index.backends.top() + 1
    if index.next_backend - 1 > len(index.backends):
        index.free_backends = index.backends.holes()
    else:
        index.free_backends.clear()
    index.next_rev = max([*index.rev_names, *live_revs, 0]) + 1
    index.forget_adoption()  # every frontend left is owned: adoption's lookups are stale from here on
    plan.swept = True


def _stable_slots(old: Sequence[int], new: list[int]) -> tuple[int, ...]:
    """The new slot order: a backend that stays keeps its slot (ClientIP affinity entries name the slot their
    backend was found in, which the programs look at first; and an endpoint change rewrites only the slots that
    change); survivors past the new count move into the holes (the programs find a moved backend of an affinity
    entry among the frontend's first 256 slots), new backends fill what is left. Without old slots (or with a
    backend twice) the fragment's order."""
    if not old or len(set(new)) != len(new) or len(set(old)) != len(old):
        return tuple(new)
    n = len(new)
    want = set(new)
    out: list[int | None] = [b if b in want else None for b in old[:n]]
    placed = {b for b in out if b is not None}
    rest = [b for b in old[n:] if b in want] + [b for b in new if b not in placed and b not in old[n:]]
    it = iter(rest)
    filled = [b if b is not None else next(it) for b in out]
    filled.extend(it)
    return tuple(filled)


def finish_plan(plan: Plan) -> None:
    """A key both written and deleted in one plan (a frontend that moved between services) is only written (drained
    phases included)."""
    parts = [plan, *plan.drained]
    if plan.svc_del:
        plan.svc_del = [
            k for k in dict.fromkeys(plan.svc_del) if not any(k in p.slot_put or k in p.master_put for p in parts)
        ]
    if plan.be_del:
        plan.be_del = [k for k in dict.fromkeys(plan.be_del) if not any(k in p.be_put for p in parts)]
    if plan.name_del:
        plan.name_del = [k for k in dict.fromkeys(plan.name_del) if not any(k in p.name_put for p in parts)]


def full_steps(
    family: IPFamily, items: Sequence[tuple[ServicePortName, Fragment]], counting: bool, chunk: int
) -> list[tuple[str, str, Sequence[bytes], Sequence[bytes]]]:
    """The steps a full sync of ``items`` into empty maps executes, put phases drained every ``chunk`` services as
    the pipelined sync does (0: none). Built again when the benchmark's floor asks: keeping the last full sync's
    steps for it held every byte written (~640 per service port) for as long as kproxy ran."""
    index, plan = FamilyIndex(family), Plan(counting=counting)
    steps: list[tuple[str, str, Sequence[bytes], Sequence[bytes]]] = []
    for start in range(0, len(items), chunk or max(1, len(items))):
        for name, fragment in items[start : start + (chunk or len(items))]:
            plan_service(index, name, fragment, plan)
        if chunk:
            steps += plan.drain_puts()
    finish_plan(plan)
    return steps + plan.ordered()
