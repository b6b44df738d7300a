"""The soak's access to the lab: the API stand-in over plain HTTP (with bounded retries for the 5xx the soak itself
injects), a node's own endpoints (``/rules``, ``/verify``) reached from inside its namespace, and one node's check
against the expectation.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kproxy.soak.churn import NAMESPACE, Write

METRICS_PORT = 10249
HEALTHZ_PORT = 10256


class SoakError(RuntimeError):
    """The soak could not run (lab, API, traffic client); the message says where."""


class Api:
    """The lab's API stand-in over plain HTTP (JSON), with bounded retries for the 5xx the soak itself injects."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"null")
            except ValueError:
                payload = None
            return exc.code, payload

    @staticmethod
    def path(kind: str, name: str | None = None, namespace: str | None = NAMESPACE) -> str:
        if kind == "Service":
            base = "/api/v1" + (f"/namespaces/{namespace}" if namespace else "") + "/services"
        elif kind == "EndpointSlice":
            base = "/apis/discovery.k8s.io/v1" + (f"/namespaces/{namespace}" if namespace else "") + "/endpointslices"
        elif kind == "Node":
            base = "/api/v1/nodes"
        else:
            raise ValueError(kind)
        return base + (f"/{name}" if name else "")

    def write(self, w: Write, deadline: float) -> tuple[bool, int]:
        """Send one write, retrying 5xx and connection errors until ``deadline``: (the API took it, retries).
        A 4xx is final (the API refused the object): False."""
        retries = 0
        while True:
            try:
                if w.verb == "delete":
                    code, _ = self.call("DELETE", self.path(w.kind, w.name))
                    if code in (200, 202, 404):
                        return code != 404, retries
                else:
                    code, _ = self.call("PUT", self.path(w.kind, w.name), w.obj)
                    if code == 404:
                        code, _ = self.call("POST", self.path(w.kind), w.obj)
                    if code in (200, 201):
                        return True, retries
                if 400 <= code < 500 and code not in (404, 409, 429):
                    return False, retries
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() >= deadline:
                return False, retries
            retries += 1
            time.sleep(min(0.2 * retries, 1.0))

    def list(self, kind: str) -> list[dict[str, Any]]:
        code, body = self.call("GET", self.path(kind, namespace=None))
        if code != 200 or not isinstance(body, dict):
            raise SoakError(f"listing {kind} failed: HTTP {code}")
        return list(body.get("items") or [])

    def node(self, name: str) -> dict[str, Any] | None:
        code, body = self.call("GET", self.path("Node", name))
        return body if code == 200 and isinstance(body, dict) else None

    def faults(self, **body: Any) -> None:
        code, answer = self.call("POST", "/_faults", body)
        if code != 200:
            raise SoakError(f"POST /_faults {body} failed: HTTP {code} {answer}")


def ns_get(ns: str, path: str, port: int = METRICS_PORT, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET http://127.0.0.1:PORT/PATH inside network namespace ``ns``: the socket is made there (setns of this
    thread only, then back), the exchange runs here. Cheaper than a probe process per poll. Main thread only."""
    from pyroute2 import netns as pr_netns

    pr_netns.pushns(ns)
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    finally:
        pr_netns.popns()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@dataclass
class NodeCheck:
    """One node's state against the expectation at one moment."""

    node: str
    diffs: dict[str, str] = field(default_factory=dict)  # from /rules
    drift: int = 0  # from /verify (or the kernel_view fallback)
    drift_detail: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.diffs and self.drift == 0 and not self.error


def describe_checks(checks: Sequence[NodeCheck]) -> str:
    parts = []
    for c in checks:
        if c.ok:
            continue
        bits = [c.error] if c.error else []
        bits += [f"{k}: {v}" for k, v in list(c.diffs.items())[:3]]
        bits += c.drift_detail[:3]
        parts.append(f"{c.node}: " + "; ".join(bits))
    return " | ".join(parts) or "no difference"
