"""The API stand-in's watch streams: ``watch=true`` (and the legacy ``/watch/`` paths) as chunked JSON lines.

As the real server's watch cache: ADDED/MODIFIED/DELETED events from a resourceVersion (without one, the current
state first as synthetic ADDED events), objects leaving a label or field selector sent as DELETED with their
previous content and entering it as ADDED, BOOKMARKs every ``bookmark_interval`` and before a timeout closes the
stream (when the client allows them), an ERROR event with 410 Expired for a resourceVersion older than the kept
history, and 504 "Too large resource version" before the stream starts for one the server has not reached. The
``Accept`` header may ask for each object as a one-row ``meta.k8s.io`` Table (kubectl ``--watch``). Faults apply
live: a stream is cut abruptly after N events or T seconds, or when ``drop_watches`` is called.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kproxy.lab.apistore import (
    ApiError,
    Faults,
    Resource,
    Store,
    WatchEvent,
    object_meta,
    selector_matcher,
    status_body,
)

Match = Callable[[Mapping[str, Any]], bool]


class WatchedApi(Protocol):
    """What a watch reads of the server object (``kproxy.lab.apihttp.ApiServer``), live."""

    store: Store
    faults: Faults
    closing: bool
    drop_generation: int
    bookmark_interval: float
    default_watch_timeout: float


class WatchDrop(Exception):
    """Raised inside a watch to cut the connection without a clean end."""


class WatchStream:
    """One watch request, from its query to the stream's last chunk."""

    def __init__(
        self, handler: Any, res: Resource, namespace: str | None, name: str | None, query: dict[str, str]
    ) -> None:
        self.h = handler  # the request's BaseHTTPRequestHandler (kproxy.lab.apihttp)
        self.api: WatchedApi = handler.server.api
        self.res = res
        self.namespace = namespace
        self.query = query
        fs = query.get("fieldSelector", "")
        if name is not None:
            fs = f"{fs},metadata.name={name}" if fs else f"metadata.name={name}"
        self.match: Match = selector_matcher(query.get("labelSelector", ""), fs)
        self.bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        self.start = time.monotonic()
        self.deadline = self.start + (float(query.get("timeoutSeconds") or 0) or self.api.default_watch_timeout)
        self.drop_generation = self.api.drop_generation
        self.as_table = handler.table_version()
        self.sent = 0

    def run(self) -> None:
        initial, pos = self._begin()
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if h.record is not None:
            h.record.status = 200
        for obj in initial:
            self._emit("ADDED", obj)
        pos = self._follow(pos)
        if self.bookmarks and not self.api.closing:
            self._bookmark(pos)
        h.wfile.write(b"0\r\n\r\n")

    def _begin(self) -> tuple[list[dict[str, Any]], int]:
        """(the synthetic ADDED objects, the resourceVersion to follow from); errors before the stream starts."""
        store = self.api.store
        rv_text = self.query.get("resourceVersion", "")
        initial: list[dict[str, Any]] = []
        if rv_text in ("", "0"):
            # No resourceVersion: the current state as synthetic ADDED events, then changes after it.
            initial, pos = store.snapshot(self.res, self.namespace, self.match)
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
        if self.as_table is not None:
            self.h.table(self.res, [], {}, self.as_table, self.query)  # a bad includeObject: 400 before the stream
        return initial, pos

    def _drop_at(self) -> float | None:
        # Read live, so a fault switched on also cuts the watches already running.
        after = self.api.faults.watch_drop_after_seconds
        return self.start + after if after is not None else None

    def _follow(self, pos: int) -> int:
        """Send the changes after `pos` until the deadline, the server closing or an expired history; returns the
        resourceVersion reached."""
        api = self.api
        next_bookmark = time.monotonic() + api.bookmark_interval
        while True:
            got, floor = self._wait(pos, next_bookmark)
            if api.store.closed or api.closing:
                return pos
            if got is None:
                self._emit("ERROR", status_body(410, "Expired", f"too old resource version: {pos} ({floor})"))
                return pos
            events, pos = got
            self._send(events)
            now = time.monotonic()
            if now >= self.deadline:
                return pos
            if now >= next_bookmark:
                if self.bookmarks:
                    self._bookmark(pos)
                next_bookmark = now + api.bookmark_interval

    def _wait(self, pos: int, next_bookmark: float) -> tuple[tuple[Sequence[WatchEvent], int] | None, int]:
        """(events after `pos` and the version they reach, or None if the history no longer reaches `pos`; the
        history's floor), once there are events or a deadline or bookmark is due."""
        api, store = self.api, self.api.store
        with store.cond:
            while True:
                now = time.monotonic()
                if store.closed or api.closing:
                    return ([], pos), store.floor
                cut = self._drop_at()
                if api.drop_generation != self.drop_generation or (cut is not None and now >= cut):
                    raise WatchDrop()
                got = store.events_after(pos)
                if got is None or got[0] or now >= min(self.deadline, next_bookmark):
                    return got, store.floor
                wake = min(self.deadline, next_bookmark, cut if cut is not None else self.deadline)
                store.cond.wait(max(0.01, wake - now))

    def _send(self, events: Sequence[WatchEvent]) -> None:
        for ev in events:
            if ev.resource != self.res.key:
                continue
            if self.namespace is not None and object_meta(ev.obj).get("namespace", "") != self.namespace:
                continue
            type_, obj = ev.type, ev.obj
            if type_ == "MODIFIED":
                was, now_in = self.match(ev.old or {}), self.match(ev.obj)
                if not was and not now_in:
                    continue
                if was and not now_in and ev.old is not None:
                    # As the watch cache does: DELETED with the previous content at the event's version.
                    type_ = "DELETED"
                    obj = {**ev.old, "metadata": {**object_meta(ev.old), "resourceVersion": str(ev.rv)}}
                elif now_in and not was:
                    type_ = "ADDED"
            elif not self.match(ev.obj):
                continue
            self._emit(type_, obj)

    def _emit(self, type_: str, obj: Mapping[str, Any]) -> None:
        limit = self.api.faults.watch_drop_after_events
        if limit is not None and self.sent >= limit:
            raise WatchDrop()
        if self.as_table is not None and type_ != "ERROR":
            # As the real server: each object as a one-row Table, the columns only in the first event.
            meta = {"resourceVersion": object_meta(obj).get("resourceVersion", "")}
            obj = self.h.table(self.res, [obj], meta, self.as_table, self.query, headers=self.sent == 0)
        elif type_ != "ERROR" and isinstance(obj, dict):
            # the stored object's JSON, made once for every watcher and list (``Store.watch_object``)
            self._write(
                b'{"type":%s,"object":%s}\n' % (json.dumps(type_).encode(), self.api.store.watch_object(self.res, obj))
            )
            self.sent += 1
            return
        self._chunk({"type": type_, "object": obj})
        self.sent += 1

    def _bookmark(self, rv: int) -> None:
        meta = {"resourceVersion": str(rv)}
        self._chunk(
            {
                "type": "BOOKMARK",
                "object": {"kind": self.res.kind, "apiVersion": self.res.api_version, "metadata": meta},
            }
        )

    def _chunk(self, payload: Mapping[str, Any]) -> None:
        self._write(json.dumps(payload, separators=(",", ":")).encode() + b"\n")

    def _write(self, line: bytes) -> None:
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
