"""The data-path benchmark's fixed facts and its value types: the lab prefix, the targets and each target's client
and server pods (``ROLES``), the diagnostic limits' rulesets, the pinning, and the run, config and result records
(kproxy.bench.datapath says what is measured and why).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
#: the ClusterIP path the other way round (node-2 -> node-1), measured with ``DatapathConfig.counters_cost``: one of
#: the two loaded nodes' kproxy counts (``--service-counters``), the other does not, and the two ClusterIP targets,
#: one from each node, are the counted and the uncounted path of the same rounds (kproxy.bench.dpcounters)
REV = "clusterip_rev"
REV_NAME = "target-rev"
REV_CLUSTER_IP = "198.19.200.11"
#: the ClusterIP targets: target -> (service name, ClusterIP)
CLUSTER_IPS = {"clusterip": (TARGET_NAME, TARGET_CLUSTER_IP), REV: (REV_NAME, REV_CLUSTER_IP)}
#: the issue's budget: counters on may cost at most 3 % of new connections per second against counters off
COUNTERS_BUDGET = 0.97
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
    REV: ("pod-2-3", "pod-1-3"),  # a third pod on each loaded node, only with DatapathConfig.counters_cost
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
    #: with DatapathConfig.counters_cost: counters on / counters off per metric, both halves, the node asymmetry
    #: and each half's counter check (kproxy.bench.dpcounters.cost_entry)
    counters_cost: dict[str, Any] = field(default_factory=dict)
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
    #: also measure what --service-counters costs the ClusterIP path, per mode (kproxy.bench.dpcounters): REV every
    #: round, each mode run twice with the counting node swapped
    counters_cost: bool = False
    #: mode -> the backend options (``--backend-option``) its kproxy runs with on the loaded nodes, those the mode
    #: declares (kproxy.bench.options.parse_for_modes); recorded in the result's config
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def pods_per_node(self) -> int:
        return PODS_PER_NODE + 1 if self.counters_cost else PODS_PER_NODE

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
            "counters_cost_detail": "ClusterIP pod-1-1 -> pod-2-1 (node-1's kproxy translates) and pod-2-3 -> pod-1-3"
            " (node-2's) in the same rounds; first half node-2 runs with --service-counters and node-1 without, then"
            " both restarted with the roles swapped; counters on / off per metric is the geometric mean of the two"
            " halves' medians of per-round ratios, the node asymmetry (1.0: the nodes alike) their quotient's root;"
            " each half checks that the counting node's /metrics grew by the connections made and the other node"
            " serves no counters"
            if self.counters_cost
            else "",
            "idle": f"kproxy's CPU seconds (user + system, /proc/PID/stat) over {self.idle_seconds:g} s with no traffic"
            " and no change, after it is ready",
        }


@dataclass
class DatapathResult:
    config: dict[str, Any]
    runs: list[DatapathRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "runs": [r.to_json() for r in self.runs]}


def targets_for(mode: str, config: DatapathConfig) -> tuple[str, ...]:
    """What a run measures: the limit, the pod IP on the loaded nodes, the ClusterIP, the limit's twin and the
    diagnostic limits when asked for. The same in every mode: mode none (the calibration) measures the ClusterIP's
    endpoint in the ClusterIP's place (DatapathLab.endpoints_of), so it shares servers and turns as a real run."""
    del mode  # every mode alike, on purpose: a calibration with another schedule would calibrate something else
    return (
        TARGETS
        + ((TWIN,) if config.twin else ())
        + (CONNTRACK_LIMITS if config.conntrack_limits else ())
        + ((REV,) if config.counters_cost else ())
    )
