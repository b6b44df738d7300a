"""The API stand-in (kproxy.lab.apiserver) driven by the official `kubernetes` client, on 127.0.0.1 (no root)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import urllib3
from kubernetes.client import ApiException

from kproxy.lab.apiobjects import ApiError
from kproxy.lab.apiserver import ApiServer, parse_listen, serve


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)], bookmark_interval=0.3, history=100)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def client(api: ApiServer) -> Iterator[kubernetes.client.ApiClient]:
    cfg = kubernetes.client.Configuration()
    cfg.host = api.url
    c = kubernetes.client.ApiClient(cfg)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def core(client: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(client)


@pytest.fixture
def disc(client: kubernetes.client.ApiClient) -> kubernetes.client.DiscoveryV1Api:
    return kubernetes.client.DiscoveryV1Api(client)


def svc(name: str, ns: str = "default", labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"ports": [{"port": 80, "name": "http"}], **spec},
    }


def eps(name: str, service: str, ip: str, ns: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def status_of(exc: ApiException) -> dict[str, Any]:
    body = json.loads(exc.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure"
    assert body["code"] == exc.status
    return body


def http(api: ApiServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(api.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.startswith(b"{") or raw.startswith(b"[") else raw)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        return exc.code, json.loads(raw)


def test_crud_with_the_official_client(core: kubernetes.client.CoreV1Api) -> None:
    created = core.create_namespaced_service("default", svc("web", labels={"app": "web"}))
    assert created.metadata.uid and created.metadata.creation_timestamp
    rv1 = int(created.metadata.resource_version)
    # The registry's defaults and allocations.
    assert created.spec.type == "ClusterIP" and created.spec.cluster_ip.startswith("198.19.")
    assert created.spec.cluster_ips == [created.spec.cluster_ip] and created.spec.ip_families == ["IPv4"]
    assert created.spec.ports[0].protocol == "TCP" and created.spec.ports[0].target_port == 80
    assert created.spec.session_affinity == "None"

    got = core.read_namespaced_service("web", "default")
    assert got.metadata.uid == created.metadata.uid

    with pytest.raises(ApiException) as exc:
        core.create_namespaced_service("default", svc("web"))
    assert exc.value.status == 409 and status_of(exc.value)["reason"] == "AlreadyExists"

    # Replace with the current resourceVersion works; with a stale one is a Conflict.
    body = core.api_client.sanitize_for_serialization(got)
    body["spec"]["ports"][0]["port"] = 81
    replaced = core.replace_namespaced_service("web", "default", body)
    assert replaced.spec.ports[0].port == 81 and int(replaced.metadata.resource_version) > rv1
    assert replaced.spec.cluster_ip == created.spec.cluster_ip
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_service("web", "default", body)  # still carries the old resourceVersion
    assert exc.value.status == 409 and status_of(exc.value)["reason"] == "Conflict"

    # The client sends a dict body as a strategic merge patch; treated as a JSON merge patch.
    patched = core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"tier": "front"}}})
    assert patched.metadata.labels == {"app": "web", "tier": "front"}
    # JSON patch (a list body).
    patched = core.patch_namespaced_service(
        "web", "default", [{"op": "replace", "path": "/metadata/labels/tier", "value": "back"}]
    )
    assert patched.metadata.labels["tier"] == "back"
    # A no-op update does not produce a new resourceVersion.
    again = core.patch_namespaced_service("web", "default", {"metadata": {"labels": {"tier": "back"}}})
    assert again.metadata.resource_version == patched.metadata.resource_version

    deleted = core.delete_namespaced_service("web", "default")
    assert deleted.metadata.name == "web"
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_service("web", "default")
    body404 = status_of(exc.value)
    assert exc.value.status == 404 and body404["reason"] == "NotFound"
    assert body404["message"] == 'services "web" not found' and body404["details"]["name"] == "web"
    with pytest.raises(ApiException) as exc:
        core.delete_namespaced_service("web", "default")
    assert exc.value.status == 404


def test_service_allocations_and_status_subresource(core: kubernetes.client.CoreV1Api) -> None:
    lb = core.create_namespaced_service(
        "default", svc("lb", type="LoadBalancer", externalTrafficPolicy="Local", clusterIP="198.19.200.7")
    )
    assert lb.spec.cluster_ip == "198.19.200.7"
    assert 30000 <= lb.spec.ports[0].node_port <= 32767 and 30000 <= lb.spec.health_check_node_port <= 32767
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_service("default", svc("dup", clusterIP="198.19.200.7"))
    assert exc.value.status == 422 and status_of(exc.value)["reason"] == "Invalid"

    st = core.patch_namespaced_service_status(
        "lb", "default", {"status": {"loadBalancer": {"ingress": [{"ip": "198.18.250.1"}]}}}
    )
    assert st.status.load_balancer.ingress[0].ip == "198.18.250.1"
    # A write to the main resource keeps the status and the allocated nodePort.
    body = core.api_client.sanitize_for_serialization(st)
    body["status"] = {}
    body["spec"]["ports"][0].pop("nodePort")
    kept = core.replace_namespaced_service("lb", "default", body)
    assert kept.status.load_balancer.ingress[0].ip == "198.18.250.1"
    assert kept.spec.ports[0].node_port == lb.spec.ports[0].node_port
    # The status subresource changes nothing but the status.
    body = core.api_client.sanitize_for_serialization(kept)
    body["spec"]["ports"][0]["port"] = 99
    body["status"] = {"loadBalancer": {}}
    st2 = core.replace_namespaced_service_status("lb", "default", body)
    assert st2.spec.ports[0].port == 80 and not st2.status.load_balancer.ingress


def test_a_nodeport_service_turned_clusterip_gives_its_ports_back(api: ApiServer) -> None:
    """The soak's type flip: a NodePort Service replaced as ClusterIP (no nodePorts in the body) loses its nodePorts,
    as the registry's patchAllocatedValues does, so no later Service shares one with it and a restored dump loads
    again; a ClusterIP Service that names a nodePort is refused, as validation refuses it."""
    store = api.store
    flip = store.create(svc("flip", type="NodePort"))
    port = flip["spec"]["ports"][0]["nodePort"]
    store.update(svc("flip", type="ClusterIP"))
    assert "nodePort" not in store.get("services", "default", "flip")["spec"]["ports"][0]
    taker = store.create(svc("taker", type="NodePort", ports=[{"port": 80, "name": "http", "nodePort": port}]))
    assert taker["spec"]["ports"][0]["nodePort"] == port  # free again
    with pytest.raises(ApiError) as exc:
        store.create(svc("named", ports=[{"port": 80, "name": "http", "nodePort": 31999}]))
    assert exc.value.code == 422 and "Forbidden" in str(exc.value)
    back = store.update(svc("flip", type="NodePort"))
    assert back["spec"]["ports"][0]["nodePort"] not in (0, port)  # a fresh one: the old one is taken
    # an Local load balancer keeps its healthCheckNodePort across an update that leaves it out, and owns it
    lb = store.create(svc("lb", type="LoadBalancer", externalTrafficPolicy="Local"))
    hc = lb["spec"]["healthCheckNodePort"]
    assert (
        store.update(svc("lb", type="LoadBalancer", externalTrafficPolicy="Local"))["spec"]["healthCheckNodePort"] == hc
    )
    with pytest.raises(ApiError):
        store.create(svc("steal", type="NodePort", ports=[{"port": 80, "name": "http", "nodePort": hc}]))


def test_label_and_field_selectors(core: kubernetes.client.CoreV1Api, disc: kubernetes.client.DiscoveryV1Api) -> None:
    core.create_namespaced_service("a", svc("plain", "a"))
    core.create_namespaced_service("a", svc("other", "a", labels={"service.kubernetes.io/service-proxy-name": "x"}))
    core.create_namespaced_service("b", svc("headless", "b", labels={"service.kubernetes.io/headless": ""}))
    core.create_namespaced_service("b", svc("tiered", "b", labels={"tier": "front", "app": "shop"}))

    def names(**kw: Any) -> list[str]:
        return sorted(i.metadata.name for i in core.list_service_for_all_namespaces(**kw).items)

    upstream = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    assert names(label_selector=upstream) == ["plain", "tiered"]
    assert names(label_selector="tier=front") == ["tiered"]
    assert names(label_selector="tier==front,app=shop") == ["tiered"]
    assert names(label_selector="tier!=front") == ["headless", "other", "plain"]
    assert names(label_selector="app in (shop, bank)") == ["tiered"]
    assert names(label_selector="app notin (shop)") == ["headless", "other", "plain"]
    assert names(label_selector="service.kubernetes.io/headless") == ["headless"]
    assert names(field_selector="metadata.name=plain") == ["plain"]
    assert names(field_selector="metadata.namespace=b") == ["headless", "tiered"]
    assert names(field_selector="metadata.namespace!=b,metadata.name!=other") == ["plain"]
    assert sorted(i.metadata.name for i in core.list_namespaced_service("a").items) == ["other", "plain"]
    with pytest.raises(ApiException) as exc:
        names(label_selector="tier in (front")
    assert exc.value.status == 400
    with pytest.raises(ApiException) as exc:
        names(field_selector="spec.type=ClusterIP")
    assert exc.value.status == 400

    disc.create_namespaced_endpoint_slice("a", eps("plain-1", "plain", "198.18.1.1", "a"))
    slices = disc.list_endpoint_slice_for_all_namespaces(label_selector="kubernetes.io/service-name=plain")
    assert [s.metadata.name for s in slices.items] == ["plain-1"]
    assert slices.items[0].endpoints[0].addresses == ["198.18.1.1"]

    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n2"}})
    nodes = core.list_node(field_selector="metadata.name=n2")
    assert [n.metadata.name for n in nodes.items] == ["n2"]
    assert core.read_node("n1").metadata.name == "n1"


def test_list_resource_version_pagination_and_exact(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    for i in range(7):
        core.create_namespaced_service("default", svc(f"s{i}"))
    raw = core.list_service_for_all_namespaces(_preload_content=False)
    body = json.loads(raw.data)
    assert body["kind"] == "ServiceList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == str(api.store.resource_version)
    assert "kind" not in body["items"][0]  # as the real server: items carry no TypeMeta

    page1 = core.list_service_for_all_namespaces(limit=3)
    assert len(page1.items) == 3 and page1.metadata._continue and page1.metadata.remaining_item_count == 4
    core.create_namespaced_service("default", svc("s99"))  # after the snapshot: must not appear
    core.delete_namespaced_service("s6", "default")  # ... and this one must still appear
    page2 = core.list_service_for_all_namespaces(limit=3, _continue=page1.metadata._continue)
    page3 = core.list_service_for_all_namespaces(limit=3, _continue=page2.metadata._continue)
    assert not page3.metadata._continue
    assert page1.metadata.resource_version == page2.metadata.resource_version == page3.metadata.resource_version
    assert [i.metadata.name for i in page1.items + page2.items + page3.items] == [f"s{i}" for i in range(7)]

    # An exact list at an older resourceVersion shows the state back then.
    old = core.list_service_for_all_namespaces(
        resource_version=page1.metadata.resource_version, resource_version_match="Exact"
    )
    assert sorted(i.metadata.name for i in old.items) == [f"s{i}" for i in range(7)]
    api.compact()
    with pytest.raises(ApiException) as exc:
        core.list_service_for_all_namespaces(
            resource_version=page1.metadata.resource_version, resource_version_match="Exact"
        )
    assert exc.value.status == 410 and status_of(exc.value)["reason"] == "Expired"


def test_watch_events_bookmarks_and_timeout(core: kubernetes.client.CoreV1Api) -> None:
    core.create_namespaced_service("default", svc("before"))
    rv = core.list_service_for_all_namespaces().metadata.resource_version

    def mutate() -> None:
        time.sleep(0.2)
        core.create_namespaced_service("default", svc("w", labels={"sel": "yes"}))
        core.patch_namespaced_service("w", "default", {"metadata": {"annotations": {"a": "1"}}})
        core.patch_namespaced_service("w", "default", {"metadata": {"labels": {"sel": "no"}}})  # leaves the selector
        core.patch_namespaced_service("w", "default", {"metadata": {"labels": {"sel": "yes"}}})  # comes back
        core.delete_namespaced_service("w", "default")

    t = threading.Thread(target=mutate)
    t.start()
    seen: list[tuple[str, str]] = []
    objects: list[dict[str, Any]] = []
    start = time.monotonic()
    w = kubernetes.watch.Watch()
    for ev in w.stream(
        core.list_service_for_all_namespaces,
        label_selector="sel=yes",
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=2,
    ):
        obj = ev["raw_object"]
        seen.append((ev["type"], obj["metadata"].get("name", "")))
        if ev["type"] != "BOOKMARK":
            assert obj["kind"] == "Service" and obj["apiVersion"] == "v1"
            objects.append(obj)
    elapsed = time.monotonic() - start
    t.join()
    changes = [s for s in seen if s[0] != "BOOKMARK"]
    assert changes == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w"), ("ADDED", "w"), ("DELETED", "w")]
    # Leaving the selector: DELETED with the previous content, at the new resourceVersion (as the watch cache).
    assert objects[2]["metadata"]["labels"] == {"sel": "yes"}
    assert int(objects[2]["metadata"]["resourceVersion"]) > int(objects[1]["metadata"]["resourceVersion"])
    assert seen.count(("BOOKMARK", "")) >= 3  # every 0.3 s and one before the close
    assert seen[-1][0] == "BOOKMARK"
    assert 1.9 <= elapsed < 4.0  # timeoutSeconds honoured


def test_watch_without_resource_version_starts_with_current_state(core: kubernetes.client.CoreV1Api) -> None:
    core.create_namespaced_service("default", svc("x1"))
    core.create_namespaced_service("default", svc("x2"))
    w = kubernetes.watch.Watch()
    seen = [
        (ev["type"], ev["raw_object"]["metadata"].get("name"))
        for ev in w.stream(core.list_namespaced_service, "default", timeout_seconds=1)
    ]
    assert seen[:2] == [("ADDED", "x1"), ("ADDED", "x2")]


def test_watch_from_compacted_resource_version_gets_410(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    rv = core.list_service_for_all_namespaces().metadata.resource_version
    core.create_namespaced_service("default", svc("gone"))
    api.compact()
    resp = core.list_service_for_all_namespaces(
        watch=True, resource_version=rv, timeout_seconds=5, _preload_content=False
    )
    assert resp.status == 200  # as the real server: an ERROR event in the stream, not an HTTP error
    line = resp.readline()
    resp.release_conn()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    assert event["object"]["kind"] == "Status" and event["object"]["code"] == 410
    assert event["object"]["reason"] == "Expired"
    # The client's own watch helper turns it into an ApiException 410 when it may not retry.
    with pytest.raises(ApiException) as exc:
        for _ in kubernetes.watch.Watch().stream(
            core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=2
        ):
            pass
    assert exc.value.status == 410
    # A current resourceVersion still works.
    now = core.list_service_for_all_namespaces().metadata.resource_version
    events = list(
        kubernetes.watch.Watch().stream(core.list_service_for_all_namespaces, resource_version=now, timeout_seconds=1)
    )
    assert events == []


def test_history_limit_expires_old_resource_versions(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    rv = core.list_service_for_all_namespaces().metadata.resource_version
    core.create_namespaced_service("default", svc("h"))
    for i in range(101):  # history is 100 in this fixture
        core.patch_namespaced_service("h", "default", {"metadata": {"annotations": {"i": str(i)}}})
    with pytest.raises(ApiException) as exc:
        for _ in kubernetes.watch.Watch().stream(
            core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=1
        ):
            pass
    assert exc.value.status == 410


def test_faults_errors_delay_and_watch_drops(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    assert http(api, "GET", "/healthz") == (200, b"ok")
    code, state = http(api, "POST", "/_faults", {"error_next": 2, "error_code": 500})
    assert code == 200 and state["error_next"] == 2 and state["error_code"] == 500
    for _ in range(2):
        with pytest.raises(ApiException) as exc:
            core.list_namespaced_service("default")
        assert exc.value.status == 500 and status_of(exc.value)["reason"] == "InternalError"
    core.list_namespaced_service("default")

    api.faults.update(error_rate=1.0, error_code=503)
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_service("default")
    assert exc.value.status == 503 and status_of(exc.value)["reason"] == "ServiceUnavailable"
    http(api, "POST", "/_faults", {"reset": True, "delay": 0.3})
    start = time.monotonic()
    core.list_namespaced_service("default")
    assert time.monotonic() - start >= 0.3
    code, state = http(api, "POST", "/_faults", {"reset": True})
    assert state["delay"] == 0.0 and state["error_rate"] == 0.0

    # Drop every watch after 2 events: the client sees a broken stream, not a clean end.
    rv = core.list_service_for_all_namespaces().metadata.resource_version
    for i in range(4):
        core.create_namespaced_service("default", svc(f"d{i}"))
    http(api, "POST", "/_faults", {"watch_drop_after_events": 2})
    resp = core.list_service_for_all_namespaces(
        watch=True, resource_version=rv, timeout_seconds=5, _preload_content=False
    )
    got = b""
    with pytest.raises(urllib3.exceptions.HTTPError):
        for chunk in resp.stream(amt=None):
            got += chunk
    assert [json.loads(x)["object"]["metadata"]["name"] for x in got.splitlines()] == ["d0", "d1"]

    # Dropped after T seconds, and on demand.
    api.faults.update(watch_drop_after_events=None, watch_drop_after_seconds=0.5)
    resp = core.list_service_for_all_namespaces(
        watch=True, resource_version=rv, timeout_seconds=5, _preload_content=False
    )
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):
        for _chunk in resp.stream(amt=None):
            pass
    assert 0.4 < time.monotonic() - start < 2.0
    api.faults.reset()
    now = core.list_service_for_all_namespaces().metadata.resource_version
    resp = core.list_service_for_all_namespaces(
        watch=True, resource_version=now, timeout_seconds=5, _preload_content=False
    )
    threading.Timer(0.2, api.drop_watches).start()
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.HTTPError):
        for _chunk in resp.stream(amt=None):
            pass
    assert time.monotonic() - start < 2.0

    # Compact over HTTP.
    code, state = http(api, "POST", "/_faults", {"compact": True})
    assert state["history_floor"] == state["resource_version"] == api.store.resource_version
    assert http(api, "GET", "/_faults")[1]["watch_drop_after_events"] is None
    # The request log records what was asked.
    watches = [r for r in api.requests if r.watch]
    assert watches and watches[-1].query["resourceVersion"] == now


def test_events_core_and_events_k8s_io(client: kubernetes.client.ApiClient, core: kubernetes.client.CoreV1Api) -> None:
    core.create_namespaced_event(
        "default",
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "kproxy-"},
            "involvedObject": {"kind": "Node", "name": "n1"},
            "reason": "Starting",
            "message": "kproxy started",
            "type": "Normal",
        },
    )
    ev1 = kubernetes.client.EventsV1Api(client)
    ev1.create_namespaced_event(
        "default",
        {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": "e2"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reportingController": "kproxy",
            "reportingInstance": "kproxy-n1",
            "action": "Start",
            "reason": "Starting",
            "type": "Normal",
        },
    )
    core_events = core.list_namespaced_event("default").items
    assert len(core_events) == 1 and core_events[0].metadata.name.startswith("kproxy-")
    assert core_events[0].reason == "Starting"
    assert [e.metadata.name for e in ev1.list_namespaced_event("default").items] == ["e2"]


def test_python_store_api(api: ApiServer) -> None:
    store = api.store
    created = store.create(svc("p"))
    assert store.get("services", "default", "p")["metadata"]["uid"] == created["metadata"]["uid"]
    items, rv = store.list("services")
    assert [i["metadata"]["name"] for i in items] == ["p"] and rv == store.resource_version
    created["metadata"]["labels"] = {"x": "y"}
    updated = store.update(created)
    assert updated["metadata"]["labels"] == {"x": "y"}
    items[0]["metadata"]["name"] = "mutated"  # copies: the store is not affected
    assert store.get("Service", "default", "p")["metadata"]["name"] == "p"
    store.apply(svc("p", labels={"z": "1"}))
    assert store.get("services", "default", "p")["metadata"]["labels"] == {"z": "1"}
    store.delete("services", "default", "p")
    assert store.list("services")[0] == []


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:6443") == (None, "127.0.0.1", 6443)
    assert parse_listen("kpl-fabric/198.18.0.1:6443") == ("kpl-fabric", "198.18.0.1", 6443)
    assert parse_listen("[::1]:0") == (None, "::1", 0)
    with pytest.raises(ValueError):
        parse_listen("nohost")
    out = subprocess.run(
        [sys.executable, "-m", "kproxy", "apiserver", "--listen", "bogus"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "bad listen address 'bogus'" in out.stderr and "Traceback" not in out.stderr


def test_command_line_serves_loaded_manifests_and_stops_on_sigterm(tmp_path: Path) -> None:
    manifests = tmp_path / "m"
    manifests.mkdir()
    (manifests / "a.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: loaded, namespace: ns1}\nspec:\n  ports: [{port: 53}]\n"
        "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-a}\n"
    )
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kproxy.lab.apiserver",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--load",
            str(manifests),
            "--history",
            "50",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert port_file.exists(), proc.communicate(timeout=5)[0]
        cfg = kubernetes.client.Configuration()
        cfg.host = f"http://127.0.0.1:{int(port_file.read_text())}"
        with kubernetes.client.ApiClient(cfg) as c:
            core = kubernetes.client.CoreV1Api(c)
            assert [s.metadata.name for s in core.list_namespaced_service("ns1").items] == ["loaded"]
            assert core.read_node("node-a").metadata.name == "node-a"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=10)[0]
    assert proc.returncode == 0, out


def test_one_server_several_listeners() -> None:
    import socket

    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    api = serve([(None, "127.0.0.1", 0), (None, "::1", 0)])
    try:
        v4, v6 = api.ports
        api.store.create(svc("both"))
        for url in (f"http://127.0.0.1:{v4}", f"http://[::1]:{v6}"):
            cfg = kubernetes.client.Configuration()
            cfg.host = url
            with kubernetes.client.ApiClient(cfg) as c:
                items = kubernetes.client.CoreV1Api(c).list_namespaced_service("default").items
                assert [s.metadata.name for s in items] == ["both"]
    finally:
        api.close()
