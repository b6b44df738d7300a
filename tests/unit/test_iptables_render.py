"""Unit tests of the iptables backend's pure parts: rendering (rule by rule, and golden payloads), partial-sync
planning, payload chunking, failure attribution and cleanup selection. No root, no kernel.

Golden files live in tests/unit/golden/iptables/; regenerate with ``KPROXY_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kproxy import nodeaddr
from kproxy.backends.iptables import adopt, render
from kproxy.backends.iptables import trace as tr
from kproxy.backends.iptables.cleanup import cleanup_payload, cleanup_payloads
from kproxy.backends.iptables.proxier import IptablesProxier
from kproxy.config import ProxyConfig
from kproxy.model import IPFamily, Protocol, ProxyState, ServicePort, ServicePortName

from .iptables_objects import CFG, CTX4, NODE, ep, lines, spn, svc

GOLDEN = Path(__file__).parent / "golden" / "iptables"


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KPROXY_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with KPROXY_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


def full_payload(services: list[ServicePort], ctx: render.Context = CTX4) -> str:
    frags = {sp.name: render.render_service(sp, ctx) for sp in services}
    return render.build_restore(ctx, frags, write=None, top=None, jump_rules=ctx.jump_rules, canary=True).text


# ------------------------------------------------------------------------------------------------ names


def test_hash16_is_base32_of_sha256() -> None:
    """The hand-rolled encoder equals upstream's base32(sha256(...))[:16] on many inputs, not just the examples."""
    import base64
    import hashlib

    for i in range(2000):
        text = f"ns-{i}/svc-{i * 7919}:p{i % 13}tcp198.18.{i % 256}.{i // 256}:{8000 + i}"
        assert render._hash16(text) == base64.b32encode(hashlib.sha256(text.encode()).digest())[:16].decode()


def test_hashing_matches_upstream_examples() -> None:
    assert render.service_chain(spn("kube-dns", "dns", Protocol.UDP, "kube-system")) == "KUBE-SVC-TCOU7JCQXEZGVUNU"
    assert render.service_chain(spn("kube-dns", "dns-tcp", Protocol.TCP, "kube-system")) == "KUBE-SVC-ERIFXISQEP7F7OF4"
    # SEP adds the endpoint string; SVL/EXT/FW share the service hash
    s = spn("kube-dns", "dns", Protocol.UDP, "kube-system")
    assert render.local_chain(s) == "KUBE-SVL-TCOU7JCQXEZGVUNU"
    assert render.external_chain(s) == "KUBE-EXT-TCOU7JCQXEZGVUNU"
    assert render.firewall_chain(s) == "KUBE-FW-TCOU7JCQXEZGVUNU"
    import base64
    import hashlib

    want = base64.b32encode(hashlib.sha256(b"kube-system/kube-dns:dnsudp10.244.0.5:53").digest()).decode()[:16]
    assert render.endpoint_chain(s, "10.244.0.5:53") == "KUBE-SEP-" + want


def test_unnamed_port_hash_omits_colon() -> None:
    s = ServicePortName("ns", "web", "", Protocol.TCP)
    import base64
    import hashlib

    want = base64.b32encode(hashlib.sha256(b"ns/webtcp").digest()).decode()[:16]
    assert render.service_chain(s) == "KUBE-SVC-" + want


def test_probabilities_formatted_as_upstream() -> None:
    assert [render.probability(n) for n in (2, 3, 7)] == ["0.5000000000", "0.3333333333", "0.1428571429"]


# ------------------------------------------------------------------------------------------------ behaviours


def test_clusterip_single_endpoint() -> None:
    sp = svc("a", (ep("198.18.1.5"),))
    h = render.port_proto_hash(sp.name)
    sep = render.endpoint_chain(sp.name, "198.18.1.5:8080")
    assert lines(sp) == [
        f'-A KUBE-SERVICES -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        f"-j KUBE-SVC-{h}",
        f'-A KUBE-SVC-{h} -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        "! -s 198.18.0.0/16 -j KUBE-MARK-MASQ",
        f'-A KUBE-SVC-{h} -m comment --comment "ns1/a:http -> 198.18.1.5:8080" -j {sep}',
        f"-A {sep} -m comment --comment ns1/a:http -s 198.18.1.5 -j KUBE-MARK-MASQ",  # hairpin
        f"-A {sep} -m comment --comment ns1/a:http -m tcp -p tcp -j DNAT --to-destination 198.18.1.5:8080",
    ]
    assert render.render_service(sp, CTX4).chains == (f"KUBE-SVC-{h}", sep)


def test_multiple_endpoints_statistic_probabilities() -> None:
    sp = svc("a", (ep("198.18.1.5"), ep("198.18.1.6"), ep("198.18.1.7")))
    svc_rules = [x for x in lines(sp) if x.startswith("-A KUBE-SVC-") and "-> " in x]
    assert len(svc_rules) == 3
    assert "--probability 0.3333333333 -j KUBE-SEP-" in svc_rules[0]
    assert "--probability 0.5000000000 -j KUBE-SEP-" in svc_rules[1]
    assert "statistic" not in svc_rules[2]  # the last rule is unconditional


def test_no_endpoints_reject_in_filter_only() -> None:
    sp = svc("a", (), node_port=30001, external_ips=("198.19.0.9",))
    frag = render.render_service(sp, CTX4)
    assert frag.chains == () and frag.rules == ()
    assert frag.top[render.F_SERVICES] == (
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http has no endpoints" -m tcp -p tcp -d 198.18.200.1 '
        "--dport 80 -j REJECT",
    )
    assert frag.top[render.F_EXTERNAL] == (
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/a:http has no endpoints" -m tcp -p tcp -d 198.19.0.9 '
        "--dport 80 -j REJECT",
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/a:http has no endpoints" -m addrtype --dst-type LOCAL '
        "-m tcp -p tcp --dport 30001 -j REJECT",
    )
    assert render.N_SERVICES not in frag.top and render.N_NODEPORTS not in frag.top


def test_itp_local_without_local_endpoints_drops_clusterip() -> None:
    sp = svc("a", (ep("198.18.2.5"),), internal_policy_local=True, has_any_endpoints=True)
    frag = render.render_service(sp, CTX4)
    assert frag.top == {
        render.F_SERVICES: (
            '-A KUBE-SERVICES -m comment --comment "ns1/a:http has no local endpoints" -m tcp -p tcp '
            "-d 198.18.200.1 --dport 80 -j DROP",
        )
    }
    assert frag.chains == ()  # no cluster chain: nothing else uses the cluster endpoints


def test_etp_local_short_circuit_and_local_chain() -> None:
    local = ep("198.18.1.5", local=True)
    remote = ep("198.18.2.5")
    sp = svc("a", (local, remote), local_endpoints=(local,), external_policy_local=True, node_port=30001)
    h = render.port_proto_hash(sp.name)
    got = lines(sp)
    ext = [x for x in got if x.startswith(f"-A KUBE-EXT-{h}")]
    assert ext == [
        f'-A KUBE-EXT-{h} -m comment --comment "pod traffic for ns1/a:http external destinations" '
        f"-s 198.18.0.0/16 -j KUBE-SVC-{h}",
        f'-A KUBE-EXT-{h} -m comment --comment "masquerade LOCAL traffic for ns1/a:http external destinations" '
        "-m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        f'-A KUBE-EXT-{h} -m comment --comment "route LOCAL traffic for ns1/a:http external destinations" '
        f"-m addrtype --src-type LOCAL -j KUBE-SVC-{h}",
        f"-A KUBE-EXT-{h} -j KUBE-SVL-{h}",
    ]
    svl = [x for x in got if x.startswith(f"-A KUBE-SVL-{h}")]
    assert len(svl) == 1 and "198.18.1.5:8080" in svl[0]
    assert f"-A KUBE-NODEPORTS -m comment --comment ns1/a:http -m tcp -p tcp --dport 30001 -j KUBE-EXT-{h}" in got
    chains = render.render_service(sp, CTX4).chains
    assert sum(c.startswith("KUBE-SEP-") for c in chains) == 2  # both endpoints reachable, each chain once


def test_etp_local_without_local_endpoints_drops_external_but_keeps_short_circuit() -> None:
    sp = svc("a", (ep("198.18.2.5"),), external_policy_local=True, node_port=30001, has_any_endpoints=True)
    h = render.port_proto_hash(sp.name)
    got = lines(sp)
    assert f"-A KUBE-EXT-{h} -j KUBE-SVL-{h}" not in got
    assert any(x.startswith(f"-A KUBE-EXT-{h}") and "--src-type LOCAL -j KUBE-SVC-" in x for x in got)
    assert (
        '-A KUBE-EXTERNAL-SERVICES -m comment --comment "ns1/a:http has no local endpoints" -m addrtype '
        "--dst-type LOCAL -m tcp -p tcp --dport 30001 -j DROP"
    ) in got


def test_nodeport_cluster_policy_masquerades_and_tail_rule() -> None:
    sp = svc("a", (ep("198.18.1.5"),), node_port=30080)
    h = render.port_proto_hash(sp.name)
    got = lines(sp)
    assert (
        f'-A KUBE-EXT-{h} -m comment --comment "masquerade traffic for ns1/a:http external destinations" '
        "-j KUBE-MARK-MASQ" in got
    )
    assert f"-A KUBE-EXT-{h} -j KUBE-SVC-{h}" in got
    tail = render.render_fixed(CTX4)[render.N_SERVICES][1]
    # upstream's rule with localhostNodePorts on (its default): loopback included, so 127.0.0.1:NODEPORT answers
    assert tail == (
        f"-A KUBE-SERVICES -m comment --comment {render.NODEPORTS_COMMENT} -m addrtype --dst-type LOCAL "
        "-j KUBE-NODEPORTS",
    )
    text = full_payload([sp])
    nat = text.split("*nat", 1)[1]
    svc_lines = [x for x in nat.splitlines() if x.startswith("-A KUBE-SERVICES")]
    assert "NOTE: this must be the last rule" in svc_lines[-1]


def test_nodeport_addresses_cidr_and_primary() -> None:
    cfg = CFG.with_(nodeport_addresses=("198.19.0.0/16", "fd00:198:18::/48"))
    ctx = render.make_context(cfg, NODE, IPFamily.V4)
    assert ctx.nodeport_destinations == (("-d", "198.19.0.0/16", "-m", "addrtype", "--dst-type", "LOCAL"),)
    ctx = render.make_context(CFG.with_(nodeport_addresses=("primary",)), NODE, IPFamily.V4)
    assert ctx.nodeport_destinations == (("-d", "198.19.255.1"),)
    ctx6 = render.make_context(CFG, NODE, IPFamily.V6)
    assert ctx6.nodeport_destinations == (("-m", "addrtype", "--dst-type", "LOCAL", "!", "-d", "::1/128"),)
    assert render.make_context(CFG, NODE, IPFamily.V4).nodeport_destinations == (
        ("-m", "addrtype", "--dst-type", "LOCAL"),
    )
    assert render.make_context(CFG.with_(localhost_nodeports=False), NODE, IPFamily.V4).nodeport_destinations == (
        ("-m", "addrtype", "--dst-type", "LOCAL", "!", "-d", "127.0.0.0/8"),
    )


def test_localhost_nodeports_as_upstream() -> None:
    """Upstream's rules while it serves localhost NodePorts (``localhostNodePorts``, IPv4): its copy of kubelet's
    ``KUBE-FIREWALL`` with the CVE-2020-8558 drop, jumped to from INPUT and OUTPUT; none of it otherwise."""
    on = full_payload([svc("a", (ep("198.18.1.5"),), node_port=30080)])
    drop = (
        '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 '
        "! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
    )
    filter_part = on.split("*filter", 1)[1].split("COMMIT", 1)[0].splitlines()
    assert ":KUBE-FIREWALL - [0:0]" in filter_part and drop in filter_part
    assert "-I INPUT 1 -j KUBE-FIREWALL" in filter_part and "-I OUTPUT 1 -j KUBE-FIREWALL" in filter_part
    off_ctx = render.make_context(CFG.with_(localhost_nodeports=False), NODE, IPFamily.V4)
    for ctx in (off_ctx, render.make_context(CFG, NODE, IPFamily.V6)):
        text = full_payload([], ctx)
        assert "KUBE-FIREWALL" not in text and not ctx.localhost_nodeports
        assert ctx.jump_rules == render.JUMP_RULES
    # partial syncs never declare (so never flush) kubelet's chain: only the full sync's shared chains do
    assert render.KUBELET_FIREWALL not in render.build_restore(CTX4, {}, write=(), top=[render.N_SERVICES]).text


def test_nodeport_addresses_match_all_and_loopback(caplog: pytest.LogCaptureFixture) -> None:
    everything4 = (("-m", "addrtype", "--dst-type", "LOCAL"),)  # localhostNodePorts on: loopback too
    everything6 = (("-m", "addrtype", "--dst-type", "LOCAL", "!", "-d", "::1/128"),)
    # a zero CIDR of the family means every local address, whatever else is listed
    cfg = CFG.with_(nodeport_addresses=("198.19.0.0/16", "0.0.0.0/0", "fd00:198:18::/48"))
    assert render.make_context(cfg, NODE, IPFamily.V4).nodeport_destinations == everything4
    assert render.make_context(cfg, NODE, IPFamily.V6).nodeport_destinations == (
        ("-d", "fd00:198:18::/48", "-m", "addrtype", "--dst-type", "LOCAL"),
    )
    cfg = CFG.with_(nodeport_addresses=("::/0", "198.19.0.0/16"))
    assert render.make_context(cfg, NODE, IPFamily.V6).nodeport_destinations == everything6
    # no CIDR of the family at all: every local address too (upstream's MatchAll per family)
    assert (
        render.make_context(cfg.with_(nodeport_addresses=("198.19.0.0/16",)), NODE, IPFamily.V6).nodeport_destinations
        == everything6
    )
    # a loopback CIDR serves 127.0.0.1 (upstream: the loopback address is one of the node IPs in the CIDR); with
    # --iptables-localhost-nodeports=false, or in IPv6, it is skipped with an error in the log (once per process)
    cfg = CFG.with_(nodeport_addresses=("127.0.0.0/8", "198.19.0.0/16", "::1/128", "127.0.0.1/32"))
    assert render.make_context(cfg, NODE, IPFamily.V4).nodeport_destinations == (
        ("-d", "198.19.0.0/16", "-m", "addrtype", "--dst-type", "LOCAL"),
        ("-d", "127.0.0.1"),
    )
    nodeaddr._log_once.cache_clear()  # the node context decides it, once for every backend
    with caplog.at_level("ERROR", logger=nodeaddr.__name__):
        off = cfg.with_(localhost_nodeports=False)
        assert render.make_context(off, NODE, IPFamily.V4).nodeport_destinations == (
            ("-d", "198.19.0.0/16", "-m", "addrtype", "--dst-type", "LOCAL"),
        )
        assert render.make_context(cfg, NODE, IPFamily.V6).nodeport_destinations == ()
        render.make_context(off, NODE, IPFamily.V4)
    logged = [r.getMessage() for r in caplog.records]
    assert sum("127.0.0.0/8" in m for m in logged) == 1 and any("::1/128" in m for m in logged), logged
    assert all("--iptables-localhost-nodeports=false" in m for m in logged if "127." in m), logged
    # a CIDR around loopback becomes the CIDRs around it (and 127.0.0.1 alone, localhost NodePorts being on)
    cfg = CFG.with_(nodeport_addresses=("0.0.0.0/1",), localhost_nodeports=False)
    dests = render.make_context(cfg, NODE, IPFamily.V4).nodeport_destinations
    assert [d[1] for d in dests] == [
        "0.0.0.0/2",
        "64.0.0.0/3",
        "96.0.0.0/4",
        "112.0.0.0/5",
        "120.0.0.0/6",
        "124.0.0.0/7",
        "126.0.0.0/8",
    ]
    # "primary" on a node without an address of the family is no CIDR of that family either
    assert (
        render.make_context(CFG.with_(nodeport_addresses=("primary",)), NODE, IPFamily.V6).nodeport_destinations
        == everything6
    )


def test_external_ips() -> None:
    sp = svc("a", (ep("198.18.1.5"),), external_ips=("198.19.0.9",))
    h = render.port_proto_hash(sp.name)
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http external IP" -m tcp -p tcp -d 198.19.0.9 --dport 80 '
        f"-j KUBE-EXT-{h}"
    ) in lines(sp)


def test_load_balancer_source_ranges() -> None:
    sp = svc(
        "a",
        (ep("198.18.1.5"),),
        load_balancer_ips=("198.19.0.10",),
        load_balancer_source_ranges=("198.19.128.0/17", "198.19.255.0/24"),
    )
    h = render.port_proto_hash(sp.name)
    got = lines(sp)
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns1/a:http loadbalancer IP" -m tcp -p tcp -d 198.19.0.10 --dport 80 '
        f"-j KUBE-FW-{h}"
    ) in got
    fw = [x for x in got if x.startswith(f"-A KUBE-FW-{h}")]
    assert fw == [
        f'-A KUBE-FW-{h} -m comment --comment "ns1/a:http loadbalancer IP" -s 198.19.128.0/17 -j KUBE-EXT-{h}',
        f'-A KUBE-FW-{h} -m comment --comment "ns1/a:http loadbalancer IP" -s 198.19.255.0/24 -j KUBE-EXT-{h}',
        # the node's address (198.19.255.1) is in a range: the LB IP is admitted as a source (VIP loop-back)
        f'-A KUBE-FW-{h} -m comment --comment "ns1/a:http loadbalancer IP" -s 198.19.0.10 -j KUBE-EXT-{h}',
        # upstream's last rule: no target, what reaches it is dropped by KUBE-PROXY-FIREWALL in filter
        f'-A KUBE-FW-{h} -m comment --comment "other traffic to ns1/a:http will be dropped by KUBE-PROXY-FIREWALL"',
    ]
    assert (
        f'-A KUBE-PROXY-FIREWALL -m comment --comment "ns1/a:http traffic not accepted by KUBE-FW-{h}" -m tcp -p tcp '
        "-d 198.19.0.10 --dport 80 -j DROP"
    ) in got


def test_session_affinity() -> None:
    sp = svc("a", (ep("198.18.1.5"), ep("198.18.1.6")), affinity_timeout=10800)
    h = render.port_proto_hash(sp.name)
    s1 = render.endpoint_chain(sp.name, "198.18.1.5:8080")
    got = [x for x in lines(sp) if x.startswith(f"-A KUBE-SVC-{h}") and "->" in x]
    assert got[0] == (
        f'-A KUBE-SVC-{h} -m comment --comment "ns1/a:http -> 198.18.1.5:8080" -m recent --name {s1} --rcheck '
        f"--seconds 10800 --reap -j {s1}"
    )
    assert "--rcheck" in got[1] and "statistic" in got[2] and "statistic" not in got[3]
    assert (
        f"-A {s1} -m comment --comment ns1/a:http -m recent --name {s1} --set -m tcp -p tcp -j DNAT "
        "--to-destination 198.18.1.5:8080"
    ) in lines(sp)


def test_masquerade_all_and_no_detector() -> None:
    sp = svc("a", (ep("198.18.1.5"),))
    h = render.port_proto_hash(sp.name)
    ctx = render.make_context(CFG.with_(masquerade_all=True), NODE, IPFamily.V4)
    assert (
        f'-A KUBE-SVC-{h} -m comment --comment "ns1/a:http cluster IP" -m tcp -p tcp -d 198.18.200.1 --dport 80 '
        "-j KUBE-MARK-MASQ"
    ) in lines(sp, ctx)
    bare = render.make_context(ProxyConfig(), NODE, IPFamily.V4)  # no cluster CIDR: no masquerade rule
    assert not any("cluster IP" in x and "KUBE-MARK-MASQ" in x for x in lines(sp, bare))
    nodecidr = render.make_context(CFG.with_(detect_local_mode="NodeCIDR"), NODE, IPFamily.V4)
    assert any("! -s 198.18.1.0/24 -j KUBE-MARK-MASQ" in x for x in lines(sp, nodecidr))


def test_ipv6() -> None:
    ctx6 = render.make_context(CFG, NODE, IPFamily.V6)
    sp = svc("a", (ep("fd00:198:18:1::5"),), cluster_ip="fd00:198:18:ff::1", family=IPFamily.V6)
    got = lines(sp, ctx6)
    assert any(x.endswith("-j DNAT --to-destination [fd00:198:18:1::5]:8080") for x in got)
    assert any("! -s fd00:198:18::/56 -j KUBE-MARK-MASQ" in x for x in got)
    empty = svc("b", (), cluster_ip="fd00:198:18:ff::2", family=IPFamily.V6)
    assert render.render_service(empty, ctx6).top[render.F_SERVICES][0].endswith("-j REJECT")


def test_health_check_node_port_accept() -> None:
    sp = svc("a", (ep("198.18.1.5"),), health_check_node_port=32000)
    assert render.render_service(sp, CTX4).top[render.F_NODEPORTS] == (
        '-A KUBE-NODEPORTS -m comment --comment "ns1/a:http health check node port" -m tcp -p tcp --dport 32000 '
        "-j ACCEPT",
    )


def test_comments_are_quoted_and_escaped() -> None:
    assert render.quote("plain text") == '"plain text"'
    assert render.quote('a"b\\c\nd') == '"a\\"b\\\\c d"'
    assert len(render.quote("x" * 1000)) <= 252
    assert len(render.quote("é" * 199).encode()) <= 252  # the limit is in bytes, not characters
    assert render.quote("é" * 10) == '"' + "é" * 10 + '"'
    odd = dataclasses.replace(svc("a", (ep("198.18.1.5"),)), name=ServicePortName("n s", 'we"b', "p", Protocol.TCP))
    for line in lines(odd):
        assert "\n" not in line
    assert any('--comment "n s/we\\"b:p cluster IP"' in x for x in lines(odd))
    sep_line = [x for x in lines(odd) if x.startswith("-A KUBE-SEP-")][0]
    assert '--comment "n s/we\\"b:p" ' in sep_line  # the bare word upstream writes gets quoted when needed


def test_fixed_chains() -> None:
    fixed = render.render_fixed(CTX4)
    assert fixed[render.N_POSTROUTING][0] == (
        "-A KUBE-POSTROUTING -m mark ! --mark 0x004000/0x004000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x004000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE '
        "--random-fully",
    )
    assert fixed[render.N_MARK_MASQ][0] == ("-A KUBE-MARK-MASQ -j MARK --or-mark 0x004000",)
    assert fixed[render.F_FORWARD][0][0] == "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"


def test_large_cluster_mode_drops_per_endpoint_comments() -> None:
    sp = svc("a", (ep("198.18.1.5"), ep("198.18.1.6")), affinity_timeout=60)
    ctx = render.make_context(CFG, NODE, IPFamily.V4, large_cluster=True)
    h = render.port_proto_hash(sp.name)
    sep = render.endpoint_chain(sp.name, "198.18.1.6:8080")
    got = lines(sp, ctx)
    assert f"-A KUBE-SVC-{h} -j {sep}" in got
    assert f"-A {sep} -s 198.18.1.6 -j KUBE-MARK-MASQ" in got
    assert f"-A {sep} -m recent --name {sep} --set -m tcp -p tcp -j DNAT --to-destination 198.18.1.6:8080" in got
    # the service-level rules keep theirs
    assert any(x.startswith("-A KUBE-SERVICES -m comment") for x in got)


# ------------------------------------------------------------------------------------------------ golden payloads


def _mixed() -> list[ServicePort]:
    a = svc("a", (ep("198.18.1.5"), ep("198.18.1.6")), node_port=30080, affinity_timeout=60)
    b = dataclasses.replace(svc("b"), name=spn("b", "dns", Protocol.UDP), port=53, cluster_ip="198.18.200.2")
    local = ep("198.18.1.7", local=True)
    c = dataclasses.replace(
        svc("c", (local, ep("198.18.2.7")), local_endpoints=(local,), external_policy_local=True),
        cluster_ip="198.18.200.3",
        node_port=30081,
        health_check_node_port=32001,
        load_balancer_ips=("198.19.0.10",),
        load_balancer_source_ranges=("198.19.128.0/17",),
        external_ips=("198.19.0.11",),
    )
    return [a, b, c]


def test_golden_full_ipv4() -> None:
    golden("full-ipv4.txt", full_payload(_mixed()))


def test_golden_full_ipv6() -> None:
    ctx6 = render.make_context(CFG, NODE, IPFamily.V6)
    a = svc("a6", (ep("fd00:198:18:1::5"), ep("fd00:198:18:1::6")), cluster_ip="fd00:198:18:ff::1", node_port=30090)
    b = svc("b6", (), cluster_ip="fd00:198:18:ff::2")
    golden("full-ipv6.txt", full_payload([a, b], ctx6))


# ------------------------------------------------------------------------------------------------ partial syncs


def test_partial_writes_only_dirty_chains_and_skips_unchanged_top() -> None:
    services = _mixed()
    old = {sp.name: render.render_service(sp, CTX4) for sp in services}
    a = services[0]
    a2 = dataclasses.replace(a, cluster_endpoints=(a.cluster_endpoints[0], ep("198.18.1.9")))
    new = render.render_service(a2, CTX4)
    assert render.changed_top_chains(old, {a.name: new}) == set()  # an endpoint change leaves KUBE-SERVICES alone
    frags = dict(old)
    frags[a.name] = new
    stale = set(old[a.name].chains) - set(new.chains)
    text = render.build_restore(CTX4, frags, write=[a.name], top=set(), delete_chains=stale).text
    assert "*filter" not in text and ":KUBE-SERVICES" not in text and ":KUBE-NODEPORTS" not in text
    declared = [x[1:].split(" ")[0] for x in text.splitlines() if x.startswith(":")]
    assert set(declared) == set(new.chains) | stale
    assert all(x.split(" ")[1] in new.chains for x in text.splitlines() if x.startswith("-A "))
    assert [x for x in text.splitlines() if x.startswith("-X ")] == [f"-X {c}" for c in sorted(stale)]
    golden("partial-endpoint-change.txt", text)


def test_partial_new_or_removed_service_rewrites_only_affected_top_chains() -> None:
    services = _mixed()
    old = {sp.name: render.render_service(sp, CTX4) for sp in services}
    d = dataclasses.replace(svc("d", (ep("198.18.1.8"),)), cluster_ip="198.18.200.4")
    assert render.changed_top_chains(old, {d.name: render.render_service(d, CTX4)}) == {render.N_SERVICES}
    assert render.changed_top_chains(old, {services[1].name: None}) == {render.F_SERVICES}
    # going from no endpoints to some moves the service from filter REJECT to a nat jump
    b2 = dataclasses.replace(services[1], cluster_endpoints=(ep("198.18.1.9", 53),), has_any_endpoints=True)
    assert render.changed_top_chains(old, {b2.name: render.render_service(b2, CTX4)}) == {
        render.F_SERVICES,
        render.N_SERVICES,
    }


def test_chunked_payloads_keep_services_whole_and_top_last() -> None:
    services = [
        dataclasses.replace(svc(f"s{i}", (ep("198.18.1.5"), ep("198.18.1.6"))), cluster_ip=f"198.18.9.{i}")
        for i in range(20)
    ]
    frags = {sp.name: render.render_service(sp, CTX4) for sp in services}
    parts = render.build_restores(
        CTX4, frags, write=None, top=None, jump_rules=render.JUMP_RULES, canary=True, chunk_lines=30
    )
    assert len(parts) > 3
    assert ":KUBE-MARK-MASQ " in parts[0].text  # every service chunk jumps to it
    for part in parts[:-1]:
        assert "*filter" not in part.text and ":KUBE-SERVICES" not in part.text
    assert ":KUBE-SERVICES" in parts[-1].text and "-I INPUT 1" in parts[-1].text
    for sp in services:  # each service's own chains are declared in exactly one payload
        holders = [p for p in parts if f":{render.service_chain(sp.name)} " in p.text]
        assert len(holders) == 1
        assert all(f":{c} " in holders[0].text for c in frags[sp.name].chains)
    single = render.build_restores(CTX4, frags, write=None, top=None, chunk_lines=None)
    assert len(single) == 1


def test_owner_of_maps_lines_to_services() -> None:
    services = _mixed()
    frags = {sp.name: render.render_service(sp, CTX4) for sp in services}
    res = render.build_restore(CTX4, frags, write=None, top=None)
    text_lines = res.text.split("\n")
    for i, line in enumerate(text_lines, start=1):
        if line.startswith("-A KUBE-SVC-" + render.port_proto_hash(services[0].name)):
            assert res.owner_of(i) == services[0].name
        if "ns1/b:dns has no endpoints" in line:
            assert res.owner_of(i) == services[1].name
        if line.startswith(":") or line == "COMMIT" or "KUBE-POSTROUTING" in line:
            assert res.owner_of(i) is None


# ------------------------------------------------------------------------------------------------ cleanup

SAVE = """# Generated by iptables-save v1.8.9
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-ROUTER-INPUT - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -m comment --comment "kubernetes service portals" -m conntrack --ctstate NEW -j KUBE-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -j KUBE-ROUTER-INPUT
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A KUBE-FIREWALL -d 127.0.0.0/8 -j DROP
-A KUBE-SERVICES -d 198.18.0.1/32 -j REJECT
-A KUBE-ROUTER-INPUT -j RETURN
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-SEP-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-XLB-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-MARK-DROP - [0:0]
:CNI-HOSTPORT - [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j CNI-HOSTPORT
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A CNI-HOSTPORT -j KUBE-MARK-MASQ
-A KUBE-SERVICES -j KUBE-SVC-ABCDEFGHIJKLMNOP
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -j MASQUERADE
COMMIT
"""


def test_cleanup_selects_only_our_chains_and_jumps() -> None:
    payload = cleanup_payload(SAVE)
    assert payload == (
        "*mangle\n"
        ":KUBE-PROXY-CANARY - [0:0]\n"
        "-X KUBE-PROXY-CANARY\n"
        "COMMIT\n"
        "*filter\n"
        ":KUBE-SERVICES - [0:0]\n"
        ":KUBE-FORWARD - [0:0]\n"
        '-D INPUT -m comment --comment "kubernetes service portals" -m conntrack --ctstate NEW -j KUBE-SERVICES\n'
        '-D FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD\n'
        "-X KUBE-SERVICES\n"
        "-X KUBE-FORWARD\n"
        "COMMIT\n"
        "*nat\n"
        ":KUBE-SERVICES - [0:0]\n"
        ":KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n"
        ":KUBE-SEP-ABCDEFGHIJKLMNOP - [0:0]\n"
        ":KUBE-XLB-ABCDEFGHIJKLMNOP - [0:0]\n"
        '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES\n'
        "-X KUBE-SERVICES\n"
        "-X KUBE-SVC-ABCDEFGHIJKLMNOP\n"
        "-X KUBE-SEP-ABCDEFGHIJKLMNOP\n"
        "-X KUBE-XLB-ABCDEFGHIJKLMNOP\n"
        "COMMIT\n"
    )
    for kept in ("KUBE-FIREWALL", "KUBE-ROUTER-INPUT", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP", "CNI-HOSTPORT"):
        assert f":{kept} " not in payload and f"-X {kept}" not in payload
    # the CNI portmap plugin's hostPort chain still marks for masquerade: the mark chain, the chain that honours
    # the mark, and the jump into it stay, as do the other program's rules
    for kept in ("KUBE-MARK-MASQ", "KUBE-POSTROUTING"):
        assert f":{kept} " not in payload and f"-X {kept}" not in payload
    assert "-D POSTROUTING" not in payload and "CNI-HOSTPORT" not in payload


def test_cleanup_of_clean_tables_is_empty() -> None:
    assert cleanup_payload("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n") == ""


@pytest.mark.parametrize("chunk", [None, 500])
def test_render_scales(chunk: int | None) -> None:
    """1,000 services x 10 endpoints render into the expected number of lines (speed is the benchmark's job)."""
    services = {}
    for i in range(1000):
        eps = tuple(ep(f"198.18.{i // 100}.{i % 100 + 1}", 8000 + j) for j in range(10))
        sp = dataclasses.replace(svc(f"s{i}", eps), cluster_ip=f"198.19.{i // 250}.{i % 250 + 1}")
        services[sp.name] = render.render_service(sp, CTX4)
    parts = render.build_restores(CTX4, services, write=None, top=None, chunk_lines=chunk)
    rules = sum(p.rules["nat"] for p in parts)
    assert rules == 1000 * (1 + 1 + 10 + 20) + 5  # KUBE-SERVICES, masq, 10 SVC jumps, 2 per SEP; fixed chains


def test_stream_restores_writes_what_build_restores_writes() -> None:
    """The streamed full sync (each chunk rendered while the previous one is applied) yields exactly the payloads,
    line owners and rule counts of build_restores, for a full write and for an adopting one; deletions are asked
    for only once every service was taken."""
    frags = {}
    for i in range(300):
        eps = tuple(ep(f"198.18.{i // 100}.{i % 100 + 1}", 8000 + j) for j in range(i % 4))
        sp = dataclasses.replace(svc(f"s{i}", eps), cluster_ip=f"198.19.{i // 250}.{i % 250 + 1}")
        frags[sp.name] = render.render_service(sp, CTX4)
    taken: list[ServicePortName] = []
    asked_after: list[int] = []

    def items(chosen: set[ServicePortName]) -> Iterator[tuple[ServicePortName, render.Fragment, bool]]:
        for s, f in frags.items():
            taken.append(s)
            yield s, f, s in chosen

    def deletes() -> list[str]:
        asked_after.append(len(taken))
        return ["KUBE-SEP-GONE"]

    for write in (None, [s for i, s in enumerate(frags) if i % 3]):
        expected = render.build_restores(
            CTX4,
            frags,
            write=write,
            top=None,
            delete_chains=["KUBE-SEP-GONE"],
            jump_rules=render.JUMP_RULES,
            canary=True,
            chunk_lines=200,
        )
        taken.clear()
        asked_after.clear()
        chosen = set(frags) if write is None else set(write)
        got = list(
            render.stream_restores(
                CTX4,
                items(chosen),
                top=None,
                delete_chains=deletes,
                jump_rules=render.JUMP_RULES,
                canary=True,
                chunk_lines=200,
            )
        )
        assert len(got) == len(expected) > 5
        assert [(r.text, r.owners, r.rules) for r in got] == [(r.text, r.owners, r.rules) for r in expected]
        assert asked_after == [300]


# ------------------------------------------------------------------------------------------------ packet explainer


def test_trace_clusterip_splits_over_endpoints() -> None:
    services = _mixed()
    frags = {sp.name: render.render_service(sp, CTX4) for sp in services}
    got = tr.trace(CTX4, frags, tr.Packet("198.18.1.20", "tcp", "198.18.200.1", 80))
    verdicts = sorted((o["verdict"], o["probability"], o["masquerade"]) for o in got["outcomes"])
    assert verdicts == [("DNAT 198.18.1.5:8080", 0.5, False), ("DNAT 198.18.1.6:8080", 0.5, False)]
    # from off-cluster: masqueraded
    got = tr.trace(CTX4, frags, tr.Packet("203.0.113.7", "tcp", "198.18.200.1", 80))
    assert all(o["masquerade"] for o in got["outcomes"])


def test_trace_reject_nodeport_and_firewall() -> None:
    services = _mixed()
    frags = {sp.name: render.render_service(sp, CTX4) for sp in services}
    (o,) = tr.trace(CTX4, frags, tr.Packet("198.18.1.20", "udp", "198.18.200.2", 53))["outcomes"]
    assert o["verdict"] == "REJECT" and "has no endpoints" in o["rules"][-1]
    # NodePort of the eTP=Local service from outside: only the local endpoint, source kept
    (o,) = tr.trace(CTX4, frags, tr.Packet("203.0.113.7", "tcp", "198.19.255.1", 30081, dst_local=True))["outcomes"]
    assert o["verdict"] == "DNAT 198.18.1.7:8080" and not o["masquerade"]
    # LB IP from a source outside loadBalancerSourceRanges: dropped by KUBE-PROXY-FIREWALL
    (o,) = tr.trace(CTX4, frags, tr.Packet("203.0.113.7", "tcp", "198.19.0.10", 80))["outcomes"]
    assert o["verdict"] == "DROP"
    allowed = tr.trace(CTX4, frags, tr.Packet("198.19.200.7", "tcp", "198.19.0.10", 80))["outcomes"]
    assert [x["verdict"] for x in allowed] == ["DNAT 198.18.1.7:8080"]
    # nothing for an unknown address
    (o,) = tr.trace(CTX4, frags, tr.Packet("198.18.1.20", "tcp", "198.18.77.77", 80))["outcomes"]
    assert o["verdict"] == "no service rule"


def test_trace_filter_hook_follows_the_packet() -> None:
    # the kernel's order of kproxy's jumps per built-in chain (each inserted at position 1, as upstream prepends)
    targets = {c: [r.target for r in tr.hook_rules(c)] for c in ("INPUT", "FORWARD", "OUTPUT")}
    assert targets == {
        "INPUT": ["KUBE-PROXY-FIREWALL", "KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES"],
        "FORWARD": ["KUBE-PROXY-FIREWALL", "KUBE-FORWARD", "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"],
        "OUTPUT": ["KUBE-PROXY-FIREWALL", "KUBE-SERVICES"],
    }
    e = svc("e", cluster_ip="198.18.200.5", node_port=30090, external_ips=("198.19.0.12",))  # no endpoints
    services = [*_mixed(), e]
    frags = {sp.name: render.render_service(sp, CTX4) for sp in services}

    def one(pkt: tr.Packet) -> tuple[str, str, list[str]]:
        got = tr.trace(CTX4, frags, pkt)
        (o,) = got["outcomes"]
        return got["hook"], o["verdict"], o["rules"]

    # healthCheckNodePort to the node: INPUT's KUBE-NODEPORTS accepts it
    hook, verdict, rules = one(tr.Packet("203.0.113.7", "tcp", "198.19.255.1", 32001, dst_local=True))
    assert (hook, verdict) == ("INPUT", "ACCEPT") and "health check node port" in rules[-1]
    assert rules[-2].startswith("-A INPUT ") and rules[-2].endswith("-j KUBE-NODEPORTS")
    # a NodePort without endpoints: INPUT reaches KUBE-EXTERNAL-SERVICES
    hook, verdict, rules = one(tr.Packet("203.0.113.7", "tcp", "198.19.255.1", 30090, dst_local=True))
    assert (hook, verdict) == ("INPUT", "REJECT") and rules[-2].endswith("-j KUBE-EXTERNAL-SERVICES")
    # ClusterIP without endpoints: FORWARD (from a pod) and OUTPUT (from the node) both pass KUBE-SERVICES
    for pkt, want in (
        (tr.Packet("198.18.1.20", "tcp", "198.18.200.5", 80), "FORWARD"),
        (tr.Packet("198.19.255.1", "tcp", "198.18.200.5", 80, src_local=True), "OUTPUT"),
    ):
        hook, verdict, rules = one(pkt)
        assert (hook, verdict) == (want, "REJECT") and rules[-2].startswith(f"-A {want} "), rules
    # an external IP without endpoints: rejected when forwarded, but OUTPUT has no KUBE-EXTERNAL-SERVICES jump
    assert one(tr.Packet("203.0.113.7", "tcp", "198.19.0.12", 80))[:2] == ("FORWARD", "REJECT")
    assert one(tr.Packet("198.19.255.1", "tcp", "198.19.0.12", 80, src_local=True))[:2] == (
        "OUTPUT",
        "no service rule",
    )
    # the LB firewall comes first in every hook
    hook, verdict, rules = one(tr.Packet("203.0.113.7", "tcp", "198.19.0.10", 80))
    assert (hook, verdict) == ("FORWARD", "DROP") and rules[-2].endswith("-j KUBE-PROXY-FIREWALL")
    assert "will be dropped by KUBE-PROXY-FIREWALL" in rules[-3]  # fell off the end of the nat KUBE-FW chain


# ------------------------------------------------------------------------------------------------ adoption


def test_adoption_canonical_form_matches_iptables_save_spelling() -> None:
    ours = (
        '-A KUBE-SVC-X -m comment --comment "ns/a:http cluster IP" -m tcp -p tcp -d 198.19.0.1 --dport 80 '
        "! -s 198.18.0.0/16 -j KUBE-MARK-MASQ"
    )
    saved = (
        '-A KUBE-SVC-X ! -s 198.18.0.0/16 -d 198.19.0.1/32 -p tcp -m comment --comment "ns/a:http cluster IP" '
        "-m tcp --dport 80 -j KUBE-MARK-MASQ"
    )
    assert adopt.canonical(ours) == adopt.canonical(saved)
    ours = (
        "-A KUBE-SEP-Y -m comment --comment ns/a:http -m recent --name KUBE-SEP-Y --set -m tcp -p tcp -j DNAT "
        "--to-destination 198.18.1.1:80"
    )
    saved = (
        '-A KUBE-SEP-Y -p tcp -m comment --comment "ns/a:http" -m recent --set --name KUBE-SEP-Y '
        "--mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 198.18.1.1:80"
    )
    assert adopt.canonical(ours) == adopt.canonical(saved)
    ours = '-A KUBE-SVC-X -m comment --comment "a -> b" -m statistic --mode random --probability 0.5000000000 -j S'
    saved = '-A KUBE-SVC-X -m comment --comment "a -> b" -m statistic --mode random --probability 0.50000000000 -j S'
    assert adopt.canonical(ours) == adopt.canonical(saved)
    # different sources, destinations or negation are different
    assert adopt.canonical("-A C -s 198.18.0.1 -d 198.18.0.2 -j X") != adopt.canonical(
        "-A C -s 198.18.0.2 -d 198.18.0.1 -j X"
    )
    assert adopt.canonical("-A C ! -s 198.18.0.0/16 -j X") != adopt.canonical("-A C -s 198.18.0.0/16 -j X")


@given(st.integers(min_value=0, max_value=2**32 - 1), st.sampled_from(["", "/32", "/24", "/0", "/33", "/x"]))
def test_adoption_address_fast_path_agrees_with_ipaddress(n: int, suffix: str) -> None:
    """The dotted-quad shortcut of the canonical form gives exactly what ipaddress gives (or the text as it was,
    where ipaddress refuses it), for every address and for spellings it must leave to ipaddress."""
    addr = str(ipaddress.IPv4Address(n))
    for value in (addr + suffix, "0" + addr + suffix, addr.replace(".", ".0", 1) + suffix):
        try:
            expected = str(ipaddress.ip_network(value, strict=False))
        except ValueError:
            expected = value
        assert adopt._network(value) == expected


def test_adoption_unchanged_needs_every_chain_and_rule_in_order() -> None:
    sp = svc("a", (ep("198.18.1.5"), ep("198.18.1.6")))
    frag = render.render_service(sp, CTX4)
    save = "*nat\n" + "".join(f":{c} - [0:0]\n" for c in frag.chains) + "\n".join(frag.rules) + "\nCOMMIT\n"
    kernel = adopt.kernel_service_chains(save)
    assert adopt.unchanged(frag, kernel)
    swapped = list(frag.rules)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    assert not adopt.unchanged(
        frag, adopt.kernel_service_chains(save.replace("\n".join(frag.rules), "\n".join(swapped)))
    )
    missing = {k: v for k, v in kernel.items() if k != frag.chains[-1]}
    assert not adopt.unchanged(frag, missing)
    extra = dict(kernel)
    extra[frag.chains[-1]] = kernel[frag.chains[-1]] + [adopt.canonical("-A X -j ACCEPT")[1]]
    assert not adopt.unchanged(frag, extra)


def test_chunked_cleanup_unhooks_and_flushes_before_deleting() -> None:
    payloads = cleanup_payloads(SAVE, chunk_lines=2)
    assert "".join(payloads) != cleanup_payload(SAVE)
    text = "".join(payloads)
    # every flush and every jump deletion comes before the first chain deletion, and each payload stands alone
    first_x = text.index("-X ")
    assert all(text.index(f":{c} - [0:0]") < first_x for c in ("KUBE-SERVICES", "KUBE-SEP-ABCDEFGHIJKLMNOP"))
    assert text.rindex("-D ") < first_x
    for p in payloads:
        body = p.splitlines()
        assert body[0].startswith("*") and body[-1] == "COMMIT" and 1 <= len(body) - 2 <= 2
    # the same lines as the single payload, only ordered and split
    strip = {"COMMIT"} | {ln for ln in text.splitlines() if ln.startswith("*")}
    single = [ln for ln in cleanup_payload(SAVE).splitlines() if ln not in strip]
    assert sorted(ln for ln in text.splitlines() if ln not in strip) == sorted(single)


def test_large_cluster_mode_counts_endpoints_per_family_once() -> None:
    v4 = tuple(ep(f"198.18.{i // 250}.{i % 250 + 1}") for i in range(600))
    v6 = tuple(ep(f"fd00:198:18::{i + 1:x}") for i in range(900))
    # eTP=Local: the local endpoints are also cluster endpoints; each counts once
    a = svc("a", v4, local_endpoints=v4[:500])
    b = svc("b", v4[:300], cluster_ip="198.18.200.2")
    c = svc("c", v6, cluster_ip="fd00:198:18:ff::1")
    st = ProxyState({IPFamily.V4: {a.name: a, b.name: b}, IPFamily.V6: {c.name: c}}, NODE, generation=7)
    p = IptablesProxier(CFG)  # no kernel touched: counting is pure
    assert p._endpoint_count(st, IPFamily.V4) == 900 and p._endpoint_count(st, IPFamily.V6) == 900
    # one family over upstream's threshold does not push the other over it
    more = svc("d", v4[:200], cluster_ip="198.18.200.3")
    st2 = ProxyState({IPFamily.V4: {a.name: a, b.name: b, more.name: more}, IPFamily.V6: {c.name: c}}, NODE, 8)
    assert p._endpoint_count(st2, IPFamily.V4) == 1100 > render.LARGE_CLUSTER_ENDPOINTS
    assert p._endpoint_count(st2, IPFamily.V6) == 900
