"""``BpfProxier``: the bpf mode on the core's ledger. A service's fragment is its socket frontends (the service-map
entries the programs read) and its share of the nftables companion table; ``apply`` turns a batch of fragment changes
into one ordered plan of map writes (``render.plan_service``), executed as a few ``BPF_MAP_*_BATCH`` calls, and one
nft transaction when the companion part changed.

Loading: ``start()`` creates or reopens the pinned maps, then compiles, loads and attaches the programs in a child
process (``loader.attach_in_child``: bcc and LLVM never enter kproxy's own memory, ~100 MB; the programs stay attached
to the cgroup when the child exits). A sync without ``start()`` (``kproxy bench sync``, tests of the maps alone)
only opens or creates the pinned maps. ``__init__`` touches nothing.

Adoption (full batches): the service, backend and names maps are read back (``maps.read_lb``: the backend array as far
as the highest id a slot names) and decoded (``backends.bpf.decode``); a service whose frontends, backends and flags
match, under a reverse-NAT id the names map gives to it, is not rewritten, so a restart with nothing changed writes
nothing. Frontends and backends nobody wants are removed at the end of a full batch (``render.sweep``; a first sync
into empty maps has none). kproxy's index of the maps (``render.FamilyIndex``) is the allocator of backend and
reverse-NAT ids; when a write fails the index is dropped and the next full sync rebuilds it from the kernel.

Capacity (cilium#12815: a full LB map fails silently there): ``limits`` declares what the maps hold, and the core
refuses a service port that would not fit before anything is rendered (``kproxy.admission``: reported with the reason
in ``/rules`` and ``kproxy_service_ports_refused``), so a full map, 65,536 service ports or 65,536 endpoints of one
port never fail a family's sync.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.admission import Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelProbe, LabNodeSpec, Option

from . import inspect, loader, maps, nft, render, sockets
from .render import Context, FamilyIndex, Fragment, Plan

log = logging.getLogger(__name__)

NEEDS_FULL_CHECK_S = 1.0
#: the maps and the companion table are read back (a full sync that adopts what the kernel holds, repairing what
#: someone changed by hand) at least this often; in between syncs trust kproxy's own index. Under the default 30 s
#: sync period every periodic sync reads them (0.2-0.5 s at 10,000 x 10 services here).
KERNEL_READ_S = 25.0
#: after a failed re-attach of the programs, the next attempt waits this long (a compile costs 1-4 s)
REATTACH_RETRY_S = 30.0
#: rules each fixed chain of the companion table holds (``render.fixed_commands``); fewer: someone flushed it
FIXED_RULES = {"kp-reject": 1, "services": 2, "nat-prerouting": 1, "nat-output": 1, "nat-postrouting": 1}


#: a batch of at least this many services is planned in chunks while a writer thread writes the previous chunk's
#: puts (the ``bpf(2)`` calls release the GIL: the kernel's share of a full sync, ~0.2 s at 10,000 x 10, overlaps
#: kproxy's planning on another core); smaller batches write inline
PIPELINE_SERVICES = 2048
PIPELINE_CHUNK = 1024
WRITER_SWITCH_INTERVAL = 0.0005  # seconds, while a writer runs (Python's default: 0.005)


Step = tuple[str, str, Sequence[bytes], Sequence[bytes]]  # (map role, "put" or "del", keys, values)


class _Writer:
    """One thread writing put phases in the order they are submitted; after a failed write it skips the rest (the
    first error is raised by ``finish``)."""

    def __init__(self, fds: Mapping[tuple[str, IPFamily], int], family: IPFamily) -> None:
        self._fds, self._family = fds, family
        self._queue: queue.SimpleQueue[list[Step] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._busy = 0.0
        self._thread = threading.Thread(target=self._run, name="bpf-map-writer", daemon=True)
        # the writer needs the GIL back after every bpf(2) call while the sync thread plans: at the default 5 ms
        # switch interval that wait doubled its time (0.2 s of waits for 0.25 s of writes at 10,000 x 10)
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, WRITER_SWITCH_INTERVAL))
        self._thread.start()

    def submit(self, steps: list[Step]) -> None:
        self._queue.put(steps)

    def _run(self) -> None:
        while (steps := self._queue.get()) is not None:
            if self._error is not None:
                continue
            t0 = time.perf_counter()
            try:
                for role, _op, keys, values in steps:
                    maps.update_batch(self._fds[(role, self._family)], keys, values)
            except BaseException as exc:  # handed to the sync thread by finish()
                self._error = exc
            self._busy += time.perf_counter() - t0

    def finish(self) -> float:
        """Wait for every submitted write; the seconds spent writing. Raises the first write error."""
        self._queue.put(None)
        self._thread.join()
        sys.setswitchinterval(self._interval)
        if self._error is not None:
            raise self._error
        return self._busy


def run_steps(fds: Mapping[str, int], family: IPFamily, steps: Iterable[Step]) -> None:
    """Execute a plan's steps on the maps ``fds`` (role -> fd): puts as batch updates; deletes as batch deletes, of
    the backend array as all-zero values (an array refuses deletes; zero is "no backend" to the programs)."""
    for role, op, keys, values in steps:
        fd = fds[role]
        if op == "put":
            maps.update_batch(fd, keys, values)
        elif role == "be":
            maps.update_batch(fd, keys, maps.zero_values(len(keys), maps.key_sizes(family)["be"][1]))
        else:
            _delete(fd, keys)


def _delete(fd: int, keys: Sequence[bytes]) -> None:
    try:
        maps.delete_batch(fd, keys)
    except maps.BpfError as exc:
        if exc.errno != errno.ENOENT:
            raise
        # the batch stops at a key that is already gone (a half-applied earlier round): one by one
        for k in keys:
            try:
                maps.delete_batch(fd, [k])
            except maps.BpfError as e:
                if e.errno != errno.ENOENT:
                    raise


@dataclass
class Adopted:
    """What ``adopt`` read: the rebuilt index, the decoded view, reverse-NAT id use counts, the companion table."""

    index: FamilyIndex
    view: render.View
    rev_counts: Counter[int]
    nft: nft.NftView
    #: set when the maps were not read (see ``adopt``): what the ledger records as applied
    trusted: Mapping[ServicePortName, Fragment] | None = None
    #: (verify) why no socket is translated from these maps: pins gone, programs detached or reading other maps
    problem: str | None = None
    #: (verify) why the companion table does not work: a fixed chain lost its rules
    nft_problem: str | None = None


#: (family, all local, CIDRs, primary addresses) -> the companion table's ``nodeport-cidrs`` elements
_NODEPORT_CIDRS: dict[tuple[IPFamily, bool, tuple[str, ...], tuple[str, ...]], tuple[str, ...]] = {}


BpfBatch = Batch[Fragment, Context, Adopted, None]


class BpfProxier(LedgerProxier[Fragment, Context, Adopted, Adopted, None]):
    """The bpf mode (see ``backends/bpf/__init__.py``)."""

    mode: ClassVar[str] = "bpf"
    CHECK_INTERVAL_S: ClassVar[float | None] = NEEDS_FULL_CHECK_S
    # the socket path translates before conntrack sees anything, but the companion table NATs external traffic
    uses_conntrack_nat: ClassVar[bool] = True
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
            "entries of the service map and the backend array (default holds 10,000 services x 50 endpoints; the "
            "array is preallocated: 8 bytes per entry for IPv4 and 24 for IPv6, 32 MB at the default); a service "
            "that does not fit is refused with the reason and counted in kproxy_service_ports_refused",
        ),
    )

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        super().__init__(config, netns=netns)
        self._places: loader.Places | None = None
        self._fds: dict[tuple[str, IPFamily], int] = {}
        self._index: dict[IPFamily, FamilyIndex | None] = {f: None for f in self.families}
        self._nft_ready: dict[IPFamily, bool] = {f: False for f in self.families}
        # the services whose fragments have a companion part: the table exists only while this is not empty; the
        # ``nodeport-cidrs`` elements written (None: unknown)
        self._nft_users: dict[IPFamily, set[ServicePortName]] = {f: set() for f in self.families}
        self._nft_cidrs: dict[IPFamily, tuple[str, ...] | None] = {f: None for f in self.families}
        self._kernel_read: dict[IPFamily, float] = {}
        # the repair of someone else's flush (``_check_kernel``): families owed a full sync that reads the kernel,
        # the map ids kproxy's fds hold, fds of unpinned maps (closed once the UDP reaper is idle), programs to attach
        self._owed: set[IPFamily] = set()
        self._held_ids: dict[tuple[str, IPFamily], int] = {}
        self._retired: list[int] = []
        self._reattach = False
        self._reattach_after = 0.0
        self._metric_entries: Any = None
        self._counts: dict[IPFamily, dict[str, int]] = {}  # the last apply's figures per family, for describe()
        self.attached: list[str] = []
        self._reaper = sockets.Reaper()
        self.last_reap: Future[int] | None = None
        self._last_full: tuple[IPFamily, list[Step]] | None = None
        self._last_partial: tuple[IPFamily, list[Step]] | None = None

    # -- hooks ----------------------------------------------------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        try:
            import bcc  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        except Exception as exc:  # bcc raises OSError when libbcc is missing
            return Availability(False, f"bcc (python3-bpfcc) is not importable: {type(exc).__name__}: {exc}")
        if os.geteuid() != 0:
            return Availability(False, "the bpf mode needs root (bpf(2), cgroup attachments)")
        release = os.uname().release
        # bcc's own order: BCC_KERNEL_SOURCE (the image's merged tree, deploy/Dockerfile), the release's build
        # folder, the kernel's built-in archive
        source = os.environ.get("BCC_KERNEL_SOURCE")
        if source:
            if not Path(source, "include", "linux", "kconfig.h").exists():
                return Availability(False, f"BCC_KERNEL_SOURCE={source} holds no kernel headers (include/linux)")
        elif not Path(f"/lib/modules/{release}/build").exists() and not Path("/sys/kernel/kheaders.tar.xz").exists():
            return Availability(False, f"no kernel headers for bcc: /lib/modules/{release}/build is missing")
        if not Path("/sys/kernel/btf/vmlinux").exists():
            return Availability(False, "the kernel has no BTF (/sys/kernel/btf/vmlinux): too old for the bpf mode")
        return Availability(True)

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
        """The node's own cgroup, and a pin folder keyed by the node's namespace (never the host's folder)."""
        # the node's kproxy runs under `ip netns exec` (a fresh /sys): it reaches the machine's bpffs through this
        loader.ensure_host_bind()
        out: dict[str, Any] = {}
        if node.cgroup is not None and "bpf_cgroup_path" not in options:
            out["bpf_cgroup_path"] = str(node.cgroup)
        if "bpf_pin_path" not in options:
            out["bpf_pin_path"] = str(loader.PIN_ROOT / f"lab-{node.netns}")
        return out

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        return inspect.remnants(probe)

    @classmethod
    def kernel_view(cls, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
        return inspect.kernel_view(probe, family)

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        inspect.cleanup(config.backend_options, netns)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _where(self) -> loader.Places:
        if self._places is None:
            self._places = loader.places(self.option_values(self.config.backend_options), self.netns)
        return self._places

    #: the maps a sync reads and writes (the LRU maps belong to the programs alone)
    SYNC_ROLES: ClassVar[tuple[str, ...]] = ("svc", "be", "name")

    def _ensure_maps(self, every: bool = False) -> None:
        """Open (or create and pin) the maps syncs use, of this kproxy's families; ``every``: all maps of both
        families, as the programs need them (``start``). A benchmark never pays for the LRU maps' preallocation."""
        want = (
            [(r, f) for f in (IPFamily.V4, IPFamily.V6) for r in maps.ROLES]
            if every
            else [(r, f) for f in self.families for r in self.SYNC_ROLES]
        )
        missing = [k for k in want if k not in self._fds]
        if not missing:
            return
        p = self._where()
        if not self._fds:
            loader.ensure_places(p)
            inspect.record_places(p, self.netns)
        for role, fam in missing:
            self._fds[(role, fam)] = loader.open_or_create(p, role, fam)

    def start(self) -> None:
        """Compile the programs, pin or reopen the maps, attach to the cgroup (replacing an older kproxy's copies)."""
        p = self._where()
        loader.ensure_places(p)
        inspect.record_places(p, self.netns)
        self._ensure_maps(every=True)  # created with the programs' specs: the compiler reopens them
        self.attached = loader.attach_in_child(p)
        log.info("bpf: attached %s to %s", ", ".join(self.attached), p.cgroup)

    def close(self) -> None:
        self._reaper.close()  # it reads the reverse-NAT map: before the fds go
        for fd in [*self._fds.values(), *self._retired]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._retired.clear()
        self._held_ids.clear()
        nft.release(self.netns)

    def cleanup(self) -> None:
        self.close()
        super().cleanup()
        self._index = {f: None for f in self.families}
        self._nft_ready = {f: False for f in self.families}
        self._nft_users = {f: set() for f in self.families}
        self._nft_cidrs = {f: None for f in self.families}

    # -- ledger hooks ---------------------------------------------------------------------------------------------

    def context(self, node: FamilyContext, state: ProxyState) -> Context:
        key = (node.family, node.nodeport_all_local, node.nodeport_cidrs, node.nodeport_ips)
        cidrs = _NODEPORT_CIDRS.get(key)
        if cidrs is None:
            if len(_NODEPORT_CIDRS) > 64:
                _NODEPORT_CIDRS.clear()
            cidrs = _NODEPORT_CIDRS[key] = render.nodeport_cidrs(*key)
        return Context(node.family, tuple(sorted(node.nodeport_addresses)), cidrs)

    def render(self, sp: ServicePort, ctx: Context) -> Fragment:
        return render.render(sp, ctx)

    def adopt(self, family: IPFamily, ctx: Context) -> Adopted:
        """What the maps hold. Read from the kernel at the first sync, after a failure and at least every
        ``KERNEL_READ_S`` (``sync`` owes it); in between, a full sync trusts kproxy's index of what it wrote (what
        someone else flushed or deleted, pins, programs or the companion table, is noticed by ``_check_kernel``
        within a second of the next sync), so it costs a render, not a decode of every entry."""
        self._ensure_maps()
        cur = self._index[family]
        if cur is not None and time.monotonic() - self._kernel_read.get(family, 0.0) < KERNEL_READ_S:
            present = self._nft_ready[family]
            return Adopted(
                cur, {}, Counter(), nft.NftView(present, frozenset(), frozenset()), self.applied_fragments(family)
            )
        self._kernel_read[family] = time.monotonic()
        return self._read_kernel(family)

    def _read_kernel(self, family: IPFamily) -> Adopted:
        """The maps and the companion table as the kernel holds them now (read-only; any thread)."""
        fds = self._fds
        raw = maps.read_lb(fds[("svc", family)], fds[("be", family)], fds[("name", family)], family)
        index, view = render.index_from_raw(family, raw["svc"], raw["be"], raw["name"])
        counts = Counter(v[3] for v in view.values())
        table, _why = self._nft_checked(family)
        return Adopted(index, view, counts, table)

    def _nft_checked(self, family: IPFamily) -> tuple[nft.NftView, str | None]:
        """The companion table as read, less the chains that lost rules (a flushed table keeps chains and elements,
        not rules): a fixed chain short of rules drops ``services`` (the fixed part is written again), a service
        chain whose rule count differs from what its (digest-named) rules say is written again; and why, if so."""
        v = nft.read(family, self.netns)
        if not v.present:
            return v, None
        drop: set[str] = set()
        why = None
        short = [c for c, n in FIXED_RULES.items() if v.rules.get(c, 0) != n]
        if short:
            drop.add("services")
            why = f"companion chain {short[0]} holds {v.rules.get(short[0], 0)} rules, wanted {FIXED_RULES[short[0]]}"
        # a chain's name carries the digest of its rules, so any fragment naming it says how many it holds; a chain
        # no applied service names is left as it is (a full sync deletes it when nobody wants it)
        want = {c: len(rules) for frag in self.applied_fragments(family).values() for c, rules in frag.nft.chains}
        drop.update(c for c in v.chains if c in want and v.rules.get(c, 0) != want[c])
        if not drop:
            return v, None
        return nft.NftView(True, v.chains - drop, v.elements, v.rules), why

    def _read_pinned(self, family: IPFamily) -> Adopted:
        """What the pins hold now, read through fds of its own (never kproxy's: those keep a map alive after someone
        unpinned it), with the programs' state when kproxy attached them (read-only; any thread)."""
        p = self._where()
        raw: dict[str, tuple[bytes, bytes]] = {role: (b"", b"") for role in self.SYNC_ROLES}
        gone = []
        fds: dict[str, int] = {}
        try:
            for role in self.SYNC_ROLES:
                try:
                    fds[role] = maps.obj_get(str(p.pin(role, family)))
                except FileNotFoundError:
                    gone.append(maps.pin_name(role, family))
            if not gone:
                raw = maps.read_lb(fds["svc"], fds["be"], fds["name"], family)
            elif "svc" in fds and "name" in fds:  # the backend array gone: what the service map still says
                ks = maps.key_sizes(family)
                raw.update(svc=maps.lookup_raw(fds["svc"], *ks["svc"]), name=maps.lookup_raw(fds["name"], *ks["name"]))
        finally:
            for fd in fds.values():
                os.close(fd)
        index, view = render.index_from_raw(family, raw["svc"], raw["be"], raw["name"])
        counts = Counter(v[3] for v in view.values())
        table, nft_problem = self._nft_checked(family)
        problem = f"pinned map {gone[0]} missing in {p.pin_dir}" if gone else None
        if problem is None and self.attached:
            problem = loader.programs_problem(p, loader.pinned_ids(p), (family,))
        return Adopted(index, view, counts, table, problem=problem, nft_problem=nft_problem)

    def verify_view(self, family: IPFamily, ctx: Context) -> Adopted:
        """Always the kernel through the pins (never the trusted index, never kproxy's own fds), the programs'
        attachments and the companion table's rules."""
        return self._read_pinned(family)

    def verify_service(self, view: Adopted, name: ServicePortName, fragment: Fragment) -> str | None:
        a = view
        fronts = render.decoded(fragment)
        held = {k: a.view[k] for k in fronts if k in a.view}
        if not held and not any(e in a.nft.elements for e in fragment.nft.elements):
            return "missing"
        if a.problem is not None:  # the maps may be right, but no socket is translated from them
            return f"different: {a.problem}"
        if a.nft_problem is not None and not fragment.nft.empty:
            return f"different: {a.nft_problem}"
        if self.adopted_unchanged(view, name, fragment):
            return None
        for k, want in fronts.items():
            got = a.view.get(k)
            if got is None:
                return f"different: frontend {k[0]}:{k[1]}/{k[2]} missing"
            if got[:3] != want:
                return f"different: frontend {k[0]}:{k[1]}/{k[2]} holds {got[:3]}, wanted {want}"
        missing = [e for e in fragment.nft.elements if e not in a.nft.elements]
        if missing:
            return f"different: companion element {' '.join(missing[0])} missing"
        lost = [c for c, _ in fragment.nft.chains if c not in a.nft.chains]
        if lost:
            return f"different: companion chain {lost[0]} missing or not holding its rules"
        return "different: reverse-NAT id or name"

    def verify_extra(self, view: Adopted, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
        a = view
        keys = {render.service_key(n) for n in wanted}
        out = []
        for k, got in a.view.items():
            owner = a.index.rev_names.get(got[3])
            if owner not in keys:
                out.append(f"frontend {k[0]}:{k[1]}/{k[2]}: not wanted (rev_nat {got[3]}, {owner or 'unnamed'})")
        want_elems = {e for f in wanted.values() for e in f.nft.elements}
        out += [f"nft element {m} {k} : {v}: not wanted" for m, k, v in sorted(a.nft.elements - want_elems)]
        return out

    def adopted_unchanged(self, adopted: Adopted, name: ServicePortName, fragment: Fragment) -> bool:
        a = adopted
        if a.trusted is not None:
            return a.trusted.get(name) == fragment
        if not a.view:  # the maps hold no frontend (a first sync): nothing is there already
            return False
        if not render.unchanged(a.index, a.view, a.rev_counts, name, fragment):
            return False
        if not a.nft.present and fragment.nft.empty:
            return True
        return all(c in a.nft.chains for c, _ in fragment.nft.chains) and all(
            e in a.nft.elements for e in fragment.nft.elements
        )

    def needs_full(self, family: IPFamily) -> bool:
        """Asked by the ledger at most every ``CHECK_INTERVAL_S`` per family. For the first family: are the pinned
        maps the ones kproxy writes, are its programs attached and reading them, is the companion table there? What
        someone flushed or deleted (the pins, the attachments, the table: ``kproxy cleanup`` of another process does
        all three) is put back: the maps made and pinned again (empty) and their family owed a full sync that reads
        the kernel and writes everything, the programs attached again after it (``apply``). A few bpf(2) calls and
        one ``list tables``. A family is also owed a full batch when its read-back is due (``KERNEL_READ_S``: its
        adopt reads the kernel, and its writes put back what someone edited in place)."""
        if family is self.families[0] and self._fds:
            try:
                self._check_kernel_now()
            except (OSError, RuntimeError, ValueError, nft.NftError) as exc:  # never a reason to fail the sync
                log.warning("bpf: checking that the kernel state is still there failed: %s", exc)
        if family in self._owed:
            self._owed.discard(family)
            return True
        read = self._kernel_read.get(family)
        return read is not None and time.monotonic() - read >= KERNEL_READ_S

    def _check_kernel_now(self) -> None:
        if self._retired and (self.last_reap is None or self.last_reap.done()):
            for fd in self._retired:
                os.close(fd)
            self._retired.clear()
        p = self._where()
        for k, fd in self._fds.items():
            if k not in self._held_ids:
                self._held_ids[k] = loader.map_id(fd)
        pinned = loader.pinned_ids(p)
        lost = sorted({k for k, i in self._held_ids.items() if pinned.get(k) != i}, key=str)
        if lost:
            log.warning(
                "bpf: pinned maps gone or replaced in %s (%s): pinning new ones, full resync",
                p.pin_dir,
                ", ".join(maps.pin_name(r, f) for r, f in lost),
            )
            # the old maps stay alive while an fd holds them: retired, closed once the reaper cannot use them
            self._retired += self._fds.values()
            self._fds.clear()
            self._held_ids.clear()
            self._ensure_maps(every=bool(self.attached))
            for f in self.families:
                self._index[f] = None
                self._kernel_read.pop(f, None)
                self._owed.add(f)
            pinned = loader.pinned_ids(p)
        if self.attached and not self._reattach:
            why = loader.programs_problem(p, pinned, self.families)
            if why is not None:
                log.warning("bpf: %s: attaching the programs again after the next sync", why)
                self._reattach = True
                self._reattach_after = 0.0
                self._owed.update(self.families)  # a sync now, so the programs come back at once
        for f in self.families:
            if self._nft_ready[f] and not nft.table_present(f, self.netns):
                log.warning("bpf: the companion table %s (%s) is gone: full resync", render.TABLE, f.value)
                self._nft_ready[f] = False
                self._kernel_read.pop(f, None)
                self._owed.add(f)

    def _repair_programs(self) -> None:
        """Compile and attach the programs again (``loader.attach_in_child``: the same as ``start``)."""
        p = self._where()
        try:
            self._ensure_maps(every=True)
            self.attached = loader.attach_in_child(p)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            self._reattach_after = time.monotonic() + REATTACH_RETRY_S
            log.error("bpf: attaching the programs again failed (next try in %.0f s): %s", REATTACH_RETRY_S, exc)
            return
        self._reattach = False
        log.info("bpf: attached %s to %s again", ", ".join(self.attached), p.cgroup)

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

    # -- apply ----------------------------------------------------------------------------------------------------

    def limits(self, family: IPFamily) -> Limits:
        """What the maps hold (the core refuses a service port that does not fit, before it is rendered): the
        service map ``--bpf-map-size`` entries (a master and a slot per backend, per frontend), the backend array as
        many backends less one (id 0 is "none"), 65,535 reverse-NAT ids and 65,535 slots per frontend (16 bits
        each)."""
        size = self._where().map_size
        return Limits(service_ports=0xFFFF, endpoints_per_port=0xFFFF, entries=size, endpoints=size - 1)

    def apply(self, batch: BpfBatch) -> Applied:
        fam = batch.family
        if not batch.full and not batch.deltas:
            return Applied()  # nothing of this family changed
        t0 = time.perf_counter()
        self._ensure_maps()
        adopted: Adopted | None = batch.adopted
        if batch.full:
            index = adopted.index if adopted is not None else self.adopt(fam, batch.context).index
        else:
            cur = self._index[fam]
            if cur is None:
                return Applied(ok=False, error="the map index is unknown after a failure: a full sync rebuilds it")
            index = cur
        plan = Plan()
        # an index holding nothing before this plan (a first sync into empty maps) has nothing to sweep after it: the
        # plan writes only frontends of wanted services, backends their slots name, names of those services
        was_empty = not (index.fronts or index.backends or index.rev_names)
        if batch.full and index.unclaimed():
            for name, frag in batch.wanted.items():
                render.claim(index, name, frag)
            if len(batch.deltas) != len(batch.wanted):
                for d in batch.deltas:
                    if d.name not in batch.wanted:
                        render.claim(index, d.name, None)
        # until this batch is fully in, the index may not match the kernel: a full sync then reads the maps again
        read_at = self._kernel_read.pop(fam, None)
        steps: list[Step] = []  # the exact payload, for the benchmark's floors
        writer = _Writer(self._fds, fam) if len(batch.deltas) >= PIPELINE_SERVICES else None
        t_write = 0.0
        try:
            try:
                deltas = batch.deltas
                if writer is None:
                    for d in deltas:
                        render.plan_service(index, d.name, d.new_fragment, plan)
                else:
                    for start in range(0, len(deltas), PIPELINE_CHUNK):
                        for d in deltas[start : start + PIPELINE_CHUNK]:
                            render.plan_service(index, d.name, d.new_fragment, plan)
                        chunk = plan.drain_puts()
                        steps += chunk
                        writer.submit(chunk)
                if batch.full and not was_empty:
                    render.sweep(index, batch.wanted, plan)
                render.finish_plan(plan)
            finally:
                if writer is not None:
                    t_write = writer.finish()  # raises the first write error (what followed it was not written)
            t1 = time.perf_counter()
            rest = plan.ordered()
            steps += rest
            self._execute_steps(fam, rest)
        except maps.BpfError as exc:
            self._index[fam] = None
            self._kernel_read.pop(fam, None)
            why = "a BPF map is full (E2BIG)" if exc.errno == errno.E2BIG else str(exc)
            return Applied(ok=False, error=f"bpf map write failed: {why}")
        except BaseException:  # a planning error (no reverse-NAT id left): the index may not match the maps now
            self._index[fam] = None
            self._kernel_read.pop(fam, None)
            raise
        if steps:
            if batch.full:
                self._last_full = (fam, steps)
            else:
                self._last_partial = (fam, steps)
        t2 = time.perf_counter()
        plan.release(index)
        self._index[fam] = index
        try:
            self._apply_nft(batch, adopted, set())
        except nft.NftError as exc:
            self._nft_ready[fam] = False
            self._kernel_read.pop(fam, None)
            return Applied(ok=False, error=f"nft companion table: {exc}")
        t3 = time.perf_counter()
        if read_at is not None:
            self._kernel_read[fam] = read_at
        if batch.full:
            self._owed.discard(fam)
            if self._reattach and fam is self.families[-1] and time.monotonic() >= self._reattach_after:
                self._repair_programs()  # the maps hold everything again: the programs may read them
        self._reap_udp(batch)
        figures = {"map_writes": plan.writes, "service_entries": index.svc_entries, "backends": len(index.backends)}
        self._counts[fam] = figures
        if self._metric_entries is not None:
            self._metric_entries.labels(ip_family=fam.value, map="service").set(index.svc_entries)
            self._metric_entries.labels(ip_family=fam.value, map="backend").set(len(index.backends))
        return Applied(
            figures=MappingProxyType(figures),
            # "apply": the map writes after planning ended; "pipelined": those written meanwhile (another thread)
            timings=MappingProxyType(
                {"plan": t1 - t0, "apply": t2 - t1, "nft": t3 - t2, **({"pipelined": t_write} if writer else {})}
            ),
        )

    def _reap_udp(self, batch: BpfBatch) -> None:
        """Connected UDP sockets to backends a UDP service just lost are ended (see ``backends.bpf.sockets``); only
        when the programs are attached (a benchmark has no sockets to end)."""
        if not self.attached or self._places is None:
            return
        gone: set[tuple[str, int]] = set()
        for d in batch.deltas:
            if d.name.protocol.value != "UDP" or d.old_fragment is None:
                continue
            old = {b for f in d.old_fragment.frontends for b in f.backends}
            new = {b for f in d.new_fragment.frontends for b in f.backends} if d.new_fragment is not None else set()
            gone |= old - new
        if gone:
            self.last_reap = self._reaper.submit(
                self._places.cgroup, gone, self._fds.get(("rev", batch.family)), batch.family
            )

    def _execute_steps(self, fam: IPFamily, steps: list[Step]) -> None:
        run_steps({role: self._fds[(role, fam)] for role in self.SYNC_ROLES}, fam, steps)

    def _apply_nft(self, batch: BpfBatch, adopted: Adopted | None, names: set[ServicePortName]) -> None:
        """The companion table's share of a batch. The table exists only while some service has a companion part
        (NodePorts, externalIPs, LB IPs, services without endpoints or with Local policy and no local endpoint):
        its nat chains and ct rules turn conntrack on for every packet of the namespace, pod-to-pod traffic
        included, so when the last such service goes the table goes with it."""
        fam = batch.family
        t = f"{'ip' if fam == IPFamily.V4 else 'ip6'} {render.TABLE}"
        users = self._nft_users[fam]
        if batch.full:
            users.clear()
            users.update(n for n, f in batch.wanted.items() if not f.nft.empty)
        else:
            for d in batch.deltas:
                if d.new_fragment is not None and not d.new_fragment.nft.empty:
                    users.add(d.name)
                else:
                    users.discard(d.name)
        cidrs = batch.context.nodeport_cidrs
        if not users:
            if batch.full and adopted is not None and adopted.trusted is None:
                present = adopted.nft.present
            elif batch.full and adopted is None:
                present = nft.table_present(fam, self.netns)
            else:
                present = self._nft_ready[fam]
            if present:
                nft.delete_table(fam, self.netns)
            self._nft_ready[fam] = False
            self._nft_cidrs[fam] = None
            return
        first: list[str] = []
        mid: list[str] = []
        last: list[str] = []
        if batch.full:
            if adopted is not None and adopted.trusted is not None:
                chains: set[str] = set()
                elems: set[tuple[str, str, str]] = set()
                for frag in adopted.trusted.values():
                    chains.update(c for c, _ in frag.nft.chains)
                    elems.update(frag.nft.elements)
                base = {"services"} if adopted.nft.present else set()
                view = nft.NftView(adopted.nft.present, frozenset(chains | base), frozenset(elems))
            else:
                view = adopted.nft if adopted is not None else nft.read(fam, self.netns)
            want_chains: dict[str, tuple[str, ...]] = {}
            want_elems: set[tuple[str, str, str]] = set()
            for frag in batch.wanted.values():
                want_chains.update(frag.nft.chains)
                want_elems.update(frag.nft.elements)
            if view.present and view.sets is not None and render.NODEPORT_CIDRS not in view.sets:
                # an older layout (its NodePort rule matched any local address, loopback too): written again whole
                first += [f"add table {t}", f"delete table {t}"]
                view = nft.NftView(False, frozenset(), frozenset())
            elif view.sets is not None:
                self._nft_cidrs[fam] = view.sets.get(render.NODEPORT_CIDRS)
            if not view.present or not self._nft_ready[fam] or "services" not in view.chains:
                first += render.fixed_commands(fam)
                self._nft_cidrs[fam] = None if view.present else ()
            if self._nft_cidrs[fam] != cidrs:
                first += render.nodeport_cidr_commands(fam, cidrs)
            for name, rules in want_chains.items():
                if name not in view.chains:
                    # flushed too: a chain someone emptied (or cut short) gets its rules once, not appended twice
                    first += [f"add chain {t} {name}", f"flush chain {t} {name}"]
                    first += [f"add rule {t} {name} {r}" for r in rules]
            want_keys = {(m, k): v for m, k, v in want_elems}
            for m, k, v in view.elements:
                if want_keys.get((m, k)) != v:
                    mid.append(f"delete element {t} {m} {{ {k} }}")
            for m, k, v in want_elems:
                if (m, k, v) not in view.elements:
                    mid.append(f"add element {t} {m} {{ {k} : {v} }}")
            for name in view.chains:
                if (name.startswith("s-") or name.startswith("f-")) and name not in want_chains:
                    last.append(f"delete chain {t} {name}")
        else:
            for d in batch.deltas:
                o = d.old_fragment.nft if d.old_fragment is not None else None
                n = d.new_fragment.nft if d.new_fragment is not None else None
                if (o is None or o.empty) and (n is None or n.empty):
                    continue
                a, b, c = render.nft_changes(fam, o, n)
                first += a
                mid += b
                last += c
            if (first or mid or last) and not self._nft_ready[fam]:
                first = render.fixed_commands(fam) + render.nodeport_cidr_commands(fam, cidrs) + first
        if not (first or mid or last):
            return
        # deletes before adds inside the element phase: a changed element is deleted, then added
        mid = render.group_elements(mid)
        # a firewall chain jumps to its service chain: it goes first, or the kernel refuses (EBUSY)
        last.sort(key=lambda c: 0 if " f-" in c else 1)
        nft.run("\n".join(first + mid + last) + "\n", self.netns)
        self._nft_ready[fam] = True
        self._nft_cidrs[fam] = cidrs

    # -- benchmark floors -----------------------------------------------------------------------------------------

    def measure_floor(self) -> float | None:
        """The last full sync's exact map writes (same batches, same order) into fresh empty maps of the same shape:
        the kernel's own time for that payload."""
        if self._last_full is None:
            return None
        fam, steps = self._last_full
        size = self._where().map_size
        fds = {role: maps.create_like(role, fam, size) for role in self.SYNC_ROLES}
        try:
            t0 = time.perf_counter()
            run_steps(fds, fam, steps)
            return time.perf_counter() - t0
        finally:
            for fd in fds.values():
                os.close(fd)

    def measure_partial_floor(self) -> Mapping[str, float] | None:
        """The last partial sync's map writes again, into the maps as they are (rewriting the same bytes)."""
        if self._last_partial is None or not self._fds:
            return None
        fam, steps = self._last_partial
        t0 = time.perf_counter()
        for role, op, keys, values in steps:
            if op == "put":
                maps.update_batch(self._fds[(role, fam)], keys, values)
        puts = time.perf_counter() - t0
        return {"floor_s": puts}

    # -- metrics, trace -------------------------------------------------------------------------------------------

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
        """Where a new connection would go, read from the maps themselves (a few lookups, no lock): the frontend's
        master entry, each slot's backend id and the backend's address. A socket of the node's cgroup is translated
        at connect; other packets (``src_local`` False) meet the companion table, whose elements are listed too."""
        fam = IPFamily.of(dst)
        if fam not in self.families or not self._fds:
            return None
        pnum = maps.PROTO_NUMBERS.get(proto.upper(), 0)
        ks = maps.key_sizes(fam)
        fd_svc, fd_be, fd_name = (self._fds[(r, fam)] for r in ("svc", "be", "name"))
        front = f"{dst}:{dport}/{proto.upper()}" if fam == IPFamily.V4 else f"[{dst}]:{dport}/{proto.upper()}"
        raw = maps.lookup(fd_svc, maps.lb_key(fam, dst, dport, pnum, 0), ks["svc"][1])
        companion = [
            f"nft {render.TABLE}: {m} {k} : {v}"
            for frag in self.applied_fragments(fam).values()
            for m, k, v in frag.nft.elements
            if k.startswith(f"{dst} . {proto.lower()} . {dport}") or (dst_local and k == f"{proto.lower()} . {dport}")
        ]
        if raw is None:
            return {"outcomes": [{"probability": 1.0, "verdict": "not a frontend: not translated", "rules": companion}]}
        _bid, aff, count, rev, flags = maps.decode_service(raw)
        name_raw = maps.lookup(fd_name, maps.name_key(rev), maps.NAME_VAL.size)
        name = maps.decode_name(name_raw) if name_raw else f"rev_nat_id {rev}"
        head = [
            f"{render.TABLE} svc {front} slot 0: count={count} flags={flags:#x} affinity={aff}s rev_nat={rev} ({name})"
        ]
        if flags & maps.F_REJECT:
            verdict = "reject: connect()/sendmsg() fail with ECONNREFUSED" if src_local else "reject (companion table)"
            return {"service": name, "outcomes": [{"probability": 1.0, "verdict": verdict, "rules": head + companion}]}
        if flags & maps.F_DROP or count == 0:
            verdict = "not translated; dropped by the companion table"
            return {"service": name, "outcomes": [{"probability": 1.0, "verdict": verdict, "rules": head + companion}]}
        outcomes = []
        for slot in range(1, count + 1):
            sraw = maps.lookup(fd_svc, maps.lb_key(fam, dst, dport, pnum, slot), ks["svc"][1])
            if sraw is None:
                continue
            bid = maps.decode_service(sraw)[0]
            braw = maps.lookup(fd_be, maps.backend_key(bid), ks["be"][1])
            if braw is None or not any(braw):  # an array entry of no backend is all zero
                continue
            a, p, _ = maps.decode_backend(fam, braw)
            target = f"{a}:{p}" if fam == IPFamily.V4 else f"[{a}]:{p}"
            rules = [*head, f"slot {slot} -> backend {bid} {target}"]
            outcomes.append(
                {
                    "probability": round(1.0 / count, 4),
                    "verdict": f"socket connected to {target}" if src_local else f"DNAT to {target}",
                    "masquerade": False,
                    "rules": rules if src_local else rules + companion,
                }
            )
        return {"service": name, "affinitySeconds": aff if flags & maps.F_AFFINITY else 0, "outcomes": outcomes}
