"""The bpf mode's chunked plans (``planner.Plan.drain_puts``, used by large full syncs that write one chunk while they
plan the next) write exactly what one unchunked plan writes: the same puts, in per-service safe order, and the same
deletes after every put (a key deleted by one chunk and written by a later one is only written). No kernel."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.backends.bpf import maps, render
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import FamilyIndex
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Context, Fragment
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName

CTX = Context(IPFamily.V4, ())


def frag(i: int, n: int, base: int = 0) -> tuple[ServicePortName, Fragment]:
    name = ServicePortName("ns", f"s{i}", "http", Protocol.TCP)
    eps = tuple(Endpoint(f"198.18.{(base + i) % 250}.{j + 1}", 8080) for j in range(n))
    sp = ServicePort(name, IPFamily.V4, f"198.19.0.{i + 1}", 80, cluster_endpoints=eps, has_any_endpoints=bool(eps))
    return name, render.render(sp, CTX)


def run(changes: list[tuple[ServicePortName, Fragment | None]], index: FamilyIndex, chunk: int | None) -> list:
    """The executed steps (role, op, keys, values) of planning ``changes`` in chunks of ``chunk`` (None: one plan)."""
    plan = Plan()
    steps: list = []
    size = chunk or len(changes)
    for start in range(0, len(changes), size):
        for name, new in changes[start : start + size]:
            planner.plan_service(index, name, new, plan)
        if chunk is not None:
            steps += plan.drain_puts()
    planner.finish_plan(plan)
    return steps + plan.ordered()


def entries(steps: list) -> tuple[dict, dict]:
    """(role -> key -> value written last, role -> keys deleted) after executing the steps in order."""
    state: dict = {}
    deleted: dict = {}
    for role, op, keys, values in steps:
        if op == "put":
            state.setdefault(role, {}).update(zip(keys, values, strict=True))
        else:
            for k in keys:
                state.get(role, {}).pop(k, None)
                deleted.setdefault(role, set()).add(k)
    return state, deleted


def two_indexes(setup: list[tuple[ServicePortName, Fragment | None]]) -> tuple[FamilyIndex, FamilyIndex]:
    a, b = FamilyIndex(IPFamily.V4), FamilyIndex(IPFamily.V4)
    run(setup, a, None)
    run(setup, b, None)
    return a, b


def test_chunked_first_sync_writes_what_one_plan_writes() -> None:
    changes: list[tuple[ServicePortName, Fragment | None]] = [frag(i, 1 + i % 4) for i in range(40)]
    a, b = FamilyIndex(IPFamily.V4), FamilyIndex(IPFamily.V4)
    whole, chunked = run(changes, a, None), run(changes, b, 7)
    assert entries(whole) == entries(chunked)
    assert a.backends == b.backends and a.fronts == b.fronts
    # each chunk's phases keep the safe order: backends and names before slots before masters
    roles = [(role, op) for role, op, _, _ in chunked]
    assert roles[:4] == [("be", "put"), ("name", "put"), ("svc", "put"), ("svc", "put")]


def test_removals_and_reused_ids_across_chunks() -> None:
    setup: list[tuple[ServicePortName, Fragment | None]] = [frag(i, 3) for i in range(20)]
    a, b = two_indexes(setup)
    # the first services go (their backend ids are freed), later ones get new backends (reusing those ids)
    changes: list[tuple[ServicePortName, Fragment | None]] = [(frag(i, 3)[0], None) for i in range(5)]
    changes += [frag(i, 4, base=100) for i in range(5, 20)]
    whole, chunked = run(changes, a, None), run(changes, b, 3)
    assert entries(whole) == entries(chunked)
    state, _ = entries(chunked)
    # every backend id a slot names is in the backend map at the end (a reused id was not deleted after its put)
    be_keys = set(state["be"])
    for key, value in state["svc"].items():
        if key[6:8] != b"\0\0":  # a slot entry: its first 4 bytes are the backend id
            assert value[:4] in be_keys
    assert a.backends == b.backends


def test_fresh_single_frontend_fast_path_plans_what_the_general_path_plans() -> None:
    changes = [frag(i, 1 + i % 5) for i in range(30)]
    fast, general = FamilyIndex(IPFamily.V4), FamilyIndex(IPFamily.V4)
    total = sum(len(f.frontends[0].backends) for _, f in changes)
    # a free list handing out 1, 2, 3, ... (popped from its end) sends every service down the general path
    general.free_backends = list(range(total, 0, -1))
    general.next_backend = total + 1
    a, b = Plan(), Plan()
    for name, f in changes:
        planner.plan_service(fast, name, f, a)
        planner.plan_service(general, name, f, b)
    assert a.bulk_master.count == len(changes) and b.bulk_master.count == 0  # the two paths were taken
    for phase in ("be", "name", "slot", "master"):
        assert a.written(phase) == b.written(phase)
    # a bulk phase is written before the same phase's other entries, in the order the general path would
    assert [(role, op) for role, op, _, _ in a.ordered()] == [(role, op) for role, op, _, _ in b.ordered()]
    assert entries(a.ordered()) == entries(b.ordered())
    assert fast.backends == general.backends and fast.fronts == general.fronts and fast.owned == general.owned
    assert fast.svc_entries == general.svc_entries


def test_slot_keys_of_a_large_service_are_the_maps_keys() -> None:
    from kproxy.backends.bpf import maps
    from kproxy.backends.bpf import plan as planner

    name, f = frag(7, 200)
    index, plan = FamilyIndex(IPFamily.V4), Plan()
    planner.plan_service(index, name, f, plan)
    a, p, proto = f.frontends[0].key
    assert set(plan.written("slot")) == {maps.lb_key(IPFamily.V4, a, p, proto, s) for s in range(1, 201)}
    assert set(plan.written("master")) == {maps.lb_key(IPFamily.V4, a, p, proto, 0)}
    shrunk = Plan()
    planner.plan_service(index, name, frag(7, 3)[1], shrunk)
    assert set(shrunk.svc_del) == {maps.lb_key(IPFamily.V4, a, p, proto, s) for s in range(4, 201)}


def _replay_checking(state: dict[str, dict[bytes, bytes]], steps: list, allowed: dict[bytes, set[bytes]]) -> None:
    """Apply ``steps`` one map batch at a time; after each, every master's slots 1..count must exist and name a
    backend whose value is one of that frontend's old or new backends (``allowed``: frontend key head -> backend
    values). What a connect() racing the sync can see, since a batch call is not atomic across entries, is
    covered too: each put and delete is applied and checked entry by entry."""

    def check() -> None:
        for key, value in state["svc"].items():
            head, slot = key[:6], int.from_bytes(key[6:8], "little")
            if slot != 0:
                continue
            count = int.from_bytes(value[8:10], "little")
            for i in range(1, count + 1):
                slot_key = head + i.to_bytes(2, "little") + key[8:]
                assert slot_key in state["svc"], f"slot {i} of a master counting {count} is missing"
                bid = state["svc"][slot_key][:4]
                assert bid in state["be"], "a slot names a backend id the backend map lacks"
                assert state["be"][bid] in allowed[head], "a slot names another service's pod"

    for role, op, keys, values in steps:
        for i, key in enumerate(keys):
            if op == "put":
                state[role][key] = values[i]
            else:
                state[role].pop(key, None)
            check()


def test_ids_freed_in_a_sync_are_not_reused_before_it_is_in_the_kernel() -> None:
    """One service goes and another arrives in one batch: the newcomer must not take the freed backend ids while
    the leaving service's master and slots still name them (puts run before deletes), or a connect() to the leaving
    service reaches the newcomer's pod meanwhile. After the plan is in, the freed ids are handed out again."""
    index = FamilyIndex(IPFamily.V4)
    old_name, old = frag(1, 3)
    plan = Plan()
    planner.plan_service(index, old_name, old, plan)
    planner.finish_plan(plan)
    state: dict[str, dict[bytes, bytes]] = {"be": {}, "svc": {}, "name": {}}
    for role, _op, keys, values in plan.ordered():
        state[role].update(zip(keys, values, strict=True))
    plan.release(index)

    new_name, new = frag(2, 3, base=100)
    plan = Plan()
    planner.plan_service(index, old_name, None, plan)
    planner.plan_service(index, new_name, new, plan)
    planner.finish_plan(plan)
    heads = {f.key: maps.lb_key(IPFamily.V4, *f.key, 0)[:6] for fr in (old, new) for f in fr.frontends}
    allowed = {heads[f.key]: {maps.backend_value(IPFamily.V4, a, p, f.proto) for a, p in f.backends}
               for fr in (old, new) for f in fr.frontends}  # fmt: skip
    _replay_checking(state, plan.ordered(), allowed)
    freed = set(plan.freed_backends)
    assert freed and not freed & set(index.backends)
    plan.release(index)
    assert freed <= set(index.free_backends)
    later = Plan()
    planner.plan_service(index, *frag(3, 1, base=200), later)
    assert set(index.backends) & freed  # once the plan is in, a freed id is handed out again


def test_bulk_phases_of_services_above_the_cached_packers_match_the_encoders() -> None:
    """A service with more endpoints than ``planner._PACKERS_UPTO`` takes the bulk path with per-entry packing."""
    n = planner._PACKERS_UPTO + 5
    name = ServicePortName("ns", "big", "http", Protocol.TCP)
    eps = tuple(Endpoint(f"198.18.{j // 250}.{j % 250 + 1}", 8080) for j in range(n))
    sp = ServicePort(name, IPFamily.V4, "198.19.9.9", 80, cluster_endpoints=eps, has_any_endpoints=True)
    index, plan = FamilyIndex(IPFamily.V4), Plan()
    planner.plan_service(index, name, render.render(sp, CTX), plan)
    assert plan.bulk_slot.count == n and not plan.slot_put
    st = index.fronts[("198.19.9.9", 80, 6)]
    assert plan.written("slot") == {
        maps.lb_key(IPFamily.V4, "198.19.9.9", 80, 6, i): maps.slot_value(bid) for i, bid in enumerate(st.slots, 1)
    }
    assert plan.written("be") == {
        maps.backend_key(bid): maps.backend_value(IPFamily.V4, a, p, proto)
        for bid, (a, p, proto) in index.backends.items()
    }


def test_bulk_backends_with_several_target_ports_match_the_encoders() -> None:
    name = ServicePortName("ns", "mixed", "http", Protocol.TCP)
    eps = (Endpoint("198.18.7.1", 8080), Endpoint("198.18.7.2", 9090), Endpoint("198.18.7.3", 8080))
    sp = ServicePort(name, IPFamily.V4, "198.19.9.8", 80, cluster_endpoints=eps, has_any_endpoints=True)
    index, plan = FamilyIndex(IPFamily.V4), Plan()
    planner.plan_service(index, name, render.render(sp, CTX), plan)
    assert plan.bulk_be.count == 3
    assert plan.written("be") == {
        maps.backend_key(bid): maps.backend_value(IPFamily.V4, a, p, proto)
        for bid, (a, p, proto) in index.backends.items()
    }
    assert sorted((a, p) for a, p, _ in index.backends.values()) == [
        ("198.18.7.1", 8080), ("198.18.7.2", 9090), ("198.18.7.3", 8080)
    ]  # fmt: skip


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),  # a full batch (every wanted service planned, then the sweep) or a partial one
            st.dictionaries(st.integers(0, 7), st.one_of(st.none(), st.integers(0, 6)), max_size=8),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_ids_stay_unique_through_full_and_partial_batches(batches: list[tuple[bool, dict[int, int | None]]]) -> None:
    """Random sequences of batches (services added, resized, moved to other pods, removed; full batches sweep): after
    every batch no backend id is named by two slots, every slot's id is a known backend, and the free list holds
    each id once and none in use (an id handed out twice sends one service's connections to another's pod)."""
    index = FamilyIndex(IPFamily.V4)
    wanted: dict[ServicePortName, Fragment] = {}
    for full, changes in batches:
        plan = Plan()
        for i, n in changes.items():
            name, f = frag(i, n, base=7 * (n or 0)) if n is not None else (frag(i, 1)[0], None)
            if f is None:
                wanted.pop(name, None)
            else:
                wanted[name] = f
            if not full:
                planner.plan_service(index, name, f, plan)
        if full:
            for name, f in wanted.items():
                planner.plan_service(index, name, f, plan)
            planner.sweep(index, wanted, plan)
        planner.finish_plan(plan)
        plan.release(index)
        slots = [bid for st in index.fronts.values() for bid in st.slots]
        assert len(slots) == len(set(slots)), "a backend id named by two slots"
        assert set(slots) <= set(index.backends)
        assert len(index.free_backends) == len(set(index.free_backends)), "an id twice in the free list"
        assert not set(index.free_backends) & set(index.backends), "a free id in use"
