"""Integration tests of the iptables backend against the real kernel, in network namespaces of their own.

Each test makes a namespace with the prefix ``kpt-ipt-`` (removed in the fixture's finalizer, also on failure) and
points the proxier at it (``IptablesProxier(config, netns=...)``: every iptables command then runs under
``ip netns exec``). Both flavours (nf_tables and legacy) run every test. Needs root.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kproxy.backends.iptables import cleanup, layout, render
from kproxy.backends.iptables.cleanup import cleanup_leftovers
from kproxy.backends.iptables.kernel import detect_flavour
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import (
    Changes,
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)
from kproxy.proxier import LocalProbe

from .scratch import scratch_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, iptables)"),
    pytest.mark.skipif(shutil.which("iptables-nft-restore") is None, reason="iptables not installed"),
]

NODE = NodeInfo("node-a", pod_cidrs=("198.18.1.0/24",))
A = ServicePortName("ns1", "a", "http", Protocol.TCP)
B = ServicePortName("ns1", "b", "dns", Protocol.UDP)
C = ServicePortName("ns1", "c", "http", Protocol.TCP)
D = ServicePortName("ns1", "d", "http", Protocol.TCP)
BAD = ServicePortName("ns1", "bad", "http", Protocol.TCP)


def ep(ip: str, port: int = 80) -> Endpoint:
    return Endpoint(ip, port)


SP_A = ServicePort(
    A,
    IPFamily.V4,
    "198.19.0.1",
    80,
    node_port=30080,
    cluster_endpoints=(ep("198.18.1.1"), ep("198.18.1.2")),
    has_any_endpoints=True,
)
SP_B = ServicePort(B, IPFamily.V4, "198.19.0.2", 53)
SP_C6 = ServicePort(
    C,
    IPFamily.V6,
    "fd00:198:18:ff::1",
    80,
    cluster_endpoints=(ep("fd00:198:18:1::1"),),
    has_any_endpoints=True,
    load_balancer_ips=("fd00:198:18:fe::1",),
    load_balancer_source_ranges=("fd00:198:18:1::/64",),
)
SP_D = ServicePort(D, IPFamily.V4, "198.19.0.4", 80, cluster_endpoints=(ep("198.18.1.4"),), has_any_endpoints=True)


def state(*sps: ServicePort) -> ProxyState:
    fams: dict[IPFamily, dict[ServicePortName, ServicePort]] = {IPFamily.V4: {}, IPFamily.V6: {}}
    for sp in sps:
        fams[sp.family][sp.name] = sp
    return ProxyState(fams, NODE)  # type: ignore[arg-type]


@pytest.fixture
def netns() -> Iterator[str]:
    with scratch_netns("kpt-ipt-") as name:
        yield name


def proxier(netns: str, flavour: str, **cfg: object) -> IptablesProxier:
    config = ProxyConfig(
        cluster_cidrs=("198.18.0.0/16", "fd00:198:18::/56"), backend_options={"iptables_flavour": flavour}, **cfg
    )  # type: ignore[arg-type]
    return IptablesProxier(config, netns=netns)


def ns_run(netns: str, *argv: str, check: bool = True) -> str:
    return subprocess.run(["ip", "netns", "exec", netns, *argv], check=check, capture_output=True, text=True).stdout


def save(netns: str, flavour: str, v6: bool = False, counters: bool = False) -> str:
    argv = [f"ip{'6' if v6 else ''}tables-{flavour}-save"] + (["-c"] if counters else [])
    return ns_run(netns, *argv)


def section(text: str, table: str) -> str:
    return text.split(f"*{table}\n", 1)[1].split("COMMIT", 1)[0]


def chains(text: str, table: str = "nat") -> set[str]:
    section_ = section(text, table)
    return {ln[1:].split(" ", 1)[0] for ln in section_.splitlines() if ln.startswith(":")}


def test_full_sync_programs_both_families(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour)
    res = p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True))
    assert res.ok and res.full, res.error
    v4, v6 = save(netns, flavour), save(netns, flavour, v6=True)
    svc = render.service_chain(A)
    sep1, sep2 = render.endpoint_chain(A, "198.18.1.1:80"), render.endpoint_chain(A, "198.18.1.2:80")
    assert {svc, sep1, sep2, render.external_chain(A), "KUBE-SERVICES", "KUBE-MARK-MASQ"} <= chains(v4)
    assert f'-A {sep1} -p tcp -m comment --comment "ns1/a:http" -m tcp -j DNAT --to-destination 198.18.1.1:80' in v4
    assert re.search(
        r'-A KUBE-SERVICES -d 198.19.0.2/32 -p udp -m comment --comment "ns1/b:dns has no endpoints" '
        r"-m udp --dport 53 -j REJECT",
        v4,
    )
    assert "KUBE-PROXY-CANARY" in chains(v4, "mangle") and "KUBE-PROXY-CANARY" in chains(v6, "filter")
    assert render.firewall_chain(C) in chains(v6)
    fw_last = f'-A {render.firewall_chain(C)} -m comment --comment "other traffic to ns1/c:http will be dropped by '
    assert fw_last + 'KUBE-PROXY-FIREWALL"\n' in v6
    assert "--to-destination [fd00:198:18:1::1]:80" in v6
    # localhost NodePorts on (upstream's default): IPv4's NodePort rule takes loopback too, IPv6's never does
    assert "! -d ::1/128" in v6 and "! -d 127.0.0.0/8" not in v4 and "-A KUBE-FIREWALL" in v4
    assert res.family(IPFamily.V4).rules["nat"] > 10 and res.family(IPFamily.V6).rules["filter"] >= 4
    described = p.describe(A)
    common, detail = described["services"]["ns1/a:http/TCP"]["IPv4"], described["detail"]["services"]
    assert common["applied"] and common["internal"] == "forward" and svc in detail["ns1/a:http/TCP"]["IPv4"]["chains"]
    outcomes = p.trace("198.18.1.50", "tcp", "198.19.0.1", 80)["outcomes"]
    assert sorted(o["verdict"] for o in outcomes) == ["DNAT 198.18.1.1:80", "DNAT 198.18.1.2:80"]
    # a second full sync adopts what is there: jumps are not duplicated, nothing is lost
    res = p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True))
    assert res.ok, res.error
    v4b = save(netns, flavour)
    for j in render.JUMP_RULES:
        table = v4b.split(f"*{j.table}\n", 1)[1].split("COMMIT", 1)[0]
        assert table.count(f"-A {j.chain} {j.spec}") == 1, j
    assert chains(v4b) == chains(v4)
    # adoption reads every chain back as equal, the FW chain's target-less last rule included: nothing rewritten
    assert not any(f":{render.firewall_chain(C)} " in t for t in p.last_payloads(IPFamily.V6))
    assert not any(f":{render.service_chain(A)} " in t for t in p.last_payloads(IPFamily.V4))


def test_partial_sync_writes_only_changed_chains(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True)).ok
    a2 = dataclasses.replace(SP_A, cluster_endpoints=(ep("198.18.1.1"), ep("198.18.1.3")))
    res = p.sync(state(a2, SP_B, SP_C6), Changes(full=False, services=frozenset({A})))
    assert res.ok and not res.full, res.error
    (payload,) = p.last_payloads(IPFamily.V4)
    assert p.last_payloads(IPFamily.V6) == []
    declared = {ln[1:].split(" ")[0] for ln in payload.splitlines() if ln.startswith(":")}
    old_sep = render.endpoint_chain(A, "198.18.1.2:80")
    new_sep = render.endpoint_chain(A, "198.18.1.3:80")
    assert declared == {
        render.service_chain(A),
        render.external_chain(A),
        new_sep,
        old_sep,
        render.endpoint_chain(A, "198.18.1.1:80"),
    }
    assert "*filter" not in payload and f"-X {old_sep}" in payload
    v4 = save(netns, flavour)
    assert new_sep in chains(v4) and old_sep not in chains(v4)
    # a new service rewrites nat KUBE-SERVICES only
    res = p.sync(state(a2, SP_B, SP_C6, SP_D), Changes(full=False, services=frozenset({D})))
    assert res.ok, res.error
    (payload,) = p.last_payloads(IPFamily.V4)
    assert ":KUBE-SERVICES" in payload and "*filter" not in payload and ":KUBE-NODEPORTS" not in payload
    # removing the endpoint-less service rewrites filter KUBE-SERVICES only
    res = p.sync(state(a2, SP_C6, SP_D), Changes(full=False, services=frozenset({B})))
    assert res.ok, res.error
    (payload,) = p.last_payloads(IPFamily.V4)
    assert payload.startswith("*filter\n:KUBE-SERVICES - [0:0]\n") and "*nat" not in payload
    assert "198.19.0.2" not in save(netns, flavour)
    # removing a service deletes all its chains
    res = p.sync(state(SP_C6, SP_D), Changes(full=False, services=frozenset({A})))
    assert res.ok, res.error
    assert not any(c.endswith(render.port_proto_hash(A)) for c in chains(save(netns, flavour)))


def test_partial_floor_replays_and_leaves_the_rules_as_they_were(netns: str, flavour: str) -> None:
    """``measure_partial_floor`` (for ``kproxy bench sync``) replays the last partial change; on nf_tables also with the
    built-in chains' jumps removed for a moment. Afterwards the kernel holds exactly what the sync wrote."""
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True)).ok
    assert p.measure_partial_floor() is None  # the last sync was a full one
    a2 = dataclasses.replace(SP_A, cluster_endpoints=(ep("198.18.1.1"), ep("198.18.1.3")))
    assert p.sync(state(a2, SP_B, SP_C6), Changes(full=False, services=frozenset({A}))).ok

    def rules() -> list[str]:
        text = save(netns, flavour) + save(netns, flavour, v6=True)
        return [ln for ln in text.splitlines() if not ln.startswith("#")]

    before = rules()
    figures = p.measure_partial_floor()
    assert figures is not None and 0 < figures["floor_s"] < 30
    assert ("unhooked_s" in figures) == (flavour == "nft")
    assert rules() == before
    v4 = save(netns, flavour)
    jumps = [ln for ln in section(v4, "nat").splitlines() if ln.startswith(("-A PREROUTING", "-A OUTPUT"))]
    assert len(jumps) == 2 and all("-j KUBE-SERVICES" in ln for ln in jumps)


def test_a_stale_chain_someone_else_jumps_to_is_left_and_the_sync_goes_on(netns: str, flavour: str) -> None:
    """The kernel refuses to delete a chain another chain still jumps to; the sync retries without deleting stale
    chains (the chain leaks) instead of failing at every sync."""
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True)).ok
    old_sep = render.endpoint_chain(A, "198.18.1.2:80")
    ns_run(netns, f"iptables-{flavour}", "-w", "-t", "nat", "-N", "OTHER-PROGRAM")
    ns_run(netns, f"iptables-{flavour}", "-w", "-t", "nat", "-A", "OTHER-PROGRAM", "-j", old_sep)
    a2 = dataclasses.replace(SP_A, cluster_endpoints=(ep("198.18.1.1"),))
    res = p.sync(state(a2, SP_B, SP_C6), Changes(full=False, services=frozenset({A})))
    assert res.ok and not res.failed, res.error
    v4 = save(netns, flavour)
    assert old_sep in chains(v4) and f"-A OTHER-PROGRAM -j {old_sep}" in v4
    svc_rules = [ln for ln in v4.splitlines() if ln.startswith(f"-A {render.service_chain(A)} ")]
    assert svc_rules and not any(old_sep in ln for ln in svc_rules)  # the service no longer uses it
    # a full sync (the next periodic one) also goes through, and deletes it once nothing jumps to it
    assert p.sync(state(a2, SP_B, SP_C6), Changes(full=True)).ok
    ns_run(netns, f"iptables-{flavour}", "-w", "-t", "nat", "-F", "OTHER-PROGRAM")
    assert p.sync(state(a2, SP_B, SP_C6), Changes(full=True)).ok
    assert old_sep not in chains(save(netns, flavour))


def test_canary_flush_forces_full_resync(netns: str, flavour: str) -> None:
    p = proxier(netns, flavour, sync_period=30.0)
    assert p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True)).ok
    before = chains(save(netns, flavour))
    for table in ("mangle", "nat", "filter"):  # what a firewall restart does (upstream notices it by mangle)
        ns_run(netns, f"iptables-{flavour}", "-t", table, "-F")
        ns_run(netns, f"iptables-{flavour}", "-t", table, "-X")
    assert not p.canary_present()
    # checked at most once per sync period, not on every partial sync: a sync right after the full one skips it
    res = p.sync(state(SP_A, SP_B, SP_C6), Changes(full=False))
    assert res.ok and not res.full and res.timings["canary"] == 0.0, res
    _age_checks(p, 30.0)  # a sync period passes (no clock in the test: the check's last time moves back)
    res = p.sync(state(SP_A, SP_B, SP_C6), Changes(full=False))
    assert res.ok and res.full and res.timings["canary"] > 0.0, res.error
    assert chains(save(netns, flavour)) == before
    assert p.canary_present()
    # present: the next check (a period later) finds it and the sync stays partial
    _age_checks(p, 30.0)
    res = p.sync(state(SP_A, SP_B, SP_C6), Changes(full=False))
    assert res.ok and not res.full and res.timings["canary"] > 0.0, res.error


def _age_checks(p: IptablesProxier, seconds: float) -> None:
    """Move the ledger's record of the last cheap check ``seconds`` back, as if that much time had passed."""
    checked = p.ledger._checked_at
    for fam in list(checked):
        checked[fam] -= seconds


def _send_udp(netns: str, ip: str, port: int, count: int) -> None:
    code = (
        "import socket\n"
        f"for _ in range({count}):\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"    s.sendto(b'x', ({ip!r}, {port}))\n"
        "    s.close()\n"
    )
    ns_run(netns, "/usr/bin/python3", "-c", code)


def _counter(text: str, *needles: str) -> int:
    for ln in text.splitlines():
        if ln.startswith("[") and all(n in ln for n in needles):
            return int(ln[1:].split(":", 1)[0])
    raise AssertionError(f"no rule with {needles!r}")


def test_restart_adopts_without_flushing(netns: str, flavour: str) -> None:
    # a route so that packets to service IPs reach the nat OUTPUT hook
    ns_run(netns, "ip", "link", "set", "lo", "up")
    ns_run(netns, "ip", "link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
    ns_run(netns, "ip", "link", "set", "kv0", "up")
    ns_run(netns, "ip", "link", "set", "kv1", "up")
    ns_run(netns, "ip", "addr", "add", "198.18.250.1/24", "dev", "kv0")
    ns_run(netns, "ip", "route", "add", "default", "via", "198.18.250.2")
    b_ok = dataclasses.replace(SP_B, cluster_endpoints=(ep("198.18.1.9", 53),), has_any_endpoints=True)
    p1 = proxier(netns, flavour)
    assert p1.sync(state(SP_A, b_ok), Changes(full=True)).ok
    _send_udp(netns, "198.19.0.2", 53, 5)
    jump = '--comment "kubernetes service portals" -j KUBE-SERVICES'
    out_before = _counter(section(save(netns, flavour, counters=True), "nat"), "-A OUTPUT ", jump)
    assert out_before >= 5
    # restart: a new instance's first sync is full, adopts, and never removes the jumps or KUBE-SERVICES
    p2 = proxier(netns, flavour)
    res = p2.sync(state(SP_A, b_ok), Changes(full=True))
    assert res.ok and res.full, res.error
    nat = section(save(netns, flavour, counters=True), "nat")
    assert _counter(nat, "-A OUTPUT ", jump) >= out_before  # the built-in chain's jump rule was kept, counters and all
    assert nat.count(jump) == 2  # PREROUTING and OUTPUT, once each
    # adoption: B's chains were already exactly right, so the restart did not rewrite them; their counters go on
    sep_b = render.endpoint_chain(B, "198.18.1.9:53")
    assert not any(f":{sep_b} " in text for text in p2.last_payloads(IPFamily.V4))
    _send_udp(netns, "198.19.0.2", 53, 3)
    dnat = f"-A {sep_b} -p udp"
    counted = _counter(section(save(netns, flavour, counters=True), "nat"), dnat)
    assert counted == 8
    # a partial sync of another service leaves B's chains (and their counters) alone
    res = p2.sync(state(SP_A, b_ok, SP_D), Changes(full=False, services=frozenset({D})))
    assert res.ok and not res.full, res.error
    assert _counter(section(save(netns, flavour, counters=True), "nat"), dnat) == 8
    _send_udp(netns, "198.19.0.2", 53, 2)
    assert _counter(section(save(netns, flavour, counters=True), "nat"), dnat) == 10
    # a chain changed behind kproxy's back (same rule count, other content) is repaired by the next full sync
    ipt = f"iptables-{flavour}"
    ns_run(netns, ipt, "-t", "nat", "-R", sep_b, "2", "-p", "udp", "-j", "DNAT", "--to-destination", "198.18.1.66:53")
    assert "198.18.1.66" in save(netns, flavour)
    p3 = proxier(netns, flavour)
    assert p3.sync(state(SP_A, b_ok, SP_D), Changes(full=True)).ok
    v4 = save(netns, flavour)
    assert "198.18.1.66" not in v4 and "--to-destination 198.18.1.9:53" in v4
    assert any(f":{sep_b} " in text for text in p3.last_payloads(IPFamily.V4))
    assert not any(f":{render.service_chain(A)} " in text for text in p3.last_payloads(IPFamily.V4))
    # B deleted while kproxy was down: its stale chains go, and it counts as the one service port written
    res = proxier(netns, flavour).sync(state(SP_A, SP_D), Changes(full=True))
    assert res.ok and res.families[IPFamily.V4].written == 1, res
    assert f":{sep_b} " not in save(netns, flavour)


LOCAL = ServicePortName("ns1", "local", "http", Protocol.TCP)
LOCAL_EP = Endpoint("198.18.1.5", 80, is_local=True)
# externalTrafficPolicy=Local with an endpoint on this node: the mode's KUBE-SVL- (and KUBE-EXT-) chains exist
SP_LOCAL = ServicePort(
    LOCAL,
    IPFamily.V4,
    "198.19.0.5",
    80,
    node_port=30085,
    external_policy_local=True,
    cluster_endpoints=(LOCAL_EP,),
    local_endpoints=(LOCAL_EP,),
    has_any_endpoints=True,
)


def kubelets_chains(netns: str, flavour: str) -> None:
    """kubelet's own KUBE- chains (upstream's kubelet_network_linux.go), which no cleanup of ours may touch."""
    ipt = f"iptables-{flavour}"
    ns_run(netns, ipt, "-N", "KUBE-FIREWALL")
    ns_run(netns, ipt, "-A", "INPUT", "-j", "KUBE-FIREWALL")
    for table in ("mangle", "nat", "filter"):
        ns_run(netns, ipt, "-t", table, "-N", "KUBE-KUBELET-CANARY")
    ns_run(netns, ipt, "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")


def test_cleanup_leaves_nothing_of_ours(netns: str, flavour: str) -> None:
    """Nothing of the mode left, by the widest reading: every KUBE- line of both families and both flavours that
    is not kubelet's (``cleanup.remnants``), after a sync that made every kind of chain, KUBE-SVL- included."""
    kubelets_chains(netns, flavour)
    ns_run(netns, f"iptables-{flavour}", "-t", "nat", "-N", "OTHER")
    ns_run(netns, f"iptables-{flavour}", "-t", "nat", "-A", "PREROUTING", "-j", "OTHER")
    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_B, SP_C6, SP_LOCAL), Changes(full=True)).ok
    before = cleanup.remnants(LocalProbe(netns))
    for prefix in ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"):
        assert any(f":{prefix}" in ln for ln in before), f"no {prefix} chain to clean up: {before}"
    p.cleanup()
    assert cleanup.remnants(LocalProbe(netns)) == []
    v4 = save(netns, flavour)
    assert "-A INPUT -j KUBE-FIREWALL" in v4 and "-A PREROUTING -j OTHER" in v4
    assert ":KUBE-KUBELET-CANARY" in section(v4, "nat") and ":KUBE-IPTABLES-HINT" in section(v4, "mangle")
    # the module-level function works with no proxier, on both flavours, and is idempotent
    assert p.sync(state(SP_A, SP_LOCAL), Changes(full=True)).ok
    assert cleanup.remnants(LocalProbe(netns))
    cleanup_leftovers(ProxyConfig(), netns=netns)
    cleanup_leftovers(ProxyConfig(), netns=netns)
    assert cleanup.remnants(LocalProbe(netns)) == []


def test_kernel_rejected_service_is_skipped(netns: str, flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = render.render_service

    def broken(sp: ServicePort, ctx: render.Context) -> render.Fragment:
        frag = original(sp, ctx)
        if sp.name != BAD:
            return frag
        chain = frag.chains[0]
        return dataclasses.replace(frag, rules=frag.rules + (f"-A {chain} -m nosuchmatch --foo -j ACCEPT",))

    monkeypatch.setattr(render, "render_service", broken)
    sp_bad = ServicePort(
        BAD, IPFamily.V4, "198.19.0.9", 80, cluster_endpoints=(ep("198.18.1.9"),), has_any_endpoints=True
    )
    p = proxier(netns, flavour)
    res = p.sync(state(SP_A, SP_B, sp_bad, SP_C6), Changes(full=True))
    assert res.ok, res.error
    assert set(res.failed) == {BAD} and "nosuchmatch" in res.failed[BAD]
    assert res.family(IPFamily.V4).kernel_refusals == 1 and not res.failed_families  # refused once, then recovered
    v4 = save(netns, flavour)
    assert render.service_chain(A) in chains(v4) and "198.19.0.9" not in v4
    assert render.service_chain(BAD) not in chains(v4)
    assert p.describe(BAD)["services"]["ns1/bad:http/TCP"]["IPv4"]["failed"]
    with scratch_netns("kpt-ipf-") as scratch:
        assert p.measure_floor(scratch) is not None  # the payloads kept for the floor are those that applied
    # a partial sync touching it again reports it again and applies the rest
    a2 = dataclasses.replace(SP_A, cluster_endpoints=(ep("198.18.1.1"),))
    res = p.sync(state(a2, SP_B, sp_bad, SP_C6), Changes(full=False, services=frozenset({A, BAD})))
    assert res.ok and set(res.failed) == {BAD}, res
    assert render.endpoint_chain(A, "198.18.1.2:80") not in chains(save(netns, flavour))
    # fixed: it is applied
    monkeypatch.setattr(render, "render_service", original)
    res = p.sync(state(a2, SP_B, sp_bad, SP_C6), Changes(full=False, services=frozenset({BAD})))
    assert res.ok and not res.failed
    assert render.service_chain(BAD) in chains(save(netns, flavour))
    assert p.describe(BAD)["services"]["ns1/bad:http/TCP"]["IPv4"]["applied"] is True


def test_flavour_detection_and_floor(netns: str) -> None:
    assert detect_flavour(netns) == "nft"
    p = proxier(netns, "legacy")
    assert p.sync(state(SP_A, SP_B), Changes(full=True)).ok
    assert detect_flavour(netns) == "legacy"  # legacy tables hold KUBE-* chains
    with scratch_netns("kpt-ipf-") as scratch:
        floor = p.measure_floor(scratch)
    assert floor is not None and 0 < floor < 30
    auto = IptablesProxier(ProxyConfig(cluster_cidrs=("198.18.0.0/16",)), netns=netns)
    assert auto.kernel.flavour == "legacy"


@pytest.fixture
def netns2() -> Iterator[str]:
    with scratch_netns("kpt-ipt-") as name:
        yield name


SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.251.2", 8080))
s.listen(4)
s.settimeout(20)
print("ready", flush=True)
for _ in range(2):
    try:
        c, addr = s.accept()
    except OSError:
        break
    c.sendall(("hello from " + addr[0]).encode())
    c.close()
"""

CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print(s.recv(100).decode())
"""


def test_real_packets_clusterip_and_reject(netns: str, netns2: str, flavour: str) -> None:
    """A ClusterIP is DNATed to a TCP listener in another namespace; a service without endpoints refuses fast."""
    subprocess.run(
        ["ip", "link", "add", "kv0", "netns", netns, "type", "veth", "peer", "name", "kv1", "netns", netns2], check=True
    )
    for ns, dev, addr in ((netns, "kv0", "198.18.251.1/24"), (netns2, "kv1", "198.18.251.2/24")):
        ns_run(ns, "ip", "link", "set", "lo", "up")
        ns_run(ns, "ip", "addr", "add", addr, "dev", dev)
        ns_run(ns, "ip", "link", "set", dev, "up")
    ns_run(netns, "ip", "route", "add", "default", "via", "198.18.251.2")
    svc = ServicePort(
        A, IPFamily.V4, "198.19.0.1", 80, cluster_endpoints=(ep("198.18.251.2", 8080),), has_any_endpoints=True
    )
    empty = ServicePort(D, IPFamily.V4, "198.19.0.4", 80)
    p = proxier(netns, flavour)
    assert p.sync(state(svc, empty), Changes(full=True)).ok
    server = subprocess.Popen(
        ["ip", "netns", "exec", netns2, "/usr/bin/python3", "-c", SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = ns_run(netns, "/usr/bin/python3", "-c", CLIENT, "198.19.0.1", "80")
        assert out.strip() == "hello from 198.18.251.1"  # node-originated: not masqueraded, reached the pod
        refused = subprocess.run(
            ["ip", "netns", "exec", netns, "/usr/bin/python3", "-c", CLIENT, "198.19.0.4", "80"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert refused.returncode != 0 and "ConnectionRefusedError" in refused.stderr
    finally:
        server.kill()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()


def test_failing_family_does_not_stop_the_other(netns: str, flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a line outside every service that the kernel refuses, in IPv4's payload only: IPv4 cannot be synced at all
    original = render.render_fixed

    def broken(ctx: render.Context) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        fixed = original(ctx)
        if ctx.family == IPFamily.V4:
            head, tail = fixed[render.N_MARK_MASQ]
            fixed[render.N_MARK_MASQ] = ((*head, "-A KUBE-MARK-MASQ -m nosuchmatch --foo -j ACCEPT"), tail)
        return fixed

    monkeypatch.setattr(layout, "render_fixed", broken)
    p = proxier(netns, flavour)
    res = p.sync(state(SP_A, SP_C6), Changes(full=True))
    assert not res.ok and res.error is not None and res.error.startswith("IPv4: ") and "IPv6" not in res.error
    assert res.failed_families == {IPFamily.V4} and res.family(IPFamily.V4).kernel_refusals >= 1
    assert res.family(IPFamily.V6).kernel_refusals == 0
    assert render.service_chain(A) not in save(netns, flavour)
    v6 = save(netns, flavour, v6=True)
    assert render.firewall_chain(C) in chains(v6) and "--to-destination [fd00:198:18:1::1]:80" in v6
    # IPv6 is done; IPv4 keeps needing a full sync while IPv6 takes partial ones
    c2 = dataclasses.replace(SP_C6, cluster_endpoints=(ep("fd00:198:18:1::2"),))
    res = p.sync(state(SP_A, c2), Changes(full=False, services=frozenset({C})))
    assert not res.ok and res.full and res.error is not None and res.error.startswith("IPv4: ")
    (payload6,) = p.last_payloads(IPFamily.V6)
    assert "KUBE-PROXY-CANARY" not in payload6 and "[fd00:198:18:1::2]:80" in save(netns, flavour, v6=True)
    # fixed: the next (partial) sync brings IPv4 up with a full sync of that family alone
    monkeypatch.setattr(layout, "render_fixed", original)
    res = p.sync(state(SP_A, c2), Changes(full=False, services=frozenset()))
    assert res.ok and res.full, res.error
    assert render.service_chain(A) in chains(save(netns, flavour))
    assert any("KUBE-PROXY-CANARY" in t for t in p.last_payloads(IPFamily.V4)) and p.last_payloads(IPFamily.V6) == []
    res = p.sync(state(SP_A, c2), Changes(full=False, services=frozenset()))
    assert res.ok and not res.full, res.error


def test_refused_update_keeps_the_old_rules(netns: str, flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = render.render_service

    def broken(sp: ServicePort, ctx: render.Context) -> render.Fragment:
        frag = original(sp, ctx)
        if sp.name != A or not sp.external_ips:  # only A's update is refused
            return frag
        chain = frag.chains[0]
        return dataclasses.replace(frag, rules=frag.rules + (f"-A {chain} -m nosuchmatch --foo -j ACCEPT",))

    p = proxier(netns, flavour)
    assert p.sync(state(SP_A, SP_B, SP_C6), Changes(full=True)).ok
    before = save(netns, flavour)
    monkeypatch.setattr(render, "render_service", broken)
    # the update adds filter lines (a DROP for the external IP, no local endpoints) and refused nat lines: the filter
    # table may commit before nat is refused, so the retry writes the filter chain back too
    a2 = dataclasses.replace(
        SP_A,
        cluster_endpoints=(ep("198.18.1.1"), ep("198.18.1.3")),
        external_ips=("198.19.0.50",),
        external_policy_local=True,
    )
    res = p.sync(state(a2, SP_B, SP_C6), Changes(full=False, services=frozenset({A})))
    assert res.ok and set(res.failed) == {A} and "nosuchmatch" in res.failed[A], res
    after = save(netns, flavour)
    assert "198.19.0.50" not in after and "198.18.1.3" not in after and "nosuchmatch" not in after
    assert section(after, "nat") == section(before, "nat") and section(after, "filter") == section(before, "filter")
    info = p.describe(A)["services"]["ns1/a:http/TCP"]["IPv4"]
    assert info["applied"] and info["failed"] and info["internalEndpoints"] == ["198.18.1.1:80", "198.18.1.2:80"]
    # a full sync still refused: the old rules stay (adopted as they are, not even rewritten)
    res = p.sync(state(a2, SP_B, SP_C6), Changes(full=True))
    assert res.ok and set(res.failed) == {A}, res
    assert section(save(netns, flavour), "nat") == section(before, "nat")
    assert not any(f":{render.service_chain(A)} " in t for t in p.last_payloads(IPFamily.V4))
    # fixed: the update lands
    monkeypatch.setattr(render, "render_service", original)
    res = p.sync(state(a2, SP_B, SP_C6), Changes(full=False, services=frozenset({A})))
    assert res.ok and not res.failed, res
    v4 = save(netns, flavour)
    assert "198.19.0.50" in v4 and "--to-destination 198.18.1.3:80" in v4
    assert not p.describe(A)["services"]["ns1/a:http/TCP"]["IPv4"]["failed"]
