"""``kproxy bench sync``: how long the cache and a backend take to program N services x E endpoints, from empty
and after one endpoint changes, next to the kernel's own time for the same payload (docs/PERFORMANCE.md).

A real backend runs in a throwaway network namespace ``kpb-<pid>``: the command re-executes itself inside it
(``ip netns exec kpb-<pid> python -P -m kproxy.bench bench sync ... --inside``; ``-P``: the working directory stays
off ``sys.path``) and deletes the namespace afterwards, also when the run fails or is interrupted; a namespace left
by a killed run (its pid is gone) is removed by the next. ``--mode fake`` times the cache alone and needs no
namespace. ``--state mixed`` replaces the default state (ClusterIP services only, as every published figure) with
kproxy.bench.mixed's: NodePorts, externalIPs, load-balancer IPs, ``externalTrafficPolicy: Local`` and services
without endpoints among them. Any service the core or the kernel refuses fails the run: every synthetic service has
addresses and ports of its own. In the default state ``--ports-every N`` gives every Nth service three ports
(``services`` counts Services, ``service_ports`` what the cache and the ledger hold) and ``--udp-every N`` makes
every Nth service UDP (1: all of them; 0: none).

Phases, each timed with ``time.perf_counter``:
- ``absorb_s``: feeding every Service and EndpointSlice to ``ServiceCache`` as a list (``replace_services`` and
  ``replace_slices``, as kproxy.sources.kube does), the cache's time alone: the objects are generated a page (500)
  at a time, each page timed apart and left out (``generate_s``; a real process decodes them from JSON instead), so
  only one page is alive at once (the ``absorb`` phase's memory and CPU time include the generator's);
- ``snapshot_s``: the first ``snapshot()`` (all services recomputed);
- ``full_sync_s``: that snapshot plus the backend's first (full) ``sync`` and the ``commit``;
- ``partial_sync_s``: median over ``--repeat`` runs of: one endpoint of one service changes (``upsert_slice``),
  ``snapshot``, ``sync``, ``commit``;
- ``floor_s``: ``backend.measure_floor(scratch)`` (the kernel alone taking the full payload; None for fake), and
  ``ratio`` = full_sync_s / floor_s; ``floor_user_s`` / ``floor_sys_s``: the CPU time of the floor's tool where the
  floor runs one (``iptables-restore``, the userspace mode's ``nft -f``), its own parsing (user) and the kernel
  taking the transaction plus the tool's own page faults (system); the nftables mode's floor runs no tool: it sends
  kproxy's own transactions, encoded beforehand, into the empty namespace (``kernel.netlink_floor``); ``render_s``:
  the backend's own ``timings["render"]`` of the full sync;
- ``partial_apply_s``: median of the backend's ``timings["apply"]`` in the partial runs (the kernel's share of a
  partial sync: what is left of ``partial_sync_s`` is kproxy's own work);
- ``partial_floor_s``: ``backend.measure_partial_floor()["floor_s"]``, the kernel alone taking the last partial
  sync's change again by the most direct means; ``partial_floor_detail``: the rest of what that returned (the
  iptables backend adds ``unhooked_s``, the same replay with the jumps from the built-in chains removed);
- ``partial_writes``: the service ports each partial sync wrote (the ledger's deltas; anything but the changed
  service's ports, 1, or 3 for a service of ``--ports-every``, fails the run), and
  ``partial_ratio`` = partial_sync_s / full_sync_s, which must stay under PARTIAL_RATIO_MAX from BOUND_SERVICES on
  (``bound_failures``: the command exits 1 after printing the figures);
- the restart: the first backend is closed (its sockets and descriptors go, the kernel state stays: the userspace
  mode's proxy sockets are bound again) and a fresh instance in a new process (kproxy.bench.restart, in the same
  network namespace: ``restart_pid``, beside the run's ``pid``), as a restarted kproxy, builds a new cache from a list
  (``restart_absorb_s``, the generator's ``restart_generate_s`` left out), takes the first snapshot
  (``restart_snapshot_s``) and syncs in full adopting what the kernel holds (``restart_sync_s``, the adopt-only
  figure); ``restart_total_s`` is what the restarted process pays before it proxies, to set beside ``absorb_s`` +
  ``full_sync_s`` of a first start; ``restart_writes``: the services that sync wrote (0 when adoption works:
  nothing changed; anything else is a bound failure);
  ``restart_parts``: that sync's phases as the ledger times them (``adopt``, ``render``, ``apply``, ``total``) with
  the backend's own split of its adoption (nftables: ``adopt_chains``, ``adopt_rules``, ``adopt_dump``,
  ``adopt_parse``, ``adopt_group``, ``adopt_small_sets``); ``restart_rss_mb``: the restart's process's peak resident
  set, from its start to the end of its sync;
- ``conntrack_partial_s``: median over the partial runs of what the UDP conntrack reconciler does after that sync
  before it dumps the kernel's entries (``ConntrackReconciler.update_targets`` with the sync's changed UDP service
  ports, as the daemon calls it), and ``conntrack_walk_s``: the map built from the whole table (what a
  reconciliation after a full sync costs; before the map was kept, every reconciliation walked the table, and asked
  every service port's answerers besides). The dump itself is O(conntrack entries), not of the table, and is left
  out: this bench touches no conntrack table;
- ``describe_ms``: while the full sync runs, another thread asks ``describe()`` for one service again and again
  (what ``/rules?service=`` and ``kproxy show --service`` do): p50 and max milliseconds and how many answers, so
  "``/rules`` never waits for a sync" is a figure;
- ``rss_mb``: peak resident memory of the running phases (absorb to the partial syncs; not the floors, which render the
  table again); ``counts``: the backend's sizes;
- ``memory``: where the bytes go (kproxy.bench.memory): ``phases`` gives each phase's resident set at its end, its own
  peak and the process's CPU time in it (``absorb``, ``snapshot``, ``full_sync``, ``partial``; and the restart's
  process's ``restart_absorb``, ``restart_snapshot``, ``restart_sync``); ``bytes`` the live objects after the partial
  syncs (and in the restart's process after its sync, ``restart_bytes``) summed per owner (``cache``, ``snapshot``,
  ``fake_kernel``, ``ledger``, ``backend``: each object counted once, by the first of these that holds it) and
  ``bytes_per_port`` / ``restart_bytes_per_port`` the same per service port.

The restart runs for every mode (kproxy.bench.restart): a real mode's in a new process in the same namespace, as a
DaemonSet's restart is (in the run's own process it carried the earlier phases' heap, ~120 MB under bpf at
100,000 x 10, so its memory figures were not a restarted kproxy's); the fake's in the run's process, its "kernel"
(what it records as programmed) handed to the fresh instance as a real kernel keeps its tables when the process
goes.

With ``--reference upstream-nftables`` the run also times upstream kube-proxy's nftables layout for the same state
(kproxy.bench.reference_nft, in a namespace of its own) and reports ``reference`` with ``reference_ratio`` =
reference full time / kproxy's full sync time (``reference_partial_ratio`` likewise for the partial sync).
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kproxy.bench import counterread, memory, synthetic
from kproxy.bench.restart import restart_phase
from kproxy.bench.syncparts import (
    NODE,
    BenchError,
    BenchState,
    SyncBench,
    bench_config,
    listed,
    no_refusals,
    remove_state,
    weigh,
    written,
)
from kproxy.cache import ServiceCache
from kproxy.conntrack import ConntrackReconciler, udp_changes
from kproxy.model import Changes, IPFamily, ProxyState, SyncResult
from kproxy.proxier import FAKE_MODE, BenchHooks, backend_class
from kproxy.toolkit.netns import scratch_netns

__all__ = ["BenchError", "SyncBench", "bound_failures", "format_table", "render", "run_in_namespace", "run_sync_bench"]

NETNS_PREFIX = "kpb-"
RUN_TIMEOUT = 3600.0  # seconds: a bound on one benchmark run (upstream's nftables layout alone took 68 s here)
#: at BOUND_SERVICES services and more, a partial sync (one endpoint moved) must cost under PARTIAL_RATIO_MAX x the
#: full sync: a backend that rewrote its whole table on every sync would be near 1. At 10,000 x 10 on a quiet 2-core
#: machine: iptables 0.02 (its kernel's validation walk is O(table)), userspace 0.005, bpf and nftables 0.004.
BOUND_SERVICES = 10_000
PARTIAL_RATIO_MAX = 0.05


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def flat_counts(result: SyncResult) -> dict[str, int]:
    """The result's per-family figures as the bench's JSON has always spelt them (``IPv4/deltas``,
    ``IPv4/nat/total``, ``IPv4/elements_added``...): an output format, never parsed back."""
    out: dict[str, int] = {}
    for fam, f in result.families.items():
        p = fam.value
        out.update({f"{p}/full": int(f.full), f"{p}/deltas": f.written, f"{p}/services": f.services})
        if f.kernel_refusals:
            out[f"{p}/kernel_refusals"] = f.kernel_refusals
        out.update({f"{p}/{t}/total": n for t, n in f.rules.items()})
        out.update({f"{p}/{t}/last": n for t, n in f.rules_last.items()})
        out.update({f"{p}/{k}": n for k, n in f.figures.items()})
    return out


def run_sync_bench(
    mode: str,
    n_services: int,
    n_endpoints: int,
    repeat: int = 5,
    backend_options: Mapping[str, Any] | None = None,
    state_name: str = "default",
    service_counters: bool = False,
    *,
    ports_every: int = 0,
    udp_every: int = synthetic.UDP_EVERY,
) -> SyncBench:
    """Run the phases in the current network namespace (the caller chose it) and return the figures; a real mode's
    restart runs in a new process in the same namespace (kproxy.bench.restart), and the kernel state is removed at the
    end whatever failed. ``backend_options`` reach the backend as ``ProxyConfig.backend_options`` (e.g.
    ``iptables_flavour``); ``state_name`` chooses the synthetic state (STATES), ``ports_every`` and ``udp_every``
    shape the default one; ``service_counters`` turns ``--service-counters`` on."""
    if n_services < 1 or n_endpoints < 1 or repeat < 1:
        raise BenchError("--services, --endpoints and --repeat must be at least 1")
    if n_endpoints > synthetic.MAX_ENDPOINTS:
        raise BenchError(f"--endpoints: at most {synthetic.MAX_ENDPOINTS} (one EndpointSlice per service)")
    gen = BenchState(state_name, n_endpoints, ports_every=ports_every, udp_every=udp_every)
    if n_services > gen.gen.MAX_SERVICES:
        raise BenchError(f"--services: at most {gen.gen.MAX_SERVICES} in the {state_name} state")
    config = bench_config(mode, backend_options, service_counters)
    cls = backend_class(mode)
    avail = cls.available()
    if not avail:
        raise BenchError(f"mode {mode} is not available here: {avail.reason}")
    backend = cls(config)
    backend.start()  # as the daemon does before the first sync (loaders, data-path loops)
    out = SyncBench(
        mode=mode,
        services=n_services,
        endpoints=n_endpoints,
        repeat=repeat,
        state=state_name,
        service_counters=service_counters,
    )
    out.ports_every, out.udp_every, out.pid = ports_every, udp_every, os.getpid()
    out.service_ports = gen.service_ports(n_services)
    live = [backend]  # the instance whose cleanup removes the kernel state (see restart_phase); [] when none is owed
    meter = memory.PhaseMeter()
    try:
        cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
        state = _full_phase(out, backend, cache, gen, meter)
        state = _partial_phase(out, backend, cache, gen, meter, state) or state
        weigh(out, "", cache, state, backend)
        if service_counters:
            out.counter_read = counterread.measure(backend, (IPFamily.V4,), repeat)  # the state is IPv4
        floors: BenchHooks = backend
        pfloor = dict(floors.measure_partial_floor() or {})
        out.partial_floor_s = pfloor.pop("floor_s", None)
        out.partial_floor_detail = pfloor
        if out.mode != FAKE_MODE:  # the floor's fresh target, made and removed by the core
            with scratch_netns("kpb-floor-") as scratch:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                out.floor_s = floors.measure_floor(scratch)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
            # a floor's tool runs as a child (``iptables-restore``, ``nft -f``): its user time is the tool's own
            # parsing and evaluating, its system time the kernel taking the transaction (nf_tables processes a
            # netlink batch in the sender's context) and the tool's own page faults: ``nft -f`` of the nftables
            # mode's 100,000 x 10 spent most of its 12.9 s of system time clearing pages for its 2.6 GB
            if after.ru_utime + after.ru_stime > before.ru_utime + before.ru_stime:
                out.floor_user_s = round(after.ru_utime - before.ru_utime, 3)
                out.floor_sys_s = round(after.ru_stime - before.ru_stime, 3)
        if out.floor_s:
            out.ratio = out.full_sync_s / out.floor_s
        if out.full_sync_s > 0:
            out.partial_ratio = out.partial_sync_s / out.full_sync_s
        # a running kproxy: its phases' own peaks (the meter's reset of VmHWM, ``clear_refs``, resets ru_maxrss with
        # it; and ru_maxrss would count the bench's floors, which render the whole table's text again)
        out.rss_mb = max((p.peak_mb for p in meter.phases.values()), default=_peak_rss_mb())
        del cache, state, backend  # the old process's cache, snapshot and backend are gone with it (``live`` has it)
        restart_phase(out, live, cls, config, gen, meter)
        out.memory["phases"] = {k: asdict(v) for k, v in meter.phases.items()}
    finally:
        if mode != "fake" and live:  # the namespace goes away anyway; this removes what lives outside it (BPF)
            remove_state(live[-1])
    return out


def _full_phase(
    out: SyncBench, backend: Any, cache: ServiceCache, gen: BenchState, meter: memory.PhaseMeter
) -> ProxyState:
    """Absorb the whole state, the first snapshot and the full sync; the snapshot synced."""
    got = listed(gen, cache, out.services, meter, "")
    state, changes = got.state, got.changes
    out.generate_s, out.absorb_s, out.snapshot_s = got.generate_s, got.absorb_s, got.snapshot_s
    if len(state) != out.service_ports:
        raise BenchError(f"the cache holds {len(state)} service ports, expected {out.service_ports}: {cache.errors()}")
    if not changes.full:
        raise BenchError("the first snapshot did not ask for a full sync")
    meter.start()
    t3 = time.perf_counter()
    with _DescribeProbe(backend, next(iter(state)).name) as probe:
        result = backend.sync(state, changes)
    if not result.ok:
        raise BenchError(f"full sync failed: {result.error}")
    no_refusals(result, "full sync")
    cache.commit(changes, failed=tuple(result.failed))
    t4 = time.perf_counter()
    meter.stop("full_sync")
    out.describe_ms = probe.figures()
    # the full sync: its snapshot and its sync (the meter's own reads between them are left out)
    out.full_sync_s = got.snapshot_s + (t4 - t3)
    out.render_s = result.timings.get("render")
    out.counts = flat_counts(result)
    return state


def _partial_phase(
    out: SyncBench, backend: Any, cache: ServiceCache, gen: BenchState, meter: memory.PhaseMeter, full_state: ProxyState
) -> ProxyState | None:
    """``repeat`` partial syncs of one endpoint change each; each must write its service (and nothing else). The
    last snapshot synced."""
    applies: list[float] = []
    state = None
    conntrack = _ConntrackProbe(full_state)
    meter.start()
    for r in range(out.repeat):
        s0 = time.perf_counter()
        i = gen.change_one(cache, r, out.services)
        state, changes = cache.snapshot()
        result = backend.sync(state, changes)
        if not result.ok:
            raise BenchError(f"partial sync {r + 1} failed: {result.error}")
        cache.commit(changes, failed=tuple(result.failed))
        out.partial_sync_runs.append(time.perf_counter() - s0)
        if "apply" in result.timings:
            applies.append(result.timings["apply"])
        if changes.full or not changes.services:
            raise BenchError(f"partial sync {r + 1}: expected one dirty service, got {changes}")
        no_refusals(result, f"partial sync {r + 1}")
        wrote = written(result)
        out.partial_writes.append(wrote)
        want = gen.ports_of(i)
        if wrote != want:  # the moved endpoint must reach the kernel, and nothing else needs rewriting
            raise BenchError(f"partial sync {r + 1} wrote {wrote} services, expected {want} ({gen.gen.__name__} {i})")
        conntrack.after(state, changes)
    meter.stop("partial")
    out.conntrack_partial_s = statistics.median(conntrack.seconds)
    out.conntrack_walk_s = conntrack.walk_s
    out.partial_sync_s = statistics.median(out.partial_sync_runs)
    out.partial_apply_s = statistics.median(applies) if applies else None
    return state


class _ConntrackProbe:
    """The UDP conntrack reconciler's work after each partial sync, up to its dump (see the module docstring): its
    map built from the full sync's state (timed: the walk of the whole table), then kept from each partial sync's
    changes, as the daemon keeps it."""

    def __init__(self, state: ProxyState) -> None:
        self.reconciler = ConntrackReconciler(families=(IPFamily.V4,))
        t0 = time.perf_counter()
        self.reconciler.update_targets(state, IPFamily.V4, (), None)
        self.walk_s = time.perf_counter() - t0
        self.seconds: list[float] = []

    def after(self, state: ProxyState, changes: Changes) -> None:
        t0 = time.perf_counter()
        self.reconciler.update_targets(state, IPFamily.V4, (), set(udp_changes(changes)))
        self.seconds.append(time.perf_counter() - t0)


class _DescribeProbe:
    """A thread asking ``describe(key)`` (and serialising it, as ``/rules`` does) until the ``with`` block ends."""

    def __init__(self, backend: Any, key: Any, pause: float = 0.005) -> None:
        self.backend, self.key, self.pause = backend, key, pause
        self.seconds: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-describe", daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            t0 = time.perf_counter()
            json.dumps(self.backend.describe(self.key), default=str)
            self.seconds.append(time.perf_counter() - t0)
            self._done.wait(self.pause)

    def __enter__(self) -> _DescribeProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)

    def figures(self) -> dict[str, float]:
        if not self.seconds:
            return {}
        ms = sorted(1000 * s for s in self.seconds)
        return {"p50": ms[len(ms) // 2], "max": ms[-1], "answers": float(len(ms))}


def bound_failures(b: SyncBench) -> list[str]:
    """What the run's own figures break: the partial/full ratio at BOUND_SERVICES and more, and a restart that
    rewrote anything (nothing changed between the two processes)."""
    out = []
    if b.services >= BOUND_SERVICES and b.partial_ratio is not None and b.partial_ratio >= PARTIAL_RATIO_MAX:
        out.append(
            f"partial sync / full sync = {b.partial_ratio:.3f} (partial {b.partial_sync_s:.4f} s, full "
            f"{b.full_sync_s:.4f} s), not under {PARTIAL_RATIO_MAX} at {b.services} services"
        )
    if b.restart_writes:
        out.append(f"the restarted backend wrote {b.restart_writes} services, though nothing changed")
    return out


def _ns_alive(name: str) -> bool:
    m = re.fullmatch(rf"{NETNS_PREFIX}(\d+)", name)
    return not m or Path(f"/proc/{m.group(1)}").exists()


def _remove_stale_namespaces() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listing.splitlines():
        name = line.split(" ", 1)[0]
        if name.startswith(NETNS_PREFIX) and not _ns_alive(name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def run_in_namespace(argv: Sequence[str]) -> int:
    """Re-execute ``python -P -m kproxy.bench <argv> --inside`` in a fresh namespace ``kpb-<pid>``; its exit code.
    ``-P`` keeps the working directory off ``sys.path``: the kproxy run is the installed one, never a checkout that
    happens to be the working directory (a run once mixed two commits' code)."""
    if os.geteuid() != 0:
        print("kproxy bench sync: a real backend needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    _remove_stale_namespaces()
    ns = f"{NETNS_PREFIX}{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=30)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-P", "-m", "kproxy.bench", *argv, "--inside"]
        return subprocess.run(cmd, timeout=RUN_TIMEOUT).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


def format_table(b: SyncBench) -> str:
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f} s"

    rows = [
        ("mode", b.mode),
        (
            "services x endpoints",
            f"{b.services} x {b.endpoints} ({b.state} state{', service counters' if b.service_counters else ''})",
        ),
        (
            "service ports",
            f"{b.service_ports}" + (f" (every {b.ports_every}th service has 3)" if b.ports_every else ""),
        ),
        ("absorb (the cache alone)", sec(b.absorb_s)),
        ("  generating the objects (left out)", sec(b.generate_s)),
        ("first snapshot", sec(b.snapshot_s)),
        ("full sync", sec(b.full_sync_s)),
        (f"partial sync (median of {b.repeat})", sec(b.partial_sync_s)),
        ("  of which kernel apply", sec(b.partial_apply_s)),
        ("kernel floor of the last partial change", sec(b.partial_floor_s)),
        *((f"  {k.removesuffix('_s').replace('_', ' ')}", sec(v)) for k, v in sorted(b.partial_floor_detail.items())),
        ("kernel floor", sec(b.floor_s)),
        ("  its tool's CPU: user (parsing) / system (the kernel)", f"{sec(b.floor_user_s)} / {sec(b.floor_sys_s)}"),
        ("full sync / floor", "-" if b.ratio is None else f"{b.ratio:.2f}"),
        ("render", sec(b.render_s)),
        ("partial / full", "-" if b.partial_ratio is None else f"{b.partial_ratio:.4f}"),
        ("services each partial sync wrote", ", ".join(map(str, b.partial_writes)) or "-"),
        ("conntrack map after a partial sync (median)", sec(b.conntrack_partial_s)),
        ("  its map built from the whole table", sec(b.conntrack_walk_s)),
        ("restart: list, snapshot, adopting sync", sec(b.restart_total_s)),
        ("  cache from a list", sec(b.restart_absorb_s)),
        ("  first snapshot", sec(b.restart_snapshot_s)),
        ("  adopting sync (nothing changed)", sec(b.restart_sync_s)),
        ("  services it wrote", "-" if b.restart_writes is None else str(b.restart_writes)),
        (
            "describe() during the full sync",
            "-"
            if not b.describe_ms
            else f"p50 {b.describe_ms['p50']:.1f} ms, max {b.describe_ms['max']:.1f} ms "
            f"({int(b.describe_ms['answers'])} answers)",
        ),
        *counterread.table_rows(b.counter_read),
        ("peak RSS", f"{b.rss_mb:.1f} MB"),
        ("peak RSS of the restart's process", "-" if b.restart_rss_mb is None else f"{b.restart_rss_mb:.1f} MB"),
    ]
    rows += _memory_rows(b.memory)
    rows += [(f"count {k}", str(v)) for k, v in sorted(b.counts.items())]
    if b.reference is not None:
        ref = b.reference
        rows += [
            (f"reference {ref['layout']}: full (nft -f)", sec(ref.get("full_s"))),
            ("  reference partial (median)", sec(ref.get("partial_s"))),
            ("  reference stale-chain deletion", sec(ref.get("partial_cleanup_s"))),
            (
                "  reference chains / rules / elements",
                f"{ref.get('chains')} / {ref.get('rules')} / {ref.get('elements')}",
            ),
            ("  reference full / kproxy full", "-" if b.reference_ratio is None else f"{b.reference_ratio:.1f}x"),
            (
                "  reference partial / kproxy partial",
                "-" if b.reference_partial_ratio is None else f"{b.reference_partial_ratio:.1f}x",
            ),
        ]
    if b.reference_note:
        rows.append(("reference", b.reference_note))
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if any(k.endswith("/last") for k in b.counts):
        text += (
            "\n(counts of the full sync, as upstream's rule gauges: .../last = rules its restores wrote, jumps from"
            " the built-in chains and the canary included; .../total = rules kproxy's chains hold)"
        )
    return text


def _memory_rows(mem: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = [
        (f"RSS after {name} (its peak, its CPU)", f"{p['rss_mb']:.1f} MB ({p['peak_mb']:.1f} MB, {p['cpu_s']:.2f} s)")
        for name, p in mem.get("phases", {}).items()
    ]
    for prefix, when in (("", "running"), ("restart_", "restarted")):
        per_port = mem.get(prefix + "bytes_per_port")
        if per_port:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in per_port.items() if k != "total")
            rows.append((f"bytes per service port, {when}", f"{per_port['total']:.0f} ({parts})"))
    return rows


def render(b: SyncBench, fmt: str) -> str:
    return json.dumps(b.to_json(), indent=2) if fmt == "json" else format_table(b)
