"""Builders of Kubernetes-shaped Service / EndpointSlice / Node dicts for the cache tests (not a test module)."""

from __future__ import annotations

from typing import Any

NODE = "node-a"


def service(
    name: str = "web",
    namespace: str = "default",
    *,
    cluster_ip: str | list[str] = "198.18.0.10",
    ports: list[dict[str, Any]] | None = None,
    type_: str = "ClusterIP",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    ips = [cluster_ip] if isinstance(cluster_ip, str) else cluster_ip
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "resourceVersion": "1"}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    body: dict[str, Any] = {
        "type": type_,
        "clusterIP": ips[0] if ips else "",
        "clusterIPs": ips,
        "ports": ports if ports is not None else [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
    }
    body.update(spec)
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}
    if status is not None:
        obj["status"] = status
    return obj


def endpoint(
    ip: str,
    *,
    node: str | None = "node-b",
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zone: str | None = None,
    for_zones: list[str] | None = None,
    for_nodes: list[str] | None = None,
) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [ip], "conditions": {}}
    for key, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if value is not None:
            ep["conditions"][key] = value
    if node is not None:
        ep["nodeName"] = node
    if zone is not None:
        ep["zone"] = zone
    if for_zones is not None or for_nodes is not None:
        ep["hints"] = {}
        if for_zones is not None:
            ep["hints"]["forZones"] = [{"name": z} for z in for_zones]
        if for_nodes is not None:
            ep["hints"]["forNodes"] = [{"name": n} for n in for_nodes]
    return ep


def endpoint_slice(
    name: str = "web-abc",
    namespace: str = "default",
    *,
    service_name: str | None = "web",
    address_type: str = "IPv4",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if service_name is not None:
        meta["labels"] = {"kubernetes.io/service-name": service_name}
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": address_type,
        "endpoints": endpoints if endpoints is not None else [endpoint("198.18.1.1")],
        "ports": ports if ports is not None else [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def node(
    name: str = NODE,
    *,
    zone: str | None = None,
    labels: dict[str, str] | None = None,
    pod_cidrs: list[str] | None = None,
    deleting: bool = False,
    taints: list[dict[str, str]] | None = None,
    addresses: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    all_labels = dict(labels or {})
    if zone is not None:
        all_labels["topology.kubernetes.io/zone"] = zone
    meta: dict[str, Any] = {"name": name, "labels": all_labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "spec": {"podCIDRs": pod_cidrs or [], "taints": taints or []},
        "status": {"addresses": addresses or []},
    }
