"""An in-memory stand-in for kube-apiserver: the API kproxy watches, for the lab and for tests.

There is no kube-apiserver on the development machine, so the lab cluster, the conformance suite and
the source/reflector tests talk to this server instead. It speaks enough of the real protocol for the OFFICIAL
`kubernetes` Python client (CoreV1Api, DiscoveryV1Api, EventsV1Api), for kproxy's reflectors and for kubectl
(`kubectl get` gets the same columns as from a real cluster). Its parts, imported here under one name:

- ``kproxy.lab.apistore``: the objects, resourceVersions, watch history, selectors and fault settings (``Store``,
  ``Faults``), over ``kproxy.lab.apiobjects`` (resources, ``ApiError``, patches) and ``kproxy.lab.apialloc``
  (Service defaults, clusterIP and nodePort allocation);
- ``kproxy.lab.apihttp``: the HTTP server over a store (``ApiServer``, ``serve``, ``parse_listen``), with paginated
  lists (``kproxy.lab.apipages``), watches (``kproxy.lab.apiwatch``), routes and discovery
  (``kproxy.lab.apiroutes``) and the Table view of ``kproxy.lab.apitable`` for kubectl;
- ``kproxy.lab.apicli``: `kproxy apiserver` (``register``, ``main``), the only part `kproxy` loads at start.

Run as `kproxy apiserver` or `python -m kproxy.lab.apiserver` (the lab starts it so).
"""

from __future__ import annotations

from kproxy.lab.apicli import main, register, run_command
from kproxy.lab.apihttp import ApiServer, Listen, RequestRecord, parse_listen, serve
from kproxy.lab.apistore import (
    DEFAULT_HISTORY,
    DEFAULT_SERVICE_CIDRS,
    NODE_PORT_RANGE,
    RESOURCES,
    ApiError,
    Faults,
    Resource,
    Store,
    WatchEvent,
    json_patch,
    merge_patch,
    resource_for,
    status_body,
)
from kproxy.lab.apitable import table, table_version

__all__ = [
    "DEFAULT_HISTORY",
    "DEFAULT_SERVICE_CIDRS",
    "NODE_PORT_RANGE",
    "RESOURCES",
    "ApiError",
    "ApiServer",
    "Faults",
    "Listen",
    "RequestRecord",
    "Resource",
    "Store",
    "WatchEvent",
    "json_patch",
    "main",
    "merge_patch",
    "parse_listen",
    "register",
    "resource_for",
    "run_command",
    "serve",
    "status_body",
    "table",
    "table_version",
]

if __name__ == "__main__":
    raise SystemExit(main())
