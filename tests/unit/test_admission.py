"""The core's admission rules (``kproxy.admission``), through the ledger every backend syncs with.

Address ownership: a ClusterIP beats an externalIP or load-balancer claim; between equals the holder keeps the key
through partial syncs, full syncs and restarts; the refused part is reported and the owner's entries are never touched
by the claimant's changes. Capacity: a service port over a mode's declared limits is left out with the reason and the
family keeps syncing. Driven through ``FakeProxier`` (its fragment is the admitted ServicePort itself), so what the
"kernel" holds is exactly what every backend would be handed.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.admission import Book, Limits
from kproxy.fake import FakeProxier
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

UDP = Protocol.UDP


def name(ns: str, svc: str, proto: Protocol = UDP) -> ServicePortName:
    return ServicePortName(ns, svc, "dns" if proto is UDP else "tcp", proto)


def port(
    ns: str,
    svc: str,
    vip: str,
    *,
    external: tuple[str, ...] = (),
    lbs: tuple[str, ...] = (),
    node_port: int = 0,
    eps: int = 1,
    created: str = "",
    proto: Protocol = UDP,
) -> ServicePort:
    endpoints = tuple(Endpoint(f"198.18.65.{10 + i}", 53) for i in range(eps))
    return ServicePort(
        name(ns, svc, proto),
        IPFamily.V4,
        vip,
        53,
        node_port=node_port,
        external_ips=external,
        load_balancer_ips=lbs,
        cluster_endpoints=endpoints,
        has_any_endpoints=eps > 0,
        created=created,
    )


def state(*sps: ServicePort) -> ProxyState:
    v4 = {sp.name: sp for sp in sps}
    return ProxyState({IPFamily.V4: MappingProxyType(v4), IPFamily.V6: MappingProxyType({})}, NodeInfo("node-1"))


def full() -> Changes:
    return Changes(full=True)


def partial(*sps: ServicePort | ServicePortName) -> Changes:
    return Changes(full=False, services=frozenset(s if isinstance(s, ServicePortName) else s.name for s in sps))


def held(fake: FakeProxier, spn: ServicePortName) -> ServicePort | None:
    return fake.programmed.get(("IPv4", spn))


DNS = port("kube-system", "kube-dns", "198.19.0.10", created="2020-01-01T00:00:00Z")
# a Service of another tenant, in a namespace that sorts before kube-system, listing kube-dns's ClusterIP
THIEF = port("aaa", "thief", "198.19.0.20", external=("198.19.0.10", "198.19.100.5"), created="2026-01-01T00:00:00Z")


def test_an_external_ip_never_takes_another_services_cluster_ip() -> None:
    fake = FakeProxier()
    for changes in (full(), partial(THIEF), full()):  # created together, then touched, then the periodic full sync
        res = fake.sync(state(DNS, THIEF), changes)
        assert res.ok and not res.failed
        assert held(fake, DNS.name) == DNS
        thief = held(fake, THIEF.name)
        assert thief is not None and thief.external_ips == ("198.19.100.5",)  # only the address nobody holds
        assert "198.19.0.10:53/UDP is held by kube-system/kube-dns:dns" in res.refused[THIEF.name]
        assert res.refused[THIEF.name].startswith("address-conflict: ")
        assert DNS.name not in res.refused
    # the refusal is in describe(): the common part says why, and what was refused is what it was handed
    desc = fake.describe(THIEF.name)["services"]["aaa/thief:dns/UDP"]["IPv4"]
    assert desc["refused"] is not None and "kube-dns" in desc["refused"] and desc["failed"] == desc["refused"]


def test_the_cluster_ip_wins_over_an_external_claim_that_came_first() -> None:
    fake = FakeProxier()
    assert fake.sync(state(THIEF), full()).ok
    thief = held(fake, THIEF.name)
    assert thief is not None and thief.external_ips == THIEF.external_ips  # nobody held 198.19.0.10:53 yet
    fake.batches.clear()
    res = fake.sync(state(THIEF, DNS), partial(DNS))
    assert held(fake, DNS.name) == DNS
    thief = held(fake, THIEF.name)
    assert thief is not None and thief.external_ips == ("198.19.100.5",)  # evicted in the same sync
    assert {d.name for b in fake.batches for d in b.deltas} == {DNS.name, THIEF.name}
    assert THIEF.name in res.refused
    # kube-dns goes: the externalIP claim waits for the key and gets it in the same sync
    res = fake.sync(state(THIEF), partial(DNS))
    thief = held(fake, THIEF.name)
    assert thief is not None and thief.external_ips == THIEF.external_ips and not res.refused


def test_deleting_the_refused_claimant_never_touches_the_owner() -> None:
    fake = FakeProxier()
    assert fake.sync(state(DNS, THIEF), full()).ok
    fake.batches.clear()
    res = fake.sync(state(DNS), partial(THIEF))
    assert res.ok and not res.refused
    assert held(fake, DNS.name) == DNS
    assert [d.name for b in fake.batches for d in b.deltas] == [THIEF.name]  # the owner is not rewritten


def test_between_equals_the_holder_keeps_the_key_through_syncs_and_a_restart() -> None:
    first = port("zzz", "first", "198.19.0.30", external=("198.19.100.7",), created="2026-06-01T00:00:00Z")
    # older, and sorts first: it would win any tie-break, but the key is held already when it comes
    second = port("aaa", "second", "198.19.0.31", external=("198.19.100.7",), created="2020-01-01T00:00:00Z")
    fake = FakeProxier()
    assert fake.sync(state(first), full()).ok
    for changes in (partial(second), full(), partial(first, second)):
        res = fake.sync(state(first, second), changes)
        assert held(fake, first.name) == first
        got = held(fake, second.name)
        assert got is not None and got.external_ips == ()
        assert "held by zzz/first:dns" in res.refused[second.name]
    # a restarted process: an empty book, a kernel that holds first's version; adoption says who holds the key
    restarted = FakeProxier()
    restarted.programmed = dict(fake.programmed)
    fake.batches.clear()
    res = restarted.sync(state(second, first), full())  # second listed first: the order must not matter
    assert held(restarted, first.name) == first and second.name in res.refused
    assert not [d for b in restarted.batches for d in b.deltas]  # nothing changed: nothing written
    # a node that never held it (an empty kernel): the older Service wins
    fresh = FakeProxier()
    res = fresh.sync(state(first, second), full())
    got = held(fresh, second.name)
    assert got is not None and got.external_ips == ("198.19.100.7",) and first.name in res.refused


def test_node_ports_and_load_balancer_ips_follow_the_same_rule() -> None:
    a = port("ns", "a", "198.19.0.40", node_port=30053, lbs=("198.19.200.1",), created="2020-01-01T00:00:00Z")
    b = port("ns", "b", "198.19.0.41", node_port=30053, lbs=("198.19.200.1",), created="2021-01-01T00:00:00Z")
    fake = FakeProxier()
    res = fake.sync(state(a, b), full())
    assert held(fake, a.name) == a
    got = held(fake, b.name)
    assert got is not None and (got.node_port, got.load_balancer_ips) == (0, ())
    assert "nodePort 30053/UDP is held by ns/a:dns" in res.refused[b.name]
    # a TCP port of the same number is another key
    c = port("ns", "c", "198.19.0.42", node_port=30053, proto=Protocol.TCP)
    assert fake.sync(state(a, b, c), partial(c)).ok and held(fake, c.name) == c


def test_a_cluster_ip_twice_refuses_the_whole_later_service_port() -> None:
    a = port("ns", "a", "198.19.0.50", created="2020-01-01T00:00:00Z")
    b = port("ns", "b", "198.19.0.50", created="2021-01-01T00:00:00Z")
    fake = FakeProxier()
    res = fake.sync(state(b, a), full())
    assert held(fake, a.name) == a and held(fake, b.name) is None
    assert res.refused[b.name].startswith("address-conflict: ClusterIP 198.19.0.50:53/UDP is held by ns/a:dns")
    desc = fake.describe()["services"]["ns/b:dns/UDP"]["IPv4"]
    assert desc["applied"] is False and desc["refused"]
    # the verify view does not count the refused service as drift
    assert fake.verify(state(a, b))["drift"] == 0


def test_own_duplicates_are_served_once() -> None:
    own = port("ns", "own", "198.19.0.60", external=("198.19.0.60", "198.19.100.9"), lbs=("198.19.100.9",))
    fake = FakeProxier()
    res = fake.sync(state(own), full())
    got = held(fake, own.name)
    assert got is not None and (got.external_ips, got.load_balancer_ips) == (("198.19.100.9",), ())
    assert not res.refused  # nothing of another service's was claimed


def test_a_service_over_the_modes_limits_is_left_out_and_the_family_keeps_syncing() -> None:
    fake = FakeProxier()
    fake.capacity = Limits(service_ports=2, endpoints_per_port=3)
    a, b, c = (port("ns", n, f"198.19.0.{70 + i}") for i, n in enumerate("abc"))
    big = port("ns", "big", "198.19.0.80", eps=4)
    res = fake.sync(state(a, b, c, big), full())
    assert res.ok and not res.failed
    assert held(fake, a.name) == a and held(fake, b.name) == b
    assert held(fake, c.name) is None and held(fake, big.name) is None
    assert res.refused[c.name].startswith("capacity: needs 1 service ports; this mode holds at most 2")
    assert res.refused[big.name] == "capacity: 4 endpoints, over this mode's 3 per service port"
    # more syncs keep succeeding; removing a frees room for the one that waits
    res = fake.sync(state(b, c, big), partial(a.name))
    assert res.ok and held(fake, c.name) == c and c.name not in res.refused and big.name in res.refused
    # the big one shrinks under the limit: admitted once there is room... there is none, so it stays out
    small = dataclasses.replace(big, cluster_endpoints=big.cluster_endpoints[:2])
    res = fake.sync(state(b, c, small), partial(small))
    assert held(fake, small.name) is None and "needs 1 service ports" in res.refused[small.name]
    res = fake.sync(state(c, small), partial(b.name))
    assert held(fake, small.name) == small and not res.refused


def test_the_book_alone_is_o_changes() -> None:
    """An unchanged service port is not decided again: the admitted version stands (identity, no work)."""
    book = Book()
    sps = [port("ns", f"s{i}", f"198.19.1.{i}") for i in range(50)]
    assert book.admit([(sp.name, sp) for sp in sps]) == {}  # nothing else gained or lost anything
    assert all(book.version(sp.name, sp) is sp for sp in sps) and not book.altered
    assert book.admit([(sp.name, sp) for sp in sps]) == {}


class _OneByOne(Book):
    """The capacity check without its bulk path: every service port through ``_misfit``, in order."""

    def _fit_all(self, todo: list[tuple[ServicePortName, ServicePort | None]]) -> bool:
        return False


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    st.tuples(st.integers(1, 8), st.integers(1, 30), st.integers(2, 6)),
    st.lists(st.dictionaries(st.integers(0, 9), st.one_of(st.none(), st.integers(0, 8)), max_size=10), max_size=8),
)
def test_the_capacity_check_counts_at_once_what_it_counts_one_by_one(
    limits: tuple[int, int, int], syncs: list[dict[int, int | None]]
) -> None:
    """Random syncs (service ports added, grown, shrunk, removed) under small limits: the bulk path (everything
    fits) leaves the book as the one-by-one path does, refusals, waiting service ports and usage included."""
    ports, endpoints, per_port = limits
    lim = Limits(service_ports=ports, endpoints=endpoints, entries=2 * endpoints, endpoints_per_port=per_port)
    fast, slow = Book(limits=lim), _OneByOne(limits=lim)
    for changes in syncs:
        pairs = [
            (name("ns", f"s{i}"), None if n is None else port("ns", f"s{i}", f"198.19.2.{i}", eps=n))
            for i, n in changes.items()
        ]
        assert fast.admit(pairs) == slow.admit(pairs)
        for field in ("usage", "totals", "refused", "over_capacity", "admitted", "altered", "room_freed"):
            assert getattr(fast, field) == getattr(slow, field), field


class _CountedName(ServicePortName):
    """A ServicePortName that counts how often it is hashed (the dataclass hash is a Python call per use)."""

    hashed = 0

    def __hash__(self) -> int:
        _CountedName.hashed += 1
        return super().__hash__()


def test_a_first_sync_under_limits_hashes_each_service_port_a_few_times_not_once_per_check() -> None:
    """The capacity check of a first sync whose service ports all fit counts them at once: per service port a
    usage entry, not a lookup, a removal, an insertion and a discard."""
    n = 500
    sps = [
        dataclasses.replace(p, name=_CountedName(p.name.namespace, p.name.name, p.name.port, p.name.protocol))
        for p in (port("ns", f"s{i}", f"198.19.{3 + i // 250}.{i % 250}", eps=3) for i in range(n))
    ]
    book = Book(limits=Limits(service_ports=n, endpoints=3 * n, entries=4 * n, endpoints_per_port=3))
    _CountedName.hashed = 0
    assert book.admit([(sp.name, sp) for sp in sps]) == {}
    assert not book.refused and book.totals == [n, 3 * n, 4 * n]
    assert _CountedName.hashed <= 3 * n, _CountedName.hashed / n


def test_describe_reads_the_refusals_while_a_sync_changes_them() -> None:
    """``describe()`` (``/rules``, from the HTTP server's thread) reads the admission book while the sync's thread
    refuses or admits service ports. Seen in `kproxy bench sync --mode userspace --services 50000` (34,096 refused):
    "dictionary changed size during iteration". Here the book changes while describe formats a refusal."""
    fake = FakeProxier()
    fake.capacity = Limits(service_ports=1)
    a, b, c = (port("ns", n, f"198.19.0.{90 + i}") for i, n in enumerate("abc"))
    assert fake.sync(state(a, b, c), full()).refused.keys() == {b.name, c.name}
    book = fake.ledger.books[IPFamily.V4]

    class Meanwhile(str):
        def __format__(self, spec: str) -> str:  # the sync's thread refuses one more service port meanwhile
            book.refused.setdefault(name("ns", "late"), book.refused[c.name])
            return str.__format__(self, spec)

    book.refused[b.name] = dataclasses.replace(book.refused[b.name], message=Meanwhile("room for 1"))
    services = fake.describe()["services"]
    assert services["ns/b:dns/UDP"]["IPv4"]["refused"] == "capacity: room for 1"
    assert name("ns", "late") in book.refused
