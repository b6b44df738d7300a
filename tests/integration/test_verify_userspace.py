"""``verify`` on the userspace mode: its table read back (elements, chains, the fixed rules) together with the
namespace's listening sockets from the kernel and what the data path serves on each, diffed against what the state
wants. It must find a redirect rule deleted by hand, a port element changed by hand so a ClusterIP reaches another
service's proxy socket, a verdict changed by hand, a stray element, a table someone flushed (rules gone, maps left)
or deleted, a proxy socket closed by hand (``ss -K``) and one whose port another process took; and say nothing once
a sync has repaired them (a real userspace proxier, in a namespace of the test's own)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from kproxy.backends.userspace import render
from kproxy.backends.userspace.proxier import UserspaceProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nftkernel import available

from .scratch import scratch_netns

pytestmark = pytest.mark.root

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
B = ServicePortName("ns1", "b", "http", Protocol.TCP)
SP_A = ServicePort(
    A, IPFamily.V4, "198.19.0.1", 80, cluster_endpoints=(Endpoint("198.18.1.1", 80), Endpoint("198.18.1.2", 80)),
    has_any_endpoints=True,
)  # fmt: skip
SP_B = ServicePort(
    B, IPFamily.V4, "198.19.0.2", 80, node_port=30080, cluster_endpoints=(Endpoint("198.18.1.3", 80),),
    has_any_endpoints=True,
)  # fmt: skip
STATE = ProxyState({IPFamily.V4: MappingProxyType({A: SP_A, B: SP_B})}, NODE, generation=1)
KA, KB = "ns1/a:http/TCP", "ns1/b:http/TCP"


@pytest.fixture
def netns() -> Iterator[str]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with scratch_netns("kpt-vfu-", lo_up=True) as name:
        yield name


def nft(netns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nft", *args], check=True, timeout=30, capture_output=True, text=True
    ).stdout


def port_of(netns: str, key: str) -> int:
    """The proxy port the kernel's service-ports map names for ``key`` (read from the kernel, not the proxier)."""
    out = nft(netns, "list", "map", "ip", render.TABLE, render.SERVICE_PORTS)
    m = re.search(re.escape(key) + r' comment "[^"]*" : (\d+)', out)
    assert m, out
    return int(m.group(1))


def clean(p: UserspaceProxier) -> None:
    report = p.verify(STATE)
    assert report["drift"] == 0 and not report["services"] and not report["extra"] and not report["errors"], report


def drifted(p: UserspaceProxier) -> dict[str, str]:
    report = p.verify(STATE)
    assert not report["errors"], report
    return {k: v["IPv4"] for k, v in report["services"].items()}


def test_verify_finds_hand_made_drift_and_a_sync_repairs_it(netns: str) -> None:
    config = ProxyConfig(cluster_cidrs=("198.18.0.0/16",), ip_families=(IPFamily.V4,), sync_period=1.0)
    p = UserspaceProxier(config, netns=netns)
    try:
        p.start()
        assert p.sync(STATE, Changes(full=True)).ok
        clean(p)
        a_key, b_key = "198.19.0.1 . tcp . 80", "198.19.0.2 . tcp . 80"
        port_a, port_b = port_of(netns, a_key), port_of(netns, b_key)
        assert port_a != port_b

        # a rule deleted by hand: NodePorts no longer redirect; only b (the service with a NodePort) goes through it
        listing = nft(netns, "-a", "list", "chain", "ip", render.TABLE, render.REDIRECT_NP)
        handle = re.search(r"redirect to .*# handle (\d+)", listing)
        assert handle, listing
        nft(netns, "delete", "rule", "ip", render.TABLE, render.REDIRECT_NP, "handle", handle.group(1))
        got = drifted(p)
        assert set(got) == {KB} and "chain redirect-np" in got[KB], got
        assert p.sync(STATE, Changes(full=True)).ok  # the damaged table is replaced whole, the sockets kept
        clean(p)
        assert port_of(netns, a_key) == port_a

        # a map element changed by hand: a's ClusterIP now redirects to b's proxy socket
        nft(netns, "delete", "element", "ip", render.TABLE, render.SERVICE_PORTS, f"{{ {a_key} }}")
        stolen = f'{{ {a_key} comment "{KA}" : {port_b} }}'
        nft(netns, "add", "element", "ip", render.TABLE, render.SERVICE_PORTS, stolen)
        got = drifted(p)
        assert set(got) == {KA} and f"serves {KB}" in got[KA], got
        assert p.sync(STATE, Changes(full=True)).ok
        clean(p)

        # a verdict changed by hand (b's ClusterIP dropped), and a stray element nobody accounts for
        nft(netns, "delete", "element", "ip", render.TABLE, render.SERVICE_IPS, f"{{ {b_key} }}")
        nft(netns, "add", "element", "ip", render.TABLE, render.SERVICE_IPS, f'{{ {b_key} comment "{KB}" : drop }}')
        nft(netns, "add", "element", "ip", render.TABLE, render.SERVICE_IPS, "{ 198.19.9.9 . tcp . 80 : drop }")
        report = p.verify(STATE)
        assert set(report["services"]) == {KB} and "'drop'" in report["services"][KB]["IPv4"], report
        assert any("198.19.9.9" in x for x in report["extra"]), report
        assert p.sync(STATE, Changes(full=True)).ok
        clean(p)

        # someone flushed the table: every rule gone, the maps and their elements left; the check of the fixed
        # rules (once per sync period) turns the next sync, even one with no change, into a full one that repairs it
        nft(netns, "flush", "table", "ip", render.TABLE)
        got = drifted(p)
        assert set(got) == {KA, KB} and all(v.startswith("different") and "chain services" in v for v in got.values())
        time.sleep(UserspaceProxier.CHECK_INTERVAL_S or 0.0)  # the full sync before counts as a check
        assert p.sync(STATE, Changes(full=False)).ok
        clean(p)

        # someone deleted it: everything is missing
        nft(netns, "delete", "table", "ip", render.TABLE)
        assert drifted(p) == {KA: "missing", KB: "missing"}
        assert p.sync(STATE, Changes(full=True)).ok
        clean(p)
        port_a = port_of(netns, a_key)

        # a's proxy socket destroyed by hand (ss -K): the redirect names a port nothing listens on; the data path
        # notices, so the next sync, even one with no change, binds a new socket
        kill = ["ip", "netns", "exec", netns, "ss", "-K", "-tln", "sport", "=", f":{port_a}"]
        subprocess.run(kill, check=True, timeout=30, capture_output=True)
        got = drifted(p)
        assert set(got) == {KA} and f"tcp/{port_a}: no socket listens" in got[KA], got
        deadline = time.monotonic() + 5
        while not p.engine.dead and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.sync(STATE, Changes(full=False)).ok
        clean(p)
        port_a = port_of(netns, a_key)

        # destroyed again, and another process took the port meanwhile (SO_REUSEADDR: the destroyed socket, still
        # open in kproxy, keeps its port bound): a full sync moves a to a port of its own
        subprocess.run(kill[:-1] + [f":{port_a}"], check=True, timeout=30, capture_output=True)
        squat = (
            "import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); print('ok', flush=True); time.sleep(60)"
        )
        thief = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", squat, str(port_a)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert thief.stdout is not None and thief.stdout.readline().strip() == "ok"
            got = drifted(p)
            assert set(got) == {KA} and f"tcp/{port_a}: held by another process" in got[KA], got
            assert p.sync(STATE, Changes(full=True)).ok
            clean(p)
            assert port_of(netns, a_key) != port_a
        finally:
            thief.kill()
            thief.communicate(timeout=10)
    finally:
        p.close()
