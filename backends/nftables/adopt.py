"""Reading back what kproxy's nftables table holds, once per full sync, cheaply (``Adopted``).

Listing the whole table at 10,000 services x 10 endpoints takes seconds (libnftables formats every element of the
100,000-element ``backends`` map; docs/PERFORMANCE.md), and ``nft list chain`` or ``list tables`` fetch the whole
table too (nft 1.0.6).
So adoption reads only what is small: chain names (``list chains``), every chain's rules by the comment kproxy
writes on each (``layout.rule_tag``; one netlink rule dump, which carries no set elements: a deleted rule, a flushed
chain or table and a rule added by hand are seen), the ``service-ips`` and ``service-nodeports``
maps (one element per service address, each commented with its service's key), the ``service-digests`` set (one
element per service port, commented ``<service key> #<fragment digest>``), the firewall and hairpin sets and the
three context sets. The two maps and the digest set, an element per service address each, and the hairpin set, one
per local endpoint, are read with one netlink element dump each (``setdump``): through libnftables (its parse, its
JSON, Python's) they cost seconds at 100,000 services; the small sets through libnftables. Those dumps run in the
libnftables worker thread while the ledger renders every wanted service (the kernel's walk happens in ``recv``,
without the GIL), and are taken in at the first comparison (``Adopted.ready``); a dump that fails then makes the
table unadoptable, replaced whole as one that cannot be read. Where the time goes: ``Adopted.parts`` (the bench's
``restart_parts``). A service whose entries and digest equal the new fragment's is unchanged; for any other, the
keys of its big-map elements follow from its entries (an entry's verdict names the shared chain, ``lb-i-3``, hence
the slots 0..2 of its key in ``backends``), so it can be rewritten exactly without the big read.

A restart (the first adoption of a process, ``read(trust_digests=True)``) reads the digest and hairpin sets first
and takes a service whose digest and own chains match its new fragment as held whole, as the slots always are: the
digest is written in the same transaction as the service's entries and slots, so only a hand edit makes them
differ. The entry maps are dumped meanwhile, queued behind, and taken in only when a service the kernel holds
changed or is no longer wanted (its old keys are deleted, ``Adopted.complete``); a restart with nothing changed
gives that read up (``Adopted.settle``) and reads half the elements. Why it matters: the kernel resumes a set's
element dump at each ~32 KB continuation by walking the set again from its start, so one dump of n elements costs
O(n^2) in the kernel (the counting sets are sharded for it, ``setdump``), and ``service-ips``, the biggest (a
counter and a comment per element), was most of a restart's time at 100,000 services (docs/PERFORMANCE.md). What
a restart does not see, an entry edited by hand under its unchanged digest while kproxy was down, is repaired by
the next full sync that reads everything (every later adoption of the process does: a drift repair, one after a
failure, the periodic one) and reported by ``kproxy verify`` (also run after the periodic full sync); while kproxy
runs, the drift watcher (``kproxy.drift``) turns such an edit into a full sync at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from kproxy.model import IPFamily, ServicePortName
from kproxy.nftkernel import Nft
from kproxy.proxier import BackendError
from kproxy.toolkit.cidr import spans
from kproxy.toolkit.nft import elements
from kproxy.toolkit.switching import switch_interval

from . import counters as counters_mod
from . import layout, render, setdump

log = logging.getLogger(__name__)
Tags = tuple[str | None, ...]  # the comments of a chain's rules, in order (None: a rule without one)
Raw = list[tuple[str, list[bytes]]]  # (set, the datagrams of its element dump) per set, unparsed
T = TypeVar("T")


NO_ENTRIES: Mapping[tuple[str, str], str] = MappingProxyType({})


@dataclass(slots=True)
class Service:
    """One service's skeleton as the kernel holds it."""

    digest: str | None = None
    digests_agree: bool = True  # False: more than one digest element names it
    digest_key: str | None = None  # the key of its service-digests element
    #: (map, key) -> verdict; the read-only empty default until an entry is read (a restart's trusting adoption
    #: reads none: an empty dict and list per service were 12 MB at 100,000 service ports)
    entries: Mapping[tuple[str, str], str] = field(default_factory=lambda: NO_ENTRIES)
    firewall: tuple[str, ...] = ()  # firewall-allow keys

    def keys(self) -> dict[tuple[str, str], str | None]:
        """Every (map, key) of its elements: entries with their verdicts, slots and firewall keys (values unknown)."""
        out: dict[tuple[str, str], str | None] = dict(self.entries)
        for (mapname, key), verdict in self.entries.items():
            comps = key.split(" . ")
            proto = comps[1] if mapname == layout.SERVICE_IPS and len(comps) > 1 else comps[0]
            target = verdict[5:] if verdict.startswith("goto ") else ""
            if target.startswith("fw-"):
                target = target[3:]
            parts = target.split("-")
            try:
                if parts[0] in ("lb", "np") and len(parts) == 3:
                    primary = layout.slot_map(layout.BACKENDS if parts[0] == "lb" else layout.NODEPORT_BACKENDS, proto)
                    for i in range(int(parts[2])):
                        out[(primary, f"{key} . {i}")] = None
                elif parts[0] in ("lbl", "npl") and len(parts) == 3:
                    addr = parts[0] == "lbl"
                    primary = layout.slot_map(layout.BACKENDS if addr else layout.NODEPORT_BACKENDS, proto)
                    shortcut = layout.slot_map(
                        layout.SHORTCUT_BACKENDS if addr else layout.NODEPORT_SHORTCUT_BACKENDS, proto
                    )
                    for i in range(int(parts[1])):
                        out[(primary, f"{key} . {i}")] = None
                    for i in range(int(parts[2])):
                        out[(shortcut, f"{key} . {i}")] = None
            except ValueError:
                continue
        for k in self.firewall:
            out[(layout.FIREWALL, k)] = ""
        if self.digest_key is not None:
            out[(layout.SERVICE_DIGESTS, self.digest_key)] = ""
        return out


@dataclass(slots=True)
class Adopted:
    """What adoption read for one family. ``table``: kproxy's table exists; ``layout_ok``: it is this layout (else
    it is replaced whole); ``services`` by comment key; ``chains``: every chain name; ``sets``: every set name."""

    family: IPFamily
    table: bool = False
    layout_ok: bool = False
    services: dict[str, Service] = field(default_factory=dict)
    chains: set[str] = field(default_factory=set)
    rules: dict[str, Tags] = field(default_factory=dict)  # chain -> its rules' comments (layout.rule_tag)
    sets: set[str] = field(default_factory=set)
    hairpin: set[str] = field(default_factory=set)
    context: dict[str, tuple[tuple[int, int], ...] | tuple[str, ...]] = field(default_factory=dict)
    #: --service-counters: reads the counting elements by their entry (``counters.by_entry``), once, when a changed
    #: or stale service needs them (``counting``): the element dump costs seconds at scale, a restart with nothing
    #: changed needs none
    counter_reader: Callable[[], tuple[dict[tuple[str, str], int] | None, str]] | None = None
    _counting: dict[tuple[str, str], list[tuple[str, str]]] | None = None
    seconds: float = 0.0
    #: where the read's time went (``read``: chains, rules, small_sets, dump, parse; ``ready``: wait, group)
    parts: dict[str, float] = field(default_factory=dict)
    #: the entry maps' and the digest set's dumps while they run in the background (``read``), taken in by ``ready``
    pending: Future[dict[str, list[tuple[str, str, str]]]] | None = None
    firewall: list[tuple[str, str]] = field(default_factory=list)  # (comment key, key) of firewall-allow elements
    error: str = ""  # why the services could not be read (the table is then replaced whole)
    #: a restart's adoption (``read(trust_digests=True)``): the entry maps not taken in yet, a service whose digest
    #: and chains match its fragment is held whole; ``complete`` takes them in when a changed or unwanted service
    #: needs its old keys (``entries_pending``: their read in the background meanwhile, given up by ``settle``)
    trusting: bool = False
    entries_pending: Future[Raw] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    reread: Callable[[], Raw] | None = None  # the entry maps' dumps again, when the background read was given up
    #: what the netlink element dumps taken in read: ``datagrams``, ``elements`` (the bench's figures)
    counts: dict[str, int] = field(default_factory=dict)
    #: a trusting adoption's services that only a digest names, by comment key: ``<digest key>#<digest>`` in one
    #: string (``_trusted``) rather than a ``Service`` and three strings (12 MB at 100,000 service ports), made
    #: ``Service`` objects when ``complete`` takes the entry maps in; every other service (firewall keys, digests
    #: that disagree) is in ``services``
    trusted: dict[str, str] = field(default_factory=dict)

    def complete(self) -> None:
        """Take in the entry maps of a trusting adoption (its background read, or a new one when that was given
        up) and merge them into the services the digests gave (``_take_entries``); a no-op otherwise. BackendError
        when the read fails (the sync fails; the next full sync adopts again, reading everything)."""
        if not self.ready() or not self.trusting:
            return
        self.trusting = False
        pending, self.entries_pending = self.entries_pending, None
        t0 = time.perf_counter()
        try:
            if pending is not None and not self.cancel.is_set():
                raw = pending.result()
            elif self.reread is not None:
                raw = self.reread()
            else:
                raise OSError("no read of the entry maps")
            t1 = time.perf_counter()
            got = _parsed(self.family, raw, self.counts)
        except Exception as exc:  # noqa: BLE001 - any failure of the read fails this sync, not the process
            fam = render.nft_family(self.family)
            raise BackendError(f"reading the entry maps of kproxy's {fam} table: {exc!r}") from exc
        self.parts.update(entries_wait=t1 - t0, entries_parse=time.perf_counter() - t1)
        _take_entries(self, got)

    def settle(self) -> None:
        """A trusting adoption whose entries nothing needed: give up their background read, which would otherwise
        hold libnftables' worker thread (the next transaction's) for seconds at scale, and let go of what it read
        (its datagrams, ~12 MB at 100,000 service ports, would stay until the sync ends: ``complete`` reads again)."""
        if self.trusting:
            self.cancel.set()
            self.entries_pending = None

    def held(self, ckey: str) -> bool:
        """Whether the kernel holds something of the service with comment key ``ckey`` (its digest, entries or
        firewall elements as read so far)."""
        self.ready()
        return ckey in self.services or ckey in self.trusted

    def all_wanted(self, comments: Iterable[str]) -> bool:
        """Whether every service the kernel holds (as read so far) is one of ``comments``, each a wanted service
        port's comment key (unique: one per service port): counted, not a set of 100,000 keys made (4 MB)."""
        self.ready()
        services, trusted = self.services, self.trusted
        found = sum(1 for c in comments if c in services or c in trusted)
        return found == len(services) + len(trusted)

    def ckeys(self) -> Iterator[str]:
        """The comment key of every service the kernel holds something of (as read so far)."""
        self.ready()
        yield from self.services
        yield from self.trusted

    def ready(self) -> bool:
        """Whether the table can be adopted (this layout, and its services read), after taking in the background
        read of its services if it ran (waiting for it). A failed read leaves ``layout_ok`` False: the table is
        replaced whole, as when nothing could be read."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            t0 = time.perf_counter()
            try:
                dumped = pending.result()
            except Exception as exc:  # noqa: BLE001 - any failure of the read leaves the table unadoptable
                self.error = f"netlink element dump of kproxy's {render.nft_family(self.family)} table: {exc!r}"
                log.warning("%s: %s: the table will be replaced", self.family.value, self.error)
                self.layout_ok = False
                dumped = None
                self.settle()  # a table replaced whole needs no entry
                self.trusting = False
            self.parts["wait"] = time.perf_counter() - t0
            if dumped is not None:
                _take_services(self, dumped)
        return self.layout_ok

    def counting(self) -> dict[tuple[str, str], list[tuple[str, str]]]:
        """The counting elements the kernel holds, by entry (empty without counters). BackendError when the read
        fails (the sync fails, and the next full sync adopts again)."""
        if self._counting is None:
            self._counting = {}
            if self.counter_reader is not None:
                held, err = self.counter_reader()
                if held is None:
                    self._counting = None
                    raise BackendError(f"reading the counting sets: {err}")
                self._counting = counters_mod.by_entry(held)
        return self._counting

    def service(self, spn: ServicePortName) -> Service | None:
        """What the kernel holds of ``spn`` (None: nothing); a trusting adoption takes in the entry maps first when
        it holds something (a changed service is rewritten from its old keys)."""
        ckey = layout.comment_key(render.service_key(spn))
        if self.held(ckey) and self.trusting:
            self.complete()
        return self.services.get(ckey)

    def get(self, spn: ServicePortName) -> Service | None:
        return self.service(spn)

    def service_chains(self, sid: str) -> list[str]:
        marks = (f"-{sid}-", f"-{sid}")
        return [c for c in self.chains if layout.is_service_chain(c) and any(m in c for m in marks)]

    def service_sets(self, sid: str) -> list[str]:
        return [s for s in self.sets if s.startswith(f"aff-{sid}-")]

    def chains_hold(self, frag: render.Fragment) -> bool:
        """Whether the kernel holds every per-service chain of ``frag`` with exactly its rules."""
        return all(self.rules.get(name, ()) == tags(rules) for name, rules in frag.chains)

    def unchanged(self, frag: render.Fragment) -> bool:
        """Whether the kernel holds ``frag`` (its digest, exactly its entries, its own chains). Asked for every
        service port of a full sync: no copy of the entries is made."""
        if self.pending is not None:
            self.ready()
        svc = self.services.get(frag.comment)
        if svc is None and self.trusting:
            packed = self.trusted.get(frag.comment)
            return (
                packed is not None and _digest_is(packed, frag.digest) and (not frag.chains or self.chains_hold(frag))
            )
        if svc is None or not svc.digests_agree or svc.digest != frag.digest:
            return False
        if frag.chains and not self.chains_hold(frag):
            return False
        if self.trusting:  # the digest stands for the entries (a restart: see the module docstring)
            return True
        held, found = svc.entries, 0
        for m, k, v in frag.entries:
            if held.get((m, k)) != v:
                return False
            found += 1
        return found == len(held)


def context_form(name: str, items: Iterable[str]) -> tuple[tuple[int, int], ...] | tuple[str, ...]:
    if name == layout.LOCAL_IFACES:
        return tuple(sorted(i.strip('"') for i in items))
    return spans(items)


def split_comment(comment: str | None) -> tuple[str, str | None]:
    """(service comment key, digest or None) of an element comment."""
    if not comment:
        return "", None
    key, sep, digest = comment.rpartition(" #")
    return (key, digest) if sep else (comment, None)


def read(
    nft: Nft, family: IPFamily, layout_chain: str, counters: bool = False, *, trust_digests: bool = False
) -> tuple[Adopted | None, str]:
    """Read the table of ``family`` (see the module docstring; ``counters``: its counting elements too, one netlink
    dump, ``counters.read_counts``; ``trust_digests``: a restart's adoption, ``Adopted.trusting``); (None, error)
    when a read fails. ``Adopted.parts``: where the time went."""
    fam = render.nft_family(family)
    out = Adopted(family)
    t0 = time.perf_counter()
    objs, err = nft.read(f"list chains {fam}")
    if objs is None:
        return None, err
    for o in objs:
        ch = o.get("chain")
        if ch and ch.get("table") == layout.TABLE:
            out.chains.add(ch["name"])
    if not out.chains:
        # no chain: either no table, or an empty one; a set read tells them apart
        probe, _ = nft.read(f"list set {fam} {layout.TABLE} {layout.LOCAL_CIDRS}")
        out.table = probe is not None
        out.layout_ok = False
        return out, ""
    out.table = True
    t1 = time.perf_counter()
    rules, err = read_rules(nft, family)
    if rules is None:
        return None, err
    out.rules = rules
    out.parts.update(chains=t1 - t0, rules=time.perf_counter() - t1)
    # the fixed chains' rules, not only their names: a flushed table keeps chains, sets and elements, and nothing works
    out.layout_ok = layout_chain in out.chains and not fixed_problems(family, rules, counters)
    if not out.layout_ok:
        return out, ""
    if counters:
        out.counter_reader = lambda: counters_mod.read_counts(nft, family)
    err = _read_small_sets(nft, out)
    if err:
        return None, err
    # the services' elements are dumped where the context lives while the caller renders (the ledger renders every
    # wanted service before its first comparison): taken in by ``ready``
    if not trust_digests:
        out.pending = nft.later(lambda: _prompt(_dump_entries, family, out.parts, DUMPED, out.counts))
    else:
        out.trusting = True
        out.pending = nft.later(lambda: _prompt(_dump_entries, family, out.parts, FIRST, out.counts))
        # queued behind the first: the entry maps, needed only when a service changed or went (``complete``)
        cancel = out.cancel
        out.entries_pending = nft.later(lambda: _raw_entries(family, cancel))
        out.reread = lambda: nft.call(lambda: _raw_entries(family, None))
    # `list sets` formats every element of every set (seconds at scale): affinity sets are named after their
    # endpoint chains instead (ep-<id>-<ep>-<timeout> uses aff-<id>-<ep>-<timeout>)
    out.sets = {"aff-" + c[3:] for c in out.chains if c.startswith("ep-")}
    return out, ""


def _take_services(out: Adopted, dumped: Mapping[str, list[tuple[str, str, str]]]) -> None:
    """The services' entries (when read: not yet in a trusting adoption), digests and firewall elements into
    ``out.services``; a trusting adoption's services that only one digest names into ``out.trusted``."""
    t0 = time.perf_counter()
    services, trusted = out.services, out.trusted
    entries_read = layout.SERVICE_IPS in dumped
    _put_entries(services, dumped)
    for key, _, comment in dumped[layout.SERVICE_DIGESTS]:
        ckey, digest = split_comment(comment)
        svc = services.get(ckey)
        if svc is None and out.trusting:
            if ckey not in trusted:
                trusted[ckey] = _trusted(key, digest)
                continue
            svc = services[ckey] = _service(trusted.pop(ckey))  # named twice: they disagree (below)
        if svc is None:  # a digest without entries: the service is rewritten (its digest element deleted first)
            svc = services[ckey] = Service(digests_agree=not entries_read)
        elif svc.digest_key is not None:
            svc.digests_agree = False
        svc.digest, svc.digest_key = digest, key
    out.hairpin = {key for key, _, _ in dumped[layout.HAIRPIN]}
    for ckey, key in out.firewall:
        svc = services.get(ckey)
        if svc is None:
            packed = trusted.pop(ckey, None)
            svc = services[ckey] = Service(digests_agree=False) if packed is None else _service(packed)
        svc.firewall = (*svc.firewall, key)  # a handful per service
    out.parts["group"] = out.parts.get("group", 0.0) + time.perf_counter() - t0


def _trusted(key: str, digest: str | None) -> str:
    """A service that only its digest element names, as ``Adopted.trusted`` keeps it: the element's key (the
    ``render`` spelling of an address, protocol and port: never a ``#``), then ``#`` and the digest of its comment
    when it has one."""
    return key if digest is None else f"{key}#{digest}"


def _digest_is(packed: str, digest: str) -> bool:
    """Whether ``packed`` (``_trusted``) holds exactly ``digest``, without a copy: it ends with it, right after the
    first ``#``."""
    at = packed.find("#")
    return at >= 0 and at == len(packed) - len(digest) - 1 and packed.endswith(digest)


def _service(packed: str) -> Service:
    """The ``Service`` a ``_trusted`` string stands for (its digest and the key of its digest element)."""
    key, sep, digest = packed.partition("#")
    return Service(digest=digest if sep else None, digest_key=key)


def _untrust(out: Adopted) -> None:
    """The trusted services as ``Service`` objects (before the entry maps are merged in: ``_take_entries``)."""
    services, trusted = out.services, out.trusted
    for ckey, packed in trusted.items():
        services[ckey] = _service(packed)
    trusted.clear()


def _put_entries(services: dict[str, Service], dumped: Mapping[str, list[tuple[str, str, str]]]) -> None:
    """The entry maps' elements, each into its service's entries (a dict of its own, made at its first entry)."""
    for name in ENTRY_MAPS:
        for key, value, comment in dumped.get(name, ()):
            ckey, _ = split_comment(comment)
            svc = services.get(ckey)
            if svc is None:
                svc = services[ckey] = Service(entries={})
            elif not isinstance(svc.entries, dict):
                svc.entries = {}
            entries = svc.entries
            assert isinstance(entries, dict)  # made here, never the shared empty one
            entries[(name, key)] = value


def _take_entries(out: Adopted, dumped: Mapping[str, list[tuple[str, str, str]]]) -> None:
    """A trusting adoption's entry maps, read once something needed them, into the services its digest set gave:
    what ``_take_services`` makes of every dump at once, without keeping the digest set's dump until then (14 MB
    at 100,000 service ports): a digest whose service has no entry disagrees, as one read with the entries does."""
    t0 = time.perf_counter()
    _untrust(out)
    services = out.services
    _put_entries(services, dumped)
    for svc in services.values():
        if svc.digest_key is not None and not svc.entries:
            svc.digests_agree = False
    out.parts["group"] = out.parts.get("group", 0.0) + time.perf_counter() - t0


def _read_small_sets(nft: Nft, out: Adopted) -> str:
    """The firewall and context sets through libnftables (a few elements each); the error, or ""."""
    t0 = time.perf_counter()
    fam = render.nft_family(out.family)
    objs, err = nft.read(f"list set {fam} {layout.TABLE} {layout.FIREWALL}")
    if objs is None:
        return err
    out.firewall = [(split_comment(el.comment)[0], el.key) for el in elements(objs)]
    for name in layout.CONTEXT_SETS:
        objs, err = nft.read(f"list set {fam} {layout.TABLE} {name}")
        if objs is None:
            return err
        out.context[name] = context_form(name, [el.key for el in elements(objs)])
    out.parts["small_sets"] = time.perf_counter() - t0
    return ""


#: the elements adoption reads over netlink (``setdump``) rather than through libnftables: one per service address
#: or NodePort each, and one per local endpoint (hairpin); the rest of what it reads is a handful of elements
DUMPED = (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS, layout.SERVICE_DIGESTS, layout.HAIRPIN)
#: a restart's adoption reads these first (one element per service port, one per local endpoint) ...
FIRST = (layout.SERVICE_DIGESTS, layout.HAIRPIN)
#: ... and the entry maps only when a changed or unwanted service needs its old keys (``Adopted.complete``)
ENTRY_MAPS = (layout.SERVICE_IPS, layout.SERVICE_NODEPORTS)


def key_text(family: IPFamily, setname: str, raw: bytes) -> str:
    """A ``DUMPED`` element's key from its bytes, spelled as ``render`` writes it (``198.19.0.1 . tcp . 80``,
    ``tcp . 30080``, a hairpin's ``198.18.1.2 . 198.18.1.2``)."""
    if setname == layout.HAIRPIN:
        af, n = (socket.AF_INET, 4) if family is IPFamily.V4 else (socket.AF_INET6, 16)
        return f"{socket.inet_ntop(af, raw[:n])} . {socket.inet_ntop(af, raw[n : 2 * n])}"
    return counters_mod.entry_text(family, raw, setname != layout.SERVICE_NODEPORTS)


def read_entries(
    nft: Nft, family: IPFamily, parts: dict[str, float] | None = None
) -> tuple[dict[str, list[tuple[str, str, str]]] | None, str]:
    """The elements of the entry maps and the digest set (``DUMPED``), name -> (key as ``render`` spells it,
    verdict or "", comment), one netlink element dump each on one socket, where ``nft``'s context lives; (None,
    error) when a dump fails (a set missing, the socket). ``parts`` gets the seconds in the dumps (``dump``: the
    kernel and the socket) and in parsing them (``parse``)."""
    try:
        return nft.call(lambda: _dump_entries(family, parts)), ""
    except OSError as exc:
        return None, f"netlink element dump of kproxy's {render.nft_family(family)} table: {exc}"


#: the interpreter's thread switch interval while the services' read runs beside the render (``_prompt``)
SWITCH_S = 0.0005


def _prompt(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with the interpreter's thread switch interval cut to ``SWITCH_S`` meanwhile: a dump's thread
    needs the GIL back after each ~32 KB datagram while the ledger renders in the main thread, and at the default 5 ms
    those waits added up to about the kernel's own time (a 100,000-element dump is ~230 datagrams). The render is
    interrupted as often either way (once per datagram), only sooner."""
    with switch_interval(SWITCH_S):
        return fn(*args)


def _dump_entries(
    family: IPFamily,
    parts: dict[str, float] | None,
    names: Sequence[str] = DUMPED,
    counts: dict[str, int] | None = None,
) -> dict[str, list[tuple[str, str, str]]]:
    """``read_entries`` of ``names`` in the calling thread's namespace (OSError when a dump fails); ``counts`` gets
    the datagrams and elements read."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    parse, t0 = 0.0, time.perf_counter()
    for name, chunks in setdump.raw_dumps(family, names):
        p0 = time.perf_counter()
        out.update(_parsed(family, [(name, chunks)], counts))
        parse += time.perf_counter() - p0
    if parts is not None:
        parts.update(dump=time.perf_counter() - t0 - parse, parse=parse)
    return out


def _parsed(family: IPFamily, raw: Raw, counts: dict[str, int] | None) -> dict[str, list[tuple[str, str, str]]]:
    """Ended dumps (``setdump.raw_dumps``) as ``read_entries`` returns them; ``counts`` gets what was read."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for name, chunks in raw:
        got, _ = setdump.parse_elements(name, chunks)
        out[name] = [(key_text(family, name, k), v, c) for k, v, c in got]
        if counts is not None:
            counts["datagrams"] = counts.get("datagrams", 0) + len(chunks)
            counts["elements"] = counts.get("elements", 0) + len(got)
    return out


def _raw_entries(family: IPFamily, cancel: threading.Event | None) -> Raw:
    """The entry maps' datagrams, unparsed (a trusting adoption parses them only if it needs them: no GIL taken
    from the render meanwhile but one append per datagram); setdump.Cancelled once ``cancel`` is set."""
    return list(setdump.raw_dumps(family, ENTRY_MAPS, cancel))


def tags(rules: Sequence[str]) -> Tags:
    """The comments kproxy writes on ``rules`` (``layout.rule_tag``): what a chain holding them exactly reads back."""
    return tuple(layout.rule_tag(r) for r in rules)


def read_rules(nft: Nft, family: IPFamily) -> tuple[dict[str, Tags] | None, str]:
    """Chain -> the comments of its rules, in order, for kproxy's table (chains without rules are absent)."""
    got, err = nft.rule_comments(render.nft_family(family), layout.TABLE)
    if got is None:
        return None, err
    return {chain: tuple(found) for chain, found in got.items()}, ""


def fixed_problems(family: IPFamily, rules: Mapping[str, Tags], counters: bool = False) -> list[str]:
    """How the fixed chains' rules in the kernel differ from the layout's ([] when they are exactly it)."""
    out: list[str] = []
    for chain, wanted in layout.fixed_chain_rules(family, counters).items():
        held = rules.get(chain, ())
        if held != tags(wanted):
            out.append(
                f"chain {chain} holds {len(held)} of its {len(wanted)} rules"
                if len(held) != len(wanted)
                else f"chain {chain}: its rules differ"
            )
    return out


def shared_ok(name: str, family: IPFamily, rules: Mapping[str, Tags]) -> bool:
    """Whether the kernel holds shared chain ``name`` with exactly the rules its name stands for."""
    try:
        return rules.get(name, ()) == tags(layout.shared_chain_rules(name, family))
    except ValueError:
        return False


def wanted_context(ctx_elements: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    return {name: context_form(name, items) for name, items in ctx_elements.items()}
