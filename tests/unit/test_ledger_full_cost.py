"""What a full sync costs the ledger per service port, counted in hashes of its name: a ``ServicePortName``'s hash
is a Python call (a frozen dataclass's), so at 100,000 service ports every lookup the ledger repeats per service
port is a tenth of a second. A first sync and an unchanged full sync look each name up a few times, not once per
dict the ledger copies or fills on the way."""

from __future__ import annotations

from types import MappingProxyType

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext

N = 400


class _CountedName(ServicePortName):
    """A ServicePortName that counts how often it is hashed."""

    hashed = 0

    def __hash__(self) -> int:
        _CountedName.hashed += 1
        return super().__hash__()


class _Plain(LedgerProxier[ServicePort, FamilyContext, None, None, None]):
    """A backend that renders a service port to itself and applies without looking at names."""

    mode = "plain"

    def __init__(self) -> None:
        super().__init__(ProxyConfig(ip_families=(IPFamily.V4,)))

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> ServicePort:
        return sp

    def apply(self, batch: Batch[ServicePort, FamilyContext, None, None]) -> Applied:
        return Applied()


def _state() -> ProxyState:
    ports = {}
    for i in range(N):
        name = _CountedName("ns", f"s{i}", "http", Protocol.TCP)
        eps = (Endpoint(f"198.18.{65 + i // 250}.{i % 250}", 8080),)
        ports[name] = ServicePort(name, IPFamily.V4, f"198.19.{i // 250}.{i % 250}", 80, cluster_endpoints=eps)
    return ProxyState({IPFamily.V4: MappingProxyType(ports)}, NodeInfo("node-1"))


def _hashes_per_port(backend: _Plain, state: ProxyState) -> float:
    _CountedName.hashed = 0
    result = backend.sync(state, Changes(full=True))
    assert result.ok and result.family(IPFamily.V4).services == N
    return _CountedName.hashed / N


def test_a_full_sync_looks_each_name_up_a_few_times() -> None:
    backend, state = _Plain(), _state()
    first = _hashes_per_port(backend, state)
    again = _hashes_per_port(backend, state)  # nothing changed: every fragment from the record
    assert backend.applied(IPFamily.V4)[1] == dict(state.family(IPFamily.V4))
    assert first <= 3, first
    assert again <= 5, again
