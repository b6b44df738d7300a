"""A kubeconfig's ``tokenFile`` (kubeadm's kube-proxy kubeconfig, the DaemonSet's ConfigMap): sent stripped and read
again so a rotated service-account token is picked up.

On the code before, the official client read the file once and sent it verbatim: a trailing newline made every
request fail, and a rotated token was never seen by a running kproxy.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from kproxy.sources import client as kube_client


@pytest.fixture
def api() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({"kind": "ServiceList", "apiVersion": "v1", "metadata": {}, "items": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_token_file_is_sent_stripped_and_followed(
    tmp_path: Path, api: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = api
    token = tmp_path / "token"
    token.write_text("first-token\n")  # as an editor or `echo` writes it
    conf = tmp_path / "kubeconfig"
    conf.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: '{url}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "users: [{name: u, user: {tokenFile: token}}]\n"  # relative to the kubeconfig, as kubectl resolves it
    )
    client = kube_client.make_api_client(str(conf))
    core = kubernetes.client.CoreV1Api(client)
    core.list_service_for_all_namespaces(_request_timeout=5)
    assert seen[-1] == "Bearer first-token"
    token.write_text("rotated-token")
    core.list_service_for_all_namespaces(_request_timeout=5)
    assert seen[-1] == "Bearer first-token"  # read again at most every TOKEN_REREAD_S
    monkeypatch.setattr(kube_client, "TOKEN_REREAD_S", 0.0)
    core.list_service_for_all_namespaces(_request_timeout=5)
    assert seen[-1] == "Bearer rotated-token"
    client.close()
