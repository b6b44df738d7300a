"""``verify`` on the bpf mode, and the repair of what it finds: a real ``BpfProxier`` (programs compiled by bcc and
attached to a cgroup of the test's own, maps pinned in a folder of its own, the companion table in a throwaway
namespace ``kpf-vt-…``). Verify reads the kernel (the pinned maps through the pins, the cgroup's attachments, the
companion table's chains and rules), never kproxy's memory or its own map fds. It must name the service for a
service-map element deleted by hand, a backend element changed by hand, a service map emptied, the companion table
flushed (rules gone, chains and elements left) or deleted, a program detached, and all of it at once (another
process's ``cleanup``, as ``kproxy soak``'s flush fault does); the periodic syncs put it back (the cheap check
every second for what vanished, the read-back for what was edited in place) and verify is clean again, with real
connections through the ClusterIP answered afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

from .bpfplace import bpf_place, ns_script

pytestmark = pytest.mark.root

CG_MOUNT = Path("/run/kproxy-bpf-test/cgroup2")
POD = "198.18.220.1"
NODE = NodeInfo("node-a", addresses=(POD,))
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
B = ServicePortName("ns1", "b", "http", Protocol.TCP)
C = ServicePortName("ns1", "c", "http", Protocol.TCP)
KEYS = {A: "ns1/a:http/TCP", B: "ns1/b:http/TCP", C: "ns1/c:http/TCP"}


def _ep(ip: str) -> Endpoint:
    return Endpoint(ip, 8080, node_name="node-a", is_local=True)


SP_A = ServicePort(  # a plain ClusterIP: socket frontends only, nothing in the companion table
    A, IPFamily.V4, "198.19.1.1", 80, cluster_endpoints=(_ep(POD), _ep("198.18.220.2")),
    local_endpoints=(_ep(POD), _ep("198.18.220.2")), has_any_endpoints=True,
)  # fmt: skip
SP_B = ServicePort(  # a NodePort: a companion chain (masquerade, DNAT) and a nodeports element
    B, IPFamily.V4, "198.19.1.2", 80, node_port=30080, cluster_endpoints=(_ep(POD),), local_endpoints=(_ep(POD),),
    has_any_endpoints=True,
)  # fmt: skip
SP_C = ServicePort(C, IPFamily.V4, "198.19.1.3", 80)  # no endpoints: reject (socket flag and a companion element)
STATE = ProxyState({IPFamily.V4: MappingProxyType({A: SP_A, B: SP_B, C: SP_C})}, NODE, generation=1)
PERIODIC = Changes(full=False, services=frozenset())  # what the runner's periodic sync hands over: nothing changed


@pytest.fixture
def place() -> Iterator[tuple[str, dict[str, str]]]:
    """A namespace with the pod address on lo, a cgroup and a pin folder of the test's own; all removed after."""
    with bpf_place("kpf-vt-", CG_MOUNT, (POD,)) as got:
        yield got


SERVER = f"""
import socket, threading, time
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("{POD}", 8080)); t.listen()
def serve():
    while True:
        c, a = t.accept(); c.sendall(b"pod"); c.close()
threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True); time.sleep(120)
"""

CLIENT = """
import json, socket
try:
    s = socket.create_connection(("198.19.1.2", 80), timeout=2); r = [s.recv(10).decode(), list(s.getpeername())]
except OSError as e:
    r = [type(e).__name__]
print(json.dumps(r))
"""


@pytest.fixture
def server(place: tuple[str, dict[str, str]]) -> Iterator[None]:
    with ns_script(place[0], SERVER):
        yield


def connect_b(ns: str, cg: str) -> list[object]:
    """A client in the test's cgroup connects to B's ClusterIP: ``["pod", [ClusterIP, 80]]`` when connect4 and
    getpeername4 translated it, else the error's name."""

    def pre() -> None:
        Path(cg, "cgroup.procs").write_text(str(os.getpid()))

    res = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT],
        preexec_fn=pre,  # noqa: PLW1509 - the only way to start a process inside a cgroup before it runs
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return list(json.loads(res.stdout))


def nft(ns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def drifted(report: dict[str, object]) -> set[str]:
    services = report["services"]
    assert isinstance(services, dict)
    return set(services)


def why(report: dict[str, object], key: str) -> str:
    services = report["services"]
    assert isinstance(services, dict)
    return str(services[key]["IPv4"])


def assert_clean(report: dict[str, object]) -> None:
    assert report["drift"] == 0 and not report["services"] and not report["extra"] and not report["errors"], report


def edit_a_backend(svc: int, be: int, to: str) -> None:
    """Service a's first backend element rewritten by hand to ``to``:8080 (what someone with ``bpftool`` could do);
    the backend array's first entries hold this state's few backends (they have the lowest ids)."""
    from kproxy.backends.bpf import decode, maps

    ks = maps.key_sizes(IPFamily.V4)
    index, _ = decode.index_from_raw(
        IPFamily.V4, maps.lookup_raw(svc, *ks["svc"]), maps.lookup_array(be, *ks["be"], 64)
    )
    slot = maps.lookup(svc, maps.lb_key(IPFamily.V4, "198.19.1.1", 80, 6, 1), ks["svc"][1])
    assert slot is not None
    bid = maps.decode_service(slot)[0]
    assert bid in index.backends
    maps.update_batch(be, [maps.backend_key(bid)], [maps.backend_value(IPFamily.V4, to, 8080, 6)])


def test_verify_names_what_was_flushed_and_the_periodic_sync_repairs_it(
    place: tuple[str, dict[str, str]], server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vanished (a program detached, the companion table deleted or flushed, pins and programs and table all
    removed by another process's cleanup): verify names the services at once, and a periodic sync puts it back
    through the cheap check (the read-back schedule left at its default: this is not a read-back)."""
    from kproxy.backends.bpf import loader, maps, proxier
    from kproxy.backends.bpf.proxier import BpfProxier

    monkeypatch.setattr(BpfProxier, "CHECK_INTERVAL_S", 0.0)  # the check's one-second rate limit: not what is tested
    assert proxier.KERNEL_READ_S >= 20
    ns, opts = place
    cg = opts["bpf_cgroup_path"]
    config = ProxyConfig(mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=opts)
    p = BpfProxier(config, netns=ns)
    try:
        p.start()
        assert p.sync(STATE, Changes(full=True)).ok
        assert_clean(p.verify(STATE))
        assert connect_b(ns, cg) == ["pod", ["198.19.1.2", 80]]

        # a program detached by someone: the maps are right, but no socket is translated; every service is named
        progs = [d for d in loader.ours(loader.attached(Path(cg))) if d["name"] == "kp_connect4"]
        loader.detach_ids(Path(cg), progs)
        report = p.verify(STATE)
        assert drifted(report) == set(KEYS.values()), report
        assert "kp_connect4 is not attached" in why(report, KEYS[A]), report
        assert connect_b(ns, cg) != ["pod", ["198.19.1.2", 80]]
        assert p.sync(STATE, PERIODIC).ok  # the check notices, the programs are attached again after the sync
        assert_clean(p.verify(STATE))
        assert connect_b(ns, cg) == ["pod", ["198.19.1.2", 80]]

        # the companion table deleted: the services with a companion part (b: NodePort, c: reject) are named
        nft(ns, "delete", "table", "ip", "kproxy-bpf")
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[B], KEYS[C]}, report
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))

        # the companion table flushed: chains and elements are left, no rule; verify reads the rules
        nft(ns, "flush", "table", "ip", "kproxy-bpf")
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[B], KEYS[C]}, report
        assert "holds 0 rules" in why(report, KEYS[C]), report

        # another process's cleanup (kproxy soak's flush fault): programs detached, pins removed, tables deleted; the
        # running kproxy still holds fds of the unpinned maps, which verify must not read
        BpfProxier.cleanup_leftovers(config, netns=ns)
        report = p.verify(STATE)
        assert {why(report, k) for k in KEYS.values()} == {"missing"}, report
        assert connect_b(ns, cg) != ["pod", ["198.19.1.2", 80]]
        assert p.sync(STATE, PERIODIC).ok  # new maps pinned and filled, the table written, then the programs
        assert_clean(p.verify(STATE))
        assert connect_b(ns, cg) == ["pod", ["198.19.1.2", 80]]
        assert "vmap @svc" in nft(ns, "list", "chain", "ip", "kproxy-bpf", "services")
        assert all(Path(opts["bpf_pin_path"], maps.pin_name(r, f)).exists() for r in maps.ROLES for f in IPFamily)
    finally:
        p.close()


def test_verify_names_what_was_edited_by_hand_and_the_read_back_repairs_it(
    place: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was edited in place (a service-map element deleted, a backend element changed, a map emptied, the table
    flushed): verify names the service at once; the periodic sync's read-back of the kernel puts it back (its
    schedule, every ``KERNEL_READ_S``, is shortened to every sync here)."""
    from kproxy.backends.bpf import maps, proxier
    from kproxy.backends.bpf.proxier import BpfProxier

    monkeypatch.setattr(BpfProxier, "CHECK_INTERVAL_S", 0.0)
    ns, opts = place
    config = ProxyConfig(mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=opts)
    p = BpfProxier(config, netns=ns)
    pins = Path(opts["bpf_pin_path"])
    ks = maps.key_sizes(IPFamily.V4)
    try:
        assert p.sync(STATE, Changes(full=True)).ok
        assert_clean(p.verify(STATE))
        svc = maps.obj_get(str(pins / maps.pin_name("svc", IPFamily.V4)))
        be = maps.obj_get(str(pins / maps.pin_name("be", IPFamily.V4)))
        # within the read-back interval a periodic sync trusts kproxy's index: it must not hide drift from verify
        maps.delete_batch(svc, [maps.lb_key(IPFamily.V4, "198.19.1.1", 80, 6, 0)])  # a's master entry
        assert p.sync(STATE, PERIODIC).ok
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[A]} and why(report, KEYS[A]) == "missing", report

        monkeypatch.setattr(proxier, "KERNEL_READ_S", 0.0)  # from here every periodic sync reads the kernel back
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))

        # a's backend element changed by hand: connections would go to another pod
        edit_a_backend(svc, be, "198.18.220.9")
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[A]} and "198.18.220.9" in why(report, KEYS[A]), report
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))

        # a's backend entry zeroed (what a delete is in the backend array): drift, and the next sync writes it again
        slot = maps.lookup(svc, maps.lb_key(IPFamily.V4, "198.19.1.1", 80, 6, 1), ks["svc"][1])
        assert slot is not None
        maps.update_batch(be, [maps.backend_key(maps.decode_service(slot)[0])], maps.zero_values(1, ks["be"][1]))
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[A]}, report
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))

        # the service map emptied: every service is named (a: missing; b and c keep their companion elements)
        keys = [k for k, _ in maps.lookup_all(svc, *ks["svc"])]
        maps.delete_batch(svc, keys)
        report = p.verify(STATE)
        assert drifted(report) == set(KEYS.values()) and why(report, KEYS[A]) == "missing", report
        assert why(report, KEYS[B]) == "different: frontend 198.19.1.2:80/6 missing", report
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))

        # the companion table flushed (in place: no check notices a table that is still there)
        nft(ns, "flush", "table", "ip", "kproxy-bpf")
        report = p.verify(STATE)
        assert drifted(report) == {KEYS[B], KEYS[C]}, report
        assert p.sync(STATE, PERIODIC).ok
        assert_clean(p.verify(STATE))
        assert "vmap @svc" in nft(ns, "list", "chain", "ip", "kproxy-bpf", "services")
        b_chain = next(c for c, _ in p.applied_fragments(IPFamily.V4)[B].nft.chains)
        assert "dnat" in nft(ns, "list", "chain", "ip", "kproxy-bpf", b_chain)
        os.close(svc)
        os.close(be)
    finally:
        p.close()


def test_the_read_behind_finds_an_edit_in_place_off_the_sync_path_and_a_full_batch_repairs_it(
    place: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's read-behind (``kproxy.readbehind``) reads the real maps beside the syncs: a clean read tells the
    backend it may trust its index for another interval; a backend element changed by hand is named, a repair is
    asked for, and the full batch that follows reads the maps (not the index, which the read told it to distrust)
    and puts the element back. With a read-behind, a due read-back no longer makes a periodic sync a full one."""
    import threading

    from kproxy.backends.bpf import maps, proxier
    from kproxy.backends.bpf.proxier import BpfProxier
    from kproxy.readbehind import ReadBehind

    monkeypatch.setattr(BpfProxier, "CHECK_INTERVAL_S", 0.0)
    assert proxier.KERNEL_READ_S >= 20  # the index is trusted between read-backs: the repair must not trust it
    ns, opts = place
    config = ProxyConfig(mode="bpf", hostname_override="node-a", ip_families=(IPFamily.V4,), backend_options=opts)
    p = BpfProxier(config, netns=ns)
    pins = Path(opts["bpf_pin_path"])
    asked: list[str] = []

    def repair(families: frozenset[IPFamily], why: str) -> None:
        asked.append(why)
        for fam in families:
            p.request_full(fam)

    rb = ReadBehind(p.ledger, threading.Lock(), repair)
    p.ledger.read_behind = True  # as ``rb.start()`` does, without its thread: the test runs the reads itself
    try:
        assert p.sync(STATE, Changes(full=True)).ok
        out = rb.once(IPFamily.V4)
        assert out is not None and out.compared and out.differences == () and asked == [], out
        assert not p.readback_due(IPFamily.V4)

        svc = maps.obj_get(str(pins / maps.pin_name("svc", IPFamily.V4)))
        be = maps.obj_get(str(pins / maps.pin_name("be", IPFamily.V4)))
        edit_a_backend(svc, be, "198.18.220.9")
        out = rb.once(IPFamily.V4)
        assert out is not None and len(out.differences) == 1, out
        assert out.differences[0].startswith(KEYS[A]) and "198.18.220.9" in out.differences[0], out
        assert len(asked) == 1
        result = p.sync(STATE, PERIODIC)
        assert result.ok and result.full
        assert_clean(p.verify(STATE))
        out = rb.once(IPFamily.V4)
        assert out is not None and out.differences == (), out

        monkeypatch.setattr(proxier, "KERNEL_READ_S", 0.0)  # a read-back is due at every sync from here
        assert p.readback_due(IPFamily.V4)
        result = p.sync(STATE, PERIODIC)
        assert result.ok and not result.full  # the read-behind serves it, not the sync
        p.ledger.read_behind = False
        result = p.sync(STATE, PERIODIC)
        assert result.ok and result.full  # without one, the old way: the due read-back is a full batch
        os.close(svc)
        os.close(be)
    finally:
        p.close()
