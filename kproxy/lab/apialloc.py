"""The API stand-in's Service defaults and allocations, as the real registry makes them.

A Service gets the registry's defaults (type, sessionAffinity, internalTrafficPolicy, protocol, targetPort), a
clusterIP per family from the service CIDRs (any size: a /12 holds 1,048,574 addresses, as kube-apiserver's
default 10.96.0.0/12; the lab gives ranges from 198.18.0.0/15 and fd00:198:18::/48), nodePorts from 30000-32767
(once per number across Services, once per protocol within one) and a healthCheckNodePort for an
``externalTrafficPolicy: Local`` load balancer. An update keeps the allocated values it leaves out, as the
registry's patchAllocatedValues does, and a failed allocation gives back what it took. Not thread-safe: the store
calls it under its lock.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Iterable, Mapping
from typing import Any

from kproxy.lab.apiobjects import ApiError, object_meta

NODE_PORT_RANGE = (30000, 32767)
NODE_PORT_TYPES = ("NodePort", "LoadBalancer")  # the types that hold nodePorts


class ServiceAllocator:
    """The clusterIPs and nodePorts in use, and the cursor of the next free clusterIP per family."""

    def __init__(self, service_cidrs: Iterable[str]) -> None:
        self._nets = [ipaddress.ip_network(c) for c in service_cidrs]
        self._ips_used: set[str] = set()
        self._ports_used: set[int] = set()
        self._ip_cursor: dict[int, int] = {}

    def default_service(self, svc: dict[str, Any], old: dict[str, Any] | None) -> None:
        spec = svc.setdefault("spec", {})
        old_spec = (old or {}).get("spec", {})
        typ = spec.setdefault("type", "ClusterIP")
        if typ == "ExternalName":
            # ExternalName services have no cluster IP or node ports; give back any the old version held.
            if old is not None:
                self.release(old)
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
        if typ not in NODE_PORT_TYPES:
            for port in spec.get("ports") or []:
                if port.get("nodePort"):
                    raise ApiError(
                        422,
                        "Invalid",
                        f'Service "{object_meta(svc).get("name")}" is invalid: spec.ports[].nodePort: Forbidden: '
                        f"may not be used when `type` is '{typ}'",
                    )
        if old is not None:
            # Allocated values that an update leaves out are kept (the registry's patchAllocatedValues), the
            # nodePorts and the healthCheckNodePort only while the new type still needs them: a NodePort Service
            # turned ClusterIP gives its ports back (kept, they would be a second owner of a port reallocated later)
            for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
                if key in old_spec and not spec.get(key):
                    spec[key] = old_spec[key]
            local_lb = typ == "LoadBalancer" and spec.get("externalTrafficPolicy") == "Local"
            if local_lb and old_spec.get("healthCheckNodePort") and not spec.get("healthCheckNodePort"):
                spec["healthCheckNodePort"] = old_spec["healthCheckNodePort"]
            old_ports = {(p.get("port"), p.get("protocol")): p.get("nodePort") for p in old_spec.get("ports") or []}
            for port in spec.get("ports") or []:
                kept = old_ports.get((port.get("port"), port.get("protocol")))
                if typ in NODE_PORT_TYPES and not port.get("nodePort") and kept:
                    port["nodePort"] = kept
            if old_spec.get("clusterIP") and spec.get("clusterIP") != old_spec.get("clusterIP"):
                raise ApiError(
                    422,
                    "Invalid",
                    f'Service "{object_meta(svc).get("name")}" is invalid: spec.clusterIPs[0]: field is immutable',
                )
            self.release(old)
        try:
            self._allocate(svc, typ)
        except ApiError:
            if old is not None:
                self.claim(old)
            raise

    def claim(self, svc: Mapping[str, Any]) -> None:
        spec = svc.get("spec") or {}
        for ip in spec.get("clusterIPs") or []:
            if ip and ip != "None":
                self._ips_used.add(ip)
        for port in spec.get("ports") or []:
            if port.get("nodePort"):
                self._ports_used.add(int(port["nodePort"]))
        if spec.get("healthCheckNodePort"):
            self._ports_used.add(int(spec["healthCheckNodePort"]))

    def release(self, svc: Mapping[str, Any]) -> None:
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
            if typ in NODE_PORT_TYPES:
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
                    if spec.get("externalTrafficPolicy") == "Local":
                        hc = int(spec.get("healthCheckNodePort") or 0)
                        if hc and hc in self._ports_used:
                            raise ApiError(
                                422,
                                "Invalid",
                                f'Service "{name}" is invalid: spec.healthCheckNodePort: Invalid value: {hc}: '
                                "provided port is already allocated",
                            )
                        spec["healthCheckNodePort"] = hc or self._next_port()
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
