"""The bpf mode's nftables companion table (``kproxy-bpf`` in ``ip`` and ``ip6``): its commands, running its
transactions, reading it back, and the per-family state that decides when it exists.

The table carries only what the socket programs cannot see (packets that do not start in a socket of the node's
cgroup: external clients to NodePorts, externalIPs and load-balancer IPs, forwarded packets to a ClusterIP with no
endpoints); see ``backends/bpf/__init__.py`` for why it is nftables and not a tc program. It exists only while some
service has a part in it: its nat chains and ct rules turn conntrack on for every packet of the namespace.

libnftables runs in-process through the core's ``kproxy.nftkernel``: the process's shared context in its own
network namespace, a worker thread in a named one (tests). Transactions are small (a service's elements), so neither
is on the hot path of a sync of plain ClusterIP services, which never touches this table.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kproxy.batch import Batch
from kproxy.model import IPFamily, ServicePortName
from kproxy.nftkernel import Nft
from kproxy.toolkit.nft import delete_text, nft_family
from kproxy.toolkit.nft import elements as nft_elements

from .render import MASQ_LABEL, Fragment, NftPart

log = logging.getLogger(__name__)

TABLE = "kproxy-bpf"
#: bumped when the companion table's fixed part changes (its chains carry it in a comment)
NFT_LAYOUT = "kproxy-bpf-nft-2"
NODEPORT_CIDRS = "nodeport-cidrs"
#: rules each fixed chain holds (``fixed_commands``); fewer: someone flushed it
FIXED_RULES = {"kp-reject": 1, "services": 2, "nat-prerouting": 1, "nat-output": 1, "nat-postrouting": 1}


# ------------------------------------------------------------------------------------------------ commands


def nodeport_cidr_commands(family: IPFamily, cidrs: Iterable[str]) -> list[str]:
    """The ``nodeport-cidrs`` set emptied and filled with ``cidrs`` (one transaction's commands)."""
    t = f"{nft_family(family)} {TABLE}"
    items = list(cidrs)
    return [f"flush set {t} {NODEPORT_CIDRS}"] + (
        [f"add element {t} {NODEPORT_CIDRS} {{ {', '.join(items)} }}"] if items else []
    )


def fixed_commands(family: IPFamily) -> list[str]:
    """The companion table's fixed part (idempotent: ``add`` of what exists is a no-op); the ``nodeport-cidrs``
    elements come from the context (``nodeport_cidr_commands``)."""
    ip = nft_family(family)
    addr = "ipv4_addr" if family == IPFamily.V4 else "ipv6_addr"
    t = f"{ip} {TABLE}"
    return [
        f"add table {t}",
        f"add map {t} svc {{ type {addr} . inet_proto . inet_service : verdict ; }}",
        f"add map {t} nodeports {{ type inet_proto . inet_service : verdict ; }}",
        f"add set {t} {NODEPORT_CIDRS} {{ type {addr} ; flags interval ; }}",
        f"add chain {t} kp-reject",
        f'add chain {t} services {{ comment "{NFT_LAYOUT}" ; }}',
        f"add chain {t} nat-prerouting {{ type nat hook prerouting priority dstnat ; policy accept ; }}",
        f"add chain {t} nat-output {{ type nat hook output priority -100 ; policy accept ; }}",
        f"add chain {t} nat-postrouting {{ type nat hook postrouting priority srcnat ; policy accept ; }}",
        f"flush chain {t} kp-reject",
        f"flush chain {t} services",
        f"flush chain {t} nat-prerouting",
        f"flush chain {t} nat-output",
        f"flush chain {t} nat-postrouting",
        f"add rule {t} kp-reject reject",
        f"add rule {t} services {ip} daddr . meta l4proto . th dport vmap @svc",
        f"add rule {t} services {ip} daddr @{NODEPORT_CIDRS} fib daddr type local meta l4proto . th dport"
        " vmap @nodeports",
        f"add rule {t} nat-prerouting jump services",
        f"add rule {t} nat-output jump services",
        f"add rule {t} nat-postrouting ct label {MASQ_LABEL} masquerade fully-random",
    ]


def nft_changes(family: IPFamily, old: NftPart | None, new: NftPart | None) -> tuple[list[str], list[str], list[str]]:
    """The commands that turn one service's companion part into another, in three phases that a transaction runs in
    order across services: (chains added or rewritten, elements deleted then added, chains deleted)."""
    t = f"{nft_family(family)} {TABLE}"
    o = old or NftPart()
    n = new or NftPart()
    first: list[str] = []
    mid: list[str] = []
    last: list[str] = []
    old_chains = dict(o.chains)
    for name, rules in n.chains:
        if name in old_chains:
            continue  # the name carries the digest of the rules
        first.append(f"add chain {t} {name}")
        first += [f"add rule {t} {name} {r}" for r in rules]
    new_elems = set(n.elements)
    old_elems = set(o.elements)
    for m, k, v in o.elements:
        if (m, k, v) not in new_elems:
            mid.append(f"delete element {t} {m} {{ {k} }}")
    for m, k, v in n.elements:
        if (m, k, v) not in old_elems:
            mid.append(f"add element {t} {m} {{ {k} : {v} }}")
    new_names = {name for name, _ in n.chains}
    for name in old_chains:
        if name not in new_names:
            last.append(f"delete chain {t} {name}")
    last.sort(key=lambda c: 0 if " f-" in c else 1)  # a firewall chain jumps to its service chain: it goes first
    return first, mid, last


def group_elements(commands: list[str]) -> list[str]:
    """Element commands merged into one ``delete element`` and one ``add element`` command per map, deletes first
    (nft parses and commits one command with many elements far faster than many commands: a batch of 900 services
    that gained endpoints is two commands, not 900). Other commands are kept, in order, before them."""
    other: list[str] = []
    dels: dict[str, list[str]] = {}
    adds: dict[str, list[str]] = {}
    for c in commands:
        verb = "delete" if c.startswith("delete element ") else "add" if c.startswith("add element ") else None
        if verb is None or "{" not in c:
            other.append(c)
            continue
        head, _, body = c.partition(" { ")
        (dels if verb == "delete" else adds).setdefault(head.split(" ", 2)[2], []).append(body.rstrip(" }"))
    out = list(other)
    out += [f"delete element {m} {{ {', '.join(items)} }}" for m, items in dels.items()]
    out += [f"add element {m} {{ {', '.join(items)} }}" for m, items in adds.items()]
    return out


# ------------------------------------------------------------------------------------------------ the kernel


class NftError(RuntimeError):
    pass


def open_nft(netns: str | None) -> Nft:
    """A libnftables context for ``netns`` (``kproxy.nftkernel``), ~13 ms to make (libnftables loads its caches), a
    command through it ~0.1 ms: its owner keeps it and closes it."""
    return Nft(netns, worker=False, name=f"kpb-nft-{netns}" if netns else "kpb-nft")


def run(nft: Nft, text: str, *, json_out: bool = False) -> str:
    """Run ``text`` as one nft transaction (or a listing); the output; NftError with nft's message on failure."""
    listing = text.startswith("list ") and "\n" not in text.strip()
    res = nft.query(text, json_output=json_out) if listing else nft.run(text, json_output=json_out)
    if not res.ok:
        raise NftError(res.error.strip() or f"nft failed ({res.rc})")
    return res.output


@dataclass(frozen=True, slots=True)
class NftView:
    """What the companion table of one family holds: chain names and map elements as (map, key, verdict) text, in
    the spelling ``render.render_nft`` uses. ``present`` is False when there is no table. ``rules``: how many rules
    each chain holds (a table someone flushed keeps its chains and map elements but no rule); empty when not read."""

    present: bool
    chains: frozenset[str]
    elements: frozenset[tuple[str, str, str]]
    rules: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: interval sets (``nodeport-cidrs``): name -> elements as collapsed CIDR text (``render.nodeport_cidrs``'
    #: spelling); None when not read. A table without the set is of an older layout (its NodePort rule has no
    #: address match) and is written again whole.
    sets: Mapping[str, tuple[str, ...]] | None = None


def read(nft: Nft, family: IPFamily) -> NftView:
    """The table's chains and elements (one listing of a small table)."""
    try:
        out = run(nft, f"list table {nft_family(family)} {TABLE}", json_out=True)
    except NftError as exc:
        if "No such file" in str(exc) or "does not exist" in str(exc):
            return NftView(False, frozenset(), frozenset())
        raise
    doc = json.loads(out or "{}")
    chains: set[str] = set()
    elements: set[tuple[str, str, str]] = set()
    rules: dict[str, int] = {}
    sets: dict[str, tuple[str, ...]] = {}
    for item in doc.get("nftables", []):
        if "chain" in item:
            chains.add(item["chain"]["name"])
            rules.setdefault(item["chain"]["name"], 0)
        elif "rule" in item:
            name = item["rule"].get("chain", "")
            rules[name] = rules.get(name, 0) + 1
        elif "set" in item:
            st = item["set"]
            sets[st["name"]] = _cidrs(st.get("elem", []) or [])
        elif "map" in item:
            elements.update((el.set, el.key, el.value) for el in nft_elements([item]))
    return NftView(True, frozenset(chains), frozenset(elements), MappingProxyType(rules), MappingProxyType(sets))


def _cidrs(elems: list[Any]) -> tuple[str, ...]:
    """An interval set's JSON elements (addresses, ``prefix`` and ``range`` objects) as collapsed CIDR text."""
    nets: list[Any] = []
    for e in elems:
        if isinstance(e, dict) and "elem" in e:
            e = e["elem"].get("val")
        try:
            if isinstance(e, str):
                nets.append(ipaddress.ip_network(e))
            elif isinstance(e, dict) and "prefix" in e:
                nets.append(ipaddress.ip_network(f"{e['prefix']['addr']}/{e['prefix']['len']}"))
            elif isinstance(e, dict) and "range" in e:
                lo, hi = (ipaddress.ip_address(x) for x in e["range"])
                nets += list(ipaddress.summarize_address_range(lo, hi))  # type: ignore[arg-type]
        except (ValueError, TypeError, KeyError):
            continue
    try:
        collapsed = list(ipaddress.collapse_addresses(nets))
    except TypeError:  # mixed versions: not a set of ours
        return ()
    return tuple(str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n) for n in collapsed)


def table_present(nft: Nft, family: IPFamily) -> bool:
    """Whether the family's companion table exists: ``list tables`` fetches table names only (no chain, rule or
    element), so the bpf mode's check every second stays cheap however big the table is."""
    out = run(nft, f"list tables {nft_family(family)}")
    return any(ln.split()[-1:] == [TABLE] for ln in out.splitlines())


def delete_table(nft: Nft, family: IPFamily) -> None:
    """Remove the family's companion table (nothing when it does not exist)."""
    run(nft, delete_text(nft_family(family), TABLE))


# ------------------------------------------------------------------------------------------------ the state


class Companion:
    """The companion table of each family as one kproxy keeps it: which services have a part in it (the table
    exists only while some do), whether its fixed part is known to be there, the ``nodeport-cidrs`` elements
    written (None: unknown). Runner thread only."""

    def __init__(self, families: Iterable[IPFamily], netns: str | None) -> None:
        self.netns = netns
        self.families = tuple(families)
        self.users: dict[IPFamily, set[ServicePortName]] = {f: set() for f in self.families}
        self.ready: dict[IPFamily, bool] = {f: False for f in self.families}
        self.cidrs: dict[IPFamily, tuple[str, ...] | None] = {f: None for f in self.families}
        self._nft: Nft | None = None

    @property
    def nft(self) -> Nft:
        """This kproxy's libnftables context for the table, made at first use."""
        if self._nft is None:
            self._nft = open_nft(self.netns)
        return self._nft

    def close(self) -> None:
        if self._nft is not None:
            self._nft.close()
            self._nft = None

    def forget(self) -> None:
        for f in self.families:
            self.users[f] = set()
            self.ready[f] = False
            self.cidrs[f] = None

    def lost(self, family: IPFamily) -> bool:
        """Whether the table was there after kproxy's last write and is gone now (``list tables``: cheap)."""
        if self.ready[family] and not table_present(self.nft, family):
            self.ready[family] = False
            return True
        return False

    def checked(self, family: IPFamily, applied: Mapping[ServicePortName, Fragment]) -> tuple[NftView, str | None]:
        """The table as read, less the chains that lost rules (a flushed table keeps chains and elements, not rules):
        a fixed chain short of rules drops ``services`` (the fixed part is written again), a service chain whose
        rule count differs from what its (digest-named) rules say is written again; and why, if so."""
        v = read(self.nft, family)
        if not v.present:
            return v, None
        drop: set[str] = set()
        why = None
        short = [c for c, n in FIXED_RULES.items() if v.rules.get(c, 0) != n]
        if short:
            drop.add("services")
            why = f"companion chain {short[0]} holds {v.rules.get(short[0], 0)} rules, wanted {FIXED_RULES[short[0]]}"
        # a chain's name carries the digest of its rules, so any fragment naming it says how many it holds; a chain
        # no applied service names is left as it is (a full sync deletes it when nobody wants it)
        want = {c: len(rules) for frag in applied.values() for c, rules in frag.nft.chains}
        drop.update(c for c in v.chains if c in want and v.rules.get(c, 0) != want[c])
        if not drop:
            return v, None
        return NftView(True, v.chains - drop, v.elements, v.rules), why

    def apply(
        self,
        batch: Batch[Fragment, Any, Any, Any],
        view: NftView | None,
        trusted: Mapping[ServicePortName, Fragment] | None,
    ) -> None:
        """The table's share of a batch. ``view``: what adoption read of the table (None: not read); ``trusted``:
        the fragments the ledger records as applied when adoption trusted kproxy's own index instead of reading the
        kernel. Raises NftError."""
        fam = batch.family
        self._update_users(batch)
        cidrs: tuple[str, ...] = batch.context.nodeport_cidrs
        if not self.users[fam]:
            self._remove(batch, view, trusted)
            return
        if batch.full:
            first, mid, last = self._full_commands(batch, self._full_view(fam, view, trusted), cidrs)
        else:
            first, mid, last = [], [], []
            for d in batch.deltas:
                o = d.old_fragment.nft if d.old_fragment is not None else None
                n = d.new_fragment.nft if d.new_fragment is not None else None
                if (o is None or o.empty) and (n is None or n.empty):
                    continue
                a, b, c = nft_changes(fam, o, n)
                first += a
                mid += b
                last += c
            if (first or mid or last) and not self.ready[fam]:
                first = fixed_commands(fam) + nodeport_cidr_commands(fam, cidrs) + first
        if not (first or mid or last):
            return
        # deletes before adds inside the element phase: a changed element is deleted, then added
        mid = group_elements(mid)
        # a firewall chain jumps to its service chain: it goes first, or the kernel refuses (EBUSY)
        last.sort(key=lambda c: 0 if " f-" in c else 1)
        run(self.nft, "\n".join(first + mid + last) + "\n")
        self.ready[fam] = True
        self.cidrs[fam] = cidrs

    def _update_users(self, batch: Batch[Fragment, Any, Any, Any]) -> None:
        users = self.users[batch.family]
        if batch.full:
            users.clear()
            users.update(n for n, f in batch.wanted.items() if not f.nft.empty)
            return
        for d in batch.deltas:
            if d.new_fragment is not None and not d.new_fragment.nft.empty:
                users.add(d.name)
            else:
                users.discard(d.name)

    def _remove(
        self,
        batch: Batch[Fragment, Any, Any, Any],
        view: NftView | None,
        trusted: Mapping[ServicePortName, Fragment] | None,
    ) -> None:
        """No service has a part: the table goes (when it is there)."""
        fam = batch.family
        if batch.full and view is not None and trusted is None:
            present = view.present
        elif batch.full and view is None:
            present = table_present(self.nft, fam)
        else:
            present = self.ready[fam]
        if present:
            delete_table(self.nft, fam)
        self.ready[fam] = False
        self.cidrs[fam] = None

    def _full_view(
        self, fam: IPFamily, view: NftView | None, trusted: Mapping[ServicePortName, Fragment] | None
    ) -> NftView:
        """What a full batch compares with: the table as read, or (adoption trusted the index) what the applied
        fragments say it holds."""
        if view is not None and trusted is not None:
            chains: set[str] = set()
            elems: set[tuple[str, str, str]] = set()
            for frag in trusted.values():
                chains.update(c for c, _ in frag.nft.chains)
                elems.update(frag.nft.elements)
            base = {"services"} if view.present else set()
            return NftView(view.present, frozenset(chains | base), frozenset(elems))
        return view if view is not None else read(self.nft, fam)

    def _full_commands(
        self, batch: Batch[Fragment, Any, Any, Any], view: NftView, cidrs: tuple[str, ...]
    ) -> tuple[list[str], list[str], list[str]]:
        """A full batch's commands in three phases: the fixed part and chains, element changes, chains deleted."""
        fam = batch.family
        t = f"{nft_family(fam)} {TABLE}"
        first: list[str] = []
        mid: list[str] = []
        last: list[str] = []
        want_chains: dict[str, tuple[str, ...]] = {}
        want_elems: set[tuple[str, str, str]] = set()
        for frag in batch.wanted.values():
            want_chains.update(frag.nft.chains)
            want_elems.update(frag.nft.elements)
        if view.present and view.sets is not None and NODEPORT_CIDRS not in view.sets:
            # an older layout (its NodePort rule matched any local address, loopback too): written again whole
            first += [f"add table {t}", f"delete table {t}"]
            view = NftView(False, frozenset(), frozenset())
        elif view.sets is not None:
            self.cidrs[fam] = view.sets.get(NODEPORT_CIDRS)
        if not view.present or not self.ready[fam] or "services" not in view.chains:
            first += fixed_commands(fam)
            self.cidrs[fam] = None if view.present else ()
        if self.cidrs[fam] != cidrs:
            first += nodeport_cidr_commands(fam, cidrs)
        for name, rules in want_chains.items():
            if name not in view.chains:
                # flushed too: a chain someone emptied (or cut short) gets its rules once, not appended twice
                first += [f"add chain {t} {name}", f"flush chain {t} {name}"]
                first += [f"add rule {t} {name} {r}" for r in rules]
        want_keys = {(m, k): v for m, k, v in want_elems}
        for m, k, v in view.elements:
            if want_keys.get((m, k)) != v:
                mid.append(f"delete element {t} {m} {{ {k} }}")
        for m, k, v in want_elems:
            if (m, k, v) not in view.elements:
                mid.append(f"add element {t} {m} {{ {k} : {v} }}")
        for name in view.chains:
            if (name.startswith("s-") or name.startswith("f-")) and name not in want_chains:
                last.append(f"delete chain {t} {name}")
        return first, mid, last
