"""The cache's shared garbage-collector pause (kproxy.cache._gc_paused): safe when threads overlap, and it leaves the
process's own collector settings (enabled or not, objects someone else froze) as they were."""

from __future__ import annotations

import gc
import threading
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
    kept = [{"n": i} for i in range(100)]
    _gc_paused.keep()  # not held: nothing happens
    assert gc.get_freeze_count() == 0
    with _gc_paused(True):
        made = [{"n": i} for i in range(100)]
        _gc_paused.keep()
        ids = {id(o) for o in gc.get_objects()}
        # the step's objects are out of every generation's walk (frozen), like the rest of the heap
        assert not any(id(o) in ids for o in made) and not any(id(o) in ids for o in kept)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
