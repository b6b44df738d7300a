"""Adoption's netlink element dumps parsed (no root, no kernel): the entry maps' and the digest set's elements
(``setdump.parse_elements``) and their keys spelled as ``render`` writes them (``counters.entry_text``).

The datagrams here are built attribute by attribute as the kernel's ``nf_tables_fill_setelem`` lays them out (key,
data, expressions, user data); ``tests/integration/test_nftables_restart.py`` reads a real table the same way."""

from __future__ import annotations

import socket
import struct
import sys
from collections import Counter
from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.backends.nftables import adopt, counters, layout, render, setdump
from kproxy.model import Endpoint, IPFamily, Protocol, ServicePort, ServicePortName
from kproxy.nodeaddr import FamilyContext, LocalDetect

CTX4 = FamilyContext(IPFamily.V4, local=LocalDetect("cidr", ("198.18.0.0/16",)), node_ips=("198.19.255.1",))

NESTED = 0x8000  # NLA_F_NESTED: nf_tables nests without it (nla_nest_start_noflag), a parser must not rely on that


def nla(kind: int, payload: bytes, nested: bool = False) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind | (NESTED if nested else 0))
    return head + payload + b"\0" * (-len(payload) % 4)


def verdict(code: int, chain: str = "") -> bytes:
    body = nla(1, struct.pack(">i", code)) + (nla(2, chain.encode() + b"\0") if chain else b"")
    return nla(2, nla(2, body))  # NFTA_SET_ELEM_DATA { NFTA_DATA_VERDICT { CODE, CHAIN } }


def counter_expr(packets: int) -> bytes:
    data = nla(2, nla(1, struct.pack(">Q", 100 * packets)) + nla(2, struct.pack(">Q", packets)))
    return nla(7, nla(1, b"counter\0") + data)


def element(
    key: bytes, value: bytes = b"", comment: str | None = None, packets: int | None = None, flagged: bool = False
) -> bytes:
    """One NFTA_LIST_ELEM in the kernel's order (``flagged``: its nests marked NLA_F_NESTED)."""
    body = nla(1, nla(1, key), nested=flagged) + value
    if packets is not None:
        body += counter_expr(packets)
    if comment is not None:
        text = comment.encode() + b"\0"
        body += nla(6, bytes((0, len(text))) + text)
    return nla(1, body, nested=flagged)


def message(setname: str, elements: list[bytes], flags: int = 0x2) -> bytes:
    attrs = nla(1, b"kproxy\0") + nla(2, setname.encode() + b"\0") + nla(3, b"".join(elements))
    body = struct.pack("=BBH", socket.AF_INET, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), (10 << 8) | 12, flags, 1, 0) + body


DONE = struct.pack("=IHHIIi", 20, 3, 0x2, 1, 0, 0)


def v4_entry(ip: str, proto: int, port: int) -> bytes:
    return socket.inet_aton(ip) + bytes((proto, 0, 0, 0)) + port.to_bytes(2, "big") + b"\0\0"


def test_the_entry_maps_elements_come_back_with_verdict_and_comment() -> None:
    """Two datagrams of a ``service-ips`` dump (counters on the elements, comments of several lengths, a goto, a
    drop, a jump) and a ``service-digests`` one: every element with its key bytes, its verdict and its comment."""
    a = v4_entry("198.19.0.1", 6, 80)
    b = v4_entry("198.19.0.2", 17, 53)
    c = v4_entry("198.19.0.3", 132, 9999)
    first = message(
        "service-ips",
        [
            element(a, verdict(-4, "lb-i-10"), "bench/svc-00001:http/TCP", packets=3),
            element(b, verdict(0), "bench/svc-00002:dns/UDP", packets=0),
        ],
    )
    # the attribute walk reads what the one-pattern path does not expect (flagged nests, a name of 256 bytes' padding)
    second = message(
        "service-ips",
        [
            element(c, verdict(-3, "reject-chain"), "n/s:p/SCTP", packets=7, flagged=True),
            element(a, verdict(-4, "x" * 251), "y" * 249, packets=1),
        ],
    )
    got, done = setdump.parse_elements("service-ips", [first, second + DONE])
    assert done
    assert got == [
        (a, "goto lb-i-10", "bench/svc-00001:http/TCP"),
        (b, "drop", "bench/svc-00002:dns/UDP"),
        (c, "jump reject-chain", "n/s:p/SCTP"),
        (a, "goto " + "x" * 251, "y" * 249),
    ]
    digests = message("service-digests", [element(a, comment="bench/svc-00001:http/TCP #abcdefghij"), element(b)])
    got, done = setdump.parse_elements("service-digests", [digests, DONE])
    assert done and got == [(a, "", "bench/svc-00001:http/TCP #abcdefghij"), (b, "", "")]


def test_a_dump_cut_short_interrupted_or_refused_is_not_taken_for_the_set() -> None:
    one = message("service-ips", [element(v4_entry("198.19.0.1", 6, 80), verdict(0), "x")])
    got, done = setdump.parse_elements("service-ips", [one])
    assert len(got) == 1 and not done  # no NLMSG_DONE: the caller must not take it for the whole set
    with pytest.raises(InterruptedError, match="service-ips changed during the dump"):
        setdump.parse_elements("service-ips", [message("service-ips", [], flags=0x2 | 0x10)])
    enoent = struct.pack("=IHHIIi", 36, 2, 0, 1, 0, -2) + b"\0" * 16
    with pytest.raises(OSError, match="service-ips"):
        setdump.parse_elements("service-ips", [enoent])


@pytest.mark.parametrize(
    ("family", "text", "address"),
    [
        (IPFamily.V4, "198.19.0.1 . tcp . 80", True),
        (IPFamily.V4, "198.18.128.7 . udp . 53", True),
        (IPFamily.V6, "fd00:198:18:ff:1::2 . sctp . 9999", True),
        (IPFamily.V4, "tcp . 30080", False),
        (IPFamily.V6, "udp . 32767", False),
    ],
)
def test_entry_keys_are_spelled_as_render_writes_them(family: IPFamily, text: str, address: bool) -> None:
    raw = counters.entry_bytes(family, text)
    assert counters.entry_text(family, raw, address) == text


def test_a_hairpin_key_is_spelled_as_render_writes_it() -> None:
    raw = socket.inet_aton("198.18.1.2") * 2
    assert adopt.key_text(IPFamily.V4, layout.HAIRPIN, raw) == "198.18.1.2 . 198.18.1.2"
    raw6 = socket.inet_pton(socket.AF_INET6, "fd00:198:18:7f::3") * 2
    assert adopt.key_text(IPFamily.V6, layout.HAIRPIN, raw6) == "fd00:198:18:7f::3 . fd00:198:18:7f::3"


def test_a_counting_keys_text_is_unchanged() -> None:
    """``key_text`` now spells its entry part with ``entry_text``: the same text as before, both kinds."""
    for name, text in (
        (layout.count_shards(layout.ENDPOINT_COUNTERS)[1], "198.19.0.65 . tcp . 80 . 198.18.1.2 . 8080"),
        (layout.count_shards(layout.NODEPORT_ENDPOINT_COUNTERS)[0], "udp . 30080 . 198.18.1.2 . 5353"),
    ):
        assert counters.key_text(name, IPFamily.V4, counters.key_bytes(IPFamily.V4, text)) == text


def test_services_read_in_the_background_are_taken_in_when_first_needed() -> None:
    """``adopt.read`` leaves the services' dumps running (``Adopted.pending``); the first comparison takes them in
    (entries, digest, firewall elements read before), and a failed read makes the table unadoptable (replaced
    whole) instead of passing for an empty one."""
    frag = render.render_service(
        ServicePort(
            ServicePortName("ns1", "web", "http", Protocol.TCP),
            IPFamily.V4,
            "198.18.200.1",
            80,
            cluster_endpoints=(Endpoint("198.18.1.2", 8080),),
            has_any_endpoints=True,
        ),
        CTX4,
    )
    done: Future[dict[str, list[tuple[str, str, str]]]] = Future()
    done.set_result(
        {
            layout.SERVICE_IPS: [(k, v, frag.comment) for m, k, v in frag.entries],
            layout.SERVICE_NODEPORTS: [],
            layout.SERVICE_DIGESTS: [(frag.digest_key, "", frag.digest_comment)],
            layout.HAIRPIN: [("198.18.1.2 . 198.18.1.2", "", "")],
        }
    )
    a = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, pending=done, firewall=[("other", "1.2.3.4")])
    assert a.unchanged(frag) and a.pending is None and a.ready()
    assert set(a.services) == {frag.comment, "other"} and not a.services["other"].digests_agree
    assert "wait" in a.parts and "group" in a.parts and a.hairpin == {"198.18.1.2 . 198.18.1.2"}
    failed: Future[dict[str, list[tuple[str, str, str]]]] = Future()
    failed.set_exception(OSError(2, "No such file or directory"))
    b = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, pending=failed)
    assert not b.unchanged(frag) and not b.ready() and not b.layout_ok and "No such file" in b.error


def _frag(name: str, ip: str) -> render.Fragment:
    sp = ServicePort(
        ServicePortName("ns1", name, "http", Protocol.TCP),
        IPFamily.V4,
        ip,
        80,
        cluster_endpoints=(Endpoint("198.18.1.2", 8080),),
        has_any_endpoints=True,
    )
    return render.render_service(sp, CTX4)


def _done(value: object) -> Future[dict[str, list[tuple[str, str, str]]]]:
    fut: Future[dict[str, list[tuple[str, str, str]]]] = Future()
    fut.set_result(value)  # type: ignore[arg-type]
    return fut


def test_a_restart_trusts_the_digests_and_reads_the_entry_maps_only_for_a_changed_service() -> None:
    """A trusting adoption (a restart's) takes a service whose digest matches as held without taking in the entry
    maps; ``settle`` gives their read up (the cancel flag the dump checks after each datagram); a held service that
    changed takes them in (read again when given up) and is regrouped from every dump; the counts say what was
    read."""
    web, api = _frag("web", "198.18.200.1"), _frag("api", "198.18.200.2")
    first = _done(
        {
            layout.SERVICE_DIGESTS: [(f.digest_key, "", f.digest_comment) for f in (web, api)],
            layout.HAIRPIN: [("198.18.1.2 . 198.18.1.2", "", "")],
        }
    )
    # the entry maps as the kernel sends them (one datagram each, ended), parsed only when taken in
    entries = [
        (
            layout.SERVICE_IPS,
            [
                message(
                    layout.SERVICE_IPS,
                    [
                        element(v4_entry(ip, 6, 80), verdict(-4, "lb-i-1"), c, 0)
                        for ip, c in (("198.18.200.1", web.comment), ("198.18.200.2", api.comment))
                    ],
                )
                + DONE
            ],
        ),
        (layout.SERVICE_NODEPORTS, [DONE]),
    ]
    rereads: list[int] = []

    def reread() -> list[tuple[str, list[bytes]]]:
        rereads.append(1)
        return entries

    never: Future[list[tuple[str, list[bytes]]]] = Future()  # the background read, still running
    a = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, pending=first, trusting=True)
    a.entries_pending, a.reread, a.counts = never, reread, {"datagrams": 2, "elements": 3}
    assert a.unchanged(web) and a.unchanged(api) and a.trusting
    # each held as its digest element's key and digest in one string, no Service made yet
    assert a.trusted == {f.comment: f"{f.digest_key}#{f.digest}" for f in (web, api)} and not a.services
    a.settle()
    assert a.cancel.is_set() and not rereads
    # the same service with another endpoint: its digest differs, and its old keys come from the entry maps
    moved = render.render_service(
        ServicePort(
            ServicePortName("ns1", "web", "http", Protocol.TCP),
            IPFamily.V4,
            "198.18.200.1",
            80,
            cluster_endpoints=(Endpoint("198.18.1.3", 8080),),
            has_any_endpoints=True,
        ),
        CTX4,
    )
    assert not a.unchanged(moved)
    svc = a.service(ServicePortName("ns1", "web", "http", Protocol.TCP))
    assert svc is not None and svc.entries == {(layout.SERVICE_IPS, "198.18.200.1 . tcp . 80"): "goto lb-i-1"}
    assert rereads == [1] and not a.trusting and a.counts == {"datagrams": 4, "elements": 5}
    assert a.unchanged(api)  # compared entry by entry now
    # not given up: the background read is taken in, no read again
    b = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, pending=_done(first.result()), trusting=True)
    done: Future[list[tuple[str, list[bytes]]]] = Future()
    done.set_result(entries)
    b.entries_pending, b.reread = done, reread
    assert b.service(ServicePortName("ns1", "new", "http", Protocol.TCP)) is None and b.trusting  # nothing held
    assert b.service(ServicePortName("ns1", "api", "http", Protocol.TCP)) is not None and not b.trusting
    assert rereads == [1] and b.counts == {"datagrams": 2, "elements": 2}


def test_the_services_read_runs_with_a_short_thread_switch_interval() -> None:
    """The dumps beside the render (``adopt._prompt``): the dump's thread gets the GIL back within ``SWITCH_S`` of
    each datagram rather than the default 5 ms; the interval is restored after, also when the read fails."""
    before = sys.getswitchinterval()
    assert adopt._prompt(sys.getswitchinterval) == min(before, adopt.SWITCH_S)
    assert sys.getswitchinterval() == before

    def fails() -> None:
        raise OSError(2, "gone")

    with pytest.raises(OSError):
        adopt._prompt(fails)
    assert sys.getswitchinterval() == before


_svc_shape = st.tuples(
    st.integers(0, 2),  # digest elements naming it (two: they disagree)
    st.integers(0, 2),  # service-ips entries
    st.integers(0, 1),  # service-nodeports entries
    st.integers(0, 2),  # firewall-allow elements
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_svc_shape, max_size=6))
def test_entries_taken_in_later_group_as_one_read_of_every_dump(shapes: list[tuple[int, int, int, int]]) -> None:
    """A trusting adoption keeps no dump of the digest set: the entry maps taken in later (``complete``) are merged
    into the services the digests gave. Whatever the kernel holds (digests twice or missing, entries without a
    digest, firewall elements), each service ends as reading every dump at once makes it: its entries, firewall
    keys, digest and key, and, for one with a digest, whether its digests agree."""
    dumps: dict[str, list[tuple[str, str, str]]] = {m: [] for m in adopt.DUMPED}
    firewall: list[tuple[str, str]] = []
    for i, (digests, ips, nodeports, fw) in enumerate(shapes):
        ckey = f"ns/s{i}:http/tcp"
        for d in range(digests):
            dumps[layout.SERVICE_DIGESTS].append((f"198.18.0.{i} . tcp . {80 + d}", "", f"{ckey} #d{i}{d}"))
        for e in range(ips):
            dumps[layout.SERVICE_IPS].append((f"198.18.0.{i} . tcp . {80 + e}", f"goto lb-{i}", ckey))
        for _ in range(nodeports):
            dumps[layout.SERVICE_NODEPORTS].append((f"tcp . {30000 + i}", f"goto np-{i}", ckey))
        firewall += [(ckey, f"198.18.0.{i} . tcp . 80 . 203.0.{f}.0/24") for f in range(fw)]
    dumps[layout.HAIRPIN].append(("198.18.1.2 . 198.18.1.2", "", ""))

    def seen(a: adopt.Adopted) -> dict[str, tuple[object, ...]]:
        return {
            k: (dict(s.entries), s.firewall, s.digest, s.digest_key, s.digests_agree if s.digest else None)
            for k, s in a.services.items()
        }

    whole = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, firewall=list(firewall))
    adopt._take_services(whole, dumps)
    first = {m: dumps[m] for m in (layout.SERVICE_DIGESTS, layout.HAIRPIN)}
    later = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, firewall=list(firewall), trusting=True)
    adopt._take_services(later, first)
    # before the entry maps: held are the services a digest or a firewall element names; only those one digest and
    # nothing else names are kept packed (``Adopted.trusted``)
    named = Counter(adopt.split_comment(c)[0] for _, _, c in dumps[layout.SERVICE_DIGESTS])
    walled = {ckey for ckey, _ in firewall}
    assert set(later.ckeys()) == named.keys() | walled
    assert set(later.trusted) == {k for k, n in named.items() if n == 1 and k not in walled}
    adopt._take_entries(later, {m: dumps[m] for m in adopt.ENTRY_MAPS})
    assert not later.trusted
    assert seen(later) == seen(whole)
    assert later.hairpin == whole.hairpin


@settings(max_examples=300, deadline=None)
@given(
    st.text(st.characters(blacklist_characters="#"), max_size=12),
    st.none() | st.text(max_size=12),
    st.text(max_size=12),
)
def test_a_trusted_service_keeps_its_key_and_digest_in_one_string(key: str, digest: str | None, other: str) -> None:
    """``Adopted.trusted``'s packing: a digest element's key (never a ``#``) and its comment's digest (any text, or
    none) come back whole, and a digest compares equal only to itself, whatever ``#`` it holds."""
    packed = adopt._trusted(key, digest)
    svc = adopt._service(packed)
    assert (svc.digest_key, svc.digest) == (key, digest)
    for d in (other, digest or "", f"{other}#{digest}", f"{key}#{digest}"):
        assert adopt._digest_is(packed, d) == (digest == d)


@settings(max_examples=300, deadline=None)
@given(
    st.sets(st.integers(0, 30)),
    st.sets(st.integers(0, 30)),
    st.sets(st.integers(0, 30)),
)
def test_all_wanted_counts_as_the_set_comparison_would(trusted: set[int], held: set[int], wanted: set[int]) -> None:
    """``Adopted.all_wanted`` (a count, no set of every wanted key made) answers as ``held <= wanted`` does, the
    kernel's services split between ``trusted`` (packed) and ``services`` as a restart's adoption leaves them."""
    a = adopt.Adopted(IPFamily.V4, table=True, layout_ok=True, trusting=True)
    a.trusted = {f"ns/s{i}:http/tcp": adopt._trusted(f"198.18.0.{i} . tcp . 80", "d") for i in trusted}
    a.services = {f"ns/s{i}:http/tcp": adopt.Service() for i in held - trusted}
    comments = [f"ns/s{i}:http/tcp" for i in sorted(wanted)]
    assert a.all_wanted(comments) == (set(a.ckeys()) <= set(comments))
