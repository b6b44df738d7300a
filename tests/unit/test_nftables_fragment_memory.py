"""The nftables fragment's memory and its digest: what the ledger keeps per service port of the nftables mode
(issue 22: at most 4 KB per service port with 10 endpoints in the cache and in each mode's ledger; the fragment
takes at most ``BOUND`` of the ledger's share), and the digest written to the kernel, which must not change
whatever the fragment's representation (a restarted process adopts an old kernel table only if the digests of the
services it renders equal those the old process wrote)."""

from __future__ import annotations

import hashlib
import json

import pytest

from kproxy.backends.nftables import counters, fragment, layout, render
from kproxy.bench import memory, synthetic
from kproxy.cache import ServiceCache
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext, LocalDetect

NODE = "node-1"
CTX4 = FamilyContext(IPFamily.V4, local=LocalDetect("cidr", ("198.18.64.0/18",)), node_ips=("198.19.255.1",))
#: bytes per service port with 10 endpoints (half of them local) of its rendered fragment
BOUND = 1000


def _ports(n: int, endpoints: int = 10) -> tuple[ServiceCache, list[ServicePort]]:
    cache = ServiceCache(node_name=NODE, ip_families=(IPFamily.V4,))
    for i in range(1, n + 1):
        assert cache.upsert_service(json.loads(json.dumps(synthetic.service(i))))
    for i in range(1, n + 1):
        assert cache.upsert_slice(json.loads(json.dumps(synthetic.endpoint_slice(i, endpoints))))
    cache.mark_synced("services")
    cache.mark_synced("endpointslices")
    state, _ = cache.snapshot()
    return cache, sorted(state, key=lambda sp: sp.name)


def _fragment_bytes(n: int) -> int:
    """Bytes of the fragments of ``n`` synthetic service ports, beyond what the cache holds already."""
    cache, ports = _ports(n)
    frags = {sp.name: render.render_service(sp, CTX4) for sp in ports}
    assert all(len(f.elements) == 11 for f in frags.values())  # its entry and 10 slots
    figures = memory.walk([memory.Owner("cache", [cache, ports]), memory.Owner("fragments", [frags])])
    return figures["fragments"]["bytes"]


def test_a_fragment_of_10_endpoints_stays_small() -> None:
    small, large = 100, 1100
    per_port = (_fragment_bytes(large) - _fragment_bytes(small)) / (large - small)
    assert per_port <= BOUND, f"{per_port:.0f} bytes per service port"


# ----------------------------------------------------------------------------------------------- the digest


def _spn(name: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, "http", proto)


def _ep(ip: str, local: bool = False) -> Endpoint:
    return Endpoint(ip, 8080, is_local=local, node_name="node-a" if local else "node-b")


EPS = (_ep("198.18.64.2", local=True), _ep("198.18.65.2"), _ep("198.18.65.3"))


def _sp(name: str, eps: tuple[Endpoint, ...] = EPS, **kw: object) -> ServicePort:
    base: dict[str, object] = dict(
        name=_spn(name),
        family=IPFamily.V4,
        cluster_ip="198.18.200.1",
        port=80,
        cluster_endpoints=eps,
        has_any_endpoints=bool(eps),
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


def _cases() -> dict[str, ServicePort]:
    return {
        "cluster-ip": _sp("web"),
        "no-endpoints": _sp("empty", ()),
        "not-ready": _sp("down", (), has_any_endpoints=True),
        "nodeport-external": _sp("np", node_port=30080, external_ips=("198.18.100.1",)),
        "local-policy": _sp(
            "etp",
            node_port=30081,
            external_ips=("198.18.100.2",),
            external_policy_local=True,
            local_endpoints=EPS[:1],
        ),
        "firewall": _sp("lb", load_balancer_ips=("198.18.150.1",), load_balancer_source_ranges=("203.0.113.0/24",)),
        "affinity": _sp("sticky", affinity_timeout=30, node_port=30082),
    }


def _old_formula(frag: render.Fragment) -> str:
    """The digest as the tuple representation computed it: its elements' "map|key|value" lines, then the repr of
    (shared, chains, sets, hairpin) when any of them is not empty."""
    text = "\n".join(map("|".join, frag.elements))
    rest = (frag.shared, frag.chains, frag.sets, frag.hairpin)
    if any(rest):
        text += repr(rest)
    n = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    p = layout.B32_PAIRS
    return "".join(p[(n >> s) & 1023] for s in (0, 10, 20, 30, 40))


def test_the_digest_written_to_the_kernel_is_the_one_before() -> None:
    got = {}
    for case, sp in _cases().items():
        frag = render.render_service(sp, CTX4)
        assert frag.digest == _old_formula(frag), case
        got[case] = frag.digest
        counted = counters.with_counters(frag, sp)
        assert counted.digest == _old_formula(counted), case
        assert (counted.digest != frag.digest) == bool(sp.cluster_endpoints), case  # counting elements: digested
        got[case + "+counters"] = counted.digest
    assert got == PINNED


def test_the_text_is_packed_and_gives_every_element_back() -> None:
    """``fragment.pack``: a slot's key is written without its entry's; the fast path for ClusterIPs writes the same
    text as the general packing, and ``elements`` (``unpack``) gives back what was packed."""
    for case, sp in _cases().items():
        for frag in (render.render_service(sp, CTX4), counters.with_counters(render.render_service(sp, CTX4), sp)):
            elements = frag.elements
            assert fragment.pack(elements) == frag.text, case
            assert fragment.parse_elements(frag.text) == list(elements), case
            assert fragment.digest_text(elements) == "\n".join(map("|".join, elements)) == fragment.unpack(frag.text)
            assert elements[0][:2] == (layout.SERVICE_IPS, frag.digest_key), case
    web = render.render_service(_cases()["cluster-ip"], CTX4)
    slots = render.slot_map(render.BACKENDS, "tcp")
    assert web.text.split("\n") == [
        "service-ips|198.18.200.1 . tcp . 80|goto lb-i-3",
        f"{slots}|~0|198.18.64.2 . 8080",
        f"{slots}|~1|198.18.65.2 . 8080",
        f"{slots}|~2|198.18.65.3 . 8080",
    ]
    assert fragment.unpack(web.text) == fragment.digest_text(web.elements)
    assert web.elements[3] == (slots, "198.18.200.1 . tcp . 80 . 2", "198.18.65.3 . 8080")


def test_pack_refuses_what_would_make_its_text_ambiguous() -> None:
    """Every key and value comes from validated addresses, ports and names; ``pack`` still refuses an element that
    would read back as other elements: a ``|`` or a newline in it, or a key starting with ``~`` (a packed key's
    mark). ``_render_cluster_ip_only`` writes the same text from addresses and numbers alone."""
    slots = render.slot_map(render.BACKENDS, "tcp")
    entry = (layout.SERVICE_IPS, "198.18.200.1 . tcp . 80", "goto lb-i-1")
    assert fragment.pack([entry, (slots, "198.18.200.1 . tcp . 80 . 0", "198.18.64.2 . 8080")]).count("|~") == 1
    for bad in (
        (slots, "198.18.200.1 . tcp . 80 . 0", "198.18.64.2 . 8080|x"),
        (slots, "198.18.200.1 . tcp . 80 . 0", "198.18.64.2 . 8080\nservice-ips|1.2.3.4 . tcp . 1|drop"),
        (slots, "~0", "198.18.64.2 . 8080"),
        (layout.SERVICE_IPS, "~198.18.200.2 . tcp . 80", "drop"),
    ):
        with pytest.raises(ValueError, match="holds '\\|' or a newline, or a key starts with '~'"):
            fragment.pack([entry, bad])


def test_a_full_syncs_transaction_is_written_from_the_text_as_from_the_elements() -> None:
    """``Transaction.add_fragment`` (a full sync into an empty table) writes what ``add_elements`` writes from the
    tuples: uncommented elements, then firewall elements, entries and the digest with their comments."""
    for case, sp in _cases().items():
        frag = counters.with_counters(render.render_service(sp, CTX4), sp)
        fast, slow = render.Transaction(IPFamily.V4), render.Transaction(IPFamily.V4)
        fast.add_fragment(frag, sp.name)
        els = frag.elements
        entry_maps = (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS)
        slow.add_elements([e for e in els if e[0] not in entry_maps and e[0] != layout.FIREWALL], None, sp.name)
        slow.add_elements([e for e in els if e[0] == layout.FIREWALL], frag.comment, sp.name)
        slow.add_elements([e for e in els if e[0] in entry_maps], frag.comment, sp.name)
        slow.add_elements([(layout.SERVICE_DIGESTS, frag.digest_key, "")], frag.digest_comment, sp.name)
        assert fast.text() == slow.text() and fast.lines() == slow.lines(), case
        assert fast.elements_added == slow.elements_added == len(els) + 1


#: the digest of each case (and with counters) as the tuple representation before issue 22 wrote it: they must never
#: change, or a restart rewrites every service of an old table
PINNED = {
    "cluster-ip": "hvj25i2i3g",
    "cluster-ip+counters": "yie4hgidr5",
    "no-endpoints": "ghmmynpvdw",
    "no-endpoints+counters": "ghmmynpvdw",
    "not-ready": "lngzs7bmpp",
    "not-ready+counters": "lngzs7bmpp",
    "nodeport-external": "lw43j62cgs",
    "nodeport-external+counters": "fvraxdzrcg",
    "local-policy": "fjh6omammf",
    "local-policy+counters": "rec4swqrsr",
    "firewall": "cg3wpbplaf",
    "firewall+counters": "nkwkcfkbqm",
    "affinity": "ljv6smtwff",
    "affinity+counters": "zfcir2wpdx",
}


def test_a_changed_endpoint_rewrites_its_slot_and_the_digest_only() -> None:
    """The diff of a partial sync: from the changed lines for a fragment with one entry, from the keys otherwise
    (a NodePort's), the same elements either way."""
    moved = (*EPS[:2], _ep("198.18.65.9"))
    for case, kw in (("cluster-ip", {}), ("nodeport", {"node_port": 30080})):
        old, new = (render.render_service(_sp("web", eps, **kw), CTX4) for eps in (EPS, moved))
        tx = render.Transaction(IPFamily.V4)
        render.change_service(tx, _spn("web"), old, new)
        slots = [render.slot_map(m, "tcp") for m in (render.BACKENDS, layout.NODEPORT_BACKENDS)][: 1 + bool(kw)]
        keys = ["198.18.200.1 . tcp . 80 . 2", "tcp . 30080 . 2"]
        want = [(m, f"{k} : 198.18.65.9 . 8080") for m, k in zip(slots, keys, strict=False)]
        assert [(m, t) for m, g in tx.adds.items() for t in g.texts if m != layout.SERVICE_DIGESTS] == want, case
        assert [(m, t) for m, g in tx.deletes.items() for t in g.texts] == [
            *((m, k) for m, k in zip(slots, keys, strict=False)),
            (layout.SERVICE_DIGESTS, "198.18.200.1 . tcp . 80"),
        ], case
        assert tx.elements_added == len(slots) + 1 and old.digest != new.digest
