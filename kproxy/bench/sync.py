"""``kproxy bench sync``: how long the cache and a backend take to program N services x E endpoints, from empty
and after one endpoint changes, next to the kernel's own time for the same payload (PERFORMANCE.md).

A real backend runs in a throwaway network namespace ``kpb-<pid>``: the command re-executes itself inside it
(``ip netns exec kpb-<pid> python -m kproxy.bench bench sync ... --inside``) and deletes the namespace afterwards, also
when the run fails or is interrupted; a namespace left by a killed run (its pid is gone) is removed by the next.
``--mode fake`` times the cache alone and needs no namespace.

Phases, each timed with ``time.perf_counter``:
- ``absorb_s``: feeding every Service and EndpointSlice to ``ServiceCache`` (objects generated lazily);
- ``snapshot_s``: the first ``snapshot()`` (all services recomputed);
- ``full_sync_s``: that snapshot plus the backend's first (full) ``sync`` and the ``commit``;
- ``partial_sync_s``: median over ``--repeat`` runs of: one endpoint of one service changes (``upsert_slice``),
  ``snapshot``, ``sync``, ``commit``;
- ``floor_s``: ``backend.measure_floor()`` (the kernel alone taking the full payload; None for fake), and
  ``ratio`` = full_sync_s / floor_s; ``render_s``: the backend's own ``timings["render"]`` of the full sync;
- ``partial_apply_s``: median of the backend's ``timings["apply"]`` in the partial runs (the kernel's share of a
  partial sync: what is left of ``partial_sync_s`` is kproxy's own work);
- ``partial_floor_s``: ``backend.measure_partial_floor()["floor_s"]``, the kernel alone taking the last partial
  sync's change again by the most direct means; ``partial_floor_detail``: the rest of what that returned (the
  iptables backend adds ``unhooked_s``, the same replay with the jumps from the built-in chains removed);
- ``restart_sync_s``: a fresh backend instance (a restarted kproxy) taking the same state in a full sync, adopting
  what the kernel holds; ``restart_writes``: the services that sync wrote (0 when adoption works: nothing changed);
- ``describe_ms``: while the full sync runs, another thread asks ``describe()`` for one service again and again
  (what ``/rules?service=`` and ``kproxy show --service`` do): p50 and max milliseconds and how many answers, so
  "``/rules`` never waits for a sync" is a figure;
- ``rss_mb``: peak resident memory of the process that ran the phases; ``counts``: the backend's sizes.

With ``--reference upstream-nftables`` the run also times upstream kube-proxy's nftables layout for the same state
(kproxy.bench.reference_nft, in a namespace of its own) and reports ``reference`` with ``reference_ratio`` =
reference full time / kproxy's full sync time (``reference_partial_ratio`` likewise for the partial sync).

Who uses it: ``kproxy.bench.cli`` (``kproxy bench sync``), ``make bench`` and ``kproxy compare``.
"""

from __future__ import annotations

import gc
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily
from kproxy.proxier import backend_class

NODE = "node-1"
NETNS_PREFIX = "kpb-"
CLUSTER_CIDR = "198.18.64.0/18"
RUN_TIMEOUT = 3600.0  # seconds: a bound on one benchmark run (upstream's nftables layout alone took 68 s here)


@dataclass
class SyncBench:
    """One run's figures; ``to_json()`` is the documented JSON output."""

    mode: str
    services: int
    endpoints: int
    repeat: int
    absorb_s: float = 0.0
    snapshot_s: float = 0.0
    full_sync_s: float = 0.0
    partial_sync_s: float = 0.0
    partial_sync_runs: list[float] = field(default_factory=list)
    floor_s: float | None = None
    ratio: float | None = None
    render_s: float | None = None
    partial_apply_s: float | None = None
    partial_floor_s: float | None = None
    partial_floor_detail: dict[str, float] = field(default_factory=dict)
    restart_sync_s: float | None = None
    restart_writes: int | None = None
    #: peak RSS of the whole run, the restart phase included (``rss_mb`` is the peak before it: full and partial
    #: syncs, as a running kproxy; a restart's adoption reads the kernel's whole state back)
    restart_rss_mb: float | None = None
    describe_ms: dict[str, float] = field(default_factory=dict)
    rss_mb: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    #: ``--reference``: the yardstick's figures (kproxy.bench.reference_nft.ReferenceBench.to_json()), or why not
    reference: dict[str, Any] | None = None
    reference_note: str = ""
    #: reference full (partial) time / kproxy's full (partial) sync time: how many times ahead kproxy is
    reference_ratio: float | None = None
    reference_partial_ratio: float | None = None

    def attach_reference(self, ref: dict[str, Any]) -> None:
        self.reference = ref
        if self.full_sync_s > 0 and ref.get("full_s"):
            self.reference_ratio = ref["full_s"] / self.full_sync_s
        if self.partial_sync_s > 0 and ref.get("partial_s"):
            self.reference_partial_ratio = ref["partial_s"] / self.partial_sync_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class BenchError(RuntimeError):
    """The benchmark cannot run (backend unavailable, a sync failed); the message says why."""


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def run_sync_bench(
    mode: str, n_services: int, n_endpoints: int, repeat: int = 5, backend_options: Mapping[str, Any] | None = None
) -> SyncBench:
    """Run the phases in the current network namespace (the caller chose it) and return the figures.
    ``backend_options`` reach the backend as ``ProxyConfig.backend_options`` (e.g. ``iptables_flavour``)."""
    if n_services < 1 or n_endpoints < 1 or repeat < 1:
        raise BenchError("--services, --endpoints and --repeat must be at least 1")
    if n_endpoints > synthetic.MAX_ENDPOINTS:
        raise BenchError(f"--endpoints: at most {synthetic.MAX_ENDPOINTS} (one EndpointSlice per service)")
    if n_services > synthetic.MAX_SERVICES:
        raise BenchError(f"--services: at most {synthetic.MAX_SERVICES} (198.19.0.0/16)")
    config = ProxyConfig(
        mode=mode,
        hostname_override=NODE,
        cluster_cidrs=(CLUSTER_CIDR,),
        backend_options=MappingProxyType(dict(backend_options or {})),
    )
    cls = backend_class(mode)
    avail = cls.available()
    if not avail:
        raise BenchError(f"mode {mode} is not available here: {avail.reason}")
    backend = cls(config)
    backend.start()  # as the daemon does before the first sync (loaders, data-path loops)
    out = SyncBench(mode=mode, services=n_services, endpoints=n_endpoints, repeat=repeat)
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    try:
        t0 = time.perf_counter()
        for svc in synthetic.services(n_services):
            cache.upsert_service(svc)
        for eps in synthetic.endpoint_slices(n_services, n_endpoints):
            cache.upsert_slice(eps)
        cache.mark_synced("services")
        cache.mark_synced("endpointslices")
        t1 = time.perf_counter()
        state, changes = cache.snapshot()
        t2 = time.perf_counter()
        if len(state) != n_services:
            raise BenchError(f"the cache holds {len(state)} service ports, expected {n_services}: {cache.errors()}")
        if not changes.full:
            raise BenchError("the first snapshot did not ask for a full sync")
        with _DescribeProbe(backend, next(iter(state)).name) as probe:
            result = backend.sync(state, changes)
        if not result.ok:
            raise BenchError(f"full sync failed: {result.error}")
        cache.commit(changes, failed=tuple(result.failed))
        t3 = time.perf_counter()
        out.describe_ms = probe.figures()
        out.absorb_s, out.snapshot_s, out.full_sync_s = t1 - t0, t2 - t1, t3 - t1
        out.render_s = result.timings.get("render")
        out.counts = {k: int(v) for k, v in result.counts.items()}

        applies: list[float] = []
        for r in range(repeat):
            i = 1 + (r * 7919) % n_services  # a different service each time, spread over the table
            s0 = time.perf_counter()
            cache.upsert_slice(synthetic.endpoint_slice(i, n_endpoints, variant=r + 1))
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
        out.partial_sync_s = statistics.median(out.partial_sync_runs)
        out.partial_apply_s = statistics.median(applies) if applies else None

        pfloor = dict(backend.measure_partial_floor() or {})
        out.partial_floor_s = pfloor.pop("floor_s", None)
        out.partial_floor_detail = pfloor
        out.floor_s = backend.measure_floor()
        if out.floor_s:
            out.ratio = out.full_sync_s / out.floor_s
        out.rss_mb = _peak_rss_mb()  # a running kproxy: the full and partial syncs
        if mode != "fake":  # a restarted kproxy: a new instance adopting what the kernel holds, nothing changed
            forget = getattr(backend, "forget", None)
            if forget is not None:  # the old process is gone: its memory must not count in the new one's
                forget()
            gc.collect()
            fresh = cls(config)
            fresh.start()
            try:
                state, changes = cache.snapshot(full=True)
                r0 = time.perf_counter()
                result = fresh.sync(state, changes)
                out.restart_sync_s = time.perf_counter() - r0
                if not result.ok:
                    raise BenchError(f"restart sync failed: {result.error}")
                out.restart_writes = sum(v for k, v in result.counts.items() if k.endswith("/deltas"))
            finally:
                fresh.close()
            out.restart_rss_mb = _peak_rss_mb()
    finally:
        if mode != "fake":
            try:  # the namespace goes away anyway; this removes what lives outside it (a BPF cgroup hook)
                backend.cleanup()
            finally:
                backend.close()
    return out


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
    """Re-execute ``python -m kproxy.bench <argv> --inside`` in a fresh namespace ``kpb-<pid>``; its exit code."""
    if os.geteuid() != 0:
        print("kproxy bench sync: a real backend needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    _remove_stale_namespaces()
    ns = f"{NETNS_PREFIX}{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=30)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kproxy.bench", *argv, "--inside"]
        return subprocess.run(cmd, timeout=RUN_TIMEOUT).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


def format_table(b: SyncBench) -> str:
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f} s"

    rows = [
        ("mode", b.mode),
        ("services x endpoints", f"{b.services} x {b.endpoints}"),
        ("absorb", sec(b.absorb_s)),
        ("first snapshot", sec(b.snapshot_s)),
        ("full sync", sec(b.full_sync_s)),
        (f"partial sync (median of {b.repeat})", sec(b.partial_sync_s)),
        ("  of which kernel apply", sec(b.partial_apply_s)),
        ("kernel floor of the last partial change", sec(b.partial_floor_s)),
        *((f"  {k.removesuffix('_s').replace('_', ' ')}", sec(v)) for k, v in sorted(b.partial_floor_detail.items())),
        ("kernel floor", sec(b.floor_s)),
        ("full sync / floor", "-" if b.ratio is None else f"{b.ratio:.2f}"),
        ("render", sec(b.render_s)),
        ("restart (fresh process, nothing changed)", sec(b.restart_sync_s)),
        ("  services it wrote", "-" if b.restart_writes is None else str(b.restart_writes)),
        (
            "describe() during the full sync",
            "-"
            if not b.describe_ms
            else f"p50 {b.describe_ms['p50']:.1f} ms, max {b.describe_ms['max']:.1f} ms "
            f"({int(b.describe_ms['answers'])} answers)",
        ),
        ("peak RSS", f"{b.rss_mb:.1f} MB"),
        ("peak RSS with the restart", "-" if b.restart_rss_mb is None else f"{b.restart_rss_mb:.1f} MB"),
    ]
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


def render(b: SyncBench, fmt: str) -> str:
    return json.dumps(b.to_json(), indent=2) if fmt == "json" else format_table(b)
