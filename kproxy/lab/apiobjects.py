"""The API stand-in's vocabulary: the resources it serves, its Status errors and the patches it applies.

No state here: ``Resource`` / ``RESOURCES`` / ``resource_for`` name what the stand-in (``kproxy.lab.apiserver``)
serves, ``ApiError`` / ``status_body`` are the real server's Status answers, and ``merge_patch`` / ``json_patch``
are RFC 7386 and RFC 6902 as the real server applies them (a strategic merge patch is applied as a merge patch:
lists are replaced, not merged). Imports only the standard library.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

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

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        list_meta: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})
        self.list_meta = dict(list_meta or {})  # the Status's own metadata (an expired list's new continue token)

    def status(self) -> dict[str, Any]:
        body = status_body(self.code, self.reason, self.message, self.details)
        body["metadata"] = dict(self.list_meta)
        return body


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


def object_meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object's metadata, or an empty dict when it has none (or a malformed one)."""
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}
