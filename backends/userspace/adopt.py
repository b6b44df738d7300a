"""What the userspace mode's table and data path hold, read back: once per full sync (``read``: adoption, so a restart
rebinds the ports its rules name and writes nothing when it can) and for ``kproxy verify`` (``View``, judged by
``service_problems`` and ``extra``).

Nothing here trusts the ledger or the proxier's own records: the table comes from libnftables' ``list table``, the
sockets from the kernel's socket tables of the backend's namespace (``kernel.listening``), ownership from this
process's descriptors, and what a socket serves from the data path's own listener table (the loop that relays the
connections, not a record of what was written). So ``verify`` finds a redirect rule deleted by hand, a flushed
table (rules gone, maps left), an element changed by hand (a verdict, or a port that now names another service's
socket or none), a proxy socket closed by hand (``ss -K``) or a port another process took, and a listener whose
endpoints the data path did not take.

The fixed rules are compared by *signature* (the maps and sets a rule names, its jump/goto targets, its payload and
meta fields, its redirect/reject/drop/vmap statements) rather than by text: libnftables prints rules in its own
spelling, which differs from what ``render`` writes and between nft versions, while a signature read from the JSON
listing is the same for both. A deleted, flushed or replaced rule changes the signatures; a rule edited inside the
same fields (another address in a match) is not seen.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kproxy.model import IPFamily, ServicePortName
from kproxy.toolkit.cidr import spans
from kproxy.toolkit.nft import elements
from kproxy.toolkit.verify import Findings

from . import render
from .render import Fragment

log = logging.getLogger(__name__)

Signature = frozenset[str]
ElemKey = tuple[str, str]  # (map, key)
_KEYWORDS = ("redirect", "reject", "drop", "vmap", "masquerade", "dnat", "snat", "accept")
_FIELDS = ("ip", "ip6", "th", "meta", "ct")
_WORD = re.compile(r"[a-z][a-z0-9]*")


# ------------------------------------------------------------------------------------------------ the fixed rules


def text_signature(body: str) -> Signature:
    """The signature of a rule as ``render`` writes it (the part after ``add rule <family> <table> <chain>``)."""
    words = body.replace("{", " ").replace("}", " ").replace(",", " ").split()
    out: set[str] = set()
    for i, w in enumerate(words):
        if w.startswith("@"):
            out.add(w)
        elif w in ("jump", "goto") and i + 1 < len(words):
            out.add(f"{w}:{words[i + 1]}")
        elif w in _KEYWORDS and not (i >= 2 and words[i - 2] == "ct"):  # "ct status dnat": a value
            out.add(w)
        elif w == "fib":
            out.add("fib")
        elif w in _FIELDS and i + 1 < len(words) and _WORD.fullmatch(words[i + 1]):
            out.add(f"{w}.{words[i + 1]}")
    return frozenset(out)


def json_signature(exprs: Iterable[Any]) -> Signature:
    """The signature of a rule from libnftables' JSON listing (``rule.expr``)."""
    out: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, str):
            if node.startswith("@"):
                out.add(node)
        elif isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for k, v in node.items():
                if k in ("jump", "goto") and isinstance(v, dict):
                    out.add(f"{k}:{v.get('target')}")
                    continue
                if k in _KEYWORDS:
                    out.add(k)
                elif k == "fib":
                    out.add("fib")
                elif k == "payload" and isinstance(v, dict) and "field" in v:
                    out.add(f"{v.get('protocol')}.{v['field']}")
                elif k in ("meta", "ct") and isinstance(v, dict) and "key" in v:
                    out.add(f"{k}.{v['key']}")
                walk(v)

    walk(list(exprs))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Fixed:
    """The fixed part as ``render.fixed_commands`` writes it: chains, each rule's signature in order, base chains'
    (type, hook, policy), and the maps and sets."""

    chains: Mapping[str, tuple[Signature, ...]]
    hooks: Mapping[str, tuple[str, str, str]]
    maps: frozenset[str]


@lru_cache(maxsize=2)
def expected_fixed(family: IPFamily) -> Fixed:
    f, t = render.nft_family(family), render.TABLE
    chains: dict[str, list[Signature]] = {}
    hooks: dict[str, tuple[str, str, str]] = {}
    maps: set[str] = set()
    for line in render.fixed_commands(family):
        head = f"add chain {f} {t} "
        if line.startswith(head):
            name, _, spec = line[len(head) :].partition(" ")
            chains.setdefault(name, [])
            if "hook" in spec:
                words = spec.replace("{", " ").replace("}", " ").replace(";", " ").split()
                hooks[name] = (words[words.index("type") + 1], words[words.index("hook") + 1], words[-1])
        elif line.startswith(f"add rule {f} {t} "):
            name, _, body = line[len(f"add rule {f} {t} ") :].partition(" ")
            chains.setdefault(name, []).append(text_signature(body))
        elif line.startswith((f"add map {f} {t} ", f"add set {f} {t} ")):
            maps.add(line.split()[4])
    return Fixed({k: tuple(v) for k, v in chains.items()}, hooks, frozenset(maps))


def fixed_problems(objs: list[dict[str, Any]], family: IPFamily) -> dict[tuple[str, int], str]:
    """What of the fixed part the table's JSON objects lack or hold differently: (chain, rule index) -> why; index
    -1 for the chain as a whole (missing, or a base chain on another hook); (chain, -2) for rules in this mode's
    chains that the layout does not account for (someone added them)."""
    want = expected_fixed(family)
    held_rules: dict[str, list[Signature]] = {}
    held_hooks: dict[str, tuple[str, str, str]] = {}
    present: set[str] = set()
    for o in objs:
        chain = o.get("chain")
        if chain is not None and chain.get("table") == render.TABLE:
            present.add(chain["name"])
            if "hook" in chain:
                held_hooks[chain["name"]] = (str(chain.get("type")), str(chain["hook"]), str(chain.get("policy")))
        rule = o.get("rule")
        if rule is not None and rule.get("table") == render.TABLE:
            held_rules.setdefault(rule["chain"], []).append(json_signature(rule.get("expr") or []))
    out: dict[tuple[str, int], str] = {}
    for name, sigs in want.chains.items():
        if name not in present:
            out[(name, -1)] = f"chain {name} missing"
            continue
        if name in want.hooks and held_hooks.get(name) != want.hooks[name]:
            out[(name, -1)] = f"chain {name} is {held_hooks.get(name) or 'not a base chain'}, wanted {want.hooks[name]}"
            continue
        left = Counter(held_rules.get(name, []))
        for i, sig in enumerate(sigs):
            if left[sig] > 0:
                left[sig] -= 1
            else:
                out[(name, i)] = f"chain {name}: rule {i + 1} ({' '.join(sorted(sig))}) missing"
        if +left:
            out[(name, -2)] = f"chain {name}: {sum(left.values())} rule(s) the layout does not account for"
    for name in sorted(present - set(want.chains)):
        if name != render.LAYOUT:
            out[(name, -2)] = f"chain {name}: not part of the layout"
    return out


def needed_rules(frag: Fragment) -> set[tuple[str, int]]:
    """The fixed rules a service's traffic passes through: (chain, rule index); index -1 stands for the chain."""
    fixed = expected_fixed(frag.family)
    need: set[str] = {"prerouting", "output", "services"}
    if frag.listeners:  # its proxy sockets are reached only through the guard's accept of redirected flows
        need |= {"input", render.GUARD}
    svc_rules: set[int] = set()
    for e in frag.entries:
        svc_rules.add(0 if e.map == render.SERVICE_IPS else 1)
        if e.verdict == render.V_REDIRECT_SVC:
            need.add(render.REDIRECT_SVC)
        elif e.verdict == render.V_REDIRECT_NP:
            need.add(render.REDIRECT_NP)
        elif e.verdict == render.V_REJECT:
            need.add(render.REJECT)
        elif e.verdict == render.V_FIREWALL:
            need |= {render.FIREWALL_CHAIN, render.REDIRECT_SVC}
    out: set[tuple[str, int]] = set()
    for name in need:
        out.add((name, -1))
        rules = range(len(fixed.chains[name])) if name != "services" else svc_rules
        out.update((name, i) for i in rules)
    return out


# ------------------------------------------------------------------------------------------------------ adoption


@dataclass(slots=True)
class Adopted:
    """What this mode's table holds in one family (read once per full batch)."""

    table: bool = False
    layout_ok: bool = False
    elements: dict[ElemKey, tuple[str, str]] = field(default_factory=dict)  # (map, key) -> (value, comment)
    by_comment: dict[str, set[tuple[str, str, str]]] = field(default_factory=dict)
    nodeport_cidrs: tuple[tuple[int, int], ...] = ()
    proxy_ports: tuple[str, ...] = ()  # the proxy-ports set's elements (the guard's range)
    #: (proto, port) of the wildcard sockets listening now that are this process's own (None: not read)
    live: set[tuple[str, int]] | None = None

    def ports(self, frag: Fragment) -> dict[str, int]:
        """The proxy port the kernel's elements name for each of ``frag``'s roles (where they agree)."""
        out: dict[str, int] = {}
        for e in frag.entries:
            if not e.role:
                continue
            got = self.elements.get((render.PORT_MAPS[e.map], e.key))
            if got is not None and got[0].isdigit() and got[1] == frag.comment:
                out.setdefault(e.role, int(got[0]))
        return out

    def unchanged(self, frag: Fragment) -> bool:
        """Whether the table holds ``frag`` exactly (its elements, with the ports they name)."""
        if not self.layout_ok:
            return False
        ports = self.ports(frag)
        if set(ports) != set(frag.roles()):
            return False
        return self.by_comment.get(frag.comment, set()) == set(frag.kernel_elements(ports))


def read(objs: list[dict[str, Any]] | None, family: IPFamily, live: set[tuple[str, int]] | None) -> Adopted:
    """The table's ``list table`` JSON objects (None: there is no table) as ``Adopted``; a table of another layout
    or with its fixed part damaged (a rule deleted, a flushed table, a rule someone added) is not adopted
    (``layout_ok`` False: replaced whole)."""
    if objs is None:
        return Adopted(live=live)
    got = Adopted(table=True, live=live)
    got.layout_ok = any((o.get("chain") or {}).get("name") == render.LAYOUT for o in objs)
    if got.layout_ok:
        damaged = fixed_problems(objs, family)
        if damaged:
            log.warning(
                "%s: this mode's table is damaged (%s): it is replaced", family.value, "; ".join(damaged.values())
            )
            got.layout_ok = False
    if not got.layout_ok:
        return got
    cidrs: list[str] = []
    for name, key, value, comment, _ in elements(objs):
        if name == render.NODEPORT_CIDRS:
            cidrs.append(key)
        elif name == render.PROXY_PORTS:
            got.proxy_ports += (key,)
        elif name in render.SERVICE_MAPS:
            got.elements[(name, key)] = (value, comment)
            got.by_comment.setdefault(comment, set()).add((name, key, value))
    got.nodeport_cidrs = spans(cidrs)
    return got


# ------------------------------------------------------------------------------------------------------ verify


@dataclass(frozen=True, slots=True)
class Served:
    """What the data path does with one of this process's proxy sockets."""

    ident: tuple[Any, ...]  # (family, service port, role)
    endpoints: frozenset[tuple[str, int]]
    affinity: float
    dead: bool  # the loop saw it stop listening (closed under it)


@dataclass(slots=True)
class View:
    """Everything ``verify`` read for one family."""

    family: IPFamily
    table: bool = False
    error: str | None = None
    fixed: dict[tuple[str, int], str] = field(default_factory=dict)  # fixed_problems
    maps: set[str] = field(default_factory=set)
    elements: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # (map, key) -> (value, comment)
    nodeport_cidrs: list[str] = field(default_factory=list)
    want_cidrs: tuple[str, ...] = ()
    proxy_ports: list[str] = field(default_factory=list)  # the proxy-ports set's elements
    want_ports: str = ""  # the element it should hold (the proxy port range)
    sockets: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (proto, port) -> listening inodes
    mine: set[int] = field(default_factory=set)  # this process's socket inodes
    served: dict[int, Served] = field(default_factory=dict)  # inode -> what the data path does with it


def parse_table(view: View, objs: list[dict[str, Any]]) -> None:
    """Fill ``view`` from a ``list table`` JSON listing."""
    view.table = True
    view.fixed = fixed_problems(objs, view.family)
    for o in objs:
        body = o.get("map") or o.get("set")
        if body is not None and body.get("table") == render.TABLE:
            view.maps.add(str(body["name"]))
    for name, key, value, comment, _ in elements(objs):
        if name == render.NODEPORT_CIDRS:
            view.nodeport_cidrs.append(key)
        elif name == render.PROXY_PORTS:
            view.proxy_ports.append(key)
        elif name in render.SERVICE_MAPS:
            view.elements[(name, key)] = (value, comment)


def service_problems(view: View, name: ServicePortName, frag: Fragment) -> str | None:
    """None when the kernel and the data path serve ``frag`` exactly; else ``missing`` or ``different: ...``."""
    if not view.table:
        return "missing"
    problems: list[str] = []
    found = 0
    guard = ("input", render.GUARD)  # named after the redirect path's problems (the report keeps the first few)
    for need in sorted(needed_rules(frag), key=lambda x: (x[0] in guard, x[0], x[1])):
        if need in view.fixed:
            problems.append(view.fixed[need])
    if frag.listeners and view.want_ports and view.proxy_ports != [view.want_ports]:
        # the guard matches nothing (or the wrong ports): this service's proxy sockets take direct connections
        problems.append(f"{render.PROXY_PORTS} holds {sorted(view.proxy_ports)}, wanted {view.want_ports}")
    ports: dict[str, set[int]] = {}
    for e in frag.entries:
        held = view.elements.get((e.map, e.key))
        if held is None:
            problems.append(f"{e.map}: {e.key} missing")
        else:
            found += 1
            if held[0] != e.verdict:
                problems.append(f"{e.map}: {e.key} is {held[0]!r}, wanted {e.verdict!r}")
            if held[1] != frag.comment:
                problems.append(f"{e.map}: {e.key} is marked {held[1]!r}")
        if not e.role:
            continue
        pm = render.PORT_MAPS[e.map]
        port = view.elements.get((pm, e.key))
        if port is None:
            problems.append(f"{pm}: {e.key} missing")
            continue
        found += 1
        if port[1] != frag.comment:
            problems.append(f"{pm}: {e.key} is marked {port[1]!r}")
        if not port[0].isdigit():
            problems.append(f"{pm}: {e.key} is {port[0]!r}, not a port")
            continue
        ports.setdefault(e.role, set()).add(int(port[0]))
    for k in frag.firewall:
        if (render.FIREWALL, k) in view.elements:
            found += 1
        else:
            problems.append(f"{render.FIREWALL}: {k} missing")
    listeners = {lst.role: lst for lst in frag.listeners}
    for role, held_ports in sorted(ports.items()):
        if len(held_ports) > 1:
            problems.append(f"role {role}: its addresses name ports {sorted(held_ports)}, one proxy socket wanted")
        for number in sorted(held_ports):
            problems += _socket_problems(view, name, frag.proto, number, role, listeners.get(role))
    return Findings(problems, found).verdict(6)


def _socket_problems(
    view: View, name: ServicePortName, proto: str, port: int, role: str, lst: render.Listener | None
) -> list[str]:
    where = f"proxy port {proto}/{port}"
    inodes = view.sockets.get((proto, port), [])
    if not inodes:
        return [f"{where}: no socket listens on it"]
    mine = [i for i in inodes if i in view.mine]
    if not mine:
        return [f"{where}: held by another process (socket inode {inodes[0]})"]
    served = view.served.get(mine[0])
    if served is None:
        return [f"{where}: a socket of this process that the data path does not serve"]
    if served.dead:
        return [f"{where}: the data path saw its socket stop listening"]
    _, owner, owner_role = served.ident
    if owner != name or owner_role != role:
        return [f"{where}: its socket serves {render.service_key(owner)} (role {owner_role})"]
    if lst is None:
        return [f"{where}: no listener of role {role} is wanted"]
    out = []
    if served.endpoints != frozenset(lst.endpoints):
        out.append(f"{where}: the data path balances over {sorted(served.endpoints)}, wanted {sorted(lst.endpoints)}")
    if served.affinity != float(lst.affinity):
        out.append(f"{where}: affinity {served.affinity:g} s, wanted {lst.affinity} s")
    return out


def extra(view: View, wanted: Mapping[ServicePortName, Fragment]) -> list[str]:
    """What the table and the data path hold that no wanted service accounts for: elements, rules or chains outside
    the layout, a nodeport-cidrs set other than the node's, proxy sockets serving services that are not wanted."""
    if not view.table:
        return []
    mine: set[tuple[str, str]] = set()
    for frag in wanted.values():
        for e in frag.entries:
            mine.add((e.map, e.key))
            if e.role:
                mine.add((render.PORT_MAPS[e.map], e.key))
        mine.update((render.FIREWALL, k) for k in frag.firewall)
    out = [f"{m}: {k}: an element no service accounts for" for (m, k) in sorted(view.elements) if (m, k) not in mine]
    out += [why for (_, i), why in sorted(view.fixed.items()) if i == -2]
    out += [f"map or set {m} missing" for m in sorted(expected_fixed(view.family).maps - view.maps)]
    if render.NODEPORT_CIDRS in view.maps and spans(view.nodeport_cidrs) != spans(view.want_cidrs):
        out.append(f"{render.NODEPORT_CIDRS} holds {sorted(view.nodeport_cidrs)}, wanted {list(view.want_cidrs)}")
    names = set(wanted)
    for inode, served in sorted(view.served.items()):
        if served.ident[1] not in names:
            out.append(f"a proxy socket (inode {inode}) serves {render.service_key(served.ident[1])}: not wanted")
    return out
