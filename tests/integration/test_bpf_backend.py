"""The bpf backend against the real kernel: programs compiled by bcc and attached to a cgroup of the test's own (in a
cgroup2 mount of its own), maps pinned in a folder of its own, clients started inside that cgroup and a throwaway
namespace (``kpf-it-…``). Real TCP through connect4 with getpeername showing the ClusterIP, ECONNREFUSED at once
for a service without endpoints, unconnected and connected UDP with replies from the ClusterIP, a restart that adopts
the pinned maps and writes nothing, a service refused because the maps are full, cleanup leaving nothing."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.proxier import LocalProbe

from .bpfplace import bpf_place, ns_script

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
BACKEND_IP = "198.18.210.1"
NODE = NodeInfo("node-a", addresses=("198.18.210.1",))


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    """A namespace with an address, a cgroup of the test's own and a pin folder of its own; all removed after."""
    with bpf_place("kpf-it-", CG_MOUNT, (BACKEND_IP,)) as got:
        yield got


def _config(opts: dict[str, str], **kw: object) -> ProxyConfig:
    return ProxyConfig(
        mode="bpf",
        hostname_override="node-a",
        ip_families=(IPFamily.V4,),
        backend_options=MappingProxyType({**opts, **kw}),
    )


def spn(name: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, "p", proto)


def sp(name: str, ip: str, eps: tuple[str, ...], proto: Protocol = Protocol.TCP, **kw: object) -> ServicePort:
    endpoints = tuple(Endpoint(e, 8080, node_name="node-a", is_local=True) for e in eps)
    base: dict[str, object] = dict(
        name=spn(name, proto),
        family=IPFamily.V4,
        cluster_ip=ip,
        port=80,
        cluster_endpoints=endpoints,
        local_endpoints=endpoints,
        has_any_endpoints=bool(eps),
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


def state(*ports: ServicePort, generation: int = 1) -> ProxyState:
    return ProxyState({IPFamily.V4: MappingProxyType({p.name: p for p in ports})}, NODE, generation)


def in_cgroup(ns: str, cg: str, code: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` in namespace ``ns`` with the process placed in cgroup ``cg`` before it starts."""

    def pre() -> None:
        Path(cg, "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        preexec_fn=pre,  # noqa: PLW1509 - the only way to start a process inside a cgroup before it runs
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


SERVERS = f"""
import socket, threading, time
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("{BACKEND_IP}", 8080)); t.listen()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("{BACKEND_IP}", 8080))
def tcp():
    while True:
        c, a = t.accept(); c.sendall(("tcp %s:%d" % a).encode()); c.close()
def udp():
    while True:
        d, a = u.recvfrom(100); u.sendto(b"udp " + d, a)
threading.Thread(target=tcp, daemon=True).start(); threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True); time.sleep(60)
"""


@pytest.fixture
def servers(place: tuple[str, dict[str, str]]) -> Iterator[None]:
    with ns_script(place[0], SERVERS):
        yield


def test_tcp_udp_reject_through_the_socket_programs(place: tuple[str, dict[str, str]], servers: None) -> None:
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        assert len(p.attached) == 8
        res = p.sync(
            state(
                sp("web", "198.19.0.10", (BACKEND_IP,)),
                sp("dns", "198.19.0.10", (BACKEND_IP,), Protocol.UDP),
                sp("empty", "198.19.0.11", ()),
            ),
            Changes(full=True),
        )
        assert res.ok, res.error
        out = in_cgroup(
            ns,
            opts["bpf_cgroup_path"],
            """
import json, socket, time
r = {}
s = socket.create_connection(("198.19.0.10", 80), timeout=3)
r["peer"] = s.getpeername(); r["tcp"] = s.recv(100).decode(); s.close()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(3)
u.sendto(b"hi", ("198.19.0.10", 80)); d, a = u.recvfrom(100); r["udp"] = [d.decode(), list(a)]
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(3); c.connect(("198.19.0.10", 80))
c.send(b"c"); r["cudp"] = [c.recv(100).decode(), list(c.getpeername())]
t0 = time.monotonic()
try:
    socket.create_connection(("198.19.0.11", 80), timeout=3); r["reject"] = "connected"
except OSError as e:
    r["reject"] = [e.errno, time.monotonic() - t0]
print(json.dumps(r))
""",
        )
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["peer"] == ["198.19.0.10", 80]  # getpeername4: the application sees the ClusterIP
        assert r["tcp"].startswith("tcp ")  # answered by the backend through connect4
        assert r["udp"] == ["udp hi", ["198.19.0.10", 80]]  # sendmsg4 + recvmsg4: the reply from the ClusterIP
        assert r["cudp"] == ["udp c", ["198.19.0.10", 80]]
        errno_, seconds = r["reject"]
        assert errno_ == 111 and seconds < 0.5  # ECONNREFUSED at once
        # the explainer answers from the maps
        tr = p.trace("198.18.210.9", "tcp", "198.19.0.10", 80, src_local=True)
        assert tr is not None and tr["service"] == "ns1/web:p/TCP"
        assert [o["verdict"] for o in tr["outcomes"]] == [f"socket connected to {BACKEND_IP}:8080"]
        tr = p.trace("198.18.210.9", "tcp", "198.19.0.11", 80, src_local=True)
        assert tr is not None and tr["outcomes"][0]["verdict"].startswith("reject")
    finally:
        p.close()


def test_restart_adopts_the_pinned_maps_and_writes_nothing(place: tuple[str, dict[str, str]]) -> None:
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    st = state(
        sp("a", "198.19.0.20", ("198.18.211.1", "198.18.211.2")),
        sp("b", "198.19.0.21", ("198.18.211.3",), node_port=30080),
        sp("c", "198.19.0.22", ()),
    )
    first = BpfProxier(_config(opts), netns=ns)
    try:
        res = first.sync(st, Changes(full=True))
        assert res.ok, res.error
        assert res.family(IPFamily.V4).figures["map_writes"] > 0
    finally:
        first.close()
    second = BpfProxier(_config(opts), netns=ns)
    try:
        res = second.sync(st, Changes(full=True))
        assert res.ok, res.error
        assert res.family(IPFamily.V4).written == 0 and res.family(IPFamily.V4).figures["map_writes"] == 0
        # a partial change after adoption writes the changed service only
        st2 = state(*(p for p in st if p.name != spn("a")), sp("a", "198.19.0.20", ("198.18.211.1",)), generation=2)
        res = second.sync(st2, Changes(full=False, services=frozenset({spn("a")})))
        assert res.ok and res.family(IPFamily.V4).written == 1
        view = BpfProxier.kernel_view(LocalProbe(ns, MappingProxyType(opts)), IPFamily.V4)
        assert view is not None
        assert [ln for ln in view["ns1/a:p/TCP"] if "slot" in ln] == [
            ln for ln in view["ns1/a:p/TCP"] if "slot 1 ->" in ln
        ]
        assert any("reject" in ln for ln in view["ns1/c:p/TCP"])
        # verify reads the kernel back: clean, then a master entry deleted behind kproxy's back is drift
        assert second.verify(st2)["drift"] == 0
        from kproxy.backends.bpf import loader, maps

        fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("svc", IPFamily.V4)))
        try:
            maps.delete_batch(fd, [maps.lb_key(IPFamily.V4, "198.19.0.21", 80, 6, 0)])
        finally:
            os.close(fd)
        report = second.verify(st2)
        assert report["drift"] >= 1 and "ns1/b:p/TCP" in report["services"], report
        assert loader.DEFAULT_MAP_SIZE >= 10_000 * 51  # the default holds 10,000 services x 50 endpoints
    finally:
        second.close()
    # b deleted while kproxy was down: the restart's sweep removes its frontends (a NodePort is left of it), and
    # counts it as the one service port it wrote
    third = BpfProxier(_config(opts), netns=ns)
    try:
        res = third.sync(state(*(p for p in st2 if p.name != spn("b")), generation=3), Changes(full=True))
        assert res.ok, res.error
        assert res.family(IPFamily.V4).written == 1 and res.family(IPFamily.V4).services == 2
    finally:
        third.close()


def test_a_service_that_does_not_fit_is_refused_with_the_reason(place: tuple[str, dict[str, str]]) -> None:
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts, bpf_map_size=8), netns=ns)
    try:
        small = sp("small", "198.19.0.30", ("198.18.212.1", "198.18.212.2"))  # 3 entries
        big = sp("big", "198.19.0.31", tuple(f"198.18.212.{i}" for i in range(10, 20)))  # 11 entries
        res = p.sync(state(small, big), Changes(full=True))
        assert res.ok and not res.failed  # the core refused it before anything was written: not a kernel failure
        assert set(res.refused) == {spn("big")}
        assert res.refused[spn("big")].startswith("capacity: needs 10 endpoints; this mode holds at most 7 per family")
        view = BpfProxier.kernel_view(LocalProbe(ns, MappingProxyType(opts)), IPFamily.V4)
        assert view is not None and "ns1/small:p/TCP" in view and "ns1/big:p/TCP" not in view
    finally:
        p.close()


def test_cleanup_leaves_no_pin_attachment_or_table(place: tuple[str, dict[str, str]]) -> None:
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        assert p.sync(state(sp("np", "198.19.0.40", ("198.18.213.1",), node_port=30090)), Changes(full=True)).ok
        probe = LocalProbe(ns, MappingProxyType(opts))
        before = BpfProxier.remnants(probe)
        assert any(ln.startswith("pin ") for ln in before)
        assert any("kp_connect4" in ln for ln in before)
        assert any(ln.startswith("nft ip kproxy-bpf") for ln in before)
    finally:
        p.close()
    BpfProxier.cleanup_leftovers(_config(opts), netns=ns)
    assert BpfProxier.remnants(LocalProbe(ns, MappingProxyType(opts))) == []


UDP_CLIENT = """
import socket, sys, time
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(2); c.connect(("198.19.0.50", 53))
c.send(b"a"); print("first", c.recv(100).decode(), flush=True)
sys.stdin.readline()  # the backend is replaced meanwhile
t0 = time.monotonic()
while time.monotonic() - t0 < 5:
    try:
        c.send(b"b"); c.recv(100)
    except OSError as e:  # the socket was ended: reconnect, as resolvers do
        print("ended", e.errno, flush=True)
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(2); c.connect(("198.19.0.50", 53))
        c.send(b"c"); print("after", c.recv(100).decode(), flush=True)
        break
    time.sleep(0.1)
else:
    print("still pinned", flush=True)
"""

UDP_SERVERS = """
import socket, threading, time
def serve(ip):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((ip, 53))
    while True:
        d, a = u.recvfrom(100); u.sendto(ip.encode(), a)
for ip in ("198.18.214.1", "198.18.214.2"):
    threading.Thread(target=serve, args=(ip,), daemon=True).start()
print("ready", flush=True); time.sleep(60)
"""


def test_a_connected_udp_socket_to_a_removed_backend_is_ended(place: tuple[str, dict[str, str]]) -> None:
    """cilium#27300: a connected UDP client (a resolver) pinned to a backend that went away must not keep sending
    into the void: kproxy ends the socket, the client reconnects to the live backend."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    for ip in ("198.18.214.1", "198.18.214.2"):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "lo"], check=True, timeout=30)
    servers = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", UDP_SERVERS], stdout=subprocess.PIPE, text=True
    )
    p = BpfProxier(_config(opts), netns=ns)
    client = None
    try:
        assert servers.stdout is not None and servers.stdout.readline().strip() == "ready"
        p.start()

        def dns(ep: str, gen: int) -> ProxyState:
            e = (Endpoint(ep, 53, node_name="node-a", is_local=True),)
            port = ServicePort(
                name=spn("dns", Protocol.UDP),
                family=IPFamily.V4,
                cluster_ip="198.19.0.50",
                port=53,
                cluster_endpoints=e,
                local_endpoints=e,
                has_any_endpoints=True,
            )
            return state(port, generation=gen)

        assert p.sync(dns("198.18.214.1", 1), Changes(full=True)).ok
        cg = opts["bpf_cgroup_path"]

        def pre() -> None:
            Path(cg, "cgroup.procs").write_text(str(os.getpid()))

        client = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", UDP_CLIENT],
            preexec_fn=pre,  # noqa: PLW1509 - the client must run inside the cgroup from its start
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "first 198.18.214.1"
        res = p.sync(dns("198.18.214.2", 2), Changes(full=False, services=frozenset({spn("dns", Protocol.UDP)})))
        assert res.ok
        assert p.last_reap is not None and p.last_reap.result(timeout=30) >= 1
        client.stdin.write("go\n")
        client.stdin.flush()
        lines = [client.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("ended"), lines
        assert lines[1] == "after 198.18.214.2", lines
    finally:
        for proc in (client, servers):
            if proc is not None:
                proc.kill()
                proc.wait(10)
                for f in (proc.stdout, proc.stdin):
                    if f is not None:
                        f.close()
        p.close()


def test_a_restarted_kproxy_keeps_the_attached_programs_of_its_build(place: tuple[str, dict[str, str]]) -> None:
    """A second start (a restarted kproxy of the same build) adopts the attached programs: same ids, nothing
    swapped; programs whose maps are not the pinned ones any more are replaced, once the first sync has filled the
    maps the new ones read."""
    from kproxy.backends.bpf import cleanup, loader
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    cg = Path(opts["bpf_cgroup_path"])
    first = BpfProxier(_config(opts), netns=ns)
    try:
        first.start()
    finally:
        first.close()
    ids = sorted(d["id"] for d in loader.ours(loader.attached(cg)))
    assert len(ids) == 8
    second = BpfProxier(_config(opts), netns=ns)
    try:
        second.start()
        assert sorted(d["id"] for d in loader.ours(loader.attached(cg))) == ids
    finally:
        second.close()
    cleanup.remove_tree(Path(opts["bpf_pin_path"]))  # the maps the programs read are no longer the pinned ones
    third = BpfProxier(_config(opts), netns=ns)
    try:
        third.start()
        # the older copies serve until the first sync has filled the new maps (test_bpf_restart.py), then go
        both = sorted(d["id"] for d in loader.ours(loader.attached(cg)))
        assert len(both) == 16 and set(ids) <= set(both)
        assert third.sync(state(sp("a", "198.19.0.30", ("198.18.211.1",))), Changes(full=True)).ok
        now = sorted(d["id"] for d in loader.ours(loader.attached(cg)))
        assert len(now) == 8 and not set(now) & set(ids)
    finally:
        third.close()


HOST_BIND_SCRIPT = """
import json, subprocess, sys, time
from pathlib import Path
from kproxy.backends.bpf import cleanup, loader
loader.HOST_BPFFS = Path(sys.argv[1])
loader.PIN_ROOT = Path(sys.argv[2])
out = {}
loader.ensure_host_bind()
out["bound"] = loader._bpf_mounted(loader.HOST_BPFFS)
# a process of another mount namespace that sees the bind (a lab node's kproxy under ip netns exec): kept
child = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "20"])
for _ in range(100):
    if loader._bind_in_use():
        break
    time.sleep(0.05)
loader.release_host_bind()
out["kept_in_use"] = loader._bpf_mounted(loader.HOST_BPFFS)
child.kill(); child.wait()
# pins left under the pin root: kept
loader.PIN_ROOT.mkdir(parents=True, exist_ok=True)
(loader.PIN_ROOT / "x").mkdir()
loader.release_host_bind()
out["kept_pins"] = loader._bpf_mounted(loader.HOST_BPFFS)
(loader.PIN_ROOT / "x").rmdir(); loader.PIN_ROOT.rmdir()
loader.release_host_bind()
out["released"] = not loader._bpf_mounted(loader.HOST_BPFFS) and not loader.HOST_BPFFS.exists()
print(json.dumps(out))
"""


def test_the_labs_bpffs_bind_goes_with_the_last_user() -> None:
    """``lab_prepare`` binds the machine's bpffs outside /sys (``loader.ensure_host_bind``); ``cleanup`` (lab down)
    undoes it once no pins are left and no process of another mount namespace sees it. Run in a private mount
    namespace with a bind point and pin root of the test's own, so the machine's mounts are never touched."""
    tag = uuid.uuid4().hex[:8]
    bind = f"/run/kpf-it-bpffs-{tag}"
    root = f"/sys/fs/bpf/kpf-it-root-{tag}"
    res = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", HOST_BIND_SCRIPT, bind, root],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.splitlines()[-1]) == {
            "bound": True,
            "kept_in_use": True,
            "kept_pins": True,
            "released": True,
        }
    finally:
        inspect_root = Path(root)
        if inspect_root.is_dir():
            for d in sorted(inspect_root.rglob("*"), reverse=True):
                d.rmdir()
            inspect_root.rmdir()
        Path(bind).rmdir() if Path(bind).is_dir() and not os.path.ismount(bind) else None


def test_70000_service_ports_are_programmed_and_what_does_not_fit_is_refused(place: tuple[str, dict[str, str]]) -> None:
    """Past 65,535 frontends (issue 22; Cilium's 16-bit service ids stop there: cilium#39236): 70,000 service ports
    in one family are programmed into real maps with 32-bit reverse-NAT and backend ids, and the ones past 65,535 are
    reachable by lookup (``trace`` reads the master entry, the names map, the slot and the backend array). The maps'
    size (``--bpf-map-size``) is what the core's capacity check enforces per service port: one that does not fit is
    refused with the reason, as is one with more endpoints than the 16-bit slot count, and the family keeps syncing.
    A restarted proxier adopts the 70,000 and writes nothing."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    n = 70_000
    size = 2 * n + 10  # each service port: a master and one slot, one backend, one name
    first_vip = int(ipaddress.IPv4Address("198.19.0.1"))
    many = [sp(f"s{i}", str(ipaddress.IPv4Address(first_vip + i)), ("198.18.212.1",)) for i in range(n)]
    over = sp("over", "198.18.255.1", tuple(f"198.18.213.{i}" for i in range(1, 21)))  # 21 entries: 10 are left
    first_ep = int(ipaddress.IPv4Address("198.18.0.0"))
    big = sp("big", "198.18.255.2", tuple(str(ipaddress.IPv4Address(first_ep + i)) for i in range(0x10000)))
    p = BpfProxier(_config(opts, bpf_map_size=size), netns=ns)
    try:
        res = p.sync(state(*many, over, big), Changes(full=True))
        assert res.ok and not res.failed, res.error
        assert set(res.refused) == {spn("over"), spn("big")}, res.refused
        assert "capacity" in res.refused[spn("over")], res.refused
        assert res.refused[spn("big")] == "capacity: 65536 endpoints, over this mode's 65535 per service port"
        assert res.family(IPFamily.V4).figures["service_entries"] == 2 * n
        for i in (0, 65_534, 65_535, 65_536, n - 1):  # reverse-NAT ids i + 1: both sides of 16 bits
            got = p.trace("198.18.0.9", "TCP", many[i].cluster_ip, 80, src_local=True)
            assert got is not None and got["service"] == f"ns1/s{i}:p/TCP", got
            assert f"rev_nat={i + 1} " in got["outcomes"][0]["rules"][0], got
            assert got["outcomes"][0]["verdict"] == "socket connected to 198.18.212.1:8080", got
        # the family keeps syncing: a change of one service past 65,535 is programmed
        moved = sp("s69999", many[-1].cluster_ip, ("198.18.212.9",))
        many[-1] = moved
        res = p.sync(state(*many, over, big), Changes(full=False, services=frozenset({moved.name})))
        assert res.ok and set(res.refused) == {spn("over"), spn("big")}
        got = p.trace("198.18.0.9", "TCP", moved.cluster_ip, 80, src_local=True)
        assert got is not None and got["outcomes"][0]["verdict"] == "socket connected to 198.18.212.9:8080", got
    finally:
        p.close()
    again = BpfProxier(_config(opts, bpf_map_size=size), netns=ns)
    try:
        res = again.sync(state(*many, over, big), Changes(full=True))
        assert res.ok and res.family(IPFamily.V4).figures["map_writes"] == 0, res.family(IPFamily.V4).figures
    finally:
        again.close()
