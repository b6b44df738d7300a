"""The nftables mode's traffic counters (``--service-counters``) against a real table and real connections.

Each test makes a node namespace ``kpx-nct-...`` (kproxy's table and the client) and an endpoints' namespace
``kpx-nce-...`` (three echo servers on one address, ``kproxy.lab.echo``: each answer names the server), deleted in
the fixture's finalizer also on failure: connections from the node to a ClusterIP go through kproxy's nat-output
chain, its DNAT and the counting chain at postrouting to the endpoint the DNAT picked. Needs root.

With ``KPROXY_CAPTURE_NFT_COUNTERS=<dir>`` the first test writes the kernel's answer to the counting sets' netlink
element dumps after its connections (base64, as read), with what the servers saw, to ``<dir>/counters_dump.json``
(the dump parser's unit test reads it from ``tests/unit/golden/nftables/``).
"""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.backends.nftables import counters, layout
from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.config import ProxyConfig
from kproxy.counters import Measure
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nftkernel import available

from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, nftables)"),
    pytest.mark.skipif(available() is not None, reason=f"libnftables: {available()}"),
]

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
CLIENT = "198.18.1.254"  # the node's address, inside the cluster CIDR: kproxy's rules do not masquerade it
EP_IP = "198.18.1.1"
ENDPOINTS = {"ep1": Endpoint(EP_IP, 8081), "ep2": Endpoint(EP_IP, 8082), "ep3": Endpoint(EP_IP, 8083)}
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
U = ServicePortName("ns1", "u", "dns", Protocol.UDP)
OTHER = ServicePortName("ns1", "other", "http", Protocol.TCP)


def sp(name: ServicePortName, cip: str, port: int, eps: tuple[Endpoint, ...]) -> ServicePort:
    return ServicePort(name, IPFamily.V4, cip, port, cluster_endpoints=eps, has_any_endpoints=bool(eps))


SP_A = sp(A, "198.19.0.1", 80, tuple(ENDPOINTS.values()))
SP_U = sp(U, "198.19.0.2", 53, tuple(ENDPOINTS.values()))
SP_OTHER = sp(OTHER, "198.19.0.3", 80, (ENDPOINTS["ep1"],))


def state(*sps: ServicePort, gen: int = 1) -> ProxyState:
    v4 = MappingProxyType({s.name: s for s in sps})
    return ProxyState(MappingProxyType({IPFamily.V4: v4, IPFamily.V6: MappingProxyType({})}), NODE, gen)


def ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, timeout=30, capture_output=True)


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[str]:
    """The node's namespace (kproxy's table, the client) and the endpoints' (one address, so UDP answers come from
    the address the flow was sent to; an echo server per endpoint port), joined by a veth pair; ready."""
    with scratch_netns("kpx-nct-", lo_up=True) as ns, scratch_netns("kpx-nce-", lo_up=True) as ends:
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


@pytest.fixture
def make(netns: str) -> Iterator[Callable[..., NftablesProxier]]:
    """Proxiers in the node namespace (a new one is a restarted kproxy), closed at the end."""
    made: list[NftablesProxier] = []

    def new(counters: bool = True) -> NftablesProxier:
        config = ProxyConfig(cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,), service_counters=counters)
        p = NftablesProxier(config, netns=netns)
        p.start()
        made.append(p)
        return p

    yield new
    for p in made:
        p.close()


def answers(ns: str, proto: str, host: str, port: int, count: int) -> collections.Counter[str]:
    """``count`` new TCP connections (or UDP flows: a socket each, so a source port each) from the namespace; how
    many each echo server answered."""
    code = f"""
import socket
kind = socket.SOCK_STREAM if {proto!r} == "tcp" else socket.SOCK_DGRAM
for _ in range({count}):
    with socket.socket(socket.AF_INET6 if ":" in {host!r} else socket.AF_INET, kind) as s:
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


def per_endpoint(p: NftablesProxier, name: ServicePortName) -> dict[str, int]:
    dump = p.counters(IPFamily.V4)
    assert dump is not None
    pc = dump.ports[name]
    counts = {ep: c.connections for ep, c in pc.per_endpoint().items()}
    assert pc.total.connections == sum(counts.values())
    assert pc.total.packets is None and pc.total.bytes is None and pc.packets is None and pc.bytes is None
    return counts


def expected(seen: collections.Counter[str], names: tuple[str, ...] = tuple(ENDPOINTS)) -> dict[str, int]:
    return {str(ENDPOINTS[n]): seen[n] for n in names}


def kernel_counters(p: NftablesProxier) -> set[tuple[str, str]]:
    """The counting elements the kernel holds."""
    held, err = counters.read_counts(p.nft, IPFamily.V4)
    assert held is not None, err
    return set(held)


def capture(p: NftablesProxier, seen: dict[ServicePort, collections.Counter[str]]) -> None:
    """The kernel's listing, with what the servers saw, for the dump parser's unit test."""
    out = os.environ.get("KPROXY_CAPTURE_NFT_COUNTERS")
    if not out:
        return
    doc: dict[str, object] = {
        "netlink_dump_base64": {
            name: [base64.b64encode(c).decode() for c in p.nft.call(lambda n=name: counters.raw_dump(IPFamily.V4, n))]
            for name in counters.COUNTING
        }
    }
    doc["kproxy_test"] = {
        "endpoints": [{"ip": e.ip, "port": e.port} for e in ENDPOINTS.values()],
        "services": [
            {
                "name": s.name.name,
                "port_name": s.name.port,
                "protocol": s.name.protocol.value,
                "cluster_ip": s.cluster_ip,
                "port": s.port,
                "seen": expected(counts),
            }
            for s, counts in seen.items()
        ],
    }
    Path(out, "counters_dump.json").write_text(json.dumps(doc, indent=1) + "\n")


def test_connections_and_flows_counted_per_endpoint_as_they_went(
    netns: str, make: Callable[..., NftablesProxier]
) -> None:
    p = make()
    assert p.counters_offered == frozenset({Measure.CONNECTIONS})
    assert p.sync(state(SP_A, SP_U), Changes(full=True)).ok
    assert per_endpoint(p, A) == {str(e): 0 for e in ENDPOINTS.values()}
    report = p.verify(state(SP_A, SP_U))  # the counter maps' elements read back as written
    assert report["drift"] == 0, report

    tcp = answers(netns, "tcp", SP_A.cluster_ip, 80, 30)
    udp = answers(netns, "udp", SP_U.cluster_ip, 53, 9)
    assert sum(tcp.values()) == 30 and sum(udp.values()) == 9
    assert len(tcp) >= 2, f"30 connections all went to one endpoint: {tcp}"  # 3^-29 by chance
    dump = p.counters(IPFamily.V4)
    assert dump is not None and dump.family is IPFamily.V4 and set(dump.ports) == {A, U}
    assert dump.ports[A].total.connections == 30 and dump.ports[U].total.connections == 9
    assert per_endpoint(p, A) == expected(tcp)
    assert per_endpoint(p, U) == expected(udp)
    capture(p, {SP_A: tcp, SP_U: udp})
    # the same connection's later packets are not counted again: one connection, many lines
    code = f"""
import socket
with socket.create_connection(({SP_A.cluster_ip!r}, 80), timeout=5) as s:
    for _ in range(20):
        s.sendall(b"hi\\n")
        assert s.recv(1000)
"""
    subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code], check=True, timeout=60)
    assert sum(per_endpoint(p, A).values()) == 31


def test_counters_survive_partial_syncs_and_a_restart_and_go_with_their_service(
    netns: str, make: Callable[..., NftablesProxier]
) -> None:
    p = make()
    assert p.sync(state(SP_A, SP_U), Changes(full=True)).ok
    tcp = answers(netns, "tcp", SP_A.cluster_ip, 80, 18)
    udp = answers(netns, "udp", SP_U.cluster_ip, 53, 6)

    # another service added: a partial sync that touches nothing of A's or U's
    assert p.sync(state(SP_A, SP_U, SP_OTHER, gen=2), Changes(False, frozenset({OTHER}))).ok
    assert per_endpoint(p, A) == expected(tcp) and per_endpoint(p, U) == expected(udp)
    assert per_endpoint(p, OTHER) == {str(ENDPOINTS["ep1"]): 0}

    # a restart with nothing changed: the new proxier's full sync adopts the table and writes nothing
    p = make()
    assert p.sync(state(SP_A, SP_U, SP_OTHER, gen=3), Changes(full=True)).ok
    assert p.last_transaction(IPFamily.V4) == ""
    assert per_endpoint(p, A) == expected(tcp) and per_endpoint(p, U) == expected(udp)
    more = answers(netns, "tcp", SP_A.cluster_ip, 80, 6)
    tcp += more
    assert per_endpoint(p, A) == expected(tcp)

    # A loses its first endpoint (a partial sync): the others' slots move, their counters go on
    sp_a1 = sp(A, SP_A.cluster_ip, 80, (ENDPOINTS["ep2"], ENDPOINTS["ep3"]))
    assert p.sync(state(sp_a1, SP_U, SP_OTHER, gen=4), Changes(False, frozenset({A}))).ok
    assert per_endpoint(p, A) == expected(tcp, ("ep2", "ep3"))
    again = answers(netns, "tcp", SP_A.cluster_ip, 80, 6)
    assert "ep1" not in again
    tcp += again
    assert per_endpoint(p, A) == expected(tcp, ("ep2", "ep3"))

    # a restart while A got ep1 back and U lost ep3: adoption rebuilds both from the kernel's counter names; the
    # endpoints they keep keep their counts, ep1 starts at 0 and U's ep3 counter is deleted
    before = kernel_counters(p)
    sp_u1 = sp(U, SP_U.cluster_ip, 53, (ENDPOINTS["ep1"], ENDPOINTS["ep2"]))
    p = make()
    assert p.sync(state(SP_A, sp_u1, SP_OTHER, gen=5), Changes(full=True)).ok
    assert per_endpoint(p, A) == {**expected(tcp, ("ep2", "ep3")), str(ENDPOINTS["ep1"]): 0}
    assert per_endpoint(p, U) == expected(udp, ("ep1", "ep2"))
    after = kernel_counters(p)
    assert len(after - before) == 1 and len(before - after) == 1  # A's ep1 element came, U's ep3 element went

    # U deleted: its counters go with it, from the dump and from the kernel
    assert p.sync(state(SP_A, SP_OTHER, gen=6), Changes(False, frozenset({U}))).ok
    dump = p.counters(IPFamily.V4)
    assert dump is not None and U not in dump.ports and set(dump.ports) == {A, OTHER}
    assert len(kernel_counters(p)) == 3 + 1


def test_counters_off_writes_none_and_turning_them_on_replaces_the_table(
    netns: str, make: Callable[..., NftablesProxier]
) -> None:
    p = make(counters=False)
    assert p.sync(state(SP_A), Changes(full=True)).ok
    assert p.counters(IPFamily.V4) is None
    assert counters.read_counts(p.nft, IPFamily.V4)[0] is None  # no counting sets
    assert "counter" not in p.last_transaction(IPFamily.V4).replace("counter;", "")  # the entry maps' own flag
    seen = answers(netns, "tcp", SP_A.cluster_ip, 80, 4)
    assert sum(seen.values()) == 4

    p = make(counters=True)  # a restart with counters on: another layout, replaced in one transaction
    assert p.sync(state(SP_A), Changes(full=True)).ok
    assert "delete table ip kproxy" in p.last_transaction(IPFamily.V4)
    assert per_endpoint(p, A) == {str(e): 0 for e in ENDPOINTS.values()}
    seen = answers(netns, "tcp", SP_A.cluster_ip, 80, 6)
    assert per_endpoint(p, A) == expected(seen)


def test_each_connection_counts_in_the_shard_python_renders_its_element_in(
    netns: str, make: Callable[..., NftablesProxier]
) -> None:
    """The count chains pick a counting set in the kernel by the low bits of the address the client dialled (or of
    the NodePort); ``layout.counting_set`` picks one in Python for the element it renders. Connections to services
    whose ClusterIPs fall in four different shards (1, 63, 0, 2) and to a NodePort (shard 61, dialled at the node's
    own address, whose shard 62 holds nothing) count in their own elements, each in the set Python chose, and
    nowhere else."""
    two = (ENDPOINTS["ep1"], ENDPOINTS["ep2"])

    def key(name: str) -> str:  # an endpoint's fields of a counting key
        return f"{ENDPOINTS[name].ip} . {ENDPOINTS[name].port}"

    addresses = ("198.19.0.1", "198.19.0.63", "198.19.0.64", "198.19.1.130")
    sharded = [sp(ServicePortName("ns1", f"s{i}", "http", Protocol.TCP), ip, 80, two) for i, ip in enumerate(addresses)]
    np_name = ServicePortName("ns1", "np", "http", Protocol.TCP)
    np = ServicePort(
        np_name, IPFamily.V4, "198.19.0.5", 80, node_port=30077, cluster_endpoints=two, has_any_endpoints=True
    )
    p = make()
    assert p.sync(state(*sharded, np), Changes(full=True)).ok
    want: dict[tuple[str, str], int] = {}
    for n, s in enumerate(sharded, start=3):
        seen = answers(netns, "tcp", s.cluster_ip, 80, n)
        assert sum(seen.values()) == n
        shard = layout.counting_set(layout.SERVICE_IPS, f"{s.cluster_ip} . tcp . 80")
        want.update({(shard, f"{s.cluster_ip} . tcp . 80 . {key(e)}"): c for e, c in seen.items()})
        assert per_endpoint(p, s.name) == expected(seen, ("ep1", "ep2"))
    seen = answers(netns, "tcp", CLIENT, 30077, 4)
    shard = layout.counting_set(layout.SERVICE_NODEPORTS, "tcp . 30077")
    want.update({(shard, f"tcp . 30077 . {key(e)}"): c for e, c in seen.items()})
    assert per_endpoint(p, np_name) == expected(seen, ("ep1", "ep2"))
    held, err = counters.read_counts(p.nft, IPFamily.V4)
    assert held is not None, err
    assert {mk: v for mk, v in held.items() if v} == want
    assert {m for m, _ in want} == {
        "endpoint-counters-01",
        "endpoint-counters-63",
        "endpoint-counters-00",
        "endpoint-counters-02",
        "nodeport-endpoint-counters-61",
    }


@pytest.fixture
def netns6(tmp_path: Path) -> Iterator[str]:
    """``netns``'s two namespaces in IPv6 only: the node at ``CLIENT6``, two echo servers at ``EP6``."""
    with scratch_netns("kpx-nct6-", lo_up=True) as ns, scratch_netns("kpx-nce6-", lo_up=True) as ends:
        ip(ns, "link", "add", "kpx0", "type", "veth", "peer", "name", "eth0", "netns", ends)
        ip(ns, "-6", "addr", "add", f"{CLIENT6}/64", "dev", "kpx0", "nodad")
        ip(ns, "link", "set", "kpx0", "up")
        ip(ns, "-6", "route", "add", "fd00:198:19::/64", "dev", "kpx0")  # the ClusterIPs
        ip(ends, "-6", "addr", "add", f"{EP6}/64", "dev", "eth0", "nodad")
        ip(ends, "link", "set", "eth0", "up")
        procs = []
        try:
            for name, port in (("ep1", 8081), ("ep2", 8082)):
                argv = [sys.executable, "-m", "kproxy.lab.echo", "--name", name, "--ports", str(port)]
                procs.append(
                    subprocess.Popen(["ip", "netns", "exec", ends, *argv, "--ready-file", str(tmp_path / name)])
                )
            deadline = time.monotonic() + 20
            while not all((tmp_path / n).exists() for n in ("ep1", "ep2")) and time.monotonic() < deadline:
                assert all(p.poll() is None for p in procs), "an echo server exited"
                time.sleep(0.05)
            assert all((tmp_path / n).exists() for n in ("ep1", "ep2")), "echo servers not ready"
            yield ns
        finally:
            for p in procs:
                p.kill()
                p.wait(10)


CLIENT6 = "fd00:198:18:1::fe"
EP6 = "fd00:198:18:1::1"


def test_ipv6_connections_count_in_the_shard_python_renders_their_element_in(netns6: str) -> None:
    """The IPv6 table's dispatch (``ct original ip6 daddr & ::3f``): connections to ClusterIPs in shards 1, 63 and 0
    count in the elements Python put in those shards."""
    eps = (Endpoint(EP6, 8081), Endpoint(EP6, 8082))
    addresses = ("fd00:198:19::1", "fd00:198:19::7f", "fd00:198:19::140")
    sps = [
        ServicePort(
            ServicePortName("ns1", f"v{i}", "http", Protocol.TCP),
            IPFamily.V6,
            a,
            80,
            cluster_endpoints=eps,
            has_any_endpoints=True,
        )
        for i, a in enumerate(addresses)
    ]
    config = ProxyConfig(cluster_cidrs=("fd00:198:18::/48",), ip_families=(IPFamily.V6,), service_counters=True)
    p = NftablesProxier(config, netns=netns6)
    p.start()
    try:
        v6 = MappingProxyType({s.name: s for s in sps})
        node = NodeInfo("node-a", pod_cidrs=("fd00:198:18:1::/64",))
        assert p.sync(ProxyState(MappingProxyType({IPFamily.V6: v6}), node, 1), Changes(full=True)).ok
        want = {}
        for n, s in enumerate(sps, start=3):
            seen = answers(netns6, "tcp", s.cluster_ip, 80, n)
            assert sum(seen.values()) == n
            shard = layout.counting_set(layout.SERVICE_IPS, f"{s.cluster_ip} . tcp . 80")
            want.update({(shard, f"{s.cluster_ip} . tcp . 80 . {EP6} . 808{e[-1]}"): c for e, c in seen.items()})
            dump = p.counters(IPFamily.V6)
            assert dump is not None
            got = {ep: c.connections for ep, c in dump.ports[s.name].per_endpoint().items()}
            assert {k: v for k, v in got.items() if v} == {f"[{EP6}]:808{e[-1]}": c for e, c in seen.items()}
        held, err = counters.read_counts(p.nft, IPFamily.V6)
        assert held is not None, err
        assert {mk: v for mk, v in held.items() if v} == want
        assert {m for m, _ in want} == {"endpoint-counters-01", "endpoint-counters-63", "endpoint-counters-00"}
    finally:
        p.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KPROXY_COUNTERS_SCALE"), reason="set KPROXY_COUNTERS_SCALE=1 (minutes)")
def test_one_dump_at_ten_thousand_services(make: Callable[..., NftablesProxier]) -> None:
    """The scrape budget: one ``counters()`` at 10,000 services x 10 endpoints, timed (printed: run with -s), and a
    restart with nothing changed (its adoption reads no counting element)."""
    p = make()
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
    r = make()
    t0 = time.perf_counter()
    assert r.sync(state(*sps, gen=2), Changes(full=True)).ok
    restart = time.perf_counter() - t0
    assert r.last_transaction(IPFamily.V4) == ""
    print(f"nftables: counters() at 10,000 x 10: {seconds:.2f} s; restart sync (adoption included) {restart:.2f} s")
