"""``kproxy.syncfacts``: what the daemon derives from each synced state, updated from the changes alone, must equal
what a full rebuild of the same state gives, whatever the sequence of changes."""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.syncfacts import SyncFacts

FAMILIES = (IPFamily.V4, IPFamily.V6)
NAMES = [ServicePortName("ns", f"svc-{i // 2}", f"p{i % 2}", Protocol.TCP) for i in range(8)]


def port(spn: ServicePortName, fam: IPFamily, hc: bool, local: int, ready: bool, itp: bool) -> ServicePort:
    v4 = fam is IPFamily.V4
    eps = tuple(
        Endpoint(f"198.18.65.{10 + i}" if v4 else f"fd00:198:18:65::{10 + i}", 8080, is_local=True, ready=ready)
        for i in range(local)
    )
    return ServicePort(
        spn,
        fam,
        "198.19.0.1" if v4 else "fd00:198:19::1",
        80,
        health_check_node_port=31000 + int(spn.name[4:]) if hc else 0,
        serving_endpoints=eps,
        internal_policy_local=itp,
        local_endpoints=eps,
        has_any_endpoints=True,  # endpoints elsewhere: a Local policy without local ones drops
    )


versions = st.tuples(st.booleans(), st.integers(0, 2), st.booleans(), st.booleans())
states = st.dictionaries(st.tuples(st.sampled_from(NAMES), st.sampled_from(FAMILIES)), versions, max_size=12)


def state_of(spec: dict[tuple[ServicePortName, IPFamily], tuple[bool, int, bool, bool]]) -> ProxyState:
    fams: dict[IPFamily, dict[ServicePortName, ServicePort]] = {f: {} for f in FAMILIES}
    for (spn, fam), v in spec.items():
        fams[fam][spn] = port(spn, fam, *v)
    return ProxyState({f: MappingProxyType(m) for f, m in fams.items()}, NodeInfo("node-1"))


def summary(f: SyncFacts) -> tuple[object, ...]:
    return (f.health_ports(), f.local_ready(), [f.no_local_endpoints(fam) for fam in FAMILIES])


@settings(max_examples=150, deadline=None)
@given(st.lists(states, min_size=1, max_size=6))
def test_partial_updates_equal_a_full_rebuild(sequence: list[dict]) -> None:  # type: ignore[type-arg]
    running = SyncFacts(FAMILIES)
    previous: dict = {}  # type: ignore[type-arg]
    last_health: tuple[object, ...] | None = None
    for i, spec in enumerate(sequence):
        dirty = frozenset(spn for spn, _ in set(spec) ^ set(previous)) | frozenset(
            spn for key, v in spec.items() if previous.get(key) not in (None, v) for spn in [key[0]]
        )
        state = state_of(spec)
        running.update(state, Changes(full=i == 0, services=dirty))
        rebuilt = SyncFacts(FAMILIES)
        rebuilt.update(state, Changes(full=True))
        assert summary(running) == summary(rebuilt)
        # the daemon hands the health servers their table only when it changed: never a change missed
        health = summary(running)[:2]
        assert running.take_health_changed() or health == last_health
        assert not running.take_health_changed()
        last_health = health
        previous = spec


def test_health_changed_only_when_the_health_part_changed() -> None:
    a = ServicePortName("ns", "svc-1", "p0", Protocol.TCP)
    b = ServicePortName("ns", "svc-2", "p0", Protocol.TCP)
    facts = SyncFacts(FAMILIES)
    facts.update(state_of({(a, IPFamily.V4): (True, 1, True, False)}), Changes(full=True))
    assert facts.take_health_changed() and not facts.take_health_changed()
    # a service without a health port changes: nothing for the health servers
    spec = {(a, IPFamily.V4): (True, 1, True, False), (b, IPFamily.V4): (False, 2, True, True)}
    facts.update(state_of(spec), Changes(full=False, services=frozenset({b})))
    assert not facts.take_health_changed()
    # its local ready endpoints change: something
    spec[(a, IPFamily.V4)] = (True, 2, True, False)
    facts.update(state_of(spec), Changes(full=False, services=frozenset({a})))
    assert facts.take_health_changed() and facts.local_ready() == {a.service: 2}


@settings(max_examples=60, deadline=None)
@given(states)
def test_only_service_ports_with_a_share_are_held(spec: dict) -> None:  # type: ignore[type-arg]
    """Most service ports drop nothing and have no health port: nothing is kept for them (at 100,000 service ports a
    part each held about 35 MB for nothing)."""
    facts = SyncFacts(FAMILIES)
    state = state_of(spec)
    facts.update(state, Changes(full=True))
    sharing = {
        (spn, fam)
        for (spn, fam), (hc, local, _ready, itp) in spec.items()
        if hc or (itp and local == 0)  # a Local internal policy without local endpoints drops (endpoints elsewhere)
    }
    assert set(facts._parts) == sharing
