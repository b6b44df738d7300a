"""Lists with ``limit`` and ``continue`` for the API stand-in, as kube-apiserver's etcd3 storage serves them.

What the real server does, and so what this does (upstream: ``k8s.io/apiserver/pkg/storage/etcd3/store.go`` and
``storage/continue.go``; the client side is client-go's ``tools/pager``):

- items come in etcd's key order ("NAMESPACE/NAME" below the resource's prefix), ``limit`` of them per page; when
  more keys follow, ``metadata.continue`` is set and, only for a list without label or field selectors,
  ``metadata.remainingItemCount`` (with selectors the server cannot know how many of the rest match);
- the continue token is opaque to clients: base64url (unpadded) of ``{"v":"meta.k8s.io/v1","rv":RV,"start":KEY}``
  with KEY the last key read plus a NUL byte, relative to the list's prefix; every page is read at the first page's
  resourceVersion, so the pages are one consistent snapshot and carry that resourceVersion;
- a token that does not decode, names another version or a key outside the prefix is ``400 BadRequest``
  ("invalid continue token: ..."); a token with a resourceVersion in the request is ``400`` ("specifying resource
  version is not allowed when using continue"); a token whose resourceVersion was compacted away (the store's
  history no longer reaches it: ``Store.compact`` or a full history) is ``410 Expired`` with upstream's message and,
  in the Status's metadata, a token that continues at the latest version (rv -1: an inconsistent list, which the
  client may accept; client-go's pager instead lists again without ``limit``).

Decision: a token holds no server state, exactly as upstream's, so it stays valid for as long as its
resourceVersion is in the history however many lists run meanwhile; only the sorted snapshot a token reads is
cached (``keep`` of them, shared object references), so paging through 100,000 objects costs one sort, not one
per page.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import collections
import json
import posixpath
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kproxy.lab.apistore import ApiError, Resource, Store, storage_key

CONTINUE_VERSION = "meta.k8s.io/v1"
EXPIRED_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)

Match = Callable[[Mapping[str, Any]], bool]


def encode_continue(start: str, rv: int) -> str:
    """The token for a page that starts at key `start` (relative to the list's prefix) at resourceVersion `rv`."""
    raw = json.dumps({"v": CONTINUE_VERSION, "rv": rv, "start": start}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[str, int]:
    """(start key, resourceVersion) of a token; ValueError with upstream's wording if it is not one."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"continue key is not valid: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != CONTINUE_VERSION:
        raise ValueError("continue key is not valid: server does not recognize this encoded key")
    start, rv = data.get("start"), data.get("rv")
    if not isinstance(start, str) or not start:
        raise ValueError("continue key is not valid: encoded start key empty")
    if not isinstance(rv, int) or isinstance(rv, bool):
        raise ValueError("continue key is not valid: the resource version is not an integer")
    # As upstream: the key must stay inside the list's prefix once cleaned ("../" would escape it).
    key = start if start.startswith("/") else "/" + start
    if posixpath.normpath(key) != key:
        raise ValueError(f"continue key is not valid: {start}")
    return key[1:], rv


class _Snapshot:
    """Every object of one resource at one resourceVersion, in key order (references to the stored objects)."""

    __slots__ = ("keys", "objs")

    def __init__(self, state: Mapping[tuple[str, str], dict[str, Any]]) -> None:
        pairs = sorted((storage_key(ns, name), obj) for (ns, name), obj in state.items())
        self.keys = [k for k, _ in pairs]
        self.objs = [o for _, o in pairs]


class Pager:
    """Answers list requests over a store: one page or everything, at a resourceVersion. Thread-safe."""

    def __init__(self, store: Store, keep: int = 8) -> None:
        self.store = store
        self.keep = keep
        self._snaps: collections.OrderedDict[tuple[str, int], _Snapshot] = collections.OrderedDict()
        self._lock = threading.Lock()

    def list(
        self, res: Resource, namespace: str | None, query: Mapping[str, str], match: Match, selectors: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the page's items, the list's metadata) for a list request's query parameters; `selectors` says whether
        the request had a label or field selector (then remainingItemCount stays unset, as upstream)."""
        limit = _limit(query.get("limit", ""))
        token = query.get("continue", "")
        rv_text = query.get("resourceVersion", "")
        prefix = f"{namespace}/" if res.namespaced and namespace is not None else ""
        start = ""
        if token:
            try:
                start, rv = decode_continue(token)
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid continue token: {exc}") from None
            if rv_text not in ("", "0"):
                raise ApiError(400, "BadRequest", "specifying resource version is not allowed when using continue")
            if rv == 0:
                raise ApiError(400, "BadRequest", "0 continue resource version is not allowed when using continue")
            try:
                snap, rv = self._snapshot(res, None if rv < 0 else rv)
            except ApiError as exc:
                if exc.code != 410:
                    raise
                raise ApiError(
                    410, "Expired", EXPIRED_CONTINUE, list_meta={"continue": encode_continue(start, -1)}
                ) from None
        else:
            snap, rv = self._snapshot(res, self._first_rv(rv_text, query.get("resourceVersionMatch", "")))
        return _page(snap, prefix, start, limit, match, selectors, rv)

    def _first_rv(self, rv_text: str, rv_match: str) -> int | None:
        """The resourceVersion a first page is read at: now, or exactly the one asked for (``Exact``)."""
        if rv_text in ("", "0"):
            return None
        try:
            wanted = int(rv_text)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}") from exc
        if rv_match == "Exact":
            return wanted
        if wanted > self.store.resource_version:
            raise ApiError(504, "Timeout", f"Too large resource version: {wanted}", {"retryAfterSeconds": 1})
        return None

    def _snapshot(self, res: Resource, at_rv: int | None) -> tuple[_Snapshot, int]:
        current = self.store.resource_version
        rv = current if at_rv is None else at_rv
        with self._lock:
            snap = self._snaps.get((res.key, rv))
            # a cached snapshot is served only while the store could still rebuild it: compaction expires it too
            if snap is not None and rv >= self.store.floor:
                self._snaps.move_to_end((res.key, rv))
                return snap, rv
        state, rv = self.store.state_at(res, at_rv)  # raises 410 for a compacted resourceVersion
        snap = _Snapshot(state)
        with self._lock:
            self._snaps[(res.key, rv)] = snap
            while len(self._snaps) > self.keep:
                self._snaps.popitem(last=False)
        return snap, rv


def _limit(text: str) -> int:
    if not text:
        return 0
    try:
        return max(0, int(text))
    except ValueError as exc:
        raise ApiError(400, "BadRequest", f"invalid limit {text!r}") from exc


def _page(
    snap: _Snapshot, prefix: str, start: str, limit: int, match: Match, selectors: bool, rv: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    keys = snap.keys
    lo = bisect.bisect_left(keys, prefix)
    # keys below "NS/" end before "NS0" ('0' follows '/'): the namespace's range
    hi = bisect.bisect_left(keys, prefix[:-1] + "0") if prefix else len(keys)
    i = max(lo, bisect.bisect_left(keys, prefix + start)) if start else lo
    items: list[dict[str, Any]] = []
    last = ""
    while i < hi and (limit == 0 or len(items) < limit):
        obj = snap.objs[i]
        last = keys[i]
        if match(obj):
            items.append(obj)
        i += 1
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if limit and i < hi:
        meta["continue"] = encode_continue(last[len(prefix) :] + "\x00", rv)
        if not selectors:
            meta["remainingItemCount"] = hi - i
    return items, meta
