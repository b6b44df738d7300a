"""The pieces of ``kproxy bench sync`` (kproxy.bench.sync) that its restart's process (kproxy.bench.restart) shares
with the run's own: the figures (``SyncBench``), the synthetic state (``BenchState``), the backends' configuration
(``bench_config``), the checks of a sync's result and the weighing of the live objects (``weigh``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from kproxy.bench import memory, mixed, synthetic
from kproxy.cache import ServiceCache
from kproxy.config import ProxyConfig
from kproxy.model import Changes, ProxyState, SyncResult
from kproxy.proxier import FAKE_MODE

NODE = "node-1"
CLUSTER_CIDR = "198.18.64.0/18"
STATES = ("default", "mixed")


@dataclass
class SyncBench:
    """One run's figures; ``to_json()`` is the documented JSON output."""

    mode: str
    services: int
    endpoints: int
    repeat: int
    #: the synthetic state (STATES): ``default`` (ClusterIPs; every published figure) or ``mixed``
    state: str = "default"
    #: whether the backend ran with ``--service-counters``
    service_counters: bool = False
    #: default state: every Nth service has three ports (0: one port each), every Nth is UDP (0: none)
    ports_every: int = 0
    udp_every: int = synthetic.UDP_EVERY
    #: the service ports the cache and the ledger hold (``services`` counts Services)
    service_ports: int = 0
    #: the cache absorbing both lists, without the synthetic generator's time (``generate_s``)
    absorb_s: float = 0.0
    generate_s: float = 0.0
    snapshot_s: float = 0.0
    full_sync_s: float = 0.0
    partial_sync_s: float = 0.0
    partial_sync_runs: list[float] = field(default_factory=list)
    #: service ports each partial sync wrote (the ledger's deltas): the changed service's, or the run fails
    partial_writes: list[int] = field(default_factory=list)
    #: partial_sync_s / full_sync_s (PARTIAL_RATIO_MAX at BOUND_SERVICES and more, see ``bound_failures``)
    partial_ratio: float | None = None
    floor_s: float | None = None
    #: the CPU time of the floor's child process (the tool): user (the tool's parse and evaluation) and system (the
    #: kernel taking the transaction); None when the floor runs no child (bpf writes its maps from this process)
    floor_user_s: float | None = None
    floor_sys_s: float | None = None
    ratio: float | None = None
    render_s: float | None = None
    partial_apply_s: float | None = None
    partial_floor_s: float | None = None
    partial_floor_detail: dict[str, float] = field(default_factory=dict)
    restart_sync_s: float | None = None
    #: what a restarted process pays before it proxies: its cache from a list (restart_absorb_s), the first snapshot
    #: (restart_snapshot_s) and the adopting sync (restart_sync_s), in all restart_total_s
    restart_absorb_s: float | None = None
    restart_generate_s: float | None = None
    restart_snapshot_s: float | None = None
    restart_total_s: float | None = None
    restart_writes: int | None = None
    #: the restart sync's phases as the ledger and the backend time them (``adopt``: reading the kernel, and the
    #: backend's own split of it, e.g. nftables' ``adopt_dump``; ``render``: rendering and comparing every service)
    restart_parts: dict[str, float] = field(default_factory=dict)
    #: peak RSS of the restart's process (``VmHWM``) from its start to the end of its sync, the backend's start
    #: included (the fake's restart runs in the run's own process: from the start of its partial syncs); ``rss_mb``
    #: is the peak of the full and partial syncs, as a running kproxy; a restart's adoption reads the kernel back
    restart_rss_mb: float | None = None
    #: the process that ran the restart: a real mode's is a child of the run's own (``pid``)
    restart_pid: int | None = None
    pid: int = 0
    conntrack_partial_s: float | None = None
    conntrack_walk_s: float | None = None
    describe_ms: dict[str, float] = field(default_factory=dict)
    rss_mb: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    #: where the bytes go, per phase and per owner (see the module docstring)
    memory: dict[str, Any] = field(default_factory=dict)
    #: ``--service-counters``: what reading them costs after the partial syncs (kproxy.bench.counterread.measure)
    counter_read: dict[str, Any] | None = None
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


#: the figures a real mode's restart process reports (kproxy.bench.restart), merged into the run's ``SyncBench``
RESTART_FIELDS = tuple(f.name for f in fields(SyncBench) if f.name.startswith("restart_"))


class BenchError(RuntimeError):
    """The benchmark cannot run (backend unavailable, a sync failed); the message says why."""


class BenchState:
    """The synthetic objects of one ``--state``: the default (``synthetic``: ClusterIPs only, as every published
    figure) or ``mixed`` (``mixed``: external paths too)."""

    def __init__(
        self, name: str, n_endpoints: int, *, ports_every: int = 0, udp_every: int = synthetic.UDP_EVERY
    ) -> None:
        if name not in STATES:
            raise BenchError(f"--state: one of {', '.join(STATES)}, not {name!r}")
        if ports_every < 0 or udp_every < 0:
            raise BenchError("--ports-every and --udp-every must be at least 0")
        shape = {"ports_every": ports_every, "udp_every": udp_every}
        if name == "mixed" and (ports_every, udp_every) != (0, synthetic.UDP_EVERY):
            raise BenchError("--ports-every and --udp-every shape the default state only, not the mixed one")
        self.name, self.n_endpoints = name, n_endpoints
        self.gen: Any = mixed if name == "mixed" else synthetic
        self.shape: dict[str, int] = shape if name == "default" else {}  # the generator's keywords
        self.ports_every = ports_every
        self.variants: dict[int, int] = {}  # service index -> the variant its slice has now (partial syncs)

    def service_ports(self, n_services: int) -> int:
        return synthetic.service_ports(n_services, ports_every=self.ports_every)

    def ports_of(self, i: int) -> int:
        """The service ports of service ``i`` (its slice lists them all: an endpoint change rewrites each)."""
        return synthetic.service_ports(i, ports_every=self.ports_every) - synthetic.service_ports(
            i - 1, ports_every=self.ports_every
        )

    def absorb(self, cache: ServiceCache, n_services: int) -> float:
        """Every Service and EndpointSlice as a list would return them now (the partial syncs' changes included),
        handed over as kproxy.sources.kube hands a list: ``replace_services`` / ``replace_slices`` (which pause the
        collector, as a real start or restart does). Returns the seconds spent generating the objects, which the
        caller keeps apart from the cache's (``generate_s``): a real process gets them from JSON instead."""
        shape, variants, n_endpoints = self.shape, self.variants, self.n_endpoints
        clock = synthetic.TimedPages()
        cache.replace_services(clock.paged(lambda i: self.gen.service(i, **shape), n_services))
        cache.replace_slices(
            clock.paged(
                lambda i: self.gen.endpoint_slice(i, n_endpoints, variant=variants.get(i, 0), **shape), n_services
            )
        )
        return clock.seconds

    def change_one(self, cache: ServiceCache, r: int, n_services: int) -> int:
        """Move one endpoint of a service that has endpoints, a different one each time, spread over the table."""
        i = 1 + (r * 7919) % n_services
        while self.name == "mixed" and not mixed.has_endpoints(i):
            i = 1 + i % n_services
        self.variants[i] = r + 1
        cache.upsert_slice(self.gen.endpoint_slice(i, self.n_endpoints, variant=r + 1, **self.shape))
        return i


def written(result: SyncResult) -> int:
    """Services one sync wrote or removed (every family's ``written``)."""
    return sum(f.written for f in result.families.values())


def no_refusals(result: SyncResult, what: str) -> None:
    """The synthetic state gives every service its own addresses and ports: a refusal is the generator's bug (or
    the core's), and a figure with services left out would flatter."""
    if result.refused:
        some = "; ".join(f"{k}: {v}" for k, v in list(result.refused.items())[:3])
        raise BenchError(f"{what}: the core refused {len(result.refused)} service port(s), e.g. {some}")
    if result.failed:
        some = "; ".join(f"{k}: {v}" for k, v in list(result.failed.items())[:3])
        raise BenchError(f"{what}: the kernel refused {len(result.failed)} service port(s), e.g. {some}")


def bench_config(mode: str, backend_options: Mapping[str, Any] | None, service_counters: bool) -> ProxyConfig:
    """The configuration of a bench run's backends; the restart's process builds the same one, so its backend finds
    the kernel state of the first (the bpf mode's pin folder and cgroup follow from the options and the namespace)."""
    return ProxyConfig(
        mode=mode,
        hostname_override=NODE,
        cluster_cidrs=(CLUSTER_CIDR,),
        backend_options=MappingProxyType(dict(backend_options or {})),
        service_counters=service_counters,
    )


def weigh(out: SyncBench, prefix: str, cache: ServiceCache, state: ProxyState, backend: Any) -> None:
    """The live objects of the cache, the snapshot, the ledger and the backend (kproxy.bench.memory.breakdown),
    into ``out.memory[prefix + "bytes"]`` and ``[prefix + "bytes_per_port"]``."""
    ledger = getattr(backend, "ledger", None)
    owners = [
        memory.Owner("cache", [cache], stop=[state]),
        memory.Owner("snapshot", [state]),
        # the fake's "kernel" lives in the process: what it holds is not the ledger's (after a restart, the old
        # process's ServicePorts, which the new cache's equal but do not share)
        memory.Owner("fake_kernel", [backend.programmed] if out.mode == FAKE_MODE else []),
        memory.Owner("ledger", [ledger] if ledger is not None else [], stop=[backend]),  # it names its backend
        memory.Owner("backend", [backend]),
    ]
    figures = memory.breakdown(owners)
    out.memory[prefix + "bytes"] = figures
    out.memory[prefix + "bytes_per_port"] = memory.per_port(figures, len(state))


def remove_state(backend: Any) -> None:
    """Remove what ``backend``'s configuration keeps in the kernel (``cleanup``: a started instance's or an unstarted
    one's), then close the instance, whatever the cleanup raised."""
    try:
        backend.cleanup()
    finally:
        backend.close()


@dataclass(slots=True)
class Listed:
    """A list absorbed into a new cache and its first snapshot (``listed``): the snapshot, and the seconds each took
    (``absorb_s`` without the generator's ``generate_s``: a real process gets the objects from JSON instead)."""

    state: ProxyState
    changes: Changes
    generate_s: float
    absorb_s: float
    snapshot_s: float


def listed(gen: BenchState, cache: ServiceCache, n_services: int, meter: memory.PhaseMeter, prefix: str) -> Listed:
    """Absorb the state's list into ``cache`` and take its first snapshot, each a phase of ``meter``
    (``{prefix}absorb``, ``{prefix}snapshot``): what a starting and a restarted kproxy do before their first sync."""
    meter.start()
    t0 = time.perf_counter()
    generate_s = gen.absorb(cache, n_services)
    t1 = time.perf_counter()
    meter.stop(f"{prefix}absorb")
    meter.start()
    t2 = time.perf_counter()
    state, changes = cache.snapshot()
    t3 = time.perf_counter()
    meter.stop(f"{prefix}snapshot")
    return Listed(state, changes, generate_s, t1 - t0 - generate_s, t3 - t2)
