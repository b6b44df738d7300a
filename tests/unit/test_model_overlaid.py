"""kproxy.model.Overlaid: a base and an overlay of changes read as the dict they stand for, and the cache publishes
them (a new base now and then)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kproxy.bench import synthetic
from kproxy.cache import ServiceCache
from kproxy.model import IPFamily, Overlaid


def test_an_overlaid_mapping_reads_as_the_dict_it_stands_for() -> None:
    base = {"a": 1, "b": 2, "c": 3}
    view = Overlaid(base, {"b": None, "d": 4, "a": 10}, 3)
    want = {"a": 10, "c": 3, "d": 4}
    assert view == want and dict(view.items()) == want and sorted(view.values()) == [3, 4, 10]
    assert "b" not in view and view.get("b") is None and "d" in view and view["a"] == 10 and len(view) == 3
    with pytest.raises(KeyError):
        view["b"]  # noqa: B018
    with pytest.raises(TypeError):
        view["e"] = 5  # type: ignore[index]
    assert base == {"a": 1, "b": 2, "c": 3}  # the base is read, never written


def test_the_cache_publishes_overlays_and_new_bases() -> None:
    cache = ServiceCache(node_name="node-1", ip_families=(IPFamily.V4,))
    kinds = set()
    for i in range(1, 200):
        cache.upsert_service(synthetic.service(i))
        state, changes = cache.snapshot()
        cache.commit(changes)
        kinds.add(type(state.family(IPFamily.V4)))
        assert len(state) == i
    assert kinds == {Overlaid, MappingProxyType}
