"""The contract every backend implements, and the one ordered table of modes.

Why the cut sits here: everything Kubernetes means by a Service (which objects count, how slices merge, which
endpoints this node may use, reject versus drop) is decided once, in the cache, and handed to a backend as a
``ProxyState`` of node-local ``ServicePort`` values plus ``Changes`` (what is dirty). A backend only translates
that into kernel state (iptables rules, nftables maps, BPF maps, proxy sockets). So four very different
datapaths behave the same by construction, and the semantics are unit-tested once, without root.

The mode table (``MODES``) is the single source for ``--mode`` validation, ``/proxyMode``, ``kproxy --help`` and
the docs. The core never imports a backend module by name: backends register under the ``kproxy.backends``
entry-point group (see pyproject.toml) and are looked up through it, which import-linter can enforce.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.config import ProxyConfig
from kproxy.model import Changes, ProxyState, ServicePort, ServicePortName, SyncResult

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


class BackendError(RuntimeError):
    """A backend cannot be loaded or cannot run here; the message says why."""


class Proxier:
    """Base class of every backend. Subclasses set ``mode`` and implement ``sync``, ``describe`` and ``cleanup``.

    Rules of the contract:
    - ``__init__`` must not touch the kernel; ``sync`` does, and the first ``sync`` (``changes.full``) adopts
      whatever this mode already left in the kernel and converges on the given state *without flushing*, so a
      restart does not disturb established connections.
    - ``sync`` is idempotent. On a full sync the backend rewrites everything it owns and removes what is no
      longer wanted; otherwise it rewrites only ``changes.services``. It never raises for a problem with one
      service: it reports it in ``SyncResult.failed`` and applies the rest. It returns ``ok=False`` when the
      kernel did not take the change, and the caller retries with a full sync; nothing is lost.
    - ``cleanup`` removes everything this mode ever wrote on this node (also when nothing runs); it is never
      called on exit. Starting a mode calls ``cleanup`` of every *other* installed mode first.
    - ``describe`` answers "how is this service programmed now" from what the backend wrote, for ``/rules``
      and ``kproxy show``.
    """

    mode: ClassVar[str] = ""
    #: Conformance scenarios that are physically impossible for this mode: scenario id -> reason.
    not_applicable: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: Whether this mode's datapath NATs through conntrack, so stale UDP entries must be reconciled after syncs.
    uses_conntrack_nat: ClassVar[bool] = True

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config

    @classmethod
    def available(cls) -> Availability:
        """Whether this host can run the mode; the reason names the missing kernel feature or package."""
        raise NotImplementedError(f"{cls.__name__} must implement the classmethod 'available'")

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """Declare this backend's own flags (``--<mode>-...``); their values reach ``config.backend_options``."""

    def sync(self, state: ProxyState, changes: Changes) -> SyncResult:
        raise NotImplementedError(f"{type(self).__name__} must implement 'sync(state, changes)'")

    def describe(self, key: ServicePortName | None = None) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement 'describe(key)'")

    def cleanup(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement 'cleanup()'")

    def trace(
        self, src: str, proto: str, dst: str, dport: int, *, src_local: bool = False, dst_local: bool = False
    ) -> dict[str, Any] | None:
        """Where a new connection's first packet from ``src`` to ``dst:dport/proto`` would go through what this mode
        last programmed (``src_local``: sent by the node itself; ``dst_local``: ``dst`` is one of the node's own
        addresses, as for NodePorts). None when the mode has no packet explainer."""
        return None

    def measure_floor(self) -> float | None:
        """Seconds the kernel alone takes to apply the last *full* sync's exact payload, by the most direct means,
        into a fresh empty target the backend makes itself (for ``kproxy bench sync``). None if not measurable."""
        return None

    def measure_partial_floor(self) -> Mapping[str, float] | None:
        """For ``kproxy bench sync``: the kernel's own time to take the last *partial* sync's change again, by the most
        direct means, into the state it holds now: ``{"floor_s": seconds}``, plus any figures (seconds, keys ending in
        ``_s``) that explain where that time goes. Benchmarks only: it may rewrite what is programmed. None if not
        measurable."""
        return None

    def close(self) -> None:
        """Release sockets, file descriptors and threads; kernel state stays."""


class FakeProxier(Proxier):
    """A backend with no kernel: records what it was asked to program.

    Core tests drive the cache, runner, daemon, health and metrics through it, and ``kproxy bench sync --mode
    fake`` times the cache alone with it. ``fail_next`` makes the next N syncs fail, to test retries.
    """

    mode = "fake"

    def __init__(self, config: ProxyConfig | None = None) -> None:
        super().__init__(config or ProxyConfig())
        self.lock = threading.Lock()
        self.programmed: dict[tuple[str, ServicePortName], ServicePort] = {}
        self.syncs: list[Changes] = []
        self.fail_next = 0
        self.reject: dict[ServicePortName, str] = {}  # services the "kernel" refuses, with the reason
        self.cleaned = False

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    def sync(self, state: ProxyState, changes: Changes) -> SyncResult:
        with self.lock:
            self.syncs.append(changes)
            if self.fail_next > 0:
                self.fail_next -= 1
                return SyncResult(ok=False, full=changes.full, error="injected failure")
            failed: dict[ServicePortName, str] = {}
            if changes.full:
                wanted = {(sp.family.value, sp.name): sp for sp in state}
                self.programmed = {k: v for k, v in wanted.items() if k[1] not in self.reject}
            else:
                for spn in changes.services:
                    for fam in state.services:
                        self.programmed.pop((fam.value, spn), None)
                        sp = state.get(spn, fam)
                        if sp is not None and spn not in self.reject:
                            self.programmed[(fam.value, spn)] = sp
            for spn, why in self.reject.items():
                if any(s.name == spn for s in state):
                    failed[spn] = why
            return SyncResult(
                ok=True,
                full=changes.full,
                failed=MappingProxyType(failed),
                counts=MappingProxyType({"services": len(self.programmed)}),
            )

    def describe(self, key: ServicePortName | None = None) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = {}
            for (fam, spn), sp in sorted(self.programmed.items()):
                if key is not None and spn != key:
                    continue
                out.setdefault(str(spn) + "/" + spn.protocol.value, {})[fam] = {
                    "clusterIP": sp.cluster_ip,
                    "port": sp.port,
                    "internal": sp.internal_verdict.value,
                    "external": sp.external_verdict.value,
                    "endpoints": [str(e) for e in sp.internal_endpoints],
                }
            return {"mode": self.mode, "services": out}

    def cleanup(self) -> None:
        with self.lock:
            self.programmed.clear()
            self.cleaned = True


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def backend_class(mode: str) -> type[Proxier]:
    """The Proxier class of a mode. BackendError names what is wrong (unknown mode, backend not installed)."""
    if mode == FakeProxier.mode:
        return FakeProxier
    if mode not in MODE_NAMES:
        raise BackendError(f"unknown mode {mode!r}: choose one of {', '.join(MODE_NAMES)}")
    ep = _entry_points().get(mode)
    if ep is None:
        raise BackendError(f"mode {mode!r} is not implemented in this build of kproxy (no '{ENTRY_POINT_GROUP}' entry)")
    try:
        cls = ep.load()
    except ImportError as exc:
        raise BackendError(f"mode {mode!r}: backend failed to import: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Proxier)) or cls.mode != mode:
        raise BackendError(f"entry point {ep.value} for mode {mode!r} is not a Proxier of that mode")
    return cls


def installed_backends() -> dict[str, type[Proxier]]:
    """Every mode of the table whose backend is installed and imports, in table order."""
    out: dict[str, type[Proxier]] = {}
    for mode in MODE_NAMES:
        try:
            out[mode] = backend_class(mode)
        except BackendError:
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
        return Availability(False, f"{mode}: availability probe failed: {exc}")
