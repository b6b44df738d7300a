"""The nftables layout rendered for each behaviour (no root, no kernel): elements, chains, transactions, explainer,
and the adoption skeleton."""

from __future__ import annotations

import ipaddress

import pytest

from kproxy.backends.nftables import adopt, render, trace
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext, LocalDetect
from kproxy.toolkit.nft import elements

CTX4 = FamilyContext(IPFamily.V4, local=LocalDetect("cidr", ("198.18.0.0/16",)), node_ips=("198.19.255.1",))
CTX6 = FamilyContext(IPFamily.V6, local=LocalDetect("cidr", ("fd00:198:18::/56",)))


def spn(name: str, port: str = "http", proto: Protocol = Protocol.TCP, ns: str = "ns1") -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def ep(ip: str, port: int = 8080, local: bool = False) -> Endpoint:
    return Endpoint(ip, port, is_local=local, node_name="node-a" if local else "node-b")


def svc(name: str, eps: tuple[Endpoint, ...] = (), **kw: object) -> ServicePort:
    fam = IPFamily.V6 if ":" in str(kw.get("cluster_ip", "")) else IPFamily.V4
    base: dict[str, object] = dict(
        name=spn(name, proto=kw.pop("proto", Protocol.TCP)),  # type: ignore[arg-type]
        family=fam,
        cluster_ip="198.18.200.1",
        port=80,
        cluster_endpoints=eps,
        has_any_endpoints=bool(eps),
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


THREE = (ep("198.18.1.2"), ep("198.18.2.2"), ep("198.18.2.3"))


def elems(frag: render.Fragment, mapname: str) -> dict[str, str]:
    return {k: v for m, k, v in frag.elements if m == mapname}


# ----------------------------------------------------------------------------------------------- ClusterIP


def test_cluster_ip_goes_to_a_count_indexed_chain_and_slots() -> None:
    frag = render.render_service(svc("web", THREE), CTX4)
    assert elems(frag, render.SERVICE_IPS) == {"198.18.200.1 . tcp . 80": "goto lb-i-3"}
    assert elems(frag, render.slot_map(render.BACKENDS, "tcp")) == {
        "198.18.200.1 . tcp . 80 . 0": "198.18.1.2 . 8080",
        "198.18.200.1 . tcp . 80 . 1": "198.18.2.2 . 8080",
        "198.18.200.1 . tcp . 80 . 2": "198.18.2.3 . 8080",
    }
    assert frag.shared == ("lb-i-3",)
    assert frag.chains == () and frag.sets == ()
    assert frag.key == "ns1/web:http/TCP"
    assert render.shared_chain_rules("lb-i-3", IPFamily.V4) == (
        "jump masq-internal",
        "meta l4proto tcp dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @backends-tcp",
        "meta l4proto udp dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @backends-udp",
        "meta l4proto sctp dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @backends-sctp",
    )


def test_masquerade_all_and_no_local_detection_pick_other_chains() -> None:
    all_ = FamilyContext(IPFamily.V4, local=CTX4.local, masquerade_all=True)
    none = FamilyContext(IPFamily.V4)
    assert elems(render.render_service(svc("a", THREE), all_), render.SERVICE_IPS) == {
        "198.18.200.1 . tcp . 80": "goto lb-a-3"
    }
    assert elems(render.render_service(svc("a", THREE), none), render.SERVICE_IPS) == {
        "198.18.200.1 . tcp . 80": "goto lb-n-3"
    }
    assert render.shared_chain_rules("lb-a-2", IPFamily.V4)[0] == f"ct label set {render.MASQ_LABEL}"
    assert len(render.shared_chain_rules("lb-n-2", IPFamily.V4)) == 3


def test_no_endpoints_reject_every_address_tcp_and_udp() -> None:
    sp = svc("gone", external_ips=("198.18.100.1",), node_port=30080, proto=Protocol.UDP)
    frag = render.render_service(sp, CTX4)
    assert elems(frag, render.SERVICE_IPS) == {
        "198.18.200.1 . udp . 80": "goto reject-chain",
        "198.18.100.1 . udp . 80": "goto reject-chain",
    }
    assert elems(frag, render.SERVICE_NODEPORTS) == {"udp . 30080": "goto reject-chain"}
    assert not elems(frag, render.slot_map(render.BACKENDS, "tcp")) and frag.shared == ()
    rules = render.fixed_chain_rules(IPFamily.V4)[render.REJECT_CHAIN]
    assert rules == ("reject",)


def test_internal_policy_local_without_local_endpoints_drops() -> None:
    sp = svc("itp", THREE, internal_policy_local=True)
    frag = render.render_service(sp, CTX4)
    assert elems(frag, render.SERVICE_IPS) == {"198.18.200.1 . tcp . 80": "drop"}
    local = svc("itp", THREE, internal_policy_local=True, local_endpoints=(THREE[0],))
    frag = render.render_service(local, CTX4)
    assert elems(frag, render.SERVICE_IPS) == {"198.18.200.1 . tcp . 80": "goto lb-i-1"}
    assert elems(frag, render.slot_map(render.BACKENDS, "tcp")) == {"198.18.200.1 . tcp . 80 . 0": "198.18.1.2 . 8080"}


# ----------------------------------------------------------------------------------------------- external


def test_nodeport_and_external_ip_cluster_policy_masquerade() -> None:
    sp = svc("np", THREE, node_port=30080, external_ips=("198.18.100.1",))
    frag = render.render_service(sp, CTX4)
    assert elems(frag, render.SERVICE_NODEPORTS) == {"tcp . 30080": "goto np-a-3"}
    assert elems(frag, render.SERVICE_IPS)["198.18.100.1 . tcp . 80"] == "goto lb-a-3"
    assert elems(frag, render.slot_map(render.NODEPORT_BACKENDS, "tcp"))["tcp . 30080 . 2"] == "198.18.2.3 . 8080"
    assert elems(frag, render.slot_map(render.BACKENDS, "tcp"))["198.18.100.1 . tcp . 80 . 0"] == "198.18.1.2 . 8080"
    assert set(frag.shared) == {"lb-i-3", "lb-a-3", "np-a-3"}
    assert render.shared_chain_rules("np-a-3", IPFamily.V4)[:2] == (
        f"ct label set {render.MASQ_LABEL}",
        "meta l4proto tcp dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-backends-tcp",
    )


def test_external_policy_local_short_circuits_pods_and_the_node() -> None:
    local = (ep("198.18.1.2", local=True),)
    sp = svc("etp", THREE, node_port=30081, external_ips=("198.18.100.2",), external_policy_local=True,
             local_endpoints=local)  # fmt: skip
    frag = render.render_service(sp, CTX4)
    assert elems(frag, render.SERVICE_IPS)["198.18.100.2 . tcp . 80"] == "goto lbl-1-3"
    assert elems(frag, render.SERVICE_NODEPORTS) == {"tcp . 30081": "goto npl-1-3"}
    assert elems(frag, render.slot_map(render.BACKENDS, "tcp"))["198.18.100.2 . tcp . 80 . 0"] == "198.18.1.2 . 8080"
    assert len(elems(frag, render.slot_map(render.SHORTCUT_BACKENDS, "tcp"))) == 3
    assert len([k for k in elems(frag, render.slot_map(render.NODEPORT_BACKENDS, "tcp"))]) == 1
    assert {"lbl-1-3", "sc-3", "lb-n-1", "npl-1-3", "npsc-3", "np-n-1"} <= set(frag.shared)
    assert render.shared_chain_rules("lbl-1-3", IPFamily.V4) == (
        "ip saddr @local-cidrs goto sc-3",
        "iifname @local-ifaces goto sc-3",
        f"fib saddr type local ct label set {render.MASQ_LABEL} goto sc-3",
        "goto lb-n-1",
    )
    # this node has no local endpoint: only pods and the node itself get through, the rest is dropped
    none_local = svc("etp", THREE, node_port=30081, external_policy_local=True)
    frag = render.render_service(none_local, CTX4)
    assert elems(frag, render.SERVICE_NODEPORTS) == {"tcp . 30081": "goto npl-0-3"}
    assert render.shared_chain_rules("npl-0-3", IPFamily.V4)[-1] == "drop"
    assert "np-n-0" not in frag.shared


def test_load_balancer_source_ranges_firewall() -> None:
    sp = svc("lb", THREE, load_balancer_ips=("198.18.150.1",), load_balancer_source_ranges=("203.0.113.0/24",))
    frag = render.render_service(sp, CTX4)
    assert elems(frag, render.SERVICE_IPS)["198.18.150.1 . tcp . 80"] == "goto fw-lb-a-3"
    assert elems(frag, render.FIREWALL) == {"198.18.150.1 . tcp . 80 . 203.0.113.0/24": ""}
    assert render.shared_chain_rules("fw-lb-a-3", IPFamily.V4) == (
        "ip daddr . meta l4proto . th dport . ip saddr @firewall-allow goto lb-a-3",
        "drop",
    )
    # a range holding the node's address also admits the LB IPs themselves (upstream's VIP loop-back rule)
    sp = svc("lb", THREE, load_balancer_ips=("198.18.150.1",), load_balancer_source_ranges=("198.19.0.0/16",))
    assert "198.18.150.1 . tcp . 80 . 198.18.150.1" in elems(render.render_service(sp, CTX4), render.FIREWALL)


def test_session_affinity_uses_per_service_chains_and_timeout_sets() -> None:
    sp = svc("sticky", THREE[:2], affinity_timeout=30)
    frag = render.render_service(sp, CTX4)
    sid = render.service_chain_id(sp.name)
    chains = dict(frag.chains)
    assert elems(frag, render.SERVICE_IPS) == {"198.18.200.1 . tcp . 80": f"goto svc-{sid}-i"}
    assert chains[f"svc-{sid}-i"] == ("jump masq-internal", f"goto pick-{sid}-c")
    pick = chains[f"pick-{sid}-c"]
    assert pick[0].startswith(f"ip saddr @aff-{sid}-")
    assert pick[-1].startswith("numgen random mod 2 vmap { 0 : goto ep-")
    eps = [c for c in chains if c.startswith("ep-")]
    assert len(eps) == 2 and all(c.endswith("-30") for c in eps)
    assert chains[eps[0]][0].startswith("update @aff-") and chains[eps[0]][1].startswith("meta l4proto tcp dnat ip to ")
    assert all(spec == "type ipv4_addr; flags dynamic,timeout; timeout 30s;" for _, spec in frag.sets)
    assert frag.shared == () and not elems(frag, render.slot_map(render.BACKENDS, "tcp"))


def test_hairpin_elements_for_local_endpoints_only() -> None:
    eps = (ep("198.18.1.2", local=True), ep("198.18.2.2"))
    frag = render.render_service(svc("h", eps), CTX4)
    assert frag.hairpin == ("198.18.1.2 . 198.18.1.2",)


def test_ipv6_rendering() -> None:
    eps = (ep("fd00:198:18:1::2"),)
    sp = svc("six", eps, cluster_ip="fd00:198:18:ff::1", family=IPFamily.V6)
    frag = render.render_service(sp, CTX6)
    assert elems(frag, render.slot_map(render.BACKENDS, "tcp")) == {
        "fd00:198:18:ff::1 . tcp . 80 . 0": "fd00:198:18:1::2 . 8080"
    }
    assert render.shared_chain_rules("lb-i-1", IPFamily.V6)[1].startswith("meta l4proto tcp dnat ip6 to ip6 daddr")
    cmds = render.fixed_commands(IPFamily.V6)
    assert cmds[0] == f'add table ip6 kproxy {{ comment "{render.LAYOUT}"; }}'


# ----------------------------------------------------------------------------------------------- context


def test_context_sets() -> None:
    el = render.context_elements(CTX4)
    assert el[render.LOCAL_CIDRS] == ("198.18.0.0/16",) and el[render.LOCAL_IFACES] == ()
    nets = [ipaddress.ip_network(c) for c in el[render.NODEPORT_CIDRS]]
    assert not any(ipaddress.ip_address("127.0.0.1") in n for n in nets)
    assert any(ipaddress.ip_address("198.19.255.1") in n for n in nets)
    bridge = FamilyContext(IPFamily.V4, local=LocalDetect("bridge", ("cbr0",)))
    assert render.context_elements(bridge)[render.LOCAL_IFACES] == ('"cbr0"',)
    prefix = FamilyContext(IPFamily.V4, local=LocalDetect("prefix", ("veth",)), nodeport_all_local=False,
                           nodeport_cidrs=("198.19.0.0/16",), nodeport_ips=("198.20.0.1",))  # fmt: skip
    el = render.context_elements(prefix)
    assert el[render.LOCAL_IFACES] == ('"veth*"',)
    assert el[render.NODEPORT_CIDRS] == ("198.19.0.0/16", "198.20.0.1")
    overlapping = FamilyContext(
        IPFamily.V4,
        nodeport_all_local=False,
        nodeport_cidrs=("198.19.0.0/16", "198.19.1.0/24"),
        nodeport_ips=("198.19.2.3",),
    )
    assert render.context_elements(overlapping)[render.NODEPORT_CIDRS] == ("198.19.0.0/16",)
    with pytest.raises(ValueError):
        render.context_elements(FamilyContext(IPFamily.V4, local=LocalDetect("bridge", ('br"0',))))


def test_fixed_part_is_context_free_and_ordered() -> None:
    cmds = render.fixed_commands(IPFamily.V4)
    text = "\n".join(cmds)
    assert "add chain ip kproxy nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }" in text
    assert "add rule ip kproxy nat-postrouting ct label 127 masquerade fully-random" in text
    hairpin = "ct status dnat ip saddr . ip daddr @hairpin masquerade fully-random"
    assert f"add rule ip kproxy nat-postrouting {hairpin}" in text
    assert f"add chain ip kproxy {render.layout_chain(IPFamily.V4)}" in text
    assert "198.18" not in text  # nothing of the node context: it lives in the context sets


# ----------------------------------------------------------------------------------------------- transactions


def test_endpoint_change_writes_only_changed_slots_and_the_digest() -> None:
    """The entry (a verdict-map element) stays: adding one makes the kernel validate every element of the table's
    verdict maps at commit, a cost that grows with the number of services. Only the slot that changed and the
    service's digest element are written."""
    old = render.render_service(svc("web", THREE), CTX4)
    new = render.render_service(svc("web", (THREE[0], THREE[1], ep("198.18.3.3"))), CTX4)
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), old, new)
    text = tx.text()
    assert text.splitlines() == [
        "delete element ip kproxy backends-tcp {",
        "198.18.200.1 . tcp . 80 . 2",
        "}",
        "delete element ip kproxy service-digests {",
        "198.18.200.1 . tcp . 80",
        "}",
        "add element ip kproxy backends-tcp {",
        "198.18.200.1 . tcp . 80 . 2 : 198.18.3.3 . 8080",
        "}",
        "add element ip kproxy service-digests {",
        f'198.18.200.1 . tcp . 80 comment "ns1/web:http/TCP #{new.digest}"',
        "}",
    ]
    assert "service-ips" not in text
    assert [o for line, o in tx.lines() if not line.endswith(("{", "}"))] == [spn("web")] * 4
    assert tx.owner_of(2) == spn("web") and tx.owner_of(1) is None
    # a changed verdict (another endpoint count) rewrites the entry, under the service's name
    fewer = render.render_service(svc("web", THREE[:2]), CTX4)
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), old, fewer)
    assert '198.18.200.1 . tcp . 80 comment "ns1/web:http/TCP" : goto lb-i-2' in tx.text().splitlines()


def test_removal_deletes_every_key_and_affinity_chains_after_flushing() -> None:
    old = render.render_service(svc("sticky", THREE[:2], affinity_timeout=30), CTX4)
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("sticky"), old, None)
    lines = tx.text().splitlines()
    flushes = [i for i, line in enumerate(lines) if line.startswith("flush chain")]
    deletes = [i for i, line in enumerate(lines) if line.startswith("delete chain")]
    sets = [i for i, line in enumerate(lines) if line.startswith("delete set")]
    elem = [i for i, line in enumerate(lines) if line.startswith("delete element")]
    assert len(flushes) == len(deletes) == len(old.chains)
    assert max(flushes) < min(elem) < min(deletes) < min(sets)
    assert len(sets) == 2


def test_adopted_skeleton_derives_slot_keys() -> None:
    s = adopt.Service(
        digest="x",
        entries={
            (render.SERVICE_IPS, "198.18.200.1 . tcp . 80"): "goto lb-i-2",
            (render.SERVICE_NODEPORTS, "tcp . 30080"): "goto npl-1-2",
        },
        firewall=("198.18.150.1 . tcp . 80 . 203.0.113.0/24",),
    )
    keys = s.keys()
    assert ("backends-tcp", "198.18.200.1 . tcp . 80 . 1") in keys
    assert ("nodeport-backends-tcp", "tcp . 30080 . 0") in keys
    assert ("nodeport-shortcut-backends-tcp", "tcp . 30080 . 1") in keys
    assert (render.FIREWALL, "198.18.150.1 . tcp . 80 . 203.0.113.0/24") in keys
    assert len(keys) == 2 + 2 + 1 + 2 + 1


def test_adoption_parses_libnftables_json_and_compares_digests() -> None:
    frag = render.render_service(svc("web", THREE), CTX4)
    listing = [
        {
            "map": {
                "name": "service-ips",
                "elem": [
                    [
                        {"elem": {"val": {"concat": ["198.18.200.1", "tcp", 80]}, "comment": frag.digest_comment}},
                        {"goto": {"target": "lb-i-3"}},
                    ]
                ],
            }
        }
    ]
    got = [(el.key, el.value, el.comment) for el in elements(listing)]
    assert got == [("198.18.200.1 . tcp . 80", "goto lb-i-3", frag.digest_comment)]
    a = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True)
    ckey, digest = adopt.split_comment(frag.digest_comment)
    a.services[ckey] = adopt.Service(digest=digest, entries={(render.SERVICE_IPS, got[0][0]): got[0][1]})
    assert a.unchanged(frag)
    assert not a.unchanged(render.render_service(svc("web", THREE[:2]), CTX4))


def test_long_names_fit_a_comment() -> None:
    long = ServicePortName("n" * 63, "s" * 63, "p" * 15, Protocol.SCTP)
    c = render.comment_key(render.service_key(long))
    assert len(c) <= 110 and "~" in c
    assert render.comment_key("ns/web:http/TCP") == "ns/web:http/TCP"


# ----------------------------------------------------------------------------------------------- explainer


def _frags(*sps: ServicePort, ctx: FamilyContext = CTX4) -> dict[ServicePortName, render.Fragment]:
    return {sp.name: render.render_service(sp, ctx) for sp in sps}


def test_trace_cluster_ip_splits_over_endpoints_and_masquerades_off_cluster_sources() -> None:
    frags = _frags(svc("web", THREE))
    pod = trace.trace(CTX4, frags, trace.Packet("198.18.1.9", "tcp", "198.18.200.1", 80))
    assert sorted(o["verdict"] for o in pod["outcomes"]) == [
        "DNAT 198.18.1.2:8080",
        "DNAT 198.18.2.2:8080",
        "DNAT 198.18.2.3:8080",
    ]
    assert all(abs(o["probability"] - 1 / 3) < 1e-6 and not o["masquerade"] for o in pod["outcomes"])
    outside = trace.trace(CTX4, frags, trace.Packet("203.0.113.5", "tcp", "198.18.200.1", 80))
    assert all(o["masquerade"] for o in outside["outcomes"])


def test_trace_reject_drop_nodeport_firewall_hairpin() -> None:
    frags = _frags(
        svc("gone"),
        svc("np", THREE, cluster_ip="198.18.200.2", node_port=30080),
        svc(
            "lb",
            THREE,
            cluster_ip="198.18.200.3",
            load_balancer_ips=("198.18.150.1",),
            load_balancer_source_ranges=("203.0.113.0/24",),
        ),  # fmt: skip
        svc("self", (ep("198.18.1.2", local=True),), cluster_ip="198.18.200.4"),
    )
    rej = trace.trace(CTX4, frags, trace.Packet("198.18.1.9", "tcp", "198.18.200.1", 80))
    assert [o["verdict"] for o in rej["outcomes"]] == ["REJECT"]
    np = trace.trace(CTX4, frags, trace.Packet("203.0.113.5", "tcp", "198.19.255.1", 30080, dst_local=True))
    assert len(np["outcomes"]) == 3 and all(o["masquerade"] for o in np["outcomes"])
    denied = trace.trace(CTX4, frags, trace.Packet("192.0.2.1", "tcp", "198.18.150.1", 80))
    assert [o["verdict"] for o in denied["outcomes"]] == ["DROP"]
    allowed = trace.trace(CTX4, frags, trace.Packet("203.0.113.5", "tcp", "198.18.150.1", 80))
    assert len(allowed["outcomes"]) == 3
    hair = trace.trace(CTX4, frags, trace.Packet("198.18.1.2", "tcp", "198.18.200.4", 80))
    assert hair["outcomes"][0]["verdict"] == "DNAT 198.18.1.2:8080" and hair["outcomes"][0]["masquerade"]
    miss = trace.trace(CTX4, frags, trace.Packet("198.18.1.9", "tcp", "198.18.200.9", 80))
    assert miss["outcomes"][0]["verdict"] == "no service rule"


def test_trace_affinity_and_local_policy() -> None:
    local = (ep("198.18.1.2", local=True),)
    frags = _frags(
        svc("sticky", THREE[:2], affinity_timeout=30),
        svc(
            "etp", THREE, cluster_ip="198.18.200.5", node_port=30081, external_policy_local=True, local_endpoints=local
        ),  # fmt: skip
    )
    st = trace.trace(CTX4, frags, trace.Packet("198.18.1.9", "tcp", "198.18.200.1", 80))
    assert sorted(o["verdict"] for o in st["outcomes"]) == ["DNAT 198.18.1.2:8080", "DNAT 198.18.2.2:8080"]
    ext = trace.trace(CTX4, frags, trace.Packet("203.0.113.5", "tcp", "198.19.255.1", 30081, dst_local=True))
    assert [o["verdict"] for o in ext["outcomes"]] == ["DNAT 198.18.1.2:8080"]
    assert not ext["outcomes"][0]["masquerade"]
    node = trace.trace(CTX4, frags, trace.Packet("198.19.255.1", "tcp", "198.19.255.1", 30081, src_local=True,
                                                 dst_local=True))  # fmt: skip
    assert len(node["outcomes"]) == 3 and all(o["masquerade"] for o in node["outcomes"])


@pytest.mark.parametrize(
    "sp",
    [
        svc("a", THREE),
        svc("b"),
        svc("c", THREE, internal_policy_local=True),
        svc("d", (ep("198.18.1.2", local=True), ep("198.18.2.2")), proto=Protocol.UDP),
        svc("e", THREE, internal_policy_local=True, local_endpoints=(THREE[0],)),
    ],
)
def test_the_cluster_ip_fast_path_renders_what_the_general_path_does(sp: ServicePort) -> None:
    for ctx in (CTX4, FamilyContext(IPFamily.V4), FamilyContext(IPFamily.V4, masquerade_all=True)):
        assert render._render_cluster_ip_only(sp, ctx) == render._render_general(sp, ctx)


def test_source_ranges_never_overlap_in_the_interval_set() -> None:
    sp = svc("lb", THREE, load_balancer_ips=("198.19.150.1",),
             load_balancer_source_ranges=("10.0.0.0/8", "10.1.0.0/16", "198.19.0.0/16", "fd00::/8"))  # fmt: skip
    fw = sorted(elems(render.render_service(sp, CTX4), render.FIREWALL))
    # 10.1.0.0/16 is inside 10.0.0.0/8; the LB IP (admitted: a range holds the node's address) is inside 198.19/16;
    # the IPv6 range is not this family's
    assert fw == ["198.19.150.1 . tcp . 80 . 10.0.0.0/8", "198.19.150.1 . tcp . 80 . 198.19.0.0/16"]
