"""Netlink element dumps of kproxy's nf_tables sets and maps: the request, the datagrams, and two parsers: one for
the counting sets (``counters.py``), keyed by the elements' raw key bytes, and one for the elements adoption reads
(``adopt.py``: the entry maps and the digest set), each element's key bytes, verdict and comment.

Decisions:

- **Raw netlink, not libnftables**: nft 1.0.6's ``list set`` fetches every element of the table and formats each.
- **One socket for every set of a read**: the dumps run one after the other on it (a netlink socket holds one dump
  at a time), so a read of 128 sets opens one socket, not 128.
- **A read can be given up** (``raw_dumps``' ``cancel``, checked after each datagram): a restart dumps the entry maps
  in the background in case it needs them, and stops as soon as it knows it does not (``adopt``).
- **Small sets** are the caller's business and the reason it shards: the kernel resumes a set's dump at each ~32 KB
  continuation by walking the set again from its start and skipping the elements already sent, so one dump of n
  elements costs O(n^2) (a bigger receive buffer does not help: the kernel caps a dump's datagram at 32 KB).
- **Adoption's elements** (``parse_elements``): the entry maps and the digest set hold one element per service
  address (100,000 at 100,000 services), each with a comment; libnftables' ``list map`` of one costs seconds there
  (its own parse, its JSON, Python's JSON), the attribute walk here a fraction (docs/PERFORMANCE.md).
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
import threading
from collections.abc import Callable, Iterable, Iterator

from kproxy.model import IPFamily
from kproxy.toolkit import netlink

from . import layout

# nf_tables' set-element messages and attributes (shared with the writer: ``kproxy.toolkit.netlink``)
_GETSETELEM, _NEWSETELEM = netlink.NFT_MSG_GETSETELEM, netlink.NFT_MSG_NEWSETELEM
_NEWSETELEM_TYPE = netlink.nft_type(_NEWSETELEM)
_LIST_TABLE, _LIST_SET = netlink.NFTA_SET_ELEM_LIST_TABLE, netlink.NFTA_SET_ELEM_LIST_SET
_LIST_ELEMENTS, _LIST_ELEM = netlink.NFTA_SET_ELEM_LIST_ELEMENTS, netlink.NFTA_LIST_ELEM
_ELEM_KEY, _ELEM_DATA, _ELEM_USERDATA = (
    netlink.NFTA_SET_ELEM_KEY,
    netlink.NFTA_SET_ELEM_DATA,
    netlink.NFTA_SET_ELEM_USERDATA,
)
_ELEM_EXPR, _ELEM_EXPRESSIONS = 7, 11  # NFTA_SET_ELEM_EXPR, NFTA_SET_ELEM_EXPRESSIONS
_DATA_VERDICT, _VERDICT_CODE, _VERDICT_CHAIN = (
    netlink.NFTA_DATA_VERDICT,
    netlink.NFTA_VERDICT_CODE,
    netlink.NFTA_VERDICT_CHAIN,
)
_VERDICTS = netlink.VERDICTS
_UDATA_COMMENT = netlink.NFTNL_UDATA_SET_ELEM_COMMENT
_DATA_VALUE = netlink.NFTA_DATA_VALUE
_EXPR_NAME, _EXPR_DATA, _COUNTER_BYTES, _COUNTER_PACKETS = 1, 2, 1, 2
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
    return out, _walk(setname, chunks, lambda data, a, b: _elements(data, a, b, out))


def _walk(setname: str, chunks: Iterable[bytes], take: Callable[[bytes, int, int], None] | None) -> bool:
    """The one walk over a dump's datagrams: ``take(data, start, end)`` for each NFTA_SET_ELEM_LIST_ELEMENTS payload;
    whether the dump ended. InterruptedError when the set changed during the dump, OSError for an error message."""
    for data in chunks:
        for h in netlink.headers(data):
            if h.type == netlink.NLMSG_DONE:
                return True
            if h.type == netlink.NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, h.at + netlink.NLMSG_HDR.size)
                if code:
                    raise OSError(-code, f"netlink element dump of {setname}: {os.strerror(-code)}")
            elif h.flags & netlink.NLM_F_DUMP_INTR:
                raise InterruptedError(f"{setname} changed during the dump")
            elif take is not None and h.type == _NEWSETELEM_TYPE:
                for k, a, b in netlink.attrs(data, h.at + netlink.NFNL_HDRLEN, h.at + h.length):
                    if k == _LIST_ELEMENTS:
                        take(data, a, b)
    return False


def _verdict(data: bytes, start: int, end: int) -> str:
    """A verdict's text (``goto lb-i-3``, ``drop``) from an NFTA_DATA_VERDICT payload."""
    code, chain = None, ""
    for kind, a, b in netlink.attrs(data, start, end):
        if kind == _VERDICT_CODE:
            code = struct.unpack_from(">i", data, a)[0]
        elif kind == _VERDICT_CHAIN:
            chain = data[a:b].rstrip(b"\0").decode(errors="replace")
    word = _VERDICTS.get(code, str(code)) if code is not None else ""
    return f"{word} {chain}" if chain else word


def _comment(data: bytes, start: int, end: int) -> str:
    """The comment among an element's user data records ("" without one)."""
    while start + 2 <= end:
        kind, length = data[start], data[start + 1]
        if kind == _UDATA_COMMENT:
            return data[start + 2 : start + 2 + length].rstrip(b"\0").decode(errors="replace")
        start += 2 + length
    return ""


def _plain_element(data: bytes, start: int, end: int) -> tuple[bytes, str, str] | None:
    """(key bytes, verdict or "", comment or "") of one NFTA_LIST_ELEM; None without a key."""
    key, value, comment = None, "", ""
    for kind, a, b in netlink.attrs(data, start, end):
        if kind == _ELEM_KEY:
            key = netlink.attr(data, _DATA_VALUE, a, b)
        elif kind == _ELEM_DATA:
            verdicts = (_verdict(data, a2, b2) for k2, a2, b2 in netlink.attrs(data, a, b) if k2 == _DATA_VERDICT)
            value = next(verdicts, "")
        elif kind == _ELEM_USERDATA:
            comment = _comment(data, a, b)
    return None if key is None else (key, value, comment)


@functools.lru_cache(maxsize=16)
def _plain_shape(keylen: int) -> re.Pattern[bytes]:
    """For a key of ``keylen`` bytes: the pattern of one element as the kernel lays out an entry or a digest:
    NFTA_LIST_ELEM { KEY { DATA_VALUE key }, [DATA { VERDICT { CODE, [CHAIN] } }], [EXPR counter], [USERDATA] },
    capturing the key, the verdict code, the chain attribute's length and name, the user data's length and the
    comment. Lengths are checked against the names by ``_fast_element`` (a name and its padding are not told apart
    by the pattern alone)."""
    key = re.escape(struct.pack("=HHHH", 8 + keylen, _ELEM_KEY, 4 + keylen, _DATA_VALUE)) + b"(.{%d})" % keylen
    data = rb"(?:..\x02\x00..\x02\x00\x08\x00\x01\x00(.{4})(?:(..)\x02\x00([^\x00]*)\x00{1,4})?)?"
    counter = re.escape(struct.pack("=HH", 44, _ELEM_EXPR)) + b".{40}"
    userdata = rb"(?:(..)\x06\x00\x00.([^\x00]*)\x00{1,4})?"
    return re.compile(b"..\x01\x00" + key + data + b"(?:" + counter + b")?" + userdata, re.DOTALL)


def _fast_element(m: re.Match[bytes]) -> tuple[bytes, str, str] | None:
    """``_plain_shape``'s match as (key, verdict, comment), or None when a length disagrees with what the pattern
    took for a name (the attribute walk reads that element instead)."""
    key, code, chain_len, chain, ud_len, comment = m.groups()
    value = ""
    if code is not None:
        word = _VERDICTS.get(int.from_bytes(code, "big", signed=True), "")
        if not word:
            return None
        if chain is not None:
            if int.from_bytes(chain_len, "little") != len(chain) + 5:
                return None
            value = f"{word} {chain.decode(errors='replace')}"
        else:
            value = word
    text = ""
    if comment is not None:
        if int.from_bytes(ud_len, "little") != len(comment) + 7:
            return None
        text = comment.decode(errors="replace")
    return key, value, text


def _plain_elements(data: bytes, start: int, end: int, out: list[tuple[bytes, str, str]]) -> None:
    """The elements of one NFTA_SET_ELEM_LIST_ELEMENTS payload into ``out``: each by one match of its key length's
    pattern that must end where the element does, else by the attribute walk."""
    pattern: re.Pattern[bytes] | None = None
    at = start
    while at + 4 <= end:
        length = struct.unpack_from("=H", data, at)[0]
        if length < 4:
            break
        stop = at + length
        got = None
        if pattern is None and at + 12 <= end:
            keylen = struct.unpack_from("=H", data, at + 4)[0] - 8
            pattern = _plain_shape(keylen) if 0 < keylen <= 64 else None
        if pattern is not None and (m := pattern.match(data, at, stop)) is not None and m.end() == stop:
            got = _fast_element(m)
        if got is None:
            got = _plain_element(data, at + 4, stop)
        if got is not None:
            out.append(got)
        at += (length + 3) & ~3


def parse_elements(setname: str, chunks: Iterable[bytes]) -> tuple[list[tuple[bytes, str, str]], bool]:
    """A netlink element dump of any set or verdict map -> ((key bytes, verdict or "", comment or "") per element,
    whether the dump ended); a data map's values are not read (""). Raises as ``parse_raw``."""
    out: list[tuple[bytes, str, str]] = []
    return out, _walk(setname, chunks, lambda data, a, b: _plain_elements(data, a, b, out))


def _ended(data: bytes, setname: str) -> bool:
    """Whether a datagram of a dump holds its end (headers only; errors raised as ``parse_raw`` raises them)."""
    return _walk(setname, [data], None)


class Cancelled(Exception):
    """A dump given up by its caller (``raw_dumps``' ``cancel``): closing the socket ends it in the kernel."""


def _one(
    sock: socket.socket, family: IPFamily, setname: str, seq: int, cancel: threading.Event | None = None
) -> list[bytes]:
    """The datagrams of one dump on ``sock``, taken again (up to twice) when the set changed during it; Cancelled
    as soon as ``cancel`` is set (checked after each datagram)."""
    for attempt in range(3):
        chunks: list[bytes] = []
        sock.send(request(family, setname, seq + attempt))
        try:
            while True:
                chunks.append(sock.recv(_RECV))
                if _ended(chunks[-1], setname):
                    return chunks
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"netlink element dump of {setname}: given up after {len(chunks)} datagrams")
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


def raw_dumps(
    family: IPFamily, setnames: Iterable[str], cancel: threading.Event | None = None
) -> Iterator[tuple[str, list[bytes]]]:
    """(set, the datagrams of its element dump) for each of ``setnames`` in turn, on one socket, in the calling
    thread's network namespace; Cancelled once ``cancel`` is set (the socket, and the dump in the kernel, closed)."""
    with netlink.netfilter_socket() as sock:
        sock.settimeout(_TIMEOUT_S)
        for i, setname in enumerate(setnames):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"netlink element dump of {setname}: given up before it started")
            yield setname, _one(sock, family, setname, 4 * i + 1, cancel)


def raw_dump(family: IPFamily, setname: str) -> list[bytes]:
    """The datagrams of one element dump of ``setname``."""
    return next(iter(raw_dumps(family, (setname,))))[1]
