"""The API stand-in's HTTP side: REST routes, lists, watches, discovery and the server object (`ApiServer`).

Speaks enough of kube-apiserver's protocol over one ``kproxy.lab.apistore.Store`` for the OFFICIAL `kubernetes`
Python client, kproxy's reflectors and kubectl: list (labelSelector, fieldSelector, limit/continue with consistent
snapshots, resourceVersion + resourceVersionMatch), get, create, replace, merge/strategic/JSON patch, delete, with
the real server's Status bodies; watch=true as chunked JSON lines (ADDED/MODIFIED/DELETED from a resourceVersion,
BOOKMARKs every few seconds and before a timeout closes the stream, objects leaving a label selector sent as
DELETED and entering it as ADDED, as the watch cache does, and an ERROR event with 410 Expired for a
resourceVersion older than the kept history); discovery for kubectl; and, when the Accept header asks for it, the
``meta.k8s.io`` Table that `kubectl get` prints (``kproxy.lab.apitable``). Faults (``Faults``, also over HTTP at
/_faults) are applied here: watches dropped after N events or T seconds, requests failed with 500/503 or
delayed, lists answered 200 with a malformed body (``bad_list``); every request is logged (``ApiServer.requests``,
GET /_requests).

One process may listen on several sockets, each optionally inside a named network namespace, so the lab's nodes
and the test process on 127.0.0.1 reach the same store.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from kproxy.lab.apistore import (
    DEFAULT_HISTORY,
    DEFAULT_SERVICE_CIDRS,
    RESOURCE_BY_PATH,
    RESOURCES,
    ApiError,
    Faults,
    Resource,
    Store,
    object_meta,
    resource_for,
    selector_matcher,
    status_body,
)
from kproxy.lab.apitable import INCLUDE_OBJECT, table, table_version

log = logging.getLogger("kproxy.lab.apiserver")  # one logger name for the stand-in, whichever module logs


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
        self._send_bytes(code, json.dumps(body, separators=(",", ":")).encode(), "application/json")

    def _send_bytes(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
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
            obj = store.get(res.key, namespace, name)
            as_table = self._table_version()
            if as_table is not None:
                meta = {"resourceVersion": object_meta(obj).get("resourceVersion", "")}
                self._send_json(200, self._table(res, [obj], meta, as_table, query))
                return
            self._send_json(200, obj)
        elif method == "PUT":
            body = self._body()
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "request body must be an object")
            if object_meta(body).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            body = dict(body)
            body["metadata"] = {**object_meta(body), "name": name}
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
                details = {"name": name, "group": res.group, "kind": res.plural, "uid": object_meta(gone).get("uid")}
                self._send_json(200, status_body(200, "", "", details))
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    def _list(self, res: Resource, namespace: str | None, query: dict[str, str]) -> None:
        api = self.server.api
        bad = api.bad_list_answer(res)
        if bad is not None:
            self._send_bytes(200, *bad)
            return
        match = selector_matcher(query.get("labelSelector", ""), query.get("fieldSelector", ""))
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
        as_table = self._table_version()
        if as_table is not None:
            self._send_json(200, self._table(res, page, meta, as_table, query))
            return
        body = {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": meta,
            # Like the real server, list items carry no kind/apiVersion.
            "items": [{k: v for k, v in obj.items() if k not in ("kind", "apiVersion")} for obj in page],
        }
        self._send_json(200, body)

    # --- Table (kubectl get)

    def _table_version(self) -> str | None:
        return table_version(self.headers.get("Accept"))

    @staticmethod
    def _table(
        res: Resource,
        objects: Iterable[Mapping[str, Any]],
        meta: Mapping[str, Any],
        version: str,
        query: Mapping[str, str],
        headers: bool = True,
    ) -> dict[str, Any]:
        include = query.get("includeObject") or "Metadata"
        if include not in INCLUDE_OBJECT:
            raise ApiError(
                400, "BadRequest", f"includeObject: unsupported value {include!r}, want one of {INCLUDE_OBJECT}"
            )
        return table(res, objects, meta, version=version, include_object=include, headers=headers)

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
        match = selector_matcher(label_sel, fs)
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

        as_table = self._table_version()
        if as_table is not None:
            self._table(res, [], {}, as_table, query)  # a bad includeObject is a 400 before the stream starts
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
            if as_table is not None and type_ != "ERROR":
                # As the real server: each object as a one-row Table, the columns only in the first event.
                meta = {"resourceVersion": object_meta(obj).get("resourceVersion", "")}
                obj = self._table(res, [obj], meta, as_table, query, headers=sent == 0)
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
                ns = object_meta(ev.obj).get("namespace", "")
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
                        obj = {**ev.old, "metadata": {**object_meta(ev.old), "resourceVersion": str(ev.rv)}}
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
    res = RESOURCE_BY_PATH.get((group, version, rest[0]))
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

    def bad_list_answer(self, res: Resource) -> tuple[bytes, str] | None:
        """The `bad_list` fault: the malformed 200 answer (body, content type) this list gets, or None."""
        faults = self.faults
        with self._lock:
            shape = faults.bad_list
            if not shape:
                return None
            if faults.bad_list_next > 0:
                faults.bad_list_next -= 1
                if faults.bad_list_next == 0:
                    faults.bad_list = ""  # that was the last one
        if shape == "not_json":
            return b"<html><body>502 Bad Gateway</body></html>", "text/html"
        meta = {"resourceVersion": str(self.store.resource_version)}
        body: dict[str, Any] = {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": []}
        if shape == "empty":
            body = {}
        elif shape == "wrong_kind":
            body["kind"] = "EventList"
        elif shape == "no_resource_version":
            body["metadata"] = {}
        elif shape == "items_not_a_list":
            body["items"] = {}
        return json.dumps(body).encode(), "application/json"

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
                log.info("apiserver: skipping %s %s (kind not served)", obj.get("kind"), object_meta(obj).get("name"))
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
