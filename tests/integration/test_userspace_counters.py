"""The userspace relay's traffic counters (``--service-counters``) with real connections, in a throwaway namespace of
their own (``kpy-…``): the node's own processes reach two ClusterIPs (a TCP and a UDP port each, two endpoints each:
echo servers on a veth address of the namespace) through the mode's redirects and proxy sockets.

Checked: with counters on, ``counters(IPv4)`` holds per service port the N connections (M flows) the clients made,
split per endpoint as the echo servers answered them, and the bytes the clients sent and received; the collector's
text carries them and says packets are not counted; an endpoint that leaves takes its count along (the service's
total stays), a removed service takes its counters along. With counters off, ``counters()`` is None and no listener
has anything that counts. And (slow) the cost: new connections per second through a ClusterIP with counters on and
off, two namespaces served side by side, rounds interleaved; printed (``-s``), not asserted (the machine is shared).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.backends.userspace.proxier import UserspaceProxier
from kproxy.config import ProxyConfig
from kproxy.counters import CounterCollector, CounterDump, Counts, Measure
from kproxy.model import Changes, IPFamily, Protocol, ServicePortName
from kproxy.nftkernel import available

from .scratch import scratch_netns
from .test_userspace_backend import ip, sp, state

pytestmark = pytest.mark.root

OFF = ProxyConfig(cluster_cidrs=("198.18.64.0/18",), ip_families=(IPFamily.V4,))
ON = dataclasses.replace(OFF, service_counters=True)
EP = "198.18.101.2"
CIPS = {"alpha": "198.18.200.10", "beta": "198.18.200.11"}
PORTS = {"ep1": 8081, "ep2": 8082, "ep3": 8083, "ep4": 8084}
ENDPOINTS = {"alpha": (("ep1", 8081), ("ep2", 8082)), "beta": (("ep3", 8083), ("ep4", 8084))}

# N TCP connections and M UDP flows (each from a socket of its own, all open at once: M distinct client ports)
CLIENT = """
import json, socket, sys, time
host, port, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {"tcp": {}, "udp": {}, "tcp_bytes": 0, "udp_bytes": 0, "errors": 0}
t0 = time.perf_counter()
for i in range(n):
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            s.sendall(b"hello %d\\n" % i)
            f = s.makefile("rb")
            line = f.readline()
            f.close()
        out["tcp"][line.split()[0].decode()] = out["tcp"].get(line.split()[0].decode(), 0) + 1
        out["tcp_bytes"] += len(b"hello %d\\n" % i) + len(line)
    except (OSError, IndexError):
        out["errors"] += 1
out["seconds"] = time.perf_counter() - t0
socks = []
for i in range(m):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    socks.append(s)
    try:
        s.connect((host, port))
        s.send(b"flow %d\\n" % i)
        data = s.recv(2000)
        out["udp"][data.split()[0].decode()] = out["udp"].get(data.split()[0].decode(), 0) + 1
        out["udp_bytes"] += len(b"flow %d\\n" % i) + len(data)
    except (OSError, IndexError):
        out["errors"] += 1
for s in socks:
    s.close()
print(json.dumps(out))
"""


@contextlib.contextmanager
def node_lab(prefix: str, tmp_path: Path) -> Iterator[str]:
    """A namespace whose own processes are the clients, with the four echo servers on a veth address of it."""
    with scratch_netns(prefix, lo_up=True) as node:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            ip(node, "link", "add", "kpya", "type", "veth", "peer", "name", "kpyb")
            ip(node, "addr", "add", "198.18.101.1/24", "dev", "kpya")
            ip(node, "addr", "add", f"{EP}/24", "dev", "kpyb")
            ip(node, "link", "set", "kpya", "up")
            ip(node, "link", "set", "kpyb", "up")
            ip(node, "route", "add", "default", "dev", "kpya")  # the ClusterIPs are routable before the redirect
            for name, port in PORTS.items():
                ready = tmp_path / f"{prefix}{name}"
                cmd = ["ip", "netns", "exec", node, sys.executable, "-m", "kproxy.lab.echo", "--name", name]
                procs.append(subprocess.Popen(cmd + ["--ports", str(port), "--ready-file", str(ready)]))
            deadline = time.monotonic() + 20
            while not all((tmp_path / f"{prefix}{n}").exists() for n in PORTS) and time.monotonic() < deadline:
                time.sleep(0.05)  # the echo servers' readiness files: bounded
            assert all((tmp_path / f"{prefix}{n}").exists() for n in PORTS), "echo servers not ready"
            yield node
        finally:
            for p in procs:
                p.kill()
                p.wait(10)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[str]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with node_lab("kpy-n-", tmp_path) as ns:
        yield ns


def services(names: tuple[str, ...] = ("alpha", "beta"), drop: str = "") -> list[Any]:
    out = []
    for name in names:
        eps = tuple((EP, port) for ep, port in ENDPOINTS[name] if ep != drop)
        for proto in (Protocol.TCP, Protocol.UDP):
            out.append(sp(name, eps, proto, cluster_ip=CIPS[name]))
    return out


def clients(ns: str, host: str, n: int, m: int) -> dict[str, Any]:
    res = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, host, "80", str(n), str(m)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    assert out["errors"] == 0, out
    return out


def key(name: str, proto: Protocol) -> ServicePortName:
    return ServicePortName("ns1", name, "p", proto)


def per_endpoint(dump: CounterDump, name: str, proto: Protocol) -> dict[str, int]:
    return {ep: c.connections for ep, c in dump.ports[key(name, proto)].per_endpoint().items()}


def seen(answers: dict[str, int], name: str) -> dict[str, int]:
    """What the echo servers answered, as the dump names endpoints (an endpoint that answered none: 0)."""
    return {f"{EP}:{port}": answers.get(ep, 0) for ep, port in ENDPOINTS[name]}


@pytest.fixture
def counting(node: str) -> Iterator[UserspaceProxier]:
    p = UserspaceProxier(ON, netns=node)
    p.start()
    try:
        yield p
    finally:
        p.close()
        UserspaceProxier.cleanup_leftovers(ON, netns=node)


def test_counts_connections_flows_and_bytes_per_service_and_endpoint(node: str, counting: UserspaceProxier) -> None:
    p = counting
    names = {key(n, proto) for n in CIPS for proto in (Protocol.TCP, Protocol.UDP)}
    assert p.sync(state(*services()), Changes(full=True)).ok
    fresh = p.counters(IPFamily.V4)
    assert fresh is not None and set(fresh.ports) == names
    assert all(pc.total == Counts(0, None, 0) and set(pc.connections) == {0} for pc in fresh.ports.values())
    assert UserspaceProxier.counters_offered == {Measure.CONNECTIONS, Measure.BYTES}
    runs = {"alpha": clients(node, CIPS["alpha"], 40, 10), "beta": clients(node, CIPS["beta"], 25, 7)}
    dump = p.counters(IPFamily.V4)
    assert dump is not None
    for name, out in runs.items():
        n, m = sum(out["tcp"].values()), sum(out["udp"].values())
        assert (n, m) == ((40, 10) if name == "alpha" else (25, 7))
        assert dump.ports[key(name, Protocol.TCP)].total == Counts(n, None, out["tcp_bytes"]), name
        assert dump.ports[key(name, Protocol.UDP)].total == Counts(m, None, out["udp_bytes"]), name
        assert per_endpoint(dump, name, Protocol.TCP) == seen(out["tcp"], name)
        assert per_endpoint(dump, name, Protocol.UDP) == seen(out["udp"], name)
    assert all(pc.packets is None and pc.bytes is None for pc in dump.ports.values())  # per endpoint: connections
    assert p.counters(IPFamily.V6) == CounterDump(IPFamily.V6, {})

    text = CounterCollector(p, (IPFamily.V4,)).exposition().decode()
    labels = 'namespace="ns1",service="alpha",port="p",protocol="TCP",family="IPv4"'
    assert f"kproxy_service_connections_total{{{labels}}} 40\n" in text
    assert f"kproxy_service_bytes_total{{{labels}}} {runs['alpha']['tcp_bytes']}\n" in text
    ep1 = runs["alpha"]["tcp"]["ep1"]
    assert f'kproxy_endpoint_connections_total{{{labels},endpoint="{EP}:8081"}} {ep1}\n' in text
    assert 'kproxy_service_counters_offered{measure="packets"} 0' in text and "_packets_total" not in text

    # ep2 leaves alpha and beta goes: their counts go with them; alpha's totals stay
    gone = frozenset(names)
    assert p.sync(state(*services(("alpha",), drop="ep2"), gen=2), Changes(full=False, services=gone)).ok
    after = p.counters(IPFamily.V4)
    assert after is not None and set(after.ports) == {key("alpha", Protocol.TCP), key("alpha", Protocol.UDP)}
    assert per_endpoint(after, "alpha", Protocol.TCP) == {f"{EP}:8081": ep1}
    for proto in (Protocol.TCP, Protocol.UDP):
        assert after.ports[key("alpha", proto)].total == dump.ports[key("alpha", proto)].total


def test_off_nothing_counts(node: str) -> None:
    p = UserspaceProxier(OFF, netns=node)
    p.start()
    try:
        assert p.sync(state(*services()), Changes(full=True)).ok
        clients(node, CIPS["alpha"], 10, 4)
        assert p.counters(IPFamily.V4) is None
        tallies = p.engine.run(lambda: [lst.tally for lst in p.engine.listeners.values()])
        assert len(tallies) == 4 and set(tallies) == {None}
    finally:
        p.close()
        UserspaceProxier.cleanup_leftovers(OFF, netns=node)


CONNECTIONS, ROUNDS = 2000, 6


@pytest.mark.slow
def test_cost_new_connections_per_second_on_and_off(tmp_path: Path) -> None:
    """Two namespaces served side by side, one proxier counting and one not; rounds of CONNECTIONS new connections
    through a ClusterIP, interleaved (the order alternating). Two figures per side: new connections per second as the
    client saw them, and the relay's CPU time per connection (this process's CPU time over a round: both data-path
    threads run here, the idle one does nothing; steadier than the rate on a shared machine). Printed, not asserted;
    every connection must be answered and the counting side must have counted each."""
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with contextlib.ExitStack() as stack:
        sides = {}
        for label, cfg in (("off", OFF), ("on", ON)):
            ns = stack.enter_context(node_lab(f"kpy-{label}-", tmp_path))
            p = UserspaceProxier(cfg, netns=ns)
            stack.callback(UserspaceProxier.cleanup_leftovers, cfg, netns=ns)
            stack.callback(p.close)
            p.start()
            assert p.sync(state(*services(("alpha",))), Changes(full=True)).ok
            sides[label] = (ns, p)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(ROUNDS):
            for label in ("off", "on") if r % 2 == 0 else ("on", "off"):
                t0 = time.process_time()
                out = clients(sides[label][0], CIPS["alpha"], CONNECTIONS, 0)
                cpu[label].append((time.process_time() - t0) / CONNECTIONS * 1e6)
                rates[label].append(CONNECTIONS / out["seconds"])
        dump = sides["on"][1].counters(IPFamily.V4)
        assert dump is not None and dump.ports[key("alpha", Protocol.TCP)].total.connections == CONNECTIONS * ROUNDS
        for what, fig, unit in (("new connections/s", rates, ""), ("relay CPU per connection", cpu, " us")):
            off, on = statistics.median(fig["off"]), statistics.median(fig["on"])
            print(
                f"\nuserspace {what}, {ROUNDS} interleaved rounds of {CONNECTIONS}: counters off {off:.1f}{unit} "
                f"(rounds {[round(x, 1) for x in fig['off']]}), on {on:.1f}{unit} "
                f"(rounds {[round(x, 1) for x in fig['on']]}); on/off {on / off:.3f}"
            )
