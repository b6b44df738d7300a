"""The iptables mode's traffic counters (``--service-counters``) against real rules and real connections.

Each test makes a node namespace ``kpx-cnt-...`` (kproxy's rules and the client) and an endpoints' namespace
``kpx-end-...`` (two echo servers, ``kproxy.lab.echo``: each answer names the server), deleted in the fixture's
finalizer also on failure: connections from the node to a ClusterIP go through the nat table's OUTPUT chain and
kproxy's rules to the endpoint the rules picked. Both flavours (nf_tables and legacy). Needs root.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.counters import Measure
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, iptables)"),
    pytest.mark.skipif(shutil.which("iptables-nft-restore") is None, reason="iptables not installed"),
]

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
CLIENT = "198.18.1.254"  # the node's address, inside the cluster CIDR: kproxy's rules do not masquerade it
EP_IP = "198.18.1.1"
ENDPOINTS = {"ep1": Endpoint(EP_IP, 8081), "ep2": Endpoint(EP_IP, 8082)}
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
U = ServicePortName("ns1", "u", "dns", Protocol.UDP)
OTHER = ServicePortName("ns1", "other", "http", Protocol.TCP)


def sp(name: ServicePortName, cip: str, port: int, eps: tuple[Endpoint, ...]) -> ServicePort:
    return ServicePort(name, IPFamily.V4, cip, port, cluster_endpoints=eps, has_any_endpoints=bool(eps))


SP_A = sp(A, "198.19.0.1", 80, tuple(ENDPOINTS.values()))
SP_U = sp(U, "198.19.0.2", 53, tuple(ENDPOINTS.values()))
SP_OTHER = sp(OTHER, "198.19.0.3", 80, (Endpoint("198.18.1.1", 8081),))


def state(*sps: ServicePort, gen: int = 1) -> ProxyState:
    v4 = MappingProxyType({s.name: s for s in sps})
    return ProxyState(MappingProxyType({IPFamily.V4: v4, IPFamily.V6: MappingProxyType({})}), NODE, gen)


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, timeout=30, capture_output=True)


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[str]:
    """The node's namespace (kproxy's rules, the client) and the endpoints' (one address, so UDP answers come from
    the address the flow was sent to; an echo server per endpoint port), joined by a veth pair; ready."""
    with scratch_netns("kpx-cnt-", lo_up=True) as ns, scratch_netns("kpx-end-", lo_up=True) as ends:
        ip(ns, "link", "add", "kpx0", "type", "veth", "peer", "name", "eth0", "netns", ends)
        ip(ns, "addr", "add", f"{CLIENT}/24", "dev", "kpx0")
        ip(ns, "link", "set", "kpx0", "up")
        ip(ns, "route", "add", "198.19.0.0/16", "dev", "kpx0")  # the ClusterIPs: routable before the DNAT
        ip(ends, "addr", "add", f"{EP_IP}/24", "dev", "eth0")
        ip(ends, "link", "set", "eth0", "up")
        procs = []
        try:
            for name, e in ENDPOINTS.items():
                argv = [sys.executable, "-m", "kproxy.lab.echo", "--name", name, "--ports", str(e.port)]
                argv += ["--no-ipv6", "--ready-file", str(tmp_path / name)]
                procs.append(subprocess.Popen(["ip", "netns", "exec", ends, *argv]))
            deadline = time.monotonic() + 20
            while not all((tmp_path / n).exists() for n in ENDPOINTS) and time.monotonic() < deadline:
                assert all(p.poll() is None for p in procs), "an echo server exited"
                time.sleep(0.05)
            assert all((tmp_path / n).exists() for n in ENDPOINTS), "echo servers not ready"
            yield ns
        finally:
            for p in procs:
                p.kill()
                p.wait(10)


def proxier(netns: str, flavour: str, counters: bool = True) -> IptablesProxier:
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16",),
        ip_families=(IPFamily.V4,),
        backend_options={"iptables_flavour": flavour},
        service_counters=counters,
    )
    return IptablesProxier(config, netns=netns)


def answers(ns: str, proto: str, host: str, port: int, count: int) -> collections.Counter[str]:
    """``count`` new TCP connections (or UDP flows: a socket each, so a source port each) from the namespace; how
    many each echo server answered."""
    code = f"""
import socket
kind = socket.SOCK_STREAM if {proto!r} == "tcp" else socket.SOCK_DGRAM
for _ in range({count}):
    with socket.socket(socket.AF_INET, kind) as s:
        s.settimeout(5)
        s.connect(({host!r}, {port}))
        s.sendall(b"hi\\n")
        print(s.recv(1000).split()[0].decode())
"""
    res = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return collections.Counter(res.stdout.split())


def per_endpoint(p: IptablesProxier, name: ServicePortName) -> dict[str, int]:
    dump = p.counters(IPFamily.V4)
    assert dump is not None
    pc = dump.ports[name]
    counts = {ep: c.connections for ep, c in pc.per_endpoint().items()}
    assert pc.total.connections == sum(counts.values())
    assert pc.total.packets is None and pc.total.bytes is None and pc.packets is None and pc.bytes is None
    return counts


def expected(seen: collections.Counter[str]) -> dict[str, int]:
    return {str(e): seen[name] for name, e in ENDPOINTS.items()}


def test_connections_and_flows_counted_per_endpoint_as_they_went(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour)
    assert p.counters_offered == frozenset({Measure.CONNECTIONS})
    assert p.sync(state(SP_A, SP_U), Changes(full=True)).ok
    assert per_endpoint(p, A) == {str(e): 0 for e in ENDPOINTS.values()}

    tcp = answers(netns, "tcp", SP_A.cluster_ip, 80, 24)
    udp = answers(netns, "udp", SP_U.cluster_ip, 53, 6)
    assert sum(tcp.values()) == 24 and sum(udp.values()) == 6
    assert len(tcp) == 2, f"24 connections all went to one endpoint: {tcp}"  # 2^-23 by chance
    dump = p.counters(IPFamily.V4)
    assert dump is not None and dump.family is IPFamily.V4 and set(dump.ports) == {A, U}
    assert dump.ports[A].total.connections == 24 and dump.ports[U].total.connections == 6
    assert per_endpoint(p, A) == expected(tcp)
    assert per_endpoint(p, U) == expected(udp)


def test_counters_survive_other_services_changes_and_a_restart(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_U), Changes(full=True)).ok
    tcp = answers(netns, "tcp", SP_A.cluster_ip, 80, 10)
    udp = answers(netns, "udp", SP_U.cluster_ip, 53, 4)

    # another service added: a partial sync that rewrites KUBE-SERVICES, not A's or U's own chains
    assert p.sync(state(SP_A, SP_U, SP_OTHER, gen=2), Changes(False, frozenset({OTHER}))).ok
    assert per_endpoint(p, A) == expected(tcp) and per_endpoint(p, U) == expected(udp)
    assert per_endpoint(p, OTHER) == {"198.18.1.1:8081": 0}

    # a restart: a new proxier's first (full) sync adopts the unchanged chains and writes nothing of them
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_U, SP_OTHER, gen=3), Changes(full=True)).ok
    assert per_endpoint(p, A) == expected(tcp) and per_endpoint(p, U) == expected(udp)
    more = answers(netns, "tcp", SP_A.cluster_ip, 80, 6)
    assert per_endpoint(p, A) == expected(tcp + more)

    # A's endpoints change: its chains are written again and its counters start over; U is removed: gone
    sp_a1 = sp(A, SP_A.cluster_ip, 80, (ENDPOINTS["ep2"],))
    assert p.sync(state(sp_a1, SP_OTHER, gen=4), Changes(False, frozenset({A, U}))).ok
    assert per_endpoint(p, A) == {"198.18.1.1:8082": 0}
    dump = p.counters(IPFamily.V4)
    assert dump is not None and U not in dump.ports
    assert answers(netns, "tcp", SP_A.cluster_ip, 80, 3) == {"ep2": 3}
    assert per_endpoint(p, A) == {"198.18.1.1:8082": 3}


def test_counters_off_reads_nothing(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour, counters=False)
    assert p.sync(state(SP_A), Changes(full=True)).ok
    assert p.counters(IPFamily.V4) is None


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KPROXY_COUNTERS_SCALE"), reason="set KPROXY_COUNTERS_SCALE=1 (minutes)")
def test_one_dump_at_ten_thousand_services(netns: str, flavour: str) -> None:
    """The scrape budget: one ``counters()`` at 10,000 services x 10 endpoints, timed (printed: run with -s)."""
    p = proxier(netns, flavour)
    sps = []
    for i in range(10_000):
        name = ServicePortName("scale", f"s{i}", "http", Protocol.TCP)
        eps = tuple(
            Endpoint(f"10.{(i * 10 + j) >> 16}.{(i * 10 + j) >> 8 & 255}.{(i * 10 + j) & 255}", 80) for j in range(10)
        )
        sps.append(sp(name, f"172.16.{i >> 8}.{i & 255}", 80, eps))
    assert p.sync(state(*sps), Changes(full=True)).ok
    t0 = time.perf_counter()
    dump = p.counters(IPFamily.V4)
    seconds = time.perf_counter() - t0
    assert dump is not None and len(dump.ports) == 10_000
    assert all(len(pc.endpoints) == 10 and pc.total.connections == 0 for pc in dump.ports.values())
    print(f"{flavour}: counters() at 10,000 x 10: {seconds:.2f} s")
