"""The bpf mode's traffic counters without root: the counter map's spec, the counters named per service port and
endpoint, the plan's counter writes (zeroed with each new backend and when it goes, none without the switch), and the
C source's compile-time switch (the programs have no counter map without it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import MappingProxyType

import pytest

from kproxy.backends.bpf import counters, loader, maps, render
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import FamilyIndex
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Context
from kproxy.batch import Batch, Delta
from kproxy.counters import Measure
from kproxy.model import Endpoint, IPFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName

CTX = Context(IPFamily.V4, ("198.18.0.11",))
V6 = Context(IPFamily.V6, ())


def spn(name: str) -> ServicePortName:
    return ServicePortName("ns1", name, "http", Protocol.TCP)


def svc(name: str, ips: tuple[str, ...], cip: str = "198.19.0.10", family: IPFamily = IPFamily.V4) -> ServicePort:
    eps = tuple(Endpoint(ip, 8080) for ip in ips)
    return ServicePort(spn(name), family, cip, 80, cluster_endpoints=eps, has_any_endpoints=bool(eps))


def plan_of(index: FamilyIndex, *changes: tuple[str, ServicePort | None], counting: bool = True) -> Plan:
    p = Plan(counting=counting)
    for name, sp in changes:
        planner.plan_service(index, spn(name), render.render(sp, CTX) if sp else None, p)
    planner.finish_plan(p)
    return p


def ids(keys: object) -> list[int]:
    return [maps.COUNTER_KEY.unpack(k)[0] for k in keys]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ maps


def test_counter_map_is_an_array_indexed_by_backend_id() -> None:
    assert maps.map_spec(maps.COUNTER_ROLE, IPFamily.V4, 1000, 10) == (maps.MAP_ARRAY, 4, 8, 1000, 0)
    assert maps.pin_name(maps.COUNTER_ROLE, IPFamily.V6) == f"cnt6_{maps.MAPS_VERSION}"
    assert maps.COUNTER_ROLE not in maps.ROLES  # only pinned with the switch on
    assert maps.COUNTER_ROLE in loader.PINNED_ROLES  # so the programs reading it read pinned maps only


# ------------------------------------------------------------------------------------------------ plan


def test_new_backends_get_a_zero_counter_after_their_entry_and_before_any_slot_names_them() -> None:
    index = FamilyIndex(IPFamily.V4)
    p = plan_of(index, ("a", svc("a", ("198.18.1.1", "198.18.1.2"))))
    steps = p.ordered()
    roles = [(role, op) for role, op, _, _ in steps]
    assert roles.index(("be", "put")) < roles.index(("cnt", "put")) < roles.index(("svc", "put"))
    (cnt,) = [s for s in steps if s[0] == "cnt"]
    assert sorted(ids(cnt[2])) == sorted(index.backends) == [1, 2]
    assert list(cnt[3]) == [bytes(8)] * 2
    assert p.writes == 2 + 1 + 2 + 1 + 2  # backends, name, slots, master, and the two counters


def test_a_removed_service_zeroes_its_counters_with_its_backends() -> None:
    index = FamilyIndex(IPFamily.V4)
    plan_of(index, ("a", svc("a", ("198.18.1.1", "198.18.1.2"))))
    p = plan_of(index, ("a", None))
    steps = {(role, op): keys for role, op, keys, _ in p.ordered()}
    assert ("cnt", "put") not in steps
    assert sorted(ids(steps[("cnt", "del")])) == sorted(ids(steps[("be", "del")])) == [1, 2]


def test_an_endpoint_change_zeroes_the_new_backends_counter_and_deletes_the_old_ones() -> None:
    index = FamilyIndex(IPFamily.V4)
    plan_of(index, ("a", svc("a", ("198.18.1.1", "198.18.1.2"))))
    p = plan_of(index, ("a", svc("a", ("198.18.1.1", "198.18.1.3"))))
    steps = {(role, op): keys for role, op, keys, _ in p.ordered()}
    assert ids(steps[("cnt", "put")]) == [3] and ids(steps[("cnt", "del")]) == [2]


def test_without_the_switch_a_plan_writes_no_counter() -> None:
    index = FamilyIndex(IPFamily.V4)
    plan_of(index, ("a", svc("a", ("198.18.1.1",))), counting=False)
    p = plan_of(
        index, ("a", svc("a", ("198.18.1.2",))), ("b", svc("b", ("198.18.1.3",), "198.19.0.11")), counting=False
    )
    assert p.ordered() and all(role != maps.COUNTER_ROLE for role, *_ in p.ordered())


def test_drained_puts_carry_the_counters_of_their_backends() -> None:
    index = FamilyIndex(IPFamily.V4)
    p = Plan(counting=True)
    planner.plan_service(index, spn("a"), render.render(svc("a", ("198.18.1.1", "198.18.1.2")), CTX), p)
    drained = p.drain_puts()
    assert [s[0] for s in drained] == ["be", "cnt", "name", "svc", "svc"]
    assert ids(drained[1][2]) == [1, 2]


# ------------------------------------------------------------------------------------------------ names


def batch(full: bool, *changes: tuple[str, ServicePort | None], wanted: tuple[str, ...] = ()) -> Batch:  # type: ignore[type-arg]
    deltas = tuple(Delta(spn(n), None, None, sp, render.render(sp, CTX) if sp else None) for n, sp in changes)
    state = ProxyState(MappingProxyType({}), NodeInfo("n"), 1)
    want = MappingProxyType({spn(n): render.render(svc(n, ()), CTX) for n in wanted})
    return Batch(IPFamily.V4, full, CTX, deltas, want, MappingProxyType({}), state)


def test_service_ports_are_named_with_their_endpoints_and_read_per_backend_id(tmp_path: Path) -> None:
    index = FamilyIndex(IPFamily.V4)
    a = svc("a", ("198.18.1.2", "198.18.1.1"))
    b = ServicePort(
        spn("b"), IPFamily.V4, "198.19.0.11", 80, node_port=30080,
        cluster_endpoints=(Endpoint("198.18.1.1", 8080),), has_any_endpoints=True,
    )  # fmt: skip
    plan_of(index, ("a", a), ("b", b))
    names = counters.Names((IPFamily.V4,))
    names.applied(IPFamily.V4, index, batch(True, ("a", a), ("b", b), wanted=("a", "b", "refused")))
    got = names._names[IPFamily.V4]
    # a's two backends (ids 1, 2 in its fragment's order), b's one across its two frontends
    assert got[spn("a")] == ((1, 2), ("198.18.1.2:8080", "198.18.1.1:8080"))
    assert got[spn("b")] == ((3,), ("198.18.1.1:8080",))
    assert got[spn("refused")] == ((), ())
    counts = [10 * i for i in range(max(index.backends) + 1)]
    d = counters.dump(IPFamily.V4, got, counts)
    pa = d.ports[spn("a")]
    assert dict(zip(pa.endpoints, pa.connections, strict=True)) == {
        ep: 10 * i for i, ep in zip(got[spn("a")][0], got[spn("a")][1], strict=True)
    }
    assert pa.total.connections == 30 and pa.packets is None and pa.bytes is None
    assert d.ports[spn("b")].total.connections == 30 and d.ports[spn("refused")].total.connections == 0
    # a partial batch: a removed (its counters go), b changed (a new backend, counted from what the map holds)
    p = plan_of(index, ("a", None), ("b", svc("b", ("198.18.1.9",), "198.19.0.11")))
    assert p.ordered()
    names.applied(IPFamily.V4, index, batch(False, ("a", None), ("b", svc("b", ("198.18.1.9",), "198.19.0.11"))))
    d = counters.dump(IPFamily.V4, names._names[IPFamily.V4], [0] * 16)
    assert set(d.ports) == {spn("b"), spn("refused")}
    assert d.ports[spn("b")].endpoints == ("198.18.1.9:8080",) and d.ports[spn("b")].connections == (0,)


def test_ipv6_endpoints_are_bracketed() -> None:
    index = FamilyIndex(IPFamily.V6)
    sp = svc("a", ("fd00::2",), "fd01::10", IPFamily.V6)
    planner.plan_service(index, spn("a"), render.render(sp, V6), Plan())
    assert counters.all_ids(index) == {spn("a"): ((1,), ("[fd00::2]:8080",))}


def test_the_mode_offers_connections_only() -> None:
    from kproxy.backends.bpf.proxier import BpfProxier

    assert BpfProxier.counters_offered == frozenset({Measure.CONNECTIONS})


# ------------------------------------------------------------------------------------------------ C source


def _preprocessed(*defines: str) -> str:
    """bpf/kproxy_sock.c through the C preprocessor with these defines (kernel headers left out: only kproxy's own
    macros matter here), comments and blank lines gone."""
    src = loader.SOURCE.read_text()
    src = re.sub(r"^#include <.*>$", "", src, flags=re.M)
    res = subprocess.run(
        ["cpp", "-P", f"-I{loader.SOURCE.parent}", *defines, "-"],
        input=src, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return res.stdout


PINS = [f'-DKP_PIN_{r.upper()}{n}="/p/{r}{n}"' for r in (*maps.ROLES, loader.PEER_ROLE) for n in (4, 6)]


@pytest.mark.skipif(shutil.which("cpp") is None, reason="no C preprocessor")
def test_without_the_counter_pins_the_programs_have_no_counter_map_nor_counting() -> None:
    off = _preprocessed(*PINS)
    on = _preprocessed(*PINS, '-DKP_PIN_CNT4="/p/cnt4"', '-DKP_PIN_CNT6="/p/cnt6"')
    assert "kp_cnt" not in off and "kp_count" not in off
    assert 'BPF_TABLE_PINNED("array", __u32, __u64, kp_cnt4' in on
    # the counting is in both families' translation, per connection and per new UDP flow
    assert on.count("kp_count(backend_id, 0)") == 3 and on.count("kp_count(backend_id, 1)") == 2
