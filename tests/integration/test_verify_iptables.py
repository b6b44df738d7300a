"""``verify`` on the iptables mode: the kernel read back with iptables-save and diffed against what the state wants.

It must find a rule deleted by hand, a rule changed by hand (another DNAT destination), a shared-chain line deleted by
hand, a stray chain, and a table someone else flushed, and say nothing once a full sync has repaired them (real rules,
in a namespace of the test's own).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from kproxy.backends.iptables import render
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import Changes, Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

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
STATE = ProxyState(
    {IPFamily.V4: MappingProxyType({A: SP_A, B: SP_B}), IPFamily.V6: MappingProxyType({})}, NODE, generation=1
)


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpt-vfy-", lo_up=True) as name:
        yield name


def ipt(netns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "iptables-nft", "-w", *args], check=True, timeout=30)


def test_verify_finds_hand_made_drift_and_a_full_sync_repairs_it(netns: str) -> None:
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16",), backend_options=MappingProxyType({"iptables_flavour": "nft"})
    )
    p = IptablesProxier(config, netns=netns)
    assert p.sync(STATE, Changes(full=True)).ok
    clean = p.verify(STATE)
    assert clean["drift"] == 0 and not clean["services"] and not clean["extra"] and not clean["errors"], clean

    # a rule deleted by hand in a service's own chain: A differs, B does not
    sep = render.endpoint_chain(A, "198.18.1.2:80")
    ipt(netns, "-t", "nat", "-F", sep)
    report = p.verify(STATE)
    assert set(report["services"]) == {"ns1/a:http/TCP"} and report["drift"] == 1, report
    assert sep in report["services"]["ns1/a:http/TCP"]["IPv4"]

    # a rule changed by hand: A's second endpoint now DNATs to another pod (the iptables form of a changed element)
    assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 0
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "iptables-nft", "-w", "-t", "nat", "-S", sep],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    lines = [ln for ln in out.splitlines() if ln.startswith(f"-A {sep} ")]
    index, dnat = next((i, ln) for i, ln in enumerate(lines, 1) if "--to-destination 198.18.1.2:80" in ln)
    changed = dnat.split(" ", 2)[2].replace("198.18.1.2:80", "198.18.1.9:80")
    ipt(netns, "-t", "nat", "-R", sep, str(index), *shlex.split(changed))
    report = p.verify(STATE)
    assert set(report["services"]) == {"ns1/a:http/TCP"} and report["drift"] == 1, report
    assert sep in report["services"]["ns1/a:http/TCP"]["IPv4"]

    # a line of the shared KUBE-SERVICES chain deleted by hand: B's jump is gone
    assert p.sync(STATE, Changes(full=True)).ok and p.verify(STATE)["drift"] == 0
    svc_b = render.service_chain(B)
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "iptables-nft", "-w", "-t", "nat", "-S", "KUBE-SERVICES"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    line = next(ln for ln in out.splitlines() if ln.endswith(f"-j {svc_b}"))
    ipt(netns, "-t", "nat", *shlex.split(line.replace("-A ", "-D ", 1)))
    report = p.verify(STATE)
    assert set(report["services"]) == {"ns1/b:http/TCP"}, report
    assert "KUBE-SERVICES" in report["services"]["ns1/b:http/TCP"]["IPv4"]

    # a stray service chain and a stray KUBE-SERVICES line nobody accounts for
    ipt(netns, "-t", "nat", "-N", "KUBE-SVC-STRAYSTRAYSTRAY")
    ipt(netns, "-t", "nat", "-A", "KUBE-SERVICES", "-d", "198.19.9.9/32", "-j", "KUBE-SVC-STRAYSTRAYSTRAY")
    report = p.verify(STATE)
    assert any("KUBE-SVC-STRAYSTRAYSTRAY" in x and "no service owns" in x for x in report["extra"]), report
    assert any("198.19.9.9" in x for x in report["extra"]), report

    # someone flushed the whole nat table: every service is missing
    ipt(netns, "-t", "nat", "-F")
    ipt(netns, "-t", "nat", "-X")
    report = p.verify(STATE)
    assert report["services"] == {
        "ns1/a:http/TCP": {"IPv4": "missing"},
        "ns1/b:http/TCP": {"IPv4": "missing"},
    }, report

    # a full sync repairs all of it (the stray chain included: it is not kproxy's own, so it is only reported once
    # it has a rule nothing explains; here the flush took it)
    assert p.sync(STATE, Changes(full=True)).ok
    assert p.verify(STATE)["drift"] == 0


def test_a_service_without_endpoints_is_no_drift(netns: str) -> None:
    """iptables-save spells REJECT's default (``--reject-with icmp-port-unreachable``) where kproxy leaves it out."""
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16",), backend_options=MappingProxyType({"iptables_flavour": "nft"})
    )
    p = IptablesProxier(config, netns=netns)
    lonely = ServicePort(ServicePortName("ns1", "c", "dns", Protocol.UDP), IPFamily.V4, "198.19.0.3", 53)
    st = ProxyState(
        {IPFamily.V4: MappingProxyType({A: SP_A, lonely.name: lonely}), IPFamily.V6: MappingProxyType({})}, NODE
    )
    assert p.sync(st, Changes(full=True)).ok
    report = p.verify(st)
    assert report["drift"] == 0, report
