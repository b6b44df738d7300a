"""The UDP conntrack reconciler against real conntrack entries made by real packets.

Two namespaces joined by a veth pair: a client (``kpc-<pid>-c``) and a node (``kpc-<pid>-n``) that owns a
service address on ``lo`` and DNATs it with a hand-written iptables rule to UDP echo listeners ("pods") that
answer with their own address. The client sends from one fixed source port, the "backend" changes under it, and
the test shows the stale entry keeping the client on the old path until ``ConntrackReconciler.reconcile`` (with
a hand-built ``ProxyState``) removes exactly that entry; then the client's next datagram from the same port
reaches the new backend. Unrelated entries (a UDP flow to a non-service address, a TCP entry to the service
address) stay.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kproxy.conntrack import ConntrackReconciler, reconcile_needed
from kproxy.model import (
    Changes,
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

PREFIX = "kpc-"
ECHO = r"""
import socket, sys, time
addr, port, life = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, port))
s.settimeout(0.5)
end = time.monotonic() + life
while time.monotonic() < end:
    try:
        data, peer = s.recvfrom(2048)
    except socket.timeout:
        continue
    s.sendto(addr.encode(), peer)
"""
CLIENT = r"""
import socket, sys
src, sport, dst, dport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.socket(socket.AF_INET6 if ":" in dst else socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((src, sport))
s.connect((dst, dport))
s.settimeout(1.0)
s.send(b"ping")
try:
    print(s.recv(2048).decode())
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")
"""


@dataclass(frozen=True)
class Addrs:
    family: IPFamily
    client: str
    node: str
    vip: str
    old: str
    new: str
    other: str  # a non-service address with a listener: traffic to it is unrelated to any service
    plen: int


V4 = Addrs(IPFamily.V4, "198.18.250.1", "198.18.250.2", "198.18.252.10", "198.18.251.2", "198.18.251.3",
           "198.18.251.4", 24)  # fmt: skip
V6 = Addrs(IPFamily.V6, "fd00:198:18:250::1", "fd00:198:18:250::2", "fd00:198:18:252::10", "fd00:198:18:251::2",
           "fd00:198:18:251::3", "fd00:198:18:251::4", 64)  # fmt: skip
SVC_PORT, POD_PORT, NODE_PORT, OTHER_PORT = 53, 5353, 30053, 6000


def run(*argv: str, check: bool = True) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise AssertionError(f"{argv}: rc={out.returncode} {out.stderr.strip()}")
    return out.stdout


def _remove_stale() -> None:
    """Remove kpc- namespaces left by a killed run of this module (their pid no longer exists)."""
    for name in run("ip", "netns", "list").split():
        m = re.fullmatch(r"kpc-(\d+)-[cn]", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            run("ip", "netns", "del", name, check=False)


@dataclass
class Topo:
    client_ns: str
    node_ns: str
    procs: list[subprocess.Popen[bytes]]

    def node(self, *argv: str, check: bool = True) -> str:
        return run("ip", "netns", "exec", self.node_ns, *argv, check=check)

    def ipt(self, fam: IPFamily, *args: str) -> None:
        self.node("ip6tables" if fam is IPFamily.V6 else "iptables", *args)

    def echo(self, addr: str, port: int) -> None:
        argv = ["ip", "netns", "exec", self.node_ns, sys.executable, "-c", ECHO, addr, str(port), "60"]
        self.procs.append(subprocess.Popen(argv))

    def send(self, src: str, sport: int, dst: str, dport: int) -> str:
        return run("ip", "netns", "exec", self.client_ns, sys.executable, "-c", CLIENT, src, str(sport), dst,
                   str(dport)).strip()  # fmt: skip

    def conntrack(self, fam: IPFamily, proto: str = "udp") -> str:
        return self.node("conntrack", "-L", "-f", "ipv6" if fam is IPFamily.V6 else "ipv4", "-p", proto, check=False)


@pytest.fixture
def topo() -> Iterator[Topo]:
    _remove_stale()
    pid = os.getpid()
    c, n = f"{PREFIX}{pid}-c", f"{PREFIX}{pid}-n"
    t = Topo(c, n, [])
    run("ip", "netns", "add", c)
    run("ip", "netns", "add", n)
    try:
        va, vb = f"kpc{pid}a"[:15], f"kpc{pid}b"[:15]
        run("ip", "link", "add", va, "netns", c, "type", "veth", "peer", "name", vb, "netns", n)
        for ns, dev in ((c, va), (n, vb)):
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "link", "set", dev, "up")
        for a in (V4, V6):
            run("ip", "-n", c, "addr", "add", f"{a.client}/{a.plen}", "dev", va, "nodad")
            run("ip", "-n", n, "addr", "add", f"{a.node}/{a.plen}", "dev", vb, "nodad")
            run("ip", "-n", c, "route", "add", "default" if a is V4 else "::/0", "via", a.node)
            full = "32" if a is V4 else "128"
            for ip in (a.vip, a.old, a.new, a.other):
                run("ip", "-n", n, "addr", "add", f"{ip}/{full}", "dev", "lo")
            for ip in (a.old, a.new):
                t.echo(ip, POD_PORT)
            t.echo(a.other, OTHER_PORT)
        time.sleep(0.5)  # listeners bind (bounded: the echo processes end by themselves after 60 s)
        yield t
    finally:
        for p in t.procs:
            p.kill()
            p.wait(timeout=10)
        run("ip", "netns", "del", c, check=False)
        run("ip", "netns", "del", n, check=False)


def _state(a: Addrs, endpoints: tuple[str, ...], node_port: int = 0) -> ProxyState:
    spn = ServicePortName("ns1", "dns", "dns", Protocol.UDP)
    eps = tuple(Endpoint(ip, POD_PORT, node_name="node-1", is_local=True) for ip in endpoints)
    sp = ServicePort(
        name=spn,
        family=a.family,
        cluster_ip=a.vip,
        port=SVC_PORT,
        node_port=node_port,
        cluster_endpoints=eps,
        local_endpoints=eps,
        has_any_endpoints=bool(eps),
        serving_endpoints=eps,
    )
    return ProxyState(services={a.family: {spn: sp}}, node=NodeInfo("node-1"))


def _dnat(a: Addrs, dst: str, dport: int, to: str) -> list[str]:
    target = f"[{to}]:{POD_PORT}" if a.family is IPFamily.V6 else f"{to}:{POD_PORT}"
    return ["-d", dst, "-p", "udp", "--dport", str(dport), "-j", "DNAT", "--to-destination", target]


@pytest.mark.parametrize("a", [V4, V6], ids=["ipv4", "ipv6"])
def test_replaced_backend(topo: Topo, a: Addrs) -> None:
    fam = a.family
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.vip, SVC_PORT, a.old))
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.node, NODE_PORT, a.old))
    assert topo.send(a.client, 40000, a.vip, SVC_PORT) == a.old
    assert topo.send(a.client, 40001, a.node, NODE_PORT) == a.old
    assert topo.send(a.client, 40002, a.other, OTHER_PORT) == a.other  # unrelated to any service
    # A TCP entry to the service address, DNATed to the old backend: not UDP, so never touched.
    topo.node("conntrack", "-I", "-p", "tcp", "-s", a.client, "-d", a.vip, "--sport", "40003",
              "--dport", str(SVC_PORT), "-r", a.old, "-q", a.client, "--reply-port-src", str(POD_PORT),
              "--reply-port-dst", "40003", "--state", "ESTABLISHED", "-t", "120")  # fmt: skip

    # The "backend" moves the service to the new pod; the client on its fixed port is still stuck on the old one.
    topo.ipt(fam, "-t", "nat", "-R", "PREROUTING", "1", *_dnat(a, a.vip, SVC_PORT, a.new))
    topo.ipt(fam, "-t", "nat", "-R", "PREROUTING", "2", *_dnat(a, a.node, NODE_PORT, a.new))
    assert topo.send(a.client, 40000, a.vip, SVC_PORT) == a.old
    assert topo.send(a.client, 40001, a.node, NODE_PORT) == a.old

    state = _state(a, (a.new,), node_port=NODE_PORT)
    assert reconcile_needed(Changes(full=False, services=frozenset(sp.name for sp in state)), state)
    rec = ConntrackReconciler(netns=topo.node_ns)
    # No node IPs given: the node port is found on the namespace's own addresses (nodePortAddresses empty).
    deleted = rec.reconcile(state, node_ips=[])
    assert deleted[fam] == 2
    assert rec.last_duration > 0
    listing = topo.conntrack(fam)
    assert f"src={a.old} " not in listing
    assert f"dst={a.other} " in listing  # the unrelated UDP flow stays
    assert f"src={a.old} " in topo.conntrack(fam, "tcp")  # and so does the TCP entry
    # Converged: a second pass finds nothing more to delete.
    assert rec.reconcile(state, node_ips=[V4.node, V6.node])[fam] == 0

    assert topo.send(a.client, 40000, a.vip, SVC_PORT) == a.new
    assert topo.send(a.client, 40001, a.node, NODE_PORT) == a.new


def test_zero_endpoints_then_endpoints_again(topo: Topo) -> None:
    a, fam = V4, IPFamily.V4
    rec = ConntrackReconciler(netns=topo.node_ns)
    nodes = [a.node]
    # Another service's rule keeps the nat chain non-empty, as on any real node. (Observed here: deleting the
    # last rule of the chain also ended the old entry's DNAT, which would hide exactly the bug under test.)
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.other, 7000, a.other))
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.vip, SVC_PORT, a.old))
    assert topo.send(a.client, 41000, a.vip, SVC_PORT) == a.old

    # The service loses its only endpoint (kubernetes#139628): no DNAT rule any more, the service address itself
    # has no listener, so new flows are refused; but the DNATed entry keeps the client on the dead pod.
    topo.ipt(fam, "-t", "nat", "-D", "PREROUTING", "2")
    assert topo.send(a.client, 41000, a.vip, SVC_PORT) == a.old
    assert rec.reconcile(_state(a, ()), nodes)[fam] == 1
    assert topo.send(a.client, 41000, a.vip, SVC_PORT) == "refused"
    # That refusal is cached as an entry that was never DNATed; with no endpoints it is correct and stays.
    assert f"src={a.vip} dst={a.client} sport={SVC_PORT} dport=41000" in topo.conntrack(fam)
    assert rec.reconcile(_state(a, ()), nodes)[fam] == 0

    # Endpoints come back: the cached "no endpoints" entry would keep refusing the client until deleted.
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.vip, SVC_PORT, a.new))
    assert topo.send(a.client, 41000, a.vip, SVC_PORT) == "refused"
    assert rec.reconcile(_state(a, (a.new,)), nodes)[fam] == 1
    assert topo.send(a.client, 41000, a.vip, SVC_PORT) == a.new


def test_a_deleted_service_takes_its_rewritten_flows_with_it(topo: Topo) -> None:
    """Upstream's kubernetes#141371: once a UDP Service is deleted the state has no target for its address, and a
    reconciler that only looks at today's services leaves the flow rewritten to its old endpoint: a client on a
    fixed source port keeps reaching that pod. The reconciler remembers the addresses it knew."""
    a, fam = V4, IPFamily.V4
    rec = ConntrackReconciler(netns=topo.node_ns)
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.other, 7000, a.other))  # a chain never empty
    topo.ipt(fam, "-t", "nat", "-A", "PREROUTING", *_dnat(a, a.vip, SVC_PORT, a.old))
    assert topo.send(a.client, 42000, a.vip, SVC_PORT) == a.old
    assert rec.reconcile(_state(a, (a.old,)), node_ips=[a.node])[fam] == 0  # live: kept
    topo.ipt(fam, "-t", "nat", "-D", "PREROUTING", *_dnat(a, a.vip, SVC_PORT, a.old))  # the Service is deleted
    empty = ProxyState(services={fam: {}}, node=NodeInfo("node-1"))
    assert topo.send(a.client, 42000, a.vip, SVC_PORT) == a.old  # the entry still rewrites it
    assert rec.reconcile(empty, node_ips=[a.node])[fam] == 1
    assert f"src={a.old} " not in topo.conntrack(fam)
    assert rec.reconcile(empty, node_ips=[a.node])[fam] == 0  # forgotten once done
