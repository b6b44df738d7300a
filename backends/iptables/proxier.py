"""The iptables backend's Proxier: the ledger's hooks over ``render``, applied with ``iptables-restore --noflush``.

The core's ledger (``kproxy.ledger``) keeps what is programmed, turns each sync into per-service deltas, runs the
refusal rounds (a refused service keeps its old rules, or is left out) and syncs each family on its own. This module
supplies one round of it for iptables (``apply``): the payloads (one per family, several on the nf_tables flavour
when a change is big, see ``render.build_restores``), and which service a refused payload line belongs to.

Partial batches (upstream's KEP-3453) write only the dirty services' own chains and rewrite a shared chain
(KUBE-SERVICES ...) only when a dirty service's lines in it changed, which the fragments the ledger keeps make cheap
to decide. Full batches (first sync, periodically, a missing canary, after a failure) read the nat table once
(``adopt``: ``iptables-save -t nat``): services whose chains the kernel holds exactly get no delta (``adopt.py``),
the shared chains are rewritten, missing jumps from the built-in chains are inserted and stale service chains
deleted, but no table is ever flushed, so a restarted kproxy converges without disturbing established connections.

Within one sync, rounds after a refusal rewrite the services an earlier (committed) payload of that sync wrote and
the shared chains it changed, because a refused payload's earlier tables (filter before nat) and earlier chunks have
committed; a refused stale-chain deletion (another program's chain still jumps to it) is retried without deletions.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from prometheus_client import Counter, Gauge

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.counters import CounterDump
from kproxy.drift import Drift
from kproxy.metrics import PREFIX
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelHooks, Option
from kproxy.toolkit.trace import traced

from . import adopt, kernel, layout, render
from . import cleanup as cleanup_mod
from . import counters as counters_mod
from . import trace as trace_mod
from .adopt import Adoption, KernelRules
from .kernel import FLAVOURS, TABLES, Kernel, binary, detect_flavour, missing_binaries
from .render import Context, Fragment, JumpRule, Restore

log = logging.getLogger(__name__)

MAX_DELETION_RETRIES = 1  # a refused stale-chain deletion: one more try without deletions, within the same round
CHUNK_LINES = 3000  # lines per payload on the nf_tables flavour (see render.build_restores)
# Upstream's monitor polls mangle (small, cheap). The nf_tables flavour looks one chain up by name, so nat (the table
# a flush hurts) is cheap to check too; the legacy flavour reads a whole table per check (1 s for nat at 10k services).
CANARY_TABLES = {"nft": ("mangle", "nat"), "legacy": ("mangle",)}


@dataclass(slots=True)
class _Written:
    """What the last successful batch of one family wrote (tests, ``/rules`` counts, the floor measurements)."""

    payloads: list[str] = field(default_factory=list)
    was_full: bool = True
    rules: dict[str, int] = field(default_factory=dict)
    # what the last full batch wanted: the payloads that write it all into an empty table (measure_floor)
    full: tuple[Context, dict[ServicePortName, Fragment]] | None = None


@dataclass(slots=True)
class _Scratch:
    """What the refusal rounds of one family's sync carry."""

    written: set[ServicePortName] = field(default_factory=set)  # in a payload of this sync that committed
    created: set[str] = field(default_factory=set)  # chains this sync's payloads declared
    tops: set[str] = field(default_factory=set)  # shared chains earlier rounds wrote
    jumps: list[JumpRule] | None = None  # the jump rules still to insert
    keep_stale: bool = False  # a stale-chain deletion was refused: keep them this sync


@dataclass(slots=True)
class _Plan:
    """One round's decisions (``IptablesProxier._plan``), kept across its tries."""

    write: list[ServicePortName] | None  # services whose own chains are written (None: all)
    top: set[str] | None  # shared chains to rewrite (None: all)
    stale: set[str]  # chains to delete
    kernel_rules: int  # rules already in the kernel (the chunk size follows)
    jumps: list[JumpRule] = field(default_factory=list)
    chunk: int | None = None
    names: list[ServicePortName] = field(default_factory=list)
    stream: bool = False
    refusals: int = 0  # restores the kernel refused in this apply
    rules_written: dict[str, int] = field(default_factory=lambda: {"filter": 0, "nat": 0})


def leftovers(stale: Iterable[str], batch: IptBatch) -> int:
    """Service ports a full sync removed that nothing wants and no delta names (``Applied.leftovers``): the port
    hashes of the deleted chains of a service port (``KUBE-SVC-<hash>``, its SVL, EXT, FW and XLB chains), less the
    deltas'. A service port without endpoints has no chain of its own: its rules in the shared chains go unseen."""
    named = {render.port_proto_hash(name) for name in batch.written}
    ports = {c.split("-", 2)[2] for c in stale if c.startswith(layout.PORT_CHAIN_PREFIXES)}
    return len(ports - named)


@dataclass(slots=True)
class _Round:
    """One try of a round: the payloads applied, and the refused one (``error`` None: all applied)."""

    payloads: list[str] = field(default_factory=list)
    error: str | None = None
    refused: Restore | None = None
    bad: ServicePortName | None = None
    line: int = 0


IptBatch = Batch[Fragment, Context, Adoption, _Scratch]


class IptablesProxier(LedgerProxier[Fragment, Context, Adoption, KernelRules, _Scratch]):
    """Upstream kube-proxy's iptables layout, applied through iptables-restore (nf_tables or legacy flavour)."""

    mode: ClassVar[str] = "iptables"
    kernel_hooks: ClassVar[KernelHooks | None] = cleanup_mod  # remnants, kernel_view, cleanup_leftovers
    CHECK_INTERVAL_S: ClassVar[float | None] = None  # the canary, once per sync period (as upstream)
    # iptables-nft's tables announce their changes (shared tables: the KUBE- chains are this mode's)
    DRIFT: ClassVar[Drift | None] = Drift(frozenset(TABLES), chains=("KUBE-",))
    counters_offered = counters_mod.OFFERED  # connections: a nat rule never sees a connection's later packets
    options: ClassVar[tuple[Option, ...]] = (
        Option(
            "iptables_flavour",
            str,
            "auto",
            "iptables binaries: auto (what the node already uses, as iptables-wrapper decides), nft, legacy",
            ("auto", *FLAVOURS),
        ),
    )

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self.flavour_option = str(config.backend_options.get("iptables_flavour") or "auto")
        if self.flavour_option not in ("auto", *FLAVOURS):
            raise ValueError(f"--iptables-flavour {self.flavour_option!r}: choose auto, nft or legacy")
        self._kernel: Kernel | None = None
        self._written: dict[IPFamily, _Written] = {f: _Written() for f in self.families}
        self._canary_s: dict[IPFamily, float] = {}  # seconds the last check of a family took (0.0: skipped)
        self._counts: dict[tuple[int, int, IPFamily], int] = {}
        self._metrics: dict[str, Any] = {}
        self._counters = counters_mod.Reader(self)  # --service-counters: reads only when asked

    # ------------------------------------------------------------------------------------------ hooks

    @classmethod
    def available(cls) -> Availability:
        missing = missing_binaries(("nft",))
        if missing and missing_binaries(("legacy",)):
            return Availability(False, f"{missing[0]} not found: apt-get install iptables")
        for fam in (IPFamily.V4, IPFamily.V6):
            name = binary("restore", fam, "nft" if not missing else "legacy")
            try:
                proc = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=10, check=False)
            except OSError as exc:
                return Availability(False, f"{name} not usable: {exc}")
            if proc.returncode != 0:
                return Availability(False, f"{name} --version failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return Availability(True)

    def register_metrics(self, registry: Any, families: Sequence[IPFamily]) -> None:
        """Upstream's iptables-mode metrics (``pkg/proxy/metrics``: registered for this mode only)."""
        fam = ["ip_family"]
        self._metrics = {
            "total": Gauge(
                PREFIX + "sync_proxy_rules_iptables_total",
                "Total number of iptables rules owned by kube-proxy",
                ["ip_family", "table"],
                registry=registry,
            ),
            "last": Gauge(
                PREFIX + "sync_proxy_rules_iptables_last",
                "Number of iptables rules written by kube-proxy in last sync",
                ["ip_family", "table"],
                registry=registry,
            ),
            "failures": Counter(
                PREFIX + "sync_proxy_rules_iptables_restore_failures",
                "Cumulative proxy iptables restore failures",
                fam,
                registry=registry,
            ),
            "partial_failures": Counter(
                PREFIX + "sync_proxy_rules_iptables_partial_restore_failures",
                "Cumulative proxy iptables partial restore failures",
                fam,
                registry=registry,
            ),
        }
        for f in families:
            self._metrics["failures"].labels(f.label)
            self._metrics["partial_failures"].labels(f.label)

    def observe_sync(self, family: IPFamily, result: SyncResult, *, full: bool, ok: bool) -> None:
        """Rule gauges from the family's ``rules``/``rules_last``; every refused restore counted as a restore failure
        (the partial ones apart as well, as upstream), also in a sync that recovered by skipping services. A failed
        family that names no refusal failed before any restore was refused: one failure."""
        if not self._metrics:
            return
        label = family.label
        done = result.families.get(family)
        if done is not None:
            for table, n in done.rules.items():
                self._metrics["total"].labels(label, table).set(n)
            for table, n in done.rules_last.items():
                self._metrics["last"].labels(label, table).set(n)
        default = 0 if ok or result.failed_families else 1
        times = done.kernel_refusals if done is not None and done.kernel_refusals else default
        if times > 0:
            self._metrics["failures"].labels(label).inc(times)
            if not full:
                self._metrics["partial_failures"].labels(label).inc(times)

    def counters(self, family: IPFamily) -> CounterDump | None:
        """New connections per service port and endpoint from the nat table's DNAT rule counters (``counters.py``);
        no packets or bytes: a connection's later packets never reach a nat rule."""
        return self._counters.read(family) if self.config.service_counters else None

    # ------------------------------------------------------------------------------------------ the kernel

    @property
    def kernel(self) -> Kernel:
        if self._kernel is None:
            flavour = self.flavour_option
            if flavour == "auto":
                flavour = detect_flavour(self.netns)
            self._kernel = Kernel(flavour, self.netns)
            log.info("iptables flavour: %s", flavour)
        return self._kernel

    def drift(self) -> Drift | None:
        """Legacy tables announce nothing: the canary is polled every second instead."""
        return Drift(poll_s=1.0) if self.kernel.flavour == "legacy" else self.DRIFT

    def last_payloads(self, family: IPFamily) -> list[str]:
        """The restore payloads the last sync wrote for a family (tests assert on what was written)."""
        return list(self._written[family].payloads)

    def canary_present(self) -> bool:
        k = self.kernel
        return all(
            k.chain_exists(fam, table, render.KUBE_PROXY_CANARY)
            for fam in self.families
            for table in CANARY_TABLES[k.flavour]
        )

    # ------------------------------------------------------------------------------------------ the ledger's hooks

    def context(self, node: FamilyContext, state: ProxyState) -> Context:
        large = self._endpoint_count(state, node.family) > render.LARGE_CLUSTER_ENDPOINTS
        return render.context_for(node, self.config.masquerade_mark, large_cluster=large)

    def render(self, sp: ServicePort, ctx: Context) -> Fragment:
        return render.render_service(sp, ctx)

    def needs_full(self, family: IPFamily) -> bool:
        """The canary (asked once per sync period: ``CHECK_INTERVAL_S``, upstream's monitor's interval)."""
        k = self.kernel
        c0 = time.perf_counter()
        present = all(k.chain_exists(family, table, render.KUBE_PROXY_CANARY) for table in CANARY_TABLES[k.flavour])
        self._canary_s[family] = time.perf_counter() - c0
        if present:
            return False
        log.warning("%s KUBE-PROXY-CANARY is gone (someone flushed iptables): full resync", family.value)
        return True

    def adopt(self, family: IPFamily, ctx: Context) -> Adoption:
        return kernel.read_adoption(self.kernel, family)

    def adopted_unchanged(self, adopted: Adoption, name: ServicePortName, fragment: Fragment) -> bool:
        return bool(adopted.chains) and adopt.unchanged(fragment, adopted.chains)

    def apply(self, batch: IptBatch) -> Applied:
        """One round for one family: the payloads for ``batch``, applied in order; the first refused line's service
        is reported refused (the ledger retries without it). A refused stale-chain deletion is retried once without
        deletions, within the round."""
        if batch.scratch is None:
            batch.scratch = _Scratch()
            if batch.full and batch.context.localhost_nodeports:
                kernel.ensure_route_localnet(self.kernel.netns)
        frags = dict(batch.wanted)
        timings = {"build": 0.0, "apply": 0.0, "save": 0.0, "canary": self._canary_s.pop(batch.family, 0.0)}
        plan = self._plan(batch, frags)
        if isinstance(plan, Applied):
            return plan
        for _try in range(MAX_DELETION_RETRIES + 1):
            done = self._round(batch, plan, frags, timings)
            if done.error is None:
                out = self._applied(batch, frags, done.payloads, plan.rules_written, plan.refusals, timings)
                return replace(out, leftovers=leftovers(plan.stale, batch)) if batch.full else out
            failed = self._after_refusal(batch, plan, done, timings)
            if failed is not None:
                return failed
        return Applied(
            ok=False, error="a stale-chain deletion was refused again", kernel_refusals=plan.refusals, timings=timings
        )

    def _plan(self, batch: IptBatch, frags: dict[ServicePortName, Fragment]) -> _Plan | Applied:
        """What the round writes: the services whose chains are written (None: all), the shared chains (None: all),
        the stale chains to delete, the jumps to insert, the payload size."""
        sc = batch.scratch
        assert sc is not None
        if batch.full:
            adoption = batch.adopted or Adoption()
            if adoption.error:
                return Applied(ok=False, error=adoption.error)
            if sc.jumps is None:
                jumps = batch.context.jump_rules
                sc.jumps = [j for j in jumps if f"{j.table}/-A {j.chain} {j.spec}" not in adoption.jumps]
            # services an earlier round committed differ from the adoption read: they are written again
            write: list[ServicePortName] | None = [
                *batch.written,
                *(spn for spn in sc.written if spn in frags and spn not in batch.written),
            ]
            if not adoption.chains:
                write = None  # nothing of ours in the kernel: everything
            wanted_chains = {c for f in frags.values() for c in f.chains}
            stale = {c for c in set(adoption.chains) | sc.created if c not in wanted_chains}
            plan = _Plan(write, None, stale, adoption.rules)
        else:
            if sc.jumps is None:
                sc.jumps = []
            updates = {d.name: d.new_fragment for d in batch.deltas}
            top = render.changed_top_chains(batch.applied, updates) | sc.tops
            old = {c for d in batch.deltas if d.old_fragment is not None for c in d.old_fragment.chains}
            wanted_chains = {c for spn in updates if spn in frags for c in frags[spn].chains}
            kernel_rules = sum(len(f.rules) for f in batch.applied.values())
            write = [spn for spn, f in updates.items() if f is not None]
            plan = _Plan(write, top, (old | sc.created) - wanted_chains, kernel_rules)
        plan.jumps = sc.jumps or []
        plan.chunk = _chunk_lines(plan.kernel_rules) if self.kernel.flavour == "nft" else None
        plan.names = list(frags) if plan.write is None else plan.write
        # a big full sync on nf_tables streams its chunks (see render.stream_restores)
        size = 3 * (len(frags) + self._endpoint_count(batch.state, batch.family))
        plan.stream = batch.full and plan.chunk is not None and size > 2 * plan.chunk
        return plan

    def _restores(self, batch: IptBatch, plan: _Plan, frags: dict[ServicePortName, Fragment]) -> Iterable[Restore]:
        if plan.stream:
            # a big full sync: whole services per chunk, the shared chains last, as each chunk is built (the same
            # payloads as build_restores makes for a change bigger than a chunk)
            writing = set(plan.names)
            return render.stream_restores(
                batch.context,
                ((spn, f, spn in writing) for spn, f in frags.items()),
                top=plan.top,
                delete_chains=lambda gone=plan.stale: gone,  # type: ignore[misc]
                jump_rules=plan.jumps,
                canary=True,
                chunk_lines=plan.chunk or 0,
            )
        return render.build_restores(
            batch.context,
            frags,
            write=plan.write,
            top=plan.top,
            delete_chains=plan.stale,
            jump_rules=plan.jumps,
            canary=batch.full,
            chunk_lines=plan.chunk,
        )

    def _round(
        self, batch: IptBatch, plan: _Plan, frags: dict[ServicePortName, Fragment], timings: dict[str, float]
    ) -> _Round:
        """The payloads of one try, applied until the first refusal."""
        sc = batch.scratch
        assert sc is not None
        if sc.keep_stale:
            plan.stale = set()
        b0 = time.perf_counter()
        sc.created.update(c for spn in plan.names for c in frags[spn].chains)
        restores = self._restores(batch, plan, frags)
        timings["build"] += time.perf_counter() - b0
        done = _Round()
        for restore, res, building in kernel.apply_overlapped(self.kernel, batch.family, restores):
            timings["build"] += building
            timings["apply"] += res.seconds
            done.payloads.append(restore.text)
            if res.ok:
                for t, n in restore.rules.items():
                    plan.rules_written[t] += n
                sc.written.update(spn for _, _, spn in restore.owners)
                continue
            done.error = kernel.summarise(res.stderr, restore.text)
            plan.refusals += 1
            m = kernel.LINE.search(res.stderr)
            done.line = int(m.group(1)) if m else 0
            done.bad = restore.owner_of(done.line) if done.line else None
            done.refused = restore
            break
        return done

    def _after_refusal(self, batch: IptBatch, plan: _Plan, done: _Round, timings: dict[str, float]) -> Applied | None:
        """What a refused payload means: a service to report, a stale-chain deletion to retry without (None: try
        again), or a failed family."""
        fam, sc, error = batch.family, batch.scratch, done.error or ""
        assert sc is not None
        self._written[fam].payloads, self._written[fam].was_full = done.payloads, batch.full
        deletion_refused = (
            done.bad is None
            and not sc.keep_stale
            and done.refused is not None
            and kernel.deletes_at(done.refused.text, done.line)
        )
        if (deletion_refused or done.bad is not None) and any(j.table == "filter" for j in plan.jumps):
            # the refused payload's filter part (with its jumps) may have committed before its nat part was
            # refused: insert only what is still missing (nat, always last, never committed)
            s0 = time.perf_counter()
            plan.jumps, err = self._without_present_filter_jumps(fam, plan.jumps)
            timings["save"] += time.perf_counter() - s0
            sc.jumps = plan.jumps
            if err:
                return Applied(ok=False, error=f"{error}; then {err}", kernel_refusals=plan.refusals, timings=timings)
        if plan.top is not None:
            sc.tops.update(plan.top)
        if deletion_refused:
            # no service's line: most likely a chain deletion, refused because another program's chain still
            # jumps to it (a pre-1.24 KUBE-XLB- chain is swept, others are not ours); without this the same
            # payload would be refused at every sync and the family never programmed again
            log.warning("iptables-restore refused the payload (%s): retrying without deleting stale chains", error)
            sc.keep_stale = True
            if batch.full and plan.write is not None:
                plan.write = [
                    *plan.write,
                    *(spn for spn in sc.written if spn in batch.wanted and spn not in plan.write),
                ]
                plan.names = plan.write
            return None
        if done.bad is None:
            return Applied(ok=False, error=error, kernel_refusals=plan.refusals, timings=timings)
        refused = MappingProxyType({done.bad: error})
        return Applied(ok=False, refused=refused, error=error, kernel_refusals=plan.refusals, timings=timings)

    def _applied(
        self,
        batch: IptBatch,
        frags: dict[ServicePortName, Fragment],
        payloads: list[str],
        rules_written: dict[str, int],
        refusals: int,
        timings: dict[str, float],
    ) -> Applied:
        fam = batch.family
        w = self._written[fam]
        w.payloads, w.was_full, w.rules = payloads, batch.full, rules_written
        if batch.full:
            w.full = (batch.context, frags)
        totals = render.total_rules(batch.context, frags)
        tables = ("filter", "nat")
        return Applied(
            ok=True,
            kernel_refusals=refusals,
            rules=MappingProxyType({t: totals[t] for t in tables}),
            rules_last=MappingProxyType({t: rules_written[t] for t in tables}),
            timings=timings,
        )

    # ------------------------------------------------------------------------------------------ verify

    def verify_view(self, family: IPFamily, ctx: Context) -> KernelRules:
        return kernel.read_rules(self.kernel, family, ctx)

    def verify_error(self, view: KernelRules) -> str | None:
        return view.error

    def verify_service(self, view: KernelRules, name: ServicePortName, fragment: Fragment) -> str | None:
        return adopt.verify_service(view, fragment)

    def verify_extra(self, view: KernelRules, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        return adopt.verify_extra(view, wanted)

    # ------------------------------------------------------------------------------------------ describe, trace

    def detail(self, name: ServicePortName, family: IPFamily, fragment: Fragment) -> dict[str, Any]:
        rules = {k: list(lines) for k, lines in fragment.top.items()}
        rules["nat/own"] = list(fragment.rules)
        return {"chains": list(fragment.chains), "rules": rules}

    def detail_global(self) -> dict[str, Any]:
        counts = {f"{fam.value}/{t}/last": n for fam, w in self._written.items() for t, n in w.rules.items()}
        return {"flavour": self._kernel.flavour if self._kernel else None, "counts": counts}

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any]:
        """Where a new connection's first packet would go through the rules last applied (see ``trace.py``)."""
        return traced(self.applied, trace_mod.trace, src, proto, dst, dport, src_local=src_local, dst_local=dst_local)

    # ------------------------------------------------------------------------------------------ bench

    def measure_floor(self, scratch: str) -> float | None:
        """Seconds ``iptables-restore`` (same flavour, same flags) takes for the last full sync's exact payloads in
        the bench's empty namespace ``scratch``."""
        flavour = self.kernel.flavour
        chunk = _chunk_lines(0) if flavour == "nft" else None
        payloads = {
            fam: [
                r.text
                for r in render.build_restores(
                    w.full[0],
                    w.full[1],
                    write=None,
                    top=None,
                    jump_rules=w.full[0].jump_rules,
                    canary=True,
                    chunk_lines=chunk,
                )
                if r.text
            ]
            for fam, w in self._written.items()
            if w.full is not None
        }
        if not payloads:
            return None
        return kernel.timed_restores(kernel.Kernel(flavour, scratch), payloads, "floor restore")

    def measure_partial_floor(self) -> dict[str, float] | None:
        """Replay the last partial sync's payloads with ``iptables-restore`` (same flavour, same flags) into the table
        as it is now, without their ``-X`` lines (those chains are gone already): the same chain flushes and rule
        additions, so ``floor_s`` is what the kernel and the restore tool alone take for that change.

        On the nf_tables flavour it then measures the same replay once more with the jumps from the built-in chains
        into kproxy's chains deleted (``unhooked_s``, ``kernel.unhooked_floor``): nf_tables validates every rule
        reachable from a base chain on each commit that adds a rule (``nf_tables_validate`` at commit), so the gap
        between the two is that walk over the whole service table, which no payload shape avoids. Benchmarks only:
        the node's services are unhooked for the moment it takes."""
        if self._kernel is None:
            return None
        k = self._kernel
        payloads = {
            fam: [kernel.replayable(t) for t in w.payloads] for fam, w in self._written.items() if not w.was_full
        }
        payloads = {fam: [t for t in texts if t] for fam, texts in payloads.items()}
        payloads = {fam: texts for fam, texts in payloads.items() if texts}
        if not payloads:
            return None
        floor = kernel.timed_restores(k, payloads, "partial floor replay")
        if floor is None:
            return None
        out = {"floor_s": floor}
        if k.flavour == "nft":
            unhooked, lost = kernel.unhooked_floor(k, payloads)
            if unhooked is not None:
                out["unhooked_s"] = unhooked
            for fam in lost:  # the next full sync inserts missing jumps anyway
                self.request_full(fam)
        return out

    # ------------------------------------------------------------------------------------------ helpers

    def _endpoint_count(self, state: ProxyState, fam: IPFamily) -> int:
        """Upstream's largeClusterMode input, per family as upstream's per-family proxier counts it: the endpoints of
        each of the family's service ports (cluster and local ones, each counted once), cached per state."""
        key = (id(state), state.generation, fam)
        count = self._counts.get(key)
        if count is None:
            count = 0
            for sp in state.family(fam).values():
                if not sp.local_endpoints:
                    count += len(sp.cluster_endpoints)
                elif not sp.cluster_endpoints:
                    count += len(sp.local_endpoints)
                else:
                    count += len({str(e) for e in sp.cluster_endpoints} | {str(e) for e in sp.local_endpoints})
            self._counts = {k: v for k, v in self._counts.items() if k[:2] == key[:2]}
            self._counts[key] = count
        return count

    def _without_present_filter_jumps(self, fam: IPFamily, jumps: list[JumpRule]) -> tuple[list[JumpRule], str | None]:
        """``jumps`` without the filter ones the kernel holds now."""
        present, err = kernel.filter_builtin_rules(self.kernel, fam)
        if err:
            return jumps, err
        return [j for j in jumps if j.table != "filter" or f"filter/-A {j.chain} {j.spec}" not in present], None


def _chunk_lines(kernel_rules: int) -> int:
    """Lines per nf_tables payload. Each payload pays a fixed cost F that grows with the rules already in the table
    (iptables-nft fetches them all) plus a cost quadratic in its own size (a per line squared); their sum over a
    change of L lines, L x (F/c + a x c), is least at c = sqrt(F/a), and F/a is about 250 per rule in the table
    (docs/PERFORMANCE.md, iptables mode)."""
    return max(CHUNK_LINES, min(4 * CHUNK_LINES, int((250 * kernel_rules) ** 0.5)))
