"""The read-behind: a periodic read-back of the kernel off the sync path that finds in-place edits and never
mistakes a sync that ran during its read for damage.

Driven through ``FakeProxier`` (its "kernel" is its own record, which a test edits in place as someone with
``bpftool`` would edit a map), so the core's rules are tested once here; the bpf mode's real maps are in
``tests/integration/test_bpf_read_behind.py``.
"""

from __future__ import annotations

import threading
from types import MappingProxyType

from kproxy.config import ProxyConfig
from kproxy.fake import FakeProxier
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.readbehind import ReadBehind

V4 = IPFamily.V4


def spn(name: str) -> ServicePortName:
    return ServicePortName("ns", name, "http", Protocol.TCP)


def sp(name: str, n: int, eps: int = 1) -> ServicePort:
    endpoints = tuple(Endpoint(f"198.18.65.{10 + i}", 8080) for i in range(eps))
    return ServicePort(spn(name), V4, f"198.19.0.{n}", 80, cluster_endpoints=endpoints, has_any_endpoints=eps > 0)


def state(*sps: ServicePort, generation: int = 1) -> ProxyState:
    fams = {V4: MappingProxyType({s.name: s for s in sps}), IPFamily.V6: MappingProxyType({})}
    return ProxyState(fams, NodeInfo("node-1"), generation=generation)


class Repairs:
    def __init__(self) -> None:
        self.asked: list[tuple[frozenset[IPFamily], str]] = []

    def __call__(self, families: frozenset[IPFamily], why: str) -> None:
        self.asked.append((families, why))


class Reads(FakeProxier):
    """The fake, recording what the read-behind tells it (``kernel_read``)."""

    def __init__(self) -> None:
        super().__init__(ProxyConfig(ip_families=(V4,)))
        self.told: list[float | None] = []

    def kernel_read(self, family: IPFamily, at: float | None) -> None:
        self.told.append(at)


Reader = ReadBehind[object, object, object, object, object]


def reader(fake: Reads) -> tuple[Reader, Repairs]:
    """A read-behind of ``fake``'s ledger (no thread: the tests run its steps) and the repairs it asks for."""
    repairs = Repairs()
    return ReadBehind(fake.ledger, threading.Lock(), repairs), repairs  # type: ignore[arg-type]


def loaded(n: int = 5, fake: Reads | None = None, eps: int = 2) -> tuple[Reads, list[ServicePort], Reader, Repairs]:
    fake = fake or Reads()
    sps = [sp(f"s{i}", 10 + i, eps=eps) for i in range(n)]
    assert fake.sync(state(*sps), Changes(full=True)).ok
    rb, repairs = reader(fake)
    return fake, sps, rb, repairs


def test_a_clean_kernel_is_a_clean_read_and_the_backend_may_trust_its_memory() -> None:
    fake, _, rb, repairs = loaded()
    out = rb.once(V4)
    assert out is not None and out.compared and out.differences == ()
    assert repairs.asked == [] and len(fake.told) == 1 and fake.told[0] is not None
    assert fake.ledger.records[V4].touched is None  # no noting left running


def test_an_edit_in_place_is_found_and_repaired_and_the_backend_told_to_read_the_kernel() -> None:
    fake, sps, rb, repairs = loaded()
    with fake.lock:  # someone rewrites one service's entry in the "kernel" by hand
        fake.programmed[(V4.value, sps[2].name)] = sp("s2", 12, eps=1)
    out = rb.once(V4)
    assert out is not None and out.compared
    assert out.differences == ("ns/s2:http/TCP: different",)
    assert [fams for fams, _ in repairs.asked] == [frozenset({V4})]
    assert fake.told == [None]


def test_a_foreign_extra_is_found() -> None:
    fake, _, rb, repairs = loaded()
    with fake.lock:
        fake.programmed[(V4.value, spn("stranger"))] = sp("stranger", 99)
    out = rb.once(V4)
    assert out is not None and len(out.differences) == 1 and "stranger" in out.differences[0]
    assert len(repairs.asked) == 1


def test_partial_syncs_during_the_read_are_not_damage() -> None:
    """The read sees the kernel before a partial sync that changes one service, adds one and removes one; the
    ledger has recorded the sync by the time the read finishes. Compared without the touched services, the stale
    view of all three would be three differences (and a full batch for nothing)."""
    fake, sps, rb, repairs = loaded()
    r = rb.begin(V4)
    assert r is not None
    rb.read(r)  # the kernel as it was
    changed, added = sp("s1", 11, eps=3), sp("new", 50)
    after = [changed if s.name == changed.name else s for s in sps if s.name != sps[4].name] + [added]
    names = frozenset({changed.name, added.name, sps[4].name})
    assert fake.sync(state(*after, generation=2), Changes(full=False, services=names)).ok
    out = rb.finish(r)
    assert out.compared and out.differences == () and out.skipped == 2  # s1 and "new": touched since the read began
    assert repairs.asked == [] and fake.told and fake.told[-1] is not None


def test_the_same_stale_view_without_the_noting_would_be_damage() -> None:
    """The check the previous test relies on: the stale view against the ledger's new record differs."""
    fake, sps, rb, _ = loaded()
    r = rb.begin(V4)
    assert r is not None
    rb.read(r)
    changed = sp("s1", 11, eps=3)
    after = [changed if s.name == changed.name else s for s in sps]
    assert fake.sync(state(*after, generation=2), Changes(full=False, services=frozenset({changed.name}))).ok
    assert r.view is not None
    assert fake.verify_service(r.view, changed.name, fake.ledger.records[V4].fragments[changed.name]) == "different"


def test_a_full_batch_during_the_read_concludes_nothing() -> None:
    fake, sps, rb, repairs = loaded()
    r = rb.begin(V4)
    assert r is not None
    with fake.lock:
        fake.programmed[(V4.value, sps[0].name)] = sp("s0", 10, eps=5)  # damage the full batch below puts back
    rb.read(r)
    assert fake.sync(state(*sps, generation=2), Changes(full=True)).ok
    out = rb.finish(r)
    assert not out.compared and repairs.asked == [] and fake.told == []
    assert fake.ledger.records[V4].touched is None


def test_nothing_applied_is_nothing_to_read() -> None:
    rb, _ = reader(Reads())
    assert rb.once(V4) is None


def test_with_a_read_behind_a_due_read_back_no_longer_makes_a_sync_full() -> None:
    class Due(Reads):
        def readback_due(self, family: IPFamily) -> bool:
            return True

    fake = Due()
    a, b = sp("a", 10), sp("b", 11)
    assert fake.sync(state(a, b), Changes(full=True)).ok
    fake.ledger._checked_at.clear()  # the cheap check is due at the next partial sync
    b2 = sp("b", 11, eps=2)
    assert fake.sync(state(a, b2, generation=2), Changes(full=False, services=frozenset({b.name}))).full
    fake.ledger.read_behind = True
    fake.ledger._checked_at.clear()
    b3 = sp("b", 11, eps=3)
    assert not fake.sync(state(a, b3, generation=3), Changes(full=False, services=frozenset({b.name}))).full


def test_reads_take_at_most_their_share_of_the_time() -> None:
    """A read that took 2 s lets the next begin 200 s after it (``SHARE`` 1%); before the first read the cost is
    guessed from the table's size, counted from when a read was first due."""
    from kproxy import readbehind

    _, _, rb, _ = loaded(5)
    guess = 5 * readbehind.GUESS_S_PER_PORT / readbehind.SHARE
    assert not rb.paced(V4, 1000.0)
    assert not rb.paced(V4, 1000.0 + guess / 2)
    assert rb.paced(V4, 1000.0 + guess * 1.01)
    out = rb.once(V4)  # a real read records what it took
    assert out is not None and rb.last_s > 0
    rb._done(V4, 2000.0, 2.0)
    assert not rb.paced(V4, 2100.0)
    assert rb.paced(V4, 2200.0)


class ByElement(Reads):
    """A "kernel" whose extras are judged per element, as the bpf and nftables modes judge theirs: an entry the view
    holds is foreign unless some wanted fragment is exactly it (a name alone does not explain it)."""

    def verify_extra(self, view: dict[ServicePortName, ServicePort], wanted: object) -> list[str]:
        assert isinstance(wanted, dict)
        return [f"{k}: {sp.cluster_endpoints} not wanted" for k, sp in view.items() if wanted.get(k) != sp]


def test_a_service_changed_twice_during_the_read_is_not_damage() -> None:
    """A -> B before the read, B -> C after it: the view holds B, the ledger C, the first earlier version A. Only
    the layer of the second earlier version (B) explains the view; with the first alone, B's entry was foreign."""
    fake, sps, rb, repairs = loaded(3, ByElement(), eps=1)
    name = sps[1].name
    r = rb.begin(V4)
    assert r is not None
    b, c = sp("s1", 11, eps=2), sp("s1", 11, eps=3)
    assert fake.sync(state(sps[0], b, sps[2], generation=2), Changes(full=False, services=frozenset({name}))).ok
    rb.read(r)  # the kernel holds B
    assert fake.sync(state(sps[0], c, sps[2], generation=3), Changes(full=False, services=frozenset({name}))).ok
    touched = fake.ledger.records[V4].touched
    assert touched is not None and touched[name] == [sps[1], b]
    out = rb.finish(r)
    assert out.compared and out.differences == () and repairs.asked == [], out


def test_a_foreign_entry_stays_foreign_in_every_layer() -> None:
    fake, sps, rb, _ = loaded(3, ByElement(), eps=1)
    r = rb.begin(V4)
    assert r is not None
    b = sp("s1", 11, eps=2)
    assert fake.sync(state(sps[0], b, sps[2], generation=2), Changes(full=False, services=frozenset({b.name}))).ok
    with fake.lock:
        fake.programmed[(V4.value, sps[2].name)] = sp("s2", 12, eps=4)  # someone's edit of an untouched service
    rb.read(r)
    out = rb.finish(r)
    assert out.compared and len(out.differences) == 2, out  # s2 differs, and its entry explains nothing
