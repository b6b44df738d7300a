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

import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from prometheus_client import Counter as Counter_

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.metrics import PREFIX
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nftkernel import Nft, available
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelProbe
from kproxy.toolkit import nft as nft_tools
from kproxy.toolkit.netns import scratch_netns
from kproxy.toolkit.trace import traced
from kproxy.toolkit.verify import Findings

from . import adopt as adopt_mod
from . import layout, render
from . import trace as trace_mod
from .render import Fragment

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # seconds between "is my table still there" checks at the start of partial syncs
CHUNK = 10_000  # elements per transaction of a big full sync (see NftablesProxier.apply)


@dataclass(slots=True)
class _KernelState:
    """What this process knows the kernel holds besides the ledger's fragments (None: unknown, read it)."""

    shared: set[str] = field(default_factory=set)
    refs: Counter[str] = field(default_factory=Counter)  # shared chain -> services using it
    hairpin: set[str] = field(default_factory=set)
    context: dict[str, Any] | None = None
    entries: dict[tuple[str, str], ServicePortName] = field(default_factory=dict)  # entry key -> owner
    known: bool = False


@dataclass(slots=True)
class _Scratch:
    """What the refusal rounds of one full batch carry: the chunks an earlier round committed."""

    entries: dict[tuple[str, str], ServicePortName] | None = None  # entry owners after this round's batch
    committed: dict[ServicePortName, Fragment | None] = field(default_factory=dict)
    stale_done: set[str] = field(default_factory=set)
    kernel: _KernelState | None = None  # what the kernel holds after the committed chunks
    fresh: bool = False  # the table was (re)made from nothing


NftBatch = Batch[Fragment, FamilyContext, adopt_mod.Adopted, _Scratch]


def _scratch(batch: NftBatch) -> _Scratch:
    if batch.scratch is None:
        batch.scratch = _Scratch()
    return batch.scratch


@dataclass(slots=True)
class _Chunk:
    """One transaction and what the kernel holds once it commits."""

    tx: render.Transaction
    services: dict[ServicePortName, Fragment | None]
    shared: set[str]
    refs: Counter[str]
    hairpin: set[str]
    context: dict[str, Any] | None = None
    stale: set[str] = field(default_factory=set)  # comment keys of unwanted services it removes


@dataclass(slots=True)
class _TableView:
    """What ``verify`` read: every map and set of the table (name -> key -> value), the chain names, the comments of
    every chain's rules (``layout.rule_tag``) and how the fixed chains differ from the layout."""

    family: IPFamily = IPFamily.V4
    maps: dict[str, dict[str, str]] = field(default_factory=dict)
    chains: set[str] = field(default_factory=set)
    rules: dict[str, adopt_mod.Tags] = field(default_factory=dict)
    fixed: list[str] = field(default_factory=list)
    error: str | None = None


class NftablesProxier(LedgerProxier[Fragment, FamilyContext, adopt_mod.Adopted, _TableView, _Scratch]):
    """kproxy's nftables layout (see the package docstring), applied through libnftables in-process."""

    mode: ClassVar[str] = "nftables"
    CHECK_INTERVAL_S: ClassVar[float | None] = CHECK_INTERVAL
    uses_conntrack_nat: ClassVar[bool] = True

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self._nft = nft_tools.OwnContext(netns)
        self._metrics: dict[str, Any] = {}
        self._kernel: dict[IPFamily, _KernelState] = {f: _KernelState() for f in self.families}
        self._last_full_text: dict[IPFamily, str] = {}
        self._last_text: dict[IPFamily, str] = {}
        # the last partial batch's changes (service, old, new), for measure_partial_floor
        self._last_partial: dict[IPFamily, list[tuple[ServicePortName, Fragment | None, Fragment | None]]] = {}
        self._counts: dict[IPFamily, dict[str, int]] = {}  # the last apply's figures per family, for describe()

    # ------------------------------------------------------------------------------------------ hooks

    @classmethod
    def available(cls) -> Availability:
        why = available()
        return Availability(why is None, why or "")

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        return nft_tools.remnants(probe, layout.TABLE)

    @classmethod
    def kernel_view(cls, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
        found = nft_tools.elements(nft_tools.listed(probe, family, layout.TABLE) or ())
        # slots carry no comment: their key is their entry's plus a slot number, and the entry names the service
        owner = {
            el.key: adopt_mod.split_comment(el.comment)[0]
            for el in found
            if el.set in (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS)
        }
        out: dict[str, list[str]] = {}
        for el in found:
            ckey, _ = adopt_mod.split_comment(el.comment)
            if ckey:
                out.setdefault(ckey, []).append(nft_tools.element_line(el))
            elif el.set.startswith(tuple(layout.SLOT_BASES)) and (ckey := owner.get(el.key.rpartition(" . ")[0], "")):
                out.setdefault(ckey, []).append(nft_tools.element_line(el, ckey))
        return out

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Delete kproxy's tables (``ip kproxy``, ``ip6 kproxy``) and nothing else; errors are logged, never raised
        (a leftover must not stop another mode from starting)."""
        from .cleanup import cleanup_tables

        cleanup_tables(netns)

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def nft(self) -> Nft:
        return self._nft.get()

    def start(self) -> None:
        # the netlink rule reads (adoption, the check before partial syncs) import pyroute2's nftables part: ~0.1 s
        # once, paid here rather than inside the first sync that checks
        import pyroute2.nftables.main  # noqa: F401

    def close(self) -> None:
        self._nft.close()

    def cleanup(self) -> None:
        super().cleanup()
        self._kernel = {f: _KernelState() for f in self.families}

    # ------------------------------------------------------------------------------------------ ledger methods

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        # rules match local addresses by kind (fib daddr type local): an address change rewrites nothing
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> Fragment:
        return render.render_service(sp, ctx)

    def adopt(self, family: IPFamily, ctx: FamilyContext) -> adopt_mod.Adopted | None:
        t0 = time.perf_counter()
        got, err = adopt_mod.read(self.nft, family, layout.layout_chain(family))
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
        problems = adopt_mod.fixed_problems(family, rules) if rules is not None else ["unreadable"]
        if problems:
            log.warning(
                "%s: kproxy's nftables table was changed by someone else (%s): full resync",
                family.value,
                "; ".join(problems[:3]),
            )
            self._kernel[family] = _KernelState()
            return True
        return False

    # ------------------------------------------------------------------------------------------ verify, metrics

    def verify_view(self, family: IPFamily, ctx: FamilyContext) -> _TableView:
        """The whole table read back (every map and set with its elements, chain names): unlike adoption, which
        trusts the digests in the entry comments, ``verify`` compares every element, slots included."""
        fam = render.nft_family(family)
        objs, err = self.nft.read(f"list table {fam} {layout.TABLE}")
        view = _TableView(family)
        if objs is None:
            if "No such file" in err or "does not exist" in err:
                return view  # no table: everything wanted is missing
            view.error = err or "nft list table failed"
            return view
        for obj in objs:
            body = obj.get("map") or obj.get("set")
            if body is not None and body.get("table") == layout.TABLE:
                view.maps[body["name"]] = {el.key: el.value for el in nft_tools.elements([obj])}
            chain = obj.get("chain")
            if chain is not None and chain.get("table") == layout.TABLE:
                view.chains.add(chain["name"])
        rules, err = adopt_mod.read_rules(self.nft, family)
        if rules is None:
            view.error = err
            return view
        view.rules = rules
        view.fixed = adopt_mod.fixed_problems(family, rules)
        return view

    def verify_error(self, view: _TableView) -> str | None:
        return view.error

    def verify_service(self, view: _TableView, name: ServicePortName, fragment: Fragment) -> str | None:
        """Every element of the service in its map with its value (slots included), its own chains, its hairpin
        elements."""
        assert isinstance(view, _TableView)
        f = Findings()
        for m, key, value in fragment.elements:
            f.check(f"{m}: {key}", view.maps.get(m, {}).get(key), value)
        for chain, rules in fragment.chains:
            if chain not in view.chains:
                f.problems.append(f"chain {chain} missing")
            elif (kept := view.rules.get(chain, ())) != adopt_mod.tags(rules):
                f.problems.append(f"chain {chain}: {len(kept)} rules held, {len(rules)} wanted, or others")
            else:
                f.found += 1
        for chain in _with_deps(fragment.shared):
            if chain not in view.chains:
                f.problems.append(f"shared chain {chain} missing")
            elif not adopt_mod.shared_ok(chain, view.family, view.rules):
                f.problems.append(f"shared chain {chain}: its rules differ")
        f.problems += view.fixed  # every service goes through the fixed chains
        hairpin = view.maps.get(layout.HAIRPIN, {})
        f.problems += [f"{layout.HAIRPIN}: {key} missing" for key in fragment.hairpin if key not in hairpin]
        return f.verdict()

    def verify_extra(self, view: _TableView, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        """Elements of the service maps that no wanted service accounts for (the hairpin and context sets are
        shared and kept on purpose: not counted)."""
        assert isinstance(view, _TableView)
        mine: dict[str, set[str]] = {}
        for frag in wanted.values():
            for m, key, _ in frag.elements:
                mine.setdefault(m, set()).add(key)
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
        return {"table": layout.TABLE, "layout": layout.LAYOUT, "counts": counts}

    # ------------------------------------------------------------------------------------------ apply

    def apply(self, batch: NftBatch) -> Applied:
        """One transaction for a partial batch. A full batch is one transaction too when it replaces the table (no
        moment without rules) or is small; a big one is split into transactions of whole services (``CHUNK``
        elements each: libnftables holds ~2.4 kB per element it parses, 264 MB for 10,000 x 10 in one go), the
        shared chains first and their removal last, so every service changes atomically and every intermediate state
        is a consistent mix of old and new services, as the iptables backend's chunked restores. Each chunk is applied
        in the libnftables thread while the next one is built. Chunks that committed before a refusal are remembered
        in ``batch.scratch``, so the ledger's retry round starts from what the kernel holds."""
        fam = batch.family
        r0 = time.perf_counter()
        timings = {"render_apply": 0.0, "apply": 0.0}
        self._entry_owners(batch)
        if batch.full:
            chunks = self._full_chunks(batch)
        else:
            ks = self._kernel[fam]
            if not ks.known:
                return Applied(ok=False, error="kernel state unknown: a full sync must come first", need_full=True)
            chunks = iter([self._partial(batch, ks)])
        timings["render_apply"] += time.perf_counter() - r0
        added = deleted = commands = 0
        texts: list[str] = []
        pending: tuple[_Chunk, str, Any] | None = None
        error: tuple[_Chunk, Any] | None = None
        while True:
            b0 = time.perf_counter()
            nxt = next(chunks, None)
            text = nxt.tx.text() if nxt is not None else ""
            timings["render_apply"] += time.perf_counter() - b0
            if pending is not None:
                chunk, ptext, fut = pending
                res = fut.result()
                timings["apply"] += res.seconds
                if not res.ok:
                    error = (chunk, res)
                    break
                self._commit_chunk(batch, chunk)
                texts.append(ptext)
                pending = None
            if nxt is None:
                break
            added += nxt.tx.elements_added
            deleted += nxt.tx.elements_deleted
            commands += text.count("\n")
            if text:
                pending = (nxt, text, self.nft.submit(text))
            else:
                self._commit_chunk(batch, nxt)
        figures = {
            "elements_added": added,
            "elements_deleted": deleted,
            "commands": commands,
            "transactions": len(texts) + (1 if error else 0),
        }
        if error is not None:
            chunk, res = error
            summary, refused = nft_tools.refused(res, chunk.tx.owner_of)
            if not refused:  # not a service's fault: read the kernel again at the full sync
                self._kernel[fam] = _KernelState()
            return Applied(
                ok=False,
                refused=refused,
                error=summary,
                kernel_refusals=1,
                figures=MappingProxyType(figures),
                timings=MappingProxyType(timings),
            )
        ks = self._kernel[fam]
        if not batch.full and not any(f" {w} {render.nft_family(fam)} " in t for t in texts for w in ("chain", "set")):
            self._last_partial[fam] = [(d.name, d.old_fragment, d.new_fragment) for d in batch.deltas]
        else:
            self._last_partial.pop(fam, None)
        sc = _scratch(batch)
        if sc.entries is not None:
            ks.entries, sc.entries = sc.entries, None
        ks.known = True
        self._last_text[fam] = "".join(texts)
        if batch.full and sc.fresh:
            self._last_full_text[fam] = "".join(texts)
        figures["shared_chains"] = len(ks.shared)
        self._counts[fam] = figures
        return Applied(ok=True, figures=MappingProxyType(figures), timings=MappingProxyType(timings))

    def _entry_owners(self, batch: NftBatch) -> None:
        """Which service owns each map element after this batch (``scratch["entries"]``). Two services never claim
        one address . protocol . port: the core decides that before rendering (``kproxy.admission``)."""
        if batch.full:
            owners = {(m, k): spn for spn, frag in batch.wanted.items() for m, k, _ in frag.entries}
        else:
            owners = dict(self._kernel[batch.family].entries)
            for d in batch.deltas:
                if d.old_fragment is not None:
                    for m, k, _ in d.old_fragment.entries:
                        if owners.get((m, k)) == d.name:
                            del owners[(m, k)]
            for d in batch.deltas:
                for m, k, _ in d.new_fragment.entries if d.new_fragment is not None else ():
                    owners[(m, k)] = d.name
        _scratch(batch).entries = owners

    def _partial(self, batch: NftBatch, ks: _KernelState) -> _Chunk:
        tx = render.Transaction(batch.family)
        refs = Counter(ks.refs)
        hairpin: set[str] = set()
        services: dict[ServicePortName, Fragment | None] = {}
        for d in batch.deltas:
            render.change_service(tx, d.name, d.old_fragment, d.new_fragment)
            services[d.name] = d.new_fragment
            if d.old_fragment is not None:
                refs.subtract(set(_with_deps(d.old_fragment.shared)))
            if d.new_fragment is not None:
                refs.update(set(_with_deps(d.new_fragment.shared)))
                hairpin.update(h for h in d.new_fragment.hairpin if h not in ks.hairpin)
        shared = _shared_changes(tx, ks.shared, refs)
        _hairpin(tx, hairpin, set())
        return _Chunk(tx, services, shared=shared, refs=refs, hairpin=ks.hairpin | hairpin)

    def _full_chunks(self, batch: NftBatch) -> Iterator[_Chunk]:
        """The transactions of a full batch (see ``apply``), built as they are asked for."""
        fam = batch.family
        scratch = _scratch(batch)
        adopted = batch.adopted
        committed = scratch.committed
        tx = render.Transaction(fam)
        known = scratch.kernel  # after chunks of an earlier round committed
        replace = False
        damaged: set[str] = set()
        if known is not None:
            present_shared, present_hairpin, present_context = known.shared, known.hairpin, known.context or {}
        elif adopted is None or not adopted.table or not adopted.layout_ok:
            scratch.fresh = True
            replace = adopted is None or adopted.table
            if replace:
                # unreadable, or another layout: replaced whole in one transaction (no moment without rules)
                tx.head.append(f"add table {tx.fam} {layout.TABLE}")
                tx.head.append(f"delete table {tx.fam} {layout.TABLE}")
            tx.head.extend(layout.fixed_commands(fam))
            present_shared, present_hairpin, present_context = set(), set(), {}
        else:
            present_shared = {c for c in adopted.chains if layout.is_shared_chain(c)}
            # a shared chain whose rules were changed by hand is written again (flushed first)
            damaged = {c for c in present_shared if not adopt_mod.shared_ok(c, fam, adopted.rules)}
            present_hairpin = set(adopted.hairpin)
            present_context = dict(adopted.context)
        if known is None and adopted is not None and scratch.fresh:
            adopted = None  # nothing of the old table survives
        wanted_ctx = layout.context_elements(batch.context)
        want_form = adopt_mod.wanted_context(wanted_ctx)
        for name, items in wanted_ctx.items():
            if present_context.get(name) != want_form[name]:
                if not scratch.fresh:
                    tx.head.append(f"flush set {tx.fam} {layout.TABLE} {name}")
                if items:
                    tx.head.append(f"add element {tx.fam} {layout.TABLE} {name} {{ {', '.join(items)} }}")
        refs = Counter(s for f in batch.wanted.values() for s in set(_with_deps(f.shared)))
        needed_shared = set(refs)
        needed_hairpin = {h for f in batch.wanted.values() for h in f.hairpin}
        for name in _ordered(needed_shared - (present_shared - damaged)):
            tx.add_shared_chain(name, exists=name in present_shared)
        _hairpin(tx, needed_hairpin - present_hairpin, set())
        both_shared = present_shared | needed_shared
        both_hairpin = present_hairpin | needed_hairpin
        services: dict[ServicePortName, Fragment | None] = {}

        stale: set[str] = set()

        def chunk(last: bool = False) -> _Chunk:
            return _Chunk(
                tx,
                services,
                shared=needed_shared if last else both_shared,
                refs=refs if last else Counter(),
                hairpin=needed_hairpin if last else both_hairpin,
                context=want_form,
                stale=stale,
            )

        def full() -> bool:
            return not replace and tx.elements_added + tx.elements_deleted >= CHUNK

        in_batch: set[ServicePortName] = set()
        for d in batch.deltas:
            in_batch.add(d.name)
            if d.name in committed:  # an earlier round's chunk wrote it
                if committed[d.name] != d.new_fragment:
                    render.change_service(tx, d.name, committed[d.name], d.new_fragment)
            elif adopted is None or (svc := adopted.service(d.name)) is None:
                render.change_service(tx, d.name, None, d.new_fragment)
            elif (
                d.old_fragment is not None
                and svc.digests_agree
                and svc.digest == d.old_fragment.digest
                and svc.entries == {(m, k): v for m, k, v in d.old_fragment.entries}
                and adopted.chains_hold(d.old_fragment)
            ):  # the kernel holds the old version whole (an entry deleted by hand leaves the digest in the others)
                render.change_service(tx, d.name, d.old_fragment, d.new_fragment)
            else:
                sid = layout.service_chain_id(d.name)
                render.change_service(
                    tx,
                    d.name,
                    None,
                    d.new_fragment,
                    old_keys=svc.keys(),
                    old_chains=adopted.service_chains(sid),
                    old_sets=adopted.service_sets(sid),
                )
            services[d.name] = d.new_fragment
            if full():
                yield chunk()
                tx, services = render.Transaction(fam), {}
        if adopted is not None:
            # services the kernel holds that nothing wants (deleted while kproxy was down)
            handled = {f.comment for f in batch.wanted.values()}
            handled.update(layout.comment_key(render.service_key(spn)) for spn in in_batch)
            done = scratch.stale_done
            for ckey, svc in adopted.services.items():
                if ckey not in handled and ckey not in done:
                    render.change_service(tx, None, None, None, old_keys=svc.keys())
                    stale.add(ckey)
            # chains of services the deltas handle (changed or removed) are theirs to rewrite or delete
            wanted_sids = {layout.service_chain_id(spn) for spn in (*batch.wanted, *in_batch)}
            stale_chains = [c for c in adopted.chains if layout.is_service_chain(c) and _sid_of(c) not in wanted_sids]
            for c in stale_chains:
                tx.flush_chain(c, None)
            for c in stale_chains:
                tx.delete_chain(c, None)
            for s in adopted.sets:
                if _sid_of(s) not in wanted_sids:
                    tx.delete_set(s, None)
        _shared_changes(tx, both_shared, refs)
        _hairpin(tx, set(), both_hairpin - needed_hairpin)
        yield chunk(last=True)

    def _commit_chunk(self, batch: NftBatch, chunk: _Chunk) -> None:
        """Record what a committed transaction left in the kernel."""
        ks = self._kernel[batch.family]
        ks.shared = set(chunk.shared)
        ks.hairpin = set(chunk.hairpin)
        if chunk.refs or not batch.full:
            ks.refs = Counter(chunk.refs)
        if chunk.context is not None:
            ks.context = chunk.context
        if batch.full:
            sc = _scratch(batch)
            sc.committed.update(chunk.services)
            sc.stale_done.update(chunk.stale)
            sc.kernel = _KernelState(
                shared=set(chunk.shared), hairpin=set(chunk.hairpin), context=chunk.context, known=True
            )

    # ------------------------------------------------------------------------------------------ tools

    def last_transaction(self, family: IPFamily) -> str:
        """The text of the last committed transaction of a family (tests assert on what was written)."""
        return self._last_text.get(family, "")

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any]:
        """Where a new connection's first packet would go through what was last applied (see ``trace.py``)."""
        return traced(self.applied, trace_mod.trace, src, proto, dst, dport, src_local=src_local, dst_local=dst_local)

    def measure_partial_floor(self) -> dict[str, float] | None:
        """The kernel's own time (libnftables in-process, the most direct means) to take the last partial sync's
        element changes again: the change is first undone (untimed), then the same transaction is run and timed.
        Benchmarks only. None when the last batch of every family created or removed chains (not replayable)."""
        total = 0.0
        done = False
        for fam, changes in self._last_partial.items():
            undo, redo = render.Transaction(fam), render.Transaction(fam)
            for spn, old, new in changes:
                render.change_service(undo, spn, new, old)
                render.change_service(redo, spn, old, new)
            res = self.nft.run(undo.text())
            if not res.ok:
                log.warning("partial floor: undoing the last change failed: %s", nft_tools.summary(res.error))
                return None
            res = self.nft.run(redo.text())
            if not res.ok:
                log.warning("partial floor: replaying the last change failed: %s", nft_tools.summary(res.error))
                self._kernel[fam] = _KernelState()
                return None
            total += res.seconds
            done = True
        return {"floor_s": total} if done else None

    def measure_floor(self) -> float | None:
        """Seconds ``nft -f`` takes for the exact transaction of the last full sync that built the table from
        nothing, into a fresh namespace of its own (``kpn-floor-…``), deleted afterwards."""
        texts = [t for t in self._last_full_text.values() if t]
        if not texts:
            return None
        total = 0.0
        with scratch_netns("kpn-floor-") as ns:
            for text in texts:
                seconds = nft_tools.file_seconds(ns, text)
                if seconds is None:
                    return None
                total += seconds
        return total


def _sid_of(name: str) -> str:
    """The service id inside a per-service chain or set name (``pick-<id>-c``, ``aff-<id>-<ep>-<t>``)."""
    parts = name.split("-")
    if parts[0] == "fw":
        parts = parts[1:]
    return parts[1] if len(parts) > 1 else ""


def _with_deps(names: Any) -> set[str]:
    out: set[str] = set()
    for n in names:
        out.add(n)
        out.update(layout.shared_chain_needs(n))
    return out


def _ordered(names: set[str]) -> list[str]:
    """Shared chains in creation order: those others jump to first."""

    def rank(n: str) -> int:
        if n.startswith("fw-"):
            return 2
        if n.startswith(("lbl-", "npl-")):
            return 1
        return 0

    return sorted(names, key=lambda n: (rank(n), n))


def _shared_changes(tx: render.Transaction, present: set[str], refs: Counter[str]) -> set[str]:
    """Create the shared chains some service now uses and the kernel lacks; remove those no service uses any more
    (emptied first: they jump to each other). Returns the shared chains the kernel holds afterwards."""
    wanted = {n for n, c in refs.items() if c > 0}
    for name in _ordered(wanted - present):
        tx.add_shared_chain(name)
    gone = present - wanted
    for name in gone:
        tx.flush_chain(name, None)
    for name in _ordered(gone)[::-1]:
        tx.delete_chain(name, None)
    for name in [n for n, c in refs.items() if c <= 0]:
        del refs[name]
    return wanted


def _hairpin(tx: render.Transaction, add: set[str], delete: set[str]) -> None:
    tx.delete_keys(((layout.HAIRPIN, h) for h in sorted(delete)), None)
    tx.add_elements(((layout.HAIRPIN, h, "") for h in sorted(add)), None, None)
