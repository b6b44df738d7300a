"""The reflector's paginated list against the API stand-in over HTTP, through the official client: pages of 500 as
client-go's pager, the watch from the list's resourceVersion, and the pager's fallback when a continue token expires
between pages (no root, 127.0.0.1 only)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiException

from kproxy.lab.apiserver import ApiServer
from kproxy.sources.kube import DEFAULT_PAGE_SIZE, KubeSource, Reflector
from kproxy.sources.recording import RecordingSink

SERVICES = "/api/v1/services"


def svc(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"ports": [{"port": 80}]},
    }


def service_reflector(
    client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    before_page: Callable[[dict[str, Any]], None],
    before_watch: Callable[[dict[str, Any]], None] = lambda _kw: None,
) -> Reflector:
    """A Services reflector whose every list request first calls `before_page` with its arguments (and every
    watch request `before_watch`, which may raise what the server would answer)."""
    core = kubernetes.client.CoreV1Api(client)

    def list_fn(**kw: Any) -> Any:
        (before_watch if kw.get("watch") else before_page)(kw)
        return core.list_service_for_all_namespaces(**kw)

    return Reflector(
        "services",
        list_fn,
        apply_list=sink.replace_services,
        upsert=sink.upsert_service,
        delete=lambda o: sink.delete_service(o["metadata"]["namespace"], o["metadata"]["name"]),
        synced=lambda: sink.mark_synced("services"),
        api_version="v1",
        object_kind="Service",
        backoff=(0.05, 0.4),
        watch_timeout=3,
    )


@pytest.fixture
def started() -> Iterator[list[Reflector]]:
    running: list[Reflector] = []
    yield running
    for reflector in running:
        reflector.stop()


def lists(api: ApiServer) -> list[dict[str, str]]:
    return [r.query for r in list(api.requests) if r.path == SERVICES and r.method == "GET" and not r.watch]


def test_the_first_list_comes_in_pages_of_500_and_the_watch_starts_at_its_version(
    reflector_api: ApiServer,
    reflector_client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    started: list[Reflector],
) -> None:
    store = reflector_api.store
    for i in range(1234):
        store.create(svc(f"s{i:04d}"))
    first_rv = str(store.resource_version)
    added: list[str] = []

    def between_pages(kw: dict[str, Any]) -> None:
        if kw.get("_continue") and not added:  # a change after the first page: not in this list, in the watch
            added.append(store.create(svc("late"))["metadata"]["name"])

    reflector = service_reflector(reflector_client, sink, between_pages)
    started.append(reflector)
    reflector.start()
    assert reflector.synced.wait(90)  # an event, bounded: 1,234 objects through the official client on a busy machine
    assert len(sink.services) == 1234 and ("default", "late") not in sink.services
    pages = lists(reflector_api)
    assert DEFAULT_PAGE_SIZE == 500 and [q.get("limit") for q in pages] == ["500"] * 3
    assert "continue" not in pages[0] and all(q.get("continue") for q in pages[1:])
    # As client-go's first list: resourceVersion=0 (the server may answer from its watch cache) on the first page,
    # the token alone on the others (upstream refuses a resourceVersion beside a token).
    assert pages[0]["resourceVersion"] == "0" and all("resourceVersion" not in q for q in pages[1:])
    assert reflector.stats.lists == 1
    # The watch starts from the list's resourceVersion, so the change made between pages arrives as an event.
    assert sink.wait_for(lambda s: ("default", "late") in s.services)
    watch = next(r for r in reflector_api.requests if r.watch and r.path == SERVICES)
    assert watch.query["resourceVersion"] == first_rv
    assert reflector.stats.events == 1 and reflector.stats.errors == 0


def test_an_expired_continue_token_falls_back_to_one_list_without_limit(
    reflector_api: ApiServer,
    reflector_client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    started: list[Reflector],
) -> None:
    store = reflector_api.store
    for i in range(1100):
        store.create(svc(f"s{i:04d}"))
    compacted: list[int] = []

    def compact_after_first_page(kw: dict[str, Any]) -> None:
        if kw.get("_continue") and not compacted:
            store.create(svc("late"))
            compacted.append(reflector_api.compact())  # the first page's version is gone, as after etcd compaction

    reflector = service_reflector(reflector_client, sink, compact_after_first_page)
    started.append(reflector)
    reflector.start()
    assert reflector.synced.wait(90)  # an event, bounded: 1,234 objects through the official client on a busy machine
    pages = lists(reflector_api)
    # page 1, page 2 (410 Expired), then the pager's fallback: one list without limit or continue
    assert [("limit" in q, "continue" in q) for q in pages] == [(True, False), (True, True), (False, False)]
    assert pages[2].get("resourceVersion") == "0"  # the fallback asks for what the first page asked for
    assert len(sink.services) == 1101 and ("default", "late") in sink.services
    stats = reflector.stats
    assert stats.expired_pages == 1 and stats.expired == 0 and stats.lists == 1 and stats.errors == 0
    assert stats.last_rv == str(compacted[0])


def test_kube_source_lists_every_kind_in_pages(
    reflector_api: ApiServer, reflector_client: kubernetes.client.ApiClient, sink: RecordingSink
) -> None:
    store = reflector_api.store
    for i in range(501):
        store.create(svc(f"s{i:04d}"))
    source = KubeSource(sink, reflector_client, "node-1", resync_backoff=(0.05, 0.4), watch_timeout=3)
    try:
        source.start()
        assert source.wait_synced(20)
    finally:
        source.stop()
    assert len(sink.services) == 501
    assert [q.get("limit") for q in lists(reflector_api)] == ["500", "500"]


def test_after_a_410_the_relist_is_a_consistent_read(
    reflector_api: ApiServer,
    reflector_client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    started: list[Reflector],
) -> None:
    store = reflector_api.store
    store.create(svc("a"))
    watches: list[str] = []

    def gone_once(kw: dict[str, Any]) -> None:
        watches.append(kw["resource_version"])
        if len(watches) == 1:  # the first watch is answered 410 Gone, as a server whose history moved on
            raise ApiException(status=410, reason="Gone")

    reflector = service_reflector(reflector_client, sink, lambda _kw: None, gone_once)
    started.append(reflector)
    reflector.start()
    assert sink.wait_for(lambda _s: reflector.stats.lists >= 2 and len(watches) >= 2)
    pages = lists(reflector_api)
    assert pages[0]["resourceVersion"] == "0" and "resourceVersion" not in pages[1]
    assert reflector.stats.expired == 1 and ("default", "a") in sink.services


def test_the_pages_read_so_far_are_out_of_the_collectors_walks_while_the_next_is_read(
    reflector_api: ApiServer,
    reflector_client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    started: list[Reflector],
) -> None:
    """What the sink keeps of each page (here the recording sink's copies, in the cache its records) must not be
    walked again by the collector for each new page (that multiplied a large list's parsing time): the list runs in
    the shared pause, which freezes what each page left once the sink took it, and the pause ends with the list."""
    store = reflector_api.store
    for i in range(1234):
        store.create(svc(f"s{i:04d}"))
    frozen: list[int] = []

    def before_page(_kw: dict[str, Any]) -> None:
        frozen.append(gc.get_freeze_count())

    reflector = service_reflector(reflector_client, sink, before_page)
    started.append(reflector)
    reflector.start()
    assert reflector.synced.wait(90)  # an event, bounded: 1,234 objects through the official client on a busy machine
    assert len(frozen) == 3 and len(sink.services) == 1234
    # before page 2, page 1's 500 objects (a few containers each) are frozen; before page 3, page 2's too
    assert frozen[1] >= frozen[0] + 500 and frozen[2] >= frozen[1] + 500
    assert gc.get_freeze_count() == 0  # the pause ended with the list
