"""The nftables mode's netlink writer (``nlwrite``) against the real kernel, in a throwaway namespace (``kpm-nlw-…``):
elements it writes are, byte for byte, what libnftables writes from the same lines (keys, data, verdicts, comments,
the counters the kernel adds), for every map and set it writes in both families, and its deletes leave what
libnftables' leave; a batch the kernel refuses changes nothing and goes to libnftables, whose answer names the
service; a transaction it does not write is libnftables'."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.backends.nftables import kernel, layout, nlwrite, setdump
from kproxy.backends.nftables.plan import Chunk
from kproxy.backends.nftables.render import Transaction
from kproxy.model import IPFamily, Protocol, ServicePortName
from kproxy.nftkernel import Nft, available
from kproxy.toolkit import netlink

from .scratch import scratch_netns

pytestmark = pytest.mark.root

PROTOS = ("tcp", "udp", "sctp")
CHAINS = ("lb-i-2", "np-a-2")  # shared chains the verdicts go to (made with the table)
OWNER = ServicePortName("ns", "web", "http", Protocol.TCP)


@pytest.fixture(scope="module")
def nft() -> Iterator[Nft]:
    if available() is not None:
        pytest.skip(f"libnftables unusable: {available()}")
    with scratch_netns("kpm-nlw-", lo_up=True) as ns:
        n = Nft(ns)
        try:
            yield n
        finally:
            n.close()


def fresh_table(nft: Nft, family: IPFamily) -> None:
    """kproxy's table with nothing but its fixed part (with the counting sets) and the chains ``CHAINS``."""
    fam = layout.FAM[family]
    nft.run(f"add table {fam} {layout.TABLE}\ndelete table {fam} {layout.TABLE}\n")
    tx = Transaction(family)
    tx.head.extend(layout.fixed_commands(family, counters=True))
    for chain in CHAINS:
        tx.add_shared_chain(chain)
    res = nft.run(tx.text())
    assert res.ok, res.error


def dump(nft: Nft, family: IPFamily) -> dict[str, Counter[bytes]]:
    """Every element of every map and set the writer writes, as the kernel dumps it (its attributes' bytes)."""
    names = sorted(nlwrite.shapes(family))
    got = nft.call(lambda: list(setdump.raw_dumps(family, names)))
    out: dict[str, Counter[bytes]] = {}
    for name, datagrams in got:
        elements: Counter[bytes] = Counter()
        for data in datagrams:
            for h in netlink.headers(data):
                if h.type != netlink.nft_type(12):  # NFT_MSG_NEWSETELEM
                    continue
                for kind, a, b in netlink.attrs(data, h.at + netlink.NFNL_HDRLEN, h.at + h.length):
                    if kind == 3:  # NFTA_SET_ELEM_LIST_ELEMENTS
                        elements.update(data[a2:b2] for _, a2, b2 in netlink.attrs(data, a, b))
        out[name] = elements
    return out


def addr(family: IPFamily) -> st.SearchStrategy[str]:
    return st.ip_addresses(v=4 if family is IPFamily.V4 else 6).map(str)


def port() -> st.SearchStrategy[int]:
    return st.integers(0, 65535)


COMMENT = st.text("abcdefghijklmnopqrstuvwxyz0123456789-./:_#", min_size=1, max_size=100)


def lines(family: IPFamily) -> dict[str, st.SearchStrategy[str]]:
    """A strategy of one element line for every map and set the writer writes (spelled as the layout writes them,
    independently of ``nlwrite``'s reading of the declarations)."""
    a, p, proto = addr(family), port(), st.sampled_from(PROTOS)
    verdict = st.sampled_from(("drop", *(f"goto {c}" for c in CHAINS), f"goto {layout.REJECT_CHAIN}"))
    slot = st.integers(0, 70000)
    out = {
        layout.SERVICE_IPS: st.builds(
            lambda k, q, n, c, v: f'{k} . {q} . {n} comment "{c}" : {v}', a, proto, p, COMMENT, verdict
        ),
        layout.SERVICE_NODEPORTS: st.builds(
            lambda q, n, c, v: f'{q} . {n} comment "{c}" : {v}', proto, p, COMMENT, verdict
        ),
        layout.SERVICE_DIGESTS: st.builds(lambda k, q, n, c: f'{k} . {q} . {n} comment "{c}"', a, proto, p, COMMENT),
        layout.HAIRPIN: st.builds(lambda x, y: f"{x} . {y}", a, a),
    }
    for base in layout.SLOT_BASES:
        for q in PROTOS:
            if base.startswith("nodeport"):
                out[layout.slot_map(base, q)] = st.builds(
                    lambda n, i, e, m, q=q: f"{q} . {n} . {i} : {e} . {m}", p, slot, a, p
                )
            else:
                out[layout.slot_map(base, q)] = st.builds(
                    lambda k, n, i, e, m, q=q: f"{k} . {q} . {n} . {i} : {e} . {m}", a, p, slot, a, p
                )
    for name in layout.count_shards(layout.ENDPOINT_COUNTERS)[:2]:
        out[name] = st.builds(lambda k, q, n, e, m: f"{k} . {q} . {n} . {e} . {m}", a, proto, p, a, p)
    for name in layout.count_shards(layout.NODEPORT_ENDPOINT_COUNTERS)[:2]:
        out[name] = st.builds(lambda q, n, e, m: f"{q} . {n} . {e} . {m}", proto, p, a, p)
    return out


def test_the_writer_takes_the_maps_and_sets_of_fixed_shape_only() -> None:
    for family in (IPFamily.V4, IPFamily.V6):
        names = set(nlwrite.shapes(family))
        wanted = {n for _, n, _ in layout.set_declarations(family, counters=True)}
        not_written = {layout.FIREWALL, layout.LOCAL_CIDRS, layout.LOCAL_IFACES, layout.NODEPORT_CIDRS}
        assert names == wanted - not_written


def key_of(line: str) -> str:
    return line.partition(" : ")[0].partition(' comment "')[0]


@st.composite
def transactions(draw: st.DrawFn, family: IPFamily) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Element lines per map (keys unique in each), and the keys of some of them to delete."""
    adds: dict[str, list[str]] = {}
    deletes: dict[str, list[str]] = {}
    for name, strategy in lines(family).items():
        got = draw(st.lists(strategy, min_size=1, max_size=4, unique_by=key_of))
        if got:
            adds[name] = got
            deletes[name] = [key_of(line) for line in got[: draw(st.integers(0, len(got)))]]
    return adds, deletes


def tx_of(family: IPFamily, adds: dict[str, list[str]], deletes: dict[str, list[str]]) -> Transaction:
    tx = Transaction(family)
    for name, texts in adds.items():
        tx.adds.setdefault(name, tx._group(tx.adds, name)).texts.extend(texts)
        tx.adds[name].owners.extend([OWNER] * len(texts))
    for name, keys in deletes.items():
        if keys:
            tx.delete_keys(((name, k) for k in keys), OWNER)
    return tx


@pytest.mark.parametrize("family", [IPFamily.V4, IPFamily.V6])
def test_written_elements_are_what_libnftables_writes(nft: Nft, family: IPFamily) -> None:
    writer = nlwrite.Writer(nft)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(transactions(family))
    def check(case: tuple[dict[str, list[str]], dict[str, list[str]]]) -> None:
        adds, deletes = case
        add, delete = tx_of(family, adds, {}), tx_of(family, {}, deletes)
        results = []
        for through_netlink in (False, True):
            fresh_table(nft, family)
            for tx in (add, delete):
                if tx.empty():
                    continue
                if through_netlink:
                    messages = nlwrite.encode(tx)
                    assert messages is not None, tx.text()
                    res = writer.submit(family, messages).result()
                    assert res is not None and res.ok, res
                else:
                    res = nft.run(tx.text())
                    assert res.ok, res.error
                results.append(dump(nft, family))
        half = len(results) // 2
        assert results[half:] == results[:half]
        assert sum(map(len, results[0].values())) == sum(map(len, adds.values()))

    try:
        check()
    finally:
        writer.close()


def test_a_refused_batch_changes_nothing_and_libnftables_names_the_service(nft: Nft) -> None:
    family = IPFamily.V4
    fresh_table(nft, family)
    m = layout.slot_map(layout.BACKENDS, "tcp")
    assert nft.run(f"add element ip {layout.TABLE} {m} {{ 198.19.0.1 . tcp . 80 . 0 : 198.18.0.1 . 8080 }}\n").ok
    before = dump(nft, family)
    other = ServicePortName("ns", "other", "http", Protocol.TCP)
    tx = Transaction(family)
    tx.add_elements([(m, "198.19.0.2 . tcp . 80 . 0", "198.18.0.2 . 8080")], None, other)
    tx.add_elements([(m, "198.19.0.1 . tcp . 80 . 0", "198.18.0.9 . 8080")], None, OWNER)  # clashes
    writer = nlwrite.Writer(nft)
    try:
        messages = nlwrite.encode(tx)
        assert messages is not None
        assert writer.submit(family, messages).result() is None  # refused: the caller asks libnftables
        assert dump(nft, family) == before  # atomic: the first element did not land either
        committed: list[Chunk] = []
        out = kernel.apply_chunks(nft, iter([Chunk(tx, {}, set(), Counter())]), committed.append, 1 << 20, writer)
        assert out.error is not None and not committed
        assert out.figures["netlink_batches"] == 1 and out.figures["netlink_refused"] == 1
        chunk, res = out.error
        assert {chunk.tx.owner_of(n) for n in res.error_lines()} == {OWNER}
        assert dump(nft, family) == before
    finally:
        writer.close()


def test_what_the_writer_does_not_write_goes_to_libnftables(nft: Nft) -> None:
    family = IPFamily.V4
    fresh_table(nft, family)
    fw = Transaction(family)  # an interval set: libnftables merges and splits ranges
    fw.add_elements([(layout.FIREWALL, "198.19.0.1 . tcp . 80 . 10.0.0.0/8", "")], "ns/web:http/TCP", OWNER)
    assert nlwrite.encode(fw) is None
    writer = nlwrite.Writer(nft)
    try:
        out = kernel.apply_chunks(nft, iter([Chunk(fw, {}, set(), Counter())]), lambda c: None, 1 << 20, writer)
        assert out.error is None and out.figures["netlink_batches"] == 0
        listing = nft.run(f"list set ip {layout.TABLE} {layout.FIREWALL}")
        assert "10.0.0.0/8" in listing.output
    finally:
        writer.close()
