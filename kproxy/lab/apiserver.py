"""An in-memory stand-in for kube-apiserver: the API kproxy watches, for the lab and for tests.

There is no kube-apiserver on the development machine (see HOST.md), so the lab cluster, the conformance suite and
the source/reflector tests talk to this server instead. It speaks enough of the real protocol for the OFFICIAL
`kubernetes` Python client (CoreV1Api, DiscoveryV1Api, EventsV1Api) and for kproxy's reflectors:

- Services (with the /status subresource), discovery.k8s.io/v1 EndpointSlices, Nodes (with /status), core and
  events.k8s.io/v1 Events; list (labelSelector, fieldSelector metadata.name/metadata.namespace, limit/continue with
  consistent snapshots, resourceVersion + resourceVersionMatch), get, create, replace, merge/strategic/JSON patch,
  delete — with the real server's Status bodies (404 NotFound, 409 AlreadyExists/Conflict, 410 Expired, 422 Invalid).
- watch=true as chunked JSON lines: ADDED/MODIFIED/DELETED from a resourceVersion, BOOKMARKs every few seconds and
  before a timeout closes the stream, objects leaving a label selector sent as DELETED and entering it as ADDED
  (as the watch cache does), an ERROR event with a 410 Expired Status for a resourceVersion older than the kept
  history (`history` events; `compact()` drops it).
- Services get the server's defaults (type, ports' protocol/targetPort, traffic policies) and allocations (clusterIP
  from `service_cidrs`, nodePorts, healthCheckNodePort), so tests may create minimal manifests.
- Fault injection (`Faults`, also over HTTP at /_faults) for reliability tests: drop watches after N events or T
  seconds, fail requests with 500/503, delay requests, compact history; every request is logged (`requests`).

One process may listen on several sockets, each optionally inside a named network namespace, so the lab's nodes and
the test process on 127.0.0.1 reach the same store. Run as `kproxy apiserver` (see `register`) or
`python -m kproxy.lab.apiserver`.
"""

from __future__ import annotations

import argparse
import base64
import collections
import copy
import ipaddress
import json
import logging
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from kproxy.sources.selectors import SelectorError, field_matcher, label_matcher

log = logging.getLogger(__name__)

DEFAULT_HISTORY = 10000
DEFAULT_SERVICE_CIDRS = ("198.19.128.0/17", "fd00:198:18:ffff::/112")
NODE_PORT_RANGE = (30000, 32767)


# --------------------------------------------------------------------------------------------------------------------
# Resources


@dataclass(frozen=True, slots=True)
class Resource:
    key: str  # store key, also what Store's Python methods take
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES: dict[str, Resource] = {
    r.key: r
    for r in (
        Resource("services", "", "v1", "services", "Service", True, True),
        Resource("endpointslices", "discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True, False),
        Resource("nodes", "", "v1", "nodes", "Node", False, True),
        Resource("events", "", "v1", "events", "Event", True, False),
        Resource("events.k8s.io", "events.k8s.io", "v1", "events", "Event", True, False),
    )
}
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES.values()}
_BY_KIND = {(r.api_version, r.kind): r for r in RESOURCES.values()}
_ALIASES = {"service": "services", "endpointslice": "endpointslices", "node": "nodes", "event": "events"}


def resource_for(name_or_obj: str | Mapping[str, Any]) -> Resource:
    """Resolve "services" / "Service" / an object with apiVersion+kind to its Resource."""
    if isinstance(name_or_obj, Mapping):
        key = (str(name_or_obj.get("apiVersion", "")), str(name_or_obj.get("kind", "")))
        if key not in _BY_KIND:
            raise ApiError(400, "BadRequest", f"no kind {key[1]!r} is registered for version {key[0]!r}")
        return _BY_KIND[key]
    name = name_or_obj.lower()
    name = _ALIASES.get(name, name)
    if name not in RESOURCES:
        raise KeyError(f"unknown resource {name_or_obj!r}")
    return RESOURCES[name]


class ApiError(Exception):
    """An API failure; the HTTP layer turns it into a Status body with this code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message, self.details)


def status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 300 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    if code < 300:
        del body["message"], body["reason"]
    return body


def _not_found(res: Resource, name: str) -> ApiError:
    group_res = f"{res.plural}.{res.group}" if res.group else res.plural
    return ApiError(
        404, "NotFound", f'{group_res} "{name}" not found', {"name": name, "group": res.group, "kind": res.plural}
    )


def _ns_key(res: Resource, namespace: str | None) -> str:
    return (namespace or "default") if res.namespaced else ""


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------------------------------
# Patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic merge patch: lists are replaced, not merged)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test, copy, move."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "JSON patch must be a list of operations")
    doc = copy.deepcopy(target)

    def parent(parts: list[str]) -> tuple[Any, str]:
        node = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node, parts[-1]

    def get(parts: list[str]) -> Any:
        node = doc
        for p in parts:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node

    def add(parts: list[str], value: Any) -> None:
        node, last = parent(parts)
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), value)
        else:
            node[last] = value

    def remove(parts: list[str]) -> Any:
        node, last = parent(parts)
        return node.pop(int(last)) if isinstance(node, list) else node.pop(last)

    try:
        for op in ops:
            kind, parts = op["op"], _pointer(op["path"])
            if kind == "add":
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(parts)
            elif kind == "replace":
                remove(parts)
                add(parts, copy.deepcopy(op["value"]))
            elif kind == "test":
                if get(parts) != op["value"]:
                    raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
            elif kind in ("copy", "move"):
                src = _pointer(op["from"])
                value = copy.deepcopy(get(src))
                if kind == "move":
                    remove(src)
                add(parts, value)
            else:
                raise ApiError(400, "BadRequest", f"unknown JSON patch operation {kind!r}")
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        raise ApiError(422, "Invalid", f"JSON patch failed: {exc!r}") from exc
    return doc


# --------------------------------------------------------------------------------------------------------------------
# The store


class WatchEvent(NamedTuple):
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]  # stored objects are never mutated once stored, so events share them
    old: dict[str, Any] | None


ObjectList = list[dict[str, Any]]  # named here because Store.list shadows the builtin inside the class


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


class Store:
    """The objects, one global resourceVersion counter and the watch history. Thread-safe.

    Stored objects are treated as immutable: every change stores a new dict, so lists and watch streams can
    serialise them outside the lock. The Python methods take and return deep copies.
    """

    def __init__(self, history: int = DEFAULT_HISTORY, service_cidrs: Iterable[str] = DEFAULT_SERVICE_CIDRS) -> None:
        self.cond = threading.Condition()
        self.history = max(1, int(history))
        self._rv = 1000
        self._floor = self._rv  # a watch from rv >= floor can be served from history
        self._events: collections.deque[WatchEvent] = collections.deque()
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in RESOURCES}
        self._nets = [ipaddress.ip_network(c) for c in service_cidrs]
        self._ips_used: set[str] = set()
        self._ports_used: set[int] = set()
        self._ip_cursor: dict[int, int] = {}
        self.closed = False

    # --- reading

    @property
    def resource_version(self) -> int:
        with self.cond:
            return self._rv

    @property
    def floor(self) -> int:
        with self.cond:
            return self._floor

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any]:
        res = resource_for(resource)
        with self.cond:
            obj = self._objects[res.key].get((_ns_key(res, namespace), name))
        if obj is None:
            raise _not_found(res, name)
        return copy.deepcopy(obj)

    def list(
        self,
        resource: str,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
    ) -> tuple[list[dict[str, Any]], int]:
        """(deep copies of the matching objects, the resourceVersion of that state)."""
        items, rv = self.snapshot(resource_for(resource), namespace, _matcher(label_selector, field_selector))
        return copy.deepcopy(items), rv

    def snapshot(
        self,
        res: Resource,
        namespace: str | None,
        match: Callable[[Mapping[str, Any]], bool],
        at_rv: int | None = None,
    ) -> tuple[ObjectList, int]:
        """Matching stored objects (shared, do not mutate) sorted by namespace/name, at `at_rv` or now."""
        with self.cond:
            current = self._rv
            if at_rv is None or at_rv == current:
                state = dict(self._objects[res.key])
                rv = current
            else:
                if at_rv < self._floor:
                    raise ApiError(410, "Expired", f"too old resource version: {at_rv} ({self._floor})")
                if at_rv > current:
                    raise ApiError(
                        504,
                        "Timeout",
                        f"Too large resource version: {at_rv}, current: {current}",
                        {"retryAfterSeconds": 1},
                    )
                state = dict(self._objects[res.key])
                # Undo, newest first, every event after at_rv: the state as it was at that resourceVersion.
                for ev in reversed(self._events):
                    if ev.rv <= at_rv:
                        break
                    if ev.resource != res.key:
                        continue
                    key = (_meta(ev.obj).get("namespace", ""), _meta(ev.obj).get("name", ""))
                    if ev.type == "ADDED":
                        state.pop(key, None)
                    else:
                        state[key] = ev.old if ev.old is not None else ev.obj
                rv = at_rv
        items = [
            obj for (ns, _name), obj in sorted(state.items()) if (namespace is None or ns == namespace) and match(obj)
        ]
        return items, rv

    def events_after(self, rv: int) -> tuple[Sequence[WatchEvent], int] | None:
        """Events with resourceVersion > rv and the current resourceVersion; None if rv is older than the history.

        The caller holds `cond`.
        """
        if rv < self._floor:
            return None
        if rv >= self._rv:
            return [], self._rv
        first = self._events[0].rv  # resourceVersions in the history are contiguous: one per change
        start = rv + 1 - first
        return [self._events[i] for i in range(start, len(self._events))], self._rv

    # --- writing

    def _bump(self, res: Resource, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        self._events.append(WatchEvent(self._rv, res.key, type_, obj, old))
        while len(self._events) > self.history:
            self._floor = self._events.popleft().rv
        self.cond.notify_all()

    def compact(self) -> int:
        """Drop all watch history: any watch from an older resourceVersion now gets 410 Expired."""
        with self.cond:
            self._events.clear()
            self._floor = self._rv
            self.cond.notify_all()
            return self._rv

    def _key(self, res: Resource, obj: Mapping[str, Any], namespace: str | None) -> tuple[str, str]:
        meta = _meta(obj)
        name = meta.get("name")
        if not name or not isinstance(name, str):
            raise ApiError(422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value")
        if not res.namespaced:
            return "", name
        ns = namespace or meta.get("namespace") or "default"
        if meta.get("namespace") and namespace and meta["namespace"] != namespace:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        return ns, name

    def create(self, obj: Mapping[str, Any], *, resource: str | None = None, namespace: str | None = None) -> dict:
        res = resource_for(resource or obj)
        new = copy.deepcopy(dict(obj))
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        meta = new.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        with self.cond:
            ns, name = self._key(res, new, namespace)
            if (ns, name) in self._objects[res.key]:
                group_res = f"{res.plural}.{res.group}" if res.group else res.plural
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{group_res} "{name}" already exists',
                    {"name": name, "group": res.group, "kind": res.plural},
                )
            if res.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            if res.key == "services":
                self._default_service(new, None)
            self._rv += 1
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta["resourceVersion"] = str(self._rv)
            meta.pop("deletionTimestamp", None)
            self._objects[res.key][(ns, name)] = new
            self._bump(res, "ADDED", new, None)
            return copy.deepcopy(new)

    def update(
        self,
        obj: Mapping[str, Any],
        *,
        resource: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Replace an object (PUT). A resourceVersion in `obj` must match the stored one (else 409 Conflict).

        Without a subresource, the status of kinds with a /status subresource is kept; with "status", only the
        status changes. An update that changes nothing returns the stored object without a new resourceVersion.
        """
        res = resource_for(resource or obj)
        new = copy.deepcopy(dict(obj))
        with self.cond:
            ns, name = self._key(res, new, namespace)
            old = self._objects[res.key].get((ns, name))
            if old is None:
                raise _not_found(res, name)
            return self._replace(res, old, new, subresource)

    def _replace(
        self, res: Resource, old: dict[str, Any], new: dict[str, Any], subresource: str | None
    ) -> dict[str, Any]:
        old_meta, meta = _meta(old), new.setdefault("metadata", {})
        name = old_meta["name"]
        given_rv = meta.get("resourceVersion")
        if given_rv and str(given_rv) != old_meta["resourceVersion"]:
            group_res = f"{res.plural}.{res.group}" if res.group else res.plural
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {group_res} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                {"name": name, "group": res.group, "kind": res.plural},
            )
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        for key in ("uid", "creationTimestamp", "namespace", "name"):
            if key in old_meta:
                meta[key] = old_meta[key]
        if res.status_subresource:
            if subresource == "status":
                new = {**old, "status": new.get("status", {})}
                new["metadata"] = dict(old_meta)
                meta = new["metadata"]
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        if res.key == "services" and subresource != "status":
            self._default_service(new, old)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._objects[res.key][(old_meta.get("namespace", ""), name)] = new
        self._bump(res, "MODIFIED", new, old)
        return copy.deepcopy(new)

    def patch(
        self,
        resource: str,
        namespace: str | None,
        name: str,
        patch: Any,
        patch_type: str = "application/merge-patch+json",
        subresource: str | None = None,
    ) -> dict[str, Any]:
        res = resource_for(resource)
        with self.cond:
            old = self._objects[res.key].get((_ns_key(res, namespace), name))
            if old is None:
                raise _not_found(res, name)
            if patch_type.startswith("application/json-patch+json"):
                new = json_patch(old, patch)  # works on its own deep copy
            elif patch_type.split(";")[0].strip() in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
                "application/apply-patch+yaml",
            ):
                if not isinstance(patch, Mapping):
                    raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
                new = merge_patch(copy.deepcopy(old), patch)
            else:
                raise ApiError(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {patch_type}"
                )
            if not isinstance(new, dict):
                raise ApiError(422, "Invalid", "patch did not produce an object")
            # A patch carries the resourceVersion precondition only if it sets one explicitly.
            patch_rv = _meta(patch).get("resourceVersion") if isinstance(patch, Mapping) else None
            meta = new.setdefault("metadata", {})
            if patch_rv is None:
                meta.pop("resourceVersion", None)
            return self._replace(res, old, new, subresource)

    def delete(self, resource: str, namespace: str | None, name: str) -> dict[str, Any]:
        res = resource_for(resource)
        with self.cond:
            key = (_ns_key(res, namespace), name)
            old = self._objects[res.key].pop(key, None)
            if old is None:
                raise _not_found(res, name)
            if res.key == "services":
                self._release(old)
            self._rv += 1
            gone = copy.deepcopy(old)
            _meta(gone)["resourceVersion"] = str(self._rv)
            self._bump(res, "DELETED", gone, old)
            return copy.deepcopy(gone)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create the object, or replace it (ignoring resourceVersion) if it exists: handy for tests and --load."""
        res = resource_for(obj)
        try:
            return self.create(obj)
        except ApiError as exc:
            if exc.code != 409:
                raise
        new = copy.deepcopy(dict(obj))
        _meta(new).pop("resourceVersion", None)
        updated = self.update(new, resource=res.key)
        if res.status_subresource and "status" in obj:
            updated["status"] = obj["status"]
            updated = self.update(updated, resource=res.key, subresource="status")
        return updated

    # --- Service defaults and allocations, as the real registry does them

    def _default_service(self, svc: dict[str, Any], old: dict[str, Any] | None) -> None:
        spec = svc.setdefault("spec", {})
        old_spec = (old or {}).get("spec", {})
        typ = spec.setdefault("type", "ClusterIP")
        if typ == "ExternalName":
            # ExternalName services have no cluster IP or node ports; give back any the old version held.
            if old is not None:
                self._release(old)
            for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy", "healthCheckNodePort"):
                spec.pop(key, None)
            for port in spec.get("ports") or []:
                port.pop("nodePort", None)
            return
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        if old is not None:
            # Allocated values that an update leaves out are kept (the registry's patchAllocatedValues).
            for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy", "healthCheckNodePort"):
                if key in old_spec and not spec.get(key):
                    spec[key] = old_spec[key]
            old_ports = {(p.get("port"), p.get("protocol")): p.get("nodePort") for p in old_spec.get("ports") or []}
            for port in spec.get("ports") or []:
                if not port.get("nodePort") and old_ports.get((port.get("port"), port.get("protocol"))):
                    port["nodePort"] = old_ports[(port.get("port"), port.get("protocol"))]
            if old_spec.get("clusterIP") and spec.get("clusterIP") != old_spec.get("clusterIP"):
                raise ApiError(
                    422,
                    "Invalid",
                    f'Service "{_meta(svc).get("name")}" is invalid: spec.clusterIPs[0]: field is immutable',
                )
            self._release(old)
        try:
            self._allocate(svc, typ)
        except ApiError:
            if old is not None:
                self._claim(old)
            raise

    def _claim(self, svc: Mapping[str, Any]) -> None:
        spec = svc.get("spec") or {}
        for ip in spec.get("clusterIPs") or []:
            if ip and ip != "None":
                self._ips_used.add(ip)
        for port in spec.get("ports") or []:
            if port.get("nodePort"):
                self._ports_used.add(int(port["nodePort"]))
        if spec.get("healthCheckNodePort"):
            self._ports_used.add(int(spec["healthCheckNodePort"]))

    def _release(self, svc: Mapping[str, Any]) -> None:
        spec = svc.get("spec") or {}
        for ip in spec.get("clusterIPs") or []:
            self._ips_used.discard(ip)
        for port in spec.get("ports") or []:
            if port.get("nodePort"):
                self._ports_used.discard(int(port["nodePort"]))
        if spec.get("healthCheckNodePort"):
            self._ports_used.discard(int(spec["healthCheckNodePort"]))

    def _allocate(self, svc: dict[str, Any], typ: str) -> None:
        spec = svc["spec"]
        name = _meta(svc).get("name")
        ips = [ip for ip in spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])]
        if ips and ips[0] != "None":
            for ip in ips:
                if ip in self._ips_used:
                    raise ApiError(
                        422,
                        "Invalid",
                        f'Service "{name}" is invalid: spec.clusterIPs: Invalid value: "{ip}": '
                        "provided IP is already allocated",
                    )
        new_ports: list[int] = []
        try:
            if not ips:
                families = spec.get("ipFamilies") or ["IPv4"]
                if spec.get("ipFamilyPolicy") in ("PreferDualStack", "RequireDualStack") and len(families) == 1:
                    families = [families[0], "IPv6" if families[0] == "IPv4" else "IPv4"]
                ips = [self._next_ip(4 if f == "IPv4" else 6) for f in families]
            if ips[0] != "None":
                spec["clusterIP"], spec["clusterIPs"] = ips[0], ips
                spec["ipFamilies"] = ["IPv6" if ":" in ip else "IPv4" for ip in ips]
                spec.setdefault("ipFamilyPolicy", "RequireDualStack" if len(ips) > 1 else "SingleStack")
                self._ips_used.update(ips)
            else:
                spec["clusterIP"], spec["clusterIPs"] = "None", ["None"]
                spec.setdefault("ipFamilies", ["IPv4"])
                spec.setdefault("ipFamilyPolicy", "SingleStack")
            if typ in ("NodePort", "LoadBalancer"):
                spec.setdefault("externalTrafficPolicy", "Cluster")
                # One Service may use a nodePort once per protocol (TCP and UDP on the same number), as the
                # real allocator allows; across Services a nodePort is taken once.
                mine: dict[int, set[str]] = {}
                for port in spec.get("ports") or []:
                    proto = str(port.get("protocol") or "TCP")
                    if port.get("nodePort") and int(port["nodePort"]) in mine:
                        np = int(port["nodePort"])
                        if proto in mine[np]:
                            raise ApiError(
                                422,
                                "Invalid",
                                f'Service "{name}" is invalid: spec.ports[].nodePort: Duplicate value: {np}/{proto}',
                            )
                        mine[np].add(proto)
                        continue
                    if port.get("nodePort"):
                        np = int(port["nodePort"])
                        if np in self._ports_used:
                            raise ApiError(
                                422,
                                "Invalid",
                                f'Service "{name}" is invalid: spec.ports[].nodePort: Invalid value: '
                                f"{np}: provided port is already allocated",
                            )
                    else:
                        np = self._next_port()
                        port["nodePort"] = np
                    mine.setdefault(np, set()).add(proto)
                    self._ports_used.add(np)
                    new_ports.append(np)
                if typ == "LoadBalancer":
                    spec.setdefault("allocateLoadBalancerNodePorts", True)
                    if spec.get("externalTrafficPolicy") == "Local" and not spec.get("healthCheckNodePort"):
                        spec["healthCheckNodePort"] = self._next_port()
                        self._ports_used.add(spec["healthCheckNodePort"])
                        new_ports.append(spec["healthCheckNodePort"])
        except ApiError:
            for ip in ips:
                self._ips_used.discard(ip)
            for np in new_ports:
                self._ports_used.discard(np)
            raise

    def _next_ip(self, family: int) -> str:
        for net in self._nets:
            if net.version != family:
                continue
            size = min(net.num_addresses, 1 << 20)
            start = self._ip_cursor.get(family, 10)
            for i in range(size):
                offset = 1 + (start + i) % (size - 2)  # skip network and broadcast-like ends
                ip = str(net.network_address + offset)
                if ip not in self._ips_used:
                    self._ip_cursor[family] = offset
                    return ip
        raise ApiError(422, "Invalid", f"no free IPv{family} ClusterIP in {[str(n) for n in self._nets]}")

    def _next_port(self) -> int:
        lo, hi = NODE_PORT_RANGE
        for _ in range(hi - lo + 1):
            port = random.randint(lo, hi)
            if port not in self._ports_used:
                return port
        for port in range(lo, hi + 1):
            if port not in self._ports_used:
                return port
        raise ApiError(422, "Invalid", "no free nodePort")


def _matcher(label_selector: str, field_selector: str) -> Callable[[Mapping[str, Any]], bool]:
    try:
        by_label = label_matcher(label_selector)
        by_field = field_matcher(field_selector)
    except SelectorError as exc:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {exc}") from exc
    return lambda obj: by_label(obj) and by_field(obj)


# --------------------------------------------------------------------------------------------------------------------
# Faults and the request log


@dataclass
class Faults:
    """What to break, switchable at runtime.

    Python: `server.faults.update(error_rate=1.0)`, `server.faults.reset()`, `server.compact()`,
    `server.drop_watches()`. HTTP: POST /_faults with a JSON object of any of these fields plus `"reset": true`,
    `"compact": true`, `"drop_watches": true` and `"bookmark_interval": seconds`; GET /_faults shows the settings,
    the current resourceVersion and the oldest one a watch may still start from (`history_floor`).
    """

    watch_drop_after_events: int | None = None  # close every watch abruptly after this many events
    watch_drop_after_seconds: float | None = None  # ... or after this long
    error_rate: float = 0.0  # fraction of API requests answered with error_code
    error_next: int = 0  # the next N API requests answered with error_code
    error_code: int = 503
    delay: float = 0.0  # seconds added to every API request

    def update(self, **values: Any) -> None:
        for key, value in values.items():
            if key not in Faults.__dataclass_fields__:
                raise ValueError(f"unknown fault {key!r}")
            setattr(self, key, value)

    def reset(self) -> None:
        self.update(**asdict(Faults()))


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    time: float
    status: int = 0

    @property
    def watch(self) -> bool:
        return self.query.get("watch", "").lower() in ("true", "1")


class Listen(NamedTuple):
    netns: str | None
    host: str
    port: int


def parse_listen(text: str) -> Listen:
    """`[NETNS/]HOST:PORT`, HOST may be `[v6]`."""
    netns: str | None = None
    if "/" in text:
        netns, text = text.split("/", 1)
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad listen address {text!r}, want [NETNS/]HOST:PORT")
    return Listen(netns or None, host.strip("[]") or "127.0.0.1", int(port))


# --------------------------------------------------------------------------------------------------------------------
# HTTP


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


class _Drop(Exception):
    """Raised inside a watch to cut the connection without a clean end."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, delayed ACKs add ~40 ms to every request.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        with self.server.conns_lock:
            self.server.conns.add(self.connection)

    def finish(self) -> None:
        with self.server.conns_lock:
            self.server.conns.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        log.debug("%s %s", self.address_string(), format % args)

    # --- plumbing

    def _send_json(self, code: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self._record is not None:
            self._record.status = code

    def _body(self) -> Any:
        raw = self._raw
        if not raw:
            return None
        ctype = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if "protobuf" in ctype or "cbor" in ctype:
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            try:
                import yaml

                return yaml.safe_load(raw)
            except Exception as exc:
                raise ApiError(400, "BadRequest", f"cannot decode request body: {exc}") from exc

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        self._record: RequestRecord | None = None
        # Read the body before anything can fail: an unread body would be parsed as the next request on this
        # keep-alive connection.
        length = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(length) if length > 0 else b""
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        path = url.path.rstrip("/") or "/"
        try:
            if path == "/healthz" or path == "/livez" or path == "/readyz":
                data = b"ok"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            if path == "/_faults":
                if method == "POST":
                    api.set_faults(self._body() or {})
                self._send_json(200, api.faults_state())
                return
            if path == "/_requests":
                self._send_json(200, [asdict(r) for r in list(api.requests)[-500:]])
                return
            record = RequestRecord(method, path, query, time.time())
            self._record = record
            api.requests.append(record)
            api.inject_faults()
            discovery = _discovery(path)
            if discovery is not None:
                self._send_json(200, discovery)
                return
            self._api(method, path, query)
        except ApiError as exc:
            self._send_json(exc.code, exc.status())
        except _Drop:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug here must answer 500, not hang the client
            log.exception("apiserver: %s %s failed", method, self.path)
            try:
                self._send_json(500, status_body(500, "InternalError", f"internal error: {exc!r}"))
            except OSError:
                self.close_connection = True

    def _api(self, method: str, path: str, query: dict[str, str]) -> None:
        route = _route(path)
        if route is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        res, namespace, name, sub, watch_path = route
        store = self.server.api.store
        if sub is not None and not (sub == "status" and res.status_subresource):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if name is None:
            if method == "GET":
                if watch_path or _truthy(query.get("watch")):
                    self._watch(res, namespace, None, query)
                else:
                    self._list(res, namespace, query)
                return
            if method == "POST":
                body = self._body()
                if not isinstance(body, Mapping):
                    raise ApiError(400, "BadRequest", "request body must be an object")
                self._send_json(201, store.create(body, resource=res.key, namespace=namespace))
                return
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on a collection")
        if method == "GET":
            if watch_path:
                self._watch(res, namespace, name, query)
                return
            self._send_json(200, store.get(res.key, namespace, name))
        elif method == "PUT":
            body = self._body()
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "request body must be an object")
            if _meta(body).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            body = dict(body)
            body["metadata"] = {**_meta(body), "name": name}
            self._send_json(200, store.update(body, resource=res.key, namespace=namespace, subresource=sub))
        elif method == "PATCH":
            patch_type = self.headers.get("Content-Type", "application/merge-patch+json")
            self._send_json(200, store.patch(res.key, namespace, name, self._body(), patch_type, subresource=sub))
        elif method == "DELETE":
            self._body()  # DeleteOptions: accepted and ignored
            gone = store.delete(res.key, namespace, name)
            if res.key == "services":
                self._send_json(200, gone)
            else:
                details = {"name": name, "group": res.group, "kind": res.plural, "uid": _meta(gone).get("uid")}
                self._send_json(200, status_body(200, "", "", details))
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    def _list(self, res: Resource, namespace: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        match = _matcher(query.get("labelSelector", ""), query.get("fieldSelector", ""))
        token = query.get("continue", "")
        limit = int(query.get("limit") or 0)
        if token:
            items, rv, offset = api.continue_list(token)
        else:
            rv_text, rv_match = query.get("resourceVersion", ""), query.get("resourceVersionMatch", "")
            at_rv: int | None = None
            if rv_text not in ("", "0"):
                try:
                    wanted = int(rv_text)
                except ValueError as exc:
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}") from exc
                if rv_match == "Exact":
                    at_rv = wanted
                elif wanted > api.store.resource_version:
                    raise ApiError(504, "Timeout", f"Too large resource version: {wanted}", {"retryAfterSeconds": 1})
            items, rv = api.store.snapshot(res, namespace, match, at_rv)
            offset = 0
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        page = items[offset:]
        if limit > 0 and len(page) > limit:
            page = page[:limit]
            meta["continue"] = api.remember_list(items, rv, offset + limit)
            meta["remainingItemCount"] = len(items) - offset - limit
        body = {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": meta,
            # Like the real server, list items carry no kind/apiVersion.
            "items": [{k: v for k, v in obj.items() if k not in ("kind", "apiVersion")} for obj in page],
        }
        self._send_json(200, body)

    # --- watch

    def _chunk(self, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _watch(self, res: Resource, namespace: str | None, name: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        store = api.store
        fs = query.get("fieldSelector", "")
        if name is not None:
            fs = f"{fs},metadata.name={name}" if fs else f"metadata.name={name}"
        label_sel = query.get("labelSelector", "")
        match = _matcher(label_sel, fs)
        rv_text = query.get("resourceVersion", "")
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        timeout = float(query.get("timeoutSeconds") or 0) or api.default_watch_timeout
        faults = api.faults
        start = time.monotonic()
        deadline = start + timeout
        drop_generation = api.drop_generation

        def drop_at() -> float | None:
            # Read live, so a fault switched on also cuts the watches already running.
            after = faults.watch_drop_after_seconds
            return start + after if after is not None else None

        initial: list[dict[str, Any]] = []
        if rv_text in ("", "0"):
            # No resourceVersion: the current state as synthetic ADDED events, then changes after it.
            initial, pos = store.snapshot(res, namespace, match)
        else:
            try:
                pos = int(rv_text)
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}") from exc
            current = store.resource_version
            if pos > current:
                # A client that remembers a newer server (this one restarted) is told so, as the real server does.
                raise ApiError(
                    504,
                    "Timeout",
                    f"Too large resource version: {pos}, current: {current}",
                    {
                        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                        "retryAfterSeconds": 1,
                    },
                )

        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self._record is not None:
            self._record.status = 200
        sent = 0

        def emit(type_: str, obj: Mapping[str, Any]) -> None:
            nonlocal sent
            limit = faults.watch_drop_after_events
            if limit is not None and sent >= limit:
                raise _Drop()
            self._chunk({"type": type_, "object": obj})
            sent += 1

        def bookmark(rv: int) -> None:
            self._chunk(
                {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": res.kind,
                        "apiVersion": res.api_version,
                        "metadata": {"resourceVersion": str(rv)},
                    },
                }
            )

        for obj in initial:
            emit("ADDED", obj)
        next_bookmark = time.monotonic() + api.bookmark_interval
        while True:
            with store.cond:
                while True:
                    now = time.monotonic()
                    if store.closed or api.closing:
                        batch = None
                        break
                    cut = drop_at()
                    if api.drop_generation != drop_generation or (cut is not None and now >= cut):
                        raise _Drop()
                    got = store.events_after(pos)
                    if got is None or got[0] or now >= min(deadline, next_bookmark):
                        batch = got
                        break
                    wake = min(deadline, next_bookmark, cut if cut is not None else deadline)
                    store.cond.wait(max(0.01, wake - now))
                floor = store.floor
            if store.closed or api.closing:
                break
            if batch is None:
                emit(
                    "ERROR",
                    status_body(410, "Expired", f"too old resource version: {pos} ({floor})"),
                )
                break
            events, current = batch
            for ev in events:
                if ev.resource != res.key:
                    continue
                ns = _meta(ev.obj).get("namespace", "")
                if namespace is not None and ns != namespace:
                    continue
                type_, obj = ev.type, ev.obj
                if type_ == "MODIFIED":
                    was, now_in = match(ev.old or {}), match(ev.obj)
                    if not was and not now_in:
                        continue
                    if was and not now_in and ev.old is not None:
                        # As the watch cache does: DELETED with the previous content at the event's version.
                        type_ = "DELETED"
                        obj = {**ev.old, "metadata": {**_meta(ev.old), "resourceVersion": str(ev.rv)}}
                    elif now_in and not was:
                        type_ = "ADDED"
                elif not match(ev.obj):
                    continue
                emit(type_, obj)
            pos = current
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_bookmark:
                if bookmarks:
                    bookmark(pos)
                next_bookmark = now + api.bookmark_interval
        if bookmarks and not api.closing:
            bookmark(pos)
        self.wfile.write(b"0\r\n\r\n")


_SHORT_NAMES = {"services": ["svc"], "nodes": ["no"], "events": ["ev"]}
_DISCOVERY_GROUPS = {
    "discovery.k8s.io": ["v1"],
    "events.k8s.io": ["v1"],
}


def _discovery(path: str) -> dict[str, Any] | None:
    """Just enough discovery for kubectl to list these kinds against the stand-in."""
    if path == "/version":
        return {"major": "1", "minor": "33", "gitVersion": "v1.33.0-kproxy-standin", "platform": "linux/amd64"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": g,
                    "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                    "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                }
                for g, vs in _DISCOVERY_GROUPS.items()
            ],
        }
    for res_group_version in {(r.group, r.version) for r in RESOURCES.values()}:
        group, version = res_group_version
        gv_path = f"/apis/{group}/{version}" if group else f"/api/{version}"
        if path == gv_path:
            rs = [r for r in RESOURCES.values() if (r.group, r.version) == res_group_version]
            resources = []
            for r in rs:
                resources.append(
                    {
                        "name": r.plural,
                        "singularName": r.kind.lower(),
                        "shortNames": _SHORT_NAMES.get(r.plural, []),
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                    }
                )
                if r.status_subresource:
                    resources.append(
                        {
                            "name": f"{r.plural}/status",
                            "singularName": "",
                            "namespaced": r.namespaced,
                            "kind": r.kind,
                            "verbs": ["get", "patch", "update"],
                        }
                    )
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources,
            }
    return None


def _route(path: str) -> tuple[Resource, str | None, str | None, str | None, bool] | None:
    """(resource, namespace, name, subresource, legacy /watch/ path) for an API path, or None."""
    parts = path.strip("/").split("/")
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch_path = bool(rest) and rest[0] == "watch"
    if watch_path:
        rest = rest[1:]
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    res = _BY_PATH.get((group, version, rest[0]))
    if res is None or (namespace is not None and not res.namespaced):
        return None
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    return res, namespace, name, sub, watch_path


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    api: ApiServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Open client connections, so close() also ends keep-alive ones (a closed server must look gone).
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()

    def close_connections(self) -> None:
        with self.conns_lock:
            conns = list(self.conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hang up on keep-alive connections all the time; socketserver would print a traceback to stderr.
        log.debug("apiserver: connection from %s ended with an error", client_address, exc_info=True)


# --------------------------------------------------------------------------------------------------------------------
# The server object


def _make_socket(listen: Listen) -> socket.socket:
    """A listening socket, created inside `listen.netns` if one is named (the socket stays bound to that netns)."""
    if listen.netns:
        from pyroute2 import netns as pr_netns

        pr_netns.pushns(listen.netns)
        try:
            return _bind(listen)
        finally:
            pr_netns.popns()
    return _bind(listen)


def _bind(listen: Listen) -> socket.socket:
    infos = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _type, _proto, _canon, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # A lab address added a moment ago may still be tentative (IPv6 DAD): bind to it anyway.
        sock.setsockopt(socket.SOL_IP, getattr(socket, "IP_FREEBIND", 15), 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class ApiServer:
    """The running stand-in: a `Store`, fault settings, a request log and one HTTP server per listen address."""

    def __init__(
        self,
        store: Store | None = None,
        *,
        bookmark_interval: float = 5.0,
        default_watch_timeout: float = 1800.0,
    ) -> None:
        self.store = store or Store()
        self.faults = Faults()
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.requests: collections.deque[RequestRecord] = collections.deque(maxlen=10000)
        self.closing = False
        self.drop_generation = 0
        self._servers: list[_HTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._lists: collections.OrderedDict[int, tuple[list[dict[str, Any]], int]] = collections.OrderedDict()
        self._list_seq = 0
        self._lock = threading.Lock()

    # --- listening

    def listen(self, listen: Listen) -> int:
        sock = _make_socket(listen)
        srv = _HTTPServer(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        srv.socket.close()
        srv.socket = sock
        srv.address_family = sock.family
        srv.server_address = sock.getsockname()
        srv.server_name, srv.server_port = listen.host, sock.getsockname()[1]
        srv.api = self
        thread = threading.Thread(
            target=srv.serve_forever, kwargs={"poll_interval": 0.2}, name=f"apiserver-{listen.host}", daemon=True
        )
        thread.start()
        self._servers.append(srv)
        self._threads.append(thread)
        return int(srv.server_port)

    @property
    def ports(self) -> list[int]:
        return [int(s.server_port) for s in self._servers]

    @property
    def url(self) -> str:
        """http://HOST:PORT of the first listener (for a kubeconfig or --master)."""
        srv = self._servers[0]
        host = str(srv.server_address[0])
        return f"http://[{host}]:{srv.server_port}" if ":" in host else f"http://{host}:{srv.server_port}"

    def close(self) -> None:
        self.closing = True
        with self.store.cond:
            self.store.cond.notify_all()
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
            srv.close_connections()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- faults

    def compact(self) -> int:
        return self.store.compact()

    def drop_watches(self) -> None:
        """Cut every running watch now, abruptly (no final chunk), as a lost connection would."""
        with self.store.cond:
            self.drop_generation += 1
            self.store.cond.notify_all()

    def set_faults(self, body: Mapping[str, Any]) -> None:
        """Apply a /_faults body: any Faults field, plus `reset`, `compact` and `bookmark_interval`."""
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "faults must be a JSON object")
        values = dict(body)
        if values.pop("reset", False):
            self.faults.reset()
        if values.pop("compact", False):
            self.compact()
        if values.pop("drop_watches", False):
            self.drop_watches()
        if "bookmark_interval" in values:
            self.bookmark_interval = float(values.pop("bookmark_interval"))
        try:
            self.faults.update(**values)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc

    def faults_state(self) -> dict[str, Any]:
        state = asdict(self.faults)
        state["bookmark_interval"] = self.bookmark_interval
        state["resource_version"] = self.store.resource_version
        state["history_floor"] = self.store.floor
        return state

    def inject_faults(self) -> None:
        faults = self.faults
        if faults.delay > 0:
            time.sleep(faults.delay)
        fail = False
        with self._lock:
            if faults.error_next > 0:
                faults.error_next -= 1
                fail = True
        if fail or (faults.error_rate > 0 and random.random() < faults.error_rate):
            code = faults.error_code
            reason = "ServiceUnavailable" if code == 503 else "InternalError"
            raise ApiError(code, reason, f"injected fault: {code}")

    # --- paginated lists keep their snapshot so every page is from the same resourceVersion

    def remember_list(self, items: list[dict[str, Any]], rv: int, offset: int) -> str:
        with self._lock:
            if offset == 0 or not any(v[0] is items for v in self._lists.values()):
                self._list_seq += 1
                self._lists[self._list_seq] = (items, rv)
                while len(self._lists) > 32:
                    self._lists.popitem(last=False)
                seq = self._list_seq
            else:
                seq = next(k for k, v in self._lists.items() if v[0] is items)
        return base64.urlsafe_b64encode(json.dumps({"id": seq, "offset": offset, "rv": rv}).encode()).decode()

    def continue_list(self, token: str) -> tuple[list[dict[str, Any]], int, int]:
        try:
            data = json.loads(base64.urlsafe_b64decode(token.encode()))
            seq, offset = int(data["id"]), int(data["offset"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, "BadRequest", "invalid continue token") from exc
        with self._lock:
            snap = self._lists.get(seq)
        if snap is None:
            raise ApiError(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result. "
                "You can start a new list without the continue parameter.",
            )
        return snap[0], snap[1], offset

    # --- loading manifests

    def load(self, folder: str | Path) -> int:
        """Apply every object of a supported kind found in the folder's manifests; returns how many."""
        from kproxy.sources.files import read_manifest_folder

        count = 0
        for obj in read_manifest_folder(Path(folder)):
            try:
                resource_for(obj)
            except ApiError:
                log.info("apiserver: skipping %s %s (kind not served)", obj.get("kind"), _meta(obj).get("name"))
                continue
            self.store.apply(obj)
            count += 1
        return count


def serve(
    listens: Iterable[Listen | tuple[str | None, str, int]],
    *,
    history: int = DEFAULT_HISTORY,
    bookmark_interval: float = 5.0,
    service_cidrs: Iterable[str] = DEFAULT_SERVICE_CIDRS,
    store: Store | None = None,
) -> ApiServer:
    """Start the stand-in on every listen address (port 0 picks a free port); see `ApiServer.ports`."""
    api = ApiServer(store or Store(history=history, service_cidrs=service_cidrs), bookmark_interval=bookmark_interval)
    try:
        for listen in listens:
            api.listen(Listen(*listen))
    except BaseException:
        api.close()
        raise
    return api


# --------------------------------------------------------------------------------------------------------------------
# Command line


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `apiserver` to a command line; the handler is set as the `func` default and returns an exit code."""
    p = subparsers.add_parser(
        "apiserver",
        help="run the in-memory Kubernetes API stand-in (for the lab and tests)",
        description="An in-memory Kubernetes API server for Services, EndpointSlices, Nodes and Events.",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="[NETNS/]HOST:PORT",
        help="address to listen on, optionally inside a network namespace (repeatable; default 127.0.0.1:6443)",
    )
    p.add_argument("--port-file", default="", help="write the first bound port to this file (for port 0)")
    p.add_argument("--load", default="", metavar="DIR", help="preload the YAML/JSON manifests in this folder")
    p.add_argument("--history", type=int, default=DEFAULT_HISTORY, help="watch events kept for resuming watches")
    p.add_argument("--bookmark-interval", type=float, default=5.0, help="seconds between watch BOOKMARK events")
    p.add_argument(
        "--service-cidr",
        action="append",
        default=[],
        help=f"ClusterIP range(s) to allocate from (default {','.join(DEFAULT_SERVICE_CIDRS)})",
    )
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    try:
        listens = [parse_listen(text) for text in (args.listen or ["127.0.0.1:6443"])]
    except ValueError as exc:
        print(f"kproxy apiserver: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        api = serve(
            listens,
            history=args.history,
            bookmark_interval=args.bookmark_interval,
            service_cidrs=args.service_cidr or DEFAULT_SERVICE_CIDRS,
        )
    except OSError as exc:
        print(f"kproxy apiserver: cannot listen: {exc}", file=sys.stderr)
        return 1
    try:
        if args.load:
            count = api.load(args.load)
            log.info("apiserver: loaded %d objects from %s", count, args.load)
        if args.port_file:
            tmp = Path(f"{args.port_file}.tmp")
            tmp.write_text(f"{api.ports[0]}\n")
            tmp.replace(args.port_file)
        log.info(
            "apiserver: listening on %s",
            ", ".join(f"{lst.netns or '-'}/{lst.host}:{port}" for lst, port in zip(listens, api.ports, strict=True)),
        )
        while not stop.wait(1.0):
            pass
    finally:
        api.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kproxy.lab.apiserver")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv if argv is not None else ["apiserver", *__import__("sys").argv[1:]])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
