"""The first-class fake backend: no kernel, records what it was asked to program.

It syncs through the same ledger as every real backend (its fragment is the ServicePort itself), so the core's tests
cover the delta, refusal and retry rules once for all modes; core tests drive the cache, runner, daemon, health and
metrics through it, and ``kproxy bench sync --mode fake`` times the cache and ledger alone with it. ``fail_next``
makes the next N syncs fail as a whole; ``reject`` makes the "kernel" refuse services (with a reason), one per
apply, as iptables-restore stops at the first bad line; ``capacity`` declares limits as a real mode does.
``set_counters`` gives a service port the traffic counters its "kernel" reports (``counters``, every measure), only
while it is programmed, as a real mode's counters go with its service.

It is registered as the ``fake`` entry point of ``kproxy.backends`` but never listed among the modes. What it was
asked (``syncs``, ``batches``) is kept for the last ``KEPT`` syncs and applies only, with the count of all of them: a
fake that runs for days (``kproxy run`` on it, a long bench) must not grow with every sync, and a full batch holds the
whole state.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar, overload

from kproxy.admission import UNLIMITED, Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.counters import ALL_MEASURES, CounterDump, Measure, PortCounters
from kproxy.model import Changes, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext, NodeContext
from kproxy.proxier import FAKE_MODE, Availability, KernelProbe

Programmed = Mapping[ServicePortName, ServicePort]  # what the fake's "kernel" holds in one family
T = TypeVar("T")
KEPT = 256  # syncs and applies the fake remembers


class Recent(Generic[T]):
    """The last ``keep`` items of a series and how many there were in all: ``len`` counts every item appended since
    the last ``clear``, and indexes and slices count from the first of those (an index no longer kept is an
    IndexError, a slice gives what is kept of it), so ``len`` before and a slice from it after still work."""

    def __init__(self, keep: int = KEPT) -> None:
        self._items: deque[T] = deque(maxlen=keep)
        self._count = 0

    def append(self, item: T) -> None:
        self._items.append(item)
        self._count += 1

    def clear(self) -> None:
        self._items.clear()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        first = self._count - len(self._items)  # the index of the oldest item kept
        if isinstance(index, slice):
            return [self._items[k - first] for k in range(*index.indices(self._count)) if k >= first]
        k = index + self._count if index < 0 else index
        if not first <= k < self._count:
            raise IndexError(f"item {index} of {self._count} is not kept (the last {len(self._items)} are)")
        return self._items[k - first]


class FakeProxier(LedgerProxier[ServicePort, FamilyContext, Programmed, Programmed, None]):
    """A backend with no kernel (see the module docstring)."""

    mode: ClassVar[str] = FAKE_MODE
    counters_offered: ClassVar[frozenset[Measure]] = ALL_MEASURES

    def __init__(self, config: ProxyConfig | None = None, *, netns: str | None = None) -> None:
        super().__init__(config or ProxyConfig(), netns=netns)
        self.lock = threading.Lock()
        self.programmed: dict[tuple[str, ServicePortName], ServicePort] = {}
        self.syncs: Recent[Changes] = Recent()
        self.batches: Recent[Batch[ServicePort, FamilyContext, Programmed, None]] = Recent()
        self.fail_next = 0
        self.reject: dict[ServicePortName, str] = {}  # services the "kernel" refuses, with the reason
        self.capacity: Limits = UNLIMITED  # what the "kernel" can hold per family (``limits``)
        self.counts: dict[tuple[IPFamily, ServicePortName], PortCounters] = {}  # the "kernel's" counters
        self.cleaned = False
        self.started = self.closed = False

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        return []

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Nothing in any kernel to remove."""

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True

    def sync(self, state: ProxyState, changes: Changes, node: NodeContext | None = None) -> SyncResult:
        with self.lock:
            self.syncs.append(changes)
            if self.fail_next > 0:
                self.fail_next -= 1
                return SyncResult(ok=False, full=changes.full, error="injected failure")
        return super().sync(state, changes, node)

    def set_counters(self, family: IPFamily, name: ServicePortName, counters: PortCounters) -> None:
        """What the "kernel" counted for ``name`` in ``family`` (reported while it is programmed)."""
        with self.lock:
            self.counts[(family, name)] = counters

    def counters(self, family: IPFamily) -> CounterDump:
        with self.lock:
            fam = family.value
            ports = {spn: pc for (f, spn), pc in self.counts.items() if f == family and (fam, spn) in self.programmed}
        return CounterDump(family, ports)

    def limits(self, family: IPFamily) -> Limits:
        return self.capacity

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> ServicePort:
        return sp

    def apply(self, batch: Batch[ServicePort, FamilyContext, Programmed, None]) -> Applied:
        with self.lock:
            self.batches.append(batch)
            for d in batch.deltas:
                if d.new_fragment is not None and d.name in self.reject and d.new_fragment != d.old_fragment:
                    return Applied(ok=False, refused=MappingProxyType({d.name: self.reject[d.name]}))
            fam = batch.family.value
            leftovers = 0
            if batch.full:
                named = set(batch.written)
                leftovers = sum(1 for f, s in self.programmed if f == fam and s not in batch.wanted and s not in named)
                self.programmed = {k: v for k, v in self.programmed.items() if k[0] != fam}
                self.programmed.update({(fam, spn): sp for spn, sp in batch.wanted.items()})
            else:
                for d in batch.deltas:
                    if d.new_fragment is None:
                        self.programmed.pop((fam, d.name), None)
                    else:
                        self.programmed[(fam, d.name)] = d.new_fragment
            return Applied(leftovers=leftovers)

    def adopt(self, family: IPFamily, ctx: FamilyContext) -> Programmed:
        """What the "kernel" holds: the fake's own record, as a real backend reads its table back."""
        with self.lock:
            return {spn: sp for (fam, spn), sp in self.programmed.items() if fam == family.value}

    def adopted_unchanged(self, adopted: Programmed, name: ServicePortName, fragment: ServicePort) -> bool:
        return adopted.get(name) == fragment

    def verify_view(self, family: IPFamily, ctx: FamilyContext) -> Programmed:
        return self.adopt(family, ctx)

    def verify_service(self, view: Programmed, name: ServicePortName, fragment: ServicePort) -> str | None:
        held = view.get(name)
        return None if held == fragment else "missing" if held is None else "different"

    def verify_extra(self, view: Programmed, wanted: Mapping[ServicePortName, ServicePort]) -> list[str]:
        return [f"{k}: not wanted" for k in view if k not in wanted]

    def detail(self, name: ServicePortName, family: IPFamily, fragment: ServicePort) -> dict[str, Any]:
        return {"programmed": True}

    def cleanup(self) -> None:
        with self.lock:
            self.programmed.clear()
            self.cleaned = True
        self.forget()
