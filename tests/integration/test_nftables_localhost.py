"""Localhost NodePorts in the nftables mode, with real sockets in a throwaway namespace (``kpm-nlh-…``): the node's
own process reaches ``127.0.0.1:NODEPORT`` over TCP and UDP through the mode's relay (upstream's KEP-6032 proxy), a
partial sync retargets and removes listeners, a service without endpoints has none (refused), and
``--iptables-localhost-nodeports=false`` or a ``--nodeport-addresses`` without loopback leave 127.0.0.1 closed."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nftkernel import available

from .scratch import scratch_netns

pytestmark = pytest.mark.root

CFG = ProxyConfig(cluster_cidrs=("198.18.64.0/18",), ip_families=(IPFamily.V4, IPFamily.V6))
NODE = NodeInfo("node-a", addresses=("198.18.0.1",))
EP = "198.18.9.1"  # an "endpoint": an address of the node's loopback device with servers on 8081 and 8082


@pytest.fixture
def netns() -> Iterator[str]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with scratch_netns("kpm-nlh-", lo_up=True) as ns:
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{EP}/32", "dev", "lo"], check=True, timeout=30)
        stop = threading.Event()
        threads = [_serve(ns, port, kind, stop) for port in (8081, 8082) for kind in ("tcp", "udp")]
        try:
            yield ns
        finally:
            stop.set()
            for t in threads:
                t.join(5)


def _serve(ns: str, port: int, kind: str, stop: threading.Event) -> threading.Thread:
    """A server on EP:port inside ``ns`` that answers ``ep<port>`` (TCP: to each connection; UDP: to each datagram)."""
    from pyroute2 import netns as pr_netns

    ready = threading.Event()
    answer = f"ep{port}".encode()

    def run() -> None:
        pr_netns.setns(ns, flags=0)
        with socket.socket(type=socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM) as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((EP, port))
            if kind == "tcp":
                srv.listen()
            srv.settimeout(0.2)
            ready.set()
            while not stop.is_set():
                try:
                    if kind == "tcp":
                        conn, _ = srv.accept()
                        with conn:
                            conn.sendall(answer)
                    else:
                        _, peer = srv.recvfrom(100)
                        srv.sendto(answer, peer)
                except TimeoutError:
                    continue

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(5)
    return t


def _ask(ns: str, port: int, kind: str = "tcp", count: int = 2) -> list[str]:
    """``count`` new connections (or UDP sockets) from a process of ``ns`` to 127.0.0.1:port: each answer, or the
    error's name."""
    send = "s.send(b'hi')" if kind == "udp" else "pass"
    code = (
        "import socket\n"
        f"for _ in range({count}):\n"
        f"  s=socket.socket(type=socket.{'SOCK_STREAM' if kind == 'tcp' else 'SOCK_DGRAM'}); s.settimeout(2)\n"
        "  try:\n"
        f"    s.connect(('127.0.0.1',{port}))\n"
        f"    {send}\n"
        "    print(s.recv(10).decode())\n"
        "  except OSError as e: print(type(e).__name__)\n"
        "  s.close()\n"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def spn(name: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, "p", proto)


def sp(name: str, node_port: int, ports: tuple[int, ...], proto: Protocol = Protocol.TCP) -> ServicePort:
    endpoints = tuple(Endpoint(EP, p, node_name="node-b") for p in ports)
    return ServicePort(
        name=spn(name, proto),
        family=IPFamily.V4,
        cluster_ip=f"198.19.0.{node_port % 200}",
        port=80,
        node_port=node_port,
        cluster_endpoints=endpoints,
        has_any_endpoints=bool(endpoints),
        serving_endpoints=endpoints,
    )


def state(*sps: ServicePort, gen: int = 1) -> ProxyState:
    return ProxyState(
        services=MappingProxyType({IPFamily.V4: MappingProxyType({s.name: s for s in sps})}), node=NODE, generation=gen
    )


def test_tcp_and_udp_on_127_0_0_1_through_full_and_partial_syncs(netns: str) -> None:
    web, dns, empty = sp("web", 30081, (8081, 8082)), sp("dns", 30082, (8081, 8082), Protocol.UDP), sp("e", 30083, ())
    p = NftablesProxier(CFG, netns=netns)
    try:
        assert p.sync(state(web, dns, empty), Changes(full=True)).ok
        assert sorted(_ask(netns, 30081)) == ["ep8081", "ep8082"]  # round robin over the two endpoints
        assert sorted(_ask(netns, 30082, "udp")) == ["ep8081", "ep8082"]
        assert _ask(netns, 30083, count=1) == ["ConnectionRefusedError"]  # no endpoints: no listener, refused
        relay = p.detail_global()["localhostNodePorts"]
        assert relay["listeners"] == 2 and relay["running"], relay
        # a partial sync: one endpoint left for web, dns removed
        web2 = sp("web", 30081, (8082,))
        changes = Changes(full=False, services=frozenset({web.name, dns.name}))
        assert p.sync(state(web2, empty, gen=2), changes).ok
        assert _ask(netns, 30081) == ["ep8082", "ep8082"]
        assert _ask(netns, 30082, "udp", count=1) == ["ConnectionRefusedError"]  # ICMP port unreachable
        assert p.detail_global()["localhostNodePorts"]["listeners"] == 1
    finally:
        p.close()
        NftablesProxier.cleanup_leftovers(CFG, netns=netns)
    assert _ask(netns, 30081, count=1) == ["ConnectionRefusedError"]  # the relay's sockets went with it


@pytest.mark.parametrize(
    "cfg",
    [CFG.with_(localhost_nodeports=False), CFG.with_(nodeport_addresses=("198.18.0.0/24",))],
    ids=["flag-false", "nodeport-addresses-without-loopback"],
)
def test_turned_off(netns: str, cfg: ProxyConfig) -> None:
    p = NftablesProxier(cfg, netns=netns)
    try:
        assert p.sync(state(sp("web", 30081, (8081,))), Changes(full=True)).ok
        assert _ask(netns, 30081, count=1) == ["ConnectionRefusedError"]
        assert p.detail_global()["localhostNodePorts"]["listeners"] == 0
    finally:
        p.close()
        NftablesProxier.cleanup_leftovers(cfg, netns=netns)
