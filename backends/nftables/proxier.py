"""The nftables backend's Proxier: renders fragments with ``render``, applies one libnftables transaction per batch.

It syncs through the core's ledger (``kproxy.ledger.LedgerProxier``): the ledger hands ``apply`` the services that
changed with what the kernel holds for them; this module turns that into one atomic transaction per family and
keeps only what the ledger cannot know: which shared chains (``lb-i-3``), hairpin elements and context-set contents
the kernel holds. A partial sync writes element deletes and adds of the dirty services (plus a shared chain the
first time an endpoint count appears); a full sync also writes the fixed part where it is missing, reconciles the
context sets, shared chains and hairpin set, and removes services the kernel holds that are no longer wanted.

A refused transaction changes nothing (nft transactions are atomic); libnftables names the refused commands' lines,
which map back to the services that own them (``Applied.refused``), and the ledger retries without them. A refusal
no service owns fails the family (a full sync with adoption follows).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from prometheus_client import Counter as Counter_

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied
from kproxy.config import ProxyConfig
from kproxy.counters import CounterDump
from kproxy.drift import Drift
from kproxy.metrics import PREFIX
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nftkernel import Nft, available
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelHooks
from kproxy.toolkit import nft as nft_tools
from kproxy.toolkit.trace import traced
from kproxy.toolkit.verify import Findings

from . import adopt as adopt_mod
from . import cleanup as cleanup_mod
from . import counters as counters_mod
from . import kernel, layout, nlwrite, plan, render
from . import trace as trace_mod
from .kernel import TableView
from .localhost import LocalhostRelay
from .plan import Known, NftBatch, Scratch
from .render import Fragment

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # seconds between "is my table still there" checks at the start of partial syncs
LAST_TEXT_KEPT = 1 << 20  # characters: a longer last transaction (a full sync at scale) is not kept between syncs


class NftablesProxier(LedgerProxier[Fragment, FamilyContext, adopt_mod.Adopted, TableView, Scratch]):
    """kproxy's nftables layout (see the package docstring), applied through libnftables in-process."""

    mode: ClassVar[str] = "nftables"
    kernel_hooks: ClassVar[KernelHooks | None] = cleanup_mod  # remnants, kernel_view, cleanup_leftovers
    CHECK_INTERVAL_S: ClassVar[float | None] = CHECK_INTERVAL
    DRIFT: ClassVar[Drift | None] = Drift(frozenset({layout.TABLE}))  # its table announces every change
    uses_conntrack_nat: ClassVar[bool] = True
    counters_offered = counters_mod.OFFERED  # connections: nat chains never see a connection's later packets

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self._nft = nft_tools.OwnContext(netns)
        self._writer: nlwrite.Writer | None = None
        self._metrics: dict[str, Any] = {}
        self._kernel: dict[IPFamily, Known] = {f: Known() for f in self.families}
        self._last_text: dict[IPFamily, str] = {}  # the last transaction, when at most LAST_TEXT_KEPT long
        # the last partial batch's changes (service, old, new), for measure_partial_floor
        self._last_partial: dict[IPFamily, list[tuple[ServicePortName, Fragment | None, Fragment | None]]] = {}
        self._counts: dict[IPFamily, dict[str, int]] = {}  # the last apply's figures per family, for describe()
        self.localhost = LocalhostRelay(netns)  # localhost NodePorts (``localhost``): a thread only while serving
        self.localhost.engine.on_dead = lambda ident: self.request_full(IPFamily.V4)  # a full sync binds it anew
        self.counting = config.service_counters  # --service-counters: a counting element per endpoint (``counters``)
        self._counters = counters_mod.Reader(self)  # reads only when asked
        # families adopted once already: only the first adoption of a process (a restart) trusts the digests
        # (``adopt.Adopted.trusting``); every later full sync (drift, a failure, the periodic one) reads everything
        self._adopted_once: set[IPFamily] = set()

    # ------------------------------------------------------------------------------------------ hooks

    @classmethod
    def available(cls) -> Availability:
        why = available()
        return Availability(why is None, why or "")

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def nft(self) -> Nft:
        return self._nft.get()

    @property
    def writer(self) -> nlwrite.Writer:
        """The netlink writer of element-only transactions (``nlwrite``), on the current libnftables context."""
        nft = self.nft
        if self._writer is None or self._writer.nft is not nft:
            if self._writer is not None:
                self._writer.close()
            self._writer = nlwrite.Writer(nft)
        return self._writer

    def start(self) -> None:
        # the netlink rule reads (adoption, the check before partial syncs) import pyroute2's nftables part: ~0.1 s
        # once, paid here rather than inside the first sync that checks
        import pyroute2.nftables.main  # noqa: F401

    def close(self) -> None:
        self.localhost.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._nft.close()

    def cleanup(self) -> None:
        super().cleanup()
        self.localhost.close()
        self._kernel = {f: Known() for f in self.families}

    # ------------------------------------------------------------------------------------------ ledger methods

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        # rules match local addresses by kind (fib daddr type local): an address change rewrites nothing
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> Fragment:
        frag = render.render_service(sp, ctx)
        return counters_mod.with_counters(frag, sp) if self.counting else frag

    def counters(self, family: IPFamily) -> CounterDump | None:
        """New connections per service port and endpoint from the table's counting sets (``counters.py``); None
        when ``--service-counters`` is off."""
        return self._counters.read(family) if self.counting else None

    @property
    def counter_read_seconds(self) -> dict[str, float]:
        """Where the last ``counters()`` spent its time (``dump``, ``parse``, ``map``; kproxy.bench.counterread)."""
        return dict(self._counters.seconds)

    def adopt(self, family: IPFamily, ctx: FamilyContext) -> adopt_mod.Adopted | None:
        t0 = time.perf_counter()
        trust = family not in self._adopted_once
        self._adopted_once.add(family)
        chain = layout.layout_chain(family, self.counting)
        got, err = adopt_mod.read(self.nft, family, chain, self.counting, trust_digests=trust)
        if got is None:
            log.warning("%s: reading kproxy's nftables table failed (%s): it will be replaced", family.value, err)
            return None
        got.seconds = time.perf_counter() - t0
        return got

    def adopted_unchanged(self, adopted: adopt_mod.Adopted, name: ServicePortName, fragment: Fragment) -> bool:
        return isinstance(adopted, adopt_mod.Adopted) and adopted.layout_ok and adopted.unchanged(fragment)

    def needs_full(self, family: IPFamily) -> bool:
        # the fixed chains' rules, read by their comments over netlink (no set elements: ~2 ms): a deleted table
        # has none, and so has a flushed one (its chains, maps and elements stay, and nothing is reached)
        rules, _ = adopt_mod.read_rules(self.nft, family)
        problems = adopt_mod.fixed_problems(family, rules, self.counting) if rules is not None else ["unreadable"]
        if problems:
            log.warning(
                "%s: kproxy's nftables table was changed by someone else (%s): full resync",
                family.value,
                "; ".join(problems[:3]),
            )
            self._kernel[family] = Known()
            return True
        return False

    # ------------------------------------------------------------------------------------------ verify, metrics

    def verify_view(self, family: IPFamily, ctx: FamilyContext) -> TableView:
        return kernel.read_table(self.nft, family, self.counting)

    def verify_error(self, view: TableView) -> str | None:
        return view.error

    def verify_service(self, view: TableView, name: ServicePortName, fragment: Fragment) -> str | None:
        """Every element of the service in its map with its value (slots included), its own chains, its hairpin
        elements."""
        assert isinstance(view, TableView)
        f = Findings()
        for m, key, value in (*fragment.elements, (layout.SERVICE_DIGESTS, fragment.digest_key, "")):
            f.check(f"{m}: {key}", view.maps.get(m, {}).get(key), value)
        for chain, rules in fragment.chains:
            if chain not in view.chains:
                f.problems.append(f"chain {chain} missing")
            elif (kept := view.rules.get(chain, ())) != adopt_mod.tags(rules):
                f.problems.append(f"chain {chain}: {len(kept)} rules held, {len(rules)} wanted, or others")
            else:
                f.found += 1
        for chain in plan.with_deps(fragment.shared):
            if chain not in view.chains:
                f.problems.append(f"shared chain {chain} missing")
            elif not adopt_mod.shared_ok(chain, view.family, view.rules):
                f.problems.append(f"shared chain {chain}: its rules differ")
        f.problems += view.fixed  # every service goes through the fixed chains
        hairpin = view.maps.get(layout.HAIRPIN, {})
        f.problems += [f"{layout.HAIRPIN}: {key} missing" for key in fragment.hairpin if key not in hairpin]
        held = self.localhost.held.get(name) if view.family == IPFamily.V4 else None
        if held != fragment.localhost:  # the relay's, not the table's: a problem, never what makes it "found"
            f.problems.append(f"localhost NodePort listener is {held}, wanted {fragment.localhost}")
        return f.verdict()

    def verify_extra(self, view: TableView, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        """Elements of the service maps that no wanted service accounts for (the hairpin and context sets are
        shared and kept on purpose: not counted)."""
        assert isinstance(view, TableView)
        mine: dict[str, set[str]] = {}
        for frag in wanted.values():
            for m, key, _ in frag.elements:
                mine.setdefault(m, set()).add(key)
            mine.setdefault(layout.SERVICE_DIGESTS, set()).add(frag.digest_key)
        skip = {layout.HAIRPIN, *layout.CONTEXT_SETS}
        out: list[str] = []
        for m, elements in view.maps.items():
            if m in skip or m.startswith("aff-"):  # affinity sets: the kernel's own entries, with timeouts
                continue
            out += [f"{m}: {key}: an element no service accounts for" for key in elements if key not in mine.get(m, ())]
        return out

    def register_metrics(self, registry: Any, families: Sequence[IPFamily]) -> None:
        """Upstream's nftables-mode metrics (``pkg/proxy/metrics``: registered for this mode only). Stale chains go in
        the sync's own transaction here, so a failed cleanup is a failed sync: the cleanup counter stays at 0 and is
        kept for dashboards written for kube-proxy."""
        fam = ["ip_family"]
        self._metrics = {
            "sync": Counter_(
                PREFIX + "sync_proxy_rules_nftables_sync_failures",
                "Cumulative proxy nftables sync failures",
                fam,
                registry=registry,
            ),
            "cleanup": Counter_(
                PREFIX + "sync_proxy_rules_nftables_cleanup_failures",
                "Cumulative proxy nftables cleanup failures",
                fam,
                registry=registry,
            ),
        }
        for f in families:
            for counter in self._metrics.values():
                counter.labels(f.label)

    def observe_sync(self, family: IPFamily, result: SyncResult, *, full: bool, ok: bool) -> None:
        if not ok and self._metrics:
            self._metrics["sync"].labels(family.label).inc()

    def detail(self, name: ServicePortName, family: IPFamily, fragment: Fragment) -> dict[str, Any]:
        return {
            "table": f"{render.nft_family(family)} {layout.TABLE}",
            "elements": [f"{m}: {k}" + (f" : {v}" if v else "") for m, k, v in fragment.elements],
            "sharedChains": list(fragment.shared),
            "chains": {n: list(rules) for n, rules in fragment.chains},
            "sets": [n for n, _ in fragment.sets],
            "hairpin": list(fragment.hairpin),
            "digest": fragment.digest,
        }

    def detail_global(self) -> dict[str, Any]:
        counts = {fam.value: dict(c) for fam, c in list(self._counts.items())}
        relay = self.localhost.stats()
        return {"table": layout.TABLE, "layout": layout.LAYOUT, "counts": counts, "localhostNodePorts": relay}

    # ------------------------------------------------------------------------------------------ apply

    def apply(self, batch: NftBatch) -> Applied:
        """Make the kernel hold ``batch`` with the transactions ``plan`` makes (one for a partial batch; a full one
        in chunks of whole services when big), each applied while the next is built. Chunks that committed before a
        refusal are remembered in ``batch.scratch``, so the ledger's retry round starts from what the kernel holds."""
        fam = batch.family
        known = self._kernel[fam]
        r0 = time.perf_counter()
        first_round = batch.scratch is None
        if batch.full:
            if isinstance(batch.adopted, adopt_mod.Adopted):
                batch.adopted.ready()  # its services' read, if still running; a failed one replaces the table
                if batch.adopted.trusting and not plan.entries_needed(batch):
                    batch.adopted.settle()  # nothing changed or went: the entry maps' read is given up
            chunks = plan.full_chunks(batch, self.counting, netlink=True)
        else:
            if not known.known:
                return Applied(ok=False, error="kernel state unknown: a full sync must come first", need_full=True)
            chunks = iter([plan.partial(batch, known)])
        render_s = time.perf_counter() - r0
        stale_before = len(batch.scratch.stale_done) if batch.scratch is not None else 0
        out = kernel.apply_chunks(
            self.nft, chunks, lambda chunk: plan.commit(batch, known, chunk), LAST_TEXT_KEPT, self.writer
        )
        out.timings["render_apply"] += render_s
        if batch.full and first_round and isinstance(batch.adopted, adopt_mod.Adopted):
            # where adoption's read went (``adopt.read``), once per sync: the ledger adds up its rounds' timings
            out.timings.update({f"adopt_{k}": v for k, v in batch.adopted.parts.items()})
            out.figures.update({f"adopt_{k}": v for k, v in batch.adopted.counts.items()})
        figures, timings = out.figures, MappingProxyType(out.timings)
        # unwanted services the kernel held (``plan.remove_unwanted``) that this apply's committed chunks removed
        gone = len(batch.scratch.stale_done) - stale_before if batch.scratch is not None else 0
        if out.error is not None:
            chunk, res = out.error
            summary, refused = nft_tools.refused(res, chunk.tx.owner_of)
            if not refused:  # not a service's fault: read the kernel again at the full sync
                self._kernel[fam] = Known()
            figs = MappingProxyType(figures)
            return Applied(
                ok=False,
                refused=refused,
                error=summary,
                kernel_refusals=1,
                figures=figs,
                timings=timings,
                leftovers=gone,
            )
        kept = out.kept  # a partial batch's text too long to keep: its floor is not taken (nor would it be short)
        if not batch.full and kept is not None and not kernel.creates_objects(fam, kept):
            self._last_partial[fam] = [(d.name, d.old_fragment, d.new_fragment) for d in batch.deltas]
        else:
            self._last_partial.pop(fam, None)
        known.known = True
        self._last_text[fam] = kept if kept is not None else f"# not kept: over {LAST_TEXT_KEPT} characters\n"
        figures["shared_chains"] = len(known.shared)
        self._counts[fam] = figures
        if fam == IPFamily.V4:
            self._relay(batch)
        return Applied(ok=True, figures=MappingProxyType(figures), timings=timings, leftovers=gone)

    def _relay(self, batch: NftBatch) -> None:
        """The localhost NodePorts' listeners follow the batch the kernel just took: a full one sets exactly the
        wanted ones, a partial one changes the dirty services' (``localhost``)."""
        if batch.full:
            want = {n: f.localhost for n, f in batch.wanted.items() if f.localhost is not None}
            self.localhost.apply(want, full=True)
        else:
            changes = {d.name: d.new_fragment.localhost if d.new_fragment else None for d in batch.deltas}
            self.localhost.apply(changes, full=False)

    # ------------------------------------------------------------------------------------------ tools

    def last_transaction(self, family: IPFamily) -> str:
        """The text of the last committed transaction of a family (tests assert on what was written); one longer
        than LAST_TEXT_KEPT (a full sync at scale) is a comment saying so."""
        return self._last_text.get(family, "")

    def fresh_transaction(self, family: IPFamily) -> str:
        """The transaction that would build the table as the ledger records it from nothing, as a full sync into an
        empty namespace writes it (``plan.fresh_text``); "" before the first successful sync."""
        context, fragments = self.applied(family)
        if context is None:
            return ""
        return plan.fresh_text(family, context, fragments, self.counting)

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any]:
        """Where a new connection's first packet would go through what was last applied (see ``trace.py``)."""
        return traced(self.applied, trace_mod.trace, src, proto, dst, dport, src_local=src_local, dst_local=dst_local)

    def measure_partial_floor(self) -> dict[str, float] | None:
        """The kernel's own time to take the last partial sync's element changes again, sent as the sync sent them
        (``kernel.partial_floor``). Benchmarks only. None when the last batch of every family
        created or removed chains (not replayable)."""
        if not self._last_partial:
            return None
        seconds = kernel.partial_floor(self.nft, self._last_partial, self.writer)
        if seconds is None:
            for fam in self._last_partial:
                self._kernel[fam] = Known()  # the replay may have left the change half undone
            return None
        return {"floor_s": seconds}

    def measure_floor(self, scratch: str) -> float | None:
        """Seconds the kernel takes for the transactions that build the table as it is now from nothing, sent as a
        full sync into an empty namespace sends them (``plan.fresh_chunks``, ``kernel.netlink_floor``), into the
        bench's empty namespace ``scratch``."""
        chunks = []
        for fam in self.families:
            context, fragments = self.applied(fam)
            if context is not None:
                chunks.append(plan.fresh_chunks(fam, context, fragments, self.counting))
        return kernel.netlink_floor(scratch, itertools.chain.from_iterable(chunks)) if chunks else None
