"""Ending connected UDP sockets pinned to a backend that is gone (cilium#27300: a connected UDP socket translated at
connect keeps sending to the old backend forever, so DNS breaks when CoreDNS moves).

When a UDP service loses a backend, kproxy destroys the *connected* UDP sockets whose peer is that backend, in every
network namespace that has a process in the mode's cgroup (the node's pods and host processes), with iproute2's
``ss -K`` (sock_diag SOCK_DESTROY, CONFIG_INET_DIAG_DESTROY). The application's next send fails (EDESTADDRREQ) and
it reconnects, through connect4, to a live backend. Unconnected sockets have no peer, so the filter never matches
them (they re-choose per datagram anyway: cilium#48564). Every removed UDP backend is looked for, whatever the
reverse-NAT map says: that map is an LRU of 65,536 entries, and a socket whose entry was pushed out (by other
sockets' translations) would otherwise stay pinned to a dead backend for ever; the map is only a hint for the log.
One ``ss`` per namespace matches all the removed backends at once. A socket that connected to the pod address
directly, with the same address and port, is ended too (ss cannot filter by socket cookie): its peer is gone as well.

Runs on a worker thread of its own, after the maps no longer lead to the backend: a sync never waits for it.

In a container (the DaemonSet) this needs the host's PID namespace (``hostPID``: the pids of ``cgroup.procs`` must
name processes in /proc), ``CAP_SYS_PTRACE`` (opening /proc/PID/ns/net of a process with capabilities kproxy
lacks) and ``CAP_SYS_ADMIN`` (setns into that namespace): deploy/overlays/bpf has the measurements. Processes whose
namespace cannot be opened are counted by reason and logged as a warning, never skipped silently.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kproxy.model import IPFamily

from . import maps
from .render import Fragment

log = logging.getLogger(__name__)


def peers_to_end(changes: Iterable[tuple[Fragment | None, Fragment | None]], max_fresh: int) -> set[tuple[str, int]]:
    """The peers whose connected UDP sockets must end after a batch of UDP service changes (old, new fragment): every
    backend a service lost, and every frontend that translates now and did not before (a Service deleted and created
    again: a socket connected in between went to the bare address untranslated and would stay there), the latter
    only when at most ``max_fresh`` of them."""
    gone: set[tuple[str, int]] = set()
    fresh: set[tuple[str, int]] = set()
    for old, new in changes:
        old_fr = old.frontends if old is not None else ()
        new_fr = new.frontends if new is not None else ()
        gone |= {b for f in old_fr for b in f.backends} - {b for f in new_fr for b in f.backends}
        before = {f.key for f in old_fr if f.backends}
        fresh |= {(f.address, f.port) for f in new_fr if f.backends and f.key not in before}
    return gone | fresh if len(fresh) <= max_fresh else gone


def cgroup_namespaces(cgroup: Path, unreachable: dict[str, int] | None = None) -> dict[int, int]:
    """Network namespace inode -> one pid in it, for every process of ``cgroup`` and its children. Processes whose
    namespace cannot be looked at are counted in ``unreachable`` by the reason (an errno's name, or ``"not in this
    PID namespace, or gone"`` for a process ``cgroup.procs`` lists but /proc does not show)."""
    out: dict[int, int] = {}
    for procs in [cgroup / "cgroup.procs", *cgroup.glob("**/cgroup.procs")]:
        try:
            pids = [int(x) for x in procs.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                ino = os.stat(f"/proc/{pid}/ns/net").st_ino
            except OSError as exc:
                if unreachable is not None:
                    why = _why(pid, exc)
                    unreachable[why] = unreachable.get(why, 0) + 1
                continue
            out.setdefault(ino, pid)
    return out


def _why(pid: int, exc: OSError) -> str:
    # a pid of another PID namespace reads as 0 in cgroup.procs, or names nothing (or another process) here
    if pid == 0 or exc.errno == errno.ENOENT:
        return "not in this PID namespace, or gone"
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def translated_peers(rev_fd: int, family: IPFamily, peers: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The ``peers`` that some socket was translated to, by the reverse-NAT map (socket cookie . backend keys)."""
    want = set(peers)
    ks, vs = maps.key_sizes(family)["rev"]
    keys, _values = maps.lookup_raw(rev_fd, ks, vs)
    fmt = maps.REV4_KEY if family == IPFamily.V4 else maps.REV6_KEY
    seen = set()
    for _cookie, a, p, _pad in fmt.iter_unpack(keys):
        seen.add((maps.addr_text(a), int.from_bytes(p, "big")))
    return sorted(want & seen)


def _dst(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def ss_filter(targets: Iterable[tuple[str, int]]) -> list[str]:
    """An ``ss`` filter (argv words) matching a socket whose peer is any of ``targets``."""
    words: list[str] = ["("]
    for i, (ip, port) in enumerate(sorted(set(targets))):
        words += (["or"] if i else []) + ["dst", _dst(ip, port)]
    return [*words, ")"]


def destroy_connected_udp(
    cgroup: Path, peers: Iterable[tuple[str, int]], rev_fd: int | None = None, family: IPFamily = IPFamily.V4
) -> int:
    """Destroy connected UDP sockets whose peer is one of ``peers`` in the cgroup's namespaces, every one of them
    looked for (``rev_fd``, the reverse-NAT map, only says in the log how many it still knew); how many ss ended."""
    targets = sorted(set(peers))
    if not targets:
        return 0
    hinted: list[tuple[str, int]] | None = None
    if rev_fd is not None:
        try:
            hinted = translated_peers(rev_fd, family, targets)
        except (OSError, maps.BpfError):
            hinted = None
    killed = 0
    unreachable: dict[str, int] = {}
    for _ino, pid in cgroup_namespaces(cgroup, unreachable).items():
        argv = ["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-K", "-n", "-u", *ss_filter(targets)]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("bpf: ending UDP sockets to %s failed: %s", targets, exc)
            continue
        if res.returncode != 0:
            log.warning("bpf: ss -K for %s: %s", targets, res.stderr.strip()[:200])
            continue
        killed += max(0, len([ln for ln in res.stdout.splitlines() if ln.strip()]) - 1)  # minus the header
    if unreachable:
        # their connected UDP sockets to the removed backends stay as they are: say so, never silently
        log.warning(
            "bpf: connected UDP sockets to %s not looked for in the network namespaces of %s process(es) of %s (%s)",
            targets,
            sum(unreachable.values()),
            cgroup,
            ", ".join(f"{why}: {n}" for why, n in sorted(unreachable.items())),
        )
    if killed:
        seen = "" if hinted is None else f" ({len(hinted)} of them still in the reverse-NAT map)"
        log.info("bpf: ended %d connected UDP socket(s) to %s (gone backends, new frontends)%s", killed, targets, seen)
    return killed


class Reaper:
    """One worker thread that ends stale connected UDP sockets, in submission order."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def warm(self) -> None:
        """Start the worker thread now (``start``), so a sync that ends sockets never waits for a thread to start."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bpf-udp-reaper")
            self._pool.submit(int).result()

    def submit(
        self, cgroup: Path, peers: Iterable[tuple[str, int]], rev_fd: int | None, family: IPFamily
    ) -> Future[int] | None:
        items = list(peers)
        if not items:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bpf-udp-reaper")
        return self._pool.submit(destroy_connected_udp, cgroup, items, rev_fd, family)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)
            self._pool = None
