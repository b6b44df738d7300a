"""The API stand-in's store: objects, one resourceVersion counter, the watch history, selectors and faults.

The part of the stand-in (see ``kproxy.lab.apiserver``) that knows what the API *holds*, with no HTTP in it:
the resources it serves (Services with /status, discovery.k8s.io/v1 EndpointSlices, Nodes with /status, core and
events.k8s.io/v1 Events), create/replace/patch/delete with the real server's conflicts and Status errors
(``ApiError``), JSON merge and JSON patches, Service defaults and allocations (clusterIPs from the service CIDRs,
nodePorts, healthCheckNodePort) as the real registry makes them, lists at a resourceVersion (consistent snapshots),
the bounded watch history (``events_after``; ``compact()`` drops it), label/field selectors, and the fault
settings (``Faults``) that the HTTP layer applies.

Imports only the standard library and ``kproxy.sources.selectors``.
"""

from __future__ import annotations

import collections
import copy
import ipaddress
import random
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

from kproxy.sources.selectors import SelectorError, field_matcher, label_matcher

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
RESOURCE_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES.values()}
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


def object_meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object's metadata, or an empty dict when it has none (or a malformed one)."""
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
        items, rv = self.snapshot(resource_for(resource), namespace, selector_matcher(label_selector, field_selector))
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
                    key = (object_meta(ev.obj).get("namespace", ""), object_meta(ev.obj).get("name", ""))
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
        meta = object_meta(obj)
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
        old_meta, meta = object_meta(old), new.setdefault("metadata", {})
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
            patch_rv = object_meta(patch).get("resourceVersion") if isinstance(patch, Mapping) else None
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
            object_meta(gone)["resourceVersion"] = str(self._rv)
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
        object_meta(new).pop("resourceVersion", None)
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
                    f'Service "{object_meta(svc).get("name")}" is invalid: spec.clusterIPs[0]: field is immutable',
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
        name = object_meta(svc).get("name")
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


def selector_matcher(label_selector: str, field_selector: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate for `labelSelector=` and `fieldSelector=`; a bad selector is a 400, as on the real server."""
    try:
        by_label = label_matcher(label_selector)
        by_field = field_matcher(field_selector)
    except SelectorError as exc:
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {exc}") from exc
    return lambda obj: by_label(obj) and by_field(obj)


# --------------------------------------------------------------------------------------------------------------------
# Faults


# The malformed list answers the `bad_list` fault can give: an empty object; a well-formed empty list of another
# kind; the right kind without a resourceVersion; the right kind whose items are not a list; not JSON at all.
BAD_LIST_SHAPES = ("empty", "wrong_kind", "no_resource_version", "items_not_a_list", "not_json")


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
    # lists (not watches, not gets) answered 200 with a malformed body, as a broken proxy in front of the API
    # server might: one of BAD_LIST_SHAPES; with bad_list_next > 0 only that many lists, else every list
    bad_list: str = ""
    bad_list_next: int = 0

    def update(self, **values: Any) -> None:
        for key, value in values.items():
            if key not in Faults.__dataclass_fields__:
                raise ValueError(f"unknown fault {key!r}")
            if key == "bad_list" and value not in ("", *BAD_LIST_SHAPES):
                raise ValueError(f"bad_list: {value!r} is not one of {', '.join(BAD_LIST_SHAPES)}")
            setattr(self, key, value)

    def reset(self) -> None:
        self.update(**asdict(Faults()))
