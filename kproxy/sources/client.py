"""The official client's ApiClient for the reflectors and the Event recorder: --kubeconfig, in-cluster, ~/.kube/config.

Used by the daemon and the tests through ``kproxy.sources.kube.make_api_client`` (re-exported there). A kubeconfig's
``tokenFile`` (kubeadm's kube-proxy kubeconfig) is sent stripped and read again every ``TOKEN_REREAD_S``: the
client would read it once and send it verbatim, trailing newline included, and never see a rotated token.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client import ApiClient

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
