"""The data-path benchmark's objects in the lab's API: the target Service and its one-pod EndpointSlice, the
synthetic services of a size, and a writer that creates them over the API stand-in's public HTTP API with a few
keep-alive connections, as any client would.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from kproxy.bench import synthetic
from kproxy.bench.dpconfig import (
    ECHO_PORT,
    IPERF_PORT,
    SERVICE_PORT,
    TARGET_CLUSTER_IP,
    TARGET_NAME,
    TARGET_NAMESPACE,
    WRITE_THREADS,
    DatapathError,
)
from kproxy.lab.plan import LabPod


def _strip(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "resourceVersion", "generateName")}
    return {**obj, "metadata": meta}


def target_objects(pod: LabPod, name: str = TARGET_NAME, cluster_ip: str = TARGET_CLUSTER_IP) -> list[dict[str, Any]]:
    """The target Service (TCP and UDP 80 -> 8080, TCP 5201 -> iperf3) and its EndpointSlice: pod ``pod`` only. (The
    counters' cost measures a second one, ``dpconfig.REV_NAME``, the other way between the loaded nodes.)"""
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": TARGET_NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [
                {"name": "tcp", "protocol": "TCP", "port": SERVICE_PORT, "targetPort": ECHO_PORT},
                {"name": "udp", "protocol": "UDP", "port": SERVICE_PORT, "targetPort": ECHO_PORT},
                {"name": "iperf", "protocol": "TCP", "port": IPERF_PORT, "targetPort": IPERF_PORT},
            ],
        },
    }
    eps = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-1",
            "namespace": TARGET_NAMESPACE,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod.ip4],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": pod.node,
                "targetRef": {"kind": "Pod", "namespace": TARGET_NAMESPACE, "name": pod.name},
            }
        ],
        "ports": [
            {"name": "tcp", "protocol": "TCP", "port": ECHO_PORT},
            {"name": "udp", "protocol": "UDP", "port": ECHO_PORT},
            {"name": "iperf", "protocol": "TCP", "port": IPERF_PORT},
        ],
    }
    return [svc, eps]


def _collection_path(obj: dict[str, Any]) -> str:
    ns = obj["metadata"]["namespace"]
    if obj["kind"] == "Service":
        return f"/api/v1/namespaces/{ns}/services"
    return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


class ApiWriter:
    """Creates objects through the API stand-in's HTTP API with a few keep-alive connections."""

    def __init__(self, api_url: str, threads: int = WRITE_THREADS) -> None:
        u = urlsplit(api_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.threads = threads
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []  # every thread's, closed when create_all ends
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def create(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj)
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request("POST", _collection_path(obj), body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status in (200, 201, 409):  # 409: already there from an earlier size
                return
            raise DatapathError(
                f"the lab API refused {obj['kind']} {obj['metadata']['name']}: {resp.status} {data[:300]!r}"
            )

    def create_all(self, objs: Iterable[dict[str, Any]]) -> int:
        n = 0
        try:
            with ThreadPoolExecutor(max_workers=self.threads) as pool:
                for _ in pool.map(self.create, objs):
                    n += 1
        finally:
            with self._lock:
                for conn in self._opened:
                    conn.close()
                self._opened.clear()
        return n


#: addresses the bench's own objects hold (its target's ClusterIP, the NAT floor's rule), never a synthetic service's
RESERVED_IPS = frozenset({TARGET_CLUSTER_IP, "198.19.255.253", "198.19.255.254"})
#: the synthetic indexes with those addresses (the first /16 of the synthetic blocks: index = offset in 198.19/16)
_RESERVED = sorted(
    int(ip.split(".")[2]) * 256 + int(ip.split(".")[3]) for ip in RESERVED_IPS if ip.startswith("198.19.")
)


def synthetic_index(k: int) -> int:
    """The synthetic set's index of the ``k``-th service the bench programs, skipping those whose ClusterIP the bench
    reserves (at 100,000 services the synthetic set reaches 198.19.200.10, the target's own)."""
    for r in _RESERVED:
        if r <= k:
            k += 1
    return k


def synthetic_objects(first: int, last: int, endpoints: int) -> Iterable[dict[str, Any]]:
    """Services ``first..last`` of the synthetic set (and their slices), as the API's create takes them, none on a
    reserved address."""
    for k in range(first, last + 1):
        i = synthetic_index(k)
        yield _strip(synthetic.service(i))
        yield _strip(synthetic.endpoint_slice(i, endpoints))
