"""The lab's pure parts, without root: names and addresses of the plan, the ip batch lines, probe and echo texts.

The names and addresses are a contract (the conformance scenarios and the backends' tests rely on them), so they
are pinned here; the kernel side is tested in tests/integration/test_lab.py.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kproxy.lab import netns
from kproxy.lab.echo import _answer
from kproxy.lab.plan import (
    CLUSTER_CIDR4,
    CLUSTER_CIDR6,
    MAX_NODES,
    LabError,
    external_batch,
    fabric_batch,
    make_plan,
    node_batch,
    pod_batch,
)
from kproxy.lab.probe import ProbeResult, build_argv, error_word


def test_plan_names_and_addresses() -> None:
    plan = make_plan(2, 3)
    assert plan.fabric_ns == "kpl-fabric" and plan.bridge == "kpl-br0" and plan.external_ns == "kpl-ext"
    assert (plan.external_ip4, plan.external_ip6) == ("198.18.0.2", "fd00:198:18::2")
    n2 = plan.nodes[1]
    assert (n2.index, n2.name, n2.ns, n2.ip4, n2.ip6) == (2, "node-2", "kpl-n2", "198.18.0.12", "fd00:198:18::12")
    assert (n2.pod_cidr4, n2.pod_cidr6, n2.zone) == ("198.18.66.0/24", "fd00:198:18:66::/64", "zone-b")
    assert plan.nodes[0].zone == "zone-a"
    pod = plan.pods[4]
    assert (pod.name, pod.ns, pod.node, pod.ip4, pod.ip6) == (
        "pod-2-2",
        "kpl-n2-p2",
        "node-2",
        "198.18.66.12",
        "fd00:198:18:66::12",
    )
    assert len(plan.namespaces()) == 2 + 2 + 6


def test_plan_ipv4_only_and_prefix() -> None:
    plan = make_plan(1, 1, ipv6=False, prefix="kpz-")
    assert plan.nodes[0].ip6 == "" and plan.pods[0].ip6 == "" and plan.nodes[0].ns == "kpz-n1"
    assert not any("fd00" in line for line in fabric_batch(plan) + node_batch(plan, plan.nodes[0]))


def test_every_pod_cidr_is_inside_the_cluster_cidrs() -> None:
    plan = make_plan(MAX_NODES, 1)
    c4, c6 = ipaddress.ip_network(CLUSTER_CIDR4), ipaddress.ip_network(CLUSTER_CIDR6)
    for n in plan.nodes:
        assert ipaddress.ip_network(n.pod_cidr4).subnet_of(c4)  # type: ignore[arg-type]
        assert ipaddress.ip_network(n.pod_cidr6).subnet_of(c6)  # type: ignore[arg-type]
    with pytest.raises(LabError):
        make_plan(MAX_NODES + 1, 1)
    with pytest.raises(LabError):
        make_plan(0, 1)
    for prefix in ("kpl-x-", "kpl", "KPL-", "k-"):
        with pytest.raises(LabError):
            make_plan(1, 1, prefix=prefix)


def test_batches() -> None:
    plan = make_plan(2, 2)
    n1 = plan.nodes[0]
    lines = node_batch(plan, n1)
    assert "route add 198.18.66.0/24 via 198.18.0.12" in lines
    assert "route add fd00:198:18:66::/64 via fd00:198:18::12" in lines
    assert "route add default via 198.18.0.2" in lines and "route add ::/0 via fd00:198:18::2" in lines
    assert "link set veth2 type bridge_slave hairpin on" in lines
    assert "link add name veth1 type veth peer name eth0 netns kpl-n1-p1" in lines
    assert "addr add fd00:198:18::11/64 dev eth0 nodad" in lines
    assert "route add 198.19.0.0/16 via 198.18.0.11" in external_batch(plan)
    assert "route add fd00:198:18:ff::/64 via fd00:198:18::11" in external_batch(plan)
    pod = pod_batch(plan, n1, plan.pods[0])
    assert "route add default via 198.18.65.1" in pod and "addr add fd00:198:18:65::11/64 dev eth0 nodad" in pod
    assert "link add name n2 type veth peer name eth0 netns kpl-n2" in fabric_batch(plan)
    for line in fabric_batch(plan) + lines + pod:
        netns.check_line(line)


def test_unsafe_names_are_refused() -> None:
    for bad in ("a b", "x;rm", "", "-n", "a\nb", "x" * 80):
        with pytest.raises(ValueError):
            netns.check_name(bad)
    with pytest.raises(ValueError):
        netns.check_line('link add name "x" type veth')
    with pytest.raises(ValueError):
        netns.sysctl_argv("kpl-n1", {"net.ipv4.ip_forward": "1 2"})


def test_echo_answer() -> None:
    assert _answer("pod-1-2", ("198.18.65.11", 40000), b"hello", 8080, "tcp") == b"pod-1-2 198.18.65.11 40000\n"
    assert _answer("p", ("fe80::1%eth0", 1), b"hello", 8080, "udp") == b"p fe80::1 1\n"
    assert _answer("p", ("::1", 5), b"info more", 9000, "udp") == b"p ::1 5 port=9000 proto=udp\n"


def test_probe_result() -> None:
    r = ProbeResult(ok=True, reply="pod-1-2 198.18.65.11 40000 port=8081 proto=tcp", seconds=0.1)
    assert (r.pod, r.seen_ip, r.seen_port, r.local_port) == ("pod-1-2", "198.18.65.11", 40000, 8081)
    assert ProbeResult.from_json(r.to_json()) == r
    failed = ProbeResult(ok=False, error="refused")
    assert (failed.pod, failed.seen_ip, failed.seen_port, failed.local_port) == (None, None, None, None)


def test_probe_errors_and_argv() -> None:
    assert error_word(ConnectionRefusedError()) == "refused"
    assert error_word(ConnectionResetError()) == "refused"
    assert error_word(socket.timeout()) == "timeout"
    assert error_word(OSError(errno.EHOSTUNREACH, "No route to host")) == "unreachable"
    assert error_word(OSError(errno.ENETUNREACH, "Network is unreachable")) == "unreachable"
    argv = build_argv("udp", "fd00:198:18:ff::1", 53, count=3, src_port=40000, payload="-x")
    assert argv[0] == "udp" and "--host=fd00:198:18:ff::1" in argv and "--payload=-x" in argv
    assert argv[argv.index("--src-port") + 1] == "40000"
    with pytest.raises(ValueError):
        build_argv("sctp", "h", 1)
    with pytest.raises(ValueError):
        build_argv("tcp", "h", 1, payload="a\nb")


# --- what `kproxy lab up` and `kproxy demo` decide before touching anything -------------------------------------


def test_a_lab_is_live_only_with_processes_and_ready_or_being_built() -> None:
    from kproxy.lab.state import lab_is_live

    assert not lab_is_live(None, processes_alive=True, owner_alive=True)  # nothing recorded
    assert lab_is_live({"ready": True}, processes_alive=True, owner_alive=False)  # someone's lab
    assert lab_is_live({"ready": False}, processes_alive=True, owner_alive=True)  # being built right now
    assert not lab_is_live({"ready": True}, processes_alive=False, owner_alive=True)  # its processes were killed
    assert not lab_is_live({"ready": False}, processes_alive=True, owner_alive=False)  # build abandoned half-way


def _state(tmp: Path, prefix: str, ready: bool, owner_pid: int) -> dict[str, object]:
    plan = make_plan(1, 1, prefix=prefix)
    return {
        "prefix": prefix,
        "state_dir": str(tmp),
        "ipv6": True,
        "mode": None,
        "nodes": [dataclasses.asdict(n) for n in plan.nodes],
        "pods": [dataclasses.asdict(p) for p in plan.pods],
        "fabric_ns": plan.fabric_ns,
        "external_ns": plan.external_ns,
        "external_ip4": plan.external_ip4,
        "external_ip6": plan.external_ip6,
        "api_port": 1,
        "owner": {"pid": owner_pid, "starttime": 0},
        "ready": ready,
    }


def test_live_reads_the_state_and_checks_the_recorded_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kproxy.lab import cluster, state
    from kproxy.lab.cli import live_lab_problem

    monkeypatch.setattr(state, "STATE_ROOT", tmp_path)
    d = state.state_dir_for("kpu-")
    assert d == tmp_path / "prefix" / "kpu"
    assert cluster.Lab.live(prefix="kpu-") is None  # no state at all
    (d / "pids").mkdir(parents=True)
    (d / "state.json").write_text(json.dumps(_state(d, "kpu-", True, 0)))
    assert cluster.Lab.live(prefix="kpu-") is None  # no process recorded: a leftover
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / "pids" / "apiserver.pid").write_text(f"{dead.pid} 0\n")
    assert cluster.Lab.live(prefix="kpu-") is None  # its process is gone (a killed run)
    me = os.getpid()
    (d / "pids" / "apiserver.pid").write_text(f"{me} {netns.proc_starttime(me)}\n")
    live = cluster.Lab.live(prefix="kpu-")
    assert live is not None and live.prefix == "kpu-"
    text = live_lab_problem(live, "do something else")
    assert "'kpu-'" in text and "1 nodes, no kproxy" in text and str(d) in text and text.endswith("do something else")
    (d / "state.json").write_text(json.dumps(_state(d, "kpu-", False, dead.pid)))
    assert cluster.Lab.live(prefix="kpu-") is None  # a half-built lab whose builder is gone
    (d / "state.json").write_text(json.dumps(_state(d, "kpu-", False, me)))
    assert cluster.Lab.live(prefix="kpu-") is not None  # being built by a live process
    (d / "state.json").write_text("{not json")
    assert cluster.Lab.live(prefix="kpu-") is None


def test_modes_are_checked_before_anything_is_built() -> None:
    from kproxy.lab.cli import mode_problem, mode_text

    assert mode_problem(None) is None
    problem = mode_problem("bogus")
    assert problem is not None and "unknown mode 'bogus'" in problem
    assert mode_text(None) == "no kproxy (mode none)" and mode_text("iptables") == "kproxy --mode iptables"


def test_cli_and_demo_refuse_a_bad_mode_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Before any lab is looked at or built: these run without root and change nothing."""
    from kproxy.demo import run_demo
    from kproxy.lab.cli import main

    assert run_demo("bogus", prefix="kpu-") == 2
    err = capsys.readouterr().err
    assert err.startswith("kproxy demo: mode bogus cannot run here: unknown mode") and err.count("\n") == 1
    assert main(["lab", "--prefix", "kpu-", "up", "--mode", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kproxy lab up: mode bogus cannot run here") and err.count("\n") == 1


def test_a_prefix_that_is_the_start_of_other_labs_is_refused_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """`down` removes every namespace starting with the prefix: "kp" would take kpl-, kpk-, ... with it."""
    from kproxy.demo import run_demo
    from kproxy.lab.cli import main
    from kproxy.lab.cluster import Lab, check_prefix, state_dir_for

    assert check_prefix("kpl-") == "kpl-"
    for bad in ("kp", "kpl", "KPL-", "k-", "kpl--"):
        with pytest.raises(LabError, match="invalid lab prefix"):
            state_dir_for(bad)
    with pytest.raises(LabError, match="invalid lab prefix"):
        Lab.down(prefix="kp")
    assert main(["lab", "--prefix", "kp", "down"]) == 1
    assert main(["lab", "--prefix", "kp", "up", "--mode", "none", "--replace"]) == 2
    assert run_demo("iptables", prefix="kp", replace_lab=True) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all("invalid lab prefix 'kp'" in line for line in err)
