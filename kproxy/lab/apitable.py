"""The API stand-in's Table view: what `kubectl get` prints, computed on the server as kube-apiserver does.

kubectl asks for lists and objects with ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io,...`` and prints
the columns the server sends (server-side printing); without them it falls back to NAME and AGE. So that
``kubectl get svc`` in the lab reads as on a real cluster, the stand-in answers that request with a
``meta.k8s.io/v1`` ``Table`` whose columns and cells follow upstream's printers
(``kubernetes/kubernetes:pkg/printers/internalversion/printers.go``, printed with ``Wide: true`` as the server
does; kubectl hides the priority-1 columns unless ``-o wide``):

- Services: NAME, TYPE, CLUSTER-IP, EXTERNAL-IP, PORT(S), AGE, and SELECTOR (wide). Ports read ``80/TCP`` or
  ``80:30080/TCP`` with a nodePort; the external IP is ``<none>``, the externalIPs, or for a LoadBalancer its
  ingress IPs/hostnames (then externalIPs) or ``<pending>``; an ExternalName shows its name.
- EndpointSlices: NAME, ADDRESSTYPE, PORTS, ENDPOINTS, AGE (three ports/addresses, then ``+ N more...``).
- Nodes: NAME, STATUS, ROLES, AGE, VERSION, and INTERNAL-IP, EXTERNAL-IP, OS-IMAGE, KERNEL-VERSION,
  CONTAINER-RUNTIME (wide).
- Every other kind: NAME, AGE.

Each row carries the object as ``includeObject`` asks (``None``, ``Metadata`` by default: a
``PartialObjectMetadata``, which kubectl reads for ``-A``'s NAMESPACE column and ``--show-labels``, or ``Object``).

Pure; imports ``kproxy.lab.apistore`` for ``Resource``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from kproxy.lab.apistore import Resource, object_meta

TABLE_GROUP = "meta.k8s.io"
TABLE_VERSIONS = ("v1", "v1beta1")

_NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}
_AGE_DESCRIPTION = "CreationTimestamp is a timestamp representing the server time when this object was created."

Column = dict[str, Any]


def _column(name: str, description: str, priority: int = 0) -> Column:
    return {"name": name, "type": "string", "format": "", "description": description, "priority": priority}


def table_version(accept: str | None) -> str | None:
    """The meta.k8s.io version of Table the Accept header asks for first, or None when it asks for none."""
    for media_range in (accept or "").split(","):
        kind, *raw_params = (part.strip() for part in media_range.split(";"))
        if kind not in ("application/json", "*/*"):
            continue
        params = dict(p.partition("=")[::2] for p in raw_params)
        if params.get("as") == "Table" and params.get("g") == TABLE_GROUP and params.get("v") in TABLE_VERSIONS:
            return params["v"]
    return None


def human_age(created: str | None, now: float) -> str:
    """An object's age as kubectl shows it (apimachinery's ``duration.HumanDuration``)."""
    if not created:
        return "<unknown>"
    try:
        stamp = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    seconds = int(now - stamp.timestamp())
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    years = days // 365
    if hours < 24 * 365 * 8:
        return f"{years}y{days % 365}d" if days % 365 else f"{years}y"
    return f"{years}y"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sequence(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


# --------------------------------------------------------------------------------------------------------------------
# Services


def service_ports(ports: Iterable[Any]) -> str:
    """``80/TCP,443:30443/TCP``: upstream's makePortString."""
    pieces = []
    for port in ports:
        port = _mapping(port)
        proto = port.get("protocol") or "TCP"
        if port.get("nodePort"):
            pieces.append(f"{port.get('port')}:{port['nodePort']}/{proto}")
        else:
            pieces.append(f"{port.get('port')}/{proto}")
    return ",".join(pieces)


def service_external_ip(svc: Mapping[str, Any]) -> str:
    """Upstream's getServiceExternalIP (wide, as the server prints it: load-balancer addresses are not cut)."""
    spec, status = _mapping(svc.get("spec")), _mapping(svc.get("status"))
    typ = spec.get("type") or "ClusterIP"
    external = [str(ip) for ip in _sequence(spec.get("externalIPs"))]
    if typ in ("ClusterIP", "NodePort"):
        return ",".join(external) or "<none>"
    if typ == "LoadBalancer":
        ingress = set()
        for entry in _sequence(_mapping(status.get("loadBalancer")).get("ingress")):
            entry = _mapping(entry)
            if entry.get("ip"):
                ingress.add(str(entry["ip"]))
            elif entry.get("hostname"):
                ingress.add(str(entry["hostname"]))
        return ",".join([*sorted(ingress), *external]) or "<pending>"
    if typ == "ExternalName":
        return str(spec.get("externalName") or "")
    return "<unknown>"


def _service_row(svc: Mapping[str, Any], now: float) -> list[Any]:
    spec = _mapping(svc.get("spec"))
    meta = object_meta(svc)
    cluster_ips = _sequence(spec.get("clusterIPs"))
    selector = _mapping(spec.get("selector"))
    return [
        meta.get("name", ""),
        spec.get("type") or "ClusterIP",
        str(cluster_ips[0]) if cluster_ips else "<none>",
        service_external_ip(svc),
        service_ports(_sequence(spec.get("ports"))) or "<none>",
        human_age(meta.get("creationTimestamp"), now),
        ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "<none>",
    ]


_SERVICE_COLUMNS = [
    _NAME,
    _column("Type", "type determines how the Service is exposed."),
    _column("Cluster-IP", "clusterIP is the IP address of the service."),
    _column("External-IP", "externalIPs: addresses for which nodes in the cluster also accept this service's traffic."),
    _column("Port(s)", "The list of ports that are exposed by this service."),
    _column("Age", _AGE_DESCRIPTION),
    _column("Selector", "Route service traffic to pods with label keys and values matching this selector.", 1),
]


# --------------------------------------------------------------------------------------------------------------------
# EndpointSlices


def _with_more(items: list[str], count: int, most: int = 3) -> str:
    """Upstream's listWithMoreString: the first three, then ``+ N more...``; ``<unset>`` for none."""
    text = ",".join(items[:most])
    if count > most:
        return f"{text} + {count - most} more..."
    return text or "<unset>"


def _slice_row(sl: Mapping[str, Any], now: float) -> list[Any]:
    meta = object_meta(sl)
    ports = []
    for port in _sequence(sl.get("ports")):
        port = _mapping(port)
        ports.append(str(port["port"]) if port.get("port") is not None else str(port.get("name") or "*"))
    addresses = [str(a) for ep in _sequence(sl.get("endpoints")) for a in _sequence(_mapping(ep).get("addresses"))]
    return [
        meta.get("name", ""),
        sl.get("addressType", ""),
        _with_more(ports, len(ports)),
        _with_more(addresses, len(addresses)),
        human_age(meta.get("creationTimestamp"), now),
    ]


_SLICE_COLUMNS = [
    _NAME,
    _column("AddressType", "addressType specifies the type of address carried by this EndpointSlice."),
    _column("Ports", "ports specifies the list of network ports exposed by each endpoint in this slice."),
    _column("Endpoints", "endpoints is a list of unique endpoints in this slice."),
    _column("Age", _AGE_DESCRIPTION),
]


# --------------------------------------------------------------------------------------------------------------------
# Nodes

_ROLE_PREFIX = "node-role.kubernetes.io/"


def _node_row(node: Mapping[str, Any], now: float) -> list[Any]:
    meta, spec, status = object_meta(node), _mapping(node.get("spec")), _mapping(node.get("status"))
    state = []
    for cond in _sequence(status.get("conditions")):
        cond = _mapping(cond)
        if cond.get("type") == "Ready":
            state = ["Ready" if cond.get("status") == "True" else "NotReady"]
    if not state:
        state = ["Unknown"]
    if spec.get("unschedulable"):
        state.append("SchedulingDisabled")
    roles = set()
    for key, value in _mapping(meta.get("labels")).items():
        if key.startswith(_ROLE_PREFIX) and key[len(_ROLE_PREFIX) :]:
            roles.add(key[len(_ROLE_PREFIX) :])
        elif key == "kubernetes.io/role" and value:
            roles.add(str(value))
    info = _mapping(status.get("nodeInfo"))

    def address(kind: str) -> str:
        for entry in _sequence(status.get("addresses")):
            entry = _mapping(entry)
            if entry.get("type") == kind:
                return str(entry.get("address", ""))
        return "<none>"

    return [
        meta.get("name", ""),
        ",".join(state),
        ",".join(sorted(roles)) or "<none>",
        human_age(meta.get("creationTimestamp"), now),
        info.get("kubeletVersion", ""),
        address("InternalIP"),
        address("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


_NODE_COLUMNS = [
    _NAME,
    _column("Status", "The status of the node"),
    _column("Roles", "The roles of the node"),
    _column("Age", _AGE_DESCRIPTION),
    _column("Version", "Kubelet Version reported by the node."),
    _column("Internal-IP", "List of addresses reachable to the node.", 1),
    _column("External-IP", "List of addresses reachable to the node.", 1),
    _column("OS-Image", "OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy)).", 1),
    _column("Kernel-Version", "Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).", 1),
    _column("Container-Runtime", "ContainerRuntime Version reported by the node through runtime remote API.", 1),
]


# --------------------------------------------------------------------------------------------------------------------
# Any other kind, and the Table itself


def _generic_row(obj: Mapping[str, Any], now: float) -> list[Any]:
    meta = object_meta(obj)
    return [meta.get("name", ""), human_age(meta.get("creationTimestamp"), now)]


_GENERIC_COLUMNS = [_NAME, _column("Age", _AGE_DESCRIPTION)]

_PRINTERS: dict[str, tuple[list[Column], Callable[[Mapping[str, Any], float], list[Any]]]] = {
    "services": (_SERVICE_COLUMNS, _service_row),
    "endpointslices": (_SLICE_COLUMNS, _slice_row),
    "nodes": (_NODE_COLUMNS, _node_row),
}

INCLUDE_OBJECT = ("None", "Metadata", "Object")


def _row_object(res: Resource, obj: Mapping[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return {"kind": res.kind, "apiVersion": res.api_version, **obj}
    return {"kind": "PartialObjectMetadata", "apiVersion": f"{TABLE_GROUP}/v1", "metadata": object_meta(obj)}


def table(
    res: Resource,
    objects: Iterable[Mapping[str, Any]],
    list_meta: Mapping[str, Any],
    *,
    version: str = "v1",
    include_object: str = "Metadata",
    headers: bool = True,
    now: float | None = None,
) -> dict[str, Any]:
    """A ``meta.k8s.io`` Table of ``objects`` of resource ``res``. ``headers=False`` leaves the column definitions
    out (the real server sends them only with a watch's first event)."""
    columns, row = _PRINTERS.get(res.key, (_GENERIC_COLUMNS, _generic_row))
    at = datetime.now(timezone.utc).timestamp() if now is None else now
    rows = []
    for obj in objects:
        entry: dict[str, Any] = {"cells": row(obj, at)}
        embedded = _row_object(res, obj, include_object)
        if embedded is not None:
            entry["object"] = embedded
        rows.append(entry)
    return {
        "kind": "Table",
        "apiVersion": f"{TABLE_GROUP}/{version}",
        "metadata": dict(list_meta),
        "columnDefinitions": [dict(c) for c in columns] if headers else [],
        "rows": rows,
    }
