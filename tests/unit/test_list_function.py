"""``kproxy.sources.client.list_function``: the reflectors' list and watch calls, sent through the official client's
ApiClient without its CoreV1Api (whose import alone costs about 20 MB). The request must be the generated method's,
byte for byte, and its answers the same: the raw response, or ApiException for a status outside 2xx."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kubernetes
import pytest
from kubernetes.client import ApiException

from kproxy.lab.apiserver import ApiServer
from kproxy.sources.client import list_function

CALLS: list[dict[str, Any]] = [
    {"label_selector": "!service.kubernetes.io/service-proxy-name", "limit": 2, "resource_version": "0"},
    {"label_selector": "!service.kubernetes.io/headless", "limit": 500},
    {"field_selector": "metadata.name=node-1"},
    {"watch": True, "allow_watch_bookmarks": True, "resource_version": "1", "timeout_seconds": 1},
]


def _recorded(client: kubernetes.client.ApiClient, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every request the client sends, as (method, path, sorted query, headers), still sent to the stand-in."""
    sent: list[tuple[Any, ...]] = []
    real = client.call_api

    def record(method: str, url: str, header_params: Any = None, *args: Any, **kw: Any) -> Any:
        parts = urlsplit(url)
        sent.append((method, parts.path, sorted(parse_qsl(parts.query)), dict(header_params or {})))
        return real(method, url, header_params, *args, **kw)

    monkeypatch.setattr(client, "call_api", record)
    return sent


@pytest.mark.parametrize("kw", CALLS, ids=["first-page", "page", "node", "watch"])
def test_the_request_is_the_generated_methods(
    reflector_api: ApiServer, reflector_client: kubernetes.client.ApiClient, kw: dict[str, Any], monkeypatch: Any
) -> None:
    reflector_api.store.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "d"}})
    sent = _recorded(reflector_client, monkeypatch)
    core = kubernetes.client.CoreV1Api(reflector_client)
    answers = []
    for fn in (core.list_service_for_all_namespaces, list_function(reflector_client, "/api/v1/services")):
        resp = fn(_preload_content=False, _request_timeout=(5, 10), **kw)
        assert resp.status == 200
        body = resp.read()
        resp.release_conn()
        answers.append(body if kw.get("watch") else json.loads(body)["items"])
    generated, ours = sent
    assert ours == generated
    assert answers[0] == answers[1]


def test_a_status_outside_2xx_is_the_generated_methods_exception(
    reflector_client: kubernetes.client.ApiClient,
) -> None:
    raised = []
    for fn in (
        kubernetes.client.CoreV1Api(reflector_client).list_namespace,  # the stand-in serves no namespaces: 404
        list_function(reflector_client, "/api/v1/namespaces"),
    ):
        with pytest.raises(ApiException) as exc:
            fn(_preload_content=False, _request_timeout=(5, 10))
        raised.append((exc.value.status, exc.value.reason, exc.value.body))
    assert raised[0] == raised[1] and raised[0][0] == 404


def test_a_keyword_the_reflectors_never_send_is_refused(reflector_client: kubernetes.client.ApiClient) -> None:
    call = list_function(reflector_client, "/api/v1/services")
    with pytest.raises(TypeError, match="pretty"):
        call(pretty="true")
    with pytest.raises(TypeError, match="raw response"):
        call(_preload_content=True)
