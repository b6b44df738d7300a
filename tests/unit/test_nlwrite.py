"""The nftables mode's netlink writer without a kernel (``nlwrite``): which transactions it leaves to libnftables,
how it frames a batch and splits an element list. What the kernel makes of its bytes is checked against libnftables
in ``tests/integration/test_nftables_netlink_writes.py``."""

from __future__ import annotations

import socket
import struct
import sys

import pytest

from kproxy.backends.nftables import layout, nlwrite
from kproxy.backends.nftables.render import Transaction
from kproxy.model import IPFamily, Protocol, ServicePortName
from kproxy.toolkit import netlink

OWNER = ServicePortName("ns", "web", "http", Protocol.TCP)
SLOTS = layout.slot_map(layout.BACKENDS, "tcp")


def tx_with(name: str, line: str, family: IPFamily = IPFamily.V4) -> Transaction:
    tx = Transaction(family)
    g = tx._group(tx.adds, name)
    g.texts.append(line)
    g.owners.append(OWNER)
    return tx


@pytest.mark.parametrize(
    ("name", "line"),
    [
        (SLOTS, "fd00::1 . tcp . 80 . 0 : 198.18.0.1 . 8080"),  # an IPv6 address in an IPv4 map
        (SLOTS, "198.19.0.1 . tcp . 80 . 0 : 198.18.0.1 . 99999"),  # not a port
        (SLOTS, "198.19.0.1 . tcp . http . 0 : 198.18.0.1 . 8080"),
        (SLOTS, "198.19.0.1 . tcp . 80 . -1 : 198.18.0.1 . 8080"),
        (SLOTS, "198.19.0.1 . icmp . 80 . 0 : 198.18.0.1 . 8080"),  # not a protocol the layout writes
        (SLOTS, "198.19.0.1 . tcp . 80 : 198.18.0.1 . 8080"),  # a field missing
        (SLOTS, "198.19.0.1 . tcp . 80 . 0 . 1 : 198.18.0.1 . 8080"),  # one too many
        (SLOTS, "198.19.0.1 . tcp . 80 . 0"),  # a map element without its value
        (SLOTS, "198.19.0.1 . tcp . 80 . 0 : 198.18.0.1 . 8080 . 1"),
        (layout.SERVICE_DIGESTS, '198.19.0.1 . tcp . 80 comment "x" : drop'),  # a set element with a value
        (layout.SERVICE_IPS, '198.19.0.1 . tcp . 80 comment "x" : goto'),  # a goto without its chain
        (layout.SERVICE_IPS, '198.19.0.1 . tcp . 80 comment "x" : queue'),  # a verdict the layout never writes
        (layout.SERVICE_IPS, '198.19.0.1 . tcp . 80 comment "a"b" : drop'),  # a quote inside the comment
        (layout.SERVICE_IPS, f'198.19.0.1 . tcp . 80 comment "{"c" * 129}" : drop'),  # longer than nft allows
        (layout.FIREWALL, "198.19.0.1 . tcp . 80 . 10.0.0.0/8"),  # an interval set: libnftables' to write
        (layout.LOCAL_CIDRS, "10.0.0.0/8"),
        ("no-such-map", "198.19.0.1"),
    ],
)
def test_a_line_it_cannot_encode_leaves_the_transaction_to_libnftables(name: str, line: str) -> None:
    assert nlwrite.encode(tx_with(name, line)) is None


def test_anything_but_element_changes_is_libnftables_and_elements_are_its() -> None:
    line = "198.19.0.1 . tcp . 80 . 0 : 198.18.0.1 . 8080"
    assert nlwrite.writes(tx_with(SLOTS, line)) and nlwrite.encode(tx_with(SLOTS, line))
    for extra in ("head", "declare", "fill", "tail"):
        tx = tx_with(SLOTS, line)
        part = getattr(tx, extra)
        part.append("add chain ip kproxy x" if extra == "head" else ("add chain ip kproxy x", None))
        assert not nlwrite.writes(tx) and nlwrite.encode(tx) is None


def test_a_batch_is_framed_numbered_and_asks_for_one_acknowledgement() -> None:
    tx = Transaction(IPFamily.V6)
    tx.delete_keys([(layout.SERVICE_DIGESTS, "fd00::1 . tcp . 80")], OWNER)
    # enough elements for several messages: an element list is one attribute of at most 64 KB
    lines = [f"fd00::{i:x} . tcp . 80 . {j} : fd00:1::{i:x} . 8080" for i in range(400) for j in range(10)]
    for text in lines:
        g = tx._group(tx.adds, SLOTS)
        g.texts.append(text)
        g.owners.append(OWNER)
    messages = nlwrite.encode(tx)
    assert messages is not None and len(messages) > 3
    data = nlwrite.batch(IPFamily.V6, messages, 100)
    heads = list(netlink.headers(data))
    assert sum(h.length + (-h.length % 4) for h in heads) == len(data)
    assert [h.type for h in (heads[0], heads[-1])] == [0x10, 0x11]  # NFNL_MSG_BATCH_BEGIN, _END
    assert [h.seq for h in heads] == list(range(100, 100 + len(heads)))
    body = heads[1:-1]
    assert body[0].type == netlink.nft_type(14) and {h.type for h in body[1:]} == {netlink.nft_type(12)}
    assert [bool(h.flags & 0x4) for h in body] == [False] * (len(body) - 1) + [True]  # NLM_F_ACK: the last only
    elements = 0
    for h in body[1:]:
        assert h.length < 1 << 16
        for kind, a, b in netlink.attrs(data, h.at + netlink.NFNL_HDRLEN, h.at + h.length):
            if kind == 3:  # NFTA_SET_ELEM_LIST_ELEMENTS
                elements += sum(1 for _ in netlink.attrs(data, a, b))
    assert elements == len(lines)


def test_the_slot_index_is_in_host_byte_order_and_the_port_in_network_order() -> None:
    shape = nlwrite.shapes(IPFamily.V4)[SLOTS]
    el = nlwrite.element(shape, "198.19.0.1 . udp . 53 . 7 : 198.18.0.2 . 5353")
    key = (
        bytes([198, 19, 0, 1])
        + bytes([17, 0, 0, 0])
        + (53).to_bytes(2, "big")
        + b"\0\0"
        + (7).to_bytes(4, sys.byteorder)
    )
    data = bytes([198, 18, 0, 2]) + (5353).to_bytes(2, "big") + b"\0\0"
    assert key in el and data in el


def test_line_count_is_the_texts_without_making_it() -> None:
    tx = tx_with(SLOTS, "198.19.0.1 . tcp . 80 . 0 : 198.18.0.1 . 8080")
    assert tx.line_count() == tx.text().count("\n") == 3
    tx.head.append("add table ip kproxy")
    tx.add_shared_chain("lb-i-2")
    tx.delete_keys([(layout.SERVICE_DIGESTS, "198.19.0.1 . tcp . 80"), (layout.HAIRPIN, "1.1.1.1 . 1.1.1.1")], OWNER)
    tx.delete_chain("lb-i-3", None)
    assert tx.line_count() == tx.text().count("\n") == len(tx.lines())


def answer(seq: int, err: int) -> bytes:
    """An NLMSG_ERROR as the kernel queues it with NETLINK_CAP_ACK: the error and the original header."""
    original = netlink.NLMSG_HDR.pack(16, netlink.nft_type(12), 0, seq, 0)
    body = struct.pack("=i", err) + original
    return netlink.NLMSG_HDR.pack(16 + len(body), netlink.NLMSG_ERROR, 0, seq, 0) + body


def test_answers_count_only_their_own_batch() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with a, b:
        b.send(answer(7, -1))  # an earlier batch's refusal, left unread
        b.send(answer(12, 0) + answer(11, -17))  # this batch (10..13): its last message's ack, and a refusal
        errors, acked, lost = nlwrite._answers(a, range(10, 14), 12)
        assert (errors, acked, lost) == ([-17], True, False)
        b.send(answer(21, 0))
        assert nlwrite._answers(a, range(20, 23), 21) == ([], True, False)
        b.send(answer(31, 0))  # acknowledged, but not the last message
        assert nlwrite._answers(a, range(30, 34), 32) == ([], False, False)
