"""The bpf mode's places, peer storage and companion table on the real kernel (the review of bpf-fix2): connected UDP
sockets ended when their backend goes even after the reverse-NAT LRU lost their entry; the programs built with socket
storage for connected TCP peers (pinned ``peer4_v3``/``peer6_v3``, known to the check and to cleanup); NodePorts of
the companion table only on ``--nodeport-addresses`` and never on loopback; the companion table only while some
service needs it; a changed ``--bpf-cgroup-path`` leaving no programs on the old cgroup; the places record honoured
only by the namespace it belongs to (inodes are reused, the cookie is not).

Each test makes a namespace ``kpz-bpf-…``, a cgroup in a cgroup2 mount of its own and a pin folder of its own, all
removed in the fixture's finalizer, also on failure. Helpers (service ports, config, the cgroup runner, the echo
servers) come from test_bpf_backend.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, Protocol, ProxyState, ServicePort
from kproxy.proxier import LocalProbe

from .bpfplace import bpf_place
from .test_bpf_backend import BACKEND_IP, SERVERS, UDP_CLIENT, UDP_SERVERS, _config, in_cgroup, sp, spn, state

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-kpz-test/cgroup2")
PREFIX = "kpz-bpf-"


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    """A namespace with the backend address on lo, a cgroup and a pin folder of the test's own; all removed after."""
    with bpf_place(PREFIX, CG_MOUNT, (BACKEND_IP,)) as got:
        yield got


def popen(ns: str, code: str, cgroup: str | None = None) -> subprocess.Popen[str]:
    def pre() -> None:
        if cgroup is not None:
            Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))

    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        preexec_fn=pre,  # noqa: PLW1509 - a client must run inside the cgroup from its start
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def stop(*procs: subprocess.Popen[str] | None) -> None:
    for proc in procs:
        if proc is not None:
            proc.kill()
            proc.wait(10)
            for f in (proc.stdout, proc.stdin):
                if f is not None:
                    f.close()


def rev_count(opts: dict[str, str], family: IPFamily = IPFamily.V4) -> int:
    from kproxy.backends.bpf import maps

    fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("rev", family)))
    try:
        return len(list(maps.lookup_all(fd, *maps.key_sizes(family)["rev"])))
    finally:
        os.close(fd)


def clear_rev(opts: dict[str, str], family: IPFamily = IPFamily.V4) -> int:
    """Delete every reverse-NAT entry (what the LRU does to an old entry when other sockets fill it); how many."""
    from kproxy.backends.bpf import maps

    fd = maps.obj_get(str(Path(opts["bpf_pin_path"]) / maps.pin_name("rev", family)))
    try:
        keys = [k for k, _v in maps.lookup_all(fd, *maps.key_sizes(family)["rev"])]
        if keys:
            maps.delete_batch(fd, keys)
        return len(keys)
    finally:
        os.close(fd)


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


def test_a_connected_udp_socket_is_ended_even_when_its_reverse_entry_is_gone(
    place: tuple[str, dict[str, str]],
) -> None:
    """cilium#27300 once the LRU forgot the socket: the reverse-NAT map is a hint, not a filter. The client's entry
    is deleted by hand (as 65,536 later translations would push it out); the backend's removal still ends it."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    for ip in ("198.18.214.1", "198.18.214.2"):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "lo"], check=True, timeout=30)
    servers = popen(ns, UDP_SERVERS)
    p = BpfProxier(_config(opts), netns=ns)
    client = None
    try:
        assert servers.stdout is not None and servers.stdout.readline().strip() == "ready"
        p.start()
        assert p.sync(dns("198.18.214.1", 1), Changes(full=True)).ok
        client = popen(ns, UDP_CLIENT, opts["bpf_cgroup_path"])
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "first 198.18.214.1"
        assert clear_rev(opts) >= 1 and rev_count(opts) == 0
        res = p.sync(dns("198.18.214.2", 2), Changes(full=False, services=frozenset({spn("dns", Protocol.UDP)})))
        assert res.ok
        assert p.last_reap is not None and p.last_reap.result(timeout=30) >= 1
        client.stdin.write("go\n")
        client.stdin.flush()
        lines = [client.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("ended"), lines
        assert lines[1] == "after 198.18.214.2", lines
    finally:
        stop(client, servers)
        p.close()


TCP_CLIENT = """
import json, socket
r = []
for _ in range(3):
    s = socket.create_connection(("198.19.0.10", 80), timeout=3)
    r.append([list(s.getpeername()), s.recv(100).decode()]); s.close()
print(json.dumps(r))
"""


def test_the_programs_keep_tcp_peers_in_socket_storage_and_cleanup_removes_them(
    place: tuple[str, dict[str, str]],
) -> None:
    """``start`` builds the programs with the peer maps (bcc pins ``peer4_v3``/``peer6_v3``): TCP connections show the
    ClusterIP as their peer and leave nothing in the reverse-NAT LRU; the check before each sync finds the programs
    reading the pinned maps (peer maps included: no re-attach); a restart keeps them; cleanup leaves nothing."""
    from kproxy.backends.bpf import loader, maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    server = popen(ns, SERVERS)
    p = BpfProxier(_config(opts), netns=ns)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        p.start()
        pin = Path(opts["bpf_pin_path"])
        assert all((pin / maps.pin_name("peer", f)).exists() for f in (IPFamily.V4, IPFamily.V6))
        assert p.sync(state(sp("web", "198.19.0.10", (BACKEND_IP,))), Changes(full=True)).ok
        out = in_cgroup(ns, opts["bpf_cgroup_path"], TCP_CLIENT)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert [x[0] for x in r] == [["198.19.0.10", 80]] * 3 and all(x[1].startswith("tcp ") for x in r)
        assert rev_count(opts) == 0  # the peers are in socket storage, not in the LRU
        places = loader.places(opts, ns)
        pinned = loader.pinned_ids(places)
        assert ("peer", IPFamily.V4) in pinned and ("peer", IPFamily.V6) in pinned
        assert loader.programs_problem(places, pinned, (IPFamily.V4, IPFamily.V6)) is None
        p._check_kernel_now()
        assert not p._reattach
        ids = sorted(d["id"] for d in loader.ours(loader.attached(places.cgroup)))
    finally:
        p.close()
        stop(server)
    again = BpfProxier(_config(opts), netns=ns)
    try:
        again.start()
        assert sorted(d["id"] for d in loader.ours(loader.attached(places.cgroup))) == ids  # same build: kept
    finally:
        again.close()
    BpfProxier.cleanup_leftovers(_config(opts), netns=ns)
    assert BpfProxier.remnants(LocalProbe(ns, MappingProxyType(opts))) == []
    assert not pin.exists()


NODEPORT_CLIENT = """
import json, socket, sys
r = {}
for addr in sys.argv[1:]:
    try:
        s = socket.create_connection((addr, 30080), timeout=2); r[addr] = s.recv(100).decode()[:3]; s.close()
    except OSError as e:
        r[addr] = e.errno
print(json.dumps(r))
"""


def _outside(ns: str, *addrs: str) -> dict[str, object]:
    """Connect from a process outside the cgroup (its sockets are not translated: the companion table's path)."""
    res = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", NODEPORT_CLIENT, *addrs],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _nft(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True, timeout=30)


def test_nodeports_of_the_companion_table_follow_nodeport_addresses_and_never_loopback(
    place: tuple[str, dict[str, str]], servers_here: None
) -> None:
    """The companion table's NodePort rule matches ``@nodeport-cidrs`` as well as ``fib daddr type local``: with
    ``--nodeport-addresses 198.18.216.0/24`` only that address answers; with none, every local address but
    127.0.0.0/8 does; verify agrees (no drift) in both."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    for ip in ("198.18.216.1", "198.18.217.1"):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "lo"], check=True, timeout=30)
    st = state(sp("np", "198.19.0.40", (BACKEND_IP,), node_port=30080))
    addrs = ("198.18.216.1", "198.18.217.1", "127.0.0.1")
    refused = errno.ECONNREFUSED
    for given, want in (
        (("198.18.216.0/24",), {"198.18.216.1": "tcp", "198.18.217.1": refused, "127.0.0.1": refused}),
        ((), {"198.18.216.1": "tcp", "198.18.217.1": "tcp", "127.0.0.1": refused}),
    ):
        cfg = ProxyConfig(
            mode="bpf",
            hostname_override="node-a",
            ip_families=(IPFamily.V4,),
            nodeport_addresses=given,
            backend_options=MappingProxyType(opts),
        )
        p = BpfProxier(cfg, netns=ns)
        try:
            res = p.sync(st, Changes(full=True))
            assert res.ok, res.error
            assert _outside(ns, *addrs) == want, given
            listing = _nft(ns, "list", "table", "ip", "kproxy-bpf").stdout
            assert "daddr @nodeport-cidrs fib daddr type local" in listing
            assert p.verify(st)["drift"] == 0
        finally:
            p.close()


@pytest.fixture
def servers_here(place: tuple[str, dict[str, str]]) -> Iterator[None]:
    ns, _ = place
    proc = popen(ns, SERVERS)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        stop(proc)


OLD_LAYOUT = """add table ip kproxy-bpf
add map ip kproxy-bpf svc { type ipv4_addr . inet_proto . inet_service : verdict ; }
add map ip kproxy-bpf nodeports { type inet_proto . inet_service : verdict ; }
add chain ip kproxy-bpf kp-reject
add chain ip kproxy-bpf services { comment "kproxy-bpf-nft-1" ; }
add chain ip kproxy-bpf nat-prerouting { type nat hook prerouting priority dstnat ; policy accept ; }
add chain ip kproxy-bpf nat-output { type nat hook output priority -100 ; policy accept ; }
add chain ip kproxy-bpf nat-postrouting { type nat hook postrouting priority srcnat ; policy accept ; }
add rule ip kproxy-bpf kp-reject reject
add rule ip kproxy-bpf services ip daddr . meta l4proto . th dport vmap @svc
add rule ip kproxy-bpf services fib daddr type local meta l4proto . th dport vmap @nodeports
add rule ip kproxy-bpf nat-prerouting jump services
add rule ip kproxy-bpf nat-output jump services
add rule ip kproxy-bpf nat-postrouting ct label 127 masquerade fully-random
add element ip kproxy-bpf nodeports { tcp . 30080 : drop }
"""


def test_a_companion_table_of_the_older_layout_is_written_again(
    place: tuple[str, dict[str, str]], servers_here: None
) -> None:
    """A table an older kproxy left (its NodePort rule without the address match) is replaced whole at the first
    full sync: loopback stops reaching the NodePort."""
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"], input=OLD_LAYOUT, capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    st = state(sp("np", "198.19.0.40", (BACKEND_IP,), node_port=30080))
    p = BpfProxier(_config(opts), netns=ns)
    try:
        assert p.sync(st, Changes(full=True)).ok
        listing = _nft(ns, "list", "table", "ip", "kproxy-bpf").stdout
        assert "@nodeport-cidrs" in listing and "tcp . 30080 : drop" not in listing, listing
        assert _outside(ns, "127.0.0.1") == {"127.0.0.1": errno.ECONNREFUSED}
        assert p.verify(st)["drift"] == 0
    finally:
        p.close()


def test_the_companion_table_exists_only_while_a_service_needs_it(place: tuple[str, dict[str, str]]) -> None:
    """Plain ClusterIPs with endpoints never make the table; a NodePort (or a service without endpoints) makes it,
    in a partial sync; the last such service going (partial or full sync) removes it again, and with it the nat
    chains that turn conntrack on for every packet of the namespace. The check before each sync and verify agree."""
    from kproxy.backends.bpf import companion
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    web = sp("web", "198.19.0.10", (BACKEND_IP,))
    np_ = sp("np", "198.19.0.40", (BACKEND_IP,), node_port=30080)
    empty = sp("empty", "198.19.0.11", ())
    p = BpfProxier(_config(opts), netns=ns)

    def present() -> bool:
        with closing(companion.open_nft(ns)) as nft:
            return companion.table_present(nft, IPFamily.V4)

    def partial(st: ProxyState, *names: str) -> None:
        res = p.sync(st, Changes(full=False, services=frozenset(spn(n) for n in names)))
        assert res.ok, res.error
        p._check_kernel_now()
        assert not p._owed, "the check took the table's absence for a flush"
        assert p.verify(st)["drift"] == 0

    try:
        assert p.sync(state(web), Changes(full=True)).ok
        assert not present()
        partial(state(web, np_, generation=2), "np")
        assert present()
        partial(state(web, generation=3), "np")
        assert not present()
        partial(state(web, empty, generation=4), "empty")
        assert present()
        assert p.sync(state(web, generation=5), Changes(full=True)).ok
        assert not present()
        assert p.verify(state(web, generation=5))["drift"] == 0
    finally:
        p.close()
    # a new process adopting a table nobody needs any more removes it at its first full sync
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input="add table ip kproxy-bpf\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    q = BpfProxier(_config(opts), netns=ns)
    try:
        assert q.sync(state(web, generation=6), Changes(full=True)).ok
        with closing(companion.open_nft(ns)) as nft:
            assert not companion.table_present(nft, IPFamily.V4)
    finally:
        q.close()


def test_a_changed_cgroup_leaves_no_programs_on_the_old_one(place: tuple[str, dict[str, str]]) -> None:
    """A kproxy restarted with another ``--bpf-cgroup-path`` detaches its programs from the cgroup the record names;
    cleanup without options (another mode's start-up) then removes everything, record included."""
    from kproxy.backends.bpf import cleanup, loader
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    old_cg = Path(opts["bpf_cgroup_path"])
    new_cg = Path(f"{old_cg}-b")
    new_cg.mkdir()
    first = BpfProxier(_config(opts), netns=ns)
    try:
        first.start()
    finally:
        first.close()
    assert len(loader.ours(loader.attached(old_cg))) == 8
    moved = {**opts, "bpf_cgroup_path": str(new_cg)}
    second = BpfProxier(_config(moved), netns=ns)
    try:
        second.start()
        assert len(loader.ours(loader.attached(new_cg))) == 8
        assert loader.ours(loader.attached(old_cg)) == []
        doc = json.loads(cleanup._record_path(ns).read_text())
        assert [x["cgroup"] for x in doc["places"]] == [str(new_cg), str(old_cg)]
    finally:
        second.close()
    cleanup.cleanup_leftovers(ProxyConfig(), netns=ns)
    assert loader.ours(loader.attached(new_cg)) == []
    assert not Path(opts["bpf_pin_path"]).exists()
    assert not cleanup._record_path(ns).exists()


def test_a_record_of_another_namespace_with_the_same_inode_is_left_alone(place: tuple[str, dict[str, str]]) -> None:
    """The record is named by the namespace's inode, which the kernel reuses: one whose cookie is not this
    namespace's (written by a kproxy of a namespace that is gone) names places that are not this namespace's, and
    cleanup and remnants without options leave them (and the record) alone."""
    from kproxy.backends.bpf import cleanup, loader, maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
    finally:
        p.close()
    path = cleanup._record_path(ns)
    doc = json.loads(path.read_text())
    assert doc["netns_cookie"] == loader.netns_cookie(ns)
    # another namespace's record (the older layout's keys too, so a kproxy that ignores cookies would act on it)
    doc["netns_cookie"] += 1
    doc.update(doc["places"][0])
    path.write_text(json.dumps(doc))
    assert BpfProxier.remnants(LocalProbe(ns, MappingProxyType({}))) == []
    cleanup.cleanup_leftovers(ProxyConfig(), netns=ns)
    cg = Path(opts["bpf_cgroup_path"])
    assert len(loader.ours(loader.attached(cg))) == 8
    assert (Path(opts["bpf_pin_path"]) / maps.pin_name("svc", IPFamily.V4)).exists()
    assert path.exists()


def test_start_removes_the_pins_of_an_older_map_version(place: tuple[str, dict[str, str]]) -> None:
    """An upgrade that renames the maps (``maps.MAPS_VERSION``) leaves none of the old maps pinned once nothing reads
    them: at start when no older program is attached (else after the first sync: test_bpf_restart.py); a pin that is
    not one of kproxy's map names stays."""
    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf.proxier import BpfProxier

    ns, opts = place
    pins = Path(opts["bpf_pin_path"])
    pins.mkdir(parents=True, exist_ok=True)
    for name in ("svc4_v1", "be6_v1", "someone-elses"):
        fd = maps.create_map(maps.MAP_HASH, 4, 4, 16, maps.BPF_F_NO_PREALLOC)
        try:
            maps.obj_pin(fd, str(pins / name))
        finally:
            os.close(fd)
    p = BpfProxier(_config(opts), netns=ns)
    try:
        p.start()
        assert not (pins / "svc4_v1").exists() and not (pins / "be6_v1").exists()
        assert (pins / "someone-elses").exists()
        assert all((pins / maps.pin_name(r, IPFamily.V4)).exists() for r in maps.ROLES)
    finally:
        p.close()
        (pins / "someone-elses").unlink(missing_ok=True)
