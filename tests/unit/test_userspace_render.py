"""The userspace mode's pure parts without root: fragments (roles, verdicts, firewall keys, SCTP), the fixed table,
NodePort intervals, element text, the balancer (round robin, affinity, stale entries) and the option parsers."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.backends.userspace import render
from kproxy.backends.userspace.ports import parse_port_range
from kproxy.backends.userspace.proxier import UserspaceProxier
from kproxy.conformance.scenarios import SCENARIO_IDS
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext
from kproxy.relay.balancer import Balancer
from kproxy.relay.udp import Duration


def sp(proto: Protocol = Protocol.TCP, eps: int = 2, local: int = 0, **kw: object) -> ServicePort:
    cluster = tuple(Endpoint(f"198.18.64.{i + 1}", 8080, is_local=i < local) for i in range(eps))
    base: dict[str, object] = dict(
        name=ServicePortName("ns", "web", "http", proto),
        family=IPFamily.V4,
        cluster_ip="198.18.200.1",
        port=80,
        cluster_endpoints=cluster,
        local_endpoints=tuple(e for e in cluster if e.is_local),
        has_any_endpoints=bool(cluster),
        serving_endpoints=cluster,
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


def test_one_listener_for_every_address_when_endpoint_sets_agree() -> None:
    frag = render.render_service(sp(node_port=30080, external_ips=("198.18.210.1",)))
    assert frag.key == "ns/web:http/TCP"
    assert frag.roles() == ("c",)
    assert frag.listeners[0].endpoints == (("198.18.64.1", 8080), ("198.18.64.2", 8080))
    assert set(frag.entries) == {
        render.Entry(render.SERVICE_IPS, "198.18.200.1 . tcp . 80", render.V_REDIRECT_SVC, "c"),
        render.Entry(render.SERVICE_IPS, "198.18.210.1 . tcp . 80", render.V_REDIRECT_SVC, "c"),
        render.Entry(render.SERVICE_NODEPORTS, "tcp . 30080", render.V_REDIRECT_NP, "c"),
    }
    elems = frag.kernel_elements({"c": 41000})
    assert (render.SERVICE_PORTS, "198.18.200.1 . tcp . 80", "41000") in elems
    assert (render.NODEPORT_PORTS, "tcp . 30080", "41000") in elems


def test_local_policy_splits_listeners_and_drops_without_local_endpoints() -> None:
    frag = render.render_service(sp(node_port=30080, external_policy_local=True, local=1))
    assert frag.roles() == ("i", "e")
    assert frag.listeners[1].endpoints == (("198.18.64.1", 8080),)
    none_local = render.render_service(sp(node_port=30080, external_policy_local=True, local=0))
    assert none_local.roles() == ("i",)
    np_entry = next(e for e in none_local.entries if e.map == render.SERVICE_NODEPORTS)
    assert np_entry.verdict == render.V_DROP and np_entry.role == ""


def test_no_endpoints_rejects_and_has_no_listener() -> None:
    frag = render.render_service(sp(eps=0, node_port=30080))
    assert frag.listeners == ()
    assert {e.verdict for e in frag.entries} == {render.V_REJECT}
    assert all(m not in render.PORT_MAPS.values() for m, _, _ in frag.kernel_elements({}))


def test_source_ranges_go_through_the_firewall() -> None:
    frag = render.render_service(
        sp(load_balancer_ips=("198.18.220.1",), load_balancer_source_ranges=("198.18.99.0/24", "fd00::/64"))
    )
    lb = next(e for e in frag.entries if e.key.startswith("198.18.220.1"))
    assert lb.verdict == render.V_FIREWALL and lb.role == "c"
    assert frag.firewall == ("198.18.220.1 . tcp . 80 . 198.18.99.0/24",)


def test_sctp_is_unsupported_and_rejected() -> None:
    frag = render.render_service(sp(Protocol.SCTP, node_port=30099))
    assert frag.unsupported and frag.listeners == ()
    assert {(e.key, e.verdict) for e in frag.entries} == {
        ("198.18.200.1 . sctp . 80", render.V_REJECT),
        ("sctp . 30099", render.V_REJECT),
    }


def test_fixed_part_and_element_text() -> None:
    cmds = render.fixed_commands(IPFamily.V6)
    assert cmds[0] == f"add table ip6 {render.TABLE}"
    assert any("ip6 daddr . meta l4proto . th dport vmap @service-ips" in c for c in cmds)
    assert render.element_line(IPFamily.V4, "add", "service-ports", "1.2.3.4 . tcp . 80", "41000", "ns/a/TCP") == (
        f'add element ip {render.TABLE} service-ports {{ 1.2.3.4 . tcp . 80 comment "ns/a/TCP" : 41000 }}'
    )
    assert render.comment_key('ns/a"b/TCP') == "ns/a_b/TCP~" + render.comment_key('ns/a"b/TCP').split("~")[1]


def test_nodeport_cidrs_exclude_loopback() -> None:
    assert render.nodeport_cidrs(FamilyContext(IPFamily.V4)) == ("0.0.0.0-126.255.255.255", "128.0.0.0-255.255.255.255")
    v6 = render.nodeport_cidrs(FamilyContext(IPFamily.V6))
    assert v6 == ("::", "::2-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
    narrowed = FamilyContext(IPFamily.V4, nodeport_all_local=False, nodeport_cidrs=("198.18.0.0/24",))
    assert render.nodeport_cidrs(narrowed) == ("198.18.0.0/24",)


def test_localhost_nodeports_add_127_0_0_1_reached_from_the_node_only() -> None:
    """The core's decision (``FamilyContext.localhost_nodeports``) puts 127.0.0.1 into ``nodeport-cidrs``; the
    prerouting chain leaves loopback destinations alone, so only the node's own processes (output hook) reach it."""
    on = FamilyContext(IPFamily.V4, localhost_nodeports=True)
    assert render.nodeport_cidrs(on) == ("0.0.0.0-126.255.255.255", "127.0.0.1", "128.0.0.0-255.255.255.255")
    narrowed = FamilyContext(
        IPFamily.V4, nodeport_all_local=False, nodeport_cidrs=("198.18.0.0/24",), localhost_nodeports=True
    )
    assert render.nodeport_cidrs(narrowed) == ("127.0.0.1/32", "198.18.0.0/24")
    fixed = render.fixed_commands(IPFamily.V4)
    guard = fixed.index(f"add rule ip {render.TABLE} prerouting ip daddr 127.0.0.0/8 return")
    assert guard < fixed.index(f"add rule ip {render.TABLE} prerouting jump services")
    assert not [ln for ln in render.fixed_commands(IPFamily.V6) if "return" in ln]


def test_balancer_round_robin_affinity_and_removal() -> None:
    b = Balancer()
    eps = (("a", 1), ("b", 2), ("c", 3))
    b.update(eps, 0)
    assert sorted(b.next("x") or ("", 0) for _ in range(3)) == sorted(eps)
    b.update(eps, 60)
    first = b.next("client")
    assert all(b.next("client") == first for _ in range(10))
    assert b.next("client", reset=True) != first or len(eps) == 1
    chosen = b.next("client")
    assert chosen is not None
    gone = b.update(tuple(e for e in eps if e != chosen), 60)
    assert gone == {chosen} and "client" not in b.affinity
    b.sweep(float("inf"))
    assert b.affinity == {}
    b.update((), 60)
    assert b.next("client") is None


def test_options_and_not_applicable() -> None:
    assert parse_port_range("") is None
    assert parse_port_range("30000-30009") == (30000, 30009)
    assert parse_port_range("30000+10") == (30000, 30009)
    with pytest.raises(ValueError):
        parse_port_range("9-1")
    assert Duration("250ms") == 0.25 and Duration("2s") == 2.0 and Duration("0.5") == 0.5
    na = UserspaceProxier.not_applicable({})
    assert set(na) <= set(SCENARIO_IDS)
    assert set(na) == {"source-ip"}  # the rest of what it cannot do is declared per part


def test_reading_the_table_back() -> None:
    from kproxy.backends.userspace.adopt import Adopted
    from kproxy.toolkit.cidr import spans
    from kproxy.toolkit.nft import elements

    objs: list[dict[str, Any]] = [
        {
            "map": {
                "name": "service-ports",
                "elem": [
                    [{"elem": {"val": {"concat": ["198.18.200.1", "tcp", 80]}, "comment": "ns/web:http/TCP"}}, 41000]
                ],
            }
        },
        {
            "map": {
                "name": "service-ips",
                "elem": [
                    [
                        {"elem": {"val": {"concat": ["198.18.200.1", "tcp", 80]}, "comment": "ns/web:http/TCP"}},
                        {"goto": {"target": "redirect-svc"}},
                    ]
                ],
            }
        },
        {
            "set": {
                "name": "nodeport-cidrs",
                "elem": [{"range": ["0.0.0.0", "126.255.255.255"]}, {"prefix": {"addr": "128.0.0.0", "len": 1}}],
            }
        },
    ]
    got = [el[:4] for el in elements(objs)]
    assert ("service-ports", "198.18.200.1 . tcp . 80", "41000", "ns/web:http/TCP") in got
    assert ("service-ips", "198.18.200.1 . tcp . 80", "goto redirect-svc", "ns/web:http/TCP") in got
    cidrs = [k for n, k, _, _ in got if n == "nodeport-cidrs"]
    assert spans(cidrs) == spans(render.nodeport_cidrs(FamilyContext(IPFamily.V4)))
    frag = render.render_service(sp(cluster_ip="198.18.200.1"))
    adopted = Adopted(table=True, layout_ok=True)
    for n, k, v, c in got:
        adopted.elements[(n, k)] = (v, c)
        adopted.by_comment.setdefault(c, set()).add((n, k, v))
    assert adopted.ports(frag) == {"c": 41000}
    assert adopted.by_comment["ns/web:http/TCP"] == set(frag.kernel_elements({"c": 41000}))
