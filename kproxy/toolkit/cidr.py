"""Addresses and prefixes as the backends write and compare them: membership, collapsing into the non-overlapping
elements an interval set takes, single addresses without a prefix length, merged integer spans."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

from kproxy.model import IPFamily
from kproxy.nodeaddr import LOOPBACK

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def network_text(net: Any) -> str:
    """A network as an nft element: a single address without ``/32`` or ``/128``, else ``addr/len``."""
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


def networks(texts: Iterable[str], family: IPFamily | None = None) -> list[Network]:
    """The texts that parse as networks (host bits allowed), of ``family`` when given; the others are left out."""
    version = None if family is None else (4 if family == IPFamily.V4 else 6)
    out: list[Network] = []
    for text in texts:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        if version is None or net.version == version:
            out.append(net)
    return out


def collapsed(texts: Iterable[str], family: IPFamily) -> tuple[str, ...]:
    """The ``family`` networks among ``texts`` collapsed into non-overlapping ones (an interval set refuses
    ``198.18.0.0/15`` with ``198.18.1.0/24``), as ``network_text``."""
    return tuple(network_text(n) for n in ipaddress.collapse_addresses(networks(texts, family)))  # type: ignore[type-var]


def all_but_loopback(family: IPFamily) -> list[Network]:
    """Every address of ``family`` but loopback, as sorted networks."""
    everything = ipaddress.ip_network("0.0.0.0/0" if family == IPFamily.V4 else "::/0")
    return sorted(everything.address_exclude(LOOPBACK[family]))  # type: ignore[arg-type]


def in_any(ip: str, cidrs: Iterable[str]) -> bool:
    """Whether address ``ip`` lies in one of ``cidrs`` (unparsable text on either side matches nothing)."""
    return _in(ip, networks(cidrs))


def any_contains(cidrs: Sequence[str], ips: Sequence[str]) -> bool:
    """Whether one of ``ips`` lies in one of ``cidrs``."""
    nets = networks(cidrs) if ips else []
    return any(_in(ip, nets) for ip in ips)


def _in(ip: str, nets: Sequence[Network]) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return any(addr.version == n.version and addr in n for n in nets)


def spans(items: Iterable[str]) -> tuple[tuple[int, int], ...]:
    """Interval set elements (``a-b``, ``a/n``, ``a``) as merged, sorted integer spans: what the kernel holds and
    what is wanted compare equal in this form whatever spelling either uses."""
    found: list[tuple[int, int]] = []
    for item in items:
        if "-" in item and "/" not in item:
            first, last = item.split("-", 1)
            found.append((int(ipaddress.ip_address(first)), int(ipaddress.ip_address(last))))
        else:
            net = ipaddress.ip_network(item, strict=False)
            found.append((int(net.network_address), int(net.broadcast_address)))
    found.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in found:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)
