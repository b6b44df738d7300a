"""Drift repair: notice at once when someone else changes or removes what kproxy programmed, and ask for a repair.

The ledger's cheap "is my state still there" check (``needs_full``) runs before a sync, and an idle node syncs only
every sync period; this module makes repair follow the damage instead of the clock. A backend declares what it needs
(``Proxier.DRIFT``, a ``Drift``): the nf_tables tables it writes (the nftables mode's table, the userspace mode's
redirect table, the bpf companion table, the iptables-nft tables with the mode's chain prefix), and a poll interval
for state that the kernel does not announce (the bpf mode's pins, attachments and map identities; iptables-legacy).
The decision what a change means is made here, once, the same for every mode:

- nf_tables sends every committed transaction to the ``NFNLGRP_NFTABLES`` group of a ``NETLINK_NETFILTER`` socket:
  its messages (table, chain, rule, set, element added or removed), then ``NFT_MSG_NEWGEN`` with the committing
  task's pid (``NFTA_GEN_PROC_PID``: the *thread* id, in the initial pid namespace) and name. The watcher buffers a
  transaction until its NEWGEN and judges it whole. Only transactions that touch a declared table count: in a table
  of the mode's own, anything; in a shared table (iptables' ``nat``/``filter``/``mangle``), a change to a chain with
  the mode's prefix, or any deletion (it may be the mode's jump from a built-in chain).
- Own writes: kproxy writes kernel state only inside a sync (and the checks), and the daemon brackets those with
  ``own_writes()``. Outside that window every transaction is someone else's: the family is repaired (a full batch,
  which adopts what the kernel still holds and rewrites the rest). Inside it, a transaction committed by a thread of
  this process, or by a child still alive (``iptables-restore``, ``ip netns exec``), is kproxy's own and ignored; one
  whose committer is alive and someone else's is a repair; one whose committer cannot be told apart (the process has
  exited, or kproxy runs in a pid namespace of its own, where the kernel's pids are not its own) is *undecided*: once
  the window closes (after every message queued during it has been read, so none is judged as outside it), the
  families it touched get the cheap check. Checks write nothing, so own writes never wake a repair: no feedback
  loop. The window that remains: a foreign change inside kproxy's own write, by a process that has already exited,
  that the mode's cheap check does not see (the iptables canary does not see one deleted service chain); the next
  periodic full sync repairs it.
- A storm is coalesced by the runner: a repair is a sync request, served at most once per min-sync-period; checks
  are flags, served by the runner thread between syncs (``needs_full`` runs only there).
- A lost notification (``ENOBUFS``: the socket's queue overflowed) counts as an undecided change of every family
  inside the window and as a repair of every family outside it.

The socket is opened in the node's network namespace: the daemon's own, or the backend's ``netns`` (tests), which
the watcher's thread enters first (``kproxy.toolkit.netns``).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kproxy.model import IPFamily
from kproxy.toolkit import netlink
from kproxy.toolkit.netns import enter_netns

log = logging.getLogger(__name__)

# include/uapi/linux/netlink.h, netfilter/nf_tables.h; what the element dumps use too is in kproxy.toolkit.netlink
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NFNLGRP_NFTABLES = 7
NFT_MSG_NEWGEN = 15
#: NFT_MSG_* that remove something (DEL*, and the DESTROY* of kernels since 6.3)
DELETIONS = frozenset({2, 5, 8, 11, 14, 20, 24, 26, 27, 28, 29, 30, 31, 32})
RULE_MSGS = frozenset({6, 8, 28})  # NEW/DEL/DESTROYRULE: the chain is NFTA_RULE_CHAIN (2)
CHAIN_MSGS = frozenset({3, 5, 27})  # NEW/DEL/DESTROYCHAIN: the chain is NFTA_CHAIN_NAME (3)
NFTA_GEN_PROC_PID = 2
NFTA_GEN_PROC_NAME = 3
NFTA_TABLE = 1  # the table's name is attribute 1 of every table, chain, rule, set, element, object, flowtable msg
NFPROTO = {1: (IPFamily.V4, IPFamily.V6), 2: (IPFamily.V4,), 10: (IPFamily.V6,)}  # inet, ipv4, ipv6
_INIT_PID_NS = "pid:[4026531836]"  # PROC_PID_INIT_INO: the kernel's pids are this process's own only in it
RCVBUF = 8 << 20


@dataclass(frozen=True, slots=True)
class Drift:
    """What a backend's kernel state is, for the drift watcher: the nf_tables ``tables`` it writes (by name, in the
    ip, ip6 or inet family); ``chains``: the prefixes of its chains when those tables are shared with others (None:
    the tables are the mode's alone); ``poll_s``: how often to run the backend's cheap check for state the kernel
    does not announce (None: never between syncs)."""

    tables: frozenset[str] = frozenset()
    chains: tuple[str, ...] | None = None
    poll_s: float | None = None

    def __post_init__(self) -> None:
        if self.poll_s is not None and self.poll_s <= 0:
            raise ValueError(f"drift poll interval {self.poll_s!r}: must be positive")


@dataclass(frozen=True, slots=True)
class Message:
    """One nf_tables notification: ``kind`` is the NFT_MSG_* number; ``body`` the attributes (read on demand)."""

    kind: int
    family: int
    portid: int
    body: bytes

    def attr(self, number: int) -> bytes | None:
        return netlink.attr(self.body, number)

    def text(self, number: int) -> str | None:
        raw = self.attr(number)
        return None if raw is None else raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    @property
    def table(self) -> str | None:
        return self.text(NFTA_TABLE)

    @property
    def chain(self) -> str | None:
        if self.kind in RULE_MSGS:
            return self.text(2)
        if self.kind in CHAIN_MSGS:
            return self.text(3)
        return None


@dataclass(frozen=True, slots=True)
class Transaction:
    """One committed nf_tables transaction, its messages one of each sort (``Assembler``), and who committed it
    (NEWGEN's pid and name)."""

    messages: tuple[Message, ...]
    pid: int
    name: str


def parse(data: bytes) -> Iterator[Message]:
    """The nf_tables messages in one datagram of the notification group (other subsystems' are skipped)."""
    for h in netlink.headers(data):
        if h.type >> 8 == netlink.NFNL_SUBSYS_NFTABLES and h.length >= netlink.NFNL_HDRLEN:
            family = data[h.at + netlink.NLMSG_HDR.size]
            yield Message(h.type & 0xFF, family, h.portid, data[h.at + netlink.NFNL_HDRLEN : h.at + h.length])


class Assembler:
    """Buffers messages until their transaction's NEWGEN (the kernel sends a transaction's messages together).

    Only the first message of each *sort* is kept: whether it deletes, its family, table and chain are all that
    ``touched`` reads of a message, so a later one of the same sort changes nothing in the judgement. kproxy's own
    full sync at 100,000 service ports sends a million element messages in transactions of up to 10,000 elements
    each; a few are kept instead of every one's body. Measured on that first full sync: 449 MB at its end with
    the watcher listening, 452 MB when it kept every message, 448 MB without a watcher (peaks 489, 491, 491)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[bool, int, str | None, str | None], Message] = {}

    def feed(self, messages: Iterable[Message]) -> Iterator[Transaction]:
        for m in messages:
            if m.kind != NFT_MSG_NEWGEN:
                self._pending.setdefault((m.kind in DELETIONS, m.family, m.table, m.chain), m)
                continue
            raw = m.attr(NFTA_GEN_PROC_PID)
            pid = struct.unpack(">I", raw)[0] if raw is not None and len(raw) == 4 else 0
            msgs, self._pending = tuple(self._pending.values()), {}
            yield Transaction(msgs, pid, m.text(NFTA_GEN_PROC_NAME) or "")

    def reset(self) -> None:
        """After lost messages: what is buffered belongs to a transaction that cannot be judged whole."""
        self._pending = {}


def touched(spec: Drift, families: Iterable[IPFamily], tx: Transaction) -> dict[IPFamily, str]:
    """The families whose declared state ``tx`` changed, each with one line saying what (empty: none)."""
    wanted = set(families)
    out: dict[IPFamily, str] = {}
    for m in tx.messages:
        fams = [f for f in NFPROTO.get(m.family, ()) if f in wanted and f not in out]
        if not fams or m.table not in spec.tables:
            continue
        if spec.chains is not None and m.kind not in DELETIONS:
            chain = m.chain
            if chain is None or not chain.startswith(spec.chains):
                continue  # someone else's object in a shared table
        what = f"{'deleted' if m.kind in DELETIONS else 'changed'} in table {m.table}" + (
            f" chain {m.chain}" if m.chain else ""
        )
        for f in fams:
            out[f] = what
    return out


def own_pid(pid: int, me: int | None = None, *, pid_ns_is_init: bool | None = None) -> bool | None:
    """Whether the task ``pid`` (a thread id, in the initial pid namespace) is this process's: True for one of its
    threads or a live child, False for a live task of someone else's, None when it cannot be told (it has exited, or
    this process is not in the initial pid namespace)."""
    me = os.getpid() if me is None else me
    if pid_ns_is_init is None:
        pid_ns_is_init = pid_namespace_is_init()
    if not pid_ns_is_init or pid <= 0:
        return None
    if os.path.exists(f"/proc/{me}/task/{pid}"):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None  # gone (or a thread of another process: not listed at the top of /proc) - cannot tell
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = stat.rpartition(b")")[2].split()
    return len(fields) > 1 and int(fields[1]) == me


def pid_namespace_is_init() -> bool:
    try:
        return os.readlink("/proc/self/ns/pid") == _INIT_PID_NS
    except OSError:
        return False


@dataclass(slots=True)
class _Window:
    """The own-write window's state, kept by the watcher thread (``depth`` is raised by the caller at once)."""

    depth: int = 0
    closing: int = 0  # ends asked for, applied by the watcher thread after draining its socket
    undecided: dict[IPFamily, str] = field(default_factory=dict)


class DriftWatcher:
    """One thread: listens to nf_tables' notifications in the node's namespace, polls on ``spec.poll_s``, and calls
    ``repair(families, why)`` (someone else changed them: a full batch is due) or ``check(families, why)`` (run the
    cheap check now). Both callbacks run in the watcher thread and must only record a request."""

    def __init__(
        self,
        spec: Drift,
        families: Iterable[IPFamily],
        *,
        repair: Callable[[frozenset[IPFamily], str], None],
        check: Callable[[frozenset[IPFamily], str], None],
        netns: str | None = None,
    ) -> None:
        self.spec = spec
        self.families = tuple(families)
        self._repair = repair
        self._check = check
        self.netns = netns
        self._lock = threading.Lock()
        self._window = _Window()
        self._assembler = Assembler()
        self._me = os.getpid()
        self._init_ns = pid_namespace_is_init()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.error: str | None = None  # why notifications are not watched (the poll and the sync period remain)
        self.transactions = 0  # judged transactions (tests, the log)
        self.repairs = 0
        self.checks = 0

    # -- the daemon's side -----------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread; returns once the socket is subscribed (or failed: ``error`` says why)."""
        self._thread = threading.Thread(target=self._run, name="kproxy-drift", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.error = f"the drift watcher did not start within {timeout:g} s"
            log.warning("%s", self.error)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @contextmanager
    def own_writes(self) -> Iterator[None]:
        """Around every kernel write of kproxy's (the runner's syncs and checks): see the module's docstring."""
        with self._lock:
            self._window.depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._window.closing += 1
            self._wake()

    # -- the thread ------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (a wake is pending anyway) or closed (stopping)

    def _open(self) -> socket.socket | None:
        if not self.spec.tables:
            return None
        try:
            if self.netns:
                enter_netns(self.netns)
            sock = netlink.netfilter_socket()
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE (root), beyond rmem_max
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            self.error = f"cannot listen to nf_tables notifications: {exc}"
            log.warning("drift: %s; repairs wait for the periodic check", self.error)
            return None

    def _run(self) -> None:
        self._sock = self._open()
        self._ready.set()
        poll = self.spec.poll_s
        next_poll = time.monotonic() + poll if poll else None
        try:
            while not self._stop.is_set():
                timeout = None if next_poll is None else max(0.0, next_poll - time.monotonic())
                fds = [self._wake_r] + ([self._sock.fileno()] if self._sock is not None else [])
                ready, _, _ = select.select(fds, [], [], timeout)
                if self._wake_r in ready:
                    self._drain_pipe()
                self._drain_socket()  # before closing a window: nothing queued during it is judged outside it
                self._close_windows()
                if next_poll is not None and time.monotonic() >= next_poll:
                    assert poll is not None
                    next_poll = time.monotonic() + poll
                    self.checks += 1
                    self._check(frozenset(self.families), "poll")
        except Exception:  # never take the daemon down: the periodic check still repairs
            log.exception("drift watcher failed; repairs wait for the periodic check")
        finally:
            if self._sock is not None:
                self._sock.close()

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    def _drain_socket(self) -> None:
        if self._sock is None:
            return
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                self._assembler.reset()
                self._judge_lost()
                continue
            self.consume(data)

    def consume(self, data: bytes) -> None:
        """One datagram of the notification group, judged (the watcher thread; tests feed captured ones)."""
        for tx in self._assembler.feed(parse(data)):
            self._judge(tx)

    def _in_window(self) -> bool:
        with self._lock:
            return self._window.depth > 0

    def _judge(self, tx: Transaction) -> None:
        hit = touched(self.spec, self.families, tx)
        if not hit:
            return
        self.transactions += 1
        own = own_pid(tx.pid, self._me, pid_ns_is_init=self._init_ns)
        if own:
            return
        why = f"{next(iter(hit.values()))} by {tx.name or '?'} (pid {tx.pid})"
        if own is None and self._in_window():
            with self._lock:
                for f in hit:
                    self._window.undecided.setdefault(f, why)
            return
        self.repairs += 1
        self._repair(frozenset(hit), why)

    def _judge_lost(self) -> None:
        why = "nf_tables notifications were lost (the socket's queue overflowed)"
        if self._in_window():
            with self._lock:
                for f in self.families:
                    self._window.undecided.setdefault(f, why)
            return
        self.repairs += 1
        self._repair(frozenset(self.families), why)

    def settle(self) -> None:
        """Apply the window ends asked for (the watcher thread does so after draining its socket)."""
        self._close_windows()

    def _close_windows(self) -> None:
        with self._lock:
            w = self._window
            if not w.closing:
                return
            w.depth -= w.closing
            w.closing = 0
            if w.depth > 0 or not w.undecided:
                return
            undecided, w.undecided = w.undecided, {}
        self.checks += 1
        self._check(frozenset(undecided), next(iter(undecided.values())))
