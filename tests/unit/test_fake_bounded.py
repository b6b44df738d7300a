"""The fake backend remembers what it was asked for a bounded number of syncs (``kproxy.fake.Recent``), with the
count of all of them, so a long-running fake does not grow with every sync and tests that count or slice still do."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kproxy.fake import KEPT, FakeProxier, Recent
from kproxy.model import Changes, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName


def test_recent_keeps_the_last_items_and_counts_them_all() -> None:
    r: Recent[int] = Recent(keep=3)
    for i in range(5):
        r.append(i)
    assert len(r) == 5 and list(r) == [2, 3, 4]
    assert r[4] == r[-1] == 4 and r[2] == r[-3] == 2
    with pytest.raises(IndexError):
        r[1]  # no longer kept
    with pytest.raises(IndexError):
        r[5]
    assert r[3:] == [3, 4] and r[0:] == [2, 3, 4] and r[:3] == [2]  # what is kept of the slice
    r.clear()
    assert len(r) == 0 and list(r) == [] and r[0:] == []
    r.append(7)
    assert r[0] == 7 and r[-1] == 7


def test_the_fake_keeps_a_bounded_record_of_its_syncs() -> None:
    fake = FakeProxier()
    spn = ServicePortName("ns", "web", "http", Protocol.TCP)
    n = KEPT + 50
    for i in range(n):
        sp = ServicePort(spn, IPFamily.V4, "198.19.0.1", 80 + i % 2)
        state = ProxyState({IPFamily.V4: MappingProxyType({spn: sp})}, NodeInfo("node-1"), generation=i)
        result = fake.sync(state, Changes(full=i == 0, services=frozenset({spn}), generation=i))
        assert result.ok
    assert len(fake.syncs) == n and len(fake.batches) == 2 * n  # every one counted (a batch per family)
    assert len(list(fake.syncs)) == KEPT and len(list(fake.batches)) == KEPT  # the last KEPT kept
    assert fake.syncs[-1].generation == n - 1 and fake.syncs[n - 1] is fake.syncs[-1]
    assert [c.generation for c in fake.syncs[n - 2 :]] == [n - 2, n - 1]
    with pytest.raises(IndexError):
        fake.syncs[0]
    assert fake.programmed[("IPv4", spn)].port == 80 + (n - 1) % 2
