"""Element changes written as nf_tables netlink batches directly, without libnftables parsing their text.

A transaction that holds nothing but element deletes and adds (every chunk of a big full sync after the first, and
most partial syncs) is encoded here from the transaction's own element lines into one netlink batch (``BATCH_BEGIN``,
``NEWSETELEM`` / ``DELSETELEM`` messages, ``BATCH_END``) and sent on a ``NETLINK_NETFILTER`` socket of the context's
namespace; the kernel takes it as the same atomic transaction libnftables would have sent.

Decisions:

- **Why**: at 100,000 x 10 libnftables' parse and evaluation of the element text is most of a full sync (~16 of
  27 s of CPU, and a few kB per element it parses); the kernel's own share is ~6 s, of which ~3 s is the validation
  walk every transaction that adds a ``goto`` element pays (docs/PERFORMANCE.md). Encoding an element here is a few
  C calls (``inet_pton``, ``struct``), its bytes ~100.
- **What it takes**: the maps and sets whose element types it knows, read from the layout's own declarations
  (``layout.set_declarations``): addresses, protocols, ports, the slot index (``numgen``, host byte order), verdicts
  and plain data; comments as libnftnl writes them. Interval sets (the firewall's source ranges, the context sets),
  chains, rules and sets of their own go through libnftables: a transaction holding any of them is not encoded.
- **A refusal is libnftables' to explain**: the kernel refuses a batch as a whole (nothing is applied); the caller
  then applies the same transaction's text through libnftables, whose answer names the refused line and so the
  service (``kproxy.toolkit.nft.refused``). An encoding this module cannot make (a malformed address) is handed to
  libnftables the same way, before anything is sent.
- **Acknowledgements**: nfnetlink processes a batch in the sender's ``sendmsg``, so every answer is queued on the
  socket before ``send`` returns; only the last message asks for an acknowledgement (a refused message is always
  answered), and ``NETLINK_CAP_ACK`` keeps each answer to its header. Only answers numbered within the batch count,
  and whatever an earlier batch left unread is drained first. A batch with no answer for its last message, or whose
  answers were partly lost (ENOBUFS), leaves the kernel's state unknown: an error the caller treats as such (no
  fallback, a full sync follows).
- **Sizes**: an element list is one attribute, whose length is 16 bits, so a message carries at most ~64 KB of
  elements; a transaction is one datagram, so the socket's send buffer is raised (``SO_SNDBUFFORCE``, kproxy has
  ``CAP_NET_ADMIN``) to the batch's size.
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

from kproxy.model import IPFamily
from kproxy.nftkernel import Nft, Result
from kproxy.toolkit import netlink

from . import layout
from .fragment import Fragment
from .transaction import Transaction

# nfnetlink and nf_tables numbers (include/uapi/linux/netfilter/nfnetlink.h, nf_tables.h, netlink.h)
_BATCH_BEGIN, _BATCH_END = 0x10, 0x11  # NFNL_MSG_BATCH_*
_NEWSETELEM, _DELSETELEM = netlink.NFT_MSG_NEWSETELEM, netlink.NFT_MSG_DELSETELEM
_NLM_F_ACK, _NLM_F_CREATE = 0x4, 0x400
_LIST_TABLE, _LIST_SET = netlink.NFTA_SET_ELEM_LIST_TABLE, netlink.NFTA_SET_ELEM_LIST_SET
_LIST_ELEMENTS, _LIST_ELEM = netlink.NFTA_SET_ELEM_LIST_ELEMENTS, netlink.NFTA_LIST_ELEM
_ELEM_KEY, _ELEM_DATA, _ELEM_USERDATA = (
    netlink.NFTA_SET_ELEM_KEY,
    netlink.NFTA_SET_ELEM_DATA,
    netlink.NFTA_SET_ELEM_USERDATA,
)
_DATA_VALUE, _DATA_VERDICT = netlink.NFTA_DATA_VALUE, netlink.NFTA_DATA_VERDICT
_VERDICT_CODE, _VERDICT_CHAIN = netlink.NFTA_VERDICT_CODE, netlink.NFTA_VERDICT_CHAIN
_NESTED = netlink.NLA_F_NESTED
_UDATA_COMMENT = netlink.NFTNL_UDATA_SET_ELEM_COMMENT
_SOL_NETLINK, _NETLINK_CAP_ACK = 270, 10
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33  # asm-generic/socket.h; not in Python's socket module
_MESSAGE_MAX = 60_000  # bytes of elements per message: the element list's attribute length is a u16
_VERDICT_CODES = {word: code for code, word in netlink.VERDICTS.items()}
_PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132}

log = logging.getLogger(__name__)

_HDR = netlink.NLA_HDR.pack
_PAD = (b"\0", b"\0\0", b"\0\0\0", b"\0\0\0\0")  # an attribute's NUL and padding: 1 to 4 bytes
_FIREWALL_LINE = layout.FIREWALL + "|"  # a fragment's firewall element (``fragment.pack``)

Field = Callable[[str], bytes]


class _Memo(dict[str, bytes]):
    """The bytes of a field with few distinct values (protocols, ports, slot indexes), converted once each."""

    def __init__(self, convert: Field) -> None:
        super().__init__()
        self.convert = convert

    def __missing__(self, text: str) -> bytes:
        value = self.convert(text)
        if len(self) < 1 << 17:
            self[text] = value
        return value


def _addr4(text: str) -> bytes:
    return socket.inet_pton(socket.AF_INET, text)


def _addr6(text: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6, text)


def _proto(text: str) -> bytes:
    return bytes((_PROTOCOLS[text], 0, 0, 0))  # KeyError: not a protocol the layout writes


def _port(text: str) -> bytes:
    if not text.isdigit():
        raise ValueError(f"port {text!r}")
    return int(text).to_bytes(2, "big") + b"\0\0"  # OverflowError: not a port


def _index(text: str) -> bytes:
    if not text.isdigit():
        raise ValueError(f"slot {text!r}")
    return int(text).to_bytes(4, sys.byteorder)  # numgen's result: a 32-bit number in host byte order


_PROTO, _PORT, _INDEX = _Memo(_proto).__getitem__, _Memo(_port).__getitem__, _Memo(_index).__getitem__
_TYPES: dict[str, Field] = {"ipv4_addr": _addr4, "ipv6_addr": _addr6, "inet_proto": _PROTO, "inet_service": _PORT}
_EXPRS: dict[str, Field] = {
    "ip daddr": _addr4,
    "ip6 daddr": _addr6,
    "meta l4proto": _PROTO,
    "th dport": _PORT,
    **{f"{p} dport": _PORT for p in _PROTOCOLS},
    "numgen random mod 2": _INDEX,
}
_WIDTH: dict[Field, int] = {_addr4: 4, _addr6: 16}  # every other field takes one 32-bit register


class Shape:
    """One map's or set's elements: the key's fields and the value's (``value`` None: a set; () a verdict), with
    the attribute headers that do not depend on the element (every field has a fixed width)."""

    def __init__(self, key: tuple[Field, ...], value: tuple[Field, ...] | None) -> None:
        self.key, self.value = key, value
        self.klen = sum(_WIDTH.get(f, 4) for f in key)
        # NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }
        self.key_head = netlink.NLA_HDR.pack(8 + self.klen, _ELEM_KEY | _NESTED) + netlink.NLA_HDR.pack(
            4 + self.klen, _DATA_VALUE
        )
        self.value_head = b""
        self.pack_value = _packer(value or ())
        self._pack_key = _packer(key)
        self._pack_head = _packer(key[:-1]) if len(key) > 1 else self._pack_key
        self.plain_head = b""  # the element's header when it has no comment and no verdict (its length is fixed)
        vlen = 0
        if value:
            vlen = sum(_WIDTH.get(f, 4) for f in value)
            self.value_head = netlink.NLA_HDR.pack(8 + vlen, _ELEM_DATA | _NESTED) + netlink.NLA_HDR.pack(
                4 + vlen, _DATA_VALUE
            )
        if value is None or value:
            self.plain_head = netlink.NLA_HDR.pack(4 + 8 + self.klen + (8 + vlen if vlen else 0), _LIST_ELEM | _NESTED)
        self.key_only_head = netlink.NLA_HDR.pack(4 + 8 + self.klen, _LIST_ELEM | _NESTED)
        self._heads: dict[str, bytes] = {}  # a key's fields but the last, converted: a service's slots share them

    def pack_key(self, text: str) -> bytes:
        if self.key[-1] is not _INDEX:
            return self._pack_key(text)
        at = text.rfind(" . ")  # a slot: its entry's fields first, shared by the service's other slots
        if at < 0:
            raise ValueError(f"{text!r} has 1 field, the map {len(self.key)}")
        head = text[:at]
        done = self._heads.get(head)
        if done is None:
            done = self._pack_head(head)
            if len(self._heads) > 4096:
                self._heads.clear()
            self._heads[head] = done
        return done + _INDEX(text[at + 3 :])


def _packer(fields: tuple[Field, ...]) -> Field:
    """What converts a concatenation's text (``a . b . c``) of ``fields`` into its bytes: up to three fields (a
    value, an entry's key, the head of a slot's key) without a list. A missing field is "" and a third one stays in
    the last field's text: both fail in its conversion."""
    if len(fields) == 1:
        return fields[0]
    if len(fields) == 2:
        first, second = fields

        def pair(text: str) -> bytes:
            a, _, b = text.partition(" . ")
            return first(a) + second(b)

        return pair
    if len(fields) == 3:
        f0, f1, f2 = fields

        def triple(text: str) -> bytes:
            a, _, rest = text.partition(" . ")
            b, _, c = rest.partition(" . ")
            return f0(a) + f1(b) + f2(c)

        return triple
    return functools.partial(_pack, fields)


def _pack(fields: tuple[Field, ...], text: str) -> bytes:
    parts = text.split(" . ")
    if len(parts) != len(fields):
        raise ValueError(f"{text!r} has {len(parts)} fields, the map {len(fields)}")
    return b"".join([f(p) for f, p in zip(fields, parts, strict=True)])


def _fields(spec: str, names: dict[str, Field]) -> tuple[Field, ...]:
    return tuple(names[part.strip()] for part in spec.split(" . "))  # KeyError: a type this module does not write


def shape_of(spec: str) -> Shape | None:
    """The element shape a declaration (``layout.set_declarations``' spec) gives, or None when this module does not
    write its elements (intervals, interface names, anything else)."""
    decl = spec.split(";", 1)[0].strip()
    if "flags interval" in spec or not decl.startswith(("type ", "typeof ")):
        return None
    kind, _, body = decl.partition(" ")
    names = _TYPES if kind == "type" else _EXPRS
    key, _, value = (part.strip() for part in body.partition(":"))
    try:
        if not value:
            return Shape(_fields(key, names), None)
        return Shape(_fields(key, names), () if value == "verdict" else _fields(value, names))
    except KeyError:
        return None


@functools.lru_cache(maxsize=4)
def shapes(family: IPFamily) -> dict[str, Shape]:
    """Every map and set of the layout (with the counting sets) whose elements this module writes."""
    out: dict[str, Shape] = {}
    for _, name, spec in layout.set_declarations(family, counters=True):
        shape = shape_of(spec)
        if shape is not None:
            out[name] = shape
    return out


def _nest(kind: int, payload: bytes) -> bytes:
    return netlink.nla(kind | _NESTED, payload)


@functools.lru_cache(maxsize=1024)
def _verdict(text: str) -> bytes:
    """The data attribute of a verdict (``goto lb-i-3``, ``drop``)."""
    word, _, chain = text.partition(" ")
    body = netlink.nla(_VERDICT_CODE, struct.pack(">i", _VERDICT_CODES[word]))
    if word in ("goto", "jump"):
        if not chain:
            raise ValueError(f"verdict {text!r} names no chain")
        body += netlink.nla(_VERDICT_CHAIN, chain.encode() + b"\0")
    elif chain:
        raise ValueError(f"verdict {text!r}")
    return _nest(_ELEM_DATA, _nest(_DATA_VERDICT, body))


def element(shape: Shape, line: str, *, key_only: bool = False) -> bytes:
    """One ``NFTA_LIST_ELEM`` from a transaction's element line (``key[ comment "c"][ : value]``; ``key_only``: a
    delete's, the key alone); ValueError (or KeyError, OSError, OverflowError from a field) when the line does not
    fit the shape."""
    head, sep, value = line.partition(" : ")
    if key_only:
        return shape.key_only_head + shape.key_head + shape.pack_key(head)
    key, csep, comment = head.partition(' comment "')
    out = shape.key_head + shape.pack_key(key)
    if shape.value is None:
        if sep:
            raise ValueError(f"a set element with a value: {line!r}")
    elif not sep:
        raise ValueError(f"a map element without a value: {line!r}")
    elif shape.value:
        out += shape.value_head + shape.pack_value(value)
    else:
        out += _verdict(value)
    if csep:
        text = comment[:-1].encode() if comment.endswith('"') else b""
        n = len(text) + 1  # libnftnl's record: type, length, the comment and its NUL
        if n == 1 or n > 129 or b'"' in text:  # nft allows 128 characters
            raise ValueError(f"comment of {line!r}")
        out += _HDR(6 + n, _ELEM_USERDATA) + bytes((_UDATA_COMMENT, n)) + text + _PAD[-(2 + n) % 4]
    return netlink.NLA_HDR.pack(4 + len(out), _LIST_ELEM | _NESTED) + out


def _elements(shape: Shape, lines: Iterable[str], *, key_only: bool) -> Iterator[bytes]:
    """``element`` of each line, made as the messages take them (no list of a chunk's elements); a slot's (no
    comment, data of a fixed size: most of a full sync's elements) without a call per element."""
    if key_only or not shape.value:
        for line in lines:
            yield element(shape, line, key_only=key_only)
        return
    head = shape.plain_head + shape.key_head
    value_head, pack_key, pack_value = shape.value_head, shape.pack_key, shape.pack_value
    for line in lines:
        key, _, value = line.partition(" : ")
        if '"' in key:
            yield element(shape, line)
        else:  # no value: its first field fails
            yield head + pack_key(key) + value_head + pack_value(value)


def _messages(flags: int, head: bytes, elements: Iterable[bytes]) -> Iterable[tuple[int, bytes]]:
    """(flags, attributes) of the messages carrying ``elements``, each list under ``_MESSAGE_MAX`` bytes."""
    batch: list[bytes] = []
    size = 0
    for el in elements:
        if size + len(el) > _MESSAGE_MAX and batch:
            yield flags, head + _nest(_LIST_ELEMENTS, b"".join(batch))
            batch, size = [], 0
        batch.append(el)
        size += len(el)
    if batch:
        yield flags, head + _nest(_LIST_ELEMENTS, b"".join(batch))


def writes(tx: Transaction) -> bool:
    """Whether ``tx`` holds element changes only, of maps whose elements this module writes (its lines may still
    not fit: ``encode`` says)."""
    if tx.head or tx.declare or tx.fill or tx.tail:
        return False
    known = shapes(tx.family)
    return all(m in known for m in tx.adds) and all(m in known for m in tx.deletes)


def plain(fragment: Fragment | None) -> bool:
    """Whether a fragment's transactions can be written here: no chains or sets of its own, no firewall element."""
    return fragment is None or not (fragment.chains or fragment.sets or _FIREWALL_LINE in fragment.text)


def encode(tx: Transaction) -> list[tuple[int, int, bytes]] | None:
    """(message type, flags, attributes) of ``tx``'s messages, deletes first as in its text; None when it holds
    anything but element changes of maps this module writes, or a line that does not fit its map (libnftables
    decides those)."""
    if not writes(tx):
        return None
    known = shapes(tx.family)
    table = netlink.nla(_LIST_TABLE, layout.TABLE.encode() + b"\0")
    out: list[tuple[int, int, bytes]] = []
    try:
        for msg, flags, groups in ((_DELSETELEM, 0, tx.deletes), (_NEWSETELEM, _NLM_F_CREATE, tx.adds)):
            for name, group in groups.items():
                shape = known[name]
                if not group.texts:
                    continue
                head = table + netlink.nla(_LIST_SET, name.encode() + b"\0")
                els = _elements(shape, group.texts, key_only=msg == _DELSETELEM)
                out.extend((msg, f, body) for f, body in _messages(flags, head, els))
    except (ValueError, KeyError, OSError, OverflowError):
        return None
    return out


def batch(family: IPFamily, messages: list[tuple[int, int, bytes]], seq: int) -> bytes:
    """The datagram of one transaction: ``messages`` between a batch's begin and end, numbered from ``seq``; the
    last message asks for an acknowledgement."""
    nfproto = socket.AF_INET if family is IPFamily.V4 else socket.AF_INET6  # NFPROTO_IPV4/6 have the same numbers
    res_id = socket.htons(netlink.NFNL_SUBSYS_NFTABLES)
    parts = [_control(_BATCH_BEGIN, seq, res_id)]
    last = len(messages) - 1
    for i, (msg, flags, body) in enumerate(messages):
        ack = _NLM_F_ACK if i == last else 0
        parts.append(netlink.nfmsg(msg, netlink.NLM_F_REQUEST | flags | ack, seq + 1 + i, nfproto, body))
    parts.append(_control(_BATCH_END, seq + 1 + len(messages), res_id))
    return b"".join(parts)


def _control(kind: int, seq: int, res_id: int) -> bytes:
    length = netlink.NFNL_HDRLEN
    return netlink.NLMSG_HDR.pack(length, kind, netlink.NLM_F_REQUEST, seq, 0) + netlink.NFGEN_HDR.pack(0, 0, res_id)


class Writer:
    """Sends encoded transactions on one ``NETLINK_NETFILTER`` socket, opened where ``nft``'s context lives (its
    namespace) on first use, and used there (``Nft.later``): a batch is applied in the context's worker, in order
    with libnftables' calls, while the caller builds the next."""

    def __init__(self, nft: Nft) -> None:
        self.nft = nft
        self._sock: socket.socket | None = None
        self._seq = int(time.time()) & 0x3FFFFFFF
        self._sndbuf = 0

    def submit(self, family: IPFamily, messages: list[tuple[int, int, bytes]]) -> Future[Result | None]:
        """Send one transaction in the context's worker; its Future gives a ``Result``, or None when it was not
        applied and libnftables should try it (the kernel refused it, or it could not be sent: the caller applies
        its text through libnftables, which names a refused line)."""
        seq = self._seq
        last = seq + len(messages) + 1  # its BATCH_END
        self._seq = (last + 1) & 0x3FFFFFFF
        data = batch(family, messages, seq)
        return self.nft.later(lambda: self._send(data, seq, last - 1))

    def _socket(self, size: int) -> socket.socket:
        if self._sock is None:
            self._sock = netlink.netfilter_socket()
            self._sock.setsockopt(_SOL_NETLINK, _NETLINK_CAP_ACK, 1)
            _buffer(self._sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, 1 << 20)
        if size + 65536 > self._sndbuf:
            self._sndbuf = max(size + 65536, 1 << 20)
            _buffer(self._sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, self._sndbuf)
        return self._sock

    def _send(self, data: bytes, first: int, last: int) -> Result | None:
        """Send one batch whose messages are numbered ``first`` to ``last`` (the last element message)."""
        t0 = time.perf_counter()
        try:
            sock = self._socket(len(data))
            _answers(sock, range(0))  # anything an earlier batch left unread is not this one's
            sock.send(data)
        except OSError as exc:  # not sent (a datagram over the send buffer): libnftables tries
            log.warning("netlink batch of %d bytes not sent (%s): libnftables takes it", len(data), exc)
            return None
        errors, acked, lost = _answers(sock, range(first, last + 2), last)
        seconds = time.perf_counter() - t0
        if lost:  # a lost answer may have been a refusal: an acknowledgement does not say it committed
            return Result(1, "", "netlink batch: answers lost (ENOBUFS); the table's state is unknown", seconds)
        if errors:
            return None
        if not acked:
            return Result(1, "", "netlink batch: no acknowledgement; the table's state is unknown", seconds)
        return Result(0, "", "", seconds)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _buffer(sock: socket.socket, forced: int, plain: int, size: int) -> None:
    """Set a socket buffer over the system's maximum (``*BUFFORCE``: CAP_NET_ADMIN in the initial user namespace),
    else as far as the maximum allows (a bigger batch is then not sent, and libnftables takes it)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, forced, size)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, plain, size)


def _answers(sock: socket.socket, seqs: range, last: int = -1) -> tuple[list[int], bool, bool]:
    """What the kernel answered a batch numbered ``seqs``, all queued by the time ``send`` returned: the errors,
    whether message ``last`` was acknowledged, and whether answers were lost (ENOBUFS, reported before what is still
    queued). Answers outside ``seqs`` are read and dropped."""
    errors: list[int] = []
    acked = lost = False
    while True:
        try:
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return errors, acked, lost
        except OSError:  # ENOBUFS: some answers were dropped; read on
            lost = True
            continue
        for h in netlink.headers(data):
            if h.type != netlink.NLMSG_ERROR or h.length < netlink.NLMSG_HDR.size + 4 or h.seq not in seqs:
                continue
            (err,) = struct.unpack_from("=i", data, h.at + netlink.NLMSG_HDR.size)
            if err:
                errors.append(err)
            elif h.seq == last:
                acked = True
