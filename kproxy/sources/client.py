"""The official client's ApiClient for the reflectors and the Event recorder: --kubeconfig, in-cluster, ~/.kube/config.

Used by the daemon and the tests through ``kproxy.sources.kube.make_api_client`` (re-exported there). A kubeconfig's
``tokenFile`` (kubeadm's kube-proxy kubeconfig) is sent stripped and read again every ``TOKEN_REREAD_S``: the
client would read it once and send it verbatim, trailing newline included, and never see a rotated token.

``list_function`` is what the reflectors call to list and watch a collection: a GET through this ApiClient (its
configuration, authentication, TLS and connection pool), as the generated API classes send it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client import ApiClient, ApiException

log = logging.getLogger(__name__)


def make_api_client(kubeconfig: str = "", master: str = "") -> ApiClient:
    """An ApiClient from --kubeconfig, else the in-cluster service account, else ~/.kube/config; --master overrides
    the server address (plain http is fine, for the lab's API stand-in)."""
    cfg = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
        token_file = _token_file(kubeconfig)
        if token_file is not None:
            _follow_token_file(cfg, token_file)
    elif os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("KUBERNETES_SERVICE_PORT"):
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    elif Path(os.path.expanduser(kubernetes.config.KUBE_CONFIG_DEFAULT_LOCATION)).exists():
        kubernetes.config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    elif not master:
        raise kubernetes.config.ConfigException(
            "no --kubeconfig, no in-cluster service account and no ~/.kube/config: cannot reach the API server"
        )
    if master:
        host = master.rstrip("/")
        cfg.host = host
        refresh = cfg.refresh_api_key_hook
        if refresh is not None:
            # the in-cluster loader refreshes the token before every request and, in doing so, sets the server
            # back to KUBERNETES_SERVICE_HOST: --master must survive it
            def keep_master(c: Any) -> None:
                refresh(c)
                c.host = host

            cfg.refresh_api_key_hook = keep_master
    client = ApiClient(cfg)
    client.user_agent = "kproxy/0.1"
    return client


TOKEN_REREAD_S = 60.0  # a projected service-account token is rotated well before it expires (kubelet: at 80 %)


def _token_file(kubeconfig: str) -> Path | None:
    """The current context's user's ``tokenFile`` (what kubeadm's kube-proxy kubeconfig names), or None."""
    import yaml

    try:
        doc = yaml.safe_load(Path(kubeconfig).read_text()) or {}
        ctx_name = doc.get("current-context")
        ctx = next(c["context"] for c in doc.get("contexts") or [] if c.get("name") == ctx_name)
        user = next(u["user"] for u in doc.get("users") or [] if u.get("name") == ctx.get("user"))
        path = user.get("tokenFile")
    except (OSError, yaml.YAMLError, StopIteration, AttributeError, KeyError, TypeError):
        return None
    if not isinstance(path, str) or not path:
        return None
    return (Path(kubeconfig).parent / path) if not os.path.isabs(path) else Path(path)


def _follow_token_file(cfg: Any, path: Path) -> None:
    """Send the token file's current content, stripped (the client reads it once and sends it verbatim, a trailing
    newline included), and read it again at most every ``TOKEN_REREAD_S`` so a rotated token is picked up."""
    state: dict[str, Any] = {"at": 0.0, "token": ""}

    # the loader's own hook is not chained: it re-reads the file verbatim and installs itself again on every call
    def refresh(c: Any) -> None:
        now = time.monotonic()
        if not state["at"] or now - state["at"] >= TOKEN_REREAD_S:
            try:
                state["token"] = path.read_text().strip() or state["token"]
                state["at"] = now
            except OSError as exc:
                log.warning("cannot read the kubeconfig's token file %s: %s (keeping the last token)", path, exc)
        if state["token"]:
            for key in ("BearerToken", "authorization"):  # the client looks the first up, then the second
                c.api_key_prefix.pop(key, None)
            c.api_key["BearerToken"] = f"Bearer {state['token']}"
            c.api_key.pop("authorization", None)

    cfg.refresh_api_key_hook = refresh
    refresh(cfg)


#: the generated API methods' keywords the reflectors use -> their query parameters
_QUERY = {
    "label_selector": "labelSelector",
    "field_selector": "fieldSelector",
    "resource_version": "resourceVersion",
    "limit": "limit",
    "_continue": "continue",
    "watch": "watch",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
}


def list_function(api_client: ApiClient, path: str) -> Callable[..., Any]:
    """A list-and-watch call for the collection at ``path`` (``/api/v1/services``) that takes the generated methods'
    keywords (``list_service_for_all_namespaces(label_selector=..., _continue=..., watch=True, ...)``) and answers as
    they do with ``_preload_content=False``: the raw urllib3 response, or ApiException for a status outside 2xx. The
    request is serialized and sent by the ApiClient itself (``param_serialize``, ``call_api``), bearer token included.

    Why not ``CoreV1Api``: its module, the client's largest, wraps each of its several hundred methods in pydantic's
    ``validate_call`` when it is imported, about 20 MB resident (measured: 46 -> 67 MB) in a process that calls two
    of them. ``DiscoveryV1Api`` would cost little, but the three reflectors are better built one way."""

    def call(*, _preload_content: bool = False, _request_timeout: Any = None, **kw: Any) -> Any:
        if _preload_content:
            raise TypeError("list_function answers with the raw response only (_preload_content=False)")
        unknown = set(kw) - set(_QUERY)
        if unknown:
            raise TypeError(f"unexpected keywords {sorted(unknown)}")
        query = [(_QUERY[k], v) for k, v in kw.items() if v is not None]
        request = api_client.param_serialize(
            "GET", path, query_params=query, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
        )
        resp = api_client.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= resp.status <= 299:
            resp.read()  # type: ignore[no-untyped-call]
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    return call
