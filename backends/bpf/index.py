"""kproxy's index of one family's bpf maps: every frontend with its owner, master entry and slots, every backend id,
the reverse-NAT ids and their names, and the allocators of both kinds of id. Rebuilt from the kernel on adoption
(``adopt``, ``decode``), updated as plans are made (``plan``): the index is what a partial sync plans against, so it
never reads the maps. A module of its own so that the planner and the decoder share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kproxy.model import IPFamily, ServicePortName

from .maps import Master

#: the highest backend and reverse-NAT id (32 bits in the maps; 0 is "none")
MAX_ID = 0xFFFFFFFF - 1

#: frontend -> (flags, affinity, its backends' (address, port) in slot order, rev_nat_id): what adoption and verify
#: compare (``adopt.same_backends``: slot order is the fragment's until endpoints change, so most comparisons sort
#: nothing)
View = dict[tuple[str, int, int], tuple[int, int, tuple[tuple[str, int], ...], int]]


@dataclass(slots=True)
class FrontState:
    """What the service map holds for one frontend (as written or adopted)."""

    owner: ServicePortName | None
    master: Master
    slots: tuple[int, ...]  # backend ids of slots 1..count


@dataclass
class FamilyIndex:
    """kproxy's knowledge of one family's maps: every frontend, every backend id, and the allocators. Rebuilt from
    the kernel on adoption, updated as plans are executed."""

    family: IPFamily
    fronts: dict[tuple[str, int, int], FrontState] = field(default_factory=dict)
    backends: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    rev_ids: dict[ServicePortName, int] = field(default_factory=dict)
    rev_names: dict[int, str] = field(default_factory=dict)  # the names map: rev_nat_id -> "ns/name:port/PROTO"
    owned: dict[ServicePortName, set[tuple[str, int, int]]] = field(default_factory=dict)  # owner -> its frontends
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

    def put_front(self, key: tuple[str, int, int], st: FrontState) -> None:
        """Record a frontend (taking it from its previous owner, if another)."""
        old = self.fronts.get(key)
        if old is not None:
            self.entries -= 1 + len(old.slots)
            if old.owner is not None and old.owner != st.owner:
                self.owned.get(old.owner, set()).discard(key)
        self.entries += 1 + len(st.slots)
        self.fronts[key] = st
        if st.owner is not None:
            self.owned.setdefault(st.owner, set()).add(key)

    def drop_front(self, key: tuple[str, int, int]) -> None:
        old = self.fronts.pop(key, None)
        if old is not None:
            self.entries -= 1 + len(old.slots)
        if old is not None and old.owner is not None:
            mine = self.owned.get(old.owner)
            if mine is not None:
                mine.discard(key)
                if not mine:
                    del self.owned[old.owner]

    def set_owner(self, key: tuple[str, int, int], name: ServicePortName) -> None:
        st = self.fronts[key]
        if st.owner is not None and st.owner != name:
            self.owned.get(st.owner, set()).discard(key)
        st.owner = name
        self.owned.setdefault(name, set()).add(key)

    def alloc_rev(self) -> int:
        if self.free_revs:
            return self.free_revs.pop()
        i = self.next_rev
        if i > MAX_ID:
            raise OverflowError(f"no reverse-NAT id left ({MAX_ID:,} service ports per family)")
        self.next_rev += 1
        return i
