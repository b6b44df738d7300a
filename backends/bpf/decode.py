"""Adoption's decoding of the bpf mode's maps, fast: the raw service, backend and names maps (what
``maps.lookup_raw`` / ``maps.read_lb`` return) to the ``index.FamilyIndex`` and ``index.View`` adoption compares,
for a restart at scale (10,000 services x 10 endpoints: 120,000 entries read).

The fast path (``fast_index``) reads the raw bytes as columns (``array`` over the buffers, extended slices of
``bytes``) and does its per-entry work in C-level ``map``/``zip``/``dict`` calls, no Python step per entry: each
entry's frontend becomes one 64-bit integer, masters are numbered by a dict of those, and each slot entry's backend
id is written straight to its place (master, slot) in a flat array. It applies when the maps are consistent: every
key's padding and high slot byte zero, every master once, every slot entry one of its master's ``1..count`` and each
of those present; anything else (orphan slots, slots beyond a count, a missing master or slot, odd lengths) takes the
general path (``general_index``), entry by entry. Both give the same result, order of every dict included;
tests/unit/test_bpf_decode.py checks that on random plans and corruptions.

The backend map may be an array: values of all zero bytes are no backend and are skipped (both paths). Read from
index 0 (as ``maps.read_lb`` reads it), its values are the index's backend table as they come (``index.Backends``),
and the view names a slot's backend by the head of its value (address . port bytes), so no backend's address is
decoded to text: at 100,000 x 10 a dict of a million backends' tuples and their texts was most of the decode.

The fast path takes about half of the general path's time for IPv4 (less of a gain for IPv6, whose addresses are
numbered through 16-byte pieces). The rest is memory-bound: one write per slot at a random place, one join per
frontend for the view.
"""

from __future__ import annotations

import array
import dataclasses
import random
import struct
import sys
from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import add
from typing import Any, Literal, TypeVar

from kproxy.model import IPFamily

from . import maps
from .index import Backends, FamilyIndex, FrontState, View, endpoint_size
from .index import ids as slot_ids
from .maps import Master

_T = TypeVar("_T")
_LITTLE = sys.byteorder == "little"
#: a slot naming a backend id the backend map lacks, as the view shows it (``index.endpoint_pairs``: ``("?", 0)``)
_UNKNOWN = {f: bytes(endpoint_size(f)) for f in IPFamily}
_KEY_SIZE = {IPFamily.V4: maps.LB4_KEY.size, IPFamily.V6: maps.LB6_KEY.size}  # 12, 24
_ADDR_SIZE = {IPFamily.V4: 4, IPFamily.V6: 16}
_BE_SIZE = {IPFamily.V4: maps.LB4_BACKEND.size, IPFamily.V6: maps.LB6_BACKEND.size}  # 8, 20
_BE_WHOLE = {f: struct.Struct(f"{size}s") for f, size in _BE_SIZE.items()}
# the general path's formats: backend values as address, port (network order, as an int), protocol (flags skipped);
# service-map keys as (address . port bytes, slot, protocol)
_BE4_DECODE = struct.Struct(">4sHBx")
_BE6_DECODE = struct.Struct(">16sHBx")
_RAW_KEY4 = struct.Struct("<6sHB3x")
_RAW_KEY6 = struct.Struct("<18sHB3x")
_SVC_SIZE = maps.LB_SERVICE.size  # 16: backend_id, affinity, count (16 bits), flags, padding, rev_nat_id
_NAME_SIZE = maps.NAME_VAL.size
_IS_ZERO = bytes([1] + [0] * 255)  # a bytes.translate table: 1 where a byte is zero, else 0
_UNFILLED_ID = 0xFFFFFFFF
_UNFILLED = _UNFILLED_ID.to_bytes(4, sys.byteorder)


def index_from_raw(
    family: IPFamily,
    svc_raw: tuple[bytes, bytes],
    be_raw: tuple[bytes, bytes],
    name_raw: tuple[bytes, bytes] = (b"", b""),
) -> tuple[FamilyIndex, View]:
    """Rebuild an index from the maps' raw contents (all keys, all values, each concatenated: what ``maps.read_lb``
    returns) with owners unknown until claimed, and the decoded view adoption compares: frontend -> (flags, affinity,
    backends, rev_nat_id). All-zero backend values (array entries of no backend) are left out. Column-wise for
    consistent maps (``fast_index``), entry by entry otherwise (``general_index``)."""
    got = fast_index(family, svc_raw, be_raw, name_raw)
    if got is not None:
        return got
    return general_index(family, svc_raw, be_raw, name_raw)


# ------------------------------------------------------------------------------------------------ columns


def _u32(raw: bytes) -> array.array[int]:
    """``raw`` as little-endian 32-bit integers (``maps``' formats are little-endian)."""
    a = array.array("I", raw)
    if not _LITTLE:
        a.byteswap()
    return a


def _words(raw: bytes, code: Literal["I", "H"]) -> Sequence[int]:
    """``raw`` as little-endian integers of the array ``code``: a view of its bytes where the machine is little-endian
    (the service map's values are 17.6 MB at 100,000 x 10: two copies of them were most of what decoding held)."""
    if _LITTLE:
        return memoryview(raw).cast(code)
    a = array.array(code, raw)
    a.byteswap()
    return a


def _u16(lo: bytes, hi: bytes) -> array.array[int]:
    """16-bit integers from a column of low bytes and one of high bytes."""
    b = bytearray(2 * len(lo))
    b[0::2], b[1::2] = (lo, hi) if _LITTLE else (hi, lo)
    return array.array("H", b)


_IOTA = b""  # the keys 0..len/4-1 of an array map as read, replaced whole when a longer one is needed


def _iota(n: int) -> bytes:
    """The keys 0..n-1 of an array map as read (little-endian 32-bit)."""
    global _IOTA
    got = _IOTA
    if len(got) < 4 * n:
        a = array.array("I", range(max(n, len(got) // 2)))
        if not _LITTLE:
            a.byteswap()
        got = _IOTA = a.tobytes()  # built first, then swapped in: a thread reading the old one is unaffected
    return got[: 4 * n]


def _chunks(raw: bytes, size: int, stride: int) -> list[bytes]:
    """The ``size`` first bytes of every ``stride`` bytes of ``raw`` (C-level loops: no Python step per piece)."""
    n = len(raw)
    return list(map(raw.__getitem__, map(slice, range(0, n, stride), range(size, n + size, stride))))


#: tabulation hashing: a fixed random table per (mixed byte, byte above it)
_TABLES = [[bytes(random.Random(8 * i + j).sample(range(256), 256)) for j in range(8)] for i in range(3)]


def _packed(cols: list[bytes]) -> array.array[int]:
    """Eight byte columns (lowest byte first) as one 64-bit integer per row, each of the three lowest bytes XORed
    with a tabulation hash of the bytes above it: still one integer per distinct row (each byte is recovered from the
    ones above it), but the low bits, which pick a dict slot, vary between rows that differ anywhere (rows sharing
    their low address bytes, or an address with many ports as NodePorts have, would otherwise probe long chains)."""
    n = len(cols[0])
    rec = bytearray(8 * n)
    for i, col in enumerate(cols):
        if i < len(_TABLES):
            acc = int.from_bytes(col, "little")
            tables = _TABLES[i]
            for j in range(i + 1, 8):
                acc ^= int.from_bytes(cols[j].translate(tables[j]), "little")
            col = acc.to_bytes(n, "little")
        rec[(i if _LITTLE else 7 - i) :: 8] = col
    return array.array("Q", rec)


def _firsts(raw: bytes, size: int, stride: int) -> bytes:
    """The ``size`` first bytes of every ``stride`` bytes of ``raw``, concatenated."""
    out = bytearray(size * (len(raw) // stride))
    for i in range(size):
        out[i::size] = raw[i::stride]
    return bytes(out)


def _texts4(addrs: bytes) -> list[str]:
    """IPv4 addresses (4 bytes each, concatenated) as text, as ``inet_ntop`` spells them: one ``%`` format for all."""
    n = len(addrs) // 4
    return (("%d.%d.%d.%d\n" * n) % tuple(addrs)).split("\n")[:n] if n else []


def _texts(family: IPFamily, addrs: bytes) -> list[str]:
    """Addresses (concatenated) as text."""
    if family == IPFamily.V4:
        return _texts4(addrs)
    pieces = _chunks(addrs, 16, 16)
    ntop = maps.addr_text
    known = {a: ntop(a) for a in set(pieces)}
    return list(map(known.__getitem__, pieces))


def _names(name_raw: tuple[bytes, bytes]) -> dict[int, str] | None:
    """The names map: rev_nat_id -> service key (text up to the first NUL); None for lengths that do not fit."""
    keys, values = name_raw
    n = len(keys) // 4
    if len(keys) != 4 * n or len(values) != _NAME_SIZE * n:
        return None
    texts = [c.partition(b"\0")[0] for c in _chunks(values, _NAME_SIZE, _NAME_SIZE)]
    try:  # one decode for all (NUL separates: no text holds one); per text only if some is not UTF-8
        decoded = b"\0".join(texts).decode().split("\0") if texts else []
    except UnicodeDecodeError:
        decoded = [t.decode(errors="replace") for t in texts]
    return dict(zip(_u32(keys), decoded, strict=True))


# ------------------------------------------------------------------------------------------------ objects


def _build(cls: type[_T], n: int, columns: dict[str, Any]) -> list[_T]:
    """Instances of a slotted dataclass (see ``_can_build``), one per row of ``columns`` (field name -> values,
    every field): allocated, then each slot filled for all by one C-level pass (the dataclass ``__init__``, a Python
    function, costs ~1 us per object; a frozen one's does what this does, ``object.__setattr__`` per field)."""
    objs: list[_T] = list(map(object.__new__, repeat(cls, n)))
    for name, values in columns.items():
        deque(map(getattr(cls, name).__set__, objs, values), maxlen=0)
    return objs


def _can_build(cls: type) -> bool:
    """Whether ``_build`` makes what ``cls(...)`` makes: a slotted dataclass whose ``__init__`` only sets fields."""
    fields = dataclasses.fields(cls)
    return getattr(cls, "__slots__", None) == tuple(f.name for f in fields) and not hasattr(cls, "__post_init__")


_MASTER_FIELDS = [f.name for f in dataclasses.fields(Master)]
_FRONT_FIELDS = [f.name for f in dataclasses.fields(FrontState)]
#: the fields this module fills; another field (or an __init__ doing more) and the constructors are called instead
_BUILD = (
    _can_build(Master)
    and _can_build(FrontState)
    and sorted(_MASTER_FIELDS) == sorted(("count", "flags", "affinity", "rev_nat_id"))
    and sorted(_FRONT_FIELDS) == sorted(("owner", "master", "slots"))
)


def _masters(counts: list[int], flags: list[int], affs: list[int], revs: list[int]) -> list[Master]:
    if not _BUILD:
        return list(map(Master, counts, flags, affs, revs))
    cols = {"count": counts, "flags": flags, "affinity": affs, "rev_nat_id": revs}
    return _build(Master, len(counts), {f: cols[f] for f in _MASTER_FIELDS})


def _states(masters: list[Master], slots: list[array.array[int]]) -> list[FrontState]:
    if not _BUILD:
        return list(map(FrontState, repeat(None), masters, slots))
    cols: dict[str, Any] = {"owner": repeat(None, len(masters)), "master": masters, "slots": slots}
    return _build(FrontState, len(masters), {f: cols[f] for f in _FRONT_FIELDS})


# ------------------------------------------------------------------------------------------------ fast path

#: backend id -> its address . port bytes as the view shows a slot's backend: a list indexed by id when ids are dense
EndpointsById = list[bytes] | dict[int, bytes]


def _backends(family: IPFamily, be_raw: tuple[bytes, bytes]) -> tuple[Backends, EndpointsById] | None:
    """The backend table (all-zero values no backend) and each id's address . port bytes (all zero: none); None for
    lengths that do not fit, or an id twice. Nothing per backend but one slice of its value."""
    keys, values = be_raw
    vs = _BE_SIZE[family]
    n = len(keys) // 4
    if len(keys) != 4 * n or len(values) != vs * n:
        return None
    # an array map read as far as some index: its unused tail is zero bytes
    used = -(-len(values.rstrip(b"\0")) // vs)
    if used < n:
        n = used
        keys, values = keys[: 4 * n], values[: vs * n]
    ids: Sequence[int] = _u32(keys)
    dense = keys == _iota(n)  # an array map read from index 0: ids in order, the values are the table as they come
    if not dense and len(set(ids)) != n:
        return None  # an id twice (no map reads so): the general path keeps render's order of events
    eps = _chunks(values, endpoint_size(family), vs)
    if dense:
        return Backends.from_array(family, values), eps
    backends = Backends(family)
    for bid, v in zip(ids, _chunks(values, vs, vs), strict=True):
        if any(v):
            backends.put_raw(bid, v)
    top = max(ids, default=-1)
    by_id: EndpointsById
    if top < 2 * n + 1024:
        by_id = [_UNKNOWN[family]] * (top + 1)
        deque(map(by_id.__setitem__, ids, eps), maxlen=0)
    else:
        by_id = dict(zip(ids, eps, strict=True))
    return backends, by_id


def fast_index(
    family: IPFamily,
    svc_raw: tuple[bytes, bytes],
    be_raw: tuple[bytes, bytes],
    name_raw: tuple[bytes, bytes] = (b"", b""),
) -> tuple[FamilyIndex, View] | None:
    """``index_from_raw`` for consistent maps (see the module docstring); None when they are not."""
    keys, values = svc_raw
    ks = _KEY_SIZE[family]
    al = _ADDR_SIZE[family]
    n = len(keys) // ks
    if len(keys) != ks * n or len(values) != _SVC_SIZE * n:
        return None
    zero_n = bytes(n)
    # padding and high slot byte zero: (address, port, protocol, low slot byte) stands for the whole key
    if any(keys[i::ks] != zero_n for i in (al + 3, al + 5, al + 6, al + 7)):
        return None
    rev_names = _names(name_raw)
    got_be = _backends(family, be_raw)
    if rev_names is None or got_be is None:
        return None
    backends, ep_by_id = got_be
    slot_lo = keys[al + 2 :: ks]
    masters = list(compress(range(n), slot_lo.translate(_IS_ZERO)))
    n_masters = len(masters)
    vi, vh = _words(values, "I"), _words(values, "H")
    counts = list(map(vh[4::8].__getitem__, masters))
    if sum(counts) != n - n_masters:
        return None
    port_hi, port_lo, protos = keys[al::ks], keys[al + 1 :: ks], keys[al + 4 :: ks]
    front = _packed([zero_n, *_addr_columns(family, keys, n), port_lo, port_hi, protos])
    slot_ids = _slot_ids(front, slot_lo, masters, counts, vi[0::4])
    if slot_ids is None:
        return None
    maddr = _firsts(
        b"".join(map(keys.__getitem__, map(slice, [i * ks for i in masters], [i * ks + al for i in masters]))), al, al
    )
    texts = _texts(family, maddr)
    ports = _u16(port_lo, port_hi)
    fkeys = list(zip(texts, map(ports.__getitem__, masters), map(protos.__getitem__, masters), strict=True))
    flags = list(map(values[10::16].__getitem__, masters))
    affs = list(map(vi[1::4].__getitem__, masters))
    revs = list(map(vi[3::4].__getitem__, masters))
    index = FamilyIndex(family)
    index.rev_names = rev_names
    index.backends = backends
    index.fronts = dict(zip(fkeys, _states(_masters(counts, flags, affs, revs), slot_ids), strict=True))
    try:
        view = _view(fkeys, flags, affs, revs, slot_ids, ep_by_id.__getitem__)
    except (IndexError, KeyError):  # a slot naming a backend the map lacks
        get = ep_by_id.get if isinstance(ep_by_id, dict) else dict(enumerate(ep_by_id)).get
        unknown = _UNKNOWN[family]
        view = _view(fkeys, flags, affs, revs, slot_ids, lambda i: get(i, unknown))
    _fill_by_rev(index.by_rev, revs, fkeys)
    index.entries = n
    index.next_rev = max(max(revs, default=0), max(rev_names, default=0)) + 1
    index.next_backend = backends.top() + 1
    return index, view


def _addr_columns(family: IPFamily, keys: bytes, n: int) -> list[bytes]:
    """The service-map keys' addresses as four byte columns (lowest byte first): an IPv4 address's own bytes, an
    IPv6 address's number among the distinct ones."""
    ks = _KEY_SIZE[family]
    if family == IPFamily.V4:
        return [keys[i::ks] for i in (3, 2, 1, 0)]
    addrs = _chunks(keys, _ADDR_SIZE[family], ks)
    number = dict(zip(dict.fromkeys(addrs), range(n), strict=False))
    nb = array.array("I", map(number.__getitem__, addrs)).tobytes()
    return [nb[i::4] for i in range(4)]


def _slot_ids(
    front: array.array[int], slot_lo: bytes, masters: list[int], counts: list[int], ids: Sequence[int]
) -> list[array.array[int]] | None:
    """Each master's backend ids of its slots 1..count, or None when the slot entries are not exactly those.
    ``front``: every entry's frontend as one integer (the slot left out); ``ids``: every entry's backend id."""
    n_masters = len(masters)
    # each master gets a row of ``width`` places in a flat array (place 0 unused, then slots 1..width-1), each slot
    # entry finds its master's row by its frontend's integer
    width = max(slot_lo, default=0) + 1
    if counts and max(counts) >= width:
        return None  # a count no slot entry reaches: some slot is missing (and the row would be too short)
    row_of = dict(zip(map(front.__getitem__, masters), range(0, width * n_masters, width), strict=True))
    if len(row_of) != n_masters:
        return None  # a master twice
    try:  # an array, not a list: one slot entry per backend of every frontend (a million at 100,000 x 10)
        rows = array.array("Q", map(row_of.__getitem__, compress(front, slot_lo)))
    except KeyError:
        return None  # a slot without its master
    # each slot entry's backend id written at its row + slot (an array: a write touches no object), then a master's
    # slots 1..count are one slice. Slot entries number sum(counts): every place 1..count of every master written
    # means each holds exactly those, each once (a slot beyond a count, or a key twice, leaves one unwritten).
    placed = array.array("I", _UNFILLED * (width * n_masters))
    slots = slot_lo.replace(b"\0", b"")  # the slot entries' slots, in order
    deque(map(placed.__setitem__, map(add, rows, slots), compress(ids, slot_lo)), maxlen=0)
    starts = range(1, width * n_masters + 1, width)
    held_ids = list(map(placed.__getitem__, map(slice, starts, map(add, starts, counts))))
    if array.array("I", b"".join(held_ids)).count(_UNFILLED_ID):
        return None  # a place unwritten (or a backend id that spells it: the general path decides)
    return held_ids  # each an array of its own (a slice)


def _fill_by_rev(
    by_rev: dict[int, list[tuple[str, int, int]]], revs: list[int], fkeys: list[tuple[str, int, int]]
) -> None:
    """Frontends per reverse-NAT id."""
    if len(set(revs)) == len(revs):
        by_rev.update(zip(revs, map(_one, fkeys), strict=True))
        return
    for r, fk in zip(revs, fkeys, strict=True):
        got = by_rev.get(r)
        if got is None:
            by_rev[r] = [fk]
        else:
            got.append(fk)


def _view(
    fkeys: list[tuple[str, int, int]],
    flags: list[int],
    affs: list[int],
    revs: list[int],
    slot_ids: list[array.array[int]],
    pair: Any,
) -> View:
    """frontend -> (flags, affinity, its backends' address . port bytes in slot order, rev_nat_id)."""
    held = map(b"".join, map(map, repeat(pair), slot_ids))
    return dict(zip(fkeys, zip(flags, affs, held, revs, strict=True), strict=True))


def _one(key: tuple[str, int, int]) -> list[tuple[str, int, int]]:
    return [key]


def general_index(
    family: IPFamily,
    svc_raw: tuple[bytes, bytes],
    be_raw: tuple[bytes, bytes],
    name_raw: tuple[bytes, bytes] = (b"", b""),
) -> tuple[FamilyIndex, View]:
    """``index_from_raw`` for any contents: ``render``'s algorithm, entry by entry (orphan slots, slots beyond a
    count, missing masters; odd lengths raise as it does), all-zero backend values skipped."""
    v4 = family == IPFamily.V4
    index = FamilyIndex(family)
    texts: dict[bytes, str] = {}
    addr_text = maps.addr_text

    def text(a: bytes) -> str:
        t = texts.get(a)
        if t is None:
            t = texts[a] = addr_text(a)
        return t

    for (rev,), (nm,) in zip(
        maps.NAME_KEY.iter_unpack(name_raw[0]), maps.NAME_VAL.iter_unpack(name_raw[1]), strict=True
    ):
        index.rev_names[rev] = nm.split(b"\0", 1)[0].decode(errors="replace")
    backends = index.backends
    be_ap: dict[int, bytes] = {}
    ep_size = endpoint_size(family)
    unknown = _UNKNOWN[family]
    be_ids = _u32(be_raw[0])
    be_dec = _BE4_DECODE if v4 else _BE6_DECODE
    zero = bytes(be_dec.size)
    for bid, (value,) in zip(be_ids, _BE_WHOLE[family].iter_unpack(be_raw[1]), strict=True):
        if value == zero:
            continue  # an array map's entry of no backend
        backends.put_raw(bid, value)
        be_ap[bid] = value[:ep_size]
    key_fmt = _RAW_KEY4 if v4 else _RAW_KEY6
    raw_masters: dict[tuple[bytes, int], Master] = {}
    raw_slots: dict[tuple[bytes, int], dict[int, int]] = {}
    for (ap, slot, proto), (bid, aff, n_slots, flags, rev) in zip(
        key_fmt.iter_unpack(svc_raw[0]), maps.LB_SERVICE.iter_unpack(svc_raw[1]), strict=True
    ):
        if slot == 0:
            raw_masters[(ap, proto)] = Master(n_slots, flags, aff, rev)
        else:
            raw_slots.setdefault((ap, proto), {})[slot] = bid

    def fkey(rk: tuple[bytes, int]) -> tuple[str, int, int]:
        ap, proto = rk
        return (text(ap[:-2]), int.from_bytes(ap[-2:], "big"), proto)

    masters = {fkey(rk): m for rk, m in raw_masters.items()}
    slots = {fkey(rk): sl for rk, sl in raw_slots.items()}
    view: View = {}
    empty: dict[int, int] = {}
    fronts = index.fronts
    for fk, m in masters.items():
        sl = slots.get(fk, empty)
        count = m.count
        ids = tuple([sl.get(i, 0) for i in range(1, count + 1)])
        view[fk] = (m.flags, m.affinity, b"".join([be_ap.get(i, unknown) for i in ids]), m.rev_nat_id)
        index.by_rev.setdefault(m.rev_nat_id, []).append(fk)
        if len(sl) > count:  # slots beyond the count (a half-finished shrink): kept so a rewrite deletes them
            ids += tuple(sl[s] for s in range(count + 1, max(sl) + 1) if s in sl)
        fronts[fk] = FrontState(None, m, slot_ids(ids))
    for fk, sl in slots.items():
        if fk not in masters:  # orphan slots without a master: owned by nobody, removed on the next full sync
            fronts[fk] = FrontState(None, Master(0, 0, 0, 0), slot_ids(sl[s] for s in sorted(sl)))
    index.entries = sum(1 + len(st.slots) for st in fronts.values())
    revs = {st.master.rev_nat_id for st in fronts.values()} | set(index.rev_names)
    index.next_rev = max(revs, default=0) + 1
    index.next_backend = backends.top() + 1
    return index, view
