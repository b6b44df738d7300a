"""The lab's plan: which namespaces, links, addresses and routes a lab of N nodes and M pods per node has.

Pure (no I/O), so names and addresses can be checked without root; kproxy.lab.cluster builds what it says.

Topology (fixed names and addresses others rely on; prefix "kpl-"):

* fabric namespace ``kpl-fabric`` with bridge ``kpl-br0`` (198.18.0.1/24, fd00:198:18::1/64): the API stand-in
  listens there on port 6443;
* node i (1-based) ``kpl-n{i}``: ``eth0`` 198.18.0.{10+i}/24, fd00:198:18::{10+i}/64 on the fabric; pod bridge
  ``cbr0`` 198.18.{64+i}.1/24, fd00:198:18:{64+i}::1/64; routes to the other nodes' pod CIDRs via their fabric
  addresses; a default route via the external client (so a packet to a VIP without rules reaches the netfilter
  hooks instead of failing routing, and "no endpoints -> refused" is observable); ip forwarding, the
  bridge-nf-call sysctls, and its own cgroup ``kpl-n{i}`` in a lab-owned cgroup2 mount;
* pod j on node i: namespace ``kpl-n{i}-p{j}``, pod ``pod-{i}-{j}``, 198.18.{64+i}.{10+j}/24 and
  fd00:198:18:{64+i}::{10+j}/64, default routes via cbr0, hairpin on its bridge port, running
  ``python -m kproxy.lab.echo`` (kproxy.lab.echo) inside the node's cgroup;
* external client ``kpl-ext``: 198.18.0.2/24, fd00:198:18::2/64, routes to the service ranges via node 1.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PREFIX = "kpl-"
CLUSTER_CIDR4 = "198.18.64.0/18"
CLUSTER_CIDR6 = "fd00:198:18:40::/58"
SERVICE_ROUTES4 = ("198.19.0.0/16",)
# fd00:198:18:ff::/64 is where the tests allocate ClusterIPs; fd00:198:18:ffff::/64 holds the API stand-in's own
# default allocation range, routed too so an automatically allocated IPv6 ClusterIP is as reachable as a chosen one.
SERVICE_ROUTES6 = ("fd00:198:18:ff::/64", "fd00:198:18:ffff::/64")
API_PORT_IN_LAB = 6443
MAX_NODES = 15  # fd00:198:18:{64+i}:: must stay inside fd00:198:18:40::/58 (hex 40..7f)
MAX_PODS_PER_NODE = 200
ZONE_LABEL = "topology.kubernetes.io/zone"


class LabError(RuntimeError):
    """The lab could not be built, found or used; the message says what and where to look."""


@dataclass(frozen=True)
class LabNode:
    index: int
    name: str
    ns: str
    ip4: str
    ip6: str
    pod_cidr4: str
    pod_cidr6: str
    zone: str


@dataclass(frozen=True)
class LabPod:
    name: str
    ns: str
    node: str  # the LabNode's name ("node-1")
    ip4: str
    ip6: str


@dataclass(frozen=True)
class Plan:
    prefix: str
    ipv6: bool
    fabric_ns: str
    bridge: str
    external_ns: str
    external_ip4: str
    external_ip6: str
    nodes: tuple[LabNode, ...]
    pods: tuple[LabPod, ...]

    def namespaces(self) -> list[str]:
        return [self.fabric_ns, self.external_ns, *(n.ns for n in self.nodes), *(p.ns for p in self.pods)]


def check_prefix(prefix: str) -> str:
    """The prefix if valid, else LabError: one word and a dash, so no lab's prefix is the start of another's and
    ``down`` of one (which removes every namespace starting with its prefix) never touches the other."""
    if not re.fullmatch(r"[a-z][a-z0-9]{1,8}-", prefix):
        raise LabError(f"invalid lab prefix {prefix!r}: want a short lower-case word and a dash, like 'kpl-'")
    return prefix


def make_plan(nodes: int, pods_per_node: int, ipv6: bool = True, prefix: str = DEFAULT_PREFIX) -> Plan:
    if not 1 <= nodes <= MAX_NODES:
        raise LabError(f"nodes must be 1..{MAX_NODES}, not {nodes}")
    if not 0 <= pods_per_node <= MAX_PODS_PER_NODE:
        raise LabError(f"pods_per_node must be 0..{MAX_PODS_PER_NODE}, not {pods_per_node}")
    check_prefix(prefix)
    lab_nodes, lab_pods = [], []
    cluster4, cluster6 = ipaddress.IPv4Network(CLUSTER_CIDR4), ipaddress.IPv6Network(CLUSTER_CIDR6)
    for i in range(1, nodes + 1):
        cidr4, cidr6 = f"198.18.{64 + i}.0/24", f"fd00:198:18:{64 + i}::/64"
        # the pod CIDRs must fall inside --cluster-cidr, or every backend's local-traffic detection is wrong
        if not ipaddress.IPv4Network(cidr4).subnet_of(cluster4) or not ipaddress.IPv6Network(cidr6).subnet_of(cluster6):
            raise LabError(f"pod CIDRs of node {i} fall outside the cluster CIDRs")
        node = LabNode(
            index=i,
            name=f"node-{i}",
            ns=f"{prefix}n{i}",
            ip4=f"198.18.0.{10 + i}",
            ip6=f"fd00:198:18::{10 + i}" if ipv6 else "",
            pod_cidr4=cidr4,
            pod_cidr6=cidr6 if ipv6 else "",
            zone="zone-a" if i % 2 else "zone-b",
        )
        lab_nodes.append(node)
        for j in range(1, pods_per_node + 1):
            lab_pods.append(
                LabPod(
                    name=f"pod-{i}-{j}",
                    ns=f"{prefix}n{i}-p{j}",
                    node=node.name,
                    ip4=f"198.18.{64 + i}.{10 + j}",
                    ip6=f"fd00:198:18:{64 + i}::{10 + j}" if ipv6 else "",
                )
            )
    return Plan(
        prefix=prefix,
        ipv6=ipv6,
        fabric_ns=f"{prefix}fabric",
        bridge=f"{prefix}br0",
        external_ns=f"{prefix}ext",
        external_ip4="198.18.0.2",
        external_ip6="fd00:198:18::2" if ipv6 else "",
        nodes=tuple(lab_nodes),
        pods=tuple(lab_pods),
    )


def fabric_batch(plan: Plan) -> list[str]:
    br = plan.bridge
    lines = ["link set lo up", f"link add name {br} type bridge mcast_snooping 0", f"addr add 198.18.0.1/24 dev {br}"]
    if plan.ipv6:
        lines.append(f"addr add fd00:198:18::1/64 dev {br} nodad")
    lines.append(f"link set {br} up")
    for port, peer_ns in [(f"n{n.index}", n.ns) for n in plan.nodes] + [("ext", plan.external_ns)]:
        lines += [
            f"link add name {port} type veth peer name eth0 netns {peer_ns}",
            f"link set {port} master {br}",
            f"link set {port} up",
        ]
    return lines


def node_batch(plan: Plan, node: LabNode) -> list[str]:
    i = node.index
    lines = ["link set lo up", "link set eth0 up", f"addr add {node.ip4}/24 dev eth0"]
    lines += ["link add name cbr0 type bridge mcast_snooping 0", f"addr add 198.18.{64 + i}.1/24 dev cbr0"]
    if plan.ipv6:
        lines += [f"addr add {node.ip6}/64 dev eth0 nodad", f"addr add fd00:198:18:{64 + i}::1/64 dev cbr0 nodad"]
    lines.append("link set cbr0 up")
    for j, pod in enumerate(p for p in plan.pods if p.node == node.name):
        port = f"veth{j + 1}"
        lines += [
            f"link add name {port} type veth peer name eth0 netns {pod.ns}",
            f"link set {port} master cbr0",
            # as kubelet's hairpin-veth: without it a pod reaching itself through its service times out
            f"link set {port} type bridge_slave hairpin on",
            f"link set {port} up",
        ]
    for other in plan.nodes:
        if other is not node:
            lines.append(f"route add {other.pod_cidr4} via {other.ip4}")
            if plan.ipv6:
                lines.append(f"route add {other.pod_cidr6} via {other.ip6}")
    lines.append(f"route add default via {plan.external_ip4}")
    if plan.ipv6:
        lines.append(f"route add ::/0 via {plan.external_ip6}")
    return lines


def pod_batch(plan: Plan, node: LabNode, pod: LabPod) -> list[str]:
    lines = ["link set lo up", "link set eth0 up", f"addr add {pod.ip4}/24 dev eth0"]
    lines.append(f"route add default via 198.18.{64 + node.index}.1")
    if plan.ipv6:
        lines += [f"addr add {pod.ip6}/64 dev eth0 nodad", f"route add ::/0 via fd00:198:18:{64 + node.index}::1"]
    return lines


def external_batch(plan: Plan) -> list[str]:
    first = plan.nodes[0]
    lines = ["link set lo up", "link set eth0 up", f"addr add {plan.external_ip4}/24 dev eth0"]
    lines += [f"route add {r} via {first.ip4}" for r in SERVICE_ROUTES4]
    if plan.ipv6:
        lines.append(f"addr add {plan.external_ip6}/64 dev eth0 nodad")
        lines += [f"route add {r} via {first.ip6}" for r in SERVICE_ROUTES6]
    return lines


NO_DAD_SYSCTLS: dict[str, str | int] = {
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
}

NODE_SYSCTLS: dict[str, str | int] = {
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
    "net.ipv6.conf.all.accept_dad": 0,
    "net.ipv6.conf.default.accept_dad": 0,
    # replies between two pods on one bridge must pass conntrack to be un-DNATed
    "net.bridge.bridge-nf-call-iptables": 1,
    "net.bridge.bridge-nf-call-ip6tables": 1,
    # Service traffic from the external client enters and leaves node 1 on one link; ICMP redirects for it share
    # the per-host ICMP rate limit with the port-unreachables a proxy sends, which then get rate-limited away.
    "net.ipv4.conf.all.send_redirects": 0,
    "net.ipv4.conf.default.send_redirects": 0,
}
