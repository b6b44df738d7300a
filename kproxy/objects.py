"""What the Kubernetes objects the proxy reads are called, which ones are not ours, and this node's Node.

Shared by the two parsers below the cache (``kproxy.serviceport`` for Services, ``kproxy.endpointslices`` for
EndpointSlices): the well-known labels and annotations, the ``Ignored`` signal for an object that is valid but not
for this proxy (upstream's ``ShouldSkipService`` and the address-type filter), a best-effort name of any object for
logs and ``ServiceCache.errors()`` (even a malformed one), and ``parse_node`` (the few fields of this node's Node
that the proxy reads: labels for topology, pod CIDRs and addresses, and whether it is being deleted).

Pure; imports only ``validation`` and ``model``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

from kproxy import validation as v
from kproxy.model import NodeInfo

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_ZONE = "topology.kubernetes.io/zone"
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"


#: every object names its namespace, and a cluster has few: each checked once (a DNS-1123 label) and shared
NAMESPACES = v.Known(v.dns1123_label, 4096)


class Ignored(Exception):
    """The object is valid but not ours (labels, headless, ExternalName, FQDN, another family)."""


def clip(text: str) -> str:
    """A name for a log line: bounded, and with control characters escaped (a newline in a name from the manifest
    folder must not forge a line)."""
    if len(text) > 100:
        return f"{v.printable(text[:80])}...({len(text)} chars)"
    return v.printable(text)


def label(kind: str, namespace: str, name: str) -> str:
    """``"Service ns/name"``: how an object is named in logs and in ``errors()``."""
    return f"{kind} {clip(namespace)}/{clip(name)}"


def object_name(obj: Any) -> tuple[str, str]:
    """Best-effort (namespace, name) of an object, even when it is malformed (``"?"`` for what is missing); no label
    is built (a list's every object needs its name, only a rejected one a label)."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    ns = name = "?"
    if isinstance(meta, Mapping):
        if isinstance(meta.get("namespace"), str):
            ns = meta["namespace"]
        if isinstance(meta.get("name"), str):
            name = meta["name"]
    return ns, name


def object_label(kind: str, obj: Any) -> tuple[str, str, str]:
    """Best-effort (label, namespace, name) of an object for logs and ``errors()``, even when it is malformed."""
    ns, name = object_name(obj)
    return label(kind, ns, name), ns, name


def parse_time(text: str) -> float | None:
    """An RFC 3339 time stamp into epoch seconds; None when it is not one."""
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def parse_node(obj: Mapping[str, Any]) -> NodeInfo:
    """A Node object into NodeInfo; ValueError when bad."""
    obj = v.mapping(obj, "Node")
    meta = v.mapping(obj.get("metadata"), "metadata")
    name = v.dns1123_subdomain(meta.get("name"), "metadata.name")
    labels = v.string_map(meta.get("labels"), "metadata.labels")
    spec = v.optional_mapping(obj.get("spec"), "spec")
    raw_cidrs = v.optional_sequence(spec.get("podCIDRs"), "spec.podCIDRs")
    if not raw_cidrs and spec.get("podCIDR"):
        raw_cidrs = [spec.get("podCIDR")]
    pod_cidrs = tuple(v.cidr(c, f"spec.podCIDRs[{i}]")[0] for i, c in enumerate(raw_cidrs))
    eligible = not meta.get("deletionTimestamp")
    for i, raw in enumerate(v.optional_sequence(spec.get("taints"), "spec.taints")):
        taint = v.mapping(raw, f"spec.taints[{i}]")
        if v.optional_string(taint.get("key"), f"spec.taints[{i}].key") == TAINT_TO_BE_DELETED:
            eligible = False
    status = v.optional_mapping(obj.get("status"), "status")
    addresses = []
    for i, raw in enumerate(v.optional_sequence(status.get("addresses"), "status.addresses")):
        entry = v.mapping(raw, f"status.addresses[{i}]")
        if entry.get("type") in ("InternalIP", "ExternalIP"):
            addresses.append(v.ip_address(entry.get("address"), f"status.addresses[{i}].address")[0])
    return NodeInfo(
        name=name,
        labels=MappingProxyType(labels),
        zone=labels.get(LABEL_ZONE) or None,
        pod_cidrs=pod_cidrs,
        addresses=tuple(dict.fromkeys(addresses)),
        eligible=eligible,
    )
