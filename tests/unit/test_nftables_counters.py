"""The nftables mode's traffic counters rendered (no root, no kernel): off, the ruleset is byte for byte what it was
before counters existed (a golden file written by the code before them); on, named counters per endpoint whose
names are safe nft text and give their endpoint back, kept across endpoint changes, rebuilt from the kernel's names
at adoption, and the dump mapped back to service ports. The dump parser's input is the kernel's own: a netlink
object dump captured by ``tests/integration/test_nftables_counters.py`` (``golden/nftables/counters_dump.json``)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from types import MappingProxyType

from kproxy.backends.nftables import adopt, counters, layout, plan, render
from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.batch import Batch, Delta
from kproxy.config import ProxyConfig
from kproxy.counters import Measure
from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext, LocalDetect

GOLDEN = Path(__file__).parent / "golden" / "nftables"
CTX4 = FamilyContext(IPFamily.V4, local=LocalDetect("cidr", ("198.18.0.0/16",)), node_ips=("198.19.255.1",))
CTX6 = FamilyContext(IPFamily.V6, local=LocalDetect("cidr", ("fd00:198:18::/56",)))


def spn(name: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, "http", proto)


def ep(ip: str, port: int = 8080, local: bool = False) -> Endpoint:
    return Endpoint(ip, port, is_local=local, node_name="node-a" if local else "node-b")


THREE = (ep("198.18.1.2"), ep("198.18.2.2", local=True), ep("198.18.2.3"))


def services() -> list[ServicePort]:
    """One of each shape: ClusterIP, UDP, no endpoints, NodePort + externalIP + LB with source ranges, Local
    policies, ClientIP affinity."""
    v4 = IPFamily.V4
    return [
        ServicePort(spn("web"), v4, "198.18.200.1", 80, cluster_endpoints=THREE, has_any_endpoints=True),
        ServicePort(
            spn("dns", Protocol.UDP), v4, "198.18.200.2", 53, cluster_endpoints=THREE[:2], has_any_endpoints=True
        ),
        ServicePort(spn("empty"), v4, "198.18.200.3", 80),
        ServicePort(
            spn("edge"),
            v4,
            "198.18.200.4",
            80,
            node_port=30080,
            external_ips=("203.0.113.7",),
            load_balancer_ips=("203.0.113.8",),
            load_balancer_source_ranges=("192.0.2.0/24",),
            cluster_endpoints=THREE,
            local_endpoints=THREE[1:2],
            has_any_endpoints=True,
        ),
        ServicePort(
            spn("local"),
            v4,
            "198.18.200.5",
            80,
            node_port=30081,
            external_ips=("203.0.113.9",),
            external_policy_local=True,
            cluster_endpoints=THREE,
            local_endpoints=THREE[1:2],
            has_any_endpoints=True,
        ),
        ServicePort(
            spn("sticky"), v4, "198.18.200.6", 80, affinity_timeout=30, cluster_endpoints=THREE, has_any_endpoints=True
        ),
    ]


def proxier(on: bool) -> NftablesProxier:
    return NftablesProxier(ProxyConfig(ip_families=(IPFamily.V4,), service_counters=on))


def full_text(on: bool) -> str:
    """The text of a full sync into an empty table (what the kernel is handed), counters on or off."""
    p = proxier(on)
    frags = {sp.name: p.render(sp, CTX4) for sp in services()}
    state = ProxyState(
        MappingProxyType({IPFamily.V4: MappingProxyType({sp.name: sp for sp in services()})}), NodeInfo("node-a")
    )
    deltas = tuple(Delta(sp.name, None, None, sp, frags[sp.name]) for sp in services())
    batch: plan.NftBatch = Batch(IPFamily.V4, True, CTX4, deltas, frags, {}, state)
    if on:
        return "".join(chunk.tx.text() for chunk in plan.full_chunks(batch, True))
    return "".join(chunk.tx.text() for chunk in plan.full_chunks(batch))


def test_counters_off_the_ruleset_is_byte_identical_to_before_counters() -> None:
    """``golden/nftables/full_counters_off.nft``: ``full_text(False)`` as the code before counters wrote it."""
    assert full_text(False) == (GOLDEN / "full_counters_off.nft").read_text()
    off = proxier(False)
    assert off.counters(IPFamily.V4) is None
    for sp in services():
        assert off.render(sp, CTX4) == render.render_service(sp, CTX4)
    assert layout.fixed_commands(IPFamily.V4, counters=False) == layout.fixed_commands(IPFamily.V4)


def test_counters_on_add_the_counting_chains_maps_and_a_named_counter_per_endpoint() -> None:
    text = full_text(True)
    off = full_text(False)
    assert layout.layout_chain(IPFamily.V4, True) != layout.layout_chain(IPFamily.V4)  # turning it on replaces
    assert "add map ip kproxy endpoint-counters { type ipv4_addr . inet_proto . inet_service . ipv4_addr" in text
    assert "add chain ip kproxy count-postrouting { type nat hook postrouting priority 90; policy accept; }" in text
    assert "add chain ip kproxy count-input { type nat hook input priority 90; policy accept; }" in text
    assert (
        "meta l4proto udp ct status dnat counter name ct original ip daddr . meta l4proto . ct original proto-dst"
        " . ip daddr . th dport map @endpoint-counters accept" in text
    )
    names = [line.split()[-1] for line in text.splitlines() if line.startswith("add counter ip kproxy ")]
    # one per (service port, endpoint): web 3, dns 2, empty 0, edge 3, local 3, sticky 3
    assert len(names) == len(set(names)) == 14
    assert all(counters.endpoint_of(n) is not None for n in names)
    # every counter is declared before the elements that name it
    first_elements = text.index("add element ip kproxy endpoint-counters")
    assert all(text.index(f"add counter ip kproxy {n}\n") < first_elements for n in names)
    web = proxier(True).render(services()[0], CTX4)
    got = {k: v for m, k, v in web.elements if m == layout.ENDPOINT_COUNTERS}
    assert got == {
        f"198.18.200.1 . tcp . 80 . {e.ip} . 8080": counters.counter_name(
            counters.service_part(web.comment), e.ip, 8080
        )
        for e in THREE
    }
    edge = proxier(True).render(services()[3], CTX4)
    by_map: dict[str, int] = {}
    for m, _, _ in edge.elements:
        by_map[m] = by_map.get(m, 0) + 1
    assert by_map[layout.ENDPOINT_COUNTERS] == 3 * 3  # ClusterIP, externalIP, LB IP x 3 endpoints
    assert by_map[layout.NODEPORT_ENDPOINT_COUNTERS] == 3
    assert (
        edge.elements[0][0] == layout.SERVICE_IPS and edge.digest != render.render_service(services()[3], CTX4).digest
    )

    # everything the off text holds is still there (digests aside: they cover the counters): counters only add
    def lines(t: str) -> set[str]:
        return {re.sub(r' #[a-z2-7]{10}"', ' #"', ln.rstrip(",")) for ln in t.splitlines()}

    assert lines(off) - lines(text) == {f"add chain ip kproxy {layout.layout_chain(IPFamily.V4)}"}


def test_names_are_safe_nft_text_and_give_their_endpoint_back() -> None:
    for ip, port in (("198.18.1.2", 8080), ("fd00:198:18::7", 53), ("::ffff:198.18.0.1", 1)):
        name = counters.counter_name("abcdefghijkl", ip, port)
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") and len(name) < 64
        got = counters.endpoint_of(name)
        assert got is not None and got[0] == "abcdefghijkl" and got[2] == port
        assert counters.endpoint_text(got[1], got[2]) == str(Endpoint(ip, port)).replace("::ffff:198.18.0.1", got[1])
    assert counters.endpoint_of("c-x-zz") is None and counters.endpoint_of("lb-i-3") is None
    for bad in (("198.18.1.2; flush ruleset", 80), ("198.18.1.2", 0), ("198.18.1.2", 70000)):
        try:
            counters.counter_name("abcdefghijkl", *bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")
    six = ServicePort(
        spn("v6"), IPFamily.V6, "fd00:198:19::1", 80, cluster_endpoints=(ep("fd00:198:18::2"),), has_any_endpoints=True
    )
    frag = NftablesProxier(ProxyConfig(ip_families=(IPFamily.V6,), service_counters=True)).render(six, CTX6)
    assert [k for m, k, _ in frag.elements if m == layout.ENDPOINT_COUNTERS] == [
        "fd00:198:19::1 . tcp . 80 . fd00:198:18::2 . 8080"
    ]
    assert "ct original ip6 daddr" in " ".join(layout.fixed_chain_rules(IPFamily.V6, True)["count-input"])


def test_an_endpoint_change_keeps_the_other_endpoints_counters() -> None:
    """Removing the first endpoint moves the others' slots in ``backends-tcp``, but their counters and counter-map
    elements stay: only the removed endpoint's go."""
    p = proxier(True)
    old = p.render(services()[0], CTX4)
    new = p.render(
        ServicePort(spn("web"), IPFamily.V4, "198.18.200.1", 80, cluster_endpoints=THREE[1:], has_any_endpoints=True),
        CTX4,
    )
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), old, new)
    lines = tx.text().splitlines()
    gone = old.counters[0]
    assert [ln for ln in lines if "counter ip" in ln] == [f"delete counter ip kproxy {gone}"]
    assert lines.index(f"delete counter ip kproxy {gone}") > lines.index("delete element ip kproxy endpoint-counters {")
    assert [ln for ln in lines if ln.startswith("198.18.200.1 . tcp . 80 . 198.18.")] == [
        "198.18.200.1 . tcp . 80 . 198.18.1.2 . 8080"  # its counter-map element; no other endpoint's
    ]
    assert not [ln for ln in lines if ln.startswith("add element ip kproxy endpoint-counters")]
    # an endpoint added: its counter first, then its element
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), new, old)
    lines = tx.text().splitlines()
    assert lines.index(f"add counter ip kproxy {gone}") < lines.index("add element ip kproxy endpoint-counters {")
    # the service removed: every counter goes, after its elements
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), old, None)
    lines = tx.text().splitlines()
    assert sorted(ln.split()[-1] for ln in lines if ln.startswith("delete counter")) == sorted(old.counters)


def test_adoption_rebuilds_a_changed_service_from_the_kernels_counter_names() -> None:
    """After a restart, a service that changed meanwhile: its entries come from service-ips, its endpoints from its
    counters' names; the counters the new version keeps are not touched."""
    p = proxier(True)
    old = p.render(services()[0], CTX4)
    new = p.render(
        ServicePort(spn("web"), IPFamily.V4, "198.18.200.1", 80, cluster_endpoints=THREE[:2], has_any_endpoints=True),
        CTX4,
    )
    names = counters.by_service({n: 5 for n in old.counters})
    assert list(names) == [counters.service_part(old.comment)]
    svc = adopt.Service(digest=old.digest, digest_key=old.digest_key, entries={(m, k): v for m, k, v in old.entries})
    skeleton = counters.skeleton(svc.entries, names[counters.service_part(old.comment)])
    assert skeleton == {(m, k): v for m, k, v in old.elements if m == layout.ENDPOINT_COUNTERS}
    tx = render.Transaction(IPFamily.V4)
    render.change_service(
        tx,
        spn("web"),
        None,
        new,
        old_keys={**svc.keys(), **skeleton},
        old_counters=names[counters.service_part(old.comment)],
    )
    lines = tx.text().splitlines()
    assert [ln for ln in lines if "counter ip" in ln] == [f"delete counter ip kproxy {old.counters[2]}"]
    assert "198.18.200.1 . tcp . 80 . 198.18.2.3 . 8080" in lines  # the gone endpoint's element, deleted


def test_the_dump_maps_the_kernels_listing_back_to_service_ports() -> None:
    """``golden/nftables/counters_dump.json`` is what the kernel answered to the counters' object dump in the
    integration test (its services ``ns1/a:http/TCP`` and ``ns1/u:dns/UDP`` with three endpoints each), after real
    connections, with what the servers saw; the fragments are rendered here the same way."""
    listing = json.loads((GOLDEN / "counters_dump.json").read_text())
    chunks = [base64.b64decode(c) for c in listing["netlink_dump_base64"]]
    packets, done = counters.parse_dump(chunks)
    assert done and len(packets) == 6 and all(counters.endpoint_of(n) is not None for n in packets)
    assert counters.parse_dump(chunks[:-1] + [chunks[-1][:-20]]) == (packets, False)  # cut before its end
    meta = listing["kproxy_test"]
    p = proxier(True)
    eps = tuple(Endpoint(e["ip"], e["port"]) for e in meta["endpoints"])
    frags = {}
    for s in meta["services"]:
        proto = Protocol(s["protocol"])
        sp = ServicePort(
            ServicePortName("ns1", s["name"], s["port_name"], proto),
            IPFamily.V4,
            s["cluster_ip"],
            s["port"],
            cluster_endpoints=eps,
            has_any_endpoints=True,
        )
        frags[sp.name] = p.render(sp, CTX4)
    plans: dict[object, object] = {}
    dump = counters.dump(IPFamily.V4, frags, packets, plans)  # type: ignore[arg-type]
    assert set(dump.ports) == set(frags)
    for s in meta["services"]:
        pc = next(v for k, v in dump.ports.items() if k.name == s["name"])
        assert {e: c.connections for e, c in pc.per_endpoint().items()} == s["seen"]
        assert pc.total.connections == sum(s["seen"].values()) and pc.total.bytes is None
    # a service the ledger no longer has goes from the dump and the plans
    gone = next(iter(frags))
    rest = {k: v for k, v in frags.items() if k != gone}
    assert gone not in counters.dump(IPFamily.V4, rest, packets, plans).ports and gone not in plans  # type: ignore[arg-type]
    assert NftablesProxier.counters_offered == frozenset({Measure.CONNECTIONS})
