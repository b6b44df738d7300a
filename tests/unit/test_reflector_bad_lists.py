"""Malformed list answers (a broken proxy in front of the API server) never reach the sink: the reflector backs off
and lists again. Through the API stand-in's `bad_list` fault, over loopback, with the official client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from kproxy.lab.apiserver import ApiServer
from kproxy.lab.apistore import BAD_LIST_SHAPES
from kproxy.sources.kube import KubeSource
from kproxy.sources.recording import RecordingSink

NODE = "node-1"
BASE_BACKOFF = 0.05


def svc(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": {}}


@pytest.fixture
def api(reflector_api: ApiServer) -> ApiServer:
    return reflector_api


@pytest.fixture
def client(reflector_client: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    return reflector_client


@pytest.fixture
def source(sink: RecordingSink, client: kubernetes.client.ApiClient) -> Iterator[KubeSource]:
    src = KubeSource(sink, client, NODE, resync_backoff=(BASE_BACKOFF, 0.4), watch_timeout=3, page_size=2)
    try:
        yield src
    finally:
        src.stop()


def service_lists(api: ApiServer) -> list[Any]:
    return [r for r in list(api.requests) if r.path == "/api/v1/services" and r.method == "GET" and not r.watch]


def names(sink: RecordingSink) -> set[str]:
    return {name for _ns, name in sink.services}


@pytest.mark.parametrize("shape", BAD_LIST_SHAPES)
def test_a_malformed_relist_keeps_every_service(
    api: ApiServer, sink: RecordingSink, source: KubeSource, shape: str
) -> None:
    for name in ("a", "b", "c"):
        api.store.create(svc(name))
    source.start()
    assert source.wait_synced(5)
    assert names(sink) == {"a", "b", "c"} and sink.count("replace_services") == 1
    first = len(service_lists(api))  # the first list's pages (page_size=2: two requests for three services)

    # The watches go down while the history moves on and is compacted, so that they come back to a 410 and relist;
    # from then on every list is answered 200 with a malformed body.
    services = source.reflectors["services"]
    api.faults.update(error_rate=1.0, error_code=503)
    api.drop_watches()
    assert sink.wait_for(lambda s: services.stats.errors >= 1, timeout=5)
    api.store.create(svc("tmp"))
    api.store.delete("services", "default", "tmp")
    api.compact()
    api.faults.update(bad_list=shape, error_rate=0.0)  # in this order: no good list in between
    # A fourth bad answer asked for: the reflector has handled the first three (it lists again only after that).
    assert sink.wait_for(lambda s: len(service_lists(api)) >= first + 4, timeout=10)
    assert names(sink) == {"a", "b", "c"}
    assert sink.count("replace_services") == 1  # nothing of a bad answer was applied
    assert services.stats.lists == 1 and services.stats.bad_lists >= 3
    # Treated as a failed list: the reflector backed off between tries (its delay is at least 0.75 x the base).
    bad = [r.time for r in service_lists(api)[first:]]
    assert all(b - a >= 0.75 * BASE_BACKOFF - 0.005 for a, b in zip(bad, bad[1:], strict=False)), bad

    api.faults.reset()  # the proxy is fixed: the next relist is believed
    api.store.delete("services", "default", "c")
    assert sink.wait_for(lambda s: names(s) == {"a", "b"}, timeout=10)
    assert sink.count("replace_services") == 2 and services.stats.lists == 2


def test_a_malformed_first_list_is_not_synced(api: ApiServer, sink: RecordingSink, source: KubeSource) -> None:
    """`200 {}` for the first lists: nothing reaches the sink, and services are not marked synced, until a real
    list arrives (marking them synced on an empty list would let the first sync delete every rule)."""
    for name in ("a", "b"):
        api.store.create(svc(name))
    api.faults.update(bad_list="empty", bad_list_next=4)  # the first 4 lists of any kind
    source.start()
    assert source.wait_synced(10)
    assert names(sink) == {"a", "b"}
    first_replace = next(arg for call, arg in sink.calls if call == "replace_services")
    assert first_replace == 2
    marked = [i for i, (call, arg) in enumerate(sink.calls) if call == "mark_synced" and arg == "services"]
    replaced = [i for i, (call, _arg) in enumerate(sink.calls) if call == "replace_services"]
    assert len(marked) == 1 and replaced[0] < marked[0]
    assert sum(r.stats.bad_lists for r in source.reflectors.values()) == 4
    assert sum(r.stats.lists for r in source.reflectors.values()) == 3


def test_the_fault_switch_over_http(api: ApiServer) -> None:
    import json
    import urllib.error
    import urllib.request

    def post(body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            f"{api.url}/_faults", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.load(resp)

    assert post({"bad_list": "wrong_kind", "bad_list_next": 1})["bad_list"] == "wrong_kind"
    with urllib.request.urlopen(f"{api.url}/api/v1/services", timeout=5) as resp:
        assert json.load(resp)["kind"] == "EventList"
    with urllib.request.urlopen(f"{api.url}/api/v1/services", timeout=5) as resp:
        assert json.load(resp)["kind"] == "ServiceList"  # only the next one was bad
    with pytest.raises(urllib.error.HTTPError) as err:
        post({"bad_list": "nonsense"})
    assert err.value.code == 400
    err.value.close()
