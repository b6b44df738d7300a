"""The bpf mode's index held compactly (``backends/bpf/index.py``): the backend table is the backend array's bytes
(not a dict of tuples), it behaves as the dict it replaced under any sequence of writes, and a plan's backend values
are exactly what the table holds. Memory is counted with ``kproxy.bench.memory.walk`` (what the sync bench's
breakdown uses), not timed."""

from __future__ import annotations

import gc
import ipaddress
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.backends.bpf import adopt, decode, maps
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import Backends, FamilyIndex, endpoints
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Fragment, Frontend
from kproxy.bench import memory
from kproxy.model import IPFamily, Protocol, ServicePortName

V4, V6 = IPFamily.V4, IPFamily.V6
SERVICES, ENDPOINTS = 500, 10


def _name(i: int) -> ServicePortName:
    return ServicePortName("bench", f"s{i}", "http", Protocol.TCP)


def _fragment(i: int) -> Fragment:
    backends = tuple((f"10.{(i >> 8) & 255}.{i & 255}.{j + 1}", 8080) for j in range(ENDPOINTS))
    return Fragment((Frontend(f"172.16.{(i >> 8) & 255}.{i & 255}", 80, 6, 0, 0, backends),))


def _planned(n: int) -> tuple[FamilyIndex, Plan]:
    index, plan = FamilyIndex(V4), Plan()
    for i in range(1, n + 1):
        planner.plan_service(index, _name(i), _fragment(i), plan)
    planner.finish_plan(plan)
    return index, plan


def test_backend_table_costs_bytes_per_backend_not_objects() -> None:
    """A first sync's backends held at about the array's 8 bytes each (the dict of tuples it replaced held ~140
    bytes and three objects per backend: 1.4 KB per service port at 10 endpoints)."""
    index, _ = _planned(SERVICES)
    assert len(index.backends) == SERVICES * ENDPOINTS
    got = memory.walk([memory.Owner("backends", [index.backends])])["backends"]
    assert got["bytes"] / len(index.backends) <= 12, got
    assert got["objects"] <= 8, got  # the table, its buffer and a few small ints: none per backend


def test_index_costs_under_800_bytes_per_service_port() -> None:
    """The whole index of a first sync (frontends with their slots, backends, owners, reverse-NAT ids and names),
    beyond what the wanted fragments hold already, per service port of 10 endpoints: slots are 4-byte ids in an
    array (a tuple of ints held 400 bytes), owners a tuple (a set of one held 216). It was ~2,500 bytes."""
    wanted = [(_name(i), _fragment(i)) for i in range(1, SERVICES + 1)]
    index, plan = FamilyIndex(V4), Plan()
    for name, frag in wanted:
        planner.plan_service(index, name, frag, plan)
    got = memory.walk([memory.Owner("wanted", [wanted]), memory.Owner("index", [index])])["index"]
    assert got["bytes"] / SERVICES <= 800, got
    assert got["objects"] / SERVICES <= 12, got


def test_table_bytes_are_the_planned_backend_array() -> None:
    """What the plan writes to the backend array (id -> value) is, byte for byte, what the table holds at that id;
    ids the plan did not write hold nothing."""
    index, plan = _planned(50)
    written = plan.written("be")
    assert written
    for key, value in written.items():
        bid = int.from_bytes(key, "little")
        assert index.backends.raw(bid) == value
    assert sorted(index.backends) == sorted(int.from_bytes(k, "little") for k in written)
    assert index.backends.raw(0) is None and index.backends.top() == max(index.backends)


def _addr(family: IPFamily, n: int) -> str:
    return str(ipaddress.IPv4Address(0x0A000001 + n) if family == V4 else ipaddress.IPv6Address((0xFD << 120) + n))


_ops = st.lists(
    st.tuples(st.sampled_from(("set", "del", "run")), st.integers(0, 40), st.integers(1, 65535), st.integers(0, 3)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from((V4, V6)), _ops)
def test_table_behaves_as_the_dict_it_replaced(family: IPFamily, ops: list[tuple[str, int, int, int]]) -> None:
    """Any sequence of sets, deletes and runs of new ids: the same items (in id order), length, membership, highest
    id and decoded tuples as a dict of (address, port, protocol)."""
    table, model = Backends(family), {}
    protos = (6, 17, 132, 6)
    for op, bid, port, p in ops:
        be = (_addr(family, bid * 7 + p), port, protos[p])
        if op == "set":
            table[bid] = be
            model[bid] = be
        elif op == "del":
            assert (bid in table) == (bid in model)
            table.discard(bid)
            model.pop(bid, None)
        else:
            fresh = [b for b in range(bid, bid + p + 1) if b not in model]
            if len(fresh) != p + 1:
                continue  # a run is of new ids only (a plan's fresh ones)
            scratch = Backends(family)
            for b in fresh:
                scratch[b] = (be[0], port, be[2])
                model[b] = (be[0], port, be[2])
            table.put_run(bid, b"".join(scratch.raw(b) or b"" for b in fresh))
        assert len(table) == len(model)
    assert list(table.items()) == sorted(model.items())
    assert table == model and table == Backends(family, model.items())
    assert table.top() == max(model, default=0)
    assert table.ids() == set(model)
    assert all(table.get(b) is None for b in range(45) if b not in model)


@given(st.sampled_from((V4, V6)), st.sets(st.integers(0, 60)), st.lists(st.integers(0, 80)))
def test_unused_ids_and_holes_are_the_set_arithmetic_they_replaced(
    family: IPFamily, held: set[int], used: list[int]
) -> None:
    """The sweep's byte maps answer what its sets did: the ids held that no slot names (lowest first), and the ids
    from 1 to the highest held that hold nothing (highest first), whatever ids the slots name, held or not."""
    table = Backends(family, ((b, (_addr(family, b), 80, 6)) for b in held))
    assert table.unused(iter(used)) == sorted(held - set(used))
    top = max(held, default=0)
    assert table.holes() == sorted(set(range(1, top + 1)) - held, reverse=True)


def test_planning_keeps_nothing_once_its_index_and_plan_are_gone() -> None:
    """Planning holds nothing outside the index and the plan: no memo of the addresses it packed (a bounded cache
    of a million addresses held 190 MB at 100,000 x 10, missing on every new backend)."""
    fragments = [(_name(i), _fragment(i)) for i in range(1, 2001)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index, plan = FamilyIndex(V4), Plan()
        for name, frag in fragments:
            planner.plan_service(index, name, frag, plan)
        planner.finish_plan(plan)
        assert len(index.backends) == 2000 * ENDPOINTS
        del index, plan
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 100_000, f"{kept} bytes kept after planning 20,000 backends"


def _mixed(i: int) -> Fragment:
    """Every third service port with a NodePort frontend too (the general path plans those)."""
    f = _fragment(i).frontends[0]
    if i % 3:
        return Fragment((f,))
    return Fragment((f, Frontend("192.168.0.1", 30000 + i, 6, maps.F_EXTERNAL, 0, f.backends)))


def test_floor_steps_are_built_again_as_the_sync_wrote_them() -> None:
    """The benchmark's floor replays a full sync's writes: ``full_steps`` builds them again from the applied
    fragments (the proxier no longer keeps them), the same steps in the same chunks as the pipelined sync drains."""
    items = [(_name(i), _mixed(i)) for i in range(1, 700)]
    for chunk in (0, 64):
        index, plan = FamilyIndex(V4), Plan()
        synced: list[tuple[str, str, list[bytes], list[bytes]]] = []
        for start in range(0, len(items), chunk or len(items)):  # as BpfProxier._write_maps plans a batch
            for name, frag in items[start : start + (chunk or len(items))]:
                planner.plan_service(index, name, frag, plan)
            if chunk:
                synced += [(r, o, list(k), list(v)) for r, o, k, v in plan.drain_puts()]
        planner.finish_plan(plan)
        synced += [(r, o, list(k), list(v)) for r, o, k, v in plan.ordered()]
        again = [(r, o, list(k), list(v)) for r, o, k, v in planner.full_steps(V4, items, False, chunk)]
        assert again == synced
        assert sum(len(k) for _, _, k, _ in again) == plan.writes


def test_an_adopted_index_after_its_full_batch_holds_what_a_planned_one_does() -> None:
    """A restart: the maps read back, every wanted service claims its part, the full batch sweeps. Afterwards the
    index holds no adoption lookups (frontends per reverse-NAT id, names inverted) and costs about what a first
    sync's does (the decoded addresses are its own strings: ~100 bytes more per service port)."""
    wanted = {_name(i): _fragment(i) for i in range(1, SERVICES + 1)}
    first, plan = FamilyIndex(V4), Plan()
    for name, frag in wanted.items():
        planner.plan_service(first, name, frag, plan)
    planner.finish_plan(plan)
    written: dict[str, dict[bytes, bytes]] = {"svc": {}, "be": {}, "name": {}}
    for role, _, keys, values in plan.ordered():
        written[role].update(zip(keys, values, strict=True))
    raw = {role: (b"".join(m), b"".join(m.values())) for role, m in written.items()}
    index, _ = decode.index_from_raw(V4, raw["svc"], raw["be"], raw["name"])
    assert index.by_rev
    adopt.claim_all(index, wanted, ())
    again = Plan()
    planner.sweep(index, wanted, again)
    assert again.writes == 0 and index.by_rev == {} and index.fronts == first.fronts
    got = memory.walk([memory.Owner("wanted", [wanted]), memory.Owner("index", [index])])["index"]
    assert got["bytes"] / SERVICES <= 950, got


def test_adoption_decodes_no_backend_address() -> None:
    """A restart's decode names each slot's backend by its value's address . port bytes (the view's backends are
    one bytes per frontend): no backend's address becomes text, no tuple per backend. The view of 500 service ports
    x 10 endpoints costs what its keys and bytes do (it was ~1,300 bytes per service port)."""
    wanted = {_name(i): _fragment(i) for i in range(1, SERVICES + 1)}
    index, plan = FamilyIndex(V4), Plan()
    for name, frag in wanted.items():
        planner.plan_service(index, name, frag, plan)
    planner.finish_plan(plan)
    written: dict[str, dict[bytes, bytes]] = {"svc": {}, "be": {}, "name": {}}
    for role, _, keys, values in plan.ordered():
        written[role].update(zip(keys, values, strict=True))
    be = written["be"]
    top = max(int.from_bytes(k, "little") for k in be)  # the backend array as read_lb reads it: from index 0
    array_keys = b"".join(i.to_bytes(4, "little") for i in range(top + 1))
    array_values = b"".join(be.get(i.to_bytes(4, "little"), bytes(8)) for i in range(top + 1))
    svc = (b"".join(written["svc"]), b"".join(written["svc"].values()))
    names = (b"".join(written["name"]), b"".join(written["name"].values()))
    got_index, view = decode.index_from_raw(V4, svc, (array_keys, array_values), names)
    assert got_index.backends == index.backends
    for name, frag in wanted.items():
        f = frag.frontends[0]
        assert view[f.key][2] == endpoints(V4, f.backends)
        assert adopt.unchanged(got_index, view, {view[f.key][3]: 1}, name, frag)
    walked = memory.walk([memory.Owner("index", [got_index]), memory.Owner("view", [view])])["view"]
    assert walked["bytes"] / SERVICES <= 400, walked


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from((V4, V6)),
    st.lists(st.tuples(st.integers(0, 2**128 - 1), st.integers(1, 65535)), min_size=1, max_size=12),
    st.sampled_from((6, 17, 132)),
)
def test_packing_is_the_maps_encoders(family: IPFamily, raw: list[tuple[int, int]], proto: int) -> None:
    """The planner's and the view's packing (``inet_pton`` bound to the family, the port table) gives the bytes
    ``maps``' own encoders give: a new service's backend values, each backend's value in the table, the view's
    address . port bytes."""
    make = ipaddress.IPv4Address if family == V4 else ipaddress.IPv6Address
    bits = 32 if family == V4 else 128
    pairs = tuple(dict.fromkeys((str(make(a % 2**bits)), p) for a, p in raw))
    index, plan = FamilyIndex(family), Plan()
    front = Frontend(_addr(family, 7), 80, proto, 0, 0, pairs)
    planner.plan_service(index, _name(1), Fragment((front,)), plan)
    want = [maps.backend_value(family, a, p, proto) for a, p in pairs]
    assert list(plan.written("be").values()) == want
    assert [index.backends.raw(b) for b in index.fronts[front.key].slots] == want
    assert endpoints(family, pairs) == b"".join(maps.addr_bytes(a) + maps.port_bytes(p) for a, p in pairs)
    key = maps.lb_key(family, front.address, 80, proto, 0)
    assert key in plan.written("master")


def test_a_drained_chunk_holds_its_writes_as_one_byte_string_per_phase() -> None:
    """A pipelined full sync drains each chunk's puts to the writer and keeps the drained phases until the plan
    ends: their bulk entries are then one joined byte string per phase, not the per-service pieces they were built
    from (at 100,000 x 10: ~80 MB of small objects held through the sync)."""
    index, plan = FamilyIndex(V4), Plan()
    for i in range(1, 201):
        planner.plan_service(index, _name(i), _fragment(i), plan)
    steps = plan.drain_puts()
    (done,) = plan.drained
    for bulk in (done.bulk_be, done.bulk_slot, done.bulk_master):
        assert len(bulk.keys) == len(bulk.values) == 1 and bulk.count
    assert sum(len(k) for _, _, k, _ in steps) == done.writes
    assert len(done.written("be")) == 200 * ENDPOINTS
