"""The first-class fake backend: no kernel, records what it was asked to program.

It syncs through the same ledger as every real backend (its fragment is the ServicePort itself), so the core's tests
cover the delta, refusal and retry rules once for all modes; core tests drive the cache, runner, daemon, health and
metrics through it, and ``kproxy bench sync --mode fake`` times the cache and ledger alone with it. ``fail_next``
makes the next N syncs fail as a whole; ``reject`` makes the "kernel" refuse services (with a reason), one per
apply, as iptables-restore stops at the first bad line; ``capacity`` declares limits as a real mode does.

It is registered as the ``fake`` entry point of ``kproxy.backends`` but never listed among the modes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from kproxy.admission import UNLIMITED, Limits
from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.model import Changes, IPFamily, ProxyState, ServicePort, ServicePortName, SyncResult
from kproxy.nodeaddr import FamilyContext, NodeContext
from kproxy.proxier import FAKE_MODE, Availability, KernelProbe

Programmed = Mapping[ServicePortName, ServicePort]  # what the fake's "kernel" holds in one family


class FakeProxier(LedgerProxier[ServicePort, FamilyContext, Programmed, Programmed, None]):
    """A backend with no kernel (see the module docstring)."""

    mode: ClassVar[str] = FAKE_MODE

    def __init__(self, config: ProxyConfig | None = None, *, netns: str | None = None) -> None:
        super().__init__(config or ProxyConfig(), netns=netns)
        self.lock = threading.Lock()
        self.programmed: dict[tuple[str, ServicePortName], ServicePort] = {}
        self.syncs: list[Changes] = []
        self.batches: list[Batch[ServicePort, FamilyContext, Programmed, None]] = []
        self.fail_next = 0
        self.reject: dict[ServicePortName, str] = {}  # services the "kernel" refuses, with the reason
        self.capacity: Limits = UNLIMITED  # what the "kernel" can hold per family (``limits``)
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
            if batch.full:
                self.programmed = {k: v for k, v in self.programmed.items() if k[0] != fam}
                self.programmed.update({(fam, spn): sp for spn, sp in batch.wanted.items()})
            else:
                for d in batch.deltas:
                    if d.new_fragment is None:
                        self.programmed.pop((fam, d.name), None)
                    else:
                        self.programmed[(fam, d.name)] = d.new_fragment
            return Applied()

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
