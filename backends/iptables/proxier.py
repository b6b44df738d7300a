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

import collections
import logging
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from kproxy.proxier import Availability, BackendError, KernelProbe, Option
from kproxy.toolkit.trace import traced
from kproxy.toolkit.verify import Findings

from . import adopt, render
from . import cleanup as cleanup_mod
from . import counters as counters_mod
from . import trace as trace_mod
from .kernel import FLAVOURS, TABLES, Kernel, Run, binary, detect_flavour, missing_binaries
from .render import Context, Fragment, JumpRule, Restore

log = logging.getLogger(__name__)

MAX_DELETION_RETRIES = 1  # a refused stale-chain deletion: one more try without deletions, within the same round
CHUNK_LINES = 3000  # lines per payload on the nf_tables flavour (see render.build_restores)
# Upstream's monitor polls mangle (small, cheap). The nf_tables flavour looks one chain up by name, so nat (the table
# a flush hurts) is cheap to check too; the legacy flavour reads a whole table per check (1 s for nat at 10k services).
CANARY_TABLES = {"nft": ("mangle", "nat"), "legacy": ("mangle",)}
_LINE = re.compile(r"line:? (\d+)")


@dataclass(slots=True)
class Adoption:
    """What a full batch read from the kernel before writing: the nat table's service chains (canonical rules), the
    jump rules present in the built-in chains ("table/-A CHAIN spec"), how many nat rules there are; or the error."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    jumps: set[str] = field(default_factory=set)
    rules: int = 0
    error: str | None = None


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


IptBatch = Batch[Fragment, Context, Adoption, _Scratch]


class IptablesProxier(LedgerProxier[Fragment, Context, Adoption, "_KernelRules", _Scratch]):
    """Upstream kube-proxy's iptables layout, applied through iptables-restore (nf_tables or legacy flavour)."""

    mode: ClassVar[str] = "iptables"
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

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Every chain and jump of this mode, both flavours, both families (``cleanup.cleanup_leftovers``)."""
        cleanup_mod.cleanup_leftovers(netns)

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        found: list[str] = _inspect().remnants(probe)
        return found

    @classmethod
    def kernel_view(cls, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
        view: dict[str, list[str]] = _inspect().kernel_view(probe, family)
        return view

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
        return counters_mod.read(self, family) if self.config.service_counters else None

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
        """The nat table's service chains (canonical, for adoption), the jumps present in the built-in chains and
        the nat table's rule count, read once per full batch."""
        kernel = self.kernel
        # the nat jumps come with the nat table's save (on the legacy flavour every -S reads the whole table, 1 s for
        # nat at 10,000 services)
        jumps, err = self._filter_builtin_rules(family)
        if err:
            return Adoption(error=err)
        res = kernel.save(family, "nat")
        if not res.ok:
            return Adoption(error=f"{binary('save', family, kernel.flavour)} -t nat: {res.stderr.strip()}")
        builtin = ("-A PREROUTING ", "-A OUTPUT ", "-A POSTROUTING ")
        jumps.update(f"nat/{line}" for line in res.stdout.splitlines() if line.startswith(builtin))
        return Adoption(adopt.kernel_service_chains(res.stdout), jumps, res.stdout.count("\n-A "))

    def adopted_unchanged(self, adopted: Adoption, name: ServicePortName, fragment: Fragment) -> bool:
        return bool(adopted.chains) and adopt.unchanged(fragment, adopted.chains)

    def apply(self, batch: IptBatch) -> Applied:
        """One round for one family: the payloads for ``batch``, applied in order; the first refused line's service
        is reported refused (the ledger retries without it)."""
        if batch.scratch is None:
            batch.scratch = _Scratch()
        fam, ctx, sc = batch.family, batch.context, batch.scratch
        kernel = self.kernel
        timings = {"build": 0.0, "apply": 0.0, "save": 0.0, "canary": self._canary_s.pop(fam, 0.0)}
        refusals = 0  # restores the kernel refused in this apply
        frags = dict(batch.wanted)
        written, created, tops_tried = sc.written, sc.created, sc.tops
        if batch.full:
            adoption = batch.adopted or Adoption()
            if adoption.error:
                return Applied(ok=False, error=adoption.error)
            if sc.jumps is None:
                sc.jumps = [j for j in render.JUMP_RULES if f"{j.table}/-A {j.chain} {j.spec}" not in adoption.jumps]
            # services an earlier round committed differ from the adoption read: they are written again
            write: list[ServicePortName] | None = [
                *batch.written,
                *(spn for spn in written if spn in frags and spn not in batch.written),
            ]
            if not adoption.chains:
                write = None  # nothing of ours in the kernel: everything
            top: set[str] | None = None
            wanted_chains = {c for f in frags.values() for c in f.chains}
            stale = {c for c in set(adoption.chains) | created if c not in wanted_chains}
            kernel_rules = adoption.rules
        else:
            if sc.jumps is None:
                sc.jumps = []
            updates = {d.name: d.new_fragment for d in batch.deltas}
            write = [spn for spn, f in updates.items() if f is not None]
            top = render.changed_top_chains(batch.applied, updates) | tops_tried
            old = {c for d in batch.deltas if d.old_fragment is not None for c in d.old_fragment.chains}
            wanted_chains = {c for spn in updates if spn in frags for c in frags[spn].chains}
            stale = (old | created) - wanted_chains
            kernel_rules = sum(len(f.rules) for f in batch.applied.values())
        jumps: list[JumpRule] = sc.jumps or []
        chunk = _chunk_lines(kernel_rules) if kernel.flavour == "nft" else None
        names = list(frags) if write is None else write
        # a big full sync on nf_tables streams its chunks (see render.stream_restores)
        size = 3 * (len(frags) + self._endpoint_count(batch.state, fam))
        stream = batch.full and chunk is not None and size > 2 * chunk
        payloads: list[str] = []
        rules_written = {"filter": 0, "nat": 0}
        for _try in range(MAX_DELETION_RETRIES + 1):
            if sc.keep_stale:
                stale = set()
            b0 = time.perf_counter()
            created.update(c for spn in names for c in frags[spn].chains)
            restores: Iterable[Restore]
            if stream:
                # a big full sync: whole services per chunk, the shared chains last, as each chunk is built (the
                # same payloads as build_restores makes for a change bigger than a chunk)
                writing = set(names)
                restores = render.stream_restores(
                    ctx,
                    ((spn, f, spn in writing) for spn, f in frags.items()),
                    top=top,
                    delete_chains=lambda gone=stale: gone,  # type: ignore[misc]
                    jump_rules=jumps,
                    canary=True,
                    chunk_lines=chunk or 0,
                )
            else:
                restores = render.build_restores(
                    ctx,
                    frags,
                    write=write,
                    top=top,
                    delete_chains=stale,
                    jump_rules=jumps,
                    canary=batch.full,
                    chunk_lines=chunk,
                )
            timings["build"] += time.perf_counter() - b0
            payloads = []
            error: str | None = None
            refused: Restore | None = None
            bad: ServicePortName | None = None
            line = 0
            for restore, res, building in _apply_overlapped(kernel, fam, restores):
                timings["build"] += building
                timings["apply"] += res.seconds
                payloads.append(restore.text)
                if res.ok:
                    for t, n in restore.rules.items():
                        rules_written[t] += n
                    written.update(spn for _, _, spn in restore.owners)
                    continue
                error = _summarise(res.stderr, restore.text)
                refusals += 1
                m = _LINE.search(res.stderr)
                line = int(m.group(1)) if m else 0
                bad = restore.owner_of(line) if line else None
                refused = restore
                break
            if error is None:
                return self._applied(batch, frags, payloads, rules_written, refusals, timings)
            self._written[fam].payloads, self._written[fam].was_full = payloads, batch.full
            deletion_refused = (
                bad is None and not sc.keep_stale and refused is not None and _deletes_at(refused.text, line)
            )
            if (deletion_refused or bad is not None) and any(j.table == "filter" for j in jumps):
                # the refused payload's filter part (with its jumps) may have committed before its nat part was
                # refused: insert only what is still missing (nat, always last, never committed)
                s0 = time.perf_counter()
                jumps, err = self._without_present_filter_jumps(fam, jumps)
                timings["save"] += time.perf_counter() - s0
                sc.jumps = jumps
                if err:
                    return Applied(ok=False, error=f"{error}; then {err}", kernel_refusals=refusals, timings=timings)
            if top is not None:
                tops_tried.update(top)
            if deletion_refused:
                # no service's line: most likely a chain deletion, refused because another program's chain still
                # jumps to it (a pre-1.24 KUBE-XLB- chain is swept, others are not ours); without this the same
                # payload would be refused at every sync and the family never programmed again
                log.warning("iptables-restore refused the payload (%s): retrying without deleting stale chains", error)
                sc.keep_stale = True
                if batch.full and write is not None:
                    write = [*write, *(spn for spn in written if spn in frags and spn not in write)]
                    names = write
                continue
            if bad is None:
                return Applied(ok=False, error=error, kernel_refusals=refusals, timings=timings)
            return Applied(
                ok=False, refused=MappingProxyType({bad: error}), error=error, kernel_refusals=refusals, timings=timings
            )
        return Applied(
            ok=False, error="a stale-chain deletion was refused again", kernel_refusals=refusals, timings=timings
        )

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

    def verify_view(self, family: IPFamily, ctx: Context) -> _KernelRules:
        """Every rule of kproxy's chains in nat and filter, read now with ``iptables-save`` (canonical)."""
        kernel = self.kernel
        rules: dict[str, list[adopt.Canon]] = {}
        for table in ("nat", "filter"):
            res = kernel.save(family, table)
            if not res.ok:
                return _KernelRules(ctx, {}, f"{binary('save', family, kernel.flavour)} -t {table}: {res.stderr}")
            for line in res.stdout.splitlines():
                if line.startswith(":KUBE-"):
                    rules.setdefault(f"{table}/{line[1:].split(' ', 1)[0]}", [])
                elif line.startswith("-A KUBE-"):
                    chain, canon = adopt.canonical(line)
                    rules.setdefault(f"{table}/{chain}", []).append(canon)
        return _KernelRules(ctx, rules)

    def verify_error(self, view: _KernelRules) -> str | None:
        return view.error

    def verify_service(self, view: _KernelRules, name: ServicePortName, fragment: Fragment) -> str | None:
        """The service's own nat chains rule for rule, and each of its lines in the shared chains."""
        assert isinstance(view, _KernelRules)
        f = Findings()
        own: dict[str, list[adopt.Canon]] = {c: [] for c in fragment.chains}
        for line in fragment.rules:
            chain, canon = adopt.canonical(line)
            own.setdefault(chain, []).append(canon)
        for chain, wanted in own.items():
            held = view.rules.get(f"nat/{chain}")
            if held is None:
                f.problems.append(f"chain nat/{chain} missing")
                continue
            f.found += 1
            if held != wanted:
                f.problems.append(f"chain nat/{chain}: {len(held)} rules, {len(wanted)} wanted, or in another form")
        for key, lines in fragment.top.items():
            held_lines = view.sets.get(key)
            if held_lines is None:
                held_lines = view.sets[key] = set(view.rules.get(key, []))
            for line in lines:
                if adopt.canonical(line)[1] in held_lines:
                    f.found += 1
                else:
                    f.problems.append(f"rule missing in {key}: {line}")
        return f.verdict()

    def verify_extra(self, view: _KernelRules, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        """Service chains no wanted service owns, and lines in the shared chains no wanted service (or the fixed
        part) accounts for."""
        assert isinstance(view, _KernelRules)
        chains = {f"nat/{c}" for f in wanted.values() for c in f.chains}
        out = [
            f"{key}: a service chain no service owns"
            for key in view.rules
            if key.startswith("nat/") and render.is_service_chain(key[4:]) and key not in chains
        ]
        expected: dict[str, list[adopt.Canon]] = {}
        for key, (head, tail) in render.render_fixed(view.ctx).items():
            expected.setdefault(key, []).extend(adopt.canonical(line)[1] for line in (*head, *tail))
        for frag in wanted.values():
            for key, lines in frag.top.items():
                expected.setdefault(key, []).extend(adopt.canonical(line)[1] for line in lines)
        for key in render.ALL_TOP:
            left = collections.Counter(expected.get(key, []))
            for canon in view.rules.get(key, []):
                if left[canon] > 0:
                    left[canon] -= 1
                else:
                    out.append(f"{key}: a rule no service accounts for: {_spell(key, canon)}")
        return out

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

    def measure_floor(self) -> float | None:
        """Seconds ``iptables-restore`` (same flavour, same flags) takes for the last full sync's exact payloads in a
        fresh namespace of its own (prefix ``kpb-``), deleted afterwards."""
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
                    jump_rules=render.JUMP_RULES,
                    canary=True,
                    chunk_lines=chunk,
                )
                if r.text
            ]
            for fam, w in self._written.items()
            if w.full is not None
        }
        if not payloads or shutil.which("ip") is None:
            return None
        ns = "kpb-" + uuid.uuid4().hex[:10]
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
        try:
            return _timed_restores(Kernel(flavour, ns), payloads, "floor restore")
        finally:
            subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True, timeout=30)

    def measure_partial_floor(self) -> dict[str, float] | None:
        """Replay the last partial sync's payloads with ``iptables-restore`` (same flavour, same flags) into the table
        as it is now, without their ``-X`` lines (those chains are gone already): the same chain flushes and rule
        additions, so ``floor_s`` is what the kernel and the restore tool alone take for that change.

        On the nf_tables flavour it then measures the same replay once more with the jumps from the built-in chains
        into kproxy's chains (``render.JUMP_RULES`` of the tables the payload writes) deleted, and inserts them again:
        ``unhooked_s``. nf_tables validates every rule reachable from a base chain on each commit that adds a rule
        (``nf_tables_validate`` at commit), so the gap between the two is that walk over the whole service table,
        which no payload shape avoids. Benchmarks only: the node's services are unhooked for the moment it takes."""
        if self._kernel is None:
            return None
        k = self._kernel
        payloads = {fam: [_replayable(t) for t in w.payloads] for fam, w in self._written.items() if not w.was_full}
        payloads = {fam: [t for t in texts if t] for fam, texts in payloads.items()}
        payloads = {fam: texts for fam, texts in payloads.items() if texts}
        if not payloads:
            return None

        floor = _timed_restores(k, payloads, "partial floor replay")
        if floor is None:
            return None
        out = {"floor_s": floor}
        if k.flavour != "nft":
            return out
        tables = {fam: {m.group(1) for t in texts for m in _TABLE.finditer(t)} for fam, texts in payloads.items()}
        jumps = {fam: [j for j in render.JUMP_RULES if j.table in tables[fam]] for fam in payloads}
        unhooked: dict[IPFamily, list[JumpRule]] = {}
        try:
            for fam, js in jumps.items():
                for table in ("filter", "nat"):  # one restore per table: each is deleted whole or not at all
                    mine = [j for j in js if j.table == table]
                    if not mine:
                        continue
                    res = k.restore(fam, _jump_text(mine, "-D"))
                    if not res.ok:
                        log.warning("partial floor: could not unhook: %s", res.stderr.strip())
                        return out
                    unhooked.setdefault(fam, []).extend(mine)
            seconds = _timed_restores(k, payloads, "partial floor replay without the jumps")
            if seconds is not None:
                out["unhooked_s"] = seconds
        finally:
            for fam, js in unhooked.items():
                res = k.restore(fam, _jump_text(js, "-I"))
                if not res.ok:  # the next full sync inserts missing jumps anyway
                    log.error("partial floor: could not insert the jumps again: %s", res.stderr.strip())
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
        present, err = self._filter_builtin_rules(fam)
        if err:
            return jumps, err
        return [j for j in jumps if j.table != "filter" or f"filter/-A {j.chain} {j.spec}" not in present], None

    def _filter_builtin_rules(self, fam: IPFamily) -> tuple[set[str], str | None]:
        """The rules of filter's INPUT, FORWARD and OUTPUT ("filter/-A CHAIN spec"), one ``iptables -S`` per chain:
        filter is small on both flavours (on legacy every -S reads the whole table, so nat is read by one save)."""
        kernel = self.kernel
        present: set[str] = set()
        for chain in ("INPUT", "FORWARD", "OUTPUT"):
            res = kernel.list_chain(fam, "filter", chain)
            if not res.ok:
                return present, f"{binary('', fam, kernel.flavour)} -t filter -S {chain}: {res.stderr.strip()}"
            present.update(f"filter/{line}" for line in res.stdout.splitlines() if line.startswith("-A "))
        return present, None


@dataclass(slots=True)
class _KernelRules:
    """What ``verify`` read: the rules of kproxy's chains ("table/CHAIN" -> canonical rules, in order)."""

    ctx: Context
    rules: dict[str, list[adopt.Canon]]
    error: str | None = None
    sets: dict[str, set[adopt.Canon]] = field(default_factory=dict)  # the shared chains' rules as sets, on demand


def _spell(key: str, canon: adopt.Canon) -> str:
    """A canonical rule back in iptables words (for messages)."""
    words = [f"-A {key.split('/', 1)[1]}"]
    for neg, opt, vals in canon:
        words.append(("! " if neg else "") + " ".join((opt, *vals)))
    return " ".join(words)


def _inspect() -> Any:
    """The kernel-inspection module (``inspect.py``: remnants and per-service kernel views), imported on use."""
    try:
        from . import inspect as inspect_mod
    except ImportError as exc:  # pragma: no cover - the module ships with the backend
        raise BackendError(f"iptables kernel inspection unavailable: {exc}") from None
    return inspect_mod


_TABLE = re.compile(r"^\*(\w+)$", re.M)


def _apply_overlapped(
    kernel: Kernel, fam: IPFamily, restores: Iterable[Restore]
) -> Iterator[tuple[Restore, Run, float]]:
    """Apply payloads in order, one at a time, each in a worker thread while the next is taken from ``restores``
    (rendered, when it is a generator): yields (payload, result, seconds spent taking the next payload) as each
    one finishes. The caller stops at the first refusal; the payload rendered meanwhile is never applied.

    ``iptables-restore`` runs in its own process (the kernel's work is in its system calls), so on two cores the
    rendering of chunk N+1 in Python costs no wall time while chunk N is applied."""
    it = iter(restores)

    def take() -> tuple[Restore | None, float]:
        t0 = time.perf_counter()
        for r in it:
            if r.text:
                return r, time.perf_counter() - t0
        return None, time.perf_counter() - t0

    cur, spent = take()
    if cur is None:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="iptables-restore") as pool:
        while cur is not None:
            fut = pool.submit(kernel.restore, fam, cur.text)
            nxt, more = take()
            res = fut.result()
            yield cur, res, spent
            if not res.ok:
                return
            cur, spent = nxt, more


def _deletes_at(text: str, line: int) -> bool:
    """Whether the payload's refused line (1-based) is a chain deletion (``-X``), as both flavours report a chain
    that something still jumps to."""
    lines = text.splitlines()
    return 0 < line <= len(lines) and lines[line - 1].startswith("-X ")


def _timed_restores(kernel: Kernel, payloads: Mapping[IPFamily, list[str]], what: str) -> float | None:
    """Seconds ``iptables-restore`` took for every payload, in order; None (logged) when one is refused."""
    total = 0.0
    for fam, texts in payloads.items():
        for text in texts:
            res = kernel.restore(fam, text)
            if not res.ok:
                log.warning("%s failed: %s", what, res.stderr.strip())
                return None
            total += res.seconds
    return total


def _replayable(text: str) -> str:
    """A restore payload without its chain deletions (``-X``, which cannot be repeated) and without the declarations
    (``:CHAIN``) that flushed those chains before, which would create them again."""
    lines = text.splitlines(keepends=True)
    gone = {f":{line[3:].strip()} " for line in lines if line.startswith("-X ")}
    return "".join(line for line in lines if not line.startswith("-X ") and line[: line.find(" ") + 1] not in gone)


def _jump_text(jumps: list[JumpRule], op: str) -> str:
    """A restore payload deleting (``-D``) or inserting at the top (``-I``, in the order a full sync does) jumps."""
    lines: list[str] = []
    for table in ("filter", "nat"):
        mine = [j for j in jumps if j.table == table]
        if mine:
            pos = " 1" if op == "-I" else ""
            lines += [f"*{table}", *(f"{op} {j.chain}{pos} {j.spec}" for j in mine), "COMMIT"]
    return "\n".join(lines) + "\n" if lines else ""


def _chunk_lines(kernel_rules: int) -> int:
    """Lines per nf_tables payload. Each payload pays a fixed cost that grows with the rules already in the table
    (iptables-nft fetches them all: 0.4 s at 430k rules) plus a cost quadratic in its own size (about 0.4 s for
    10,000 lines); their sum over a change of L lines, L x (F/c + a x c), is least at c = sqrt(F/a)."""
    return max(CHUNK_LINES, min(4 * CHUNK_LINES, int((250 * kernel_rules) ** 0.5)))


def _summarise(stderr: str, text: str) -> str:
    """The first line of iptables-restore's complaint plus the payload line it names."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("Try `")]
    summary = "; ".join(lines[:3]) or "iptables-restore failed"
    m = _LINE.search(stderr)
    if m:
        n = int(m.group(1))
        payload = text.split("\n")
        if 1 <= n <= len(payload):
            summary += f" [line {n}: {payload[n - 1][:300]}]"
    return summary
