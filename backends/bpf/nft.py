"""The bpf mode's nftables companion table (``kproxy-bpf`` in ``ip`` and ``ip6``): running its transactions and
reading it back. The table carries only what the socket programs cannot see (packets that do not start in a socket of
the node's cgroup: external clients to NodePorts, externalIPs and load-balancer IPs, forwarded packets to a ClusterIP
with no endpoints); see ``backends/bpf/__init__.py`` for why it is nftables and not a tc program.

In the caller's network namespace libnftables runs in-process (``nftables.Nftables().cmd``); for a named namespace
(tests) the ``nft`` command runs under ``ip netns exec``. Transactions are small (a service's elements), so neither
is on the hot path of a sync of plain ClusterIP services, which never touches this table.

Who uses it: ``backends.bpf.proxier`` and ``backends.bpf.inspect``.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kproxy.model import IPFamily

from .render import TABLE


class NftError(RuntimeError):
    pass


_LOCAL = threading.local()


def _context() -> Any:
    """This thread's libnftables context: making one costs ~13 ms (it loads its caches), a command through a kept one
    0.1 ms; contexts are not shared between threads."""
    ctx = getattr(_LOCAL, "nft", None)
    if ctx is None:
        import nftables  # type: ignore[import-not-found,unused-ignore]

        ctx = _LOCAL.nft = nftables.Nftables()
    return ctx


def _ip(family: IPFamily) -> str:
    return "ip" if family == IPFamily.V4 else "ip6"


def run(text: str, netns: str | None = None, *, json_out: bool = False) -> str:
    """Run ``text`` as one nft transaction (or a listing); the output; NftError with nft's message on failure."""
    if netns is None:
        nft = _context()
        nft.set_json_output(json_out)
        rc, out, err = nft.cmd(text)
        if rc != 0:
            raise NftError(err.strip() or f"nft failed ({rc})")
        return str(out)
    argv = ["ip", "netns", "exec", netns, "nft"] + (["-j"] if json_out else [])
    listing = text.startswith("list ") and "\n" not in text.strip()
    # nft prints a listing's JSON only when the command is given on the command line, not through -f
    argv += text.split() if listing else ["-f", "-"]
    res = subprocess.run(argv, input=None if listing else text, capture_output=True, text=True, timeout=60, check=False)
    if res.returncode != 0:
        raise NftError(res.stderr.strip() or f"nft failed ({res.returncode})")
    return res.stdout


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


def _key_text(val: Any) -> str:
    if isinstance(val, dict) and "concat" in val:
        return " . ".join(_key_text(v) for v in val["concat"])
    return str(val)


def _verdict_text(data: Any) -> str:
    if isinstance(data, dict):
        for verb in ("goto", "jump"):
            if verb in data:
                return f"{verb} {data[verb]['target']}"
        for verb in ("drop", "accept", "return"):
            if verb in data:
                return verb
    return str(data)


def read(family: IPFamily, netns: str | None = None) -> NftView:
    """The table's chains and elements (one listing of a small table)."""
    try:
        out = run(f"list table {_ip(family)} {TABLE}", netns, json_out=True)
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
            m = item["map"]
            for el in m.get("elem", []) or []:
                if isinstance(el, list) and len(el) == 2:
                    k, v = el
                    if isinstance(k, dict) and "elem" in k:
                        k = k["elem"]["val"]
                    elements.add((m["name"], _key_text(k), _verdict_text(v)))
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
    out = run(f"list tables {_ip(family)}", netns)
    return any(ln.split()[-1:] == [TABLE] for ln in out.splitlines())


def delete_table(family: IPFamily, netns: str | None = None) -> None:
    """Remove the family's companion table (nothing when it does not exist)."""
    t = f"{_ip(family)} {TABLE}"
    run(f"add table {t}\ndelete table {t}", netns)


def table_lines(family: IPFamily, netns: str | None = None) -> list[str]:
    """``nft list table`` of the companion table, one line per line ([] when absent), for remnants and show."""
    try:
        out = run(f"list table {_ip(family)} {TABLE}", netns)
    except NftError:
        return []
    return [ln.strip() for ln in out.splitlines() if ln.strip()]
