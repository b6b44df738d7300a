"""What is programmed, kept by the core: the ledger every backend syncs through.

A backend knows how to turn one ``ServicePort`` into kernel state and how to apply a batch of such changes. Everything
around that is the same for every mode and lives here, once, tested once (with ``kproxy.fake.FakeProxier``):

- per IP family, each service's last-applied ``ServicePort`` and the backend's *fragment* for it (whatever the backend
  renders one service to: chain text, map elements, BPF map entries, a socket spec), the services the kernel refused
  (kept on their old version or left out, with the reason), and whether a full sync is owed;
- turning ``sync(state, changes)`` into ``Delta`` values (service, old port + old fragment, new port + new fragment)
  and handing them to ``apply`` in a ``Batch``: partial batches hold the dirty services only; full batches (first
  sync, after a failure, a changed node context, periodically, or when the backend says its state vanished) hold
  every service whose fragment differs from what the kernel holds, which the backend's ``adopt`` reads once, so a
  restart with nothing changed writes nothing;
- the refusal rounds: a service the kernel refuses is retried without it, up to ``MAX_ROUNDS`` times: it keeps its
  previously applied fragment if it had one (as upstream, whose failed restore leaves every old rule in place), else
  it is left out (treated as absent: no reject rule either), and it is reported in ``SyncResult.failed`` (the cache
  keeps it dirty, so the next sync retries it);
- the published snapshot behind ``describe()``: replaced whole after every sync, read without any lock, so ``/rules``
  answers at once while a long full sync runs.

What a ledger-driven backend implements (``LedgerProxier``'s abstract methods): ``context``, ``render``, ``apply``;
optionally ``adopt`` with ``adopted_unchanged``, ``needs_full``, ``detail`` and ``detail_global``. Threads: every one
of them but ``detail``/``detail_global`` runs in the runner thread, inside ``sync``; those two run in HTTP threads on
the published snapshot's fragments and must be pure.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

from kproxy.admission import UNLIMITED, Book, Limits
from kproxy.config import ProxyConfig
from kproxy.gcpause import collector_paused
from kproxy.model import Changes, FamilySync, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext, NodeContext, resolve
from kproxy.proxier import Description, Proxier, ServiceDescription

log = logging.getLogger(__name__)

MAX_ROUNDS = 4  # applies per family per sync when the kernel refuses services one after another
#: A fault switch for tests and ``kproxy soak`` ("a failed kernel apply"): with this variable set, a positive integer N
#: in ``$KPROXY_TEST_FAULTS_DIR/<node name>/fail-apply`` answers the next N applies as failed (as a refused
#: transaction would) and counts down. Unset (production), it costs one environment lookup per apply.
FAULT_SWITCH = "KPROXY_TEST_FAULTS_DIR"

_BULK_SERVICES = 500  # dirty services above which a partial sync pauses the collector as a full one does

F = TypeVar("F")  # a backend's fragment: what one service port renders to (compared with ==)
C = TypeVar("C")  # a backend's per-family rendering context (hashable; compared with ==)


@dataclass(frozen=True, slots=True)
class Delta(Generic[F]):
    """One service port's change in one family. ``old_fragment`` is what the kernel holds (None: nothing, or unknown
    on a full batch without adoption); ``new_fragment`` None means remove it."""

    name: ServicePortName
    old: ServicePort | None
    old_fragment: F | None
    new: ServicePort | None
    new_fragment: F | None

    @property
    def removed(self) -> bool:
        return self.new_fragment is None


@dataclass(slots=True)
class Batch(Generic[F, C]):
    """What ``apply`` must make true in one family. ``full``: the kernel must hold exactly ``wanted`` (ensure the
    base objects, write ``deltas``, remove anything of the mode's that ``wanted`` lacks); otherwise only ``deltas``.
    ``applied`` is what the ledger records as in the kernel before this batch; ``adopted`` what ``adopt`` read (full
    batches only, may be None). ``scratch`` is the backend's own memory across the refusal rounds of this family's
    sync (what an earlier, partly committed round wrote)."""

    family: IPFamily
    full: bool
    context: C
    deltas: tuple[Delta[F], ...]
    wanted: Mapping[ServicePortName, F]
    applied: Mapping[ServicePortName, F]
    state: ProxyState
    adopted: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def written(self) -> tuple[ServicePortName, ...]:
        """The services this batch (re)writes (not removals)."""
        return tuple(d.name for d in self.deltas if d.new_fragment is not None)


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply`` reports. ``refused``: services the kernel refused (the rest of the batch may or may not have
    been applied: the ledger retries with those services kept on their old fragment or left out); ``error`` with
    ``ok`` False and nothing refused: the family failed as a whole (a full sync follows). ``kernel_refusals``: kernel
    transactions refused in this apply (also ones the backend retried itself); ``rules``/``rules_last``/``figures``
    as ``FamilySync``'s (the last apply's stand); ``timings`` (seconds per phase) feed metrics; ``need_full`` asks for
    a full sync soon."""

    ok: bool = True
    refused: Mapping[ServicePortName, str] = field(default_factory=lambda: MappingProxyType({}))
    error: str | None = None
    kernel_refusals: int = 0
    rules: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rules_last: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    figures: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    timings: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    need_full: bool = False


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
    """The ledger of one family: what the last successful batches left in the kernel."""

    context: C | None = None
    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    fragments: dict[ServicePortName, F] = field(default_factory=dict)
    failed: dict[ServicePortName, str] = field(default_factory=dict)
    need_full: bool = True  # first sync, or the last sync of this family failed


@dataclass(frozen=True, slots=True)
class Published(Generic[F]):
    """An immutable view of one family's record, swapped in whole after each sync (``describe`` reads it).
    ``refused``: what the core's admission refused (``kproxy.admission``), as ``reason: message``."""

    services: Mapping[ServicePortName, ServicePort]
    fragments: Mapping[ServicePortName, F]
    failed: Mapping[ServicePortName, str]
    refused: Mapping[ServicePortName, str] = field(default_factory=lambda: MappingProxyType({}))
    context: Any = None  # the rendering context the fragments were applied with (None: nothing applied yet)


def _empty_published() -> Published[Any]:
    return Published(MappingProxyType({}), MappingProxyType({}), MappingProxyType({}))


def describe_port(
    sp: ServicePort | None, applied: bool, failed: str | None, refused: str | None = None
) -> ServiceDescription:
    """The common part of ``describe()`` for one service port of one family."""
    if sp is None:
        return {"applied": applied, "failed": failed or refused, "refused": refused}
    return {
        "clusterIP": sp.cluster_ip,
        "port": sp.port,
        "nodePort": sp.node_port,
        "externalIPs": list(sp.external_ips),
        "loadBalancerIPs": list(sp.load_balancer_ips),
        "loadBalancerSourceRanges": list(sp.load_balancer_source_ranges),
        "sessionAffinitySeconds": sp.affinity_timeout,
        "internalTrafficPolicyLocal": sp.internal_policy_local,
        "externalTrafficPolicyLocal": sp.external_policy_local,
        "internal": sp.internal_verdict.value,
        "external": sp.external_verdict.value,
        "internalEndpoints": [str(e) for e in sp.internal_endpoints],
        "externalEndpoints": [str(e) for e in sp.external_endpoints],
        "applied": applied,
        "failed": failed or refused,
        "refused": refused,
    }


def service_key(spn: ServicePortName) -> str:
    """The key of a service port in ``describe()`` and ``kernel_view()``: ``ns/name[:port]/PROTO``."""
    return f"{spn}/{spn.protocol.value}"


class LedgerProxier(Proxier, Generic[F, C]):
    """A backend that syncs through the ledger: implement ``context``, ``render`` and ``apply`` (and the optional
    methods below); ``sync``, ``describe`` and the refusal rounds come from here."""

    #: seconds between the ledger's calls of ``needs_full`` per family (the cheap "is my state still there" check,
    #: before each sync once due); None: the sync period, as upstream polls its canary chain
    CHECK_INTERVAL_S: ClassVar[float | None] = 1.0

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self.families: tuple[IPFamily, ...] = tuple(f for f in (IPFamily.V4, IPFamily.V6) if f in config.ip_families)
        self.records: dict[IPFamily, FamilyRecord[F, C]] = {f: FamilyRecord() for f in self.families}
        #: who holds which address, what fits (``kproxy.admission``): decided before anything is rendered
        self.books: dict[IPFamily, Book] = {f: Book() for f in self.families}
        self._published: dict[IPFamily, Published[F]] = {f: _empty_published() for f in self.families}
        self._published_generation = 0
        self._checked_at: dict[IPFamily, float] = {}  # when ``needs_full`` was last asked, per family
        self._full_requested: set[IPFamily] = set()  # ``request_full``'s, taken by the family's next sync

    # -- what a backend implements -----------------------------------------------------------------------------

    def context(self, node: FamilyContext, state: ProxyState) -> C:
        """The family's rendering context (hashable); when it differs from the last applied one, the ledger does a
        full batch (every fragment may differ)."""
        raise NotImplementedError(f"{type(self).__name__} must implement 'context(node, state)'")

    def render(self, sp: ServicePort, ctx: C) -> F:
        """One service port's fragment (pure: no kernel, no shared state; tests assert on it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement 'render(sp, ctx)'")

    def apply(self, batch: Batch[F, C]) -> Applied:
        """Make the kernel hold what ``batch`` says (see ``Batch``); report refused services or an error."""
        raise NotImplementedError(f"{type(self).__name__} must implement 'apply(batch)'")

    def adopt(self, family: IPFamily, ctx: C) -> Any:
        """What the kernel holds now for this mode (read once per full batch), or None when unknown; services it
        already holds exactly (``adopted_unchanged``) get no delta. Default: None (full batches rewrite all)."""
        return None

    def adopted_unchanged(self, adopted: Any, name: ServicePortName, fragment: F) -> bool:
        """Whether ``adopted`` (from ``adopt``) holds ``fragment`` for ``name`` exactly."""
        get = getattr(adopted, "get", None)
        return get is not None and get(name) == fragment

    def limits(self, family: IPFamily) -> Limits:
        """What this mode can hold in one family (id widths, map sizes, port ranges); the core refuses the service
        ports that do not fit, before rendering them. Default: no limit."""
        return UNLIMITED

    def needs_full(self, family: IPFamily) -> bool:
        """A cheap check before a sync, asked at most every ``CHECK_INTERVAL_S`` per family (the ledger keeps the
        time): True when this mode's state vanished from the kernel (someone flushed it; say so in the log) or a
        read-back is due, so this family gets a full batch that repairs it."""
        return False

    def verify_view(self, family: IPFamily, ctx: C) -> Any:
        """What the kernel holds, read now, for ``verify`` (default: ``adopt``); None when the mode cannot read it."""
        return self.adopt(family, ctx)

    def verify_service(self, view: Any, name: ServicePortName, fragment: F) -> str | None:
        """None when ``view`` holds ``fragment`` exactly; else ``missing`` (nothing of the service) or ``different``
        with what differs."""
        if self.adopted_unchanged(view, name, fragment):
            return None
        get = getattr(view, "get", None)
        return "missing" if get is not None and get(name) is None else "different"

    def verify_extra(self, view: Any, wanted: Mapping[ServicePortName, F]) -> list[str]:
        """What ``view`` holds that no wanted fragment accounts for (a service that should be gone, a stray
        object), one line each."""
        keys = getattr(view, "keys", None)
        return [f"{k}: not wanted" for k in keys() if k not in wanted] if keys is not None else []

    def detail(self, name: ServicePortName, family: IPFamily, fragment: F) -> dict[str, Any]:
        """The backend's own detail of one applied service (chains, elements, ...), for ``describe()`` (pure)."""
        return {}

    def detail_global(self) -> dict[str, Any]:
        """The backend's own global detail for ``describe()`` (counts, flavour, ...); any thread, no lock."""
        return {}

    # -- the contract ------------------------------------------------------------------------------------------

    def sync(self, state: ProxyState, changes: Changes, node: NodeContext | None = None) -> SyncResult:
        """Sync every family through the ledger, each on its own (as upstream runs one proxier per family): a family
        the kernel keeps refusing does not stop the other, and only the failed family needs a full sync next."""
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
        # the whole heap meanwhile find nothing to free (0.17 s of a 0.86 s full sync at 10,000 x 10, bpf); a small
        # one only defers collections, so none of the whole heap lands inside it (the lab's scale-smoke judges every
        # sync's duration)
        bulk = (
            changes.full
            or len(changes.services) > _BULK_SERVICES
            or any(self.records[f].need_full for f in self.families)
        )
        with collector_paused(True, light=not bulk):
            for fam in self.families:
                tally = self._sync_family(fam, state, changes, node.family(fam), failed, timings)
                families[fam] = tally.result(len(self.records[fam].fragments))
                did_full = did_full or tally.full
                need_full = need_full or tally.need_full
                if tally.error is not None:
                    errors.append(f"{fam.value}: {tally.error}")
                    failed_families.add(fam)
        self._published_generation = state.generation
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
        """Drop every record (after ``cleanup``): the next sync is a full one that rewrites everything."""
        for fam in self.families:
            self.records[fam] = FamilyRecord()
            self._published[fam] = _empty_published()
            self.books[fam].forget()

    def cleanup(self) -> None:
        super().cleanup()
        self.forget()

    def applied_fragments(self, family: IPFamily) -> Mapping[ServicePortName, F]:
        """The fragments the ledger records as in the kernel (the published snapshot; any thread)."""
        return self._published[family].fragments

    def applied(self, family: IPFamily) -> tuple[C | None, Mapping[ServicePortName, F]]:
        """(context, fragments) of what the ledger records as in the kernel, from one published snapshot (any
        thread: what ``trace`` explains); the context is None before the first successful sync of ``family``."""
        pub = self._published.get(family) or _empty_published()
        return pub.context, pub.fragments

    def request_full(self, family: IPFamily) -> None:
        """Ask for a full batch of ``family`` at its next sync (the backend lost track of the kernel, or its data path
        saw its state go). Any thread: the request is taken at the start of that family's next sync."""
        self._full_requested.add(family)

    def check_now(self, family: IPFamily) -> bool:
        """The cheap check (``needs_full``) of ``family`` now, between syncs (the drift watcher asks; runner thread
        only): True when it found this mode's state gone, and then ``family``'s next sync is a full batch."""
        rec = self.records.get(family)
        if rec is None or rec.need_full:
            return False  # nothing applied yet, or a full batch is owed already
        self._checked_at[family] = time.monotonic()
        if not self.needs_full(family):
            return False
        self.request_full(family)
        return True

    def describe(self, key: ServicePortName | None = None) -> Description:
        """The published snapshot's common part, with the backend's detail beside it; never waits for a sync."""
        services: dict[str, dict[str, ServiceDescription]] = {}
        detail: dict[str, dict[str, Any]] = {}
        for fam in self.families:
            pub = self._published[fam]  # one reference read: a consistent view even while a sync runs
            names: Iterable[ServicePortName]
            if key is not None:
                names = [key] if key in pub.services or key in pub.failed or key in pub.refused else []
            else:
                names = sorted(set(pub.services) | set(pub.failed) | set(pub.refused))
            for spn in names:
                frag = pub.fragments.get(spn)
                k = service_key(spn)
                services.setdefault(k, {})[fam.value] = describe_port(
                    pub.services.get(spn), frag is not None, pub.failed.get(spn), pub.refused.get(spn)
                )
                if frag is not None:
                    detail.setdefault(k, {})[fam.value] = self.detail(spn, fam, frag)
        return {
            "mode": self.mode,
            "generation": self._published_generation,
            "services": services,
            "detail": {"services": detail, **self.detail_global()},
        }

    def verify(self, state: ProxyState, node: NodeContext | None = None) -> dict[str, Any]:
        """Read back what the kernel holds (``verify_view``: never the ledger's memory) and diff it against what
        ``state`` wants, per service: ``missing``, ``different`` (with what), and ``extra`` objects no wanted service
        accounts for. Services the kernel refused (the ledger knows why) are listed apart under ``refused``: known,
        reported in metrics, not drift. ``drift`` counts the rest. Read-only; any thread (the reads race a sync in
        progress, so a caller that must be exact runs it between syncs)."""
        node = node or resolve(self.config, state.node, families=self.families)
        drifted: dict[str, dict[str, str]] = {}
        refused: dict[str, dict[str, str]] = {}
        extra: list[str] = []
        errors: list[str] = []
        for fam in self.families:
            ctx = self.context(node.family(fam), state)
            try:
                view = self.verify_view(fam, ctx)
            except Exception as exc:
                errors.append(f"{fam.value}: reading the kernel failed: {type(exc).__name__}: {exc}")
                continue
            if view is None or getattr(view, "error", None):
                errors.append(f"{fam.value}: cannot read back the kernel state: {getattr(view, 'error', '')}")
                continue
            failed = self._published[fam].failed
            book = self.books[fam]
            wanted: dict[ServicePortName, F] = {}
            for spn, wanted_sp in state.family(fam).items():
                sp = book.admitted[spn] if spn in book.altered else wanted_sp
                if sp is None:
                    continue  # refused by the core (reported in ``/rules``): nothing of it is wanted in the kernel
                frag = wanted[spn] = self.render(sp, ctx)
                why = self.verify_service(view, spn, frag)
                if why is None:
                    continue
                if spn in failed:
                    refused.setdefault(service_key(spn), {})[fam.value] = f"{why} (refused: {failed[spn]})"
                else:
                    drifted.setdefault(service_key(spn), {})[fam.value] = why
            extra.extend(f"{fam.value}: {line}" for line in self.verify_extra(view, wanted))
        return {
            "mode": self.mode,
            "generation": state.generation,
            "drift": len(drifted) + len(extra) + len(errors),
            "services": drifted,
            "extra": extra,
            "refused": refused,
            "errors": errors,
        }

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
        """One family's sync: its batch, its refusal rounds, the commit; what it did (``error`` set: it failed)."""
        rec = self.records[fam]
        r0 = time.perf_counter()
        ctx = self.context(node, state)
        requested = fam in self._full_requested
        if requested:
            self._full_requested.discard(fam)
        full = changes.full or rec.need_full or ctx != rec.context or requested
        if full:  # a full batch repairs whatever the check would find: it counts as one
            self._checked_at[fam] = time.monotonic()
        elif self._check_due(fam):
            c0 = time.perf_counter()
            if self.needs_full(fam):
                log.info("%s: the backend asks for a full batch (its kernel state changed under it)", fam.value)
                full = True
            _add(timings, "check", time.perf_counter() - c0)
        services = state.family(fam)
        adopted: Any = None
        if full:
            a0 = time.perf_counter()
            adopted = self.adopt(fam, ctx)
            adopt_s = time.perf_counter() - a0
            _add(timings, "adopt", adopt_s)
            r0 += adopt_s  # "render" is the ledger's own work: adoption is timed apart
        # (name, wanted version or None) of every service this batch looks at; a full batch: every wanted service,
        # then those the kernel holds and nobody wants (set operations on dict keys reuse the stored hashes: a
        # ServicePortName's own hash is a Python call, and a full sync at 10,000 services made ~20 per service)
        pairs: list[tuple[ServicePortName, ServicePort | None]]
        if full:
            pairs = list(services.items())
            if rec.fragments:
                pairs += [(spn, None) for spn in rec.fragments.keys() - services.keys()]
        else:
            pairs = [
                (spn, services.get(spn))
                for spn in changes.services
                if spn in services or spn in rec.fragments or spn in rec.failed
            ]
        pairs = self._admit(fam, pairs, node, ctx, full, adopted)
        names: set[ServicePortName] | None = None  # the names of ``pairs``, built at the first refusal
        rendered: dict[ServicePortName, F] = {}
        keep: set[ServicePortName] = set()  # refused update: the fragment applied before stays
        skip: set[ServicePortName] = set()  # refused and nothing (acceptable) before: left out, treated as absent
        tally = _Tally(full=full)
        scratch: dict[str, Any] = {}
        render_s = time.perf_counter() - r0
        for attempt in range(MAX_ROUNDS):
            r1 = time.perf_counter()
            deltas: list[Delta[F]] = []
            ports: dict[ServicePortName, ServicePort] = {}  # the version each wanted fragment stands for
            wanted: dict[ServicePortName, F] = {} if full else dict(rec.fragments)
            rec_services, rec_fragments = rec.services, rec.fragments
            has_old = bool(rec_services) or bool(rec_fragments)  # a first sync or a restart: nothing recorded
            check_adopted = full and adopted is not None
            for spn, sp in pairs:
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
                    new_sp = sp
                    new_frag = rendered.get(spn) if attempt else None
                    if new_frag is None:
                        new_frag = rendered[spn] = self.render(sp, ctx)
                if new_frag is None:
                    if not full:
                        wanted.pop(spn, None)
                else:
                    assert new_sp is not None
                    wanted[spn] = new_frag
                    ports[spn] = new_sp
                    if check_adopted and self.adopted_unchanged(adopted, spn, new_frag):
                        continue  # the kernel holds it exactly already: nothing to write
                if full and new_frag is None and old_frag is None and adopted is None:
                    continue  # nothing there, nothing wanted
                deltas.append(Delta(spn, old_sp, old_frag, new_sp, new_frag))
            render_s += time.perf_counter() - r1
            batch: Batch[F, C] = Batch(
                family=fam,
                full=full,
                context=ctx,
                deltas=tuple(deltas),
                wanted=MappingProxyType(wanted),
                applied=MappingProxyType(rec.fragments),
                state=state,
                adopted=adopted,
                scratch=scratch,
            )
            try:
                outcome = _injected_failure(self.config.node_name) or self.apply(batch)
            except Exception as exc:  # a backend bug must not lose the ledger: the family fails, a full sync follows
                log.exception("%s: apply raised", fam.value)
                outcome = Applied(ok=False, error=f"{type(exc).__name__}: {exc}")
            tally.absorb(outcome)
            for k, v in outcome.timings.items():
                _add(timings, k, v)
            if outcome.ok and not outcome.refused:
                self._commit(rec, fam, ctx, full, deltas, ports, wanted, keep, skip)
                tally.written = len(deltas)  # services written or removed (0: nothing changed)
                tally.error = None
                break
            if not outcome.refused:
                tally.error = outcome.error or "apply failed"
                break
            tally.refusal_rounds += 1
            progressed = False
            for spn, why in outcome.refused.items():
                if spn in skip:
                    continue
                progressed = True
                if names is None:
                    names = {n for n, _ in pairs}
                if spn not in keep and spn in rec.fragments and spn in names:
                    log.warning("the kernel refused the new version of %s (%s): keeping its old one", spn, why)
                    keep.add(spn)
                else:
                    log.warning("the kernel refused %s (%s): leaving it out", spn, why)
                    keep.discard(spn)
                    skip.add(spn)
                failed[spn] = why
                rec.failed[spn] = why
            if not progressed:
                tally.error = outcome.error or "the kernel refused services that were already left out"
                break
        else:
            tally.error = f"still refused after {MAX_ROUNDS} rounds: {outcome.error or ''}".rstrip(": ")
        _add(timings, "render", render_s)
        if tally.error is not None:
            rec.need_full = True
            rec.context = None  # unknown now: the next full sync adopts what the kernel holds
            self._publish(fam)
        return tally

    def _check_due(self, fam: IPFamily) -> bool:
        interval = self.CHECK_INTERVAL_S if self.CHECK_INTERVAL_S is not None else self.config.sync_period
        now = time.monotonic()
        if now - self._checked_at.get(fam, float("-inf")) < interval:
            return False
        self._checked_at[fam] = now
        return True

    def _admit(
        self,
        fam: IPFamily,
        pairs: list[tuple[ServicePortName, ServicePort | None]],
        node: FamilyContext,
        ctx: C,
        full: bool,
        adopted: Any,
    ) -> list[tuple[ServicePortName, ServicePort | None]]:
        """``pairs`` as the core admits them (``kproxy.admission``): addresses another service port holds taken out,
        what does not fit left out, and the service ports whose admitted version changed because of these added."""
        book = self.books[fam]
        book.limits = self.limits(fam)
        if book.limits != UNLIMITED:
            book.nodeport_addresses = len(node.nodeport_addresses)

        def holder(spn: ServicePortName, sp: ServicePort) -> bool:
            return adopted is not None and self.adopted_unchanged(adopted, spn, self.render(sp, ctx))

        decided = book.admit(pairs, adopted_holder=holder if full else None)
        altered, admitted = book.altered, book.admitted
        out = pairs
        if altered:  # else nothing is refused or trimmed anywhere in this family: every pair stands as it is
            out = [(spn, admitted[spn] if spn in altered and sp is not None else sp) for spn, sp in pairs]
        if not full:  # others that gained or lost a key or room (a full batch has every service port already)
            seen = {spn for spn, _ in pairs}
            out = out + [(spn, sp) for spn, sp in decided.items() if spn not in seen]
        return out

    def _commit(
        self,
        rec: FamilyRecord[F, C],
        fam: IPFamily,
        ctx: C,
        full: bool,
        deltas: list[Delta[F]],
        ports: Mapping[ServicePortName, ServicePort],
        wanted: Mapping[ServicePortName, F],
        keep: set[ServicePortName],
        skip: set[ServicePortName],
    ) -> None:
        """Record a successful batch: the kernel now holds ``wanted``."""
        if full:
            rec.services = dict(ports)  # a full batch's ``ports`` has exactly ``wanted``'s keys
            rec.fragments = dict(wanted)
            rec.failed = {spn: why for spn, why in rec.failed.items() if spn in keep or spn in skip}
        else:
            for d in deltas:
                if d.name in keep:
                    continue  # still the old version, reported in failed
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
        rec.context = ctx
        rec.need_full = False
        self._publish(fam)

    def _publish(self, fam: IPFamily) -> None:
        rec = self.records[fam]
        self._published[fam] = Published(
            MappingProxyType(dict(rec.services)),
            MappingProxyType(dict(rec.fragments)),
            MappingProxyType(dict(rec.failed)),
            MappingProxyType({spn: f"{r.reason}: {r.message}" for spn, r in self.books[fam].refused.items()}),
            rec.context,
        )


def _injected_failure(node: str) -> Applied | None:
    """The test fault switch (``FAULT_SWITCH``): a failed apply when one is owed, else None."""
    folder = os.environ.get(FAULT_SWITCH)
    if not folder:
        return None
    switch = Path(folder) / node / "fail-apply"
    try:
        owed = int(switch.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if owed <= 0:
        return None
    switch.write_text(f"{owed - 1}\n")
    log.warning("fault switch %s: failing this apply (%d more owed)", switch, owed - 1)
    return Applied(ok=False, error="injected apply failure (test fault switch)")


def _add(timings: dict[str, float], key: str, seconds: float) -> None:
    timings[key] = timings.get(key, 0.0) + seconds
