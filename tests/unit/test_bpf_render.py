"""The bpf mode's pure parts without root: fragments per behaviour, the companion table's elements and transactions,
the plan of map writes (its order, only what changed, removals), and adoption's decoding."""

from __future__ import annotations

from kproxy.backends.bpf import adopt, companion, maps, render
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import FamilyIndex
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Context
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName

CTX = Context(IPFamily.V4, ("198.18.0.11", "198.18.65.1"))


def spn(name: str, port: str = "http", proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName("ns1", name, port, proto)


def ep(ip: str, port: int = 8080, local: bool = False) -> Endpoint:
    return Endpoint(ip, port, is_local=local)


THREE = (ep("198.18.65.11"), ep("198.18.66.11"), ep("198.18.66.12"))


def svc(name: str, eps: tuple[Endpoint, ...] = THREE, **kw: object) -> ServicePort:
    base: dict[str, object] = dict(
        name=spn(name, proto=kw.pop("proto", Protocol.TCP)),  # type: ignore[arg-type]
        family=IPFamily.V4,
        cluster_ip="198.19.0.10",
        port=80,
        cluster_endpoints=eps,
        local_endpoints=tuple(e for e in eps if e.is_local),
        has_any_endpoints=bool(eps),
    )
    base.update(kw)
    return ServicePort(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ fragments


def test_cluster_ip_is_one_frontend_with_its_backends_and_no_companion_part() -> None:
    frag = render.render(svc("web"), CTX)
    assert len(frag.frontends) == 1
    f = frag.frontends[0]
    assert f.key == ("198.19.0.10", 80, 6)
    assert f.flags == 0 and f.affinity == 0
    assert f.backends == (("198.18.65.11", 8080), ("198.18.66.11", 8080), ("198.18.66.12", 8080))
    assert frag.nft.empty
    assert frag.entries == 4 and frag.backend_count == 3


def test_no_endpoints_rejects_at_the_socket_and_in_the_companion_table() -> None:
    frag = render.render(svc("empty", ()), CTX)
    assert frag.frontends[0].flags == maps.F_REJECT
    assert frag.frontends[0].backends == ()
    assert frag.nft.elements == (("svc", "198.19.0.10 . tcp . 80", "goto kp-reject"),)


def test_internal_local_policy_without_local_endpoints_drops() -> None:
    frag = render.render(svc("itp", internal_policy_local=True), CTX)
    assert frag.frontends[0].flags == maps.F_DROP
    assert frag.nft.elements == (("svc", "198.19.0.10 . tcp . 80", "drop"),)


def test_affinity_sets_the_flag_and_timeout() -> None:
    frag = render.render(svc("aff", affinity_timeout=30), CTX)
    assert frag.frontends[0].flags == maps.F_AFFINITY
    assert frag.frontends[0].affinity == 30


def test_nodeport_is_a_socket_frontend_per_node_address_and_a_companion_element() -> None:
    frag = render.render(svc("np", node_port=30080), CTX)
    keys = [f.key for f in frag.frontends]
    assert keys == [("198.19.0.10", 80, 6), ("198.18.0.11", 30080, 6), ("198.18.65.1", 30080, 6)]
    assert all(f.flags & maps.F_EXTERNAL for f in frag.frontends[1:])
    ((chain, rules),) = frag.nft.chains
    assert chain.startswith("s-")
    assert rules[0] == f"ct label set {render.MASQ_LABEL}"
    assert rules[1].startswith("meta l4proto tcp dnat ip to numgen random mod 3 map {")
    assert ("nodeports", "tcp . 30080", f"goto {chain}") in frag.nft.elements


def test_external_local_policy_keeps_the_client_address_and_drops_without_local_endpoints() -> None:
    local = (ep("198.18.65.11", local=True), ep("198.18.66.11"))
    frag = render.render(svc("etp", local, node_port=30081, external_policy_local=True), CTX)
    ((chain, rules),) = frag.nft.chains
    assert rules == ("meta l4proto tcp dnat ip to 198.18.65.11:8080",)  # no masquerade, local endpoint only
    # local sockets to the node port: the cluster endpoints (upstream's short-circuit for local traffic)
    assert frag.frontends[1].backends == (("198.18.65.11", 8080), ("198.18.66.11", 8080))
    none_here = render.render(svc("etp", (ep("198.18.66.11"),), node_port=30081, external_policy_local=True), CTX)
    assert none_here.nft.chains == ()
    assert ("nodeports", "tcp . 30081", "drop") in none_here.nft.elements


def test_load_balancer_source_ranges_get_a_firewall_chain() -> None:
    frag = render.render(
        svc("lb", load_balancer_ips=("198.19.200.1",), load_balancer_source_ranges=("198.18.0.2/32",)), CTX
    )
    names = [c for c, _ in frag.nft.chains]
    assert [n[:2] for n in names] == ["s-", "f-"]
    fw = dict(frag.nft.chains)[names[1]]
    assert fw == (f"ip saddr {{ 198.18.0.2/32 }} goto {names[0]}", "drop")
    assert ("svc", "198.19.200.1 . tcp . 80", f"goto {names[1]}") in frag.nft.elements


def test_removing_a_firewalled_service_deletes_the_firewall_chain_before_the_chain_it_jumps_to() -> None:
    frag = render.render(
        svc("lb", load_balancer_ips=("198.19.200.1",), load_balancer_source_ranges=("198.18.0.2/32",)), CTX
    )
    first, mid, last = companion.nft_changes(IPFamily.V4, frag.nft, None)
    assert first == [] and all(c.startswith("delete element") for c in mid)
    assert [c.split()[-1][:2] for c in last] == ["f-", "s-"]


def test_companion_chain_names_change_with_their_rules() -> None:
    a = render.render(svc("np", node_port=30080), CTX)
    b = render.render(svc("np", THREE[:2], node_port=30080), CTX)
    assert a.nft.chains[0][0] != b.nft.chains[0][0]
    first, mid, last = companion.nft_changes(IPFamily.V4, a.nft, b.nft)
    assert first[0] == f"add chain ip {companion.TABLE} {b.nft.chains[0][0]}"
    assert any(c.startswith("delete element") for c in mid) and any(c.startswith("add element") for c in mid)
    assert last == [f"delete chain ip {companion.TABLE} {a.nft.chains[0][0]}"]


def test_element_commands_are_grouped_per_map_deletes_first() -> None:
    t = f"ip {companion.TABLE}"
    cmds = [
        f"add element {t} svc {{ 198.19.0.1 . tcp . 80 : goto kp-reject }}",
        f"delete element {t} svc {{ 198.19.0.2 . tcp . 80 }}",
        f"add element {t} nodeports {{ tcp . 30080 : drop }}",
        f"add element {t} svc {{ 198.19.0.3 . udp . 53 : drop }}",
        f"delete element {t} svc {{ 198.19.0.1 . tcp . 80 }}",
    ]
    assert companion.group_elements(cmds) == [
        f"delete element {t} svc {{ 198.19.0.2 . tcp . 80, 198.19.0.1 . tcp . 80 }}",
        f"add element {t} svc {{ 198.19.0.1 . tcp . 80 : goto kp-reject, 198.19.0.3 . udp . 53 : drop }}",
        f"add element {t} nodeports {{ tcp . 30080 : drop }}",
    ]


def test_udp_and_sctp_protocol_numbers() -> None:
    assert render.render(svc("dns", proto=Protocol.UDP), CTX).frontends[0].proto == 17
    assert render.render(svc("s", proto=Protocol.SCTP), CTX).frontends[0].proto == 132


# --------------------------------------------------------------------------------------------------- plans


def _plan(index: FamilyIndex, name: ServicePortName, sp: ServicePort | None) -> Plan:
    plan = Plan()
    planner.plan_service(index, name, render.render(sp, CTX) if sp else None, plan)
    planner.finish_plan(plan)
    return plan


def test_a_new_service_writes_backends_then_slots_then_the_master_last() -> None:
    index = FamilyIndex(IPFamily.V4)
    plan = _plan(index, spn("web"), svc("web"))
    steps = plan.ordered()
    assert [(role, op) for role, op, _, _ in steps] == [
        ("be", "put"),
        ("name", "put"),
        ("svc", "put"),
        ("svc", "put"),
    ]
    slots, masters = steps[2], steps[3]
    assert [maps.decode_lb_key(IPFamily.V4, k)[3] for k in slots[2]] == [1, 2, 3]
    assert [maps.decode_lb_key(IPFamily.V4, k)[3] for k in masters[2]] == [0]
    assert maps.decode_service(masters[3][0])[2] == 3  # count
    assert len(steps[0][2]) == 3
    assert index.svc_entries == 4 and len(index.backends) == 3


def test_plan_bytes_are_exactly_the_map_encodings() -> None:
    """The plan builds keys and values from cached byte pieces; they must equal the maps module's encoders."""
    index = FamilyIndex(IPFamily.V4)
    plan = _plan(index, spn("web"), svc("web", node_port=30080))
    want_slots = {
        maps.lb_key(IPFamily.V4, a, p, 6, i): maps.slot_value(bid)
        for (a, p, _proto), st in index.fronts.items()
        for i, bid in enumerate(st.slots, start=1)
    }
    assert plan.slot_put == want_slots
    assert set(plan.master_put) == {maps.lb_key(IPFamily.V4, a, p, 6, 0) for (a, p, _proto) in index.fronts}
    assert plan.be_put == {
        maps.backend_key(bid): maps.backend_value(IPFamily.V4, a, p, proto)
        for bid, (a, p, proto) in index.backends.items()
    }


def test_an_unchanged_service_writes_nothing() -> None:
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("web"), svc("web"))
    assert _plan(index, spn("web"), svc("web")).writes == 0


def test_shrinking_writes_the_count_before_deleting_slots_and_backends() -> None:
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("web"), svc("web"))
    plan = _plan(index, spn("web"), svc("web", THREE[:1]))
    steps = [(role, op) for role, op, _, _ in plan.ordered()]
    assert steps == [("svc", "put"), ("svc", "del"), ("be", "del")]
    (_, _, masters, values), (_, _, deleted, _), (_, _, be_deleted, _) = plan.ordered()
    assert maps.decode_service(values[0])[2] == 1
    assert sorted(maps.decode_lb_key(IPFamily.V4, k)[3] for k in deleted) == [2, 3]
    assert len(be_deleted) == 2
    assert index.svc_entries == 2 and len(index.backends) == 1


def test_one_endpoint_replaced_writes_one_backend_one_slot_and_deletes_one_backend() -> None:
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("web"), svc("web"))
    plan = _plan(index, spn("web"), svc("web", (*THREE[:2], ep("198.18.66.99"))))
    assert len(plan.be_put) == 1 and len(plan.slot_put) == 1
    assert not plan.master_put  # same count, flags, affinity: the master entry is untouched
    assert len(plan.be_del) == 1 and not plan.svc_del


def test_surviving_backends_keep_their_slots() -> None:
    """ClientIP affinity entries name the slot they were made for: removing the first of three endpoints moves only
    the last backend into the hole (one slot written, one deleted), and the middle one keeps slot 2; a new endpoint
    then takes the free slot at the end."""
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("web"), svc("web", affinity_timeout=30))
    slots_before = index.fronts[("198.19.0.10", 80, 6)].slots
    plan = _plan(index, spn("web"), svc("web", THREE[1:], affinity_timeout=30))
    slots_after = index.fronts[("198.19.0.10", 80, 6)].slots
    assert tuple(slots_after) == (slots_before[2], slots_before[1])
    assert [maps.decode_lb_key(IPFamily.V4, k)[3] for k in plan.slot_put] == [1]
    assert [maps.decode_lb_key(IPFamily.V4, k)[3] for k in plan.svc_del] == [3]
    _plan(index, spn("web"), svc("web", (ep("198.18.66.99"), *THREE[1:]), affinity_timeout=30))
    assert index.fronts[("198.19.0.10", 80, 6)].slots[:2] == slots_after


def test_removing_a_service_deletes_the_master_before_its_slots_and_then_backends_and_name() -> None:
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("web"), svc("web"))
    plan = _plan(index, spn("web"), None)
    steps = plan.ordered()
    assert [(r, o) for r, o, _, _ in steps] == [("svc", "del"), ("be", "del"), ("name", "del")]
    slots = [maps.decode_lb_key(IPFamily.V4, k)[3] for k in steps[0][2]]
    assert slots == [0, 1, 2, 3]
    assert index.fronts == {} and index.backends == {} and index.rev_ids == {}


def test_a_frontend_moving_between_services_is_written_not_deleted() -> None:
    index = FamilyIndex(IPFamily.V4)
    first = _plan(index, spn("old"), svc("old"))
    plan = Plan()
    planner.plan_service(index, spn("old"), None, plan)
    planner.plan_service(index, spn("new"), render.render(svc("new"), CTX), plan)
    planner.finish_plan(plan)
    master = maps.lb_key(IPFamily.V4, "198.19.0.10", 80, 6, 0)
    assert master in plan.written("master") and master not in plan.svc_del
    # executed (every put before every delete), the new service's entries are what stays
    svc_m, be_m, _ = _kernel(FamilyIndex(IPFamily.V4), [first, plan])
    st = index.fronts[("198.19.0.10", 80, 6)]
    assert maps.decode_service(svc_m[master])[2] == 3
    assert {maps.decode_lb_key(IPFamily.V4, k)[3] for k in svc_m} == {0, 1, 2, 3}
    assert {int.from_bytes(k, "little") for k in be_m} == set(st.slots)


def test_every_service_gets_its_own_reverse_nat_id_and_name() -> None:
    index = FamilyIndex(IPFamily.V4)
    _plan(index, spn("a"), svc("a"))
    _plan(index, spn("b"), svc("b", cluster_ip="198.19.0.11"))
    assert index.rev_ids[spn("a")] != index.rev_ids[spn("b")]
    assert index.rev_names[index.rev_ids[spn("a")]] == "ns1/a:http/TCP"


# ------------------------------------------------------------------------------------------------ adoption


def _kernel(index: FamilyIndex, plans: list[Plan]) -> tuple[dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes]]:
    """Execute plans into dicts standing for the three maps (their bytes exactly as the kernel would hold them)."""
    svc_m: dict[bytes, bytes] = {}
    be_m: dict[bytes, bytes] = {}
    name_m: dict[bytes, bytes] = {}
    target = {"svc": svc_m, "be": be_m, "name": name_m}
    for plan in plans:
        for role, op, keys, values in plan.ordered():
            m = target[role]
            if op == "put":
                m.update(zip(keys, values, strict=True))
            else:
                for k in keys:
                    del m[k]
    return svc_m, be_m, name_m


def test_adoption_recognises_what_was_written_and_a_change() -> None:
    index = FamilyIndex(IPFamily.V4)
    web, np_ = svc("web"), svc("np", cluster_ip="198.19.0.11", node_port=30080)
    plans = [_plan(index, spn("web"), web), _plan(index, spn("np"), np_)]
    svc_m, be_m, name_m = _kernel(index, plans)
    adopted, view = adopt.index_from_kernel(IPFamily.V4, svc_m.items(), be_m.items(), name_m.items())
    counts: dict[int, int] = {}
    for v in view.values():
        counts[v[3]] = counts.get(v[3], 0) + 1
    assert adopt.unchanged(adopted, view, counts, spn("web"), render.render(web, CTX))
    assert adopt.unchanged(adopted, view, counts, spn("np"), render.render(np_, CTX))
    assert not adopt.unchanged(adopted, view, counts, spn("web"), render.render(svc("web", THREE[:2]), CTX))
    # a frontend the service no longer has (the node port) makes it changed too
    assert not adopt.unchanged(
        adopted, view, counts, spn("np"), render.render(svc("np", cluster_ip="198.19.0.11"), CTX)
    )
    # another service's name under the same entries is not this service
    assert not adopt.unchanged(adopted, view, counts, spn("other"), render.render(web, CTX))


def test_adopted_index_claims_and_rewrites_only_what_changed() -> None:
    index = FamilyIndex(IPFamily.V4)
    svc_m, be_m, name_m = _kernel(index, [_plan(index, spn("web"), svc("web"))])
    adopted, _ = adopt.index_from_kernel(IPFamily.V4, svc_m.items(), be_m.items(), name_m.items())
    adopt.claim(adopted, spn("web"), None)
    plan = _plan(adopted, spn("web"), svc("web", (*THREE[:2], ep("198.18.66.99"))))
    assert len(plan.be_put) == 1 and len(plan.slot_put) == 1 and len(plan.be_del) == 1
    assert not plan.name_put  # the name entry is already there


def test_a_full_sync_that_frees_ids_hands_each_out_once_afterwards() -> None:
    """A full batch removing a service frees its backend ids (released once the plan is in) and its sweep lists the
    holes below the highest id in use: an id in both lists went to two backends later, and a frontend's slots named
    one backend twice (seen in a soak). Every id is handed out once, and no two backends ever share one."""
    index = FamilyIndex(IPFamily.V4)
    a = svc("a", (ep("198.18.65.1"), ep("198.18.65.2"), ep("198.18.65.3")), cluster_ip="198.19.0.1")
    b = svc("b", (ep("198.18.66.1"), ep("198.18.66.2"), ep("198.18.66.3")), cluster_ip="198.19.0.2")
    _plan(index, spn("a"), a)
    _plan(index, spn("b"), b)
    plan = Plan()
    planner.plan_service(index, spn("a"), None, plan)  # a goes in a full batch: its ids are freed
    planner.sweep(index, {spn("b"): render.render(b, CTX)}, plan)
    planner.finish_plan(plan)
    plan.release(index)
    assert len(index.free_backends) == len(set(index.free_backends)) == 3
    later = Plan()
    for name, ip in (("c", "198.18.67"), ("d", "198.18.68")):
        s = svc(name, (ep(f"{ip}.1"), ep(f"{ip}.2"), ep(f"{ip}.3")), cluster_ip=f"198.19.0.{ord(name)}")
        planner.plan_service(index, spn(name), render.render(s, CTX), later)
    slots = [bid for st in index.fronts.values() for bid in st.slots]
    assert len(slots) == len(set(slots)) == 9
    assert sorted(index.backends) == sorted(slots)


def test_reverse_nat_and_backend_ids_past_16_bits_round_trip_through_the_maps() -> None:
    """Ids are 32 bits in the maps (issue 22: past 65,535 frontends): a service planned with a reverse-NAT id and
    backend ids above 65,535 is written with them, and both decoders read them back."""
    from kproxy.backends.bpf import decode
    from kproxy.backends.bpf.index import MAX_ID

    index = FamilyIndex(IPFamily.V4)
    index.next_rev, index.next_backend = 70_001, 1_000_000
    web = svc("web")
    svc_m, be_m, name_m = _kernel(index, [_plan(index, spn("web"), web)])
    master = svc_m[maps.lb_key(IPFamily.V4, "198.19.0.10", 80, 6, 0)]
    _bid, _aff, count, rev, _flags = maps.decode_service(master)
    assert (count, rev) == (3, 70_001)
    assert name_m[maps.name_key(70_001)] == maps.name_value("ns1/web:http/TCP")
    assert sorted(maps.BACKEND_ID.unpack(k)[0] for k in be_m) == [1_000_000, 1_000_001, 1_000_002]
    raw = (b"".join(svc_m), b"".join(svc_m.values()))
    be_raw = (b"".join(be_m), b"".join(be_m.values()))
    name_raw = (b"".join(name_m), b"".join(name_m.values()))
    for got in (
        decode.fast_index(IPFamily.V4, raw, be_raw, name_raw),
        decode.general_index(IPFamily.V4, raw, be_raw, name_raw),
    ):
        assert got is not None
        adopted, view = got
        assert adopted.rev_names == {70_001: "ns1/web:http/TCP"} and adopted.next_rev == 70_002
        assert set(adopted.backends) == {1_000_000, 1_000_001, 1_000_002}
        assert adopt.unchanged(adopted, view, {70_001: 1}, spn("web"), render.render(web, CTX))
    assert MAX_ID == 2**32 - 2


def test_udp_sockets_to_end_are_lost_backends_and_frontends_that_translate_anew() -> None:
    """A backend a UDP service lost: its connected sockets end (cilium#27300). A frontend that translates now and did
    not before (the Service deleted and created again): a socket connected in between went to the bare ClusterIP
    untranslated, so it ends too and reconnects through connect4. A frontend that translated already is left alone,
    and so is a batch with more new frontends than the bound (a first sync)."""
    from kproxy.backends.bpf.sockets import peers_to_end

    both = render.render(svc("dns", (ep("198.18.66.1", 53), ep("198.18.66.2", 53)), proto=Protocol.UDP), CTX)
    one = render.render(svc("dns", (ep("198.18.66.2", 53),), proto=Protocol.UDP), CTX)
    vip = (both.frontends[0].address, both.frontends[0].port)
    assert peers_to_end([(both, one)], 64) == {("198.18.66.1", 53)}
    assert vip in peers_to_end([(None, one)], 64)  # created (again): its frontends translate anew
    assert peers_to_end([(one, one)], 64) == set()
    assert peers_to_end([(None, one)], 0) == set()  # too many new frontends at once: not looked for
