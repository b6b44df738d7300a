"""What a conformance scenario works with: object builders, the API, probes, expectations, deadlines.

A scenario builds Services and EndpointSlices from the lab's pods (there is no endpoint-slice controller in the lab, so
slices are written here, which is also how ready/serving/terminating states are simulated), applies them through the
lab's API stand-in with the official client, sends real packets with the lab's probes, and states its expectations with
``expect``/``fail``. A failure raises ``ScenarioFailure`` whose text says what was sent, what came back and what was
expected, so a person can act on it without re-running.

Every object a scenario makes lives in its own namespace (``conf-<id>``), which the runner empties afterwards
(also on failure), so a failing scenario leaves the lab usable for the next one. Waiting is always bounded:
``eventually`` polls with short sleeps up to a deadline, and every wait is also capped by the scenario's own
timeout.
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "conformance.kproxy.example"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
METRICS_PORT = 10249
HEALTHZ_PORT = 10256
# (connect, read) seconds for every API call: a stuck API stand-in fails the call, not the whole pytest run
API_TIMEOUT = (5, 30)


class ScenarioFailure(AssertionError):
    """A scenario's expectation did not hold. ``str()`` is the whole story: what was sent, got and expected."""

    def __init__(self, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        parts = [what]
        if sent:
            parts.append(f"sent: {sent}")
        if got:
            parts.append(f"got: {got}")
        if expected:
            parts.append(f"expected: {expected}")
        super().__init__("; ".join(parts))
        self.what, self.sent, self.got, self.expected = what, sent, got, expected


class NotApplicable(Exception):
    """The scenario cannot be run meaningfully on this lab or backend; the message is the reason."""


class NotApplicableHere(NotApplicable):
    """The scenario has nothing to judge on this host, whatever the lab (a single installed mode has no other mode to
    switch to): reported not-applicable with the reason, and not a gap of a reused lab."""


class ScenarioTimeout(ScenarioFailure):
    """The scenario ran past its own time budget."""


# --------------------------------------------------------------------------------------------------------------
# Addresses: unique per run, from the lab's address plan.
# --------------------------------------------------------------------------------------------------------------


class Addresses:
    """Hands out ClusterIPs, externalIPs, load-balancer IPs and NodePorts that no other scenario of this run uses.

    The plan is the lab's: ClusterIPs from 198.19.0.0/18 and fd00:198:18:ff::/112, externalIPs from
    198.19.100.0/24, load-balancer IPs from 198.19.200.0/24, NodePorts from 30000-32767. Thread-safe, because
    scale-smoke builds services from several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v4 = int(ipaddress.IPv4Address("198.19.1.1"))  # leave 198.19.0.x to the lab's own services
        self._v4_end = int(ipaddress.IPv4Address("198.19.63.254"))
        self._v6 = int(ipaddress.IPv6Address("fd00:198:18:ff::100"))
        self._ext = 10
        self._lb = 10
        self._node_port = 30100

    def cluster_ip(self, family: str = "IPv4") -> str:
        with self._lock:
            if family == "IPv6":
                self._v6 += 1
                return str(ipaddress.IPv6Address(self._v6))
            if self._v4 >= self._v4_end:
                raise RuntimeError("ClusterIP range 198.19.0.0/18 exhausted for this run")
            self._v4 += 1
            if self._v4 & 0xFF in (0, 255):  # skip .0/.255, which look odd in reports
                self._v4 += 2 if self._v4 & 0xFF == 255 else 1
            return str(ipaddress.IPv4Address(self._v4))

    def external_ip(self) -> str:
        with self._lock:
            self._ext += 1
            return f"198.19.100.{self._ext}"

    def lb_ip(self) -> str:
        with self._lock:
            self._lb += 1
            return f"198.19.200.{self._lb}"

    def node_port(self) -> int:
        with self._lock:
            self._node_port += 1
            if self._node_port > 32767:
                raise RuntimeError("NodePort range exhausted for this run")
            return self._node_port


# --------------------------------------------------------------------------------------------------------------
# Probe results, summarised for failure messages.
# --------------------------------------------------------------------------------------------------------------


def answer_pod(result: Any) -> str:
    """The pod name an echo reply names (``"<pod> <seen-ip> <seen-port>"``), or ``""``."""
    pod = getattr(result, "pod", None)
    if pod:
        return str(pod)
    reply = getattr(result, "reply", "") or ""
    return reply.split()[0] if reply.split() else ""


def answer_seen_ip(result: Any) -> str:
    """The source address the echo server saw, or ``""``."""
    seen = getattr(result, "seen_ip", None)
    if seen:
        return str(seen)
    parts = (getattr(result, "reply", "") or "").split()
    return parts[1] if len(parts) > 1 else ""


def summarize(results: Sequence[Any]) -> str:
    """``"60 probes: 58 answered (pod-1-1 x20, pod-2-0 x38), 2 failed (timeout x2)"``."""
    ok = [r for r in results if getattr(r, "ok", False)]
    bad = [r for r in results if not getattr(r, "ok", False)]
    pods = collections.Counter(answer_pod(r) or "?" for r in ok)
    errors = collections.Counter(str(getattr(r, "error", "") or "error") for r in bad)
    text = f"{len(results)} probes: {len(ok)} answered"
    if pods:
        text += " (" + ", ".join(f"{p} x{n}" for p, n in sorted(pods.items())) + ")"
    if bad:
        text += f", {len(bad)} failed (" + ", ".join(f"{e} x{n}" for e, n in sorted(errors.items())) + ")"
        secs = [float(getattr(r, "seconds", 0.0) or 0.0) for r in bad]
        text += f" after {min(secs):.2f}-{max(secs):.2f} s"
    return text


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Probe:
    """What a probe helper sent and what came back, kept for the failure message."""

    src: str
    kind: str
    host: str
    port: int
    results: list[Any] = field(default_factory=list)

    @property
    def sent(self) -> str:
        return f"{len(self.results)} {self.kind.upper()} probe(s) from {self.src} to {hostport(self.host, self.port)}"

    @property
    def ok(self) -> list[Any]:
        return [r for r in self.results if getattr(r, "ok", False)]

    @property
    def failed(self) -> list[Any]:
        return [r for r in self.results if not getattr(r, "ok", False)]

    @property
    def pods(self) -> set[str]:
        return {answer_pod(r) for r in self.ok}

    @property
    def seen_ips(self) -> set[str]:
        return {answer_seen_ip(r) for r in self.ok}

    @property
    def errors(self) -> set[str]:
        return {str(getattr(r, "error", "") or "error") for r in self.failed}

    def summary(self) -> str:
        return summarize(self.results)


# --------------------------------------------------------------------------------------------------------------
# The context.
# --------------------------------------------------------------------------------------------------------------


def _name_of(obj: Any) -> str:
    return str(getattr(obj, "name", obj))


def _ns_of(where: Any) -> str:
    """A lab pod, node or namespace name -> the network namespace to run in."""
    if isinstance(where, str):
        return where
    ns = getattr(where, "ns", None)
    if not ns:
        raise TypeError(f"cannot run a probe from {where!r}: it has no network namespace")
    return str(ns)


class Context:
    """Everything one scenario run needs. Made by the runner; see the module docstring."""

    def __init__(
        self,
        lab: Any,
        mode: str,
        scenario_id: str,
        addresses: Addresses,
        timeout_s: float,
        kproxy_argv: Sequence[str] = (),
        *,
        options: Mapping[str, Any] | None = None,
        declared_parts: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        api: tuple[Any, Any] | None = None,
    ) -> None:
        """``options``: the backend options kproxy runs with on the nodes (what ``kernel_probe`` hands the mode's
        hooks). ``declared_parts``: the parts of this scenario the mode declares not applicable (part -> reason, its
        ``not_applicable_parts``). ``clock``/``sleep``/``api`` are seams for the judge's own tests
        (tests/unit/test_conformance_judge.py), which drive a scenario on a scripted lab with a fake clock and
        in-memory CoreV1Api/DiscoveryV1Api stand-ins; the runner leaves them at the real clock and the lab's API."""
        self.lab = lab
        self.mode = mode
        self.scenario_id = scenario_id
        self.addresses = addresses
        self.namespace = f"conf-{scenario_id}"
        self.now = clock
        self._sleep = sleep
        self.deadline = self.now() + timeout_s
        self.timeout_s = timeout_s
        self.kproxy_argv = tuple(kproxy_argv)
        self.options: Mapping[str, Any] = MappingProxyType(dict(options or {}))
        if api is None:
            from kubernetes import client as k8s  # imported here so report/cli users need no client

            self.api_client = lab.api_client()
            # Any: the scenarios hand plain dicts to the client, which accepts them (pydantic validates them there)
            api = (k8s.CoreV1Api(self.api_client), k8s.DiscoveryV1Api(self.api_client))
        else:
            self.api_client = None
        self.core: Any = api[0]
        self.discovery: Any = api[1]
        self.notes: list[str] = []
        self.declared_parts: Mapping[str, str] = MappingProxyType(dict(declared_parts or {}))
        self.parts: list[tuple[str, str]] = []  # (part, reason): halves of the scenario that could not be exercised
        #: parts found not applicable at run time that the mode does not declare: the runner fails the scenario
        self.undeclared: list[tuple[str, str]] = []
        self._service_ports: dict[str, list[dict[str, Any]]] = {}
        self._slice_seq = 0

    # -- lab shortcuts -----------------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[Any]:
        return list(self.lab.nodes)

    @property
    def pods(self) -> list[Any]:
        return list(self.lab.pods)

    def pods_on(self, node: Any) -> list[Any]:
        name = _name_of(node)
        return [p for p in self.lab.pods if p.node == name]

    def node_of(self, pod: Any) -> Any:
        for n in self.lab.nodes:
            if n.name == pod.node:
                return n
        raise KeyError(pod.node)

    @property
    def external_ns(self) -> str:
        return str(self.lab.external_ns)

    @property
    def external_ip4(self) -> str:
        return str(getattr(self.lab, "external_ip4", None) or "198.18.0.2")

    @property
    def external_ip6(self) -> str:
        return str(getattr(self.lab, "external_ip6", None) or "fd00:198:18::2")

    @property
    def has_ipv6(self) -> bool:
        ipv6 = getattr(self.lab, "ipv6", None)
        if ipv6 is not None:
            return bool(ipv6)
        return all(getattr(p, "ip6", None) for p in self.lab.pods)

    def note(self, text: str) -> None:
        """A fact worth reporting even when the scenario passes (a figure, a caveat)."""
        self.notes.append(text)

    def skips(self, part: str) -> bool:
        """Whether the mode declares ``part`` of this scenario not applicable (``not_applicable_parts``), decided up
        front and never by what the lab shows: then it is reported as its own not-applicable row
        ``<scenario>/<part>`` with the mode's reason, and the scenario leaves that part out."""
        reason = self.declared_parts.get(part)
        if reason is None:
            return False
        if part not in {p for p, _ in self.parts}:
            self.parts.append((part, f"declared by mode {self.mode}: {reason}"))
        return True

    def part_not_applicable(self, part: str, reason: str) -> None:
        """A part of the scenario found not applicable at run time (``reason``: what was seen). A part the mode
        declares is its not-applicable row; one it does not declare is a failure of the scenario (the runner's):
        what a mode cannot do is said up front, never inferred from an observation that may be wrong."""
        if self.skips(part):
            return
        self.undeclared.append((part, reason))

    def part_not_applicable_here(self, part: str, reason: str) -> None:
        """A part nothing on this host can exercise, whatever the mode (say, "starting another mode" with one mode
        installed): its own not-applicable row ``<scenario>/<part>``, never folded into a pass. A run that requires
        every mode (CI) never meets one."""
        self.parts.append((part, f"not on this host: {reason}"))

    # -- deadlines ---------------------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - self.now()

    def check_deadline(self, doing: str = "") -> None:
        if self.remaining() <= 0:
            raise ScenarioTimeout(
                f"scenario exceeded its {self.timeout_s:.0f} s budget" + (f" while {doing}" if doing else "")
            )

    def sleep(self, seconds: float) -> None:
        self.check_deadline("sleeping")
        self._sleep(max(0.0, min(seconds, self.remaining())))

    def eventually(self, check: Callable[[], T], timeout: float = 10.0, interval: float = 0.2, what: str = "") -> T:
        """Call ``check`` until it returns without raising ``ScenarioFailure``; return its value. After
        ``timeout`` seconds (capped by the scenario's budget) the last failure is raised, saying how long we
        waited. Other exceptions propagate at once: they are bugs, not "not yet"."""
        start = self.now()
        end = min(start + timeout, self.deadline)
        attempts = 0
        while True:
            attempts += 1
            try:
                return check()
            except ScenarioFailure as exc:
                if self.now() >= end:
                    waited = self.now() - start
                    raise ScenarioFailure(
                        f"{what + ': ' if what else ''}{exc.what} (still so after {waited:.1f} s, {attempts} tries)",
                        sent=exc.sent,
                        got=exc.got,
                        expected=exc.expected,
                    ) from None
            self._sleep(max(0.0, min(interval, end - self.now())))

    # -- expectations ------------------------------------------------------------------------------------------
    def fail(self, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        raise ScenarioFailure(what, sent=sent, got=got, expected=expected)

    def expect(self, cond: object, what: str, *, sent: str = "", got: str = "", expected: str = "") -> None:
        if not cond:
            raise ScenarioFailure(what, sent=sent, got=got, expected=expected)

    # -- object builders ---------------------------------------------------------------------------------------
    @staticmethod
    def port(
        port: int,
        target: int | str = 8080,
        *,
        name: str = "",
        protocol: str = "TCP",
        node_port: int | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"port": port, "targetPort": target, "protocol": protocol}
        if name:
            out["name"] = name
        if node_port is not None:
            out["nodePort"] = node_port
        return out

    def service(
        self,
        name: str,
        ports: Sequence[dict[str, Any]] | None = None,
        *,
        type: str = "ClusterIP",  # noqa: A002 - the Kubernetes field's name
        families: Sequence[str] = ("IPv4",),
        cluster_ip: str | None = "auto",
        labels: dict[str, str] | None = None,
        **spec: Any,
    ) -> dict[str, Any]:
        """A Service dict. ClusterIPs are allocated per family unless given (``None``/``"None"`` = headless);
        NodePort and LoadBalancer ports get a NodePort each unless they name one. ``spec`` adds fields as they
        are spelled in Kubernetes (``externalTrafficPolicy=``, ``sessionAffinity=``, ...)."""
        ports = [dict(p) for p in (ports or [self.port(80, 8080, name="tcp")])]
        body_spec: dict[str, Any] = {"type": type, "ports": ports}
        if type in ("NodePort", "LoadBalancer"):
            for p in ports:
                p.setdefault("nodePort", self.addresses.node_port())
        if type == "ExternalName":
            pass  # no ClusterIP: the proxy must skip it whatever else it carries
        elif cluster_ip in (None, "None"):
            body_spec["clusterIP"] = "None"
            body_spec["clusterIPs"] = ["None"]
            body_spec["ipFamilies"] = list(families)
        else:
            if cluster_ip == "auto":
                ips = [self.addresses.cluster_ip(f) for f in families]
            else:
                ips = [cluster_ip]
            body_spec["clusterIP"] = ips[0]
            body_spec["clusterIPs"] = ips
            body_spec["ipFamilies"] = list(families)
            body_spec["ipFamilyPolicy"] = "RequireDualStack" if len(families) > 1 else "SingleStack"
        body_spec.update(spec)
        self._service_ports[name] = ports
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict(labels or {})},
            "spec": body_spec,
        }

    def slice_for(
        self,
        service: dict[str, Any] | str,
        pods: Iterable[Any],
        *,
        family: str = "IPv4",
        ready: bool = True,
        serving: bool | None = None,
        terminating: bool = False,
        ports: Sequence[dict[str, Any]] | None = None,
        name: str | None = None,
    ) -> dict[str, Any]:
        """An EndpointSlice of ``pods`` for ``service`` (a Service dict from ``service()`` or its name). Ports
        default to the service's ports with numeric targetPorts; give ``ports`` (``{name, port, protocol}``)
        when targetPorts are named. ``serving`` defaults to ``ready``, as the endpoint-slice controller sets it
        for pods that are not terminating."""
        svc_name = service if isinstance(service, str) else service["metadata"]["name"]
        if ports is None:
            svc_ports = self._service_ports.get(svc_name)
            if svc_ports is None and isinstance(service, dict):
                svc_ports = service["spec"].get("ports", [])
            slice_ports = []
            for p in svc_ports or []:
                target = p.get("targetPort", p["port"])
                if not isinstance(target, int):
                    raise ValueError(f"service {svc_name} port {p} has a named targetPort: pass ports= explicitly")
                sp: dict[str, Any] = {"port": target, "protocol": p.get("protocol", "TCP"), "name": p.get("name", "")}
                slice_ports.append(sp)
        else:
            slice_ports = [dict(p) for p in ports]
        if serving is None:
            serving = ready
        self._slice_seq += 1
        suffix = "v6" if family == "IPv6" else "v4"
        endpoints = []
        for pod in pods:
            endpoints.append(
                {
                    "addresses": [pod.ip6 if family == "IPv6" else pod.ip4],
                    "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                    "nodeName": pod.node,
                    **({"zone": z} if (z := getattr(self._node_named(pod.node), "zone", None)) else {}),
                    "targetRef": {"kind": "Pod", "namespace": self.namespace, "name": pod.name},
                }
            )
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name or f"{svc_name}-{suffix}",
                "namespace": self.namespace,
                "labels": {SERVICE_NAME_LABEL: svc_name, MANAGED_BY_LABEL: MANAGED_BY},
                # as the endpoint-slice controller stamps it: what network_programming_duration_seconds measures from
                "annotations": {
                    TRIGGER_TIME_ANNOTATION: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                },
            },
            "addressType": family,
            "endpoints": endpoints,
            "ports": slice_ports,
        }

    def _node_named(self, name: str) -> Any:
        for n in self.lab.nodes:
            if n.name == name:
                return n
        return None

    # -- the API -----------------------------------------------------------------------------------------------
    def apply(self, *objs: dict[str, Any]) -> None:
        """Create each object, or replace it when it exists (carrying over its resourceVersion)."""
        from kubernetes.client.exceptions import ApiException

        for obj in objs:
            self.check_deadline("writing to the API")
            kind, name = obj["kind"], obj["metadata"]["name"]
            create, read, replace = self._verbs(kind)
            try:
                create(self.namespace, obj, _request_timeout=API_TIMEOUT)
                continue
            except ApiException as exc:
                if exc.status != 409:
                    raise ScenarioFailure(
                        f"the API refused to create {kind} {self.namespace}/{name}", got=_api_error(exc)
                    ) from None
            current = read(name, self.namespace, _request_timeout=API_TIMEOUT)
            body = json.loads(json.dumps(obj))
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            try:
                replace(name, self.namespace, body, _request_timeout=API_TIMEOUT)
            except ApiException as exc:
                raise ScenarioFailure(
                    f"the API refused to replace {kind} {self.namespace}/{name}", got=_api_error(exc)
                ) from None

    def delete(self, kind: str, name: str, *, missing_ok: bool = True) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            if kind == "Service":
                self.core.delete_namespaced_service(name, self.namespace, _request_timeout=API_TIMEOUT)
            else:
                self.discovery.delete_namespaced_endpoint_slice(name, self.namespace, _request_timeout=API_TIMEOUT)
        except ApiException as exc:
            if not (missing_ok and exc.status == 404):
                raise

    def delete_service(self, name: str) -> None:
        """The service and every slice labelled as its, as the garbage collector would do."""
        self.delete("Service", name)
        for s in self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={name}", _request_timeout=API_TIMEOUT
        ).items:
            self.delete("EndpointSlice", s.metadata.name)

    def set_lb_ingress(self, name: str, ips: Sequence[str]) -> None:
        """Give a LoadBalancer service its ingress IPs, as a cloud controller would (the /status subresource)."""
        from kubernetes.client.exceptions import ApiException

        status = {"loadBalancer": {"ingress": [{"ip": ip} for ip in ips]}}
        try:
            self.core.patch_namespaced_service_status(
                name,
                self.namespace,
                {"status": status},
                _content_type="application/merge-patch+json",
                _request_timeout=API_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status not in (405, 415, 422, 400):
                raise ScenarioFailure(
                    f"could not set the load-balancer status of {name}", got=_api_error(exc)
                ) from None
            current = self.core.read_namespaced_service(name, self.namespace, _request_timeout=API_TIMEOUT)
            body = self.api_client.sanitize_for_serialization(current)
            body["status"] = status
            self.core.replace_namespaced_service_status(name, self.namespace, body, _request_timeout=API_TIMEOUT)

    def empty_namespace(self, namespace: str | None = None) -> int:
        """Delete every Service and EndpointSlice in the namespace; returns how many objects went."""
        ns = namespace or self.namespace
        n = 0
        from kubernetes.client.exceptions import ApiException

        for s in self.core.list_namespaced_service(ns, _request_timeout=API_TIMEOUT).items:
            try:
                self.core.delete_namespaced_service(s.metadata.name, ns, _request_timeout=API_TIMEOUT)
                n += 1
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for s in self.discovery.list_namespaced_endpoint_slice(ns, _request_timeout=API_TIMEOUT).items:
            try:
                self.discovery.delete_namespaced_endpoint_slice(s.metadata.name, ns, _request_timeout=API_TIMEOUT)
                n += 1
            except ApiException as exc:
                if exc.status != 404:
                    raise
        return n

    def _verbs(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        if kind == "Service":
            return (
                self.core.create_namespaced_service,
                self.core.read_namespaced_service,
                self.core.replace_namespaced_service,
            )
        if kind == "EndpointSlice":
            return (
                self.discovery.create_namespaced_endpoint_slice,
                self.discovery.read_namespaced_endpoint_slice,
                self.discovery.replace_namespaced_endpoint_slice,
            )
        raise ValueError(f"kind {kind} is not one the conformance suite writes")

    # -- probes ------------------------------------------------------------------------------------------------
    def probe(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        count: int = 1,
        timeout: float = 1.0,
        src_port: int | None = None,
        interval: float | None = None,
        payload: str | None = None,
    ) -> Probe:
        """Send ``count`` probes (new connections / datagrams) from ``src`` (a pod, node or namespace name).
        ``payload="info"`` makes the echo server add ``port=<its port> proto=<tcp|udp>`` to its answer."""
        self.check_deadline(f"probing {hostport(host, port)}")
        kwargs: dict[str, Any] = {"count": count, "timeout": timeout}
        if src_port is not None:
            kwargs["src_port"] = src_port
        if interval is not None:
            kwargs["interval"] = interval
        if payload is not None:
            kwargs["payload"] = payload
        results = list(self.lab.probe(_ns_of(src), kind, host, port, **kwargs))
        label = _name_of(src) if not isinstance(src, str) else src
        return Probe(label, kind, host, port, results)

    def reach(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        count: int = 1,
        timeout: float = 1.0,
        only: Iterable[Any] | None = None,
        all_of: Iterable[Any] | None = None,
    ) -> Probe:
        """Probe and demand that every probe is answered; ``only``: by these pods alone; ``all_of``: each of
        these pods answers at least once. Raises ScenarioFailure saying what came back otherwise."""
        pr = self.probe(src, host, port, kind, count=count, timeout=timeout)
        only_names = {_name_of(p) for p in only} if only is not None else None
        all_names = {_name_of(p) for p in all_of} if all_of is not None else None
        expected = f"all {count} answered"
        if only_names is not None:
            expected += " by " + ", ".join(sorted(only_names)) + " only"
        if all_names is not None:
            expected += ", each of " + ", ".join(sorted(all_names)) + " at least once"
        if pr.failed:
            self.fail(
                f"{len(pr.failed)} of {count} probes were not answered",
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        if only_names is not None and not pr.pods <= only_names:
            self.fail(
                "answered by a pod that is not an endpoint it should reach: " + ", ".join(sorted(pr.pods - only_names)),
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        if all_names is not None and not all_names <= pr.pods:
            self.fail(
                "some endpoints never answered: " + ", ".join(sorted(all_names - pr.pods)),
                sent=pr.sent,
                got=pr.summary(),
                expected=expected,
            )
        return pr

    def blocked(
        self,
        src: Any,
        host: str,
        port: int,
        kind: str = "tcp",
        *,
        how: str = "any",
        count: int = 1,
        timeout: float = 1.0,
        within: float | None = None,
    ) -> Probe:
        """Probe and demand that nothing answers. ``how``: ``"refused"`` (RST / ICMP unreachable: the error is
        refused or unreachable), ``"port-unreachable"`` (for UDP: ICMP port unreachable, which the probe's connected
        socket sees as ECONNREFUSED, "refused"; a host-unreachable or a timeout is not it), ``"timeout"`` (silently
        dropped) or ``"any"``. ``within``: every probe must have failed faster than this many seconds."""
        expected = {
            "refused": "every probe refused (TCP RST / ICMP unreachable)",
            "port-unreachable": "every probe answered by ICMP port unreachable (ECONNREFUSED)",
            "timeout": "every probe dropped (a timeout, not a refusal)",
            "any": "no probe answered",
        }[how]
        pr = self.probe(src, host, port, kind, count=count, timeout=timeout)
        if within is not None:
            expected += f" in under {within:.1f} s"
        if pr.ok:
            self.fail("a probe that must fail was answered", sent=pr.sent, got=pr.summary(), expected=expected)
        for r in pr.failed:
            err = str(getattr(r, "error", "") or "")
            if how == "refused" and not _is_refusal(err):
                self.fail(
                    f"the probe failed with {err!r}, not a refusal", sent=pr.sent, got=pr.summary(), expected=expected
                )
            if how == "port-unreachable" and err != "refused":
                self.fail(
                    f"the probe failed with {err!r}, not ICMP port unreachable",
                    sent=pr.sent,
                    got=pr.summary(),
                    expected=expected,
                )
            if how == "timeout" and err != "timeout":
                self.fail(
                    f"the probe failed with {err!r}, not a timeout", sent=pr.sent, got=pr.summary(), expected=expected
                )
            secs = float(getattr(r, "seconds", 0.0) or 0.0)
            if within is not None and secs >= within:
                self.fail(f"the refusal took {secs:.2f} s", sent=pr.sent, got=pr.summary(), expected=expected)
        return pr

    def http(self, src: Any, url: str) -> Any:
        """GET ``url`` from ``src``'s namespace; returns the lab's result (``status``, ``headers``, ``body``)."""
        self.check_deadline(f"fetching {url}")
        return self.lab.probe_http(_ns_of(src), url)

    def metrics_text(self, node: Any) -> str:
        """``/metrics`` of the kproxy on ``node``, read from inside the node (it listens on 127.0.0.1)."""
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        r = self.http(node, url)
        if getattr(r, "status", None) != 200:
            self.fail(
                f"/metrics on {_name_of(node)} did not answer 200",
                sent=f"GET {url} in {_ns_of(node)}",
                got=_http_got(r),
                expected="200 and the Prometheus exposition",
            )
        return _body(r)

    def rules(self, node: Any, service: str | None = None) -> dict[str, Any]:
        """``/rules`` of the kproxy on ``node`` (how each service is programmed), as JSON."""
        url = f"http://127.0.0.1:{METRICS_PORT}/rules"
        if service:
            url += "?service=" + service
        r = self.http(node, url)
        sent = f"GET {url} in {_ns_of(node)}"
        if getattr(r, "status", None) != 200:
            self.fail(
                f"/rules on {_name_of(node)} did not answer 200", sent=sent, got=_http_got(r), expected="200 and JSON"
            )
        try:
            return dict(json.loads(_body(r)))
        except ValueError:
            self.fail(
                f"/rules on {_name_of(node)} is not JSON", sent=sent, got=_body(r)[:200], expected="a JSON object"
            )
            raise  # unreachable; fail raises

    def exec(self, where: Any, argv: Sequence[str], timeout: float = 30.0) -> Any:
        self.check_deadline(f"running {' '.join(argv[:3])}")
        return self.lab.exec(_ns_of(where), list(argv), timeout=min(timeout, max(1.0, self.remaining())))

    def kernel_probe(self, node: Any, mode: str | None = None) -> KernelProbe:
        """A ``kproxy.proxier.KernelProbe`` into ``node``'s namespace, for ``mode``'s (default: the scenario's)
        ``remnants``/``kernel_view`` hooks: what the kernel holds, read from the kernel, never from kproxy's own
        account (/rules). Its options are those the node's kproxy runs with in that mode (the lab's
        ``node_options``), else the session's."""
        node_options = getattr(self.lab, "node_options", None)
        options = node_options(node, mode or self.mode) if node_options is not None else self.options
        return KernelProbe(self, node, options)


class KernelProbe:
    """Runs read-only commands in one lab node's network namespace (through the lab's exec, bounded by the
    scenario's deadline) with the node's backend options: the conformance side of ``kproxy.proxier.KernelProbe``."""

    def __init__(self, ctx: Context, node: Any, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.node = node
        self.options: Mapping[str, Any] = MappingProxyType(dict(ctx.options if options is None else options))

    def run(self, argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        res = self.ctx.exec(self.node, argv, timeout=timeout)
        return subprocess.CompletedProcess(
            list(argv),
            int(getattr(res, "returncode", 0) or 0),
            _text(getattr(res, "stdout", "")),
            _text(getattr(res, "stderr", "")),
        )


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")


def _is_refusal(err: str) -> bool:
    """The lab probe's words for a rejection: ``refused`` (ECONNREFUSED / a reset) or ``unreachable`` (an ICMP
    host/net unreachable or administratively prohibited). Anything else (a timeout, ``closed``) is not one."""
    return err in ("refused", "unreachable")


def _http_got(r: Any) -> str:
    """An HTTP probe's outcome for a failure message: the status, or the error when nothing came back."""
    err = getattr(r, "error", "") or ""
    return f"{getattr(r, 'status', None)}" + (f" ({err})" if err else "") + f" {_body(r)[:200]}"


def _body(r: Any) -> str:
    body = getattr(r, "body", "")
    if isinstance(body, bytes):
        return body.decode(errors="replace")
    return str(body or "")


def body_of(r: Any) -> str:
    return _body(r)


def header(r: Any, name: str) -> str | None:
    """A response header, case-insensitively, from whatever mapping the lab returns."""
    headers = getattr(r, "headers", None) or {}
    try:
        items = headers.items()
    except AttributeError:
        items = list(headers)
    for k, v in items:
        if str(k).lower() == name.lower():
            return str(v)
    return None


def _api_error(exc: Any) -> str:
    body = getattr(exc, "body", "") or ""
    try:
        msg = json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        msg = body
    return f"HTTP {getattr(exc, 'status', '?')} {getattr(exc, 'reason', '')}: {str(msg)[:300]}"
