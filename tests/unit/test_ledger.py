"""The ledger: deltas, adoption, the refusal rounds and the published snapshot, once for every backend.

Driven through ``FakeProxier`` (no kernel) and a small recording backend, so the retry rules every mode relies on are
tested here and not again in each backend.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from kproxy.backend import LedgerProxier
from kproxy.batch import Applied, Batch
from kproxy.config import ProxyConfig
from kproxy.fake import FakeProxier
from kproxy.ledger import MAX_ROUNDS
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext


def spn(name: str) -> ServicePortName:
    return ServicePortName("ns", name, "http", Protocol.TCP)


_VIPS: dict[str, int] = {}  # every service its own ClusterIP (two services with one would be an address conflict)


def sp(name: str, eps: int = 1, family: IPFamily = IPFamily.V4) -> ServicePort:
    n = _VIPS.setdefault(name, 10 + len(_VIPS))
    ip = f"198.19.0.{n}" if family is IPFamily.V4 else f"fd00:198:18:ff::{n:x}"
    prefix = "198.18.65." if family is IPFamily.V4 else "fd00:198:18:65::"
    endpoints = tuple(Endpoint(f"{prefix}{10 + i}", 8080) for i in range(eps))
    return ServicePort(spn(name), family, ip, 80, cluster_endpoints=endpoints, has_any_endpoints=eps > 0)


def state(*sps: ServicePort, generation: int = 1, node: NodeInfo | None = None) -> ProxyState:
    fams: dict[IPFamily, dict[ServicePortName, ServicePort]] = {IPFamily.V4: {}, IPFamily.V6: {}}
    for s in sps:
        fams[s.family][s.name] = s
    return ProxyState(
        {f: MappingProxyType(m) for f, m in fams.items()}, node or NodeInfo("node-1"), generation=generation
    )


def partial(*names: str) -> Changes:
    return Changes(full=False, services=frozenset(spn(n) for n in names))


def v4_batches(fake: FakeProxier) -> list[Batch[ServicePort, FamilyContext, None, None]]:
    return [b for b in fake.batches if b.family is IPFamily.V4]


def test_partial_batch_carries_only_the_dirty_services_with_old_and_new() -> None:
    fake = FakeProxier()
    a, b = sp("a", 1), sp("b", 2)
    assert fake.sync(state(a, b), Changes(full=True)).ok
    a2 = sp("a", 3)
    fake.batches.clear()
    assert fake.sync(state(a2, b), partial("a")).ok
    (batch,) = v4_batches(fake)
    assert not batch.full
    (delta,) = batch.deltas
    assert (delta.name, delta.old, delta.old_fragment, delta.new, delta.new_fragment) == (a.name, a, a, a2, a2)
    assert fake.programmed[("IPv4", a.name)] == a2 and fake.programmed[("IPv4", b.name)] == b
    # a removal is a delta with no new fragment
    fake.batches.clear()
    assert fake.sync(state(b), partial("a")).ok
    ((removal,),) = [bt.deltas for bt in v4_batches(fake)]
    assert removal.removed and removal.old == a2
    assert ("IPv4", a.name) not in fake.programmed


def test_a_restart_that_changes_nothing_writes_nothing() -> None:
    """A new instance adopts what the kernel holds (the fake's 'kernel' is its record): no delta at all."""
    a, b = sp("a", 1), sp("b", 2)
    first = FakeProxier()
    assert first.sync(state(a, b), Changes(full=True)).ok
    second = FakeProxier()
    second.programmed = dict(first.programmed)  # what the kernel holds after the restart
    assert second.sync(state(a, b), Changes(full=True)).ok
    (batch,) = v4_batches(second)
    assert batch.full and batch.deltas == () and dict(batch.wanted) == {a.name: a, b.name: b}
    assert second.describe()["services"]["ns/a:http/TCP"]["IPv4"]["applied"]
    # one changed service is the only write; one the kernel has but the state lacks is removed by the full batch
    third = FakeProxier()
    third.programmed = {**first.programmed, ("IPv4", spn("gone")): sp("gone")}
    a2 = sp("a", 2)
    assert third.sync(state(a2, b), Changes(full=True)).ok
    (batch,) = v4_batches(third)
    assert [d.name for d in batch.deltas] == [a.name]
    assert ("IPv4", spn("gone")) not in third.programmed


class _OrderedFake(FakeProxier):
    """Records the order of renders and comparisons with the adoption."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def render(self, sp: ServicePort, ctx: FamilyContext) -> ServicePort:
        self.calls.append("render")
        return super().render(sp, ctx)

    def adopted_unchanged(self, adopted: Any, name: ServicePortName, fragment: ServicePort) -> bool:
        self.calls.append("compare")
        return super().adopted_unchanged(adopted, name, fragment)


def test_a_full_batch_renders_every_service_before_it_compares_with_the_adoption() -> None:
    """A backend may read the kernel in the background (nftables' element dumps): the ledger renders every wanted
    service first, so the read overlaps the rendering, and compares afterwards; each service is rendered once."""
    names = [f"o{i}" for i in range(5)]
    first = FakeProxier()
    assert first.sync(state(*(sp(n) for n in names)), Changes(full=True)).ok
    again = _OrderedFake()
    again.programmed = dict(first.programmed)
    assert again.sync(state(*(sp(n) for n in names)), Changes(full=True)).ok
    assert again.calls == ["render"] * 5 + ["compare"] * 5
    (batch,) = v4_batches(again)
    assert batch.deltas == ()


def test_a_refused_update_keeps_the_old_version_and_a_refused_new_service_is_left_out() -> None:
    fake = FakeProxier()
    a, b = sp("a", 1), sp("b", 1)
    assert fake.sync(state(a, b), Changes(full=True)).ok
    fake.reject[a.name] = "line 7: no such match"
    fake.reject[spn("c")] = "line 9: bad"
    a2, c = sp("a", 2), sp("c", 1)
    res = fake.sync(state(a2, b, c), partial("a", "c"))
    assert res.ok and dict(res.failed) == {a.name: "line 7: no such match", c.name: "line 9: bad"}
    assert fake.programmed[("IPv4", a.name)] == a  # the old version stays
    assert ("IPv4", c.name) not in fake.programmed  # nothing before: left out
    # one refusal per apply, as a restore stops at its first bad line: three rounds here
    assert len(v4_batches(fake)) == 1 + 3
    desc = fake.describe()["services"]
    assert desc["ns/a:http/TCP"]["IPv4"]["failed"] and desc["ns/a:http/TCP"]["IPv4"]["applied"]
    assert desc["ns/a:http/TCP"]["IPv4"]["internalEndpoints"] == ["198.18.65.10:8080"]  # what runs: the old one
    assert desc["ns/c:http/TCP"]["IPv4"]["failed"] and not desc["ns/c:http/TCP"]["IPv4"]["applied"]
    # fixed: the update lands and the failure is forgotten
    fake.reject.clear()
    res = fake.sync(state(a2, b, c), partial("a", "c"))
    assert res.ok and not res.failed
    assert fake.programmed[("IPv4", a.name)] == a2 and fake.programmed[("IPv4", c.name)] == c
    assert not fake.describe()["services"]["ns/a:http/TCP"]["IPv4"]["failed"]


class Refusing(LedgerProxier[ServicePort, FamilyContext, None, None, None]):
    """A backend whose 'kernel' refuses what ``refuse`` says, however often; or raises."""

    mode = "refusing"

    def __init__(self) -> None:
        super().__init__(ProxyConfig(ip_families=(IPFamily.V4, IPFamily.V6)))
        self.refuse: dict[IPFamily, set[ServicePortName]] = {IPFamily.V4: set(), IPFamily.V6: set()}
        self.raise_in: set[IPFamily] = set()
        self.applied: list[Batch[ServicePort, FamilyContext, None, None]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()  # set when an apply has begun (and waits on ``gate``, if any)

    def context(self, node: FamilyContext, state: ProxyState) -> FamilyContext:
        return node.without_addresses()

    def render(self, sp: ServicePort, ctx: FamilyContext) -> ServicePort:
        return sp

    def apply(self, batch: Batch[ServicePort, FamilyContext, None, None]) -> Applied:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.applied.append(batch)
        if batch.family in self.raise_in:
            raise RuntimeError("backend bug")
        for d in batch.deltas:
            if d.name in self.refuse[batch.family] and d.new_fragment is not None:
                return Applied(ok=False, refused=MappingProxyType({d.name: "refused"}), error="refused")
        return Applied()


def test_a_service_refused_every_round_fails_the_family_and_the_other_family_syncs() -> None:
    r = Refusing()
    a4, a6 = sp("a", 1), sp("a", 1, IPFamily.V6)
    assert r.sync(state(a4, a6), Changes(full=True)).ok
    # IPv6 keeps refusing both the new and the old version of a: kept, then left out, then the round fails
    r.refuse[IPFamily.V6] = {a6.name}
    res = r.sync(state(sp("a", 2), sp("a", 2, IPFamily.V6)), partial("a"))
    assert res.ok and res.failed == {a6.name: "refused"}  # kept its old version, then left out: the family goes on
    records = r.ledger.records
    assert a6.name not in records[IPFamily.V6].fragments and records[IPFamily.V4].fragments[a4.name] == sp("a", 2)
    r.raise_in = {IPFamily.V6}
    res = r.sync(state(sp("a", 3), sp("a", 3, IPFamily.V6)), partial("a"))
    assert not res.ok and res.failed_families == {IPFamily.V6} and "backend bug" in (res.error or "")
    assert records[IPFamily.V4].fragments[a4.name] == sp("a", 3)  # IPv4 was programmed all the same
    assert records[IPFamily.V6].need_full and records[IPFamily.V6].context is None
    r.raise_in, r.refuse[IPFamily.V6] = set(), set()
    r.applied.clear()
    res = r.sync(state(sp("a", 3), sp("a", 3, IPFamily.V6)), partial("a"))
    assert [b.full for b in r.applied if b.family is IPFamily.V6] == [True]  # the failed family resyncs in full
    assert [b.full for b in r.applied if b.family is IPFamily.V4] == [False]


def test_rounds_are_bounded() -> None:
    class Endless(Refusing):
        def apply(self, batch: Batch[ServicePort, FamilyContext, None, None]) -> Applied:
            self.applied.append(batch)
            fresh = [d.name for d in batch.deltas if d.new_fragment is not None]
            if fresh:
                return Applied(ok=False, refused=MappingProxyType({fresh[0]: "refused"}), error="refused")
            return Applied()

    r = Endless()
    names = [f"s{i}" for i in range(MAX_ROUNDS + 2)]
    res = r.sync(state(*(sp(n) for n in names)), Changes(full=True))
    assert not res.ok and "rounds" in (res.error or "")
    assert len([b for b in r.applied if b.family is IPFamily.V4]) == MAX_ROUNDS


def test_a_changed_node_context_makes_a_full_batch() -> None:
    fake = FakeProxier(ProxyConfig(cluster_cidrs=("198.18.0.0/16",)))
    a = sp("a")
    assert fake.sync(state(a), Changes(full=True)).ok
    fake.batches.clear()
    assert fake.sync(state(a, node=NodeInfo("node-1", addresses=("198.18.0.11",))), partial()).ok
    assert [b.full for b in v4_batches(fake)] == [True]  # the Node's addresses feed the context
    fake.batches.clear()
    assert fake.sync(state(a, node=NodeInfo("node-1", addresses=("198.18.0.11",))), partial()).ok
    assert [b.full for b in v4_batches(fake)] == [False]


def test_describe_never_waits_for_a_sync() -> None:
    """describe() answers while a sync is held inside apply (waited for, not slept on), and only the gate, opened
    after describe has answered, lets that sync finish: a describe that waited for it would never answer in time."""
    r = Refusing()
    a = sp("a", 1)
    assert r.sync(state(a), Changes(full=True)).ok
    r.gate = threading.Event()
    r.entered.clear()
    worker = threading.Thread(target=r.sync, args=(state(sp("a", 2)), partial("a")))
    worker.start()
    answered = threading.Event()
    got: list[Mapping[str, Any]] = []

    def ask() -> None:
        got.append(r.describe())
        answered.set()

    asker = threading.Thread(target=ask)
    try:
        assert r.entered.wait(10), "the sync never reached apply"
        asker.start()
        assert answered.wait(10), "describe() waited for the sync held in apply"
        assert worker.is_alive() and not r.gate.is_set()  # the sync was still inside apply when describe answered
        assert got[0]["services"]["ns/a:http/TCP"]["IPv4"]["internalEndpoints"] == ["198.18.65.10:8080"]
    finally:
        r.gate.set()
        worker.join(10)
        if asker.ident is not None:
            asker.join(10)
    assert r.describe()["services"]["ns/a:http/TCP"]["IPv4"]["internalEndpoints"] == [
        "198.18.65.10:8080",
        "198.18.65.11:8080",
    ]


@pytest.mark.parametrize("fail", [1, 2])
def test_whole_failures_keep_the_ledger_and_the_next_sync_is_full(fail: int) -> None:
    fake = FakeProxier()
    a = sp("a")
    assert fake.sync(state(a), Changes(full=True)).ok
    fake.fail_next = fail
    for _ in range(fail):
        assert not fake.sync(state(sp("a", 2)), partial("a")).ok
    assert fake.programmed[("IPv4", a.name)] == a
    assert fake.sync(state(sp("a", 2)), Changes(full=True)).ok
    assert fake.programmed[("IPv4", a.name)] == sp("a", 2)


def test_verify_reads_the_kernel_back_not_the_ledger() -> None:
    """The fake's "kernel" is its ``programmed`` record: what someone else changed there is drift, the ledger's own
    memory notwithstanding; a service the kernel refused is reported apart, not as drift."""
    fake = FakeProxier()
    a, b = sp("a", 1), sp("b", 2)
    st = state(a, b)
    assert fake.sync(st, Changes(full=True)).ok
    assert fake.verify(st)["drift"] == 0
    del fake.programmed[("IPv4", a.name)]  # someone deleted it
    fake.programmed[("IPv4", b.name)] = sp("b", 1)  # someone changed it
    fake.programmed[("IPv4", spn("ghost"))] = sp("ghost")  # someone added one
    report = fake.verify(st)
    assert report["services"] == {"ns/a:http/TCP": {"IPv4": "missing"}, "ns/b:http/TCP": {"IPv4": "different"}}
    assert report["extra"] == ["IPv4: ns/ghost:http: not wanted"] and report["drift"] == 3
    assert fake.sync(st, Changes(full=True)).ok  # the full sync adopts the kernel as it is and repairs it
    assert fake.verify(st)["drift"] == 0
    fake.reject[a.name] = "no"
    st2 = state(sp("a", 3), b)
    assert fake.sync(st2, partial("a")).failed
    report = fake.verify(st2)
    assert report["drift"] == 0 and "refused: no" in report["refused"]["ns/a:http/TCP"]["IPv4"]


def test_the_fault_switch_fails_applies_and_counts_down(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """kproxy soak's "failed kernel apply": N owed failures, each a failed family (a full sync follows), then none."""
    from kproxy.ledger import FAULT_SWITCH

    monkeypatch.setenv(FAULT_SWITCH, str(tmp_path))  # read once, when the ledger is made (as a daemon starts)
    fake = FakeProxier(ProxyConfig(hostname_override="node-9", ip_families=(IPFamily.V4,)))
    a = sp("a")
    assert fake.sync(state(a), Changes(full=True)).ok
    (tmp_path / "node-9").mkdir()
    switch = tmp_path / "node-9" / "fail-apply"
    switch.write_text("1\n")
    res = fake.sync(state(sp("a", 2)), partial("a"))
    assert not res.ok and "injected" in (res.error or "") and switch.read_text().strip() == "0"
    assert fake.programmed[("IPv4", a.name)] == a  # nothing applied
    res = fake.sync(state(sp("a", 2)), partial("a"))
    assert res.ok and res.full and fake.programmed[("IPv4", a.name)] == sp("a", 2)


def test_a_check_that_finds_the_state_gone_after_a_failed_sync_asks_for_a_run_now() -> None:
    """Someone else flushes the table while a partial sync writes into it: that sync fails (a full batch is owed,
    its retry a retry interval away), and the drift check that follows must still say the state is gone, so the
    repair runs now; while the state is there, a failed sync is left to its retry."""

    class Checked(Refusing):
        gone = False

        def needs_full(self, family: IPFamily) -> bool:
            return self.gone

    r = Checked()
    a = sp("a")
    assert not r.check_now(IPFamily.V4)  # nothing applied yet
    assert r.sync(state(a), Changes(full=True)).ok
    assert not r.check_now(IPFamily.V4)  # there, and nothing owed
    r.raise_in.add(IPFamily.V4)  # the partial sync under the flush fails
    assert not r.sync(state(sp("a", 2)), partial("a")).ok
    r.raise_in.clear()
    assert not r.check_now(IPFamily.V4)  # failed, but the state is there: the retry interval stands
    r.gone = True
    assert r.check_now(IPFamily.V4)  # failed, and the state is gone: a run now
    done = r.sync(state(sp("a", 2)), partial("a"))
    assert done.ok and done.full  # the full batch that was owed


def test_a_bulk_sync_gives_the_heap_it_freed_back_to_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sync renders every service and frees most of that by its end: the ledger trims the C heap after it
    (``gcpause.trim_heap``; at 100,000 x 10, nftables 551 -> 449 MB in 12 ms), and after a partial one that is as
    big; a small partial sync does not pay the walk."""
    from kproxy import ledger

    calls: list[bool] = []
    monkeypatch.setattr(ledger, "trim_heap", lambda: calls.append(True) or True)
    fake = FakeProxier()
    many = [sp(f"t{i}") for i in range(ledger._BULK_SERVICES + 1)]
    result = fake.sync(state(*many), Changes(full=True))
    assert result.ok and calls == [True] and result.timings["trim"] >= 0
    result = fake.sync(state(*many, generation=2), partial("t1"))
    assert result.ok and calls == [True] and "trim" not in result.timings
    bulk = Changes(full=False, services=frozenset(s.name for s in many))
    assert fake.sync(state(*many, generation=3), bulk).ok and calls == [True, True]
