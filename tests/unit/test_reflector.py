"""KubeSource's reflectors against the API stand-in, through the official client (no root, 127.0.0.1 only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from kproxy.lab.apiserver import ApiServer, serve
from kproxy.sources.events import EventRecorder
from kproxy.sources.kube import KubeSource, Reflector, make_api_client
from kproxy.sources.recording import RecordingSink

NODE = "node-1"


def svc(name: str, labels: dict[str, str] | None = None, ns: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"ports": [{"port": 80}]},
    }


def eps(name: str, service: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service, **(labels or {})},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["198.18.2.1"], "conditions": {"ready": True}}],
        "ports": [{"port": 8080}],
    }


def node(name: str, zone: str = "z1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"zone": zone}}}


@pytest.fixture
def api(reflector_api: ApiServer) -> ApiServer:
    return reflector_api


@pytest.fixture
def client(reflector_client: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    return reflector_client


@pytest.fixture
def source(sink: RecordingSink, client: kubernetes.client.ApiClient) -> Iterator[KubeSource]:
    src = KubeSource(sink, client, NODE, resync_backoff=(0.05, 0.4), watch_timeout=3, page_size=2)
    try:
        yield src
    finally:
        src.stop()


def names(objs: dict[tuple[str, str], Any]) -> set[str]:
    return {name for _ns, name in objs}


def list_requests(api: ApiServer, path: str) -> list[Any]:
    return [r for r in api.requests if r.path == path and r.method == "GET" and not r.watch]


def test_initial_list_reaches_the_sink_and_marks_synced(
    api: ApiServer, sink: RecordingSink, source: KubeSource
) -> None:
    store = api.store
    for i in range(5):  # more than one page (page_size=2)
        store.create(svc(f"s{i}"))
        store.create(eps(f"s{i}-a", f"s{i}"))
    store.create(svc("other-proxy", {"service.kubernetes.io/service-proxy-name": "someone-else"}))
    store.create(svc("headless", {"service.kubernetes.io/headless": ""}))
    store.create(eps("headless-a", "headless", {"service.kubernetes.io/headless": ""}))
    store.create(node(NODE))
    store.create(node("node-2"))

    source.start()
    assert source.wait_synced(5)
    assert sink.synced == {"services", "endpointslices", "nodes"} and source.synced
    assert names(sink.services) == {f"s{i}" for i in range(5)}
    assert names(sink.slices) == {f"s{i}-a" for i in range(5)}
    assert sink.node is not None and sink.node["metadata"]["name"] == NODE
    # List items get the same shape as watched objects.
    assert sink.services[("default", "s0")]["kind"] == "Service"
    assert sink.slices[("default", "s0-a")]["apiVersion"] == "discovery.k8s.io/v1"
    # Paginated: 3 pages of services, all from one snapshot.
    assert len(list_requests(api, "/api/v1/services")) == 3
    stats = source.stats()
    assert stats["services"]["lists"] == 1 and stats["services"]["errors"] == 0
    # Upstream's selector went to the server.
    assert sink.wait_for(lambda s: sum(1 for r in list(api.requests) if r.watch) >= 3)
    watch = next(r for r in api.requests if r.watch and r.path == "/api/v1/services")
    assert watch.query["labelSelector"] == "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    assert watch.query["allowWatchBookmarks"] == "true"
    node_watch = next(r for r in api.requests if r.watch and r.path == "/api/v1/nodes")
    assert node_watch.query["fieldSelector"] == f"metadata.name={NODE}"


def test_watch_delivers_add_modify_delete(api: ApiServer, sink: RecordingSink, source: KubeSource) -> None:
    store = api.store
    source.start()
    assert source.wait_synced(5)
    assert sink.node is None

    store.create(svc("a"))
    store.create(eps("a-1", "a"))
    store.create(node(NODE))
    store.create(node("node-2"))  # not ours: never reaches the sink
    assert sink.wait_for(
        lambda s: ("default", "a") in s.services and ("default", "a-1") in s.slices and s.node is not None
    )
    store.patch("services", "default", "a", {"metadata": {"annotations": {"v": "2"}}})
    store.patch("nodes", None, NODE, {"metadata": {"labels": {"zone": "z9"}}})
    assert sink.wait_for(
        lambda s: (
            s.services[("default", "a")]["metadata"].get("annotations") == {"v": "2"}
            and s.node is not None
            and s.node["metadata"]["labels"]["zone"] == "z9"
        )
    )
    store.delete("endpointslices", "default", "a-1")
    store.delete("services", "default", "a")
    store.delete("nodes", None, NODE)
    assert sink.wait_for(lambda s: not s.services and not s.slices and s.node is None)
    assert all(arg != "node-2" for call, arg in sink.calls if call == "set_node")

    # A label added later takes the service out of our view: the server sends DELETED.
    store.create(svc("b"))
    assert sink.wait_for(lambda s: ("default", "b") in s.services)
    store.patch("services", "default", "b", {"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": "x"}}})
    assert sink.wait_for(lambda s: ("default", "b") not in s.services)
    store.patch(
        "services", "default", "b", {"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": None}}}
    )
    assert sink.wait_for(lambda s: ("default", "b") in s.services)
    assert source.stats()["services"]["lists"] == 1
    # Bookmarks keep the resourceVersion moving while other kinds change.
    assert sink.wait_for(lambda s: source.stats()["nodes"]["bookmarks"] > 0, timeout=2)


def test_dropped_watch_resumes_from_last_resource_version_without_relist(
    api: ApiServer, sink: RecordingSink, source: KubeSource
) -> None:
    store = api.store
    store.create(svc("base"))
    source.start()
    assert source.wait_synced(5)
    api.faults.update(watch_drop_after_events=1)  # every watch breaks after one event
    api.drop_watches()
    for i in range(6):
        store.create(svc(f"x{i}"))
        time.sleep(0.02)
    store.delete("services", "default", "base")
    assert sink.wait_for(lambda s: names(s.services) == {f"x{i}" for i in range(6)}, timeout=10)
    api.faults.reset()

    stats = source.stats()["services"]
    assert stats["lists"] == 1, stats  # never relisted
    assert stats["watches"] >= 7 and stats["expired"] == 0
    assert len(list_requests(api, "/api/v1/services")) == 1
    watches = [r for r in api.requests if r.watch and r.path == "/api/v1/services"]
    rvs = [int(r.query["resourceVersion"]) for r in watches]
    assert rvs == sorted(rvs) and len(set(rvs)) >= 7  # each re-watch starts where the last one stopped
    # Nothing was delivered twice: one upsert per created service, one delete.
    assert sink.count("upsert_service") == 6 and sink.count("delete_service") == 1


def test_expired_resource_version_relists_and_applies_missed_deletes(
    api: ApiServer, sink: RecordingSink, source: KubeSource
) -> None:
    store = api.store
    store.create(svc("keep"))
    store.create(svc("doomed"))
    store.create(eps("doomed-1", "doomed"))
    source.start()
    assert source.wait_synced(5)
    assert names(sink.services) == {"keep", "doomed"}

    # The watch goes down and stays down (every request fails) while things change and history is compacted.
    api.faults.update(error_rate=1.0, error_code=503)
    api.drop_watches()
    assert sink.wait_for(lambda s: source.stats()["services"]["errors"] >= 1, timeout=5)
    store.delete("services", "default", "doomed")
    store.delete("endpointslices", "default", "doomed-1")
    store.create(svc("new"))
    api.compact()
    api.faults.reset()

    assert sink.wait_for(lambda s: names(s.services) == {"keep", "new"} and not s.slices, timeout=10)
    stats = source.stats()
    assert stats["services"]["expired"] >= 1 and stats["services"]["lists"] == 2
    assert stats["endpointslices"]["lists"] == 2
    # The missed delete came through the relist's replace, not a watch event.
    assert sink.count("delete_service") == 0 and sink.count("replace_services") == 2


def test_server_errors_back_off_then_recover(api: ApiServer, sink: RecordingSink, source: KubeSource) -> None:
    source.start()
    assert source.wait_synced(5)
    api.faults.update(error_rate=1.0, error_code=500)
    api.drop_watches()
    before = len(api.requests)
    time.sleep(1.5)
    failed = len(api.requests) - before
    # Three reflectors, back-off 0.05 s doubling to 0.4 s: about 6 attempts each in 1.5 s, not a busy loop.
    assert 3 <= failed <= 40, failed
    assert all(source.stats()[k]["errors"] >= 2 for k in ("services", "endpointslices", "nodes"))
    api.faults.reset()
    api.store.create(svc("after"))
    assert sink.wait_for(lambda s: ("default", "after") in s.services, timeout=5)


def test_server_unreachable_at_start_then_appears(sink: RecordingSink, tmp_path: Path) -> None:
    server = serve([(None, "127.0.0.1", 0)], bookmark_interval=0.2)
    port = server.ports[0]
    server.store.create(svc("late"))
    server.faults.update(error_next=6, error_code=503)  # the first lists fail
    client = make_api_client(master=server.url)
    src = KubeSource(sink, client, NODE, resync_backoff=(0.05, 0.2), watch_timeout=3)
    try:
        src.start()
        assert src.wait_synced(5)
        assert names(sink.services) == {"late"}
        assert sum(r["errors"] for r in src.stats().values()) >= 6
        assert port == server.ports[0]
    finally:
        src.stop()
        server.close()
        client.close()


def test_service_proxy_name_lists_without_the_name_clause(api: ApiServer, client: Any) -> None:
    sink = RecordingSink()
    api.store.create(svc("mine", {"service.kubernetes.io/service-proxy-name": "kproxy"}))
    api.store.create(svc("theirs", {"service.kubernetes.io/service-proxy-name": "other"}))
    api.store.create(svc("headless", {"service.kubernetes.io/headless": ""}))
    api.store.create(svc("plain"))
    src = KubeSource(sink, client, NODE, service_proxy_name="kproxy", watch_timeout=3)
    try:
        src.start()
        assert src.wait_synced(5)
        # Headless is filtered by the server; the proxy-name check is the cache's (documented in kube.py).
        assert names(sink.services) == {"mine", "theirs", "plain"}
    finally:
        src.stop()


def test_malformed_events_are_skipped(api: ApiServer, sink: RecordingSink, client: Any) -> None:
    src = KubeSource(sink, client, NODE, watch_timeout=3)
    r: Reflector = src.reflectors["services"]
    r._rv = "5"
    r._handle(b"this is not json")
    r._handle(b'{"type": "ADDED"}')
    r._handle(b'{"type": "WHATEVER", "object": {"metadata": {"resourceVersion": "9"}}}')
    assert r.stats.errors == 3 and r._rv == "5" and not sink.calls
    r._handle(b'{"type": "ADDED", "object": {"metadata": {"name": "ok", "namespace": "d", "resourceVersion": "7"}}}')
    r._handle(b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "8"}}}')
    assert ("d", "ok") in sink.services and r._rv == "8" and r.stats.bookmarks == 1


def test_stop_interrupts_a_blocked_watch(api: ApiServer, sink: RecordingSink, client: Any) -> None:
    src = KubeSource(sink, client, NODE, watch_timeout=300)
    src.start()
    assert src.wait_synced(5)
    time.sleep(0.2)  # the watches are now blocked reading
    start = time.monotonic()
    src.stop()
    assert time.monotonic() - start < 2.0
    assert not any(r._thread and r._thread.is_alive() for r in src.reflectors.values())


def test_make_api_client_from_kubeconfig(api: ApiServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: lab, cluster: {{server: "{api.url}"}}}}]
users: [{{name: u, user: {{token: abc}}}}]
contexts: [{{name: lab, context: {{cluster: lab, user: u}}}}]
current-context: lab
"""
    )
    api.store.create(svc("k"))
    c = make_api_client(kubeconfig=str(kubeconfig))
    try:
        core = kubernetes.client.CoreV1Api(c)
        assert [s.metadata.name for s in core.list_namespaced_service("default").items] == ["k"]
    finally:
        c.close()
    # --master overrides the kubeconfig's server.
    c = make_api_client(kubeconfig=str(kubeconfig), master="http://127.0.0.1:1")
    try:
        assert c.configuration.host == "http://127.0.0.1:1"
    finally:
        c.close()


def test_event_recorder_posts_node_events(api: ApiServer, client: Any) -> None:
    rec = EventRecorder(client, NODE)
    assert rec.starting()
    items, _rv = api.store.list("events.k8s.io", "default")
    assert len(items) == 1
    ev = items[0]
    assert ev["reason"] == "Starting" and ev["action"] == "StartKubeProxy" and ev["type"] == "Normal"
    assert ev["regarding"] == {"kind": "Node", "apiVersion": "v1", "name": NODE, "uid": NODE}
    assert ev["reportingController"] == "kproxy" and ev["metadata"]["name"].startswith(f"{NODE}.")
    api.faults.update(error_next=1, error_code=503)
    assert not rec.node_event("Broken", "Test") and rec.failed == 1 and rec.recorded == 1
    # The failed POST's body was consumed: the pooled connection still works for the next request.
    assert rec.node_event("Again", "Test", note="fine") and rec.recorded == 2


def test_restarted_server_with_older_resource_versions_is_relisted(sink: RecordingSink) -> None:
    first = serve([(None, "127.0.0.1", 0)], bookmark_interval=0.2)
    port = first.ports[0]
    for i in range(20):
        first.store.create(svc(f"old{i}"))
    client = make_api_client(master=first.url)
    src = KubeSource(sink, client, NODE, resync_backoff=(0.05, 0.2), watch_timeout=3)
    second = None
    try:
        src.start()
        assert src.wait_synced(5) and len(sink.services) == 20
        first.close()
        # A new, empty server on the same address: its resourceVersions are behind what the reflector holds.
        second = serve([(None, "127.0.0.1", port)], bookmark_interval=0.2)
        second.store.create(svc("fresh"))
        assert sink.wait_for(lambda s: names(s.services) == {"fresh"}, timeout=10)
        assert src.stats()["services"]["lists"] == 2
        too_large = [r for r in second.requests if r.watch and r.status == 504]
        assert too_large, "the reflector should have been told its resourceVersion is too large"
    finally:
        src.stop()
        client.close()
        first.close()
        if second is not None:
            second.close()


def test_master_survives_the_in_cluster_token_refresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pod, the client refreshes its token before requests and resets the server address with it: --master
    (a DaemonSet pointing kproxy at an API load balancer, as kube-proxy's --master does) must stay."""
    import kubernetes.config.incluster_config as incluster

    from kproxy.sources.kube import make_api_client

    (tmp_path / "token").write_text("t0k3n")
    (tmp_path / "ca.crt").write_text("not a real certificate")
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "198.18.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    client = make_api_client(master="http://198.18.0.9:6443")
    cfg = client.configuration
    assert cfg.host == "http://198.18.0.9:6443"
    assert cfg.refresh_api_key_hook is not None
    cfg.refresh_api_key_hook(cfg)  # what the client does before a request
    assert cfg.host == "http://198.18.0.9:6443"
    client.close()
