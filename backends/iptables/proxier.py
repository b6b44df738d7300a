"""The iptables backend's Proxier: renders with ``render``, applies with ``iptables-restore --noflush --counters``.

Each family is synced on its own, as upstream runs one proxier per family: a family the kernel refuses is reported
(``ok`` False, the error names it) and needs a full sync next time, while the other family is still programmed and
goes on with partial syncs. One restore per family per sync (several on the nf_tables flavour when a change is big, see
``render.build_restores``; a big full sync renders each chunk while the previous one is applied, ``_stream``).
Partial syncs (upstream's KEP-3453) write only the dirty services' own chains and
rewrite a shared chain (KUBE-SERVICES ...) only when a dirty service's lines in it changed, which the per-service
fragments kept from the last successful restore make cheap to decide. Full syncs (first sync, ``changes.full``, a
missing canary, after a failure) read the nat table once (``iptables-save -t nat``) to adopt what is in the
kernel: they rewrite the shared chains and every service whose chains differ from what the kernel holds (see
``adopt.py``; unchanged services keep their rules and counters), insert the jumps from the built-in chains that are
missing and delete stale service chains, but never flush a table, so a restarted kproxy converges without
disturbing established connections.

A restore the kernel refuses is traced back to the service whose lines it names; that service keeps the rules it
had before (or, new or refused again, is left out, treated as absent) and the rest is applied, up to ``MAX_ROUNDS``
times; it is reported in ``SyncResult.failed``. A retry rewrites the shared chains earlier rounds wrote as well,
because a refused payload's earlier tables (filter before nat) have already committed.

Who uses it: the daemon (through the ``kproxy.backends`` entry point ``iptables``), ``kproxy bench sync``, the lab,
and tests/integration/test_iptables_backend.py.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.config import ProxyConfig
from kproxy.model import Changes, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.proxier import Availability, Proxier

from . import adopt, render
from . import cleanup as cleanup_mod
from . import trace as trace_mod
from .kernel import FLAVOURS, Kernel, Run, binary, detect_flavour, missing_binaries

log = logging.getLogger(__name__)

MAX_ROUNDS = 4  # restores per family per sync when the kernel refuses services one after another
CHUNK_LINES = 3000  # lines per payload on the nf_tables flavour (see render.build_restores)
# Upstream's monitor polls mangle (small, cheap). The nf_tables flavour looks one chain up by name, so nat (the table
# a flush hurts) is cheap to check too; the legacy flavour reads a whole table per check (1 s for nat at 10k services).
CANARY_TABLES = {"nft": ("mangle", "nat"), "legacy": ("mangle",)}
_LINE = re.compile(r"line:? (\d+)")


@dataclass(slots=True)
class _Family:
    """What was applied for one family by the last successful restore."""

    ctx: render.Context | None = None
    fragments: dict[ServicePortName, render.Fragment] = field(default_factory=dict)
    services: dict[ServicePortName, ServicePort] = field(default_factory=dict)
    failed: dict[ServicePortName, str] = field(default_factory=dict)
    last_payloads: list[str] = field(default_factory=list)  # every payload of the last sync (for tests and /rules)
    last_was_full: bool = True  # whether those came from a full sync
    # what the last full sync wanted (for measure_floor: the payloads that write it all into an empty table)
    last_full: tuple[render.Context, dict[ServicePortName, render.Fragment]] | None = None
    last_rules: dict[str, int] = field(default_factory=dict)
    need_full: bool = True  # first sync, or the last sync of this family failed


class IptablesProxier(Proxier):
    """Upstream kube-proxy's iptables layout, applied through iptables-restore (nf_tables or legacy flavour)."""

    mode: ClassVar[str] = "iptables"
    uses_conntrack_nat: ClassVar[bool] = True

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        """``netns`` aims every iptables command at a named namespace (tests and benchmarks); the daemon leaves it
        None and programs the namespace it runs in, as upstream does."""
        super().__init__(config)
        self.netns = netns
        self.flavour_option = str(config.backend_options.get("iptables_flavour") or "auto")
        if self.flavour_option not in ("auto", *FLAVOURS):
            raise ValueError(f"--iptables-flavour {self.flavour_option!r}: choose auto, nft or legacy")
        self.families = tuple(f for f in (IPFamily.V4, IPFamily.V6) if f in config.ip_families)
        self._kernel: Kernel | None = None
        self._lock = threading.Lock()
        self._fam: dict[IPFamily, _Family] = {f: _Family() for f in self.families}
        self._canary_checked = float("-inf")  # time.monotonic() of the last canary check (or full sync)
        # chains of the services written by the current round's payloads: if a later payload of the same sync fails
        # because of one of them, the chains an earlier payload created for it must be deleted again
        self._pending_chains: dict[ServicePortName, tuple[str, ...]] = {}
        self._counts: dict[tuple[int, int, IPFamily], int] = {}

    # ------------------------------------------------------------------------------------------ contract

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
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument(
            "--iptables-flavour",
            choices=("auto", *FLAVOURS),
            default="auto",
            help="iptables binaries: auto (what the node already uses, as iptables-wrapper decides), nft, legacy",
        )

    @property
    def kernel(self) -> Kernel:
        if self._kernel is None:
            flavour = self.flavour_option
            if flavour == "auto":
                flavour = detect_flavour(self.netns)
            self._kernel = Kernel(flavour, self.netns)
            log.info("iptables flavour: %s", flavour)
        return self._kernel

    def sync(self, state: ProxyState, changes: Changes) -> SyncResult:
        with self._lock:
            return self._sync(state, changes)

    def cleanup(self) -> None:
        with self._lock:
            if self.netns is None:
                cleanup_mod.cleanup_leftovers()
            else:
                cleanup_mod.cleanup_leftovers(self.netns)
            for fs in self._fam.values():
                fs.fragments.clear()
                fs.services.clear()
                fs.failed.clear()
                fs.need_full = True

    def measure_floor(self) -> float | None:
        """Seconds ``iptables-restore`` (same flavour, same flags) takes for the last full sync's exact payloads in a
        fresh namespace of its own (prefix ``kpb-``), deleted afterwards."""
        with self._lock:
            flavour = self.kernel.flavour
            chunk = _chunk_lines(0) if flavour == "nft" else None
            payloads = {
                fam: [
                    r.text
                    for r in render.build_restores(
                        fs.last_full[0],
                        fs.last_full[1],
                        write=None,
                        top=None,
                        jump_rules=render.JUMP_RULES,
                        canary=True,
                        chunk_lines=chunk,
                    )
                    if r.text
                ]
                for fam, fs in self._fam.items()
                if fs.last_full is not None
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
        with self._lock:
            if self._kernel is None:
                return None
            k = self._kernel
            payloads = {
                fam: [_replayable(t) for t in fs.last_payloads] for fam, fs in self._fam.items() if not fs.last_was_full
            }
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
            unhooked: dict[IPFamily, list[render.JumpRule]] = {}
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
                        self._fam[fam].need_full = True
            return out

    def describe(self, key: ServicePortName | None = None) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {}
            for fam, fs in self._fam.items():
                names = set(fs.services) | set(fs.failed)
                for spn in sorted(names):
                    if key is not None and spn != key:
                        continue
                    entry = out.setdefault(f"{spn}/{spn.protocol.value}", {})
                    sp = fs.services.get(spn)
                    frag = fs.fragments.get(spn)
                    info: dict[str, Any] = {"applied": frag is not None, "failed": fs.failed.get(spn)}
                    if sp is not None:
                        info.update(
                            clusterIP=sp.cluster_ip,
                            port=sp.port,
                            nodePort=sp.node_port,
                            internal=sp.internal_verdict.value,
                            external=sp.external_verdict.value,
                            internalEndpoints=[str(e) for e in sp.internal_endpoints],
                            externalEndpoints=[str(e) for e in sp.external_endpoints],
                        )
                    if frag is not None:
                        info["chains"] = list(frag.chains)
                        rules: dict[str, list[str]] = {}
                        for k, lines in frag.top.items():
                            rules[k] = list(lines)
                        rules["nat/own"] = list(frag.rules)
                        info["rules"] = rules
                    entry[fam.value] = info
            counts = {f"{fam.value}/{t}/last": n for fam, fs in self._fam.items() for t, n in fs.last_rules.items()}
            return {
                "mode": self.mode,
                "flavour": self._kernel.flavour if self._kernel else None,
                "counts": counts,
                "services": out,
            }

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any]:
        """Where a new connection's first packet would go through the rules last applied (see ``trace.py``)."""
        fam = IPFamily.of(dst)
        with self._lock:
            fs = self._fam.get(fam)
            if fs is None or fs.ctx is None:
                return {"error": f"no {fam.value} rules applied yet"}
            pkt = trace_mod.Packet(src, proto.lower(), dst, dport, src_local, dst_local)
            return trace_mod.trace(fs.ctx, fs.fragments, pkt)

    # ------------------------------------------------------------------------------------------ syncing

    def last_payloads(self, family: IPFamily) -> list[str]:
        """The restore payloads the last sync wrote for a family (tests assert on what was written)."""
        with self._lock:
            return list(self._fam[family].last_payloads)

    def canary_present(self) -> bool:
        k = self.kernel
        return all(
            k.chain_exists(fam, table, render.KUBE_PROXY_CANARY)
            for fam in self.families
            for table in CANARY_TABLES[k.flavour]
        )

    def _sync(self, state: ProxyState, changes: Changes) -> SyncResult:
        """Sync every family, each on its own (as upstream runs one proxier per family): a family the kernel keeps
        refusing does not stop the other from being programmed, and only the failed family needs a full sync next."""
        t0 = time.perf_counter()
        timings = {"render": 0.0, "apply": 0.0, "canary": 0.0, "save": 0.0}
        full = {fam: changes.full or self._fam[fam].need_full for fam in self.families}
        now = time.monotonic()
        if not all(full.values()) and now - self._canary_checked >= self.config.sync_period:
            # off the hot path: at most once per sync period (upstream's monitor polls at that interval)
            self._canary_checked = now
            c0 = time.perf_counter()
            k = self.kernel
            for fam in self.families:
                if not full[fam] and not all(
                    k.chain_exists(fam, table, render.KUBE_PROXY_CANARY) for table in CANARY_TABLES[k.flavour]
                ):
                    log.warning("%s KUBE-PROXY-CANARY is gone (someone flushed iptables): full resync", fam.value)
                    full[fam] = True
            timings["canary"] = time.perf_counter() - c0
        failed: dict[ServicePortName, str] = {}
        counts: dict[str, int] = {}
        errors: list[str] = []
        failed_families: set[IPFamily] = set()
        did_full = False
        for fam in self.families:
            fs = self._fam[fam]
            error, fam_full = self._sync_family(fam, state, changes, full[fam], failed, timings, counts)
            did_full = did_full or fam_full
            counts[f"{fam.value}/full"] = int(fam_full)
            if error is not None:
                fs.need_full = True
                errors.append(f"{fam.value}: {error}")
                failed_families.add(fam)
            else:
                fs.need_full = False
        if all(full.values()) and not errors:
            self._canary_checked = now  # just written in every family
        for key in ("nat", "filter"):
            counts[f"rules_total/{key}"] = sum(counts.get(f"{f.value}/{key}/total", 0) for f in self.families)
            counts[f"rules_last/{key}"] = sum(counts.get(f"{f.value}/{key}/last", 0) for f in self.families)
        timings["total"] = time.perf_counter() - t0
        return SyncResult(
            ok=not errors,
            full=did_full,
            error="; ".join(errors) or None,
            failed=MappingProxyType(failed),
            counts=MappingProxyType(counts),
            timings=MappingProxyType(timings),
            failed_families=frozenset(failed_families),
        )

    def _sync_family(
        self,
        fam: IPFamily,
        state: ProxyState,
        changes: Changes,
        full: bool,
        failed: dict[ServicePortName, str],
        timings: dict[str, float],
        counts: dict[str, int],
    ) -> tuple[str | None, bool]:
        """Render and apply one family: (error text when nothing sensible could be applied, whether it was a full
        sync)."""
        fs = self._fam[fam]
        kernel = self.kernel
        large = self._endpoint_count(state, fam) > render.LARGE_CLUSTER_ENDPOINTS
        ctx = render.make_context(self.config, state.node, fam, large_cluster=large)
        if ctx != fs.ctx:
            full = True  # node CIDRs / addresses changed: every fragment may differ
        services = state.family(fam)
        skip: set[ServicePortName] = set()  # refused: left out (treated as absent)
        keep: set[ServicePortName] = set()  # refused update: the fragment applied before stays (as upstream keeps it)
        jumps: list[render.JumpRule] = []
        stale: set[str] = set()
        keep_stale = False  # a deletion was refused (something else jumps to a stale chain): leak rather than stall
        written: set[ServicePortName] = set()  # services with lines in a payload of this sync that committed
        created: dict[ServicePortName, set[str]] = {}  # their chains, over every round (a stale sweep needs all)

        def plan() -> tuple[dict[ServicePortName, render.Fragment], list[ServicePortName] | None, set[str] | None]:
            if full:
                frags = {
                    spn: fs.fragments[spn] if spn in keep else render.render_service(sp, ctx)
                    for spn, sp in services.items()
                    if spn not in skip
                }
                if not kernel_chains:
                    return frags, None, None
                # adoption: services whose chains the kernel already holds exactly are not rewritten; the read is from
                # before the first round, so services a payload of an earlier round committed are written again
                write = [spn for spn, f in frags.items() if spn in written or not adopt.unchanged(f, kernel_chains)]
                return frags, write, None
            frags = dict(fs.fragments)
            updates: dict[ServicePortName, render.Fragment | None] = {}
            for spn in changes.services:
                sp = services.get(spn)
                if spn in keep:
                    new: render.Fragment | None = fs.fragments[spn]
                else:
                    new = render.render_service(sp, ctx) if sp is not None and spn not in skip else None
                updates[spn] = new
                if new is None:
                    frags.pop(spn, None)
                else:
                    frags[spn] = new
            # a kept service's old chains are written again too: an earlier payload of this sync may have changed them
            to_write = [spn for spn, f in updates.items() if f is not None]
            return frags, to_write, render.changed_top_chains(fs.fragments, updates) | tops_tried

        # shared chains earlier rounds wrote: a table of a refused payload may have committed before the refusal
        tops_tried: set[str] = set()
        kernel_chains: dict[str, list[adopt.Canon]] = {}
        if full:
            s0 = time.perf_counter()
            kernel_chains, present_jumps, kernel_rules, err = self._read_kernel(fam)
            existing = set(kernel_chains)
            timings["save"] += time.perf_counter() - s0
            if err:
                return err, full
            jumps = [j for j in render.JUMP_RULES if f"{j.table}/-A {j.chain} {j.spec}" not in present_jumps]
        else:
            kernel_chains = {}
            existing = set()
            kernel_rules = sum(len(f.rules) for f in fs.fragments.values())
        chunk = _chunk_lines(kernel_rules) if kernel.flavour == "nft" else None
        # A big full sync on nf_tables streams: each chunk is applied while the next is rendered (see _stream).
        stream = full and chunk is not None and 3 * (len(services) + self._endpoint_count(state, fam)) > 2 * chunk
        r0 = time.perf_counter()
        frags: dict[ServicePortName, render.Fragment] = {}  # a stream fills them in its first round
        write: list[ServicePortName] | None = None
        top: set[str] | None = None
        if not stream:
            frags, write, top = plan()
        render_s = time.perf_counter() - r0
        apply_s = 0.0
        payloads: list[str] = []
        rules_written: dict[str, int] = {}
        for _round in range(MAX_ROUNDS):
            restores: Iterable[render.Restore]
            if stream and _round == 0:
                # frags and write are filled as the chunks are rendered
                frags, write, restores = self._stream(services, ctx, kernel_chains, existing, jumps, chunk or 0)
            elif full:
                wanted = {c for f in frags.values() for c in f.chains}
                made = {c for spn in skip | keep for c in created.get(spn, ())}
                stale = {c for c in existing | made if c not in wanted}
            else:
                old_chains = {c for spn in changes.services if spn in fs.fragments for c in fs.fragments[spn].chains}
                for spn in skip | keep:  # refused services whose new chains an earlier chunk may have created
                    old_chains.update(created.get(spn, ()))
                wanted = {c for spn in changes.services if spn in frags for c in frags[spn].chains}
                stale = old_chains - wanted
            if not (stream and _round == 0):
                if keep_stale:
                    stale = set()
                b0 = time.perf_counter()
                restores = render.build_restores(
                    ctx,
                    frags,
                    write=write,
                    top=top,
                    delete_chains=stale,
                    jump_rules=jumps,
                    canary=full,
                    chunk_lines=chunk,
                )
                render_s += time.perf_counter() - b0
                self._pending_chains = {spn: frags[spn].chains for spn in (write if write is not None else frags)}
            payloads = []  # what this round wrote: the last round is the one that stuck
            rules_written = {"filter": 0, "nat": 0}
            bad: ServicePortName | None = None
            error: str | None = None
            refused: render.Restore | None = None
            line = 0
            for restore, res, rendering in _apply_overlapped(kernel, fam, restores):
                render_s += rendering
                apply_s += res.seconds
                payloads.append(restore.text)
                if res.ok:
                    for t, n in restore.rules.items():
                        rules_written[t] += n
                    written.update(spn for _, _, spn in restore.owners)
                    continue
                error = _summarise(res.stderr, restore.text)
                refusals = f"{fam.value}/kernel_refusals"
                counts[refusals] = counts.get(refusals, 0) + 1
                m = _LINE.search(res.stderr)
                line = int(m.group(1)) if m else 0
                bad = restore.owner_of(line) if line else None
                refused = restore
                break
            for spn, chains_ in self._pending_chains.items():  # filled as the stream went, or before the round
                created.setdefault(spn, set()).update(chains_)
            if error is None:
                break
            deletion_refused = (
                bad is None and not keep_stale and refused is not None and _deletes_at(refused.text, line)
            )
            if (deletion_refused or (bad is not None and bad not in skip)) and any(j.table == "filter" for j in jumps):
                # the refused payload's filter part (with its jumps) may have committed before its nat part was
                # refused: insert only what is still missing (nat, always last, never committed)
                jumps, err = self._without_present_filter_jumps(fam, jumps)
                if err:
                    timings["render"] += render_s
                    timings["apply"] += apply_s
                    fs.last_payloads, fs.last_was_full = payloads, full
                    return f"{error}; then {err}", full
            if deletion_refused:
                # no service's line: most likely a chain deletion, refused because another program's chain still
                # jumps to it (a pre-1.24 KUBE-XLB- chain is swept, others are not ours); without this the same
                # payload would be refused at every sync and the family never programmed again
                log.warning("iptables-restore refused the payload (%s): retrying without deleting stale chains", error)
                keep_stale = True
                if top is not None:
                    tops_tried.update(top)
                if stream and _round == 0:
                    frags, write, top = plan()  # the stream stopped early: the whole plan for the next round
                continue
            if bad is None or bad in skip:
                timings["render"] += render_s
                timings["apply"] += apply_s
                fs.last_payloads, fs.last_was_full = payloads, full
                return error, full
            if bad not in keep and bad in fs.fragments:
                log.warning("iptables-restore refused the new rules of %s (%s): keeping its old rules", bad, error)
                keep.add(bad)
            else:  # new, or even its old rules are refused now
                log.warning("iptables-restore refused the rules of %s (%s): skipping that service", bad, error)
                keep.discard(bad)
                skip.add(bad)
            if bad not in failed:
                failed[bad] = error
                fs.failed[bad] = error
            if top is not None:
                tops_tried.update(top)
            if not full:
                changes = Changes(full=False, services=changes.services | {bad}, generation=changes.generation)
            frags, write, top = plan()
        else:
            timings["render"] += render_s
            timings["apply"] += apply_s
            fs.last_payloads, fs.last_was_full = payloads, full
            return f"still refused after {MAX_ROUNDS} rounds: {error}", full
        timings["render"] += render_s
        timings["apply"] += apply_s
        # Success: remember what the kernel now holds.
        fs.ctx = ctx
        fs.fragments = frags
        applied = frags.keys()
        if full:
            fs.services = {
                spn: fs.services.get(spn, sp) if spn in keep else sp for spn, sp in services.items() if spn in applied
            }
            fs.failed = {spn: why for spn, why in fs.failed.items() if spn in skip or spn in keep}
            fs.last_full = (ctx, frags)
        else:
            for spn in changes.services:
                sp = services.get(spn)
                if spn in keep:
                    continue  # still the old rules (and the old ServicePort), reported in failed
                if sp is not None and spn in applied:
                    fs.services[spn] = sp
                    fs.failed.pop(spn, None)
                else:
                    fs.services.pop(spn, None)
                    if sp is None:
                        fs.failed.pop(spn, None)
        fs.last_payloads, fs.last_was_full = payloads, full
        fs.last_rules = rules_written
        totals = render.total_rules(ctx, frags)
        for t in ("filter", "nat"):
            counts[f"{fam.value}/{t}/total"] = totals[t]
            counts[f"{fam.value}/{t}/last"] = rules_written[t]
        counts[f"{fam.value}/services"] = len(frags)
        return None, full

    def _stream(
        self,
        services: Mapping[ServicePortName, ServicePort],
        ctx: render.Context,
        kernel_chains: Mapping[str, list[adopt.Canon]],
        existing: set[str],
        jumps: list[render.JumpRule],
        chunk: int,
    ) -> tuple[dict[ServicePortName, render.Fragment], list[ServicePortName], Iterator[render.Restore]]:
        """A full sync's payloads as a generator that renders each service when its chunk is asked for, with the
        fragments and the services written (adoption: those whose chains differ from the kernel's) filled in as it
        goes; complete once it is exhausted."""
        frags: dict[ServicePortName, render.Fragment] = {}
        write: list[ServicePortName] = []
        self._pending_chains = {}

        def items() -> Iterator[tuple[ServicePortName, render.Fragment, bool]]:
            for spn, sp in services.items():
                f = frags[spn] = render.render_service(sp, ctx)
                w = not kernel_chains or not adopt.unchanged(f, kernel_chains)
                if w:
                    write.append(spn)
                    self._pending_chains[spn] = f.chains
                yield spn, f, w

        def deletes() -> set[str]:
            wanted = {c for f in frags.values() for c in f.chains}
            return {c for c in existing if c not in wanted}

        restores = render.stream_restores(
            ctx, items(), top=None, delete_chains=deletes, jump_rules=jumps, canary=True, chunk_lines=chunk
        )
        return frags, write, restores

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

    def _without_present_filter_jumps(
        self, fam: IPFamily, jumps: list[render.JumpRule]
    ) -> tuple[list[render.JumpRule], str | None]:
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

    def _read_kernel(self, fam: IPFamily) -> tuple[dict[str, list[adopt.Canon]], set[str], int, str | None]:
        """The nat table's service chains with their rules (canonical, for adoption), the jump rules present in the
        built-in chains ("table/-A CHAIN spec"), and how many rules the nat table holds; error text or None."""
        kernel = self.kernel
        # the nat jumps come with the nat table's save (on the legacy flavour every -S reads the whole table, 1 s for
        # nat at 10,000 services)
        jumps, err = self._filter_builtin_rules(fam)
        if err:
            return {}, set(), 0, err
        res = kernel.save(fam, "nat")
        if not res.ok:
            return {}, jumps, 0, f"{binary('save', fam, kernel.flavour)} -t nat: {res.stderr.strip()}"
        builtin = ("-A PREROUTING ", "-A OUTPUT ", "-A POSTROUTING ")
        jumps.update(f"nat/{line}" for line in res.stdout.splitlines() if line.startswith(builtin))
        chains = adopt.kernel_service_chains(res.stdout)
        return chains, jumps, res.stdout.count("\n-A "), None


_TABLE = re.compile(r"^\*(\w+)$", re.M)


def _apply_overlapped(
    kernel: Kernel, fam: IPFamily, restores: Iterable[render.Restore]
) -> Iterator[tuple[render.Restore, Run, float]]:
    """Apply payloads in order, one at a time, each in a worker thread while the next is taken from ``restores``
    (rendered, when it is a generator): yields (payload, result, seconds spent taking the next payload) as each
    one finishes. The caller stops at the first refusal; the payload rendered meanwhile is never applied.

    ``iptables-restore`` runs in its own process (the kernel's work is in its system calls), so on two cores the
    rendering of chunk N+1 in Python costs no wall time while chunk N is applied."""
    it = iter(restores)

    def take() -> tuple[render.Restore | None, float]:
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


def _jump_text(jumps: list[render.JumpRule], op: str) -> str:
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
