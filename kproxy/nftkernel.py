"""libnftables for the modes that speak nftables (the nftables mode, the userspace mode's redirect table, the bpf
mode's companion table): one context per worker, transactions from a memfd, JSON reads, network-namespace entry.

One ``Nft.run(text)`` is one ``nft_run_cmd_from_file`` call of Debian's python3-nftables: the whole text is one
atomic transaction, as ``nft -f``, without starting a process per command (docs/PERFORMANCE.md, "The core"). The
text goes through a memfd "file" because libnftables names a refused command's line only for file input (from a
buffer it prints the first line), and the backends map that line back to the service that owns it.
Reads use JSON output (``libnftables-json(5)``), parsed with the standard library; ``kproxy.toolkit.nft`` turns
set and map elements into text.

Threads and namespaces: libnftables talks netlink from the calling thread's network namespace, and a context's socket
belongs to the namespace it was opened in. ``Nft(netns="name")`` owns one worker thread that first ``setns``es into
``/run/netns/<name>`` (tests and benchmarks aim at namespaces of their own; ``setns`` moves that thread alone).
``Nft()`` also has a worker thread by default, in the caller's namespace: libnftables releases the GIL, so a backend
builds its next transaction while one is applied. ``Nft(worker=False)`` calls in the caller's thread, with one
context per process shared under a lock (the userspace mode opens it before any proxy socket, see below).
``Nft.call(fn)`` runs any function where the context lives (the userspace mode makes its proxy sockets there).

Descriptors: libnftables 1.0.6 waits for netlink answers with ``select()``, which aborts the process ("bit out of
range 0 - FD_SETSIZE") when its socket's descriptor is 1024 or above. The userspace mode holds thousands of
descriptors, so every context here is opened on a low descriptor freed for it from a small reserve. Nothing is opened
at import: the reserve is taken when the process opens its first context (the userspace mode does that before its
first proxy socket), and ``HANDLES.close()`` gives the reserve and the process's shared context back.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kproxy.toolkit.netns import enter_netns

T = TypeVar("T")
_LOCATION = re.compile(r"^(?:/dev/stdin|internal|<cmdline>|[^:\s]*):(\d+):\d+", re.M)


@dataclass(frozen=True, slots=True)
class Result:
    """What one libnftables call returned: rc 0 is success; ``seconds`` is the call's wall time."""

    rc: int
    output: str
    error: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def error_lines(self) -> list[int]:
        """1-based lines of the input the error names (libnftables reports each refused command's location)."""
        return [int(m.group(1)) for m in _LOCATION.finditer(self.error)]


def import_nftables() -> Any:
    """The ``nftables`` module (Debian's python3-nftables; the venv sees it through --system-site-packages)."""
    import nftables  # type: ignore[import-not-found,unused-ignore]

    return nftables


def available() -> str | None:
    """None when libnftables loads and lists tables here, else why not (with the packages to install)."""
    try:
        nftables = import_nftables()
    except ImportError as exc:
        return f"python3-nftables is not importable ({exc}): apt-get install python3-nftables nftables"
    try:
        # flowtables, not tables: libnftables 1.0.6 fetches every rule of every table for `list tables` (costly beside
        # another mode's large tables, docs/PERFORMANCE.md "The core"), only tables for this
        rc, _, err = nftables.Nftables().cmd("list flowtables")
    except OSError as exc:
        return f"libnftables cannot be loaded: {exc}"
    if rc != 0:
        return f"nft list flowtables failed: {str(err).strip()}"
    return None


class KernelHandles:
    """The process's own libnftables handles: the reserve of low descriptors and the one shared context of
    ``Nft(worker=False)``. Nothing is opened until first use; ``close`` gives both back (and the next use opens them
    again)."""

    RESERVE = 8

    def __init__(self) -> None:
        self._reserved: list[int] = []
        self._filled = False  # the reserve is taken once, at the first context; later refills follow closes
        self._reserve_lock = threading.Lock()
        self._shared: Any = None
        #: held while the shared context is in use: one caller at a time
        self.shared_lock = threading.Lock()

    def _refill_locked(self) -> None:
        while len(self._reserved) < self.RESERVE:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if fd >= 1000:
                os.close(fd)
                break
            self._reserved.append(fd)
        self._filled = True

    def refill(self) -> None:
        """Take the reserve back up to its size (a context closed: its low descriptor is free again)."""
        with self._reserve_lock:
            self._refill_locked()

    def new_context(self) -> Any:
        """A libnftables context whose netlink socket (opened right away) takes a low descriptor freed for it."""
        with self._reserve_lock:
            if not self._filled:
                self._refill_locked()
            if self._reserved:
                os.close(self._reserved.pop(0))
            ctx = import_nftables().Nftables()
        ctx.set_handle_output(False)
        return ctx

    def shared(self) -> Any:
        """The process's shared context, opened on first use; the caller holds ``shared_lock``."""
        if self._shared is None:
            self._shared = self.new_context()
        return self._shared

    def close(self) -> None:
        """Drop the shared context (its socket closes with it) and close the reserved descriptors."""
        with self.shared_lock:
            self._shared = None
        with self._reserve_lock:
            while self._reserved:
                os.close(self._reserved.pop())
            self._filled = False


HANDLES = KernelHandles()


def new_context() -> Any:
    """A libnftables context on a low descriptor (see ``KernelHandles.new_context``)."""
    return HANDLES.new_context()


class Nft:
    """A libnftables context in this namespace or in a named one (see the module docstring)."""

    def __init__(self, netns: str | None = None, *, worker: bool = True, name: str = "nft") -> None:
        self.netns = netns
        self._ctx: Any = None
        self._pool: ThreadPoolExecutor | None = None
        if netns is not None or worker:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            if netns is not None:
                self._pool.submit(enter_netns, netns).result()
        self._closed = False

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._closed:
            raise RuntimeError("libnftables context closed")
        if self._pool is None:
            fut: Future[T] = Future()
            try:
                with HANDLES.shared_lock:  # the process's shared context: one caller at a time
                    fut.set_result(fn())
            except BaseException as exc:  # handed to the caller through the future, as a worker would
                fut.set_exception(exc)
            return fut
        return self._pool.submit(fn)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` where the context lives (the worker thread, in the namespace), and return what it returns."""
        return self._submit(fn).result()

    def later(self, fn: Callable[[], T]) -> Future[T]:
        """``call`` without waiting: the caller works meanwhile (calls queued after it wait for it)."""
        return self._submit(fn)

    def ready(self) -> None:
        """Open the context now (the userspace mode does it before any proxy socket exists)."""
        self.call(self._nft)

    def _nft(self) -> Any:
        if self._pool is None:
            return HANDLES.shared()
        if self._ctx is None:  # made in the thread that uses it (its socket belongs to that namespace)
            self._ctx = HANDLES.new_context()
        return self._ctx

    def run(self, text: str, *, json_output: bool = False) -> Result:
        """Run commands as one transaction (when they change anything) and wait for the answer."""
        return self.submit(text, json_output=json_output).result()

    def submit(self, text: str, *, json_output: bool = False) -> Future[Result]:
        """``run`` without waiting: the caller builds the next transaction meanwhile (see the module docstring)."""

        def go() -> Result:
            nft = self._nft()
            nft.set_json_output(json_output)
            fd = os.memfd_create("kproxy-nft", os.MFD_CLOEXEC)
            try:
                view = memoryview(text.encode())
                while view:
                    view = view[os.write(fd, view) :]
                t0 = time.perf_counter()
                rc, out, err = nft.cmd_from_file(f"/proc/self/fd/{fd}")
                return Result(int(rc), out or "", err or "", time.perf_counter() - t0)
            finally:
                os.close(fd)

        return self._submit(go)

    def query(self, text: str, *, json_output: bool = True, terse: bool = False) -> Result:
        """A read (``list ...``) from a buffer: no transaction, nothing to map back. ``terse``: the answer leaves set
        and map elements out (``nft -t``; libnftables 1.0.6 still fetches them, so ``rule_comments`` is the cheap way
        to read rules)."""

        def go() -> Result:
            nft = self._nft()
            nft.set_json_output(json_output)
            nft.set_terse_output(terse)
            try:
                t0 = time.perf_counter()
                rc, out, err = nft.cmd(text)
                return Result(int(rc), out or "", err or "", time.perf_counter() - t0)
            finally:
                nft.set_terse_output(False)

        return self.call(go)

    def read(self, command: str, *, terse: bool = False) -> tuple[list[dict[str, Any]] | None, str]:
        """A ``list ...`` command's JSON objects (the ``nftables`` array without metainfo), or (None, error)."""
        res = self.query(command, terse=terse)
        if not res.ok:
            return None, res.error.strip()
        try:
            data = json.loads(res.output) if res.output else {"nftables": []}
        except ValueError as exc:
            return None, f"unreadable JSON from libnftables: {exc}"
        return [o for o in data.get("nftables", []) if "metainfo" not in o], ""

    def rule_comments(self, family: str, table: str) -> tuple[dict[str, list[str | None]] | None, str]:
        """Every rule of ``table`` (family ``ip`` or ``ip6``), chain -> the rules' comments in order (None for a rule
        without one), or (None, error). Read with one netlink rule dump (pyroute2), where the namespace's context
        lives: libnftables' ``list chain`` fetches every set element of the table first, a rule dump carries none
        (docs/PERFORMANCE.md, "The core"). Chains without rules are not in the answer."""

        def go() -> dict[str, list[str | None]]:
            from pyroute2.nftables.main import NFTables

            nl = NFTables(nfgen_family=socket.AF_INET6 if family == "ip6" else socket.AF_INET)
            try:
                out: dict[str, list[str | None]] = {}
                for msg in nl.get_rules():
                    if msg.get_attr("NFTA_RULE_TABLE") != table:
                        continue
                    data = msg.get_attr("NFTA_RULE_USERDATA")
                    comment = data.decode(errors="replace") if isinstance(data, bytes) else data
                    out.setdefault(str(msg.get_attr("NFTA_RULE_CHAIN")), []).append(
                        comment if isinstance(comment, str) else None
                    )
                return out
            finally:
                nl.close()

        try:
            return self.call(go), ""
        except Exception as exc:  # noqa: BLE001 - any failure of the read is reported as the read's error
            return None, f"netlink rule dump of {family} {table}: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._ctx is not None:
            self._ctx = None  # its socket closes with it: a low descriptor goes back to the reserve
            HANDLES.refill()
