"""The API stand-in's store: objects, one resourceVersion counter, the watch history, selectors and faults.

The part of the stand-in (see ``kproxy.lab.apiserver``) that knows what the API *holds*, with no HTTP in it:
create/replace/patch/delete with the real server's conflicts and Status errors, Service defaults and allocations
(``kproxy.lab.apialloc``), the state at a resourceVersion (``state_at``: consistent snapshots for lists and their
pages), the bounded watch history (``events_after``; ``compact()`` drops it, and with it every older
resourceVersion, as etcd's compaction does), label/field selectors, and the fault settings (``Faults``) that the
HTTP layer applies. The resources, Status errors and patches are ``kproxy.lab.apiobjects``'s, re-exported here.

Imports only the standard library, ``kproxy.sources.selectors`` and the stand-in's lower modules.
"""

from __future__ import annotations

import collections
import copy
import json
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from kproxy.lab.apialloc import NODE_PORT_RANGE, ServiceAllocator
from kproxy.lab.apiobjects import (
    RESOURCE_BY_PATH,
    RESOURCES,
    ApiError,
    Resource,
    _not_found,
    _now,
    _ns_key,
    json_patch,
    merge_patch,
    object_meta,
    resource_for,
    status_body,
)
from kproxy.sources.selectors import SelectorError, field_matcher, label_matcher

__all__ = [
    "DEFAULT_HISTORY",
    "DEFAULT_SERVICE_CIDRS",
    "NODE_PORT_RANGE",
    "RESOURCES",
    "RESOURCE_BY_PATH",
    "ApiError",
    "Faults",
    "Resource",
    "Store",
    "WatchEvent",
    "encode_item",
    "json_patch",
    "merge_patch",
    "object_meta",
    "resource_for",
    "selector_matcher",
    "storage_key",
    "status_body",
]

DEFAULT_HISTORY = 10000
# IPv4 from the lab's service range (198.19.0.0/18 is the conformance suite's, 198.19.100.0/24 and .200.0/24 its
# external and load-balancer IPs); IPv6 a /108 (1,048,576 addresses, the size of kube-apiserver's default /12)
# inside fd00:198:18:ffff::/64, which the lab routes.
DEFAULT_SERVICE_CIDRS = ("198.19.128.0/17", "fd00:198:18:ffff::/108")


class WatchEvent(NamedTuple):
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]  # stored objects are never mutated once stored, so events share them
    old: dict[str, Any] | None


ObjectList = list[dict[str, Any]]  # named here because Store.list shadows the builtin inside the class


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
        # each stored object's list-item JSON, made when it is stored (see ``list_item``), beside that object
        self._encoded: dict[str, dict[tuple[str, str], tuple[dict[str, Any], bytes]]] = {k: {} for k in RESOURCES}
        self._alloc = ServiceAllocator(service_cidrs)
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
        """Matching stored objects (shared, do not mutate) in etcd's key order, at `at_rv` or now."""
        state, rv = self.state_at(res, at_rv)
        items = [
            obj
            for (ns, _name), obj in sorted(state.items(), key=lambda kv: storage_key(*kv[0]))
            if (namespace is None or ns == namespace) and match(obj)
        ]
        return items, rv

    def list_item(self, res: Resource, obj: dict[str, Any]) -> bytes:
        """``obj``'s JSON as a list item (``encode_item``), made once per stored version of the object, when it is
        stored (a scale run's bulk load pays it before anyone lists): every page of every client's list (each node
        of a lab lists everything) reuses it, and so does every watch event of that version (``watch_object``).
        Checked by identity against the stored object; an older version (a list or a watch at a past
        resourceVersion) is encoded each time it is served."""
        cached = self._encoded[res.key].get(_meta_key(obj))
        if cached is not None and cached[0] is obj:
            return cached[1]
        return encode_item(obj)

    def watch_object(self, res: Resource, obj: dict[str, Any]) -> bytes:
        """``obj``'s JSON as a watch event carries it: the list item's bytes with ``apiVersion`` and ``kind``."""
        item = self.list_item(res, obj)
        head = json.dumps({"apiVersion": res.api_version, "kind": res.kind}, separators=(",", ":")).encode()
        return head[:-1] + (b"," + item[1:] if item != b"{}" else b"}")

    def state_at(self, res: Resource, at_rv: int | None = None) -> tuple[dict[tuple[str, str], dict[str, Any]], int]:
        """Every stored object of `res` by (namespace, name) as it was at `at_rv` (now if None), and that version:
        410 Expired if the history no longer reaches back to it, 504 if it is in the future."""
        with self.cond:
            current = self._rv
            state = dict(self._objects[res.key])
            if at_rv is None or at_rv == current:
                return state, current
            if at_rv < self._floor:
                raise ApiError(410, "Expired", f"too old resource version: {at_rv} ({self._floor})")
            if at_rv > current:
                raise ApiError(
                    504,
                    "Timeout",
                    f"Too large resource version: {at_rv}, current: {current}",
                    {"retryAfterSeconds": 1},
                )
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
            return state, at_rv

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
        if type_ == "DELETED":
            self._encoded[res.key].pop(_meta_key(obj), None)
        else:
            self._encoded[res.key][_meta_key(obj)] = (obj, encode_item(obj))
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
        with self.cond:
            return copy.deepcopy(self._create(res, new, namespace))

    def create_many(self, objects: Iterable[Any], chunk: int = 1000) -> tuple[int, ObjectList]:
        """Create every object (taking ownership: they are stored uncopied), `chunk` per hold of the lock so
        watches and lists keep being served; (how many were created, the Status of the first 20 failures with the
        failing object's index). The bulk-load path of a scale run: what kproxy lists afterwards is the same."""
        return self._many(objects, chunk, lambda res, obj: self._create(res, obj, None))

    def replace_many(self, objects: Iterable[Any], chunk: int = 1000) -> tuple[int, ObjectList]:
        """Replace every object (as `update` without a resourceVersion precondition), as `create_many` creates."""

        def replace(res: Resource, obj: dict[str, Any]) -> None:
            object_meta(obj).pop("resourceVersion", None)
            ns, name = self._key(res, obj, None)
            old = self._objects[res.key].get((ns, name))
            if old is None:
                raise _not_found(res, name)
            self._replace(res, old, obj, None)

        return self._many(objects, chunk, replace)

    def _many(
        self, objects: Iterable[Any], chunk: int, one: Callable[[Resource, dict[str, Any]], object]
    ) -> tuple[int, ObjectList]:
        done, failures = 0, ObjectList()
        pending = list(enumerate(objects))
        for first in range(0, len(pending), chunk):
            with self.cond:
                for index, obj in pending[first : first + chunk]:
                    try:
                        if not isinstance(obj, dict):
                            raise ApiError(400, "BadRequest", "every item must be an object")
                        one(resource_for(obj), obj)
                        done += 1
                    except ApiError as exc:
                        if len(failures) < 20:
                            failures.append({**exc.status(), "index": index})
        return done, failures

    def _create(self, res: Resource, new: dict[str, Any], namespace: str | None) -> dict[str, Any]:
        """Store `new` (owned by the store from now on) as a new object; the caller holds `cond`."""
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        meta = new.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
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
            self._alloc.default_service(new, None)
        self._rv += 1
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = str(self._rv)
        meta.pop("deletionTimestamp", None)
        self._objects[res.key][(ns, name)] = new
        self._bump(res, "ADDED", new, None)
        return new

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
            self._alloc.default_service(new, old)
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
                self._alloc.release(old)
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


def encode_item(obj: Mapping[str, Any]) -> bytes:
    """An object as the items of a list carry it: compact JSON without ``kind`` and ``apiVersion`` (as the real
    server's list items)."""
    item = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return json.dumps(item, separators=(",", ":")).encode()


def _meta_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = object_meta(obj)
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def storage_key(namespace: str, name: str) -> str:
    """An object's key below its resource's prefix, as etcd holds it ("NAMESPACE/NAME", or "NAME" for a
    cluster-scoped kind): lists come in this key's byte order, and a continue token names a position in it."""
    return f"{namespace}/{name}" if namespace else name


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
