"""What is programmed, kept by the core: the ledger that drives every backend.

A backend knows how to turn one ``ServicePort`` into kernel state and how to apply a batch of such changes (the typed
protocol in ``kproxy.batch``). Everything around that is the same for every mode and lives here, once, tested once
(with ``kproxy.fake.FakeProxier``); ``LedgerProxier`` holds a ``Ledger`` and hands it itself as the backend:

- per IP family, each service's last-applied ``ServicePort`` and the backend's *fragment* for it, the services the
  kernel refused (kept on their old version or left out, with the reason), and whether a full sync is owed;
- turning ``sync(state, changes)`` into ``Delta`` values and handing them to ``apply`` in a ``Batch``: partial
  batches hold the dirty services only; full batches (first sync, after a failure, a changed node context, a
  backend's request, or when the cheap check says its state vanished) hold every service whose fragment differs from
  what the kernel holds, which the backend's ``adopt`` reads once, so a restart with nothing changed writes nothing
  (every wanted service is rendered before the first comparison: a backend may go on reading meanwhile);
- the render memo: a service port whose ``ServicePort`` and context equal the applied ones keeps its applied
  fragment (rendering is pure), so a full sync of an unchanged table renders nothing;
- the schedule of the cheap "is my state still there" check (``needs_full``), one policy for every mode: before
  every full batch but a first one, and before a partial batch at most every ``CHECK_INTERVAL_S`` per family; a
  backend's periodic read-back of the whole kernel (``readback_due``) runs off the sync path when the daemon runs a
  read-behind (``kproxy.readbehind``), which the records help with (``touched``, ``full_batches``);
- the address ownership and capacity rules (``kproxy.admission``), decided before anything is rendered;
- the refusal rounds: a service the kernel refuses is retried without it, up to ``MAX_ROUNDS`` times: it keeps its
  previously applied fragment if it had one (as upstream, whose failed restore leaves every old rule in place), else
  it is left out, and it is reported in ``SyncResult.failed`` (the cache keeps it dirty, so the next sync retries);
- the collector pause around a sync (``kproxy.gcpause``), so no backend touches the garbage collector itself.

What the records hold is read by ``describe`` and ``verify`` (``kproxy.readback``) from HTTP threads: each family's
record is changed under its own lock, in O(changes) per partial sync, and readers copy what they need under it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Generic

from kproxy.admission import UNLIMITED, Book
from kproxy.batch import A, Applied, Backend, Batch, C, Delta, F, Overlay, S, V
from kproxy.config import ProxyConfig
from kproxy.gcpause import collector_paused, trim_heap
from kproxy.model import Changes, FamilySync, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext, NodeContext, resolve
from kproxy.toolkit.mappings import dict_of, has_other_keys

log = logging.getLogger(__name__)

MAX_ROUNDS = 4  # applies per family per sync when the kernel refuses services one after another
#: A fault switch for tests and ``kproxy soak`` ("a failed kernel apply"): when this variable is set in the process's
#: environment at start, a positive integer N in ``$KPROXY_TEST_FAULTS_DIR/<node name>/fail-apply`` answers the next N
#: applies as failed (as a refused transaction would) and counts down. Read once, when the ledger is made.
FAULT_SWITCH = "KPROXY_TEST_FAULTS_DIR"

_BULK_SERVICES = 500  # dirty services above which a partial sync pauses the collector as a full one does

#: (service port, its wanted version or None: removed); a full batch's is the state's own items view (iterated twice,
#: no list of 100,000 tuples made: 6 MB at 100,000 service ports) unless the record holds others
Pairs = Collection[tuple[ServicePortName, ServicePort | None]]


@dataclass(slots=True)
class _Tally:
    """What one family's sync gathers over its refusal rounds, for its ``FamilySync``."""

    full: bool = False
    written: int = 0
    kernel_refusals: int = 0  # the backend's own count, summed over rounds
    refusal_rounds: int = 0  # rounds that ended in refused services (when the backend counts none itself)
    rules: Mapping[str, int] = field(default_factory=dict)
    rules_last: Mapping[str, int] = field(default_factory=dict)
    figures: Mapping[str, int] = field(default_factory=dict)
    need_full: bool = False
    error: str | None = None

    def absorb(self, outcome: Applied) -> None:
        self.kernel_refusals += outcome.kernel_refusals
        self.written += outcome.leftovers  # an earlier round's chunks may have removed some before a refusal
        if outcome.rules:
            self.rules = outcome.rules
        if outcome.rules_last:
            self.rules_last = outcome.rules_last
        if outcome.figures:
            self.figures = outcome.figures
        self.need_full = self.need_full or outcome.need_full

    def result(self, services: int) -> FamilySync:
        return FamilySync(
            full=self.full,
            written=self.written,
            services=services,
            kernel_refusals=self.kernel_refusals or self.refusal_rounds,
            rules=MappingProxyType(dict(self.rules)),
            rules_last=MappingProxyType(dict(self.rules_last)),
            figures=MappingProxyType(dict(self.figures)),
        )


@dataclass(slots=True)
class FamilyRecord(Generic[F, C]):
    """The ledger of one family: what the last successful batches left in the kernel. Changed only by the runner
    thread, under ``lock``; other threads read it under ``lock`` (``kproxy.readback``)."""

    context: C | None = None
    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    fragments: dict[ServicePortName, F] = field(default_factory=dict)
    failed: dict[ServicePortName, str] = field(default_factory=dict)
    need_full: bool = True  # first sync, or the last sync of this family failed
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: while a read-behind runs (``kproxy.readbehind``): per service a partial batch wrote or removed since it began,
    #: the fragments recorded before each of those changes, oldest first (None: there was none); None when no
    #: read-behind runs
    touched: dict[ServicePortName, list[F | None]] | None = None
    full_batches: int = 0  # successful full batches (a read-behind that overlaps one compares nothing)


@dataclass(slots=True)
class _Plan(Generic[F, C, A]):
    """One family's sync before its rounds: the context, the kind of batch, what adoption read, the pairs."""

    family: IPFamily
    context: C
    full: bool
    adopted: A | None
    pairs: Pairs
    memo: bool  # the applied fragments were rendered with this context: equal ServicePorts keep theirs


@dataclass(slots=True)
class _Rounds(Generic[F, S]):
    """What the refusal rounds of one family's sync carry from one round to the next."""

    rendered: dict[ServicePortName, F] = field(default_factory=dict)
    keep: set[ServicePortName] = field(default_factory=set)  # refused update: the fragment applied before stays
    skip: set[ServicePortName] = field(default_factory=set)  # refused, nothing acceptable before: left out
    names: set[ServicePortName] | None = None  # the plan's names, built at the first refusal
    scratch: S | None = None
    render_s: float = 0.0


class Ledger(Generic[F, C, A, V, S]):
    """The records of every family of one backend and the sync that drives it (see the module docstring)."""

    def __init__(self, backend: Backend[F, C, A, V, S], config: ProxyConfig) -> None:
        self.backend = backend
        self.config = config
        self.families: tuple[IPFamily, ...] = tuple(f for f in (IPFamily.V4, IPFamily.V6) if f in config.ip_families)
        self.records: dict[IPFamily, FamilyRecord[F, C]] = {f: FamilyRecord() for f in self.families}
        #: who holds which address, what fits (``kproxy.admission``): decided before anything is rendered
        self.books: dict[IPFamily, Book] = {f: Book() for f in self.families}
        self.generation = 0  # the state generation of the last sync
        self._checked_at: dict[IPFamily, float] = {}  # when ``needs_full`` was last asked, per family
        self._full_requested: set[IPFamily] = set()  # ``request_full``'s, taken by the family's next sync
        #: a read-behind (``kproxy.readbehind``) serves the backend's periodic read-back off the sync path; without
        #: one (tests, benchmarks), a due read-back makes the next batch a full one that adopts the kernel
        self.read_behind = False
        folder = os.environ.get(FAULT_SWITCH)
        self._fault_switch = Path(folder) / config.node_name / "fail-apply" if folder else None

    # -- the contract ------------------------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: Changes, node: NodeContext | None = None) -> SyncResult:
        """Sync every family, each on its own (as upstream runs one proxier per family): a family the kernel keeps
        refusing does not stop the other, and only the failed family needs a full sync next."""
        t0 = time.perf_counter()
        if node is None:  # tests and benchmarks: the daemon resolves it once per sync for everyone
            node = resolve(self.config, state.node, families=self.families)
        failed: dict[ServicePortName, str] = {}
        families: dict[IPFamily, FamilySync] = {}
        timings: dict[str, float] = {}
        errors: list[str] = []
        failed_families: set[IPFamily] = set()
        did_full = need_full = False
        # a full (or very large) sync allocates a few objects per service and per endpoint: the collector's walks of
        # the whole heap meanwhile find nothing to free; a small one only defers collections
        bulk = changes.full or len(changes.services) > _BULK_SERVICES or any(r.need_full for r in self.records.values())
        with collector_paused(True, light=not bulk):
            for fam in self.families:
                tally = self._sync_family(fam, state, changes, node.family(fam), failed, timings)
                families[fam] = tally.result(len(self.records[fam].fragments))
                did_full = did_full or tally.full
                need_full = need_full or tally.need_full
                if tally.error is not None:
                    errors.append(f"{fam.value}: {tally.error}")
                    failed_families.add(fam)
        if bulk:  # what it rendered and wrote is freed by now: its pages back to the OS (12 ms at 100,000 x 10)
            t1 = time.perf_counter()
            trim_heap()
            timings["trim"] = time.perf_counter() - t1
        self.generation = state.generation
        timings["total"] = time.perf_counter() - t0
        refused: dict[ServicePortName, str] = {}
        for fam in self.families:
            for spn, why in self.books[fam].refused.items():
                refused.setdefault(spn, f"{why.reason}: {why.message}")
        return SyncResult(
            refused=MappingProxyType(refused),
            ok=not errors,
            full=did_full,
            error="; ".join(errors) or None,
            failed=MappingProxyType(failed),
            families=MappingProxyType(families),
            timings=MappingProxyType(timings),
            need_full_sync=need_full,
            failed_families=frozenset(failed_families),
        )

    def forget(self) -> None:
        """Drop every record (after a cleanup): the next sync is a full one that rewrites everything."""
        for fam in self.families:
            with self.records[fam].lock:
                self.records[fam] = FamilyRecord()
            self.books[fam].forget()

    def request_full(self, family: IPFamily) -> None:
        """Ask for a full batch of ``family`` at its next sync. Any thread."""
        self._full_requested.add(family)

    def applied(self, family: IPFamily) -> tuple[C | None, dict[ServicePortName, F]]:
        """(context, fragments) the ledger records as in the kernel: a copy, consistent, any thread; the context is
        None before the first successful sync of ``family`` and after a failed one."""
        rec = self.records.get(family)
        if rec is None:
            return None, {}
        with rec.lock:
            return rec.context, dict(rec.fragments)

    def check_now(self, family: IPFamily) -> bool:
        """The cheap check (``needs_full``) of ``family`` now, between syncs (the drift watcher asks; runner thread
        only): True when it found this mode's state gone, and then ``family``'s next sync is a full batch.

        Also when a full batch is owed already after a failed sync: someone else's change inside a sync (a flushed
        table under a partial batch) fails that sync, and its retry would wait the retry interval; a state found
        gone is worth a run now. A failed sync whose state is still there is left to its retry (no loop of runs
        on a kernel that keeps refusing)."""
        rec = self.records.get(family)
        if rec is None:
            return False  # nothing applied yet
        self._checked_at[family] = time.monotonic()
        if not self.backend.needs_full(family):
            return False
        if not rec.need_full:
            self.request_full(family)
        return True

    # -- one family --------------------------------------------------------------------------------------------

    def _sync_family(
        self,
        fam: IPFamily,
        state: ProxyState,
        changes: Changes,
        node: FamilyContext,
        failed: dict[ServicePortName, str],
        timings: dict[str, float],
    ) -> _Tally:
        """One family's sync: its plan, its refusal rounds, the commit; what it did (``error`` set: it failed)."""
        r0, adopt_before = time.perf_counter(), timings.get("adopt", 0.0)
        plan = self._plan(fam, state, changes, node, timings)
        adopt_s = timings.get("adopt", 0.0) - adopt_before  # "render" is the ledger's own work: adoption apart
        rounds: _Rounds[F, S] = _Rounds(render_s=time.perf_counter() - r0 - adopt_s)
        tally = _Tally(full=plan.full)
        outcome = Applied()
        for attempt in range(MAX_ROUNDS):
            r1 = time.perf_counter()
            batch, ports = self._batch(plan, state, rounds, attempt)
            rounds.render_s += time.perf_counter() - r1
            outcome = self._apply(batch)
            tally.absorb(outcome)
            for k, v in outcome.timings.items():
                _add(timings, k, v)
            rounds.scratch = batch.scratch
            if outcome.ok and not outcome.refused:
                plan.adopted = batch.adopted = None  # what adoption read is done with: freed before the records grow
                self._commit(plan, batch, ports, rounds)
                tally.written += len(batch.deltas)  # services written or removed (0: nothing changed)
                break
            if not outcome.refused:
                tally.error = outcome.error or "apply failed"
                break
            tally.refusal_rounds += 1
            if not self._refused(plan, outcome.refused, rounds, failed):
                tally.error = outcome.error or "the kernel refused services that were already left out"
                break
        else:
            tally.error = f"still refused after {MAX_ROUNDS} rounds: {outcome.error or ''}".rstrip(": ")
        _add(timings, "render", rounds.render_s)
        if tally.error is not None:
            rec = self.records[fam]
            with rec.lock:
                rec.need_full = True
                rec.context = None  # unknown now: the next full sync adopts what the kernel holds
        return tally

    def _plan(
        self, fam: IPFamily, state: ProxyState, changes: Changes, node: FamilyContext, timings: dict[str, float]
    ) -> _Plan[F, C, A]:
        """The batch's kind (full or partial, after the cheap check if due), adoption, and the pairs it looks at."""
        rec = self.records[fam]
        ctx = self.backend.context(node, state)
        requested = fam in self._full_requested
        if requested:
            self._full_requested.discard(fam)
        full = changes.full or rec.need_full or ctx != rec.context or requested
        if full and not (changes.full or rec.need_full or requested) and rec.context is not None:
            log.info("%s: a full batch: this node's context changed (%s)", fam.value, _context_change(rec.context, ctx))
        elif full:
            why = "the cache's" if changes.full else "owed after a failure" if rec.need_full else "requested"
            log.debug("%s: a full batch (%s)", fam.value, why)
        # the cheap check runs before every full batch (a full batch re-establishes the truth: a backend that trusts
        # its memory of what it wrote there must hear first that the kernel lost it) and before a partial one when
        # due
        if full and rec.context is None:  # a first sync, or one after a failure: adoption reads the kernel anyway
            self._checked_at[fam] = time.monotonic()
        elif full or self._check_due(fam):
            self._checked_at[fam] = time.monotonic()
            c0 = time.perf_counter()
            gone = self.backend.needs_full(fam)
            if not full and (gone or (not self.read_behind and self.backend.readback_due(fam))):
                why = "its kernel state changed under it" if gone else "its periodic read-back is due"
                log.info("%s: the backend asks for a full batch (%s)", fam.value, why)
                full = True
            _add(timings, "check", time.perf_counter() - c0)
        services = state.family(fam)
        adopted: A | None = None
        if full:
            a0 = time.perf_counter()
            adopted = self.backend.adopt(fam, ctx)
            _add(timings, "adopt", time.perf_counter() - a0)
        # a full batch: every wanted service, then those the kernel holds and nobody wants (set operations on dict
        # keys reuse the stored hashes: a ServicePortName's own hash is a Python call)
        pairs: Pairs
        if full:
            pairs = services.items()
            if rec.fragments and has_other_keys(rec.fragments, services):
                pairs = [*pairs, *((spn, None) for spn in rec.fragments.keys() - services.keys())]
        else:
            pairs = [
                (spn, services.get(spn))
                for spn in changes.services
                if spn in services or spn in rec.fragments or spn in rec.failed
            ]
        plan: _Plan[F, C, A] = _Plan(
            fam, ctx, full, adopted, pairs, memo=rec.context is not None and ctx == rec.context
        )
        plan.pairs = self._admit(plan, node)
        return plan

    def _render(
        self,
        plan: _Plan[F, C, A],
        spn: ServicePortName,
        sp: ServicePort,
        rounds: _Rounds[F, S],
        old_sp: ServicePort | None,
        old_frag: F | None,
    ) -> F:
        """``sp``'s fragment: from this sync's earlier round, from the record (``old_sp``, ``old_frag``) when ``sp``
        and the context equal the applied ones (rendering is pure), else rendered. The first round keeps nothing
        here (``_batch`` keeps its ``wanted``: the same fragments), so a full sync looks each name up once less."""
        rendered = rounds.rendered
        if rendered:
            frag = rendered.get(spn)
            if frag is not None:
                return frag
        if plan.memo and old_frag is not None and old_sp is not None and (old_sp is sp or old_sp == sp):
            frag = old_frag
        else:
            frag = self.backend.render(sp, plan.context)
        if rendered:
            rendered[spn] = frag
        return frag

    def _batch(
        self, plan: _Plan[F, C, A], state: ProxyState, rounds: _Rounds[F, S], attempt: int
    ) -> tuple[Batch[F, C, A, S], dict[ServicePortName, ServicePort]]:
        """One round's batch, and the version each wanted fragment stands for."""
        rec = self.records[plan.family]
        full, adopted = plan.full, plan.adopted
        keep, skip = rounds.keep, rounds.skip
        deltas: list[Delta[F]] = []
        ports: dict[ServicePortName, ServicePort] = {}
        wanted: dict[ServicePortName, F] = {}  # full: everything wanted; partial: the changed services' fragments
        removed: set[ServicePortName] = set()  # partial: the services this batch takes out
        rec_services, rec_fragments = rec.services, rec.fragments
        has_old = bool(rec_services) or bool(rec_fragments)  # a first sync or a restart: nothing recorded
        unchanged = self.backend.adopted_unchanged
        pre: dict[ServicePortName, F] = {}
        if full and adopted is not None and attempt == 0:
            # every wanted service rendered before the first comparison with the adoption: a backend whose read of
            # the kernel goes on in the background meanwhile (nftables' element dumps) overlaps the two. The first
            # round keeps no rendered dict (see _render), so the fragments wait here for the loop below.
            for spn, sp in plan.pairs:
                if sp is not None and not (keep and spn in keep) and not (skip and spn in skip):
                    o_sp, o_frag = (rec_services.get(spn), rec_fragments.get(spn)) if has_old else (None, None)
                    pre[spn] = self._render(plan, spn, sp, rounds, o_sp, o_frag)
            wanted = pre  # this round wants exactly what it rendered: the loop below sets the same fragments again
        for spn, sp in plan.pairs:
            old_sp: ServicePort | None = None
            old_frag: F | None = None
            if has_old:
                old_sp, old_frag = rec_services.get(spn), rec_fragments.get(spn)
            new_sp: ServicePort | None
            new_frag: F | None
            if keep and spn in keep:
                new_sp, new_frag = old_sp, old_frag
            elif sp is None or (skip and spn in skip):
                new_sp, new_frag = None, None
            else:
                new_sp, new_frag = sp, pre.get(spn) if pre else None
                if new_frag is None:
                    new_frag = self._render(plan, spn, sp, rounds, old_sp, old_frag)
            if new_frag is None:
                if not full:
                    removed.add(spn)
            else:
                assert new_sp is not None
                wanted[spn] = new_frag
                ports[spn] = new_sp
                if adopted is not None and unchanged(adopted, spn, new_frag):
                    continue  # the kernel holds it exactly already: nothing to write
            if full and new_frag is None and old_frag is None and adopted is None:
                continue  # nothing there, nothing wanted
            deltas.append(Delta(spn, old_sp, old_frag, new_sp, new_frag))
        if attempt == 0:  # what a later round reuses: every fragment rendered (or kept from the record) in this one;
            # the dict itself, not a copy (5 MB at 100,000): a later round builds its own ``wanted``, and this round's
            # batch is done with before a later round adds to it
            rounds.rendered = wanted
        batch: Batch[F, C, A, S] = Batch(
            family=plan.family,
            full=full,
            context=plan.context,
            deltas=tuple(deltas),
            wanted=MappingProxyType(wanted) if full else Overlay(rec.fragments, wanted, removed),
            applied=MappingProxyType(rec.fragments),
            state=state,
            adopted=adopted,
            scratch=rounds.scratch,
        )
        return batch, ports

    def _apply(self, batch: Batch[F, C, A, S]) -> Applied:
        injected = self._injected_failure()
        if injected is not None:
            return injected
        try:
            return self.backend.apply(batch)
        except Exception as exc:  # a backend bug must not lose the ledger: the family fails, a full sync follows
            log.exception("%s: apply raised", batch.family.value)
            return Applied(ok=False, error=f"{type(exc).__name__}: {exc}")

    def _refused(
        self,
        plan: _Plan[F, C, A],
        refused: Mapping[ServicePortName, str],
        rounds: _Rounds[F, S],
        failed: dict[ServicePortName, str],
    ) -> bool:
        """Keep or leave out what the kernel refused for the next round; False when nothing new was refused."""
        rec = self.records[plan.family]
        progressed = False
        for spn, why in refused.items():
            if spn in rounds.skip:
                continue
            progressed = True
            if rounds.names is None:
                rounds.names = {n for n, _ in plan.pairs}
            if spn not in rounds.keep and spn in rec.fragments and spn in rounds.names:
                log.warning("the kernel refused the new version of %s (%s): keeping its old one", spn, why)
                rounds.keep.add(spn)
            else:
                log.warning("the kernel refused %s (%s): leaving it out", spn, why)
                rounds.keep.discard(spn)
                rounds.skip.add(spn)
            failed[spn] = why
            with rec.lock:
                rec.failed[spn] = why
        return progressed

    def _check_due(self, fam: IPFamily) -> bool:
        interval = self.backend.CHECK_INTERVAL_S
        if interval is None:
            interval = self.config.sync_period
        now = time.monotonic()
        if now - self._checked_at.get(fam, float("-inf")) < interval:
            return False
        self._checked_at[fam] = now
        return True

    def _admit(self, plan: _Plan[F, C, A], node: FamilyContext) -> Pairs:
        """The plan's pairs as the core admits them (``kproxy.admission``): addresses another service port holds
        taken out, what does not fit left out, and the service ports whose admitted version changed added."""
        book = self.books[plan.family]
        book.limits = self.backend.limits(plan.family)
        if book.limits != UNLIMITED:
            book.nodeport_addresses = len(node.nodeport_addresses)
        adopted = plan.adopted

        def holder(spn: ServicePortName, sp: ServicePort) -> bool:
            return adopted is not None and self.backend.adopted_unchanged(
                adopted, spn, self.backend.render(sp, plan.context)
            )

        pairs = plan.pairs
        decided = book.admit(pairs, adopted_holder=holder if plan.full else None)
        altered, admitted = book.altered, book.admitted
        out = pairs
        if altered:  # else nothing is refused or trimmed anywhere in this family: every pair stands as it is
            out = [(spn, admitted[spn] if spn in altered and sp is not None else sp) for spn, sp in pairs]
        if not plan.full:  # others that gained or lost a key or room (a full batch has every service port already)
            seen = {spn for spn, _ in pairs}
            out = [*out, *((spn, sp) for spn, sp in decided.items() if spn not in seen)]
        return out

    def _commit(
        self,
        plan: _Plan[F, C, A],
        batch: Batch[F, C, A, S],
        ports: dict[ServicePortName, ServicePort],
        rounds: _Rounds[F, S],
    ) -> None:
        """Record a successful batch: the kernel now holds ``batch.wanted`` (O(changes) for a partial batch)."""
        rec = self.records[plan.family]
        keep, skip = rounds.keep, rounds.skip
        with rec.lock:
            if plan.full:
                rec.full_batches += 1
                rec.services = ports  # the batch's own (``_batch`` made it): exactly ``wanted``'s keys, not copied
                rec.fragments = dict_of(batch.wanted)
                rec.failed = {spn: why for spn, why in rec.failed.items() if spn in keep or spn in skip}
            else:
                _commit_deltas(rec, batch.deltas, keep, skip)
            rec.context = plan.context
            rec.need_full = False

    def _injected_failure(self) -> Applied | None:
        """The test fault switch (``FAULT_SWITCH``): a failed apply when one is owed, else None."""
        switch = self._fault_switch
        if switch is None:
            return None
        try:
            owed = int(switch.read_text().strip() or 0)
        except (OSError, ValueError):
            return None
        if owed <= 0:
            return None
        switch.write_text(f"{owed - 1}\n")
        log.warning("fault switch %s: failing this apply (%d more owed)", switch, owed - 1)
        return Applied(ok=False, error="injected apply failure (test fault switch)")


def _commit_deltas(
    rec: FamilyRecord[F, C], deltas: Iterable[Delta[F]], keep: set[ServicePortName], skip: set[ServicePortName]
) -> None:
    touched = rec.touched
    for d in deltas:
        if d.name in keep:
            continue  # still the old version, reported in failed
        if touched is not None:
            touched.setdefault(d.name, []).append(rec.fragments.get(d.name))
        if d.new_fragment is None:
            rec.services.pop(d.name, None)
            rec.fragments.pop(d.name, None)
            if d.name not in skip:
                rec.failed.pop(d.name, None)
        else:
            assert d.new is not None
            rec.services[d.name] = d.new
            rec.fragments[d.name] = d.new_fragment
            rec.failed.pop(d.name, None)


def _add(timings: dict[str, float], key: str, seconds: float) -> None:
    timings[key] = timings.get(key, 0.0) + seconds


def _context_change(old: object, new: object) -> str:
    """The fields of two context values that differ, for the log (their names, or the types when not dataclasses)."""
    if dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new) and type(old) is type(new):
        names = [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]
        return ", ".join(names) or "equal fields"
    return f"{type(old).__name__} -> {type(new).__name__}"
