"""The bpf mode's chunked plans (``render.Plan.drain_puts``, used by large full syncs that write one chunk while they
plan the next) write exactly what one unchunked plan writes: the same puts, in per-service safe order, and the same
deletes after every put (a key deleted by one chunk and written by a later one is only written). No kernel."""

from __future__ import annotations

from kproxy.backends.bpf import render
from kproxy.backends.bpf.render import Context, FamilyIndex, Fragment, Plan
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
            render.plan_service(index, name, new, plan)
        if chunk is not None:
            steps += plan.drain_puts()
    render.finish_plan(plan)
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
        render.plan_service(fast, name, f, a)
        render.plan_service(general, name, f, b)
    assert (a.be_put, a.name_put, a.slot_put, a.master_put) == (b.be_put, b.name_put, b.slot_put, b.master_put)
    assert fast.backends == general.backends and fast.fronts == general.fronts and fast.owned == general.owned
    assert fast.svc_entries == general.svc_entries


def test_slot_keys_of_a_large_service_are_the_maps_keys() -> None:
    from kproxy.backends.bpf import maps

    name, f = frag(7, 200)
    index, plan = FamilyIndex(IPFamily.V4), Plan()
    render.plan_service(index, name, f, plan)
    a, p, proto = f.frontends[0].key
    assert set(plan.slot_put) == {maps.lb_key(IPFamily.V4, a, p, proto, s) for s in range(1, 201)}
    assert set(plan.master_put) == {maps.lb_key(IPFamily.V4, a, p, proto, 0)}
    shrunk = Plan()
    render.plan_service(index, name, frag(7, 3)[1], shrunk)
    assert set(shrunk.svc_del) == {maps.lb_key(IPFamily.V4, a, p, proto, s) for s in range(4, 201)}
