"""List + watch reflectors on the official `kubernetes` client: the object source for real clusters and the lab.

Used by the daemon (`kproxy run`) to feed the cache (an `ObjectSink`) with Services, EndpointSlices and this node's
Node. Each kind has one `Reflector` thread that does what client-go's reflector does for upstream kube-proxy:

    list (pages of 500, as client-go's pager), each page into sink.replace_* as it arrives -> mark_synced (once)
      -> watch from the list's RV
      a continue token expired between pages (410)  -> one list without limit (the pager's FullListIfExpired)
      a first page that is not this kind's list with a resourceVersion -> nothing applied; back off and relist
      a later page that fails -> its predecessors were upserted, nothing deleted; back off and relist
      ADDED/MODIFIED -> upsert, DELETED -> delete, BOOKMARK -> remember the resourceVersion only
      watch ended normally or the connection broke -> watch again from the last resourceVersion (no relist)
      410 Expired (ERROR event or HTTP 410)        -> relist; the replace applies deletions missed meanwhile
      connection errors / 5xx                       -> exponential back-off with jitter, then retry

Requests go through the official client's ApiClient (``kproxy.sources.client.list_function``: the generated API
methods' keywords and raw response, without importing CoreV1Api's 20 MB of validators) and the JSON is parsed here:
building the client's model classes for 10,000 objects is far too slow, and the cache wants plain dicts anyway.
A list is streamed into the sink rather than gathered first (client-go's pager gathers it): the sink parses each
object into its compact records and drops the dict, so only one page of raw objects is alive at a time; gathering
100,000 EndpointSlices first held them all beside the cache being built from them (about as much again as the
cache, kept by the process after the list was freed). The next page is not read ahead in a helper thread: tried, it
made the lab's first sync at 100,000 services slower, not faster (the reads compete with the absorbing thread).
The server-side label selector is upstream's (`!service-proxy-name,!headless`, cmd/kube-proxy/app/server.go),
applied to Services and EndpointSlices alike (the EndpointSlice controller copies a Service's labels to its slices).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kubernetes.client import ApiClient, ApiException

from kproxy.gcpause import collector_paused, trim_heap
from kproxy.sources import ObjectSink
from kproxy.sources.client import list_function, make_api_client
from kproxy.sources.selectors import proxy_label_selector

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PAGE_SIZE", "KubeSource", "Reflector", "ReflectorStats", "make_api_client"]

DEFAULT_PAGE_SIZE = 500
# Upstream's reflector picks timeoutSeconds in [minWatchTimeout, 2*minWatchTimeout) with minWatchTimeout = 5 min.
DEFAULT_WATCH_TIMEOUT = 300.0
# A list of at least this many items gives its freed pages back to the OS once applied (kproxy.gcpause.trim_heap).
TRIM_AFTER = 2 * DEFAULT_PAGE_SIZE


class _Expired(Exception):
    """The resourceVersion we hold is gone from the server's history: relist."""


class _Relist(Exception):
    """An ERROR watch event other than 410: state is unknown, relist after a back-off (as client-go does)."""


class _ContinueExpired(Exception):
    """A continue token expired between pages (410): list again without limit (the pager's FullListIfExpired)."""


class _BadList(Exception):
    """A list answer that is not this kind's list (a broken proxy's `200 {}`, another kind, no resourceVersion):
    nothing of it is applied; back off and list again, as for a failed request."""


@dataclass
class ReflectorStats:
    lists: int = 0  # full lists (the first one included)
    watches: int = 0  # watch requests started
    watch_ends: int = 0  # watches that ended normally (server timeout)
    errors: int = 0  # failed requests, broken connections, malformed events, sink failures
    expired: int = 0  # 410s that forced a relist
    expired_pages: int = 0  # continue tokens that expired mid-list (then listed again without limit)
    bad_lists: int = 0  # list answers refused unapplied (not this kind's list, no resourceVersion), also in errors
    events: int = 0  # ADDED/MODIFIED/DELETED applied
    bookmarks: int = 0
    last_rv: str = ""


ListFn = Callable[..., Any]


class Reflector:
    """One list + watch loop for one kind. Run by `KubeSource`, one thread each."""

    def __init__(
        self,
        kind: str,
        list_fn: ListFn,
        *,
        apply_list: Callable[[Iterable[dict[str, Any]]], None],
        upsert: Callable[[Mapping[str, Any]], object],
        delete: Callable[[Mapping[str, Any]], object],
        synced: Callable[[], None],
        api_version: str,
        object_kind: str,
        label_selector: str = "",
        field_selector: str = "",
        backoff: tuple[float, float] = (0.5, 30.0),
        watch_timeout: float = DEFAULT_WATCH_TIMEOUT,
        connect_timeout: float = 10.0,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.kind = kind
        self._list_fn = list_fn
        self._apply_list = apply_list
        self._upsert = upsert
        self._delete = delete
        self._synced_cb = synced
        self._api_version = api_version
        self._object_kind = object_kind
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.backoff = backoff
        self.watch_timeout = watch_timeout
        self.connect_timeout = connect_timeout
        self.page_size = page_size
        self.stats = ReflectorStats()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._rv = ""  # the resourceVersion to watch from; "" means relist
        # The resourceVersion the next list asks for, as client-go's relistResourceVersion: "0" first (any version:
        # the API server may answer from its watch cache, sparing etcd when every node starts at once), then the
        # last list's (not older than that); "" (a consistent read) once the server said a version is gone.
        self._list_rv = "0"
        self._watch_lines = 0  # lines the current watch has delivered
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"reflector-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()  # makes a read blocked in another thread fail now
            except Exception:  # noqa: BLE001 - already closed is fine
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _selectors(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.label_selector:
            kw["label_selector"] = self.label_selector
        if self.field_selector:
            kw["field_selector"] = self.field_selector
        return kw

    def _delay(self, failures: int) -> float:
        base, cap = self.backoff
        delay = min(cap, base * 2.0 ** max(0, failures - 1))
        return min(cap, delay * random.uniform(0.75, 1.25))

    def run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._watch_lines = 0
            try:
                if not self._rv:
                    self._rv = self._list()
                    failures = 0
                started = time.monotonic()
                lines = self._watch()
                self.stats.watch_ends += 1
                if lines == 0 and time.monotonic() - started < 1.0:
                    # A server that ends every watch at once must not make us spin.
                    failures += 1
                    self._stop.wait(self._delay(failures))
                else:
                    failures = 0
            except _Expired:
                self.stats.expired += 1
                log.info("reflector %s: resourceVersion %s expired, relisting", self.kind, self._rv)
                self._rv = self._list_rv = ""
            except Exception as exc:  # noqa: BLE001 - every failure is retried; only stop() ends the loop
                if self._stop.is_set():
                    break
                if isinstance(exc, ApiException) and exc.status == 410:
                    self.stats.expired += 1
                    self._rv = self._list_rv = ""
                    continue
                if _too_large(exc):
                    # The server is behind our resourceVersion (restarted, or another replica): start over.
                    self._rv = self._list_rv = ""
                if isinstance(exc, _Relist):
                    self._rv = ""
                if isinstance(exc, _BadList):
                    self.stats.bad_lists += 1
                if self._watch_lines > 0:
                    failures = 0  # the broken watch had made progress: retry soon, do not keep growing the delay
                self.stats.errors += 1
                failures += 1
                delay = self._delay(failures)
                log.warning(
                    "reflector %s: %s; retrying in %.1fs (%s)",
                    self.kind,
                    _describe(exc),
                    delay,
                    f"watch from {self._rv}" if self._rv else "relist",
                )
                self._stop.wait(delay)

    # --- list

    def _list(self) -> str:
        """List every page into the sink as it arrives (one ``replace`` call, fed page by page), then mark synced.

        Only one page of raw objects is alive at a time: the sink parses each object into its own records and drops
        it, so a list of 100,000 slices is never held whole (raw dicts beside the cache's records). The first page is
        fetched and checked before the sink sees anything: a malformed answer (not this kind's list, no
        resourceVersion; a broken proxy's ``200 {}``) raises `_BadList` with nothing applied. A later page that fails
        ends the sink's iteration with the error: the objects of the pages before it were upserted (they are the
        server's, at the list's version), nothing was deleted (a sink deletes only what a *complete* list lacks) and
        the list is not counted; the reflector backs off and lists again. A continue token that expired between
        pages ends the partial replace the same way, then the list is read again without ``limit`` and replaces it.
        """
        trimmed = 0
        with collector_paused(True):
            try:
                rv, trimmed = self._stream_list(paged=True)
            except _ContinueExpired:
                self.stats.expired_pages += 1
                log.info("reflector %s: continue token expired mid-list; listing without limit", self.kind)
                rv, trimmed = self._stream_list(paged=False)
        if trimmed >= TRIM_AFTER:
            trim_heap()  # the pages' memory, freed by now, back to the OS (see kproxy.gcpause.trim_heap)
        if not self.synced.is_set():
            try:
                self._synced_cb()  # before the event: whoever waited on it finds the sink marked synced
            finally:
                self.synced.set()
        return rv

    def _stream_list(self, *, paged: bool) -> tuple[str, int]:
        """One list (``paged``: in pages of `page_size`, else one request without limit) streamed into the sink;
        the list's resourceVersion and how many items it brought. Errors of the source propagate; the sink's own
        are logged and counted (a sink bug must not stop the reflector)."""
        first = {"resource_version": self._list_rv} if self._list_rv else {}
        kw = {**self._selectors(), **first}
        if paged and self.page_size:
            kw["limit"] = self.page_size
        page, meta = self._page(**kw)
        rv = _list_rv(meta)
        token = _continue(meta) if paged else ""
        failure: list[BaseException] = []
        count = [0]
        try:
            self._apply_list(self._items(page, token, failure, count))
        except Exception:  # noqa: BLE001 - a sink bug must not stop the reflector; the source's own errors re-raise
            if failure:
                raise failure[0] from None
            self.stats.errors += 1
            log.exception("reflector %s: the sink rejected a full list", self.kind)
        if failure:  # a sink that swallowed the source's error: the list is not complete
            raise failure[0]
        self._list_rv = rv
        self.stats.lists += 1
        self.stats.last_rv = rv
        return rv, count[0]

    def _items(
        self, page: list[dict[str, Any]], token: str, failure: list[BaseException], count: list[int]
    ) -> Iterator[dict[str, Any]]:
        """The items of the first page, then of each next one as client-go's pager reads them (following
        ``continue``, the token alone: upstream refuses a resourceVersion beside one). Each page is released once the
        sink has taken it. An error is recorded in ``failure`` before it ends the sink's iteration, so the caller can
        tell it from the sink's own; an expired token (410 on a later page) is `_ContinueExpired`."""
        try:
            while True:
                count[0] += len(page)
                yield from page
                # what the sink built from this page lives on: out of the pause's later walks
                collector_paused.keep()
                if not token:
                    return
                page = []  # the next page replaces this one: never two pages at once
                try:
                    page, meta = self._page(**self._selectors(), limit=self.page_size, _continue=token)
                except ApiException as exc:
                    if exc.status == 410:
                        raise _ContinueExpired() from None
                    raise
                token = _continue(meta)
        except Exception as exc:
            failure.append(exc)
            raise

    def _page(self, **kw: Any) -> tuple[list[dict[str, Any]], Mapping[str, Any]]:
        """One list request: its checked items (with kind and apiVersion, as watched objects) and metadata. The
        body is read without the response keeping a copy (the client holds its last response until its next call)."""
        resp = self._list_fn(_preload_content=False, _request_timeout=(self.connect_timeout, 60.0), **kw)
        try:
            body = json.loads(resp.read(decode_content=True))
        except ValueError as exc:
            raise _BadList(f"list response is not JSON ({exc})") from None
        finally:
            resp.release_conn()
        page, meta = self._check_page(body)
        del body
        items = []
        for item in page:
            if isinstance(item, dict):
                # List items come without kind/apiVersion; give them the same shape as watched objects.
                item.setdefault("apiVersion", self._api_version)
                item.setdefault("kind", self._object_kind)
                items.append(item)
        return items, meta

    def _check_page(self, body: Any) -> tuple[list[Any], Mapping[str, Any]]:
        """One page's items and metadata, once the page is known to be this kind's list; `_BadList` otherwise."""
        want = f"{self._object_kind}List"
        if not isinstance(body, dict):
            raise _BadList(f"list response is a JSON {type(body).__name__}, not an object")
        kind, api_version = body.get("kind"), body.get("apiVersion")
        if kind != want or api_version != self._api_version:
            got = f"{_short(kind)} {_short(api_version)}"
            raise _BadList(f"list response is kind {got}, not {want} {self._api_version}")
        meta = body.get("metadata")
        if not isinstance(meta, dict):
            raise _BadList("list response without metadata")
        items = body.get("items")
        if items is None:
            return [], meta  # an empty list may come as null (a nil slice on the server)
        if not isinstance(items, list):
            raise _BadList(f"list response's items are a {type(items).__name__}, not a list")
        return items, meta

    # --- watch

    def _watch(self) -> int:
        """One watch from self._rv; returns how many lines it got. self._rv follows every event and bookmark."""
        timeout = int(self.watch_timeout * random.uniform(1.0, 2.0)) or 1
        self.stats.watches += 1
        resp = self._list_fn(
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self._rv,
            timeout_seconds=timeout,
            _preload_content=False,
            _request_timeout=(self.connect_timeout, timeout + 30.0),
            **self._selectors(),
        )
        with self._resp_lock:
            self._resp = resp
        if self._stop.is_set():
            resp.shutdown()
        lines = 0
        try:
            for line in _lines(resp):
                lines += 1
                self._watch_lines = lines
                self._handle(line)
        finally:
            with self._resp_lock:
                self._resp = None
            resp.release_conn()
        return lines

    def _handle(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            type_ = event["type"]
            obj = event["object"]
            meta = obj.get("metadata") or {}
        except (ValueError, KeyError, TypeError, AttributeError):
            self.stats.errors += 1
            log.warning("reflector %s: skipping a malformed watch event: %.200r", self.kind, line)
            return
        if type_ == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Expired()
            raise _Relist(f"watch ERROR event: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        new_rv = str(meta.get("resourceVersion") or self._rv)
        if type_ == "BOOKMARK":
            self.stats.bookmarks += 1
        elif type_ in ("ADDED", "MODIFIED", "DELETED"):
            try:
                (self._delete if type_ == "DELETED" else self._upsert)(obj)
                self.stats.events += 1
            except Exception:  # noqa: BLE001 - one bad object or sink bug must not end the watch
                self.stats.errors += 1
                log.exception("reflector %s: applying %s %s failed", self.kind, type_, _short(meta.get("name")))
        else:
            self.stats.errors += 1
            log.warning("reflector %s: unknown watch event type %r", self.kind, type_)
            return
        self._rv = self.stats.last_rv = new_rv


def _lines(resp: Any) -> Iterator[bytes]:
    """The lines of a chunked watch response as they arrive (chunks need not align with lines)."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=True):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf


def _continue(meta: Mapping[str, Any]) -> str:
    token = meta.get("continue") or ""
    if not isinstance(token, str):
        raise _BadList(f"metadata.continue is a {type(token).__name__}, not a string")
    return token


def _list_rv(meta: Mapping[str, Any]) -> str:
    rv = meta.get("resourceVersion")
    if not isinstance(rv, str) or not rv:
        raise _BadList("list response without a resourceVersion")
    return rv


def _too_large(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 504 and "Too large resource version" in str(exc.body or "")


def _short(value: Any) -> str:
    """A value from a server's answer, for a log line: repr'd (control characters escaped) and bounded."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:60])
    return f"<{type(value).__name__}>"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _ns_name(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class KubeSource:
    """Three reflectors (Services, EndpointSlices, this node's Node) feeding one sink."""

    def __init__(
        self,
        sink: ObjectSink,
        api_client: ApiClient,
        node_name: str,
        *,
        service_proxy_name: str = "",
        resync_backoff: tuple[float, float] = (0.5, 30.0),
        watch_timeout: float = DEFAULT_WATCH_TIMEOUT,
        page_size: int = DEFAULT_PAGE_SIZE,
        on_stop: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.sink = sink
        self.node_name = node_name
        self._on_stop = tuple(on_stop)  # what else ends with the source (the daemon's event recorder)
        self.label_selector = proxy_label_selector(service_proxy_name)
        common: dict[str, Any] = {"backoff": resync_backoff, "watch_timeout": watch_timeout, "page_size": page_size}

        def node_list(items: Iterable[dict[str, Any]]) -> None:
            mine = [i for i in items if (i.get("metadata") or {}).get("name") == node_name]
            sink.set_node(mine[0] if mine else None)

        self.reflectors: dict[str, Reflector] = {
            "services": Reflector(
                "services",
                list_function(api_client, "/api/v1/services"),
                apply_list=sink.replace_services,
                upsert=sink.upsert_service,
                delete=lambda o: sink.delete_service(*_ns_name(o)),
                synced=lambda: sink.mark_synced("services"),
                api_version="v1",
                object_kind="Service",
                label_selector=self.label_selector,
                **common,
            ),
            "endpointslices": Reflector(
                "endpointslices",
                list_function(api_client, "/apis/discovery.k8s.io/v1/endpointslices"),
                apply_list=sink.replace_slices,
                upsert=sink.upsert_slice,
                delete=lambda o: sink.delete_slice(*_ns_name(o)),
                synced=lambda: sink.mark_synced("endpointslices"),
                api_version="discovery.k8s.io/v1",
                object_kind="EndpointSlice",
                label_selector=self.label_selector,
                **common,
            ),
            "nodes": Reflector(
                "nodes",
                list_function(api_client, "/api/v1/nodes"),
                apply_list=node_list,
                upsert=lambda o: sink.set_node(o),
                delete=lambda _o: sink.set_node(None),
                synced=lambda: sink.mark_synced("nodes"),
                api_version="v1",
                object_kind="Node",
                field_selector=f"metadata.name={node_name}",
                **common,
            ),
        }

    def start(self) -> KubeSource:
        for reflector in self.reflectors.values():
            reflector.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        for reflector in self.reflectors.values():
            reflector._stop.set()
        for reflector in self.reflectors.values():
            reflector.stop(timeout)
        for stop in self._on_stop:
            stop()

    @property
    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors.values())

    def wait_synced(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for reflector in self.reflectors.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not reflector.synced.wait(left):
                return False
        return True

    def stats(self) -> dict[str, dict[str, Any]]:
        return {kind: asdict(r.stats) for kind, r in self.reflectors.items()}
