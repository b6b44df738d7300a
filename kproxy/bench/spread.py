"""``kproxy compare``'s fairness column: per mode, how evenly one service's new connections spread over its
endpoints, from the mode's own counters (``--service-counters``): a chi-square test against the even split and the
largest and smallest shares (``kproxy.fairness``).

Decisions:

- **A burst of its own.** The data-path benchmark's traffic goes to a one-endpoint service (it measures the cost of
  the translation, not the choice) and runs with counters off (compare times the default data path), so it says
  nothing about the spread. Here ``--fairness-connections`` new TCP connections go from one pod to a ClusterIP with
  ENDPOINTS endpoints, once per mode.
- **A small lab of its own**: two nodes, ENDPOINTS pods each, under the comparison's lab prefix once the data-path
  lab is down. kproxy runs with ``--service-counters`` on node-1 only, the client's node, which translates every
  connection (DNAT, a connect() program or the relay); the endpoints are node-2's pods. Each mode is removed again
  afterwards as the data-path benchmark removes it (``kproxy.bench.dplab.remove_mode``).
- **From the counters**, read from node-1's ``/metrics`` as any Prometheus reads them (``kproxy.counters.parse``):
  the split is the per-endpoint difference between a read before and a read after the burst, polled (bounded) until
  the service's count has grown by the connections answered (a slow mode serves a scrape from its last read). The
  split the answers showed (each echo server names its pod) is recorded beside it: the two must agree, which the
  conformance scenario ``counters`` checks exactly; here a difference is reported, not fatal.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

from kproxy.counters import Measure, Scrape, parse, service_key
from kproxy.fairness import fairness

ENDPOINTS = 4
CONNECTIONS = 300
NAMESPACE = "fairness"
NAME = "spread"
CLUSTER_IP = "198.19.201.10"
SERVICE_PORT = 80
ECHO_PORT = 8080
METRICS_URL = "http://127.0.0.1:10249/metrics"
READY_TIMEOUT = 120.0  # kproxy healthy on node-1 (the bpf mode compiles its programs at start)
COUNTED_TIMEOUT = 60.0  # a read of the counters newer than the burst
KEY = service_key(NAMESPACE, NAME, "tcp", "TCP", "IPv4")


class FairnessError(RuntimeError):
    """The burst could not be measured in a mode; the message says what and where."""


def service_objects(pods: list[Any]) -> list[dict[str, Any]]:
    """The Service (TCP 80 -> 8080) and its EndpointSlice of ``pods``."""
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": CLUSTER_IP,
            "clusterIPs": [CLUSTER_IP],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [{"name": "tcp", "protocol": "TCP", "port": SERVICE_PORT, "targetPort": ECHO_PORT}],
        },
    }
    ready = {"ready": True, "serving": True, "terminating": False}
    eps = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": f"{NAME}-1", "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": NAME}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [p.ip4], "conditions": ready, "nodeName": p.node} for p in pods],
        "ports": [{"name": "tcp", "protocol": "TCP", "port": ECHO_PORT}],
    }
    return [svc, eps]


def counted_split(before: Scrape, after: Scrape, endpoints: list[str]) -> dict[str, float]:
    """Each endpoint's new connections between two reads of the counters (0 for one the reads do not name)."""

    def conns(scrape: Scrape, ep: str) -> float:
        sample = scrape.services.get(KEY)
        return float((sample.endpoints.get(ep, {}) if sample else {}).get(Measure.CONNECTIONS.value) or 0.0)

    return {ep: conns(after, ep) - conns(before, ep) for ep in endpoints}


def fairness_entry(
    mode: str, counted: Mapping[str, float], answered: Mapping[str, int], sent: int, command: str = ""
) -> dict[str, Any]:
    """One mode's row of results.json's ``fairness.runs``: the counted split, its chi-square test against the even
    split and its shares (``kproxy.fairness.Fairness.as_dict``; None when nothing was counted), and the split the
    answers showed."""
    spread = fairness(dict(counted))
    return {
        "mode": mode,
        "connections": sent,
        "endpoints": len(counted),
        "counted": {ep: round(v) for ep, v in counted.items()},
        "answered": dict(answered),
        "counted_equals_answered": {ep: round(v) for ep, v in counted.items()} == dict(answered),
        "fairness": spread.as_dict() if spread is not None else None,
        "command": command,
        "error": "",
    }


class FairnessLab:
    """The burst's lab (see the module docstring); a context manager: the lab goes down on exit, also on error."""

    def __init__(self, prefix: str, progress: Callable[[str], None] | None = None) -> None:
        self.prefix = prefix
        self.progress = progress or (lambda _msg: None)
        self.lab: Any = None

    def __enter__(self) -> FairnessLab:
        from kproxy.bench.dpobjects import ApiWriter
        from kproxy.lab.cluster import Lab

        if Lab.live(self.prefix) is not None:
            raise FairnessError(f"a lab with prefix {self.prefix!r} is running: take it down first")
        self.progress(f"fairness: lab up ({self.prefix}: 2 nodes, {ENDPOINTS} pods each)")
        self.lab = Lab.up(nodes=2, pods_per_node=ENDPOINTS, mode=None, ipv6=False, prefix=self.prefix, timeout=120)
        try:
            ApiWriter(self.lab.api_url).create_all(service_objects(self.servers))
        except BaseException:
            Lab.down(prefix=self.prefix)  # __exit__ does not run when __enter__ fails
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        from kproxy.lab.cluster import Lab

        Lab.down(prefix=self.prefix)

    @property
    def node(self) -> Any:
        return self.lab.nodes[0]

    @property
    def client(self) -> Any:
        return next(p for p in self.lab.pods if p.node == self.node.name)

    @property
    def servers(self) -> list[Any]:
        return [p for p in self.lab.pods if p.node == self.lab.nodes[1].name]

    def read(self) -> Scrape:
        r = self.lab.probe_http(self.node.ns, METRICS_URL, timeout=10.0)
        if r.status != 200:
            raise FairnessError(f"{METRICS_URL} on {self.node.name}: {r.status} {r.error}")
        return parse(r.body or "", time.monotonic())

    def measure(self, mode: str, connections: int) -> dict[str, Any]:
        """The burst in ``mode``: kproxy started with counters on node-1, measured, removed again."""
        from kproxy.bench.dplab import remove_mode

        try:
            self.lab.start_kproxy(self.node, mode, ["--service-counters"])
            self.lab.wait_kproxy(self.node, timeout=READY_TIMEOUT)
            entry = self._burst(mode, connections)
        except BaseException:
            remove_mode(self.lab, [self.node], mode)
            raise
        entry["note"] = remove_mode(self.lab, [self.node], mode)  # what the mode left: noted, as the data path does
        return entry

    def _burst(self, mode: str, connections: int) -> dict[str, Any]:
        endpoint_of = {p.name: f"{p.ip4}:{ECHO_PORT}" for p in self.servers}
        self._wait_programmed(mode)
        before = self.read()
        results = self.lab.probe(self.client.ns, "tcp", CLUSTER_IP, SERVICE_PORT, count=connections, timeout=2.0)
        answered = collections.Counter(endpoint_of.get(str(r.pod), str(r.pod)) for r in results if r.ok)
        total = sum(answered.values())
        deadline = time.monotonic() + COUNTED_TIMEOUT
        while True:
            split = counted_split(before, self.read(), list(endpoint_of.values()))
            if sum(split.values()) >= total:
                break
            if time.monotonic() > deadline:
                raise FairnessError(
                    f"mode {mode}: the counters show {sum(split.values()):g} of {total} answered connections after"
                    f" {COUNTED_TIMEOUT:.0f} s"
                )
            time.sleep(0.3)
        answered_all = {ep: answered.get(ep, 0) for ep in endpoint_of.values()}
        return fairness_entry(mode, split, answered_all, connections)

    def _wait_programmed(self, mode: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            r = self.lab.probe(self.client.ns, "tcp", CLUSTER_IP, SERVICE_PORT, timeout=1.0)[0]
            if r.ok:
                return
            if time.monotonic() > deadline:
                raise FairnessError(f"mode {mode}: {CLUSTER_IP} does not answer from {self.client.name}: {r!r}")
            time.sleep(0.3)
