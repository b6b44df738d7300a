"""Transactions of kproxy's nftables layout (pure): fragment changes in, one ``nft -f`` transaction's text out.

``Transaction`` gathers one transaction for one family in the order libnftables needs (declarations, chain
contents, element deletes, element adds, removals), with every element of a map in one command and every line
recorded as its service's, so a refused line names the service to leave out. ``change_service`` adds what turns one
service's old fragment into its new one (or what the kernel's skeleton of it shows, after a restart); a full sync
into an empty table writes each fragment straight from its packed text (``Transaction.add_fragment``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import IPFamily, ServicePortName

from .fragment import ENTRY_MAPS, Element, Fragment, parse_elements, single_entry, split_line, unpack
from .layout import (
    FAM,
    FIREWALL,
    SERVICE_DIGESTS,
    SERVICE_IPS,
    SERVICE_NODEPORTS,
    TABLE,
    comment_key,
    rule_command,
    shared_chain_rules,
)

Owner = ServicePortName | None


@dataclass(slots=True)
class _Group:
    """The elements of one map in one ``add element`` / ``delete element`` command: their lines and, line for line,
    the service each belongs to (two lists, not a tuple per element: a full sync writes millions)."""

    texts: list[str] = field(default_factory=list)
    owners: list[Owner] = field(default_factory=list)


@dataclass(slots=True)
class Transaction:
    """One atomic ``nft`` transaction for one family, built in order: declarations, chain contents, element
    deletes, element adds, removals. Elements are grouped into one ``add element`` / ``delete element`` command per
    map with one element per line (thousands of small commands cost libnftables far more than one long one), and
    every line that belongs to one service is recorded as its, so a refused element (libnftables names its line)
    names the service to leave out."""

    family: IPFamily
    head: list[str] = field(default_factory=list)  # table, maps, fixed chains, context sets
    declare: list[tuple[str, Owner]] = field(default_factory=list)  # chains and sets to create
    fill: list[tuple[str, Owner]] = field(default_factory=list)  # chain rules
    deletes: dict[str, _Group] = field(default_factory=dict)  # map -> keys
    adds: dict[str, _Group] = field(default_factory=dict)  # map -> elements
    tail: list[tuple[str, Owner]] = field(default_factory=list)  # chain and set removals
    elements_added: int = 0
    elements_deleted: int = 0

    @property
    def fam(self) -> str:
        return FAM[self.family]

    def _grouped(self, verb: str, groups: dict[str, _Group]) -> list[tuple[str, Owner]]:
        out: list[tuple[str, Owner]] = []
        for m, g in groups.items():
            if not g.texts:
                continue
            out.append((f"{verb} element {self.fam} {TABLE} {m} {{", None))
            last = len(g.texts) - 1
            out.extend((text if i == last else text + ",", g.owners[i]) for i, text in enumerate(g.texts))
            out.append(("}", None))
        return out

    def _grouped_text(self, verb: str, groups: dict[str, _Group]) -> list[str]:
        """``_grouped``'s lines as text, without a tuple per line."""
        return [
            f"{verb} element {self.fam} {TABLE} {m} {{\n" + ",\n".join(g.texts) + "\n}\n"
            for m, g in groups.items()
            if g.texts
        ]

    def lines(self) -> list[tuple[str, Owner]]:
        return (
            [(h, None) for h in self.head]
            + self.declare
            + self.fill
            + self._grouped("delete", self.deletes)
            + self._grouped("add", self.adds)
            + self.tail
        )

    def text(self) -> str:
        """``lines()`` as one text, one line each."""
        parts = [h + "\n" for h in self.head]
        parts += [line + "\n" for line, _ in (*self.declare, *self.fill)]
        parts += self._grouped_text("delete", self.deletes)
        parts += self._grouped_text("add", self.adds)
        parts += [line + "\n" for line, _ in self.tail]
        return "".join(parts)

    def line_count(self) -> int:
        """The lines of ``text()``, without making it."""
        groups = sum(len(g.texts) + 2 for g in (*self.deletes.values(), *self.adds.values()) if g.texts)
        return len(self.head) + len(self.declare) + len(self.fill) + groups + len(self.tail)

    def owner_of(self, lineno: int) -> Owner:
        """The service owning 1-based line ``lineno`` of ``text()``."""
        lines = self.lines()
        return lines[lineno - 1][1] if 0 < lineno <= len(lines) else None

    def empty(self) -> bool:
        return not (self.head or self.declare or self.fill or self.deletes or self.adds or self.tail)

    # -- building blocks

    def _group(self, groups: dict[str, _Group], m: str) -> _Group:
        g = groups.get(m)
        if g is None:
            g = groups[m] = _Group()
        return g

    def add_elements(self, elements: Iterable[Element], comment: str | None, owner: Owner) -> None:
        c = f' comment "{comment}"' if comment else ""
        for m, k, v in elements:
            g = self._group(self.adds, m)
            g.texts.append(f"{k}{c} : {v}" if v else f"{k}{c}")
            g.owners.append(owner)
            self.elements_added += 1

    def add_fragment(self, frag: Fragment, owner: Owner) -> None:
        """Every element of ``frag`` into an empty place (a full sync into an empty table): its slots and other
        uncommented elements first, then its firewall elements, its entries, its digest (commented), each from its
        line (``fragment.unpack``) without making the tuples."""
        comment = f' comment "{comment_key(frag.key)}"'
        later: list[tuple[str, str]] = []  # firewall elements and entries, commented, in that order
        entries: list[tuple[str, str]] = []
        adds = self.adds
        n = 0
        for line in unpack(frag.text).split("\n"):
            m, _, kv = line.partition("|")
            if m in ENTRY_MAPS:
                entries.append((m, kv))
                continue
            if m == FIREWALL:
                later.append((m, kv))
                continue
            g = adds.get(m) or self._group(adds, m)
            # "key|value" to "key : value"; a set element's "key|" to "key" (no key or value holds a "|")
            g.texts.append(kv[:-1] if kv[-1] == "|" else kv.replace("|", " : "))
            g.owners.append(owner)
            n += 1
        for m, kv in (*later, *entries):
            k, _, v = kv.partition("|")
            g = adds.get(m) or self._group(adds, m)
            g.texts.append(f"{k}{comment} : {v}" if v else f"{k}{comment}")
            g.owners.append(owner)
            n += 1
        self.elements_added += n
        self.add_elements(((SERVICE_DIGESTS, frag.digest_key, ""),), frag.digest_comment, owner)

    def delete_keys(self, keys: Iterable[tuple[str, str]], owner: Owner) -> None:
        for m, k in keys:
            g = self._group(self.deletes, m)
            g.texts.append(k)
            g.owners.append(owner)
            self.elements_deleted += 1

    def add_shared_chain(self, name: str, *, exists: bool = False) -> None:
        """Declare and fill a shared chain; ``exists``: the kernel holds it with other rules (edited by hand), which
        are flushed first."""
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", None))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", None))
        self.fill.extend((rule_command(fam, name, r), None) for r in shared_chain_rules(name, self.family))

    def delete_chain(self, name: str, owner: ServicePortName | None) -> None:
        fam = self.fam
        self.tail.append((f"delete chain {fam} {TABLE} {name}", owner))

    def write_chain(self, name: str, rules: Sequence[str], owner: ServicePortName | None, *, exists: bool) -> None:
        fam = self.fam
        self.declare.append((f"add chain {fam} {TABLE} {name}", owner))
        if exists:
            self.fill.append((f"flush chain {fam} {TABLE} {name}", owner))
        self.fill.extend((rule_command(fam, name, r), owner) for r in rules)

    def flush_chain(self, name: str, owner: ServicePortName | None) -> None:
        """Emptied before anything is deleted (a removed service's chains jump to each other)."""
        self.declare.append((f"flush chain {self.fam} {TABLE} {name}", owner))

    def add_set(self, name: str, spec: str, owner: ServicePortName | None) -> None:
        self.declare.insert(0, (f"add set {self.fam} {TABLE} {name} {{ {spec} }}", owner))

    def delete_set(self, name: str, owner: ServicePortName | None) -> None:
        self.tail.append((f"delete set {self.fam} {TABLE} {name}", owner))


def element_keys(frag: Fragment) -> dict[tuple[str, str], str]:
    """(map, key) -> value of a fragment's elements."""
    return {(m, k): v for m, k, v in parse_elements(frag.text)}


def change_service(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    *,
    old_keys: Mapping[tuple[str, str], str | None] | None = None,
    old_chains: Iterable[str] = (),
    old_sets: Iterable[str] = (),
) -> None:
    """Add to ``tx`` what turns ``old`` into ``new`` for one service (None: absent). ``old_keys`` (values None when
    unknown) / ``old_chains`` / ``old_sets`` stand for ``old`` when only the kernel's skeleton of it is known (adopted
    after a restart): every element whose value is unknown is deleted and written again. An entry whose verdict is
    unchanged is left alone (adding a verdict-map element makes the kernel validate every element of the table's
    verdict maps at commit); the digest element changes with the digest."""
    if old is None and not old_keys and not old_chains and not old_sets:
        if new is not None:  # the common case of a full sync into an empty table: no diff to make
            tx.add_fragment(new, spn)
            for name, spec in new.sets:
                tx.add_set(name, spec, spn)
            for name, rules in new.chains:
                tx.write_chain(name, rules, spn, exists=False)
        return
    _change_elements(tx, spn, old, new, old_keys)
    _change_chains(tx, spn, old, new, old_chains, old_sets)


def _change_elements(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    old_keys: Mapping[tuple[str, str], str | None] | None,
) -> None:
    skeleton = old_keys or {}
    old_digest = old.digest_key if old is not None else next((k for m, k in skeleton if m == SERVICE_DIGESTS), None)
    digest_changed = old is None or new is None or old.digest != new.digest or old.digest_key != new.digest_key
    dels, adds = _diff(old, new, skeleton)
    if old_digest is not None and digest_changed:
        dels.append((SERVICE_DIGESTS, old_digest))
    if dels:
        tx.delete_keys(dels, spn)
    if new is None:
        return
    entries = [e for e in adds if e[0] in (SERVICE_IPS, SERVICE_NODEPORTS)]
    others = [e for e in adds if e[0] not in (SERVICE_IPS, SERVICE_NODEPORTS)]
    if others:
        # slots carry no comment (their key starts with their entry's, which names the service)
        tx.add_elements((e for e in others if e[0] != FIREWALL), None, spn)
        tx.add_elements((e for e in others if e[0] == FIREWALL), new.comment, spn)
    if entries:
        tx.add_elements(entries, new.comment, spn)
    if digest_changed:
        tx.add_elements(((SERVICE_DIGESTS, new.digest_key, ""),), new.digest_comment, spn)


def _diff(
    old: Fragment | None, new: Fragment | None, skeleton: Mapping[tuple[str, str], str | None]
) -> tuple[list[tuple[str, str]], list[Element]]:
    """(map, key) of every element of ``old`` (or of the skeleton) that ``new`` lacks or holds with another value,
    and every element of ``new`` that ``old`` lacks or holds with another value, each in its fragment's order."""
    if old is not None and new is not None and single_entry(old.text) and single_entry(new.text):
        # no key twice in either (one entry: its slots' indexes differ), so an element is unchanged exactly when its
        # whole line is in both: only the changed lines are split (a partial sync's diff, per changed service)
        b, a = unpack(old.text).split("\n"), unpack(new.text).split("\n")
        b_set, a_set = set(b), set(a)
        dels = [(m, k) for m, k, _ in map(split_line, [line for line in b if line not in a_set])]
        return dels, [(m, k, v) for m, k, v in map(split_line, [line for line in a if line not in b_set])]
    before: Mapping[tuple[str, str], str | None] = (
        element_keys(old) if old is not None else {k: v for k, v in skeleton.items() if k[0] != SERVICE_DIGESTS}
    )
    after = element_keys(new) if new is not None else {}
    dels = [mk for mk, v in before.items() if (nv := after.get(mk)) is None or nv != v]
    return dels, [(mk[0], mk[1], v) for mk, v in after.items() if mk not in before or before[mk] != v]


def _change_chains(
    tx: Transaction,
    spn: ServicePortName | None,
    old: Fragment | None,
    new: Fragment | None,
    old_chains: Iterable[str],
    old_sets: Iterable[str],
) -> None:
    """Per-service chains and sets (ClientIP affinity)."""
    old_chain_rules = dict(old.chains) if old is not None else {c: None for c in old_chains}
    new_chain_rules = dict(new.chains) if new is not None else {}
    old_set_specs = dict(old.sets) if old is not None else {s: None for s in old_sets}
    new_set_specs = dict(new.sets) if new is not None else {}
    for name, spec in new_set_specs.items():
        if name not in old_set_specs:  # the timeout is part of the name: a set never changes in place
            tx.add_set(name, spec, spn)
    for name, rules in new_chain_rules.items():
        if old_chain_rules.get(name) != rules:
            tx.write_chain(name, rules, spn, exists=name in old_chain_rules)
    gone_chains = [c for c in old_chain_rules if c not in new_chain_rules]
    for name in gone_chains:
        tx.flush_chain(name, spn)
    for name in gone_chains:
        tx.delete_chain(name, spn)
    for name in old_set_specs:
        if name not in new_set_specs:
            tx.delete_set(name, spn)
