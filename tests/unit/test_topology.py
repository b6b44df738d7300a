"""Table tests for kproxy.topology: upstream CategorizeEndpoints, topology hints and the traffic-policy helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kproxy.model import Endpoint
from kproxy.topology import (
    PREFER_SAME_NODE,
    PREFER_SAME_ZONE,
    categorize_endpoints,
    topology_mode,
    uses_cluster_endpoints,
    uses_local_endpoints,
)

NODE = "node-a"


def ep(
    ip: str,
    *,
    ready: bool = True,
    serving: bool | None = None,
    terminating: bool = False,
    local: bool = False,
    zones: tuple[str, ...] = (),
    nodes: tuple[str, ...] = (),
) -> Endpoint:
    return Endpoint(
        ip=ip,
        port=80,
        ready=ready,
        serving=ready if serving is None else serving,
        terminating=terminating,
        node_name=NODE if local else "node-b",
        is_local=local,
        zone_hints=frozenset(zones),
        node_hints=frozenset(nodes),
    )


def ips(eps: tuple[Endpoint, ...]) -> set[str]:
    return {e.ip for e in eps}


@dataclass
class Case:
    name: str
    endpoints: list[Endpoint]
    uses_cluster: bool = True
    uses_local: bool = False
    zone: str | None = None
    cluster: set[str] = field(default_factory=set)
    local: set[str] = field(default_factory=set)
    reachable: set[str] | None = None  # default: cluster | local
    has_any: bool = False


A, B, C, D = "198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"
TERM = {"ready": False, "serving": True, "terminating": True}
DEAD = {"ready": False, "serving": False, "terminating": True}

CASES = [
    Case("no endpoints", []),
    Case("cluster: ready only", [ep(A), ep(B, ready=False, serving=False)], cluster={A}, has_any=True),
    Case("cluster: all ready", [ep(A), ep(B)], cluster={A, B}, has_any=True),
    Case("cluster: terminating fallback", [ep(A, **TERM), ep(B, **DEAD)], cluster={A}, has_any=True),
    Case("cluster: ready beats terminating", [ep(A, **TERM), ep(B)], cluster={B}, has_any=True),
    Case("cluster: nothing serving", [ep(A, **DEAD), ep(B, ready=False, serving=False)], has_any=False),
    Case(
        "local: ready local only",
        [ep(A, local=True), ep(B)],
        uses_cluster=False,
        uses_local=True,
        local={A},
        has_any=True,
    ),
    Case(
        "local: no local endpoints but remote ones -> has_any (drop, not reject)",
        [ep(A), ep(B)],
        uses_cluster=False,
        uses_local=True,
        local=set(),
        has_any=True,
    ),
    Case(
        "local: terminating local fallback",
        [ep(A, local=True, **TERM), ep(B)],
        uses_cluster=False,
        uses_local=True,
        local={A},
        has_any=True,
    ),
    Case(
        "local: ready local beats terminating local",
        [ep(A, local=True, **TERM), ep(B, local=True)],
        uses_cluster=False,
        uses_local=True,
        local={B},
        has_any=True,
    ),
    Case(
        "local: remote terminating counts for has_any",
        [ep(A, **TERM)],
        uses_cluster=False,
        uses_local=True,
        has_any=True,
    ),
    Case(
        "local: only non-serving endpoints",
        [ep(A, local=True, **DEAD)],
        uses_cluster=False,
        uses_local=True,
        has_any=False,
    ),
    Case(
        "both: union equals cluster when no topology and no fallback",
        [ep(A, local=True), ep(B)],
        uses_local=True,
        cluster={A, B},
        local={A},
        has_any=True,
    ),
    Case(
        "both: local terminating fallback is merged into all_reachable",
        [ep(A, local=True, **TERM), ep(B)],
        uses_local=True,
        cluster={B},
        local={A},
        reachable={A, B},
        has_any=True,
    ),
    Case(
        "zone hints: same zone kept",
        [ep(A, zones=("z1",)), ep(B, zones=("z2",)), ep(C, zones=("z1",))],
        zone="z1",
        cluster={A, C},
        has_any=True,
    ),
    Case(
        "zone hints: no endpoint for our zone -> no filtering",
        [ep(A, zones=("z1",)), ep(B, zones=("z2",))],
        zone="z3",
        cluster={A, B},
        has_any=True,
    ),
    Case(
        "zone hints: one ready endpoint without hints -> no filtering",
        [ep(A, zones=("z1",)), ep(B)],
        zone="z1",
        cluster={A, B},
        has_any=True,
    ),
    Case(
        "zone hints: unready endpoint without hints does not matter",
        [ep(A, zones=("z1",)), ep(B, zones=("z2",)), ep(C, ready=False, serving=False)],
        zone="z1",
        cluster={A},
        has_any=True,
    ),
    Case(
        "zone hints: node without zone label -> no filtering",
        [ep(A, zones=("z1",)), ep(B, zones=("z2",))],
        zone=None,
        cluster={A, B},
        has_any=True,
    ),
    Case(
        "zone hints: fallback to terminating ignores topology",
        [ep(A, zones=("z2",), **TERM), ep(B, zones=("z1",), **TERM)],
        zone="z1",
        cluster={A, B},
        has_any=True,
    ),
    Case(
        "node hints: same node kept",
        [ep(A, nodes=(NODE,), zones=("z1",)), ep(B, nodes=("node-b",), zones=("z1",))],
        zone="z1",
        cluster={A},
        has_any=True,
    ),
    Case(
        "node hints: none for this node -> zone hints used",
        [ep(A, nodes=("node-c",), zones=("z1",)), ep(B, nodes=("node-b",), zones=("z2",))],
        zone="z1",
        cluster={A},
        has_any=True,
    ),
    Case(
        "node hints: one endpoint lacks a node hint -> zone hints used",
        [ep(A, nodes=(NODE,), zones=("z2",)), ep(B, zones=("z1",))],
        zone="z1",
        cluster={B},
        has_any=True,
    ),
    Case(
        "topology + local: union of topology-filtered cluster set and local set",
        [ep(A, local=True, zones=("z2",)), ep(B, zones=("z1",))],
        uses_local=True,
        zone="z1",
        cluster={B},
        local={A},
        reachable={A, B},
        has_any=True,
    ),
    Case(
        "neither policy used",
        [ep(A)],
        uses_cluster=False,
        uses_local=False,
        has_any=False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_categorize_endpoints(case: Case) -> None:
    got = categorize_endpoints(
        case.endpoints, uses_cluster=case.uses_cluster, uses_local=case.uses_local, node_name=NODE, zone=case.zone
    )
    assert ips(got.cluster) == case.cluster
    assert ips(got.local) == case.local
    expected_reachable = case.reachable if case.reachable is not None else case.cluster | case.local
    assert ips(got.all_reachable) == expected_reachable
    assert len(got.all_reachable) == len(expected_reachable), "all_reachable must not repeat an endpoint"
    assert got.has_any is case.has_any
    if not case.uses_cluster:
        assert got.cluster == ()
    if not case.uses_local:
        assert got.local == ()


def test_categorize_keeps_input_order() -> None:
    eps = [ep(C), ep(A), ep(B)]
    got = categorize_endpoints(eps, uses_cluster=True, uses_local=False, node_name=NODE, zone=None)
    assert [e.ip for e in got.cluster] == [C, A, B]


@pytest.mark.parametrize(
    ("endpoints", "zone", "mode"),
    [
        ([], "z1", ""),
        ([ep(A, ready=False, serving=False, zones=("z1",))], "z1", ""),
        ([ep(A, zones=("z1",))], "z1", PREFER_SAME_ZONE),
        ([ep(A, zones=("z1",))], None, ""),
        ([ep(A, nodes=(NODE,))], None, PREFER_SAME_NODE),
        ([ep(A, nodes=(NODE,)), ep(B, nodes=("x",))], "z1", PREFER_SAME_NODE),
        ([ep(A, nodes=("x",), zones=("z1",))], "z1", PREFER_SAME_ZONE),
        ([ep(A, nodes=("x",))], "z1", ""),
    ],
)
def test_topology_mode(endpoints: list[Endpoint], zone: str | None, mode: str) -> None:
    assert topology_mode(endpoints, NODE, zone) == mode


@pytest.mark.parametrize(
    ("internal_local", "external_local", "has_external", "cluster", "local"),
    [
        (False, False, False, True, False),  # plain ClusterIP
        (False, False, True, True, False),  # NodePort, Cluster policies
        (True, False, False, False, True),  # iTP=Local ClusterIP: never the cluster set
        (True, False, True, True, True),  # iTP=Local NodePort with eTP=Cluster
        (False, True, True, True, True),  # eTP=Local: local for external, cluster for short-circuit + internal
        (True, True, True, True, True),  # both Local: cluster set still needed for the short-circuit
        (False, True, False, True, False),  # eTP=Local without external addresses means nothing
    ],
)
def test_policy_helpers(
    internal_local: bool, external_local: bool, has_external: bool, cluster: bool, local: bool
) -> None:
    assert uses_cluster_endpoints(internal_local, external_local, has_external) is cluster
    assert uses_local_endpoints(internal_local, external_local, has_external) is local
