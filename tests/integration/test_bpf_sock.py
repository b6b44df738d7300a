"""The bpf mode's socket programs (bpf/kproxy_sock.c) on the real kernel, for the cases the review found broken:
dual-stack IPv6 sockets reaching an IPv4 service through an IPv4-mapped address (``::ffff:a.b.c.d``: the *6 hooks
run, and must use the IPv4 maps), and a master entry whose count points at a slot that is gone (kproxy shrinking the
service while a program runs) failing the connect at once instead of letting it out untranslated; and the build with
socket storage for connected TCP sockets (KP_PIN_PEER4/6, compiled here by the test until the loader passes them),
whose TCP connections leave nothing in the reverse-NAT LRU; and ClientIP affinity kept for a backend that a
scale-down moved to another slot.

Each test compiles and attaches the programs (bcc) to a cgroup of its own in a cgroup2 mount of its own, pins the
maps in a folder of its own and runs clients inside that cgroup in a throwaway namespace ``kpsk-it-…`` whose route
to the service range leads nowhere (a veth whose peer drops everything), so an untranslated connect hangs as it
would on a real node instead of failing with "network unreachable". Helpers (service ports, config, the client
runner, the echo servers) come from test_bpf_backend.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.model import Changes, IPFamily, Protocol

from .bpfplace import bpf_place, ns_script
from .test_bpf_backend import BACKEND_IP, SERVERS, _config, in_cgroup, sp, state

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-sock-test/cgroup2")
VIP = "198.19.0.10"
EMPTY_VIP = "198.19.0.11"
GAP_VIP = "198.19.0.12"


def _dead_end_route(ns: str) -> None:
    """An untranslated packet to a service address goes out here and is dropped by the peer (no address, no
    forwarding): a connect that escapes translation hangs, as on a node with a default route."""

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", ns, *args], check=True, timeout=30)

    ip("link", "add", "kpc0", "type", "veth", "peer", "name", "kpc1")
    ip("addr", "add", "198.18.215.1/30", "dev", "kpc0")
    ip("link", "set", "kpc0", "up")
    ip("link", "set", "kpc1", "up")
    ip("neigh", "add", "198.18.215.2", "lladdr", "02:00:00:00:00:02", "dev", "kpc0", "nud", "permanent")
    ip("route", "add", "198.19.0.0/16", "via", "198.18.215.2", "dev", "kpc0")


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    """A namespace with the backend address and a dead-end route to 198.19.0.0/16, a cgroup and a pin folder of the
    test's own; all removed after, also on failure."""
    with bpf_place("kpsk-it-", CG_MOUNT, (BACKEND_IP,), _dead_end_route) as got:
        yield got


@pytest.fixture
def servers(place: tuple[str, dict[str, str]]) -> Iterator[None]:
    """TCP and UDP echo servers on the backend address (outside the cgroup: backends are not translated)."""
    with ns_script(place[0], SERVERS):
        yield


MAPPED_CLIENT = f"""
import json, socket, time
V6ONLY = getattr(socket, "IPV6_V6ONLY", 26)
def sock(kind):
    s = socket.socket(socket.AF_INET6, kind); s.setsockopt(socket.IPPROTO_IPV6, V6ONLY, 0); s.settimeout(2); return s
r = {{}}
t0 = time.monotonic()
s = sock(socket.SOCK_STREAM)
try:
    s.connect(("::ffff:{VIP}", 80)); r["peer"] = list(s.getpeername()[:2]); r["tcp"] = s.recv(100).decode()
except OSError as e:
    r["tcp"] = ["error", e.errno, round(time.monotonic() - t0, 2)]
s.close()
u = sock(socket.SOCK_DGRAM)
try:
    u.sendto(b"hi", ("::ffff:{VIP}", 80)); d, a = u.recvfrom(100); r["udp"] = [d.decode(), list(a[:2])]
except OSError as e:
    r["udp"] = ["error", e.errno]
c = sock(socket.SOCK_DGRAM)
try:
    c.connect(("::ffff:{VIP}", 80)); c.send(b"c"); r["cudp"] = [c.recv(100).decode(), list(c.getpeername()[:2])]
except OSError as e:
    r["cudp"] = ["error", e.errno]
t0 = time.monotonic()
try:
    sock(socket.SOCK_STREAM).connect(("::ffff:{EMPTY_VIP}", 80)); r["reject"] = "connected"
except OSError as e:
    r["reject"] = [e.errno, time.monotonic() - t0]
print(json.dumps(r))
"""


def test_a_dual_stack_socket_reaches_an_ipv4_service_through_a_mapped_address(
    place: tuple[str, dict[str, str]], servers: None
) -> None:
    """An AF_INET6 socket (IPV6_V6ONLY off, Java's default) to ::ffff:<ClusterIP> runs connect6/recvmsg6/
    getpeername6 with a mapped address: it reaches the IPv4 backend and sees the mapped ClusterIP as its peer and as
    the source of UDP replies; a service without endpoints is refused at once there too."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        res = p.sync(
            state(
                sp("web", VIP, (BACKEND_IP,)),
                sp("dns", VIP, (BACKEND_IP,), Protocol.UDP),
                sp("empty", EMPTY_VIP, ()),
            ),
            Changes(full=True),
        )
        assert res.ok, res.error
        out = in_cgroup(ns, opts["bpf_cgroup_path"], MAPPED_CLIENT)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert str(r["tcp"]).startswith(f"tcp {BACKEND_IP}:"), r  # answered by the IPv4 backend through connect6
        assert r["peer"] == [f"::ffff:{VIP}", 80]  # getpeername6: the mapped ClusterIP, not the backend
        assert r["udp"] == ["udp hi", [f"::ffff:{VIP}", 80]]  # recvmsg6: the reply from the mapped ClusterIP
        assert r["cudp"] == ["udp c", [f"::ffff:{VIP}", 80]]  # connect6 (connected UDP) + getpeername6
        errno_, seconds = r["reject"]
        assert errno_ == errno.ECONNREFUSED and seconds < 0.5
    finally:
        p.close()


GAP_CLIENT = f"""
import json, socket, time
r = {{}}
def attempt(name, family, kind, addr, send=False):
    s = socket.socket(family, kind); s.settimeout(2)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, getattr(socket, "IPV6_V6ONLY", 26), 0)
    t0 = time.monotonic()
    try:
        if send:
            s.sendto(b"x", addr); s.recvfrom(100)
        else:
            s.connect(addr)
        r[name] = ["ok", round(time.monotonic() - t0, 2)]
    except OSError as e:
        r[name] = [e.errno, round(time.monotonic() - t0, 2)]
    s.close()
attempt("tcp4", socket.AF_INET, socket.SOCK_STREAM, ("{GAP_VIP}", 80))
attempt("udp4", socket.AF_INET, socket.SOCK_DGRAM, ("{GAP_VIP}", 80))
attempt("sendto4", socket.AF_INET, socket.SOCK_DGRAM, ("{GAP_VIP}", 80), send=True)
attempt("tcp_mapped", socket.AF_INET6, socket.SOCK_STREAM, ("::ffff:{GAP_VIP}", 80))
attempt("ok4", socket.AF_INET, socket.SOCK_STREAM, ("{VIP}", 80))
print(json.dumps(r))
"""


def _sync_gap_services(p: Any) -> None:
    """Start ``p`` and program a consistent service (``web``) and the TCP and UDP services the gap tests break."""
    p.start()
    res = p.sync(
        state(
            sp("web", VIP, (BACKEND_IP,)),
            sp("gap", GAP_VIP, (BACKEND_IP,)),
            sp("gapu", GAP_VIP, (BACKEND_IP,), Protocol.UDP),
        ),
        Changes(full=True),
    )
    assert res.ok, res.error


def _assert_gap_unreachable(ns: str, opts: dict[str, str]) -> None:
    """The gap services' TCP, UDP and mapped-address clients fail with EHOSTUNREACH at once; ``web`` still answers."""
    out = in_cgroup(ns, opts["bpf_cgroup_path"], GAP_CLIENT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for name in ("tcp4", "udp4", "sendto4", "tcp_mapped"):
        got, seconds = r[name]
        assert got == errno.EHOSTUNREACH and seconds < 0.5, (name, r)
    assert r["ok4"][0] == "ok"  # the consistent service next to them is untouched


def test_a_master_entry_pointing_at_a_missing_slot_fails_the_connect_at_once(
    place: tuple[str, dict[str, str]], servers: None
) -> None:
    """kproxy shrinking a service deletes slots beyond the new count after writing the new count; a program that
    read the old count meanwhile looks up a slot that is gone. It looks the master up again and retries once; a
    master whose count still points at a missing slot (written here by hand) fails the connect and the UDP send with
    EHOSTUNREACH at once, never letting the socket out untranslated (it would hang: nothing answers a ClusterIP)."""
    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        _sync_gap_services(p)
        fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("svc", IPFamily.V4)))
        try:
            for proto in (6, 17):  # the master entries (count 1) stay; the slot they count is gone
                master = maps.lookup(fd, maps.lb_key(IPFamily.V4, GAP_VIP, 80, proto, 0), maps.LB_SERVICE.size)
                assert master is not None and maps.decode_service(master)[2] == 1
                slot = maps.lb_key(IPFamily.V4, GAP_VIP, 80, proto, 1)
                assert maps.lookup(fd, slot, maps.LB_SERVICE.size) is not None
                maps.delete_batch(fd, [slot])
        finally:
            os.close(fd)
        _assert_gap_unreachable(ns, opts)
    finally:
        p.close()


def test_a_slot_naming_a_zeroed_backend_fails_the_connect_at_once(
    place: tuple[str, dict[str, str]], servers: None
) -> None:
    """The backend map is an array: a backend kproxy removed is an all-zero entry, not a missing one. A slot that
    still names it (a program racing the removal) gets the same answer as a missing slot: EHOSTUNREACH at once."""
    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        _sync_gap_services(p)
        pins = Path(opts["bpf_pin_path"])
        svc = maps.obj_get(str(pins / maps.pin_name("svc", IPFamily.V4)))
        be = maps.obj_get(str(pins / maps.pin_name("be", IPFamily.V4)))
        try:
            for proto in (6, 17):
                slot = maps.lookup(svc, maps.lb_key(IPFamily.V4, GAP_VIP, 80, proto, 1), maps.LB_SERVICE.size)
                assert slot is not None
                key = maps.backend_key(maps.decode_service(slot)[0])
                assert any(maps.lookup(be, key, maps.LB4_BACKEND.size) or b"")
                maps.update_batch(be, [key], maps.zero_values(1, maps.LB4_BACKEND.size))
        finally:
            os.close(svc)
            os.close(be)
        _assert_gap_unreachable(ns, opts)
    finally:
        p.close()


VIP6 = "fd00:198:18:ffff::10"
GAP_VIP6 = "fd00:198:18:ffff::12"
BACKEND6 = "fd00:198:18:210::1"

SERVER6 = f"""
import socket, threading, time
t = socket.socket(socket.AF_INET6); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("{BACKEND6}", 8080)); t.listen()
def tcp():
    while True:
        c, a = t.accept(); c.sendall(("tcp6 %s" % a[0]).encode()); c.close()
threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True); time.sleep(60)
"""

GAP6_CLIENT = f"""
import json, socket, time
r = {{}}
for name, addr in (("gap6", "{GAP_VIP6}"), ("ok6", "{VIP6}")):
    s = socket.socket(socket.AF_INET6); s.settimeout(2); t0 = time.monotonic()
    try:
        s.connect((addr, 80)); r[name] = ["ok", list(s.getpeername()[:2]), s.recv(100).decode()]
    except OSError as e:
        r[name] = [e.errno, round(time.monotonic() - t0, 2)]
    s.close()
print(json.dumps(r))
"""


def attach_with_peer(opts: dict[str, str], ns: str, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Compile the programs with KP_PIN_PEER4/6 (socket storage for connected TCP sockets; kproxy's loader does not
    pass them yet) and attach them to the test's cgroup in this process; the peer maps' pins (bcc makes them)."""
    import bcc  # type: ignore[import-not-found,unused-ignore]

    from kproxy.backends.bpf import loader, maps

    pin = Path(opts["bpf_pin_path"])
    peer_pins = [pin / f"peer{n}_{maps.MAPS_VERSION}" for n in (4, 6)]
    real = bcc.BPF

    class WithPeer(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, cflags: list[str] | None = None, **kw: object) -> None:
            extra = [f'-DKP_PIN_PEER{n}="{path}"' for n, path in zip((4, 6), peer_pins, strict=True)]
            super().__init__(*args, cflags=[*(cflags or []), *extra], **kw)

    monkeypatch.setattr(bcc, "BPF", WithPeer)
    places = loader.places(opts, ns)
    b = loader.compile_programs(places)
    assert len(loader.load_and_attach(b, places.cgroup)[0]) == 8
    assert all(x.exists() for x in peer_pins)
    return peer_pins


def drop_peer(opts: dict[str, str]) -> None:
    """Detach the programs and remove the peer pins (before the proxier's own cleanup, which also knows them now)."""
    from kproxy.backends.bpf import loader, maps

    loader.detach_all(Path(opts["bpf_cgroup_path"]))
    for n in (4, 6):
        (Path(opts["bpf_pin_path"]) / f"peer{n}_{maps.MAPS_VERSION}").unlink(missing_ok=True)


def rev_entries(opts: dict[str, str], family: IPFamily) -> int:
    from kproxy.backends.bpf import maps

    fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("rev", family)))
    try:
        ks, vs = maps.key_sizes(family)["rev"]
        return len(list(maps.lookup_all(fd, ks, vs)))
    finally:
        os.close(fd)


@pytest.mark.parametrize("peer", [False, True], ids=["rev-lru", "peer-storage"])
def test_an_ipv6_master_entry_pointing_at_a_missing_slot_fails_the_connect_at_once(
    place: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch, peer: bool
) -> None:
    """The IPv6 path (connect6 with a native address) retries and fails the same way, and still translates a
    consistent IPv6 service (getpeername6 showing its ClusterIP: from the reverse-NAT LRU, or from socket storage
    when the peer maps are given, leaving the LRU empty)."""
    from types import MappingProxyType

    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf.proxier import BpfProxier
    from kproxy.config import ProxyConfig
    from kproxy.model import ProxyState

    from .test_bpf_backend import NODE

    ns, opts = place
    for args in (
        ["addr", "add", f"{BACKEND6}/128", "dev", "lo", "nodad"],
        ["addr", "add", "fd00:198:18:215::1/64", "dev", "kpc0", "nodad"],
        ["neigh", "add", "fd00:198:18:215::2", "lladdr", "02:00:00:00:00:02", "dev", "kpc0", "nud", "permanent"],
        ["route", "add", "fd00:198:18:ffff::/64", "via", "fd00:198:18:215::2", "dev", "kpc0"],
    ):
        subprocess.run(["ip", "-n", ns, "-6", *args], check=True, timeout=30)
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER6], stdout=subprocess.PIPE, text=True
    )
    cfg = ProxyConfig(
        mode="bpf",
        hostname_override="node-a",
        ip_families=(IPFamily.V4, IPFamily.V6),
        backend_options=MappingProxyType(opts),
    )
    p = BpfProxier(cfg, netns=ns)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        v6 = [sp(n, ip, (BACKEND6,), family=IPFamily.V6) for n, ip in (("web6", VIP6), ("gap6", GAP_VIP6))]
        st = ProxyState(
            {IPFamily.V4: MappingProxyType({}), IPFamily.V6: MappingProxyType({x.name: x for x in v6})}, NODE, 1
        )
        res = p.sync(st, Changes(full=True))
        assert res.ok, res.error
        if peer:
            attach_with_peer(opts, ns, monkeypatch)
        else:  # the loader builds with the peer maps: the LRU path is built here without them
            from kproxy.backends.bpf import loader

            places = loader.places(opts, ns)
            assert len(loader.load_and_attach(loader.compile_programs(places, peer=False), places.cgroup)[0]) == 8
        fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("svc", IPFamily.V6)))
        try:
            slot = maps.lb_key(IPFamily.V6, GAP_VIP6, 80, 6, 1)
            assert maps.lookup(fd, slot, maps.LB_SERVICE.size) is not None
            maps.delete_batch(fd, [slot])
        finally:
            os.close(fd)
        out = in_cgroup(ns, opts["bpf_cgroup_path"], GAP6_CLIENT)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        got, seconds = r["gap6"]
        assert got == errno.EHOSTUNREACH and seconds < 0.5, r
        assert r["ok6"] == ["ok", [VIP6, 80], f"tcp6 {BACKEND6}"], r
        assert rev_entries(opts, IPFamily.V6) == (0 if peer else 1)
    finally:
        p.close()
        if peer:
            drop_peer(opts)
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()


PEER_CLIENT = f"""
import json, socket
r = {{"peers": []}}
for _ in range(5):
    s = socket.create_connection(("{VIP}", 80), timeout=2); r["peers"].append(list(s.getpeername())); s.recv(100)
    s.close()
m = socket.socket(socket.AF_INET6); m.setsockopt(socket.IPPROTO_IPV6, getattr(socket, "IPV6_V6ONLY", 26), 0)
m.settimeout(2); m.connect(("::ffff:{VIP}", 80)); r["mapped"] = list(m.getpeername()[:2]); m.close()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(2)
u.sendto(b"hi", ("{VIP}", 80)); d, a = u.recvfrom(100); r["udp"] = [d.decode(), list(a)]
print(json.dumps(r))
"""


def test_tcp_peers_live_in_socket_storage_when_the_peer_maps_are_given(
    place: tuple[str, dict[str, str]], servers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built with KP_PIN_PEER4/6 (socket storage for connected TCP sockets), getpeername still shows the ClusterIP
    (plain and mapped), UDP replies still come from it, and the TCP connections leave nothing in the reverse-NAT LRU:
    only the UDP socket's entry is there (without the peer maps every connect adds one)."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        res = p.sync(
            state(sp("web", VIP, (BACKEND_IP,)), sp("dns", VIP, (BACKEND_IP,), Protocol.UDP)), Changes(full=True)
        )
        assert res.ok, res.error
        attach_with_peer(opts, ns, monkeypatch)
        out = in_cgroup(ns, opts["bpf_cgroup_path"], PEER_CLIENT)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["peers"] == [[VIP, 80]] * 5
        assert r["mapped"] == [f"::ffff:{VIP}", 80]
        assert r["udp"] == ["udp hi", [VIP, 80]]
        assert rev_entries(opts, IPFamily.V4) == 1  # the UDP socket's; no TCP connection's
    finally:
        p.close()
        drop_peer(opts)


STICKY_VIP = "198.19.0.13"
STICKY_PORTS = tuple(range(8081, 8089))  # eight backends on the backend address, told apart by their port

STICKY_SERVERS = f"""
import socket, threading, time
def serve(port):
    t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("{BACKEND_IP}", port))
    t.listen()
    while True:
        c, a = t.accept(); c.sendall(str(port).encode()); c.close()
for port in {STICKY_PORTS!r}:
    threading.Thread(target=serve, args=(port,), daemon=True).start()
print("ready", flush=True); time.sleep(60)
"""


def sticky_client(count: int) -> str:
    """The client's network namespace cookie (SO_NETNS_COOKIE: the affinity key's client), then the ports answering
    ``count`` connects to the sticky service."""
    return f"""
import json, socket, struct
s = socket.socket(); cookie = struct.unpack("<Q", s.getsockopt(socket.SOL_SOCKET, 71, 8))[0]; s.close()
got = []
for _ in range({count}):
    c = socket.create_connection(("{STICKY_VIP}", 80), timeout=2); got.append(int(c.recv(10))); c.close()
print(json.dumps({{"cookie": cookie, "ports": got}}))
"""


def test_clientip_affinity_keeps_a_backend_that_a_scale_down_moved_to_another_slot(
    place: tuple[str, dict[str, str]],
) -> None:
    """A scale-down moves the last slot's backend into the slot freed (``planner._stable_slots``). Its clients keep
    it (upstream keeps affinity per endpoint): the program finds it in its new slot and the entry names that slot.
    Set up by hand each round: the client's affinity entry names the backend of the last of 8 slots; then the
    backend of slot 1 goes. Three rounds: a program that chose again would keep the backend in only 1 of 7 each."""
    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf.proxier import BpfProxier
    from kproxy.model import Endpoint

    ns, opts = place
    pins = Path(opts["bpf_pin_path"])
    eps = {port: Endpoint(BACKEND_IP, port, node_name="node-a", is_local=True) for port in STICKY_PORTS}

    def port_state(ports: list[int], generation: int) -> Any:
        chosen = tuple(eps[p] for p in ports)
        svc = sp(  # ClientIP affinity with upstream's default timeout
            "sticky",
            STICKY_VIP,
            (),
            affinity_timeout=10800,
            cluster_endpoints=chosen,
            local_endpoints=chosen,
            has_any_endpoints=True,
        )
        return state(svc, generation=generation)

    def client(count: int) -> dict[str, Any]:
        out = in_cgroup(ns, opts["bpf_cgroup_path"], sticky_client(count))
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def slots(svc_fd: int, be_fd: int) -> tuple[list[int], dict[int, int], int]:
        """(backend ids of slots 1..count, backend id -> port, rev_nat_id) as the maps hold them."""
        master = maps.lookup(svc_fd, maps.lb_key(IPFamily.V4, STICKY_VIP, 80, 6, 0), maps.LB_SERVICE.size)
        assert master is not None
        _, _, count, rev, flags = maps.decode_service(master)
        assert flags & maps.F_AFFINITY
        ids = []
        for i in range(1, count + 1):
            raw = maps.lookup(svc_fd, maps.lb_key(IPFamily.V4, STICKY_VIP, 80, 6, i), maps.LB_SERVICE.size)
            assert raw is not None
            ids.append(maps.decode_service(raw)[0])
        ports = {}
        for bid in ids:
            raw = maps.lookup(be_fd, maps.backend_key(bid), maps.LB4_BACKEND.size)
            assert raw is not None
            ports[bid] = maps.decode_backend(IPFamily.V4, raw)[1]
        return ids, ports, rev

    with ns_script(ns, STICKY_SERVERS):
        p = BpfProxier(_config(opts), netns=ns)
        svc_fd = be_fd = aff_fd = -1
        try:
            p.start()
            ports = list(STICKY_PORTS)
            assert p.sync(port_state(ports, 1), Changes(full=True)).ok
            svc_fd = maps.obj_get(str(pins / maps.pin_name("svc", IPFamily.V4)))
            be_fd = maps.obj_get(str(pins / maps.pin_name("be", IPFamily.V4)))
            aff_fd = maps.obj_get(str(pins / maps.pin_name("aff", IPFamily.V4)))
            cookie = client(0)["cookie"]
            for rnd in range(3):
                ids, by_id, rev = slots(svc_fd, be_fd)
                assert len(ids) == 8
                last = ids[-1]
                key = maps.AFF_KEY.pack(cookie, rev, 0)
                maps.update_batch(aff_fd, [key], [maps.AFF_VAL.pack(int(time.monotonic()), last, 8)])
                assert client(3)["ports"] == [by_id[last]] * 3, "the entry written by hand is honoured"
                gone = by_id[ids[0]]
                ports.remove(gone)
                assert p.sync(port_state(ports, 2 + 2 * rnd), Changes(full=True)).ok
                moved, _, _ = slots(svc_fd, be_fd)
                assert len(moved) == 7 and moved[0] == last, f"round {rnd}: the last backend moved to slot 1"
                assert client(10)["ports"] == [by_id[last]] * 10, f"round {rnd}: affinity kept through the move"
                entry = maps.lookup(aff_fd, key, maps.AFF_VAL.size)
                assert entry is not None and maps.AFF_VAL.unpack(entry)[1:] == (last, 1)  # it names the new slot
                ports.append(gone)  # back for the next round: into the last slot, the next round's affine one
                assert p.sync(port_state(ports, 3 + 2 * rnd), Changes(full=True)).ok
        finally:
            for fd in (svc_fd, be_fd, aff_fd):
                if fd >= 0:
                    os.close(fd)
            p.close()
