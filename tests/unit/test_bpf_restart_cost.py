"""What a restart of the bpf mode costs per service port, counted (not timed): a full batch on an index read back
from the maps compares, claims and sweeps every service port, so each step that hashes a ``ServicePortName`` (a Python
call) or decodes an entry once more per service is paid 100,000 times at scale."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import pytest

from kproxy.backends.bpf import adopt, decode
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.companion import NftView
from kproxy.backends.bpf.index import FamilyIndex, endpoints
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Fragment, Frontend
from kproxy.model import IPFamily, Protocol, ServicePortName

V4 = IPFamily.V4
ENDPOINTS = 4


def _name(i: int) -> ServicePortName:
    return ServicePortName("bench", f"s{i}", "http", Protocol.TCP)


def _fragment(i: int) -> Fragment:
    backends = tuple((f"10.{(i >> 8) & 255}.{i & 255}.{j + 1}", 8080) for j in range(ENDPOINTS))
    return Fragment((Frontend(f"172.{16 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}", 80, 6, 0, 0, backends),))


def _read_back(n: int) -> tuple[adopt.Adopted, dict[ServicePortName, Fragment]]:
    """``n`` services as a first sync writes them, read back as a restarted process adopts them; what it wants."""
    wanted = {_name(i): _fragment(i) for i in range(1, n + 1)}
    written = FamilyIndex(V4)
    plan = Plan()
    for name, frag in wanted.items():
        planner.plan_service(written, name, frag, plan)
    planner.finish_plan(plan)
    maps: dict[str, dict[bytes, bytes]] = {"svc": {}, "be": {}, "name": {}}
    for role, op, keys, values in plan.ordered():
        assert op == "put"
        maps[role].update(zip(keys, values, strict=True))
    raw = {role: (b"".join(m), b"".join(m.values())) for role, m in maps.items()}
    return adopt.adopted(V4, raw, NftView(False, frozenset(), frozenset())), wanted


@contextmanager
def _hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts ``ServicePortName.__hash__`` calls while the block runs (dict lookups call it; stored hashes do not)."""
    count = [0]
    real = ServicePortName.__hash__

    def counted(self: ServicePortName) -> int:
        count[0] += 1
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(ServicePortName, "__hash__", counted)
        yield count


@pytest.mark.parametrize("n", [300, 3000])
def test_a_full_batch_sweep_hashes_no_name_per_service(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep after a restart with nothing changed finds every frontend owned by a wanted service and every name
    wanted, and removes nothing, comparing by the hashes the dicts store: no name hashed per service port (it was two
    per service port: its owner looked up in ``wanted``, its reverse-NAT name too)."""
    a, wanted = _read_back(n)
    adopt.claim_all(a.index, wanted, ())
    plan = Plan()
    with _hashes(monkeypatch) as count:
        planner.sweep(a.index, MappingProxyType(wanted), plan)
    assert count[0] <= 2, count
    assert not plan.svc_del and not plan.be_del and not plan.name_del
    assert len(a.index.rev_ids) == n and len(a.index.owned) == n


def test_the_sweep_still_removes_what_no_wanted_service_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service no longer wanted after the restart: its frontend, backends and name go in the sweep (the path that
    looks owners up one by one, taken only when some owner is not wanted)."""
    a, wanted = _read_back(50)
    gone = _name(7)
    adopt.claim_all(a.index, wanted, ())
    del wanted[gone]
    plan = Plan()
    planner.sweep(a.index, MappingProxyType(wanted), plan)
    assert len(plan.svc_del) == 1 + ENDPOINTS and len(plan.be_del) == ENDPOINTS and len(plan.name_del) == 1
    assert gone not in a.index.rev_ids and gone not in {st.owner for st in a.index.fronts.values()}
    assert len(a.index.fronts) == 49


@contextmanager
def _sorts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the ``sorted`` calls of the decoder and of adoption's comparison while the block runs."""
    count = [0]

    def counted(*args: Any, **kw: Any) -> Any:
        count[0] += 1
        return sorted(*args, **kw)

    with monkeypatch.context() as m:
        for module in (adopt, decode):
            m.setattr(module, "sorted", counted, raising=False)
        yield count


def test_a_restart_with_nothing_changed_sorts_no_frontends_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The view holds each frontend's backends in slot order, which is the fragment's as a first sync writes it: the
    decode and the comparison of every service sort nothing (they sorted every frontend's backends twice)."""
    n = 400
    with _sorts(monkeypatch) as count:
        a, wanted = _read_back(n)
        assert all(adopt.adopted_unchanged(a, name, frag) for name, frag in wanted.items())
    assert count[0] == 0, count


def test_slots_in_another_order_than_the_fragments_still_compare_equal() -> None:
    """An endpoint replaced keeps the survivors in their slots (the new one takes the freed slot): the kernel's order
    is then not the fragment's, and the service is still unchanged for adoption and verify; a backend missing is not."""
    name = _name(1)
    before = _fragment(1)
    f0 = before.frontends[0]
    moved = Fragment((dataclasses.replace(f0, backends=(*f0.backends[1:], ("10.0.1.99", 8080))),))
    index = FamilyIndex(V4)
    plans = [Plan(), Plan()]
    for plan, frag in zip(plans, (before, moved), strict=True):
        planner.plan_service(index, name, frag, plan)
        planner.finish_plan(plan)
        plan.release(index)
    assert index.fronts[f0.key].slots[0] == ENDPOINTS + 1  # the new backend in the first slot
    maps: dict[str, dict[bytes, bytes]] = {"svc": {}, "be": {}, "name": {}}
    for plan in plans:
        for role, op, keys, values in plan.ordered():
            for k, v in zip(keys, values if op == "put" else [None] * len(keys), strict=True):
                if v is None:
                    maps[role].pop(k, None)
                else:
                    maps[role][k] = v
    raw = {role: (b"".join(m), b"".join(m.values())) for role, m in maps.items()}
    a = adopt.adopted(V4, raw, NftView(False, frozenset(), frozenset()))
    assert a.view[f0.key][2] != endpoints(V4, moved.frontends[0].backends)  # slot order, not the fragment's
    assert adopt.adopted_unchanged(a, name, moved)
    assert adopt.verify_service(a, name, moved) is None
    short = Fragment((dataclasses.replace(f0, backends=moved.frontends[0].backends[:-1]),))
    assert not adopt.adopted_unchanged(a, name, short)
    assert (adopt.verify_service(a, name, short) or "").startswith("different: frontend")
