"""The contract every backend implements, and the one ordered table of modes.

Why the cut sits here: everything Kubernetes means by a Service (which objects count, how slices merge, which
endpoints this node may use, reject versus drop) is decided once, in the cache, and handed to a backend as a
``ProxyState`` of node-local ``ServicePort`` values plus ``Changes`` (what is dirty). What the node itself is (local
traffic detection, NodePort addresses, its own addresses) is decided once per sync in ``kproxy.nodeaddr``. What has
been programmed, what the kernel refused and the retry rounds live in ``kproxy.ledger``. A backend only translates
one service at a time into kernel state (iptables rules, nftables map elements, BPF map entries, proxy sockets) and
applies batches of such changes. So four very different datapaths behave the same by construction, and the
semantics and the retry rules are unit-tested once, without root.

The mode table (``MODES``) is the single source for ``--mode`` validation, ``/proxyMode``, ``kproxy --help`` and
the docs; it is the only place in the core that names a mode. The core never imports a backend module by name:
backends register under the ``kproxy.backends`` entry-point group (see pyproject.toml) and are looked up through it,
which import-linter enforces.

What a backend implements (a fifth mode is this list; ``kproxy.batch.Backend`` documents the driven protocol and
``kproxy.backend.LedgerProxier`` its defaults):

1. ``mode`` (a name in ``MODES``) and ``available()``: can this host run it, and if not, why.
2. The per-service translation, through ``LedgerProxier``: ``context()`` (the family's rendering context, from the
   ``NodeContext``), ``render()`` (pure: one ServicePort to a fragment), ``apply()`` (a batch of deltas; says which
   services the kernel refused), ``adopt()`` (what the kernel holds at start, so a restart rewrites nothing),
   ``needs_full()`` (a cheap "is my state still there"), ``detail()`` (its own part of ``describe``).
3. Hooks, classmethods so that no running instance is needed: ``options`` (typed ``Option`` values, which become
   ``--<mode>-...`` flags of every command that builds the backend), ``lab_options()`` (per-node option values in
   the lab, e.g. a cgroup and a pin folder of the node's own), ``remnants()`` (what the mode left in
   the kernel), ``kernel_view()`` (what the kernel holds per service, for conformance checks), ``cleanup_leftovers()``
   (remove it all), ``not_applicable()`` (scenarios impossible for the mode), ``not_applicable_parts()`` (parts of
   scenarios impossible for it); and on the instance
   ``register_metrics()`` (its own metrics, on the daemon's registry) fed by ``observe_sync()``.
4. Lifecycle: ``__init__`` touches nothing; ``start()`` (threads, loaders, data-path loops) before the first sync;
   ``close()`` once the runner thread has joined. Optional: ``trace()`` (the packet explainer),
   ``conntrack_answerers()`` (who may answer a UDP flow), ``measure_floor(scratch)`` / ``measure_partial_floor()``
   (bench). The hooks for tools come in three small protocols (``KernelHooks``, ``LabHooks``, ``BenchHooks``).

Threads: ``sync`` (and everything it calls: ``context``, ``render``, ``apply``, ``adopt``, ``needs_full``) runs
only in the runner thread; ``describe``, ``trace`` and the metrics collection may run in any HTTP thread at any
time and must not wait for a sync; ``start`` and ``close`` run in the main thread, ``close`` after the runner thread
has stopped; classmethod hooks run in whatever process calls them (the CLI, the conformance runner).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, TypedDict

from kproxy.config import ProxyConfig
from kproxy.counters import CounterDump, Measure
from kproxy.drift import Drift
from kproxy.model import Changes, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import NodeContext

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kproxy.backends"


@dataclass(frozen=True, slots=True)
class Availability:
    """Can this host run a mode, and if not, what is missing (a kernel feature, a package, a binary)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    summary: str


# Ordered as kube-proxy's history: the order --help, /proxyMode docs and `kproxy compare` present them in.
MODES: tuple[Mode, ...] = (
    Mode("userspace", "proxy sockets in kproxy itself, reached through iptables redirects (early kube-proxy)"),
    Mode("iptables", "upstream kube-proxy's iptables chain layout, one iptables-restore per sync"),
    Mode("nftables", "verdict maps in a table of kproxy's own, one nft transaction per sync"),
    Mode("bpf", "bcc-compiled socket and tc programs whose BPF maps kproxy updates"),
)
MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES)
#: the mode of ``kproxy run`` without ``--mode`` (upstream's default on Linux)
DEFAULT_MODE = "iptables"
#: the first-class fake (``kproxy.fake``): no kernel, never listed, reachable by name for tests and ``bench``
FAKE_MODE = "fake"


class BackendError(RuntimeError):
    """A backend cannot be loaded or cannot run here; the message says why."""


# ----------------------------------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class Option:
    """One typed option a backend declares. ``name`` is the key in ``ProxyConfig.backend_options`` (``bpf_pin_path``);
    the flag is ``--`` plus the name with dashes (``--bpf-pin-path``), given to ``run``, ``cleanup``, ``show``, and as
    ``--backend-option NAME=VALUE`` to ``bench``, ``lab``, ``conformance`` and ``compare``."""

    name: str
    type: type[Any] = str
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def convert(self, text: str) -> Any:
        """The value of ``text`` (a flag's or ``NAME=VALUE``'s), checked; ValueError names the option."""
        try:
            if self.type is bool:
                low = text.strip().lower()
                if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(text)
                value: Any = low in ("1", "true", "yes", "on")
            else:
                value = self.type(text)
        except ValueError:
            raise ValueError(f"{self.flag}: {text!r} is not a {self.type.__name__}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.flag}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        return value


def add_option_flags(group: argparse._ArgumentGroup, cls: type[Proxier]) -> list[str]:
    """Add a backend's options as flags (default suppressed: only given flags reach the config); their dests."""
    dests = []
    for opt in cls.options:
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": opt.help}
        if opt.type is bool:
            kwargs["type"] = opt.convert
            kwargs["metavar"] = "BOOL"
        else:
            kwargs["type"] = opt.convert
            if opt.choices:
                kwargs["metavar"] = "{" + ",".join(map(str, opt.choices)) + "}"
        group.add_argument(opt.flag, **kwargs)
        dests.append(opt.name)
    return dests


def split_option_assignment(item: str) -> tuple[str, str]:
    """One ``NAME=VALUE`` (``--backend-option``) as (the option's name, ``bpf_map_size`` for ``bpf-map-size`` too,
    the value's text); ValueError when it is not of that form."""
    name, eq, value = item.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not eq or not name:
        raise ValueError(f"--backend-option {item!r}: expected NAME=VALUE")
    return name, value


def parse_option_assignments(cls: type[Proxier], assignments: Iterable[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings (``--backend-option``) into a backend's typed options; ValueError names the fault."""
    known = {o.name: o for o in cls.options}
    out: dict[str, Any] = {}
    for item in assignments:
        name, value = split_option_assignment(item)
        opt = known.get(name)
        if opt is None:
            names = ", ".join(sorted(known)) or "none"
            raise ValueError(f"--backend-option {name}: mode {cls.mode!r} has no such option (it has: {names})")
        out[name] = opt.convert(value)
    return out


def option_arguments(cls: type[Proxier], options: Mapping[str, Any]) -> list[str]:
    """The ``kproxy run`` flags that carry ``options`` (the lab passes a node's options this way)."""
    known = {o.name: o for o in cls.options}
    argv: list[str] = []
    for name, value in options.items():
        opt = known.get(name)
        if opt is None:
            raise ValueError(f"mode {cls.mode!r} has no option {name!r}")
        argv += [opt.flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


# ------------------------------------------------------------------------------------------- kernel inspection


class KernelProbe(Protocol):
    """Runs read-only commands in one node's network namespace, for hooks that inspect the kernel from outside a
    running kproxy (``remnants``, ``kernel_view``): the conformance runner's probe execs into a lab node, ``kproxy
    cleanup`` checks its own work with a local one. ``options`` are the node's backend options (pin folder, ...)."""

    @property
    def options(self) -> Mapping[str, Any]: ...

    def run(self, argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]: ...


@dataclass(frozen=True)
class LocalProbe:
    """A KernelProbe for this process's namespace, or a named one (``ip netns exec``)."""

    netns: str | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def run(self, argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        full = ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)


@dataclass(frozen=True, slots=True)
class LabNodeSpec:
    """What a backend's ``lab_options`` learns about one lab node: its name and namespace, the cgroup (v2) its
    processes run in, and a folder of the node's own (for pins and state) that the lab removes with the node."""

    name: str
    netns: str
    cgroup: Path | None
    state_dir: Path


# ------------------------------------------------------------------------------------------------- the hooks
# Three small protocols, each what one kind of tool needs from a mode and nothing else; a mode's class (its
# classmethods) satisfies the first two, an instance the third. ``Proxier`` declares all three with defaults, and
# mypy's override checks hold every backend to them; the tools take these types, not ``type[Proxier]``.


class KernelHooks(Protocol):
    """The kernel, with no instance running: what a mode left, what the kernel holds per service, and removing it
    all (``kproxy cleanup``, the lab's teardown, the soak's and the conformance suite's kernel checks)."""

    def remnants(self, probe: KernelProbe) -> list[str]: ...

    def kernel_view(self, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None: ...

    def cleanup_leftovers(self, config: ProxyConfig, *, netns: str | None = None) -> None: ...


class LabHooks(Protocol):
    """The lab and the conformance suite: what is impossible for the mode, and a lab node's own places."""

    def not_applicable(self, options: Mapping[str, Any]) -> Mapping[str, str]: ...

    def not_applicable_parts(self, options: Mapping[str, Any]) -> Mapping[str, Mapping[str, str]]: ...

    def lab_options(self, node: LabNodeSpec, options: Mapping[str, Any]) -> dict[str, Any]: ...

    def lab_prepare(self, node: LabNodeSpec, options: Mapping[str, Any]) -> None: ...


class BenchHooks(Protocol):
    """``kproxy bench sync``: the kernel's own time for what an instance last wrote."""

    def measure_floor(self, scratch: str) -> float | None: ...

    def measure_partial_floor(self) -> Mapping[str, float] | None: ...


# ----------------------------------------------------------------------------------------------- describe()


class ServiceDescription(TypedDict, total=False):
    """How one service port of one family is programmed: the common part of ``describe()`` (kproxy's own
    schema, the same for every mode; scenarios and ``kproxy show`` read it). ``applied``: the kernel holds it;
    ``failed``: why the kernel refused its latest version (it then runs its previous one, or nothing), or why the
    core refused (part of) it; ``refused``: only the latter (``kproxy.admission``: an address another service holds,
    or more than the mode can hold), as ``reason: message``; the addresses shown are those it was given."""

    clusterIP: str
    port: int
    nodePort: int
    externalIPs: list[str]
    loadBalancerIPs: list[str]
    loadBalancerSourceRanges: list[str]
    sessionAffinitySeconds: int
    internalTrafficPolicyLocal: bool
    externalTrafficPolicyLocal: bool
    internal: str  # the Verdict for ClusterIP traffic: forward, reject or drop
    external: str  # the Verdict for NodePort, externalIP and load-balancer traffic
    internalEndpoints: list[str]
    externalEndpoints: list[str]
    applied: bool
    failed: str | None
    refused: str | None


class Description(TypedDict, total=False):
    """``describe()``: ``services`` maps ``ns/name[:port]/PROTO`` to ``{IPv4|IPv6: ServiceDescription}``, from the
    ledger's published snapshot (no sync lock); ``generation`` is the cache generation last applied; ``detail`` is
    the backend's own, per service (``services``: same keys, with chains, map elements or sockets) and global
    (``counts`` and anything else), and is not compared by scenarios; ``live`` holds what changes without a sync
    (affinity entries, counters), read on request only."""

    mode: str
    generation: int
    services: dict[str, dict[str, ServiceDescription]]
    detail: dict[str, Any]
    live: dict[str, Any]


class VerifyReport(TypedDict):
    """``verify()``: the kernel read back against what the state wants. ``services`` maps ``ns/name[:port]/PROTO``
    to ``{IPv4|IPv6: "missing" | "different: ..."}``; ``extra`` what the kernel holds that nothing wanted accounts
    for; ``refused`` the differences of services the kernel refused (known, not drift); ``errors`` families that
    could not be read; ``drift`` counts services, extras and errors."""

    mode: str
    generation: int
    drift: int
    services: dict[str, dict[str, str]]
    extra: list[str]
    refused: dict[str, dict[str, str]]
    errors: list[str]


# ------------------------------------------------------------------------------------------------- the contract


class Proxier:
    """Base class of every backend (see the module docstring for the list a backend implements). Ledger-driven
    backends derive from ``kproxy.backend.LedgerProxier``, whose ``sync``, ``describe`` and ``verify`` are the ledger's.

    Rules of the contract:
    - ``__init__`` must not touch the kernel or start threads; ``start`` may start threads; ``sync`` touches the
      kernel, and the first ``sync`` (``changes.full``) adopts whatever this mode already left in the kernel and
      converges on the given state *without flushing*, so a restart does not disturb established connections.
    - ``sync`` is idempotent. It never raises for a problem with one service: it reports it in ``SyncResult.failed``
      and applies the rest. It returns ``ok=False`` when the kernel did not take the change, and the caller retries
      with a full sync; nothing is lost.
    - ``cleanup_leftovers`` removes everything this mode ever wrote on this node (also when nothing runs); it is
      never called on exit. Starting a mode calls ``cleanup_leftovers`` of every *other* installed mode first.
    - ``describe`` answers "how is this service programmed now" for ``/rules`` and ``kproxy show`` without waiting
      for a running sync.
    """

    mode: ClassVar[str] = ""
    #: Whether this mode's datapath NATs through conntrack, so stale UDP entries must be reconciled after syncs.
    uses_conntrack_nat: ClassVar[bool] = True
    #: Whether established connections keep working while kproxy restarts or another mode replaces this one (the
    #: kernel keeps forwarding them: conntrack NAT, sockets connected straight to a backend). A proxy that relays
    #: them through its own sockets says False: they end with the process, by nature.
    survives_restart: ClassVar[bool] = True
    #: This mode's own typed options (flags ``--<mode>-...``); their values reach ``config.backend_options``.
    options: ClassVar[tuple[Option, ...]] = ()
    #: What announces damage to this mode's kernel state, for the drift watcher (``kproxy.drift``): the nf_tables
    #: tables it writes, a poll interval for what the kernel does not announce; None: repaired at the sync period.
    DRIFT: ClassVar[Drift | None] = None
    #: What ``counters`` counts with ``--service-counters`` (``kproxy.counters``; connections in every mode that
    #: counts at all, packets and bytes where they cost no per-packet work the mode would not otherwise do); empty:
    #: the mode has no counters yet. The metrics, ``kproxy top`` and the docs show the rest as n/a.
    counters_offered: ClassVar[frozenset[Measure]] = frozenset()
    #: The mode's ``KernelHooks`` (its ``cleanup`` module: ``remnants``, ``kernel_view``, ``cleanup_leftovers``), which
    #: the classmethods of the same names call; None: the mode implements them itself.
    kernel_hooks: ClassVar[KernelHooks | None] = None

    def __init__(self, config: ProxyConfig, *, netns: str | None = None) -> None:
        """``netns`` aims the backend at a named network namespace (tests and benchmarks); the daemon leaves it None
        and programs the namespace it runs in, as upstream does."""
        self.config = config
        self.netns = netns

    def drift(self) -> Drift | None:
        """``DRIFT``, or what this instance's kernel flavour needs (asked once, before the first sync)."""
        return self.DRIFT

    # -- hooks that need no instance ----------------------------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        """Whether this host can run the mode; the reason names the missing kernel feature or package."""
        raise NotImplementedError(f"{cls.__name__} must implement the classmethod 'available'")

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> list[str]:
        """Add this backend's ``options`` as flags; returns their dests."""
        return add_option_flags(group, cls)

    @classmethod
    def option_values(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every option's value: ``given`` over the declared defaults."""
        out = {o.name: o.default for o in cls.options if o.default is not None}
        out.update({k: v for k, v in given.items() if k in {o.name for o in cls.options}})
        return out

    @classmethod
    def not_applicable(cls, options: Mapping[str, Any]) -> Mapping[str, str]:
        """Conformance scenarios physically impossible for this mode with these options: scenario id -> reason.
        The conformance runner checks every key against its scenario ids."""
        return MappingProxyType({})

    @classmethod
    def not_applicable_parts(cls, options: Mapping[str, Any]) -> Mapping[str, Mapping[str, str]]:
        """Parts of conformance scenarios (an assertion, a half) physically impossible for this mode with these
        options: scenario id -> part -> reason, declared up front. The runner checks every key against the scenario's
        own parts; a part a scenario finds not applicable at run time that is not declared here fails it."""
        return MappingProxyType({})

    @classmethod
    def lab_options(cls, node: LabNodeSpec, options: Mapping[str, Any]) -> dict[str, Any]:
        """Per-node option values for one lab node, on top of the ``options`` the lab was asked for (a cgroup and a
        pin folder of the node's own, ...; never the host's shared ones). The lab passes them to ``kproxy run`` as
        flags and to ``cleanup_leftovers`` when it takes the node down."""
        return {}

    @classmethod
    def lab_prepare(cls, node: LabNodeSpec, options: Mapping[str, Any]) -> None:
        """Prepare the machine for one lab node's kproxy before it starts (the bpf mode binds bpffs where a node's
        process reaches it); the lab calls it, never a real node. Default: nothing."""

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        """What this mode left in the kernel the probe looks at, one line per object ([] when nothing). A tool that
        fails raises (BackendError): "nothing left" must never stand for "could not look"."""
        if cls.kernel_hooks is None:
            raise NotImplementedError(f"{cls.__name__} must set 'kernel_hooks' or implement 'remnants'")
        return cls.kernel_hooks.remnants(probe)

    @classmethod
    def kernel_view(cls, probe: KernelProbe, family: IPFamily) -> dict[str, list[str]] | None:
        """What the kernel holds now, per service port (``ns/name[:port]/PROTO`` -> the lines, elements or entries
        that carry it, with counters where the kernel keeps them), read from the kernel and never from kproxy's
        memory: conformance checks that "an IPv6 change never rewrote IPv4 rules" or "an ignored service has no
        rules" with it. None when the mode has no such view."""
        return cls.kernel_hooks.kernel_view(probe, family) if cls.kernel_hooks is not None else None

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Remove everything this mode ever wrote on this node (or in ``netns``); no running instance needed."""
        if cls.kernel_hooks is None:
            raise NotImplementedError(f"{cls.__name__} must set 'kernel_hooks' or implement 'cleanup_leftovers'")
        cls.kernel_hooks.cleanup_leftovers(config, netns=netns)

    # -- the instance ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start what the backend runs besides syncs (a data-path loop, a BPF loader); called once, before the
        first sync, from the main thread."""

    def sync(self, state: ProxyState, changes: Changes, node: NodeContext | None = None) -> SyncResult:
        """Program ``state`` (``changes`` says what is dirty; ``node`` is this sync's node context, resolved by the
        caller once for every part, or by the backend itself when None). Runner thread only."""
        raise NotImplementedError(f"{type(self).__name__} must implement 'sync(state, changes)'")

    def describe(self, key: ServicePortName | None = None) -> Description:
        raise NotImplementedError(f"{type(self).__name__} must implement 'describe(key)'")

    def verify(self, state: ProxyState, node: NodeContext | None = None) -> VerifyReport | None:
        """Read back what the kernel holds and diff it against what ``state`` wants (``kproxy verify``, ``/verify``,
        the drift metric): ``{"drift": n, ...}``, or None when the mode cannot read its kernel state back. Any
        thread; read-only. ``kproxy.backend.LedgerProxier`` implements it over ``verify_view``/``verify_service``/
        ``verify_extra``."""
        return None

    def request_full(self, family: IPFamily) -> None:
        """Ask for a full sync of ``family`` at its next sync (any thread). Ledger-driven backends honour it."""

    def check_now(self, family: IPFamily) -> bool:
        """Run the cheap "is my state still there" check of ``family`` now, between syncs (runner thread only): True
        when the state is gone and a full sync of ``family`` is owed. Default: nothing to check."""
        return False

    def cleanup(self) -> None:
        """Remove everything this mode wrote (``cleanup_leftovers`` with this instance's config and namespace)."""
        type(self).cleanup_leftovers(self.config, netns=self.netns)

    def register_metrics(self, registry: Any, families: Sequence[IPFamily]) -> None:
        """Create this mode's own Prometheus metrics in ``registry`` (the daemon's prometheus_client registry), with
        upstream's names where upstream has them; ``observe_sync`` feeds them. Called once, before ``start``."""

    def observe_sync(self, family: IPFamily, result: SyncResult, *, full: bool, ok: bool) -> None:
        """Feed this mode's own metrics (``register_metrics``) after each sync of ``family``."""

    def counters(self, family: IPFamily) -> CounterDump | None:
        """Every programmed service port's traffic counters in ``family`` (``counters_offered`` says which), read
        from the kernel in one dump (one nft listing, one ``iptables-save -c``, one map iteration), or None when
        the mode does not count or ``config.service_counters`` is off. Any thread (a scrape); read-only."""
        return None

    def conntrack_answerers(self, sp: ServicePort) -> Iterable[tuple[str, int]]:
        """Who may legitimately answer a UDP flow to ``sp``'s addresses (address, port): every serving endpoint, as
        upstream. A mode that answers from somewhere else (a userspace proxy answers from the node) says so, so the
        conntrack reconciler never deletes its live flows."""
        return ((ep.ip, ep.port) for ep in sp.serving_endpoints)

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any] | None:
        """Where a new connection's first packet from ``src`` to ``dst:dport/proto`` would go through what this mode
        last programmed (``src_local``: sent by the node itself; ``dst_local``: ``dst`` is one of the node's own
        addresses, as for NodePorts). None when the mode has no packet explainer."""
        return None

    def measure_floor(self, scratch: str) -> float | None:
        """Seconds the kernel alone takes to apply the last *full* sync's exact payload, by the most direct means,
        into a fresh empty target (for ``kproxy bench sync``): ``scratch`` is a new, empty network namespace the
        bench made for it and deletes afterwards (a mode whose state lives outside namespaces, as bpf maps do, makes
        its fresh target itself). None if not measurable."""
        return None

    def measure_partial_floor(self) -> Mapping[str, float] | None:
        """For ``kproxy bench sync``: the kernel's own time to take the last *partial* sync's change again, by the most
        direct means, into the state it holds now: ``{"floor_s": seconds}``, plus any figures (seconds, keys ending in
        ``_s``) that explain where that time goes. Benchmarks only: it may rewrite what is programmed. None if not
        measurable."""
        return None

    def close(self) -> None:
        """Release sockets, file descriptors and threads; kernel state stays. Called after the runner has joined."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


# the base satisfies the three hook protocols (mypy checks these lines; overrides are held to the base's signatures)
_KERNEL_HOOKS: KernelHooks = Proxier
_LAB_HOOKS: LabHooks = Proxier
_BENCH_HOOKS: type[BenchHooks] = Proxier


def backend_class(mode: str) -> type[Proxier]:
    """The Proxier class of a mode. BackendError names what is wrong (unknown mode, backend not installed, or a
    backend whose import raises anything at all: bcc raises OSError when libbcc is missing)."""
    if mode not in MODE_NAMES and mode != FAKE_MODE:
        raise BackendError(f"unknown mode {mode!r}: choose one of {', '.join(MODE_NAMES)}")
    ep = _entry_points().get(mode)
    if ep is None:
        raise BackendError(f"mode {mode!r} is not implemented in this build of kproxy (no '{ENTRY_POINT_GROUP}' entry)")
    try:
        cls = ep.load()
    except Exception as exc:  # one mode that cannot load must never take a command down with it
        raise BackendError(f"mode {mode!r}: backend failed to import: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Proxier)) or cls.mode != mode:
        raise BackendError(f"entry point {ep.value} for mode {mode!r} is not a Proxier of that mode")
    return cls


def installed_backends() -> dict[str, type[Proxier]]:
    """Every mode of the table whose backend is installed and imports, in table order."""
    out: dict[str, type[Proxier]] = {}
    for mode in MODE_NAMES:
        try:
            out[mode] = backend_class(mode)
        except BackendError as exc:
            log.debug("%s", exc)
            continue
    return out


def availability(mode: str) -> Availability:
    """``available()`` of a mode, folding "not installed" and "unknown" into the reason."""
    try:
        cls = backend_class(mode)
    except BackendError as exc:
        return Availability(False, str(exc))
    try:
        return cls.available()
    except Exception as exc:  # a probe that blows up is a reason too, never a crash of `kproxy run`
        return Availability(False, f"{mode}: availability probe failed: {type(exc).__name__}: {exc}")


def available_backends() -> dict[str, type[Proxier]]:
    """Every installed mode whose ``available()`` says yes here, in table order."""
    return {mode: cls for mode, cls in installed_backends().items() if availability(mode)}


def cleanup_other_modes(
    config: ProxyConfig, *, netns: str | None = None, keep: str | None = None
) -> dict[str, str | None]:
    """Remove the leftovers of every installed, available mode but ``keep`` (default: ``config.mode``), as upstream's
    ``platformCleanup`` does when a mode starts. mode -> None when done, or the error (one mode failing never stops
    the others, nor the mode that starts)."""
    keep = config.mode if keep is None else keep
    out: dict[str, str | None] = {}
    for mode, cls in installed_backends().items():
        if mode == keep or not availability(mode):
            continue
        try:
            cls.cleanup_leftovers(config.with_(mode=mode), netns=netns)  # options are named per mode
            out[mode] = None
        except Exception as exc:
            out[mode] = f"{type(exc).__name__}: {exc}"
    return out
