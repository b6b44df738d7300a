"""Netlink as nf_tables speaks it, for the two raw ``NETLINK_NETFILTER`` readers (the drift watcher's notification
listener, ``kproxy.drift``, and the nftables mode's set element dumps, ``setdump``) and its one writer (the
nftables mode's element batches, ``nlwrite``): the header structs, the constants they share, the walk over a
datagram's messages and over a payload's attributes, and their encoders.

Decisions:

- **Offsets, not copies**: the walks yield where a message or an attribute is in the caller's buffer (an element
  dump parses megabytes; a slice per attribute would copy each element once more); ``attr`` slices the one
  attribute asked for.
- **A malformed length ends a walk** (a message header or an attribute shorter than its own header, a message that
  runs past its datagram): the kernel never sends one, and what follows it cannot be found.
- Numbers are the kernel's (``include/uapi/linux/netlink.h``, ``netfilter/nfnetlink.h``,
  ``netfilter/nf_tables.h``); what only one reader needs stays with it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import NamedTuple

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLM_F_DUMP_INTR = 0x10  # the dumped object changed during the dump
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, portid
NFGEN_HDR = struct.Struct("=BBH")  # family, version, res_id (big endian)
NLA_HDR = struct.Struct("=HH")  # len, type
NFNL_HDRLEN = NLMSG_HDR.size + NFGEN_HDR.size  # where an nf_tables message's attributes start
NLA_TYPE_MASK = 0x3FFF  # the type without NLA_F_NESTED and NLA_F_NET_BYTEORDER
NLA_F_NESTED = 0x8000  # libmnl sets it on every nest

# nf_tables' set-element messages and attributes (linux/netfilter/nf_tables.h), read by the element dumps
# (``setdump``) and written by the nftables mode's netlink writer (``nlwrite``)
NFT_MSG_NEWSETELEM, NFT_MSG_GETSETELEM, NFT_MSG_DELSETELEM = 12, 13, 14
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_USERDATA = 1, 2, 6
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFTNL_UDATA_SET_ELEM_COMMENT = 0  # libnftnl's user data is (type u8, length u8, value) records
#: verdict codes (linux/netfilter.h, nf_tables.h) as nft spells them; jump and goto name their chain
VERDICTS = {0: "drop", 1: "accept", -1: "continue", -2: "break", -3: "jump", -4: "goto", -5: "return"}


def align(n: int) -> int:
    """``n`` rounded up to netlink's 4-byte alignment (NLMSG_ALIGN, NLA_ALIGN)."""
    return (n + 3) & ~3


def nft_type(msg: int) -> int:
    """The netlink message type of the nf_tables message ``msg`` (an NFT_MSG_* number)."""
    return NFNL_SUBSYS_NFTABLES << 8 | msg


class Header(NamedTuple):
    """One netlink message of a datagram: where it starts (``at``) and its header's fields."""

    at: int
    length: int
    type: int
    flags: int
    seq: int
    portid: int


def headers(data: bytes) -> Iterator[Header]:
    """The messages of one datagram, in order (see the module's docstring for where the walk ends)."""
    at, size = 0, len(data)
    while at + NLMSG_HDR.size <= size:
        length, kind, flags, seq, portid = NLMSG_HDR.unpack_from(data, at)
        if length < NLMSG_HDR.size or at + length > size:
            return
        yield Header(at, length, kind, flags, seq, portid)
        at += align(length)


def attrs(data: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
    """The attributes in ``data[start:end]``: (type without the flags, payload start, payload end)."""
    end = len(data) if end is None else end
    while start + NLA_HDR.size <= end:
        length, kind = NLA_HDR.unpack_from(data, start)
        if length < NLA_HDR.size:
            return
        yield kind & NLA_TYPE_MASK, start + NLA_HDR.size, start + length
        start += align(length)


def attr(data: bytes, number: int, start: int = 0, end: int | None = None) -> bytes | None:
    """The payload of the first attribute of type ``number`` in ``data[start:end]`` (None: there is none)."""
    return next((data[a:b] for kind, a, b in attrs(data, start, end) if kind == number), None)


def nla(kind: int, payload: bytes) -> bytes:
    """One attribute: its header, ``payload`` and the padding to the next attribute."""
    return NLA_HDR.pack(NLA_HDR.size + len(payload), kind) + payload + b"\0" * (-len(payload) % 4)


def nfmsg(msg: int, flags: int, seq: int, family: int, attributes: bytes) -> bytes:
    """One nf_tables message (``msg``: an NFT_MSG_* number) of ``family`` (an NFPROTO_* number) carrying
    ``attributes`` (``nla`` values, concatenated)."""
    length = NFNL_HDRLEN + len(attributes)
    return NLMSG_HDR.pack(length, nft_type(msg), flags, seq, 0) + NFGEN_HDR.pack(family, 0, 0) + attributes


def netfilter_socket() -> socket.socket:
    """A ``NETLINK_NETFILTER`` socket of the calling thread's network namespace, bound (the kernel picks its port
    id); the caller sets its buffers, groups and blocking."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
    except OSError:
        sock.close()
        raise
    return sock
