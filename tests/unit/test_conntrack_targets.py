"""The conntrack reconciler's incremental target map (``kproxy.conntrack.TargetMap``) against a full rebuild.

Property (hypothesis, derandomized and bounded): after any sequence of syncs (service ports of either protocol and
family added, changed, moved onto each other's addresses, removed; node addresses changed) and reconciliations
(finished or not), the map kept from the changed service ports alone looks at exactly the addresses a full rebuild
from the state does (``service_targets``) plus those gone since the last finished reconciliation (upstream's
kubernetes#141371), each with the same answerers. And a partial reconciliation never walks the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.conntrack import (
    AddrPort,
    ConntrackReconciler,
    TargetMap,
    _Target,
    is_stale,
    service_targets,
    serving_endpoints,
)
from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,  # derandomized: nothing to remember between runs, and no .hypothesis folder in the tree
    suppress_health_check=[HealthCheck.too_slow],
)

NAMES = [ServicePortName("ns", f"s{i}", "p", proto) for i in range(4) for proto in (Protocol.UDP, Protocol.TCP)]
# few addresses, so service ports collide on one address:port (the union rule) and come back to gone ones
ADDRS = {
    IPFamily.V4: ("198.19.0.1", "198.19.0.2", "198.18.200.1"),
    IPFamily.V6: ("fd00:198:18::a", "fd00:0198:0018::b"),  # the second one not in canonical text
}
ENDPOINTS = {
    IPFamily.V4: tuple(Endpoint(f"198.18.64.{i}", 5353) for i in range(1, 4)),
    IPFamily.V6: tuple(Endpoint(f"fd00:198:18:7f::{i}", 5353) for i in range(1, 4)),
}
NODE_IPS = ("198.18.0.1", "198.18.0.2", "fd00:198:18::1", "fd00:0198:0018::2")


@st.composite
def service_port(draw: st.DrawFn, spn: ServicePortName, fam: IPFamily) -> ServicePort:
    addrs = ADDRS[fam]
    eps = tuple(draw(st.lists(st.sampled_from(ENDPOINTS[fam]), max_size=3, unique=True)))
    return ServicePort(
        spn,
        fam,
        draw(st.sampled_from(addrs)),
        draw(st.sampled_from((53, 54))),
        node_port=draw(st.sampled_from((0, 0, 30053, 30054))),
        external_ips=tuple(draw(st.lists(st.sampled_from(addrs), max_size=2))),
        cluster_endpoints=eps,
        serving_endpoints=eps,
        has_any_endpoints=bool(eps),
    )


@st.composite
def sync(draw: st.DrawFn) -> dict[tuple[IPFamily, ServicePortName], ServicePort | None]:
    """One sync's changes: some service ports of some families set or removed (None)."""
    out: dict[tuple[IPFamily, ServicePortName], ServicePort | None] = {}
    for _ in range(draw(st.integers(1, 4))):
        fam, spn = draw(st.sampled_from(list(IPFamily))), draw(st.sampled_from(NAMES))
        out[(fam, spn)] = draw(st.none() | service_port(spn, fam))
    return out


step = st.one_of(
    st.tuples(st.just("sync"), sync(), st.booleans()),  # the changes; whether the caller passes them (else None)
    st.tuples(st.just("nodes"), st.lists(st.sampled_from(NODE_IPS), max_size=3), st.just(False)),
    st.tuples(st.just("reconciled"), st.booleans(), st.just(False)),  # a reconciliation ended (finished or not)
)


def _state(services: Mapping[IPFamily, Mapping[ServicePortName, ServicePort]]) -> ProxyState:
    return ProxyState({f: MappingProxyType(dict(m)) for f, m in services.items()}, NodeInfo("node-1"))


def _proxied(sp: ServicePort) -> list[tuple[str, int]]:
    """A backend that answers from the node (as the userspace mode): the answer depends on the service port."""
    return [("198.18.0.1" if sp.family is IPFamily.V4 else "fd00:198:18::1", 40000 + sp.port)]


@SETTINGS
@given(st.lists(step, max_size=25))
def test_the_incremental_map_equals_a_full_rebuild(steps: list[tuple[str, object, bool]]) -> None:
    services: dict[IPFamily, dict[ServicePortName, ServicePort]] = {f: {} for f in IPFamily}
    maps = {f: TargetMap(f) for f in IPFamily}
    known: dict[IPFamily, frozenset[AddrPort]] = {f: frozenset() for f in IPFamily}  # the reference's memory
    nodes: list[str] = []
    for kind, arg, pass_changes in steps:
        if kind == "reconciled":
            for fam, m in maps.items():
                current = frozenset(service_targets(_state(services), fam, nodes))
                known[fam] = current if arg else known[fam] | current
                m.reconciled(bool(arg))
            continue
        changed: set[ServicePortName] = set()
        if kind == "nodes":
            nodes = list(arg)  # type: ignore[call-overload]
        else:
            for (fam, spn), sp in arg.items():  # type: ignore[attr-defined]
                changed.add(spn)
                if sp is None:
                    services[fam].pop(spn, None)
                else:
                    services[fam][spn] = sp
        state = _state(services)
        for fam, m in maps.items():
            m.update(state, changed if pass_changes or kind == "nodes" else None)
            m.set_nodes(nodes)
            for answerers in (serving_endpoints, _proxied):
                rebuilt = service_targets(state, fam, nodes, answerers)
                gone = {key: frozenset[AddrPort]() for key in known[fam] - rebuilt.keys()}
                want = {**gone, **{key: t.endpoints for key, t in rebuilt.items()}}
                assert {key: t.endpoints for key, t in m.targets(state, answerers).items()} == want
            assert m.gone == known[fam] - rebuilt.keys()
            assert m.new == rebuilt.keys() - known[fam]


class _NoWalk(Mapping[ServicePortName, ServicePort]):
    """A family's service ports that answer lookups but refuse to be walked: what a partial sync may touch."""

    def __init__(self, services: Mapping[ServicePortName, ServicePort]) -> None:
        self._services = dict(services)

    def __getitem__(self, key: ServicePortName) -> ServicePort:
        return self._services[key]

    def __len__(self) -> int:
        return len(self._services)

    def __iter__(self) -> Iterator[ServicePortName]:
        raise AssertionError("a partial reconciliation walked every service port")


class _Entries(ConntrackReconciler):
    """The reconciler's decisions over a fixed list of conntrack entries (orig dst, reply src), no kernel: the
    kernel side is tests/integration/test_conntrack.py."""

    def __init__(self, entries: list[tuple[AddrPort, AddrPort]]) -> None:
        super().__init__(families=(IPFamily.V4,))
        self.entries = entries
        self.stale: list[tuple[AddrPort, AddrPort]] = []

    def _delete_stale(self, family: IPFamily, targets: object) -> tuple[int, bool]:
        lookup: Callable[[AddrPort], _Target | None] = targets  # type: ignore[assignment]
        self.stale = [(o, r) for o, r in self.entries if (t := lookup(o)) is not None and is_stale(o, r, t)]
        return len(self.stale), True


def test_a_partial_reconciliation_looks_up_only_what_changed() -> None:
    dns = [ServicePortName("ns", f"dns-{i}", "dns", Protocol.UDP) for i in range(50)]
    old, new = Endpoint("198.18.64.1", 5353), Endpoint("198.18.64.2", 5353)
    table = {
        spn: ServicePort(spn, IPFamily.V4, f"198.19.0.{i + 1}", 53, cluster_endpoints=(old,), serving_endpoints=(old,))
        for i, spn in enumerate(dns)
    }
    flow = (("198.19.0.1", 53), ("198.18.64.1", 5353))  # a client's flow to dns-0, DNATed to its old endpoint
    gone_flow = (("198.19.0.50", 53), ("198.18.64.1", 5353))  # to dns-49, about to be deleted
    rec = _Entries([flow, gone_flow])
    assert rec.reconcile(ProxyState({IPFamily.V4: MappingProxyType(table)}, NodeInfo("n")), [])[IPFamily.V4] == 0
    # dns-0's endpoint moves and dns-49 is deleted: the next reconciliation is told so and walks nothing
    table[dns[0]] = ServicePort(
        dns[0], IPFamily.V4, "198.19.0.1", 53, cluster_endpoints=(new,), serving_endpoints=(new,)
    )
    del table[dns[49]]
    state = ProxyState({IPFamily.V4: _NoWalk(table)}, NodeInfo("n"))
    assert rec.reconcile(state, [], changed={dns[0], dns[49]})[IPFamily.V4] == 2
    assert rec.stale == [flow, gone_flow]  # the moved endpoint's flow, and the deleted service's (#141371)
    # (no kernel deletes them here): the gone address is forgotten once a reconciliation finished
    assert rec.reconcile(state, [], changed=set())[IPFamily.V4] == 1
    assert rec.stale == [flow]
