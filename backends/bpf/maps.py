"""The BPF maps of the bpf mode from Python: byte layouts mirroring ``bpf/kproxy_lb.h``, pin names, and the few
``bpf(2)`` commands kproxy needs (open a pin, batched update/delete/lookup), called directly through libc
(``objects``: the commands about programs and objects' info).

Why not bcc's table objects: a sync writes up to 110,000 entries, and building a ctypes object per entry costs more
than the kernel's work; here the keys and values of a batch are ``struct.pack``ed into one buffer each and handed to
``BPF_MAP_UPDATE_BATCH`` in one syscall. And tools that only read the maps (``kernel_view``, ``remnants``,
adoption after a restart) open the pins without compiling anything (bcc needs ~2 s of clang for that).

The ctypes ``Structure`` mirrors (``Lb4Key`` ...) exist for the unit tests, which check that every ``struct`` format
here has the size and field offsets of the C header; encoding uses ``struct`` for speed.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kproxy.model import IPFamily

#: bumped whenever a layout in bpf/kproxy_lb.h changes: every pinned map gets a new name, so a new layout never
#: silently reuses an old map (bcc does not check the type of a pinned map it reopens). v2: the backend map is an
#: array (v1: a hash); v3: 32-bit reverse-NAT ids (v2: 16 bits) and a names map of ``--bpf-map-size`` entries
MAPS_VERSION = "v3"

F_REJECT = 0x01
F_DROP = 0x02
F_AFFINITY = 0x04
F_EXTERNAL = 0x08

PROTO_NUMBERS = {"TCP": 6, "UDP": 17, "SCTP": 132}
PROTO_NAMES = {v: k for k, v in PROTO_NUMBERS.items()}

# struct formats (little-endian host fields, network-order address and port bytes), see bpf/kproxy_lb.h
LB4_KEY = struct.Struct("<4s2sHB3x")  # address, dport, slot, proto
LB6_KEY = struct.Struct("<16s2sHB3x")
LB_SERVICE = struct.Struct("<IIHBxI")  # backend_id, affinity_timeout, count, flags, rev_nat_id
LB4_BACKEND = struct.Struct("<4s2sBB")  # address, port, proto, flags
LB6_BACKEND = struct.Struct("<16s2sBB")
BACKEND_ID = struct.Struct("<I")
REV4_KEY = struct.Struct("<Q4s2sH")
REV4_VAL = struct.Struct("<4s2s2xI")
REV6_KEY = struct.Struct("<Q16s2sH")
REV6_VAL = struct.Struct("<16s2s2xI")
AFF_KEY = struct.Struct("<QII")
AFF_VAL = struct.Struct("<QII")
NAME_KEY = struct.Struct("<I")
NAME_VAL = struct.Struct("128s")


class Lb4Key(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("address", ctypes.c_uint8 * 4),
        ("dport", ctypes.c_uint8 * 2),
        ("slot", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class Lb6Key(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("address", ctypes.c_uint32 * 4),
        ("dport", ctypes.c_uint8 * 2),
        ("slot", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class LbService(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("backend_id", ctypes.c_uint32),
        ("affinity_timeout", ctypes.c_uint32),
        ("count", ctypes.c_uint16),
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("rev_nat_id", ctypes.c_uint32),
    ]


class Lb4Backend(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("address", ctypes.c_uint8 * 4),
        ("port", ctypes.c_uint8 * 2),
        ("proto", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
    ]


class Lb6Backend(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("address", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint8 * 2),
        ("proto", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
    ]


class Rev4Key(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("cookie", ctypes.c_uint64),
        ("address", ctypes.c_uint8 * 4),
        ("port", ctypes.c_uint8 * 2),
        ("pad", ctypes.c_uint16),
    ]


class AffKey(ctypes.Structure):
    _pack_ = 1
    _fields_ = [
        ("client_cookie", ctypes.c_uint64),
        ("rev_nat_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class AffVal(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("last_used", ctypes.c_uint64), ("backend_id", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


#: each struct format with its ctypes mirror (the unit tests compare sizes and offsets)
MIRRORS: tuple[tuple[struct.Struct, type[ctypes.Structure]], ...] = (
    (LB4_KEY, Lb4Key),
    (LB6_KEY, Lb6Key),
    (LB_SERVICE, LbService),
    (LB4_BACKEND, Lb4Backend),
    (LB6_BACKEND, Lb6Backend),
    (REV4_KEY, Rev4Key),
    (AFF_KEY, AffKey),
    (AFF_VAL, AffVal),
)

# ------------------------------------------------------------------------------------------------- pin names

#: the maps of one family: role -> C name stem (the pin is ``<stem><4|6>_<MAPS_VERSION>``)
ROLES = ("svc", "be", "rev", "aff", "name")


#: the counters of ``--service-counters`` (an array: backend id -> new connections and flows, ``counters``): pinned
#: like the others, but only while counters are on, so not a role every kproxy opens
COUNTER_ROLE = "cnt"
COUNTER_KEY = BACKEND_ID
COUNTER_VALUE = struct.Struct("<Q")


def pin_name(role: str, family: IPFamily) -> str:
    return f"{role}{4 if family == IPFamily.V4 else 6}_{MAPS_VERSION}"


def all_pin_names() -> tuple[str, ...]:
    return tuple(pin_name(r, f) for f in (IPFamily.V4, IPFamily.V6) for r in ROLES)


# ------------------------------------------------------------------------------------------------ encoding


def addr_bytes(ip: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)


def addr_text(raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6 if len(raw) == 16 else socket.AF_INET, raw)


def port_bytes(port: int) -> bytes:
    return port.to_bytes(2, "big")


@dataclass(frozen=True, slots=True)
class Master:
    """A frontend's slot-0 entry."""

    count: int
    flags: int
    affinity: int
    rev_nat_id: int


def lb_key(family: IPFamily, address: str, port: int, proto: int, slot: int) -> bytes:
    fmt = LB4_KEY if family == IPFamily.V4 else LB6_KEY
    return fmt.pack(addr_bytes(address), port_bytes(port), slot, proto)


def decode_lb_key(family: IPFamily, raw: bytes) -> tuple[str, int, int, int]:
    """(address, port, proto, slot)."""
    fmt = LB4_KEY if family == IPFamily.V4 else LB6_KEY
    a, p, slot, proto = fmt.unpack(raw)
    return addr_text(a), int.from_bytes(p, "big"), proto, slot


def master_value(m: Master) -> bytes:
    return LB_SERVICE.pack(0, m.affinity, m.count, m.flags, m.rev_nat_id)


def slot_value(backend_id: int) -> bytes:
    return LB_SERVICE.pack(backend_id, 0, 0, 0, 0)


def decode_service(raw: bytes) -> tuple[int, int, int, int, int]:
    """(backend_id, affinity_timeout, count, rev_nat_id, flags)."""
    backend_id, affinity, count, flags, rev = LB_SERVICE.unpack(raw)
    return backend_id, affinity, count, rev, flags


def backend_key(backend_id: int) -> bytes:
    return BACKEND_ID.pack(backend_id)


def backend_value(family: IPFamily, address: str, port: int, proto: int) -> bytes:
    fmt = LB4_BACKEND if family == IPFamily.V4 else LB6_BACKEND
    return fmt.pack(addr_bytes(address), port_bytes(port), proto, 0)


def decode_backend(family: IPFamily, raw: bytes) -> tuple[str, int, int]:
    """(address, port, proto)."""
    fmt = LB4_BACKEND if family == IPFamily.V4 else LB6_BACKEND
    a, p, proto, _flags = fmt.unpack(raw)
    return addr_text(a), int.from_bytes(p, "big"), proto


def key_sizes(family: IPFamily) -> dict[str, tuple[int, int]]:
    """role -> (key size, value size)."""
    v4 = family == IPFamily.V4
    return {
        "svc": ((LB4_KEY if v4 else LB6_KEY).size, LB_SERVICE.size),
        "be": (BACKEND_ID.size, (LB4_BACKEND if v4 else LB6_BACKEND).size),
        "rev": ((REV4_KEY if v4 else REV6_KEY).size, (REV4_VAL if v4 else REV6_VAL).size),
        "aff": (AFF_KEY.size, AFF_VAL.size),
        "name": (NAME_KEY.size, NAME_VAL.size),
    }


def name_key(rev_nat_id: int) -> bytes:
    return NAME_KEY.pack(rev_nat_id)


def name_value(text: str) -> bytes:
    return NAME_VAL.pack(text.encode()[:127])


def decode_name(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


# ------------------------------------------------------------------------------------------------ bpf(2)

_SYS_BPF = 321  # x86_64
_BPF_MAP_CREATE = 0
_BPF_MAP_LOOKUP_ELEM = 1
_BPF_OBJ_PIN = 6
_BPF_OBJ_GET = 7
_BPF_MAP_LOOKUP_BATCH = 24
_BPF_MAP_UPDATE_BATCH = 26
_BPF_MAP_DELETE_BATCH = 27

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The same syscall() without releasing the GIL (ctypes.PyDLL): for calls of a few microseconds. Releasing it costs
# nothing by itself, but getting it back waits for whichever thread holds it then, up to the 5 ms switch interval:
# in the lab, with the sources parsing a burst of objects, a partial sync's four or five map calls waited that long
# each (a sync's "apply" of < 0.1 ms of kernel work took 1-100 ms).
_libc_held = ctypes.PyDLL(None, use_errno=True)
_libc_held.syscall.restype = ctypes.c_long
#: batches of at most this many entries are written without releasing the GIL (~1 us of kernel time each)
HOLD_GIL_ENTRIES = 4096


class BpfError(OSError):
    """A bpf(2) command failed; ``errno`` says why (E2BIG: a map is full)."""


def bpf_call(cmd: int, attr: ctypes.Array[ctypes.c_char], *, hold_gil: bool = True) -> int:
    """One bpf(2) command; ``hold_gil`` False for long ones (a large batch: other threads run meanwhile)."""
    ret = int((_libc_held if hold_gil else _libc).syscall(_SYS_BPF, cmd, attr, len(attr)))
    if ret < 0:
        e = ctypes.get_errno()
        raise BpfError(e, os.strerror(e))
    return ret


def obj_get(path: str) -> int:
    """An fd for the map pinned at ``path`` (FileNotFoundError when there is none)."""
    p = ctypes.create_string_buffer(path.encode())
    attr = ctypes.create_string_buffer(struct.pack("<QII", ctypes.addressof(p), 0, 0), 120)
    try:
        return bpf_call(_BPF_OBJ_GET, attr)
    except BpfError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "no pinned map", path) from None
        raise


MAP_HASH = 1
MAP_ARRAY = 2
MAP_LRU_HASH = 9
BPF_F_NO_PREALLOC = 1


def create_map(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int, name: str = "") -> int:
    """A new map; its fd."""
    attr = ctypes.create_string_buffer(
        struct.pack("<IIIIIII16s", map_type, key_size, value_size, max_entries, flags, 0, 0, name.encode()[:15]), 120
    )
    return bpf_call(_BPF_MAP_CREATE, attr)


def create_like(role: str, family: IPFamily, map_size: int) -> int:
    """A new, unpinned map of one role's exact spec (``map_spec``) for benchmarks; its fd."""
    return create_map(*map_spec(role, family, map_size, map_size))


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(path.encode())
    attr = ctypes.create_string_buffer(struct.pack("<QII", ctypes.addressof(p), fd, 0), 120)
    bpf_call(_BPF_OBJ_PIN, attr)


def map_spec(role: str, family: IPFamily, map_size: int, lru_size: int) -> tuple[int, int, int, int, int]:
    """(type, key size, value size, max entries, flags) of one map, exactly as bpf/kproxy_sock.c declares it, so a
    map kproxy creates and pins before the programs are compiled is the one bcc then reopens."""
    if role == COUNTER_ROLE:  # indexed by backend id, like the backend array (see backends/bpf/counters.py)
        return (MAP_ARRAY, COUNTER_KEY.size, COUNTER_VALUE.size, map_size, 0)
    k, v = key_sizes(family)[role]
    if role == "svc":
        return (MAP_HASH, k, v, map_size, BPF_F_NO_PREALLOC)
    if role == "be":  # ids are kproxy's, dense from 1: an array (see backends/bpf/__init__.py)
        return (MAP_ARRAY, k, v, map_size, 0)
    if role == "name":  # one entry per service port (allocated on use)
        return (MAP_HASH, k, v, map_size, BPF_F_NO_PREALLOC)
    return (MAP_LRU_HASH, k, v, lru_size, 0)


def _batch_attr(
    fd: int, keys: int, values: int, count: int, in_b: int = 0, out_b: int = 0
) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(struct.pack("<QQQQIIQQ", in_b, out_b, keys, values, count, fd, 0, 0), 120)


class Packed(Sequence[bytes]):
    """Entries of one size laid end to end in one byte string: a batch's keys or values as a plan builds them for a
    first sync (a service's entries in one concatenation, no object per entry). A read-only sequence of the entries
    for whoever looks at them one by one (tests, replays); the batch calls take the buffer as it is."""

    __slots__ = ("blob", "size")

    def __init__(self, blob: bytes, size: int) -> None:
        if size <= 0 or len(blob) % size:
            raise ValueError(f"{len(blob)} bytes are not whole entries of {size}")
        self.blob, self.size = blob, size

    def __len__(self) -> int:
        return len(self.blob) // self.size

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step == 1:
                return Packed(self.blob[start * self.size : max(start, stop) * self.size], self.size)
            return [self[j] for j in range(start, stop, step)]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.blob[i * self.size : (i + 1) * self.size]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Packed({len(self)} x {self.size} bytes)"


def _joined(items: Sequence[bytes], i: int, n: int) -> bytes:
    """Entries ``i .. i+n`` of ``items`` in one byte string."""
    if isinstance(items, Packed):
        if i == 0 and n == len(items):
            return items.blob
        return items.blob[i * items.size : (i + n) * items.size]
    return b"".join(items[i : i + n])


def update_batch(fd: int, keys: Sequence[bytes], values: Sequence[bytes], chunk: int = 65536) -> None:
    """Write ``keys[i] -> values[i]`` in as few BPF_MAP_UPDATE_BATCH calls as the chunk size allows."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys for {len(values)} values")
    for i in range(0, len(keys), chunk):
        n = min(chunk, len(keys) - i)
        kb = ctypes.create_string_buffer(_joined(keys, i, n))
        vb = ctypes.create_string_buffer(_joined(values, i, n))
        attr = _batch_attr(fd, ctypes.addressof(kb), ctypes.addressof(vb), n)
        bpf_call(_BPF_MAP_UPDATE_BATCH, attr, hold_gil=n <= HOLD_GIL_ENTRIES)


def delete_batch(fd: int, keys: Sequence[bytes], chunk: int = 65536) -> None:
    """Delete ``keys`` (missing ones are an error of the kernel's: ENOENT; callers delete what they know exists)."""
    for i in range(0, len(keys), chunk):
        n = min(chunk, len(keys) - i)
        kb = ctypes.create_string_buffer(_joined(keys, i, n))
        bpf_call(_BPF_MAP_DELETE_BATCH, _batch_attr(fd, ctypes.addressof(kb), 0, n), hold_gil=n <= HOLD_GIL_ENTRIES)


def lookup_all(fd: int, key_size: int, value_size: int, chunk: int = 16384) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of a hash map, by BPF_MAP_LOOKUP_BATCH (no order)."""
    kb = ctypes.create_string_buffer(key_size * chunk)
    vb = ctypes.create_string_buffer(value_size * chunk)
    in_b = ctypes.create_string_buffer(8)
    out_b = ctypes.create_string_buffer(8)
    first = True
    while True:
        attr = _batch_attr(
            fd,
            ctypes.addressof(kb),
            ctypes.addressof(vb),
            chunk,
            0 if first else ctypes.addressof(in_b),
            ctypes.addressof(out_b),
        )
        done = False
        try:
            bpf_call(_BPF_MAP_LOOKUP_BATCH, attr, hold_gil=False)
        except BpfError as exc:
            if exc.errno != errno.ENOENT:
                raise
            done = True
        count = struct.unpack_from("<I", attr.raw, 32)[0]
        kraw, vraw = kb.raw, vb.raw
        for i in range(count):
            yield kraw[i * key_size : (i + 1) * key_size], vraw[i * value_size : (i + 1) * value_size]
        if done:
            return
        ctypes.memmove(in_b, out_b, 8)
        first = False


def lookup_raw(fd: int, key_size: int, value_size: int, chunk: int = 65536) -> tuple[bytes, bytes]:
    """Every key and every value of a hash map, each concatenated (BPF_MAP_LOOKUP_BATCH; no order)."""
    return _lookup_batches(fd, key_size, value_size, None, chunk)


def lookup_array(fd: int, key_size: int, value_size: int, count: int, chunk: int = 65536) -> tuple[bytes, bytes]:
    """The first ``count`` entries of an array map (indexes 0 .. count-1, fewer if the array is shorter), keys and
    values each concatenated; entries never written are all zero bytes. Reading a whole array would cost its size
    (1M entries by default): callers read as far as the highest index anything names."""
    if count <= 0:
        return b"", b""
    return _lookup_batches(fd, key_size, value_size, count, chunk)


def _lookup_batches(fd: int, key_size: int, value_size: int, limit: int | None, chunk: int) -> tuple[bytes, bytes]:
    """BPF_MAP_LOOKUP_BATCH calls from the map's first key until the end, or until ``limit`` entries."""
    kb = ctypes.create_string_buffer(key_size * chunk)
    vb = ctypes.create_string_buffer(value_size * chunk)
    in_b = ctypes.create_string_buffer(8)
    out_b = ctypes.create_string_buffer(8)
    keys: list[bytes] = []
    values: list[bytes] = []
    left = limit
    first = True
    while left is None or left > 0:
        n = chunk if left is None else min(chunk, left)
        attr = _batch_attr(
            fd, ctypes.addressof(kb), ctypes.addressof(vb), n, 0 if first else ctypes.addressof(in_b),
            ctypes.addressof(out_b),
        )  # fmt: skip
        done = False
        try:
            bpf_call(_BPF_MAP_LOOKUP_BATCH, attr, hold_gil=False)
        except BpfError as exc:
            if exc.errno != errno.ENOENT:
                raise
            done = True
        got = struct.unpack_from("<I", attr.raw, 32)[0]
        keys.append(ctypes.string_at(kb, got * key_size))
        values.append(ctypes.string_at(vb, got * value_size))
        if left is not None:
            left -= got
        if done or got == 0:
            break
        ctypes.memmove(in_b, out_b, 8)
        first = False
    return b"".join(keys), b"".join(values)


def read_lb(svc_fd: int, be_fd: int, name_fd: int, family: IPFamily) -> dict[str, tuple[bytes, bytes]]:
    """The service, backend and names maps raw (role -> (keys, values), each concatenated): the backend array as far
    as the highest backend id a service entry names (ids beyond are unreachable: left for the next writer of that
    id), entries of no backend included as all zero bytes.

    The names map is read before the service map and again after it, and the two are joined (the later one wins a
    key): a read beside a sync (``kproxy.readbehind``) would otherwise miss the name of a service removed between
    its service-map read and its names read, and report that service's frontends as nobody's. Between syncs the two
    reads are the same."""
    ks = key_sizes(family)
    names_before = lookup_raw(name_fd, *ks["name"])
    svc = lookup_raw(svc_fd, *ks["svc"])
    ids = array.array("I")
    ids.frombytes(svc[1])
    upto = max(ids[0 :: LB_SERVICE.size // 4], default=0)  # each value's first field is its backend id (0: a master)
    be = lookup_array(be_fd, *ks["be"], upto + 1)
    return {"svc": svc, "be": be, "name": joined(names_before, lookup_raw(name_fd, *ks["name"]), *ks["name"])}


def joined(
    first: tuple[bytes, bytes], second: tuple[bytes, bytes], key_size: int, value_size: int
) -> tuple[bytes, bytes]:
    """Two raw reads of one hash map as one: every key of either, with ``second``'s value where both have it."""
    if first == second:
        return second
    entries = dict(zip(pieces(first[0], key_size), pieces(first[1], value_size), strict=True))
    entries.update(zip(pieces(second[0], key_size), pieces(second[1], value_size), strict=True))
    return b"".join(entries), b"".join(entries.values())


def pieces(raw: bytes, size: int) -> list[bytes]:
    """``raw`` cut into consecutive ``size``-byte pieces (one per map entry, or per backend of a slot list)."""
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def zero_values(count: int, value_size: int) -> Packed:
    """``count`` all-zero values: what "no entry" is in an array map (deleting from one is refused)."""
    return Packed(bytes(count * value_size), value_size)


def lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    kb = ctypes.create_string_buffer(key)
    vb = ctypes.create_string_buffer(value_size)
    attr = ctypes.create_string_buffer(struct.pack("<I4xQQQ", fd, ctypes.addressof(kb), ctypes.addressof(vb), 0), 120)
    try:
        bpf_call(_BPF_MAP_LOOKUP_ELEM, attr)
    except BpfError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    return vb.raw[:value_size]
