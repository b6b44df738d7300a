"""Adoption and read-back of the bpf mode: what the maps and the companion table hold, decoded into kproxy's index
(``decode``) and compared with the fragments the ledger wants.

A full batch adopts: the service, backend and names maps are read back (``maps.read_lb``: the backend array as far
as the highest id a slot names; in a thread while the ledger renders, ``pending``) and decoded; a service whose
frontends, backends (in any slot order: ``same_backends``) and flags match, under a
reverse-NAT id the names map gives to it, is not rewritten, so a restart with nothing changed writes nothing. The
frontends of each wanted service are claimed (``claim``) so their backend ids are reused, not duplicated. ``verify``
reads the same way, through the pins (never kproxy's own fds), and says what differs per service.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from kproxy.model import IPFamily, ServicePortName
from kproxy.toolkit.keys import service_key

from . import decode, maps
from .companion import NftView
from .index import FamilyIndex, View, endpoint_pairs, endpoint_size, endpoints
from .render import Fragment, decoded


@dataclass
class Adopted:
    """What ``adopt`` read: the rebuilt index, the decoded view, reverse-NAT id use counts, the companion table."""

    index: FamilyIndex
    view: View
    rev_counts: Counter[int]
    nft: NftView
    #: set when the maps were not read (the proxier's ``adopt``): what the ledger records as applied
    trusted: Mapping[ServicePortName, Fragment] | None = None
    #: (verify) why no socket is translated from these maps: pins gone, programs detached or reading other maps
    problem: str | None = None
    #: (verify) why the companion table does not work: a fixed chain lost its rules
    nft_problem: str | None = None
    #: the maps' read while it runs in another thread (``pending``): ``ready`` decodes it on first use
    raw: Future[dict[str, tuple[bytes, bytes]]] | None = None
    #: seconds ``ready`` waited for that read (``adopt_wait``) and decoded it (``adopt_decode``), for the timings
    seconds: dict[str, float] = field(default_factory=dict)

    def ready(self) -> Adopted:
        """This adoption with the maps read and decoded: waits for a read still running (``pending``), once; raises
        what the read raised."""
        raw = self.raw
        if raw is not None:
            self.raw = None
            t0 = time.perf_counter()
            got_raw = raw.result()
            t1 = time.perf_counter()
            got = adopted(self.index.family, got_raw, self.nft)
            self.index, self.view, self.rev_counts = got.index, got.view, got.rev_counts
            self.seconds = {"adopt_wait": t1 - t0, "adopt_decode": time.perf_counter() - t1}
        return self


def pending(family: IPFamily, raw: Future[dict[str, tuple[bytes, bytes]]], table: NftView) -> Adopted:
    """An ``Adopted`` whose maps are still being read (``Adopted.ready`` decodes them): the read's ``bpf(2)`` calls
    release the GIL, so they overlap the ledger's admission and rendering of every wanted service, which the ledger
    does before its first comparison."""
    return Adopted(FamilyIndex(family), {}, Counter(), table, raw=raw)


def index_from_kernel(
    family: IPFamily,
    svc_entries: Iterable[tuple[bytes, bytes]],
    be_entries: Iterable[tuple[bytes, bytes]],
    name_entries: Iterable[tuple[bytes, bytes]] = (),
) -> tuple[FamilyIndex, View]:
    """``decode.index_from_raw`` for (key, value) pairs."""

    def raw(entries: Iterable[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
        pairs = list(entries)
        return b"".join(k for k, _ in pairs), b"".join(v for _, v in pairs)

    return decode.index_from_raw(family, raw(svc_entries), raw(be_entries), raw(name_entries))


def adopted(
    family: IPFamily,
    raw: Mapping[str, tuple[bytes, bytes]],
    table: NftView,
    problem: str | None = None,
    nft_problem: str | None = None,
) -> Adopted:
    """An ``Adopted`` from the raw maps (role -> (keys, values)) and the companion table as read."""
    index, view = decode.index_from_raw(family, raw["svc"], raw["be"], raw["name"])
    counts = Counter(v[3] for v in view.values())
    return Adopted(index, view, counts, table, problem=problem, nft_problem=nft_problem)


def claim(index: FamilyIndex, name: ServicePortName, fragment: Fragment | None) -> None:
    """Mark what the kernel holds for ``name`` as its own: the frontends whose reverse-NAT id the names map gives
    to it, and any frontend of ``fragment`` nobody owns yet (so its backend ids are reused, not duplicated)."""
    text = service_key(name)
    revs = index.revs_named(text)
    if revs:
        index.rev_ids.setdefault(name, revs[0])
    for rev in revs:
        for key in index.by_rev.get(rev, ()):
            st = index.fronts.get(key)
            if st is not None and st.owner is None:
                index.set_owner(key, name)
    for f in fragment.frontends if fragment is not None else ():
        held = index.fronts.get(f.key)
        if held is not None and held.owner is None:
            index.set_owner(f.key, name)
            index.rev_ids.setdefault(name, held.master.rev_nat_id)


def claim_all(
    index: FamilyIndex, wanted: Mapping[ServicePortName, Fragment], removed: Iterable[ServicePortName]
) -> None:
    """A full batch on an index read from the kernel: every wanted service claims what it holds, and so does every
    service the batch removes (so its frontends and ids go with it)."""
    if not index.unclaimed():
        return
    for name, frag in wanted.items():
        claim(index, name, frag)
    for name in removed:
        if name not in wanted:
            claim(index, name, None)


def unchanged(
    index: FamilyIndex, view: View, rev_counts: Mapping[int, int], name: ServicePortName, fragment: Fragment
) -> bool:
    """Whether the kernel holds ``fragment``'s frontends exactly, under a reverse-NAT id named for ``name``, and no
    other frontend under that id."""
    rev = -1  # every frontend's reverse-NAT id, once they agree
    family = index.family
    for f in fragment.frontends:
        got = view.get(f.key)
        if got is None or got[0] != f.flags or got[1] != f.affinity:
            return False
        if not same_backends(got[2], endpoints(family, f.backends), endpoint_size(family)):
            return False
        if rev != got[3]:
            if rev != -1:
                return False
            rev = got[3]
    if rev == -1 or index.rev_names.get(rev) != service_key(name):
        return False
    return rev_counts.get(rev, 0) == len(fragment.frontends)


def same_backends(held: bytes, wanted: bytes, size: int) -> bool:
    """Whether a frontend's slots (``View`` order: the slots') hold ``wanted`` (``index.endpoints``, ``size`` bytes
    each) in any order: equal as they are (slots written in the fragment's order and not changed since), else equal
    once both are sorted."""
    if held == wanted:
        return True
    if len(held) != len(wanted):
        return False
    return sorted(maps.pieces(held, size)) == sorted(maps.pieces(wanted, size))


def adopted_unchanged(a: Adopted, name: ServicePortName, fragment: Fragment) -> bool:
    """Whether ``a`` holds ``fragment`` for ``name`` exactly: its frontends and its companion part."""
    if a.trusted is not None:
        return a.trusted.get(name) == fragment
    if a.raw is not None:
        a.ready()
    if not a.view:  # the maps hold no frontend (a first sync): nothing is there already
        return False
    if not unchanged(a.index, a.view, a.rev_counts, name, fragment):
        return False
    if not a.nft.present and fragment.nft.empty:
        return True
    return all(c in a.nft.chains for c, _ in fragment.nft.chains) and all(
        e in a.nft.elements for e in fragment.nft.elements
    )


def verify_service(a: Adopted, name: ServicePortName, fragment: Fragment) -> str | None:
    """None when the kernel holds ``fragment`` exactly; else ``missing`` or ``different: ...`` with what differs."""
    if a.problem is None and (a.nft_problem is None or fragment.nft.empty) and adopted_unchanged(a, name, fragment):
        return None  # the common answer, without decoding the fragment (a read-back compares every service)
    fronts = decoded(fragment)
    held = {k: a.view[k] for k in fronts if k in a.view}
    if not held and not any(e in a.nft.elements for e in fragment.nft.elements):
        return "missing"
    if a.problem is not None:  # the maps may be right, but no socket is translated from them
        return f"different: {a.problem}"
    if a.nft_problem is not None and not fragment.nft.empty:
        return f"different: {a.nft_problem}"
    if adopted_unchanged(a, name, fragment):
        return None
    for k, want in fronts.items():
        got = a.view.get(k)
        if got is None:
            return f"different: frontend {k[0]}:{k[1]}/{k[2]} missing"
        held_sorted = (got[0], got[1], tuple(sorted(endpoint_pairs(a.index.family, got[2]))))  # ``decoded``'s order
        if held_sorted != want:
            return f"different: frontend {k[0]}:{k[1]}/{k[2]} holds {held_sorted}, wanted {want}"
    missing = [e for e in fragment.nft.elements if e not in a.nft.elements]
    if missing:
        return f"different: companion element {' '.join(missing[0])} missing"
    lost = [c for c, _ in fragment.nft.chains if c not in a.nft.chains]
    if lost:
        return f"different: companion chain {lost[0]} missing or not holding its rules"
    return "different: reverse-NAT id or name"


def verify_extra(a: Adopted, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
    """What the maps and the table hold that no wanted service accounts for, one line each."""
    keys = {service_key(n) for n in wanted}
    out = []
    for k, got in a.view.items():
        owner = a.index.rev_names.get(got[3])
        if owner not in keys:
            out.append(f"frontend {k[0]}:{k[1]}/{k[2]}: not wanted (rev_nat {got[3]}, {owner or 'unnamed'})")
    want_elems = {e for f in wanted.values() for e in f.nft.elements}
    out += [f"nft element {m} {k} : {v}: not wanted" for m, k, v in sorted(a.nft.elements - want_elems)]
    return out
