"""``BpfProxier``: the bpf mode on the core's ledger (the typed protocol of ``kproxy.batch``). A service's fragment
is its socket frontends and its share of the nftables companion table (``render``); ``apply`` turns a batch into one
ordered plan of map writes (``plan``), executed as a few ``BPF_MAP_*_BATCH`` calls (``kernel``), and one nft
transaction when the companion part changed (``companion``); ``adopt`` reads the kernel back (``adopt``).

Loading: ``start()`` creates or reopens the pinned maps, then adopts the pinned programs of its own build when they
read those maps (a restart: no compile), else compiles, loads and attaches the programs in a child process
(``loader.attach_in_child``: bcc and LLVM never enter kproxy's own memory; the programs stay attached to the cgroup
when the child exits). Either way it then holds an fd of each program and pins them (``programs.Keeper``), so a repair
of detached programs or removed pins is a few ``bpf(2)`` calls, not a compile. A sync without ``start()`` (``kproxy
bench sync``, tests of the maps alone) only opens or creates the pinned maps. ``__init__`` touches nothing.

kproxy's index of the maps (``index.FamilyIndex``) is the allocator of backend and reverse-NAT ids; when a write
fails the index is dropped and the next full sync rebuilds it from the kernel. Capacity (cilium#12815: a full LB map
fails silently there): ``limits`` declares what the maps hold, and the core refuses a service port that would not
fit before anything is rendered, so a full map never fails a family's sync.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import subprocess
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.admission import Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.counters import CounterDump, Measure
from kproxy.drift import Drift
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelHooks, LabNodeSpec, Option

from . import adopt, cleanup, companion, counters, kernel, loader, maps, plan, probe, programs, render, sockets, trace
from .adopt import Adopted
from .index import MAX_ID, FamilyIndex
from .kernel import Step
from .render import Context, Fragment

log = logging.getLogger(__name__)

NEEDS_FULL_CHECK_S = 1.0
#: the maps and the companion table are read back (what someone changed by hand) this often: by the daemon's
#: read-behind, else as a full sync that adopts them; in between, full syncs trust kproxy's own index
KERNEL_READ_S = 25.0
MAX_FRESH_REAP = 64  # new translating UDP frontends per batch whose untranslated sockets are looked for (a first
# sync makes every frontend new: nothing was translated before it, and one ss filter of thousands would not do)
#: after a failed re-attach of the programs, the next attempt waits this long (a compile costs 1-4 s)
REATTACH_RETRY_S = 30.0
#: a batch of at least this many services is planned in chunks while a writer thread writes the previous chunk's
#: puts (the ``bpf(2)`` calls release the GIL: the kernel's share of a full sync overlaps kproxy's planning on
#: another core); smaller batches write inline
PIPELINE_SERVICES = 2048
PIPELINE_CHUNK = 1024

BpfBatch = Batch[Fragment, Context, Adopted, None]


class BpfProxier(LedgerProxier[Fragment, Context, Adopted, Adopted, None]):
    """The bpf mode (see ``backends/bpf/__init__.py``)."""

    mode: ClassVar[str] = "bpf"
    kernel_hooks: ClassVar[KernelHooks | None] = cleanup  # remnants, kernel_view, cleanup_leftovers
    CHECK_INTERVAL_S: ClassVar[float | None] = NEEDS_FULL_CHECK_S
    # the companion table announces its changes; pins, attachments and map identities are polled (``needs_full``)
    DRIFT: ClassVar[Drift | None] = Drift(frozenset({companion.TABLE}), poll_s=0.3)
    # the socket path translates before conntrack sees anything, but the companion table NATs external traffic
    uses_conntrack_nat: ClassVar[bool] = True
    # connections only: the programs run at connect()/sendmsg() and never see a connection's packets (counters.py)
    counters_offered: ClassVar[frozenset[Measure]] = counters.OFFERED
    options: ClassVar[tuple[Option, ...]] = (
        Option(
            "bpf_cgroup_path",
            str,
            "",
            "cgroup (v2) whose processes' sockets are load-balanced (the node's pods and host processes); default: "
            "a child cgroup of kproxy's own per network namespace (never the machine's root cgroup)",
        ),
        Option(
            "bpf_allow_root_cgroup",
            bool,
            False,
            "allow --bpf-cgroup-path to be the root of the machine's cgroup v2 hierarchy (every process's sockets, "
            "host daemons' too, are then load-balanced); refused unless chosen",
        ),
        Option(
            "bpf_pin_path",
            str,
            "",
            "bpffs folder for the pinned maps; default /sys/fs/bpf/kproxy/net-<netns inode>",
        ),
        Option(
            "bpf_map_size",
            int,
            loader.DEFAULT_MAP_SIZE,
            "entries of every map that grows with services: the service map, the backend array and the names map "
            "(default holds 10,000 services x 50 endpoints; the array is preallocated: 8 bytes per entry for IPv4 "
            "and 24 for IPv6, 32 MB at the default); a service port that does not fit is refused with the reason "
            "and counted in kproxy_service_ports_refused; a change needs `kproxy cleanup` first",
        ),
    )

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self._places: loader.Places | None = None
        counting = config.service_counters
        self._maps = kernel.OpenMaps(self._where, lambda p: cleanup.record_places(p, self.netns), counting)
        # --service-counters: each service port's backend ids, to name what the counter maps hold (counters.py)
        self._names = counters.Names(self.families) if counting else None
        self._index: dict[IPFamily, FamilyIndex | None] = {f: None for f in self.families}
        self._companion = companion.Companion(self.families, netns)
        self._kernel_read: dict[IPFamily, float] = {}
        # the repair of someone else's flush (``_check_kernel_now``): families owed a full sync that reads the kernel,
        # programs to attach again
        self._owed: set[IPFamily] = set()
        self._reattach = False
        self._reattach_after = 0.0
        # the programs attached, held (fds) and pinned: detached or unpinned, they are put back without a compile
        self.programs = programs.Keeper()
        self._metric_entries: Any = None
        self._counts: dict[IPFamily, dict[str, int]] = {}  # the last apply's figures per family, for describe()
        self.attached: list[str] = []
        # older copies of the programs that ``start`` replaced (they read other maps: an upgrade with another map
        # layout, pins lost while kproxy was down), left attached until every family's first full sync has filled
        # the maps the new ones read: attached first, they run first and keep translating meanwhile
        self._replaced: list[dict[str, Any]] = []
        self._filled: set[IPFamily] = set()
        self._reaper = sockets.Reaper()
        #: adoption's reads of the maps, in the background while the ledger renders (``adopt``)
        self._reader: ThreadPoolExecutor | None = None
        self.last_reap: Future[int] | None = None
        self._last_full: IPFamily | None = None  # the family of the last full sync that wrote (the floor's)
        self._last_partial: tuple[IPFamily, list[Step]] | None = None

    @property
    def _fds(self) -> dict[tuple[str, IPFamily], int]:
        return self._maps.fds

    # -- hooks ----------------------------------------------------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        return probe.availability()  # bcc is imported in a child: libbcc would stay in this process (60 MB)

    @classmethod
    def not_applicable(cls, options: Mapping[str, Any]) -> Mapping[str, str]:
        return MappingProxyType({})

    @classmethod
    def not_applicable_parts(cls, options: Mapping[str, Any]) -> Mapping[str, Mapping[str, str]]:
        """A pod's datagram is translated at its socket, before any conntrack entry exists: no entry can stand in a
        new service's way. The maps carry no counters."""
        return MappingProxyType(
            {
                "udp-conntrack": MappingProxyType(
                    {"stale-entry": "pods' datagrams are translated at the socket (sendmsg/connect), not by conntrack"}
                ),
                "dual-stack": MappingProxyType(
                    {"kernel-counters": "its maps carry no counters, so a rewrite with the same content cannot be seen"}
                ),
            }
        )

    @classmethod
    def lab_options(cls, node: LabNodeSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        """The node's own cgroup, and a pin folder keyed by the node's namespace (never the host's folder). Values
        only: what the node needs prepared on the machine is ``lab_prepare``'s."""
        out: dict[str, Any] = {}
        if node.cgroup is not None and "bpf_cgroup_path" not in options:
            out["bpf_cgroup_path"] = str(node.cgroup)
        if "bpf_pin_path" not in options:
            out["bpf_pin_path"] = str(loader.PIN_ROOT / f"lab-{node.netns}")
        return out

    @classmethod
    def lab_prepare(cls, node: LabNodeSpec, options: Mapping[str, Any]) -> None:
        """Prepare the machine for a lab node's kproxy, from the lab's own (the machine's) mount namespace, before it
        starts: the node's kproxy runs under ``ip netns exec`` (a fresh /sys without the machine's bpffs) and reaches
        the machine's bpffs through a bind of it outside /sys (``loader.ensure_host_bind``; ``cleanup`` undoes it
        with the last pins)."""
        loader.ensure_host_bind()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _where(self) -> loader.Places:
        if self._places is None:
            p = loader.places(self.option_values(self.config.backend_options), self.netns)
            self._places = dataclasses.replace(p, counters=self.config.service_counters)
        return self._places

    def _ensure_maps(self, every: bool = False) -> None:
        self._maps.ensure(self.families, every)

    def start(self) -> None:
        """Pin or reopen the maps; adopt the pinned programs of this build or compile them; attach to the cgroup
        (replacing an older kproxy's copies); hold and pin the programs."""
        p = self._where()
        loader.ensure_places(p)
        cleanup.record_places(p, self.netns)
        self._ensure_maps(every=True)  # created with the programs' specs: the compiler reopens them
        self.attached, self._replaced = self.programs.start(p)
        self._reaper.warm()  # a partial sync that ends UDP sockets hands them to a thread already running
        log.info("bpf: attached %s to %s", ", ".join(self.attached), p.cgroup)
        if self._replaced:
            log.info("bpf: %d older programs stay attached until the first sync fills the maps", len(self._replaced))
        else:
            self._remove_stale_pins(p)  # no older program reads them

    def close(self) -> None:
        self._reaper.close()  # it reads the reverse-NAT map: before the fds go
        if self._reader is not None:  # a read under way ends before its fds go
            self._reader.shutdown(wait=True)
            self._reader = None
        self._maps.close()
        self.programs.close()  # pinned and attached: they stay in the kernel
        self._companion.close()

    def cleanup(self) -> None:
        self.close()
        super().cleanup()
        self._index = {f: None for f in self.families}
        self._companion.forget()
        if self._names is not None:
            self._names.forget()

    # -- ledger hooks ---------------------------------------------------------------------------------------------

    def context(self, node: FamilyContext, state: ProxyState) -> Context:
        cidrs = render.nodeport_cidrs(node.family, node.nodeport_all_local, node.nodeport_cidrs, node.nodeport_ips)
        return Context(node.family, tuple(sorted(node.nodeport_addresses)), cidrs)

    def render(self, sp: ServicePort, ctx: Context) -> Fragment:
        return render.render(sp, ctx)

    def adopt(self, family: IPFamily, ctx: Context) -> Adopted:
        """What the maps hold: read at the first sync, after a failure, or when a read-back differed or is overdue;
        else kproxy's index (``needs_full`` notices what vanished within a second): no decode of every entry."""
        self._ensure_maps()
        cur = self._index[family]
        if cur is not None and time.monotonic() - self._kernel_read.get(family, 0.0) < KERNEL_READ_S:
            present = self._companion.ready[family]
            table = companion.NftView(present, frozenset(), frozenset())
            return Adopted(cur, {}, Counter(), table, self.applied_fragments(family))
        self._kernel_read[family] = time.monotonic()
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kproxy-bpf-read")
        raw = self._reader.submit(kernel.read_maps, self._maps.family_fds(family), family)
        table, _why = self._companion.checked(family, self.applied_fragments(family))
        return adopt.pending(family, raw, table)  # decoded at the ledger's first comparison (``Adopted.ready``)

    def adopted_unchanged(self, adopted: Adopted, name: ServicePortName, fragment: Fragment) -> bool:
        return adopt.adopted_unchanged(adopted, name, fragment)

    def verify_view(self, family: IPFamily, ctx: Context) -> Adopted:
        """Always the kernel through the pins (never the trusted index, never kproxy's own fds), the programs'
        attachments and the companion table's rules. Read-only; any thread."""
        p = self._where()
        raw, gone = kernel.read_pinned(p, family)
        table, nft_problem = self._companion.checked(family, self.applied_fragments(family))
        problem = f"pinned map {gone[0]} missing in {p.pin_dir}" if gone else None
        if problem is None and self.attached:
            problem = loader.programs_problem(p, loader.pinned_ids(p), (family,))
        return adopt.adopted(family, raw, table, problem, nft_problem)

    def verify_service(self, view: Adopted, name: ServicePortName, fragment: Fragment) -> str | None:
        return adopt.verify_service(view, name, fragment)

    def verify_extra(self, view: Adopted, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        return adopt.verify_extra(view, wanted)

    def needs_full(self, family: IPFamily) -> bool:
        """Asked by the ledger at most every ``CHECK_INTERVAL_S`` per family. For the first family: are the pinned
        maps the ones kproxy writes, are its programs attached and reading them, is the companion table there? What
        someone flushed or deleted (the pins, the attachments, the table: ``kproxy cleanup`` of another process does
        all three) is put back: removed pins and detached programs from the held ones at once (``programs.Keeper``:
        the same maps, no compile); else the maps made and pinned again (empty) and the programs compiled and attached
        again after the full sync that refills them (``apply``). Either way the family is owed a full sync that reads
        the kernel. A few bpf(2) calls and one ``list tables``. (A due read-back, ``KERNEL_READ_S``, is
        ``readback_due``'s: no damage.)"""
        if family is self.families[0] and self._fds:
            try:
                self._check_kernel_now()
            except (OSError, RuntimeError, ValueError, companion.NftError) as exc:  # never a reason to fail the sync
                log.warning("bpf: checking that the kernel state is still there failed: %s", exc)
        if family in self._owed:
            self._owed.discard(family)
            return True
        return False

    def readback_due(self, family: IPFamily) -> bool:
        """A read-back of the maps (edits in place) is due every ``KERNEL_READ_S`` (``kproxy.readbehind``)."""
        read = self._kernel_read.get(family)
        return read is not None and time.monotonic() - read >= KERNEL_READ_S

    def kernel_read(self, family: IPFamily, at: float | None) -> None:
        """A clean read-back from ``at`` (None: a difference: the next full batch adopts from the maps)."""
        if at is None:
            self._kernel_read.pop(family, None)
        elif at > self._kernel_read.get(family, float("-inf")):
            self._kernel_read[family] = at

    def _owe(self, families: Iterable[IPFamily], *, forget_index: bool = False) -> None:
        for f in families:
            if forget_index:
                self._index[f] = None
            self._kernel_read.pop(f, None)
            self._owed.add(f)

    def _check_kernel_now(self) -> None:
        if self._maps.retired and (self.last_reap is None or self.last_reap.done()):
            self._maps.close_retired()
        p = self._where()
        for _ in range(3):  # a removal still under way (``rm -r``) may take more meanwhile: put that back too
            if self.programs.put_back_pins(p, self._fds):
                self._owe(self.families)  # a full sync that reads the maps back (whatever else the damage did)
            pinned = loader.pinned_ids(p)
            if all(k in pinned for k in self._fds):
                break
        lost = self._maps.lost(pinned)
        if lost:
            log.warning(
                "bpf: pinned maps gone or replaced in %s (%s): pinning new ones, full resync",
                p.pin_dir,
                ", ".join(maps.pin_name(r, f) for r, f in lost),
            )
            self._ensure_maps(every=bool(self.attached))
            self._owe(self.families, forget_index=True)
            pinned = loader.pinned_ids(p)
        if self.attached and not self._reattach:
            why = loader.programs_problem(p, pinned, self.families)
            if why is not None and self.programs.reattach(p, pinned, self.families, why):
                self._owe(self.families)  # as above
            elif why is not None:
                log.warning("bpf: %s: compiling and attaching the programs again after the next sync", why)
                self._reattach = True
                self._reattach_after = 0.0
                self._owe(self.families)  # a sync now, so the programs come back at once
        for f in self.families:
            if self._companion.lost(f):
                log.warning("bpf: the companion table %s (%s) is gone: full resync", companion.TABLE, f.value)
                self._owe((f,))

    def _repair_programs(self) -> None:
        """Compile and attach the programs again (``loader.attach_in_child``): the held ones could not serve."""
        p = self._where()
        try:
            self._ensure_maps(every=True)
            self.attached = self.programs.compile_again(p)  # the maps were just filled: older copies go at once
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            self._reattach_after = time.monotonic() + REATTACH_RETRY_S
            log.error("bpf: attaching the programs again failed (next try in %.0f s): %s", REATTACH_RETRY_S, exc)
            return
        self._reattach = False
        log.info("bpf: attached %s to %s again", ", ".join(self.attached), p.cgroup)

    def _detach_replaced(self) -> None:
        """The maps the new programs read hold every family now: the older copies ``start`` replaced go, and the pins
        of an older map layout with them (nothing reads those maps any more)."""
        p = self._where()
        try:
            loader.detach_ids(p.cgroup, self._replaced)
        except (OSError, RuntimeError) as exc:
            log.warning("bpf: detaching the replaced programs from %s failed (retried): %s", p.cgroup, exc)
            return
        log.info("bpf: detached %d replaced programs from %s", len(self._replaced), p.cgroup)
        self._replaced = []
        self._remove_stale_pins(p)

    def _remove_stale_pins(self, p: loader.Places) -> None:
        try:
            stale = loader.remove_stale_pins(p)
            stale += self.programs.remove_stale(p)
        except OSError as exc:
            log.warning("bpf: removing the pins of an older map layout in %s failed: %s", p.pin_dir, exc)
            return
        if stale:
            log.info("bpf: removed the pins of an older map layout: %s", ", ".join(stale))

    def detail(self, name: ServicePortName, family: IPFamily, fragment: Fragment) -> dict[str, Any]:
        return render.summary(fragment)

    def detail_global(self) -> dict[str, Any]:
        p = self._places
        return {
            "pinPath": str(p.pin_dir) if p else None,
            "cgroup": str(p.cgroup) if p else None,
            "mapSize": p.map_size if p else None,
            "attached": list(self.attached),
            "counts": {fam.value: dict(c) for fam, c in list(self._counts.items())},
        }

    def limits(self, family: IPFamily) -> Limits:
        """What the maps hold (the core refuses a service port that does not fit, before it is rendered), all sized
        by ``--bpf-map-size``: the service map that many entries (a master and a slot per backend, per frontend),
        the backend array as many backends less one (id 0 is "none": backend ids are its indexes), the names map as
        many service ports (one reverse-NAT id each: 32 bits, so the map size is the limit); 65,535 slots per
        frontend (the 16-bit slot of a service-map key)."""
        size = self._where().map_size
        return Limits(
            service_ports=min(size, MAX_ID), endpoints_per_port=0xFFFF, entries=size, endpoints=min(size - 1, MAX_ID)
        )

    # -- apply ----------------------------------------------------------------------------------------------------

    def apply(self, batch: BpfBatch) -> Applied:
        fam = batch.family
        if not batch.full and not batch.deltas:
            return Applied()  # nothing of this family changed
        t0 = time.perf_counter()
        self._ensure_maps()
        adopted: Adopted | None = batch.adopted
        if batch.full:
            index = (adopted if adopted is not None else self.adopt(fam, batch.context)).ready().index
            adopt.claim_all(index, batch.wanted, (d.name for d in batch.deltas))
        else:
            cur = self._index[fam]
            if cur is None:
                return Applied(ok=False, error="the map index is unknown after a failure: a full sync rebuilds it")
            index = cur
        # until this batch is fully in, the index may not match the kernel: a full sync then reads the maps again
        read_at = self._kernel_read.pop(fam, None)
        try:
            the_plan, steps, t_write, t1 = self._write_maps(batch, index)
        except maps.BpfError as exc:
            self._index[fam] = None
            why = "a BPF map is full (E2BIG)" if exc.errno == errno.E2BIG else str(exc)
            return Applied(ok=False, error=f"bpf map write failed: {why}")
        except BaseException:  # a planning error (no reverse-NAT id left): the index may not match the maps now
            self._index[fam] = None
            raise
        if steps:
            if batch.full:
                self._last_full = fam
            else:
                self._last_partial = (fam, steps)
        t2 = time.perf_counter()
        the_plan.release(index)
        self._index[fam] = index
        if self._names is not None:
            self._names.applied(fam, index, batch)
        try:
            trusted = adopted.trusted if adopted is not None else None
            self._companion.apply(batch, adopted.nft if adopted is not None else None, trusted)
        except companion.NftError as exc:
            self._companion.ready[fam] = False
            return Applied(ok=False, error=f"nft companion table: {exc}")
        t3 = time.perf_counter()
        if read_at is not None:
            self._kernel_read[fam] = read_at
        if batch.full:
            self._owed.discard(fam)
            self._filled.add(fam)
            if self._replaced and self._filled >= set(self.families):
                self._detach_replaced()
            if self._reattach and fam is self.families[-1] and time.monotonic() >= self._reattach_after:
                self._repair_programs()  # the maps hold everything again: the programs may read them
        self._reap_udp(batch)
        timings = {"plan": t1 - t0, "apply": t2 - t1, "nft": t3 - t2, **({"pipelined": t_write} if t_write else {})}
        if adopted is not None:  # the read of the maps and its decode (inside the ledger's "render" when it compared)
            timings.update(adopted.seconds)
            adopted.seconds = {}  # once per adoption: a later refusal round does not count them again
        figures = MappingProxyType(self._figures(fam, index, the_plan))
        return Applied(figures=figures, timings=MappingProxyType(timings), leftovers=the_plan.leftovers)

    def _write_maps(self, batch: BpfBatch, index: FamilyIndex) -> tuple[plan.Plan, list[Step], float, float]:
        """Plan the batch's map writes and execute them: (the plan, its steps, the seconds a writer thread wrote while
        planning went on, when planning ended). "apply" timings are the writes after planning ended."""
        fam = batch.family
        the_plan = plan.Plan(counting=self._names is not None)
        # an index holding nothing before this plan (a first sync into empty maps) has nothing to sweep after it: the
        # plan writes only frontends of wanted services, backends their slots name, names of those services
        was_empty = not (index.fronts or index.backends or index.rev_names)
        steps: list[Step] = []
        t_write = 0.0
        deltas = batch.deltas
        if len(deltas) < PIPELINE_SERVICES:
            for d in deltas:
                plan.plan_service(index, d.name, d.new_fragment, the_plan)
        else:
            with kernel.Writer(self._fds, fam) as writer:
                for start in range(0, len(deltas), PIPELINE_CHUNK):
                    for d in deltas[start : start + PIPELINE_CHUNK]:
                        plan.plan_service(index, d.name, d.new_fragment, the_plan)
                    chunk = the_plan.drain_puts()
                    steps += chunk
                    writer.submit(chunk)
                t_write = writer.finish()  # raises the first write error (what followed it was not written)
        if batch.full and not was_empty:
            plan.sweep(index, batch.wanted, the_plan)
        plan.finish_plan(the_plan)
        t1 = time.perf_counter()
        rest = the_plan.ordered()
        steps += rest
        kernel.run_steps(self._maps.family_fds(fam), fam, rest)
        return the_plan, steps, t_write, t1

    def _figures(self, fam: IPFamily, index: FamilyIndex, the_plan: plan.Plan) -> dict[str, int]:
        figures = {"map_writes": the_plan.writes, "service_entries": index.entries, "backends": len(index.backends)}
        self._counts[fam] = figures
        if self._metric_entries is not None:
            self._metric_entries.labels(ip_family=fam.value, map="service").set(index.entries)
            self._metric_entries.labels(ip_family=fam.value, map="backend").set(len(index.backends))
        return figures

    def _reap_udp(self, batch: BpfBatch) -> None:
        """Connected UDP sockets to backends a UDP service just lost are ended (see ``backends.bpf.sockets``), and
        those connected to a frontend that translates now and did not before (a Service deleted and created again:
        a socket connected in between went to the bare address, untranslated, and would stay there); only when the
        programs are attached (a benchmark has no sockets to end)."""
        if not self.attached or self._places is None:
            return
        gone = sockets.peers_to_end(
            ((d.old_fragment, d.new_fragment) for d in batch.deltas if d.name.protocol.value == "UDP"), MAX_FRESH_REAP
        )
        if gone:
            self.last_reap = self._reaper.submit(
                self._places.cgroup, gone, self._fds.get(("rev", batch.family)), batch.family
            )

    def counters(self, family: IPFamily) -> CounterDump | None:
        """New connections and flows per service port and endpoint, from one walk of the family's counter map
        (``counters.py``); None without ``--service-counters``."""
        if self._names is None or family not in self.families:
            return None
        return self._names.read(family, self._where())

    # -- benchmark floors, metrics, trace --------------------------------------------------------------------------

    def measure_floor(self, scratch: str) -> float | None:
        """The last full sync's map writes (built again: ``plan.full_steps``) into fresh empty maps of the same shape
        (``kernel.floor_full``); maps live outside namespaces, so ``scratch`` is not needed."""
        if (fam := self._last_full) is None:
            return None
        items, counting = list(self.applied_fragments(fam).items()), self._names is not None
        chunk = PIPELINE_CHUNK if len(items) >= PIPELINE_SERVICES else 0  # as ``_write_maps`` drains
        return kernel.floor_full(fam, plan.full_steps(fam, items, counting, chunk), self._where().map_size)

    def measure_partial_floor(self) -> Mapping[str, float] | None:
        """The last partial sync's map writes again, into the maps as they are (rewriting the same bytes)."""
        if self._last_partial is None or not self._fds:
            return None
        fam, steps = self._last_partial
        return {"floor_s": kernel.floor_partial(self._maps.family_fds(fam), steps)}

    def register_metrics(self, registry: Any, families: Iterable[IPFamily]) -> None:
        from prometheus_client import Gauge

        self._metric_entries = Gauge(
            "kproxy_bpf_map_entries",
            "Entries kproxy holds in the bpf mode's maps",
            ["ip_family", "map"],
            registry=registry,
        )

    def observe_sync(self, family: IPFamily, result: SyncResult, *, full: bool, ok: bool) -> None:
        """The refusal counter is fed in apply (where the reason is known); nothing more per sync."""

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any] | None:
        """Where a new connection would go, read from the maps themselves (``backends.bpf.trace``)."""
        fam = IPFamily.of(dst)
        if fam not in self.families or not self._fds:
            return None
        return trace.explain(
            self._maps.family_fds(fam),
            self.applied_fragments(fam),
            proto,
            dst,
            dport,
            src_local=src_local,
            dst_local=dst_local,
        )
