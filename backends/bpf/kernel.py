"""The bpf mode talking to the kernel: executing a plan's steps with batched ``bpf(2)`` calls (a large batch's puts
written by a second thread while the next chunk is planned), the maps one kproxy holds open and the check that they
are still the pinned ones, reading the maps back, and the benchmark's floors.

The maps' byte layouts and the raw ``bpf(2)`` commands are ``maps``; compiling and attaching the programs is
``loader``; the companion table is ``companion``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from kproxy.model import IPFamily
from kproxy.toolkit.switching import switch_interval

from . import loader, maps, objects

log = logging.getLogger(__name__)

Step = tuple[str, str, Sequence[bytes], Sequence[bytes]]  # (map role, "put" or "del", keys, values)
#: the maps a sync reads and writes (the LRU maps belong to the programs alone)
SYNC_ROLES: tuple[str, ...] = ("svc", "be", "name")
#: while a writer thread runs, the interpreter's switch interval (Python's default: 0.005 s). Why: the writer thread
#: needs the GIL back after every ``bpf(2)`` call (each releases it) while the sync thread plans; at the default 5 ms a
#: write waits that long for its turn, which doubled the writer's time (0.2 s of waits for 0.25 s of writes at
#: 10,000 x 10) and made the pipeline slower than no pipeline. Lowered only while the pipeline runs
#: (``kproxy.toolkit.switching``).
WRITER_SWITCH_INTERVAL = 0.0005


class Writer:
    """One thread writing put phases in the order they are submitted; after a failed write it skips the rest (the
    first error is raised by ``finish``). Use as a context manager: the switch interval is lowered only inside."""

    def __init__(self, fds: Mapping[tuple[str, IPFamily], int], family: IPFamily) -> None:
        self._fds, self._family = fds, family
        self._queue: queue.SimpleQueue[list[Step] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._busy = 0.0
        self._thread = threading.Thread(target=self._run, name="bpf-map-writer", daemon=True)
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> Writer:
        self._scope.enter_context(switch_interval(WRITER_SWITCH_INTERVAL))
        try:
            self._thread.start()
        except BaseException:
            self._scope.close()  # the interval as found: __exit__ does not run when __enter__ raises
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._scope.close()

    def submit(self, steps: list[Step]) -> None:
        self._queue.put(steps)

    def _run(self) -> None:
        while (steps := self._queue.get()) is not None:
            if self._error is not None:
                continue
            t0 = time.perf_counter()
            try:
                for role, _op, keys, values in steps:
                    maps.update_batch(self._fds[(role, self._family)], keys, values)
            except BaseException as exc:  # handed to the sync thread by finish()
                self._error = exc
            self._busy += time.perf_counter() - t0

    def finish(self) -> float:
        """Wait for every submitted write; the seconds spent writing. Raises the first write error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._busy


def run_steps(fds: Mapping[str, int], family: IPFamily, steps: Iterable[Step]) -> None:
    """Execute a plan's steps on the maps ``fds`` (role -> fd): puts as batch updates; deletes as batch deletes, of
    the backend array and the counters as all-zero values (an array refuses deletes; zero is "no backend" to the
    programs)."""
    for role, op, keys, values in steps:
        fd = fds[role]
        if op == "put":
            maps.update_batch(fd, keys, values)
        elif role == "be":
            maps.update_batch(fd, keys, maps.zero_values(len(keys), maps.key_sizes(family)["be"][1]))
        elif role == maps.COUNTER_ROLE:  # an array too: a counter goes to zero
            maps.update_batch(fd, keys, maps.zero_values(len(keys), maps.COUNTER_VALUE.size))
        else:
            _delete(fd, keys)


def _delete(fd: int, keys: Sequence[bytes]) -> None:
    try:
        maps.delete_batch(fd, keys)
    except maps.BpfError as exc:
        if exc.errno != errno.ENOENT:
            raise
        # the batch stops at a key that is already gone (a half-applied earlier round): one by one
        for k in keys:
            try:
                maps.delete_batch(fd, [k])
            except maps.BpfError as e:
                if e.errno != errno.ENOENT:
                    raise


class OpenMaps:
    """The pinned maps one kproxy holds open (role, family) -> fd, and the check that they are still the pinned ones.
    A map someone unpinned stays alive while an fd holds it: such fds are retired (closed once nothing reads them)
    and the pins made again."""

    def __init__(
        self,
        where: Callable[[], loader.Places],
        on_first_open: Callable[[loader.Places], None],
        counters: bool = False,
    ) -> None:
        self._where = where
        self._on_first_open = on_first_open
        #: the maps a sync writes: with ``--service-counters`` the counters too (zeroed with each new backend)
        self.sync_roles = (*SYNC_ROLES, maps.COUNTER_ROLE) if counters else SYNC_ROLES
        self.fds: dict[tuple[str, IPFamily], int] = {}
        self._held_ids: dict[tuple[str, IPFamily], int] = {}
        self._retired: list[int] = []

    def ensure(self, families: Iterable[IPFamily], every: bool = False) -> None:
        """Open (or create and pin) the maps syncs use, of ``families``; ``every``: all maps of both families, as
        the programs need them (``start``). A benchmark never pays for the LRU maps' preallocation. Without
        counters, ``every`` unpins counter maps an earlier kproxy left (counting again later starts from zero)."""
        counting = maps.COUNTER_ROLE in self.sync_roles
        roles = (*maps.ROLES, maps.COUNTER_ROLE) if counting else maps.ROLES
        want = (
            [(r, f) for f in (IPFamily.V4, IPFamily.V6) for r in roles]
            if every
            else [(r, f) for f in families for r in self.sync_roles]
        )
        if every and not counting:
            for f in (IPFamily.V4, IPFamily.V6):
                self._where().pin(maps.COUNTER_ROLE, f).unlink(missing_ok=True)
        missing = [k for k in want if k not in self.fds]
        if not missing:
            return
        p = self._where()
        if not self.fds:
            loader.ensure_places(p)
            self._on_first_open(p)
        for role, fam in missing:
            self.fds[(role, fam)] = loader.open_or_create(p, role, fam)

    def family_fds(self, family: IPFamily) -> dict[str, int]:
        return {role: self.fds[(role, family)] for role in self.sync_roles}

    def close_retired(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()

    @property
    def retired(self) -> bool:
        return bool(self._retired)

    def lost(self, pinned: Mapping[tuple[str, IPFamily], int]) -> list[tuple[str, IPFamily]]:
        """The maps held whose pin is gone or names another map now (``pinned``: ``loader.pinned_ids``); when some
        are, every held fd is retired: the caller opens (and pins) them all again."""
        for k, fd in self.fds.items():
            if k not in self._held_ids:
                self._held_ids[k] = objects.map_id(fd)
        lost = sorted({k for k, i in self._held_ids.items() if pinned.get(k) != i}, key=str)
        if lost:
            self._retired += self.fds.values()
            self.fds.clear()
            self._held_ids.clear()
        return lost

    def close(self) -> None:
        for fd in [*self.fds.values(), *self._retired]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self._retired.clear()
        self._held_ids.clear()


def read_maps(fds: Mapping[str, int], family: IPFamily) -> dict[str, tuple[bytes, bytes]]:
    """The service, backend and names maps raw (``maps.read_lb``)."""
    return maps.read_lb(fds["svc"], fds["be"], fds["name"], family)


def read_pinned(p: loader.Places, family: IPFamily) -> tuple[dict[str, tuple[bytes, bytes]], list[str]]:
    """What the pins hold now, read through fds of its own (never kproxy's: those keep a map alive after someone
    unpinned it); and the pins that are missing. Read-only; any thread."""
    raw: dict[str, tuple[bytes, bytes]] = {role: (b"", b"") for role in SYNC_ROLES}
    gone = []
    fds: dict[str, int] = {}
    try:
        for role in SYNC_ROLES:
            try:
                fds[role] = maps.obj_get(str(p.pin(role, family)))
            except FileNotFoundError:
                gone.append(maps.pin_name(role, family))
        if not gone:
            raw = read_maps(fds, family)
        elif "svc" in fds and "name" in fds:  # the backend array gone: what the service map still says
            ks = maps.key_sizes(family)
            raw.update(svc=maps.lookup_raw(fds["svc"], *ks["svc"]), name=maps.lookup_raw(fds["name"], *ks["name"]))
    finally:
        for fd in fds.values():
            os.close(fd)
    return raw, gone


def floor_full(family: IPFamily, steps: list[Step], map_size: int) -> float:
    """A full sync's exact map writes (same batches, same order) into fresh empty maps of the same shape: the
    kernel's own time for that payload."""
    roles = dict.fromkeys([*SYNC_ROLES, *(role for role, *_ in steps)])  # the counters too, when the steps write them
    fds = {role: maps.create_like(role, family, map_size) for role in roles}
    try:
        t0 = time.perf_counter()
        run_steps(fds, family, steps)
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def floor_partial(fds: Mapping[str, int], steps: list[Step]) -> float:
    """A partial sync's puts again, into the maps as they are (rewriting the same bytes)."""
    t0 = time.perf_counter()
    for role, op, keys, values in steps:
        if op == "put":
            maps.update_batch(fds[role], keys, values)
    return time.perf_counter() - t0
