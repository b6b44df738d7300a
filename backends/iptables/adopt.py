"""Adoption: which services' chains the kernel already holds exactly as kproxy would write them.

A full sync (start-up, periodic, after a failure) reads the nat table once with ``iptables-save`` and compares, per
service, every chain kproxy would write with the chain the kernel has. Services that match are not rewritten: a
restarted kproxy then leaves their rules (and counters) alone, and a full sync at 10,000 services costs the save and
the shared chains instead of every line (on the nf_tables flavour each payload re-fetches the table).

The comparison is on a canonical form of each rule, so ``iptables-save``'s spelling (``-s 1.2.3.4/32``, options in
its own order, ``--mask 255.255.255.255 --rsource`` defaults, 11-digit probabilities, quoted comments) equals
kproxy's rendered text. It is conservative: anything it does not recognise as equal counts as different and gets
rewritten. Rule order within a chain is compared; the order of options within a rule is not (every option kproxy
writes is a plain conjunctive match, and ``recent --set`` always runs because the protocol match that follows it
holds for every packet that reached the chain).
"""

from __future__ import annotations

import collections
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kproxy.model import ServicePortName
from kproxy.toolkit.verify import Findings

from . import render

_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\S+')
_DEFAULTS = {
    ("--mask", ("255.255.255.255",)),
    ("--mask", ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",)),
    ("--rsource", ()),
    # iptables-save spells REJECT's default out; kproxy's rules (as upstream's) leave it implicit
    ("--reject-with", ("icmp-port-unreachable",)),
    ("--reject-with", ("icmp6-port-unreachable",)),
}

Canon = tuple[tuple[bool, str, tuple[str, ...]], ...]


_HEX = re.compile(r"0x[0-9a-fA-F]+(?:/0x[0-9a-fA-F]+)?")
# a dotted quad exactly as ipaddress prints it (no leading zeros): such an address (/32 or bare) is already canonical
_V4 = re.compile(r"(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)")
_ADDRESS_OPTS = frozenset(("-s", "-d", "--source", "--destination"))


def _network(value: str) -> str:
    addr, _, plen = value.partition("/")
    if plen in ("", "32") and _V4.fullmatch(addr):  # the common case, ~20x cheaper than ipaddress
        return addr + "/32"
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        return value


def _value(opt: str, value: str) -> str:
    if value[:1] == '"' and value.endswith('"') and len(value) >= 2:
        value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if value[:1] == "0" and _HEX.fullmatch(value):  # marks: iptables-save drops leading zeros (0x004000 -> 0x4000)
        return "/".join(hex(int(part, 16)) for part in value.split("/"))
    if opt in _ADDRESS_OPTS:
        return _network(value)
    if opt == "--probability":
        try:
            return f"{float(value):.9f}"
        except ValueError:
            return value
    return value


def canonical(line: str) -> tuple[str, Canon]:
    """(chain, canonical rule) of an ``-A CHAIN ...`` line, in either spelling."""
    words = _TOKEN.findall(line)
    chain = words[1] if len(words) > 1 else ""
    opts: list[tuple[bool, str, tuple[str, ...]]] = []
    neg = False
    i = 2
    n = len(words)
    while i < n:
        w = words[i]
        if w == "!":
            neg = True
            i += 1
            continue
        j = i + 1
        vals: list[str] = []
        while j < n and not words[j].startswith("-") and words[j] != "!":
            vals.append(_value(w, words[j]))
            j += 1
        if w in ("--or-mark", "--xor-mark") and len(vals) == 1:  # iptables-save spells both as --set-xmark
            w, vals = "--set-xmark", [f"{vals[0]}/{vals[0] if w == '--or-mark' else '0x0'}"]
        item = (w, tuple(vals))
        if item not in _DEFAULTS:
            opts.append((neg, w, tuple(vals)))
        neg = False
        i = j
    return chain, tuple(sorted(opts))


def kernel_service_chains(save_text: str) -> dict[str, list[str]]:
    """Service chains of an ``iptables-save -t nat`` text: chain -> its rule lines, in order, as saved. They are
    canonicalised only when compared (``unchanged``), one service at a time: canonical tuples of a whole table held
    all at once take many times the memory of its lines."""
    out: dict[str, list[str]] = {}
    for line in save_text.splitlines():
        if line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            if render.is_service_chain(name):
                out.setdefault(name, [])
        elif line.startswith("-A KUBE-"):
            chain = line[3:].split(" ", 1)[0]
            if render.is_service_chain(chain):
                out.setdefault(chain, []).append(line)
    return out


def unchanged(frag: render.Fragment, kernel: Mapping[str, Sequence[str | Canon]]) -> bool:
    """Whether every chain of ``frag`` is in the kernel with exactly its rules (``kernel``: chain -> rule lines as
    saved, or canonical rules)."""
    if not frag.chains:
        return True
    mine: dict[str, list[Canon]] = {c: [] for c in frag.chains}
    for line in frag.rules:
        chain, canon = canonical(line)
        rules = mine.get(chain)
        if rules is None:
            return False
        rules.append(canon)
    for chain, rules in mine.items():
        held = kernel.get(chain)
        if held is None or len(held) != len(rules):
            return False
        if [canonical(x)[1] if isinstance(x, str) else x for x in held] != rules:
            return False
    return True


@dataclass(slots=True)
class Adoption:
    """What a full batch read from the kernel before writing: the nat table's service chains (canonical rules), the
    jump rules present in the built-in chains ("table/-A CHAIN spec"), how many nat rules there are; or the error."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    jumps: set[str] = field(default_factory=set)
    rules: int = 0
    error: str | None = None


# ------------------------------------------------------------------------------------------ verify


@dataclass(slots=True)
class KernelRules:
    """What ``verify`` read: the rules of kproxy's chains ("table/CHAIN" -> canonical rules, in order)."""

    ctx: render.Context
    rules: dict[str, list[Canon]]
    error: str | None = None
    sets: dict[str, set[Canon]] = field(default_factory=dict)  # the shared chains' rules as sets, on demand


def spell(key: str, canon: Canon) -> str:
    """A canonical rule back in iptables words (for messages)."""
    words = [f"-A {key.split('/', 1)[1]}"]
    for neg, opt, vals in canon:
        words.append(("! " if neg else "") + " ".join((opt, *vals)))
    return " ".join(words)


def verify_service(view: KernelRules, fragment: render.Fragment) -> str | None:
    """The service's own nat chains rule for rule, and each of its lines in the shared chains."""
    f = Findings()
    own: dict[str, list[Canon]] = {c: [] for c in fragment.chains}
    for line in fragment.rules:
        chain, canon = canonical(line)
        own.setdefault(chain, []).append(canon)
    for chain, wanted in own.items():
        held = view.rules.get(f"nat/{chain}")
        if held is None:
            f.problems.append(f"chain nat/{chain} missing")
            continue
        f.found += 1
        if held != wanted:
            f.problems.append(f"chain nat/{chain}: {len(held)} rules, {len(wanted)} wanted, or in another form")
    for key, lines in fragment.top.items():
        held_lines = view.sets.get(key)
        if held_lines is None:
            held_lines = view.sets[key] = set(view.rules.get(key, []))
        for line in lines:
            if canonical(line)[1] in held_lines:
                f.found += 1
            else:
                f.problems.append(f"rule missing in {key}: {line}")
    return f.verdict()


def verify_extra(view: KernelRules, wanted: Mapping[ServicePortName, render.Fragment]) -> list[str]:
    """Service chains no wanted service owns, and lines in the shared chains no wanted service (or the fixed
    part) accounts for."""
    chains = {f"nat/{c}" for f in wanted.values() for c in f.chains}
    out = [
        f"{key}: a service chain no service owns"
        for key in view.rules
        if key.startswith("nat/") and render.is_service_chain(key[4:]) and key not in chains
    ]
    expected: dict[str, list[Canon]] = {}
    for key, (head, tail) in render.render_fixed(view.ctx).items():
        expected.setdefault(key, []).extend(canonical(line)[1] for line in (*head, *tail))
    for frag in wanted.values():
        for key, lines in frag.top.items():
            expected.setdefault(key, []).extend(canonical(line)[1] for line in lines)
    for key in render.ALL_TOP:
        left = collections.Counter(expected.get(key, []))
        for canon in view.rules.get(key, []):
            if left[canon] > 0:
                left[canon] -= 1
            else:
                out.append(f"{key}: a rule no service accounts for: {spell(key, canon)}")
    return out
