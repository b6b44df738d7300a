"""The bpf mode's traffic counters (``--service-counters``) against the real programs and real sockets.

Each test has a namespace, a cgroup and a pin folder of its own (``bpfplace``, ``kh2-cnt-…``), removed afterwards.
Three endpoints listen on addresses of the namespace's lo (outside the cgroup) and answer with their own address; a
client started inside the cgroup makes TCP connections, unconnected UDP flows (several datagrams each) and connected
UDP flows to ClusterIPs, and the counters per endpoint must equal what the endpoints answered. Two compiles in all:
one with the switch on, one without (whose programs must have no counter map). Needs root and bcc.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.counters import Measure
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .bpfplace import bpf_place, ns_script
from .test_bpf_backend import in_cgroup

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
EPS = ("198.18.212.1", "198.18.212.2", "198.18.212.3")
CIP = "198.19.1.10"
NODE = NodeInfo("node-a", addresses=(EPS[0],))
WEB = ServicePortName("ns1", "web", "http", Protocol.TCP)
DNS = ServicePortName("ns1", "dns", "dns", Protocol.UDP)
EP_TEXT = tuple(f"{e}:8080" for e in EPS)


def sp(name: ServicePortName, port: int, eps: tuple[str, ...] = EPS) -> ServicePort:
    endpoints = tuple(Endpoint(e, 8080, node_name="node-a", is_local=True) for e in eps)
    return ServicePort(
        name, IPFamily.V4, CIP, port, cluster_endpoints=endpoints, local_endpoints=endpoints, has_any_endpoints=True
    )


def state(*ports: ServicePort, generation: int = 1) -> ProxyState:
    return ProxyState({IPFamily.V4: MappingProxyType({p.name: p for p in ports})}, NODE, generation)


def config(opts: dict[str, str], counting: bool) -> ProxyConfig:
    return ProxyConfig(
        mode="bpf",
        hostname_override="node-a",
        ip_families=(IPFamily.V4,),
        backend_options=MappingProxyType(opts),
        service_counters=counting,
    )


# each endpoint answers with its own address: TCP on accept, UDP per datagram
SERVERS = f"""
import socket, threading, time
def tcp(a):
    t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind((a, 8080)); t.listen(64)
    while True:
        c, _ = t.accept(); c.sendall(a.encode()); c.close()
def udp(a):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((a, 8080))
    while True:
        d, peer = u.recvfrom(100); u.sendto(a.encode(), peer)
for a in {EPS!r}:
    threading.Thread(target=tcp, args=(a,), daemon=True).start()
    threading.Thread(target=udp, args=(a,), daemon=True).start()
print("ready", flush=True); time.sleep(300)
"""

# ``tcp`` connections, ``udp`` unconnected UDP sockets sending 3 datagrams each (one flow each), ``cudp`` connected
# UDP sockets (one flow each); per kind, how many each endpoint answered (a flow's answers all come from one)
CLIENT = """
import collections, json, socket
tcp, udp, cudp = {tcp}, {udp}, {cudp}
out = {{"tcp": collections.Counter(), "udp": collections.Counter()}}
for _ in range(tcp):
    with socket.create_connection(("{cip}", 80), timeout=5) as s:
        out["tcp"][s.recv(100).decode()] += 1
for _ in range(udp):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(5)
        got = set()
        for _ in range(3):
            u.sendto(b"q", ("{cip}", 53)); got.add(u.recvfrom(100)[0].decode())
        assert len(got) == 1, got
        out["udp"][got.pop()] += 1
for _ in range(cudp):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(5); u.connect(("{cip}", 53)); u.send(b"q"); u.send(b"q")
        a, b = u.recv(100).decode(), u.recv(100).decode()
        assert a == b, (a, b)
        out["udp"][a] += 1
print(json.dumps(out))
"""


def traffic(ns: str, cg: str, tcp: int, udp: int, cudp: int) -> dict[str, collections.Counter[str]]:
    """Real connections and flows from inside the cgroup; per kind ("tcp", "udp"), endpoint -> answered."""
    res = in_cgroup(ns, cg, CLIENT.format(tcp=tcp, udp=udp, cudp=cudp, cip=CIP), timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    return {kind: collections.Counter({f"{a}:8080": n for a, n in got[kind].items()}) for kind in ("tcp", "udp")}


def per_endpoint(p: object, name: ServicePortName) -> dict[str, int]:
    dump = p.counters(IPFamily.V4)  # type: ignore[attr-defined]
    assert dump is not None and dump.family is IPFamily.V4
    pc = dump.ports[name]
    assert pc.packets is None and pc.bytes is None and pc.total.packets is None
    counts = dict(zip(pc.endpoints, pc.connections, strict=True))
    assert pc.total.connections == sum(counts.values())
    return counts


def whole(seen: collections.Counter[str], eps: tuple[str, ...] = EP_TEXT) -> dict[str, int]:
    return {e: seen[e] for e in eps}


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    with bpf_place("kh2-cnt-", CG_MOUNT, EPS) as got, ns_script(got[0], SERVERS):
        yield got


def test_connections_and_flows_per_endpoint_survive_a_restart_and_go_with_the_service(
    place: tuple[str, dict[str, str]],
) -> None:
    from kproxy.backends.bpf import counters, maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    cg = opts["bpf_cgroup_path"]
    st = state(sp(WEB, 80), sp(DNS, 53))
    p = BpfProxier(config(opts, True), netns=ns)
    try:
        p.start()  # the one compile with counters
        assert p.counters_offered == frozenset({Measure.CONNECTIONS})
        res = p.sync(st, Changes(full=True))
        assert res.ok, res.error
        assert per_endpoint(p, WEB) == per_endpoint(p, DNS) == dict.fromkeys(EP_TEXT, 0)
        seen = traffic(ns, cg, tcp=30, udp=9, cudp=6)
        assert sum(seen["tcp"].values()) == 30 and sum(seen["udp"].values()) == 15
        assert len(seen["tcp"]) >= 2, f"30 connections all went to one endpoint: {seen['tcp']}"
        assert per_endpoint(p, WEB) == whole(seen["tcp"])  # one per connect
        assert per_endpoint(p, DNS) == whole(seen["udp"])  # one per flow, not per datagram
    finally:
        p.close()

    # a restart: a new proxier adopts the pinned maps, writes nothing, and the counts are still there
    again = BpfProxier(config(opts, True), netns=ns)
    try:
        res = again.sync(st, Changes(full=True))
        assert res.ok, res.error
        fam = res.family(IPFamily.V4)
        assert fam.written == 0 and fam.figures["map_writes"] == 0
        assert per_endpoint(again, WEB) == whole(seen["tcp"]) and per_endpoint(again, DNS) == whole(seen["udp"])
        more = traffic(ns, cg, tcp=12, udp=0, cudp=3)  # the programs attached before the restart go on counting
        assert per_endpoint(again, WEB) == whole(seen["tcp"] + more["tcp"])
        assert per_endpoint(again, DNS) == whole(seen["udp"] + more["udp"])

        # the service goes: its counters go with it (its ids' counters deleted), the other's stay
        web_ids = set(again._names._names[IPFamily.V4][WEB][0])  # type: ignore[union-attr]
        res = again.sync(state(sp(DNS, 53), generation=2), Changes(full=False, services=frozenset({WEB})))
        assert res.ok, res.error
        dump = again.counters(IPFamily.V4)
        assert dump is not None and WEB not in dump.ports and DNS in dump.ports
        fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name(maps.COUNTER_ROLE, IPFamily.V4)))
        try:
            held = counters.read_map(fd, 64)
        finally:
            os.close(fd)
        assert [held[i] for i in sorted(web_ids)] == [0] * len(web_ids)
        assert sum(held) == sum((seen["udp"] + more["udp"]).values())

        # back with one endpoint fewer: its ids (reused) count from zero
        res = again.sync(state(sp(WEB, 80, EPS[:2]), sp(DNS, 53), generation=3), Changes(full=True))
        assert res.ok, res.error
        assert per_endpoint(again, WEB) == dict.fromkeys(EP_TEXT[:2], 0)
        last = traffic(ns, cg, tcp=8, udp=0, cudp=0)
        assert per_endpoint(again, WEB) == whole(last["tcp"], EP_TEXT[:2]) and sum(last["tcp"].values()) == 8
    finally:
        again.close()


def test_without_the_switch_the_programs_have_no_counter_map(place: tuple[str, dict[str, str]]) -> None:
    from kproxy.backends.bpf import loader, maps, objects
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    pins = Path(opts["bpf_pin_path"])
    pins.mkdir(parents=True)
    # a counter map an earlier kproxy with the switch on left: a start without it unpins it
    left = pins / maps.pin_name(maps.COUNTER_ROLE, IPFamily.V4)
    fd = maps.create_map(*maps.map_spec(maps.COUNTER_ROLE, IPFamily.V4, 16, 16))
    maps.obj_pin(fd, str(left))
    os.close(fd)
    p = BpfProxier(config(opts, False), netns=ns)
    try:
        p.start()
        assert p.sync(state(sp(WEB, 80)), Changes(full=True)).ok
        assert p.counters(IPFamily.V4) is None
        assert not left.exists() and not list(pins.glob("cnt*"))
        where = p._where()
        pinned = loader.pinned_ids(where)
        assert (maps.COUNTER_ROLE, IPFamily.V4) not in pinned
        assert loader.programs_problem(where, pinned, (IPFamily.V4, IPFamily.V6)) is None
        # every attached program reads pinned maps only, and no counter map is pinned
        for d in loader.ours(loader.attached(where.cgroup)):
            pfd = objects.prog_fd_by_id(int(d["id"]))
            try:
                assert objects.prog_map_ids(pfd) <= set(pinned.values())
            finally:
                os.close(pfd)
        res = traffic(ns, opts["bpf_cgroup_path"], tcp=3, udp=0, cudp=0)
        assert sum(res["tcp"].values()) == 3  # and the data path works as ever
    finally:
        p.close()
