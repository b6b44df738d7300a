"""The periodic read-back of a backend's kernel state, off the sync path.

A mode that trusts its own memory of what it wrote between read-backs (the bpf mode: a full batch there adopts from
kproxy's index of the maps) still reads the whole kernel back now and then (``readback_due``), to put back what
someone edited in place. Done as a full batch, that read-back sat on the sync path: at 100,000 service ports a due
read-back turned the next sync, whatever changed, into a read and decode of every map entry (seconds), so an
endpoint change that arrived then waited seconds to be programmed. Here the daemon reads the kernel in a thread of
its own while syncs go on, and compares it with what the ledger records; only a difference asks for a full batch.

How one read stays honest while partial syncs change the kernel under it:

1. *Begin*, between syncs (the daemon's sync lock held): the family's record starts noting every service a partial
   batch writes or removes (``FamilyRecord.touched``, with the fragment it held before), and the count of full
   batches is taken.
2. *Read*, no lock held: the backend's ``verify_view`` (the same read ``kproxy verify`` uses: the kernel, never the
   backend's memory). Syncs go on meanwhile.
3. *Finish*, between syncs again: the applied fragments and the touched services are copied and the noting stops.
   A full batch that ran meanwhile adopted the kernel itself: nothing is compared. Otherwise every applied service
   that no batch touched must be held exactly (``verify_service``; services the kernel refused are left to their
   retries), and nothing may be held that no service accounts for, where a touched service accounts for both its
   versions (``verify_extra`` with the applied fragments, and again with the touched services' earlier ones: what
   neither explains is foreign). A sync runs its apply and its commit under the sync lock, so the copy never sees
   a batch half recorded.

Reads are paced (``paced``): at most ``SHARE`` of the time goes to them, so at 100,000 service ports (a read of
~4 s in the bpf mode) an edit in place is found within minutes rather than the backend's 25 s, as upstream's full
resync (an hour by default) bounds its own repairs of what it cannot see.

A service that changes in every read's window is never compared (its view is stale by construction); what someone
edited in place there is put back by the next full batch that adopts from the kernel: the periodic full sync
(``full_sync_period``: an hour, upstream's FullSyncPeriod), since by then the backend's last read is old.

The outcome goes to the backend (``kernel_read``: clean, it may trust its memory for another interval; not clean,
its next full batch adopts from the kernel) and, when the kernel differs, to ``repair`` (the daemon's drift repair:
a full batch of the family, counted in the drift metrics). The comparison costs a read and a ``verify_service`` per
service in this thread; it writes nothing. Without a read-behind (tests, benchmarks) the ledger keeps the old way:
a due read-back makes the next batch a full one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic

from kproxy.batch import A, C, F, S, V
from kproxy.gcpause import collector_paused
from kproxy.ledger import Ledger
from kproxy.model import IPFamily, ServicePortName
from kproxy.toolkit.keys import service_key

log = logging.getLogger(__name__)

#: how often the thread asks the backend whether a read-back is due (seconds)
POLL_S = 1.0
#: differences named in the log per read (the rest are counted)
LOGGED = 5
#: services compared between two offers of the GIL to the sync thread (a few milliseconds of comparing)
YIELD_EVERY = 256
#: the share of the time reads may take (``paced``). A read cannot give the GIL away everywhere: a backend's decode
#: of its maps runs stretches of C-level loops that hold it (the bpf mode's: seconds at 100,000 service ports), and
#: a sync that falls due meanwhile waits. Bounding the share bounds how many changes meet such a wait.
SHARE = 0.01
#: before a family's first read, its cost is guessed per applied service port (the bpf mode's, measured at 10
#: endpoints: ~40 us)
GUESS_S_PER_PORT = 40e-6

Repair = Callable[[frozenset[IPFamily], str], None]


@dataclass(slots=True)
class Read(Generic[C, V]):
    """One read-back of one family in progress."""

    family: IPFamily
    context: C
    full_batches: int
    started: float  # monotonic
    view: V | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one read found. ``compared``: False when a full batch ran meanwhile or the family had nothing applied
    (nothing was concluded); ``differences``: one line each (empty: the kernel holds what the ledger records)."""

    family: IPFamily
    compared: bool
    differences: tuple[str, ...] = ()
    skipped: int = 0  # services a partial batch touched while the read ran, or the kernel refused


class ReadBehind(Generic[F, C, A, V, S]):
    """Serves ``ledger.backend.readback_due`` in a thread of its own (see the module docstring). ``between_syncs``
    is the lock the daemon holds around every sync; ``repair`` asks for a full batch of families."""

    def __init__(
        self,
        ledger: Ledger[F, C, A, V, S],
        between_syncs: contextlib.AbstractContextManager[object],
        repair: Repair,
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.ledger = ledger
        self._between = between_syncs
        self._repair = repair
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reads = 0  # completed reads that compared
        self.repairs = 0  # reads that found the kernel different
        self.last_s = 0.0  # seconds the last whole read took
        self._last: dict[IPFamily, float] = {}  # per family: when its last read began (``paced``)
        self._cost: dict[IPFamily, float] = {}  # per family: what its last read took, or the guess before one

    # -- one read, in steps (the thread runs them in order; tests interleave syncs between them) -------------

    def begin(self, family: IPFamily) -> Read[C, V] | None:
        """Step 1 (takes the sync lock): start noting the services partial batches touch. None when the family has
        nothing applied (its next sync is a full batch that adopts anyway)."""
        rec = self.ledger.records[family]
        with self._between, rec.lock:
            if rec.context is None or rec.need_full:
                return None
            rec.touched = {}
            return Read(family, rec.context, rec.full_batches, time.monotonic())

    def read(self, r: Read[C, V]) -> None:
        """Step 2 (no lock): read the kernel through the backend's ``verify_view``."""
        backend = self.ledger.backend
        try:
            view = backend.verify_view(r.family, r.context)
        except Exception as exc:  # a read that fails is a finding, not a crash of the thread
            r.error = f"reading the kernel failed: {type(exc).__name__}: {exc}"
            return
        problem = "the mode cannot read its kernel state back" if view is None else backend.verify_error(view)
        if problem:
            r.error = problem
        r.view = view

    def finish(self, r: Read[C, V]) -> Outcome:
        """Step 3 (takes the sync lock to copy, compares without it): what the read found; tells the backend and,
        when the kernel differs, asks for a repair."""
        rec = self.ledger.records[r.family]
        with self._between, rec.lock:
            touched, rec.touched = rec.touched, None
            overlapped = rec.full_batches != r.full_batches or rec.context != r.context or rec.need_full
            applied = dict(rec.fragments)
            failed = set(rec.failed)
        if overlapped or touched is None:
            return Outcome(r.family, compared=False)
        if r.error is not None or r.view is None:
            found: tuple[str, ...] = (r.error or "no view",)
            skipped = 0
        else:
            found, skipped = self._compare(r.view, applied, touched, failed)
        with self._between:  # between syncs: an apply takes the backend's read time away and puts it back
            self.ledger.backend.kernel_read(r.family, None if found else r.started)
        self.reads += 1
        if found:
            self.repairs += 1
            shown = "; ".join(found[:LOGGED]) + (f" (and {len(found) - LOGGED} more)" if len(found) > LOGGED else "")
            log.warning("read-back of %s: the kernel differs from what kproxy wrote: %s", r.family.value, shown)
            self._repair(frozenset({r.family}), f"the periodic read-back found {len(found)} differences")
        return Outcome(r.family, compared=True, differences=found, skipped=skipped)

    def _compare(
        self,
        view: V,
        applied: Mapping[ServicePortName, F],
        touched: Mapping[ServicePortName, list[F | None]],
        failed: set[ServicePortName],
    ) -> tuple[tuple[str, ...], int]:
        backend = self.ledger.backend
        found: list[str] = []
        skipped = 0
        for i, (spn, frag) in enumerate(applied.items()):
            if not i % YIELD_EVERY:
                time.sleep(0)  # the GIL to a waiting sync now, not after the interpreter's switch interval
            if spn in touched or spn in failed:
                skipped += 1
                continue
            why = backend.verify_service(view, spn, frag)
            if why is not None:
                found.append(f"{service_key(spn)}: {why}")
        extra = backend.verify_extra(view, applied)
        # what an earlier version of a touched service explains is not foreign: the k-th layer lays every touched
        # service's k-th earlier version over the applied ones, and a line stays only while every layer has it
        depth = max(map(len, touched.values()), default=0)
        for k in range(depth):
            if not extra:
                break
            layer = {spn: versions[k] for spn, versions in touched.items() if k < len(versions)}
            earlier = {**applied, **{spn: f for spn, f in layer.items() if f is not None}}
            seen = set(backend.verify_extra(view, earlier))
            extra = [line for line in extra if line in seen]
        found += extra
        return tuple(found), skipped

    def once(self, family: IPFamily) -> Outcome | None:
        """One whole read of ``family`` now (None: nothing applied to compare with)."""
        r = self.begin(family)
        if r is None:
            return None
        out: Outcome | None = None
        try:
            # the read and the comparison allocate a few objects per map entry: without the shared pause the
            # collector would walk them again and again, stalling the sync thread too (it holds the GIL meanwhile)
            with collector_paused(True):
                self.read(r)
                out = self.finish(r)
            return out
        except BaseException:
            rec = self.ledger.records[family]
            with rec.lock:
                rec.touched = None  # never left noting for a read that will not finish
            raise
        finally:  # a read that failed is paced too: it must not run again at every poll
            self.last_s = time.monotonic() - r.started
            self._done(family, r.started, self.last_s)
            found = "failed" if out is None else f"{len(out.differences)} differences"
            log.debug("read-back of %s: %.2f s, %s", family.value, self.last_s, found)

    def paced(self, family: IPFamily, now: float) -> bool:
        """Whether a due read of ``family`` may start now: at most ``SHARE`` of the time goes to reading, so the
        next read starts no sooner than its last one's cost / ``SHARE`` after that one began. Before the first
        read, the cost is guessed from the table's size (``GUESS_S_PER_PORT``), counted from the moment the backend
        first said a read was due."""
        last = self._last.get(family)
        if last is None:
            last = self._last[family] = now
            self._cost[family] = len(self.ledger.records[family].fragments) * GUESS_S_PER_PORT
        return now - last >= self._cost.get(family, 0.0) / SHARE

    def _done(self, family: IPFamily, started: float, cost: float) -> None:
        self._last[family], self._cost[family] = started, cost

    # -- the thread -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self.ledger.read_behind = True
        self._thread = threading.Thread(target=self._loop, name="kproxy-read-behind", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.ledger.read_behind = False

    def _loop(self) -> None:
        backend = self.ledger.backend
        while not self._stop.wait(self._poll_s):
            for fam in self.ledger.families:
                if self._stop.is_set():
                    return
                try:
                    if backend.readback_due(fam) and self.paced(fam, time.monotonic()):
                        self.once(fam)
                except Exception:  # the thread must outlive one bad read; the next poll tries again
                    log.exception("read-back of %s failed", fam.value)
