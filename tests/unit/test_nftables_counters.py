"""The nftables mode's traffic counters rendered (no root, no kernel): off, the ruleset is byte for byte what it was
before counters existed (a golden file written by the code before them); on, a counting element per (service
address or NodePort, endpoint), kept across other endpoints' changes, found again from the kernel's elements at
adoption, and the dump mapped back to service ports. The dump parser's input is the kernel's own: the netlink
element dumps captured by ``tests/integration/test_nftables_counters.py`` (``golden/nftables/counters_dump.json``)."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path
from types import MappingProxyType

from kproxy.backends.nftables import adopt, counters, layout, plan, render, setdump
from kproxy.backends.nftables.proxier import NftablesProxier
from kproxy.batch import Batch, Delta
from kproxy.config import ProxyConfig
from kproxy.counters import Measure
from kproxy.model import (
    Endpoint,
    IPFamily,
    NodeInfo,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
    endpoint_label,
)
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


def test_counters_on_add_the_counting_chains_sets_and_an_element_per_address_and_endpoint() -> None:
    text = full_text(True)
    off = full_text(False)
    assert layout.layout_chain(IPFamily.V4, True) != layout.layout_chain(IPFamily.V4)  # turning it on replaces
    for i in (0, 63):
        assert (
            f"add set ip kproxy endpoint-counters-{i:02d} {{ type ipv4_addr . inet_proto . inet_service . ipv4_addr"
            " . inet_service; counter; }" in text
        )
        assert (
            f"add set ip kproxy nodeport-endpoint-counters-{i:02d} {{ type inet_proto . inet_service . ipv4_addr"
            " . inet_service; counter; }" in text
        )
    assert "endpoint-counters-64" not in text and len(counters.COUNTING) == 2 * layout.COUNT_SHARDS == 128
    assert "add chain ip kproxy count-postrouting { type nat hook postrouting priority 90; policy accept; }" in text
    assert "add chain ip kproxy count-input { type nat hook input priority 90; policy accept; }" in text
    assert "add chain ip kproxy count-ep-63\n" in text and "add chain ip kproxy count-np-00\n" in text
    # one dispatch per connection, whatever the number of shards: the low bits of the address, or of the NodePort
    assert (
        "ct status dnat ct original ip daddr & 0.0.0.63 vmap { 0.0.0.0 : jump count-ep-00, 0.0.0.1 : jump count-ep-01,"
        in text
    )
    assert "meta l4proto sctp ct status dnat ct original proto-dst & 63 vmap { 0 : jump count-np-00, 1 :" in text
    assert (
        "meta l4proto udp ct original ip daddr . meta l4proto . ct original proto-dst . ip daddr"
        " . th dport @endpoint-counters-07 accept" in text
    )
    assert (
        "meta l4proto tcp meta l4proto . ct original proto-dst . ip daddr . th dport"
        " @nodeport-endpoint-counters-07 accept" in text
    )
    assert "counter ip" not in text  # no named counter objects
    web = proxier(True).render(services()[0], CTX4)
    got = [(m, k) for m, k, _ in web.elements if m in counters.COUNTING]
    assert got == [("endpoint-counters-01", f"198.18.200.1 . tcp . 80 . {e.ip} . 8080") for e in THREE]
    edge = proxier(True).render(services()[3], CTX4)
    by_map: dict[str, int] = {}
    for m, _, _ in edge.elements:
        by_map[m] = by_map.get(m, 0) + 1
    # ClusterIP 198.18.200.4, externalIP 203.0.113.7, LB IP 203.0.113.8 (shards 4, 7, 8) x 3 endpoints
    assert [by_map[f"endpoint-counters-{i:02d}"] for i in (4, 7, 8)] == [3, 3, 3]
    assert by_map["nodeport-endpoint-counters-00"] == 3  # 30080 & 63
    assert (
        edge.elements[0][0] == layout.SERVICE_IPS and edge.digest != render.render_service(services()[3], CTX4).digest
    )
    assert proxier(True).render(services()[2], CTX4) == render.render_service(services()[2], CTX4)  # no endpoints

    # everything the off text holds is still there (digests aside: they cover the counters): counters only add
    def lines(t: str) -> set[str]:
        return {re.sub(r' #[a-z2-7]{10}"', ' #"', ln.rstrip(",")) for ln in t.splitlines()}

    assert lines(off) - lines(text) == {f"add chain ip kproxy {layout.layout_chain(IPFamily.V4)}"}


def test_ipv6_counting_keys_and_rules() -> None:
    six = ServicePort(
        spn("v6"), IPFamily.V6, "fd00:198:19::1", 80, cluster_endpoints=(ep("fd00:198:18::2"),), has_any_endpoints=True
    )
    frag = NftablesProxier(ProxyConfig(ip_families=(IPFamily.V6,), service_counters=True)).render(six, CTX6)
    assert [(m, k) for m, k, _ in frag.elements if m in counters.COUNTING] == [
        ("endpoint-counters-01", "fd00:198:19::1 . tcp . 80 . fd00:198:18::2 . 8080")
    ]
    rules = layout.fixed_chain_rules(IPFamily.V6, True)
    assert rules["count-input"][0].startswith(
        "ct status dnat ct original ip6 daddr & ::3f vmap { :: : jump count-ep-00, "
    )
    assert ", ::3f : jump count-ep-63 }" in rules["count-input"][0]
    assert "ct original ip6 daddr . meta l4proto" in rules["count-ep-05"][0]
    assert layout.counting_set(layout.SERVICE_IPS, "fd00::1:ff7f . tcp . 80") == "endpoint-counters-63"
    assert endpoint_label("fd00:198:18::2", 8080) == str(Endpoint("fd00:198:18::2", 8080))


def test_an_endpoint_change_keeps_the_other_endpoints_counting_elements() -> None:
    """Removing the first endpoint moves the others' slots in ``backends-tcp``, but their counting elements stay:
    only the removed endpoint's goes."""
    p = proxier(True)
    old = p.render(services()[0], CTX4)
    fewer = ServicePort(
        spn("web"), IPFamily.V4, "198.18.200.1", 80, cluster_endpoints=THREE[1:], has_any_endpoints=True
    )
    new = p.render(fewer, CTX4)
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("web"), old, new)
    lines = tx.text().splitlines()
    i = lines.index("delete element ip kproxy endpoint-counters-01 {")
    assert lines[i + 1 : i + 3] == ["198.18.200.1 . tcp . 80 . 198.18.1.2 . 8080", "}"]
    assert not [ln for ln in lines if ln.startswith("add element ip kproxy endpoint-counters")]


def test_adoption_finds_a_changed_services_counting_elements() -> None:
    """After a restart, a service that changed meanwhile: its entries come from service-ips, its counting elements
    from the kernel's, grouped by entry; those the new version keeps are not touched."""
    p = proxier(True)
    old = p.render(services()[3], CTX4)
    fewer = ServicePort(
        spn("edge"),
        IPFamily.V4,
        "198.18.200.4",
        80,
        node_port=30080,
        cluster_endpoints=THREE[:2],
        has_any_endpoints=True,
    )
    new = p.render(fewer, CTX4)
    held = {(m, k): 0 for m, k, _ in old.elements if m in counters.COUNTING}
    held[("endpoint-counters-09", "198.18.250.9 . tcp . 80 . 198.18.1.2 . 8080")] = 0  # another service's
    svc = adopt.Service(digest=old.digest, digest_key=old.digest_key, entries={(m, k): v for m, k, v in old.entries})
    skeleton = counters.skeleton(svc.entries, counters.by_entry(held))
    assert skeleton == {(m, k): v for m, k, v in old.elements if m in counters.COUNTING}
    tx = render.Transaction(IPFamily.V4)
    render.change_service(tx, spn("edge"), None, new, old_keys={**svc.keys(), **skeleton})
    lines = [ln.rstrip(",") for ln in tx.text().splitlines()]
    gone = {k for m, k, _ in old.elements if m in counters.COUNTING} - {k for m, k, _ in new.elements}
    kept = {k for m, k, _ in new.elements if m in counters.COUNTING}
    assert gone and gone <= set(lines) and not kept & set(lines)


def test_the_dump_maps_the_kernels_listing_back_to_service_ports() -> None:
    """``golden/nftables/counters_dump.json`` is what the kernel answered to the counting sets' element dumps in
    the integration test (its services ``ns1/a:http/TCP`` and ``ns1/u:dns/UDP`` with three endpoints each), after
    real connections, with what the servers saw; the fragments are rendered here the same way."""
    listing = json.loads((GOLDEN / "counters_dump.json").read_text())
    packets: dict[bytes, int] = {}
    for name, raw in listing["netlink_dump_base64"].items():
        chunks = [base64.b64decode(c) for c in raw]
        got, done = counters.parse_dump(name, IPFamily.V4, chunks)
        by_bytes, done_raw = setdump.parse_raw(name, chunks)
        assert done and done_raw and len(got) == len(by_bytes)
        assert {counters.key_bytes(IPFamily.V4, k): v for (_, k), v in got.items()} == by_bytes  # each other's inverse
        packets.update(by_bytes)
        assert counters.parse_dump(name, IPFamily.V4, chunks[:-1] + [chunks[-1][:-20]])[1] is False  # cut short
    assert len(packets) == 6
    meta = listing["kproxy_test"]
    p = proxier(True)
    eps = tuple(Endpoint(e["ip"], e["port"]) for e in meta["endpoints"])
    frags = {}
    for s in meta["services"]:
        name = ServicePortName("ns1", s["name"], s["port_name"], Protocol(s["protocol"]))
        sp = ServicePort(name, IPFamily.V4, s["cluster_ip"], s["port"], cluster_endpoints=eps, has_any_endpoints=True)
        frags[sp.name] = p.render(sp, CTX4)
    plans: dict[int, object] = {}
    dump = counters.dump(IPFamily.V4, frags, packets, plans)  # type: ignore[arg-type]
    assert set(dump.ports) == set(frags)
    for s in meta["services"]:
        pc = next(v for k, v in dump.ports.items() if k.name == s["name"])
        assert {e: c.connections for e, c in pc.per_endpoint().items()} == s["seen"]
        assert pc.total.connections == sum(s["seen"].values()) > 0 and pc.total.bytes is None
    # a service the ledger no longer has goes from the dump and the plans
    gone = next(iter(frags))
    rest = {k: v for k, v in frags.items() if k != gone}
    assert gone not in counters.dump(IPFamily.V4, rest, packets, plans).ports  # type: ignore[arg-type]
    assert set(plans) == {id(f) for f in rest.values()}  # its plan went with it
    assert NftablesProxier.counters_offered == frozenset({Measure.CONNECTIONS})


def test_the_parser_reads_a_message_of_another_shape_attribute_by_attribute() -> None:
    """The kernel's dump parsed by the one-pattern path, and again with a key the pattern does not expect in one
    element (a copy of the dump's first element, its key's data attribute lengthened by a 4-byte field: the run no
    longer matches), which the attribute walk reads: the same counts, and the odd element's own key."""
    listing = json.loads((GOLDEN / "counters_dump.json").read_text())
    chunks = [base64.b64decode(c) for c in listing["netlink_dump_base64"]["endpoint-counters"]]
    fast, _ = setdump.parse_raw("endpoint-counters", chunks)
    assert len(fast) == 6
    first = chunks[0]
    at = first.index(struct.pack("=HHHHHH", 76, 1, 28, 1, 24, 1))  # the first element: 20-byte key
    odd = struct.pack("=HHHHHH", 80, 1, 32, 1, 28, 1) + first[at + 12 : at + 32] + b"XXXX" + first[at + 32 : at + 76]
    # the element list's length (and the message's) grow by the odd element's 80 bytes
    lst = first.rindex(struct.pack("=H", 3), 0, at) - 2  # NFTA_SET_ELEM_LIST_ELEMENTS header, just before
    (list_len,) = struct.unpack_from("=H", first, lst)
    grown = bytearray(first[: lst + list_len] + odd + first[lst + list_len :])
    struct.pack_into("=H", grown, lst, list_len + 80)
    struct.pack_into("=I", grown, 0, struct.unpack_from("=I", first, 0)[0] + 80)
    slow, done = setdump.parse_raw("endpoint-counters", [bytes(grown), *chunks[1:]])
    key = first[at + 12 : at + 32] + b"XXXX"
    assert done and slow == {**fast, key: fast[first[at + 12 : at + 32]]}
