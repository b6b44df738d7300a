"""Netlink element dumps of nf_tables sets whose elements carry a counter (the nftables mode's counting sets,
``counters.py``): the request, the datagrams, and a parser keyed by the elements' raw key bytes.

Decisions:

- **Raw netlink, not libnftables**: nft 1.0.6's ``list set`` fetches every element of the table and formats each.
- **One socket for every set of a read**: the dumps run one after the other on it (a netlink socket holds one dump
  at a time), so a read of 128 sets opens one socket, not 128.
- **Small sets** are the caller's business and the reason it shards: the kernel resumes a set's dump at each ~32 KB
  continuation by walking the set again from its start and skipping the elements already sent, so one dump of n
  elements costs O(n^2).
- **Parsing**: every element of a counting set without comment or timeout has the same attributes in the same order
  and the same length (key, then one ``counter`` expression: bytes, packets). A message's element list is checked
  whole against one compiled pattern (a run of such elements) and unpacked by one ``struct`` in C, straight into
  the result (no Python per element, no object kept per element but its key). A list of another shape (a kernel
  that pads 64-bit attributes, an element with a comment) is walked attribute by attribute instead.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import socket
import struct
from collections.abc import Iterable, Iterator

from kproxy.model import IPFamily
from kproxy.toolkit import netlink

from . import layout

# nf_tables' set-element messages and attributes (linux/netfilter/nf_tables.h)
_GETSETELEM, _NEWSETELEM = 13, 12  # NFT_MSG_*
_NEWSETELEM_TYPE = netlink.nft_type(_NEWSETELEM)
_LIST_TABLE, _LIST_SET, _LIST_ELEMENTS = 1, 2, 3  # NFTA_SET_ELEM_LIST_*
_LIST_ELEM = 1  # NFTA_LIST_ELEM
_ELEM_KEY, _ELEM_EXPR, _ELEM_EXPRESSIONS = 1, 7, 11  # NFTA_SET_ELEM_*
_DATA_VALUE, _EXPR_NAME, _EXPR_DATA, _COUNTER_BYTES, _COUNTER_PACKETS = 1, 1, 2, 1, 2
_RECV = 1 << 16  # a dump's datagram is at most ~32 KB (the kernel's cap on its continuation buffers)
_TIMEOUT_S = 30.0


def request(family: IPFamily, setname: str, seq: int) -> bytes:
    """The NFT_MSG_GETSETELEM dump request for ``setname`` in kproxy's table of ``family``."""
    body = netlink.nla(_LIST_TABLE, layout.TABLE.encode() + b"\0") + netlink.nla(_LIST_SET, setname.encode() + b"\0")
    nfproto = socket.AF_INET if family is IPFamily.V4 else socket.AF_INET6  # NFPROTO_IPV4/6 have the same numbers
    return netlink.nfmsg(_GETSETELEM, netlink.NLM_F_REQUEST | netlink.NLM_F_DUMP, seq, nfproto, body)


def _packets(data: bytes, start: int, end: int) -> int | None:
    """The packets of a counter expression (NFTA_EXPR_NAME "counter", NFTA_EXPR_DATA)."""
    expr = list(netlink.attrs(data, start, end))
    if not any(k == _EXPR_NAME and data[a:b].rstrip(b"\0") == b"counter" for k, a, b in expr):
        return None
    for k, a, b in expr:
        if k == _EXPR_DATA:
            for k2, a2, _ in netlink.attrs(data, a, b):
                if k2 == _COUNTER_PACKETS:
                    return int(struct.unpack_from(">Q", data, a2)[0])
    return None


def _element(data: bytes, start: int, end: int) -> tuple[bytes, int] | None:
    """(key bytes, packets) of one NFTA_LIST_ELEM."""
    key, packets = None, None
    for kind, a, b in netlink.attrs(data, start, end):
        if kind == _ELEM_KEY:
            key = netlink.attr(data, _DATA_VALUE, a, b)
        elif kind == _ELEM_EXPR:
            packets = _packets(data, a, b)
        elif kind == _ELEM_EXPRESSIONS:  # more than one expression: a list of them
            found = (_packets(data, a2, b2) for _, a2, b2 in netlink.attrs(data, a, b))
            packets = next((p for p in found if p is not None), None)
    return None if key is None or packets is None else (key, packets)


@functools.lru_cache(maxsize=16)
def _shape(keylen: int) -> tuple[re.Pattern[bytes], struct.Struct]:
    """For a key of ``keylen`` bytes (a multiple of 4): the pattern of a run of plain counting elements, each
    NFTA_LIST_ELEM { KEY { DATA_VALUE key }, EXPR { NAME "counter", DATA { BYTES u64, PACKETS u64 } } }, and the
    struct that takes (key, packets) out of one."""
    head = struct.pack("=HHHHHH", 56 + keylen, _LIST_ELEM, 8 + keylen, _ELEM_KEY, 4 + keylen, _DATA_VALUE)
    expr = struct.pack("=HHHH", 44, _ELEM_EXPR, 12, _EXPR_NAME) + b"counter\0"
    expr += struct.pack("=HHHH", 28, _EXPR_DATA, 12, _COUNTER_BYTES)
    one = re.escape(head) + b".{%d}" % keylen + re.escape(expr) + b".{8}" + re.escape(struct.pack("=HH", 12, 2))
    return re.compile(b"(?:" + one + b".{8})+", re.DOTALL), struct.Struct(f">{len(head)}x{keylen}s{len(expr) + 12}xQ")


def _elements(data: bytes, start: int, end: int, out: dict[bytes, int]) -> None:
    """The elements of one NFTA_SET_ELEM_LIST_ELEMENTS payload into ``out``: when the whole payload is a run of
    elements of the first one's shape, unpacked in C; else attribute by attribute."""
    if end - start >= 16:
        keylen = struct.unpack_from("=H", data, start + 8)[0] - 4
        if keylen > 0 and keylen % 4 == 0:
            run, one = _shape(keylen)
            if run.fullmatch(data, start, end):
                out.update(one.iter_unpack(memoryview(data)[start:end]))
                return
    for _, a, b in netlink.attrs(data, start, end):
        got = _element(data, a, b)
        if got is not None:
            out[got[0]] = got[1]


def parse_raw(setname: str, chunks: Iterable[bytes]) -> tuple[dict[bytes, int], bool]:
    """A netlink element dump of a counting set (the datagrams it was read in) -> (packets per key bytes, whether
    the dump ended). InterruptedError when the set changed during the dump, OSError for an error message."""
    out: dict[bytes, int] = {}
    for data in chunks:
        for h in netlink.headers(data):
            if h.type == netlink.NLMSG_DONE:
                return out, True
            if h.type == netlink.NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, h.at + netlink.NLMSG_HDR.size)
                if code:
                    raise OSError(-code, f"netlink element dump of {setname}: {os.strerror(-code)}")
            elif h.flags & netlink.NLM_F_DUMP_INTR:
                raise InterruptedError(f"{setname} changed during the dump")
            elif h.type == _NEWSETELEM_TYPE:
                for k, a, b in netlink.attrs(data, h.at + netlink.NFNL_HDRLEN, h.at + h.length):
                    if k == _LIST_ELEMENTS:
                        _elements(data, a, b, out)
    return out, False


def _ended(data: bytes, setname: str) -> bool:
    """Whether a datagram of a dump holds its end (headers only; errors raised as ``parse_raw`` raises them)."""
    for h in netlink.headers(data):
        if h.type == netlink.NLMSG_DONE:
            return True
        if h.type == netlink.NLMSG_ERROR:
            parse_raw(setname, [data[h.at : h.at + h.length]])
        elif h.flags & netlink.NLM_F_DUMP_INTR:
            raise InterruptedError(f"{setname} changed during the dump")
    return False


def _one(sock: socket.socket, family: IPFamily, setname: str, seq: int) -> list[bytes]:
    """The datagrams of one dump on ``sock``, taken again (up to twice) when the set changed during it."""
    for attempt in range(3):
        chunks: list[bytes] = []
        sock.send(request(family, setname, seq + attempt))
        try:
            while True:
                chunks.append(sock.recv(_RECV))
                if _ended(chunks[-1], setname):
                    return chunks
        except InterruptedError:
            _drain(sock, chunks[-1])
            continue
    raise OSError(errno.EAGAIN, f"netlink element dump of {setname}: the set kept changing")


def _drain(sock: socket.socket, last: bytes) -> None:
    """Read an interrupted dump to its end (its NLMSG_DONE or error), so the socket can carry the next one."""
    data = last
    for _ in range(1 << 20):  # bounded: a dump ends
        if any(h.type in (netlink.NLMSG_DONE, netlink.NLMSG_ERROR) for h in netlink.headers(data)):
            return
        data = sock.recv(_RECV)


def raw_dumps(family: IPFamily, setnames: Iterable[str]) -> Iterator[tuple[str, list[bytes]]]:
    """(set, the datagrams of its element dump) for each of ``setnames`` in turn, on one socket, in the calling
    thread's network namespace."""
    with netlink.netfilter_socket() as sock:
        sock.settimeout(_TIMEOUT_S)
        for i, setname in enumerate(setnames):
            yield setname, _one(sock, family, setname, 4 * i + 1)


def raw_dump(family: IPFamily, setname: str) -> list[bytes]:
    """The datagrams of one element dump of ``setname``."""
    return next(iter(raw_dumps(family, (setname,))))[1]
