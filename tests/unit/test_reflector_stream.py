"""The reflector streams a list into the sink page by page, against the API stand-in over HTTP through the official
client: the sink takes a page's objects before the next page is requested (one page of raw objects alive at a time),
a later page that fails leaves what the sink held undeleted, and a large list gives its freed memory back once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiException

from kproxy.cache import ServiceCache
from kproxy.lab.apiserver import ApiServer
from kproxy.sources import kube
from kproxy.sources.kube import Reflector
from kproxy.sources.recording import RecordingSink
from tests.unit.test_reflector_pages import lists, service_reflector, svc


@pytest.fixture
def running() -> Iterator[list[Reflector]]:
    out: list[Reflector] = []
    yield out
    for reflector in out:
        reflector.stop()


def fill(api: ApiServer, n: int) -> None:
    for i in range(n):
        api.store.create(svc(f"s{i:04d}"))


class RequestCountingSink(RecordingSink):
    """Notes, for every object a full list hands over, how many list requests the server had seen by then."""

    def __init__(self, api: ApiServer) -> None:
        super().__init__()
        self.api = api
        self.requests_at: list[int] = []

    def replace_services(self, objs: Iterable[Mapping[str, Any]]) -> None:
        def noted() -> Iterator[Mapping[str, Any]]:
            for obj in objs:
                self.requests_at.append(len(lists(self.api)))
                yield obj

        super().replace_services(noted())


def test_the_sink_takes_each_page_before_the_next_is_requested(
    reflector_api: ApiServer, reflector_client: kubernetes.client.ApiClient, running: list[Reflector]
) -> None:
    fill(reflector_api, 1234)
    sink = RequestCountingSink(reflector_api)
    reflector = service_reflector(reflector_client, sink, lambda _kw: None)
    running.append(reflector)
    reflector.start()
    assert reflector.synced.wait(90)  # an event, bounded: 1,234 objects through the official client on a busy machine
    at = sink.requests_at
    assert len(at) == 1234 and len(sink.services) == 1234 and sink.count("replace_services") == 1
    # pages of 500: objects 0..499 while only the first request was made, 500..999 the second, the rest the third
    # (gathering the whole list first makes every count 3)
    assert set(at[:500]) == {1} and set(at[500:1000]) == {2} and set(at[1000:]) == {3}
    assert reflector.stats.lists == 1 and reflector.stats.errors == 0


def test_a_later_page_that_fails_deletes_nothing_and_the_list_is_read_again(
    reflector_api: ApiServer, reflector_client: kubernetes.client.ApiClient, running: list[Reflector]
) -> None:
    """The pages before the failure were upserted (the server's objects), but what the sink held that they lack is
    kept until a complete list says it is gone; the list is not counted, the reflector backs off and lists again."""
    fill(reflector_api, 1234)
    cache = ServiceCache("node-1")
    old = svc("old")
    old["spec"]["clusterIP"] = "10.96.250.1"
    assert cache.upsert_service(old)
    calls: list[dict[str, Any]] = []
    held_at_retry: list[int] = []

    def second_page_fails_once(kw: dict[str, Any]) -> None:
        calls.append(kw)
        if kw.get("_continue") and sum(1 for c in calls if c.get("_continue")) == 1:
            raise ApiException(status=503, reason="Service Unavailable")
        if len(calls) == 3:  # the retry's first page: what the failed list left in the cache
            held_at_retry.append(cache.stats()["services"])

    reflector = service_reflector(reflector_client, RecordingSink(), second_page_fails_once)
    reflector._apply_list = cache.replace_services
    running.append(reflector)
    reflector.start()
    assert reflector.synced.wait(90)
    assert held_at_retry == [1 + 500]  # "old" kept beside the first page's 500
    assert cache.stats()["services"] == 1234  # the complete list then replaced everything: "old" is gone
    assert reflector.stats.lists == 1 and reflector.stats.errors == 1
    # the failed request never reached the server: page 1, then the whole list again (pages 1, 2, 3)
    assert [("continue" in q) for q in lists(reflector_api)] == [False, False, True, True]


def test_a_large_list_gives_memory_back_once_a_small_one_not(
    reflector_api: ApiServer,
    reflector_client: kubernetes.client.ApiClient,
    sink: RecordingSink,
    running: list[Reflector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[int] = []
    monkeypatch.setattr(kube, "trim_heap", lambda: trims.append(len(sink.services)) or True)
    fill(reflector_api, kube.TRIM_AFTER - 1)
    small = service_reflector(reflector_client, sink, lambda _kw: None)
    running.append(small)
    small.start()
    assert small.synced.wait(90)
    assert trims == []
    small.stop()
    for i in range(2):
        reflector_api.store.create(svc(f"t{i}"))
    large = service_reflector(reflector_client, sink, lambda _kw: None)
    running.append(large)
    large.start()
    assert large.synced.wait(90)
    assert trims == [kube.TRIM_AFTER + 1]  # once, after the list was applied
