"""The cache's fast constructors (kproxy.endpointslices._new_endpoint, kproxy.serviceport.with_endpoints) build
exactly what the constructors build, and the shared collector pause leaves the collector's settings as they
were."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from kproxy.endpointslices import _new_endpoint
from kproxy.gcpause import collector_paused
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName, rare_fields
from kproxy.serviceport import with_endpoints
from kproxy.topology import Categorized


def test_fast_endpoint_equals_the_constructor() -> None:
    hints = frozenset({"zone-1"}), frozenset({"node-a"})
    raw = (1, "198.18.0.7", True, False, "node-a", True, rare_fields(True, "zone-1", *hints))
    fast = _new_endpoint(raw, 8080)
    slow = Endpoint("198.18.0.7", 8080, True, False, True, "node-a", "zone-1", True, *hints)
    assert type(fast) is Endpoint
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    values = [getattr(fast, name) for name in Endpoint.__match_args__]  # every field, in the constructor's order
    assert values == ["198.18.0.7", 8080, True, False, True, "node-a", "zone-1", True, *hints]


def test_with_endpoints_equals_replace() -> None:
    spn = ServicePortName("ns", "web", "http", Protocol.UDP)
    tmpl = ServicePort(
        spn,
        IPFamily.V4,
        "198.18.0.10",
        53,
        node_port=30053,
        external_ips=("198.18.1.1",),
        load_balancer_ips=("198.18.2.2",),
        load_balancer_source_ranges=("198.18.3.0/24",),
        affinity_timeout=30,
        external_policy_local=True,
        internal_policy_local=False,
        health_check_node_port=31000,
    )
    a = Endpoint("198.18.0.7", 5353, node_name="node-a", is_local=True)
    b = Endpoint("198.18.0.8", 5353, ready=False, serving=False, terminating=True)
    c = Endpoint("198.18.0.9", 5353, ready=False, serving=True, terminating=True)
    cat = Categorized(cluster=(a,), local=(a,), all_reachable=(a,), has_any=True)
    for eps in ((a, b, c), (a, c), ()):
        fast = with_endpoints(tmpl, cat, eps)
        slow = dataclasses.replace(
            tmpl,
            cluster_endpoints=cat.cluster,
            local_endpoints=cat.local,
            has_any_endpoints=cat.has_any,
            serving_endpoints=tuple(e for e in eps if e.serving),
        )
        assert type(fast) is ServicePort
        assert fast == slow and hash(fast) == hash(slow)
    assert with_endpoints(tmpl, cat, (a, c)).serving_endpoints == (a, c)


def test_pause_restores_thresholds_and_moves_its_objects_out_of_the_young_generation() -> None:
    before = gc.get_threshold()
    with collector_paused(True):
        assert gc.isenabled()
        assert gc.get_threshold()[0] == collector_paused.PAUSED_YOUNG
        made = [[i] for i in range(5000)]  # tracked objects allocated during the pause
        assert gc.get_count()[0] >= 4000  # no young collection ran over them (the count nets out frees)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0 and gc.isenabled()
    assert gc.get_count()[0] < 1000  # they went to the oldest generation unwalked, not left in the young one
    assert len(made) == 5000


def test_light_pause_defers_collections_and_freezes_nothing() -> None:
    before = gc.get_threshold()
    gc.collect()
    with collector_paused(True, light=True):
        assert gc.get_threshold()[0] == collector_paused.PAUSED_YOUNG and gc.get_freeze_count() == 0
        made = [[i] for i in range(3000)]
        with collector_paused(True):  # a bulk pause inside a light one (another thread's relist) freezes
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # until the last holder leaves
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0 and gc.isenabled()
    assert len(made) == 3000
    with collector_paused(True, light=True):
        young = [[i] for i in range(3000)]
        assert gc.get_count()[0] >= 2000  # no young collection inside; they stay young, collected afterwards
    assert len(young) == 3000 and gc.get_freeze_count() == 0


def test_light_pause_never_counts_frozen_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gc.get_freeze_count()`` walks every frozen object (16 ms with a frozen heap of 10,000 services: the nftables
    mode freezes around each sync); a light pause, taken by every partial sync, must not ask it."""
    calls: list[int] = []
    real = gc.get_freeze_count

    def counting() -> int:
        calls.append(1)
        return real()

    monkeypatch.setattr(gc, "get_freeze_count", counting)
    gc.freeze()
    try:
        with collector_paused(True, light=True):
            pass
        assert not calls
        with collector_paused(True):
            pass
        assert len(calls) == 1 and real() > 0  # someone else's freeze: asked once, left alone
    finally:
        gc.unfreeze()
