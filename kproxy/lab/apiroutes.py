"""The API stand-in's addresses and paths: listen sockets (optionally inside a network namespace), the REST
routes of the served resources, and the discovery documents kubectl reads before it lists anything.

Pure but for ``make_socket``, which binds (inside a named network namespace if one is given: the socket stays
bound to that namespace, so one stand-in serves the lab's nodes and the test process alike).
"""

from __future__ import annotations

import socket
from typing import Any, NamedTuple

from kproxy.lab.apistore import RESOURCE_BY_PATH, RESOURCES, Resource


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


_SHORT_NAMES = {"services": ["svc"], "nodes": ["no"], "events": ["ev"]}
_DISCOVERY_GROUPS = {
    "discovery.k8s.io": ["v1"],
    "events.k8s.io": ["v1"],
}


def discovery(path: str) -> dict[str, Any] | None:
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


def route_of(path: str) -> tuple[Resource, str | None, str | None, str | None, bool] | None:
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


def make_socket(listen: Listen) -> socket.socket:
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
