"""Where the userspace mode talks to the kernel: its libnftables context (the redirect table and the input guard's
set), the namespace's socket tables, the open-file limit, and what the kernel alone takes for a full sync.

libnftables (1.0.6) ``select()``s on its netlink socket and aborts the process when that descriptor is 1024 or
above, so the context is opened before any proxy socket (``kproxy.nftkernel``); with a namespace named, its worker
thread lives there and also makes the proxy sockets. The socket tables are read from
``/proc/thread-self/net/{tcp,tcp6,udp,udp6}`` in the calling thread's namespace (call them through the context).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
from typing import Any

from kproxy.model import IPFamily
from kproxy.nftkernel import Nft
from kproxy.toolkit import nft as nft_tools
from kproxy.toolkit.netns import in_netns

from . import render
from .ports import bind_seconds

log = logging.getLogger(__name__)

TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"

Objects = list[dict[str, Any]]


def context(netns: str | None) -> nft_tools.OwnContext:
    """libnftables for this mode: in the caller's thread with the process's one shared context when no namespace is
    named (opened before any proxy socket, on a low descriptor), else a worker thread in the namespace, which also
    makes the proxy sockets there."""
    return nft_tools.OwnContext(netns, worker=False, name=f"kpu-kernel-{netns}" if netns else "kpu-kernel")


def raise_open_file_limit() -> None:
    """One descriptor per proxy socket and six per relayed connection: the soft limit goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("userspace: could not raise the open-file limit from %d to %d: %s", soft, hard, exc)


# ------------------------------------------------------------------------------------------------------ the table


def read_table(nft: Nft, family: IPFamily, *, terse: bool = False) -> tuple[Objects | None, str]:
    """This mode's table in ``family`` as libnftables' JSON objects (``terse``: without elements), or None and
    the error (``No such file ...`` when there is no table)."""
    return nft.read(f"list table {render.nft_family(family)} {render.TABLE}", terse=terse)


def missing(err: str) -> bool:
    """Whether a failed read means the table is not there (rather than unreadable)."""
    return "No such file" in err


def guard_ports(nft: Nft, family: IPFamily) -> list[str] | None:
    """The elements of the input guard's ``proxy-ports`` set, None when it cannot be read (no table). A set, not a
    chain: nft 1.0.6 fetches the whole table to list a chain, and only the set itself to list a set."""
    objs, _ = nft.read(f"list set {render.nft_family(family)} {render.TABLE} {render.PROXY_PORTS}")
    return None if objs is None else [el.key for el in nft_tools.elements(objs)]


# ------------------------------------------------------------------------------------------------------ sockets


def listening(family: IPFamily) -> dict[tuple[str, int], list[int]]:
    """(proto, port) -> inodes of the sockets bound to the wildcard address and listening (TCP) or unconnected (UDP),
    from the kernel's socket tables of the calling thread's namespace (call it in the backend's)."""
    suffix = "" if family == IPFamily.V4 else "6"
    wildcard = "0" * (8 if family == IPFamily.V4 else 32)
    out: dict[tuple[str, int], list[int]] = {}
    for proto, state in (("tcp", TCP_LISTEN), ("udp", UDP_UNCONNECTED)):
        try:
            with open(f"/proc/thread-self/net/{proto}{suffix}") as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != state:
                        continue
                    addr, _, port = cols[1].partition(":")
                    if addr != wildcard or cols[2].split(":")[0].strip("0"):
                        continue
                    out.setdefault((proto, int(port, 16)), []).append(int(cols[9]))
        except FileNotFoundError:
            continue  # no IPv6 in this namespace's kernel
    return out


def own_socket_inodes() -> set[int]:
    """The inodes of every socket this process holds a descriptor of."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


# ------------------------------------------------------------------------------------------------------ the floor


def floor_seconds(fresh: dict[IPFamily, tuple[str, int, int]], ns: str) -> float | None:
    """What the kernel alone takes for the last full syncs that built the table from nothing (per family: the
    transaction's text, its TCP and UDP sockets): ``nft -f`` of the exact transaction plus binding (and for TCP
    listening on) as many sockets, in the empty namespace ``ns``."""
    work = {fam: v for fam, v in fresh.items() if v[0]}
    if not work:
        return None
    total = 0.0
    for fam, (text, tcp_n, udp_n) in work.items():
        seconds = nft_tools.file_seconds(ns, text)
        if seconds is None:
            return None
        try:
            bound = in_netns(ns, functools.partial(bind_seconds, fam, tcp_n, udp_n), timeout=600, name="kpu-floor")
        except (OSError, TimeoutError) as exc:
            log.warning("floor: binding sockets in %s failed: %s", ns, exc)
            return None
        if bound is None:
            return None
        total += seconds + bound
    return total
