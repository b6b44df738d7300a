"""A throwaway fifth mode: what ``backends/__init__.py``'s list asks of a new mode and nothing else.

Its "kernel" is a dict per family; a service port renders to a dict; ``apply`` writes the batch into the kernel dict
(full: exactly ``wanted``; partial: the deltas), ``adopt`` and ``verify_view`` read it back. The ledger's contract
tests (``test_ledger_contract.py``) run it beside the fake: it passes them with no helper copied from anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.proxier import Availability, KernelProbe

Frag = dict[str, Any]  # one service port: its frontend and its endpoints
Kernel = dict[ServicePortName, Frag]  # what the "kernel" holds in one family
Ctx = tuple[IPFamily, tuple[str, ...]]  # the family and the Node's addresses in it


class DictMode(LedgerProxier[Frag, Ctx, Kernel, Kernel, None]):
    mode: ClassVar[str] = "dict"

    def __init__(self, config: ProxyConfig | None = None, *, netns: str | None = None) -> None:
        super().__init__(config or ProxyConfig(), netns=netns)
        self.kernel: dict[IPFamily, Kernel] = {f: {} for f in self.families}
        self.renders = 0

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def remnants(cls, probe: KernelProbe) -> list[str]:
        return []

    @classmethod
    def cleanup_leftovers(cls, config: ProxyConfig, *, netns: str | None = None) -> None:
        """Nothing outside this process."""

    def context(self, node: FamilyContext, state: ProxyState) -> Ctx:
        return (node.family, node.node_ips)

    def render(self, sp: ServicePort, ctx: Ctx) -> Frag:
        self.renders += 1
        front = f"{sp.cluster_ip}:{sp.port}/{sp.name.protocol.value}"
        return {"front": front, "to": [str(e) for e in sp.cluster_endpoints]}

    def apply(self, batch: Batch[Frag, Ctx, Kernel, None]) -> Applied:
        held = self.kernel[batch.family]
        leftovers = 0
        if batch.full:  # what it held that nothing wants and no delta names (deleted while it was down)
            leftovers = len(held.keys() - batch.wanted.keys() - set(batch.written))
            held.clear()
            held.update(batch.wanted)
        for d in batch.deltas:
            if d.new_fragment is None:
                held.pop(d.name, None)
            else:
                held[d.name] = d.new_fragment
        return Applied(leftovers=leftovers)

    def adopt(self, family: IPFamily, ctx: Ctx) -> Kernel:
        return dict(self.kernel[family])

    def adopted_unchanged(self, adopted: Kernel, name: ServicePortName, fragment: Frag) -> bool:
        return adopted.get(name) == fragment

    def verify_view(self, family: IPFamily, ctx: Ctx) -> Kernel:
        return dict(self.kernel[family])

    def verify_service(self, view: Kernel, name: ServicePortName, fragment: Frag) -> str | None:
        held = view.get(name)
        return None if held == fragment else "missing" if held is None else f"different: {held} != {fragment}"

    def verify_extra(self, view: Kernel, wanted: Mapping[ServicePortName, Frag]) -> list[str]:
        return [f"{name}: not wanted" for name in view if name not in wanted]
