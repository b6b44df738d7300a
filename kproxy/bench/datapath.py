"""``kproxy bench datapath``: what a backend's rules cost the traffic that crosses them, in the lab
(docs/PERFORMANCE.md).

From a pod to a ClusterIP whose only endpoint is a pod on the other node, with N services programmed on both nodes,
and the same traffic to that pod's IP directly, against **the limit**: the same traffic between two pods on two
nodes that have no proxy rules at all, measured in the same run. The lab has four nodes (eight with the diagnostic
limits; prefix ``kpd-``, two pods each, IPv4): kproxy runs on node-1 and node-2 only; node-3 and node-4 never get a
rule, so pod-3-1 -> pod-4-1 is the limit at every size. (The pod IP on the loaded node is not the limit: a proxy's
rules also tax traffic that never touches a service, e.g. iptables' KUBE-SERVICES walk on every new connection, on
both nodes.)

Targets, measured in many short rounds whose order is shuffled, every target with a client pod and a server pod of
its own (``ROLES``: each echo server takes one operation per turn of the interleaving; a server shared by two targets
answers each later than a server of one, which once put the pod IP 4-10 % "above" the limit):

* ``limit``: pod-3-1 -> pod-4-1's IP (no proxy rules anywhere on the path);
* ``limit_twin``: pod-3-2 -> pod-4-2's IP, the limit's path between two other pods: the lab's self-test in every
  run (twin / limit must be 1.0 within a couple of per cent; ``DatapathConfig.twin``);
* ``podip``: pod-1-2 -> pod-2-2's IP across the loaded nodes;
* ``clusterip``: pod-1-1 -> the target service's ClusterIP, DNATed (or translated at connect()) to pod-2-1; in mode
  ``none`` pod-2-1's IP directly, so the calibration runs a real run's targets, pods and schedule;
* diagnostic limits (``DatapathConfig.conntrack_limits``, on by default here, ``kproxy compare --conntrack-limits``):
  ``limit_ct``, the limit's path with conntrack turned on in nodes 5 and 6 by a one-rule table, and ``limit_nat``,
  nodes 7 and 8 with nat base chains and a DNAT rule that never matches (conntrack + the nat hooks + a null binding
  per connection: what every NAT-based proxy pays before any rule of its own). Why they exist: on this kernel
  conntrack's hooks register per network namespace only when a rule needs them (a ct expression, a NAT rule; a nat
  chain alone does not), so the plain limit tracks nothing, and a NAT proxy cannot reach it; the pod IP and the
  ClusterIP are also reported against ``limit_nat`` (``DatapathRun.ratios_vs``). The conntrack entries in each
  path's nodes after every round are recorded: 0 on the limit's nodes shows it.

One client (``dpclient --serve``) runs every target in turn, one operation each; it makes no socket itself. Each
target's sockets come from a factory process (``dpclient --factory``) in the target's client pod and in its client
node's cgroup, because a socket belongs to the cgroup of the process that made it and a bpf proxy's socket programs
(connect4, sendmsg4) run for the socket's cgroup: the limits' sockets come from nodes that never run a proxy and pass
no program; the pod IP's and the ClusterIP's come from node-1 and pass all of bpf's.

Metrics, per target and round (kproxy.bench.dpclient against the pods' echo servers; iperf3 for throughput): new TCP
connections per second (connect, one request/response, close with RST) with the p50/p99 of a whole connection (a
failed operation's time counts in its target's rate; a round in which some target failed more than
``MAX_ERROR_FRACTION`` of a phase's operations is left out whole); request/response p50/p99 on one established TCP
connection; UDP request/response p50/p99; bulk TCP throughput (``iperf3 -c``, Gbit/s). Each figure is the median
over the rounds; each ratio is against the limit, oriented so that 1.0 means "as fast as without a proxy" and
smaller is slower (rates: target / limit; latencies: limit / target), taken within each round and then the median
over rounds (:func:`paired_ratios`), with the interquartile range of the per-round ratios beside it
(:func:`ratio_spread`: the noise of a shared machine).

Pinning (2 cores): every client (dpclient, its factories, iperf3 -c) runs under ``taskset -c 0``; the servers (the
targets' echo servers, re-pinned with ``taskset -a -p -c 1``, and ``iperf3 -s``) on CPU 1. The kproxy processes and
the lab's API stand-in are not pinned: they are idle while traffic runs (their sync is finished and checked first).

Services: size N means N services programmed in total: the target plus N - 1 synthetic ones (kproxy.bench.synthetic:
namespace ``bench``, ClusterIPs from 198.19.0.0/16, E endpoints each on node-1/node-2, every tenth UDP), written to
the lab's API stand-in over its HTTP API before kproxy starts, so each size costs one full sync per node. Sizes run in
ascending order; each mode is started on both loaded nodes, waited for (``/healthz`` 200, then the ClusterIP answers
over TCP and UDP), measured, stopped, and its rules removed (``kproxy cleanup --mode MODE`` in both nodes, then any
table left, e.g. iptables-nft's empty built-in ones, whose forward chain would tax the next mode's every packet, and
the conntrack entries). kproxy's CPU time over a quiet interval before the traffic (``idle_cpu_s``: synced, no
change, no traffic; an idle proxy must cost almost nothing) and while the traffic runs are recorded.

Mode ``none`` starts no proxy: every target against ``limit`` then shows what the lab itself contributes (1.0 within
the noise), with the same targets and schedule as a real run.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kproxy.bench import synthetic
from kproxy.lab import netns
from kproxy.lab.cluster import Lab, LabError, LabPod

LAB_PREFIX = "kpd-"
NONE_MODE = "none"
TARGET_NAMESPACE = "datapath"
TARGET_NAME = "target"
TARGET_CLUSTER_IP = "198.19.200.10"
ECHO_PORT = 8080
SERVICE_PORT = 80
IPERF_PORT = 5201
CLIENT_CPU = "0"
SERVER_CPU = "1"
PINNED_CLIENT = ("taskset", "-c", CLIENT_CPU)
TARGETS = ("limit", "podip", "clusterip")
#: the limit's twin: the same path between two other pods of the same nodes, measured in the same rounds. Two
#: identical targets must measure alike (twin / limit within a few per cent): the lab's self-test, in every run
TWIN = "limit_twin"
#: each target's client pod and server pod. Every target has a server (and a client pod) of its own, so every echo
#: server takes one operation per turn of the interleaving: a server taking two per turn (once the pod IP and the
#: ClusterIP shared one) answers each a little later than one taking one, which skewed every ratio. The ClusterIP's
#: endpoint is pod-2-1. A target's sockets are made in its client pod and its node's cgroup (dpclient.factory)
ROLES = {
    "limit": ("pod-3-1", "pod-4-1"),
    TWIN: ("pod-3-2", "pod-4-2"),
    "podip": ("pod-1-2", "pod-2-2"),
    "clusterip": ("pod-1-1", "pod-2-1"),
    "limit_ct": ("pod-5-1", "pod-6-1"),
    "limit_nat": ("pod-7-1", "pod-8-1"),
}
PODS_PER_NODE = 2
#: a round in which some target failed more than this fraction of one phase's operations is failed (not counted)
MAX_ERROR_FRACTION = 0.01
#: diagnostic limits (DatapathConfig.conntrack_limits): the limit's path with conntrack turned on in nodes 3 and 4
#: by a minimal table, and with nat base chains and a DNAT rule that never matches (conntrack + the nat hooks),
#: loaded just before
#: the measurement and deleted just after (so the plain limit, measured in the same round, has neither)
CONNTRACK_LIMITS = ("limit_ct", "limit_nat")
LIMIT_TARGETS = ("limit", TWIN, *CONNTRACK_LIMITS)
DIAG_TABLE = "kpdiag"
DIAG_RULESETS = {
    # a ct expression makes the kernel register conntrack's hooks in this namespace (nf_ct_netns_get)
    "limit_ct": (
        f"table inet {DIAG_TABLE} {{\n"
        "  chain pre { type filter hook prerouting priority 0; policy accept; ct state established accept; }\n"
        "}\n"
    ),
    # nat base chains alone register the nat hooks but not conntrack (without a connection the nat hooks return at
    # once): it is a NAT rule (nft_nat's init) that turns conntrack on. So one DNAT rule that never matches (an
    # address nothing uses) in prerouting: conntrack, the nat hooks, the nat chain walked by every new connection
    # and a null binding made for it, as in every NAT-based proxy, and no translation
    "limit_nat": (
        f"table ip {DIAG_TABLE} {{\n"
        "  chain pre { type nat hook prerouting priority dstnat; policy accept;"
        " ip daddr 198.19.255.254 tcp dport 1 dnat to 198.19.255.253; }\n"
        "  chain out { type nat hook output priority -100; policy accept; }\n"
        "  chain post { type nat hook postrouting priority srcnat; policy accept; }\n"
        "}\n"
    ),
}
WRITE_THREADS = 4
CLEANUP_TIMEOUT = 120.0
KPROXY_READY_TIMEOUT = 600.0  # seconds: a full sync of 10,000 services on two nodes sharing 2 cores

#: (metric, where it comes from, higher is better, unit)
METRICS: tuple[tuple[str, str, bool, str], ...] = (
    ("conn_rate", "crr.rate", True, "conn/s"),
    ("conn_p50_us", "crr.p50_us", False, "us"),
    ("conn_p99_us", "crr.p99_us", False, "us"),
    ("rr_rate", "rr.rate", True, "req/s"),
    ("rr_p50_us", "rr.p50_us", False, "us"),
    ("rr_p99_us", "rr.p99_us", False, "us"),
    ("udp_rate", "udp.rate", True, "req/s"),
    ("udp_p50_us", "udp.p50_us", False, "us"),
    ("udp_p99_us", "udp.p99_us", False, "us"),
    ("tcp_gbps", "iperf.gbps", True, "Gbit/s"),
)
HIGHER_IS_BETTER = {m: hib for m, _, hib, _ in METRICS}
UNITS = {m: unit for m, _, _, unit in METRICS}


class DatapathError(RuntimeError):
    """The benchmark could not run or a measurement failed; the message says what and where."""


@dataclass
class DatapathRun:
    """One mode at one size: medians per target, the ratios against the limit, and every round's figures."""

    mode: str
    services: int
    ready_s: float = 0.0  # kproxy started on both nodes -> both healthy and the ClusterIP answering
    kproxy_rss_mb: dict[str, float] = field(default_factory=dict)
    kproxy_peak_rss_mb: dict[str, float] = field(default_factory=dict)
    sync_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    medians: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: list[dict[str, dict[str, float]]] = field(default_factory=list)
    #: target -> metric -> [first quartile, third quartile] of the per-round ratios against the limit (the noise)
    ratio_spread: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    #: ratios of pod IP and ClusterIP against the diagnostic limits: limit name -> target -> metric -> ratio
    ratios_vs: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    #: target -> median of the conntrack entries in its client's and server's node right after each round
    conntrack_entries: dict[str, dict[str, float]] = field(default_factory=dict)
    #: CPU seconds each loaded node's kproxy used while traffic ran (it should be idle; a busy proxy taxes everyone)
    kproxy_cpu_s: dict[str, float] = field(default_factory=dict)
    #: CPU seconds each loaded node's kproxy used over a quiet interval of ``idle_seconds`` before the traffic
    #: (synced, no change coming: an idle proxy must cost almost nothing)
    idle_cpu_s: dict[str, float] = field(default_factory=dict)
    idle_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    #: rounds left out because some target failed more than MAX_ERROR_FRACTION of a phase's operations: why
    failed_rounds: list[str] = field(default_factory=list)
    error: str = ""  # the mode could not be measured at this size: why
    note: str = ""  # measured, but something around it went wrong (e.g. the cleanup afterwards)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DatapathConfig:
    rounds: int = 10
    seconds: float = 0.5
    iperf_seconds: float = 1.0
    endpoints: int = 10
    prefix: str = LAB_PREFIX
    conntrack_limits: bool = True  # also measure CONNTRACK_LIMITS every round (the floor of a NAT-based proxy)
    twin: bool = True  # also measure TWIN every round (the lab's self-test: it must match the limit)
    idle_seconds: float = 10.0  # the quiet interval over which kproxy's idle CPU is read, before the traffic

    def describe(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "conntrack_limits_detail": {
                "limit_ct": "pod-5-1 -> pod-6-1 on nodes 5 and 6, whose only rule turns conntrack on (an inet"
                " filter prerouting chain with 'ct state established accept')",
                "limit_nat": "pod-7-1 -> pod-8-1 on nodes 7 and 8, with nat base chains (prerouting, output,"
                " postrouting) and one DNAT rule that never matches: conntrack, the nat hooks and a null binding per"
                " connection, as every NAT-based proxy has (empty nat chains alone do not turn conntrack on)",
            }
            if self.conntrack_limits
            else {},
            "pinning": f"clients taskset -c {CLIENT_CPU}; echo servers and iperf3 -s taskset -c {SERVER_CPU}",
            "limit": "pod-3-1 -> pod-4-1 on nodes 3 and 4, which never run a proxy",
            "twin": "pod-3-2 -> pod-4-2, the limit's path between two other pods (the lab's self-test: 1.0)"
            if self.twin
            else "",
            "roles": {t: f"{c} -> {s}" for t, (c, s) in ROLES.items()},
            "client_close": "RST (SO_LINGER 0)",
            "interleaving": "each round's connection, request/response and UDP phases run every target in turn, one"
            " operation each, from one client; every target has its own client pod and its own server pod (each"
            " server one operation per turn); each target's sockets are made by a factory process in its client pod"
            " and its client node's cgroup (the limits' nodes have no socket programs, the loaded nodes have bpf's);"
            " rates are successful operations over the time of all operations, failed ones included, the slowest 1 %"
            f" of the successful ones left out (preemption); a round with a phase above {MAX_ERROR_FRACTION:.0%}"
            " failed operations for any target is failed and left out; target order shuffled per round; iperf3 per"
            " target after them",
            "mode_none": "no proxy: the ClusterIP target is measured at its endpoint's pod IP (pod-2-1), so the"
            " calibration runs the same targets, pods and schedule as a real run",
            "idle": f"kproxy's CPU seconds (user + system, /proc/PID/stat) over {self.idle_seconds:g} s with no traffic"
            " and no change, after it is ready",
        }


@dataclass
class DatapathResult:
    config: dict[str, Any]
    runs: list[DatapathRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "runs": [r.to_json() for r in self.runs]}


def parse_sizes(text: str) -> list[int]:
    """``"1,1000,10000"`` -> [1, 1000, 10000] (sorted, unique); ValueError for anything else."""
    sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not sizes or sizes[0] < 1 or sizes[-1] > synthetic.MAX_SERVICES:
        raise ValueError(f"service counts must be 1..{synthetic.MAX_SERVICES}: {text!r}")
    return sizes


def ratio(metric: str, target: float, limit: float) -> float | None:
    """Fraction of the limit's performance (1.0 = as fast as without proxy rules; smaller is slower)."""
    if target <= 0 or limit <= 0:
        return None
    return target / limit if HIGHER_IS_BETTER[metric] else limit / target


def flatten(client: dict[str, Any], iperf: dict[str, Any] | None) -> dict[str, float]:
    """One round's dpclient JSON (and iperf3's figure) as metric -> value."""
    out: dict[str, float] = {}
    for metric, source, _, _ in METRICS:
        phase, key = source.split(".")
        if phase == "iperf":
            if iperf is not None:
                out[metric] = float(iperf[key])
            continue
        part = client.get(phase)
        if isinstance(part, dict) and part.get("ops"):
            out[metric] = float(part[key])
    return out


def medians(rounds: Iterable[dict[str, float]]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for r in rounds:
        for k, v in r.items():
            values.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in values.items()}


def per_round_ratios(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, list[float]]]:
    """Each target's ratio to ``base`` per metric, one per round (target and base measured seconds apart)."""
    out: dict[str, dict[str, list[float]]] = {}
    for t in targets:
        if t == base:
            continue
        per_metric: dict[str, list[float]] = {}
        for r in rounds:
            limit, this = r.get(base, {}), r.get(t, {})
            for m, v in this.items():
                q = ratio(m, v, limit.get(m, 0.0))
                if q is not None:
                    per_metric.setdefault(m, []).append(q)
        out[t] = per_metric
    return out


def paired_ratios(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, float]]:
    """Each target's ratio to the limit (or ``base``) per metric: the median over rounds of the ratio *within* each
    round (the target and the limit measured seconds apart), which drift between rounds on a shared machine cannot
    skew the way it skews a ratio of two medians."""
    return {
        t: {m: statistics.median(v) for m, v in per_metric.items()}
        for t, per_metric in per_round_ratios(rounds, targets, base).items()
    }


def quartiles(values: Sequence[float]) -> list[float]:
    """[first quartile, third quartile] (the spread the report shows beside a median); one value: [v, v]."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def ratio_spread(
    rounds: Sequence[dict[str, dict[str, float]]], targets: Sequence[str], base: str = "limit"
) -> dict[str, dict[str, list[float]]]:
    """The interquartile range of each target's per-round ratios to ``base``: how noisy the median beside it is."""
    return {
        t: {m: [round(x, 4) for x in quartiles(v)] for m, v in per_metric.items()}
        for t, per_metric in per_round_ratios(rounds, targets, base).items()
    }


def iperf_gbps(doc: dict[str, Any]) -> float:
    """Receiver-side throughput of an ``iperf3 -J`` run, in Gbit/s."""
    try:
        return float(doc["end"]["sum_received"]["bits_per_second"]) / 1e9
    except (KeyError, TypeError, ValueError):
        raise DatapathError(f"iperf3 gave no throughput: {str(doc.get('error') or doc)[:300]}") from None


# --- writing services to the lab's API (its public HTTP API, as any client would) ----------------------------------


def _strip(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "resourceVersion", "generateName")}
    return {**obj, "metadata": meta}


def target_objects(pod: LabPod) -> list[dict[str, Any]]:
    """The target Service (TCP and UDP 80 -> 8080, TCP 5201 -> iperf3) and its EndpointSlice: pod ``pod`` only."""
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": TARGET_NAME, "namespace": TARGET_NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": TARGET_CLUSTER_IP,
            "clusterIPs": [TARGET_CLUSTER_IP],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [
                {"name": "tcp", "protocol": "TCP", "port": SERVICE_PORT, "targetPort": ECHO_PORT},
                {"name": "udp", "protocol": "UDP", "port": SERVICE_PORT, "targetPort": ECHO_PORT},
                {"name": "iperf", "protocol": "TCP", "port": IPERF_PORT, "targetPort": IPERF_PORT},
            ],
        },
    }
    eps = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{TARGET_NAME}-1",
            "namespace": TARGET_NAMESPACE,
            "labels": {"kubernetes.io/service-name": TARGET_NAME},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [pod.ip4],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "nodeName": pod.node,
                "targetRef": {"kind": "Pod", "namespace": TARGET_NAMESPACE, "name": pod.name},
            }
        ],
        "ports": [
            {"name": "tcp", "protocol": "TCP", "port": ECHO_PORT},
            {"name": "udp", "protocol": "UDP", "port": ECHO_PORT},
            {"name": "iperf", "protocol": "TCP", "port": IPERF_PORT},
        ],
    }
    return [svc, eps]


def _collection_path(obj: dict[str, Any]) -> str:
    ns = obj["metadata"]["namespace"]
    if obj["kind"] == "Service":
        return f"/api/v1/namespaces/{ns}/services"
    return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


class ApiWriter:
    """Creates objects through the API stand-in's HTTP API with a few keep-alive connections."""

    def __init__(self, api_url: str, threads: int = WRITE_THREADS) -> None:
        u = urlsplit(api_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.threads = threads
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []  # every thread's, closed when create_all ends
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def create(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj)
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request("POST", _collection_path(obj), body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status in (200, 201, 409):  # 409: already there from an earlier size
                return
            raise DatapathError(
                f"the lab API refused {obj['kind']} {obj['metadata']['name']}: {resp.status} {data[:300]!r}"
            )

    def create_all(self, objs: Iterable[dict[str, Any]]) -> int:
        n = 0
        try:
            with ThreadPoolExecutor(max_workers=self.threads) as pool:
                for _ in pool.map(self.create, objs):
                    n += 1
        finally:
            with self._lock:
                for conn in self._opened:
                    conn.close()
                self._opened.clear()
        return n


def synthetic_objects(first: int, last: int, endpoints: int) -> Iterable[dict[str, Any]]:
    """Services ``first..last`` of the synthetic set (and their slices), as the API's create takes them."""
    for i in range(first, last + 1):
        yield _strip(synthetic.service(i))
        yield _strip(synthetic.endpoint_slice(i, endpoints))


# --- the lab ------------------------------------------------------------------------------------------------------


#: ``progress(message, advance=0)``: the step starting now ("" keeps the last), and how many measurements just ended
Progress = Callable[..., None]


class DatapathLab:
    """The four-node lab of this benchmark; use as a context manager (the lab goes down on exit, also on error)."""

    def __init__(self, config: DatapathConfig, progress: Progress | None = None) -> None:
        self.config = config
        self.progress: Progress = progress or (lambda _msg, _advance=0: None)
        self.lab: Lab | None = None
        self.written = 0  # synthetic services in the API
        self._servers: list[subprocess.Popen[bytes]] = []
        self._clients: dict[str, subprocess.Popen[str]] = {}
        #: target -> (the socket factory in its client pod and cgroup, the client's end of its channel)
        self._factories: dict[str, tuple[subprocess.Popen[bytes], socket.socket]] = {}
        self.client_restarts = 0  # dpclients that died or hung and were started again
        self.proxied = False  # a proxy runs on the loaded nodes now (mode none: the ClusterIP has none to answer)

    def __enter__(self) -> DatapathLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # lifecycle

    def up(self) -> None:
        if Lab.live(self.config.prefix) is not None:
            raise DatapathError(
                f"a lab with prefix {self.config.prefix!r} is running: take it down first (kproxy lab --prefix"
                f" {self.config.prefix} down), or use another --lab-prefix"
            )
        nodes = 8 if self.config.conntrack_limits else 4
        self.progress(f"lab up ({self.config.prefix}: {nodes} nodes, {PODS_PER_NODE} pods each)")
        self.lab = Lab.up(
            nodes=nodes, pods_per_node=PODS_PER_NODE, mode=None, ipv6=False, prefix=self.config.prefix, timeout=120
        )
        lab = self.lab
        # the limit is only a limit if nothing in its nodes hooks netfilter; the loaded nodes start as bare (and are
        # returned to that after each mode: stop_mode)
        for node in lab.nodes:
            if self.tables(node.ns):
                raise DatapathError(f"{node.name} has nftables tables before any proxy ran: {self.tables(node.ns)}")
        for target in CONNTRACK_LIMITS if self.config.conntrack_limits else ():
            for node in self.path_nodes(target):  # for the whole run: these nodes are that limit's
                self._nft(node.ns, DIAG_RULESETS[target])
        for target in self.all_targets:
            pod = self.server_of(target)
            self._pin_echo(pod)
            self._start_iperf(pod)
            self._start_factory(target)
        ApiWriter(lab.api_url).create_all(target_objects(self.server_pod))

    @property
    def all_targets(self) -> tuple[str, ...]:
        """Every target this lab measures (the same in every mode)."""
        return targets_for("", self.config)

    def down(self) -> None:
        for client in self._clients.values():
            if client.poll() is None and client.stdin is not None:
                try:
                    client.stdin.write("quit\n")
                    client.stdin.close()
                except OSError:
                    pass
            try:
                client.wait(timeout=5)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(timeout=5)
            if client.stdout is not None:
                client.stdout.close()
        self._clients.clear()
        for proc, channel in self._factories.values():
            channel.close()  # the factory sees EOF and ends
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._factories.clear()
        for proc in self._servers:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._servers.clear()
        if self.lab is not None:
            self.progress("lab down")
            Lab.down(prefix=self.config.prefix)
            self.lab = None

    # who is who

    @property
    def _lab(self) -> Lab:
        if self.lab is None:
            raise DatapathError("the lab is not up")
        return self.lab

    @property
    def client_pod(self) -> LabPod:
        """The ClusterIP's client pod (pod-1-1)."""
        return self.client_of("clusterip")

    @property
    def server_pod(self) -> LabPod:
        """The ClusterIP's only endpoint (pod-2-1)."""
        return self.server_of("clusterip")

    @property
    def loaded_nodes(self) -> list[Any]:
        return [self._lab.node("node-1"), self._lab.node("node-2")]

    def path_nodes(self, target: str) -> list[Any]:
        """The two nodes a target's traffic crosses (client's, server's)."""
        return [self._lab.node(self._lab.pod(p).node) for p in ROLES[target]]

    def client_of(self, target: str) -> LabPod:
        return self._lab.pod(ROLES[target][0])

    def server_of(self, target: str) -> LabPod:
        return self._lab.pod(ROLES[target][1])

    def _nft(self, ns: str, text: str) -> None:
        res = self._lab.exec(ns, ["nft", "-f", "-"], input=text.encode(), timeout=30)
        if res.returncode != 0:
            raise DatapathError(f"nft in {ns}: {res.stderr.decode(errors='replace')[-300:]}")

    def conntrack_count(self, ns: str) -> float | None:
        """Connections conntrack tracks in a node's namespace now (None: conntrack is not loaded at all)."""
        res = self._lab.exec(ns, ["cat", "/proc/sys/net/netfilter/nf_conntrack_count"], timeout=10)
        try:
            return float(res.stdout.decode().strip()) if res.returncode == 0 else None
        except ValueError:
            return None

    def kproxy_cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) each loaded node's kproxy has used so far."""
        out = {}
        tick = os.sysconf("SC_CLK_TCK")
        for node in self.loaded_nodes:
            pid = self._lab.kproxy_pid(node)
            if pid is None:
                continue
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[node.name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
        return out

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """CPU seconds each loaded node's kproxy uses over ``seconds`` of quiet (no traffic, no change): a synced
        proxy should cost almost nothing. (A wall-clock interval on purpose: this is the measurement, not a wait.)"""
        if seconds <= 0:
            return {}
        before = self.kproxy_cpu()
        time.sleep(seconds)
        after = self.kproxy_cpu()
        return {k: round(after[k] - before[k], 3) for k in after if k in before}

    def _pin_echo(self, pod: LabPod) -> None:
        pid = next((p.get("echo_pid") for p in self._lab.status()["pods"] if p["name"] == pod.name), None)
        if not pid:
            raise DatapathError(f"no echo server found for {pod.name}")
        subprocess.run(["taskset", "-a", "-p", "-c", SERVER_CPU, str(pid)], check=True, capture_output=True, timeout=10)

    def _start_iperf(self, pod: LabPod) -> None:
        argv = netns.exec_argv(pod.ns, ["taskset", "-c", SERVER_CPU, "iperf3", "-s", "-p", str(IPERF_PORT)])
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=netns.cgroup_preexec(self._lab.cgroup_path(pod.node)),
        )
        self._servers.append(proc)

    # services and proxies

    def ensure_services(self, n: int) -> float:
        """Program ``n`` services in total (the target and ``n - 1`` synthetic ones); seconds the writes took."""
        want = n - 1
        if want <= self.written:
            if want < self.written:
                raise DatapathError("sizes must grow within one run (services are only ever added)")
            return 0.0
        self.progress(f"writing services {self.written + 1}..{want} to the lab API")
        t0 = time.monotonic()
        ApiWriter(self._lab.api_url).create_all(synthetic_objects(self.written + 1, want, self.config.endpoints))
        self.written = want
        return time.monotonic() - t0

    def start_mode(self, mode: str) -> float:
        """Start kproxy ``mode`` on both loaded nodes; seconds until both are healthy and the ClusterIP answers."""
        lab = self._lab
        t0 = time.monotonic()
        self.proxied = True
        for node in self.loaded_nodes:
            lab.start_kproxy(node, mode)
        for node in self.loaded_nodes:
            lab.wait_kproxy(node, timeout=KPROXY_READY_TIMEOUT)
        deadline = time.monotonic() + 60
        last = ""
        while time.monotonic() < deadline:
            tcp = lab.probe(self.client_pod.ns, "tcp", TARGET_CLUSTER_IP, SERVICE_PORT, timeout=1.0)[0]
            udp = lab.probe(self.client_pod.ns, "udp", TARGET_CLUSTER_IP, SERVICE_PORT, timeout=1.0)[0]
            if tcp.ok and udp.ok and tcp.pod == self.server_pod.name:
                return time.monotonic() - t0
            last = f"tcp {tcp!r}, udp {udp!r}"
            time.sleep(0.5)
        raise DatapathError(f"mode {mode}: the ClusterIP {TARGET_CLUSTER_IP} does not answer from pod-1-1: {last}")

    def stop_mode(self, mode: str) -> str:
        """Stop kproxy on both loaded nodes, remove what ``mode`` wrote (its cleanup, then whatever tables are left)
        and the conntrack entries; "" or what went wrong or was left (not fatal: noted beside the run)."""
        lab = self._lab
        self.proxied = False
        for node in self.loaded_nodes:
            lab.stop_kproxy(node)
        problems = []
        for node in self.loaded_nodes:
            try:
                res = lab.exec(node.ns, [*Lab.kproxy_command(), "cleanup", "--mode", mode], timeout=CLEANUP_TIMEOUT)
            except subprocess.TimeoutExpired:
                problems.append(f"kproxy cleanup --mode {mode} in {node.name} took over {CLEANUP_TIMEOUT:.0f} s")
                continue
            if res.returncode != 0:
                problems.append(f"kproxy cleanup in {node.name}: {res.stderr.decode(errors='replace')[-300:]}")
        # What the mode's cleanup leaves (iptables-nft's empty built-in tables and chains: a filter chain hooked at
        # forward taxes every packet of the next mode measured here) goes too, and the conntrack entries: each mode
        # starts on nodes as bare as the limit's were when the lab came up (up() checked they had no rules).
        for node in self.loaded_nodes:
            left = self.tables(node.ns)
            if left:
                problems.append(f"left in {node.name} after the cleanup (removed): {', '.join(left)}")
            lab.exec(node.ns, ["nft", "flush", "ruleset"], timeout=CLEANUP_TIMEOUT)
            lab.exec(node.ns, ["conntrack", "-F"], timeout=30)
        return "; ".join(problems)

    def tables(self, ns: str) -> list[str]:
        """The nftables tables in a namespace ("ip filter", ...)."""
        res = self._lab.exec(ns, ["nft", "list", "tables"], timeout=30)
        return [line.removeprefix("table ").strip() for line in res.stdout.decode().splitlines() if line.strip()]

    def kproxy_memory(self) -> tuple[dict[str, float], dict[str, float]]:
        """(resident MB, peak resident MB) of each loaded node's kproxy."""
        rss, peak = {}, {}
        for node in self.loaded_nodes:
            pid = self._lab.kproxy_pid(node)
            if pid is None:
                continue
            try:
                fields = dict(
                    line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line
                )
            except OSError:
                continue
            rss[node.name] = int(fields["VmRSS"].split()[0]) / 1024
            peak[node.name] = int(fields["VmHWM"].split()[0]) / 1024
        return rss, peak

    def sync_metrics(self) -> dict[str, dict[str, float]]:
        """Each loaded node's sync-duration histogram (sum, count) from its /metrics, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        code = (
            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
            "'http://127.0.0.1:10249/metrics', timeout=10).read().decode())"
        )
        out: dict[str, dict[str, float]] = {}
        for node in self.loaded_nodes:
            res = self._lab.exec(node.ns, [sys.executable, "-c", code], timeout=30)
            if res.returncode != 0:
                continue
            figures: dict[str, float] = {}
            for fam in text_string_to_metric_families(res.stdout.decode(errors="replace")):
                if fam.name not in (
                    "kubeproxy_sync_proxy_rules_duration_seconds",
                    "kubeproxy_sync_full_proxy_rules_duration_seconds",
                ):
                    continue
                short = fam.name.removeprefix("kubeproxy_").removesuffix("_duration_seconds")
                for s in fam.samples:
                    if s.name.endswith("_sum"):
                        figures[f"{short}_sum_s"] = figures.get(f"{short}_sum_s", 0.0) + s.value
                    elif s.name.endswith("_count"):
                        figures[f"{short}_count"] = figures.get(f"{short}_count", 0.0) + s.value
            out[node.name] = figures
        return out

    # traffic

    def _iperf(self, pod: LabPod, host: str) -> dict[str, Any]:
        c = self.config
        argv = [*PINNED_CLIENT, "iperf3", "-c", host, "-p", str(IPERF_PORT)]
        argv += ["-t", str(c.iperf_seconds), "-J", "--connect-timeout", "2000"]
        last: dict[str, Any] = {}
        for _ in range(3):  # the server may still be finishing the previous test ("server is busy")
            res = self._lab.exec(pod.ns, argv, timeout=c.iperf_seconds + 60)
            try:
                last = json.loads(res.stdout.decode() or "{}")
            except ValueError:
                last = {"error": res.stdout.decode(errors="replace")[-300:]}
            if res.returncode == 0 and "end" in last:
                return {"gbps": iperf_gbps(last)}
            time.sleep(0.5)
        raise DatapathError(f"iperf3 in {pod.name} -> {host}: {str(last.get('error') or last)[:300]}")

    def endpoints_of(self, target: str) -> tuple[LabPod, str, int]:
        """(client pod, address, port) of a target. Without a proxy the ClusterIP is measured at its endpoint's pod
        IP: mode none then runs the same targets, pods and schedule as a real run (the calibration)."""
        if target == "clusterip" and self.proxied:
            return self.client_pod, TARGET_CLUSTER_IP, SERVICE_PORT
        return self.client_of(target), self.server_of(target).ip4, ECHO_PORT

    def _start_factory(self, target: str) -> None:
        """The target's socket factory (dpclient.factory): in its client pod, its client node's cgroup and pinned to
        the client CPU, so the target's sockets pass exactly the socket programs of the node it starts from."""
        pod = self.client_of(target)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*PINNED_CLIENT, sys.executable, "-m", "kproxy.bench.dpclient", "--factory", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(
                netns.exec_argv(pod.ns, argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                preexec_fn=netns.cgroup_preexec(self._lab.cgroup_path(pod.node)),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._factories[target] = (proc, ours)

    def factory_pid(self, target: str) -> int:
        """The pid of the process that makes a target's sockets."""
        return self._factories[target][0].pid

    def _multi_client(self) -> subprocess.Popen[str]:
        """The one ``dpclient --serve`` that measures every target in turn (:func:`dpclient.interleaved`), pinned to
        the client CPU. It makes no socket of its own: each target's come from that target's factory, whose channel
        it inherits (the same descriptor number as here), so no target's sockets are in the wrong cgroup."""
        proc = self._clients.get("multi")
        if proc is None or proc.poll() is not None:
            argv = [*PINNED_CLIENT, sys.executable, "-m", "kproxy.bench.dpclient", "--serve"]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                pass_fds=tuple(ch.fileno() for _, ch in self._factories.values()),
            )
            self._clients["multi"] = proc
        return proc

    def _multi_phase(self, phase: str, targets: Sequence[str]) -> list[dict[str, Any]]:
        c = self.config
        spec = []
        for t in targets:
            _pod, host, port = self.endpoints_of(t)
            spec.append({"source": self._factories[t][1].fileno(), "host": host, "port": port})
        seconds = c.seconds * len(targets)  # the same operations per target as a phase of its own
        req = {"phase": phase, "targets": spec, "seconds": seconds, "warmup": 0.05, "timeout": 1.0}
        line = ""
        for attempt in range(2):
            proc = self._multi_client()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], 3 * seconds + 30)
                line = proc.stdout.readline() if ready else ""
            except OSError:
                line = ""
            if line:
                break
            proc.kill()
            proc.wait(timeout=10)
            self._clients.pop("multi", None)
            self.client_restarts += 1
            self.progress(
                f"the interleaved dpclient gave no answer to {phase} (exit {proc.returncode}); attempt {attempt}"
            )
        if not line:
            raise DatapathError(f"the interleaved dpclient gave no answer to {req}, twice")
        answer = dict(json.loads(line))
        if "error" in answer:
            raise DatapathError(f"the interleaved dpclient, {req}: {answer['error']}")
        return list(answer["targets"])

    def measure_round(self, targets: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
        """:meth:`judged_round` without the verdict: (figures per target, errors per target)."""
        out, errors, _failure = self.judged_round(targets)
        return out, errors

    def judged_round(self, targets: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, int], str]:
        """One round over ``targets``: each request/response phase interleaved across all of them (one operation
        per target in turn), then iperf3 per target in the order given. (figures per target, errors per target,
        why the round failed: "" when it did not, see :func:`round_failure`)"""
        client: dict[str, dict[str, Any]] = {t: {} for t in targets}
        for phase in ("crr", "rr", "udp"):
            for t, figures in zip(targets, self._multi_phase(phase, targets), strict=True):
                client[t][phase] = figures
        out, errors = {}, {}
        for t in targets:
            pod, host, _port = self.endpoints_of(t)
            errors[t] = sum(int(client[t][p].get("errors", 0)) for p in client[t])
            try:
                iperf: dict[str, Any] | None = self._iperf(pod, host)
            except DatapathError as exc:  # this round has no throughput for it (counted), the rest stands
                self.progress(f"{t}: {exc}")
                iperf, errors[t] = None, errors[t] + 1
            out[t] = flatten(client[t], iperf)
        return out, errors, round_failure(client)


def round_failure(client: dict[str, dict[str, dict[str, Any]]], limit: float = MAX_ERROR_FRACTION) -> str:
    """Why a round's figures cannot stand ("" if they can): some target failed more than ``limit`` of one phase's
    operations (a path that loses connections or datagrams is broken, not slow; its rate would hide it)."""
    bad = []
    for t, phases in client.items():
        for phase, fig in phases.items():
            ops, errs = int(fig.get("ops", 0)), int(fig.get("errors", 0))
            if errs and errs > limit * (ops + errs):
                bad.append(f"{t} {phase}: {errs} of {ops + errs} operations failed")
    return "; ".join(bad)


def targets_for(mode: str, config: DatapathConfig) -> tuple[str, ...]:
    """What a run measures: the limit, the pod IP on the loaded nodes, the ClusterIP, the limit's twin and the
    diagnostic limits when asked for. The same in every mode: mode none (the calibration) measures the ClusterIP's
    endpoint in the ClusterIP's place (DatapathLab.endpoints_of), so it shares servers and turns as a real run."""
    del mode  # every mode alike, on purpose: a calibration with another schedule would calibrate something else
    return TARGETS + ((TWIN,) if config.twin else ()) + (CONNTRACK_LIMITS if config.conntrack_limits else ())


def round_order(targets: Sequence[str], r: int) -> list[str]:
    """The targets' order in round ``r``: a shuffle seeded by the round, the same in every run. An interleaved
    operation runs a little faster after one from the same pod (warm caches), so a fixed cyclic order (a rotation
    keeps each target's predecessor) would favour one target for the whole run; shuffled, each has every
    predecessor in turn."""
    order = list(targets)
    random.Random(r).shuffle(order)
    return order


def measure_run(dl: DatapathLab, mode: str, services: int, targets: Sequence[str]) -> DatapathRun:
    """Rounds over ``targets`` (rotating their order) with whatever is programmed now; medians and ratios."""
    run = DatapathRun(mode=mode, services=services)
    per_target: dict[str, list[dict[str, float]]] = {t: [] for t in targets}
    ct: dict[str, dict[str, list[float]]] = {}
    cpu0 = dl.kproxy_cpu()
    for r in range(dl.config.rounds):
        order = round_order(targets, r)
        dl.progress(f"{mode} @ {services}: round {r + 1}/{dl.config.rounds}, {', '.join(order)} interleaved")
        this_round, errors, failure = dl.judged_round(order)
        for t in order:
            run.errors[t] = run.errors.get(t, 0) + errors[t]
        if failure:  # left out whole, every target's figures of it, so the rounds stay paired
            run.failed_rounds.append(f"round {r + 1}: {failure}")
            dl.progress(f"{mode} @ {services}: round {r + 1} failed: {failure}", len(order))
            continue
        for t in order:
            for side, node in zip(("client_node", "server_node"), dl.path_nodes(t), strict=True):
                n = dl.conntrack_count(node.ns)
                if n is not None:
                    ct.setdefault(t, {}).setdefault(side, []).append(n)
            per_target[t].append(this_round[t])
        dl.progress("", len(order))
        run.rounds.append(this_round)
    cpu1 = dl.kproxy_cpu()
    run.kproxy_cpu_s = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1 if k in cpu0}
    if len(run.failed_rounds) * 2 > dl.config.rounds:
        raise DatapathError(f"{len(run.failed_rounds)} of {dl.config.rounds} rounds failed: {run.failed_rounds}")
    run.medians = {t: medians(v) for t, v in per_target.items()}
    run.ratios = paired_ratios(run.rounds, targets)
    run.ratio_spread = ratio_spread(run.rounds, targets)
    run.conntrack_entries = {t: {side: statistics.median(v) for side, v in d.items()} for t, d in ct.items()}
    for base in CONNTRACK_LIMITS:
        if base in targets:
            both = [t for t in ("podip", "clusterip") if t in targets]
            run.ratios_vs[base] = paired_ratios(run.rounds, [base, *both], base)
    return run


def run_in_lab(
    dl: DatapathLab, modes: Sequence[str], n: int, on_run: Callable[[DatapathRun], None] | None = None
) -> list[DatapathRun]:
    """Every mode at size ``n`` in a running DatapathLab (mode ``none``: no proxy at all)."""
    dl.ensure_services(n)
    runs = []
    for mode in modes:
        if mode == NONE_MODE:
            run = measure_run(dl, mode, n, targets_for(mode, dl.config))
        else:
            dl.progress(f"{mode} @ {n}: starting kproxy on node-1 and node-2")
            try:
                ready = dl.start_mode(mode)
            except (DatapathError, LabError) as exc:
                # one mode failing at one size is a finding for the report, not the end of everyone's figures
                run = DatapathRun(mode=mode, services=n, error=str(exc)[:2000])
                dl.progress(f"{mode} @ {n}: FAILED: {exc}", dl.config.rounds * len(targets_for(mode, dl.config)))
                dl.stop_mode(mode)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
                continue
            try:
                rss, peak = dl.kproxy_memory()
                dl.progress(f"{mode} @ {n}: kproxy's idle CPU over {dl.config.idle_seconds:g} s")
                idle = dl.idle_cpu(dl.config.idle_seconds)
                try:
                    run = measure_run(dl, mode, n, targets_for(mode, dl.config))
                except DatapathError as exc:  # a measurement that failed: this run's finding, not everyone's end
                    run = DatapathRun(mode=mode, services=n, error=f"measuring: {str(exc)[:2000]}")
                run.idle_cpu_s, run.idle_seconds = idle, dl.config.idle_seconds
                run.ready_s = ready
                run.kproxy_rss_mb, run.kproxy_peak_rss_mb = rss, peak
                run.sync_metrics = dl.sync_metrics()
            finally:
                cleanup_problem = dl.stop_mode(mode)
            if cleanup_problem:
                run.note = cleanup_problem
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs


def run_datapath(
    modes: Sequence[str],
    sizes: Sequence[int],
    config: DatapathConfig | None = None,
    progress: Progress | None = None,
    on_run: Callable[[DatapathRun], None] | None = None,
) -> DatapathResult:
    """Every mode at every size (ascending) in one lab, taken down afterwards. Modes must be available here."""
    config = config or DatapathConfig()
    result = DatapathResult(config=config.describe())
    if on_run is None and progress is not None:
        # each run's whole figures as one line on the progress stream as soon as it is measured, so a run that
        # ends early (a crash, a kill) still leaves what it measured
        report = progress

        def on_run(run: DatapathRun) -> None:
            report("measured: " + json.dumps(run.to_json(), separators=(",", ":")))

    with DatapathLab(config, progress) as dl:
        for n in sorted(set(sizes)):
            result.runs += run_in_lab(dl, modes, n, on_run)
    return result


# --- output -------------------------------------------------------------------------------------------------------


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric == "tcp_gbps":
        return f"{v:.2f}"
    return f"{v:,.0f}"


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows as aligned text: the first column left, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]


ALL_TARGETS = (*TARGETS, TWIN, *CONNTRACK_LIMITS)


def _ratio_cell(ratios: dict[str, float], spread: dict[str, list[float]], metric: str) -> str:
    v = ratios.get(metric)
    if v is None:
        return "-"
    q = spread.get(metric)
    return f"{v:.2f} [{q[0]:.2f}-{q[1]:.2f}]" if q else f"{v:.2f}"


def format_table(result: DatapathResult) -> str:
    """One block per run: each metric's medians per target and the ratios to the limit (with the interquartile range
    of the per-round ratios in brackets: the noise), then the ratios against the diagnostic limits."""
    lines = []
    c = result.config
    lines.append(
        f"medians of {c['rounds']} rounds ({c['seconds']} s per phase, iperf3 {c['iperf_seconds']} s);"
        f" pinning: {c['pinning']}; limit: {c['limit']}; ratio 1.0 = as fast as the limit, [q1-q3] of the"
        " per-round ratios beside each"
    )
    if c.get("twin"):
        lines.append(f"limit_twin: {c['twin']}")
    for name, text in (c.get("conntrack_limits_detail") or {}).items():
        lines.append(f"{name}: {text}")
    for run in result.runs:
        lines.append("")
        head = f"mode {run.mode}, {run.services} services"
        if run.ready_s:
            head += f" (ready {run.ready_s:.1f} s after start"
            if run.kproxy_rss_mb:
                head += ", kproxy RSS " + ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(run.kproxy_rss_mb.items()))
            if run.idle_cpu_s:
                head += f", kproxy CPU idle over {run.idle_seconds:g} s " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in sorted(run.idle_cpu_s.items())
                )
            if run.kproxy_cpu_s:
                head += ", kproxy CPU while measuring " + ", ".join(
                    f"{k} {v:.1f} s" for k, v in sorted(run.kproxy_cpu_s.items())
                )
            head += ")"
        lines.append(head)
        if run.error:
            lines.append(f"NOT MEASURED: {run.error}")
            continue
        targets = [t for t in ALL_TARGETS if t in run.medians]
        cols = ["metric", *targets, *(f"{t}/limit" for t in targets if t != "limit")]
        rows = []
        for metric, _, _, unit in METRICS:
            row = [f"{metric} ({unit})"]
            row += [_fmt(metric, run.medians[t].get(metric)) for t in targets]
            row += [
                _ratio_cell(run.ratios.get(t, {}), run.ratio_spread.get(t, {}), metric) for t in targets if t != "limit"
            ]
            rows.append(row)
        lines += _columns([cols, *rows])
        for base, per_target in run.ratios_vs.items():
            against = [t for t in ("podip", "clusterip") if t in per_target]
            if not against:
                continue
            lines.append(f"against {base}:")
            rows = [["metric", *(f"{t}/{base}" for t in against)]]
            for metric, _, _, unit in METRICS:
                rows.append(
                    [
                        f"{metric} ({unit})",
                        *(
                            "-" if per_target[t].get(metric) is None else f"{per_target[t][metric]:.2f}"
                            for t in against
                        ),
                    ]
                )
            lines += _columns(rows)
        if run.conntrack_entries:
            lines.append(
                "conntrack entries after a round (client node, server node): "
                + "; ".join(
                    f"{t} {d.get('client_node', 0):.0f}, {d.get('server_node', 0):.0f}"
                    for t, d in run.conntrack_entries.items()
                )
            )
        if any(run.errors.values()):
            lines.append("errors: " + ", ".join(f"{t} {n}" for t, n in sorted(run.errors.items()) if n))
        for why in run.failed_rounds:
            lines.append(f"left out: {why}")
    return "\n".join(lines)


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI runner, ``kill``) unwind like Ctrl-C, so the lab goes down with the run
    instead of being left behind with its processes (the main thread only, where Python runs signal handlers)."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def check_modes(modes: Sequence[str]) -> list[str]:
    """Problems with the requested modes (unknown, not installed, not available here): empty when all can run."""
    from kproxy.proxier import availability

    problems = []
    for mode in modes:
        if mode == NONE_MODE:
            continue
        avail = availability(mode)
        if not avail:
            problems.append(f"mode {mode}: {avail.reason}")
    return problems


__all__ = [
    "DatapathConfig",
    "DatapathError",
    "DatapathLab",
    "DatapathResult",
    "DatapathRun",
    "LabError",
    "METRICS",
    "check_modes",
    "format_table",
    "parse_sizes",
    "run_datapath",
    "run_in_lab",
    "stop_on_sigterm",
]
