"""Localhost NodePorts in the iptables mode against the real kernel, as upstream serves them: the node's own process
reaches ``127.0.0.1:NODEPORT`` through the DNAT (``route_localnet=1`` set by kproxy, upstream's ``KUBE-FIREWALL``
mitigation rule in place), masqueraded to the node's address; ``--iptables-localhost-nodeports=false`` and a
``--nodeport-addresses`` without loopback leave 127.0.0.1 closed and the sysctl alone. Namespaces of its own
(``kpt-ilh-``), both flavours. Needs root."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, iptables)"),
    pytest.mark.skipif(shutil.which("iptables-nft-restore") is None, reason="iptables not installed"),
]

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
SVC = ServicePort(
    ServicePortName("ns1", "np", "http", Protocol.TCP),
    IPFamily.V4,
    "198.19.0.1",
    80,
    node_port=30080,
    cluster_endpoints=(Endpoint("198.18.251.2", 8080),),
    has_any_endpoints=True,
)
DROP = (
    '-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" '
    "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"  # as iptables-save spells it
)
SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.251.2", 8080))
s.listen(8)
print("ready", flush=True)
while True:
    c, addr = s.accept()
    c.sendall(("hello from " + addr[0]).encode())
    c.close()
"""
CLIENT = """
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3)
    print(s.recv(100).decode())
except OSError as e:
    print(type(e).__name__)
"""


def ns_run(netns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def lab() -> Iterator[str]:
    """The node's namespace, with a pod namespace behind a veth whose server answers on 198.18.251.2:8080."""
    with scratch_netns("kpt-ilh-") as node, scratch_netns("kpt-ilh-") as pod:
        subprocess.run(
            ["ip", "link", "add", "kv0", "netns", node, "type", "veth", "peer", "name", "kv1", "netns", pod], check=True
        )
        for ns, dev, addr in ((node, "kv0", "198.18.251.1/24"), (pod, "kv1", "198.18.251.2/24")):
            ns_run(ns, "ip", "link", "set", "lo", "up")
            ns_run(ns, "ip", "addr", "add", addr, "dev", dev)
            ns_run(ns, "ip", "link", "set", dev, "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", pod, "/usr/bin/python3", "-c", SERVER], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            yield node
        finally:
            server.kill()
            server.wait(timeout=10)
            if server.stdout is not None:
                server.stdout.close()


def route_localnet(netns: str) -> str:
    return ns_run(netns, "cat", "/proc/sys/net/ipv4/conf/all/route_localnet").strip()


def run(netns: str, flavour: str, **cfg: object) -> IptablesProxier:
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16",),
        ip_families=(IPFamily.V4,),
        backend_options={"iptables_flavour": flavour},
        **cfg,  # type: ignore[arg-type]
    )
    p = IptablesProxier(config, netns=netns)
    assert p.sync(ProxyState({IPFamily.V4: {SVC.name: SVC}}, NODE), Changes(full=True)).ok  # type: ignore[arg-type]
    return p


def test_served_as_upstream(lab: str, flavour: str) -> None:
    assert route_localnet(lab) == "0"  # a fresh namespace
    run(lab, flavour)
    assert route_localnet(lab) == "1"
    saved = ns_run(lab, f"iptables-{flavour}-save")
    assert DROP in saved and "-A INPUT -j KUBE-FIREWALL" in saved and "-A OUTPUT -j KUBE-FIREWALL" in saved
    # the node's own client, masqueraded to the node's address on the way out (the EXT chain's masquerade)
    assert ns_run(lab, "/usr/bin/python3", "-c", CLIENT, "30080").strip() == "hello from 198.18.251.1"
    # someone resets the sysctl: the next full sync sets it again
    ns_run(lab, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0")
    run(lab, flavour)
    assert route_localnet(lab) == "1"
    assert ns_run(lab, "/usr/bin/python3", "-c", CLIENT, "30080").strip() == "hello from 198.18.251.1"


@pytest.mark.parametrize(
    "cfg",
    [{"localhost_nodeports": False}, {"nodeport_addresses": ("198.18.251.0/24",)}],
    ids=["flag-false", "nodeport-addresses-without-loopback"],
)
def test_turned_off(lab: str, flavour: str, cfg: dict[str, object]) -> None:
    run(lab, flavour, **cfg)
    assert route_localnet(lab) == "0"  # left alone
    assert "KUBE-FIREWALL" not in ns_run(lab, f"iptables-{flavour}-save")
    assert ns_run(lab, "/usr/bin/python3", "-c", CLIENT, "30080").strip() == "ConnectionRefusedError"
    assert ns_run(lab, "/usr/bin/python3", "-c", CLIENT.replace("127.0.0.1", "198.18.251.1"), "30080").strip() == (
        "hello from 198.18.251.1"
    )
