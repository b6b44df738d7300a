"""The netlink walk and encoders both raw nf_tables readers share (``kproxy.toolkit.netlink``), on datagrams a real
kernel sent: the counting sets' element dumps of ``golden/nftables/counters_dump.json`` (captured by
``tests/integration/test_nftables_counters.py``) and the notifications of ``test_drift.CAPTURED``; the encoders
against the walk and against the dump request the kernel answered in that integration test."""

from __future__ import annotations

import base64
import json
import socket
import struct
from pathlib import Path

from kproxy.backends.nftables import setdump
from kproxy.model import IPFamily
from kproxy.toolkit import netlink

from .test_drift import CAPTURED

DUMP = json.loads((Path(__file__).parent / "golden" / "nftables" / "counters_dump.json").read_text())
NEWSETELEM, GETSETELEM, NEWGEN = 12, 13, 15  # NFT_MSG_*
NLM_F_MULTI = 0x2


def dump(name: str) -> list[bytes]:
    return [base64.b64decode(c) for c in DUMP["netlink_dump_base64"][name]]


def span(data: bytes, number: int, start: int, end: int) -> tuple[int, int]:
    """Where the payload of the first attribute ``number`` in ``data[start:end]`` is."""
    return next((a, b) for k, a, b in netlink.attrs(data, start, end) if k == number)


def test_a_kernel_dump_is_element_messages_then_done_each_datagram_walked_whole() -> None:
    for name in DUMP["netlink_dump_base64"]:
        chunks = dump(name)
        seen = [(h.type, h.flags, h.seq, h.portid) for c in chunks for h in netlink.headers(c)]
        assert seen[-1][0] == netlink.NLMSG_DONE
        assert {t for t, *_ in seen[:-1]} == {netlink.nft_type(NEWSETELEM)} == {0x0A0C}
        assert {f for _, f, *_ in seen} == {NLM_F_MULTI} and len({(s, p) for *_, s, p in seen}) == 1  # one dump
        for c in chunks:  # the messages tile each datagram
            assert sum(netlink.align(h.length) for h in netlink.headers(c)) == len(c)


def test_the_attributes_of_an_element_message() -> None:
    """NFTA_SET_ELEM_LIST_TABLE, _SET and _ELEMENTS, the elements' list walked as the parser walks it: one
    NFTA_LIST_ELEM per element, whose key is the one ``setdump.parse_raw`` reports."""
    chunks = dump("endpoint-counters")
    first = chunks[0]
    (h,) = netlink.headers(first)
    start, end = h.at + netlink.NFNL_HDRLEN, h.at + h.length
    assert [k for k, _, _ in netlink.attrs(first, start, end)] == [1, 2, 3]
    assert netlink.attr(first, 1, start, end) == b"kproxy\0"
    assert netlink.attr(first, 2, start, end) == b"endpoint-counters\0"
    assert netlink.attr(first, 9, start, end) is None
    (_, a, b) = next(x for x in netlink.attrs(first, start, end) if x[0] == 3)
    elems = list(netlink.attrs(first, a, b))
    assert {k for k, _, _ in elems} == {1} and b == end  # NFTA_LIST_ELEM, the list ends the message
    keys = {netlink.attr(first, 1, *span(first, 1, x1, x2)) for _, x1, x2 in elems}  # KEY's DATA_VALUE
    assert keys == set(setdump.parse_raw("endpoint-counters", chunks)[0]) and len(keys) == 6


def test_notifications_carry_the_generation_and_its_committer() -> None:
    """Every message of a committed transaction holds its generation in the nfgen header's res_id (big endian),
    and NFT_MSG_NEWGEN, last, holds it again with the committer's pid and name."""
    for hexed in CAPTURED.values():
        data = bytes.fromhex(hexed)
        msgs = list(netlink.headers(data))
        assert sum(netlink.align(h.length) for h in msgs) == len(data)
        assert msgs[-1].type == netlink.nft_type(NEWGEN) and all(h.type >> 8 == 10 for h in msgs)
        gens = {socket.ntohs(netlink.NFGEN_HDR.unpack_from(data, h.at + netlink.NLMSG_HDR.size)[2]) for h in msgs}
        last = msgs[-1]
        body = data[last.at + netlink.NFNL_HDRLEN : last.at + last.length]
        gen_id, pid, name = (netlink.attr(body, n) for n in (1, 2, 3))  # NFTA_GEN_ID, _PROC_PID, _PROC_NAME
        assert gen_id is not None and pid is not None and name is not None
        assert gens == {int.from_bytes(gen_id, "big")} and struct.unpack(">I", pid)[0] > 0
        assert name in (b"nft\0", b"iptables-nft\0") and {h.portid for h in msgs} == {struct.unpack(">I", pid)[0]}


def test_the_encoders_write_what_the_walk_reads() -> None:
    body = netlink.nla(1, b"kproxy\0") + netlink.nla(0x8000 | 3, netlink.nla(1, b"\1\2\3"))  # a nested one
    msg = netlink.nfmsg(GETSETELEM, netlink.NLM_F_REQUEST | netlink.NLM_F_DUMP, 7, socket.AF_INET6, body)
    (h,) = netlink.headers(msg)
    assert (h.at, h.length, h.type, h.flags, h.seq, h.portid) == (0, len(msg), 0x0A0D, 0x301, 7, 0)
    assert netlink.NFGEN_HDR.unpack_from(msg, netlink.NLMSG_HDR.size) == (socket.AF_INET6, 0, 0)
    got = list(netlink.attrs(msg, netlink.NFNL_HDRLEN))
    assert [k for k, _, _ in got] == [1, 3]  # the nested flag is not part of the type
    assert msg[got[0][1] : got[0][2]] == b"kproxy\0" and len(msg) % 4 == 0  # 7 bytes, padded to 8
    assert netlink.attr(msg, 1, got[1][1], got[1][2]) == b"\1\2\3"


def test_the_dump_request_is_the_one_the_kernel_answered() -> None:
    """The request as ``setdump`` wrote it before the shared encoder (the one whose answer the golden dump holds,
    but for its sequence number)."""
    assert setdump.request(IPFamily.V4, "endpoint-counters", 5).hex() == (
        "380000000d0a01030500000000000000020000000b0001006b70726f7879000016000200656e64706f696e742d636f756e74657273"
        "000000"
    )


def test_a_malformed_length_ends_the_walk() -> None:
    """A message running past its datagram, or an attribute shorter than its header, ends the walk there: what
    follows it cannot be found."""
    (data,) = dump("nodeport-endpoint-counters")
    assert [h.type for h in netlink.headers(data)] == [0x0A0C, netlink.NLMSG_DONE]
    assert [h.type for h in netlink.headers(data[:-1])] == [0x0A0C]  # DONE cut short
    assert list(netlink.headers(b"\x08\0\0\0" + data[4:])) == []  # a length below the header's own
    bad = netlink.nla(1, b"a") + struct.pack("=HH", 2, 2) + netlink.nla(3, b"c")
    assert [k for k, _, _ in netlink.attrs(bad)] == [1] and netlink.attr(bad, 3) is None
