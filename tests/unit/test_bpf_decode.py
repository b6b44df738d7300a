"""The bpf mode's fast adoption decoder (``backends/bpf/decode.py``) against ``render``'s: random services planned
and executed into dicts standing for the three maps (as tests/unit/test_bpf_render.py's ``_kernel`` does), then
random corruptions (masters deleted, slots deleted, slots beyond a count or past 255, orphan slots, a nonzero padding
byte, a key twice, backend values zeroed as an array map holds "no backend", names lost or not UTF-8), raw order
shuffled, IPv4 and IPv6. ``decode.index_from_raw`` must return exactly what ``decode.general_index`` (render's
former algorithm, entry by entry: the independent reference) returns for the same maps with the all-zero backend
values left out (every field of the index and the view, dict order included), and the fast path must be the one
taken whenever the maps are consistent.

Hypothesis is derandomized and bounded: CI sees the same examples every run, in a few seconds.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.backends.bpf import decode, index, maps, render
from kproxy.backends.bpf import plan as planner
from kproxy.backends.bpf.index import FamilyIndex
from kproxy.backends.bpf.plan import Plan
from kproxy.backends.bpf.render import Context, Fragment
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROTOS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)
NODE4 = ("198.18.0.11", "198.18.65.1")
NODE6 = ("fd00:198:18::11", "fd00:198:18:1::1")


def _cluster_ip(family: IPFamily, i: int) -> str:
    return f"198.19.{i // 250}.{i % 250 + 1}" if family == IPFamily.V4 else f"fd00:198:18:19::{i + 1:x}"


def _external_ip(family: IPFamily, i: int) -> str:
    return f"198.19.{200 + i // 250}.{i % 250 + 1}" if family == IPFamily.V4 else f"fd00:198:18:200::{i + 1:x}"


def _endpoint_ip(family: IPFamily, i: int) -> str:
    return f"198.18.{i // 250 + 1}.{i % 250 + 1}" if family == IPFamily.V4 else f"fd00:198:18:2::{i + 1:x}"


@dataclass(frozen=True)
class Spec:
    """One generated service port (its name is ``s<i>``)."""

    i: int
    proto: Protocol
    port: int
    endpoints: tuple[tuple[int, int], ...]  # (address number, port); a pair may repeat
    node_port: bool
    external: bool
    affinity: int
    local_only: bool

    def name(self) -> ServicePortName:
        return ServicePortName("ns1", f"s{self.i}", "p", self.proto)

    def service(self, family: IPFamily) -> ServicePort:
        eps = tuple(Endpoint(_endpoint_ip(family, a), p, is_local=a % 3 == 0) for a, p in self.endpoints)
        return ServicePort(
            name=self.name(),
            family=family,
            cluster_ip=_cluster_ip(family, self.i),
            port=self.port,
            node_port=30000 + self.i if self.node_port else 0,
            external_ips=(_external_ip(family, self.i),) if self.external else (),
            affinity_timeout=self.affinity,
            internal_policy_local=self.local_only,
            cluster_endpoints=eps,
            local_endpoints=tuple(e for e in eps if e.is_local),
            has_any_endpoints=bool(eps),
        )


def specs(i: int) -> st.SearchStrategy[Spec]:
    return st.builds(
        Spec,
        st.just(i),
        st.sampled_from(PROTOS),
        st.sampled_from((53, 80, 443)),
        st.lists(st.tuples(st.integers(0, 40), st.sampled_from((8080, 9090))), max_size=12).map(tuple),
        st.booleans(),
        st.booleans(),
        st.sampled_from((0, 0, 30)),
        st.sampled_from((False, False, False, True)),
    )


@st.composite
def rounds(draw: st.DrawFn) -> list[dict[int, Spec]]:
    """Two or three syncs: services added, changed (endpoints, flags) and removed between them."""
    n = draw(st.integers(0, 10))
    first = {i: draw(specs(i)) for i in range(n)}
    out = [first]
    for _ in range(draw(st.integers(1, 2))):
        cur = dict(out[-1])
        for i in list(cur):
            what = draw(st.sampled_from(("keep", "keep", "change", "remove")))
            if what == "change":
                cur[i] = draw(specs(i))
            elif what == "remove":
                del cur[i]
        for i in range(n, n + draw(st.integers(0, 3))):
            cur[i] = draw(specs(i))
        n += 3
        out.append(cur)
    return out


Maps = tuple[dict[bytes, bytes], dict[bytes, bytes], dict[bytes, bytes]]


def _kernel(family: IPFamily, syncs: list[dict[int, Spec]]) -> tuple[Maps, dict[ServicePortName, Fragment]]:
    """The maps after planning every sync in turn into one index and executing the plans (puts, then deletes, in
    the plan's order), and the last sync's fragments."""
    ctx = Context(family, NODE4 if family == IPFamily.V4 else NODE6)
    index = FamilyIndex(family)
    svc_m: dict[bytes, bytes] = {}
    be_m: dict[bytes, bytes] = {}
    name_m: dict[bytes, bytes] = {}
    target = {"svc": svc_m, "be": be_m, "name": name_m}
    frags: dict[ServicePortName, Fragment] = {}
    for sync in syncs:
        plan = Plan()
        now = {s.name(): render.render(s.service(family), ctx) for s in sync.values()}
        for name in frags:
            if name not in now:
                planner.plan_service(index, name, None, plan)
        for name, frag in now.items():
            planner.plan_service(index, name, frag, plan)
        planner.finish_plan(plan)
        for role, op, keys, values in plan.ordered():
            m = target[role]
            if op == "put":
                m.update(zip(keys, values, strict=True))
            else:
                for k in keys:
                    m.pop(k, None)
        plan.release(index)
        frags = now
    return (svc_m, be_m, name_m), frags


# ------------------------------------------------------------------------------------------------ corruptions

CORRUPTIONS = (
    "master_deleted",
    "slot_deleted",
    "slots_beyond_count",
    "slot_past_255",
    "orphan_slot",
    "padding",
    "key_twice",
    "backend_zeroed",
    "name_lost",
    "name_not_utf8",
    "backend_array",
    "backend_twice",
    "slot_moved",
)
#: corruptions after which the service map is no longer consistent (the fast path must decline)
SVC_CORRUPTIONS = {
    "slot_moved",
    "master_deleted",
    "slot_deleted",
    "slots_beyond_count",
    "slot_past_255",
    "orphan_slot",
    "padding",
}


def _key_fmt(family: IPFamily) -> tuple[int, int]:
    """(key size, address size) of the service map."""
    return (maps.LB4_KEY.size, 4) if family == IPFamily.V4 else (maps.LB6_KEY.size, 16)


def _with_slot(key: bytes, al: int, slot: int) -> bytes:
    return key[: al + 2] + slot.to_bytes(2, "little") + key[al + 4 :]


def _corrupt(family: IPFamily, m: Maps, what: list[str], rnd: random.Random) -> tuple[list[tuple[bytes, bytes]], ...]:
    """The maps as (key, value) lists in a shuffled order, with the corruptions ``what`` applied."""
    svc_m, be_m, name_m = (dict(x) for x in m)
    _ks, al = _key_fmt(family)
    masters = [k for k in svc_m if k[al + 2 : al + 4] == b"\0\0"]
    slots = [k for k in svc_m if k[al + 2 : al + 4] != b"\0\0"]
    be_ids = sorted(int.from_bytes(k, "little") for k in be_m)
    some_id = rnd.choice([*be_ids, 0, 999_999])
    extra: list[tuple[bytes, bytes]] = []
    if "master_deleted" in what and masters:
        del svc_m[rnd.choice(masters)]
    if "slot_deleted" in what and slots:
        del svc_m[rnd.choice(slots)]
    masters = [k for k in masters if k in svc_m]
    if "slots_beyond_count" in what and masters:
        k = rnd.choice(masters)
        count = maps.decode_service(svc_m[k])[2]
        for j in range(1, rnd.randint(1, 3) + 1):
            svc_m[_with_slot(k, al, count + j)] = maps.slot_value(rnd.choice([*be_ids, some_id]))
    if "slot_moved" in what and len(masters) > 1:  # one master's last slot becomes another's count + 1
        a, b = rnd.sample(masters, 2)
        count_a, count_b = maps.decode_service(svc_m[a])[2], maps.decode_service(svc_m[b])[2]
        if count_a:
            svc_m[_with_slot(b, al, count_b + 1)] = svc_m.pop(_with_slot(a, al, count_a))
    if "slot_past_255" in what and masters:
        svc_m[_with_slot(rnd.choice(masters), al, rnd.choice((256, 300, 65535)))] = maps.slot_value(some_id)
    if "orphan_slot" in what:
        addr = maps.addr_bytes(_cluster_ip(family, 900))
        orphan = maps.LB4_KEY if family == IPFamily.V4 else maps.LB6_KEY
        for slot in range(1, rnd.randint(1, 3) + 1):
            svc_m[orphan.pack(addr, (80).to_bytes(2, "big"), slot, 6)] = maps.slot_value(some_id)
    if "padding" in what and svc_m:
        k = rnd.choice(list(svc_m))
        bad = bytearray(k)
        bad[al + 5 + rnd.randint(0, 2)] = rnd.randint(1, 255)
        svc_m[bytes(bad)] = maps.slot_value(some_id) if rnd.random() < 0.5 else svc_m[k]
    if "key_twice" in what and svc_m:
        k = rnd.choice(list(svc_m))
        extra.append((k, maps.slot_value(some_id) if k[al + 2 : al + 4] != b"\0\0" else svc_m[k]))
    vsize = 8 if family == IPFamily.V4 else 20
    if "backend_zeroed" in what and be_m:
        for k in rnd.sample(list(be_m), rnd.randint(1, len(be_m))):
            be_m[k] = bytes(vsize)
    if "name_lost" in what and name_m:
        del name_m[rnd.choice(list(name_m))]
    if "name_not_utf8" in what and name_m:
        k = rnd.choice(list(name_m))
        name_m[k] = maps.NAME_VAL.pack(rnd.choice((b"\xff\xfens/x", b"ns/\xe2\x82", b"ns/ok\xed\xa0\x80")))
    svc = list(svc_m.items()) + extra
    rnd.shuffle(svc)
    if "backend_array" in what:  # as maps.read_lb reads an array: index 0 up to the top id, holes all zero
        top = max(be_ids, default=0) + rnd.randint(0, 3)
        be = [(maps.backend_key(i), be_m.get(maps.backend_key(i), bytes(vsize))) for i in range(top + 1)]
    else:
        be = list(be_m.items())
        rnd.shuffle(be)
    if "backend_twice" in what and be:  # the same id again, another value (all zero or not), before or after
        k, _ = rnd.choice(be)
        be.insert(
            rnd.randint(0, len(be)),
            (k, rnd.choice((bytes(vsize), maps.backend_value(family, _endpoint_ip(family, 99), 1, 6)))),
        )
    names = list(name_m.items())
    rnd.shuffle(names)
    return svc, be, names


def _raw(entries: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    return b"".join(k for k, _ in entries), b"".join(v for _, v in entries)


def _nonzero(entries: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The backend entries ``render``'s decoder should see: an all-zero value is no backend."""
    return [(k, v) for k, v in entries if any(v)]


def _same(a: tuple[FamilyIndex, index.View], b: tuple[FamilyIndex, index.View]) -> None:
    (ia, va), (ib, vb) = a, b
    assert ia == ib
    for field in ("fronts", "backends", "rev_names", "by_rev", "rev_ids", "owned"):
        assert list(getattr(ia, field).items()) == list(getattr(ib, field).items()), field
    assert (ia.entries, ia.next_rev, ia.next_backend) == (ib.entries, ib.next_rev, ib.next_backend)
    assert list(va.items()) == list(vb.items())


def _check(family: IPFamily, m: Maps, what: list[str], seed: int) -> None:
    svc, be, names = _corrupt(family, m, what, random.Random(seed))
    svc_raw, be_raw, name_raw = _raw(svc), _raw(be), _raw(names)
    ref = decode.general_index(family, svc_raw, _raw(_nonzero(be)), name_raw)
    _same(ref, decode.general_index(family, svc_raw, be_raw, name_raw))
    _same(ref, decode.index_from_raw(family, svc_raw, be_raw, name_raw))
    if not SVC_CORRUPTIONS & set(what) and not {"key_twice", "backend_twice"} & set(what):
        assert decode.fast_index(family, svc_raw, be_raw, name_raw) is not None, "consistent maps: the fast path"


@SETTINGS
@given(
    st.sampled_from((IPFamily.V4, IPFamily.V6)),
    rounds(),
    st.lists(st.sampled_from(CORRUPTIONS), max_size=3, unique=True),
    st.integers(0, 2**32),
)
def test_decoder_equals_render_on_random_and_corrupted_maps(
    family: IPFamily, syncs: list[dict[int, Spec]], what: list[str], seed: int
) -> None:
    m, _ = _kernel(family, syncs)
    _check(family, m, what, seed)


def test_consistent_maps_at_scale_take_the_fast_path_and_agree() -> None:
    """300 services, a dozen endpoints each, some node ports and external IPs, both families, the backend map read
    as a hash map and as an array."""
    for family in (IPFamily.V4, IPFamily.V6):
        sync = {
            i: Spec(
                i,
                PROTOS[i % 3],
                80,
                tuple(((i + j) % 200, 8080) for j in range(12)),
                node_port=i % 7 == 0,
                external=i % 11 == 0,
                affinity=30 if i % 5 == 0 else 0,
                local_only=False,
            )
            for i in range(300)
        }
        m, _ = _kernel(family, [sync])
        _check(family, m, [], 1)
        _check(family, m, ["backend_array"], 2)
        _check(family, m, ["backend_array", "backend_zeroed"], 3)


def test_empty_maps() -> None:
    for family in (IPFamily.V4, IPFamily.V6):
        got = decode.index_from_raw(family, (b"", b""), (b"", b""), (b"", b""))
        _same(decode.general_index(family, (b"", b""), (b"", b""), (b"", b"")), got)
        assert decode.fast_index(family, (b"", b""), (b"", b"")) is not None


@settings(max_examples=200, derandomize=True, database=None)
@given(st.lists(st.binary(min_size=4, max_size=4), max_size=50))
def test_ipv4_texts_are_inet_ntop(addrs: list[bytes]) -> None:
    assert decode._texts4(b"".join(addrs)) == [socket.inet_ntop(socket.AF_INET, a) for a in addrs]


def test_a_backend_id_twice_decodes_as_render_reads_it() -> None:
    """No map reads so, but raw bytes might: the later value wins, an all-zero one is skipped wherever it is."""
    family = IPFamily.V4
    m, _ = _kernel(family, [{0: Spec(0, Protocol.TCP, 80, ((1, 8080), (2, 8080)), False, False, 0, False)}])
    svc, be, names = (list(x.items()) for x in m)
    other = maps.backend_value(family, _endpoint_ip(family, 7), 9090, 6)
    for twice in ([be[0], (be[0][0], bytes(8))], [(be[0][0], bytes(8)), be[0]], [be[0], (be[0][0], other)]):
        entries = twice + be[1:]
        ref = decode.general_index(family, _raw(svc), _raw(_nonzero(entries)), _raw(names))
        _same(ref, decode.index_from_raw(family, _raw(svc), _raw(entries), _raw(names)))
        _same(ref, decode.general_index(family, _raw(svc), _raw(entries), _raw(names)))


def test_slots_moved_between_masters_with_the_sum_of_counts_kept() -> None:
    """One frontend holds a slot beyond its count while another lacks its last slots, the number of slot entries
    still the sum of the counts: inconsistent, whatever master comes last in the raw order."""
    family = IPFamily.V4
    a = maps.addr_bytes(_cluster_ip(family, 0))
    b = maps.addr_bytes(_cluster_ip(family, 1))
    port = (80).to_bytes(2, "big")
    entries = [
        (maps.LB4_KEY.pack(a, port, 0, 6), maps.master_value(maps.Master(1, 0, 0, 1))),
        (maps.LB4_KEY.pack(a, port, 1, 6), maps.slot_value(1)),
        (maps.LB4_KEY.pack(a, port, 2, 6), maps.slot_value(2)),
        (maps.LB4_KEY.pack(b, port, 0, 6), maps.master_value(maps.Master(3, 0, 0, 2))),
        (maps.LB4_KEY.pack(b, port, 1, 6), maps.slot_value(3)),
        (maps.LB4_KEY.pack(b, port, 2, 6), maps.slot_value(4)),
    ]
    be = [(maps.backend_key(i), maps.backend_value(family, _endpoint_ip(family, i), 8080, 6)) for i in range(1, 5)]
    for order in (entries, entries[3:] + entries[:3], entries[::-1]):
        svc_raw = _raw(order)
        assert decode.fast_index(family, svc_raw, _raw(be)) is None
        _same(decode.general_index(family, svc_raw, _raw(be)), decode.index_from_raw(family, svc_raw, _raw(be)))


def test_objects_built_field_by_field_equal_constructed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_build`` fills Master and FrontState slots directly; with it off the constructors run: same index."""
    sync = {
        i: Spec(i, PROTOS[i % 3], 80, ((i, 8080), (i + 1, 8080)), i % 2 == 0, False, 30 * (i % 2), False)
        for i in range(9)
    }
    m, _ = _kernel(IPFamily.V4, [sync])
    raws = [_raw(list(x.items())) for x in m]
    built = decode.fast_index(IPFamily.V4, *raws)
    monkeypatch.setattr(decode, "_BUILD", False)
    constructed = decode.fast_index(IPFamily.V4, *raws)
    assert built is not None and constructed is not None
    _same(built, constructed)
    assert all(type(st.master) is maps.Master for st in built[0].fronts.values())
