"""The API stand-in answering from one process both on 127.0.0.1 and inside a network namespace (needs root).

The lab runs one stand-in for all its nodes: the socket for the fabric address is created inside the fabric's
namespace. This test makes its own namespace (prefix kpa-), with an address only there, and checks that a client
inside the namespace and one on loopback outside it see the same store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import kubernetes
import pytest

from kproxy.lab.apiserver import serve

pytestmark = pytest.mark.root

NS = f"kpa-api-{os.getpid()}"
ADDR = "198.18.254.1"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns() -> Iterator[str]:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)  # a stale one from a killed run
    ip("netns", "add", NS)
    try:
        ip("-n", NS, "link", "set", "lo", "up")
        ip("-n", NS, "addr", "add", f"{ADDR}/32", "dev", "lo")
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)


def test_one_server_two_namespaces(netns: str) -> None:
    api = serve([(None, "127.0.0.1", 0), (netns, ADDR, 0)])
    try:
        local_port, ns_port = api.ports
        cfg = kubernetes.client.Configuration()
        cfg.host = f"http://127.0.0.1:{local_port}"
        with kubernetes.client.ApiClient(cfg) as c:
            kubernetes.client.CoreV1Api(c).create_namespaced_service(
                "default", {"metadata": {"name": "shared"}, "spec": {"ports": [{"port": 80}]}}
            )
        code = (
            "import urllib.request;"
            f"print(urllib.request.urlopen('http://{ADDR}:{ns_port}/api/v1/services', timeout=5).read().decode())"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert [i["metadata"]["name"] for i in json.loads(out)["items"]] == ["shared"]
    finally:
        api.close()
