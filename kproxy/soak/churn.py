"""The soak's objects and the change generator: a seeded, bounded stream of writes to Services and EndpointSlices.

``Churn`` keeps a model of every service it made (ports, families, policies, endpoints drawn from the lab's pods)
and turns one random step into the API writes that carry it (``Write``). Every service has the TCP port ``p0``
(80 -> 8080); some have a UDP port ``u0`` on the same number (80 -> 8080/UDP) and a second TCP port ``p1``
(81 -> 8081). Steps: create, delete, scale up/down, a readiness flip, an internalTrafficPolicy flip, a
session-affinity flip, the second port or the UDP port added or removed, a type flip (ClusterIP <-> NodePort) and
bad objects: a new Service or EndpointSlice the API takes but kproxy must reject
(a bad address, protocol or port, quotes and newlines in names of ports), later repaired or deleted.

Why bad objects are always *new* objects: kproxy keeps the last good version of an object whose update is invalid,
and the soak's expectation is computed from what the API holds now (``kproxy.soak.expect``), which has no memory
of earlier versions; a bad object under a fresh name has the same meaning in both (rejected, nothing else touched).

Pure (no I/O): ``kproxy.soak.run`` sends the writes, tests/unit/test_soak.py checks the model.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NAMESPACE = "soak"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "soak.kproxy.example"
ANCHOR = "anchor"  # the service the traffic runs through; never churned
TARGET_PORT = 8080  # the lab's echo servers answer on 8080, 8081 and 9000
SECOND_PORT = (81, 8081)


@dataclass(frozen=True)
class PodRef:
    """A lab pod as the churn needs it (kproxy.lab.cluster.LabPod has these fields)."""

    name: str
    node: str
    ip4: str
    ip6: str


@dataclass(frozen=True)
class Write:
    """One API call: ``put`` an object (create or replace) or ``delete`` one (``obj`` then names it)."""

    verb: str  # "put" | "delete"
    obj: dict[str, Any]
    step: str  # which churn step made it (for the report)

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def service(self) -> str:
        """The name of the Service this write is about (a slice's label; a slice deletion names no label, but every
        slice the churn makes is called ``<service>-<suffix>``)."""
        if self.kind == "Service":
            return self.name
        label = (self.obj["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
        return str(label) if label else self.name.rsplit("-", 1)[0]


@dataclass
class ServiceModel:
    name: str
    families: list[str]
    itp: str = "Cluster"
    affinity: bool = False
    type: str = "ClusterIP"
    second_port: bool = False
    udp: bool = False
    # per family ("IPv4"/"IPv6"): pod name -> ready
    endpoints: dict[str, dict[str, bool]] = field(default_factory=dict)


def service_object(m: ServiceModel) -> dict[str, Any]:
    ports: list[dict[str, Any]] = [{"name": "p0", "port": 80, "targetPort": TARGET_PORT, "protocol": "TCP"}]
    if m.second_port:
        ports.append({"name": "p1", "port": SECOND_PORT[0], "targetPort": SECOND_PORT[1], "protocol": "TCP"})
    if m.udp:
        ports.append({"name": "u0", "port": 80, "targetPort": TARGET_PORT, "protocol": "UDP"})
    spec: dict[str, Any] = {
        "type": m.type,
        "ports": ports,
        "ipFamilies": list(m.families),
        "ipFamilyPolicy": "RequireDualStack" if len(m.families) > 1 else "SingleStack",
        "internalTrafficPolicy": m.itp,
        "sessionAffinity": "ClientIP" if m.affinity else "None",
    }
    if m.type == "NodePort":
        spec["externalTrafficPolicy"] = "Cluster"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": m.name, "namespace": NAMESPACE},
        "spec": spec,
    }


def slice_object(m: ServiceModel, family: str, pods: dict[str, PodRef]) -> dict[str, Any]:
    suffix = "v6" if family == "IPv6" else "v4"
    ports = [{"name": "p0", "port": TARGET_PORT, "protocol": "TCP"}]
    if m.second_port:
        ports.append({"name": "p1", "port": SECOND_PORT[1], "protocol": "TCP"})
    if m.udp:
        ports.append({"name": "u0", "port": TARGET_PORT, "protocol": "UDP"})
    endpoints = []
    for pod_name, ready in sorted(m.endpoints.get(family, {}).items()):
        pod = pods[pod_name]
        endpoints.append(
            {
                "addresses": [pod.ip6 if family == "IPv6" else pod.ip4],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "nodeName": pod.node,
                "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod.name},
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{m.name}-{suffix}",
            "namespace": NAMESPACE,
            "labels": {SERVICE_NAME_LABEL: m.name, MANAGED_BY_LABEL: MANAGED_BY},
        },
        "addressType": family,
        "endpoints": endpoints,
        "ports": ports,
    }


def _ref(kind: str, name: str) -> dict[str, Any]:
    api = "v1" if kind == "Service" else "discovery.k8s.io/v1"
    return {"apiVersion": api, "kind": kind, "metadata": {"name": name, "namespace": NAMESPACE}}


# Values kproxy must refuse while the API stand-in stores them (it validates little, as a broken admission chain or
# an old apiserver would let through): the soak's "bad objects".
BAD_ADDRESSES = ("198.18.65.300", "not-an-ip", "198.18.65.1/24", "fd00::zz")
BAD_SERVICE_PORTS: tuple[dict[str, Any], ...] = (
    {"name": "p0", "port": 80, "targetPort": 8080, "protocol": "BOGUS"},
    {"name": "p0", "port": 70000, "targetPort": 8080, "protocol": "TCP"},
    {"name": 'p0"; -j ACCEPT #', "port": 80, "targetPort": 8080, "protocol": "TCP"},
    {"name": "p0\n}", "port": 80, "targetPort": 8080, "protocol": "TCP"},
)


class Churn:
    """The change generator (see the module docstring). ``step()`` returns the writes of one random step."""

    def __init__(
        self,
        pods: Sequence[PodRef],
        *,
        ipv6: bool = True,
        seed: int = 1,
        min_services: int = 8,
        max_services: int = 40,
    ) -> None:
        if not pods:
            raise ValueError("the churn needs at least one pod")
        self.pods = {p.name: p for p in pods}
        self.ipv6 = ipv6
        self.rng = random.Random(seed)
        self.min_services = min_services
        self.max_services = max_services
        self.services: dict[str, ServiceModel] = {}
        self.bad: set[tuple[str, str]] = set()  # (kind, name) of bad objects present in the API
        self._seq = 0

    # -- objects --------------------------------------------------------------------------------------------

    def anchor(self) -> list[Write]:
        """The traffic's service: every pod, IPv4 (and IPv6), never changed by ``step``."""
        fams = ["IPv4", "IPv6"] if self.ipv6 else ["IPv4"]
        m = ServiceModel(ANCHOR, fams, endpoints={f: {p: True for p in self.pods} for f in fams})
        return self._put_all(m, "anchor")

    def initial(self, count: int) -> list[Write]:
        out: list[Write] = []
        for _ in range(count):
            out += self._create()
        return out

    def objects(self, m: ServiceModel) -> list[dict[str, Any]]:
        return [service_object(m)] + [slice_object(m, f, self.pods) for f in m.families]

    def _put_all(self, m: ServiceModel, step: str) -> list[Write]:
        return [Write("put", obj, step) for obj in self.objects(m)]

    # -- steps ----------------------------------------------------------------------------------------------

    STEPS = (
        ("create", 3),
        ("delete", 2),
        ("scale_up", 4),
        ("scale_down", 4),
        ("ready_flip", 3),
        ("policy_flip", 2),
        ("affinity_flip", 1),
        ("port_flip", 1),
        ("udp_flip", 1),
        ("type_flip", 1),
        ("bad_object", 1),
        ("bad_repair", 1),
    )

    def step(self) -> list[Write]:
        """One random step's writes (never empty: a step that cannot apply falls back to a scale)."""
        names, weights = zip(*self.STEPS, strict=True)
        for _ in range(10):
            kind = self.rng.choices(names, weights)[0]
            writes = getattr(self, "_" + kind)()
            if writes:
                return list(writes)
        return self._create() or self._scale_up()

    def _pick(self) -> ServiceModel | None:
        if not self.services:
            return None
        return self.services[self.rng.choice(sorted(self.services))]

    def _create(self) -> list[Write]:
        if len(self.services) >= self.max_services:
            return []
        self._seq += 1
        fams = ["IPv4", "IPv6"] if self.ipv6 and self.rng.random() < 0.3 else ["IPv4"]
        pods = sorted(self.pods)
        m = ServiceModel(f"s{self._seq:04d}", fams, udp=self.rng.random() < 0.4)
        for fam in fams:
            chosen = self.rng.sample(pods, self.rng.randint(0, min(3, len(pods))))
            m.endpoints[fam] = {p: self.rng.random() < 0.9 for p in chosen}
        self.services[m.name] = m
        return self._put_all(m, "create")

    def _delete(self) -> list[Write]:
        if len(self.services) <= self.min_services:
            return []
        m = self._pick()
        assert m is not None
        del self.services[m.name]
        # the slices first, as the endpoint-slice controller and garbage collector leave them: either order must work
        slices = [Write("delete", _ref("EndpointSlice", f"{m.name}-{f[-2:].lower()}"), "delete") for f in m.families]
        writes = slices + [Write("delete", _ref("Service", m.name), "delete")]
        if self.rng.random() < 0.5:
            writes.reverse()
        return writes

    def _slice_write(self, m: ServiceModel, fam: str, step: str) -> list[Write]:
        return [Write("put", slice_object(m, fam, self.pods), step)]

    def _scale_up(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        fam = self.rng.choice(m.families)
        free = sorted(set(self.pods) - set(m.endpoints.get(fam, {})))
        if not free:
            return []
        m.endpoints.setdefault(fam, {})[self.rng.choice(free)] = True
        return self._slice_write(m, fam, "scale_up")

    def _scale_down(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        fam = self.rng.choice(m.families)
        present = sorted(m.endpoints.get(fam, {}))
        if not present:
            return []
        del m.endpoints[fam][self.rng.choice(present)]
        return self._slice_write(m, fam, "scale_down")

    def _ready_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        fam = self.rng.choice(m.families)
        present = sorted(m.endpoints.get(fam, {}))
        if not present:
            return []
        pod = self.rng.choice(present)
        m.endpoints[fam][pod] = not m.endpoints[fam][pod]
        return self._slice_write(m, fam, "ready_flip")

    def _service_write(self, m: ServiceModel, step: str) -> list[Write]:
        return [Write("put", service_object(m), step)]

    def _policy_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        m.itp = "Local" if m.itp == "Cluster" else "Cluster"
        return self._service_write(m, "policy_flip")

    def _affinity_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        m.affinity = not m.affinity
        return self._service_write(m, "affinity_flip")

    def _port_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        m.second_port = not m.second_port
        # the service and its slices change together (a new port has no endpoints until its slices name it)
        return self._service_write(m, "port_flip") + [
            w for f in m.families for w in self._slice_write(m, f, "port_flip")
        ]

    def _udp_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        m.udp = not m.udp
        return self._service_write(m, "udp_flip") + [w for f in m.families for w in self._slice_write(m, f, "udp_flip")]

    def _type_flip(self) -> list[Write]:
        m = self._pick()
        if m is None:
            return []
        m.type = "NodePort" if m.type == "ClusterIP" else "ClusterIP"
        obj = service_object(m)
        return [Write("put", obj, "type_flip")]

    def _bad_object(self) -> list[Write]:
        if len(self.bad) >= 4:
            return []
        self._seq += 1
        if self.rng.random() < 0.5 and self.services:
            # a second slice for a good service, with a bad address: the service's other slices must stay programmed
            m = self._pick()
            assert m is not None
            fam = m.families[0]
            obj = slice_object(m, fam, self.pods)
            obj["metadata"]["name"] = f"{m.name}-bad{self._seq}"
            pod = self.pods[sorted(self.pods)[0]]
            obj["endpoints"] = [
                {
                    "addresses": [self.rng.choice(BAD_ADDRESSES)],
                    "conditions": {"ready": True},
                    "nodeName": pod.node,
                }
            ]
            self.bad.add(("EndpointSlice", obj["metadata"]["name"]))
            return [Write("put", obj, "bad_object")]
        name = f"bad{self._seq:04d}"
        m = ServiceModel(name, ["IPv4"], endpoints={"IPv4": {sorted(self.pods)[0]: True}})
        svc = service_object(m)
        svc["spec"]["ports"] = [copy.deepcopy(self.rng.choice(BAD_SERVICE_PORTS))]
        self.bad.add(("Service", name))
        return [Write("put", svc, "bad_object"), Write("put", slice_object(m, "IPv4", self.pods), "bad_object")]

    def _bad_repair(self) -> list[Write]:
        """Delete a bad object, or (a bad Service) replace it with a valid one that joins the churn."""
        if not self.bad:
            return []
        kind, name = self.rng.choice(sorted(self.bad))
        self.bad.discard((kind, name))
        if kind == "Service" and len(self.services) < self.max_services and self.rng.random() < 0.5:
            m = ServiceModel(name, ["IPv4"], endpoints={"IPv4": {sorted(self.pods)[0]: True}})
            self.services[name] = m
            return self._put_all(m, "bad_repair")
        writes = [Write("delete", _ref(kind, name), "bad_repair")]
        if kind == "Service":
            writes.append(Write("delete", _ref("EndpointSlice", f"{name}-v4"), "bad_repair"))
        return writes


def _essence(obj: Mapping[str, Any]) -> Any:
    """What of an object the soak's writes decide (the API adds defaults, allocations and metadata)."""
    if obj.get("kind") == "Service" or "spec" in obj:
        spec = obj.get("spec") or {}
        ports = [
            (p.get("name"), p.get("port"), p.get("targetPort"), p.get("protocol")) for p in spec.get("ports") or []
        ]
        return ("Service", ports, spec.get("type"), spec.get("internalTrafficPolicy"), spec.get("sessionAffinity"))
    eps = [
        (tuple(e.get("addresses") or ()), (e.get("conditions") or {}).get("ready"), e.get("nodeName"))
        for e in obj.get("endpoints") or []
    ]
    slice_ports = [(p.get("name"), p.get("port"), p.get("protocol")) for p in obj.get("ports") or []]
    return ("EndpointSlice", obj.get("addressType"), eps, slice_ports)


def api_differences(
    written: Mapping[tuple[str, str], Write],
    unsure: Collection[tuple[str, str]],
    api_objects: Mapping[tuple[str, str], Mapping[str, Any]],
) -> dict[str, str]:
    """``Kind name`` -> how the API differs from the last write the API took for that object (``written``): still
    there after a delete, missing, or different. Objects whose last write the API refused (``unsure``) are left out:
    the soak cannot know which version stands. Objects of the namespace nobody wrote are ``unexpected``."""
    out: dict[str, str] = {}
    for key, w in written.items():
        if key in unsure:
            continue
        held = api_objects.get(key)
        label = f"{key[0]} {key[1]}"
        if w.verb == "delete":
            if held is not None:
                out[label] = "still there after its delete"
        elif held is None:
            out[label] = "missing"
        elif _essence(held) != _essence(w.obj):
            out[label] = f"differs: {_essence(held)!r} != {_essence(w.obj)!r}"
    for key in api_objects:
        if key not in written and key not in unsure:
            out[f"{key[0]} {key[1]}"] = "unexpected"
    return out
