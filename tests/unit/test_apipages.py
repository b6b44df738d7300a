"""The API stand-in's paginated lists (kproxy.lab.apipages) against upstream's rules, over HTTP with the official
client where the wire matters and on the Pager directly where the arithmetic does (no root, 127.0.0.1 only)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiException

from kproxy.lab.apipages import EXPIRED_CONTINUE, Pager, decode_continue, encode_continue
from kproxy.lab.apiserver import ApiServer, serve
from kproxy.lab.apistore import RESOURCES, Store, selector_matcher


def svc(name: str, ns: str = "default", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"ports": [{"port": 80}]},
    }


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = serve([(None, "127.0.0.1", 0)], history=100_000)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def core(api: ApiServer) -> Iterator[kubernetes.client.CoreV1Api]:
    cfg = kubernetes.client.Configuration()
    cfg.host = api.url
    client = kubernetes.client.ApiClient(cfg)
    try:
        yield kubernetes.client.CoreV1Api(client)
    finally:
        client.close()


def raw_list(core: kubernetes.client.CoreV1Api, **kw: Any) -> dict[str, Any]:
    resp = core.list_service_for_all_namespaces(_preload_content=False, **kw)
    return json.loads(resp.data)  # type: ignore[no-any-return]


def status(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    assert body["kind"] == "Status" and body["code"] == exc.status
    return body


def page_all(pager: Pager, namespace: str | None, limit: int, label: str = "") -> tuple[list[str], list[dict]]:
    """Every page of a list: the names in order, and each page's metadata."""
    res = RESOURCES["services"]
    match = selector_matcher(label, "")
    names: list[str] = []
    metas: list[dict[str, Any]] = []
    token = ""
    for _ in range(10_000):
        query = {"limit": str(limit), **({"continue": token} if token else {})}
        items, meta = pager.list(res, namespace, query, match, bool(label))
        names += [f"{i['metadata']['namespace']}/{i['metadata']['name']}" for i in items]
        metas.append(meta)
        token = meta.get("continue", "")
        if not token:
            return names, metas
    raise AssertionError("the pages never ended")


def test_pages_cover_every_object_once_in_etcd_key_order() -> None:
    store = Store(history=10_000)
    # "a-b" sorts before "a/..." in etcd's byte order ('-' < '/'), though ("a", ...) < ("a-b", ...) as tuples.
    want = sorted(f"{ns}/s{i:04d}" for ns in ("a", "a-b", "default") for i in range(411))
    for key in want:
        ns, name = key.split("/")
        store.create(svc(name, ns, {"odd": str(int(name[1:]) % 2)}))
    pager = Pager(store)
    for limit in (1, 7, 500, 5000):
        names, metas = page_all(pager, None, limit)
        assert names == want, limit
        assert len({m["resourceVersion"] for m in metas}) == 1
        assert len(metas) == -(-len(want) // limit)
        # remainingItemCount counts what the next pages hold, and the last page has neither it nor a token
        for k, meta in enumerate(metas[:-1]):
            assert meta["remainingItemCount"] == len(want) - (k + 1) * limit
        assert "continue" not in metas[-1] and "remainingItemCount" not in metas[-1]
    names, _ = page_all(pager, "a", 100)
    assert names == [k for k in want if k.startswith("a/")]
    # With a selector the server cannot know how many of the rest match: no remainingItemCount, as upstream.
    names, metas = page_all(pager, None, 100, "odd=1")
    assert names == [k for k in want if int(k.split("/")[1][1:]) % 2]
    assert all("remainingItemCount" not in m for m in metas) and "continue" in metas[0]


def test_pages_are_one_snapshot_while_objects_change(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    for i in range(25):
        api.store.create(svc(f"s{i:02d}"))
    first = raw_list(core, limit=10)
    api.store.delete("services", "default", "s15")  # after the snapshot: still listed
    api.store.create(svc("s99"))  # after the snapshot: not listed
    second = raw_list(core, limit=10, _continue=first["metadata"]["continue"])
    third = raw_list(core, limit=10, _continue=second["metadata"]["continue"])
    names = [i["metadata"]["name"] for p in (first, second, third) for i in p["items"]]
    assert names == [f"s{i:02d}" for i in range(25)]
    assert first["metadata"]["resourceVersion"] == third["metadata"]["resourceVersion"]
    assert first["metadata"]["remainingItemCount"] == 15 and "continue" not in third["metadata"]


def test_a_token_lives_as_long_as_its_resource_version(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    for i in range(5):
        api.store.create(svc(f"s{i}"))
    first = raw_list(core, limit=2)
    for _ in range(40):  # many other paginated lists meanwhile: no server state ties them to this one
        raw_list(core, limit=1)
    second = raw_list(core, limit=2, _continue=first["metadata"]["continue"])
    assert [i["metadata"]["name"] for i in second["items"]] == ["s2", "s3"]
    start, rv = decode_continue(first["metadata"]["continue"])
    assert start == "default/s1\x00" and str(rv) == first["metadata"]["resourceVersion"]


def test_an_expired_token_is_410_with_a_token_for_the_rest(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    for i in range(6):
        api.store.create(svc(f"s{i}"))
    first = raw_list(core, limit=2)
    api.store.create(svc("s9"))
    api.compact()  # etcd's compaction: the first page's resourceVersion is gone
    with pytest.raises(ApiException) as exc:
        raw_list(core, limit=2, _continue=first["metadata"]["continue"])
    body = status(exc.value)
    assert exc.value.status == 410 and body["reason"] == "Expired" and body["message"] == EXPIRED_CONTINUE
    # The Status carries a token that continues at the latest version (an inconsistent list, rv -1).
    token = body["metadata"]["continue"]
    assert decode_continue(token) == ("default/s1\x00", -1)
    rest = raw_list(core, _continue=token)
    assert [i["metadata"]["name"] for i in rest["items"]] == ["s2", "s3", "s4", "s5", "s9"]
    assert rest["metadata"]["resourceVersion"] == str(api.store.resource_version)


def bad_token(payload: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("%%%not-base64", "invalid continue token: continue key is not valid: "),
        (bad_token({"v": "v2", "rv": 5, "start": "a\x00"}), "server does not recognize this encoded key"),
        (bad_token({"v": "meta.k8s.io/v1", "rv": 5, "start": ""}), "encoded start key empty"),
        (bad_token({"v": "meta.k8s.io/v1", "rv": 5, "start": "../../secrets/x"}), "continue key is not valid"),
        (encode_continue("default/a\x00", 0), "0 continue resource version is not allowed when using continue"),
    ],
)
def test_a_bad_token_is_400(api: ApiServer, core: kubernetes.client.CoreV1Api, token: str, message: str) -> None:
    api.store.create(svc("a"))
    with pytest.raises(ApiException) as exc:
        raw_list(core, limit=1, _continue=token)
    assert exc.value.status == 400 and status(exc.value)["reason"] == "BadRequest"
    assert message in status(exc.value)["message"]


def test_a_resource_version_beside_a_token_is_400(api: ApiServer, core: kubernetes.client.CoreV1Api) -> None:
    for i in range(3):
        api.store.create(svc(f"s{i}"))
    first = raw_list(core, limit=1)
    rv = first["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as exc:
        raw_list(core, limit=1, _continue=first["metadata"]["continue"], resource_version=rv)
    assert exc.value.status == 400
    assert status(exc.value)["message"] == "specifying resource version is not allowed when using continue"
    # resourceVersion=0 beside a token is allowed (upstream ignores it)
    second = raw_list(core, limit=1, _continue=first["metadata"]["continue"], resource_version="0")
    assert [i["metadata"]["name"] for i in second["items"]] == ["s1"]


def test_bulk_load_creates_what_lists_then_page_through(api: ApiServer) -> None:
    cfg = kubernetes.client.Configuration()
    cfg.host = api.url
    with kubernetes.client.ApiClient(cfg) as client:
        items = [svc(f"b{i:04d}") for i in range(1200)] + [svc("b0001"), {"kind": "Nope"}]
        resp = client.call_api(
            "POST", f"{api.url}/_bulk", header_params={"Content-Type": "application/json"}, body={"items": items}
        )
        answer = json.loads(resp.read())
        assert answer["created"] == 1200
        assert [(f["index"], f["code"]) for f in answer["failures"]] == [(1200, 409), (1201, 400)]
        core = kubernetes.client.CoreV1Api(client)
        names, token, pages = [], None, 0
        while token != "":
            kw = {"_continue": token} if token else {}
            page = core.list_service_for_all_namespaces(limit=500, **kw)
            names += [i.metadata.name for i in page.items]
            token = page.metadata._continue or ""
            pages += 1
        assert pages == 3 and names == [f"b{i:04d}" for i in range(1200)]
        assert len({s.spec.cluster_ip for s in core.list_service_for_all_namespaces().items}) == 1200


def test_bulk_replace_changes_objects_and_reports_the_missing(api: ApiServer) -> None:
    api.store.create(svc("r1", labels={"v": "1"}))
    rv = api.store.resource_version
    changed = svc("r1", labels={"v": "2"})
    changed["metadata"]["resourceVersion"] = "1"  # ignored: a bulk replace has no precondition
    answer = api.bulk({"items": [changed, svc("missing")], "replace": True})
    assert answer["replaced"] == 1 and [(f["index"], f["code"]) for f in answer["failures"]] == [(1, 404)]
    got = api.store.get("services", "default", "r1")
    assert got["metadata"]["labels"] == {"v": "2"} and int(got["metadata"]["resourceVersion"]) == rv + 1
    assert got["spec"]["clusterIP"]  # the allocation is kept, as a replace keeps it


def test_each_object_is_serialized_once_for_every_page_list_and_watch_of_that_version(
    api: ApiServer, core: kubernetes.client.CoreV1Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node of a lab lists everything and watches it, and any write (a node's Event) starts a new snapshot:
    each stored object's JSON is made once per version of the object (when it is stored), not once per page or
    event served; a changed object once more."""
    from kproxy.lab import apistore

    encoded: list[str] = []
    real = apistore.encode_item

    def counting(obj: Any) -> bytes:
        encoded.append(obj["metadata"]["name"])
        return real(obj)

    monkeypatch.setattr(apistore, "encode_item", counting)
    store = api.store
    for i in range(1234):
        store.create(svc(f"s{i:04d}"))

    def names() -> list[str]:
        got, token = [], ""
        while True:
            kw = {"_continue": token} if token else {}
            body = raw_list(core, limit=500, **kw)
            got += [o["metadata"]["name"] for o in body["items"]]
            token = body["metadata"].get("continue", "")
            if not token:
                return got

    first = names()
    store.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})  # an unrelated write: new version
    assert names() == first and len(first) == 1234
    assert sorted(n for n in encoded if n != "n1") == sorted(first)  # once each, for two lists of three pages
    rv = first_rv = str(store.resource_version)
    store.patch("services", "default", "s0007", {"metadata": {"labels": {"changed": "yes"}}})
    again = raw_list(core, limit=500)
    watch = core.list_service_for_all_namespaces(
        watch=True, resource_version=first_rv, timeout_seconds=1, _preload_content=False
    )
    events = [json.loads(line) for line in watch.data.splitlines() if line.strip()]
    assert encoded[1235:] == ["s0007"] and again["items"][7]["metadata"]["labels"] == {"changed": "yes"}
    assert [(e["type"], e["object"]["kind"], e["object"]["apiVersion"]) for e in events] == [
        ("MODIFIED", "Service", "v1")
    ]
    assert events[0]["object"] == store.get("services", "default", "s0007") and rv != store.resource_version


def test_a_page_is_the_same_json_as_the_whole_list_serialized_at_once(
    api: ApiServer, core: kubernetes.client.CoreV1Api
) -> None:
    """The page assembled from per-object JSON is byte for byte what serializing the list at once gives."""
    store = api.store
    for i in range(3):
        store.create(svc(f"s{i}", labels={"app": f"a{i}"}))
    resp = core.list_service_for_all_namespaces(_preload_content=False, limit=2)
    body = json.loads(resp.data)
    items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in store.list("services")[0]]
    whole = {"kind": "ServiceList", "apiVersion": "v1", "metadata": body["metadata"], "items": items[:2]}
    assert resp.data == json.dumps(whole, separators=(",", ":")).encode()
