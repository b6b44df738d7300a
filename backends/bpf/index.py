"""kproxy's index of one family's bpf maps: every frontend with its owner, master entry and slots, every backend id,
the reverse-NAT ids and their names, and the allocators of both kinds of id. Rebuilt from the kernel on adoption
(``adopt``, ``decode``), updated as plans are made (``plan``): the index is what a partial sync plans against, so it
never reads the maps. A module of its own so that the planner and the decoder share it without importing each other.
"""

from __future__ import annotations

import functools
import socket
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

from kproxy.model import IPFamily, ServicePortName

from .maps import LB4_BACKEND, LB6_BACKEND, Master, addr_bytes, addr_text

_ONE_IF_SET = bytes([0] + [1] * 255)  # bytes.translate tables: any set byte -> 1, or -> 0 with 0 -> 1
_ZERO_IF_SET = bytes([1] + [0] * 255)

#: the highest backend and reverse-NAT id (32 bits in the maps; 0 is "none")
MAX_ID = 0xFFFFFFFF - 1

#: frontend -> (flags, affinity, its backends' address . port bytes in slot order (``endpoints``), rev_nat_id): what
#: adoption and verify compare (``adopt.same_backends``: slot order is the fragment's until endpoints change, so most
#: comparisons are one bytes compare). Bytes, not (address, port) tuples: decoding a million backends' addresses to
#: text and a tuple each was most of a restart's decode at 100,000 x 10.
View = dict[tuple[str, int, int], tuple[int, int, bytes, int]]

#: an address as the maps hold it, by family: ``inet_pton`` bound to the family, so a ``map`` over a service's
#: backends runs no Python frame (not memoised: a first sync's addresses are new to any cache)
PTON = {
    IPFamily.V4: functools.partial(socket.inet_pton, socket.AF_INET),
    IPFamily.V6: functools.partial(socket.inet_pton, socket.AF_INET6),
}


@functools.cache
def ports() -> list[bytes]:
    """A port as the maps hold it (network order), by number: a list lookup where ``to_bytes`` is a call per
    backend. Built at the first use, not at import: it holds 65,536 objects (3 MB), and a kproxy of every other mode
    imports this package to remove the bpf mode's leftovers."""
    return [i.to_bytes(2, "big") for i in range(65536)]


def endpoint_size(family: IPFamily) -> int:
    """Bytes of one backend's address . port (the head of its backend-map value)."""
    return 6 if family == IPFamily.V4 else 18


def endpoints(family: IPFamily, backends: Iterable[tuple[str, int]]) -> bytes:
    """(address, port) pairs as a ``View`` holds them: each one's address . port bytes, laid end to end."""
    pton, port = PTON[family], ports()
    return b"".join([pton(a) + port[p] for a, p in backends])


def endpoint_pairs(family: IPFamily, blob: bytes) -> tuple[tuple[str, int], ...]:
    """``endpoints`` read back (all zero bytes: a slot naming no backend, shown as ``("?", 0)``)."""
    size = endpoint_size(family)
    out = []
    for i in range(0, len(blob), size):
        ep = blob[i : i + size]
        out.append((addr_text(ep[:-2]), int.from_bytes(ep[-2:], "big")) if any(ep) else ("?", 0))
    return tuple(out)


class Backends(MutableMapping[int, tuple[str, int, int]]):
    """Backend id -> (address, port, protocol), held as the backend array holds it: each id's map value (address,
    port in network order, protocol, flags; 8 bytes for IPv4, 20 for IPv6) at ``id * size`` of one ``bytearray``, an
    all-zero value meaning no backend. Why not a dict of tuples: at 100,000 services x 10 endpoints that dict held
    ~1.4 KB per service port (an int key, a tuple and a port int per backend, the dict's slots); this holds 80 bytes,
    a plan writes a new service's values with one slice assignment (the blob it hands the kernel) and adoption takes
    the array's read as it comes. Ids are dense from 1 (the allocators hand out the lowest free ones), so the buffer
    is about as long as the backends held. Reading an entry as a tuple decodes it; the planner compares the raw
    bytes (``raw``, ``endpoint``)."""

    __slots__ = ("_buf", "_size", "_alen", "_count")

    def __init__(self, family: IPFamily, items: Iterable[tuple[int, tuple[str, int, int]]] = ()) -> None:
        v4 = family == IPFamily.V4
        self._size = (LB4_BACKEND if v4 else LB6_BACKEND).size
        self._alen = 4 if v4 else 16
        self._buf = bytearray()
        self._count = 0
        for bid, be in items:
            self[bid] = be

    @property
    def size(self) -> int:
        """Bytes of one value."""
        return self._size

    def _zero(self, off: int) -> bool:
        buf = self._buf
        return not any(buf[off : off + self._size])

    def raw(self, bid: int) -> bytes | None:
        """The map value of ``bid`` (None: no backend)."""
        off = bid * self._size
        if bid < 0 or off >= len(self._buf):
            return None
        v = bytes(self._buf[off : off + self._size])
        return v if any(v) else None

    def endpoint(self, bid: int) -> bytes | None:
        """The address and port bytes of ``bid``'s value (what tells two backends of one service apart)."""
        v = self.raw(bid)
        return None if v is None else v[: self._alen + 2]

    def put_raw(self, bid: int, value: bytes) -> None:
        """Hold ``value`` (a map value, not all zero) for ``bid``."""
        if bid < 0 or len(value) != self._size or not any(value):
            raise ValueError(f"backend {bid}: {len(value)}-byte value {value.hex()} is not a backend's")
        off = bid * self._size
        buf = self._buf
        if off >= len(buf):
            buf.extend(bytes(off + self._size - len(buf)))
        elif not self._zero(off):
            self._count -= 1
        buf[off : off + self._size] = value
        self._count += 1

    def put_run(self, first: int, values: bytes) -> None:
        """Hold the values laid end to end in ``values`` for ids ``first``, ``first + 1`` ... (a new service's
        backends: one slice assignment). Every value's protocol byte must be set (as every backend's is)."""
        size = self._size
        n, rest = divmod(len(values), size)
        if first < 0 or rest:
            raise ValueError(f"{len(values)} bytes from id {first} are not whole {size}-byte values")
        if values[self._alen + 2 :: size].count(0):
            raise ValueError(f"a value without a protocol among the {n} from id {first}")
        off, end = first * size, (first + n) * size
        buf = self._buf
        old = buf[off:end]  # whole values (the buffer is), fewer past its end
        held = len(self._rows(old)) if old.strip(b"\0") else 0  # fresh ids (a plan's): nothing to count
        if end > len(buf):
            buf.extend(bytes(end - len(buf)))
        buf[off:end] = values
        self._count += n - held

    def _rows(self, blob: bytes | bytearray) -> list[int]:
        """The row numbers of the values in ``blob`` that are not all zero (C-level: one OR of the byte columns)."""
        return list(compress(range(len(blob) // self._size), self._held(blob)))

    def _held(self, blob: bytes | bytearray) -> bytes:
        """A byte per whole value of ``blob``: 1 for one that is not all zero, else 0."""
        size = self._size
        n = len(blob) // size
        acc = 0
        for i in range(size):
            acc |= int.from_bytes(blob[i::size], "little")
        return acc.to_bytes(n, "little").translate(_ONE_IF_SET)

    def unused(self, used: Iterable[int]) -> list[int]:
        """The ids held that ``used`` does not name, lowest first. Byte maps, not sets: a full sync's sweep at
        100,000 x 10 once built two sets of a million ids (~120 MB for a moment)."""
        held = self._held(self._buf)
        n = len(held)
        mark = bytearray(n)
        deque(map(mark.__setitem__, filter(n.__gt__, used), repeat(1)), maxlen=0)
        keep = int.from_bytes(held, "little") & ~int.from_bytes(mark, "little")
        return list(compress(range(n), keep.to_bytes(n, "little")))

    def holes(self) -> list[int]:
        """The ids from 1 to the highest held that hold no backend, highest first."""
        top = self.top()
        free = self._held(self._buf)[1 : top + 1].translate(_ZERO_IF_SET)
        return list(compress(range(1, top + 1), free))[::-1]

    @classmethod
    def from_array(cls, family: IPFamily, values: bytes) -> Backends:
        """The table of a backend array read from index 0 (values laid end to end, all-zero ones no backend)."""
        out = cls(family)
        if len(values) % out._size:
            raise ValueError(f"{len(values)} bytes are not whole {out._size}-byte values")
        out._buf = bytearray(values)
        out._count = out._held(values).count(1)
        return out

    def ids(self) -> set[int]:
        return set(self._rows(self._buf))

    def top(self) -> int:
        """The highest id held (0: none)."""
        used = len(self._buf.rstrip(b"\0"))
        return (used - 1) // self._size if used else 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, bid: object) -> bool:
        return isinstance(bid, int) and self.raw(bid) is not None

    def __getitem__(self, bid: int) -> tuple[str, int, int]:
        v = self.raw(bid) if isinstance(bid, int) else None
        if v is None:
            raise KeyError(bid)
        al = self._alen
        return addr_text(v[:al]), int.from_bytes(v[al : al + 2], "big"), v[al + 2]

    def get(self, bid: int, default: Any = None) -> Any:
        try:
            return self[bid]
        except KeyError:
            return default

    def __setitem__(self, bid: int, be: tuple[str, int, int]) -> None:
        a, port, proto = be
        self.put_raw(bid, addr_bytes(a) + port.to_bytes(2, "big") + bytes((proto, 0)))

    def __delitem__(self, bid: int) -> None:
        if bid not in self:
            raise KeyError(bid)
        off = bid * self._size
        self._buf[off : off + self._size] = bytes(self._size)
        self._count -= 1

    def discard(self, bid: int) -> None:
        if bid in self:
            del self[bid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows(self._buf))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backends):
            return self._size == other._size and self._buf.rstrip(b"\0") == other._buf.rstrip(b"\0")
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Backends({dict(self.items())!r})"


def ids(values: Iterable[int] = ()) -> array[int]:
    """Backend ids as ``FrontState.slots`` holds them."""
    return array("I", values)


@dataclass(slots=True)
class FrontState:
    """What the service map holds for one frontend (as written or adopted)."""

    owner: ServicePortName | None
    master: Master
    #: backend ids of slots 1..count: 4 bytes each (a tuple of ints held 36 per id, 10 ints a service port)
    slots: array[int]


@dataclass
class FamilyIndex:
    """kproxy's knowledge of one family's maps: every frontend, every backend id, and the allocators. Rebuilt from
    the kernel on adoption, updated as plans are executed."""

    family: IPFamily
    fronts: dict[tuple[str, int, int], FrontState] = field(default_factory=dict)
    backends: Backends = field(init=False)
    rev_ids: dict[ServicePortName, int] = field(default_factory=dict)
    rev_names: dict[int, str] = field(default_factory=dict)  # the names map: rev_nat_id -> "ns/name:port/PROTO"
    #: owner -> its frontends (a tuple: a service port has one to a few, and a set of one held 216 bytes)
    owned: dict[ServicePortName, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    by_rev: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)  # adopted frontends per rev id
    _by_name: dict[str, list[int]] | None = None  # rev_names inverted, built on first use (adoption only)
    next_backend: int = 1
    next_rev: int = 1
    free_backends: list[int] = field(default_factory=list)
    free_revs: list[int] = field(default_factory=list)
    #: some reverse-NAT id is held under two names (adoption's ``claim`` can do that; ``sweep`` finds out): a freed id
    #: is then checked against every name's (``Plan.release``), else a freed id was its one name's
    shared_revs: bool = False

    entries: int = 0  # service-map entries the fronts stand for, kept as they change (read on every apply)

    def __post_init__(self) -> None:
        self.backends = Backends(self.family)

    @property
    def svc_entries(self) -> int:
        return self.entries

    def unclaimed(self) -> bool:
        """Whether some frontend or reverse-NAT name has no owner yet (an index read from the kernel): ``claim``
        has nothing to do otherwise."""
        return any(st.owner is None for st in self.fronts.values()) or bool(
            self.rev_names.keys() - set(self.rev_ids.values())
        )

    def revs_named(self, text: str) -> list[int]:
        """The reverse-NAT ids the names map gives to a service key (normally one)."""
        if self._by_name is None:
            by: dict[str, list[int]] = {}
            for r, n in self.rev_names.items():
                by.setdefault(n, []).append(r)
            self._by_name = by
        return self._by_name.get(text, [])

    def forget_adoption(self) -> None:
        """Drop what only claiming adopted frontends looks up (``by_rev``, the names inverted: ~200 bytes per
        service port after a restart); both describe the maps as read, not as planned since."""
        self.by_rev = {}
        self._by_name = None

    def put_front(self, key: tuple[str, int, int], st: FrontState) -> None:
        """Record a frontend (taking it from its previous owner, if another)."""
        old = self.fronts.get(key)
        if old is not None:
            self.entries -= 1 + len(old.slots)
            if old.owner is not None and old.owner != st.owner:
                self._disown(old.owner, key, keep_empty=True)
        self.entries += 1 + len(st.slots)
        self.fronts[key] = st
        if st.owner is not None:
            self._own(st.owner, key)

    def drop_front(self, key: tuple[str, int, int]) -> None:
        old = self.fronts.pop(key, None)
        if old is not None:
            self.entries -= 1 + len(old.slots)
        if old is not None and old.owner is not None:
            self._disown(old.owner, key, keep_empty=False)

    def set_owner(self, key: tuple[str, int, int], name: ServicePortName) -> None:
        st = self.fronts[key]
        if st.owner is not None and st.owner != name:
            self._disown(st.owner, key, keep_empty=True)
        st.owner = name
        self._own(name, key)

    def _own(self, name: ServicePortName, key: tuple[str, int, int]) -> None:
        mine = self.owned.get(name, ())
        if key not in mine:
            self.owned[name] = (*mine, key)

    def _disown(self, name: ServicePortName, key: tuple[str, int, int], *, keep_empty: bool) -> None:
        """``key`` no longer ``name``'s; a service left with none keeps its (empty) entry when ``keep_empty`` (the
        next sweep forgets it), else loses it."""
        mine = self.owned.get(name)
        if mine is None or key not in mine:
            return
        rest = tuple([k for k in mine if k != key])
        if rest or keep_empty:
            self.owned[name] = rest
        else:
            del self.owned[name]

    def alloc_rev(self) -> int:
        if self.free_revs:
            return self.free_revs.pop()
        i = self.next_rev
        if i > MAX_ID:
            raise OverflowError(f"no reverse-NAT id left ({MAX_ID:,} service ports per family)")
        self.next_rev += 1
        return i
