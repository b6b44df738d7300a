"""The bpf mode's nftables companion table (``kproxy-bpf`` in ``ip`` and ``ip6``): running its transactions and
reading it back. The table carries only what the socket programs cannot see (packets that do not start in a socket of
the node's cgroup: external clients to NodePorts, externalIPs and load-balancer IPs, forwarded packets to a ClusterIP
with no endpoints); see ``backends/bpf/__init__.py`` for why it is nftables and not a tc program.

libnftables runs in-process through the core's ``kproxy.nftkernel``: the process's shared context in its own
network namespace, a worker thread in a named one (tests). Transactions are small (a service's elements), so neither
is on the hot path of a sync of plain ClusterIP services, which never touches this table.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kproxy.model import IPFamily
from kproxy.nftkernel import Nft
from kproxy.toolkit.nft import delete_text, nft_family
from kproxy.toolkit.nft import elements as nft_elements

from .render import TABLE


class NftError(RuntimeError):
    pass


_CONTEXTS: dict[str | None, Nft] = {}
_CONTEXTS_LOCK = threading.Lock()


def _nft(netns: str | None) -> Nft:
    """The libnftables context for ``netns`` (``kproxy.nftkernel``): the process's shared one in the caller's own
    namespace, a worker thread in a named one; made once, ~13 ms (libnftables loads its caches), a command through it
    ~0.1 ms."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(netns)
        if ctx is None:
            ctx = _CONTEXTS[netns] = Nft(netns, worker=False, name=f"kpb-nft-{netns}" if netns else "kpb-nft")
        return ctx


def release(netns: str | None) -> None:
    """Close the context of a named namespace (its worker thread); the process's own context stays."""
    if netns is None:
        return
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.pop(netns, None)
    if ctx is not None:
        ctx.close()


def run(text: str, netns: str | None = None, *, json_out: bool = False) -> str:
    """Run ``text`` as one nft transaction (or a listing); the output; NftError with nft's message on failure."""
    nft = _nft(netns)
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


def read(family: IPFamily, netns: str | None = None) -> NftView:
    """The table's chains and elements (one listing of a small table)."""
    try:
        out = run(f"list table {nft_family(family)} {TABLE}", netns, json_out=True)
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


def table_present(family: IPFamily, netns: str | None = None) -> bool:
    """Whether the family's companion table exists: ``list tables`` fetches table names only (no chain, rule or
    element), so the bpf mode's check every second stays cheap however big the table is."""
    out = run(f"list tables {nft_family(family)}", netns)
    return any(ln.split()[-1:] == [TABLE] for ln in out.splitlines())


def delete_table(family: IPFamily, netns: str | None = None) -> None:
    """Remove the family's companion table (nothing when it does not exist)."""
    run(delete_text(nft_family(family), TABLE), netns)
