"""A partial snapshot costs what changed, not the table: the published mappings are a base plus an overlay
(kproxy.model.Overlaid, tests/unit/test_model_overlaid.py), every snapshot stays as it was whatever came after, and
a full sync's commit leaves no table-sized record behind."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, Protocol, ServicePort, ServicePortName

NODE = "node-1"
V4 = IPFamily.V4


def _cache(n: int) -> ServiceCache:
    cache = ServiceCache(node_name=NODE, ip_families=(V4,))
    for i in range(1, n + 1):
        assert cache.upsert_service(synthetic.service(i))
    for i in range(1, n + 1):
        assert cache.upsert_slice(synthetic.endpoint_slice(i, 2))
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    return cache


def test_a_partial_snapshot_allocates_what_changed_not_the_table() -> None:
    n = 4000
    cache = _cache(n)
    state, changes = cache.snapshot()
    cache.commit(changes)
    table = sys.getsizeof(dict(state.family(V4)))  # what one copy of the family's mapping costs
    peaks = []
    for r in range(20):
        cache.upsert_slice(synthetic.endpoint_slice(1 + r * 97, 2, variant=r + 1))
        tracemalloc.start()
        try:
            state, changes = cache.snapshot()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert len(changes.services) == 1 and len(state) == n
        cache.commit(changes)
    assert max(peaks) < table / 4, (peaks, table)


def test_a_full_commit_leaves_no_table_sized_dirty_record() -> None:
    cache = _cache(3000)
    _, changes = cache.snapshot()
    cache.commit(changes)
    # a dict keeps its capacity when emptied by deletions: walking it would cost the whole table every snapshot
    assert sys.getsizeof(cache._dirty) <= sys.getsizeof({})


def test_every_snapshot_stays_as_it_was_across_new_bases() -> None:
    """Hundreds of partial snapshots (several new bases on the way), each checked against a plain copy taken when it
    was made: lookups, membership, length, iteration and equality."""
    n = 300
    cache = _cache(n)
    rng = random.Random(22)
    kept: list[tuple[object, dict[ServicePortName, ServicePort]]] = []
    present = set(range(1, n + 1))
    for r in range(400):
        i = rng.randint(1, n + 40)  # some beyond n: services that come and go
        if i in present and rng.random() < 0.3:
            cache.delete_service("bench", synthetic.service_name(i))
            present.discard(i)
        else:
            cache.upsert_service(synthetic.service(i))
            cache.upsert_slice(synthetic.endpoint_slice(i, 2, variant=r))
            present.add(i)
        state, changes = cache.snapshot()
        cache.commit(changes)
        view = state.family(V4)
        assert len(view) == len(present)
        kept.append((view, {spn: sp for spn, sp in view.items()}))
    gone = ServicePortName("bench", "svc-99999", "http", Protocol.TCP)
    for view, copy in kept:
        assert view == copy and dict(view) == copy and len(view) == len(copy)
        assert set(view.keys()) == set(copy) and set(view) == set(copy)
        for spn, sp in copy.items():
            assert view[spn] is sp and view.get(spn) is sp and spn in view
        assert gone not in view and view.get(gone, "none") == "none"
        with pytest.raises(KeyError):
            view[gone]  # noqa: B018
