"""A partial sync of the bpf mode costs what changed, not the table: planning one service's change and releasing the
plan's freed ids allocates the same at 2,000 and at 20,000 services (tracemalloc's peak: a set or a copy of the
index is table-sized), and the O(changes) release still never hands out an id that a name holds."""

from __future__ import annotations

import sys
import tracemalloc

from kproxy.backends.bpf import adopt, render
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import FamilyIndex
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Context, Fragment, Frontend
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName

V4 = IPFamily.V4
CTX = Context(V4, ())
ENDPOINTS = 10


def _name(i: int) -> ServicePortName:
    return ServicePortName("bench", f"s{i}", "http", Protocol.TCP)


def _fragment(i: int, variant: int = 0) -> Fragment:
    """Service ``i``: one ClusterIP frontend with ENDPOINTS backends; ``variant`` moves its first endpoint."""
    backends = tuple(
        (f"10.{(i >> 8) & 255}.{i & 255}.{j + 1 + (50 * variant if j == 0 else 0)}", 8080) for j in range(ENDPOINTS)
    )
    return Fragment((Frontend(f"172.{16 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}", 80, 6, 0, 0, backends),))


def _index(n: int) -> FamilyIndex:
    """An index of ``n`` services as a first sync leaves it (planned, released)."""
    index = FamilyIndex(V4)
    plan = Plan()
    for i in range(1, n + 1):
        planner.plan_service(index, _name(i), _fragment(i), plan)
    planner.finish_plan(plan)
    plan.release(index)
    return index


def _peak(index: FamilyIndex, changes: list[tuple[ServicePortName, Fragment | None]]) -> int:
    """Bytes allocated at the peak while one partial batch is planned, ordered and released."""
    tracemalloc.start()
    try:
        plan = Plan()
        for name, frag in changes:
            planner.plan_service(index, name, frag, plan)
        planner.finish_plan(plan)
        plan.ordered()
        plan.release(index)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_one_endpoint_moved_costs_the_same_at_two_table_sizes() -> None:
    peaks = {}
    for n in (2_000, 20_000):
        index = _index(n)
        got = [_peak(index, [(_name(1 + (r * 797) % n), _fragment(1 + (r * 797) % n, r + 1))]) for r in range(5)]
        peaks[n] = max(got)
        assert len(index.rev_ids) == n and index.entries == n * (1 + ENDPOINTS)
    table = sys.getsizeof(set(range(20_000)))  # one set of the larger index's ids
    assert peaks[20_000] < table / 8, (peaks, table)
    assert peaks[20_000] < 2 * peaks[2_000] + 16_384, peaks


def test_a_service_removed_costs_the_same_at_two_table_sizes() -> None:
    peaks = {}
    for n in (2_000, 20_000):
        index = _index(n)
        peaks[n] = max(_peak(index, [(_name(1 + r * 31), None)]) for r in range(5))
        assert len(index.rev_ids) == n - 5
        assert len(index.free_revs) == 5 and len(index.free_backends) == 5 * ENDPOINTS
    table = sys.getsizeof(set(range(20_000)))
    assert peaks[20_000] < table / 8, (peaks, table)
    assert peaks[20_000] < 2 * peaks[2_000] + 16_384, peaks


def _svc(name: str, cluster_ip: str, subnet: str) -> ServicePort:
    eps = tuple(Endpoint(f"{subnet}.{j}", 8080) for j in (1, 2, 3))
    return ServicePort(
        ServicePortName("ns", name, "http", Protocol.TCP), V4, cluster_ip, 80, cluster_endpoints=eps,
        has_any_endpoints=True,
    )  # fmt: skip


def _kernel(plans: list[Plan]) -> dict[str, dict[bytes, bytes]]:
    maps_: dict[str, dict[bytes, bytes]] = {"svc": {}, "be": {}, "name": {}}
    for plan in plans:
        for role, op, keys, values in plan.ordered():
            if op == "put":
                maps_[role].update(zip(keys, values, strict=True))
            else:
                for k in keys:
                    maps_[role].pop(k, None)
    return maps_


def test_a_reverse_nat_id_two_names_hold_after_adoption_is_never_freed_by_one() -> None:
    """Adoption can give one reverse-NAT id to two names (``web``'s ClusterIP now wanted by ``web2``, ``web`` at a
    new address): the full batch's sweep notes it, and a later partial batch removing one of them leaves the id out
    of the free list while the other holds it (the release's O(changes) path does not apply then)."""
    first = FamilyIndex(V4)
    web = _svc("web", "198.19.0.10", "198.18.1")
    plan = Plan()
    planner.plan_service(first, web.name, render.render(web, CTX), plan)
    planner.finish_plan(plan)
    raw = _kernel([plan])
    index, _ = adopt.index_from_kernel(V4, raw["svc"].items(), raw["be"].items(), raw["name"].items())
    web2 = _svc("web2", "198.19.0.10", "198.18.2")  # web's ClusterIP
    moved = _svc("web", "198.19.0.11", "198.18.1")
    wanted = {web2.name: render.render(web2, CTX), web.name: render.render(moved, CTX)}
    adopt.claim_all(index, wanted, ())
    full = Plan()
    for name, frag in wanted.items():
        planner.plan_service(index, name, frag, full)
    planner.sweep(index, wanted, full)
    planner.finish_plan(full)
    full.release(index)
    shared = index.rev_ids[web.name]
    assert index.rev_ids[web2.name] == shared and index.shared_revs
    partial = Plan()
    planner.plan_service(index, web.name, None, partial)
    planner.finish_plan(partial)
    partial.release(index)
    assert index.rev_ids == {web2.name: shared}
    assert shared not in index.free_revs
    assert index.alloc_rev() != shared
