"""The ledger's contract, once for every ledger-driven backend with no kernel: the fake and a throwaway fifth mode
(``fifth_mode.DictMode``, written from ``backends/__init__.py``'s list alone). Each test drives the backend only
through ``sync``, ``describe``, ``verify`` and ``request_full``, and reads the backend's own "kernel" back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kproxy.backend import LedgerProxier
from kproxy.fake import FakeProxier
from kproxy.model import Changes, IPFamily, NodeInfo
from kproxy.proxier import installed_backends

from .fifth_mode import DictMode
from .test_ledger import partial, sp, state

Factory = Callable[[], Any]


def _fake_held(p: FakeProxier) -> dict[Any, Any]:
    return {spn: s for (fam, spn), s in p.programmed.items() if fam == "IPv4"}


def _dict_held(p: DictMode) -> dict[Any, Any]:
    return dict(p.kernel[IPFamily.V4])


BACKENDS: dict[str, tuple[Factory, Callable[[Any], dict[Any, Any]]]] = {
    "fake": (FakeProxier, _fake_held),
    "fifth-mode": (DictMode, _dict_held),
}


@pytest.fixture(params=sorted(BACKENDS))
def mode(request: pytest.FixtureRequest) -> tuple[Any, Callable[[Any], dict[Any, Any]]]:
    make, held = BACKENDS[request.param]
    return make(), held


def test_first_sync_programs_every_service_and_describe_lists_them(mode: Any) -> None:
    p, held = mode
    a, b = sp("a", 1), sp("b", 2)
    res = p.sync(state(a, b), Changes(full=True))
    assert res.ok and res.full and res.families[IPFamily.V4].written == 2
    assert set(held(p)) == {a.name, b.name}
    rules = p.describe()
    assert set(rules["services"]) == {"ns/a:http/TCP", "ns/b:http/TCP"}
    assert rules["services"]["ns/b:http/TCP"]["IPv4"]["internalEndpoints"] == ["198.18.65.10:8080", "198.18.65.11:8080"]


def test_a_partial_sync_writes_only_the_dirty_service(mode: Any) -> None:
    p, held = mode
    a, b = sp("a", 1), sp("b", 1)
    assert p.sync(state(a, b), Changes(full=True)).ok
    before = held(p)
    res = p.sync(state(a, sp("b", 3)), partial("b"))
    assert res.ok and not res.full and res.families[IPFamily.V4].written == 1
    after = held(p)
    assert after[a.name] == before[a.name] and after[b.name] != before[b.name]
    res = p.sync(state(a), partial("b"))  # b deleted
    assert res.ok and set(held(p)) == {a.name}


def test_a_restart_with_nothing_changed_writes_nothing(mode: Any) -> None:
    p, held = mode
    a, b = sp("a", 1), sp("b", 2)
    assert p.sync(state(a, b), Changes(full=True)).ok
    again = type(p)()  # a new process on the same "kernel"
    if isinstance(p, DictMode):
        again.kernel = p.kernel
    else:
        again.programmed = p.programmed
    res = again.sync(state(a, b), Changes(full=True))
    assert res.ok and res.full and res.families[IPFamily.V4].written == 0
    # b deleted while it was down: no delta names it (nothing was recorded), and it counts as written all the same
    third = type(p)()
    if isinstance(p, DictMode):
        third.kernel = p.kernel
    else:
        third.programmed = again.programmed
    res = third.sync(state(a), Changes(full=True))
    assert res.ok and res.families[IPFamily.V4].written == 1 and set(held(third)) == {a.name}


def test_a_changed_context_makes_a_full_batch_and_request_full_too(mode: Any) -> None:
    p, _ = mode
    a = sp("a")
    assert p.sync(state(a), Changes(full=True)).ok
    moved = state(a, node=NodeInfo("node-1", addresses=("198.18.0.11",)))
    assert p.sync(moved, partial()).full  # the Node's addresses feed both modes' context
    assert not p.sync(moved, partial()).full
    p.request_full(IPFamily.V4)
    assert p.sync(moved, partial()).full
    assert not p.sync(moved, partial()).full


def test_verify_finds_what_someone_else_changed_and_a_full_sync_repairs_it(mode: Any) -> None:
    p, held = mode
    a, b = sp("a", 1), sp("b", 2)
    st = state(a, b)
    assert p.sync(st, Changes(full=True)).ok
    assert p.verify(st)["drift"] == 0
    if isinstance(p, DictMode):
        kernel = p.kernel[IPFamily.V4]
        del kernel[a.name]
        kernel[b.name] = {"front": "elsewhere", "to": []}
        kernel[sp("ghost").name] = {"front": "ghost", "to": []}
    else:
        del p.programmed[("IPv4", a.name)]
        p.programmed[("IPv4", b.name)] = sp("b", 1)
        p.programmed[("IPv4", sp("ghost").name)] = sp("ghost")
    report = p.verify(st)
    assert report["drift"] == 3 and report["services"]["ns/a:http/TCP"] == {"IPv4": "missing"}
    assert report["services"]["ns/b:http/TCP"]["IPv4"].startswith("different")
    assert p.sync(st, Changes(full=True)).ok
    assert p.verify(st)["drift"] == 0 and set(held(p)) == {a.name, b.name}


def test_an_identical_service_and_context_is_never_rendered_twice() -> None:
    """The ledger's render memo: a periodic full sync of an unchanged table renders nothing; a changed service, and
    every service after a context change, is rendered again."""
    p = DictMode()
    a, b = sp("a", 1), sp("b", 2)
    assert p.sync(state(a, b), Changes(full=True)).ok
    assert p.renders == 2
    assert p.sync(state(a, b), Changes(full=True)).ok
    assert p.renders == 2
    assert p.sync(state(a, sp("b", 3)), Changes(full=True)).ok
    assert p.renders == 3
    assert p.sync(state(a, sp("b", 3), node=NodeInfo("node-1", addresses=("198.18.0.11",))), partial()).ok
    assert p.renders == 5


def test_a_partial_batch_sees_the_whole_wanted_table_without_a_copy() -> None:
    """``Batch.wanted`` of a partial batch: the applied fragments with the batch's changes over them."""
    seen: list[dict[Any, Any]] = []

    class Watching(DictMode):
        def apply(self, batch: Any) -> Any:
            if batch.family is IPFamily.V4:
                seen.append({"wanted": dict(batch.wanted), "len": len(batch.wanted), "a": sp("a").name in batch.wanted})
            return super().apply(batch)

    p = Watching()
    a, b, c = sp("a", 1), sp("b", 1), sp("c", 1)
    assert p.sync(state(a, b), Changes(full=True)).ok
    assert p.sync(state(b, c), partial("a", "c")).ok
    last = seen[-1]
    assert last["len"] == 2 and not last["a"] and set(last["wanted"]) == {b.name, c.name}


def test_no_installed_backend_overrides_sync() -> None:
    for name, cls in installed_backends().items():
        if issubclass(cls, LedgerProxier):
            assert cls.sync is LedgerProxier.sync, f"{name} overrides sync"
            assert cls.describe is LedgerProxier.describe and cls.verify is LedgerProxier.verify, name
