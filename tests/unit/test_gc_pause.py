"""The cache's shared garbage-collector pause (kproxy.cache._gc_paused): safe when threads overlap, and it leaves the
process's own collector settings (enabled or not, objects someone else froze) as they were."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kproxy.cache import ServiceCache, _gc_paused
from kproxy.model import IPFamily

from .cache_objects import endpoint, endpoint_slice, service


def test_overlapping_pauses_end_with_the_last_holder() -> None:
    assert gc.get_freeze_count() == 0
    entered, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def holder() -> None:
        with _gc_paused(True):
            entered.set()
            release.wait(30)
            seen.append(gc.get_freeze_count())

    other = threading.Thread(target=holder)
    with _gc_paused(True):
        frozen = gc.get_freeze_count()
        other.start()
        assert entered.wait(30)
    # This thread's pause is over, the other thread's is not: its objects stay out of the collector's walks.
    assert frozen > 0 and gc.get_freeze_count() > 0
    assert gc.isenabled()
    release.set()
    other.join(30)
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_inactive_pause_changes_nothing() -> None:
    with _gc_paused(False):
        assert gc.get_freeze_count() == 0


def test_someone_elses_freeze_and_disable_are_left_alone() -> None:
    sentinel: list[object] = [object()]  # a tracked container, frozen with the rest
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        with _gc_paused(True):
            pass
        # not unfrozen by us: the sentinel is still outside the collector's generations (the frozen count itself is
        # no witness: frozen objects that other threads of a long test run free meanwhile lower it)
        assert gc.get_freeze_count() > 0
        assert not any(o is sentinel for o in gc.get_objects())
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with _gc_paused(True):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_concurrent_relists_and_snapshots_leave_the_collector_as_it_was() -> None:
    cache = ServiceCache("node-1", ip_families=(IPFamily.V4,))
    n = 600  # above the snapshot's pause threshold
    services = [service(f"s{i}", cluster_ip=f"198.18.{i // 256}.{i % 256}") for i in range(n)]
    slices = [
        endpoint_slice(f"s{i}-a", service_name=f"s{i}", endpoints=[endpoint(f"198.19.{i // 256}.{i % 256}")])
        for i in range(n)
    ]
    errors: list[BaseException] = []

    def run(fn: Callable[[Any], object], arg: Any) -> None:
        try:
            for _ in range(3):
                fn(arg)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(cache.replace_services, services)),
        threading.Thread(target=run, args=(cache.replace_slices, slices)),
        threading.Thread(target=run, args=(lambda full: cache.snapshot(full), True)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    state, _ = cache.snapshot()
    assert len(state) == n and all(sp.has_any_endpoints for sp in state)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_keep_freezes_what_the_pause_allocated_so_far_and_nothing_outside_a_pause() -> None:
    kept = [[i] for i in range(100)]  # lists: always tracked by the collector
    _gc_paused.keep()  # not held: nothing happens
    assert gc.get_freeze_count() == 0
    with _gc_paused(True):
        made = [[i] for i in range(100)]
        _gc_paused.keep()
        ids = {id(o) for o in gc.get_objects()}
        # the step's objects are out of every generation's walk (frozen), like the rest of the heap
        assert not any(id(o) in ids for o in made) and not any(id(o) in ids for o in kept)
    assert gc.get_freeze_count() == 0 and gc.isenabled()


class _Cyclic:
    other: Any = None


def test_settle_collects_cycles_then_freezes_for_good_and_later_pauses_freeze_nothing() -> None:
    live = [[i] for i in range(50)]  # lists: always tracked by the collector
    a, b = _Cyclic(), _Cyclic()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    try:
        assert _gc_paused.settle()
        assert gone() is None  # the garbage cycle was collected before the freeze
        ids = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in ids for o in live)  # out of every walk, for good
        with _gc_paused(True):
            made = [[i] for i in range(50)]
        ids = {id(o) for o in gc.get_objects()}
        # the pause froze nothing (what it made is walked until the next settle collects it first) and gave the
        # settled heap back to nobody
        assert all(id(o) in ids for o in made) and not any(id(o) in ids for o in live)
        assert _gc_paused.settle() and not any(id(o) in {id(x) for x in gc.get_objects()} for o in made)
    finally:
        _gc_paused.unsettle()
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_settle_leaves_someone_elses_freeze_alone_and_never_runs_inside_a_pause() -> None:
    with _gc_paused(True):
        assert not _gc_paused.settle()
    gc.freeze()
    try:
        assert not _gc_paused.settle()
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_a_churn_leaves_no_cyclic_garbage_in_the_settled_heap() -> None:
    """What settle costs: a frozen object that becomes part of a garbage cycle is never freed. The cache's objects
    are acyclic: a churn of slice changes, snapshots and commits over a settled cache leaves no cycle of kproxy
    objects behind (the settled heap given back and collected with every garbage object kept for inspection)."""
    cache = ServiceCache("node-1", ip_families=(IPFamily.V4,))
    n = 300
    cache.replace_services([service(f"s{i}", cluster_ip=f"198.18.{i // 256}.{i % 256}") for i in range(n)])

    def slice_of(i: int, k: int) -> dict[str, Any]:
        ip = f"198.19.{(i + k) // 256 % 256}.{(i + k) % 256}"
        return endpoint_slice(f"s{i}-a", service_name=f"s{i}", endpoints=[endpoint(ip)])

    cache.replace_slices([slice_of(i, 0) for i in range(n)])
    state, changes = cache.snapshot(full=True)
    cache.commit(changes)
    flags = gc.get_debug()
    try:
        assert _gc_paused.settle()
        for k in range(1, 4):
            for i in range(n):
                cache.upsert_slice(slice_of(i, k))
                if i % 50 == 49:
                    state, changes = cache.snapshot()
                    cache.commit(changes)
            assert _gc_paused.settle()
        assert len(cache.snapshot()[0]) == n
        _gc_paused.unsettle()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith("kproxy")]
        assert ours == []
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        _gc_paused.unsettle()
    assert gc.get_freeze_count() == 0
