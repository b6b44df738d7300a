"""The transactions of one batch: what to write so the kernel holds what the batch says, and what the kernel holds
once each transaction commits (pure: the kernel is only read through the batch's adoption and the ``Known`` state).

A partial batch is one transaction of the dirty services' element changes, plus a shared chain the first time an
endpoint count appears and its removal with its last user. A full batch ensures the fixed part, reconciles the
context sets, the shared chains and the hairpin set, writes the services the adoption does not show unchanged and
removes what nothing wants; a big one is split into chunks of whole services (``CHUNK`` elements each, or
``NETLINK_CHUNK`` for the chunks written as netlink batches, ``nlwrite``), the fixed part and shared chains first, then
the services that go, and the chains' removal last, so every intermediate state is a consistent mix of old and new
services. Why chunks, and their
sizes: docs/PERFORMANCE.md and the package docstring.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kproxy.batch import Batch, Delta
from kproxy.model import IPFamily, NodeInfo, ProxyState, ServicePortName
from kproxy.nodeaddr import FamilyContext

from . import adopt as adopt_mod
from . import counters as counters_mod
from . import layout, nlwrite, render
from .render import Fragment

CHUNK = 10_000  # elements per transaction of a big full sync that libnftables parses
#: elements per transaction of a big full sync written as a netlink batch (``nlwrite``): no parse to hold, and each
#: transaction that adds a ``goto`` element makes the kernel walk every verdict-map element at its commit
NETLINK_CHUNK = 50_000


@dataclass(slots=True)
class Known:
    """What this process knows the kernel holds besides the ledger's fragments (``known`` False: unknown, a full
    sync reads it)."""

    shared: set[str] = field(default_factory=set)
    refs: Counter[str] = field(default_factory=Counter)  # shared chain -> services using it
    hairpin: set[str] = field(default_factory=set)
    context: dict[str, Any] | None = None
    known: bool = False


@dataclass(slots=True)
class Scratch:
    """What the refusal rounds of one full batch carry: the chunks an earlier round committed."""

    committed: dict[ServicePortName, Fragment | None] = field(default_factory=dict)
    stale_done: set[str] = field(default_factory=set)
    kernel: Known | None = None  # what the kernel holds after the committed chunks
    fresh: bool = False  # the table was (re)made from nothing


NftBatch = Batch[Fragment, FamilyContext, adopt_mod.Adopted, Scratch]


def scratch(batch: NftBatch) -> Scratch:
    if batch.scratch is None:
        batch.scratch = Scratch()
    return batch.scratch


@dataclass(slots=True)
class Chunk:
    """One transaction and what the kernel holds once it commits. ``hairpin_added``: the hairpin elements it adds
    (a partial chunk; the kernel's set is ``Known.hairpin`` plus those), ``hairpin`` the whole set (a full chunk)."""

    tx: render.Transaction
    services: dict[ServicePortName, Fragment | None]
    shared: set[str]
    refs: Counter[str]
    hairpin: set[str] | None = None
    hairpin_added: set[str] = field(default_factory=set)
    context: dict[str, Any] | None = None
    stale: set[str] = field(default_factory=set)  # comment keys of unwanted services it removes


def partial(batch: NftBatch, known: Known) -> Chunk:
    """The one transaction of a partial batch: O(its deltas), whatever the number of services (the shared-chain
    reference counts are a handful of chains; the known hairpin set is only read)."""
    tx = render.Transaction(batch.family)
    refs: Counter[str] = Counter()  # the changes to known.refs
    hairpin: set[str] = set()
    services: dict[ServicePortName, Fragment | None] = {}
    for d in batch.deltas:
        render.change_service(tx, d.name, d.old_fragment, d.new_fragment)
        services[d.name] = d.new_fragment
        if d.old_fragment is not None:
            refs.subtract(with_deps(d.old_fragment.shared))
        if d.new_fragment is not None:
            refs.update(with_deps(d.new_fragment.shared))
            hairpin.update(h for h in d.new_fragment.hairpin if h not in known.hairpin)
    after = Counter(known.refs)
    after.update(refs)  # Counter.update adds (negative counts too)
    shared = shared_changes(tx, known.shared, after)
    add_hairpin(tx, hairpin, set())
    return Chunk(tx, services, shared=shared, refs=after, hairpin_added=hairpin)


def commit(batch: NftBatch, known: Known, chunk: Chunk) -> None:
    """Record in ``known`` (and the batch's scratch) what a committed transaction left in the kernel."""
    known.shared = set(chunk.shared)
    if chunk.hairpin is not None:
        known.hairpin = set(chunk.hairpin)
    else:
        known.hairpin.update(chunk.hairpin_added)
    if chunk.refs or not batch.full:
        known.refs = Counter(chunk.refs)
    if chunk.context is not None:
        known.context = chunk.context
    if batch.full:
        sc = scratch(batch)
        sc.committed.update(chunk.services)
        sc.stale_done.update(chunk.stale)
        sc.kernel = Known(shared=set(chunk.shared), hairpin=set(known.hairpin), context=chunk.context, known=True)


def full_chunks(batch: NftBatch, counters: bool = False, netlink: bool = False) -> Iterator[Chunk]:
    """The transactions of a full batch, built as they are asked for (see the module docstring; ``counters``: the
    fixed part with ``--service-counters``). ``netlink``: transactions of element changes only are written as
    netlink batches (``nlwrite``), so in a batch of more than ``CHUNK`` elements the fixed part and shared chains go
    first in a transaction of their own (which libnftables parses), and chunks of plain services grow to
    ``NETLINK_CHUNK`` elements; a service with chains, sets or firewall elements of its own starts a new chunk when
    the one it would join is past ``CHUNK``, which keeps every transaction libnftables parses near ``CHUNK``."""
    f = _Full(batch, counters, netlink)
    f.head()
    if netlink and not f.replace and not f.tx.empty() and _writes_more_than(batch, CHUNK):
        yield f.chunk()
        f.tx, f.services = render.Transaction(batch.family), {}
    # services that go first: one added in this batch may take an address a removed one still holds, and chunks
    # are separate transactions (a partial batch is one, its deletes first)
    gone = [d for d in batch.deltas if d.new_fragment is None]
    for d in itertools.chain(gone, (d for d in batch.deltas if d.new_fragment is not None)):
        if f.cut_before(d.old_fragment, d.new_fragment):
            yield f.chunk()
            f.tx, f.services = render.Transaction(batch.family), {}
        f.write(d.name, d.old_fragment, d.new_fragment)
        if f.is_full():
            yield f.chunk()
            f.tx, f.services = render.Transaction(batch.family), {}
    if f.cut_before(None, None, removals=True):  # chain removals are libnftables': not in a big netlink chunk
        yield f.chunk()
        f.tx, f.services = render.Transaction(batch.family), {}
    if f.adopted is not None:
        f.remove_unwanted()
    shared_changes(f.tx, f.both_shared, f.refs)
    add_hairpin(f.tx, set(), f.both_hairpin - f.needed_hairpin)
    yield f.chunk(last=True)


def _writes_more_than(batch: NftBatch, n: int) -> bool:
    """Whether a full batch's new fragments hold more than ``n`` elements (counted until there are)."""
    total = 0
    for d in batch.deltas:
        if d.new_fragment is not None:
            total += d.new_fragment.text.count("\n") + 2  # its lines and its digest
            if total > n:
                return True
    return False


def fresh_chunks(
    family: IPFamily, context: FamilyContext, fragments: Mapping[ServicePortName, Fragment], counters: bool = False
) -> Iterator[Chunk]:
    """The transactions that build a table holding ``fragments`` from nothing, as a full sync into an empty namespace
    writes them (``full_chunks`` with an adoption that found no table). Rendered again when asked (the benchmark's
    floor) rather than kept: they are the table's size (70 MB of text at 100,000 x 10). The batch's state is empty:
    planning reads the fragments and the context, never the services they came from."""
    batch: NftBatch = Batch(
        family=family,
        full=True,
        context=context,
        deltas=tuple(Delta(name, None, None, None, frag) for name, frag in fragments.items()),
        wanted=fragments,
        applied=MappingProxyType({}),
        state=ProxyState(services={}, node=NodeInfo("")),
        adopted=adopt_mod.Adopted(family),
    )
    return full_chunks(batch, counters, netlink=True)


def fresh_text(
    family: IPFamily, context: FamilyContext, fragments: Mapping[ServicePortName, Fragment], counters: bool = False
) -> str:
    """``fresh_chunks``' transactions joined into one text."""
    return "".join(chunk.tx.text() for chunk in fresh_chunks(family, context, fragments, counters))


class _Full:
    """The state of one full batch's planning across its chunks."""

    def __init__(self, batch: NftBatch, counters: bool = False, netlink: bool = False) -> None:
        self.batch, self.counters, self.netlink = batch, counters, netlink
        self.scratch = scratch(batch)
        self.adopted = batch.adopted
        self.tx = render.Transaction(batch.family)
        self.replace = False
        self.services: dict[ServicePortName, Fragment | None] = {}
        self.in_batch: set[ServicePortName] = set()
        self.stale: set[str] = set()
        self.damaged: set[str] = set()
        self.present_shared, self.present_hairpin, self.present_context = self._present()
        if batch.adopted is not None and self.scratch.kernel is None and self.scratch.fresh:
            self.adopted = None  # nothing of the old table survives
        # by distinct tuple of shared chains first: a handful of them for every service of the table
        self.refs: Counter[str] = Counter()
        for shared, users in Counter(f.shared for f in batch.wanted.values()).items():
            for s in with_deps(shared):
                self.refs[s] += users
        self.needed_shared = set(self.refs)
        self.needed_hairpin = {h for f in batch.wanted.values() for h in f.hairpin}
        self.both_shared = self.present_shared | self.needed_shared
        self.both_hairpin = self.present_hairpin | self.needed_hairpin
        self.want_context: dict[str, Any] = {}

    def _present(self) -> tuple[set[str], set[str], dict[str, Any]]:
        """The shared chains, hairpin elements and context sets the kernel holds before this round; makes the table
        from nothing (replacing an unreadable one or one of another layout in the same transaction) when needed."""
        known, adopted, fam, tx = self.scratch.kernel, self.adopted, self.batch.family, self.tx
        if known is not None:  # after chunks of an earlier round committed
            return known.shared, known.hairpin, known.context or {}
        if adopted is None or not adopted.table or not adopted.layout_ok:
            self.scratch.fresh = True
            self.replace = adopted is None or adopted.table
            if self.replace:
                # unreadable, or another layout: replaced whole in one transaction (no moment without rules)
                tx.head.append(f"add table {tx.fam} {layout.TABLE}")
                tx.head.append(f"delete table {tx.fam} {layout.TABLE}")
            tx.head.extend(layout.fixed_commands(fam, counters=self.counters))
            return set(), set(), {}
        shared = {c for c in adopted.chains if layout.is_shared_chain(c)}
        # a shared chain whose rules were changed by hand is written again (flushed first)
        self.damaged = {c for c in shared if not adopt_mod.shared_ok(c, fam, adopted.rules)}
        return shared, set(adopted.hairpin), dict(adopted.context)

    def head(self) -> None:
        """The context sets that differ, the shared chains and hairpin elements the kernel lacks."""
        tx = self.tx
        wanted_ctx = layout.context_elements(self.batch.context)
        self.want_context = adopt_mod.wanted_context(wanted_ctx)
        for name, items in wanted_ctx.items():
            if self.present_context.get(name) != self.want_context[name]:
                if not self.scratch.fresh:
                    tx.head.append(f"flush set {tx.fam} {layout.TABLE} {name}")
                if items:
                    tx.head.append(f"add element {tx.fam} {layout.TABLE} {name} {{ {', '.join(items)} }}")
        for name in ordered(self.needed_shared - (self.present_shared - self.damaged)):
            tx.add_shared_chain(name, exists=name in self.present_shared)
        add_hairpin(tx, self.needed_hairpin - self.present_hairpin, set())

    def chunk(self, last: bool = False) -> Chunk:
        return Chunk(
            self.tx,
            self.services,
            shared=self.needed_shared if last else self.both_shared,
            refs=self.refs if last else Counter(),
            hairpin=self.needed_hairpin if last else self.both_hairpin,
            context=self.want_context,
            stale=self.stale if last else set(),
        )

    def is_full(self) -> bool:
        if self.replace:
            return False
        n = self.tx.elements_added + self.tx.elements_deleted
        return n >= CHUNK and (n >= NETLINK_CHUNK or not self.netlink or not nlwrite.writes(self.tx))

    def cut_before(self, old: Fragment | None, new: Fragment | None, *, removals: bool = False) -> bool:
        """Whether a service whose change libnftables must parse (or the last chunk's removals) would join a big
        netlink-written chunk. A service rewritten from the kernel's skeleton after a restart is judged by its
        fragments only (its kernel-held chains are not looked up here)."""
        if not self.netlink or self.replace or self.tx.elements_added + self.tx.elements_deleted < CHUNK:
            return False
        return (removals or not (nlwrite.plain(old) and nlwrite.plain(new))) and nlwrite.writes(self.tx)

    def write(self, name: ServicePortName, old: Fragment | None, new: Fragment | None) -> None:
        """One service's change, from what the kernel is known to hold for it."""
        tx, adopted, committed = self.tx, self.adopted, self.scratch.committed
        if adopted is not None:  # only ``remove_unwanted`` asks, after an adoption (a fresh table's sync: 4 MB at 100k)
            self.in_batch.add(name)
        if name in committed:  # an earlier round's chunk wrote it
            if committed[name] != new:
                render.change_service(tx, name, committed[name], new)
        elif adopted is None or (svc := adopted.service(name)) is None:
            render.change_service(tx, name, None, new)
        elif (
            old is not None
            and svc.digests_agree
            and svc.digest == old.digest
            and svc.entries == {(m, k): v for m, k, v in old.entries}
            and adopted.chains_hold(old)
        ):  # the kernel holds the old version whole (an entry deleted by hand leaves the digest in the others)
            render.change_service(tx, name, old, new)
        else:
            sid = layout.service_chain_id(name)
            render.change_service(
                tx,
                name,
                None,
                new,
                old_keys={**svc.keys(), **counters_mod.skeleton(svc.entries, adopted.counting())},
                old_chains=adopted.service_chains(sid),
                old_sets=adopted.service_sets(sid),
            )
        self.services[name] = new

    def remove_unwanted(self) -> None:
        """Services the kernel holds that nothing wants (deleted while kproxy was down), and chains and sets of
        services no longer wanted."""
        adopted, tx, batch = self.adopted, self.tx, self.batch
        assert adopted is not None
        unwanted: list[str] = []
        if not adopted.all_wanted(f.comment for f in batch.wanted.values()):  # else every held one is wanted
            handled = {f.comment for f in batch.wanted.values()}
            handled.update(layout.comment_key(render.service_key(spn)) for spn in self.in_batch)
            done = self.scratch.stale_done
            unwanted = [c for c in adopted.ckeys() if c not in handled and c not in done]
        if adopted.trusting and unwanted:
            adopted.complete()  # an unwanted service: its entries are deleted, so they must be known
        for ckey in unwanted:
            svc = adopted.services[ckey]
            keys = {**svc.keys(), **counters_mod.skeleton(svc.entries, adopted.counting())}
            render.change_service(tx, None, None, None, old_keys=keys)
            self.stale.add(ckey)
        # chains of services the deltas handle (changed or removed) are theirs to rewrite or delete
        own_chains = [c for c in adopted.chains if layout.is_service_chain(c)]
        if not own_chains and not adopted.sets:
            return  # no service has chains or sets of its own (ClientIP affinity): no service's id is needed
        wanted_sids = {layout.service_chain_id(spn) for spn in (*batch.wanted, *self.in_batch)}
        stale_chains = [c for c in own_chains if sid_of(c) not in wanted_sids]
        for c in stale_chains:
            tx.flush_chain(c, None)
        for c in stale_chains:
            tx.delete_chain(c, None)
        for s in adopted.sets:
            if sid_of(s) not in wanted_sids:
                tx.delete_set(s, None)


def sid_of(name: str) -> str:
    """The service id inside a per-service chain or set name (``pick-<id>-c``, ``aff-<id>-<ep>-<t>``)."""
    parts = name.split("-")
    if parts[0] == "fw":
        parts = parts[1:]
    return parts[1] if len(parts) > 1 else ""


def with_deps(names: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for n in names:
        out.add(n)
        out.update(layout.shared_chain_needs(n))
    return out


def ordered(names: set[str]) -> list[str]:
    """Shared chains in creation order: those others jump to first."""

    def rank(n: str) -> int:
        if n.startswith("fw-"):
            return 2
        if n.startswith(("lbl-", "npl-")):
            return 1
        return 0

    return sorted(names, key=lambda n: (rank(n), n))


def shared_changes(tx: render.Transaction, present: set[str], refs: Counter[str]) -> set[str]:
    """Create the shared chains some service now uses and the kernel lacks; remove those no service uses any more
    (emptied first: they jump to each other). Returns the shared chains the kernel holds afterwards."""
    wanted = {n for n, c in refs.items() if c > 0}
    for name in ordered(wanted - present):
        tx.add_shared_chain(name)
    gone = present - wanted
    for name in gone:
        tx.flush_chain(name, None)
    for name in ordered(gone)[::-1]:
        tx.delete_chain(name, None)
    for name in [n for n, c in refs.items() if c <= 0]:
        del refs[name]
    return wanted


def add_hairpin(tx: render.Transaction, add: set[str], delete: set[str]) -> None:
    tx.delete_keys(((layout.HAIRPIN, h) for h in sorted(delete)), None)
    tx.add_elements(((layout.HAIRPIN, h, "") for h in sorted(add)), None, None)


def entries_needed(batch: NftBatch) -> bool:
    """Whether a full batch over a trusting adoption (a restart's: ``adopt.Adopted.trusting``) needs the entry maps:
    a service it writes that the kernel holds something of (rewritten from its old keys), or one the kernel holds
    that nothing wants (removed). False: every service the kernel holds is wanted and unchanged, or new."""
    adopted = batch.adopted
    if adopted is None or not adopted.ready():
        return False
    if any(adopted.held(layout.comment_key(render.service_key(d.name))) for d in batch.deltas):
        return True
    return not adopted.all_wanted(f.comment for f in batch.wanted.values())
