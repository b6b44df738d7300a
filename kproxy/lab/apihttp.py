"""The API stand-in's HTTP side: REST verbs, lists, the request log, faults and the server object (`ApiServer`).

Speaks enough of kube-apiserver's protocol over one ``kproxy.lab.apistore.Store`` for the OFFICIAL `kubernetes`
Python client, kproxy's reflectors and kubectl: list (labelSelector, fieldSelector, limit/continue as
``kproxy.lab.apipages`` serves them, resourceVersion + resourceVersionMatch), get, create, replace,
merge/strategic/JSON patch, delete, with the real server's Status bodies; watch=true (``kproxy.lab.apiwatch``);
discovery for kubectl (``kproxy.lab.apiroutes``); and, when the Accept header asks for it, the ``meta.k8s.io``
Table that `kubectl get` prints (``kproxy.lab.apitable``). Faults (``Faults``, also over HTTP at /_faults) are
applied here: requests failed with 500/503 or delayed, lists answered 200 with a malformed body (``bad_list``),
watches cut; every request is logged (``ApiServer.requests``, GET /_requests). POST /_bulk loads many objects at
once (a scale run's setup; what clients list and watch is unchanged).

One process may listen on several sockets, each optionally inside a named network namespace, so the lab's nodes
and the test process on 127.0.0.1 reach the same store.
"""

from __future__ import annotations

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
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kproxy.lab.apipages import Pager
from kproxy.lab.apiroutes import Listen, discovery, make_socket, parse_listen, route_of
from kproxy.lab.apistore import (
    DEFAULT_HISTORY,
    DEFAULT_SERVICE_CIDRS,
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
from kproxy.lab.apiwatch import WatchDrop, WatchStream

__all__ = ["ApiServer", "Listen", "RequestRecord", "parse_listen", "serve"]

log = logging.getLogger("kproxy.lab.apiserver")  # one logger name for the stand-in, whichever module logs


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    time: float
    status: int = 0
    client: str = ""  # the client's address: which lab node asked

    @property
    def watch(self) -> bool:
        return self.query.get("watch", "").lower() in ("true", "1")


# --------------------------------------------------------------------------------------------------------------------
# HTTP


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


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
        if self.record is not None:
            self.record.status = code

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
        self.record: RequestRecord | None = None
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
            if path == "/_bulk" and method == "POST":
                self._send_json(200, api.bulk(self._body()))
                return
            if path == "/_requests":
                last = int(query.get("limit") or 500)  # the newest `limit` (default 500; the log keeps 10,000)
                self._send_json(200, [asdict(r) for r in list(api.requests)[-last:]] if last > 0 else [])
                return
            record = RequestRecord(method, path, query, time.time(), client=str(self.client_address[0]))
            self.record = record
            api.requests.append(record)
            api.inject_faults()
            found = discovery(path)
            if found is not None:
                self._send_json(200, found)
                return
            self._api(method, path, query)
        except ApiError as exc:
            self._send_json(exc.code, exc.status())
        except WatchDrop:
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
        route = route_of(path)
        if route is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        res, namespace, name, sub, watch_path = route
        store = self.server.api.store
        if sub is not None and not (sub == "status" and res.status_subresource):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if name is None:
            if method == "GET":
                if watch_path or _truthy(query.get("watch")):
                    WatchStream(self, res, namespace, None, query).run()
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
                WatchStream(self, res, namespace, name, query).run()
                return
            obj = store.get(res.key, namespace, name)
            as_table = self.table_version()
            if as_table is not None:
                meta = {"resourceVersion": object_meta(obj).get("resourceVersion", "")}
                self._send_json(200, self.table(res, [obj], meta, as_table, query))
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
        label_sel, field_sel = query.get("labelSelector", ""), query.get("fieldSelector", "")
        match = selector_matcher(label_sel, field_sel)
        page, meta = api.pager.list(res, namespace, query, match, bool(label_sel or field_sel))
        as_table = self.table_version()
        if as_table is not None:
            self._send_json(200, self.table(res, page, meta, as_table, query))
            return
        # Like the real server, list items carry no kind/apiVersion. Each item's JSON is the store's, made once per
        # object version (``Store.list_item``): a page is its envelope and those bytes, joined.
        envelope = {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta}
        head = json.dumps(envelope, separators=(",", ":")).encode()[:-1]  # without its closing brace
        items = b",".join(api.store.list_item(res, obj) for obj in page)
        self._send_bytes(200, b"".join((head, b',"items":[', items, b"]}")), "application/json")

    # --- Table (kubectl get)

    def table_version(self) -> str | None:
        return table_version(self.headers.get("Accept"))

    @staticmethod
    def table(
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
        self.pager = Pager(self.store)
        self._lock = threading.Lock()

    # --- listening

    def listen(self, listen: Listen) -> int:
        sock = make_socket(listen)
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

    # --- loading

    def bulk(self, body: Any) -> dict[str, Any]:
        """POST /_bulk: create every object of ``{"items": [...]}`` (Services, EndpointSlices, ... as the API
        returns them), or with ``"replace": true`` replace existing ones (no resourceVersion precondition), far
        faster than one request each: a scale run loads and churns its objects so, while kproxy lists and watches
        them through the ordinary API. Answers ``{"created" or "replaced": N, "failures": [Status + index]}``."""
        items = body.get("items") if isinstance(body, Mapping) else None
        if not isinstance(items, list):
            raise ApiError(400, "BadRequest", 'a bulk load is {"items": [objects]}')
        if isinstance(body, Mapping) and body.get("replace"):
            replaced, failures = self.store.replace_many(items)
            return {"replaced": replaced, "failures": failures}
        created, failures = self.store.create_many(items)
        return {"created": created, "failures": failures}

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
