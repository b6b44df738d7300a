"""The lab cluster on real namespaces: topology, traffic between pods, the API stand-in, cgroups, clean removal.

Builds one lab without kproxy (mode None) for the module, then checks what the conformance suite relies on: pods on
different nodes reach each other directly (TCP and UDP, IPv4 and IPv6) and the echo names the pod and the source it
saw; nodes are reachable from the external client; the API is reachable from a node and from the machine and holds
the registered Nodes; node 1's cgroup holds its pods' processes; `kproxy lab up` and `kproxy demo` refuse to replace
the running lab and a bad mode; a killed run is cleaned up by the next `lab up`; `down` leaves no kpl- namespace,
cgroup, mount or state file behind; a lab whose kproxy cannot start is taken down again by `lab up`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kproxy.lab import Lab, LabPod
from kproxy.lab import netns as lab_netns
from kproxy.lab.state import CGROUP_MOUNT, STATE_ROOT, state_dir_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root (network namespaces, cgroup2 mount)"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (ip) is not installed"),
]

STARTUP_BUDGET = 20.0
# A prefix of the tests' own: a lab someone runs meanwhile under the default "kpl-" (the conformance suite, a person
# trying kproxy) is left alone. Everything else -- names after the prefix, addresses, layout -- is the default lab's.
P = "kplt-"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    t0 = time.monotonic()
    try:
        the_lab = Lab.up(nodes=2, pods_per_node=3, mode=None, prefix=P)
    except BaseException:
        Lab.down(prefix=P)
        raise
    the_lab.startup = time.monotonic() - t0  # type: ignore[attr-defined]
    try:
        yield the_lab
    finally:
        Lab.down(prefix=P)


def other_node_pod(lab: Lab, pod: LabPod) -> LabPod:
    return next(p for p in lab.pods if p.node != pod.node)


def test_startup_is_fast_and_complete(lab: Lab) -> None:
    startup = lab.startup  # type: ignore[attr-defined]
    print(f"lab up (2 nodes, 6 pods, no kproxy): {startup:.2f}s")
    assert startup < STARTUP_BUDGET
    assert [n.ns for n in lab.nodes] == [f"{P}n1", f"{P}n2"]
    assert [p.name for p in lab.pods] == [f"pod-{i}-{j}" for i in (1, 2) for j in (1, 2, 3)]
    expected = {f"{P}fabric", f"{P}ext", f"{P}n1", f"{P}n2", *(f"{P}n{i}-p{j}" for i in (1, 2) for j in (1, 2, 3))}
    assert expected == set(lab_netns.list_netns(P))
    assert lab.pod("pod-2-3").ip4 == "198.18.66.13" and lab.pod("pod-2-3").ip6 == "fd00:198:18:66::13"
    assert (lab.nodes[0].zone, lab.nodes[1].zone) == ("zone-a", "zone-b")


@pytest.mark.parametrize("kind", ["tcp", "udp"])
@pytest.mark.parametrize("family", ["ip4", "ip6"])
def test_pod_reaches_pod_on_other_node(lab: Lab, kind: str, family: str) -> None:
    client = lab.pod("pod-1-2")
    server = other_node_pod(lab, client)
    results = lab.probe(client.ns, kind, getattr(server, family), 8080, count=3, timeout=2.0)
    assert len(results) == 3
    for r in results:
        assert r.ok, r
        assert r.pod == server.name
        assert r.seen_ip == getattr(client, family)  # direct pod-to-pod: no NAT
        assert r.seen_port and r.seen_port > 0


def test_echo_reports_its_port_on_request(lab: Lab) -> None:
    pod = lab.pod("pod-2-1")
    for port in lab.echo_ports:
        for kind in ("tcp", "udp"):
            [r] = lab.probe(f"{P}n1-p1", kind, pod.ip4, port, payload="info")
            assert r.ok and r.local_port == port and r.reply.endswith(f"proto={kind}"), r


def test_hold_carries_many_exchanges_on_one_connection(lab: Lab) -> None:
    server = lab.pod("pod-2-2")
    proc = lab.hold(f"{P}n1-p1", f"{server.ip6}", 9000, seconds=0.6, interval=0.1)
    results = lab.finish_hold(proc)
    assert len(results) >= 4
    assert all(r.ok and r.pod == server.name for r in results), results
    assert len({r.seen_port for r in results}) == 1  # one connection throughout


def test_refused_and_timeout_are_told_apart(lab: Lab) -> None:
    node2 = lab.nodes[1]
    [tcp] = lab.probe(lab.external_ns, "tcp", node2.ip4, 1)
    [udp] = lab.probe(lab.external_ns, "udp", node2.ip6, 1)
    assert (tcp.error, udp.error) == ("refused", "refused")
    # no rules for a service IP yet: the node routes it to its default gateway (the external client), which drops
    # it -- a timeout, not "network unreachable", so a proxy's reject rules will be observable
    [r] = lab.probe(f"{P}n1-p1", "tcp", "198.19.0.10", 80, timeout=0.5)
    assert r.error == "timeout"


def test_external_client_reaches_nodes(lab: Lab) -> None:
    for node in lab.nodes:
        for addr in (node.ip4, node.ip6):
            [r] = lab.probe(lab.external_ns, "tcp", addr, 10256, timeout=1.0)
            assert r.error == "refused", r  # an answer (RST) from the node: it is reachable, nothing listens yet


def test_api_reachable_from_node_and_machine(lab: Lab) -> None:
    for node in lab.nodes:
        for url in ("http://198.18.0.1:6443/healthz", "http://[fd00:198:18::1]:6443/healthz"):
            r = lab.probe_http(node.ns, url)
            assert r.ok and r.status == 200, r
    with urllib.request.urlopen(f"{lab.api_url}/healthz", timeout=5) as resp:
        assert resp.status == 200
    assert lab.lab_api_url == "http://198.18.0.1:6443"
    # the kubeconfig lab up writes works with the official client
    import kubernetes

    client = kubernetes.config.new_client_from_config(config_file=str(lab.kubeconfig))
    names = {n.metadata.name for n in kubernetes.client.CoreV1Api(client).list_node().items}
    assert names == {n.name for n in lab.nodes}


def test_nodes_registered(lab: Lab) -> None:
    from kubernetes import client

    with lab.api_client() as api:
        nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}
    assert set(nodes) == {"node-1", "node-2"}
    for ln in lab.nodes:
        n = nodes[ln.name]
        assert n.metadata.labels["topology.kubernetes.io/zone"] == ln.zone
        assert n.metadata.labels["kubernetes.io/hostname"] == ln.name
        assert n.spec.pod_cidrs == [ln.pod_cidr4, ln.pod_cidr6]
        internal = [a.address for a in n.status.addresses if a.type == "InternalIP"]
        assert internal == [ln.ip4, ln.ip6]


def test_node_settings(lab: Lab) -> None:
    node = lab.nodes[0]
    keys = [
        "net.ipv4.ip_forward",
        "net.ipv6.conf.all.forwarding",
        "net.bridge.bridge-nf-call-iptables",
        "net.bridge.bridge-nf-call-ip6tables",
    ]
    out = lab.exec(node.ns, ["sysctl", "-n", *keys], check=True).stdout.decode().split()
    assert out == ["1", "1", "1", "1"]
    links = lab.exec(node.ns, ["ip", "-d", "-j", "link", "show", "master", "cbr0"], check=True).stdout
    ports = json.loads(links)
    assert len(ports) == 3
    assert all(p["linkinfo"]["info_slave_data"]["hairpin"] for p in ports)


def test_cgroup_of_node_holds_its_processes(lab: Lab) -> None:
    n1, n2 = lab.nodes
    cg = lab.cgroup_path(n1)
    assert cg == CGROUP_MOUNT / f"{P}n1" and lab_netns.is_cgroup2_mount(CGROUP_MOUNT)
    procs = lab_netns.cgroup_procs(cg)
    echo_pids = {p["echo_pid"] for p in lab.status()["pods"] if p["node"] == n1.name}
    assert len(echo_pids) == 3 and None not in echo_pids
    assert echo_pids <= procs
    assert not echo_pids & lab_netns.cgroup_procs(lab.cgroup_path(n2))
    # a command run in a pod of node 1 runs in node 1's cgroup; one in the external client in none of the lab's
    assert lab.exec(f"{P}n1-p3", ["cat", "/proc/self/cgroup"]).stdout.decode().splitlines()[-1] == f"0::/{P}n1"
    assert P not in lab.exec(lab.external_ns, ["cat", "/proc/self/cgroup"]).stdout.decode()


def test_attach_and_status_from_another_process(lab: Lab) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kproxy.lab.cli", "lab", "--prefix", P, "status", "--format", "json"],
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    st = json.loads(out)
    assert st["api_url"] == lab.api_url and st["api_running"]
    assert all(p["echo_pid"] for p in st["pods"])
    assert Lab.attach(prefix=P).pods == lab.pods


def test_node_process_lifecycle(lab: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """start_kproxy/stop_kproxy's process handling (netns, cgroup, pid file, log, signals), with a stand-in command.

    The stand-in takes kproxy's place only here, where what is tested is the lab's handling of the node process;
    the real kproxy runs under the lab in the conformance suite.
    """
    script = "import signal,sys,time; print('started', sys.argv[1:4], flush=True); time.sleep(120)"
    monkeypatch.setattr(Lab, "kproxy_command", staticmethod(lambda: [sys.executable, "-c", script]))
    node = lab.nodes[1]
    lab.start_kproxy(node, "iptables", ["--v", "2"])
    try:
        pid = lab.kproxy_pid(node)
        assert pid and lab.kproxy_running(node)
        # `ip netns exec` enters the namespace a moment after the process starts: wait for it, boundedly
        deadline = time.monotonic() + 5
        while pid not in lab_netns.netns_pids([node.ns])[node.ns] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid in lab_netns.netns_pids([node.ns])[node.ns]
        assert pid in lab_netns.cgroup_procs(lab.cgroup_path(node))
        assert Lab.attach(prefix=P).kproxy_running(node.name)  # seen from another Lab object, as the runner would
        with pytest.raises(Exception, match="already runs"):
            lab.start_kproxy(node, "iptables")
        deadline = time.monotonic() + 10
        while "started ['run'" not in lab.kproxy_log(node) and time.monotonic() < deadline:
            time.sleep(0.05)
        log = lab.kproxy_log(node)
        assert "started ['run', '--mode', 'iptables']" in log
        assert "--master http://198.18.0.1:6443 --hostname-override node-2" in log and "--v 2" in log
        assert "--cluster-cidr 198.18.64.0/18,fd00:198:18:40::/58" in log
        assert lab.status()["nodes"][1]["kproxy_mode"] == "iptables"
    finally:
        lab.stop_kproxy(node, timeout=5)
    assert not lab.kproxy_running(node) and not lab_netns.alive(pid)
    lab.stop_kproxy(node)  # stopping a stopped kproxy is a no-op

    monkeypatch.setattr(Lab, "kproxy_command", staticmethod(lambda: [sys.executable, "-c", "raise SystemExit(3)"]))
    lab.start_kproxy(node, "iptables")
    with pytest.raises(Exception, match="not running"):
        lab.wait_kproxy(node, timeout=10)


def test_machine_namespace_is_untouched(lab: Lab) -> None:
    """No lab address or link in the machine's own namespace: no lab packet can leave the machine."""
    addrs = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, check=True, timeout=10).stdout)
    for link in addrs:
        assert not link["ifname"].startswith(P), link["ifname"]
        for a in link.get("addr_info", []):
            assert not a["local"].startswith(("198.18.", "198.19.", "fd00:198:18:")), (link["ifname"], a["local"])
    routes = subprocess.run(["ip", "route"], capture_output=True, check=True, timeout=10).stdout.decode()
    assert "198.18." not in routes and "198.19." not in routes


def lab_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kproxy.lab.cli", "lab", "--prefix", P, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_up_and_demo_refuse_to_replace_a_running_lab(lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    from kproxy.demo import run_demo

    before = set(lab._pids().values())
    r = lab_cli("up", "--mode", "none")
    assert r.returncode == 2, r.stderr
    assert "already running under prefix 'kplt-'" in r.stderr
    assert f"`kproxy lab --prefix {P} down`" in r.stderr and f"`kproxy lab --prefix {P} up --replace`" in r.stderr
    assert r.stdout == ""
    r = lab_cli("up", "--mode", "nftables-no-such")  # the mode is checked first, before the lab is looked at
    assert r.returncode == 2 and "unknown mode" in r.stderr
    assert run_demo("iptables", prefix=P) == 2
    err = capsys.readouterr().err
    assert err.startswith("kproxy demo: a lab is already running under prefix 'kplt-'")
    assert "--replace-lab" in err and "--lab-prefix" in err
    # nothing of the running lab was touched
    assert set(lab._pids().values()) == before and Lab.live(prefix=P) is not None
    [p] = lab.probe(lab.pods[0].ns, "tcp", lab.pods[-1].ip4, 8080)
    assert p.ok and p.pod == lab.pods[-1].name


def test_exec_refuses_foreign_namespaces(lab: Lab) -> None:
    with pytest.raises(Exception, match="not a namespace of this lab"):
        lab.exec("kpt-anything", ["true"])


def test_killed_run_is_cleaned_up_by_next_up_and_down(lab: Lab) -> None:
    """Runs last: SIGKILL every lab process, leave the namespaces, then `up` again, then `down`."""
    keep = "kplt_keep"  # ours, and it must survive: down removes only names starting with the prefix "kplt-"
    lab_netns.add_netns([keep])
    try:
        pids = {v for v in (p["echo_pid"] for p in lab.status()["pods"]) if v}
        api_pid = lab._pids()["apiserver"]
        for pid in pids | {api_pid}:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # SIGKILL takes effect a moment later
        while any(lab_netns.alive(p) for p in pids | {api_pid}) and time.monotonic() < deadline:
            time.sleep(0.02)
        # a stale state file with no live processes behind it, and every namespace still there
        assert (state_dir_for(P) / "state.json").exists() and len(lab_netns.list_netns(P)) == 10
        assert Lab.live(prefix=P) is None  # a leftover, not someone's lab: `lab up` replaces it without asking
        t0 = time.monotonic()
        r = lab_cli("up", "--mode", "none", "--pods-per-node", "2")
        print(f"lab up over a killed lab: {time.monotonic() - t0:.2f}s")
        assert r.returncode == 0, r.stderr
        assert "no kproxy (mode none)" in r.stdout and "None" not in r.stdout
        again = Lab.attach(prefix=P)
        assert len(again.pods) == 4 and f"{P}n1-p3" not in lab_netns.list_netns(P)
        [pr] = again.probe(f"{P}n2-p2", "tcp", again.pod("pod-1-1").ip4, 8080)
        assert pr.ok and pr.pod == "pod-1-1"
        new_pids = set(again._pids().values())
        assert new_pids and not new_pids & (pids | {api_pid})

        Lab.down(prefix=P)
        assert lab_netns.list_netns(P) == []
        assert keep in lab_netns.list_netns("kplt")
        if not _other_labs():  # the cgroup2 mount is shared with a lab of another prefix, if one runs
            assert not any(mp == str(CGROUP_MOUNT) for mp, _ in lab_netns.mounts())
        assert not state_dir_for(P).exists()  # state, pid files, ready files and logs: all gone
        assert not any(lab_netns.alive(p) for p in new_pids)
        assert not any(d.name.startswith(P) for d in _cgroup2_children())
        Lab.down(prefix=P)  # idempotent
    finally:
        lab_netns.delete_netns([keep])


def test_up_takes_down_a_lab_whose_kproxy_cannot_start() -> None:
    """Runs after the module's lab is gone: `lab up` whose kproxy exits at once leaves no lab, only its logs."""
    from kproxy.lab.cli import mode_problem

    if mode_problem("iptables"):
        pytest.skip(f"kproxy cannot run here: {mode_problem('iptables')}")
    try:
        r = lab_cli("up", "--nodes", "1", "--pods-per-node", "1", "--mode", "iptables", "--kproxy-arg=--no-such-flag")
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "kproxy on node-1 is not running" in r.stderr and "lab taken down" in r.stderr
        assert lab_netns.list_netns(P) == [] and Lab.live(prefix=P) is None
        d = state_dir_for(P)
        assert not (d / "state.json").exists() and not (d / "pids").exists()
        assert "--no-such-flag" in (d / "kproxy-node-1.log").read_text()  # kept for diagnosis
        r = lab_cli("down")
        assert r.returncode == 0, r.stderr
        assert not d.exists()
    finally:
        Lab.down(prefix=P)


def _other_labs() -> list[str]:
    return [str(p) for p in [STATE_ROOT / "state.json", *STATE_ROOT.glob("prefix/*/state.json")] if p.exists()]


def _cgroup2_children() -> list[os.DirEntry[str]]:
    for mp, fs in lab_netns.mounts():
        if fs == "cgroup2":
            return [e for e in os.scandir(mp) if e.is_dir()]
    return []
